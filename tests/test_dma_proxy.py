"""The DMA proxy (gpu_worker/offload/dma_proxy.py, copy mode `proxy`): its protocol on the CPU (the C thread
copying host memory with memcpy, publish / wait as the Triton interpreter and as their references), its faults,
and the offload backend on it, lossless against resident; the CUDA path on the GPU machine."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.models import load_model
from gpu_worker.offload.dma_proxy import DmaProxy
from kernels.expert_copy import proxy as proxy_kernels
from kernels.impl import interpreted

from tests.test_offload import PROMPT, assert_slots_hold_their_experts, greedy_tokens

L, E, S, N = 3, 10, 6, 96


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _interpreter_for_cpu_kernels(request):
    """impl="triton" on CPU tensors needs the interpreter, which conftest sets only where there is no GPU (there,
    the tests marked gpu run the kernels on CUDA)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("impl") == "triton" and not interpreted():
        pytest.skip("Triton kernels on CPU tensors need the interpreter, which conftest sets only without a GPU "
                    "(with one, the tests marked gpu run them on CUDA)")


def _host_layers(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(E, N, generator=gen).to(torch.bfloat16).to(device) for _ in range(L)]


def _plan(call: int, device="cpu"):
    gen = torch.Generator().manual_seed(100 + call)
    evict = torch.randperm(S, generator=gen).to(torch.int32).to(device)
    src = torch.randperm(E, generator=gen)[:S].to(torch.int32).to(device)
    return evict, src, torch.tensor([call % (S + 1)], dtype=torch.int32, device=device)


def _run_calls(px: DmaProxy, host, slots, calls: int) -> int:
    """Publish and wait for `calls` plans of 0..S copies; check each lands; the copies expected."""
    expected = 0
    for call in range(calls):
        layer = call % L
        evict, src, num = _plan(call, slots.device)
        before = slots.clone()
        px.publish(layer, evict, src, num)
        px.wait(0, layer, evict, src, num)
        px.wait(1, layer, evict, src, num)
        n = int(num[0])
        expected += n
        want = before.clone()
        for i in range(n):
            want[int(evict[i])] = host[layer][int(src[i])]
        assert torch.equal(slots, want), f"call {call}: the slots are not the plan applied to them"
    return expected


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("split_cols", [0, 64])
def test_the_proxy_lands_every_plan_in_order(impl, split_cols):
    host = _host_layers()
    slots = torch.zeros(S, N, dtype=torch.bfloat16)
    px = DmaProxy(slots, host, split_cols=split_cols, impl=impl)
    try:
        copies = _run_calls(px, host, slots, calls=9)
        c = px.counters()
        assert not px.failed() and c["fallbacks"] == 0
        assert c["copies"] == copies and c["bytes"] == copies * N * 2
        assert c["published"] == c["issued"] == sum(1 for call in range(9) if call % (S + 1))
    finally:
        px.close()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_proxy_error_is_reported_and_the_wait_copies_itself(impl):
    """The C side rejects a bad entry (here: it believes there are no host rows) and stops; the waits see its
    fail word, copy the plan themselves (the slots stay right) and the host learns why."""
    host = _host_layers()
    slots = torch.zeros(S, N, dtype=torch.bfloat16)
    px = DmaProxy(slots, host, split_cols=64, impl=impl)
    try:
        _run_calls(px, host, slots, calls=2)
        assert px.counters()["fallbacks"] == 0
        px._p.num_rows = 0
        _run_calls(px, host, slots, calls=4)
        assert px.failed()
        assert "host row out of range" in px.failure_reason()
        assert px.counters()["fallbacks"] >= 2          # both parts of at least the first failing plan
    finally:
        px.close()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_stopped_proxy_times_out_and_the_wait_copies_itself(impl):
    """... into a pool whose rows are padded (its own copy steps by the rows' stride, as the thread does)."""
    host = _host_layers()
    slots = torch.zeros(S, N + 32, dtype=torch.bfloat16)[:, :N]
    px = DmaProxy(slots, host, split_cols=0, impl=impl, deadline_s=0.002)
    try:
        px.lib.ft_proxy_stop(px._p)                        # the thread is gone; nothing will land
        _run_calls(px, host, slots, calls=3)
        assert px.failed() and "did not land" in px.failure_reason()
        assert px.counters()["issued"] == 0 and px.counters()["fallbacks"] >= 1
    finally:
        px.close()


