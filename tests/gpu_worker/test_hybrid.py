"""The `hybrid` and `cpu` expert backends on the tiny model with real CPU worker processes.

Lossless against `resident` (greedy, float32) for every rounding mode with and without promotion;
faults in the middle of a generation (SIGKILL, SIGSTOP of one of two workers) finish with the
resident tokens; the policy changes live; telemetry reaches the engine's stats.
The tiny model's tokens are dominated by its bigram embedding, so equal tokens alone would miss
wrong expert outputs: every layer call is also compared with `ResidentExperts` on the same inputs
(`Lockstep`), within MAX_REL_DIFF (the CPU kernel's fp32 GEMMs group tokens differently, so the
last bits may differ; a wrong route or weight is off by O(1)).
One backend (2 workers) serves the whole module: starting workers is the slow part.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time
import types

import pytest
import torch

from ftexpert.gpu_worker.engine import Engine, SamplingParams
from ftexpert.gpu_worker.engine.engine import DEFAULT_PREFILL_CHUNK_TOKENS
from ftexpert.gpu_worker.backends.hybrid import HybridExperts, HybridOptions
from ftexpert.kernels.slot_cache import ROUND_MODES, reset
from ftexpert.kernels.slot_cache.state import POLICY_FRAC_Q16, POLICY_PROMOTE, POLICY_ROUND
from tests.conftest import HAS_CUDA
from tests.built_engines import build, build_with_resources, engine_of
from tests.gpu_worker.test_device_doorbell import stop_worker

PROMPTS = ([5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8], [300, 11, 64, 7, 250, 3, 99])
NEW_TOKENS = 24
FAULT_TOKENS = 48
CACHE_SLOTS = 12                  # of 4 layers x 8 experts: misses every step
TEST_WORKER_ARGS = ("--threads", "1", "--no-pin", "--hot-ms", "1", "--sleep-max-us", "200")
MAX_REL_DIFF = 1e-5              # |hybrid - resident|_max / |resident|_max per layer call (measured: 5e-7)
RESTART_TIMEOUT_S = 60.0
STOP_DEADLINE_S = 1.0             # the SIGSTOP test's deadline; the others use a lenient one (no false alarms)
LENIENT_DEADLINE_S = 20.0


def options_for_tests(**kw) -> HybridOptions:
    return HybridOptions(cpu_deadline_s=LENIENT_DEADLINE_S, **kw)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def make_engine(built, running: int = 2, experts=None) -> Engine:
    """An engine over `built`'s model and `experts` (default: the test's Lockstep, `built.lock`, where it has one)."""
    return engine_of(built, max_running_requests=running, max_context_tokens=128, prefill_chunk_tokens=4,
                     experts=experts if experts is not None else getattr(built, "lock", None))


def greedy(built, prompts=PROMPTS, n: int = NEW_TOKENS, experts=None) -> list[list[int]]:
    return make_engine(built, experts=experts).generate([list(p) for p in prompts],
                                                        SamplingParams(max_new_tokens=n, ignore_eos=True))


def resident_build(device: str = "cpu"):
    return build(device=device, max_running_requests=2, max_context_tokens=128)


@pytest.fixture(scope="module")
def resident(tiny_cache):
    loaded = resident_build()
    return {"tokens": greedy(loaded), "long": greedy(loaded, prompts=PROMPTS[:1], n=FAULT_TOKENS)[0]}


class Lockstep:
    """The hybrid backend as the model's experts, every call checked against the resident backend."""

    def __init__(self, backend: HybridExperts, reference):
        self.backend, self.reference = backend, reference
        self.max_rel_diff, self.calls = 0.0, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, layer_idx, x, topk_ids, topk_weights, partials=False):
        # the sums are compared: a fused forward's request for per-route outputs is not passed on (either is valid)
        out = self.backend.forward(layer_idx, x, topk_ids, topk_weights)
        if out.is_cuda and torch.cuda.is_current_stream_capturing():
            return out         # a decode graph being captured (device hand-off): its warm-ups were compared
        ref = self.reference.forward(layer_idx, x, topk_ids, topk_weights)
        rel = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        self.max_rel_diff = max(self.max_rel_diff, rel)
        self.calls += 1
        return out


@pytest.fixture(scope="module")
def hybrid(tiny_cache):
    loaded = build_with_resources("hybrid", cache_size=CACHE_SLOTS, worker_args=TEST_WORKER_ARGS,
                                  max_running_requests=2, max_context_tokens=128,
                                  hybrid=options_for_tests(fetch_fraction=0.5))
    backend = loaded.experts
    loaded.lock = Lockstep(backend, resident_build().experts)     # the engines of make_engine run over it
    yield loaded
    backend.close()


def fresh(lockstep: Lockstep, **policy) -> dict:
    """Empty the slot pool, apply a policy, return the counters to diff against."""
    backend = lockstep.backend
    backend.pool.deadline_s = LENIENT_DEADLINE_S
    reset(backend.cache)
    backend.set_policy(**policy)
    lockstep.max_rel_diff, lockstep.calls = 0.0, 0
    return backend.counters()


def assert_lockstep(lockstep: Lockstep) -> None:
    assert lockstep.calls > 0 and lockstep.max_rel_diff <= MAX_REL_DIFF


def delta(backend: HybridExperts, before: dict, name: str) -> float:
    return backend.counters()[name] - before[name]


