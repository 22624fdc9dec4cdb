"""One MoE layer's CPU share: the torch path and the compiled path behind one interface.

``ExpertKernel(store, kernel=..., num_threads=...)(layer, hidden, token_idx, expert_id, weight, out)``
computes out[:T] = sum_k weight_k * FFN_{expert_k}(hidden[token_k]) in fp32, reading every used
expert's bytes once (triples are grouped by expert), weights in place from the store. A split
(``split_expert=e, split_limit=c``, c > 0) computes expert e over its intermediate channels [0, c) only
(gate/up rows [0, c), down columns [0, c)): the GPU adds the rest; c = 0 means no split.

Kernels: ``torch`` (bf16 F.linear per expert; always available, the fallback), ``native-<isa>``
(cpu_expert_pool/native/expert_ffn.c: amx_bf16, avx512_bf16, avx512, avx2, scalar), ``native`` (best ISA
here), ``auto`` (native when it builds, else torch, with a log line saying why).

Quantized stores (``store.expert_format``: fp8, int4-g*, mxfp4, nvfp4) use native/quant_ffn.c, which
dequantizes in registers to fp32 and has avx512, avx2 and scalar paths (no avx512_bf16 or AMX one: the
dequantized weights are fp32); ``native`` there means the best of those three.
Activations of the 4-bit formats (int4, mxfp4, nvfp4) on the AVX-512 path: ``act_quant`` (the worker's
``--act-quant``). ``int8`` quantizes them to int8 in blocks of 16 with an fp32 scale and takes integer dot products
(AVX-512 VNNI; native/quant_int8.h): about twice the speed where the fp32 path is compute-bound, at a relative
error docs/QUANTIZATION.md states ("CPU activations"). ``fp32`` keeps them fp32 (the reference's numerics to
fp32 rounding). ``auto`` (the default) is int8 where the CPU has AVX-512 VNNI and the store a 4-bit format, else
fp32; other formats and ISAs always run fp32.
Biased experts with gpt-oss's clamped SwiGLU (``store.shape.expert_act``, proto/expert_act.py) run in both compiled
kernels, every ISA and format: they read the biases from the end of each expert row (native/act_desc.py describes
the activation and where the biases are), add the gate / up biases before the clamp and out += w * (down . h +
b_down), the reference's order. They are never split by channels (the down bias belongs to one side).
Legend: T tokens, H hidden, I intermediate, E experts, n triples, B tokens of one expert, c split_limit.
"""
from __future__ import annotations

import dataclasses
import logging
from functools import partial

import torch
import torch.nn.functional as F

from ftexpert.cpu_expert_pool.native.act_desc import ExpertActDesc, expert_act_desc
from ftexpert.cpu_expert_pool.native.build import ISA_BY_NAME, ISA_NAMES, NativeLib, try_load_native
from ftexpert.cpu_expert_pool.native.quant_desc import INT8_FORMATS, QuantFormatDesc, quant_format_desc
from ftexpert.cpu_expert_pool.native_loop import NativeServeLoop
from ftexpert.kernels.expert_reference import apply_act, dequantize_expert
from ftexpert.proto.expert_store import ExpertStore
from ftexpert.proto.shm_layout import SPLIT_CHANNEL_UNIT

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "native", *(f"native-{name}" for name in ISA_BY_NAME))
ACT_QUANTS = ("auto", "fp32", "int8")      # the 4-bit formats' activations on the AVX-512 path (see above)
QUANT_TOP_ISA = ISA_BY_NAME["avx512"]      # quant_ffn.c's widest path


@dataclasses.dataclass(frozen=True)
class LayerStats:
    num_experts: int        # distinct experts computed
    weight_bytes: int       # expert bytes read (a split expert: its c channels' rows only)


def check_split(store: ExpertStore, split_expert: int, split_limit: int) -> None:
    """split_limit 0: no split (split_expert ignored); else 0 < c < I, a multiple of SPLIT_CHANNEL_UNIT,
    and 0 <= split_expert < E. Raises ValueError naming the bad value."""
    if split_limit == 0:
        return
    if store.shape.expert_act.bias:
        raise ValueError(f"CPU expert kernel: {store.shape.act} experts have biases and are not split by channels "
                         f"(split_limit {split_limit}); use a fetch_round other than split")
    inter = store.shape.intermediate
    if not 0 < split_limit < inter:
        raise ValueError(f"CPU expert kernel: split_limit {split_limit} is outside (0, I={inter}) (0: no split)")
    if split_limit % SPLIT_CHANNEL_UNIT:
        raise ValueError(f"CPU expert kernel: split_limit {split_limit} is not a multiple of {SPLIT_CHANNEL_UNIT}")
    if not 0 <= split_expert < store.num_experts:
        raise ValueError(f"CPU expert kernel: split_expert {split_expert} is outside [0, {store.num_experts}) "
                         f"with split_limit {split_limit}")


