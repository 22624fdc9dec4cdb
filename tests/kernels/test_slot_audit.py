"""The slot audit (FREETOKEN_MOE_SLOT_AUDIT): kernels.slot_cache.audit finds each kind of broken state, and
the engine runs it every N decode steps, counts what it finds and empties the cache on a problem."""
from __future__ import annotations

import json

import pytest
import torch

from ftexpert.coordinator.cli import build_parser, main
from ftexpert.coordinator.process_set import options_from_serve_args
from ftexpert.gpu_worker.engine import Engine, EngineConfig, SamplingParams
from ftexpert.proto.engine_spec import spec_from_args
from ftexpert.kernels.slot_cache import SlotCache, ensure
from ftexpert.kernels.slot_cache.audit import audit
from tests.built_engines import build, engine_of
from tests.kernels.slot_cache_util import RouteGen

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]
L, E, S = 3, 10, 12


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def used_cache(per_layer: bool = False) -> SlotCache:
    """A cache after a few hundred routed calls through the reference (full, with evictions)."""
    cache = SlotCache.create(L, E, S, per_layer=per_layer)
    routes = RouteGen(L, E, seed=3)
    for step in range(40):
        layer = step % L
        ensure(cache, layer, routes.routes(layer, 2, 3), impl="reference")
    return cache


def occupied(cache: SlotCache) -> list[int]:
    return (cache.id_of_slot >= 0).nonzero().reshape(-1).tolist()


def test_a_used_cache_passes():
    for per_layer in (False, True):
        cache = used_cache(per_layer)
        assert len(occupied(cache)) > 4 and audit(cache) == []


def _two_slots_one_expert(c):
    a, b = occupied(c)[:2]
    c.id_of_slot[b] = c.id_of_slot[a]


def _map_names_another_slot(c):
    a, b = occupied(c)[:2]
    c.slot_for_id.view(-1)[int(c.id_of_slot[a])] = b


def _empty_slot_with_a_usage(c):
    s = occupied(c)[0]
    c.slot_for_id.view(-1)[int(c.id_of_slot[s])] = -1
    c.id_of_slot[s] = -1                      # emptied without its usage


def _usage_ahead_of_the_step(c):
    c.usage[occupied(c)[0]] = int(c.step[0]) + 5


def _slot_outside_its_layers_pool(c):
    # per-layer pools: move a layer-0 expert into a slot of layer 1's pool
    s = next(s for s in occupied(c) if int(c.id_of_slot[s]) < E)
    t = S + next(i for i in range(S) if int(c.id_of_slot[S + i]) < 0) if bool((c.id_of_slot[S:2 * S] < 0).any()) \
        else S
    flat = int(c.id_of_slot[s])
    c.id_of_slot[t], c.usage[t] = flat, c.usage[s]
    c.id_of_slot[s], c.usage[s] = -1, -1
    c.slot_for_id.view(-1)[flat] = t


def _id_past_the_last_expert(c):
    c.id_of_slot[occupied(c)[0]] = L * E + 3


def _map_past_the_pool(c):
    c.slot_for_id.view(-1)[int(c.id_of_slot[occupied(c)[0]])] = c.total_slots + 1


def _error_word_set(c):
    c.error[0] = 1


def _key_below_minus_one(c):
    c.usage[occupied(c)[0]] = -7


def _recency_ahead_of_the_step(c):
    c.expert_recency[1, 2] = int(c.step[0]) + 1


@pytest.mark.parametrize("corrupt, message, per_layer", [
    (_id_past_the_last_expert, "past the last expert", False),
    (_map_past_the_pool, "past the pool's end", False),
    (_error_word_set, "error word", False),
    (_key_below_minus_one, "below -1", False),
    (_recency_ahead_of_the_step, "routed at steps past the step counter", False),
    (_two_slots_one_expert, "held by two slots", False),
    (_map_names_another_slot, "whose map names another slot", False),
    (_empty_slot_with_a_usage, "occupancy and usage disagree", False),
    (_usage_ahead_of_the_step, "past the step counter", False),
    (_slot_outside_its_layers_pool, "outside their pool", True),
])
def test_each_broken_invariant_is_named(corrupt, message, per_layer):
    cache = used_cache(per_layer)
    corrupt(cache)
    problems = audit(cache)
    assert any(message in p for p in problems), problems


