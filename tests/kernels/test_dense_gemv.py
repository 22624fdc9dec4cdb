"""kernels/dense_gemv: the Triton kernel in lockstep with its torch reference, the argument checks, the
impl dispatch, the block heuristic, and (marked gpu) bfloat16 at qwen3-30b-a3b shapes and inside a
CUDA graph.

Without a GPU the kernel runs in the Triton interpreter (conftest.py), which computes bfloat16
wrongly: the lockstep tests use float32 and small shapes with blocks smaller than the defaults, so
that several blocks and ragged edges (N, K not multiples of the blocks) are exercised.
Tolerance there: the kernel and the reference differ only in the order of fp32 summation, so the
largest error relative to the largest output must stay below 1e-5 (observed ~2e-7; a wrong row, a
missed step or a token mixed into another gives O(1)).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftexpert.kernels.dense_gemv import DEFAULT_LINEAR_BLOCKS, MAX_T, LinearBlocks, linear_gemv, pick_blocks, preferred
from ftexpert.kernels.dense_gemv import api as dense_api
from ftexpert.kernels.dense_gemv import reference as ref
from tests.conftest import KERNEL_DEVICE, assert_compile_check

DEV = KERNEL_DEVICE
FP32_TOL = 1e-5
SMALL = LinearBlocks(block_n=8, block_k=16, num_warps=4)
EVEN = LinearBlocks(block_n=8, block_k=32, num_warps=2)


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def operands(T, N, K, seed, strided_x=False, strided_w=False, dtype=torch.float32, device="cpu"):
    """x [T, K], w [N, K] on `device`; strided: column slices of wider tensors (row stride > K, an odd
    offset), sliced on the device (a copy to another device would make them contiguous)."""
    g = torch.Generator().manual_seed(seed)
    if strided_x:
        x = torch.randn(2 * T, K + 7, generator=g).to(dtype).to(device)[::2, 3:3 + K]
    else:
        x = torch.randn(T, K, generator=g).to(dtype).to(device)
    if strided_w:
        w = torch.randn(N, K + 5, generator=g).to(dtype).to(device)[:, 5:]
    else:
        w = torch.randn(N, K, generator=g).to(dtype).to(device)
    return x, w


# -- lockstep ------------------------------------------------------------------------------------

LOCKSTEP_CASES = {
    # name: (T, N, K, blocks, strided x, strided w)
    "t1-ragged-n37-k70": (1, 37, 70, SMALL, False, False),
    "t2-even-n64-k128": (2, 64, 128, EVEN, False, False),
    "t3-ragged-n4-k32-one-warp": (3, 37, 70, LinearBlocks(block_n=4, block_k=32, num_warps=1), False, False),
    "t4-ragged-strided-x-and-w": (4, 37, 70, SMALL, True, True),
    "t5-even-strided-w": (5, 48, 96, LinearBlocks(block_n=16, block_k=16, num_warps=4), False, True),
    "t16-picked-blocks-strided-x": (16, 20, 64, None, True, False),
    "t4-picked-blocks-n128-k256": (4, 128, 256, None, False, False),
    "t1-ragged-k1000": (1, 5, 1000, LinearBlocks(block_n=2, block_k=64), False, False),
    "t2-k-smaller-than-one-block": (2, 9, 20, LinearBlocks(block_n=4, block_k=32), True, True),
    "t7-n-smaller-than-block": (7, 3, 50, LinearBlocks(block_n=8, block_k=64, num_warps=2), False, False),
}


@pytest.mark.parametrize("case", list(LOCKSTEP_CASES))
def test_linear_gemv_lockstep(case):
    T, N, K, blocks, strided_x, strided_w = LOCKSTEP_CASES[case]
    x, w = operands(T, N, K, seed=T * 101 + N, strided_x=strided_x, strided_w=strided_w, device=DEV)
    assert (x.stride(0) != K) == strided_x and (w.stride(0) != K) == strided_w
    expected = ref.linear_gemv_reference(x.cpu(), w.cpu())
    got = linear_gemv(x, w, impl="triton", blocks=blocks)
    assert got.dtype == x.dtype and got.shape == (T, N) and got.is_contiguous()
    assert torch.isfinite(got).all()
    assert rel_max(got, expected) < FP32_TOL
    assert torch.equal(linear_gemv(x, w, impl="triton", blocks=blocks), got)            # deterministic


@pytest.mark.parametrize("case", ["t1-ragged-n37-k70", "t4-ragged-strided-x-and-w", "t16-picked-blocks-strided-x",
                                  "t7-n-smaller-than-block"])
def test_linear_gemv_with_a_bias_lockstep(case):
    """gpt-oss's biased projections: the bias added to the fp32 sums before the rounding, every row its own (a
    bias of the outputs' size, so a wrong or missing one moves the result far past the tolerance)."""
    T, N, K, blocks, strided_x, strided_w = LOCKSTEP_CASES[case]
    x, w = operands(T, N, K, seed=T * 13 + N, strided_x=strided_x, strided_w=strided_w, device=DEV)
    b = (10 * torch.randn(N, generator=torch.Generator().manual_seed(N))).to(DEV)
    expected = ref.linear_gemv_reference(x.cpu(), w.cpu(), b.cpu())
    got = linear_gemv(x, w, impl="triton", blocks=blocks, bias=b)
    assert got.shape == (T, N) and rel_max(got, expected) < FP32_TOL
    assert rel_max(got, F.linear(x.cpu(), w.cpu(), b.cpu())) < FP32_TOL
    assert rel_max(linear_gemv(x, w, impl="triton", blocks=blocks), expected) > 1e-2      # the bias counts
    zero_k = linear_gemv(x[:, :0], w[:, :0], impl="triton", bias=b)
    assert torch.equal(zero_k.cpu(), b.cpu().expand(T, N))


