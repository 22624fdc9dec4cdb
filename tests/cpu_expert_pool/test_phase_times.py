"""The CPU kernel's phase stamps (native/phase_times.h, a -DFT_PHASE_TIMES build only) and bench_cpu_phases.py's
reading of them: the stamps of a real call are ordered phase by phase inside the call, the worker's library has
none, and the columns come out of a hand-made set of stamps as computed by hand."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ftexpert.cpu_expert_pool.native.build import NativeUnavailable
from ftexpert.cpu_expert_pool.native.quant_desc import quant_format_desc
from tests.bench.test_bench_cpu_paths import _bench
from tests.cpu_expert_pool.test_cpu_pool_quant import NATIVE, call_raw, make_batch, make_store

needs_native = pytest.mark.skipif(NATIVE is None, reason="no compiled kernel here")


def test_the_columns_of_hand_made_stamps():
    """Two threads; the stamps in ns (marks 0..7 of phase_times.h), the columns in us as the docstring defines them."""
    m = np.array([[2_000, 3_000, 5_000, 20_000, 22_000, 23_000, 26_000, 40_000],
                  [4_000, 4_500, 5_500, 15_000, 21_500, 24_000, 25_000, 45_000]], dtype=np.int64)
    got = _bench("bench_cpu_phases").phases_of(0, 50_000, m)
    want = {"call": 50.0, "enter": 2.0, "p0": 1.0, "p1": 15.0, "p1-": 9.5, "hq": 2.5, "p2": 20.0, "p2-": 14.0,
            # barriers: last leave - last arrival: (5.5 - 4.5) + (22 - 20) + (26 - 24) = 5 us
            "bar": 5.0, "exit": 5.0}
    assert got == pytest.approx(want)


@needs_native
def test_a_calls_stamps_are_ordered_inside_it_and_the_workers_library_has_none():
    assert NATIVE.quant.phase_times() is None
    try:
        lib = _bench("bench_cpu_phases").phase_library()
    except NativeUnavailable as exc:
        pytest.fail(f"the phase build failed: {exc}")
    store = make_store("mxfp4")
    try:
        hidden, tok, exp, w = make_batch(store, 3, 2, torch.bfloat16, seed=1)
        out, _ = call_raw(lib, quant_format_desc(store.shape.quant_layout), 0, store, 1, hidden, tok, exp, w,
                          threads=2)
        ref, _ = call_raw(NATIVE.quant, quant_format_desc(store.shape.quant_layout), 0, store, 1, hidden, tok, exp, w,
                          threads=2)
        assert torch.equal(out, ref)                      # the stamps change nothing the call computes
        call0, call1, m = lib.phase_times()
        assert m.shape == (2, 8)
        assert (np.diff(m, axis=1) >= 0).all() and call0 <= m.min() and m.max() <= call1
    finally:
        store.close()
        store.unlink()
