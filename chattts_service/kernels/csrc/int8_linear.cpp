// chatts_int8_linear: int8 linear layers, the norm and the activations' quantization included;
// the product with AVX512-VNNI (x86 CPUs that have it: Ice Lake and later, Zen 4) or AVX2; on
// aarch64 with NEON, DotProd or I8MM (int8_linear_arm.cpp, which says how it differs).
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
#include "prepared_row.h"

namespace {

// Quantize one row as described above, to round(levels * x) + zero_point (levels + 1 for the
// x86 products' u8; 0 for aarch64's, whose bytes are s8); returns its largest magnitude.
float quantize_row(const float* x, int64_t width, const float* gain, float eps, int levels,
                   int32_t zero_point, uint8_t* quantized) {
    const PreparedRow prepared(x, width, gain, eps);
    // as fbgemm quantizes the same rows (divided by their maximum, then times the inverse of
    // the scale 1/levels, rounded to even), so both kernels see the same integers
    const float inverse_scale = 1.0f / static_cast<float>(1.0 / levels);
    for (int64_t i = 0; i < width; ++i) {
        const float level =
            __builtin_nearbyintf((prepared.value(i) / prepared.largest) * inverse_scale);
        quantized[i] = static_cast<uint8_t>(static_cast<int32_t>(level) + zero_point);
    }
    return prepared.largest;
}

// Prefetching the weights: `prefetch_bytes` ahead of use (0: none, the hardware prefetcher
// alone), with hint HINT (0: non-temporal, 1: T0). The best of these differs between CPUs
// (ChattsTuning; kernels/tuning.py measures them). The hint has to be a constant.
// The HINT of a product that prefetches nothing: no prefetch code in its loop at all (where
// the distance is 0 at run time, the loop still worked out every address it would not fetch:
// a third more instructions a group of inputs at 8 rows). A prompt's rows past the first 8
// find the weights in cache and fetch nothing, and run faster without that code.
constexpr int kNoPrefetch = 2;
// Past 8 rows, gemm_blocks' passes also fetch their share of the next run of weights
// (share_of_next_run): the first with T0 ahead of its own reads as well (kT0AndNextRun), the
// later ones nothing else (kNextRunOnly). Two builds of their own, so the loops of 8 rows or
// fewer carry no code for it.
constexpr int kNextRunOnly = 3;
constexpr int kT0AndNextRun = 4;

// One of a product's three builds by its HINT: non-temporal, T0, or none (kNoPrefetch).
template <typename Build>
inline Build by_hint(int hint, Build nta, Build t0, Build none) {
    return hint == kNoPrefetch ? none : hint == 1 ? t0 : nta;
}

#if CHATTS_X86
template <int HINT>
inline void prefetch_weights(uintptr_t address) {
    _mm_prefetch(reinterpret_cast<const char*>(address), HINT == 0 ? _MM_HINT_NTA : _MM_HINT_T0);
}
#endif

// What a product reading BLOCKS neighbouring blocks side by side (a run, starting at `blocks`;
// one stream a block) prefetches at `at` in the first block: `prefetch_bytes` further on, the
// same offset in the other blocks. Near a block's end that would fall in the next block of the
// run, which its own stream has already read: there it goes on into the next run instead,
// where the thread (or the other one) reads next, which made steps faster at 1 to 8 rows
// (measured side by side: see the commit that made it).
template <int BLOCKS>
inline uintptr_t ahead_in_run(const int8_t* at, const int8_t* blocks, int64_t block_bytes,
                              int64_t prefetch_bytes) {
    uintptr_t ahead = reinterpret_cast<uintptr_t>(at) + prefetch_bytes;
    if (BLOCKS > 1 && at - blocks + prefetch_bytes >= block_bytes)
        ahead += (BLOCKS - 1) * block_bytes;
    return ahead;
}

// Where pass `pass` of `passes` over a block of weights (at `block_start`, `block_bytes` long,
// read 64 bytes per step in `steps` steps) prefetches: its first step prefetches `from`, each
// next one `step` bytes further (a step of 0: none). One pass prefetches `prefetch_bytes` ahead
// of its own reads. With more, the first streams the block from memory and the next find it in
// cache, so prefetching ahead would leave memory idle during those: each pass prefetches its
// share of the next block instead (the p-th P-th of it, a few bytes a step:
// share_of_next_run), and the stream runs through every pass: faster at 8 rows (two AVX2
// passes), a little at 41 (measured side by side: see the commit that made it). (The VNNI
// product past 8 rows does the same, its shares by rows: gemm.)
struct PassPrefetch {
    uintptr_t from;
    int64_t step;
};

// A pass's share of the next run of weights (`run_bytes` from `next_run`), in proportion to
// its rows (rows [first, first + count) of `rows`), spread over its `steps` steps.
inline PassPrefetch share_of_next_run(uintptr_t next_run, int64_t run_bytes, int64_t steps,
                                      int64_t first, int64_t count, int64_t rows) {
    return {next_run + static_cast<uintptr_t>(run_bytes * first / rows),
            (run_bytes * count + steps * rows - 1) / (steps * rows)};
}

inline PassPrefetch pass_prefetch(uintptr_t block_start, int64_t block_bytes, int64_t steps,
                                  int64_t prefetch_bytes, int64_t pass, int64_t passes) {
    if (prefetch_bytes <= 0) return {block_start, 0};
    if (passes == 1) return {block_start + static_cast<uintptr_t>(prefetch_bytes), 64};
    return share_of_next_run(block_start + static_cast<uintptr_t>(block_bytes), block_bytes,
                             steps, pass, 1, passes);
}

#if CHATTS_X86
// The VNNI products' epilogue for one row's int32 sums of a block of 16 channels: the u8 offset
// removed, times the channel's scale, times the row's largest magnitude, the residual added
// after the product is rounded (as torch adds it); the first `valid` channels stored. One
// function for gemm_blocks, gemm_row and gemm_tiles, so all three round alike.
__attribute__((target("avx512f,avx512bw"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
inline void store_row(__m512i sums, const int32_t* offsets, const float* weight_scale,
                      float row_max, const float* residual, float* out, int valid) {
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const __m512 scaled =
        _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_loadu_si512(offsets)));
    __m512 result = _mm512_mul_ps(_mm512_mul_ps(scaled, _mm512_loadu_ps(weight_scale)),
                                  _mm512_set1_ps(row_max));
    if (residual != nullptr)
        result = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual), result);
    _mm512_mask_storeu_ps(out, mask, result);
}

