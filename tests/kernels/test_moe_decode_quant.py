"""kernels/moe_decode/quant.py: the decode MoE FFN over quantized slot rows (moe_gemv_quant) and the prefill's
dequantize_rows, each in lockstep with its torch reference (quant_reference.py: the format's reference codec,
proto.expert_format, then moe_gemv_reference's math), every format, odd group counts, -1 routes, a split
around a copy.

Without a GPU the kernels run in the Triton interpreter (conftest.py), which computes bfloat16 wrongly and
slowly: float32 and float16 activations, small shapes, blocks that keep the grids small but still cut H and I
into several ragged steps. Tests marked `gpu` run bf16 at qwen3-30b-a3b shapes on CUDA.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ftexpert.kernels.moe_decode import DEFAULT_GEMV_BLOCKS, CopyPlan, GemvBlocks
from ftexpert.kernels.moe_decode.api import QUANT_GEMV_BLOCKS
from ftexpert.kernels.moe_decode import reference as ref
from ftexpert.kernels.moe_decode.quant import GATE_UP_REGIONS, DequantBlocks, dequantize_rows, moe_gemv_quant
from ftexpert.kernels.moe_decode.quant_reference import dequantize_rows_reference, moe_gemv_quant_reference
from ftexpert.proto.expert_format import ExpertFormat, FormatError, QuantLayout
from ftexpert.kernels.expert_reference import dequantize_expert, quantize_expert, unpack_expert
from tests.conftest import KERNEL_DEVICE, assert_compile_check

DEV = KERNEL_DEVICE
FORMATS = ["fp8", "int4-g32", "int4-g64", "int4-g128", "mxfp4", "nvfp4"]
# H, I per format: odd group counts along both K dims, and H, I that the blocks below do not divide
SHAPES = {"fp8": (200, 72), "int4-g32": (96, 160), "int4-g64": (192, 64), "int4-g128": (128, 384),
          "mxfp4": (96, 160), "nvfp4": (80, 48)}
BLOCKS = GemvBlocks(gate_up_block_n=32, gate_up_block_k=64, down_block_n=64, down_block_k=64, sum_block=64)
SPLIT_ROW = 32                     # row stride padding: slot rows longer than an expert


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def slot_rows(label: str, S: int, seed: int = 0, scramble: bool = False) -> tuple[torch.Tensor, QuantLayout]:
    """S random experts quantized into rows [S, expert_nbytes + SPLIT_ROW] uint8. scramble: code bytes and
    scale / zero bytes replaced by random ones too (every code value, E4M3 subnormals, all zero points)."""
    fmt = ExpertFormat.parse(label)
    H, I = SHAPES[label]
    layout = QuantLayout(H, I, fmt)
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(S, layout.expert_nbytes + SPLIT_ROW, dtype=torch.uint8)
    for s in range(S):
        gate, up, down = (torch.randn(r, c, generator=g) * 0.1 for r, c in ((I, H), (I, H), (H, I)))
        quantize_expert(gate, up, down, fmt, out=rows[s, :layout.expert_nbytes])
        if scramble:
            for m in unpack_expert(rows[s], layout):
                codes = torch.randint(0, 256, m.codes.shape, generator=g, dtype=torch.uint8)
                if fmt.name == "fp8":
                    codes[(codes & 0x7F) == 0x7F] = 0x7E         # E4M3 NaN: decodes to +-480 (quant_kernels)
                m.codes.copy_(codes)
                if fmt.name in ("fp8", "int4"):
                    m.scales.copy_(torch.rand(m.scales.shape, generator=g) * 2.0 ** torch.randint(-20, 4, m.scales.shape, generator=g))
                elif fmt.name == "mxfp4":
                    m.scales.copy_(torch.randint(0, 255, m.scales.shape, generator=g, dtype=torch.uint8))
                else:
                    sc = torch.randint(0, 256, m.scales.shape, generator=g, dtype=torch.uint8)
                    sc[(sc & 0x7F) == 0x7F] = 0x7E
                    m.scales.copy_(sc)
                if m.zeros is not None:
                    m.zeros.copy_(torch.randint(0, 256, m.zeros.shape, generator=g, dtype=torch.uint8))
    return rows, layout


def routes(T, K, S, seed, missing=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    if missing:
        ids.view(-1)[torch.randperm(T * K, generator=g)[:missing]] = -1
    return ids, torch.rand(T, K, generator=g)


# -- decoding: bit for bit ------------------------------------------------------------------------

@pytest.mark.parametrize("label", FORMATS)
def test_dequantize_rows_is_the_reference_codec_bit_for_bit(label):
    """Every code value (random bytes), random scales and zero points, E4M3 / fp32 subnormals: the kernel's
    float32 weights are dequantize_expert's exactly; -1 rows are zeros; float16 output is its rounding."""
    rows, layout = slot_rows(label, 3, seed=1, scramble=True)
    H, I = SHAPES[label]
    ids = torch.tensor([2, -1, 0], dtype=torch.int32)
    w13, w2 = dequantize_rows(rows.to(DEV), ids.to(DEV), layout, torch.float32, impl="triton",
                              blocks=DequantBlocks(block_n=64, block_k=64))
    assert w13.shape == (3, 2 * I, H) and w2.shape == (3, H, I)
    for i, e in enumerate(ids.tolist()):
        if e < 0:
            assert not w13[i].any() and not w2[i].any()
            continue
        gate, up, down = dequantize_expert(rows[e], layout)
        assert torch.equal(w13[i, :I].cpu(), gate) and torch.equal(w13[i, I:].cpu(), up)
        assert torch.equal(w2[i].cpu(), down)
    r13, r2 = dequantize_rows_reference(rows, ids, layout, torch.float32)
    assert torch.equal(w13.cpu(), r13) and torch.equal(w2.cpu(), r2)
    h13, h2 = dequantize_rows(rows.to(DEV), ids.to(DEV), layout, torch.float16, impl="triton",
                              blocks=DequantBlocks(block_n=64, block_k=64))
    assert torch.equal(h13.cpu(), r13.half()) and torch.equal(h2.cpu(), r2.half())