def expert_weights(store: ExpertStore, layer: int, expert: int,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) of one expert: zero-copy views (bf16 format; cast to ``dtype`` when given), or its
    bytes dequantized (kernels.expert_reference.dequantize_expert, float32) and cast to ``dtype`` (default: the store's
    model dtype)."""
    dtype = store.dtype if dtype is None else dtype
    if not store.expert_format.quantized:
        w13, w2 = store.expert_views(layer, expert)
        return w13.to(dtype), w2.to(dtype)
    gate, up, down = dequantize_expert(store.expert_bytes_view(layer, expert), store.shape.quant_layout)
    return torch.cat((gate, up)).to(dtype), down.to(dtype)


def torch_moe_layer(store: ExpertStore, layer: int, hidden: torch.Tensor, token_idx: torch.Tensor,
                    expert_id: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, split_expert: int = -1,
                    split_limit: int = 0) -> LayerStats:
    """hidden [T, H] bf16/fp32, token_idx/expert_id [n] int32, weight [n] fp32, out [T, H] fp32 (overwritten);
    split_limit > 0: expert split_expert over channels [0, split_limit) only."""
    _check_triples(store, hidden.shape[0], token_idx, expert_id)
    check_split(store, split_expert, split_limit)
    out.zero_()
    if token_idx.numel() == 0:
        return LayerStats(0, 0)
    inter = store.shape.intermediate
    channel_bytes = store.expert_bytes // inter                          # 3 rows of H: gate, up, down (and scales)
    x = hidden.to(store.dtype)                                           # [T, H]
    act = store.shape.expert_act
    order = torch.argsort(expert_id, stable=True)
    experts, counts = torch.unique_consecutive(expert_id[order], return_counts=True)
    start, num_bytes = 0, 0
    for e, count in zip(experts.tolist(), counts.tolist()):
        rows = order[start:start + count]
        start += count
        toks = token_idx[rows].long()                                    # [B]
        w13, w2 = expert_weights(store, layer, e)                        # [2I, H], [H, I] (dequantized)
        c = split_limit if split_limit and e == split_expert else inter
        if c < inter:                                                    # prefix of the channels
            w13, w2 = torch.cat((w13[:c], w13[inter:inter + c])), w2[:, :c]   # [2c, H], [H, c]
        if act.bias:                                                     # never split (check_split)
            b13, b2 = store.expert_biases(layer, e)                      # [2I], [H]
            h = apply_act(F.linear(x[toks], w13, b13), act)              # [B, I]
            y = F.linear(h, w2, b2)                                      # [B, H]
        else:
            gate_up = F.linear(x[toks], w13)                             # [B, 2c]
            h = F.silu(gate_up[:, :c]) * gate_up[:, c:]                  # [B, c]
            y = F.linear(h, w2)                                          # [B, H]
        out.index_add_(0, toks, y.float() * weight[rows, None])
        num_bytes += store.expert_bytes if c == inter else c * channel_bytes    # whole: biases and padding too
    return LayerStats(len(counts), num_bytes)


def _check_triples(store: ExpertStore, num_tokens: int, token_idx: torch.Tensor, expert_id: torch.Tensor) -> None:
    if token_idx.numel() and (int(token_idx.min()) < 0 or int(token_idx.max()) >= num_tokens):
        raise ValueError(f"CPU expert kernel: a token index is outside [0, {num_tokens})")
    if expert_id.numel() and (int(expert_id.min()) < 0 or int(expert_id.max()) >= store.num_experts):
        raise ValueError(f"CPU expert kernel: an expert id is outside [0, {store.num_experts})")


class ExpertKernel:
    """The kernel a CPU worker uses; construct once per process (sets thread counts)."""

    def __init__(self, store: ExpertStore, *, kernel: str = "auto", num_threads: int = 1, act_quant: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"kernel {kernel!r} is not known; choose one of {', '.join(KERNELS)}")
        if act_quant not in ACT_QUANTS:
            raise ValueError(f"act_quant {act_quant!r} is not known; choose one of {', '.join(ACT_QUANTS)}")
        if num_threads <= 0:
            raise ValueError(f"num_threads must be > 0, got {num_threads}")
        self.store = store
        self.num_threads = num_threads
        self._native: NativeLib | None = None
        self._isa = -1
        fmt = store.expert_format
        self._quant: QuantFormatDesc | None = quant_format_desc(store.shape.quant_layout) if fmt.quantized else None
        self._act: ExpertActDesc | None = expert_act_desc(store.shape)     # None: silu without biases
        if kernel != "torch":
            self._native, why = try_load_native()
            if self._native is None:
                if kernel != "auto":
                    raise RuntimeError(f"kernel {kernel!r} unavailable: {why}")
                log.warning("compiled CPU expert kernel unavailable, using torch: %s", why)
        if self._native is not None:
            top = min(self._native.best_isa, QUANT_TOP_ISA) if fmt.quantized else self._native.best_isa
            if not fmt.quantized and store.dtype != torch.bfloat16:
                if kernel != "auto":
                    raise ValueError(f"the compiled kernel reads bf16 weights; this store is {store.dtype}: "
                                     "use --kernel torch")
                self._native = None
            elif kernel in ("auto", "native"):
                self._isa = top
            else:
                self._isa = ISA_BY_NAME[kernel.removeprefix("native-")]
                if fmt.quantized and self._isa > QUANT_TOP_ISA:
                    raise ValueError(f"kernel {kernel!r}: the {fmt.label} kernel has no {ISA_NAMES[self._isa]} path "
                                     "(it dequantizes to fp32 and runs AVX-512F there); use --kernel native or "
                                     "native-avx512")
                if self._isa > self._native.best_isa:
                    raise ValueError(f"kernel {kernel!r} needs {ISA_NAMES[self._isa]}, this CPU tops out at "
                                     f"{self._native.best_isa_name}; use --kernel native")
        self.act_int8 = self._pick_act_int8(act_quant)
        if self.act_int8:
            self._quant = quant_format_desc(store.shape.quant_layout, act_int8=True)
        torch.set_num_threads(num_threads)

    def _pick_act_int8(self, act_quant: str) -> bool:
        """int8 activations where act_quant asks for them (auto: wherever they run); ValueError where "int8" cannot."""
        if act_quant == "fp32":
            return False
        fmt = self.store.expert_format
        why = (f"the {fmt.label} store is not a 4-bit format ({', '.join(INT8_FORMATS)})"
               if fmt.name not in INT8_FORMATS else "the compiled kernel is not in use" if self._native is None
               else f"the kernel runs {ISA_NAMES[self._isa]}, not avx512" if self._isa != QUANT_TOP_ISA
               else "this CPU has no AVX-512 VNNI" if not self._native.quant.int8_available else "")
        if why and act_quant == "int8":
            raise ValueError(f"act_quant 'int8' unavailable: {why}; use act_quant 'fp32' or 'auto'")
        return not why

    @property
    def activations(self) -> str:
        """How the activations enter the dot products: "int8" (quant_int8.h) or "fp32"."""
        return "int8" if self.act_int8 else "fp32"

    @property
    def name(self) -> str:
        return "torch" if self._native is None else f"native-{ISA_NAMES[self._isa]}"

    def serve_loop(self, channel, *, split, worker_index: int):
        """The C loop (cpu_expert_pool/native_loop.py) around this kernel for `channel`, or None with the
        torch kernel (the Python loop then serves)."""
        if self._native is None:
            return None
        return NativeServeLoop(self._native, channel, self.store, isa=self._isa, num_threads=self.num_threads,
                               split=split, worker_index=worker_index, quant_format=self._quant, act=self._act)

    def pin_threads(self, cpus: list[int]) -> bool:
        """Pin compute thread i to cpus[i] (needs the compiled library; best effort)."""
        if self._native is None or len(cpus) != self.num_threads:
            return False
        return self._native.pin_threads(list(cpus)) == 0

    def __call__(self, layer: int, hidden: torch.Tensor, token_idx: torch.Tensor, expert_id: torch.Tensor,
                 weight: torch.Tensor, out: torch.Tensor, split_expert: int = -1, split_limit: int = 0) -> LayerStats:
        """hidden [T, H] bf16/fp32 contiguous; token_idx/expert_id [n] int32; weight [n] fp32; out [T, H] fp32;
        split_limit > 0: expert split_expert over channels [0, split_limit) only (check_split)."""
        num_tokens, hidden_size = hidden.shape
        if hidden_size != self.store.shape.hidden or tuple(out.shape) != (num_tokens, hidden_size):
            raise ValueError(f"hidden {tuple(hidden.shape)} / out {tuple(out.shape)} do not match H="
                             f"{self.store.shape.hidden}")
        check_split(self.store, split_expert, split_limit)
        if self._native is None:
            return torch_moe_layer(self.store, layer, hidden, token_idx, expert_id, weight, out, split_expert,
                                   split_limit)
        for t, dtype in ((token_idx, torch.int32), (expert_id, torch.int32), (weight, torch.float32),
                         (out, torch.float32)):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"compiled kernel needs contiguous {dtype} triples and out, got {t.dtype}")
        if hidden.dtype not in (torch.bfloat16, torch.float32) or not hidden.is_contiguous():
            raise ValueError(f"hidden must be contiguous bf16 or fp32, got {hidden.dtype}")
        if not 0 <= layer < self.store.num_layers:
            raise IndexError(f"layer {layer} is outside the store's {self.store.num_layers} layers")
        n = token_idx.numel()
        if expert_id.numel() != n or weight.numel() != n:
            raise ValueError("token_idx, expert_id and weight must have the same length")
        shape = self.store.shape
        call = self._native.moe_layer if self._quant is None else partial(self._native.quant.moe_layer, self._quant)
        groups, num_bytes = call(
            self._isa, self.num_threads, self.store.data_ptr + self.store.expert_offset(layer, 0),
            self.store.expert_stride, shape.num_experts, shape.hidden, shape.intermediate, hidden.data_ptr(),
            hidden.dtype == torch.bfloat16, num_tokens, token_idx.data_ptr(), expert_id.data_ptr(),
            weight.data_ptr(), n, out.data_ptr(), split_expert, split_limit, act=self._act)
        return LayerStats(groups, num_bytes)
