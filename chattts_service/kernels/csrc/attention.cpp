// chatts_decode_attention: attention for one decode step. Every sequence adds one token and
// attends over its own keys and values; one call per layer for all sequences of a batch.
// Each (sequence, head) pair is computed start to finish by one thread, in a fixed order
// that depends only on that sequence's own length, so a sequence's result is the same
// whatever else shares its batch and however the threads split the work.
//
// Layout: each sequence has its own cache, [layers, capacity, heads, dim] bf16 values for keys
// and another for values (half the bytes of fp32 to read each step; rounded to nearest even,
// as torch converts). Position-major: one sequence's keys of a layer lie in one run that grows
// at its end, which a thread reads front to back, every head of a block of positions in turn,
// as one long stream (a run per head, [heads, capacity, dim], is a dozen short streams a
// layer: they read at about half the rate). q, k_new, v_new: per sequence, heads * dim
// contiguous floats, rows `*_row_stride` floats apart. out: [rows, heads * dim]. With rotary
// tables, q and k_new are rotated here at the new token's position first (so they can come
// straight from the fused q/k/v projection).
#include "common.h"

namespace {

// A block: a multiple of four positions. Before each head's work on a block, that head's
// slice kFetchPositions further on is fetched, so the reads spread over the work: a whole
// block's lines fetched at once (16 positions, 2 KB ahead) stalled the core until most of
// them arrived, then left memory idle while it computed. Fetched into L2, not L1 (fetch): a
// bf16 head's 4 positions are 8 lines, so the lines in flight a block ahead outnumber what L1
// can have outstanding, and a core
// stalled on its fetches; L2 can have more outstanding, and its hits cost a few cycles more
// (measured side by side: see the commit that made it).
constexpr int64_t kBlockPositions = 4;
constexpr int64_t kFetchPositions = 8;
constexpr int64_t kMaxHeadsAGroup = 64;   // heads one task attends (more: more tasks)

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

// The largest of `start` and x[0..count), eight lanes at a time, as a scalar loop of
// `x[i] > largest ? x[i] : largest` from `start` finds it (a NaN in x is passed over alike),
// without that loop's chain of compares: a maximum is the same in any order (of -0 and +0
// either may come out, and every use below gives the same bits for both).
inline float largest_of(float start, const float* x, int64_t count) {
    __m256 lanes = _mm256_set1_ps(start);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(x + i), lanes);
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    float largest = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
    for (; i < count; ++i) largest = x[i] > largest ? x[i] : largest;
    return largest;
}

// One head's key or value for an int8 cache: round(x / scale) with scale = max |x| / 127 (all
// zeros: scale 0), so x ~ q * scale; returns the scale.
float quantize_vector(const float* x, int64_t dim, int8_t* quantized) {
    float magnitudes[256];
    for (int64_t d = 0; d < dim; ++d) magnitudes[d] = std::fabs(x[d]);
    const float largest = largest_of(0.0f, magnitudes, dim);
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

// Sixteen bf16 elements as two vectors of floats without a shuffle: a 32-bit lane holds
// elements 2j (its low half) and 2j + 1 (its high half), so `low_halves` gives the even
// elements and `high_halves` the odd ones, each moved or masked into a float's top 16 bits.
inline __m256 low_halves(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}

inline __m256 high_halves(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(-65536)));
}

inline __m256i load_pairs(const uint16_t* k) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k));
}

inline __m256 load8(const int8_t* k) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// The query's products with COUNT consecutive keys (`stride` elements apart; dim % 8 == 0),
// eight lanes each, the lanes accumulated in dimension order: sums[i] for key i.
template <typename Element, int COUNT>
inline void dot_lanes(const float* query, const Element* keys, int64_t stride, int64_t dim,
                      __m256* sums) {
    for (int i = 0; i < COUNT; ++i) sums[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 q = _mm256_loadu_ps(query + d);
        for (int i = 0; i < COUNT; ++i)
            sums[i] = _mm256_fmadd_ps(q, load8(keys + i * stride + d), sums[i]);
    }
}

