"""One decode forward: its inputs (`DecodeInputs`) and the forward itself (`decode_forward`), shared by the
engine, which runs it eagerly, and the CUDA-graph runner (cuda_graphs.py), which captures and replays it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ftexpert.gpu_worker.engine.attention import DecodeAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.gpu_worker.models.model import MoeModel
from ftexpert.gpu_worker.models.qwen3_next import StatefulContext


@dataclass(frozen=True)
class DecodeInputs:
    """Everything a decode forward needs; the CUDA-graph runner copies these into static buffers."""
    token_ids: torch.Tensor     # [T] int64, device: the last token of each request
    positions: torch.Tensor     # [T] int64, device: its position (seq_len - 1)
    slot_ids: torch.Tensor      # [T] int64, device: its slot (block table row, state cache row)
    bucket_tokens: int          # attention span (>= max position + 1)


def decode_forward(model: MoeModel, kv: KVCache, states: StateCache | None, inputs: DecodeInputs,
                   attention_backend: str) -> torch.Tensor:
    """One token per request -> logits [T, V] fp32. Fixed shapes for (T, bucket); no host sync
    unless the expert backend makes one. The K/V go through the device block tables (kv.block_tables), which
    the engine updates in place between steps."""
    attn = DecodeAttention(kv, inputs.slot_ids, inputs.positions, inputs.bucket_tokens,
                           model.cfg.sliding_window, backend=attention_backend)
    if states is not None:
        attn = StatefulContext(attn, states.decode(inputs.slot_ids))
    return model.forward(inputs.token_ids, inputs.positions, attn)
