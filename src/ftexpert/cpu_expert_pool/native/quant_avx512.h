/* The AVX-512F/BW/VL decoders and dot products of the quantized expert kernel: static inline code included by
 * quant_dots.h (its types, tables and formulas), inside its x86-64 block. */
#ifndef FT_QUANT_AVX512_H
#define FT_QUANT_AVX512_H

static inline __mmask16 mask16(int left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }
T_AVX512Q INLINE_Q __m512 table512(const qrow *r, int g) {        /* int4: (u - zero[g]) * scale[g], u < 16 */
    const __m512i u = _mm512_sub_epi32(_mm512_loadu_si512(IOTA16), _mm512_set1_epi32(r->zeros[g]));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(r->fscales[g]));
}
/* 32 4-bit codes at k, looked up in t (vpermps reads index bits 3..0 only: the low nibble needs no mask): w[0] the
   even elements, w[1] the odd ones (the permuted activation block's two halves). */
T_AVX512Q INLINE_Q void nib32_512(const uint8_t *codes, int k, __m512 t, __m512 *w) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k / 2)));
    w[0] = _mm512_permutexvar_ps(v, t);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), t);
}
/* nvfp4's last block of 16 (one group) at k, unscaled: lanes 0..7 the even elements, 8..15 the odd ones. */
T_AVX512Q INLINE_Q __m512 fp4x16_512(const uint8_t *codes, int k) {
    uint64_t q;
    memcpy(&q, codes + k / 2, 8);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_set1_epi64x((long long)q));          /* bytes 0..7 twice */
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift), _mm512_loadu_ps(FP4_LUT));
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
/* The fast decoder: 16 codes -> fp32 bits sign | magnitude << 20, i.e. code * 2**-120 exactly (e4m3's subnormals
   land on fp32 subnormals); times s * 2**120 that is code * s, one rounding. Needs s * 2**120 finite (s < 2**8)
   and no NaN code. */
#define FP8_FAST_SHIFT 1.329227995784916e36f              /* 2**120 */
static inline int fp8_fast_scale(float s) { return !(isinf(s * FP8_FAST_SHIFT) && !isinf(s)); }
T_AVX512Q INLINE_Q __m512 fp8_bits_512(__m128i q) {
    const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(q), 20);               /* sign-extended */
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0x87F00000u)));
}
/* The scales of groups [g, g + 16) of an mxfp4 / nvfp4 row with n groups, into s[16], as fp4_group_scale gives
   them (groups from n on read as code 0). */
T_AVX512Q INLINE_Q void fp4_scales16_512(int fmt, const qrow *r, int g, int n, float *s) {
    const __m128i q = _mm_maskz_loadu_epi8(mask16(n - g), r->bscales + g);
    if (fmt == FMT_MXFP4) {            /* 2**(e - 127): e << 23; e = 0 -> 2**-127; e = 255 -> inf by itself */
        const __m512i e = _mm512_cvtepu8_epi32(q);
        const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
        const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000));
        _mm512_storeu_ps(s, _mm512_castsi512_ps(bits));
    } else {                           /* e4m3 (code / 256 * 256, exact) * global */
        _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_mul_ps(fp8x16_512(q, 1), _mm512_set1_ps(256.0f)),
                                          _mm512_set1_ps(r->global)));
    }
}
T_AVX512Q INLINE_Q int fp8_nan_512(const uint8_t *p, int n) {   /* any 0x7f / 0xff among n codes (n % 64 == 0) */
    const __m512i m = _mm512_set1_epi8(0x7f);
    uint64_t any = 0;
    for (int i = 0; i < n; i += 64)
        any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), m), m);
    return any != 0;
}
/* fp8: 32 weights at k. fast: the block's scale passes fp8_fast_scale and its codes hold no NaN (m = s * 2**120);
   otherwise the general decoder. */
T_AVX512Q INLINE_Q void fp8x32_512(const qrow *r, int k, __m512 m, int fast, __m512 *w) {
    if (fast) {
        w[0] = _mm512_mul_ps(fp8_bits_512(_mm_loadu_si128((const __m128i *)(r->codes + k))), m);
        w[1] = _mm512_mul_ps(fp8_bits_512(_mm_loadu_si128((const __m128i *)(r->codes + k + 16))), m);
    } else {
        w[0] = dec8_512(r, k, 0xffff);
        w[1] = dec8_512(r, k + 16, 0xffff);
    }
}
/* The fp8 block of k0 (k0 % 128 == 0, n its length): 1 where the fast decoder may decode all of it. */
T_AVX512Q INLINE_Q int fp8_block_fast_512(const qrow *r, int k0, int n) {
    return fp8_fast_scale(r->fscales[k0 / FP8_BLOCK]) && n % 64 == 0 && !fp8_nan_512(r->codes + k0, n);
}
/* The weights of both rows at k (NV vectors each, 16 elements of x apart) into every token's accumulators. */
#define ACC512(NB, NV, va, vb, k)                                                                                \
    for (int b = 0; b < NB; ++b) {                                                                             \
        for (int v = 0; v < NV; ++v) {                                                                         \
            const __m512 xv = _mm512_loadu_ps(x[b] + (k) + 16 * v);                                          \
            if ((v & 1) == 0) { a0[b] = _mm512_fmadd_ps(va[v], xv, a0[b]); b0[b] = _mm512_fmadd_ps(vb[v], xv, b0[b]); } \
            else { a1[b] = _mm512_fmadd_ps(va[v], xv, a1[b]); b1[b] = _mm512_fmadd_ps(vb[v], xv, b1[b]); }     \
        }                                                                                                      \
    }

