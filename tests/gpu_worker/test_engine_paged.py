"""The engine over its paged KV cache (engine/kv_cache.py, block_pool.py, kv_blocks.py, scheduler.py): admission by
free blocks, preemption by recompute when the pool runs out, the block book never leaking, and a request that can
never fit refused at add_request. Greedy tokens are compared with an unconstrained run (a pool with room for every
request, prefix caching off): a request's tokens must not depend on the pool, on who was preempted, or on what it
found cached. The embedded default model, on the CPU."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.gpu_worker.assembly.loader import load_model

VOCAB_LO, VOCAB_HI = 3, 300          # ordinary word ids of the embedded model


@pytest.fixture(scope="module")
def embedded():
    return load_model(device="cpu")


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def engine(loaded, *, pool: int | None = None, block: int = 4, prefix: bool = True, running: int = 3,
           chunk: int = 16, ctx: int = 256, overlap: bool = False, checkpoints: int | None = None) -> Engine:
    """An engine with a pool of `pool` tokens (None: the default, room for every request); `checkpoints`: the
    linear layers' kept states (EngineConfig.state_checkpoints)."""
    return Engine(loaded.model, EngineConfig(max_running_requests=running, max_context_tokens=ctx,
                                             prefill_chunk_tokens=chunk, kv_block_size=block,
                                             kv_cache_tokens=pool, prefix_caching=prefix, overlap_decode=overlap,
                                             state_checkpoints=checkpoints),
                  eos_token_ids=())


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def audit(e: Engine) -> None:
    """The block book is consistent, and its ref counts are the running requests' table entries; every running
    request's table row names exactly its blocks; no block is in two requests' tables unless it is cached-shared
    (named by a prefix key)."""
    held = Counter(b for r in e.scheduler.running for b in r.blocks)
    pool = e.blocks.pool
    assert pool.audit(dict(held)) == []
    for r in e.scheduler.running:
        row = e.kv.host_tables[r.slot].tolist()
        assert row[:len(r.blocks)] == r.blocks and all(b == -1 for b in row[len(r.blocks):])
        assert len(r.blocks) * e.kv.block_size >= r.num_kv_tokens
    for block, n in held.items():
        assert n == 1 or pool.key_of[block] is not None, f"unnamed block {block} shared by {n} requests"
    for r in e.scheduler.waiting:
        assert r.slot is None and not r.blocks


def assert_idle_and_whole(e: Engine) -> None:
    """Nothing running: every block free or cached, every ref count zero, every table row empty."""
    pool = e.blocks.pool
    assert not e.has_work()
    assert pool.audit({}) == [] and all(n == 0 for n in pool.ref)
    assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_blocks
    assert (e.kv.host_tables == -1).all()
    assert e.step() == [] and (e.kv.block_tables.cpu() == -1).all()          # the device rows at the next plan
    s = e.stats
    assert (s.kv_blocks_used, s.kv_blocks_free + s.kv_blocks_cached) == (0, s.kv_blocks_total)


def run(e: Engine, requests: dict, check=audit) -> dict:
    """Add `requests` (name -> (prompt, max_new)) at once and drain: name -> (tokens, finish reason)."""
    for name, (prompt, n) in requests.items():
        e.add_request(prompt, greedy(n), request_id=name)
    out: dict = {}
    while e.has_work():
        for o in e.step():
            toks, _ = out.get(o.request_id, ([], None))
            out[o.request_id] = (toks + [o.new_token_id], o.finish_reason)
        check(e)
    return out


def shared_prefix_requests(n: int, prefix_len: int, seed: int) -> dict:
    base = ids(prefix_len, seed)
    return {f"r{i}": (base + ids(3 + 2 * i, seed + 10 + i), 10 + i % 3) for i in range(n)}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_small_pool_preempts_and_evicts_and_keeps_the_tokens(embedded, overlap):
    """A pool of 16 blocks of 4 tokens for five requests of up to 36 tokens each: the youngest are preempted and
    recomputed, cached blocks evicted, and every request ends with the tokens of the unconstrained run."""
    requests = shared_prefix_requests(5, 13, seed=1)
    expected = run(engine(embedded, prefix=False), requests)
    small = engine(embedded, pool=64, overlap=overlap)
    got = run(small, requests)
    assert got == expected and all(reason == "length" for _, reason in got.values())
    s = small.stats
    assert s.kv_preemptions_total >= 1, "the pool never ran out: the test tests nothing"
    assert s.kv_cache_evictions_total >= 1 and s.prefix_cache_hit_tokens_total > 0
    assert_idle_and_whole(small)


