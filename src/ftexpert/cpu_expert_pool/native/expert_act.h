/* What an expert computes besides its matrices (proto/expert_act.py), shared by expert_ffn.c and quant_ffn.c:
 * the activation that turns gate . x and up . x into h, and the biases at the end of the expert's row.
 *
 *   FT_ACT_SILU           h = silu(g) * u
 *   FT_ACT_SWIGLU_CLAMP   gpt-oss: g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha g)
 *
 * with g = gate . x + b_gate and u = up . x + b_up for the clamped SwiGLU (whose experts always have biases), and its output
 * down . h + b_down, times the route weight (the reference's order: out += w * (down . h + b_down)). The biases
 * are 2I + H values of bias_dtype at bias_offset bytes from the expert's first byte: gate's I, up's I, down's H.
 * A NULL descriptor is silu without biases. The activation is chosen once per row of tokens (ft_gate_rows), never
 * per element. Mirrored in cpu_expert_pool/native/act_desc.py.
 */
#ifndef FT_EXPERT_ACT_H
#define FT_EXPERT_ACT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FT_ACT_SILU = 0, FT_ACT_SWIGLU_CLAMP = 1 };
enum { FT_BIAS_BF16 = 1, FT_BIAS_F16 = 2, FT_BIAS_F32 = 3 };

typedef struct {
    int64_t kind;          /* FT_ACT_* */
    int64_t bias_offset;   /* bytes from the expert's first byte to its biases (>= 0) */
    int64_t bias_dtype;    /* FT_BIAS_*: the model's compute dtype */
    double alpha, limit;   /* swiglu-clamp: the sigmoid's gain and the clamp (> 0) */
} ft_expert_act;

static inline int64_t ft_bias_item(int64_t dtype) { return dtype == FT_BIAS_F32 ? 4 : 2; }

/* 0 when the descriptor is usable for experts of `expert_stride` bytes (a NULL one is), else -1. */
static inline int ft_act_check(const ft_expert_act *a, int H, int I, int64_t expert_stride) {
    if (!a) return 0;
    if (a->kind != FT_ACT_SWIGLU_CLAMP || !(a->alpha > 0 && a->limit > 0) || a->bias_offset < 0) return -1;
    if (a->bias_dtype < FT_BIAS_BF16 || a->bias_dtype > FT_BIAS_F32) return -1;
    return a->bias_offset + (2 * (int64_t)I + H) * ft_bias_item(a->bias_dtype) <= expert_stride ? 0 : -1;
}

/* A descriptor always carries biases (proto/expert_act.py: only swiglu-clamp experts have them). */
static inline int ft_act_biased(const ft_expert_act *a) { return a != NULL; }

static inline float ft_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 0x3ffu;
    float f;
    if (exp == 31) { uint32_t u = sign | 0x7f800000u | (man << 13); memcpy(&f, &u, 4); return f; }
    if (exp == 0) f = ldexpf((float)man, -24);                     /* zero and subnormals */
    else { uint32_t u = ((exp + 112) << 23) | (man << 13); memcpy(&f, &u, 4); }
    return sign ? -f : f;
}

/* Bias idx (0 .. 2I + H) of the expert at `expert` as fp32; 0 without a descriptor (silu). */
static inline float ft_bias(const ft_expert_act *a, const void *expert, int64_t idx) {
    if (!ft_act_biased(a)) return 0.0f;
    const uint8_t *p = (const uint8_t *)expert + a->bias_offset + idx * ft_bias_item(a->bias_dtype);
    uint16_t v;
    float f;
    switch (a->bias_dtype) {
    case FT_BIAS_F32: memcpy(&f, p, 4); return f;
    case FT_BIAS_F16: memcpy(&v, p, 2); return ft_f16_to_f32(v);
    default: { memcpy(&v, p, 2); uint32_t u = (uint32_t)v << 16; memcpy(&f, &u, 4); return f; }
    }
}

/* nb tokens of one channel: g[b] (gate . x) becomes h[b] from u[b] (up . x), with that channel's gate and up biases
   bg, bu (0 without biases). A NULL descriptor: silu, biases not added (the path of every silu model). */
static inline void ft_gate_rows(const ft_expert_act *a, float *g, const float *u, int nb, float bg, float bu) {
    if (!a) {
        for (int b = 0; b < nb; ++b) g[b] = g[b] / (1.0f + expf(-g[b])) * u[b];
        return;
    }
    const float alpha = (float)a->alpha, limit = (float)a->limit;
    for (int b = 0; b < nb; ++b) {
        float gb = g[b] + bg, ub = u[b] + bu;            /* clamped as torch.clamp does: NaN stays NaN */
        gb = gb > limit ? limit : gb;
        ub = ub > limit ? limit : ub < -limit ? -limit : ub;
        g[b] = (ub + 1.0f) * (gb / (1.0f + expf(-alpha * gb)));
    }
}
#endif /* FT_EXPERT_ACT_H */
