"""`ft`: the one command line of the service.

Subcommands live in their own modules and are imported only when chosen: `ft serve ...` imports the serve
module alone (not the workers' command-line modules), `ft --help` none of them, so `ft --help` stays fast and
needs no GPU stack, and `ft serve` in process mode imports no module of the GPU worker. A subcommand module
provides ``add_arguments(parser)`` and ``run(args) -> int``; both must be importable without importing torch at
module level. ``build_parser()`` without a command line declares every subcommand's flags (tests, docs).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

# (subcommand, module, one-line help). Nested groups use "group sub" names.
COMMANDS: list[tuple[str, str, str]] = [
    ("bench kernels", "ftexpert.kernels.slot_cache.bench_cli", "time the slot-cache kernels (GPU)"),
    ("bench bw", "ftexpert.gpu_worker.bench_bw_cli",
     "measure PCIe and CPU-pool expert bandwidth; write the profile the fetch fraction starts from"),
    ("bench train-moe", "ftexpert.workload.train_cli", "train a MoE language model from scratch; write a HF checkpoint"),
    ("bench routing", "ftexpert.workload.routing_cli", "routing statistics (and trace) of a trained checkpoint"),
    ("serve", "ftexpert.coordinator.serve_cli", "serve the OpenAI-compatible HTTP API and the gRPC control plane"),
    ("soak", "ftexpert.coordinator.soak_cli", "run a live `ft serve` under load and faults; report growth, latency, recovery"),
    ("ctl", "ftexpert.coordinator.ctl_cli", "control a running server over gRPC (stats, policy, workers, drain, ...)"),
    ("generate", "ftexpert.coordinator.generate_cli", "run one completion through the engine in this process (no server)"),
    ("worker cpu", "ftexpert.cpu_expert_pool.cli", "run one CPU expert worker (computes expert misses on the CPU)"),
    ("worker gpu", "ftexpert.gpu_worker.worker_cli", "run the GPU worker (model, KV cache, engine loop) for a coordinator"),
    ("worker store", "ftexpert.gpu_worker.store_cli",
     "open the model for a coordinator, report its facts and fill its expert store (ft serve starts it)"),
]


def version() -> str:
    try:
        return metadata.version("ft-expert-service")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "0.1.0+src"


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its leading words, e.g. "worker gpu"), or None (no command, or an unknown one:
    then every subcommand is declared, so that argparse's help and errors are the full ones)."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    for name, _, _ in COMMANDS:
        if words[:len(name.split())] == name.split():
            return name
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """ft's parser. `argv` given: only the subcommand it names gets its flags (and its module imported); the
    others are listed with their one-line help."""
    only = chosen_command(argv) if argv is not None else None
    parser = argparse.ArgumentParser(
        prog="ft", description="Disaggregated Mixture-of-Experts serving (GPU slot cache + CPU experts).")
    parser.add_argument("--version", action="version", version=f"ft {version()}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, module, help_text in COMMANDS:
        words = name.split()
        sub_action = top
        for depth, word in enumerate(words[:-1]):
            key = " ".join(words[: depth + 1])
            if key not in groups:
                gp = sub_action.add_parser(word, help=f"{word} commands")
                groups[key] = gp.add_subparsers(dest=f"{key.replace(' ', '_')}_command",
                                                metavar="SUBCOMMAND", required=True)
            sub_action = groups[key]
        sp = sub_action.add_parser(words[-1], help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = getattr(args, "_module", None)
    if module is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(module).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # User-facing errors carry their fix in the message; no traceback for them.
        print(f"ft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
