"""CPU expert kernels in lockstep with the float32 reference: torch path and every compiled ISA here, whole
experts and a split expert (a prefix of its channels); silu experts and gpt-oss's (biased, clamped SwiGLU: gate / up
large enough that the clamp bites, test_the_activation_is_seen)."""
from __future__ import annotations

import ctypes
import os
import uuid

import pytest
import torch

from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel, torch_moe_layer
from ftexpert.cpu_expert_pool.native.act_desc import expert_act_desc
from ftexpert.cpu_expert_pool.native.build import ISA_NAMES, try_load_native
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.proto.expert_store import ExpertStore
from tests.cpu_expert_pool.cpu_pool_util import BIASED_GAIN, GPT_OSS, check_act_is_seen, fill_biases

NATIVE, WHY_NOT = try_load_native()
NATIVE_KERNELS = [f"native-{ISA_NAMES[i]}" for i in range(NATIVE.best_isa + 1)] if NATIVE else []
BF16_UNIT_ROUNDOFF = 2.0 ** -8
# Paths that round x, h (and, in torch, the GEMM outputs) to bf16: a few bf16 roundings of the output scale.
BF16_PATH_TOL = 4 * BF16_UNIT_ROUNDOFF
FP32_PATH_TOL = 1e-5            # bf16 weights widened exactly, fp32 math: only summation order differs
BF16_PATHS = {"torch", "native-avx512_bf16", "native-amx_bf16"}

# (H, I, E, act): multiples of the vector widths, and sizes with tails on every ISA; silu and gpt-oss experts.
SHAPES = {"aligned": (128, 64, 6, "silu"), "tails": (88, 40, 5, "silu"), "aligned-gpt-oss": (128, 64, 6, GPT_OSS),
          "tails-gpt-oss": (88, 40, 5, GPT_OSS)}
# (T, n-per-token, all-on-one-expert)
BATCHES = {"one-token": (1, 1, False), "topk2-T5": (5, 2, False), "B20-one-expert": (20, 1, True),
           "topk4-T17": (17, 4, False)}


def make_store(hidden: int, inter: int, experts: int, act: str = "silu", layers: int = 2) -> ExpertStore:
    name = f"ft-test-kern-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    store = ExpertStore.create(name, num_layers=layers, num_experts=experts, hidden=hidden, intermediate=inter,
                               dtype=torch.bfloat16, config_hash="k", act=act)
    g = torch.Generator().manual_seed(hidden * 1000 + inter)
    for layer in range(layers):
        w = torch.randn(experts, store.shape.expert_numel, generator=g) / hidden ** 0.5
        store.write_layer(layer, w.to(torch.bfloat16))
        for e in range(experts if store.shape.expert_act.bias else 0):
            store.expert_views(layer, e)[0].mul_(BIASED_GAIN)
            fill_biases(store, layer, e, g)
    return store


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def store(request):
    s = make_store(*SHAPES[request.param])
    yield s
    s.close()
    s.unlink()


def make_batch(store: ExpertStore, num_tokens: int, per_token: int, one_expert: bool, hidden_dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, store.shape.hidden, generator=g).to(hidden_dtype)          # [T, H]
    experts = store.num_experts
    if one_expert:
        expert_id = torch.full((num_tokens,), experts - 1, dtype=torch.int32)
        token_idx = torch.arange(num_tokens, dtype=torch.int32)
    else:   # distinct experts per token, like a router's top-k
        expert_id = torch.stack([torch.randperm(experts, generator=g)[:per_token] for _ in range(num_tokens)])
        expert_id = expert_id.flatten().to(torch.int32)
        token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(per_token)
    weight = torch.rand(token_idx.numel(), generator=g, dtype=torch.float32)
    return hidden, token_idx, expert_id, weight