def test_dequantize_rows_writes_the_packed_expert_layout_into_out():
    rows, layout = slot_rows("nvfp4", 2, seed=2)
    H, I = SHAPES["nvfp4"]
    out = torch.full((2, 3 * I * H + 8), 7.0).to(DEV)
    w13, w2 = dequantize_rows(rows.to(DEV), torch.tensor([1, 0]).to(DEV), layout, torch.float32, out=out,
                              impl="triton", blocks=DequantBlocks(block_n=64, block_k=64))
    assert w13.data_ptr() == out.data_ptr() and w2.data_ptr() == out[:, 2 * I * H:].data_ptr()
    gate, up, down = dequantize_expert(rows[1], layout)
    assert torch.equal(out[0, :3 * I * H].cpu(), torch.cat([gate.reshape(-1), up.reshape(-1), down.reshape(-1)]))
    assert torch.all(out[:, 3 * I * H:] == 7.0)                     # past the experts: untouched


# -- moe_gemv_quant -------------------------------------------------------------------------------

GEMV_CASES = {
    # name: (format, T, K, S, missing, x dtype)
    "fp8-t1-k8": ("fp8", 1, 8, 9, 0, torch.float32),
    "fp8-t4-k2-missing-fp16": ("fp8", 4, 2, 6, 2, torch.float16),
    "int4-g32-t4-k3-missing": ("int4-g32", 4, 3, 5, 3, torch.float32),
    "int4-g64-t1-k5-fp16": ("int4-g64", 1, 5, 6, 1, torch.float16),
    "int4-g128-t2-k2": ("int4-g128", 2, 2, 4, 0, torch.float32),
    "mxfp4-t1-k6-missing": ("mxfp4", 1, 6, 7, 2, torch.float32),
    "mxfp4-t4-k2-fp16": ("mxfp4", 4, 2, 4, 1, torch.float16),
    "nvfp4-t4-k4-missing": ("nvfp4", 4, 4, 6, 5, torch.float32),
    "nvfp4-t1-k8": ("nvfp4", 1, 8, 8, 0, torch.float32),
}


GSUM_CASES = ["int4-g32-t4-k3-missing", "int4-g64-t1-k5-fp16", "mxfp4-t1-k6-missing", "mxfp4-t4-k2-fp16",
              "nvfp4-t4-k4-missing", "nvfp4-t1-k8"]


