/* Decoders and dot products of the quantized expert kernel (quant_ffn.c, its only includer): static inline code.
 *
 * A row of a quantized matrix (qrow) is read in place from the store; weights are dequantized in registers to
 * fp32 exactly as proto/expert_format.py's decode formulas say, then multiplied with fp32 activations:
 *   fp8    w = e4m3(code) * scale[r / 128][k / 128]
 *   int4   w = (u - zero[g]) * scale[g]                 g = k / G
 *   mxfp4  w = fp4(code) * 2**(e[g] - 127)
 *   nvfp4  w = fp4(code) * fp32(e4m3(s[g]) * global)
 * 4-bit formats: each group's 16 possible weights form a table (the formula applied to the 16 codes, so every
 * entry is the reference's value), and a code is a table index (vpermps). Two codes share a byte, so a chunk of
 * 32 weights (16 bytes) decodes into its even elements and its odd elements: the activations of 4-bit formats are
 * stored permuted the same way, per block of 32 (or a last block of 16): position p < n/2 holds element 2p,
 * position n/2 + p holds element 2p + 1 (perm4_pos). fp8: the sign and magnitude bits are moved into fp32 bits of
 * code * 2**-120 and multiplied by scale * 2**120 (the same product as code * scale, one rounding); blocks whose
 * codes include NaN or whose scale is >= 2**8 take the general decoder (fp16 bits of code / 256, vcvtph2ps).
 *
 * ISAs: AVX-512F/BW/VL (16 lanes), AVX2 + FMA + F16C (8 lanes), portable C. There is no AVX-512 BF16 or AMX
 * path: the dequantized weights are fp32 (rounding them to bf16 would change them), so those CPUs run AVX-512F.
 */
#ifndef FT_QUANT_DOTS_H
#define FT_QUANT_DOTS_H

enum { FMT_FP8 = 1, FMT_INT4 = 2, FMT_MXFP4 = 3, FMT_NVFP4 = 4 };   /* ft_quant_format.format */
#define FP8_BLOCK 128
#define CHUNK 32          /* 4-bit: weights per 16-byte chunk (a permuted activation block) */

typedef struct {
    const uint8_t *codes;      /* the row's codes: K bytes (fp8) or K / 2 */
    const float *fscales;      /* fp8: the row's block row [ceil(K / 128)]; int4: the row's [K / G] */
    const uint8_t *bscales;    /* mxfp4 (E8M0) / nvfp4 (E4M3): the row's [K / G] */
    const uint8_t *zeros;      /* int4: the row's [K / G] */
    float global;              /* nvfp4: the matrix's global scale */
} qrow;