// The same for bf16 keys (dim % 16 == 0) against a query in split_pairs' order: each 16
// dimensions widened without a shuffle, the even and the odd elements in chains of their own.
template <int COUNT>
inline void dot_pairs(const float* split_query, const uint16_t* keys, int64_t stride,
                      int64_t dim, __m256* sums) {
    __m256 even[COUNT], odd[COUNT];
    for (int i = 0; i < COUNT; ++i) even[i] = odd[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        const __m256 q_even = _mm256_loadu_ps(split_query + d);
        const __m256 q_odd = _mm256_loadu_ps(split_query + d + 8);
        for (int i = 0; i < COUNT; ++i) {
            const __m256i pairs = load_pairs(keys + i * stride + d);
            even[i] = _mm256_fmadd_ps(q_even, low_halves(pairs), even[i]);
            odd[i] = _mm256_fmadd_ps(q_odd, high_halves(pairs), odd[i]);
        }
    }
    for (int i = 0; i < COUNT; ++i) sums[i] = _mm256_add_ps(even[i], odd[i]);
}

// A vector's 16-element pieces each as its 8 even elements, then its 8 odd ones.
inline void split_pairs(const float* x, int64_t dim, float* out) {
    for (int64_t d = 0; d < dim; d += 16)
        for (int64_t j = 0; j < 8; ++j) {
            out[d + j] = x[d + 2 * j];
            out[d + 8 + j] = x[d + 2 * j + 1];
        }
}

// A bf16 head of dim % 16 == 0 is read in pairs: its query in split_pairs' order, dot_pairs.
template <typename Element>
inline bool reads_pairs(int64_t dim) {
    return sizeof(Element) == 2 && dim % 16 == 0;
}

// The query's products with COUNT consecutive keys (dim % 8 == 0): dot_pairs where the head is
// read in pairs, else dot_lanes.
template <typename Element, int COUNT>
inline void dot(const float* query, const Element* keys, int64_t stride, int64_t dim,
                __m256* sums) {
    if constexpr (sizeof(Element) == 2) {
        if (reads_pairs<Element>(dim)) return dot_pairs<COUNT>(query, keys, stride, dim, sums);
    }
    dot_lanes<Element, COUNT>(query, keys, stride, dim, sums);
}

// Sixteen consecutive elements as two vectors of floats: bf16 as its even and its odd elements
// (no shuffle), int8 as its first eight and its last eight.
inline void load16(const uint16_t* x, __m256& a, __m256& b) {
    const __m256i pairs = load_pairs(x);
    a = low_halves(pairs);
    b = high_halves(pairs);
}

inline void load16(const int8_t* x, __m256& a, __m256& b) {
    a = load8(x);
    b = load8(x + 8);
}

