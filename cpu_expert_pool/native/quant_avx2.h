/* The AVX2 + FMA + F16C decoders and dot products of the quantized expert kernel: static inline code included by
 * quant_dots.h after quant_avx512.h (whose fp8 helpers it shares), inside its x86-64 block. */
#ifndef FT_QUANT_AVX2_H
#define FT_QUANT_AVX2_H

typedef struct { __m256 lo, hi; } tab256;      /* a 16-entry table: entries 0..7, 8..15 */

T_AVX2Q INLINE_Q tab256 table256(int fmt, const qrow *r, int g) {
    tab256 t;
    if (fmt == FMT_INT4) {
        const __m256i z = _mm256_set1_epi32(r->zeros[g]);
        const __m256 s = _mm256_set1_ps(r->fscales[g]);
        const __m256i u0 = _mm256_loadu_si256((const __m256i *)IOTA16);
        const __m256i u1 = _mm256_loadu_si256((const __m256i *)(IOTA16 + 8));
        t.lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u0, z)), s);
        t.hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u1, z)), s);
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

#endif /* FT_QUANT_AVX2_H */
