"""`EngineSpec`: everything that shapes an engine, resolved once and handed whole to what builds it.

Every entry point declares the engine's flags with `add_engine_flags` (one declaration, one type per flag)
and turns them into a spec with `spec_from_args` (CLI flag > FREETOKEN_* variable > default, resolved here
and nowhere else). The spec then travels unchanged: `ft generate` and `ft serve --workers inline` give it to
`gpu_worker.api.build_engine`; `ft serve` (process mode) sends it to its GPU worker in the engine link's
WELCOME (a typed field of the message: proto/engine_messages.py), and the worker builds the same engine from
it, so the two cannot disagree.

No torch here: the coordinator resolves the spec before any worker exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ftexpert.proto.cli_flags import DEVICES, add_device_flag, add_reserve_cpus_flag
from ftexpert.proto.knobs import KNOBS_BY_FIELD, add_cli_flag, nonnegative_int_flag, positive_int_flag, resolve

STRATEGIES = ("resident", "offload", "cpu", "hybrid")
CPU_POOL_STRATEGIES = ("cpu", "hybrid")           # strategies whose misses CPU expert workers compute
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --preset's choices: the names of gpu_worker/checkpoint/presets.py's registry, repeated so that parsing the flags
# imports no torch (tests/coordinator/test_generate_cli.py keeps the two in step)
PRESET_NAMES = ("tiny", "qwen3-30b-a3b", "olmoe-1b-7b", "mixtral-8x7b", "qwen3-next-80b-a3b", "qwen3-30b-a3b-128k",
                "gpt-oss-20b", "gpt-oss-120b")
DEFAULT_MAX_RUNNING_REQUESTS = 8
ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")
# the choices of settings whose code imports torch, repeated here so that parsing the flags imports none
# (tests/proto/test_engine_spec.py keeps each in step with its home)
EXPERT_COMPUTE_MODES = ("auto", "grouped", "gemv")       # gpu_worker/backends/expert_compute.py MODES
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")          # gpu_worker/engine/attention.py
DENSE_LINEARS = ("auto", "gemv", "torch")                # gpu_worker/models/model.py DENSE_LINEARS, and auto
EXPERT_COPIES = ("split", "whole")                       # offload / hybrid's decode copy (OffloadExperts split_copy)
CPU_ACT_QUANTS = ("auto", "fp32", "int8")                # cpu_expert_pool/expert_kernel.py ACT_QUANTS
# the fields that take one of a few values: the spec refuses another, their flags offer these
CHOICES = {"moe_strategy": STRATEGIES, "device": DEVICES, "dtype": DTYPES, "expert_compute": EXPERT_COMPUTE_MODES,
           "expert_copy": EXPERT_COPIES, "fused_kernels": AUTO_ON_OFF, "dense_linear": DENSE_LINEARS,
           "overlap_decode": AUTO_ON_OFF, "cuda_graphs": ON_OFF, "attention_backend": ATTENTION_BACKENDS,
           "cpu_act_quant": CPU_ACT_QUANTS}
# the embedded default model (neither --model nor --preset): its files ship in the GPU worker's checkpoint package;
# its path is named here so that `ft serve` resolves the default without importing the model-loading code
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "gpu_worker" / "checkpoint" / "data" / "default-moe"

# the FREETOKEN_* knobs that are engine settings (proto/knobs.py holds their types, defaults and help)
ENGINE_KNOBS = ("expert_format", "overlap_decode", "eviction_freq_weight", "eviction_freq_half_life",
                "pin_gpu_worker", "moe_slot_audit", "pdl", "moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k",
                "moe_prefetch_verify")


# The spec's fields by what a change of them rebuilds (gpu_worker/assembly/build.py): the model (a new load), the
# expert backend (`build_engine(spec, reuse=built)` keeps the model's dense weights), or only the engine over the
# same model and experts (`BuiltEngine.fresh_engine(spec)`). Every field is in exactly one (a test checks).
MODEL_FIELDS = ("model", "preset", "seed_weights", "device", "dtype", "expert_format", "fused_kernels")
EXPERT_FIELDS = ("moe_strategy", "moe_cache_size", "moe_cache_per_layer", "num_cpu_workers", "reserve_cpus",
                 "cpu_act_quant",
                 "pin_gpu_worker", "eviction_freq_weight", "eviction_freq_half_life", "expert_compute", "expert_copy")
ENGINE_FIELDS = ("moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify", "routing",
                 "dense_linear", "max_running_requests", "max_context_tokens", "prefill_chunk_tokens",
                 "overlap_decode", "cuda_graphs", "attention_backend", "moe_slot_audit", "pdl", "kv_block_size",
                 "kv_cache_gib", "prefix_cache", "state_checkpoints")


class SpecError(ValueError):
    """An engine spec that cannot be built: the message names the field and what to do."""


def routing_flag(raw: str) -> str:
    """--routing, checked and kept as text: model (the routers decide), zipf or zipf:SKEW (a seeded table of a
    skewed popularity, SKEW >= 0), or trace:FILE (a recorded routing trace); gpu_worker/models/synthetic_routing.py."""
    text = raw.strip()
    name, colon, value = text.partition(":")
    if text == "model" or (name == "zipf" and not colon):
        return text
    if name == "zipf" and colon:
        try:
            if float(value) >= 0:
                return text
        except ValueError:
            pass
    if name == "trace" and value:
        return text
    raise argparse.ArgumentTypeError(f"expected model, zipf[:SKEW] (SKEW >= 0) or trace:FILE, got {raw!r}")


def cache_size_flag(raw: str) -> str:
    """--moe-cache-size, checked and kept as text: a slot count ("256", an int >= 1) or a fraction of all experts
    in (0, 1] ("0.25", with its point: "1" is one slot, "1.0" all of them)."""
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a slot count or a fraction in (0, 1], got {raw!r}") from None
    if "." not in text and value.is_integer() and value >= 1:
        return str(int(value))
    if "." in text and 0 < value <= 1:
        return repr(value)
    raise argparse.ArgumentTypeError(f"expected a slot count >= 1 or a fraction in (0, 1] (with its decimal "
                                     f"point), got {raw!r}")


@dataclass(frozen=True)
class EngineSpec:
    # the model
    model: str | None = None                    # checkpoint directory (absolute once resolved); None: preset / tiny
    preset: str | None = None                   # random weights of a real model's shape
    seed_weights: int = 0                       # the preset's weight seed
    device: str = "auto"
    dtype: str = "auto"
    expert_format: str = "auto"                 # auto, or an expert format label (int4 -> int4-g128)
    # the experts
    moe_strategy: str = "resident"
    moe_cache_size: str | None = None           # GPU expert slots: a count "256" or a fraction "0.25" (cache_size_flag)
    moe_cache_per_layer: bool = False           # every layer its own pool of moe_cache_size // layers slots
    num_cpu_workers: int = 0                    # cpu / hybrid: CPU expert workers (0: one per NUMA node)
    reserve_cpus: str | None = None             # cpu / hybrid: CPUs the CPU workers keep off
    cpu_act_quant: str = "auto"                 # cpu / hybrid: the CPU workers' 4-bit experts' activations
    pin_gpu_worker: str = "on"                  # cpu / hybrid: the engine's process pins itself to those
    eviction_freq_weight: int = 0
    eviction_freq_half_life: int = 3072
    moe_prefetch: str = "off"                   # the lookahead prefetch (docs/PREFETCH.md)
    moe_prefetch_budget: int = 4
    moe_prefetch_k: int = 16
    moe_prefetch_verify: str = "off"
    expert_compute: str = "auto"                # the experts' FFN on the GPU: grouped, gemv; auto: by batch size
    expert_copy: str = "split"                  # offload / hybrid's decode copy: w13 then w2 (split), or whole
    # the model's forward
    fused_kernels: str = "auto"                 # the fused forward (kernels/moe_decode); auto: on CUDA
    dense_linear: str = "auto"                  # decode's dense projections: gemv (kernels/dense_gemv) or torch;
                                                # auto: gemv on CUDA
    routing: str = "model"                      # synthetic routing of random-weight presets (benchmarks): routing_flag
    # the engine
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    max_context_tokens: int | None = None       # None: the model's, at most 32768
    prefill_chunk_tokens: int | None = None     # None: the engine's default for the backend
    kv_block_size: int | None = None            # positions per KV block; None: the engine's (16)
    kv_cache_gib: float | None = None           # the KV pool's memory; None: max_running_requests x max_context_tokens
    prefix_cache: str = "on"                    # share KV blocks of equal prompt prefixes
    state_checkpoints: int | None = None        # linear-attention models: states kept for prefix hits (None: the
                                                # engine's default, max_running_requests; 0: no prefix cache for them)
    overlap_decode: str = "auto"
    cuda_graphs: str = "on"                     # decode forwards replayed from CUDA graphs (on a CUDA device)
    attention_backend: str = "auto"             # decode attention: sdpa or triton; auto: triton on CUDA
    moe_slot_audit: int = 0                     # check the slot cache every N steps (0: never)
    pdl: str = "auto"

    def __post_init__(self) -> None:
        try:                                       # auto, or the format's label (int4 -> int4-g128)
            object.__setattr__(self, "expert_format", KNOBS_BY_FIELD["expert_format"].parse(self.expert_format))
        except ValueError as exc:
            raise SpecError(f"expert_format={self.expert_format!r}: {exc}") from None
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise SpecError(f"{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not isinstance(self.moe_cache_per_layer, bool):
            raise SpecError(f"moe_cache_per_layer={self.moe_cache_per_layer!r} must be True or False")
        try:
            routing_flag(self.routing)
        except argparse.ArgumentTypeError as exc:
            raise SpecError(f"routing={self.routing!r}: {exc}") from None
        if self.max_running_requests < 1:
            raise SpecError(f"max_running_requests={self.max_running_requests} must be >= 1")
        for name in ("max_context_tokens", "prefill_chunk_tokens", "kv_block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SpecError(f"{name}={value} must be >= 1 (or unset for the default)")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise SpecError(f"kv_cache_gib={self.kv_cache_gib} must be > 0 (or unset for the default)")
        if self.prefix_cache not in ("on", "off"):
            raise SpecError(f"prefix_cache={self.prefix_cache!r} is not one of on, off")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise SpecError(f"state_checkpoints={self.state_checkpoints} must be >= 0 (0: no prefix cache for a model "
                            f"with linear-attention layers; unset for the default)")
        if self.moe_cache_size is not None:
            try:
                cache_size_flag(self.moe_cache_size)
            except argparse.ArgumentTypeError as exc:
                raise SpecError(f"moe_cache_size: {exc}") from None
        if self.num_cpu_workers < 0:
            raise SpecError(f"num_cpu_workers={self.num_cpu_workers} must be >= 0 (0: one per NUMA node)")
        for name in ("moe_prefetch", "moe_prefetch_verify"):
            if getattr(self, name) not in KNOBS_BY_FIELD[name].choices:
                raise SpecError(f"{name}={getattr(self, name)!r} is not one of "
                                f"{', '.join(KNOBS_BY_FIELD[name].choices)}")
        if self.moe_cache_per_layer and self.moe_strategy == "resident":
            raise SpecError("moe_cache_per_layer: per-layer slot pools need a slot cache (--moe-strategy offload, "
                            "cpu or hybrid), not resident")
        # auto (the default) is nothing without a slot cache; measure, on and the verifier are asked for explicitly
        if ((self.moe_prefetch not in ("off", "auto") or self.moe_prefetch_verify != "off")
                and self.moe_strategy == "resident"):
            raise SpecError(f"--moe-prefetch {self.moe_prefetch} / --moe-prefetch-verify: the lookahead prefetch "
                            f"needs a slot cache (--moe-strategy offload, cpu or hybrid), not {self.moe_strategy}")

    @property
    def uses_cpu_pool(self) -> bool:
        return self.moe_strategy in CPU_POOL_STRATEGIES

    @property
    def overlap(self) -> bool | None:
        """EngineConfig.overlap_decode: None = on where the device supports it."""
        return None if self.overlap_decode == "auto" else self.overlap_decode == "on"

    @property
    def fused(self) -> bool | None:
        """MoeModel's fused_kernels: None = on CUDA."""
        return None if self.fused_kernels == "auto" else self.fused_kernels == "on"

    def differing(self, other: "EngineSpec") -> list[str]:
        """The names of the fields whose values differ between this spec and `other`, in declaration order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def positive_float_flag(raw: str) -> float:
    """argparse type of a size flag (e.g. --kv-cache-gib): a number > 0."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {raw!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {raw}")
    return value


