"""Real CPU worker processes: serving, refusals, stopping, and faults (SIGKILL, SIGSTOP, restart)."""
from __future__ import annotations

import hashlib
import os
import signal
import time
import uuid

import pytest
import torch

from ftexpert.proto.cpu_channel import CpuPoolClient, WorkerDead, WorkerError, WorkerTimeout
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.proto import shm_layout as sl
from ftexpert.proto import shm_segment
from ftexpert.proto.expert_store import ExpertStore
from tests.cpu_expert_pool.cpu_pool_util import channel, procs, random_store  # noqa: F401 (fixtures)

H, I, E, L = 64, 32, 4, 2
T_MAX, MAX_TRIPLES = 8, 16
START_TIMEOUT_S = 60          # a worker imports torch and may build the kernel on a cold cache
DEATH_DEADLINE_S = 2.0        # the client must notice a dead or stopped worker within this
WORKER_ARGS = ["--threads", "1", "--hot-ms", "5", "--no-pin"]


@pytest.fixture(scope="module")
def store():
    name = f"ft-test-wstore-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    s = random_store(name, num_layers=L, num_experts=E, hidden=H, intermediate=I, config_hash="cfg-w")
    yield s
    s.close()
    s.unlink()


def batch(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(2)
    expert_id = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(num_tokens)]).flatten().int()
    return hidden, (token_idx, expert_id, torch.rand(2 * num_tokens, generator=g))


def check(store: ExpertStore, client: CpuPoolClient, layer: int, seed: int) -> None:
    hidden, triples = batch(3, seed)
    out = client.call(layer, hidden, triples, deadline_s=10)
    ref = reference_moe_layer(store, layer, hidden, *triples)
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))


def store_digest(store: ExpertStore) -> str:
    return hashlib.sha256(store.layer_view(0).view(torch.int16).numpy().tobytes()
                          + store.layer_view(1).view(torch.int16).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_a_real_worker_serves_refuses_a_bad_request_and_stops_on_sigterm(store, channel, procs, tmp_path, loop):
    """loop: the worker's hot loop (FT_WORKER_LOOP): the C loop around the compiled kernel (where it builds;
    else the torch kernel's Python loop serves either way), or the Python loop."""
    proc = procs(store_name=store.name, channel_name=channel, num_workers=2, extra_args=WORKER_ARGS,
                 env={**os.environ, "FT_WORKER_LOOP": loop})
    client = CpuPoolClient(channel)
    assert client.wait_for_worker(timeout_s=START_TIMEOUT_S) == proc.pid
    for i in range(4):
        check(store, client, layer=i % L, seed=i)
    # A request the kernel refuses (an expert id outside the layer): answered BAD_REQUEST (the C loop leaves
    # it to the Python path), and the worker keeps serving.
    hidden, (tok, exp, w) = batch(2, 11)
    exp = exp.clone()
    exp[1] = E
    with pytest.raises(WorkerError, match="bad request"):
        client.call(1, hidden, (tok, exp, w), deadline_s=10)
    check(store, client, layer=1, seed=12)
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout_s=20) == 0
    seg, layout = sl.attach_channel(channel)
    assert int(sl.ChannelViews(seg, layout).worker_state[0]) == sl.WORKER_STOPPED
    seg.close()
    with pytest.raises(WorkerDead):
        check(store, client, layer=0, seed=10)
    client.close()
    assert "stopping: SIGTERM" in (tmp_path / "worker0.log").read_text()


