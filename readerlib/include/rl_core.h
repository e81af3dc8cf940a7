/* rl_core.h -- the C core shared by readerlib's compiled modules.
 *
 * Design:
 *   - rl_block: a reference-counted owner of memory (a decoded chunk, a slice
 *     of a memory-mapped file, a batch).  Records point into blocks; a reader
 *     that wants to keep a record past the producer's next call takes a
 *     reference.  Counts are atomic because blocks cross threads (prefetch).
 *   - rl_record: (block, data, size) -- one serialized instance or one batch.
 *   - CRC-32C (Castagnoli): SSE4.2 `crc32` instruction, three interleaved
 *     streams combined with precomputed shift tables (Mark Adler's method),
 *     with a slicing-by-8 software fallback chosen at run time.  CRC-32C
 *     detects every burst error up to 32 bits, so any single corrupted byte.
 *   - xoshiro256** seeded by splitmix64, Lemire's unbiased bounded draw.
 *
 * State exists once per process.  The CRC tables and the block pool live in
 * one rl_core_state owned by the extension readerlib._core (it defines
 * RL_CORE_OWNER before including this header); every other module holds only
 * a pointer to it, set by rl_core_import() at module init (a capsule, NumPy's
 * PyArray_API way: extensions are loaded RTLD_LOCAL, so a plain `extern`
 * would not be shared).  The code stays `static inline` here -- block
 * incref/decref, the pool's fast path and the hardware CRC loop are inlined
 * into each caller -- but it reads and writes the one state through that
 * pointer (the names below, rl_pool, rl_crc32c_table, ..., are macros over it).
 */
#ifndef READERLIB_RL_CORE_H
#define READERLIB_RL_CORE_H

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>


/* ------------------------------------------------------------------ state */
#define RL_POOL_SLOTS 4
#define RL_POOL_MIN_BYTES (1 << 20)
#define RL_POOL_MAX_BYTES ((int64_t)64 << 20)

typedef struct rl_block rl_block;
typedef struct {
    uint32_t crc_table[8][256];    /* slicing-by-8 */
    uint32_t crc_long[4][256];     /* shift operators for the 3-stream hw loop */
    uint32_t crc_short[4][256];
    uint32_t crc_pow2[40][32];     /* crc_pow2[k]: append 2^k zero bytes */
    int crc_hw;                    /* 1: SSE4.2 crc32 instruction */
    rl_block *pool[RL_POOL_SLOTS];
    int pool_n;
    int64_t pool_bytes;
    int pool_lock_word;
    int crc_fold;                  /* 1: AVX-512 VPCLMULQDQ folding for long inputs (rl_crc32c_fold_raw) */
} rl_core_state;

#define RL_CORE_CAPSULE "readerlib._core._C_CORE"
static rl_core_state *rl_core = NULL;

#define rl_crc32c_table (rl_core->crc_table)
#define rl_crc32c_long (rl_core->crc_long)
#define rl_crc32c_short (rl_core->crc_short)
#define rl_crc32c_pow2 (rl_core->crc_pow2)
#define rl_crc32c_hw (rl_core->crc_hw)
#define rl_crc32c_fold (rl_core->crc_fold)
#define rl_pool (rl_core->pool)
#define rl_pool_n (rl_core->pool_n)
#define rl_pool_bytes (rl_core->pool_bytes)
#define rl_pool_lock_word (rl_core->pool_lock_word)

#ifndef RL_CORE_OWNER
/* Call once, under the GIL, at module init (before anything below): 0 or -1
 * with a Python exception set. */
static int rl_core_import(void) {
    if (rl_core) return 0;
    rl_core = (rl_core_state *)PyCapsule_Import(RL_CORE_CAPSULE, 0);
    return rl_core ? 0 : -1;
}
#endif

/* ------------------------------------------------------------------ blocks */
struct rl_block {
    int64_t refcnt;
    void (*release)(rl_block *self);   /* called once when refcnt hits 0 */
    /* optional: a final consumer copied [p, p + n) out of this block and will
     * not read it again (memory-mapped chunks drop those pages early) */
    void (*consumed)(rl_block *self, const char *p, int64_t n);
    char *data;
    int64_t size;
    void *ctx;                         /* owner-specific (mapping, ...) */
    int64_t aux;                       /* owner-specific */
};

