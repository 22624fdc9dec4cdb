"""Decode through CUDA graphs gives exactly the eager tokens, and graphs are really replayed."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.engine import Engine, EngineConfig, SamplingParams
from gpu_worker.models import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_graph_decode_equals_eager(num_prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path))
    loaded = load_model(device="cuda")
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 3][: 3 + i] for i in range(num_prompts)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eager = Engine(loaded.model, EngineConfig(max_running_requests=3, max_context_tokens=256,
                                              cuda_graphs=False), eos_token_ids=())
    graphs = Engine(loaded.model, EngineConfig(max_running_requests=3, max_context_tokens=256),
                    eos_token_ids=())
    assert eager.generate(prompts, params) == graphs.generate(prompts, params)
    assert graphs.graphs.captures >= 1 and graphs.graphs.replays >= 30
    assert eager.graphs is None
