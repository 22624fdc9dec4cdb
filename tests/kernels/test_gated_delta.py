"""kernels/gated_delta: the chunked form against the token-by-token recurrence (CPU, fp32), both against
transformers' own torch gated delta rule, and flash-linear-attention's kernels in lockstep with the reference
(GPU, marked gpu)."""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels import gated_delta
from ftexpert.kernels.gated_delta import reference


def inputs(B=2, T=150, Hk=2, Hv=4, Dk=16, Dv=32, device="cpu", dtype=torch.float32, seed=0, state=True):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)
    q, k, v = rnd(B, T, Hk, Dk), rnd(B, T, Hk, Dk), rnd(B, T, Hv, Dv)
    g = -torch.rand(B, T, Hv, generator=gen, device=device) * 2                 # log decay <= 0
    beta = torch.rand(B, T, Hv, generator=gen, device=device)
    s0 = rnd(B, Hv, Dk, Dv) if state else None
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype), s0]


@pytest.mark.parametrize("T", [1, 63, 64, 150])
def test_chunked_equals_the_recurrence(T):
    args = inputs(T=T)
    o_c, s_c = reference.chunk_gated_delta_rule(*args)
    o_r, s_r = reference.recurrent_gated_delta_rule(*args)
    assert o_c.shape == (2, T, 4, 32) and s_c.shape == (2, 4, 16, 32) and s_c.dtype == torch.float32
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-4)


def test_a_sequence_split_carries_its_state():
    q, k, v, g, beta, s0 = inputs(T=100)
    o_all, s_all = reference.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    o1, s1 = reference.chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], s0)
    o2, s2 = reference.recurrent_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-4)


def test_the_reference_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from tests.gpu_worker.qwen3_next_util import torch_reference_kernels
    torch_reference_kernels()
    q, k, v, g, beta, s0 = inputs(T=90)
    for ours, theirs in ((reference.chunk_gated_delta_rule, hf.torch_chunk_gated_delta_rule),
                         (reference.recurrent_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)):
        o, s = ours(q, k, v, g, beta, s0)
        o_hf, s_hf = theirs(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)


def test_bad_impl_and_shapes_are_refused():
    args = inputs(T=4)
    with pytest.raises(ValueError, match="impl must be one of"):
        gated_delta.chunk_gated_delta_rule(*args, impl="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gated_delta.recurrent_gated_delta_rule(*args, impl="fla")
    q, k, v, g, beta, s0 = args
    with pytest.raises(ValueError, match="initial_state has shape"):
        reference.recurrent_gated_delta_rule(q, k, v, g, beta, s0[:, :2])
    with pytest.raises(ValueError, match="multiple of key heads"):
        reference.chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


@pytest.mark.skipif(not gated_delta.fla_available(), reason="flash-linear-attention (fla-core) is not installed")
def test_fla_recurrent_matches_the_reference_in_the_triton_interpreter():
    """The decode kernel through fla's own signature (its fifth positional argument is gk, not beta), on the CPU
    under TRITON_INTERPRET (tests/conftest.py sets it), grouped value heads and an initial state."""
    from ftexpert.kernels.gated_delta.fla_path import fla_recurrent
    args = inputs(B=2, T=2, Hk=2, Hv=4, Dk=16, Dv=32)
    o, s = fla_recurrent(*args)
    o_ref, s_ref = reference.recurrent_gated_delta_rule(*args)
    assert ((o - o_ref).norm() / o_ref.norm()).item() <= 1e-5
    assert ((s - s_ref).norm() / s_ref.norm()).item() <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,rule", [(1, "recurrent"), (2, "recurrent"), (100, "chunk"), (1024, "chunk")])
def test_fla_matches_the_reference(dtype, T, rule):
    """Qwen3-Next's linear-layer shape (16 key / 32 value heads of 128), B = 2, fla against the fp32 reference."""
    if not gated_delta.fla_available():
        pytest.fail("flash-linear-attention (fla-core) does not import on this GPU machine; "
                    "install it (docs/DEPENDENCIES.md) to test the fla path")
    args = inputs(B=2, T=T, Hk=16, Hv=32, Dk=128, Dv=128, device="cuda", dtype=dtype)
    fn = {"chunk": gated_delta.chunk_gated_delta_rule, "recurrent": gated_delta.recurrent_gated_delta_rule}[rule]
    o, s = fn(*args, impl="fla")
    ref_fn = {"chunk": reference.chunk_gated_delta_rule, "recurrent": reference.recurrent_gated_delta_rule}[rule]
    o_ref, s_ref = ref_fn(*[a.float() if a is not None else None for a in args])
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    assert o.dtype == dtype and s.dtype == torch.float32
    assert ((o.float() - o_ref).norm() / o_ref.norm()).item() <= tol
    assert ((s - s_ref).norm() / s_ref.norm()).item() <= tol
