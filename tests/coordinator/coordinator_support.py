"""Helpers for the coordinator tests: a byte-level tokenizer model dir, a fake engine with the engine's
contract (gpu_worker/worker_loop.py StepEngine: add_request / step / abort / has_work / set_policy / stats /
scheduler), and a live server on 127.0.0.1 that serves it as `--workers inline` does (InlineEngine)."""
from __future__ import annotations

import json
import os
import random
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ftexpert.coordinator.engine_service import EngineService
from ftexpert.coordinator.inline_engine import InlineEngine
from ftexpert.coordinator.logprobs import bytes_to_unicode
from ftexpert.coordinator.openai_requests import ModelInfo
from ftexpert.coordinator.policy import FetchPolicy, PolicySettings
from ftexpert.proto.bandwidth_profile import ExpertFormat
from ftexpert.coordinator.server import BackgroundServer, CoordinatorServer, ListenConfig
from ftexpert.coordinator.text_codec import TextCodec
from ftexpert.coordinator.ports import free_loopback_port  # noqa: E402

MODEL_NAME = "tiny-test"
CONTEXT_LENGTH = 256
FAKE_TEXT = "Hello world! The quick brown fox jumps over the lazy dog. "
EOS_TOKEN = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_model_dir(path: str, chat_template: str = CHATML_TEMPLATE, specials: tuple[str, ...] = (),
                         stop_tokens: tuple[str, ...] = ()) -> str:
    """tokenizer.json (byte-level, token id == byte value, 3 specials and `specials` from id 259),
    tokenizer_config.json (`chat_template`), configs (generation_config.json's eos ids: `stop_tokens`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, "<|im_start|>", "<|im_end|>", *specials])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    if stop_tokens:
        with open(os.path.join(path, "generation_config.json"), "w") as fh:
            json.dump({"eos_token_id": [tok.token_to_id(t) for t in stop_tokens]}, fh)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"chat_template": chat_template, "eos_token": EOS_TOKEN, "bos_token": None}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({"max_position_embeddings": CONTEXT_LENGTH}, fh)
    return path


@dataclass
class FakeRequest:
    prompt_ids: list[int]
    params: Any
    produced: int = 0
    rng: random.Random = field(default_factory=random.Random)


class FakeEngine:
    """Engine stand-in: one token per running request per step, from FAKE_TEXT's bytes (or random letters
    when temperature > 0 and a seed is given). Thread-checked: only one thread may call it, as with the real
    engine."""

    def __init__(self, max_running: int = 8, step_delay_s: float = 0.0, eos_after: int | None = None,
                 eos_id: int = 256, context_length: int = CONTEXT_LENGTH, text: str = FAKE_TEXT,
                 token_ids: list[int] | None = None):
        self.context_length = context_length
        self.token_ids = token_ids          # a script of ids (special tokens too) instead of `text`'s bytes
        self.max_running = max_running
        self.step_delay_s = step_delay_s
        self.text = text.encode()
        self.eos_after = eos_after
        self.eos_id = eos_id
        self.waiting: list[int] = []
        self.running: dict[int, FakeRequest] = {}
        self.requests: dict[int, FakeRequest] = {}
        self.aborted: list[int] = []
        self.finished: list[int] = []
        self.fail_next_steps = 0
        self.policy_calls: list[dict] = []
        self.cpu_workers: dict[str, dict] = {}
        self._thread: int | None = None
        self.counters = {"decode_tokens_total": 0, "steps_total": 0, "expert_hits_total": 0,
                         "expert_misses_total": 0, "experts_fetched_total": 0, "cpu_experts_total": 0,
                         "copy_bytes_total": 0, "copy_time_s_total": 0.0, "cpu_expert_time_s_total": 0.0}

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "engine called from two threads"

    @property
    def scheduler(self) -> "FakeEngine":
        """Its own scheduler: `running` and `waiting` are the queue depths."""
        return self

    def add_request(self, prompt_ids, params, request_id) -> int:
        self._check_thread()
        if len(prompt_ids) >= self.context_length:
            raise ValueError("prompt longer than the context")
        rid = request_id
        req = FakeRequest(list(prompt_ids), params)
        if params.seed is not None:
            req.rng.seed(params.seed)
        self.requests[rid] = req
        self.waiting.append(rid)
        return rid

    def abort(self, rid) -> None:
        self._check_thread()
        self.aborted.append(rid)
        self.running.pop(rid, None)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def has_work(self) -> bool:
        self._check_thread()
        return bool(self.waiting or self.running)

    def _token(self, req: FakeRequest) -> int:
        if req.params.temperature > 0 and req.params.seed is not None:
            return req.rng.choice(b"abcdefghijklmnopqrstuvwxyz ")
        if self.token_ids is not None:
            return self.token_ids[req.produced % len(self.token_ids)]
        return self.text[req.produced % len(self.text)]

    def step(self):
        self._check_thread()
        if self.fail_next_steps > 0:
            self.fail_next_steps -= 1
            raise RuntimeError("simulated CUDA error")
        while self.waiting and len(self.running) < self.max_running:
            rid = self.waiting.pop(0)
            self.running[rid] = self.requests[rid]
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        out = []
        for rid, req in list(self.running.items()):
            p = req.params
            if self.eos_after is not None and req.produced >= self.eos_after and not p.ignore_eos:
                token = self.eos_id
            else:
                token = self._token(req)
            req.produced += 1
            reason = None
            if token in p.stop_token_ids:
                reason = "stop"
            elif req.produced >= p.max_new_tokens:
                reason = "length"
            if reason:
                del self.running[rid]
                self.finished.append(rid)
            out.append((rid, token, reason is not None, reason))
        c = self.counters
        c["steps_total"] += 1
        c["decode_tokens_total"] += len(out)
        c["expert_hits_total"] += 6 * len(out)
        c["expert_misses_total"] += 2 * len(out)
        c["experts_fetched_total"] += len(out)
        c["cpu_experts_total"] += len(out)
        c["copy_bytes_total"] += 1_000_000 * len(out)
        c["copy_time_s_total"] += 50e-6 * len(out)
        c["cpu_expert_time_s_total"] += 100e-6 * len(out)
        # two CPU workers: cpu0 computes 3 experts a token at 100 us each, cpu1 1 at 300 us
        for name, experts, seconds in (("cpu0", 3, 100e-6), ("cpu1", 1, 300e-6)):
            w = self.cpu_workers.setdefault(name, {"experts_total": 0, "time_s_total": 0.0})
            w["experts_total"] += experts * len(out)
            w["time_s_total"] += experts * seconds * len(out)
        return out

    def set_policy(self, **fields) -> None:
        self._check_thread()
        self.policy_calls.append(fields)

    @property
    def stats(self) -> dict:
        return {**self.counters, "cpu_workers": {n: dict(w) for n, w in self.cpu_workers.items()}}


free_port = free_loopback_port


@dataclass
class LiveServer:
    server: CoordinatorServer
    engine_box: list
    base_url: str
    grpc_address: str
    model_dir: str

    @property
    def engine(self) -> FakeEngine:
        return self.engine_box[-1]

    def wait_for(self, predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.01)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


TINY_CONTEXT_LENGTH = 512
_TINY_CACHE: dict = {}


def tiny_served_engine(model: str | None = None):
    """The real engine on the tiny model (random weights), or on the checkpoint `model` (e.g. the embedded default
    model, trained), CPU, loaded once per test session."""
    if model not in _TINY_CACHE:
        from ftexpert.coordinator.engine_factory import served_engine
        from ftexpert.gpu_worker.api import build_engine
        from ftexpert.proto.engine_spec import EngineSpec
        spec = EngineSpec(device="cpu", model=model, max_running_requests=4, max_context_tokens=TINY_CONTEXT_LENGTH)
        _TINY_CACHE[model] = served_engine(build_engine(spec), spec)
    return _TINY_CACHE[model]


@contextmanager
def live_server(tmp_path, *, api_key: str | None = None, engine_kwargs: dict | None = None,
                request_timeout_s: float = 60.0, max_pending_requests: int = 256, grpc: bool = True,
                drain_timeout_s: float = 5.0, real_engine: bool = False, context_length: int = CONTEXT_LENGTH,
                tls=None, supervisor=None, engine_worker: str | None = None, model: str | None = None,
                chat_template: str = CHATML_TEMPLATE, specials: tuple[str, ...] = (),
                stop_tokens: tuple[str, ...] = ()):
    """A CoordinatorServer on 127.0.0.1 (free ports) around the fake engine, or the real tiny one (`model`: a real
    engine on that checkpoint instead; `supervisor`, `engine_worker`: as process mode passes them)."""
    model_dir = write_tiny_model_dir(os.path.join(str(tmp_path), "model"), chat_template, specials, stop_tokens)
    box: list = []
    if real_engine:
        served = tiny_served_engine(model)
        codec, context_length = served.codec, served.context_length

        def factory():
            box.append(served.engine_factory())
            return box[-1]
    else:
        codec = TextCodec.from_model_dir(model_dir)

        def factory() -> FakeEngine:
            box.append(FakeEngine(eos_id=codec.eos_token_ids[0], context_length=context_length,
                                  **(engine_kwargs or {})))
            return box[-1]

    def build() -> CoordinatorServer:
        policy = FetchPolicy(PolicySettings(), expert_format=ExpertFormat("bf16", 64, 32))
        service = EngineService(InlineEngine(factory), codec.decode, policy=policy,
                                request_timeout_s=request_timeout_s, max_pending_requests=max_pending_requests)
        model = ModelInfo(MODEL_NAME, context_length, codec)
        listen = ListenConfig(host="127.0.0.1", port=0, grpc_port=0 if grpc else -1, api_key=api_key,
                              drain_timeout_s=drain_timeout_s, tls=tls)
        return CoordinatorServer(service, model, policy, listen, supervisor=supervisor, engine_worker=engine_worker)

    bg = BackgroundServer(build)
    server = bg.start()
    try:
        yield LiveServer(server, box, f"{server.listen.scheme}://127.0.0.1:{server.http_port}",
                         f"127.0.0.1:{server.grpc_port}", model_dir)
    finally:
        bg.stop(drain_timeout_s=1.0)
