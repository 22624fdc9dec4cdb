"""The soak's moving parts: `Soak` starts `ft serve` (its log in the report folder), takes reference answers,
runs the client threads, the fault thread (SIGKILL of the GPU worker or of a CPU worker on a schedule) and a
sampler of the process tree and /metrics, then stops the server. report.py judges what it recorded."""
from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ftexpert.coordinator.ports import free_loopback_port
from ftexpert.cpu_expert_pool.api import IMPORT_ROOT, worker_env
from ftexpert.coordinator.soak import agent
from ftexpert.coordinator.soak.probes import TreeSample, metric_values, named_values, pids_of, sample_tree

PROMPTS = ["Hello", "The weather is", "Question: what is two plus two?", "Once upon a time",
           "The quick brown fox", "A mixture of experts model"]
CHAT = [{"role": "user", "content": "Hello!"}]
MAX_TOKENS = 16
SAMPLED_SEEDS = (1, 2, 3)
REQUEST_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
RECOVERY_TIMEOUT_S = 120.0
MAX_REQUESTS_PER_CLIENT = 1_000_000
UNAVAILABLE_BACKOFF_S = 0.05          # a client's pause after a 503
OUTAGE_GRACE_S = 1.0                  # after /health is ok again, stragglers of the outage still count as outage
KINDS = {"completion": 25, "stream": 20, "chat": 15, "sampled": 5, "bad": 15, "disconnect": 10, "agent": 10}
GOOD_KINDS = ("completion", "stream", "chat", "sampled", "agent")
BAD_BODIES = [b"{not json", json.dumps({"model": "soak", "prompt": "x", "max_tokens": -1}).encode(),
              json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
              json.dumps({"model": "soak"}).encode(),
              json.dumps({"model": "soak", "prompt": "x", "temperature": "hot"}).encode()]
ROLES = {"gpu": "worker gpu", "cpu": "worker cpu"}     # a fault's role -> the worker's command line


@dataclass
class Outcome:
    kind: str
    started: float
    latency_s: float
    result: str                       # ok | wrong | error | outage | unavailable (before classify)
    detail: str = ""
    max_gap_s: float | None = None    # streams: the longest wait between two events


@dataclass
class Kill:
    role: str                         # gpu | cpu
    pid: int
    at: float
    recovered: float | None = None    # a new worker of the role (and, for gpu, /health ok) at this time


@dataclass
class Sample:
    t: float
    tree: TreeSample
    generated_tokens: float


