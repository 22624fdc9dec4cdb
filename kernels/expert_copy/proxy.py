"""The device side of the DMA proxy (gpu_worker/offload/dma_proxy.py): publish a copy plan to the host,
and wait until the proxy's copy-engine DMAs of it have landed.

    publish   one program: when the plan is not empty, seq = state[ST_SEQ] + 1; the plan's (host row,
              slot) pairs, the layer and n go into mailbox entry seq % ring, then (behind a system fence)
              the mailbox's seq word = seq; state[ST_SEQ] = seq. Nothing is published once state[ST_FAIL]
              is set (the proxy is given up for the rest of the step).
    wait      one program: spins until landed[part] >= state[ST_SEQ] (the proxy writes landed[part] with
              cuStreamWriteValue64 after the part's copies). If the proxy reported an error (the mailbox's
              fail word) or the deadline state[ST_DEADLINE_NS] passed, or state[ST_FAIL] was already set,
              it sets state[ST_FAIL] (and the mapped fail word the host reads) and copies the part itself
              with its one program: the step stays correct (slowly) and the host switches to the kernel
              copy at the step's end (OffloadExperts.step_end).

Both are graph-capturable: the sequence lives on the device, so a replay publishes the next one.
The mailbox is host memory the device can address (pinned, or any CPU tensor under the interpreter);
its layout is dma_proxy.c's (FT_MBOX_*, FT_ENTRY_*).
"""
from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from kernels.handoff.triton_kernels import _fence_sys, _ld_sys, _now_ns
from kernels.impl import resolve_impl

# Mailbox words (int64) and entry words (int32): dma_proxy.c's FT_MBOX_* / FT_ENTRY_*.
MBOX_SEQ, MBOX_FAIL, MBOX_WAIT_FAIL = 0, 1, 2      # MBOX_WAIT_FAIL (written by the device, read by the host): 1 a
                                                  # wait gave up, 2 a plan longer than the mailbox was not published
MBOX_HEADER = 8
ENTRY_SEQ, ENTRY_LAYER, ENTRY_N, ENTRY_PAIRS = 0, 2, 3, 4
# Device state words (int64).
ST_SEQ = 0              # the last sequence published
ST_FAIL = 1             # a wait gave up on the proxy (deadline or its error) and copied itself
ST_DEADLINE_NS = 2      # how long a wait spins before it gives up
ST_WAIT_NS = 3          # time the waits spent spinning (GPU: %globaltimer ns; interpreter: 1000 a spin)
ST_PUBLISHED = 4        # plans published
ST_FALLBACKS = 5        # parts the wait kernel copied itself
STATE_WORDS = 6
POLL_EVERY = 64         # a wait looks at the proxy's (mapped) fail word once every this many polls
FALLBACK_BLOCK = 1024   # 16-bit words per iteration of the wait kernel's own copy

_MBOX_SEQ = tl.constexpr(MBOX_SEQ)
_MBOX_FAIL = tl.constexpr(MBOX_FAIL)
_MBOX_WAIT_FAIL = tl.constexpr(MBOX_WAIT_FAIL)
_MBOX_HEADER = tl.constexpr(MBOX_HEADER)
_ENTRY_LAYER = tl.constexpr(ENTRY_LAYER)
_ENTRY_N = tl.constexpr(ENTRY_N)
_ENTRY_PAIRS = tl.constexpr(ENTRY_PAIRS)
_ST_SEQ = tl.constexpr(ST_SEQ)
_ST_FAIL = tl.constexpr(ST_FAIL)
_ST_DEADLINE_NS = tl.constexpr(ST_DEADLINE_NS)
_ST_WAIT_NS = tl.constexpr(ST_WAIT_NS)
_ST_PUBLISHED = tl.constexpr(ST_PUBLISHED)
_ST_FALLBACKS = tl.constexpr(ST_FALLBACKS)
_POLL_EVERY = tl.constexpr(POLL_EVERY)


