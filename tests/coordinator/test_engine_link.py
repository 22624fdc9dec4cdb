"""The engine link without real workers: the message schema, the coordinator's EngineLinkServer and
RemoteEngine (on an event loop) against a scripted DEALER in this process, and gpu_busy_loop against a
fake engine."""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import subprocess
import sys
import threading
import time

import pytest
import zmq

from ftexpert.coordinator.engine_client import EngineError, EngineUnavailable
from ftexpert.coordinator.engine_link import EngineLinkServer, PeerMismatch, PeerMissing
from ftexpert.coordinator.remote_engine import RemoteEngine
from ftexpert.gpu_worker.worker_link import CoordinatorLost
from ftexpert.gpu_worker.worker_loop import EXIT_COORDINATOR_LOST, EXIT_ENGINE_FAILED, LocalStop, gpu_busy_loop
from ftexpert.proto import engine_messages as em
from ftexpert.proto import link_auth
from ftexpert.proto.link_io import check_loopback_address
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.sampling_params import SamplingParams

SPEC = EngineSpec(moe_strategy="resident", max_running_requests=4, max_context_tokens=512)


def sample(cls):
    """An instance of a message class with a typed value in every field."""
    values = {bool: True, int: 7, float: 0.5, str: "x", bytes: b"\x01\x02", list[int]: [1, 2], list[str]: ["a"],
              list[bool]: [True, False], list[float]: [1.5], EngineSpec: SPEC,
              SamplingParams: SamplingParams(max_new_tokens=3, temperature=0.7, top_k=5, seed=2 ** 63 - 1,
                                             stop_token_ids=(1, 2))}
    import typing
    return cls(**{f: values[t] for f, t in typing.get_type_hints(cls).items()})


@pytest.mark.parametrize("cls", list(em.MESSAGE_TYPES.values()), ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    msg = sample(cls)
    assert em.decode(em.encode(msg)) == msg


def test_sampling_params_cross_the_link_as_they_are():
    for params in (SamplingParams(), SamplingParams(max_new_tokens=9, temperature=0.5, top_p=0.9, seed=0,
                                                    ignore_eos=True, stop_token_ids=(3,))):
        msg = em.decode(em.encode(em.AddRequest(1, em.pack_token_ids([4]), params)))
        assert msg.params == params and isinstance(msg.params.stop_token_ids, tuple)
        assert (msg.params.seed is None) == (params.seed is None)
    import msgpack
    frames = em.encode(em.AddRequest(1, b"", SamplingParams()))
    payload = msgpack.unpackb(frames[1])
    payload["params"]["top_p"] = 0.0                       # the worker refuses what the front door would
    with pytest.raises(em.MessageError, match="top_p must be in"):
        em.decode([frames[0], msgpack.packb(payload)])
    payload["params"] = {"max_new_tokens": 2, "extra": 1}
    with pytest.raises(em.MessageError, match="SamplingParams: unknown field"):
        em.decode([frames[0], msgpack.packb(payload)])


def test_decode_names_what_is_wrong():
    frames = em.encode(em.Abort([1, 2]))
    with pytest.raises(em.MessageError, match="unknown engine link message type 99"):
        em.decode([b"\x63", frames[1]])
    import msgpack
    with pytest.raises(em.MessageError, match="Abort: unknown field"):
        em.decode([frames[0], msgpack.packb({"request_ids": [1], "extra": 1})])
    with pytest.raises(em.MessageError, match="Abort: missing field.*request_ids"):
        em.decode([frames[0], msgpack.packb({})])
    with pytest.raises(em.MessageError, match="Abort.request_ids"):
        em.decode([frames[0], msgpack.packb({"request_ids": ["1"]})])
    with pytest.raises(em.MessageError, match="not msgpack"):
        em.decode([frames[0], b"\xc1"])
    with pytest.raises(em.MessageError, match="is not"):
        em.encode(em.Abort(["1"]))                       # type: ignore[list-item]


def test_token_ids_pack():
    assert em.unpack_token_ids(em.pack_token_ids([0, 5, 2 ** 31 - 1])) == [0, 5, 2 ** 31 - 1]
    with pytest.raises(em.MessageError):
        em.unpack_token_ids(b"\x00\x01\x02")


def test_only_loopback_addresses_are_accepted():
    for ok in ("tcp://127.0.0.1:1921", "tcp://localhost:5", "tcp://[::1]:5", "ipc:///run/ft/engine.sock"):
        assert check_loopback_address(ok) == ok
    for bad in ("tcp://0.0.0.0:1921", "tcp://10.0.0.1:1", "tcp://*:1921", "ipc://", "inproc://x"):
        with pytest.raises(ValueError, match="not a loopback address"):
            check_loopback_address(bad)


class FakeWorker:
    """A scripted GPU worker: a DEALER speaking the engine link by hand."""

    def __init__(self, addr: str, name: str = "gpu0", pid: int | None = None, secret: bytes | None = None,
                 protocol: int = em.ENGINE_PROTOCOL_VERSION):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.pid = pid if pid is not None else 10_000_000 + id(self) % 1000   # no such pid: no pidfd
        self.identity = f"{name}-{self.pid}".encode()
        self.secret = secret
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.name, self.protocol = name, protocol

    def send(self, msg) -> None:
        self.sock.send_multipart(em.encode(msg))

    def recv(self, timeout_s: float = 5.0, skip_heartbeats: bool = True):
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and self.sock.poll(int(remaining * 1000)), "no message from the coordinator"
            msg = em.decode(self.sock.recv_multipart())
            if not (skip_heartbeats and isinstance(msg, em.Heartbeat)):
                return msg

    def hello(self) -> em.Welcome | em.Reject:
        """KNOCK, check the CHALLENGE, HELLO with the proof (a worker of this run: it holds the link's key)."""
        nonce = link_auth.new_nonce()
        self.send(em.Knock(nonce, em.ENGINE_PROTOCOL_VERSION))
        challenge = self.recv()
        assert isinstance(challenge, em.Challenge) and challenge.worker_nonce == nonce
        assert link_auth.verify(self.secret, link_auth.COORDINATOR, challenge.proof, nonce, challenge.nonce)
        proof = link_auth.prove(self.secret, link_auth.WORKER, challenge.nonce, nonce, self.identity)
        self.send(em.Hello(self.name, self.pid, self.protocol, proof))
        return self.recv()

    def ready(self, session: int) -> None:
        self.send(em.Ready(session, self.pid, "cpu", "", 100, 512, 4, "ResidentExperts", 0.1))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def link():
    server = EngineLinkServer("tcp://127.0.0.1:0", SPEC, store_name="ft-store-x", heartbeat_interval_s=0.1,
                              peer_timeout_s=0.6)
    server.start()
    yield server
    server.close()


def params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, seed=5)


