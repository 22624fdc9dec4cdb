/* CPU expert FFN for one MoE layer: out[t] = sum_k w_k * down(silu(gate(x_t)) * up(x_t)).
 *
 * Weights are read in place from the expert store: per expert, w13 [2I, H] (gate rows, then up
 * rows) followed by w2 [H, I], bf16, HF [out, in] layout. Triples (token, expert, weight) are grouped
 * by expert (counting sort), so each expert's bytes are read once per call however many tokens use it.
 *
 * Threads (OpenMP, one team): phase 0 zeroes out[T, H] and converts x; phase 1 splits the
 * gate/up rows of all groups into contiguous ranges (h = silu(g) * u); phase 2 splits the H output
 * rows, each thread adding every group's contribution to its own rows (no atomics, no races).
 *
 * ISAs, chosen at run time (ft_best_isa): 3 AVX-512 BF16 (_mm512_dpbf16_ps; x and h rounded to
 * bf16, fp32 accumulation), 2 AVX-512F, 1 AVX2+FMA (bf16 weights widened to fp32, fp32 x and h),
 * 0 portable C. Built without -march: only the functions with a target attribute use those units.
 *
 * Legend: T tokens, H hidden, I intermediate, E experts, n triples, G experts used, B tokens of one.
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_BF16 = 3 };
enum { ERR_BAD_TOKEN = -1, ERR_BAD_EXPERT = -2, ERR_NO_MEMORY = -3, ERR_BAD_ISA = -4, ERR_BAD_ARGS = -5 };
#define TOKEN_CHUNK 256   /* tokens of one expert handled per pass over a weight row pair */
#define ALIGN_BYTES 64

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
static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* ---------------------------------------------------------------- CPU features */
int ft_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl");
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return ISA_AVX512_BF16;
    if (avx512) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

/* ---------------------------------------------------------------- dot products
 * Two weight rows at once against NB tokens: ra[b] = wa . x_b, rb[b] = wb . x_b, x_b = xbase + idx[b] * xs
 * (elements). Sharing each x load between two rows halves the loads per multiply-add, so batched
 * calls are limited by the FMA units, not the load ports; at NB = 1 it gives 4 independent chains.
 */
typedef void (*dot2_f32_fn)(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, int64_t xs,
                            const int32_t *idx, float *ra, float *rb);
typedef void (*dot2_bf16_fn)(const uint16_t *wa, const uint16_t *wb, int K, const uint16_t *xbase,
                             int64_t xs, const int32_t *idx, float *ra, float *rb);

static void dot2_scalar(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, int64_t xs,
                        const int32_t *idx, int nb, float *ra, float *rb) {
    for (int b = 0; b < nb; ++b) {
        const float *x = xbase + (int64_t)idx[b] * xs;
        float a0 = 0, a1 = 0, b0 = 0, b1 = 0;
        int k = 0;
        for (; k + 2 <= K; k += 2) {
            a0 += bf16_to_f32(wa[k]) * x[k];
            a1 += bf16_to_f32(wa[k + 1]) * x[k + 1];
            b0 += bf16_to_f32(wb[k]) * x[k];
            b1 += bf16_to_f32(wb[k + 1]) * x[k + 1];
        }
        if (k < K) { a0 += bf16_to_f32(wa[k]) * x[k]; b0 += bf16_to_f32(wb[k]) * x[k]; }
        ra[b] = a0 + a1;
        rb[b] = b0 + b1;
    }
}

#if defined(__x86_64__)
#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define T_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define NB_AVX2 4         /* 16 ymm registers: 2 x 4 accumulators + operands */
#define NB_AVX512 8       /* 32 zmm registers: 2 x 8 accumulators + operands */

