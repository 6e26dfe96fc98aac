// The int8 product on aarch64: NEON (every Armv8 CPU), DotProd (sdot: Armv8.2 on, Graviton 2
// and later, Ampere Altra, Apple M1 and later) and I8MM (smmla: Armv8.6 on, Graviton 3 and 4,
// Apple M2 and later), the best the CPU has chosen at run time from its hardware capabilities
// (getauxval; arm_product). Included by int8_linear.cpp on aarch64 only.
//
// The weights are packed as for the x86 products (packed[block][k / 4][channel][k % 4], blocks
// of 16 channels), so one 16-byte register holds 4 inputs of 4 channels. The activations are
// quantized as for VNNI (127 levels a side) but kept signed, round(levels * x) with no zero
// point: Arm's instructions multiply s8 by s8, so there is no offset to take off again, and the
// integer sums are exactly the VNNI product's sums minus its offsets. The epilogue is
// store_row's: the sum as a float, times the channel's scale, times the row's largest
// magnitude, then the residual added; so every variant, at any row count or thread split,
// gives a row the VNNI product's bits for it.
//
// - NEON: smull multiplies 8 pairs into int16 (at most 127 * 127, no overflow), sadalp adds
//   them in pairs into int32; a final addp adds each channel's two halves. 2 rows a pass.
// - DotProd: sdot adds 4 products into each channel's int32 lane, one instruction per 16 bytes
//   of weights a row (vpdpbusd's work on a quarter of the lanes). 4 rows a pass.
// - I8MM: smmla multiplies a 2x8 block of two rows' inputs by a 8x2 block of two channels'
//   weights into a 2x2 block of sums. The packing has 4 inputs a channel together, so two
//   groups of 4 are zipped into 8 (zip1/zip2 on 32-bit lanes) first: per 128 bytes of weights,
//   8 zips shared by every row pair, and 8 smmla a row pair where DotProd needs 16 sdot. 4 rows
//   (two pairs) a pass; a last odd row takes the DotProd loop.
//
// Integer sums are exact, so their order is free. The float epilogue's order is not: GCC's NEON
// intrinsics are plain vector arithmetic to it, which -fassociative-math may regroup (the two
// products, the channel's scale times the row's magnitude first: a last bit off in a third of
// the outputs, seen under qemu) and -ffp-contract may fuse into a multiply-add. So every
// function that holds the epilogue is built without either (CHATTS_EXACT_FLOAT), as store_row's
// callers are.

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif

// a product over all rows: rows, n, k, the s8 rows, packed weights, each channel's scale over
// the levels, each row's largest magnitude, residual (or NULL), its stride, out, its stride,
// threads
using ArmGemm = void (*)(int64_t, int64_t, int64_t, const int8_t*, const int8_t*, const float*,
                         const float*, const float*, int64_t, float*, int64_t, int);

#define CHATTS_EXACT_FLOAT \
    optimize("no-associative-math", "signed-zeros", "trapping-math", "fp-contract=off")

// One row's results of 4 channels (from channel `channel` of the block) plus the residual, as
// torch adds it; only the block's first `valid` channels are stored. The int4 product's too.
__attribute__((CHATTS_EXACT_FLOAT, always_inline)) inline void store_lanes(
    float32x4_t result, const float* residual, float* out, int channel, int valid) {
    if (channel + 4 <= valid) {
        if (residual != nullptr) result = vaddq_f32(vld1q_f32(residual + channel), result);
        vst1q_f32(out + channel, result);
        return;
    }
    float lanes[4];
    vst1q_f32(lanes, result);
    for (int c = channel; c < valid; ++c)
        out[c] = residual != nullptr ? residual[c] + lanes[c - channel] : lanes[c - channel];
}

