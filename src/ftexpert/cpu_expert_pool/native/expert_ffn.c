/* CPU expert FFN for one MoE layer: out[t] = sum_k w_k * down(silu(gate(x_t)) * up(x_t)), or with an activation
 * descriptor (expert_act.h) gpt-oss's experts: the clamped SwiGLU over the biased gate / up, plus the down bias.
 *
 * Weights are read in place from the expert store: per expert, w13 [2I, H] (gate rows, then up
 * rows) followed by w2 [H, I], bf16, HF [out, in] layout. Triples (token, expert, weight) are grouped
 * by expert (counting sort), so each expert's bytes are read once per call however many tokens use it.
 *
 * Biases (with a descriptor) sit after w2 in the row, bf16 (the store's compute dtype). The activation and the
 * biases are applied per row of tokens (ft_gate_rows); a NULL descriptor runs the silu loops of old.
 *
 * Split expert: at most one expert per call (split_expert) may be computed over a prefix of its
 * intermediate channels only, [0, split_limit) (the GPU computes the rest and adds the partial sums):
 * its gate/up rows [0, c) and down columns [0, c). split_limit 0: no split. Per group g, lim_g = c or I.
 *
 * Threads (OpenMP, one team): phase 0 zeroes out[T, H] and converts x; phase 1 splits the
 * gate/up rows [0, lim_g) of all groups into contiguous ranges (h = act(g, u)); phase 2 splits the H
 * output rows, each thread adding every group's contribution to its own rows (no atomics, no races).
 *
 * ISAs, chosen at run time (ft_best_isa): 4 AMX-BF16 tiles for experts with >= AMX_MIN_TOKENS
 * tokens (16 weight rows x 16 tokens per tile multiply), AVX-512 BF16 for the others; 3 AVX-512 BF16
 * (_mm512_dpbf16_ps); both round x and h to bf16 and accumulate in fp32. 2 AVX-512F, 1 AVX2+FMA
 * (bf16 weights widened to fp32, fp32 x and h); 0 portable C. Built without -march: only functions
 * with a target attribute use those units.
 *
 * Legend: T tokens, H hidden, I intermediate, E experts, n triples, G experts used, B tokens of one,
 * c split_limit.
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3, ISA_AMX_BF16 = 4 };
enum { ERR_BAD_TOKEN = -1, ERR_BAD_EXPERT = -2, ERR_NO_MEMORY = -3, ERR_BAD_ISA = -4, ERR_BAD_ARGS = -5,
       ERR_BAD_ACT = -7 };
#define TOKEN_CHUNK 256   /* tokens of one expert handled per pass over a weight row pair */
#define TILE 16           /* AMX: rows of a tile, tokens of a tile, K pairs of a tile */
#define TILE_K 32         /* AMX: bf16 elements of K per tile multiply */
#define AMX_MIN_TOKENS 4  /* experts with fewer tokens use the AVX-512 BF16 dot products */
#define ALIGN_BYTES 64
#define SPLIT_CHANNEL_UNIT 32  /* split_limit granularity (proto/shm_layout.py); a multiple of TILE_K */

