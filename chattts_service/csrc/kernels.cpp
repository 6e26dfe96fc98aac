// The decode loop's fused kernels: plain C++ with OpenMP, called through ctypes.
//
// chatts_decode_attention: attention for one decode step. Every sequence adds one token and
// attends over its own keys and values; one call per layer for all sequences of a batch.
// Each (sequence, head) pair is computed start to finish by one thread, in a fixed order
// that depends only on that sequence's own length, so a sequence's result is the same
// whatever else shares its batch and however the threads split the work.
//
// Layout: each sequence has its own cache, [layers, heads, capacity, dim] bf16 values for keys
// and another for values (half the bytes of fp32 to read each step; rounded to nearest even,
// as torch converts). q, k_new, v_new: per sequence, heads * dim contiguous floats, rows
// `*_row_stride` floats apart. out: [rows, heads * dim]. With rotary tables, q and k_new are
// rotated here at the new token's position first (so they can come straight from the fused
// q/k/v projection).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

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

constexpr int64_t kPrefetchPositions = 32;  // (dim 64: 128 bytes of bf16 a position)

// Rotary position embedding of one head's vector, as transformers' Llama applies it:
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]). Two products and a
// sum, each rounded as torch rounds them (no fused multiply-add), so the rotated key that
// goes into the cache is the one torch's operators would have written.
__attribute__((noinline, optimize("fp-contract=off")))
void rotate(const float* x, const float* cos, const float* sin, int64_t dim, float* out) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] - x[d + half] * sin[d];
    for (int64_t d = half; d < dim; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

// One head's key or value for an int8 cache: round(x / scale) with scale = max |x| / 127 (all
// zeros: scale 0), so x ~ q * scale; returns the scale.
float quantize_vector(const float* x, int64_t dim, int8_t* quantized) {
    float largest = 0.0f;
    for (int64_t d = 0; d < dim; ++d) {
        const float magnitude = std::fabs(x[d]);
        largest = magnitude > largest ? magnitude : largest;
    }
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    for (int64_t d = 0; d < dim; ++d)
        quantized[d] = static_cast<int8_t>(__builtin_nearbyintf(x[d] * inverse));
    return largest / 127.0f;
}

// One (row, head) of a decode step's attention, over a cache of bf16 (uint16_t) or of int8
// with one scale per (position, head) (int8_t; `key_scale`/`value_scale` point at this head's
// scales).
template <typename Element>
void attend(Element* key, Element* value, float* key_scale, float* value_scale,
            int64_t length, int64_t held, int64_t dim, float scale, const float* query,
            const float* new_key, const float* new_value, float* score, float* result) {
    // the new token's key and value go into the cache first
    if constexpr (sizeof(Element) == 2) {
        for (int64_t d = 0; d < dim; ++d) {
            key[length * dim + d] = to_bf16(new_key[d]);
            value[length * dim + d] = to_bf16(new_value[d]);
        }
    } else {
        key_scale[length] = quantize_vector(new_key, dim, key + length * dim);
        value_scale[length] = quantize_vector(new_value, dim, value + length * dim);
    }
    const int64_t positions = length + 1;

    // fetch ahead: the keys (read once), and the values into the cache for the pass after the
    // softmax; one (row, head) stream is short (12.8 KB of bf16 at 100 positions) and the
    // hardware prefetcher alone ramps up too late (20 layers, 8 rows x 100 positions: 2.4 ->
    // 1.3 ms; x 600: 8.7 -> 7.5 ms)
    const auto fetch = [key, value, dim, held](int64_t position) {
        // never past the cache: clamped, not skipped (with a branch here GCC made the whole
        // loop 2x slower, as slow as no prefetch at all)
        position = position < held ? position : held - 1;
        for (int64_t d = 0; d < dim; d += 64 / sizeof(Element)) {  // a cache line at a time
            __builtin_prefetch(key + position * dim + d, 0, 0);
            __builtin_prefetch(value + position * dim + d, 0, 3);
        }
    };
    for (int64_t position = 0; position < kPrefetchPositions; ++position) fetch(position);
    for (int64_t position = 0; position < positions; ++position) {
        const Element* k = key + position * dim;
        fetch(position + kPrefetchPositions);
        float dot = 0.0f;
        if constexpr (sizeof(Element) == 2) {
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * from_bf16(k[d]);
            score[position] = dot * scale;
        } else {
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * static_cast<float>(k[d]);
            score[position] = dot * (key_scale[position] * scale);
        }
    }
    float largest = score[0];
    for (int64_t position = 1; position < positions; ++position)
        largest = score[position] > largest ? score[position] : largest;
    float total = 0.0f;
    for (int64_t position = 0; position < positions; ++position) {
        score[position] = exp_nonpositive(score[position] - largest);
        total += score[position];
    }
    float accumulated[256] = {0.0f};
    for (int64_t position = 0; position < positions; ++position) {
        const Element* v = value + position * dim;
        if constexpr (sizeof(Element) == 2) {
            const float weight = score[position];
            for (int64_t d = 0; d < dim; ++d) accumulated[d] += weight * from_bf16(v[d]);
        } else {
            const float weight = score[position] * value_scale[position];
            for (int64_t d = 0; d < dim; ++d) accumulated[d] += weight * static_cast<float>(v[d]);
        }
    }
    const float inverse = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) result[d] = accumulated[d] * inverse;
}

}  // namespace

