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

static void rl_chunkview_release(rl_block *b) {
    rl_block *m = (rl_block *)b->ctx;
    if (b->aux) {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = ((uintptr_t)b->data + page - 1) & ~(page - 1);
        uintptr_t hi = ((uintptr_t)b->data + (uintptr_t)b->size) & ~(page - 1);
        if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    }
    rl_block_decref(m);
    free(b);
}

static inline rl_block *rl_chunkview_new(rl_block *mapping, char *data, int64_t size, int drop_pages) {
    rl_block *b = rl_block_wrap(data, size, rl_chunkview_release, mapping, drop_pages);
    if (b) rl_block_incref(mapping);
    return b;
}
#endif
