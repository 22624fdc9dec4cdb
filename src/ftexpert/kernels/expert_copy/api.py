"""`copy_plan`: validation and dispatch of the plan copy."""
from __future__ import annotations

import torch

from ftexpert.kernels.impl import interpreted

from ftexpert.kernels.expert_copy.reference import copy_plan_reference

DEFAULT_CHUNKS = 64        # programs per expert row
BLOCK_WORDS = 2048         # 16-bit words a program moves per loop iteration (4 KiB)
NUM_WARPS = 4


def _words(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{what} must be [rows, elements] with contiguous rows, got {tuple(t.shape)}")
    if t.element_size() not in (1, 2, 4):
        raise ValueError(f"{what} must hold 1-, 2- or 4-byte elements, got {t.dtype}")
    if t.element_size() == 1 and (t.shape[1] % 2 or t.stride(0) % 2 or t.storage_offset() % 2):
        raise ValueError(f"{what}: byte rows (a quantized expert's) must be an even number of bytes at even "
                         f"offsets, got {tuple(t.shape)} with strides {t.stride()}")
    return t.view(torch.int16)


def copy_plan(slots: torch.Tensor, host_rows: torch.Tensor, evict_slots: torch.Tensor,
              src_indices: torch.Tensor, num_indices: torch.Tensor, *, max_copies: int,
              impl: str = "auto", chunks: int | None = None, block_words: int | None = None,
              num_warps: int | None = None, cols: tuple[int, int] | None = None) -> None:
    """slots[evict[i]] = host_rows[src[i]] for i < num_indices, without reading the plan on the host.

    slots: [S_total, N] device pool (2- or 4-byte elements, or uint8 bytes of quantized experts, N even);
    host_rows: [E, N] host view (pinned / registered for the
    device on CUDA); plan tensors as written by kernels.slot_cache.ensure; max_copies: an upper
    bound of num_indices known on the host (e.g. the number of routes), which sizes the grid.
    chunks (programs per expert), block_words (16-bit words a program moves per iteration) and
    num_warps tune the kernel; None: the module's DEFAULT_CHUNKS / BLOCK_WORDS / NUM_WARPS, read at
    call time (bench/bench_copy_plan.py sweeps them).
    cols = (lo, hi): copy only elements [lo, hi) of each planned row (an expert's w13 or w2, so that a
    copy in two parts can release the GEMMs of the first part early); the chunk size stays the one of a
    whole row, so a part takes proportionally fewer programs. None: the whole row.
    """
    if slots.dtype != host_rows.dtype or slots.shape[1] != host_rows.shape[1]:
        raise ValueError(f"slots {tuple(slots.shape)} {slots.dtype} and host rows "
                         f"{tuple(host_rows.shape)} {host_rows.dtype} must share dtype and row size")
    slot_words, host_words = _words(slots, "slots"), _words(host_rows, "host_rows")
    item = slots.element_size()                                      # bytes per element (1: a quantized row)
    lo, hi = (0, slots.shape[1]) if cols is None else (int(cols[0]), int(cols[1]))
    if not 0 <= lo <= hi <= slots.shape[1]:
        raise ValueError(f"cols {cols} must satisfy 0 <= lo <= hi <= {slots.shape[1]} (the row's elements)")
    if (lo * item) % 2 or (hi * item) % 2:
        raise ValueError(f"cols {cols} of byte rows must be even (the copy moves 16-bit words)")
    lo, hi = lo * item // 2, hi * item // 2
    if impl == "auto":
        impl = "triton" if slots.device.type == "cuda" else "reference"
    if impl == "reference":
        copy_plan_reference(slot_words, host_words, evict_slots, src_indices, num_indices, lo, hi)
        return
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    if slots.device.type != "cuda" and not interpreted():
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (the interpreter)")
    if max_copies <= 0 or hi == lo:
        return
    # lazy: the Triton kernels are defined at their first launch (TRITON_INTERPRET is read then)
    from ftexpert.kernels.expert_copy.triton_kernels import copy_plan_kernel
    chunks = DEFAULT_CHUNKS if chunks is None else int(chunks)
    block = BLOCK_WORDS if block_words is None else int(block_words)
    warps = NUM_WARPS if num_warps is None else int(num_warps)
    if chunks < 1 or block < 8 or block & (block - 1) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"chunks {chunks} must be >= 1, block_words {block} a power of two >= 8, "
                         f"num_warps {warps} one of 1, 2, 4, 8, 16")
    aligned = host_words.data_ptr() % 16 == 0 and host_words.stride(0) % 8 == 0 and lo % 8 == 0
    row_words = slot_words.shape[1]
    chunk_words = -(-row_words // chunks)
    chunk_words = -(-chunk_words // block) * block
    grid = (max_copies, -(-(hi - lo) // chunk_words))
    copy_plan_kernel[grid](slot_words, host_words.data_ptr(), host_words.stride(0), evict_slots,
                           src_indices, num_indices, row_words, chunk_words, lo, hi, BLOCK=block,
                           ALIGNED=aligned, num_warps=warps)
