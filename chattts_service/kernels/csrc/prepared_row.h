// A row prepared for the int8 product: shared by the fused RMSNorm and the int8 linear.
#pragma once

#include "common.h"

namespace {

// One row as both row preparations below see it: value(i) = x[i] * factor * gain[i], where
// factor is LlamaRMSNorm's 1 / rms(x) when there is a gain (without one, value(i) is x[i]),
// and the largest |value(i)| (at least 1e-12). Written once, so the fbgemm path (unit rows)
// and the VNNI path (u8 rows) divide the same values by the same maximum.
struct PreparedRow {
    const float* in;
    const float* gain;
    float factor = 1.0f;
    float largest = 0.0f;

    PreparedRow(const float* row, int64_t width, const float* row_gain, float eps)
        : in(row), gain(row_gain) {
        if (gain != nullptr) {
            float squares = 0.0f;
            for (int64_t i = 0; i < width; ++i) squares += in[i] * in[i];
            factor = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
        }
        // the largest magnitude as the largest bit pattern: without the sign bit, floats order
        // as their bits do, and GCC vectorises an integer maximum where it keeps a float one
        // scalar (for NaN's sake), 4x slower on a row of 3072 here
        uint32_t largest_bits = 0;
        if (gain != nullptr) {
            for (int64_t i = 0; i < width; ++i) {
                const uint32_t bits = magnitude_bits(in[i] * factor * gain[i]);
                largest_bits = bits > largest_bits ? bits : largest_bits;
            }
        } else {
            for (int64_t i = 0; i < width; ++i) {
                const uint32_t bits = magnitude_bits(in[i]);
                largest_bits = bits > largest_bits ? bits : largest_bits;
            }
        }
        std::memcpy(&largest, &largest_bits, sizeof largest);
        largest = largest > 1e-12f ? largest : 1e-12f;
    }

    float value(int64_t i) const { return in[i] * factor * (gain != nullptr ? gain[i] : 1.0f); }

    static uint32_t magnitude_bits(float x) {
        uint32_t bits;
        std::memcpy(&bits, &x, sizeof bits);
        return bits & 0x7fffffffu;
    }
};

}  // namespace
