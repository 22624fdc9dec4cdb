"""Expert sources: where a layer's packed experts come from.

An `ExpertSource` fills a caller-owned packed layer ``out: [E, N]`` (see expert_layout). The caller
chooses where ``out`` lives (GPU memory for `ResidentExperts`, a shared-memory store for the CPU pool
and the offload backend), so the experts are written once, straight into their final home, one
layer at a time: no second host copy of the experts ever exists.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError, CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, expert_views
from ftexpert.gpu_worker.checkpoint.gpt_oss_config import expert_act_of
from ftexpert.gpu_worker.checkpoint.gpt_oss_experts import fill_gpt_oss_layer
from ftexpert.gpu_worker.checkpoint.weight_names import expert_names, fused_expert_names


class ExpertSource(Protocol):
    layout: ExpertLayout
    num_layers: int
    num_experts: int

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        """Write layer ``layer``'s experts into ``out: [E, N]`` (any device, ``layout.storage_dtype``: the model
        dtype, or one expert's bytes a uint8 row in a quantized ``layout.fmt``; format_sources.py converts)."""


class CheckpointExpertSource:
    """Experts of a safetensors checkpoint, in the hub's per-expert or transformers' fused layout."""

    def __init__(self, reader: CheckpointReader, cfg: MoeConfig, dtype: torch.dtype):
        self.reader, self.cfg = reader, cfg
        self.layout = ExpertLayout(cfg.hidden_size, cfg.expert_intermediate_size, dtype, act=expert_act_of(cfg))
        self.num_layers, self.num_experts = cfg.num_layers, cfg.num_experts
        self._staging: torch.Tensor | None = None   # one host layer, reused (pinned for GPU targets)

    def layer_format(self, layer: int) -> str:
        """'hub' (one tensor per expert and projection) or 'fused' ([E, 2I, H] + [E, H, I])."""
        if self.reader.has(expert_names(self.cfg, layer, 0)[0]):
            return "hub"
        if self.reader.has(fused_expert_names(layer)[0]):
            return "fused"
        raise CheckpointError(
            f"layer {layer}'s experts are missing from {self.reader.model_dir}: neither "
            f"{expert_names(self.cfg, layer, 0)[0]!r} (hub layout) nor {fused_expert_names(layer)[0]!r} "
            f"(transformers fused layout) is present; the checkpoint is incomplete or not a "
            f"{self.cfg.hf_architecture}")

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        self.layout.check(out)
        if out.shape[0] != self.num_experts:
            raise ValueError(f"out has {out.shape[0]} experts, the checkpoint {self.num_experts}")
        host = out if out.device.type == "cpu" else self._staging_layer(out)
        if self.cfg.arch == "gptoss":
            fill_gpt_oss_layer(self.reader, layer, self.num_experts, self.layout, host)
        elif self.layer_format(layer) == "hub":
            self._fill_hub(layer, host)
        else:
            self._fill_fused(layer, host)
        if host is not out:
            out.copy_(host, non_blocking=False)

    def _staging_layer(self, out: torch.Tensor) -> torch.Tensor:
        if self._staging is None or self._staging.shape != out.shape:
            self._staging = self.layout.empty_layer(out.shape[0], pin_memory=torch.cuda.is_available())
        return self._staging

    def _fill_hub(self, layer: int, host: torch.Tensor) -> None:
        for e in range(self.num_experts):
            gate, up, down = expert_views(host[e], self.layout)
            g_name, u_name, d_name = expert_names(self.cfg, layer, e)
            self.reader.get_into(g_name, gate)
            self.reader.get_into(u_name, up)
            self.reader.get_into(d_name, down)

    def _fill_fused(self, layer: int, host: torch.Tensor) -> None:
        E, H, I = self.num_experts, self.layout.hidden_size, self.layout.intermediate_size
        gu_name, d_name = fused_expert_names(layer)
        host[:, : self.layout.w13_numel].copy_(self.reader.get(gu_name, (E, 2 * I, H)).reshape(E, -1))
        host[:, self.layout.w13_numel:].copy_(self.reader.get(d_name, (E, H, I)).reshape(E, -1))


def seeded_generator(device: torch.device | str, seed: int, *key: int) -> torch.Generator:
    """A generator on ``device`` whose stream depends only on (seed, key): order-independent."""
    mixed = seed & 0xFFFFFFFF
    for k in key:
        mixed = (mixed * 1_000_003 + k + 1) % (2**63 - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(mixed)
    return gen


class RandomExpertSource:
    """Seeded random experts, generated on ``out``'s device directly into the packed layout.

    Values depend on (seed, layer) and on the device kind (CPU and CUDA generators differ).
    """

    EXPERT_KEY = 1   # distinguishes expert streams from dense-weight streams (see random_weights)

    def __init__(self, cfg: MoeConfig, dtype: torch.dtype, seed: int, std: float):
        self.cfg, self.seed, self.std = cfg, seed, std
        self.layout = ExpertLayout(cfg.hidden_size, cfg.expert_intermediate_size, dtype, act=expert_act_of(cfg))
        self.num_layers, self.num_experts = cfg.num_layers, cfg.num_experts

    def fill_layer(self, layer: int, out: torch.Tensor) -> None:
        self.layout.check(out)
        gen = seeded_generator(out.device, self.seed, self.EXPERT_KEY, layer)
        out.normal_(mean=0.0, std=self.std, generator=gen)
