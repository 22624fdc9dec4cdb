"""kernels/moe_decode: each Triton kernel in lockstep with its torch reference, the references against
the model code they replace, and the wiring (ResidentExperts "gemv", the fused MoeModel forward).

Without a GPU the kernels run in the Triton interpreter (conftest.py), which computes bfloat16
wrongly: the lockstep tests use float32 and tiny shapes (with blocks smaller than the defaults, so
that several blocks and ragged edges are exercised). Tests marked `gpu` check bfloat16 on CUDA at
qwen3-30b-a3b shapes and the fused model's greedy tokens against the plain forward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, pack_experts

from ftexpert.gpu_worker.backends.resident import ResidentExperts
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.models.layers import apply_rope, rms_norm as model_rms_norm, route
from ftexpert.gpu_worker.models.model import MoeModel
from ftexpert.gpu_worker.checkpoint.presets import random_model_parts
from ftexpert.gpu_worker.backends.expert_compute import pick_mode
from ftexpert.kernels.moe_decode import (GemvBlocks, KvWrite, add_rms_norm, moe_gemv, qk_norm_rope, rms_norm, rope,
                                route_topk)
from ftexpert.kernels.moe_decode import reference as ref
from tests.conftest import KERNEL_DEVICE, assert_compile_check

DEV = KERNEL_DEVICE
SMALL = GemvBlocks(gate_up_block_n=8, gate_up_block_k=16, down_block_n=16, down_block_k=16,
                   sum_block=32)
EVEN = GemvBlocks(gate_up_block_n=8, gate_up_block_k=32, down_block_n=16, down_block_k=16,
                  sum_block=32)


def gathered_expert_ffn(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """An independent torch reference of the routed FFN: gathers the T*K experts and runs batched GEMVs,
    rounding where moe_gemv rounds (gate/up in x.dtype, silu in x.dtype, the weighted sum over k in fp32).

    x [T, H], topk_ids/topk_weights [T, K], w13 [E, 2I, H], w2 [E, H, I] -> [T, H]
    """
    T, K = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)                                   # [P = T*K]
    xp = x.unsqueeze(1).expand(T, K, x.shape[1]).reshape(T * K, -1, 1)  # [P, H, 1], pair p = t*K + k
    h = torch.bmm(w13.index_select(0, flat_ids), xp).squeeze(2)       # [P, 2I]
    h = (F.silu(h[:, :inter]) * h[:, inter:]).unsqueeze(2)            # [P, I, 1]
    y = torch.bmm(w2.index_select(0, flat_ids), h).squeeze(2)         # [P, H]
    y = y.float() * topk_weights.reshape(-1, 1)                       # [P, H] fp32
    return y.view(T, K, -1).sum(dim=1).to(x.dtype)                    # [T, H]


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def experts(S, H, I, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(S, 2 * I, H, generator=g) * 0.1).to(dtype),
            (torch.randn(S, H, I, generator=g) * 0.1).to(dtype))


def routes(T, K, S, seed, missing=0, repeat=False, dtype=torch.int64):
    """ids [T, K]: distinct experts per token, `missing` of them -1, optionally a repeated id."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    flat = ids.view(-1)
    if repeat and ids.numel() > 1:
        flat[-1] = flat[0]
    if missing:
        flat[torch.randperm(flat.numel(), generator=g)[:missing]] = -1
    return ids.to(dtype), torch.rand(T, K, generator=g)


# -- moe_gemv ------------------------------------------------------------------------------------

GEMV_CASES = {
    # name: (T, K, H, I, S, blocks, missing, repeat, ids dtype)
    "t1-k8-default-blocks": (1, 8, 64, 32, 12, None, 0, False, torch.int64),
    "t2-k2-ragged": (2, 2, 40, 24, 6, SMALL, 0, False, torch.int64),
    "t3-k4-missing-repeat-int32": (3, 4, 40, 24, 8, SMALL, 3, True, torch.int32),
    "t4-k3-even": (4, 3, 64, 32, 9, EVEN, 2, False, torch.int64),
    "t3-k6-missing-repeat": (3, 6, 40, 24, 8, SMALL, 4, True, torch.int64),
    "t4-k8-ragged-missing": (4, 8, 72, 20, 10, SMALL, 9, True, torch.int32),
    "t2-k5-one-token-all-missing": (2, 5, 48, 16, 7, SMALL, 0, False, torch.int64),
}