static inline void rl_block_incref(rl_block *b) {
    if (b) __atomic_add_fetch(&b->refcnt, 1, __ATOMIC_RELAXED);
}

static inline void rl_block_decref(rl_block *b) {
    if (b && __atomic_sub_fetch(&b->refcnt, 1, __ATOMIC_ACQ_REL) == 0) b->release(b);
}

static void rl_block_free_malloced(rl_block *b) {
    free(b->data);
    free(b);
}

/* Large blocks (batches of big records, inflated chunks) are recycled through
 * a small pool instead of going back to the allocator: a fresh multi-MB
 * allocation is mmap'ed and zero-filled page by page, which costs about as
 * much as the copy that fills it.  The pool is bounded (slots and bytes). */

static inline void rl_pool_lock(void) {
    while (__atomic_exchange_n(&rl_pool_lock_word, 1, __ATOMIC_ACQUIRE)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}
static inline void rl_pool_unlock(void) { __atomic_store_n(&rl_pool_lock_word, 0, __ATOMIC_RELEASE); }

static void rl_block_release_pooled(rl_block *b) {
    int64_t cap = b->aux;
    rl_pool_lock();
    if (rl_pool_n < RL_POOL_SLOTS && rl_pool_bytes + cap <= RL_POOL_MAX_BYTES) {
        rl_pool[rl_pool_n++] = b;
        rl_pool_bytes += cap;
        rl_pool_unlock();
        return;
    }
    rl_pool_unlock();
    free(b->data);
    free(b);
}

static inline rl_block *rl_pool_take(int64_t size) {
    rl_block *b = NULL;
    rl_pool_lock();
    for (int i = 0; i < rl_pool_n; i++) {
        int64_t cap = rl_pool[i]->aux;
        if (cap >= size && cap - size <= size / 2) {
            b = rl_pool[i];
            rl_pool[i] = rl_pool[--rl_pool_n];
            rl_pool_bytes -= cap;
            break;
        }
    }
    rl_pool_unlock();
    return b;
}

/* A block owning `size` bytes of heap memory (64-byte aligned), refcnt 1. */
static inline rl_block *rl_block_new(int64_t size) {
    rl_block *b;
    if (size >= RL_POOL_MIN_BYTES && (b = rl_pool_take(size)) != NULL) {
        b->refcnt = 1;
        b->size = size;
        return b;
    }
    b = (rl_block *)malloc(sizeof(rl_block));
    if (!b) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, 64, size > 0 ? (size_t)size : 64) != 0) { free(b); return NULL; }
    b->refcnt = 1;
    b->consumed = NULL;
    b->release = size >= RL_POOL_MIN_BYTES ? rl_block_release_pooled : rl_block_free_malloced;
    b->data = (char *)p;
    b->size = size;
    b->ctx = NULL;
    b->aux = size;          /* capacity */
    return b;
}

static void rl_block_release_static(rl_block *b) { free(b); }

/* A block over memory owned elsewhere, released by `release` (refcnt 1). */
static inline rl_block *rl_block_wrap(char *data, int64_t size, void (*release)(rl_block *),
                                      void *ctx, int64_t aux) {
    rl_block *b = (rl_block *)malloc(sizeof(rl_block));
    if (!b) return NULL;
    b->refcnt = 1;
    b->consumed = NULL;
    b->release = release;
    b->data = data;
    b->size = size;
    b->ctx = ctx;
    b->aux = aux;
    return b;
}

/* A block over memory kept alive by a Python object. */
static inline rl_block *rl_block_new_static(char *data, int64_t size) {
    return rl_block_wrap(data, size, rl_block_release_static, NULL, 0);
}

typedef struct {
    rl_block *block;
    const char *data;
    int64_t size;
} rl_record;

/* Records at least this big tell their block when they have been copied out. */
#define RL_CONSUMED_MIN (32 * 1024)

static inline void rl_record_consumed(const rl_record *r) {
    if (r->size >= RL_CONSUMED_MIN && r->block->consumed)
        r->block->consumed(r->block, r->data, r->size);
}

