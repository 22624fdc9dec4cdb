"""Child-process supervision with small dummy children (python -c scripts) on the CPU."""
from __future__ import annotations

import logging
import os
import sys
import time

import pytest

from ftexpert.proto.supervised_child import config_hash
from ftexpert.coordinator.supervisor import (ConfigMismatch, HandshakeTimeout, HeartbeatTimeout, Supervisor, WorkerExited,
                                    WorkerGaveUp, WorkerSpec)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
HASH = config_hash({"model": "tiny", "layers": 4})
ENV = {"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}

GOOD = f"""
from ftexpert.proto.supervised_child import SupervisorLink
link = SupervisorLink.from_env()
link.hello({HASH!r})
link.ready()
link.serve(heartbeat_interval_s=0.05, max_s=60)
"""
WRONG_HASH = GOOD.replace(HASH, "0123456789abcdef")
SILENT = "import time; time.sleep(60)"
CRASH_BEFORE_READY = "import sys; print('cannot open /dev/nvidia0', file=sys.stderr); sys.exit(3)"
DIE_AFTER_READY = f"""
import os, time
from ftexpert.proto.supervised_child import SupervisorLink
link = SupervisorLink.from_env()
link.hello({HASH!r})
link.ready()
with open(os.environ["STARTS_FILE"], "a") as fh:
    fh.write(f"{{time.monotonic()}}\\n")
time.sleep(0.1)
os._exit(7)
"""
HANG_AFTER_READY = f"""
import time
from ftexpert.proto.supervised_child import SupervisorLink
link = SupervisorLink.from_env()
link.hello({HASH!r})
link.ready()
time.sleep(60)          # no heartbeats: looks hung
"""


def spec(name, script, **kw) -> WorkerSpec:
    defaults = dict(ready_timeout_s=10.0, heartbeat_timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=1.0,
                    env=dict(ENV))
    defaults.update(kw)
    return WorkerSpec(name, [sys.executable, "-c", script], HASH, **defaults)


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_healthy_children_handshake_heartbeat_and_stop_cleanly():
    sup = Supervisor([spec("cpu-numa0", GOOD), spec("cpu-numa1", GOOD)])
    sup.start()
    try:
        info = {w["name"]: w for w in sup.worker_info()}
        assert {w["state"] for w in info.values()} == {"ready"}
        pids = [w["pid"] for w in info.values()]
        time.sleep(0.3)
        assert all(0 <= w["last_heartbeat_age_s"] < 0.5 for w in sup.worker_info())
        sup.check()                                  # nothing to report
    finally:
        sup.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)                          # exited and reaped
    assert {w["state"] for w in sup.worker_info()} == {"stopped"}


def test_config_hash_mismatch_fails_fast_naming_the_worker():
    t0 = time.monotonic()
    with pytest.raises(ConfigMismatch) as info:
        Supervisor([spec("gpu0", WRONG_HASH)]).start()
    assert time.monotonic() - t0 < 8
    message = str(info.value)
    assert "gpu0" in message and "0123456789abcdef" in message and HASH in message


def test_missing_peer_times_out_with_a_message_naming_it():
    with pytest.raises(HandshakeTimeout) as info:
        Supervisor([spec("cpu-numa0", SILENT, ready_timeout_s=0.5)]).start()
    assert "cpu-numa0" in str(info.value) and "no HELLO" in str(info.value)


def test_child_dying_before_ready_reports_exit_code_and_its_output():
    with pytest.raises(WorkerExited) as info:
        Supervisor([spec("gpu0", CRASH_BEFORE_READY)]).start()
    err = info.value
    assert err.name == "gpu0" and err.exitcode == 3 and "before READY" in str(err)
    assert "/dev/nvidia0" in str(err)


