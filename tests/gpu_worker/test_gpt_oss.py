"""gpt-oss against transformers itself (float32, CPU): logits within 1e-4 relative error, identical greedy tokens
for 32 steps with prompts longer than the sliding window, one request or three batched; the offload strategy at a
small cache gives the resident tokens; an MXFP4 checkpoint in the hub's layout equals transformers on the
dequantized weights; misuse names the file and the tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from tests.built_engines import build, build_with_resources, engine_of
from tests.gpu_worker.gpt_oss_util import WINDOW, hf_gpt_oss, save_mxfp4
from tests.gpu_worker.test_models_parity import prefill_logits
from tests.gpu_worker.test_models_util import hf_greedy, prompt_ids, rel_err

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_gpt_oss(seed=7)
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(str(path))
    return hf, path, build(path, dtype="float32", max_context_tokens=128)


def test_config_reads_what_transformers_wrote(pair):
    _, path, ours = pair
    cfg = ours.cfg
    assert cfg.arch == "gptoss" and cfg.top_k == 4 and cfg.sliding_window is None
    p = cfg.extra["gpt_oss"]
    assert p["window"] == WINDOW and p["layer_types"][1] == "full_attention" and p["rope"]["rope_type"] == "yarn"
    assert MoeConfig.from_hf_dict(cfg.to_hf_dict()).extra["gpt_oss"] == p
    assert ours.model.experts.layout.act.label == "swiglu-clamp:1.702:7.0"


@pytest.mark.parametrize("chunk", [64, 5], ids=["one_chunk", "chunks_of_5"])
def test_logits_match_transformers(pair, chunk):
    hf, _, ours = pair
    prompt = prompt_ids(23, seed=3)                         # 23 > WINDOW: the sliding layers drop keys
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    got = prefill_logits(ours, prompt, chunk)
    assert rel_err(got, expected) <= REL_TOL


def test_logits_match_transformers_with_one_query_slices(pair, monkeypatch):
    """The sinks' and windows' prefill in slices of one query each (a logits budget of 1 byte), as a long context
    is: the same logits."""
    from ftexpert.gpu_worker.engine import sink_attention
    hf, _, ours = pair
    monkeypatch.setattr(sink_attention, "CUSTOM_LOGITS_BYTES", 1)
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert rel_err(prefill_logits(ours, prompt, 64), expected) <= REL_TOL


def test_the_fused_forward_matches_transformers(pair, tmp_path):
    """The fused forward (the CUDA default; its kernels' references here): q / k / v in one biased GEMM over the
    concatenated weights and biases (the projections views of them), the fused norms, rope and routing."""
    hf, path, _ = pair
    fused = build(path, dtype="float32", max_context_tokens=128, fused_kernels="on")
    layer = fused.model.dense.layers[0]
    assert fused.model.fused_kernels and layer.qkv_proj is not None and layer.qkv_bias is not None
    assert layer.k_bias.data_ptr() == layer.qkv_bias[layer.q_bias.numel():].data_ptr()      # views, no copies
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert rel_err(prefill_logits(fused, prompt, 64), expected) <= REL_TOL
    short = prompt_ids(11, seed=4)                # (transformers' generate is checked up to 11-13 tokens here)
    assert _greedy(fused, [short], 16) == [hf_greedy(hf, short, 16)]


def test_the_fused_forwards_biased_projections_through_dense_gemv(pair, monkeypatch):
    """`dense_linear` gemv (the CUDA default): a decode token's q/k/v, o and router projections go through
    kernels/dense_gemv with their biases (here its reference; the kernel's lockstep: tests/kernels/test_dense_gemv.py),
    and greedy decoding still gives transformers' tokens."""
    from ftexpert.kernels import dense_gemv
    hf, path, _ = pair
    biased = []
    real = dense_gemv.linear_gemv

    def spy(h, w, **kw):
        biased.append(kw.get("bias") is not None)
        return real(h, w, **kw)
    monkeypatch.setattr(dense_gemv, "linear_gemv", spy)
    fused = build(path, dtype="float32", max_context_tokens=128, fused_kernels="on", dense_linear="gemv")
    assert fused.model.dense_linear == "gemv"
    short = prompt_ids(11, seed=4)
    assert _greedy(fused, [short], 16) == [hf_greedy(hf, short, 16)]
    layers = len(fused.model.dense.layers)
    assert sum(biased) >= 15 * 3 * layers and all(biased)             # 15 decode steps x (qkv, o, router) a layer


def test_the_window_and_the_sinks_matter(pair):
    """A model that ignored the window or the sinks would be off by far more than REL_TOL."""
    hf, _, ours = pair
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
        layers = ours.model.dense.layers
        saved = [layer.sinks.clone() for layer in layers]
        for layer in layers:
            layer.sinks.fill_(-1e4)                          # sinks off
        no_sinks = prefill_logits(ours, prompt, 64)
        for layer, s in zip(layers, saved):
            layer.sinks.copy_(s)
    assert rel_err(no_sinks, expected) > 100 * REL_TOL
    params = ours.model.params
    ours.model.params = type(params)(**{**params.__dict__, "window": None})
    try:
        no_window = prefill_logits(ours, prompt, 64)
    finally:
        ours.model.params = params
    assert rel_err(no_window, expected) > 100 * REL_TOL


def test_greedy_generation_matches_transformers(pair):
    hf, _, ours = pair
    prompt = prompt_ids(11, seed=4)
    expected = hf_greedy(hf, prompt, 32)
    engine = engine_of(ours, max_context_tokens=128, prefill_chunk_tokens=4)
    assert engine.generate([prompt], SamplingParams(max_new_tokens=32, ignore_eos=True))[0] == expected


def test_batched_greedy_generation_matches_transformers(pair):
    hf, _, ours = pair
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 13, 9)]
    expected = [hf_greedy(hf, p, 20) for p in prompts]
    engine = engine_of(ours, max_running_requests=3, max_context_tokens=128)
    assert engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True)) == expected