T_AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
T_AVX2 static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
T_AVX512 static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
T_AVX512 static inline __m512 widen16_masked(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#define BH(v) ((__m512bh)(v))

#define DEFINE_DOT2_AVX2(NB)                                                                       \
T_AVX2 static void dot2_avx2_##NB(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, \
                                  int64_t xs, const int32_t *idx, float *ra, float *rb) {          \
    const float *x[NB]; __m256 aa[NB], ab[NB]; float ta[NB], tb[NB];                               \
    for (int b = 0; b < NB; ++b) {                                                                 \
        x[b] = xbase + (int64_t)idx[b] * xs; aa[b] = ab[b] = _mm256_setzero_ps(); ta[b] = tb[b] = 0; \
    }                                                                                              \
    int k = 0;                                                                                     \
    for (; k + 8 <= K; k += 8) {                                                                   \
        __m256 va = widen8(wa + k), vb = widen8(wb + k);                                           \
        for (int b = 0; b < NB; ++b) {                                                             \
            __m256 xv = _mm256_loadu_ps(x[b] + k);                                                 \
            aa[b] = _mm256_fmadd_ps(va, xv, aa[b]); ab[b] = _mm256_fmadd_ps(vb, xv, ab[b]);        \
        }                                                                                          \
    }                                                                                              \
    for (; k < K; ++k)                                                                             \
        for (int b = 0; b < NB; ++b) { ta[b] += bf16_to_f32(wa[k]) * x[b][k]; tb[b] += bf16_to_f32(wb[k]) * x[b][k]; } \
    for (int b = 0; b < NB; ++b) { ra[b] = hsum256(aa[b]) + ta[b]; rb[b] = hsum256(ab[b]) + tb[b]; } \
}
#define DEFINE_DOT2_AVX512(NB)                                                                     \
T_AVX512 static void dot2_avx512_##NB(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, \
                                      int64_t xs, const int32_t *idx, float *ra, float *rb) {      \
    const float *x[NB]; __m512 aa[NB], ab[NB];                                                     \
    for (int b = 0; b < NB; ++b) { x[b] = xbase + (int64_t)idx[b] * xs; aa[b] = ab[b] = _mm512_setzero_ps(); } \
    int k = 0;                                                                                     \
    for (; k + 16 <= K; k += 16) {                                                                 \
        __m512 va = widen16(wa + k), vb = widen16(wb + k);                                         \
        for (int b = 0; b < NB; ++b) {                                                             \
            __m512 xv = _mm512_loadu_ps(x[b] + k);                                                 \
            aa[b] = _mm512_fmadd_ps(va, xv, aa[b]); ab[b] = _mm512_fmadd_ps(vb, xv, ab[b]);        \
        }                                                                                          \
    }                                                                                              \
    if (k < K) {                                                                                   \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                            \
        __m512 va = widen16_masked(wa + k, m), vb = widen16_masked(wb + k, m);                     \
        for (int b = 0; b < NB; ++b) {                                                             \
            __m512 xv = _mm512_maskz_loadu_ps(m, x[b] + k);                                        \
            aa[b] = _mm512_fmadd_ps(va, xv, aa[b]); ab[b] = _mm512_fmadd_ps(vb, xv, ab[b]);        \
        }                                                                                          \
    }                                                                                              \
    for (int b = 0; b < NB; ++b) { ra[b] = _mm512_reduce_add_ps(aa[b]); rb[b] = _mm512_reduce_add_ps(ab[b]); } \
}
#define DEFINE_DOT2_BF16(NB)                                                                       \
T_BF16 static void dot2_bf16_##NB(const uint16_t *wa, const uint16_t *wb, int K, const uint16_t *xbase, \
                                  int64_t xs, const int32_t *idx, float *ra, float *rb) {          \
    const uint16_t *x[NB]; __m512 aa[NB], ab[NB];                                                  \
    for (int b = 0; b < NB; ++b) { x[b] = xbase + (int64_t)idx[b] * xs; aa[b] = ab[b] = _mm512_setzero_ps(); } \
    int k = 0;                                                                                     \
    for (; k + 32 <= K; k += 32) {                                                                 \
        __m512i va = _mm512_loadu_si512(wa + k), vb = _mm512_loadu_si512(wb + k);                  \
        for (int b = 0; b < NB; ++b) {                                                             \
            __m512i xv = _mm512_loadu_si512(x[b] + k);                                             \
            aa[b] = _mm512_dpbf16_ps(aa[b], BH(va), BH(xv)); ab[b] = _mm512_dpbf16_ps(ab[b], BH(vb), BH(xv)); \
        }                                                                                          \
    }                                                                                              \
    if (k < K) {                                                                                   \
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);                                          \
        __m512i va = _mm512_maskz_loadu_epi16(m, wa + k), vb = _mm512_maskz_loadu_epi16(m, wb + k); \
        for (int b = 0; b < NB; ++b) {                                                             \
            __m512i xv = _mm512_maskz_loadu_epi16(m, x[b] + k);                                    \
            aa[b] = _mm512_dpbf16_ps(aa[b], BH(va), BH(xv)); ab[b] = _mm512_dpbf16_ps(ab[b], BH(vb), BH(xv)); \
        }                                                                                          \
    }                                                                                              \
    for (int b = 0; b < NB; ++b) { ra[b] = _mm512_reduce_add_ps(aa[b]); rb[b] = _mm512_reduce_add_ps(ab[b]); } \
}
DEFINE_DOT2_AVX2(2) DEFINE_DOT2_AVX2(3) DEFINE_DOT2_AVX2(4)
DEFINE_DOT2_AVX512(2) DEFINE_DOT2_AVX512(3) DEFINE_DOT2_AVX512(4) DEFINE_DOT2_AVX512(5)
DEFINE_DOT2_AVX512(6) DEFINE_DOT2_AVX512(7) DEFINE_DOT2_AVX512(8)
DEFINE_DOT2_BF16(2) DEFINE_DOT2_BF16(3) DEFINE_DOT2_BF16(4) DEFINE_DOT2_BF16(5) DEFINE_DOT2_BF16(6)
DEFINE_DOT2_BF16(7) DEFINE_DOT2_BF16(8)

