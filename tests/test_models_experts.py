"""The expert seam: packed layout, the two ResidentExperts compute paths, expert sources, backends."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.models import (ExpertLayout, RandomExpertSource, ResidentExperts,
                               make_expert_backend, pack_experts, unpack_experts)
from gpu_worker.models.checkpoint import CheckpointReader
from gpu_worker.models.config import MoeConfig
from gpu_worker.models.expert_layout import expert_views
from gpu_worker.models.expert_sources import CheckpointExpertSource
from gpu_worker.models.resident_experts import gathered_expert_ffn, grouped_expert_ffn
from test_models_util import hf_model, rel_err, save_hf

E, H, I = 8, 64, 32


def random_experts(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
            (torch.randn(E, H, I, generator=g) * 0.1).to(dtype))


def naive_moe(x, ids, weights, w13, w2):
    """The definition, token by token: sum_k w_k * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = w13[e, :I].double(), w13[e, I:].double()
            h = F.silu(gate @ x[t].double()) * (up @ x[t].double())
            out[t] += float(weights[t, k]) * (w2[e].double() @ h)
    return out


def test_packed_layout_is_gate_up_down_bytes_of_each_expert_in_a_row():
    w13, w2 = random_experts()
    packed = pack_experts(w13, w2)
    layout = ExpertLayout(H, I, torch.float32)
    assert packed.shape == (E, layout.expert_numel) and packed.is_contiguous()
    assert layout.expert_nbytes == (3 * I * H) * 4
    for e in range(E):
        assert torch.equal(packed[e], torch.cat([w13[e, :I].flatten(), w13[e, I:].flatten(), w2[e].flatten()]))
        gate, up, down = expert_views(packed[e], layout)
        assert torch.equal(gate, w13[e, :I]) and torch.equal(up, w13[e, I:]) and torch.equal(down, w2[e])
    v13, v2 = unpack_experts(packed, layout)
    assert torch.equal(v13, w13) and torch.equal(v2, w2)
    assert v13.data_ptr() == packed.data_ptr()                     # views, not copies
    with pytest.raises(ValueError, match="expert_numel|expected"):
        unpack_experts(packed[:, 1:], layout)


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("ffn", [grouped_expert_ffn, gathered_expert_ffn], ids=["grouped", "gather"])
def test_expert_ffn_paths_match_the_definition(ffn, num_tokens):
    w13, w2 = random_experts(seed=num_tokens)
    g = torch.Generator().manual_seed(99)
    x = torch.randn(num_tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(num_tokens)])   # [T, 2]
    weights = torch.rand(num_tokens, 2, generator=g)
    got = ffn(x, ids, weights, w13, w2)
    expected = naive_moe(x, ids, weights, w13, w2)
    assert got.dtype == x.dtype and got.shape == (num_tokens, H)
    assert rel_err(got, expected) < 1e-5


