"""The coordinator process in one object: engine service + HTTP API + gRPC control plane + signals.

`ft serve` builds one and runs it until SIGTERM/SIGINT (or gRPC Shutdown): then it drains (stops
accepting, waits for requests in flight up to drain_timeout_s, aborts the rest), stops the
listeners, stops the engine thread, and returns. Tests build one around a fake engine.

Who may call: the HTTP API requires the API key when one is set (else it is open to whoever reaches its address:
loopback by default); the gRPC control plane always requires a key: the API key, or else the control key this
server makes and writes for its own user (coordinator/control_key.py), which `ft ctl` finds by itself.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ftexpert.coordinator.auth import check_exposure
from ftexpert.coordinator.control_key import ControlKey
from ftexpert.coordinator.engine_service import EngineService
from ftexpert.coordinator.grpc_server import GrpcServer
from ftexpert.coordinator.http_api import HttpApi
from ftexpert.coordinator.openai_requests import ModelInfo
from ftexpert.coordinator.policy import FetchPolicy
from ftexpert.coordinator.supervisor import EXIT_WORKERS_GAVE_UP  # the supervisor gave up: systemd restarts the set
from ftexpert.coordinator.tokenize_pool import DEFAULT_MAX_WAITING, DEFAULT_THREADS, TokenizePool
from ftexpert.coordinator.tls import TlsFiles
from ftexpert.proto.control_rpc import CONTROL_SERVICE

log = logging.getLogger("ft.coordinator.server")

DEFAULT_DRAIN_TIMEOUT_S = 30.0


@dataclass
class ListenConfig:
    host: str = "127.0.0.1"
    port: int = 1919
    grpc_host: str | None = None          # None: same as host
    grpc_port: int = 1920                 # 0 = a free port; -1 = no gRPC listener
    api_key: str | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    tokenizer_threads: int = DEFAULT_THREADS          # requests parsed and tokenized at once
    tokenizer_max_waiting: int = DEFAULT_MAX_WAITING  # more waiting for a thread; beyond: 503 + Retry-After
    exit_on_worker_give_up: bool = True   # the supervisor gave up on a worker: drain, stop, exit 70 (else stay up)
    insecure: bool = False                # allow a non-loopback listener without an API key
    tls: TlsFiles | None = None           # HTTPS and gRPC over TLS

    def check(self) -> list[str]:
        """ValueError for an HTTP listener off loopback without a key (unless insecure); else the warnings to print.
        (The gRPC listener is never without one: with no API key it requires the control key.)"""
        message = check_exposure(self.host, self.api_key, "HTTP API", self.insecure)
        return [message] if message else []

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"


class CoordinatorServer:
    def __init__(self, service: EngineService, model: ModelInfo, policy: FetchPolicy, listen: ListenConfig,
                 supervisor: Any = None, engine_worker: str | None = None):
        self.service = service
        self.supervisor = supervisor          # coordinator.supervisor.Supervisor of worker processes, if any
        self.engine_worker = engine_worker    # the supervised worker that runs the engine (process mode: gpu0)
        self.model = model
        self.policy = policy
        self.listen = listen
        self.drain_timeout_s = listen.drain_timeout_s
        self.tokenize = TokenizePool(listen.tokenizer_threads, listen.tokenizer_max_waiting)
        self.http = HttpApi(service, model, api_key=listen.api_key, tokenize=self.tokenize, workers=self.workers)
        self.exit_code = 0
        self.grpc: GrpcServer | None = None
        self.control_key: ControlKey | None = None    # the gRPC key when no API key is set
        self.loop: asyncio.AbstractEventLoop | None = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self._closed: asyncio.Event | None = None
        self._shutdown_task: asyncio.Task | None = None
        self.warnings: list[str] = []

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        grpc_host = self.listen.grpc_host or self.listen.host
        self.warnings = self.listen.check()
        for message in self.warnings:
            log.warning("%s", message)
        tls = self.listen.tls
        ssl_context = tls.http_context() if tls is not None else None
        await self.service.start()
        await asyncio.get_running_loop().run_in_executor(None, self.tokenize.start_threads)
        try:
            self.http_port = await self.http.start(self.listen.host, self.listen.port, ssl_context=ssl_context)
            if self.listen.grpc_port >= 0:
                self.control_key = None if self.listen.api_key else ControlKey()
                self.grpc = GrpcServer(self, self.listen.api_key or self.control_key.key, tls=tls)
                self.grpc_port = self.grpc.start(grpc_host, self.listen.grpc_port)
                if self.control_key is not None:
                    log.info("gRPC control key (no API key set): %s", self.control_key.write(self.grpc_port))
                    self.grpc.auth.refusal = self.control_key.refusal()
        except BaseException:
            if self.grpc is not None and self.grpc.port is not None:
                self.grpc.stop(0.0)
            if self.control_key is not None:
                self.control_key.remove()
            await self.http.stop()
            await self.service.stop()
            raise
        log.info("serving %s: %s on %s:%s, gRPC%s on %s:%s", self.model.name, self.listen.scheme.upper(),
                 self.listen.host, self.http_port, " (TLS)" if tls else "", grpc_host, self.grpc_port)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.loop.add_signal_handler(sig, self.request_shutdown, self.drain_timeout_s)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform without it
                pass

    def request_shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Begin drain-then-stop (idempotent). Call on the event loop."""
        if self._shutdown_task is None:
            timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
            log.info("shutting down: draining for up to %.1f s", timeout)
            self._shutdown_task = asyncio.ensure_future(self._shutdown(timeout))

    async def _shutdown(self, drain_timeout_s: float) -> None:
        try:
            finished, aborted = await self.service.drain(drain_timeout_s)
            log.info("drained: %d finished, %d aborted", finished, aborted)
            await self.http.stop()
            if self.grpc is not None:
                await asyncio.get_running_loop().run_in_executor(None, self.grpc.stop, 2.0)
            if self.control_key is not None:
                self.control_key.remove()
            await self.service.stop()
        finally:
            self.tokenize.shutdown()
            self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def serve_until_shutdown(self) -> None:
        await self.start()
        self.install_signal_handlers()
        await self.wait_closed()

    def worker_gave_up(self, name: str, message: str, *, gpu_worker: bool) -> None:
        """From the supervisor's thread: it stopped restarting worker `name`. Clients are told so (503
        `engine_failed`, no Retry-After) and /metrics shows it; by default the coordinator then drains and exits
        EXIT_WORKERS_GAVE_UP, so that its service manager restarts the whole set."""
        def on_loop() -> None:
            log.error("the supervisor gave up on worker %s: %s", name, message)
            if gpu_worker and hasattr(self.service.engine, "mark_gave_up"):
                self.service.engine.mark_gave_up(message)
            if self.listen.exit_on_worker_give_up:
                log.error("exiting with code %d so that the service manager restarts the process set "
                          "(--on-worker-give-up stay keeps serving instead)", EXIT_WORKERS_GAVE_UP)
                self.exit_code = EXIT_WORKERS_GAVE_UP
                self.request_shutdown()
        if self.loop is not None:
            self.loop.call_soon_threadsafe(on_loop)

    # -------------------------------------------------------------- control-plane hooks

    def workers(self) -> list[dict[str, Any]]:
        """Each worker process once. The engine is `engine` (inline, or a GPU worker attached from outside), or, when
        a supervised worker runs it, that worker's entry (the supervisor's view, with the engine link's last error
        while the supervisor has none of its own)."""
        supervised = self.supervisor.worker_info() if self.supervisor is not None else []
        engine = self.service.worker_info()
        for w in supervised:
            if w["name"] == self.engine_worker:
                w["last_error"] = w["last_error"] or engine[0]["last_error"]
                return supervised
        return engine + supervised

    def worker(self, name: str) -> dict[str, Any] | None:
        """The entry of worker `name`; `engine` names the engine's worker in every mode."""
        if name == "engine" and self.engine_worker is not None:
            name = self.engine_worker
        return next((w for w in self.workers() if w["name"] == name), None)

    async def restart_worker(self, name: str) -> None:
        if name == "engine":
            await self.service.restart_engine()
            return
        if self.supervisor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.supervisor.restart, name)
            return
        raise ValueError(f"worker {name!r} cannot be restarted here")

    def component_health(self) -> dict[str, bool]:
        s = self.service
        accepting = not (s.draining or s.stopped)
        components = {
            "": accepting and s.engine_healthy,
            CONTROL_SERVICE: not s.stopped,
            "engine": s.engine_healthy,
            "http": self.http._runner is not None and accepting,
        }
        for w in self.workers():
            components[f"worker/{w['name']}"] = w["state"] == "ready"
        return components


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (faster sockets), else asyncio's default loop."""
    try:
        # optional: uvloop where installed
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main())


class BackgroundServer:
    """Runs a CoordinatorServer on its own event loop in a thread (tests, embedding)."""

    def __init__(self, build: Callable[[], CoordinatorServer]):
        self._build = build
        self.server: CoordinatorServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ft-coordinator", daemon=True)

    def _main(self) -> None:
        async def body() -> None:
            try:
                self.server = self._build()
                await self.server.start()
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait_closed()
        run(body)

    def start(self, timeout_s: float = 60.0) -> CoordinatorServer:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the coordinator did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self.server

    def stop(self, drain_timeout_s: float = 5.0, timeout_s: float = 30.0) -> None:
        if self.server is not None and self.server.loop is not None and self._thread.is_alive():
            self.server.loop.call_soon_threadsafe(self.server.request_shutdown, drain_timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the coordinator did not stop within {timeout_s} s")
