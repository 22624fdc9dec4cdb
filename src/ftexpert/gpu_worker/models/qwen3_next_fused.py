"""The fused forward of `Qwen3NextModel` (``fused_kernels``; the CUDA default): the plain forward of qwen3_next.py
with its element-wise work in kernels/next_decode.

- every residual add fused into the next (1 + w) RMSNorm, the MoE's one with the shared expert's gate (its
  one-row GEMV too), the combine and, at decode sizes on the resident backend, the routed experts' sum over k (their
  per-route outputs: ExpertBackend.forward's `partials`): two launches a layer for what was ~25;
- Gated DeltaNet, decode steps: the conv update (state rows in place), splits and gates in one launch before the
  gated delta rule, RMSNormGated in one after it (gated_deltanet.py);
- gated attention: the (1 + w) q/k norms, the partial rotary embedding and the KV cache write in one launch, the
  sigmoid output gate in one;
- the router: softmax, top-k, renormalise and the rounding of the weights to the model dtype in one launch
  (kernels/moe_decode route_topk); the shared expert's silu * up inside its down projection's GEMV (one launch);
- the projections that read one input as one GEMV (qwen3_next_weights.fuse_next_projections): the router with the
  shared expert's gate and up, in_proj_qkvz with in_proj_ba, q with k and v.

Numerics: the plain forward's rounding points; the two differ only in the order of fp32 sums (norm statistics,
softmax sums, GEMV accumulation), so logits agree to rounding. On CPU the fused forward runs the kernels' torch
references unless ``kernel_impl = "triton"`` (the Triton interpreter, for tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels import dense_gemv, next_decode as kn

from ftexpert.gpu_worker.checkpoint.config import LINEAR_ATTENTION
from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import NextLayerWeights
from ftexpert.gpu_worker.models.gated_deltanet import gated_deltanet
from ftexpert.gpu_worker.models.model import AttentionContext


class NextFusedForward:
    """The fused forward's methods, mixed into `Qwen3NextModel` (which holds cfg, dense, experts, linear, ...)."""

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """x [T, H] embeddings -> logits [R, V] fp32; ctx: the StatefulContext."""
        cfg, eps, impl = self.cfg, self.cfg.rms_norm_eps, self.kernel_impl
        layers = self.dense.layers
        h = kn.rms_norm(x, layers[0].attn_norm, eps, impl=impl)                     # [T, H]
        for i, layer in enumerate(layers):
            if cfg.layer_types[i] == LINEAR_ATTENTION:
                mixed = gated_deltanet(cfg, layer, h, ctx.states, self.mixer_index[i], self.delta_impl, self.linear,
                                       kernel_impl=impl)
            else:
                mixed = self._attention_fused(self.mixer_index[i], layer, h, cos, sin, ctx.attn)
            x, h = kn.add_rms_norm(x, mixed, layer.mlp_norm, eps, impl=impl)
            routed, shared = self._moe_fused(i, layer, h, positions)
            after = layers[i + 1].attn_norm if i + 1 < len(layers) else self.dense.final_norm
            x, h = kn.add_rms_norm(x, routed, after, eps, shared=kn.SharedExpert(shared, h, layer.shared_expert_gate),
                                   impl=impl)
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)                                       # [R, H] (the norm is per row)
        return F.linear(h, self.dense.lm_head).float()                              # [R, V]

    def _attention_fused(self, kv_layer: int, layer: NextLayerWeights, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        cfg, impl = self.cfg, self.kernel_impl
        D = cfg.head_dim
        qg, k, v = self._qkv(layer, h)                                              # qg per head: query, gate
        kv = attn.kv_write(kv_layer, v)                                             # the KV write fused into rope
        q, k = kn.qk_norm_partial_rope(qg[..., :D], k, layer.q_norm, layer.k_norm, cos, sin, cfg.rms_norm_eps,
                                       kv=kv, impl=impl)
        out = attn.attend(kv_layer, q, k, v, kv_written=kv is not None)            # [T, Hq, D]
        return self.linear(kn.sigmoid_gate(out, qg[..., D:], impl=impl), layer.o_proj)   # [T, H]

    def _moe_fused(self, i: int, layer: NextLayerWeights, h: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the routed experts' output [T, H] or per-route outputs [T, K, H] fp32, the shared expert's output before
        its gate [T, H])."""
        cfg, impl = self.cfg, self.kernel_impl
        logits, gate, up = self._moe_inputs(layer, h)
        ids, weights = kn.route_topk(logits, cfg.top_k, softmax_first=True, renorm=cfg.norm_topk_prob,
                                     round_weights=True, impl=impl)                 # [T, K] each
        if self.routing_override is not None:
            ids = self.routing_override.ids(i, positions)
        # [T, H], or at decode sizes the resident backend's weighted per-route outputs [T, K, H] fp32, which the
        # next add_rms_norm sums (one launch fewer a layer)
        routed = self.experts.forward(i, h, ids, weights, partials=True)
        return routed, self.linear_glu(gate, up, layer.shared_down_proj)

    def linear_glu(self, gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The shared expert's down projection of silu(gate) * up: one launch where the decode GEMV is taken
        (kernels/dense_gemv with the gated input made in the kernel, the roundings of next_decode's silu_mul), else
        the activation kernel, then the projection."""
        if self.dense_linear == "gemv" and dense_gemv.preferred(gate.shape[0], w.shape[0]):
            return dense_gemv.linear_gemv(gate, w, impl=self.kernel_impl, up=up)
        return self.linear(kn.silu_mul(gate, up, impl=self.kernel_impl), w)
