"""The few CUDA driver entry points the device hand-off needs, through ctypes (no CUDA toolkit needed).

    drv = driver()                                   # libcuda, loaded on first use (importing this loads nothing)
    dptr = drv.device_pointer(host_address)          # of memory registered with cudaHostRegisterMapped
    drv.capabilities(0)                              # driver version and the device's host-memory attributes

Every failed call raises `CudaDriverError("<call> failed: <CUDA_ERROR_NAME> (<code>)")`; a machine without
libcuda raises `CudaDriverUnavailable`. Device pointers of registered host memory come from
`cuMemHostGetDevicePointer_v2` (proto.shm_layout.cuda_host_register registers portable | mapped, which that
call requires), never from assuming they equal the host address.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Sequence

# CUDA driver API constants (cuda.h of CUDA 12; values checked against the header, not guessed)
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

CU_ERROR_NAMES = {
    0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
    100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE", 201: "CUDA_ERROR_INVALID_CONTEXT",
    400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS", 712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
    713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}

LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")


class CudaDriverUnavailable(RuntimeError):
    """No CUDA driver library here (no NVIDIA driver), or it lacks an entry point this module binds."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``call`` and ``code`` say which and why."""

    def __init__(self, call: str, code: int, name: str, hint: str = ""):
        self.call, self.code, self.name = call, code, name
        super().__init__(f"{call} failed: {name} ({code}){'; ' + hint if hint else ''}")


def _bind(fn, argtypes, restype=ctypes.c_int):
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class CudaDriver:
    """libcuda's entry points through ctypes (`lib`: a ctypes CDLL, or a stand-in with the same attributes).
    Build the process's one with ``driver()``."""

    def __init__(self, lib, lib_name: str = "libcuda"):
        self.lib, self.lib_name = lib, lib_name
        p_int, p_u64 = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)
        try:
            self._init = _bind(lib.cuInit, [ctypes.c_uint])
            self._driver_get_version = _bind(lib.cuDriverGetVersion, [p_int])
            self._device_get = _bind(lib.cuDeviceGet, [p_int, ctypes.c_int])
            self._device_get_attribute = _bind(lib.cuDeviceGetAttribute, [p_int, ctypes.c_int, ctypes.c_int])
            # _v2: 64-bit CUdeviceptr (the unversioned one is the 32-bit original)
            self._host_get_device_pointer = _bind(lib.cuMemHostGetDevicePointer_v2,
                                                  [p_u64, ctypes.c_void_p, ctypes.c_uint])
        except AttributeError as exc:
            raise CudaDriverUnavailable(f"{lib_name} lacks a CUDA driver entry point ({exc}); the driver is too "
                                        "old or this is not libcuda") from None
        self._get_error_name = getattr(lib, "cuGetErrorName", None)
        if self._get_error_name is not None:
            _bind(self._get_error_name, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self.check(self._init(0), "cuInit(0)")
        version = ctypes.c_int(0)
        self.check(self._driver_get_version(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value

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
            raise CudaDriverError(call, code, self.error_name(code), hint)

    # -- queries --------------------------------------------------------------------------------
    def device_attribute(self, attribute: int, ordinal: int) -> int:
        dev, value = ctypes.c_int(0), ctypes.c_int(0)
        self.check(self._device_get(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        self.check(self._device_get_attribute(ctypes.byref(value), attribute, dev.value),
                   f"cuDeviceGetAttribute({attribute}, device {ordinal})")
        return value.value

    def capabilities(self, ordinal: int) -> dict[str, object]:
        """The driver version and the device's attributes that mapped host memory depends on."""
        caps: dict[str, object] = {"driver_version": self.driver_version}
        for name, attribute in (("unified_addressing", CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
                                ("host_pointer_for_registered_mem",
                                 CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)):
            try:
                caps[name] = self.device_attribute(attribute, ordinal)
            except CudaDriverError as exc:       # an attribute this driver predates
                caps[name] = f"n/a ({exc.name})"
        return caps

    def device_pointer(self, host_address: int) -> int:
        """cuMemHostGetDevicePointer of registered (mapped) host memory; a context must be current."""
        dptr = ctypes.c_uint64(0)
        self.check(self._host_get_device_pointer(ctypes.byref(dptr), ctypes.c_void_p(host_address), 0),
                   f"cuMemHostGetDevicePointer(0x{host_address:x})",
                   "the address must lie in memory registered with cudaHostRegisterMapped (proto.shm_layout."
                   "cuda_host_register does) and a CUDA context must be current")
        return dptr.value


_DRIVER: CudaDriver | None = None
_DRIVER_LOCK = threading.Lock()


def load_driver(names: Sequence[str] = LIBCUDA_NAMES) -> CudaDriver:
    """Load libcuda (the first of `names` that loads) and bind the entry points. Raises CudaDriverUnavailable
    when none loads (no NVIDIA driver) or CudaDriverError when cuInit fails."""
    errors = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            continue
        return CudaDriver(lib, name)
    raise CudaDriverUnavailable("cannot load the CUDA driver library (" + "; ".join(errors) + "): no NVIDIA "
                                "driver on this machine; the CPU share takes the host hand-off here")


def driver() -> CudaDriver:
    """The process's CudaDriver, loaded on first use (importing this module loads nothing)."""
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = load_driver()
        return _DRIVER
