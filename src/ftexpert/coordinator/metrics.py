"""Service figures: one snapshot function for gRPC GetStats and /metrics (Prometheus text format 0.0.4).

Series (docs/METRICS.md lists them with their meaning):
  ft_uptime_seconds, ft_draining, ft_engine_healthy                           gauges
  ft_requests_running, ft_requests_waiting                                   gauges (queue depth)
  ft_requests_total, ft_requests_failed_total, ft_requests_aborted_total     counters
  ft_requests_finished_total{reason}                                         counter
  ft_prompt_tokens_total, ft_generation_tokens_total                         counters
  ft_generation_tokens_per_second                                            gauge, last 5 s
  ft_expert_hit_ratio, ft_expert_misses_per_token, ft_pcie_gigabytes_per_second     gauges
  ft_prefetch_precision, ft_prefetch_useful_per_layer, ft_prefetch_covered_share,
  ft_prefetch_auto_predicting_share                                           gauges (the lookahead prefetch)
  ft_experts_fetched_total, ft_experts_cpu_total, ft_cpu_expert_seconds_total       counters
  ft_fetch_fraction, ft_fetch_fraction_target, ft_policy_pcie_gigabytes_per_second,
  ft_policy_cpu_gigabytes_per_second, ft_cpu_worker_share{worker}             gauges
  ft_policy_decisions_total                                                   counter
  ft_http_requests_total{route,code}                                          counter
  ft_time_to_first_token_seconds, ft_request_duration_seconds                 histograms
  ft_tokenizer_requests_in_flight, ft_tokenizer_rejected_total                gauge, counter
  ft_worker_restarts_total{worker,kind}, ft_worker_state{worker,kind,state}  counter, gauge (supervised)
  ft_supervisor_gave_up                                                       gauge
  ft_process_resident_memory_bytes{component,worker}, ft_process_open_fds{component,worker}   gauges (/proc)
  ft_engine_counter_total{name}                                               the engine's *_total stats
  ft_engine_stat{name}                                                        its other numeric stats
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from ftexpert.coordinator.engine_service import EngineService

# Engine stat names (flattened, cumulative) read for the derived expert figures, first found wins.
# The engine's own names come first; the rest are accepted spellings.
STAT_ALIASES: dict[str, tuple[str, ...]] = {
    "hits": ("expert_hits_total", "expert_hits", "hits"),
    "misses": ("expert_misses_total", "expert_misses", "misses"),
    "tokens": ("decode_tokens_total", "tokens_generated_total", "generated_tokens", "tokens"),
    "fetched": ("experts_fetched_total", "experts_fetched", "fetched"),
    "cpu": ("cpu_experts_total", "experts_cpu_total", "experts_cpu"),
    "copy_bytes": ("copy_bytes_total", "bytes_copied_total", "h2d_bytes_total"),
    "copy_time_s": ("copy_time_s_total", "copy_time_s"),
    "cpu_time_s": ("cpu_expert_time_s_total", "cpu_time_s_total", "cpu_time_s"),
}

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WORKER_STATES = ("starting", "handshaking", "ready", "backoff", "failed", "stopped")
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _stat(stats: dict[str, float], key: str) -> float | None:
    for name in STAT_ALIASES[key]:
        if name in stats:
            return stats[name]
    return None


def expert_figures(stats: dict[str, float]) -> dict[str, float]:
    """Hit rate, misses per token, fetched / CPU experts, PCIe GB/s, CPU time from engine stats."""
    hits, misses, tokens = _stat(stats, "hits"), _stat(stats, "misses"), _stat(stats, "tokens")
    copy_bytes, copy_s = _stat(stats, "copy_bytes"), _stat(stats, "copy_time_s")
    routed = (hits or 0.0) + (misses or 0.0)
    return {
        "expert_hit_rate": (hits or 0.0) / routed if routed else 0.0,
        "expert_misses_per_token": (misses or 0.0) / tokens if tokens else 0.0,
        "experts_fetched_total": _stat(stats, "fetched") or 0.0,
        "experts_cpu_total": _stat(stats, "cpu") or 0.0,
        "pcie_gb_s": (copy_bytes / copy_s / 1e9) if copy_bytes and copy_s else 0.0,
        "cpu_expert_time_s_total": _stat(stats, "cpu_time_s") or 0.0,
        **prefetch_figures(stats),
    }


def prefetch_figures(stats: dict[str, float]) -> dict[str, float]:
    """The lookahead prefetch (docs/PREFETCH.md): precision (useful / predicted), useful predictions per scored
    layer call, and the share of would-be demand misses it covered (useful / (useful + demand misses))."""
    predicted = stats.get("prefetch_predicted_total", 0.0)
    useful = stats.get("prefetch_useful_total", 0.0)
    layers = stats.get("prefetch_layer_calls_total", 0.0)
    misses = _stat(stats, "misses") or 0.0
    auto_steps = stats.get("prefetch_auto_steps_total", 0.0)
    return {"prefetch_precision": useful / predicted if predicted else 0.0,
            "prefetch_useful_per_layer": useful / layers if layers else 0.0,
            "prefetch_covered_share": useful / (useful + misses) if useful + misses else 0.0,
            "prefetch_auto_predicting_share": (stats.get("prefetch_auto_predicting_steps_total", 0.0) / auto_steps
                                               if auto_steps else 0.0)}


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.total += value
            self.count += 1


class HttpCounters:
    def __init__(self) -> None:
        self.by_route_code: dict[tuple[str, int], int] = {}
        self.ttft = Histogram()
        self.duration = Histogram()

    def count(self, route: str, code: int) -> None:
        key = (route, code)
        self.by_route_code[key] = self.by_route_code.get(key, 0) + 1


def service_stats(service: "EngineService") -> dict[str, Any]:
    """Every figure of the service as plain data (GetStats and /metrics both read this)."""
    stats = dict(service.engine_stats)
    out: dict[str, Any] = {
        "uptime_s": time.monotonic() - service.started_at,
        "draining": service.draining,
        "engine_healthy": service.engine_healthy,
        "requests_running": service.requests_running,
        "requests_waiting": service.requests_waiting,
        "requests_total": service.requests_total,
        "requests_failed_total": service.requests_failed_total,
        "requests_aborted_total": service.requests_aborted_total,
        "requests_finished_by_reason": dict(service.finished_by_reason),
        "prompt_tokens_total": service.prompt_tokens_total,
        "generated_tokens_total": service.generated_tokens_total,
        "generated_tokens_per_s": service.tokens_per_s(),
        "engine": stats,
        "engine_error": service.last_error,
        "policy": service.policy.snapshot() if service.policy is not None else None,
    }
    out.update(expert_figures(stats))
    return out


def process_figures(pid: int) -> tuple[float, float] | None:
    """(resident bytes, open file descriptors) of a process of ours from /proc, or None when it is gone."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            rss_kb = next((int(line.split()[1]) for line in f if line.startswith(b"VmRSS:")), 0)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return None
    return rss_kb * 1024.0, float(fds)


