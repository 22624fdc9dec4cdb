"""The int8-activation path of the quantized kernel (native/quant_int8.h: int4, mxfp4, nvfp4 on AVX-512 VNNI) in
lockstep with the plain reference of the same maths (cpu_expert_pool/reference.py: quantize_activations_int8, blocks
of 16 values, int8, an fp32 scale each; then float64), and within a stated bound of the fp32-activation reference.

Lockstep, tolerance TOL = 1e-5 of the output's largest magnitude: the integer products are exact, so what is left is
fp32 arithmetic (the group x block scale products, the sums over blocks, int4's zero points taken out through
the groups' fp32 sums; observed 1e-7 to 5e-7). The dot products
are checked that way through the ft_quant_dot_i8 hook over a table of shapes (K not a multiple of the 256-value
super-block, an odd number of rows, 1..8 tokens). The tolerance sees the mistakes the scheme could make (a scale per
row instead of per block, a zero point or the fp4 offset not taken out, unquantized activations): each moves the
result by more than 100 x TOL (test_the_tolerance_sees_a_wrong_scale_or_offset).

The layer (ExpertKernel: several experts a call, a split expert, every format, silu and gpt-oss experts) quantizes
h again after the activation, and the C code's fp32 h and the reference's float64 h can fall on two sides of a
rounding boundary (seen: 6e-5 of the output scale in one case of 84); LAYER_TOL = 2e-3 of the output's largest
magnitude leaves room for a few such values and is still 5x below the error of unquantized activations.

Against the fp32-activation reference (what act_quant="fp32" computes): relative L2 error of the layer's output at
most BOUND = 3% (measured about 1.0% with Gaussian activations, 1.3% with outlier channels, docs/QUANTIZATION.md).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel
from ftexpert.cpu_expert_pool.native.build import NativeUnavailable, build_library
from ftexpert.cpu_expert_pool.native.quant_desc import QuantBindings, quant_format_desc
from ftexpert.cpu_expert_pool.reference import expert_weights, int8_activations, reference_moe_layer
from ftexpert.kernels.expert_reference import dequantize_expert
from tests.cpu_expert_pool.cpu_pool_util import GPT_OSS
from tests.cpu_expert_pool.test_cpu_pool_quant import (E, NATIVE, NATIVE_DIR, SIMDE_HEADER, make_batch, make_store,
                                                       rel_err)

INT8 = NATIVE is not None and NATIVE.quant.int8_available
needs_int8 = pytest.mark.skipif(not INT8, reason="no compiled kernel or no AVX-512 VNNI here")
TOL = 1e-5
LAYER_TOL = 2e-3
BOUND = 0.03
# fmt -> (H, I): K below, at and past one super-block (256 values), not a multiple of it, odd groups
SHAPES = {"int4-g32": (288, 96), "int4-g64": (320, 192), "int4-g128": (640, 128), "mxfp4": (544, 160),
          "nvfp4": (272, 48)}
FORMATS = list(SHAPES)


def make(fmt: str, act: str = "silu", seed: int = 0):
    import tests.cpu_expert_pool.test_cpu_pool_quant as q
    saved = q.SHAPES[fmt]
    q.SHAPES[fmt] = SHAPES[fmt]
    try:
        return make_store(fmt, seed=seed, act=act)
    finally:
        q.SHAPES[fmt] = saved


@pytest.fixture(scope="module", params=FORMATS)
def store(request):
    s = make(request.param)
    yield s
    s.close()
    s.unlink()


def activations(batch: int, K: int, seed: int) -> torch.Tensor:
    """[batch, K]: Gaussian, one block of zeros, a block with one large value, scales varying by block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, K, generator=g) * torch.exp(torch.randn(1, K // 16, generator=g)).repeat_interleave(16, 1)
    x[:, 16:32] = 0
    x[:, 40] *= 50
    return x.contiguous()


def dot_i8(lib: QuantBindings, store, matrix: str, row0: int, nrows: int, x: torch.Tensor) -> torch.Tensor:
    H, I = store.shape.hidden, store.shape.intermediate
    row = store.expert_bytes_view(1, 2)
    out = torch.full((x.shape[0], nrows), float("nan"))
    lib.dot_i8(quant_format_desc(store.shape.quant_layout, act_int8=True), row.data_ptr(), H, I, matrix, row0, nrows,
               x.data_ptr(), x.shape[0], out.data_ptr())
    return out


def matrices(store) -> dict[str, torch.Tensor]:
    return dict(zip(("gate", "up", "down"), dequantize_expert(store.expert_bytes_view(1, 2), store.shape.quant_layout)))


# ---------------------------------------------------------------------------------------------
# Dot products: lockstep
# ---------------------------------------------------------------------------------------------
@needs_int8
@pytest.mark.parametrize("batch", range(1, 9))
def test_dot_products_match_the_int8_reference(store, batch):
    for matrix, W in matrices(store).items():
        rows, K = W.shape
        row0, nrows = 1, rows - 1 if rows % 2 == 0 else rows - 2           # an odd number of rows from row 1
        x = activations(batch, K, seed=batch + rows)
        got = dot_i8(NATIVE.quant, store, matrix, row0, nrows, x)
        ref = int8_activations(x).double() @ W[row0:row0 + nrows].double().T
        assert rel_err(got, ref.float()) <= TOL, f"{store.shape.fmt} {matrix} B={batch}"


@needs_int8
def test_the_tolerance_sees_a_wrong_scale_or_offset(store):
    """References with the mistakes the kernel could make are far outside TOL of what it computes."""
    W = matrices(store)["gate"]
    x = activations(4, W.shape[1], seed=1)
    got = dot_i8(NATIVE.quant, store, "gate", 0, W.shape[0], x)
    xq = int8_activations(x).double()
    amax = x.abs().amax(1, keepdim=True)
    per_row = torch.round(x * (127 / amax)) * (amax / 127)                  # one scale a row, not a block
    layout, fmt = store.shape.quant_layout, store.expert_format
    s = dequantize_expert(store.expert_bytes_view(1, 2), layout)[0].double()
    wrong = {"fp32 activations": x.double() @ s.T, "a scale per row": per_row.double() @ s.T}
    G = fmt.group_size
    if fmt.name == "int4":                  # the zero point not taken out: weights (u - z) * s + z * s
        off, n = layout.regions["scales_w13"]
        scales = store.expert_bytes_view(1, 2)[off:off + n].view(torch.float32)[:W.numel() // G]
        zoff, _ = layout.regions["zeros_w13"]
        zeros = store.expert_bytes_view(1, 2)[zoff:zoff + W.numel() // G].double()
        shift = (scales.double() * zeros).reshape(W.shape[0], -1).repeat_interleave(G, 1)
    else:                                   # the fp4 offset (12, i.e. 6 in fp4 units) not taken out
        shift = 6 * (s.abs().reshape(W.shape[0], -1, G).amax(-1) / 6).repeat_interleave(G, 1)
    wrong["the offset or zero point left in"] = xq @ (s + shift).T
    for what, ref in wrong.items():
        assert rel_err(got, ref.float()) > 100 * TOL, what
    assert rel_err(got, (xq @ s.T).float()) <= TOL


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
BATCHES = {"B1": (1, 1, torch.bfloat16), "B4": (4, 1, torch.bfloat16), "T5-top3": (5, 3, torch.bfloat16),
           "B4-top2-x-fp32": (4, 2, torch.float32), "T3-all": (3, E, torch.bfloat16), "T8-all": (8, E, torch.float32)}


@needs_int8
@pytest.mark.parametrize("act", ["silu", GPT_OSS])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_layer_matches_the_int8_reference_and_stays_within_the_bound(store, act, batch):
    s = store if act == "silu" else make(store.shape.fmt, act=act, seed=1)
    try:
        hidden, tok, exp, w = make_batch(s, *BATCHES[batch], seed=len(batch))
        kernel = ExpertKernel(s, kernel="native", num_threads=2, act_quant="int8")
        assert kernel.activations == "int8"
        out = torch.full(hidden.shape, float("nan"))
        kernel(1, hidden, tok, exp, w, out)
        ref = reference_moe_layer(s, 1, hidden, tok, exp, w, dtype=torch.float64, act_int8=True)
        assert rel_err(out, ref) <= LAYER_TOL
        fp32 = reference_moe_layer(s, 1, hidden, tok, exp, w, dtype=torch.float64)
        rows = tok.unique().long()
        err = float((out[rows].double() - fp32[rows].double()).norm() / fp32[rows].double().norm())
        assert 1e-3 < err <= BOUND, f"relative L2 error {err:.2e} against the fp32-activation reference"
    finally:
        if s is not store:
            s.close()
            s.unlink()


@needs_int8
def test_split_expert_quantizes_its_prefix(store):
    inter = store.shape.intermediate
    c = 32
    hidden, tok, exp, w = make_batch(store, 4, 2, torch.bfloat16, seed=6)
    split_expert = int(exp[0])
    out = torch.empty(hidden.shape)
    ExpertKernel(store, kernel="native", num_threads=2, act_quant="int8")(1, hidden, tok, exp, w, out,
                                                                            split_expert=split_expert, split_limit=c)
    ref = torch.zeros(hidden.shape, dtype=torch.float64)
    xq = int8_activations(hidden).double()
    for k in range(tok.numel()):
        e = int(exp[k])
        lim = c if e == split_expert else inter
        w13, w2 = (v.double() for v in expert_weights(store, 1, e))
        x = xq[int(tok[k])]
        h = torch.nn.functional.silu(w13[:lim] @ x) * (w13[inter:inter + lim] @ x)
        ref[int(tok[k])] += float(w[k]) * int8_activations(h).double() @ w2[:, :lim].T
    assert rel_err(out, ref) <= LAYER_TOL


@needs_int8
def test_results_do_not_depend_on_the_thread_count(store):
    hidden, tok, exp, w = make_batch(store, 5, 3, torch.bfloat16, seed=8)
    outs = []
    for threads in (1, 2, 3, 7):
        out = torch.empty(hidden.shape)
        ExpertKernel(store, kernel="native", num_threads=threads, act_quant="int8")(1, hidden, tok, exp, w, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# ---------------------------------------------------------------------------------------------
# The setting and the dispatcher
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(NATIVE is None, reason="compiled kernel unavailable")
def test_auto_picks_int8_where_vnni_runs_and_fp32_elsewhere(store, monkeypatch):
    assert ExpertKernel(store, kernel="native").activations == ("int8" if INT8 else "fp32")
    assert ExpertKernel(store, kernel="native", act_quant="fp32").activations == "fp32"
    assert ExpertKernel(store, kernel="native-avx2").activations == "fp32"            # AVX2 keeps the fp32 path
    with pytest.raises(ValueError, match="not avx512"):
        ExpertKernel(store, kernel="native-avx2", act_quant="int8")
    with pytest.raises(ValueError, match="act_quant 'int4' is not known"):
        ExpertKernel(store, act_quant="int4")
    monkeypatch.setattr(NATIVE.quant, "int8_available", False)                     # a CPU without VNNI
    assert ExpertKernel(store, kernel="native").activations == "fp32"
    with pytest.raises(ValueError, match="no AVX-512 VNNI"):
        ExpertKernel(store, kernel="native", act_quant="int8")


@pytest.mark.skipif(NATIVE is None, reason="compiled kernel unavailable")
def test_fp8_and_bf16_stores_keep_fp32_activations():
    s = make_store("fp8")
    try:
        assert ExpertKernel(s, kernel="native").activations == "fp32"
        with pytest.raises(ValueError, match="not a 4-bit format"):
            ExpertKernel(s, kernel="native", act_quant="int8")
        desc = quant_format_desc(s.shape.quant_layout)
        desc.act_int8 = 1                                                          # the C side refuses it too
        hidden, tok, exp, w = make_batch(s, 1, 1, torch.bfloat16, seed=1)
        from tests.cpu_expert_pool.test_cpu_pool_quant import call_raw
        with pytest.raises(ValueError, match="quantized format descriptor"):
            call_raw(NATIVE.quant, desc, 2, s, 0, hidden, tok, exp, w)
    finally:
        s.close()
        s.unlink()


@needs_int8
def test_the_c_side_refuses_int8_below_avx512(store):
    from tests.cpu_expert_pool.test_cpu_pool_quant import call_raw
    hidden, tok, exp, w = make_batch(store, 1, 1, torch.bfloat16, seed=1)
    desc = quant_format_desc(store.shape.quant_layout, act_int8=True)
    with pytest.raises(ValueError, match="ISA"):
        call_raw(NATIVE.quant, desc, 1, store, 0, hidden, tok, exp, w)


# ---------------------------------------------------------------------------------------------
# The same code on emulated intrinsics (SIMDe), where its headers are installed
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emulated():
    if not SIMDE_HEADER.exists():
        pytest.skip("SIMDe headers absent (apt-get install libsimde-dev): the int8 path is not emulated")
    try:
        path = build_library(sources=(NATIVE_DIR / "quant_ffn.c",), stem="libft_quant_emulated",
                             headers=tuple(NATIVE_DIR / f for f in ("expert_act.h", "quant_dots.h", "quant_avx512.h",
                                                                    "quant_avx2.h", "quant_int8.h", "simde_shim.h",
                                                                    "phase_times.h")),
                             extra_flags=("-DFT_EMULATE_AVX512",))
    except NativeUnavailable as exc:
        pytest.fail(f"the emulated build failed: {exc}")
    return QuantBindings(ctypes.CDLL(str(path)))


def test_emulated_int8_path_matches_the_reference(store, emulated):
    from tests.cpu_expert_pool.test_cpu_pool_quant import call_raw
    for batch in ("B1", "T5-top3"):
        hidden, tok, exp, w = make_batch(store, *BATCHES[batch], seed=2)
        out, _ = call_raw(emulated, quant_format_desc(store.shape.quant_layout, act_int8=True), 2, store, 1,
                          hidden, tok, exp, w)
        ref = reference_moe_layer(store, 1, hidden, tok, exp, w, torch.float64, act_int8=True)
        assert rel_err(out, ref) <= LAYER_TOL
    W = matrices(store)["down"]
    x = activations(3, W.shape[1], seed=3)
    got = dot_i8(emulated, store, "down", 0, W.shape[0], x)
    assert rel_err(got, (int8_activations(x).double() @ W.double().T).float()) <= TOL


# ---------------------------------------------------------------------------------------------
# The activations' quantizer: the vector one writes the plain one's bytes
# ---------------------------------------------------------------------------------------------
def quantizer_inputs(batch: int, K: int, seed: int) -> np.ndarray:
    """Gaussian rows with block scales from 1e-6 to 1e4, a zero block, an outlier, and a block of exact ties (its
    amax 127, so each value x.5 is x.5 after scaling and must round to even)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, K)) * 10.0 ** np.repeat(rng.integers(-6, 5, (K + 15) // 16), 16)[:K]
    x[:, 16:32] = 0
    x[:, 5::97] *= 50
    if K >= 48:
        x[:, 32:48] = [127, 2.5, 3.5, -0.5, 0.5, -1.5, 1.5, 126.5, -126.5, 64.5, -64.5, 0.49999997, 5.5, -5.5, 7.5, 8.5]
    return x.astype(np.float32)


@needs_int8
@pytest.mark.parametrize("fmt,G", [("int4", 32), ("int4", 128), ("int4", 64), ("mxfp4", 32), ("nvfp4", 16)])
@pytest.mark.parametrize("K", [16, 17, 255, 256, 272, 768, 2048, 2880])
def test_the_vector_quantizer_writes_the_plain_quantizers_bytes(fmt, G, K):
    x = quantizer_inputs(3, K, seed=K + G)
    plain = NATIVE.quant.q8_rows(fmt, G, x, plain=True)
    assert plain.shape[1] >= K and plain.any()
    np.testing.assert_array_equal(NATIVE.quant.q8_rows(fmt, G, x, plain=False), plain)


def test_the_emulated_vector_quantizer_writes_the_plain_quantizers_bytes(emulated):
    for fmt, G, K in (("int4", 32, 288), ("mxfp4", 32, 2880), ("nvfp4", 16, 272)):
        x = quantizer_inputs(2, K, seed=K)
        np.testing.assert_array_equal(emulated.q8_rows(fmt, G, x, plain=False), emulated.q8_rows(fmt, G, x, plain=True))


def test_the_quantizer_hook_refuses_an_unknown_group():
    if NATIVE is None:
        pytest.skip("no compiled kernel")
    with pytest.raises(ValueError, match="ft_quant_q8_rows"):
        NATIVE.quant.q8_rows("mxfp4", 24, np.zeros((1, 64), np.float32), plain=True)
