"""Quantized checkpoints in each published on-disk format -> our expert format, exactly.

Each tiny checkpoint (tests/gpu_worker/quant_checkpoints.py) carries the format's own float32
dequantization (the compressed-tensors library, transformers' fp8 / mxfp4 code, the published GPTQ and
ModelOpt decoders); our source's expert bytes, decoded by kernels.expert_reference.dequantize_expert, must
equal it bit for bit, and a transformers model running them must give the reference logits."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError, CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.dense_weights import load_dense_weights
from ftexpert.gpu_worker.checkpoint.quant_checkpoint import (DequantizingReader, QuantCheckpointError, QuantCheckpointExpertSource,
                                                dequantize_dense, detect_quant_format)
from ftexpert.gpu_worker.checkpoint.quant_tensors import gptq_matrix
from ftexpert.gpu_worker.checkpoint.weight_names import expert_names
from ftexpert.proto.expert_format import ExpertFormat, FormatError
from ftexpert.kernels.expert_reference import (dequantize_expert, dequantize_matrix, e4m3_decode, fp4_decode,
                                              unpack_nibbles)
from tests.gpu_worker.quant_checkpoints import (KINDS, gptq_reference, hf_model, load_hub_state,
                                                write_quant_checkpoint)
from tests.gpu_worker.test_models_util import prompt_ids, rel_err

VARIANTS = [(k, 128) for k in KINDS] + [("ct-int4-asym", 32), ("gptq", 64)]
EXACT = [v for v in VARIANTS if v[0] != "ct-nvfp4"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(kind: str, group: int = 128, **kw):
        key = (kind, group, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = write_quant_checkpoint(tmp_path_factory.mktemp(kind) / "ckpt", kind, group, **kw)
        return cache[key]
    return get


def our_experts(path) -> tuple[MoeConfig, dict[str, torch.Tensor]]:
    """Every expert through QuantCheckpointExpertSource.fill_layer and dequantize_expert (hub names)."""
    cfg = MoeConfig.from_dir(path)
    fmt = detect_quant_format(json.loads((path / "config.json").read_text()))
    src = QuantCheckpointExpertSource(CheckpointReader(path), cfg, fmt)
    nbytes = src.quant_layout.expert_nbytes
    store = torch.full((cfg.num_experts, nbytes + 48), 0xAB, dtype=torch.uint8)   # row stride > nbytes
    out = {}
    for layer in range(cfg.num_layers):
        rows = store[:, :nbytes]
        src.fill_layer(layer, rows)
        assert bool((store[:, nbytes:] == 0xAB).all()), "fill_layer wrote past an expert's bytes"
        for e in range(cfg.num_experts):
            for name, w in zip(expert_names(cfg, layer, e), dequantize_expert(rows[e], src.quant_layout)):
                out[name] = w
    return cfg, out


@pytest.mark.parametrize("kind,group", EXACT, ids=[f"{k}-g{g}" for k, g in EXACT])
def test_experts_equal_the_formats_own_dequantization(ckpts, kind, group):
    ck = ckpts(kind, group)
    _, ours = our_experts(ck.path)
    assert ours and all(torch.equal(w, ck.dequantized[n]) for n, w in ours.items()), \
        [n for n, w in ours.items() if not torch.equal(w, ck.dequantized[n])][:4]


def test_ct_nvfp4_is_the_reciprocal_product_and_within_two_ulps_of_the_library(ckpts):
    """compressed-tensors divides by weight_global_scale; we (and vLLM) multiply by its float32 reciprocal:
    the scales differ by at most one float32 ulp, so the weights by at most two."""
    ck = ckpts("ct-nvfp4")
    _, ours = our_experts(ck.path)
    tensors = {}
    for f in ck.path.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    for name, w in ours.items():
        p = name[: -len("weight")]
        glob = torch.reciprocal(tensors[p + "weight_global_scale"]).reshape(())
        scale = (e4m3_decode(tensors[p + "weight_scale"].view(torch.uint8)) * glob).repeat_interleave(16, 1)
        assert torch.equal(w, fp4_decode(unpack_nibbles(tensors[p + "weight_packed"])) * scale)
        lib = ck.dequantized[name]
        ulp = torch.nextafter(lib.abs(), torch.tensor(float("inf"))) - lib.abs()
        assert bool(((w - lib).abs() <= 2 * ulp).all())


def test_ct_nvfp4_with_a_power_of_two_global_scale_is_exact(ckpts):
    ck = ckpts("ct-nvfp4", pow2_global=True)
    _, ours = our_experts(ck.path)
    assert all(torch.equal(w, ck.dequantized[n]) for n, w in ours.items())


@pytest.mark.parametrize("kind", KINDS)
def test_dense_weights_are_dequantized_exactly(ckpts, kind):
    ck = ckpts(kind)
    reader = DequantizingReader(CheckpointReader(ck.path))
    dense = [n for n in ck.dequantized if ".experts." not in n]
    mismatched = [n for n in dense if not torch.equal(reader.get(n), ck.dequantized[n])]
    if kind == "ct-nvfp4":     # the reciprocal convention: at most two float32 ulps, see above
        assert all(rel_err(reader.get(n), ck.dequantized[n]) < 1e-6 for n in mismatched)
    else:
        assert not mismatched
    weights = load_dense_weights(reader, MoeConfig.from_dir(ck.path), "cpu", torch.float32)
    assert weights.layers[1].q_proj.shape == ck.dequantized["model.layers.1.self_attn.q_proj.weight"].shape


def test_library_dtype_results_are_ours_rounded(ckpts):
    """The libraries compute in the checkpoint's scale dtype: their bf16 / fp16 result is our float32 rounded."""
    from tests.gpu_worker.quant_checkpoints import _ct_args, ct_reference
    ck = ckpts("ct-int4-asym")
    tensors = load_file(str(ck.path / "model-00001-of-00002.safetensors"))
    p = "model.layers.0.mlp.experts.2.down_proj."
    lib_bf16 = ct_reference({k[len(p):]: v for k, v in tensors.items() if k.startswith(p)},
                            _ct_args("ct-int4-asym", 128), dtype=torch.bfloat16)
    assert lib_bf16.dtype == torch.bfloat16 and torch.equal(lib_bf16, ck.dequantized[p + "weight"].bfloat16())
    ck = ckpts("gptq")
    tensors = load_file(str(ck.path / "model-00001-of-00002.safetensors"))
    t = {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}
    assert torch.equal(gptq_reference(t, v1=True, dtype=torch.float16), ck.dequantized[p + "weight"].half())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_running_the_dequantized_weights(ckpts, kind):
    ck = ckpts(kind)
    cfg, experts = our_experts(ck.path)
    reader = DequantizingReader(CheckpointReader(ck.path))
    ours = {n: (experts[n] if n in experts else reader.get(n)) for n in ck.dequantized}
    ids = torch.tensor([prompt_ids(12, seed=3)])
    model = hf_model("qwen3", **ck.shape_kw)             # the unquantized weights the checkpoint was made from
    with torch.no_grad():
        bf16 = model(ids).logits
        load_hub_state(model, ck.dequantized)               # = reference_model(ck)
        want = model(ids).logits
        load_hub_state(model, ours)
        got = model(ids).logits
    assert rel_err(got, want) < (1e-6 if kind == "ct-nvfp4" else 1e-12)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert rel_err(want, bf16) < 0.5          # the quantized model is still the model (loose: 4-bit, tiny)


