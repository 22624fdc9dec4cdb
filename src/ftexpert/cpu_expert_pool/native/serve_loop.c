/* The CPU worker's hot path in C: wait for the channel's doorbell, compute each request with
   ft_moe_layer (ft_moe_layer_q for a quantized store; both with the store's activation descriptor), publish
   the response line and done_seq (protocol: proto/shm_layout.py).

   Why C: the Python loop (cpu_expert_pool/worker.py cpu_busy_loop) costs ~5-6 us a request in Python
   alone (look up the slot, views, the kernel call through ctypes, the response fields), and on the
   GPU -> CPU -> GPU hand-off that decides whether the GPU's first poll of the response (one PCIe
   round trip, ~4 us on the H200 machine) already finds it. Here a request costs the kernel plus a few
   hundred nanoseconds.

   ft_serve handles requests until one of: the deadline passes (Python's housekeeping: heartbeat,
   control messages, signals), no request came for hot_ns since the last one (Python's idle policy then
   sleeps), or a request needs Python (a malformed line or split, a missing slot, a kernel error: Python answers
   it with its status and its log line). It never answers a request it returns for: the caller's
   next_request() sees it as the next one, unchanged.

   Memory order (x86-64 TSO and the compiler): loads of request_seq, then the request line, then the data
   (acquire on request_seq); stores of out (the kernel's OpenMP team joins before ft_moe_layer returns),
   then the response line, then resp seq and done_seq (release stores). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

int ft_moe_layer(int isa, int num_threads, const void *layer_base, int64_t expert_stride_bytes, int num_experts,
                 int H, int I, const void *hidden, int hidden_is_bf16, int T, const int32_t *tok,
                 const int32_t *expert, const float *weight, int n, float *out, int64_t *stats_out,
                 int split_expert, int split_limit, const void *act);                 /* expert_ffn.c */
int ft_moe_layer_q(const void *quant_format, int isa, int num_threads, const void *layer_base,
                   int64_t expert_stride_bytes, int num_experts, int H, int I, const void *hidden, int hidden_is_bf16,
                   int T, const int32_t *tok, const int32_t *expert, const float *weight, int n, float *out,
                   int64_t *stats_out, int split_expert, int split_limit, const void *act);   /* quant_ffn.c */

#define FT_SLOTS 2

/* Field offsets of the request / response lines (proto/shm_layout.py REQUEST_LINE, RESPONSE_LINE). */
#define REQ_SEQ 0
#define REQ_LAYER 8
#define REQ_TOKENS 12
#define REQ_TRIPLES 16
#define REQ_SPLIT_LIMIT 20      /* 0: no split (a 64-bit store of num_triples at 16 leaves it 0) */
#define REQ_SPLIT_EXPERT 24
#define SPLIT_CHANNEL_UNIT 32   /* proto/shm_layout.py SPLIT_CHANNEL_UNIT */
#define RESP_SEQ 0
#define RESP_STATUS 8
#define RESP_EXPERTS 12
#define RESP_COMPUTE_NS 16

typedef struct {
    int64_t *request_seq;                 /* channel words */
    int64_t *done_seq;
    uint8_t *request_line[FT_SLOTS];
    uint8_t *response_line[FT_SLOTS];
    void *hidden[FT_SLOTS];               /* [t_max, H] bf16 or fp32 */
    int32_t *token_idx[FT_SLOTS];         /* [max_triples] */
    int32_t *expert_id[FT_SLOTS];
    float *weight[FT_SLOTS];
    float *out[FT_SLOTS];                 /* [t_max, H] fp32 */
    int64_t t_max, max_triples, hidden_is_bf16;
    const uint8_t *store_data;            /* the expert store's data region: expert (l, e) at
                                             (l * E + e) * expert_stride */
    int64_t expert_stride;
    int64_t num_layers, num_experts, hidden_size, intermediate;
    const int16_t *owner;                 /* [L, E] worker index, or NULL: no split to count against */
    int64_t worker_index;
    int64_t isa, num_threads;
    const void *quant_format;             /* quant_ffn.c's ft_quant_format of a quantized store, NULL: bf16 */
    const void *act;                      /* expert_act.h's ft_expert_act (gpt-oss: swiglu-clamp, biases), NULL: silu */
} ft_channel_desc;

