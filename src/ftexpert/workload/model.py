"""A Qwen3-MoE language model in plain torch, numerically the same as transformers'
``Qwen3MoeForCausalLM`` (RMSNorm in float32, per-head q/k norms, default RoPE, grouped-query
attention, a softmax-then-top-k router renormalised when ``norm_topk_prob``, SwiGLU experts).

Parameters carry the checkpoint's names (``state_dict_hf`` maps the fused expert tensors to the
hub's per-expert layout), so a trained model is written as a Hugging Face checkpoint directly.
``forward`` returns the logits and every layer's router logits (for the load-balancing loss);
``capture=True`` also returns every layer's router input (the routing statistics' predictor).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_tables(cfg: ModelConfig, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float,
                                                       device=device) / cfg.head_dim))
    freqs = torch.arange(seq_len, device=device, dtype=torch.float)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(b, t, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): softmax over experts, then top-k."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def grouped_mm_available(device: torch.device | None = None) -> bool:
    """torch has ``_grouped_mm`` and, on CUDA, the GPU is Hopper or newer (what it needs there)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return device is None or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)


def experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, impl: str) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, j].

    The (token, slot) pairs are sorted by expert; ``impl="grouped"`` computes every expert's rows with
    one ``torch._grouped_mm`` per projection, ``"loop"`` with one matmul per expert. The combine is a
    gather and a sum over the k slots (no scatter-add), so it is deterministic on CUDA too.
    """
    t, k = ids.shape
    num_experts, inter = down.shape[0], down.shape[2]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))                                  # (bincount: no static shape to compile)
    xs = x.unsqueeze(1).expand(t, k, x.shape[-1]).reshape(t * k, -1)[order]
    if impl == "grouped":
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        ys = torch._grouped_mm(a, down.transpose(-2, -1), offs=offs)
    elif impl == "loop":
        parts = []
        for e, rows in enumerate(torch.split(xs, counts.tolist())):
            if rows.shape[0] == 0:
                continue
            h = rows @ gate_up[e].t()
            parts.append((F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].t())
        ys = torch.cat(parts)
    else:
        raise ValueError(f"unknown experts impl {impl!r}; use 'grouped' or 'loop'")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y = ys[inverse].view(t, k, -1)
    return (y * weights.unsqueeze(-1)).sum(1)


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))   # [gate; up] rows, as transformers
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        weights, ids = route(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        gate_up, down = self.gate_up_proj, self.down_proj
        if flat.is_cuda and torch.is_autocast_enabled("cuda"):     # autocast does not cover _grouped_mm
            dt = torch.get_autocast_dtype("cuda")
            flat, gate_up, down = flat.to(dt), gate_up.to(dt), down.to(dt)
        out = experts_forward(flat, ids, weights.to(flat.dtype), gate_up, down, impl)
        return out.view(shape), logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoe(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the layer's output, its router logits, its router input)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        out, logits = self.mlp(h, impl)
        return x + out, logits, h


class MoeLM(nn.Module):
    def __init__(self, cfg: ModelConfig, experts_impl: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.experts_impl = experts_impl or ("grouped" if grouped_mm_available() else "loop")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def compile_layers(self) -> None:
        """Compile each decoder layer (regional compilation: the layers share one compiled graph). Their
        many small element-wise ops bound training at these widths; fused, they cost a fraction. A layer
        that fails to compile runs eagerly (dynamo's suppress_errors)."""
        import torch._dynamo  # lazy: ~2 s to import, only when compiling (CUDA training)

        torch._dynamo.config.suppress_errors = True
        for layer in self.layers:
            layer.compile()

    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        std = self.cfg.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, ids: torch.Tensor, capture: bool = False):
        """(logits [B, T, V], router logits per layer [B*T, E], router inputs per layer or None)."""
        x = self.embed_tokens(ids)
        cos, sin = rope_tables(self.cfg, ids.shape[1], ids.device, x.dtype)
        router_logits, router_inputs = [], []
        for layer in self.layers:
            x, logits, h = layer(x, cos, sin, self.experts_impl)
            if capture:
                router_inputs.append(h.reshape(-1, h.shape[-1]))
            router_logits.append(logits)
        return self.lm_head(self.norm(x)), router_logits, (router_inputs if capture else None)

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation (full recompute per token: for tests and small models)."""
        seq = torch.tensor([ids], device=self.embed_tokens.weight.device)
        out = []
        for _ in range(max_new_tokens):
            nxt = int(self(seq)[0][0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
        return out


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` without a mask: num_experts * sum_e f_e * P_e, where
    f_e is the fraction of (token, slot) picks of expert e (summed over the k slots) and P_e the mean
    router probability of e, both pooled over every layer's tokens."""
    logits = torch.cat([g.float() for g in router_logits])
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    picks = F.one_hot(selected, num_experts).float().sum(1).mean(0)      # [E], sums to top_k
    return (picks * probs.mean(0)).sum() * num_experts


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token multiplies by (embedding lookup excluded, lm head included)."""
    h = cfg.hidden_size
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * h
    moe = h * cfg.num_experts + cfg.top_k * 3 * h * cfg.moe_intermediate_size
    return cfg.num_layers * (attn + moe) + h * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 * active parameters + causal attention scores and values (forward + backward)."""
    return 6.0 * active_params(cfg) + 6.0 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim
