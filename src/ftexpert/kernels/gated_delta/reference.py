"""The gated delta rule in plain torch (fp32): the chunked form for prefill and the token-by-token recurrence for
decode. Shapes (batch first, tokens second, as flash-linear-attention takes them):

    q, k [B, T, Hk, Dk]   v [B, T, Hv, Dv]   g, beta [B, T, Hv]   state [B, Hv, Dk, Dv] (fp32)

Hv is a multiple of Hk: each query/key head serves Hv / Hk consecutive value heads. q and k are L2-normalised
(eps 1e-6 inside the square root) and q is scaled by Dk^-0.5. For each value head, with S the [Dk, Dv] state:

    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - S^T k_t))^T;   o_t = S^T q_t

The chunked form computes the same over chunks of `CHUNK` tokens with a unit lower-triangular solve inside each
chunk (the WY / UT representation) and one state update per chunk; it agrees with the recurrence to fp32
rounding.
"""
from __future__ import annotations

import torch

CHUNK = 64
L2_EPS = 1e-6


def _prepare(q, k, v, g, beta):
    """fp32, heads first ([B, H, T, ...]), q/k expanded to the value heads, L2-normalised, q scaled."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    if Hv != Hk:
        q = q.repeat_interleave(Hv // Hk, dim=2)
        k = k.repeat_interleave(Hv // Hk, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float().contiguous() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _initial(state, B, H, Dk, Dv, device):
    if state is None:
        return torch.zeros(B, H, Dk, Dv, dtype=torch.float32, device=device)
    if tuple(state.shape) != (B, H, Dk, Dv):
        raise ValueError(f"initial_state has shape {tuple(state.shape)}; expected {(B, H, Dk, Dv)}")
    return state.float()


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """Token by token -> (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    S = _initial(initial_state, B, H, Dk, Dv, v.device)
    out = torch.empty(B, H, T, Dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]                                                        # [B, H, Dk]
        recalled = (S * kt[..., None]).sum(-2)                                 # [B, H, Dv]
        delta = (v[:, :, t] - recalled) * beta[:, :, t, None]
        S = S + kt[..., None] * delta[..., None, :]
        out[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(out_dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK):
    """Chunked -> (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.view(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.view(B, H, n, chunk), beta.view(B, H, n, chunk)
    G = g.cumsum(-1)                                                           # log decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()   # [.., i, j]: j -> i
    kb = k * beta[..., None]
    # the UT transform: (I + A) W = beta K e^G and (I + A) U = beta V, A = strictly lower (beta K K^T * decay)
    # (only the strictly lower triangle is read: the solves take a unit diagonal)
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * G.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                                   # within the chunk, causal
    q_dec = q * G.exp()[..., None]
    k_dec = k * (G[..., -1:] - G).exp()[..., None]
    S = _initial(initial_state, B, H, Dk, Dv, v.device)
    out = torch.empty(B, H, n, chunk, Dv, dtype=torch.float32, device=v.device)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S                                    # what the state does not predict
        out[:, :, c] = q_dec[:, :, c] @ S + attn[:, :, c] @ v_new
        S = S * G[:, :, c, -1].exp()[..., None, None] + k_dec[:, :, c].transpose(-1, -2) @ v_new
    out = out.view(B, H, n * chunk, Dv)[:, :, :T]
    return out.transpose(1, 2).to(out_dtype), S