/* --------------------------------------------------------- little endian */
static inline uint32_t rl_load_u32(const char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rl_load_u64(const char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline int64_t rl_load_i64(const char *p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline void rl_store_u32(char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void rl_store_u64(char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void rl_store_i64(char *p, int64_t v) { memcpy(p, &v, 8); }

/* --------------------------------------------------------------- copying */
/* Copies into a batch that will not be read again before it leaves the chain
 * skip the cache: streaming stores avoid reading the destination lines in
 * (read-for-ownership), so a DRAM-bound copy moves 2 bytes per byte instead
 * of 3.  Call rl_copy_fence() before the batch is handed out. */
#define RL_STREAM_MIN 16384
#if defined(__x86_64__)
#include <emmintrin.h>
static inline void rl_copy_big(char *dst, const char *src, size_t n) {
    if (n < RL_STREAM_MIN) { memcpy(dst, src, n); return; }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, n - i);
}
static inline void rl_copy_fence(void) { _mm_sfence(); }
#else
static inline void rl_copy_big(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
static inline void rl_copy_fence(void) {}
#endif

/* ------------------------------------------------------------------ CRC32C */
#define RL_CRC32C_POLY 0x82f63b78u
#define RL_CRC_LONG 8192
#define RL_CRC_SHORT 256

static uint32_t rl_gf2_matrix_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static inline uint32_t rl_crc32c_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^
           zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

#ifdef RL_CORE_OWNER
static void rl_gf2_matrix_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = rl_gf2_matrix_times(mat, mat[n]);
}

/* Operator that appends `len` (a power of two) zero bytes to a raw CRC. */
static void rl_crc32c_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = RL_CRC32C_POLY;
    for (int n = 1; n < 32; n++) { odd[n] = row; row <<= 1; }
    rl_gf2_matrix_square(even, odd);   /* 2 zero bits */
    rl_gf2_matrix_square(odd, even);   /* 4 zero bits */
    do {
        rl_gf2_matrix_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        rl_gf2_matrix_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void rl_crc32c_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    rl_crc32c_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = rl_gf2_matrix_times(op, n);
        zeros[1][n] = rl_gf2_matrix_times(op, n << 8);
        zeros[2][n] = rl_gf2_matrix_times(op, n << 16);
        zeros[3][n] = rl_gf2_matrix_times(op, n << 24);
    }
}

/* Fill the tables of the one state (readerlib._core, at its init). */
static void rl_core_state_init(rl_core_state *st) {
    rl_core = st;
    rl_crc32c_zeros_op(rl_crc32c_pow2[0], 1);
    for (int k = 1; k < 40; k++) rl_gf2_matrix_square(rl_crc32c_pow2[k], rl_crc32c_pow2[k - 1]);
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = n;
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ RL_CRC32C_POLY : crc >> 1;
        rl_crc32c_table[0][n] = crc;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t crc = rl_crc32c_table[0][n];
        for (int k = 1; k < 8; k++) {
            crc = rl_crc32c_table[0][crc & 0xff] ^ (crc >> 8);
            rl_crc32c_table[k][n] = crc;
        }
    }
    rl_crc32c_zeros(rl_crc32c_long, RL_CRC_LONG);
    rl_crc32c_zeros(rl_crc32c_short, RL_CRC_SHORT);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    rl_crc32c_hw = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#else
    rl_crc32c_hw = 0;
#endif
    if (getenv("READERLIB_NO_HW_CRC")) rl_crc32c_hw = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    rl_crc32c_fold = rl_crc32c_hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
#endif
    {
        /* "0", "false", "off" or "no" (any case): the crc32 streams only (the A/B) */
        const char *f = getenv("READERLIB_CRC_FOLD");
        if (f && (f[0] == '0' || f[0] == 'f' || f[0] == 'F' || f[0] == 'n' || f[0] == 'N' ||
                  ((f[0] == 'o' || f[0] == 'O') && (f[1] == 'f' || f[1] == 'F'))))
            rl_crc32c_fold = 0;
    }
}
#endif

/* Slicing-by-8 software CRC-32C (raw register in and out, no inversion). */
static uint32_t rl_crc32c_sw_raw(uint32_t crc, const unsigned char *next, size_t len) {
    while (len && ((uintptr_t)next & 7) != 0) {
        crc = rl_crc32c_table[0][(crc ^ *next++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t word;
        memcpy(&word, next, 8);
        word ^= crc;
        crc = rl_crc32c_table[7][word & 0xff] ^ rl_crc32c_table[6][(word >> 8) & 0xff] ^
              rl_crc32c_table[5][(word >> 16) & 0xff] ^ rl_crc32c_table[4][(word >> 24) & 0xff] ^
              rl_crc32c_table[3][(word >> 32) & 0xff] ^ rl_crc32c_table[2][(word >> 40) & 0xff] ^
              rl_crc32c_table[1][(word >> 48) & 0xff] ^ rl_crc32c_table[0][word >> 56];
        next += 8;
        len -= 8;
    }
    while (len) {
        crc = rl_crc32c_table[0][(crc ^ *next++) & 0xff] ^ (crc >> 8);
        len--;
    }
    return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
/* clang 14 and later keep the crc32 instruction apart from sse4.2 (a target
 * of "sse4.2" alone refuses _mm_crc32_*); gcc has it in sse4.2 */
#if defined(__clang__) && __clang_major__ >= 14
#define RL_SSE42_TARGET "sse4.2,crc32"
#else
#define RL_SSE42_TARGET "sse4.2"
#endif
/* Three interleaved crc32 streams over blocks of `block` bytes, combined by
 * shifting with the precomputed zeros operator for `block` bytes. */
__attribute__((target(RL_SSE42_TARGET)))
static inline uint64_t rl_crc32c_hw_streams(uint64_t crc0, const unsigned char **pnext, size_t *plen,
                                            size_t block, uint32_t zeros[][256]) {
    const unsigned char *next = *pnext;
    size_t len = *plen;
    while (len >= block * 3) {
        const unsigned char *end = next + block;
        uint64_t crc1 = 0, crc2 = 0;
        do {
            uint64_t a, b, c;
            memcpy(&a, next, 8); memcpy(&b, next + block, 8); memcpy(&c, next + 2 * block, 8);
            crc0 = _mm_crc32_u64(crc0, a);
            crc1 = _mm_crc32_u64(crc1, b);
            crc2 = _mm_crc32_u64(crc2, c);
            next += 8;
        } while (next < end);
        crc0 = rl_crc32c_shift(zeros, (uint32_t)crc0) ^ crc1;
        crc0 = rl_crc32c_shift(zeros, (uint32_t)crc0) ^ crc2;
        next += block * 2;
        len -= block * 3;
    }
    *pnext = next;
    *plen = len;
    return crc0;
}

/* Folding with carry-less multiplies (AVX-512 VPCLMULQDQ), Intel's "Fast CRC
 * Computation for Generic Polynomials Using PCLMULQDQ" in the bit-reflected
 * form: 16 lanes of 128 bits (four zmm accumulators, 256 bytes a step) are each
 * multiplied forward by x^2048 (mod P) and XORed into the next 256 bytes; at
 * the end the lanes are folded into one 128-bit value V with the message's
 * remainder, and the crc32 instruction over V's 16 bytes (from 0) gives the
 * raw CRC register.  The crc32 instruction's throughput (one 8-byte step a
 * cycle) bounds the three-stream loop at ~16-20 GB/s from cache; the folding
 * runs at the loads' speed, which lets a fused CRC + copy from memory run at
 * the copy's speed.
 *
 * Constants for a fold over D bits (a 128-bit lane whose low quadword holds
 * the earlier bytes): lo = reflect32(x^(D+63) mod P) << 32 multiplies the low
 * quadword, hi = reflect32(x^(D-1) mod P) << 32 the high one (derived and
 * checked against the bitwise CRC in tests/formats/test_crc_fold.py). */
#define RL_CRC_FOLD_MIN 512       /* shorter inputs: the crc32 streams */
#define RL_FOLD_K(pair) RL_FOLD_K_(pair)   /* (expands the pair's macro first) */
#define RL_FOLD_K_(D_LO, D_HI) _mm512_set_epi64((long long)(D_HI), (long long)(D_LO), (long long)(D_HI), \
                                               (long long)(D_LO), (long long)(D_HI), (long long)(D_LO), \
                                               (long long)(D_HI), (long long)(D_LO))
#define RL_FOLD_2048 0xe9a5d8be00000000ull, 0x1426a81500000000ull
#define RL_FOLD_1536 0x7ccbbbf200000000ull, 0x31c9460800000000ull
#define RL_FOLD_1024 0x6577b24500000000ull, 0x7417153f00000000ull
#define RL_FOLD_512 0x1c19243b00000000ull, 0x75bba45b00000000ull
#define RL_FOLD_384 0xa46ef4aa00000000ull, 0x6051243f00000000ull
#define RL_FOLD_256 0x33ccbbbc00000000ull, 0xa2158b3400000000ull
#define RL_FOLD_128 0x3743f7bd00000000ull, 0x3171d43000000000ull
#include <immintrin.h>

#define RL_FOLD_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul," RL_SSE42_TARGET)))
RL_FOLD_TARGET static inline __m512i rl_fold512(__m512i v, __m512i k, __m512i next) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(v, k, 0x00),
                                     _mm512_clmulepi64_epi128(v, k, 0x11), next, 0x96);
}
RL_FOLD_TARGET static inline __m128i rl_fold128(__m128i v, uint64_t lo, uint64_t hi, __m128i next) {
    __m128i k = _mm_set_epi64x((long long)hi, (long long)lo);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(v, k, 0x00), _mm_clmulepi64_si128(v, k, 0x11)),
                         next);
}
#define RL_FOLD_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define RL_FOLD_STORE(store, p, v) do { \
        if ((store) == 2) _mm512_stream_si512((void *)(p), (v)); \
        else if ((store) == 1) _mm512_storeu_si512((void *)(p), (v)); \
    } while (0)