// BLOCKS (1, 2, 4 or 8) neighbouring blocks of 16 channels for ROWS rows (1..8; 1..4 with four
// blocks, 1..2 with eight): each broadcast input serves every block, BLOCKS * ROWS accumulators
// (at most 16) keep the multiply unit busy, and each thread streams BLOCKS runs of weights at
// once: where memory reads slowly, more runs in flight read faster (how many pay is measured
// per CPU: kernels/tuning.py). The accumulators are named variables, not an array (GCC 12
// kept an array of them on the stack, much slower at 8 rows), each added to in its own register
// (dpbusd); the ones a ROWS and BLOCKS leave unused are never touched.
// `valid`: how many of the last block's 16 channels are real (the rest are padding and are not
// stored).
// optimize: without -fassociative-math the epilogue multiplies in the written order for every
// ROWS (with it, GCC regrouped the two products for some row counts, and a row's result
// changed in its last bit with its batch); without fp-contract the residual is added to the
// rounded product, as torch adds it, not fused into a multiply-add.
template <int ROWS, int BLOCKS, int HINT>
__attribute__((target("avx512f,avx512bw,avx512vnni"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void gemm_blocks(int64_t k_groups, const uint8_t* xq, int64_t x_stride, const int8_t* blocks,
                 int64_t block_bytes, const int32_t* offsets, const float* weight_scale,
                 const float* row_max, const float* residual, int64_t residual_stride,
                 float* out, int64_t out_stride, int valid, uintptr_t weights_end,
                 int64_t prefetch_bytes, PassPrefetch next) {
    static_assert(BLOCKS == 1 || BLOCKS == 2 || BLOCKS == 4 || BLOCKS == 8, "1, 2, 4 or 8 blocks");
    static_assert(ROWS >= 1 && ROWS * BLOCKS <= 16, "at most 16 accumulators");
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0,
            c0 = a0, c1 = a0, c2 = a0, c3 = a0, c4 = a0, c5 = a0, c6 = a0, c7 = a0, d0 = a0,
            d1 = a0, d2 = a0, d3 = a0, d4 = a0, d5 = a0, d6 = a0, d7 = a0, e0 = a0, e1 = a0,
            e2 = a0, e3 = a0, e4 = a0, e5 = a0, e6 = a0, e7 = a0, f0 = a0, f1 = a0, f2 = a0,
            f3 = a0, f4 = a0, f5 = a0, f6 = a0, f7 = a0, g0 = a0, g1 = a0, g2 = a0, g3 = a0,
            g4 = a0, g5 = a0, g6 = a0, g7 = a0, h0 = a0, h1 = a0, h2 = a0, h3 = a0, h4 = a0,
            h5 = a0, h6 = a0, h7 = a0;
    const uint8_t* x = xq;
    const int8_t* w = blocks;
    uintptr_t next_at = next.from;
    for (int64_t group = 0; group < k_groups; ++group, x += 4, w += 64) {
        // the weights are read once per call: fetch them ahead of use; at a block's end into
        // the next run's (ahead_in_run), read next, but never past the weights
        const uintptr_t ahead = ahead_in_run<BLOCKS>(w, blocks, block_bytes, prefetch_bytes);
        // a pass of many rows: its share of the next run, into L2 (see gemm)
        if constexpr (HINT == kNextRunOnly || HINT == kT0AndNextRun) {
            if (next_at < weights_end)
                _mm_prefetch(reinterpret_cast<const char*>(next_at), _MM_HINT_T1);
            next_at += next.step;
        }
        if (HINT != kNoPrefetch && HINT != kNextRunOnly && prefetch_bytes > 0 &&
            ahead + (BLOCKS - 1) * block_bytes < weights_end) {
            prefetch_weights<HINT>(ahead);
            if constexpr (BLOCKS >= 2) prefetch_weights<HINT>(ahead + block_bytes);
            if constexpr (BLOCKS >= 4) {
                prefetch_weights<HINT>(ahead + 2 * block_bytes);
                prefetch_weights<HINT>(ahead + 3 * block_bytes);
            }
            if constexpr (BLOCKS == 8) {
                for (int b = 4; b < 8; ++b) prefetch_weights<HINT>(ahead + b * block_bytes);
            }
        }
        const __m512i w0 = _mm512_loadu_si512(w);
        __m512i w1 = w0, w2 = w0, w3 = w0, w4 = w0, w5 = w0, w6 = w0, w7 = w0;
        if constexpr (BLOCKS >= 2) w1 = _mm512_loadu_si512(w + block_bytes);
        if constexpr (BLOCKS >= 4) {
            w2 = _mm512_loadu_si512(w + 2 * block_bytes);
            w3 = _mm512_loadu_si512(w + 3 * block_bytes);
        }
        if constexpr (BLOCKS == 8) {
            w4 = _mm512_loadu_si512(w + 4 * block_bytes);
            w5 = _mm512_loadu_si512(w + 5 * block_bytes);
            w6 = _mm512_loadu_si512(w + 6 * block_bytes);
            w7 = _mm512_loadu_si512(w + 7 * block_bytes);
        }
#define CHATTS_ROW(R)                                                                     \
        if constexpr (ROWS > R) {                                                         \
            int32_t four;                                                                 \
            std::memcpy(&four, x + R * x_stride, sizeof four);                            \
            const __m512i inputs = _mm512_set1_epi32(four);                               \
            dpbusd(a##R, inputs, w0);                                                     \
            if constexpr (BLOCKS >= 2) dpbusd(b##R, inputs, w1);                          \
            if constexpr (BLOCKS >= 4) {                                                  \
                dpbusd(c##R, inputs, w2);                                                 \
                dpbusd(d##R, inputs, w3);                                                 \
            }                                                                             \
            if constexpr (BLOCKS == 8) {                                                  \
                dpbusd(e##R, inputs, w4);                                                 \
                dpbusd(f##R, inputs, w5);                                                 \
                dpbusd(g##R, inputs, w6);                                                 \
                dpbusd(h##R, inputs, w7);                                                 \
            }                                                                             \
        }
        CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
        CHATTS_ROW(4) CHATTS_ROW(5) CHATTS_ROW(6) CHATTS_ROW(7)
#undef CHATTS_ROW
    }
    const __m512i accumulators[8][8] = {{a0, a1, a2, a3, a4, a5, a6, a7},
                                        {b0, b1, b2, b3, b4, b5, b6, b7},
                                        {c0, c1, c2, c3, c4, c5, c6, c7},
                                        {d0, d1, d2, d3, d4, d5, d6, d7},
                                        {e0, e1, e2, e3, e4, e5, e6, e7},
                                        {f0, f1, f2, f3, f4, f5, f6, f7},
                                        {g0, g1, g2, g3, g4, g5, g6, g7},
                                        {h0, h1, h2, h3, h4, h5, h6, h7}};
    for (int b = 0; b < BLOCKS; ++b) {
        // offsets: zero point * (sum of the channel's weights), the activations' u8 offset
        const int channels = b + 1 < BLOCKS ? 16 : valid;
        for (int r = 0; r < ROWS; ++r)
            store_row(accumulators[b][r], offsets + b * 16, weight_scale + b * 16, row_max[r],
                      residual == nullptr ? nullptr : residual + r * residual_stride + b * 16,
                      out + r * out_stride + b * 16, channels);
    }
}

// One row, one block of 16 channels: gemm_blocks<1, 1, HINT>'s sums in four chains, each
// taking every fourth group of inputs, added at the end (integers: the same sums). One chain
// waits a vpdpbusd's latency for every 64 bytes of weights; four keep the loads streaming.
// At one row that made a pass over the int8 layers as fast as a loop that only reads them
// (measured side by side: see the commit that made it).
template <int HINT>
__attribute__((target("avx512f,avx512bw,avx512vnni"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void gemm_row(int64_t k_groups, const uint8_t* x, const int8_t* w, const int32_t* offsets,
              const float* weight_scale, float row_max, const float* residual, float* out,
              int valid, uintptr_t weights_end, int64_t prefetch_bytes) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t group = 0;
    const auto prefetch = [&](const int8_t* at) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(at) + prefetch_bytes;
        if (HINT != kNoPrefetch && prefetch_bytes > 0 && ahead < weights_end)
            prefetch_weights<HINT>(ahead);
    };
    for (; group + 4 <= k_groups; group += 4, x += 16, w += 256) {
        int32_t four[4];
        std::memcpy(four, x, sizeof four);
        prefetch(w);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(four[0]), _mm512_loadu_si512(w));
        prefetch(w + 64);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_set1_epi32(four[1]), _mm512_loadu_si512(w + 64));
        prefetch(w + 128);
        a2 = _mm512_dpbusd_epi32(a2, _mm512_set1_epi32(four[2]), _mm512_loadu_si512(w + 128));
        prefetch(w + 192);
        a3 = _mm512_dpbusd_epi32(a3, _mm512_set1_epi32(four[3]), _mm512_loadu_si512(w + 192));
    }
    for (; group < k_groups; ++group, x += 4, w += 64) {
        int32_t four;
        std::memcpy(&four, x, sizeof four);
        prefetch(w);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_set1_epi32(four), _mm512_loadu_si512(w));
    }
    const __m512i sums = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    store_row(sums, offsets, weight_scale, row_max, residual, out, valid);
}

using BlockFunction = void (*)(int64_t, const uint8_t*, int64_t, const int8_t*, int64_t,
                               const int32_t*, const float*, const float*, const float*,
                               int64_t, float*, int64_t, int, uintptr_t, int64_t,
                               PassPrefetch);
template <int BLOCKS, int HINT>
constexpr BlockFunction kBlockFunctions[9] = {
    nullptr,
    gemm_blocks<1, BLOCKS, HINT>,
    gemm_blocks<2, BLOCKS, HINT>,
    gemm_blocks<3, BLOCKS, HINT>,
    gemm_blocks<4, BLOCKS, HINT>,
    gemm_blocks<5, BLOCKS, HINT>,
    gemm_blocks<6, BLOCKS, HINT>,
    gemm_blocks<7, BLOCKS, HINT>,
    gemm_blocks<8, BLOCKS, HINT>};
// gemm_blocks' builds for BLOCKS blocks by their HINT
template <int BLOCKS>
const BlockFunction* block_builds(int hint) {
    switch (hint) {
        case 0: return kBlockFunctions<BLOCKS, 0>;
        case 1: return kBlockFunctions<BLOCKS, 1>;
        case kNextRunOnly: return kBlockFunctions<BLOCKS, kNextRunOnly>;
        case kT0AndNextRun: return kBlockFunctions<BLOCKS, kT0AndNextRun>;
        default: return kBlockFunctions<BLOCKS, kNoPrefetch>;
    }
}
template <int HINT>
constexpr BlockFunction kQuadFunctions[5] = {nullptr, gemm_blocks<1, 4, HINT>,
                                             gemm_blocks<2, 4, HINT>, gemm_blocks<3, 4, HINT>,
                                             gemm_blocks<4, 4, HINT>};
template <int HINT>
constexpr BlockFunction kOctFunctions[3] = {nullptr, gemm_blocks<1, 8, HINT>,
                                            gemm_blocks<2, 8, HINT>};

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void gemm(int64_t rows, int64_t n, int64_t k, const uint8_t* xq, const int8_t* packed,
          const int32_t* offsets, const float* weight_scale, const float* row_max,
          const float* residual, int64_t residual_stride, float* out, int64_t out_stride,
          int threads, const ChattsTuning& tuning) {
    // one block at a time, or two, each broadcast input serving both: from how many rows
    // pairs pay depends on the CPU (tuning.pair_blocks_from; past 8 rows, always): on some
    // they were slower than single blocks at every row count, on others faster from 2 rows.
    // One row walks a block in four chains (gemm_row), or a pair (from 1 row, where memory
    // reads slowly).
    // Up to tuning.octs_up_to rows (at most 2), eight blocks at a time; else up to
    // tuning.quads_up_to rows (at most 4), four (gemm_blocks with BLOCKS 8 or 4); the last few
    // four at a time where four are left, then alone. The same bits every way.
    const int64_t blocks = (n + 15) / 16, block_bytes = 16 * k;
    const int64_t span = rows <= tuning.octs_up_to     ? 8
                         : rows <= tuning.quads_up_to ? 4
                         : rows >= tuning.pair_blocks_from ? 2
                                                           : 1;  // valid_tuning: at most 9
    const int64_t tasks = (blocks + span - 1) / span;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(packed) + blocks * block_bytes;
    const int64_t prefetch_bytes = prefetch_bytes_for(tuning, rows);
    // More than 8 rows pass over each block again and must find it in cache: a non-temporal
    // prefetch leaves lines in L1 alone, and a block of 1,536 inputs (24 KB, 48 KB a pair)
    // does not stay there, so every pass read it from memory again (the tuning measures 1 and
    // 8 rows, one pass). So the first pass fetches into every level (T0), and every pass
    // fetches its share of the next block or
    // pair into L2 (share_of_next_run, by its rows): the passes after the first read from
    // cache, and memory sat idle through them while the next block's first pass waited for
    // it (measured side by side: see the commit that made it).
    // The HINT every product of this call runs with (by_hint picks its build): none where
    // nothing is fetched, else the tuning's, T0 past 8 rows (where single blocks and pairs
    // run the share-fetching builds, block_builds).
    const int hint = prefetch_bytes == 0                     ? kNoPrefetch
                     : tuning.prefetch_hint == 1 || rows > 8 ? 1
                                                             : 0;
    // guided: each thread starts on a long run of blocks, streamed in order, and the last
    // blocks go to whichever thread is free first. On a shared virtual machine one vCPU is
    // often slower for a moment, and with halves fixed in advance the other waited for it:
    // the guided split was never slower than the static one, and mostly faster. Which thread
    // computes a block changes nothing in it.
    // how many of a block's 16 channels are real (the last block's may be fewer)
    const auto valid_in = [n](int64_t block) {
        return static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
    };
    // block `block` and, with `both`, the next: paired, or alone (one row in four chains)
    const auto single_or_pair = [&](int64_t block, bool both) {
        const int valid = valid_in(both ? block + 1 : block);
        if (rows == 1 && !both) {
            by_hint(hint, gemm_row<0>, gemm_row<1>, gemm_row<kNoPrefetch>)(
                k / 4, xq, packed + block * block_bytes, offsets + block * 16,
                weight_scale + block * 16, row_max[0],
                residual == nullptr ? nullptr : residual + block * 16, out + block * 16, valid,
                weights_end, prefetch_bytes);
            return;
        }
        const int64_t run_blocks = both ? 2 : 1;
        const uintptr_t next_run =
            reinterpret_cast<uintptr_t>(packed + (block + run_blocks) * block_bytes);
        for (int64_t first = 0; first < rows; first += 8) {
            const int64_t count = rows - first < 8 ? rows - first : 8;
            // past 8 rows (where hint is T0, or nothing) the passes share the next run
            const bool shares = rows > 8 && hint != kNoPrefetch;
            const int pass_hint = !shares ? hint : first == 0 ? kT0AndNextRun : kNextRunOnly;
            const PassPrefetch next =
                shares ? share_of_next_run(next_run, run_blocks * block_bytes, k / 4, first,
                                           count, rows)
                       : PassPrefetch{0, 0};
            (both ? block_builds<2>(pass_hint) : block_builds<1>(pass_hint))[count](
                k / 4, xq + first * k, k, packed + block * block_bytes, block_bytes,
                offsets + block * 16, weight_scale + block * 16, row_max + first,
                residual == nullptr ? nullptr : residual + first * residual_stride + block * 16,
                residual_stride, out + first * out_stride + block * 16, out_stride, valid,
                weights_end, first == 0 ? prefetch_bytes : 0, next);
        }
    };
    // `count` (4 or 8) neighbouring blocks from `block`, side by side
    const auto run_of = [&](int64_t block, int count) {
        const BlockFunction* functions =
            count == 8 ? by_hint<const BlockFunction*>(hint, kOctFunctions<0>, kOctFunctions<1>,
                                                       kOctFunctions<kNoPrefetch>)
                       : by_hint<const BlockFunction*>(hint, kQuadFunctions<0>,
                                                       kQuadFunctions<1>,
                                                       kQuadFunctions<kNoPrefetch>);
        functions[rows](k / 4, xq, k, packed + block * block_bytes, block_bytes,
                        offsets + block * 16, weight_scale + block * 16, row_max,
                        residual == nullptr ? nullptr : residual + block * 16, residual_stride,
                        out + block * 16, out_stride, valid_in(block + count - 1), weights_end,
                        prefetch_bytes, PassPrefetch{0, 0});
    };
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t task = 0; task < tasks; ++task) {
        int64_t block = task * span;
        if (span < 4) {
            single_or_pair(block, span == 2 && block + 1 < blocks);
            continue;
        }
        const int64_t end = block + span < blocks ? block + span : blocks;
        if (end - block == span) {
            run_of(block, static_cast<int>(span));
            continue;
        }
        if (end - block >= 4) {  // the last few: four side by side if as many are left
            run_of(block, 4);
            block += 4;
        }
        for (; block < end; ++block) single_or_pair(block, false);
    }
}

// The same product on AMX tiles (Intel Xeon from Sapphire Rapids on), for a batch of rows: a
// tile holds up to 16 rows of 64 quantized inputs (A), 16 groups of 4 inputs of a block's 16
// channels (B: 1 KB of the packed block as it lies, rows 64 bytes apart), and 16 x 16 int32
// sums (C). tdpbusd adds to each sum what vpdpbusd adds for the same four inputs, exactly, so
// every row gets the bits gemm gives it; the inputs past the last whole 64 (k % 64) are added
// by vpdpbusd before the epilogue, store_row, as in gemm_blocks. Blocks go in pairs (one A tile
// serves two B tiles); more than 16 rows walk a block once per 16 (the quantized rows are
// padded with zero rows to a multiple of 16, which are never stored). Where it pays is the
// CPU's to say (ChattsTuning::tiles_from, measured by kernels/tuning.py): at one row a tile
// multiplies 15 rows of nothing, and gemm_row already reads as fast as memory goes.

// Whether this process may use AMX tiles: the CPU has AMX-TILE and AMX-INT8 (CPUID 7.0:EDX
// bits 24 and 25) and Linux granted the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA; granted once, for every thread of the process). Asked once.
bool tiles_granted() {
    static const bool granted = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (__get_cpuid_max(0, nullptr) < 7) return false;
        __cpuid_count(7, 0, eax, ebx, ecx, edx);
        if ((edx & (1u << 24)) == 0 || (edx & (1u << 25)) == 0) return false;
        constexpr long kArchRequestPermission = 0x1023, kTileData = 18;
        return syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0;
    }();
    return granted;
}

// ldtilecfg's 64 bytes: palette 1; tiles 0 and 1 the sums (C) of two blocks, 2 the inputs (A),
// 4 and 5 the two blocks' weights (B).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};

    explicit TileConfig(int input_rows) {
        for (const int tile : {0, 1, 2}) {
            rows[tile] = static_cast<uint8_t>(input_rows);
            bytes_per_row[tile] = 64;
        }
        for (const int tile : {4, 5}) {
            rows[tile] = 16;
            bytes_per_row[tile] = 64;
        }
    }
};

// One pass of `count` (<= the tiles' rows) rows over BLOCKS (1 or 2) blocks: the sums of the
// first `chunks` * 64 inputs by tiles into `sums` ([16][BLOCKS * 16] int32), then the rest's.
template <int BLOCKS, int HINT>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni")))
void tile_sums(int64_t chunks, int64_t tail_groups, const uint8_t* xq, int64_t x_stride,
               int count, const int8_t* blocks, int64_t block_bytes, int32_t (*sums)[32],
               uintptr_t weights_end, int64_t prefetch_bytes) {
    _tile_zero(0);
    if constexpr (BLOCKS == 2) _tile_zero(1);
    const int8_t* w = blocks;
    const uint8_t* x = xq;
    for (int64_t chunk = 0; chunk < chunks; ++chunk, w += 1024, x += 64) {
        if (prefetch_bytes > 0) {  // each block's next kilobyte, as gemm_blocks fetches ahead
            for (int line = 0; line < 1024; line += 64) {
                const uintptr_t ahead =
                    ahead_in_run<BLOCKS>(w + line, blocks, block_bytes, prefetch_bytes);
                if (ahead + (BLOCKS - 1) * block_bytes >= weights_end) break;
                prefetch_weights<HINT>(ahead);
                if constexpr (BLOCKS == 2) prefetch_weights<HINT>(ahead + block_bytes);
            }
        }
        _tile_loadd(2, x, x_stride);
        _tile_loadd(4, w, 64);
        _tile_dpbusd(0, 2, 4);
        if constexpr (BLOCKS == 2) {
            _tile_loadd(5, w + block_bytes, 64);
            _tile_dpbusd(1, 2, 5);
        }
    }
    _tile_stored(0, &sums[0][0], 32 * sizeof(int32_t));
    if constexpr (BLOCKS == 2) _tile_stored(1, &sums[0][16], 32 * sizeof(int32_t));
    for (int64_t group = 0; group < tail_groups; ++group, x += 4, w += 64) {
        for (int r = 0; r < count; ++r) {
            int32_t four;
            std::memcpy(&four, x + r * x_stride, sizeof four);
            const __m512i inputs = _mm512_set1_epi32(four);
            for (int b = 0; b < BLOCKS; ++b) {
                const __m512i weights = _mm512_loadu_si512(w + b * block_bytes);
                _mm512_storeu_si512(&sums[r][16 * b],
                                    _mm512_dpbusd_epi32(_mm512_loadu_si512(&sums[r][16 * b]),
                                                        inputs, weights));
            }
        }
    }
}

// gemm on tiles: `xq` holds `rows` rows, or a multiple of 16 when rows > 16 (zero padding).
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni")))
void gemm_tiles(int64_t rows, int64_t n, int64_t k, const uint8_t* xq, const int8_t* packed,
                const int32_t* offsets, const float* weight_scale, const float* row_max,
                const float* residual, int64_t residual_stride, float* out, int64_t out_stride,
                int threads, const ChattsTuning& tuning) {
    const int64_t blocks = (n + 15) / 16, block_bytes = 16 * k, tasks = (blocks + 1) / 2;
    const int64_t chunks = k / 64, tail_groups = (k % 64) / 4;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(packed) + blocks * block_bytes;
    const int64_t prefetch_bytes = prefetch_bytes_for(tuning, rows);
    // past 16 rows later passes read each block again: into every level, as gemm does
    const bool t0 = tuning.prefetch_hint == 1 || rows > 16;
    const TileConfig config(rows < 16 ? static_cast<int>(rows) : 16);
#pragma omp parallel num_threads(threads)
    {
        // the configuration is each thread's own; torch's AMX kernels (oneDNN) set theirs too
        _tile_loadconfig(&config);
        alignas(64) int32_t sums[16][32];
#pragma omp for schedule(guided)  // as gemm, for the same reason
        for (int64_t task = 0; task < tasks; ++task) {
            const int64_t block = task * 2;
            const bool both = block + 1 < blocks;
            for (int64_t first = 0; first < rows; first += 16) {
                const int count = static_cast<int>(rows - first < 16 ? rows - first : 16);
                // the weights stream from memory on the first pass; later ones find them cached
                const int64_t ahead = first == 0 ? prefetch_bytes : 0;
                const uint8_t* x = xq + first * k;
                const int8_t* w = packed + block * block_bytes;
                if (both) {
                    (t0 ? tile_sums<2, 1> : tile_sums<2, 0>)(chunks, tail_groups, x, k, count, w,
                                                             block_bytes, sums, weights_end, ahead);
                } else {
                    (t0 ? tile_sums<1, 1> : tile_sums<1, 0>)(chunks, tail_groups, x, k, count, w,
                                                             block_bytes, sums, weights_end, ahead);
                }
                for (int b = 0; b < (both ? 2 : 1); ++b) {
                    const int64_t channel = (block + b) * 16;
                    const int valid = static_cast<int>(n - channel < 16 ? n - channel : 16);
                    for (int r = 0; r < count; ++r) {
                        const int64_t row = first + r;
                        store_row(_mm512_loadu_si512(&sums[r][16 * b]), offsets + channel,
                                  weight_scale + channel,
                                  row_max[row],
                                  residual == nullptr
                                      ? nullptr
                                      : residual + row * residual_stride + channel,
                                  out + row * out_stride + channel, valid);
                    }
                }
            }
        }
        _tile_release();
    }
}

// The same product for CPUs with AVX2 but not AVX512-VNNI (Haswell to Skylake, Zen 1-3), on
// the same packed weights. vpmaddubsw multiplies u8 by s8 and adds pairs into int16, saturating:
// with activations of 63 levels a side (u8 in [1, 127]) and weights in [-127, 127] a pair's
// sum is at most 32258, so it never saturates; vpmaddwd by ones then adds the pairs into int32
// lanes, so each group of four inputs adds to its channel exactly what vpdpbusd adds. 256-bit
// registers hold 8 channels: a block's 16 take two, and ROWS (1..4) rows keep 2 * ROWS
// accumulators (16 ymm registers in all). More rows pass over the block again, from cache.
// Group g prefetches prefetch_from + g * prefetch_step (a step of 0: none).
template <int ROWS, int HINT>
__attribute__((target("avx2,fma"),
               optimize("no-associative-math", "signed-zeros", "trapping-math",
                        "fp-contract=off")))
void gemm_block_avx2(int64_t k_groups, const uint8_t* xq, int64_t x_stride,
                     const int8_t* block, const int32_t* offsets, const float* weight_scale,
                     const float* row_max, const float* residual, int64_t residual_stride,
                     float* out, int64_t out_stride, int valid, uintptr_t weights_end,
                     uintptr_t prefetch_from, int64_t prefetch_step) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,
            b3 = a0;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* x = xq;
    const int8_t* w = block;
    uintptr_t ahead = prefetch_from;
    for (int64_t group = 0; group < k_groups; ++group, x += 4, w += 64, ahead += prefetch_step) {
        if (prefetch_step > 0 && ahead < weights_end) prefetch_weights<HINT>(ahead);
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
                                   int64_t, float*, int64_t, int, uintptr_t, uintptr_t, int64_t);
template <int HINT>
constexpr Avx2BlockFunction kAvx2BlockFunctions[5] = {
    nullptr, gemm_block_avx2<1, HINT>, gemm_block_avx2<2, HINT>, gemm_block_avx2<3, HINT>,
    gemm_block_avx2<4, HINT>};

__attribute__((target("avx2,fma")))
void gemm_avx2(int64_t rows, int64_t n, int64_t k, const uint8_t* xq, const int8_t* packed,
               const int32_t* offsets, const float* weight_scale, const float* row_max,
               const float* residual, int64_t residual_stride, float* out, int64_t out_stride,
               int threads, const ChattsTuning& tuning) {
    const int64_t blocks = (n + 15) / 16, block_bytes = 16 * k;
    const uintptr_t weights_end = reinterpret_cast<uintptr_t>(packed) + blocks * block_bytes;
    const int64_t prefetch_bytes = prefetch_bytes_for(tuning, rows);
    const Avx2BlockFunction* functions =
        tuning.prefetch_hint == 1 ? kAvx2BlockFunctions<1> : kAvx2BlockFunctions<0>;
    const int64_t passes = (rows + 3) / 4, k_groups = k / 4;  // 4 rows a pass
#pragma omp parallel for num_threads(threads) schedule(guided)  // as gemm, for the same reason
    for (int64_t block = 0; block < blocks; ++block) {
        const int valid = static_cast<int>(n - block * 16 < 16 ? n - block * 16 : 16);
        const uintptr_t start = reinterpret_cast<uintptr_t>(packed + block * block_bytes);
        for (int64_t first = 0; first < rows; first += 4) {
            const int64_t count = rows - first < 4 ? rows - first : 4;
            const PassPrefetch ahead =
                pass_prefetch(start, block_bytes, k_groups, prefetch_bytes, first / 4, passes);
            functions[count](
                k_groups, xq + first * k, k, packed + block * block_bytes, offsets + block * 16,
                weight_scale + block * 16, row_max + first,
                residual == nullptr ? nullptr : residual + first * residual_stride + block * 16,
                residual_stride, out + first * out_stride + block * 16, out_stride, valid,
                weights_end, ahead.from, ahead.step);
        }
    }
}

#else
bool tiles_granted() { return false; }
#endif  // CHATTS_X86

#if CHATTS_ARM
#include "int8_linear_arm.cpp"
#endif

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

bool valid_tuning(const ChattsTuning& tuning) {
    return tuning.prefetch_groups >= 0 && tuning.prefetch_groups <= 256 &&
           tuning.prefetch_hint >= 0 && tuning.prefetch_hint <= 1 &&
           tuning.pair_blocks_from >= 1 && tuning.pair_blocks_from <= 9 &&
           tuning.quads_up_to >= 0 && tuning.quads_up_to <= 4 && tuning.octs_up_to >= 0 &&
           tuning.octs_up_to <= 2 && tuning.bare_up_to >= 0 && tuning.bare_up_to <= 4 &&
           (tuning.tiles_from == 0 || (tuning.tiles_from >= 2 && tuning.tiles_from <= 65));
}

// Each row of x (RMSNorm-ed with `gain`, or silu(gate) * up with `swiglu`) quantized as
// quantize_row does: `quantized` [rows, k] and each row's largest magnitude, `row_max`; then
// zero rows up to `padded_rows` (gemm_tiles reads whole tiles).
struct QuantizedRows {
    std::unique_ptr<uint8_t[]> quantized;
    std::unique_ptr<float[]> row_max;

    QuantizedRows(int64_t rows, int64_t k, const float* x, int64_t x_row_stride,
                  const float* gain, float eps, int swiglu, int levels, int32_t zero_point,
                  int threads, int64_t padded_rows = 0)
        : quantized(new uint8_t[std::max(rows, padded_rows) * k]), row_max(new float[rows]) {
        if (padded_rows > rows)
            std::memset(quantized.get() + rows * k, 0, (padded_rows - rows) * k);
        std::unique_ptr<float[]> products(swiglu ? new float[rows * k] : nullptr);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
        for (int64_t row = 0; row < rows; ++row) {
            const float* values = x + row * x_row_stride;
            if (swiglu) {
                silu_times(values, values + k, k, products.get() + row * k);
                values = products.get() + row * k;
            }
            row_max[row] =
                quantize_row(values, k, gain, eps, levels, zero_point, quantized.get() + row * k);
        }
    }
};

}  // namespace

// out[rows, n] (rows `out_stride` floats apart) = the rows of x (`x_row_stride` floats apart)
// times the packed weights, transposed; plus `residual` [rows, n] (`residual_stride` apart)
// when it is not NULL. The rows are RMSNorm-ed with `gain` first when it is not NULL; with
// `swiglu`, each row of x holds 2k values, gate then up, and the row multiplied is
// silu(gate) * up. k % 4 == 0; `packed`, `offsets` and `weight_scale` cover n rounded up to 16
// channels; `offsets` is (levels + 1) * each channel's weight sum, `weight_scale` each channel's
// scale divided by `levels` (the activations' levels either side of zero). `instructions`:
// a ChattsProduct (kernels.h).
static int32_t int8_linear(
    int64_t rows, int64_t n, int64_t k, const float* x, int64_t x_row_stride, const float* gain,
    float eps, int swiglu, const int8_t* packed, const int32_t* offsets,
    const float* weight_scale, const float* residual, int64_t residual_stride, float* out,
    int64_t out_stride, int levels, int instructions, int threads, const ChattsTuning& tuning) {
    if (k % 4 != 0) return CHATTS_WIDTH_NOT_MULTIPLE_OF_4;
    if (!valid_tuning(tuning)) return CHATTS_BAD_TUNING;
#if CHATTS_X86
    if (instructions == CHATTS_PRODUCT_VNNI) {
        if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
            return CHATTS_CPU_LACKS_PRODUCT;
        if (levels < 1 || levels > 127) return CHATTS_TOO_MANY_LEVELS;
    } else if (instructions == CHATTS_PRODUCT_AVX2) {
        if (!__builtin_cpu_supports("avx2")) return CHATTS_CPU_LACKS_PRODUCT;
        if (levels < 1 || levels > 63) return CHATTS_TOO_MANY_LEVELS;
    } else if (instructions >= CHATTS_PRODUCT_NEON && instructions <= CHATTS_PRODUCT_I8MM) {
        return CHATTS_CPU_LACKS_PRODUCT;
    } else {
        return CHATTS_UNKNOWN_PRODUCT;
    }
    // tiles: VNNI's integers on AMX, from as many rows as the tuning says
    const bool tiles = instructions == CHATTS_PRODUCT_VNNI && tuning.tiles_from > 0 &&
                       rows >= tuning.tiles_from;
    if (tiles && !tiles_granted()) return CHATTS_NO_TILES;
    const QuantizedRows prepared(rows, k, x, x_row_stride, gain, eps, swiglu, levels,
                                 levels + 1, threads,
                                 tiles && rows > 16 ? (rows + 15) / 16 * 16 : rows);
    (tiles ? gemm_tiles : instructions == CHATTS_PRODUCT_VNNI ? gemm : gemm_avx2)(
        rows, n, k, prepared.quantized.get(), packed, offsets, weight_scale,
        prepared.row_max.get(), residual, residual_stride, out, out_stride, threads, tuning);
#else
    const ArmGemm product = arm_product(instructions);
    if (instructions == CHATTS_PRODUCT_AVX2 || instructions == CHATTS_PRODUCT_VNNI)
        return CHATTS_CPU_LACKS_PRODUCT;
    if (instructions < CHATTS_PRODUCT_NEON || instructions > CHATTS_PRODUCT_I8MM)
        return CHATTS_UNKNOWN_PRODUCT;
    if (product == nullptr) return CHATTS_CPU_LACKS_PRODUCT;
    if (levels < 1 || levels > 127) return CHATTS_TOO_MANY_LEVELS;
    (void)offsets;  // s8 activations: no zero point to take off (int8_linear_arm.cpp)
    const QuantizedRows prepared(rows, k, x, x_row_stride, gain, eps, swiglu, levels, 0,
                                 threads);
    product(rows, n, k, reinterpret_cast<const int8_t*>(prepared.quantized.get()), packed,
            weight_scale, prepared.row_max.get(), residual, residual_stride, out, out_stride,
            threads);
#endif
    return CHATTS_OK;
}

extern "C" int32_t chatts_int8_linear(const ChattsInt8LinearArgs* a) {
    return int8_linear(a->rows, a->n, a->k, a->x, a->x_row_stride, a->gain, a->eps, a->swiglu,
                       a->packed, a->offsets, a->weight_scale, a->residual, a->residual_stride,
                       a->out, a->out_stride, a->levels, a->product, a->threads, a->tuning);
}

extern "C" int32_t chatts_amx_tiles() { return tiles_granted() ? 1 : 0; }

// The int8 products this CPU runs, as a mask of 1 << ChattsProduct.
extern "C" int32_t chatts_int8_products() {
#if CHATTS_X86
    int32_t mask = 0;
    if (__builtin_cpu_supports("avx2")) mask |= 1 << CHATTS_PRODUCT_AVX2;
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"))
        mask |= 1 << CHATTS_PRODUCT_VNNI;
    return mask;
#else
    int32_t mask = 0;
    for (int32_t product = CHATTS_PRODUCT_NEON; product <= CHATTS_PRODUCT_I8MM; ++product)
        if (arm_product(product) != nullptr) mask |= 1 << product;
    return mask;
#endif
}
