"""moe_gemv with gpt-oss's expert biases and clamped SwiGLU: the Triton kernels (the interpreter here, float32,
small blocks with ragged edges) in lockstep with the torch reference, both against the model's expert maths
(gpu_worker.backends.expert_math.act_expert_ffn, which follows transformers' GptOssExperts), with routes at -1 and a
copy plan split. A GPU test checks bfloat16 at gpt-oss-120b's shapes."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.backends.expert_math import act_expert_ffn
from ftexpert.kernels.moe_decode import CopyPlan, GemvBlocks, moe_gemv
from ftexpert.proto.expert_act import gpt_oss_act
from tests.conftest import KERNEL_DEVICE

DEV = KERNEL_DEVICE
SMALL = GemvBlocks(gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16, sum_block=32)
ACT = gpt_oss_act()


def case(T=3, K=4, S=6, H=40, I=24, dtype=torch.float32, seed=0, scale=0.8, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 2
    w13 = torch.randn(S, 2 * I, H, generator=g) * scale           # large: gate/up reach past the clamp at 7
    w2 = torch.randn(S, H, I, generator=g) * 0.1
    b13 = torch.randn(S, 2 * I, generator=g)
    b2 = torch.randn(S, H, generator=g)
    ids = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    ids[1, 2] = -1                                                 # a route not on the GPU: adds exactly 0
    w = torch.softmax(torch.randn(T, K, generator=g), dim=-1)
    to = lambda t: t.to(device=device, dtype=dtype)                # noqa: E731
    return (to(x), ids.to(device), w.to(device), to(w13), to(w2), to(b13), to(b2))


def rel_max(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_clamp_bites_in_these_cases():
    x, ids, _, w13, _, b13, _ = case()
    gate_up = torch.einsum("sih,th->tsi", w13, x) + b13
    assert (gate_up > ACT.limit).any() and (gate_up < -ACT.limit).any()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_biased_gemv_matches_the_model_maths(impl):
    x, ids, w, w13, w2, b13, b2 = case()
    want = act_expert_ffn(x, ids, w, w13, w2, b13, b2, ACT)
    got = moe_gemv(x, ids, w, w13, w2, impl=impl, blocks=SMALL, b13=b13, b2=b2, act=ACT)
    assert rel_max(got, want) <= 1e-5
    silu = moe_gemv(x, ids, w, w13, w2, impl=impl, blocks=SMALL)   # without: a different function
    assert rel_max(silu, want) > 0.1


def test_triton_in_lockstep_with_the_reference_with_a_copy_plan_split():
    x, ids, w, w13, w2, b13, b2 = case(T=4, seed=3)
    ref = moe_gemv(x, ids, w, w13, w2, impl="reference", b13=b13, b2=b2, act=ACT)
    plan = CopyPlan(torch.tensor([int(ids[0, 0]), int(ids[2, 1])], dtype=torch.int32, device=DEV),
                    torch.tensor([2], dtype=torch.int32, device=DEV), max_len=2)
    calls = []
    got = moe_gemv(x, ids, w, w13, w2, impl="triton", blocks=SMALL, plan=plan, between=lambda: calls.append(1),
                   b13=b13, b2=b2, act=ACT)
    assert calls == [1] and rel_max(got, ref) <= 1e-5
    plain = moe_gemv(x, ids, w, w13, w2, impl="triton", blocks=SMALL, b13=b13, b2=b2, act=ACT)
    assert torch.equal(got, plain)                                 # the split changes no arithmetic


def test_bias_views_of_packed_rows_are_taken_in_place():
    """The backends pass the rows' bias tails (strided views) straight to the kernel."""
    from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, bias_views, unpack_experts
    x, ids, w, w13, w2, b13, b2 = case()
    S, I2, H = w13.shape
    lay = ExpertLayout(H, I2 // 2, torch.float32, act=ACT)
    rows = lay.zeros_layer(S, device=DEV)
    v13, v2 = unpack_experts(rows, lay)
    v13.copy_(w13), v2.copy_(w2)
    c13, c2 = bias_views(rows, lay)
    c13.copy_(b13), c2.copy_(b2)
    got = moe_gemv(x, ids, w, v13, v2, impl="triton", blocks=SMALL, b13=c13, b2=c2, act=ACT)
    assert rel_max(got, act_expert_ffn(x, ids, w, w13, w2, b13, b2, ACT)) <= 1e-5


def test_misuse_is_refused():
    x, ids, w, w13, w2, b13, b2 = case()
    with pytest.raises(ValueError, match="both biases"):
        moe_gemv(x, ids, w, w13, w2, b13=b13, act=ACT)
    with pytest.raises(ValueError, match=r"\[S, 2I\]"):
        moe_gemv(x, ids, w, w13, w2, b13=b13[:, :4], b2=b2, act=ACT)


@pytest.mark.gpu
def test_bf16_at_gpt_oss_120b_shapes_on_the_gpu():
    x, ids, w, w13, w2, b13, b2 = case(T=4, K=4, S=16, H=2880, I=2880, dtype=torch.bfloat16, scale=0.05,
                                       device="cuda")
    ref = moe_gemv(x, ids, w, w13, w2, impl="reference", b13=b13, b2=b2, act=ACT)
    got = moe_gemv(x, ids, w, w13, w2, impl="triton", b13=b13, b2=b2, act=ACT)
    assert rel_max(got, ref) <= 2e-2


@pytest.mark.parametrize("fmt", ["mxfp4", "int4-g32"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_biased_quantized_gemv_matches_the_model_maths(fmt, impl):
    """moe_gemv_quant with the biases (the rows' bias tails) and the clamped SwiGLU, against act_expert_ffn over
    the dequantized weights."""
    from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, bias_views
    from ftexpert.kernels.moe_decode.quant import dequantize_rows, moe_gemv_quant
    from ftexpert.kernels.expert_reference import quantize_expert
    x, ids, w, w13, w2, b13, b2 = case(H=64, I=32)
    S, I2, H = w13.shape
    lay = ExpertLayout(H, I2 // 2, torch.float32, fmt, ACT)
    host = lay.zeros_layer(S)                                      # quantized on the host, then moved
    for s in range(S):
        quantize_expert(w13[s, : I2 // 2].cpu(), w13[s, I2 // 2:].cpu(), w2[s].cpu(), lay.fmt, out=host[s])
    rows = host.to(DEV)
    c13, c2 = bias_views(rows, lay)
    c13.copy_(b13), c2.copy_(b2)
    dq13, dq2 = dequantize_rows(rows, torch.arange(S, device=DEV), lay.quant_layout, torch.float32, impl="reference")
    want = act_expert_ffn(x, ids, w, dq13, dq2, b13, b2, ACT)
    got = moe_gemv_quant(x, ids, w, rows, lay.quant_layout, impl=impl, blocks=SMALL_Q, b13=c13, b2=c2, act=ACT)
    assert rel_max(got, want) <= 1e-5


SMALL_Q = GemvBlocks(gate_up_block_n=8, gate_up_block_k=32, down_block_n=16, down_block_k=32, sum_block=32)
