/* rl_gather.h -- the row loops of batch_reindex's forward gather
 * (readerlib/kernels/_reindex.pyx): y[i] = x[idx[i]], rows of `rb` bytes,
 * for int32 and int64 indices.
 *
 *   cached  rows a multiple of 32 bytes, up to 1 KiB: inlined moves (no libc
 *           call and size dispatch per row).  For outputs that stay in the
 *           caches.  On x86-64 the body is picked at import by the CPU
 *           (rl_gather_select_isa): AVX-512 64-byte moves for rows of 64-byte
 *           multiples, AVX2 32-byte moves for the others of 64 bytes or more,
 *           else the baseline SSE2 16-byte moves (memcpy of a constant 32).
 *           The AVX2 / AVX-512
 *           bodies also prefetch the *output* row they will write `pf` rows
 *           later (see below).
 *   stream  rows a multiple of 16 bytes into a 16-byte aligned output too big
 *           for the caches: non-temporal (streaming) stores, so the output's
 *           lines are not read before being written (no read-for-ownership)
 *           and do not evict the source.  Consecutive rows are consecutive in
 *           the output, so the write-combining buffers see whole lines.  One
 *           sfence at the end of the range.
 *
 * Both prefetch the source row `pf` indices ahead: the gather's reads are at
 * random rows, which no hardware prefetcher predicts.  Prefetches never
 * fault, and the loops only prefetch rows of [b, e) anyway (input rows named
 * by idx[b..e), output rows b..e-1: never another thread's chunk, never past
 * idx's end).  The caller checks every index first (the loops trust them).
 *
 * Measured on the Zen 4 EPYC (2 cores), one thread, 256-byte rows, best of
 * 30-200 calls of these loops from a small C driver:
 *   16 MiB output, streaming, source in L3: no prefetch 1.27-3.6 ms, 8 rows
 *   ahead 0.68-0.76, 16 ahead 0.63-0.66, 24 ahead 0.62-0.69, 32 ahead
 *   0.68-1.0.  Streaming-writing 16 MiB alone takes 0.60 ms, on 1 thread or
 *   2 (the VM's DRAM write bandwidth, ~28 GB/s): 16 ahead is at that floor.
 *   2 MiB output, cached: no prefetch 66.7 us, 8 or 16 ahead 55.0 us.
 *   There, wider moves bought nothing (AVX2 55.1 vs 55.0 us).
 * On the 2-vCPU Xeon (Sapphire Rapids, AVX-512, 2026-12-05), where 16 MiB
 * outputs take the cached loop (streaming from 32 MiB), the cached stores
 * were the limit: each store to an output line not in L1 waits for that
 * line (read-for-ownership), and the store buffer only has a few such
 * misses in flight.  Prefetching the output row `pf` rows ahead (a read
 * prefetch: the line arrives exclusive, as no other core holds it) starts
 * those reads early, and 64-byte moves need a quarter of the stores.  In
 * the interleaved Python A/B (benchmarks/results/kernels_cpu.md), 16 MiB of
 * 256-byte rows, best / median ms: 2 threads, baseline 0.73 / 1.26-1.42,
 * AVX-512 + output prefetch 0.60-0.62 / 1.06-1.19, AVX2 + output prefetch
 * 0.64-0.65 / 1.16-1.23; the output prefetch with 16-byte moves 0.71-0.73
 * (nothing), 64-byte moves without it 0.72-1.21; one thread 1.21-1.27 ->
 * 0.97-1.02.  prefetchw instead of the read prefetch: no better.  Prefetch
 * distance 8-32: within noise.  Other rows, same A/B (2 threads / 1 thread
 * best ms, baseline -> AVX-512): 512-byte rows, 16 MiB, 0.755 -> 0.718 /
 * 1.393 -> 1.311; 1 KiB rows within noise (0.658 -> 0.642 / 1.203 -> 1.201);
 * 96-byte rows (AVX2), 6 MiB, 0.346 -> 0.326 / 0.501 -> 0.454.
 */
#ifndef READERLIB_RL_GATHER_H
#define READERLIB_RL_GATHER_H
#include <stddef.h>
#include "rl_isa.h"
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define RL_GATHER_SSE2 1
#else
#define RL_GATHER_SSE2 0
#endif
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define RL_GATHER_X86_DISPATCH 1   /* AVX2 / AVX-512 cached bodies, chosen at import */
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

/* The loop: copy rows [b, e), prefetching the source row `pf` rows ahead;
   COPY(d, s, n); OUTPF(d, n): what it does for the output row it will write
   `pf` rows later (RL_OUTPF: prefetch it, RL_NO_OUTPF: nothing); ATTR: a
   target attribute or nothing. */