@pytest.mark.parametrize("case,group_sum", [(c, False) for c in GEMV_CASES] + [(c, True) for c in GSUM_CASES])
def test_moe_gemv_quant_lockstep(case, group_sum):
    """The Triton kernels against the reference; group_sum: a scale applied to each group's sum (the 4-bit
    formats' GemvBlocks.quant_group_sum), the same bound."""
    label, T, K, S, missing, dtype = GEMV_CASES[case]
    rows, layout = slot_rows(label, S, seed=T * 7 + K)
    ids, weights = routes(T, K, S, seed=T + K, missing=missing)
    weights[ids < 0] = float("nan")                                  # a missing route's weight is never read
    x = torch.randn(T, SHAPES[label][0], generator=torch.Generator().manual_seed(K)).to(dtype)
    expected = moe_gemv_quant_reference(x, ids, weights, rows, layout)
    got = moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout,
                         impl="triton", blocks=replace(BLOCKS, quant_group_sum=group_sum))
    assert got.dtype == dtype and got.shape == x.shape and torch.isfinite(got).all()
    # float32: summation order only; float16: that, and a rounding flip of an fp16 intermediate now and then
    assert rel_max(got, expected) < (1e-5 if dtype == torch.float32 else 4e-3)
    if (ids < 0).all(dim=1).any():
        assert not got[(ids < 0).all(dim=1).to(DEV)].any()


@pytest.mark.parametrize("case", ["mxfp4-t1-k6-missing", "nvfp4-t4-k4-missing"])
def test_the_default_blocks_of_the_fp4_formats_are_the_measured_ones_and_match_the_reference(case):
    """mxfp4 and nvfp4 run QUANT_GEMV_BLOCKS when no blocks are given (the sweep's winner: 8 x 512 / 8 x 256 and
    the scale a group's sum), in lockstep with the reference; the other formats keep DEFAULT_GEMV_BLOCKS."""
    assert QUANT_GEMV_BLOCKS["mxfp4"].quant_group_sum and QUANT_GEMV_BLOCKS["nvfp4"].quant_group_sum
    assert (QUANT_GEMV_BLOCKS["mxfp4"].gate_up_block_n, QUANT_GEMV_BLOCKS["mxfp4"].down_block_n) == (8, 8)
    assert set(QUANT_GEMV_BLOCKS) == {"mxfp4", "nvfp4"} and not DEFAULT_GEMV_BLOCKS.quant_group_sum
    label, T, K, S, missing, dtype = GEMV_CASES[case]
    rows, layout = slot_rows(label, S, seed=T + K)
    ids, weights = routes(T, K, S, seed=T * K, missing=missing)
    x = torch.randn(T, SHAPES[label][0], generator=torch.Generator().manual_seed(T)).to(dtype)
    expected = moe_gemv_quant_reference(x, ids, weights, rows, layout)
    got = moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout, impl="triton")
    assert rel_max(got, expected) < 1e-5
    with pytest.MonkeyPatch.context() as mp:                      # no blocks given: the format's are the ones read
        mp.setitem(QUANT_GEMV_BLOCKS, layout.fmt.name, GemvBlocks(gate_up_block_n=3))
        with pytest.raises(ValueError, match="gate_up_block_n = 3"):
            moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout)


def test_the_reference_is_moe_gemv_reference_over_the_decoded_experts():
    """float32: the quantized reference is the bf16 path's reference run on dequantize_expert's weights."""
    label, S = "int4-g32", 5
    rows, layout = slot_rows(label, S, seed=4)
    H, I = SHAPES[label]
    w13 = torch.empty(S, 2 * I, H)
    w2 = torch.empty(S, H, I)
    for e in range(S):
        gate, up, down = dequantize_expert(rows[e], layout)
        w13[e, :I], w13[e, I:], w2[e] = gate, up, down
    ids, weights = routes(3, 4, S, seed=5, missing=2)
    x = torch.randn(3, H)
    assert torch.equal(moe_gemv_quant_reference(x, ids, weights, rows, layout),
                       ref.moe_gemv_reference(x, ids, weights, w13, w2))
    assert torch.equal(moe_gemv_quant(x, ids, weights, rows, layout, impl="reference"),
                       moe_gemv_quant_reference(x, ids, weights, rows, layout))


