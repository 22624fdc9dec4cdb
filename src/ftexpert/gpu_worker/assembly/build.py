"""`build_engine(spec)`: the one place an engine is assembled.

Every engine is built here from an `EngineSpec` (proto/engine_spec.py): the GPU worker process (from the spec
its coordinator sent in WELCOME), `ft serve --workers inline`, `ft generate`, the benches and the tests. In
order: the PDL setting; the device; the checkpoint (`open_model_source`, unless the caller opened it already
to fill the expert store); the synthetic routing, if any; the expert backend (over the host resources the
coordinator's `ExpertResources` made, when an `Attachment` names them; else the strategies that need none); the
dense weights and the architecture's forward and the lookahead prefetch (`assemble_model`, loader.py); the
`Engine`.

Two hooks build over what an earlier build loaded, for a benchmark's or a test's rows over one model (the spec's
fields say which: proto/engine_spec.py MODEL_FIELDS, EXPERT_FIELDS, ENGINE_FIELDS):
- ``build_engine(spec, reuse=built)``: the same dense weights, a new expert backend (another strategy, cache,
  eviction key, ...): the earlier build's backend is closed first and its model taken over;
- ``built.fresh_engine(spec)``: the same model and expert backend, a new `Engine` with other engine settings
  (batch, context, chunk, graphs, overlap, attention, routing, prefetch); ``experts=`` runs it over a backend the
  caller made or wrapped instead (tests of a backend's internals).
No other module constructs an `Engine` (tests/test_architecture.py keeps it so, bar an allow-list of the Engine
class's own unit tests).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ftexpert.gpu_worker.assembly.attached_backends import make_attached_expert_backend
from ftexpert.gpu_worker.assembly.backends import make_expert_backend
from ftexpert.gpu_worker.assembly.device import resolve_device
from ftexpert.gpu_worker.assembly.loader import ModelSource, assemble_model, open_model_source
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.backends.hybrid.options import HybridOptions
from ftexpert.gpu_worker.backends.offload.prefetch import PrefetchSettings, attach_prefetch
from ftexpert.gpu_worker.engine import Engine, EngineConfig
from ftexpert.gpu_worker.engine.grammar import GrammarCompiler
from ftexpert.gpu_worker.engine.engine import context_tokens
from ftexpert.gpu_worker.models.synthetic_routing import SyntheticRouting
from ftexpert.kernels.pdl import apply_setting
from ftexpert.proto.engine_spec import ENGINE_FIELDS, MODEL_FIELDS, EngineSpec, SpecError

PREFETCH_FIELDS = ("moe_prefetch", "moe_prefetch_budget", "moe_prefetch_k", "moe_prefetch_verify")


@dataclass(frozen=True)
class Attachment:
    """Host resources someone else created and owns (coordinator/expert_resources.py): the shared-memory expert
    store and, for cpu / hybrid, the CPU workers' channels. `host` / `pool`: the store (HostExperts) and the CPU
    pool (CpuPool) already open in this process, borrowed rather than attached again (a benchmark's rows over one
    store: no second mapping or pinning of it); the engine's backend never closes them."""
    store_name: str = ""
    cpu_channels: tuple[str, ...] = ()
    worker_info: Callable[[], list[dict]] | None = None     # the owner's supervisor view of the CPU workers
    host: Any = None
    pool: Any = None


