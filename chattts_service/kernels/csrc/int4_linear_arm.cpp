// The int4 product on aarch64: NEON, DotProd and I8MM, the one the kernels chose for int8
// (arm_product checks the CPU runs it). Included by int4_linear.cpp on aarch64 only.
//
// The weights are Int4Packing's, as on x86: per 8 inputs 64 bytes, 4 bytes a channel, the low
// nibble of byte j the weight of input 8p + j and the high one that of input 8p + 4 + j, each
// q + 8. Unpacked, the low nibbles of a 16-byte load are 4 inputs of 4 channels, the int8
// packing's layout, and the high ones the next 4 inputs of the same channels; taking 8 off
// makes them signed (q in [-7, 7]), so nothing like x86's `8 * level sum` correction follows.
// The activations are quantized to 63 levels a side as on x86 but kept signed (zero point 0).
// So each group's integer sum is the x86 products' exact integer, and the float steps after it
// are theirs one for one: the group's sum as a float times its scale, added to the channel's
// float sum in group order; the total times the row's largest magnitude; the residual added.
// Every variant gives a row the x86 products' bits for it, at any row count or thread split.
//
// - NEON: smull into int16 (at most 7 * 63), sadalp into int32 pairs, addp at the group's end.
//   2 rows a pass.
// - DotProd: sdot, each row's 8 inputs one 8-byte register whose two 32-bit lanes take the low
//   and the high nibbles' products. 4 rows a pass.
// - I8MM: zipping the low and the high nibbles of two channels (zip1/zip2 on 32-bit lanes)
//   gives each channel its 8 inputs in order, as smmla takes them: a 2x8 block of two rows'
//   inputs times a 8x2 block of two channels' weights. 4 rows (two pairs) a pass; a last odd
//   row takes the DotProd loop.

#define CHATTS_EXACT_FLOAT \
    optimize("no-associative-math", "signed-zeros", "trapping-math", "fp-contract=off")

namespace {

// 8 inputs of 16 channels (64 bytes of nibbles): low[j] inputs 0-3 and high[j] inputs 4-7 of
// channels 4j..4j + 3, 4 bytes a channel, signed.
__attribute__((always_inline)) inline void unpack_nibbles(const uint8_t* w, int8x16_t low[4],
                                                          int8x16_t high[4]) {
    const uint8x16_t mask = vdupq_n_u8(0x0F);
    const int8x16_t zero = vdupq_n_s8(static_cast<int8_t>(kInt4Zero));
    for (int j = 0; j < 4; ++j) {
        const uint8x16_t bytes = vld1q_u8(w + 16 * j);
        low[j] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(bytes, mask)), zero);
        high[j] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(bytes, 4)), zero);
    }
}

// A group's exact sums of one row (4 channels a register) into its float sums: as x86's
// sum + float(group sum) * scale, each rounded.
__attribute__((CHATTS_EXACT_FLOAT, always_inline)) inline void add_group(
    float32x4_t totals[4], const int32x4_t sums[4], const float* scales) {
    for (int j = 0; j < 4; ++j)
        totals[j] = vaddq_f32(totals[j], vmulq_f32(vcvtq_f32_s32(sums[j]), vld1q_f32(scales + 4 * j)));
}

// One row's float sums times its largest magnitude, plus the residual; only the block's first
// `valid` channels are stored.
__attribute__((CHATTS_EXACT_FLOAT, always_inline)) inline void store_int4_row(
    const float32x4_t totals[4], float row_max, const float* residual, float* out, int valid) {
    for (int j = 0; j < 4 && 4 * j < valid; ++j)
        store_lanes(vmulq_f32(totals[j], vdupq_n_f32(row_max)), residual, out, 4 * j, valid);
}

// The arguments every block function takes: k, group, the s8 rows from the pass's first and
// their stride, the block's nibbles and scales, the rows' largest magnitudes, residual (or
// NULL) and its stride, out and its stride, the block's valid channels.
#define CHATTS_INT4_BLOCK_PARAMETERS                                                           \
    int64_t k, int64_t group, const int8_t *x, int64_t x_stride, const uint8_t *w,             \
        const float *scales, const float *row_max, const float *residual,                      \
        int64_t residual_stride, float *out, int64_t out_stride, int valid

