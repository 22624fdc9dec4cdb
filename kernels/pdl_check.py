"""Check, without a GPU, that every decode kernel compiled with USE_PDL follows kernels/pdl.py's rule in
the code ptxas gets: `griddepcontrol.wait` comes before any store and before any global load except the
dense GEMV's first weight tile, `griddepcontrol.launch_dependents` right after it, and nothing of the
kind is compiled without USE_PDL.

    python -m kernels.pdl_check [--arch 90]

One line per kernel, exit 1 on a violation; SKIP and exit 0 where this triton cannot compile ahead of
time (kernels.compile_driver) or has no gdc_wait.
"""
from __future__ import annotations

import argparse
import re
import sys


def _cases() -> list[tuple[str, object, dict, dict, bool]]:
    """(name, kernel, signature, constexprs, loads its weights before the wait)."""
    from kernels.decode_attention import triton_kernels as attn
    from kernels.dense_gemv import triton_kernels as gemv
    from kernels.dense_gemv.compile_check import _cases as gemv_cases
    from kernels.moe_decode import triton_kernels as moe
    from kernels.moe_decode.compile_check import _cases as moe_cases

    picked = []
    for module, cases, names in (
            (gemv, gemv_cases(), {"qkv / o_proj / router 1x2048 T=1 (the default)", "split-K sum",
                                  "4x1024 T=3 ragged K"}),
            (moe, moe_cases(), {"gate_up 4x512 2-D even (the default)", "gate_up 4x512 2-D split: routes in the plan",
                                "down 16x256 per-step even", "sum over k", "add + rms_norm",
                                "q/k norm + rope + KV write", "route softmax/top-k/renorm"})):
        for name, attr, sig, consts, _opts, _div in cases:
            if name in names:
                picked.append((name, getattr(module, attr), sig, consts, attr == "linear_gemv_kernel"))
    f32 = "*fp32"
    split_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "rows_ptr": "*i64", "seq_lens_ptr": "*i32",
                 "m_ptr": f32, "l_ptr": f32, "acc_ptr": f32, "stride_qt": "i32", "stride_qh": "i32",
                 "stride_kb": "i64", "stride_ks": "i32", "stride_kh": "i32", "stride_vb": "i64", "stride_vs": "i32",
                 "stride_vh": "i32", "scale": "fp32", "bucket": "i32", "window": "i32", "chunk": "i32"}
    split_consts = dict(NUM_SPLITS=8, G=8, GP=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, HAS_WINDOW=False,
                        USE_DOT=True, IS_FP32=False)
    merge_sig = {"m_ptr": f32, "l_ptr": f32, "acc_ptr": f32, "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
                 "bucket": "i32", "window": "i32", "chunk": "i32"}
    merge_consts = dict(NUM_SPLITS=8, SPLITS_P2=8, HEAD_DIM=128, BLOCK_D=128, HAS_WINDOW=False)
    for name, fn, sig, consts in (("decode attention split", attn.decode_attn_split_kernel, split_sig, split_consts),
                                  ("decode attention merge", attn.decode_attn_merge_kernel, merge_sig, merge_consts)):
        picked.append((name, fn, {**sig, **{k: "constexpr" for k in consts}}, consts, False))
    return picked


def _first(ptx: str, pattern: str) -> int:
    m = re.search(pattern, ptx)
    return m.start() if m else -1


def check_ptx(ptx: str, use_pdl: bool, weights_first: bool) -> list[str]:
    """What breaks the rule in one kernel's PTX (empty: nothing)."""
    wait = _first(ptx, r"griddepcontrol\.wait")
    launch = _first(ptx, r"griddepcontrol\.launch_dependents")
    if not use_pdl:
        return [] if wait < 0 and launch < 0 else ["griddepcontrol compiled without USE_PDL"]
    problems = []
    if wait < 0 or launch < 0:
        return ["no griddepcontrol.wait / launch_dependents with USE_PDL"]
    if launch < wait:
        problems.append("launch_dependents before the wait")
    store = _first(ptx, r"\bst\.global")
    if 0 <= store < wait:
        problems.append("a global store before the wait")
    load = _first(ptx, r"\bld\.global")
    if weights_first and not 0 <= load < wait:
        problems.append("no weight load in flight before the wait")
    if not weights_first and 0 <= load < wait:
        problems.append("a global load before the wait")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the PDL wait order of the decode kernels, in their PTX")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    from kernels.compile_driver import cannot_compile_ahead
    skip = cannot_compile_ahead()
    if skip:
        print(f"SKIP: {skip}")
        return 0
    from kernels.pdl import _triton_has_gdc
    if not _triton_has_gdc():
        print("SKIP: this triton has no tl.extra.cuda.gdc_wait")
        return 0
    from kernels.slot_cache.ptx_check import compile_for_arch

    failed = total = 0
    for name, fn, sig, consts, weights_first in _cases():
        for use_pdl in (False, True):
            total += 1
            try:
                kernel = compile_for_arch(fn, {**sig, "USE_PDL": "constexpr"}, {**consts, "USE_PDL": use_pdl},
                                          args.arch)
                problems = check_ptx(kernel.asm["ptx"], use_pdl, weights_first)
            except Exception as exc:                                      # report every failure
                problems = [f"{type(exc).__name__}: {exc}"]
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {name}, USE_PDL={use_pdl}"
                  + (": " + "; ".join(problems) if problems else ""), flush=True)
    print(f"{total - failed} compiled, {failed} failed (sm_{args.arch})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
