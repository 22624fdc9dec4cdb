/* Decoders and dot products of the quantized expert kernel (quant_ffn.c, its only includer): static inline code.
 *
 * A row of a quantized matrix (qrow) is read in place from the store; weights are dequantized in registers to
 * fp32 exactly as proto/expert_format.py's decode formulas say (the same products, the same rounding: the decoded
 * weights are the reference's bit for bit, which ft_dequantize_rows exposes to the tests), then multiplied with
 * fp32 activations and summed in fp32:
 *   fp8    w = e4m3(code) * scale[r / 128][k / 128]
 *   int4   w = (u - zero[g]) * scale[g]                 g = k / G
 *   mxfp4  w = fp4(code) * 2**(e[g] - 127)
 *   nvfp4  w = fp4(code) * fp32(e4m3(s[g]) * global)
 * Loop order: weights outer, tokens inner. A call takes two rows and a register block of up to 4 tokens; every
 * weight vector is decoded once and multiplied into each token's accumulators, so B tokens cost one decode and B
 * FMAs a vector. The loops walk groups (fp8: 128-blocks), so no index is divided by the group size.
 *   int4, AVX-512: each group's 16 possible weights form a table ((u - z) * s for the 16 codes), a code is a table
 *     index (vpermps; G >= 32, so a table serves whole chunks). AVX2: no table (a lookup on 8 lanes is two vpermps
 *     and a blend): the fp32 bits 2**23 + u minus 2**23 + z give u - z exactly, times s.
 *   mxfp4 / nvfp4: codes go through the constant fp4 value table (AVX-512 vpermps on FP4_LUT; AVX2 vpshufb on the
 *     nibbles into the fp16 high bytes FP4_F16_HI, then vcvtph2ps) and the vector is multiplied by its group's
 *     scale (the reference's product). The scales of 8 (AVX2) / 16 (AVX-512) groups are decoded at once by vector
 *     code. nvfp4's 16-wide groups no longer cost a table each.
 *   Two codes share a byte, so a chunk of 32 weights (16 bytes) decodes into its even elements and its odd
 *     elements: the activations of 4-bit formats are stored permuted the same way, per block of 32 (or a last
 *     block of 16): position p < n/2 holds element 2p, position n/2 + p holds element 2p + 1 (perm4_pos).
 *   fp8: the sign and magnitude bits are moved into fp32 bits of code * 2**-120 and multiplied by scale * 2**120
 *     (the same product as code * scale, one rounding). A 128-block is tested once for NaN codes and a scale
 *     >= 2**8; such blocks (and a row's partial last block) take the general decoder (fp16 bits of code / 256,
 *     vcvtph2ps).
 * Numerics: the weights are exact, the sums are fp32 in the vector lanes' order (not the reference's float64), so
 * the kernel matches the reference to fp32 accumulation error, not bit for bit.
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
/* The fp16 bits of the 16 fp4 values have a zero low byte (two significant bits at most): their high bytes. */
static const uint8_t FP4_F16_HI[16] = {0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46,
                                       0x80, 0xB8, 0xBC, 0xBE, 0xC0, 0xC2, 0xC4, 0xC6};
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
    return f32_from_bits(e == 0 ? 0x00400000u : e == 255 ? 0x7f800000u : (uint32_t)e << 23);
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

/* 4-bit rows are short (a qwen3-30b-a3b down row is 384 bytes) and a thread walks rows of two matrices at once,
   so the hardware prefetcher, which restarts at every 4 KiB page, leaves the codes' loads waiting on DRAM: each
   new line of codes asks for the line PREFETCH_AHEAD bytes ahead in both rows (the next rows follow in the store;
   docs/BENCHMARKS.md, "CPU expert kernel", has the before / after). */
#define PREFETCH_AHEAD 2048
#define PREFETCH_CODES(wa, wb, off)       /* off: the codes' byte offset, at most one line apart each call */   \
    if (((off) & 63) == 0) {                                                                                    \
        _mm_prefetch((const char *)((wa)->codes + (off) + PREFETCH_AHEAD), _MM_HINT_T0);                        \
        _mm_prefetch((const char *)((wb)->codes + (off) + PREFETCH_AHEAD), _MM_HINT_T0);                        \
    }

#include "quant_avx512.h"   /* 16 lanes */
#include "quant_avx2.h"     /* 8 lanes */

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