// One row's sums of 4 channels (from channel `channel` of the block) through the epilogue.
__attribute__((CHATTS_EXACT_FLOAT, always_inline)) inline void store_four(int32x4_t sums, const float* weight_scale, float row_max,
                       const float* residual, float* out, int channel, int valid) {
    if (channel >= valid) return;
    store_lanes(vmulq_f32(vmulq_f32(vcvtq_f32_s32(sums), vld1q_f32(weight_scale + channel)),
                          vdupq_n_f32(row_max)),
                residual, out, channel, valid);
}

// ROWS (1 or 2) rows of one block of 16 channels with smull and sadalp.
template <int ROWS>
__attribute__((CHATTS_EXACT_FLOAT))
void block_neon(int64_t k_groups, const int8_t* x, int64_t x_stride, const int8_t* w,
                const float* weight_scale, const float* row_max, const float* residual,
                int64_t residual_stride, float* out, int64_t out_stride, int valid) {
    int32x4_t low[ROWS][4], high[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) low[r][j] = high[r][j] = vdupq_n_s32(0);
    for (int64_t group = 0; group < k_groups; ++group, w += 64) {
        const int8x16_t weights[4] = {vld1q_s8(w), vld1q_s8(w + 16), vld1q_s8(w + 32),
                                      vld1q_s8(w + 48)};
        for (int r = 0; r < ROWS; ++r) {
            int32_t four;
            std::memcpy(&four, x + r * x_stride + 4 * group, sizeof four);
            const int8x16_t inputs = vreinterpretq_s8_s32(vdupq_n_s32(four));
            for (int j = 0; j < 4; ++j) {
                low[r][j] = vpadalq_s16(low[r][j],
                                        vmull_s8(vget_low_s8(weights[j]), vget_low_s8(inputs)));
                high[r][j] = vpadalq_s16(high[r][j], vmull_high_s8(weights[j], inputs));
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j)
            store_four(vpaddq_s32(low[r][j], high[r][j]), weight_scale, row_max[r],
                       residual == nullptr ? nullptr : residual + r * residual_stride,
                       out + r * out_stride, 4 * j, valid);
}

// ROWS (1..4) rows of one block with sdot: 4 groups of inputs a 16-byte load, one lane each.
template <int ROWS>
__attribute__((target("arch=armv8.2-a+dotprod"), CHATTS_EXACT_FLOAT))
void block_dotprod(int64_t k_groups, const int8_t* x, int64_t x_stride, const int8_t* w,
                   const float* weight_scale, const float* row_max, const float* residual,
                   int64_t residual_stride, float* out, int64_t out_stride, int valid) {
    int32x4_t sums[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) sums[r][j] = vdupq_n_s32(0);
    int64_t group = 0;
#define CHATTS_LANE(L)                                                                     \
    {                                                                                      \
        const int8_t* at = w + 64 * (group + L);                                          \
        const int8x16_t w0 = vld1q_s8(at), w1 = vld1q_s8(at + 16), w2 = vld1q_s8(at + 32), \
                        w3 = vld1q_s8(at + 48);                                            \
        for (int r = 0; r < ROWS; ++r) {                                                   \
            sums[r][0] = vdotq_laneq_s32(sums[r][0], w0, inputs[r], L);                    \
            sums[r][1] = vdotq_laneq_s32(sums[r][1], w1, inputs[r], L);                    \
            sums[r][2] = vdotq_laneq_s32(sums[r][2], w2, inputs[r], L);                    \
            sums[r][3] = vdotq_laneq_s32(sums[r][3], w3, inputs[r], L);                    \
        }                                                                                  \
    }
    for (; group + 4 <= k_groups; group += 4) {
        int8x16_t inputs[ROWS];
        for (int r = 0; r < ROWS; ++r) inputs[r] = vld1q_s8(x + r * x_stride + 4 * group);
        CHATTS_LANE(0) CHATTS_LANE(1) CHATTS_LANE(2) CHATTS_LANE(3)
    }
    for (; group < k_groups; ++group) {
        int8x16_t inputs[ROWS];
        for (int r = 0; r < ROWS; ++r) {
            int32_t four;
            std::memcpy(&four, x + r * x_stride + 4 * group, sizeof four);
            inputs[r] = vreinterpretq_s8_s32(vdupq_n_s32(four));
        }
        CHATTS_LANE(0)
    }
#undef CHATTS_LANE
    for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j)
            store_four(sums[r][j], weight_scale, row_max[r],
                       residual == nullptr ? nullptr : residual + r * residual_stride,
                       out + r * out_stride, 4 * j, valid);
}

// Eight inputs of a row from group `group` on; of a last odd group, its 4 and 4 zeros.
inline int8x8_t eight_inputs(const int8_t* row, int64_t group, int64_t k_groups) {
    if (group + 1 < k_groups) return vld1_s8(row + 4 * group);
    uint32_t four;
    std::memcpy(&four, row + 4 * group, sizeof four);
    return vcreate_s8(static_cast<uint64_t>(four));
}

// PAIRS (1 or 2) pairs of rows of one block with smmla (a pair's second row may repeat its
// first: `rows` says how many are real).
template <int PAIRS>
__attribute__((target("arch=armv8.2-a+i8mm"), CHATTS_EXACT_FLOAT))
void block_i8mm(int64_t k_groups, const int8_t* x, int64_t x_stride, const int8_t* w,
                const float* weight_scale, const float* row_max, const float* residual,
                int64_t residual_stride, float* out, int64_t out_stride, int valid, int rows) {
    // sums[p][c]: rows 2p and 2p + 1 by channels 2c and 2c + 1 (c = 0..7)
    int32x4_t sums[PAIRS][8];
    for (int p = 0; p < PAIRS; ++p)
        for (int c = 0; c < 8; ++c) sums[p][c] = vdupq_n_s32(0);
    const int8_t* row_at[2 * PAIRS];
    for (int r = 0; r < 2 * PAIRS; ++r) row_at[r] = x + (r < rows ? r : rows - 1) * x_stride;
    const int8x16_t zero = vdupq_n_s8(0);
    for (int64_t group = 0; group < k_groups; group += 2, w += 128) {
        const bool pair = group + 1 < k_groups;
        int8x16_t channels[8];  // channels 2c and 2c + 1, 8 inputs each
        for (int j = 0; j < 4; ++j) {
            const int32x4_t first = vreinterpretq_s32_s8(vld1q_s8(w + 16 * j));
            const int32x4_t second =
                pair ? vreinterpretq_s32_s8(vld1q_s8(w + 64 + 16 * j)) : vreinterpretq_s32_s8(zero);
            channels[2 * j] = vreinterpretq_s8_s32(vzip1q_s32(first, second));
            channels[2 * j + 1] = vreinterpretq_s8_s32(vzip2q_s32(first, second));
        }
        for (int p = 0; p < PAIRS; ++p) {
            const int8x16_t inputs = vcombine_s8(eight_inputs(row_at[2 * p], group, k_groups),
                                                 eight_inputs(row_at[2 * p + 1], group, k_groups));
            for (int c = 0; c < 8; ++c) sums[p][c] = vmmlaq_s32(sums[p][c], inputs, channels[c]);
        }
    }
    for (int p = 0; p < PAIRS; ++p)
        for (int j = 0; j < 4; ++j) {
            // [r0 c0, r0 c1, r1 c0, r1 c1] and [r0 c2, r0 c3, r1 c2, r1 c3]: each row's four
            const int64x2_t a = vreinterpretq_s64_s32(sums[p][2 * j]);
            const int64x2_t b = vreinterpretq_s64_s32(sums[p][2 * j + 1]);
            for (int half = 0; half < 2 && 2 * p + half < rows; ++half) {
                const int r = 2 * p + half;
                const int32x4_t row_sums = vreinterpretq_s32_s64(half == 0 ? vzip1q_s64(a, b)
                                                                           : vzip2q_s64(a, b));
                store_four(row_sums, weight_scale, row_max[r],
                           residual == nullptr ? nullptr : residual + r * residual_stride,
                           out + r * out_stride, 4 * j, valid);
            }
        }
}

// The product over every block and row: blocks split between threads (guided, as gemm), each
// block's rows in passes of `per_pass`, run by pass(count, first, block).
template <typename Pass>
void arm_gemm(int64_t rows, int64_t n, int64_t k, int64_t per_pass, int threads, Pass pass) {
    const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t block = 0; block < blocks; ++block) {
        const int valid = static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
        for (int64_t first = 0; first < rows; first += per_pass)
            pass(rows - first < per_pass ? rows - first : per_pass, first, block, valid);
    }
    (void)k;
}