def test_linear_gemv_refuses_a_bad_bias():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    for bad in (torch.randn(7), torch.randn(8, 1), torch.randn(8).double(), torch.empty(8, device="meta")):
        with pytest.raises(ValueError, match=r"bias must be \[8\] torch.float32 on cpu"):
            linear_gemv(x, w, bias=bad)
    with pytest.raises(ValueError, match="contiguous"):
        linear_gemv(x, w, bias=torch.randn(16)[::2])


def test_linear_gemv_rows_do_not_depend_on_the_batch():
    """Row t of a T = 4 (T_PAD 4) or T = 3 call is bitwise the row computed alone (T = 1), with one
    blocks setting; NaN in another row of x does not leak into row t."""
    x, w = operands(4, 37, 70, seed=9, device=DEV)
    for blocks in (SMALL, LinearBlocks(block_n=4, block_k=32, num_warps=1)):
        batch = linear_gemv(x, w, impl="triton", blocks=blocks)
        three = linear_gemv(x[:3], w, impl="triton", blocks=blocks)
        for t in range(4):
            alone = linear_gemv(x[t:t + 1], w, impl="triton", blocks=blocks)
            assert torch.equal(batch[t:t + 1], alone)
            if t < 3:
                assert torch.equal(three[t:t + 1], alone)
        poisoned = x.clone()
        poisoned[2] = float("nan")
        got = linear_gemv(poisoned, w, impl="triton", blocks=blocks)
        assert torch.isnan(got[2]).all()
        assert torch.equal(got[[0, 1, 3]], batch[[0, 1, 3]])


def test_linear_gemv_rows_past_n_do_not_reach_the_result():
    """w a view of the first N rows of a tensor whose next row is NaN, N not a multiple of block_n: the
    last program's rows past N (clamped to row N-1 in the kernel, so that they stay in bounds; the
    interpreter cannot see an out-of-bounds read) are never stored."""
    T, N, K = 3, 13, 40
    x, w = operands(T, N + 1, K, seed=4, device=DEV)
    w[N] = float("nan")
    got = linear_gemv(x, w[:N], impl="triton", blocks=SMALL)
    assert torch.isfinite(got).all()
    assert rel_max(got, ref.linear_gemv_reference(x.cpu(), w[:N].cpu())) < FP32_TOL


