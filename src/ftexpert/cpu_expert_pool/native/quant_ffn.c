/* CPU expert FFN over quantized experts (fp8, int4, mxfp4, nvfp4) for one MoE layer:
 * out[t] = sum_k w_k * down(silu(gate(x_t)) * up(x_t)), the bf16 kernel's contract (expert_ffn.c) for experts
 * stored as proto/expert_format.py lays them out. The Python side passes the expert's region offsets and the
 * format (ft_quant_format, mirrored in cpu_expert_pool/native/quant_desc.py); the shapes of the regions follow
 * from H, I and the format by that file's formulas. Decoders and dot products: quant_dots.h. An activation
 * descriptor (expert_act.h) selects gpt-oss's clamped SwiGLU and the biases after the quantized weights (at
 * act->bias_offset, in the model's compute dtype: bf16, fp16 or fp32); NULL is silu without biases.
 *
 * Same structure as ft_moe_layer: triples grouped by expert (counting sort), one OpenMP team; phase 0 zeroes
 * out and converts x to fp32 (4-bit formats: permuted per block of 32, perm4_pos); phase 1 splits the gate/up
 * row pairs [0, lim_g) of all groups (h = act(g, u), fp32, stored permuted for 4-bit formats); phase 2 splits
 * the H output rows; both hand out their rows in chunks, each to the thread that comes for it first. A split
 * expert (split_limit c > 0) reads gate/up rows [0, c) and down columns [0, c).
 * Each output element is computed by one thread in a fixed order: results do not depend on the thread count.
 *
 * ISAs: 2 and above (AVX-512 BF16, AMX) run the AVX-512F code, 1 AVX2, 0 portable C (see quant_dots.h).
 * int8 activations (ft_quant_format.act_int8, 4-bit formats, ISA 2 on a CPU with AVX-512 VNNI): phase 0 also
 * quantizes x, phase 1 stores h in element order, and between phases 1 and 2 every h row is quantized over its
 * g_lim values (quant_int8.h); the dot products are then integer.
 * Legend: T tokens, H hidden, I intermediate, E experts, n triples, G experts used, B tokens of one, c split_limit.
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };   /* expert_ffn.c's numbering */
enum { ERR_BAD_TOKEN = -1, ERR_BAD_EXPERT = -2, ERR_NO_MEMORY = -3, ERR_BAD_ISA = -4, ERR_BAD_ARGS = -5,
       ERR_BAD_FORMAT = -6, ERR_BAD_ACT = -7 };
#define TOKEN_CHUNK 256
#define ALIGN_BYTES 64
#define SPLIT_CHANNEL_UNIT 32

#if defined(FT_EMULATE_AVX512)       /* a test build: the AVX-512 code on SIMDe's portable intrinsics */
#include "simde_shim.h"
#define T_AVX512Q
#define T_AVX2Q
static int ft_best_isa(void) { return ISA_AVX512; }
#else
#if defined(__x86_64__)
#include <immintrin.h>
#endif
int ft_best_isa(void);               /* expert_ffn.c */
#endif

#include "expert_act.h"
#include "quant_dots.h"
#include "quant_int8.h"
#include "phase_times.h"

/* One quantized expert's layout: ft_quant_format (cpu_expert_pool/native/quant_desc.py builds it from a
   proto.expert_format.QuantLayout). Offsets are bytes from the expert's first byte, -1 for an absent region. */