def test_the_triton_decode_attention_with_sinks_gives_transformers_tokens(pair):
    """The decode attention's Triton kernel (the Triton interpreter here) with the sinks in its merge, on the full
    and the sliding layers (one window group, one not): transformers' greedy tokens, two requests past the window."""
    hf, _, ours = pair
    prompts = [prompt_ids(n, seed=30 + n) for n in (21, 6)]
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    engine = engine_of(ours, max_running_requests=2, max_context_tokens=128, attention_backend="triton")
    assert engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True)) == expected


def _greedy(built, prompts, n=32):
    engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=4)
    return engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=n, ignore_eos=True))


@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_offload_at_a_small_cache_gives_the_resident_tokens(pair, tmp_path, monkeypatch, prefetch):
    """Offload at 10 of 24 slots, with the lookahead prefetch off and on (its router predictor with the router's
    bias), gives the resident tokens."""
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    _, path, ours = pair
    prompts = [prompt_ids(11, seed=4), prompt_ids(17, seed=5)]
    resident = _greedy(ours, prompts)
    loaded = build(path, dtype="float32", moe_strategy="offload", moe_cache_size=10, moe_prefetch=prefetch,
                   moe_prefetch_budget=2, max_context_tokens=128)
    try:
        assert _greedy(loaded, prompts) == resident
        counters = loaded.experts.counters()
        assert counters["expert_misses_total"] > 0
        assert (counters["prefetch_useful_total"] > 0) == (prefetch == "on")
    finally:
        loaded.close()


def test_mxfp4_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path):
    hf = hf_gpt_oss(seed=11)
    path = save_mxfp4(hf, tmp_path / "mxfp4")
    ours = build(path, dtype="float32", max_context_tokens=128)
    assert ours.model.experts.layout.fmt.label == "mxfp4"
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert rel_err(prefill_logits(ours, prompt, 5), expected) <= REL_TOL
    assert _greedy(ours, [prompt_ids(11, seed=4)])[0] == hf_greedy(hf, prompt_ids(11, seed=4), 32)
    # served dequantized (bf16 format rows in float32): the same model
    deq = load_model(path, device="cpu", dtype="float32", expert_format="bf16")
    assert rel_err(prefill_logits(deq, prompt, 64), expected) <= REL_TOL


