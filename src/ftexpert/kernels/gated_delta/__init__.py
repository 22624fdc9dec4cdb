"""The gated delta rule of Gated DeltaNet layers (Qwen3-Next's linear attention): a chunked form for prefill and a
recurrence for decode, with a plain torch reference (reference.py) and flash-linear-attention's Triton kernels
(fla_path.py; PyPI ``fla-core``, optional) behind one entry point each. Shapes and maths: reference.py.

    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state, impl="auto")
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, impl="auto")

``impl``: "auto" (fla on CUDA tensors when it is importable, else the reference), "fla" (fla or a clear error),
"reference". The state comes back in fp32 whichever runs.
"""
from __future__ import annotations

import torch

from ftexpert.kernels.gated_delta import reference
from ftexpert.kernels.gated_delta.fla_path import fla_available, fla_chunk, fla_recurrent

IMPLS = ("auto", "fla", "reference")


def resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"gated delta impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "fla" if device.type == "cuda" and fla_available() else "reference"
    if impl == "fla":
        if device.type != "cuda":
            raise ValueError("impl='fla' (flash-linear-attention's Triton kernels) needs CUDA tensors; "
                             "use impl='reference' on the CPU")
        if not fla_available():
            raise ValueError("impl='fla' needs flash-linear-attention: pip install fla-core "
                             "(docs/DEPENDENCIES.md), or use impl='auto' / 'reference'")
    return impl


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, impl: str = "auto"):
    """Prefill: -> (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    if resolve_impl(impl, v.device) == "fla":
        return fla_chunk(q, k, v, g, beta, initial_state)
    return reference.chunk_gated_delta_rule(q, k, v, g, beta, initial_state)


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, impl: str = "auto"):
    """Decode (a few tokens a sequence): -> (o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] fp32)."""
    if resolve_impl(impl, v.device) == "fla":
        return fla_recurrent(q, k, v, g, beta, initial_state)
    return reference.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "resolve_impl", "fla_available", "IMPLS"]
