"""The device-side hand-off kernels (see kernels/handoff/__init__.py for the protocol).

Mapped host memory (the registered channel and the doorbell's own words) arrives as integer
addresses and is cast to pointers here, as in kernels/expert_copy. On the GPU, the loads that
observe the CPU use `ld.acquire.sys` (or volatile loads whose order does not matter) and the ring
is published behind `fence.acq_rel.sys` by every thread and a block barrier (the
`__threadfence_system(); __syncthreads(); flag = seq` pattern), so
the CPU sees the hidden states, triples and request line before `request_seq` moves. The Triton
interpreter (CI, no GPU) has no inline assembly: there, `ON_GPU=False` selects volatile loads and
an iteration count instead of the global timer; host memory is coherent for it anyway.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Byte offsets inside a slot's request / response lines (proto/shm_layout.py REQUEST_LINE, RESPONSE_LINE).
REQ_SEQ, REQ_LAYER, REQ_TOKENS, REQ_TRIPLES, REQ_SPLIT_LIMIT, REQ_SPLIT_EXPERT = 0, 8, 12, 16, 20, 24
RESP_OFFSET = 64                        # the response line follows the request line (one cache line each)
RESP_SEQ, RESP_STATUS, RESP_EXPERTS, RESP_COMPUTE_NS = 0, 8, 12, 16

# Per-member device state words (int64), see DeviceHandoffState in api.py.
ST_RUNG0 = 0            # seq rung into slot 0 by the last ring (0: nothing rung)
ST_RUNG1 = 1            # ... slot 1
ST_RINGS = 2            # requests rung
ST_TRIPLES = 3          # triples handed off
ST_ANSWERED = 4         # valid answers joined
ST_EXPERTS = 5          # distinct experts the worker reported
ST_COMPUTE_NS = 6       # worker-reported compute time
ST_FAILED = 7           # calls that were not joined (timeout, abort, error status)
ST_DEADLINE_NS = 8      # how long a join waits (DeviceDoorbell writes it: a captured graph follows changes)
ST_SEQ = 9              # the channel's last request seq as the device knows it (DeviceDoorbell syncs it)
ST_WAIT_NS = 10         # join: time spent waiting for the worker's answer, rung calls only (GPU: %globaltimer ns;
                        # interpreter: 1000 per spin)
STATE_WORDS = 11
POLL_EVERY = 16         # join: look at the abort word and done_seq once every this many polls

# Failure codes written into the host-visible failure word of a member (any nonzero code: the call failed).
FAIL_TIMEOUT = 1        # the kernel's own deadline passed
FAIL_ABORTED = 2        # the host watchdog raised the abort word (worker dead or late)
FAIL_STATUS = 3         # the worker answered this request with an error status
FAIL_REPLACED = 4       # done_seq passed the request without its response: a restarted worker claimed the channel

# The same as constexprs for the kernels (Triton reads only constexpr globals).
_REQ_SEQ = tl.constexpr(REQ_SEQ)
_REQ_LAYER = tl.constexpr(REQ_LAYER)
_REQ_TOKENS = tl.constexpr(REQ_TOKENS)
_REQ_TRIPLES = tl.constexpr(REQ_TRIPLES)
_REQ_SPLIT_LIMIT = tl.constexpr(REQ_SPLIT_LIMIT)
_REQ_SPLIT_EXPERT = tl.constexpr(REQ_SPLIT_EXPERT)
_RESP_OFFSET = tl.constexpr(RESP_OFFSET)
_RESP_SEQ = tl.constexpr(RESP_SEQ)
_RESP_STATUS = tl.constexpr(RESP_STATUS)
_RESP_EXPERTS = tl.constexpr(RESP_EXPERTS)
_RESP_COMPUTE_NS = tl.constexpr(RESP_COMPUTE_NS)
_ST_RUNG0 = tl.constexpr(ST_RUNG0)
_ST_RINGS = tl.constexpr(ST_RINGS)
_ST_TRIPLES = tl.constexpr(ST_TRIPLES)
_ST_ANSWERED = tl.constexpr(ST_ANSWERED)
_ST_EXPERTS = tl.constexpr(ST_EXPERTS)
_ST_COMPUTE_NS = tl.constexpr(ST_COMPUTE_NS)
_ST_FAILED = tl.constexpr(ST_FAILED)
_ST_DEADLINE_NS = tl.constexpr(ST_DEADLINE_NS)
_ST_SEQ = tl.constexpr(ST_SEQ)
_ST_WAIT_NS = tl.constexpr(ST_WAIT_NS)
_POLL_EVERY = tl.constexpr(POLL_EVERY)
_FAIL_REPLACED = tl.constexpr(FAIL_REPLACED)
_FAIL_TIMEOUT = tl.constexpr(FAIL_TIMEOUT)
_FAIL_ABORTED = tl.constexpr(FAIL_ABORTED)
_FAIL_STATUS = tl.constexpr(FAIL_STATUS)


@triton.jit
def _ld_sys(addr, ON_GPU: tl.constexpr, BITS: tl.constexpr = 64):
    """Load of a 64- or 32-bit word of mapped host memory that observes the CPU's latest store."""
    if BITS == 64:
        p = addr.to(tl.pointer_type(tl.int64))
        asm: tl.constexpr = "ld.acquire.sys.global.b64 $0, [$1];"
        constraints: tl.constexpr = "=l,l"
    else:
        p = addr.to(tl.pointer_type(tl.int32))
        asm: tl.constexpr = "ld.acquire.sys.global.b32 $0, [$1];"
        constraints: tl.constexpr = "=r,l"
    if ON_GPU:
        v = tl.inline_asm_elementwise(asm, constraints, [p], dtype=p.dtype.element_ty, is_pure=False, pack=1)
    else:
        v = tl.load(p, volatile=True)
    return v