@dataclass
class Soak:
    args: object
    out_dir: str
    port: int = 0
    proc: subprocess.Popen | None = None
    store_name: str = ""
    reference: dict = field(default_factory=dict)
    sampled: dict = field(default_factory=dict)
    scripts: list = field(default_factory=list)          # the agent conversations (soak/agent.py)
    engine_after: dict = field(default_factory=dict)     # the engine's counters and stats after the load
    outcomes: list = field(default_factory=list)
    kills: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_sampling: threading.Event = field(default_factory=threading.Event)

    @property
    def log_path(self) -> str:
        return os.path.join(self.out_dir, "server.log")

    # ------------------------------------------------------------------ server

    def start(self) -> None:
        self.port = free_loopback_port()
        self.store_name = f"ft-soak-{os.getpid()}"
        argv = [sys.executable, "-m", "ftexpert.coordinator.cli", "serve", "--workers", self.args.workers, "--port",
                str(self.port), "--grpc-port", "-1", "--served-model-name", "soak", "--store-name", self.store_name,
                "--drain-timeout-s", "10", *self.args.serve_args.split()]
        env = {**worker_env(), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=IMPORT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ft serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if "ft serve: soak" in self.log_tail(20000):
                return
            time.sleep(0.2)
        raise RuntimeError(f"ft serve did not listen within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-n:]

    def sample(self) -> Sample:
        tokens = float("nan")
        try:
            tokens = metric_values(self.get("/metrics")[1].decode()).get("ft_generation_tokens_total", tokens)
        except OSError:
            pass
        return Sample(time.monotonic(), sample_tree(self.proc.pid, self.store_name), tokens)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return -9

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, body: bytes, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def completion_body(self, prompt: str, **extra) -> bytes:
        return json.dumps({"model": "soak", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                           **extra}).encode()

    def chat_body(self, **extra) -> bytes:
        return json.dumps({"model": "soak", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0,
                           **extra}).encode()

    def take_reference(self) -> None:
        for prompt in PROMPTS:
            status, raw = self.post("/v1/completions", self.completion_body(prompt))
            if status != 200:
                raise RuntimeError(f"reference request failed: {status} {raw[:300]!r}")
            self.reference[prompt] = json.loads(raw)["choices"][0]["text"]
        status, raw = self.post("/v1/chat/completions", self.chat_body())
        if status != 200:
            raise RuntimeError(f"reference chat failed: {status} {raw[:300]!r}")
        self.reference["<chat>"] = json.loads(raw)["choices"][0]["message"]["content"]
        context = json.loads(self.get("/v1/models")[1])["data"][0]["max_model_len"]
        self.scripts = agent.make_scripts(self.args.seed)
        agent.take_references(self.scripts, self.post, context)

    # ------------------------------------------------------------------ one request of each kind

    def one(self, kind: str, rng: random.Random) -> tuple[str, str, float | None]:
        """(result, detail, longest token gap) of one request; raises on transport errors."""
        if kind == "stream":
            return self.stream(rng.choice(PROMPTS))
        if kind == "disconnect":
            return (*self.disconnect(rng), None)
        if kind == "agent":
            return (*agent.replay(rng.choice(self.scripts), self.post, self.failure), None)
        return (*self.plain(kind, rng), None)

    def plain(self, kind: str, rng: random.Random) -> tuple[str, str]:
        if kind == "completion":
            prompt = rng.choice(PROMPTS)
            status, raw = self.post("/v1/completions", self.completion_body(prompt))
            if status != 200:
                return self.failure(status, raw)
            text = json.loads(raw)["choices"][0]["text"]
            return ("ok", "") if text == self.reference[prompt] else ("wrong", f"{prompt!r}: {text!r}")
        if kind == "chat":
            status, raw = self.post("/v1/chat/completions", self.chat_body())
            if status != 200:
                return self.failure(status, raw)
            text = json.loads(raw)["choices"][0]["message"]["content"]
            return ("ok", "") if text == self.reference["<chat>"] else ("wrong", f"chat: {text!r}")
        if kind == "sampled":
            seed = rng.choice(SAMPLED_SEEDS)
            prompt = PROMPTS[seed % len(PROMPTS)]
            status, raw = self.post("/v1/completions", self.completion_body(prompt, temperature=0.8, seed=seed))
            if status != 200:
                return self.failure(status, raw)
            text = json.loads(raw)["choices"][0]["text"]
            with self.lock:
                first = self.sampled.setdefault(seed, text)
            return ("ok", "") if text == first else ("wrong", f"seed {seed}: {text!r} != {first!r}")
        if kind == "bad":
            status, raw = self.post("/v1/completions", rng.choice(BAD_BODIES))
            try:
                err = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                err = ""
            return ("ok", "") if 400 <= status < 500 and err else ("wrong", f"bad request got {status} {raw[:200]!r}")
        raise ValueError(kind)

    def stream(self, prompt: str) -> tuple[str, str, float | None]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        events, gaps = [], []
        try:
            conn.request("POST", "/v1/completions", self.completion_body(prompt, stream=True),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return (*self.failure(resp.status, resp.read()), None)
            last = time.monotonic()
            for line in iter(resp.readline, b""):
                if line.startswith(b"data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    events.append(line.decode().strip())
        finally:
            conn.close()
        max_gap = max(gaps[1:], default=None)       # from the first event on: the time to it is latency, not a gap
        if not events or events[-1] != "data: [DONE]":
            return "wrong", f"stream did not end with [DONE]: {events[-1:]!r}", max_gap
        payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
        if payloads and "error" in payloads[-1]:
            return (*self.failure(500, json.dumps(payloads[-1]).encode()), max_gap)
        text = "".join(p["choices"][0]["text"] for p in payloads)
        return (("ok", "") if text == self.reference[prompt] else ("wrong", f"stream {prompt!r}: {text!r}")) + (max_gap,)

    def disconnect(self, rng: random.Random) -> tuple[str, str]:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=REQUEST_TIMEOUT_S)
        try:
            body = json.dumps({"model": "soak", "prompt": rng.choice(PROMPTS), "max_tokens": 1500,
                               "ignore_eos": True, "stream": True, "temperature": 0}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            head = sock.recv(4096)
            if not head.startswith(b"HTTP/1.1 200"):
                return self.failure(int(head[9:12] or 0), head)
        finally:
            sock.close()                                      # gone mid-stream: the server must abort it
        return "ok", ""

    def failure(self, status: int, raw: bytes) -> tuple[str, str]:
        text = raw[:300].decode(errors="replace")
        if status == 503 or "engine_unavailable" in text:
            return "unavailable", f"{status} {text}"
        return "error", f"{status} {text}"

    # ------------------------------------------------------------------ load

    def classify(self, result: str, started: float, ended: float) -> str:
        """503 / engine_unavailable during a GPU-worker kill's outage is expected; elsewhere it is an error (a
        CPU-worker kill must cost nothing: the GPU worker fetches that share instead)."""
        if result != "unavailable":
            return result
        for kill in self.kills:
            if kill.role != "gpu":
                continue
            end = (kill.recovered if kill.recovered is not None else float("inf")) + OUTAGE_GRACE_S
            if ended >= kill.at and started <= end:
                return "outage"
        return "error"

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        kinds, weights = zip(*KINDS.items())
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            kind = rng.choices(kinds, weights)[0]
            t0 = time.monotonic()
            gap = None
            try:
                result, detail, gap = self.one(kind, rng)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                result, detail = "unavailable" if self.kills else "error", f"{type(exc).__name__}: {exc}"
            t1 = time.monotonic()
            with self.lock:
                self.outcomes.append(Outcome(kind, t0, t1 - t0, result, detail, gap))
            if result == "unavailable":
                time.sleep(UNAVAILABLE_BACKOFF_S)         # as a client would, instead of hammering a 503

    def kill_one(self, role: str) -> Kill | None:
        pids = pids_of(self.proc.pid, ROLES[role])
        if not pids:
            with self.lock:
                self.outcomes.append(Outcome("kill", time.monotonic(), 0.0, "error", f"no {role} worker to kill"))
            return None
        kill = Kill(role, pids[0], time.monotonic())
        os.kill(kill.pid, signal.SIGKILL)
        self.kills.append(kill)                          # classify reads it (recovered is set in place)
        time.sleep(0.2)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                now_pids = pids_of(self.proc.pid, ROLES[role])
                replaced = len(now_pids) >= len(pids) and set(now_pids) - set(pids)
                if replaced and (role != "gpu" or self.get("/health", 5)[0] == 200):
                    kill.recovered = time.monotonic()
                    break
            except OSError:
                pass
            time.sleep(0.05)
        return kill

    def faults(self, start: float, deadline: float) -> None:
        """The kill schedule: (time, role) pairs from --kill-*-worker-at-s / --kill-*-worker-every-s, in order."""
        plan = []
        for role in ROLES:
            at, every = getattr(self.args, f"kill_{role}_worker_at_s"), getattr(self.args, f"kill_{role}_worker_every_s")
            t = at
            while t is not None and start + t < deadline - 1.0:
                plan.append((start + t, role))
                t = t + every if every else None
        for when, role in sorted(plan):
            time.sleep(max(0.0, when - time.monotonic()))
            if time.monotonic() < deadline - 1.0:
                self.kill_one(role)

    def sampler(self) -> None:
        while not self._stop_sampling.wait(self.args.sample_interval_s):
            try:
                self.samples.append(self.sample())
            except Exception:  # noqa: BLE001 - a sample lost is not a failed soak
                pass

    def run_load(self) -> tuple[float, float]:
        start = time.monotonic()
        deadline = start + self.args.duration_s
        threads = [threading.Thread(target=self.client, args=(i, deadline), daemon=True)
                   for i in range(self.args.concurrency)]
        threads.append(threading.Thread(target=self.faults, args=(start, deadline), daemon=True))
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.args.duration_s + REQUEST_TIMEOUT_S + RECOVERY_TIMEOUT_S)
        self._stop_sampling.set()
        sampler.join(10)
        return start, time.monotonic()

    def requests_inside(self) -> float:
        values = metric_values(self.get("/metrics")[1].decode())
        return values.get("ft_requests_running", 0.0) + values.get("ft_requests_waiting", 0.0)

    def read_engine_after(self) -> None:
        """The engine's counters and stats once the load is over (the prefix cache's hits, the KV blocks held)."""
        text = self.get("/metrics")[1].decode()
        self.engine_after = {**named_values(text, "ft_engine_counter_total"), **named_values(text, "ft_engine_stat")}
