/* Test build only (FT_EMULATE_AVX512, tests/cpu_expert_pool/test_cpu_pool_quant.py): the AVX-512 and AVX2 code of
 * quant_dots.h on SIMDe's portable implementations of the intrinsics (Debian: libsimde-dev), so that a machine
 * without AVX-512 runs that code path against the reference. The intrinsics SIMDe 0.7.4 lacks are written out
 * here lane by lane from Intel's definitions. */
#ifndef FT_SIMDE_SHIM_H
#define FT_SIMDE_SHIM_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef simde__mmask16 __mmask16;

static inline __m512 _mm512_cvtepi32_ps(__m512i a) {
    int32_t v[16]; float r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; ++i) r[i] = (float)v[i];
    return _mm512_loadu_ps(r);
}
static inline __m512i _mm512_cvtepu8_epi32(__m128i a) {          /* the 16 bytes of a, zero-extended */
    uint8_t v[16]; int32_t r[16];
    _mm_storeu_si128((__m128i *)v, a);
    for (int i = 0; i < 16; ++i) r[i] = v[i];
    return _mm512_loadu_si512(r);
}
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) {          /* the 16 bytes of a, sign-extended */
    int8_t v[16]; int32_t r[16];
    _mm_storeu_si128((__m128i *)v, a);
    for (int i = 0; i < 16; ++i) r[i] = v[i];
    return _mm512_loadu_si512(r);
}
static inline uint32_t _mm256_cmpeq_epi8_mask(__m256i a, __m256i b) {
    int8_t va[32], vb[32];
    _mm256_storeu_si256((__m256i *)va, a);
    _mm256_storeu_si256((__m256i *)vb, b);
    uint32_t m = 0;
    for (int i = 0; i < 32; ++i) m |= (uint32_t)(va[i] == vb[i]) << i;
    return m;
}
static inline __mmask16 _mm256_cmpeq_epi16_mask(__m256i a, __m256i b) {
    int16_t va[16], vb[16];
    _mm256_storeu_si256((__m256i *)va, a);
    _mm256_storeu_si256((__m256i *)vb, b);
    __mmask16 m = 0;
    for (int i = 0; i < 16; ++i) m |= (__mmask16)((va[i] == vb[i]) << i);
    return m;
}
static inline __m512 _mm512_cvtph_ps(__m256i a) {                 /* 16 fp16 -> fp32, from SIMDe's 8-lane one */
    float r[16];
    _mm256_storeu_ps(r, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
    _mm256_storeu_ps(r + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
    return _mm512_loadu_ps(r);
}
static inline __m128i _mm_maskz_loadu_epi8(__mmask16 k, const void *p) {
    uint8_t r[16];
    for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? ((const uint8_t *)p)[i] : 0;
    return _mm_loadu_si128((const __m128i *)r);
}
static inline __m512i _mm512_maskz_loadu_epi8(uint64_t k, const void *p) {
    uint8_t r[64];
    for (int i = 0; i < 64; ++i) r[i] = (k >> i) & 1 ? ((const uint8_t *)p)[i] : 0;
    return _mm512_loadu_si512(r);
}
static inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const float *p) {
    float r[16];
    for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? p[i] : 0.0f;
    return _mm512_loadu_ps(r);
}
static inline void _mm512_mask_storeu_ps(float *p, __mmask16 k, __m512 a) {
    float v[16];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; ++i) if ((k >> i) & 1) p[i] = v[i];
}
static inline __m512i _mm512_cvtps_epi32(__m512 a) {           /* nearest, ties to even (MXCSR's default) */
    float v[16]; int32_t r[16];
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; ++i) r[i] = (int32_t)rintf(v[i]);
    return _mm512_loadu_si512(r);
}
static inline float _mm512_reduce_max_ps(__m512 a) {
    float v[16], m;
    _mm512_storeu_ps(v, a);
    m = v[0];
    for (int i = 1; i < 16; ++i) m = v[i] > m ? v[i] : m;
    return m;
}
static inline int _mm512_reduce_add_epi32(__m512i a) {
    int32_t v[16], s = 0;
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}
static inline __m128i _mm512_cvtepi32_epi8(__m512i a) {        /* the low byte of each lane (vpmovdb) */
    int32_t v[16]; int8_t r[16];
    _mm512_storeu_si512(v, a);
    for (int i = 0; i < 16; ++i) r[i] = (int8_t)v[i];
    return _mm_loadu_si128((const __m128i *)r);
}
static inline float _mm512_reduce_add_ps(__m512 a) {
    float v[16], s = 0;
    _mm512_storeu_ps(v, a);
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}
#endif /* FT_SIMDE_SHIM_H */