typedef struct {
    int64_t format;            /* FMT_* */
    int64_t group_size;        /* int4 32 / 64 / 128, mxfp4 32, nvfp4 16; fp8 128 (the block side) */
    int64_t expert_bytes;      /* QuantLayout.expert_nbytes */
    int64_t codes_w13, codes_w2, scales_w13, scales_w2, zeros_w13, zeros_w2, globals;
    int64_t act_int8;          /* 1: int8 activations (4-bit formats, AVX-512 VNNI: quant_int8.h); 0: fp32 */
} ft_quant_format;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
/* Rows a chunk of a phase's `total`: about four chunks a thread, at least `least`. */
static inline int64_t chunk_rows(int64_t total, int nth, int64_t least) {
    const int64_t c = ceil_div(total, (int64_t)nth * 4);
    return c > least ? c : least;
}
/* The first row of the next chunk not yet taken (chunks 0 .. nth - 1 are the threads' first, by their numbers). */
static inline int64_t next_chunk(int nth, int64_t rows, int64_t *taken) {
    return (int64_t)nth * rows + __atomic_fetch_add(taken, rows, __ATOMIC_RELAXED);
}
static int64_t code_row_bytes(const ft_quant_format *f, int64_t k) { return f->format == FMT_FP8 ? k : k / 2; }
static int64_t scale_count(const ft_quant_format *f, int64_t rows, int64_t k) {     /* one matrix */
    return f->format == FMT_FP8 ? ceil_div(rows, FP8_BLOCK) * ceil_div(k, FP8_BLOCK) : rows * (k / f->group_size);
}
static int64_t scale_item(const ft_quant_format *f) { return f->format <= FMT_INT4 ? 4 : 1; }

static int region_ok(const ft_quant_format *f, int64_t off, int64_t nbytes, int present) {
    if (!present) return off == -1;
    return off >= 0 && nbytes >= 0 && off + nbytes <= f->expert_bytes;
}

/* 0, or ERR_BAD_FORMAT: an unknown format, a group size it does not take or that does not divide H and I, or a
   region that does not fit the expert's bytes (or is given where the format has none). */
int ft_quant_format_check(const ft_quant_format *f, int H, int I, int64_t expert_stride_bytes) {
    if (!f || f->format < FMT_FP8 || f->format > FMT_NVFP4) return ERR_BAD_FORMAT;
    const int64_t G = f->group_size;
    const int ok_group = f->format == FMT_FP8 ? G == FP8_BLOCK
                         : f->format == FMT_INT4 ? (G == 32 || G == 64 || G == 128)
                         : f->format == FMT_MXFP4 ? G == 32 : G == 16;
    if (!ok_group || H <= 0 || I <= 0) return ERR_BAD_FORMAT;
    if (f->act_int8 != 0 && (f->act_int8 != 1 || f->format == FMT_FP8)) return ERR_BAD_FORMAT;
    if (f->format != FMT_FP8 && (H % G || I % G)) return ERR_BAD_FORMAT;
    if (f->expert_bytes <= 0 || f->expert_bytes > expert_stride_bytes) return ERR_BAD_FORMAT;
    const int int4 = f->format == FMT_INT4, nv = f->format == FMT_NVFP4;
    const int64_t s13 = 2 * scale_count(f, I, H), s2 = scale_count(f, H, I);
    if (!region_ok(f, f->codes_w13, 2 * (int64_t)I * code_row_bytes(f, H), 1)
        || !region_ok(f, f->codes_w2, (int64_t)H * code_row_bytes(f, I), 1)
        || !region_ok(f, f->scales_w13, s13 * scale_item(f), 1) || !region_ok(f, f->scales_w2, s2 * scale_item(f), 1)
        || !region_ok(f, f->zeros_w13, s13, int4) || !region_ok(f, f->zeros_w2, s2, int4)
        || !region_ok(f, f->globals, 12, nv)) return ERR_BAD_FORMAT;
    return 0;
}

/* Row r of matrix m (0 gate [I, H], 1 up [I, H], 2 down [H, I]) of the expert at e. */
static qrow quant_row(const ft_quant_format *f, const uint8_t *e, int H, int I, int m, int r) {
    const int64_t K = m == 2 ? I : H, rows = m == 2 ? H : I;
    const int64_t part = m == 1 ? 1 : 0, n_scales = scale_count(f, rows, K);
    const int64_t row_in_region = m == 1 ? (int64_t)I + r : r;
    const int64_t codes = m == 2 ? f->codes_w2 : f->codes_w13, scales = m == 2 ? f->scales_w2 : f->scales_w13;
    const int64_t zeros = m == 2 ? f->zeros_w2 : f->zeros_w13;
    const int64_t per_row = f->format == FMT_FP8 ? ceil_div(K, FP8_BLOCK) : K / f->group_size;
    const int64_t srow = f->format == FMT_FP8 ? r / FP8_BLOCK : r;              /* fp8: the block row */
    qrow q = {e + codes + row_in_region * code_row_bytes(f, K), NULL, NULL, NULL, 1.0f};
    const uint8_t *s = e + scales + (part * n_scales + srow * per_row) * scale_item(f);
    if (f->format <= FMT_INT4) q.fscales = (const float *)s;
    else q.bscales = s;
    if (f->format == FMT_INT4) q.zeros = e + zeros + part * n_scales + srow * per_row;
    if (f->format == FMT_NVFP4) memcpy(&q.global, e + f->globals + 4 * m, 4);
    return q;
}

