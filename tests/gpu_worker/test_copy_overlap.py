"""The expert FFN split around a concurrent copy (kernels.moe_decode.CopyPlan, gpu_worker/backends/offload's DecodeCopy).

moe_gemv with a plan computes the routes whose slot the plan does not fill, calls `between()` (where
the caller waits for the copy), then the routes in the plan. The CPU tests poison the plan's slots
until `between()` runs, so a result that used them before it is NaN; the GPU tests run the real copy
on a side stream, eagerly and inside a CUDA graph, against an FFN over the host weights.
"""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.backends import expert_math
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, unpack_experts
from ftexpert.gpu_worker.backends.expert_math import expert_rows
from ftexpert.gpu_worker.backends.expert_compute import expert_ffn
from ftexpert.gpu_worker.backends.offload.decode_copy import CopyTimer, DecodeCopy
from ftexpert.kernels.moe_decode import CopyPlan, GemvBlocks, moe_gemv
from ftexpert.kernels.moe_decode import reference as ref
from tests.conftest import KERNEL_DEVICE

DEV = KERNEL_DEVICE
SMALL = GemvBlocks(gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16, sum_block=32)


def _experts(S, H, I, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(S, 2 * I, H, generator=g) * 0.1, torch.randn(S, H, I, generator=g) * 0.1)


@pytest.mark.parametrize("plan_len", [0, 1, 3])
def test_split_gemv_reads_the_plans_slots_only_after_between(plan_len):
    T, K, H, I, S = 2, 4, 40, 24, 10
    w13, w2 = _experts(S, H, I, seed=plan_len)
    ids = torch.tensor([[3, 7, -1, 1], [7, 0, 5, -1]])
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(1))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    # the plan fills slots 7, 5, 9 (9 is not routed); position 3 (slot 1, routed) is past the length
    plan_slots = torch.tensor([7, 5, 9, 1, -1], dtype=torch.int32)
    filled = plan_slots[:plan_len].long()
    expected = ref.moe_gemv_reference(x, ids, weights, w13, w2)
    unsplit = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), w13.to(DEV), w2.to(DEV), impl="triton",
                       blocks=SMALL)
    p13, p2 = w13.clone().to(DEV), w2.clone().to(DEV)
    p13[filled.to(DEV)] = float("nan")                    # the copy has not landed yet
    p2[filled.to(DEV)] = float("nan")
    calls = []

    off_plan = torch.tensor([s for s in range(S) if s not in filled.tolist()], dtype=torch.long)

    def between():             # the copy lands; the routes off the plan (slot 1 included) must be done
        calls.append(1)
        p13[filled.to(DEV)] = w13[filled].to(DEV)
        p2[filled.to(DEV)] = w2[filled].to(DEV)
        p13[off_plan.to(DEV)] = float("nan")
        p2[off_plan.to(DEV)] = float("nan")

    plan = CopyPlan(plan_slots.to(DEV), torch.tensor([plan_len], dtype=torch.int32, device=DEV), max_len=5)
    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), p13, p2, impl="triton", blocks=SMALL,
                   plan=plan, between=between)
    assert calls == [1]
    assert torch.isfinite(got).all(), "a route was computed in the wrong launch"
    assert torch.equal(got.cpu(), unsplit.cpu()), "the split call must be bit-identical to the unsplit one"
    assert ((got.cpu() - expected).abs().max() / expected.abs().max()) < 1e-5


