"""Qwen3-Next (Gated DeltaNet + gated attention, shared expert) against transformers, and its state cache.

float32 on the CPU: logits within 1e-4 relative error of transformers' forward, greedy tokens identical for 32
steps; the per-request state cache: chunked prefill equals one long prefill, requests interleaved, joining and
finishing at different steps give the tokens each gives alone; offload at a small cache equals resident."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftexpert.gpu_worker.engine import Engine, SamplingParams
from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.checkpoint.reader import CheckpointError
from ftexpert.gpu_worker.models.qwen3_next import StatefulContext
from tests.built_engines import build, build_with_resources, engine_of
from tests.gpu_worker.qwen3_next_util import hf_greedy_full, hf_qwen3_next, save
from tests.gpu_worker.test_models_util import prompt_ids, rel_err

REL_TOL = 1e-4
PARAMS = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = hf_qwen3_next(seed=7)
    return hf, save(hf, tmp_path_factory.mktemp("qwen3next"))


@pytest.fixture(scope="module")
def resident(checkpoint):
    return build(checkpoint[1], dtype="float32", max_running_requests=2, max_context_tokens=256)


def prefill_logits(loaded, prompt: list[int], chunk: int) -> torch.Tensor:
    """All-position logits [P, V] through the engine's prefill contexts, ``chunk`` tokens at a time."""
    cfg = loaded.cfg
    kv = KVCache(cfg, max_batch=2, max_context_tokens=256, dtype=torch.float32, device=torch.device("cpu"))
    states = StateCache(cfg, max_batch=2, dtype=torch.float32, device=torch.device("cpu"))
    out = []
    for start in range(0, len(prompt), chunk):
        ids = prompt[start:start + chunk]
        attn = StatefulContext(PrefillAttention(kv, slot=1, start_pos=start, num_tokens=len(ids)),
                               states.prefill(1, start))
        out.append(loaded.model.forward(torch.tensor(ids), torch.arange(start, start + len(ids)), attn))
    return torch.cat(out)


def engine(built, running: int = 1, chunk: int = 4) -> Engine:
    return engine_of(built, max_running_requests=running, max_context_tokens=256, prefill_chunk_tokens=chunk)


def test_config_reads_the_hybrid_layout(resident):
    cfg = resident.cfg
    assert cfg.arch == "qwen3_next" and cfg.num_kv_layers == 1
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.partial_rotary_factor == 0.25 and cfg.shared_expert_intermediate_size == 48
    assert cfg.linear_attention.conv_dim == 2 * 16 + 32


@pytest.mark.parametrize("chunk", [100, 64, 5], ids=["one_chunk", "chunks_of_64", "chunks_of_5"])
def test_logits_match_transformers(checkpoint, resident, chunk):
    hf, _ = checkpoint
    prompt = prompt_ids(90, seed=3)                     # longer than the gated delta rule's 64-token chunks
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    got = prefill_logits(resident, prompt, chunk)
    assert got.shape == expected.shape
    assert rel_err(got, expected) <= REL_TOL


def test_greedy_generation_matches_transformers(checkpoint, resident):
    hf, _ = checkpoint
    prompt = prompt_ids(11, seed=4)
    expected = hf_greedy_full(hf, prompt, 32)
    assert engine(resident).generate([prompt], PARAMS)[0] == expected


def test_chunked_prefill_equals_one_long_prefill(resident):
    prompt = prompt_ids(70, seed=5)
    one = engine(resident, chunk=256).generate([prompt], PARAMS)[0]
    for chunk in (3, 16, 64):
        assert engine(resident, chunk=chunk).generate([prompt], PARAMS)[0] == one


def test_interleaved_requests_give_their_tokens_alone(resident):
    """Two requests sharing the state cache: one joins while the other decodes, they prefill in chunks between
    decode steps, and finish at different steps; then a third reuses a finished request's rows."""
    prompts = [prompt_ids(9, seed=20), prompt_ids(23, seed=21), prompt_ids(6, seed=22)]
    lengths = [12, 30, 8]
    alone = [engine(resident).generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
             for p, n in zip(prompts, lengths)]
    eng = engine(resident, running=2, chunk=5)
    got: dict = {}
    first = eng.add_request(prompts[0], SamplingParams(max_new_tokens=lengths[0], ignore_eos=True))
    ids = [first]
    steps = 0
    while eng.has_work() or len(ids) < 3:
        if steps == 3:
            ids.append(eng.add_request(prompts[1], SamplingParams(max_new_tokens=lengths[1], ignore_eos=True)))
        if steps == 6:
            ids.append(eng.add_request(prompts[2], SamplingParams(max_new_tokens=lengths[2], ignore_eos=True)))
        for out in eng.step():
            got.setdefault(out.request_id, []).append(out.new_token_id)
        steps += 1
    assert [got[i] for i in ids] == alone


