"""Programmatic dependent launch (kernels/pdl.py): the switch, the wait order in the compiled kernels
(on a CPU, through Triton's real compiler), and on a GPU that the decode kernels give bitwise the same
results with and without it, eager and in a CUDA graph, at the qwen3-30b-a3b shapes where the grids
are several waves deep (where an early start would show a race)."""
from __future__ import annotations

import os

import pytest
import torch

from ftexpert.kernels import pdl
from tests.conftest import assert_compile_check


@pytest.fixture
def pdl_env(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "auto")      # so that teardown restores the variable whatever the test sets

    def set_mode(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(pdl.ENV, raising=False)
        else:
            monkeypatch.setenv(pdl.ENV, value)
    return set_mode


@pytest.mark.parametrize("value, expected", [(None, "auto"), ("", "auto"), ("auto", "auto"), ("on", "on"),
                                             ("off", "off")])
def test_mode_parses_the_environment(pdl_env, value, expected):
    pdl_env(value)
    assert pdl.mode() == expected


@pytest.mark.parametrize("value", ["sometimes", "1", "0", "ON"])
def test_a_bad_mode_says_what_to_set(pdl_env, value):
    """The kernels take what the knob takes (proto/knobs.py refuses the same values), nothing else."""
    pdl_env(value)
    with pytest.raises(ValueError, match=f"FREETOKEN_PDL='{value}': use one of auto, on, off"):
        pdl.mode()


def test_never_on_a_cpu_device(pdl_env):
    cpu = torch.device("cpu")
    for value in (None, "auto", "off"):
        pdl_env(value)
        assert not pdl.pdl_enabled(cpu)
        assert pdl.pdl_args(cpu) == {"USE_PDL": False}        # no launch_pdl: the interpreter rejects it
    pdl_env("on")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pdl.pdl_enabled(cpu)


@pytest.mark.slow
def test_the_wait_comes_first_in_the_compiled_kernels():
    """ftexpert.kernels.pdl_check: every decode kernel compiled with USE_PDL, as launched, waits before any store,
    atomic, async copy and load but the dense GEMV's first weight tile (whose loads before the wait must not
    grow with T), and lets the next kernel launch only after; without USE_PDL nothing of it is compiled.
    Checked by hand that it fails: the norm's pdl_enter moved below its loads, the GEMV's below its first step."""
    assert_compile_check("ftexpert.kernels.pdl_check")


# -- GPU -----------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _decode_chain(w: dict, state: dict) -> list[torch.Tensor]:
    """One qwen3-30b-a3b layer's decode kernels in stream order, as MoeModel's fused forward runs them
    (norm, qkv, q/k norm + rope + KV write, attention, o_proj, add + norm, router, top-k, experts), twice
    over (the second layer reads the first's output): every kernel's input is the kernel before's output."""
    from ftexpert.kernels import dense_gemv
    from ftexpert.kernels import moe_decode as kops
    from ftexpert.kernels.decode_attention import decode_attention
    from ftexpert.kernels.dense_gemv import LinearBlocks
    from ftexpert.kernels.moe_decode import CopyPlan, KvWrite
    outs = []
    x = state["x"]
    h = kops.rms_norm(x, w["norm"], 1e-6)
    for _ in range(2):
        qkv = dense_gemv.linear_gemv(h, w["qkv"])
        q = qkv[:, :4096].view(1, 32, 128)
        k = qkv[:, 4096:4608].view(1, 4, 128)
        v = qkv[:, 4608:].view(1, 4, 128)
        kv = KvWrite(state["k_cache"].view(-1, 4, 128), state["v_cache"].view(-1, 4, 128), state["index"], v)
        q, k = kops.qk_norm_rope(q, k, w["q_norm"], w["k_norm"], state["cos"], state["sin"], 1e-6, kv=kv)
        a = decode_attention(q, state["k_cache"], state["v_cache"], state["rows"], state["seq_lens"],
                             scale=128 ** -0.5, bucket=1024)
        o = dense_gemv.linear_gemv(a.view(1, 4096), w["o_proj"])
        x, h = kops.add_rms_norm(x, o, w["norm2"], 1e-6)
        logits = dense_gemv.linear_gemv(h, w["router"])
        ids, weights = kops.route_topk(logits, 8, renorm=True)
        y = kops.moe_gemv(h, ids, weights, w["w13"], w["w2"])
        x, h = kops.add_rms_norm(x, y, w["norm"], 1e-6)
        outs += [qkv, q, k, a, o, logits, ids, weights, y, x, h]
    # the rest of the kernels and launch shapes: rope alone, linear_gemv with several rows a program, moe_gemv split around a "copy"
    # on a side stream (its plan's launches wait on that stream's work: an event edge, not a programmatic one)
    q2, k2 = kops.rope(q, k, state["cos"], state["sin"])
    o2 = dense_gemv.linear_gemv(a.view(1, 4096), w["o_proj"],
                                blocks=LinearBlocks(block_n=4, block_k=1024, num_warps=4))
    compute = torch.cuda.current_stream()
    side = state["side"]
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        scratch = state["scratch"] * 2.0 + 1.0                  # stands for the copy: work the plan waits for
    plan = CopyPlan(ids[0, :2].to(torch.int32), torch.full((1,), 2, dtype=torch.int32, device=x.device), 2)
    y2 = kops.moe_gemv(h, ids, weights, w["w13"], w["w2"], plan=plan, between=lambda: compute.wait_stream(side))
    outs += [q2, k2, o2, y2, scratch]
    return outs


def _chain_inputs(device) -> tuple[dict, dict]:
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)
    w = {"norm": rnd(2048, scale=1.0), "norm2": rnd(2048, scale=1.0), "qkv": rnd(5120, 2048),
         "q_norm": rnd(128, scale=1.0), "k_norm": rnd(128, scale=1.0), "o_proj": rnd(2048, 4096),
         "router": rnd(128, 2048), "w13": rnd(128, 1536, 2048), "w2": rnd(128, 2048, 768)}
    k_cache, v_cache = rnd(1, 1024, 4, 128, scale=1.0), rnd(1, 1024, 4, 128, scale=1.0)
    state = {"x": rnd(1, 2048, scale=1.0), "k_cache": k_cache, "v_cache": v_cache,
             "index": torch.tensor([700], device=device), "rows": torch.zeros(1, dtype=torch.int64, device=device),
             "seq_lens": torch.tensor([701], dtype=torch.int32, device=device),
             "cos": rnd(1, 128, scale=1.0), "sin": rnd(1, 128, scale=1.0),
             "side": torch.cuda.Stream(device), "scratch": torch.ones(4096, device=device)}
    return w, state


