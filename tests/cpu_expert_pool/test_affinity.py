"""The process that drives the GPU on the reserved CPUs, the CPU workers off them, also after a restart.

Decisions with the affinity calls monkeypatched: which CPUs the driving process pins itself to (the
reserved ones within its affinity; none when off, when nothing is reserved or none of them is
allowed), every thread set (one appearing meanwhile, one gone), the GPU worker pinning only with CPU
workers, the flags from `ft serve` / `ft generate` / `ft worker gpu` and the knob, and the worker
planning over `--allowed-cpus` instead of the narrow mask it inherited. Then for real, on a machine
with two or more CPUs: `ft generate`'s set-up (the owner's CPU workers, a CpuPool attached to them, in a
child process) pins itself, its worker is placed on the rest, a worker SIGKILLed and restarted by the
owner's supervisor (a child of the pinned process) lands there again; the same under `ft serve`
(the GPU worker pinned, the coordinator not, a restarted CPU worker on the rest).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tests.coordinator.serve_support import ENV, REPO, TINY_ARGS, Server, children_pids  # noqa: E402

from ftexpert.coordinator.cli import build_parser  # noqa: E402
from ftexpert.proto.engine_spec import spec_from_args  # noqa: E402
from ftexpert.proto import cpus as cpu_lists  # noqa: E402
from ftexpert.cpu_expert_pool.topology import discover_placements  # noqa: E402
from ftexpert.proto.cpus import format_cpulist  # noqa: E402
from ftexpert.cpu_expert_pool.worker import WorkerOptions, plan_placement  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions  # noqa: E402
from ftexpert.gpu_worker.backends.hybrid import options as hybrid_options  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "numa"
RESTART_TIMEOUT_S = 60.0
WORKER_ARGS = ("--threads", "1", "--no-pin", "--hot-ms", "1", "--no-warmup")


@pytest.fixture
def fake_affinity(monkeypatch):
    """os.sched_getaffinity answers `mask`; os.sched_setaffinity records (tid, cpus); threads 101-103."""
    state = {"mask": set(range(8)), "set": []}
    monkeypatch.delenv("FREETOKEN_PIN_GPU_WORKER", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(state["mask"]))
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: state["set"].append((tid, tuple(cpus))))
    monkeypatch.setattr(cpu_lists, "thread_ids", lambda: [101, 102, 103])
    monkeypatch.setattr(hybrid_options, "_affinity_before_pin", None)     # no pin left from another test
    return state


@pytest.mark.parametrize("reserve, pin, mask, want", [
    ("0", True, range(8), (0,)),
    ("0-1,9", True, range(1, 8), (1,)),          # only the reserved CPUs within the affinity
    ("8-9", True, range(8), ()),                 # none of them allowed here
    ("", True, range(8), ()),                    # nothing reserved
    ("0", False, range(8), ()),                  # switched off
    (None, True, range(8), (0,)),                # default: CPU 0 from 4 CPUs on
    (None, True, range(2), ()),                  # ... and nothing below
])
def test_driving_process_cpus(fake_affinity, reserve, pin, mask, want):
    fake_affinity["mask"] = set(mask)
    assert HybridOptions(reserve_cpus=reserve, pin_gpu_worker=pin).driving_process_cpus() == want


def test_the_knob_switches_pinning_off(fake_affinity, monkeypatch):
    assert HybridOptions(reserve_cpus="0").driving_process_cpus() == (0,)
    monkeypatch.setenv("FREETOKEN_PIN_GPU_WORKER", "off")
    assert HybridOptions(reserve_cpus="0").driving_process_cpus() == ()
    assert HybridOptions(reserve_cpus="0", pin_gpu_worker=True).driving_process_cpus() == (0,)   # field wins


def test_pin_sets_every_thread_returns_the_old_affinity_and_logs_one_line(fake_affinity, caplog):
    with caplog.at_level(logging.INFO, logger="ft.hybrid"):
        before = HybridOptions(reserve_cpus="0,9", pin_gpu_worker=True).pin_driving_process("the test process")
    assert before == tuple(range(8))
    assert fake_affinity["set"] == [(101, (0,)), (102, (0,)), (103, (0,))]
    lines = [r.getMessage() for r in caplog.records if r.name == "ft.hybrid"]
    assert lines == [f"pinned the test process (pid {os.getpid()}, 3 threads) to CPU 0, the reserved CPUs "
                     f"(was 0-7); the CPU workers keep off them"]


def test_defaults_read_the_affinity_from_before_the_pin(fake_affinity):
    # After the pin the process sees one CPU; the default reservation and the workers' allowed set must
    # still describe the machine (a second pool, or worker flags built later), until the pin is undone.
    before = HybridOptions(pin_gpu_worker=True).pin_driving_process("the test process")
    fake_affinity["mask"] = {0}                      # what the kernel now reports for this process
    assert before == tuple(range(8))
    assert HybridOptions().reserved_cpus() == "0"
    hybrid_options.unpin_driving_process()
    assert HybridOptions().reserved_cpus() == ""


def test_nothing_is_pinned_where_no_reserved_cpu_is_allowed(fake_affinity, caplog):
    with caplog.at_level(logging.INFO, logger="ft.hybrid"):
        assert HybridOptions(reserve_cpus="8", pin_gpu_worker=True).pin_driving_process("it") is None
        assert HybridOptions(reserve_cpus="0", pin_gpu_worker=False).pin_driving_process("it") is None
    assert fake_affinity["set"] == []
    assert [r.getMessage() for r in caplog.records if r.name == "ft.hybrid"] == \
        ["it not pinned: none of the reserved CPUs 8 is in its affinity 0-7"]


def test_set_process_affinity_covers_threads_started_meanwhile_and_skips_gone_ones(monkeypatch):
    listings = iter([[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]])      # thread 4 starts during the first pass
    calls = []

    def setaffinity(tid, cpus):
        calls.append(tid)
        if tid == 2:
            raise ProcessLookupError(tid)                        # thread 2 exited since the listing

    monkeypatch.setattr(cpu_lists, "thread_ids", lambda: next(listings))
    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    assert cpu_lists.set_process_affinity([5]) == 4
    assert calls == [1, 2, 3, 4]


def test_thread_ids_lists_this_process_threads():
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert threading.get_native_id() in cpu_lists.thread_ids() and t.native_id in cpu_lists.thread_ids()
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("strategy, pin, pinned", [("resident", True, False), ("offload", True, False),
                                                   ("hybrid", True, True), ("cpu", True, True),
                                                   ("hybrid", False, False)])
def test_the_gpu_worker_pins_itself_only_with_cpu_workers(fake_affinity, strategy, pin, pinned):
    from ftexpert.gpu_worker.api import pin_engine_process
    from ftexpert.proto.engine_spec import EngineSpec

    spec = EngineSpec(moe_strategy=strategy, reserve_cpus="0", pin_gpu_worker="on" if pin else "off")
    assert pin_engine_process(spec) == (tuple(range(8)) if pinned else None)
    assert fake_affinity["set"] == ([(101, (0,)), (102, (0,)), (103, (0,))] if pinned else [])


def test_worker_flags_carry_the_affinity_from_before_the_pin(fake_affinity):
    """The owner resolves its workers' flags once, before this process may pin itself: a worker its supervisor
    restarts later is placed as the first one was."""
    from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources
    from ftexpert.cpu_expert_pool.api import worker_flags

    flags = worker_flags(reserve_cpus="0")
    args = build_parser().parse_args(["worker", "cpu", "--store", "s", *flags])
    assert (args.allowed_cpus, args.reserve_cpus) == ("0-7", "0")
    assert build_parser().parse_args(["worker", "cpu", "--store", "s"]).allowed_cpus is None
    res = ExpertResources("hybrid", CpuWorkerSettings(num_workers=1))
    res._plan_workers()
    fake_affinity["mask"] = {0}                    # pinned since
    res.store_name, res.channel_names = "s", ["s.cpu0"]
    (spec,) = res.cpu_worker_specs()
    args = build_parser().parse_args(spec.argv[3:])
    assert (args.allowed_cpus, args.reserve_cpus) == ("0-7", "0")


def test_a_worker_plans_over_the_allowed_cpus_not_its_inherited_mask(fake_affinity, tmp_path):
    fake_affinity["mask"] = {0}              # inherited from a parent pinned to the reserved CPU 0
    for sysfs in (FIXTURES / "one_node", tmp_path):          # a node tree, and none (one node of them)
        options = WorkerOptions(store_name="s", channel_name="c", reserved_cpus=(0,), sysfs_root=str(sysfs),
                                allowed_cpus=(0, 1, 2, 3))
        assert plan_placement(options).cpus == (1, 2, 3), sysfs
        without = WorkerOptions(store_name="s", channel_name="c", reserved_cpus=(0,), sysfs_root=str(sysfs))
        with pytest.raises(ValueError, match="no CPU left"):       # started by hand: the affinity it has
            plan_placement(without)


@pytest.mark.parametrize("argv, environ, pinned", [
    ([], {}, False),                                            # inline: the servers share the process
    (["--pin-gpu-worker", "on"], {}, True),
    ([], {"FREETOKEN_PIN_GPU_WORKER": "on"}, True),
    (["--pin-gpu-worker", "off"], {"FREETOKEN_PIN_GPU_WORKER": "on"}, False),
])
def test_inline_serve_pins_only_when_asked(argv, environ, pinned):
    from ftexpert.coordinator.serve_cli import inline_spec
    args = build_parser().parse_args(["serve", "--workers", "inline", "--reserve-cpus", "0", *argv])
    spec = inline_spec(args, environ)
    assert spec.pin_gpu_worker == ("on" if pinned else "off") and spec.reserve_cpus == "0"


def test_inline_serve_hands_its_options_to_the_engine(monkeypatch):
    import ftexpert.gpu_worker.api as api
    from ftexpert.coordinator import expert_resources, serve_cli
    seen = {}

    def fake_build(spec, **kw):
        seen.update(kw, spec=spec)
        raise RuntimeError("stop here")

    class FakeResources:
        store_name, channel_names, closed = "s", ["s.cpu0"], False

        def start_cpu_workers(self):
            pass

        def worker_info(self):
            return []

        def close(self):
            FakeResources.closed = True

    monkeypatch.setattr(api, "build_engine", fake_build)
    monkeypatch.setattr(expert_resources.ExpertResources, "create", classmethod(lambda cls, *a, **kw: FakeResources()))
    monkeypatch.delenv("FREETOKEN_PIN_GPU_WORKER", raising=False)
    args = build_parser().parse_args(["serve", "--workers", "inline", "--moe-strategy", "hybrid", "--device", "cpu"])
    with pytest.raises(RuntimeError, match="stop here"):
        serve_cli.run_inline(args, serve_cli.inline_spec(args))
    assert seen["spec"].moe_strategy == "hybrid" and seen["spec"].pin_gpu_worker == "off"
    attachment = seen["attachment"]
    assert (attachment.store_name, attachment.cpu_channels) == ("s", ("s.cpu0",)) and FakeResources.closed


def test_serve_and_generate_flags_reach_the_workers(tmp_path):
    from ftexpert.coordinator.engine_link import EngineLinkServer
    from ftexpert.coordinator.process_set import ProcessSet, options_from_serve_args

    serve = build_parser().parse_args(["serve", "--moe-strategy", "hybrid", "--num-cpu-workers", "1",
                                       "--reserve-cpus", "0", "--pin-gpu-worker", "off"])
    from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources

    procs = ProcessSet(options_from_serve_args(serve, spec_from_args(serve)))
    procs.link = EngineLinkServer("tcp://127.0.0.1:0", procs.options.spec)        # bound, not started
    procs.resources = ExpertResources("hybrid", CpuWorkerSettings(num_workers=1, reserve_cpus="0"))
    procs.resources._plan_workers()                                                # no store, no channel made
    procs.resources.store_name, procs.resources.channel_names = "ft-test-affinity", ["ft-test-affinity.cpu0"]
    try:
        cpu, gpu = procs.worker_specs()
    finally:
        procs.link.sock.close(0)
    cpu_args = build_parser().parse_args(cpu.argv[3:])
    assert (cpu_args.allowed_cpus, cpu_args.reserve_cpus) == (format_cpulist(os.sched_getaffinity(0)), "0")
    assert (procs.options.spec.reserve_cpus, procs.options.spec.pin_gpu_worker) == ("0", "off")   # in WELCOME

    generate = build_parser().parse_args(["generate", "--prompt-ids", "1", "--pin-gpu-worker", "off"])
    assert spec_from_args(generate).pin_gpu_worker == "off"
    assert spec_from_args(build_parser().parse_args(["generate", "--prompt-ids", "1"])).pin_gpu_worker == "on"


# -- for real -------------------------------------------------------------------------------------------------
def _plan():
    """(reserved CPU, placements of the workers) on this machine: the first allowed CPU is reserved."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 or more CPUs (one reserved, one for a CPU worker)")
    reserved = allowed[0]
    return reserved, discover_placements(reserved_cpus=[reserved])