/* One token: two chains per row, so four independent chains in flight. */
T_AVX2 static void dot2_avx2_1(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, int64_t xs,
                               const int32_t *idx, float *ra, float *rb) {
    const float *x = xbase + (int64_t)idx[0] * xs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        a0 = _mm256_fmadd_ps(widen8(wa + k), x0, a0); a1 = _mm256_fmadd_ps(widen8(wa + k + 8), x1, a1);
        b0 = _mm256_fmadd_ps(widen8(wb + k), x0, b0); b1 = _mm256_fmadd_ps(widen8(wb + k + 8), x1, b1);
    }
    float ta = 0, tb = 0;
    for (; k < K; ++k) { ta += bf16_to_f32(wa[k]) * x[k]; tb += bf16_to_f32(wb[k]) * x[k]; }
    ra[0] = hsum256(_mm256_add_ps(a0, a1)) + ta;
    rb[0] = hsum256(_mm256_add_ps(b0, b1)) + tb;
}
T_AVX512 static void dot2_avx512_1(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase,
                                   int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const float *x = xbase + (int64_t)idx[0] * xs;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
        a0 = _mm512_fmadd_ps(widen16(wa + k), x0, a0); a1 = _mm512_fmadd_ps(widen16(wa + k + 16), x1, a1);
        b0 = _mm512_fmadd_ps(widen16(wb + k), x0, b0); b1 = _mm512_fmadd_ps(widen16(wb + k + 16), x1, b1);
    }
    for (; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1);
        __m512 x0 = _mm512_maskz_loadu_ps(m, x + k);
        a0 = _mm512_fmadd_ps(widen16_masked(wa + k, m), x0, a0);
        b0 = _mm512_fmadd_ps(widen16_masked(wb + k, m), x0, b0);
    }
    ra[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    rb[0] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}
T_BF16 static void dot2_bf16_1(const uint16_t *wa, const uint16_t *wb, int K, const uint16_t *xbase,
                               int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const uint16_t *x = xbase + (int64_t)idx[0] * xs;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i x0 = _mm512_loadu_si512(x + k), x1 = _mm512_loadu_si512(x + k + 32);
        a0 = _mm512_dpbf16_ps(a0, BH(_mm512_loadu_si512(wa + k)), BH(x0));
        a1 = _mm512_dpbf16_ps(a1, BH(_mm512_loadu_si512(wa + k + 32)), BH(x1));
        b0 = _mm512_dpbf16_ps(b0, BH(_mm512_loadu_si512(wb + k)), BH(x0));
        b1 = _mm512_dpbf16_ps(b1, BH(_mm512_loadu_si512(wb + k + 32)), BH(x1));
    }
    for (; k < K; k += 32) {
        __mmask32 m = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (K - k)) - 1);
        __m512i x0 = _mm512_maskz_loadu_epi16(m, x + k);
        a0 = _mm512_dpbf16_ps(a0, BH(_mm512_maskz_loadu_epi16(m, wa + k)), BH(x0));
        b0 = _mm512_dpbf16_ps(b0, BH(_mm512_maskz_loadu_epi16(m, wb + k)), BH(x0));
    }
    ra[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    rb[0] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}