def _fresh(state: dict) -> dict:
    """The chain's inputs anew (it writes the KV cache rows in place)."""
    return {k: v if isinstance(v, torch.cuda.Stream) else v.clone() for k, v in state.items()}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_decode_kernels_are_bitwise_the_same_with_pdl(pdl_env, graph):
    device = torch.device("cuda")
    pdl_env("auto")
    if not pdl.pdl_enabled(device):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with gdc_wait")
    pdl_env("off")
    w, state = _chain_inputs(device)
    fresh = _fresh(state)
    expected = [t.clone() for t in _decode_chain(w, fresh)]
    expected_cache = fresh["k_cache"].clone(), fresh["v_cache"].clone()
    pdl_env("on")
    for rep in range(3 if graph else 5):
        fresh = _fresh(state)
        if graph:
            _decode_chain(w, fresh)                          # compile outside the capture
            fresh = _fresh(state)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, stream=stream):
                outs = _decode_chain(w, fresh)
            for replay in range(10):                         # replays rewrite the same cache rows
                cuda_graph.replay()
            torch.cuda.synchronize()
        else:
            outs = _decode_chain(w, fresh)
            torch.cuda.synchronize()
        assert len(outs) == len(expected)
        for i, (got, want) in enumerate(zip(outs, expected)):
            assert torch.equal(got, want), f"output {i} of the chain differs with PDL (rep {rep})"
        assert torch.equal(fresh["k_cache"], expected_cache[0]) and torch.equal(fresh["v_cache"], expected_cache[1])