def test_death_becomes_one_typed_error_and_restarts_back_off_exponentially(tmp_path):
    starts_file = tmp_path / "starts"
    errors = []
    sup = Supervisor([spec("cpu-numa0", DIE_AFTER_READY, max_restarts=3, backoff_initial_s=0.3,
                           env={**ENV, "STARTS_FILE": str(starts_file)})], on_error=errors.append)
    sup.start()
    try:
        wait_until(lambda: any(isinstance(e, WorkerGaveUp) for e in errors), timeout_s=20)
        deaths = [e for e in errors if isinstance(e, WorkerExited)]
        assert len(deaths) == 4 and all(e.exitcode == 7 and "while serving" in str(e) for e in deaths)
        starts = [float(x) for x in starts_file.read_text().split()]
        assert len(starts) == 4                              # first start + 3 restarts, then it gave up
        gaps = [b - a for a, b in zip(starts, starts[1:])]   # run + start-up + back-off 0.3, 0.6, 1.2
        assert gaps[1] - gaps[0] > 0.15 and gaps[2] - gaps[1] > 0.3, gaps
        info = sup.worker_info()[0]
        assert info["state"] == "failed" and info["restarts"] == 3 and "exited with code 7" in info["last_error"]
        raised = []
        for _ in range(10):
            try:
                sup.check()
                break
            except Exception as exc:  # noqa: BLE001
                raised.append(type(exc))
        assert raised == [WorkerExited] * 4 + [WorkerGaveUp]   # each failure raised once, in order
    finally:
        sup.stop()


def test_hung_child_is_killed_after_the_heartbeat_timeout_and_restarted():
    errors = []
    sup = Supervisor([spec("cpu-numa0", HANG_AFTER_READY, heartbeat_timeout_s=0.4, max_restarts=10)],
                     on_error=errors.append)
    sup.start()
    try:
        first_pid = sup.worker_info()[0]["pid"]
        wait_until(lambda: errors and sup.worker_info()[0]["state"] == "ready"
                   and sup.worker_info()[0]["pid"] != first_pid)
        assert isinstance(errors[0], HeartbeatTimeout) and "cpu-numa0" in str(errors[0])
        with pytest.raises(ProcessLookupError):
            os.kill(first_pid, 0)
    finally:
        sup.stop()


def test_operator_restart_replaces_the_process():
    sup = Supervisor([spec("gpu0", GOOD)])
    sup.start()
    try:
        old = sup.worker_info()[0]["pid"]
        sup.restart("gpu0")
        wait_until(lambda: sup.worker_info()[0]["state"] == "ready")
        info = sup.worker_info()[0]
        assert info["pid"] != old and info["restarts"] == 1
        with pytest.raises(ValueError, match="gpu0"):
            sup.restart("gpu9")
    finally:
        sup.stop()


def test_child_exits_when_the_supervisor_goes_away(tmp_path):
    import socket
    import subprocess
    from multiprocessing.connection import Connection

    from ftexpert.proto.supervised_child import HELLO, READY, WELCOME, decode, encode
    parent, child = socket.socketpair()
    env = {**os.environ, **ENV, "FT_SUPERVISOR_FD": str(child.fileno()), "FT_WORKER_NAME": "w"}
    p = subprocess.Popen([sys.executable, "-c", GOOD], env=env, pass_fds=(child.fileno(),))
    child.close()
    conn = Connection(parent.detach())
    try:
        assert conn.poll(10) and decode(conn.recv_bytes())["type"] == HELLO
        conn.send_bytes(encode({"type": WELCOME}))
        assert conn.poll(10) and decode(conn.recv_bytes())["type"] == READY
        conn.close()                                  # the parent is gone
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


SCRIPTED = f"""
import os, sys, time
from ftexpert.proto.supervised_child import SupervisorLink
with open(os.environ["STARTS_FILE"], "a") as fh:
    fh.write("x")
n = len(open(os.environ["STARTS_FILE"]).read())
plan = os.environ["PLAN"].split(",")[min(n, len(os.environ["PLAN"].split(","))) - 1]   # this start's fate
link = SupervisorLink.from_env()
if plan == "crash":
    sys.exit(5)                                   # before READY
link.hello({HASH!r})
link.ready()
if plan == "serve":
    link.serve(heartbeat_interval_s=0.05, max_s=60)
link.serve(heartbeat_interval_s=0.05, max_s=float(plan))
os._exit(7)                                       # READY for `plan` seconds, then dies
"""