/* 256 bytes of s into four registers, stored to d as `store` says */
#define RL_FOLD_TAKE256(store, s, d, r0, r1, r2, r3) do { \
        r0 = RL_FOLD_LOAD(s); r1 = RL_FOLD_LOAD((s) + 64); \
        r2 = RL_FOLD_LOAD((s) + 128); r3 = RL_FOLD_LOAD((s) + 192); \
        RL_FOLD_STORE(store, d, r0); RL_FOLD_STORE(store, (d) + 64, r1); \
        RL_FOLD_STORE(store, (d) + 128, r2); RL_FOLD_STORE(store, (d) + 192, r3); \
    } while (0)

/* The raw CRC register after the first (n & ~255) bytes of s (n >= 256),
 * continuing from the raw register `crc`; `store` 1 also copies those bytes
 * to d (plain stores), 2 with streaming stores (d 64-byte aligned; fence with
 * rl_cc_fence), 0 copies nothing (d unused).  The bytes fed to the CRC are
 * the registers stored.  Advances *ps, *pd (when storing) and *pn. */
RL_FOLD_TARGET __attribute__((always_inline))
static inline uint32_t rl_crc32c_fold_raw(uint32_t crc, char **pd, const char **ps, size_t *pn, int store) {
    const char *s = *ps;
    char *d = *pd;
    size_t n = *pn;
    const __m512i k2048 = RL_FOLD_K(RL_FOLD_2048);
    __m512i x0, x1, x2, x3, y0, y1, y2, y3;
    RL_FOLD_TAKE256(store, s, d, x0, x1, x2, x3);
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    s += 256; n -= 256;
    if (store) d += 256;                /* (d is NULL when not storing: no arithmetic on it) */
    while (n >= 256) {
        RL_FOLD_TAKE256(store, s, d, y0, y1, y2, y3);
        x0 = rl_fold512(x0, k2048, y0);
        x1 = rl_fold512(x1, k2048, y1);
        x2 = rl_fold512(x2, k2048, y2);
        x3 = rl_fold512(x3, k2048, y3);
        s += 256; n -= 256;
        if (store) d += 256;
    }
    /* x0 x^1536 + x1 x^1024 + x2 x^512 + x3, then its four lanes into one */
    x3 = rl_fold512(x2, RL_FOLD_K(RL_FOLD_512), x3);
    x3 = rl_fold512(x1, RL_FOLD_K(RL_FOLD_1024), x3);
    x3 = rl_fold512(x0, RL_FOLD_K(RL_FOLD_1536), x3);
    __m128i v = _mm512_extracti32x4_epi32(x3, 3);
    v = rl_fold128(_mm512_extracti32x4_epi32(x3, 2), RL_FOLD_128, v);
    v = rl_fold128(_mm512_extracti32x4_epi32(x3, 1), RL_FOLD_256, v);
    v = rl_fold128(_mm512_castsi512_si128(x3), RL_FOLD_384, v);
    uint64_t r = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(v));
    r = _mm_crc32_u64(r, (uint64_t)_mm_extract_epi64(v, 1));
    *ps = s;
    if (store) *pd = d;
    *pn = n;
    return (uint32_t)r;
}

