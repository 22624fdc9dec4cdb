"""`CheckpointReader`: named tensors out of single or sharded safetensors files, with errors that
name the file, the tensor and the fix. No pickle: ``*.bin`` checkpoints are refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint is incomplete or does not match its config; the message says what to do."""


class CheckpointReader:
    """Maps tensor name -> shard file and reads tensors lazily (safetensors memory-maps the file)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.shard_of: dict[str, Path] = {}   # tensor name -> shard path
        self._handles: dict[Path, object] = {}
        index = self.model_dir / INDEX_FILE
        single = self.model_dir / SINGLE_FILE
        if index.is_file():
            self._read_index(index)
        elif single.is_file():
            self._add_shard(single)
        else:
            shards = sorted(self.model_dir.glob("*.safetensors"))
            if shards:
                for shard in shards:
                    self._add_shard(shard)
            elif any(self.model_dir.glob("*.bin")) or any(self.model_dir.glob("*.pt")):
                raise CheckpointError(
                    f"{self.model_dir} holds only pickled *.bin/*.pt weights, which this service does not "
                    f"load; convert them to safetensors (e.g. transformers save_pretrained, the default)")
            else:
                raise CheckpointError(
                    f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {self.model_dir}; "
                    f"download the checkpoint's weight files into that directory")

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc!r}); "
                                  f"re-download it") from None
        missing = sorted({f for f in weight_map.values() if not (self.model_dir / f).is_file()})
        if missing:
            raise CheckpointError(
                f"{index} names shard(s) missing from {self.model_dir}: {', '.join(missing)}; "
                f"download them (the index lists every shard the checkpoint needs)")
        for name, fname in weight_map.items():
            self.shard_of[name] = self.model_dir / fname

    def _add_shard(self, shard: Path) -> None:
        for name in self._handle(shard).keys():
            self.shard_of[name] = shard

    def _handle(self, shard: Path):
        handle = self._handles.get(shard)
        if handle is None:
            try:
                handle = safe_open(str(shard), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {shard}: {exc}; the file is damaged or not "
                                      f"safetensors, re-download it") from None
            self._handles[shard] = handle
        return handle

    def has(self, name: str) -> bool:
        return name in self.shard_of

    def names(self) -> list[str]:
        return list(self.shard_of)

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor ``name`` (a CPU tensor in the stored dtype), checked against ``shape``."""
        shard = self.shard_of.get(name)
        if shard is None:
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint in {self.model_dir}; the checkpoint is "
                f"incomplete or its config.json does not describe it (check num_hidden_layers, "
                f"num_experts and the architecture)")
        handle = self._handle(shard)
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{shard.name}: cannot read tensor {name!r} ({exc}); the index maps "
                                  f"it to this shard but the shard lacks it; re-download the shard") from None
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{shard.name}: tensor {name!r} has shape {tuple(tensor.shape)} but config.json implies "
                f"{tuple(shape)}; the weights and config.json belong to different models")
        return tensor

    def get_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name`` into ``out`` (shape-checked against ``out``, dtype converted)."""
        out.copy_(self.get(name, tuple(out.shape)))

    def close(self) -> None:
        self._handles.clear()
