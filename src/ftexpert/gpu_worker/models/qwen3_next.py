"""`Qwen3NextModel`: the forward of ``Qwen3NextForCausalLM`` over a flat batch of tokens.

Layers follow ``cfg.layer_types``: a ``linear_attention`` layer is a Gated DeltaNet (gated_deltanet.py: a short
causal conv1d, the gated delta rule with its recurrent state, an output gate through RMSNormGated); a
``full_attention`` layer is gated attention (q with an output gate, per-head (1 + w) q/k norms, rotary embeddings
on the first ``partial_rotary_factor`` of each head, the service's KV cache through the `AttentionContext`). Every
layer's FFN is the routed MoE through the `ExpertBackend` (so offload / cpu / hybrid serve its experts) plus a
shared expert scaled by ``sigmoid(shared_expert_gate . x)``. Its RMSNorms compute ``(1 + w) * norm(x)`` in fp32.
Two forwards with the same rounding points, as for `MoeModel`: the plain torch one below (the CPU default) and
the fused one (``fused_kernels``, the CUDA default: qwen3_next_fused.py, kernels/next_decode).

The per-sequence state of the linear layers comes with the attention context: the engine passes a
`StatefulContext` (its KV context and the rows of its state cache, engine/state_cache.py). The model keeps no state
of its own between calls. Shapes: T tokens, H hidden, Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ftexpert.kernels import dense_gemv
from ftexpert.kernels.next_decode.reference import apply_partial_rope, offset_rms_norm as next_rms_norm

from ftexpert.gpu_worker.checkpoint.config import LINEAR_ATTENTION, MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.models.gated_deltanet import gated_deltanet
from ftexpert.gpu_worker.models.layers import rotary_table, route
from ftexpert.gpu_worker.models.model import AttentionContext, DenseLinearChoice
from ftexpert.gpu_worker.models.qwen3_next_fused import NextFusedForward
from ftexpert.gpu_worker.checkpoint.qwen3_next_config import rotary_dim
from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import NextLayerWeights, fuse_next_projections


class SequenceStates(Protocol):
    """The recurrent and convolution state of the sequences in one forward (rows of the state cache)."""
    num_seqs: int       # B: the forward's T tokens are B sequences of T / B consecutive tokens each

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear layer ``layer`` (its ordinal among the linear layers) -> (conv [B, C, K-1] in the model dtype,
        recurrent [B, Hv, Dk, Dv] fp32) of these sequences."""

    def write(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Store these sequences' new states (same shapes as `read`)."""

    def conv_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step: (the layer's conv cache [N, C, K-1], these sequences' rows [B] int64 in it), for a kernel
        that updates the rows in place instead of `read` / `write` of the conv state; None where it cannot."""

    def recurrent_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step: (the layer's recurrent cache [N, Hv, Dk, Dv] fp32, these sequences' rows [B] int64 in it),
        for a kernel that advances the rows in place instead of `read_recurrent` / `write_recurrent`; None where it
        cannot."""

    def read_recurrent(self, layer: int) -> torch.Tensor:
        """The recurrent half of `read`."""

    def write_recurrent(self, layer: int, recurrent: torch.Tensor) -> None:
        """The recurrent half of `write`."""


@dataclass
class StatefulContext:
    """What a qwen3_next forward attends through: the KV context of its attention layers (indexed by their
    ordinal among the full-attention layers) and the state rows of its linear layers."""
    attn: AttentionContext
    states: SequenceStates


class Qwen3NextModel(NextFusedForward, DenseLinearChoice):
    def __init__(self, cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int,
                 fused_kernels: bool | None = None):
        """fused_kernels: the fused forward (qwen3_next_fused.py: kernels/next_decode); None: on CUDA only. When on,
        the projections that read one input are concatenated in place (qwen3_next_weights.fuse_next_projections)."""
        if cfg.arch != "qwen3_next":
            raise ValueError(f"Qwen3NextModel serves qwen3_next, not {cfg.arch!r} (use MoeModel)")
        if experts.num_layers != cfg.num_layers or experts.num_experts != cfg.num_experts:
            raise ValueError(f"expert backend has {experts.num_layers} layers x {experts.num_experts} "
                             f"experts; the model needs {cfg.num_layers} x {cfg.num_experts}")
        if len(dense.layers) != cfg.num_layers or not all(isinstance(w, NextLayerWeights) for w in dense.layers):
            raise ValueError("Qwen3NextModel needs qwen3_next dense weights (qwen3_next_weights.py)")
        self.cfg, self.dense, self.experts = cfg, dense, experts
        self.device = dense.embed.device
        self.dtype = dense.embed.dtype
        self.rotary_dim = rotary_dim(cfg)
        self.rope = rotary_table(cfg, self.rotary_dim, max_positions, self.device)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else bool(fused_kernels)
        self.kernel_impl = "auto"         # kernels.next_decode / moe_decode impl of the fused forward ("triton": tests)
        self.delta_impl = "auto"          # kernels.gated_delta impl: "auto" | "fla" | "reference"
        # the dense projections at decode sizes: "gemv" (kernels/dense_gemv, on CUDA) or "torch" (F.linear)
        self._dense_linear = "gemv" if self.device.type == "cuda" else "torch"
        self.routing_override = None      # benchmarks of random-weight presets (synthetic_routing.py)
        # layer -> its ordinal among the layers of its kind (KV cache layer / state cache layer)
        self.mixer_index: list[int] = []
        counts = {"linear": 0, "full": 0}
        for t in cfg.layer_types:
            kind = "linear" if t == LINEAR_ATTENTION else "full"
            self.mixer_index.append(counts[kind])
            counts[kind] += 1
        self.num_linear_layers, self.num_full_layers = counts["linear"], counts["full"]
        if self.fused_kernels:
            fuse_next_projections(dense)

    def linear(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A dense projection: kernels.dense_gemv where it beats cuBLAS (``dense_linear`` "gemv": one decode token,
        router-sized outputs to 4), else F.linear."""
        if self._dense_linear == "gemv" and dense_gemv.preferred(h.shape[0], w.shape[0]):
            return dense_gemv.linear_gemv(h, w, impl=self.kernel_impl)
        return F.linear(h, w)

    def ensure_positions(self, max_positions: int) -> None:
        if self.rope.max_positions < max_positions:
            self.rope = rotary_table(self.cfg, self.rotary_dim, max_positions, self.device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: StatefulContext,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids, positions [T] int64 -> logits [R, V] fp32 (R = len(logit_rows), or T)."""
        if not isinstance(attn, StatefulContext):
            raise TypeError(f"Qwen3NextModel.forward needs a StatefulContext (KV context + linear-layer states), "
                            f"got {type(attn).__name__}; the engine builds one from its state cache")
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x = F.embedding(token_ids, self.dense.embed)                    # [T, H]
        cos, sin = self.rope.lookup(positions, self.dtype)              # [T, 1, R]
        if self.fused_kernels:
            return self._forward_fused(x, positions, cos, sin, attn, logit_rows)
        for i, layer in enumerate(self.dense.layers):
            h = next_rms_norm(x, layer.attn_norm, eps)
            if cfg.layer_types[i] == LINEAR_ATTENTION:
                x = x + gated_deltanet(cfg, layer, h, attn.states, self.mixer_index[i], self.delta_impl,
                                       self.linear)
            else:
                x = x + self._attention(self.mixer_index[i], layer, h, cos, sin, attn.attn)
            x = x + self._moe(i, layer, next_rms_norm(x, layer.mlp_norm, eps), positions)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)                           # [R, H]
        x = next_rms_norm(x, self.dense.final_norm, eps)
        return F.linear(x, self.dense.lm_head).float()                  # [R, V]

    def _attention(self, kv_layer: int, layer: NextLayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        cfg = self.cfg
        qg, k, v = self._qkv(layer, h)
        q, gate = qg.chunk(2, dim=-1)                                    # [T, Hq, D] each
        q = next_rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
        k = next_rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        out = attn.attend(kv_layer, q.contiguous(), k.contiguous(), v)  # [T, Hq, D]
        T = h.shape[0]
        out = out.reshape(T, cfg.q_size) * torch.sigmoid(gate.reshape(T, cfg.q_size))
        return self.linear(out, layer.o_proj)                              # [T, H]

    def _qkv(self, layer: NextLayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A full-attention layer's projections -> q with its gate [T, Hq, 2D] (per head D query, then D gate
        values), k, v [T, Hkv, D]: one GEMM where they are fused (fuse_next_projections; strided views), else three."""
        cfg = self.cfg
        T, Hq, Hkv, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if layer.qkv_proj is not None:
            qg, k, v = self.linear(h, layer.qkv_proj).split([2 * Hq * D, Hkv * D, Hkv * D], dim=1)
        else:
            qg, k, v = self.linear(h, layer.q_proj), self.linear(h, layer.k_proj), self.linear(h, layer.v_proj)
        return qg.view(T, Hq, 2 * D), k.view(T, Hkv, D), v.view(T, Hkv, D)

    def _moe_inputs(self, layer: NextLayerWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE's projections of its input -> router logits [T, E], shared expert gate and up [T, Is]: one GEMM
        where they are fused (fuse_next_projections; strided views), else three."""
        if layer.moe_in_proj is not None:
            E, Is = self.cfg.num_experts, self.cfg.shared_expert_intermediate_size
            logits, gate, up = self.linear(h, layer.moe_in_proj).split([E, Is, Is], dim=1)
            return logits, gate, up
        return (F.linear(h, layer.router), self.linear(h, layer.shared_gate_proj),     # the router as route() ran it
                self.linear(h, layer.shared_up_proj))

    def _moe(self, i: int, layer: NextLayerWeights, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits, gate, up = self._moe_inputs(layer, h)
        topk_ids, topk_weights = route(self.cfg, h, layer.router, logits=logits)   # [T, K], [T, K]
        if self.routing_override is not None:
            topk_ids = self.routing_override.ids(i, positions)
        # the weights rounded to the model dtype first, as transformers does; the backends take fp32
        routed = self.experts.forward(i, h, topk_ids, topk_weights.to(h.dtype).float())   # [T, H]
        act = F.silu(gate) * up
        shared = self.linear(act, layer.shared_down_proj)
        return routed + torch.sigmoid(self.linear(h, layer.shared_expert_gate)) * shared
