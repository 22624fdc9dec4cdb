/* int8 activations for the 4-bit formats (int4, mxfp4, nvfp4): integer dot products on AVX-512 VNNI (vpdpbusd).
 * Included by quant_ffn.c after quant_dots.h; chosen per store by ft_quant_format.act_int8
 * (cpu_expert_pool/expert_kernel.py's act_quant setting, docs/QUANTIZATION.md "CPU activations").
 *
 * Activations: blocks of Q8_BLOCK = 16 consecutive values (k = 16 j .. 16 j + 15 of a row) share one fp32 scale
 * s = amax / 127, and each value is q = rint(x * (127 / amax)) in [-127, 127] (0 for a zero block). Weights: the
 * 4-bit codes as unsigned bytes (vpdpbusd multiplies unsigned by signed bytes):
 *   int4   u            in [0, 15]   (u the code; the group's zero point z comes out once a row, below)
 *   fp4    2 v + 12     in [0, 24]   (v the e2m1 value: 2 v is one of 0, 1, 2, 3, 4, 6, 8, 12 or its negative;
 *                                    one vpshufb of the code)
 * A block lies in one weight group (the groups are 16, 32, 64 or 128 values), so a row . x = sum over blocks of
 * group_scale * s * (integer dot), times 1/2 for fp4. fp4's offset comes back out through the block's sum of q:
 * each row of quantized activations carries -12 * sum(q) for every block, the dot products' starting value. int4's
 * zero point through the group's sum S_g = sum over its blocks of s * sum(q) (fp32): row . x = sum over blocks of
 * scale_g * s * (u . q) - sum over groups of scale_g * z_g * S_g, the second sum one 16-wide multiply-add per 16
 * groups of a row and token (the rows of int4 activations carry S_g for the row's ceil(K / G) groups).
 *
 * Layout of a quantized row: super-blocks of Q8_SB = 256 values (16 blocks, one an int32 lane), Q8_SB_BYTES each:
 * 4 vectors of 64 q bytes, then the 16 int32 corrections (int4: 0), then the 16 fp32 scales; int4 then S_g, padded
 * with zeros to a multiple of 16 floats. Byte (2 p + h) * 64 + 4 l + i
 * holds value 16 l + 8 p + 2 i + h: lane l of vector 2 p + h meets the low (h = 0) or high nibbles of the row's
 * code bytes 8 l + 4 p .. + 3, which one vpermt2d of the super-block's 128 code bytes puts there.
 * A row's tail (K not a multiple of 256) is zero: zero codes times zero activations, zero scales.
 */
#ifndef FT_QUANT_INT8_H
#define FT_QUANT_INT8_H

#define Q8_BLOCK 16
#define Q8_SB 256
#define Q8_SB_BYTES 384

static inline int q8_groups(int K, int G) { return (K + G - 1) / G; }
static inline int64_t q8_sb_bytes(int K) { return (int64_t)((K + Q8_SB - 1) / Q8_SB) * Q8_SB_BYTES; }
/* Bytes of a quantized row of K values for `fmt` weights in groups of G (int4: S_g after the super-blocks). */
static inline int64_t q8_row_bytes(int K, int fmt, int G) {
    return q8_sb_bytes(K) + (fmt == FMT_INT4 ? (int64_t)(q8_groups(K, G) + 15) / 16 * 64 : 0);
}

/* x [K] fp32 (element order) -> dst [q8_row_bytes(K, fmt, G)] for a row of `fmt` weights in groups of G: the plain
   one, value by value (the reference of q8_quantize_row_512, byte for byte: ft_quant_q8_rows). */