// ROWS (1 or 2) rows of one block of 16 channels with smull and sadalp.
template <int ROWS>
__attribute__((CHATTS_EXACT_FLOAT)) void int4_block_neon(CHATTS_INT4_BLOCK_PARAMETERS) {
    float32x4_t totals[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) totals[r][j] = vdupq_n_f32(0.0f);
    for (int64_t start = 0, index = 0; start < k; start += group, ++index) {
        // per row and 4 channels: channels 0-1's pair sums, channels 2-3's
        int32x4_t first[ROWS][4], second[ROWS][4];
        for (int r = 0; r < ROWS; ++r)
            for (int j = 0; j < 4; ++j) first[r][j] = second[r][j] = vdupq_n_s32(0);
        for (int64_t i = start; i < start + group; i += 8, w += 64) {
            int8x16_t low[4], high[4];
            unpack_nibbles(w, low, high);
            for (int r = 0; r < ROWS; ++r) {
                int32_t four_low, four_high;
                std::memcpy(&four_low, x + r * x_stride + i, 4);
                std::memcpy(&four_high, x + r * x_stride + i + 4, 4);
                const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(four_low));
                const int8x16_t x1 = vreinterpretq_s8_s32(vdupq_n_s32(four_high));
                for (int j = 0; j < 4; ++j) {
                    first[r][j] = vpadalq_s16(first[r][j],
                                              vmull_s8(vget_low_s8(low[j]), vget_low_s8(x0)));
                    second[r][j] = vpadalq_s16(second[r][j], vmull_high_s8(low[j], x0));
                    first[r][j] = vpadalq_s16(first[r][j],
                                              vmull_s8(vget_low_s8(high[j]), vget_low_s8(x1)));
                    second[r][j] = vpadalq_s16(second[r][j], vmull_high_s8(high[j], x1));
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            int32x4_t sums[4];
            for (int j = 0; j < 4; ++j) sums[j] = vpaddq_s32(first[r][j], second[r][j]);
            add_group(totals[r], sums, scales + index * 16);
        }
    }
    for (int r = 0; r < ROWS; ++r)
        store_int4_row(totals[r], row_max[r],
                       residual == nullptr ? nullptr : residual + r * residual_stride,
                       out + r * out_stride, valid);
}

// ROWS (1..4) rows of one block with sdot.
template <int ROWS>
__attribute__((target("arch=armv8.2-a+dotprod"), CHATTS_EXACT_FLOAT)) void int4_block_dotprod(
    CHATTS_INT4_BLOCK_PARAMETERS) {
    float32x4_t totals[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) totals[r][j] = vdupq_n_f32(0.0f);
    for (int64_t start = 0, index = 0; start < k; start += group, ++index) {
        int32x4_t sums[ROWS][4];
        for (int r = 0; r < ROWS; ++r)
            for (int j = 0; j < 4; ++j) sums[r][j] = vdupq_n_s32(0);
        for (int64_t i = start; i < start + group; i += 8, w += 64) {
            int8x16_t low[4], high[4];
            unpack_nibbles(w, low, high);
            for (int r = 0; r < ROWS; ++r) {
                const int8x8_t inputs = vld1_s8(x + r * x_stride + i);
                for (int j = 0; j < 4; ++j) {
                    sums[r][j] = vdotq_lane_s32(sums[r][j], low[j], inputs, 0);
                    sums[r][j] = vdotq_lane_s32(sums[r][j], high[j], inputs, 1);
                }
            }
        }
        for (int r = 0; r < ROWS; ++r) add_group(totals[r], sums[r], scales + index * 16);
    }
    for (int r = 0; r < ROWS; ++r)
        store_int4_row(totals[r], row_max[r],
                       residual == nullptr ? nullptr : residual + r * residual_stride,
                       out + r * out_stride, valid);
}

// PAIRS (1 or 2) pairs of rows of one block with smmla (a pair's second row may repeat its
// first: `rows` says how many are real).
template <int PAIRS>
__attribute__((target("arch=armv8.2-a+i8mm"), CHATTS_EXACT_FLOAT)) void int4_block_i8mm(
    CHATTS_INT4_BLOCK_PARAMETERS, int rows) {
    float32x4_t totals[2 * PAIRS][4];
    for (int r = 0; r < 2 * PAIRS; ++r)
        for (int j = 0; j < 4; ++j) totals[r][j] = vdupq_n_f32(0.0f);
    const int8_t* row_at[2 * PAIRS];
    for (int r = 0; r < 2 * PAIRS; ++r) row_at[r] = x + (r < rows ? r : rows - 1) * x_stride;
    for (int64_t start = 0, index = 0; start < k; start += group, ++index) {
        // sums[p][c]: rows 2p and 2p + 1 by channels 2c and 2c + 1 (c = 0..7)
        int32x4_t sums[PAIRS][8];
        for (int p = 0; p < PAIRS; ++p)
            for (int c = 0; c < 8; ++c) sums[p][c] = vdupq_n_s32(0);
        for (int64_t i = start; i < start + group; i += 8, w += 64) {
            int8x16_t low[4], high[4];
            unpack_nibbles(w, low, high);
            int8x16_t channels[8];  // channels 2c and 2c + 1, their 8 inputs in order
            for (int j = 0; j < 4; ++j) {
                const int32x4_t first = vreinterpretq_s32_s8(low[j]);
                const int32x4_t second = vreinterpretq_s32_s8(high[j]);
                channels[2 * j] = vreinterpretq_s8_s32(vzip1q_s32(first, second));
                channels[2 * j + 1] = vreinterpretq_s8_s32(vzip2q_s32(first, second));
            }
            for (int p = 0; p < PAIRS; ++p) {
                const int8x16_t inputs =
                    vcombine_s8(vld1_s8(row_at[2 * p] + i), vld1_s8(row_at[2 * p + 1] + i));
                for (int c = 0; c < 8; ++c) sums[p][c] = vmmlaq_s32(sums[p][c], inputs, channels[c]);
            }
        }
        for (int p = 0; p < PAIRS; ++p) {
            int32x4_t by_row[2][4];  // each row's sums of channels 4j..4j + 3
            for (int j = 0; j < 4; ++j) {
                // [r0 c0, r0 c1, r1 c0, r1 c1] and [r0 c2, r0 c3, r1 c2, r1 c3]
                const int64x2_t a = vreinterpretq_s64_s32(sums[p][2 * j]);
                const int64x2_t b = vreinterpretq_s64_s32(sums[p][2 * j + 1]);
                by_row[0][j] = vreinterpretq_s32_s64(vzip1q_s64(a, b));
                by_row[1][j] = vreinterpretq_s32_s64(vzip2q_s64(a, b));
            }
            add_group(totals[2 * p], by_row[0], scales + index * 16);
            add_group(totals[2 * p + 1], by_row[1], scales + index * 16);
        }
    }
    for (int r = 0; r < rows; ++r)
        store_int4_row(totals[r], row_max[r],
                       residual == nullptr ? nullptr : residual + r * residual_stride,
                       out + r * out_stride, valid);
}

#undef CHATTS_INT4_BLOCK_PARAMETERS

}  // namespace

