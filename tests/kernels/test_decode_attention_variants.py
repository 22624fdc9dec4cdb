"""kernels/decode_attention's split kernel over the page layouts it must address and its `num_stages` launch option:
in lockstep with the torch reference over scattered block tables of pages that divide BLOCK_N, that do not (24 with
block_n 64), that hold several tiles (32 with block_n 16) and of one position, contiguous rows, sliding windows
(tiles that start off a page boundary), sinks, T = 1 and 3, G = 8 (tl.dot) and G = 2 (broadcast), fp32 and bf16
(the interpreter's bf16 tl.dot is wrong: there bf16 is checked against the reference on the broadcast path only).
num_stages is read off the launch. A compile check builds the kernel for sm_90 with Triton's real compiler; the `gpu`
tests run the same lockstep compiled on CUDA (at Triton's default num_stages and at 4), and bf16 at qwen3-30b-a3b
shapes; the bench's `--sweep-set stages` runs end to end on the CPU with a stub timer."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftexpert.kernels.decode_attention import (DEFAULT_BLOCKS, DecodeAttentionBlocks, decode_attention,
                                               decode_attention_reference)
from ftexpert.kernels.decode_attention import api, triton_kernels
from tests.conftest import HAS_CUDA, KERNEL_DEVICE
from tests.kernels.test_decode_attention import bf16_close, make_cache
from tests.kernels.test_decode_attention_paged import scattered_tables

REPO = Path(__file__).resolve().parents[2]
STAGES = (None, 1, 2, 3, 4, 5)
Hkv, D = 2, 16

# (G, T, seq_lens, bucket, window, page (None: contiguous rows [5, 160]), block_n, sinks)
CASES = {
    "g8-t3-page16-bn32": (8, 3, [70, 5, 96], 96, None, 16, 32, False),         # 2 page ids a tile, tl.dot
    "g2-t1-page16-bn64-sinks": (2, 1, [200], 256, None, 16, 64, True),         # the default block_n: 4 ids a tile
    "g8-t3-page1-bn16": (8, 3, [33, 1, 20], 48, None, 1, 16, False),           # 16 ids a tile
    "g2-t3-page24-bn64": (2, 3, [70, 5, 130], 144, None, 24, 64, False),       # PAGE does not divide BLOCK_N
    "g8-t1-page32-bn16": (8, 1, [90], 96, None, 32, 16, False),                # a tile inside one page: 1 id
    "g8-t3-page16-window-sinks": (8, 3, [70, 20, 96], 96, 37, 16, 32, True),   # tiles start off page boundaries
    "g2-t3-page8-window1": (2, 3, [50, 9, 1], 64, 1, 8, 16, False),
    "g8-t3-contiguous": (8, 3, [70, 5, 96], 96, None, None, 32, False),        # one page of 160 a row
}


def blocks_for(block_n: int, num_stages: int | None = None) -> DecodeAttentionBlocks:
    """Chunks of two tiles, so that a program walks more than one (the ids carried a tile ahead)."""
    return DecodeAttentionBlocks(block_n=block_n, min_chunk=2 * block_n, short_min_chunk=2 * block_n,
                                 target_programs=64, num_stages=num_stages)


def make_case(name: str, dtype=torch.float32):
    """(args, kwargs, block_n) of decode_attention for CASES[name]: random caches, scattered pages (or rows)."""
    G, T, lens, bucket, window, page, block_n, with_sinks = CASES[name]
    seed = sum(map(ord, name))
    g = torch.Generator().manual_seed(seed)
    if page is None:
        k, v = make_cache(5, 160, Hkv, D, dtype=dtype, seed=seed)
        tables, rows = None, torch.randperm(5, generator=g)[:T]
    else:
        num_pages = sum(-(-n // page) for n in lens) + 4                       # a few pages no request names
        k, v = make_cache(num_pages, page, Hkv, D, dtype=dtype, seed=seed)
        tables, rows = scattered_tables(lens, page, num_pages, T + 2, -(-bucket // page), seed=seed)
        tables = tables.to(KERNEL_DEVICE)
    q = torch.randn(T, G * Hkv, D, generator=g).to(dtype).to(KERNEL_DEVICE)
    sinks = (2 * torch.randn(G * Hkv, generator=g)).to(KERNEL_DEVICE) if with_sinks else None
    args = (q, k, v, rows.to(KERNEL_DEVICE), torch.tensor(lens).to(KERNEL_DEVICE))
    return args, dict(scale=D ** -0.5, bucket=bucket, sliding_window=window, block_tables=tables, sinks=sinks), block_n


def reference(args, kw) -> torch.Tensor:
    """The torch reference on the inputs upcast to fp32 (an fp32 output)."""
    q, k, v, rows, lens = args
    return decode_attention_reference(q.float(), k.float(), v.float(), rows, lens, **kw)


def bf16_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output within 2% of the largest reference value, the whole within 1% relative (a wrong page or position
    moves it by tens of percent; tiny heads leave bf16 rounding little to average out)."""
    err = (out.float() - ref.float()).abs()
    assert err.max() <= 2e-2 * ref.abs().max(), float(err.max())
    assert err.norm() <= 1e-2 * ref.float().norm(), float(err.norm() / ref.float().norm())


