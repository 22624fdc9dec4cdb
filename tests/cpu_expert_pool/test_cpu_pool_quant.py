"""The compiled kernel over quantized experts (native/quant_ffn.c) in lockstep with the plain reference
(kernels.expert_reference.dequantize_expert, then float64 math), for every format, odd group counts, batch 1 and 4,
every ISA path this CPU has (the portable C one always), the AVX-512 code on emulated intrinsics where SIMDe's
headers are installed, through ExpertKernel, the raw binding and the C serve loop; silu experts and gpt-oss's
(biased, clamped SwiGLU, with gate / up large enough that the clamp bites: test_the_activation_is_seen); and its
decoders bit for bit against dequantize_matrix.

These tests pin act_quant="fp32" (the fp32-activation path); the int8-activation path (the default of the 4-bit
formats on AVX-512 VNNI CPUs) has its own lockstep tests: test_cpu_pool_int8.py.

Tolerance: TOL = 1e-5 of the output's largest magnitude. The kernel's dequantized weights equal the reference's
exactly (test_decoders_are_bit_exact; the dot products use the same decoders), so what is left is fp32 arithmetic
against float64: sums over K <= 384 terms in the vector lanes' order (about sqrt(K) * 2**-24 of the terms' scale:
observed 1e-7 to 1e-6) and expf in silu. A decoding error (a neighbour group's scale, a zero point
dropped, nibbles swapped) moves the output by percents (test_the_tolerance_sees_a_decoding_error).
"""
from __future__ import annotations

import os
import queue
import threading
import types
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel
from ftexpert.cpu_expert_pool.native.act_desc import expert_act_desc
from ftexpert.cpu_expert_pool.native.build import ISA_NAMES, NativeUnavailable, build_library, try_load_native
from ftexpert.cpu_expert_pool.native.quant_desc import QuantBindings, QuantFormatDesc, quant_format_desc
from ftexpert.cpu_expert_pool.reference import expert_weights, reference_moe_layer
from ftexpert.kernels.expert_reference import apply_act, dequantize_expert, quantize_expert
from ftexpert.proto.expert_store import ExpertStore
from tests.cpu_expert_pool.cpu_pool_util import BIASED_GAIN, GPT_OSS, check_act_is_seen, fill_biases

NATIVE, WHY_NOT = try_load_native()
pytestmark = pytest.mark.skipif(NATIVE is None, reason=f"compiled kernel unavailable: {WHY_NOT}")
QUANT_ISAS = list(range(min(NATIVE.best_isa, 2) + 1)) if NATIVE else []       # scalar, avx2, avx512 where present
NATIVE_DIR = Path(__file__).resolve().parents[2] / "src" / "ftexpert" / "cpu_expert_pool" / "native"
SIMDE_HEADER = Path("/usr/include/simde/x86/avx512.h")
TOL = 1e-5

# fmt -> (H, I): odd numbers of groups / blocks, and fp8 / nvfp4 rows that end in a partial block.
SHAPES = {"fp8": (328, 136), "int4-g32": (96, 160), "int4-g64": (192, 64), "int4-g128": (384, 128),
          "mxfp4": (96, 160), "nvfp4": (48, 80)}
FORMATS = list(SHAPES)
# store -> (format, activation, compute dtype): every format with silu experts and with gpt-oss's (bf16 biases), and
# gpt-oss's biases in the other compute dtypes
STORES = {**{f: (f, "silu", torch.bfloat16) for f in FORMATS}, **{f"{f}-gpt-oss": (f, GPT_OSS, torch.bfloat16)
                                                                  for f in FORMATS},
          "mxfp4-gpt-oss-fp32": ("mxfp4", GPT_OSS, torch.float32), "int4-g32-gpt-oss-fp16": ("int4-g32", GPT_OSS,
                                                                                             torch.float16)}
E, L = 5, 2
# (T, experts per token, x dtype)
# (T, experts per token, x dtype); "-all": every token uses every expert, so each expert gets T tokens (the kernel
# decodes a weight vector once for a register block of up to 4 tokens: 5 is a full block and one more)
BATCHES = {"B1": (1, 1, torch.bfloat16), "B4": (4, 1, torch.bfloat16), "T5-top3": (5, 3, torch.bfloat16),
           "B4-top2-x-fp32": (4, 2, torch.float32), "T2-all": (2, E, torch.bfloat16), "T3-all": (3, E, torch.bfloat16),
           "T4-all": (4, E, torch.float32), "T5-all": (5, E, torch.bfloat16)}