// The eight lanes' sum, always in the same order.
inline float hsum(__m256 lanes) {
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// One sequence's cache at one layer (position-major: position p of head h at
// (p * heads + h) * dim; an int8 cache's scales at p * heads + h).
template <typename Element>
struct LayerRun {
    Element* keys;
    Element* values;
    float* key_scales;    // int8 caches only
    float* value_scales;
    int64_t heads, dim, held;  // held: positions the cache can hold (never read past)

    int64_t stride() const { return heads * dim; }
    Element* key(int64_t position, int64_t head) const {
        return keys + (position * heads + head) * dim;
    }
    Element* value(int64_t position, int64_t head) const {
        return values + (position * heads + head) * dim;
    }
};

// Store the new position's key and value of one head.
template <typename Element>
void store(const LayerRun<Element>& run, int64_t head, int64_t length, const float* new_key,
           const float* new_value) {
    Element* key = run.key(length, head);
    Element* value = run.value(length, head);
    const int64_t dim = run.dim;
    if constexpr (sizeof(Element) == 2) {
        for (int64_t d = 0; d < dim; ++d) {
            key[d] = to_bf16(new_key[d]);
            value[d] = to_bf16(new_value[d]);
        }
    } else {
        const int64_t at = length * run.heads + head;
        run.key_scales[at] = quantize_vector(new_key, dim, key);
        run.value_scales[at] = quantize_vector(new_value, dim, value);
    }
}

// Fetch ahead, into L2 (locality 2: prefetcht1), what heads [head_lo, head_hi) read of
// positions [first, end) (never past the cache).
template <typename Element>
inline void fetch(const Element* base, const LayerRun<Element>& run, int64_t first, int64_t end,
                  int64_t head_lo, int64_t head_hi) {
    end = end < run.held ? end : run.held;
    const int64_t span = (head_hi - head_lo) * run.dim * static_cast<int64_t>(sizeof(Element));
    for (int64_t position = first; position < end; ++position) {
        const char* at =
            reinterpret_cast<const char*>(base + (position * run.heads + head_lo) * run.dim);
        for (int64_t byte = 0; byte < span; byte += 64) __builtin_prefetch(at + byte, 0, 2);
    }
}

// Heads [head_lo, head_hi) of one sequence over positions 0..length of its cache (the new
// token's key and value stored), a block of positions at a time, so the layer's run is read
// front to back once for the keys and once for the values. Each head's numbers are formed as
// they would be alone: every score one dot and hsum, the softmax over that head's scores,
// each output lane's multiply-adds in position order (its running sums kept in `sums` between
// blocks). queries: [heads][dim] (rotated); scores: [heads][length + 1]; sums: [heads][dim];
// results: the row's output at head_lo.
template <typename Element>
void attend(const LayerRun<Element>& run, int64_t length, int64_t head_lo, int64_t head_hi,
            float scale, const float* queries, float* scores, float* sums, float* results) {
    const int64_t positions = length + 1, dim = run.dim, stride = run.stride();
    const int64_t count = head_hi - head_lo;
    const auto block_end = [positions](int64_t first) {
        return first + kBlockPositions < positions ? first + kBlockPositions : positions;
    };

    fetch(run.keys, run, 0, kFetchPositions, head_lo, head_hi);
    for (int64_t first = 0; first < positions; first += kBlockPositions) {
        const int64_t end = block_end(first);
        for (int64_t head = head_lo; head < head_hi; ++head) {
            fetch(run.keys, run, first + kFetchPositions, end + kFetchPositions, head, head + 1);
            const float* query = queries + (head - head_lo) * dim;
            float* score = scores + (head - head_lo) * positions;
            const auto scaled = [&](int64_t position, float dot) {
                if constexpr (sizeof(Element) == 2) {
                    score[position] = dot * scale;
                } else {
                    score[position] = dot * (run.key_scales[position * run.heads + head] * scale);
                }
            };
            int64_t position = first;
            if (dim % 8 == 0) {
                // four positions at a time: four independent chains of multiply-adds (a block
                // is whole groups of four); each position's sum is formed the same way
                // whatever its group
                for (; position + 4 <= end; position += 4) {
                    __m256 lanes[4];
                    dot<Element, 4>(query, run.key(position, head), stride, dim, lanes);
                    for (int64_t i = 0; i < 4; ++i) scaled(position + i, hsum(lanes[i]));
                }
                for (; position < end; ++position) {
                    __m256 lanes[1];
                    dot<Element, 1>(query, run.key(position, head), stride, dim, lanes);
                    scaled(position, hsum(lanes[0]));
                }
            }
            for (; position < end; ++position) {  // a head dimension not a multiple of 8
                const Element* k = run.key(position, head);
                float dot = 0.0f;
                if constexpr (sizeof(Element) == 2) {
                    for (int64_t d = 0; d < dim; ++d) dot += query[d] * from_bf16(k[d]);
                } else {
                    for (int64_t d = 0; d < dim; ++d) dot += query[d] * static_cast<float>(k[d]);
                }
                scaled(position, dot);
            }
        }
    }

    float inverses[kMaxHeadsAGroup];
    for (int64_t head = head_lo; head < head_hi; ++head) {
        float* score = scores + (head - head_lo) * positions;
        const float largest = largest_of(score[0], score, positions);
        float total = 0.0f;
        for (int64_t position = 0; position < positions; ++position) {
            score[position] = exp_nonpositive(score[position] - largest);
            total += score[position];
        }
        inverses[head - head_lo] = 1.0f / total;
    }

    std::fill(sums, sums + count * dim, 0.0f);
    fetch(run.values, run, 0, kFetchPositions, head_lo, head_hi);
    for (int64_t first = 0; first < positions; first += kBlockPositions) {
        const int64_t end = block_end(first);
        for (int64_t head = head_lo; head < head_hi; ++head) {
            fetch(run.values, run, first + kFetchPositions, end + kFetchPositions, head, head + 1);
            const float* score = scores + (head - head_lo) * positions;
            float* sum = sums + (head - head_lo) * dim;
            const auto weight_of = [&](int64_t position) {
                if constexpr (sizeof(Element) == 2) {
                    return score[position];
                } else {
                    return score[position] * run.value_scales[position * run.heads + head];
                }
            };
            if (dim % 64 == 0) {
                // 64 dimensions at a time in eight registers (loaded and stored once a block:
                // an array in memory made each position's adds wait on the previous
                // position's stores), each 16 as load16 gives them: for bf16 its even and its
                // odd elements, so `sum` holds them in split_pairs' order; every dimension's
                // multiply-adds in position order
                for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                    __m256 lanes[8];
                    for (int j = 0; j < 8; ++j) lanes[j] = _mm256_loadu_ps(sum + d0 + 8 * j);
                    for (int64_t position = first; position < end; ++position) {
                        const __m256 weight = _mm256_set1_ps(weight_of(position));
                        const Element* v = run.value(position, head) + d0;
                        for (int c = 0; c < 4; ++c) {
                            __m256 a, b;
                            load16(v + 16 * c, a, b);
                            lanes[2 * c] = _mm256_fmadd_ps(weight, a, lanes[2 * c]);
                            lanes[2 * c + 1] = _mm256_fmadd_ps(weight, b, lanes[2 * c + 1]);
                        }
                    }
                    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(sum + d0 + 8 * j, lanes[j]);
                }
                continue;
            }
            for (int64_t position = first; position < end; ++position) {
                const Element* v = run.value(position, head);
                const float weight = weight_of(position);
                if constexpr (sizeof(Element) == 2) {
                    for (int64_t d = 0; d < dim; ++d) sum[d] += weight * from_bf16(v[d]);
                } else {
                    for (int64_t d = 0; d < dim; ++d) sum[d] += weight * static_cast<float>(v[d]);
                }
            }
        }
    }
    const bool split = sizeof(Element) == 2 && dim % 64 == 0;  // the sums' order, as above
    for (int64_t head = head_lo; head < head_hi; ++head) {
        const float* sum = sums + (head - head_lo) * dim;
        float* result = results + (head - head_lo) * dim;
        const float inverse = inverses[head - head_lo];
        if (split) {
            for (int64_t d = 0; d < dim; d += 16)
                for (int64_t j = 0; j < 8; ++j) {
                    result[d + 2 * j] = sum[d + j] * inverse;
                    result[d + 2 * j + 1] = sum[d + 8 + j] * inverse;
                }
            continue;
        }
        for (int64_t d = 0; d < dim; ++d) result[d] = sum[d] * inverse;
    }
}

