"""Compile the kernels that touch mapped host memory for an NVIDIA target without a GPU (Triton's front
end, LLVM and the bundled ptxas): the hand-off kernels, so their inline PTX (ld.acquire.sys,
fence.acq_rel.sys, %globaltimer) is checked on a CPU, and the plan copy of kernels/expert_copy, whose
PCIe reads must be 16-byte vectors (ld.global.v4), not 2-byte words.

    python -m ftexpert.kernels.handoff.compile_check [--arch 90] [--ptx DIR]

Prints one line per kernel variant with the count of system-scope loads and fences in its PTX.
"""
from __future__ import annotations

import argparse
import os
import sys

from ftexpert.kernels.expert_copy import triton_kernels as copy_kernels
from ftexpert.kernels.expert_copy.api import BLOCK_WORDS
from ftexpert.kernels.expert_split import triton_kernels as split_kernels
from ftexpert.kernels.expert_split.api import SPLIT_UNIT, W13_BLOCK, W13_ROWS, W2_ROWS
from ftexpert.kernels.handoff import triton_kernels
from ftexpert.kernels.handoff.api import JOIN_BLOCK, RING_BLOCK_H, RING_BLOCK_R
from ftexpert.kernels.slot_cache.ptx_check import compile_for_arch


def cases():
    ring_sig = {"x_ptr": "*bf16", "stride_x": "i32", "T": "i32", "H": "i32", "ids_ptr": "*i32",
                "routes_ptr": "*i32", "w_ptr": "*fp32", "R": "i32", "K": "i32", "owner_ptr": "*i32",
                "owner_off": "i32", "member": "i32", "hidden_addr": "i64", "token_addr": "i64",
                "expert_addr": "i64", "weight_addr": "i64", "line_addr": "i64", "request_seq_addr": "i64",
                "fail_ptr": "*i32", "state_ptr": "*i64", "slot": "i32", "layer": "i32",
                "split_ptr": "*i32", "split_slot": "i32",
                "HIDDEN_BF16": "constexpr", "ALWAYS_RING": "constexpr", "USE_OWNER": "constexpr",
                "BLOCK_R": "constexpr", "BLOCK_H": "constexpr", "ON_GPU": "constexpr", "HAS_SPLIT": "constexpr"}
    join_sig = {"src_ptr": "*bf16", "dst_ptr": "*fp32", "numel": "i32", "out_addr": "i64", "line_addr": "i64",
                "done_seq_addr": "i64", "abort_addr": "i64", "fail_ptr": "*i32", "host_fail_addr": "i64",
                "state_ptr": "*i64", "slot": "i32", "SAME": "constexpr",
                "BLOCK": "constexpr", "ON_GPU": "constexpr"}
    ring = dict(HIDDEN_BF16=True, ALWAYS_RING=False, USE_OWNER=True, HAS_SPLIT=False, BLOCK_R=RING_BLOCK_R, BLOCK_H=RING_BLOCK_H,
                ON_GPU=True)
    copy_sig = {"slots_ptr": "*i16", "host_addr": "i64", "host_row_words": "i32", "evict_ptr": "*i32",
                "src_ptr": "*i32", "num_indices_ptr": "*i32", "row_words": "i32", "chunk_words": "i32",
                "col_lo": "i32", "col_hi": "i32", "BLOCK": "constexpr", "ALIGNED": "constexpr"}
    return [("plan copy aligned", "copy_plan_kernel", copy_sig, dict(BLOCK=BLOCK_WORDS, ALIGNED=True)),
            ("ring owner bf16", "ring_kernel", ring_sig, ring),
            ("ring owner bf16 split", "ring_kernel", ring_sig, {**ring, "HAS_SPLIT": True}),
            ("ring all fp32", "ring_kernel", {**ring_sig, "x_ptr": "*fp32"},
             {**ring, "HIDDEN_BF16": False, "USE_OWNER": False, "ALWAYS_RING": True}),
            ("join bf16 -> fp32", "join_kernel", join_sig, dict(SAME=False, BLOCK=JOIN_BLOCK, ON_GPU=True)),
            ("join fp32 in place", "join_kernel", {**join_sig, "src_ptr": "*fp32"},
             dict(SAME=True, BLOCK=JOIN_BLOCK, ON_GPU=True)),
            ("count call", "count_call_kernel",
             {"counts_ptr": "*i64", "ids_ptr": "*i32", "n": "i32", "num_indices_ptr": "*i32",
              "num_missing_ptr": "*i32", "OFFLOAD": "constexpr", "BLOCK": "constexpr"},
             dict(OFFLOAD=False, BLOCK=32)),
            *split_cases()]


def split_cases():
    """kernels/expert_split: the split slot's copy reads host memory like the plan copy (16-byte vectors)."""
    head = {"slots_ptr": "*i16", "host_addr": "i64", "host_row_words": "i32", "desc_ptr": "*i32", "split_slot": "i32",
            "row_words": "i32"}
    w13 = {**head, "HW": "i32", "I": "i32", "ROWS": "constexpr", "BLOCK": "constexpr", "ALIGNED": "constexpr"}
    w2 = {**head, "w2_off": "i32", "H": "i32", "IW": "i32", "PER": "constexpr", "UNIT": "constexpr",
          "ROWS": "constexpr", "ALIGNED": "constexpr", "EVEN_ROWS": "constexpr"}
    return [("split copy w13", "split_copy_w13_kernel", w13, dict(ROWS=W13_ROWS, BLOCK=W13_BLOCK, ALIGNED=True)),
            ("split copy w2 bf16", "split_copy_w2_kernel", w2, dict(PER=1, UNIT=SPLIT_UNIT, ROWS=W2_ROWS, ALIGNED=True,
                                                                      EVEN_ROWS=True))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--ptx", default=None, help="write NAME.ptx files here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("SKIP: TRITON_INTERPRET=1; unset it")
        return 0
    for name, kernel, signature, constexprs in cases():
        module = copy_kernels if kernel == "copy_plan_kernel" else split_kernels if kernel.startswith("split_") \
            else triton_kernels
        fn = getattr(module, kernel)
        # the JIT marks 16-divisible integer arguments (the page-aligned channel addresses) as such at launch
        # (and the plan copy's column range: 0 and an expert's w13 words, both multiples of 16 words)
        aligned = [a for a in signature if a.endswith(("_addr", "_ptr", "_words"))
                   or a in ("numel", "H", "col_lo", "col_hi", "HW", "I", "IW", "w2_off")]
        compiled = compile_for_arch(fn, signature, constexprs, args.arch, divisible=aligned)
        ptx = compiled.asm["ptx"]
        counts = {op: ptx.count(op) for op in ("ld.acquire.sys", "fence.acq_rel.sys", "%globaltimer", "bar.sync",
                                               "ld.global.v4", "ld.global.cv.v4", "st.global.v4")}
        print(f"{name:22s} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
        if args.ptx:
            os.makedirs(args.ptx, exist_ok=True)
            with open(os.path.join(args.ptx, name.replace(" ", "_") + ".ptx"), "w") as fh:
                fh.write(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