// out[rows, n] = the rows of x times the int4 weights, plus `residual`: int4_linear's contract
// on x86 (int4_linear.cpp), on the Arm product `a.product`.
static int32_t int4_linear(const ChattsInt4LinearArgs& a) {
    const int64_t rows = a.rows, n = a.n, k = a.k, group = a.group;
    if (group < 8 || group > kInt4MaxGroup || group % 8 != 0 || k % group != 0)
        return CHATTS_BAD_GROUP;
    if (a.product == CHATTS_PRODUCT_AVX2 || a.product == CHATTS_PRODUCT_VNNI)
        return CHATTS_CPU_LACKS_PRODUCT;
    if (a.product < CHATTS_PRODUCT_NEON || a.product > CHATTS_PRODUCT_I8MM)
        return CHATTS_UNKNOWN_PRODUCT;
    if (arm_product(a.product) == nullptr) return CHATTS_CPU_LACKS_PRODUCT;
    // 63 levels, as the x86 products take them: the same integers, the same bits
    if (a.levels < 1 || a.levels > 63) return CHATTS_TOO_MANY_LEVELS;
    if (!valid_tuning(a.tuning)) return CHATTS_BAD_TUNING;
    const QuantizedRows prepared(rows, k, a.x, a.x_row_stride, a.gain, a.eps, a.swiglu, a.levels,
                                 0, a.threads);
    const int8_t* xs = reinterpret_cast<const int8_t*>(prepared.quantized.get());
    const int64_t blocks = (n + 15) / 16, block_bytes = 8 * k, groups = k / group;
    const int64_t per_pass = a.product == CHATTS_PRODUCT_NEON ? 2 : 4;
#pragma omp parallel for num_threads(a.threads) schedule(guided)
    for (int64_t block = 0; block < blocks; ++block) {
        const int valid = static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
        for (int64_t first = 0; first < rows; first += per_pass) {
            const int count = static_cast<int>(rows - first < per_pass ? rows - first : per_pass);
#define CHATTS_INT4_BLOCK_ARGUMENTS                                                            \
    k, group, xs + first * k, k, a.packed + block * block_bytes, a.scales + block * groups * 16, \
        prepared.row_max.get() + first,                                                        \
        a.residual == nullptr ? nullptr : a.residual + first * a.residual_stride + block * 16, \
        a.residual_stride, a.out + first * a.out_stride + block * 16, a.out_stride, valid
            if (a.product == CHATTS_PRODUCT_NEON)
                (count == 2 ? int4_block_neon<2> : int4_block_neon<1>)(CHATTS_INT4_BLOCK_ARGUMENTS);
            else if (a.product == CHATTS_PRODUCT_DOTPROD || count == 1)
                (count == 1   ? int4_block_dotprod<1>
                 : count == 2 ? int4_block_dotprod<2>
                 : count == 3 ? int4_block_dotprod<3>
                              : int4_block_dotprod<4>)(CHATTS_INT4_BLOCK_ARGUMENTS);
            else if (count == 2)
                int4_block_i8mm<1>(CHATTS_INT4_BLOCK_ARGUMENTS, 2);
            else
                int4_block_i8mm<2>(CHATTS_INT4_BLOCK_ARGUMENTS, count);
#undef CHATTS_INT4_BLOCK_ARGUMENTS
        }
    }
    return CHATTS_OK;
}

#undef CHATTS_EXACT_FLOAT
