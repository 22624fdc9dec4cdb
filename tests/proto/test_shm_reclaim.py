"""Start-up reclaims every shared-memory segment of ours whose creator is gone, whatever its name (real
/dev/shm files): a store left by a coordinator killed on one port is freed when the next starts on another."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest

from ftexpert.proto.shm_layout import CHANNEL_MAGIC
from ftexpert.proto.shm_segment import SHM_DIR, ShmSegment, reclaim_stale_segments

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(REPO, "src")
MAGICS = (b"FTEXPST1", CHANNEL_MAGIC)
NBYTES = 1 << 20

CREATE_AND_DIE = """
import os, sys
from ftexpert.proto.shm_segment import ShmSegment
for name, magic in zip(sys.argv[1::2], sys.argv[2::2]):
    ShmSegment.create(name, nbytes={nbytes}, magic=magic.encode(), version=1, meta={{"x": 1}}, kind="test",
                      meta_capacity_bytes=1024)
os._exit(0)                                  # killed: nothing unlinked
""".format(nbytes=NBYTES)


def _left_by_a_dead_process(*named: tuple[str, bytes]) -> None:
    args = [a for name, magic in named for a in (name, magic.decode())]
    subprocess.run([sys.executable, "-c", CREATE_AND_DIE, *args], check=True,
                   env={**os.environ, "PYTHONPATH": SRC})


@pytest.fixture
def names():
    made = [f"ft-test-reclaim-{uuid.uuid4().hex[:10]}-{i}" for i in range(4)]
    yield made
    for name in made:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def test_stale_segments_of_any_name_are_reclaimed_and_live_or_foreign_ones_kept(names, caplog):
    dead_store, dead_channel, live, foreign = names
    _left_by_a_dead_process((dead_store, b"FTEXPST1"), (dead_channel, CHANNEL_MAGIC), (foreign, b"NOTOURS1"))
    mine = ShmSegment.create(live, nbytes=NBYTES, magic=b"FTEXPST1", version=1, meta={}, kind="test",
                             meta_capacity_bytes=1024)
    try:
        with caplog.at_level(logging.WARNING):
            freed = reclaim_stale_segments(MAGICS)
        ours = {f.name: f for f in freed if f.name in names}
        assert set(ours) == {dead_store, dead_channel}
        assert all(f.nbytes == NBYTES for f in ours.values())
        assert not os.path.exists(os.path.join(SHM_DIR, dead_store))
        assert os.path.exists(os.path.join(SHM_DIR, live)) and os.path.exists(os.path.join(SHM_DIR, foreign))
        assert dead_store in caplog.text and f"{NBYTES} bytes" in caplog.text     # says what it freed
    finally:
        mine.close()
        mine.unlink()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_stale_segment_of_another_user_is_left_alone(names):
    name = names[0]
    _left_by_a_dead_process((name, b"FTEXPST1"))
    os.chown(os.path.join(SHM_DIR, name), 65534, 65534)
    assert name not in {f.name for f in reclaim_stale_segments(MAGICS)}
    assert os.path.exists(os.path.join(SHM_DIR, name))


def test_serve_start_reclaims_them(names, monkeypatch):
    """ExpertResources.create (ft serve in both modes, ft generate) runs the reclaim before anything else."""
    from ftexpert.coordinator.expert_resources import ExpertResources

    _left_by_a_dead_process((names[0], b"FTEXPST1"))
    ExpertResources.create(None, "resident", store_name="unused").close()
    assert not os.path.exists(os.path.join(SHM_DIR, names[0]))