/* stats[]: what ft_serve adds up, in this order (WorkerStats' fields). */
enum { ST_REQUESTS, ST_TOKENS, ST_TRIPLES, ST_EXPERTS, ST_BYTES, ST_COMPUTE_NS, ST_FOREIGN, ST_COUNT };

/* Return codes. */
enum { FT_SERVE_DEADLINE = 0, FT_SERVE_IDLE = 1, FT_SERVE_PYTHON = 2, FT_SERVE_BAD_ARGS = -1 };

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline int64_t load_acquire64(const void *p) { return __atomic_load_n((const int64_t *)p, __ATOMIC_ACQUIRE); }
static inline int32_t load32(const uint8_t *p) { return __atomic_load_n((const int32_t *)p, __ATOMIC_RELAXED); }

/* done_io: the last request answered (the caller's copy of done_seq), updated. last_work_ns_io: when the
   last request was answered (CLOCK_MONOTONIC, time.monotonic_ns()), updated. stats: ST_COUNT int64s,
   added to. */
int ft_serve(const ft_channel_desc *ch, int64_t *done_io, int64_t deadline_ns, int64_t hot_ns,
             int64_t *last_work_ns_io, int64_t *stats) {
    if (!ch || !done_io || !last_work_ns_io || !stats || !ch->request_seq || !ch->done_seq) return FT_SERVE_BAD_ARGS;
    int64_t done = *done_io;
    for (;;) {
        int64_t now = mono_ns();
        if (load_acquire64(ch->request_seq) > done) {
            const int64_t seq = done + 1;
            int slot = -1;
            for (int s = 0; s < FT_SLOTS; ++s)
                if (load_acquire64(ch->request_line[s] + REQ_SEQ) == seq) { slot = s; break; }
            if (slot < 0) { *done_io = done; return FT_SERVE_PYTHON; }      /* rang without a slot */
            const uint8_t *line = ch->request_line[slot];
            const int32_t layer = load32(line + REQ_LAYER), T = load32(line + REQ_TOKENS),
                          n = load32(line + REQ_TRIPLES), split_limit = load32(line + REQ_SPLIT_LIMIT),
                          split_expert = load32(line + REQ_SPLIT_EXPERT);
            const int bad_split = split_limit != 0
                                  && (split_limit < 0 || split_limit >= ch->intermediate
                                      || split_limit % SPLIT_CHANNEL_UNIT != 0 || split_expert < 0
                                      || split_expert >= ch->num_experts);
            if (layer < 0 || layer >= ch->num_layers || T < 0 || T > ch->t_max || n < 0 || n > ch->max_triples
                || bad_split) {
                *done_io = done;
                return FT_SERVE_PYTHON;                                        /* malformed: Python answers */
            }
            const int64_t t0 = mono_ns();
            int64_t kstats[2] = {0, 0};
            if (n == 0) {
                memset(ch->out[slot], 0, (size_t)T * (size_t)ch->hidden_size * sizeof(float));
            } else {
                const uint8_t *base = ch->store_data + (size_t)layer * (size_t)ch->num_experts * (size_t)ch->expert_stride;
                int rc = ch->quant_format
                    ? ft_moe_layer_q(ch->quant_format, (int)ch->isa, (int)ch->num_threads, base, ch->expert_stride,
                                     (int)ch->num_experts, (int)ch->hidden_size, (int)ch->intermediate,
                                     ch->hidden[slot], (int)ch->hidden_is_bf16, T, ch->token_idx[slot],
                                     ch->expert_id[slot], ch->weight[slot], n, ch->out[slot], kstats,
                                     split_expert, split_limit, ch->act)
                    : ft_moe_layer((int)ch->isa, (int)ch->num_threads, base, ch->expert_stride,
                                   (int)ch->num_experts, (int)ch->hidden_size, (int)ch->intermediate,
                                   ch->hidden[slot], (int)ch->hidden_is_bf16, T, ch->token_idx[slot],
                                   ch->expert_id[slot], ch->weight[slot], n, ch->out[slot], kstats,
                                   split_expert, split_limit, ch->act);
                if (rc != 0) { *done_io = done; return FT_SERVE_PYTHON; }     /* Python reports the error */
            }
            const int64_t t1 = mono_ns();
            int64_t foreign = 0;
            if (ch->owner) {    /* ids read again from shared memory: a client rewriting them must not
                                   index outside the map (the kernel validated its own read) */
                const int16_t *row = ch->owner + (size_t)layer * (size_t)ch->num_experts;
                for (int k = 0; k < n; ++k) {
                    const int32_t e = __atomic_load_n(&ch->expert_id[slot][k], __ATOMIC_RELAXED);
                    foreign += e >= 0 && e < ch->num_experts && row[e] != ch->worker_index;
                }
            }
            uint8_t *resp = ch->response_line[slot];
            __atomic_store_n((int32_t *)(resp + RESP_STATUS), 0, __ATOMIC_RELAXED);
            __atomic_store_n((int32_t *)(resp + RESP_EXPERTS), (int32_t)kstats[0], __ATOMIC_RELAXED);
            __atomic_store_n((int64_t *)(resp + RESP_COMPUTE_NS), t1 - t0, __ATOMIC_RELAXED);
            __atomic_store_n((int64_t *)(resp + RESP_SEQ), seq, __ATOMIC_RELEASE);  /* the line is complete ... */
            __atomic_store_n(ch->done_seq, seq, __ATOMIC_RELEASE);                  /* ... before done_seq moves */
            done = seq;
            *done_io = done;
            *last_work_ns_io = t1;
            stats[ST_REQUESTS] += 1;
            stats[ST_TOKENS] += T;
            stats[ST_TRIPLES] += n;
            stats[ST_EXPERTS] += kstats[0];
            stats[ST_BYTES] += kstats[1];
            stats[ST_COMPUTE_NS] += t1 - t0;
            stats[ST_FOREIGN] += foreign;
            if (t1 >= deadline_ns) return FT_SERVE_DEADLINE;
            continue;
        }
        if (now >= deadline_ns) { *done_io = done; return FT_SERVE_DEADLINE; }
        if (now - *last_work_ns_io >= hot_ns) { *done_io = done; return FT_SERVE_IDLE; }
        cpu_relax();
    }
}

