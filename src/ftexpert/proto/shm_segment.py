"""Named POSIX shared-memory segments: `ShmSegment` and its common header (a cross-process contract).

``ShmSegment``: a named POSIX shared-memory file under /dev/shm with a common 64-byte header
(magic, layout version, creator pid + start time, state) and a msgpack meta block. It is created
by exactly one process (the creator owns ``unlink``); a segment left by a dead creator is
detected (pid gone, or reused by another process) and reclaimed; a live one is an error naming it.
We use os.open + mmap, not ``multiprocessing.shared_memory``: on Python < 3.13 attaching there
registers the segment with a resource tracker that unlinks it when the *attaching* process exits.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import re
import resource
import stat
import struct
from typing import Any, Iterable

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


@dataclasses.dataclass(frozen=True)
class ReclaimedSegment:
    name: str
    nbytes: int
    creator_pid: int


def reclaim_stale_segments(magics: Iterable[bytes], shm_dir: str = SHM_DIR) -> list[ReclaimedSegment]:
    """Unlink every segment in `shm_dir` of ours whose creator is gone, whatever its name; returns what was freed.

    Ours: a regular file owned by this user whose common header carries one of `magics`. Gone: its creator pid
    no longer runs, or runs as another process (start time differs). A segment of another user, one whose
    creator lives, or one without a readable header (its creator died before writing it) is left alone."""
    wanted, uid = set(magics), os.getuid()
    freed: list[ReclaimedSegment] = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return freed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_size < COMMON_HEADER_BYTES:
            continue
        header = _read_header_of_file(entry.path)
        if header is None or header.magic not in wanted or header.creator_pid <= 0 \
                or creator_is_alive(header.creator_pid, header.creator_start_ticks):
            continue
        try:
            if os.stat(entry.path, follow_symlinks=False).st_ino != st.st_ino:
                continue                          # replaced meanwhile (a new creator): not the one we read
            os.unlink(entry.path)
        except OSError:
            continue
        freed.append(ReclaimedSegment(entry.name, st.st_size, header.creator_pid))
    if freed:
        log.warning("reclaimed %d stale shared-memory segment(s), %.1f MiB, left by dead processes: %s",
                    len(freed), sum(f.nbytes for f in freed) / 1024 ** 2,
                    ", ".join(f"{f.name} ({f.nbytes} bytes, creator pid {f.creator_pid})" for f in freed))
    return freed


def cuda_host_register(address: int, nbytes: int, *, what: str) -> bool:
    """cudaHostRegister a host range (portable) of a writable mapping. Returns False where CUDA is absent.

    Register after the bytes are filled: registering first makes the driver touch (zero-fill) the
    pages. Raises RuntimeError naming the usual fixes when the driver refuses.
    """
    import torch  # lazy: this module is torch-free (the coordinator imports it)

    if not torch.cuda.is_available():
        return False
    # portable (every context) | mapped (kernels may read it through its own address: the
    # plan-copy kernel does, see kernels/expert_copy)
    host_register_portable, host_register_mapped = 0x01, 0x02
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes,
                                                    host_register_portable | host_register_mapped))
    if code != 0:
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
    import torch  # lazy: this module is torch-free (the coordinator imports it)

    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(address)