RL_FOLD_TARGET __attribute__((noinline))
static uint32_t rl_crc32c_fold_only(uint32_t crc, const unsigned char **pnext, size_t *plen) {
    char *unused = NULL;
    return rl_crc32c_fold_raw(crc, &unused, (const char **)pnext, plen, 0);
}

__attribute__((target(RL_SSE42_TARGET)))
static uint32_t rl_crc32c_hw_raw(uint32_t crc, const unsigned char *next, size_t len) {
    uint64_t crc0 = crc;
    if (rl_crc32c_fold && len >= RL_CRC_FOLD_MIN) crc0 = rl_crc32c_fold_only(crc, &next, &len);
    while (len && ((uintptr_t)next & 7) != 0) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    crc0 = rl_crc32c_hw_streams(crc0, &next, &len, RL_CRC_LONG, rl_crc32c_long);
    crc0 = rl_crc32c_hw_streams(crc0, &next, &len, RL_CRC_SHORT, rl_crc32c_short);
    while (len >= 8) {
        uint64_t a;
        memcpy(&a, next, 8);
        crc0 = _mm_crc32_u64(crc0, a);
        next += 8;
        len -= 8;
    }
    while (len) {
        crc0 = _mm_crc32_u8((uint32_t)crc0, *next++);
        len--;
    }
    return (uint32_t)crc0;
}
#endif

