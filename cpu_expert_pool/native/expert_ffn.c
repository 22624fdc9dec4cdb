/* CPU expert FFN for one MoE layer: out[t] = sum_k w_k * down(silu(gate(x_t)) * up(x_t)).
 *
 * Weights are read in place from the expert store: per expert, w13 [2I, H] (gate rows, then up
 * rows) followed by w2 [H, I], bf16, HF [out, in] layout. Triples (token, expert, weight) are grouped
 * by expert (counting sort), so each expert's bytes are read once per call however many tokens use it.
 *
 * Split expert: at most one expert per call (split_expert) may be computed over a prefix of its
 * intermediate channels only, [0, split_limit) (the GPU computes the rest and adds the partial sums):
 * its gate/up rows [0, c) and down columns [0, c). split_limit 0: no split. Per group g, lim_g = c or I.
 *
 * Threads (OpenMP, one team): phase 0 zeroes out[T, H] and converts x; phase 1 splits the
 * gate/up rows [0, lim_g) of all groups into contiguous ranges (h = silu(g) * u); phase 2 splits the H
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
enum { ERR_BAD_TOKEN = -1, ERR_BAD_EXPERT = -2, ERR_NO_MEMORY = -3, ERR_BAD_ISA = -4, ERR_BAD_ARGS = -5 };
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
static inline float silu(float g) { return g / (1.0f + expf(-g)); }

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

/* ---------------------------------------------------------------- AMX tiles
 * Tiles: 0, 1 accumulators C [16 rows][16 tokens] fp32; 2, 3 weights A [16 rows][32 K] bf16, loaded
 * straight from the store (row stride = the row length); 4 activations B [16 K pairs][16 tokens x 2]
 * bf16 in the "VNNI" layout: B[kk][n][p] = x[n][2 kk + p], packed once per call. */
#if defined(__x86_64__)
#define T_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

