"""`ft serve`: the OpenAI-compatible HTTP API and the gRPC control plane around one engine.

    ft serve                                  # the embedded default model, CPU or GPU (auto)
    FT_API_KEY=... ft serve --model /models/Qwen3-30B-A3B --device cuda --host 0.0.0.0 --tls-cert C --tls-key K
    ft serve --attach --engine-addr ipc:///run/ft/engine.sock ...   # workers started by systemd
    ft serve --workers inline                 # the engine in this process (debugging, no restarts)

Listens on 127.0.0.1 unless --host says otherwise; a non-loopback address needs an API key ($FT_API_KEY or
--api-key-file: never on the command line, which `ps` shows everyone) or an explicit --insecure. SIGTERM / SIGINT drain: no new requests, the ones in flight finish (up to
--drain-timeout-s), then it stops (and stops its worker processes).

--workers process (the default): this process is the coordinator; it creates the shared-memory expert
store when the strategy needs one, starts `ft worker gpu` (and `ft worker cpu` for cpu/hybrid) as
supervised children and restarts them (coordinator/process_set.py). --attach: the same, but the workers
are started by someone else and connect. --workers inline: one process, the engine in a thread.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from ftexpert.coordinator.auth import add_api_key_flags
from ftexpert.proto.knobs import add_cli_flags, positive_int_flag, resolve

DEFAULT_PORT = 1919
DEFAULT_GRPC_PORT = 1920


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="DIR", help="model directory (Hugging Face layout); "
                       "default: the embedded default model, a small MoE trained on the bundled corpus")
    model.add_argument("--preset", default=None, help="model preset (random weights of a real model's shape)")
    model.add_argument("--served-model-name", default=None, help="model name clients use (default: the "
                       "directory's name, the preset, or 'tiny')")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    model.add_argument("--moe-strategy", default="resident", choices=("resident", "offload", "cpu", "hybrid"),
                       help="expert backend (docs/ARCHITECTURE.md)")
    model.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots (offload/hybrid)")
    model.add_argument("--max-running-requests", type=int, default=8, help="requests decoding together")
    model.add_argument("--max-context-tokens", type=int, default=None,
                       help="prompt + generated tokens per request (default: the model's, at most 32768)")
    model.add_argument("--prefill-chunk-tokens", type=positive_int_flag, default=None,
                       help="prompt tokens a prefill chunk takes (default: 4096; cpu/hybrid: the CPU share's token limit, 512); smaller chunks hold up other requests' decode steps for less time and need less memory, larger ones reach the first token sooner (offload: each chunk costs one pass over the experts)")
    net = parser.add_argument_group("listeners")
    net.add_argument("--host", default="127.0.0.1", help="HTTP address (default loopback)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    net.add_argument("--grpc-host", default=None, help="gRPC address (default: --host)")
    net.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port; -1 = no gRPC listener")
    add_api_key_flags(net)                   # HTTP and gRPC require the token when one is set
    net.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host / --grpc-host without an API key (refused otherwise)")
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
    procs.add_argument("--workers", default="process", choices=("process", "inline"),
                       help="process (default): the engine runs in a supervised `ft worker gpu` child, restarted "
                            "when it dies; inline: in a thread of this process (no isolation, no restarts)")
    procs.add_argument("--attach", action="store_true",
                       help="do not start workers: wait for independently started ones (systemd) to connect")
    procs.add_argument("--engine-addr", default=os.environ.get("FT_ENGINE_ADDR"),
                       help="ZMQ address of the engine link: ipc://PATH (its directory must be 0700, this user's) "
                            "or loopback tcp://127.0.0.1:PORT [env FT_ENGINE_ADDR; default: ipc://<runtime dir>/"
                            "engine.sock, the runtime dir being $RUNTIME_DIRECTORY or $XDG_RUNTIME_DIR/ft-<port>]")
    procs.add_argument("--store-name", default=os.environ.get("FT_STORE_NAME"),
                       help="name of the shared-memory expert store in /dev/shm (offload/cpu/hybrid) [env "
                            "FT_STORE_NAME; default ft-experts-<port>]")
    procs.add_argument("--num-cpu-workers", type=int, default=0,
                       help="CPU expert workers for cpu/hybrid (0 = one per NUMA node or core group)")
    procs.add_argument("--reserve-cpus", default=None, metavar="LIST",
                       help="cpu/hybrid: CPUs the CPU workers keep off and the GPU worker pins itself to "
                            "(--pin-gpu-worker; default: 0 on machines with >= 4 CPUs)")
    procs.add_argument("--on-worker-give-up", default="exit", choices=("exit", "stay"),
                       help="when the supervisor stops restarting a worker (it failed 6 times in a row, none "
                            "of them after a stable minute): exit (default: drain, stop, exit code 70, so systemd restarts the set) or stay "
                            "(keep serving; /health and requests answer 503 engine_failed)")
    procs.add_argument("--worker-ready-timeout-s", type=float, default=600.0,
                       help="start-up: how long a worker may take to say READY (loading included)")
    pol = parser.add_argument_group("fetch policy")
    pol.add_argument("--fetch-fraction", type=float, default=None,
                     help="fixed fetch fraction f in [0, 1] (default: from `ft bench bw`'s profile, then tuned)")
    pol.add_argument("--fetch-fraction-min", type=float, default=None, help="lower bound of f for the tuner")
    pol.add_argument("--fetch-fraction-max", type=float, default=None, help="upper bound of f for the tuner")
    pol.add_argument("--no-auto-tune", action="store_true", help="keep f fixed (no online re-tuning)")
    add_cli_flags(parser)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def build_policy_from_args(args: argparse.Namespace, expert_format, gpu_name: str):
    from ftexpert.coordinator.policy import DEFAULT_FRACTION_MAX, DEFAULT_FRACTION_MIN, PolicySettings, build_policy

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
        from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR

        args.model = str(DEFAULT_MODEL_DIR)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ftexpert.proto.sd_notify import process_notifier
    process_notifier().status("starting")         # (and the workers it starts do not inherit $NOTIFY_SOCKET)
    if args.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    use_default_model(args)
    if args.attach and args.workers == "inline":
        raise ValueError("--attach waits for worker processes; it cannot be combined with --workers inline")
    check_listeners(args)
    if args.workers == "inline":
        return run_inline(args)
    return run_processes(args)


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
    from ftexpert.coordinator.ports import check_listen_addresses

    check_listen_addresses(listen_addresses(args))


def serve_forever(server, listen, served_model_name: str, description: str) -> None:
    """Run the server until it stops; under systemd READY=1 once it listens (and its engine is READY), then
    WATCHDOG=1 and STATUS= from a task on the event loop (a blocked loop stops them)."""
    import asyncio

    from ftexpert.coordinator.server import run as run_loop
    from ftexpert.proto.sd_notify import process_notifier

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
        print(f"ft serve: {served_model_name} ({description}) on {listen.scheme}://{listen.host}:{server.http_port}/v1"
              f"{grpc_note}", file=sys.stderr, flush=True)
        await server.wait_closed()
        if task is not None:
            task.cancel()
        notifier.stopping("stopped")

    run_loop(main)


def listen_config(args: argparse.Namespace):
    """The listeners, checked before anything loads: the key (file or env), TLS files, exposure."""
    from ftexpert.coordinator.auth import resolve_api_key
    from ftexpert.coordinator.server import ListenConfig
    from ftexpert.coordinator.tls import TlsFiles
    from ftexpert.coordinator.tokenize_pool import DEFAULT_THREADS

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


def run_processes(args: argparse.Namespace) -> int:
    """The coordinator with its GPU worker (and CPU workers) as separate processes."""
    from ftexpert.coordinator.engine_factory import expert_format_of, served_name
    from ftexpert.coordinator.engine_service import EngineService
    from ftexpert.coordinator.openai_requests import ModelInfo
    from ftexpert.coordinator.process_set import ProcessSet, flags_an_attached_worker_ignores, options_from_serve_args
    from ftexpert.coordinator.server import CoordinatorServer
    from ftexpert.coordinator.text_codec import TextCodec
    from ftexpert.gpu_worker.api import open_model_source

    listen = listen_config(args)
    model_dir = os.path.abspath(args.model) if args.model else None
    source = open_model_source(model_dir, args.preset, device="cpu",      # tokenizer, config, expert source
                               expert_format=resolve({"expert_format": args.expert_format})["expert_format"])
    if source.tokenizer is None:
        raise FileNotFoundError(f"{model_dir or args.preset} has no tokenizer.json; the HTTP API needs one to turn "
                                f"text into tokens (put the model's tokenizer.json beside its weights)")
    codec = TextCodec.from_text_tokenizer(source.tokenizer, source.eos_token_ids)
    options = options_from_serve_args(args)
    for flag in flags_an_attached_worker_ignores(args):
        print(f"ft serve: warning: {flag} does not reach an attached GPU worker (it runs with its own flags: set "
              f"{flag} in its unit's flags (FT_GPU_WORKER_ARGS in ft.env), or, for a knob, the FREETOKEN_* variable "
              f"in its environment)", file=sys.stderr)
    procs = ProcessSet(options, source)

    def interrupted(signum, _frame):            # before the event loop takes the signals over
        raise KeyboardInterrupt(f"signal {signum} during start-up")

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = None
    from ftexpert.proto.sd_notify import process_notifier
    process_notifier().status("creating the expert store; waiting for the GPU worker to load and say READY")
    try:
        facts = procs.start()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        policy = build_policy_from_args(args, expert_format_of(source.cfg, source.expert_format.label),
                                        facts.gpu_name)
        service = EngineService(procs.engine_client(), codec.decode, policy=policy,
                                request_timeout_s=args.request_timeout_s,
                                max_pending_requests=args.max_pending_requests)
        name = served_name(model_dir, args.preset, args.served_model_name)
        model = ModelInfo(name, facts.max_context_tokens, codec)
        server = CoordinatorServer(service, model, policy, listen, supervisor=procs.supervisor)
        procs.on_gave_up = lambda name, message, gpu: server.worker_gave_up(name, message, gpu_worker=gpu)
        where = "attached" if args.attach else f"pid {facts.pid}"
        serve_forever(server, listen, name, f"{source.description}; GPU worker {where} on {facts.device}")
    finally:
        procs.stop()
    if server is not None and server.exit_code:
        print(f"ft serve: stopped: the supervisor gave up on a worker (exit code {server.exit_code})",
              file=sys.stderr)
        return server.exit_code
    print("ft serve: stopped", file=sys.stderr)
    return 0


def inline_hybrid_options(args: argparse.Namespace, environ=None):
    """HybridOptions of the inline engine (cpu/hybrid). Its process also runs the HTTP and gRPC servers, so it
    is pinned to the reserved CPUs only when asked (--pin-gpu-worker on, or FREETOKEN_PIN_GPU_WORKER set):
    the process mode's default (on) would squeeze the servers onto one core with the engine."""
    from ftexpert.gpu_worker.api import HybridOptions

    environ = os.environ if environ is None else environ
    flag = getattr(args, "pin_gpu_worker", None)
    asked = flag is not None or "FREETOKEN_PIN_GPU_WORKER" in environ
    pin = asked and resolve({"pin_gpu_worker": flag}, environ)["pin_gpu_worker"] == "on"
    return HybridOptions(reserve_cpus=getattr(args, "reserve_cpus", None), pin_gpu_worker=pin)