def test_preemption_without_prefix_cache_recomputes_every_token(embedded):
    requests = shared_prefix_requests(4, 9, seed=2)
    expected = run(engine(embedded, prefix=False), requests)
    small = engine(embedded, pool=48, prefix=False, chunk=5)
    assert run(small, requests) == expected
    s = small.stats
    assert s.kv_preemptions_total >= 1 and s.prefix_cache_queries_total == 0 and s.kv_blocks_cached == 0
    prompts = sum(len(p) for p, _ in requests.values())
    assert s.prefill_tokens > prompts                    # the preempted requests' tokens, computed again
    assert_idle_and_whole(small)


def test_a_request_that_can_never_fit_is_refused_with_the_numbers(embedded):
    e = engine(embedded, pool=32)                       # 8 blocks of 4
    with pytest.raises(ValueError, match=r"needs up to 10 KV blocks of 4 tokens \(30 prompt \+ up to 10 generated "
                                         r"tokens\) but the KV cache holds 8 blocks \(32 tokens\) in all"):
        e.add_request(ids(30, 3), greedy(10))
    assert not e.has_work()
    fits = run(e, {"a": (ids(20, 4), 12)})              # 20 + 12 = 32 tokens: exactly the pool
    assert len(fits["a"][0]) == 12 and fits["a"][1] == "length"
    ctx = engine(embedded, ctx=40)                      # the context limit caps the need: 36 + 100 -> 40 tokens
    assert len(run(ctx, {"b": (ids(36, 5), 100)})["b"][0]) == 5
    with pytest.raises(ValueError, match="kv_cache_tokens or kv_cache_gib"):
        EngineConfig(kv_cache_tokens=64, kv_cache_gib=1.0)


def test_admission_waits_for_blocks_not_for_rows(embedded):
    """Four rows but a pool of 10 blocks: requests wait in line for blocks (first come, first served), and a
    request is admitted only with a block to spare for each running one."""
    e = engine(embedded, pool=40, running=4, prefix=False)
    for i in range(4):
        e.add_request(ids(14, 20 + i), greedy(2), request_id=i)      # 4 blocks each for its prompt
    e.step()
    assert [r.request_id for r in e.scheduler.running] == [0, 1] and len(e.scheduler.waiting) == 2
    while e.has_work():
        e.step()
        audit(e)
        assert len(e.scheduler.running) <= 2
    assert e.stats.requests_finished == 4
    assert_idle_and_whole(e)


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_random_adds_aborts_and_steps_leak_no_block(embedded, seed):
    """A seeded soak: requests with shared prefixes join, are aborted (waiting, prefilling, decoding) and finish
    over a pool that forces preemption and eviction; the book is checked after every step, every finished
    request has the tokens of the unconstrained run, and at the end every block is free or cached."""
    rng = random.Random(seed)
    prefixes = [ids(11, 30), ids(6, 31)]
    prompts = [prefixes[i % 2] + ids(1 + 3 * i, 40 + i) for i in range(6)]
    longest = {i: run(engine(embedded, prefix=False), {i: (p, 9)})[i][0] for i, p in enumerate(prompts)}
    e = engine(embedded, pool=56, running=3, chunk=7, overlap=True)
    added: dict = {}
    done: dict = {}
    toks: dict = {}
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            p, n = rng.randrange(len(prompts)), rng.randint(1, 9)
            rid = e.add_request(prompts[p], greedy(n))
            added[rid] = (p, n)
        elif op < 0.4 and added:
            rid = rng.choice(list(added))
            if rid not in done and e.abort(rid):
                done[rid] = "abort"
        else:
            for o in e.step():
                toks.setdefault(o.request_id, []).append(o.new_token_id)
                if o.finished:
                    done[o.request_id] = o.finish_reason
            audit(e)
    while e.has_work():
        for o in e.step():
            toks.setdefault(o.request_id, []).append(o.new_token_id)
            if o.finished:
                done[o.request_id] = o.finish_reason
        audit(e)
    assert set(done) == set(added)
    for rid, (p, n) in added.items():
        if done[rid] != "abort":
            assert toks[rid] == longest[p][:n], rid
    assert e.stats.kv_preemptions_total >= 1 and e.stats.prefix_cache_hit_tokens_total > 0
    assert_idle_and_whole(e)


