"""The `ft bench bw` bandwidth profile: its format and reader (a contract between the writer, `ft bench bw`,
and its readers, the coordinator's fetch policy and the GPU worker's starting fetch fraction).

A profile holds, per GPU and expert format (dtype, hidden and intermediate size, and the experts' storage
format: bf16, fp8, int4-g*, mxfp4, nvfp4; an entry without "format" is bf16), the measured PCIe and
CPU-pool expert bandwidths; the fetch fraction starts at B_pcie / (B_pcie + B_cpu). A profile of other
hardware or another expert format is ignored with a log line, never misapplied.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

from ftexpert.proto.expert_format import ExpertFormat as StorageFormat
from ftexpert.proto.expert_format import FormatError, QuantLayout

log = logging.getLogger("ft.bandwidth_profile")

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "torch.float16": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32", "torch.float32": "float32",
    "int8": "int8", "torch.int8": "int8", "fp8": "float8", "float8": "float8",
}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "float8": 1}


def normalize_dtype(name: str) -> str:
    key = str(name).strip().lower()
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown expert dtype {name!r}; known: {', '.join(sorted(set(_DTYPE_ALIASES)))}")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class ExpertFormat:
    """What one expert's weights look like: gate, up ([I, H] each) and down ([H, I]) in the model dtype, stored
    as ``fmt`` (a proto.expert_format label: bf16 = the dtype itself, or a quantized format's bytes)."""
    dtype: str
    hidden_size: int
    intermediate_size: int
    fmt: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if self.hidden_size <= 0 or self.intermediate_size <= 0:
            raise ValueError(f"expert sizes must be positive, got H={self.hidden_size} I={self.intermediate_size}")
        try:
            object.__setattr__(self, "fmt", StorageFormat.parse(self.fmt).label)
        except FormatError as exc:
            raise ValueError(str(exc)) from None

    @property
    def bytes_per_expert(self) -> int:
        storage = StorageFormat.parse(self.fmt)
        if storage.quantized:
            return QuantLayout(self.hidden_size, self.intermediate_size, storage).expert_nbytes
        return 3 * self.hidden_size * self.intermediate_size * _DTYPE_BYTES[self.dtype]

    def key(self) -> str:
        base = f"{self.dtype}/{self.hidden_size}x{self.intermediate_size}"
        return base if self.fmt == "bf16" else f"{base}/{self.fmt}"


@dataclass(frozen=True)
class BandwidthProfile:
    pcie_gb_s: float
    cpu_gb_s: float
    gpu_name: str
    expert_format: ExpertFormat
    path: str

    @property
    def fetch_fraction(self) -> float:
        return self.pcie_gb_s / (self.pcie_gb_s + self.cpu_gb_s)


def load_bandwidth_profile(path: str, expert_format: ExpertFormat, gpu_name: str) -> BandwidthProfile | None:
    """The entry of an `ft bench bw` profile that matches this GPU and expert format, or None.

    Schema (docs/POLICY.md): {"gpu_name": str, "entries": [{"dtype", "hidden_size",
    "intermediate_size", "pcie_gb_s", "cpu_gb_s", optional "format" (default bf16), optional "gpu_name"}]}. A missing file, another
    GPU or another expert format gives None and one log line saying why.
    """
    if not path or not os.path.exists(path):
        log.info("no bandwidth profile at %r; run `ft bench bw` on this machine to write one", path)
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        entries = doc["entries"]
        if not isinstance(entries, list):
            raise TypeError("'entries' must be a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring bandwidth profile %s: unreadable (%s); rerun `ft bench bw`", path, exc)
        return None
    seen: list[str] = []
    for entry in entries:
        try:
            entry_gpu = str(entry.get("gpu_name", doc.get("gpu_name", "")))
            fmt = ExpertFormat(entry["dtype"], int(entry["hidden_size"]), int(entry["intermediate_size"]),
                               str(entry.get("format", "bf16")))
            pcie, cpu = float(entry["pcie_gb_s"]), float(entry["cpu_gb_s"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("skipping a malformed entry of bandwidth profile %s: %s", path, exc)
            continue
        seen.append(f"{entry_gpu} {fmt.key()}")
        if entry_gpu.strip() != gpu_name.strip() or fmt != expert_format:
            continue
        if not (pcie > 0 and cpu > 0 and math.isfinite(pcie) and math.isfinite(cpu)):
            log.warning("ignoring bandwidth profile %s: non-positive bandwidths for %s", path, fmt.key())
            return None
        return BandwidthProfile(pcie, cpu, entry_gpu, fmt, path)
    log.warning("ignoring bandwidth profile %s: measured for [%s], not for %s %s; "
                "run `ft bench bw` on this machine", path, "; ".join(seen) or "nothing", gpu_name,
                expert_format.key())
    return None


def default_benchbw_path() -> str:
    """Where `ft bench bw` writes its profile by default (FREETOKEN_BENCHBW_PATH overrides it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "freetoken", "benchbw.json")
