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
#include "common.h"

namespace {

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

// Eight keys' elements as floats: bf16 widened, or int8 converted (its scale applied after).
inline __m256 load8(const uint16_t* k) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 load8(const int8_t* k) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// The query's products with COUNT consecutive keys (dim % 8 == 0), eight lanes each, the lanes
// accumulated in dimension order: sums[i] for key i.
template <typename Element, int COUNT>
inline void dot_lanes(const float* query, const Element* keys, int64_t dim, __m256* sums) {
    for (int i = 0; i < COUNT; ++i) sums[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 q = _mm256_loadu_ps(query + d);
        for (int i = 0; i < COUNT; ++i)
            sums[i] = _mm256_fmadd_ps(q, load8(keys + i * dim + d), sums[i]);
    }
}

// The eight lanes' sum, always in the same order.
inline float hsum(__m256 lanes) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// One (row, head) of a decode step's attention, over a cache of bf16 (uint16_t) or of int8
// with one scale per (position, head) (int8_t; `key_scale`/`value_scale` point at this head's
// scales).
template <typename Element>
void store(Element* key, Element* value, float* key_scale, float* value_scale, int64_t length,
           int64_t dim, const float* new_key, const float* new_value) {
    if constexpr (sizeof(Element) == 2) {
        for (int64_t d = 0; d < dim; ++d) {
            key[length * dim + d] = to_bf16(new_key[d]);
            value[length * dim + d] = to_bf16(new_value[d]);
        }
    } else {
        key_scale[length] = quantize_vector(new_key, dim, key + length * dim);
        value_scale[length] = quantize_vector(new_value, dim, value + length * dim);
    }
}

// The query over positions 0..length of the cache (the new token's key and value stored).
template <typename Element>
void attend(Element* key, Element* value, float* key_scale, float* value_scale,
            int64_t length, int64_t held, int64_t dim, float scale, const float* query,
            float* score, float* result) {
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
    const auto scaled = [&](int64_t position, float dot) {
        if constexpr (sizeof(Element) == 2) {
            score[position] = dot * scale;
        } else {
            score[position] = dot * (key_scale[position] * scale);
        }
    };
    int64_t position = 0;
    if (dim % 8 == 0) {
        // four positions at a time: four independent chains of multiply-adds, where one
        // position's chain waited on each add; each
        // position's sum is formed the same way whatever its group (dot_lanes, hsum)
        for (; position + 4 <= positions; position += 4) {
            for (int64_t ahead = 0; ahead < 4; ++ahead) fetch(position + ahead + kPrefetchPositions);
            __m256 sums[4];
            dot_lanes<Element, 4>(query, key + position * dim, dim, sums);
            for (int64_t i = 0; i < 4; ++i) scaled(position + i, hsum(sums[i]));
        }
        for (; position < positions; ++position) {
            fetch(position + kPrefetchPositions);
            __m256 sums[1];
            dot_lanes<Element, 1>(query, key + position * dim, dim, sums);
            scaled(position, hsum(sums[0]));
        }
    }
    for (; position < positions; ++position) {  // a head dimension not a multiple of 8
        const Element* k = key + position * dim;
        fetch(position + kPrefetchPositions);
        float dot = 0.0f;
        if constexpr (sizeof(Element) == 2) {
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * from_bf16(k[d]);
        } else {
            for (int64_t d = 0; d < dim; ++d) dot += query[d] * static_cast<float>(k[d]);
        }
        scaled(position, dot);
    }
    float largest = score[0];
    for (int64_t position = 1; position < positions; ++position)
        largest = score[position] > largest ? score[position] : largest;
    float total = 0.0f;
    for (int64_t position = 0; position < positions; ++position) {
        score[position] = exp_nonpositive(score[position] - largest);
        total += score[position];
    }
    const auto weight_of = [&](int64_t position) {
        if constexpr (sizeof(Element) == 2) {
            return score[position];
        } else {
            return score[position] * value_scale[position];
        }
    };
    const float inverse = 1.0f / total;
    if (dim % 64 == 0) {
        // 64 dimensions at a time in eight registers: an array in memory made each position's
        // adds wait on the previous position's stores; the same sums in the same order
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            __m256 sums[8];
            for (int j = 0; j < 8; ++j) sums[j] = _mm256_setzero_ps();
            for (int64_t position = 0; position < positions; ++position) {
                const __m256 weight = _mm256_set1_ps(weight_of(position));
                const Element* v = value + position * dim + d0;
                for (int j = 0; j < 8; ++j)
                    sums[j] = _mm256_fmadd_ps(weight, load8(v + 8 * j), sums[j]);
            }
            for (int j = 0; j < 8; ++j)
                _mm256_storeu_ps(result + d0 + 8 * j,
                                 _mm256_mul_ps(sums[j], _mm256_set1_ps(inverse)));
        }
        return;
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
    for (int64_t d = 0; d < dim; ++d) result[d] = accumulated[d] * inverse;
}

// What a pass of `attention_pass` does for each (row, head): store the new key and value, then
// attend (a decode step); or only store, or only attend (a prompt: every position stored
// before any attends).
enum AttentionPass { kStoreAndAttend, kStore, kAttend };

}  // namespace

