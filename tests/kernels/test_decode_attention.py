"""kernels/decode_attention: the flash-decoding kernel against its torch reference and against the
SDPA path of `DecodeAttention` it replaces on CUDA.

On a machine without a GPU the kernels run in the Triton interpreter (conftest.py sets it up), in
float32 on tiny shapes (the interpreter computes bfloat16 wrongly); the `gpu` tests run bf16 at
qwen3-30b-a3b shapes (Hq=32, Hkv=4, D=128), also inside a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import EngineConfig, SamplingParams
from ftexpert.gpu_worker.engine.attention import DecodeAttention, decode_bucket_tokens
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.kernels.decode_attention import (DEFAULT_BLOCKS, DecodeAttentionBlocks, decode_attention,
                                      decode_attention_reference, split_plan)
from tests.built_engines import build, engine_of
from tests.conftest import HAS_CUDA, KERNEL_DEVICE
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, save_hf

# Small blocks so that tiny buckets still split into several chunks of several loop steps.
SMALL = DecodeAttentionBlocks(block_n=16, min_chunk=32, short_min_chunk=32, target_programs=64)


def make_cache(B, S, Hkv, D, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    """k, v [B, S, Hkv, D] of random values (stale garbage beyond every seq_len)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, S, Hkv, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(B, S, Hkv, D, generator=g).to(dtype=dtype, device=device)
    return k, v


def run_both(q, k, v, rows, seq_lens, bucket, window=None, blocks=SMALL, scale=None, sinks=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = decode_attention(q, k, v, rows, seq_lens, scale=scale, bucket=bucket, sliding_window=window,
                           impl="triton", blocks=blocks, sinks=sinks)
    ref = decode_attention_reference(q, k, v, rows, seq_lens, scale=scale, bucket=bucket,
                                     sliding_window=window, sinks=sinks)
    return out, ref


# (G, D, T, seq_lens, bucket, window): G >= DOT_MIN_GROUP (4) takes tl.dot, smaller G the broadcast-sum
CASES = {
    "mha-d16-t1-len1": (1, 16, 1, [1], 64, None),
    "g2-d32-t3": (2, 32, 3, [37, 64, 5], 64, None),
    "g4-d64-t4": (4, 64, 4, [97, 1, 128, 33], 128, None),
    "g8-d32-t2-full-bucket": (8, 32, 2, [128, 77], 128, None),
    "g8-d16-t4-window": (8, 16, 4, [100, 3, 128, 40], 128, 37),
    "g2-d16-t2-window1": (2, 16, 2, [50, 9], 64, 1),
    "g4-d32-t3": (4, 32, 3, [65, 17, 96], 96, None),
    "g1-d32-t2-window": (1, 32, 2, [96, 31], 96, 20),
    "g8-d64-t1-odd-bucket": (8, 64, 1, [70], 70, None),
}


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", list(CASES))
def test_lockstep_with_reference(case):
    G, D, T, lens, bucket, window = CASES[case]
    Hkv, B, S = 2, 6, 160
    k, v = make_cache(B, S, Hkv, D, seed=len(case))
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, G * Hkv, D, generator=g).to(KERNEL_DEVICE)
    rows = torch.randperm(B, generator=g)[:T].to(KERNEL_DEVICE)              # scattered, permuted rows
    seq_lens = torch.tensor(lens).to(KERNEL_DEVICE)
    out, ref = run_both(q, k, v, rows, seq_lens, bucket, window, SMALL)
    assert out.shape == (T, G * Hkv, D) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", ["g8-d32-t2-full-bucket", "g8-d16-t4-window", "g2-d32-t3", "mha-d16-t1-len1"])
