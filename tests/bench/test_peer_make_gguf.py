"""bench/peer_llamacpp/make_gguf.py: the GGUF files of the llama.cpp side-by-side benchmark (docs/PEERS.md).

Tiny files of both architectures in every expert type are written and read back with the `gguf` package's reader;
their tensors and keys are checked against a table written by hand from llama.cpp's loader (b11434:
src/models/qwen3moe.cpp and openai-moe.cpp, llama_model_base::load_hparams and create_tensor_qkv), not from the
writer. Where a llama-bench build is at hand (bench/peer_llamacpp/build.sh cpu, or PEER_LLAMA_BENCH), it loads the
tiny files and runs a short prefill and decode.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = gguf.GGMLQuantizationType


def _make_gguf():
    spec = importlib.util.spec_from_file_location(
        "peer_make_gguf", os.path.join(REPO, "bench", "peer_llamacpp", "make_gguf.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


mg = _make_gguf()

# What llama.cpp's loader asks for, by hand from its source: tensor name -> ne (ggml order, innermost first) in the
# loader's own variable names. {i} is every layer. n_embd_head = attention.key_length.
COMMON = {
    "token_embd.weight": ("n_embd", "n_vocab"),
    "output_norm.weight": ("n_embd",),
    "output.weight": ("n_embd", "n_vocab"),
    "blk.{i}.attn_norm.weight": ("n_embd",),
    "blk.{i}.attn_q.weight": ("n_embd", "n_embd_head*n_head"),
    "blk.{i}.attn_k.weight": ("n_embd", "n_embd_head*n_head_kv"),
    "blk.{i}.attn_v.weight": ("n_embd", "n_embd_head*n_head_kv"),
    "blk.{i}.attn_output.weight": ("n_embd_head*n_head", "n_embd"),
    "blk.{i}.ffn_gate_inp.weight": ("n_embd", "n_expert"),
    "blk.{i}.ffn_gate_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
    "blk.{i}.ffn_down_exps.weight": ("n_ff_exp", "n_embd", "n_expert"),
    "blk.{i}.ffn_up_exps.weight": ("n_embd", "n_ff_exp", "n_expert"),
}
LOADER = {
    "qwen3moe": {**COMMON,
                 "blk.{i}.attn_k_norm.weight": ("n_embd_head",),
                 "blk.{i}.attn_q_norm.weight": ("n_embd_head",),
                 "blk.{i}.ffn_norm.weight": ("n_embd",)},
    "gpt-oss": {**COMMON,
                "blk.{i}.post_attention_norm.weight": ("n_embd",),       # LLM_TENSOR_ATTN_POST_NORM (llama-arch.cpp)
                "blk.{i}.attn_q.bias": ("n_embd_head*n_head",),        # create_tensor_qkv: optional, written
                "blk.{i}.attn_k.bias": ("n_embd_head*n_head_kv",),
                "blk.{i}.attn_v.bias": ("n_embd_head*n_head_kv",),
                "blk.{i}.attn_sinks.weight": ("n_head",),
                "blk.{i}.attn_output.bias": ("n_embd",),
                "blk.{i}.ffn_gate_inp.bias": ("n_expert",),
                "blk.{i}.ffn_gate_exps.bias": ("n_ff_exp", "n_expert"),
                "blk.{i}.ffn_down_exps.bias": ("n_embd", "n_expert"),
                "blk.{i}.ffn_up_exps.bias": ("n_ff_exp", "n_expert")},
}
NVFP4_SCALES = {f"blk.{{i}}.ffn_{m}_exps.scale": ("n_expert",) for m in ("gate", "up", "down")}   # optional to it
# keys the loader requires (get_key without `false`) or needs non-zero, and the ones these shapes set
REQUIRED_KEYS = {
    "qwen3moe": ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
                 "attention.key_length", "attention.value_length", "expert_feed_forward_length", "rope.freq_base"],
    "gpt-oss": ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
                "attention.key_length", "attention.value_length", "expert_feed_forward_length", "rope.freq_base",
                "attention.sliding_window", "rope.scaling.type", "rope.scaling.factor",
                "rope.scaling.original_context_length"],
}
# the real models' numbers (their config.json), by hand: what the full-size files must say
REAL = {
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_vocab=151936, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4,
                          n_embd_head=128, n_expert=128, n_expert_used=8, n_ff_exp=768),
    "gpt-oss-120b": dict(arch="gpt-oss", n_vocab=201088, n_embd=2880, n_layer=36, n_head=64, n_head_kv=8,
                         n_embd_head=64, n_expert=128, n_expert_used=4, n_ff_exp=2880),
}
DENSE_TYPE = {"token_embd.weight": T.BF16, "output.weight": T.BF16}


def _expected(arch: str, dims: dict, n_layer: int, expert_type) -> dict[str, tuple[int, ...]]:
    table = dict(LOADER[arch])
    if expert_type == T.NVFP4:
        table.update(NVFP4_SCALES)
    out = {}
    for name, ne in table.items():
        value = tuple(int(eval(d, {}, dims)) for d in ne)           # noqa: S307 (the table's own expressions)
        for i in (range(n_layer) if "{i}" in name else [None]):
            out[name.format(i=i)] = value
    return out


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def _dims(reader, arch):
    k = lambda s: _field(reader, f"{arch}.{s}")                     # noqa: E731
    return dict(n_embd=k("embedding_length"), n_head=k("attention.head_count"), n_head_kv=k("attention.head_count_kv"),
                n_embd_head=k("attention.key_length"), n_expert=k("expert_count"),
                n_ff_exp=k("expert_feed_forward_length"), n_vocab=len(reader.fields["tokenizer.ggml.tokens"].data))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    files = {}
    for arch in ("qwen3moe", "gpt-oss"):
        for name in mg.EXPERT_TYPES:
            path = d / f"{arch}-{name}.gguf"
            mg.write_gguf(path, mg.tiny_shape(arch), name, seed=7, threads=2, log=lambda *_: None)
            files[arch, name] = path
    return files


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("experts", ["bf16", "q8_0", "q4_0", "mxfp4", "nvfp4"])
def test_tiny_file_has_the_tensors_and_keys_llamacpp_loads(tiny_files, arch, experts):
    r = gguf.GGUFReader(tiny_files[arch, experts])
    assert _field(r, "general.architecture") == arch
    for key in REQUIRED_KEYS[arch]:
        assert f"{arch}.{key}" in r.fields, key
    n_layer = _field(r, f"{arch}.block_count")
    assert n_layer == 2
    assert _field(r, f"{arch}.expert_count") > 0 and _field(r, f"{arch}.expert_used_count") > 0
    assert _field(r, f"{arch}.attention.key_length") == _field(r, f"{arch}.attention.value_length")
    if arch == "gpt-oss":
        assert _field(r, "gpt-oss.rope.scaling.type") == "yarn"
    expert_type = mg.EXPERT_TYPES[experts][0]
    want = _expected(arch, _dims(r, arch), n_layer, expert_type)
    got = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert got == want
    for t in r.tensors:
        if "_exps.weight" in t.name:
            assert t.tensor_type == expert_type, t.name
        elif t.name in DENSE_TYPE or t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                        "attn_output.weight")):
            assert t.tensor_type == T.BF16, t.name
        else:                                        # norms, router, biases, sinks, NVFP4 scales
            assert t.tensor_type == T.F32, t.name
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        assert t.n_bytes == math.prod(int(x) for x in t.shape) // block * size, t.name


@pytest.mark.parametrize("experts", ["bf16", "q8_0", "q4_0", "mxfp4"])
def test_weights_are_finite_small_and_not_all_alike(tiny_files, experts):
    r = gguf.GGUFReader(tiny_files["qwen3moe", experts])
    for t in r.tensors:
        if not t.name.startswith("blk.1."):
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        assert np.isfinite(w).all(), t.name
        if t.name.endswith("norm.weight"):
            assert (w == 1.0).all(), t.name
            continue
        assert 0 < np.abs(w).max() < 0.5, (t.name, np.abs(w).max())
        assert 0.001 < np.sqrt(np.mean(w * w)) < 0.1, t.name
        assert np.unique(w).size > 8, t.name


def test_the_same_seed_writes_the_same_file_whatever_the_threads(tmp_path):
    s = mg.tiny_shape("gpt-oss")
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    mg.write_gguf(a, s, "mxfp4", seed=3, threads=1, log=lambda *_: None)
    mg.write_gguf(b, s, "mxfp4", seed=3, threads=3, log=lambda *_: None)
    mg.write_gguf(c, s, "mxfp4", seed=4, threads=1, log=lambda *_: None)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_vocabulary_is_a_valid_byte_level_bpe(tiny_files):
    r = gguf.GGUFReader(tiny_files["qwen3moe", "bf16"])
    f = r.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    mf = r.fields["tokenizer.ggml.merges"]
    merges = [bytes(mf.parts[i]).decode("utf-8") for i in mf.data]
    assert _field(r, "tokenizer.ggml.model") == "gpt2" and _field(r, "tokenizer.ggml.pre") == "qwen2"
    assert len(set(tokens)) == len(tokens) == 512
    eos = _field(r, "tokenizer.ggml.eos_token_id")
    assert types[eos] == int(gguf.TokenType.CONTROL)
    # every ordinary token is made of GPT-2's byte symbols only (llama.cpp decodes them byte by byte), all 256 are
    # tokens (the newline llama.cpp tokenizes at load among them), and every merge joins two tokens into one
    symbols = set(mg.byte_symbols())
    assert len(symbols) == 256 and symbols <= set(tokens) and "\u010a" in symbols
    for tok, ty in zip(tokens, types):
        if ty == int(gguf.TokenType.NORMAL):
            assert set(tok) <= symbols, tok
    vocab = set(tokens)
    for m in merges:
        left, right = m.split(" ")
        assert left in vocab and right in vocab and left + right in vocab, m


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_full_size_plan_matches_the_real_model(model):
    """The full-size tensors (no data written): every tensor llama.cpp loads, the real model's sizes."""
    s = mg.preset_shape(model)
    real = REAL[model]
    assert s.arch == real["arch"]
    assert (s.n_vocab, s.n_embd, s.n_layer, s.n_head, s.n_head_kv, s.head_dim, s.n_expert, s.n_expert_used,
            s.n_ff_exp) == tuple(real[k] for k in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv",
                                                   "n_embd_head", "n_expert", "n_expert_used", "n_ff_exp"))
    for name, (expert_type, _) in mg.EXPERT_TYPES.items():
        specs = mg.tensor_specs(s, expert_type)
        got = {sp.name: sp.ne for sp in specs}
        assert got == _expected(real["arch"], real, real["n_layer"], expert_type), name
        experts = sum(sp.nbytes for sp in specs if sp.fill == "expert")
        assert experts == mg.expert_bytes(s, expert_type) * s.n_layer * s.n_expert
    # bytes of one expert: BF16 2 bytes a weight, Q8_0 34 per 32, Q4_0 18 per 32, MXFP4 17 per 32, NVFP4 36 per 64
    w = 3 * real["n_embd"] * real["n_ff_exp"]
    assert mg.expert_bytes(s, T.BF16) == 2 * w
    assert mg.expert_bytes(s, T.Q8_0) == w // 32 * 34
    assert mg.expert_bytes(s, T.Q4_0) == w // 32 * 18 == mg.expert_bytes(s, T.NVFP4)
    assert mg.expert_bytes(s, T.MXFP4) == w // 32 * 17