static const float FP4_LUT[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static const int32_t IOTA16[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float e4m3_to_f32(uint8_t b) {           /* float8_e4m3fn: no infinities, 0x7f / 0xff NaN */
    const uint32_t mag = b & 0x7fu, sign = (uint32_t)(b & 0x80u) << 24;
    if (mag == 0x7fu) return NAN;
    if (mag < 8) {                                     /* subnormal: m * 2**-9 (exact) */
        const float v = (float)mag * 0.001953125f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((mag + (120u << 3)) << 20));   /* exponent e + 120, mantissa m << 20 */
}
static inline float e8m0_to_f32(uint8_t e) {           /* 2**(e - 127): e = 0 is 2**-127 (subnormal), 255 inf */
    return e == 0 ? f32_from_bits(0x00400000u) : e == 255 ? f32_from_bits(0x7f800000u) : f32_from_bits((uint32_t)e << 23);
}
static inline float fp4_group_scale(int fmt, const qrow *r, int g) {
    return fmt == FMT_MXFP4 ? e8m0_to_f32(r->bscales[g]) : e4m3_to_f32(r->bscales[g]) * r->global;
}

/* 4-bit formats: the 16 weights of group g. int4: (float)(u - z) is exact, as the reference's u.float() - z.float(). */
static inline void table16(int fmt, const qrow *r, int g, float t[16]) {
    if (fmt == FMT_INT4) {
        const float s = r->fscales[g];
        const int z = r->zeros[g];
        for (int u = 0; u < 16; ++u) t[u] = (float)(u - z) * s;
    } else {
        const float s = fp4_group_scale(fmt, r, g);
        for (int u = 0; u < 16; ++u) t[u] = FP4_LUT[u] * s;
    }
}

/* Position of element k of a K-long row in the permuted activation layout of 4-bit formats. */
static inline int perm4_pos(int k, int K) {
    const int blk = k & ~(CHUNK - 1), n = K - blk < CHUNK ? K - blk : CHUNK, r = k - blk;
    return blk + (r & 1 ? n / 2 + r / 2 : r / 2);
}

/* ---------------------------------------------------------------- portable C */
static inline float fp8_weight(const qrow *r, int k) { return e4m3_to_f32(r->codes[k]) * r->fscales[k / FP8_BLOCK]; }

/* ra[b] = wa . x_b, rb[b] = wb . x_b over k < K (x_b = xbase + idx[b] * xs; 4-bit formats: x permuted). */
static void dotq_scalar(int fmt, int G, const qrow *wa, const qrow *wb, int K, const float *xbase, int64_t xs,
                        const int32_t *idx, int nb, float *ra, float *rb) {
    for (int b = 0; b < nb; ++b) {
        const float *x = xbase + (int64_t)idx[b] * xs;
        float sa = 0, sb = 0;
        if (fmt == FMT_FP8) {
            for (int k = 0; k < K; ++k) { sa += fp8_weight(wa, k) * x[k]; sb += fp8_weight(wb, k) * x[k]; }
        } else {
            float ta[16], tb[16];
            int group = -1;
            for (int k = 0; k < K; k += 2) {
                if (k / G != group) { group = k / G; table16(fmt, wa, group, ta); table16(fmt, wb, group, tb); }
                const uint8_t ca = wa->codes[k / 2], cb = wb->codes[k / 2];
                const float x0 = x[perm4_pos(k, K)], x1 = x[perm4_pos(k + 1, K)];
                sa += ta[ca & 15] * x0 + ta[ca >> 4] * x1;
                sb += tb[cb & 15] * x0 + tb[cb >> 4] * x1;
            }
        }
        ra[b] = sa;
        rb[b] = sb;
    }
}

#if defined(__x86_64__)
#ifndef T_AVX512Q
#define T_AVX512Q __attribute__((target("avx512f,avx512bw,avx512vl")))
#define T_AVX2Q __attribute__((target("avx2,fma,f16c")))
#endif
#define INLINE_Q static inline __attribute__((always_inline))
#define QNB_AVX512 4      /* tokens a register block: 4 accumulators a token */
/* AVX2: 4 tokens with one accumulator a row and token (16 registers), 2 accumulators below 3 tokens */
#define QNB_AVX2 4

/* ---------------------------------------------------------------- AVX-512 */
T_AVX512Q INLINE_Q __m512 table512(int fmt, const qrow *r, int g) {
    if (fmt == FMT_INT4) {
        const __m512i u = _mm512_sub_epi32(_mm512_loadu_si512(IOTA16), _mm512_set1_epi32(r->zeros[g]));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(r->fscales[g]));
    }
    return _mm512_mul_ps(_mm512_loadu_ps(FP4_LUT), _mm512_set1_ps(fp4_group_scale(fmt, r, g)));
}
/* The tables chunk k (k % 32 == 0) needs: t[0] its group; nvfp4 (G = 16): t[0], t[1] its two groups. */
T_AVX512Q INLINE_Q void tables512_at(int fmt, int G, const qrow *r, int k, int K, __m512 *t) {
    if (fmt == FMT_NVFP4) {
        t[0] = table512(fmt, r, k / 16);
        if (k + 16 < K) t[1] = table512(fmt, r, k / 16 + 1);
    } else if (k % G == 0) {
        t[0] = table512(fmt, r, k / G);
    }
}
/* 32 weights at k: w[0] the even elements, w[1] the odd ones (the permuted activation block's two halves). */
T_AVX512Q INLINE_Q void dec4_512(int fmt, const uint8_t *codes, int k, const __m512 *t, __m512 *w) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k / 2)));
    const __m512i hi = _mm512_srli_epi32(v, 4);
    if (fmt == FMT_NVFP4) {          /* lanes 8..15 hold elements 16..31: the second group, table bit 4 */
        const __m512i sel = _mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0);
        w[0] = _mm512_permutex2var_ps(t[0], _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(15)), sel), t[1]);
        w[1] = _mm512_permutex2var_ps(t[0], _mm512_or_si512(hi, sel), t[1]);
    } else {                         /* vpermps reads index bits 3..0 only: the low nibble needs no mask */
        w[0] = _mm512_permutexvar_ps(v, t[0]);
        w[1] = _mm512_permutexvar_ps(hi, t[0]);
    }
}
/* nvfp4's last block of 16 weights (one group) at k: lanes 0..7 the even elements, 8..15 the odd ones. */
T_AVX512Q INLINE_Q __m512 dec4_tail512(const uint8_t *codes, int k, __m512 t) {
    uint64_t q;
    memcpy(&q, codes + k / 2, 8);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_set1_epi64x((long long)q));          /* bytes 0..7 twice */
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift), t);
}
/* 16 fp8 codes -> code / 256 (fp16 bits: sign, then the 7 magnitude bits at 13..7; with nan_fix, a 0x7f
   magnitude -> NaN: callers that know the codes hold none skip it). */