@pytest.mark.parametrize("loop", ["native", "python"])
def test_an_idle_worker_sleeps_and_beats(store, channel, procs, tmp_path, loop):
    """Once cold an idle worker sleeps (it does not keep a core spinning), and it still beats."""
    import psutil

    proc = procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS,
                 env={**os.environ, "FT_WORKER_LOOP": loop})
    client = CpuPoolClient(channel)
    client.wait_for_worker(timeout_s=START_TIMEOUT_S)
    check(store, client, layer=0, seed=1)
    log_text = (tmp_path / "worker0.log").read_text()
    if loop == "native" and "kernel native-" in log_text:
        assert "hot loop: C (ft_serve)" in log_text
    time.sleep(0.3)                                          # cold: past hot_ms
    ps = psutil.Process(proc.pid)
    cpu0, t0 = ps.cpu_times(), time.monotonic()
    ages = []
    while time.monotonic() - t0 < 1.0:
        ages.append(client.heartbeat_age_s())
        time.sleep(0.05)
    cpu1, wall = ps.cpu_times(), time.monotonic() - t0
    busy = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / wall
    assert busy < 0.5, f"an idle worker used {busy:.0%} of a core"
    assert max(ages) < 0.05, f"heartbeat ages up to {max(ages) * 1e3:.1f} ms while idle"
    check(store, client, layer=1, seed=2)                    # and a cold worker still answers
    client.close()


def test_wrong_config_hash_is_refused(store, channel, procs, tmp_path):
    proc = procs(store_name=store.name, channel_name=channel, extra_args=[*WORKER_ARGS, "--expect-config-hash", "other"])
    assert proc.wait(timeout_s=START_TIMEOUT_S) == 2             # refused before serving
    assert "config hash 'cfg-w', expected 'other'" in (tmp_path / "worker0.log").read_text()


def test_missing_store_exits_with_a_clear_error(channel, procs, tmp_path):
    proc = procs(store_name="ft-test-no-such-store", channel_name=channel, extra_args=WORKER_ARGS)
    assert proc.wait(timeout_s=START_TIMEOUT_S) == 2
    log = (tmp_path / "worker0.log").read_text()
    assert "no expert store named 'ft-test-no-such-store'" in log and "start the coordinator" in log


def test_sigkill_mid_run_is_seen_as_dead_and_a_restart_reattaches_without_copying(store, channel, procs):
    digest_before = store_digest(store)
    inode_before = os.stat(os.path.join(shm_segment.SHM_DIR, store.name)).st_ino
    proc = procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS)
    client = CpuPoolClient(channel)
    client.wait_for_worker(timeout_s=START_TIMEOUT_S)
    for i in range(5):
        check(store, client, layer=i % L, seed=i)

    hidden, triples = batch(3, seed=99)
    seen_dead_after_s = None
    for i in range(200):                              # a run of requests; the kill lands in the middle
        layer = i % L
        client.submit(layer, hidden, triples)
        if i == 20:
            killed_at = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
        try:
            client.wait(layer, deadline_s=DEATH_DEADLINE_S + 5)
        except WorkerDead as exc:
            seen_dead_after_s = time.monotonic() - killed_at
            assert "died" in str(exc)
            break
    assert i >= 20 and seen_dead_after_s is not None and seen_dead_after_s < DEATH_DEADLINE_S
    assert proc.wait(timeout_s=5) == -signal.SIGKILL

    restarted = procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS)
    assert client.wait_for_worker(timeout_s=START_TIMEOUT_S) == restarted.pid
    for i in range(4):
        check(store, client, layer=i % L, seed=100 + i)
    # Same segment, same bytes, mapped read-only and shared: nothing was reloaded or copied.
    assert os.stat(os.path.join(shm_segment.SHM_DIR, store.name)).st_ino == inode_before
    assert store_digest(store) == digest_before and store.is_ready
    mapping = _store_mapping(restarted.pid, store.name)
    assert mapping["perms"] == "r--s"
    assert mapping["Rss"] > 0 and mapping["Private_Dirty"] == 0 and mapping["Anonymous"] == 0
    client.close()