/* ---------------------------------------------------------------- bf16 helpers */
static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {            /* round to nearest even, NaN kept quiet */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---------------------------------------------------------------- CPU features */
static int amx_permitted(void) {                 /* Linux: a process must ask before using AMX tiles */
#if defined(__x86_64__) && defined(SYS_arch_prctl)
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return 0;
#endif
}

int ft_best_isa(void) {
    static int best = -1;
    if (best >= 0) return best;
    best = ISA_SCALAR;
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16"))
        best = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") && amx_permitted()
               ? ISA_AMX_BF16 : ISA_AVX512_BF16;
    else if (avx512) best = ISA_AVX512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = ISA_AVX2;
#endif
    return best;
}

#include "expert_act.h"
#include "expert_dots.h"

/* ---------------------------------------------------------------- scratch (grow-only, per process) */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
typedef struct { void *ptr; size_t bytes; } buffer;
static buffer g_meta = {NULL, 0};     /* the sort and per-group offsets */
static buffer g_work = {NULL, 0};     /* converted x, h, packed x */

static size_t align_up(size_t v) { return (v + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }

static void *reserve(buffer *b, size_t nbytes) {    /* contents are not kept when it grows */
    if (nbytes <= b->bytes && b->ptr) return b->ptr;
    free(b->ptr);
    b->bytes = 0;
    b->ptr = aligned_alloc(ALIGN_BYTES, align_up(nbytes ? nbytes : 1));
    if (b->ptr) b->bytes = align_up(nbytes ? nbytes : 1);
    return b->ptr;
}

/* ---------------------------------------------------------------- the layer call */
/* Phase-1 rows i0 .. i0+nrows of group g, dot-product path: h[b][i] row-major (row stride I) for the
   group's tokens; w13 is the expert's first byte (its biases: act). */
static void phase1_rows_dot(int isa, int use_bf16, const ft_expert_act *act, const uint16_t *w13, int H, int I,
                            int i0, int nrows, const void *x, const int32_t *toks, int B, void *h, float *ra,
                            float *rb) {
    for (int i = i0; i < i0 + nrows; ++i) {
        const uint16_t *gate = w13 + (int64_t)i * H, *up = w13 + (int64_t)(I + i) * H;
        const float bg = ft_bias(act, w13, i), bu = ft_bias(act, w13, (int64_t)I + i);
        for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
            const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
            if (use_bf16) dot2_rows_bf16(gate, up, H, (const uint16_t *)x, H, toks + b0, nb, ra, rb);
            else dot2_rows_f32(isa, gate, up, H, (const float *)x, H, toks + b0, nb, ra, rb);
            ft_gate_rows(act, ra, rb, nb, bg, bu);                      /* ra = h */
            if (use_bf16)
                for (int b = 0; b < nb; ++b) ((uint16_t *)h)[(int64_t)(b0 + b) * I + i] = f32_to_bf16(ra[b]);
            else
                for (int b = 0; b < nb; ++b) ((float *)h)[(int64_t)(b0 + b) * I + i] = ra[b];
        }
    }
}

/* Phase-2 rows j0 .. j1 of one group, dot-product path: out[tok][j] += w * (down_j[:K] . h[:K] + b_down[j]); I is
   the row stride of down and of h, K <= I the channels used (lim_g); expert: its first byte (the biases). */
static void phase2_rows_dot(int isa, int use_bf16, const ft_expert_act *act, const void *expert, const uint16_t *w2,
                            int H, int I, int K, int j0, int j1, const void *h, const int32_t *toks, const float *wts,
                            int B, const int32_t *iota, float *out, float *ra, float *rb) {
    for (int j = j0; j < j1; j += 2) {
        const int pair = j + 1 < j1;                    /* odd tail: the second row repeats the first */
        const uint16_t *wa = w2 + (int64_t)j * I, *wb = w2 + (int64_t)(j + pair) * I;
        const float ba = ft_bias(act, expert, 2 * (int64_t)I + j), bb = ft_bias(act, expert, 2 * (int64_t)I + j + pair);
        for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
            const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
            if (use_bf16)
                dot2_rows_bf16(wa, wb, K, (const uint16_t *)h + (int64_t)b0 * I, I, iota, nb, ra, rb);
            else
                dot2_rows_f32(isa, wa, wb, K, (const float *)h + (int64_t)b0 * I, I, iota, nb, ra, rb);
            for (int b = 0; b < nb; ++b) {
                float *o = out + (int64_t)toks[b0 + b] * H + j;
                o[0] += wts[b0 + b] * (ra[b] + ba);
                if (pair) o[1] += wts[b0 + b] * (rb[b] + bb);
            }
        }
    }
}

/* Returns 0, or a negative ERR_*. stats_out[0] = experts used (G), stats_out[1] = weight bytes read.
   split_limit 0: no split (split_expert ignored); else 0 < split_limit < I, a multiple of
   SPLIT_CHANNEL_UNIT, and 0 <= split_expert < E (ERR_BAD_ARGS otherwise; a biased expert is never split).
   act: the activation and biases (expert_act.h; NULL: silu without biases), ERR_BAD_ACT if it does not fit. */
