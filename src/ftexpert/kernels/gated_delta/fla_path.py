"""flash-linear-attention's gated delta rule kernels (``fla.ops.gated_delta_rule``; PyPI ``fla-core``) behind the
reference's signature. Optional: `fla_available()` says whether it imports here.

q and k are expanded to the value heads before the call (the reference's grouping: key head i serves value heads
i*r .. i*r + r - 1), the L2 normalisation runs inside the kernel (``use_qk_l2norm_in_kernel``), the scale is
Dk^-0.5, and the state goes in and comes out in fp32.
"""
from __future__ import annotations

import functools



@functools.lru_cache(maxsize=1)
def _ops():
    try:
        # optional: fla-core (the linear-attention extra)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:          # absent, or present but failing to import on this torch / triton
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_available() -> bool:
    return _ops() is not None


def _expand(q, k, v):
    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return q.contiguous(), k.contiguous()


def _state(initial_state):
    return None if initial_state is None else initial_state.float().contiguous()


def _call(kernel, q, k, v, g, beta, initial_state):
    q, k = _expand(q, k, v)
    # g and beta by name: the two kernels' positional orders differ (the recurrent one takes gk fifth)
    o, state = kernel(q, k, v.contiguous(), g=g.float().contiguous(), beta=beta.contiguous().to(v.dtype),
                      scale=q.shape[-1] ** -0.5, initial_state=_state(initial_state), output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype), state.float()


def fla_chunk(q, k, v, g, beta, initial_state=None):
    """fla's chunked kernel (prefill); the reference's signature and results."""
    return _call(_ops()[0], q, k, v, g, beta, initial_state)


def fla_recurrent(q, k, v, g, beta, initial_state=None):
    """fla's fused recurrent kernel (decode); the reference's signature and results."""
    return _call(_ops()[1], q, k, v, g, beta, initial_state)


__all__ = ["fla_available", "fla_chunk", "fla_recurrent"]