def test_bad_arguments_are_refused():
    host = _host_layers()
    with pytest.raises(ValueError, match="split_cols"):
        DmaProxy(torch.zeros(S, N, dtype=torch.bfloat16), host, split_cols=N)
    with pytest.raises(ValueError, match="one dtype"):
        DmaProxy(torch.zeros(S, N, dtype=torch.float32), host)
    with pytest.raises(ValueError, match="2- or 4-byte"):
        DmaProxy(torch.zeros(S, N, dtype=torch.uint8), [h.view(torch.uint8)[:, :N] for h in host])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_plan_longer_than_the_mailbox_is_not_published_and_the_wait_copies_it(impl):
    """ensure never plans more copies than the mailbox holds; if it did, nothing is written past the entry: the
    plan is not published and the waits copy it."""
    host = _host_layers()
    slots = torch.zeros(S, N, dtype=torch.bfloat16)
    px = DmaProxy(slots, host, max_pairs=2, split_cols=64, impl=impl)
    try:
        entries = px.mbox[proxy_kernels.MBOX_HEADER:].clone()
        _run_calls(px, host, slots, calls=6)              # plans of 0..5 copies: the third is longer than 2
        assert px.failed() and "longer than the mailbox" in px.failure_reason()
        assert px.counters()["published"] == 2 and px.counters()["fallbacks"] >= 2
        tail = px.mbox[proxy_kernels.MBOX_HEADER:]
        past_entry_2 = 3 * proxy_kernels.entry_words(2) // 2     # int64 words: entries 1 and 2 were published
        assert torch.equal(tail[past_entry_2:], entries[past_entry_2:]), "a plan was written past its entry"
    finally:
        px.close()


@pytest.mark.parametrize("split_copy", [True, False])
def test_offload_on_the_proxy_gives_the_resident_tokens(split_copy):
    from gpu_worker.offload import OffloadExperts
    prompts = (PROMPT, PROMPT[3:9])
    resident = greedy_tokens(load_model(device="cpu"), prompts=prompts)
    loaded = load_model(device="cpu", moe_strategy="offload", moe_cache_size=10)
    backend = OffloadExperts(loaded.model.experts.host, 10, "cpu", copy_mode="proxy", split_copy=split_copy)
    loaded.model.experts = backend
    try:
        assert (backend._proxy.split_cols > 0) == split_copy
        assert greedy_tokens(loaded, prompts=prompts) == resident
        assert_slots_hold_their_experts(backend)
        stats = backend.refresh_stats()
        c = backend._proxy.counters()
        assert stats.fetched > 10 and c["copies"] == stats.fetched and c["fallbacks"] == 0
        assert backend.copy_mode == "proxy" and stats.proxy_failures == 0
    finally:
        backend.close()


def _proxied_offload(monkeypatch, hook):
    """(resident's tokens, the tiny model on an offload backend with copy mode proxy, the backend): `hook(call)`
    runs before each of its proxy's publishes, numbered from 1."""
    from gpu_worker.offload import OffloadExperts
    resident = greedy_tokens(load_model(device="cpu"))
    loaded = load_model(device="cpu", moe_strategy="offload", moe_cache_size=10)
    backend = OffloadExperts(loaded.model.experts.host, 10, "cpu", copy_mode="proxy")
    loaded.model.experts = backend
    px, publish, calls = backend._proxy, backend._proxy.publish, [0]

    def hooked_publish(*args):
        calls[0] += 1
        hook(calls[0])
        publish(*args)

    monkeypatch.setattr(px, "publish", hooked_publish)
    return resident, loaded, backend


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_proxy_failure_mid_generation_falls_back_to_the_copy_kernel(monkeypatch, phase):
    """The proxy stops on an error during the prompt's prefill or a decode step: that call's waits copy the plans
    themselves; in decode the engine re-runs the step (step_end), in prefill the next call drops the proxy before
    it maps a slot; the backend carries on with the kernel copy, and the tokens are resident's."""
    state = {}

    def hook(call):
        if call == state["at"]:
            state["px"]._p.num_rows = 0

    resident, loaded, backend = _proxied_offload(monkeypatch, hook)
    px = state["px"] = backend._proxy
    layers = backend.num_layers
    # the 11-token prompt is prefilled in 3 chunks of 4 (3 * layers calls); then each decode step calls every layer.
    # decode: the last layer of the second decode step, so that no later eager call of the step sees the failure first
    state["at"] = 2 if phase == "prefill" else 3 * layers + 2 * layers
    from gpu_worker.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(loaded.model, EngineConfig(max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=4),
                    eos_token_ids=())
    try:
        assert engine.generate([list(PROMPT)], SamplingParams(max_new_tokens=24, ignore_eos=True)) == resident
        assert engine.stats.decode_step_retries == (phase == "decode"), "only a decode step whose waits copied runs again"
        assert backend.stats.proxy_failures == 1 and backend.copy_mode == "kernel"
        assert px.counters()["fallbacks"] >= 1
        assert_slots_hold_their_experts(backend)
    finally:
        backend.close()


