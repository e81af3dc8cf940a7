/* rl_crccopy.h -- fused CRC-32C + copy: each source byte is loaded once,
 * stored to the destination and fed to the CRC from the same register.
 *
 * The CRC covers the value that was stored, not a second read of the source,
 * so when the source can change under the copy (a shared mapping of a file
 * rewritten in place), the bytes checked are still exactly the bytes copied.
 *
 * AVX-512 VPCLMULQDQ folding for inputs of RL_CRC_FOLD_MIN bytes and more
 * where the CPU has it (rl_core.h's rl_crc32c_fold_raw; READERLIB_CRC_FOLD=0
 * turns it off), then SSE4.2 `crc32` on three interleaved streams (latency 3, throughput 1 a
 * cycle) for the rest, combined with a shift table for the stream length (Mark Adler's
 * method, as rl_core.h's rl_crc32c); a byte-at-a-time table fallback without
 * SSE4.2 (or with READERLIB_NO_HW_CRC set).  It uses rl_core.h's
 * tables (one copy per process, readerlib._core).  Same conditioning as rl_crc32c (zlib style: `crc` in
 * and out are final values, 0 to start): rl_crc32c_copy(0, d, s, n) ==
 * rl_crc32c(0, s, n), and d[0..n) == s[0..n) afterwards.
 *
 * The module must have called rl_core_import() (as every readerlib module does). */
#ifndef READERLIB_RL_CRCCOPY_H
#define READERLIB_RL_CRCCOPY_H
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "rl_core.h"

/* The CRC tables, the shift tables for the stream lengths and the hardware
 * flag are rl_core.h's, owned once per process by readerlib._core. */
#define RL_CC_LONG RL_CRC_LONG
#define RL_CC_SHORT RL_CRC_SHORT
#define rl_cc_table (rl_crc32c_table[0])
#define rl_cc_long rl_crc32c_long
#define rl_cc_short rl_crc32c_short
#define rl_cc_hw rl_crc32c_hw
#define rl_cc_fold_on rl_crc32c_fold
#define rl_cc_shift rl_crc32c_shift

/* Kept for callers: the shared tables are built when readerlib._core loads. */
static inline void rl_cc_init(void) {}

/* Software path: copy and CRC a byte at a time (raw register in and out). */
static uint32_t rl_cc_sw_raw(uint32_t crc, char *dst, const char *src, size_t n) {
    const unsigned char *s = (const unsigned char *)src;
    unsigned char *d = (unsigned char *)dst;
    for (size_t i = 0; i < n; i++) {
        unsigned char v = s[i];
        d[i] = v;
        crc = rl_cc_table[(crc ^ v) & 0xff] ^ (crc >> 8);
    }
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#include <emmintrin.h>
/* RL_CC_STORE: a plain store, or (nt) a streaming one that skips the cache:
 * the destination's lines are not read in first (no read-for-ownership), for
 * a destination that is not read again soon.  Fence with rl_cc_fence(). */
#define RL_CC_STORE(nt, dst, v) do { \
        if (nt) _mm_stream_si64((long long *)(dst), (long long)(v)); else memcpy((dst), &(v), 8); \
    } while (0)
__attribute__((target(RL_SSE42_TARGET)))
static inline uint64_t rl_cc_hw_streams(uint64_t crc0, char **pd, const char **ps, size_t *pn,
                                        size_t block, uint32_t zeros[][256], int nt) {
    char *d = *pd;
    const char *s = *ps;
    size_t n = *pn;
    while (n >= 3 * block) {
        uint64_t crc1 = 0, crc2 = 0;
        for (size_t i = 0; i < block; i += 8) {
            uint64_t a, b, c;
            memcpy(&a, s + i, 8);
            memcpy(&b, s + block + i, 8);
            memcpy(&c, s + 2 * block + i, 8);
            RL_CC_STORE(nt, d + i, a);            /* the stored value is the one checked */
            RL_CC_STORE(nt, d + block + i, b);
            RL_CC_STORE(nt, d + 2 * block + i, c);
            crc0 = _mm_crc32_u64(crc0, a);
            crc1 = _mm_crc32_u64(crc1, b);
            crc2 = _mm_crc32_u64(crc2, c);
        }
        crc0 = rl_cc_shift(zeros, (uint32_t)crc0) ^ crc1;
        crc0 = rl_cc_shift(zeros, (uint32_t)crc0) ^ crc2;
        s += 3 * block;
        d += 3 * block;
        n -= 3 * block;
    }
    *pd = d;
    *ps = s;
    *pn = n;
    return crc0;
}