static const dot2_f32_fn DOT2_AVX2[NB_AVX2 + 1] = {0, dot2_avx2_1, dot2_avx2_2, dot2_avx2_3, dot2_avx2_4};
static const dot2_f32_fn DOT2_AVX512[NB_AVX512 + 1] = {0, dot2_avx512_1, dot2_avx512_2, dot2_avx512_3,
    dot2_avx512_4, dot2_avx512_5, dot2_avx512_6, dot2_avx512_7, dot2_avx512_8};
static const dot2_bf16_fn DOT2_BF16[NB_AVX512 + 1] = {0, dot2_bf16_1, dot2_bf16_2, dot2_bf16_3, dot2_bf16_4,
    dot2_bf16_5, dot2_bf16_6, dot2_bf16_7, dot2_bf16_8};
#endif /* __x86_64__ */

/* ra[b], rb[b] for every b < B, in register blocks of tokens (the two weight rows stay in L1). */
static inline void dot2_rows_f32(int isa, const uint16_t *wa, const uint16_t *wb, int K, const float *xbase,
                                 int64_t xs, const int32_t *idx, int B, float *ra, float *rb) {
#if defined(__x86_64__)
    if (isa == ISA_AVX512 || isa == ISA_AVX2) {
        const dot2_f32_fn *table = isa == ISA_AVX512 ? DOT2_AVX512 : DOT2_AVX2;
        const int block = isa == ISA_AVX512 ? NB_AVX512 : NB_AVX2;
        for (int b0 = 0; b0 < B; b0 += block) {
            int nb = B - b0 < block ? B - b0 : block;
            table[nb](wa, wb, K, xbase, xs, idx + b0, ra + b0, rb + b0);
        }
        return;
    }
#endif
    dot2_scalar(wa, wb, K, xbase, xs, idx, B, ra, rb);
}

static inline void dot2_rows_bf16(const uint16_t *wa, const uint16_t *wb, int K, const uint16_t *xbase,
                                  int64_t xs, const int32_t *idx, int B, float *ra, float *rb) {
#if defined(__x86_64__)
    for (int b0 = 0; b0 < B; b0 += NB_AVX512) {
        int nb = B - b0 < NB_AVX512 ? B - b0 : NB_AVX512;
        DOT2_BF16[nb](wa, wb, K, xbase, xs, idx + b0, ra + b0, rb + b0);
    }
#else
    (void)wa; (void)wb; (void)K; (void)xbase; (void)xs; (void)idx; (void)B; (void)ra; (void)rb;
#endif
}

/* ---------------------------------------------------------------- scratch (grow-only, per process) */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_scratch = NULL;
static size_t g_scratch_bytes = 0;

static size_t align_up(size_t v) { return (v + ALIGN_BYTES - 1) / ALIGN_BYTES * ALIGN_BYTES; }

static void *scratch(size_t nbytes) {
    if (nbytes <= g_scratch_bytes) return g_scratch;
    free(g_scratch);
    g_scratch_bytes = 0;
    g_scratch = aligned_alloc(ALIGN_BYTES, align_up(nbytes));
    if (g_scratch) g_scratch_bytes = align_up(nbytes);
    return g_scratch;
}