// With `key_scales`/`value_scales` NULL the caches hold bf16; otherwise int8, and these give
// each row's scales, [layers, heads, capacity] float32.
extern "C" int chatts_decode_attention(
    int64_t rows, int64_t heads, int64_t dim, int64_t layer, float scale, int threads,
    const float* q, int64_t q_row_stride,
    const float* k_new, int64_t k_row_stride,
    const float* v_new, int64_t v_row_stride,
    void* const* keys, void* const* values,    // per row: its cache's first element
    float* const* key_scales, float* const* value_scales,  // per row (int8 caches), or NULL
    const int64_t* capacity,                   // per row: positions its cache can hold
    const int64_t* lengths,                    // per row: positions already held
    const float* cos, const float* sin,        // [positions, dim] rotary tables, or NULL
    float* out) {
    if (dim > 256) return 1;
    int64_t longest = 0;
    for (int64_t row = 0; row < rows; ++row) {
        if (lengths[row] >= capacity[row]) return 2;
        if (lengths[row] + 1 > longest) longest = lengths[row] + 1;
    }
    const bool int8 = key_scales != nullptr;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(longest);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; ++task) {
            const int64_t row = task / heads, head = task % heads;
            const int64_t head_index = layer * heads + head;
            const int64_t head_offset = head_index * capacity[row] * dim;
            const float* query = q + row * q_row_stride + head * dim;
            const float* new_key = k_new + row * k_row_stride + head * dim;
            const float* new_value = v_new + row * v_row_stride + head * dim;
            float rotated_query[256], rotated_key[256];
            if (cos != nullptr) {  // at the new token's position, lengths[row]
                const float* position_cos = cos + lengths[row] * dim;
                const float* position_sin = sin + lengths[row] * dim;
                rotate(query, position_cos, position_sin, dim, rotated_query);
                rotate(new_key, position_cos, position_sin, dim, rotated_key);
                query = rotated_query;
                new_key = rotated_key;
            }
            float* result = out + row * heads * dim + head * dim;
            if (int8) {
                const int64_t scale_offset = head_index * capacity[row];
                attend(static_cast<int8_t*>(keys[row]) + head_offset,
                       static_cast<int8_t*>(values[row]) + head_offset,
                       key_scales[row] + scale_offset, value_scales[row] + scale_offset,
                       lengths[row], capacity[row], dim, scale, query, new_key, new_value,
                       scores.data(), result);
            } else {
                attend(static_cast<uint16_t*>(keys[row]) + head_offset,
                       static_cast<uint16_t*>(values[row]) + head_offset,
                       static_cast<float*>(nullptr), static_cast<float*>(nullptr),
                       lengths[row], capacity[row], dim, scale, query, new_key, new_value,
                       scores.data(), result);
            }
        }
    }
    return 0;
}

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

// chatts_rms_norm_unit_rows: LlamaRMSNorm (x / rms(x) * gain) of each row, then the row divided
// by its largest magnitude, ready for the int8 kernel's fixed activation scale; `row_max`
// receives that magnitude, by which the int8 product is multiplied back. One pass over the
// row instead of the dozen operators of torch's rms_norm, absolute maximum and division.
// Without `gain`, the row is only divided by its largest magnitude.
extern "C" void chatts_rms_norm_unit_rows(
    int64_t rows, int64_t width, const float* x, int64_t x_row_stride, const float* gain,
    float eps, float* out, float* row_max) {
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t row = 0; row < rows; ++row) {
        const PreparedRow prepared(x + row * x_row_stride, width, gain, eps);
        float* unit = out + row * width;
        for (int64_t i = 0; i < width; ++i) unit[i] = prepared.value(i) / prepared.largest;
        row_max[row] = prepared.largest;
    }
}

