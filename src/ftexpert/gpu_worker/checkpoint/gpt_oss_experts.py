"""gpt-oss's experts as checkpoints store them, into the packed expert rows (gpu_worker/checkpoint/expert_layout.py).

- unquantized (what transformers saves): ``mlp.experts.gate_up_proj`` [E, H, 2I] (x @ W; gate and up columns
  interleaved: gate j is column 2j, up j column 2j + 1, as GptOssExperts._apply_gate reads them),
  ``gate_up_proj_bias`` [E, 2I] (interleaved the same way), ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H];
- MXFP4 (the hub's): ``gate_up_proj_blocks`` / ``_scales`` (rows interleaved; quant_checkpoint.py reads them) with
  the same two biases, in the checkpoint's dtype.

A row holds gate [I, H], up [I, H], down [H, I] in the [out, in] order, then the biases (gate's, up's, down's).
"""
from __future__ import annotations

import torch

from ftexpert.proto.expert_format import ExpertFormat
from ftexpert.kernels.expert_reference import quantize_matrix

from ftexpert.gpu_worker.checkpoint.reader import CheckpointError, CheckpointReader
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, bias_views, expert_views
from ftexpert.gpu_worker.checkpoint.weight_names import gpt_oss_expert_names


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] interleaved (gate, up, gate, up, ...) -> [..., 2I] gate's I then up's I."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def fill_gpt_oss_biases(reader: CheckpointReader, layer: int, num_experts: int, layout: ExpertLayout,
                        out: torch.Tensor) -> None:
    """The experts' biases of ``layer`` into the bias tails of rows ``out`` [E, N] (host)."""
    E, H, I = num_experts, layout.hidden_size, layout.intermediate_size
    _, gub, _, db = gpt_oss_expert_names(layer)
    for name in (gub, db):
        if not reader.has(name):
            raise CheckpointError(f"{reader.model_dir}: {name} is missing: gpt-oss experts have biases "
                                  f"(gate_up_proj_bias [E, 2I], down_proj_bias [E, H]); the checkpoint is incomplete")
    b13, b2 = bias_views(out, layout)
    b13.copy_(deinterleave(reader.get(gub, (E, 2 * I))))
    b2.copy_(reader.get(db, (E, H)))


def fill_gpt_oss_layer(reader: CheckpointReader, layer: int, num_experts: int, layout: ExpertLayout,
                       out: torch.Tensor) -> None:
    """Layer ``layer``'s unquantized experts (transformers' layout) into rows ``out`` [E, N] (host, float)."""
    E, H, I = num_experts, layout.hidden_size, layout.intermediate_size
    gu, _, down, _ = gpt_oss_expert_names(layer)
    if not reader.has(gu):
        blocks = reader.has(gu + "_blocks")
        raise CheckpointError(
            f"{reader.model_dir}: {gu} is missing" + (
                ": the experts are MXFP4 (_blocks / _scales) but config.json has no quantization_config "
                "(quant_method mxfp4); restore it" if blocks else
                "; gpt-oss experts are read as transformers saves them (mlp.experts.gate_up_proj [E, H, 2I], "
                "down_proj [E, I, H], with biases) or as the hub stores them (MXFP4 _blocks / _scales)"))
    w_gu = reader.get(gu, (E, H, 2 * I))
    w_down = reader.get(down, (E, I, H))
    for e in range(E):
        gate, up, d = expert_views(out[e], layout)
        gate.copy_(w_gu[e, :, 0::2].t())
        up.copy_(w_gu[e, :, 1::2].t())
        d.copy_(w_down[e].t())
    fill_gpt_oss_biases(reader, layer, num_experts, layout, out)


def interleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate's I then up's I -> [..., 2I] interleaved (the inverse of `deinterleave`)."""
    inter = t.shape[-1] // 2
    return torch.stack((t[..., :inter], t[..., inter:]), dim=-1).flatten(-2)


def gpt_oss_expert_state(layer: int, packed: torch.Tensor, layout: ExpertLayout, mxfp4: bool = False
                         ) -> dict[str, torch.Tensor]:
    """One layer's float expert rows [E, N] under gpt-oss's checkpoint names: transformers' unquantized layout, or
    (``mxfp4``) the hub's ``_blocks`` / ``_scales`` (kernels.expert_reference's round to nearest), biases either way."""
    E, H, I = packed.shape[0], layout.hidden_size, layout.intermediate_size
    gu, gub, down, db = gpt_oss_expert_names(layer)
    b13, b2 = bias_views(packed, layout)
    state = {gub: interleave(b13).contiguous(), db: b2.contiguous()}
    views = [expert_views(packed[e], layout) for e in range(E)]
    if not mxfp4:
        state[gu] = torch.stack([interleave(torch.cat((g, u)).t()) for g, u, _ in views])    # [E, H, 2I]
        state[down] = torch.stack([d.t() for _, _, d in views]).contiguous()                # [E, I, H]
        return state
    fmt = ExpertFormat.parse("mxfp4")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("gb", "gs", "db", "ds")}
    for g, u, d in views:
        rows = torch.stack((g, u), dim=1).reshape(2 * I, H).float()     # rows interleaved: gate j, up j
        q = quantize_matrix(rows, fmt)
        parts["gb"].append(q.codes.reshape(2 * I, H // 32, 16))
        parts["gs"].append(q.scales.reshape(2 * I, H // 32))
        q = quantize_matrix(d.float(), fmt)
        parts["db"].append(q.codes.reshape(H, I // 32, 16))
        parts["ds"].append(q.scales.reshape(H, I // 32))
    state.update({gu + "_blocks": torch.stack(parts["gb"]), gu + "_scales": torch.stack(parts["gs"]),
                  down + "_blocks": torch.stack(parts["db"]), down + "_scales": torch.stack(parts["ds"])})
    return state


MXFP4_QUANTIZATION = {"quant_method": "mxfp4",
                      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"]}
