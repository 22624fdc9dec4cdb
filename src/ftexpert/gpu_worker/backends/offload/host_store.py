"""Host copy of every expert, once, in the shared-memory expert store (pinned for DMA).

The service's store is created by the coordinator's side (coordinator/expert_resources.py) and filled by
``fill_expert_store``: in that process (`ft generate`, `ft serve --workers inline`) or in `ft worker store`
(`ft serve`, whose coordinator imports no torch); the GPU worker attaches (``HostExperts.attach``). An engine
built without that owner, and the benchmarks, make a store of their own (``HostExperts.create_filled``). Either
way the bytes live in one POSIX shared-memory segment that the CPU expert pool maps read-only and the GPU reads
by DMA after `cudaHostRegister`.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
from typing import Callable

import torch

from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource
from ftexpert.proto.expert_store import ExpertStore

log = logging.getLogger(__name__)
_store_numbers = itertools.count()


def layout_hash(source: ExpertSource) -> str:
    """The store's config hash: shape, compute dtype and the experts' format (a store of other experts is refused)."""
    lay = source.layout
    text = f"{source.num_layers}x{source.num_experts}x{lay.hidden_size}x{lay.intermediate_size}:{lay.dtype}"
    if lay.quantized:                      # bf16 keeps the hash it always had
        text += f":{lay.fmt.label}"
    if lay.act.bias:                       # so do silu experts
        text += f":{lay.act.label}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fill_expert_store(store: ExpertStore, source: ExpertSource,
                      staging_device: torch.device | str | None = None) -> None:
    """Write every expert of `source` into `store` (created empty for its layout, attached writable here), layer by
    layer, then mark it ready. With a CUDA `staging_device` each layer is produced on the GPU and copied down
    (random presets then hold the values a `resident` run on that GPU computes with). Its creator may be another
    process: `ft serve`'s coordinator creates the store and `ft worker store` fills it."""
    lay = source.layout
    if store.config_hash != layout_hash(source) or store.num_layers != source.num_layers \
            or store.num_experts != source.num_experts:
        raise ValueError(f"expert store {store.name!r} ({store.num_layers} x {store.num_experts} experts, config "
                         f"{store.config_hash}) was not made for these experts ({source.num_layers} x "
                         f"{source.num_experts}, config {layout_hash(source)}): create it from the same model")
    staging = None
    if staging_device is not None and torch.device(staging_device).type == "cuda":
        staging = lay.empty_layer(source.num_experts, device=staging_device)
    for layer in range(source.num_layers):
        view = store.layer_view(layer)
        if staging is None:
            source.fill_layer(layer, view)
        else:
            source.fill_layer(layer, staging)
            view.copy_(staging)
    store.mark_ready()


class HostExperts:
    """Per-layer [E, N] views of the expert store (uint8 rows for a quantized format); `owns` says whether this
    process unlinks it."""

    def __init__(self, store: ExpertStore, layout: ExpertLayout, owns: bool):
        self.store, self.layout, self.owns = store, layout, owns
        self.num_layers, self.num_experts = store.num_layers, store.num_experts
        self.layers = [store.layer_view(layer) for layer in range(self.num_layers)]   # [E, N] each
        self.pinned = False

    @classmethod
    def create_filled(cls, source: ExpertSource, *, name: str | None = None,
                      staging_device: torch.device | str | None = None, pin: bool = True,
                      before_fill: Callable[[ExpertStore], object] | None = None) -> "HostExperts":
        """Create a store and fill it layer by layer from `source` (fill_expert_store).

        With a CUDA `staging_device`, each layer is produced on the GPU and copied down: random
        presets then hold the same values as a `resident` run on that GPU, and generating 58 GB
        of random weights stays fast. The store is pinned (cudaHostRegister) after it is filled,
        since registering first would zero-fill it. ``pin=False``: the creator never does DMA (the
        coordinator, whose GPU worker pins its own attachment), so it makes no CUDA context.
        ``before_fill(store)`` runs on the empty store (pages are placed where they are first written:
        the CPU strategies bind them to their workers' NUMA nodes there).
        """
        lay = source.layout
        name = name or f"ft-experts-{os.getpid()}-{next(_store_numbers)}"
        store = ExpertStore.create(name, num_layers=source.num_layers,
                                   num_experts=source.num_experts, hidden=lay.hidden_size,
                                   intermediate=lay.intermediate_size, dtype=lay.dtype,
                                   config_hash=layout_hash(source), fmt=lay.fmt.label, act=lay.act.label)
        try:
            host = cls(store, lay, owns=True)
            if before_fill is not None:
                before_fill(store)
            fill_expert_store(store, source, staging_device)
            if pin and torch.cuda.is_available():
                host.pinned = store.pin_for_cuda()
        except BaseException:
            store.close()
            store.unlink()
            raise
        return host

    @classmethod
    def attach(cls, name: str, layout: ExpertLayout) -> "HostExperts":
        store = ExpertStore.attach(name, readonly=True)
        if (store.expert_format != layout.fmt or store.dtype != layout.dtype
                or store.shape.expert_act != layout.act):
            store.close()
            raise ValueError(f"expert store {name!r} holds {store.shape.fmt} experts ({store.shape.dtype}), this "
                             f"engine computes {layout.fmt.label} ({str(layout.dtype).removeprefix('torch.')}): "
                             "start the coordinator and the GPU worker with the same --expert-format and --dtype")
        host = cls(store, layout, owns=False)
        if torch.cuda.is_available():
            host.pinned = store.pin_for_cuda()
        return host

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def close(self) -> None:
        self.store.close()
        if self.owns:
            self.store.unlink()
