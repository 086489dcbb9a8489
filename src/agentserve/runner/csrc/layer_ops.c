/* The small per-layer operations of a bfloat16 forward, one call each:
 * residual add + RMSNorm, rotary embedding + KV-cache write, SiLU-and-multiply.
 *
 * In torch each of these is 3-10 small kernels (casts, powers, means, cats,
 * index copies), and at decode sizes their dispatch, about 2-5 us a kernel,
 * costs more than their arithmetic: some 300-400 ops and 3-4 ms of a
 * SmolLM2 step. Here they are one pass over the rows each.
 *
 * Each rounds where the torch expressions it replaces round (transformers'
 * RMSNorm: the normalized value is cast to bfloat16 before the weight
 * multiplies it; rotate-half rotary: x*cos and rotate(x)*sin each rounded,
 * then their sum; SiLU rounded, then the product), so results equal torch's
 * up to the order of the RMS sum. Only bfloat16 is handled: float32 keeps
 * torch's kernels, the path that must match transformers bit for bit. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_neg.h"

static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* h [T, dim] (+)= delta (when not NULL), then out = weight * bf16(h * rsqrt(mean(h^2) + eps)). */
void agentserve_add_rms_norm(bf16_t *h, const bf16_t *delta, const bf16_t *weight, bf16_t *out, long T, long dim,
                             float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * dim >= 65536)
    for (long t = 0; t < T; t++) {
        bf16_t *x = h + t * dim;
        float ss = 0.0f;
        if (delta) {
            const bf16_t *dl = delta + t * dim;
            #pragma omp simd reduction(+:ss)
            for (long j = 0; j < dim; j++) {
                float v = rnd(bf16_to_f32(x[j]) + bf16_to_f32(dl[j]));
                x[j] = f32_to_bf16(v);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+:ss)
            for (long j = 0; j < dim; j++) {
                float v = bf16_to_f32(x[j]);
                ss += v * v;
            }
        }
        float r = 1.0f / sqrtf(ss / (float)dim + eps);
        bf16_t *o = out + t * dim;
        #pragma omp simd
        for (long j = 0; j < dim; j++) o[j] = f32_to_bf16(bf16_to_f32(weight[j]) * rnd(bf16_to_f32(x[j]) * r));
    }
}

/* qkv [T, (H + 2 KVH) * D] rows of a fused q/k/v projection. Rotates q and k
 * (rotate-half, cos/sin tables [positions, D]) and writes q to q_out [T, H, D],
 * k and v to the cache [KVH, cache_tokens, D] at slots[t]. */
void agentserve_rope_kv(const bf16_t *qkv, long T, int H, int KVH, int D, const bf16_t *cos_t, const bf16_t *sin_t,
                        const int64_t *positions, bf16_t *k_cache, bf16_t *v_cache, long cache_tokens,
                        const int64_t *slots, bf16_t *q_out, int nthreads) {
    const long width = (long)(H + 2 * KVH) * D;
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T >= 64)
    for (long t = 0; t < T; t++) {
        const bf16_t *row = qkv + t * width;
        const bf16_t *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        const long slot = slots[t];
        for (int h = 0; h < H + KVH; h++) {
            const bf16_t *x = row + (long)h * D;
            bf16_t *dst = h < H ? q_out + (t * H + h) * (long)D : k_cache + ((long)(h - H) * cache_tokens + slot) * D;
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = bf16_to_f32(x[j]), b = bf16_to_f32(x[j + half]);
                dst[j] = f32_to_bf16(rnd(a * bf16_to_f32(c[j])) + rnd(-b * bf16_to_f32(s[j])));
                dst[j + half] = f32_to_bf16(rnd(b * bf16_to_f32(c[j + half])) + rnd(a * bf16_to_f32(s[j + half])));
            }
        }
        for (int h = 0; h < KVH; h++)
            memcpy(v_cache + ((long)h * cache_tokens + slot) * D, row + (long)(H + KVH + h) * D, sizeof(bf16_t) * D);
    }
}

/* bf16(silu(x)) * u as agentserve_silu_mul rounds it: x / (1 + e) for x >= 0,
 * x * e / (1 + e) below, e = exp(-|x|) (no overflow either side); 0 where
 * torch's exp(-x) overflows. */
static inline float silu_mul1(float x, float u) {
    float e = exp_neg(-fabsf(x));
    float s = x >= 0.0f ? x / (1.0f + e) : x < -87.0f ? 0.0f * x : x * e / (1.0f + e);
    return rnd(s) * u;
}

/* gu [T, 2 * inter] (gate then up) -> out [T, inter] = bf16(silu(gate)) * up. */
void agentserve_silu_mul(const bf16_t *gu, long T, long inter, bf16_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * inter >= 65536)
    for (long t = 0; t < T; t++) {
        const bf16_t *g = gu + t * 2 * inter, *u = g + inter;
        bf16_t *o = out + t * inter;
        long j = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; j + 16 <= inter; j += 16) {
            __m512 x = bf16x16_load(g + j);
            __m512 e = exp_neg16(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
            __m512 d = _mm512_add_ps(one, e);
            __m512 s = _mm512_div_ps(x, d);
            __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
            s = _mm512_mask_div_ps(s, neg, _mm512_mul_ps(x, e), d);
            s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), x, zero);
            bf16x16_store(o + j, _mm512_mul_ps(bf16x16_round(s), bf16x16_load(u + j)));
        }
#endif
        for (; j < inter; j++) o[j] = f32_to_bf16(silu_mul1(bf16_to_f32(g[j]), bf16_to_f32(u[j])));
    }
}
