"""What the lookahead prefetch puts on the compute stream a layer call: its kernels (`prefetch_score`,
`prefetch_ensure`) and next to nothing else. Each torch op the bookkeeping runs there is a kernel launch on a GPU,
2-3 us each even inside a CUDA graph: about 35 of them a layer once cost `auto` 5.5 ms a decode step on the H200
(docs/PREFETCH.md, Measured). Counted on the CPU with a torch dispatch mode around the per-layer hooks (`begin`,
`install`); the slot-cache kernels and the predictor (its own stream on a GPU) are counted apart."""
from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import ftexpert.gpu_worker.backends.offload.prefetch as prefetch_module
from ftexpert.gpu_worker.backends.offload.prefetch import PrefetchSettings
from tests.gpu_worker.prefetch_util import decode_run, offload_model, open_windows

# ops that make a view or read metadata: no kernel on a GPU
VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "reshape", "_reshape_alias", "alias", "as_strided", "unsqueeze",
            "squeeze", "expand", "t", "transpose", "permute", "detach", "lift_fresh", "sym_size", "sym_stride",
            "sym_numel", "sym_storage_offset", "is_same_size"}
MAX_OPS_A_LAYER_CALL = 1      # now 0; the code before the scoring kernel ran 31.5 (auto) and 15 (on)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _count_hooks(monkeypatch, lookahead) -> dict:
    """Wrap the lookahead's per-layer hooks in an OpCounter; its kernels and the predictor run uncounted (each
    noted as one launch)."""
    seen = {"calls": 0, "ops": [], "kernels": 0}

    def apart(fn):
        def run(*args, **kwargs):
            seen["kernels"] += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return run

    for name in ("prefetch_score", "prefetch_ensure"):
        monkeypatch.setattr(prefetch_module, name, apart(getattr(prefetch_module, name)))
    monkeypatch.setattr(lookahead.predictor, "predict", apart(lookahead.predictor.predict))
    for hook in ("begin", "install"):
        inner = getattr(lookahead, hook)

        def counted(*args, _inner=inner, _hook=hook, **kwargs):
            counter = OpCounter()
            with counter:
                out = _inner(*args, **kwargs)
            seen["ops"] += counter.ops
            seen["calls"] += _hook == "begin"
            return out
        monkeypatch.setattr(lookahead, hook, counted)
    return seen


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_the_prefetch_adds_next_to_no_ops_a_layer_call_beside_its_kernels(monkeypatch, tmp_path, mode):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))
    model = offload_model(False, PrefetchSettings(mode=mode, budget=2))
    try:
        if mode == "auto":
            open_windows(model.experts)
        seen = _count_hooks(monkeypatch, model.experts.slot_pool.lookahead)
        decode_run(model, batch=1, decode_steps=12)
        counters = model.experts.counters()
    finally:
        model.close()
    assert counters["prefetch_installed_total"] > 0 and seen["kernels"] > 0, "nothing was prefetched: proves nothing"
    per_call = len(seen["ops"]) / seen["calls"]
    assert per_call <= MAX_OPS_A_LAYER_CALL, (
        f"{mode}: {per_call:.1f} torch ops a layer call on the compute stream beside the prefetch's kernels "
        f"(at most {MAX_OPS_A_LAYER_CALL}): {sorted(set(seen['ops']))}")