/* quant_row's addressing of one matrix, computed once an expert and matrix (it divides by the group size and
   multiplies 64-bit counts); a row is then a few multiply-adds (qmat_row), which the short rows of 4-bit formats
   (a down row of I = 768 weights is 384 bytes) would otherwise pay on every row pair. */
typedef struct {
    const uint8_t *codes, *scales, *zeros;
    int64_t code_stride, scale_stride;     /* bytes a row (fp8 scales: a block row of 128 rows) */
    int fp8;
    float global;
} qmat;

static qmat quant_mat(const ft_quant_format *f, const uint8_t *e, int H, int I, int m) {
    const qrow r0 = quant_row(f, e, H, I, m, 0);
    const int64_t K = m == 2 ? I : H;
    const int64_t per_row = f->format == FMT_FP8 ? ceil_div(K, FP8_BLOCK) : K / f->group_size;
    const qmat q = {r0.codes, f->format <= FMT_INT4 ? (const uint8_t *)r0.fscales : r0.bscales, r0.zeros,
                    code_row_bytes(f, K), per_row * scale_item(f), f->format == FMT_FP8, r0.global};
    return q;
}

static inline qrow qmat_row(const qmat *q, int r, int fmt) {
    const int64_t srow = q->fp8 ? r / FP8_BLOCK : r;
    const uint8_t *s = q->scales + srow * q->scale_stride;
    qrow row = {q->codes + (int64_t)r * q->code_stride, NULL, NULL, NULL, q->global};
    if (fmt <= FMT_INT4) row.fscales = (const float *)s;
    else row.bscales = s;
    if (fmt == FMT_INT4) row.zeros = q->zeros + srow * (q->scale_stride / 4);
    return row;
}

/* Rows r0 .. r0 + rows - 1 of q: their first PREFETCH_AHEAD code bytes and their scales' first lines, towards L2.
   PREFETCH_CODES runs PREFETCH_AHEAD ahead of the row a thread reads, so a stream that starts cold (the next
   expert's rows, the next phase's) would wait on DRAM for its first lines; this asks for them one expert or
   one phase before. */
static inline void prefetch_rows(const qmat *q, int r0, int rows, int fmt) {
#if defined(__x86_64__)
    if (rows <= 0) return;
    const qrow r = qmat_row(q, r0, fmt);
    const int64_t nc = (int64_t)rows * q->code_stride, ns = (int64_t)rows * q->scale_stride;
    const char *c = (const char *)r.codes;
    const char *sc = fmt <= FMT_INT4 ? (const char *)r.fscales : (const char *)r.bscales;
    for (int64_t o = 0; o < (nc < PREFETCH_AHEAD ? nc : PREFETCH_AHEAD); o += 64) _mm_prefetch(c + o, _MM_HINT_T1);
    for (int64_t o = 0; o < (ns < 256 ? ns : 256); o += 64) _mm_prefetch(sc + o, _MM_HINT_T1);
#else
    (void)q; (void)r0; (void)rows; (void)fmt;
#endif
}

/* ---------------------------------------------------------------- scratch (grow-only, per process) */
static pthread_mutex_t q_lock = PTHREAD_MUTEX_INITIALIZER;
typedef struct { void *ptr; size_t bytes; } qbuffer;
static qbuffer q_meta = {NULL, 0}, q_work = {NULL, 0};

