"""`ft serve`: the OpenAI-compatible HTTP API and the gRPC control plane around one engine.

    ft serve                                  # the embedded default model, CPU or GPU (auto)
    FT_API_KEY=... ft serve --model /models/Qwen3-30B-A3B --device cuda --host 0.0.0.0 --tls-cert C --tls-key K
    ft serve --attach --engine-addr ipc:///run/ft/engine.sock ...   # workers started by systemd
    ft serve --workers inline                 # the engine in this process (debugging, no restarts)

Listens on 127.0.0.1 unless --host says otherwise; a non-loopback HTTP address needs an API key ($FT_API_KEY or
--api-key-file: never on the command line, which `ps` shows everyone) or an explicit --insecure. Without an API key
the gRPC control plane requires a key this process writes for its own user, which `ft ctl` of that user finds
(coordinator/control_key.py). SIGTERM / SIGINT drain: no new requests, the ones in flight finish (up to
--drain-timeout-s), then it stops (and stops its worker processes).

--workers process (the default): this process is the coordinator and imports neither torch nor the model-loading
code: a short-lived `ft worker store` child opens the model and reports its facts (tokenizer, vocabulary, the
experts' shape) and fills the shared-memory expert store this process creates when the strategy needs one; then
it starts `ft worker gpu` (and `ft worker cpu` for cpu/hybrid) as supervised children and restarts them
(coordinator/process_set.py). --attach: the same, but the GPU worker is started by someone else and connects.
--workers inline: one process, the engine in a thread.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

from ftexpert.coordinator.auth import add_api_key_flags, resolve_api_key
from ftexpert.coordinator.openai_requests import ModelInfo
from ftexpert.coordinator.policy import DEFAULT_FRACTION_MAX, DEFAULT_FRACTION_MIN, PolicySettings, build_policy
from ftexpert.coordinator.ports import check_listen_addresses
from ftexpert.coordinator.tls import TlsFiles
from ftexpert.coordinator.tokenize_pool import DEFAULT_THREADS
from ftexpert.proto.cli_flags import add_fetch_fraction_flag, add_log_level_flag, add_workers_flag
from ftexpert.proto.engine_spec import DEFAULT_MODEL_DIR, EngineSpec, add_engine_flags, spec_from_args
from ftexpert.proto.knobs import add_cli_flag, positive_int_flag, resolve
from ftexpert.proto.sd_notify import process_notifier

DEFAULT_PORT = 1919
DEFAULT_GRPC_PORT = 1920


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser)                 # the model, the experts, the engine: proto/engine_spec.py
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the "
                        "directory's name, the preset, or 'tiny')")
    net = parser.add_argument_group("listeners")
    net.add_argument("--host", default="127.0.0.1", help="HTTP address (default loopback)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    net.add_argument("--grpc-host", default=None, help="gRPC address (default: --host)")
    net.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port; -1 = no gRPC listener")
    add_api_key_flags(net)                   # HTTP and gRPC require the token when one is set
    net.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host without an API key (refused otherwise; gRPC then still "
                          "requires the control key that ft serve writes for its own user)")
    net.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS and gRPC over TLS: certificate chain")
    net.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key (with --tls-cert)")
    net.add_argument("--drain-timeout-s", type=float, default=30.0, help="how long SIGTERM waits for requests")
    net.add_argument("--request-timeout-s", type=float, default=600.0, help="longest a request may run")
    net.add_argument("--max-pending-requests", type=int, default=512,
                     help="requests accepted at once (running + queued); beyond: HTTP 503 with Retry-After")
    net.add_argument("--tokenizer-threads", type=positive_int_flag, default=None,
                     help="requests parsed and tokenized at once, off the event loop (default: half the CPUs, 1-4)")
    net.add_argument("--tokenizer-max-waiting", type=int, default=16,
                     help="more requests waiting for a tokenizer thread; beyond: HTTP 503 with Retry-After")
    procs = parser.add_argument_group("worker processes")
    add_workers_flag(procs)
    procs.add_argument("--attach", action="store_true",
                       help="do not start workers: wait for independently started ones (systemd) to connect")
    procs.add_argument("--engine-addr", default=os.environ.get("FT_ENGINE_ADDR"),
                       help="ZMQ address of the engine link: ipc://PATH (its directory must be 0700, this user's) "
                            "or loopback tcp://127.0.0.1:PORT [env FT_ENGINE_ADDR; default: ipc://<runtime dir>/"
                            "engine.sock, the runtime dir being $RUNTIME_DIRECTORY or $XDG_RUNTIME_DIR/ft-<port>]")
    procs.add_argument("--store-name", default=os.environ.get("FT_STORE_NAME"),
                       help="name of the shared-memory expert store in /dev/shm (offload/cpu/hybrid) [env "
                            "FT_STORE_NAME; default ft-experts-<port>]")
    procs.add_argument("--on-worker-give-up", default="exit", choices=("exit", "stay"),
                       help="when the supervisor stops restarting a worker (it failed 6 times in a row, none "
                            "of them after a stable minute): exit (default: drain, stop, exit code 70, so systemd restarts the set) or stay "
                            "(keep serving; /health and requests answer 503 engine_failed)")
    procs.add_argument("--worker-ready-timeout-s", type=float, default=600.0,
                       help="start-up: how long a worker may take to say READY (loading included)")
    pol = parser.add_argument_group("fetch policy")
    add_fetch_fraction_flag(pol)
    pol.add_argument("--fetch-fraction-min", type=float, default=None, help="lower bound of f for the tuner")
    pol.add_argument("--fetch-fraction-max", type=float, default=None, help="upper bound of f for the tuner")
    pol.add_argument("--no-auto-tune", action="store_true", help="keep f fixed (no online re-tuning)")
    add_cli_flag(pol, "fetch_round")
    add_cli_flag(pol, "benchbw_path")
    add_log_level_flag(parser)


def build_policy_from_args(args: argparse.Namespace, expert_format, gpu_name: str):
    knobs = resolve({k: getattr(args, k, None) for k in ("fetch_round", "benchbw_path")})
    given = args.fetch_fraction
    # the tuner's default bounds widen to a fixed --fetch-fraction (0 = every miss on the CPU pool): it is used as
    # given; bounds given explicitly that exclude it are an error (PolicySettings.validate)
    low = DEFAULT_FRACTION_MIN if given is None else min(DEFAULT_FRACTION_MIN, given)
    high = DEFAULT_FRACTION_MAX if given is None else max(DEFAULT_FRACTION_MAX, given)
    settings = PolicySettings(
        strategy=args.moe_strategy,
        fetch_fraction=given if given is not None else 0.5,
        fetch_fraction_min=args.fetch_fraction_min if args.fetch_fraction_min is not None else low,
        fetch_fraction_max=args.fetch_fraction_max if args.fetch_fraction_max is not None else high,
        auto_tune=not args.no_auto_tune and args.fetch_fraction is None,
        fetch_round=knobs["fetch_round"])
    settings.validate()
    return build_policy(settings, fraction_given=args.fetch_fraction is not None,
                        benchbw_path=knobs["benchbw_path"], expert_format=expert_format, gpu_name=gpu_name)


def use_default_model(args: argparse.Namespace) -> None:
    """Neither --model nor --preset: the embedded default model (a small trained MoE in the package)."""
    if not args.model and not args.preset:
        args.model = str(DEFAULT_MODEL_DIR)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    process_notifier().status("starting")         # (and the workers it starts do not inherit $NOTIFY_SOCKET)
    use_default_model(args)
    if args.attach and args.workers == "inline":
        raise ValueError("--attach waits for worker processes; it cannot be combined with --workers inline")
    check_listeners(args)
    if args.workers == "inline":
        return run_inline(args, inline_spec(args))
    return run_processes(args, spec_from_args(args))


def listen_addresses(args: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """Every TCP address `ft serve` will listen on: HTTP (and /metrics), gRPC, the engine link's tcp:// port."""
    out = [("the HTTP API", args.host, args.port, "--port")]
    if args.grpc_port >= 0:
        out.append(("the gRPC control plane", args.grpc_host or args.host, args.grpc_port, "--grpc-port"))
    if args.workers == "process":
        addr = args.engine_addr or ""             # (the default is an ipc:// socket: no port to check)
        if addr.startswith("tcp://") and ":" in addr[len("tcp://"):]:
            host, _, port = addr[len("tcp://"):].rpartition(":")
            if port.isdigit():
                out.append(("the engine link", host.strip("[]"), int(port), "--engine-addr"))
    return out