def rel_max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kernel", ["torch", *NATIVE_KERNELS])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["x-bf16", "x-fp32"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_matches_fp32_reference(store, kernel, hidden_dtype, batch):
    hidden, token_idx, expert_id, weight = make_batch(store, *BATCHES[batch], hidden_dtype, seed=len(batch))
    ref = reference_moe_layer(store, 1, hidden, token_idx, expert_id, weight)
    out = torch.full(ref.shape, float("nan"))            # the kernel must overwrite every element
    stats = ExpertKernel(store, kernel=kernel, num_threads=2)(1, hidden, token_idx, expert_id, weight, out)
    assert stats.num_experts == len(set(expert_id.tolist()))
    assert stats.weight_bytes == stats.num_experts * store.expert_bytes
    tol = BF16_PATH_TOL if kernel in BF16_PATHS else FP32_PATH_TOL
    err = rel_max_error(out, ref)
    assert err <= tol, f"{kernel}: max error {err:.2e} of the output scale, allowed {tol:.2e}"
    untouched = torch.ones(ref.shape[0], dtype=torch.bool)
    untouched[token_idx.long()] = False
    assert bool((out[untouched] == 0).all())


def test_the_activation_is_seen(store):
    """gpt-oss stores: dropping either clamp or any bias moves the reference far beyond the tolerances."""
    if not store.shape.expert_act.bias:
        pytest.skip("silu experts have no clamp and no biases")
    for batch in ("topk2-T5", "B20-one-expert"):
        hidden, token_idx, expert_id, weight = make_batch(store, *BATCHES[batch], torch.bfloat16, seed=len(batch))
        check_act_is_seen(store, 1, (hidden, token_idx, expert_id, weight), BF16_PATH_TOL)


@pytest.mark.parametrize("kernel", ["torch", *(["native"] if NATIVE else [])])
def test_biased_experts_are_not_split(store, kernel):
    """The down bias belongs to one side: a split of a gpt-oss expert is refused, by Python and by the C kernel."""
    if not store.shape.expert_act.bias:
        pytest.skip("silu experts split (the split tests below)")
    hidden, token_idx, expert_id, weight = make_batch(store, 3, 1, False, torch.bfloat16, seed=2)
    out = torch.full(hidden.shape, 7.0)
    with pytest.raises(ValueError, match="not split by channels"):
        ExpertKernel(store, kernel=kernel, num_threads=1)(0, hidden, token_idx, expert_id, weight, out,
                                                          split_expert=int(expert_id[0]), split_limit=32)
    if kernel != "torch":
        with pytest.raises(ValueError, match="invalid split"):
            NATIVE.moe_layer(0, 1, store.data_ptr, store.expert_stride, store.num_experts, store.shape.hidden,
                             store.shape.intermediate, hidden.data_ptr(), 1, 3, token_idx.data_ptr(),
                             expert_id.data_ptr(), weight.data_ptr(), 3, out.data_ptr(), int(expert_id[0]), 32,
                             act=expert_act_desc(store.shape))
    assert bool((out == 7.0).all())


def test_reading_the_wrong_layer_is_caught(store):
    """The tolerance is tight enough to see a wrong expert: layer 0 vs layer 1 differ far beyond it."""
    hidden, token_idx, expert_id, weight = make_batch(store, 3, 2, False, torch.bfloat16, seed=3)
    ref = reference_moe_layer(store, 1, hidden, token_idx, expert_id, weight)
    out = torch.empty_like(ref)
    ExpertKernel(store, kernel="auto", num_threads=1)(0, hidden, token_idx, expert_id, weight, out)
    assert rel_max_error(out, ref) > 50 * BF16_PATH_TOL


@pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_is_deterministic_across_thread_counts_and_calls(store, threads):
    hidden, token_idx, expert_id, weight = make_batch(store, 9, 3, False, torch.bfloat16, seed=11)
    outs = []
    for _ in range(2):
        out = torch.empty(hidden.shape, dtype=torch.float32)
        ExpertKernel(store, kernel="native", num_threads=threads)(1, hidden, token_idx, expert_id, weight, out)
        outs.append(out)
    single = torch.empty_like(outs[0])
    ExpertKernel(store, kernel="native", num_threads=1)(1, hidden, token_idx, expert_id, weight, single)
    # Each output element is computed by one thread in a fixed order: bit-identical whatever the split.
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], single)