def test_resident_experts_modes_agree_in_bfloat16():
    w13, w2 = random_experts(torch.bfloat16, seed=4)
    packed = [pack_experts(w13, w2)]
    layout = ExpertLayout(H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
    outs = {m: ResidentExperts(packed, layout, mode=m).forward(0, x, ids, weights) for m in ("grouped", "gather")}
    expected = naive_moe(x.float(), ids, weights, w13.float(), w2.float())
    for mode, out in outs.items():
        assert out.dtype == torch.bfloat16
        assert rel_err(out, expected) < 1e-2, mode      # bf16 rounding of h and of the output
    with pytest.raises(ValueError, match="not one of"):
        ResidentExperts(packed, layout, mode="fast")


def test_checkpoint_source_fills_hub_and_fused_layouts_identically(tmp_path):
    hf = hf_model("qwen3", seed=3)
    sources = {}
    for fmt in ("hub", "fused"):
        d = save_hf(hf, tmp_path / fmt, fmt=fmt)
        cfg = MoeConfig.from_dir(d)
        sources[fmt] = CheckpointExpertSource(CheckpointReader(d), cfg, torch.float32)
        assert sources[fmt].layer_format(0) == fmt
    ref_w13 = hf.model.layers[1].mlp.experts.gate_up_proj.detach()       # transformers' own [E, 2I, H]
    ref_w2 = hf.model.layers[1].mlp.experts.down_proj.detach()           # [E, H, I]
    for fmt, src in sources.items():
        out = src.layout.empty_layer(src.num_experts)
        src.fill_layer(1, out)
        w13, w2 = unpack_experts(out, src.layout)
        assert torch.equal(w13, ref_w13) and torch.equal(w2, ref_w2), fmt


def test_sources_fill_a_padded_row_view_in_place(tmp_path):
    """The shared-memory store pads each expert to 4 KiB; sources write straight into such a view."""
    hf = hf_model("olmoe", seed=6)
    d = save_hf(hf, tmp_path / "o")
    src = CheckpointExpertSource(CheckpointReader(d), MoeConfig.from_dir(d), torch.float32)
    n = src.layout.expert_numel
    backing = torch.full((E, n + 1024 // 4), -7.0)                       # row stride padded by 1 KiB
    view = backing[:, :n]
    src.fill_layer(0, view)
    w13, w2 = unpack_experts(view, src.layout)
    assert torch.equal(w13, hf.model.layers[0].mlp.experts.gate_up_proj.detach())
    assert torch.equal(w2, hf.model.layers[0].mlp.experts.down_proj.detach())
    assert torch.all(backing[:, n:] == -7.0)                             # padding untouched
    x, ids, weights = torch.randn(3, H), torch.tensor([[0, 5], [7, 1], [5, 2]]), torch.full((3, 2), 0.5)
    for mode in ("grouped", "gather"):
        out = ResidentExperts([view], src.layout, mode=mode).forward(0, x, ids, weights)
        assert rel_err(out, naive_moe(x, ids, weights, w13, w2)) < 1e-5, mode


def test_random_source_is_seeded_per_layer_and_order_independent():
    cfg = MoeConfig(arch="qwen3", vocab_size=32, hidden_size=H, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, num_experts=E, top_k=2, expert_intermediate_size=I, rms_norm_eps=1e-6,
                    rope_theta=1e4, max_position_embeddings=64)
    src = RandomExpertSource(cfg, torch.float32, seed=7, std=0.02)
    layers = []
    for layer in (2, 0, 1):
        out = src.layout.empty_layer(E)
        src.fill_layer(layer, out)
        layers.append(out)
    again = src.layout.empty_layer(E)
    src.fill_layer(2, again)
    assert torch.equal(layers[0], again)
    assert not torch.equal(layers[0], layers[1])
    other_seed = RandomExpertSource(cfg, torch.float32, seed=8, std=0.02)
    out = other_seed.layout.empty_layer(E)
    other_seed.fill_layer(2, out)
    assert not torch.equal(out, again)
    assert 0.015 < again.std().item() < 0.025


def test_backend_factory_resident_and_offload():
    cfg = MoeConfig(arch="mixtral", vocab_size=32, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, num_experts=E, top_k=2, expert_intermediate_size=I, rms_norm_eps=1e-5,
                    rope_theta=1e6, max_position_embeddings=64)
    src = RandomExpertSource(cfg, torch.float32, seed=1, std=0.02)
    backend = make_expert_backend("resident", src, "cpu")
    assert isinstance(backend, ResidentExperts) and backend.num_layers == 2 and backend.num_experts == E
    assert backend.nbytes == 2 * E * src.layout.expert_nbytes
    offload = make_expert_backend("offload", src, "cpu", cache_size=E + 1)
    try:
        assert offload.cache.num_slots == E + 1 and offload.num_layers == 2
    finally:
        offload.close()
    with pytest.raises(ValueError, match=f"at least {E} slots"):
        make_expert_backend("offload", src, "cpu", cache_size=E - 1)
    with pytest.raises(ValueError, match="not one of"):
        make_expert_backend("magic", src, "cpu")