def test_the_engine_spec_sizes_the_pool(embedded):
    """--kv-block-size, --kv-cache-gib and --prefix-cache reach the engine build_engine makes."""
    from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, build_engine
    from ftexpert.proto.engine_spec import EngineSpec
    cfg = embedded.cfg
    per_block = 2 * cfg.num_kv_layers * 8 * cfg.kv_size * 4                  # float32 K and V of 8 positions
    built = build_engine(EngineSpec(model=str(DEFAULT_MODEL_DIR), device="cpu", max_running_requests=2,
                                    kv_block_size=8, kv_cache_gib=100 * per_block / 2**30, prefix_cache="off"))
    try:
        e = built.engine
        assert (e.kv.block_size, e.kv.num_blocks, e.blocks.prefix_caching) == (8, 100, False)
        assert e.kv.block_tables.shape == (2, -(-e.max_context_tokens // 8))
    finally:
        built.close()
    default = build_engine(EngineSpec(model=str(DEFAULT_MODEL_DIR), device="cpu", max_running_requests=2))
    try:
        e = default.engine
        assert e.kv.block_size == 16 and e.blocks.prefix_caching
        assert e.kv.num_blocks * 16 == 2 * e.max_context_tokens             # two full contexts
    finally:
        default.close()


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("device, attention", [pytest.param("cuda", "triton", marks=GPU),
                                               pytest.param("cuda", "sdpa", marks=GPU), ("cpu", "sdpa")])
def test_gpu_graphs_and_overlap_over_a_small_pool_give_the_cpu_tokens(tmp_path, device, attention):
    """On CUDA: decode steps replayed from CUDA graphs (the block tables changed in place between replays),
    queued ahead (overlap), over a pool that preempts and evicts, with the prefix cache: the tokens of the
    unconstrained CPU run. On the CPU the same schedule without graphs (and the pool's size checked to preempt:
    7 blocks of 16 for 3 running requests of 3-4 blocks, the first shared)."""
    from ftexpert.gpu_worker.checkpoint.tiny import ensure_tiny_checkpoint
    from ftexpert.gpu_worker.engine import Engine, EngineConfig
    path = ensure_tiny_checkpoint(tmp_path / "tiny")
    cpu = load_model(path, device="cpu")
    model = cpu if device == "cpu" else load_model(path, device="cuda", expert_compute="gemv")
    vocab = cpu.cfg.vocab_size
    base = [(7 * k) % (vocab - 1) + 1 for k in range(21)]
    requests = {f"r{i}": (base + [(5 * i + k) % (vocab - 1) + 1 for k in range(3 + 2 * i)], 24) for i in range(5)}
    expected = run(engine(cpu, prefix=False), requests)
    e = Engine(model.model, EngineConfig(max_running_requests=3, max_context_tokens=256, prefill_chunk_tokens=16,
                                         kv_block_size=16, kv_cache_tokens=112, attention_backend=attention,
                                         overlap_decode=True), eos_token_ids=())
    assert run(e, requests) == expected
    s = e.stats
    assert s.kv_preemptions_total >= 1 and s.prefix_cache_hit_tokens_total > 0 and s.decode_steps_ahead > 0
    assert device == "cpu" or (e.graphs is not None and e.graphs.replays > 0)
    assert_idle_and_whole(e)


@pytest.mark.parametrize("prefix", [True, False])
def test_a_preempted_request_resumes_where_it_was(embedded, prefix):
    """Preempted after 2 tokens of a 7-token prompt (blocks of 4): its recompute covers positions [0, 8), two whole
    blocks. With the prefix cache both are found cached, so it decodes at once, in a block given at admission for
    position 8; without, it recomputes them. The tokens are those of a run without preemption."""
    prompt = ids(7, 50)
    expected = run(engine(embedded, prefix=False), {"a": (prompt, 6)})["a"][0]
    e = engine(embedded, prefix=prefix)
    e.add_request(prompt, greedy(6), request_id="a")
    toks = []
    while len(toks) < 2:
        toks += [o.new_token_id for o in e.step()]
    req = e.scheduler.find("a")
    e.scheduler._preempt(req)
    assert req.prefill_len == 8 and req.slot is None and e.stats.kv_preemptions_total == 1
    prefilled = e.stats.prefill_tokens
    while e.has_work():
        toks += [o.new_token_id for o in e.step()]
        audit(e)
    assert toks == expected
    assert e.stats.prefill_tokens - prefilled == (0 if prefix else 8)
    assert_idle_and_whole(e)