T_AVX512Q INLINE_Q __m512 fp8x16_512(__m128i bytes, int nan_fix) {
    const __m256i s = _mm256_cvtepi8_epi16(bytes);                                  /* sign-extended */
    __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16((short)0xBFFF));
    if (nan_fix) {
        const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)),
                                                      _mm256_set1_epi16(0x3f80));
        h = _mm256_mask_mov_epi16(h, nan, _mm256_set1_epi16(0x7e00));
    }
    return _mm512_cvtph_ps(h);
}
/* (code / 256) * (256 s) is the same product as code * s, one rounding, while 256 s is exact (it overflows
   only for s >= 2**120: then two products, (code / 256 * 256) * s). */
static inline int fp8_scale_exact(float s) { return !(isinf(s * 256.0f) && !isinf(s)); }
T_AVX512Q INLINE_Q __m512 fp8_scale512(__m512 f, float s) {
    if (!fp8_scale_exact(s)) return _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(256.0f)), _mm512_set1_ps(s));
    return _mm512_mul_ps(f, _mm512_set1_ps(s * 256.0f));
}
/* The general decoder (masked tails, rare scales, NaN codes): 16 weights at k. */
T_AVX512Q INLINE_Q __m512 dec8_512(const qrow *r, int k, __mmask16 m) {
    return fp8_scale512(fp8x16_512(_mm_maskz_loadu_epi8(m, r->codes + k), 1), r->fscales[k / FP8_BLOCK]);
}
T_AVX512Q INLINE_Q int fp8_nan32_512(const uint8_t *p) {      /* any 0x7f / 0xff among 32 codes */
    const __m256i m = _mm256_set1_epi8(0x7f);
    return _mm256_cmpeq_epi8_mask(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), m), m) != 0;
}
/* The fast decoder: 16 codes -> fp32 bits sign | magnitude << 20, i.e. code * 2**-120 exactly (e4m3's subnormals
   land on fp32 subnormals); times s * 2**120 that is code * s, one rounding. Needs s * 2**120 finite (s < 2**8)
   and no NaN code. */
#define FP8_FAST_SHIFT 1.329227995784916e36f              /* 2**120 */
static inline int fp8_fast_scale(float s) { return !(isinf(s * FP8_FAST_SHIFT) && !isinf(s)); }
T_AVX512Q INLINE_Q __m512 fp8_bits_512(__m128i q) {
    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(q), 20);               /* sign-extended */
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0x87F00000u)));
}
/* 32 weights at k (k % 32 == 0): m = s * 2**120 of the block, fast = fp8_fast_scale(s). */
T_AVX512Q INLINE_Q void dec8x32_512(const qrow *r, int k, __m512 m, int fast, __m512 *w) {
    if (fast && !fp8_nan32_512(r->codes + k)) {
        w[0] = _mm512_mul_ps(fp8_bits_512(_mm_loadu_si128((const __m128i *)(r->codes + k))), m);
        w[1] = _mm512_mul_ps(fp8_bits_512(_mm_loadu_si128((const __m128i *)(r->codes + k + 16))), m);
    } else {
        w[0] = dec8_512(r, k, 0xffff);
        w[1] = dec8_512(r, k + 16, 0xffff);
    }
}
static inline __mmask16 mask16(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }

T_AVX512Q INLINE_Q void dotq_avx512(const int fmt, const int NB, int G, const qrow *wa, const qrow *wb, int K,
                                    const float *xbase, int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const float *x[QNB_AVX512];
    __m512 a0[QNB_AVX512], a1[QNB_AVX512], b0[QNB_AVX512], b1[QNB_AVX512];
    for (int b = 0; b < NB; ++b) {
        x[b] = xbase + (int64_t)idx[b] * xs;
        a0[b] = a1[b] = b0[b] = b1[b] = _mm512_setzero_ps();
    }
    int k = 0;
    if (fmt == FMT_FP8) {
        __m512 ma = _mm512_setzero_ps(), mb = ma;
        int fa = 0, fb = 0;
        for (; k + 32 <= K; k += 32) {         /* 128-blocks hold whole 32-steps */
            if (k % FP8_BLOCK == 0) {
                const float sa = wa->fscales[k / FP8_BLOCK], sb = wb->fscales[k / FP8_BLOCK];
                fa = fp8_fast_scale(sa); fb = fp8_fast_scale(sb);
                ma = _mm512_set1_ps(sa * FP8_FAST_SHIFT); mb = _mm512_set1_ps(sb * FP8_FAST_SHIFT);
            }
            __m512 va[2], vb[2];
            dec8x32_512(wa, k, ma, fa, va);
            dec8x32_512(wb, k, mb, fb, vb);
            const __m512 wa0 = va[0], wa1 = va[1], wb0 = vb[0], wb1 = vb[1];
            for (int b = 0; b < NB; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x[b] + k), x1 = _mm512_loadu_ps(x[b] + k + 16);
                a0[b] = _mm512_fmadd_ps(wa0, x0, a0[b]); a1[b] = _mm512_fmadd_ps(wa1, x1, a1[b]);
                b0[b] = _mm512_fmadd_ps(wb0, x0, b0[b]); b1[b] = _mm512_fmadd_ps(wb1, x1, b1[b]);
            }
        }
        for (; k < K; k += 16) {
            const __mmask16 m = mask16(K - k);
            const __m512 wa0 = dec8_512(wa, k, m), wb0 = dec8_512(wb, k, m);
            for (int b = 0; b < NB; ++b) {
                const __m512 x0 = _mm512_maskz_loadu_ps(m, x[b] + k);
                a0[b] = _mm512_fmadd_ps(wa0, x0, a0[b]);
                b0[b] = _mm512_fmadd_ps(wb0, x0, b0[b]);
            }
        }
    } else {
        __m512 ta[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, tb[2] = {ta[0], ta[1]};
        for (; k + CHUNK <= K; k += CHUNK) {
            tables512_at(fmt, G, wa, k, K, ta);
            tables512_at(fmt, G, wb, k, K, tb);
            __m512 va[2], vb[2];
            dec4_512(fmt, wa->codes, k, ta, va);
            dec4_512(fmt, wb->codes, k, tb, vb);
            for (int b = 0; b < NB; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x[b] + k), x1 = _mm512_loadu_ps(x[b] + k + 16);
                a0[b] = _mm512_fmadd_ps(va[0], x0, a0[b]); a1[b] = _mm512_fmadd_ps(va[1], x1, a1[b]);
                b0[b] = _mm512_fmadd_ps(vb[0], x0, b0[b]); b1[b] = _mm512_fmadd_ps(vb[1], x1, b1[b]);
            }
        }
        if (k < K) {                           /* nvfp4 only: K % 32 == 16 */
            tables512_at(fmt, G, wa, k, K, ta);
            tables512_at(fmt, G, wb, k, K, tb);
            const __m512 va = dec4_tail512(wa->codes, k, ta[0]), vb = dec4_tail512(wb->codes, k, tb[0]);
            for (int b = 0; b < NB; ++b) {
                const __m512 x0 = _mm512_loadu_ps(x[b] + k);
                a0[b] = _mm512_fmadd_ps(va, x0, a0[b]);
                b0[b] = _mm512_fmadd_ps(vb, x0, b0[b]);
            }
        }
    }
    for (int b = 0; b < NB; ++b) {
        ra[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b]));
        rb[b] = _mm512_reduce_add_ps(_mm512_add_ps(b0[b], b1[b]));
    }
}