def fill_expert(row: torch.Tensor, store: ExpertStore, g: torch.Generator) -> None:
    shape, fmt = store.shape, store.expert_format
    H, I = shape.hidden, shape.intermediate
    gain = BIASED_GAIN if shape.expert_act.bias else 1.0
    gate, up = (gain * torch.randn(I, H, generator=g) / H ** 0.5 for _ in range(2))
    down = torch.randn(H, I, generator=g) / I ** 0.5
    quantize_expert(gate, up, down, fmt, out=row)
    if fmt.name == "int4":        # the quantizer is symmetric (zero 8): give every group its own zero point
        for region in ("zeros_w13", "zeros_w2"):
            off, n = shape.quant_layout.regions[region]
            row[off:off + n] = torch.randint(4, 12, (n,), generator=g, dtype=torch.uint8)


def make_store(fmt: str, seed: int = 0, act: str = "silu", dtype: torch.dtype = torch.bfloat16) -> ExpertStore:
    H, I = SHAPES[fmt]
    store = ExpertStore.create(f"ft-test-quant-{os.getpid()}-{uuid.uuid4().hex[:8]}", num_layers=L, num_experts=E,
                               hidden=H, intermediate=I, dtype=dtype, config_hash="q", fmt=fmt, act=act)
    g = torch.Generator().manual_seed(seed + H * 7 + I)
    for layer in range(L):
        view = store.layer_view(layer)
        for e in range(E):
            fill_expert(view[e], store, g)
            if store.shape.expert_act.bias:
                fill_biases(store, layer, e, g)
    store.mark_ready()
    return store


@pytest.fixture(scope="module", params=list(STORES))
def store(request):
    fmt, act, dtype = STORES[request.param]
    s = make_store(fmt, act=act, dtype=dtype)
    yield s
    s.close()
    s.unlink()


def make_batch(store: ExpertStore, num_tokens: int, per_token: int, hidden_dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, store.shape.hidden, generator=g).to(hidden_dtype)          # [T, H]
    expert_id = torch.stack([torch.randperm(E, generator=g)[:per_token] for _ in range(num_tokens)]).flatten().int()
    token_idx = torch.arange(num_tokens, dtype=torch.int32).repeat_interleave(per_token)
    weight = torch.rand(token_idx.numel(), generator=g, dtype=torch.float32)
    return hidden, token_idx, expert_id, weight


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def call_raw(lib: QuantBindings, desc: QuantFormatDesc, isa: int, store: ExpertStore, layer: int, hidden, tok, exp, w,
             threads: int = 2, split_expert: int = -1, split_limit: int = 0):
    out = torch.full(hidden.shape, float("nan"))
    stats = lib.moe_layer(desc, isa, threads, store.data_ptr + store.expert_offset(layer, 0), store.expert_stride, E,
                          store.shape.hidden, store.shape.intermediate, hidden.data_ptr(),
                          hidden.dtype == torch.bfloat16, hidden.shape[0], tok.data_ptr(), exp.data_ptr(),
                          w.data_ptr(), tok.numel(), out.data_ptr(), split_expert, split_limit,
                          act=expert_act_desc(store.shape))
    return out, stats


@pytest.fixture(scope="module")
def emulated():
    """quant_ffn.c built with FT_EMULATE_AVX512: its AVX-512 code on SIMDe (apt-get install libsimde-dev)."""
    if not SIMDE_HEADER.exists():
        pytest.skip("SIMDe headers absent (apt-get install libsimde-dev): the AVX-512 code is not emulated")
    try:
        path = build_library(sources=(NATIVE_DIR / "quant_ffn.c",), stem="libft_quant_emulated",
                             headers=tuple(NATIVE_DIR / f for f in ("expert_act.h", "quant_dots.h", "quant_avx512.h",
                                                                    "quant_avx2.h", "quant_int8.h", "simde_shim.h",
                                                                    "phase_times.h")),
                             extra_flags=("-DFT_EMULATE_AVX512",))
    except NativeUnavailable as exc:
        pytest.fail(f"the emulated AVX-512 build failed: {exc}")
    import ctypes
    return QuantBindings(ctypes.CDLL(str(path)))