@pytest.mark.parametrize("label", ["fp8", "nvfp4"])
def test_the_split_around_a_copy_is_the_unsplit_call_bit_for_bit(label):
    """The plan's slots get their w13 bytes in between() and their w2 bytes in between_down(): a launch that
    read them early would compute with the stale rows. The result equals the unsplit call on the landed rows."""
    S, T, K = 6, 2, 3
    stale, layout = slot_rows(label, S, seed=8)
    landed, _ = slot_rows(label, S, seed=9)
    ids = torch.tensor([[0, 3, 5], [3, -1, 1]], dtype=torch.int32)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(1))
    x = torch.randn(T, layout.hidden_size, generator=torch.Generator().manual_seed(2))
    plan_slots, extra = [3, 4], 5                                    # slot 4 unrouted; 5: the split slot
    first = [layout.regions[n] for n in GATE_UP_REGIONS if n in layout.regions]   # what gate/up reads
    rows = stale.clone().to(DEV)
    for s in range(S):
        if s not in plan_slots + [extra]:
            rows[s] = landed[s].to(DEV)
    calls = []

    def copy(second: bool):
        for s in plan_slots + [extra]:
            if second:                                               # the w2 part (and the rest of the row)
                rows[s] = landed[s].to(DEV)
            for off, n in [] if second else first:
                rows[s, off:off + n] = landed[s, off:off + n].to(DEV)
        calls.append("w2" if second else "w13")
    plan = CopyPlan(torch.tensor(plan_slots, dtype=torch.int32, device=DEV),
                    torch.tensor([len(plan_slots)], dtype=torch.int32, device=DEV), len(plan_slots),
                    extra_slot=extra)
    got = moe_gemv_quant(x.to(DEV), ids.to(DEV), weights.to(DEV), rows, layout, impl="triton", blocks=BLOCKS,
                         plan=plan, between=lambda: copy(False), between_down=lambda: copy(True))
    assert calls == ["w13", "w2"]
    assert torch.equal(rows.cpu(), landed)
    whole = moe_gemv_quant(x.to(DEV), ids.to(DEV), weights.to(DEV), landed.to(DEV), layout, impl="triton",
                           blocks=BLOCKS)
    assert torch.equal(got.cpu(), whole.cpu())
    assert rel_max(got, moe_gemv_quant_reference(x, ids, weights, landed, layout)) < 1e-5


def test_missing_routes_read_no_bytes():
    """-1 routes of a pool whose row before row 0 is all 0x7f bytes (codes of +-480, huge scales): nothing
    leaks in."""
    label = "fp8"
    rows, layout = slot_rows(label, 4, seed=3)
    backing = torch.cat([torch.full((1, rows.shape[1]), 0x7F, dtype=torch.uint8), rows])
    ids = torch.tensor([[-1, 2], [1, -1]])
    weights = torch.rand(2, 2)
    x = torch.randn(2, layout.hidden_size)
    got = moe_gemv_quant(x.to(DEV), ids.to(DEV), weights.to(DEV), backing[1:].to(DEV), layout, impl="triton",
                         blocks=BLOCKS)
    assert torch.isfinite(got).all()
    assert rel_max(got, moe_gemv_quant_reference(x, ids, weights, rows, layout)) < 1e-5


def test_bad_arguments_get_clear_errors():
    rows, layout = slot_rows("mxfp4", 2)
    H = layout.hidden_size
    x, ids, w = torch.randn(1, H), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
    with pytest.raises(TypeError, match="QuantLayout"):
        moe_gemv_quant(x, ids, w, rows, object())
    with pytest.raises(ValueError, match="H = "):
        moe_gemv_quant(torch.randn(1, H + 2), ids, w, rows, layout)
    with pytest.raises(ValueError, match="uint8"):
        moe_gemv_quant(x, ids, w, rows.float(), layout)
    with pytest.raises(ValueError, match="takes"):
        moe_gemv_quant(x, ids, w, rows[:, :layout.expert_nbytes - 16], layout)
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_gemv_quant(x, ids, w, torch.zeros(2, layout.expert_nbytes + 4, dtype=torch.uint8)[:, :layout.expert_nbytes],
                       layout)
    with pytest.raises(ValueError, match="powers of two"):
        moe_gemv_quant(x, ids, w, rows, layout, impl="triton", blocks=GemvBlocks(gate_up_block_k=48))
    with pytest.raises(ValueError, match="between"):
        moe_gemv_quant(x, ids, w, rows, layout, plan=CopyPlan(torch.zeros(1, dtype=torch.int32),
                                                              torch.zeros(1, dtype=torch.int32), 1))
    with pytest.raises(ValueError, match="impl"):
        moe_gemv_quant(x, ids, w, rows, layout, impl="fast")
    with pytest.raises(FormatError, match="group size 32 does not divide"):
        QuantLayout(100, 64, ExpertFormat("mxfp4"))
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize_rows(rows, torch.zeros(1, dtype=torch.int64), layout, torch.int8)


