"""A flag is declared once: wherever two `ft` commands take the same flag it has the same definition (type,
choices, default, help: one declaration, proto/cli_flags.py, proto/engine_spec.py or proto/knobs.py), except the
flags listed below, which mean different things in different commands."""
from __future__ import annotations

import argparse
import collections

from ftexpert.coordinator.cli import build_parser

# flag -> why its commands declare it differently (each listed flag must still differ: the list cannot go stale)
DIFFERENT = {
    "--chat": "ctl generate's is a request to a running server; ft generate's wraps its own --prompt",
    "--ignore-eos": "ctl generate: a request field, unset fields take the server's defaults",
    "--prompt": "ctl generate: a request field (required there)",
    "--seed": "a sampling seed (generate), a training seed (train-moe), the soak's load seed",
    "--temperature": "ctl generate: a request field, unset the server's default",
    "--top-p": "ctl generate: a request field, unset the server's default",
    "--top-k": "sampling (generate, ctl generate) against experts per CPU call (bench bw)",
    "--device": "the training tools' (bench train-moe, bench routing) default to the GPU / the CPU",
    "--dtype": "ft bench bw loads no model: the measured experts' dtype, any torch dtype name",
    "--model": "ft bench bw takes a shape from a config.json; bench routing reads a trained checkpoint (a Path)",
    "--preset": "ft bench bw takes a shape from any preset, test presets too",
    "--reserve-cpus": "ft worker cpu gets the list its coordinator resolved ('' for none)",
    "--drain-timeout-s": "ctl drain / shutdown send it with the request (0: the server's own)",
    "--engine-addr": "ft worker gpu defaults to ft serve's default address; ft serve resolves its own",
    "--handshake-timeout-s": "a CPU worker's HELLO to its supervisor against the GPU worker's to the coordinator",
    "--json": "each command's own output",
    "--out": "each command's own output",
    "--store": "ft worker cpu names its store segment; ft worker gpu overrides WELCOME's",
    "--tokens": "training tokens against tokens to route",
}
PER_COMMAND_DEFAULT = {"--max-running-requests": "ft generate's one request: 1; ft serve: 8"}


def declarations() -> dict[str, dict[str, argparse.Action]]:
    """flag -> {command: its action}, over every `ft` subcommand."""
    found: dict[str, dict[str, argparse.Action]] = collections.defaultdict(dict)

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    walk(sub, f"{name} {word}".strip())
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    found[flag][name] = action
    walk(build_parser(), "")
    return found


def definition(action: argparse.Action, default: bool = True) -> tuple:
    kind = action.type
    return (type(action).__name__, getattr(kind, "__qualname__", repr(kind)), tuple(action.choices or ()),
            action.nargs, action.dest, action.metavar, action.help, action.required,
            action.default if default else None)


def test_a_flag_several_commands_take_is_declared_alike():
    differing = {}
    for flag, by_command in declarations().items():
        if len(by_command) < 2:
            continue
        kinds = {command: definition(action, flag not in PER_COMMAND_DEFAULT)
                 for command, action in by_command.items()}
        if len(set(kinds.values())) > 1:
            differing[flag] = kinds
    unexplained = {flag: kinds for flag, kinds in differing.items() if flag not in DIFFERENT}
    assert not unexplained, ("flags declared differently by different commands (declare them once, "
                             f"proto/cli_flags.py): {unexplained}")
    stale = sorted(set(DIFFERENT) - set(differing))
    assert not stale, f"listed as different but declared alike now (drop them from DIFFERENT): {stale}"


def test_serve_and_generate_share_every_engine_flag():
    """The engine's flags, the fetch fraction and the knobs come from one declaration for both: the same flags,
    defined alike (the batch's default is each command's)."""
    found = declarations()
    serve = {flag for flag, by in found.items() if "serve" in by}
    generate = {flag for flag, by in found.items() if "generate" in by}
    shared = serve & generate
    assert {"--model", "--moe-strategy", "--cuda-graphs", "--routing", "--fetch-fraction", "--expert-format",
            "--moe-prefetch", "--max-running-requests"} <= shared
    for flag in shared:
        a, b = found[flag]["serve"], found[flag]["generate"]
        assert definition(a, flag not in PER_COMMAND_DEFAULT) == definition(b, flag not in PER_COMMAND_DEFAULT), flag
    assert (found["--max-running-requests"]["serve"].default, found["--max-running-requests"]["generate"].default) \
        == (8, 1)


def test_the_shared_flags_refuse_bad_values_at_parse_time(capsys):
    import pytest
    for argv, message in ((["generate", "--prompt-ids", "1", "--fetch-fraction", "1.5"], "must be within [0, 1]"),
                          (["serve", "--fetch-fraction", "x"], "expected a number in [0, 1]"),
                          (["worker", "cpu", "--store", "s", "--log-level", "LOUD"], "invalid choice: 'LOUD'")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert message in capsys.readouterr().err
