/* The AVX2 + FMA + F16C decoders and dot products of the quantized expert kernel: static inline code included by
 * quant_dots.h after quant_avx512.h (whose fp8 helpers it shares), inside its x86-64 block. */
#ifndef FT_QUANT_AVX2_H
#define FT_QUANT_AVX2_H

/* int4: 32 weights at k of a group (zf = 2**23 + zero, s its scale) in the permuted order (w[0] elements 0,2..14,
   w[1] 16,18..30, w[2] 1,3..15, w[3] 17..31), without a table (on 8 lanes a 16-entry lookup costs two vpermps and
   a blend): the fp32 bits of 2**23 + u (u | 0x4B000000) minus 2**23 + z is u - z exactly, times s the reference's
   product. */
T_AVX2Q INLINE_Q void int4x32_magic_256(const uint8_t *codes, int k, __m256 zf, __m256 s, __m256 *w) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(codes + k / 2));
    const __m256i v0 = _mm256_cvtepu8_epi32(q), v1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
    const __m256i m = _mm256_set1_epi32(0x4B000000), f = _mm256_set1_epi32(15);
#define INT4_MAGIC(u) _mm256_mul_ps(_mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(u, m)), zf), s)
    w[0] = INT4_MAGIC(_mm256_and_si256(v0, f));
    w[1] = INT4_MAGIC(_mm256_and_si256(v1, f));
    w[2] = INT4_MAGIC(_mm256_srli_epi32(v0, 4));
    w[3] = INT4_MAGIC(_mm256_srli_epi32(v1, 4));
#undef INT4_MAGIC
}
/* fp4 codes -> fp16 (FP4_F16_HI: vpshufb on the nibbles, then the byte as the high byte of a word) -> fp32.
   q: the codes' bytes in both 128-bit lanes; lane 0 decodes the low nibbles (even elements), lane 1 the high ones. */
T_AVX2Q INLINE_Q __m256i fp4_f16_256(__m256i q) {
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                         _mm256_set1_epi8(15));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_F16_HI)), nib);
}
/* 32 fp4 values (unscaled) at k, in int4x32_magic_256's order. */
T_AVX2Q INLINE_Q void fp4x32_256(const uint8_t *codes, int k, __m256 *w) {
    const __m256i t = fp4_f16_256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(codes + k / 2))));
    const __m256i lo = _mm256_unpacklo_epi8(_mm256_setzero_si256(), t), hi = _mm256_unpackhi_epi8(_mm256_setzero_si256(), t);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    w[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    w[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    w[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}
/* nvfp4's last block of 16 (one group): w[0] the even elements, w[1] the odd ones (unscaled). */
T_AVX2Q INLINE_Q void fp4x16_256(const uint8_t *codes, int k, __m256 *w) {
    const __m256i t = fp4_f16_256(_mm256_broadcastsi128_si256(_mm_loadl_epi64((const __m128i *)(codes + k / 2))));
    const __m256i lo = _mm256_unpacklo_epi8(_mm256_setzero_si256(), t);
    w[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    w[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
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
/* The scales of groups [g, g + 8) of an mxfp4 / nvfp4 row with n groups, into s[8], as fp4_group_scale gives
   them (groups from n on read as code 0). */
T_AVX2Q INLINE_Q void fp4_scales8_256(int fmt, const qrow *r, int g, int n, float *s) {
    uint64_t b = 0;
    memcpy(&b, r->bscales + g, g + 8 <= n ? 8 : (size_t)(n - g));
    const __m128i q = _mm_cvtsi64_si128((long long)b);
    if (fmt == FMT_MXFP4) {            /* 2**(e - 127): e << 23; e = 0 -> 2**-127; e = 255 -> inf by itself */
        const __m256i e = _mm256_cvtepu8_epi32(q);
        const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000),
                                                _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
        _mm256_storeu_ps(s, _mm256_castsi256_ps(bits));
    } else {                           /* e4m3 (code / 256 * 256, exact) * global */
        _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_mul_ps(fp8x8_256(q, 1), _mm256_set1_ps(256.0f)),
                                          _mm256_set1_ps(r->global)));
    }
}
/* The general decoder: 8 codes at p -> code * s. */
T_AVX2Q INLINE_Q __m256 dec8_256(const uint8_t *p, float s) {
    const __m256 f = fp8x8_256(_mm_loadl_epi64((const __m128i *)p), 1);
    if (!fp8_scale_exact(s)) return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(256.0f)), _mm256_set1_ps(s));
    return _mm256_mul_ps(f, _mm256_set1_ps(s * 256.0f));
}
T_AVX2Q INLINE_Q int fp8_nan_256(const uint8_t *p, int n) {   /* any 0x7f / 0xff among n codes (n % 32 == 0) */
    const __m256i m = _mm256_set1_epi8(0x7f);
    __m256i any = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 32)
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), m), m));
    return !_mm256_testz_si256(any, any);
}
T_AVX2Q INLINE_Q __m256 fp8_bits_256(__m128i q) {              /* the low 8 codes of q, as fp8_bits_512 */
    const __m256i v = _mm256_slli_epi32(_mm256_cvtepi8_epi32(q), 20);
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0x87F00000u)));
}
/* fp8: 16 weights at k. fast: the block's scale passes fp8_fast_scale and its codes hold no NaN (m = s * 2**120);
   otherwise the general decoder. */
