"""`StateCheckpoints` (engine/state_checkpoints.py) alone, over a stand-in state cache: a row's checkpoint is taken
only on a block boundary; a leaving request's checkpoint is kept under the key of the block it closes, only when that
block is named in the prefix cache; the store evicts the least recently used; a hit is shortened to the longest run
of cached blocks that ends at a kept state; a restore writes the kept state into the request's row."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ftexpert.gpu_worker.engine.state_checkpoints import StateCheckpoints

BS = 4


def states(batch: int = 2) -> SimpleNamespace:
    conv = torch.zeros(3, batch, 5, 2)                   # [Llin, B, C, K-1]
    rec = torch.zeros(3, batch, 2, 4, 4)                 # [Llin, B, Hv, Dk, Dv]
    return SimpleNamespace(conv=conv, recurrent=rec, max_batch=batch,
                           nbytes=conv.numel() * 4 + rec.numel() * 4)


def fill(st, slot: int, value: float) -> None:
    st.conv[:, slot] = value
    st.recurrent[:, slot] = value


def test_checkpoints_are_taken_on_block_boundaries_only():
    c = StateCheckpoints(states(), 2, BS)
    with pytest.raises(ValueError, match="block boundary"):
        c.mark([0], [6])
    with pytest.raises(ValueError, match="block boundary"):
        c.mark([0], [0])
    with pytest.raises(ValueError, match="capacity"):
        StateCheckpoints(states(), 0, BS)


KEYS = [b"k0", b"k1", b"k2", b"k3"]


@pytest.mark.parametrize("boundary, registered, kept", [
    (8, 2, True),       # block 1 closes at 8 tokens and is named: kept under k1
    (8, 1, False),      # block 1 not named in the prefix cache (e.g. a step queued ahead past the tokens kept)
    (16, 4, True),
    (None, 4, False),   # no boundary reached
])
def test_a_leaving_request_keeps_its_last_boundary(boundary, registered, kept):
    st = states()
    c = StateCheckpoints(st, 2, BS)
    fill(st, 1, 3.0)
    if boundary is not None:
        c.mark([1], [boundary])
    assert c.keep(1, KEYS, registered) is kept
    assert c.num_cached == int(kept) and c.boundaries(1) == [0, 0]
    if kept:
        assert c.usable_hits(KEYS, 4) == boundary // BS


def test_the_store_evicts_the_least_recently_used_and_hits_end_at_a_kept_state():
    st = states()
    c = StateCheckpoints(st, 2, BS)
    for value, boundary in ((1.0, 4), (2.0, 8), (3.0, 12)):     # three states for a store of two: k0 evicted
        fill(st, 0, value)
        c.mark([0], [boundary])
        assert c.keep(0, KEYS, 4)
    assert c.num_cached == 2 and c.saved_total == 3
    # (the K/V hit's length, the hit kept): the longest run ending at a kept state (k1 and k2 are kept)
    for hits, usable in ((4, 3), (3, 3), (2, 2), (1, 0), (0, 0)):
        assert c.usable_hits(KEYS, hits) == usable
    # a restore into row 1: the state kept after 8 tokens (value 2), which becomes that row's checkpoint; using k1
    # makes k2 the least recently used, so the next state kept evicts k2
    c.restore(1, KEYS, 2)
    assert (st.conv[:, 1] == 2.0).all() and (st.recurrent[:, 1] == 2.0).all() and c.boundaries(1) == [8, 0]
    fill(st, 0, 4.0)
    c.mark([0], [16])
    assert c.keep(0, KEYS, 4)
    assert c.usable_hits(KEYS, 3) == 2 and c.usable_hits(KEYS, 4) == 4 and c.restored_total == 1
    c.restore(0, KEYS, 0)                                            # no hit: a fresh row, no checkpoint
    assert c.boundaries(0) == [0, 0]


def test_a_block_completed_by_a_step_the_request_never_keeps_leaves_the_one_before():
    """A decode step queued ahead completes block 2 (12 tokens) of a request that then stops: that block is not
    named (2 blocks are), so the checkpoint before it, at 8 tokens, is the one kept; a third boundary overwrites the
    oldest of the two rows."""
    st = states()
    c = StateCheckpoints(st, 2, BS)
    fill(st, 0, 1.0)
    c.mark([0], [8])
    fill(st, 0, 2.0)
    c.mark([0], [12])
    assert c.boundaries(0) == [12, 8]
    assert c.keep(0, KEYS, 2) and c.usable_hits(KEYS, 4) == 2
    c.restore(1, KEYS, 2)
    assert (st.conv[:, 1] == 1.0).all()                              # the state after 8 tokens, not 12
    for value, b in ((3.0, 12), (4.0, 16)):
        fill(st, 1, value)
        c.mark([1], [b])
    assert c.boundaries(1) == [16, 12]                               # the restored 8 was the older row