@dataclass
class BuiltEngine:
    engine: Engine
    source: ModelSource
    device: torch.device
    experts: ExpertBackend
    load_time_s: float
    spec: EngineSpec
    model: Any

    @property
    def cfg(self) -> Any:
        return self.source.cfg

    def fresh_engine(self, spec: EngineSpec | None = None, *, experts: ExpertBackend | None = None) -> Engine:
        """Another engine over the same model and expert backend (a restart that reloads no weights; a benchmark's
        or a test's rows over one model); it becomes `self.engine`. `spec`: the built spec with other engine settings
        (ENGINE_FIELDS; the routing, dense projections and prefetch change on the shared model, and `self.spec`
        follows); a model or
        expert field that differs is refused (SpecError: `build_engine(spec, reuse=self)` makes another backend).
        `experts`: run over this backend instead, the caller's (a test's wrapper or hand-made backend; it closes
        it), on a shallow copy of the model: the built model, `self.engine` and `self.spec` stay as they are."""
        spec = self.spec if spec is None else spec
        changed = self.spec.differing(spec)
        fixed = [name for name in changed if name not in ENGINE_FIELDS]
        if fixed:
            name = fixed[0]
            raise SpecError(f"{name}={getattr(spec, name)!r}: fresh_engine keeps the built model and experts "
                            f"({name}={getattr(self.spec, name)!r}); build_engine(spec, reuse=built) builds another "
                            f"expert backend over the same dense weights, build_engine(spec) another model")
        if self.experts is None and experts is None:
            raise ValueError("this built engine's expert backend was released (release_experts, or handed over to "
                             "build_engine(reuse=...)): build_engine(spec, reuse=built) gives the model another")
        model = self.model
        if experts is not None:
            model = copy.copy(model)
            model.experts = experts
        if "pdl" in changed:
            apply_setting(spec.pdl, spec.device)
        if "dense_linear" in changed:
            model.dense_linear = _dense_linear(spec, self.device)
        rerouted = spec.routing != "model" and "max_context_tokens" in changed
        if "routing" in changed or rerouted:
            model.routing_override = _routing(spec, self.source, self.device)
        if experts is not None:
            return _engine(model, spec, self.source, self.engine.grammars if self.engine is not None else None)
        if "routing" in changed or rerouted or any(name in changed for name in PREFETCH_FIELDS):
            attach_prefetch(model, _prefetch(spec))
        grammars = self.engine.grammars if self.engine is not None else None
        self.spec, self.engine = spec, None           # (the last engine's memory freed first, unless held elsewhere)
        self.engine = _engine(model, spec, self.source, grammars)
        return self.engine

    def close(self) -> None:
        """Detach the expert backend from the store and the channels (their owner unlinks them)."""
        if self.experts is not None:
            self.experts.close()

    def release_experts(self) -> None:
        """Close and drop the expert backend and the engine, keeping the model's dense weights for a later
        `build_engine(spec, reuse=self)` (a benchmark frees the GPU memory of its resident experts before it fills
        the host store its next backends share). Only `build_engine(reuse=...)` takes this BuiltEngine after."""
        if self.model is None:
            raise ValueError("this built engine's model was handed over to another build_engine(reuse=...) already")
        experts, self.engine, self.experts = self.experts, None, None
        self.model.experts = None
        if experts is not None:
            experts.close()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _give_up_model(self) -> Any:
        """build_engine's `reuse`: the model handed over, its expert backend released first (so that its memory is
        free before the next one is built). This BuiltEngine is empty afterwards."""
        self.release_experts()
        model, self.model = self.model, None
        return model


def grammar_compiler(source: ModelSource) -> GrammarCompiler | None:
    """Structured output's grammar compiler over the model's tokenizer (None without a tokenizer.json); its
    tokenizer is built on the first constrained request."""
    if source.tokenizer is None:
        return None
    eos = set(source.eos_token_ids) | set(source.tokenizer.eos_token_ids)
    return GrammarCompiler.from_tokenizer(source.tokenizer.tokenizer, source.cfg.vocab_size, eos)


def kv_block_size(spec: EngineSpec) -> dict[str, int]:
    """EngineConfig's kv_block_size where the spec sets one (else the engine's default)."""
    return {} if spec.kv_block_size is None else {"kv_block_size": spec.kv_block_size}


def hybrid_options(spec: EngineSpec, base: HybridOptions | None = None) -> HybridOptions:
    """The cpu / hybrid backends' options: `base` (ft generate's CPU-side flags; default: the defaults) with the
    spec's reserved CPUs and pin setting."""
    return dataclasses.replace(base or HybridOptions(), reserve_cpus=spec.reserve_cpus,
                               pin_gpu_worker=spec.pin_gpu_worker == "on")


def pin_engine_process(spec: EngineSpec, hybrid: HybridOptions | None = None,
                       what: str = "the engine's process") -> tuple[int, ...] | None:
    """cpu / hybrid: pin this process (every thread) to the CPUs the CPU workers keep off, where the spec says so;
    the CPUs pinned to, or None (another strategy, or the pin is off)."""
    if not spec.uses_cpu_pool:
        return None
    return hybrid_options(spec, hybrid).pin_driving_process(what)


