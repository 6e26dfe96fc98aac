// chatts_peak_loop: what the products' instructions do at most, with nothing to wait for: their
// inner loop on values held in registers, on every thread. The benchmarks divide a product's
// multiply-adds by this rate for the least time any kernel made of those instructions could
// take, and so tell a target the CPU's arithmetic puts out of reach from one a better kernel
// could meet. Each loop keeps enough independent sums that no instruction waits for another's
// result, and an empty asm statement per iteration hides the weights' values from the
// compiler, so nothing is hoisted out of the loop.

#if CHATTS_X86
namespace {

// The products' operands as their loops read them: four rows' groups of 4 inputs (each
// broadcast from memory) and 128 bytes of weights, L1-resident. The loops read them through a
// pointer an empty asm statement hides, so each iteration loads them again, as the products do.
alignas(64) const int32_t kPeakInputs[8] = {0x01020304, 0x05060708, 0x090a0b0c, 0x0d0e0f10,
                                            0x11121314, 0x15161718, 0x191a1b1c, 0x1d1e1f20};
alignas(64) const int8_t kPeakWeights[128] = {3, -5, 7, -11, 13, -17, 19, -23};

// acc += v in acc's own register (as dpbusd does for vpdpbusd: written as the intrinsic, GCC 12
// copied each sum to another register and back every iteration, and spilled one)
__attribute__((target("avx2"), always_inline)) inline void add_in_place(__m256i& acc, __m256i v) {
    asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(v));
}

// gemm_block_avx2's instructions for 4 rows of one block (a group of 4 inputs): per row, a
// broadcast input; per half-block, vpmaddubsw (32 u8 x s8 products added in pairs),
// vpmaddwd by ones (pairs to int32), vpaddd.
__attribute__((target("avx2"))) uint64_t peak_avx2(int64_t iterations) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0,
            b3 = a0;
    const int32_t* x = kPeakInputs;
    const int8_t* w = kPeakWeights;
    for (int64_t i = 0; i < iterations; ++i) {
        asm volatile("" : "+r"(x), "+r"(w));
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#define CHATTS_ROW(R)                                                                        \
        {                                                                                    \
            const __m256i inputs = _mm256_set1_epi32(x[R]);                                  \
            add_in_place(a##R, _mm256_madd_epi16(_mm256_maddubs_epi16(inputs, w0), ones));   \
            add_in_place(b##R, _mm256_madd_epi16(_mm256_maddubs_epi16(inputs, w1), ones));   \
        }
        CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
#undef CHATTS_ROW
    }
    const __m256i sum = _mm256_add_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
        _mm256_add_epi32(_mm256_add_epi32(b0, b1), _mm256_add_epi32(b2, b3)));
    uint64_t lanes[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), sum);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// gemm_blocks' instructions for 8 rows of a pair of blocks: per row a broadcast input, per