def run_inline(args: argparse.Namespace) -> int:
    """One process: the engine in a thread of the coordinator, over the host resources of the same owner as
    the process mode (coordinator/expert_resources.py)."""
    from ftexpert.coordinator.expert_resources import (HOST_STORE_STRATEGIES, CpuWorkerSettings, ExpertResources,
                                              reclaim_stale_host_memory)
    from ftexpert.coordinator.process_set import default_store_name

    from ftexpert.coordinator.generate_cli import prefetch_settings

    listen_config(args)                              # refused listeners fail before anything loads
    prefetch = prefetch_settings(args)
    if args.moe_strategy not in HOST_STORE_STRATEGIES:
        if prefetch is not None:
            raise ValueError(f"--moe-prefetch / --moe-prefetch-verify need a slot cache (--moe-strategy offload or "
                             f"hybrid), not {args.moe_strategy}")
        reclaim_stale_host_memory()               # what killed runs left, whatever their strategy
        return _run_inline(args, None)
    from ftexpert.gpu_worker.api import load_attached_model, open_model_source, resolve_device

    device = resolve_device(args.device)
    model_dir = os.path.abspath(args.model) if args.model else None
    source = open_model_source(model_dir, args.preset, device=device,
                               expert_format=resolve({"expert_format": args.expert_format})["expert_format"])
    cpu = CpuWorkerSettings(num_workers=args.num_cpu_workers, reserve_cpus=getattr(args, "reserve_cpus", None),
                            log_level=args.log_level, ready_timeout_s=args.worker_ready_timeout_s)
    resources = ExpertResources.create(source, args.moe_strategy, cpu=cpu,
                                       store_name=args.store_name or default_store_name(args.port),
                                       staging_device=device if device.type == "cuda" else None)
    try:
        resources.start_cpu_workers()
        hybrid = inline_hybrid_options(args) if args.moe_strategy in ("cpu", "hybrid") else None
        eviction = resolve({"eviction_freq_weight": args.eviction_freq_weight,
                            "eviction_freq_half_life": args.eviction_freq_half_life})
        loaded = load_attached_model(source, device, moe_strategy=args.moe_strategy, store_name=resources.store_name,
                                     cpu_channels=resources.channel_names, moe_cache_size=args.moe_cache_size,
                                     hybrid=hybrid, pin_driving_process=True, worker_info=resources.worker_info,
                                     freq_weight=eviction["eviction_freq_weight"],
                                     freq_half_life=eviction["eviction_freq_half_life"],
                                     prefetch=prefetch)
        return _run_inline(args, loaded)
    finally:
        resources.close()