@pytest.mark.slow
def test_quant_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler on every format's kernels (see tests/kernels/test_moe_decode.py): ~1 min."""
    assert_compile_check("ftexpert.kernels.moe_decode.quant_compile_check")


# -- GPU -----------------------------------------------------------------------------------------

BF16_ULP = 2.0 ** -8


def gpu_rows(label: str, S: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, QuantLayout]:
    fmt = ExpertFormat.parse(label)
    layout = QuantLayout(H, I, fmt)
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.empty(S, layout.expert_nbytes, dtype=torch.uint8, device="cuda")
    for s in range(S):
        gate, up, down = (torch.randn(r, c, generator=g, device="cuda") * 0.02 for r, c in ((I, H), (I, H), (H, I)))
        quantize_expert(gate, up, down, fmt, out=rows[s])
    return rows, layout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("label", ["fp8", "int4-g128", "int4-g32", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_moe_gemv_quant_bf16_at_qwen3_shapes(label, T):
    """bf16 at qwen3-30b-a3b shapes (H=2048, I=768, K=8) against the reference on the GPU: the same rounding
    points, so only fp32 summation order and bf16 rounding flips differ (as the bf16 kernel's test);
    bit-exact dequantize_rows; deterministic; the same inside a CUDA graph; split = unsplit."""
    S, H, I, K = 24, 2048, 768, 8
    rows, layout = gpu_rows(label, S, H, I, seed=T)
    ids, weights = routes(T, K, S, seed=T, missing=1 if T > 1 else 0)
    ids, weights = ids.cuda(), torch.softmax(weights, -1).cuda()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
    expected = moe_gemv_quant_reference(x, ids, weights, rows, layout)
    got = moe_gemv_quant(x, ids, weights, rows, layout)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_max(got, expected) < 8 * BF16_ULP
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2 * BF16_ULP
    assert torch.equal(moe_gemv_quant(x, ids, weights, rows, layout), got)         # deterministic
    plan = CopyPlan(ids.view(-1)[:3].clamp(min=0).to(torch.int32), torch.tensor([3], dtype=torch.int32, device="cuda"), 3)
    assert torch.equal(moe_gemv_quant(x, ids, weights, rows, layout, plan=plan, between=lambda: None), got)
    some = torch.tensor([ids.view(-1)[0].item(), -1, 5], device="cuda")
    w13, w2 = dequantize_rows(rows, some, layout, torch.float32)
    r13, r2 = dequantize_rows_reference(rows, some, layout, torch.float32)
    assert torch.equal(w13, r13) and torch.equal(w2, r2)
    b13, _ = dequantize_rows(rows, some, layout, torch.bfloat16)
    assert torch.equal(b13, r13.to(torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_gemv_quant(x, ids, weights, rows, layout)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static = moe_gemv_quant(x, ids, weights, rows, layout)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, got)


@pytest.mark.parametrize("case", ["nvfp4-t4-k4-missing", "mxfp4-t1-k6-missing", "int4-g128-t2-k2", "fp8-t1-k8"])
def test_partials_are_the_routes_outputs_whose_sum_is_the_call(case):
    """partials=True: the weighted per-route outputs [T, K, H] fp32 (a missing route exactly 0), whose sum in k order
    (reference.sum_routes) is the summed call bit for bit (float32: the sum launch rounds nothing); the reference's
    partials likewise."""
    from ftexpert.kernels.moe_decode.reference import sum_routes
    label, T, K, S, missing, dtype = GEMV_CASES[case]
    rows, layout = slot_rows(label, S, seed=T * 7 + K)
    ids, weights = routes(T, K, S, seed=T + K, missing=missing)
    x = torch.randn(T, SHAPES[label][0], generator=torch.Generator().manual_seed(K)).to(dtype)
    args = (x.to(DEV), ids.to(DEV), weights.to(DEV), rows.to(DEV), layout)
    parts = moe_gemv_quant(*args, impl="triton", blocks=BLOCKS, partials=True)
    assert parts.shape == (T, K, x.shape[1]) and parts.dtype == torch.float32
    assert not parts[(ids < 0).to(DEV)].any()
    assert torch.equal(sum_routes(parts, x.dtype), moe_gemv_quant(*args, impl="triton", blocks=BLOCKS))
    ref_parts = moe_gemv_quant_reference(x, ids, weights, rows, layout, partials=True)
    assert torch.equal(sum_routes(ref_parts, x.dtype), moe_gemv_quant_reference(x, ids, weights, rows, layout))
    assert rel_max(parts, ref_parts) < 1e-5