// ---------------------------------------------------------------------------------------------
// chatts_int8_linear: int8 linear layers, the norm and the activations' quantization included;
// the product with AVX512-VNNI (x86 CPUs that have it: Ice Lake and later, Zen 4) or AVX2.
//
// Activations: each row (RMSNorm-ed first when there is a gain) divided by its largest
// magnitude and quantized to u8 as round(levels * x) + levels + 1: levels 127 for VNNI, so in
// [1, 255]; 63 for AVX2, so in [1, 127]. The magnitude multiplies the result back. Weights: s8
// with one scale per output channel, packed once in blocks of 16 output channels so that one
// 64-byte load holds 4 consecutive inputs of 16 channels: packed[block][k / 4][channel][k % 4]
// (zero channels pad the last block). vpdpbusd multiplies u8 by s8 and adds groups of four into
// int32 lanes, exactly (the AVX2 product adds the same sums in two steps), so the sum is the
// same whatever the row count or thread split; subtracting (levels + 1) * (sum of the channel's
// weights) removes the u8 offset, and each row's epilogue is its own. So a row's result never
// depends on the other rows of its batch. The integers and the float products are the ones
// fbgemm forms for the same quantized tensors at the same levels, in the same order (a test
// holds the two to the same bits). Up to 8 rows (4 with AVX2) share each load of weights, so
// they stream from memory once per call for a decode step's batch; more rows find each block in
// cache.
#include <immintrin.h>

#include <memory>

namespace {

// Quantize one row as described above, to round(levels * x) + levels + 1; returns its largest
// magnitude.
float quantize_row(const float* x, int64_t width, const float* gain, float eps, int levels,
                   uint8_t* quantized) {
    const PreparedRow prepared(x, width, gain, eps);
    // as fbgemm quantizes the same rows (divided by their maximum, then times the inverse of
    // the scale 1/levels, rounded to even), so both kernels see the same integers
    const float inverse_scale = 1.0f / static_cast<float>(1.0 / levels);
    const int32_t zero_point = levels + 1;
    for (int64_t i = 0; i < width; ++i) {
        const float level =
            __builtin_nearbyintf((prepared.value(i) / prepared.largest) * inverse_scale);
        quantized[i] = static_cast<uint8_t>(static_cast<int32_t>(level) + zero_point);
    }
    return prepared.largest;
}

constexpr int64_t kPrefetchGroups = 16;  // groups of 64 bytes of weights

// BLOCKS (1 or 2) neighbouring blocks of 16 channels for ROWS (1..8) rows: each broadcast input
// serves both blocks, and 2 * ROWS accumulators keep the multiply unit busy. The accumulators
// are named variables, not an array: GCC 12 kept an array of them on the stack, or copied them
// between registers around every vpdpbusd (1.4x slower at 8 rows). `valid`: how many of the
// last block's 16 channels are real (the rest are padding and are not stored).
// optimize: without -fassociative-math the epilogue multiplies in the written order for every
// ROWS (with it, GCC regrouped the two products for some row counts, and a row's result
// changed in its last bit with its batch); without fp-contract the residual is added to the
// rounded product, as torch adds it, not fused into a multiply-add.
template <int ROWS, int BLOCKS>
__attribute__((target("avx512f,avx512bw,avx512vnni"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void gemm_blocks(int64_t k_groups, const uint8_t* xq, int64_t x_stride, const int8_t* blocks,
                 int64_t block_bytes, const int32_t* offsets, const float* weight_scale,
                 const float* row_max, const float* residual, int64_t residual_stride,
                 float* out, int64_t out_stride, int valid, uintptr_t weights_end) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    const uint8_t* x = xq;
    const int8_t* w = blocks;
    for (int64_t group = 0; group < k_groups; ++group, x += 4, w += 64) {
        // the weights are read once per call: fetch them 1 KB ahead of use, marked
        // non-temporal (a decode step at 8 rows 14.6-15.1 -> 12.5-13.2 ms here; the T0 hint
        // measured the same, and the hardware prefetcher alone falls behind); at a block's end
        // into the next block, which is read next, but never past the weights
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + kPrefetchGroups * 64;
        if (ahead + (BLOCKS - 1) * block_bytes < weights_end) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_NTA);
            if constexpr (BLOCKS == 2)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + block_bytes), _MM_HINT_NTA);
        }
        const __m512i w0 = _mm512_loadu_si512(w);
        __m512i w1 = w0;
        if constexpr (BLOCKS == 2) w1 = _mm512_loadu_si512(w + block_bytes);
#define CHATTS_ROW(R)                                                                     \
        if constexpr (ROWS > R) {                                                         \
            int32_t four;                                                                 \
            std::memcpy(&four, x + R * x_stride, sizeof four);                            \
            const __m512i inputs = _mm512_set1_epi32(four);                               \
            a##R = _mm512_dpbusd_epi32(a##R, inputs, w0);                                 \
            if constexpr (BLOCKS == 2) b##R = _mm512_dpbusd_epi32(b##R, inputs, w1);      \
        }
        CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
        CHATTS_ROW(4) CHATTS_ROW(5) CHATTS_ROW(6) CHATTS_ROW(7)
#undef CHATTS_ROW
    }
    const __m512i accumulators[2][8] = {{a0, a1, a2, a3, a4, a5, a6, a7},
                                        {b0, b1, b2, b3, b4, b5, b6, b7}};
    for (int b = 0; b < BLOCKS; ++b) {
        // zero point * (sum of the channel's weights): the u8 offset of the activations
        const __m512i offset = _mm512_loadu_si512(offsets + b * 16);
        const __m512 scale = _mm512_loadu_ps(weight_scale + b * 16);
        const int channels = b + 1 < BLOCKS ? 16 : valid;
        const __mmask16 mask = static_cast<__mmask16>((1u << channels) - 1u);
        for (int r = 0; r < ROWS; ++r) {
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(accumulators[b][r], offset));
            __m512 result = _mm512_mul_ps(_mm512_mul_ps(sums, scale), _mm512_set1_ps(row_max[r]));
            if (residual != nullptr)  // added after the product is rounded, as torch adds
                result = _mm512_add_ps(
                    _mm512_maskz_loadu_ps(mask, residual + r * residual_stride + b * 16), result);
            _mm512_mask_storeu_ps(out + r * out_stride + b * 16, mask, result);
        }
    }
}