def check_listeners(args: argparse.Namespace) -> None:
    """Before the model loads: a taken port is found in a second, not after minutes of loading."""
    check_listen_addresses(listen_addresses(args))


def serve_forever(server, listen, served_model_name: str, description: str) -> None:
    """Run the server until it stops; under systemd READY=1 once it listens (and its engine is READY), then
    WATCHDOG=1 and STATUS= from a task on the event loop (a blocked loop stops them)."""
    from ftexpert.coordinator.server import run as run_loop      # lazy: aiohttp and gRPC load only to serve

    notifier = process_notifier()

    async def notify_loop(where: str) -> None:
        period_s = min(1.0, (notifier.watchdog_interval_s or 4.0) / 4)
        while True:
            service = server.service
            notifier.status("draining" if service.draining else f"serving on {where}" if service.engine_healthy
                            else "the engine is not ready (waiting for the GPU worker)")
            notifier.watchdog()
            await asyncio.sleep(period_s)

    async def main() -> None:
        await server.start()
        server.install_signal_handlers()
        where = f"{listen.scheme}://{listen.host}:{server.http_port}"
        notifier.ready(f"serving on {where}")
        task = asyncio.ensure_future(notify_loop(where)) if notifier.enabled else None
        for message in server.warnings:
            print(message, file=sys.stderr)
        grpc_note = (f", gRPC{' (TLS)' if listen.tls else ''} on {listen.grpc_host or listen.host}:{server.grpc_port}"
                     if server.grpc_port else "")
        if server.control_key is not None:            # no API key: ft ctl of this user reads this one
            grpc_note += f" (control key {server.control_key.path})"
        print(f"ft serve: {served_model_name} ({description}) on {listen.scheme}://{listen.host}:{server.http_port}/v1"
              f"{grpc_note}", file=sys.stderr, flush=True)
        await server.wait_closed()
        if task is not None:
            task.cancel()
        notifier.stopping("stopped")

    run_loop(main)