@pytest.mark.parametrize("case", list(GEMV_CASES))
def test_moe_gemv_lockstep(case):
    T, K, H, I, S, blocks, missing, repeat, id_dtype = GEMV_CASES[case]
    w13, w2 = experts(S, H, I, seed=T * 31 + K)
    ids, weights = routes(T, K, S, seed=T + 7 * K, missing=missing, repeat=repeat, dtype=id_dtype)
    if case == "t2-k5-one-token-all-missing":
        ids[1] = -1
    weights[ids < 0] = float("nan")                       # a missing route's weight is never read
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    expected = ref.moe_gemv_reference(x, ids, weights, w13, w2)
    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), w13.to(DEV), w2.to(DEV), impl="triton",
                   blocks=blocks)
    assert got.dtype == x.dtype and got.shape == (T, H)
    assert torch.isfinite(got).all()
    assert rel_max(got, expected) < 1e-5
    if case == "t2-k5-one-token-all-missing":
        assert torch.equal(got[1].cpu(), torch.zeros(H))


@pytest.mark.parametrize("case", ["t3-k4-missing-repeat-int32", "t1-k8-default-blocks"])
def test_moe_gemv_partials_sum_to_the_call(case):
    """partials=True: the weighted per-route outputs [T, K, H] fp32 (a missing route exactly 0) whose sum in k order
    (reference.sum_routes) is the summed call bit for bit (float32); the reference's likewise."""
    T, K, H, I, S, blocks, missing, repeat, id_dtype = GEMV_CASES[case]
    w13, w2 = experts(S, H, I, seed=T * 31 + K)
    ids, weights = routes(T, K, S, seed=T + 7 * K, missing=missing, repeat=repeat, dtype=id_dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    args = (x.to(DEV), ids.to(DEV), weights.to(DEV), w13.to(DEV), w2.to(DEV))
    parts = moe_gemv(*args, impl="triton", blocks=blocks, partials=True)
    assert parts.shape == (T, K, H) and parts.dtype == torch.float32 and not parts[(ids < 0).to(DEV)].any()
    assert torch.equal(ref.sum_routes(parts, x.dtype), moe_gemv(*args, impl="triton", blocks=blocks))
    ref_parts = ref.moe_gemv_reference(x, ids, weights, w13, w2, partials=True)
    assert torch.equal(ref.sum_routes(ref_parts, x.dtype), ref.moe_gemv_reference(x, ids, weights, w13, w2))
    assert rel_max(parts, ref_parts) < 1e-5


def test_moe_gemv_missing_routes_read_no_weights():
    """-1 routes point before row 0 of a view whose backing row there is NaN: nothing leaks in."""
    S, H, I, T, K = 5, 32, 16, 2, 3
    w13, w2 = experts(S, H, I, seed=3)
    b13 = torch.cat([torch.full((1, 2 * I, H), float("nan")), w13])
    b2 = torch.cat([torch.full((1, H, I), float("nan")), w2])
    ids = torch.tensor([[0, -1, 4], [-1, 2, -1]])
    weights = torch.rand(T, K)
    x = torch.randn(T, H)
    got = moe_gemv(x.to(DEV), ids.to(DEV), weights.to(DEV), b13[1:].to(DEV), b2[1:].to(DEV), impl="triton",
                   blocks=SMALL)
    assert torch.isfinite(got).all()
    assert rel_max(got, ref.moe_gemv_reference(x, ids, weights, w13, w2)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_moe_gemv_reference_rounds_like_gathered_expert_ffn(dtype):
    """Bit for bit on the CPU: the reference rounds where gathered_expert_ffn rounds; a -1 route adds
    what the hybrid backend's old (slot 0, weight 0) substitution added."""
    S, H, I = 10, 96, 40
    w13, w2 = experts(S, H, I, dtype, seed=11)
    for T, K in ((1, 8), (3, 2), (4, 5)):
        ids, weights = routes(T, K, S, seed=T * K)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dtype)
        assert torch.equal(ref.moe_gemv_reference(x, ids, weights, w13, w2),
                           gathered_expert_ffn(x, ids, weights, w13, w2))
        ids, weights = routes(T, K, S, seed=T * K, missing=T)
        valid = ids >= 0
        assert torch.equal(ref.moe_gemv_reference(x, ids, weights, w13, w2),
                           gathered_expert_ffn(x, torch.where(valid, ids, 0), torch.where(valid, weights, 0.0),
                                               w13, w2))


def test_moe_gemv_rejects_bad_arguments():
    w13, w2 = experts(4, 16, 8)
    x, ids, w = torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        moe_gemv(x, ids[:1], w[:1], w13, w2)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe_gemv(x, ids.float(), w, w13, w2)
    with pytest.raises(ValueError, match=r"\[S, 2I, H\]"):
        moe_gemv(x, ids, w, w2, w13)
    with pytest.raises(TypeError, match="dtype"):
        moe_gemv(x, ids, w, w13.double(), w2.double())
    with pytest.raises(ValueError, match="impl"):
        moe_gemv(x, ids, w, w13, w2, impl="fast")


# -- norms ---------------------------------------------------------------------------------------

def norm_inputs(shape, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:   # a [T, heads, D] slice of a wider projection, as q of a fused qkv
        T, heads, D = shape
        x = torch.randn(T, (heads + 3) * D, generator=g)[:, D:(heads + 1) * D].view(T, heads, D)
    else:
        x = torch.randn(*shape, generator=g) * 3
    return x, torch.rand(shape[-1], generator=g) + 0.5


@pytest.mark.parametrize("shape, strided", [((5, 48), False), ((3, 100), False), ((1, 64), False),
                                            ((3, 4, 16), True), ((2, 3, 12), True)])
def test_rms_norm_lockstep(shape, strided):
    x, w = norm_inputs(shape, seed=len(shape) + shape[-1], strided=strided)
    expected = ref.rms_norm_reference(x, w, 1e-6)
    assert torch.equal(expected, model_rms_norm(x, w, 1e-6))         # the reference is the model's code
    got = rms_norm(x.to(DEV), w.to(DEV), 1e-6, impl="triton")
    assert got.shape == x.shape and got.is_contiguous()
    assert rel_max(got, expected) < 1e-6
    delta = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    x_new, normed = add_rms_norm(x.to(DEV), delta.to(DEV), w.to(DEV), 1e-6, impl="triton")
    assert torch.equal(x_new.cpu(), x + delta)                       # the add rounds as torch's
    assert rel_max(normed, model_rms_norm(x + delta, w, 1e-6)) < 1e-6


# -- q/k norm + rope ----------------------------------------------------------------------------

@pytest.mark.parametrize("T, Hq, Hkv, D", [(1, 4, 2, 16), (3, 4, 2, 12), (4, 2, 2, 8)])
def test_qk_norm_rope_lockstep(T, Hq, Hkv, D):
    g = torch.Generator().manual_seed(T * D)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)
    q = qkv[:, :Hq * D].view(T, Hq, D)                                # strided views, as the model's
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    angles = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    exp_q, exp_k = ref.qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6)
    assert torch.equal(exp_q, apply_rope(model_rms_norm(q, qw, 1e-6), cos, sin))
    assert torch.equal(exp_k, apply_rope(model_rms_norm(k, kw, 1e-6), cos, sin))
    got_q, got_k = qk_norm_rope(q.to(DEV), k.to(DEV), qw.to(DEV), kw.to(DEV), cos.to(DEV), sin.to(DEV), 1e-6,
                                impl="triton")
    assert got_q.shape == (T, Hq, D) and got_k.shape == (T, Hkv, D)
    assert rel_max(got_q, exp_q) < 1e-6 and rel_max(got_k, exp_k) < 1e-6
    # rope alone has no reduction: the kernel's values are torch's exactly
    rq, rk = rope(q.to(DEV), k.to(DEV), cos.to(DEV), sin.to(DEV), impl="triton")
    assert torch.equal(rq.cpu(), apply_rope(q, cos, sin)) and torch.equal(rk.cpu(), apply_rope(k, cos, sin))


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_writes_the_kv_cache_rows_it_is_given(impl, norm):
    """The fused K/V write: rows kv.index of the caches get the returned k and the given v, exactly as
    index_copy_ would put them; every other row keeps its bytes."""
    T, Hq, Hkv, D, N = 3, 4, 2, 12, 10
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)
    q = qkv[:, :Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)                       # strided, as the model's split
    angles = torch.rand(T, 1, D, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    qw, kw = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5) if norm else (None, None)
    k_cache, v_cache = torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
    index = torch.tensor([[7, 1], [0, 2], [4, 3]])[:, 0]                 # a strided view: rows 7, 0, 4
    exp_k_cache, exp_v_cache = k_cache.clone(), v_cache.clone()
    dev = (lambda t: t.to(DEV)) if impl == "triton" else (lambda t: t)
    kv = KvWrite(dev(k_cache), dev(v_cache), dev(index), dev(v))
    got_q, got_k = qk_norm_rope(dev(q), dev(k), qw if qw is None else dev(qw), kw if kw is None else dev(kw),
                                dev(cos), dev(sin), 1e-6, impl=impl, kv=kv)
    plain_q, plain_k = qk_norm_rope(dev(q), dev(k), qw if qw is None else dev(qw), kw if kw is None else dev(kw),
                                    dev(cos), dev(sin), 1e-6, impl=impl)
    assert torch.equal(got_q.cpu(), plain_q.cpu()) and torch.equal(got_k.cpu(), plain_k.cpu())
    exp_k_cache.index_copy_(0, index, got_k.cpu())
    exp_v_cache.index_copy_(0, index, v)
    assert torch.equal(kv.k_cache.cpu(), exp_k_cache)
    assert torch.equal(kv.v_cache.cpu(), exp_v_cache)
    untouched = [r for r in range(N) if r not in index.tolist()]
    assert torch.equal(kv.k_cache.cpu()[untouched], k_cache[untouched])   # the others keep their bytes


