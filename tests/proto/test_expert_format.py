"""The expert format contract: layouts, the reference codec against a per-element definition, misuse."""
import math
import struct

import pytest
import torch

from ftexpert.proto.expert_format import FORMATS, ExpertFormat, FormatError, QuantLayout
from ftexpert.kernels.expert_reference import (dequantize_expert, dequantize_matrix, quantize_expert, quantize_matrix,
                                              unpack_expert)

QUANT = ["fp8", "int4", "int4-g32", "int4-g64", "mxfp4", "nvfp4"]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _element(q, fmt, r, k):
    """Weight (r, k) decoded from the bytes by the format's written definition, one element at a time."""
    if fmt.name == "fp8":
        code = q.codes[r, k:k + 1].view(torch.float8_e4m3fn).float().item()
        return f32(code * q.scales[r // 128, k // 128].item())
    byte = int(q.codes[r, k // 2])
    nib = byte & 0xF if k % 2 == 0 else byte >> 4
    g = k // fmt.group_size
    if fmt.name == "int4":
        return f32((nib - int(q.zeros[r, g])) * q.scales[r, g].item())
    val = (-1.0 if nib & 8 else 1.0) * E2M1[nib & 7]
    if fmt.name == "mxfp4":
        return f32(val * math.ldexp(1.0, int(q.scales[r, g]) - 127))
    scale = f32(q.scales[r, g:g + 1].view(torch.float8_e4m3fn).float().item() * f32(q.global_scale))
    return f32(val * scale)


@pytest.mark.parametrize("name", QUANT)
def test_dequantize_is_the_per_element_definition(name):
    fmt = ExpertFormat.parse(name)
    torch.manual_seed(1)
    rows, k = (130, 260) if name == "fp8" else (5, 3 * fmt.group_size)   # partial fp8 blocks; 3 groups
    w = torch.randn(rows, k) * 0.05
    q = quantize_matrix(w, fmt)
    deq = dequantize_matrix(q, fmt, rows, k)
    for r in range(0, rows, 7 if rows > 10 else 1):
        for kk in range(0, k, 3):
            assert deq[r, kk].item() == pytest.approx(_element(q, fmt, r, kk), rel=0, abs=0)
    rel = ((deq - w).norm() / w.norm()).item()
    assert rel < (0.04 if name == "fp8" else 0.15), rel


@pytest.mark.parametrize("name", QUANT)
def test_expert_bytes_round_trip_exactly(name):
    fmt = ExpertFormat.parse(name)
    torch.manual_seed(2)
    H, I = (192, 136) if name == "fp8" else (2 * 128, 3 * 128)
    layout = QuantLayout(H, I, fmt)
    mats = [torch.randn(I, H), torch.randn(I, H), torch.randn(H, I)]
    row = quantize_expert(*mats, fmt)
    assert row.numel() == layout.expert_nbytes and layout.expert_nbytes % 16 == 0
    for region, (off, n) in layout.regions.items():
        assert off % 16 == 0 and off + n <= layout.expert_nbytes, region
    for got, want, shape in zip(dequantize_expert(row, layout), mats, [(I, H), (I, H), (H, I)]):
        ref = dequantize_matrix(quantize_matrix(want, fmt), fmt, *shape)
        assert torch.equal(got, ref)
    gate, up, down = unpack_expert(row, layout)
    assert gate.codes.data_ptr() == row.data_ptr()          # views, no copy


def test_four_bit_experts_are_about_a_quarter_of_bf16():
    H, I = 2048, 768                                         # the qwen3-30b-a3b expert
    bf16 = 3 * H * I * 2
    for name, ratio in (("fp8", 1.99), ("int4", 3.7), ("mxfp4", 3.76), ("nvfp4", 3.55)):
        assert bf16 / QuantLayout(H, I, ExpertFormat.parse(name)).expert_nbytes == pytest.approx(ratio, abs=0.02)


def test_misuse_is_refused_with_a_reason():
    with pytest.raises(FormatError, match="not supported"):
        ExpertFormat.parse("int3")
    with pytest.raises(FormatError, match="group size 48"):
        ExpertFormat.parse("int4-g48")
    with pytest.raises(FormatError, match="does not divide the intermediate size 96"):
        QuantLayout(128, 96, ExpertFormat.parse("int4"))
    with pytest.raises(FormatError, match="groups of 32"):
        ExpertFormat("mxfp4", 16)
    layout = QuantLayout(64, 64, ExpertFormat.parse("mxfp4"))
    with pytest.raises(FormatError, match="uint8 bytes"):
        unpack_expert(torch.zeros(10, dtype=torch.uint8), layout)
    assert set(FORMATS) == {"bf16", "fp8", "int4", "mxfp4", "nvfp4"}
