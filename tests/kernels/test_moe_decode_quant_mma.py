"""kernels/moe_decode/quant_mma_kernels.py: the 4-bit gate/up and down GEMVs on the tensor cores
(GemvBlocks.quant_mma, quant_mma_down).

- DECODE_ASM, the PTX that turns 4 code bytes into bfloat16 pairs on the GPU, is run here by a small emulator of
  its five opcodes (parsed from the kernel's own text, so an edit to it is what is tested) on every byte value in
  every position, against the codec's E2M1 values.
- Without a GPU the kernel runs in the Triton interpreter (its float32 decode and dots, the same sums): in lockstep
  with the reference over ragged K steps, one and several column ranges, missing routes, a copy-plan split and
  gpt-oss's biases and clamped SwiGLU; what it refuses, refused with what to change.
- A GPU test runs bfloat16 at qwen3-next-80b-a3b's and gpt-oss-120b's expert shapes against the reference.
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from ftexpert.kernels.moe_decode import CopyPlan, GemvBlocks
from ftexpert.kernels.moe_decode.quant import MMA_MIN_PROGRAMS, mma_split, moe_gemv_quant
from ftexpert.kernels.moe_decode.quant_mma_kernels import DECODE_ASM
from ftexpert.kernels.moe_decode.quant_reference import moe_gemv_quant_reference
from ftexpert.proto.expert_format import ExpertFormat, QuantLayout
from ftexpert.kernels.expert_reference import quantize_expert
from tests.conftest import KERNEL_DEVICE
from tests.kernels.test_moe_decode_quant import BF16_ULP, gpu_rows, rel_max, routes

DEV = KERNEL_DEVICE
MMA = {"nvfp4": GemvBlocks(gate_up_block_n=16, gate_up_block_k=256, down_block_n=16, down_block_k=256, sum_block=64,
                           quant_mma=True, quant_mma_down=True),
       "mxfp4": GemvBlocks(gate_up_block_n=16, gate_up_block_k=512, down_block_n=16, down_block_k=512, sum_block=64,
                           quant_mma=True, quant_mma_down=True)}

# -- the decode's PTX, emulated ---------------------------------------------------------------------

def _prmt(a, b, sel):
    """prmt.b32 (default mode): byte i of the result is byte sel[4i+2:4i] of {b, a} (a: 0-3, b: 4-7), or with
    sel's bit 4i+3 set that byte's sign replicated."""
    src = (b.astype(np.uint64) << 32) | a.astype(np.uint64)
    out = np.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = ((src >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)).astype(np.uint32)
        if nib & 8:
            byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
        out |= byte << np.uint32(8 * i)
    return out


def _lop3(a, b, c, lut):
    out = np.zeros_like(a)
    for bit in range(8):                       # the LUT's bit for each (a, b, c): index = a*4 + b*2 + c
        if lut >> bit & 1:
            ma = a if bit & 4 else ~a
            mb = b if bit & 2 else ~b
            mc = c if bit & 1 else ~c
            out |= ma & mb & mc
    return out


def run_decode_asm(words: np.ndarray) -> list[np.ndarray]:
    """DECODE_ASM's body executed on uint32 words ($4) -> the four output registers $0..$3."""
    regs: dict[str, np.ndarray] = {"$4": words.astype(np.uint32)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full_like(words, int(tok, 0), dtype=np.uint32)

    ops = 0
    for line in DECODE_ASM.value.splitlines():
        m = re.match(r"\s*([a-z0-9.]+)\s+([^;]*);", line)
        if not m or m.group(1) == ".reg":
            continue
        op, args = m.group(1), [t.strip() for t in m.group(2).split(",")]
        d, src = args[0], [val(t) for t in args[1:]]
        if op == "and.b32":
            r = src[0] & src[1]
        elif op == "shl.b32":
            r = (src[0] << src[1]) & np.uint32(0xFFFFFFFF)
        elif op == "shr.u32":
            r = src[0] >> src[1]
        elif op == "prmt.b32":
            r = _prmt(src[0], src[1], int(args[3], 0))
        elif op == "lop3.b32":
            r = _lop3(src[0], src[1], src[2], int(args[4], 0))
        else:
            raise AssertionError(f"DECODE_ASM uses {op}, which this emulator does not know")
        regs[d] = r.astype(np.uint32)
        ops += 1
    assert ops == 15, ops                      # 8 weights: 15 instructions (the docstring's count)
    return [regs[f"${i}"] for i in range(4)]


def e2m1_bf16_bits(nibbles: np.ndarray) -> np.ndarray:
    """The codec's E2M1 values times 2**-126 as bfloat16 bits (exact: the top half of their float32)."""
    vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    v = vals[nibbles & 7] * np.where(nibbles & 8, -1.0, 1.0) * 2.0 ** -126
    bits = v.astype(np.float32).view(np.uint32)
    assert np.array_equal(bits & 0xFFFF, np.zeros_like(bits))
    return bits >> 16


def test_the_decode_ptx_is_the_codec_bit_for_bit():
    """Every byte value in each of the four positions (the others random), and random words: output register r
    holds weights (2r, 2r + 1) of the low nibbles (r = 0, 1) or the high ones (r = 2, 3), element 2i in the low
    half, as inline_asm_elementwise's pack of 4 bfloat16 expects."""
    rng = np.random.default_rng(0)
    words = [rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)]
    for pos in range(4):
        w = rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32)
        w &= ~np.uint32(0xFF << (8 * pos))
        words.append(w | (np.arange(256, dtype=np.uint32) << np.uint32(8 * pos)))
    words = np.concatenate(words)
    out = run_decode_asm(words)
    byte = [(words >> np.uint32(8 * i)) & 0xFF for i in range(4)]
    for r, (b0, b1, shift) in enumerate([(0, 1, 0), (2, 3, 0), (0, 1, 4), (2, 3, 4)]):
        want_lo = e2m1_bf16_bits((byte[b0] >> shift) & 0xF)
        want_hi = e2m1_bf16_bits((byte[b1] >> shift) & 0xF)
        assert np.array_equal(out[r] & 0xFFFF, want_lo), r
        assert np.array_equal(out[r] >> 16, want_hi), r


