"""NUMA discovery and worker placement on fixture sysfs trees (1, 2 and 4 nodes) and on this machine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftexpert.cpu_expert_pool.topology import WorkerPlacement, discover_placements, plan_workers, read_core_of_cpu, read_numa_nodes
from ftexpert.proto.cpus import format_cpulist, parse_cpulist

FIXTURES = Path(__file__).parents[1] / "fixtures" / "numa"
ALL_16 = range(16)


@pytest.mark.parametrize("text, cpus", [
    ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
    ("5", (5,)),
    ("", ()),
    ("\n", ()),
    ("0,2-3,7\n", (0, 2, 3, 7)),
    ("0-6:2", (0, 2, 4, 6)),
    ("3,1,2", (1, 2, 3)),
], ids=["ranges", "single", "empty", "newline", "mixed", "stride", "unsorted"])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "0-", "1,,x"])
def test_parse_cpulist_rejects_garbage(bad):
    with pytest.raises(ValueError, match="bad CPU list"):
        parse_cpulist(bad)


def test_format_cpulist_round_trips():
    for cpus in [(0, 1, 2, 3, 8, 9, 10, 11), (5,), (), (0, 2, 4), (1, 2, 3, 7, 8)]:
        assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert format_cpulist([0, 1, 2, 3, 8]) == "0-3,8"


def test_read_nodes_of_each_fixture():
    one = read_numa_nodes(str(FIXTURES / "one_node"))
    assert [(n.node_id, n.cpus) for n in one] == [(0, tuple(range(8)))]
    two = read_numa_nodes(str(FIXTURES / "two_node"))
    assert [(n.node_id, n.cpus) for n in two] == [(0, (0, 1, 2, 3, 8, 9, 10, 11)), (1, (4, 5, 6, 7, 12, 13, 14, 15))]
    four = read_numa_nodes(str(FIXTURES / "four_node"))
    assert [n.node_id for n in four] == [0, 1, 2, 3, 4]
    assert four[4].cpus == ()          # memory-only node


def test_core_siblings_are_read_and_missing_ones_default_to_self():
    core_of = read_core_of_cpu(range(16), str(FIXTURES / "two_node"))
    assert core_of[9] == 1 and core_of[1] == 1 and core_of[15] == 7
    assert read_core_of_cpu([5], str(FIXTURES / "four_node")) == {5: 5}


def test_one_node_default_is_one_worker_one_thread_per_core():
    (p,) = discover_placements(sysfs_root=str(FIXTURES / "one_node"), allowed_cpus=range(8))
    assert p == WorkerPlacement(0, 0, tuple(range(8)), (0, 1, 2, 3))


def test_one_node_split_into_core_groups_keeps_smt_siblings_together():
    placements = discover_placements(num_workers=2, sysfs_root=str(FIXTURES / "one_node"), allowed_cpus=range(8))
    assert [p.cpus for p in placements] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [p.compute_cpus for p in placements] == [(0, 1), (2, 3)]
    assert {p.node_id for p in placements} == {0}


def test_one_node_uneven_split_and_too_many_workers():
    placements = discover_placements(num_workers=3, sysfs_root=str(FIXTURES / "one_node"), allowed_cpus=range(8))
    assert [p.compute_cpus for p in placements] == [(0, 1), (2,), (3,)]
    with pytest.raises(ValueError, match="fewer than the 5 workers"):
        discover_placements(num_workers=5, sysfs_root=str(FIXTURES / "one_node"), allowed_cpus=range(8))


def test_two_nodes_one_worker_each_on_its_own_node():
    placements = discover_placements(sysfs_root=str(FIXTURES / "two_node"), allowed_cpus=ALL_16)
    assert [(p.worker_index, p.node_id) for p in placements] == [(0, 0), (1, 1)]
    assert placements[0].cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert placements[0].compute_cpus == (0, 1, 2, 3)
    assert placements[1].compute_cpus == (4, 5, 6, 7)


def test_two_nodes_intersect_with_affinity_and_reserved():
    # affinity excludes 4-5 and their siblings 12-13 (taskset); CPU 0 and its sibling 8 reserved for the GPU worker.
    allowed = [c for c in ALL_16 if c not in (4, 5, 12, 13)]
    placements = discover_placements(sysfs_root=str(FIXTURES / "two_node"), allowed_cpus=allowed,
                                     reserved_cpus=[0, 8])
    assert placements[0].cpus == (1, 2, 3, 9, 10, 11)
    assert placements[1].cpus == (6, 7, 14, 15)
    assert placements[1].compute_cpus == (6, 7)


def test_affinity_confined_to_one_node_gives_one_worker():
    placements = discover_placements(sysfs_root=str(FIXTURES / "two_node"), allowed_cpus=[4, 5, 6, 7])
    assert [(p.node_id, p.cpus) for p in placements] == [(1, (4, 5, 6, 7))]


def test_workers_never_span_nodes():
    with pytest.raises(ValueError, match="multiple of the 2 usable"):
        discover_placements(num_workers=3, sysfs_root=str(FIXTURES / "two_node"), allowed_cpus=ALL_16)
    placements = discover_placements(num_workers=4, sysfs_root=str(FIXTURES / "two_node"), allowed_cpus=ALL_16)
    assert [p.node_id for p in placements] == [0, 0, 1, 1]
    assert [p.compute_cpus for p in placements] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_four_nodes_skip_the_memory_only_node():
    placements = discover_placements(sysfs_root=str(FIXTURES / "four_node"), allowed_cpus=ALL_16)
    assert [p.node_id for p in placements] == [0, 1, 2, 3]
    assert [p.cpus for p in placements] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert all(p.cpus == p.compute_cpus for p in placements)     # no SMT info: every CPU a core
    assert sorted(c for p in placements for c in p.cpus) == list(ALL_16)


def test_no_cpu_left_is_a_clear_error():
    with pytest.raises(ValueError, match="reserve fewer CPUs"):
        plan_workers(read_numa_nodes(str(FIXTURES / "four_node")), [0, 1], reserved_cpus=[0, 1])


def test_missing_node_tree_means_one_node_of_allowed_cpus(tmp_path):
    (p,) = discover_placements(sysfs_root=str(tmp_path))
    assert p.node_id == 0 and set(p.cpus) == os.sched_getaffinity(0)


def test_bind_current_process_on_this_machine():
    # In a child so this test process keeps its affinity.
    code = (
        "import os, sys\n"
        "from ftexpert.cpu_expert_pool.topology import discover_placements, bind_current_process\n"
        "p = discover_placements()[0]\n"
        "p = type(p)(0, p.node_id, p.cpus[:1], p.compute_cpus[:1])\n"
        "r = bind_current_process(p)\n"
        "assert sorted(os.sched_getaffinity(0)) == list(p.cpus), (os.sched_getaffinity(0), p.cpus)\n"
        "print(r.mempolicy_bound, r.note)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    assert "affinity" in out.stdout


def test_store_pages_are_bound_to_the_owner_node(tmp_path):
    import uuid

    import torch

    from ftexpert.proto.expert_owners import ExpertSplit
    from ftexpert.cpu_expert_pool.topology import place_store_on_nodes
    from ftexpert.proto.expert_store import ExpertStore

    placements = discover_placements()
    name = f"ft-test-numa-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    store = ExpertStore.create(name, num_layers=2, num_experts=3, hidden=64, intermediate=32, dtype=torch.bfloat16,
                               config_hash="n")
    try:
        split = ExpertSplit.contiguous(2, 3, len(placements))
        bound = place_store_on_nodes(store, split.owner, placements)
        if bound == 0:
            pytest.skip("mbind is not permitted here")
        assert bound == 6
        store.layer_view(0).fill_(1.0)
        with open("/proc/self/numa_maps") as f:
            policy_at = {int(line.split()[0], 16): line.split()[1] for line in f if name in line}
        # The data region (from data_ptr) is bound; the header before it keeps the default policy.
        assert policy_at.get(store.data_ptr) == f"bind:{placements[0].node_id}", policy_at
        assert set(policy_at.values()) <= {"default", f"bind:{placements[0].node_id}"}
    finally:
        store.close()
        store.unlink()


def _small_store(tag: str):
    import uuid

    import torch

    from ftexpert.proto.expert_store import ExpertStore
    return ExpertStore.create(f"ft-test-place-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_layers=2,
                              num_experts=4, hidden=64, intermediate=32, dtype=torch.bfloat16, config_hash="p")


def test_store_pages_go_to_the_node_of_their_worker_on_two_nodes(monkeypatch):
    """The store's creator binds expert e's pages to the node of the worker owning it (contiguous ranges:
    experts 0-1 with worker 0 on node 0, experts 2-3 with worker 1 on node 1), every layer."""
    from ftexpert.cpu_expert_pool import topology
    calls = []
    monkeypatch.setattr(topology, "mbind_range", lambda address, nbytes, node, move=True: (calls.append(
        (address, nbytes, node)), (True, ""))[1])
    store = _small_store("two")
    try:
        bound = topology.place_store_for_workers(store, num_workers=None, sysfs_root=str(FIXTURES / "two_node"),
                                                 allowed_cpus=ALL_16)
        assert bound == 8
        want = [(store.data_ptr + store.expert_offset(layer, e), store.expert_stride, 0 if e < 2 else 1)
                for layer in range(2) for e in range(4)]
        assert calls == want
    finally:
        store.close()
        store.unlink()


def test_store_pages_are_left_alone_on_one_node_and_when_workers_do_not_fit(monkeypatch):
    from ftexpert.cpu_expert_pool import topology
    monkeypatch.setattr(topology, "mbind_range", lambda *a, **k: pytest.fail("mbind on one node"))
    store = _small_store("one")
    try:
        assert topology.place_store_for_workers(store, num_workers=2, sysfs_root=str(FIXTURES / "one_node"),
                                                allowed_cpus=range(8)) == 0
        # 3 workers on 2 nodes do not fit (the workers say so themselves): no placement, no error here
        assert topology.place_store_for_workers(store, num_workers=3, sysfs_root=str(FIXTURES / "two_node"),
                                                allowed_cpus=ALL_16) == 0
    finally:
        store.close()
        store.unlink()


def test_the_store_creator_places_pages_before_filling():
    """HostExperts.create_filled runs before_fill on the empty store (pages land where first written)."""
    from ftexpert.gpu_worker.assembly.loader import load_model
    from ftexpert.gpu_worker.backends.offload import HostExperts
    source = load_model(device="cpu").source.experts
    seen = []

    def before_fill(store):
        seen.append((store.is_ready, float(store.layer_view(0).float().abs().sum())))
    host = HostExperts.create_filled(source, before_fill=before_fill, pin=False)
    try:
        assert seen == [(False, 0.0)]
        assert host.store.is_ready and float(host.layers[0].float().abs().sum()) > 0
    finally:
        host.close()
