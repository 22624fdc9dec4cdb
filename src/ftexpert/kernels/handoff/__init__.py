"""The GPU -> CPU worker -> GPU hand-off as two kernels, capturable in a CUDA graph.

`ring` (one program): the routes the slot cache left to the CPU (-1) whose expert this worker owns
become (token, expert id, weight) triples written straight into the worker's registered channel,
with the hidden states and the request line; then `request_seq` moves (the protocol of
proto/shm_layout.py, unchanged for the worker). `join` (a few programs): spin on `done_seq` with
system-scope loads, check the response line, and add the partial sums read in place into the GPU's
part. No copy engine, no host thread, no stream memory operation: the sequence number is read from
a device-side copy of the channel's sequence that each ring advances (DeviceDoorbell re-syncs it after
host-driven calls), so replays of a captured graph ring fresh numbers. A call that times out, is
aborted by the host watchdog, or is answered with an error is not added; it raises a device flag
that makes every later ring of the step a no-op, and a host-visible word the engine checks after
the step (which is then re-run with every miss fetched). `gpu_worker/backends/hybrid/device_doorbell.py`
binds these to a CpuPoolClient channel; docs/HYBRID.md has the whole story.
"""
from ftexpert.kernels.handoff.api import COUNT_MAX_PAIRS, count_call, join, ring
from ftexpert.kernels.handoff.triton_kernels import (COUNTERS, FAIL_ABORTED, FAIL_REPLACED, FAIL_STATUS, FAIL_TIMEOUT, ST_ANSWERED, ST_COMPUTE_NS,
                             ST_DEADLINE_NS, ST_EXPERTS, ST_FAILED, ST_RINGS, ST_SEQ, ST_TRIPLES, ST_WAIT_NS,
                             STATE_WORDS)

__all__ = ["ring", "join", "count_call", "COUNT_MAX_PAIRS", "COUNTERS", "STATE_WORDS", "ST_RINGS", "ST_TRIPLES", "ST_ANSWERED", "ST_EXPERTS", "ST_COMPUTE_NS",
           "ST_FAILED", "ST_DEADLINE_NS", "ST_SEQ", "ST_WAIT_NS", "FAIL_TIMEOUT", "FAIL_ABORTED", "FAIL_STATUS",
           "FAIL_REPLACED"]