/* One row in element order (ft_dequantize_rows): the decoders above, their permuted halves put back. */
T_AVX512Q static void dequant_row_avx512(int fmt, int G, const qrow *q, int K, float *o, float *tmp) {
    int k = 0;
    if (fmt == FMT_FP8) {
        __m512 w[2];
        for (; k + 32 <= K; k += 32) {
            const float s = q->fscales[k / FP8_BLOCK];
            dec8x32_512(q, k, _mm512_set1_ps(s * FP8_FAST_SHIFT), fp8_fast_scale(s), w);
            _mm512_storeu_ps(o + k, w[0]);
            _mm512_storeu_ps(o + k + 16, w[1]);
        }
        for (; k < K; k += 16) _mm512_mask_storeu_ps(o + k, mask16(K - k), dec8_512(q, k, mask16(K - k)));
        return;
    }
    __m512 t[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, w[2];
    for (; k + CHUNK <= K; k += CHUNK) {
        tables512_at(fmt, G, q, k, K, t);
        dec4_512(fmt, q->codes, k, t, w);
        _mm512_storeu_ps(tmp, w[0]);
        _mm512_storeu_ps(tmp + 16, w[1]);
        for (int j = 0; j < 16; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[16 + j]; }
    }
    if (k < K) {
        tables512_at(fmt, G, q, k, K, t);
        _mm512_storeu_ps(tmp, dec4_tail512(q->codes, k, t[0]));
        for (int j = 0; j < 8; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[8 + j]; }
    }
}

/* ---------------------------------------------------------------- AVX2 */
typedef struct { __m256 lo, hi; } tab256;      /* a 16-entry table: entries 0..7, 8..15 */

T_AVX2Q INLINE_Q tab256 table256(int fmt, const qrow *r, int g) {
    tab256 t;
    if (fmt == FMT_INT4) {
        const __m256i z = _mm256_set1_epi32(r->zeros[g]);
        const __m256 s = _mm256_set1_ps(r->fscales[g]);
        t.lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)IOTA16), z)), s);
        t.hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(IOTA16 + 8)), z)), s);
    } else {
        const __m256 s = _mm256_set1_ps(fp4_group_scale(fmt, r, g));
        t.lo = _mm256_mul_ps(_mm256_loadu_ps(FP4_LUT), s);
        t.hi = _mm256_mul_ps(_mm256_loadu_ps(FP4_LUT + 8), s);
    }
    return t;
}
T_AVX2Q INLINE_Q void tables256_at(int fmt, int G, const qrow *r, int k, int K, tab256 *t) {
    if (fmt == FMT_NVFP4) {
        t[0] = table256(fmt, r, k / 16);
        if (k + 16 < K) t[1] = table256(fmt, r, k / 16 + 1);
        else t[1] = t[0];
    } else if (k % G == 0) {
        t[0] = t[1] = table256(fmt, r, k / G);
    }
}
/* Table lookup of 8 codes (index bits 3..0): vpermps on each half, bit 3 picks the half. */
T_AVX2Q INLINE_Q __m256 lookup256(__m256i v, tab256 t) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, v), _mm256_permutevar8x32_ps(t.hi, v),
                            _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}
/* 32 weights at k in the permuted order: w[0] elements 0,2..14 (t[0]), w[1] 16,18..30 (t[1]), w[2] 1,3..15,
   w[3] 17..31. */