T_AVX2Q INLINE_Q void fp8x16_256(const qrow *r, int k, __m256 m, int fast, __m256 *w) {
    if (fast) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(r->codes + k));
        w[0] = _mm256_mul_ps(fp8_bits_256(q), m);
        w[1] = _mm256_mul_ps(fp8_bits_256(_mm_srli_si128(q, 8)), m);
    } else {
        const float s = r->fscales[k / FP8_BLOCK];
        w[0] = dec8_256(r->codes + k, s);
        w[1] = dec8_256(r->codes + k + 8, s);
    }
}
/* The fp8 block of k0 (k0 % 128 == 0, n its length): 1 where the fast decoder may decode all of it. */
T_AVX2Q INLINE_Q int fp8_block_fast_256(const qrow *r, int k0, int n) {
    return fp8_fast_scale(r->fscales[k0 / FP8_BLOCK]) && n % 32 == 0 && !fp8_nan_256(r->codes + k0, n);
}
T_AVX2Q static inline float hsum256q(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
/* The weights of both rows at k (nv vectors each, 8 elements of x apart) into every token's accumulators. */
#define ACC256(NB, NV, va, vb, k)                                                                                \
    for (int b = 0; b < NB; ++b) {                                                                             \
        for (int v = 0; v < NV; ++v) {                                                                         \
            const __m256 xv = _mm256_loadu_ps(x[b] + (k) + 8 * v);                                           \
            if (NB > 2 || (v & 1) == 0) {  /* 16 registers: one accumulator a row and token above 2 tokens */  \
                a0[b] = _mm256_fmadd_ps(va[v], xv, a0[b]); b0[b] = _mm256_fmadd_ps(vb[v], xv, b0[b]);         \
            } else {                                                                                           \
                a1[b] = _mm256_fmadd_ps(va[v], xv, a1[b]); b1[b] = _mm256_fmadd_ps(vb[v], xv, b1[b]);         \
            }                                                                                                  \
        }                                                                                                      \
    }
#define SCALE256(w, lo, hi, s0, s1) do { (w)[lo] = _mm256_mul_ps((w)[lo], s0); (w)[hi] = _mm256_mul_ps((w)[hi], s1); } while (0)

/* Weights outer, tokens inner: each weight vector is decoded once a call and applied to the NB tokens. */
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
    if (fmt == FMT_FP8) {
        for (int k0 = 0; k0 < K; k0 += FP8_BLOCK) {
            const int n = K - k0 < FP8_BLOCK ? K - k0 : FP8_BLOCK, end = k0 + n;
            const float sa = wa->fscales[k0 / FP8_BLOCK], sb = wb->fscales[k0 / FP8_BLOCK];
            const __m256 ma = _mm256_set1_ps(sa * FP8_FAST_SHIFT), mb = _mm256_set1_ps(sb * FP8_FAST_SHIFT);
            int k = k0;
            if (n == FP8_BLOCK && fp8_block_fast_256(wa, k0, n) && fp8_block_fast_256(wb, k0, n)) {
                for (; k < end; k += 16) {
                    __m256 va[2], vb[2];
                    PREFETCH_CODES(wa, wb, k)
                    fp8x16_256(wa, k, ma, 1, va);
                    fp8x16_256(wb, k, mb, 1, vb);
                    ACC256(NB, 2, va, vb, k)
                }
            } else {
                for (; k + 16 <= end; k += 16) {
                    __m256 va[2], vb[2];
                    fp8x16_256(wa, k, ma, 0, va);
                    fp8x16_256(wb, k, mb, 0, vb);
                    ACC256(NB, 2, va, vb, k)
                }
                for (; k < end; ++k) {
                    const float fa = fp8_weight(wa, k), fb = fp8_weight(wb, k);
                    for (int b = 0; b < NB; ++b) { ta[b] += fa * x[b][k]; tb[b] += fb * x[b][k]; }
                }
            }
        }
    } else if (fmt == FMT_INT4) {              /* G >= 32: whole chunks; a split K: 32s */
        for (int g = 0, k = 0; k < K; ++g) {
            const __m256 za = _mm256_set1_ps(8388608.0f + wa->zeros[g]), zb = _mm256_set1_ps(8388608.0f + wb->zeros[g]);
            const __m256 sa = _mm256_set1_ps(wa->fscales[g]), sb = _mm256_set1_ps(wb->fscales[g]);
            for (const int end = k + G < K ? k + G : K; k < end; k += CHUNK) {
                __m256 va[4], vb[4];
                PREFETCH_CODES(wa, wb, k / 2)
                int4x32_magic_256(wa->codes, k, za, sa, va);
                int4x32_magic_256(wb->codes, k, zb, sb, vb);
                ACC256(NB, 4, va, vb, k)
            }
        }
    } else {                                   /* mxfp4 (a group a chunk), nvfp4 (two groups a chunk) */
        const int ng = K / G, gpc = CHUNK / G;
        float sa[8], sb[8];
        for (int g0 = 0; g0 < ng; g0 += 8) {
            fp4_scales8_256(fmt, wa, g0, ng, sa);
            fp4_scales8_256(fmt, wb, g0, ng, sb);
            for (int g = g0; g < g0 + 8 && g + gpc <= ng; g += gpc) {
                const int k = g * G, j = g - g0, j1 = j + gpc - 1;
                __m256 va[4], vb[4];
                PREFETCH_CODES(wa, wb, k / 2)
                fp4x32_256(wa->codes, k, va);
                fp4x32_256(wb->codes, k, vb);
                const __m256 sa0 = _mm256_set1_ps(sa[j]), sa1 = _mm256_set1_ps(sa[j1]);
                const __m256 sb0 = _mm256_set1_ps(sb[j]), sb1 = _mm256_set1_ps(sb[j1]);
                SCALE256(va, 0, 1, sa0, sa1); SCALE256(va, 2, 3, sa0, sa1);
                SCALE256(vb, 0, 1, sb0, sb1); SCALE256(vb, 2, 3, sb0, sb1);
                ACC256(NB, 4, va, vb, k)
            }
            if (gpc == 2 && ng % 2 && g0 + 8 >= ng) {   /* nvfp4's last block of 16: K % 32 == 16 */
                const int k = (ng - 1) * G, j = ng - 1 - g0;
                __m256 va[2], vb[2];
                fp4x16_256(wa->codes, k, va);
                fp4x16_256(wb->codes, k, vb);
                const __m256 sa0 = _mm256_set1_ps(sa[j]), sb0 = _mm256_set1_ps(sb[j]);
                SCALE256(va, 0, 1, sa0, sa0); SCALE256(vb, 0, 1, sb0, sb0);
                ACC256(NB, 2, va, vb, k)
            }
        }
    }
    for (int b = 0; b < NB; ++b) {
        ra[b] = hsum256q(_mm256_add_ps(a0[b], a1[b])) + ta[b];
        rb[b] = hsum256q(_mm256_add_ps(b0[b], b1[b])) + tb[b];
    }
}

