"""kernels/decode_attention over a paged KV cache: the Triton kernel (the interpreter on CPU, float32, small shapes)
in lockstep with the torch reference, which gathers each request's pages through its block table row, and both
against a per-token loop over the table on the host; then the engine's attention contexts (`PrefillAttention`,
`DecodeAttention` with either backend) over a `KVCache` whose blocks are scattered, against a per-token reference.

The `gpu` tests run bf16 at qwen3-30b-a3b shapes and replay a CUDA graph whose block tables change in place."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.engine.attention import DecodeAttention, PrefillAttention, decode_bucket_tokens
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.kernels.decode_attention import DecodeAttentionBlocks, decode_attention, decode_attention_reference
from tests.conftest import KERNEL_DEVICE
from tests.gpu_worker.test_engine_attention import reference
from tests.kernels.test_decode_attention import make_cache   # [pages, page, Hkv, D] of random values

SMALL = DecodeAttentionBlocks(block_n=16, min_chunk=32, short_min_chunk=32, target_programs=64)


def scattered_tables(lens, page, num_pages, rows_total, max_pages, seed):
    """Block table rows [rows_total, max_pages] int32 (-1 unused): each request (row rows[t]) gets distinct random
    pages for its positions, no page in two rows; returns (tables, rows)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(num_pages, generator=g).tolist()
    rows = torch.randperm(rows_total, generator=g)[:len(lens)].tolist()
    tables = torch.full((rows_total, max_pages), -1, dtype=torch.int32)
    for r, n in zip(rows, lens):
        need = -(-n // page)
        tables[r, :need] = torch.tensor([pages.pop() for _ in range(need)], dtype=torch.int32)
    return tables, torch.tensor(rows)


def loop_reference(q, k, v, tables, rows, lens, scale, window=None):
    """Per request, per head: softmax over the positions it attends, each looked up in the table on the host."""
    T, Hq, D = q.shape
    page, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for t in range(T):
        n, row = int(lens[t]), int(rows[t])
        lo = 0 if window is None else max(0, n - window)
        pos = list(range(lo, n))
        keys = torch.stack([k[int(tables[row, p // page]), p % page].double().cpu() for p in pos])   # [n, Hkv, D]
        vals = torch.stack([v[int(tables[row, p // page]), p % page].double().cpu() for p in pos])
        for h in range(Hq):
            w = torch.softmax(keys[:, h // G] @ q[t, h].double().cpu() * scale, 0)
            out[t, h] = w @ vals[:, h // G]
    return out


# (G, D, T, seq_lens, bucket, window, page)
CASES = {
    "mha-page16": (1, 16, 2, [1, 40], 64, None, 16),
    "g2-page4": (2, 32, 3, [37, 64, 5], 64, None, 4),
    "g4-page16-dot": (4, 32, 4, [97, 1, 128, 33], 128, None, 16),
    "g8-page8-window": (8, 16, 4, [100, 3, 128, 40], 128, 37, 8),
    "g2-page16-window1": (2, 16, 2, [50, 9], 64, 1, 16),
    "g4-page32-window": (4, 16, 3, [96, 31, 70], 96, 20, 32),
    "g8-page5-odd": (8, 16, 2, [70, 12], 70, None, 5),
}


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", list(CASES))
def test_paged_kernel_in_lockstep_with_the_gathering_reference(case):
    G, D, T, lens, bucket, window, page = CASES[case]
    Hkv = 2
    max_pages = -(-bucket // page)
    num_pages = sum(-(-n // page) for n in lens) + 5                    # a few pages no request names
    k, v = make_cache(num_pages, page, Hkv, D, seed=len(case))
    tables, rows = scattered_tables(lens, page, num_pages, T + 2, max_pages, seed=len(case))
    q = torch.randn(T, G * Hkv, D, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    seq_lens = torch.tensor(lens)
    args = (q, k, v, rows.to(KERNEL_DEVICE), seq_lens.to(KERNEL_DEVICE))
    kw = dict(scale=D ** -0.5, bucket=bucket, sliding_window=window, block_tables=tables.to(KERNEL_DEVICE))
    out = decode_attention(*args, impl="triton", blocks=SMALL, **kw)
    ref = decode_attention_reference(*args, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    loop = loop_reference(q, k, v, tables, rows, lens, D ** -0.5, window)
    torch.testing.assert_close(ref.double().cpu(), loop, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("no_tf32")
def test_pages_and_positions_a_request_does_not_attend_are_never_read():
    """NaN in every page no request names and in every position past a request's length or before its window, in
    its own pages too: the output is finite and equal to the one over clean pages."""
    G, D, page, Hkv, window = 4, 16, 8, 2, 19
    lens = [45, 64, 9]
    num_pages = 20
    k, v = make_cache(num_pages, page, Hkv, D, seed=3)
    tables, rows = scattered_tables(lens, page, num_pages, 4, 8, seed=3)
    q = torch.randn(3, G * Hkv, D, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    kw = dict(scale=D ** -0.5, bucket=64, sliding_window=window, block_tables=tables.to(KERNEL_DEVICE))
    seq_lens = torch.tensor(lens).to(KERNEL_DEVICE)
    clean = decode_attention(q, k, v, rows.to(KERNEL_DEVICE), seq_lens, impl="triton", blocks=SMALL, **kw)
    keep = torch.zeros(num_pages, page, dtype=torch.bool)
    for r, n in zip(rows.tolist(), lens):
        for p in range(max(0, n - window), n):
            keep[int(tables[r, p // page]), p % page] = True
    kn, vn = k.clone(), v.clone()
    kn[~keep.to(KERNEL_DEVICE)] = float("nan")
    vn[~keep.to(KERNEL_DEVICE)] = float("nan")
    out = decode_attention(q, kn, vn, rows.to(KERNEL_DEVICE), seq_lens, impl="triton", blocks=SMALL, **kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, rtol=1e-5, atol=1e-5)


def test_bucket_is_checked_against_the_tables_span():
    k, v = make_cache(4, 16, 2, 16, device="cpu")
    tables = torch.zeros(2, 3, dtype=torch.int32)
    q, one = torch.randn(1, 4, 16), torch.tensor([1])
    with pytest.raises(ValueError, match=r"bucket=49 must be in \[1, 48\]"):
        decode_attention(q, k, v, torch.tensor([0]), one, scale=0.25, bucket=49, block_tables=tables)
    with pytest.raises(TypeError, match="block_tables"):
        decode_attention(q, k, v, torch.tensor([0]), one, scale=0.25, bucket=16, block_tables=tables.float())


# ---- the engine's attention contexts over scattered blocks ----------------------------------------

def paged_kv(slots_tokens: dict[int, int], block_size=4, heads=8, kv_heads=2, head_dim=16, max_ctx=64,
             dtype=torch.float64, device="cpu", seed=0) -> KVCache:
    """A paged KVCache of random values whose slots own scattered, non-consecutive blocks."""
    cfg = MoeConfig(arch="mixtral", vocab_size=8, hidden_size=heads * head_dim, num_layers=2, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=head_dim, num_experts=2, top_k=1, expert_intermediate_size=8,
                    rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=max_ctx)
    need = sum(-(-n // block_size) for n in slots_tokens.values())
    kv = KVCache(cfg, max(slots_tokens) + 1, max_ctx, dtype, torch.device(device), block_size=block_size,
                 num_blocks=2 * need + 3)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g, dtype=torch.float64).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g, dtype=torch.float64).to(dtype))
    free = torch.randperm(kv.num_blocks, generator=g).tolist()
    for slot, n in slots_tokens.items():
        kv.set_row(slot, [free.pop() for _ in range(-(-n // block_size))])
    kv.sync()
    return kv


def token_kv(kv: KVCache, layer: int, slot: int, n: int):
    """Positions [0, n) of `slot` looked up one by one: k, v [n, Hkv, D]."""
    bs = kv.block_size
    blocks = kv.host_tables[slot].tolist()
    k = torch.stack([kv.k[layer, blocks[p // bs], p % bs] for p in range(n)])
    v = torch.stack([kv.v[layer, blocks[p // bs], p % bs] for p in range(n)])
    return k, v


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_decode_attention_over_scattered_blocks(backend, window):
    dtype = torch.float64 if backend == "sdpa" else torch.float32         # the interpreter: float32
    positions = {3: 17, 0: 40, 2: 2}
    kv = paged_kv({s: p + 1 for s, p in positions.items()}, dtype=dtype, device=KERNEL_DEVICE)
    slots = torch.tensor(list(positions), device=KERNEL_DEVICE)
    pos = torch.tensor(list(positions.values()), device=KERNEL_DEVICE)
    g = torch.Generator().manual_seed(1)
    q, k_new, v_new = (torch.randn(3, h, 16, generator=g, dtype=torch.float64).to(dtype).to(KERNEL_DEVICE)
                       for h in (8, 2, 2))
    attn = DecodeAttention(kv, slots, pos, decode_bucket_tokens(41, 64), sliding_window=window, backend=backend)
    out = attn.attend(1, q, k_new, v_new)
    for t, (slot, p) in enumerate(positions.items()):
        keys, values = token_kv(kv, 1, slot, p + 1)
        assert torch.equal(keys[p], k_new[t]) and torch.equal(values[p], v_new[t])    # written at its position
        torch.testing.assert_close(out[t], reference(q[t], keys, values, p, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("consecutive", [True, False], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_prefill_attention_over_blocks(consecutive, window):
    start, C, slot = 9, 6, 1
    kv = paged_kv({0: 8, 1: start + C}, seed=2)
    if consecutive:
        kv.set_row(slot, [5, 6, 7, 8])
    attn = PrefillAttention(kv, slot=slot, start_pos=start, num_tokens=C, sliding_window=window)
    assert (attn._first is not None) == consecutive
    g = torch.Generator().manual_seed(3)
    q = torch.randn(C, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(C, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(C, 2, 16, generator=g, dtype=torch.float64)
    other = token_kv(kv, 0, 0, 8)
    out = attn.attend(0, q, k, v)
    keys, values = token_kv(kv, 0, slot, start + C)
    assert torch.equal(keys[start:], k) and torch.equal(values[start:], v)
    assert all(torch.equal(a, b) for a, b in zip(other, token_kv(kv, 0, 0, 8)))    # slot 0 untouched
    for c in range(C):
        assert torch.allclose(out[c], reference(q[c], keys, values, start + c, window), atol=1e-10)


def test_prefill_refuses_positions_without_a_block():
    kv = paged_kv({0: 8})
    with pytest.raises(RuntimeError, match="no KV block"):
        PrefillAttention(kv, slot=0, start_pos=8, num_tokens=4)


# ---- on the GPU: bf16 at qwen3-30b-a3b shapes, and block tables changed in place under a CUDA graph ----------

@pytest.mark.gpu
@pytest.mark.parametrize("lens,window", [([1280, 77, 4096], None), ([3000, 2048], 512)])
def test_bf16_paged_qwen3_shapes_on_gpu(lens, window):
    Hq, Hkv, D, page = 32, 4, 128, 16
    bucket = decode_bucket_tokens(max(lens), 32768)
    num_pages = sum(-(-n // page) for n in lens) + 64
    k, v = make_cache(num_pages, page, Hkv, D, dtype=torch.bfloat16, device="cuda", seed=5)
    tables, rows = scattered_tables(lens, page, num_pages, 8, bucket // page, seed=5)
    q = (2 * torch.randn(len(lens), Hq, D)).to(torch.bfloat16).cuda()
    kw = dict(scale=D ** -0.5, bucket=bucket, sliding_window=window, block_tables=tables.cuda())
    seq_lens = torch.tensor(lens).cuda()
    out = decode_attention(q, k, v, rows.cuda(), seq_lens, **kw)
    ref = decode_attention_reference(q.float(), k.float(), v.float(), rows.cuda(), seq_lens, **kw)
    err = (out.float() - ref).abs()
    assert err.max() <= 1e-2 * ref.abs().max() and err.norm() <= 5e-3 * ref.norm()


@pytest.mark.gpu
def test_paged_kernel_in_a_cuda_graph_reads_tables_changed_in_place():
    Hq, Hkv, D, page, bucket = 32, 4, 128, 16, 2048
    num_pages = 400
    k, v = make_cache(num_pages, page, Hkv, D, dtype=torch.bfloat16, device="cuda", seed=6)
    tables = torch.full((4, bucket // page), -1, dtype=torch.int32, device="cuda")
    rows = torch.tensor([1, 3], device="cuda")
    seq_lens = torch.tensor([100, 2048], device="cuda")
    q = torch.randn(2, Hq, D, device="cuda").to(torch.bfloat16)

    def fill(lens, seed):
        host = torch.full((4, bucket // page), -1, dtype=torch.int32)
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        used = 0
        for r, n in zip(rows.tolist(), lens):
            need = -(-n // page)
            host[r, :need] = perm[used:used + need].int()
            used += need
        tables.copy_(host.cuda())
        seq_lens.copy_(torch.tensor(lens))
    fill([100, 2048], 0)
    kw = dict(scale=D ** -0.5, bucket=bucket)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(q, k, v, rows, seq_lens, block_tables=tables, **kw)       # compile outside
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, rows, seq_lens, block_tables=tables, **kw)
    for seed, lens in enumerate(([100, 2048], [1, 1280], [2047, 64])):
        fill(lens, seed + 1)
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_reference(q.float(), k.float(), v.float(), rows, seq_lens, block_tables=tables, **kw)
        err = (out.float() - ref).abs()
        assert err.max() <= 1e-2 * ref.abs().max(), seed