T_AVX2Q INLINE_Q void dec4_256(const uint8_t *codes, int k, const tab256 *t, __m256 *w) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(codes + k / 2));
    const __m256i v0 = _mm256_cvtepu8_epi32(q), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
    w[0] = lookup256(v0, t[0]);
    w[1] = lookup256(v1, t[1]);
    w[2] = lookup256(_mm256_srli_epi32(v0, 4), t[0]);
    w[3] = lookup256(_mm256_srli_epi32(v1, 4), t[1]);
}
/* nvfp4's last block of 16 (one group): w[0] the even elements, w[1] the odd ones. */
T_AVX2Q INLINE_Q void dec4_tail256(const uint8_t *codes, int k, tab256 t, __m256 *w) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + k / 2)));
    w[0] = lookup256(v, t);
    w[1] = lookup256(_mm256_srli_epi32(v, 4), t);
}
/* 8 fp8 codes (the low 8 bytes of q) -> code / 256, as fp8x16_512. */
T_AVX2Q INLINE_Q __m256 fp8x8_256(__m128i q, int nan_fix) {
    __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(q), 7), _mm_set1_epi16((short)0xBFFF));
    if (nan_fix) {
        const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
        h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan);
    }
    return _mm256_cvtph_ps(h);
}
/* The general decoder: 8 codes at p -> code * s. */
T_AVX2Q INLINE_Q __m256 dec8_256(const uint8_t *p, float s) {
    const __m256 f = fp8x8_256(_mm_loadl_epi64((const __m128i *)p), 1);
    if (!fp8_scale_exact(s)) return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(256.0f)), _mm256_set1_ps(s));
    return _mm256_mul_ps(f, _mm256_set1_ps(s * 256.0f));
}
T_AVX2Q INLINE_Q int fp8_nan16_256(__m128i q) {               /* any 0x7f / 0xff among 16 codes */
    const __m128i m = _mm_set1_epi8(0x7f);
    return _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(q, m), m)) != 0;
}
T_AVX2Q INLINE_Q __m256 fp8_bits_256(__m128i q) {              /* the low 8 codes of q, as fp8_bits_512 */
    const __m256i v = _mm256_slli_epi32(_mm256_cvtepi8_epi32(q), 20);
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0x87F00000u)));
}
/* 16 weights at k (k % 16 == 0): m = s * 2**120 of the block, fast = fp8_fast_scale(s). */
T_AVX2Q INLINE_Q void dec8x16_256(const qrow *r, int k, __m256 m, int fast, __m256 *w) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(r->codes + k));
    if (fast && !fp8_nan16_256(q)) {
        w[0] = _mm256_mul_ps(fp8_bits_256(q), m);
        w[1] = _mm256_mul_ps(fp8_bits_256(_mm_srli_si128(q, 8)), m);
    } else {
        const float s = r->fscales[k / FP8_BLOCK];
        w[0] = dec8_256(r->codes + k, s);
        w[1] = dec8_256(r->codes + k + 8, s);
    }
}
T_AVX2Q static inline float hsum256q(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

T_AVX2Q INLINE_Q void dotq_avx2(const int fmt, const int NB, int G, const qrow *wa, const qrow *wb, int K,
                                const float *xbase, int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const float *x[QNB_AVX2];
    __m256 a0[QNB_AVX2], a1[QNB_AVX2], b0[QNB_AVX2], b1[QNB_AVX2];
    float ta[QNB_AVX2], tb[QNB_AVX2];
    for (int b = 0; b < NB; ++b) {
        x[b] = xbase + (int64_t)idx[b] * xs;
        a0[b] = a1[b] = b0[b] = b1[b] = _mm256_setzero_ps();
        ta[b] = tb[b] = 0;
    }
    int k = 0;
    if (fmt == FMT_FP8) {
        __m256 ma = _mm256_setzero_ps(), mb = ma;
        int fa = 0, fb = 0;
        for (; k + 16 <= K; k += 16) {         /* 128-blocks hold whole 16-steps */
            if (k % FP8_BLOCK == 0) {
                const float sa = wa->fscales[k / FP8_BLOCK], sb = wb->fscales[k / FP8_BLOCK];
                fa = fp8_fast_scale(sa); fb = fp8_fast_scale(sb);
                ma = _mm256_set1_ps(sa * FP8_FAST_SHIFT); mb = _mm256_set1_ps(sb * FP8_FAST_SHIFT);
            }
            __m256 va[2], vb[2];
            dec8x16_256(wa, k, ma, fa, va);
            dec8x16_256(wb, k, mb, fb, vb);
            const __m256 wa0 = va[0], wa1 = va[1], wb0 = vb[0], wb1 = vb[1];
            for (int b = 0; b < NB; ++b) {
                const __m256 x0 = _mm256_loadu_ps(x[b] + k), x1 = _mm256_loadu_ps(x[b] + k + 8);
                if (NB > 2) {                  /* 16 registers: one accumulator a row and token */
                    a0[b] = _mm256_fmadd_ps(wa0, x0, a0[b]); a0[b] = _mm256_fmadd_ps(wa1, x1, a0[b]);
                    b0[b] = _mm256_fmadd_ps(wb0, x0, b0[b]); b0[b] = _mm256_fmadd_ps(wb1, x1, b0[b]);
                } else {
                    a0[b] = _mm256_fmadd_ps(wa0, x0, a0[b]); a1[b] = _mm256_fmadd_ps(wa1, x1, a1[b]);
                    b0[b] = _mm256_fmadd_ps(wb0, x0, b0[b]); b1[b] = _mm256_fmadd_ps(wb1, x1, b1[b]);
                }
            }
        }
        for (; k < K; ++k) {
            const float fa = fp8_weight(wa, k), fb = fp8_weight(wb, k);
            for (int b = 0; b < NB; ++b) { ta[b] += fa * x[b][k]; tb[b] += fb * x[b][k]; }
        }
    } else {
        tab256 tta[2], ttb[2];
        tta[0] = tta[1] = ttb[0] = ttb[1] = (tab256){_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; k + CHUNK <= K; k += CHUNK) {
            tables256_at(fmt, G, wa, k, K, tta);
            tables256_at(fmt, G, wb, k, K, ttb);
            __m256 va[4], vb[4];
            dec4_256(wa->codes, k, tta, va);
            dec4_256(wb->codes, k, ttb, vb);
            for (int b = 0; b < NB; ++b) {
                const float *xk = x[b] + k;
                const __m256 x0 = _mm256_loadu_ps(xk), x1 = _mm256_loadu_ps(xk + 8);
                const __m256 x2 = _mm256_loadu_ps(xk + 16), x3 = _mm256_loadu_ps(xk + 24);
                if (NB > 2) {                  /* 16 registers: one accumulator a row and token */
                    a0[b] = _mm256_fmadd_ps(va[0], x0, a0[b]); b0[b] = _mm256_fmadd_ps(vb[0], x0, b0[b]);
                    a0[b] = _mm256_fmadd_ps(va[1], x1, a0[b]); b0[b] = _mm256_fmadd_ps(vb[1], x1, b0[b]);
                    a0[b] = _mm256_fmadd_ps(va[2], x2, a0[b]); b0[b] = _mm256_fmadd_ps(vb[2], x2, b0[b]);
                    a0[b] = _mm256_fmadd_ps(va[3], x3, a0[b]); b0[b] = _mm256_fmadd_ps(vb[3], x3, b0[b]);
                } else {
                    a0[b] = _mm256_fmadd_ps(va[0], x0, a0[b]); a1[b] = _mm256_fmadd_ps(va[1], x1, a1[b]);
                    b0[b] = _mm256_fmadd_ps(vb[0], x0, b0[b]); b1[b] = _mm256_fmadd_ps(vb[1], x1, b1[b]);
                    a0[b] = _mm256_fmadd_ps(va[2], x2, a0[b]); a1[b] = _mm256_fmadd_ps(va[3], x3, a1[b]);
                    b0[b] = _mm256_fmadd_ps(vb[2], x2, b0[b]); b1[b] = _mm256_fmadd_ps(vb[3], x3, b1[b]);
                }
            }
        }
        if (k < K) {                           /* nvfp4 only: K % 32 == 16 */
            tables256_at(fmt, G, wa, k, K, tta);
            tables256_at(fmt, G, wb, k, K, ttb);
            __m256 va[2], vb[2];
            dec4_tail256(wa->codes, k, tta[0], va);
            dec4_tail256(wb->codes, k, ttb[0], vb);
            for (int b = 0; b < NB; ++b) {
                const __m256 x0 = _mm256_loadu_ps(x[b] + k), x1 = _mm256_loadu_ps(x[b] + k + 8);
                a0[b] = _mm256_fmadd_ps(va[0], x0, a0[b]); a1[b] = _mm256_fmadd_ps(va[1], x1, a1[b]);
                b0[b] = _mm256_fmadd_ps(vb[0], x0, b0[b]); b1[b] = _mm256_fmadd_ps(vb[1], x1, b1[b]);
            }
        }
    }
    for (int b = 0; b < NB; ++b) {
        ra[b] = hsum256q(_mm256_add_ps(a0[b], a1[b])) + ta[b];
        rb[b] = hsum256q(_mm256_add_ps(b0[b], b1[b])) + tb[b];
    }
}

T_AVX2Q static void dequant_row_avx2(int fmt, int G, const qrow *q, int K, float *o, float *tmp) {
    int k = 0;
    if (fmt == FMT_FP8) {
        __m256 w[2];
        for (; k + 16 <= K; k += 16) {
            const float s = q->fscales[k / FP8_BLOCK];
            dec8x16_256(q, k, _mm256_set1_ps(s * FP8_FAST_SHIFT), fp8_fast_scale(s), w);
            _mm256_storeu_ps(o + k, w[0]);
            _mm256_storeu_ps(o + k + 8, w[1]);
        }
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, dec8_256(q->codes + k, q->fscales[k / FP8_BLOCK]));
        for (; k < K; ++k) o[k] = fp8_weight(q, k);
        return;
    }
    tab256 t[2];
    t[0] = t[1] = (tab256){_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 w[4];
    for (; k + CHUNK <= K; k += CHUNK) {
        tables256_at(fmt, G, q, k, K, t);
        dec4_256(q->codes, k, t, w);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(tmp + 8 * i, w[i]);
        for (int j = 0; j < 16; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[16 + j]; }
    }
    if (k < K) {
        tables256_at(fmt, G, q, k, K, t);
        dec4_tail256(q->codes, k, t[0], w);
        _mm256_storeu_ps(tmp, w[0]);
        _mm256_storeu_ps(tmp + 8, w[1]);
        for (int j = 0; j < 8; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[8 + j]; }
    }
}

typedef void (*dotq_fn)(int G, const qrow *wa, const qrow *wb, int K, const float *xbase, int64_t xs,
                        const int32_t *idx, float *ra, float *rb);
#define DEFINE_DOTQ(ISA, T, FMT, NAME, NB)                                                                   \
T static void dotq_##ISA##_##NAME##_##NB(int G, const qrow *wa, const qrow *wb, int K, const float *xbase,     \
                                          int64_t xs, const int32_t *idx, float *ra, float *rb) {              \
    dotq_##ISA(FMT, NB, G, wa, wb, K, xbase, xs, idx, ra, rb);                                               \
}
#define DEFINE_DOTQ_FMT(ISA, T, FMT, NAME) DEFINE_DOTQ(ISA, T, FMT, NAME, 1) DEFINE_DOTQ(ISA, T, FMT, NAME, 2) \
    DEFINE_DOTQ(ISA, T, FMT, NAME, 3) DEFINE_DOTQ(ISA, T, FMT, NAME, 4)