using BlockFunction = void (*)(int64_t, const uint8_t*, int64_t, const int8_t*, int64_t,
                               const int32_t*, const float*, const float*, const float*,
                               int64_t, float*, int64_t, int, uintptr_t);
template <int BLOCKS>
constexpr BlockFunction kBlockFunctions[9] = {
    nullptr, gemm_blocks<1, BLOCKS>, gemm_blocks<2, BLOCKS>, gemm_blocks<3, BLOCKS>,
    gemm_blocks<4, BLOCKS>, gemm_blocks<5, BLOCKS>, gemm_blocks<6, BLOCKS>,
    gemm_blocks<7, BLOCKS>, gemm_blocks<8, BLOCKS>};

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void gemm(int64_t rows, int64_t n, int64_t k, const uint8_t* xq, const int8_t* packed,
          const int32_t* offsets, const float* weight_scale, const float* row_max,
          const float* residual, int64_t residual_stride, float* out, int64_t out_stride,
          int threads) {
    // up to 8 rows (a decode step) one block at a time, more two at a time, each broadcast
    // input serving both (the 80 projections of a step here, against pairs throughout: 1 row
    // 4.1-4.5 vs 4.7-5.3 ms, 8 rows 5.5-5.8 vs 6.3-6.6 ms; pairs at 64 rows 18.7-21.3 vs
    // 22.9-23.8 ms); the same bits either way
    const int64_t blocks = (n + 15) / 16, block_bytes = 16 * k, span = rows > 8 ? 2 : 1;
    const int64_t tasks = (blocks + span - 1) / span;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(packed) + blocks * block_bytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
        const int64_t block = task * span;
        const bool both = span == 2 && block + 1 < blocks;
        const int64_t last = both ? block + 1 : block;
        const int valid = static_cast<int>(n - last * 16 < 16 ? n - last * 16 : 16);
        for (int64_t first = 0; first < rows; first += 8) {
            const int64_t count = rows - first < 8 ? rows - first : 8;
            (both ? kBlockFunctions<2> : kBlockFunctions<1>)[count](
                k / 4, xq + first * k, k, packed + block * block_bytes, block_bytes,
                offsets + block * 16, weight_scale + block * 16, row_max + first,
                residual == nullptr ? nullptr : residual + first * residual_stride + block * 16,
                residual_stride, out + first * out_stride + block * 16, out_stride, valid,
                weights_end);
        }
    }
}

