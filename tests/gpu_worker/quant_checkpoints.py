"""Tiny Qwen3-MoE checkpoints in each published quantized on-disk format, and their references.

`write_quant_checkpoint(path, kind)` -> `QuantCheckpoint`: the directory, and the format's OWN float32
dequantization of every weight (hub names), which is what a correct reader must reproduce bit for bit:
- compressed-tensors ``pack-quantized`` / ``nvfp4-pack-quantized``: written AND dequantized by the
  ``compressed-tensors`` library (its compressors, scales from its ``calculate_qparams``);
- FP8 block: dequantized by transformers' ``finegrained_fp8`` (DeepSeek-V3's ``x.float() * s``);
- MXFP4 (gpt-oss layout, experts fused with gate/up rows interleaved): by transformers'
  ``convert_moe_packed_tensors``;
- GPTQ and ModelOpt NVFP4 (no CPU library installable here): by the published dequantization
  (GPTQModel's unpack with ``g_idx`` gather, ``zeros + 1`` for v1; ModelOpt's ``NVFP4QTensor``),
  written here independently of the reader under test.
Attention projections are quantized too (except for mxfp4, as gpt-oss), so dense dequantization is
exercised; routers, norms, embeddings and lm_head stay float32. `reference_model(ckpt)` is the
transformers model running the dequantized weights (the reference logits). Reusable after the
loader integration: ``ft generate`` on ``ckpt.path`` must match ``reference_model(ckpt)``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from ftexpert.kernels.expert_reference import fp4_decode, fp4_encode
from tests.gpu_worker.test_models_util import hf_model

KINDS = ("fp8", "gptq", "gptq-v2-asym", "ct-int4", "ct-int4-asym", "mxfp4", "modelopt-nvfp4", "ct-nvfp4")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class QuantCheckpoint:
    path: Path
    kind: str
    config: dict                                  # config.json as written
    dequantized: dict[str, torch.Tensor]          # hub name -> the format's own float32 dequantization
    shape_kw: dict = field(default_factory=dict)  # hf_model overrides that make this shape


def shape_for(kind: str, group: int = 128) -> dict:
    """Tiny shapes each format accepts: fp8 has partial 128-blocks, int4 G | H and I, fp4 several groups."""
    base = dict(num_experts=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    if kind == "fp8":
        return base | dict(hidden_size=192, moe_intermediate_size=80)
    if kind in ("gptq", "gptq-v2-asym", "ct-int4", "ct-int4-asym"):
        return base | dict(hidden_size=128, moe_intermediate_size=max(group, 32))
    if kind == "mxfp4":
        return base | dict(hidden_size=128, moe_intermediate_size=64)
    return base | dict(hidden_size=128, moe_intermediate_size=48)


def hub_state(model) -> dict[str, torch.Tensor]:
    """transformers' fused Qwen3-MoE experts -> the hub's per-expert names."""
    state, out = model.state_dict(), {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{p}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


def reference_model(ckpt: QuantCheckpoint, state: dict[str, torch.Tensor] | None = None):
    """transformers' Qwen3MoeForCausalLM (float32) running ``state`` (default: the reference weights)."""
    model = hf_model("qwen3", **ckpt.shape_kw)
    load_hub_state(model, state if state is not None else ckpt.dequantized)
    return model


def load_hub_state(model, hub: dict[str, torch.Tensor]) -> None:
    fused = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, n = name[: -len("gate_up_proj")], model.config.num_experts
            fused[name] = torch.stack([torch.cat([hub[f"{p}{e}.gate_proj.weight"], hub[f"{p}{e}.up_proj.weight"]])
                                       for e in range(n)])
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            fused[name] = torch.stack([hub[f"{p}{e}.down_proj.weight"] for e in range(model.config.num_experts)])
        else:
            fused[name] = hub[name]
    model.load_state_dict(fused, strict=True)