@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_offload_at_a_small_cache_gives_the_resident_tokens(checkpoint, resident, prefetch):
    """Offload at 10 of 32 slots, with the lookahead prefetch off and on, gives the resident tokens."""
    prompts = [prompt_ids(13, seed=30), prompt_ids(7, seed=31)]
    expected = engine(resident, running=2).generate(prompts, PARAMS)
    offload = build(checkpoint[1], dtype="float32", moe_strategy="offload", moe_cache_size=10, moe_prefetch=prefetch,
                    moe_prefetch_budget=2, max_running_requests=2, max_context_tokens=256)
    assert engine(offload, running=2).generate(prompts, PARAMS) == expected
    counters = offload.experts.counters()
    assert counters["expert_misses_total"] > 0
    assert (counters["prefetch_useful_total"] > 0) == (prefetch == "on")


def test_state_rows_are_zeroed_when_a_request_ends(resident):
    eng = engine(resident)
    eng.generate([prompt_ids(8, seed=40)], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert eng.states.recurrent.abs().sum() == 0 and eng.states.conv.abs().sum() == 0
    rid = eng.add_request(prompt_ids(8, seed=41), SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.states.recurrent.abs().sum() > 0                       # prefilled and decoding: its row holds state
    assert eng.abort(rid)
    assert eng.states.recurrent.abs().sum() == 0 and eng.states.conv.abs().sum() == 0
    assert eng.states.nbytes == StateCache.nbytes_for(resident.cfg, 1, torch.float32)


def test_a_missing_linear_attention_weight_names_the_file_and_tensor(checkpoint, tmp_path):
    src = checkpoint[1]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.linear_attn.A_log"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.linear_attn\.A_log.*linear_attention"):
        load_model(tmp_path, device="cpu", dtype="float32")


def test_a_plain_attention_context_is_refused(resident):
    kv = KVCache(resident.cfg, max_batch=1, max_context_tokens=16, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(TypeError, match="StatefulContext"):
        resident.model.forward(torch.tensor([1, 2]), torch.arange(2), PrefillAttention(kv, 0, 0, 2))


@pytest.mark.parametrize("strategy", ["hybrid", "cpu"])
def test_hybrid_and_cpu_give_the_resident_tokens(checkpoint, resident, tmp_path, monkeypatch, strategy):
    """The routed experts split between PCIe fetches and two CPU expert processes (hybrid, a cache of 10 of 32
    experts), or every miss computed by the CPU processes (cpu)."""
    from ftexpert.gpu_worker.backends.hybrid import HybridOptions
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    prompts = [prompt_ids(13, seed=50), prompt_ids(7, seed=51)]
    expected = engine(resident, running=2).generate(prompts, PARAMS)
    loaded = build_with_resources(strategy, cache_size=10, model_dir=checkpoint[1], dtype="float32",
                                  max_running_requests=2, max_context_tokens=256,
                                  worker_args=("--threads", "1", "--no-pin", "--hot-ms", "1", "--sleep-max-us", "200"),
                                  hybrid=HybridOptions(cpu_deadline_s=20.0, fetch_fraction=0.5))
    try:
        assert engine(loaded, running=2).generate(prompts, PARAMS) == expected
        assert loaded.experts.counters()["expert_misses_total"] > 0
    finally:
        loaded.close()


def test_the_80b_preset_has_the_real_shapes():
    from ftexpert.gpu_worker.checkpoint import presets
    cfg = presets.preset_config("qwen3-next-80b-a3b")
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.expert_intermediate_size) == \
        (48, 512, 10, 2048, 512)
    assert cfg.layer_types.count("full_attention") == 12 == cfg.num_kv_layers
    assert all(t == "full_attention" for t in cfg.layer_types[3::4])
    assert cfg.shared_expert_intermediate_size == 512 and cfg.linear_attention.conv_dim == 8192
    # 36 linear layers x (32 x 128 x 128 fp32 + 8192 x 3 bf16) a request
    assert StateCache.nbytes_for(cfg, 1, torch.bfloat16) == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    assert presets.describe(cfg).startswith("Qwen3NextForCausalLM: 48 layers, 512 experts top-10")


def mini_next():
    from ftexpert.gpu_worker.checkpoint import presets
    cfg = presets.preset_config("qwen3-next-80b-a3b")
    lin = cfg.linear_attention.__class__(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8,
                                         conv_kernel_dim=4)
    return cfg.replace(vocab_size=96, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                       num_experts=8, top_k=2, expert_intermediate_size=32, shared_expert_intermediate_size=48,
                       dtype="float32", layer_types=cfg.layer_types[:4], linear_attention=lin,
                       extra={"initializer_range": 0.3}, eos_token_ids=(3,))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_a_mini_preset_written_to_disk_loads_in_transformers(monkeypatch, tmp_path, fmt):
    """A preset-shaped random model: in memory equals written to disk, transformers reads the checkpoint with the
    same logits, and the experts serve as NVFP4 too (quantized while loading)."""
    import transformers
    from ftexpert.gpu_worker.checkpoint import presets
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(presets.PRESETS, "mini-next", mini_next())
    in_memory = build(preset="mini-next", seed_weights=5, expert_format=fmt, max_context_tokens=256)
    on_disk = build(tmp_path / "mini", preset="mini-next", seed_weights=5, expert_format=fmt, max_context_tokens=256)
    prompt = [int(t) for t in torch.arange(1, 40) * 5 % 96]
    tokens = engine(in_memory).generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert engine(on_disk).generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True)) == tokens
    if fmt == "bf16":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "mini"), dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0]
        assert rel_err(prefill_logits(on_disk, prompt, 64), expected) <= REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["resident", "offload"])
