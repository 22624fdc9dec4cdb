/* The DMA proxy: a host thread that turns copy plans published by the GPU into copy-engine DMAs.
 *
 * The kernel copy mode moves experts host -> GPU with SM loads, because its plan lives on the device
 * (written by the slot cache's ensure kernel) and a CUDA graph cannot issue a cudaMemcpy whose
 * addresses are data. The copy engine moves them ~7% faster. This thread closes the loop without a host
 * sync on the decode path (gpu_worker/offload/dma_proxy.py has the protocol):
 *
 *   GPU (compute stream, in or out of a graph)       this thread
 *   publish kernel: entry[seq % R] <- plan, fence,
 *                   mbox[0] <- seq                ->  sees mbox[0] > done, reads the entry
 *                                                     cuMemcpyHtoDAsync of every planned expert's first
 *                                                     part, cuStreamWriteValue64(landed[0] <- seq), then
 *                                                     the second parts and landed[1] <- seq (own stream)
 *   wait kernel: spins until landed[p] >= seq     <-  (the write lands after the copies: its fence)
 *
 * Written in C rather than Python because one driver call from Python costs several microseconds and
 * the GIL; here a plan of three experts is issued in a few microseconds. The CUDA driver entry points
 * are passed in (resolved by the caller through ctypes), so this file needs no CUDA headers. Without
 * them (memcpy == NULL) the "device" is host memory: plain memcpy and an atomic store stand in for the
 * driver calls, which lets CI run the whole protocol on a machine without a GPU.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FT_PAUSE() _mm_pause()
#else
#define FT_PAUSE() __asm__ __volatile__("" ::: "memory")
#endif

typedef int (*ft_memcpy_htod_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*ft_write64_fn)(void *stream, uint64_t addr, uint64_t value, unsigned int flags);
typedef int (*ft_ctx_set_fn)(void *ctx);

/* Mailbox words (int64), shared with dma_proxy.py: the header, then the ring of entries. */
#define FT_MBOX_SEQ 0            /* the last sequence the GPU published */
#define FT_MBOX_FAIL 1           /* written here: nonzero once the proxy stopped on an error (the wait kernel polls it) */
#define FT_MBOX_HEADER 8         /* int64 words before entry 0 (one cache line) */
/* An entry (int32 words): seq (two words), layer, n, then n pairs (host row, slot). */
#define FT_ENTRY_SEQ 0
#define FT_ENTRY_LAYER 2
#define FT_ENTRY_N 3
#define FT_ENTRY_PAIRS 4

/* Errors (negative; a positive status is the failing driver call's CUresult). */
#define FT_ERR_ENTRY_SEQ (-1)    /* the entry does not carry the sequence the mailbox announced */
#define FT_ERR_LAYER (-2)        /* layer outside [0, num_layers) */
#define FT_ERR_N (-3)            /* plan length outside [0, max_pairs] */
#define FT_ERR_ROW (-4)          /* host row outside [0, num_rows) */
#define FT_ERR_SLOT (-5)         /* slot outside [0, num_slots) */
#define FT_ERR_CTX (-6)          /* making the context current failed */

