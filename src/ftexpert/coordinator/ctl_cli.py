"""`ft ctl`: the command-line client of the coordinator's gRPC control plane.

    ft ctl stats                      ft ctl policy get
    ft ctl policy set --fraction 0.4 --round stochastic
    ft ctl workers                    ft ctl restart engine
    ft ctl drain [--timeout-s 30]     ft ctl drain --resume
    ft ctl shutdown                   ft ctl health [SERVICE]
    ft ctl generate --prompt "Hello" --max-tokens 32 [--chat] [--temperature 0]

--address (default 127.0.0.1:1920, env FT_CTL_ADDRESS), the key from $FT_API_KEY or --api-key-file (never
the command line: `ps` shows it); with neither, the control key of a server on this host started without an API
key, when this user may read it (coordinator/control_key.py). --tls-ca PEM for a server with --tls-cert, --json
for machine-readable output, --timeout-s for each call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ftexpert.coordinator import control_key
from ftexpert.coordinator.auth import add_api_key_flags, resolve_api_key

DEFAULT_ADDRESS = "127.0.0.1:1920"
DEFAULT_TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("FT_CTL_ADDRESS", DEFAULT_ADDRESS),
                        help=f"gRPC address of the coordinator [env FT_CTL_ADDRESS, default {DEFAULT_ADDRESS}]")
    add_api_key_flags(parser)
    parser.add_argument("--tls-ca", default=os.environ.get("FT_CTL_TLS_CA"), metavar="PEM",
                        help="connect over TLS, trusting this CA (or self-signed) certificate [env FT_CTL_TLS_CA]")
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of each call")
    parser.add_argument("--json", action="store_true", help="print replies as JSON")
    sub = parser.add_subparsers(dest="ctl_command", metavar="ACTION", required=True)
    sub.add_parser("stats", help="service counters and gauges")
    policy = sub.add_parser("policy", help="show or change the expert-miss policy")
    psub = policy.add_subparsers(dest="policy_command", metavar="get|set", required=True)
    psub.add_parser("get", help="the policy in force and the tuner's view")
    pset = psub.add_parser("set", help="change some policy fields (the rest stay)")
    pset.add_argument("--strategy", choices=("resident", "offload", "cpu", "hybrid"))
    pset.add_argument("--fraction", type=float, help="fixed fetch fraction f in [0, 1] (turns auto-tune off)")
    pset.add_argument("--min", dest="fraction_min", type=float, help="lower bound of f for the tuner")
    pset.add_argument("--max", dest="fraction_max", type=float, help="upper bound of f for the tuner")
    tune = pset.add_mutually_exclusive_group()
    tune.add_argument("--auto", dest="auto_tune", action="store_true", default=None, help="re-tune f online")
    tune.add_argument("--no-auto", dest="auto_tune", action="store_false", help="keep f fixed")
    pset.add_argument("--round", choices=("min-wait", "stochastic", "prefer-fetch", "split"), help="rounding of f*M")
    pset.add_argument("--prefetch", choices=("auto", "off", "measure", "on"),
                      help="the lookahead expert prefetch (offload, hybrid; docs/PREFETCH.md)")
    pset.add_argument("--prefetch-budget", type=int, help="experts the prefetch installs per layer, 1..128")
    sub.add_parser("workers", help="supervised workers and their state")
    restart = sub.add_parser("restart", help="restart a worker by name")
    restart.add_argument("name")
    drain = sub.add_parser("drain", help="stop accepting requests and wait for those in flight")
    drain.add_argument("--drain-timeout-s", type=float, default=0.0, help="0 = the server's default")
    drain.add_argument("--resume", action="store_true", help="accept requests again")
    shutdown = sub.add_parser("shutdown", help="drain, then stop the service")
    shutdown.add_argument("--drain-timeout-s", type=float, default=0.0, help="0 = the server's default")
    health = sub.add_parser("health", help="grpc.health.v1 status of the service or one component")
    health.add_argument("service", nargs="?", default=None, help="component name; none: list all")
    gen = sub.add_parser("generate", help="generate text and print it as it streams")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")


def _to_dict(message: Any) -> dict:
    from google.protobuf import json_format      # lazy: protobuf loads only when `ft ctl` prints a reply
    try:      # protobuf >= 5.26
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:  # older runtimes name the option differently
        return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                         including_default_value_fields=True)


def _print(message: Any, as_json: bool, out) -> None:
    data = _to_dict(message)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True), file=out)
        return
    _print_tree(data, 0, out)


def _print_tree(data: Any, indent: int, out) -> None:
    pad = "  " * indent
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, (dict, list)) and v:
                print(f"{pad}{k}:", file=out)
                _print_tree(v, indent + 1, out)
            else:
                print(f"{pad}{k}: {v if not isinstance(v, float) else f'{v:.6g}'}", file=out)
    elif isinstance(data, list):
        for item in data:
            if isinstance(item, dict):
                print(f"{pad}-", file=out)
                _print_tree(item, indent + 1, out)
            else:
                print(f"{pad}- {item}", file=out)


def run(args: argparse.Namespace, out=None) -> int:
    # lazy: gRPC and the control stubs load only when `ft ctl` runs a command (`ft --help` start-up time)
    import grpc

    from ftexpert.proto import control_rpc as rpc

    out = out or sys.stdout
    api_key, key_file, notes = resolve_api_key(args.api_key_file), None, []
    if api_key is None:                   # a server here without an API key: its control key, if it is ours
        api_key, key_file, notes = control_key.find(args.address)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    t = args.timeout_s
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        control = rpc.ControlStub(channel)
        try:
            return _dispatch(args, control, rpc.HealthStub(channel), rpc, metadata, t, out)
        except grpc.RpcError as exc:
            code = exc.code()
            hint = {grpc.StatusCode.UNAVAILABLE: f" (is `ft serve` running with --grpc-port matching {args.address}?)",
                    grpc.StatusCode.UNAUTHENTICATED: _key_hint(api_key, key_file, notes)}.get(code, "")
            print(f"ft ctl: {code.name}: {exc.details()}{hint}", file=sys.stderr)
            return 1


def _key_hint(api_key: str | None, key_file: str | None, notes: list[str]) -> str:
    """After UNAUTHENTICATED: which key ft ctl sent, or why it had none."""
    if key_file is not None:
        return (f" (ft ctl sent the control key in {key_file}, which this server does not take: it was left by an "
                f"earlier server on that port; set FT_API_KEY or pass --api-key-file with this server's key)")
    if api_key is not None:
        return " (the key of FT_API_KEY / --api-key-file is not this server's)"
    return f" (ft ctl had no key to send{''.join(f'; {note}' for note in notes)})"


def _dispatch(args, control, health, rpc, metadata, t, out) -> int:
    cmd = args.ctl_command
    if cmd == "stats":
        _print(control.GetStats(rpc.msg.GetStatsRequest(), timeout=t, metadata=metadata), args.json, out)
    elif cmd == "policy" and args.policy_command == "get":
        _print(control.GetPolicy(rpc.msg.GetPolicyRequest(), timeout=t, metadata=metadata), args.json, out)
    elif cmd == "policy":
        fields = {"strategy": args.strategy, "fetch_fraction": args.fraction,
                  "fetch_fraction_min": args.fraction_min, "fetch_fraction_max": args.fraction_max,
                  "auto_tune": args.auto_tune, "fetch_round": args.round, "prefetch": args.prefetch,
                  "prefetch_budget": args.prefetch_budget}
        fields = {k: v for k, v in fields.items() if v is not None}
        if not fields:
            print("ft ctl: policy set needs at least one option, e.g. --fraction 0.4", file=sys.stderr)
            return 2
        _print(control.SetPolicy(rpc.msg.SetPolicyRequest(**fields), timeout=t, metadata=metadata), args.json, out)
    elif cmd == "workers":
        _print(control.ListWorkers(rpc.msg.ListWorkersRequest(), timeout=t, metadata=metadata), args.json, out)
    elif cmd == "restart":
        _print(control.RestartWorker(rpc.msg.RestartWorkerRequest(name=args.name), timeout=max(t, 600.0),
                                     metadata=metadata), args.json, out)
    elif cmd == "drain":
        request = rpc.msg.DrainRequest(timeout_s=args.drain_timeout_s, resume=args.resume)
        _print(control.Drain(request, timeout=t + max(args.drain_timeout_s, 60.0), metadata=metadata), args.json, out)
    elif cmd == "shutdown":
        _print(control.Shutdown(rpc.msg.ShutdownRequest(drain_timeout_s=args.drain_timeout_s), timeout=t,
                                metadata=metadata), args.json, out)
    elif cmd == "health":
        if args.service is None:
            statuses = health.List(rpc.health.HealthListRequest(), timeout=t).statuses
            table = {name or "(whole service)": rpc.SERVING_STATUS.Name(st.status) for name, st in statuses.items()}
            print(json.dumps(table, indent=2, sort_keys=True) if args.json else
                  "\n".join(f"{k}: {v}" for k, v in sorted(table.items())), file=out)
        else:
            reply = health.Check(rpc.health.HealthCheckRequest(service=args.service), timeout=t)
            name = rpc.SERVING_STATUS.Name(reply.status)
            print(json.dumps({"status": name}) if args.json else name, file=out)
            return 0 if name == "SERVING" else 1
    elif cmd == "generate":
        return _generate(args, control, rpc, metadata, out)
    return 0


def _generate(args, control, rpc, metadata, out) -> int:
    sampling = rpc.msg.SamplingOptions(ignore_eos=args.ignore_eos)
    for field, value in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                         ("seed", args.seed)):
        if value is not None:
            setattr(sampling, field, value)
    if args.max_tokens < 1:
        print("ft ctl: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    request = rpc.msg.GenerateRequest(prompt=args.prompt, chat=args.chat, max_tokens=args.max_tokens,
                                      sampling=sampling, stop=args.stop)
    last = None
    for chunk in control.Generate(request, timeout=max(args.timeout_s, 600.0), metadata=metadata):
        last = chunk
        if args.json:
            print(json.dumps(_to_dict(chunk)), file=out)
        else:
            out.write(chunk.text)
            out.flush()
    if not args.json:
        out.write("\n")
        if last is not None and last.finished:
            print(f"[{last.finish_reason}: {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} "
                  f"generated tokens]", file=sys.stderr)
    return 0
