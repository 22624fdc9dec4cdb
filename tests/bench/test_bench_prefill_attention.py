"""bench/bench_prefill_attention.py: its FLOP count is the causal mask's (counted pair by pair), and without a GPU it
refuses with a message instead of timing nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
import bench_prefill_attention as bpa  # noqa: E402


@pytest.mark.parametrize("C, S", [(1, 1), (4, 10), (7, 7), (16, 100)])
def test_the_flops_count_the_pairs_the_lower_right_causal_mask_lets_through(C, S):
    pairs = int(causal_lower_right(C, S)._materialize().sum())
    Hq, D = 3, 8
    assert bpa.causal_flops(C, S, Hq, D) == 4 * D * Hq * pairs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_without_a_gpu_it_refuses():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_prefill_attention.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
