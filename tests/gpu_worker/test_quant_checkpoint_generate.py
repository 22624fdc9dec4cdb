"""Quantized checkpoints as they are published, end to end: each on-disk format loads through `load_model` and
generates transformers' greedy tokens (transformers running the format's own dequantization), resident and
offload alike; the experts stay quantized in the backend."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from tests.built_engines import build
from tests.gpu_worker.quant_checkpoints import KINDS, reference_model, write_quant_checkpoint

pytest.importorskip("transformers")
PROMPT = [3, 17, 42, 99, 5, 250, 7, 64, 11, 120, 8, 33]
STEPS = 16


def _built(path, **fields):
    return build(path, dtype="float32", max_running_requests=1, max_context_tokens=64, prefill_chunk_tokens=64,
                 **fields)


def _generate(built, prompt: list[int]) -> list[int]:
    return built.engine.generate([prompt], SamplingParams(max_new_tokens=STEPS, ignore_eos=True))[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_published_format_generates_transformers_tokens(kind, tmp_path):
    ckpt = write_quant_checkpoint(tmp_path / kind, kind)
    vocab = ckpt.config["vocab_size"]
    prompt = [t % vocab for t in PROMPT]
    hf = reference_model(ckpt).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, min_new_tokens=STEPS,
                           eos_token_id=None)[0, len(prompt):].tolist()
    resident = _built(ckpt.path)
    assert resident.source.expert_format.quantized
    assert resident.source.experts.layout.fmt.label == resident.source.expert_format.label
    got = _generate(resident, prompt)
    assert got == want, f"{kind}: {got} != transformers' {want}"
    offload = _built(ckpt.path, moe_strategy="offload", moe_cache_size=4)
    try:
        assert _generate(offload, prompt) == got
    finally:
        offload.close()
