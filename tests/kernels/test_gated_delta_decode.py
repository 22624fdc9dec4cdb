"""kernels/next_decode gdn_decode_rule: the gated delta rule's decode step on the state cache's rows in place (the
Triton kernel) in lockstep with its reference (gather the rows, kernels/gated_delta's torch recurrence, scatter),
over several successive steps so that the state carries: rows scattered and out of order, grouped q/k heads and
q/k already expanded to the value heads (gdn_decode_pre's form), Dk / Dv not powers of two and Dv over several
tiles; the rows not named, and the other layers of the cache, untouched.

Without a GPU the kernel runs in the Triton interpreter (conftest.py), on a GPU natively (the gpu-marked test also
at Qwen3-Next's head shapes and inside a CUDA graph). Tolerances: the state (fp32 whatever the inputs) and fp32
outputs within 1e-5 relative of the tensor's largest value (the kernel sums the Dk products in another order than
torch, and exp / rsqrt may differ by an ulp; the state's rounding differences carry from step to step but stay at a
few ulps of its scale); bf16 outputs as test_next_decode.close (all but 3%, at least all but 2, bit-equal, the
rest one bf16 step apart: an ulp of fp32 in S^T q flips a bf16 rounding now and then).
"""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels import next_decode as kn
from tests.conftest import KERNEL_DEVICE
from tests.kernels.test_next_decode import close

DEV = KERNEL_DEVICE


def close_state(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().amax().clamp_min(1e-30).item()
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5 * scale)


def step_inputs(T, Hqk, Hv, Dk, Dv, dtype, gen):
    """One decode step's q, k [T, Hqk, Dk], v [T, Hv, Dv] (dtype), g [T, Hv] fp32 (log decay in (-4, 0], some
    heads barely decaying), beta [T, Hv] (dtype)."""
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)
    q, k, v = rnd(T, Hqk, Dk, scale=2), rnd(T, Hqk, Dk), rnd(T, Hv, Dv)
    g = -(torch.rand(T, Hv, generator=gen) * 2).pow(2).to(DEV)
    beta = torch.rand(T, Hv, generator=gen).to(dtype).to(DEV)
    return q, k, v, g, beta


