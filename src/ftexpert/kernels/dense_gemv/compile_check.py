"""Compile the dense GEMV kernels for an NVIDIA target without a GPU: Triton's front end, MLIR passes,
LLVM and ptxas (bundled with the triton wheel) run as on the GPU machine, so code that only the
interpreter accepts (e.g. an op that does not broadcast when compiled) fails here, on a CPU.

    python -m ftexpert.kernels.dense_gemv.compile_check [--arch 90] [--resources]

Exit status 0 when everything compiled; prints SKIP and exits 0 when this triton cannot compile
ahead of time (no ASTSource / GPUTarget of this shape, or TRITON_INTERPRET=1 in the environment).
--resources adds, per kernel, registers / spills (cuobjdump), shared memory, and the layout
conversions Triton left inside the K loop (`loop cvt`: 0 means the weight tile and the x rows were
loaded in one layout; each conversion is a round trip through shared memory every step), with
16-byte alignment hints on the pointer and size arguments, as the JIT gives them at launch on
aligned tensors.
"""
from __future__ import annotations

import sys

from ftexpert.kernels.compile_driver import run_compile_check
from ftexpert.kernels.dense_gemv import triton_kernels


def _cases() -> list[tuple[str, str, dict, dict, dict, list[str]]]:
    """(name, kernel attribute, signature, constexprs, options, 16-divisible args)."""
    def sig(dt: str, out: str) -> dict:
        return {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{out}", "T": "i32", "N": "i32",
                "K": "i32", "stride_xt": "i32", "stride_wn": "i32",
                "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "T_PAD": "constexpr", "EVEN_K": "constexpr"}
    div = ["x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xt", "stride_wn"]
    w4 = {"num_warps": 4}

    def gemv(name, dt, out, bn, bk, t_pad, even=True, opts=w4, bias=False, glu=False):
        extra = {"b_ptr": f"*{dt}", "BIAS": "constexpr"} if bias else {}
        consts = {"BIAS": True} if bias else {}
        if glu:         # the gated input (up=): up's pointer and row stride, silu with libdevice (ACCURATE) as on a GPU
            extra.update({"u_ptr": f"*{dt}", "stride_ut": "i32", "GLU": "constexpr", "ACCURATE": "constexpr"})
            consts.update(GLU=True, ACCURATE=True)
        return (name, "linear_gemv_kernel", {**sig(dt, out), **extra},
                dict(BLOCK_N=bn, BLOCK_K=bk, T_PAD=t_pad, EVEN_K=even, **consts), opts,
                div + (["b_ptr"] if bias else []) + (["u_ptr", "stride_ut"] if glu else []))
    return [
        gemv("qwen3-next shared down, gated input 1x512 T=1", "bf16", "bf16", 1, 512, 1, glu=True),
        gemv("qwen3-next shared down, gated input 1x512 T=4", "bf16", "bf16", 1, 512, 4, glu=True),
        gemv("gpt-oss qkv / o_proj with bias 1x2048 T=1 ragged K", "bf16", "bf16", 1, 2048, 1, even=False, bias=True),
        gemv("gpt-oss router with bias 1x2048 T=4 ragged K", "bf16", "bf16", 1, 2048, 4, even=False, bias=True),
        gemv("qkv / o_proj / router 1x2048 T=1 (the default)", "bf16", "bf16", 1, 2048, 1),
        gemv("router 1x2048 T=2", "bf16", "bf16", 1, 2048, 2),
        gemv("qkv / o_proj 4x1024 T=1", "bf16", "bf16", 4, 1024, 1),
        gemv("qkv / o_proj 4x1024 T=2", "bf16", "bf16", 4, 1024, 2),
        gemv("qkv / o_proj 4x1024 T=4", "bf16", "bf16", 4, 1024, 4),
        gemv("qkv / o_proj 4x1024 T=16", "bf16", "bf16", 4, 1024, 16),
        gemv("router 1x2048 T=1", "bf16", "bf16", 1, 2048, 1),
        gemv("router 1x2048 T=4", "bf16", "bf16", 1, 2048, 4),
        gemv("8x1024 T=4", "bf16", "bf16", 8, 1024, 4),
        gemv("4x2048 T=4", "bf16", "bf16", 4, 2048, 4),
        gemv("16x256 T=4 (warps along N)", "bf16", "bf16", 16, 256, 4),
        gemv("4x1024 T=3 ragged K", "bf16", "bf16", 4, 1024, 4, even=False),
        gemv("fp16 4x1024 T=4", "fp16", "fp16", 4, 1024, 4),
        gemv("fp32 4x1024 T=4", "fp32", "fp32", 4, 1024, 4),
    ]


def loop_conversions(ttgir: str) -> int:
    """ttg.convert_layout ops inside the kernel's scf.for loops (by indentation)."""
    count, loop_indent = 0, None
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if loop_indent is not None and line.strip() and indent <= loop_indent:
            loop_indent = None
        if loop_indent is None and "scf.for" in line:
            loop_indent = indent
        elif loop_indent is not None and "ttg.convert_layout" in line:
            count += 1
    return count


def _extra(kernel) -> str:
    return f"  shared {kernel.metadata.shared}  loop cvt {loop_conversions(kernel.asm['ttgir'])}"


def main(argv: list[str] | None = None) -> int:
    return run_compile_check("compile the dense GEMV kernels for an NVIDIA target", _cases(), triton_kernels, argv, extra=_extra)


if __name__ == "__main__":
    sys.exit(main())