static void q8_quantize_row_ref(const float *x, int K, int fmt, int G, uint8_t *dst) {
    const int off = fmt == FMT_INT4 ? 0 : 12;
    float *S = (float *)(dst + q8_sb_bytes(K));                          /* int4: the groups' sums */
    if (fmt == FMT_INT4) memset(S, 0, (size_t)(q8_groups(K, G) + 15) / 16 * 64);
    for (int k0 = 0; k0 < K; k0 += Q8_SB, dst += Q8_SB_BYTES) {
        int8_t *q = (int8_t *)dst;
        int32_t nc[16];
        float sx[16];
        memset(q, 0, Q8_SB);
        for (int l = 0; l < 16; ++l) {
            const int b0 = k0 + Q8_BLOCK * l, n = K - b0 <= 0 ? 0 : K - b0 < Q8_BLOCK ? K - b0 : Q8_BLOCK;
            float amax = 0.0f;
            for (int e = 0; e < n; ++e) amax = fmaxf(amax, fabsf(x[b0 + e]));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int e = 0; e < n; ++e) {
                const float r = rintf(x[b0 + e] * inv);                /* nearest, ties to even */
                const int v = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
                q[((e >> 3) * 2 + (e & 1)) * 64 + 4 * l + ((e >> 1) & 3)] = (int8_t)v;
                sum += v;
            }
            nc[l] = -off * sum;
            sx[l] = amax / 127.0f;
            if (fmt == FMT_INT4 && n > 0) S[b0 / G] = fmaf(sx[l], (float)sum, S[b0 / G]);   /* one rounding */
        }
        memcpy(dst + Q8_SB, nc, sizeof nc);
        memcpy(dst + Q8_SB + 64, sx, sizeof sx);
    }
}

#if defined(__x86_64__)
#if defined(FT_EMULATE_AVX512)
#define T_VNNI
#else
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif
/* 2 v + 12 for the 16 e2m1 codes (FP4_LUT's order) */
static const uint8_t FP4_X2_U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
static const int32_t EVEN_DWORDS[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};

static inline uint64_t mask64(int n) { return n >= 64 ? ~0ull : n <= 0 ? 0ull : (1ull << n) - 1; }

/* The 16 lane scales of super-block s of a row of K values (lane l: values 256 s + 16 l .., in group
   (256 s + 16 l) / G; lanes past K's last group: 0; a split row's K may end inside a group: its lanes past K meet
   zero codes and zero activations). */
T_VNNI INLINE_Q __m512 q8_scales(int fmt, int G, const qrow *r, int s, int K) {
    const int shift = G == 16 ? 0 : G == 32 ? 1 : G == 64 ? 2 : 3;          /* lanes a group: 1 << shift */
    const int g0 = s * (Q8_SB / G), left = q8_groups(K, G) - g0, n = left < (16 >> shift) ? left : (16 >> shift);
    const __mmask16 m = mask16(n);
    const __m512i lane_group = _mm512_srli_epi32(_mm512_loadu_si512(IOTA16), shift);
    __m512 sg;                                                                  /* groups g0 .. g0 + n - 1 */
    if (fmt == FMT_INT4) {
        sg = _mm512_maskz_loadu_ps(m, r->fscales + g0);
    } else {
        float s16[16];
        fp4_scales16_512(fmt, r, g0, g0 + n, s16);
        sg = _mm512_maskz_mov_ps(m, _mm512_loadu_ps(s16));
    }
    return _mm512_permutexvar_ps(lane_group, sg);
}

/* int4: scale_g * z_g for the row's groups g .. g + 15 (0 from its ceil(K / G)-th on). */
T_VNNI INLINE_Q __m512 q8_zero_scales(const qrow *r, int g, int ng) {
    const __mmask16 m = mask16(ng - g);
    const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, r->zeros + g)));
    return _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r->fscales + g), z);
}

/* Super-block s's weights as the unsigned integers above, in the activations' byte order (w[4]). */
T_VNNI INLINE_Q void q8_weights(int fmt, const qrow *r, int s, int K, __m512i *w) {
    const uint8_t *c = r->codes + (int64_t)s * (Q8_SB / 2);
    const int nbytes = (K - s * Q8_SB) / 2;
    __m512i in0, in1;
    if (nbytes >= 128) {
        in0 = _mm512_loadu_si512(c);
        in1 = _mm512_loadu_si512(c + 64);
    } else {
        in0 = _mm512_maskz_loadu_epi8(mask64(nbytes), c);
        in1 = _mm512_maskz_loadu_epi8(mask64(nbytes - 64), c + 64);
    }
    const __m512i even = _mm512_loadu_si512(EVEN_DWORDS), odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i d0 = _mm512_permutex2var_epi32(in0, even, in1), d1 = _mm512_permutex2var_epi32(in0, odd, in1);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    w[0] = _mm512_and_si512(d0, nib);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(d0, 4), nib);
    w[2] = _mm512_and_si512(d1, nib);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(d1, 4), nib);
    if (fmt != FMT_INT4) {
        const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FP4_X2_U8));
        for (int v = 0; v < 4; ++v) w[v] = _mm512_shuffle_epi8(lut, w[v]);
    }
}