class Recorder:
    """EngineEvents: what RemoteEngine delivers on the loop."""

    def __init__(self):
        self.tokens: list[tuple] = []
        self.failed: list[tuple[int, EngineError]] = []
        self.stats: list[dict] = []
        self.thread = None

    def on_tokens(self, outputs):
        self.thread = threading.current_thread()
        self.tokens += outputs

    def on_request_failed(self, request_id, error):
        self.failed.append((request_id, error))

    def on_stats(self, stats):
        self.stats.append(stats)


async def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def recv(worker: "FakeWorker", timeout_s: float = 5.0):
    """The worker's next message, read beside the running loop."""
    return await asyncio.get_running_loop().run_in_executor(None, worker.recv, timeout_s)


def test_a_worker_of_another_protocol_is_rejected(link):
    worker = FakeWorker(link.address, "gpu3", secret=link.secret, protocol=em.ENGINE_PROTOCOL_VERSION - 1)
    try:
        reply = worker.hello()
        assert isinstance(reply, em.Reject) and "protocol differs" in reply.reason
        with pytest.raises(PeerMismatch, match=f"gpu3.*protocol {em.ENGINE_PROTOCOL_VERSION - 1}, the coordinator "
                                               f"{em.ENGINE_PROTOCOL_VERSION}"):
            link.wait_ready(2.0)
    finally:
        worker.close()


def test_welcome_carries_the_coordinators_engine_spec(link):
    worker = FakeWorker(link.address, "gpu0", secret=link.secret)
    try:
        welcome = worker.hello()
        assert isinstance(welcome, em.Welcome) and welcome.spec == SPEC      # whole, typed, field for field
        assert link.spec_hash == em.spec_hash(SPEC.to_wire()) != em.spec_hash(
            dataclasses.replace(SPEC, max_context_tokens=1024).to_wire())
    finally:
        worker.close()


def test_no_worker_is_a_timeout_naming_the_address(link):
    with pytest.raises(PeerMissing, match=f"did not become READY on {link.address} within 0.3 s \\(none connected"):
        link.wait_ready(0.3)


