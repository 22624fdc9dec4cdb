"""`EngineStats`: token counts and wall time spent in prefill and decode forwards, and the expert
backend's cumulative counters under the names the coordinator reads (docs/CONTROL_PLANE.md)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


@dataclass
class EngineStats:
    num_steps: int = 0
    num_decode_steps: int = 0          # steps that ran a decode forward
    decode_step_retries: int = 0       # decode forwards run again because the expert backend's failed
    decode_steps_ahead: int = 0        # decode steps queued before the previous one's tokens were read (overlap_decode)
    decode_tokens_discarded: int = 0   # tokens of such steps for requests that had ended meanwhile (a stop token, abort)
    slot_audits: int = 0               # slot-cache audits run (EngineConfig.slot_audit_every)
    slot_audit_failures: int = 0       # audits that found a problem (the cache was emptied after each)
    num_prefill_chunks: int = 0
    prefill_tokens: int = 0            # prompt tokens put through the model
    decode_tokens: int = 0             # tokens decode forwards made and kept (one per running request; with overlap_decode,
                                       # decode_time_s is the host's wall time in decode calls, the queued GPU work beside it)
    generated_tokens: int = 0          # tokens sampled (prefill's last chunk samples one too)
    prefill_time_s: float = 0.0        # forward + sampling, device-synchronised
    decode_time_s: float = 0.0
    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    # the paged KV cache (kv_blocks.py): its blocks now, and the prefix cache's lookups since the start
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0            # held by requests
    kv_blocks_cached: int = 0          # held by none, named by a prefix key: reusable until evicted
    kv_blocks_free: int = 0
    kv_cache_evictions_total: int = 0  # cached blocks taken for new contents
    kv_preemptions_total: int = 0      # requests whose blocks were taken back to let older ones grow (recomputed)
    # the window group's pool (the sliding-window layers' blocks, kv_cache.py; all 0 for a model without one)
    kv_window_blocks_total: int = 0
    kv_window_blocks_used: int = 0
    kv_window_blocks_cached: int = 0
    kv_window_blocks_free: int = 0
    kv_window_evictions_total: int = 0
    prefix_cache_enabled: bool = False
    prefix_cache_queries_total: int = 0        # admissions that looked their prompt up
    prefix_cache_query_tokens_total: int = 0   # tokens those admissions had to prefill
    prefix_cache_hit_tokens_total: int = 0     # of those, tokens found in the cache (their prefill skipped)
    # a model with linear-attention layers (state_checkpoints.py): the states kept at block boundaries for its hits
    state_checkpoints_cached: int = 0          # kept now
    state_checkpoints_saved_total: int = 0     # kept since the start (a leaving request's last boundary)
    state_checkpoint_restores_total: int = 0   # admissions that resumed from one
    # Expert backend counters (offload, cpu and hybrid backends; zero for resident), copied after every step.
    expert_hits_total: int = 0
    expert_misses_total: int = 0
    experts_fetched_total: int = 0
    copy_bytes_total: int = 0
    copy_time_s_total: float = 0.0
    cpu_experts_total: int = 0
    cpu_expert_time_s_total: float = 0.0
    gpu_wait_for_cpu_s_total: float = 0.0
    gpu_wait_for_copy_s_total: float = 0.0
    gpu_wait_for_cpu_unpaired_s_total: float = 0.0     # part of the CPU wait with no copy-side figure (HybridStats)
    cpu_workers: dict[str, Any] = field(default_factory=dict)    # name -> {experts_total, time_s_total, ...}
    # the lookahead prefetch (FREETOKEN_MOE_PREFETCH on / measure; gpu_worker/backends/offload/prefetch.py)
    prefetch_predicted_total: int = 0      # experts chosen for a prefetch (installed when on, counted when measuring)
    prefetch_useful_total: int = 0         # of those, routed by the layer they were chosen for
    prefetch_installed_total: int = 0      # experts installed into low-priority slots (on)
    prefetch_layer_calls_total: int = 0    # layer calls whose prefetch was scored
    prefetch_auto_predicted_total: int = 0  # experts auto's rule chose (auto: installed; measure: would have)
    prefetch_auto_useful_total: int = 0    # of those, routed by the layer they were chosen for
    prefetch_auto_steps_total: int = 0     # auto: decode steps its rule would predict in
    prefetch_auto_predicting_steps_total: int = 0   # of those, the steps its guard let the predictor run

    def absorb_expert_counters(self, counters: Mapping[str, Any]) -> None:
        """Take the backend's cumulative counters (only the names above)."""
        for name in _EXPERT_COUNTERS:
            if name in counters:
                setattr(self, name, counters[name])

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time_s if self.prefill_time_s > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out = asdict(self)
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return out


_EXPERT_COUNTERS = ("expert_hits_total", "expert_misses_total", "experts_fetched_total", "copy_bytes_total",
                    "copy_time_s_total", "cpu_experts_total", "cpu_expert_time_s_total", "gpu_wait_for_cpu_s_total",
                    "gpu_wait_for_copy_s_total", "gpu_wait_for_cpu_unpaired_s_total", "cpu_workers",
                    "prefetch_predicted_total", "prefetch_useful_total", "prefetch_installed_total",
                    "prefetch_layer_calls_total", "prefetch_auto_predicted_total", "prefetch_auto_useful_total",
                    "prefetch_auto_steps_total", "prefetch_auto_predicting_steps_total")
