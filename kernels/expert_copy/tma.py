"""An experiment: the plan copy with Hopper's TMA (bulk tensor loads) instead of SM vector loads.

The plan-copy kernel (triton_kernels.py) reads mapped host memory with 16-byte loads per thread and moves
an expert at 92-95% of what the copy engine does over the same link (docs/OFFLOAD.md). One guess why: the
PCIe read requests an SM's loads turn into are smaller than the copy engine's, so more of the link goes
to packet headers. A TMA load asks for a whole tile at once; whether that changes the requests on the link
is what `bench/bench_copy_plan.py --tma` measures. Same contract as `copy_plan` (slots[evict[i]] =
host_rows[src[i]] for i < num_indices, columns [lo, hi)); the rows are viewed as tiles of
[block_rows, TILE_WORDS] 16-bit words, so the row length and the column range must be multiples of
TILE_WORDS (every expert format of the presets is).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_WORDS = 64            # 128 bytes: the widest inner box a 128-byte swizzle takes
DEFAULT_BLOCK_ROWS = 256   # a 32 KiB tile


@triton.jit
def copy_plan_tma_kernel(src_desc, slots_ptr, evict_ptr, src_ptr, num_indices_ptr, tiles_per_row, tile_lo,
                         tile_hi, BM: tl.constexpr, BN: tl.constexpr):
    """Grid (copies, cdiv(tile_hi - tile_lo, BM)): program (i, t) moves rows [tile_lo + t*BM, +BM) of the
    [tiles_per_row, BN] view of plan entry i's expert."""
    i = tl.program_id(0)
    t = tl.program_id(1)
    if i < tl.load(num_indices_ptr):
        r0 = tile_lo + t * BM
        src_row = tl.load(src_ptr + i)
        dst_row = tl.load(evict_ptr + i).to(tl.int64)
        tile = src_desc.load([src_row * tiles_per_row + r0, 0])                       # [BM, BN]
        rows = r0 + tl.arange(0, BM)
        offs = (dst_row * tiles_per_row + rows.to(tl.int64))[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(slots_ptr + offs, tile, mask=(rows < tile_hi)[:, None])


def copy_plan_tma(slots: torch.Tensor, host_rows: torch.Tensor, evict_slots: torch.Tensor, src_indices: torch.Tensor,
                  num_indices: torch.Tensor, *, max_copies: int, cols: tuple[int, int] | None = None,
                  block_rows: int = DEFAULT_BLOCK_ROWS) -> None:
    """copy_plan's contract through TMA loads (GPU, sm_90). host_rows: [E, N] pinned / registered host rows
    (their address is the device's under UVA, as for copy_plan)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    words_slots, words_host = slots.view(torch.int16), host_rows.view(torch.int16)
    per = slots.element_size() // 2
    row_words = words_slots.shape[1]
    lo, hi = (0, slots.shape[1]) if cols is None else cols
    lo, hi = lo * per, hi * per
    if (row_words % TILE_WORDS or lo % TILE_WORDS or hi % TILE_WORDS or words_host.stride(0) != row_words
            or not words_host.is_contiguous()):
        raise ValueError(f"copy_plan_tma needs contiguous rows of a multiple of {TILE_WORDS} words and a column "
                         f"range on that grid; got rows of {row_words} words (host stride {words_host.stride(0)}), "
                         f"columns [{lo}, {hi})")
    tiles_per_row = row_words // TILE_WORDS
    flat = words_host.reshape(-1, TILE_WORDS)                                     # [E * tiles_per_row, 64]
    desc = TensorDescriptor(flat, list(flat.shape), [TILE_WORDS, 1], [block_rows, TILE_WORDS])
    t_lo, t_hi = lo // TILE_WORDS, hi // TILE_WORDS
    grid = (max_copies, triton.cdiv(t_hi - t_lo, block_rows))
    copy_plan_tma_kernel[grid](desc, words_slots, evict_slots, src_indices, num_indices, tiles_per_row, t_lo,
                               t_hi, BM=block_rows, BN=TILE_WORDS)