def test_linear_gemv_empty_shapes():
    x, w = operands(2, 5, 8, seed=1, device=DEV)
    assert linear_gemv(x[:0], w, impl="triton").shape == (0, 5)
    assert linear_gemv(x, w[:0], impl="triton").shape == (2, 0)
    zero_k = linear_gemv(x[:, :0], w[:, :0], impl="triton")
    assert zero_k.shape == (2, 5) and torch.equal(zero_k.cpu(), torch.zeros(2, 5))
    assert torch.equal(ref.linear_gemv_reference(x[:, :0].cpu(), w[:, :0].cpu()), torch.zeros(2, 5))


# -- arguments, dispatch -------------------------------------------------------------------------

def test_linear_gemv_rejects_bad_arguments():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=f"MAX_T = {MAX_T}.*F.linear"):
        linear_gemv(torch.randn(MAX_T + 1, 16), w)
    linear_gemv(torch.randn(MAX_T, 16), w)                                 # the largest batch is fine
    with pytest.raises(TypeError, match=r"\(8, 16\).*float64.*\(2, 16\).*float32"):
        linear_gemv(x, w.double())
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        linear_gemv(x.long(), w.long())
    with pytest.raises(ValueError, match=r"\(2, 16\).*\(8, 12\)"):
        linear_gemv(x, torch.randn(8, 12))
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        linear_gemv(x[0], w)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        linear_gemv(torch.randn(16, 2).T, w)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        linear_gemv(x, torch.randn(16, 8).T)
    with pytest.raises(ValueError, match="meta"):
        linear_gemv(x, torch.empty(8, 16, device="meta"))
    with pytest.raises(ValueError, match="impl"):
        linear_gemv(x, w, impl="fast")
    with pytest.raises(TypeError, match="LinearBlocks"):
        linear_gemv(x, w, blocks=(4, 1024))


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_n=3), "block_n"), (dict(block_n=512), "block_n"), (dict(block_k=8), "block_k"),
    (dict(block_k=1000), "block_k"), (dict(block_n=64, block_k=2048), "65536"), (dict(num_warps=3), "num_warps"),
    (dict(block_n=True), "int"),
    (dict(block_k=1024.0), "int")])
def test_linear_blocks_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearBlocks(**kwargs)


