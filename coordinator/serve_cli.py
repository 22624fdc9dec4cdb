"""`ft serve`: the OpenAI-compatible HTTP API and the gRPC control plane around one engine.

    ft serve                                  # the embedded tiny model, CPU or GPU (auto)
    ft serve --model /models/Qwen3-30B-A3B --device cuda --api-key "$KEY"

Listens on 127.0.0.1 unless --host says otherwise (a non-loopback address without --api-key prints a
warning). SIGTERM / SIGINT drain: no new requests, the ones in flight finish (up to
--drain-timeout-s), then it stops. The engine runs in-process, in its own thread.
"""
from __future__ import annotations

import argparse
import logging
import sys

from proto.knobs import add_cli_flags, resolve

DEFAULT_PORT = 1919
DEFAULT_GRPC_PORT = 1920


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="DIR", help="model directory (Hugging Face layout); "
                       "default: the embedded tiny model")
    model.add_argument("--preset", default=None, help="model preset (random weights of a real model's shape)")
    model.add_argument("--served-model-name", default=None, help="model name clients use (default: the "
                       "directory's name, the preset, or 'tiny')")
    model.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the model runs")
    model.add_argument("--moe-strategy", default="resident", choices=("resident", "offload", "cpu", "hybrid"),
                       help="expert backend (see DESIGN.md section 1)")
    model.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots (offload/hybrid)")
    model.add_argument("--max-running-requests", type=int, default=8, help="requests decoding together")
    model.add_argument("--max-context-tokens", type=int, default=None,
                       help="prompt + generated tokens per request (default: the model's, at most 32768)")
    net = parser.add_argument_group("listeners")
    net.add_argument("--host", default="127.0.0.1", help="HTTP address (default loopback)")
    net.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port")
    net.add_argument("--grpc-host", default=None, help="gRPC address (default: --host)")
    net.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port; -1 = no gRPC listener")
    net.add_argument("--api-key", default=None, help="bearer token required by HTTP and gRPC [env FT_API_KEY]")
    net.add_argument("--drain-timeout-s", type=float, default=30.0, help="how long SIGTERM waits for requests")
    net.add_argument("--request-timeout-s", type=float, default=600.0, help="longest a request may run")
    net.add_argument("--max-pending-requests", type=int, default=512,
                     help="requests accepted at once (running + queued); beyond: HTTP 503")
    pol = parser.add_argument_group("fetch policy")
    pol.add_argument("--fetch-fraction", type=float, default=None,
                     help="fixed fetch fraction f in [0, 1] (default: from `ft bench bw`'s profile, then tuned)")
    pol.add_argument("--fetch-fraction-min", type=float, default=None, help="lower bound of f for the tuner")
    pol.add_argument("--fetch-fraction-max", type=float, default=None, help="upper bound of f for the tuner")
    pol.add_argument("--no-auto-tune", action="store_true", help="keep f fixed (no online re-tuning)")
    add_cli_flags(parser)
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def build_policy_from_args(args: argparse.Namespace, expert_format, gpu_name: str):
    from coordinator.policy import DEFAULT_FRACTION_MAX, DEFAULT_FRACTION_MIN, PolicySettings, build_policy

    knobs = resolve({k: getattr(args, k, None) for k in ("fetch_round", "fetch_select", "moe_prefetch",
                                                         "moe_prefetch_budget", "benchbw_path")})
    settings = PolicySettings(
        strategy=args.moe_strategy,
        fetch_fraction=args.fetch_fraction if args.fetch_fraction is not None else 0.5,
        fetch_fraction_min=args.fetch_fraction_min if args.fetch_fraction_min is not None else DEFAULT_FRACTION_MIN,
        fetch_fraction_max=args.fetch_fraction_max if args.fetch_fraction_max is not None else DEFAULT_FRACTION_MAX,
        auto_tune=not args.no_auto_tune and args.fetch_fraction is None,
        fetch_round=knobs["fetch_round"], fetch_select=knobs["fetch_select"], moe_prefetch=knobs["moe_prefetch"],
        moe_prefetch_budget=knobs["moe_prefetch_budget"])
    settings.validate()
    return build_policy(settings, fraction_given=args.fetch_fraction is not None,
                        benchbw_path=knobs["benchbw_path"], expert_format=expert_format, gpu_name=gpu_name)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from coordinator.auth import resolve_api_key
    from coordinator.engine_factory import load_served_engine
    from coordinator.engine_service import EngineService
    from coordinator.openai_requests import ModelInfo
    from coordinator.server import CoordinatorServer, ListenConfig, run as run_loop

    if args.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    api_key = resolve_api_key(args.api_key)
    served = load_served_engine(args.model, args.preset, args.device, moe_strategy=args.moe_strategy,
                                moe_cache_size=args.moe_cache_size, max_running_requests=args.max_running_requests,
                                max_context_tokens=args.max_context_tokens, served_model_name=args.served_model_name)
    policy = build_policy_from_args(args, served.expert_format, served.gpu_name)
    service = EngineService(served.engine_factory, served.codec.decode, policy=policy,
                            request_timeout_s=args.request_timeout_s, max_pending_requests=args.max_pending_requests)
    model = ModelInfo(served.model_name, served.context_length, served.codec)
    listen = ListenConfig(host=args.host, port=args.port, grpc_host=args.grpc_host, grpc_port=args.grpc_port,
                          api_key=api_key, drain_timeout_s=args.drain_timeout_s)
    server = CoordinatorServer(service, model, policy, listen)

    async def main() -> None:
        await server.start()
        server.install_signal_handlers()
        for message in server.warnings:
            print(message, file=sys.stderr)
        grpc_note = f", gRPC on {listen.grpc_host or listen.host}:{server.grpc_port}" if server.grpc_port else ""
        print(f"ft serve: {served.model_name} ({served.description}) on http://{args.host}:{server.http_port}/v1"
              f"{grpc_note}", file=sys.stderr, flush=True)
        await server.wait_closed()

    run_loop(main)
    print("ft serve: stopped", file=sys.stderr)
    return 0