#define RL_GATHER_LOOP_X(NAME, IDX_T, COPY, FENCE, OUTPF, ATTR)                \
ATTR static void NAME(const char* src, rl_gidx rb, const IDX_T* idx,           \
                      rl_gidx b, rl_gidx e, char* dst, rl_gidx pf) {           \
    rl_gidx i, stop = e - pf > b ? e - pf : b;                                 \
    for (i = b; i < stop; ++i) {                                               \
        rl_gather_prefetch(src + (rl_gidx)idx[i + pf] * rb, rb);               \
        OUTPF(dst + (i + pf) * rb, rb);                                        \
        COPY(dst + i * rb, src + (rl_gidx)idx[i] * rb, rb);                    \
    }                                                                          \
    for (; i < e; ++i)                                                         \
        COPY(dst + i * rb, src + (rl_gidx)idx[i] * rb, rb);                    \
    FENCE;                                                                     \
}
#define RL_OUTPF(d, n) rl_gather_prefetch((d), (n))
#define RL_NO_OUTPF(d, n) ((void)0)
#define RL_NO_ATTR
#define RL_GATHER_LOOP(NAME, IDX_T, COPY, FENCE)                               \
    RL_GATHER_LOOP_X(NAME, IDX_T, COPY, FENCE, RL_NO_OUTPF, RL_NO_ATTR)

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

RL_GATHER_LOOP(rl_gather_base_i32, int32_t, RL_COPY_CACHED32, RL_NOFENCE)
RL_GATHER_LOOP(rl_gather_base_i64, int64_t, RL_COPY_CACHED32, RL_NOFENCE)
RL_GATHER_LOOP(rl_gather_stream_i32, int32_t, RL_COPY_STREAM16, RL_SFENCE)
RL_GATHER_LOOP(rl_gather_stream_i64, int64_t, RL_COPY_STREAM16, RL_SFENCE)

#ifdef RL_GATHER_X86_DISPATCH
/* AVX2: n % 32 == 0.  AVX-512: n % 64 == 0.  Unaligned loads and stores. */
#define RL_COPY_YMM(d, s, n) do {                                              \
    rl_gidx c_;                                                                \
    for (c_ = 0; c_ < (n); c_ += 32)                                           \
        _mm256_storeu_si256((__m256i*)((d) + c_),                              \
                            _mm256_loadu_si256((const __m256i*)((s) + c_)));   \
} while (0)
#define RL_COPY_ZMM(d, s, n) do {                                              \
    rl_gidx c_;                                                                \
    for (c_ = 0; c_ < (n); c_ += 64)                                           \
        _mm512_storeu_si512((void*)((d) + c_),                                 \
                            _mm512_loadu_si512((const void*)((s) + c_)));      \
} while (0)
#define RL_TARGET_AVX2 __attribute__((target("avx2")))
#define RL_TARGET_AVX512 __attribute__((target("avx512f")))
RL_GATHER_LOOP_X(rl_gather_avx2_i32, int32_t, RL_COPY_YMM, RL_NOFENCE, RL_OUTPF, RL_TARGET_AVX2)
RL_GATHER_LOOP_X(rl_gather_avx2_i64, int64_t, RL_COPY_YMM, RL_NOFENCE, RL_OUTPF, RL_TARGET_AVX2)
RL_GATHER_LOOP_X(rl_gather_avx512_i32, int32_t, RL_COPY_ZMM, RL_NOFENCE, RL_OUTPF, RL_TARGET_AVX512)
RL_GATHER_LOOP_X(rl_gather_avx512_i64, int64_t, RL_COPY_ZMM, RL_NOFENCE, RL_OUTPF, RL_TARGET_AVX512)
#endif

/* The cached body in use: 1 baseline, 2 AVX2, 3 AVX-512 (rows of 64-byte
   multiples; AVX2 for the others).  Rows of 32 bytes keep the baseline: two
   of them share an output line, so the output prefetch would be issued
   twice per line (measured 2-10% slower on one thread at 16 MiB).  Set once
   at import, or by tests. */
static int rl_gather_isa = 1;

static int rl_gather_select_isa(int want) {   /* want: 0 best, 1 baseline, 2 avx2, 3 avx512 (rl_isa.h) */
    want = rl_isa_choose(want);         /* (the baseline where no wider body is compiled) */
    rl_gather_isa = want;
    return want;
}

/* Cached rows: rb % 32 == 0, rb <= 1 KiB. */
#define RL_GATHER_CACHED(NAME, IDX_T, SFX)                                     \
static void NAME(const char* src, rl_gidx rb, const IDX_T* idx,                \
                 rl_gidx b, rl_gidx e, char* dst, rl_gidx pf) {                \
    RL_GATHER_CACHED_X86(SFX)                                                  \
    rl_gather_base_##SFX(src, rb, idx, b, e, dst, pf);                         \
}
#ifdef RL_GATHER_X86_DISPATCH
#define RL_GATHER_CACHED_X86(SFX)                                              \
    if (rl_gather_isa >= 3 && rb % 64 == 0) {                                  \
        rl_gather_avx512_##SFX(src, rb, idx, b, e, dst, pf);                   \
        return;                                                                \
    }                                                                          \
    if (rl_gather_isa >= 2 && rb >= 64) {                                      \
        rl_gather_avx2_##SFX(src, rb, idx, b, e, dst, pf);                     \
        return;                                                                \
    }
#else
#define RL_GATHER_CACHED_X86(SFX)
#endif
RL_GATHER_CACHED(rl_gather_cached_i32, int32_t, i32)
RL_GATHER_CACHED(rl_gather_cached_i64, int64_t, i64)

#endif  /* READERLIB_RL_GATHER_H */
