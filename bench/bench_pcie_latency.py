"""What one GPU <-> host round trip costs on this machine, measured from inside a kernel with the GPU's
global timer: the floor under any GPU-driven hand-off (kernels/handoff, docs/HYBRID.md).

Rows (medians over --reps kernel launches; each launch averages --iters operations):
  read        a chain of dependent `ld.acquire.sys` loads of a registered host word (one PCIe read each)
  write+fence 4 KiB stored to registered host memory by 128 threads, then `fence.acq_rel.sys` (what the
              ring kernel does before it rings)
  ping-pong   the GPU stores i to host word A (fenced) and spins until host word B == i, while a host
              thread spins on A and copies it to B: one hand-off with the worker reduced to a Python
              spin loop (the expert worker adds its own request handling on top)

    python bench/bench_pcie_latency.py [--reps 50] [--iters 200]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ftexpert.kernels.handoff.triton_kernels import _fence_sys, _ld_sys, _now_ns  # noqa: E402


@triton.jit
def probe_kernel(host_addr, out_ptr, iters, MODE: tl.constexpr):
    """MODE 0: dependent reads; 1: 4 KiB write + fence; 2: ping-pong (A at host_addr, B at +64)."""
    a = host_addr.to(tl.pointer_type(tl.int64))
    t0 = _now_ns(0, True)
    if MODE == 0:
        v = t0 * 0
        for _ in range(iters):
            v = _ld_sys(host_addr + (v & 1) * 8, True)        # A holds 0: the same word, but a real dependency
        t1 = _now_ns(0, True) + v * 0
    elif MODE == 1:
        buf = tl.multiple_of(host_addr.to(tl.pointer_type(tl.float32)), 16) + 256   # past A and B's lines
        offs = tl.arange(0, 1024)
        for i in range(iters):
            tl.store(buf + offs, offs.to(tl.float32) + i)
            _fence_sys(True)
        t1 = _now_ns(0, True)
    else:
        for i in range(1, iters + 1):
            tl.store(a, i.to(tl.int64))
            _fence_sys(True)
            b = _ld_sys(host_addr + 64, True)
            while b != i:
                b = _ld_sys(host_addr + 64, True)
        t1 = _now_ns(0, True)
    tl.store(out_ptr, (t1 - t0) // iters)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA (the probes run on the GPU)", file=sys.stderr)
        return 2
    from ftexpert.gpu_worker.backends.hybrid.device_doorbell import PinnedWords
    from ftexpert.kernels.cuda_driver import driver

    torch.cuda.synchronize()
    words = PinnedWords(8192, cuda_driver=driver(), device=torch.device("cuda", 0), what="latency probe")
    a, b = words.word(0), words.word(64)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    stop = threading.Event()

    def echo() -> None:                       # the host side of the ping-pong
        last = 0
        while not stop.is_set():
            v = a.value
            if v != last:
                b.value = v
                last = v

    rows = []
    try:
        for mode, label in ((0, "read (ld.acquire.sys, dependent chain)"), (1, "write 4 KiB + fence.acq_rel.sys"),
                            (2, "ping-pong with a host spin thread")):
            thread = None
            if mode == 2:
                thread = threading.Thread(target=echo, daemon=True)
                thread.start()
            samples = []
            for r in range(args.reps + 3):
                a.value = 0
                b.value = 0
                probe_kernel[(1,)](words.dptr(0), out, args.iters, MODE=mode, num_warps=4)
                done = torch.cuda.Event()
                done.record()
                while not done.query():          # sleep, not a blocking sync: the echo thread needs the GIL
                    time.sleep(0.0002)
                if r >= 3:
                    samples.append(int(out.item()) / 1e3)
            if thread is not None:
                stop.set()
                thread.join()
            rows.append((label, float(np.median(samples)), float(np.percentile(samples, 90))))
    finally:
        stop.set()
        words.close()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.reps} launches x {args.iters} operations")
    print(f"{'operation':<44} {'median us':>9} {'p90 us':>8}")
    for label, med, p90 in rows:
        print(f"{label:<44} {med:>9.2f} {p90:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
