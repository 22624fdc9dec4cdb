"""Programmatic dependent launch (PDL) for the decode kernels, Hopper and later.

A decode step at batch 1 is a chain of small kernels (norms, GEMVs, rope, attention, router, expert
GEMVs: ~12 a layer, ~600 a step), each bound by its own launch, ramp-up and tail as much as by bytes.
With PDL a kernel launched with `launch_pdl=True` may start while the kernel before it in the stream
is still running, once every program of that one has passed `griddepcontrol.launch_dependents`; it
must then `griddepcontrol.wait` (which returns when the kernel before it has finished and its writes
are visible) before it touches anything that kernel, or any earlier one, wrote or reads. The
dependent's launch, its programs' set-up and, in the dense GEMVs, the load of its first weight tile
(weights no kernel writes) overlap the tail of the kernel before it. CUDA graphs keep the edge
(stream capture records it as a programmatic dependency).

The rule every kernel here follows (`pdl_enter`), so that no ordering the stream used to give is lost:
- `gdc_wait` comes before the first load of anything but constant weights, before every store, and
  on every path through the program (a program that exits without waiting could let the kernel after
  it start before the one before it is done: the wait is what makes completion transitive);
- `gdc_launch_dependents` comes right after the wait, so at most two kernels of a chain overlap:
  the running one and the next, waiting;
- the memory a kernel stores to may have been freed by an earlier kernel's caller and handed out again
  (the caching allocator reuses blocks in stream order): since every store follows the wait, the
  earlier kernel has finished with it.
A kernel before which a non-PDL kernel (torch, cuBLAS, the slot cache) runs waits for it in full, as
without PDL; a kernel launched without PDL waits for a PDL kernel in full as well.

`FREETOKEN_PDL`: `auto` (default: on with an NVIDIA GPU (not ROCm) of compute capability 9.0 or later, a Triton
that has `gdc_wait`, and not under the interpreter), `on` (the same, but an error where it cannot),
`off`. Read at launch time, so a CUDA graph keeps what was set when it was captured.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ftexpert.kernels.impl import interpreted
from ftexpert.proto.knobs import KNOBS_BY_ENV

try:
    from triton.language.extra import cuda as tl_cuda
except ImportError:                 # a Triton without it: pdl_enabled() says no, USE_PDL stays False
    tl_cuda = None

ENV = "FREETOKEN_PDL"
MODES = KNOBS_BY_ENV[ENV].choices          # the knob's values (proto/knobs.py), no others


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """In a kernel launched with PDL: wait for the kernel before it, then let the next one launch.
    Nothing without USE_PDL (the branch is not compiled; the interpreter never reaches it)."""
    if USE_PDL:
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()


def _triton_has_gdc() -> bool:
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> tuple[bool, str]:
    if interpreted():
        return False, "the Triton interpreter has no programmatic dependent launch"
    if not _triton_has_gdc():
        return False, f"Triton {triton.__version__} has no tl.extra.cuda.gdc_wait"
    if getattr(torch.version, "hip", None):
        return False, "this is a ROCm build of torch (griddepcontrol is NVIDIA's)"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return False, f"compute capability {major}.{minor} < 9.0 (PDL needs Hopper or later)"
    return True, ""


def mode() -> str:
    """FREETOKEN_PDL's value (unset or empty: auto); the values the knob (proto/knobs.py) takes, no others."""
    value = os.environ.get(ENV, "").strip() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: use one of {', '.join(MODES)}")
    return value


def apply_setting(value: str, device: "torch.device | str | None" = None) -> None:
    """Make `value` (the `pdl` knob: --pdl, FREETOKEN_PDL) what this process's kernels launch with: the
    kernels read the environment at launch time (`auto` with the variable unset is left unset). With
    `device` ('auto' = CUDA where there is one), `on` where PDL cannot apply is refused now, at start-up,
    not at the first decode step (graphs are captured on first use)."""
    if value not in MODES:
        raise ValueError(f"pdl {value!r}: use one of {', '.join(MODES)}")
    if value != "auto" or ENV in os.environ:
        os.environ[ENV] = value
    if value == "on" and device is not None:
        if str(device) == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        pdl_enabled(torch.device(device))                     # raises, saying why


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched now on `device` use PDL (see the module docstring)."""
    m = mode()
    if m == "off" or device.type != "cuda":
        if m == "on" and device.type != "cuda":
            raise ValueError(f"--pdl on / {ENV}=on needs a CUDA device, got {device}: leave it at auto")
        return False
    ok, why = _supported(device.index if device.index is not None else torch.cuda.current_device())
    if not ok and m == "on":
        raise ValueError(f"--pdl on / {ENV}=on, but {why}: leave it at auto")
    return ok


def pdl_args(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the kernel's USE_PDL constexpr and, with PDL, Triton's
    `launch_pdl` launch option (never passed otherwise: the interpreter does not take it)."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"USE_PDL": False}