@pytest.mark.parametrize("fetch_round", ["min-wait", "stochastic", "prefer-fetch", "split"])   # split: floor here
@pytest.mark.parametrize("promote", [True, False], ids=["promote", "no-promote"])
def test_hybrid_gives_the_resident_tokens(hybrid, resident, fetch_round, promote):
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round=fetch_round, promote=promote, seed=7)
    assert greedy(hybrid) == resident["tokens"]
    # both sides did work, nothing failed, and every slot still holds finite values
    assert delta(backend, before, "experts_fetched_total") > 0
    assert delta(backend, before, "cpu_triples_total") > 0
    for name in ("cpu0", "cpu1"):
        assert backend.counters()["cpu_workers"][name]["triples_total"] > before["cpu_workers"][name]["triples_total"]
    assert delta(backend, before, "fallbacks_total") == 0 and not backend.degraded
    assert torch.isfinite(backend.slots).all()
    assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []    # maps and every slot's bytes
    assert_lockstep(lock)


def test_hybrid_with_the_frequency_weighted_eviction_key(hybrid, resident):
    """A hybrid backend with the frequency-weighted eviction key (HybridExperts(freq_weight=...), else the knob
    FREETOKEN_EVICTION_FREQ_WEIGHT), over the module's store and CPU pool: the tokens and every layer's sums equal
    resident's (Lockstep), both sides work, every mapped slot holds its expert, and the routes are counted."""
    shared = hybrid.lock.backend
    shared.pool.deadline_s = LENIENT_DEADLINE_S
    backend = HybridExperts(shared.host, CACHE_SLOTS, "cpu", shared.pool, owns_host=False, owns_pool=False,
                            fetch_fraction=0.5, seed=7, freq_weight=16)
    lock = Lockstep(backend, hybrid.lock.reference)
    try:
        assert backend.cache.freq_weight == 16
        assert greedy(hybrid, experts=lock) == resident["tokens"]
        assert int(backend.cache.expert_count.sum()) > 0
        c = backend.counters()
        assert c["experts_fetched_total"] > 0 and c["cpu_triples_total"] > 0 and c["fallbacks_total"] == 0
        assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []
        assert_lockstep(lock)
    finally:
        backend.close()


def test_cpu_strategy_computes_every_miss_on_the_cpu(hybrid, resident):
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="cpu")
    assert greedy(hybrid) == resident["tokens"]
    routed = delta(backend, before, "routed_pairs")
    assert delta(backend, before, "experts_fetched_total") == 0 and delta(backend, before, "expert_hits_total") == 0
    assert delta(backend, before, "cpu_triples_total") == routed > 0
    assert_lockstep(lock)
    # the device policy the kernel reads: f = 0 (Q16), promotion off
    assert int(backend.cache.policy[POLICY_FRAC_Q16]) == 0 and int(backend.cache.policy[POLICY_PROMOTE]) == 0


def test_gemv_mode_takes_the_cpu_routes_at_minus_one(hybrid, resident):
    """The gemv mode (moe_gemv, the CUDA decode default; its torch reference here) gets the routes left
    to the CPU as -1 directly, no (slot 0, weight 0) substitution: same tokens, same per-call sums."""
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, seed=3)
    backend.mode = "gemv"
    try:
        assert greedy(hybrid) == resident["tokens"]
    finally:
        backend.mode = "auto"
    assert delta(backend, before, "cpu_triples_total") > 0 and delta(backend, before, "experts_fetched_total") > 0
    assert_lockstep(lock)


def test_hits_of_a_warm_pool_still_run_on_the_gpu_in_cpu_mode(hybrid, resident):
    lock = hybrid.lock
    backend = lock.backend
    fresh(lock, strategy="offload")                   # warm the pool by fetching
    assert greedy(hybrid) == resident["tokens"]
    before = backend.counters()
    backend.set_policy(strategy="cpu")
    assert greedy(hybrid) == resident["tokens"]
    assert delta(backend, before, "expert_hits_total") > 0 and delta(backend, before, "experts_fetched_total") == 0
    assert 0 < delta(backend, before, "cpu_triples_total") < delta(backend, before, "routed_pairs")
    assert_lockstep(lock)


def test_prefill_chunks_take_the_engines_default_unless_the_strategy_is_cpu(hybrid):
    """The engine's prefill chunk with a hybrid backend is the general default (4,096): on the H200 a 4K prompt at a
    25% cache took 7.48 s in 512-token chunks that keep their CPU share, 1.26 s as one chunk run as offload
    (bench/run_gpu.sh prefill), and the prefill prefetch below takes that to the copy roofline. With strategy cpu
    (nothing fetched) the chunks stay within cpu_max_tokens; an explicit chunk size wins either way."""
    backend = hybrid.lock.backend
    try:
        fresh(hybrid.lock, strategy="hybrid")
        assert backend.preferred_prefill_chunk_tokens() is None
        def chunk(size=None):           # over the bare backend (not the test's Lockstep wrapper)
            return engine_of(hybrid, experts=backend, prefill_chunk_tokens=size).prefill_chunk_tokens
        assert chunk() == DEFAULT_PREFILL_CHUNK_TOKENS
        backend.set_policy(strategy="cpu")
        assert chunk() == backend.cpu_max_tokens <= 512
        assert chunk(2048) == 2048
    finally:
        backend.set_policy(strategy="hybrid")


PREFETCH_PROMPT = [(7 * i + 3) % 300 for i in range(40)]