@pytest.mark.parametrize("plan_len", [0, 2, 3])
def test_a_two_part_wait_reads_w13_after_between_and_w2_after_between_down(plan_len):
    """The copy in two parts (w13, then w2): the plan's gate/up rows may be read only after between(),
    its down rows only after between_down(), and the routes off the plan are done before either."""
    T, K, H, I, S = 2, 4, 40, 24, 10
    w13, w2 = _experts(S, H, I, seed=20 + plan_len)
    ids = torch.tensor([[3, 7, -1, 1], [7, 0, 5, -1]])
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(21))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(22))
    plan_slots = torch.tensor([7, 5, 9, 1, -1], dtype=torch.int32)
    filled = plan_slots[:plan_len].long().to(DEV)
    off_plan = torch.tensor([s for s in range(S) if s not in plan_slots[:plan_len].tolist()], device=DEV)
    unsplit = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), w13.to(DEV), w2.to(DEV), impl="triton",
                       blocks=SMALL)
    p13, p2 = w13.clone().to(DEV), w2.clone().to(DEV)
    p13[filled] = float("nan")                            # neither part has landed
    p2[filled] = float("nan")
    calls = []

    def between():                                        # w13 lands; the routes off the plan are done
        calls.append("w13")
        p13[filled] = w13.to(DEV)[filled]
        p13[off_plan] = float("nan")
        p2[off_plan] = float("nan")

    def between_down():                                   # w2 lands; the plan's gate/up is done
        calls.append("w2")
        p2[filled] = w2.to(DEV)[filled]
        if plan_len:
            p13[filled] = float("nan")

    plan = CopyPlan(plan_slots.to(DEV), torch.tensor([plan_len], dtype=torch.int32, device=DEV), max_len=5)
    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), p13, p2, impl="triton", blocks=SMALL,
                   plan=plan, between=between, between_down=between_down)
    assert calls == ["w13", "w2"]
    assert torch.isfinite(got).all(), "a part of a route was read before its hook"
    assert torch.equal(got.cpu(), unsplit.cpu())


def test_between_down_needs_between():
    x, (w13, w2) = torch.randn(1, 32), _experts(4, 32, 16, seed=1)
    with pytest.raises(ValueError, match="give between"):
        moe_gemv(x, torch.tensor([[0, 2]]), torch.rand(1, 2), w13, w2, between_down=print)


def test_split_gemv_leaves_no_route_out():
    """Every route is computed exactly once whatever the plan holds: a route whose slot is in the plan
    only in the second launch, the rest only in the first (a route computed by neither would be
    missing from the sum; one computed by both, after between() corrupted it, would be NaN)."""
    T, K, H, I, S = 3, 2, 32, 16, 6
    w13, w2 = _experts(S, H, I, seed=9)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(3))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    plan_slots = torch.tensor([4, 1], dtype=torch.int32)
    d13, d2 = w13.clone().to(DEV), w2.clone().to(DEV)

    def between():                                        # the routes off the plan must be done by now
        for s in (0, 2, 3, 5):
            d13[s] = float("nan")
            d2[s] = float("nan")

    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), d13, d2, impl="triton", blocks=SMALL,
                   plan=CopyPlan(plan_slots.to(DEV), torch.tensor([2], dtype=torch.int32, device=DEV), 2),
                   between=between)
    expected = ref.moe_gemv_reference(x, ids, weights, w13, w2)
    assert torch.isfinite(got).all()
    assert ((got.cpu() - expected).abs().max() / expected.abs().max()) < 1e-5


def test_a_plan_longer_than_its_bound_falls_back_to_the_serial_order():
    """length 3 with max_len 2: the kernels compare only two entries, so every route waits for between()."""
    T, K, H, I, S = 1, 4, 32, 16, 8
    w13, w2 = _experts(S, H, I, seed=5)
    ids = torch.tensor([[0, 2, 4, 6]])
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(6))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7))
    p13, p2 = torch.full_like(w13, float("nan")).to(DEV), torch.full_like(w2, float("nan")).to(DEV)

    def between():                                        # nothing is ready before this
        p13.copy_(w13.to(DEV))
        p2.copy_(w2.to(DEV))

    plan = CopyPlan(torch.tensor([0, 2, 4, -1], dtype=torch.int32, device=DEV),
                    torch.tensor([3], dtype=torch.int32, device=DEV), max_len=2)
    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), p13, p2, impl="triton", blocks=SMALL, plan=plan,
                   between=between)
    expected = ref.moe_gemv_reference(x, ids, weights, w13, w2)
    assert torch.isfinite(got).all()
    assert ((got.cpu() - expected).abs().max() / expected.abs().max()) < 1e-5


def test_between_runs_without_a_split_too():
    x, (w13, w2) = torch.randn(1, 32), _experts(4, 32, 16, seed=1)
    ids, weights = torch.tensor([[0, 2]]), torch.rand(1, 2)
    calls = []
    out = moe_gemv(x, ids, weights, w13, w2, impl="reference", between=lambda: calls.append(1),
                   plan=CopyPlan(torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 2))
    assert calls == [1] and torch.equal(out, ref.moe_gemv_reference(x, ids, weights, w13, w2))
    out = moe_gemv(x, ids, weights, w13, w2, impl="reference", between=lambda: calls.append(2),
                   between_down=lambda: calls.append(3),
                   plan=CopyPlan(torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 2))
    assert calls == [1, 2, 3] and torch.equal(out, ref.moe_gemv_reference(x, ids, weights, w13, w2))


