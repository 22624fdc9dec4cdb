"""The prefix cache (engine/block_pool.py, kv_blocks.py): full KV blocks shared by every request whose sequence starts
with them. Greedy tokens are the same with it on and off over multi-turn conversations that share a system prompt,
interleaved, with and without a pool small enough to evict; a hit skips the prefill of the shared blocks (but the
last prompt token); gpt-oss (sliding windows, sinks) shares blocks too; Qwen3-Next resumes its linear layers' states
from the checkpoint a conversation's last turn kept at a block boundary (and without such checkpoints runs with the
prefix cache off and still preempts and recomputes correctly). The embedded default
model and the tiny gpt-oss / Qwen3-Next checkpoints of the other tests, on the CPU."""
from __future__ import annotations

import pytest

from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.worker_loop import engine_stats
from tests.gpu_worker.test_engine_paged import assert_idle_and_whole, audit, engine, greedy, ids, run


@pytest.fixture(scope="module")
def embedded():
    return load_model(device="cpu")


def converse(e, system: list[int], users: dict[str, list[list[int]]], max_new: int, stagger: int = 2) -> dict:
    """Conversations over one engine, interleaved: conversation i starts at step stagger * i; each turn's prompt is
    the one before, its answer and the next user message (the system prompt first). (name, turn) -> tokens."""
    history = {name: list(system) for name in users}
    turn = {name: 0 for name in users}
    live: dict = {}
    out: dict = {}
    step = 0
    while True:
        for i, name in enumerate(users):
            if name not in live.values() and turn[name] < len(users[name]) and step >= stagger * i:
                history[name] += users[name][turn[name]]
                rid = e.add_request(list(history[name]), greedy(max_new))
                live[rid] = name
        if not e.has_work():
            break
        for o in e.step():
            name = live[o.request_id]
            out.setdefault((name, turn[name]), []).append(o.new_token_id)
            if o.finished:
                history[name] += out[(name, turn[name])]
                turn[name] += 1
                del live[o.request_id]
        audit(e)
        step += 1
    return out


def conversations(seed: int) -> tuple[list[int], dict]:
    system = ids(37, seed)
    users = {f"c{i}": [ids(5 + 2 * t + i, seed + 10 * i + t) for t in range(3)] for i in range(3)}
    return system, users


@pytest.mark.parametrize("pool", [None, 96], ids=["roomy", "evicting"])
def test_multi_turn_tokens_are_the_same_with_the_prefix_cache_on_and_off(embedded, pool):
    system, users = conversations(seed=3)
    off = engine(embedded, prefix=False, chunk=8)
    expected = converse(off, system, users, max_new=6)
    on = engine(embedded, pool=pool, chunk=8)
    got = converse(on, system, users, max_new=6)
    assert got == expected and len(got) == 9
    s = on.stats
    assert s.prefix_cache_queries_total >= 9 and s.prefix_cache_hit_tokens_total >= 8 * 36
    assert s.prefill_tokens < off.stats.prefill_tokens
    if pool is not None:
        assert s.kv_cache_evictions_total >= 1
    assert_idle_and_whole(on)


def test_a_hit_skips_the_shared_blocks_but_computes_the_last_prompt_token(embedded):
    e = engine(embedded, block=4)
    prompt = ids(24, 5)                                   # 6 full blocks
    first = run(e, {"a": (prompt, 5)})["a"][0]            # its last step fills block 7: named as it finishes
    prefilled = e.stats.prefill_tokens
    assert e.stats.prefix_cache_hit_tokens_total == 0 and e.stats.kv_blocks_cached == 7   # 24 + 4 fed: 7 full
    assert run(e, {"b": (prompt, 4)})["b"][0] == first[:4]
    assert e.stats.prefix_cache_hit_tokens_total == 20   # 5 blocks: the 6th holds the last prompt token
    assert e.stats.prefill_tokens - prefilled == 4
    longer = prompt + first[:4] + ids(6, 6)              # the next turn: the answer's K/V (block 7) are cached too
    e.stats.prefix_cache_hit_tokens_total = 0
    run(e, {"c": (longer, 2)})
    assert e.stats.prefix_cache_hit_tokens_total == 24 + 4
    other = prompt[:4] + prompt                           # block 0 cached; then the same blocks one block later
    e.stats.prefix_cache_hit_tokens_total = 0
    assert run(e, {"d": (other, 4)}) == run(engine(embedded, prefix=False), {"d": (other, 4)})
    assert e.stats.prefix_cache_hit_tokens_total == 4     # a key covers the whole prefix, hence the position
    assert_idle_and_whole(e)