/* CRC-32C of buf, continuing from `crc` (0 to start), zlib-style conditioning. */
static inline uint32_t rl_crc32c(uint32_t crc, const void *buf, size_t len) {
    const unsigned char *p = (const unsigned char *)buf;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (rl_crc32c_hw == 1) return ~rl_crc32c_hw_raw(~crc, p, len);
#endif
    return ~rl_crc32c_sw_raw(~crc, p, len);
}

/* CRC of A ++ B from crc(A), crc(B) and len(B) (zlib's crc32_combine, with a
 * table of operators for power-of-two lengths: ~1 us).  Lets independent
 * threads checksum the parts of a chunk. */
static inline uint32_t rl_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
    for (int k = 0; len2 && k < 40; k++, len2 >>= 1)
        if (len2 & 1) crc1 = rl_gf2_matrix_times(rl_crc32c_pow2[k], crc1);
    return crc1 ^ crc2;
}

/* TFRecord's masked CRC. */
static inline uint32_t rl_crc32c_mask(uint32_t crc) {
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* Its inverse: the CRC a masked one was made from. */
static inline uint32_t rl_crc32c_unmask(uint32_t masked) {
    uint32_t r = masked - 0xa282ead8u;
    return (r >> 17) | (r << 15);
}

/* ------------------------------------------------------------------ random */
typedef struct { uint64_t s[4]; } rl_rng;

static inline uint64_t rl_splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Seed from (seed, stream): distinct streams give independent sequences. */
static inline void rl_rng_seed(rl_rng *r, uint64_t seed, uint64_t stream) {
    uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull);
    for (int i = 0; i < 4; i++) r->s[i] = rl_splitmix64(&x);
}

static inline uint64_t rl_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t rl_rng_next(rl_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rl_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rl_rotl(s[3], 45);
    return result;
}

/* Uniform integer in [0, n), n >= 1, unbiased (Lemire 2019). */
static inline uint64_t rl_rng_below(rl_rng *r, uint64_t n) {
    uint64_t x = rl_rng_next(r);
    __uint128_t m = (__uint128_t)x * n;
    uint64_t l = (uint64_t)m;
    if (l < n) {
        uint64_t t = -n % n;
        while (l < t) {
            x = rl_rng_next(r);
            m = (__uint128_t)x * n;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* Stateless hash of (seed, a, b): for per-position randomness. */
static inline uint64_t rl_hash3(uint64_t seed, uint64_t a, uint64_t b) {
    uint64_t x = seed ^ (a * 0x9e3779b97f4a7c15ull);
    uint64_t h = rl_splitmix64(&x);
    x = h ^ (b * 0xc2b2ae3d27d4eb4full);
    return rl_splitmix64(&x);
}

#endif
