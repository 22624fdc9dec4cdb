"""Checkpoint loading: configs, and the errors a broken checkpoint gets (each names file, tensor, fix)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftexpert.gpu_worker.checkpoint.config import MoeConfig

from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.checkpoint.reader import CheckpointError
from tests.gpu_worker.test_models_util import hf_model, save_hf


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return save_hf(hf_model("qwen3", seed=2), tmp_path_factory.mktemp("qwen3"))


def copy_of(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("arch", ["qwen3", "olmoe", "mixtral"])
def test_config_reads_what_transformers_writes_and_round_trips(tmp_path, arch):
    d = save_hf(hf_model(arch), tmp_path / arch)
    cfg = MoeConfig.from_dir(d)
    assert (cfg.arch, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.num_layers) == (arch, 8, 2, 64, 2)
    assert cfg.expert_intermediate_size == 32 and cfg.head_dim == 16 and cfg.dtype == "float32"
    assert MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_hub_style_config_fields(tmp_path):
    """Hub configs use num_experts, top-level rope_theta and torch_dtype (Qwen3-30B-A3B style)."""
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
           "intermediate_size": 6144, "rope_theta": 1000000.0, "rope_scaling": None, "norm_topk_prob": True,
           "torch_dtype": "bfloat16", "eos_token_id": 151645, "sliding_window": 4096,
           "use_sliding_window": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}
    cfg = MoeConfig.from_hf_dict(raw)
    assert (cfg.num_experts, cfg.rope_theta, cfg.dtype, cfg.sliding_window) == (128, 1e6, "bfloat16", None)
    assert cfg.eos_token_ids == (151645,) and cfg.norm_topk_prob


def test_unsupported_architecture(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    edit_config(d, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*not supported.*Qwen3MoeForCausalLM"):
        load_model(d, device="cpu")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        load_model(tmp_path, device="cpu")


def test_missing_shard_names_the_shard(tmp_path):
    d = save_hf(hf_model("olmoe"), tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{victim}.*download"):
        load_model(d, device="cpu")


def test_missing_tensor_names_the_tensor(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    state = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    del state[name]
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*missing.*{d}"):
        load_model(d, device="cpu")


def test_shape_mismatch_names_file_tensor_and_shapes(qwen3_dir, tmp_path):
    d = copy_of(qwen3_dir, tmp_path)
    edit_config(d, moe_intermediate_size=16)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.experts.0"
                                              r".gate_proj.weight' has shape \(32, 64\).*\(16, 64\)"):
        load_model(d, device="cpu")


def test_pickle_checkpoints_are_refused(qwen3_dir, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(qwen3_dir / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickled.*safetensors"):
        load_model(d, device="cpu")


def test_dtype_override(qwen3_dir):
    loaded = load_model(qwen3_dir, device="cpu", dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.experts.packed[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not one of"):
        load_model(qwen3_dir, device="cpu", dtype="int4")
