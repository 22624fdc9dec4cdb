"""`prefetch_score`: the lookahead prefetch's scoring of one layer call (counters and auto's per-rank counts) in one
launch. Hand-computed cases state the contract; random cases run the Triton kernel (the interpreter on a machine
without a GPU) in lockstep with the reference."""
from __future__ import annotations

import pytest
import torch

from ftexpert.kernels.slot_cache import prefetch_score
from tests.conftest import KERNEL_DEVICE

IMPLS = ("reference", "triton")


def _score(impl, routed, chosen, chosen_len, num=None, *, cand=None, ranks=None, k=0, allow=0, installed=False,
           counts=None, seen=None, hit=None):
    dev = KERNEL_DEVICE if impl == "triton" else torch.device("cpu")
    counts = torch.zeros(6, dtype=torch.int64) if counts is None else counts.clone()
    seen = torch.zeros(k + 1, dtype=torch.int64) if seen is None else seen.clone()
    hit = torch.zeros(k + 1, dtype=torch.int64) if hit is None else hit.clone()
    t = {"counts": counts.to(dev), "seen": seen.to(dev), "hit": hit.to(dev)}
    track = cand is not None
    prefetch_score(torch.tensor(routed, device=dev), torch.tensor(chosen, dtype=torch.int32, device=dev), chosen_len,
                   None if num is None else torch.tensor([num], dtype=torch.int32, device=dev), t["counts"],
                   cand=torch.tensor(cand, device=dev) if track else None,
                   ranks=torch.tensor(ranks, device=dev) if track else None, k=k,
                   allow=torch.tensor([allow], device=dev) if track else None,
                   seen=t["seen"] if track else None, hit=t["hit"] if track else None,
                   count_installed=installed, impl=impl)
    return t["counts"].cpu().tolist(), t["seen"].cpu().tolist(), t["hit"].cpu().tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_choice_is_counted_against_the_routes(impl):
    # plan [5, 9, 2, 7] of which 3 installed: 5 and 2 routed, 9 not; 7 lies past the count
    counts, _, _ = _score(impl, routed=[2, 3, 5, 11], chosen=[5, 9, 2, 7], chosen_len=4, num=3, installed=True)
    assert counts == [3, 2, 3, 1, 0, 0]
    # measure's choice: no count, -1 entries are none, nothing installed
    counts, _, _ = _score(impl, routed=[1, 4], chosen=[4, -1, 1, 6, 0], chosen_len=4)
    assert counts == [3, 2, 0, 1, 0, 0]
    # a count above chosen_len reads only chosen_len entries; an empty choice still scores the call
    counts, _, _ = _score(impl, routed=[1], chosen=[1, 1, 1], chosen_len=2, num=9, installed=True)
    assert counts == [2, 2, 2, 1, 0, 0]
    counts, _, _ = _score(impl, routed=[1], chosen=[1], chosen_len=1, num=0, installed=True)
    assert counts == [0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_the_ranks_are_counted_per_column_and_the_allowed_prefix_apart(impl):
    # candidates 8 (rank 0, routed), 3 (resident: -1, routed), 6 (rank 1, not routed), 8 again (-1), 4 (rank 2,
    # routed); k = 6: lane 5 has no candidate and counts as none in column k; auto allowed 2 (ranks 0 and 1)
    counts, seen, hit = _score(impl, routed=[8, 3, 4, 10], chosen=[8, 6], chosen_len=2, num=2, installed=True,
                               cand=[8, 3, 6, 8, 4], ranks=[0, -1, 1, -1, 2], k=6, allow=2)
    assert seen == [1, 1, 1, 0, 0, 0, 3]
    assert hit == [1, 0, 1, 0, 0, 0, 2]        # column 6: 3 and the second 8 are routed, the empty lane not
    assert counts == [2, 1, 2, 1, 2, 1]
    # allow 0: auto chose nothing; the per-rank counts are kept all the same, and add to what was there
    counts, seen2, hit2 = _score(impl, routed=[6], chosen=[], chosen_len=0, cand=[8, 3, 6, 8, 4],
                                 ranks=[0, -1, 1, -1, 2], k=6, allow=0, counts=torch.tensor(counts),
                                 seen=torch.tensor(seen), hit=torch.tensor(hit))
    assert counts == [2, 1, 2, 2, 2, 1]
    assert seen2 == [2, 2, 2, 0, 0, 0, 6]
    assert hit2 == [1, 1, 1, 0, 0, 0, 2]


def test_bad_arguments_are_refused():
    c = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts must be"):
        prefetch_score(torch.tensor([1]), torch.tensor([1]), 1, None, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="chosen_len"):
        prefetch_score(torch.tensor([1]), torch.tensor([1]), 2, None, c)
    with pytest.raises(ValueError, match="needs ranks"):
        prefetch_score(torch.tensor([1]), torch.tensor([1]), 1, None, c, cand=torch.tensor([1]), k=1)
    with pytest.raises(ValueError, match="k must lie"):
        prefetch_score(torch.tensor([1]), torch.tensor([1]), 1, None, c, cand=torch.tensor([1, 2]),
                       ranks=torch.tensor([0, 1]), k=1, allow=torch.tensor([1]), seen=torch.zeros(2, dtype=torch.int64),
                       hit=torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("seed", range(6))
def test_lockstep_random(seed):
    _lockstep(seed)


@pytest.mark.gpu
def test_lockstep_random_in_the_gpu_suite():
    """The same cases in the GPU suite (which runs the tests marked gpu), with the kernel compiled for the GPU."""
    for seed in range(6):
        _lockstep(seed)


def _lockstep(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    experts = 24
    for call in range(4):
        r = int(torch.randint(1, 90, (1,), generator=g))           # up to batch ~11 at top-8: several route tiles
        routed = torch.randint(0, experts, (r,), generator=g).tolist()
        length = int(torch.randint(0, 20, (1,), generator=g))
        chosen = torch.randint(-1, experts, (max(length, 1) + 3,), generator=g).tolist()
        num = int(torch.randint(0, length + 3, (1,), generator=g)) if call % 2 else None
        k = int(torch.randint(1, 20, (1,), generator=g))
        c = int(torch.randint(1, k + 1, (1,), generator=g))
        cand = torch.randint(-1, experts, (c,), generator=g).tolist()
        ranks = torch.randint(-1, k, (c,), generator=g).tolist()
        allow = int(torch.randint(0, k + 1, (1,), generator=g))
        args = dict(routed=routed, chosen=chosen, chosen_len=length, num=num, installed=bool(call % 3),
                    cand=cand if call != 3 else None, ranks=ranks, k=k, allow=allow)
        assert _score("triton", **args) == _score("reference", **args), f"seed {seed} call {call}: {args}"