/* One row in element order (ft_dequantize_rows): the dot products' decoders, their permuted halves put back. */
T_AVX2Q static void dequant_row_avx2(int fmt, int G, const qrow *q, int K, float *o, float *tmp) {
    if (fmt == FMT_FP8) {
        for (int k0 = 0; k0 < K; k0 += FP8_BLOCK) {
            const int n = K - k0 < FP8_BLOCK ? K - k0 : FP8_BLOCK, end = k0 + n;
            const float s = q->fscales[k0 / FP8_BLOCK];
            const int fast = n == FP8_BLOCK && fp8_block_fast_256(q, k0, n);
            int k = k0;
            for (__m256 w[2]; k + 16 <= end; k += 16) {
                fp8x16_256(q, k, _mm256_set1_ps(s * FP8_FAST_SHIFT), fast, w);
                _mm256_storeu_ps(o + k, w[0]);
                _mm256_storeu_ps(o + k + 8, w[1]);
            }
            for (; k + 8 <= end; k += 8) _mm256_storeu_ps(o + k, dec8_256(q->codes + k, s));
            for (; k < end; ++k) o[k] = fp8_weight(q, k);
        }
        return;
    }
    const int ng = K / G;
    float s[8];
    __m256 w[4];
    for (int k = 0; k < K; k += CHUNK) {
        const int g = k / G, tail = K - k < CHUNK;
        if (fmt == FMT_INT4) {
            int4x32_magic_256(q->codes, k, _mm256_set1_ps(8388608.0f + q->zeros[g]), _mm256_set1_ps(q->fscales[g]), w);
        } else {
            fp4_scales8_256(fmt, q, g & ~7, ng, s);
            const __m256 s0 = _mm256_set1_ps(s[g & 7]), s1 = _mm256_set1_ps(s[(g + CHUNK / G - 1) & 7]);
            if (tail) {
                fp4x16_256(q->codes, k, w);
                SCALE256(w, 0, 1, s0, s0);
            } else {
                fp4x32_256(q->codes, k, w);
                SCALE256(w, 0, 1, s0, s1); SCALE256(w, 2, 3, s0, s1);
            }
        }
        const int half = tail ? 8 : 16;
        if (tail) { _mm256_storeu_ps(tmp, w[0]); _mm256_storeu_ps(tmp + 8, w[1]); }
        else for (int i = 0; i < 4; ++i) _mm256_storeu_ps(tmp + 8 * i, w[i]);
        for (int j = 0; j < half; ++j) { o[k + 2 * j] = tmp[j]; o[k + 2 * j + 1] = tmp[half + j]; }
    }
}

#endif /* FT_QUANT_AVX2_H */