def _quantized_names(state: dict[str, torch.Tensor], kind: str) -> list[str]:
    names = [n for n in state if ".experts." in n]
    if kind != "mxfp4":
        names += [n for n in state if any(f"self_attn.{a}." in n for a in ATTN)]
    return names


# -- FP8 block (DeepSeek-V3 weight_quant / weight_dequant) ----------------------------------------------
def _fp8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, k = w.shape
    sr, sc = -(-rows // 128), -(-k // 128)
    pad = torch.zeros(sr * 128, sc * 128)
    pad[:rows, :k] = w
    blocks = pad.view(sr, 128, sc, 128)
    s = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).view(sr * 128, sc * 128)[:rows, :k]
    return {"weight": q.contiguous(), "weight_scale_inv": s.contiguous()}


def _fp8_ref(t: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    return _dequantize_fp8_weight(t["weight"], t["weight_scale_inv"], [128, 128], torch.float32)


# -- GPTQ (RTN with GPTQ's packing; v1 stores zero - 1) --------------------------------------------------
def _pack_rows_int32(u: torch.Tensor) -> torch.Tensor:
    """[n, m] values 0..15 -> [n/8, m] int32: row i in word row i // 8 at bits 4 * (i % 8)."""
    n, m = u.shape
    words = (u.long().view(n // 8, 8, m) << (4 * torch.arange(8)).view(1, 8, 1)).sum(1)
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)   # two's complement int32


def _gptq(w: torch.Tensor, group: int, sym: bool, v1: bool) -> dict[str, torch.Tensor]:
    rows, k = w.shape
    g = w.view(rows, k // group, group)
    if sym:
        amax = g.abs().amax(-1)
        scale = (2 * amax / 15).to(torch.float16)
        zero = torch.full_like(amax, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(torch.float16)
        zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long().view(rows, k)
    stored_zero = (zero - 1) & 0xF if v1 else zero                      # [rows, K/G]
    return {"qweight": _pack_rows_int32(q.t().contiguous()),            # [K/8, rows]
            "qzeros": _pack_rows_int32(stored_zero.contiguous()).t().contiguous(),   # [K/G, rows/8]
            "scales": scale.t().contiguous(),                           # [K/G, rows]
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def gptq_reference(t: dict[str, torch.Tensor], v1: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GPTQModel's torch dequantize_weight: unpack with shifts, zeros (+1 for v1), gather by g_idx."""
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, 8), wf.view(1, 1, 8)) & 15
    zeros = zeros.reshape(t["scales"].shape) + (1 if v1 else 0)
    weight = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, 8, -1), wf.view(1, 8, 1)) & 15
    weight = weight.reshape(-1, weight.shape[-1])                       # [K, rows]
    g = t["g_idx"].long()
    out = t["scales"].to(dtype)[g] * (weight - zeros[g]).to(dtype)
    return out.t().contiguous()


# -- compressed-tensors (the library writes and reads) ---------------------------------------------------
def _ct_args(kind: str, group: int):
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
    if kind == "ct-nvfp4":
        return preset_name_to_scheme("NVFP4A16", ["Linear"])
    from compressed_tensors.quantization import QuantizationScheme
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group,
                            symmetric=kind == "ct-int4")
    return QuantizationScheme(targets=["Linear"], weights=args)


def _ct(w: torch.Tensor, scheme, pow2_global: bool = False) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import NVFP4PackedCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    a = scheme.weights
    g = w.view(w.shape[0], -1, a.group_size)
    if a.type == "float":
        gs = generate_gparam(w.min(), w.max())
        if pow2_global:
            gs = torch.exp2(torch.floor(torch.log2(gs)))
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), a, global_scale=gs)
        return dict(NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs},
                                                   scheme))
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), a)
    state = {"weight": w, "weight_scale": scale.to(torch.bfloat16)}    # scales in the model dtype, as published
    if not a.symmetric:
        state["weight_zero_point"] = zp
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def ct_reference(t: dict[str, torch.Tensor], scheme, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The library's own decompression, with float32 scales (or ``dtype`` = the checkpoint's)."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    if scheme.weights.type == "float":
        m, n = t["weight_packed"].shape
        x = unpack_fp4_from_uint8(t["weight_packed"], m, n * 2, dtype=torch.float32)
        return dequantize(x_q=x, scale=t["weight_scale"].to(torch.float32), args=scheme.weights,
                          global_scale=t["weight_global_scale"], dtype=torch.float32)
    state = dict(t)
    state["weight_scale"] = state["weight_scale"].to(dtype)
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


