/* bfloat16 <-> float32, scalar, shared by the kernels. */
#ifndef AGENTSERVE_BF16_H
#define AGENTSERVE_BF16_H

#include <stdint.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)((v.u + rounding) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 -> float32 */
static inline __m512 bf16x16_load(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float32 -> the bits of the nearest bfloat16 (ties to even, NaN quieted), in
 * the low half of each 32-bit lane: f32_to_bf16 on 16 lanes. (The AVX512-BF16
 * conversion flushes denormals, which the scalar path does not.) */
static inline __m512i bf16x16_bits(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(hi, _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                 _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

/* f rounded to bfloat16 and back */
static inline __m512 bf16x16_round(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(f), 16));
}

static inline void bf16x16_store(bf16_t *p, __m512 f) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16_bits(f)));
}
#endif

#endif
