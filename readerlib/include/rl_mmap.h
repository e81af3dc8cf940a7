/* Blocks holding file bytes the reader owns (readers map nothing).
 *
 * The name is historical: RecordIO and TFRecord readers used to hand out
 * pointers into a read-only mapping of the file, which turned a file
 * truncated while being read into SIGBUS and let a same-size rewrite change
 * bytes after their checksum was checked.  Every chunk (or big record) is now
 * read with pread(2) into one of these blocks and checked there.  (The one
 * place a file may be mapped again is the optional mmap mode of deferred
 * records, include/rl_mapped.h, behind its SIGBUS guard.) */
#ifndef READERLIB_RL_MMAP_H
#define READERLIB_RL_MMAP_H
#include <sys/mman.h>
#include <unistd.h>
#include "rl_core.h"

/* Drop the whole pages inside [p, p + n) from this process. */
static void rl_drop_pages(const char *p, int64_t n) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = ((uintptr_t)p + page - 1) & ~(page - 1);
    uintptr_t hi = ((uintptr_t)p + (uintptr_t)n) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* A big record was copied out: its pages can go now, not when the whole
 * chunk is released (a shuffle keeps a chunk alive until its last record
 * leaves the buffer, which for big records means most of the file). */
static void rl_chunkview_consumed(rl_block *b, const char *p, int64_t n) {
    (void)b;
    rl_drop_pages(p, n);
}

/* ------------------------------------------------------------ file blocks
 * What a reader hands out is read with pread(2) into memory the block owns,
 * then checked there: the bytes checked are the bytes handed out, whatever
 * happens to the file afterwards.  A file truncated while it is read gives a
 * short read (a clear "the file shrank" error), never SIGBUS as a mapping
 * would; a file rewritten in place cannot change records already checked.
 *
 * Buffers come from malloc (see rl_fb_alloc for why not page-aligned or
 * mmap'ed).  A consumed big record may have the whole pages strictly inside
 * it dropped (MADV_DONTNEED: private anonymous pages come back as zeros),
 * which never reaches the allocator's headers outside the block; that keeps
 * `low_memory` readers' resident memory bounded as over a mapping.  Page-
 * aligned RecordIO chunks are read one block per record instead and need no
 * dropping. */
#include <errno.h>

/* Released buffers are recycled through a bounded pool (per extension
 * module, like rl_core.h's): a fresh allocation is faulted in and
 * zero-filled page by page, which costs more than the pread that fills it.
 * A buffer some pages of which were dropped (low_memory) refaults those.
 * Sized for big records one block each: a batch of 256 x 64 KiB lets 256
 * blocks go at once and the reader then reads 256 more (a pool of 32 left
 * ~10% of the time in page faults and clearing fresh pages, perf). */
#define RL_FB_SLOTS 512
#define RL_FB_MAX_BYTES ((int64_t)32 << 20)

/* Plain malloc, measured on a shuffle over 64 KiB records (one block each):
 * one mmap + munmap per block (even MAP_POPULATE'd) read 3-4x slower than
 * heap blocks, which glibc hands out again without faulting them in, and
 * page-aligned heap blocks (posix_memalign) left up to a page of fragments
 * per live block (peak RSS 752 MB against malloc's 706 MB; the old mapping:
 * 715 MB with low_memory=True, 1963 MB without). */
static void rl_fb_free(void *p, int64_t cap) {
    (void)cap;
    free(p);
}

static void *rl_fb_alloc(int64_t cap) {
    return malloc((size_t)cap);
}
static void *rl_fb_buf[RL_FB_SLOTS];
static int64_t rl_fb_cap[RL_FB_SLOTS];
static int rl_fb_n = 0;
static int64_t rl_fb_bytes = 0;
static int rl_fb_lock_word = 0;

