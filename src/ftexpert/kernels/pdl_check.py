"""Check, without a GPU, that every decode kernel compiled with USE_PDL follows kernels/pdl.py's rule in
the code ptxas gets, for every compile_check case as launched (warps, 16-byte alignment): `griddepcontrol.wait`
comes before any store, atomic, async copy and global load except the dense GEMV's first weight tile (the
GEMV's loads before the wait must be as many at T = 1, 2, 4 and 16: an x row's loads would grow with T),
`griddepcontrol.launch_dependents` right after it, and nothing of the kind is compiled without USE_PDL.

    python -m ftexpert.kernels.pdl_check [--arch 90]

One line per kernel, exit 1 on a violation; SKIP and exit 0 where this triton cannot compile ahead of
time (kernels.compile_driver) or has no gdc_wait.
"""
from __future__ import annotations

import argparse
import re
import sys

from ftexpert.kernels.compile_driver import cannot_compile_ahead
from ftexpert.kernels.decode_attention import triton_kernels as attn
from ftexpert.kernels.dense_gemv import triton_kernels as gemv
from ftexpert.kernels.dense_gemv.compile_check import _cases as gemv_cases
from ftexpert.kernels.moe_decode import triton_kernels as moe
from ftexpert.kernels.moe_decode.compile_check import _cases as moe_cases
from ftexpert.kernels.pdl import _triton_has_gdc
from ftexpert.kernels.slot_cache.ptx_check import compile_for_arch


def _cases() -> list[tuple[str, object, dict, dict, dict, list[str], bool]]:
    """(name, kernel, signature, constexprs, compile options, 16-divisible args, loads its weights before
    the wait): every case of the two compile_check modules, as launched, and the attention kernels."""
    picked = []
    for module, cases in ((gemv, gemv_cases()), (moe, moe_cases())):
        for name, attr, sig, consts, opts, div in cases:
            picked.append((name, getattr(module, attr), sig, consts, opts, div, attr == "linear_gemv_kernel"))
    f32 = "*fp32"
    split_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i32", "rows_ptr": "*i64", "seq_lens_ptr": "*i32",
                 "m_ptr": f32, "l_ptr": f32, "acc_ptr": f32, "stride_qt": "i32", "stride_qh": "i32",
                 "stride_kb": "i64", "stride_ks": "i32", "stride_kh": "i32", "stride_vb": "i64", "stride_vs": "i32",
                 "stride_vh": "i32", "stride_tb": "i32", "scale": "fp32", "bucket": "i32", "window": "i32", "chunk": "i32"}
    split_consts = dict(NUM_SPLITS=8, G=8, GP=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, HAS_WINDOW=False,
                        USE_DOT=True, IS_FP32=False, PAGE=16)
    merge_sig = {"m_ptr": f32, "l_ptr": f32, "acc_ptr": f32, "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
                 "sinks_ptr": "*bf16", "bucket": "i32", "window": "i32", "chunk": "i32"}
    merge_consts = dict(NUM_SPLITS=8, SPLITS_P2=8, HEAD_DIM=128, BLOCK_D=128, HAS_WINDOW=False, HAS_SINKS=True)
    for name, fn, sig, consts in (("decode attention split", attn.decode_attn_split_kernel, split_sig, split_consts),
                                  ("decode attention merge", attn.decode_attn_merge_kernel, merge_sig, merge_consts)):
        picked.append((name, fn, {**sig, **{k: "constexpr" for k in consts}}, consts, {"num_warps": 4}, [], False))
    return picked


# what reads or writes memory another kernel may touch: loads and stores of global (or generic) memory in
# any flavour (vector, cache hint, .volatile / .relaxed / .acquire / .release), atomics, reductions, async copies
MEMORY_OP = r"\b(?:ld|st)(?:\.(?:volatile|relaxed|acquire|release|weak|gpu|sys|cta))*\.global\b|\b(?:atom|red)\.|\bcp\.async"
LOAD = r"\bld(?:\.(?:volatile|relaxed|acquire|weak|gpu|sys|cta))*\.global\b"


