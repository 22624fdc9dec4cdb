"""`GptOssModel`: the gpt-oss decoder forward (``GptOssForCausalLM``) over a flat batch of tokens.

Same contract as `MoeModel` (model.py): attention is delegated to an `AttentionContext`, the routed experts to
an `ExpertBackend`. What differs, as in transformers' modeling_gpt_oss:
- q/k/v/o projections with biases (``attention_bias``);
- attention sinks (one logit per head in every softmax's denominator) and, per layer, a sliding window
  (``sliding_attention``: the last ``window`` keys) or full attention: ``attend(..., sinks=, sliding_window=)``;
- YaRN rotary frequencies with their attention scaling on cos / sin (layers.py: rotary_table);
- the router: top-k of the biased logits, softmax over those k;
- the experts' clamped SwiGLU with biases, carried by the expert rows (layout.act: proto/expert_act.py), so every
  backend (resident, offload, cpu, hybrid) computes it.

Two forwards with the same rounding points, as for `MoeModel`: the plain torch one and the fused one
(``fused_kernels``, the CUDA default): MoeModel's fused loop with gpt-oss's fp32-weight RMSNorm fused with the
residual adds (kernels/next_decode, offset 0), the rotary embedding and the KV cache write in one launch
(kernels/moe_decode rope; the sinks and windows stay in the attention), the router's top-k and softmax (rounded to
the model dtype) in one launch, and one biased GEMM for q, k and v (dense_tensors.fuse_qkv); its decode-sized
projections (q/k/v, o, the router) go through kernels/dense_gemv with their biases where MoeModel's do
(`dense_linear`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ftexpert.kernels import moe_decode as kops
from ftexpert.kernels import next_decode as kn

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights, LayerWeights, fuse_qkv
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import gpt_oss_params
from ftexpert.gpu_worker.models.gpt_oss_layers import gpt_oss_rms_norm as rms_norm, gpt_oss_route
from ftexpert.gpu_worker.models.layers import apply_rope
from ftexpert.gpu_worker.models.model import AttentionContext, MoeModel


class GptOssModel(MoeModel):
    def __init__(self, cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int,
                 fused_kernels: bool | None = None):
        if not experts.layout.act.bias:
            raise ValueError(f"a gpt-oss model needs experts with gpt-oss's biased clamped SwiGLU; the backend's "
                             f"experts compute {experts.layout.act.label}")
        self.params = gpt_oss_params(cfg)
        super().__init__(cfg, dense, experts, max_positions, fused_kernels=False)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else bool(fused_kernels)
        if self.fused_kernels:
            fuse_qkv(dense)                              # one biased GEMM for q, k and v
        for i, layer in enumerate(dense.layers):
            if layer.sinks is None or layer.router_bias is None:
                raise ValueError(f"gpt-oss layer {i} lacks its attention sinks or router bias")
        # the rotary table: MoeModel's, YaRN from cfg.rope_scaling (layers.rotary_table)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids, positions [T] int64 (device) -> logits [R, V] float32 (see MoeModel.forward)."""
        eps = self.cfg.rms_norm_eps
        x = F.embedding(token_ids, self.dense.embed)                    # [T, H]
        cos, sin = self.rope.lookup(positions, self.dtype)              # [T, 1, D]
        if self.fused_kernels:
            return self._forward_fused(x, positions, cos, sin, attn, logit_rows)
        for i, layer in enumerate(self.dense.layers):
            x = x + self._attention(i, layer, rms_norm(x, layer.attn_norm, eps), cos, sin, attn)
            x = x + self._moe(i, layer, rms_norm(x, layer.mlp_norm, eps), positions)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)                           # [R, H]
        x = rms_norm(x, self.dense.final_norm, eps)
        return F.linear(x, self.dense.lm_head).float()                  # [R, V]

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attn: AttentionContext, fused: bool = False) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        if fused and layer.qkv_proj is not None:        # one GEMM (dense_tensors.fuse_qkv): strided views
            kv_size = cfg.num_kv_heads * cfg.head_dim
            q, k, v = self._linear(h, layer.qkv_proj, layer.qkv_bias).split([cfg.q_size, kv_size, kv_size], dim=1)
        else:
            q, k, v = (F.linear(h, layer.q_proj, layer.q_bias), F.linear(h, layer.k_proj, layer.k_bias),
                       F.linear(h, layer.v_proj, layer.v_bias))
        q = q.view(T, cfg.num_heads, cfg.head_dim)                                             # [T, Hq, D]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)                                          # [T, Hkv, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)                                          # [T, Hkv, D]
        kv = attn.kv_write(i, v) if fused else None          # the fused forward: the KV write inside the rope kernel
        if fused:
            q, k = kops.rope(q, k, cos, sin, impl=self.kernel_impl, kv=kv)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(i, q, k, v, kv_written=kv is not None, sinks=layer.sinks,
                          sliding_window=self.params.layer_window(i))
        if fused:
            return self._linear(out.reshape(T, cfg.q_size), layer.o_proj, layer.o_bias)        # [T, H]
        return F.linear(out.reshape(T, cfg.q_size), layer.o_proj, layer.o_bias)               # [T, H]

    def _moe(self, i: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor,
             fused: bool = False) -> torch.Tensor:
        if fused:                       # top-k of the biased logits, softmax over those k rounded to their dtype
            topk_ids, topk_weights = kops.route_topk(self._linear(h, layer.router, layer.router_bias), self.cfg.top_k,
                                                     softmax_first=False, round_weights=True, impl=self.kernel_impl)
        else:
            topk_ids, topk_weights = gpt_oss_route(h, layer.router, layer.router_bias, self.cfg.top_k)
        if self.routing_override is not None:
            topk_ids = self.routing_override.ids(i, positions)
        # fused: at decode sizes the resident backend's per-route outputs [T, K, H] fp32, summed by the next
        # add_rms_norm (kernels/next_decode; one launch fewer a layer); else [T, H]
        return self.experts.forward(i, h, topk_ids, topk_weights, partials=fused)

    # -- the fused forward: MoeModel._forward_fused over these -------------------------------------------------
    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps, impl = self.cfg.rms_norm_eps, self.kernel_impl
        if delta is None:
            return x, kn.rms_norm(x, weight, eps, offset=0.0, impl=impl)
        return kn.add_rms_norm(x, delta, weight, eps, offset=0.0, impl=impl)

    def _attention_fused(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        return self._attention(i, layer, h, cos, sin, attn, fused=True)

    def _moe_fused(self, i: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._moe(i, layer, h, positions, fused=True)