def build_engine(spec: EngineSpec, *, attachment: Attachment | None = None, source: ModelSource | None = None,
                 hybrid: HybridOptions | None = None, reuse: BuiltEngine | None = None, predictor: Any = None,
                 pin_driving_process: bool = True, process_name: str = "the engine's process") -> BuiltEngine:
    """The engine `spec` describes. `attachment`: the store (and CPU channels) to attach for offload / cpu /
    hybrid (None: offload makes its own store; cpu / hybrid need one). `source`: the checkpoint, already opened
    by the caller (it filled the store from it). `hybrid`: cpu / hybrid options beyond the spec's (ft generate's
    CPU-side flags; a benchmark's fetch fraction and rounding). `reuse`: an earlier build whose model (dense
    weights) this one takes over with a new expert backend; the spec's MODEL_FIELDS must equal its spec's, and
    `reuse` is empty afterwards. `predictor`: the lookahead prefetch's predictor (tests; None: the model's routers,
    or a replayed trace's candidates). pin_driving_process: cpu / hybrid: pin this process to the reserved CPUs once
    loaded, as the options say (`process_name` names it in the log)."""
    t0 = time.perf_counter()
    model = None
    if reuse is not None:
        fixed = [name for name in reuse.spec.differing(spec) if name in MODEL_FIELDS]
        if fixed or source is not None:
            what = f"{fixed[0]}={getattr(spec, fixed[0])!r}" if fixed else "source"
            raise SpecError(f"{what}: build_engine(reuse=...) keeps the earlier build's model; build_engine(spec) "
                            f"loads another")
        source, device = reuse.source, reuse.device
    else:
        device = resolve_device(spec.device)
    apply_setting(spec.pdl, spec.device)
    if source is None:
        source = open_model_source(spec.model, spec.preset, dtype=spec.dtype, seed=spec.seed_weights, device=device,
                                   expert_format=spec.expert_format)
    routing = _routing(spec, source, device)
    if reuse is not None:
        model = reuse._give_up_model()
    experts = _expert_backend(spec, source, device, attachment, hybrid_options(spec, hybrid)
                              if spec.uses_cpu_pool else None)
    prefetch = _prefetch(spec)
    if model is None:
        model = assemble_model(source, experts, device, prefetch, fused_kernels=spec.fused, routing=routing,
                               dense_linear=_dense_linear(spec, device), predictor=predictor)
    try:
        if reuse is not None:                         # the model taken over, with the new backend
            model.experts, model.routing_override = experts, routing
            model.dense_linear = _dense_linear(spec, device)
            attach_prefetch(model, prefetch, predictor)
        engine = _engine(model, spec, source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)          # the KV cache allocated: the load time covers it
    except BaseException:
        experts.close()
        raise
    if pin_driving_process:
        pin_engine_process(spec, hybrid, process_name)
    return BuiltEngine(engine, source, device, experts, time.perf_counter() - t0, spec, model)


def _expert_backend(spec: EngineSpec, source: ModelSource, device: torch.device, attachment: Attachment | None,
                    options: HybridOptions | None) -> ExpertBackend:
    common = dict(cache_size=spec.moe_cache_size, mode=spec.expert_compute, per_layer=spec.moe_cache_per_layer,
                  hybrid=options, split_copy=spec.expert_copy == "split", freq_weight=spec.eviction_freq_weight,
                  freq_half_life=spec.eviction_freq_half_life)
    if attachment is None:
        return make_expert_backend(spec.moe_strategy, source.experts, device, top_k=source.cfg.top_k, **common)
    return make_attached_expert_backend(spec.moe_strategy, source.experts, device, store_name=attachment.store_name,
                                        cpu_channels=attachment.cpu_channels, worker_info=attachment.worker_info,
                                        host=attachment.host, pool=attachment.pool, **common)


def _routing(spec: EngineSpec, source: ModelSource, device: torch.device) -> SyntheticRouting | None:
    """The synthetic routing table for the engine's whole context (None: the routers decide)."""
    max_context = context_tokens(spec.max_context_tokens, source.cfg)
    return SyntheticRouting.parse(spec.routing, source.cfg, max_context, device)


def _prefetch(spec: EngineSpec) -> PrefetchSettings:
    """The lookahead prefetch's settings (its budget and candidates kept when it is off: SetPolicy may turn it on)."""
    return PrefetchSettings(mode=spec.moe_prefetch, budget=spec.moe_prefetch_budget, k=spec.moe_prefetch_k,
                            verify=spec.moe_prefetch_verify)


def _dense_linear(spec: EngineSpec, device: torch.device) -> str:
    if spec.dense_linear == "auto":
        return "gemv" if device.type == "cuda" else "torch"
    return spec.dense_linear


def _engine(model: Any, spec: EngineSpec, source: ModelSource, grammars: GrammarCompiler | None = None) -> Engine:
    """The engine over `model` as `spec` says; `grammars`: an earlier engine's compiler over the same tokenizer (else
    a new one)."""
    return Engine(model, EngineConfig(max_running_requests=spec.max_running_requests,
                                      max_context_tokens=spec.max_context_tokens,
                                      prefill_chunk_tokens=spec.prefill_chunk_tokens,
                                      cuda_graphs=spec.cuda_graphs == "on", attention_backend=spec.attention_backend,
                                      slot_audit_every=spec.moe_slot_audit, overlap_decode=spec.overlap,
                                      kv_cache_gib=spec.kv_cache_gib, prefix_caching=spec.prefix_cache == "on",
                                      state_checkpoints=spec.state_checkpoints,
                                      **kv_block_size(spec)),
                  source.eos_token_ids, grammars if grammars is not None else grammar_compiler(source))
