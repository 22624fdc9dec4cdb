"""Compile the hand-off kernels for an NVIDIA target without a GPU (Triton's front end, LLVM and the
bundled ptxas), so the inline PTX (ld.acquire.sys, fence.sc.sys, %globaltimer) is checked on a CPU.

    python -m kernels.handoff.compile_check [--arch 90] [--ptx DIR]

Prints one line per kernel variant with the count of system-scope loads and fences in its PTX.
"""
from __future__ import annotations

import argparse
import os
import sys


def cases():
    ring_sig = {"x_ptr": "*bf16", "stride_x": "i32", "T": "i32", "H": "i32", "ids_ptr": "*i32",
                "routes_ptr": "*i32", "w_ptr": "*fp32", "R": "i32", "K": "i32", "owner_ptr": "*i32",
                "owner_off": "i32", "member": "i32", "hidden_addr": "i64", "token_addr": "i64",
                "expert_addr": "i64", "weight_addr": "i64", "line_addr": "i64", "request_seq_addr": "i64",
                "fail_ptr": "*i32", "state_ptr": "*i64", "slot": "i32", "layer": "i32",
                "HIDDEN_BF16": "constexpr", "ALWAYS_RING": "constexpr", "USE_OWNER": "constexpr",
                "BLOCK_R": "constexpr", "BLOCK_H": "constexpr", "ON_GPU": "constexpr"}
    join_sig = {"src_ptr": "*bf16", "dst_ptr": "*fp32", "numel": "i32", "out_addr": "i64", "line_addr": "i64",
                "done_seq_addr": "i64", "abort_addr": "i64", "fail_ptr": "*i32", "host_fail_addr": "i64",
                "state_ptr": "*i64", "slot": "i32", "deadline_ns": "i64", "SAME": "constexpr",
                "BLOCK": "constexpr", "ON_GPU": "constexpr"}
    from .api import JOIN_BLOCK, RING_BLOCK_H, RING_BLOCK_R
    ring = dict(HIDDEN_BF16=True, ALWAYS_RING=False, USE_OWNER=True, BLOCK_R=RING_BLOCK_R, BLOCK_H=RING_BLOCK_H,
                ON_GPU=True)
    return [("ring owner bf16", "ring_kernel", ring_sig, ring),
            ("ring all fp32", "ring_kernel", {**ring_sig, "x_ptr": "*fp32"},
             {**ring, "HIDDEN_BF16": False, "USE_OWNER": False, "ALWAYS_RING": True}),
            ("join bf16 -> fp32", "join_kernel", join_sig, dict(SAME=False, BLOCK=JOIN_BLOCK, ON_GPU=True)),
            ("join fp32 in place", "join_kernel", {**join_sig, "src_ptr": "*fp32"},
             dict(SAME=True, BLOCK=JOIN_BLOCK, ON_GPU=True))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--ptx", default=None, help="write NAME.ptx files here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("SKIP: TRITON_INTERPRET=1; unset it")
        return 0
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import triton_kernels
    for name, kernel, signature, constexprs in cases():
        compiled = triton.compile(ASTSource(fn=getattr(triton_kernels, kernel), signature=signature,
                                            constexprs=constexprs),
                                  target=GPUTarget("cuda", args.arch, 32), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        counts = {op: ptx.count(op) for op in ("ld.acquire.sys", "fence.sc.sys", "%globaltimer", "bar.sync")}
        print(f"{name:22s} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
        if args.ptx:
            os.makedirs(args.ptx, exist_ok=True)
            with open(os.path.join(args.ptx, name.replace(" ", "_") + ".ptx"), "w") as fh:
                fh.write(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
