"""GPU-stream side of the CPU-pool doorbell: the stream itself rings a CPU worker and waits for its answer.

``CpuPoolClient.submit/wait`` is host-driven: the GPU stream is synchronised, the host writes the
request, spins on ``done_seq`` and copies the partial sums up. ``StreamDoorbell`` puts the whole round
trip on one CUDA stream instead, with CUDA stream memory operations (``cuStreamWriteValue64`` /
``cuStreamWaitValue64``) on the registered channel (proto/shm_layout.py has its layout and protocol).
Per call, enqueued without any host synchronisation::

    D2H   hidden[:T] (and the triples) -> the slot's channel buffers     copy engine, stream-ordered
    W64   request line words: num_triples (+16) and layer | T << 32 (+8) when they changed, seq (+0)
    W64   request_seq = seq                                              the doorbell
    WAIT  done_seq >= seq          (CU_STREAM_WAIT_VALUE_GEQ)            the worker's answer
    [K    status ring[seq % R] <- the slot's response line (seq, status)] check_status=True: a tiny kernel
    H2D   the slot's out[:T] -> out [T, H] fp32 on the device
    W64   progress = seq                                                 host-visible: this call is over

The request line is written by the stream (not the host) so that the host may run any number of calls
ahead of the GPU: slot s = layer % 2 is reused by call seq + 2 only after the stream has passed call
seq's wait and copy, in stream order. Hence: one stream per doorbell, and no ``CpuPoolClient.submit`` on
the same channel while stream calls are in flight (``drain()`` first).

Memory ordering (why the worker never sees a half-written request, and the GPU never reads a half-written
answer):
- Every ``cuStreamWriteValue64`` here uses CU_STREAM_WRITE_VALUE_DEFAULT, which puts a memory fence before
  the write ("similar semantics to __threadfence_system() but scoped to the stream"); a stream operation
  also starts only after the previous ones in the stream completed. So the D2H copies of hidden/triples
  and the request line words are visible to the CPU before ``request_seq`` moves. (The v2 memop API
  does not even accept CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER.) The worker loads ``request_seq``, then
  the line, then the data: x86-64 does not reorder loads with loads.
- The worker stores out, then its response line, then ``done_seq`` (x86-64 TSO keeps store order). The
  wait is satisfied only once ``done_seq >= seq`` is observed; the status capture and the H2D copy come
  after it in stream order and read coherent host memory, so they see everything stored before
  ``done_seq``. CU_STREAM_WAIT_VALUE_FLUSH is not needed: it orders *remote writes into device memory*
  (RDMA), while here the device reads host memory.

Fault safety (``DoorbellWatchdog``): a stream waiting on ``done_seq`` of a dead worker would hang the GPU
forever. A host thread that reads only host memory (no CUDA calls, so a host thread blocked in a CUDA
call cannot stall it) watches every doorbell that has calls in flight: when the GPU has rung a request
that is not answered (``request_seq > done_seq``) and the worker is dead (pidfd) or the request is
older than ``deadline_s``, it *aborts*: records the range of sequence numbers it gives up on, writes
``done_seq`` = the last enqueued seq itself (the host may bump the counter the stream waits on), and
keeps re-asserting that value until the stream has passed all of them (a late worker finishing an old
request would lower it again). Those calls are then invalid (``StreamCall.valid() is False``: the
caller fetches instead); new calls raise ``WorkerDead`` / ``WorkerTimeout`` until ``reconnect()``.
A replacement worker claims the channel as usual (done_seq = request_seq): stale requests it still sees
are answered and ignored.

CUDA graphs: not capturable yet, and ``enqueue`` refuses a capturing stream. A captured
cuStreamWriteValue64 / cuStreamWaitValue64 replays the *values* of capture time, while request_seq /
done_seq only grow. A graph-capturable variant needs the sequence number on the device: a device
counter incremented by a one-thread kernel per call, kernels (not memops) that write the line's seq
and request_seq through the mapped channel from that counter, and a wait that is either a one-thread
kernel spinning on done_seq >= counter (volatile loads of the mapped word) or left outside the graph.
The copies and the triples are graph-safe already (fixed addresses per slot); the watchdog would have
to learn the seq from the device counter (a mapped word) instead of the host's count.

Without CUDA (tests, CPU machines) ``backend="host"`` runs the same sequence of operations on a host
thread that stands in for the stream (``HostStream``); everything but the CUDA calls is shared.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import logging
import math
import mmap
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np
import torch

from proto.cpu_channel import CpuPoolClient, WorkerDead, WorkerTimeout
from proto.shm_layout import (CACHE_LINE_BYTES, HIDDEN_ITEM_BYTES, NUM_SLOTS, PAGE_BYTES, REQUEST_SEQ_OFFSET,
                              SLOT_LINES_BYTES, SLOT_LINES_OFFSET, STATUS_NAMES, STATUS_OK)
from proto.shm_segment import cuda_host_register, cuda_host_unregister

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# CUDA driver API constants (cuda.h of CUDA 12; values checked against the header, not guessed)
# ---------------------------------------------------------------------------------------------
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92           # v1 memops (needed NVreg_EnableStreamMemOPs=1)
CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1 = 93
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1 = 94
CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122      # v2 memops (the *_v2 entry points, CUDA >= 11.7)
CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR = 123
CU_STREAM_WAIT_VALUE_GEQ = 0x0          # (int64)(*addr - value) >= 0: a cyclic >=
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0     # fence before the write (see the module docstring)
CU_GET_PROC_ADDRESS_DEFAULT = 0
CU_STREAM_CAPTURE_STATUS_NONE = 0
PROC_ADDRESS_CUDA_VERSION = 12000       # ask cuGetProcAddress for the CUDA 12 flavour (the _v2 memops)

CU_ERROR_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
    400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS", 712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 801: "CUDA_ERROR_NOT_SUPPORTED",
    900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", 901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
    906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
    999: "CUDA_ERROR_UNKNOWN",
}

LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")


class StreamMemOpsUnavailable(RuntimeError):
    """No CUDA driver / device / stream memory operations here: use the host-driven CpuPoolClient path."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``call`` and ``code`` say which and why."""

    def __init__(self, call: str, code: int, name: str, hint: str = ""):
        self.call, self.code, self.name = call, code, name
        super().__init__(f"{call} failed: {name} ({code}){'; ' + hint if hint else ''}")