/* The folding loop (rl_core.h's rl_crc32c_fold_raw) storing what it checks. */
RL_FOLD_TARGET __attribute__((noinline))
static uint32_t rl_cc_fold(uint32_t crc, char **pd, const char **ps, size_t *pn, int nt) {
    return nt ? rl_crc32c_fold_raw(crc, pd, ps, pn, 2) : rl_crc32c_fold_raw(crc, pd, ps, pn, 1);
}

__attribute__((target(RL_SSE42_TARGET)))
static uint32_t rl_cc_hw_raw(uint32_t crc, char *d, const char *s, size_t n, int nt) {
    uint64_t crc0 = crc;
    /* streaming stores need 8-byte-aligned destinations: align d first */
    while (n && ((uintptr_t)d & 7) != 0) {
        unsigned char v = (unsigned char)*s++;
        *d++ = (char)v;
        crc0 = _mm_crc32_u8((uint32_t)crc0, v);
        n--;
    }
    if (rl_cc_fold_on && n >= RL_CRC_FOLD_MIN + 64) {
        /* the zmm streaming store wants a 64-byte aligned destination */
        while (nt && ((uintptr_t)d & 63) != 0) {
            uint64_t a;
            memcpy(&a, s, 8);
            RL_CC_STORE(1, d, a);
            crc0 = _mm_crc32_u64(crc0, a);
            s += 8; d += 8; n -= 8;
        }
        crc0 = rl_cc_fold((uint32_t)crc0, &d, &s, &n, nt);
    }
    if (nt) {
        crc0 = rl_cc_hw_streams(crc0, &d, &s, &n, RL_CC_LONG, rl_cc_long, 1);
        crc0 = rl_cc_hw_streams(crc0, &d, &s, &n, RL_CC_SHORT, rl_cc_short, 1);
    } else {
        crc0 = rl_cc_hw_streams(crc0, &d, &s, &n, RL_CC_LONG, rl_cc_long, 0);
        crc0 = rl_cc_hw_streams(crc0, &d, &s, &n, RL_CC_SHORT, rl_cc_short, 0);
    }
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, s, 8);
        memcpy(d, &a, 8);
        crc0 = _mm_crc32_u64(crc0, a);
        s += 8; d += 8; n -= 8;
    }
    while (n) {
        unsigned char v = (unsigned char)*s++;
        *d++ = (char)v;
        crc0 = _mm_crc32_u8((uint32_t)crc0, v);
        n--;
    }
    return (uint32_t)crc0;
}
#endif

/* Copy n bytes src -> dst (not overlapping) and return the CRC-32C of the
 * bytes stored, continuing from `crc` (0 to start). */
static inline uint32_t rl_crc32c_copy(uint32_t crc, char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (rl_cc_hw == 1) return ~rl_cc_hw_raw(~crc, dst, src, n, 0);
#endif
    return ~rl_cc_sw_raw(~crc, dst, src, n);
}

/* The same with streaming stores (x86-64; plain stores elsewhere): for a
 * destination written once and read later (a record's block, a batch).  Call
 * rl_cc_fence() before another thread may read dst. */
static inline uint32_t rl_crc32c_copy_nt(uint32_t crc, char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (rl_cc_hw == 1) return ~rl_cc_hw_raw(~crc, dst, src, n, 1);
#endif
    return ~rl_cc_sw_raw(~crc, dst, src, n);
}

static inline void rl_cc_fence(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    _mm_sfence();
#endif
}

static inline int rl_cc_uses_hardware(void) { return rl_cc_hw == 1; }
#endif
