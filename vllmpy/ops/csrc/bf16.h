/* bfloat16 <-> float32 for the CPU kernels: the upper half of a float32, rounded to
 * nearest-even on the way down as PyTorch rounds (a NaN stays a NaN). */
#ifndef VLLMPY_BF16_H
#define VLLMPY_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    const uint32_t u = v.u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (u >> 16) | 0x40u; /* NaN stays NaN */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet : rounded);
}

#endif
