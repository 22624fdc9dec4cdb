"""The expert weight store: every expert's weights once, in host shared memory (/dev/shm).

Layout of the segment (one file, mapped by the coordinator, the GPU worker and every CPU worker)::

    0            common header (64 B): magic "FTEXPST1", version, meta_nbytes, creator pid + start
                 time, state (CREATING -> READY once every expert is written)
    64           meta (msgpack, <= 4032 B): num_layers, num_experts, hidden, intermediate, dtype, format,
                 expert_bytes, expert_stride, data_offset, config_hash, creator_pid
    4096         (unused up to the 2 MiB boundary)
    data_offset  = 2 MiB: the data region, L * E * expert_stride bytes
                 expert (l, e) at data_offset + (l * E + e) * expert_stride:
                     w13 [2I, H]  gate_proj rows then up_proj rows (HF [out, in] layout)
                     w2  [H, I]   down_proj
                 in the model dtype (format bf16), or one quantized expert's bytes as
                 proto/expert_format.py lays them out (fp8, int4-g*, mxfp4, nvfp4);
                 expert_stride = expert_bytes rounded up to 4 KiB

Legend: L layers, E experts per layer, H hidden size, I expert intermediate size.

Attaching maps the same pages (no copy): N attached processes add no private memory for weights.
Fill first, then ``pin_for_cuda`` (registering first would make the driver zero-fill the pages).

The coordinator imports this module and creates, places and unlinks the store without torch: the shape's sizes
are computed from dtype names, and torch is imported lazily, by the tensor views and the writes, which only
the processes that read or fill the experts use.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

from ftexpert.proto.expert_act import ExpertAct, bias_offset
from ftexpert.proto.expert_format import ExpertFormat, FormatError, QuantLayout
from ftexpert.proto.shm_segment import (COMMON_HEADER_BYTES, HUGE_PAGE_BYTES, PAGE_BYTES, SEGMENT_READY, ShmError,
                              ShmSegment, cuda_host_register, cuda_host_unregister, round_up)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

STORE_MAGIC = b"FTEXPST1"
STORE_VERSION = 2
STORE_KIND = "expert store"
HEADER_BYTES = PAGE_BYTES
DATA_ALIGN_BYTES = HUGE_PAGE_BYTES
EXPERT_ALIGN_BYTES = PAGE_BYTES
STORE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}     # the model dtypes a store holds: bytes each

__all__ = ["ExpertStore", "StoreShape", "ShmError", "STORE_DTYPE_BYTES"]


def dtype_name(dtype: "torch.dtype | str") -> str:
    """The name of a model dtype ("bfloat16"), given as a name or a torch dtype (read by its name: no torch here)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in STORE_DTYPE_BYTES:
        raise ValueError(f"expert dtype {dtype!r} is not supported; use one of {', '.join(STORE_DTYPE_BYTES)}")
    return name


def _torch():
    import torch  # lazy: the coordinator imports this module and never builds a tensor view

    return torch


