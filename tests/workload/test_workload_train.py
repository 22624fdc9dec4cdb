"""`python -m ftexpert.workload.train_moe`: a trained tiny checkpoint that transformers and `ft generate` load
with the same greedy tokens; the model's pieces against transformers'; determinism; bad input."""
from __future__ import annotations

import json

import pytest
import torch

from ftexpert.workload import corpus
from ftexpert.workload.checkpoint import load_checkpoint
from ftexpert.workload.model import MoeLM, experts_forward, load_balancing_loss
from ftexpert.workload.shapes import SHAPES
from ftexpert.workload.train_moe import main as train_main

transformers = pytest.importorskip("transformers")

TRAIN_TOKENS = 40 * 2048          # 40 steps: enough that greedy text is words, not one repeated token


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("wl") / "tiny"
    assert train_main(["--shape", "tiny", "--out", str(out), "--tokens", str(TRAIN_TOKENS),
                       "--device", "cpu", "--seed", "3"]) == 0
    return out


PROMPT = "And God said unto"


@pytest.fixture(scope="module")
def hf_reference(trained):
    """(prompt ids, transformers' 32 greedy tokens, the transformers model), computed once."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    prompt = transformers.AutoTokenizer.from_pretrained(trained)(PROMPT).input_ids
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return prompt, out[0, len(prompt):].tolist(), hf


def test_checkpoint_layout_and_metadata(trained):
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 8
    assert cfg["num_experts_per_tok"] == 2 and cfg["norm_topk_prob"] is True
    meta = json.loads((trained / "ft_workload.json").read_text())
    assert meta["shape"] == "tiny" and meta["seed"] == 3 and meta["tokens"] == TRAIN_TOKENS
    tok = transformers.AutoTokenizer.from_pretrained(trained)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("And God said").input_ids) == "And God said"


def test_greedy_tokens_match_transformers(trained, hf_reference):
    prompt, hf_tokens, hf = hf_reference
    model, tok = load_checkpoint(trained)
    assert tok.encode(PROMPT).ids == prompt
    ours = model.greedy(prompt, 32)
    assert ours == hf_tokens
    assert len(set(ours)) > 2, f"a barely trained model: {tok.decode(ours)!r}"
    ids = torch.tensor([prompt + ours])
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_ft_generate_loads_the_checkpoint(trained, hf_reference, capsys, monkeypatch, tmp_path):
    from ftexpert.coordinator.cli import main as ft_main
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    prompt, hf_tokens, _ = hf_reference
    assert ft_main(["generate", "--model", str(trained), "--prompt", PROMPT, "--max-new-tokens", "16",
                    "--temperature", "0", "--ignore-eos", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompt_token_ids"] == prompt
    assert result["token_ids"] == hf_tokens[:16]


def test_training_is_deterministic_for_a_seed(tmp_path):
    small = tmp_path / "small.txt"                   # a small --corpus keeps the three runs quick
    small.write_text("\n".join(corpus.load_documents()[:60]) + "\n")

    def weights(name: str, seed: int) -> bytes:
        out = tmp_path / name
        train_main(["--shape", "tiny", "--out", str(out), "--tokens", "4096", "--device", "cpu",
                    "--seed", str(seed), "--corpus", str(small)])
        assert json.loads((out / "ft_workload.json").read_text())["corpus"] == str(small)
        return (out / "model.safetensors").read_bytes()
    first = weights("a", 5)
    assert weights("b", 5) == first
    assert weights("c", 6) != first


def test_minutes_fixes_the_step_count_after_timing(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("\n".join(corpus.load_documents()[:60]) + "\n")
    out = tmp_path / "m"
    assert train_main(["--shape", "tiny", "--out", str(out), "--minutes", "0.001", "--device", "cpu",
                       "--corpus", str(small)]) == 0
    meta = json.loads((out / "ft_workload.json").read_text())
    from ftexpert.workload.train_moe import TIMING_STEPS, WARM_STEPS
    # 0.06 s buys fewer steps than the warm-up, the timed steps and one more, or the lr warm-up and one more
    warmup_floor = max(WARM_STEPS + TIMING_STEPS + 1, SHAPES["tiny"].warmup_steps + 1)
    assert meta["steps"] == warmup_floor and meta["tokens"] == warmup_floor * 2048
    assert f"--minutes 0.001: {warmup_floor} steps (--tokens {warmup_floor * 2048} reproduces it)" \
        in capsys.readouterr().out


def test_grouped_experts_match_the_loop():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=gen, requires_grad=True)
    gate_up = torch.randn(6, 2 * 8, 16, generator=gen, requires_grad=True)
    down = torch.randn(6, 16, 8, generator=gen, requires_grad=True)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(37)])
    ids[:, 0] = 5                                    # expert 5 busy, some experts idle in places
    weights = torch.rand(37, 3, generator=gen)
    outs, grads = [], []
    for impl in ("grouped", "loop"):
        y = experts_forward(x, ids, weights, gate_up, down, impl)
        g = torch.autograd.grad(y.square().sum(), (x, gate_up, down))
        outs.append(y)
        grads.append(g)
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # and against the per-token definition
    ref = torch.zeros(37, 16)
    for t in range(37):
        for j in range(3):
            e = ids[t, j]
            h = gate_up[e] @ x[t]
            ref[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(h[:8]) * h[8:]))
    torch.testing.assert_close(outs[1], ref, rtol=1e-4, atol=1e-4)


def test_load_balancing_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(50, 8, generator=gen) * 2 for _ in range(3)]
    ref = load_balancing_loss_func(tuple(logits), 8, 2)
    torch.testing.assert_close(load_balancing_loss(logits, 8, 2), ref)


def test_the_routing_shapes_are_fixed():
    olmoe, qwen = SHAPES["olmoe-routing"], SHAPES["qwen3-30b-a3b-routing"]
    assert (olmoe.num_layers, olmoe.num_experts, olmoe.top_k, olmoe.norm_topk_prob) == (16, 64, 8, False)
    assert (qwen.num_layers, qwen.num_experts, qwen.top_k, qwen.norm_topk_prob) == (48, 128, 8, True)
    for shape in SHAPES.values():                    # builds, and the grouped GEMM's alignment holds
        cfg = shape.model_config()
        assert cfg.hidden_size % 16 == 0 and cfg.moe_intermediate_size % 16 == 0
        assert cfg.num_heads % cfg.num_kv_heads == 0
    MoeLM(SHAPES["tiny"].model_config())


def test_bad_input_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_main(["--shape", "tiny", "--out", str(tmp_path / "x"), "--tokens", "10", "--minutes", "1"])
    with pytest.raises(SystemExit):
        train_main(["--shape", "huge", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):
        train_main(["--shape", "tiny", "--out", str(tmp_path / "x"), "--tokens", "0"])
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        train_main(["--shape", "tiny", "--out", str(full), "--tokens", "2048", "--device", "cpu"])
    with pytest.raises(FileNotFoundError, match="corpus"):
        train_main(["--shape", "tiny", "--out", str(tmp_path / "y"), "--device", "cpu",
                    "--corpus", str(tmp_path / "missing.txt")])
    short = tmp_path / "short.txt"
    short.write_text("one line\n")
    with pytest.raises(ValueError, match="at least"):
        corpus.load_documents(short)


def test_routing_cli_writes_the_trace_its_statistics_come_from(trained, tmp_path, capsys):
    from ftexpert.workload.routing import main as routing_main, routing_stats
    from ftexpert.proto.routing_trace import read_trace
    trace_path, json_path = tmp_path / "r.trace", tmp_path / "r.json"
    assert routing_main(["--model", str(trained), "--tokens", "700", "--trace", str(trace_path),
                         "--json", str(json_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("700 tokens in 2 sequences; 4 layers, 8 experts, top-2")
    assert printed.splitlines()[-1].split()[0] == "all"
    trace = read_trace(trace_path)
    assert trace.num_tokens == 700 and trace.seq_starts.tolist() == [0, 512]
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(routing_stats(trace)))
    with pytest.raises(SystemExit):
        routing_main(["--model", str(trained), "--tokens", "1"])
    with pytest.raises(FileNotFoundError, match="config.json"):
        routing_main(["--model", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_training_on_cuda_is_deterministic_for_a_seed(tmp_path, compiled):
    """The CUDA path (grouped GEMMs, bf16 autocast; compiled decoder layers or eager): two runs of one seed write
    the same bytes, another seed does not."""
    small = tmp_path / "small.txt"
    small.write_text("\n".join(corpus.load_documents()[:60]) + "\n")

    def weights(name: str, seed: int) -> bytes:
        out = tmp_path / name
        train_main(["--shape", "tiny", "--out", str(out), "--tokens", "65536", "--device", "cuda",
                    "--seed", str(seed), "--corpus", str(small), *([] if compiled else ["--no-compile"])])
        return (out / "model.safetensors").read_bytes()
    first = weights("a", 5)
    assert weights("b", 5) == first
    assert weights("c", 6) != first
