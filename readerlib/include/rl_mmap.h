/* Blocks over a memory-mapped file: one for the mapping, one per chunk view.
 * A chunk view holds a reference on the mapping, so the mapping outlives the
 * reader when downstream readers still hold records.  When a chunk view is
 * released its interior pages are dropped from this process (MADV_DONTNEED
 * on a read-only private file mapping refaults from the page cache), which
 * keeps resident memory bounded by the chunks still referenced. */
#ifndef READERLIB_RL_MMAP_H
#define READERLIB_RL_MMAP_H
#include <sys/mman.h>
#include <unistd.h>
#include "rl_core.h"

static void rl_mapping_release(rl_block *b) {
    if (b->data && b->size > 0) munmap(b->data, (size_t)b->size);
    free(b);
}

static inline rl_block *rl_mapping_new(char *data, int64_t size) {
    return rl_block_wrap(data, size, rl_mapping_release, NULL, 0);
}

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

/* The same for page-aligned records (each starts a page and owns its last,
 * partial page up to the next record's padding): every page can go. */
static void rl_chunkview_consumed_aligned(rl_block *b, const char *p, int64_t n) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    (void)b;
    uintptr_t lo = (uintptr_t)p & ~(page - 1);
    uintptr_t hi = ((uintptr_t)p + (uintptr_t)n + page - 1) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static void rl_chunkview_release(rl_block *b) {
    rl_block *m = (rl_block *)b->ctx;
    if (b->aux) rl_drop_pages(b->data, b->size);
    rl_block_decref(m);
    free(b);
}

static inline rl_block *rl_chunkview_new(rl_block *mapping, char *data, int64_t size, int drop_pages) {
    rl_block *b = rl_block_wrap(data, size, rl_chunkview_release, mapping, drop_pages);
    if (b) {
        rl_block_incref(mapping);
        /* 2: drop each big record's interior pages once copied; 3: records are
         * page-aligned, drop all of their pages */
        if (drop_pages == 2) b->consumed = rl_chunkview_consumed;
        else if (drop_pages == 3) b->consumed = rl_chunkview_consumed_aligned;
    }
    return b;
}
#endif