static size_t align_up(size_t v) { return (v + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }
static void *reserve(qbuffer *b, size_t nbytes) {
    if (nbytes <= b->bytes && b->ptr) return b->ptr;
    free(b->ptr);
    b->bytes = 0;
    b->ptr = aligned_alloc(ALIGN_BYTES, align_up(nbytes ? nbytes : 1));
    if (b->ptr) b->bytes = align_up(nbytes ? nbytes : 1);
    return b->ptr;
}

static inline float bf16_to_f32(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }

/* Returns 0 or a negative ERR_*; the arguments after qf are ft_moe_layer's (expert_ffn.c), act included. stats_out[0]
   = experts used, stats_out[1] = bytes read: expert_bytes an expert (plus its biases), a split expert its c / I
   share. */
int ft_moe_layer_q(const ft_quant_format *qf, int isa, int num_threads,
                   const void *layer_base, int64_t expert_stride_bytes, int num_experts, int H, int I,
                   const void *hidden, int hidden_is_bf16, int T,
                   const int32_t *tok, const int32_t *expert, const float *weight, int n,
                   float *out, int64_t *stats_out, int split_expert, int split_limit, const ft_expert_act *act) {
    PHASE_CALL(0);
    if (isa < ISA_SCALAR || isa > ft_best_isa()) return ERR_BAD_ISA;
    if (H <= 0 || I <= 0 || T < 0 || n < 0 || num_experts <= 0 || num_threads <= 0) return ERR_BAD_ARGS;
    if (ft_quant_format_check(qf, H, I, expert_stride_bytes)) return ERR_BAD_FORMAT;
    if (ft_act_check(act, H, I, expert_stride_bytes)
        || (ft_act_biased(act) && act->bias_offset < qf->expert_bytes)) return ERR_BAD_ACT;
    if (split_limit != 0 && ft_act_biased(act)) return ERR_BAD_ARGS;
    if (split_limit != 0 && (split_limit < 0 || split_limit >= I || split_limit % SPLIT_CHANNEL_UNIT != 0
                             || split_expert < 0 || split_expert >= num_experts)) return ERR_BAD_ARGS;
    for (int k = 0; k < n; ++k) {
        if (tok[k] < 0 || tok[k] >= T) return ERR_BAD_TOKEN;
        if (expert[k] < 0 || expert[k] >= num_experts) return ERR_BAD_EXPERT;
    }
    const int fmt = (int)qf->format, G = (int)qf->group_size, four = fmt != FMT_FP8, i8 = qf->act_int8 != 0;
    if (isa > ISA_AVX512) isa = ISA_AVX512;
    if (i8 && (isa != ISA_AVX512 || !ft_quant_int8_available())) return ERR_BAD_ISA;

    pthread_mutex_lock(&q_lock);
    const size_t a_e = align_up((size_t)(num_experts + 1) * 4), a_n = align_up((size_t)(n + 1) * 4);
    uint8_t *s = (uint8_t *)reserve(&q_meta, a_e + 6 * a_n);
    if (!s) { pthread_mutex_unlock(&q_lock); return ERR_NO_MEMORY; }
    int32_t *counts = (int32_t *)s, *g_expert = (int32_t *)(s + a_e), *g_start = (int32_t *)(s + a_e + a_n);
    int32_t *g_lim = (int32_t *)(s + a_e + 2 * a_n), *stok = (int32_t *)(s + a_e + 3 * a_n);
    float *swt = (float *)(s + a_e + 4 * a_n);
    int32_t *iota = (int32_t *)(s + a_e + 5 * a_n);
    memset(counts, 0, (size_t)(num_experts + 1) * 4);
    for (int k = 0; k < n; ++k) counts[expert[k] + 1]++;
    int ng = 0;
    for (int e = 0; e < num_experts; ++e) {
        if (counts[e + 1]) {
            g_expert[ng] = e; g_start[ng] = counts[e];
            g_lim[ng] = split_limit > 0 && e == split_expert ? split_limit : I;
            ++ng;
        }
        counts[e + 1] += counts[e];
    }
    g_start[ng] = n;
    for (int k = 0; k < n; ++k) {
        const int pos = counts[expert[k]]++;
        stok[pos] = tok[k];
        swt[pos] = weight[k];
    }
    for (int k = 0; k < n; ++k) iota[k] = k;
    /* x [T, H] fp32, h [n, I] fp32 (group g's rows from g_start[g]), g_item[g]: phase-1 row pairs before g;
       int8 activations: x and h quantized, rows of x8s / h8s bytes (quant_int8.h) */
    const int64_t x8s = i8 ? q8_row_bytes(H, fmt, G) : 0, h8s = i8 ? q8_row_bytes(I, fmt, G) : 0;
    const size_t off_h = align_up((size_t)T * H * 4), off_items = off_h + align_up((size_t)n * I * 4);
    const size_t off_x8 = off_items + align_up((size_t)(ng + 1) * 8), off_h8 = off_x8 + align_up((size_t)(T * x8s));
    uint8_t *w = (uint8_t *)reserve(&q_work, off_h8 + (size_t)(n * h8s));
    if (!w) { pthread_mutex_unlock(&q_lock); return ERR_NO_MEMORY; }
    float *xq = (float *)w, *hbuf = (float *)(w + off_h);
    int64_t *g_item = (int64_t *)(w + off_items);
    uint8_t *x8 = w + off_x8, *h8 = w + off_h8;
    const int perm = four && !i8;                  /* the fp32 path's permuted activations */
    g_item[0] = 0;
    for (int g = 0; g < ng; ++g) g_item[g + 1] = g_item[g] + g_lim[g];
    const int64_t items1 = g_item[ng];
    const uint8_t *base = (const uint8_t *)layer_base;
    /* Phases 1 and 2 hand out their rows in chunks: thread t's first chunk is chunk t (known before the barrier,
       so its first rows can be asked for there), each later one the next not yet taken (one atomic add). The
       threads of a team do not read at one rate (bench_cpu_phases.py: the slowest took 1.7-2.3x the fastest over
       fixed ranges), so fixed ranges would end with the slowest. Which thread computes a row does not change its
       value, nor the order of any sum. */
    int64_t taken1 = 0, taken2 = 0;

    #pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        /* chunk sizes: about four chunks a thread; phase 2's even, so that its row pairs stay inside a chunk */
        const int64_t ch1 = chunk_rows(items1, nth, 8), ch2 = (chunk_rows(H, nth, 16) + 1) / 2 * 2;
        PHASE_MARK(tid, nth, 0);
        /* phase 0: zero out[T, H]; x -> fp32 (4-bit formats: permuted) */
        const int64_t t0 = (int64_t)T * tid / nth, t1 = (int64_t)T * (tid + 1) / nth;
        memset(out + t0 * H, 0, (size_t)(t1 - t0) * H * 4);
        for (int64_t t = t0; t < t1; ++t)
            for (int k = 0; k < H; ++k) {
                const float v = hidden_is_bf16 ? bf16_to_f32(((const uint16_t *)hidden)[t * H + k])
                                               : ((const float *)hidden)[t * H + k];
                xq[t * H + (perm ? perm4_pos(k, H) : k)] = v;
            }
        for (int64_t t = t0; i8 && t < t1; ++t) q8_quantize_row(xq + t * H, H, fmt, G, x8 + t * x8s);
        const int64_t first1 = (int64_t)tid * ch1, end1 = first1 + ch1 < items1 ? first1 + ch1 : items1;
        if (first1 < end1) {                   /* this thread's first gate / up rows, while the others finish */
            int g = 0;
            while (first1 >= g_item[g + 1]) ++g;
            const uint8_t *e = base + (int64_t)g_expert[g] * expert_stride_bytes;
            const qmat gm = quant_mat(qf, e, H, I, 0), um = quant_mat(qf, e, H, I, 1);
            const int i = (int)(first1 - g_item[g]), n = (int)((end1 < g_item[g + 1] ? end1 : g_item[g + 1]) - first1);
            prefetch_rows(&gm, i, n, fmt);
            prefetch_rows(&um, i, n, fmt);
        }
        PHASE_MARK(tid, nth, 1);
        #pragma omp barrier
        PHASE_MARK(tid, nth, 2);

        /* phase 1: h = act(gate . x, up . x) (silu: silu(g) * u), this thread's chunks of row pairs (a thread's
           chunks come in rising order, so its expert index g1 only moves forward) */
        float ra[TOKEN_CHUNK], rb[TOKEN_CHUNK];
        int g1 = 0, mat_g = -1;
        qmat gate_m, up_m;
        for (int64_t c0 = first1; c0 < items1; c0 = next_chunk(nth, ch1, &taken1)) {
          const int64_t c1 = c0 + ch1 < items1 ? c0 + ch1 : items1;
          for (int64_t item = c0; item < c1; ++item) {
            while (item >= g_item[g1 + 1]) ++g1;
            const int g = g1, i = (int)(item - g_item[g]), B = g_start[g + 1] - g_start[g];
            const uint8_t *e = base + (int64_t)g_expert[g] * expert_stride_bytes;
            if (g != mat_g) {
                gate_m = quant_mat(qf, e, H, I, 0); up_m = quant_mat(qf, e, H, I, 1); mat_g = g;
                if (c1 > g_item[g + 1]) {      /* the chunk goes on into the next expert: its first rows */
                    const uint8_t *e1 = base + (int64_t)g_expert[g + 1] * expert_stride_bytes;
                    const qmat gm = quant_mat(qf, e1, H, I, 0), um = quant_mat(qf, e1, H, I, 1);
                    const int n = (int)((c1 < g_item[g + 2] ? c1 : g_item[g + 2]) - g_item[g + 1]);
                    prefetch_rows(&gm, 0, n, fmt);
                    prefetch_rows(&um, 0, n, fmt);
                }
            }
            const qrow gate = qmat_row(&gate_m, i, fmt), up = qmat_row(&up_m, i, fmt);
            float *h = hbuf + (int64_t)g_start[g] * I;
            const int pos = perm ? perm4_pos(i, I) : i;
            const float bg = ft_bias(act, e, i), bu = ft_bias(act, e, (int64_t)I + i);
            for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
                const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
#if defined(__x86_64__)
                if (i8) dot8_rows(fmt, G, &gate, &up, H, x8, x8s, stok + g_start[g] + b0, nb, ra, rb);
                else
#endif
                dotq_rows(isa, fmt, G, &gate, &up, H, xq, H, stok + g_start[g] + b0, nb, ra, rb);
                ft_gate_rows(act, ra, rb, nb, bg, bu);                    /* ra = h */
                for (int b = 0; b < nb; ++b) h[(int64_t)(b0 + b) * I + pos] = ra[b];
            }
          }
        }
        /* phase 2's first chunk: this thread's rows tid * ch2 .. of every expert's down matrix */
        const int64_t first2 = (int64_t)tid * ch2;
        if (ng > 0 && first2 < H) {            /* the first expert's, while the others finish phase 1 */
            const qmat dm = quant_mat(qf, base + (int64_t)g_expert[0] * expert_stride_bytes, H, I, 2);
            prefetch_rows(&dm, (int)first2, (int)(first2 + ch2 < H ? ch2 : H - first2), fmt);
        }
        PHASE_MARK(tid, nth, 3);
        #pragma omp barrier
        PHASE_MARK(tid, nth, 4);
        if (i8) {                              /* h quantized, a row's first g_lim values (a split: c) */
            int g = 0;
            for (int r = (int)((int64_t)n * tid / nth), r1 = (int)((int64_t)n * (tid + 1) / nth); r < r1; ++r) {
                while (r >= g_start[g + 1]) ++g;
                q8_quantize_row(hbuf + (int64_t)r * I, g_lim[g], fmt, G, h8 + r * h8s);
            }
            PHASE_MARK(tid, nth, 5);
            #pragma omp barrier
        } else {
            PHASE_MARK(tid, nth, 5);
        }
        PHASE_MARK(tid, nth, 6);

        /* phase 2: out[tok, j] += w * (down_j[:lim] . h + b_down[j]), this thread's chunks of rows j, every group
           in order for each row */
        for (int64_t r0 = first2; r0 < H; r0 = next_chunk(nth, ch2, &taken2)) {
          const int j0 = (int)r0, j1 = (int)(r0 + ch2 < H ? r0 + ch2 : H);
          for (int g = 0; g < ng; ++g) {
            const int start = g_start[g], B = g_start[g + 1] - start, K = g_lim[g];
            const uint8_t *e = base + (int64_t)g_expert[g] * expert_stride_bytes;
            const float *h = hbuf + (int64_t)start * I;
            const qmat down_m = quant_mat(qf, e, H, I, 2);
            if (g + 1 < ng) {                  /* the next expert's rows, one expert ahead */
                const qmat next = quant_mat(qf, base + (int64_t)g_expert[g + 1] * expert_stride_bytes, H, I, 2);
                prefetch_rows(&next, j0, j1 - j0, fmt);
            }
            for (int j = j0; j < j1; j += 2) {
                const int pair = j + 1 < j1;                 /* odd tail: the second row repeats the first */
                const qrow da = qmat_row(&down_m, j, fmt), db = qmat_row(&down_m, j + pair, fmt);
                const float ba = ft_bias(act, e, 2 * (int64_t)I + j), bb = ft_bias(act, e, 2 * (int64_t)I + j + pair);
                for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
                    const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
#if defined(__x86_64__)
                    if (i8) dot8_rows(fmt, G, &da, &db, K, h8 + (start + b0) * h8s, h8s, iota, nb, ra, rb);
                    else
#endif
                    dotq_rows(isa, fmt, G, &da, &db, K, h + (int64_t)b0 * I, I, iota, nb, ra, rb);
                    for (int b = 0; b < nb; ++b) {
                        float *o = out + (int64_t)stok[start + b0 + b] * H + j;
                        o[0] += swt[start + b0 + b] * (ra[b] + ba);
                        if (pair) o[1] += swt[start + b0 + b] * (rb[b] + bb);
                    }
                }
            }
          }
        }
        PHASE_MARK(tid, nth, 7);
    }
    pthread_mutex_unlock(&q_lock);
    PHASE_CALL(1);
    if (stats_out) {
        stats_out[0] = ng;
        int64_t bytes = 0;
        const int64_t whole = ft_act_biased(act)   /* weights, padding and biases: never split */
            ? act->bias_offset + (2 * (int64_t)I + H) * ft_bias_item(act->bias_dtype) : qf->expert_bytes;
        for (int g = 0; g < ng; ++g) bytes += g_lim[g] == I ? whole : qf->expert_bytes * g_lim[g] / I;
        stats_out[1] = bytes;
    }
    return 0;
}