@pytest.mark.parametrize("kernel", ["torch", *(["native"] if NATIVE else [])])
def test_bad_triples_are_rejected_not_read_out_of_bounds(store, kernel):
    hidden, token_idx, expert_id, weight = make_batch(store, 4, 1, False, torch.bfloat16, seed=5)
    out = torch.empty(hidden.shape, dtype=torch.float32)
    k = ExpertKernel(store, kernel=kernel, num_threads=1)
    bad_token = token_idx.clone()
    bad_token[2] = 4
    with pytest.raises(ValueError, match="token index"):
        k(1, hidden, bad_token, expert_id, weight, out)
    bad_expert = expert_id.clone()
    bad_expert[0] = store.num_experts
    with pytest.raises(ValueError, match="expert id"):
        k(1, hidden, token_idx, bad_expert, weight, out)


def test_empty_request_zeroes_out(store):
    hidden = torch.randn(3, store.shape.hidden).to(torch.bfloat16)
    none = torch.empty(0, dtype=torch.int32)
    for kernel in ["torch", *(["native"] if NATIVE else [])]:
        out = torch.full((3, store.shape.hidden), 7.0)
        stats = ExpertKernel(store, kernel=kernel, num_threads=1)(0, hidden, none, none,
                                                                  torch.empty(0), out)
        assert stats.num_experts == 0 and bool((out == 0).all())


def test_unknown_kernel_and_unsupported_isa_are_clear_errors(store):
    with pytest.raises(ValueError, match="choose one of"):
        ExpertKernel(store, kernel="fast")
    if NATIVE is not None and NATIVE.best_isa < 3:
        with pytest.raises(ValueError, match="tops out at"):
            ExpertKernel(store, kernel="native-avx512_bf16")


def test_torch_path_is_the_fallback_for_non_bf16_stores():
    name = f"ft-test-kern-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    s = ExpertStore.create(name, num_layers=1, num_experts=2, hidden=32, intermediate=16, dtype=torch.float32,
                           config_hash="k")
    s.write_layer(0, torch.randn(2, s.shape.expert_numel) / 32 ** 0.5)
    k = ExpertKernel(s, kernel="auto", num_threads=1)
    assert k.name == "torch"
    hidden = torch.randn(2, 32)
    tok, exp, w = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), torch.ones(2)
    out = torch.empty(2, 32)
    k(0, hidden, tok, exp, w, out)
    ref = reference_moe_layer(s, 0, hidden, tok, exp, w)
    assert rel_max_error(out, ref) <= FP32_PATH_TOL
    torch_out = torch.empty(2, 32)
    torch_moe_layer(s, 0, hidden, tok, exp, w, torch_out)
    assert torch.equal(out, torch_out)
    s.close()
    s.unlink()


