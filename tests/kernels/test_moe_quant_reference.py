"""kernels/moe_decode/quant.py's public functions (their reference path on the CPU) in lockstep with the plain codec (proto.expert_format) and moe_gemv."""
from __future__ import annotations

import pytest
import torch

from kernels.moe_decode import CopyPlan, moe_gemv
from kernels.moe_decode import quant as qr
from proto.expert_format import ExpertFormat, FormatError, QuantLayout, dequantize_expert, fp4_decode, quantize_expert

FORMATS = ("fp8", "int4-g32", "int4-g64", "int4", "mxfp4", "nvfp4")
H, I = 256, 128            # 2 x 1 fp8 blocks of [H, I]; several groups of every size


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (tells -0.0 from 0.0)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def quant_pool(label: str, num: int, seed: int = 0, pad: int = 48) -> tuple[torch.Tensor, QuantLayout]:
    """[num, N + pad] rows of random experts quantized to `label` (a padded stride, as the store's)."""
    fmt = ExpertFormat.parse(label)
    lay = QuantLayout(H, I, fmt)
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(num, lay.expert_nbytes + pad, dtype=torch.uint8)
    for e in range(num):
        scale = 10.0 ** float(torch.empty(()).uniform_(-3, 1, generator=g))
        quantize_expert(torch.randn(I, H, generator=g) * scale, torch.randn(I, H, generator=g),
                        torch.randn(H, I, generator=g) * 0.05, fmt, out=rows[e, :lay.expert_nbytes])
    return rows, lay


def test_fp4_values_are_fp4_decode_bit_for_bit():
    nib = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(bits(qr.fp4_values(nib)), bits(fp4_decode(nib)))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label", FORMATS)
def test_dequantize_rows_is_dequantize_expert_bit_for_bit(label, out_dtype, monkeypatch):
    rows, lay = quant_pool(label, 5)
    monkeypatch.setattr(qr, "DEQUANT_CHUNK_BYTES", 1)            # chunks of one row: the chunk edges too
    ids = torch.tensor([3, 0, 3, 4, 1], dtype=torch.int32)
    w13, w2 = qr.dequantize_rows(rows, ids, lay, out_dtype)
    assert w13.shape == (5, 2 * I, H) and w2.shape == (5, H, I) and w13.dtype == w2.dtype == out_dtype
    for j, e in enumerate(ids.tolist()):
        gate, up, down = dequantize_expert(rows[e], lay)
        assert torch.equal(bits(w13[j, :I]), bits(gate.to(out_dtype))), f"{label} gate of row {e}"
        assert torch.equal(bits(w13[j, I:]), bits(up.to(out_dtype))), f"{label} up of row {e}"
        assert torch.equal(bits(w2[j]), bits(down.to(out_dtype))), f"{label} down of row {e}"


@pytest.mark.parametrize("label", FORMATS)
def test_moe_gemv_quant_is_moe_gemv_over_the_dequantized_rows(label):
    rows, lay = quant_pool(label, 6, seed=1)
    S = rows.shape[0]
    w13, w2 = qr.dequantize_rows(rows, torch.arange(S), lay, torch.bfloat16)       # the whole pool, dequantized
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [-1, 2], [5, -1]])
    weights = torch.rand(3, 2, generator=g)
    got = qr.moe_gemv_quant(x, ids, weights, rows, lay)
    want = moe_gemv(x, ids, weights, w13, w2, impl="reference")
    assert got.dtype == torch.bfloat16 and torch.equal(bits(got), bits(want))


def test_moe_gemv_quant_runs_both_waits_before_reading_the_rows(monkeypatch):
    rows, lay = quant_pool("int4-g32", 3)
    x, ids, w = torch.zeros(1, H), torch.tensor([[0, 2]]), torch.ones(1, 2)
    log = []
    plan = CopyPlan(torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 2)
    real = qr.dequantize_rows

    def watched(*args, **kw):
        log.append("dequantize")
        return real(*args, **kw)

    monkeypatch.setattr(qr, "dequantize_rows", watched)
    qr.moe_gemv_quant(x, ids, w, rows, lay, plan=plan, between=lambda: log.append("between"),
                      between_down=lambda: log.append("between_down"))
    assert log == ["between", "between_down", "dequantize"]
    with pytest.raises(ValueError, match="between"):
        qr.moe_gemv_quant(x, ids, w, rows, lay, plan=plan)


def test_bad_rows_and_layouts_are_refused():
    rows, lay = quant_pool("nvfp4", 2)
    with pytest.raises(FormatError, match="uint8"):
        qr.dequantize_rows(rows.float(), torch.tensor([0]), lay, torch.float32)
    with pytest.raises(FormatError, match="uint8"):
        qr.dequantize_rows(rows[:, :lay.expert_nbytes - 16], torch.tensor([0]), lay, torch.float32)
    with pytest.raises(FormatError, match="QuantLayout"):
        qr.dequantize_rows(rows, torch.tensor([0]), object(), torch.float32)
    with pytest.raises(ValueError, match="H = "):
        qr.moe_gemv_quant(torch.zeros(1, H + 2), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), rows, lay)
