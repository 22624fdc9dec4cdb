"""The prefill attention of a short chunk after a long history in two parts merged by their log-sum-exp
(engine/prefix_attention.py): against a per-query reference on the CPU (the parts' plain matmul path), where it
applies (a table), and on a GPU through `PrefillAttention` (the flash kernel's own op for the parts) against the
unsplit flash path and the reference."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.prefix_attention import attention_lse, prefix_split_attention, split_applies
from tests.gpu_worker.test_engine_attention import qwen3_heads_case, reference
from tests.gpu_worker.test_models_util import rel_err


def _case(start: int, C: int, Hq: int, Hkv: int, D: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(C, Hq, D, generator=g).to(dtype)
    ctx = torch.randn(start + C, Hkv, D, generator=g).to(dtype)        # [S, Hkv, D]: history, then the chunk
    vals = torch.randn(start + C, Hkv, D, generator=g).to(dtype)
    return q, ctx, vals


@pytest.mark.parametrize("start,C,Hq,Hkv,dtype", [
    (40, 7, 8, 2, torch.float64),      # G 4
    (1, 1, 4, 4, torch.float64),       # the shortest history, one query, G 1
    (33, 16, 6, 3, torch.float32),     # G 2
    (64, 5, 8, 1, torch.bfloat16),     # every query head on one kv head
])
def test_the_split_equals_the_reference_per_query(start, C, Hq, Hkv, dtype):
    D = 16
    q, ctx, vals = _case(start, C, Hq, Hkv, D, dtype)
    keys, values = ctx.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)    # [1, Hkv, S, D] views
    out = prefix_split_attention(q, keys, values, start, D ** -0.5)
    assert out.shape == (C, Hq, D) and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    for c in range(C):
        want = reference(q[c].double(), ctx.double(), vals.double(), start + c)
        assert rel_err(out[c].double(), want) < tol, c


def test_the_parts_log_sum_exp_is_the_scores():
    """attention_lse's lse is log sum exp of the scaled scores over the keys each query sees (causal: m sees n <= m),
    and its output their softmax-weighted values: checked on one head by hand."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = attention_lse(q, k, v, causal=True, scale=0.5)
    for m in range(4):
        s = (k[0, 0, :m + 1] @ q[0, 0, m]) * 0.5
        assert lse[0, 0, m].item() == pytest.approx(torch.logsumexp(s, 0).item(), abs=1e-12)
        assert torch.allclose(out[0, 0, m], torch.softmax(s, 0) @ v[0, 0, :m + 1], atol=1e-12)


def test_a_wrong_context_is_refused():
    q, ctx, vals = _case(8, 4, 4, 2, 16, torch.float32)
    keys = ctx.transpose(0, 1).unsqueeze(0)
    with pytest.raises(ValueError, match="history"):
        prefix_split_attention(q, keys[:, :, :10], keys[:, :, :10], 8, 0.25)
    with pytest.raises(ValueError, match="history"):
        prefix_split_attention(q, keys[:, :, 8:], keys[:, :, 8:], 0, 0.25)


def test_the_split_stays_off_the_cpu():
    assert not split_applies(516, 32, 32768, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_where_the_split_applies():
    """A table on the machine's SMs (132 on an H100 / H200): qwen3-30b-a3b's 32 query heads."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert split_applies(516, 32, 32768, dev) == (5 * 32 < 2 * sms)
    assert not split_applies(4096, 32, 28672, dev), "a long chunk fills the SMs by itself"
    assert not split_applies(516, 32, 1024, dev), "a short history: the plain call"
    assert not split_applies(1000, 32, 3000, dev), "a history under four chunks"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start,chunk", [(4096, 300), (8192, 517)])
def test_gpu_split_path_matches_flash_and_the_reference(monkeypatch, start, chunk):
    """qwen3-30b-a3b's heads in bf16 through PrefillAttention: "auto" takes the split (the flash op's log-sum-exp),
    "flash" the plain call; the two agree within bf16 rounding and each with the fp64 reference."""
    from ftexpert.gpu_worker.engine import attention
    ctx = start + chunk
    kv, q, k, v = qwen3_heads_case(ctx, chunk, seed=6)
    split = PrefillAttention(kv, 0, start, chunk)
    out = split.attend(0, q, k, v)
    assert split._flash is True and split._split is True
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "flash")
    plain = PrefillAttention(kv, 0, start, chunk)
    out_plain = plain.attend(0, q, k, v)
    assert plain._flash is True and plain._split is False
    assert rel_err(out.double(), out_plain.double()) < 1e-2
    for c in sorted({0, chunk // 2, chunk - 1}):
        ref = reference(q[c].double(), kv.k[0, 0, :ctx].double(), kv.v[0, 0, :ctx].double(), start + c)
        assert rel_err(out[c].double(), ref) < 2e-2, c