// The arguments every block function takes, for rows from `first` of block `block`.
#define CHATTS_BLOCK_ARGUMENTS                                                               \
    k / 4, xq + first * k, k, packed + block * 16 * k, weight_scale + block * 16,            \
        row_max + first,                                                                     \
        residual == nullptr ? nullptr : residual + first * residual_stride + block * 16,     \
        residual_stride, out + first * out_stride + block * 16, out_stride, valid

void gemm_neon(int64_t rows, int64_t n, int64_t k, const int8_t* xq, const int8_t* packed,
               const float* weight_scale, const float* row_max, const float* residual,
               int64_t residual_stride, float* out, int64_t out_stride, int threads) {
    arm_gemm(rows, n, k, 2, threads, [&](int64_t count, int64_t first, int64_t block, int valid) {
        (count == 2 ? block_neon<2> : block_neon<1>)(CHATTS_BLOCK_ARGUMENTS);
    });
}

constexpr void (*kDotprodBlocks[5])(int64_t, const int8_t*, int64_t, const int8_t*, const float*,
                                     const float*, const float*, int64_t, float*, int64_t,
                                     int) = {nullptr, block_dotprod<1>, block_dotprod<2>,
                                             block_dotprod<3>, block_dotprod<4>};

void gemm_dotprod(int64_t rows, int64_t n, int64_t k, const int8_t* xq, const int8_t* packed,
                  const float* weight_scale, const float* row_max, const float* residual,
                  int64_t residual_stride, float* out, int64_t out_stride, int threads) {
    arm_gemm(rows, n, k, 4, threads, [&](int64_t count, int64_t first, int64_t block, int valid) {
        kDotprodBlocks[count](CHATTS_BLOCK_ARGUMENTS);
    });
}

