// What the kernels share: the standard headers, bf16 conversions, a vectorisable exp(x).
#pragma once

#if defined(__x86_64__)
#define CHATTS_X86 1
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__aarch64__)
// aarch64: the int8 product has NEON builds of its own (int8_linear_arm.cpp); the kernels
// written with AVX2 intrinsics (attention, the depthwise convolution, the read loop) compile
// through SIMDe, which maps each to its NEON equivalent (an eight-lane float vector is two
// NEON registers, a fused multiply-add is vfmaq_f32), so the same order of operations gives
// the same bits.
#define CHATTS_ARM 1
#include <arm_neon.h>
#include <sys/auxv.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/fma.h>
#else
#error "the kernels are written for x86-64 and aarch64"
#endif
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"

namespace {

inline float from_bf16(uint16_t value) {
    const uint32_t bits = static_cast<uint32_t>(value) << 16;
    float result;
    std::memcpy(&result, &bits, sizeof result);
    return result;
}

inline uint16_t to_bf16(float value) {  // round to nearest even (no NaNs arrive here)
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0, Cephes' single-precision polynomial (about 1 ulp); written without
// branches or calls so the compiler vectorises the loops that use it.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#if CHATTS_X86
// acc += u8 x s8 in fours (vpdpbusd) in acc's own register. Written as the intrinsic, GCC 12
// gave the sums of gemm_blocks' single-block loops (every row count), of the int4 VNNI blocks
// and of the peak loop a second register each and copied every sum there and back around
// each vpdpbusd: two register copies per vpdpbusd, sharing the vector pipes with it. The same
// instruction, so the same bits.
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline void dpbusd(__m512i& acc,
                                                                                __m512i u8,
                                                                                __m512i s8) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
}
#endif

// The bytes of weights a product prefetches ahead for `rows` rows: the tuning's distance, or
// none up to tuning.bare_up_to rows (where the hardware prefetcher alone streams faster).
inline int64_t prefetch_bytes_for(const ChattsTuning& tuning, int64_t rows) {
    return rows <= tuning.bare_up_to ? 0 : static_cast<int64_t>(tuning.prefetch_groups) * 64;
}

}  // namespace
