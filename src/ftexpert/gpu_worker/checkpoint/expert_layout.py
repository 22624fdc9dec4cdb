"""The packed expert layout: one expert = one contiguous byte range = one DMA.

A layer's experts live in one flat tensor ``packed: [E, N]`` with ``N = expert_numel``. Row e is
expert e: its ``w13`` [2I, H] (gate rows, then up rows) followed by its ``w2`` [H, I], row-major,
in the checkpoint dtype. The offload backend's slots, the shared-memory expert store and the CPU
expert pool all use exactly this layout, so an expert moves between them as one copy of
``expert_nbytes`` bytes. Rows may be padded (row stride > N, as in proto/expert_store.py's
``layer_view``); every function here accepts such a view.

    packed[e] = [ gate (I*H) | up (I*H) | down (H*I) ]
                  \\____ w13: 2*I*H ____/  \\_ w2: H*I _/

A quantized format (``fmt``: fp8, int4-g*, mxfp4, nvfp4; proto/expert_format.py) keeps the same shape of
things: row e of ``packed: [E, N]`` is expert e, but in uint8 bytes laid out as `QuantLayout` says (codes,
scales, zero points, globals), N = its ``expert_nbytes``. ``dtype`` stays the compute dtype (what the experts
dequantize to); ``storage_dtype`` is what the rows hold. The expert math over such rows goes through one seam,
gpu_worker/backends/expert_math.py; `unpack_experts` / `expert_views` are the bf16 layout's views only.

``act`` (proto/expert_act.py) is what the expert computes besides its matrices: silu (the default) or gpt-oss's
clamped SwiGLU, whose experts have biases. A biased row ends with them (`bias_views`): right after w2 in the
bf16 format, at ``bias_offset`` of the quantized bytes otherwise; 2I + H values of ``dtype`` (gate, up, down).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ftexpert.proto.expert_act import SILU, ExpertAct, bias_offset
from ftexpert.proto.expert_format import ExpertFormat, FormatError, QuantLayout

BF16_FORMAT = ExpertFormat("bf16")


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int          # H
    intermediate_size: int    # I
    dtype: torch.dtype        # the compute dtype (the rows' element type in the bf16 format)
    fmt: ExpertFormat = field(default=BF16_FORMAT)   # the rows' format (bf16: the model dtype unquantized)
    act: ExpertAct = field(default=SILU)             # the activation; biases at the row's end where act.bias

    def __post_init__(self) -> None:
        if isinstance(self.fmt, str):
            object.__setattr__(self, "fmt", ExpertFormat.parse(self.fmt))
        if self.fmt.quantized:
            QuantLayout(self.hidden_size, self.intermediate_size, self.fmt)    # refuses shapes it cannot hold

    @property
    def quantized(self) -> bool:
        return self.fmt.quantized

    @property
    def quant_layout(self) -> QuantLayout:
        """The byte layout of one quantized expert (quantized formats only)."""
        return QuantLayout(self.hidden_size, self.intermediate_size, self.fmt)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The element type of a packed row: the compute dtype (bf16 format), else uint8 bytes."""
        return torch.uint8 if self.fmt.quantized else self.dtype

    def with_format(self, fmt: ExpertFormat | str) -> "ExpertLayout":
        return ExpertLayout(self.hidden_size, self.intermediate_size, self.dtype,
                            ExpertFormat.parse(fmt) if isinstance(fmt, str) else fmt, self.act)

    def with_dtype(self, dtype: torch.dtype) -> "ExpertLayout":
        """This layout unquantized (bf16 format) in ``dtype``, same activation."""
        return ExpertLayout(self.hidden_size, self.intermediate_size, dtype, BF16_FORMAT, self.act)

    @property
    def bias_numel(self) -> int:
        """Bias values at the end of a row (2I + H where act.bias, else 0)."""
        return self.act.bias_numel(self.hidden_size, self.intermediate_size)

    @property
    def bias_start(self) -> int:
        """Where a row's biases start: an element index (bf16 format) or a byte offset (quantized)."""
        if self.fmt.quantized:
            return bias_offset(self.quant_layout.expert_nbytes)
        return self.w13_numel + self.w2_numel

    @property
    def w13_numel(self) -> int:
        return 2 * self.intermediate_size * self.hidden_size

    @property
    def w2_numel(self) -> int:
        return self.hidden_size * self.intermediate_size

    @property
    def expert_numel(self) -> int:
        """Elements of one packed row: weights (bf16 format) or bytes (quantized)."""
        if self.fmt.quantized:
            if not self.bias_numel:
                return self.quant_layout.expert_nbytes
            return self.bias_start + self.bias_numel * torch.empty((), dtype=self.dtype).element_size()
        return self.w13_numel + self.w2_numel + self.bias_numel

    @property
    def expert_nbytes(self) -> int:
        return self.expert_numel * torch.empty((), dtype=self.storage_dtype).element_size()

    def empty_layer(self, num_experts: int, device: torch.device | str = "cpu",
                    pin_memory: bool = False) -> torch.Tensor:
        """An uninitialised packed layer: [E, N] of storage_dtype."""
        return torch.empty(num_experts, self.expert_numel, dtype=self.storage_dtype, device=device,
                           pin_memory=pin_memory)

    def zeros_layer(self, num_experts: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed packed layer [E, N] (zero bytes dequantize to 0 in every format: finite values)."""
        return torch.zeros(num_experts, self.expert_numel, dtype=self.storage_dtype, device=device)

    def check(self, packed: torch.Tensor) -> None:
        if packed.dim() != 2 or packed.shape[1] != self.expert_numel:
            raise ValueError(f"packed experts have shape {tuple(packed.shape)}; expected "
                             f"[num_experts, {self.expert_numel}] (H={self.hidden_size}, "
                             f"I={self.intermediate_size})")
        if packed.dtype != self.storage_dtype:
            raise ValueError(f"packed experts are {packed.dtype}, the {self.fmt.label} layout expects "
                             f"{self.storage_dtype}")
        if packed.stride(1) != 1 or packed.stride(0) < self.expert_numel:
            raise ValueError("packed experts must be rows of expert_numel contiguous elements (a row "
                             "stride padded beyond expert_numel is fine, e.g. the shared-memory store's)")


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack w13 [E, 2I, H] and w2 [E, H, I] into [E, N] (into ``out`` when given)."""
    E, two_i, H = w13.shape
    if w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, H] and [E, H, I]")
    layout = ExpertLayout(H, two_i // 2, w13.dtype if out is None else out.dtype)
    if out is None:
        out = layout.empty_layer(E, device=w13.device)
    layout.check(out)
    out[:, : layout.w13_numel].copy_(w13.reshape(E, -1))
    out[:, layout.w13_numel:].copy_(w2.reshape(E, -1))
    return out


def bias_views(packed: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of the biases of packed [S, N] rows: b13 [S, 2I] (gate's, then up's) and b2 [S, H], in
    ``layout.dtype`` (any format; a layout without biases raises)."""
    if not layout.bias_numel:
        raise ValueError(f"{layout.act.label} experts have no biases")
    H, I = layout.hidden_size, layout.intermediate_size
    start = layout.bias_start
    if layout.fmt.quantized:
        size = torch.empty((), dtype=layout.dtype).element_size()
        if packed.stride(0) % size:
            raise ValueError(f"rows of {packed.stride(0)} bytes cannot hold {layout.dtype} biases (not a multiple "
                             f"of {size} bytes)")
        vals = packed[:, start: start + layout.bias_numel * size].view(layout.dtype)
    else:
        vals = packed[:, start: start + layout.bias_numel]
    return vals[:, : 2 * I], vals[:, 2 * I: 2 * I + H]


def _bf16_only(layout: ExpertLayout, what: str) -> None:
    if layout.fmt.quantized:
        raise FormatError(f"{what}: {layout.fmt.label} experts are bytes, not w13 / w2 matrices; compute over them "
                          "through gpu_worker.backends.expert_math (expert_rows), or dequantize them "
                          "(kernels.expert_reference.dequantize_expert)")


def unpack_experts(packed: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of packed [E, N] as w13 [E, 2I, H] and w2 [E, H, I] (the bf16 format)."""
    _bf16_only(layout, "unpack_experts")
    layout.check(packed)
    E, H, I = packed.shape[0], layout.hidden_size, layout.intermediate_size
    w13 = packed[:, : layout.w13_numel].view(E, 2 * I, H)
    w2 = packed[:, layout.w13_numel: layout.w13_numel + layout.w2_numel].view(E, H, I)
    return w13, w2


def expert_views(packed_row: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one expert's flat row [N] as (gate [I, H], up [I, H], down [H, I]) (the bf16 format)."""
    _bf16_only(layout, "expert_views")
    H, I = layout.hidden_size, layout.intermediate_size
    gate = packed_row[: I * H].view(I, H)
    up = packed_row[I * H: 2 * I * H].view(I, H)
    down = packed_row[2 * I * H: 3 * I * H].view(H, I)
    return gate, up, down