# -- misuse ------------------------------------------------------------------------------------------
def _edit_tensors(path, edit):
    for f in sorted(path.glob("*.safetensors")):
        state = load_file(str(f))
        edit(state)
        save_file(state, str(f), metadata={"format": "pt"})


def _copy(ck, tmp_path):
    import shutil
    dst = tmp_path / "ckpt"
    shutil.copytree(ck.path, dst)
    return dst


def _source(path, fmt=None):
    raw = json.loads((path / "config.json").read_text())
    return QuantCheckpointExpertSource(CheckpointReader(path), MoeConfig.from_dir(path), fmt or detect_quant_format(raw))


def _fill(src, layer=0):
    src.fill_layer(layer, torch.zeros(src.num_experts, src.quant_layout.expert_nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported; supported: fp8"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\] is not supported"),
    ({"quant_method": "fp8"}, r"per-tensor FP8\) is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq bits 8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, r"group_size -1 is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"quant_algo 'FP8' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     r"format 'float-quantized' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"targets": ["re:.*gate_proj$", "re:.*up_proj$"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
        "b": {"targets": ["re:.*down_proj$"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}}},
     r"quantize one expert's projections differently"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*down_proj$"],
      "config_groups": {"a": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     r"mixing quantized and unquantized expert projections"),
], ids=["awq", "fp8-block64", "fp8-per-tensor", "gptq-8bit", "gptq-per-channel", "modelopt-fp8",
        "ct-fp8", "ct-mixed-groups", "ct-partly-ignored"])
def test_unsupported_configs_are_refused(qc, match):
    with pytest.raises(QuantCheckpointError, match=match):
        detect_quant_format({"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": qc})


