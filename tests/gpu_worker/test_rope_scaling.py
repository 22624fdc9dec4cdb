"""YaRN (config.json's rope_parameters / rope_scaling, rope_type "yarn") for the architectures that use the shared
rotary table: the frequencies and attention scaling equal transformers' own, a tiny Qwen3-MoE with YaRN gives
transformers' logits and greedy tokens past its original context, the model's context grows to the original
times the factor, and what is not computed is refused (another rope type, a YaRN without its original context,
a --max-context-tokens beyond the model's context)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ftexpert.gpu_worker.assembly.loader import load_model
from ftexpert.gpu_worker.checkpoint.config import MoeConfig
from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.models.layers import rotary_table, yarn_inv_freq
from tests.built_engines import build
from tests.gpu_worker.test_models_util import hf_model, prompt_ids, rel_err, save_hf

ORIGINAL = 64                   # the tiny model's "trained" context; YaRN x4 stretches it to 256
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@pytest.fixture(scope="module")
def yarn_pair(tmp_path_factory):
    hf = hf_model("qwen3", seed=21, max_position_embeddings=ORIGINAL, rope_theta=10000.0,
                  rope_parameters={**YARN, "rope_theta": 10000.0})
    return hf, save_hf(hf, tmp_path_factory.mktemp("yarn"))


@pytest.mark.parametrize("rope", [YARN, {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
                                  {**YARN, "attention_factor": 1.3}], ids=["published", "betas", "attention-factor"])
def test_the_frequencies_and_scaling_are_transformers(rope):
    from transformers import Qwen3MoeConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=ORIGINAL,
                            rope_parameters={**rope, "rope_theta": 10000.0})
    inv_expected, scale_expected = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    inv, scale = yarn_inv_freq(16, 10000.0, rope, ORIGINAL)
    assert torch.allclose(inv, inv_expected.float(), rtol=1e-6, atol=0) and scale == pytest.approx(scale_expected)
    assert scale != 1.0 and not torch.allclose(inv, 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16))


def test_the_config_reads_yarn_and_its_context(yarn_pair):
    _, path = yarn_pair
    cfg = MoeConfig.from_dir(path)
    assert cfg.rope_scaling == YARN and cfg.context_length == 4 * ORIGINAL
    assert MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg and MoeConfig.from_hf_dict(cfg.to_hf_dict()).rope_scaling == YARN
    table = rotary_table(cfg, cfg.head_dim, 8, "cpu")
    inv, scale = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, YARN, ORIGINAL)
    assert torch.allclose(table.cos[3], torch.cat([(3 * inv).cos(), (3 * inv).cos()]) * scale)


def test_logits_and_greedy_tokens_past_the_original_context_are_transformers(yarn_pair):
    hf, path = yarn_pair
    built = build(path, max_context_tokens=4 * ORIGINAL, prefill_chunk_tokens=32)
    assert built.engine.max_context_tokens == 4 * ORIGINAL
    prompt = prompt_ids(150, seed=22)                                   # beyond the original 64 positions
    expected = []
    with torch.no_grad():               # transformers' full forward each step (its generate() with a cache past
        for _ in range(8):              # max_position_embeddings disagrees with its own forward here)
            expected.append(int(hf(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    assert built.engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0] == expected
    with torch.no_grad():
        hf_last = hf(torch.tensor([prompt])).logits[0, -1]
    plain = hf_model("qwen3", seed=21, max_position_embeddings=4 * ORIGINAL, rope_theta=10000.0)
    with torch.no_grad():
        plain_last = plain(torch.tensor([prompt])).logits[0, -1]
    assert rel_err(plain_last, hf_last) > 1e-2                          # YaRN changes the answer: it is computed
    kv = KVCache(built.cfg, 1, 4 * ORIGINAL, torch.float32, torch.device("cpu"))
    ours_last = built.model.forward(torch.tensor(prompt), torch.arange(len(prompt)),
                                    PrefillAttention(kv, 0, 0, len(prompt)), logit_rows=torch.tensor([len(prompt) - 1]))
    assert rel_err(ours_last[0], hf_last) <= 1e-4


def _edited(path, tmp_path, **changes):
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "factor": 4.0}, "rope type 'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0}, "lacks original_max_position_embeddings"),
    ({**YARN, "mscale": 0.7}, "not supported for YaRN"),
], ids=["longrope", "no-original", "mscale"])
def test_what_is_not_computed_is_refused(yarn_pair, tmp_path, rope, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edited(yarn_pair[1], tmp_path, rope_parameters=rope), device="cpu")


def test_a_context_beyond_the_models_is_refused(yarn_pair, tmp_path):
    with pytest.raises(ValueError, match=r"max_context_tokens=257 is longer than the model's context of 256"):
        build(yarn_pair[1], max_context_tokens=4 * ORIGINAL + 1)
    plain = _edited(yarn_pair[1], tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"context of 64 tokens \(max_position_embeddings.*rope_scaling"):
        build(plain, max_context_tokens=128)


def test_the_128k_preset_is_qwen3_30b_with_its_model_cards_yarn():
    from ftexpert.gpu_worker.checkpoint.presets import preset_config

    base, long = preset_config("qwen3-30b-a3b"), preset_config("qwen3-30b-a3b-128k")
    assert base.context_length == 40960 and long.context_length == 131072
    assert long.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    same = {k: v for k, v in vars(base).items() if k != "rope_scaling"}
    assert {k: v for k, v in vars(long).items() if k != "rope_scaling"} == same
    # the config a worker is given carries the scaling, so a checkpoint written from the preset reads it back
    assert MoeConfig.from_hf_dict(long.to_hf_dict()).context_length == 131072