def test_quantized_at_load_keeps_the_biases(pair):
    """--expert-format mxfp4 on the unquantized checkpoint: the rows' biases are the float rows' exactly, and the
    weights are quantize_expert's of them."""
    from ftexpert.gpu_worker.checkpoint.expert_layout import bias_views, expert_views
    from ftexpert.kernels.expert_reference import quantize_expert
    _, path, ours = pair
    quant = load_model(path, device="cpu", dtype="float32", expert_format="mxfp4")
    qlay, flay = quant.model.experts.layout, ours.model.experts.layout
    assert qlay.fmt.label == "mxfp4" and qlay.act == flay.act
    for layer in range(ours.cfg.num_layers):
        qrows, frows = quant.model.experts.packed[layer], ours.model.experts.packed[layer]
        for q, f in zip(bias_views(qrows, qlay), bias_views(frows, flay)):
            assert torch.equal(q, f) and f.abs().sum() > 0
        want = quantize_expert(*expert_views(frows[3], flay), qlay.fmt)
        assert torch.equal(qrows[3, : want.numel()], want)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_missing_expert_bias_names_the_file_and_tensor(pair, tmp_path):
    _, path, _ = pair
    bad = _copy(path, tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"bad.*model\.layers\.1\.mlp\.experts\.down_proj_bias"):
        load_model(bad, device="cpu", dtype="float32")


@pytest.mark.parametrize("change,message", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
])
def test_configs_it_cannot_compute_are_refused(pair, tmp_path, change, message):
    _, path, _ = pair
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"config\.json.*{message}"):
        MoeConfig.from_dir(tmp_path)


# expert format -> the CPU workers' kernel: an MXFP4 store runs the compiled quant_ffn.c in the C serving loop (the
# biases in fp32, the compute dtype); a float32 bf16-format store the torch kernel (the compiled bf16 kernel reads
# bf16 weights only)
CPU_KERNELS = {"mxfp4": "native-", "bf16": "torch"}


@pytest.mark.parametrize("expert_format", list(CPU_KERNELS))
@pytest.mark.parametrize("strategy", ["hybrid", "cpu"])
def test_cpu_pool_strategies_give_the_resident_tokens(pair, tmp_path, monkeypatch, caplog, strategy, expert_format):
    """The CPU workers compute the biased clamped SwiGLU experts (the store's rows carry the biases), with the
    kernel their log line names."""
    import logging

    from ftexpert.coordinator import supervisor
    from ftexpert.gpu_worker.backends.hybrid import HybridOptions

    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger=supervisor.log.name)          # where the workers' stderr lines go
    _, path, ours = pair
    if expert_format != "bf16":
        ours = build(path, dtype="float32", expert_format=expert_format, max_context_tokens=128)
    prompts = [prompt_ids(11, seed=4), prompt_ids(17, seed=5)]
    resident = _greedy(ours, prompts)
    # over real CPU worker processes, attached as the GPU worker does (their log lines reach the
    # coordinator.supervisor logger at INFO)
    loaded = build_with_resources(strategy, model_dir=path, dtype="float32", cache_size=10,
                                  expert_format=expert_format, max_context_tokens=128, num_workers=1,
                                  worker_args=("--threads", "1", "--no-pin", "--hot-ms", "1", "--act-quant", "fp32"),
                                  log_level="INFO",
                                  hybrid=HybridOptions(cpu_deadline_s=20.0, fetch_fraction=0.5))
    try:
        assert _greedy(loaded, prompts) == resident
        assert loaded.experts.counters()["expert_misses_total"] > 0
        kernels = [m.split(", kernel ")[1].split(",")[0] for m in caplog.messages if "serving channel" in m]
        assert kernels and all(k.startswith(CPU_KERNELS[expert_format]) for k in kernels), caplog.messages[-20:]
        native_loop = any("hot loop: C (ft_serve)" in m for m in caplog.messages)      # the compiled serving loop
        assert native_loop == (CPU_KERNELS[expert_format] == "native-"), caplog.messages[-20:]
    finally:
        loaded.close()


def _small_preset():
    from ftexpert.gpu_worker.checkpoint.presets import preset_config
    cfg = preset_config("gpt-oss-20b")
    p = dict(cfg.extra["gpt_oss"])
    p.update(layer_types=["sliding_attention", "full_attention"], window=WINDOW)
    return cfg.replace(vocab_size=VOCAB_SMALL, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, num_experts=8, expert_intermediate_size=32, dtype="float32",
                       eos_token_ids=(), pad_token_id=None, extra={**cfg.extra, "gpt_oss": p})


VOCAB_SMALL = 128