// What a pass of `attention_pass` does for each (row, head): store the new key and value, then
// attend (a decode step); or only store, or only attend (a prompt: every position stored
// before any attends).
enum AttentionPass { kStoreAndAttend, kStore, kAttend };

// One task: heads [head_lo, head_hi) of one row. scratch: 2 * heads * dim + heads * (length +
// 1) floats.
template <typename Element>
void run_task(AttentionPass pass, const LayerRun<Element>& run, int64_t length,
              int64_t head_lo, int64_t head_hi, float scale, const float* q, const float* k_new,
              const float* v_new, const float* position_cos, const float* position_sin,
              float* scratch, float* out) {
    const int64_t dim = run.dim, count = head_hi - head_lo;
    float* queries = scratch;             // [count][dim]
    float* sums = queries + count * dim;  // [count][dim]
    float* scores = sums + count * dim;   // [count][length + 1]
    float rotated_key[256];
    for (int64_t head = head_lo; head < head_hi; ++head) {
        const float* new_key = k_new + head * dim;
        float* query = queries + (head - head_lo) * dim;
        if (position_cos != nullptr) {  // at the new token's position
            if (pass != kStore) rotate(q + head * dim, position_cos, position_sin, dim, query);
            if (pass != kAttend) rotate(new_key, position_cos, position_sin, dim, rotated_key);
            new_key = rotated_key;
        } else if (pass != kStore) {
            std::copy(q + head * dim, q + (head + 1) * dim, query);
        }
        if (pass != kAttend) store(run, head, length, new_key, v_new + head * dim);
        if (pass != kStore && reads_pairs<Element>(dim)) {  // for dot_pairs
            float plain[256];
            std::copy(query, query + dim, plain);
            split_pairs(plain, dim, query);
        }
    }
    if (pass != kStore)
        attend(run, length, head_lo, head_hi, scale, queries, scores, sums, out + head_lo * dim);
}

}  // namespace

