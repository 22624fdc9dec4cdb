"""Device and dtype choice: ``auto`` means CUDA when present, else CPU."""
from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but torch sees no CUDA GPU "
                           f"(torch {torch.__version__}); use --device cpu or auto")
    return device


def resolve_dtype(name: str | torch.dtype | None, checkpoint_dtype: str) -> torch.dtype:
    """``auto``/None: the checkpoint's dtype."""
    if isinstance(name, torch.dtype):
        return name
    chosen = checkpoint_dtype if name in (None, "auto") else name
    if chosen not in DTYPE_CHOICES[1:]:
        raise ValueError(f"dtype {chosen!r} is not one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, chosen)