def test_the_prefix_cache_figures_reach_the_worker_stats(embedded):
    e = engine(embedded)
    run(e, {"a": (ids(20, 8), 3)})
    names, values = engine_stats(e)
    stats = dict(zip(names, values))
    for name in ("prefix_cache_queries_total", "prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total",
                 "kv_cache_evictions_total", "kv_preemptions_total", "kv_blocks_total", "kv_blocks_used",
                 "kv_blocks_cached", "kv_blocks_free", "kv_block_size", "prefix_cache_enabled"):
        assert name in stats, name
    assert stats["prefix_cache_enabled"] == 1.0 and stats["kv_blocks_cached"] == 5 and stats["kv_block_size"] == 4


def test_gpt_oss_windows_and_sinks_share_blocks(tmp_path):
    """gpt-oss's sliding-window layers (window 8, blocks of 4) read cached blocks like the full ones."""
    from tests.gpu_worker.gpt_oss_util import hf_gpt_oss
    hf = hf_gpt_oss(seed=7)
    hf.save_pretrained(str(tmp_path / "g"))
    loaded = load_model(tmp_path / "g", device="cpu", dtype="float32")
    system = [i % 120 + 1 for i in range(0, 63, 3)]       # 21 tokens, past the window
    users = {f"c{i}": [[(7 * i + 11 * t + k) % 120 + 1 for k in range(4 + t)] for t in range(2)] for i in range(2)}
    expected = converse(engine(loaded, prefix=False, chunk=8), system, users, max_new=5)
    on = engine(loaded, pool=72, chunk=8)
    assert converse(on, system, users, max_new=5) == expected
    assert on.stats.prefix_cache_hit_tokens_total > 0
    assert_idle_and_whole(on)


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    from tests.gpu_worker.qwen3_next_util import hf_qwen3_next, save
    return load_model(save(hf_qwen3_next(seed=7), tmp_path_factory.mktemp("next") / "n"), device="cpu",
                      dtype="float32")


def next_conversations() -> tuple[list[int], dict]:
    system = [(5 * k) % 120 + 1 for k in range(13)]
    users = {f"c{i}": [[(7 * i + 11 * t + k) % 120 + 1 for k in range(3 + 2 * t + i)] for t in range(3)]
             for i in range(3)}
    return system, users


@pytest.mark.parametrize("pool, keep, overlap", [(None, None, False), (None, None, True), (60, None, False),
                                                  (None, 1, False)],
                         ids=["roomy", "overlap", "evicting", "one-state-kept"])
def test_qwen3_next_multi_turn_tokens_are_the_same_with_the_prefix_cache_on_and_off(next_model, pool, keep,
                                                                                    overlap):
    """Qwen3-Next: a hit resumes the linear layers' recurrent and conv states from the checkpoint its conversation's
    last turn kept at a block boundary (state_checkpoints.py), so its greedy tokens are those of the run without
    the prefix cache: interleaved conversations, a decode step queued ahead (the boundary copies ordered behind
    it), a pool small enough to evict and preempt, and a store of one state (each conversation evicts the
    others')."""
    system, users = next_conversations()
    # with a step queued ahead: one conversation at a time, so that its decode steps run in a steady batch and
    # queue ahead, some of them completing a block
    stagger, max_new = (100, 9) if overlap else (2, 6)
    expected = converse(engine(next_model, prefix=False, chunk=8), system, users, max_new=max_new, stagger=stagger)
    on = engine(next_model, pool=pool, chunk=8, overlap=overlap, checkpoints=keep)
    assert converse(on, system, users, max_new=max_new, stagger=stagger) == expected
    s = on.stats
    assert s.prefix_cache_enabled and s.state_checkpoints_saved_total > 0
    assert (s.decode_steps_ahead > 0) == overlap
    if keep is None and pool is None:
        assert s.prefix_cache_hit_tokens_total > 0 and s.state_checkpoint_restores_total > 0
    assert s.state_checkpoints_cached <= (keep or 2 * 3)
    if pool is not None:
        assert s.kv_cache_evictions_total > 0
    assert_idle_and_whole(on)