def thread_affinities(pid: int) -> list[str]:
    """The distinct Cpus_allowed_list of every thread of `pid`."""
    lists = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                lists.update(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
        except (FileNotFoundError, ProcessLookupError):
            pass                                               # exited meanwhile
    return sorted(lists)


POOL_SCRIPT = r"""
import json, logging, os, signal, sys, time, types, uuid
import torch
sys.path.insert(0, "tests/cpu_expert_pool")
from test_affinity import RESTART_TIMEOUT_S, WORKER_ARGS, thread_affinities
from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources
from ftexpert.gpu_worker.api import HybridOptions, attach_cpu_pool
from ftexpert.proto.expert_store import ExpertStore

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
reserve, num_workers = sys.argv[1], int(sys.argv[2])
store = ExpertStore.create(f"ft-test-affinity-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=1, num_experts=8,
                           hidden=32, intermediate=16, dtype=torch.float32, config_hash="affinity")
store.mark_ready()
cpu = CpuWorkerSettings(num_workers=num_workers, reserve_cpus=reserve, worker_args=WORKER_ARGS, backoff_initial_s=0.1,
                        ready_timeout_s=RESTART_TIMEOUT_S)
me = os.getpid()
out = {"before": thread_affinities(me)}
resources = ExpertResources.over_store(store, "hybrid", top_k=2, model_dtype=torch.float32, cpu=cpu)
resources.start_cpu_workers()
pool = attach_cpu_pool(store, resources.channel_names, HybridOptions(reserve_cpus=reserve, pin_gpu_worker=True),
                       worker_info=resources.worker_info)
try:
    out["pinned"] = thread_affinities(me)
    first = pool.worker_pids()
    out["workers"] = {name: thread_affinities(pid) for name, pid in first.items()}
    os.kill(first["cpu0"], signal.SIGKILL)
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        info = {w["name"]: w for w in pool.worker_info()}["cpu0"]
        if info["state"] == "ready" and info["pid"] not in (0, first["cpu0"]):
            out["restarted"] = thread_affinities(info["pid"])
            break
        if info["state"] == "failed" or time.monotonic() > deadline:
            out["restarted"] = f"not READY again within {RESTART_TIMEOUT_S} s: {info}"
            break
        time.sleep(0.05)
    out["pinned_after_restart"] = thread_affinities(me)
finally:
    pool.close()
    resources.close()
    store.close()
    store.unlink()
print(json.dumps(out))
"""


def test_ft_generate_pool_pins_itself_and_a_restarted_worker_lands_off_the_reserved_cpu():
    reserved, placements = _plan()
    run = subprocess.run([sys.executable, "-c", POOL_SCRIPT, str(reserved), str(len(placements))], cwd=REPO,
                         env=ENV, capture_output=True, text=True, timeout=3 * RESTART_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    everything = [format_cpulist(os.sched_getaffinity(0))]
    assert out["before"] == everything
    assert out["pinned"] == out["pinned_after_restart"] == [str(reserved)], run.stderr[-3000:]   # every thread
    assert out["workers"] == {f"cpu{p.worker_index}": [format_cpulist(p.cpus)] for p in placements}
    assert out["restarted"] == [format_cpulist(placements[0].cpus)], run.stderr[-3000:]
    assert f"pinned the engine's process (pid " in run.stderr and f"to CPU {reserved}, the reserved CPUs" in run.stderr


def _cpu_worker_pids(server_pid: int) -> dict[int, int]:
    import psutil

    pids = {}
    for pid in children_pids(server_pid, "worker cpu"):
        argv = psutil.Process(pid).cmdline()
        pids[int(argv[argv.index("--worker-index") + 1])] = pid
    return pids


def _supervised(srv: Server, name: str) -> dict:
    from tests.coordinator.grpc_support import control_channel

    from ftexpert.proto import control_rpc as rpc
    with control_channel(f"127.0.0.1:{srv.grpc_port}") as channel:
        workers = rpc.ControlStub(channel).ListWorkers(rpc.msg.ListWorkersRequest(), timeout=10).workers
    return {w.name: w for w in workers}[name]


def test_ft_serve_pins_the_gpu_worker_and_its_cpu_workers_stay_off_it(tmp_path):
    reserved, placements = _plan()
    store = f"ft-test-affinity-{os.getpid()}"
    srv = Server(["--moe-strategy", "hybrid", "--num-cpu-workers", str(len(placements)), "--store-name", store,
                  "--reserve-cpus", str(reserved), *TINY_ARGS], tmp_path / "serve.log")
    try:
        srv.wait_listening()
        (gpu_pid,) = children_pids(srv.pid, "worker gpu")
        assert thread_affinities(gpu_pid) == [str(reserved)], srv.output()[-3000:]
        assert f"pinned GPU worker gpu0 (pid {gpu_pid}, " in srv.output()
        assert thread_affinities(srv.pid) == [format_cpulist(os.sched_getaffinity(0))]     # not the coordinator
        pids = _cpu_worker_pids(srv.pid)
        assert {i: thread_affinities(pid) for i, pid in pids.items()} == \
            {p.worker_index: [format_cpulist(p.cpus)] for p in placements}
        assert srv.complete("Hello", 8)["choices"][0]["text"]
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            info = _supervised(srv, "cpu0")
            if info.state == "ready" and info.pid not in (0, pids[0]):
                break
            assert time.monotonic() < deadline, f"cpu0 not READY again: {info}\n{srv.output()[-3000:]}"
            time.sleep(0.1)
        assert thread_affinities(info.pid) == [format_cpulist(placements[0].cpus)]
        assert srv.complete("Hello", 8)["choices"][0]["text"]
        assert srv.stop() == 0
    finally:
        srv.kill()


@pytest.mark.parametrize("reserve, threads", [("0-1", 2), ("3", 1)])
def test_the_attached_backend_sizes_torch_threads_by_the_reserved_list(monkeypatch, reserve, threads):
    # ft serve hands its GPU worker the reserved list; the worker's torch CPU threads follow its size
    import types

    import torch

    import ftexpert.gpu_worker.backends.hybrid as hybrid
    from ftexpert.gpu_worker.assembly import attached_backends
    from ftexpert.gpu_worker.assembly.loader import open_model_source

    class FakePool:
        t_max = 4

        @classmethod
        def attach(cls, *args, **kwargs):
            return cls()

        def close(self):
            pass

    seen = []
    monkeypatch.setattr(hybrid, "CpuPool", FakePool)
    made = types.SimpleNamespace()
    monkeypatch.setattr(hybrid, "HybridExperts", lambda *args, **kwargs: made)
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    source = open_model_source(None, None, device="cpu")
    backend = attached_backends._attached_hybrid(
        "hybrid", types.SimpleNamespace(store=None), source.experts, 8, torch.device("cpu"), ["ch0"],
        per_layer=False, mode="auto", hybrid=HybridOptions(reserve_cpus=reserve))
    assert backend is made and seen == [threads]


@pytest.mark.parametrize("act_quant", ["auto", "fp32", "int8"])
def test_the_specs_cpu_act_quant_reaches_every_workers_command_line(fake_affinity, act_quant):
    """`ft serve --cpu-act-quant X` (EngineSpec.cpu_act_quant) -> CpuWorkerSettings.act_quant -> each worker's
    --act-quant X (its WorkerSettings.act_quant); a worker_args flag given later wins, as argparse reads it last."""
    import argparse

    from ftexpert.coordinator.expert_resources import CpuWorkerSettings, ExpertResources
    from ftexpert.proto.engine_spec import EngineSpec, add_engine_flags, spec_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    spec = spec_from_args(parser.parse_args(["--moe-strategy", "hybrid", "--cpu-act-quant", act_quant]), environ={})
    assert spec.cpu_act_quant == act_quant and EngineSpec().cpu_act_quant == "auto"
    res = ExpertResources("hybrid", CpuWorkerSettings(num_workers=2, act_quant=spec.cpu_act_quant))
    res._plan_workers()
    res.store_name, res.channel_names = "s", ["s.cpu0", "s.cpu1"]
    for worker in res.cpu_worker_specs():
        assert build_parser().parse_args(worker.argv[3:]).act_quant == act_quant
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-act-quant", "int4"])
