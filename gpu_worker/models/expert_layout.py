"""The packed expert layout: one expert = one contiguous byte range = one DMA.

A layer's experts live in one flat tensor ``packed: [E, N]`` with ``N = expert_numel``. Row e is
expert e: its ``w13`` [2I, H] (gate rows, then up rows) followed by its ``w2`` [H, I], row-major,
in the checkpoint dtype. The offload backend's slots, the shared-memory expert store and the CPU
expert pool all use exactly this layout, so an expert moves between them as one copy of
``expert_nbytes`` bytes. Rows may be padded (row stride > N, as in proto/expert_store.py's
``layer_view``); every function here accepts such a view.

    packed[e] = [ gate (I*H) | up (I*H) | down (H*I) ]
                  \\____ w13: 2*I*H ____/  \\_ w2: H*I _/
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int          # H
    intermediate_size: int    # I
    dtype: torch.dtype

    @property
    def w13_numel(self) -> int:
        return 2 * self.intermediate_size * self.hidden_size

    @property
    def w2_numel(self) -> int:
        return self.hidden_size * self.intermediate_size

    @property
    def expert_numel(self) -> int:
        return self.w13_numel + self.w2_numel

    @property
    def expert_nbytes(self) -> int:
        return self.expert_numel * torch.empty((), dtype=self.dtype).element_size()

    def empty_layer(self, num_experts: int, device: torch.device | str = "cpu",
                    pin_memory: bool = False) -> torch.Tensor:
        """An uninitialised packed layer: [E, N]."""
        return torch.empty(num_experts, self.expert_numel, dtype=self.dtype, device=device,
                           pin_memory=pin_memory)

    def check(self, packed: torch.Tensor) -> None:
        if packed.dim() != 2 or packed.shape[1] != self.expert_numel:
            raise ValueError(f"packed experts have shape {tuple(packed.shape)}; expected "
                             f"[num_experts, {self.expert_numel}] (H={self.hidden_size}, "
                             f"I={self.intermediate_size})")
        if packed.dtype != self.dtype:
            raise ValueError(f"packed experts are {packed.dtype}, layout expects {self.dtype}")
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


def unpack_experts(packed: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of packed [E, N] as w13 [E, 2I, H] and w2 [E, H, I]."""
    layout.check(packed)
    E, H, I = packed.shape[0], layout.hidden_size, layout.intermediate_size
    w13 = packed[:, : layout.w13_numel].view(E, 2 * I, H)
    w2 = packed[:, layout.w13_numel:].view(E, H, I)
    return w13, w2


def expert_views(packed_row: torch.Tensor, layout: ExpertLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of one expert's flat row [N] as (gate [I, H], up [I, H], down [H, I])."""
    H, I = layout.hidden_size, layout.intermediate_size
    gate = packed_row[: I * H].view(I, H)
    up = packed_row[I * H: 2 * I * H].view(I, H)
    down = packed_row[2 * I * H:].view(H, I)
    return gate, up, down