@pytest.mark.gpu
@needs_gpu
def test_engine_tokens_are_the_same_with_pdl(pdl_env, tmp_path):
    """The tiny model in bf16 on CUDA with CUDA graphs: greedy tokens of three prompts, batched, with
    PDL off and on (the spec's pdl; a fresh engine each: its graphs are captured under the setting)."""
    from ftexpert.gpu_worker.engine import SamplingParams
    from ftexpert.gpu_worker.checkpoint.tiny import ensure_tiny_checkpoint
    from tests.built_engines import build, engine_of
    from tests.gpu_worker.test_models_util import prompt_ids
    pdl_env("auto")
    if not pdl.pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0 and a Triton with gdc_wait")
    tiny = ensure_tiny_checkpoint(tmp_path / "tiny")
    loaded = build(tiny, device="cuda", dtype="bfloat16", max_context_tokens=256)
    ps = [prompt_ids(n, seed=n, vocab=loaded.cfg.vocab_size) for n in (5, 23, 11)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    tokens = {}
    for value in ("off", "on"):
        engine = engine_of(loaded, pdl=value)
        assert pdl.mode() == value
        tokens[value] = engine.generate(ps, params)
    assert tokens["on"] == tokens["off"]


def test_apply_setting_sets_what_the_kernels_read(pdl_env):
    pdl_env(None)
    pdl.apply_setting("auto")
    assert pdl.ENV not in os.environ                            # the default: nothing to set
    pdl.apply_setting("off")
    assert pdl.mode() == "off"
    with pytest.raises(ValueError, match="use one of auto, on, off"):
        pdl.apply_setting("maybe")
    assert pdl.mode() == "off"                                  # a refused value changes nothing
    pdl.apply_setting("auto")
    assert pdl.mode() == "auto"                                 # set before: now auto


def test_on_where_it_cannot_apply_is_refused_at_start_up(pdl_env, capsys):
    pdl_env(None)
    with pytest.raises(ValueError, match="--pdl on / FREETOKEN_PDL=on needs a CUDA device, got cpu"):
        pdl.apply_setting("on", "cpu")
    pdl.apply_setting("on")                                     # no device: refused at launch, as before
    assert pdl.mode() == "on"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA device"):
            pdl.apply_setting("on", "auto")                     # auto resolves to this machine's device
    from ftexpert.coordinator.cli import main                           # ft generate says so before it loads anything
    assert main(["generate", "--prompt-ids", "5", "--max-new-tokens", "1", "--device", "cpu", "--pdl", "on"]) == 2
    assert "--pdl on / FREETOKEN_PDL=on needs a CUDA device" in capsys.readouterr().err


def test_the_knob_reaches_every_entry_point(pdl_env, monkeypatch, capsys):
    """--pdl / FREETOKEN_PDL: a declared knob (a bad value is refused by name), ft generate applies it
    (flag > environment) before it loads the model, and ft serve resolves it into the engine spec its GPU worker
    gets in WELCOME."""
    import json

    from ftexpert.coordinator.cli import build_parser, main
    from ftexpert.coordinator.process_set import options_from_serve_args
    from ftexpert.proto.engine_spec import spec_from_args
    from ftexpert.proto.knobs import read_env

    assert read_env({"FREETOKEN_PDL": "off"}) == {"pdl": "off"}
    with pytest.raises(ValueError, match="FREETOKEN_PDL='sometimes' is not valid"):
        read_env({"FREETOKEN_PDL": "sometimes"})

    seen = []
    import ftexpert.gpu_worker.assembly.build as build
    load = build.make_expert_backend

    def recording(*args, **kwargs):
        seen.append(pdl.mode())
        return load(*args, **kwargs)
    monkeypatch.setattr(build, "make_expert_backend", recording)
    argv = ["generate", "--prompt-ids", "5,17,42", "--max-new-tokens", "3", "--device", "cpu", "--json"]
    pdl_env("off")
    assert main(argv) == 0
    assert main(argv + ["--pdl", "auto"]) == 0
    assert seen == ["off", "auto"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]

    serve = build_parser().parse_args(["serve", "--pdl", "off"])
    assert options_from_serve_args(serve, spec_from_args(serve)).spec.pdl == "off"   # what WELCOME carries


def test_not_on_rocm_whatever_its_gfx_version(pdl_env, monkeypatch):
    """A ROCm build reports its gfx version as the capability (MI300: 9.4): PDL is NVIDIA's, so auto stays off
    there, and on is refused with the reason."""
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl._supported.cache_clear()
    try:
        pdl_env("auto")
        assert not pdl.pdl_enabled(torch.device("cuda", 0))
        pdl_env("on")
        with pytest.raises(ValueError, match="ROCm build"):
            pdl.pdl_enabled(torch.device("cuda", 0))
    finally:
        pdl._supported.cache_clear()