def test_published_configs_are_recognised():
    assert detect_quant_format({}) is None
    assert detect_quant_format({"quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128]}}) == ExpertFormat("fp8")                      # DeepSeek-V3 / Qwen3-FP8
    assert detect_quant_format({"quantization_config": {
        "bits": 4, "group_size": 64, "desc_act": False, "sym": True, "quant_method": "gptq"}}).label == "int4-g64"
    assert detect_quant_format({"quantization_config": {"quant_method": "mxfp4"}}).label == "mxfp4"
    assert detect_quant_format({"quantization_config": {"quant_method": "modelopt", "quantization": {
        "quant_algo": "NVFP4", "group_size": 16}}}).label == "nvfp4"
    assert detect_quant_format({"quantization_config": {                                # experts left in bf16
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*experts.*"],
        "config_groups": {"a": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}}).label == "bf16"


def test_act_order_gptq_is_refused_naming_the_tensor(ckpts, tmp_path):
    d = _copy(ckpts("gptq", 64), tmp_path)                         # K = 128: two groups of 64
    name = "model.layers.0.mlp.experts.1.up_proj.g_idx"
    _edit_tensors(d, lambda s: s.update({name: s[name].flip(0).contiguous()}) if name in s else None)
    with pytest.raises(QuantCheckpointError, match=r"model-00001-of-00002.safetensors: model.layers.0.mlp.experts"
                                                   r".1.up_proj.g_idx is not in input order.*act-order"):
        _fill(_source(d))


def test_scales_of_the_wrong_shape_name_file_and_tensor(ckpts, tmp_path):
    d = _copy(ckpts("fp8"), tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    _edit_tensors(d, lambda s: s.update({name: s[name][:1].contiguous()}) if name in s else None)
    with pytest.raises(QuantCheckpointError, match=r"model-00002-of-00002.safetensors: model.layers.1.mlp.experts."
                                                   r"3.down_proj.weight_scale_inv has shape \(1, 1\), expected \(2, 1\)"):
        _fill(_source(d), layer=1)


def test_an_expert_with_another_group_size_is_refused(ckpts, tmp_path):
    d = _copy(ckpts("ct-int4"), tmp_path)
    name = "model.layers.0.mlp.experts.2.gate_proj.weight_scale"
    _edit_tensors(d, lambda s: s.update({name: s[name].repeat(1, 2).contiguous()}) if name in s else None)
    with pytest.raises(QuantCheckpointError, match=r"experts.2.gate_proj.weight_scale has shape.*scales for group "
                                                   r"size 64, the config says 128: a checkpoint mixing group sizes"):
        _fill(_source(d))


def test_an_unquantized_expert_in_a_quantized_checkpoint_is_refused(ckpts, tmp_path):
    d = _copy(ckpts("ct-nvfp4"), tmp_path)
    p = "model.layers.0.mlp.experts.1.down_proj."

    def unquantize(s):
        if p + "weight_packed" in s:
            for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):
                s.pop(p + suffix)
            s[p + "weight"] = torch.zeros(128, 48)
    _edit_tensors(d, unquantize)
    import os
    os.remove(d / "model.safetensors.index.json")      # the index would still name the removed tensors
    with pytest.raises(QuantCheckpointError, match=r"experts.1.down_proj.\* is unquantized.*mixing formats"):
        _fill(_source(d))


def test_group_size_that_does_not_divide_and_format_mismatch(ckpts, tmp_path):
    d = _copy(ckpts("gptq", 64), tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"]["group_size"] = 128                 # I = 64
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(FormatError, match=r"group size 128 does not divide the intermediate size 64"):
        _source(d)
    with pytest.raises(QuantCheckpointError, match=r"stores its experts as fp8.*not nvfp4"):
        _source(ckpts("fp8").path, ExpertFormat("nvfp4"))


def test_fp8_weights_without_scales_are_refused(ckpts, tmp_path):
    d = _copy(ckpts("fp8"), tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    _edit_tensors(d, lambda s: s.pop(name, None))
    import os
    os.remove(d / "model.safetensors.index.json")
    with pytest.raises(QuantCheckpointError, match=r"q_proj.weight is float8_e4m3fn with no scales"):
        dequantize_dense(CheckpointReader(d), "model.layers.0.self_attn.q_proj.weight")


def test_mxfp4_biases_and_wrong_block_shapes_are_refused(ckpts, tmp_path):
    d = _copy(ckpts("mxfp4"), tmp_path)
    _edit_tensors(d, lambda s: s.update({"model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(4, 128)})
                  if "model.layers.0.mlp.experts.gate_up_proj_blocks" in s else None)
    os_index = d / "model.safetensors.index.json"
    os_index.unlink()
    with pytest.raises(QuantCheckpointError, match=r"gate_up_proj_bias: expert biases"):
        _fill(_source(d))
    d2 = _copy(ckpts("mxfp4"), tmp_path / "b")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    _edit_tensors(d2, lambda s: s.update({name: s[name][:, :, :1].contiguous()}) if name in s else None)
    with pytest.raises(CheckpointError, match=r"down_proj_scales.*has shape \(4, 128, 1\).*implies \(4, 128, 2\)"):
        _fill(_source(d2), layer=1)


def test_gptq_v1_zero_point_wraps_to_sixteen():
    """v1 stores zero - 1: a group whose zero is 0 is stored as 15 and decodes (as GPTQ does) to 16."""
    rows, k, g = 8, 32, 32
    q = torch.randint(0, 16, (k, rows))
    qweight = (q.view(k // 8, 8, rows).long() << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    qweight = (qweight - ((qweight >> 31) & 1) * (1 << 32)).to(torch.int32)
    word = sum(n << (4 * i) for i, n in enumerate([15, 0, 15, 0, 3, 7, 15, 1]))     # stored zero - 1
    qzeros = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    scales = torch.rand(1, rows).half() + 0.5
    t = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": torch.zeros(k, dtype=torch.int32)}
    m = gptq_matrix(qweight, qzeros, scales, t["g_idx"], g, True, "test: ")
    assert 16 in m.zeros.unique().tolist()
    assert torch.equal(dequantize_matrix(m, ExpertFormat("int4", g), rows, k), gptq_reference(t, v1=True))