def _scripted(tmp_path, plan: str, **kw) -> WorkerSpec:
    return spec("gpu0", SCRIPTED, max_restarts=2, stable_after_s=0.6, backoff_initial_s=0.05,
                env={**ENV, "STARTS_FILE": str(tmp_path / "starts"), "PLAN": plan}, **kw)


def test_a_stable_period_after_ready_starts_the_failure_count_afresh(tmp_path):
    errors = []
    # dies twice at once, then serves 1.5 s (> stable_after_s) and dies, dies once more, then serves: without the
    # reset that is 4 failures in a row against max_restarts=2, and it would give up at the third
    sup = Supervisor([_scripted(tmp_path, "0.1,0.1,1.5,0.1,serve")], on_error=errors.append)
    sup.start()
    try:
        wait_until(lambda: len((tmp_path / "starts").read_text()) >= 5 and sup.worker_info()[0]["state"] == "ready",
                   timeout_s=20)
        assert not [e for e in errors if isinstance(e, WorkerGaveUp)], errors
        assert sup.worker_info()[0]["restarts"] == 4
    finally:
        sup.stop()


def test_the_stable_period_counts_from_this_childs_ready_not_an_earlier_ones(tmp_path, caplog):
    """After a long stable run, children that crash before READY still count up and the supervisor gives up
    (it once measured from the earlier child's READY and restarted a crash loop for ever); giving up is logged
    at error level."""
    errors = []
    sup = Supervisor([_scripted(tmp_path, "1.0,crash")], on_error=errors.append)
    with caplog.at_level(logging.ERROR, logger="ft.coordinator.supervisor"):
        sup.start()
        try:
            wait_until(lambda: any(isinstance(e, WorkerGaveUp) for e in errors), timeout_s=20)
        finally:
            sup.stop()
    assert len((tmp_path / "starts").read_text()) == 3        # the stable one + 2 crashes, then it gave up
    assert any(r.levelno == logging.ERROR and "giving up on worker gpu0" in r.getMessage() for r in caplog.records)


def _give_up_advice(mode: str):
    """The give-up advice of the supervisor's owner in each mode: `ft serve --on-worker-give-up exit|stay` (the
    process set's), and the inline owner of the CPU workers (`ft serve --workers inline`, `ft generate`)."""
    from ftexpert.coordinator.cli import build_parser
    from ftexpert.coordinator.expert_resources import ExpertResources
    from ftexpert.coordinator.process_set import ProcessSet, options_from_serve_args
    from ftexpert.proto.engine_spec import spec_from_args

    if mode == "inline":
        return ExpertResources.give_up_advice
    args = build_parser().parse_args(["serve", "--preset", "tiny", "--on-worker-give-up", mode])
    return ProcessSet(options_from_serve_args(args, spec_from_args(args))).give_up_advice


@pytest.mark.parametrize("mode", ["exit", "stay", "inline"])
def test_the_give_up_message_advises_what_brings_the_worker_back_in_each_mode(tmp_path, mode):
    errors = []
    sup = Supervisor([spec("gpu0", DIE_AFTER_READY, max_restarts=1, env={**ENV, "STARTS_FILE": str(tmp_path / "s")})],
                     on_error=errors.append, give_up_advice=_give_up_advice(mode))
    sup.start()
    try:
        wait_until(lambda: any(isinstance(e, WorkerGaveUp) for e in errors), timeout_s=20)
    finally:
        sup.stop()
    message = str(next(e for e in errors if isinstance(e, WorkerGaveUp)))
    assert "fix the cause (worker gpu0 exited with code 7" in message
    if mode == "exit":             # the coordinator exits 70: an `ft ctl` call would find nothing to talk to
        assert "ft ctl" not in message and "exits with code 70" in message and "run `ft serve` again" in message
    elif mode == "stay":
        assert message.endswith("then restart it with `ft ctl restart gpu0` (--on-worker-give-up stay: the "
                                "coordinator keeps serving)")
    else:                          # no `ft ctl restart` reaches the inline owner's supervisor
        assert "ft ctl" not in message and "`ft serve --workers inline` or `ft generate`" in message
