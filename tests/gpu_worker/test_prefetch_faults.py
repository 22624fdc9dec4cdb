"""Fault injection: the prefetch's detectors fire, and the ordering that keeps it lossless is the one that matters.

On the CPU (CI): FREETOKEN_MOE_PREFETCH_VERIFY catches corrupted slot bytes, a stale slot map, a write while an
expert GEMM reads, and a skipped prefetch copy (whose negative control shows the identity check catches it too);
a slot evicted while its prefetch copy is still in flight stays correct when the copies run in one stream's order
and goes wrong (the negative control) when the prefetch copy lands after the demand copy that evicted it. On the
GPU (marked gpu): a missing stream join under a delay kernel on the copy stream changes the output, the join keeps
it identical; the decode CUDA graphs give prefetch-off's tokens and logits.
"""
from __future__ import annotations

import pytest
import torch

import ftexpert.gpu_worker.backends.offload.decode_copy as decode_copy_module
import ftexpert.gpu_worker.backends.offload.prefetch as prefetch_module
from ftexpert.gpu_worker.backends.offload.prefetch import Lookahead, PrefetchSettings
from ftexpert.gpu_worker.backends.offload.verify import SlotVerifyError

from tests.gpu_worker.prefetch_util import assert_identical, decode_run, offload_model

STEPS = 40


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path / "cache"))


def _occupied(backend) -> list[int]:
    return (backend.cache.id_of_slot >= 0).nonzero().reshape(-1).tolist()


def test_verify_catches_corrupted_slot_bytes():
    # prefetch off: on this small pool a budget-4 prefetch would evict the corrupted slots before any hit
    model = offload_model(False, PrefetchSettings(mode="off", verify="1"))
    try:
        decode_run(model, batch=1, decode_steps=8)                  # warm: every slot holds an expert
        for slot in _occupied(model.experts):
            model.experts.slots[slot].view(torch.int16)[7] += 1     # one 16-bit word of each resident expert
        with pytest.raises(SlotVerifyError, match="bytes differ"):
            decode_run(model, batch=1, decode_steps=8)
    finally:
        model.close()


def test_verify_meta_catches_a_stale_slot_map():
    model = offload_model(False, PrefetchSettings(mode="off", verify="meta"))
    try:
        decode_run(model, batch=1, decode_steps=8)
        c = model.experts.cache
        slots = _occupied(model.experts)
        ids = c.id_of_slot[slots].clone()
        c.id_of_slot[slots] = ids.roll(1)                           # every slot now names another's expert
        with pytest.raises(SlotVerifyError, match="stale slot map"):
            decode_run(model, batch=1, decode_steps=8)
    finally:
        model.close()


def test_verify_catches_a_write_while_the_expert_gemm_reads(monkeypatch):
    model = offload_model(False, PrefetchSettings(mode="on", verify="1"))
    backend = model.experts
    ffn = backend.rows.ffn
    calls = []

    def writing_ffn(mode, x, ids, weights, **kw):
        calls.append(1)
        if len(calls) == 30:                                       # a copy landing in a slot the GEMM reads
            slot = int(ids.reshape(-1).max())
            backend.slots[slot].view(torch.int16)[3] += 1
        return ffn(mode, x, ids, weights, **kw)

    try:
        monkeypatch.setattr(backend.rows, "ffn", writing_ffn)
        with pytest.raises(SlotVerifyError, match="after the expert GEMM"):
            decode_run(model, batch=1, decode_steps=STEPS)
    finally:
        model.close()


def test_a_skipped_prefetch_copy_is_caught_by_verify_and_by_the_identity_check(monkeypatch):
    reference = offload_model(False, None)
    try:
        ref = decode_run(reference, batch=1, decode_steps=STEPS)
    finally:
        reference.close()
    monkeypatch.setattr(Lookahead, "copy", lambda self, layer: None)          # the plan installed, never copied
    model = offload_model(False, PrefetchSettings(mode="on", verify="1"))
    try:
        with pytest.raises(SlotVerifyError, match="before the expert GEMM"):
            decode_run(model, batch=1, decode_steps=STEPS)
    finally:
        model.close()
    model = offload_model(False, PrefetchSettings(mode="on"))                 # negative control: no detector
    try:
        with pytest.raises(AssertionError, match="differ"):
            assert_identical(ref, decode_run(model, batch=1, decode_steps=STEPS), "skipped copy")
    finally:
        model.close()


class InFlight:
    """The prefetch copy made 'in flight': deferred, its plan snapshotted, until the next demand copy runs. `safe`:
    it lands before that demand copy (the one copy stream's order); else after it (an unordered second stream).
    Counts the demand copies that evicted a slot whose prefetch copy was still pending."""

    def __init__(self, monkeypatch, safe: bool):
        self.safe, self.pending, self.evicted_in_flight = safe, [], 0
        real = prefetch_module.copy_plan

        def deferred(slots, host, evict, src, num, max_copies):
            self.pending.append((slots, host, evict.clone(), src.clone(), num.clone(), max_copies))

        def demand(slots, host, evict, src, num, max_copies, cols=None):
            n = int(num)
            for p in self.pending:
                if set(evict[:n].tolist()) & set(p[2][:int(p[4])].tolist()):
                    self.evicted_in_flight += 1
            if self.safe:
                self.flush(real)
            real(slots, host, evict, src, num, max_copies=max_copies, cols=cols)
            if not self.safe:
                self.flush(real)

        monkeypatch.setattr(prefetch_module, "copy_plan", deferred)
        monkeypatch.setattr(decode_copy_module, "copy_plan", demand)

    def flush(self, real) -> None:
        while self.pending:
            slots, host, evict, src, num, max_copies = self.pending.pop(0)
            real(slots, host, evict, src, num, max_copies=max_copies)


@pytest.mark.parametrize("safe", [True, False], ids=["stream-order", "unordered-negative-control"])
def test_evicting_a_slot_whose_prefetch_copy_is_in_flight(monkeypatch, safe):
    """A garbage predictor on a small pool: its wrong guesses (usage 0) are the next layer's first victims, often
    while their copy is still pending. In stream order the output is prefetch-off's; the unsafe order differs."""
    reference = offload_model(False, None)
    try:
        ref = decode_run(reference, batch=1, decode_steps=STEPS)
    finally:
        reference.close()
    inflight = InFlight(monkeypatch, safe)
    model = offload_model(False, PrefetchSettings(mode="on", budget=4), predictor="random")
    try:
        run = decode_run(model, batch=1, decode_steps=STEPS)
    finally:
        model.close()
    assert inflight.evicted_in_flight > 0, "no slot was evicted with its prefetch copy in flight: proves nothing"
    if safe:
        assert_identical(ref, run, "in-flight eviction, stream order")
    else:
        with pytest.raises(AssertionError, match="differ"):
            assert_identical(ref, run, "in-flight eviction, unordered")
