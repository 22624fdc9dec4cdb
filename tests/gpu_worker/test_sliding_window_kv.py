"""gpt-oss's sliding-window layers keep only their window of K/V (kv_cache.py's window group, window_blocks.py).

A tiny transformers gpt-oss (window 8, blocks of 4, prompts of several windows) served with the window group gives
transformers' greedy tokens and those of the whole-context cache (the one-group layout, kept here as the reference
by building the engine without a window pool), with chunked prefill, interleaved requests, preemption under a tiny
pool and prefix-cache hits; at every step each request holds at most its bound of window blocks, the table rows hold
-1 before each window, and once all is done no block leaks (BlockPool.audit)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine import engine as engine_module
from ftexpert.gpu_worker.engine.engine import Engine
from ftexpert.gpu_worker.engine.kv_blocks import KVBlocks
from ftexpert.gpu_worker.engine.kv_cache import (KVCache, block_nbytes, pool_sizes, window_blocks_per_request,
                                                 window_split)
from ftexpert.kernels.decode_attention import decode_attention, decode_attention_reference
from tests.built_engines import build, engine_of
from tests.conftest import KERNEL_DEVICE
from tests.gpu_worker.gpt_oss_util import WINDOW, hf_gpt_oss
from tests.gpu_worker.test_models_util import hf_greedy, prompt_ids

BS = 4          # positions per block: a window of 8 spans 2-3 blocks
NEW = 12        # greedy tokens per request


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_gpt_oss(seed=11)
    path = tmp_path_factory.mktemp("gpt_oss_swa")
    hf.save_pretrained(str(path))
    return hf, build(path, dtype="float32", max_context_tokens=128)


@pytest.fixture(scope="module")
def prompts():
    return [prompt_ids(n, seed=40 + n) for n in (37, 26, 45)]        # 3-6 windows each


@pytest.fixture(scope="module")
def expected(pair, prompts):
    hf, _ = pair
    return [hf_greedy(hf, p, NEW) for p in prompts]


def make_engine(built, **fields) -> Engine:
    config = dict(max_running_requests=3, max_context_tokens=128, kv_block_size=BS, prefill_chunk_tokens=5,
                  prefix_cache="on", kv_cache_gib=None)          # every field: the built spec follows the last
    config.update(fields)
    return engine_of(built, **config)


def whole_context_engine(built, monkeypatch, **fields) -> Engine:
    """The cache as it was before window groups: every layer keeps the whole context (one group)."""
    with monkeypatch.context() as m:
        m.setattr(engine_module, "pool_sizes", lambda *a, **k: (pool_sizes(*a, **k)[0], 0))
        engine = make_engine(built, **fields)
    assert engine.kv.window_group is None and engine.blocks.window is None
    return engine


def check_windows(engine: Engine) -> int:
    """The invariants after a step: every running request holds at most the bound of window blocks (the one whose
    prefill chunk ran: the chunk's bound; the others: a decode step's), exactly those of
    its table row from its first window block on, -1 before; the window pool's ref counts equal the rows'. Returns
    the most window blocks a request holds."""
    wb, group = engine.blocks.window, engine.kv.window_group
    most = 0
    held: Counter = Counter()
    assert sum(len(r.window_blocks) > wb.decode_bound for r in engine.scheduler.running) <= 1   # one chunk at most
    for req in engine.scheduler.running:
        n = len(req.window_blocks)
        most = max(most, n)
        assert n <= wb.bound, (req.request_id, n, wb.bound)
        row = group.host_tables[req.slot].tolist()
        assert all(b == -1 for b in row[:req.window_first]), row
        assert row[req.window_first:req.window_first + n] == req.window_blocks
        # the blocks it holds cover the window of its next query
        assert req.window_first <= group.first_block(req.num_kv_tokens)
        held.update(req.window_blocks)
    assert wb.pool.audit(dict(held)) == []
    return most


def run_checked(engine: Engine, prompts, params) -> tuple[list[list[int]], int]:
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    most = 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].append(out.new_token_id)
        most = max(most, check_windows(engine))
    return [tokens[i] for i in ids], most


def assert_no_leak(engine: Engine) -> None:
    for pool in (engine.blocks.pool, engine.blocks.window.pool):
        assert pool.num_used == 0 and pool.audit({}) == []
    assert (engine.kv.window_group.host_tables == -1).all() and (engine.kv.host_tables == -1).all()
    s = engine.stats
    assert s.kv_window_blocks_used == 0 and s.kv_window_blocks_total == engine.blocks.window.pool.num_blocks > 0


def test_the_bound_and_the_split():
    assert window_blocks_per_request(8, 4, 5) == 4            # keys [p - 7, p + 4]: 12 positions, at most 4 blocks
    assert window_blocks_per_request(8, 4, 1) == 3            # decode: [p - 7, p + 1], 9 positions
    assert window_blocks_per_request(128, 16, 4096) == 265    # gpt-oss at its default chunk


def test_only_gpt_oss_with_both_kinds_of_layers_gets_a_window_group(pair):
    _, built = pair
    cfg = built.cfg
    full, sliding, window = window_split(cfg)
    assert (full, sliding, window) == ([1], [0, 2], WINDOW)
    kv = KVCache(cfg, 2, 64, torch.float32, torch.device("cpu"), block_size=BS, num_blocks=10, window_num_blocks=6)
    assert [g.layers for g in kv.groups] == [(1,), (0, 2)] and kv.k.shape[0] == 1 and kv.window_group.k.shape[:2] == (2, 6)
    assert kv.layer_group(2) == (kv.window_group, 1)
    fixed = KVCache(cfg, 2, 64, torch.float32, torch.device("cpu"))          # the fixed layout: one group, all layers
    assert fixed.window_group is None and fixed.k.shape[0] == 3
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        KVBlocks(kv, True)


def test_greedy_tokens_equal_transformers_and_the_whole_context_cache(pair, prompts, expected, monkeypatch):
    """Three interleaved requests in 5-token chunks: the window-only cache gives transformers' tokens, and the
    whole-context cache's; the window group's memory per request stays bounded and nothing leaks."""
    _, built = pair
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine = make_engine(built, prefix_cache="off")
    got, most = run_checked(engine, prompts, params)
    assert got == expected
    assert most == engine.blocks.window.bound                 # the bound is reached, and never passed
    assert_no_leak(engine)
    reference = whole_context_engine(built, monkeypatch, prefix_cache="off")
    assert reference.generate(prompts, params) == expected
    # the window layers keep one chunk's 4 blocks of 4 positions and 2 x 3 decoding ones, not 3 x 128 positions
    wb = engine.blocks.window
    assert (wb.bound, wb.decode_bound) == (4, 3) and engine.kv.window_group.num_blocks == 4 + 2 * 3
    assert engine.kv.num_blocks == reference.kv.num_blocks == 3 * 128 // BS
    assert engine.kv.nbytes * 3 == reference.kv.nbytes * (1 + 2 * 10 / 96)


def test_preemption_under_a_tiny_pool(pair, prompts, expected):
    """A full-context pool that holds one request and a bit: requests are preempted and recomputed (their window
    blocks released and rebuilt), and the tokens stay transformers'."""
    _, built = pair
    cfg = built.cfg
    full_blocks = -(-(45 + NEW) // BS) + 3                  # the longest request and 3 blocks
    gib = (full_blocks * block_nbytes(cfg, 1, BS, torch.float32)
           + (5 + 2 * 3) * block_nbytes(cfg, 2, BS, torch.float32)) / 2**30
    engine = make_engine(built, kv_cache_gib=gib, prefill_chunk_tokens=7)
    assert engine.kv.num_blocks == full_blocks and engine.kv.window_group.num_blocks == 5 + 2 * 3
    got, _ = run_checked(engine, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert got == expected
    assert engine.stats.kv_preemptions_total > 0
    assert_no_leak(engine)


def test_prefix_hits_share_the_window_blocks(pair, prompts):
    """A prompt that extends a finished one hits its blocks (the window group's too: the window of the hit's end is
    still cached) and gives transformers' tokens; with the window blocks evicted the hit is shortened to none."""
    hf, built = pair
    first = prompts[0]
    follow = first + prompt_ids(9, seed=99)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine = make_engine(built)
    run_checked(engine, [first], params)
    cached = engine.stats.kv_window_blocks_cached
    assert cached > 0
    got, _ = run_checked(engine, [follow], params)
    assert got == [hf_greedy(hf, follow, NEW)]
    hit = engine.stats.prefix_cache_hit_tokens_total
    assert hit == len(first) // BS * BS                       # every full block of the first prompt: 36 tokens
    assert_no_leak(engine)
    # every cached window block evicted: the full-context blocks alone make no hit
    wb = engine.blocks.window
    wb.pool.release(wb.pool.allocate(wb.pool.num_available))
    engine.add_request(follow, params)
    req = engine.scheduler.waiting[0]
    assert engine.blocks._hits(req) != []                   # the full-context group alone would hit
    adm = engine.blocks.admission(req)
    assert adm.hits == [] and adm.window_hits == []
    got = []
    while engine.has_work():
        for out in engine.step():
            got.append(out.new_token_id)
        check_windows(engine)
    assert got == hf_greedy(hf, follow, NEW)
    assert_no_leak(engine)


def _cached_window(built, missing: set[int]):
    """A window pool whose blocks 0-9 are cached under keys 0-9, but for those in `missing` (free)."""
    wb = make_engine(built).blocks.window
    keys = [bytes([i]) * 16 for i in range(10)]
    blocks = wb.pool.allocate(10)
    for j, (b, key) in enumerate(zip(blocks, keys)):
        if j not in missing:
            wb.pool.register(b, key)
    wb.pool.release(blocks)
    return wb, keys, blocks


def test_a_hit_is_cut_to_the_longest_prefix_whose_window_is_cached(pair):
    """WindowBlocks.shorten: a hit of h blocks restarts at P = 4h and needs the window group's blocks of keys
    [P - 7, P); with one of those uncached, the hit is cut to the longest shorter one whose window is cached."""
    _, built = pair
    wb, keys, blocks = _cached_window(built, set())
    assert wb.shorten(keys, 10) == (10, blocks[8:10])          # P = 40: keys from 33 on, blocks 8 and 9
    assert wb.shorten(keys, 1) == (1, blocks[0:1])
    wb, keys, blocks = _cached_window(built, {8})
    assert wb.shorten(keys, 10) == (8, blocks[6:8])            # 10 and 9 need block 8
    wb, keys, blocks = _cached_window(built, {8, 6})
    assert wb.shorten(keys, 10) == (6, blocks[4:6])
    wb, keys, blocks = _cached_window(built, {0})
    assert wb.shorten(keys, 1) == (0, []) and wb.shorten(keys, 3) == (3, blocks[1:3])
    wb.prefix_caching = False
    assert wb.shorten(keys, 3) == (0, [])


def test_a_kv_budget_too_small_for_the_window_pool_says_what_to_do(pair):
    _, built = pair
    with pytest.raises(ValueError, match="sliding-window layers.*raise kv_cache_gib"):
        make_engine(built, kv_cache_gib=1e-6)
    sizes = pool_sizes(built.cfg, torch.float32, BS, 3, 128, 5, gib=0.01)
    assert sizes[1] == window_blocks_per_request(WINDOW, BS, 5) + 2 * window_blocks_per_request(WINDOW, BS, 1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode_attention_never_reads_blocks_before_the_window(impl):
    """Table entries before a request's window are -1, and the pages they named hold NaN: the kernel and the
    reference read from the window's first block on only, and equal the whole table's result."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D, page, window = 2, 4, 2, 16, 4, 8
    seq_lens = torch.tensor([23, 30])
    cache_k = torch.randn(20, page, Hkv, D, generator=g)
    cache_v = torch.randn(20, page, Hkv, D, generator=g)
    tables = torch.tensor([list(range(0, 8)), list(range(8, 16))], dtype=torch.int32)
    q = torch.randn(T, Hq, D, generator=g)
    kw = dict(scale=D ** -0.5, bucket=32, sliding_window=window)
    rows = torch.tensor([0, 1])
    whole = decode_attention_reference(q, cache_k, cache_v, rows, seq_lens, block_tables=tables, **kw)
    cut = tables.clone()
    for t, n in enumerate(seq_lens.tolist()):
        first = (n - window) // page
        for j in range(first):
            cache_k[tables[t, j]] = float("nan")
            cache_v[tables[t, j]] = float("nan")
            cut[t, j] = -1
    dev = torch.device(KERNEL_DEVICE if impl == "triton" else "cpu")
    got = decode_attention(q.to(dev), cache_k.to(dev), cache_v.to(dev), rows.to(dev), seq_lens.to(dev),
                           block_tables=cut.to(dev), impl=impl, **kw).cpu()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_on_the_gpu_graphs_keep_only_the_window(tmp_path, no_tf32):
    """CUDA graphs replay decode steps that read the window group through its device table (updated in place as
    blocks leave the window): transformers' tokens, the bound kept, nothing leaked."""
    hf = hf_gpt_oss(seed=11)
    hf.save_pretrained(str(tmp_path))
    built = build(tmp_path, dtype="float32", max_context_tokens=128, device="cuda")
    prompts = [prompt_ids(n, seed=40 + n) for n in (37, 26, 45)]
    engine = make_engine(built)
    got, _ = run_checked(engine, prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert got == [hf_greedy(hf, p, NEW) for p in prompts]
    assert engine.graphs is not None and engine.graphs.replays > 0
    assert_no_leak(engine)