def add_engine_flags(parser: argparse.ArgumentParser, *,
                     max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS) -> None:
    """The engine's flags, declared once for `ft serve`, `ft generate` and the benches (`max_running_requests`:
    this command's default: 1 for `ft generate`'s one request)."""
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="DIR", help="model directory (Hugging Face layout); "
                       "default: the embedded default model, a small MoE trained on the bundled corpus")
    model.add_argument("--preset", default=None, choices=PRESET_NAMES,
                       help="a real model's shape with seeded random weights, made in memory; with --model, written "
                            "to DIR first if DIR has no config.json")
    model.add_argument("--seed-weights", type=int, default=0, help="seed of a preset's random weights")
    add_device_flag(model)
    model.add_argument("--dtype", default="auto", choices=DTYPES, help="dense weights' dtype (auto: the checkpoint's)")
    add_cli_flag(model, "expert_format")
    experts = parser.add_argument_group("experts")
    experts.add_argument("--moe-strategy", default="resident", choices=STRATEGIES,
                         help="expert backend: resident (all on the GPU), offload (misses fetched over PCIe), cpu "
                              "(misses computed by the CPU workers), hybrid (split between the two)")
    experts.add_argument("--moe-cache-size", type=cache_size_flag, default=None, metavar="N|FRACTION",
                         help="GPU expert slots (offload / cpu / hybrid): a count, or a fraction of all experts "
                              "(default 0.25)")
    experts.add_argument("--moe-cache-per-layer", action="store_true",
                         help="offload / cpu / hybrid: every layer its own pool of --moe-cache-size / layers slots "
                              "(default: one pool shared by every layer)")
    experts.add_argument("--num-cpu-workers", type=int, default=0,
                         help="CPU expert workers for cpu / hybrid (0 = one per NUMA node or core group)")
    add_reserve_cpus_flag(experts)
    _choice_flag(experts, "cpu_act_quant", "cpu / hybrid: the CPU workers' activations of 4-bit experts (int4, mxfp4, "
                 "nvfp4): int8 in blocks of 16 with integer dot products (faster; docs/QUANTIZATION.md states the "
                 "error), fp32, or auto: int8 where the CPU has AVX-512 VNNI")
    for field in ("pin_gpu_worker", "eviction_freq_weight", "eviction_freq_half_life", "moe_prefetch",
                  "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify"):
        add_cli_flag(experts, field)
    _choice_flag(experts, "expert_compute", "the experts' FFN on the GPU: grouped (prefill-sized GEMMs), gemv "
                 "(decode-sized, graph-safe); auto: gemv for small decode batches on CUDA, else grouped")
    _choice_flag(experts, "expert_copy", "offload / hybrid: a decode step's expert copy in two parts, every w13 then "
                 "every w2, the fetched routes' gate/up between them (split), or each expert whole")
    forward = parser.add_argument_group("forward")
    _choice_flag(forward, "fused_kernels", "the fused forward (kernels/moe_decode: one-launch norms, rope, routing; "
                 "one qkv GEMM); auto: on CUDA")
    _choice_flag(forward, "dense_linear", "decode-sized dense projections through kernels/dense_gemv (gemv) or "
                 "F.linear (torch); auto: gemv on CUDA")
    forward.add_argument("--routing", type=routing_flag, default="model", metavar="model|zipf[:SKEW]|trace:FILE",
                         help="benchmarks of random-weight presets: the experts from a seeded table of a skewed "
                              "popularity (zipf) or a recorded trace (`ft bench routing --trace`) instead of the "
                              "routers' choice (model, the default); the numerics are then a benchmark's")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-running-requests", type=positive_int_flag, default=max_running_requests,
                        help="requests decoding together")
    engine.add_argument("--max-context-tokens", type=positive_int_flag, default=None,
                        help="prompt + generated tokens per request (default: the model's, at most 32768)")
    engine.add_argument("--prefill-chunk-tokens", type=positive_int_flag, default=None,
                        help="prompt tokens a prefill chunk takes (default: 4096; cpu/hybrid: the CPU share's token "
                             "limit, 512); smaller chunks hold up other requests' decode steps for less time and "
                             "need less memory, larger ones reach the first token sooner (offload: each chunk "
                             "costs one pass over the experts)")
    _choice_flag(engine, "cuda_graphs", "replay decode forwards from CUDA graphs where it is safe (on a CUDA device)")
    _choice_flag(engine, "attention_backend", "decode attention: triton (kernels/decode_attention) or sdpa; auto: "
                 "triton on CUDA")
    engine.add_argument("--kv-block-size", type=positive_int_flag, default=None,
                        help="positions per KV cache block (default 16): the prefix cache shares whole blocks")
    engine.add_argument("--kv-cache-gib", type=positive_float_flag, default=None, metavar="GIB",
                        help="memory of the KV cache's block pools (default: room for max-running-requests full "
                             "contexts); requests are admitted while its blocks last. A model with sliding-window "
                             "layers (gpt-oss) takes their pool (max-running-requests windows and one prefill chunk) "
                             "out of it first; the rest holds the full-attention layers")
    engine.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                        help="reuse the KV blocks of a prompt prefix computed before (default on; a model with "
                             "linear-attention layers, Qwen3-Next, resumes their states from those kept by "
                             "--state-checkpoints)")
    engine.add_argument("--state-checkpoints", type=nonnegative_int_flag, default=None, metavar="N",
                        help="a model with linear-attention layers (Qwen3-Next): the states at block boundaries kept "
                             "for prefix hits, one per recent conversation (default: max-running-requests; 74 MiB "
                             "each at qwen3-next-80b-a3b, and two more a running request); 0: no prefix cache for it")
    for field in ("overlap_decode", "moe_slot_audit", "pdl"):
        add_cli_flag(engine, field)