DEFINE_DOTQ_FMT(avx512, T_AVX512Q, FMT_FP8, fp8) DEFINE_DOTQ_FMT(avx512, T_AVX512Q, FMT_INT4, int4)
DEFINE_DOTQ_FMT(avx512, T_AVX512Q, FMT_MXFP4, mxfp4) DEFINE_DOTQ_FMT(avx512, T_AVX512Q, FMT_NVFP4, nvfp4)
DEFINE_DOTQ_FMT(avx2, T_AVX2Q, FMT_FP8, fp8) DEFINE_DOTQ_FMT(avx2, T_AVX2Q, FMT_INT4, int4)
DEFINE_DOTQ_FMT(avx2, T_AVX2Q, FMT_MXFP4, mxfp4) DEFINE_DOTQ_FMT(avx2, T_AVX2Q, FMT_NVFP4, nvfp4)

/* [format][tokens in the block] */
static const dotq_fn DOTQ_AVX512[5][QNB_AVX512 + 1] = {
    {0}, {0, dotq_avx512_fp8_1, dotq_avx512_fp8_2, dotq_avx512_fp8_3, dotq_avx512_fp8_4},
    {0, dotq_avx512_int4_1, dotq_avx512_int4_2, dotq_avx512_int4_3, dotq_avx512_int4_4},
    {0, dotq_avx512_mxfp4_1, dotq_avx512_mxfp4_2, dotq_avx512_mxfp4_3, dotq_avx512_mxfp4_4},
    {0, dotq_avx512_nvfp4_1, dotq_avx512_nvfp4_2, dotq_avx512_nvfp4_3, dotq_avx512_nvfp4_4}};