def test_the_emulator_catches_a_wrong_mask():
    """A negative control: the same PTX with the mask of its last logic op changed no longer decodes."""
    words = np.arange(0, 2 ** 16, dtype=np.uint32) * 65537
    good = run_decode_asm(words)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DECODE_ASM, "value", DECODE_ASM.value.replace("0x81C081C0, 0xA8;\n}", "0x81C08140, 0xA8;\n}"))
        bad = run_decode_asm(words)
    assert not np.array_equal(bad[3], good[3]) and np.array_equal(bad[0], good[0])


# -- the kernel, in lockstep with the reference ------------------------------------------------------

def expert_rows(label: str, S: int, H: int, I: int, seed: int) -> tuple[torch.Tensor, QuantLayout]:
    fmt = ExpertFormat.parse(label)
    layout = QuantLayout(H, I, fmt)
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(S, layout.expert_nbytes + 32, dtype=torch.uint8)
    for s in range(S):
        gate, up, down = (torch.randn(r, c, generator=g) * 0.1 for r, c in ((I, H), (I, H), (H, I)))
        quantize_expert(gate, up, down, fmt, out=rows[s, :layout.expert_nbytes])
    return rows, layout


# label, H, I, T, K, S, missing, mma_split, dtype, (gate/up, down) on the tensor cores: K steps of 256 (nvfp4) /
# 512 (mxfp4) columns, ragged at the end (down's K is I)
CASES = {
    "nvfp4-4-steps-ragged-auto-split": ("nvfp4", 800, 48, 2, 3, 5, 1, 0, torch.float32, (True, False)),
    "nvfp4-one-range-t1": ("nvfp4", 512, 32, 1, 4, 6, 0, 1, torch.float32, (True, True)),
    "nvfp4-two-ranges-fp16": ("nvfp4", 768, 16, 3, 2, 4, 1, 2, torch.float16, (True, True)),
    "nvfp4-down-only-ragged-ranges": ("nvfp4", 96, 560, 2, 3, 5, 1, 0, torch.float32, (False, True)),
    "mxfp4-3-steps-ragged-auto-split": ("mxfp4", 1088, 64, 2, 3, 5, 1, 0, torch.float32, (True, True)),
    "mxfp4-down-two-ranges": ("mxfp4", 64, 1088, 1, 3, 4, 0, 2, torch.float32, (False, True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_tensor_core_gemvs_are_in_lockstep_with_the_reference(case):
    label, H, I, T, K, S, missing, split, dtype, (gate_up, down) = CASES[case]
    rows, layout = expert_rows(label, S, H, I, seed=H + I)
    ids, weights = routes(T, K, S, seed=T * K, missing=missing)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(K)).to(dtype)
    blocks = replace(MMA[label], mma_split=split, quant_mma=gate_up, quant_mma_down=down)
    expected = moe_gemv_quant_reference(x, ids, weights, rows, layout)
    got = moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout,
                         impl="triton", blocks=blocks)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_max(got, expected) < (1e-5 if dtype == torch.float32 else 4e-3)
    plain = moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout,
                           impl="triton", blocks=replace(blocks, quant_mma=False, quant_mma_down=False))
    assert rel_max(got, plain) < (1e-5 if dtype == torch.float32 else 4e-3)
    if missing:                                    # a route not on the GPU adds exactly 0: its partial is 0.0
        parts = moe_gemv_quant(x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout,
                               impl="triton", blocks=blocks, partials=True)
        assert not parts[(ids < 0).to(DEV)].any()