def _filled(cache: SlotCache, n: int):
    gen = torch.Generator().manual_seed(n)
    host = [torch.randn(E, n, generator=gen).to(torch.bfloat16) for _ in range(L)]
    slots = torch.zeros(cache.total_slots, n, dtype=torch.bfloat16)
    for s in occupied(cache):
        layer, expert = divmod(int(cache.id_of_slot[s]), E)
        slots[s] = host[layer][expert]
    return host, slots


def test_slot_bytes_are_compared_with_the_store():
    cache = used_cache()
    host, slots = _filled(cache, 16)
    every = len(occupied(cache))
    assert audit(cache, slots=slots, host_layers=host, sample_slots=every) == []
    bad = occupied(cache)[3]
    slots[bad, 0] += 1.0                      # one word of one slot: a copy that did not land whole
    problems = audit(cache, slots=slots, host_layers=host, sample_slots=every)
    assert len(problems) == 1 and f"slots {bad} " in problems[0] and "expert's bytes" in problems[0]
    assert audit(cache, slots=slots, host_layers=host, sample_slots=0) == []     # the maps alone are fine


def test_whole_rows_go_to_the_latest_slots_and_windows_to_the_others():
    cache = used_cache()
    n = 3000                                  # three 256-element windows: start, middle, end
    host, slots = _filled(cache, n)
    newest = max(occupied(cache), key=lambda s: (int(cache.usage[s]), -s))    # ties: the lowest slot, as audit
    kept = slots[newest, 1000].clone()
    slots[newest, 1000] += 1.0                # outside every window: only a whole-row check sees it
    assert audit(cache, slots=slots, host_layers=host, sample_slots=0, probe_slots=100) == []
    assert any(f"slots {newest} " in p for p in audit(cache, slots=slots, host_layers=host, sample_slots=1))
    slots[newest, 1000] = kept                # (bf16: adding and subtracting 1 need not give the word back)
    other = min(occupied(cache), key=lambda s: int(cache.usage[s]))
    slots[other, n // 2] += 1.0               # the middle window
    assert audit(cache, slots=slots, host_layers=host, sample_slots=1) == []          # not the newest slot
    assert any(f"slots {other} " in p for p in audit(cache, slots=slots, host_layers=host, probe_slots=100))


def _build(**fields):
    return build(max_running_requests=2, max_context_tokens=128, **fields)


def _generate(built, audit_every: int, n: int = 16) -> tuple[list[list[int]], Engine]:
    engine = engine_of(built, moe_slot_audit=audit_every)
    tokens = engine.generate([list(PROMPT), PROMPT[::-1][:7]], SamplingParams(max_new_tokens=n, ignore_eos=True))
    return tokens, engine


def test_the_engine_audits_every_n_steps_and_empties_a_broken_cache(monkeypatch):
    """Every slot's bytes broken before the third audit: the audit finds it and empties the cache, and the
    tokens stay the resident ones. With the reset replaced by a no-op they do not (the cache is large enough
    that the broken slots stay in use), so the check can fail."""
    import ftexpert.gpu_worker.engine.engine as engine_module

    resident, _ = _generate(_build(), 0)
    loaded = _build(moe_strategy="offload", moe_cache_size=28)
    backend = loaded.experts
    monkeypatch.setattr(engine_module, "SLOT_AUDIT_SAMPLE", backend.cache.total_slots)    # look at every slot
    try:
        tokens, engine = _generate(loaded, 2)
        steps = engine.stats.num_decode_steps
        assert tokens == resident and steps > 4
        assert engine.stats.slot_audits == steps // 2 and engine.stats.slot_audit_failures == 0

        def run(reset) -> tuple[list[list[int]], Engine, list]:
            backend.reset_slots()
            real, calls, emptied = type(backend).audit_slots, [], []

            def breaking_audit(sample_slots, probe_slots=0, seed=0):
                calls.append(seed)
                if len(calls) == 3:                   # every occupied slot's bytes off, before the third audit
                    backend.slots[backend.cache.id_of_slot >= 0] += 1.0
                return real(backend, sample_slots, probe_slots, seed=seed)

            def resetting():
                reset()
                emptied.append(int((backend.cache.id_of_slot >= 0).sum()))

            monkeypatch.setattr(backend, "audit_slots", breaking_audit)
            monkeypatch.setattr(backend, "reset_slots", resetting)
            tokens, engine = _generate(loaded, 1)
            monkeypatch.undo()
            monkeypatch.setattr(engine_module, "SLOT_AUDIT_SAMPLE", backend.cache.total_slots)
            assert len(calls) == engine.stats.slot_audits == engine.stats.num_decode_steps
            return tokens, engine, emptied

        tokens, engine, emptied = run(lambda: type(backend).reset_slots(backend))
        assert engine.stats.slot_audit_failures == 1 and emptied == [0]       # found once, emptied at once
        assert tokens == resident                     # emptied, the cache refills and stays lossless
        assert audit(backend.cache, slots=backend.slots, host_layers=backend.host.layers,
                     sample_slots=backend.cache.total_slots) == []
        tokens, engine, _ = run(lambda: None)         # the same break, never emptied
        assert engine.stats.slot_audit_failures > 1 and tokens != resident
    finally:
        backend.close()


def test_an_audit_that_raises_loses_no_tokens(monkeypatch):
    resident, _ = _generate(_build(), 0, n=6)
    loaded = _build(moe_strategy="offload", moe_cache_size=9)
    backend = loaded.experts

    def broken(*args, **kwargs):
        raise OSError("the host store is gone")

    monkeypatch.setattr(backend, "audit_slots", broken)
    try:
        tokens, engine = _generate(loaded, 1, n=6)
        assert tokens == resident
        assert engine.stats.slot_audit_failures == engine.stats.slot_audits == engine.stats.num_decode_steps > 0
    finally:
        backend.close()


def test_a_backend_without_a_slot_cache_is_not_audited():
    tokens, engine = _generate(_build(), 1, n=4)
    assert engine.stats.num_decode_steps > 0 and engine.stats.slot_audits == 0


def test_bad_audit_intervals_are_refused():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="slot_audit_every"):
            EngineConfig(slot_audit_every=bad)


def test_the_knob_reaches_every_entry_point(monkeypatch, capsys):
    """--moe-slot-audit / FREETOKEN_MOE_SLOT_AUDIT: ft generate (flag > environment), ft serve's worker command
    line (local to the worker), ft worker gpu's parser."""
    audits = []
    init = EngineConfig.__post_init__

    def recording(self):
        init(self)
        audits.append(self.slot_audit_every)

    monkeypatch.setattr(EngineConfig, "__post_init__", recording)
    argv = ["generate", "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--ignore-eos", "--device", "cpu",
            "--moe-strategy", "offload", "--moe-cache-size", "9", "--json"]
    monkeypatch.setenv("FREETOKEN_MOE_SLOT_AUDIT", "2")
    assert main(argv) == 0
    assert main(argv + ["--moe-slot-audit", "1"]) == 0
    assert audits[-2:] == [2, 1]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"]

    serve = build_parser().parse_args(["serve", "--moe-strategy", "offload", "--moe-slot-audit", "5"])
    assert options_from_serve_args(serve, spec_from_args(serve)).spec.moe_slot_audit == 5   # what WELCOME carries