typedef struct {
    /* set by the caller before ft_proxy_start (dma_proxy.py mirrors this layout with ctypes) */
    volatile int64_t *mbox;          /* host memory the GPU writes (mapped) */
    int64_t ring;                    /* entries in the ring */
    int64_t entry_words;             /* int32 words per entry */
    int64_t max_pairs;
    const uint64_t *layer_base;      /* host address of each layer's row 0 */
    int64_t num_layers, num_rows, host_stride;   /* rows per layer, bytes between host rows */
    uint64_t slots_base;             /* device address of slot 0 */
    int64_t num_slots, slot_stride;  /* bytes between slots */
    int64_t part_lo[2], part_hi[2];  /* byte ranges of a row copied as part 0 and part 1 (hi == lo: empty) */
    uint64_t landed[2];              /* device addresses of the int64 words written after part 0, part 1 */
    void *ctx, *stream;
    ft_memcpy_htod_fn memcpy_htod;   /* NULL: host memory stands in for the device (tests) */
    ft_write64_fn write64;
    ft_ctx_set_fn ctx_set;
    int64_t hot_ns;                  /* spin this long after the last plan before sleeping between polls */
    int64_t sleep_ns;                /* the sleep between polls once idle */
    /* written by the thread */
    volatile int64_t done;           /* the last sequence whose copies and landed writes were issued */
    volatile int64_t status;         /* 0, or the error that stopped the thread */
    volatile int64_t failed_seq;     /* the sequence being issued when it stopped */
    volatile int64_t copies, bytes;  /* issued so far */
    volatile int64_t issue_ns;       /* time spent in the driver calls of all entries (host clock) */
    volatile int64_t max_call_ns;    /* the longest single driver call, and when it began (CLOCK_MONOTONIC ns) */
    volatile int64_t max_call_at_ns;
    volatile int32_t stop;
    pthread_t thread;
    int32_t running;
} ft_proxy;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int64_t now_ns(void);

static void time_call(ft_proxy *p, int64_t t0) {
    int64_t d = now_ns() - t0;
    if (d > p->max_call_ns) {
        p->max_call_ns = d;
        p->max_call_at_ns = t0;
    }
}

static int issue_copy(ft_proxy *p, uint64_t dst, const void *src, size_t n) {
    if (p->memcpy_htod == NULL) {
        memcpy((void *)(uintptr_t)dst, src, n);
        return 0;
    }
    int64_t t0 = now_ns();
    int rc = p->memcpy_htod(dst, src, n, p->stream);
    time_call(p, t0);
    return rc;
}

static int issue_landed(ft_proxy *p, uint64_t addr, int64_t seq) {
    if (p->write64 == NULL) {
        __atomic_store_n((int64_t *)(uintptr_t)addr, seq, __ATOMIC_RELEASE);   /* after the memcpys above */
        return 0;
    }
    int64_t t0 = now_ns();
    int rc = p->write64(p->stream, addr, (uint64_t)seq, 0);   /* default flags: a fence before the write */
    time_call(p, t0);
    return rc;
}

/* Issue the copies of entry `seq`; 0 or an error (the thread then stops). */
static int64_t issue_entry(ft_proxy *p, int64_t seq) {
    const int32_t *e = (const int32_t *)(p->mbox + FT_MBOX_HEADER) + (seq % p->ring) * p->entry_words;
    int64_t entry_seq = __atomic_load_n((const int64_t *)(e + FT_ENTRY_SEQ), __ATOMIC_ACQUIRE);
    if (entry_seq != seq) return FT_ERR_ENTRY_SEQ;
    int32_t layer = e[FT_ENTRY_LAYER], n = e[FT_ENTRY_N];
    if (layer < 0 || layer >= p->num_layers) return FT_ERR_LAYER;
    if (n < 0 || n > p->max_pairs) return FT_ERR_N;
    const int32_t *pairs = e + FT_ENTRY_PAIRS;
    for (int32_t i = 0; i < n; i++) {
        if (pairs[2 * i] < 0 || pairs[2 * i] >= p->num_rows) return FT_ERR_ROW;
        if (pairs[2 * i + 1] < 0 || pairs[2 * i + 1] >= p->num_slots) return FT_ERR_SLOT;
    }
    const char *base = (const char *)(uintptr_t)p->layer_base[layer];
    for (int part = 0; part < 2; part++) {
        int64_t lo = p->part_lo[part], len = p->part_hi[part] - lo;
        for (int32_t i = 0; i < n && len > 0; i++) {
            int64_t row = pairs[2 * i], slot = pairs[2 * i + 1];
            int rc = issue_copy(p, p->slots_base + (uint64_t)(slot * p->slot_stride + lo),
                                base + row * p->host_stride + lo, (size_t)len);
            if (rc != 0) return rc;
            p->copies += part == 0 || p->part_hi[0] == p->part_lo[0];
            p->bytes += len;
        }
        int rc = issue_landed(p, p->landed[part], seq);
        if (rc != 0) return rc;
    }
    return 0;
}