/* ---------------------------------------------------------------- the layer call */
/* Returns 0, or a negative ERR_*. stats_out[0] = experts used (G), stats_out[1] = weight bytes read. */
int ft_moe_layer(int isa, int num_threads,
                 const void *layer_base, int64_t expert_stride_bytes, int num_experts, int H, int I,
                 const void *hidden, int hidden_is_bf16, int T,
                 const int32_t *tok, const int32_t *expert, const float *weight, int n,
                 float *out, int64_t *stats_out) {
    if (isa < ISA_SCALAR || isa > ft_best_isa()) return ERR_BAD_ISA;
    if (H <= 0 || I <= 0 || T < 0 || n < 0 || num_experts <= 0 || num_threads <= 0) return ERR_BAD_ARGS;
    for (int k = 0; k < n; ++k) {
        if (tok[k] < 0 || tok[k] >= T) return ERR_BAD_TOKEN;
        if (expert[k] < 0 || expert[k] >= num_experts) return ERR_BAD_EXPERT;
    }
    const int use_bf16 = isa == ISA_AVX512_BF16;
    const int need_x = use_bf16 ? !hidden_is_bf16 : hidden_is_bf16;   /* convert x into scratch? */
    const size_t xitem = use_bf16 ? 2 : 4;

    pthread_mutex_lock(&g_lock);
    /* scratch: counts [E+1] | stok [n] | swt [n] | g_expert [G] | g_start [G+1] | iota [n] | x [T,H] | h [n,I] */
    size_t off_counts = 0;
    size_t off_stok = align_up(off_counts + (size_t)(num_experts + 1) * 4);
    size_t off_swt = align_up(off_stok + (size_t)n * 4);
    size_t off_gexp = align_up(off_swt + (size_t)n * 4);
    size_t off_gstart = align_up(off_gexp + (size_t)n * 4);
    size_t off_iota = align_up(off_gstart + (size_t)(n + 1) * 4);
    size_t off_x = align_up(off_iota + (size_t)n * 4);
    size_t off_h = align_up(off_x + (need_x ? (size_t)T * H * xitem : 0));
    size_t total = align_up(off_h + (size_t)n * I * xitem);
    uint8_t *s = (uint8_t *)scratch(total);
    if (!s) { pthread_mutex_unlock(&g_lock); return ERR_NO_MEMORY; }
    int32_t *counts = (int32_t *)(s + off_counts), *stok = (int32_t *)(s + off_stok);
    float *swt = (float *)(s + off_swt);
    int32_t *g_expert = (int32_t *)(s + off_gexp), *g_start = (int32_t *)(s + off_gstart);
    int32_t *iota = (int32_t *)(s + off_iota);
    void *xconv = s + off_x, *hbuf = s + off_h;

    /* counting sort of the triples by expert (stable) */
    memset(counts, 0, (size_t)(num_experts + 1) * 4);
    for (int k = 0; k < n; ++k) counts[expert[k] + 1]++;
    int G = 0;
    for (int e = 0; e < num_experts; ++e) {
        if (counts[e + 1]) { g_expert[G] = e; g_start[G] = counts[e]; ++G; }
        counts[e + 1] += counts[e];
    }
    g_start[G] = n;
    for (int k = 0; k < n; ++k) {
        int pos = counts[expert[k]]++;
        stok[pos] = tok[k];
        swt[pos] = weight[k];
    }
    for (int k = 0; k < n; ++k) iota[k] = k;

    const uint8_t *base = (const uint8_t *)layer_base;
    const int64_t w2_off_elems = (int64_t)2 * I * H;
    const int64_t rows1 = (int64_t)G * I;           /* phase-1 work items: (group, gate/up row pair) */

    #pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
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

        /* phase 1: h[row, i] = silu(gate_i . x) * (up_i . x) for every (group, i) in this thread's range */
        float ra[TOKEN_CHUNK], rb[TOKEN_CHUNK];
        int g = 0;
        for (int64_t r = rows1 * tid / nth, r1 = rows1 * (tid + 1) / nth; r < r1; ++r) {
            while ((int64_t)(g + 1) * I <= r) ++g;
            const int i = (int)(r - (int64_t)g * I);
            const int B = g_start[g + 1] - g_start[g];
            const uint16_t *w13 = (const uint16_t *)(base + (int64_t)g_expert[g] * expert_stride_bytes);
            const uint16_t *gate = w13 + (int64_t)i * H, *up = w13 + (int64_t)(I + i) * H;
            const int32_t *toks = stok + g_start[g];
            for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
                const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
                const int64_t hrow = (int64_t)(g_start[g] + b0) * I + i;
                if (use_bf16) {
                    dot2_rows_bf16(gate, up, H, (const uint16_t *)x, H, toks + b0, nb, ra, rb);
                    for (int b = 0; b < nb; ++b) ((uint16_t *)hbuf)[hrow + (int64_t)b * I] = f32_to_bf16(silu(ra[b]) * rb[b]);
                } else {
                    dot2_rows_f32(isa, gate, up, H, (const float *)x, H, toks + b0, nb, ra, rb);
                    for (int b = 0; b < nb; ++b) ((float *)hbuf)[hrow + (int64_t)b * I] = silu(ra[b]) * rb[b];
                }
            }
        }
        #pragma omp barrier

        /* phase 2: out[tok, j] += w * (down_j . h) for this thread's rows j (two at a time), every group */
        const int j0 = (int)((int64_t)H * tid / nth), j1 = (int)((int64_t)H * (tid + 1) / nth);
        for (int gg = 0; gg < G; ++gg) {
            const int start = g_start[gg], B = g_start[gg + 1] - start;
            const uint16_t *w2 = (const uint16_t *)(base + (int64_t)g_expert[gg] * expert_stride_bytes) + w2_off_elems;
            for (int j = j0; j < j1; j += 2) {
                const int pair = j + 1 < j1;                    /* odd tail: the second row repeats the first */
                const uint16_t *wa = w2 + (int64_t)j * I, *wb = w2 + (int64_t)(j + pair) * I;
                for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
                    const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
                    if (use_bf16)
                        dot2_rows_bf16(wa, wb, I, (const uint16_t *)hbuf + (int64_t)(start + b0) * I, I, iota, nb, ra, rb);
                    else
                        dot2_rows_f32(isa, wa, wb, I, (const float *)hbuf + (int64_t)(start + b0) * I, I, iota, nb, ra, rb);
                    for (int b = 0; b < nb; ++b) {
                        float *o = out + (int64_t)stok[start + b0 + b] * H + j;
                        const float wt = swt[start + b0 + b];
                        o[0] += wt * ra[b];
                        if (pair) o[1] += wt * rb[b];
                    }
                }
            }
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (stats_out) {
        stats_out[0] = G;
        stats_out[1] = (int64_t)G * (3 * (int64_t)I * H) * 2;
    }
    return 0;
}

