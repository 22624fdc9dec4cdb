"""Soak test: a live `ft serve` on 127.0.0.1 under a bounded mix of concurrent requests for a while.

    python bench/soak.py                                   # 60 s, process mode, the tiny model on this machine
    python bench/soak.py --duration-s 20 --kill-worker-at-s 8      # the CI run (tests/bench/test_soak.py)
    python bench/soak.py --duration-s 3600 --concurrency 16 --kill-worker-every-s 600 \\
        --serve-args "--model /models/Qwen3-30B-A3B --device cuda --moe-strategy offload"  # docs/SOAK.md

Clients (threads, each with its own seeded generator) loop until the deadline over: greedy completions
(checked against a reference taken before the load, so batching must not change greedy tokens), greedy
streams, chats, seeded sampled completions (the same seed must give the same text), bad requests
(each must be a 4xx JSON error), and clients that disconnect mid-stream. Optionally the GPU worker is
killed (SIGKILL) during the run: requests that fail with 503 / engine_unavailable between the kill and
the worker's recovery count as the outage, anything else is an error. Afterwards: the server must
have no request left inside, its memory (RSS of the process tree) must not have grown by more than
--max-rss-growth-mb, SIGTERM must stop it with exit code 0, and /dev/shm must hold none of its
segments. Prints a table; exit code 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:        # run as a script from a checkout without `pip install -e`
    sys.path.insert(0, REPO)
from coordinator.ports import free_loopback_port  # noqa: E402
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
KINDS = {"completion": 30, "stream": 25, "chat": 15, "sampled": 5, "bad": 15, "disconnect": 10}
BAD_BODIES = [b"{not json", json.dumps({"model": "soak", "prompt": "x", "max_tokens": -1}).encode(),
              json.dumps({"model": "no-such-model", "prompt": "x"}).encode(),
              json.dumps({"model": "soak"}).encode(),
              json.dumps({"model": "soak", "prompt": "x", "temperature": "hot"}).encode()]


free_port = free_loopback_port


@dataclass
class Outcome:
    kind: str
    started: float
    latency_s: float
    result: str                       # ok | wrong | error | outage
    detail: str = ""


@dataclass
class Soak:
    args: argparse.Namespace
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: str = ""
    store_name: str = ""
    reference: dict = field(default_factory=dict)
    sampled: dict = field(default_factory=dict)
    outcomes: list = field(default_factory=list)
    kills: list = field(default_factory=list)          # (kill time, recovered time or None)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ server

    def start(self) -> None:
        self.port = free_port()
        self.store_name = f"ft-soak-{os.getpid()}"
        argv = [sys.executable, "-m", "coordinator.cli", "serve", "--workers", self.args.workers, "--port",
                str(self.port), "--grpc-port", "-1", "--served-model-name", "soak", "--store-name", self.store_name,
                "--drain-timeout-s", "10", *self.args.serve_args.split()]
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1"}
        fd, self.log_path = tempfile.mkstemp(prefix="ft-soak-", suffix=".log")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                     stderr=subprocess.STDOUT)
        os.close(fd)
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

    def tree(self) -> list:
        import psutil
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def rss_bytes(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001 - a process that just exited
                pass
        return total

    def gpu_worker_pid(self) -> int | None:
        for p in self.tree()[1:]:
            try:
                if "worker gpu" in " ".join(p.cmdline()):
                    return p.pid
            except Exception:  # noqa: BLE001
                pass
        return None

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

    # ------------------------------------------------------------------ one request of each kind

    def one(self, kind: str, rng: random.Random) -> tuple[str, str]:
        """(result, detail) of one request; raises on transport errors (counted by the caller)."""
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
        if kind == "stream":
            return self.stream(rng.choice(PROMPTS))
        if kind == "disconnect":
            return self.disconnect(rng)
        raise ValueError(kind)

    def stream(self, prompt: str) -> tuple[str, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", self.completion_body(prompt, stream=True),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return self.failure(resp.status, resp.read())
            events = [e for e in resp.read().decode().split("\n\n") if e]
        finally:
            conn.close()
        if not events or events[-1] != "data: [DONE]":
            return "wrong", f"stream did not end with [DONE]: {events[-1:]!r}"
        payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
        if payloads and "error" in payloads[-1]:
            return self.failure(500, json.dumps(payloads[-1]).encode())
        text = "".join(p["choices"][0]["text"] for p in payloads)
        return ("ok", "") if text == self.reference[prompt] else ("wrong", f"stream {prompt!r}: {text!r}")

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
        """503 / engine_unavailable during a kill's outage window is expected; elsewhere it is an error."""
        if result != "unavailable":
            return result
        for kill_at, recovered_at in self.kills:
            end = (recovered_at if recovered_at is not None else float("inf")) + OUTAGE_GRACE_S
            if ended >= kill_at and started <= end:
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
            try:
                result, detail = self.one(kind, rng)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                result, detail = "unavailable" if self.kills else "error", f"{type(exc).__name__}: {exc}"
            t1 = time.monotonic()
            with self.lock:
                self.outcomes.append(Outcome(kind, t0, t1 - t0, result, detail))
            if result == "unavailable":
                time.sleep(UNAVAILABLE_BACKOFF_S)         # as a client would, instead of hammering a 503

    def killer(self, start: float, deadline: float) -> None:
        a = self.args
        next_kill = start + a.kill_worker_at_s if a.kill_worker_at_s is not None else None
        while next_kill is not None and next_kill < deadline - 1.0:
            time.sleep(max(0.0, next_kill - time.monotonic()))
            pid = self.gpu_worker_pid()
            if pid is None:
                with self.lock:
                    self.outcomes.append(Outcome("kill", time.monotonic(), 0.0, "error", "no GPU worker to kill"))
                return
            kill_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            entry = [kill_at, None]
            self.kills.append(entry)               # (mutated in place: classify reads it)
            time.sleep(0.2)
            recover_deadline = time.monotonic() + RECOVERY_TIMEOUT_S
            while time.monotonic() < recover_deadline:
                try:
                    if self.get("/health", 5)[0] == 200 and self.gpu_worker_pid() not in (None, pid):
                        entry[1] = time.monotonic()
                        break
                except OSError:
                    pass
                time.sleep(0.05)
            self.kills[-1] = tuple(entry)
            next_kill = kill_at + a.kill_worker_every_s if a.kill_worker_every_s else None

    def run_load(self) -> tuple[float, float]:
        start = time.monotonic()
        deadline = start + self.args.duration_s
        threads = [threading.Thread(target=self.client, args=(i, deadline), daemon=True)
                   for i in range(self.args.concurrency)]
        threads.append(threading.Thread(target=self.killer, args=(start, deadline), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.args.duration_s + REQUEST_TIMEOUT_S + RECOVERY_TIMEOUT_S)
        return start, time.monotonic()

    def requests_inside(self) -> float:
        status, raw = self.get("/metrics")
        total = 0.0
        for line in raw.decode().splitlines():
            if line.startswith(("ft_requests_running ", "ft_requests_waiting ")):
                total += float(line.split()[-1])
        return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def shm_segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--workers", default="process", choices=("process", "inline"), help="ft serve --workers")
    p.add_argument("--serve-args", default="--device cpu --max-running-requests 4 --max-context-tokens 2048",
                   help="more `ft serve` flags (model, device, strategy)")
    p.add_argument("--kill-worker-at-s", type=float, default=None, help="SIGKILL the GPU worker this far into the run")
    p.add_argument("--kill-worker-every-s", type=float, default=None, help="and again every this many seconds")
    p.add_argument("--max-rss-growth-mb", type=float, default=256.0, help="allowed RSS growth of the server tree")
    p.add_argument("--max-mismatch-rate", type=float, default=0.0,
                   help="allowed share of good requests whose text differs from the reference (0: greedy is "
                        "batch-invariant, as on the tiny CPU model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    args = p.parse_args(argv)
    if args.kill_worker_at_s is not None and args.workers != "process":
        p.error("--kill-worker-at-s needs --workers process (there is no worker process to kill inline)")
    if args.duration_s <= 0 or args.concurrency < 1:
        p.error("--duration-s must be > 0 and --concurrency >= 1")

    soak = Soak(args)
    shm_before = set(shm_segments("ft-"))
    checks: list[tuple[str, bool, str]] = []
    exit_code = None
    try:
        soak.start()
        soak.take_reference()
        rss_start = soak.rss_bytes()
        load_start, load_end = soak.run_load()
        settle_deadline = time.monotonic() + 15
        inside = soak.requests_inside()
        while inside > 0 and time.monotonic() < settle_deadline:
            time.sleep(0.1)
            inside = soak.requests_inside()
        rss_end = soak.rss_bytes()
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            exit_code = soak.stop()
        elif soak.proc is not None:
            exit_code = soak.proc.returncode
    leaked = [n for n in shm_segments(soak.store_name)] + \
        [n for n in set(shm_segments("ft-")) - shm_before if n.startswith("ft-soak-")]

    outcomes = soak.outcomes
    by_kind: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        o.result = soak.classify(o.result, o.started, o.started + o.latency_s)
        by_kind[o.kind].append(o)
    rows = []
    for kind in list(KINDS) + [k for k in by_kind if k not in KINDS]:
        os_ = by_kind.get(kind, [])
        lat = [o.latency_s * 1000 for o in os_ if o.result == "ok"]
        count = collections.Counter(o.result for o in os_)
        rows.append((kind, len(os_), count["ok"], count["wrong"], count["error"], count["outage"],
                     percentile(lat, 50), percentile(lat, 90), percentile(lat, 99)))
    total = len(outcomes)
    good = [o for o in outcomes if o.kind in ("completion", "stream", "chat", "sampled")]
    wrong = sum(1 for o in outcomes if o.result == "wrong")
    errors = sum(1 for o in outcomes if o.result == "error")
    mismatch_rate = sum(1 for o in good if o.result == "wrong") / max(1, len(good))
    growth_mb = (rss_end - rss_start) / 1e6
    kill_note = ", ".join(f"recovered in {r - k:.1f} s" if r else "NOT recovered" for k, r in soak.kills) or "none"
    checks.append(("requests answered", total > 0 and len(good) > 0, f"{total} requests, {len(good)} good"))
    checks.append(("greedy/seeded answers match the reference", mismatch_rate <= args.max_mismatch_rate,
                   f"mismatch rate {mismatch_rate:.4f}"))
    checks.append(("bad requests refused with a 4xx JSON error",
                   not any(o.result == "wrong" for o in by_kind.get("bad", [])), ""))
    checks.append(("no unexpected errors", errors == 0, f"{errors} errors"))
    checks.append(("no request left inside the server", inside == 0, f"{inside:g} running+waiting"))
    checks.append(("RSS growth bounded", growth_mb <= args.max_rss_growth_mb,
                   f"{rss_start / 1e6:.0f} -> {rss_end / 1e6:.0f} MB ({growth_mb:+.0f} MB, limit "
                   f"{args.max_rss_growth_mb:g})"))
    if args.kill_worker_at_s is not None:
        recovered = bool(soak.kills) and all(r is not None for _, r in soak.kills)
        after = [o for o in good if soak.kills and soak.kills[-1][1] and o.started > soak.kills[-1][1] + OUTAGE_GRACE_S
                 and o.result == "ok"]
        checks.append(("GPU worker killed, restarted, serving again", recovered and bool(after),
                       f"{len(soak.kills)} kill(s): {kill_note}; {len(after)} good answers after recovery"))
    checks.append(("SIGTERM stops the server with exit code 0", exit_code == 0, f"exit code {exit_code}"))
    checks.append(("no /dev/shm segment left", not leaked, ", ".join(leaked) or "none"))

    print(f"\nsoak: {args.workers} mode, {args.concurrency} clients, {load_end - load_start:.1f} s, "
          f"{total / max(1e-9, load_end - load_start):.1f} requests/s, error rate {errors / max(1, total):.4f}, "
          f"mismatches {wrong}, kills: {kill_note}")
    print(f"{'kind':<11} {'n':>6} {'ok':>6} {'wrong':>6} {'error':>6} {'outage':>6} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'p99 ms':>8}")
    for row in rows:
        print(f"{row[0]:<11} {row[1]:>6} {row[2]:>6} {row[3]:>6} {row[4]:>6} {row[5]:>6} {row[6]:>8.1f} "
              f"{row[7]:>8.1f} {row[8]:>8.1f}")
    print()
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}")
    examples = [o for o in outcomes if o.result in ("wrong", "error")][:5]
    for o in examples:
        print(f"  e.g. {o.kind} {o.result}: {o.detail[:300]}")
    if not all(ok for _, ok, _ in checks):
        print(f"\nserver log ({soak.log_path}), last lines:\n{soak.log_tail(2000)}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
                       "kinds": [dict(zip(("kind", "n", "ok", "wrong", "error", "outage", "p50_ms", "p90_ms",
                                           "p99_ms"), r)) for r in rows],
                       "requests_total": total, "errors": errors, "mismatch_rate": mismatch_rate,
                       "rss_start_bytes": rss_start, "rss_end_bytes": rss_end,
                       "kills": [{"at_s": k - load_start, "recovered_s": (r - k) if r else None}
                                 for k, r in soak.kills]}, fh, indent=1, default=str)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
