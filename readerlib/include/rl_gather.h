/* rl_gather.h -- the row loops of batch_reindex's forward gather
 * (readerlib/kernels/_reindex.pyx): y[i] = x[idx[i]], rows of `rb` bytes,
 * for int32 and int64 indices.
 *
 *   cached  rows a multiple of 32 bytes, up to 1 KiB: inlined 32-byte moves
 *           (no libc call and size dispatch per row).  For outputs that stay
 *           in the caches.
 *   stream  rows a multiple of 16 bytes into a 16-byte aligned output too big
 *           for the caches: non-temporal (streaming) stores, so the output's
 *           lines are not read before being written (no read-for-ownership)
 *           and do not evict the source.  Consecutive rows are consecutive in
 *           the output, so the write-combining buffers see whole lines.  One
 *           sfence at the end of the range.
 *
 * Both prefetch the source row `pf` indices ahead: the gather's reads are at
 * random rows, which no hardware prefetcher predicts.  Prefetches never
 * fault, and the loops only prefetch rows of [b, e) anyway.  The caller
 * checks every index first (the loops trust them).
 *
 * Measured on this 2-core EPYC (Zen 4), one thread, 256-byte rows, best of
 * 30-200 calls of these loops from a small C driver:
 *   16 MiB output, streaming, source in L3: no prefetch 1.27-3.6 ms, 8 rows
 *   ahead 0.68-0.76, 16 ahead 0.63-0.66, 24 ahead 0.62-0.69, 32 ahead
 *   0.68-1.0.  Streaming-writing 16 MiB alone takes 0.60 ms, on 1 thread or
 *   2 (the VM's DRAM write bandwidth, ~28 GB/s): 16 ahead is at that floor.
 *   2 MiB output, cached: no prefetch 66.7 us, 8 or 16 ahead 55.0 us.
 *   Wider bodies bought nothing measurable, so there are none (no ISA
 *   dispatch): AVX2 32-byte cached moves 55.1 vs 55.0 us (2 MiB), AVX-512
 *   64-byte streaming stores of aligned lines 0.63-0.67 vs 0.62-0.69 ms at
 *   16 MiB (both at the write floor).
 */
#ifndef READERLIB_RL_GATHER_H
#define READERLIB_RL_GATHER_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define RL_GATHER_SSE2 1
#else
#define RL_GATHER_SSE2 0
#endif

typedef ptrdiff_t rl_gidx;

static inline void rl_gather_prefetch(const char* p, rl_gidx nbytes) {
#if defined(__GNUC__)
    rl_gidx o;
    if (nbytes > 512) nbytes = 512;
    for (o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 3);
#else
    (void)p; (void)nbytes;
#endif
}

/* The loop: copy rows [b, e), prefetching `pf` rows ahead; COPY(d, s, n). */
#define RL_GATHER_LOOP(NAME, IDX_T, COPY, FENCE)                               \
static void NAME(const char* src, rl_gidx rb, const IDX_T* idx,                \
                      rl_gidx b, rl_gidx e, char* dst, rl_gidx pf) {           \
    rl_gidx i, stop = e - pf > b ? e - pf : b;                                 \
    for (i = b; i < stop; ++i) {                                               \
        rl_gather_prefetch(src + (rl_gidx)idx[i + pf] * rb, rb);               \
        COPY(dst + i * rb, src + (rl_gidx)idx[i] * rb, rb);                    \
    }                                                                          \
    for (; i < e; ++i)                                                         \
        COPY(dst + i * rb, src + (rl_gidx)idx[i] * rb, rb);                    \
    FENCE;                                                                     \
}

/* Cached: n % 32 == 0.  memcpy of a constant 32 (64) bytes is one (two) moves. */
#define RL_COPY_CACHED32(d, s, n) do {                                         \
    rl_gidx c_;                                                                \
    for (c_ = 0; c_ < (n); c_ += 32) memcpy((d) + c_, (s) + c_, 32);           \
} while (0)

#if RL_GATHER_SSE2
/* Streaming, 16-byte stores: d 16-byte aligned, n % 16 == 0. */
#define RL_COPY_STREAM16(d, s, n) do {                                         \
    rl_gidx c_ = 0;                                                            \
    for (; c_ + 64 <= (n); c_ += 64) {                                         \
        __m128i a0 = _mm_loadu_si128((const __m128i*)((s) + c_));              \
        __m128i a1 = _mm_loadu_si128((const __m128i*)((s) + c_ + 16));         \
        __m128i a2 = _mm_loadu_si128((const __m128i*)((s) + c_ + 32));         \
        __m128i a3 = _mm_loadu_si128((const __m128i*)((s) + c_ + 48));         \
        _mm_stream_si128((__m128i*)((d) + c_), a0);                            \
        _mm_stream_si128((__m128i*)((d) + c_ + 16), a1);                       \
        _mm_stream_si128((__m128i*)((d) + c_ + 32), a2);                       \
        _mm_stream_si128((__m128i*)((d) + c_ + 48), a3);                       \
    }                                                                          \
    for (; c_ < (n); c_ += 16)                                                 \
        _mm_stream_si128((__m128i*)((d) + c_),                                 \
                         _mm_loadu_si128((const __m128i*)((s) + c_)));         \
} while (0)
#define RL_SFENCE _mm_sfence()
#else
#define RL_COPY_STREAM16(d, s, n) memcpy((d), (s), (n))
#define RL_SFENCE ((void)0)
#endif

#define RL_NOFENCE ((void)0)

RL_GATHER_LOOP(rl_gather_cached_i32, int32_t, RL_COPY_CACHED32, RL_NOFENCE)
RL_GATHER_LOOP(rl_gather_cached_i64, int64_t, RL_COPY_CACHED32, RL_NOFENCE)
RL_GATHER_LOOP(rl_gather_stream_i32, int32_t, RL_COPY_STREAM16, RL_SFENCE)
RL_GATHER_LOOP(rl_gather_stream_i64, int64_t, RL_COPY_STREAM16, RL_SFENCE)

#endif  /* READERLIB_RL_GATHER_H */