def _run_inline(args: argparse.Namespace, loaded) -> int:
    from ftexpert.coordinator.engine_factory import load_served_engine
    from ftexpert.coordinator.engine_service import EngineService
    from ftexpert.coordinator.inline_engine import InlineEngine
    from ftexpert.coordinator.openai_requests import ModelInfo
    from ftexpert.coordinator.server import CoordinatorServer

    listen = listen_config(args)
    from ftexpert.kernels.pdl import apply_setting
    apply_setting(resolve({"pdl": args.pdl})["pdl"], args.device)
    overlap = resolve({"overlap_decode": args.overlap_decode})["overlap_decode"]
    served = load_served_engine(args.model, args.preset, args.device, moe_strategy=args.moe_strategy,
                                moe_cache_size=args.moe_cache_size, max_running_requests=args.max_running_requests,
                                max_context_tokens=args.max_context_tokens, served_model_name=args.served_model_name,
                                prefill_chunk_tokens=args.prefill_chunk_tokens, loaded=loaded,
                                expert_format=resolve({"expert_format": args.expert_format})["expert_format"],
                                hybrid=inline_hybrid_options(args),
                                overlap_decode=None if overlap == "auto" else overlap == "on",
                                slot_audit_every=resolve({"moe_slot_audit": args.moe_slot_audit})["moe_slot_audit"])
    policy = build_policy_from_args(args, served.expert_format, served.gpu_name)
    service = EngineService(InlineEngine(served.engine_factory), served.codec.decode, policy=policy,
                            request_timeout_s=args.request_timeout_s, max_pending_requests=args.max_pending_requests)
    model = ModelInfo(served.model_name, served.context_length, served.codec)
    server = CoordinatorServer(service, model, policy, listen)
    serve_forever(server, listen, served.model_name, f"{served.description}; engine in this process")
    print("ft serve: stopped", file=sys.stderr)
    return 0
