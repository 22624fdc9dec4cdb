"""`MoeModel`: the decoder forward over a flat batch of tokens.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head_dim, E experts, K top-k, V vocab.
The model knows nothing about KV caches or batching: attention is delegated to an
`AttentionContext` (engine/attention.py builds one per step), experts to an `ExpertBackend`.
Nothing in ``forward`` syncs with the host except what those two choose to do.

Two forwards, same math and rounding points (layers.py):
- plain torch (``fused_kernels=False``; the CPU default);
- fused (``fused_kernels=True``; the CUDA default): kernels/moe_decode's one-launch RMSNorm, residual
  add + next RMSNorm, qwen3 q/k norm + rope (rope alone for mixtral / olmoe), top-k routing, and one
  GEMM for q, k and v (dense_weights.fuse_qkv). They differ from the plain forward only in the order
  of fp32 sums (norm statistics, router softmax / renorm sums, GEMM accumulation), so logits agree
  to rounding, not always bit for bit. On CPU the fused forward runs the kernels' torch references
  unless ``kernel_impl = "triton"`` (the Triton interpreter, for tests).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ftexpert.kernels import dense_gemv
from ftexpert.kernels import moe_decode as kops

from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_tensors import DenseWeights, LayerWeights, fuse_qkv
from ftexpert.gpu_worker.models.layers import apply_rope, rms_norm, rotary_table, route
from ftexpert.gpu_worker.backends.expert_backend import ExpertBackend


class AttentionContext(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               kv_written: bool = False) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after rope) -> [T, Hq, D]; stores k/v where it keeps them,
        unless `kv_written` (the rope kernel already wrote them where `kv_write` said)."""

    def kv_write(self, layer_idx: int, v: torch.Tensor) -> "kops.KvWrite | None":
        """Where the fused rope kernel may write this layer's k and v itself (None: attend writes them)."""


class DenseLinearChoice:
    """The ``dense_linear`` switch of a forward: its decode-sized dense projections through kernels/dense_gemv
    ("gemv") or F.linear ("torch")."""
    DENSE_LINEARS = ("gemv", "torch")
    _dense_linear: str

    @property
    def dense_linear(self) -> str:
        return self._dense_linear

    @dense_linear.setter
    def dense_linear(self, value: str) -> None:
        if value not in self.DENSE_LINEARS:
            raise ValueError(f"dense_linear must be one of {', '.join(self.DENSE_LINEARS)}, got {value!r}")
        self._dense_linear = value