/* q8_quantize_row_ref's bytes with a block of 16 values a vector: the same fp32 operations (127 / amax, x times it
   rounded to nearest even by vcvtps2dq, whose default rounding rintf's is; amax / 127; int4's group sums in the same
   order, each term by fmaf, which a build may not contract differently), a block's 16 bytes put in place by one
   vpshufb and four 4-byte stores. */
static const uint8_t Q8_BLOCK_ORDER[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
T_VNNI static void q8_quantize_row_512(const float *x, int K, int fmt, int G, uint8_t *dst) {
    const int off = fmt == FMT_INT4 ? 0 : 12;
    float *S = (float *)(dst + q8_sb_bytes(K));
    if (fmt == FMT_INT4) memset(S, 0, (size_t)(q8_groups(K, G) + 15) / 16 * 64);
    const __m128i order = _mm_loadu_si128((const __m128i *)Q8_BLOCK_ORDER);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int k0 = 0; k0 < K; k0 += Q8_SB, dst += Q8_SB_BYTES) {
        int32_t nc[16];
        float sx[16];
        for (int l = 0; l < 16; ++l) {
            const int b0 = k0 + Q8_BLOCK * l, n = K - b0 <= 0 ? 0 : K - b0 < Q8_BLOCK ? K - b0 : Q8_BLOCK;
            const __m512 v = _mm512_maskz_loadu_ps(mask16(n), x + (n > 0 ? b0 : 0));
            const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
            r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
            uint8_t b[16];
            _mm_storeu_si128((__m128i *)b, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(r), order));
            for (int p = 0; p < 4; ++p) memcpy(dst + p * 64 + 4 * l, b + 4 * p, 4);
            const int sum = _mm512_reduce_add_epi32(r);
            nc[l] = -off * sum;
            sx[l] = amax / 127.0f;
            if (fmt == FMT_INT4 && n > 0) S[b0 / G] = fmaf(sx[l], (float)sum, S[b0 / G]);   /* one rounding */
        }
        memcpy(dst + Q8_SB, nc, sizeof nc);
        memcpy(dst + Q8_SB + 64, sx, sizeof sx);
    }
}

/* ra[b] = wa . x_b, rb[b] = wb . x_b for NB tokens (x_b: the quantized row at xq + idx[b] * xs): int4 first takes
   the zero points out (sum over groups of scale x zero x S_g), then per super-block and token 4 vpdpbusd a row (fp4:
   from the block corrections), then one fp32 multiply-add by group scale x block scale. */
T_VNNI INLINE_Q void dot8_avx512(const int fmt, const int NB, int G, const qrow *wa, const qrow *wb, int K,
                                 const uint8_t *xq, int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const uint8_t *x[QNB_AVX512];
    __m512 fa[QNB_AVX512], fb[QNB_AVX512];
    const int nsb = (K + Q8_SB - 1) / Q8_SB;
    for (int b = 0; b < NB; ++b) {
        x[b] = xq + (int64_t)idx[b] * xs;
        fa[b] = fb[b] = _mm512_setzero_ps();
    }
    if (fmt == FMT_INT4) {
        for (int g = 0, ng = q8_groups(K, G); g < ng; g += 16) {
            const __m512 za = q8_zero_scales(wa, g, ng), zb = q8_zero_scales(wb, g, ng);
            for (int b = 0; b < NB; ++b) {
                const __m512 S = _mm512_loadu_ps((const float *)(x[b] + (int64_t)nsb * Q8_SB_BYTES) + g);
                fa[b] = _mm512_fnmadd_ps(za, S, fa[b]);
                fb[b] = _mm512_fnmadd_ps(zb, S, fb[b]);
            }
        }
    }
    for (int s = 0; s < nsb; ++s) {
        PREFETCH_CODES(wa, wb, s * (Q8_SB / 2))
        PREFETCH_CODES(wa, wb, s * (Q8_SB / 2) + 64)
        const __m512 sa = q8_scales(fmt, G, wa, s, K), sb = q8_scales(fmt, G, wb, s, K);
        __m512i va[4], vb[4];
        q8_weights(fmt, wa, s, K, va);
        q8_weights(fmt, wb, s, K, vb);
        for (int b = 0; b < NB; ++b) {
            const uint8_t *xb = x[b] + (int64_t)s * Q8_SB_BYTES;
            __m512i ia = fmt == FMT_INT4 ? _mm512_setzero_si512() : _mm512_loadu_si512(xb + Q8_SB), ib = ia;
            for (int v = 0; v < 4; ++v) {
                const __m512i xv = _mm512_loadu_si512(xb + 64 * v);
                ia = _mm512_dpbusd_epi32(ia, va[v], xv);
                ib = _mm512_dpbusd_epi32(ib, vb[v], xv);
            }
            const __m512 sx = _mm512_loadu_ps((const float *)(xb + Q8_SB + 64));
            fa[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(sa, sx), fa[b]);
            fb[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(sb, sx), fb[b]);
        }
    }
    const float half = fmt == FMT_INT4 ? 1.0f : 0.5f;                  /* fp4: the integers are 2 v */
    for (int b = 0; b < NB; ++b) {
        ra[b] = _mm512_reduce_add_ps(fa[b]) * half;
        rb[b] = _mm512_reduce_add_ps(fb[b]) * half;
    }
}

