"""`StateCache`: the per-request state of a model's linear-attention layers, beside the `KVCache`.

    conv:      [Llin, B, C, K-1]    the short convolution's last K-1 inputs (model dtype)
    recurrent: [Llin, B, Hv, Dk, Dv] the gated delta rule's state (fp32)

Llin linear layers, B = max_running_requests rows; a request owns row ``slot`` of both caches (and of the KV
cache's block tables) from admission to finish or preemption. Its first prefill chunk zeroes the row (a fresh
sequence), unless a prefix hit restored the state kept where the hit ends (state_checkpoints.py) and its prefill
starts there; every chunk after reads and advances it, and each decode step advances it by one token; a finished request's row is
zeroed and handed to the next one with its slot. Fixed shapes and device-tensor row indices keep the decode step capturable in a CUDA
graph (the graph reads and writes the live rows). Unlike K/V, whose decode write is idempotent, a state update is
not: a forward that runs twice for one token (the CUDA-graph warm-ups, a retried decode step) must restore the
rows first (`snapshot` / `restore`). A decode step's kernels may update its rows in place (`StateRows.conv_rows`,
`StateRows.recurrent_rows`) instead of a gather before and a scatter after: they change the same rows of the same
tensors, so that contract holds unchanged.
"""
from __future__ import annotations

import torch

from ftexpert.gpu_worker.checkpoint.config import LINEAR_ATTENTION, MoeConfig


def num_linear_layers(cfg: MoeConfig) -> int:
    return sum(t == LINEAR_ATTENTION for t in cfg.layer_types)


class StateRows:
    """The state rows of one forward's sequences (`SequenceStates` of models/qwen3_next.py): one row (a prefill
    chunk) or one per decode token (``rows`` [T] int64 on the device)."""

    def __init__(self, cache: "StateCache", rows: torch.Tensor | None = None, slot: int | None = None):
        self.cache, self.rows, self.slot = cache, rows, slot
        self.num_seqs = 1 if rows is None else int(rows.numel())

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        if self.rows is None:
            return c.conv[layer, self.slot:self.slot + 1], c.recurrent[layer, self.slot:self.slot + 1]
        return c.conv[layer].index_select(0, self.rows), c.recurrent[layer].index_select(0, self.rows)

    def write(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        c = self.cache
        if self.rows is None:
            c.conv[layer, self.slot].copy_(conv[0])
            c.recurrent[layer, self.slot].copy_(recurrent[0])
        else:
            c.conv[layer].index_copy_(0, self.rows, conv.to(c.conv.dtype))
            self.write_recurrent(layer, recurrent)

    def conv_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's conv state in place: (the layer's conv cache [B, C, K-1], a view, and ``rows`` [T]) for a
        kernel that reads and shifts those rows itself (kernels/next_decode gdn_decode_pre), as read + write would;
        a CUDA graph captures it over the live rows like the index_copy_ of `write`. None for a prefill chunk."""
        return None if self.rows is None else (self.cache.conv[layer], self.rows)

    def recurrent_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's recurrent state in place: (the layer's recurrent cache [B, Hv, Dk, Dv] fp32, a view, and
        ``rows`` [T]) for a kernel that reads the rows, advances them by the token and writes them back itself
        (kernels/next_decode gdn_decode_rule), as `read_recurrent` + `write_recurrent` would, without the gather and
        the scatter. The same rows of the same tensor change, so `StateCache.snapshot` / `restore` cover it, and a
        CUDA graph captures it over the live rows. None for a prefill chunk."""
        return None if self.rows is None else (self.cache.recurrent[layer], self.rows)

    def read_recurrent(self, layer: int) -> torch.Tensor:
        """The recurrent state alone, a copy of the rows: [T, Hv, Dk, Dv] fp32 (a fused decode step updates them in
        place through `recurrent_rows` instead)."""
        return self.read(layer)[1] if self.rows is None else self.cache.recurrent[layer].index_select(0, self.rows)

    def write_recurrent(self, layer: int, recurrent: torch.Tensor) -> None:
        c = self.cache
        if self.rows is None:
            c.recurrent[layer, self.slot].copy_(recurrent[0])
        else:
            c.recurrent[layer].index_copy_(0, self.rows, recurrent.float())


class StateCache:
    def __init__(self, cfg: MoeConfig, max_batch: int, dtype: torch.dtype, device: torch.device):
        lin = cfg.linear_attention
        if lin is None:
            raise ValueError(f"{cfg.arch} has no linear-attention layers: it needs no state cache")
        self.num_layers, self.max_batch = num_linear_layers(cfg), max_batch
        need = self.nbytes_for(cfg, max_batch, dtype)
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
            if need > free_bytes:
                raise RuntimeError(
                    f"the linear layers' state cache needs {need / 2**30:.2f} GiB ({max_batch} requests) but "
                    f"{device} has {free_bytes / 2**30:.2f} GiB free; lower max_running_requests")
        self.conv = torch.zeros((self.num_layers, max_batch, lin.conv_dim, lin.conv_kernel_dim - 1),
                                dtype=dtype, device=device)
        self.recurrent = torch.zeros((self.num_layers, max_batch, lin.num_value_heads, lin.key_head_dim,
                                      lin.value_head_dim), dtype=torch.float32, device=device)

    @staticmethod
    def nbytes_for(cfg: MoeConfig, max_batch: int, dtype: torch.dtype) -> int:
        """Bytes for ``max_batch`` requests (independent of the context length); 0 for a model without linear
        layers."""
        lin = cfg.linear_attention
        if lin is None:
            return 0
        elem = torch.empty((), dtype=dtype).element_size()
        per_layer = lin.conv_dim * (lin.conv_kernel_dim - 1) * elem \
            + lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * 4
        return num_linear_layers(cfg) * max_batch * per_layer

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4

    def reset(self, slot: int) -> None:
        """Zero row ``slot``: a fresh sequence (its first prefill chunk; a finished request's row)."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def prefill(self, slot: int, start_pos: int) -> StateRows:
        """The rows of a prefill chunk of the request in ``slot`` starting at ``start_pos`` (0: zeroed first)."""
        if start_pos == 0:
            self.reset(slot)
        return StateRows(self, slot=slot)

    def decode(self, slot_ids: torch.Tensor) -> StateRows:
        """The rows of a decode step: one per token, ``slot_ids`` [T] int64 on the device (each slot once)."""
        return StateRows(self, rows=slot_ids)

    def snapshot(self, slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the rows ``slot_ids`` [T] (device), for `restore`."""
        return self.conv.index_select(1, slot_ids), self.recurrent.index_select(1, slot_ids)

    def restore(self, slot_ids: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv.index_copy_(1, slot_ids, saved[0])
        self.recurrent.index_copy_(1, slot_ids, saved[1])
