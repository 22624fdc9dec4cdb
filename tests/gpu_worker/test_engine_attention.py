"""Prefill and decode attention over the KV cache against a plain per-token reference, including
scattered KV rows, grouped-query heads, sliding windows, 32K contexts, and a long prompt end to end."""
from __future__ import annotations

import math

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import DecodeAttention, PrefillAttention, decode_bucket_tokens
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from tests.built_engines import build
from tests.gpu_worker.test_models_util import hf_greedy, hf_model, prompt_ids, rel_err, save_hf


def kv_cache(max_batch: int, max_ctx: int, heads: int = 8, kv_heads: int = 2, head_dim: int = 16) -> KVCache:
    cfg = MoeConfig(arch="mixtral", vocab_size=8, hidden_size=heads * head_dim, num_layers=2, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim, num_experts=2, top_k=1,
                    expert_intermediate_size=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=max_ctx)
    kv = KVCache(cfg, max_batch, max_ctx, torch.float64, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, dtype=torch.float64))   # stale garbage everywhere
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, dtype=torch.float64))
    return kv


def reference(q, keys, values, q_pos, window=None):
    """q [Hq, D] at position q_pos; keys/values [S, Hkv, D] for positions 0..S-1 -> [Hq, D]."""
    Hq, D = q.shape
    G = Hq // keys.shape[1]
    out = torch.empty_like(q)
    lo = 0 if window is None else max(0, q_pos - window + 1)
    for h in range(Hq):
        k, v = keys[lo:q_pos + 1, h // G], values[lo:q_pos + 1, h // G]
        out[h] = torch.softmax(k @ q[h] / math.sqrt(D), 0) @ v
    return out


def test_decode_bucket_tokens():
    assert [decode_bucket_tokens(n, 32768) for n in (1, 64, 65, 1000, 32768)] == [64, 64, 128, 1024, 32768]
    assert decode_bucket_tokens(40000, 40960) == 40960


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=["compact", "scattered"])
def test_decode_attention_matches_reference(slots, window):
    kv = kv_cache(max_batch=4, max_ctx=300)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([17, 200, 3])
    T = len(slots)
    q = torch.randn(T, 8, 16, generator=g, dtype=torch.float64)
    k_new = torch.randn(T, 2, 16, generator=g, dtype=torch.float64)
    v_new = torch.randn(T, 2, 16, generator=g, dtype=torch.float64)
    attn = DecodeAttention(kv, torch.tensor(slots), positions, bucket_tokens=decode_bucket_tokens(201, 300),
                           sliding_window=window)
    out = attn.attend(1, q, k_new, v_new)
    for t, (slot, pos) in enumerate(zip(slots, positions.tolist())):
        assert torch.equal(kv.k[1, slot, pos], k_new[t]) and torch.equal(kv.v[1, slot, pos], v_new[t])
        expected = reference(q[t], kv.k[1, slot], kv.v[1, slot], pos, window)
        assert torch.allclose(out[t], expected, atol=1e-10), t


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_prefill_attention_chunk_after_history_matches_reference(window):
    kv = kv_cache(max_batch=2, max_ctx=64)
    g = torch.Generator().manual_seed(2)
    start, C = 9, 6
    q = torch.randn(C, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(C, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(C, 2, 16, generator=g, dtype=torch.float64)
    out = PrefillAttention(kv, slot=1, start_pos=start, num_tokens=C, sliding_window=window).attend(0, q, k, v)
    assert torch.equal(kv.k[0, 1, start:start + C], k)
    for c in range(C):
        assert torch.allclose(out[c], reference(q[c], kv.k[0, 1], kv.v[0, 1], start + c, window), atol=1e-10)


def test_decode_at_the_end_of_a_32k_context():
    kv = kv_cache(max_batch=1, max_ctx=32768, heads=2, kv_heads=1, head_dim=8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 8, generator=g, dtype=torch.float64)
    pos = 32767
    attn = DecodeAttention(kv, torch.tensor([0]), torch.tensor([pos]), decode_bucket_tokens(pos + 1, 32768))
    assert attn.bucket == 32768
    out = attn.attend(0, q, k, k.clone())
    assert torch.allclose(out[0], reference(q[0], kv.k[0, 0], kv.v[0, 0], pos), atol=1e-10)


def test_default_engine_holds_32k_contexts(tmp_path):
    engine = build(save_hf(hf_model("qwen3", max_position_embeddings=40960), tmp_path / "m")).engine
    # the default pool: the positions of max_running_requests (4) full contexts, in blocks of 16
    assert engine.max_context_tokens == 32768 and engine.kv.k.shape[:3] == (2, 4 * 2048, 16)
    assert engine.kv.block_tables.shape == (4, 2048) and engine.kv.block_tables.dtype == torch.int32
    assert engine.model.rope.max_positions >= 32768


def test_long_prompt_in_chunks_matches_transformers(tmp_path):
    """A 1,500-token prompt in 512-token chunks, then decode over a 2,048 bucket: same tokens as transformers."""
    hf = hf_model("qwen3", seed=5)
    loaded = build(save_hf(hf, tmp_path / "m"), max_context_tokens=4096, prefill_chunk_tokens=512)
    prompt = prompt_ids(1500, seed=6)
    expected = hf_greedy(hf, prompt, 6)
    engine = loaded.engine
    assert engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0] == expected
    assert engine.stats.num_prefill_chunks == 3
    with torch.no_grad():
        hf_last = hf(torch.tensor([prompt])).logits[0, -1]
    kv = KVCache(loaded.cfg, 1, 2048, torch.float32, torch.device("cpu"))
    ours_last = loaded.model.forward(torch.tensor(prompt), torch.arange(1500), PrefillAttention(kv, 0, 0, 1500),
                                     logit_rows=torch.tensor([1499]))[0]
    assert rel_err(ours_last, hf_last) <= 1e-4


def _prefill_bias_case(device: str, dtype: torch.dtype, window: int | None) -> None:
    """PrefillAttention's folded additive bias (built once per forward) gives bitwise what SDPA gives with the
    folded boolean mask (which it would convert into the same bias at every layer), and equals the per-token
    reference; the bias is one tensor for every layer of the forward."""
    import torch.nn.functional as F
    heads, kv_heads, d, start, chunk = 8, 2, 16, 37, 29
    cfg = MoeConfig(arch="mixtral", vocab_size=8, hidden_size=heads * d, num_layers=2, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=d, num_experts=2, top_k=1, expert_intermediate_size=8,
                    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=128)
    kv = KVCache(cfg, 1, 128, dtype, torch.device(device))
    g = torch.Generator(device=device).manual_seed(1)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, device=device).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, device=device).to(dtype))
    attn = PrefillAttention(kv, 0, start, chunk, sliding_window=window)
    q = torch.randn(chunk, heads, d, generator=g, device=device).to(dtype)
    k = torch.randn(chunk, kv_heads, d, generator=g, device=device).to(dtype)
    v = torch.randn(chunk, kv_heads, d, generator=g, device=device).to(dtype)
    out = attn.attend(0, q, k, v)
    G, end = heads // kv_heads, start + chunk
    keys = kv.k[0, 0, :end].transpose(0, 1).unsqueeze(0)
    values = kv.v[0, 0, :end].transpose(0, 1).unsqueeze(0)
    qf = q.view(chunk, kv_heads, G, d).permute(1, 2, 0, 3).reshape(1, kv_heads, G * chunk, d)
    with_mask = F.scaled_dot_product_attention(qf, keys, values, attn_mask=attn.mask.repeat(G, 1), scale=d ** -0.5)
    assert torch.equal(out, with_mask.view(kv_heads, G, chunk, d).permute(2, 0, 1, 3).reshape(chunk, heads, d))
    bias = attn.folded_bias(G, dtype)
    assert bias is attn.folded_bias(G, dtype) and bias.shape == (G * chunk, end) and bias.stride(0) % 8 == 0
    for c in (0, chunk // 2, chunk - 1):
        ref = reference(q[c].double(), kv.k[0, 0, :end].double(), kv.v[0, 0, :end].double(), start + c, window)
        assert rel_err(out[c].double(), ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    return attn


@pytest.fixture
def bias_kernel(monkeypatch):
    """Prefill attention on the folded bias even where the flash path applies (the bias tests' subject)."""
    from ftexpert.gpu_worker.engine import attention
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "bias")


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_bias_is_the_masks_bitwise(dtype, window):
    attn = _prefill_bias_case("cpu", dtype, window)
    assert attn._flash is False                       # on a CPU the bias path is the only one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 8])
def test_gpu_prefill_bias_is_the_masks_bitwise(bias_kernel, window):
    _prefill_bias_case("cuda", torch.bfloat16, window)


def test_prefill_kernel_setting_is_checked(monkeypatch):
    from ftexpert.gpu_worker.engine import attention
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "flashy")
    kv = kv_cache(max_batch=1, max_ctx=16)
    q, k = torch.zeros(2, 8, 16, dtype=torch.float64), torch.zeros(2, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="PREFILL_KERNEL must be one of auto, flash, bias"):
        PrefillAttention(kv, 0, 0, 2).attend(0, q, k, k)