def test_kv_write_is_checked():
    T, Hkv, D = 2, 2, 8
    k = torch.randn(T, Hkv, D)
    q = torch.randn(T, 4, D)
    cos = sin = torch.ones(T, 1, D)
    good = dict(k_cache=torch.zeros(5, Hkv, D), v_cache=torch.zeros(5, Hkv, D), index=torch.tensor([0, 1]),
                v=torch.randn(T, Hkv, D))
    bad = [dict(k_cache=torch.zeros(5, Hkv + 1, D)), dict(v_cache=torch.zeros(4, Hkv, D)),
           dict(index=torch.tensor([0, 1], dtype=torch.int32)), dict(index=torch.tensor([0])),
           dict(v=torch.randn(T, Hkv, D).to(torch.float64)), dict(k_cache=torch.zeros(D, Hkv, 5).transpose(0, 2))]
    for change in bad:
        with pytest.raises(ValueError, match="KvWrite"):
            rope(q, k, cos, sin, impl="reference", kv=KvWrite(**{**good, **change}))


# -- router --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, E, K", [("qwen3", 10, 3), ("qwen3", 16, 8), ("olmoe", 12, 2),
                                        ("mixtral", 8, 2), ("mixtral", 5, 4)])
def test_route_topk_lockstep(arch, E, K):
    cfg = MoeConfig(arch=arch, vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, num_experts=E, top_k=K, expert_intermediate_size=4, rms_norm_eps=1e-6,
                    rope_theta=1e4, max_position_embeddings=8, norm_topk_prob=arch == "qwen3")
    g = torch.Generator().manual_seed(E * K)
    x, router = torch.randn(4, 8, generator=g), torch.randn(E, 8, generator=g)
    exp_ids, exp_w = route(cfg, x, router)
    softmax_first = arch != "mixtral"
    logits = torch.nn.functional.linear(x, router)                      # route's own GEMM
    ids_r, w_r = ref.route_topk_reference(logits, K, softmax_first, softmax_first and cfg.norm_topk_prob)
    assert torch.equal(ids_r, exp_ids) and torch.equal(w_r, exp_w)    # the reference is layers.route
    ids, w = route_topk(logits.to(DEV), K, softmax_first=softmax_first,
                        renorm=softmax_first and cfg.norm_topk_prob, impl="triton")
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids.cpu(), exp_ids)
    assert rel_max(w, exp_w) < 1e-6