/* Weights outer, tokens inner: each weight vector is decoded once a call and applied to the NB tokens. */
T_AVX512Q INLINE_Q void dotq_avx512(const int fmt, const int NB, int G, const qrow *wa, const qrow *wb, int K,
                                    const float *xbase, int64_t xs, const int32_t *idx, float *ra, float *rb) {
    const float *x[QNB_AVX512];
    __m512 a0[QNB_AVX512], a1[QNB_AVX512], b0[QNB_AVX512], b1[QNB_AVX512];
    for (int b = 0; b < NB; ++b) {
        x[b] = xbase + (int64_t)idx[b] * xs;
        a0[b] = a1[b] = b0[b] = b1[b] = _mm512_setzero_ps();
    }
    if (fmt == FMT_FP8) {
        for (int k0 = 0; k0 < K; k0 += FP8_BLOCK) {
            const int n = K - k0 < FP8_BLOCK ? K - k0 : FP8_BLOCK, end = k0 + n;
            const float sa = wa->fscales[k0 / FP8_BLOCK], sb = wb->fscales[k0 / FP8_BLOCK];
            const __m512 ma = _mm512_set1_ps(sa * FP8_FAST_SHIFT), mb = _mm512_set1_ps(sb * FP8_FAST_SHIFT);
            int k = k0;
            if (n == FP8_BLOCK && fp8_block_fast_512(wa, k0, n) && fp8_block_fast_512(wb, k0, n)) {
                for (; k < end; k += 32) {
                    __m512 va[2], vb[2];
                    PREFETCH_CODES(wa, wb, k)
                    fp8x32_512(wa, k, ma, 1, va);
                    fp8x32_512(wb, k, mb, 1, vb);
                    ACC512(NB, 2, va, vb, k)
                }
            } else {
                for (; k + 32 <= end; k += 32) {
                    __m512 va[2], vb[2];
                    fp8x32_512(wa, k, ma, 0, va);
                    fp8x32_512(wb, k, mb, 0, vb);
                    ACC512(NB, 2, va, vb, k)
                }
                for (; k < end; k += 16) {             /* the row's last block: masked */
                    const __mmask16 m = mask16(end - k);
                    const __m512 wa0 = dec8_512(wa, k, m), wb0 = dec8_512(wb, k, m);
                    for (int b = 0; b < NB; ++b) {
                        const __m512 x0 = _mm512_maskz_loadu_ps(m, x[b] + k);
                        a0[b] = _mm512_fmadd_ps(wa0, x0, a0[b]);
                        b0[b] = _mm512_fmadd_ps(wb0, x0, b0[b]);
                    }
                }
            }
        }
    } else if (fmt == FMT_INT4) {              /* a table a group (G >= 32: whole chunks; a split K: 32s) */
        for (int g = 0, k = 0; k < K; ++g) {
            const __m512 tta = table512(wa, g), ttb = table512(wb, g);
            for (const int end = k + G < K ? k + G : K; k < end; k += CHUNK) {
                __m512 va[2], vb[2];
                PREFETCH_CODES(wa, wb, k / 2)
                nib32_512(wa->codes, k, tta, va);
                nib32_512(wb->codes, k, ttb, vb);
                ACC512(NB, 2, va, vb, k)
            }
        }
    } else {                                   /* mxfp4 (a group a chunk), nvfp4 (two groups a chunk) */
        const int ng = K / G, gpc = CHUNK / G;
        const __m512 lut = _mm512_loadu_ps(FP4_LUT);
        float sa[16], sb[16];
        for (int g0 = 0; g0 < ng; g0 += 16) {
            fp4_scales16_512(fmt, wa, g0, ng, sa);
            fp4_scales16_512(fmt, wb, g0, ng, sb);
            if (gpc == 1) {                    /* mxfp4: one scale a chunk, put into the table (the same products) */
                for (int g = g0; g < g0 + 16 && g < ng; ++g) {
                    const int k = g * G;
                    __m512 va[2], vb[2];
                    PREFETCH_CODES(wa, wb, k / 2)
                    nib32_512(wa->codes, k, _mm512_mul_ps(lut, _mm512_set1_ps(sa[g - g0])), va);
                    nib32_512(wb->codes, k, _mm512_mul_ps(lut, _mm512_set1_ps(sb[g - g0])), vb);
                    ACC512(NB, 2, va, vb, k)
                }
                continue;
            }
            /* nvfp4: lanes 0..7 hold elements of the chunk's first 16 (group j), lanes 8..15 of its second (j + 1):
               the scale vector is the 16 scales permuted by {j x 8, j + 1 x 8} */
            const __m512 scales_a = _mm512_loadu_ps(sa), scales_b = _mm512_loadu_ps(sb);
            __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            for (int g = g0; g < g0 + 16 && g + gpc <= ng; g += gpc) {
                const int k = g * G;
                __m512 va[2], vb[2];
                PREFETCH_CODES(wa, wb, k / 2)
                nib32_512(wa->codes, k, lut, va);
                nib32_512(wb->codes, k, lut, vb);
                const __m512 s_a = _mm512_permutexvar_ps(pair, scales_a), s_b = _mm512_permutexvar_ps(pair, scales_b);
                pair = _mm512_add_epi32(pair, _mm512_set1_epi32(2));
                va[0] = _mm512_mul_ps(va[0], s_a); va[1] = _mm512_mul_ps(va[1], s_a);
                vb[0] = _mm512_mul_ps(vb[0], s_b); vb[1] = _mm512_mul_ps(vb[1], s_b);
                ACC512(NB, 2, va, vb, k)
            }
            if (gpc == 2 && ng % 2 && g0 + 16 >= ng) {  /* nvfp4's last block of 16: K % 32 == 16 */
                const int k = (ng - 1) * G, j = ng - 1 - g0;
                const __m512 va = _mm512_mul_ps(fp4x16_512(wa->codes, k), _mm512_set1_ps(sa[j]));
                const __m512 vb = _mm512_mul_ps(fp4x16_512(wb->codes, k), _mm512_set1_ps(sb[j]));
                for (int b = 0; b < NB; ++b) {
                    const __m512 x0 = _mm512_loadu_ps(x[b] + k);
                    a0[b] = _mm512_fmadd_ps(va, x0, a0[b]);
                    b0[b] = _mm512_fmadd_ps(vb, x0, b0[b]);
                }
            }
        }
    }
    for (int b = 0; b < NB; ++b) {
        ra[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b]));
        rb[b] = _mm512_reduce_add_ps(_mm512_add_ps(b0[b], b1[b]));
    }
}