/* Dequantize rows [row0, row0 + nrows) of matrix m (0 gate, 1 up, 2 down) of the expert at expert_base into
   out [nrows, K] fp32, in element order, with the decoders of `isa` that the dot products use (tests compare
   them bit for bit with kernels/expert_reference.py's dequantize_matrix). */
int ft_dequantize_rows(const ft_quant_format *qf, int isa, const void *expert_base, int H, int I, int m, int row0,
                       int nrows, float *out) {
    if (isa < ISA_SCALAR || isa > ft_best_isa()) return ERR_BAD_ISA;
    if (ft_quant_format_check(qf, H, I, qf ? qf->expert_bytes : 0)) return ERR_BAD_FORMAT;
    const int K = m == 2 ? I : H, rows = m == 2 ? H : I;
    if (m < 0 || m > 2 || row0 < 0 || nrows < 0 || row0 + nrows > rows) return ERR_BAD_ARGS;
    const int fmt = (int)qf->format, G = (int)qf->group_size;
    if (isa > ISA_AVX512) isa = ISA_AVX512;
    for (int r = row0; r < row0 + nrows; ++r) {
        const qrow q = quant_row(qf, (const uint8_t *)expert_base, H, I, m, r);
        float *o = out + (int64_t)(r - row0) * K;
        int k = 0;
#if defined(__x86_64__)
        float tmp[CHUNK];
        if (isa == ISA_AVX512) dequant_row_avx512(fmt, G, &q, K, o, tmp);
        else if (isa == ISA_AVX2) dequant_row_avx2(fmt, G, &q, K, o, tmp);
        if (isa != ISA_SCALAR) continue;
#endif
        if (fmt == FMT_FP8) {
            for (; k < K; ++k) o[k] = fp8_weight(&q, k);
        } else {
            float t[16];
            for (; k < K; k += 2) {
                table16(fmt, &q, k / G, t);
                o[k] = t[q.codes[k / 2] & 15];
                o[k + 1] = t[q.codes[k / 2] >> 4];
            }
        }
    }
    return 0;
}

