// chatts_depthwise_conv1d: the audio decoder's depthwise convolutions (each ConvNeXt block's
// first layer, a kernel of 7 taps per channel) in bf16, as oneDNN runs torch's conv1d on bf16
// inputs and weights, to the bit: each output starts at its channel's bias and adds the taps'
// products in tap order, in float32 (a product of two bf16 values is exact in float32, so a
// fused multiply-add rounds only the sum), then is rounded to bf16 (nearest even). A float32
// input is first rounded to bf16, as autocast casts it. Both the input and the output lie
// channels-last ([batch, time, channels]), as the blocks hand them on: torch's convolution on
// such an input spends about as long transposing it as convolving it, and its output is
// transposed again for the layer norm after it. Eight channels a vector, two vectors a pass,
// every tap of an output in registers. With `float32`, the same in float32 throughout, as
// oneDNN runs a float32 convolution (the input as it is, each tap a fused multiply-add,
// float32 out), where the caller has checked that this gives torch's bits.
#include "common.h"

namespace {

// Eight inputs as the floats of their bf16 values.
inline __m256 bf16_floats(const uint16_t* x) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Eight float32 bit patterns rounded to bf16 (nearest even, as to_bf16), still in 32 bits.
inline __m256i rounded_bits(__m256i bits) {
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
}

inline __m256 bf16_floats(const float* x) {
    const __m256i bits = rounded_bits(_mm256_castps_si256(_mm256_loadu_ps(x)));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(-65536)));
}

inline void store_bf16(uint16_t* out, __m256 values) {
    const __m256i high = _mm256_srli_epi32(rounded_bits(_mm256_castps_si256(values)), 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

inline float bf16_value(uint16_t x) { return from_bf16(x); }
inline float bf16_value(float x) { return from_bf16(to_bf16(x)); }

// Eight inputs and one input as the convolution reads them: in bf16 (an input's bf16 value),
// or in float32 (a float32 input as it is).
template <bool Float32, typename Element>
inline __m256 input8(const Element* x) {
    if constexpr (Float32) return _mm256_loadu_ps(x);
    else return bf16_floats(x);
}

template <bool Float32, typename Element>
inline float input1(Element x) {
    if constexpr (Float32) return x;
    else return bf16_value(x);
}

template <bool Float32>
inline void store8(void* out, int64_t at, __m256 values) {
    if constexpr (Float32) _mm256_storeu_ps(static_cast<float*>(out) + at, values);
    else store_bf16(static_cast<uint16_t*>(out) + at, values);
}

template <bool Float32>
inline void store1(void* out, int64_t at, float value) {
    if constexpr (Float32) static_cast<float*>(out)[at] = value;
    else static_cast<uint16_t*>(out)[at] = to_bf16(value);
}

template <bool Float32, typename Element>
void depthwise(const ChattsDepthwiseArgs& a, const Element* x) {
    const int64_t channels = a.channels, time = a.time;
#pragma omp parallel for num_threads(a.threads) schedule(static) collapse(2)
    for (int64_t batch = 0; batch < a.batch; ++batch) {
        for (int64_t t = 0; t < time; ++t) {
            // the taps that fall inside the input (the rest read the zero padding: adding
            // their +0 products would change no sum, so they are left out)
            const Element* rows[64];
            const float* taps[64];
            int count = 0;
            for (int64_t tap = 0; tap < a.kernel; ++tap) {
                const int64_t source = t + tap * a.dilation - a.padding;
                if (source < 0 || source >= time) continue;
                rows[count] = x + (batch * time + source) * channels;
                taps[count] = a.weights + tap * channels;
                ++count;
            }
            const int64_t out = (batch * time + t) * channels;  // this output's first
            int64_t c = 0;
            for (; c + 16 <= channels; c += 16) {
                __m256 low = _mm256_setzero_ps(), high = low;
                if (a.bias != nullptr) {
                    low = _mm256_loadu_ps(a.bias + c);
                    high = _mm256_loadu_ps(a.bias + c + 8);
                }
                for (int i = 0; i < count; ++i) {
                    low = _mm256_fmadd_ps(input8<Float32>(rows[i] + c),
                                          _mm256_loadu_ps(taps[i] + c), low);
                    high = _mm256_fmadd_ps(input8<Float32>(rows[i] + c + 8),
                                           _mm256_loadu_ps(taps[i] + c + 8), high);
                }
                store8<Float32>(a.out, out + c, low);
                store8<Float32>(a.out, out + c + 8, high);
            }
            for (; c < channels; ++c) {
                float sum = a.bias != nullptr ? a.bias[c] : 0.0f;
                for (int i = 0; i < count; ++i)
                    sum = __builtin_fmaf(input1<Float32>(rows[i][c]), taps[i][c], sum);
                store1<Float32>(a.out, out + c, sum);
            }
        }
    }
}

}  // namespace

extern "C" int32_t chatts_depthwise_conv1d(const ChattsDepthwiseArgs* a) {
    if (a->batch < 0 || a->channels < 1 || a->time < 1 || a->kernel < 1 || a->kernel > 64 ||
        a->dilation < 1 || a->padding < 0 || a->threads < 1 || (a->float32 && !a->x_float))
        return CHATTS_BAD_DEPTHWISE;
    if (a->float32)
        depthwise<true>(*a, static_cast<const float*>(a->x));
    else if (a->x_float)
        depthwise<false>(*a, static_cast<const float*>(a->x));
    else
        depthwise<false>(*a, static_cast<const uint16_t*>(a->x));
    return CHATTS_OK;
}