@dataclasses.dataclass(frozen=True)
class StoreShape:
    num_layers: int
    num_experts: int
    hidden: int          # H
    intermediate: int    # I
    dtype: str           # a key of STORE_DTYPE_BYTES: the model's compute dtype
    fmt: str = "bf16"    # the experts' format: an ExpertFormat label (bf16, fp8, int4-g128, mxfp4, nvfp4)
    act: str = "silu"    # the experts' activation: an ExpertAct label (a biased one ends each row with biases)

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_experts", "hidden", "intermediate"):
            if getattr(self, field) <= 0:
                raise ValueError(f"expert store {field} must be > 0, got {getattr(self, field)}")
        dtype_name(self.dtype)
        ExpertAct.parse(self.act)
        if self.expert_format.quantized:
            QuantLayout(self.hidden, self.intermediate, self.expert_format)    # refuses shapes it cannot hold

    @property
    def expert_format(self) -> ExpertFormat:
        return ExpertFormat.parse(self.fmt)

    @property
    def expert_act(self) -> ExpertAct:
        return ExpertAct.parse(self.act)

    @property
    def quant_layout(self) -> QuantLayout:
        """The byte layout of one expert (quantized formats only)."""
        return QuantLayout(self.hidden, self.intermediate, self.expert_format)

    @property
    def storage_dtype(self) -> "torch.dtype":
        """The element type of layer_view: the model dtype (bf16 format), else uint8 bytes."""
        return _torch().uint8 if self.expert_format.quantized else self.torch_dtype

    @property
    def torch_dtype(self) -> "torch.dtype":
        return getattr(_torch(), self.dtype)

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one value of the model dtype."""
        return STORE_DTYPE_BYTES[self.dtype]

    @property
    def item_bytes(self) -> int:
        """Bytes of one element of layer_view: the model dtype's (bf16 format), else 1."""
        return 1 if self.expert_format.quantized else self.dtype_bytes

    @property
    def w13_numel(self) -> int:
        return 2 * self.intermediate * self.hidden

    @property
    def expert_numel(self) -> int:
        """Elements of one expert in layer_view: weights (bf16 format) or bytes (quantized)."""
        biases = self.expert_act.bias_numel(self.hidden, self.intermediate)
        if self.expert_format.quantized:
            if not biases:
                return self.quant_layout.expert_nbytes
            return bias_offset(self.quant_layout.expert_nbytes) + biases * self.dtype_bytes
        return self.w13_numel + self.hidden * self.intermediate + biases

    @property
    def expert_bytes(self) -> int:
        return self.expert_numel * self.item_bytes

    @property
    def bias_byte_offset(self) -> int:
        """Byte offset of a biased expert's biases in its row: after the weights (quantized: aligned, bias_offset)."""
        if self.expert_format.quantized:
            return bias_offset(self.quant_layout.expert_nbytes)
        return (self.w13_numel + self.hidden * self.intermediate) * self.dtype_bytes

    @property
    def expert_stride(self) -> int:
        return round_up(self.expert_bytes, EXPERT_ALIGN_BYTES)

    @property
    def data_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_stride