def test_presets_have_the_published_shapes():
    from ftexpert.gpu_worker.checkpoint.presets import preset_config
    small, big = preset_config("gpt-oss-20b"), preset_config("gpt-oss-120b")
    assert (small.num_layers, small.num_experts, small.top_k, small.hidden_size,
            small.expert_intermediate_size) == (24, 32, 4, 2880, 2880)
    assert (big.num_layers, big.num_experts, big.hidden_size) == (36, 128, 2880)
    assert small.expert_format == big.expert_format == "mxfp4"
    assert big.extra["gpt_oss"]["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_a_written_preset_loads_in_transformers_and_as_mxfp4(tmp_path):
    """The preset's writer: transformers' layout reads back in transformers with our logits; the MXFP4 layout
    gives exactly the experts that quantizing the float ones at load gives."""
    import transformers

    from ftexpert.gpu_worker.checkpoint.writer import write_checkpoint
    from ftexpert.gpu_worker.checkpoint.presets import random_model_parts
    cfg = _small_preset()
    _, dense, experts = random_model_parts(cfg, "cpu", torch.float32, seed=3)
    with torch.no_grad():                                 # larger weights than the preset's 0.02: a test that bites
        for layer in dense.layers:
            for t in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.router, layer.sinks):
                t.mul_(15)
    experts.std = 0.3
    float_dir = write_checkpoint(tmp_path / "float", cfg.replace(expert_format="bf16"), dense, experts)
    mx_dir = write_checkpoint(tmp_path / "mx", cfg.replace(expert_format="bf16"), dense, experts,
                              expert_format="mxfp4", shards="per_layer")
    hf = transformers.GptOssForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval()
    ours = load_model(float_dir, device="cpu", dtype="float32")
    prompt = prompt_ids(23, seed=3)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].float()
    assert rel_err(prefill_logits(ours, prompt, 64), expected) <= REL_TOL
    mx = load_model(mx_dir, device="cpu", dtype="float32")
    at_load = load_model(float_dir, device="cpu", dtype="float32", expert_format="mxfp4")
    assert mx.model.experts.layout == at_load.model.experts.layout
    for layer in range(cfg.num_layers):
        assert torch.equal(mx.model.experts.packed[layer], at_load.model.experts.packed[layer])


HARMONY_LIKE = ("{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def test_the_chat_path_uses_the_checkpoints_chat_template_jinja(pair, tmp_path):
    """gpt-oss keeps its (harmony) template in chat_template.jinja, not tokenizer_config.json: the model's tokenizer
    and the service's chat codec built from it both render with it."""
    from ftexpert.coordinator.text_codec import ChatMessage, TextCodec
    from ftexpert.gpu_worker.checkpoint.tiny import ensure_tiny_checkpoint
    from ftexpert.gpu_worker.checkpoint.tokenizer import TextTokenizer
    _, path, _ = pair
    ckpt = _copy(path, tmp_path / "chat")
    shutil.copy(ensure_tiny_checkpoint() / "tokenizer.json", ckpt / "tokenizer.json")
    (ckpt / "chat_template.jinja").write_text(HARMONY_LIKE)
    want = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    tok = TextTokenizer.from_dir(ckpt)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == want
    loaded = load_model(ckpt, device="cpu", dtype="float32")
    codec = TextCodec.from_text_tokenizer(loaded.tokenizer, loaded.eos_token_ids)
    assert codec.chat_template.render([ChatMessage("user", "hi")]) == want
    assert TextCodec.from_model_dir(str(ckpt)).chat_template.render([ChatMessage("user", "hi")]) == want


@pytest.mark.gpu
@pytest.mark.parametrize("expert_format", ["auto", "mxfp4"])
def test_on_the_gpu_graphs_offload_and_transformers_agree(pair, tmp_path, monkeypatch, expert_format):
    """CUDA, float32: the decode graphs (Triton gemv with the biases and the clamped SwiGLU, the sink attention)
    give the eager tokens and transformers' (float experts), and offload at a small cache gives resident's."""
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    hf, path, _ = pair
    prompts = [prompt_ids(11, seed=4), prompt_ids(17, seed=5)]

    def run(built, graphs):
        engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=4,
                           cuda_graphs="on" if graphs else "off")
        return engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=32, ignore_eos=True))

    resident = build(path, device="cuda", dtype="float32", expert_format=expert_format, max_context_tokens=128)
    eager, graphs = run(resident, False), run(resident, True)
    assert graphs == eager
    if expert_format == "auto":
        assert eager == [hf_greedy(hf, p, 32) for p in prompts]
    offload = build(path, device="cuda", dtype="float32", moe_strategy="offload", moe_cache_size=10,
                    expert_format=expert_format, max_context_tokens=128)
    try:
        assert run(offload, True) == eager
    finally:
        offload.close()