def test_the_ranges_split_as_the_rule_says():
    """mma_split: the fewest ranges (powers of two) reaching MMA_MIN_PROGRAMS programs, at most one K step each,
    or the one asked for (capped at the K steps); down's rows are H and its K is I."""
    b = GemvBlocks(gate_up_block_n=64, gate_up_block_k=256, down_block_n=64, down_block_k=256, quant_mma=True)
    assert MMA_MIN_PROGRAMS == 512
    assert mma_split(b, P=10, rows=512, kdim=2048) == 8              # qwen3-next gate/up: 80 programs -> 640
    assert mma_split(b, P=10, rows=2048, kdim=512, down=True) == 2   # its down: 320 -> 640, I = two K steps
    assert mma_split(replace(b, gate_up_block_k=512), P=4, rows=2880, kdim=2880) == 4   # gpt-oss: 180 -> 720
    assert mma_split(b, P=64, rows=512, kdim=2048) == 1              # already 512
    assert mma_split(b, P=1, rows=64, kdim=512) == 2                 # capped at the two K steps
    assert mma_split(replace(b, mma_split=4), P=1, rows=64, kdim=512) == 2
    assert mma_split(replace(b, mma_split=2), P=1, rows=64, kdim=4096) == 2


def test_a_copy_plan_split_is_the_unsplit_call_bit_for_bit():
    label, H, I, T, K, S = "nvfp4", 800, 48, 3, 3, 6
    rows, layout = expert_rows(label, S, H, I, seed=7)
    ids, weights = routes(T, K, S, seed=5, missing=1)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    args = (x.to(DEV), ids.to(torch.int32).to(DEV), weights.to(DEV), rows.to(DEV), layout)
    whole = moe_gemv_quant(*args, impl="triton", blocks=MMA[label])
    slots = ids.view(-1)[ids.view(-1) >= 0][:2].to(torch.int32).to(DEV)
    plan = CopyPlan(slots, torch.tensor([2], dtype=torch.int32, device=DEV), 2)
    calls = []
    split = moe_gemv_quant(*args, impl="triton", blocks=MMA[label], plan=plan, between=lambda: calls.append(1))
    assert calls == [1] and torch.equal(split, whole)