def expand(x: torch.Tensor, Hv: int) -> torch.Tensor:
    """q / k [T, Hqk, D] -> [T, Hv, D] as gdn_decode_pre gives them (key head i serves value heads i*r .. i*r+r-1)."""
    return x.repeat_interleave(Hv // x.shape[1], dim=1)


# (T, rows, Hk, r, Dk, Dv, block_v): B = 5 rows, scattered and out of order
CASES = [
    (1, [3], 2, 2, 16, 16, None),
    (3, [4, 0, 2], 2, 2, 32, 32, 16),          # Dv over two tiles
    (3, [1, 4, 3], 1, 3, 12, 20, 8),           # Dk, Dv not powers of two (masked lanes), three tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, rows, Hk, r, Dk, Dv, block_v", CASES)
def test_lockstep_over_steps_in_place(dtype, T, rows, Hk, r, Dk, Dv, block_v):
    Hv, N, L, layer = Hk * r, 5, 2, 1
    gen = torch.Generator().manual_seed(T * 100 + Dk + Dv)
    cache = torch.randn(L, N, Hv, Dk, Dv, generator=gen).to(DEV)        # two layers: the kernel gets one, a view
    caches = cache.clone(), cache.clone()
    rows_t = torch.tensor(rows, dtype=torch.int64, device=DEV)
    for _ in range(3):
        q, k, v, g, beta = step_inputs(T, Hk, Hv, Dk, Dv, dtype, gen)
        o = kn.gdn_decode_rule(q, k, v, g, beta, caches[0][layer], rows_t, block_v=block_v, impl="triton")
        o_ref = kn.gdn_decode_rule(q, k, v, g, beta, caches[1][layer], rows_t, impl="reference")
        assert o.shape == (T, Hv, Dv) and o.is_contiguous()
        close(o, o_ref)
        close_state(caches[0], caches[1])
    assert not torch.equal(caches[0][layer, rows], cache[layer, rows])  # the rows advanced, in place
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(caches[0][layer][untouched.to(DEV)], cache[layer][untouched.to(DEV)])
    assert torch.equal(caches[0][0], cache[0])                          # the other layer
    assert torch.equal(caches[1][layer][untouched.to(DEV)], cache[layer][untouched.to(DEV)])


def test_expanded_q_k_give_the_grouped_result():
    """gdn_decode_pre hands q / k already expanded to the value heads: the same programs, bit-equal results."""
    T, Hk, r, Dk, Dv = 3, 2, 2, 16, 16
    gen = torch.Generator().manual_seed(7)
    q, k, v, g, beta = step_inputs(T, Hk, Hk * r, Dk, Dv, torch.float32, gen)
    state = torch.randn(6, Hk * r, Dk, Dv, generator=gen).to(DEV)
    rows = torch.tensor([5, 1, 2], device=DEV)
    states = state.clone(), state.clone()
    o1 = kn.gdn_decode_rule(q, k, v, g, beta, states[0], rows, impl="triton")
    o2 = kn.gdn_decode_rule(expand(q, Hk * r), expand(k, Hk * r), v, g, beta, states[1], rows, impl="triton")
    assert torch.equal(o1, o2) and torch.equal(*states)


def test_eight_sequences_and_strided_views():
    """T = 8, the rows a permutation of part of the cache, q / k / v strided views of one buffer (last dim
    contiguous, as views of a projection), g and beta [T, 1, Hv] squeezed (as the layer passes gdn_decode_pre's)."""
    T, Hv, Dk, Dv, N = 8, 2, 16, 16, 11
    gen = torch.Generator().manual_seed(8)
    buf = torch.randn(T, Hv, 2 * Dk + Dv + 3, generator=gen).to(DEV)
    q, k, v = buf[..., :Dk], buf[..., Dk:2 * Dk], buf[..., 2 * Dk + 3:]
    g = (-torch.rand(T, 1, Hv, generator=gen)).to(DEV).squeeze(1)
    beta = torch.rand(T, 1, Hv, generator=gen).to(DEV).squeeze(1)
    state = torch.randn(N, Hv, Dk, Dv, generator=gen).to(DEV)
    rows = torch.randperm(N, generator=gen)[:T].to(DEV)
    states = state.clone(), state.clone()
    close(kn.gdn_decode_rule(q, k, v, g, beta, states[0], rows, impl="triton"),
          kn.gdn_decode_rule(q, k, v, g, beta, states[1], rows, impl="reference"))
    close_state(states[0], states[1])


def test_the_reference_is_the_layers_old_path():
    """impl="reference" is the gather, kernels/gated_delta's recurrence for one token and the scatter, op for op."""
    from ftexpert.kernels import gated_delta
    T, Hk, r, Dk, Dv = 2, 2, 2, 8, 8
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = (x.cpu() for x in step_inputs(T, Hk, Hk * r, Dk, Dv, torch.bfloat16, gen))
    state = torch.randn(4, Hk * r, Dk, Dv, generator=gen)
    rows = torch.tensor([3, 0])
    old = state.clone()
    o_old, s_new = gated_delta.recurrent_gated_delta_rule(*(x.unsqueeze(1) for x in (q, k, v, g, beta)),
                                                          old.index_select(0, rows), impl="reference")
    old.index_copy_(0, rows, s_new)
    o = kn.gdn_decode_rule(q, k, v, g, beta, state, rows, impl="reference")
    assert torch.equal(o, o_old.squeeze(1)) and torch.equal(state, old)


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(0)
    q, k, v, g, beta = (x.cpu() for x in step_inputs(2, 2, 4, 8, 8, torch.float32, gen))
    state, rows = torch.zeros(3, 4, 8, 8), torch.tensor([2, 0])
    call = kn.gdn_decode_rule
    with pytest.raises(ValueError, match="rows"):
        call(q, k, v, g, beta, state, rows.int())
    with pytest.raises(ValueError, match="state must be"):
        call(q, k, v, g, beta, state.bfloat16(), rows)
    with pytest.raises(ValueError, match="state must be"):
        call(q, k, v, g, beta, state[:, :, :4], rows)
    with pytest.raises(ValueError, match="multiple"):
        call(q[:, :1].expand(2, 3, 8), k[:, :1].expand(2, 3, 8), v, g, beta, state, rows)
    with pytest.raises(ValueError, match="k must be"):
        call(q, k.bfloat16(), v, g, beta, state, rows)
    with pytest.raises(ValueError, match="beta must be"):
        call(q, k, v, g, beta[:, :2], state, rows)
    with pytest.raises(ValueError, match="block_v"):
        call(q, k, v, g, beta, state, rows, block_v=3)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        call(q, k, v, g, beta, torch.zeros(3, 4, 8, 16)[..., ::2], rows, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 4, 8])
def test_gpu_at_qwen3_next_shapes(T):
    """bf16 on CUDA at Qwen3-Next's linear heads (16 key / 32 value heads of 128), 12 cache rows, q / k grouped and
    expanded, three steps in lockstep with the reference."""
    Hk, Hv, D, N = 16, 32, 128, 12
    gen = torch.Generator().manual_seed(T)
    state = (torch.randn(N, Hv, D, D, generator=gen) * 0.1).to(DEV)
    rows = torch.randperm(N, generator=gen)[:T].to(DEV)
    states = state.clone(), state.clone()
    for step in range(3):
        q, k, v, g, beta = step_inputs(T, Hk, Hv, D, D, torch.bfloat16, gen)
        if step == 1:
            q, k = expand(q, Hv), expand(k, Hv)
        close(kn.gdn_decode_rule(q, k, v, g, beta, states[0], rows),
              kn.gdn_decode_rule(q, k, v, g, beta, states[1], rows, impl="reference"))
        close_state(states[0], states[1])
    untouched = torch.ones(N, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(states[0][untouched], state[untouched])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_captured_in_a_cuda_graph():
    """Captured once, replayed on new inputs and new rows written into the captured tensors: each replay equals an
    eager reference step on the same rows (no host sync, nothing shape- or value-dependent on the host)."""
    T, Hk, Hv, D, N = 4, 16, 32, 128, 9
    gen = torch.Generator().manual_seed(11)
    state = (torch.randn(N, Hv, D, D, generator=gen) * 0.1).to(DEV)
    ref_state = state.clone()
    static = list(step_inputs(T, Hk, Hv, D, D, torch.bfloat16, gen))
    rows = torch.tensor([0, 5, 2, 7], device=DEV)
    kn.gdn_decode_rule(*static, state.clone(), rows)                   # compile outside the capture
    saved = state.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kn.gdn_decode_rule(*static, state, rows)
    state.copy_(saved)                                                 # capture does not run the kernel; be safe
    for step in range(3):
        new = step_inputs(T, Hk, Hv, D, D, torch.bfloat16, gen)
        for dst, src in zip(static, new):
            dst.copy_(src)
        rows.copy_(torch.randperm(N, generator=gen)[:T].to(DEV))
        graph.replay()
        want = kn.gdn_decode_rule(*new, ref_state, rows.clone(), impl="reference")
        close(out, want)
        close_state(state, ref_state)
