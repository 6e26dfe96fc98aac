// chatts_int4_linear: the int8 linear's product on 4-bit weights with a scale per group of
// input features (CHATTTS_QUANTIZE=int4, opt-in): half the bytes a decode step reads.
//
// Weights: each output channel's inputs in groups of `group` (a multiple of 8, at most 64),
// each group symmetric in [-7, 7] with its own float scale; kept as nibbles q + 8 in blocks of
// 16 channels: packed[block][k / 8][channel][4], the low nibble of byte [c][j] the weight of
// input 8p + j, the high nibble that of input 8p + 4 + j. Activations: quantized per row as the
// AVX2 int8 product quantizes them (63 levels a side), kept signed. vpmaddubsw multiplies the
// unsigned nibbles by the signed levels and adds pairs into int16: (q + 8) * a, at most
// 2 * 15 * 63 = 1890 a pair, so a whole group of 64 adds up in int16 without saturating
// (30240); one vpmaddwd by ones a group widens it, and 8 * (the group's sum of levels, once
// per row) takes the + 8 off again. Each group's exact integer sum, converted to float, is
// multiplied by the group's scale (which holds 1/levels) and added to the row's float sum in
// group order; the row's largest magnitude multiplies the total. The order depends on nothing
// but k: a row's result never depends on its batch, and a plain float reference (tests) gives
// the same bits.
//
// With AVX512-VNNI (ChattsProduct VNNI) the same product takes vpdpbusd: the unsigned nibbles
// times the signed levels, four inputs added into each channel's int32 lane, so a group's sum
// is the same exact integer, and the float steps after it are the same operations lane by
// lane: the AVX2 variant's bits, on 16 channels a register and up to 4 rows a pass.
//
// On aarch64 (int4_linear_arm.cpp) NEON, DotProd and I8MM form the same integers and give the
// same bits.

namespace {
constexpr int kInt4Zero = 8;  // nibble = q + 8
constexpr int64_t kInt4MaxGroup = 64;
}  // namespace

#if CHATTS_X86
namespace {

// ROWS (1 or 2) rows of one block of 16 channels: 2 * ROWS int16 sums within a group and
// 2 * ROWS float sums across groups stay in registers.
template <int ROWS, int HINT>
__attribute__((target("avx2,fma"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void int4_block_avx2(int64_t k, int64_t group, const int8_t* xs, int64_t x_stride,
                     const int32_t* level_sums, int64_t sums_stride, const uint8_t* block,
                     const float* scales, const float* row_max, const float* residual,
                     int64_t residual_stride, float* out, int64_t out_stride, int valid,
                     uintptr_t weights_end, uintptr_t prefetch_from, int64_t prefetch_step) {
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, g0 = f0, g1 = f0;  // rows 0, 1: channels 0-7, 8-15
    const uint8_t* w = block;
    uintptr_t ahead = prefetch_from;
    for (int64_t start = 0, index = 0; start < k; start += group, ++index) {
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, t0 = s0, t1 = s0;
        for (int64_t i = start; i < start + group; i += 8, w += 64, ahead += prefetch_step) {
            if (prefetch_step > 0 && ahead < weights_end) prefetch_weights<HINT>(ahead);
            const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
            const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
            // channels 0-7 and 8-15 of inputs i..i+3 (low nibbles), then of i+4..i+7 (high)
            const __m256i w0 = _mm256_and_si256(low, nibble);
            const __m256i w1 = _mm256_and_si256(high, nibble);
            const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble);
            const __m256i w3 = _mm256_and_si256(_mm256_srli_epi16(high, 4), nibble);
#define CHATTS_ROW(R, S, T)                                                               \
            if constexpr (ROWS > R) {                                                     \
                int32_t first, second;                                                    \
                std::memcpy(&first, xs + R * x_stride + i, 4);                            \
                std::memcpy(&second, xs + R * x_stride + i + 4, 4);                      \
                const __m256i x0 = _mm256_set1_epi32(first), x1 = _mm256_set1_epi32(second); \
                S = _mm256_add_epi16(S, _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0),    \
                                                         _mm256_maddubs_epi16(w2, x1)));  \
                T = _mm256_add_epi16(T, _mm256_add_epi16(_mm256_maddubs_epi16(w1, x0),    \
                                                         _mm256_maddubs_epi16(w3, x1)));  \
            }
            CHATTS_ROW(0, s0, t0) CHATTS_ROW(1, s1, t1)
#undef CHATTS_ROW
        }
        const __m256 scale_low = _mm256_loadu_ps(scales + index * 16);
        const __m256 scale_high = _mm256_loadu_ps(scales + index * 16 + 8);
#define CHATTS_GROUP(R, S, T, F, G)                                                       \
        if constexpr (ROWS > R) {                                                         \
            const __m256i shift = _mm256_set1_epi32(kInt4Zero * level_sums[R * sums_stride + index]); \
            const __m256i low_sum = _mm256_sub_epi32(_mm256_madd_epi16(S, ones), shift);  \
            const __m256i high_sum = _mm256_sub_epi32(_mm256_madd_epi16(T, ones), shift); \
            F = _mm256_add_ps(F, _mm256_mul_ps(_mm256_cvtepi32_ps(low_sum), scale_low));  \
            G = _mm256_add_ps(G, _mm256_mul_ps(_mm256_cvtepi32_ps(high_sum), scale_high)); \
        }
        CHATTS_GROUP(0, s0, t0, f0, g0) CHATTS_GROUP(1, s1, t1, f1, g1)
#undef CHATTS_GROUP
    }
    const __m256 sums[2][2] = {{f0, g0}, {f1, g1}};
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int half = 0; half < 2; ++half) {
        const int channels = valid - 8 * half;
        if (channels <= 0) break;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(channels), lanes);
        for (int r = 0; r < ROWS; ++r) {
            __m256 result = _mm256_mul_ps(sums[r][half], _mm256_set1_ps(row_max[r]));
            if (residual != nullptr)  // added after the product is rounded, as torch adds
                result = _mm256_add_ps(
                    _mm256_maskload_ps(residual + r * residual_stride + 8 * half, mask), result);
            _mm256_maskstore_ps(out + r * out_stride + 8 * half, mask, result);
        }
    }
}