# -- wiring --------------------------------------------------------------------------------------

def test_resident_gemv_mode_choice_and_result():
    S, H, I = 8, 32, 16
    w13, w2 = experts(S, H, I, seed=21)
    layout = ExpertLayout(H, I, torch.float32)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick_mode("auto", True, 32, 32) == "gemv" and pick_mode("auto", True, 33, 32) == "grouped"
    assert pick_mode("auto", False, 8, 32) == "grouped" and pick_mode("gemv", False, 99, 32) == "gemv"
    backend = ResidentExperts([pack_experts(w13, w2).to(DEV)], layout, mode="auto")
    assert backend.choose_mode(16, cuda) == "gemv" and backend.choose_mode(16, cpu) == "grouped"
    assert backend.choose_mode(128, cuda) == "gemv" and backend.choose_mode(129, cuda) == "grouped"   # resident's bound
    gemv = ResidentExperts([pack_experts(w13, w2).to(DEV)], layout, mode="gemv")
    gemv.kernel_impl = "triton"
    assert gemv.graph_safe(1000)
    ids, weights = routes(3, 2, S, seed=2)
    x = torch.randn(3, H)
    out = gemv.forward(0, x.to(DEV), ids.to(DEV), weights.to(DEV))
    assert rel_max(out, gathered_expert_ffn(x, ids, weights, w13, w2)) < 1e-5