def _first(ptx: str, pattern: str) -> int:
    m = re.search(pattern, ptx)
    return m.start() if m else -1


def loads_before_wait(ptx: str) -> int:
    """Global loads in the PTX text before the first griddepcontrol.wait (all of them without one)."""
    wait = _first(ptx, r"griddepcontrol\.wait")
    return len(re.findall(LOAD, ptx if wait < 0 else ptx[:wait]))


def check_ptx(ptx: str, use_pdl: bool, weights_first: bool) -> list[str]:
    """What breaks the rule in one kernel's PTX (empty: nothing). With `weights_first`, loads before the
    wait are allowed (the caller checks that they are the weight tile's alone: `gemv_load_counts`)."""
    wait = _first(ptx, r"griddepcontrol\.wait")
    launch = _first(ptx, r"griddepcontrol\.launch_dependents")
    if not use_pdl:
        return [] if wait < 0 and launch < 0 else ["griddepcontrol compiled without USE_PDL"]
    if wait < 0 or launch < 0:
        return ["no griddepcontrol.wait / launch_dependents with USE_PDL"]
    problems = []
    if launch < wait:
        problems.append("launch_dependents before the wait")
    before = ptx[:wait]
    others = [m.group(0) for m in re.finditer(MEMORY_OP, before) if not re.fullmatch(LOAD, m.group(0))]
    if others:
        problems.append(f"{others[0]} before the wait")
    loads = loads_before_wait(ptx)
    if weights_first and loads == 0:
        problems.append("no weight load in flight before the wait")
    if not weights_first and loads:
        problems.append("a global load before the wait")
    return problems


def gemv_load_counts(compile_ptx) -> dict[int, int]:
    """linear_gemv's loads before the wait at T = 1, 2, 4, 16 with the same blocks. Only the weight tile may
    be read before the wait, and it does not depend on T, while every token adds loads of its x row: the
    counts must all be equal (and > 0)."""
    name, attr, sig, consts, opts, div = next(c for c in gemv_cases() if c[1] == "linear_gemv_kernel")
    return {t: loads_before_wait(compile_ptx(gemv.linear_gemv_kernel, sig, {**consts, "T_PAD": t}, opts, div))
            for t in (1, 2, 4, 16)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the PDL wait order of the decode kernels, in their PTX")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    skip = cannot_compile_ahead()
    if skip:
        print(f"SKIP: {skip}")
        return 0
    if not _triton_has_gdc():
        print("SKIP: this triton has no tl.extra.cuda.gdc_wait")
        return 0

    def compile_ptx(fn, sig, consts, opts, div) -> str:
        return compile_for_arch(fn, {**sig, "USE_PDL": "constexpr"}, consts, args.arch, divisible=div,
                                options=opts).asm["ptx"]

    failed = total = 0
    for name, fn, sig, consts, opts, div, weights_first in _cases():
        for use_pdl in (False, True):
            total += 1
            try:
                problems = check_ptx(compile_ptx(fn, sig, {**consts, "USE_PDL": use_pdl}, opts, div), use_pdl,
                                     weights_first)
            except Exception as exc:                                      # report every failure
                problems = [f"{type(exc).__name__}: {exc}"]
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {name}, USE_PDL={use_pdl}"
                  + (": " + "; ".join(problems) if problems else ""), flush=True)
    total += 1
    counts = gemv_load_counts(lambda fn, sig, consts, opts, div: compile_ptx(fn, sig, {**consts, "USE_PDL": True},
                                                                             opts, div))
    bad = len(set(counts.values())) != 1 or 0 in counts.values()
    failed += bad
    print(f"{'FAIL' if bad else 'ok  '} linear_gemv: loads before the wait by T {counts}"
          + (" (only the weight tile may be read before the wait: the same at every T)" if bad else ""))
    print(f"{total - failed} compiled, {failed} failed (sm_{args.arch})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