// ROWS (1..4) rows of one block of 16 channels with vpdpbusd: per row two int32 chains within
// a group (the low nibbles' inputs and the high ones', so no vpdpbusd waits on the one before
// it) and a float sum across groups, in registers.
template <int ROWS, int HINT>
__attribute__((target("avx512f,avx512bw,avx512vnni"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void int4_block_vnni(int64_t k, int64_t group, const int8_t* xs, int64_t x_stride,
                     const int32_t* level_sums, int64_t sums_stride, const uint8_t* block,
                     const float* scales, const float* row_max, const float* residual,
                     int64_t residual_stride, float* out, int64_t out_stride, int valid,
                     uintptr_t weights_end, uintptr_t prefetch_from, int64_t prefetch_step) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 f0 = _mm512_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
    const uint8_t* w = block;
    uintptr_t ahead = prefetch_from;
    for (int64_t start = 0, index = 0; start < k; start += group, ++index) {
        __m512i l0 = _mm512_setzero_si512(), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0,
                h2 = l0, h3 = l0;
        for (int64_t i = start; i < start + group; i += 8, w += 64, ahead += prefetch_step) {
            if (prefetch_step > 0 && ahead < weights_end) prefetch_weights<HINT>(ahead);
            const __m512i both = _mm512_loadu_si512(w);
            // 16 channels of inputs i..i+3 (low nibbles), then of i+4..i+7 (high)
            const __m512i low = _mm512_and_si512(both, nibble);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
#define CHATTS_ROW(R)                                                                     \
            if constexpr (ROWS > R) {                                                     \
                int32_t first, second;                                                    \
                std::memcpy(&first, xs + R * x_stride + i, 4);                            \
                std::memcpy(&second, xs + R * x_stride + i + 4, 4);                      \
                dpbusd(l##R, low, _mm512_set1_epi32(first));                              \
                dpbusd(h##R, high, _mm512_set1_epi32(second));                            \
            }
            CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
#undef CHATTS_ROW
        }
        const __m512 scale = _mm512_loadu_ps(scales + index * 16);
#define CHATTS_GROUP(R)                                                                   \
        if constexpr (ROWS > R) {                                                         \
            const __m512i shift = _mm512_set1_epi32(kInt4Zero * level_sums[R * sums_stride + index]); \
            const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(l##R, h##R), shift);    \
            f##R = _mm512_add_ps(f##R, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), scale));    \
        }
        CHATTS_GROUP(0) CHATTS_GROUP(1) CHATTS_GROUP(2) CHATTS_GROUP(3)
#undef CHATTS_GROUP
    }
    const __m512 sums[4] = {f0, f1, f2, f3};
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < ROWS; ++r) {
        __m512 result = _mm512_mul_ps(sums[r], _mm512_set1_ps(row_max[r]));
        if (residual != nullptr)  // added after the product is rounded, as torch adds
            result = _mm512_add_ps(
                _mm512_maskz_loadu_ps(mask, residual + r * residual_stride), result);
        _mm512_mask_storeu_ps(out + r * out_stride, mask, result);
    }
}

using Int4BlockFunction = void (*)(int64_t, int64_t, const int8_t*, int64_t, const int32_t*,
                                   int64_t, const uint8_t*, const float*, const float*,
                                   const float*, int64_t, float*, int64_t, int, uintptr_t,
                                   uintptr_t, int64_t);
template <int HINT>
constexpr Int4BlockFunction kInt4BlockFunctions[3] = {nullptr, int4_block_avx2<1, HINT>,
                                                      int4_block_avx2<2, HINT>};
template <int HINT>
constexpr Int4BlockFunction kInt4VnniBlockFunctions[5] = {
    nullptr, int4_block_vnni<1, HINT>, int4_block_vnni<2, HINT>, int4_block_vnni<3, HINT>,
    int4_block_vnni<4, HINT>};

}  // namespace

// out[rows, n] = the rows of x (RMSNorm-ed with `gain`, or silu(gate) * up with `swiglu`, as
// chatts_int8_linear takes them) times the int4 weights, plus `residual`. `scales`:
// [blocks, k / group, 16] floats, each group's scale divided by `levels`.
static int32_t int4_linear(const ChattsInt4LinearArgs& a) {
    const int64_t rows = a.rows, n = a.n, k = a.k, group = a.group;
    if (group < 8 || group > kInt4MaxGroup || group % 8 != 0 || k % group != 0)
        return CHATTS_BAD_GROUP;
    const bool vnni = a.product == CHATTS_PRODUCT_VNNI;
    if (vnni) {
        if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
            return CHATTS_CPU_LACKS_PRODUCT;
    } else if (a.product == CHATTS_PRODUCT_AVX2) {
        if (!__builtin_cpu_supports("avx2")) return CHATTS_CPU_LACKS_PRODUCT;
    } else {
        return CHATTS_UNKNOWN_PRODUCT;
    }
    // 63 levels for both: the AVX2 pairs' int16 sums need them, and so the two agree
    if (a.levels < 1 || a.levels > 63) return CHATTS_TOO_MANY_LEVELS;
    const ChattsTuning& tuning = a.tuning;
    if (!valid_tuning(tuning)) return CHATTS_BAD_TUNING;
    const int64_t groups = k / group;
    const QuantizedRows prepared(rows, k, a.x, a.x_row_stride, a.gain, a.eps, a.swiglu, a.levels,
                                 a.levels + 1, a.threads);
    // the levels signed (without the u8 offset), and each group's sum of them per row
    std::unique_ptr<int8_t[]> xs(new int8_t[rows * k]);
    std::unique_ptr<int32_t[]> level_sums(new int32_t[rows * groups]);
#pragma omp parallel for num_threads(a.threads) schedule(static) if (rows > 1)
    for (int64_t row = 0; row < rows; ++row) {
        const uint8_t* quantized = prepared.quantized.get() + row * k;
        int8_t* levels = xs.get() + row * k;
        for (int64_t g = 0; g < groups; ++g) {
            int32_t sum = 0;
            for (int64_t i = g * group; i < (g + 1) * group; ++i) {
                levels[i] = static_cast<int8_t>(static_cast<int32_t>(quantized[i]) - a.levels - 1);
                sum += levels[i];
            }
            level_sums[row * groups + g] = sum;
        }
    }
    const int64_t blocks = (n + 15) / 16, block_bytes = 8 * k;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(a.packed) + blocks * block_bytes;
    const int64_t prefetch_bytes = prefetch_bytes_for(tuning, rows);
    const bool t0 = tuning.prefetch_hint == 1;
    const Int4BlockFunction* functions =
        vnni ? (t0 ? kInt4VnniBlockFunctions<1> : kInt4VnniBlockFunctions<0>)
             : (t0 ? kInt4BlockFunctions<1> : kInt4BlockFunctions<0>);
    // 2 rows a pass (VNNI: 4), each step 64 bytes of 8 inputs (as the int8 product,
    // pass_prefetch)
    const int64_t per_pass = vnni ? 4 : 2;
    const int64_t passes = (rows + per_pass - 1) / per_pass, steps = k / 8;
    // guided, as the int8 product (gemm), for the same reason
#pragma omp parallel for num_threads(a.threads) schedule(guided)
    for (int64_t block = 0; block < blocks; ++block) {
        const int valid = static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
        const uintptr_t start = reinterpret_cast<uintptr_t>(a.packed + block * block_bytes);
        for (int64_t first = 0; first < rows; first += per_pass) {
            const int64_t count = rows - first < per_pass ? rows - first : per_pass;
            const PassPrefetch ahead = pass_prefetch(start, block_bytes, steps, prefetch_bytes,
                                                     first / per_pass, passes);
            functions[count](
                k, group, xs.get() + first * k, k, level_sums.get() + first * groups, groups,
                a.packed + block * block_bytes, a.scales + block * groups * 16,
                prepared.row_max.get() + first,
                a.residual == nullptr ? nullptr : a.residual + first * a.residual_stride + block * 16,
                a.residual_stride, a.out + first * a.out_stride + block * 16, a.out_stride, valid,
                weights_end, ahead.from, ahead.step);
        }
    }
    return CHATTS_OK;
}

#else
#include "int4_linear_arm.cpp"
#endif  // CHATTS_X86

extern "C" int32_t chatts_int4_linear(const ChattsInt4LinearArgs* a) { return int4_linear(*a); }
