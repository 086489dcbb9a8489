/* The small per-layer operations of a bfloat16 forward, one call each:
 * residual add + RMSNorm, rotary embedding + KV-cache write, SiLU-and-multiply,
 * tanh-GELU-and-multiply (Gemma's GeGLU); float32 forms of the ones Gemma 3 uses.
 *
 * In torch each of these is 3-10 small kernels (casts, powers, means, cats,
 * index copies), and at decode sizes their dispatch, about 2-5 us a kernel,
 * costs more than their arithmetic: some 300-400 ops and 3-4 ms of a
 * SmolLM2 step. Here they are one pass over the rows each.
 *
 * Each rounds where the torch expressions it replaces round (transformers'
 * RMSNorm: the normalized value is cast to bfloat16 before the weight
 * multiplies it; rotate-half rotary: x*cos and rotate(x)*sin each rounded,
 * then their sum; SiLU or GELU rounded, then the product), so results equal torch's
 * up to the order of the RMS sum. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_neg.h"

static inline float rnd(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* h [T, dim] (+)= delta (when not NULL; first normed by delta_weight when that
 * is not NULL, Gemma's norm on a sublayer's output before its residual add),
 * then out = weight * bf16(h * rsqrt(mean(h^2) + eps)). */
void agentserve_add_rms_norm(bf16_t *h, const bf16_t *delta, const bf16_t *delta_weight, const bf16_t *weight,
                             bf16_t *out, long T, long dim, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * dim >= 65536)
    for (long t = 0; t < T; t++) {
        bf16_t *x = h + t * dim;
        float ss = 0.0f;
        if (delta) {
            const bf16_t *dl = delta + t * dim;
            float rd = 0.0f;
            if (delta_weight) {
                float sd = 0.0f;
                #pragma omp simd reduction(+:sd)
                for (long j = 0; j < dim; j++) sd += bf16_to_f32(dl[j]) * bf16_to_f32(dl[j]);
                rd = 1.0f / sqrtf(sd / (float)dim + eps);
            }
            if (delta_weight) {
                #pragma omp simd reduction(+:ss)
                for (long j = 0; j < dim; j++) {
                    float v = rnd(bf16_to_f32(x[j]) + rnd(bf16_to_f32(delta_weight[j]) * rnd(bf16_to_f32(dl[j]) * rd)));
                    x[j] = f32_to_bf16(v);
                    ss += v * v;
                }
            } else {
                #pragma omp simd reduction(+:ss)
                for (long j = 0; j < dim; j++) {
                    float v = rnd(bf16_to_f32(x[j]) + bf16_to_f32(dl[j]));
                    x[j] = f32_to_bf16(v);
                    ss += v * v;
                }
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

/* The float32 forms, for float32 compute on GGUF-kept weights (where the
 * projections' activations are quantized anyway): torch's float32 expressions,
 * rounded where they round, the sums in another order. The dense float32 path,
 * which must match transformers bit for bit, keeps torch's own kernels. */

static inline float rms_scale_f32(const float *x, long n, float eps) {
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (long j = 0; j < n; j++) ss += x[j] * x[j];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* agentserve_add_rms_norm in float32: h += delta_weight * (delta * rsqrt(...)) (or
 * + delta), out = weight * (h * rsqrt(mean(h^2) + eps)). */
void agentserve_add_rms_norm_f32(float *h, const float *delta, const float *delta_weight, const float *weight,
                                 float *out, long T, long dim, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * dim >= 65536)
    for (long t = 0; t < T; t++) {
        float *x = h + t * dim;
        if (delta) {
            const float *dl = delta + t * dim;
            if (delta_weight) {
                float rd = rms_scale_f32(dl, dim, eps);
                #pragma omp simd
                for (long j = 0; j < dim; j++) x[j] = x[j] + delta_weight[j] * (dl[j] * rd);
            } else {
                #pragma omp simd
                for (long j = 0; j < dim; j++) x[j] = x[j] + dl[j];
            }
        }
        float r = rms_scale_f32(x, dim, eps);
        float *o = out + t * dim;
        #pragma omp simd
        for (long j = 0; j < dim; j++) o[j] = weight[j] * (x[j] * r);
    }
}

/* qkv [T, (H + 2 KVH) * D] rows of a fused q/k/v projection. Norms q and k per
 * head when qk_norm ([H + KVH, D] weights) is not NULL, rotates them
 * (rotate-half, cos/sin tables [positions, D]) and writes q to q_out [T, H, D],
 * k and v to the cache [KVH, cache_tokens, D] at slots[t]. */
void agentserve_rope_kv(const bf16_t *qkv, long T, int H, int KVH, int D, const bf16_t *qk_norm, float eps,
                        const bf16_t *cos_t, const bf16_t *sin_t, const int64_t *positions, bf16_t *k_cache,
                        bf16_t *v_cache, long cache_tokens, const int64_t *slots, bf16_t *q_out, int nthreads) {
    const long width = (long)(H + 2 * KVH) * D;
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T >= 64)
    for (long t = 0; t < T; t++) {
        const bf16_t *row = qkv + t * width;
        const bf16_t *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        const long slot = slots[t];
        float xn[D];
        for (int h = 0; h < H + KVH; h++) {
            const bf16_t *x = row + (long)h * D;
            bf16_t *dst = h < H ? q_out + (t * H + h) * (long)D : k_cache + ((long)(h - H) * cache_tokens + slot) * D;
            if (qk_norm) {
                const bf16_t *w = qk_norm + (long)h * D;
                float ss = 0.0f;
                #pragma omp simd reduction(+:ss)
                for (int j = 0; j < D; j++) ss += bf16_to_f32(x[j]) * bf16_to_f32(x[j]);
                float r = 1.0f / sqrtf(ss / (float)D + eps);
                #pragma omp simd
                for (int j = 0; j < D; j++) xn[j] = rnd(bf16_to_f32(w[j]) * rnd(bf16_to_f32(x[j]) * r));
            } else {
                #pragma omp simd
                for (int j = 0; j < D; j++) xn[j] = bf16_to_f32(x[j]);
            }
            #pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = xn[j], b = xn[j + half];
                dst[j] = f32_to_bf16(rnd(a * bf16_to_f32(c[j])) + rnd(-b * bf16_to_f32(s[j])));
                dst[j + half] = f32_to_bf16(rnd(b * bf16_to_f32(c[j + half])) + rnd(a * bf16_to_f32(s[j + half])));
            }
        }
        for (int h = 0; h < KVH; h++)
            memcpy(v_cache + ((long)h * cache_tokens + slot) * D, row + (long)(H + KVH + h) * D, sizeof(bf16_t) * D);
    }
}

/* agentserve_rope_kv for float32 activations (tables and q/k norm weights float32):
 * the cache and q_out in bfloat16 (cache_bf16, the dtype the attention kernel
 * then reads q in) or float32. */
void agentserve_rope_kv_f32(const float *qkv, long T, int H, int KVH, int D, const float *qk_norm, float eps,
                            const float *cos_t, const float *sin_t, const int64_t *positions, void *k_cache,
                            void *v_cache, int cache_bf16, long cache_tokens, const int64_t *slots, void *q_out,
                            int nthreads) {
    const long width = (long)(H + 2 * KVH) * D;
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T >= 64)
    for (long t = 0; t < T; t++) {
        const float *row = qkv + t * width;
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        const long slot = slots[t];
        float xn[D], y[D];
        for (int h = 0; h < H + 2 * KVH; h++) {
            const float *x = row + (long)h * D;
            long at = h < H ? (t * H + h) * (long)D : ((long)((h - H) % KVH) * cache_tokens + slot) * D;
            void *base = h < H ? q_out : h < H + KVH ? k_cache : v_cache;
            if (h >= H + KVH) {
                memcpy(y, x, sizeof(float) * D);
            } else {
                if (qk_norm) {
                    const float *w = qk_norm + (long)h * D;
                    float r = rms_scale_f32(x, D, eps);
                    #pragma omp simd
                    for (int j = 0; j < D; j++) xn[j] = w[j] * (x[j] * r);
                } else {
                    memcpy(xn, x, sizeof(float) * D);
                }
                #pragma omp simd
                for (int j = 0; j < half; j++) {
                    float a = xn[j], b = xn[j + half];
                    y[j] = a * c[j] + -b * s[j];
                    y[j + half] = b * c[j + half] + a * s[j + half];
                }
            }
            if (cache_bf16) {
                bf16_t *dst = (bf16_t *)base + at;
                #pragma omp simd
                for (int j = 0; j < D; j++) dst[j] = f32_to_bf16(y[j]);
            } else {
                memcpy((float *)base + at, y, sizeof(float) * D);
            }
        }
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

/* tanh(y) for the GELU below, which adds it to 1: 1 - 2e / (1 + e) with
 * e = exp(-2|y|), so that near |tanh| = 1 (where 1 + tanh cancels for y < 0)
 * it is the float nearest the true value, as torch's is, up to one rounding;
 * near 0 the series y - y^3/3 + 2y^5/15 (its next term, 17y^7/315, is below
 * 1e-12 there); exactly 1 above 8.664339742, where torch's vectorized tanh
 * (SLEEF's) rounds to 1. */
#define TANH_ONE 8.664339742f

static inline float tanh_gelu(float y) {
    float a = fabsf(y);
    float t;
    if (a > TANH_ONE) {
        t = 1.0f;
    } else if (a < 0.03f) {
        float y2 = y * y;
        t = a * (1.0f + y2 * (-1.0f / 3.0f + y2 * (2.0f / 15.0f)));
    } else {
        float e = exp_neg(-2.0f * a);
        t = 1.0f - 2.0f * e / (1.0f + e);
    }
    return y < 0.0f ? -t : t;
}

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanh_gelu(GELU_BETA * (x + GELU_KAPPA * (x * x * x))));
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_neg on 8 lanes (the compiler does not vectorize the scalar one here:
 * floorf under the default trapping math keeps a branch) */
static inline __m256 exp_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    __m256 p = _mm256_set1_ps(1.98756915e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.39819995e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33345205e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16657665e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666657e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.00000000e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 bf16x8_load(const bf16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* f32_to_bf16 on 8 lanes, the bits in the low half of each lane */
static inline __m256i bf16x8_bits(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                  _mm256_and_si256(hi, _mm256_set1_epi32(1)))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 y = _mm256_mul_ps(_mm256_set1_ps(GELU_BETA), _mm256_fmadd_ps(_mm256_set1_ps(GELU_KAPPA), x3, x));
    __m256 a = _mm256_andnot_ps(sign, y);
    __m256 e = exp_neg8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), a));
    __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_add_ps(e, e), _mm256_add_ps(one, e)));
    __m256 y2 = _mm256_mul_ps(y, y);
    __m256 small = _mm256_mul_ps(a, _mm256_fmadd_ps(y2, _mm256_fmadd_ps(y2, _mm256_set1_ps(2.0f / 15.0f),
                                                                          _mm256_set1_ps(-1.0f / 3.0f)), one));
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.03f), _CMP_LT_OQ));
    t = _mm256_blendv_ps(t, one, _mm256_cmp_ps(a, _mm256_set1_ps(TANH_ONE), _CMP_GT_OQ));
    t = _mm256_or_ps(t, _mm256_and_ps(sign, y));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}
