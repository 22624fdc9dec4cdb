"""The one registry of FREETOKEN_* environment knobs.

Each knob is also a config field (``ServiceConfig.<field>``) and a CLI flag (``--<field with dashes>``).
Precedence: CLI flag > environment variable > default. Unknown FREETOKEN_* variables are reported,
not silently ignored, so a typo does not change behaviour unnoticed.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ftexpert.proto.expert_format import ExpertFormat, FormatError

ENV_PREFIX = "FREETOKEN_"


@dataclass(frozen=True)
class Knob:
    env: str                       # environment variable name
    field: str                     # ServiceConfig field / CLI flag name (underscores)
    parse: Callable[[str], Any]    # str -> typed value; raises ValueError on bad input
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    def convert(self, raw: str, source: str) -> Any:
        if self.choices is not None and raw not in self.choices:
            raise ValueError(
                f"{source}={raw!r} is not valid; choose one of: {', '.join(self.choices)}"
            )
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{source}={raw!r} is not valid: {exc}") from None


def _int_flag(raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {raw!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int_flag(raw: str) -> int:
    """argparse type of a count flag (e.g. --prefill-chunk-tokens): refused at parse time, before anything
    loads, with the flag's name in argparse's message."""
    return _int_flag(raw, 1)


def nonnegative_int_flag(raw: str) -> int:
    """argparse type of a count flag where 0 means none (e.g. --state-checkpoints)."""
    return _int_flag(raw, 0)


def _nonneg_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _int_in(raw: str, lo: int, hi: int) -> int:
    value = int(raw)
    if not lo <= value <= hi:
        raise ValueError(f"must be an int in [{lo}, {hi}]")
    return value


def _freq_weight(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= 1024:
        raise ValueError("must be an int in [0, 1024] (0: least recently used)")
    return value


def _expert_format(raw: str) -> str:
    """auto, or an expert format label (proto.expert_format.ExpertFormat.parse), normalised: int4 -> int4-g128."""
    if raw.strip().lower() == "auto":
        return "auto"
    try:
        return ExpertFormat.parse(raw).label
    except FormatError as exc:
        raise ValueError(str(exc)) from None


EXPERT_FORMAT_CHOICES = ("auto", "bf16", "fp8", "int4", "int4-g32", "int4-g64", "int4-g128", "mxfp4", "nvfp4")

KNOBS: tuple[Knob, ...] = (
    Knob("FREETOKEN_EXPERT_FORMAT", "expert_format", _expert_format, "auto",
         "the experts' format in the host store, the GPU slots and the CPU pool: auto (as the checkpoint stores "
         "them: its quantization_config, else bf16), bf16, fp8 (128x128 block scales), int4 (groups of 128; "
         "int4-g32 / int4-g64), mxfp4, nvfp4. A float checkpoint or a preset is quantized while loading (round to "
         "nearest); a quantized checkpoint is served in its format or as bf16 (dequantized). Part of the engine "
         "spec the GPU worker gets from its coordinator (docs/QUANTIZATION.md)",
         choices=EXPERT_FORMAT_CHOICES),
    Knob("FREETOKEN_HYBRID_FETCH_ROUND", "fetch_round", str, "split",
         "rounding of f*M to a fetch count: min-wait (finish both sides together), stochastic "
         "(seeded, unbiased), prefer-fetch (ceil), split (on the device hand-off's decode steps: floor, and the "
         "rest of one expert split by its channels between a fetch and the CPU; elsewhere as min-wait)",
         choices=("min-wait", "stochastic", "prefer-fetch", "split")),
    Knob("FREETOKEN_OVERLAP_DECODE", "overlap_decode", str, "auto",
         "queue the next decode step (fed with this step's sampled ids on the device) before this step's ids are read "
         "back, so the GPU does not idle while the host finishes a step: auto (on with a CUDA GPU), on, off; the same "
         "tokens either way, except that a request stopping with a step queued leaves its batch-mates' next token "
         "computed in the larger batch (gpu_worker/engine/README.md)",
         choices=("auto", "on", "off")),
    Knob("FREETOKEN_EVICTION_FREQ_WEIGHT", "eviction_freq_weight", _freq_weight, 0,
         "offload and hybrid: the slot cache's eviction key. 0 (default): least recently used, the contract's. W > 0 "
         "(up to 1024): a used slot's key is its last use (in layer calls) + W x the routes its expert has had, so "
         "often-routed experts stay. On the benchmarks' synthetic routing W = 256 gave a third fewer misses and "
         "36-45 percent more decode tok/s on the H200 (docs/OFFLOAD.md); the same tokens either way"),
    Knob("FREETOKEN_EVICTION_FREQ_HALF_LIFE", "eviction_freq_half_life", _nonneg_int, 3072,
         "offload and hybrid, with --eviction-freq-weight W > 0: every expert's route count is halved each time this "
         "many layer calls have passed (3072 = 64 tokens of a 48-layer model; 0: never), so that the counts follow "
         "traffic whose popular experts change. In simulation, without it four requests with different popular "
         "experts end worse than LRU; with it they stay about a quarter below (docs/OFFLOAD.md)"),
    Knob("FREETOKEN_PIN_GPU_WORKER", "pin_gpu_worker", str, "on",
         "cpu/hybrid: the process that drives the GPU (the GPU worker; `ft generate`) pins all its threads to "
         "the reserved CPUs (--reserve-cpus) within its affinity, off the CPU workers' cores; off: it runs "
         "anywhere",
         choices=("on", "off")),
    Knob("FREETOKEN_MOE_SLOT_AUDIT", "moe_slot_audit", _nonneg_int, 0,
         "every N decode steps, check the slot-cache invariants on the host and the bytes of a few slots; "
         "on a problem, log it and empty the cache (0 = never)"),
    Knob("FREETOKEN_MOE_PREFETCH", "moe_prefetch", str, "off",
         "offload and hybrid: the lookahead expert prefetch (docs/PREFETCH.md). While layer L-1 computes, layer L's "
         "router applied to layer L-1's router input predicts layer L's experts, copied into low-priority slots "
         "(lossless: the same tokens and logits as off). auto: per layer as many as fit in the PCIe "
         "link's measured idle time and clear the measured precision's break-even (none where the link has no idle "
         "time; nothing without a slot cache); on: the first --moe-prefetch-budget non-resident ones; measure: "
         "counted (useful predictions, precision, what auto would choose) without copying; off (default, until "
         "auto is measured no slower than off on the GPU: docs/PREFETCH.md): nothing",
         choices=("auto", "off", "measure", "on")),
    Knob("FREETOKEN_MOE_PREFETCH_BUDGET", "moe_prefetch_budget", lambda raw: _int_in(raw, 1, 128), 4,
         "with --moe-prefetch on/measure: experts installed (or counted) per layer, 1..128 (auto sizes its own)"),
    Knob("FREETOKEN_MOE_PREFETCH_K", "moe_prefetch_k", lambda raw: _int_in(raw, 1, 128), 16,
         "with --moe-prefetch auto/on/measure: the predictor's ranked candidates per layer, 1..128 (auto installs "
         "at most this many)"),
    Knob("FREETOKEN_MOE_PREFETCH_VERIFY", "moe_prefetch_verify", str, "off",
         "a debug detector for offload and hybrid decode steps (a host sync a layer; no decode CUDA graphs): meta "
         "checks every routed slot's maps after ensure; 1 also compares the slots' bytes with the host rows before "
         "and after the expert GEMMs; off (default): nothing, no cost",
         choices=("off", "meta", "1")),
    Knob("FREETOKEN_PDL", "pdl", str, "auto",
         "programmatic dependent launch of the decode kernels (kernels/pdl.py): auto (on with a GPU of compute "
         "capability 9.0 or later and a Triton that has it), on (an error where it cannot), off; bitwise the same "
         "tokens either way",
         choices=("auto", "on", "off")),
    Knob("FREETOKEN_BENCHBW_PATH", "benchbw_path", str, "",
         "path of the `ft bench bw` bandwidth profile (JSON); empty = the default location"),
)

KNOBS_BY_ENV = {k.env: k for k in KNOBS}
KNOBS_BY_FIELD = {k.field: k for k in KNOBS}


def read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Typed values of every knob set in the environment (unset knobs are absent)."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in KNOBS_BY_ENV)
    if unknown:
        raise ValueError(
            f"unknown environment variable(s) {', '.join(unknown)}; known knobs: "
            + ", ".join(sorted(KNOBS_BY_ENV))
        )
    return {k.field: k.convert(environ[k.env], k.env) for k in KNOBS if k.env in environ}


def add_cli_flag(parser: Any, field: str) -> None:
    """Add the flag of one knob to a parser or argument group (default None, so that env and config
    defaults apply); for a command that takes a few knobs, not all of them."""
    k = KNOBS_BY_FIELD[field]
    parser.add_argument(k.flag, dest=k.field, default=None, choices=k.choices,
                        type=(None if k.choices else k.parse),
                        help=f"{k.help} [env {k.env}, default {k.default!r}]")


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per knob; defaults are None so that env and config defaults apply."""
    group = parser.add_argument_group("expert-cache knobs (also FREETOKEN_* environment variables)")
    for k in KNOBS:
        add_cli_flag(group, k.field)


def resolve(cli_values: Mapping[str, Any] | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Knob values by precedence: CLI flag (not None) > environment > default."""
    values = {k.field: k.default for k in KNOBS}
    values.update(read_env(environ))
    for field, value in (cli_values or {}).items():
        if field in KNOBS_BY_FIELD and value is not None:
            values[field] = value
    return values