class MoeModel(DenseLinearChoice):
    def __init__(self, cfg: MoeConfig, dense: DenseWeights, experts: ExpertBackend, max_positions: int,
                 fused_kernels: bool | None = None):
        """fused_kernels: the fused forward (see the module docstring); None: on CUDA only. When on,
        q/k/v projections are concatenated in place (dense_weights.fuse_qkv)."""
        if cfg.arch == "gptoss" and type(self) is MoeModel:
            raise TypeError("gpt-oss checkpoints run gpu_worker.models.gpt_oss.GptOssModel (architectures.make_model)")
        if experts.num_layers != cfg.num_layers or experts.num_experts != cfg.num_experts:
            raise ValueError(f"expert backend has {experts.num_layers} layers x {experts.num_experts} "
                             f"experts; the model needs {cfg.num_layers} x {cfg.num_experts}")
        self.cfg, self.dense, self.experts = cfg, dense, experts
        self.device = dense.embed.device
        self.dtype = dense.embed.dtype
        self.rope = rotary_table(cfg, cfg.head_dim, max_positions, self.device)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else bool(fused_kernels)
        self.kernel_impl = "auto"     # kernels.moe_decode impl of the fused forward ("triton": tests)
        # the fused forward's dense projections (qkv, o_proj, router) where kernels/dense_gemv beats cuBLAS
        # (dense_gemv.preferred: T = 1, the router to T = 4): "gemv" (on CUDA) or "torch" (F.linear everywhere)
        self._dense_linear = "gemv" if self.device.type == "cuda" else "torch"
        # benchmarks of random-weight presets: expert ids from a table (synthetic_routing.py)
        self.routing_override = None
        if self.fused_kernels:
            fuse_qkv(dense)

    def ensure_positions(self, max_positions: int) -> None:
        """Grow the rotary table to cover positions 0..max_positions-1."""
        if self.rope.max_positions < max_positions:
            self.rope = rotary_table(self.cfg, self.cfg.head_dim, max_positions, self.device)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids, positions [T] int64 (device) -> logits [R, V] float32.

        logit_rows [R] int64 selects the tokens whose logits are computed (e.g. the last token of each
        sequence); None computes all T.
        """
        x = F.embedding(token_ids, self.dense.embed)                    # [T, H]
        cos, sin = self.rope.lookup(positions, self.dtype)              # [T, 1, D]
        if self.fused_kernels:
            return self._forward_fused(x, positions, cos, sin, attn, logit_rows)
        for i, layer in enumerate(self.dense.layers):
            x = x + self._attention(i, layer, rms_norm(x, layer.attn_norm, self.cfg.rms_norm_eps),
                                    cos, sin, attn)
            x = x + self._moe(i, layer, rms_norm(x, layer.mlp_norm, self.cfg.rms_norm_eps), positions)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)                           # [R, H]
        x = rms_norm(x, self.dense.final_norm, self.cfg.rms_norm_eps)
        return F.linear(x, self.dense.lm_head).float()                  # [R, V]

    def _attention(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        q = F.linear(h, layer.q_proj)                                   # [T, Hq*D]
        k = F.linear(h, layer.k_proj)                                   # [T, Hkv*D]
        v = F.linear(h, layer.v_proj)                                   # [T, Hkv*D]
        if cfg.arch == "olmoe":                                         # norm over the whole projection
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            if cfg.clip_qkv is not None:
                q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)                      # [T, Hq, D]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        if cfg.arch == "qwen3":                                         # norm per head
            q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(i, q, k, v)                                   # [T, Hq, D]
        return F.linear(out.reshape(T, cfg.q_size), layer.o_proj)       # [T, H]

    def _moe(self, i: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = route(self.cfg, h, layer.router)       # [T, K], [T, K]
        if self.routing_override is not None:
            topk_ids = self.routing_override.ids(i, positions)
        return self.experts.forward(i, h, topk_ids, topk_weights)       # [T, H]

    # -- the fused forward (kernels/moe_decode) ---------------------------------------------------
    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       attn: AttentionContext, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """The forward above with each residual add fused into the next norm: x [T, H] embeddings."""
        layers = self.dense.layers
        norms = [w for layer in layers for w in (layer.attn_norm, layer.mlp_norm)] + [self.dense.final_norm]
        h = self._add_norm(x, None, norms[0])[1]                        # [T, H]
        for i, layer in enumerate(layers):
            x, h = self._add_norm(x, self._attention_fused(i, layer, h, cos, sin, attn), norms[2 * i + 1])
            x, h = self._add_norm(x, self._moe_fused(i, layer, h, positions), norms[2 * i + 2])
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)                           # [R, H] (the norm is per row)
        return F.linear(h, self.dense.lm_head).float()                  # [R, V]

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused forward's residual add + RMSNorm, one launch -> (x + delta, its norm); delta None: the norm
        alone (x returned as it is)."""
        eps, impl = self.cfg.rms_norm_eps, self.kernel_impl
        if delta is None:
            return x, kops.rms_norm(x, weight, eps, impl=impl)
        return kops.add_rms_norm(x, delta, weight, eps, impl=impl)

    def _linear(self, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """A dense projection of the fused forward (+ its bias b): kernels.dense_gemv where it beats cuBLAS (one
        decode token; the router up to 4), else F.linear."""
        if self._dense_linear == "gemv" and dense_gemv.preferred(h.shape[0], w.shape[0]):
            return dense_gemv.linear_gemv(h, w, impl=self.kernel_impl, bias=b)
        return F.linear(h, w, b)

    def _attention_fused(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        cfg, impl = self.cfg, self.kernel_impl
        T = h.shape[0]
        kv_size = cfg.num_kv_heads * cfg.head_dim
        if layer.qkv_proj is not None:
            qkv = self._linear(h, layer.qkv_proj)                       # [T, Hq*D + 2*Hkv*D]
            q, k, v = qkv.split([cfg.q_size, kv_size, kv_size], dim=1)  # strided views
        else:
            q, k, v = self._linear(h, layer.q_proj), self._linear(h, layer.k_proj), self._linear(h, layer.v_proj)
        if cfg.arch == "olmoe":                                         # norm over the whole projection
            q = kops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps, impl=impl)
            k = kops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps, impl=impl)
            if cfg.clip_qkv is not None:
                q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(T, cfg.num_heads, cfg.head_dim)                      # [T, Hq, D]
        k = k.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)                   # [T, Hkv, D]
        kv = attn.kv_write(i, v)                                        # the KV write fused into rope
        if cfg.arch == "qwen3":                                         # norm per head, then rope
            q, k = kops.qk_norm_rope(q, k, layer.q_norm, layer.k_norm, cos, sin, cfg.rms_norm_eps, impl=impl,
                                     kv=kv)
        else:
            q, k = kops.rope(q, k, cos, sin, impl=impl, kv=kv)
        out = attn.attend(i, q, k, v, kv_written=kv is not None)        # [T, Hq, D]
        return self._linear(out.reshape(T, cfg.q_size), layer.o_proj)   # [T, H]

    def _moe_fused(self, i: int, layer: LayerWeights, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        logits = self._linear(h, layer.router)                          # [T, E]
        softmax_first = cfg.arch != "mixtral"
        topk_ids, topk_weights = kops.route_topk(logits, cfg.top_k, softmax_first=softmax_first,
                                                 renorm=softmax_first and cfg.norm_topk_prob,
                                                 impl=self.kernel_impl)  # [T, K] int64, [T, K] fp32
        if self.routing_override is not None:
            topk_ids = self.routing_override.ids(i, positions)
        # [T, H], or at decode sizes the resident backend's per-route outputs [T, K, H] fp32, which the next
        # add_rms_norm sums (one launch fewer a layer)
        return self.experts.forward(i, h, topk_ids, topk_weights, partials=True)