def test_copy_plan_errors():
    x, (w13, w2) = torch.randn(1, 32), _experts(4, 32, 16, seed=1)
    ids, weights = torch.tensor([[0, 2]]), torch.rand(1, 2)
    with pytest.raises(ValueError, match="CopyPlan.slots must be int32"):
        moe_gemv(x, ids, weights, w13, w2, plan=CopyPlan(torch.zeros(2, dtype=torch.int64),
                                                         torch.zeros(1, dtype=torch.int32), 2))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        moe_gemv(x, ids, weights, w13, w2, plan=CopyPlan(torch.zeros(2, 2, dtype=torch.int32),
                                                         torch.zeros(1, dtype=torch.int32), 2), between=print)
    with pytest.raises(ValueError, match="needs between"):
        moe_gemv(x, ids, weights, w13, w2, plan=CopyPlan(torch.zeros(2, dtype=torch.int32),
                                                         torch.zeros(1, dtype=torch.int32), 2))
    with pytest.raises(ValueError, match="max_len 3 must be in"):
        moe_gemv(x, ids, weights, w13, w2, plan=CopyPlan(torch.zeros(2, dtype=torch.int32),
                                                         torch.zeros(1, dtype=torch.int32), 3))


def test_the_decode_copy_without_a_side_stream_is_copy_then_ffn_and_timed_on_the_host():
    from ftexpert.kernels.slot_cache import SlotCache, ensure
    layout = ExpertLayout(32, 16, torch.float32)
    E, S = 6, 4
    g = torch.Generator().manual_seed(0)
    host = torch.randn(E, layout.expert_numel, generator=g) * 0.1
    cache = SlotCache.create(1, E, S, device="cpu")
    slots = torch.zeros(S, layout.expert_numel)
    h13, h2 = unpack_experts(host, layout)
    timer = CopyTimer(1, on_cuda=False)
    plan = DecodeCopy(slots, [host], cache, expert_rows(slots, layout), timer=timer, kernel_impl="reference")
    for routes in ([[0, 3]], [[3, 5]], [[1, 2]], [[0, 5]]):
        ids = torch.tensor(routes)
        slot_ids = ids.clone()
        ensure(cache, 0, slot_ids, fetch_fraction=1.0)
        x, w = torch.randn(1, 32, generator=g), torch.rand(1, 2, generator=g)
        out = plan.run(0, x, slot_ids, w, mode="gemv")
        assert torch.equal(out, expert_ffn("gemv", x, ids, w, h13, h2, kernel_impl="reference"))
    assert timer.resolve() > 0


def _record_copy_then_ffn(monkeypatch, split_copy, fail_second_copy=False, after_fork=False, side=True, timed=False):
    """DecodeCopy.run with streams, events, the copy and the GEMV replaced by recorders (CPU): -> its log. `timed`:
    with a CUDA CopyTimer, inside a decode step."""
    import contextlib

    from ftexpert.gpu_worker.backends.offload import decode_copy as oe
    from ftexpert.kernels.slot_cache import SlotCache
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.name))

    class Event:
        count = 0

        def __init__(self, **flags):
            Event.count += 1
            self.name = f"event{Event.count}"

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    compute, side_stream, current = Stream("compute"), Stream("side"), ["compute"]

    @contextlib.contextmanager
    def on(stream):
        current.append(stream.name)
        yield
        current.pop()

    def copy_plan(slots, host, *plan, max_copies, cols=None):
        if fail_second_copy and any(e[0] == "copy" for e in log):
            raise RuntimeError("second copy launch failed")
        log.append(("copy", current[-1], cols))

    def moe_gemv(*args, plan, between, between_down=None, **kw):
        log.append(("gate/up off the plan", current[-1]))
        between()
        log.append(("gate/up of the plan", current[-1]))
        if between_down is not None:
            between_down()
        log.append(("down of the plan", current[-1]))
        return "out"

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(oe, "copy_plan", copy_plan)
    monkeypatch.setattr(expert_math, "moe_gemv", moe_gemv)
    layout = ExpertLayout(32, 16, torch.float32)
    slots = torch.zeros(4, layout.expert_numel)
    cache = SlotCache.create(1, 6, 4, device="cpu")
    x, ids, w = torch.zeros(1, 32), torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2)
    def hook():
        log.append(("after fork", current[-1]))
        if after_fork == "raise":
            raise RuntimeError("ring launch failed")
    timer = None
    if timed:
        timer = CopyTimer(1, on_cuda=True)         # its events: event1 .. event4 (two sets of one layer)
        timer.begin_step()
    plan = oe.DecodeCopy(slots, [slots], cache, expert_rows(slots, layout), stream=side_stream if side else None, split=split_copy,
                         timer=timer)
    try:
        out = plan.run(0, x, ids, w, mode="gemv", max_copies=2, after_fork=hook if after_fork else None)
    except RuntimeError as exc:
        log.append(("raised", str(exc)))
    else:
        assert not side or out == "out"                 # without the side stream: the real expert_ffn
    return log, layout