def _choice_flag(group: Any, field: str, help: str) -> None:
    """The flag of a CHOICES field: its values, and the spec's default for it."""
    default = next(f.default for f in dataclasses.fields(EngineSpec) if f.name == field)
    group.add_argument("--" + field.replace("_", "-"), default=default, choices=CHOICES[field], help=help)


def spec_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                   **overrides: Any) -> EngineSpec:
    """The spec of parsed `add_engine_flags` flags, the FREETOKEN_* knobs resolved once (flag > env > default).
    `overrides`: fields the caller sets itself (e.g. max_running_requests=1 for `ft generate`)."""
    resolved = resolve({k: getattr(args, k, None) for k in ENGINE_KNOBS}, environ)
    knobs = {k: resolved[k] for k in ENGINE_KNOBS}
    model = getattr(args, "model", None)
    routing = getattr(args, "routing", "model")
    if routing.startswith("trace:"):                 # the worker may run elsewhere: an absolute path
        routing = "trace:" + os.path.abspath(routing[len("trace:"):])
    fields = dict(
        model=os.path.abspath(model) if model else None, preset=getattr(args, "preset", None),
        seed_weights=getattr(args, "seed_weights", 0), device=getattr(args, "device", "auto"),
        dtype=getattr(args, "dtype", "auto"), moe_strategy=getattr(args, "moe_strategy", "resident"),
        moe_cache_size=getattr(args, "moe_cache_size", None),
        moe_cache_per_layer=getattr(args, "moe_cache_per_layer", False),
        num_cpu_workers=getattr(args, "num_cpu_workers", 0), reserve_cpus=getattr(args, "reserve_cpus", None),
        cpu_act_quant=getattr(args, "cpu_act_quant", "auto"),
        expert_compute=getattr(args, "expert_compute", "auto"), expert_copy=getattr(args, "expert_copy", "split"),
        fused_kernels=getattr(args, "fused_kernels", "auto"), dense_linear=getattr(args, "dense_linear", "auto"),
        routing=routing, cuda_graphs=getattr(args, "cuda_graphs", "on"),
        attention_backend=getattr(args, "attention_backend", "auto"),
        max_running_requests=getattr(args, "max_running_requests", DEFAULT_MAX_RUNNING_REQUESTS),
        max_context_tokens=getattr(args, "max_context_tokens", None),
        prefill_chunk_tokens=getattr(args, "prefill_chunk_tokens", None),
        kv_block_size=getattr(args, "kv_block_size", None), kv_cache_gib=getattr(args, "kv_cache_gib", None),
        prefix_cache=getattr(args, "prefix_cache", "on"),
        state_checkpoints=getattr(args, "state_checkpoints", None),
        **knobs)
    fields.update(overrides)
    return EngineSpec(**fields)