// row and block vpdpbusd (64 u8 x s8 products added in fours into int32), 16 sums.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) uint64_t peak_vnni(int64_t iterations) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    const int32_t* x = kPeakInputs;
    const int8_t* w = kPeakWeights;
    for (int64_t i = 0; i < iterations; ++i) {
        asm volatile("" : "+r"(x), "+r"(w));
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
#define CHATTS_ROW(R)                                              \
        {                                                          \
            const __m512i inputs = _mm512_set1_epi32(x[R]);        \
            dpbusd(a##R, inputs, w0);                              \
            dpbusd(b##R, inputs, w1);                              \
        }
        CHATTS_ROW(0) CHATTS_ROW(1) CHATTS_ROW(2) CHATTS_ROW(3)
        CHATTS_ROW(4) CHATTS_ROW(5) CHATTS_ROW(6) CHATTS_ROW(7)
#undef CHATTS_ROW
    }
    const __m512i a = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
        _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    const __m512i b = _mm512_add_epi32(
        _mm512_add_epi32(_mm512_add_epi32(b0, b1), _mm512_add_epi32(b2, b3)),
        _mm512_add_epi32(_mm512_add_epi32(b4, b5), _mm512_add_epi32(b6, b7)));
    return static_cast<uint64_t>(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
}

// fp32 multiply-adds as a GEMM's inner loop issues them: 12 sums, each of its own broadcast
// input times one vector of weights loaded per iteration (vfmadd231ps), 256-bit or, where the
// CPU has AVX-512, 512-bit: torch's fp32 products use the widest. Every sum starts apart and
// takes its own input, so none can be merged with another.
alignas(64) const float kPeakFloats[16] = {0.5f, 0.25f, 0.125f, 0.0625f, 0.5f, 0.25f, 0.125f,
                                           0.0625f, 0.5f, 0.25f, 0.125f, 0.0625f, 0.5f, 0.25f,
                                           0.125f, 0.0625f};
#define CHATTS_PEAK_FMA(NAME, TARGET, VECTOR, SET1, LOAD, FMA)                               \
    __attribute__((target(TARGET))) uint64_t NAME(int64_t iterations) {                     \
        VECTOR s[12];                                                                        \
        for (int j = 0; j < 12; ++j) s[j] = SET1(static_cast<float>(j));                     \
        const float* w = kPeakFloats;                                                        \
        for (int64_t i = 0; i < iterations; ++i) {                                           \
            asm volatile("" : "+r"(w));                                                      \
            const VECTOR weights = LOAD(w);                                                  \
            _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) s[j] =                     \
                FMA(SET1(1e-3f * static_cast<float>(j + 1)), weights, s[j]);                 \
        }                                                                                    \
        float total = 0.0f;                                                                  \
        for (const auto& sum : s) {                                                          \
            float lanes[sizeof(VECTOR) / sizeof(float)];                                     \
            std::memcpy(lanes, &sum, sizeof lanes);                                          \
            for (const float lane : lanes) total += lane;                                    \
        }                                                                                    \
        uint32_t bits;                                                                       \
        std::memcpy(&bits, &total, sizeof bits);                                             \
        return bits;                                                                         \
    }
CHATTS_PEAK_FMA(peak_fma256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_loadu_ps,
                _mm256_fmadd_ps)
CHATTS_PEAK_FMA(peak_fma512, "avx512f", __m512, _mm512_set1_ps, _mm512_loadu_ps,
                _mm512_fmadd_ps)
#undef CHATTS_PEAK_FMA

// bf16 products as oneDNN's bf16 GEMM issues them on AVX512-BF16 (the bf16 decoder's linear
// layers): 12 fp32 sums, each adding a broadcast pair of bf16 inputs times a vector of 16 pairs
// of weights (vdpbf16ps: 32 multiply-adds), the weights loaded once per iteration.
alignas(64) const uint16_t kPeakBf16[32] = {0x3f00, 0x3e80, 0x3e00, 0x3d80, 0x3f00, 0x3e80,
                                            0x3e00, 0x3d80, 0x3f00, 0x3e80, 0x3e00, 0x3d80,
                                            0x3f00, 0x3e80, 0x3e00, 0x3d80};
__attribute__((target("avx512f,avx512bf16"))) uint64_t peak_bf16(int64_t iterations) {
    __m512 s[12];
    for (int j = 0; j < 12; ++j) s[j] = _mm512_set1_ps(static_cast<float>(j));
    const uint16_t* w = kPeakBf16;
    for (int64_t i = 0; i < iterations; ++i) {
        asm volatile("" : "+r"(w));
        const __m512bh weights = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
        _Pragma("GCC unroll 12") for (int j = 0; j < 12; ++j) s[j] = _mm512_dpbf16_ps(
            s[j], reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3c003c00 + j)), weights);
    }
    float total = 0.0f;
    for (const auto& sum : s) total += _mm512_reduce_add_ps(sum);
    uint32_t bits;
    std::memcpy(&bits, &total, sizeof bits);
    return bits;
}

}  // namespace

#endif  // CHATTS_X86

extern "C" int64_t chatts_peak_loop(int32_t kind, int64_t iterations, int32_t threads,
                                    uint64_t* checksum) {
    if (iterations < 1 || threads < 1) return -CHATTS_BAD_PEAK;
#if CHATTS_ARM  // no peak loops for aarch64's instructions yet
    (void)kind, (void)checksum;
    return -CHATTS_CPU_LACKS_PRODUCT;
#else
    uint64_t (*loop)(int64_t) = nullptr;
    int64_t per_iteration = 0;
    if (kind == CHATTS_PEAK_AVX2) {
        if (!__builtin_cpu_supports("avx2")) return -CHATTS_CPU_LACKS_PRODUCT;
        loop = peak_avx2, per_iteration = 8 * 32;
    } else if (kind == CHATTS_PEAK_VNNI) {
        if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw"))
            return -CHATTS_CPU_LACKS_PRODUCT;
        loop = peak_vnni, per_iteration = 16 * 64;
    } else if (kind == CHATTS_PEAK_FP32) {
        if (__builtin_cpu_supports("avx512f")) {
            loop = peak_fma512, per_iteration = 12 * 16;
        } else {
            if (!__builtin_cpu_supports("fma")) return -CHATTS_CPU_LACKS_PRODUCT;
            loop = peak_fma256, per_iteration = 12 * 8;
        }
    } else if (kind == CHATTS_PEAK_BF16) {
        if (!__builtin_cpu_supports("avx512bf16")) return -CHATTS_CPU_LACKS_PRODUCT;
        loop = peak_bf16, per_iteration = 12 * 32;
    } else {
        return -CHATTS_BAD_PEAK;
    }
    uint64_t folded = 0;  // added, not xor-ed: every thread's result is the same
#pragma omp parallel num_threads(threads) reduction(+ : folded)
    folded += loop(iterations);
    if (checksum != nullptr) *checksum = folded;
    return per_iteration * iterations * threads;
#endif
}
