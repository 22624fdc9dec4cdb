"""Benchmark of the slot-cache ensure kernel inside CUDA graphs (microseconds per call, median).

Each replay restores the cache state and the routes, then runs CALLS_PER_REPLAY ensure calls, so
every call sees the same situation: a full pool with top-k routes that are all hits, or all hits
but one miss that is fetched (evicting the least recently used slot). A graph with the restore
alone is timed too and subtracted. Usage: python -m ftexpert.kernels.slot_cache.bench [--sweep]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ftexpert.kernels.slot_cache import SlotCache, ensure, triton_decode
from ftexpert.kernels.slot_cache.api import SINGLE_PROGRAM_SLOTS, SMALL_WARPS, small_launch, small_part
from ftexpert.kernels.slot_cache.state import DEFAULT_VICTIM_LIST

CALLS_PER_REPLAY = 64
TOP_K = 10
# (slots, layers, experts): the expert count exceeds the pool so that the pool can be full
POOLS = [(64, 48, 128), (2048, 48, 128), (18432, 61, 512), (23197, 61, 512)]
# decode-kernel settings swept with --sweep: (slots per program or None = the default, victim-list length)
SWEEP = {
    64: [(None, v) for v in (0, 16, 32)],
    2048: [(None, v) for v in (0, 16, 32, 64)] + [(part, 32) for part in (256, 512)],
    18432: [(part, v) for part in (256, 512, 1024) for v in (0, 32)],
    23197: [(part, v) for part in (256, 512, 1024) for v in (0, 32)],
}


def _fill(cache: SlotCache) -> None:
    """Fill the pool: other layers' experts first (older), layer 0's hot experts last."""
    need = cache.num_slots - TOP_K
    layer = 1
    while need > 0:
        count = min(need, cache.num_experts)
        ensure(cache, layer, torch.arange(count, device="cuda"), fetch_fraction=1.0)
        need -= count
        layer += 1
    ensure(cache, 0, torch.arange(TOP_K, device="cuda"), fetch_fraction=1.0)
    assert int((cache.id_of_slot >= 0).sum()) == cache.num_slots


def _time_graph(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        graph.replay()
    for i in range(reps):
        start[i].record()
        graph.replay()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))  # us


def bench_case(num_slots, layers, experts, miss: bool, tile: int | None, reps: int,
               victim_list: int = DEFAULT_VICTIM_LIST):
    cache = SlotCache.create(layers, experts, num_slots, device="cuda", victim_list=victim_list)
    _fill(cache)
    snapshot = cache.clone()
    base = torch.arange(TOP_K, device="cuda")
    routes = torch.stack([base.clone() for _ in range(CALLS_PER_REPLAY)])   # [C, K]
    if miss:   # replace the last route of call i with a non-resident expert of layer 0
        routes[:, -1] = TOP_K + torch.arange(CALLS_PER_REPLAY, device="cuda")
    pristine = routes.clone()
    kwargs = dict(fetch_fraction=1.0, impl="triton", check_ids=False, slot_tile=tile, path="small")
    ensure(cache, 0, routes[0].clone(), **kwargs)          # compile outside the capture
    cache.copy_from(snapshot)
    stream = torch.cuda.Stream()
    full, restore = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(restore, stream=stream):
            cache.copy_from(snapshot)
            routes.copy_(pristine)
        with torch.cuda.graph(full, stream=stream):
            cache.copy_from(snapshot)
            routes.copy_(pristine)
            for c in range(CALLS_PER_REPLAY):
                ensure(cache, 0, routes[c], **kwargs)
    full.replay()
    torch.cuda.synchronize()
    fetched = int(cache.num_indices)
    assert fetched == (1 if miss else 0), f"expected {int(miss)} fetch per call, saw {fetched}"
    t_full, t_restore = _time_graph(full, reps), _time_graph(restore, reps)
    return (t_full - t_restore) / CALLS_PER_REPLAY


def resource_report(tile: int, victim_list: int, num_slots: int) -> tuple[int, int]:
    """(registers, spills) of the compiled decode kernel."""
    cache = SlotCache.create(61, 512, num_slots, device="cuda", victim_list=victim_list)
    ids = torch.arange(TOP_K, device="cuda")
    common = (ids, ids.numel(), cache.slot_for_id, cache.id_of_slot, cache.usage, cache.step,
              cache.expert_recency, cache.mark, cache.evict_slots, cache.src_indices,
              cache.num_indices, cache.num_missing_full, cache.error, cache.policy)
    policy = (0, 0, cache.num_slots, -1, 1 << 16, 0, 1, 0)   # layer .. seed
    shape = small_launch(TOP_K, cache.num_slots, victim_list, tile)
    programs = shape.pop("programs")
    compiled = triton_decode.ensure_small_kernel[(programs,)](
        *common, cache.part_keys, cache.arrive, cache.victim_keys[0], cache.victim_owner[0],
        cache.expert_count, 0, 0, cache.expert_count.numel(), *policy, NUM_EXPERTS=512, E_BLOCK=512,
        USE_POLICY=False, USE_FREQ=False, num_warps=SMALL_WARPS, **shape)
    return int(getattr(compiled, "n_regs", -1)), int(getattr(compiled, "n_spills", -1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true",
                        help="time every decode-kernel setting in SWEEP, not only the defaults")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--slots", default=None, help="comma-separated pool sizes of POOLS to time (default: all)")
    args = parser.parse_args(argv)
    only = {int(v) for v in args.slots.split(",")} if args.slots else None
    if not torch.cuda.is_available():
        raise RuntimeError("the slot-cache benchmark needs a CUDA GPU")
    rows = []
    for num_slots, layers, experts in POOLS:
        if only is not None and num_slots not in only:
            continue
        for tile, vlist in [(None, None)] + (SWEEP.get(num_slots, []) if args.sweep else []):
            part = small_part(num_slots) if tile is None else tile
            v = DEFAULT_VICTIM_LIST if vlist is None else vlist
            regs, spills = resource_report(part, v, num_slots)
            hit = bench_case(num_slots, layers, experts, False, part, args.reps, v)
            one = bench_case(num_slots, layers, experts, True, part, args.reps, v)
            rows.append((num_slots, part, v, tile is None and vlist is None, regs, spills, hit, one))
    print(f"\nslot-cache ensure (decode kernel), {torch.cuda.get_device_name()}, top-{TOP_K}, "
          f"{CALLS_PER_REPLAY} calls per graph replay, median of {args.reps} replays "
          f"(one program up to {SINGLE_PROGRAM_SLOTS} slots by default)")
    print(f"{'slots':>6} {'part':>5} {'vlist':>5} {'regs':>4} {'spill':>5} {'all hits us':>11} {'1 fetch us':>10}")
    for num_slots, part, pre, is_default, regs, spills, hit, one in rows:
        mark = "  <- default" if is_default else ""
        print(f"{num_slots:>6} {part:>5} {pre:>5} {regs:>4} {spills:>5} {hit:>11.2f} {one:>10.2f}{mark}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