def test_gpu_engine_with_cuda_graphs_gives_the_cpu_tokens(checkpoint, resident, strategy):
    """On CUDA (float32; the fla kernels where fla imports, dense_gemv at T = 1, decode in CUDA graphs with the state
    rows inside them), two requests joining at different steps give the CPU reference's tokens."""
    prompts = [prompt_ids(70, seed=60), prompt_ids(9, seed=61)]
    expected = engine(resident, running=2, chunk=16).generate(prompts, PARAMS)
    cuda = build(checkpoint[1], device="cuda", dtype="float32", moe_strategy=strategy, max_running_requests=2,
                 max_context_tokens=256, moe_cache_size=10 if strategy == "offload" else None)
    eng = engine(cuda, running=2, chunk=16)
    assert eng.graphs is not None
    assert eng.generate(prompts, PARAMS) == expected
    assert eng.graphs.replays > 0
    assert eng.generate(prompts, PARAMS) == expected        # the graphs replayed again over fresh state rows


@pytest.mark.gpu
def test_gpu_bf16_decode_follows_its_own_prefill(checkpoint):
    """bf16 on CUDA: each greedy token of the decode steps (recurrent state carried through the graphs) is the argmax
    of one prefill over the same sequence (bf16 rounding may flip a near tie: at most one of 16), and the logits of
    two prefills agree on their common positions."""
    loaded = build(checkpoint[1], device="cuda", dtype="bfloat16", max_context_tokens=256)
    prompt = prompt_ids(40, seed=62)
    tokens = engine(loaded, chunk=64).generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    full = prefill_logits_on(loaded, prompt + tokens)
    agree = sum(int(full[len(prompt) - 1 + t].argmax()) == tok for t, tok in enumerate(tokens))
    assert agree >= 15
    again = prefill_logits_on(loaded, prompt + tokens[:8])
    assert rel_err(full[: len(prompt) + 8], again) <= 2e-2


def prefill_logits_on(loaded, ids: list[int]) -> torch.Tensor:
    cfg, dev = loaded.cfg, loaded.device
    kv = KVCache(cfg, max_batch=1, max_context_tokens=256, dtype=loaded.model.dtype, device=dev)
    states = StateCache(cfg, max_batch=1, dtype=loaded.model.dtype, device=dev)
    attn = StatefulContext(PrefillAttention(kv, 0, 0, len(ids)), states.prefill(0, 0))
    return loaded.model.forward(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), attn).float().cpu()


def test_a_checkpoint_written_from_fused_projections_holds_the_separate_tensors(tmp_path):
    """fuse_next_projections leaves the parts as row views of one tensor each; the checkpoint writer writes each part
    as a tensor of its own, with the values of the unfused weights."""
    from safetensors.torch import load_file
    from ftexpert.gpu_worker.checkpoint.expert_sources import RandomExpertSource
    from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import fuse_next_projections, random_next_dense
    from ftexpert.gpu_worker.checkpoint.dense_weights import dense_state_dict
    from ftexpert.gpu_worker.checkpoint.writer import write_checkpoint
    cfg = mini_next()
    fused = random_next_dense(cfg, "cpu", torch.float32, seed=3)
    fuse_next_projections(fused)
    assert fused.layers[0].moe_in_proj is not None
    experts = RandomExpertSource(cfg, torch.float32, seed=3, std=0.02)
    written = {}
    for path in write_checkpoint(tmp_path / "ckpt", cfg, fused, experts).glob("*.safetensors"):
        written.update(load_file(path))
    expected = dense_state_dict(cfg, random_next_dense(cfg, "cpu", torch.float32, seed=3))
    for name, t in expected.items():
        assert torch.equal(written[name], t), name