def _prefill_prefetch_case(lock: Lockstep, resident_loaded, device: str) -> None:
    """A 40-token prompt in 32-token chunks with cpu_max_tokens 4: the chunks run as offload (the decode steps
    keep their CPU share). With the prefill prefetch on, each such chunk streams the next layer's experts behind
    its own; tokens equal resident's either way, every layer call agrees with the resident backend (Lockstep),
    every prefetch is waited for, and the prefetched experts are then hits."""
    backend = lock.backend
    run = _prefetch_prompt_tokens
    want = run(resident_loaded)
    cpu_max, prefetch_was = backend.cpu_max_tokens, backend.prefill_prefetch
    seen, stale = {}, []

    def audited(layer_idx, x, topk_ids, topk_weights, partials=False):    # (hybrid returns the sum)
        """After each prefill call, every mapped slot (the prefetched ones too) holds its expert's bytes: the
        decode steps that follow evict the prefetched slots the chunk did not use, so a check at the end
        would miss a prefetch copy that never ran."""
        out = Lockstep.forward(lock, layer_idx, x, topk_ids, topk_weights)
        if x.shape[0] > backend.cpu_max_tokens:
            if out.is_cuda:
                torch.cuda.synchronize()            # the copy stream too (the prefetch is not waited for yet)
            stale.extend((layer_idx, bad) for bad in backend.audit_slots(sample_slots=backend.cache.total_slots))
        return out

    lock.forward = audited
    try:
        backend.cpu_max_tokens = 4
        for prefetch in (True, False):
            before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, seed=5)
            backend.prefill_prefetch = prefetch
            assert run(resident_loaded, lock) == want
            assert not backend.slot_pool.prefetched, "a layer did not wait for the experts prefetched for it"
            assert not stale, f"slots that do not hold their expert after a prefill call: {stale[:4]}"
            assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []
            assert_lockstep(lock)
            seen[prefetch] = {k: delta(backend, before, k) for k in
                              ("experts_prefetched_total", "expert_misses_total", "offload_calls_total",
                               "cpu_triples_total")}
    finally:
        backend.cpu_max_tokens, backend.prefill_prefetch = cpu_max, prefetch_was
        del lock.forward
    on, off = seen[True], seen[False]
    assert on["experts_prefetched_total"] > 0 and off["experts_prefetched_total"] == 0
    assert on["expert_misses_total"] < off["expert_misses_total"], "prefetched experts should be hits"
    assert on["offload_calls_total"] > 0 and on["cpu_triples_total"] > 0     # prefill as offload, decode shared


def _prefetch_prompt_tokens(built, experts=None) -> list[list[int]]:
    engine = engine_of(built, max_running_requests=1, max_context_tokens=128, prefill_chunk_tokens=32,
                       experts=experts)
    return engine.generate([PREFETCH_PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))


class _NoWait(dict):
    """A slot pool's `prefetched` that never hands its events out: the layers do not wait (the GPU test's negative
    control)."""

    def pop(self, key, default=None):
        return default


def test_prefill_run_as_offload_streams_the_next_layers_experts(hybrid):
    _prefill_prefetch_case(hybrid.lock, resident_build(), "cpu")


def test_policy_changes_live_and_bad_values_change_nothing(hybrid, resident):
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="hybrid", fetch_fraction=1.0)
    assert greedy(hybrid) == resident["tokens"]
    assert delta(backend, before, "cpu_triples_total") == 0 and delta(backend, before, "experts_fetched_total") > 0
    policy, device_policy = dict(backend.policy), backend.cache.policy.clone()
    with pytest.raises(ValueError, match="fetch_fraction"):
        backend.set_policy(fetch_fraction=1.5)
    with pytest.raises(ValueError, match="resident needs a restart"):
        backend.set_policy(strategy="resident")
    with pytest.raises(ValueError, match="unknown policy field.*fetch_select"):
        backend.set_policy(fetch_fraction=0.25, fetch_select="recency")      # retired: recency is the only selection
    assert backend.policy == policy and torch.equal(backend.cache.policy, device_policy)
    # through the engine's set_policy (what the coordinator calls)
    engine = make_engine(hybrid)
    engine.set_policy(strategy="hybrid", fetch_fraction=0.25, fetch_round="min-wait")
    assert backend.policy["fetch_round"] == "min-wait" and backend.policy["fetch_fraction"] == 0.25
    before = backend.counters()
    assert engine.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                      ignore_eos=True)) == resident["tokens"]
    assert delta(backend, before, "cpu_triples_total") > 0
    assert_lockstep(lock)
    # telemetry in the engine's stats under the coordinator's names
    s = engine.stats
    assert s.expert_hits_total > 0 and s.expert_misses_total > 0 and s.cpu_experts_total > 0
    assert s.cpu_workers["cpu0"]["experts_total"] > 0 and s.gpu_wait_for_cpu_s_total > 0
    assert s.experts_fetched_total == backend.counters()["experts_fetched_total"]