def test_the_two_part_copy_is_wired_w13_event_then_w2_and_the_waits_in_that_order(monkeypatch):
    log, layout = _record_copy_then_ffn(monkeypatch, split_copy=True)
    w13 = layout.w13_numel
    assert log == [("wait_stream", "side", "compute"),                      # fork after ensure
                   ("copy", "side", (0, w13)), ("record", "event1", "side"),
                   ("copy", "side", (w13, layout.expert_numel)),
                   ("gate/up off the plan", "compute"),
                   ("wait_event", "compute", "event1"),                     # the w13 part only
                   ("gate/up of the plan", "compute"),
                   ("wait_stream", "compute", "side"),                      # the whole copy
                   ("down of the plan", "compute")]


def test_the_copy_timer_records_its_events_on_the_copy_stream_around_both_parts(monkeypatch):
    """Inside a decode step the layer's pair of the step's event set brackets the copy on the copy stream (so a
    captured graph records them at each replay); the w13 event stays between the parts."""
    log, layout = _record_copy_then_ffn(monkeypatch, split_copy=True, timed=True)
    w13 = layout.w13_numel
    # begin_step moved to the second set: events 3 and 4
    assert log[:6] == [("wait_stream", "side", "compute"), ("record", "event3", "side"),
                       ("copy", "side", (0, w13)), ("record", "event5", "side"),
                       ("copy", "side", (w13, layout.expert_numel)), ("record", "event4", "side")]


def test_the_whole_copy_waits_once_before_the_plans_routes(monkeypatch):
    log, _ = _record_copy_then_ffn(monkeypatch, split_copy=False)
    assert log == [("wait_stream", "side", "compute"), ("copy", "side", None), ("gate/up off the plan", "compute"),
                   ("wait_stream", "compute", "side"), ("gate/up of the plan", "compute"),
                   ("down of the plan", "compute")]


def test_after_fork_runs_on_the_compute_stream_beside_the_copy(monkeypatch):
    """The ring and the counters (after_fork) go after the copy's launches, on the compute stream, before
    the hits' GEMMs: they run beside the copy, not ahead of it. Without the side stream: before the copy."""
    log, layout = _record_copy_then_ffn(monkeypatch, split_copy=True, after_fork=True)
    w13 = layout.w13_numel
    assert log[:5] == [("wait_stream", "side", "compute"), ("copy", "side", (0, w13)), ("record", "event1", "side"),
                       ("copy", "side", (w13, layout.expert_numel)), ("after fork", "compute")]
    assert log[5] == ("gate/up off the plan", "compute")
    log, _ = _record_copy_then_ffn(monkeypatch, split_copy=True, after_fork=True, side=False)
    assert log == [("after fork", "compute"), ("copy", "compute", None)]
    log, _ = _record_copy_then_ffn(monkeypatch, split_copy=False, after_fork=True)
    assert log[:3] == [("wait_stream", "side", "compute"), ("copy", "side", None), ("after fork", "compute")]


def test_a_raising_after_fork_still_joins_the_side_stream(monkeypatch):
    log, _ = _record_copy_then_ffn(monkeypatch, split_copy=True, after_fork="raise")
    assert log[-3:] == [("after fork", "compute"), ("wait_stream", "compute", "side"),
                        ("raised", "ring launch failed")]