def test_remote_engine_streams_tokens_and_fails_only_the_lost_sessions_requests(link):
    first = FakeWorker(link.address, secret=link.secret)
    second = None
    try:
        welcome = first.hello()
        assert isinstance(welcome, em.Welcome) and welcome.session == 1 and welcome.store_name == "ft-store-x"
        first.ready(welcome.session)
        assert link.wait_ready(2.0).max_context_tokens == 512

        async def scenario():
            nonlocal second
            events = Recorder()
            engine = RemoteEngine(link)
            await engine.start(events)                            # READY came before: replayed
            assert engine.health().ready and engine.facts.max_context_tokens == 512
            rid = engine.submit([5, 6], params())
            add = await recv(first)
            assert isinstance(add, em.AddRequest) and add.request_id == rid
            assert em.unpack_token_ids(add.prompt_ids) == [5, 6] and add.params == params()
            first.send(em.TokenBatch(1, [rid, 999], [42, 1], [False, False], ["", ""]))   # 999: not ours
            await until(lambda: events.tokens, "the token batch")
            assert events.tokens == [(rid, 42, False, None, None)]
            assert events.thread is threading.current_thread()    # delivered on the loop
            first.send(em.Stats(["generated_tokens"], [1.0]))
            await until(lambda: events.stats, "the stats")
            assert events.stats[-1]["generated_tokens"] == 1.0 and engine.stats["link.requests_in_flight"] == 1.0
            engine.set_policy(em.SetPolicy("offload", 1.0, "min-wait", ["cpu0", "cpu1"],
                                           [0.75, 0.25]))
            policy = await recv(first)
            assert isinstance(policy, em.SetPolicy)
            assert policy.fields()["cpu_shares"] == {"cpu0": 0.75, "cpu1": 0.25}
            first.close()                                         # silent from now on: lost after 0.6 s
            await until(lambda: events.failed, "the lost session's request to fail")
            ((lost_rid, error),) = events.failed
            assert lost_rid == rid and isinstance(error, EngineUnavailable) and "sent nothing for" in str(error)
            assert not engine.health().ready and engine.health().pid == 0
            with pytest.raises(EngineUnavailable, match="not ready"):
                engine.submit([1], params())
            second = FakeWorker(link.address, pid=10_000_999, secret=link.secret)
            welcome = await asyncio.get_running_loop().run_in_executor(None, second.hello)
            assert welcome.session == 2
            second.ready(2)
            await until(lambda: engine.health().ready, "the second session")
            assert isinstance(await recv(second), em.SetPolicy)   # the policy is pushed to the new session
            rid2 = engine.submit([7], params(1))
            assert (await recv(second)).request_id == rid2
            second.send(em.RequestFailed(rid2, "the engine refused the request: prompt too long"))
            await until(lambda: len(events.failed) == 2, "the refusal")
            r, err = events.failed[1]
            assert r == rid2 and type(err) is EngineError and "refused the request: prompt too long" in str(err)
            assert engine.stats["link.sessions_lost_total"] == 1.0
            await engine.stop()

        asyncio.run(scenario())
    finally:
        first.close()
        if second is not None:
            second.close()


def test_a_dead_worker_pid_is_seen_at_once_and_a_second_live_worker_is_refused(link):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    worker = FakeWorker(link.address, pid=proc.pid, secret=link.secret)
    intruder = FakeWorker(link.address, "gpu1", pid=proc.pid + 1_000_000, secret=link.secret)
    try:
        worker.ready(worker.hello().session)
        link.wait_ready(2.0)

        async def scenario():
            events = Recorder()
            engine = RemoteEngine(link)
            await engine.start(events)
            assert engine.health().pid == proc.pid
            rid = engine.submit([1], params())
            reply = await asyncio.get_running_loop().run_in_executor(None, intruder.hello)
            assert isinstance(reply, em.Reject) and "is already connected" in reply.reason
            t0 = time.monotonic()
            proc.kill()
            await until(lambda: events.failed, "the request of the dead worker to fail")
            assert events.failed[0][0] == rid and f"(pid {proc.pid}) exited" in str(events.failed[0][1])
            assert time.monotonic() - t0 < 0.5                    # the pidfd, not the 0.6 s silence

        asyncio.run(scenario())
    finally:
        proc.kill()
        proc.wait()
        worker.close()
        intruder.close()


@dataclasses.dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    made: int = 0


