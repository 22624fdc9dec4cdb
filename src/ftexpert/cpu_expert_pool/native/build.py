"""Build expert_ffn.c and serve_loop.c into a shared library at first use (cached) and bind it with ctypes.

Why gcc + ctypes rather than torch.utils.cpp_extension.load_inline: the kernel needs no torch
headers (it takes raw pointers), so it builds in about a second instead of a minute, needs no ninja,
and does not depend on the torch version; a ctypes call costs a few microseconds and releases the GIL.
The library links libgomp, the same soname torch's wheel loads, so one OpenMP runtime serves both.

The cache is a private directory (proto/private_paths.py: this user's, mode 0700): ~/.cache/ft-expert-service/
cpu_kernels, or, where the home cache cannot be written, <tmp>/ft-expert-service-<uid>/cpu_kernels, which must
then be this user's own (a directory another user made first is refused, not used). A library is loaded only if
it is a regular file of this user that nobody else may write; a planted one is refused, never loaded.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ftexpert.cpu_expert_pool.native.act_desc import ExpertActDesc, act_address
from ftexpert.cpu_expert_pool.native.errors import ERRORS
from ftexpert.cpu_expert_pool.native.quant_desc import QuantBindings
from ftexpert.proto.private_paths import UnsafePath, check_loadable, private_dir

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("expert_ffn.c"),     # the expert kernel (its dot products: expert_dots.h)
           Path(__file__).with_name("serve_loop.c"),     # the worker's hot loop around it (ft_serve)
           Path(__file__).with_name("threads.c"),        # thread pinning and the bandwidth probe's reads
           Path(__file__).with_name("quant_ffn.c"))      # the quantized experts' kernel (fp8, int4, mxfp4, nvfp4)
HEADERS = tuple(Path(__file__).with_name(name) for name in ("expert_act.h", "expert_dots.h", "quant_dots.h",
                                                             "quant_avx512.h", "quant_avx2.h", "quant_int8.h",
                                                             "phase_times.h"))
CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall")
LIBS = ("-lm",)
BUILD_TIMEOUT_S = 120
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512", 3: "avx512_bf16", 4: "amx_bf16"}
ISA_BY_NAME = {v: k for k, v in ISA_NAMES.items()}


class NativeUnavailable(RuntimeError):
    """The compiled kernel cannot be built or loaded here; the torch path still works."""


def default_cache_dir() -> Path:
    """The private build cache: under the home cache, else under the temporary directory (checked either way)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "ft-expert-service" / "cpu_kernels"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.access(path.parent, os.W_OK):
            return Path(private_dir(str(path), tighten=True))
    except OSError:
        pass
    try:
        return Path(private_dir(os.path.join(tempfile.gettempdir(), f"ft-expert-service-{os.geteuid()}",
                                             "cpu_kernels"), tighten=True))
    except UnsafePath as exc:
        raise NativeUnavailable(f"no private directory to build the CPU expert kernel in: {exc}") from None