def _bind(fn, argtypes, restype=ctypes.c_int):
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_MEMOP_ARGTYPES = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]   # stream, addr, value, flags
_MEMOP_FUNCTYPE = ctypes.CFUNCTYPE(ctypes.c_int, *_MEMOP_ARGTYPES)


@dataclasses.dataclass(frozen=True)
class ResolvedMemOps:
    write64: Callable
    wait64: Callable
    api: int          # 2: the *_v2 entry points (CUDA >= 11.7, always on); 1: the original ones
    how: str          # "dlsym cuStreamWriteValue64_v2", "cuGetProcAddress(..., 12000)" or "dlsym cuStreamWriteValue64"


def resolve_stream_memops(lib, driver_version: int | None = None) -> ResolvedMemOps:
    """The 64-bit write/wait entry points of `lib` (a ctypes CDLL of libcuda, or a stand-in with the same
    attributes): the versioned ``*_v2`` symbols by dlsym when exported, else ``cuGetProcAddress`` for the
    CUDA 12 flavour, else the unversioned (v1) symbols. Both of a pair come from the same route."""
    try:
        return ResolvedMemOps(_bind(getattr(lib, "cuStreamWriteValue64_v2"), _MEMOP_ARGTYPES),
                              _bind(getattr(lib, "cuStreamWaitValue64_v2"), _MEMOP_ARGTYPES), 2,
                              "dlsym cuStreamWriteValue64_v2")
    except AttributeError:
        pass
    get_proc = getattr(lib, "cuGetProcAddress", None)
    if get_proc is not None:
        _bind(get_proc, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64])
        pointers = []
        for name in ("cuStreamWriteValue64", "cuStreamWaitValue64"):
            pfn = ctypes.pointer(ctypes.c_void_p())
            code = get_proc(name.encode(), pfn, PROC_ADDRESS_CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT)
            if code != CUDA_SUCCESS or not pfn.contents.value:
                break
            pointers.append(pfn.contents.value)
        else:
            api = 2 if driver_version is None or driver_version >= PROC_ADDRESS_CUDA_VERSION else 1
            write64, wait64 = (_MEMOP_FUNCTYPE(p) for p in pointers)
            return ResolvedMemOps(write64, wait64, api, f"cuGetProcAddress(..., {PROC_ADDRESS_CUDA_VERSION})")
    try:
        return ResolvedMemOps(_bind(getattr(lib, "cuStreamWriteValue64"), _MEMOP_ARGTYPES),
                              _bind(getattr(lib, "cuStreamWaitValue64"), _MEMOP_ARGTYPES), 1,
                              "dlsym cuStreamWriteValue64")
    except AttributeError:
        raise StreamMemOpsUnavailable(
            "the CUDA driver library exports neither cuStreamWriteValue64_v2 / cuStreamWaitValue64_v2 nor "
            "cuStreamWriteValue64 / cuStreamWaitValue64 (nor cuGetProcAddress); the driver is too old for the "
            "GPU-stream hand-off (CUDA >= 11.7 recommended): use the host-driven path") from None


