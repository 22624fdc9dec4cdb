"""Who may speak on the engine link: a process without the run's key gets no WELCOME and no prompt, and is told
nothing (no engine spec, no reason beyond two words); a worker refuses a coordinator that cannot prove the key; the default
address is an ipc socket in a 0700 directory of this user, with the key in a 0600 file beside it."""
from __future__ import annotations

import asyncio
import os
import queue
import stat
import subprocess
import sys
import time

import pytest
import zmq

from ftexpert.coordinator.engine_client import EngineUnavailable
from ftexpert.coordinator.engine_link import NOT_AUTHORIZED, EngineLinkServer, PeerMissing
from ftexpert.coordinator.remote_engine import RemoteEngine
from ftexpert.gpu_worker.worker_link import CoordinatorLink, CoordinatorLost
from ftexpert.gpu_worker.worker_main import HandshakeFailed, say_hello
from ftexpert.proto import engine_messages as em
from ftexpert.proto import link_auth
from tests.coordinator.test_engine_link import SPEC, FakeWorker, Recorder, params, until


@pytest.fixture
def link(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    server = EngineLinkServer(f"ipc://{run}/engine.sock", SPEC, heartbeat_interval_s=0.1, peer_timeout_s=5.0)
    server.start()
    yield server
    server.close()


def nothing_more(worker: FakeWorker, wait_s: float = 0.5) -> list:
    """Every message the worker gets within wait_s (heartbeats included)."""
    got = []
    deadline = time.monotonic() + wait_s
    while (remaining := deadline - time.monotonic()) > 0:
        if worker.sock.poll(int(remaining * 1000)):
            got.append(em.decode(worker.sock.recv_multipart()))
    return got


def test_a_peer_without_the_key_gets_no_welcome_and_learns_nothing(link):
    intruder = FakeWorker(link.address, "gpu0", secret=b"\x00" * 32)
    try:
        with pytest.raises(AssertionError):
            intruder.hello()                          # the coordinator's proof does not check with a wrong key
        nonce = link_auth.new_nonce()                 # so it answers a CHALLENGE with a guessed proof
        intruder.send(em.Knock(nonce, em.ENGINE_PROTOCOL_VERSION))
        challenge = intruder.recv()
        assert isinstance(challenge, em.Challenge) and link.secret not in challenge.proof
        intruder.send(em.Hello("gpu0", intruder.pid, em.ENGINE_PROTOCOL_VERSION, b"\x01" * 32))
        reply = intruder.recv()
        assert reply == em.Reject(NOT_AUTHORIZED)
        # a HELLO without any KNOCK, of another protocol: the same two words, no spec, no protocol talk
        intruder.send(em.Hello("gpu0", intruder.pid, em.ENGINE_PROTOCOL_VERSION - 1, b""))
        reply = intruder.recv()
        assert reply == em.Reject(NOT_AUTHORIZED)
        assert link.peer is None and link.auth_failures_total == 2
        with pytest.raises(PeerMissing, match="2 peer\\(s\\) failed to authenticate.*wrong proof|without a CHAL"):
            link.wait_ready(0.3)                      # an intruder cannot make start-up fail as a mismatch would
    finally:
        intruder.close()


def test_an_intruder_cannot_read_a_prompt_after_the_worker_is_gone(link):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    worker = FakeWorker(link.address, pid=proc.pid, secret=link.secret)
    intruder = FakeWorker(link.address, "gpu0", pid=proc.pid + 1_000_000, secret=b"\x07" * 32)
    try:
        worker.ready(worker.hello().session)
        link.wait_ready(2.0)

        async def scenario():
            events = Recorder()
            engine = RemoteEngine(link)
            await engine.start(events)
            first = engine.submit([5, 6], params())
            assert isinstance(await asyncio.get_running_loop().run_in_executor(None, worker.recv), em.AddRequest)
            proc.kill()                                              # the worker crashes ...
            worker.close()
            await until(lambda: events.failed, "the lost worker's request to fail")
            assert events.failed[0][0] == first
            nonce = link_auth.new_nonce()                            # ... and an intruder knocks at once
            intruder.send(em.Knock(nonce, em.ENGINE_PROTOCOL_VERSION))
            challenge = await asyncio.get_running_loop().run_in_executor(None, intruder.recv)
            intruder.send(em.Hello("gpu0", intruder.pid, em.ENGINE_PROTOCOL_VERSION,
                                   link_auth.prove(b"\x07" * 32, link_auth.WORKER, challenge.nonce, nonce,
                                                   intruder.identity)))
            assert await asyncio.get_running_loop().run_in_executor(None, intruder.recv) == em.Reject(NOT_AUTHORIZED)
            with pytest.raises(EngineUnavailable):
                engine.submit([9, 9, 9], params())                   # no prompt goes anywhere
            intruder.send(em.TokenBatch(1, [first], [66], [True], ["stop"]))   # fake tokens are dropped
            got = await asyncio.get_running_loop().run_in_executor(None, nothing_more, intruder)
            assert not [m for m in got if not isinstance(m, em.Heartbeat)] and not events.tokens
            await engine.stop()

        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()
        worker.close()
        intruder.close()


def test_the_worker_refuses_a_coordinator_without_the_key(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    key_file = link_auth.write_secret(str(run), link_auth.new_secret())
    impostor = EngineLinkServer(f"ipc://{run}/engine.sock", SPEC)          # bound by a process with another key
    impostor.start()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    worker_link = CoordinatorLink(impostor.address, b"gpu0-1", inbox)
    worker_link.start()
    hello = em.Hello("gpu0", os.getpid(), em.ENGINE_PROTOCOL_VERSION, b"")
    try:
        with pytest.raises(HandshakeFailed, match="could not prove it holds the key"):
            say_hello(worker_link, inbox, hello, 1.0, key_file)
        assert impostor.peer is None and impostor.auth_failures_total == 0   # it never got our HELLO
    finally:
        worker_link.stop()
        impostor.close()


def test_the_worker_sees_the_coordinators_exit_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    worker_link = CoordinatorLink(f"ipc://{tmp_path}/nobody.sock", b"gpu0-2", inbox)
    worker_link.start()
    try:
        worker_link.watch_coordinator(proc.pid)
        time.sleep(0.2)
        proc.kill()
        lost = inbox.get(timeout=2.0)
        assert isinstance(lost, CoordinatorLost) and "exited" in lost.reason
    finally:
        proc.kill()
        proc.wait()
        worker_link.stop()


def test_the_default_address_is_ipc_in_a_private_directory(tmp_path, monkeypatch):
    from ftexpert.coordinator.process_set import ProcessSet, ProcessSetOptions

    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    for port, expect in ((1919, f"ipc://{base}/ft-1919/engine.sock"), (0, None)):
        procs = ProcessSet(ProcessSetOptions(attach=True, spec=SPEC, http_port=port))
        addr = procs.engine_addr()
        assert addr.startswith(f"ipc://{base}/ft-") and (expect is None or addr == expect)
        directory = procs.runtime_dir(addr)
        st = os.stat(directory)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        key_file = link_auth.write_secret(directory, b"k" * 32)
        assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and link_auth.read_secret(key_file) == b"k" * 32
        assert link_auth.key_file_for(addr) == key_file             # where the worker looks by default
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(base / "ft"))        # systemd's RuntimeDirectory=
    assert link_auth.default_engine_addr(1919) == f"ipc://{base}/ft/engine.sock"


def test_directories_and_key_files_others_can_touch_are_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(link_auth.UnsafePath, match="mode 0755; it must be 0700"):
        link_auth.private_dir(str(open_dir))
    (tmp_path / "link").symlink_to(open_dir)
    with pytest.raises(link_auth.UnsafePath, match="symbolic link"):
        link_auth.private_dir(str(tmp_path / "link"))
    world = tmp_path / "world"
    world.mkdir()
    os.chmod(world, 0o777)
    with pytest.raises(link_auth.UnsafePath, match="another user can change"):
        link_auth.private_dir(str(world / "ft-1919"))
    run = link_auth.private_dir(str(tmp_path / "run"))
    key_file = link_auth.write_secret(run, link_auth.new_secret())
    os.chmod(key_file, 0o644)
    with pytest.raises(link_auth.UnsafePath, match="mode 0644"):
        link_auth.read_secret(key_file)
    with pytest.raises(link_auth.LinkAuthError, match="--engine-key-file"):
        link_auth.key_file_for("tcp://127.0.0.1:1921", environ={})


def test_a_live_coordinators_socket_is_not_taken_over(link):
    with pytest.raises(RuntimeError, match="another process listens on"):
        EngineLinkServer(link.address, SPEC)
    assert zmq.Context.instance()        # the first link still serves
    worker = FakeWorker(link.address, secret=link.secret)
    try:
        assert isinstance(worker.hello(), em.Welcome)
    finally:
        worker.close()
