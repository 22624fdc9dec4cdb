"""Shared-memory segments and the hot-path channel layout between the GPU worker and one CPU worker.

Two things live here, both cross-process contracts:

1. ``ShmSegment``: a named POSIX shared-memory file under /dev/shm with a common 64-byte header
   (magic, layout version, creator pid + start time, state) and a msgpack meta block. It is created
   by exactly one process (the creator owns ``unlink``); a segment left by a dead creator is
   detected (pid gone, or reused by another process) and reclaimed; a live one is an error naming it.
   We use os.open + mmap, not ``multiprocessing.shared_memory``: on Python < 3.13 attaching there
   registers the segment with a resource tracker that unlinks it when the *attaching* process exits.

2. The channel layout (``ChannelLayout`` / ``ChannelViews``): per CPU worker, a doorbell and
   double-buffered request/response buffers, all fixed offsets, read and written through numpy /
   torch views. No pickling, no sockets.

Channel region (one segment per CPU worker; offsets in bytes; every array is 4 KiB aligned)::

    0     +------------------------------------------------------------------+
          | common header: magic "FTCHAN01", version, meta_nbytes,           |  64 B
          | creator_pid, creator_start_ticks, state                          |
    64    | meta (msgpack): t_max, hidden, max_triples, hidden_dtype, slots   |  <= 960 B
    1024  | request_seq   i64   written by the client (GPU side)  own line    |  64 B
    1088  | done_seq      i64   written by the worker             own line    |  64 B
    1152  | heartbeat_ns  i64   worker, CLOCK_MONOTONIC, >= every 1 ms idle   |  64 B
    1216  | worker_pid    i64   worker                                       |  64 B
    1280  | worker_epoch  i64   worker: +1 at every worker (re)start          |  64 B
    1344  | worker_state  i64   worker: ABSENT/STARTING/SERVING/STOPPED       |  64 B
    1536  | slot 0 request line: seq i64, layer i32, num_tokens i32,          |  64 B  (client)
          |   num_triples i32, split_limit i32 (@20), split_expert i32 (@24)  |
    1600  | slot 0 response line: seq i64, status i32, num_experts i32,       |  64 B  (worker)
          |                       compute_ns i64                              |
    1664  | slot 1 request line, 1728 slot 1 response line                    |
    4096  +------------------------------------------------------------------+
          | slot 0: hidden    [T_max, H]     hidden_dtype (bf16 or fp32)     |
          |         token_idx [max_triples]  int32                            |
          |         expert_id [max_triples]  int32                            |
          |         weight    [max_triples]  fp32                             |
          |         out       [T_max, H]     fp32 partial sums                |
          | slot 1: the same                                                  |
          +------------------------------------------------------------------+

Slot of a request: ``layer % 2`` (fixed addresses per layer, so a captured CUDA graph can write them).

Split expert: a request may name one expert (split_expert) that the worker computes over its intermediate
channels [0, split_limit) only (the GPU computes the rest). split_limit 0 means no split, whatever
split_expert holds (a 64-bit store of num_triples at offset 16 writes it 0); otherwise it must be in (0, I)
and a multiple of SPLIT_CHANNEL_UNIT, with 0 <= split_expert < E, or the request is a bad request. The
client writes both fields on every request, so no split outlives its request.

State machine of request number n (``request_seq``/``done_seq`` only grow; x86-64 TSO orders the
plain stores below, every counter is an aligned 8-byte word on its own 64-byte line, so the GPU
stream can write/await them with cuStreamWriteValue64 / cuStreamWaitValue64 once the segment is
registered with cudaHostRegister)::

    client                                   worker
    ------                                   ------
    slot s = layer % 2; require slot's        spin on request_seq (hot_ms after the last request),
      previous seq <= done_seq                  then spin spin_us / sleep (growing) / spin ...
    write hidden, triples, request line
      (seq=n, layer, T, N, split)
    request_seq = n        ------------->    sees request_seq >= done_seq + 1 = n
                                             finds the slot whose request seq == n
                                             computes out[:T] = sum_k w_k * FFN_e(x)
                                             response line (seq=n, status, compute_ns)
    spin on done_seq >= n  <-------------   done_seq = n
    check response seq == n, status == OK
    read out[:T] (valid until slot reused)

Worker (re)start: state=STARTING, pid, epoch += 1, done_seq = request_seq (requests of a dead
predecessor are dropped: the client already gave up on them), then SERVING. Clean exit: STOPPED.
The client treats a dead pid (pidfd) as WorkerDead and a passed deadline as WorkerTimeout.

CUDA-graph note for the GPU side: cuStreamWriteValue64 / cuStreamWaitValue64 captured in a graph
replay the constant values of capture time, while request_seq / done_seq grow. Inside a graph, ring
the doorbell from a one-thread kernel that reads a device-side counter (seq = counter + 1, written
through the registered mapping), and wait either with such a kernel or by leaving the join outside
the graph; eagerly, stream memory ops with the host-computed seq work as they are.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import re
import struct
from typing import Any

import msgpack
import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PAGE_BYTES = 4096
CACHE_LINE_BYTES = 64
HUGE_PAGE_BYTES = 2 * 1024 * 1024

# Common segment header: magic, version, meta_nbytes, creator_pid, creator_start_ticks, state.
_COMMON_HEADER = struct.Struct("<8sIIqqq")
COMMON_HEADER_BYTES = 64
STATE_OFFSET = 32               # byte offset of the i64 state word in the common header
SEGMENT_CREATING = 0
SEGMENT_READY = 1
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)      # Linux value; the mmap module lacks it before 3.13

_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class ShmError(RuntimeError):
    """A shared-memory segment cannot be created or attached; the message names the fix."""


def shm_path(name: str) -> str:
    if not _SHM_NAME_RE.match(name) or name in (".", ".."):
        raise ShmError(f"shared-memory name {name!r} is not valid; use 1-200 characters of "
                       "letters, digits, '.', '_' or '-' (no slashes)")
    return os.path.join(SHM_DIR, name)


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def process_start_ticks(pid: int) -> int | None:
    """Start time of a live process (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()   # fields[0] is field 3 (state) of proc(5)
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])                           # field 22: starttime