def _llama_bench() -> str | None:
    path = os.environ.get("PEER_LLAMA_BENCH") or os.path.join(REPO, "bench", "peer_llamacpp", "bin", "cpu",
                                                               "llama-bench")
    return path if os.access(path, os.X_OK) else None


@pytest.mark.skipif(_llama_bench() is None, reason="no llama-bench build (bench/peer_llamacpp/build.sh cpu)")
@pytest.mark.parametrize("arch,experts", [("qwen3moe", "bf16"), ("qwen3moe", "q8_0"), ("qwen3moe", "q4_0"),
                                          ("qwen3moe", "mxfp4"), ("gpt-oss", "mxfp4")])
def test_llama_bench_loads_and_runs_the_tiny_file(tiny_files, arch, experts):
    out = subprocess.run([_llama_bench(), "-m", str(tiny_files[arch, experts]), "-p", "16", "-n", "4", "-r", "1",
                          "-t", "2", "-o", "json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert {(r["n_prompt"], r["n_gen"]) for r in rows} == {(16, 0), (0, 4)}
    assert all(r["avg_ts"] > 0 for r in rows)
    assert all(r["model_type"].startswith({"qwen3moe": "qwen3moe", "gpt-oss": "gpt-oss"}[arch]) for r in rows), rows