def long_run_with_fault(loaded, resident_tokens, sig: int) -> tuple[list[int], dict]:
    """One request of FAULT_TOKENS tokens; worker cpu1 gets `sig` after 6 steps. Once the backend has
    fallen back, stepping pauses until the supervisor reports the restarted worker READY, so that the
    re-admission lands inside the generation (a fast CPU would otherwise finish first)."""
    backend = loaded.lock.backend
    victim = backend.pool.members[1]
    old_pid = victim.pid
    engine = make_engine(loaded, running=1)
    engine.add_request(list(PROMPTS[0]), SamplingParams(max_new_tokens=FAULT_TOKENS, ignore_eos=True))
    tokens, steps, seen = [], 0, {}
    # (step, tokens, s since the fault, degraded, fallbacks, re-admissions, the victim's triples) on change
    trace, last = [], None
    t_fault = None
    try:
        while engine.has_work():
            tokens += [out.new_token_id for out in engine.step()]
            steps += 1
            c = backend.counters()
            state = (backend.degraded, c["fallbacks_total"], c["readmissions_total"],
                     c["cpu_workers"][victim.name]["triples_total"])
            if state != last:
                trace.append((steps, len(tokens), None if t_fault is None else round(time.monotonic() - t_fault, 3),
                              *state))
                last = state
            if steps == 6:
                os.kill(old_pid, sig)
                t_fault = time.monotonic()
                seen["fault_at_token"] = len(tokens)
            if backend.degraded and "fell_back_at_token" not in seen:
                seen["fell_back_at_token"] = len(tokens)
                deadline = time.monotonic() + RESTART_TIMEOUT_S
                while not (backend.pool.worker_pids().get(victim.name) not in (0, old_pid)
                           and _state(backend, victim.name) == "ready"):
                    assert time.monotonic() < deadline, "the supervisor did not restart the worker"
                    time.sleep(0.02)
            if "fell_back_at_token" in seen and not backend.degraded and "readmitted_at_token" not in seen:
                seen["readmitted_at_token"] = len(tokens)
    finally:
        if sig == signal.SIGSTOP and _alive(old_pid):
            os.kill(old_pid, signal.SIGCONT)
    assert tokens == resident_tokens
    assert "fell_back_at_token" in seen, f"never seen degraded after the fault at step 6; trace {trace}"
    return tokens, seen


def _state(backend: HybridExperts, name: str) -> str:
    return {w["name"]: w["state"] for w in backend.pool.worker_info()}[name]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


# The module's model is on the CPU, so the device hand-off's kernels run in the Triton interpreter; on a
# machine with CUDA (no interpreter) the gpu-marked tests below run that path on the GPU instead.
INTERPRETER_ONLY = "the device hand-off on a CPU model runs in the Triton interpreter (the gpu-marked tests cover CUDA)"
interpreter_only = pytest.mark.skipif(HAS_CUDA, reason=INTERPRETER_ONLY)


@contextlib.contextmanager
def device_backend(hybrid):
    """A second backend over the module's store and CPU pool that takes the device hand-off (its kernels in the
    Triton interpreter), as the module's Lockstep's backend until the block ends; then closed, and the module's
    host hand-off backend is back."""
    lock = hybrid.lock
    shared = lock.backend
    backend = HybridExperts(shared.host, CACHE_SLOTS, "cpu", shared.pool, owns_host=False, owns_pool=False,
                            fetch_fraction=0.5, cpu_max_tokens=shared.cpu_max_tokens, device_handoff_on_cpu=True)
    lock.backend = backend
    try:
        yield backend
    finally:
        lock.backend = shared
        backend.close()


@pytest.fixture(params=["host", "device"])
def handoff(request, hybrid):
    """Run the test with the host hand-off (CpuPool.submit/join: the module's backend) or the device hand-off
    (DeviceDoorbell: the ring/join kernels, in the Triton interpreter on the CPU; device_backend)."""
    if request.param == "host":
        yield "host"
        return
    if HAS_CUDA:
        pytest.skip(INTERPRETER_ONLY)
    with device_backend(hybrid):
        yield "device"


@interpreter_only
def test_the_device_handoff_gives_the_resident_tokens(hybrid, resident):
    lock = hybrid.lock
    with device_backend(hybrid) as backend:
        doorbells = backend.doorbells.by_member
        before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round="min-wait", promote=True, seed=7)
        assert set(doorbells) == {0, 1}                                # one doorbell per pool member
        assert greedy(hybrid) == resident["tokens"]
        counters = backend.counters()
        calls = {i: db.counters()["answered"] for i, db in doorbells.items()}
        assert all(db.in_flight == 0 and db.aborts == 0 and db.failure() == 0 for db in doorbells.values())
        assert counters["calls"] > 0 and counters["routed_pairs"] > 0
        assert_lockstep(lock)
    assert doorbells == {}                                             # closed with the backend
    assert all(n > 0 for n in calls.values())                        # both workers were rung by the kernels
    assert counters["experts_fetched_total"] - before["experts_fetched_total"] > 0
    for name in ("cpu0", "cpu1"):
        assert counters["cpu_workers"][name]["triples_total"] > before["cpu_workers"][name]["triples_total"]
    assert counters["fallbacks_total"] == before["fallbacks_total"] and not backend.degraded
    # the host hand-off works again on the same channels (the device rings advanced their sequence)
    fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round="min-wait", promote=True, seed=7)
    assert greedy(hybrid, prompts=PROMPTS[:1], n=4) == [resident["tokens"][0][:4]]
    assert_lockstep(lock)