def test_auto_on_cpu_runs_the_reference(monkeypatch):
    calls = []
    real = ref.linear_gemv_reference
    monkeypatch.setattr(dense_api.reference, "linear_gemv_reference",
                        lambda x, w, b=None, up=None: calls.append(1) or real(x, w, b, up))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, w = operands(3, 10, 24, seed=2, dtype=dtype)
        got = linear_gemv(x, w)
        assert got.dtype == dtype and torch.equal(got, real(x, w))
    assert len(calls) == 3


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = operands(1, 4, 8, seed=0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_gemv(x, w, impl="triton")


def test_the_references_bias_is_added_before_its_one_rounding():
    x, w = operands(3, 16, 64, seed=8, dtype=torch.bfloat16)
    b = torch.randn(16).to(torch.bfloat16)
    got = ref.linear_gemv_reference(x, w, b)
    assert torch.equal(got, (x.float() @ w.float().T + b.float()).to(torch.bfloat16))


def test_reference_rounds_once_like_cublas():
    """bf16: the fp32 product rounded once (within half a bf16 ulp of the exact product); F.linear on
    the CPU accumulates bf16 in fp32 too: equal up to a rare one-ulp flip."""
    x, w = operands(4, 64, 256, seed=6, dtype=torch.bfloat16)
    got = ref.linear_gemv_reference(x, w)
    assert got.dtype == torch.bfloat16
    assert rel_max(got, x.double() @ w.double().T) < 2 ** -8
    assert rel_max(got, F.linear(x, w)) < 2 ** -7


def test_preferred_follows_the_measured_rule():
    assert preferred(1, 5120) and preferred(1, 2048) and preferred(1, 128)
    assert preferred(4, 128) and not preferred(5, 128)
    assert not preferred(2, 5120) and not preferred(4, 2048)


def test_pick_blocks():
    assert pick_blocks(5120, 2048) == DEFAULT_LINEAR_BLOCKS == LinearBlocks(1, 2048, 4)
    assert pick_blocks(2048, 4096) == DEFAULT_LINEAR_BLOCKS
    assert pick_blocks(128, 2048) == DEFAULT_LINEAR_BLOCKS
    assert pick_blocks(37, 70, torch.float32) == LinearBlocks(1, 128, 1)
    for N, K, dtype in ((5120, 2048, torch.bfloat16), (2048, 4096, torch.float16), (128, 2048, torch.bfloat16),
                        (4096, 4096, torch.float32), (37, 70, torch.float32), (151936, 2048, torch.bfloat16)):
        b = pick_blocks(N, K, dtype)
        vec = 16 // torch.empty((), dtype=dtype).element_size()
        assert b.block_k >= min(K, 16)
        assert b.block_k >= 32 * vec * b.num_warps or b.num_warps == 1     # warps along K (no x conversion)
        assert b.block_k <= 2048 and b.block_n == 1


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler (MLIR, LLVM, ptxas) on every kernel configuration of compile_check, in a
    process without the interpreter: catches what only the interpreter accepts. ~5 s; skipped where
    triton cannot compile ahead of time."""
    assert_compile_check("ftexpert.kernels.dense_gemv.compile_check")


# -- GPU -----------------------------------------------------------------------------------------

BF16_ULP = 2.0 ** -8                      # relative spacing of bfloat16 (8 significant bits)
QWEN3_SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}


def bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Same rounding point, fp32 sums in another order: an output differs by at most one bf16 ulp (a
    rounding flip), plus a tiny absolute slack for outputs near 0 (cancellation), and rarely."""
    d = (got.float() - expected.float()).abs()
    e = expected.float().abs()
    assert (d <= 2 * BF16_ULP * e + 1e-4 * e.max()).all(), f"max diff {d.max().item()}"
    assert (got == expected).float().mean().item() > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES))
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_linear_gemv_bf16_at_qwen3_shapes(T, shape, no_tf32):
    """bf16 at qwen3-30b-a3b shapes against the reference (cuBLAS fp32 GEMM, rounded once) and against
    F.linear (cuBLAS bf16): only summation order differs. Deterministic; row t equals the row
    computed alone; other blocks and a strided x agree within the same tolerance."""
    N, K = QWEN3_SHAPES[shape]
    g = torch.Generator().manual_seed(T * 7 + N)
    w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).cuda()
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).cuda()
    expected = ref.linear_gemv_reference(x, w)
    got = linear_gemv(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (T, N) and torch.isfinite(got).all()
    bf16_close(got, expected)
    # cuBLAS may reduce split-K partials in bf16 (allow_bf16_reduced_precision_reduction): looser there
    assert rel_max(got, F.linear(x, w)) < 4 * BF16_ULP
    exact = (got == expected).float().mean().item()
    print(f"\n{shape} T={T}: linear_gemv == reference for {100 * exact:.2f}% of outputs (bf16)")
    assert torch.equal(linear_gemv(x, w), got)                               # deterministic
    for t in range(T):
        assert torch.equal(linear_gemv(x[t:t + 1], w), got[t:t + 1])          # independent of the batch
    other = linear_gemv(x, w, blocks=LinearBlocks(block_n=4, block_k=512, num_warps=2))
    bf16_close(other, expected)
    wide = torch.zeros(T, K + 64, dtype=torch.bfloat16, device="cuda")
    wide[:, 8:8 + K] = x
    bf16_close(linear_gemv(wide[:, 8:8 + K], w), expected)
    xf, wf = x.float(), w.float()
    assert rel_max(linear_gemv(xf, wf), ref.linear_gemv_reference(xf, wf)) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("blocks", [None, LinearBlocks(block_n=4, block_k=1024, num_warps=4)])
def test_gpu_linear_gemv_in_a_cuda_graph(blocks, no_tf32):
    """Captured once (one launch), replayed after x is overwritten in place: the
    replay gives the new x's result, bitwise the eager call's."""
    N, K, T = 2048, 4096, 4
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16).cuda()
    x = torch.randn(T, K, generator=g).to(torch.bfloat16).cuda()
    x_new = torch.randn(T, K, generator=g).to(torch.bfloat16).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        linear_gemv(x, w, blocks=blocks)                                     # compile outside the graph
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = linear_gemv(x, w, blocks=blocks)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, linear_gemv(x, w, blocks=blocks))
    x.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, linear_gemv(x_new, w, blocks=blocks))
    bf16_close(static, ref.linear_gemv_reference(x_new, w))