static const dotq_fn DOTQ_AVX2[5][QNB_AVX2 + 1] = {
    {0}, {0, dotq_avx2_fp8_1, dotq_avx2_fp8_2, dotq_avx2_fp8_3, dotq_avx2_fp8_4},
    {0, dotq_avx2_int4_1, dotq_avx2_int4_2, dotq_avx2_int4_3, dotq_avx2_int4_4},
    {0, dotq_avx2_mxfp4_1, dotq_avx2_mxfp4_2, dotq_avx2_mxfp4_3, dotq_avx2_mxfp4_4},
    {0, dotq_avx2_nvfp4_1, dotq_avx2_nvfp4_2, dotq_avx2_nvfp4_3, dotq_avx2_nvfp4_4}};
#endif /* __x86_64__ */

/* ra[b], rb[b] for every b < B: register blocks of tokens on the vector ISAs (the two rows stay in L1). */
static inline void dotq_rows(int isa, int fmt, int G, const qrow *wa, const qrow *wb, int K, const float *xbase,
                             int64_t xs, const int32_t *idx, int B, float *ra, float *rb) {
#if defined(__x86_64__)
    if (isa >= ISA_AVX2) {
        const int block = isa >= ISA_AVX512 ? QNB_AVX512 : QNB_AVX2;
        for (int b0 = 0; b0 < B; b0 += block) {
            const int nb = B - b0 < block ? B - b0 : block;
            const dotq_fn fn = isa >= ISA_AVX512 ? DOTQ_AVX512[fmt][nb] : DOTQ_AVX2[fmt][nb];
            fn(G, wa, wb, K, xbase, xs, idx + b0, ra + b0, rb + b0);
        }
        return;
    }
#endif
    dotq_scalar(fmt, G, wa, wb, K, xbase, xs, idx, B, ra, rb);
}

#endif /* FT_QUANT_DOTS_H */