/* One row in element order (ft_dequantize_rows): the dot products' decoders, their permuted halves put back. */
T_AVX512Q static void dequant_row_avx512(int fmt, int G, const qrow *q, int K, float *o, float *tmp) {
    if (fmt == FMT_FP8) {
        for (int k0 = 0; k0 < K; k0 += FP8_BLOCK) {
            const int n = K - k0 < FP8_BLOCK ? K - k0 : FP8_BLOCK, end = k0 + n;
            const float s = q->fscales[k0 / FP8_BLOCK];
            const int fast = n == FP8_BLOCK && fp8_block_fast_512(q, k0, n);
            int k = k0;
            for (__m512 w[2]; k + 32 <= end; k += 32) {
                fp8x32_512(q, k, _mm512_set1_ps(s * FP8_FAST_SHIFT), fast, w);
                _mm512_storeu_ps(o + k, w[0]);
                _mm512_storeu_ps(o + k + 16, w[1]);
            }
            for (; k < end; k += 16) _mm512_mask_storeu_ps(o + k, mask16(end - k), dec8_512(q, k, mask16(end - k)));
        }
        return;
    }
    const int ng = K / G;
    float s[16];
    for (int k = 0; k < K; k += CHUNK) {
        const int g = k / G;
        __m512 w[2];
        if (K - k < CHUNK) {                   /* nvfp4's last block of 16 */
            fp4_scales16_512(fmt, q, g & ~15, ng, s);
            _mm512_storeu_ps(tmp, _mm512_mul_ps(fp4x16_512(q->codes, k), _mm512_set1_ps(s[g & 15])));
            for (int j = 0; j < 8; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[8 + j]; }
            break;
        }
        if (fmt == FMT_INT4) {
            nib32_512(q->codes, k, table512(q, g), w);
        } else {
            fp4_scales16_512(fmt, q, g & ~15, ng, s);
            nib32_512(q->codes, k, _mm512_loadu_ps(FP4_LUT), w);
            const __m512 sv = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(s[g & 15]),
                                                   _mm512_set1_ps(s[(g + CHUNK / G - 1) & 15]));
            w[0] = _mm512_mul_ps(w[0], sv);
            w[1] = _mm512_mul_ps(w[1], sv);
        }
        _mm512_storeu_ps(tmp, w[0]);
        _mm512_storeu_ps(tmp + 16, w[1]);
        for (int j = 0; j < 16; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[16 + j]; }
    }
}

#endif /* FT_QUANT_AVX512_H */