def test_qwen3_next_hits_end_where_a_state_was_kept(next_model):
    """A turn's hit is the longest run of cached blocks that ends at a kept state: the conversation's first turn
    (13 + 3 prompt tokens, 6 generated, blocks of 4) keeps the state after its last complete block, 20 tokens; the
    next turn resends those and more, and resumes at 20, not at the longest run of cached K/V blocks."""
    system, users = next_conversations()
    e = engine(next_model, chunk=8)
    first = system + users["c0"][0]
    answer = run(e, {"t0": (first, 6)})["t0"][0]
    assert e.stats.state_checkpoints_saved_total == 1 and e.stats.state_checkpoints_cached == 1
    second = first + answer + users["c0"][1]
    hits0 = e.stats.prefix_cache_hit_tokens_total
    run(e, {"t1": (second, 2)})
    assert e.stats.prefix_cache_hit_tokens_total - hits0 == 20 and e.stats.state_checkpoint_restores_total == 1
    # a prompt that shares cached K/V blocks but no kept state is no hit: it starts at 0
    hits0 = e.stats.prefix_cache_hit_tokens_total
    run(e, {"t2": (first[:12] + [119, 118, 117, 116, 115], 2)})
    assert e.stats.prefix_cache_hit_tokens_total == hits0


def test_qwen3_next_without_state_checkpoints_has_no_prefix_cache_and_recomputes_its_states(next_model):
    """state_checkpoints=0: prefix caching is off for Qwen3-Next whatever prefix_caching says; a pool that forces
    preemption still gives the tokens of the unconstrained run (the preempted request's states are rebuilt by its
    recompute)."""
    base = [(5 * k) % 120 + 1 for k in range(10)]
    requests = {f"r{i}": (base + [(3 * i + k) % 120 + 1 for k in range(2 + i)], 8) for i in range(4)}
    expected = run(engine(next_model, prefix=False, chunk=8), requests)
    small = engine(next_model, pool=40, chunk=8, checkpoints=0)              # prefix_caching=True asked for
    assert run(small, requests) == expected
    s = small.stats
    assert not s.prefix_cache_enabled and s.prefix_cache_queries_total == 0 and s.kv_blocks_cached == 0
    assert s.kv_preemptions_total >= 1 and s.state_checkpoints_saved_total == 0
    assert_idle_and_whole(small)


def test_qwen3_next_preempted_requests_resume_from_their_kept_states(next_model):
    """With the prefix cache on, a pool that forces preemption: the preempted request keeps its last boundary's
    state and its blocks, and its recompute resumes there; the tokens are the unconstrained run's."""
    base = [(5 * k) % 120 + 1 for k in range(10)]
    requests = {f"r{i}": (base + [(3 * i + k) % 120 + 1 for k in range(2 + i)], 8) for i in range(4)}
    expected = run(engine(next_model, prefix=False, chunk=8), requests)
    small = engine(next_model, pool=40, chunk=8)
    assert run(small, requests) == expected
    s = small.stats
    assert s.prefix_cache_enabled and s.kv_preemptions_total >= 1 and s.state_checkpoint_restores_total >= 1
    assert_idle_and_whole(small)


def alone_tokens(loaded, prompt: list[int], params) -> list[int]:
    """The tokens of `prompt` run alone with the prefix cache off (chunks of 8, blocks of 4)."""
    e = engine(loaded, prefix=False, chunk=8, running=1)
    e.add_request(list(prompt), params)
    out = []
    while e.has_work():
        out += [o.new_token_id for o in e.step()]
    return out