typedef void (*dot8_fn)(int G, const qrow *wa, const qrow *wb, int K, const uint8_t *xq, int64_t xs,
                        const int32_t *idx, float *ra, float *rb);
#define DEFINE_DOT8(FMT, NAME, NB)                                                                           \
T_VNNI static void dot8_##NAME##_##NB(int G, const qrow *wa, const qrow *wb, int K, const uint8_t *xq,        \
                                      int64_t xs, const int32_t *idx, float *ra, float *rb) {                 \
    dot8_avx512(FMT, NB, G, wa, wb, K, xq, xs, idx, ra, rb);                                                  \
}
#define DEFINE_DOT8_FMT(FMT, NAME) DEFINE_DOT8(FMT, NAME, 1) DEFINE_DOT8(FMT, NAME, 2) DEFINE_DOT8(FMT, NAME, 3) \
    DEFINE_DOT8(FMT, NAME, 4)
DEFINE_DOT8_FMT(FMT_INT4, int4) DEFINE_DOT8_FMT(FMT_MXFP4, mxfp4) DEFINE_DOT8_FMT(FMT_NVFP4, nvfp4)
static const dot8_fn DOT8[5][QNB_AVX512 + 1] = {
    {0}, {0}, {0, dot8_int4_1, dot8_int4_2, dot8_int4_3, dot8_int4_4},
    {0, dot8_mxfp4_1, dot8_mxfp4_2, dot8_mxfp4_3, dot8_mxfp4_4},
    {0, dot8_nvfp4_1, dot8_nvfp4_2, dot8_nvfp4_3, dot8_nvfp4_4}};

/* ra[b], rb[b] for every b < B, register blocks of QNB_AVX512 tokens. */
static inline void dot8_rows(int fmt, int G, const qrow *wa, const qrow *wb, int K, const uint8_t *xq, int64_t xs,
                             const int32_t *idx, int B, float *ra, float *rb) {
    for (int b0 = 0; b0 < B; b0 += QNB_AVX512) {
        const int nb = B - b0 < QNB_AVX512 ? B - b0 : QNB_AVX512;
        DOT8[fmt][nb](G, wa, wb, K, xq, xs, idx + b0, ra + b0, rb + b0);
    }
}
#endif /* __x86_64__ */

/* The int8 path's activations (it runs only where ft_quant_int8_available: AVX-512 there). */
static inline void q8_quantize_row(const float *x, int K, int fmt, int G, uint8_t *dst) {
#if defined(__x86_64__)
    q8_quantize_row_512(x, K, fmt, G, dst);
#else
    q8_quantize_row_ref(x, K, fmt, G, dst);
#endif
}

/* 1 where the int8 path runs here: x86-64 with AVX-512 F/BW/VL and VNNI (the emulated test build: always). */
int ft_quant_int8_available(void) {
#if defined(FT_EMULATE_AVX512)
    return 1;
#elif defined(__x86_64__)
    __builtin_cpu_init();
    return ft_best_isa() >= ISA_AVX512 && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

#endif /* FT_QUANT_INT8_H */
