"""The expert format as configuration: quantization_config recognised or refused, the served format chosen, the
engine config hash, the GPU worker's flags, the knob, and `ft bench bw` profiles keyed on the format."""
from __future__ import annotations

import json

import pytest

from ftexpert.coordinator.cli import build_parser
from ftexpert.coordinator.process_set import options_from_serve_args
from ftexpert.gpu_worker.backends.hybrid.bandwidth import write_profile_entry
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.presets import PRESETS
from ftexpert.gpu_worker.checkpoint.quant_config import checkpoint_expert_format, resolve_served_format
from ftexpert.proto.engine_spec import spec_from_args
from ftexpert.proto import engine_messages as em
from ftexpert.proto.bandwidth_profile import ExpertFormat as ProfileFormat
from ftexpert.proto.bandwidth_profile import load_bandwidth_profile
from ftexpert.proto.expert_format import ExpertFormat, FormatError
from ftexpert.gpu_worker.checkpoint.quant_config import QuantCheckpointError

CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64,
                                       "symmetric": True}}}}
CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}


@pytest.mark.parametrize("qc, label", [
    (None, "bf16"), ({}, "bf16"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8"),
    ({"quant_method": "mxfp4"}, "mxfp4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "int4-g128"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32}, "int4-g32"),
    (CT_INT4, "int4-g64"), (CT_NVFP4, "nvfp4"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "nvfp4"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_quantization_configs_of_the_loaded_layouts_are_recognised(qc, label):
    assert checkpoint_expert_format(qc).label == label


@pytest.mark.parametrize("qc, what", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "fp8"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}, "format None"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size -1"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
])
def test_an_unrecognised_quantization_config_is_refused_naming_it(qc, what):
    with pytest.raises(QuantCheckpointError, match="is not supported") as info:
        checkpoint_expert_format(qc, "ckpt/config.json")
    assert what in str(info.value) and "ckpt/config.json" in str(info.value)


def test_formats_mixed_across_config_groups_are_refused():
    down = {**CT_INT4["config_groups"]["group_0"], "targets": ["re:.*down_proj"]}
    down = {**down, "weights": {**down["weights"], "group_size": 32}}
    mixed = {**CT_INT4, "config_groups": {"b": down, **CT_INT4["config_groups"]}}
    with pytest.raises(QuantCheckpointError, match="mixing formats"):
        checkpoint_expert_format(mixed)


def test_config_json_keeps_its_quantization_and_refuses_an_unknown_one():
    raw = PRESETS["olmoe-1b-7b"].to_hf_dict()
    cfg = MoeConfig.from_hf_dict({**raw, "quantization_config": CT_INT4})
    assert cfg.expert_format == "int4-g64" and cfg.quantization == CT_INT4
    assert MoeConfig.from_hf_dict(cfg.to_hf_dict()).expert_format == "int4-g64"          # written back
    assert MoeConfig.from_hf_dict(raw).expert_format == "bf16"
    with pytest.raises(QuantCheckpointError, match="quant_method 'hqq'"):
        MoeConfig.from_hf_dict({**raw, "quantization_config": {"quant_method": "hqq"}})


def test_the_served_format_follows_the_checkpoint_unless_asked():
    fp8, bf16 = ExpertFormat("fp8"), ExpertFormat("bf16")
    assert resolve_served_format(bf16, "auto") == bf16 and resolve_served_format(fp8, None) == fp8
    assert resolve_served_format(bf16, "int4") == ExpertFormat("int4", 128)
    assert resolve_served_format(fp8, "bf16") == bf16 and resolve_served_format(fp8, "fp8") == fp8
    with pytest.raises(FormatError, match="a second time"):
        resolve_served_format(fp8, "nvfp4")


def test_the_engine_spec_holds_the_format_and_the_worker_gets_it(tmp_path, monkeypatch):
    def serve(*extra):
        args = build_parser().parse_args(["serve", "--model", str(tmp_path / "m"), "--moe-strategy", "offload", *extra])
        return options_from_serve_args(args, spec_from_args(args)).spec

    monkeypatch.delenv("FREETOKEN_EXPERT_FORMAT", raising=False)
    plain, int4 = serve(), serve("--expert-format", "int4")
    assert plain.expert_format == "auto" and int4.expert_format == "int4-g128"
    assert em.spec_hash(plain.to_wire()) != em.spec_hash(int4.to_wire())
    welcome = em.Welcome(1, 2, "store", [], 1.0, 10.0, int4)          # what the GPU worker gets, as it gets it
    assert em.decode(em.encode(welcome)).spec.expert_format == "int4-g128"
    monkeypatch.setenv("FREETOKEN_EXPERT_FORMAT", "nvfp4")           # the knob, below the flag
    assert serve().expert_format == "nvfp4" and serve("--expert-format", "fp8").expert_format == "fp8"
    monkeypatch.setenv("FREETOKEN_EXPERT_FORMAT", "int5")
    with pytest.raises(ValueError, match="FREETOKEN_EXPERT_FORMAT"):
        serve()


def test_bandwidth_profiles_are_keyed_on_the_format(tmp_path):
    path = str(tmp_path / "bw.json")
    bf16 = ProfileFormat("bfloat16", 2048, 768)
    int4 = ProfileFormat("bfloat16", 2048, 768, "int4")
    assert int4.fmt == "int4-g128" and int4.key() == "bfloat16/2048x768/int4-g128" and bf16.key() == "bfloat16/2048x768"
    assert bf16.bytes_per_expert == 3 * 2048 * 768 * 2 and int4.bytes_per_expert < bf16.bytes_per_expert / 3
    base = {"gpu_name": "H200", "dtype": "bfloat16", "hidden_size": 2048, "intermediate_size": 768}
    write_profile_entry(path, {**base, "pcie_gb_s": 50.0, "cpu_gb_s": 50.0})          # an entry of before: bf16
    assert load_bandwidth_profile(path, int4, "H200") is None                          # not used for int4
    write_profile_entry(path, {**base, "format": "int4-g128", "pcie_gb_s": 40.0, "cpu_gb_s": 10.0})
    write_profile_entry(path, {**base, "format": "bf16", "pcie_gb_s": 30.0, "cpu_gb_s": 30.0})   # replaces the old
    assert len(json.load(open(path))["entries"]) == 2
    assert load_bandwidth_profile(path, int4, "H200").fetch_fraction == pytest.approx(0.8)
    assert load_bandwidth_profile(path, bf16, "H200").pcie_gb_s == 30.0
