"""bench/kernel_table.py's kernel families of a resident decode step: which kernel names fall in which family, the
bytes each must read, and the rate, on a table of kernels as the H100 profile of gpt-oss-120b gave them."""
from __future__ import annotations

import pytest

from bench.kernel_table import family_rates, family_table

# (name, us a step, calls a step): bench_engine.py --preset gpt-oss-120b --profile 4 on an H100 (docs/ARCHITECTURES.md)
GPT_OSS_ROWS = [
    ("moe_gate_up_quant_kernel", 1116.6, 36.0), ("moe_down_quant_kernel", 995.5, 36.0),
    ("moe_sum_k_kernel", 732.9, 36.0), ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_bias_TNT", 465.4, 36.0),
    ("nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT", 406.2, 1.0),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_bias_TNT", 399.8, 36.0), ("offset_norm_kernel", 249.9, 73.0),
    ("decode_attn_split_kernel", 212.4, 36.0), ("decode_attn_merge_kernel", 206.1, 36.0),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", 155.3, 72.0),
    ("route_topk_kernel", 92.1, 36.0),
]
# step_bytes' parts of that run: dense 3.10 GB (head 1.158 GB), experts 1.91 GB, KV 0.047 GB
PARTS = {"weights": 3_100_000_000, "experts": 1_910_000_000, "kv": 47_000_000, "states": 0}
HEAD = 201_088 * 2880 * 2


def test_families_of_the_gpt_oss_profile():
    rates = {f["family"]: f for f in family_rates(GPT_OSS_ROWS, PARTS, HEAD)}
    assert list(rates) == ["experts", "dense", "head", "attention"]
    assert rates["experts"]["us"] == pytest.approx(1116.6 + 995.5) and rates["experts"]["kernels"] == 2
    assert rates["experts"]["gb_s"] == pytest.approx(1.91e9 / 2112.1e-6 / 1e9)          # ~904 GB/s
    assert rates["dense"]["us"] == pytest.approx(465.4 + 399.8 + 155.3)                   # the head apart
    assert rates["dense"]["bytes"] == PARTS["weights"] - HEAD
    assert rates["head"]["us"] == pytest.approx(406.2) and rates["head"]["bytes"] == HEAD
    assert rates["head"]["gb_s"] == pytest.approx(HEAD / 406.2e-6 / 1e9)                  # ~2,851 GB/s
    assert rates["attention"]["bytes"] == PARTS["kv"] and rates["attention"]["kernels"] == 2


def test_the_table_lines_and_an_empty_profile():
    lines = family_table(GPT_OSS_ROWS, PARTS, HEAD, 2.951e12)
    assert lines[0].startswith("kernel families of a step") and len(lines) == 5
    assert "experts" in lines[1] and " 904 GB/s" in lines[1] and "31% of 2951 GB/s" in lines[1]
    assert family_table([("offset_norm_kernel", 10.0, 2.0)], PARTS, HEAD, 3e12) == []