def test_gpt_oss_biases_and_clamped_swiglu():
    """The activation (biases, clamp, SwiGLU) after the ranges' sums and down's bias before its rounding, as the
    float32 path computes them."""
    from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, bias_views
    from tests.kernels.test_moe_decode_gpt_oss import ACT, case
    x, ids, w, w13, w2, b13, b2 = case(T=2, K=3, H=576, I=544, scale=0.2)
    S, I2, H = w13.shape
    lay = ExpertLayout(H, I2 // 2, torch.float32, "mxfp4", ACT)
    host = lay.zeros_layer(S)
    for s in range(S):
        quantize_expert(w13[s, : I2 // 2].cpu(), w13[s, I2 // 2:].cpu(), w2[s].cpu(), lay.fmt, out=host[s])
    rows = host.to(DEV)
    c13, c2 = bias_views(rows, lay)
    c13.copy_(b13), c2.copy_(b2)
    kw = dict(b13=c13, b2=c2, act=ACT)
    want = moe_gemv_quant(x, ids, w, rows, lay.quant_layout, impl="reference", **kw)
    for split, down in ((1, False), (2, True)):
        got = moe_gemv_quant(x, ids, w, rows, lay.quant_layout, impl="triton",
                             blocks=replace(MMA["mxfp4"], mma_split=split, quant_mma_down=down), **kw)
        assert rel_max(got, want) < 1e-5, (split, down)


def test_what_it_cannot_run_is_refused_with_what_to_change():
    rows, layout = expert_rows("nvfp4", 2, 256, 32, seed=1)
    x, ids, w = torch.randn(1, 256), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    args = (x.to(DEV), ids.to(DEV), w.to(DEV), rows.to(DEV), layout)
    with pytest.raises(ValueError, match="gate_up_block_k = 128 must hold >= 16 groups of 16"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], gate_up_block_k=128))
    with pytest.raises(ValueError, match="gate_up_block_n = 8 must be >= 16"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], gate_up_block_n=8))
    with pytest.raises(ValueError, match="down_block_k = 64 must hold >= 16 groups of 16"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], quant_mma=False, down_block_k=64))
    with pytest.raises(ValueError, match="mma_split = 3: 0 \\(auto\\) or a power of two"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], mma_split=3))
    with pytest.raises(ValueError, match="mma_warps = 3: 1, 2, 4, 8 or 16"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], mma_warps=3))
    with pytest.raises(TypeError, match="quant_mma must be a bool"):
        moe_gemv_quant(*args, impl="triton", blocks=replace(MMA["nvfp4"], quant_mma=1))
    ref = moe_gemv_quant(*args, impl="reference", blocks=MMA["nvfp4"])       # the reference takes any dtype
    assert torch.isfinite(ref).all()
    i_rows, i_layout = expert_rows("int4-g32", 2, 256, 32, seed=1)
    with pytest.raises(ValueError, match="runs mxfp4 and nvfp4 experts, not int4: leave it off for int4"):
        moe_gemv_quant(x.to(DEV), ids.to(DEV), w.to(DEV), i_rows.to(DEV), i_layout, impl="triton",
                       blocks=MMA["nvfp4"])


# -- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", ["qwen3-next", "gpt-oss"])
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_tensor_core_gemvs_bf16_at_the_real_shapes(shape, T):
    """bfloat16 on the tensor cores (the PTX decode, bfloat16 dots) against the reference at the real experts'
    shapes, with the automatic ranges: the same bound as the float32 path's GPU test; deterministic; the same in a
    CUDA graph; and bfloat16 activations required."""
    label, S, H, I, K, bk = {"qwen3-next": ("nvfp4", 24, 2048, 512, 10, 256),
                             "gpt-oss": ("mxfp4", 8, 2880, 2880, 4, 512)}[shape]
    rows, layout = gpu_rows(label, S, H, I, seed=T)
    ids, weights = routes(T, K, S, seed=T, missing=1 if T > 1 else 0)
    ids, weights = ids.cuda(), torch.softmax(weights, -1).cuda()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).cuda()
    blocks = GemvBlocks(gate_up_block_n=64, gate_up_block_k=bk, down_block_n=64, down_block_k=bk,
                        quant_group_sum=True, quant_mma=True, quant_mma_down=True)
    expected = moe_gemv_quant_reference(x, ids, weights, rows, layout)
    got = moe_gemv_quant(x, ids, weights, rows, layout, blocks=blocks)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_max(got, expected) < 8 * BF16_ULP
    assert ((got.float() - expected.float()).norm() / expected.float().norm()).item() < 2 * BF16_ULP
    assert torch.equal(moe_gemv_quant(x, ids, weights, rows, layout, blocks=blocks), got)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_gemv_quant(x, ids, weights, rows, layout, blocks=blocks)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        static = moe_gemv_quant(x, ids, weights, rows, layout, blocks=blocks)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, got)
    with pytest.raises(ValueError, match="rounds the activations to bfloat16"):
        moe_gemv_quant(x.float(), ids, weights, rows, layout, blocks=blocks)
