"""The GPU kernels of a profiled stretch of work, as one table (torch.profiler): the benches' `--profile` output."""
from __future__ import annotations


def gpu_kernel_table(prof, per: int, unit: str, top: int = 25) -> list[str]:
    """The `top` kernels of a finished `torch.profiler.profile` by total GPU time, each divided by `per` (the steps,
    turns... it covered, named by `unit`): lines to print, or one line saying no GPU kernel was recorded."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or
              getattr(e, "self_device_time_total", 0) > 0]
    if not events:
        return ["profile: no GPU kernels recorded"]
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    lines = [f"\nprofile: {per} {unit}(s), GPU time {total / 1e3 / per:.3f} ms a {unit}, top {top} kernels:",
             f"{'us/' + unit:>9} {'calls/' + unit:>10} {'%':>5}  name"]
    for e in events[:top]:
        t = getattr(e, key)
        lines.append(f"{t / per:>9.1f} {e.count / per:>10.1f} {100 * t / total:>5.1f}  {e.key[:90]}")
    return lines