static inline void rl_fb_lock(void) {
    while (__atomic_exchange_n(&rl_fb_lock_word, 1, __ATOMIC_ACQUIRE)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}
static inline void rl_fb_unlock(void) { __atomic_store_n(&rl_fb_lock_word, 0, __ATOMIC_RELEASE); }

/* File blocks alive in this extension (a test hook: close() must let go of
 * every block a reader or an interrupted batch held). */
static int64_t rl_fb_live = 0;

static void rl_fileblock_release(rl_block *b) {
    int64_t cap = b->aux;
    __atomic_sub_fetch(&rl_fb_live, 1, __ATOMIC_RELAXED);
    rl_fb_lock();
    if (rl_fb_n < RL_FB_SLOTS && rl_fb_bytes + cap <= RL_FB_MAX_BYTES) {
        rl_fb_buf[rl_fb_n] = b->ctx;
        rl_fb_cap[rl_fb_n] = cap;
        rl_fb_n++;
        rl_fb_bytes += cap;
        rl_fb_unlock();
        free(b);
        return;
    }
    rl_fb_unlock();
    rl_fb_free(b->ctx, cap);
    free(b);
}

/* A pooled buffer of at least cap bytes (the smallest that fits, and not
 * more than twice cap), or NULL; *got_cap receives its capacity. */
static void *rl_fb_take(int64_t cap, int64_t *got_cap) {
    int i, best = -1;
    void *p = NULL;
    rl_fb_lock();
    for (i = rl_fb_n - 1; i >= 0; i--) {          /* newest first: the hottest in cache */
        if (rl_fb_cap[i] == cap) { best = i; break; }
        if (rl_fb_cap[i] >= cap && rl_fb_cap[i] <= 2 * cap + 65536 &&
            (best < 0 || rl_fb_cap[i] < rl_fb_cap[best])) best = i;
    }
    if (best >= 0) {
        p = rl_fb_buf[best];
        *got_cap = rl_fb_cap[best];
        rl_fb_bytes -= rl_fb_cap[best];
        rl_fb_n--;
        rl_fb_buf[best] = rl_fb_buf[rl_fb_n];
        rl_fb_cap[best] = rl_fb_cap[rl_fb_n];
    }
    rl_fb_unlock();
    return p;
}

/* An uninitialised block of `size` bytes for the file bytes at file_off
 * (its capacity is rounded up to whole pages, so pooled buffers fit many
 * sizes).  drop_pages: 0/1 none, 2 or 3 drop each big record's interior
 * pages once consumed (inward rounding only: the buffer is not page-aligned). */
static rl_block *rl_fileblock_new(int64_t file_off, int64_t size, int drop_pages) {
    int64_t page = (int64_t)sysconf(_SC_PAGESIZE);
    int64_t cap = ((size > 0 ? size : 1) + page - 1) & ~(page - 1);
    int64_t got = cap;
    (void)file_off;
    void *p = rl_fb_take(cap, &got);
    if (!p && !(p = rl_fb_alloc(cap))) return NULL;
    rl_block *b = rl_block_wrap((char *)p, size, rl_fileblock_release, p, got);
    if (!b) { rl_fb_free(p, got); return NULL; }
    if (drop_pages == 2 || drop_pages == 3) b->consumed = rl_chunkview_consumed;
    __atomic_add_fetch(&rl_fb_live, 1, __ATOMIC_RELAXED);
    return b;
}

/* Read n bytes at off into dst: returns the bytes read (fewer at the end of
 * the file), or -1 with errno set. */
static inline int64_t rl_fileblocks_live(void) {
    return __atomic_load_n(&rl_fb_live, __ATOMIC_RELAXED);
}

static inline int64_t rl_pread_full(int fd, char *dst, int64_t n, int64_t off) {
    int64_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, dst + got, (size_t)(n - got), (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        got += r;
    }
    return got;
}

/* Read na bytes into a then nb bytes into b, from off (one preadv; a short
 * first read is finished with pread).  Returns the bytes read, or -1. */
#include <sys/uio.h>
static inline int64_t rl_pread2(int fd, char *a, int64_t na, char *b, int64_t nb, int64_t off) {
    struct iovec iov[2];
    ssize_t r;
    iov[0].iov_base = a; iov[0].iov_len = (size_t)na;
    iov[1].iov_base = b; iov[1].iov_len = (size_t)nb;
    do { r = preadv(fd, iov, 2, (off_t)off); } while (r < 0 && errno == EINTR);
    if (r < 0) return -1;
    if (r == na + nb || r == 0) return r;
    if (r < na) {
        int64_t g = rl_pread_full(fd, a + r, na - r, off + r);
        if (g < 0) return -1;
        if (r + g < na) return r + g;
        r = na;
    }
    int64_t g = rl_pread_full(fd, b + (r - na), nb - (r - na), off + r);
    if (g < 0) return -1;
    return r + g;
}
/* Read into each iovec in turn from off (short reads resumed): the bytes
 * read (fewer at the end of the file), or -1 with errno set.  Modifies iov. */
typedef struct iovec rl_iov;
static inline int64_t rl_preadv_full(int fd, struct iovec *iov, int cnt, int64_t off) {
    int64_t got = 0;
    while (cnt > 0 && iov->iov_len == 0) { iov++; cnt--; }
    while (cnt > 0) {
        ssize_t r = preadv(fd, iov, cnt > 1024 ? 1024 : cnt, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        got += r;
        while (cnt > 0 && (size_t)r >= iov->iov_len) { r -= (ssize_t)iov->iov_len; iov++; cnt--; }
        if (cnt > 0 && r > 0) { iov->iov_base = (char *)iov->iov_base + r; iov->iov_len -= (size_t)r; }
    }
    return got;
}

/* 1 if the n bytes at p are all zero (padding that the format requires zero). */
static inline int rl_all_zero(const char *p, int64_t n) {
    static const char zeros[256];
    while (n > 0) {
        int64_t k = n < 256 ? n : 256;
        if (memcmp(p, zeros, (size_t)k) != 0) return 0;
        p += k;
        n -= k;
    }
    return 1;
}
#endif