@triton.jit
def _fence_sys(ON_GPU: tl.constexpr):
    """Every thread's earlier stores are visible system-wide before any later store of the block: each
    thread fences its own, the barrier orders them before the others' later work, and a second fence
    after the barrier makes the storing thread's release cover what the barrier ordered before it."""
    if ON_GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.debug_barrier()
    if ON_GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _now_ns(iteration, ON_GPU: tl.constexpr):
    """The GPU's global timer; the interpreter counts spins as microseconds instead."""
    if ON_GPU:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = iteration * 1000
    return t


@triton.jit
def ring_kernel(
    x_ptr, stride_x, T, H,              # [T, H] the MoE input (model dtype); rows stride_x apart
    ids_ptr, routes_ptr, w_ptr, R, K,   # [R = T*K] router expert ids, routes after ensure (-1: CPU), weights
    owner_ptr, owner_off, member,       # owner_ptr[owner_off + expert] = pool member; USE_OWNER=False: all
    hidden_addr, token_addr, expert_addr, weight_addr,   # the slot's mapped buffers
    line_addr, request_seq_addr,        # the slot's request line, the channel's request_seq
    fail_ptr,                           # [1] int32 device: a hand-off of this step failed -> ring nothing
    state_ptr,                          # [STATE_WORDS] int64 device: this member's state
    slot, layer,
    split_ptr, split_slot,              # HAS_SPLIT: [2] int32 (split expert or -1, limit c), the split slot
    HIDDEN_BF16: tl.constexpr, ALWAYS_RING: tl.constexpr, USE_OWNER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ON_GPU: tl.constexpr, HAS_SPLIT: tl.constexpr,
):
    """One program: compact this member's CPU routes into triples in the channel, write the hidden
    states and the request line, then ring request_seq. Rings nothing (rung seq 0) when the member
    has no triple or a hand-off of this step already failed. With HAS_SPLIT the routes at split_slot
    (kernels/expert_split) are the CPU's too, and the line carries the split (limit, expert); without,
    a limit of 0 (no split): every request line says whether it splits."""
    failed = tl.load(fail_ptr)
    seq = tl.load(state_ptr + _ST_RINGS) * 0          # int64 zero: nothing rung
    # The sequence lives on the device (ST_SEQ): reading the channel's request_seq would cost a PCIe round
    # trip (~4 us on the H200 machine). DeviceDoorbell re-syncs it after host-driven calls and faults.
    last = tl.load(state_ptr + _ST_SEQ)
    if failed == 0:
        token_p = token_addr.to(tl.pointer_type(tl.int32))
        expert_p = expert_addr.to(tl.pointer_type(tl.int32))
        weight_p = weight_addr.to(tl.pointer_type(tl.float32))
        n = tl.sum(tl.zeros([BLOCK_R], dtype=tl.int32), axis=0)
        for r0 in range(0, R, BLOCK_R):
            offs = r0 + tl.arange(0, BLOCK_R)
            inr = offs < R
            eid = tl.load(ids_ptr + offs, mask=inr, other=-1).to(tl.int32)
            route = tl.load(routes_ptr + offs, mask=inr, other=0)
            if HAS_SPLIT:
                m = inr & (eid >= 0) & ((route < 0) | (route == split_slot))
            else:
                m = inr & (eid >= 0) & (route < 0)
            if USE_OWNER:
                own = tl.load(owner_ptr + owner_off + eid, mask=m, other=-1)
                m = m & (own == member)
            mi = m.to(tl.int32)
            pos = n + tl.cumsum(mi, axis=0) - 1
            tl.store(token_p + pos, (offs // K).to(tl.int32), mask=m)
            tl.store(expert_p + pos, eid, mask=m)
            tl.store(weight_p + pos, tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32), mask=m)
            n += tl.sum(mi, axis=0)
        if (n > 0) | ALWAYS_RING:
            if HIDDEN_BF16:
                hid_p = tl.multiple_of(hidden_addr.to(tl.pointer_type(tl.bfloat16)), 16)    # page-aligned
            else:
                hid_p = tl.multiple_of(hidden_addr.to(tl.pointer_type(tl.float32)), 16)
            for t in range(0, T):
                for h0 in range(0, H, BLOCK_H):
                    ho = h0 + tl.arange(0, BLOCK_H)
                    hm = ho < H
                    v = tl.load(x_ptr + t * stride_x + ho, mask=hm)
                    tl.store(hid_p + t * H + ho, v.to(hid_p.dtype.element_ty), mask=hm)
            seq = last + 1
            line32 = line_addr.to(tl.pointer_type(tl.int32))
            tl.store(line32 + _REQ_LAYER // 4, layer)
            tl.store(line32 + _REQ_TOKENS // 4, T)
            tl.store(line32 + _REQ_TRIPLES // 4, n)
            if HAS_SPLIT:
                tl.store(line32 + _REQ_SPLIT_LIMIT // 4, tl.load(split_ptr + 1))
                tl.store(line32 + _REQ_SPLIT_EXPERT // 4, tl.load(split_ptr))
            else:
                tl.store(line32 + _REQ_SPLIT_LIMIT // 4, 0)
                tl.store(line32 + _REQ_SPLIT_EXPERT // 4, -1)
            tl.store(line_addr.to(tl.pointer_type(tl.int64)), seq)
            _fence_sys(ON_GPU)                       # data and line before the doorbell
            tl.store(request_seq_addr.to(tl.pointer_type(tl.int64)), seq)
            tl.store(state_ptr + _ST_SEQ, seq)
            tl.store(state_ptr + _ST_RINGS, tl.load(state_ptr + _ST_RINGS) + 1)
            tl.store(state_ptr + _ST_TRIPLES, tl.load(state_ptr + _ST_TRIPLES) + n)
    tl.store(state_ptr + _ST_RUNG0 + slot, seq)


@triton.jit
def join_kernel(
    src_ptr, dst_ptr, numel,            # [T*H]: dst = src + partial (src's dtype -> dst's), or dst = src
    out_addr,                           # the slot's mapped fp32 partial sums [T, H]
    line_addr, done_seq_addr,           # the slot's request line (response line after it), done_seq
    abort_addr,                         # mapped int64 word the host watchdog raises (worker dead or late)
    fail_ptr, host_fail_addr,           # [1] int32 device flag; mapped int64 word: a failure code
    state_ptr, slot,
    SAME: tl.constexpr,                 # src and dst are one tensor: nothing to copy when nothing was rung
    BLOCK: tl.constexpr, ON_GPU: tl.constexpr,
):
    """Grid (cdiv(numel, BLOCK),). Each program waits for done_seq >= the rung seq (or the abort word,
    or the deadline in the state), checks the response line, and adds its block of the partial sums.
    Program 0 adds how long its wait took (from before the first poll to after the last, answered or
    not) to the state's ST_WAIT_NS: the joins of one stream run one after the other, so the sum is the
    GPU's time waiting for the CPU.

    Every thread loads and decides for itself (a scalar here is per thread: two warps, or two programs,
    can see the answer arrive on either side of the deadline or the abort). So nothing after the wait
    branches on the decision: each element takes `src + partial` or `src` by its own thread's verdict,
    and every thread that judged the call failed raises the device flag and the host word itself. A
    call with any failed part is therefore flagged, and the step is re-run (partial sums applied to
    only some elements never reach a sampled token)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    seq = tl.load(state_ptr + _ST_RUNG0 + slot)
    if seq != 0:                                            # uniform: every thread reads the same word
        deadline_ns = tl.load(state_ptr + _ST_DEADLINE_NS)
        resp = line_addr + _RESP_OFFSET
        # An acquire load holds back every load after it, and each is a PCIe round trip (~4 us on the H200
        # machine): a poll is one acquire load of the response seq; abort word and done_seq every
        # POLL_EVERY polls; after the response, everything else in one round.
        start = _now_ns(0, ON_GPU)
        abort = seq * 0
        done = seq * 0
        rseq = _ld_sys(resp + _RESP_SEQ, ON_GPU)
        spins = 0
        while (rseq != seq) & (abort == 0) & (done < seq) & (_now_ns(spins, ON_GPU) - start < deadline_ns):
            spins += 1
            if spins % _POLL_EVERY == 0:
                abort = tl.load(abort_addr.to(tl.pointer_type(tl.int64)), volatile=True)
                done = tl.load(done_seq_addr.to(tl.pointer_type(tl.int64)), volatile=True)
            rseq = _ld_sys(resp + _RESP_SEQ, ON_GPU)
        waited_ns = _now_ns(spins, ON_GPU) - start          # this call's wait (pid 0's, into ST_WAIT_NS)
        if (rseq != seq) & (done >= seq):
            rseq = _ld_sys(resp + _RESP_SEQ, ON_GPU)     # done_seq moves after the response: look again
        answered = (rseq == seq) | (done >= seq)
        # Behind the acquire that saw the response, in one round: the partial sums, status, counters
        # (.cv: fetched again, never from a cache; vector loads, where volatile would split them into words).
        # Triton 3.6 (the H200 machine) emits these as plain ld.global: still fresh, because they come after
        # the acquire that saw the response (docs/HYBRID.md, "A one-round join, tried").
        out_p = tl.multiple_of(out_addr.to(tl.pointer_type(tl.float32)), 16)     # page-aligned channel buffer
        part = tl.load(out_p + offs, mask=m, other=0.0, cache_modifier=".cv")     # used only where ok
        status = tl.load((resp + _RESP_STATUS).to(tl.pointer_type(tl.int32)), cache_modifier=".cv")
        experts = tl.load((resp + _RESP_EXPERTS).to(tl.pointer_type(tl.int32)), cache_modifier=".cv")
        compute_ns = tl.load((resp + _RESP_COMPUTE_NS).to(tl.pointer_type(tl.int64)), cache_modifier=".cv")
        ok = (rseq == seq) & (status == 0)
        acc = tl.load(src_ptr + offs, mask=m).to(tl.float32)
        tl.store(dst_ptr + offs, tl.where(ok, acc + part, acc).to(dst_ptr.dtype.element_ty), mask=m)
        failed = tl.where(ok, offs < 0, offs >= 0)           # [BLOCK]: this thread's verdict (all true: failed)
        code = tl.where(rseq == seq, _FAIL_STATUS,
                        tl.where(answered, _FAIL_REPLACED, tl.where(abort != 0, _FAIL_ABORTED, _FAIL_TIMEOUT)))
        tl.store(fail_ptr + offs * 0, tl.full([BLOCK], 1, tl.int32), mask=failed)
        tl.store(host_fail_addr.to(tl.pointer_type(tl.int64)) + offs * 0,
                 tl.full([BLOCK], 0, tl.int64) + code, mask=failed)
        if pid == 0:                                         # counters (thread 0's verdict; the wait: any verdict)
            answered_ok = ok.to(tl.int64)
            tl.store(state_ptr + _ST_ANSWERED, tl.load(state_ptr + _ST_ANSWERED) + answered_ok)
            tl.store(state_ptr + _ST_EXPERTS, tl.load(state_ptr + _ST_EXPERTS) + experts.to(tl.int64) * answered_ok)
            tl.store(state_ptr + _ST_COMPUTE_NS, tl.load(state_ptr + _ST_COMPUTE_NS) + compute_ns * answered_ok)
            tl.store(state_ptr + _ST_FAILED, tl.load(state_ptr + _ST_FAILED) + 1 - answered_ok)
            tl.store(state_ptr + _ST_WAIT_NS, tl.load(state_ptr + _ST_WAIT_NS) + waited_ns)
    else:
        if not SAME:
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m).to(dst_ptr.dtype.element_ty), mask=m)


# Device counters of one hybrid forward, in the order of gpu_worker/backends/hybrid/hybrid_experts.py DEVICE_COUNTERS.
COUNTERS = 6


@triton.jit
def count_call_kernel(counts_ptr, ids_ptr, n, num_indices_ptr, num_missing_ptr,
                      OFFLOAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program: add one ensure call's figures to the device counters (int64 [COUNTERS]): experts
    fetched (the plan's length), distinct misses, one call (and one offload call), routed pairs, and
    distinct hits = distinct routed experts - distinct misses, as the host path counts them."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    ids = tl.load(ids_ptr + offs, mask=m, other=-1)
    valid = m & (ids >= 0)
    # an id is distinct where no earlier position holds it (n <= BLOCK is small: a BLOCK x BLOCK compare)
    earlier = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None]) & valid[None, :]
    dup = tl.sum(earlier.to(tl.int32), axis=1)
    distinct = tl.sum((valid & (dup == 0)).to(tl.int64), axis=0)
    fetched = tl.load(num_indices_ptr).to(tl.int64)
    missing = tl.load(num_missing_ptr).to(tl.int64)
    tl.store(counts_ptr + 0, tl.load(counts_ptr + 0) + fetched)
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + missing)
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + 1)
    if OFFLOAD:
        tl.store(counts_ptr + 3, tl.load(counts_ptr + 3) + 1)
    tl.store(counts_ptr + 4, tl.load(counts_ptr + 4) + n)
    tl.store(counts_ptr + 5, tl.load(counts_ptr + 5) + distinct - missing)
