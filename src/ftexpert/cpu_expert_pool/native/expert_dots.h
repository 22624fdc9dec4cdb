/* The dot-product and AMX tile kernels of expert_ffn.c (its only includer, after its bf16 helpers and constants):
 * static inline code, one translation unit. */
#ifndef FT_EXPERT_DOTS_H
#define FT_EXPERT_DOTS_H

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

/* One token reads two rows as streams (the next rows follow them in the store); the hardware prefetcher restarts at
   every 4 KiB page, so each new line of a row asks for the line BF16_PREFETCH_AHEAD bytes ahead (quant_dots.h does
   the same for the quantized rows). */
#define BF16_PREFETCH_AHEAD 2048
#define PREFETCH_ROWS(wa, wb, k)                 /* k: an element index, at most 32 apart each call */         \
    if (((k) & 31) == 0) {                                                                                      \
        _mm_prefetch((const char *)((wa) + (k)) + BF16_PREFETCH_AHEAD, _MM_HINT_T0);                            \
        _mm_prefetch((const char *)((wb) + (k)) + BF16_PREFETCH_AHEAD, _MM_HINT_T0);                            \
    }

/* One token: two chains per row, so four independent chains in flight. */
T_AVX2 static void dot2_avx2_1(const uint16_t *wa, const uint16_t *wb, int K, const float *xbase, int64_t xs,
                               const int32_t *idx, float *ra, float *rb) {
    const float *x = xbase + (int64_t)idx[0] * xs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        PREFETCH_ROWS(wa, wb, k)
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
        PREFETCH_ROWS(wa, wb, k)
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
        PREFETCH_ROWS(wa, wb, k)
        PREFETCH_ROWS(wa, wb, k + 32)
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

#endif /* FT_EXPERT_DOTS_H */