def creator_is_alive(pid: int, start_ticks: int) -> bool:
    """True when `pid` runs and is the same process (not a reuse of its pid)."""
    return pid > 0 and process_start_ticks(pid) == start_ticks


@dataclasses.dataclass(frozen=True)
class SegmentHeader:
    magic: bytes
    version: int
    creator_pid: int
    creator_start_ticks: int
    state: int
    meta: dict[str, Any]


def _read_header(buf: bytes | memoryview | mmap.mmap) -> SegmentHeader | None:
    if len(buf) < COMMON_HEADER_BYTES:
        return None
    magic, version, meta_nbytes, pid, start, state = _COMMON_HEADER.unpack_from(buf, 0)
    meta: dict[str, Any] = {}
    end = COMMON_HEADER_BYTES + meta_nbytes
    if 0 < meta_nbytes and end <= len(buf):
        try:
            meta = msgpack.unpackb(bytes(buf[COMMON_HEADER_BYTES:end]), raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            meta = {}
    return SegmentHeader(magic, version, pid, start, state, meta)


def _read_header_of_file(path: str) -> SegmentHeader | None:
    try:
        with open(path, "rb") as f:
            return _read_header(f.read(PAGE_BYTES))
    except OSError:
        return None


class ShmSegment:
    """One mmap'ed /dev/shm file. Use ``create`` (owner) or ``attach``."""

    def __init__(self, name: str, mm: mmap.mmap, nbytes: int, *, readonly: bool, owner: bool):
        self.name = name
        self.path = shm_path(name)
        self.nbytes = nbytes
        self.readonly = readonly
        self.owner = owner
        self._mm: mmap.mmap | None = mm
        # u8: [nbytes] numpy view of the whole mapping (read-only where the mapping is).
        self.u8 = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self.address = int(self.u8.ctypes.data)
        self.header = _read_header(mm)
        self.huge_pages_advised = _advise_huge_pages(mm)

    # -- creation -------------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, *, nbytes: int, magic: bytes, version: int, meta: dict[str, Any],
               kind: str, meta_capacity_bytes: int) -> "ShmSegment":
        path = shm_path(name)
        packed_meta = msgpack.packb(meta, use_bin_type=True)
        if len(packed_meta) > meta_capacity_bytes:
            raise ShmError(f"{kind} meta is {len(packed_meta)} bytes, over its {meta_capacity_bytes}-byte "
                           "block; shorten the config hash / meta strings")
        _check_free_space(nbytes, kind)
        fd = None
        for attempt in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                break
            except FileExistsError:
                if attempt:
                    raise ShmError(f"{kind} {name!r} ({path}) was created by another process while this "
                                   "one reclaimed it; start only one creator per name") from None
                _reclaim_if_stale(path, name, magic, kind)
        assert fd is not None
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        pid = os.getpid()
        start = process_start_ticks(pid) or 0
        _COMMON_HEADER.pack_into(mm, 0, magic, version, len(packed_meta), pid, start, SEGMENT_CREATING)
        mm[COMMON_HEADER_BYTES:COMMON_HEADER_BYTES + len(packed_meta)] = packed_meta
        return cls(name, mm, nbytes, readonly=False, owner=True)

    @classmethod
    def attach(cls, name: str, *, magic: bytes, version: int, readonly: bool, kind: str,
               hint: str) -> "ShmSegment":
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"no {kind} named {name!r} ({path} does not exist); {hint}") from None
        except PermissionError:
            raise ShmError(f"cannot open {path} ({kind}) for {'reading' if readonly else 'writing'}; "
                           "run as the creator's user or fix its permissions") from None
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes < PAGE_BYTES:
                raise ShmError(f"{path} is {nbytes} bytes, too small for a {kind}; it is not one or its "
                               f"creator died while creating it: remove it (rm {path}) and restart the creator")
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
        finally:
            os.close(fd)
        header = _read_header(mm)
        if header is None or header.magic != magic:
            mm.close()
            found = header.magic if header else b""
            raise ShmError(f"{path} is not a {kind} (magic {found!r}, expected {magic!r}); "
                           "check the name you passed")
        if header.version != version:
            mm.close()
            raise ShmError(f"{kind} {name!r} has layout version {header.version}; this build reads version "
                           f"{version}: restart its creator with the same build")
        return cls(name, mm, nbytes, readonly=readonly, owner=False)

    # -- header words ---------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        assert self.header is not None
        return self.header.meta

    @property
    def state(self) -> int:
        return int(self.u8[STATE_OFFSET:STATE_OFFSET + 8].view(np.int64)[0])

    def set_state(self, state: int) -> None:
        self.u8[STATE_OFFSET:STATE_OFFSET + 8].view(np.int64)[0] = state

    def remap_writable(self) -> None:
        """Turn this process's read-only mapping into a writable one at the same address, so every view
        stays valid (mmap MAP_FIXED over the same file range). cudaHostRegister needs a writable mapping."""
        if not self.readonly:
            return
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise ShmError(f"cannot reopen {self.path} for writing ({exc.strerror}); "
                           "run as the creator's user") from None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            got = libc.mmap(self.address, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        finally:
            os.close(fd)
        if got != self.address:
            raise ShmError(f"remapping {self.path} writable failed: {os.strerror(ctypes.get_errno())}")
        self.readonly = False

    def creator_alive(self) -> bool:
        assert self.header is not None
        return creator_is_alive(self.header.creator_pid, self.header.creator_start_ticks)

    # -- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Drop this process's mapping. Views still held elsewhere keep the pages mapped until
        they are garbage-collected (never a dangling pointer)."""
        mm, self._mm = self._mm, None
        if mm is None:
            return
        del self.u8
        try:
            mm.close()
        except BufferError:
            log.debug("%s: views still alive; the mapping is released when they are", self.name)

    def unlink(self) -> None:
        if not self.owner:
            raise ShmError(f"{self.name!r} may be unlinked only by its creator (pid "
                           f"{self.header.creator_pid if self.header else '?'})")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _advise_huge_pages(mm: mmap.mmap) -> bool:
    """Ask for transparent huge pages (fewer TLB misses when streaming weights). Takes effect on tmpfs
    only where /sys/kernel/mm/transparent_hugepage/shmem_enabled is 'advise' (or 'always')."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mm.madvise(advice)
        return True
    except OSError:
        return False


def _check_free_space(nbytes: int, kind: str) -> None:
    st = os.statvfs(SHM_DIR)
    free_bytes = st.f_bavail * st.f_frsize
    if nbytes > free_bytes:
        gib = 1024 ** 3
        raise ShmError(f"{kind} needs {nbytes / gib:.2f} GiB in {SHM_DIR} but only {free_bytes / gib:.2f} GiB "
                       f"are free; enlarge it (mount -o remount,size=<N>G {SHM_DIR}, or docker --shm-size) "
                       "or free space there")


def _reclaim_if_stale(path: str, name: str, magic: bytes, kind: str) -> None:
    header = _read_header_of_file(path)
    if header is None or header.magic != magic:
        raise ShmError(f"{path} exists and is not a {kind}; if nothing uses it, remove it (rm {path}) "
                       "or choose another name")
    if creator_is_alive(header.creator_pid, header.creator_start_ticks):
        raise ShmError(f"{kind} {name!r} ({path}) is in use: its creator, process {header.creator_pid}, "
                       "is alive; stop that process or choose another name")
    log.warning("reclaiming stale %s %r: its creator, process %d, is gone", kind, name, header.creator_pid)
    os.unlink(path)


def cuda_host_register(address: int, nbytes: int, *, what: str) -> bool:
    """cudaHostRegister a host range (portable) of a writable mapping. Returns False where CUDA is absent.

    Register after the bytes are filled: registering first makes the driver touch (zero-fill) the
    pages. Raises RuntimeError naming the usual fixes when the driver refuses.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    # portable (every context) | mapped (kernels may read it through its own address: the
    # plan-copy kernel does, see kernels/expert_copy)
    host_register_portable, host_register_mapped = 0x01, 0x02
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes,
                                                    host_register_portable | host_register_mapped))
    if code != 0:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        try:
            reason = str(torch.cuda.CudaError(code))
        except Exception:  # pragma: no cover - message lookup itself failed
            reason = f"cudaError {code}"
        raise RuntimeError(
            f"cudaHostRegister of {what} ({nbytes / 1024 ** 3:.2f} GiB at 0x{address:x}) failed: {reason}. "
            f"Fixes: raise the locked-memory limit (now {limit}; `ulimit -l unlimited`, systemd "
            "LimitMEMLOCK=infinity, docker --ulimit memlock=-1); some hosts cap pinned memory (WSL at about "
            "half of RAM); or run without pinning (pageable copies are ~15x slower).")
    return True


def cuda_host_unregister(address: int) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(address)


# ---------------------------------------------------------------------------------------------
# The hot-path channel
# ---------------------------------------------------------------------------------------------
CHANNEL_MAGIC = b"FTCHAN01"
CHANNEL_VERSION = 2             # 2: split_limit, split_expert in the request line
NUM_SLOTS = 2
CHANNEL_META_CAPACITY_BYTES = 1024 - COMMON_HEADER_BYTES
CONTROL_PAGE_BYTES = PAGE_BYTES

# Doorbell words: byte offsets, one 64-byte cache line each.
REQUEST_SEQ_OFFSET = 1024
DONE_SEQ_OFFSET = 1088
HEARTBEAT_NS_OFFSET = 1152
WORKER_PID_OFFSET = 1216
WORKER_EPOCH_OFFSET = 1280
WORKER_STATE_OFFSET = 1344
SLOT_LINES_OFFSET = 1536        # per slot: request line, then response line
SLOT_LINES_BYTES = 2 * CACHE_LINE_BYTES

# worker_state values
WORKER_ABSENT = 0
WORKER_STARTING = 1
WORKER_SERVING = 2
WORKER_STOPPED = 3
WORKER_STATE_NAMES = {WORKER_ABSENT: "absent", WORKER_STARTING: "starting",
                      WORKER_SERVING: "serving", WORKER_STOPPED: "stopped"}

# response status values
STATUS_OK = 0
STATUS_COMPUTE_ERROR = 1       # the kernel raised; details in the worker's log
STATUS_PROTOCOL_ERROR = 2      # request_seq advanced but no slot held that seq
STATUS_BAD_REQUEST = 3         # token index / expert id out of range, too many tokens or triples, a bad split
STATUS_NAMES = {STATUS_OK: "ok", STATUS_COMPUTE_ERROR: "compute error", STATUS_PROTOCOL_ERROR: "protocol error",
                STATUS_BAD_REQUEST: "bad request"}

HIDDEN_DTYPES = {"bfloat16": np.uint16, "float32": np.float32}   # numpy carrier of each (bf16 as u16)
HIDDEN_ITEM_BYTES = {"bfloat16": 2, "float32": 4}

# Request line (client) and response line (worker) of a slot: numpy structured dtypes. split_limit (@20) must
# follow num_triples (@16): a 64-bit store of num_triples covers it and leaves 0 there, i.e. no split.
REQUEST_LINE = np.dtype([("seq", "<i8"), ("layer", "<i4"), ("num_tokens", "<i4"), ("num_triples", "<i4"),
                         ("split_limit", "<i4"), ("split_expert", "<i4")])
RESPONSE_LINE = np.dtype([("seq", "<i8"), ("status", "<i4"), ("num_experts", "<i4"), ("compute_ns", "<i8")])
SPLIT_CHANNEL_UNIT = 32         # split_limit is a multiple of this (the AMX tile's K: 32 bf16)
assert REQUEST_LINE.fields["split_limit"][1] == 20 and REQUEST_LINE.fields["split_expert"][1] == 24
assert REQUEST_LINE.itemsize <= CACHE_LINE_BYTES and RESPONSE_LINE.itemsize <= CACHE_LINE_BYTES


@dataclasses.dataclass(frozen=True)
class ChannelLayout:
    """Byte offsets of one channel; a pure function of (t_max, hidden, max_triples, hidden_dtype)."""

    t_max: int
    hidden: int
    max_triples: int
    hidden_dtype: str

    def __post_init__(self) -> None:
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype {self.hidden_dtype!r} is not supported; use one of "
                             f"{', '.join(HIDDEN_DTYPES)}")
        for field in ("t_max", "hidden", "max_triples"):
            if getattr(self, field) <= 0:
                raise ValueError(f"channel {field} must be > 0, got {getattr(self, field)}")

    @property
    def hidden_bytes(self) -> int:
        return self.t_max * self.hidden * HIDDEN_ITEM_BYTES[self.hidden_dtype]

    @property
    def triple_array_bytes(self) -> int:
        return round_up(self.max_triples * 4, PAGE_BYTES)

    @property
    def out_bytes(self) -> int:
        return self.t_max * self.hidden * 4

    def slot_offsets(self, slot: int) -> dict[str, int]:
        """Byte offsets of slot `slot`'s arrays inside the segment."""
        off = CONTROL_PAGE_BYTES + slot * self.slot_bytes
        offsets = {}
        for name, nbytes in (("hidden", self.hidden_bytes), ("token_idx", self.triple_array_bytes),
                             ("expert_id", self.triple_array_bytes), ("weight", self.triple_array_bytes),
                             ("out", self.out_bytes)):
            offsets[name] = off
            off += round_up(nbytes, PAGE_BYTES)
        return offsets

    @property
    def slot_bytes(self) -> int:
        return (round_up(self.hidden_bytes, PAGE_BYTES) + 3 * self.triple_array_bytes
                + round_up(self.out_bytes, PAGE_BYTES))

    @property
    def nbytes(self) -> int:
        return CONTROL_PAGE_BYTES + NUM_SLOTS * self.slot_bytes

    def meta(self) -> dict[str, Any]:
        return {"t_max": self.t_max, "hidden": self.hidden, "max_triples": self.max_triples,
                "hidden_dtype": self.hidden_dtype, "num_slots": NUM_SLOTS, "nbytes": self.nbytes}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "ChannelLayout":
        try:
            layout = cls(int(meta["t_max"]), int(meta["hidden"]), int(meta["max_triples"]),
                         str(meta["hidden_dtype"]))
        except KeyError as exc:
            raise ShmError(f"channel meta lacks {exc}; recreate the channel with this build") from None
        if meta.get("num_slots") != NUM_SLOTS or meta.get("nbytes") != layout.nbytes:
            raise ShmError("channel meta does not match this build's layout; recreate the channel")
        return layout


@dataclasses.dataclass
class SlotViews:
    request: np.ndarray       # REQUEST_LINE scalar record view (client writes)
    response: np.ndarray      # RESPONSE_LINE scalar record view (worker writes)
    hidden: np.ndarray        # [T_max, H] uint16 (bf16 bits) or float32
    token_idx: np.ndarray     # [max_triples] int32
    expert_id: np.ndarray     # [max_triples] int32
    weight: np.ndarray        # [max_triples] float32
    out: np.ndarray           # [T_max, H] float32


class ChannelViews:
    """numpy views of every field of a channel segment (no copies)."""

    def __init__(self, seg: ShmSegment, layout: ChannelLayout):
        u8 = seg.u8
        self.layout = layout

        def word(offset: int) -> np.ndarray:          # [1] int64 at its own cache line
            return u8[offset:offset + 8].view(np.int64)

        self.request_seq = word(REQUEST_SEQ_OFFSET)
        self.done_seq = word(DONE_SEQ_OFFSET)
        self.heartbeat_ns = word(HEARTBEAT_NS_OFFSET)
        self.worker_pid = word(WORKER_PID_OFFSET)
        self.worker_epoch = word(WORKER_EPOCH_OFFSET)
        self.worker_state = word(WORKER_STATE_OFFSET)
        carrier = HIDDEN_DTYPES[layout.hidden_dtype]
        t_max, h, n = layout.t_max, layout.hidden, layout.max_triples
        self.slots: list[SlotViews] = []
        for s in range(NUM_SLOTS):
            lines = SLOT_LINES_OFFSET + s * SLOT_LINES_BYTES
            off = layout.slot_offsets(s)
            self.slots.append(SlotViews(
                request=u8[lines:lines + REQUEST_LINE.itemsize].view(REQUEST_LINE),
                response=u8[lines + CACHE_LINE_BYTES:lines + CACHE_LINE_BYTES + RESPONSE_LINE.itemsize]
                .view(RESPONSE_LINE),
                hidden=u8[off["hidden"]:off["hidden"] + layout.hidden_bytes].view(carrier).reshape(t_max, h),
                token_idx=u8[off["token_idx"]:off["token_idx"] + n * 4].view(np.int32),
                expert_id=u8[off["expert_id"]:off["expert_id"] + n * 4].view(np.int32),
                weight=u8[off["weight"]:off["weight"] + n * 4].view(np.float32),
                out=u8[off["out"]:off["out"] + layout.out_bytes].view(np.float32).reshape(t_max, h),
            ))


def create_channel(name: str, layout: ChannelLayout) -> ShmSegment:
    """Create a channel segment (its creator, normally the coordinator, owns unlink)."""
    seg = ShmSegment.create(name, nbytes=layout.nbytes, magic=CHANNEL_MAGIC, version=CHANNEL_VERSION,
                            meta=layout.meta(), kind="CPU-worker channel",
                            meta_capacity_bytes=CHANNEL_META_CAPACITY_BYTES)
    seg.set_state(SEGMENT_READY)
    return seg


def attach_channel(name: str) -> tuple[ShmSegment, ChannelLayout]:
    seg = ShmSegment.attach(name, magic=CHANNEL_MAGIC, version=CHANNEL_VERSION, readonly=False,
                            kind="CPU-worker channel",
                            hint="create it first (coordinator, or create_channel) and pass the same name")
    return seg, ChannelLayout.from_meta(seg.meta)