def _components(workers: list[dict[str, Any]]) -> list[tuple[dict[str, str], int]]:
    """(labels, pid) of this process and each worker process (one entry per pid)."""
    out: list[tuple[dict[str, str], int]] = [({"component": "coordinator", "worker": ""}, os.getpid())]
    seen = {os.getpid()}
    for w in workers:
        pid = int(w.get("pid") or 0)
        if pid and pid not in seen:
            seen.add(pid)
            out.append(({"component": str(w.get("kind", "worker")), "worker": str(w["name"])}, pid))
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    return repr(float(v))


def render_prometheus(service: "EngineService", http: HttpCounters | None = None, *,
                      workers: list[dict[str, Any]] | None = None, tokenize: Any = None) -> str:
    s = service_stats(service)
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"{name}{{{label_text}}} {_fmt(value)}" if label_text else f"{name} {_fmt(value)}")

    def one(name: str, kind: str, help_text: str, value: float) -> None:
        metric(name, kind, help_text, [({}, value)])

    one("ft_uptime_seconds", "gauge", "Seconds since the service started.", s["uptime_s"])
    one("ft_draining", "gauge", "1 while the service drains (accepts no new requests).", s["draining"])
    one("ft_engine_healthy", "gauge", "1 while the engine steps without errors.", s["engine_healthy"])
    one("ft_requests_running", "gauge", "Requests admitted to the engine and not finished.", s["requests_running"])
    one("ft_requests_waiting", "gauge", "Queue depth: requests accepted but not yet running.", s["requests_waiting"])
    one("ft_requests_total", "counter", "Generation requests accepted.", s["requests_total"])
    one("ft_requests_failed_total", "counter", "Requests ended by an engine error.", s["requests_failed_total"])
    one("ft_requests_aborted_total", "counter", "Requests aborted (client gone, drained).", s["requests_aborted_total"])
    metric("ft_requests_finished_total", "counter", "Requests finished, by finish reason.",
           [({"reason": r}, n) for r, n in sorted(s["requests_finished_by_reason"].items())])
    one("ft_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", s["prompt_tokens_total"])
    one("ft_generation_tokens_total", "counter", "Tokens generated.", s["generated_tokens_total"])
    one("ft_generation_tokens_per_second", "gauge", "Tokens generated per second over the last 5 s.",
        s["generated_tokens_per_s"])
    one("ft_expert_hit_ratio", "gauge", "Routed experts found in a GPU slot / all routed experts.",
        s["expert_hit_rate"])
    one("ft_expert_misses_per_token", "gauge", "Expert misses per generated token (all layers).",
        s["expert_misses_per_token"])
    one("ft_experts_fetched_total", "counter", "Experts copied host to GPU.", s["experts_fetched_total"])
    one("ft_experts_cpu_total", "counter", "Experts computed by the CPU expert pool.", s["experts_cpu_total"])
    one("ft_pcie_gigabytes_per_second", "gauge", "Host-to-GPU expert copy bandwidth (bytes / copy time).",
        s["pcie_gb_s"])
    one("ft_cpu_expert_seconds_total", "counter", "CPU time spent computing experts.", s["cpu_expert_time_s_total"])
    one("ft_prefetch_precision", "gauge", "Lookahead prefetch: useful predictions / predictions.",
        s["prefetch_precision"])
    one("ft_prefetch_useful_per_layer", "gauge", "Lookahead prefetch: useful predictions per layer call.",
        s["prefetch_useful_per_layer"])
    one("ft_prefetch_covered_share", "gauge", "Lookahead prefetch: useful / (useful + demand misses).",
        s["prefetch_covered_share"])
    one("ft_prefetch_auto_predicting_share", "gauge", "Lookahead prefetch auto: of the decode steps its rule would "
        "predict in, the share its guard let it (the measured step times said it gains).",
        s["prefetch_auto_predicting_share"])
    p = s["policy"]
    if p is not None:
        one("ft_fetch_fraction", "gauge", "Fetch fraction f in force (fetch about f*M of M misses).",
            p["fetch_fraction"])
        one("ft_fetch_fraction_target", "gauge", "B_pcie/(B_pcie+B_cpu) from the tuner's estimates.",
            p["target_fraction"])
        one("ft_policy_pcie_gigabytes_per_second", "gauge", "Tuner's estimate of PCIe expert bandwidth.",
            p["pcie_gb_s"])
        one("ft_policy_cpu_gigabytes_per_second", "gauge", "Tuner's estimate of CPU expert bandwidth.",
            p["cpu_gb_s"])
        one("ft_policy_decisions_total", "counter", "Times the fetch fraction changed.", p["decisions_total"])
        metric("ft_cpu_worker_share", "gauge", "Share of CPU-assigned experts per CPU worker.",
               [({"worker": w["name"]}, w["share"]) for w in p["workers"]])
    if http is not None:
        metric("ft_http_requests_total", "counter", "HTTP requests by route and status code.",
               [({"route": r, "code": str(c)}, n) for (r, c), n in sorted(http.by_route_code.items())])
        for name, help_text, h in (
                ("ft_time_to_first_token_seconds", "Seconds from request to its first token.", http.ttft),
                ("ft_request_duration_seconds", "Seconds from request to its last token.", http.duration)):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} histogram")
            with h._lock:
                cumulative = 0
                for bound, n in zip(h.buckets, h.counts):
                    cumulative += n
                    lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                lines.append(f"{name}_sum {_fmt(h.total)}")
                lines.append(f"{name}_count {h.count}")
    if tokenize is not None:
        one("ft_tokenizer_requests_in_flight", "gauge", "Requests being parsed and tokenized or waiting for it.",
            tokenize.in_flight)
        one("ft_tokenizer_rejected_total", "counter", "Requests refused (503) because the tokenizer was busy.",
            tokenize.rejected_total)
    supervised = [w for w in (workers or []) if w.get("name") != "engine"]   # "engine" is the link's view
    if supervised:
        labels = [{"worker": w["name"], "kind": w.get("kind", "worker")} for w in supervised]
        metric("ft_worker_restarts_total", "counter", "Restarts of a supervised worker process.",
               [(lab, w.get("restarts", 0)) for lab, w in zip(labels, supervised)])
        metric("ft_worker_state", "gauge", "1 for the supervised worker's state (ready, backoff, failed, ...).",
               [({**lab, "state": st}, float(w.get("state") == st)) for lab, w in zip(labels, supervised)
                for st in WORKER_STATES])
    one("ft_supervisor_gave_up", "gauge", "1 once a worker failed too often and is no longer restarted.",
        float(getattr(service, "engine_gave_up", None) is not None or any(w.get("state") == "failed" for w in supervised)))
    linked = [w for w in (workers or []) if w.get("name") == "engine"]     # attach / inline: no supervisor
    figures = [(labels, process_figures(pid)) for labels, pid in _components(supervised + linked)]
    figures = [(labels, f) for labels, f in figures if f is not None]
    metric("ft_process_resident_memory_bytes", "gauge", "Resident memory of each process of the service.",
           [(labels, f[0]) for labels, f in figures])
    metric("ft_process_open_fds", "gauge", "Open file descriptors of each process of the service.",
           [(labels, f[1]) for labels, f in figures])
    engine = sorted(s["engine"].items())
    metric("ft_engine_counter_total", "counter", "The engine's cumulative counters (its *_total stats), by name.",
           [({"name": k}, v) for k, v in engine if k.endswith("_total")])
    metric("ft_engine_stat", "gauge", "The engine's other numeric statistics, by flattened name.",
           [({"name": k}, v) for k, v in engine if not k.endswith("_total")])
    return "\n".join(lines) + "\n"