# -- ModelOpt NVFP4 (NVFP4QTensor: scale_2 = amax / (6 * 448), packed = q[1::2] << 4 | q[0::2]) -------------
def _modelopt(w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale_2 = (w.abs().max() / (6.0 * 448.0)).float()
    g = w.view(w.shape[0], -1, 16)
    s = (g.abs().amax(-1) / (6.0 * scale_2)).clamp(min=2 ** -9).to(torch.float8_e4m3fn)
    q = fp4_encode(g / (s.float() * scale_2)[..., None]).view(w.shape)
    return {"weight": (q[:, 1::2] << 4) | q[:, 0::2], "weight_scale": s, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(1.0)}


def modelopt_reference(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """NVFP4QTensor.dequantize: e2m1 lut of (low, high) nibbles * (float(weight_scale) * weight_scale_2)."""
    packed = t["weight"]
    un = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long)
    un[:, 1::2], un[:, 0::2] = packed >> 4, packed & 0x0F
    vals = fp4_decode(un)
    per_block = t["weight_scale"].to(torch.float32) * t["weight_scale_2"]
    return (vals.view(vals.shape[0], -1, 16) * per_block.unsqueeze(-1)).view(vals.shape)


# -- MXFP4, gpt-oss layout ----------------------------------------------------------------------------------
def _mxfp4_matrix(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization -> (codes [rows, K] nibbles, scales [rows, K/32] E8M0 bytes)."""
    g = w.view(w.shape[0], -1, 32)
    amax = g.abs().amax(-1)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    codes = fp4_encode(g / torch.exp2(exp)[..., None]).view(w.shape)
    return codes, (exp + 127).to(torch.uint8)


def _mxfp4_layer(hub: dict[str, torch.Tensor], prefix: str, n: int) -> dict[str, torch.Tensor]:
    gate_up_b, gate_up_s, down_b, down_s = [], [], [], []
    for e in range(n):
        gc, gs = _mxfp4_matrix(hub[f"{prefix}{e}.gate_proj.weight"])
        uc, us = _mxfp4_matrix(hub[f"{prefix}{e}.up_proj.weight"])
        codes = torch.stack([gc, uc], dim=1).reshape(-1, gc.shape[1])     # rows interleaved: gate, up, ...
        scales = torch.stack([gs, us], dim=1).reshape(-1, gs.shape[1])
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
        gate_up_b.append(packed.view(codes.shape[0], -1, 16))
        gate_up_s.append(scales)
        dc, ds = _mxfp4_matrix(hub[f"{prefix}{e}.down_proj.weight"])
        down_b.append((dc[:, 0::2] | (dc[:, 1::2] << 4)).view(dc.shape[0], -1, 16))
        down_s.append(ds)
    return {f"{prefix}gate_up_proj_blocks": torch.stack(gate_up_b), f"{prefix}gate_up_proj_scales": torch.stack(gate_up_s),
            f"{prefix}down_proj_blocks": torch.stack(down_b), f"{prefix}down_proj_scales": torch.stack(down_s)}


def mxfp4_reference(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """transformers' convert_moe_packed_tensors (float32) -> per-expert hub weights (gate = cols ::2)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gu = convert_moe_packed_tensors(tensors[f"{prefix}gate_up_proj_blocks"], tensors[f"{prefix}gate_up_proj_scales"],
                                    dtype=torch.float32)                # [E, H, 2I] (in x out)
    dn = convert_moe_packed_tensors(tensors[f"{prefix}down_proj_blocks"], tensors[f"{prefix}down_proj_scales"],
                                    dtype=torch.float32)                # [E, I, H]
    out = {}
    for e in range(gu.shape[0]):
        out[f"{prefix}{e}.gate_proj.weight"] = gu[e, :, 0::2].t().contiguous()
        out[f"{prefix}{e}.up_proj.weight"] = gu[e, :, 1::2].t().contiguous()
        out[f"{prefix}{e}.down_proj.weight"] = dn[e].t().contiguous()
    return out


# -- the writer ---------------------------------------------------------------------------------------------
def quantization_config(kind: str, group: int) -> dict:
    if kind == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if kind in ("gptq", "gptq-v2-asym"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": kind == "gptq",
                "checkpoint_format": "gptq" if kind == "gptq" else "gptq_v2", "damp_percent": 0.01}
    if kind == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.gate",
                                                                    "model.embed_tokens", "lm_head"]}
    if kind == "modelopt-nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    from compressed_tensors.quantization import QuantizationConfig
    fmt = "nvfp4-pack-quantized" if kind == "ct-nvfp4" else "pack-quantized"
    cfg = QuantizationConfig(config_groups={"group_0": _ct_args(kind, group)}, format=fmt,
                             ignore=["lm_head", "re:.*mlp.gate$"], quantization_status="compressed")
    return cfg.model_dump(mode="json")


