"""Attention contexts over the paged `KVCache`, one built per forward.

Both fold the G = Hq / Hkv query heads that share a kv head into SDPA's query-length axis, so grouped
query attention reads each cached key once and never copies K/V to Hq heads:

    q [T, Hq, D] -> [rows, Hkv, G * T_row, D];  k, v: [rows, Hkv, S_attn, D], read through the block tables

- `PrefillAttention`: one request, a chunk of C tokens at positions start..start+C-1; writes the chunk's
  K/V into the request's blocks (its slot's row of the host block table), attends causally over positions
  [0, start + C): a view of the cache where the request's blocks are consecutive, else one gather of its
  blocks per layer (index_select of whole blocks). Where SDPA's flash kernel
  applies (CUDA, fp16/bf16, no sliding window: `PREFILL_KERNEL` "auto"), the causal mask is not built at
  all: a lower-right causal bias object (torch.nn.attention.bias.causal_lower_right) with the query heads
  unfolded and grouped-query K/V read in place (enable_gqa); elsewhere the folded layout and an additive
  bias built once per forward (`folded_bias`). A short chunk after a long history (a prefix hit's turn) takes
  the flash kernel in two parts merged by their log-sum-exp (prefix_attention.py), so that its work fills the SMs.
- `DecodeAttention`: one token for each of T requests. Fixed shapes for CUDA graphs (no host sync): the
  slots' rows of the device block table are read on the device, and the K/V write position of each token
  (`flat_index`) is computed there from them. One of two backends:
  - "triton" (the default on CUDA): kernels/decode_attention, a flash-decoding kernel that reads only
    the T requests' blocks up to each one's sequence length (grid bounded by the bucket), gpt-oss's sinks
    taken in its merge;
  - "sdpa" (CPU, and the fallback on CUDA): the T requests' positions [0, bucket) gathered through
    their table rows (kernels.decode_attention.gather_pages), then SDPA with a mask from a device
    tensor of sequence lengths (positions past a request's length, unused table entries included, are
    masked and read finite values).
Each layer reads and writes its own layer group's pool and table rows (kv_cache.KVGroup). A window group's layers
(gpt-oss's sliding layers, whose blocks before the window are released: -1 entries) read only their window: prefill
from the block of the chunk's first query's window on, decode through `gather_window` (SDPA path) or the Triton
kernel, which starts at the window's first position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from ftexpert.kernels.decode_attention import decode_attention, gather_pages, gather_window
from ftexpert.kernels.moe_decode import KvWrite

from ftexpert.gpu_worker.engine.kv_cache import KVCache, KVGroup
from ftexpert.gpu_worker.engine.prefix_attention import prefix_split_attention, split_applies
from ftexpert.gpu_worker.engine.sink_attention import (chunked_sink_attention, folded_sinks, sink_attention,
                                                       sink_key_attention)

MIN_DECODE_BUCKET_TOKENS = 64
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")
# Prefill attention: "auto" = the flash kernel with a lower-right causal bias object where it applies (no mask in
# memory: late in a 32K context a 4,096-token chunk's folded bias is 2 GiB for qwen3-30b-a3b), split into history and
# chunk where a short chunk follows a long history (prefix_attention.py), else the folded bias; "flash" = the same
# without the split (what benchmarks compare it with); "bias" = always the folded bias (the reference that
# benchmarks and tests compare the flash path with).
PREFILL_KERNELS = ("auto", "flash", "bias")
PREFILL_KERNEL = "auto"
CONTEXT_WINDOW = "context"      # attend's default sliding_window: the one the context was built with


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA, "sdpa" elsewhere; "triton" on CPU runs the Triton interpreter
    (TRITON_INTERPRET=1 set before the kernels are defined: tests only)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "sdpa"
    return backend


def decode_bucket_tokens(max_seq_len: int, max_context_tokens: int) -> int:
    """Attention span for a decode step: the next power of two >= max_seq_len (>= 64), capped."""
    bucket = MIN_DECODE_BUCKET_TOKENS
    while bucket < max_seq_len:
        bucket *= 2
    return min(bucket, max_context_tokens)


def consecutive_run(blocks: list[int]) -> int | None:
    """The first block if `blocks` are consecutive ids (b, b+1, ...), else None."""
    if blocks and blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        return blocks[0]
    return None


class _GroupChunk:
    """A prefill chunk's view of one layer group (kv_cache.KVGroup): the blocks of positions [base, end) of the
    slot's row, base = the group's first block for the chunk's first query times BS (0 but for a window group)."""

    def __init__(self, group: KVGroup, slot: int, start: int, end: int):
        self.group, self.start, self.end = group, start, end
        self.first = group.first_block(start)
        self.base = self.first * group.block_size
        blocks = group.row_blocks(slot, end, self.first)      # the host row: [base, end) must have its blocks
        self.run = consecutive_run(blocks)                     # consecutive blocks: the context is a view
        self.num_blocks = len(blocks)
        if self.run is None:
            device, bs = group.k.device, group.block_size
            self.pages = torch.tensor(blocks, dtype=torch.int64, device=device)
            pos = torch.arange(start, end, device=device)
            self.write_index = self.pages[pos // bs - self.first] * bs + pos % bs     # [C] flat cache index

    def context(self, cache: torch.Tensor, local: int) -> torch.Tensor:
        """Positions [base, end) in one layer of the group's cache: [end - base, Hkv, D], a view where the blocks
        are consecutive, else a gather of them."""
        g = self.group
        if self.run is not None:
            pages = cache[local, self.run:self.run + self.num_blocks]
        else:
            pages = cache[local].index_select(0, self.pages)
        return pages.view(-1, g.num_kv_heads, g.head_dim)[: self.end - self.base]

    def write(self, local: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The chunk's k / v [C, Hkv, D] at its positions."""
        at = self.start - self.base
        if self.run is not None:
            self.context(self.group.k, local)[at:].copy_(k)
            self.context(self.group.v, local)[at:].copy_(v)
            return
        k_flat, v_flat = self.group.flat(local)
        k_flat.index_copy_(0, self.write_index, k)
        v_flat.index_copy_(0, self.write_index, v)


def _layer_window(group: KVGroup, asked: int | None | str, context: int | None) -> int | None:
    """The window a layer attends with: asked (CONTEXT_WINDOW: the context's); a window group's layer must ask for
    its group's window or none (the group keeps no more)."""
    window = context if asked == CONTEXT_WINDOW else asked
    if group.window is not None:
        if window is not None and window != group.window:
            raise ValueError(f"a layer of the KV cache's window group (window {group.window}) asked for window "
                             f"{window}; the group keeps only its own window")
        return group.window
    return window


class PrefillAttention:
    def __init__(self, kv: KVCache, slot: int, start_pos: int, num_tokens: int,
                 sliding_window: int | None = None):
        self.kv, self.slot, self.start, self.end = kv, slot, start_pos, start_pos + num_tokens
        if self.end > kv.max_context_tokens:
            raise ValueError(f"chunk ends at position {self.end} > max_context_tokens {kv.max_context_tokens}")
        self._chunks = [_GroupChunk(g, slot, self.start, self.end) for g in kv.groups]
        self.sliding_window = sliding_window
        self._mask: torch.Tensor | None = None
        self._folded: dict[tuple[int, torch.dtype], torch.Tensor] = {}   # (G, dtype) -> the folded heads' bias
        self._flash: bool | None = None          # whether attend takes the flash path (decided at its first call)
        self._split: bool | None = None          # whether that path splits history and chunk (likewise)
        self._sink_flash: bool | None = None     # whether flash takes a full layer's sinks as a key (likewise)

    @property
    def _first(self) -> int | None:
        """The first group's first block where the chunk's context is its consecutive blocks (a view), else None."""
        return self._chunks[0].run

    @property
    def mask(self) -> torch.Tensor:
        """[C, S_attn] bool: query c may attend key s. Built at first use: the flash path never needs it (at a
        4,096-token chunk late in a 32K context it would be 128 MiB)."""
        if self._mask is None:
            device = self.kv.k.device
            q_pos = torch.arange(self.start, self.end, device=device)[:, None]     # [C, 1]
            k_pos = torch.arange(self.end, device=device)[None, :]                # [1, S_attn]
            mask = k_pos <= q_pos                                                  # [C, S_attn]
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            self._mask = mask
        return self._mask

    def folded_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """[G*C, S_attn] additive bias in `dtype`: 0 where row g*C + c (query c) may attend, -inf elsewhere. Built
        once per forward and shared by the layers: given the boolean mask, SDPA would make this same tensor
        itself at every layer (torch's convert_boolean_attn_mask: zeros, -inf where the mask is False; the
        results are bitwise the same), which at a 4K chunk late in a 32K context is 2 GiB written 48 times. Its
        rows are a view with a stride rounded up to 8 elements: SDPA's memory-efficient kernel wants aligned
        rows and would otherwise pad a copy at every layer. Filled by broadcasting the [C, S] mask (no G-fold
        boolean copies)."""
        key = (group, dtype)
        if key not in self._folded:
            C, S = self.mask.shape
            stride = -(-S // 8) * 8
            bias = torch.zeros((group, C, stride), dtype=dtype, device=self.mask.device)
            bias[:, :, :S].masked_fill_(~self.mask, float("-inf"))
            self._folded[key] = bias.view(group * C, stride)[:, :S]
        return self._folded[key]

    def _flash_applies(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether SDPA's flash kernel takes this call's shapes and dtype with grouped-query K/V (CUDA, fp16/bf16,
        supported head size), so that the lower-right causal bias runs without a mask in memory. The efficient
        kernel's lower-right path would not take grouped-query K/V, and the fallback materialises the mask: the
        folded bias is better there."""
        if PREFILL_KERNEL not in PREFILL_KERNELS:
            raise ValueError(f"PREFILL_KERNEL must be one of {', '.join(PREFILL_KERNELS)}, got {PREFILL_KERNEL!r}")
        if PREFILL_KERNEL == "bias" or self.sliding_window is not None or q.device.type != "cuda":
            return False
        qh = q.transpose(0, 1).unsqueeze(0)
        return bool(can_use_flash_attention(SDPAParams(qh, keys, values, None, 0.0, False, True)))

    def kv_write(self, layer_idx: int, v: torch.Tensor) -> KvWrite | None:
        return None                                   # a chunk's K/V: written in attend

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               kv_written: bool = False, sinks: torch.Tensor | None = None,
               sliding_window: int | None | str = CONTEXT_WINDOW) -> torch.Tensor:
        C, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        if kv_written:
            raise ValueError("PrefillAttention writes the chunk's K/V itself (its kv_write gives None)")
        group, local = self.kv.layer_group(layer_idx)
        chunk = self._chunks[self.kv.groups.index(group)]
        chunk.write(local, k, v)
        keys = chunk.context(group.k, local).transpose(0, 1).unsqueeze(0)                  # [1, Hkv, S, D]
        values = chunk.context(group.v, local).transpose(0, 1).unsqueeze(0)                # [1, Hkv, S, D]
        if sinks is not None or sliding_window != CONTEXT_WINDOW or group.window is not None:
            window = _layer_window(group, sliding_window, self.sliding_window)
            if sinks is not None and window is None and PREFILL_KERNEL == "auto" and self._sink_flash is not False:
                out = sink_key_attention(q, keys, values, sinks, D ** -0.5)     # flash, the sink as a key
                self._sink_flash = out is not None
                if out is not None:
                    return out
            return chunked_sink_attention(q, keys, values, start=self.start, base=chunk.base, window=window,
                                          sinks=sinks, scale=D ** -0.5)
        if self._flash is None:
            self._flash = self._flash_applies(q, keys, values)
        if self._flash:        # query c attends keys [0, start + c]: causal, aligned to the lower right
            if self._split is None:
                self._split = (PREFILL_KERNEL == "auto" and keys.shape[2] == self.end
                               and split_applies(C, Hq, self.start, q.device))
            if self._split:    # a short chunk after a long history: history and chunk, merged
                return prefix_split_attention(q, keys, values, self.start, D ** -0.5)
            qh = q.transpose(0, 1).unsqueeze(0)                                            # [1, Hq, C, D]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=causal_lower_right(C, self.end),
                                                 scale=D ** -0.5, enable_gqa=True)         # [1, Hq, C, D]
            return out[0].transpose(0, 1).contiguous()
        qf = q.view(C, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * C, D)           # row g*C + c
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=self.folded_bias(G, qf.dtype),
                                             scale=D ** -0.5)
        return out.view(Hkv, G, C, D).permute(2, 0, 1, 3).reshape(C, Hq, D)


class DecodeAttention:
    """slot_ids, positions: [T] int64 device tensors (each slot at most once; slot s's K/V through row s of each
    layer group's block table, which must hold a block for every position up to its position that the group keeps);
    bucket_tokens: a host int >= max position + 1. backend: "auto" | "sdpa" | "triton" (see the module docstring).
    A window group's layers (kv_cache.py) read only the blocks of their window: the Triton kernel starts at the
    window's first position, the SDPA path gathers the window's blocks alone (`gather_window`)."""

    def __init__(self, kv: KVCache, slot_ids: torch.Tensor, positions: torch.Tensor, bucket_tokens: int,
                 sliding_window: int | None = None, backend: str = "auto"):
        self.kv, self.slot_ids, self.bucket = kv, slot_ids, bucket_tokens
        self.sliding_window = sliding_window
        self.backend = resolve_attention_backend(backend, kv.k.device)
        bs = kv.block_size
        block = torch.div(positions, bs, rounding_mode="floor")
        self._flat = [group.block_tables[slot_ids, block].long() * bs + positions % bs for group in kv.groups]
        self.flat_index = self._flat[0]                                                    # [T]
        self.positions = positions
        self.seq_lens = positions + 1                                                      # [T]
        self._window_masks: dict[int | None, torch.Tensor] = {}
        self._group_masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.backend == "triton":
            self.mask = None
            return
        self.mask = self.window_mask(sliding_window)                                       # [T, 1, 1, bucket]

    def window_mask(self, window: int | None) -> torch.Tensor:
        """[T, 1, 1, bucket] bool: which positions each request attends with ``window`` (None: all it has)."""
        if window not in self._window_masks:
            seq_lens = self.seq_lens[:, None]                                              # [T, 1]
            k_pos = torch.arange(self.bucket, device=self.positions.device)[None, :]       # [1, bucket]
            mask = k_pos < seq_lens                                                        # [T, bucket]
            if window is not None:
                mask &= k_pos >= seq_lens - window
            self._window_masks[window] = mask[:, None, None, :]
        return self._window_masks[window]

    def _window_mask_of(self, g: int, positions: torch.Tensor, window: int) -> torch.Tensor:
        """[T, 1, 1, S] bool over a window group's gathered positions [T, S] (the same for each of its layers)."""
        if g not in self._group_masks:
            seq_lens = self.seq_lens[:, None]
            mask = (positions < seq_lens) & (positions >= seq_lens - window)
            self._group_masks[g] = mask[:, None, None, :]
        return self._group_masks[g]

    def kv_write(self, layer_idx: int, v: torch.Tensor) -> KvWrite:
        """Each request's k/v at its position, for the rope kernel to write (one launch fewer a layer)."""
        group, local = self.kv.layer_group(layer_idx)
        k_flat, v_flat = group.flat(local)                                                 # [NB*BS, Hkv, D]
        return KvWrite(k_flat, v_flat, self._flat[self.kv.groups.index(group)], v)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               kv_written: bool = False, sinks: torch.Tensor | None = None,
               sliding_window: int | None | str = CONTEXT_WINDOW) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after rope): writes k/v at each request's position (unless
        `kv_written`: the rope kernel wrote them through `kv_write`) -> [T, Hq, D]. sinks / sliding_window: see
        the module docstring."""
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        group, local = self.kv.layer_group(layer_idx)
        g = self.kv.groups.index(group)
        if not kv_written:
            k_flat, v_flat = group.flat(local)                                             # [NB*BS, Hkv, D]
            k_flat.index_copy_(0, self._flat[g], k)
            v_flat.index_copy_(0, self._flat[g], v)
        custom = sinks is not None or sliding_window != CONTEXT_WINDOW or group.window is not None
        window = _layer_window(group, sliding_window, self.sliding_window)
        qg = q.view(T, Hkv, G, D)                                                          # keys [T, Hkv, S, D]
        if self.backend == "triton" and (not custom or group.window is not None or sinks is not None):
            return decode_attention(q, group.k[local], group.v[local], self.slot_ids, self.seq_lens,
                                    scale=D ** -0.5, bucket=self.bucket, sliding_window=window,
                                    impl="triton", block_tables=group.block_tables, sinks=sinks)
        if group.window is not None:                     # the window's blocks only: entries before it are -1
            keys, pos = gather_window(group.k[local], group.block_tables, self.slot_ids, self.seq_lens, window)
            values, _ = gather_window(group.v[local], group.block_tables, self.slot_ids, self.seq_lens, window)
            mask = self._window_mask_of(g, pos, window)
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        else:
            keys = gather_pages(group.k[local], group.block_tables, self.slot_ids, self.bucket).transpose(1, 2)
            values = gather_pages(group.v[local], group.block_tables, self.slot_ids, self.bucket).transpose(1, 2)
            mask = self.window_mask(window) if custom else self.mask
        if custom:
            out = sink_attention(qg, keys, values, mask, folded_sinks(sinks, Hkv, G, 1), D ** -0.5)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=D ** -0.5)
        return out.reshape(T, Hq, D)