def test_split_rounding_is_min_wait_where_nothing_splits(hybrid, resident):
    """The host hand-off (and prefill) cannot split an expert: under "split" it rounds as min-wait, not floor;
    the same generation fetches exactly what min-wait fetches."""
    lock = hybrid.lock
    backend = lock.backend
    seen = {}
    for rnd in ("min-wait", "split", "min-wait"):
        # f = 0.7: min-wait rounds 0.7 up where floor rounds it down (at 0.5 the two agree: ties go down)
        before = fresh(lock, strategy="hybrid", fetch_fraction=0.7, fetch_round=rnd, promote=False, seed=7)
        assert greedy(hybrid) == resident["tokens"]
        got = (delta(backend, before, "experts_fetched_total"), delta(backend, before, "cpu_triples_total"),
               delta(backend, before, "split_experts_total"))
        assert seen.setdefault(rnd, got) == got                        # deterministic
    assert seen["split"] == seen["min-wait"] and seen["split"][2] == 0 and seen["split"][0] > 0 and seen["split"][1] > 0
    backend.set_policy(fetch_round="split")
    host_rule = backend.split_policy.unsplit                           # min-wait for the host paths ...
    device_rule = int(backend.cache.policy[POLICY_ROUND])              # ... and floor for the device path
    backend.set_policy(fetch_round="min-wait")
    assert host_rule["round_mode"] == "min-wait" and device_rule == ROUND_MODES["split"]
    assert backend.split_policy.unsplit is None and int(backend.cache.policy[POLICY_ROUND]) == ROUND_MODES["min-wait"]


@interpreter_only
@pytest.mark.parametrize("promote", [True, False], ids=["promote", "no-promote"])
def test_split_rounding_splits_one_expert_a_layer_by_channels_on_the_device_path(hybrid, resident, promote):
    """fetch_round split on the device hand-off: the GPU fetches and computes channels [c, I) of one CPU expert
    a layer (the tiny model's I = 64: half of it), the CPU the rest; every layer call matches resident (a CPU
    computing the whole expert besides, or either side the wrong channels, is off by O(1))."""
    lock = hybrid.lock
    with device_backend(hybrid) as backend:
        before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round="split", promote=promote, seed=7)
        assert backend.splits_experts and backend.graph_key()[3] is True
        assert greedy(hybrid) == resident["tokens"]
        counters = backend.counters()
        assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []  # the split slot: outside the cache
    splits = counters["split_experts_total"] - before["split_experts_total"]
    assert splits > 0
    assert counters["split_gpu_channels_total"] - before["split_gpu_channels_total"] == 32 * splits
    for name in ("cpu0", "cpu1"):
        assert counters["cpu_workers"][name]["triples_total"] > before["cpu_workers"][name]["triples_total"]
    assert counters["fallbacks_total"] == before["fallbacks_total"] and not backend.degraded
    assert_lockstep(lock)
    backend.set_policy(fetch_round="min-wait")
    assert not backend.splits_experts


@interpreter_only
def test_the_device_path_counts_what_the_host_path_counts(hybrid, resident):
    """Hits, misses, fetches, calls and routed pairs of the device path (counted on the GPU by
    kernels.handoff.count_call, folded between steps) equal the host path's for the same generation."""
    lock = hybrid.lock
    names = ("expert_hits_total", "expert_misses_total", "experts_fetched_total", "calls", "routed_pairs",
             "offload_calls_total")
    seen = {}
    for kind in ("host", "device"):
        with device_backend(hybrid) if kind == "device" else contextlib.nullcontext():
            backend = lock.backend
            before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round="min-wait", promote=True)
            assert greedy(hybrid) == resident["tokens"]
            seen[kind] = {n: delta(backend, before, n) for n in names}
    assert seen["device"] == seen["host"]
    assert seen["host"]["expert_hits_total"] > 0 and seen["host"]["expert_misses_total"] > 0


def hold_first_answers(backend: HybridExperts, pause_s: float = 0.1) -> None:
    """Until a worker's doorbell has recorded a wait, stop the worker before each ring and resume it pause_s
    after the join began: in the interpreter the answer is otherwise in the channel before the join looks,
    and the interpreter's clock (spins) records no wait."""
    for m in backend.pool.members:
        db = backend.doorbells.for_member(m)
        held: list[int] = []                               # the worker stopped between a ring and its join

        def ring(*args, m=m, db=db, ring=db.ring, held=held, **kw):
            if db.counters()["wait_ns"] == 0:
                stop_worker(types.SimpleNamespace(pid=m.pid, signal=functools.partial(os.kill, m.pid)))
                held.append(m.pid)
            ring(*args, **kw)

        def join(*args, join=db.join, held=held, **kw):
            if not held:
                return join(*args, **kw)
            resume = threading.Timer(pause_s, os.kill, (held.pop(), signal.SIGCONT))
            resume.start()
            try:
                join(*args, **kw)
            finally:
                resume.join()

        db.ring, db.join = ring, join