# ---------------------------------------------------------------------------------------------
# Split expert: one expert over its intermediate channels [0, c) only (the GPU computes the rest).
# ---------------------------------------------------------------------------------------------
# (H, I, E): I a multiple of 32 with room for three limits; "aligned" takes the AMX path (H, I in 32s),
# "tails" has H with tails on every ISA (dot products only).
SPLIT_SHAPES = {"aligned": (128, 128, 6), "tails": (88, 160, 5)}
SPLIT_LIMITS = {"c32": lambda inter: 32, "c-mid": lambda inter: inter // 64 * 32, "c-I-32": lambda inter: inter - 32}
# (T, experts per token, tokens that route to the split expert): >= 4 of them takes AMX, 1-3 the dot path.
SPLIT_BATCHES = {"split-B8-amx": (12, 2, range(8)), "split-B2-dot": (5, 2, (1, 3)), "split-only-B1": (1, 1, (0,)),
                 "split-absent": (6, 2, ())}


@pytest.fixture(scope="module", params=list(SPLIT_SHAPES), ids=list(SPLIT_SHAPES))
def split_store(request):
    s = make_store(*SPLIT_SHAPES[request.param])
    yield s
    s.close()
    s.unlink()


def reference_split_layer(store: ExpertStore, layer: int, hidden, token_idx, expert_id, weight, split_expert: int,
                          split_limit: int) -> torch.Tensor:
    """fp32 reference from the store's weights sliced to the prefix: the split expert uses gate/up rows [0, c)
    and down columns [0, c); every other expert is whole."""
    inter = store.shape.intermediate
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    x = hidden.float()
    for k in range(token_idx.numel()):
        t, e, w = int(token_idx[k]), int(expert_id[k]), float(weight[k])
        c = split_limit if split_limit and e == split_expert else inter
        w13, w2 = store.expert_views(layer, e)                                 # [2I, H], [H, I]
        gate, up = x[t] @ w13[:c].float().T, x[t] @ w13[inter:inter + c].float().T
        out[t] += w * (torch.nn.functional.silu(gate) * up) @ w2[:, :c].float().T
    return out


def make_split_batch(store: ExpertStore, num_tokens: int, per_token: int, split_tokens, split_expert: int,
                     hidden_dtype, seed: int):
    """Distinct experts per token, none the split expert, except that tokens in split_tokens route to it."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, store.shape.hidden, generator=g).to(hidden_dtype)
    others = torch.tensor([e for e in range(store.num_experts) if e != split_expert])
    rows = []
    for t in range(num_tokens):
        row = others[torch.randperm(len(others), generator=g)[:per_token]].clone()
        if t in split_tokens:
            row[int(torch.randint(per_token, (1,), generator=g))] = split_expert
        rows.append(row)
    expert_id = torch.stack(rows).flatten().to(torch.int32)
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(per_token)
    weight = torch.rand(token_idx.numel(), generator=g, dtype=torch.float32)
    return hidden, token_idx, expert_id, weight


def split_weight_bytes(store: ExpertStore, expert_id, split_expert: int, split_limit: int) -> int:
    inter, hidden = store.shape.intermediate, store.shape.hidden
    return sum(3 * (split_limit if e == split_expert else inter) * hidden * 2 for e in set(expert_id.tolist()))


@pytest.mark.parametrize("kernel", ["torch", *NATIVE_KERNELS])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32], ids=["x-bf16", "x-fp32"])
@pytest.mark.parametrize("limit", list(SPLIT_LIMITS))
@pytest.mark.parametrize("batch", list(SPLIT_BATCHES))
def test_split_expert_matches_the_prefix_reference(split_store, kernel, hidden_dtype, limit, batch):
    store = split_store
    inter = store.shape.intermediate
    split_expert, split_limit = 2, SPLIT_LIMITS[limit](inter)
    num_tokens, per_token, split_tokens = SPLIT_BATCHES[batch]
    hidden, token_idx, expert_id, weight = make_split_batch(store, num_tokens, per_token, split_tokens, split_expert,
                                                            hidden_dtype, seed=len(batch) + split_limit)
    assert int((expert_id == split_expert).sum()) == len(split_tokens)
    ref = reference_split_layer(store, 1, hidden, token_idx, expert_id, weight, split_expert, split_limit)
    out = torch.full(ref.shape, float("nan"))
    stats = ExpertKernel(store, kernel=kernel, num_threads=3)(1, hidden, token_idx, expert_id, weight, out,
                                                              split_expert=split_expert, split_limit=split_limit)
    assert stats.num_experts == len(set(expert_id.tolist()))
    assert stats.weight_bytes == split_weight_bytes(store, expert_id, split_expert, split_limit)
    tol = BF16_PATH_TOL if kernel in BF16_PATHS else FP32_PATH_TOL
    err = rel_max_error(out, ref)
    assert err <= tol, f"{kernel}: max error {err:.2e} of the output scale, allowed {tol:.2e}"
    whole = reference_moe_layer(store, 1, hidden, token_idx, expert_id, weight)
    if split_tokens:      # the tolerance sees a split that was ignored (or applied to the wrong channels)
        assert rel_max_error(out, whole) > 4 * tol
    else:
        assert rel_max_error(out, whole) <= tol


@pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")
@pytest.mark.parametrize("kernel", NATIVE_KERNELS)
def test_split_is_deterministic_across_thread_counts(split_store, kernel):
    """Phase-1 work items differ per group with a split: any thread count computes each element the same way."""
    store = split_store
    hidden, token_idx, expert_id, weight = make_split_batch(store, 12, 3, range(6), 1, torch.bfloat16, seed=21)
    outs = []
    for threads in (1, 2, 3, 5, 8):
        out = torch.full(hidden.shape, float("nan"))
        ExpertKernel(store, kernel=kernel, num_threads=threads)(0, hidden, token_idx, expert_id, weight, out,
                                                                split_expert=1, split_limit=64)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("kernel", ["torch", *(["native"] if NATIVE else [])])
def test_zero_split_limit_ignores_split_expert(split_store, kernel):
    store = split_store
    hidden, token_idx, expert_id, weight = make_split_batch(store, 5, 2, (0, 2), 3, torch.bfloat16, seed=8)
    k = ExpertKernel(store, kernel=kernel, num_threads=2)
    plain = torch.empty(hidden.shape)
    k(0, hidden, token_idx, expert_id, weight, plain)
    for junk in (3, -7, store.num_experts + 5):
        out = torch.empty(hidden.shape)
        stats = k(0, hidden, token_idx, expert_id, weight, out, split_expert=junk, split_limit=0)
        assert torch.equal(out, plain) and stats.weight_bytes == stats.num_experts * store.expert_bytes


def bad_splits(store: ExpertStore) -> list[tuple[int, int, str]]:
    """(split_expert, split_limit, what the error names)"""
    inter, experts = store.shape.intermediate, store.num_experts
    return [(0, -32, "split_limit -32"), (0, inter, f"split_limit {inter}"),
            (0, inter + 32, f"split_limit {inter + 32}"), (0, 48, "split_limit 48"), (0, 16, "split_limit 16"), (experts, 32, f"split_expert {experts}"),
            (-1, 32, "split_expert -1")]


@pytest.mark.parametrize("kernel", ["torch", *(["native"] if NATIVE else [])])
def test_invalid_split_is_refused_by_python(split_store, kernel):
    store = split_store
    hidden, token_idx, expert_id, weight = make_split_batch(store, 3, 1, (0,), 0, torch.bfloat16, seed=4)
    k = ExpertKernel(store, kernel=kernel, num_threads=1)
    for split_expert, split_limit, named in bad_splits(store):
        out = torch.full(hidden.shape, 7.0)
        with pytest.raises(ValueError, match=named):
            k(0, hidden, token_idx, expert_id, weight, out, split_expert=split_expert, split_limit=split_limit)
        with pytest.raises(ValueError, match=named):
            torch_moe_layer(store, 0, hidden, token_idx, expert_id, weight, out, split_expert, split_limit)
        assert bool((out == 7.0).all())                   # refused before anything was written


@pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")
@pytest.mark.parametrize("isa", range(NATIVE.best_isa + 1) if NATIVE else [])
def test_invalid_split_is_refused_by_the_compiled_kernel(split_store, isa):
    """ft_moe_layer itself returns ERR_BAD_ARGS (-5), before writing out; the binding raises ValueError."""
    store = split_store
    shape = store.shape
    hidden, token_idx, expert_id, weight = make_split_batch(store, 3, 1, (0,), 0, torch.bfloat16, seed=4)
    out = torch.full(hidden.shape, 7.0)
    stats = (ctypes.c_int64 * 2)()
    args = (isa, 2, store.data_ptr + store.expert_offset(0, 0), store.expert_stride, shape.num_experts, shape.hidden,
            shape.intermediate, hidden.data_ptr(), 1, 3, token_idx.data_ptr(), expert_id.data_ptr(),
            weight.data_ptr(), token_idx.numel(), out.data_ptr())
    for split_expert, split_limit, _ in bad_splits(store):
        assert NATIVE._lib.ft_moe_layer(*args, ctypes.addressof(stats), split_expert, split_limit, None) == -5
        with pytest.raises(ValueError, match="invalid split"):
            NATIVE.moe_layer(*args, split_expert=split_expert, split_limit=split_limit)
        assert bool((out == 7.0).all())
    assert NATIVE._lib.ft_moe_layer(*args, ctypes.addressof(stats), 0, 32, None) == 0     # the same call, valid
    assert stats[1] == 3 * 32 * shape.hidden * 2 * int((expert_id == 0).any()) + 3 * shape.intermediate * \
        shape.hidden * 2 * len(set(expert_id.tolist()) - {0})