class FakeEngine:
    """Engine contract with caller-chosen ids: one token (100 + n) per request per step."""

    def __init__(self, fail_steps: int = 0):
        self.reqs: dict[int, _Req] = {}
        self.aborted: list[int] = []
        self.fail_steps = fail_steps
        self.stats = {"generated_tokens": 0}
        self.policies: list[dict] = []

    @property
    def scheduler(self):
        return dataclasses.make_dataclass("Queues", ["running", "waiting"])(list(self.reqs), [])

    def set_policy(self, **fields):
        self.policies.append(fields)

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.reqs[request_id] = _Req(prompt, params)
        return request_id

    def abort(self, rid):
        self.aborted.append(rid)
        return self.reqs.pop(rid, None) is not None

    def has_work(self):
        return bool(self.reqs)

    def step(self):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("simulated device error")
        out = []
        for rid, r in list(self.reqs.items()):
            r.made += 1
            done = r.made >= r.params.max_new_tokens
            out.append((rid, 100 + r.made, done, "length" if done else None))
            if done:
                del self.reqs[rid]
        self.stats["generated_tokens"] += len(out)
        return out


def add(rid: int, n: int, prompt=(1, 2)) -> em.AddRequest:
    return em.AddRequest(rid, em.pack_token_ids(list(prompt)), SamplingParams(max_new_tokens=n))


def run_bounded(engine, inbox: queue.SimpleQueue, send, timeout_s: float = 10.0, **kw) -> int:
    """gpu_busy_loop in a thread, so that a loop that never ends fails the test instead of hanging it."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(gpu_busy_loop(engine, inbox, send, **kw)), daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        inbox.put(em.Shutdown("test timeout"))
        t.join(5)
        raise AssertionError(f"gpu_busy_loop did not return within {timeout_s} s")
    return result[0]


def run_loop(engine, items, **kw) -> tuple[int, list]:
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    for item in items:
        inbox.put(item)
    sent: list = []
    code = run_bounded(engine, inbox, sent.append, stats_interval_s=0.0, **kw)
    return code, sent


def test_busy_loop_batches_tokens_refuses_bad_requests_and_drains():
    engine = FakeEngine()
    policy = em.SetPolicy("hybrid", 0.5, "split", ["cpu0"], [1.0])
    code, sent = run_loop(engine, [add(1, 2), add(2, 3), add(3, 1, prompt=()), em.Abort([2]), policy,
                                   LocalStop("SIGTERM", drain=True)])
    assert code == 0
    batches = [m for m in sent if isinstance(m, em.TokenBatch)]
    assert batches[0].request_ids == [1] and batches[0].token_ids == [101]       # 2 aborted before any step
    assert batches[-1].finished == [True] and batches[-1].finish_reasons == ["length"]
    ((refused,),) = [[m for m in sent if isinstance(m, em.RequestFailed)]]
    assert refused.request_id == 3 and refused.message == "the engine refused the request: the prompt is empty"
    assert engine.aborted == [2] and engine.policies == [policy.fields()]
    assert sent[-1] == em.Drained(finished=1, aborted=0)
    stats = [m for m in sent if isinstance(m, em.Stats)]
    last = dict(zip(stats[-1].names, stats[-1].values))
    assert last["generated_tokens"] == 2.0 and last["num_running"] == 0.0 and last["num_waiting"] == 0.0
    assert any(dict(zip(m.names, m.values))["num_running"] >= 1.0 for m in stats)


def test_busy_loop_exit_codes():
    assert run_loop(FakeEngine(), [add(1, 50), em.Shutdown("bye")])[0] == 0
    code, sent = run_loop(FakeEngine(), [add(1, 50), CoordinatorLost("silent")])
    assert code == EXIT_COORDINATOR_LOST
    assert any(isinstance(m, em.RequestFailed) and m.request_id == 1 for m in sent)
    engine = FakeEngine(fail_steps=5)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    inbox.put(add(1, 5))
    sent = []

    def send(msg):
        sent.append(msg)
        if isinstance(msg, em.RequestFailed):
            inbox.put(add(msg.request_id + 1, 5))   # a new request after each failed step keeps it stepping
    assert run_bounded(engine, inbox, send) == EXIT_ENGINE_FAILED
    assert isinstance(sent[-1], em.Error) and sent[-1].fatal and "3 engine steps failed" in sent[-1].message
    assert "simulated device error" in next(m for m in sent if isinstance(m, em.RequestFailed)).message
    assert engine.fail_steps == 2                  # it stopped after the third failure in a row