def tiny_cfg(arch: str) -> MoeConfig:
    return MoeConfig(arch=arch, vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=12, num_experts=8, top_k=2, expert_intermediate_size=40, rms_norm_eps=1e-6,
                     rope_theta=1e4, max_position_embeddings=64, norm_topk_prob=True, dtype="float32",
                     clip_qkv=1.5 if arch == "olmoe" else None)


def tiny_model(cfg: MoeConfig, fused: bool, device: str) -> MoeModel:
    _, dense, source = random_model_parts(cfg, device, torch.float32, seed=3)
    experts_ = ResidentExperts.from_source(source, device, mode="gemv" if fused else "grouped")
    model = MoeModel(cfg, dense, experts_, max_positions=64, fused_kernels=fused)
    if device == "cpu":
        model.kernel_impl = experts_.kernel_impl = "triton"           # the interpreter
        model.dense_linear = "gemv" if fused else "torch"              # kernels/dense_gemv as on CUDA
    return model


@pytest.mark.parametrize("arch", ["qwen3", "olmoe", "mixtral"])
def test_fused_forward_matches_the_plain_forward(arch, no_tf32, monkeypatch):
    """...and the fused forward's MoE hands its per-route outputs to the next add_rms_norm (gemv: no sum launch)."""
    from ftexpert.gpu_worker.engine.attention import PrefillAttention
    from ftexpert.kernels import moe_decode
    deltas = []
    real = moe_decode.add_rms_norm
    monkeypatch.setattr(moe_decode, "add_rms_norm",
                        lambda x, delta, *a, **kw: deltas.append(delta.dim()) or real(x, delta, *a, **kw))
    from ftexpert.gpu_worker.engine.kv_cache import KVCache
    cfg = tiny_cfg(arch)
    plain, fused = tiny_model(cfg, False, DEV), tiny_model(cfg, True, DEV)
    assert not plain.fused_kernels and plain.dense.layers[0].qkv_proj is None
    layer = fused.dense.layers[0]
    assert layer.qkv_proj is not None and layer.q_proj.data_ptr() == layer.qkv_proj.data_ptr()
    assert torch.equal(layer.k_proj, plain.dense.layers[0].k_proj)   # fuse_qkv keeps the values
    assert fused.dense.nbytes == plain.dense.nbytes                   # and no second copy
    ids = torch.tensor([5, 17, 42, 9], device=DEV)
    logits = []
    for model in (plain, fused):
        kv = KVCache(cfg, 1, 16, torch.float32, torch.device(DEV))
        logits.append(model.forward(ids, torch.arange(4, device=DEV), PrefillAttention(kv, 0, 0, 4),
                                    logit_rows=torch.tensor([1, 3], device=DEV)))
    assert logits[1].shape == (2, cfg.vocab_size)
    assert rel_max(logits[1], logits[0]) < 1e-5
    assert deltas.count(3) == cfg.num_layers and deltas.count(2) == cfg.num_layers     # MoE: per-route; attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, K, N", [(1, 8, 64), (3, 2, 100), (2, 1, 48)])