def test_lockstep_with_reference_with_sinks(case):
    """gpt-oss's attention sinks (a logit per head in the denominator, taken in the merge kernel): sinks around
    the scores' own size, so that they move the output."""
    G, D, T, lens, bucket, window = CASES[case]
    Hkv, B, S = 2, 6, 160
    k, v = make_cache(B, S, Hkv, D, seed=len(case))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(T, G * Hkv, D, generator=g).to(KERNEL_DEVICE)
    rows = torch.randperm(B, generator=g)[:T].to(KERNEL_DEVICE)
    seq_lens = torch.tensor(lens).to(KERNEL_DEVICE)
    sinks = (2 * torch.randn(G * Hkv, generator=g)).to(KERNEL_DEVICE)
    out, ref = run_both(q, k, v, rows, seq_lens, bucket, window, SMALL, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain, _ = run_both(q, k, v, rows, seq_lens, bucket, window, SMALL)
    assert (out - plain).abs().max() > 1e-2                                  # the sinks did something


def test_reference_sinks_against_hand_computed_values():
    """One position: out = v0 * e^s / (e^s + e^sink); a sink of -inf (none) leaves v0; a sink equal to the score
    halves it."""
    D = 4
    k = torch.zeros(1, 8, 1, D)
    v = torch.zeros(1, 8, 1, D)
    v[0, 0, 0] = torch.tensor([1.0, -2.0, 4.0, 0.5])
    q = torch.zeros(1, 1, D)                                                 # score 0 against every key
    one = torch.tensor([0]), torch.tensor([1])
    for sink, share in ((float("-inf"), 1.0), (0.0, 0.5), (1.0, 1 / (1 + torch.e)), (-2.0, 1 / (1 + torch.e ** -2))):
        out = decode_attention_reference(q, k, v, *one, scale=1.0, bucket=8, sinks=torch.tensor([sink]))
        torch.testing.assert_close(out[0, 0], v[0, 0, 0] * share, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("no_tf32")
def test_default_blocks_and_strided_inputs():
    """Default launch shape; q a strided view (a qkv split); the caches a layer slice of [L, B, S, Hkv, D]."""
    Hq, Hkv, D, T, B, S, bucket = 8, 2, 32, 2, 3, 300, 256
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 2, B, S, Hkv, D, generator=g).to(KERNEL_DEVICE)   # [kv, L, B, S, Hkv, D]
    k, v = cache[0, 1], cache[1, 1]
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(KERNEL_DEVICE)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    assert not q.is_contiguous()
    rows = torch.tensor([2, 0]).to(KERNEL_DEVICE)
    seq_lens = torch.tensor([200, 256]).to(KERNEL_DEVICE)
    assert split_plan(bucket, T, Hkv)[0] == 4
    out, ref = run_both(q, k, v, rows, seq_lens, bucket, blocks=DEFAULT_BLOCKS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("no_tf32")
def test_positions_past_seq_len_and_bucket_are_never_read():
    """NaNs in every position a request must not see (beyond its seq_len, outside its window, past
    the bucket, other rows) leave the output finite and equal to the reference over clean caches."""
    Hq, Hkv, D, B, S, bucket, window = 4, 2, 16, 4, 100, 64, 24
    k, v = make_cache(B, S, Hkv, D, seed=3)
    rows = torch.tensor([3, 1]).to(KERNEL_DEVICE)
    seq_lens = torch.tensor([50, 64]).to(KERNEL_DEVICE)
    q = torch.randn(2, Hq, D, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    _, ref = run_both(q, k, v, rows, seq_lens, bucket, window)
    kn, vn = k.clone(), v.clone()
    keep = torch.zeros(B, S, dtype=torch.bool)
    keep[3, 50 - window:50] = True
    keep[1, 64 - window:64] = True
    kn[~keep.to(KERNEL_DEVICE)] = float("nan")
    vn[~keep.to(KERNEL_DEVICE)] = float("nan")
    out, _ = run_both(q, kn, vn, rows, seq_lens, bucket, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_split_plan():
    for bucket in (1, 17, 64, 70, 1024, 2048, 4096, 32768, 40960):
        for T, Hkv in ((1, 4), (4, 4), (1, 1), (3, 8)):
            for blocks in (DEFAULT_BLOCKS, SMALL):
                n, chunk = split_plan(bucket, T, Hkv, blocks)
                assert chunk % blocks.block_n == 0 and n * chunk >= bucket and (n - 1) * chunk < bucket
                assert 1 <= n <= blocks.max_splits
    # qwen3-30b-a3b (Hkv=4): the documented plans
    assert split_plan(512, 1, 4) == (8, 64)
    assert split_plan(64, 1, 4) == (1, 64)
    assert split_plan(1024, 1, 4) == (8, 128)
    assert split_plan(2048, 1, 4) == (16, 128)
    assert split_plan(32768, 1, 4) == (64, 512)
    assert split_plan(2048, 4, 4) == (16, 128)
    assert split_plan(32768, 4, 4) == (16, 2048)


def test_bad_arguments():
    k, v = make_cache(2, 32, 2, 16, device="cpu")
    q = torch.randn(1, 4, 16)
    rows, lens = torch.tensor([0]), torch.tensor([5])
    kw = dict(scale=0.25, bucket=32)
    with pytest.raises(ValueError, match="bucket"):
        decode_attention(q, k, v, rows, lens, scale=0.25, bucket=33)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        decode_attention(torch.randn(1, 3, 16), k, v, rows, lens, **kw)
    with pytest.raises(ValueError, match=r"\[T=1\]"):
        decode_attention(q, k, v, torch.tensor([0, 1]), lens, **kw)
    with pytest.raises(TypeError, match="dtype"):
        decode_attention(q.double(), k, v, rows, lens, **kw)
    with pytest.raises(ValueError, match="impl"):
        decode_attention(q, k, v, rows, lens, impl="cudnn", **kw)
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(q, k, v, rows, lens, sliding_window=0, **kw)
    with pytest.raises(ValueError, match=r"sinks must be a float \[Hq=4\]"):
        decode_attention(q, k, v, rows, lens, sinks=torch.zeros(2), **kw)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, k, v, rows, lens, sinks=torch.zeros(4, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert decode_attention(q, k, v, rows, lens, impl="auto", **kw).shape == (1, 4, 16)   # reference


# ---- against the SDPA path of DecodeAttention -----------------------------------------------------

def kv_cache(max_batch, max_ctx, heads, kv_heads, head_dim, device=KERNEL_DEVICE, dtype=torch.float32,
             seed=0) -> KVCache:
    cfg = MoeConfig(arch="qwen3", vocab_size=8, hidden_size=heads * head_dim, num_layers=2, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim, num_experts=2, top_k=1,
                    expert_intermediate_size=8, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=max_ctx)
    kv = KVCache(cfg, max_batch, max_ctx, dtype, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))             # stale garbage everywhere
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    return kv


def attend_both(kv: KVCache, slots, positions, window, q, k_new, v_new, layer=1, sinks=None):
    """The same step through backend 'sdpa' and 'triton' on copies of the cache -> (sdpa, triton, caches)."""
    dev = kv.k.device
    slot_ids = torch.tensor(slots, device=dev)
    pos = torch.tensor(positions, device=dev)
    bucket = decode_bucket_tokens(max(positions) + 1, kv.max_context_tokens)
    outs, caches = [], []
    for backend in ("sdpa", "triton"):
        kv_b = kv_cache(kv.max_batch, kv.max_context_tokens, q.shape[1], kv.num_kv_heads, kv.head_dim,
                        device=dev, dtype=kv.k.dtype)
        kv_b.k.copy_(kv.k)
        kv_b.v.copy_(kv.v)
        attn = DecodeAttention(kv_b, slot_ids, pos, bucket_tokens=bucket, sliding_window=window, backend=backend)
        assert attn.backend == backend
        outs.append(attn.attend(layer, q, k_new, v_new, **({} if sinks is None else {"sinks": sinks})))
        caches.append(kv_b)
    return outs[0], outs[1], caches


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2], [4]], ids=["compact", "scattered", "idle-rows"])
def test_triton_backend_matches_sdpa_decode_attention(slots, window):
    Hq, Hkv, D = 8, 2, 16
    kv = kv_cache(max_batch=5, max_ctx=200, heads=Hq, kv_heads=Hkv, head_dim=D)
    positions = [17, 130, 0][: len(slots)]
    T = len(slots)
    g = torch.Generator().manual_seed(5)
    q, k_new, v_new = (torch.randn(T, h, D, generator=g).to(KERNEL_DEVICE) for h in (Hq, Hkv, Hkv))
    sdpa, triton_out, (kv_s, kv_t) = attend_both(kv, slots, positions, window, q, k_new, v_new)
    assert torch.equal(kv_s.k, kv_t.k) and torch.equal(kv_s.v, kv_t.v)       # the same K/V written
    torch.testing.assert_close(triton_out, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
def test_triton_backend_with_sinks_matches_the_eager_sink_attention(window):
    """gpt-oss's layers: sinks (and a sliding window) through the Triton kernel equal the eager sink softmax the
    'sdpa' backend runs."""
    Hq, Hkv, D = 8, 2, 16
    kv = kv_cache(max_batch=5, max_ctx=200, heads=Hq, kv_heads=Hkv, head_dim=D)
    slots, positions = [3, 0, 2], [17, 130, 0]
    g = torch.Generator().manual_seed(9)
    q, k_new, v_new = (torch.randn(3, h, D, generator=g).to(KERNEL_DEVICE) for h in (Hq, Hkv, Hkv))
    sinks = torch.randn(Hq, generator=g).to(KERNEL_DEVICE)
    sdpa, triton_out, _ = attend_both(kv, slots, positions, window, q, k_new, v_new, sinks=sinks)
    torch.testing.assert_close(triton_out, sdpa, rtol=1e-5, atol=1e-5)


def test_backend_auto_is_sdpa_on_cpu_and_triton_on_cuda():
    kv = kv_cache(1, 64, 4, 2, 16, device="cpu")
    one = torch.tensor([0])
    assert DecodeAttention(kv, one, one, 64).backend == "sdpa"
    if HAS_CUDA:
        kv = kv_cache(1, 64, 4, 2, 16, device="cuda")
        one = one.cuda()
        assert DecodeAttention(kv, one, one, 64).backend == "triton"
        assert DecodeAttention(kv, one, one, 64, backend="sdpa").backend == "sdpa"


@pytest.mark.usefixtures("no_tf32")
def test_engine_generates_the_same_tokens_with_either_backend(tmp_path):
    """Two requests decoding together (qwen3 layout, 2 layers): greedy tokens of backend 'triton'
    (interpreter on CPU) equal those of 'sdpa'."""
    loaded = build(save_hf(hf_model("qwen3", seed=3), tmp_path / "m"), device=KERNEL_DEVICE, max_running_requests=2,
                   max_context_tokens=64, cuda_graphs="off")
    prompts = [prompt_ids(9, seed=1), prompt_ids(4, seed=2)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("sdpa", "triton"):
        engine = engine_of(loaded, attention_backend=backend)
        tokens[backend] = engine.generate(prompts, params)
        assert engine.stats.num_decode_steps >= 3
    assert tokens["triton"] == tokens["sdpa"]


# ---- on the GPU: bf16 at qwen3-30b-a3b shapes, and inside a CUDA graph -----------------------------

QWEN3 = dict(Hq=32, Hkv=4, D=128)


def fp32_reference(q, k, v, rows, seq_lens, **kw) -> torch.Tensor:
    """The reference on the bf16 values upcast: an fp32 output, not rounded to bf16."""
    return decode_attention_reference(q.float(), k.float(), v.float(), rows, seq_lens, **kw)


def bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output (its rounding, and p rounded to bf16 before the PV product) within 1% of the
    largest reference value, and the whole tensor within 0.5% relative."""
    err = (out.float() - ref).abs()
    assert err.max() <= 1e-2 * ref.abs().max(), float(err.max())
    assert err.norm() <= 5e-3 * ref.norm(), float(err.norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.parametrize("T,lens,bucket,window", [
    (1, [1280], 2048, None),
    (4, [1, 1000, 4096, 2500], 4096, None),
    (2, [32768, 20000], 32768, None),
    (3, [300, 2048, 1500], 2048, 512),
])
def test_bf16_qwen3_shapes_on_gpu(T, lens, bucket, window):
    Hq, Hkv, D = QWEN3["Hq"], QWEN3["Hkv"], QWEN3["D"]
    B = 5
    k, v = make_cache(B, bucket, Hkv, D, dtype=torch.bfloat16, device="cuda", seed=T)
    g = torch.Generator().manual_seed(6)
    q = (2 * torch.randn(T, Hq, D, generator=g)).to(torch.bfloat16).cuda()    # peaked softmaxes
    rows = torch.randperm(B, generator=g)[:T].cuda()
    seq_lens = torch.tensor(lens).cuda()
    out = decode_attention(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket, sliding_window=window)
    ref = fp32_reference(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket, sliding_window=window)
    assert out.dtype == torch.bfloat16
    bf16_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,bucket,window", [([1100, 70], 2048, None), ([1100, 5000], 8192, 128)])
def test_bf16_gpt_oss_shapes_with_sinks_on_gpu(lens, bucket, window):
    """gpt-oss-120b's heads (Hq 64, Hkv 8, D 64), its bf16 sinks, full and 128-token sliding layers."""
    Hq, Hkv, D, T, B = 64, 8, 64, len(lens), 3
    k, v = make_cache(B, bucket, Hkv, D, dtype=torch.bfloat16, device="cuda", seed=21)
    g = torch.Generator().manual_seed(22)
    q = (2 * torch.randn(T, Hq, D, generator=g)).to(torch.bfloat16).cuda()
    sinks = (3 * torch.randn(Hq, generator=g)).to(torch.bfloat16).cuda()
    rows, seq_lens = torch.tensor([2, 0]).cuda(), torch.tensor(lens).cuda()
    out = decode_attention(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket, sliding_window=window,
                           sinks=sinks)
    ref = fp32_reference(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket, sliding_window=window,
                         sinks=sinks)
    bf16_close(out, ref)


@pytest.mark.gpu
def test_triton_backend_matches_sdpa_bf16_on_gpu():
    Hq, Hkv, D = QWEN3["Hq"], QWEN3["Hkv"], QWEN3["D"]
    kv = kv_cache(max_batch=4, max_ctx=2048, heads=Hq, kv_heads=Hkv, head_dim=D, device="cuda",
                  dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    q, k_new, v_new = (torch.randn(3, h, D, generator=g).to(torch.bfloat16).cuda() for h in (Hq, Hkv, Hkv))
    slots, positions = [2, 0, 3], [1279, 40, 700]
    sdpa, triton_out, (kv_s, kv_t) = attend_both(kv, slots, positions, None, q, k_new, v_new)
    assert torch.equal(kv_s.k, kv_t.k) and torch.equal(kv_s.v, kv_t.v)
    ref = fp32_reference(q, kv_t.k[1], kv_t.v[1], torch.tensor(slots).cuda(),
                         torch.tensor(positions).cuda() + 1, scale=D ** -0.5, bucket=2048)
    bf16_close(triton_out, ref)                                              # each within bf16 error
    bf16_close(sdpa, ref)                                                    # of the fp32 reference


@pytest.mark.gpu
def test_inside_a_cuda_graph_with_changed_seq_lens():
    """Captured once for a bucket; replays read new rows / seq_lens from the static inputs."""
    Hq, Hkv, D = QWEN3["Hq"], QWEN3["Hkv"], QWEN3["D"]
    B, bucket, T = 4, 2048, 2
    k, v = make_cache(B, bucket, Hkv, D, dtype=torch.bfloat16, device="cuda", seed=8)
    q = torch.randn(T, Hq, D, device="cuda").to(torch.bfloat16)
    rows = torch.tensor([1, 3], device="cuda")
    seq_lens = torch.tensor([100, 2048], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket)   # compile outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                                            # raises on a host sync
        out = decode_attention(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket)
    for new_rows, new_lens in (([1, 3], [100, 2048]), ([0, 2], [1, 1280]), ([3, 1], [2047, 64]),
                               ([2, 0], [1500, 1])):
        rows.copy_(torch.tensor(new_rows))
        seq_lens.copy_(torch.tensor(new_lens))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = fp32_reference(q, k, v, rows, seq_lens, scale=D ** -0.5, bucket=bucket)
        bf16_close(out, ref)