@pytest.mark.parametrize("seed, pool, keep, overlap, running", [(0, None, None, True, 3), (1, 48, None, True, 3),
                                                                 (2, 64, 1, True, 2), (3, 40, 2, False, 3)])
def test_qwen3_next_turns_that_stop_abort_and_preempt_match_the_turn_run_alone(next_model, seed, pool, keep,
                                                                               overlap, running):
    """Random conversations on one engine: answers that end on stop tokens (some with a decode step queued ahead that
    completes a block the request never keeps), aborts (the partial answer joins the history), answers shorter than
    a block (the hit then ends where a prefill chunk did), pools small enough to evict and preempt, stores of one or
    two states. Every finished turn's tokens equal those of its prompt run alone without the prefix cache."""
    import random
    from ftexpert.gpu_worker.engine import SamplingParams
    rng = random.Random(seed)
    e = engine(next_model, pool=pool, chunk=8, overlap=overlap, checkpoints=keep, running=running)
    system = [rng.randrange(1, 120) for _ in range(rng.randrange(3, 14))]
    hist = {c: list(system) for c in range(4)}
    live, got, turns, mismatches = {}, {}, 0, []
    for _ in range(300):
        for c in range(4):
            if c not in live.values() and rng.random() < 0.3 and len(hist[c]) < (150 if pool is None else pool - 24):
                hist[c] += [rng.randrange(1, 120) for _ in range(rng.randrange(1, 9))]
                params = SamplingParams(max_new_tokens=rng.randrange(2, 14),
                                        stop_token_ids=tuple(rng.sample(range(120), 4)))
                rid = e.add_request(list(hist[c]), params)
                live[rid] = c
                got[rid] = (list(hist[c]), params, [])
        if not e.has_work():
            continue
        if live and rng.random() < 0.05:                   # an abort, at times with a decode step in flight
            rid = rng.choice(sorted(live))
            e.abort(rid)
            hist[live.pop(rid)] += got[rid][2]
        for o in e.step():
            if o.request_id not in live:
                continue
            got[o.request_id][2].append(o.new_token_id)
            if o.finished:
                c = live.pop(o.request_id)
                prompt, params, toks = got[o.request_id]
                turns += 1
                if toks != alone_tokens(next_model, prompt, params):
                    mismatches.append((c, len(prompt)))
                hist[c] += toks
        audit(e)
    s = e.stats
    assert mismatches == [] and turns >= 5
    if pool is None:                                       # room to keep: later turns resume kept states
        assert s.state_checkpoint_restores_total > 0 and s.prefix_cache_hit_tokens_total > 0
    else:                                                  # the small pools evict (and, at 40, preempt)
        assert s.kv_cache_evictions_total > 0
    assert (s.decode_steps_ahead > 0) == overlap


def test_qwen3_next_a_preempted_request_may_find_its_whole_recompute_kept(next_model):
    """A pool that preempts, answers long enough that a preempted request's recompute is all cached with its state
    kept at its end: it goes straight back to decoding (no prefill) and its tokens are the unconstrained run's."""
    base = [(5 * k) % 120 + 1 for k in range(10)]
    requests = {f"r{i}": (base + [(3 * i + k) % 120 + 1 for k in range(2 + i)], 13) for i in range(4)}
    expected = run(engine(next_model, prefix=False, chunk=8), requests)
    small = engine(next_model, pool=40, chunk=8)
    whole = []                          # admissions whose hit covered the whole prefill (a preempted request's)
    admit = small.blocks.admit

    def watched(req, slot, adm):
        admit(req, slot, adm)
        if req.output_ids and not req.in_prefill:
            whole.append(req.request_id)
    small.blocks.admit = watched
    assert run(small, requests) == expected
    s = small.stats
    assert s.kv_preemptions_total >= 1 and s.state_checkpoint_restores_total >= 1 and whole
    assert_idle_and_whole(small)