// The same product for CPUs with AVX2 but not AVX512-VNNI (Haswell to Skylake, Zen 1-3), on
// the same packed weights. vpmaddubsw multiplies u8 by s8 and adds pairs into int16, saturating:
// with activations of 63 levels a side (u8 in [1, 127]) and weights in [-127, 127] a pair's
// sum is at most 32258, so it never saturates; vpmaddwd by ones then adds the pairs into int32
// lanes, so each group of four inputs adds to its channel exactly what vpdpbusd adds. 256-bit
// registers hold 8 channels: a block's 16 take two, and ROWS (1..4) rows keep 2 * ROWS
// accumulators (16 ymm registers in all). More rows pass over the block again, from cache.
template <int ROWS>
__attribute__((target("avx2,fma"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void gemm_block_avx2(int64_t k_groups, const uint8_t* xq, int64_t x_stride,
                     const int8_t* block, const int32_t* offsets, const float* weight_scale,
                     const float* row_max, const float* residual, int64_t residual_stride,
                     float* out, int64_t out_stride, int valid, uintptr_t weights_end) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,
            b3 = a0;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* x = xq;
    const int8_t* w = block;
    for (int64_t group = 0; group < k_groups; ++group, x += 4, w += 64) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(w) + kPrefetchGroups * 64;
        if (ahead < weights_end) _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_NTA);
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#define CHATTS_ROW(R)                                                                     \
        if constexpr (ROWS > R) {                                                         \
            int32_t four;                                                                 \
            std::memcpy(&four, x + R * x_stride, sizeof four);                            \
            const __m256i inputs = _mm256_set1_epi32(four);                               \
            a##R = _mm256_add_epi32(                                                      \
                a##R, _mm256_madd_epi16(_mm256_maddubs_epi16(inputs, w0), ones));         \
            b##R = _mm256_add_epi32(                                                      \
                b##R, _mm256_madd_epi16(_mm256_maddubs_epi16(inputs, w1), ones));         \
        }
        CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
#undef CHATTS_ROW
    }
    const __m256i accumulators[2][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}};
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int half = 0; half < 2; ++half) {
        const int channels = valid - 8 * half;
        if (channels <= 0) break;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(channels), lanes);
        const __m256i offset =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + 8 * half));
        const __m256 scale = _mm256_loadu_ps(weight_scale + 8 * half);
        for (int r = 0; r < ROWS; ++r) {
            const __m256 sums =
                _mm256_cvtepi32_ps(_mm256_sub_epi32(accumulators[half][r], offset));
            __m256 result = _mm256_mul_ps(_mm256_mul_ps(sums, scale),
                                          _mm256_set1_ps(row_max[r]));
            if (residual != nullptr)  // added after the product is rounded, as torch adds
                result = _mm256_add_ps(
                    _mm256_maskload_ps(residual + r * residual_stride + 8 * half, mask), result);
            _mm256_maskstore_ps(out + r * out_stride + 8 * half, mask, result);
        }
    }
}

using Avx2BlockFunction = void (*)(int64_t, const uint8_t*, int64_t, const int8_t*,
                                   const int32_t*, const float*, const float*, const float*,
                                   int64_t, float*, int64_t, int, uintptr_t);
constexpr Avx2BlockFunction kAvx2BlockFunctions[5] = {
    nullptr, gemm_block_avx2<1>, gemm_block_avx2<2>, gemm_block_avx2<3>, gemm_block_avx2<4>};

