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

#endif
