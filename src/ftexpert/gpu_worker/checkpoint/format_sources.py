"""Expert sources that change the experts' format while loading (`--expert-format`).

- `QuantizingExpertSource(inner, fmt)`: a float source (a bf16 checkpoint, a preset's random weights) whose
  experts are quantized while each layer is loaded: the inner source fills a staging layer on ``out``'s device,
  then every expert goes through ``kernels.expert_reference.quantize_expert`` (round to nearest) into its row of
  ``out`` (uint8). On the CPU the bytes are exactly quantize_expert's of the inner source's weights; on a GPU the
  same torch ops run there (fast for a 60 GB preset).
- `DequantizingExpertSource(inner, dtype)`: a quantized source (a quantized checkpoint) served as bf16:
  ``dequantize_expert`` of each expert, cast to ``dtype``.

Both print one progress line per source (`LoadProgress`), redrawn on a terminal.
"""
from __future__ import annotations

import sys
import time

import torch

from ftexpert.proto.expert_format import ExpertFormat, FormatError
from ftexpert.kernels.expert_reference import dequantize_expert, quantize_expert

from ftexpert.gpu_worker.checkpoint.expert_layout import bias_views, expert_views
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource


class LoadProgress:
    """``[#####-----] 12/48 layers, what, 3.1 s`` on stderr: redrawn in place on a terminal, every ~10% otherwise."""

    def __init__(self, total: int, what: str, stream=None) -> None:
        self.total, self.what = total, what
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last, self.t0 = -1.0, time.perf_counter()

    def update(self, done: int) -> None:
        frac = done / self.total if self.total else 1.0
        if not self.tty and done != self.total and frac - self.last < 0.1:
            return
        self.last = frac
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        end = "" if self.tty and done != self.total else "\n"
        self.stream.write(f"{chr(13) if self.tty else ''}[{bar}] {done}/{self.total} layers {self.what}, "
                          f"{time.perf_counter() - self.t0:.1f} s{end}")
        self.stream.flush()


class QuantizingExpertSource:
    """``inner``'s float experts quantized to ``fmt`` while loading (see the module docstring)."""

    def __init__(self, inner: ExpertSource, fmt: ExpertFormat, progress: bool = True):
        if inner.layout.quantized:
            raise FormatError(f"the experts are already {inner.layout.fmt.label}; quantizing them again to "
                              f"{fmt.label} would round twice: serve them as they are (--expert-format auto)")
        if not fmt.quantized:
            raise FormatError("QuantizingExpertSource needs a quantized format (fp8, int4-g*, mxfp4, nvfp4)")
        self.inner, self.fmt = inner, fmt
        self.layout = inner.layout.with_format(fmt)          # refuses shapes the format cannot hold
        self.num_layers, self.num_experts = inner.num_layers, inner.num_experts
        self._staging: torch.Tensor | None = None           # one float layer on the target device, reused
        self._progress = LoadProgress(self.num_layers, f"quantized to {fmt.label}") if progress else None
        self._filled: set[int] = set()

    def __getattr__(self, name: str):                       # cfg, reader, ... of the inner source
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        """Write layer ``layer``'s experts, quantized, into ``out: [E, N]`` uint8 (any device)."""
        self.layout.check(out)
        staging = self._staging
        if staging is None or staging.device != out.device:
            staging = self._staging = self.inner.layout.empty_layer(self.num_experts, device=out.device)
        self.inner.fill_layer(layer, staging)
        for e in range(self.num_experts):
            gate, up, down = expert_views(staging[e], self.inner.layout)
            row = out[e]
            row.zero_()                                     # the alignment gaps too: the bytes quantize_expert makes
            quantize_expert(gate, up, down, self.fmt, out=row)
        if self.layout.bias_numel:                          # biases stay in the compute dtype
            for dst, src in zip(bias_views(out, self.layout), bias_views(staging, self.inner.layout)):
                dst.copy_(src)
        self._filled.add(layer)
        if self._progress is not None:
            self._progress.update(len(self._filled))
            if len(self._filled) == self.num_layers:
                self._staging = None                        # the last layer: release the staging memory


class DequantizingExpertSource:
    """A quantized source's experts served in the bf16 layout of ``dtype`` (dequantize_expert, then a cast)."""

    def __init__(self, inner: ExpertSource, dtype: torch.dtype, progress: bool = True):
        if not inner.layout.quantized:
            raise FormatError("DequantizingExpertSource needs a quantized source")
        self.inner = inner
        self.layout = inner.layout.with_dtype(dtype)
        self.num_layers, self.num_experts = inner.num_layers, inner.num_experts
        self._progress = (LoadProgress(self.num_layers, f"dequantized from {inner.layout.fmt.label}")
                          if progress else None)
        self._filled: set[int] = set()

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        self.layout.check(out)
        qbytes = self.inner.layout.empty_layer(self.num_experts, device=out.device)
        self.inner.fill_layer(layer, qbytes)
        qlay = self.inner.layout.quant_layout
        for e in range(self.num_experts):
            gate, up, down = dequantize_expert(qbytes[e], qlay)
            g_out, u_out, d_out = expert_views(out[e], self.layout)
            g_out.copy_(gate)
            u_out.copy_(up)
            d_out.copy_(down)
        if self.layout.bias_numel:
            for dst, src in zip(bias_views(out, self.layout), bias_views(qbytes, self.inner.layout)):
                dst.copy_(src)
        self._filled.add(layer)
        if self._progress is not None:
            self._progress.update(len(self._filled))
