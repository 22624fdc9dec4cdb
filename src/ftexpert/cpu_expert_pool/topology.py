"""Where CPU workers run: NUMA nodes, physical cores, the process's allowed CPUs, and binding.

One worker per NUMA node (its threads on that node's cores, its memory policy on that node), or, on a
single-node machine, one worker per core group (the count is a setting). The CPU set is always
intersected with the affinity the process already has (systemd CPUAffinity=, cgroups, taskset), or
with the allowed CPUs its parent passes (``ft worker cpu --allowed-cpus``), and with ``reserved_cpus``
left for the GPU worker and the coordinator: every process gets its own cores. The process that drives
the GPU pins itself to the reserved CPUs (``set_process_affinity``, every thread; HybridOptions).

Sysfs is read under a root parameter so tests use fixture trees (tests/fixtures/numa/*):
``<sysfs_root>/node/node<N>/cpulist`` and ``<sysfs_root>/cpu/cpu<N>/topology/thread_siblings_list``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import os
import platform
import re
from typing import TYPE_CHECKING, Iterable

from ftexpert.proto.cpus import format_cpulist, parse_cpulist, set_process_affinity
from ftexpert.proto.expert_owners import ExpertSplit

if TYPE_CHECKING:
    import numpy as np

    from ftexpert.proto.expert_store import ExpertStore

log = logging.getLogger(__name__)

SYSFS_ROOT = "/sys/devices/system"
MPOL_PREFERRED = 1
MPOL_BIND = 2
MEMPOLICY_MODES = {"preferred": MPOL_PREFERRED, "bind": MPOL_BIND}
# set_mempolicy / mbind syscall numbers where libnuma is absent.
_SYSCALLS = {"x86_64": {"set_mempolicy": 238, "mbind": 237},
             "aarch64": {"set_mempolicy": 237, "mbind": 235}}
_NODE_DIR_RE = re.compile(r"^node(\d+)$")


@dataclasses.dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: tuple[int, ...]      # every CPU sysfs lists for the node (may be empty: memory-only node)


@dataclasses.dataclass(frozen=True)
class WorkerPlacement:
    worker_index: int
    node_id: int                    # NUMA node of its memory policy
    cpus: tuple[int, ...]           # affinity of the process (all hardware threads of its cores)
    compute_cpus: tuple[int, ...]   # one per physical core: where compute threads are pinned

    @property
    def num_threads(self) -> int:
        return len(self.compute_cpus)

    def describe(self) -> str:
        return (f"worker {self.worker_index}: node {self.node_id}, cpus {format_cpulist(self.cpus)}, "
                f"{self.num_threads} compute threads on {format_cpulist(self.compute_cpus)}")


def read_numa_nodes(sysfs_root: str = SYSFS_ROOT, fallback_cpus: Iterable[int] | None = None) -> list[NumaNode]:
    """NUMA nodes from <sysfs_root>/node; where that tree is absent, one node of `fallback_cpus` (default:
    this process's affinity)."""
    node_root = os.path.join(sysfs_root, "node")
    nodes: list[NumaNode] = []
    try:
        entries = os.listdir(node_root)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        m = _NODE_DIR_RE.match(entry)
        if not m:
            continue
        with open(os.path.join(node_root, entry, "cpulist")) as f:
            nodes.append(NumaNode(int(m.group(1)), parse_cpulist(f.read())))
    if not nodes:
        log.info("no NUMA information under %s; treating the machine as one node", node_root)
        cpus = os.sched_getaffinity(0) if fallback_cpus is None else fallback_cpus
        nodes = [NumaNode(0, tuple(sorted(set(cpus))))]
    return sorted(nodes, key=lambda n: n.node_id)


def read_core_of_cpu(cpus: Iterable[int], sysfs_root: str = SYSFS_ROOT) -> dict[int, int]:
    """cpu -> the lowest CPU id of its physical core (SMT siblings share one); cpu itself if unknown."""
    core_of: dict[int, int] = {}
    for cpu in cpus:
        path = os.path.join(sysfs_root, "cpu", f"cpu{cpu}", "topology", "thread_siblings_list")
        try:
            with open(path) as f:
                siblings = parse_cpulist(f.read())
            core_of[cpu] = min(siblings) if siblings else cpu
        except (FileNotFoundError, ValueError):
            core_of[cpu] = cpu
    return core_of


# -- planning -----------------------------------------------------------------------------------
def _split_evenly(items: list, parts: int) -> list[list]:
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(items[start:start + size])
        start += size
    return out


def plan_workers(nodes: list[NumaNode], allowed_cpus: Iterable[int], *, num_workers: int | None = None,
                 reserved_cpus: Iterable[int] = (), core_of: dict[int, int] | None = None) -> list[WorkerPlacement]:
    """Placements for every worker: never two workers on one core, never one worker on two nodes."""
    reserved_cpus = tuple(reserved_cpus)
    allowed = set(allowed_cpus) - set(reserved_cpus)
    usable = [(n.node_id, sorted(set(n.cpus) & allowed)) for n in nodes]
    usable = [(node_id, cpus) for node_id, cpus in usable if cpus]
    if not usable:
        raise ValueError(f"no CPU left for the CPU expert pool: allowed after reservation "
                         f"{format_cpulist(allowed)}, reserved "
                         f"{format_cpulist(reserved_cpus)}; reserve fewer CPUs or widen the process affinity")
    if num_workers is None:
        num_workers = len(usable)
    if num_workers <= 0 or num_workers % len(usable):
        raise ValueError(f"num_workers={num_workers} must be a positive multiple of the {len(usable)} usable "
                         "NUMA node(s), so that no worker spans two nodes")
    per_node = num_workers // len(usable)
    core_of = core_of or {}
    placements: list[WorkerPlacement] = []
    for node_id, cpus in usable:
        cores: dict[int, list[int]] = {}
        for cpu in cpus:
            cores.setdefault(core_of.get(cpu, cpu), []).append(cpu)
        if per_node > len(cores):
            raise ValueError(f"node {node_id} has {len(cores)} usable physical cores "
                             f"({format_cpulist(cpus)}), fewer than the {per_node} workers asked of it; "
                             "use fewer workers")
        for group in _split_evenly(sorted(cores.values(), key=min), per_node):
            placements.append(WorkerPlacement(
                worker_index=len(placements), node_id=node_id,
                cpus=tuple(sorted(c for core in group for c in core)),
                compute_cpus=tuple(min(core) for core in group)))
    return placements


def discover_placements(*, num_workers: int | None = None, reserved_cpus: Iterable[int] = (),
                        sysfs_root: str = SYSFS_ROOT,
                        allowed_cpus: Iterable[int] | None = None) -> list[WorkerPlacement]:
    """plan_workers on this machine (or a fixture tree), intersected with `allowed_cpus` (default: the
    current affinity; a worker started by a process that pinned itself is given its parent's wider set)."""
    allowed = tuple(os.sched_getaffinity(0)) if allowed_cpus is None else tuple(allowed_cpus)
    nodes = read_numa_nodes(sysfs_root, fallback_cpus=allowed)
    core_of = read_core_of_cpu(sorted({c for n in nodes for c in n.cpus}), sysfs_root)
    return plan_workers(nodes, allowed, num_workers=num_workers, reserved_cpus=reserved_cpus, core_of=core_of)


# -- binding ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BindResult:
    cpus: tuple[int, ...]
    mempolicy_bound: bool
    note: str


def _numa_call(name: str) -> tuple[ctypes._CFuncPtr | None, int | None]:
    """(libnuma function, None) or (libc.syscall, syscall number) or (None, None)."""
    libnuma_path = ctypes.util.find_library("numa")
    if libnuma_path:
        try:
            fn = getattr(ctypes.CDLL(libnuma_path, use_errno=True), name)
            return fn, None
        except (OSError, AttributeError):
            pass
    number = _SYSCALLS.get(platform.machine(), {}).get(name)
    if number is None:
        return None, None
    return ctypes.CDLL(None, use_errno=True).syscall, number


def _nodemask(node_ids: Iterable[int]) -> tuple[ctypes.Array, int]:
    ids = list(node_ids)
    words = max(ids) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    for node in ids:
        mask[node // 64] |= 1 << (node % 64)
    return mask, words * 64 + 1        # maxnode: bits in the mask + 1 (kernel convention)


def set_mempolicy(node_ids: Iterable[int], mode: str = "preferred") -> tuple[bool, str]:
    """Bind this process's future allocations to `node_ids`. Best effort: (ok, why not)."""
    if mode not in MEMPOLICY_MODES:
        raise ValueError(f"memory policy {mode!r} is not known; use one of {', '.join(MEMPOLICY_MODES)}")
    fn, number = _numa_call("set_mempolicy")
    if fn is None:
        return False, f"no libnuma and no known set_mempolicy syscall on {platform.machine()}"
    mask, maxnode = _nodemask(node_ids)
    args = (ctypes.c_int(MEMPOLICY_MODES[mode]), mask, ctypes.c_ulong(maxnode))
    rc = fn(*args) if number is None else fn(ctypes.c_long(number), *args)
    if rc != 0:
        err = ctypes.get_errno()
        return False, (f"set_mempolicy failed: {os.strerror(err)} (containers need CAP_SYS_NICE or a "
                       "seccomp profile that allows it)")
    return True, ""


def mbind_range(address: int, num_bytes: int, node_id: int, *, move: bool = True) -> tuple[bool, str]:
    """Place the pages of [address, address + num_bytes) on `node_id` (page-aligned address). Best effort."""
    fn, number = _numa_call("mbind")
    if fn is None:
        return False, f"no libnuma and no known mbind syscall on {platform.machine()}"
    mpol_mf_move = 1 << 1
    mask, maxnode = _nodemask([node_id])
    args = (ctypes.c_void_p(address), ctypes.c_ulong(num_bytes), ctypes.c_int(MPOL_BIND), mask,
            ctypes.c_ulong(maxnode), ctypes.c_uint(mpol_mf_move if move else 0))
    rc = fn(*args) if number is None else fn(ctypes.c_long(number), *args)
    if rc != 0:
        return False, f"mbind failed: {os.strerror(ctypes.get_errno())}"
    return True, ""


def bind_current_process(placement: WorkerPlacement, *, mempolicy: str = "preferred") -> BindResult:
    """Set CPU affinity (every thread) to the placement's CPUs and, where possible, the memory policy to
    its node. The placement may be wider than the affinity this process inherited (a worker restarted
    by a parent that pinned itself to the reserved CPUs): the new mask replaces the inherited one."""
    set_process_affinity(placement.cpus)
    bound, why = (False, "memory policy not requested") if mempolicy == "none" else \
        set_mempolicy([placement.node_id], mempolicy)
    if bound:
        note = f"affinity {format_cpulist(placement.cpus)}, memory {mempolicy} node {placement.node_id}"
    else:
        note = f"affinity {format_cpulist(placement.cpus)}, memory policy unchanged ({why})"
    log.info("bound: %s", note)
    return BindResult(tuple(sorted(os.sched_getaffinity(0))), bound, note)


def place_store_on_nodes(store: "ExpertStore", owner: "np.ndarray", placements: list[WorkerPlacement]) -> int:
    """Bind each expert's pages to the NUMA node of the worker that owns it (owner: [L, E] worker index).

    Call it in the store's creator before filling the store (pages are placed when first written;
    pages already present are moved). The policy lives with the shared-memory file, so it holds for
    every process. Returns how many experts were bound; 0 with a log line where mbind is unavailable.
    """
    node_of_worker = [p.node_id for p in placements]
    bound = 0
    for layer in range(store.num_layers):
        for expert in range(store.num_experts):
            node = node_of_worker[int(owner[layer, expert])]
            ok, why = mbind_range(store.data_ptr + store.expert_offset(layer, expert), store.expert_stride, node)
            if not ok:
                log.info("expert pages not placed by NUMA node (%s); workers read across nodes", why)
                return bound
            bound += 1
    return bound


def place_store_for_workers(store: "ExpertStore", *, num_workers: int | None, reserved_cpus: Iterable[int] = (),
                            sysfs_root: str = SYSFS_ROOT, allowed_cpus: Iterable[int] | None = None) -> int:
    """The store's creator, before filling it: where the CPU workers land on two or more NUMA nodes,
    bind each expert's pages to the node of the worker that owns it under the default split
    (ExpertSplit.contiguous: contiguous expert ranges, workers placed node by node), so every worker
    reads its experts from its own node. The workers plan their placement with the same inputs
    (discover_placements with the same count, reserved CPUs and allowed CPUs: `--allowed-cpus`, this
    process's affinity, HybridOptions.worker_flags).
    One node: nothing to do (returns 0). Returns how many experts were bound."""
    try:
        placements = discover_placements(num_workers=num_workers, reserved_cpus=reserved_cpus,
                                         sysfs_root=sysfs_root, allowed_cpus=allowed_cpus)
    except (ValueError, OSError) as exc:     # the workers plan the same way and report it themselves
        log.info("expert pages not placed by NUMA node: %s", exc)
        return 0
    nodes = sorted({p.node_id for p in placements})
    if len(nodes) < 2:
        return 0
    split = ExpertSplit.contiguous(store.num_layers, store.num_experts, len(placements))
    bound = place_store_on_nodes(store, split.owner, placements)
    if bound:
        log.info("expert store %r: %d experts' pages bound to the NUMA node of their worker (nodes %s)",
                 store.name, bound, ", ".join(map(str, nodes)))
    return bound