// With `key_scales`/`value_scales` NULL the caches hold bf16; otherwise int8, and these give
// each row's scales, [layers, heads, capacity] float32.

static int32_t attention_pass(
    AttentionPass pass,
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
    if (dim > 256) return CHATTS_HEAD_DIM_TOO_LARGE;
    int64_t longest = 0;
    for (int64_t row = 0; row < rows; ++row) {
        if (lengths[row] >= capacity[row]) return CHATTS_CACHE_FULL;
        if (lengths[row] + 1 > longest) longest = lengths[row] + 1;
    }
    const bool int8 = key_scales != nullptr;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(longest);
        // guided, as the int8 product: a slow vCPU's share goes to the other thread
#pragma omp for schedule(guided)
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
                if (pass != kStore) rotate(query, position_cos, position_sin, dim, rotated_query);
                if (pass != kAttend) rotate(new_key, position_cos, position_sin, dim, rotated_key);
                query = rotated_query;
                new_key = rotated_key;
            }
            float* result = out + row * heads * dim + head * dim;
            if (int8) {
                const int64_t scale_offset = head_index * capacity[row];
                int8_t* key = static_cast<int8_t*>(keys[row]) + head_offset;
                int8_t* value = static_cast<int8_t*>(values[row]) + head_offset;
                float* key_scale = key_scales[row] + scale_offset;
                float* value_scale = value_scales[row] + scale_offset;
                if (pass != kAttend)
                    store(key, value, key_scale, value_scale, lengths[row], dim, new_key,
                          new_value);
                if (pass != kStore)
                    attend(key, value, key_scale, value_scale, lengths[row], capacity[row], dim,
                           scale, query, scores.data(), result);
            } else {
                uint16_t* key = static_cast<uint16_t*>(keys[row]) + head_offset;
                uint16_t* value = static_cast<uint16_t*>(values[row]) + head_offset;
                float* none = nullptr;
                if (pass != kAttend)
                    store(key, value, none, none, lengths[row], dim, new_key, new_value);
                if (pass != kStore)
                    attend(key, value, none, none, lengths[row], capacity[row], dim, scale,
                           query, scores.data(), result);
            }
        }
    }
    return CHATTS_OK;
}

extern "C" int32_t chatts_decode_attention(const ChattsAttentionArgs* a) {
    return attention_pass(kStoreAndAttend, a->rows, a->heads, a->dim, a->layer, a->scale, a->threads, a->q,
                            a->q_row_stride, a->k_new, a->k_row_stride, a->v_new,
                            a->v_row_stride, a->keys, a->values, a->key_scales,
                            a->value_scales, a->capacity, a->lengths, a->cos, a->sin, a->out);
}
