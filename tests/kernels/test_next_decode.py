"""kernels/next_decode (and moe_decode's route_topk with round_weights): each Triton kernel in lockstep with its torch
reference -- the code of the models' plain forwards -- on random inputs, float32 and bfloat16, small shapes with
the real models' head counts (Qwen3-Next: 16 key / 32 value linear heads, 16 q / 2 kv heads with a quarter of
the head rotated, 512 experts top-10; gpt-oss: 128 experts top-4) and ragged ones.

Without a GPU the kernels run in the Triton interpreter (conftest.py), bfloat16 rounding done by hand
(EMU_BF16); on a GPU natively. Tolerances: float32 within 1e-5 relative of the row's largest value (fp32 sums in
another order, exp / log approximations); bfloat16 all but 3% of the elements (at least all but 2) bit-equal and
the rest one rounding step apart (2^-7 relative to the tensor's scale): a last-bit difference of an fp32 statistic
flips a rounding now and then. The routers: ids equal, on logits without ties (the kernel breaks ties by the lowest
id; torch.topk's choice among ties is unspecified), weights within 1e-5 relative, or one bfloat16 step where they
are rounded to bfloat16.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ftexpert.gpu_worker.models.gpt_oss_layers import gpt_oss_route
from ftexpert.gpu_worker.models.layers import route
from ftexpert.kernels import next_decode as kn
from ftexpert.kernels.next_decode import reference as ref
from tests.conftest import KERNEL_DEVICE, assert_compile_check

DEV = KERNEL_DEVICE
DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    g, w = got.float().cpu(), want.float().cpu()
    scale = w.abs().amax().clamp_min(1e-30).item()
    if want.dtype == torch.bfloat16:
        assert (g != w).sum().item() <= max(2, 0.03 * g.numel())
        torch.testing.assert_close(g, w, rtol=2 ** -7, atol=2 ** -7 * scale)
    else:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale)


def rand(*shape, dtype=torch.float32, scale=1.0, gen=None) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def both(fn, *args, **kw):
    """fn through the kernel and through the reference: (triton result, reference result)."""
    return fn(*args, impl="triton", **kw), fn(*args, impl="reference", **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, N", [(1, 64), (3, 100), (2, 2048)])
@pytest.mark.parametrize("offset", [1.0, 0.0], ids=["next", "gpt_oss"])
def test_norms_lockstep(dtype, T, N, offset):
    g = torch.Generator().manual_seed(T * N)
    x, d = rand(T, N, dtype=dtype, scale=2, gen=g), rand(T, N, dtype=dtype, gen=g)
    w = rand(N, dtype=dtype, scale=0.3, gen=g)
    got, want = both(kn.rms_norm, x, w, 1e-6, offset=offset)
    close(got, want)
    for got, want in zip(*both(kn.add_rms_norm, x, d, w, 1e-6, offset=offset)):
        close(got, want)
    shared = kn.SharedExpert(rand(T, N, dtype=dtype, gen=g), rand(T, N, dtype=dtype, gen=g),
                             rand(1, N, dtype=dtype, scale=0.2, gen=g))
    for got, want in zip(*both(kn.add_rms_norm, x, d, w, 1e-6, offset=offset, shared=shared)):
        close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, K, N", [(1, 10, 64), (3, 4, 100), (2, 1, 48)])
def test_add_rms_norm_sums_per_route_outputs_as_the_sum_launch(dtype, T, K, N):
    """delta [T, K, N] fp32 (the resident backend's per-route outputs): summed in k order and rounded to x's dtype
    first, so the result is add_rms_norm of the summed routes (moe_decode's sum_routes), with and without the shared
    expert; the kernel against the reference, and the reference exactly so."""
    from ftexpert.kernels.moe_decode.reference import sum_routes
    g = torch.Generator().manual_seed(T * K + N)
    x, w = rand(T, N, dtype=dtype, scale=2, gen=g), rand(N, dtype=dtype, scale=0.3, gen=g)
    parts = rand(T, K, N, gen=g)
    routed = sum_routes(parts, dtype)
    shared = kn.SharedExpert(rand(T, N, dtype=dtype, gen=g), rand(T, N, dtype=dtype, gen=g),
                             rand(1, N, dtype=dtype, scale=0.2, gen=g))
    for sh in (None, shared):
        got, want = both(kn.add_rms_norm, x, parts, w, 1e-6, shared=sh)
        for a, b, c in zip(got, want, kn.add_rms_norm(x, routed, w, 1e-6, shared=sh, impl="reference")):
            close(a, b)
            assert torch.equal(b, c)
        if dtype == torch.float32:                       # the kernel: bit for bit its own call on the summed routes
            for a, c in zip(got, kn.add_rms_norm(x, routed, w, 1e-6, shared=sh, impl="triton")):
                assert torch.equal(a, c)
    with pytest.raises(ValueError, match="per-route outputs must be"):
        kn.add_rms_norm(x, parts.to(dtype=torch.float64), w, 1e-6)


def test_norm_references_are_the_models_norms():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 40, generator=g).bfloat16(), (torch.randn(40, generator=g) * 0.3).bfloat16()
    from ftexpert.gpu_worker.models.gpt_oss_layers import gpt_oss_rms_norm
    from ftexpert.gpu_worker.models.qwen3_next import next_rms_norm
    x32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(next_rms_norm(x, w, 1e-6), (x32 * (1.0 + w.float())).bfloat16())
    assert torch.equal(gpt_oss_rms_norm(x, w, 1e-6), (w.float() * x32).bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_lockstep(dtype):
    g = torch.Generator().manual_seed(2)
    for T, N in ((1, 48), (3, 1500)):
        close(*both(kn.silu_mul, rand(T, N, dtype=dtype, scale=3, gen=g), rand(T, N, dtype=dtype, gen=g)))


def deltanet_case(T, Hk, Hv, Dk, Dv, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = Hv // Hk
    C = 2 * Hk * Dk + Hv * Dv
    qkvz = rand(T, Hk * (2 * Dk + 2 * r * Dv), dtype=dtype, gen=g)
    ba = rand(T, 2 * Hv, dtype=dtype, scale=3, gen=g)             # a + dt_bias spans softplus's both sides
    cache = rand(T + 3, C, K - 1, dtype=dtype, gen=g)
    rows = torch.randperm(T + 3, generator=g)[:T].to(DEV)
    conv_w = rand(C, K, dtype=dtype, scale=0.5, gen=g)
    A_log = (torch.rand(Hv, generator=g) * 2).log().to(DEV)
    dt_bias = torch.rand(Hv, generator=g).to(DEV)
    return qkvz, ba, cache, rows, conv_w, A_log, dt_bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hk, Hv, Dk, Dv, K", [(1, 16, 32, 8, 8, 4), (3, 2, 4, 8, 8, 4), (2, 2, 6, 12, 10, 3),
                                                  (2, 3, 3, 16, 8, 2)])
def test_gdn_decode_pre_lockstep(dtype, T, Hk, Hv, Dk, Dv, K):
    """The conv over each sequence's state row (shifted in place; the other rows untouched), q / k expanded to the
    value heads, v, g, beta."""
    qkvz, ba, cache, rows, conv_w, A_log, dt_bias = deltanet_case(T, Hk, Hv, Dk, Dv, K, dtype, seed=T * Hv + K)
    heads = kn.DeltaNetHeads(Hk, Hv, Dk, Dv)
    caches = cache.clone(), cache.clone()
    got = kn.gdn_decode_pre(qkvz, ba, caches[0], rows, conv_w, A_log, dt_bias, heads, impl="triton")
    want = kn.gdn_decode_pre(qkvz, ba, caches[1], rows, conv_w, A_log, dt_bias, heads, impl="reference")
    for a, b in zip(got, want):
        close(a, b)
    assert torch.equal(caches[0], caches[1])                     # the new states are inputs moved: exact
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(caches[0][untouched], cache[untouched])
    assert torch.equal(caches[0][rows, :, -1], torch.cat([t.reshape(T, -1) for t in ref.split_qkvz(
        qkvz, ba, Hk, Dk, Hv // Hk, Dv)[:3]], dim=-1))            # the newest input is the last column


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_lockstep(dtype):
    """o [T, Hv, Dv] with z a view of the qkvz projection ([T, Hk, r, Dv], as the layer passes it)."""
    g = torch.Generator().manual_seed(3)
    for T, Hk, r, Dk, Dv in ((1, 16, 2, 8, 8), (3, 2, 3, 4, 12)):
        qkvz = rand(T, Hk * (2 * Dk + 2 * r * Dv), dtype=dtype, scale=2, gen=g)
        z = ref.split_qkvz(qkvz, rand(T, 2 * Hk * r, dtype=dtype, gen=g), Hk, Dk, r, Dv)[3].unflatten(-1, (r, Dv))
        o = rand(T, Hk * r, Dv, dtype=dtype, gen=g)
        w = (torch.rand(Dv, generator=g) + 0.5).to(dtype).to(DEV)
        got, want = both(kn.gated_rms_norm, o, z, w, 1e-6)
        close(got, want)
        assert torch.equal(want, ref.gated_rms_norm(o, z.reshape(T, Hk * r, Dv), w, 1e-6))


def attention_case(T, Hq, Hkv, D, R, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qg = rand(T, Hq, 2 * D, dtype=dtype, scale=2, gen=g)            # per head: query, gate (the q projection)
    k, v = rand(T, Hkv, D, dtype=dtype, scale=2, gen=g), rand(T, Hkv, D, dtype=dtype, gen=g)
    qn, kn_ = rand(D, dtype=dtype, scale=0.3, gen=g), rand(D, dtype=dtype, scale=0.3, gen=g)
    angles = torch.rand(T, 1, R // 2, generator=g) * 50
    angles = torch.cat((angles, angles), dim=-1)
    return qg, k, v, qn, kn_, angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, Hq, Hkv, D, R", [(1, 16, 2, 32, 8), (2, 16, 2, 256, 64), (3, 4, 2, 12, 4),
                                               (2, 2, 1, 16, 16)])
@pytest.mark.parametrize("with_kv", [False, True])
def test_qk_norm_partial_rope_lockstep(dtype, T, Hq, Hkv, D, R, with_kv):
    qg, k, v, qn, kn_, cos, sin = attention_case(T, Hq, Hkv, D, R, dtype, seed=T + Hq + D + R)
    results = []
    for impl in ("triton", "reference"):
        kc, vc = (torch.zeros(T + 2, Hkv, D, dtype=dtype, device=DEV) for _ in range(2))
        kv = kn.KvWrite(kc, vc, torch.arange(T, device=DEV) + 2, v) if with_kv else None
        q, k_out = kn.qk_norm_partial_rope(qg[..., :D], k, qn, kn_, cos, sin, 1e-6, kv=kv, impl=impl)
        results.append((q, k_out, kc, vc))
    (q, k_out, kc, vc), (q_r, k_r, kc_r, vc_r) = results
    close(q, q_r)
    close(k_out, k_r)
    assert q.is_contiguous() and k_out.is_contiguous()
    if with_kv:
        assert torch.equal(kc[2:], k_out) and torch.equal(vc[2:], v) and torch.equal(vc_r, vc)
        assert not kc[:2].any()
    tail = ref.offset_rms_norm(qg[..., :D], qn, 1e-6)[..., R:]
    assert torch.equal(q_r[..., R:], tail)                       # the unrotated channels: the norm alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate_lockstep(dtype):
    qg, *_ = attention_case(3, 4, 2, 24, 8, dtype, seed=5)
    out = rand(3, 4, 24, dtype=dtype, gen=torch.Generator().manual_seed(6))
    close(*both(kn.sigmoid_gate, out, qg[..., 24:]))


def close_weights(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=0)


def distinct_logits(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] rows of distinct values of `dtype` (no ties for top-k)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.unique((torch.randn(8 * E, generator=g) * 3).to(dtype).float())
    assert pool.numel() >= E
    return torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:E]] for _ in range(T)]).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E, K", [(512, 10), (40, 6)])
def test_route_qwen3_next_rule(dtype, E, K):
    """Softmax over E in fp32, top-k, renormalise, the weights rounded to the model dtype: layers.route then
    .to(h.dtype).float(), as Qwen3NextModel._moe does (logits through an identity router: exact)."""
    logits = distinct_logits(3, E, dtype, seed=E)
    cfg = SimpleNamespace(arch="qwen3_next", top_k=K, norm_topk_prob=True)
    ids_m, w_m = route(cfg, logits, torch.eye(E, dtype=dtype))
    logits = logits.to(DEV)
    for impl in ("triton", "reference"):
        ids, w = kn.route_topk(logits, K, softmax_first=True, renorm=True, round_weights=True, impl=impl)
        assert torch.equal(ids.cpu(), ids_m)
        close_weights(w, w_m.to(dtype).float(), dtype)
        assert torch.equal(w, w.to(dtype).float())                # rounded to the model dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E, K", [(128, 4), (24, 3)])
def test_route_gpt_oss_rule(dtype, E, K):
    """Top-k of the (biased) logits, softmax over those k in their dtype: gpt_oss_route."""
    logits = distinct_logits(4, E, dtype, seed=E + K)
    ids_m, w_m = gpt_oss_route(logits, torch.eye(E, dtype=dtype), torch.zeros(E, dtype=dtype), K)
    assert torch.equal(F.linear(logits, torch.eye(E, dtype=dtype), torch.zeros(E, dtype=dtype)), logits)
    logits = logits.to(DEV)
    for impl in ("triton", "reference"):
        ids, w = kn.route_topk(logits, K, softmax_first=False, round_weights=True, impl=impl)
        assert torch.equal(ids.cpu(), ids_m)
        close_weights(w, w_m, dtype)


def test_bad_arguments_are_refused():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        kn.rms_norm(x, torch.zeros(7), 1e-6)
    with pytest.raises(ValueError, match="shared.gate_weight"):
        kn.add_rms_norm(x, x, torch.zeros(8), 1e-6, shared=kn.SharedExpert(x, x, torch.zeros(8)))
    qkvz, ba, cache, rows, conv_w, A_log, dt_bias = (t.cpu() for t in deltanet_case(2, 2, 4, 8, 8, 4, torch.float32, 0))
    heads = kn.DeltaNetHeads(2, 4, 8, 8)
    with pytest.raises(ValueError, match="rows"):
        kn.gdn_decode_pre(qkvz, ba, cache, rows.int(), conv_w, A_log, dt_bias, heads)
    with pytest.raises(ValueError, match="conv_cache"):
        kn.gdn_decode_pre(qkvz, ba, cache.double(), rows, conv_w, A_log, dt_bias, heads)
    with pytest.raises(ValueError, match="multiple"):
        kn.gdn_decode_pre(qkvz, ba, cache, rows, conv_w, A_log, dt_bias, kn.DeltaNetHeads(3, 4, 8, 8))
    qg, k, v, qn, kn_, cos, sin = (t.cpu() for t in attention_case(1, 4, 2, 16, 6, torch.float32, 0))
    with pytest.raises(ValueError, match="cos"):
        kn.qk_norm_partial_rope(qg[..., :16], k, qn, kn_, cos[..., :5], sin[..., :5], 1e-6)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real compiler on every kernel at the real models' block sizes (skipped where it cannot run)."""
    assert_compile_check("ftexpert.kernels.next_decode.compile_check")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_at_the_real_shapes():
    """bf16 on CUDA at qwen3-next-80b-a3b's sizes (hidden 2048, 16 / 32 linear heads of 128, conv 4, 16 / 2
    attention heads of 256 with 64 rotated, shared expert 512) and gpt-oss-120b's hidden 2880, T = 1 and 4."""
    dt = torch.bfloat16
    for T in (1, 4):
        g = torch.Generator().manual_seed(T)
        for N, off in ((2048, 1.0), (2880, 0.0)):
            x, d, s, h = (rand(T, N, dtype=dt, gen=g) for _ in range(4))
            w, gw = rand(N, dtype=dt, scale=0.3, gen=g), rand(1, N, dtype=dt, scale=0.05, gen=g)
            for a, b in zip(*both(kn.add_rms_norm, x, d, w, 1e-6, offset=off, shared=kn.SharedExpert(s, h, gw))):
                close(a, b)
        close(*both(kn.silu_mul, rand(T, 512, dtype=dt, gen=g), rand(T, 512, dtype=dt, gen=g)))
        case = deltanet_case(T, 16, 32, 128, 128, 4, dt, seed=T)
        heads = kn.DeltaNetHeads(16, 32, 128, 128)
        caches = case[2].clone(), case[2].clone()
        got = kn.gdn_decode_pre(*case[:2], caches[0], *case[3:], heads)
        want = kn.gdn_decode_pre(*case[:2], caches[1], *case[3:], heads, impl="reference")
        for a, b in zip(got, want):
            close(a, b)
        assert torch.equal(*caches)
        qg, k, v, qn, kn_, cos, sin = attention_case(T, 16, 2, 256, 64, dt, seed=T)
        close(*both(kn.sigmoid_gate, rand(T, 16, 256, dtype=dt, gen=g), qg[..., 256:]))
        for a, b in zip(*both(kn.qk_norm_partial_rope, qg[..., :256], k, qn, kn_, cos, sin, 1e-6)):
            close(a, b)