def listen_config(args: argparse.Namespace):
    """The listeners, checked before anything loads: the key (file or env), TLS files, exposure."""
    from ftexpert.coordinator.server import ListenConfig         # lazy: aiohttp and gRPC load only to serve

    listen = ListenConfig(host=args.host, port=args.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
                          api_key=resolve_api_key(args.api_key_file), drain_timeout_s=args.drain_timeout_s,
                          insecure=args.insecure, tls=TlsFiles.from_flags(args.tls_cert, args.tls_key),
                          tokenizer_threads=args.tokenizer_threads or DEFAULT_THREADS,
                          tokenizer_max_waiting=args.tokenizer_max_waiting,
                          exit_on_worker_give_up=args.on_worker_give_up == "exit")
    listen.check()
    if listen.tls is not None:
        listen.tls.http_context()                 # a certificate that does not load fails here, not after loading
    return listen


def run_processes(args: argparse.Namespace, spec: EngineSpec) -> int:
    """The coordinator with its GPU worker (and CPU workers) as separate processes. This process imports no
    torch: `ft worker store` opens the model for it (tests/coordinator/test_process_boundary.py checks)."""
    # lazy: the server's stack (aiohttp, gRPC, ZMQ, numpy) loads only to serve (`ft --help` start-up time)
    from ftexpert.coordinator.engine_factory import codec_of, expert_format_of, served_name
    from ftexpert.coordinator.engine_service import EngineService
    from ftexpert.coordinator.process_set import ProcessSet, options_from_serve_args
    from ftexpert.coordinator.server import CoordinatorServer

    listen = listen_config(args)
    procs = ProcessSet(options_from_serve_args(args, spec))

    def interrupted(signum, _frame):            # before the event loop takes the signals over
        raise KeyboardInterrupt(f"signal {signum} during start-up")

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    notifier = process_notifier()
    try:
        notifier.status("opening the model (ft worker store); filling the expert store where the strategy has one")
        model = procs.open_model()
        codec = codec_of(model)
        notifier.status("waiting for the GPU worker to load and say READY")
        facts = procs.start()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        policy = build_policy_from_args(args, expert_format_of(model), facts.gpu_name)
        service = EngineService(procs.engine_client(), codec.decode, policy=policy,
                                request_timeout_s=args.request_timeout_s,
                                max_pending_requests=args.max_pending_requests)
        name = served_name(spec.model, spec.preset, args.served_model_name)
        server = CoordinatorServer(service, ModelInfo(name, facts.max_context_tokens, codec), policy, listen,
                                   supervisor=procs.supervisor, engine_worker=procs.engine_worker)
        procs.on_gave_up = lambda name, message, gpu: server.worker_gave_up(name, message, gpu_worker=gpu)
        where = "attached" if args.attach else f"pid {facts.pid}"
        serve_forever(server, listen, name, f"{model.description}; GPU worker {where} on {facts.device}")
    finally:
        procs.stop()
    if server is not None and server.exit_code:
        print(f"ft serve: stopped: the supervisor gave up on a worker (exit code {server.exit_code})",
              file=sys.stderr)
        return server.exit_code
    print("ft serve: stopped", file=sys.stderr)
    return 0