def test_add_rms_norm_sums_per_route_outputs_as_the_sum_launch(dtype, T, K, N):
    """x [T, N] with delta [T, K, N] fp32: the kernel sums the routes as moe_gemv's sum launch does (bit for bit
    its own call on the launch's sum, whose rounding the interpreter shares), the reference as sum_routes."""
    from ftexpert.kernels.moe_decode import add_rms_norm, triton_kernels
    g = torch.Generator().manual_seed(T * K + N)
    x = (torch.randn(T, N, generator=g) * 2).to(dtype).to(DEV)
    w = (torch.randn(N, generator=g) * 0.3).to(dtype).to(DEV)
    parts = torch.randn(T, K, N, generator=g).to(DEV)
    summed = torch.empty(T, N, dtype=dtype, device=DEV)        # moe_gemv's sum launch on the parts
    triton_kernels.moe_sum_k_kernel[(T, 1)](parts, summed, K, N, BLOCK=128)
    for a, b in zip(add_rms_norm(x, parts, w, 1e-6, impl="triton"), add_rms_norm(x, summed, w, 1e-6, impl="triton")):
        assert torch.equal(a, b)
    for a, b in zip(add_rms_norm(x.cpu(), parts.cpu(), w.cpu(), 1e-6, impl="reference"),
                    ref.add_rms_norm_reference(x.cpu(), ref.sum_routes(parts.cpu(), dtype), w.cpu(), 1e-6)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="per-route outputs must be"):
        add_rms_norm(x, parts.double(), w, 1e-6)


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_fused_decode_step_writes_the_kv_cache_like_the_plain_forward(arch, no_tf32, monkeypatch):
    """A decode step of two requests through DecodeAttention: the fused forward writes K/V from its rope
    kernel (KvWrite), the plain one by index_copy_; same cache rows, same logits."""
    from ftexpert.gpu_worker.engine.attention import DecodeAttention, PrefillAttention
    from ftexpert.gpu_worker.engine.kv_cache import KVCache
    cfg = tiny_cfg(arch)
    plain, fused = tiny_model(cfg, False, DEV), tiny_model(cfg, True, DEV)
    prompts = [torch.tensor([5, 17, 42, 9], device=DEV), torch.tensor([3, 8, 1], device=DEV)]
    results = []
    written = []
    real_attend = DecodeAttention.attend

    def spy(self, layer_idx, q, k, v, *, kv_written=False):
        written.append(kv_written)
        return real_attend(self, layer_idx, q, k, v, kv_written=kv_written)
    monkeypatch.setattr(DecodeAttention, "attend", spy)
    for model in (plain, fused):
        kv = KVCache(cfg, 2, 16, torch.float32, torch.device(DEV))
        for slot, ids in enumerate(prompts):
            n = ids.numel()
            model.forward(ids, torch.arange(n, device=DEV), PrefillAttention(kv, slot, 0, n),
                          logit_rows=torch.tensor([n - 1], device=DEV))
        positions = torch.tensor([4, 3], device=DEV)
        attn = DecodeAttention(kv, torch.tensor([0, 1], device=DEV), positions, bucket_tokens=16)
        logits = model.forward(torch.tensor([11, 12], device=DEV), positions, attn, logit_rows=None)
        results.append((logits, kv))
    (plain_logits, plain_kv), (fused_logits, fused_kv) = results
    L = cfg.num_layers
    assert written == [False] * L + [True] * L        # the plain forward copies, the fused one writes in rope
    assert rel_max(fused_logits, plain_logits) < 1e-5
    for layer in range(cfg.num_layers):
        for a, b in ((fused_kv.k[layer], plain_kv.k[layer]), (fused_kv.v[layer], plain_kv.v[layer])):
            assert rel_max(a[0, :5], b[0, :5]) < 1e-5 and rel_max(a[1, :4], b[1, :4]) < 1e-5
            assert a[0, 4].abs().sum() > 0 and a[1, 3].abs().sum() > 0       # the decode rows were written
            assert torch.all(a[0, 5:] == 0) and torch.all(a[1, 4:] == 0)    # and nothing past them