def test_sigstop_is_seen_as_a_timeout_within_the_deadline(store, channel, procs):
    proc = procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS)
    client = CpuPoolClient(channel)
    client.wait_for_worker(timeout_s=START_TIMEOUT_S)
    check(store, client, layer=0, seed=1)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        hidden, triples = batch(3, seed=2)
        deadline_s = 0.3
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeout, match="heartbeat"):
            client.call(1, hidden, triples, deadline_s=deadline_s)
        elapsed = time.monotonic() - t0
        assert deadline_s <= elapsed < deadline_s + 0.5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # Resumed, it finishes the stale request; the client reconnects once nothing is in flight.
    assert client.wait_for_worker(timeout_s=10) == proc.pid
    check(store, client, layer=0, seed=3)
    client.close()


def test_second_worker_on_a_served_channel_is_refused(store, channel, procs, tmp_path):
    procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS)
    client = CpuPoolClient(channel)
    client.wait_for_worker(timeout_s=START_TIMEOUT_S)
    second = procs(store_name=store.name, channel_name=channel, extra_args=WORKER_ARGS)
    assert second.wait(timeout_s=START_TIMEOUT_S) == 2
    assert "is served by live process" in (tmp_path / "worker1.log").read_text()
    check(store, client, layer=1, seed=4)             # the first one still serves
    client.close()


def _store_mapping(pid: int, store_name: str) -> dict:
    """/proc/<pid>/smaps entry of the store segment: perms and kB fields."""
    entry: dict = {}
    with open(f"/proc/{pid}/smaps") as f:
        inside = False
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:
                inside = line.rstrip().endswith(os.path.join(shm_segment.SHM_DIR, store_name))
                if inside:
                    entry["perms"] = fields[1]
            elif inside and fields[0].endswith(":") and len(fields) >= 2 and fields[1].isdigit():
                entry[fields[0][:-1]] = int(fields[1])
    assert entry, f"the store {store_name} is not mapped by process {pid}"
    return entry


def test_under_the_coordinator_supervisor_a_killed_worker_is_restarted(store, channel):
    """coordinator/supervisor.py starts `ft worker cpu` (HELLO with the store's config hash, READY,
    heartbeats), restarts it after SIGKILL, and the new process serves the same channel and store."""
    from ftexpert.coordinator.supervisor import Supervisor, WorkerSpec
    from ftexpert.cpu_expert_pool.api import IMPORT_ROOT, worker_argv

    argv = worker_argv(store_name=store.name, channel_name=channel, flags=WORKER_ARGS)
    spec = WorkerSpec("cpu0", argv, config_hash=store.config_hash, env={"PYTHONPATH": str(IMPORT_ROOT)},
                      ready_timeout_s=START_TIMEOUT_S, backoff_initial_s=0.1, kind="cpu")
    sup = Supervisor([spec])
    sup.start(timeout_s=START_TIMEOUT_S)
    client = CpuPoolClient(channel)
    try:
        first_pid = client.wait_for_worker(timeout_s=10)
        assert first_pid == sup.worker_info()[0]["pid"]
        check(store, client, layer=0, seed=1)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(WorkerDead):
            check(store, client, layer=1, seed=2)
        second_pid = client.wait_for_worker(timeout_s=START_TIMEOUT_S)
        assert second_pid != first_pid and sup.worker_info()[0]["restarts"] == 1
        check(store, client, layer=1, seed=3)
    finally:
        client.close()
        sup.stop()
    assert sup.worker_info()[0]["state"] == "stopped"


def test_supervisor_rejects_a_worker_whose_store_has_another_config_hash(store, channel):
    from ftexpert.coordinator.supervisor import Supervisor, WorkerError, WorkerSpec
    from ftexpert.cpu_expert_pool.api import IMPORT_ROOT, worker_argv

    argv = worker_argv(store_name=store.name, channel_name=channel, flags=WORKER_ARGS)
    sup = Supervisor([WorkerSpec("cpu0", argv, config_hash="not-the-store", env={"PYTHONPATH": str(IMPORT_ROOT)},
                                 ready_timeout_s=START_TIMEOUT_S, restart=False)])
    with pytest.raises(WorkerError, match="cpu0"):
        sup.start(timeout_s=START_TIMEOUT_S)
    sup.stop()
