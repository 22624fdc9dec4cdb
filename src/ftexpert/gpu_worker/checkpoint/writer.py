"""`write_checkpoint`: a Hugging Face checkpoint directory from dense weights and an expert source.

Experts are written in the hub's per-expert layout by default (``expert_format="hub"``) or in
transformers' fused layout (``"fused"``); gpt-oss's in transformers' layout (hub and fused alike) or, with
``"mxfp4"``, as the hub stores them (``_blocks`` / ``_scales``; config.json then says quant_method mxfp4). ``shards="per_layer"`` writes the dense weights in one
shard and each layer's experts in their own, with ``model.safetensors.index.json``; the experts are
produced one packed layer at a time, so the host never holds more than one layer of them.
The directory appears atomically: files are written to a temporary sibling, then renamed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ftexpert.gpu_worker.checkpoint.reader import INDEX_FILE, SINGLE_FILE
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_weights import DenseWeights, dense_state_dict
from ftexpert.gpu_worker.checkpoint.expert_layout import expert_views, unpack_experts
from ftexpert.gpu_worker.checkpoint.expert_sources import ExpertSource
from ftexpert.gpu_worker.checkpoint.gpt_oss_experts import MXFP4_QUANTIZATION, gpt_oss_expert_state
from ftexpert.gpu_worker.checkpoint.weight_names import expert_names, fused_expert_names

EXPERT_FORMATS = ("hub", "fused", "mxfp4")
SHARDINGS = ("single", "per_layer")


def expert_state_dict(cfg: MoeConfig, layer: int, packed: torch.Tensor, source: ExpertSource,
                      expert_format: str) -> dict[str, torch.Tensor]:
    """One layer's experts under checkpoint names (copies: safetensors refuses tensors sharing memory)."""
    if cfg.arch == "gptoss":
        return gpt_oss_expert_state(layer, packed, source.layout, mxfp4=expert_format == "mxfp4")
    if expert_format == "mxfp4":
        raise ValueError("expert_format mxfp4 writes gpt-oss checkpoints only")
    if expert_format == "fused":
        w13, w2 = unpack_experts(packed, source.layout)
        gu_name, d_name = fused_expert_names(layer)
        return {gu_name: w13.contiguous(), d_name: w2.contiguous()}
    state = {}
    for e in range(cfg.num_experts):
        gate, up, down = expert_views(packed[e], source.layout)
        for name, tensor in zip(expert_names(cfg, layer, e), (gate, up, down)):
            state[name] = tensor.clone()
    return state


def _fused_router_names(cfg: MoeConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused layout also renames mixtral's ``block_sparse_moe`` to ``mlp``."""
    if cfg.arch != "mixtral":
        return state
    return {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items()}


def write_checkpoint(out_dir: str | Path, cfg: MoeConfig, dense: DenseWeights, experts: ExpertSource,
                     expert_format: str = "hub", shards: str = "single",
                     extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json, safetensors weights and ``extra_files`` (name -> text) into ``out_dir``."""
    if expert_format not in EXPERT_FORMATS or shards not in SHARDINGS:
        raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, shards one of {SHARDINGS}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"format": "pt"}
    dense_state = {k: v.detach().cpu().contiguous() for k, v in dense_state_dict(cfg, dense).items()}
    if expert_format == "fused":
        dense_state = _fused_router_names(cfg, dense_state)

    def layer_state(layer: int) -> dict[str, torch.Tensor]:
        packed = experts.layout.empty_layer(experts.num_experts)
        experts.fill_layer(layer, packed)
        return expert_state_dict(cfg, layer, packed, experts, expert_format)

    if shards == "single":
        state = dict(dense_state)
        for layer in range(cfg.num_layers):
            state.update(layer_state(layer))
        save_file(state, str(tmp / SINGLE_FILE), metadata=meta)
    else:
        total = cfg.num_layers + 1
        weight_map: dict[str, str] = {}
        for shard_idx in range(total):
            fname = f"model-{shard_idx + 1:05d}-of-{total:05d}.safetensors"
            state = dense_state if shard_idx == 0 else layer_state(shard_idx - 1)
            save_file(state, str(tmp / fname), metadata=meta)
            weight_map.update({name: fname for name in state})
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    raw = cfg.to_hf_dict()
    if expert_format == "mxfp4":
        raw["quantization_config"] = dict(MXFP4_QUANTIZATION)
    (tmp / "config.json").write_text(json.dumps(raw, indent=2))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    if out_dir.exists():
        out_dir.rmdir()          # empty (checked above)
    try:
        tmp.rename(out_dir)
    except OSError:              # another process won the race: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():
            raise
    return out_dir
