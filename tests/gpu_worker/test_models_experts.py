"""The expert seam: packed layout, the two ResidentExperts compute paths, expert sources, backends."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, pack_experts, unpack_experts

from ftexpert.gpu_worker.checkpoint.expert_sources import RandomExpertSource

from ftexpert.gpu_worker.backends.resident import ResidentExperts

from ftexpert.gpu_worker.assembly.backends import make_expert_backend
from ftexpert.gpu_worker.checkpoint.reader import CheckpointReader
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.checkpoint.expert_layout import expert_views
from ftexpert.gpu_worker.checkpoint.expert_sources import CheckpointExpertSource
import ftexpert.gpu_worker.backends.expert_compute as expert_compute
from ftexpert.gpu_worker.backends.expert_compute import (gemv_expert_ffn, group_ends, grouped_expert_ffn,
                                                      grouped_loop_expert_ffn, grouped_mm_applies,
                                                      grouped_mm_expert_ffn)
from tests.gpu_worker.test_models_util import hf_model, rel_err, save_hf

E, H, I = 8, 64, 32


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs torch._grouped_mm on the CPU (2.13 does; older ones may lack it)."""
    try:
        torch._grouped_mm(torch.zeros(2, 8), torch.zeros(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


needs_cpu_grouped_mm = pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no CPU torch._grouped_mm")


def random_experts(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype),
            (torch.randn(E, H, I, generator=g) * 0.1).to(dtype))


def naive_moe(x, ids, weights, w13, w2):
    """The definition, token by token: sum_k w_k * down(silu(gate x) * up x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = w13[e, :inter].double(), w13[e, inter:].double()
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
@pytest.mark.parametrize("ffn", [grouped_expert_ffn, grouped_loop_expert_ffn,
                                 pytest.param(grouped_mm_expert_ffn, marks=needs_cpu_grouped_mm), gemv_expert_ffn],
                         ids=["grouped", "grouped-loop", "grouped-mm", "gemv"])
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


@needs_cpu_grouped_mm
@pytest.mark.parametrize("max_groups", [1023, 16, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_rounds_like_the_loop_over_packed_slot_views(dtype, max_groups, monkeypatch):
    """The one-launch grouped path on the backends' operands: w13 / w2 strided views of a packed [S, N] pool
    (offload and hybrid pass slot ids into a pool larger than the routed set: most groups are empty), a route
    at weight 0 (the hybrid's CPU routes read slot 0 with weight 0). Same rounding points as the per-expert
    loop: equal up to the GEMMs' accumulation order (fp32: ~1e-6; bf16: a last bit of the x.dtype results).
    With fewer groups a call may take than the pool has slots (max_groups 16, 7: torch takes at most 1,023), the
    pool goes in windows of groups; 7 leaves windows without a route (slots 35-39 hold none here)."""
    monkeypatch.setattr(expert_compute, "GROUPED_MM_MAX_GROUPS", max_groups)
    slots = 40
    g = torch.Generator().manual_seed(11)
    pool = (torch.randn(slots, 3 * I * H, generator=g) * 0.1).to(dtype)
    w13, w2 = unpack_experts(pool, ExpertLayout(H, I, dtype))
    assert not w13.is_contiguous() and w13.data_ptr() == pool.data_ptr()
    T, K = 23, 4
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(slots - 5, generator=g)[:K] for _ in range(T)])  # [T, K] slot ids < 35
    weights = torch.rand(T, K, generator=g)
    weights[3, 1] = 0.0
    ids[3, 1] = 0
    got = grouped_mm_expert_ffn(x, ids, weights, w13, w2)
    loop = grouped_loop_expert_ffn(x, ids, weights, w13, w2)
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.float32:
        assert rel_err(got, loop) < 1e-5
        assert rel_err(got, naive_moe(x, ids, weights, w13, w2)) < 1e-5
    else:
        assert rel_err(got, loop) < 2e-2 and rel_err(got, naive_moe(x.float(), ids, weights, w13.float(),
                                                                    w2.float())) < 2e-2


def test_the_grouped_mode_takes_grouped_mm_where_it_applies_else_the_loop(monkeypatch):
    """On the CPU grouped_mm_applies is False: the loop; where it applies: torch._grouped_mm."""
    calls = []
    monkeypatch.setattr(expert_compute, "grouped_mm_expert_ffn", lambda *a: calls.append("mm") or a[0])
    monkeypatch.setattr(expert_compute, "grouped_loop_expert_ffn", lambda *a: calls.append("loop") or a[0])
    w13, w2 = random_experts()
    x, ids, weights = torch.randn(2, H), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    assert not grouped_mm_applies(x, w13, w2)
    grouped_expert_ffn(x, ids, weights, w13, w2)
    monkeypatch.setattr(expert_compute, "grouped_mm_applies", lambda *a: True)
    grouped_expert_ffn(x, ids, weights, w13, w2)
    assert calls == ["loop", "mm"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_mm_matches_the_loop_on_a_prefill_sized_call():
    """On the GPU (bf16, qwen3-30b-a3b's expert shape): `auto` takes torch._grouped_mm over a packed slot pool of
    1,536 slots (a 25% cache; more groups than one call takes: windows), and it agrees with the per-expert cuBLAS
    loop to bf16 rounding, and with a float64 definition."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, inter, slots, T, K = 2048, 768, 1536, 256, 8        # more slots than one _grouped_mm call takes groups
    g = torch.Generator(device=dev).manual_seed(3)
    pool = (torch.randn(slots, 3 * inter * h, generator=g, device=dev) * 0.02).to(dtype)
    w13, w2 = unpack_experts(pool, ExpertLayout(h, inter, dtype))
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+")
    x = torch.randn(T, h, generator=g, device=dev).to(dtype)
    ids = torch.stack([torch.randperm(slots, generator=g, device=dev)[:K] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)
    assert grouped_mm_applies(x, w13, w2)
    got = grouped_expert_ffn(x, ids, weights, w13, w2)
    loop = grouped_loop_expert_ffn(x, ids, weights, w13, w2)
    assert rel_err(got, loop) < 1e-2
    sub = slice(0, 8)                                       # the float64 definition on a few tokens (slow)
    used, local = torch.unique(ids[sub], return_inverse=True)          # only their slots travel to the host
    ref = naive_moe(x[sub].cpu().float(), local.cpu(), weights[sub].cpu(), w13[used].cpu().float(),
                    w2[used].cpu().float())
    assert rel_err(got[sub].cpu(), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [64, 1024, 4096])
def test_gpu_grouped_mm_is_bitwise_the_same_over_an_expert_layer_and_a_slot_pool(tokens):
    """What keeps offload's tokens equal to resident's in prefill: the same routes computed over a layer's 128
    experts (resident) and over a 1,536-slot pool holding them at scattered slots (offload at 25%: windows of
    1,023 groups) give bitwise the same output. torch picks _grouped_mm's tiles from rows per group, which
    differ between the two (4 / 64 / 256 rows a group against under 22), so this is checked, not assumed."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+")
    h, inter, experts, slots, K = 2048, 768, 128, 1536, 8
    g = torch.Generator(device=dev).manual_seed(tokens)
    layer = (torch.randn(experts, 3 * inter * h, generator=g, device=dev) * 0.02).to(dtype)
    where = torch.randperm(slots, generator=g, device=dev)[:experts]           # expert e lives in slot where[e]
    pool = torch.zeros(slots, 3 * inter * h, dtype=dtype, device=dev)
    pool[where] = layer
    x = torch.randn(tokens, h, generator=g, device=dev).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g, device=dev)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=g, device=dev), -1)
    layout = ExpertLayout(h, inter, dtype)
    resident = grouped_mm_expert_ffn(x, ids, weights, *unpack_experts(layer, layout))
    offload = grouped_mm_expert_ffn(x, where[ids], weights, *unpack_experts(pool, layout))
    assert torch.equal(resident, offload)


def test_expert_compute_modes_agree_in_bfloat16():
    w13, w2 = random_experts(torch.bfloat16, seed=4)
    packed = [pack_experts(w13, w2)]
    layout = ExpertLayout(H, I, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 2, generator=g), -1)
    outs = {m: ResidentExperts(packed, layout, mode=m).forward(0, x, ids, weights) for m in ("grouped", "gemv")}
    expected = naive_moe(x.float(), ids, weights, w13.float(), w2.float())
    for mode, out in outs.items():
        assert out.dtype == torch.bfloat16
        assert rel_err(out, expected) < 1e-2, mode      # bf16 rounding of h and of the output
    for retired in ("fast", "gather"):
        with pytest.raises(ValueError, match="not one of auto, grouped, gemv"):
            ResidentExperts(packed, layout, mode=retired)


@pytest.mark.parametrize("ids, groups, ends", [
    ([0, 0, 2, 2, 2, 4], 6, [2, 2, 5, 5, 6, 6]),       # empty groups between and after
    ([3], 4, [0, 0, 0, 1]),
    ([], 3, [0, 0, 0]),
    ([1, 1, 1, 1], 2, [0, 4]),
])
def test_group_ends_are_the_end_rows_of_each_expert_group(ids, groups, ends):
    got = group_ends(torch.tensor(ids, dtype=torch.int64), groups)
    assert got.dtype == torch.int32 and got.tolist() == ends


@pytest.mark.parametrize("groups, pairs", [(8, 64), (128, 128), (128, 3), (1023, 4096)])
def test_group_ends_equal_the_cumulated_counts(groups, pairs):
    g = torch.Generator().manual_seed(groups + pairs)
    ids = (torch.randint(0, groups, (pairs,), generator=g) ** 2) % groups      # skewed: some groups empty
    expected = torch.cumsum(torch.bincount(ids, minlength=groups), 0)
    assert torch.equal(group_ends(torch.sort(ids).values, groups).long(), expected)


def test_graph_safe_takes_the_grouped_mode_only_where_it_is_capturable(monkeypatch):
    """gemv is always capturable; grouped only where every layer's rows take the sync-free path (never on the
    CPU, never for biased experts)."""
    w13, w2 = random_experts(torch.bfloat16, seed=6)
    layout = ExpertLayout(H, I, torch.bfloat16)
    backend = ResidentExperts([pack_experts(w13, w2)], layout, mode="grouped")
    assert not backend.graph_safe(128)                                  # on the CPU: no _grouped_mm capture
    assert ResidentExperts([pack_experts(w13, w2)], layout, mode="gemv").graph_safe(128)
    import ftexpert.gpu_worker.backends.expert_math as expert_math
    monkeypatch.setattr(expert_math, "grouped_capturable", lambda *a: True)
    assert ResidentExperts([pack_experts(w13, w2)], layout, mode="grouped").graph_safe(128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_mode_runs_in_a_cuda_graph_at_a_decode_batch():
    """Batch 16 x top-8 = 128 pairs, above a gemv bound of 32: `auto` takes the grouped mode over a resident layer of
    qwen3-30b-a3b's shape, graph_safe says it can be captured, and a captured call replayed with new routes (spread,
    all on 8 experts) gives bitwise what an eager call gives."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("torch._grouped_mm needs compute capability 9.0+")
    h, inter, experts, T, K = 2048, 768, 128, 16, 8
    g = torch.Generator(device=dev).manual_seed(11)
    layer = (torch.randn(experts, 3 * inter * h, generator=g, device=dev) * 0.02).to(dtype)
    backend = ResidentExperts([layer], ExpertLayout(h, inter, dtype), mode="auto", gather_max_pairs=32)
    assert backend.choose_mode(T * K, dev) == "grouped" and backend.graph_safe(T * K)

    def routes(spread: bool):
        x = torch.randn(T, h, generator=g, device=dev).to(dtype)
        pick = experts if spread else K
        ids = torch.stack([torch.randperm(pick, generator=g, device=dev)[:K] for _ in range(T)])
        return x, ids, torch.softmax(torch.randn(T, K, generator=g, device=dev), -1)

    static = [t.clone() for t in routes(True)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            backend.forward(0, *static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(0, *static)
    for spread in (True, False, True):
        new = routes(spread)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, backend.forward(0, *new))


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
    for mode in ("grouped", "gemv"):
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
    assert backend.nbytes() == 2 * E * src.layout.expert_nbytes
    offload = make_expert_backend("offload", src, "cpu", cache_size=E + 1)
    try:
        assert offload.cache.num_slots == E + 1 and offload.num_layers == 2
        assert offload.nbytes() == (E + 1) * src.layout.expert_nbytes and offload.has_slot_cache
        assert not backend.has_slot_cache and backend.counters() == {}
    finally:
        offload.close()
    with pytest.raises(ValueError, match=f"at least {E} slots"):
        make_expert_backend("offload", src, "cpu", cache_size=E - 1)
    with pytest.raises(ValueError, match="not one of"):
        make_expert_backend("magic", src, "cpu")