def test_a_stalled_proxy_is_survived_and_stays_in_use(monkeypatch):
    """The thread stalls past a wait's deadline once (here: it sleeps 40 ms between polls while the deadline is
    2 ms) and then lands its copy late: the wait copied meanwhile; before the next call maps a slot the backend
    waits for the late copy, empties the cache, clears the flags and keeps the proxy; the tokens are resident's
    and every later plan goes through the thread again."""
    state = {}

    def hook(call):
        px = state["px"]
        if call == state["at"]:          # from here the idle thread sleeps 40 ms a poll: the next plan it gets is late
            px._p.hot_ns, px._p.sleep_ns = 0, 40_000_000
            px.state[proxy_kernels.ST_DEADLINE_NS] = 2_000_000
        elif call > state["at"] and state["backend"].stats.proxy_stalls and px._p.hot_ns == 0:
            px._p.hot_ns, px._p.sleep_ns = state["normal"]    # one stall seen and survived: back to normal
            px.state[proxy_kernels.ST_DEADLINE_NS] = state["deadline"]

    resident, loaded, backend = _proxied_offload(monkeypatch, hook)
    px = state["px"] = backend._proxy
    state["backend"] = backend
    state["at"] = at_call = 4 * backend.num_layers        # the last layer of the first decode step: arm the stall
    state["normal"] = (px._p.hot_ns, px._p.sleep_ns)
    state["deadline"] = int(px.state[proxy_kernels.ST_DEADLINE_NS])
    try:
        assert greedy_tokens(loaded) == resident
        st = backend.stats
        assert st.proxy_stalls == 1 and st.proxy_failures == 0 and backend.copy_mode == "proxy"
        c = px.counters()
        assert c["fallbacks"] >= 1 and not px.failed()
        assert c["published"] == c["issued"] > at_call // 2, "later plans must go through the thread again"
        assert_slots_hold_their_experts(backend)
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.parametrize("split_cols", [0, 64])
def test_gpu_the_proxy_lands_every_plan_by_dma(split_cols):
    host = [h.pin_memory() for h in _host_layers()]
    slots = torch.zeros(S, N, dtype=torch.bfloat16, device="cuda")
    px = DmaProxy(slots, host, split_cols=split_cols)
    try:
        copies = _run_calls(px, [h.cuda() for h in host], slots, calls=9)
        torch.cuda.synchronize()
        c = px.counters()
        assert not px.failed() and c["fallbacks"] == 0 and c["copies"] == copies
    finally:
        px.close()


@pytest.mark.gpu
def test_gpu_the_proxy_in_a_cuda_graph_publishes_a_new_sequence_each_replay():
    host = [h.pin_memory() for h in _host_layers()]
    slots = torch.zeros(S, N, dtype=torch.bfloat16, device="cuda")
    px = DmaProxy(slots, host, split_cols=64)
    try:
        evict, src, num = (t.clone() for t in _plan(3, "cuda"))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                   # warm-up (compiles the kernels)
            px.publish(1, evict, src, num)
            px.wait(0, 1, evict, src, num)
            px.wait(1, 1, evict, src, num)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            px.publish(1, evict, src, num)
            px.wait(0, 1, evict, src, num)
            px.wait(1, 1, evict, src, num)
        hostc = [h.cuda() for h in host]
        for call in range(5):
            e2, s2, n2 = _plan(10 + call, "cuda")
            evict.copy_(e2), src.copy_(s2), num.copy_(n2)
            slots.zero_()
            graph.replay()
            torch.cuda.synchronize()
            for i in range(int(n2[0])):
                assert torch.equal(slots[int(e2[i])], hostc[1][int(s2[i])]), (call, i)
        c = px.counters()
        assert not px.failed() and c["fallbacks"] == 0
        assert c["published"] == 1 + sum(1 for call in range(5) if (10 + call) % (S + 1))
    finally:
        px.close()


@pytest.mark.gpu
def test_gpu_offload_on_the_proxy_gives_the_resident_tokens_in_graphs():
    from gpu_worker.engine import Engine, EngineConfig, SamplingParams
    prompts = (PROMPT, PROMPT[:5])

    def tokens(loaded):
        engine = Engine(loaded.model, EngineConfig(max_running_requests=2, max_context_tokens=128,
                                                   prefill_chunk_tokens=4, cuda_graphs=True), eos_token_ids=())
        out = engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=32, ignore_eos=True))
        return out, engine

    resident, _ = tokens(load_model(device="cuda"))
    loaded = load_model(device="cuda", moe_strategy="offload", moe_cache_size=9, offload_copy="proxy")
    backend = loaded.model.experts
    try:
        got, engine = tokens(loaded)
        assert got == resident
        assert engine.graphs is not None and engine.graphs.replays > 0
        assert_slots_hold_their_experts(backend)
        c = backend._proxy.counters()
        assert c["fallbacks"] == 0 and c["copies"] == backend.refresh_stats().fetched > 9
        assert backend.copy_mode == "proxy"
    finally:
        backend.close()