int ft_moe_layer(int isa, int num_threads,
                 const void *layer_base, int64_t expert_stride_bytes, int num_experts, int H, int I,
                 const void *hidden, int hidden_is_bf16, int T,
                 const int32_t *tok, const int32_t *expert, const float *weight, int n,
                 float *out, int64_t *stats_out, int split_expert, int split_limit, const ft_expert_act *act) {
    if (isa < ISA_SCALAR || isa > ft_best_isa()) return ERR_BAD_ISA;
    if (H <= 0 || I <= 0 || T < 0 || n < 0 || num_experts <= 0 || num_threads <= 0) return ERR_BAD_ARGS;
    if (ft_act_check(act, H, I, expert_stride_bytes)) return ERR_BAD_ACT;
    if (split_limit != 0 && ft_act_biased(act)) return ERR_BAD_ARGS;
    if (split_limit != 0 && (split_limit < 0 || split_limit >= I || split_limit % SPLIT_CHANNEL_UNIT != 0
                             || split_expert < 0 || split_expert >= num_experts)) return ERR_BAD_ARGS;
    for (int k = 0; k < n; ++k) {
        if (tok[k] < 0 || tok[k] >= T) return ERR_BAD_TOKEN;
        if (expert[k] < 0 || expert[k] >= num_experts) return ERR_BAD_EXPERT;
    }
    /* AMX needs whole tiles: K (H for gate/up, I for down) in 32s, rows in 16s. */
    const int amx = isa == ISA_AMX_BF16 && H % TILE_K == 0 && I % TILE_K == 0;
    const int use_bf16 = isa >= ISA_AVX512_BF16;
    const int need_x = use_bf16 ? !hidden_is_bf16 : hidden_is_bf16;   /* convert x into scratch? */
    const size_t xitem = use_bf16 ? 2 : 4;

    pthread_mutex_lock(&g_lock);
    /* counting sort of the triples by expert (stable), in a small first scratch area */
    const size_t meta_bytes = align_up((size_t)(num_experts + 1) * 4) + 2 * align_up((size_t)n * 4)
                              + 6 * align_up((size_t)(n + 1) * 8) + align_up((size_t)n * 4);
    uint8_t *s = (uint8_t *)reserve(&g_meta, meta_bytes);
    if (!s) { pthread_mutex_unlock(&g_lock); return ERR_NO_MEMORY; }
    int32_t *counts = (int32_t *)s;
    int32_t *g_expert = (int32_t *)(s + align_up((size_t)(num_experts + 1) * 4));
    int32_t *g_start = g_expert + align_up((size_t)(n + 1) * 8) / 4;
    int64_t *g_hoff = (int64_t *)(g_start + align_up((size_t)(n + 1) * 8) / 4);   /* h offset (elements) */
    int64_t *g_xoff = g_hoff + align_up((size_t)(n + 1) * 8) / 8;                 /* packed-x offset, -1: none */
    int64_t *g_item = g_xoff + align_up((size_t)(n + 1) * 8) / 8;                 /* phase-1 items before g */
    int32_t *g_lim = (int32_t *)(g_item + align_up((size_t)(n + 1) * 8) / 8);     /* channels of g: c or I */
    int32_t *stok = g_lim + align_up((size_t)(n + 1) * 8) / 4;
    float *swt = (float *)(stok + align_up((size_t)n * 4) / 4);
    int32_t *iota = (int32_t *)(swt + align_up((size_t)n * 4) / 4);
    memset(counts, 0, (size_t)(num_experts + 1) * 4);
    for (int k = 0; k < n; ++k) counts[expert[k] + 1]++;
    int G = 0;
    for (int e = 0; e < num_experts; ++e) {
        if (counts[e + 1]) {
            g_expert[G] = e; g_start[G] = counts[e];
            g_lim[G] = split_limit > 0 && e == split_expert ? split_limit : I;
            ++G;
        }
        counts[e + 1] += counts[e];
    }
    g_start[G] = n;
    for (int k = 0; k < n; ++k) {
        int pos = counts[expert[k]]++;
        stok[pos] = tok[k];
        swt[pos] = weight[k];
    }
    for (int k = 0; k < n; ++k) iota[k] = k;
    /* per group: h rows (padded to whole 16-token tiles for AMX groups) and packed x (AMX groups only) */
    int64_t h_elems = 0, xv_elems = 0;
    for (int g = 0; g < G; ++g) {
        const int B = g_start[g + 1] - g_start[g];
        const int tiles = amx && B >= AMX_MIN_TOKENS ? (B + TILE - 1) / TILE : 0;
        g_hoff[g] = h_elems;
        h_elems += tiles ? (int64_t)tiles * TILE * I : (int64_t)B * I;
        g_xoff[g] = tiles ? xv_elems : -1;
        xv_elems += (int64_t)tiles * TILE * H;
    }
    const size_t off_h = align_up(need_x ? (size_t)T * H * xitem : 0);
    const size_t off_xv = align_up(off_h + (size_t)h_elems * xitem);
    uint8_t *w = (uint8_t *)reserve(&g_work, off_xv + (size_t)xv_elems * 2);
    if (!w) { pthread_mutex_unlock(&g_lock); return ERR_NO_MEMORY; }
    void *xconv = w, *hbuf = w + off_h;
    uint16_t *xv = (uint16_t *)(w + off_xv);

    const uint8_t *base = (const uint8_t *)layer_base;
    const int64_t w2_off_elems = (int64_t)2 * I * H;
    const int rows_per_item = amx ? TILE : 1;                  /* phase-1 work item: a block of row pairs */
    g_item[0] = 0;                                             /* lim_g is a multiple of 32: whole items */
    for (int g = 0; g < G; ++g) g_item[g + 1] = g_item[g] + g_lim[g] / rows_per_item;
    const int64_t items1 = g_item[G];
    const int row_blocks2 = amx ? H / TILE : H;                /* phase-2 partition unit */

    #pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#if defined(__x86_64__)
        if (amx) amx_configure();
#endif
        /* phase 0: zero out[T, H], convert x where the ISA wants the other format */
        int64_t t0 = (int64_t)T * tid / nth, t1 = (int64_t)T * (tid + 1) / nth;
        memset(out + t0 * H, 0, (size_t)(t1 - t0) * H * 4);
        if (need_x) {
            for (int64_t i = t0 * H; i < t1 * H; ++i) {
                if (use_bf16) ((uint16_t *)xconv)[i] = f32_to_bf16(((const float *)hidden)[i]);
                else ((float *)xconv)[i] = bf16_to_f32(((const uint16_t *)hidden)[i]);
            }
        }
        const void *x = need_x ? xconv : hidden;
        #pragma omp barrier
        if (amx) {   /* phase 0b: pack x of AMX groups, tile by tile: xv[kk][n] (bf16 pairs) = x[tok n][kk] */
            #pragma omp for schedule(static)
            for (int g = 0; g < G; ++g) {
                if (g_xoff[g] < 0) continue;
                const int B = g_start[g + 1] - g_start[g];
                for (int tb = 0; tb < B; tb += TILE) {
                    uint32_t *dst = (uint32_t *)(xv + g_xoff[g] + (int64_t)tb * H);
                    for (int nn = 0; nn < TILE; ++nn) {
                        const uint32_t *src = tb + nn < B ? (const uint32_t *)((const uint16_t *)x
                                              + (int64_t)stok[g_start[g] + tb + nn] * H) : NULL;
                        for (int kk = 0; kk < H / 2; ++kk) dst[(int64_t)kk * TILE + nn] = src ? src[kk] : 0;
                    }
                }
            }   /* implicit barrier */
        }

        /* phase 1: h = act(gate . x, up . x) (silu: silu(g) * u) for this thread's work items */
        float ra[TOKEN_CHUNK], rb[TOKEN_CHUNK];
        int g1 = 0;                                             /* group of the current item */
        for (int64_t item = items1 * tid / nth, end1 = items1 * (tid + 1) / nth; item < end1; ++item) {
            while (item >= g_item[g1 + 1]) ++g1;                /* items in order: the group only advances */
            const int g = g1;
            const int i0 = (int)(item - g_item[g]) * rows_per_item;
            const int B = g_start[g + 1] - g_start[g];
            const uint16_t *w13 = (const uint16_t *)(base + (int64_t)g_expert[g] * expert_stride_bytes);
            void *h = (uint8_t *)hbuf + g_hoff[g] * xitem;
#if defined(__x86_64__)
            if (g_xoff[g] >= 0) {
                float cg[TILE * TILE], cu[TILE * TILE];
                for (int tb = 0; tb < B; tb += TILE) {
                    amx_two_blocks(w13 + (int64_t)i0 * H, w13 + (int64_t)(I + i0) * H, H, H,
                                   xv + g_xoff[g] + (int64_t)tb * H, cg, cu);
                    uint16_t *hv = (uint16_t *)h + (int64_t)tb * I;          /* hv[i/2][n][i%2] */
                    for (int r = 0; r < TILE; ++r)                           /* cg = h, row by row */
                        ft_gate_rows(act, cg + r * TILE, cu + r * TILE, TILE, ft_bias(act, w13, i0 + r),
                                     ft_bias(act, w13, (int64_t)I + i0 + r));
                    for (int r = 0; r < TILE; ++r)
                        for (int nn = 0; nn < TILE; ++nn) {
                            const float v = tb + nn < B ? cg[r * TILE + nn] : 0.0f;
                            hv[((int64_t)((i0 + r) / 2) * TILE + nn) * 2 + ((i0 + r) & 1)] = f32_to_bf16(v);
                        }
                }
                continue;
            }
#endif
            phase1_rows_dot(isa, use_bf16, act, w13, H, I, i0, rows_per_item, x, stok + g_start[g], B, h, ra, rb);
        }
        #pragma omp barrier

        /* phase 2: out[tok, j] += w * (down_j . h) for this thread's rows j, every group */
        const int j0 = (int)((int64_t)row_blocks2 * tid / nth) * (amx ? TILE : 1);
        const int j1 = (int)((int64_t)row_blocks2 * (tid + 1) / nth) * (amx ? TILE : 1);
        for (int g = 0; g < G; ++g) {
            const int start = g_start[g], B = g_start[g + 1] - start, K = g_lim[g];
            const uint8_t *expert_g = base + (int64_t)g_expert[g] * expert_stride_bytes;
            const uint16_t *w2 = (const uint16_t *)expert_g + w2_off_elems;
            const void *h = (const uint8_t *)hbuf + g_hoff[g] * xitem;
#if defined(__x86_64__)
            if (g_xoff[g] >= 0) {
                float c0[TILE * TILE], c1[TILE * TILE], bd[2 * TILE];
                for (int j = j0; j < j1; j += 2 * TILE) {
                    const int two = j + TILE < j1;               /* a lone last block computes itself twice */
                    for (int r = 0; r < 2 * TILE; ++r)           /* the blocks' down biases (0 without) */
                        bd[r] = ft_bias(act, expert_g, 2 * (int64_t)I + j + (r < TILE || two ? r : r - TILE));
                    for (int tb = 0; tb < B; tb += TILE) {
                        amx_two_blocks(w2 + (int64_t)j * I, w2 + (int64_t)(j + (two ? TILE : 0)) * I, I, K,
                                       (const uint16_t *)h + (int64_t)tb * I, c0, c1);
                        for (int nn = 0; nn < TILE && tb + nn < B; ++nn) {
                            float *o = out + (int64_t)stok[start + tb + nn] * H + j;
                            const float wt = swt[start + tb + nn];
                            for (int r = 0; r < TILE; ++r) o[r] += wt * (c0[r * TILE + nn] + bd[r]);
                            if (two)
                                for (int r = 0; r < TILE; ++r) o[TILE + r] += wt * (c1[r * TILE + nn] + bd[TILE + r]);
                        }
                    }
                }
                continue;
            }
#endif
            phase2_rows_dot(isa, use_bf16, act, expert_g, w2, H, I, K, j0, j1, h, stok + start, swt + start, B, iota,
                            out, ra, rb);
        }
#if defined(__x86_64__)
        if (amx) amx_release();
#endif
    }
    pthread_mutex_unlock(&g_lock);
    if (stats_out) {
        stats_out[0] = G;
        int64_t channels = 0;                                   /* sum of lim_g: only those rows are read */
        for (int g = 0; g < G; ++g) channels += g_lim[g];
        stats_out[1] = 3 * channels * H * 2;
        if (ft_act_biased(act))                                 /* never split: every group reads its biases */
            stats_out[1] += G * (2 * (int64_t)I + H) * ft_bias_item(act->bias_dtype);
    }
    return 0;
}

