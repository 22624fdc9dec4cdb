"""The DMA proxy: copy-engine copies of a device-side copy plan, inside or outside a CUDA graph.

The offload backend's `kernel` copy mode moves a layer's missing experts with SM loads (kernels/expert_copy)
because the plan is device data that a captured graph cannot hand to cudaMemcpy. The copy engine moves
host memory ~7% faster than those loads (docs/OFFLOAD.md). Copy mode `proxy` keeps the plan on the device
and the step in one graph, and has a host thread issue the DMAs:

    compute stream (graph)                     proxy thread (dma_proxy.c)               proxy stream
    ensure -> plan on the device
    publish kernel: plan -> mailbox, seq  ---> sees seq, issues per planned expert:  ->  DMA w13 ...
    hits' GEMMs (beside the copies)                                                       landed[0] = seq
    wait kernel: landed[0] >= seq        <------------------------------------------     DMA w2 ...
    fetched routes' gate/up                                                               landed[1] = seq
    wait kernel: landed[1] >= seq        <------------------------------------------
    fetched routes' down, the sum

Ordering: the publish kernel runs after every kernel queued before it on the compute stream (it is launched
without programmatic dependent launch), so the DMAs never overwrite a slot an earlier GEMM still reads; the
landed write follows the copies on the proxy's stream with a fence (CU_STREAM_WRITE_VALUE_DEFAULT), so a wait
that sees it sees the bytes. One plan is in flight at a time (each layer waits for its own), so a ring of
four entries is never overrun.

Faults: if the proxy stops on an error (it writes the mailbox's fail word) or a wait passes its deadline, the
wait kernel copies the part itself and sets a sticky device flag: the step stays correct, slowly, and
`failed()` (read by OffloadExperts.step_end) has the backend drop the proxy for the kernel copy and re-run
the step. Not covered: a proxy thread that stalls past the deadline (seconds) and then wakes could land a
stale copy in a slot that a later layer re-mapped in the same step; that step is re-run after the cache is
reset, but an eager prefill call has no re-run.

Without CUDA (CI), the "device" is host memory: the C thread copies with memcpy and stores the landed words
itself, and the publish / wait run as the Triton interpreter or their Python references (kernels/expert_copy
/proxy.py), so the whole protocol runs on a machine without a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from pathlib import Path

import torch

from kernels.expert_copy import proxy as proxy_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("dma_proxy.c")
RING = 4                    # mailbox entries (one plan is in flight at a time)
DEADLINE_S = 0.5            # a wait gives up on the proxy after this long (then copies itself); a decode plan of
                            # 32 experts takes ~6 ms, a small prefill chunk's 128 ~23 ms
QUIESCE_S = 5.0             # how long settling after a failure waits for the thread to catch up
HOT_S = 0.05                # the thread spins this long after the last plan, then polls every SLEEP_US
SLEEP_US = 20

ERRORS = {-1: "a mailbox entry did not carry the announced sequence", -2: "a plan named a layer out of range",
          -3: "a plan was longer than the mailbox holds", -4: "a plan named a host row out of range",
          -5: "a plan named a slot out of range", -6: "making the CUDA context current in the proxy thread failed"}


class _Proxy(ctypes.Structure):
    """ctypes mirror of ft_proxy (dma_proxy.c); its field offsets are checked against the C ones at load."""
    _fields_ = [("mbox", ctypes.c_void_p), ("ring", ctypes.c_int64), ("entry_words", ctypes.c_int64),
                ("max_pairs", ctypes.c_int64), ("layer_base", ctypes.c_void_p), ("num_layers", ctypes.c_int64),
                ("num_rows", ctypes.c_int64), ("host_stride", ctypes.c_int64), ("slots_base", ctypes.c_uint64),
                ("num_slots", ctypes.c_int64), ("slot_stride", ctypes.c_int64), ("part_lo", ctypes.c_int64 * 2),
                ("part_hi", ctypes.c_int64 * 2), ("landed", ctypes.c_uint64 * 2), ("ctx", ctypes.c_void_p),
                ("stream", ctypes.c_void_p), ("memcpy_htod", ctypes.c_void_p), ("write64", ctypes.c_void_p),
                ("ctx_set", ctypes.c_void_p), ("hot_ns", ctypes.c_int64), ("sleep_ns", ctypes.c_int64),
                ("done", ctypes.c_int64), ("status", ctypes.c_int64), ("failed_seq", ctypes.c_int64),
                ("copies", ctypes.c_int64), ("bytes", ctypes.c_int64), ("issue_ns", ctypes.c_int64),
                ("max_call_ns", ctypes.c_int64), ("max_call_at_ns", ctypes.c_int64), ("stop", ctypes.c_int32),
                ("thread", ctypes.c_ulong), ("running", ctypes.c_int32)]


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL:
    """Build dma_proxy.c (first use, cached like the CPU expert kernel) and bind it."""
    from cpu_expert_pool.native.build import build_library
    path = build_library(sources=(SOURCE,), stem="libft_dma_proxy",
                         cflags=("-O2", "-shared", "-fPIC", "-Wall", "-pthread"), libs=("-lpthread",),
                         what="the DMA proxy", fallback="use --offload-copy kernel meanwhile")
    lib = ctypes.CDLL(str(path))
    for name in ("ft_proxy_start", "ft_proxy_stop"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_Proxy)]
        getattr(lib, name).restype = ctypes.c_int
    lib.ft_proxy_size.restype = ctypes.c_int64
    lib.ft_proxy_offsets.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ft_proxy_offsets.restype = ctypes.c_int
    offsets = (ctypes.c_int64 * 64)()
    count = lib.ft_proxy_offsets(offsets, 64)
    mine = [getattr(_Proxy, name).offset for name, _ in _Proxy._fields_]
    if lib.ft_proxy_size() != ctypes.sizeof(_Proxy) or list(offsets[:count]) != mine:
        raise RuntimeError(f"dma_proxy.c's ft_proxy ({lib.ft_proxy_size()} bytes, offsets {list(offsets[:count])}) "
                           f"and its ctypes mirror ({ctypes.sizeof(_Proxy)}, {mine}) disagree: update _Proxy")
    return lib


def _addr(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class DmaProxy:
    """One proxy thread for a slot pool `slots` [S, N] and the host rows of every layer `host_layers[l]`
    [E, N]. `split_cols` > 0: a plan lands in two parts, elements [0, split_cols) of each row (an expert's w13)
    and then the rest; 0: one part, the whole row (landed[0] is written, with nothing before it)."""

    def __init__(self, slots: torch.Tensor, host_layers: list[torch.Tensor], *, split_cols: int = 0,
                 max_pairs: int | None = None, deadline_s: float = DEADLINE_S, impl: str = "auto"):
        if slots.dim() != 2 or slots.stride(1) != 1 or any(h.shape[1:] != slots.shape[1:] or h.stride(1) != 1
                                                           or h.dtype != slots.dtype for h in host_layers):
            raise ValueError("DmaProxy: slots [S, N] and host_layers [E, N] need contiguous rows of one dtype")
        if len({h.stride(0) for h in host_layers}) != 1 or len({h.shape[0] for h in host_layers}) != 1:
            raise ValueError("DmaProxy: every layer's host rows must have the same row count and stride")
        if slots.element_size() not in (2, 4):
            raise ValueError(f"DmaProxy: slots of {slots.dtype} ({slots.element_size()}-byte elements): the copies move "
                             "2- or 4-byte elements")
        if not 0 <= split_cols < slots.shape[1]:
            raise ValueError(f"DmaProxy: split_cols {split_cols} must be in [0, {slots.shape[1]})")
        self.device = slots.device
        self.on_cuda = self.device.type == "cuda"
        self.slots, self.host_layers, self.impl = slots, host_layers, impl
        self.num_rows = host_layers[0].shape[0]
        self.max_pairs = int(max_pairs if max_pairs is not None else min(slots.shape[0], self.num_rows))
        elem = slots.element_size()
        self.parts = ((0, split_cols), (split_cols, slots.shape[1])) if split_cols else ((0, 0), (0, slots.shape[1]))
        self.split_cols = split_cols
        self.lib = load_library()
        words = proxy_kernels.mailbox_words(self.max_pairs, RING)
        self.mbox = torch.zeros(words, dtype=torch.int64, pin_memory=self.on_cuda)
        self.state = torch.zeros(proxy_kernels.STATE_WORDS, dtype=torch.int64, device=self.device)
        self.state[proxy_kernels.ST_DEADLINE_NS] = int(deadline_s * 1e9)
        self.landed = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._layer_base = (ctypes.c_uint64 * len(host_layers))(*[h.data_ptr() for h in host_layers])
        p = self._p = _Proxy()
        p.mbox = self.mbox.data_ptr()
        p.ring, p.entry_words, p.max_pairs = RING, proxy_kernels.entry_words(self.max_pairs), self.max_pairs
        p.layer_base = ctypes.addressof(self._layer_base)
        p.num_layers, p.num_rows, p.host_stride = len(host_layers), self.num_rows, host_layers[0].stride(0) * elem
        p.slots_base, p.num_slots, p.slot_stride = slots.data_ptr(), slots.shape[0], slots.stride(0) * elem
        for i, (lo, hi) in enumerate(self.parts):
            p.part_lo[i], p.part_hi[i] = lo * elem, hi * elem
            p.landed[i] = self.landed.data_ptr() + 8 * i
        p.hot_ns, p.sleep_ns = int(HOT_S * 1e9), SLEEP_US * 1000
        self.stream = None
        self._closed = False
        if self.on_cuda:
            from kernels.cuda_driver import driver
            drv = driver()
            torch.cuda.init()
            with torch.cuda.device(self.device):
                torch.cuda.current_stream(self.device)                 # the primary context is current here
                ctx = ctypes.c_void_p()
                drv.check(drv._ctx_get_current(ctypes.byref(ctx)), "cuCtxGetCurrent")
                self.stream = torch.cuda.Stream(device=self.device, priority=-1)
                mbox_device = drv.device_pointer(self.mbox.data_ptr())   # pinned: mapped (UVA: the same address)
            p.ctx, p.stream = ctx.value, self.stream.cuda_stream
            p.memcpy_htod = _addr(drv.lib.cuMemcpyHtoDAsync_v2)
            p.write64 = _addr(drv.memops.write64)
            p.ctx_set = _addr(drv.lib.cuCtxSetCurrent)
        # the kernels take the mailbox by its device address; the thread reads it at the host's
        self.mbox_address = mbox_device if self.on_cuda else self.mbox.data_ptr()
        rc = self.lib.ft_proxy_start(ctypes.byref(p))
        if rc != 0:
            raise OSError(rc, f"starting the DMA proxy thread failed (pthread_create: errno {rc})")

    # -- the device side --------------------------------------------------------------------------------
    def publish(self, layer: int, evict_slots: torch.Tensor, src_indices: torch.Tensor,
                num_indices: torch.Tensor) -> None:
        """On the current stream: hand the plan (as `ensure` wrote it) of `layer` to the proxy."""
        proxy_kernels.publish(self.state, self.mbox, self.mbox_address, evict_slots, src_indices,
                              num_indices, layer=layer, ring=RING, max_pairs=self.max_pairs, impl=self.impl)

    def wait(self, part: int, layer: int, evict_slots: torch.Tensor, src_indices: torch.Tensor,
             num_indices: torch.Tensor) -> None:
        """On the current stream: until part `part` (0: w13 or nothing, 1: the rest) of the last plan landed."""
        lo, hi = self.parts[part]
        if hi <= lo:
            return
        proxy_kernels.wait(self.state, self.landed, part, self.mbox, self.mbox_address, self.slots,
                           self.host_layers[layer], evict_slots, src_indices, num_indices, (lo, hi), impl=self.impl)

    # -- the host side ----------------------------------------------------------------------------------
    def quiesce(self, timeout_s: float = QUIESCE_S) -> bool:
        """Wait (host) until every plan the device published has been issued and landed, or the thread stopped
        on an error, or `timeout_s` passed; syncs the current stream first. True when all landed."""
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        target = int(self.state[proxy_kernels.ST_SEQ])
        end = time.monotonic() + timeout_s
        while self._p.done < target and self._p.status == 0 and self._p.running and time.monotonic() < end:
            time.sleep(50e-6)
        if self.stream is not None:
            self.stream.synchronize()
        return self._p.done >= target

    def failed(self) -> bool:
        """Whether a wait gave up on the proxy, or it stopped on an error (host memory, no device sync: what the
        device has executed so far; sync the stream first to include everything queued). Sticky."""
        return bool(int(self.mbox[proxy_kernels.MBOX_WAIT_FAIL]) or int(self.mbox[proxy_kernels.MBOX_FAIL]))

    def stalled(self) -> bool:
        """A failure that is a timeout only: the thread runs and reported no error (it may catch up)."""
        return self.failed() and int(self._p.status) == 0 and bool(self._p.running) \
            and int(self.mbox[proxy_kernels.MBOX_WAIT_FAIL]) == 1

    def clear_failure(self) -> None:
        """After a stall whose copies have all landed (`quiesce()` returned True): lower the flags, so that the next
        plans are published again. Queued on the current stream (the device flag); call between steps."""
        self.state[proxy_kernels.ST_FAIL] = 0
        self.mbox[proxy_kernels.MBOX_WAIT_FAIL] = 0

    def failure_reason(self) -> str:
        status = int(self._p.status)
        if status == 0 and int(self.mbox[proxy_kernels.MBOX_WAIT_FAIL]) == 2:
            return f"a plan was longer than the mailbox's {self.max_pairs} entries"
        if status == 0:
            return f"a copy did not land within {int(self.state[proxy_kernels.ST_DEADLINE_NS]) / 1e9:g} s"
        if status < 0:
            return ERRORS.get(status, f"error {status}") + f" (sequence {int(self._p.failed_seq)})"
        return f"a CUDA driver call failed with CUresult {status} (sequence {int(self._p.failed_seq)})"

    def counters(self) -> dict[str, int]:
        s = self.state.tolist()
        return {"published": s[proxy_kernels.ST_PUBLISHED], "fallbacks": s[proxy_kernels.ST_FALLBACKS],
                "wait_ns": s[proxy_kernels.ST_WAIT_NS], "issued": int(self._p.done), "copies": int(self._p.copies),
                "bytes": int(self._p.bytes), "issue_ns": int(self._p.issue_ns), "max_call_ns": int(self._p.max_call_ns),
                "max_call_at_ns": int(self._p.max_call_at_ns)}

    def close(self) -> None:
        """Stop the thread (after the copies it issued have landed). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.lib.ft_proxy_stop(ctypes.byref(self._p))
        if self.stream is not None:
            self.stream.synchronize()

    def __del__(self):
        try:
            self.close()
        except Exception:                   # noqa: BLE001 - interpreter shutdown
            pass