def test_a_failed_copy_launch_still_joins_the_side_stream(monkeypatch):
    log, _ = _record_copy_then_ffn(monkeypatch, split_copy=True, fail_second_copy=True)
    assert log[-2:] == [("wait_stream", "compute", "side"), ("raised", "second copy launch failed")]


# -- GPU: the copy really runs beside the GEMMs -------------------------------------------------------

def _gpu_case(E=24, S=12, H=2048, I=768):
    """A pool of S slots over E experts of the qwen3-30b-a3b shape (9.44 MB each, ~190 us a copy over
    PCIe: a GEMM that did not wait for its copy would read the slot's previous expert)."""
    from ftexpert.kernels.slot_cache import SlotCache
    layout = ExpertLayout(H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    host = (torch.randn(E, layout.expert_numel, generator=g) * 0.05).to(torch.bfloat16).pin_memory()
    cache = SlotCache.create(1, E, S, device="cuda")
    slots = torch.zeros(S, layout.expert_numel, dtype=torch.bfloat16, device="cuda")
    resident = host.cuda()
    return layout, host, cache, slots, resident


def _routes(n, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(E, generator=g)[:K].view(1, K) for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("overlap,split", [(True, True), (True, False), (False, True)])
def test_gpu_copy_beside_the_gemms_matches_the_host_weights(overlap, split):
    from ftexpert.kernels.slot_cache import ensure
    layout, host, cache, slots, resident = _gpu_case()
    r13, r2 = unpack_experts(resident, layout)
    side = torch.cuda.Stream() if overlap else None
    timer = CopyTimer(1, on_cuda=True)
    plan = DecodeCopy(slots, [host], cache, expert_rows(slots, layout), stream=side, split=split, timer=timer)
    g = torch.Generator().manual_seed(1)
    for ids in _routes(40, 8, 24, seed=2):
        ids = ids.cuda()
        slot_ids = ids.clone()
        ensure(cache, 0, slot_ids, fetch_fraction=1.0, check_ids=False)
        x = (torch.randn(1, layout.hidden_size, generator=g) * 0.5).to(torch.bfloat16).cuda()
        w = torch.rand(1, 8, generator=g).cuda()
        out = plan.run(0, x, slot_ids, w, mode="gemv")
        assert torch.equal(out, moe_gemv(x, ids, w, r13, r2))
    assert timer.resolve() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("split", [True, False])
def test_gpu_copy_beside_the_gemms_in_a_cuda_graph(split):
    from ftexpert.kernels.slot_cache import ensure
    layout, host, cache, slots, resident = _gpu_case()
    r13, r2 = unpack_experts(resident, layout)
    side = torch.cuda.Stream()
    timer = CopyTimer(1, on_cuda=True)
    plan = DecodeCopy(slots, [host], cache, expert_rows(slots, layout), stream=side, split=split, timer=timer)
    routes_in = torch.zeros(1, 8, dtype=torch.int64, device="cuda")
    x = torch.zeros(1, layout.hidden_size, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(1, 8, device="cuda")

    def step():
        slot_ids = routes_in.clone()
        ensure(cache, 0, slot_ids, fetch_fraction=1.0, check_ids=False)
        return plan.run(0, x, slot_ids, w, mode="gemv")

    g = torch.Generator().manual_seed(3)
    routes = _routes(30, 8, 24, seed=4)
    routes_in.copy_(routes[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                               # warm-up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    graphs, outs = {}, {}

    def replay_step():                                       # as the engine: one graph per key (CopyTimer.graph_key),
        timer.begin_step()                                   # captured after an eager warm-up in the same step
        key = timer.graph_key()
        if key not in graphs:
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key]):
                outs[key] = step()
        graphs[key].replay()
        timer.end_step()
        return outs[key]

    replay_step()
    before = timer.resolve()
    for ids in routes[1:]:
        routes_in.copy_(ids)
        x.copy_((torch.randn(1, layout.hidden_size, generator=g) * 0.5).to(torch.bfloat16))
        w.copy_(torch.rand(1, 8, generator=g))
        out = replay_step()
        assert torch.equal(out, moe_gemv(x, ids.cuda(), w, r13, r2))
    assert set(graphs) == {-1, 0, 1}, "timed steps alternate the two event sets, the others record none"
    assert timer.resolve() > before, "the replays' copies were not timed"