@interpreter_only
def test_the_device_path_counts_the_gpus_wait_for_the_cpu(hybrid, resident):
    """The join kernels' waits (ST_WAIT_NS) reach gpu_wait_for_cpu_s_total (the name the host path's CUDA
    events fill) and cpu_workers.<name>.gpu_wait_s_total, and stay there once the doorbells are closed."""
    lock = hybrid.lock
    with device_backend(hybrid) as backend:
        before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, fetch_round="min-wait", promote=True, seed=7)
        hold_first_answers(backend)
        assert greedy(hybrid, prompts=PROMPTS[:1], n=4) == [resident["tokens"][0][:4]]
        counters = backend.counters()
        waited = {m.name: backend.doorbells.by_member[m.index].counters()["wait_ns"] / 1e9
                  for m in backend.pool.members}
    waits = {name: w["gpu_wait_s_total"] - before["cpu_workers"][name]["gpu_wait_s_total"]
             for name, w in counters["cpu_workers"].items()}
    assert waits == pytest.approx(waited) and all(w > 0 for w in waits.values()), waits
    # prefill takes the host path, which adds its own wait to the total only (1e-9: float sums)
    assert counters["gpu_wait_for_cpu_s_total"] - before["gpu_wait_for_cpu_s_total"] >= sum(waits.values()) - 1e-9
    assert backend.counters()["cpu_workers"] == counters["cpu_workers"]          # closed doorbells' kept
    assert not backend.degraded and counters["fallbacks_total"] == before["fallbacks_total"]


@interpreter_only
def test_graphs_are_keyed_by_the_doorbells_they_ring(hybrid):
    """A captured graph holds its doorbells' addresses: doorbells closed and made again must not replay a graph
    that rings the closed ones."""
    with device_backend(hybrid) as backend:
        first = backend.graph_key()
        backend.device_path.close_doorbells()
        closed = backend.graph_key()
        for m in backend.pool.members:
            backend.doorbells.for_member(m)
        assert closed != first and backend.graph_key() not in (first, closed)
        assert not backend.graph_safe(2)                   # CUDA graphs: on a CUDA GPU only


def test_the_device_handoff_on_a_cpu_needs_the_interpreter(hybrid, monkeypatch):
    shared = hybrid.lock.backend
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        HybridExperts(shared.host, CACHE_SLOTS, "cpu", shared.pool, owns_host=False, owns_pool=False,
                      device_handoff_on_cpu=True)
    assert not shared.device_handoff and not shared.doorbells.by_member     # the module's: the host hand-off


def test_prefill_only_traffic_readmits_a_restarted_worker(hybrid, resident, handoff):
    """Requests that end at their first token never run a decode step (where the device path re-admits
    between graphs): their prefill re-admits a restarted worker itself."""
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="hybrid", fetch_fraction=0.25, fetch_round="min-wait", promote=True)
    victim = backend.pool.members[1]
    old_pid = victim.pid
    hybrid.resources.supervisor._workers[victim.name].failures_in_row = 0
    engine = make_engine(hybrid, running=1)
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    first = resident["tokens"][0][:1]
    os.kill(old_pid, signal.SIGKILL)
    assert engine.generate([list(PROMPTS[0])], one) == [first]
    assert backend.degraded and engine.stats.num_decode_steps == 0
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while not (backend.pool.worker_pids().get(victim.name) not in (0, old_pid)
               and _state(backend, victim.name) == "ready"):
        assert time.monotonic() < deadline, "the supervisor did not restart the worker"
        time.sleep(0.02)
    while backend.degraded and time.monotonic() < deadline:
        assert engine.generate([list(PROMPTS[0])], one) == [first]
    assert not backend.degraded and engine.stats.num_decode_steps == 0
    assert backend.counters()["readmissions_total"] == before["readmissions_total"] + 1
    reset(backend.cache)             # the prefills while degraded fetched this prompt's experts: misses again
    cpu_before = backend.counters()["cpu_triples_total"]
    assert engine.generate([list(PROMPTS[0])], one) == [first]
    assert backend.counters()["cpu_triples_total"] > cpu_before      # the CPU takes shares again
    assert_lockstep(lock)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_worker_fault_mid_generation_falls_back_then_readmits(hybrid, resident, sig, handoff):
    lock = hybrid.lock
    backend = lock.backend
    before = fresh(lock, strategy="hybrid", fetch_fraction=0.25, fetch_round="min-wait", promote=True)
    if sig == signal.SIGSTOP:
        backend.pool.deadline_s = STOP_DEADLINE_S
    victim = backend.pool.members[1]
    old_pid, restarts_before = victim.pid, backend.pool.restarts()[victim.name]
    # Each parameter is a separate incident: the module's earlier faults of this worker must not count
    # towards the supervisor's max_restarts failures in a row (stable_after_s is 60 s).
    hybrid.resources.supervisor._workers[victim.name].failures_in_row = 0
    store_path = f"/dev/shm/{backend.host.store.name}"
    inode, layer0 = os.stat(store_path).st_ino, backend.host.layers[0].clone()
    t0 = time.monotonic()
    _, seen = long_run_with_fault(hybrid, resident["long"], sig)
    assert_lockstep(lock)                     # the fetched-instead shares are right too
    after = backend.counters()
    # it fell back within the step of the fault (SIGKILL) or the deadline (SIGSTOP), fetched the share,
    # ran as offload meanwhile, and took the restarted worker back before the generation ended
    assert seen["fault_at_token"] <= seen["fell_back_at_token"] < seen["readmitted_at_token"] < FAULT_TOKENS
    assert after["fallbacks_total"] - before["fallbacks_total"] >= 1
    assert after["offload_calls_total"] > before["offload_calls_total"]
    assert after["readmissions_total"] - before["readmissions_total"] == 1 and not backend.degraded
    w_before, w_after = before["cpu_workers"][victim.name], after["cpu_workers"][victim.name]
    assert w_after["failures_total"] > w_before["failures_total"]
    assert w_after["readmissions_total"] == w_before["readmissions_total"] + 1
    assert backend.pool.restarts()[victim.name] == restarts_before + 1
    assert victim.pid != old_pid and not _alive_or_zombie(old_pid)
    if sig == signal.SIGSTOP:                # killed by the pool for missing its deadline
        assert victim.kills_total >= 1
    if handoff == "device":                  # the join kernel gave up (abort word or its own deadline)
        assert backend.doorbells.by_member[victim.index].counters()["failed"] >= 1
    # the restarted worker maps the same store: same segment, same bytes, nothing reloaded
    assert os.stat(store_path).st_ino == inode and torch.equal(backend.host.layers[0], layer0)
    # after re-admission the restarted worker computes again
    before2 = backend.counters()
    backend.pool.deadline_s = LENIENT_DEADLINE_S
    assert greedy(hybrid, prompts=PROMPTS[:1], n=8) == [resident["long"][:8]]
    assert_lockstep(lock)
    assert (backend.counters()["cpu_workers"][victim.name]["triples_total"]
            > before2["cpu_workers"][victim.name]["triples_total"])
    if handoff == "device":
        assert backend.doorbells.by_member[victim.index].failure() == 0
    assert time.monotonic() - t0 < RESTART_TIMEOUT_S