/* The int8 path's quantized activations (a test hook): rows [B, K] fp32 -> dst [B, q8_row_bytes] by the layer's
   quantizer (plain = 0) or by q8_quantize_row_ref (plain = 1), for fmt (FMT_INT4 / MXFP4 / NVFP4) weights in groups
   of G. Returns the row's bytes (B = 0: only that), or a negative error. */
int64_t ft_quant_q8_rows(const float *x, int K, int fmt, int G, int B, int plain, uint8_t *dst) {
    if (K <= 0 || B < 0 || (fmt != FMT_INT4 && fmt != FMT_MXFP4 && fmt != FMT_NVFP4)
        || (G != 16 && G != 32 && G != 64 && G != 128)) return ERR_BAD_ARGS;
    if (!plain && !ft_quant_int8_available()) return ERR_BAD_ISA;
    const int64_t xs = q8_row_bytes(K, fmt, G);
    for (int b = 0; b < B; ++b) {
        if (plain) q8_quantize_row_ref(x + (int64_t)b * K, K, fmt, G, dst + b * xs);
        else q8_quantize_row(x + (int64_t)b * K, K, fmt, G, dst + b * xs);
    }
    return xs;
}

/* Test hook of the int8 path (tests/cpu_expert_pool/test_cpu_pool_int8.py): out[b, r - row0] = row r of matrix m
   (0 gate, 1 up, 2 down) . x[b] over the matrix's K, x [B, K] fp32 quantized by q8_quantize_row, rows taken in pairs
   as the layer takes them (an odd last row paired with itself). */