def build_library(cache_dir: Path | None = None, *, sources: tuple[Path, ...] = SOURCES,
                  headers: tuple[Path, ...] = HEADERS, extra_flags: tuple[str, ...] = (),
                  stem: str = "libft_expert_ffn") -> Path:
    """Compile the CPU expert kernel and the worker's serve loop (SOURCES) once per source / compiler / machine, and
    return the library's path (other sources / flags: a test build, e.g. the AVX-512 code on emulated intrinsics)."""
    what, fallback = "the CPU expert kernel", "use --kernel torch meanwhile"
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise NativeUnavailable(f"no C compiler found (gcc/cc) to build {what}; install one (apt-get install gcc) "
                                f"or {fallback.removesuffix(' meanwhile')}")
    version = subprocess.run([cc, "-dumpfullversion", "-dumpversion"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"".join(src.read_bytes() for src in (*sources, *headers))
                         + "|".join((cc, version, platform.machine(), *CFLAGS, *extra_flags, *LIBS)).encode())
    cache_dir = Path(private_dir(str(cache_dir), tighten=True)) if cache_dir else default_cache_dir()
    out = cache_dir / f"{stem}-{key.hexdigest()[:16]}.so"
    if os.path.lexists(out):
        return checked_library(out)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
    cmd = [cc, *CFLAGS, *extra_flags, "-o", str(tmp), *map(str, sources), *LIBS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeUnavailable(f"building {what} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}\n{fallback}")
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)             # atomic: concurrent builders of the same key agree
    log.info("built %s", out)
    return checked_library(out)


def checked_library(path: Path) -> Path:
    """`path` if it is fit to load (this user's regular file, writable by nobody else); else NativeUnavailable."""
    try:
        check_loadable(str(path), "compiled CPU expert kernel")
    except UnsafePath as exc:
        raise NativeUnavailable(f"{exc}; use --kernel torch meanwhile") from None
    return path


class NativeLib:
    """ctypes bindings of expert_ffn.c."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(checked_library(path)))
        c_int, c_i64, c_p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        lib.ft_best_isa.restype = c_int
        lib.ft_best_isa.argtypes = []
        lib.ft_moe_layer.restype = c_int
        lib.ft_moe_layer.argtypes = [c_int, c_int, c_p, c_i64, c_int, c_int, c_int, c_p, c_int, c_int,
                                     c_p, c_p, c_p, c_int, c_p, c_p, c_int, c_int, c_p]
        lib.ft_pin_threads.restype = c_int
        lib.ft_pin_threads.argtypes = [c_p, c_int]
        lib.ft_read_bytes.restype = ctypes.c_uint64
        lib.ft_read_bytes.argtypes = [c_p, c_i64, c_int]
        lib.ft_serve.restype = c_int
        lib.ft_serve.argtypes = [c_p, c_p, c_i64, c_i64, c_p, c_p]
        lib.ft_channel_desc_size.restype = c_i64
        lib.ft_channel_desc_size.argtypes = []
        lib.ft_channel_desc_offsets.restype = c_int
        lib.ft_channel_desc_offsets.argtypes = [c_p, c_int]
        self._lib = lib
        self.path = path
        self.quant = QuantBindings(lib)          # ft_moe_layer_q, ft_dequantize_rows (quant_ffn.c)
        self.best_isa = int(lib.ft_best_isa())
        self._stats = (ctypes.c_int64 * 2)()

    @property
    def best_isa_name(self) -> str:
        return ISA_NAMES[self.best_isa]

    def moe_layer(self, isa: int, num_threads: int, layer_base: int, expert_stride_bytes: int, num_experts: int,
                  hidden_size: int, intermediate: int, hidden_ptr: int, hidden_is_bf16: bool, num_tokens: int,
                  tok_ptr: int, expert_ptr: int, weight_ptr: int, num_triples: int, out_ptr: int,
                  split_expert: int = -1, split_limit: int = 0,
                  act: ExpertActDesc | None = None) -> tuple[int, int]:
        """Raw call; returns (experts used, weight bytes read). Raises ValueError on a bad request.
        split_limit > 0: expert split_expert's channels [0, split_limit) only; 0: no split. act: the experts'
        activation and biases (act_desc.expert_act_desc; None: silu without biases)."""
        rc = self._lib.ft_moe_layer(isa, num_threads, layer_base, expert_stride_bytes, num_experts, hidden_size,
                                    intermediate, hidden_ptr, int(hidden_is_bf16), num_tokens, tok_ptr,
                                    expert_ptr, weight_ptr, num_triples, out_ptr, ctypes.addressof(self._stats),
                                    split_expert, split_limit, act_address(act))
        if rc != 0:
            raise ValueError(f"CPU expert kernel: {ERRORS.get(rc, f'error {rc}')}")
        return int(self._stats[0]), int(self._stats[1])

    def channel_desc_size(self) -> int:
        """sizeof(ft_channel_desc) in serve_loop.c (its ctypes mirror: cpu_expert_pool/native_loop.py)."""
        return int(self._lib.ft_channel_desc_size())

    def channel_desc_offsets(self) -> list[int]:
        """offsetof() of each ft_channel_desc field, in declaration order."""
        buf = (ctypes.c_int64 * 64)()
        count = int(self._lib.ft_channel_desc_offsets(buf, 64))
        return list(buf[:count])

    def serve(self, desc, done, deadline_ns: int, hot_ns: int, last_work_ns, stats) -> int:
        """ft_serve (serve_loop.c): desc, done and last_work_ns by reference, stats an int64 array."""
        return int(self._lib.ft_serve(ctypes.byref(desc), ctypes.byref(done), deadline_ns, hot_ns,
                                      ctypes.byref(last_work_ns), stats))

    def pin_threads(self, cpus: list[int]) -> int:
        arr = (ctypes.c_int32 * len(cpus))(*cpus)
        return int(self._lib.ft_pin_threads(ctypes.addressof(arr), len(cpus)))

    def read_bytes(self, address: int, num_bytes: int, num_threads: int) -> int:
        return int(self._lib.ft_read_bytes(address, num_bytes - num_bytes % 64, num_threads))


@functools.lru_cache(maxsize=1)
def load_native() -> NativeLib:
    """Build (first use) and load; raises NativeUnavailable with the reason."""
    if platform.machine() not in ("x86_64", "AMD64", "aarch64"):
        raise NativeUnavailable(f"the compiled kernel is not written for {platform.machine()}")
    return NativeLib(build_library())


def try_load_native() -> tuple[NativeLib | None, str]:
    try:
        return load_native(), ""
    except (NativeUnavailable, OSError, subprocess.SubprocessError) as exc:
        return None, str(exc)