# -- the gated input (up=: a shared expert's down projection of silu(gate) * up) ------------------

def gated_operands(T, N, K, seed, dtype, device):
    """gate, up: column slices of one [T, 2K + 5] tensor, as the fused MoE input projection gives them; w [N, K]."""
    g = torch.Generator().manual_seed(seed)
    both = (3 * torch.randn(T, 2 * K + 5, generator=g)).to(dtype).to(device)
    w = torch.randn(N, K, generator=g).to(dtype).to(device)
    return both[:, 5:5 + K], both[:, 5 + K:], w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, N, K, blocks", [(1, 37, 70, SMALL), (3, 16, 64, EVEN), (2, 24, 48, None),
                                             (5, 9, 100, LinearBlocks(block_n=4, block_k=32, num_warps=1))])
def test_linear_gemv_with_a_gated_input_is_silu_mul_then_the_gemv(dtype, T, N, K, blocks):
    """up=: bit for bit next_decode's Triton silu_mul followed by the same GEMV (the roundings of the activation
    made in the kernel), and the reference (torch silu * up, then the fp32 GEMV) within the lockstep tolerance."""
    from ftexpert.kernels import next_decode
    gate, up, w = gated_operands(T, N, K, seed=T * 11 + K, dtype=dtype, device=DEV)
    fused = linear_gemv(gate, w, impl="triton", blocks=blocks, up=up)
    two = linear_gemv(next_decode.silu_mul(gate, up, impl="triton"), w, impl="triton", blocks=blocks)
    assert torch.equal(fused, two)
    if dtype == torch.float32:
        assert rel_max(fused, ref.linear_gemv_reference(gate, w, None, up)) < FP32_TOL
        assert rel_max(fused, F.linear(F.silu(gate) * up, w)) < FP32_TOL
    assert torch.equal(linear_gemv(gate, w, impl="reference", up=up), ref.linear_gemv_reference(gate, w, None, up))


def test_linear_gemv_refuses_a_bad_up():
    gate, up, w = gated_operands(2, 8, 16, seed=1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"up must be \[2, 16\] torch.float32"):
        linear_gemv(gate, w, up=up[:1])
    with pytest.raises(ValueError, match="up must be"):
        linear_gemv(gate, w, up=up.double())
    with pytest.raises(ValueError, match="up .* needs a contiguous last dimension"):
        linear_gemv(gate, w, up=torch.randn(16, 2).T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_linear_gemv_gated_bf16_at_the_shared_expert_shape(T, no_tf32):
    """qwen3-next's shared expert down [2048, 512] over the gate and up views of the fused MoE input projection:
    bit for bit the Triton silu_mul then the GEMV (libdevice exp and IEEE division in both), in and out of a graph."""
    from ftexpert.kernels import next_decode
    gate, up, w = gated_operands(T, 2048, 512, seed=T, dtype=torch.bfloat16, device="cuda")
    w = w * 0.02
    fused = linear_gemv(gate, w, up=up)
    assert torch.equal(fused, linear_gemv(next_decode.silu_mul(gate, up), w))
    bf16_close(fused, ref.linear_gemv_reference(gate, w, None, up))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_gemv(gate, w, up=up)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fused)