/* ---------------------------------------------------------------- threads and bandwidth */
/* Pin OpenMP thread i of a team of n to cpus[i]; libgomp keeps the team, so the pinning persists. */
int ft_pin_threads(const int32_t *cpus, int n) {
    int failures = 0;
    #pragma omp parallel num_threads(n) reduction(+ : failures)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        failures += pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0;
    }
    return failures;
}

/* Stream-read nbytes (a multiple of 64) with n threads; returns a checksum so nothing is elided. */
#if defined(__x86_64__)
T_AVX2 static uint64_t read_avx2(const uint8_t *p, int64_t lines, int num_threads) {
    uint64_t total = 0;
    #pragma omp parallel num_threads(num_threads) reduction(^ : total)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
        int64_t i = lines * tid / nth, end = lines * (tid + 1) / nth;
        for (; i + 2 <= end; i += 2) {
            const __m256i *q = (const __m256i *)(p + i * 64);
            a = _mm256_xor_si256(a, _mm256_loadu_si256(q));
            b = _mm256_xor_si256(b, _mm256_loadu_si256(q + 1));
            c = _mm256_xor_si256(c, _mm256_loadu_si256(q + 2));
            d = _mm256_xor_si256(d, _mm256_loadu_si256(q + 3));
        }
        for (; i < end; ++i) a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(p + i * 64)));
        __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, x);
        total ^= lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    }
    return total;
}
#endif

uint64_t ft_read_bytes(const void *p, int64_t nbytes, int num_threads) {
#if defined(__x86_64__)
    if (ft_best_isa() >= ISA_AVX2) return read_avx2((const uint8_t *)p, nbytes / 64, num_threads);
#endif
    const uint64_t *q = (const uint64_t *)p;
    const int64_t words = nbytes / 8;
    uint64_t total = 0;
    #pragma omp parallel for num_threads(num_threads) reduction(^ : total) schedule(static)
    for (int64_t i = 0; i < words; i += 8) {
        total ^= q[i] ^ q[i + 1] ^ q[i + 2] ^ q[i + 3] ^ q[i + 4] ^ q[i + 5] ^ q[i + 6] ^ q[i + 7];
    }
    return total;
}