/* A global, not a stack struct: GCC 12 does not see ldtilecfg read its operand and drops the stores. */
static const tile_config TILE_CONFIG = {1, 0, {0}, {64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
                                        {TILE, TILE, TILE, TILE, TILE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}};

T_AMX static void amx_configure(void) { _tile_loadconfig(&TILE_CONFIG); }
T_AMX static void amx_release(void) { _tile_release(); }

/* c0 [16][16] = A(wa rows) . B, c1 = A(wb rows) . B over K (a multiple of 32); row strides in elements. */
T_AMX static void amx_two_blocks(const uint16_t *wa, const uint16_t *wb, int64_t wstride, int K,
                                 const uint16_t *bv, float *c0, float *c1) {
    _tile_zero(0);
    _tile_zero(1);
    for (int k = 0; k < K; k += TILE_K) {
        _tile_loadd(2, wa + k, wstride * 2);
        _tile_loadd(3, wb + k, wstride * 2);
        _tile_loadd(4, bv + (int64_t)(k / 2) * TILE * 2, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
}
#endif

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
   group's tokens. */
static void phase1_rows_dot(int isa, int use_bf16, const uint16_t *w13, int H, int I, int i0, int nrows,
                            const void *x, const int32_t *toks, int B, void *h, float *ra, float *rb) {
    for (int i = i0; i < i0 + nrows; ++i) {
        const uint16_t *gate = w13 + (int64_t)i * H, *up = w13 + (int64_t)(I + i) * H;
        for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
            const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
            if (use_bf16) {
                dot2_rows_bf16(gate, up, H, (const uint16_t *)x, H, toks + b0, nb, ra, rb);
                for (int b = 0; b < nb; ++b)
                    ((uint16_t *)h)[(int64_t)(b0 + b) * I + i] = f32_to_bf16(silu(ra[b]) * rb[b]);
            } else {
                dot2_rows_f32(isa, gate, up, H, (const float *)x, H, toks + b0, nb, ra, rb);
                for (int b = 0; b < nb; ++b) ((float *)h)[(int64_t)(b0 + b) * I + i] = silu(ra[b]) * rb[b];
            }
        }
    }
}

/* Phase-2 rows j0 .. j1 of one group, dot-product path: out[tok][j] += w * (down_j[:K] . h[:K]); I is the
   row stride of down and of h, K <= I the channels used (lim_g). */
static void phase2_rows_dot(int isa, int use_bf16, const uint16_t *w2, int H, int I, int K, int j0, int j1,
                            const void *h, const int32_t *toks, const float *wts, int B, const int32_t *iota,
                            float *out, float *ra, float *rb) {
    for (int j = j0; j < j1; j += 2) {
        const int pair = j + 1 < j1;                    /* odd tail: the second row repeats the first */
        const uint16_t *wa = w2 + (int64_t)j * I, *wb = w2 + (int64_t)(j + pair) * I;
        for (int b0 = 0; b0 < B; b0 += TOKEN_CHUNK) {
            const int nb = B - b0 < TOKEN_CHUNK ? B - b0 : TOKEN_CHUNK;
            if (use_bf16)
                dot2_rows_bf16(wa, wb, K, (const uint16_t *)h + (int64_t)b0 * I, I, iota, nb, ra, rb);
            else
                dot2_rows_f32(isa, wa, wb, K, (const float *)h + (int64_t)b0 * I, I, iota, nb, ra, rb);
            for (int b = 0; b < nb; ++b) {
                float *o = out + (int64_t)toks[b0 + b] * H + j;
                o[0] += wts[b0 + b] * ra[b];
                if (pair) o[1] += wts[b0 + b] * rb[b];
            }
        }
    }
}

/* Returns 0, or a negative ERR_*. stats_out[0] = experts used (G), stats_out[1] = weight bytes read.
   split_limit 0: no split (split_expert ignored); else 0 < split_limit < I, a multiple of
   SPLIT_CHANNEL_UNIT, and 0 <= split_expert < E (ERR_BAD_ARGS otherwise). */
int ft_moe_layer(int isa, int num_threads,
                 const void *layer_base, int64_t expert_stride_bytes, int num_experts, int H, int I,
                 const void *hidden, int hidden_is_bf16, int T,
                 const int32_t *tok, const int32_t *expert, const float *weight, int n,
                 float *out, int64_t *stats_out, int split_expert, int split_limit) {
    if (isa < ISA_SCALAR || isa > ft_best_isa()) return ERR_BAD_ISA;
    if (H <= 0 || I <= 0 || T < 0 || n < 0 || num_experts <= 0 || num_threads <= 0) return ERR_BAD_ARGS;
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

        /* phase 1: h = silu(gate . x) * (up . x) for this thread's work items */
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
                    for (int r = 0; r < TILE; ++r)
                        for (int nn = 0; nn < TILE; ++nn) {
                            const float v = tb + nn < B ? silu(cg[r * TILE + nn]) * cu[r * TILE + nn] : 0.0f;
                            hv[((int64_t)((i0 + r) / 2) * TILE + nn) * 2 + ((i0 + r) & 1)] = f32_to_bf16(v);
                        }
                }
                continue;
            }
#endif
            phase1_rows_dot(isa, use_bf16, w13, H, I, i0, rows_per_item, x, stok + g_start[g], B, h, ra, rb);
        }
        #pragma omp barrier

        /* phase 2: out[tok, j] += w * (down_j . h) for this thread's rows j, every group */
        const int j0 = (int)((int64_t)row_blocks2 * tid / nth) * (amx ? TILE : 1);
        const int j1 = (int)((int64_t)row_blocks2 * (tid + 1) / nth) * (amx ? TILE : 1);
        for (int g = 0; g < G; ++g) {
            const int start = g_start[g], B = g_start[g + 1] - start, K = g_lim[g];
            const uint16_t *w2 = (const uint16_t *)(base + (int64_t)g_expert[g] * expert_stride_bytes) + w2_off_elems;
            const void *h = (const uint8_t *)hbuf + g_hoff[g] * xitem;
#if defined(__x86_64__)
            if (g_xoff[g] >= 0) {
                float c0[TILE * TILE], c1[TILE * TILE];
                for (int j = j0; j < j1; j += 2 * TILE) {
                    const int two = j + TILE < j1;               /* a lone last block computes itself twice */
                    for (int tb = 0; tb < B; tb += TILE) {
                        amx_two_blocks(w2 + (int64_t)j * I, w2 + (int64_t)(j + (two ? TILE : 0)) * I, I, K,
                                       (const uint16_t *)h + (int64_t)tb * I, c0, c1);
                        for (int nn = 0; nn < TILE && tb + nn < B; ++nn) {
                            float *o = out + (int64_t)stok[start + tb + nn] * H + j;
                            const float wt = swt[start + tb + nn];
                            for (int r = 0; r < TILE; ++r) o[r] += wt * c0[r * TILE + nn];
                            if (two) for (int r = 0; r < TILE; ++r) o[TILE + r] += wt * c1[r * TILE + nn];
                        }
                    }
                }
                continue;
            }
#endif
            phase2_rows_dot(isa, use_bf16, w2, H, I, K, j0, j1, h, stok + start, swt + start, B, iota, out, ra, rb);
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
