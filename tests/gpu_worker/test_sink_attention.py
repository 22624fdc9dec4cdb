"""engine/sink_attention.py: gpt-oss's prefill attention with sinks and windows in bounded memory, against the
one-shot eager form (every query against every key, the mask in memory), and the flash form's sink-as-a-key."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import sink_attention as sa
from ftexpert.gpu_worker.engine.sink_attention import (chunked_sink_attention, folded_sinks, sink_attention,
                                                       sink_key_attention)


def one_shot(q, keys, values, *, start, base, window, sinks, scale):
    """The whole chunk at once: [C, S] mask over keys [base, start + C), the folded layout (the former path)."""
    C, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    q_pos = torch.arange(start, start + C)[:, None]
    k_pos = torch.arange(base, start + C)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    qf = q.view(C, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * C, D)
    out = sink_attention(qf, keys, values, mask.repeat(G, 1), folded_sinks(sinks, Hkv, G, C), scale)
    return out.view(Hkv, G, C, D).permute(2, 0, 1, 3).reshape(C, Hq, D)


def case(C, start, base, Hq=8, Hkv=2, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = start + C - base
    q = torch.randn(C, Hq, D, generator=g).to(dtype)
    keys = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    values = torch.randn(1, Hkv, S, D, generator=g).to(dtype)
    sinks = (2 * torch.randn(Hq, generator=g)).to(dtype)
    return q, keys, values, sinks


@pytest.mark.parametrize("budget", [None, 4096, 1], ids=["one-slice", "slices", "one-query-slices"])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("start, base, window", [(0, 0, None), (23, 0, None), (0, 0, 5), (23, 0, 5), (40, 32, 5)],
                         ids=["full-first-chunk", "full-later", "window-first-chunk", "window-later", "window-base"])
def test_sliced_equals_the_one_shot_form(budget, window, with_sinks, start, base):
    q, keys, values, sinks = case(C=19, start=start, base=base, seed=start + (window or 0))
    kw = dict(start=start, base=base, window=window, sinks=sinks if with_sinks else None, scale=0.25)
    got = chunked_sink_attention(q, keys, values, budget=budget, **kw)
    torch.testing.assert_close(got, one_shot(q, keys, values, **kw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C, heads, window, budget, queries", [
    (4096, 64, None, 512 << 20, 4),           # gpt-oss-120b, a 4K chunk ending at 128K: 64 x 4 x 131072 x 12 = 403 MB
    (4096, 64, 128, 512 << 20, 512),          # its sliding layers: 64 x 512 x 639 x 12 = 251 MB (1,024: 905)
    (19, 8, None, 1 << 30, 19),               # fits: one slice
    (19, 8, None, 1, 1),
])
def test_slice_length_keeps_the_logits_under_the_budget(C, heads, window, budget, queries):
    end, base = 131072, 0

    def span_of(n):
        return end - base if window is None else min(n + window - 1, end - base)

    n = sa._slice_len(C, heads, span_of, budget)
    assert n == queries
    assert n == 1 or heads * n * span_of(n) * 12 <= budget


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("start", [0, 37])
def test_the_sink_as_a_key_equals_the_sink_softmax(dtype, tol, start):
    """The flash form's arithmetic through SDPA's math kernel on the CPU: the padded sink key gives the eager
    sinks' output (bf16: within its rounding, the sink / scale carried in two bf16 values)."""
    q, keys, values, sinks = case(C=11, start=start, base=0, D=64, dtype=dtype, seed=5)
    sinks = sinks * 4                                                       # sinks that dominate some rows
    got = sink_key_attention(q, keys, values, sinks, 0.125, require_flash=False)
    ref = one_shot(q.float(), keys.float(), values.float(), start=start, base=0, window=None, sinks=sinks.float(),
                   scale=0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    plain = one_shot(q.float(), keys.float(), values.float(), start=start, base=0, window=None, sinks=None,
                     scale=0.125)
    assert (plain - ref).abs().max() > 10 * tol                             # the sinks matter at this size


def test_the_sink_key_needs_flash_where_asked():
    q, keys, values, sinks = case(C=4, start=0, base=0)
    assert sink_key_attention(q, keys, values, sinks, 0.25) is None        # the CPU: no flash kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("start", [0, 3584])
def test_gpu_flash_sink_key_at_gpt_oss_heads(start):
    """gpt-oss-120b's heads (Hq 64, Hkv 8, D 64), bf16, a 512-query chunk: flash takes the padded shapes and the
    output is the fp32 sink softmax's within bf16 rounding."""
    q, keys, values, sinks = case(C=512, start=start, base=0, Hq=64, Hkv=8, D=64, dtype=torch.bfloat16, seed=9)
    q, keys, values, sinks = (t.cuda() for t in (q, keys, values, sinks))
    got = sink_key_attention(q, keys, values, sinks, 0.125)
    assert got is not None
    ref = one_shot(q.float().cpu(), keys.float().cpu(), values.float().cpu(), start=start, base=0, window=None,
                   sinks=sinks.float().cpu(), scale=0.125)
    err = (got.float().cpu() - ref).abs()
    assert err.max() <= 2e-2 * ref.abs().max() and err.norm() <= 1e-2 * ref.norm()