class CudaDriver:
    """The few CUDA driver entry points the stream doorbell needs, through ctypes. Build with ``driver()``."""

    def __init__(self, lib, lib_name: str = "libcuda"):
        self.lib, self.lib_name = lib, lib_name
        p_int, p_u64, p_void = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(
            ctypes.c_void_p)
        try:
            self._init = _bind(lib.cuInit, [ctypes.c_uint])
            self._driver_get_version = _bind(lib.cuDriverGetVersion, [p_int])
            self._device_get = _bind(lib.cuDeviceGet, [p_int, ctypes.c_int])
            self._device_get_attribute = _bind(lib.cuDeviceGetAttribute, [p_int, ctypes.c_int, ctypes.c_int])
            self._ctx_get_current = _bind(lib.cuCtxGetCurrent, [p_void])
            # _v2: 64-bit CUdeviceptr (the unversioned one is the 32-bit original)
            self._host_get_device_pointer = _bind(lib.cuMemHostGetDevicePointer_v2,
                                                  [p_u64, ctypes.c_void_p, ctypes.c_uint])
            self._stream_is_capturing = _bind(lib.cuStreamIsCapturing, [ctypes.c_void_p, p_int])
        except AttributeError as exc:
            raise StreamMemOpsUnavailable(f"{lib_name} lacks a CUDA driver entry point ({exc}); the driver is too "
                                          "old or this is not libcuda") from None
        self._get_error_name = getattr(lib, "cuGetErrorName", None)
        if self._get_error_name is not None:
            _bind(self._get_error_name, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self.check(self._init(0), "cuInit(0)")
        version = ctypes.c_int(0)
        self.check(self._driver_get_version(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value
        self.memops = resolve_stream_memops(lib, self.driver_version)

    # -- errors ---------------------------------------------------------------------------------
    def error_name(self, code: int) -> str:
        if self._get_error_name is not None:
            name = ctypes.c_char_p()
            try:
                if self._get_error_name(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
                    return name.value.decode()
            except (ctypes.ArgumentError, OSError):  # pragma: no cover - broken stand-in
                pass
        return CU_ERROR_NAMES.get(code, f"CUresult {code}")

    def check(self, code: int, call: str, hint: str = "") -> None:
        if code != CUDA_SUCCESS:
            if code == CUDA_ERROR_NOT_SUPPORTED and not hint:
                hint = ("this device or driver does not support 64-bit stream memory operations; use the "
                        "host-driven hand-off (CpuPoolClient.submit/wait)")
            raise CudaDriverError(call, code, self.error_name(code), hint)

    # -- queries --------------------------------------------------------------------------------
    def device_attribute(self, attribute: int, ordinal: int) -> int:
        dev, value = ctypes.c_int(0), ctypes.c_int(0)
        self.check(self._device_get(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        self.check(self._device_get_attribute(ctypes.byref(value), attribute, dev.value),
                   f"cuDeviceGetAttribute({attribute}, device {ordinal})")
        return value.value

    def memops_attributes(self) -> tuple[tuple[str, int], ...]:
        """(name, attribute) that must be non-zero for the resolved memop entry points."""
        if self.memops.api == 2:
            return (("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
                     CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS),)
        return (("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1", CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1),
                ("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1",
                 CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1))

    def require_stream_memops(self, ordinal: int) -> None:
        """Raise CudaDriverError(CUDA_ERROR_NOT_SUPPORTED) naming the attribute when the device lacks them."""
        for name, attribute in self.memops_attributes():
            if not self.device_attribute(attribute, ordinal):
                hint = ("the device has no 64-bit stream memory operations (cuStreamWaitValue64); use the "
                        "host-driven hand-off")
                if self.memops.api == 1:
                    hint += ("; this driver only has the v1 memops, which need the nvidia module loaded with "
                             "NVreg_EnableStreamMemOPs=1 (or a driver for CUDA >= 11.7, whose v2 memops are on)")
                raise CudaDriverError(f"cuDeviceGetAttribute({name}) on device {ordinal} returned 0, so "
                                      f"{'cuStreamWaitValue64_v2' if self.memops.api == 2 else 'cuStreamWaitValue64'}",
                                      CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", hint)

    def capabilities(self, ordinal: int) -> dict[str, object]:
        caps: dict[str, object] = {"driver_version": self.driver_version, "memops_api": self.memops.api,
                                   "memops_resolved_by": self.memops.how}
        for name, attribute in (("unified_addressing", CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
                                ("host_pointer_for_registered_mem",
                                 CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM),
                                ("64_bit_stream_mem_ops", CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS),
                                ("stream_wait_value_nor", CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR),
                                ("stream_mem_ops_v1", CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1)):
            try:
                caps[name] = self.device_attribute(attribute, ordinal)
            except CudaDriverError as exc:       # an attribute this driver predates
                caps[name] = f"n/a ({exc.name})"
        return caps

    def has_current_context(self) -> bool:
        ctx = ctypes.c_void_p()
        self.check(self._ctx_get_current(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return bool(ctx.value)

    def device_pointer(self, host_address: int) -> int:
        """cuMemHostGetDevicePointer of registered (mapped) host memory; a context must be current."""
        dptr = ctypes.c_uint64(0)
        self.check(self._host_get_device_pointer(ctypes.byref(dptr), ctypes.c_void_p(host_address), 0),
                   f"cuMemHostGetDevicePointer(0x{host_address:x})",
                   "the address must lie in memory registered with cudaHostRegisterMapped (proto.shm_layout."
                   "cuda_host_register does) and a CUDA context must be current")
        return dptr.value

    def stream_is_capturing(self, stream: int) -> bool:
        status = ctypes.c_int(0)
        code = self._stream_is_capturing(ctypes.c_void_p(stream), ctypes.byref(status))
        if code == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:     # the legacy stream while another stream captures
            return True
        self.check(code, "cuStreamIsCapturing")
        return status.value != CU_STREAM_CAPTURE_STATUS_NONE

    # -- stream memory operations ---------------------------------------------------------------
    def write_value64(self, stream: int, dptr: int, value: int, flags: int = CU_STREAM_WRITE_VALUE_DEFAULT) -> None:
        code = self.memops.write64(stream, dptr, value, flags)
        if code:
            self.check(code, f"cuStreamWriteValue64{'_v2' if self.memops.api == 2 else ''}(0x{dptr:x}, {value})")

    def wait_value64(self, stream: int, dptr: int, value: int, flags: int = CU_STREAM_WAIT_VALUE_GEQ) -> None:
        code = self.memops.wait64(stream, dptr, value, flags)
        if code:
            self.check(code, f"cuStreamWaitValue64{'_v2' if self.memops.api == 2 else ''}(0x{dptr:x}, {value})")


_DRIVER: CudaDriver | None = None
_DRIVER_LOCK = threading.Lock()


def load_driver(names: Sequence[str] = LIBCUDA_NAMES) -> CudaDriver:
    """Load libcuda (the first of `names` that loads) and resolve the entry points. Raises
    StreamMemOpsUnavailable when none loads (no NVIDIA driver) or CudaDriverError when cuInit fails."""
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return CudaDriver(lib, name)
    raise StreamMemOpsUnavailable("cannot load the CUDA driver library (" + "; ".join(errors) + "): no NVIDIA "
                                  "driver on this machine, so no GPU-stream hand-off; use the host-driven path "
                                  "(CpuPoolClient.submit/wait) or StreamDoorbell(..., backend='host') in tests")


def driver() -> CudaDriver:
    """The process's CudaDriver, loaded on first use (importing this module loads nothing)."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = load_driver()
        return _DRIVER


# ---------------------------------------------------------------------------------------------
# Host memory the stream writes: a registered page set, and host views of addresses
# ---------------------------------------------------------------------------------------------
def host_tensor(address: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor viewing `address` (no copy; the memory must outlive it)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    raw = torch.frombuffer((ctypes.c_uint8 * max(nbytes, 1)).from_address(address), dtype=torch.uint8)
    return raw[:nbytes].view(dtype).view(*shape)


def _mapped_cuda_tensor(dptr: int, numel: int, owner: object, device: torch.device) -> torch.Tensor:
    """An int64 CUDA tensor over mapped host memory at device pointer `dptr` (kernels read/write it
    through the mapping). `owner` is kept alive by the tensor."""
    class _Mapped:
        __cuda_array_interface__ = {"shape": (numel,), "typestr": "<i8", "data": (dptr, False), "version": 2,
                                    "strides": None}
        keep = owner

    with torch.cuda.device(device):
        tensor = torch.as_tensor(_Mapped(), device=device)
    if tensor.data_ptr() != dptr:      # torch placed it on another device and copied: not an alias
        raise StreamMemOpsUnavailable(f"torch did not alias mapped host memory 0x{dptr:x} on {device} (it copied "
                                      f"it to {tensor.device}); register the channel with {device} current")
    return tensor


class PinnedWords:
    """`nbytes` of page-aligned host memory of our own, registered (portable | mapped) for CUDA, whose
    8-byte words a stream may write or await (``dptr``) and the host may read or write (``word``)."""

    def __init__(self, nbytes: int, *, cuda_driver: CudaDriver | None, device: torch.device | None, what: str):
        self.nbytes = -(-nbytes // PAGE_BYTES) * PAGE_BYTES
        self._mm = mmap.mmap(-1, self.nbytes)
        self.u8 = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = int(self.u8.ctypes.data)
        self.registered = False
        self.device_address = self.address
        if cuda_driver is not None:
            self.registered = cuda_host_register(self.address, self.nbytes, what=what)
            if not self.registered:
                raise StreamMemOpsUnavailable(f"cannot register {what} for CUDA (torch sees no GPU)")
            with torch.cuda.device(device):
                self.device_address = cuda_driver.device_pointer(self.address)

    def word(self, offset: int) -> ctypes.c_int64:
        return ctypes.c_int64.from_address(self.address + offset)

    def dptr(self, offset: int) -> int:
        return self.device_address + offset

    def close(self) -> None:
        if self.registered:
            cuda_host_unregister(self.address)
            self.registered = False


# ---------------------------------------------------------------------------------------------
# The two backends: CUDA stream memory operations, or a host thread standing in for the stream
# ---------------------------------------------------------------------------------------------
class HostStream:
    """A FIFO of host callables run in order by one thread: the CUDA stream's stand-in without a GPU."""

    def __init__(self, name: str = "host-stream"):
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._submitted = self._completed = 0
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("HostStream is closed")
            self._queue.append(fn)
            self._submitted += 1
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                fn = self._queue.popleft()
            try:
                if self.error is None:
                    with torch.inference_mode():      # callers enqueue from inference mode (the engine's)
                        fn()
            except BaseException as exc:  # kept for synchronize(); later work is skipped, as after a CUDA fault
                self.error = exc
            with self._cv:
                self._completed += 1
                self._cv.notify_all()

    def wait_geq64(self, address: int, value: int, poll_s: float = 20e-6) -> Callable[[], None]:
        word = ctypes.c_int64.from_address(address)

        def wait() -> None:
            while word.value < value and not self._closed:
                time.sleep(poll_s)
        return wait

    def synchronize(self, timeout_s: float | None = None) -> bool:
        with self._cv:
            target = self._submitted
            ok = self._cv.wait_for(lambda: self._completed >= target, timeout=timeout_s)
        if self.error is not None:
            raise RuntimeError(f"host stream operation failed: {self.error!r}") from self.error
        return ok

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)


class _CudaOps:
    def __init__(self, drv: CudaDriver, device: torch.device):
        self.drv, self.device = drv, device

    def begin(self, stream: "torch.cuda.Stream | None"):
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        if self.drv.stream_is_capturing(s.cuda_stream):
            raise RuntimeError("StreamDoorbell.enqueue cannot be captured in a CUDA graph yet: captured stream "
                               "memory operations replay the sequence numbers of capture time (see the "
                               "docstring of gpu_worker/hybrid/stream_doorbell.py); enqueue eagerly")
        return s.cuda_stream, (contextlib.nullcontext() if stream is None else torch.cuda.stream(stream))

    def copy_in(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)            # device -> registered channel (DMA)

    def copy_out(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)            # registered channel -> device (DMA)

    def write64(self, handle, dptr: int, value: int) -> None:
        self.drv.write_value64(handle, dptr, value, CU_STREAM_WRITE_VALUE_DEFAULT)

    def wait_geq64(self, handle, dptr: int, value: int) -> None:
        self.drv.wait_value64(handle, dptr, value, CU_STREAM_WAIT_VALUE_GEQ)

    def capture(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        # A kernel (not cudaMemcpyAsync): both ends are mapped host memory, which a memcpy would treat as a
        # host-to-host copy, done synchronously by the host at enqueue time.
        torch.bitwise_or(src, 0, out=dst)


class _HostOps:
    def __init__(self, stream: HostStream):
        self.stream = stream

    def begin(self, stream):
        return None, contextlib.nullcontext()

    def copy_in(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        src = src.clone()                       # the caller may reuse its tensor once enqueue returns
        self.stream.submit(lambda: dst.copy_(src))

    def copy_out(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream.submit(lambda: dst.copy_(src))     # src (the channel) is read when the stream gets there

    def write64(self, handle, address: int, value: int) -> None:
        word = ctypes.c_int64.from_address(address)

        def write() -> None:
            word.value = value
        self.stream.submit(write)

    def wait_geq64(self, handle, address: int, value: int) -> None:
        self.stream.submit(self.stream.wait_geq64(address, value))

    def capture(self, handle, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.stream.submit(lambda: dst.copy_(src))


# ---------------------------------------------------------------------------------------------
# The doorbell
# ---------------------------------------------------------------------------------------------
# Our own registered words: progress (the last call the stream finished), then the status ring.
PROGRESS_OFFSET = 0
RING_OFFSET = CACHE_LINE_BYTES
RING_ENTRY_WORDS = 2                 # response line words 0-1: seq i64, status i32 | num_experts i32 << 32
DEFAULT_RING_SIZE = 1024
# Request line words (REQUEST_LINE in proto/shm_layout.py): seq i64 @0, layer i32 @8, num_tokens i32 @12,
# num_triples i32 @16, split_limit i32 @20: the 64-bit write at +16 leaves the limit 0 (no split; this path never
# splits an expert). The doorbell skips that write when the word is unchanged (_line_cache), which holds because no
# other writer shares the channel while it lives: HybridExperts.set_handoff closes the device doorbells (the only
# writer of a split) before it makes stream ones, and a new StreamDoorbell starts with an empty cache.
LINE_SEQ, LINE_LAYER_TOKENS, LINE_TRIPLES = 0, 8, 16


@dataclasses.dataclass
class StreamCall:
    """One enqueued round trip. ``out`` is written by the stream; read it in stream order (GPU work queued
    after the call) or after ``wait()``. Check ``valid()`` before trusting it: an aborted call's ``out``
    holds stale data and the caller must fetch instead."""

    doorbell: "StreamDoorbell"
    seq: int
    layer: int
    num_tokens: int
    num_triples: int
    out: torch.Tensor

    def done(self) -> bool:
        """The stream has passed this call (its copies included). A host memory read, no CUDA call."""
        return self.doorbell.progress() >= self.seq

    def wait(self, timeout_s: float) -> bool:
        """Spin (then sleep) on the progress word; False after timeout_s. No CUDA call, never hangs."""
        if self.done():
            return True
        give_up, spin_until = time.monotonic() + timeout_s, time.monotonic() + 0.002
        while not self.done():
            now = time.monotonic()
            if now >= give_up:
                return False
            if now >= spin_until:
                time.sleep(50e-6)
        return True

    def valid(self) -> bool:
        """True when the worker answered this very request with STATUS_OK and the watchdog did not give up on
        it. The call must be done (``done()`` / ``wait()`` / a stream sync)."""
        return self.doorbell.call_valid(self.seq)

    def status(self) -> str:
        return self.doorbell.call_status(self.seq)


class StreamDoorbell:
    """Enqueue CPU-worker round trips on a CUDA stream (see the module docstring).

    client: a connected CpuPoolClient (``wait_for_worker`` done, nothing in flight); it must outlive this.
    device: the CUDA device of the stream and tensors; backend "cuda" (default on a CUDA device) or
    "host" (a HostStream thread instead of the GPU: tests, CPU machines).
    check_status: capture each response line (a tiny kernel) so ``valid()`` also checks the worker's
    status; without it, ``valid()`` only knows about watchdog aborts (a worker error status would go
    unnoticed and its ``out`` holds stale data).
    deadline_s: the watchdog gives up on a rung request this long after it first saw it unanswered.
    on_abort(reason, first_seq, last_seq): called from the watchdog thread when it gives up, just before it
    releases the stream (reason "dead", "timeout" or "closing"), e.g. to SIGKILL a late worker as CpuPool does.
    """

    def __init__(self, client: CpuPoolClient, device: torch.device | str | None = None, *, backend: str | None = None,
                 check_status: bool = True, deadline_s: float = 1.0, watchdog: bool = True,
                 ring_size: int = DEFAULT_RING_SIZE, poll_s: float = 200e-6,
                 on_abort: Callable[[str, int, int], None] | None = None,
                 cuda_driver: CudaDriver | None = None):
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backend = backend or ("cuda" if self.device.type == "cuda" else "host")
        if self.backend not in ("cuda", "host"):
            raise ValueError(f"backend must be 'cuda' or 'host', got {self.backend!r}")
        if not client.connected:
            raise WorkerDead(f"channel {client.name!r} has no connected CPU worker; call wait_for_worker() first")
        self.client, self.layout = client, client.layout
        self.check_status, self.deadline_s, self.poll_s, self.on_abort = check_status, deadline_s, poll_s, on_abort
        self.ring_size = ring_size
        self._drv: CudaDriver | None = None
        self._host_stream: HostStream | None = None
        if self.backend == "cuda":
            if self.device.type != "cuda" or not torch.cuda.is_available():
                raise StreamMemOpsUnavailable(f"backend 'cuda' needs a CUDA device (got {self.device}, torch sees "
                                              f"{'a' if torch.cuda.is_available() else 'no'} GPU); use "
                                              "backend='host' or the host-driven CpuPoolClient path")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._drv = cuda_driver or driver()
            self._drv.require_stream_memops(self.device.index)
            with torch.cuda.device(self.device):
                torch.cuda.current_stream(self.device).synchronize()       # the primary context is current
                if not self._drv.has_current_context():
                    raise StreamMemOpsUnavailable(f"no current CUDA context on {self.device} after torch's init")
            if not client.pin_for_cuda():
                raise StreamMemOpsUnavailable(f"channel {client.name!r} could not be registered for CUDA")
            self._ops: _CudaOps | _HostOps = _CudaOps(self._drv, self.device)
        else:
            self._host_stream = HostStream(f"host-stream-{client.name}")
            self._ops = _HostOps(self._host_stream)

        # Addresses: host ones for the host's own reads/writes, device ones for the stream.
        doorbell = client.doorbell_addresses()
        base = doorbell["request_seq"] - REQUEST_SEQ_OFFSET
        self._request_seq = ctypes.c_int64.from_address(doorbell["request_seq"])
        self._done_seq = ctypes.c_int64.from_address(doorbell["done_seq"])
        self._words = PinnedWords(RING_OFFSET + ring_size * RING_ENTRY_WORDS * 8, cuda_driver=self._drv,
                                  device=self.device, what=f"stream doorbell words of {client.name!r}")
        self._progress = self._words.word(PROGRESS_OFFSET)
        self._ring = self._words.u8[RING_OFFSET:RING_OFFSET + ring_size * RING_ENTRY_WORDS * 8].view(
            np.int64).reshape(ring_size, RING_ENTRY_WORDS)
        self._ring[:] = -1
        with torch.cuda.device(self.device) if self.backend == "cuda" else contextlib.nullcontext():
            dev = self._device_pointer
            self._dptr_request_seq, self._dptr_done_seq = dev(doorbell["request_seq"]), dev(doorbell["done_seq"])
            self._dptr_progress = self._words.dptr(PROGRESS_OFFSET)
            self._slot_dptr_line: list[int] = []
            self._host_hidden, self._host_out, self._host_triples = [], [], []
            self._resp_src: list[torch.Tensor] = []
            hidden_dtype = torch.bfloat16 if self.layout.hidden_dtype == "bfloat16" else torch.float32
            self.hidden_dtype = hidden_dtype
            t_max, h, n_max = self.layout.t_max, self.layout.hidden, self.layout.max_triples
            assert HIDDEN_ITEM_BYTES[self.layout.hidden_dtype] == torch.empty(0, dtype=hidden_dtype).element_size()
            for s in range(NUM_SLOTS):
                line = base + SLOT_LINES_OFFSET + s * SLOT_LINES_BYTES
                self._slot_dptr_line.append(dev(line))
                addrs = client.slot_addresses(s)
                self._host_hidden.append(host_tensor(addrs["hidden"], (t_max, h), hidden_dtype))
                self._host_out.append(host_tensor(addrs["out"], (t_max, h), torch.float32))
                self._host_triples.append((host_tensor(addrs["token_idx"], (n_max,), torch.int32),
                                           host_tensor(addrs["expert_id"], (n_max,), torch.int32),
                                           host_tensor(addrs["weight"], (n_max,), torch.float32)))
                response = line + CACHE_LINE_BYTES
                if self.backend == "cuda":
                    self._resp_src.append(_mapped_cuda_tensor(dev(response), RING_ENTRY_WORDS, client, self.device))
                else:
                    self._resp_src.append(host_tensor(response, (RING_ENTRY_WORDS,), torch.int64))
            if self.backend == "cuda":
                self._ring_dst = _mapped_cuda_tensor(self._words.dptr(RING_OFFSET), ring_size * RING_ENTRY_WORDS,
                                                     self._words, self.device).view(ring_size, RING_ENTRY_WORDS)
            else:
                self._ring_dst = torch.from_numpy(self._ring)
        self._views: dict = {}
        self._line_cache: list[tuple[int, int] | None] = [None] * NUM_SLOTS   # (triples word, layer|T word)
        self._lock = threading.Lock()
        self._aborted: list[tuple[int, int]] = []        # (lo, hi]: seqs given up on
        self._release_to = 0                            # the watchdog keeps done_seq >= this until progress is there
        self.failed: str | None = None                  # "dead" / "timeout" / "closing" until reconnect()
        self.aborts = 0
        self._closed = False
        self._own_watch_state: dict = {}                # watchdog_check's state when drain() looks itself
        self._start_sequence()
        self._watchdog = DoorbellWatchdog.shared() if watchdog else None
        if self._watchdog is not None:
            self._watchdog.add(self)

    # -- helpers --------------------------------------------------------------------------------
    def _device_pointer(self, host_address: int) -> int:
        return self._drv.device_pointer(host_address) if self._drv is not None else host_address

    def _start_sequence(self) -> None:
        if any(p is not None for p in self.client._pending):
            raise RuntimeError(f"channel {self.client.name!r} has host-driven requests in flight; wait() for them "
                               "before using the stream doorbell")
        last = max(int(self._request_seq.value), int(self._done_seq.value))
        self._next_seq = last + 1
        self._last_seq = last
        self._progress.value = max(int(self._progress.value), last)
        self._line_cache = [None] * NUM_SLOTS

    def progress(self) -> int:
        return int(self._progress.value)

    @property
    def in_flight(self) -> int:
        return self._last_seq - self.progress()

    def capabilities(self) -> dict[str, object]:
        if self._drv is None:
            return {"backend": "host"}
        return {"backend": "cuda", **self._drv.capabilities(self.device.index)}

    # -- the call -------------------------------------------------------------------------------
    def _token_views(self, s: int, t: int):
        key = (s, t)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (self._host_hidden[s][:t], self._host_out[s][:t])
        return views

    def enqueue(self, layer: int, hidden: torch.Tensor,
                triples: Sequence[torch.Tensor] | None = None, out: torch.Tensor | None = None, *,
                stream: "torch.cuda.Stream | None" = None) -> StreamCall:
        """Enqueue layer `layer`'s round trip on `stream` (default: the current stream of the device).

        hidden: [T, H] on the device (cast to the channel's dtype on the device when it differs);
        triples: (token_idx [n], expert_id [n], weight [n]) on the device, or None for none;
        out: [T, H] fp32 on the device to receive the partial sums (allocated when None).
        Raises WorkerDead / WorkerTimeout after the watchdog gave up on this channel (fetch instead;
        ``reconnect()`` once a worker serves it again).
        """
        if self._closed:
            raise RuntimeError("StreamDoorbell is closed")
        if self.failed is not None:
            exc = WorkerTimeout if self.failed == "timeout" else WorkerDead
            raise exc(f"channel {self.client.name!r}: the stream doorbell gave up on its worker ({self.failed}); "
                      "fetch instead, reconnect() once a worker serves the channel again")
        num_tokens, hidden_size = hidden.shape
        if hidden_size != self.layout.hidden or not 0 < num_tokens <= self.layout.t_max:
            raise ValueError(f"hidden {tuple(hidden.shape)} does not fit channel {self.client.name!r} "
                             f"(0 < T <= {self.layout.t_max}, H = {self.layout.hidden})")
        if not 0 <= layer < 2 ** 31:
            raise ValueError(f"layer must be in [0, 2**31), got {layer}")
        n = 0 if triples is None else len(triples[0])
        if triples is not None and (n > self.layout.max_triples or len(triples[1]) != n or len(triples[2]) != n):
            raise ValueError(f"{n} triples (expert_id {len(triples[1])}, weight {len(triples[2])}) do not fit channel "
                             f"{self.client.name!r} (max {self.layout.max_triples}, equal lengths)")
        on_device = [hidden] + (list(triples) if n else []) + ([out] if out is not None else [])
        if any(t.device != self.device for t in on_device):
            raise ValueError(f"hidden, triples and out must be on {self.device} (a host tensor would be written at "
                             "once, not in stream order)")
        if out is not None and (tuple(out.shape) != (num_tokens, hidden_size) or out.dtype != torch.float32):
            raise ValueError(f"out must be [{num_tokens}, {hidden_size}] float32, got {tuple(out.shape)} {out.dtype}")
        s = layer % NUM_SLOTS
        ops = self._ops
        handle, ctx = ops.begin(stream)
        seq = self._next_seq
        self._next_seq = seq + 1
        self._last_seq = seq                       # before the doorbell can ring: the watchdog's release covers it
        line = self._slot_dptr_line[s]
        host_hidden, host_out = self._token_views(s, num_tokens)
        with ctx:
            if out is None:
                out = torch.empty(num_tokens, hidden_size, dtype=torch.float32, device=self.device)
            ops.copy_in(handle, host_hidden, hidden if hidden.dtype == self.hidden_dtype
                        else hidden.to(self.hidden_dtype))
            if n:
                dst_token, dst_expert, dst_weight = (t[:n] for t in self._host_triples[s])
                token_idx, expert_id, weight = triples
                ops.copy_in(handle, dst_token, token_idx.to(torch.int32))
                ops.copy_in(handle, dst_expert, expert_id.to(torch.int32))
                ops.copy_in(handle, dst_weight, weight.to(torch.float32))
            triples_word, layer_tokens_word = n, (num_tokens << 32) | layer
            cached = self._line_cache[s]
            if cached is None or cached[0] != triples_word:
                ops.write64(handle, line + LINE_TRIPLES, triples_word)
            if cached is None or cached[1] != layer_tokens_word:
                ops.write64(handle, line + LINE_LAYER_TOKENS, layer_tokens_word)
            self._line_cache[s] = (triples_word, layer_tokens_word)
            ops.write64(handle, line + LINE_SEQ, seq)
            ops.write64(handle, self._dptr_request_seq, seq)                 # the doorbell
            ops.wait_geq64(handle, self._dptr_done_seq, seq)                 # the answer
            if self.check_status:
                ops.capture(handle, self._ring_dst[seq % self.ring_size], self._resp_src[s])
            ops.copy_out(handle, out, host_out)
            ops.write64(handle, self._dptr_progress, seq)
        if self._watchdog is not None:
            self._watchdog.kick()
        return StreamCall(self, seq, layer, num_tokens, n, out)

    # -- results --------------------------------------------------------------------------------
    def _aborted_seq(self, seq: int) -> bool:
        return any(lo < seq <= hi for lo, hi in self._aborted)

    def call_status(self, seq: int) -> str:
        """'ok', 'aborted', 'not done', a worker status name, 'no answer' or 'unchecked' (check_status off)."""
        if self.progress() < seq:
            return "not done"
        if self._aborted_seq(seq):
            return "aborted"
        if not self.check_status:
            return "unchecked"
        entry_seq, word = (int(v) for v in self._ring[seq % self.ring_size])
        if entry_seq > seq:
            raise RuntimeError(f"request {seq}'s status was overwritten by request {entry_seq}: check validity within "
                               f"{self.ring_size} calls (ring_size)")
        if entry_seq != seq:
            return "no answer"
        status = int(np.int32(word & 0xFFFFFFFF))
        return "ok" if status == STATUS_OK else STATUS_NAMES.get(status, f"status {status}")

    def call_valid(self, seq: int) -> bool:
        status = self.call_status(seq)
        if status == "not done":
            raise RuntimeError(f"request {seq} is still in flight; wait() for it or synchronize the stream first")
        return status in ("ok", "unchecked")

    # -- fault handling -------------------------------------------------------------------------
    def watchdog_check(self, now: float, state: dict) -> None:
        """One look by the watchdog (its thread, or a caller without one). Reads host memory only."""
        with self._lock:
            if self._closed:
                return
            last, progress = self._last_seq, self.progress()
            if progress >= last:
                state.clear()
                return
            if self._release_to and self._done_seq.value < self._release_to and progress < self._release_to:
                self._done_seq.value = self._release_to         # a late worker lowered it: release again
            requested, done = int(self._request_seq.value), int(self._done_seq.value)
            if done >= requested:
                state.clear()            # the GPU is not blocked on an unanswered request
                return
            waiting_for = done + 1
            if state.get("seq") != waiting_for:
                state["seq"], state["since"] = waiting_for, now
            if not self.client.worker_alive():
                reason = "dead"
            elif now - state["since"] >= self.deadline_s:
                reason = "timeout"
            else:
                return
            lo, hi = self._abort_locked(reason)
            state.clear()
        self._notify_abort(reason, lo, hi)
        self._release()

    def _abort_locked(self, reason: str) -> tuple[int, int]:
        """Record the give-up (calls lo+1..hi invalid, new calls refused); ``_release`` then frees the stream."""
        lo, hi = int(self._done_seq.value), self._last_seq
        if hi > lo:
            self._aborted.append((lo, hi))
        self.failed = self.failed or reason
        self.aborts += 1
        self._release_to = max(self._release_to, hi)
        log.warning("stream doorbell of channel %r: worker %s with requests %d..%d in flight; releasing the stream, "
                    "those results are invalid (fetch instead)", self.client.name,
                    "died" if reason == "dead" else f"missed the {self.deadline_s * 1e3:.0f} ms deadline"
                    if reason == "timeout" else reason, lo + 1, hi)
        return lo, hi

    def _release(self) -> None:
        with self._lock:
            if self._done_seq.value < self._release_to:
                self._done_seq.value = self._release_to          # the stream's waits pass

    def _notify_abort(self, reason: str, lo: int, hi: int) -> None:
        if self.on_abort is not None:
            try:
                self.on_abort(reason, lo + 1, hi)
            except Exception:  # the watchdog must keep running
                log.exception("on_abort callback failed")

    def abort(self, reason: str = "aborted") -> tuple[int, int]:
        """Give up on every call in flight now (as the watchdog does); returns (first, last) seq given up on."""
        with self._lock:
            lo, hi = self._abort_locked(reason)
        self._notify_abort(reason, lo, hi)
        self._release()
        return lo + 1, hi

    def drain(self, timeout_s: float) -> bool:
        """Wait (host memory polling, never a CUDA call) until the stream has passed every enqueued call."""
        give_up = time.monotonic() + timeout_s
        while self.progress() < self._last_seq:
            if self._watchdog is None:
                self.watchdog_check(time.monotonic(), self._own_watch_state)
            if time.monotonic() >= give_up:
                return False
            time.sleep(50e-6)
        return True

    def reconnect(self, timeout_s: float) -> int:
        """After an abort: drain the stream, wait for a live worker on the channel, start a fresh sequence.
        Returns the worker's pid."""
        if not self.drain(timeout_s):
            raise WorkerTimeout(f"channel {self.client.name!r}: the stream did not drain within {timeout_s:.1f} s")
        with self._lock:
            pid = self.client.wait_for_worker(timeout_s)
            self._start_sequence()
            self.failed = None
        return pid

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait for the stream (host backend: its thread; CUDA: the device's current stream)."""
        if self._host_stream is not None:
            if not self._host_stream.synchronize(timeout_s):
                raise TimeoutError("host stream did not finish in time")
        else:
            torch.cuda.current_stream(self.device).synchronize()

    def close(self, timeout_s: float = 5.0) -> None:
        """Drain (releasing the stream if the worker does not answer in timeout_s), stop watching, unregister."""
        if self._closed:
            return
        if not self.drain(timeout_s):
            self.abort("closing")
            self.drain(timeout_s)
        if self._watchdog is not None:
            self._watchdog.remove(self)
        with self._lock:
            self._closed = True
        if self._host_stream is not None:
            self._host_stream.close()
        elif self.progress() >= self._last_seq:
            self._words.close()
        else:  # pragma: no cover - a stream that cannot drain may still write the words: leak them
            log.error("stream doorbell of %r closed with the stream still in flight; leaking its words",
                      self.client.name)


class DoorbellWatchdog:
    """One daemon thread per process watching every open StreamDoorbell (see the module docstring).

    Sleeps on an event while no doorbell has calls in flight; otherwise looks every `poll_s` (the
    smallest poll_s of the doorbells). Reads host memory and the worker's pidfd only."""

    _shared: "DoorbellWatchdog | None" = None
    _shared_lock = threading.Lock()

    def __init__(self):
        self._doorbells: "weakref.WeakSet[StreamDoorbell]" = weakref.WeakSet()
        self._states: "weakref.WeakKeyDictionary[StreamDoorbell, dict]" = weakref.WeakKeyDictionary()
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="doorbell-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> "DoorbellWatchdog":
        with cls._shared_lock:
            if cls._shared is None or not cls._shared._thread.is_alive():
                cls._shared = cls()
            return cls._shared

    def add(self, doorbell: StreamDoorbell) -> None:
        with self._lock:
            self._doorbells.add(doorbell)
            self._states[doorbell] = {}
        self.kick()

    def remove(self, doorbell: StreamDoorbell) -> None:
        with self._lock:
            self._doorbells.discard(doorbell)

    def kick(self) -> None:
        if not self._event.is_set():
            self._event.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                doorbells = [(db, self._states.setdefault(db, {})) for db in self._doorbells]
            busy = [(db, state) for db, state in doorbells if db.in_flight > 0]
            if not busy:
                self._event.clear()
                if not any(db.in_flight > 0 for db, _ in doorbells):     # enqueued between the look and clear
                    self._event.wait(0.1)
                continue
            now = time.monotonic()
            for db, state in busy:
                try:
                    db.watchdog_check(now, state)
                except Exception:  # pragma: no cover - keep watching the others
                    log.exception("doorbell watchdog check failed")
            time.sleep(min(db.poll_s for db, _ in busy))