@functools.lru_cache(maxsize=None)
def default_output(name: str, dtype=torch.float32) -> torch.Tensor:
    """The kernel's output on CASES[name] at Triton's default num_stages (computed once)."""
    args, kw, block_n = make_case(name, dtype)
    return decode_attention(*args, impl="triton", blocks=blocks_for(block_n), **kw)


class LaunchSpy:
    """Stands in for decode_attn_split_kernel: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def spy(monkeypatch) -> LaunchSpy:
    spy = LaunchSpy(triton_kernels.decode_attn_split_kernel)
    monkeypatch.setattr(triton_kernels, "decode_attn_split_kernel", spy)   # api.py imports it at each call
    return spy


# ---- lockstep in the interpreter (compiled where there is a GPU; the GPU suite runs the `gpu` ones below) --------

@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("case", list(CASES))
def test_in_lockstep_with_the_reference(case):
    args, kw, _ = make_case(case)
    torch.testing.assert_close(default_output(case), reference(args, kw), rtol=1e-5, atol=1e-5)


BF16_CASES = ["g2-t1-page16-bn64-sinks", "g2-t3-page24-bn64", "g8-t3-page16-bn32", "g8-t3-page16-window-sinks"]


@pytest.mark.parametrize("case", [c for c in BF16_CASES if HAS_CUDA or CASES[c][0] < api.DOT_MIN_GROUP])
def test_bf16(case):
    args, kw, _ = make_case(case, torch.bfloat16)
    out = default_output(case, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    bf16_near(out, reference(args, kw))


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("num_stages", STAGES)
def test_num_stages_is_a_launch_option(spy, num_stages):
    """The interpreter ignores num_stages; the launch gets it (absent: Triton's default) and the result holds."""
    case = "g8-t1-page32-bn16"
    args, kw, block_n = make_case(case)
    out = decode_attention(*args, impl="triton", blocks=blocks_for(block_n, num_stages), **kw)
    torch.testing.assert_close(out, reference(args, kw), rtol=1e-5, atol=1e-5)
    (launch,) = spy.launches
    assert launch.get("num_stages") == num_stages and ("num_stages" in launch) == (num_stages is not None)
    if not HAS_CUDA:
        assert torch.equal(out, default_output(case))


@pytest.mark.usefixtures("no_tf32")
def test_k_and_v_of_different_strides():
    """K a layer of a pool [2, NB, PAGE, Hkv, D], V the first D columns of a wider one: the page and position
    strides of K and V differ, and each is used for its own."""
    args, kw, block_n = make_case("g8-t3-page16-bn32")
    q, k, v, rows, lens = args
    k_pool = torch.randn(2, *k.shape, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    k_pool[1] = k
    v_wide = torch.randn(*v.shape[:3], 3 * D, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    v_wide[..., :D] = v
    k2, v2 = k_pool[1], v_wide[..., :D]
    assert k2.stride()[:2] != v2.stride()[:2] and k2.storage_offset() > 0
    out = decode_attention(q, k2, v2, rows, lens, impl="triton", blocks=blocks_for(block_n), **kw)
    torch.testing.assert_close(out, reference(args, kw), rtol=1e-5, atol=1e-5)


def test_bad_blocks_are_refused():
    for bad in (0, -1, 2.0, "3", True):
        with pytest.raises(ValueError, match="num_stages"):
            DecodeAttentionBlocks(num_stages=bad)
    assert DEFAULT_BLOCKS.num_stages is None


def test_the_cases_see_every_page():
    """The lockstep cases would catch a wrong page: a request's last page in its table row swapped for one no request
    names moves the reference's output."""
    checked = 0
    for name, (_, _, lens, _, _, page, _, _) in CASES.items():
        if page is None:
            continue
        args, kw, _ = make_case(name)
        tables = kw["block_tables"]
        spare = min(set(range(args[1].shape[0])) - set(tables[tables >= 0].tolist()))
        for t, n in enumerate(lens):
            swapped = tables.clone()
            swapped[int(args[3][t]), (n - 1) // page] = spare
            moved = (reference(args, kw) - reference(args, {**kw, "block_tables": swapped}))[t].abs().max()
            assert moved > 1e-3, (name, t)
            checked += 1
    assert checked == sum(len(c[2]) for c in CASES.values() if c[5] is not None)


# ---- on the GPU: the same lockstep compiled, and bf16 at qwen3-30b-a3b shapes -------------------------------------

@pytest.mark.gpu
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("num_stages", [None, 4])
def test_lockstep_cases_on_gpu(num_stages):
    """Every case of the interpreter's lockstep, compiled (at Triton's default num_stages and at 4): fp32 against the
    reference, bf16 (BF16_CASES) against the reference and the default's output."""
    for case in CASES:
        args, kw, block_n = make_case(case)
        out = decode_attention(*args, impl="triton", blocks=blocks_for(block_n, num_stages), **kw)
        torch.testing.assert_close(out, reference(args, kw), rtol=1e-5, atol=1e-5, msg=case)
    for case in BF16_CASES:
        args, kw, block_n = make_case(case, torch.bfloat16)
        out = decode_attention(*args, impl="triton", blocks=blocks_for(block_n, num_stages), **kw)
        bf16_near(out, reference(args, kw))
        bf16_near(out, default_output(case, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("num_stages", [None, 4])
def test_bf16_qwen3_shapes_on_gpu(num_stages):
    """Scattered pages of 16 (full and a 512 window) and contiguous rows in lockstep with the fp32 reference and
    with the default launch's output."""
    Hq, Hkv_, Dq, page = 32, 4, 128, 16
    blocks = DecodeAttentionBlocks(num_stages=num_stages)
    g = torch.Generator().manual_seed(11)
    for lens, window, paged in (([1280, 77, 4096], None, True), ([3000, 2048], 512, True), ([1100, 4096], None, False)):
        bucket, T = 4096, len(lens)
        if paged:
            num_pages = sum(-(-n // page) for n in lens) + 64
            k, v = make_cache(num_pages, page, Hkv_, Dq, dtype=torch.bfloat16, device="cuda", seed=12)
            tables, rows = scattered_tables(lens, page, num_pages, 8, bucket // page, seed=12)
            tables = tables.cuda()
        else:
            k, v = make_cache(4, bucket, Hkv_, Dq, dtype=torch.bfloat16, device="cuda", seed=12)
            tables, rows = None, torch.tensor([3, 1])
        q = (2 * torch.randn(T, Hq, Dq, generator=g)).to(torch.bfloat16).cuda()
        args = (q, k, v, rows.cuda(), torch.tensor(lens).cuda())
        kw = dict(scale=Dq ** -0.5, bucket=bucket, sliding_window=window, block_tables=tables)
        out = decode_attention(*args, blocks=blocks, **kw)
        bf16_close(out, reference(args, kw))
        bf16_close(out, decode_attention(*args, **kw).float())


# ---- Triton's real compiler, on the CPU ------------------------------------------------------------------------

COMPILE = r"""
import json, sys
from ftexpert.kernels.compile_driver import run_compile_check
from ftexpert.kernels.decode_attention import triton_kernels
sys.exit(run_compile_check("compile the decode attention's split kernel", json.loads(sys.argv[1]),
                           triton_kernels, []))
"""


def compile_cases() -> list:
    """(name, kernel, signature, constexprs, options, 16-divisible args): qwen3-30b-a3b's split kernel (bf16, G 8,
    tl.dot) at Triton's default num_stages and at 1 and 5, contiguous rows, and the broadcast path with a window in
    fp32."""
    def case(name, stages=None, dt="bf16", G=8, window=False, page=16):
        ints = ["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                "stride_vh", "stride_tb", "bucket", "window", "chunk"]
        sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "tables_ptr": "*i32", "rows_ptr": "*i64",
               "seq_lens_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32",
               **{a: "i32" for a in ints}}
        dot = G >= api.DOT_MIN_GROUP
        consts = dict(NUM_SPLITS=16, G=G, GP=16 if dot else G, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                      HAS_WINDOW=window, USE_DOT=dot, IS_FP32=dt == "fp32", PAGE=page)
        sig.update({c: "constexpr" for c in consts})
        opts = {"num_warps": 4} if stages is None else {"num_warps": 4, "num_stages": stages}
        divisible = [a for a in sig if a.endswith("_ptr")] + ["stride_kb", "stride_vb", "stride_ks", "stride_vs"]
        return [f"{name} st={stages or '-'}", "decode_attn_split_kernel", sig, consts, opts, divisible]
    return [case("pages of 16"), case("pages of 16", 1), case("pages of 16", 5), case("contiguous rows", page=4096),
            case("window fp32 G2", dt="fp32", G=2, window=True)]


def test_the_split_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(compile_cases())], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"{len(compile_cases())} compiled, 0 failed" in proc.stdout


# ---- the bench's sweep -----------------------------------------------------------------------------------------

@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))                      # its `from graph_timing import ...`
    path = REPO / "bench" / "bench_decode_attention.py"
    spec = importlib.util.spec_from_file_location("bench_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_sweep_variants(bench):
    stages = bench.sweep_variants(DEFAULT_BLOCKS, "stages")
    assert len(stages) == len(set(stages)) and DEFAULT_BLOCKS not in stages
    assert [b.num_stages for b in stages] == list(bench.STAGES)
    assert set(stages) <= set(bench.sweep_variants(DEFAULT_BLOCKS))
    assert not any(b.num_stages is not None for b in bench.sweep_variants(DEFAULT_BLOCKS, "blocks"))
    args = bench.parse_args(["--sweep-set", "stages"])
    assert args.sweep_set == "stages" and bench.parse_args([]).sweep_set == "all"


@pytest.mark.skipif(HAS_CUDA, reason="the bench's CPU rows go through the interpreter, which is off with a GPU")
def test_bench_stages_sweep_runs_and_labels_every_variant(bench, capsys):
    """--sweep-set stages on tiny shapes with a stub timer (one call, a made-up time): a row a variant, each label
    naming its num_stages, and the stages table marking one fastest a case."""
    args = bench.parse_args(["--tokens", "1", "--contexts", "40", "--max-context", "64", "--heads", "8",
                             "--kv-heads", "2", "--head-dim", "16", "--calls", "2", "--no-sdpa", "--sweep-set", "stages",
                             "--dtype", "float32"])
    args.sweep = True
    times = iter(range(100, 1, -1))

    def timer(fn, calls, reps, warmup):
        fn(0)
        return next(times) * 1e-7
    rows: list[dict] = []
    bench.run_case(args, torch.float32, 1, 40, rows, device="cpu", timer=timer)
    names = [r["name"] for r in rows]
    variants = bench.sweep_variants(DEFAULT_BLOCKS, "stages")
    assert len(rows) == 2 + len(variants) and len(set(names)) == len(names)
    for b, name in zip(variants, names[2:]):
        assert f" st={b.num_stages} " in name
    bench.print_stages_table(rows)
    table = capsys.readouterr().out.split("split kernel num_stages")[1]
    assert table.count("*") == 2 and all(f"st={st}" in table for st in bench.STAGES)   # the header's and the fastest