__attribute__((target("avx2,fma")))
void gemm_avx2(int64_t rows, int64_t n, int64_t k, const uint8_t* xq, const int8_t* packed,
               const int32_t* offsets, const float* weight_scale, const float* row_max,
               const float* residual, int64_t residual_stride, float* out, int64_t out_stride,
               int threads) {
    const int64_t blocks = (n + 15) / 16, block_bytes = 16 * k;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(packed) + blocks * block_bytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        const int valid = static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
        for (int64_t first = 0; first < rows; first += 4) {
            const int64_t count = rows - first < 4 ? rows - first : 4;
            kAvx2BlockFunctions[count](
                k / 4, xq + first * k, k, packed + block * block_bytes, offsets + block * 16,
                weight_scale + block * 16, row_max + first,
                residual == nullptr ? nullptr : residual + first * residual_stride + block * 16,
                residual_stride, out + first * out_stride + block * 16, out_stride, valid,
                weights_end);
        }
    }
}

// SwiGLU's product silu(gate) * up, as torch computes it: silu(x) = x / (1 + exp(-x)), rounded,
// then times up. exp(-x) from the non-positive exponential: exp(-x) itself for x >= 0, its
// reciprocal exp(x) for x < 0 (about 1 ulp from torch's exp either way).
void silu_times(const float* gate, const float* up, int64_t width, float* out) {
    for (int64_t i = 0; i < width; ++i) {
        const float x = gate[i];
        const float decay = exp_nonpositive(-std::fabs(x));
        const float exp_minus_x = x >= 0.0f ? decay : 1.0f / decay;
        out[i] = (x / (1.0f + exp_minus_x)) * up[i];
    }
}

}  // namespace

// out[rows, n] (rows `out_stride` floats apart) = the rows of x (`x_row_stride` floats apart)
// times the packed weights, transposed; plus `residual` [rows, n] (`residual_stride` apart)
// when it is not NULL. The rows are RMSNorm-ed with `gain` first when it is not NULL; with
// `swiglu`, each row of x holds 2k values, gate then up, and the row multiplied is
// silu(gate) * up. k % 4 == 0; `packed`, `offsets` and `weight_scale` cover n rounded up to 16
// channels; `offsets` is (levels + 1) * each channel's weight sum, `weight_scale` each channel's
// scale divided by `levels` (the activations' levels either side of zero). `instructions`:
// 2 the AVX512-VNNI product (levels up to 127), 1 the AVX2 one (levels up to 63).
extern "C" int chatts_int8_linear(
    int64_t rows, int64_t n, int64_t k, const float* x, int64_t x_row_stride, const float* gain,
    float eps, int swiglu, const int8_t* packed, const int32_t* offsets,
    const float* weight_scale, const float* residual, int64_t residual_stride, float* out,
    int64_t out_stride, int levels, int instructions, int threads) {
    if (k % 4 != 0) return 1;
    if (instructions == 2) {
        if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
            return 2;
        if (levels < 1 || levels > 127) return 3;
    } else if (instructions == 1) {
        if (!__builtin_cpu_supports("avx2")) return 2;
        if (levels < 1 || levels > 63) return 3;
    } else {
        return 4;
    }
    std::unique_ptr<uint8_t[]> xq(new uint8_t[rows * k]);
    std::unique_ptr<float[]> row_max(new float[rows]);
    std::unique_ptr<float[]> products(swiglu ? new float[rows * k] : nullptr);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 16)
    for (int64_t row = 0; row < rows; ++row) {
        const float* values = x + row * x_row_stride;
        if (swiglu) {
            silu_times(values, values + k, k, products.get() + row * k);
            values = products.get() + row * k;
        }
        row_max[row] = quantize_row(values, k, gain, eps, levels, xq.get() + row * k);
    }
    (instructions == 2 ? gemm : gemm_avx2)(rows, n, k, xq.get(), packed, offsets, weight_scale,
                                           row_max.get(), residual, residual_stride, out,
                                           out_stride, threads);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// chatts_sample: ChatTTS's sampling rules for one step, for every (row, codebook), and the