#endif

/* gu [T, 2 * inter] (gate then up) -> out [T, inter] = bf16(gelu_tanh(gate)) * up, where
 * gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), torch's
 * F.gelu(approximate="tanh") written as torch writes it (so 1 + tanh rounds to
 * 0 where torch's does, for x below about -5). */
void agentserve_gelu_tanh_mul(const bf16_t *gu, long T, long inter, bf16_t *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * inter >= 65536)
    for (long t = 0; t < T; t++) {
        const bf16_t *g = gu + t * 2 * inter, *u = g + inter;
        bf16_t *o = out + t * inter;
        long j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= inter; j += 8) {
            __m256 y = _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits(gelu_tanh8(bf16x8_load(g + j))), 16));
            __m256i b = bf16x8_bits(_mm256_mul_ps(y, bf16x8_load(u + j)));
            __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
            _mm_storeu_si128((__m128i *)(o + j), packed);
        }
#endif
        for (; j < inter; j++) o[j] = f32_to_bf16(rnd(gelu_tanh(bf16_to_f32(g[j]))) * bf16_to_f32(u[j]));
    }
}

/* gu [T, 2 * inter] float32 (gate then up) -> out [T, inter] = gelu_tanh(gate) * up, unrounded. */
void agentserve_gelu_tanh_mul_f32(const float *gu, long T, long inter, float *out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (T * inter >= 65536)
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        long j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= inter; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(gelu_tanh8(_mm256_loadu_ps(g + j)), _mm256_loadu_ps(u + j)));
#endif
        for (; j < inter; j++) o[j] = gelu_tanh(g[j]) * u[j];
    }
}