static void *proxy_main(void *arg) {
    ft_proxy *p = (ft_proxy *)arg;
    if (p->ctx_set != NULL && p->ctx_set(p->ctx) != 0) {
        p->status = FT_ERR_CTX;
        __atomic_store_n(&p->mbox[FT_MBOX_FAIL], (int64_t)FT_ERR_CTX, __ATOMIC_RELEASE);
        return NULL;
    }
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);   /* idle polls sleep sleep_ns, not the default 50 us slack more */
    int64_t last_work = now_ns();
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        int64_t published = __atomic_load_n(&p->mbox[FT_MBOX_SEQ], __ATOMIC_ACQUIRE);
        if (published > p->done) {
            int64_t seq = p->done + 1;
            int64_t t0 = now_ns();
            int64_t rc = issue_entry(p, seq);
            p->issue_ns += now_ns() - t0;
            if (rc != 0) {
                p->failed_seq = seq;
                p->status = rc;
                __atomic_store_n(&p->mbox[FT_MBOX_FAIL], rc, __ATOMIC_RELEASE);
                return NULL;
            }
            __atomic_store_n(&p->done, seq, __ATOMIC_RELEASE);
            last_work = now_ns();
            continue;
        }
        if (now_ns() - last_work < p->hot_ns) {
            for (int i = 0; i < 4; i++) FT_PAUSE();     /* ~0.2 us between polls */
        } else {
            struct timespec ts = {0, (long)p->sleep_ns};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

int ft_proxy_start(ft_proxy *p) {
    if (p->running) return EBUSY;
    p->stop = 0;
    p->status = 0;
    int rc = pthread_create(&p->thread, NULL, proxy_main, p);
    if (rc == 0) p->running = 1;
    return rc;
}

int ft_proxy_stop(ft_proxy *p) {
    if (!p->running) return 0;
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    int rc = pthread_join(p->thread, NULL);
    p->running = 0;
    return rc;
}

int64_t ft_proxy_size(void) { return (int64_t)sizeof(ft_proxy); }

/* offsetof() of the fields dma_proxy.py writes and reads, in its order (a check of its ctypes mirror). */
int ft_proxy_offsets(int64_t *out, int cap) {
    int64_t offs[] = {
        offsetof(ft_proxy, mbox), offsetof(ft_proxy, ring), offsetof(ft_proxy, entry_words),
        offsetof(ft_proxy, max_pairs), offsetof(ft_proxy, layer_base), offsetof(ft_proxy, num_layers),
        offsetof(ft_proxy, num_rows), offsetof(ft_proxy, host_stride), offsetof(ft_proxy, slots_base),
        offsetof(ft_proxy, num_slots), offsetof(ft_proxy, slot_stride), offsetof(ft_proxy, part_lo),
        offsetof(ft_proxy, part_hi), offsetof(ft_proxy, landed), offsetof(ft_proxy, ctx),
        offsetof(ft_proxy, stream), offsetof(ft_proxy, memcpy_htod), offsetof(ft_proxy, write64),
        offsetof(ft_proxy, ctx_set), offsetof(ft_proxy, hot_ns), offsetof(ft_proxy, sleep_ns),
        offsetof(ft_proxy, done), offsetof(ft_proxy, status), offsetof(ft_proxy, failed_seq),
        offsetof(ft_proxy, copies), offsetof(ft_proxy, bytes), offsetof(ft_proxy, issue_ns),
        offsetof(ft_proxy, max_call_ns), offsetof(ft_proxy, max_call_at_ns), offsetof(ft_proxy, stop),
        offsetof(ft_proxy, thread), offsetof(ft_proxy, running),
    };
    int count = (int)(sizeof(offs) / sizeof(offs[0]));
    for (int i = 0; i < count && i < cap; i++) out[i] = offs[i];
    return count;
}