void gemm_i8mm(int64_t rows, int64_t n, int64_t k, const int8_t* xq, const int8_t* packed,
               const float* weight_scale, const float* row_max, const float* residual,
               int64_t residual_stride, float* out, int64_t out_stride, int threads) {
    arm_gemm(rows, n, k, 4, threads, [&](int64_t count, int64_t first, int64_t block, int valid) {
        if (count == 1)
            block_dotprod<1>(CHATTS_BLOCK_ARGUMENTS);
        else if (count == 2)
            block_i8mm<1>(CHATTS_BLOCK_ARGUMENTS, 2);
        else
            block_i8mm<2>(CHATTS_BLOCK_ARGUMENTS, static_cast<int>(count));
    });
}

#undef CHATTS_BLOCK_ARGUMENTS
#undef CHATTS_EXACT_FLOAT

// The product for `instructions`, or nullptr where this CPU lacks them (or they are not Arm's).
ArmGemm arm_product(int32_t instructions) {
    const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
    const bool dotprod = (hwcap & HWCAP_ASIMDDP) != 0;
    if (instructions == CHATTS_PRODUCT_NEON) return gemm_neon;
    if (instructions == CHATTS_PRODUCT_DOTPROD) return dotprod ? gemm_dotprod : nullptr;
    if (instructions == CHATTS_PRODUCT_I8MM)
        return dotprod && (hwcap2 & HWCAP2_I8MM) != 0 ? gemm_i8mm : nullptr;
    return nullptr;
}