// With `key_scales`/`value_scales` NULL the caches hold bf16; otherwise int8, and these give
// each row's scales, [layers, capacity, heads] float32.

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
    // a row's heads split into groups where there are fewer rows than two a thread, so every
    // thread has work (a step of one row); a head's numbers do not depend on its group
    int64_t groups = rows >= 2 * threads ? 1 : (2 * threads + rows - 1) / rows;
    groups = groups < heads ? groups : heads;
    while ((heads + groups - 1) / groups > kMaxHeadsAGroup) ++groups;
    const int64_t widest = (heads + groups - 1) / groups;
    const bool int8 = key_scales != nullptr;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scratch(widest * (2 * dim + longest));
        // guided, as the int8 product: a slow vCPU's share goes to the other thread
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < rows * groups; ++task) {
            const int64_t row = task / groups, group = task % groups;
            const int64_t head_lo = group * heads / groups;
            const int64_t head_hi = (group + 1) * heads / groups;
            const int64_t layer_at = layer * capacity[row] * heads;  // (positions x heads)
            const float* position_cos = cos == nullptr ? nullptr : cos + lengths[row] * dim;
            const float* position_sin = sin == nullptr ? nullptr : sin + lengths[row] * dim;
            const float* row_q = q + row * q_row_stride;
            const float* row_k = k_new + row * k_row_stride;
            const float* row_v = v_new + row * v_row_stride;
            float* row_out = out + row * heads * dim;
            if (int8) {
                const LayerRun<int8_t> run{static_cast<int8_t*>(keys[row]) + layer_at * dim,
                                           static_cast<int8_t*>(values[row]) + layer_at * dim,
                                           key_scales[row] + layer_at,
                                           value_scales[row] + layer_at,
                                           heads,
                                           dim,
                                           capacity[row]};
                run_task(pass, run, lengths[row], head_lo, head_hi, scale, row_q, row_k, row_v,
                         position_cos, position_sin, scratch.data(), row_out);
            } else {
                const LayerRun<uint16_t> run{static_cast<uint16_t*>(keys[row]) + layer_at * dim,
                                             static_cast<uint16_t*>(values[row]) + layer_at * dim,
                                             nullptr,
                                             nullptr,
                                             heads,
                                             dim,
                                             capacity[row]};
                run_task(pass, run, lengths[row], head_lo, head_hi, scale, row_q, row_k, row_v,
                         position_cos, position_sin, scratch.data(), row_out);
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