# ---------------------------------------------------------------------------------------------
# Decoders: bit for bit
# ---------------------------------------------------------------------------------------------
def adversarial_expert(store: ExpertStore, g: torch.Generator) -> torch.Tensor:
    """Random bytes everywhere (every code, E8M0 / E4M3 scale byte and zero point, NaN codes too), fp32 scales
    drawn across magnitudes, including subnormal ones and ones whose 256x overflows (fp8's fallback)."""
    layout = store.shape.quant_layout
    row = torch.randint(0, 256, (layout.expert_nbytes,), generator=g, dtype=torch.uint8)
    if store.expert_format.name in ("fp8", "int4"):
        for region in ("scales_w13", "scales_w2"):
            off, n = layout.regions[region]
            mag = torch.exp2(torch.randint(-140, 128, (n // 4,), generator=g).float())
            sign = torch.where(torch.rand(n // 4, generator=g) < .2, -1, 1)
            scales = mag * (torch.rand(n // 4, generator=g) + 0.5) * sign
            row[off:off + n] = scales.view(torch.uint8)
    if store.expert_format.name == "nvfp4":
        off, n = layout.regions["globals"]
        row[off:off + n] = torch.tensor([0.013, 3.5e-4, 7.0], dtype=torch.float32).view(torch.uint8)
    return row


def same_bits(got: torch.Tensor, ref: torch.Tensor) -> bool:
    nan = torch.isnan(ref)
    bits_equal = torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    return bool((torch.isnan(got) == nan).all()) and bits_equal


def check_decoders(lib: QuantBindings, isa: int, store: ExpertStore, row: torch.Tensor) -> None:
    layout = store.shape.quant_layout
    desc = quant_format_desc(layout)
    H, I = store.shape.hidden, store.shape.intermediate
    for name, ref in zip(("gate", "up", "down"), dequantize_expert(row, layout)):
        got = torch.full(ref.shape, 123.0)
        lib.dequantize_rows(desc, isa, row.data_ptr(), H, I, name, 0, ref.shape[0], got.data_ptr())
        assert same_bits(got, ref), f"{store.shape.fmt} {name}: {ISA_NAMES[isa]} decodes differently"


@pytest.mark.parametrize("isa", QUANT_ISAS, ids=[ISA_NAMES[i] for i in QUANT_ISAS])
def test_decoders_are_bit_exact(store, isa):
    g = torch.Generator().manual_seed(isa + 1)
    check_decoders(NATIVE.quant, isa, store, store.expert_bytes_view(1, 3))      # as quantized
    check_decoders(NATIVE.quant, isa, store, adversarial_expert(store, g))


def test_emulated_avx512_decoders_are_bit_exact(store, emulated):
    g = torch.Generator().manual_seed(9)
    check_decoders(emulated, 2, store, store.expert_bytes_view(0, 2))
    check_decoders(emulated, 2, store, adversarial_expert(store, g))


# ---------------------------------------------------------------------------------------------
# The layer: lockstep with the reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("isa", QUANT_ISAS, ids=[f"native-{ISA_NAMES[i]}" for i in QUANT_ISAS])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_kernel_matches_the_reference(store, isa, batch):
    hidden, tok, exp, w = make_batch(store, *BATCHES[batch], seed=len(batch) + isa)
    ref = reference_moe_layer(store, 1, hidden, tok, exp, w, dtype=torch.float64)
    out = torch.full(ref.shape, float("nan"))
    kernel = ExpertKernel(store, kernel=f"native-{ISA_NAMES[isa]}", num_threads=2, act_quant="fp32")
    stats = kernel(1, hidden, tok, exp, w, out)
    assert kernel.name == f"native-{ISA_NAMES[isa]}"
    assert stats.num_experts == len(set(exp.tolist())) and stats.weight_bytes == stats.num_experts * store.expert_bytes
    err = rel_err(out, ref)
    assert err <= TOL, f"{store.shape.fmt} native-{ISA_NAMES[isa]}: max error {err:.2e} of the output scale"
    untouched = torch.ones(ref.shape[0], dtype=torch.bool)
    untouched[tok.long()] = False
    assert bool((out[untouched] == 0).all())


@pytest.mark.parametrize("batch", ["B1", "B4", "T5-top3", "T2-all", "T5-all"])
def test_emulated_avx512_matches_the_reference(store, emulated, batch):
    hidden, tok, exp, w = make_batch(store, *BATCHES[batch], seed=3)
    ref = reference_moe_layer(store, 0, hidden, tok, exp, w, dtype=torch.float64)
    out, _ = call_raw(emulated, quant_format_desc(store.shape.quant_layout), 2, store, 0, hidden, tok, exp, w)
    assert rel_err(out, ref) <= TOL


def rare_scales(store: ExpertStore, g: torch.Generator, nan: bool) -> None:
    """Layer 0's scales across the decoders' special cases: fp8 / int4 fp32 scales from subnormal to >= 2**8 (fp8's
    general decoder), E8M0 0 (2**-127) among 2**-17 .. 2**8, E4M3 scales with subnormal codes; int4 zero points
    0 .. 15. With nan, expert 0 gets one NaN weight (fp8 code 0x7f, int4 scale NaN, mxfp4 scale 255 (inf, times a
    zero code NaN), nvfp4 scale 0x7f)."""
    layout, name = store.shape.quant_layout, store.expert_format.name
    view = store.layer_view(0)
    for e in range(E):
        row = view[e]
        for region in ("scales_w13", "scales_w2"):
            off, n = layout.regions[region]
            if name in ("fp8", "int4"):
                mag = torch.exp2(torch.randint(-140, 10, (n // 4,), generator=g).float())
                scales = mag * (torch.rand(n // 4, generator=g) + 0.5)
                row[off:off + n] = scales.view(torch.uint8)
            elif name == "mxfp4":
                codes = torch.randint(110, 136, (n,), generator=g, dtype=torch.uint8)
                row[off:off + n] = torch.where(torch.rand(n, generator=g) < .1, 0, codes).to(torch.uint8)
            else:
                mag = torch.randint(1, 0x7f, (n,), generator=g, dtype=torch.uint8)
                row[off:off + n] = mag | (torch.rand(n, generator=g) < .3).to(torch.uint8) * 0x80
        if name == "int4":
            for region in ("zeros_w13", "zeros_w2"):
                off, n = layout.regions[region]
                row[off:off + n] = torch.randint(0, 16, (n,), generator=g, dtype=torch.uint8)
    if nan:
        row = view[0]
        off = layout.regions["codes_w13" if name == "fp8" else "scales_w13"][0]
        if name == "fp8":
            row[off + 5] = 0x7f
        elif name == "int4":
            row[off:off + 4] = torch.tensor([float("nan")]).view(torch.uint8)
        else:
            row[off] = 255 if name == "mxfp4" else 0x7f


@pytest.mark.parametrize("isa", [*QUANT_ISAS, "emulated"])
@pytest.mark.parametrize("nan", [False, True], ids=["rare-scales", "nan"])
def test_kernel_matches_the_reference_at_rare_scales_and_nan(request, isa, nan):
    lib, isa_id = (request.getfixturevalue("emulated"), 2) if isa == "emulated" else (NATIVE.quant, isa)
    for label in FORMATS:
        s = make_store(label, seed=11)
        try:
            rare_scales(s, torch.Generator().manual_seed(12), nan)
            hidden, tok, exp, w = make_batch(s, 5, 2, torch.bfloat16, seed=13)
            exp[:2] = 0                                             # token 0 uses expert 0 (the NaN one)
            ref = reference_moe_layer(s, 0, hidden, tok, exp, w, dtype=torch.float64)
            out, _ = call_raw(lib, quant_format_desc(s.shape.quant_layout), isa_id, s, 0, hidden, tok, exp, w)
            finite = torch.isfinite(ref)
            assert torch.equal(torch.isfinite(out), finite), f"{label}: non-finite outputs differ"
            assert bool(finite.any()) and bool(finite.all()) != nan, f"{label}: the case is not what it says"
            err = float((out[finite] - ref[finite]).abs().max() / ref[finite].abs().max())
            assert err <= TOL, f"{label} isa {isa}: max error {err:.2e} of the output scale"
        finally:
            s.close()
            s.unlink()


def test_the_tolerance_sees_a_decoding_error(store):
    """The reference of the expert with one group's scale taken from its neighbour is far outside TOL."""
    hidden, tok, exp, w = make_batch(store, 1, 1, torch.bfloat16, seed=4)
    out = torch.empty(hidden.shape)
    ExpertKernel(store, kernel="native", num_threads=1, act_quant="fp32")(0, hidden, tok, exp, w, out)
    w13, w2 = expert_weights(store, 0, int(exp[0]))
    group = 128 if store.expert_format.name == "fp8" else store.expert_format.group_size
    wrong = w13.clone()
    wrong[:, :group] = w13[:, :group] * 1.5                       # as if the first group's scale were off by 1.5
    x = hidden[0].double()
    shape = store.shape
    b13, b2 = (store.expert_biases(0, int(exp[0])) if shape.expert_act.bias
               else (torch.zeros(2 * shape.intermediate), torch.zeros(shape.hidden)))
    gu = wrong.double() @ x + b13.double()
    ref_wrong = float(w[0]) * (apply_act(gu, shape.expert_act) @ w2.double().T + b2.double())
    assert rel_err(out[0], ref_wrong.float()) > 100 * TOL


def test_the_activation_is_seen(store):
    """gpt-oss stores: dropping either clamp or any bias moves the reference far beyond TOL."""
    if not store.shape.expert_act.bias:
        pytest.skip("silu experts have no clamp and no biases")
    for batch in ("T5-top3", "T5-all"):
        check_act_is_seen(store, 1, make_batch(store, *BATCHES[batch], seed=len(batch)), 100 * TOL)


@pytest.mark.parametrize("isa", QUANT_ISAS, ids=[ISA_NAMES[i] for i in QUANT_ISAS])
def test_split_expert_reads_a_prefix_of_the_channels(store, isa):
    inter = store.shape.intermediate
    c = 32 if inter > 32 else 0
    if not c:
        pytest.skip("I = 32 leaves no split")
    hidden, tok, exp, w = make_batch(store, 4, 2, torch.bfloat16, seed=6)
    split_expert = int(exp[0])
    if store.shape.expert_act.bias:               # the down bias belongs to one side: refused, by Python and by C
        with pytest.raises(ValueError, match="not split by channels"):
            ExpertKernel(store, kernel=f"native-{ISA_NAMES[isa]}", act_quant="fp32")(
                1, hidden, tok, exp, w, torch.empty(hidden.shape), split_expert=split_expert, split_limit=c)
        with pytest.raises(ValueError, match="invalid split"):
            call_raw(NATIVE.quant, quant_format_desc(store.shape.quant_layout), isa, store, 1, hidden, tok, exp, w,
                     split_expert=split_expert, split_limit=c)
        return
    out, stats = call_raw(NATIVE.quant, quant_format_desc(store.shape.quant_layout), isa, store, 1, hidden, tok, exp, w,
                          split_expert=split_expert, split_limit=c)
    ref = torch.zeros(hidden.shape, dtype=torch.float64)
    for k in range(tok.numel()):
        e = int(exp[k])
        lim = c if e == split_expert else inter
        w13, w2 = (v.double() for v in expert_weights(store, 1, e))
        x = hidden[int(tok[k])].double()
        h = torch.nn.functional.silu(w13[:lim] @ x) * (w13[inter:inter + lim] @ x)
        ref[int(tok[k])] += float(w[k]) * h @ w2[:, :lim].T
    assert rel_err(out, ref.float()) <= TOL
    others = len(set(exp.tolist())) - 1
    assert stats == (others + 1, others * store.expert_bytes + store.expert_bytes * c // inter)


def test_results_do_not_depend_on_the_thread_count(store):
    hidden, tok, exp, w = make_batch(store, 5, 3, torch.bfloat16, seed=8)
    outs = []
    for threads in (1, 2, 3, 7):
        out = torch.empty(hidden.shape)
        ExpertKernel(store, kernel="native", num_threads=threads, act_quant="fp32")(1, hidden, tok, exp, w, out)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# ---------------------------------------------------------------------------------------------
# Choice of kernel and refusals
# ---------------------------------------------------------------------------------------------
def test_native_picks_the_widest_quantized_path_and_refuses_bf16_only_isas(store):
    assert ExpertKernel(store, kernel="native", num_threads=1).name == f"native-{ISA_NAMES[QUANT_ISAS[-1]]}"
    for isa_name in ("avx512_bf16", "amx_bf16"):
        with pytest.raises(ValueError, match=f"no {isa_name} path"):
            ExpertKernel(store, kernel=f"native-{isa_name}")


def test_a_descriptor_that_does_not_fit_is_refused(store):
    hidden, tok, exp, w = make_batch(store, 2, 1, torch.bfloat16, seed=1)
    layout = store.shape.quant_layout
    bad = {"group_size": 48, "format": 9, "expert_bytes": store.expert_stride + 4096,
           "scales_w2": layout.expert_nbytes - 2, "zeros_w13": 0 if store.expert_format.name != "int4" else -1}
    for field, value in bad.items():
        desc = quant_format_desc(layout)
        setattr(desc, field, value)
        with pytest.raises(ValueError, match="quantized format descriptor"):
            call_raw(NATIVE.quant, desc, 0, store, 0, hidden, tok, exp, w)


# ---------------------------------------------------------------------------------------------
# The C serve loop and the worker's loop
# ---------------------------------------------------------------------------------------------
def _rig(store: ExpertStore):
    from ftexpert.proto.cpu_channel import CpuPoolClient
    from ftexpert.proto.shm_layout import create_worker_channel
    from ftexpert.cpu_expert_pool.channel import WorkerChannel

    seg = create_worker_channel(f"{store.name}.cpu0-{uuid.uuid4().hex[:6]}", t_max=8, hidden=store.shape.hidden,
                                max_triples=16)
    wc = WorkerChannel(seg.name)
    wc.start()
    wc.serve()
    client = CpuPoolClient(seg.name)
    client.wait_for_worker(timeout_s=5.0)
    yield wc, client
    client.close()
    wc.close()
    seg.close()
    seg.unlink()


@pytest.fixture
def rig(store):
    yield from _rig(store)


@pytest.fixture
def nvfp4_rig():
    """One format is enough for the worker's loop (its kernel call is the one tested above for every format)."""
    s = make_store("nvfp4", seed=5)
    channel = _rig(s)
    yield (s, *next(channel))
    next(channel, None)                                   # its teardown
    s.close()
    s.unlink()


def test_serve_loop_answers_like_the_reference(store, rig):
    import time

    from ftexpert.cpu_expert_pool.native_loop import SERVE_IDLE
    from ftexpert.cpu_expert_pool.worker import WorkerStats

    wc, client = rig
    kernel = ExpertKernel(store, kernel="native", num_threads=2, act_quant="fp32")
    loop = kernel.serve_loop(wc, split=None, worker_index=0)
    batches = {layer: make_batch(store, 1 + 3 * layer, 2, torch.bfloat16, seed=layer) for layer in (0, 1)}   # B1, B4
    for layer, (hidden, tok, exp, w) in batches.items():
        client.submit(layer, hidden, (tok, exp, w))
    code, _ = loop.run(time.monotonic_ns() + int(5e9), hot_ns=0, last_work_ns=0)
    assert code == SERVE_IDLE
    for layer, (hidden, tok, exp, w) in batches.items():
        out = client.wait(layer, deadline_s=5.0).clone()
        assert rel_err(out, reference_moe_layer(store, layer, hidden, tok, exp, w, dtype=torch.float64)) <= TOL
    stats = WorkerStats()
    loop.drain_stats(stats)
    used = sum(len(set(b[2].tolist())) for b in batches.values())
    assert stats.requests == 2 and stats.expert_calls == used and stats.weight_bytes == used * store.expert_bytes


@pytest.mark.parametrize("loop", ["native", "python"])
def test_worker_loop_serves_a_quantized_store(nvfp4_rig, monkeypatch, loop):
    from ftexpert.cpu_expert_pool.worker import CpuWorker, Stop, WorkerOptions, WorkerSettings, cpu_busy_loop

    store, wc, client = nvfp4_rig
    monkeypatch.setenv("FT_WORKER_LOOP", loop)
    settings = WorkerSettings(kernel="native", act_quant="fp32", num_threads=1, hot_ms=5.0)
    options = WorkerOptions(store.name, wc.name, settings=settings, pin_threads=False, warmup=False)
    worker = CpuWorker(options, types.SimpleNamespace(num_threads=1, compute_cpus=(0,)), store, wc)
    inbox: queue.Queue = queue.Queue()
    thread = threading.Thread(target=cpu_busy_loop, args=(worker, inbox), daemon=True)
    thread.start()
    try:
        for layer in (0, 1, 0):
            hidden, tok, exp, w = make_batch(store, 4, 2, torch.bfloat16, seed=10 + layer)
            out = client.call(layer, hidden, (tok, exp, w), deadline_s=5.0)
            assert rel_err(out, reference_moe_layer(store, layer, hidden, tok, exp, w, dtype=torch.float64)) <= TOL
    finally:
        inbox.put(Stop("test over"))
        thread.join(timeout=5.0)
    assert not thread.is_alive() and worker.stats.requests == 3 and worker.stats.errors == 0
    assert (worker._loop is not None) == (loop == "native")
    assert np.isfinite(worker.stats.weight_bytes)