def _alive_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("strategy", ["hybrid", "cpu"])
def test_gpu_hybrid_and_cpu_match_resident_and_survive_a_sigkill(tiny_cache, strategy):
    """The CUDA paths: the device kernels inside the engine's decode CUDA graphs (decode), and a longer prefill
    chunk on the host hand-off (pinned readback, copy stream and events, GEMMs over slot ids, the H2D join).
    Both give the resident tokens; a SIGKILLed worker's step is re-run as offload, the worker re-admitted."""
    resident_loaded = resident_build("cuda")
    tokens, long = greedy(resident_loaded), greedy(resident_loaded, prompts=PROMPTS[:1], n=FAULT_TOKENS)[0]
    loaded = build_with_resources(strategy, device="cuda", cache_size=CACHE_SLOTS, worker_args=TEST_WORKER_ARGS,
                                  max_running_requests=2, max_context_tokens=128,
                                  hybrid=options_for_tests(fetch_fraction=0.5))
    backend = loaded.experts
    lock = loaded.lock = Lockstep(backend, resident_loaded.experts)
    try:
        assert greedy(loaded) == tokens
        assert_lockstep(lock)
        c = backend.counters()
        assert c["cpu_triples_total"] > 0
        if strategy == "hybrid":
            assert c["experts_fetched_total"] > 0
        assert c["gpu_wait_for_cpu_s_total"] > 0          # the join kernels' global-timer waits
        assert backend.graph_safe(2) and c["calls"] > 0
        assert all(w["gpu_wait_s_total"] > 0 for w in c["cpu_workers"].values())
        # one 24-token prefill chunk: 48 routes, more than the device path takes, so the host hand-off
        prompt = list(PROMPTS[0]) + list(PROMPTS[1]) + [1, 2, 3, 4, 5, 6]
        assert not backend.gemm.decode_sized(len(prompt) * 2)

        def prefill_one(built):
            engine = engine_of(built, max_running_requests=1, max_context_tokens=128, prefill_chunk_tokens=64,
                               experts=getattr(built, "lock", None))
            return engine.generate([prompt], SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert prefill_one(loaded) == prefill_one(resident_loaded)
        assert_lockstep(lock)
        c2 = backend.counters()
        assert c2["handoff_s_total"] > c["handoff_s_total"] and c2["cpu_triples_total"] > c["cpu_triples_total"]
        if strategy == "hybrid":
            assert c2["copy_time_s_total"] > 0             # the host path's copy-stream events
        backend.set_policy(strategy="hybrid", fetch_fraction=0.5)      # the fault test needs fetches too
        _, seen = long_run_with_fault(loaded, long, signal.SIGKILL)
        assert_lockstep(lock)
        assert seen["fell_back_at_token"] < seen["readmitted_at_token"] < FAULT_TOKENS
        assert backend.counters()["fallbacks_total"] >= 1 and torch.isfinite(backend.slots).all()
        assert backend.doorbells.by_member[1].counters()["failed"] >= 1
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_split_rounding_in_the_decode_graphs_matches_resident_and_survives_a_sigkill(tiny_cache):
    """fetch_round split inside the engine's decode CUDA graphs: the split pick, the split slot's copy on its own
    stream beside the plan copy and the ring's split request replay with the live cache; tokens as resident; a SIGKILLed worker's
    step is re-run as offload (no split), and the worker is re-admitted."""
    resident_loaded = resident_build("cuda")
    tokens, long = greedy(resident_loaded), greedy(resident_loaded, prompts=PROMPTS[:1], n=FAULT_TOKENS)[0]
    loaded = build_with_resources("hybrid", device="cuda", cache_size=CACHE_SLOTS, worker_args=TEST_WORKER_ARGS,
                                  max_running_requests=2, max_context_tokens=128,
                                  hybrid=options_for_tests(fetch_fraction=0.5, fetch_round="split", promote=False))
    backend = loaded.experts
    lock = loaded.lock = Lockstep(backend, resident_loaded.experts)
    try:
        assert backend.splits_experts and backend.graph_safe(2)
        assert greedy(loaded) == tokens
        assert_lockstep(lock)
        c = backend.counters()
        assert c["split_experts_total"] > 0 and c["split_gpu_channels_total"] == 32 * c["split_experts_total"]
        assert c["fallbacks_total"] == 0
        _, seen = long_run_with_fault(loaded, long, signal.SIGKILL)
        assert seen["fell_back_at_token"] < seen["readmitted_at_token"] < FAULT_TOKENS
        assert backend.counters()["split_experts_total"] > c["split_experts_total"]
        assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
def test_gpu_prefill_run_as_offload_streams_the_next_layers_experts(tiny_cache):
    """The same on the GPU: the prefetch copies run on the copy stream behind the layer's own and the next
    layer waits on their event; a missing wait shows as stale slot bytes (Lockstep, the audit) or tokens."""
    resident_loaded = resident_build("cuda")
    loaded = build_with_resources("hybrid", device="cuda", cache_size=CACHE_SLOTS, worker_args=TEST_WORKER_ARGS,
                                  max_running_requests=2, max_context_tokens=128,
                                  hybrid=options_for_tests(fetch_fraction=0.5))
    backend = loaded.experts
    lock = Lockstep(backend, resident_loaded.experts)
    try:
        _prefill_prefetch_case(lock, resident_loaded, "cuda")
        # The same with the prefetch copies held back on the copy stream (~0.2 s a layer), and no sync between
        # layers: only the wait on their event keeps the next layer's GEMMs from reading the slots early. (~20 ms
        # was too short for the negative control on a machine running 6 test files: the host took longer than that
        # to queue the next layer, so the copies had landed anyway.)
        want = _prefetch_prompt_tokens(resident_loaded)
        queue = backend.host_path._queue_prefetch_copies

        def delayed(*args):
            torch.cuda._sleep(400_000_000)
            queue(*args)

        backend.host_path._queue_prefetch_copies = delayed
        backend.cpu_max_tokens = 4
        before = fresh(lock, strategy="hybrid", fetch_fraction=0.5, seed=5)
        backend.slots.zero_()         # reset keeps the bytes: the last run's experts would sit in the same slots
        assert _prefetch_prompt_tokens(resident_loaded, lock) == want
        assert_lockstep(lock)
        assert delta(backend, before, "experts_prefetched_total") > 0
        # negative control: without the wait the delayed copies are read early, and Lockstep sees it
        backend.slot_pool.prefetched = _NoWait()
        fresh(lock, strategy="hybrid", fetch_fraction=0.5, seed=5)
        backend.slots.zero_()
        _prefetch_prompt_tokens(resident_loaded, lock)
        torch.cuda.synchronize()
        assert lock.max_rel_diff > MAX_REL_DIFF, "a layer that does not wait for its prefetch went unnoticed"
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("resync", [True, False], ids=["as-built", "negative-control-no-resync"])
def test_gpu_a_failed_host_call_leaves_the_device_hand_off_in_step(tiny_cache, resync):
    """A prefill chunk on the host path (more routes than the device path takes) that raises after handing its CPU
    share over: the cache is emptied, the share drained and the device doorbells re-synced with their channels, so
    the next request, whose calls all take the device hand-off, decodes as resident with no fallback (a doorbell left
    behind its channel's sequence would reuse a number: take a stale answer or fail a healthy worker)."""
    long = list(PROMPTS[0]) + list(PROMPTS[1]) + [1, 2, 3, 4, 5, 6]     # 24 tokens x top-2: 48 routes, the host path

    def run(built, prompt):
        engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=64,
                           experts=getattr(built, "lock", None))
        return engine.generate([list(prompt)], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))

    resident_loaded = resident_build("cuda")
    want = run(resident_loaded, PROMPTS[0])                              # 11 tokens: 22 routes, the device path
    loaded = build_with_resources("hybrid", device="cuda", cache_size=CACHE_SLOTS, worker_args=TEST_WORKER_ARGS,
                                  max_running_requests=2, max_context_tokens=128,
                                  hybrid=options_for_tests(fetch_fraction=0.5))
    backend = loaded.experts
    lock = loaded.lock = Lockstep(backend, resident_loaded.experts)
    try:
        assert not backend.gemm.decode_sized(len(long) * 2) and backend.gemm.decode_sized(len(PROMPTS[0]) * 2)
        real, calls = backend.host_path._copy, [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:                                            # layer 1, its CPU share submitted
                raise RuntimeError("injected failure after the CPU share was handed over")
            return real(*args, **kwargs)

        backend.host_path._copy = failing
        if not resync:              # the guard as it was before the review: cache emptied, shares drained, no re-sync
            def forget(exc):
                backend.slot_pool.forget_after_error(exc, backend.stats)
                backend.pool.drain()
            backend.forget_slots_after_error = forget
        with pytest.raises(RuntimeError, match="injected failure"):
            run(loaded, long)
        del backend.host_path._copy
        assert backend.stats.resets_after_error == 1 and bool(backend.doorbells.stale) != resync
        lock.max_rel_diff, lock.calls = 0.0, 0
        got = run(loaded, PROMPTS[0])
        c = backend.counters()
        if not resync:              # a stale sequence: a stale answer (Lockstep, tokens) or a healthy worker failed
            assert got != want or lock.max_rel_diff > MAX_REL_DIFF or c["fallbacks_total"] > 0, \
                "a device ring behind its channel's sequence went unnoticed"
            return
        assert got == want
        assert_lockstep(lock)
        assert c["fallbacks_total"] == 0 and backend.pool.all_serving, c
        assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []
    finally:
        backend.close()