// draw. The rules, as its logits processors apply them (and as generation.shape_logits does with
// torch's operators): logits / temperature; the repetition penalty over the row's last tokens
// of that codebook (a logit seen c times becomes l * p^c if negative, else l / p^c); top-p
// (the tokens whose higher-ranked neighbours already hold top_p of the probability are
// dropped, the first `min_keep` always kept); top-k (values below the k-th largest dropped, k
// at least `min_keep`); then the end-of-speech token forbidden where the row asks. The draw: the kept
// tokens' probabilities summed in vocabulary order, and the first whose running sum exceeds
// uniform * total, so a row's token depends on its own logits and its own uniform number only.
// Only the top k tokens are ever sorted (partially), so a step costs a few passes over the
// vocabulary instead of a full sort and a dozen operators.
// Sums run in index order (no reassociation), so a draw never depends on where its buffers
// happen to lie in memory.
extern "C" __attribute__((optimize("no-associative-math"))) int chatts_sample(
    int64_t rows, int64_t width, int64_t vocabulary,
    const float* logits,        // [rows, width * vocabulary]
    const float* parameters,    // [rows, 3]: temperature, repetition penalty, 1 - top_p
    const int64_t* top_k,       // [rows]
    int64_t min_keep,           // tokens top-p and top-k always keep (ChatTTS: 3)
    const int64_t* windows,     // [rows, width, window]: recent tokens, `vocabulary` = none
    int64_t window,
    const int64_t* banned,      // [rows]: a token to forbid, or -1
    const float* uniforms,      // [rows, width], in [0, 1)
    int64_t* tokens,            // [rows, width], out
    int threads) {
    if (vocabulary <= 0 || min_keep < 1) return 1;
#pragma omp parallel num_threads(threads) if (rows * width * vocabulary > 16384)
    {
        std::vector<float> values(vocabulary), weights(vocabulary);
        std::vector<int32_t> order(vocabulary);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * width; ++task) {
            const int64_t row = task / width;
            const float* in = logits + task * vocabulary;
            const float temperature = parameters[row * 3], penalty = parameters[row * 3 + 1];
            const float keep_below = parameters[row * 3 + 2];
            float* l = values.data();
            float* w = weights.data();
            for (int64_t v = 0; v < vocabulary; ++v) l[v] = in[v] / temperature;
            // repetition penalty: each distinct recent token once, by its count
            const int64_t* recent = windows + task * window;
            for (int64_t i = 0; i < window; ++i) {
                const int64_t token = recent[i];
                if (token < 0 || token >= vocabulary) continue;
                bool seen_before = false;
                int count = 0;
                for (int64_t j = 0; j < window; ++j) {
                    if (recent[j] != token) continue;
                    seen_before = seen_before || j < i;
                    ++count;
                }
                if (seen_before) continue;
                const float alpha = std::pow(penalty, static_cast<float>(count));
                l[token] = l[token] < 0.0f ? l[token] * alpha : l[token] / alpha;
            }
            float largest = -INFINITY;
            for (int64_t v = 0; v < vocabulary; ++v) largest = l[v] > largest ? l[v] : largest;
            int64_t chosen = 0;
            if (largest == -INFINITY) {  // nothing to draw from: the first token
                tokens[task] = chosen;
                continue;
            }
            // unnormalised probabilities, and their sum
            for (int64_t v = 0; v < vocabulary; ++v)
                w[v] = l[v] == -INFINITY ? 0.0f : exp_nonpositive(l[v] - largest);
            float total = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v) total += w[v];
            // the top k by value (ties by index), most likely first
            const int64_t k =
                std::min<int64_t>(std::max<int64_t>(top_k[row], min_keep), vocabulary);
            for (int64_t v = 0; v < vocabulary; ++v) order[v] = static_cast<int32_t>(v);
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [l](int32_t a, int32_t b) {
                                  return l[a] > l[b] || (l[a] == l[b] && a < b);
                              });
            // top-p: keep while the probability at and below this rank exceeds 1 - top_p
            int64_t kept = 0;
            float above = 0.0f;  // probability of the higher-ranked tokens
            while (kept < k) {
                if (kept >= min_keep && 1.0f - above <= keep_below) break;
                above += w[order[kept]] / total;
                ++kept;
            }
            const float threshold = l[order[kept - 1]];
            float mass = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v)
                if (l[v] >= threshold && v != banned[row]) mass += w[v];
            if (mass == 0.0f) {  // only the forbidden token was left: the best other one
                for (int64_t j = 0; j < k; ++j)
                    if (order[j] != banned[row]) { chosen = order[j]; break; }
                tokens[task] = chosen;
                continue;
            }
            // strictly below the total, so the walk never runs past the last kept token
            float target = uniforms[task] * mass;
            const float ceiling = mass * (1.0f - 1.0f / 8388608.0f);
            target = target < ceiling ? target : ceiling;
            float running = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v) {
                if (l[v] < threshold || v == banned[row]) continue;
                running += w[v];
                chosen = v;
                if (running > target) break;
            }
            tokens[task] = chosen;
        }
    }
    return 0;
}