def _routing_ahead_tokens(device: str, ahead: bool, graphs: bool = False):
    """Greedy tokens of the tiny model on the synthetic routing table (zipf), resident or offload on the proxy with
    `routing_ahead` (each layer's plan published before its attention): (tokens, the offload backend or None)."""
    from gpu_worker.engine import Engine, EngineConfig, SamplingParams
    from gpu_worker.models.synthetic_routing import SyntheticRouting
    strategy = {} if ahead is None else dict(moe_strategy="offload", moe_cache_size=9, offload_copy="proxy")
    loaded = load_model(device=device, **strategy)
    loaded.model.routing_override = SyntheticRouting.parse("zipf:1.0", loaded.cfg, 128, device)
    loaded.model.routing_ahead = bool(ahead)
    engine = Engine(loaded.model, EngineConfig(max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=4,
                                               cuda_graphs=graphs), eos_token_ids=())
    prompts = (PROMPT, PROMPT[:5])
    out = engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=24, ignore_eos=True))
    return out, (None if ahead is None else loaded.model.experts), engine


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plans_published_before_the_attention_give_the_resident_tokens(device):
    """MoeModel.routing_ahead (the bound of a perfect router prediction): every decode layer's plan is made and handed
    to the proxy before the layer's attention; the tokens are resident's on the same routing table, the slots hold
    their experts, every copy went through the thread, and every call took the early path. On CUDA in graphs."""
    graphs = device == "cuda"
    resident, _, _ = _routing_ahead_tokens(device, None, graphs)
    ordinary, plain, _ = _routing_ahead_tokens(device, False, graphs)
    plain_counters = plain._proxy.counters()
    plain.close()
    got, backend, engine = _routing_ahead_tokens(device, True, graphs)
    try:
        assert got == ordinary == resident
        st = backend.refresh_stats()
        c = backend._proxy.counters()
        assert c["fallbacks"] == 0 and c["copies"] == st.fetched > 9 and backend.copy_mode == "proxy"
        assert all(c[k] == plain_counters[k] for k in ("published", "issued", "copies", "bytes")), \
            "the same plans as when each layer plans in its own call, each published once"
        if graphs:      # early_plans counts on the host: at each graph's capture, not at its replays (calls do)
            assert engine.graphs is not None and engine.graphs.replays > 0
            assert st.early_plans >= backend.num_layers * len(engine.graphs.graphs) > 0
        else:           # the tiny model's 4-token prefill chunks are decode-sized calls too: every call planned early
            assert st.early_plans == st.calls >= backend.num_layers * engine.stats.num_decode_steps > 0
        assert_slots_hold_their_experts(backend)
    finally:
        backend.close()


def test_an_early_plan_is_refused_for_other_routes_and_a_stale_one_is_dropped():
    """A layer called with routes early_plan was not given for it raises a clear error (the plan already published
    would not fit them); an early plan that no layer call took (its forward raised before the layer's experts) is
    dropped by the next early_plan or by a call that plans as usual, and its copies land."""
    from gpu_worker.offload import OffloadExperts
    loaded = load_model(device="cpu", moe_strategy="offload", moe_cache_size=10)
    backend = OffloadExperts(loaded.model.experts.host, 10, "cpu", copy_mode="proxy")
    try:
        x = torch.randn(1, loaded.cfg.hidden_size, dtype=loaded.model.dtype)
        ids = torch.tensor([[0, 1]], dtype=torch.int64)[:, :loaded.cfg.top_k]
        w = torch.full(ids.shape, 1.0 / ids.shape[1])
        assert backend.early_plan(1, ids)
        with pytest.raises(RuntimeError, match="other routes than early_plan"):
            backend.forward(0, x, ids, w)
        assert backend.early_plan(0, ids) and backend.early_plan(1, ids)    # the first is dropped by the second
        out = backend.forward(1, x, ids, w)
        assert out.shape == x.shape and backend.stats.early_plans == 1
        wide = torch.zeros(8, loaded.cfg.top_k, dtype=torch.int64)
        assert backend.early_plan(0, ids) and not backend.early_plan(0, wide.repeat(8, 1)), \
            "a prefill-sized call plans in its layer call (and drops the stale plan)"
        backend._proxy.quiesce()
        assert backend._proxy.counters()["fallbacks"] == 0
        assert_slots_hold_their_experts(backend)
    finally:
        backend.close()
