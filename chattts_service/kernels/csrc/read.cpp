// chatts_read_buffers: read buffers once and do nothing with the bytes but fold them into a
// checksum (so the reads cannot be dropped): the least a pass over the same weights can cost.
// The benchmarks divide a step's time by this, measured on the weights themselves (the same
// pages, threads and CPU), rather than by the bandwidth some other loop reads.
//
// Every thread reads its share of each buffer (one parallel region for all of them: no wait
// between buffers), 128 bytes per step in four 32-byte loads, prefetching `prefetch_bytes`
// ahead into every cache level (0: the hardware prefetcher alone), as one run front to back
// or as `streams` runs side by side (the share cut in as many pieces, read in lockstep: some
// CPUs read several runs faster, as the int8 product's four blocks at a time do). Which reads
// fastest differs between CPUs; the caller tries several. The fold is the same either way.

namespace {

#if CHATTS_X86
__attribute__((target("avx2")))
#endif
uint64_t read_span(const uint8_t* start, int64_t bytes, int64_t prefetch_bytes, int streams) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    const int64_t whole = bytes & ~int64_t{127};  // in 128-byte pieces; the rest after
    const int64_t run = (whole / 128 + streams - 1) / streams * 128;  // each stream's bytes
    for (int64_t offset = 0; offset < run; offset += 128) {
        for (int64_t stream = 0; stream < streams && stream * run + offset < whole; ++stream) {
            const uint8_t* at = start + stream * run + offset;
            if (prefetch_bytes > 0) {
                _mm_prefetch(reinterpret_cast<const char*>(at + prefetch_bytes), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(at + prefetch_bytes + 64),
                             _MM_HINT_T0);
            }
            a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
            b = _mm256_xor_si256(b,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32)));
            c = _mm256_xor_si256(c,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64)));
            d = _mm256_xor_si256(d,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 96)));
        }
    }
    const uint8_t* end = start + whole;
    uint64_t lanes[4];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes),
                        _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d)));
    uint64_t sum = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    for (const uint8_t* tail = end; tail < start + bytes; ++tail) sum += *tail;
    return sum;
}

}  // namespace

extern "C" int32_t chatts_read_buffers(ChattsReadArgs* a) {
    if (a->count < 0 || a->prefetch_bytes < 0 || a->threads < 1 || a->streams < 1 ||
        a->streams > 16)
        return CHATTS_BAD_READ;
    uint64_t checksum = 0;
#pragma omp parallel num_threads(a->threads) reduction(^ : checksum)
    {
        const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
        for (int64_t index = 0; index < a->count; ++index) {
            const int64_t bytes = a->bytes[index];
            // 64-byte aligned shares, contiguous per thread
            const int64_t share = ((bytes + threads - 1) / threads + 63) & ~int64_t{63};
            const int64_t first = thread * share;
            if (first >= bytes) continue;
            const int64_t length = bytes - first < share ? bytes - first : share;
            checksum ^= read_span(static_cast<const uint8_t*>(a->buffers[index]) + first, length,
                                  a->prefetch_bytes, a->streams);
        }
    }
    a->checksum = checksum;
    return CHATTS_OK;
}