def qwen3_heads_case(context: int, chunk: int, seed: int):
    """qwen3-30b-a3b's attention heads (32 query, 4 kv, 128 wide) in bf16 on CUDA: a one-layer KV cache of `context`
    positions filled with random K / V, and a chunk's q, k, v of `chunk` tokens."""
    heads, kv_heads, d = 32, 4, 128
    cfg = MoeConfig(arch="qwen3", vocab_size=8, hidden_size=heads * d, num_layers=1, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=d, num_experts=2, top_k=1, expert_intermediate_size=8,
                    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=context)
    kv = KVCache(cfg, 1, context, torch.bfloat16, torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, device="cuda").bfloat16())
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, device="cuda").bfloat16())
    q = torch.randn(chunk, heads, d, generator=g, device="cuda").bfloat16()
    k = torch.randn(chunk, kv_heads, d, generator=g, device="cuda").bfloat16()
    v = torch.randn(chunk, kv_heads, d, generator=g, device="cuda").bfloat16()
    return kv, q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("start,chunk", [(0, 64), (37, 29), (1000, 512), (3, 1)])
def test_gpu_prefill_flash_path_matches_the_reference_and_the_bias(monkeypatch, start, chunk):
    """qwen3-30b-a3b's heads (32 query, 4 kv, 128 wide) in bf16: the lower-right causal flash path is taken, and
    its output agrees with the per-token fp64 reference and with the folded-bias path within bf16 rounding."""
    from ftexpert.gpu_worker.engine import attention
    kv, q, k, v = qwen3_heads_case(2048, chunk, seed=4)
    heads, d = q.shape[1:]
    flash = PrefillAttention(kv, 0, start, chunk)
    out = flash.attend(0, q, k, v)
    assert flash._flash is True and out.shape == (chunk, heads, d) and out.is_contiguous()
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "bias")
    biased = PrefillAttention(kv, 0, start, chunk)
    out_bias = biased.attend(0, q, k, v)
    assert biased._flash is False
    assert rel_err(out.double(), out_bias.double()) < 1e-2
    end = start + chunk
    for c in sorted({0, chunk // 2, chunk - 1}):
        ref = reference(q[c].double(), kv.k[0, 0, :end].double(), kv.v[0, 0, :end].double(), start + c)
        assert rel_err(out[c].double(), ref) < 2e-2, c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_late_in_a_32k_context_builds_no_mask():
    """A 4,096-token chunk at positions 28,672..32,767 with qwen3-30b-a3b's heads: the folded bias alone would
    take G x C x S x 2 = 2 GiB and the boolean mask 128 MiB; the flash path builds neither (its extra memory is
    the output, 32 MiB, and the kernel's scratch), and the object is built inside the measured span."""
    heads, kv_heads, d, C, end = 32, 4, 128, 4096, 32768
    cfg = MoeConfig(arch="qwen3", vocab_size=8, hidden_size=heads * d, num_layers=1, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=d, num_experts=2, top_k=1, expert_intermediate_size=8,
                    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=end)
    kv = KVCache(cfg, 1, end, torch.bfloat16, torch.device("cuda"))
    kv.k.normal_()
    kv.v.normal_()
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(C, heads, d, generator=g, device="cuda").bfloat16()
    k = torch.randn(C, kv_heads, d, generator=g, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    attn = PrefillAttention(kv, 0, end - C, C)
    out = attn.attend(0, q, k, k)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert attn._flash is True and torch.isfinite(out).all()
    assert attn._mask is None, "the flash path built the boolean mask"
    assert extra < 192 * 2 ** 20, f"prefill attention took {extra / 2 ** 20:.0f} MiB beyond its inputs"
    ref = reference(q[-1].double(), kv.k[0, 0].double(), kv.v[0, 0].double(), end - 1)   # (attend wrote k as v)
    assert rel_err(out[-1].double(), ref) < 2e-2
