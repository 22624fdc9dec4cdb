/* The AVX-512F/BW/VL decoders and dot products of the quantized expert kernel: static inline code included by
 * quant_dots.h (its types, tables and formulas), inside its x86-64 block. */
#ifndef FT_QUANT_AVX512_H
#define FT_QUANT_AVX512_H

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

#endif /* FT_QUANT_AVX512_H */
