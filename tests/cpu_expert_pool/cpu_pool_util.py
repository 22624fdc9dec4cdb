"""Shared helpers for the CPU-pool tests."""
from __future__ import annotations

import signal
import uuid

import pytest
import torch

from ftexpert.proto.shm_layout import create_worker_channel
from ftexpert.cpu_expert_pool.api import CpuWorkerProc
from ftexpert.cpu_expert_pool.reference import expert_weights, reference_moe_layer
from ftexpert.proto.expert_act import gpt_oss_act
from ftexpert.kernels.expert_reference import apply_act
from ftexpert.proto.expert_store import ExpertStore

GPT_OSS = gpt_oss_act().label
# Biased test stores: gate / up weights scaled by this (and biases of 2 N(0, 1)), so that gate . x + b passes the
# clamp (7) for a good share of the channels and up . x + b passes -7 and 7 (check_act_is_seen shows it matters).
BIASED_GAIN = 4.0


def random_store(name: str, *, num_layers: int, num_experts: int, hidden: int, intermediate: int,
                 config_hash: str, seed: int = 0) -> ExpertStore:
    """A ready bf16 store of seeded random experts, scaled like a real layer (std 1/sqrt(H))."""
    store = ExpertStore.create(name, num_layers=num_layers, num_experts=num_experts, hidden=hidden,
                               intermediate=intermediate, dtype=torch.bfloat16, config_hash=config_hash)
    g = torch.Generator().manual_seed(seed)
    for layer in range(num_layers):
        rows = torch.randn(num_experts, store.shape.expert_numel, generator=g) / hidden ** 0.5
        store.write_layer(layer, rows.to(torch.bfloat16))
    store.mark_ready()
    return store


def serve_channel(procs, store: ExpertStore, channel: str, timeout_s: float):
    """Start a worker process on `channel` (the `procs` fixture) and a client connected to it."""
    from ftexpert.proto.cpu_channel import CpuPoolClient

    proc = procs(store_name=store.name, channel_name=channel)
    client = CpuPoolClient(channel)
    client.wait_for_worker(timeout_s=timeout_s)
    return proc, client


# Fixtures shared by the worker-process tests; a test module imports them by name and defines
# T_MAX and MAX_TRIPLES (the channel's size), a `store` fixture, and optionally WORKER_PROC_ARGS
# (flags every worker it starts gets).

@pytest.fixture
def channel(store, request):
    """The name of a fresh worker channel beside `store`, unlinked afterwards."""
    name = f"{store.name}.cpu0-{uuid.uuid4().hex[:6]}"
    seg = create_worker_channel(name, t_max=request.module.T_MAX, hidden=store.shape.hidden,
                                max_triples=request.module.MAX_TRIPLES)
    yield name
    seg.close()
    seg.unlink()


@pytest.fixture
def procs(tmp_path, request):
    """start(**kwargs) -> a started CpuWorkerProc; every one is continued (a test may have stopped
    it) and stopped at teardown."""
    started: list[CpuWorkerProc] = []
    extra = getattr(request.module, "WORKER_PROC_ARGS", None)

    def start(**kwargs) -> CpuWorkerProc:
        if extra is not None:
            kwargs = {"extra_args": extra, **kwargs}
        proc = CpuWorkerProc(log_path=tmp_path / f"worker{len(started)}.log", **kwargs).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.signal(signal.SIGCONT)
        proc.stop(timeout_s=5)


def fill_biases(store: ExpertStore, layer: int, expert: int, g: torch.Generator) -> None:
    """Seeded biases of one expert of a biased store: gate / up 2 N(0, 1), down N(0, 1)."""
    b13, b2 = store.expert_biases(layer, expert)
    b13.copy_(2 * torch.randn(b13.shape, generator=g))
    b2.copy_(torch.randn(b2.shape, generator=g))


def variant_reference(store: ExpertStore, layer: int, hidden, token_idx, expert_id, weight, *,
                      unclamped: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> torch.Tensor:
    """float64 reference of a biased store as a kernel that got the activation wrong would compute it: without the
    clamp of the inputs named in ``unclamped`` ("gate", "up") or without the biases named in ``drop`` ("gate", "up",
    "down"). With neither it is reference_moe_layer's (check_act_is_seen compares the two)."""
    act = store.shape.expert_act
    inter = store.shape.intermediate
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    x = hidden.double()
    for k in range(token_idx.numel()):
        t, e = int(token_idx[k]), int(expert_id[k])
        w13, w2 = (v.double() for v in expert_weights(store, layer, e))
        b13, b2 = (b.double().clone() for b in store.expert_biases(layer, e))
        gate = w13[:inter] @ x[t] + b13[:inter] * ("gate" not in drop)
        up = w13[inter:] @ x[t] + b13[inter:] * ("up" not in drop)
        gate = gate if "gate" in unclamped else gate.clamp(max=act.limit)
        up = up if "up" in unclamped else up.clamp(-act.limit, act.limit)
        h = (up + 1) * gate * torch.sigmoid(act.alpha * gate)
        out[t] += float(weight[k]) * (w2 @ h + b2 * ("down" not in drop))
    return out


def check_act_is_seen(store: ExpertStore, layer: int, batch, tol: float) -> None:
    """The batch's reference moves beyond 4 ``tol`` (of its scale) without either clamp or any one bias, and the
    variant with nothing left out is the reference: a kernel that dropped one fails its lockstep test."""
    ref = reference_moe_layer(store, layer, *batch, dtype=torch.float64)
    scale = float(ref.abs().max())
    assert float((variant_reference(store, layer, *batch) - ref).abs().max()) <= 1e-6 * scale     # ref: fp32
    for what, kwargs in (*((f"the {v} clamp", {"unclamped": (v,)}) for v in ("gate", "up")),
                         *((f"the {b} bias", {"drop": (b,)}) for b in ("gate", "up", "down"))):
        err = float((variant_reference(store, layer, *batch, **kwargs) - ref).abs().max()) / scale
        assert err > 4 * tol, f"{store.shape.fmt}: leaving out {what} moves the output by {err:.1e} only"
