// The decode loop's fused kernels: plain C++ with OpenMP, called through ctypes.
//
// chatts_decode_attention: attention for one decode step. Every sequence adds one token and
// attends over its own keys and values; one call per layer for all sequences of a batch.
// Each (sequence, head) pair is computed start to finish by one thread, in a fixed order
// that depends only on that sequence's own length, so a sequence's result is the same
// whatever else shares its batch and however the threads split the work.
//
// Layout: each sequence has its own cache, [layers, heads, capacity, dim] floats for keys and
// another for values. q, k_new, v_new: per sequence, heads * dim contiguous floats, rows
// `*_row_stride` floats apart. out: [rows, heads * dim].
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

}  // namespace

extern "C" int chatts_decode_attention(
    int64_t rows, int64_t heads, int64_t dim, int64_t layer, float scale, int threads,
    const float* q, int64_t q_row_stride,
    const float* k_new, int64_t k_row_stride,
    const float* v_new, int64_t v_row_stride,
    float* const* keys, float* const* values,  // per row: its cache's first element
    const int64_t* capacity,                   // per row: positions its cache can hold
    const int64_t* lengths,                    // per row: positions already held
    float* out) {
    if (dim > 256) return 1;
    int64_t longest = 0;
    for (int64_t row = 0; row < rows; ++row) {
        if (lengths[row] >= capacity[row]) return 2;
        if (lengths[row] + 1 > longest) longest = lengths[row] + 1;
    }
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> scores(longest);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; ++task) {
            const int64_t row = task / heads, head = task % heads;
            const int64_t positions = lengths[row] + 1;
            const int64_t head_offset = (layer * heads + head) * capacity[row] * dim;
            float* key = keys[row] + head_offset;
            float* value = values[row] + head_offset;
            const float* query = q + row * q_row_stride + head * dim;
            // the new token's key and value go into the cache first
            std::memcpy(key + lengths[row] * dim, k_new + row * k_row_stride + head * dim,
                        dim * sizeof(float));
            std::memcpy(value + lengths[row] * dim, v_new + row * v_row_stride + head * dim,
                        dim * sizeof(float));

            float* score = scores.data();
            for (int64_t position = 0; position < positions; ++position) {
                const float* k = key + position * dim;
                float dot = 0.0f;
                for (int64_t d = 0; d < dim; ++d) dot += query[d] * k[d];
                score[position] = dot * scale;
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
                const float* v = value + position * dim;
                const float weight = score[position];
                for (int64_t d = 0; d < dim; ++d) accumulated[d] += weight * v[d];
            }
            float* result = out + row * heads * dim + head * dim;
            const float inverse = 1.0f / total;
            for (int64_t d = 0; d < dim; ++d) result[d] = accumulated[d] * inverse;
        }
    }
    return 0;
}

// chatts_rms_norm_unit_rows: LlamaRMSNorm (x / rms(x) * gain) of each row, then the row divided
// by its largest magnitude, ready for the int8 kernel's fixed activation scale; `row_max`
// receives that magnitude, by which the int8 product is multiplied back. One pass over the
// row instead of the dozen operators of torch's rms_norm, absolute maximum and division.
extern "C" void chatts_rms_norm_unit_rows(
    int64_t rows, int64_t width, const float* x, int64_t x_row_stride, const float* gain,
    float eps, float* out, float* row_max) {
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t row = 0; row < rows; ++row) {
        const float* in = x + row * x_row_stride;
        float* normed = out + row * width;
        float squares = 0.0f;
        for (int64_t i = 0; i < width; ++i) squares += in[i] * in[i];
        const float inverse_rms = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
        float largest = 0.0f;
        for (int64_t i = 0; i < width; ++i) {
            normed[i] = in[i] * inverse_rms * gain[i];
            const float magnitude = std::fabs(normed[i]);
            largest = magnitude > largest ? magnitude : largest;
        }
        largest = largest > 1e-12f ? largest : 1e-12f;
        for (int64_t i = 0; i < width; ++i) normed[i] = normed[i] / largest;
        row_max[row] = largest;
    }
}