/* The struct's size and its fields' offsets, in declaration order, so the Python side can check that its
   ctypes mirror matches field by field. Returns the number of offsets (written when n allows). */
int64_t ft_channel_desc_size(void) { return (int64_t)sizeof(ft_channel_desc); }

#define FT_OFF(f) (int64_t)offsetof(ft_channel_desc, f)
int ft_channel_desc_offsets(int64_t *out, int n) {
    const int64_t offs[] = {FT_OFF(request_seq), FT_OFF(done_seq), FT_OFF(request_line), FT_OFF(response_line),
                            FT_OFF(hidden), FT_OFF(token_idx), FT_OFF(expert_id), FT_OFF(weight), FT_OFF(out),
                            FT_OFF(t_max), FT_OFF(max_triples), FT_OFF(hidden_is_bf16), FT_OFF(store_data),
                            FT_OFF(expert_stride), FT_OFF(num_layers), FT_OFF(num_experts), FT_OFF(hidden_size),
                            FT_OFF(intermediate), FT_OFF(owner), FT_OFF(worker_index), FT_OFF(isa),
                            FT_OFF(num_threads), FT_OFF(quant_format), FT_OFF(act)};
    const int count = (int)(sizeof(offs) / sizeof(offs[0]));
    for (int i = 0; i < count && i < n; ++i) out[i] = offs[i];
    return count;
}