int ft_quant_dot_i8(const ft_quant_format *qf, const void *expert_base, int H, int I, int m, int row0, int nrows,
                    const float *x, int B, float *out) {
    if (!ft_quant_int8_available()) return ERR_BAD_ISA;
    if (ft_quant_format_check(qf, H, I, qf ? qf->expert_bytes : 0) || qf->format == FMT_FP8) return ERR_BAD_FORMAT;
    const int K = m == 2 ? I : H, rows = m == 2 ? H : I, fmt = (int)qf->format, G = (int)qf->group_size;
    if (m < 0 || m > 2 || row0 < 0 || nrows < 0 || row0 + nrows > rows || B <= 0 || B > TOKEN_CHUNK)
        return ERR_BAD_ARGS;
    const int64_t xs = q8_row_bytes(K, fmt, G);
    uint8_t *xq = (uint8_t *)aligned_alloc(ALIGN_BYTES, align_up((size_t)(B * xs)));
    if (!xq) return ERR_NO_MEMORY;
    for (int b = 0; b < B; ++b) q8_quantize_row(x + (int64_t)b * K, K, fmt, G, xq + b * xs);
#if defined(__x86_64__)
    int32_t idx[TOKEN_CHUNK];
    float ra[TOKEN_CHUNK], rb[TOKEN_CHUNK];
    for (int b = 0; b < B; ++b) idx[b] = b;
    for (int r = row0; r < row0 + nrows; r += 2) {
        const int pair = r + 1 < row0 + nrows;
        const qrow a = quant_row(qf, (const uint8_t *)expert_base, H, I, m, r);
        const qrow c = quant_row(qf, (const uint8_t *)expert_base, H, I, m, r + pair);
        dot8_rows(fmt, G, &a, &c, K, xq, xs, idx, B, ra, rb);
        for (int b = 0; b < B; ++b) {
            out[(int64_t)b * nrows + r - row0] = ra[b];
            if (pair) out[(int64_t)b * nrows + r + 1 - row0] = rb[b];
        }
    }
#endif
    free(xq);
    return 0;
}
