/* exp(x) for x <= 0, vectorizable, shared by the kernels. */
#ifndef AGENTSERVE_EXP_NEG_H
#define AGENTSERVE_EXP_NEG_H

#include <math.h>
#include <stdint.h>

/* 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2; relative error below 2e-7.
 * libm's expf does not vectorize without -ffast-math, which would also loosen
 * the roundings the bfloat16 paths reproduce; this does, inside omp simd loops. */
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.98756915e-4f;
    p = p * r + 1.39819995e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657665e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.00000000e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_neg on 16 lanes */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.98756915e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819995e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657665e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666657e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00000000e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