def test_offload_gemv_mode_gives_the_resident_gemv_tokens(tmp_path, monkeypatch):
    from ftexpert.gpu_worker.engine import SamplingParams
    from tests.built_engines import build
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    conf = dict(max_running_requests=2, max_context_tokens=64, prefill_chunk_tokens=4, expert_compute="gemv")
    prompts = [[5, 17, 42, 99, 3], [250, 7, 64]]
    expected = build(**conf).engine.generate(prompts, params)
    loaded = build(moe_strategy="offload", moe_cache_size=10, **conf)
    try:
        assert loaded.engine.generate(prompts, params) == expected
        assert loaded.experts.stats.fetched > 10
    finally:
        loaded.close()


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler (MLIR, LLVM, ptxas) on every kernel, in a process without the
    interpreter: catches what only the interpreter accepts. ~5 s; skipped where triton cannot
    compile ahead of time."""
    assert_compile_check("ftexpert.kernels.moe_decode.compile_check")


# -- GPU -----------------------------------------------------------------------------------------

BF16_ULP = 2.0 ** -8                      # relative spacing of bfloat16 (8 significant bits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_moe_gemv_bf16_at_qwen3_shapes(T):
    """bf16 at qwen3-30b-a3b shapes against the reference on the GPU (cuBLAS bmm): the rounding points
    are the same, so only fp32 summation order differs, and a rounding flip of a bf16 intermediate
    (gate, up, silu, act, down) moves a term by one bf16 ulp: relative error ~1e-3, far below the
    O(1) error of a wrong route or weight. Deterministic, and inside a CUDA graph the same."""
    E, H, I, K = 128, 2048, 768, 8
    w13, w2 = (t.cuda() for t in experts(E, H, I, torch.bfloat16, seed=T))
    ids, weights = routes(T, K, E, seed=T, missing=1 if T > 1 else 0, repeat=T > 2)
    ids, weights = ids.cuda(), torch.softmax(weights, -1).cuda()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
    expected = ref.moe_gemv_reference(x, ids, weights, w13, w2)
    got = moe_gemv(x, ids, weights, w13, w2)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_max(got, expected) < 8 * BF16_ULP
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2 * BF16_ULP
    exact = (got == expected).float().mean().item()
    print(f"\nT={T}: moe_gemv == reference for {100 * exact:.2f}% of outputs (bf16)")
    assert torch.equal(moe_gemv(x, ids, weights, w13, w2), got)          # deterministic
    valid = ids >= 0
    gathered = gathered_expert_ffn(x, torch.where(valid, ids, 0), torch.where(valid, weights, 0.0), w13, w2)
    assert rel_max(got, gathered) < 8 * BF16_ULP
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_gemv(x, ids, weights, w13, w2)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static = moe_gemv(x, ids, weights, w13, w2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, got)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_norm_rope_router_bf16():
    """bf16 on CUDA. The add and rope alone have no reduction: equal to torch's bit for bit (rope runs
    with FMA contraction off; libdevice's expf / rsqrtf and IEEE division are torch's functions).
    Norms: the fp32 statistic may differ in its last bits (summation order), which flips a bf16
    rounding of x * r now and then: at most one bf16 ulp, rarely."""
    T, H, Hq, Hkv, D = 4, 2048, 32, 4, 128
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, H, generator=g) * 2).to(dt).cuda()
    delta = torch.randn(T, H, generator=g).to(dt).cuda()
    w = (torch.rand(H, generator=g) + 0.5).to(dt).cuda()
    x_new, normed = add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(x_new, x + delta)
    expected = ref.rms_norm_reference(x + delta, w, 1e-6)
    assert rel_max(normed, expected) <= 2 * BF16_ULP
    assert (normed == expected).float().mean().item() > 0.99
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dt).cuda()
    q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    angles = torch.rand(T, 1, D, generator=g) * 100
    cos, sin = angles.cos().to(dt).cuda(), angles.sin().to(dt).cuda()
    rq, rk = rope(q, k, cos, sin)
    assert torch.equal(rq, ref.rope_reference(q, cos, sin)) and torch.equal(rk, ref.rope_reference(k, cos, sin))
    qw, kw = (torch.rand(D, generator=g) + 0.5).to(dt).cuda(), (torch.rand(D, generator=g) + 0.5).to(dt).cuda()
    got = qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    for a, b in zip(got, ref.qk_norm_rope_reference(q, k, qw, kw, cos, sin, 1e-6)):
        assert rel_max(a, b) <= 4 * BF16_ULP and (a == b).float().mean().item() > 0.99
    # router: fp32 logits have no ties, so the order is torch.topk's exactly; bf16 logits often tie
    # (ties pick the lowest id, as torch.topk's CUDA kernel does at the k-th value, but the order
    # among tied winners is not specified by torch): compare the chosen sets there
    for logit_dtype in (torch.float32, dt):
        logits = torch.randn(T, 128, generator=g).to(logit_dtype).cuda()
        ids, weights = route_topk(logits, 8, softmax_first=True, renorm=True)
        exp_ids, exp_w = ref.route_topk_reference(logits, 8, True, True)
        if logit_dtype == torch.float32:
            assert torch.equal(ids, exp_ids) and rel_max(weights, exp_w) < 1e-6
        else:
            assert torch.equal(ids.sort(-1).values, exp_ids.sort(-1).values)
            assert rel_max(weights.sort(-1).values, exp_w.sort(-1).values) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_model_tokens_match_the_plain_forward(tmp_path, monkeypatch, no_tf32):
    """The tiny model (float32) on CUDA: fused forward + gemv experts (the default) against the plain
    forward + grouped experts, 16 greedy tokens for 3 prompts, with CUDA graphs. In float32 the two
    differ by summation order only (~1e-7 relative), far below the tiny model's logit margins, so
    the tokens must be equal. In bfloat16 a rounding flip can move a logit by ~1e-2 and exact
    equality is not guaranteed: its agreement is printed, and its first tokens (after prefill,
    where nothing has diverged yet) must agree."""
    from ftexpert.gpu_worker.engine import SamplingParams
    from tests.built_engines import build
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    prompts = [[5, 17, 42, 99], [3, 250, 7], [11, 300, 8, 64, 1]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    conf = dict(device="cuda", max_running_requests=3, max_context_tokens=128)
    for dtype in ("float32", "bfloat16"):
        fused = build(dtype=dtype, **conf)
        assert fused.model.fused_kernels and fused.model.experts.choose_mode(3 * 2, fused.device) == "gemv"
        engine = fused.engine
        got = engine.generate(prompts, params)
        assert engine.graphs is not None and engine.graphs.replays > 0
        plain = build(dtype=dtype, expert_compute="grouped", fused_kernels="off", **conf)
        assert not plain.model.fused_kernels
        expected = plain.engine.generate(prompts, params)
        same = sum(a == b for g_, e in zip(got, expected) for a, b in zip(g_, e))
        print(f"\n{dtype}: fused tokens = plain tokens for {same} of {16 * len(prompts)}")
        if dtype == "float32":
            assert got == expected
        else:
            assert [t[0] for t in got] == [t[0] for t in expected]
