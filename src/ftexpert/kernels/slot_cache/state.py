"""Expert slot-cache state: device tensors shared by the reference and the Triton kernels.

Legend: L layers, E experts per layer, S slots per pool, P pools (1 global pool, or L per-layer pools).
Slot ids are global: pool p owns slots [p*S, (p+1)*S). Flat expert id of (layer l, expert e) = l*E + e.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROUND_MODES = {"min-wait": 0, "stochastic": 1, "prefer-fetch": 2, "split": 3}   # split: floor (the hybrid
# backend's device path splits the remainder of one expert by channels, kernels/expert_split)
Q16_ONE = 1 << 16
# The victim key packs (usage + 1, pool-local slot) into one int64: slot in the low SLOT_BITS bits.
SLOT_BITS = 25
MAX_SLOTS_PER_POOL = 1 << SLOT_BITS
# Policy tensor layout (int64), read by the kernels when a call uses the cache's device policy.
POLICY_MAX_FETCH, POLICY_FRAC_Q16, POLICY_ROUND, POLICY_PROMOTE, POLICY_SEED = range(5)
POLICY_LEN = 5
# Calls with at most SMALL_ROUTES_MAX routes (decode) take the per-route kernel, whose pool scan is
# split over programs of at least MIN_PART slots each.
SMALL_ROUTES_MAX = 64
MIN_PART = 16
# The decode kernel keeps, per pool, a list of the pool's smallest victim keys (see VICTIM_LIST in
# docs/slot_cache.md): a power of two, or 0 for none.
DEFAULT_VICTIM_LIST = 32
MAX_VICTIM_LIST = 64
# The decode kernel packs (candidate index, slot, owner + 1) into one int64 so that one reduction
# picks a victim and its owner (triton_decode.PACK_*): owners (flat ids layer * E + expert) need
# fewer than OWNER_BITS bits.
OWNER_BITS = 30
KEY_NONE = 0x7FFFFFFFFFFFFFFF
# Error flag bits written by the kernels (host checks them off the hot path).
ERR_EXPERT_ID = 1
# The frequency-weighted eviction key (SlotCache.freq_weight W > 0; 0 = the contract's LRU key): a used slot's key
# is usage + 1 + W * min(routes of its expert so far, FREQ_COUNT_CAP). These bounds keep (key << SLOT_BITS) in an
# int64 while the step counter (one per layer call) stays below 2^38 - 2^34 (~2.6e11 calls).
FREQ_COUNT_CAP = 1 << 24
MAX_FREQ_WEIGHT = 1 << 10


@dataclass
class SlotCache:
    num_layers: int
    num_experts: int
    num_slots: int            # slots per pool
    per_layer: bool
    slot_for_id: torch.Tensor       # [L, E] int32: slot holding (l, e), or -1
    id_of_slot: torch.Tensor        # [P*S] int32: flat id l*E+e held by the slot, or -1
    usage: torch.Tensor             # [P*S] int64: -1 empty, 0 low priority, >=1 step of last use
    step: torch.Tensor              # [1] int64: incremented by every ensure
    expert_recency: torch.Tensor    # [L, E] int64: step at which (l, e) was last routed, or -1
    evict_slots: torch.Tensor       # [S] int32: copy plan, destination slots
    src_indices: torch.Tensor       # [S] int32: copy plan, layer-local expert rows
    num_indices: torch.Tensor       # [1] int32: entries in the copy plan
    num_missing_full: torch.Tensor  # [1] int32: distinct misses of the call, before any cap
    prefetch_evict_slots: torch.Tensor   # [S] int32: prefetch's own copy plan
    prefetch_src_indices: torch.Tensor   # [S] int32
    prefetch_num_indices: torch.Tensor   # [1] int32
    mark: torch.Tensor              # [E] int64 scratch: step at which e was routed in this call
    error: torch.Tensor             # [1] int32: ERR_* bits set by kernels on bad input
    policy: torch.Tensor            # [POLICY_LEN] int64: device copy of the fetch policy
    # derived state, not the contract's: per pool, the smallest victim keys and their slots' owners
    # as of the call that built it (entries go stale when their slot's usage changes); copied with
    # the state, emptied by reset and by prefetch installs
    victim_keys: torch.Tensor = None    # [P, max(V, 1)] int64 ascending, KEY_NONE = no entry
    victim_owner: torch.Tensor = None   # [P, max(V, 1)] int32
    # kernel scratch: per-program victim candidates and arrivals
    part_keys: torch.Tensor = None  # [max programs * (SMALL_ROUTES_MAX + V)] int64
    arrive: torch.Tensor = None     # [1] int32, 0 between calls
    victim_list: int = DEFAULT_VICTIM_LIST   # V
    # frequency-weighted eviction (an extension of the contract; 0 = its LRU key, and expert_count stays 0):
    # a slot used at step u >= 1 whose expert was routed c times has the key u + 1 + freq_weight * min(c, CAP)
    freq_weight: int = 0
    expert_count: torch.Tensor = None   # [L, E] int64: routes of (l, e) seen by ensure (when freq_weight > 0)
    # with freq_weight > 0: every expert_count is halved after an ensure call whose step is a multiple of this
    # (0: never), so that the counts follow a workload whose popular experts change
    freq_half_life: int = 0

    def __post_init__(self):
        device = self.usage.device
        if self.victim_list < 0 or self.victim_list & (self.victim_list - 1) or self.victim_list > MAX_VICTIM_LIST:
            raise ValueError(f"victim_list must be 0 or a power of two up to {MAX_VICTIM_LIST}, "
                             f"got {self.victim_list}")
        if (isinstance(self.freq_weight, bool) or not isinstance(self.freq_weight, int)
                or not 0 <= self.freq_weight <= MAX_FREQ_WEIGHT):
            raise ValueError(f"freq_weight must be an int in [0, {MAX_FREQ_WEIGHT}] (steps of protection per "
                             f"route seen; 0 = LRU), got {self.freq_weight!r}")
        if (isinstance(self.freq_half_life, bool) or not isinstance(self.freq_half_life, int)
                or self.freq_half_life < 0):
            raise ValueError(f"freq_half_life must be an int >= 0 (layer calls between halvings of the route counts; "
                             f"0: never), got {self.freq_half_life!r}")
        if self.expert_count is None:
            self.expert_count = torch.zeros(self.slot_for_id.shape, dtype=torch.int64, device=device)
        pools = self.usage.numel() // self.num_slots
        if self.victim_keys is None:
            width = max(self.victim_list, 1)
            self.victim_keys = torch.full((pools, width), KEY_NONE, dtype=torch.int64, device=device)
            self.victim_owner = torch.full((pools, width), -1, dtype=torch.int32, device=device)
        if self.part_keys is None:
            programs = -(-self.num_slots // MIN_PART)
            cand = 1 << (SMALL_ROUTES_MAX + self.victim_list - 1).bit_length()
            self.part_keys = torch.empty(programs * cand, dtype=torch.int64, device=device)
            self.arrive = torch.zeros(1, dtype=torch.int32, device=device)

    @classmethod
    def create(cls, num_layers: int, num_experts: int, num_slots: int, *,
               device: torch.device | str = "cpu", per_layer: bool = False,
               victim_list: int = DEFAULT_VICTIM_LIST, freq_weight: int = 0,
               freq_half_life: int = 0) -> "SlotCache":
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts),
                            ("num_slots", num_slots)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SlotCache.create: {name} must be a positive int, got {value!r}")
        if num_layers * num_experts >= (1 << OWNER_BITS) - 1:
            raise ValueError(f"SlotCache.create: num_layers * num_experts = {num_layers * num_experts} exceeds "
                             f"the kernel's limit of {(1 << OWNER_BITS) - 2} experts in all")
        if num_slots >= MAX_SLOTS_PER_POOL:
            raise ValueError(f"SlotCache.create: num_slots={num_slots} exceeds the kernel's limit "
                             f"of {MAX_SLOTS_PER_POOL - 1} slots per pool")
        device = torch.device(device)
        total = num_slots * (num_layers if per_layer else 1)

        def full(shape, value, dtype):
            return torch.full(shape, value, dtype=dtype, device=device)

        cache = cls(
            num_layers=num_layers, num_experts=num_experts, num_slots=num_slots,
            per_layer=per_layer,
            slot_for_id=full((num_layers, num_experts), -1, torch.int32),
            id_of_slot=full((total,), -1, torch.int32),
            usage=full((total,), -1, torch.int64),
            step=full((1,), 0, torch.int64),
            expert_recency=full((num_layers, num_experts), -1, torch.int64),
            evict_slots=full((num_slots,), -1, torch.int32),
            src_indices=full((num_slots,), -1, torch.int32),
            num_indices=full((1,), 0, torch.int32),
            num_missing_full=full((1,), 0, torch.int32),
            prefetch_evict_slots=full((num_slots,), -1, torch.int32),
            prefetch_src_indices=full((num_slots,), -1, torch.int32),
            prefetch_num_indices=full((1,), 0, torch.int32),
            mark=full((num_experts,), -1, torch.int64),
            error=full((1,), 0, torch.int32),
            policy=full((POLICY_LEN,), 0, torch.int64),
            victim_list=victim_list,
            freq_weight=freq_weight,
            freq_half_life=freq_half_life,
        )
        return cache

    def __setattr__(self, name, value):
        # freq_weight is fixed at creation: the kernels take it (and whether it is 0, and the decode kernel's victim
        # list length) at launch, so a CUDA graph captured before a change would keep the old key
        if name in ("freq_weight", "freq_half_life") and name in self.__dict__:
            raise AttributeError(f"SlotCache.{name} is fixed at creation (captured CUDA graphs hold it); create "
                                 f"the cache (or the expert backend) again with the value you want")
        super().__setattr__(name, value)

    @property
    def device(self) -> torch.device:
        return self.usage.device

    @property
    def total_slots(self) -> int:
        return self.usage.numel()

    def pool_base(self, layer: int) -> int:
        """First global slot of the pool that serves `layer`."""
        return layer * self.num_slots if self.per_layer else 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state, by name (for tests, audits and save/restore)."""
        return {name: getattr(self, name) for name in STATE_FIELDS}

    def derived_tensors(self) -> dict[str, torch.Tensor]:
        """State the kernels derive and keep beside the contract's (the victim list)."""
        return {name: getattr(self, name) for name in DERIVED_FIELDS}

    def clone(self) -> "SlotCache":
        tensors = {**self.state_tensors(), **self.derived_tensors()}
        return SlotCache(self.num_layers, self.num_experts, self.num_slots, self.per_layer,
                         **{k: v.clone() for k, v in tensors.items()}, victim_list=self.victim_list,
                         freq_weight=self.freq_weight, freq_half_life=self.freq_half_life)

    def copy_from(self, other: "SlotCache") -> None:
        """Overwrite this state with `other`'s, in place (keeps tensor addresses for CUDA graphs)."""
        if other.victim_list != self.victim_list:
            raise ValueError(f"copy_from: victim_list {other.victim_list} != {self.victim_list}")
        if (other.freq_weight, other.freq_half_life) != (self.freq_weight, self.freq_half_life):
            raise ValueError(f"copy_from: freq_weight / freq_half_life {other.freq_weight} / {other.freq_half_life} "
                             f"!= {self.freq_weight} / {self.freq_half_life}")
        for name, tensor in {**self.state_tensors(), **self.derived_tensors()}.items():
            tensor.copy_(getattr(other, name))

    def to(self, device: torch.device | str) -> "SlotCache":
        tensors = {**self.state_tensors(), **self.derived_tensors()}
        return SlotCache(self.num_layers, self.num_experts, self.num_slots, self.per_layer,
                         **{k: v.to(device) for k, v in tensors.items()}, victim_list=self.victim_list,
                         freq_weight=self.freq_weight, freq_half_life=self.freq_half_life)

    def forget_victims(self, pool: int | None = None) -> None:
        """Empty the victim list (of one pool, or all): after any change that lowers a slot's key."""
        rows = self.victim_keys if pool is None else self.victim_keys[pool]
        rows.fill_(KEY_NONE)


STATE_FIELDS = ("slot_for_id", "id_of_slot", "usage", "step", "expert_recency", "evict_slots",
                "src_indices", "num_indices", "num_missing_full", "prefetch_evict_slots",
                "prefetch_src_indices", "prefetch_num_indices", "mark", "error", "policy", "expert_count")
DERIVED_FIELDS = ("victim_keys", "victim_owner")


def reset(cache: SlotCache) -> None:
    """Empty every slot and forget all history, in place."""
    for name in ("slot_for_id", "id_of_slot", "usage", "expert_recency", "evict_slots",
                 "src_indices", "prefetch_evict_slots", "prefetch_src_indices", "mark"):
        getattr(cache, name).fill_(-1)
    for name in ("step", "num_indices", "num_missing_full", "prefetch_num_indices", "error",
                 "arrive", "expert_count"):
        getattr(cache, name).zero_()
    cache.forget_victims()
