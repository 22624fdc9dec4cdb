"""Entry point of the decode-sized dense linear layer: validation, then the Triton kernel or the torch
reference.

`impl="auto"` runs the Triton kernel on CUDA tensors and the reference elsewhere; `"triton"` on CPU
tensors needs TRITON_INTERPRET=1 set before this package's kernels are first used (the Triton
interpreter; tests/conftest.py sets it); `"reference"` always runs the torch code.

Nothing here syncs with the host or depends on tensor values on the host: `linear_gemv` is
CUDA-graph capturable for fixed shapes (its output is allocated per call, inside the graph's pool).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.kernels.impl import IMPLS, resolve_impl as _resolve_impl  # noqa: F401 (IMPLS re-exported: one dispatch rule)
from ftexpert.kernels.moe_decode.api import _accurate, emulate_bf16
from ftexpert.kernels.pdl import pdl_args

from ftexpert.kernels.dense_gemv import reference

MAX_T = 16                  # largest decode batch linear_gemv takes; larger ones belong to F.linear


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclass(frozen=True)
class LinearBlocks:
    """Launch shape of `linear_gemv`. Results do not depend on these except through the order of fp32
    summation inside a dot product.
    `pick_blocks` chooses per shape (measured on the H200: its docstring); the class defaults are
    its choice for qwen3-30b-a3b's qkv / o_proj.

    Grid (cdiv(N, block_n),): each program streams block_n weight rows in block_k-column steps, every step a [block_n, block_k] tile in 16-byte vectors, multiplied with all
    T rows of x. With block_k >= 256 * num_warps (bf16; 128 * num_warps for fp32) the warps lie along
    K: each thread holds block_n rows x block_k / (32 * num_warps) columns of the tile and only its
    own columns of x. With every program resident, the bytes in flight per loop step are about
    N * block_k * 2 (bf16): block_k sets the memory parallelism, block_n how evenly the programs spread
    over the SMs.
    Registers (ptxas for sm_90 through triton 3.9 on a CPU machine, bf16, aligned, no spills;
    `python -m ftexpert.kernels.dense_gemv.compile_check --resources`): 4x1024 / 4 warps: 40 (T=1), 63 (T=2),
    72 (T=4), 148 (T=16); 1x2048 / 4 warps: 32 (T=1), 40 (T=4); 4x2048 / 4 warps: 115 (T=4).
    """
    block_n: int = 1
    block_k: int = 2048
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"LinearBlocks.{name} must be an int, got {v!r}")
        if not (_is_pow2(self.block_n) and self.block_n <= 256):
            raise ValueError(f"LinearBlocks.block_n must be a power of two in [1, 256], got {self.block_n}")
        if not (_is_pow2(self.block_k) and 16 <= self.block_k <= 16384):
            raise ValueError(f"LinearBlocks.block_k must be a power of two in [16, 16384], got {self.block_k}")
        if self.block_n * self.block_k > 65536:
            raise ValueError(f"LinearBlocks: a block_n x block_k tile of at most 65536 elements, got "
                             f"{self.block_n} x {self.block_k}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LinearBlocks.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


DEFAULT_LINEAR_BLOCKS = LinearBlocks()


def pick_blocks(N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> LinearBlocks:
    """Blocks for an [N, K] weight (independent of T, so that a token's result does not depend on the
    batch it is in): one output row a program, block_k = min(next_pow2(K), 2048), the warps as many as
    block_k fills with 16-byte vectors along K, at most 4. Measured on the H200
    (`python bench/bench_moe_decode.py --tokens 1 --sweep`, docs/BENCHMARKS.md) at T = 1: qkv
    [5120, 2048] 6.8 us, o_proj [2048, 4096] 6.0 us, router [128, 2048] 1.9 us (cuBLAS: 8.1, 9.3, 4.7),
    each within the run's noise of the best of ~20 variants."""
    vec = max(1, 16 // torch.empty((), dtype=dtype).element_size())     # elements per 16-byte load
    block_k = max(16, min(_next_pow2(K), 2048))
    num_warps = max(1, min(4, block_k // (32 * vec)))
    return LinearBlocks(block_n=1, block_k=block_k, num_warps=num_warps)


def preferred(T: int, N: int) -> bool:
    """Whether linear_gemv beats cuBLAS for T tokens and N outputs, as measured on the H200: at T = 1 for every qwen3-30b-a3b projection (1.2-2.7x); for a router-sized N (<= 512) up
    to T = 4 (1.5-2.1x); not for qkv / o_proj at T = 2 and 4 (0.57-1.04x with 4 x 1024 blocks: each
    token's row sums cost shuffles of their own), where F.linear stays. N <= 512 stands for "a router-sized projection" (at
    qwen3-30b-a3b shapes only the router; in the tiny test models every projection).

    Re-measured with pick_blocks' 1 x 2048: qkv 0.90x / 0.61x at T = 2 / 4,
    o_proj 1.13x / 0.78x, router 2.09x / 1.49x; o_proj at T = 2 alone would gain, which this shape-blind
    rule leaves on cuBLAS. A consequence of the rule: a sequence's dense projections round differently when it
    decodes alone (T = 1: this kernel) and in a batch (cuBLAS); resident, offload and hybrid share the
    rule, so they stay token-identical to each other for the same schedule."""
    return T == 1 or (N <= 512 and T <= 4)


def linear_gemv(x: torch.Tensor, w: torch.Tensor, *, impl: str = "auto",
                blocks: LinearBlocks | None = None, bias: torch.Tensor | None = None,
                up: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-sized dense linear layer: y = x @ w.T (+ bias) -> [T, N] in x.dtype, freshly allocated.

    x: [T, K] float32 | bfloat16 | float16 with 0 <= T <= MAX_T (16; a larger batch raises ValueError:
        use F.linear), any row stride, contiguous last dimension (a column slice of a wider tensor
        works).
    w: [N, K] in x.dtype on x's device, any row stride, contiguous last dimension.
    Numerics: products and sums in fp32, rounded to x.dtype once at the end (cuBLAS's bf16 GEMM with
    fp32 compute), i.e. reference.linear_gemv_reference up to the order of the fp32 summation.
    Deterministic (no atomics). Row t of the result
    does not depend on the other rows of x, nor on T: for the same blocks (blocks=None picks them
    from N, K and the dtype only), row t of a T = 4 call is bitwise the row computed with T = 1.
    One launch.
    blocks: LinearBlocks, or None for pick_blocks(N, K, x.dtype).
    bias: [N] in x.dtype on x's device (contiguous), or None: added to the fp32 sums before the rounding (as
    cuBLAS's bias epilogue, F.linear with a bias).
    With programmatic dependent launch (kernels/pdl.py) each program reads its first weight tile before
    it waits for the kernel queued before it: w must be a weight, not the output of a kernel that may
    still be running on this stream.
    up: [T, K] in x.dtype on x's device (any row stride, contiguous last dimension), or None. Given, x is a
    gate and the layer's input is the gated activation DT(DT(silu(x)) * up), with the roundings of
    kernels/next_decode's silu_mul (a shared expert's down projection in one launch, no activation tensor):
    bit for bit the Triton silu_mul followed by this GEMV.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [T, K] and w [N, K], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"w {tuple(w.shape)} {w.dtype} must have the dtype of x {tuple(x.shape)} {x.dtype}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} must be [T, K] and [N, K] with one K")
    if w.device != x.device:
        raise ValueError(f"x {tuple(x.shape)} is on {x.device}, w {tuple(w.shape)} on {w.device}")
    T, K = x.shape
    N = w.shape[0]
    if T > MAX_T:
        raise ValueError(f"linear_gemv takes at most MAX_T = {MAX_T} rows of x, got x {tuple(x.shape)}: "
                         f"use F.linear for larger batches")
    for name, t in (("x", x), ("w", w)):
        if K > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} needs a contiguous last dimension, got strides {t.stride()}")
    if blocks is not None and not isinstance(blocks, LinearBlocks):
        raise TypeError(f"blocks must be a LinearBlocks or None, got {type(blocks).__name__}")
    if bias is not None:
        if bias.shape != (N,) or bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias must be [{N}] {x.dtype} on {x.device} (one per row of w), got "
                             f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
        if N > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias {tuple(bias.shape)} must be contiguous, got stride {bias.stride()}")
    if up is not None:
        if up.shape != x.shape or up.dtype != x.dtype or up.device != x.device:
            raise ValueError(f"up must be {list(x.shape)} {x.dtype} on {x.device} (the gate's shape), got "
                             f"{list(up.shape)} {up.dtype} on {up.device}")
        if K > 1 and up.stride(1) != 1:
            raise ValueError(f"up {tuple(up.shape)} needs a contiguous last dimension, got strides {up.stride()}")
    if _resolve_impl(impl, x.device) == "reference":
        return reference.linear_gemv_reference(x, w, bias, up)
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.dense_gemv.triton_kernels import linear_gemv_kernel
    b = blocks or pick_blocks(N, K, x.dtype)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(T, N))
    linear_gemv_kernel[(_cdiv(N, b.block_n),)](
        x, w, y, T, N, K, x.stride(0), w.stride(0),
        BLOCK_N=b.block_n, BLOCK_K=b.block_k, T_PAD=_next_pow2(T), EVEN_K=K % b.block_k == 0,
        num_warps=b.num_warps, b_ptr=x if bias is None else bias, BIAS=bias is not None, **pdl_args(x.device),
        **({} if up is None else dict(u_ptr=up, stride_ut=up.stride(0), GLU=True,
                                      ACCURATE=_accurate(x.device), EMU_BF16=emulate_bf16(x))))
    return y