class ExpertStore:
    """Zero-copy access to the shared expert weights. Create once (``create``), ``attach`` elsewhere."""

    def __init__(self, seg: ShmSegment):
        self._seg = seg
        meta = seg.meta
        try:
            self.shape = StoreShape(int(meta["num_layers"]), int(meta["num_experts"]), int(meta["hidden"]),
                                    int(meta["intermediate"]), str(meta["dtype"]), str(meta["format"]),
                                    str(meta.get("act", "silu")))
            self.config_hash = str(meta["config_hash"])
            self.data_offset = int(meta["data_offset"])
            self.expert_stride = int(meta["expert_stride"])
            self.expert_bytes = int(meta["expert_bytes"])
            self.creator_pid = int(meta["creator_pid"])
        except (KeyError, ValueError, FormatError) as exc:
            seg.close()
            raise ShmError(f"{STORE_KIND} {seg.name!r} has a malformed meta block ({exc!r}); "
                           "recreate it with this build") from None
        if (self.expert_bytes != self.shape.expert_bytes or self.expert_stride != self.shape.expert_stride
                or self.data_offset % DATA_ALIGN_BYTES or self.data_offset + self.shape.data_bytes > seg.nbytes):
            seg.close()
            raise ShmError(f"{STORE_KIND} {seg.name!r}: meta ({meta}) does not match its size "
                           f"({seg.nbytes} bytes) or this build's layout; recreate it with this build")
        self._data: "torch.Tensor | None" = None       # the data region as a tensor, made at its first use
        self._pinned = False

    @property
    def _data_u8(self) -> "torch.Tensor":
        """[data_bytes] uint8 over the data region, no copy (torch is imported here, at the first view)."""
        if self._data is None:
            torch = _torch()
            with warnings.catch_warnings():   # a read-only mapping gives a read-only buffer; writes would fault
                warnings.simplefilter("ignore", UserWarning)
                self._data = torch.frombuffer(self._seg.u8, dtype=torch.uint8, count=self.shape.data_bytes,
                                              offset=self.data_offset)
        return self._data

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, *, num_layers: int, num_experts: int, hidden: int, intermediate: int,
               dtype: "torch.dtype | str", config_hash: str, fmt: str = "bf16", act: str = "silu") -> "ExpertStore":
        """Create the segment (uninitialised data; fill it, then ``mark_ready``). The creator owns unlink.

        ``fmt`` is the experts' format (an ExpertFormat label); ``dtype`` the model's compute dtype; ``act`` their
        activation (an ExpertAct label)."""
        shape = StoreShape(num_layers, num_experts, hidden, intermediate, dtype_name(dtype),
                           ExpertFormat.parse(fmt).label, ExpertAct.parse(act).label)
        meta: dict[str, Any] = {
            "num_layers": num_layers, "num_experts": num_experts, "hidden": hidden,
            "intermediate": intermediate, "dtype": shape.dtype, "format": shape.fmt, "act": shape.act,
            "expert_bytes": shape.expert_bytes,
            "expert_stride": shape.expert_stride, "data_offset": DATA_ALIGN_BYTES,
            "config_hash": str(config_hash), "creator_pid": os.getpid(),
        }
        seg = ShmSegment.create(name, nbytes=DATA_ALIGN_BYTES + shape.data_bytes, magic=STORE_MAGIC,
                                version=STORE_VERSION, meta=meta, kind=STORE_KIND,
                                meta_capacity_bytes=HEADER_BYTES - COMMON_HEADER_BYTES)
        log.info("created %s %r: %d layers x %d experts x %.2f MB (%s experts, %s), %.2f GiB", STORE_KIND, name,
                 num_layers, num_experts, shape.expert_bytes / 1e6, shape.fmt, shape.dtype, seg.nbytes / 1024 ** 3)
        return cls(seg)

    @classmethod
    def attach(cls, name: str, *, readonly: bool = True) -> "ExpertStore":
        """Map an existing store (no copy). Validates magic, version and meta."""
        seg = ShmSegment.attach(name, magic=STORE_MAGIC, version=STORE_VERSION, readonly=readonly,
                                kind=STORE_KIND, hint="start the coordinator (it creates and loads the store) "
                                "or pass the name it printed (--store)")
        return cls(seg)

    # -- facts ----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._seg.name

    @property
    def readonly(self) -> bool:
        return self._seg.readonly

    @property
    def is_owner(self) -> bool:
        return self._seg.owner

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def num_experts(self) -> int:
        return self.shape.num_experts

    @property
    def dtype(self) -> "torch.dtype":
        """The model's compute dtype (the experts' element type in the bf16 format)."""
        return self.shape.torch_dtype

    @property
    def expert_format(self) -> ExpertFormat:
        return self.shape.expert_format

    @property
    def nbytes(self) -> int:
        """Bytes of the data region (all experts with their stride padding)."""
        return self.shape.data_bytes

    @property
    def data_ptr(self) -> int:
        """Host address of the data region in this process (2 MiB-aligned offset in the file)."""
        return self._seg.address + self.data_offset

    @property
    def is_ready(self) -> bool:
        return self._seg.state == SEGMENT_READY

    def mark_ready(self) -> None:
        """Creator: every expert is written; attachers may serve."""
        self._require_writable("mark_ready")
        self._seg.set_state(SEGMENT_READY)

    def meta(self) -> dict[str, Any]:
        return dict(self._seg.meta)

    def expert_offset(self, layer: int, expert: int) -> int:
        """Byte offset of expert (layer, expert) from ``data_ptr``."""
        self._check_index(layer, expert)
        return (layer * self.num_experts + expert) * self.expert_stride

    # -- views ----------------------------------------------------------------------------------
    def layer_view(self, layer: int) -> "torch.Tensor":
        """[E, expert_numel] tensor over layer `layer` (zero-copy, row stride padded): the model dtype in
        the bf16 format, one expert's bytes (uint8) a row in a quantized one."""
        self._check_index(layer, 0)
        shape, item = self.shape, self.shape.item_bytes
        begin = layer * shape.num_experts * self.expert_stride
        u8 = self._data_u8[begin:begin + shape.num_experts * self.expert_stride]
        flat = u8.view(shape.storage_dtype)
        return flat.as_strided((shape.num_experts, shape.expert_numel), (self.expert_stride // item, 1))

    def expert_views(self, layer: int, expert: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """(w13 [2I, H], w2 [H, I]) of one expert, zero-copy (bf16 format; see expert_bytes_view)."""
        if self.expert_format.quantized:
            raise FormatError(f"expert store {self.name!r} holds {self.shape.fmt} experts: read them with "
                              "expert_bytes_view and kernels.expert_reference.unpack_expert")
        off = self.expert_offset(layer, expert)
        flat = self._data_u8[off:off + self.expert_bytes].view(self.shape.torch_dtype)
        shape = self.shape
        w13 = flat[:shape.w13_numel].view(2 * shape.intermediate, shape.hidden)
        w2 = flat[shape.w13_numel: shape.w13_numel + shape.hidden * shape.intermediate].view(shape.hidden,
                                                                                             shape.intermediate)
        return w13, w2

    def expert_biases(self, layer: int, expert: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """(b13 [2I], b2 [H]) of one expert of a biased store, zero-copy, in the compute dtype (any format)."""
        shape = self.shape
        n = shape.expert_act.bias_numel(shape.hidden, shape.intermediate)
        if not n:
            raise FormatError(f"expert store {self.name!r} holds {shape.act} experts, which have no biases")
        off = self.expert_offset(layer, expert) + shape.bias_byte_offset
        size = shape.dtype_bytes
        vals = self._data_u8[off: off + n * size].view(shape.torch_dtype)
        return vals[: 2 * shape.intermediate], vals[2 * shape.intermediate:]

    def expert_bytes_view(self, layer: int, expert: int) -> "torch.Tensor":
        """One expert's bytes [expert_bytes] uint8, zero-copy (any format)."""
        off = self.expert_offset(layer, expert)
        return self._data_u8[off:off + self.expert_bytes]

    # -- writing (creator, or an attacher with readonly=False) ------------------------------------
    def write_layer(self, layer: int, packed: "torch.Tensor") -> None:
        """packed: [E, expert_numel] (w13 rows then w2 rows per expert, flattened), any float dtype."""
        self._require_writable("write_layer")
        expected = (self.num_experts, self.shape.expert_numel)
        if tuple(packed.shape) != expected:
            raise ValueError(f"write_layer({layer}): packed has shape {tuple(packed.shape)}, expected {expected} "
                             "([experts, 2*I*H + H*I]: gate rows, up rows, then down, flattened)")
        self.layer_view(layer).copy_(packed)

    def write_expert(self, layer: int, expert: int, *, gate: "torch.Tensor", up: "torch.Tensor",
                     down: "torch.Tensor") -> None:
        """HF tensors: gate_proj.weight [I, H], up_proj.weight [I, H], down_proj.weight [H, I]."""
        self._require_writable("write_expert")
        h, i = self.shape.hidden, self.shape.intermediate
        for what, tensor, expected in (("gate", gate, (i, h)), ("up", up, (i, h)), ("down", down, (h, i))):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"write_expert({layer}, {expert}): {what} has shape {tuple(tensor.shape)}, "
                                 f"expected {expected} (HF [out, in] layout, H={h}, I={i})")
        w13, w2 = self.expert_views(layer, expert)
        w13[:i].copy_(gate)
        w13[i:].copy_(up)
        w2.copy_(down)

    # -- CUDA -----------------------------------------------------------------------------------
    def pin_for_cuda(self) -> bool:
        """cudaHostRegister the data region; False where CUDA is absent. Call after the store is filled.

        The driver pins pages writable, so a read-only attach is first remapped writable in this process
        (same addresses: views stay valid); the store's bytes are not touched."""
        if self._pinned:
            return True
        if not _torch().cuda.is_available():
            return False
        self._seg.remap_writable()
        self._pinned = cuda_host_register(self.data_ptr, self.nbytes, what=f"{STORE_KIND} {self.name!r}")
        return self._pinned

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._seg.closed:
            return
        if self._pinned:
            cuda_host_unregister(self.data_ptr)
            self._pinned = False
        self._data = None
        self._seg.close()

    def unlink(self) -> None:
        """Creator only: remove the name; mappings stay valid until every process closes them."""
        self._seg.unlink()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.shape
        return (f"ExpertStore({self.name!r}, L={s.num_layers}, E={s.num_experts}, H={s.hidden}, "
                f"I={s.intermediate}, {s.dtype}, {self.nbytes / 1024 ** 3:.2f} GiB, "
                f"{'owner' if self.is_owner else 'attached'}{', ro' if self.readonly else ''})")

    # -- helpers --------------------------------------------------------------------------------
    def _check_index(self, layer: int, expert: int) -> None:
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise IndexError(f"expert ({layer}, {expert}) is outside the store "
                             f"({self.num_layers} layers x {self.num_experts} experts)")

    def _require_writable(self, what: str) -> None:
        if self.readonly:
            raise ShmError(f"{what}: {STORE_KIND} {self.name!r} is attached read-only; "
                           "attach with readonly=False to write")
