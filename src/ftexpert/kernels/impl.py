"""The `impl` argument every kernel entry point takes: which code runs a call.

    auto       the Triton kernel on CUDA tensors, the torch reference elsewhere
    triton     the Triton kernel; on CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1,
               set before the kernels are first used: tests/conftest.py does), which the tests use to
               run the kernels in lockstep with their references on a machine without a GPU
    reference  the plain torch code, always
"""
from __future__ import annotations

import os

import torch

IMPLS = ("auto", "triton", "reference")


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, device: torch.device) -> str:
    """'triton' or 'reference' for a call on `device`; a clear error for a bad value or 'triton' on CPU
    tensors without the interpreter."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if impl == "triton" and device.type != "cuda" and not interpreted():
        raise ValueError("impl='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                         "before the kernels are first used, or use a CUDA device")
    return impl