def write_quant_checkpoint(path: str | Path, kind: str, group: int = 128, seed: int = 0,
                           pow2_global: bool = False) -> QuantCheckpoint:
    """A 2-layer, 4-expert Qwen3-MoE checkpoint in ``kind`` (one of KINDS), layer 1's experts in a second shard."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shape_kw = shape_for(kind, group)
    model = hf_model("qwen3", seed=seed, **shape_kw)
    hub = hub_state(model)
    tensors, deq = {}, dict(hub)
    if kind == "mxfp4":
        for layer in range(model.config.num_hidden_layers):
            prefix = f"model.layers.{layer}.mlp.experts."
            packed = _mxfp4_layer(hub, prefix, model.config.num_experts)
            tensors.update(packed)
            deq.update(mxfp4_reference(packed, prefix))
        tensors.update({n: t for n, t in hub.items() if ".experts." not in n})
    else:
        quantized = set(_quantized_names(hub, kind))
        for name, w in hub.items():
            if name not in quantized:
                tensors[name] = w
                continue
            prefix = name[: -len("weight")]
            if kind == "fp8":
                t = _fp8(w)
                ref = _fp8_ref(t)
            elif kind in ("gptq", "gptq-v2-asym"):
                t = _gptq(w, group, sym=kind == "gptq", v1=kind == "gptq")
                ref = gptq_reference(t, v1=kind == "gptq")
            elif kind == "modelopt-nvfp4":
                t = _modelopt(w)
                ref = modelopt_reference(t)
            else:
                scheme = _ct_args(kind, group)
                t = _ct(w, scheme, pow2_global)
                ref = ct_reference(t, scheme)
            tensors.update({prefix + s: v for s, v in t.items()})
            deq[name] = ref.float()
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["quantization_config"] = quantization_config(kind, group)
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    shard2 = {n for n in tensors if n.startswith("model.layers.1.mlp.experts.")}
    files = {"model-00001-of-00002.safetensors": {n: tensors[n] for n in tensors if n not in shard2},
             "model-00002-of-00002.safetensors": {n: tensors[n] for n in shard2}}
    weight_map = {}
    for fname, part in files.items():
        save_file({n: t.contiguous() for n, t in part.items()}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return QuantCheckpoint(path, kind, config, deq, shape_kw)
