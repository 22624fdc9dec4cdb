"""The device-side hand-off kernels (see kernels/handoff/__init__.py for the protocol).

Mapped host memory (the registered channel and the doorbell's own words) arrives as integer
addresses and is cast to pointers here, as in kernels/expert_copy. On the GPU, the join observes the
CPU with `ld.global.cv` loads (inline PTX, fetched from the host again every poll) of words that prove themselves (the out sentinel and
the tagged answer words of proto/shm_layout.py), so no load waits behind an acquire; the ring is
published behind `fence.acq_rel.sys` by every thread and a block barrier (the
`__threadfence_system(); __syncthreads(); flag = seq` pattern), so the CPU sees the hidden states,
triples, the out sentinel and the request line before `request_seq` moves. The Triton
interpreter (CI, no GPU) has no inline assembly: there, `ON_GPU=False` selects volatile loads and
an iteration count instead of the global timer; host memory is coherent for it anyway.
"""
from __future__ import annotations

import triton
import triton.language as tl

from proto.shm_layout import ANSWER_A_OFFSET, ANSWER_B_OFFSET, OUT_SENTINEL

# Byte offsets inside a slot's request / response lines (proto/shm_layout.py REQUEST_LINE, RESPONSE_LINE).
REQ_SEQ, REQ_LAYER, REQ_TOKENS, REQ_TRIPLES = 0, 8, 12, 16
RESP_OFFSET = 64                        # the response line follows the request line (one cache line each)
RESP_ANSWER_A, RESP_ANSWER_B = ANSWER_A_OFFSET, ANSWER_B_OFFSET     # the tagged answer words

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
_RESP_OFFSET = tl.constexpr(RESP_OFFSET)
_RESP_ANSWER_A = tl.constexpr(RESP_ANSWER_A)
_RESP_ANSWER_B = tl.constexpr(RESP_ANSWER_B)
_OUT_SENTINEL = tl.constexpr(OUT_SENTINEL)
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
    hidden_addr, token_addr, expert_addr, weight_addr, out_addr,   # the slot's mapped buffers
    line_addr, request_seq_addr,        # the slot's request line, the channel's request_seq
    fail_ptr,                           # [1] int32 device: a hand-off of this step failed -> ring nothing
    state_ptr,                          # [STATE_WORDS] int64 device: this member's state
    slot, layer,
    HIDDEN_BF16: tl.constexpr, ALWAYS_RING: tl.constexpr, USE_OWNER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ON_GPU: tl.constexpr,
):
    """One program: compact this member's CPU routes into triples in the channel, write the hidden
    states, the sentinel into out[:T] and the request line, then ring request_seq. Rings nothing (rung seq 0) when the member
    has no triple or a hand-off of this step already failed."""
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
            out_w = tl.multiple_of(out_addr.to(tl.pointer_type(tl.int32)), 16)
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
                    # out's words become the sentinel until the worker writes their sums (the join's poll)
                    tl.store(out_w + t * H + ho, tl.full([BLOCK_H], _OUT_SENTINEL, tl.int32), mask=hm,
                             cache_modifier=".wt")      # written through to the host
            seq = last + 1
            line32 = line_addr.to(tl.pointer_type(tl.int32))
            tl.store(line32 + _REQ_LAYER // 4, layer)
            tl.store(line32 + _REQ_TOKENS // 4, T)
            tl.store(line32 + _REQ_TRIPLES // 4, n)
            tl.store(line_addr.to(tl.pointer_type(tl.int64)), seq)
            _fence_sys(ON_GPU)                       # data and line before the doorbell
            tl.store(request_seq_addr.to(tl.pointer_type(tl.int64)), seq)
            tl.store(state_ptr + _ST_SEQ, seq)
            tl.store(state_ptr + _ST_RINGS, tl.load(state_ptr + _ST_RINGS) + 1)
            tl.store(state_ptr + _ST_TRIPLES, tl.load(state_ptr + _ST_TRIPLES) + n)
    tl.store(state_ptr + _ST_RUNG0 + slot, seq)


@triton.jit
def _now_lanes(lane, iteration, ON_GPU: tl.constexpr):
    """_now_ns for every element of `lane` (each thread reads the timer itself; reduce to agree on it)."""
    if ON_GPU:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [lane], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = lane.to(tl.int64) * 0 + iteration * 1000
    return t


@triton.jit
def _ld_cv(p, ON_GPU: tl.constexpr, BITS: tl.constexpr):
    """Elementwise load of 32- or 64-bit words of mapped host memory, fetched from the host again every
    time: `ld.global.cv` through inline PTX. Not tl.load(cache_modifier=".cv"): triton 3.6 (the H200
    machine's) drops the modifier, and a plain load of a line the GPU itself wrote (the ring's sentinel) is
    served by the L2 long after the worker overwrote it. Not volatile loads: triton 3.6 splits volatile
    vectors into 32-bit loads that each wait for the one before (joins of 14-32 us, docs/HYBRID.md). These
    are independent loads, issued together: a poll is one PCIe round."""
    if ON_GPU:
        if BITS == 64:
            v = tl.inline_asm_elementwise("ld.global.cv.b64 $0, [$1];", "=l,l", [p], dtype=tl.int64,
                                          is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.global.cv.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32,
                                          is_pure=False, pack=1)
    else:
        v = tl.load(p, volatile=True)
    return v


@triton.jit
def _poll_answer(out_w, offs, m, a_p, b_p, lane, tag, pid, ON_GPU: tl.constexpr):
    """One round of loads, all issued together (`_ld_cv`: fetched from the host again): this program's
    block of out and both answer words. -> (out words, answer_a [LANES], answer_b [LANES], ready, errored),
    the last two the same in every thread (block reductions): ready = no word of the block is the sentinel and, in program 0, both
    answer words carry the tag (their counters are its to add); errored = answer_a is tagged and says the
    worker failed (then it writes no out word)."""
    words = tl.where(m, _ld_cv(tl.where(m, out_w + offs, out_w), ON_GPU, 32), 0)   # masked lanes: word 0
    a = _ld_cv(a_p + lane * 0, ON_GPU, 64)
    b = _ld_cv(b_p + lane * 0, ON_GPU, 64)
    missing = tl.sum(((words == _OUT_SENTINEL) & m).to(tl.int32), axis=0)
    a_here = ((a >> 32) & 0xFFFFFFFF) == tag
    both = tl.min((a_here & (((b >> 32) & 0xFFFFFFFF) == tag)).to(tl.int32), axis=0)
    errored = tl.max((a_here & (((a >> 24) & 0xFF) != 0)).to(tl.int32), axis=0) != 0
    ready = (missing == 0) & ((pid != 0) | (both != 0))
    return words, a, b, ready, errored


@triton.jit
def join_kernel(
    src_ptr, dst_ptr, numel,            # [T*H]: dst = src + partial (src's dtype -> dst's), or dst = src
    out_addr,                           # the slot's mapped fp32 partial sums [T, H]
    line_addr, done_seq_addr,           # the slot's request line (response line after it), done_seq
    abort_addr,                         # mapped int64 word the host watchdog raises (worker dead or late)
    fail_ptr, host_fail_addr,           # [1] int32 device flag; mapped int64 word: a failure code
    state_ptr, slot,
    SAME: tl.constexpr,                 # src and dst are one tensor: nothing to copy when nothing was rung
    BLOCK: tl.constexpr, LANES: tl.constexpr,    # LANES: threads of a program (32 * num_warps)
    ON_GPU: tl.constexpr,
):
    """Grid (cdiv(numel, BLOCK),). Each program waits until its block of the partial sums and the answer
    words are in (or the abort word, done_seq past the request, or the deadline in the state), then adds
    its block. Program 0 adds how long its wait took (from before the first poll to after the last,
    answered or not) to the state's ST_WAIT_NS: the joins of one stream run one after the other, so the
    sum is the GPU's time waiting for the CPU.

    One PCIe round a poll, no acquire: the ring filled out[:T] with the sentinel and the worker writes
    each word once, final (proto/shm_layout.py), so a word that is not the sentinel is this request's,
    whatever order the loads of a round were answered in; the answer words carry the request's tag.
    The threads of a program agree on every decision (block reductions of what each loaded), so the loop
    has one trip count; programs may still judge differently (one sees its block before the deadline,
    another after it), so a program that judged the call failed adds nothing and raises the device flag
    and the host word itself: a call with any failed part is flagged and the step re-run (partial sums
    applied to only some elements never reach a sampled token)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    seq = tl.load(state_ptr + _ST_RUNG0 + slot)
    if seq != 0:                                            # uniform: every thread reads the same word
        deadline_ns = tl.load(state_ptr + _ST_DEADLINE_NS)
        resp = line_addr + _RESP_OFFSET
        lane = tl.arange(0, LANES)
        tag = seq & 0xFFFFFFFF
        out_w = tl.multiple_of(out_addr.to(tl.pointer_type(tl.int32)), 16)     # page-aligned channel buffer
        a_p = (resp + _RESP_ANSWER_A).to(tl.pointer_type(tl.int64))
        b_p = (resp + _RESP_ANSWER_B).to(tl.pointer_type(tl.int64))
        abort_p = abort_addr.to(tl.pointer_type(tl.int64))
        done_p = done_seq_addr.to(tl.pointer_type(tl.int64))
        start = _now_ns(0, ON_GPU)
        abort = seq * 0
        done = seq * 0
        expired = seq * 0
        words, a, b, ready, errored = _poll_answer(out_w, offs, m, a_p, b_p, lane, tag, pid, ON_GPU)
        spins = 0
        while (not ready) & (not errored) & (abort == 0) & (done < seq) & (expired == 0):
            spins += 1
            if spins % _POLL_EVERY == 0:                    # the abort word and done_seq now and then
                abort = tl.max(tl.load(abort_p + lane * 0, volatile=True), axis=0)
                done = tl.max(tl.load(done_p + lane * 0, volatile=True), axis=0)
            words, a, b, ready, errored = _poll_answer(out_w, offs, m, a_p, b_p, lane, tag, pid, ON_GPU)
            expired = tl.max(((_now_lanes(lane, spins, ON_GPU) - start) >= deadline_ns).to(tl.int64), axis=0)
        waited_ns = _now_ns(spins, ON_GPU) - start          # this call's wait (pid 0's, into ST_WAIT_NS)
        if (not ready) & (not errored) & (done >= seq):     # done_seq moves after the answer: look again
            words, a, b, ready, errored = _poll_answer(out_w, offs, m, a_p, b_p, lane, tag, pid, ON_GPU)
        ok = ready & (not errored)
        acc = tl.load(src_ptr + offs, mask=m).to(tl.float32)
        part = words.to(tl.float32, bitcast=True)           # used only where ok (then no word is the sentinel)
        tl.store(dst_ptr + offs, tl.where(ok, acc + part, acc).to(dst_ptr.dtype.element_ty), mask=m)
        code = tl.where(errored, _FAIL_STATUS,
                        tl.where(done >= seq, _FAIL_REPLACED, tl.where(abort != 0, _FAIL_ABORTED, _FAIL_TIMEOUT)))
        failed = (offs >= 0) & (not ok)                     # [BLOCK]: the program's verdict, all alike
        tl.store(fail_ptr + offs * 0, tl.full([BLOCK], 1, tl.int32), mask=failed)
        tl.store(host_fail_addr.to(tl.pointer_type(tl.int64)) + offs * 0,
                 tl.full([BLOCK], 0, tl.int64) + code, mask=failed)
        if pid == 0:                                         # counters (the wait: any verdict)
            answered_ok = ok.to(tl.int64)
            experts = tl.max(a, axis=0) & 0xFFFFFF         # when ok, every lane loaded the one tagged word
            compute_ns = tl.max(b, axis=0) & 0xFFFFFFFF
            tl.store(state_ptr + _ST_ANSWERED, tl.load(state_ptr + _ST_ANSWERED) + answered_ok)
            tl.store(state_ptr + _ST_EXPERTS, tl.load(state_ptr + _ST_EXPERTS) + experts * answered_ok)
            tl.store(state_ptr + _ST_COMPUTE_NS, tl.load(state_ptr + _ST_COMPUTE_NS) + compute_ns * answered_ok)
            tl.store(state_ptr + _ST_FAILED, tl.load(state_ptr + _ST_FAILED) + 1 - answered_ok)
            tl.store(state_ptr + _ST_WAIT_NS, tl.load(state_ptr + _ST_WAIT_NS) + waited_ns)
    else:
        if not SAME:
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m).to(dst_ptr.dtype.element_ty), mask=m)


# Device counters of one hybrid forward, in the order of gpu_worker/hybrid/hybrid_experts.py DEVICE_COUNTERS.
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