def inline_spec(args: argparse.Namespace, environ=None) -> EngineSpec:
    """The inline engine's spec. Its process also runs the HTTP and gRPC servers, so it pins itself to the
    reserved CPUs (cpu / hybrid) only when asked (--pin-gpu-worker, or FREETOKEN_PIN_GPU_WORKER set): the
    process mode's default (on) would squeeze the servers onto one core with the engine."""
    environ = os.environ if environ is None else environ
    asked = getattr(args, "pin_gpu_worker", None) is not None or "FREETOKEN_PIN_GPU_WORKER" in environ
    spec = spec_from_args(args, environ)
    return spec if asked else dataclasses.replace(spec, pin_gpu_worker="off")


def run_inline(args: argparse.Namespace, spec: EngineSpec) -> int:
    """One process: the engine in a thread of the coordinator, built by the GPU worker's `build_engine` over the
    host resources of the same owner as the process mode (coordinator/expert_resources.py)."""
    # lazy: the server's stack, and torch with the GPU worker, load only for an inline serve (start-up time)
    from ftexpert.coordinator.engine_factory import served_engine
    from ftexpert.coordinator.engine_service import EngineService
    from ftexpert.coordinator.expert_resources import (HOST_STORE_STRATEGIES, CpuWorkerSettings, ExpertResources,
                                                       reclaim_stale_host_memory)
    from ftexpert.coordinator.inline_engine import InlineEngine
    from ftexpert.coordinator.process_set import default_store_name
    from ftexpert.coordinator.server import CoordinatorServer
    from ftexpert.gpu_worker.api import Attachment, build_engine, open_model_source, resolve_device

    listen = listen_config(args)                     # refused listeners fail before anything loads
    resources = None
    try:
        if spec.moe_strategy in HOST_STORE_STRATEGIES:
            device = resolve_device(spec.device)
            source = open_model_source(spec.model, spec.preset, dtype=spec.dtype, seed=spec.seed_weights,
                                       device=device, expert_format=spec.expert_format)
            cpu = CpuWorkerSettings(num_workers=spec.num_cpu_workers, reserve_cpus=spec.reserve_cpus,
                                    act_quant=spec.cpu_act_quant,
                                    log_level=args.log_level, ready_timeout_s=args.worker_ready_timeout_s)
            resources = ExpertResources.create(source, spec.moe_strategy, cpu=cpu,
                                               store_name=args.store_name or default_store_name(args.port),
                                               staging_device=device if device.type == "cuda" else None)
            resources.start_cpu_workers()
            built = build_engine(spec, source=source, attachment=Attachment(
                resources.store_name, tuple(resources.channel_names), resources.worker_info))
        else:
            reclaim_stale_host_memory()               # what killed runs left, whatever their strategy
            built = build_engine(spec)
        try:
            served = served_engine(built, spec, args.served_model_name)
            policy = build_policy_from_args(args, served.expert_format, served.gpu_name)
            service = EngineService(InlineEngine(served.engine_factory), served.codec.decode, policy=policy,
                                    request_timeout_s=args.request_timeout_s,
                                    max_pending_requests=args.max_pending_requests)
            model = ModelInfo(served.model_name, served.context_length, served.codec)
            server = CoordinatorServer(service, model, policy, listen)
            serve_forever(server, listen, served.model_name, f"{served.description}; engine in this process")
        finally:
            built.close()
    finally:
        if resources is not None:
            resources.close()
    print("ft serve: stopped", file=sys.stderr)
    return 0