def entry_words(max_pairs: int) -> int:
    """int32 words of one mailbox entry (a multiple of 16: entries start on cache lines)."""
    return -(-(ENTRY_PAIRS + 2 * max_pairs) // 16) * 16


def mailbox_words(max_pairs: int, ring: int) -> int:
    """int64 words of a mailbox with `ring` entries."""
    return MBOX_HEADER + ring * entry_words(max_pairs) // 2


@triton.jit
def publish_kernel(state_ptr, mbox_addr, evict_ptr, src_ptr, num_indices_ptr, layer, ring, entry_words, max_pairs,
                   BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    n = tl.load(num_indices_ptr)
    failed = tl.load(state_ptr + _ST_FAIL)
    if (n > max_pairs) & (failed == 0):                      # cannot happen from ensure; never write past the entry:
        failed = failed + 1                                  # the waits copy this plan themselves
        tl.store(state_ptr + _ST_FAIL, 1)
        tl.store(mbox_addr.to(tl.pointer_type(tl.int64)) + _MBOX_WAIT_FAIL, 2)
    if (n > 0) & (failed == 0):
        seq = tl.load(state_ptr + _ST_SEQ) + 1
        mbox = mbox_addr.to(tl.pointer_type(tl.int64))
        entry = (mbox_addr + _MBOX_HEADER * 8).to(tl.pointer_type(tl.int32)) + (seq % ring) * entry_words
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(entry + _ENTRY_PAIRS + 2 * offs, tl.load(src_ptr + offs, mask=m, other=0).to(tl.int32), mask=m)
        tl.store(entry + _ENTRY_PAIRS + 2 * offs + 1, tl.load(evict_ptr + offs, mask=m, other=0).to(tl.int32),
                 mask=m)
        tl.store(entry + _ENTRY_LAYER, layer)
        tl.store(entry + _ENTRY_N, n.to(tl.int32))
        tl.store(entry.to(tl.pointer_type(tl.int64)), seq)
        _fence_sys(ON_GPU)                                   # the entry before the mailbox's seq
        tl.store(mbox + _MBOX_SEQ, seq)
        tl.store(state_ptr + _ST_SEQ, seq)
        tl.store(state_ptr + _ST_PUBLISHED, tl.load(state_ptr + _ST_PUBLISHED) + 1)


@triton.jit
def wait_kernel(state_ptr, landed_ptr, part, mbox_addr,
                slots_ptr, host_addr, host_row_words, row_words, evict_ptr, src_ptr, num_indices_ptr,
                col_lo, col_hi, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    target = tl.load(state_ptr + _ST_SEQ)
    failed = tl.load(state_ptr + _ST_FAIL)
    mbox = mbox_addr.to(tl.pointer_type(tl.int64))
    landed = _ld_sys(landed_ptr + part, ON_GPU)
    if (failed == 0) & (landed < target):
        deadline = tl.load(state_ptr + _ST_DEADLINE_NS)
        start = _now_ns(0, ON_GPU)
        proxy_fail = landed * 0
        spins = 0
        while (landed < target) & (proxy_fail == 0) & (_now_ns(spins, ON_GPU) - start < deadline):
            spins += 1
            if spins % _POLL_EVERY == 0:
                proxy_fail = tl.load(mbox + _MBOX_FAIL, volatile=True)
            landed = _ld_sys(landed_ptr + part, ON_GPU)
        tl.store(state_ptr + _ST_WAIT_NS, tl.load(state_ptr + _ST_WAIT_NS) + (_now_ns(spins, ON_GPU) - start))
        if landed < target:
            failed = failed + 1
            tl.store(state_ptr + _ST_FAIL, 1)
            tl.store(mbox + _MBOX_WAIT_FAIL, 1)
    if failed != 0:                                          # copy this part of the plan with this program
        n = tl.load(num_indices_ptr)
        host = host_addr.to(tl.pointer_type(tl.int16))
        for i in range(0, n):
            dst = tl.load(evict_ptr + i).to(tl.int64)
            src = tl.load(src_ptr + i).to(tl.int64)
            for w0 in range(col_lo, col_hi, BLOCK):
                offs = w0 + tl.arange(0, BLOCK)
                m = offs < col_hi
                tl.store(slots_ptr + dst * row_words + offs, tl.load(host + src * host_row_words + offs, mask=m),
                         mask=m)
        if n > 0:
            tl.store(state_ptr + _ST_FALLBACKS, tl.load(state_ptr + _ST_FALLBACKS) + 1)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def publish(state: torch.Tensor, mbox: torch.Tensor, mbox_addr: int, evict_slots: torch.Tensor, src_indices: torch.Tensor,
            num_indices: torch.Tensor, *, layer: int, ring: int, max_pairs: int, impl: str = "auto") -> None:
    """Publish the plan (evict_slots, src_indices)[:num_indices] of `layer` into the mailbox `mbox` (int64 host
    memory; `mbox_addr`: its address as the device sees it); see the module docstring."""
    impl = resolve_impl(impl, state.device)
    words = entry_words(max_pairs)
    if impl == "reference":
        n = int(num_indices.reshape(-1)[0])
        if n <= 0 or int(state[ST_FAIL]) != 0:
            return
        if n > max_pairs:                           # as the kernel: the waits copy this plan themselves
            state[ST_FAIL] = 1
            mbox[MBOX_WAIT_FAIL] = 2
            return
        seq = int(state[ST_SEQ]) + 1
        entries = mbox[MBOX_HEADER:].view(torch.int32)
        e = entries[(seq % ring) * words:(seq % ring + 1) * words]
        pairs = torch.stack([src_indices[:n].to(torch.int32).cpu(), evict_slots[:n].to(torch.int32).cpu()], dim=1)
        e[ENTRY_PAIRS:ENTRY_PAIRS + 2 * n].copy_(pairs.reshape(-1))
        e[ENTRY_LAYER], e[ENTRY_N] = layer, n
        e[:2].view(torch.int64)[0] = seq
        mbox[MBOX_SEQ] = seq                        # (CPU tensors: the proxy thread reads it after the entry)
        state[ST_SEQ] = seq
        state[ST_PUBLISHED] += 1
        return
    publish_kernel[(1,)](state, mbox_addr, evict_slots, src_indices, num_indices, layer, ring, words, max_pairs,
                         BLOCK=max(16, triton.next_power_of_2(max_pairs)), ON_GPU=_on_gpu(state), num_warps=1)


def wait(state: torch.Tensor, landed: torch.Tensor, part: int, mbox: torch.Tensor, mbox_addr: int, slots: torch.Tensor,
         host_rows: torch.Tensor, evict_slots: torch.Tensor, src_indices: torch.Tensor, num_indices: torch.Tensor,
         cols: tuple[int, int], *, impl: str = "auto") -> None:
    """Wait until the proxy has landed `part` of the last published plan; if it failed or is late, copy that
    part (cols = the element range of a row) here. slots [S, N], host_rows [E, N] (the layer's)."""
    from .api import _words
    impl = resolve_impl(impl, state.device)
    slot_words, host_words = _words(slots, "slots"), _words(host_rows, "host_rows")
    per = slots.element_size() // 2
    lo, hi = cols[0] * per, cols[1] * per
    if hi <= lo:
        return
    if impl == "reference":
        target = int(state[ST_SEQ])
        failed = int(state[ST_FAIL]) != 0
        if not failed and int(landed[part]) < target:
            start = time.monotonic_ns()
            deadline = int(state[ST_DEADLINE_NS])
            while int(landed[part]) < target and int(mbox[MBOX_FAIL]) == 0 \
                    and time.monotonic_ns() - start < deadline:
                time.sleep(0)
            state[ST_WAIT_NS] += time.monotonic_ns() - start
            if int(landed[part]) < target:
                failed = True
                state[ST_FAIL] = 1
                mbox[MBOX_WAIT_FAIL] = 1
        if failed:
            from .reference import copy_plan_reference
            copy_plan_reference(slot_words, host_words, evict_slots, src_indices, num_indices, lo, hi)
            if int(num_indices.reshape(-1)[0]) > 0:
                state[ST_FALLBACKS] += 1
        return
    wait_kernel[(1,)](state, landed, part, mbox_addr, slot_words, host_words.data_ptr(), host_words.stride(0),
                      slot_words.stride(0), evict_slots, src_indices, num_indices, lo, hi,
                      BLOCK=FALLBACK_BLOCK, ON_GPU=_on_gpu(state), num_warps=4)
