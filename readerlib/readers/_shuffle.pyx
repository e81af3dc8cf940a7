# cython: freethreading_compatible=False
"""ShuffleReader: shuffle through a buffer of items (tf.data's algorithm)."""
import base64
import os
import zlib

import numpy as np
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset

from cpython.ref cimport PyObject, Py_INCREF, Py_DECREF

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib._parallel cimport parallel_for, num_threads, threads_for
from readerlib._parallel import threads_enabled as _threads_enabled
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64,
    columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH)
from readerlib.readers._base import _check_positive_int, _check_reader, _check_saved_seed_epoch
from readerlib.errors import DataLossError

rl_core_import()

# Deferred records (include/rl_mapped.h: mapped big records that only the batch
# that asked for them may copy, verifying them) are moved like any other; one
# that would go to another consumer of this shuffle is verified first.  Compaction
# never copies one: a deferred record is alone in its block (bytes == block size).
from readerlib._mapped cimport (
    rl_mapped_import, rl_record_is_deferred, rl_deferred_may_go_out, deferred_verified_copy, RL_DEF_LAYOUT)

rl_mapped_import()

__all__ = ["ShuffleReader"]

# Compaction (see ShuffleReader's design note).  Module-level so that tests can
# force it at a small scale; each ShuffleReader copies them at construction.
cdef bint _COMPACT_ON = True
cdef int64_t _COMPACT_SLACK = 4 << 20       # pinned bytes allowed beyond factor x the buffered payload
cdef double _COMPACT_FACTOR = 1.5
cdef double _COMPACT_FILL = 0.75            # blocks used below this fraction are compacted
DEF COMPACT_MAX_RECORD = 32 * 1024         # records this big are never copied (one per block is not amplified)
DEF ARENA_BYTES = 1 << 20
DEF RING = 65536                           # steps a restore can rewind (items read ahead downstream)
DEF RING_MASK = RING - 1
DEF ANCHOR_SHIFT = 6                       # an RNG anchor every 64 steps
DEF ANCHORS = RING >> ANCHOR_SHIFT


def _compaction_settings(enabled=None, slack_bytes=None, factor=None, fill=None):
    """Test/benchmark hook: the compaction settings new ShuffleReaders take
    (`enabled`; a pass when pinned bytes > `factor` x payload + `slack_bytes`);
    returns the previous ones as a dict."""
    global _COMPACT_ON, _COMPACT_SLACK, _COMPACT_FACTOR, _COMPACT_FILL
    old = {"enabled": bool(_COMPACT_ON), "slack_bytes": int(_COMPACT_SLACK),
           "factor": float(_COMPACT_FACTOR), "fill": float(_COMPACT_FILL)}
    # all checked before any is set
    if fill is not None and not 0.0 < float(fill) <= 1.0:
        raise ValueError(f"fill must be in (0, 1], got {fill}")
    if factor is not None and not float(factor) >= 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    if slack_bytes is not None and int(slack_bytes) < 0:
        raise ValueError(f"slack_bytes must be >= 0, got {slack_bytes}")
    if fill is not None:
        _COMPACT_FILL = float(fill)
    if factor is not None:
        _COMPACT_FACTOR = float(factor)
    if enabled is not None:
        _COMPACT_ON = bool(enabled)
    if slack_bytes is not None:
        _COMPACT_SLACK = int(slack_bytes)
    return old


# Inline small records (see "Inline" in ShuffleReader's design note): module-level
# so that tests and benchmarks can switch it; each ShuffleReader copies them at
# construction.
cdef bint _INLINE_ON = True
cdef int64_t _INLINE_MAX = 256               # the largest cell considered (bytes)
cdef int64_t _INLINE_MIN_PAYLOAD = 256 << 10  # projected buffer payload below which it stays off
cdef int64_t _INLINE_CELL = 0                # > 0: this cell size, not the chosen one (tests)
DEF INLINE_MAX_LIMIT = 4096                 # the largest cell (deferred records are never inlined: _take)
DEF INLINE_PROBES = 16                      # new blocks looked at before giving up on a source
DEF RESTORE_PROBE = 4096                    # a restore's fill from a file decides inlining after these
DEF PEEK_MIN = 4096                         # slots (64 KiB: beyond L1d) above which _draw_ahead peeks further
DEF OUT_BYTES = 16384                       # an output block (the copies handed out); L1-sized


def _inline_settings(enabled=None, max_cell=None, min_payload=None, cell=None):
    """Test/benchmark hook: the inline settings new ShuffleReaders take
    (`enabled`; cells of at most `max_cell` bytes; only when the buffer's
    projected payload is at least `min_payload` bytes; `cell` > 0 forces the
    cell size, 0 lets the shuffle choose); returns the previous ones as a dict."""
    global _INLINE_ON, _INLINE_MAX, _INLINE_MIN_PAYLOAD, _INLINE_CELL
    old = {"enabled": bool(_INLINE_ON), "max_cell": int(_INLINE_MAX),
           "min_payload": int(_INLINE_MIN_PAYLOAD), "cell": int(_INLINE_CELL)}
    if max_cell is not None and not 1 <= int(max_cell) <= INLINE_MAX_LIMIT:
        raise ValueError(f"max_cell must be in [1, {INLINE_MAX_LIMIT}], got {max_cell}")
    if cell is not None and not 0 <= int(cell) <= INLINE_MAX_LIMIT:
        raise ValueError(f"cell must be in [0, {INLINE_MAX_LIMIT}], got {cell}")
    if min_payload is not None and int(min_payload) < 0:
        raise ValueError(f"min_payload must be >= 0, got {min_payload}")
    if enabled is not None:
        _INLINE_ON = bool(enabled)
    if max_cell is not None:
        _INLINE_MAX = int(max_cell)
    if min_payload is not None:
        _INLINE_MIN_PAYLOAD = int(min_payload)
    if cell is not None:
        _INLINE_CELL = int(cell)
    return old


cdef extern from *:
    """
    /* A copy of n bytes (small: a record going into or out of its cell) without
     * a call: two overlapping loads and stores per size class, exact (reads and
     * writes only [0, n)). */
    #if defined(__x86_64__)
    #include <emmintrin.h>
    static inline void rl_shuffle_copy_small(char *d, const char *s, size_t n) {
        if (n > 64) { memcpy(d, s, n); return; }
        if (n >= 32) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + n - 32)), e = _mm_loadu_si128((const __m128i *)(s + n - 16));
            _mm_storeu_si128((__m128i *)d, a); _mm_storeu_si128((__m128i *)(d + 16), b);
            _mm_storeu_si128((__m128i *)(d + n - 32), c); _mm_storeu_si128((__m128i *)(d + n - 16), e);
        } else if (n >= 16) {
            __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + n - 16));
            _mm_storeu_si128((__m128i *)d, a); _mm_storeu_si128((__m128i *)(d + n - 16), b);
        } else if (n >= 8) {
            uint64_t a, b; memcpy(&a, s, 8); memcpy(&b, s + n - 8, 8); memcpy(d, &a, 8); memcpy(d + n - 8, &b, 8);
        } else if (n >= 4) {
            uint32_t a, b; memcpy(&a, s, 4); memcpy(&b, s + n - 4, 4); memcpy(d, &a, 4); memcpy(d + n - 4, &b, 4);
        } else {
            for (size_t i = 0; i < n; i++) d[i] = s[i];
        }
    }
    #else
    static inline void rl_shuffle_copy_small(char *d, const char *s, size_t n) { memcpy(d, s, n); }
    #endif
    /* Nobody but the caller holds b (acquire: whoever let go of it, on any
     * thread, has finished reading it before the caller writes into it). */
    /* Branch hint: the referenced path's code stays straight (the inline
     * path takes a jump; its branch is predicted either way). */
    #define rl_shuffle_rare(x) __builtin_expect(!!(x), 0)
    /* Transparent huge pages for the 2 MiB-aligned interior of [p, p + n),
     * not yet touched (a restore's fresh slots and cells: 16 MB each for a
     * 1M buffer, 4096 page faults each at ~2 us on this VM; 8 with huge
     * pages).  A hint: nothing changes where the system gives none. */
    #include <sys/mman.h>
    static inline void rl_shuffle_hugepages(void *p, size_t n) {
    #ifdef MADV_HUGEPAGE
        const uintptr_t H = (uintptr_t)2 << 20;
        uintptr_t a = ((uintptr_t)p + H - 1) & ~(H - 1), e = ((uintptr_t)p + n) & ~(H - 1);
        if (n >= 4 * H && e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
    #else
        (void)p; (void)n;
    #endif
    }
    /* Fault in the whole pages inside [p, p + n) now, writable, in one call
     * (MADV_POPULATE_WRITE, Linux 5.14): the same zeroed pages as the first
     * writes would fault in one at a time, without a trap each.  A hint:
     * where the kernel has no such advice (EINVAL) nothing happens, and a
     * page it could not populate (no memory) faults in later as before. */
    #include <errno.h>
    #ifndef MADV_POPULATE_WRITE
    #define MADV_POPULATE_WRITE 23
    #endif
    static int rl_shuffle_populate_ok = 1;
    static inline void rl_shuffle_populate(void *p, size_t n) {
        const uintptr_t P = 4096;
        uintptr_t a = ((uintptr_t)p + P - 1) & ~(P - 1), e = ((uintptr_t)p + n) & ~(P - 1);
        if (!__atomic_load_n(&rl_shuffle_populate_ok, __ATOMIC_RELAXED) || e <= a) return;
        if (madvise((void *)a, e - a, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
            __atomic_store_n(&rl_shuffle_populate_ok, 0, __ATOMIC_RELAXED);
    }
    static inline int rl_shuffle_sole(rl_block *b) {
        return __atomic_load_n(&b->refcnt, __ATOMIC_ACQUIRE) == 1;
    }
    """
    void __builtin_prefetch(const void *p, ...) nogil
    void rl_shuffle_copy_small(char *d, const char *s, size_t n) nogil
    bint rl_shuffle_sole(rl_block *b) nogil
    bint rl_shuffle_rare(bint x) nogil
    void rl_shuffle_hugepages(void *p, size_t n) nogil
    void rl_shuffle_populate(void *p, size_t n) nogil


cdef extern from "rl_affinity.h":
    ctypedef struct rl_cpu_mask:
        pass
    bint rl_affinity_leave(int tid, int cpu, rl_cpu_mask *saved) nogil
    void rl_affinity_restore(int tid, const rl_cpu_mask *saved) nogil
    int rl_current_cpu() nogil


def _addressable(reader, bint may_become=False):
    """True when item i of the reader's epoch is its record c_read_at(i): a buffer
    shuffle over it restores by taking its buffer's records by index.  A TFRecord
    file without its chunk table (no sidecar, not scanned yet) is not: finding
    out would scan the file.  may_become: whether it can be later (construction:
    whether to keep positions at all)."""
    from readerlib.readers._sources import _ChunkedSource
    from readerlib.readers._global_shuffle import GlobalShuffleReader
    from readerlib.readers._map import MapReader
    if isinstance(reader, MapReader):       # item i is fn(its source's item i): MapReader.c_read_at
        return _addressable(reader.reader, may_become)
    if isinstance(reader, GlobalShuffleReader) and reader._has_lost():
        return False                        # (a chunk lost this epoch: item i is not position i)
    if isinstance(reader, (_ChunkedSource, GlobalShuffleReader)):
        return (<ReaderBase>reader).c_num_records() >= 0
    f = getattr(reader, "_reads_in_file_order", None)       # RecordIO, TFRecord
    if f is None or not f():
        return False
    if not getattr(reader, "has_index", True):
        return may_become
    return (<ReaderBase>reader).c_num_records() >= 0


def _filtered_source(reader, bint may_become=False):
    """(filters, source) when `reader` is one or more FilterReaders over a source
    that is _addressable: a buffer shuffle over them keeps each record's position
    in that source (the lowest filter's input count) and restores by reading
    there (see "Restore through filters").  None otherwise: a map in between, or
    a source without random access (the shuffle replays)."""
    from readerlib.readers._map import FilterReader
    fs = []
    r = reader
    while isinstance(r, FilterReader):
        fs.append(r)
        r = r.reader
    if not fs or not _addressable(r, may_become):
        return None
    return fs, r


# Items a reader may have taken from the one below beyond what it handed out
# (prefetched, in a threaded map's chunk, a batch being built): how far a
# restore may have to rewind the buffer.  Unknown readers: the whole ring.
def _upstream_ahead(r, a):
    f = getattr(r, "_inputs_ahead", None)       # a filter: from its own counts
    if f is not None:
        return f(a)
    name = type(r).__name__
    if name in ("TakeReader", "SkipReader", "MultiPassReader", "RepeatReader", "ReaderHolder"):
        return a
    if name == "MapBatchesReader":
        return a + r._inputs_held()             # (an interrupted call's input, held)
    if name == "PrefetchReader":
        return a + 2 * int(r.capacity) + 2
    if name == "MapReader":
        return a + r._inputs_held() if int(r.num_threads) == 1 else a + 512 * int(r.num_threads)
    if name in ("BatchReader", "PaddedBatchReader"):
        return (a + 1) * int(r.batch_size)
    if name == "ShardReader":
        return (a + 1) * int(r.num_shards)
    if name == "ShuffleReader" and r._restores_through_filters():
        return a        # its restore rewinds its source by at most the steps it undoes
    return None


def _ahead_bound(above, reader):
    """Items `reader` may have handed out beyond the chain's position (None: not
    known), given the readers `above` it (top first): starting from the item the
    top's read_next holds when its hand-over raised (ReaderBase._held_items)."""
    top = above[0] if above else reader
    a = top._held_items()
    for r in above:
        a = _upstream_ahead(r, a)
        if a is None:
            return None
    return a


cdef inline int64_t _count_at(int64_t t, int64_t E, int64_t cnt, int64_t D) noexcept:
    # slots before step t's draw, from the count after step E-1: full until the
    # source ran out at step D, one fewer each step from then on
    if D < 0:
        return cnt
    return cnt + max(0, E - max(t, D))


cdef inline void _min_max(const int64_t *pos, int64_t n, int64_t *lo, int64_t *hi) noexcept nogil:
    # the least and greatest of pos[:n] (n >= 1)
    cdef int64_t i
    lo[0] = pos[0]
    hi[0] = pos[0]
    for i in range(1, n):
        if pos[i] < lo[0]:
            lo[0] = pos[i]
        if pos[i] > hi[0]:
            hi[0] = pos[i]


cdef int64_t _file_order(const int64_t *pos, int64_t n, uint64_t *keys, uint64_t *tmp) except -1:
    """Sort slots 0..n-1 by pos: keys[:n] (returned 0) or tmp[:n] (returned 1)
    <- ((pos[s] - lo) << 32) | s in increasing order, lo = min(pos), by an LSD
    radix sort of the digits of pos - lo: the fewest passes with digits of at
    most 10 bits, the bits shared evenly (a 10M-record span: 3 passes of 8
    bits, 7.5 ms for 1M keys where 2 of 12 took 10.7: a pass scattering to
    4096 places misses the cache and the TLB on most stores, one to 256 does
    not).  The keys carry the slot and its position, so the fill reads
    them in order without a gather (a sort of slot indices by pos[s] cost
    25-45 ms for a 1M buffer in those indirect loads).  The counts of every
    digit come from one read of pos, and the first pass makes the keys as it
    scatters them."""
    cdef int64_t *cnt = <int64_t *>calloc(4 * 1025, sizeof(int64_t))
    cdef int64_t i, k, d, lo, hi, npass = 0, which = 0
    cdef int bits = 0, need = 0
    cdef uint64_t off, key, mask
    cdef uint64_t *src_
    cdef uint64_t *dst
    cdef uint64_t *sw
    cdef int64_t *c
    if cnt == NULL:
        raise MemoryError()
    with nogil:
        _min_max(pos, n, &lo, &hi)
        while need < 40 and ((<uint64_t>(hi - lo)) >> need) != 0:
            need += 1
        npass = (need + 9) // 10
        if npass > 4:                       # (positions are below 2^32: not reached)
            npass = 4
        if npass == 0:
            for i in range(n):
                keys[i] = <uint64_t>i
        else:
            bits = (need + <int>npass - 1) // <int>npass
            mask = ((<uint64_t>1) << bits) - 1
            for i in range(n):
                off = <uint64_t>(pos[i] - lo)
                for d in range(npass):
                    cnt[d * 1025 + <int64_t>((off >> (bits * d)) & mask) + 1] += 1
            for d in range(npass):
                c = cnt + d * 1025
                for k in range(1 << bits):
                    c[k + 1] += c[k]
            for i in range(n):              # pass 0: the keys made as they go out
                off = <uint64_t>(pos[i] - lo)
                k = <int64_t>(off & mask)
                tmp[cnt[k]] = (off << 32) | <uint64_t>i
                cnt[k] += 1
            which = 1
            src_ = tmp
            dst = keys
            for d in range(1, npass):
                c = cnt + d * 1025
                for i in range(n):
                    key = src_[i]
                    k = <int64_t>((key >> (32 + bits * d)) & mask)
                    dst[c[k]] = key
                    c[k] += 1
                sw = src_
                src_ = dst
                dst = sw
                which = 1 - which
    free(cnt)
    return which


def _file_order_py(positions):
    """Test hook: _file_order's keys for these positions (uint64 array, sorted)."""
    cdef int64_t[::1] p = np.ascontiguousarray(positions, dtype=np.int64)
    cdef int64_t n = p.shape[0]
    if n == 0:
        return np.empty(0, np.uint64)
    a = np.empty(n, np.uint64)
    b = np.empty(n, np.uint64)
    cdef uint64_t[::1] ka = a
    cdef uint64_t[::1] kb = b
    return b if _file_order(&p[0], n, &ka[0], &kb[0]) else a


DEF CHUNK_ORDER_MAX_BUCKETS = 1024         # chunks a chunk order scatters to (else the radix sort)
DEF CHUNK_ORDER_TABLE = 65536               # granules of the position -> chunk table, at most
DEF CHUNK_ORDER_MAX_BITS = 1 << 26          # the duplicate check's bitmap: one chunk's records


cdef inline int64_t _chunk_index(const int64_t *st, int64_t nchunks, int64_t p) noexcept nogil:
    # the chunk holding position p (the last one starting at or before it)
    cdef int64_t a = 0, b = nchunks - 1, m
    while a < b:
        m = (a + b + 1) >> 1
        if st[m] <= p:
            a = m
        else:
            b = m - 1
    return a


cdef inline int64_t _chunk_at(int64_t p, int64_t lo, int s, const int64_t *tab,
                              const int64_t *starts) noexcept nogil:
    # the chunk holding position p: its granule's first chunk, then on past the
    # chunks that end at or before p (empty ones share their start)
    cdef int64_t c = tab[(p - lo) >> s]
    while starts[c + 1] <= p:
        c += 1
    return c


cdef int _chunk_order(const int64_t *pos, int64_t n, const int64_t *starts, int64_t nchunks,
                      uint64_t *keys, int64_t *lo_hi) noexcept nogil:
    """keys[:n] <- ((pos[s] - lo) << 32) | s, lo = min(pos), grouped by the
    chunk (starts[c] <= position < starts[c + 1]) in chunk order, slots in
    increasing order within a chunk; lo_hi <- (lo, max(pos)).  Returns 0; 1
    when a position is in two slots (keys unusable: the caller's radix sort
    finds the pair for the message); -1 when it does not apply (a position
    outside the chunks, more than CHUNK_ORDER_MAX_BUCKETS chunks in the span,
    a chunk too long for the duplicate check, no memory): the radix sort then.

    Design: the fill needs each chunk's records together (a chunk cache of
    two slots loads each chunk once), not the records in position order
    within a chunk (the chunk is in cache while its records are read): one
    counting-sort pass by chunk where _file_order makes three of the
    position's 8-bit digits (1M keys: 3 scatters and a second 8 MB array).
    The chunk of a position is a table lookup (granules of 2^s records, at
    most CHUNK_ORDER_TABLE of them over the span) and a step or two.  Two
    passes over pos (count, scatter; the chunk recomputed: an L1 table),
    then the duplicate check a bucket at a time against a bitmap of that
    chunk's records (L1-resident for RecordIO's 1 MiB chunks), which the
    full sort got from adjacency."""
    cdef int64_t i, c, c_lo, c_hi, nb, lo, hi, span, ntab, g, b, maxlen, k
    cdef int s = 0
    cdef int64_t *tab
    cdef int64_t *cnt
    cdef uint64_t *bits
    cdef uint64_t m, r
    if n <= 0 or nchunks <= 0:
        return -1
    _min_max(pos, n, &lo, &hi)
    lo_hi[0] = lo
    lo_hi[1] = hi
    if lo < 0 or hi >= starts[nchunks] or hi - lo >= (<int64_t>1 << 32):
        return -1
    c_lo = _chunk_index(starts, nchunks, lo)
    c_hi = _chunk_index(starts, nchunks, hi)
    nb = c_hi - c_lo + 1
    if nb > CHUNK_ORDER_MAX_BUCKETS:
        return -1
    maxlen = 0
    for c in range(c_lo, c_hi + 1):
        if starts[c + 1] - starts[c] > maxlen:
            maxlen = starts[c + 1] - starts[c]
    if maxlen > CHUNK_ORDER_MAX_BITS:
        return -1
    span = hi - lo + 1
    while (span >> s) >= CHUNK_ORDER_TABLE:
        s += 1
    ntab = ((span - 1) >> s) + 1
    tab = <int64_t *>malloc(ntab * sizeof(int64_t))
    cnt = <int64_t *>calloc(nb + 1, sizeof(int64_t))
    bits = <uint64_t *>malloc(((maxlen + 63) >> 6) * sizeof(uint64_t) + 8)
    if tab == NULL or cnt == NULL or bits == NULL:
        free(tab)
        free(cnt)
        free(bits)
        return -1
    c = c_lo
    for g in range(ntab):                   # the chunk of each granule's first position
        while starts[c + 1] <= lo + (g << s):
            c += 1
        tab[g] = c
    for i in range(n):
        cnt[_chunk_at(pos[i], lo, s, tab, starts) - c_lo + 1] += 1
    for b in range(nb):
        cnt[b + 1] += cnt[b]
    for i in range(n):
        c = _chunk_at(pos[i], lo, s, tab, starts) - c_lo
        keys[cnt[c]] = ((<uint64_t>(pos[i] - lo)) << 32) | <uint64_t>i
        cnt[c] += 1
    # cnt[b] is now bucket b's end
    k = 0
    r = 0
    for b in range(nb):
        c = c_lo + b
        memset(bits, 0, ((starts[c + 1] - starts[c] + 63) >> 6) * sizeof(uint64_t))
        while k < cnt[b]:
            i = lo + <int64_t>(keys[k] >> 32) - starts[c]
            m = (<uint64_t>1) << (i & 63)
            r |= bits[i >> 6] & m
            bits[i >> 6] |= m
            k += 1
        if r:
            break
    free(tab)
    free(cnt)
    free(bits)
    return 1 if r else 0


def _chunk_order_py(positions, starts):
    """Test hook: _chunk_order's keys for these positions and chunk starts
    (uint64 array), or None (1: a duplicate; -1: not applicable)."""
    cdef int64_t[::1] p = np.ascontiguousarray(positions, dtype=np.int64)
    cdef int64_t[::1] st = np.ascontiguousarray(starts, dtype=np.int64)
    cdef int64_t n = p.shape[0]
    cdef int64_t lo_hi[2]
    cdef int r
    if n == 0 or st.shape[0] < 2:
        return None
    a = np.empty(n, np.uint64)
    cdef uint64_t[::1] ka = a
    with nogil:
        r = _chunk_order(&p[0], n, &st[0], st.shape[0] - 1, &ka[0], lo_hi)
    return a if r == 0 else r


cdef str _pack_ages(const uint32_t *vals, int64_t n, int64_t src):
    """Positions vals[:n] (< src) as a short string: their distances back from
    src - 1 (small: the buffer holds recent records), bit-packed at the width
    of the largest (22 bits for a 1M buffer over 5M records), base64:
    "p<width>:<base64>"."""
    cdef int64_t i, nbytes, o = 0
    cdef uint32_t mx = 0, age
    cdef int w = 0, have = 0
    cdef uint64_t acc = 0
    cdef unsigned char *b
    with nogil:
        for i in range(n):
            age = <uint32_t>(src - 1 - vals[i])
            if age > mx:
                mx = age
    while w < 32 and (mx >> w) != 0:
        w += 1
    nbytes = (n * w + 7) // 8
    out = bytearray(nbytes + 8)
    b = out
    with nogil:
        for i in range(n):
            age = <uint32_t>(src - 1 - vals[i])
            acc |= (<uint64_t>age) << have
            have += w
            while have >= 8:
                b[o] = <unsigned char>(acc & 0xFF)
                o += 1
                acc >>= 8
                have -= 8
        if have > 0:
            b[o] = <unsigned char>(acc & 0xFF)
    return f"p{w}:" + base64.b64encode(memoryview(out)[:nbytes]).decode("ascii")


def _check_saved_buffer(dict buf):
    """The saved buffer's counts are ints in range and its generator state is 4
    words, not all zero (a hand-edited state: a short list read past its end,
    the all-zero state drew forever, others raised OverflowError / TypeError
    / KeyError in the int64-typed restore)."""
    where = "the shuffle's saved buffer is inconsistent"
    for key in ("epoch", "emitted", "source_position", "count", "done_at", "anchor") + \
            (("base_position",) if "base_position" in buf else ()):
        v = buf.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < -1 or v > (1 << 62):
            raise ValueError(f"{where} ({key} {v!r}: not an int in range)")
    rs = buf.get("rng")
    if (not isinstance(rs, (list, tuple)) or len(rs) != 4
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= (1 << 64) for v in rs)
            or not any(rs)):
        raise ValueError(f"{where} (rng {rs!r}: not 4 words of a generator state)")


def _pack_positions(pos, int64_t src):
    """Source positions (< src) as a short string (see _pack_ages)."""
    a = np.ascontiguousarray(np.asarray(pos, np.int64).astype(np.uint32))
    cdef uint32_t[::1] v = a
    cdef int64_t n = a.shape[0]
    return _pack_ages(&v[0] if n else NULL, n, src)


cdef signed char _B64[256]
_B64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
for _k in range(256):
    _B64[_k] = -1
for _k in range(64):
    _B64[_B64_ALPHABET[_k]] = _k


cdef int64_t _b64_bits(const unsigned char *t, int64_t m, int w, int64_t n, int64_t src,
                       int64_t *out) noexcept nogil:
    """Decode base64 text t[:m] and unpack n values of w bits (LSB first) from its
    bytes as out[i] = src - 1 - value, in one pass.  Returns the number of
    decoded bytes, or -1 (a character outside the alphabet, bad padding), -2
    (a position below 0), -3 (more bytes than n values of w bits take: it
    stops there, so the bit buffer never holds more than w + 23 bits; a
    crafted string once shifted it past 64 bits); the caller checks the
    byte count."""
    cdef int64_t i = 0, j = 0, nb = 0, p, want = (n * w + 7) // 8
    cdef int have = 0, pad, k
    cdef uint64_t acc = 0, mask = ((<uint64_t>1) << w) - 1 if w < 64 else <uint64_t>0xFFFFFFFFFFFFFFFF
    cdef int c0, c1, c2, c3
    cdef uint32_t g
    cdef int bad = 0
    if m % 4:
        return -1
    while i < m:
        pad = 0
        if i + 4 == m:
            if t[m - 1] == 61:          # '='
                pad = 2 if t[m - 2] == 61 else 1
        c0 = _B64[t[i]]
        c1 = _B64[t[i + 1]]
        c2 = _B64[t[i + 2]] if pad < 2 else 0
        c3 = _B64[t[i + 3]] if pad < 1 else 0
        if (c0 | c1 | c2 | c3) < 0:
            return -1
        g = (<uint32_t>c0 << 18) | (<uint32_t>c1 << 12) | (<uint32_t>c2 << 6) | <uint32_t>c3
        if pad == 0 and j < n and w > 0:
            # the three bytes at once (have < w <= 32 here: no bits are lost)
            acc |= (<uint64_t>(((g >> 16) & 0xFF) | (g & 0xFF00) | ((g & 0xFF) << 16))) << have
            have += 24
            nb += 3
            while have >= w and j < n:
                p = src - 1 - <int64_t>(acc & mask)
                acc >>= w
                have -= w
                if p < 0:
                    bad = 1
                out[j] = p
                j += 1
            i += 4
            continue
        for k in range(3 - pad):
            if nb >= want:
                return -3
            acc |= (<uint64_t>((g >> (16 - 8 * k)) & 0xFF)) << have
            have += 8
            nb += 1
            while have >= w and j < n and w > 0:
                p = src - 1 - <int64_t>(acc & mask)
                acc >>= w
                have -= w
                if p < 0:
                    bad = 1
                out[j] = p
                j += 1
        i += 4
    if bad:
        return -2
    return nb


cdef extern from "Python.h":
    void *PyUnicode_DATA(object o)


cdef int _decode_positions(text, int64_t src, int64_t n, int64_t *out, where) except -1:
    """out[:n] <- the positions _pack_ages wrote (or the older deflated uint32
    form: base64 of zlib), each checked to lie in [0, src)."""
    cdef const unsigned char *t
    cdef int64_t i, m, got
    cdef int w
    if not isinstance(text, str):
        raise ValueError(f"{where} (positions must be a string, got {type(text).__name__})")
    head, sep, body = text[:4].partition(":")
    if sep and head[:1] == "p" and head[1:].isdigit():
        w = int(head[1:])
        if w > 32:
            raise ValueError(f"{where} (positions {w} bits wide)")
        if not text.isascii():
            try:
                text.encode("ascii")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where} (positions do not decode: {e})") from None
        # an ASCII str holds its text as bytes: read it there (no 2 copies of
        # 4 MB for a 1M buffer)
        t = <const unsigned char *>PyUnicode_DATA(text) + len(head) + 1
        m = len(text) - len(head) - 1
        with nogil:
            got = _b64_bits(t, m, w, n, src, out)
        if got == -1:
            raise ValueError(f"{where} (positions do not decode: not base64)")
        if got == -2:
            raise ValueError(f"{where} (a position before the epoch's start)")
        if got == -3:
            raise ValueError(f"{where} (more than the {(n * w + 7) // 8} bytes of {n} "
                             f"{w}-bit positions)")
        if got != (n * w + 7) // 8:
            raise ValueError(f"{where} ({got} bytes of {w}-bit positions, expected {n})")
        if w == 0:
            for i in range(n):
                out[i] = src - 1
        return 0
    old = _unpack_positions_v1(text, src, n, where)
    for i in range(n):
        out[i] = old[i]
    return 0


def _unpack_positions(text, int64_t src, int64_t n, where):
    """The positions a state holds, as an int64 array (see _decode_positions)."""
    a = np.empty(max(n, 1), np.int64)
    cdef int64_t[::1] v = a
    _decode_positions(text, src, n, &v[0], where)
    return a[:n]


def _unpack_positions_v1(text, int64_t src, int64_t n, where):
    # states written before the bit-packed form: uint32 ages, deflated, base64
    # inflate at most the 4 n bytes n positions take (a tiny hand-edited
    # string can inflate to gigabytes)
    try:
        z = zlib.decompressobj()
        raw = z.decompress(base64.b64decode(text.encode("ascii"), validate=True), 4 * n + 4)
    except Exception as e:
        raise ValueError(f"{where} (positions do not decode: {e})") from None
    if z.unconsumed_tail or len(raw) > 4 * n:
        raise ValueError(f"{where} (more than the {n} positions expected)")
    if not z.eof:
        raise ValueError(f"{where} (positions do not decode: a truncated deflate stream)")
    if len(raw) % 4:
        raise ValueError(f"{where} (positions of {len(raw)} bytes)")
    age = np.frombuffer(raw, "<u4").astype(np.int64)
    if age.shape[0] != n:
        raise ValueError(f"{where} ({age.shape[0]} positions, expected {n})")
    pos = src - 1 - age
    if n and (pos.min() < 0):
        raise ValueError(f"{where} (a position before the epoch's start)")
    return pos


# ------------------------------------------------------------ the restore's parallel fill
# A restore from a file spends most of its fill in chunk loads (pread + the
# chunk's CRC: 0.13 ms a 1 MiB chunk; at 90% of a 10M-record epoch every chunk
# of the file holds a few buffered records) and in writing 1M records to their
# random cells.  Once the fill has decided on cells and preset the slots for
# the common record size (_preset_cells), the rest is split into pieces of the
# file order of about equal cost, run on the pool (readerlib/_parallel.pyx):
# each thread reads through a chunk cache of its own (its own descriptor;
# every chunk still loaded and verified whole: header, body CRC, every size)
# and writes only its pieces' cells.  A piece stops at the first record that
# is not of the preset size (or deferred), and at an error: the caller then
# fills the rest of each piece serially, in file order, with the general code,
# which raises the format's own error for a bad chunk -- so what the fill does
# with anything but the plain case, and every message, is the serial one.
# Written cells hold no references, so an error leaves nothing to release.
# It splits only where that can pay: a pool that runs pieces concurrently (not
# a READERLIB_NO_THREADS build, not set_num_threads(1): there every piece ran
# on the caller, through extra caches for nothing) and a probe whose records
# were all inline of the preset size (records of varying size stop the
# pieces at once and the serial fill redoes nearly everything).
# Beside a busy process (a training job's own), two things cost the split
# most of its gain, both measured at 90% of the 10M epoch: the fresh slots,
# slot positions and cells (36 MB) faulted in a page at a time by random
# writes (now populated up front, _populate), and the scheduler placing the
# woken worker on its caller's CPU, where both stayed for the whole fill in
# about half the restores, i.e. one core for two threads (now the worker
# leaves that CPU for its pieces, _leave_caller_cpu: 77 -> 63 and 74 -> 68
# ms median in two interleaved runs, results/resume.md).  The slots and slot
# positions are populated by the worker while the caller makes the chunk
# order (_order_populating), not before it.
# records left after the probe below which the fill stays serial: a second
# chunk cache, the pool's wake-up and the chunk loads' GIL hand-offs cost more
# than they save there (measured: 100k records from a 1M file, 5.1 ms serial,
# 7.1 ms split)
cdef int64_t _PAR_MIN_RECORDS = 262144
cdef int _PAR_THREADS = 0                   # 0: readerlib's thread count; 1: serial
cdef bint _PAR_EMULATE = False              # run the pieces on the caller, tid = piece % threads (tests)
# whether readerlib's pool can run pieces concurrently at all (False in a
# READERLIB_NO_THREADS build: parallel_for runs every piece on the caller)
cdef bint _POOL_CONCURRENT = _threads_enabled()
# a restore's fresh slots and cells: ask for huge pages.  Off by default: with the
# usual THP defrag setting ("madvise") an advised fault compacts memory in the
# faulting thread, and the restore measured 155-191 ms against ~60 in 2 of 8 runs
# for a 10-20% lower median (results/resume.md); _restore_parallel_settings(hugepages=True)
cdef bint _HUGE_ON = False
# the fill's order: grouped by chunk (_chunk_order) where the source's chunks are known
cdef bint _CHUNK_ORDER_ON = True
# a restore's fresh slots, slot positions and cells: faulted in up front on the
# pool (_populate), one madvise a piece, instead of one page fault at a time
# (9,000 for a 1M buffer of 16-byte cells) by the probe's and the fill's random
# writes and the preset; 4 KiB pages as before, no huge pages (no compaction)
cdef bint _POPULATE_ON = True
cdef int64_t _POPULATED = 0                 # bytes advised so far (a test hook)
# the pooled fill's worker leaves its caller's CPU when it finds itself there
# (_leave_caller_cpu: the scheduler packs the two beside a busy process)
cdef bint _SPREAD_ON = True
# the chunk order on the caller while the worker populates (_order_populating)
cdef bint _ORDER_WITH_POPULATE = True
DEF PAR_MAX_THREADS = 4                     # chunk caches opened at most (one a thread)
DEF PAR_PIECES_PER_THREAD = 8
DEF PAR_LOAD_COST = 4096                    # a chunk load, in record writes (0.13 ms / ~30 ns)
DEF PAR_BLOCK = 256                         # keys per step of the cost estimate


cdef extern from *:
    """
    #include <time.h>
    static inline double rl_shuffle_now(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
    }
    """
    double rl_shuffle_now() nogil

cdef double _phase_t[8]                     # the last restore's phase ends (a benchmark hook)


def _restore_phases():
    """Benchmark hook: the last restore's phases, seconds each: positions
    decoded (and the draws undone), the source skipped to its place, the file
    order sorted, the serial fill up to the inline decision, the rest of the
    fill, the slot positions and the rest."""
    names = ["positions", "skip", "file_order", "probe_fill", "fill", "finish"]
    return {k: _phase_t[i + 1] - _phase_t[i] for i, k in enumerate(names)}


def _restore_parallel_settings(min_records=None, threads=None, emulate=None, hugepages=None,
                               chunk_order=None, populate=None, spread=None, overlap=None):
    """Test/benchmark hook: the restore's parallel fill (`min_records`: records
    left after the probe from which it splits; `threads`: 0 readerlib's thread
    count, 1 serial, n at most n (pooled only while readerlib has 2 threads or
    more and its build has threads: see _restore_pool_concurrent); `emulate`: run the pieces one after another on
    the calling thread, piece p as thread p % threads, each with its own chunk
    cache; `hugepages`: advise huge pages for a restore's fresh slots and
    cells; `chunk_order`: the fill's order grouped by chunk where the
    source's chunks are known (_chunk_order), else sorted by position;
    `populate`: fault in a restore's fresh slots, slot positions and cells
    up front, on the pool; `spread`: the pooled fill's worker leaves its
    caller's CPU when it finds itself there; `overlap`: the chunk order on
    the caller while the worker populates the fresh slots and slot
    positions).  Returns the previous settings as a dict."""
    global _PAR_MIN_RECORDS, _PAR_THREADS, _PAR_EMULATE, _HUGE_ON, _CHUNK_ORDER_ON, _POPULATE_ON
    global _SPREAD_ON, _ORDER_WITH_POPULATE
    old = {"min_records": int(_PAR_MIN_RECORDS), "threads": int(_PAR_THREADS),
           "emulate": bool(_PAR_EMULATE), "hugepages": bool(_HUGE_ON),
           "chunk_order": bool(_CHUNK_ORDER_ON), "populate": bool(_POPULATE_ON),
           "spread": bool(_SPREAD_ON), "overlap": bool(_ORDER_WITH_POPULATE)}
    if min_records is not None and int(min_records) < 0:
        raise ValueError(f"min_records must be >= 0, got {min_records}")
    if threads is not None and not 0 <= int(threads) <= PAR_MAX_THREADS:
        raise ValueError(f"threads must be in [0, {PAR_MAX_THREADS}], got {threads}")
    if min_records is not None:
        _PAR_MIN_RECORDS = int(min_records)
    if threads is not None:
        _PAR_THREADS = int(threads)
    if emulate is not None:
        _PAR_EMULATE = bool(emulate)
    if hugepages is not None:
        _HUGE_ON = bool(hugepages)
    if chunk_order is not None:
        _CHUNK_ORDER_ON = bool(chunk_order)
    if populate is not None:
        _POPULATE_ON = bool(populate)
    if spread is not None:
        _SPREAD_ON = bool(spread)
    if overlap is not None:
        _ORDER_WITH_POPULATE = bool(overlap)
    return old


def _close_all(caches):
    """Close every one of `caches`, even when a close raises (a KeyboardInterrupt
    landing in one): the rest are closed all the same, then the first error
    is raised."""
    first = None
    for e in caches:
        try:
            e.close()
        except BaseException as x:
            if first is None:
                first = x
    if first is not None:
        raise first


def _restore_pool_concurrent(value=None):
    """Test hook: whether the restore's pooled fill takes readerlib's pool as
    able to run pieces concurrently (its default: `threads_enabled()`, False
    in a READERLIB_NO_THREADS build); False makes this build's restores
    behave as that one's.  Returns the previous value."""
    global _POOL_CONCURRENT
    old = bool(_POOL_CONCURRENT)
    if value is not None:
        _POOL_CONCURRENT = bool(value)
    return old


cdef struct _par_fill:
    const uint64_t *keys      # the file order (_file_order)
    int64_t lo
    char *cells
    int64_t cell
    int64_t uni               # the preset record size: the only one a piece writes
    const int64_t *bounds     # piece p: keys [bounds[p], bounds[p + 1])
    int64_t *stop             # piece p filled [bounds[p], stop[p]) (the caller does the rest)
    int *tid_of               # the thread that ran piece p (a test hook)
    double *times             # piece p: start and end (monotonic seconds; a benchmark hook)
    PyObject **caches         # one chunk cache a thread (ReaderBase)
    PyObject *fatal           # a BaseException not an Exception, caught in a piece (a reference)
    int caller_cpu            # the CPU the caller last started a piece on (-1: no spreading)
    int *moved                # piece p: its worker left the caller's CPU for it (a test hook)


cdef int _par_fill_piece(_par_fill *c, int64_t p, ReaderBase cache) except -1 nogil:
    cdef int64_t i, s_, nx, end = c.bounds[p + 1]
    cdef rl_record rec
    for i in range(c.bounds[p], end):
        c.stop[p] = i
        if i + 32 < end:                        # the cell written 32 records from now
            nx = <int64_t><uint32_t>c.keys[i + 32]
            __builtin_prefetch(c.cells + nx * c.cell, 1)
        cache.c_read_at(c.lo + <int64_t>(c.keys[i] >> 32), &rec)
        if rec.size != c.uni or rl_record_is_deferred(&rec):
            return 0                            # the serial fill takes it from here
        s_ = <int64_t><uint32_t>c.keys[i]
        rl_shuffle_copy_small(c.cells + s_ * c.cell, rec.data, <size_t>rec.size)
    c.stop[p] = end
    return 0


cdef int64_t _chunk_edge(const uint64_t *keys, int64_t lo, const int64_t *st, int64_t nchunks,
                         int64_t k, int64_t first, int64_t last) noexcept nogil:
    """The chunk boundary in keys[first:last] (in chunk order) nearest to k: the
    first key of key k's chunk or of the chunk after it."""
    cdef int64_t c, a, b, m, down, up
    if k <= first or k >= last:
        return k
    c = _chunk_index(st, nchunks, lo + <int64_t>(keys[k] >> 32))
    a = first                               # down: the first key in chunk c
    b = k
    while a < b:
        m = (a + b) >> 1
        if _chunk_index(st, nchunks, lo + <int64_t>(keys[m] >> 32)) < c:
            a = m + 1
        else:
            b = m
    down = a
    a = k                                   # up: the first key past chunk c
    b = last
    while a < b:
        m = (a + b) >> 1
        if _chunk_index(st, nchunks, lo + <int64_t>(keys[m] >> 32)) <= c:
            a = m + 1
        else:
            b = m
    up = a
    return down if k - down <= up - k else up


cdef inline bint _leave_caller_cpu(int caller_cpu, int tid, rl_cpu_mask *saved) noexcept nogil:
    # The pooled fill's worker (tid > 0), found on its caller's CPU, leaves it
    # for its pieces (rl_affinity.h); True: put `saved` back after
    # (rl_affinity_restore).  Why: beside a process that keeps another CPU
    # busy, the scheduler places the woken worker on its waker's CPU (no CPU
    # is idle) and its periodic balancing, slowed on busy CPUs, left both
    # threads there for a whole fill in about half the restores measured: the
    # fill then had one core instead of the two it splits for.  (The pool's
    # own rule, Placement in readerlib/_parallel.pyx, moves a worker that has
    # not joined yet; this one, a worker that joined on the caller's CPU.)
    return (tid > 0 and caller_cpu >= 0 and rl_current_cpu() == caller_cpu
            and rl_affinity_leave(0, caller_cpu, saved))


cdef void _par_fill_pieces(_par_fill *c, int64_t begin, int64_t end, int tid) noexcept:
    # Pieces [begin, end) through thread tid's cache, the GIL let go but for
    # a chunk load's own calls.  An error is left to the serial fill (stop[p]
    # is where it happened; it raises it again there).
    cdef int64_t p
    cdef ReaderBase cache = <ReaderBase>c.caches[tid]
    cdef rl_cpu_mask saved
    cdef bint moved = _leave_caller_cpu(c.caller_cpu, tid, &saved)
    if tid == 0 and c.caller_cpu >= 0:
        c.caller_cpu = rl_current_cpu()         # (a hint: read racily by the worker)
    for p in range(begin, end):
        c.tid_of[p] = tid
        c.moved[p] = moved
        c.times[2 * p] = rl_shuffle_now()
        try:
            with nogil:
                _par_fill_piece(c, p, cache)
                c.times[2 * p + 1] = rl_shuffle_now()
        except BaseException as e:
            if not isinstance(e, Exception) and c.fatal == NULL:
                Py_INCREF(e)                # (KeyboardInterrupt: the caller raises it)
                c.fatal = <PyObject *>e
    if moved:
        rl_affinity_restore(0, &saved)         # (its own mask again: it stays where it is)


cdef void _par_fill_body(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    # (a pool thread: a thread state for the body's duration, so that the
    # chunk loads' nested `with gil` and their exceptions stay on it)
    with gil:
        _par_fill_pieces(<_par_fill *>ctx, begin, end, tid)


cdef struct _bref:
    rl_block *block
    int64_t count        # references held by this shuffle (slots + output)
    int64_t next_free
    int64_t bytes        # payload of those records
    int64_t mark         # compaction pass `gen`: +gen copy out, -gen keep (0: not looked at)
    int64_t bigsize      # the size of its one record of >= 4 GiB (slot size BIG)


# A buffered record: 16 bytes (a 1M buffer's table is 16 MB).  Its block is
# btab[ref].block; a record of 4 GiB or more has size BIG and its own entry,
# which holds the size.
cdef struct _slot:
    const char *data
    uint32_t size
    uint32_t ref

cdef extern from *:
    """
    #define RL_SHUFFLE_BIG ((int64_t)0xFFFFFFFFu)
    #define RL_SHUFFLE_INL ((uint32_t)0xFFFFFFFFu)
    """
    const int64_t BIG "RL_SHUFFLE_BIG"
    const uint32_t INL "RL_SHUFFLE_INL"      # a slot's ref: its record is in its cell, no block
DEF MAX_BUFFER = 1 << 31                   # ref is 32 bits: at most this + 2 table entries


cdef struct _preset:
    _slot *slots
    char *cells
    int64_t cell
    uint32_t size


cdef void _preset_body(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    # slots [begin, end) in their cells, of c.size bytes (in order, on the
    # pool; a restore's slots were populated: _populate)
    cdef _preset *c = <_preset *>ctx
    cdef int64_t s
    for s in range(begin, end):
        c.slots[s].data = c.cells + s * c.cell
        c.slots[s].size = c.size
        c.slots[s].ref = INL


DEF POPULATE_PIECE = 1 << 20               # bytes a pool item faults in (one madvise)


cdef struct _populate_ctx:
    char *p
    int64_t n


cdef void _populate_body(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _populate_ctx *c = <_populate_ctx *>ctx
    cdef int64_t a = begin * POPULATE_PIECE, e = min(end * POPULATE_PIECE, c.n)
    rl_shuffle_populate(c.p + a, <size_t>(e - a))


cdef bint _populate_prepare(_populate_ctx *c, void *p, int64_t n, int64_t *pieces) noexcept nogil:
    # c and its pieces for _populate_body when [p, p + n) is populated at all
    global _POPULATED
    pieces[0] = 0
    if not _POPULATE_ON or p == NULL or n < 2 * POPULATE_PIECE:
        return False
    c.p = <char *>p
    c.n = n
    pieces[0] = (n + POPULATE_PIECE - 1) // POPULATE_PIECE
    _POPULATED += n
    return True


cdef void _populate(void *p, int64_t n) noexcept nogil:
    # Fault in a restore's fresh array before its random writes do, a piece
    # per pool item: a fault taken by the fill costs a trap, a page walk and
    # the cache lines it evicts, at a random moment of a memory-bound loop.
    # (Pieces start page-aligned when p is: the rounding inward loses at most
    # a page a piece boundary otherwise, which faults in later.)
    cdef _populate_ctx c
    cdef int64_t pieces
    if _populate_prepare(&c, p, n, &pieces):
        parallel_for(threads_for(n), pieces, _populate_body, &c)


cdef struct _order_job:
    # item 0: the chunk order (_chunk_order); items 1..: the populate pieces of
    # the fresh slots (na of them), then of the slot positions (nb); 0: that
    # array is not populated (off, or too small)
    const int64_t *pos
    int64_t n
    const int64_t *starts
    int64_t nchunks
    uint64_t *keys
    int64_t *lo_hi
    int result
    _populate_ctx a
    int64_t na
    _populate_ctx b
    int64_t nb
    int caller_cpu


cdef void _order_job_body(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _order_job *j = <_order_job *>ctx
    cdef int64_t k
    cdef rl_cpu_mask saved
    cdef bint moved = _leave_caller_cpu(j.caller_cpu, tid, &saved)
    for k in range(begin, end):
        if k == 0:
            j.result = _chunk_order(j.pos, j.n, j.starts, j.nchunks, j.keys, j.lo_hi)
        elif k - 1 < j.na:
            _populate_body(&j.a, k - 1, k, 0)
        else:
            _populate_body(&j.b, k - 1 - j.na, k - j.na, 0)
    if moved:
        rl_affinity_restore(0, &saved)


cdef int _order_populating(const int64_t *pos, int64_t n, const int64_t *starts, int64_t nchunks,
                           uint64_t *keys, int64_t *lo_hi, void *slots, int64_t slots_bytes,
                           void *slot_pos, int64_t slot_pos_bytes) noexcept nogil:
    """_chunk_order on the caller while the pool's worker populates the fresh
    slots and slot positions (_populate), one job: the populate (~3 ms for a
    1M buffer) no longer waits in front of the order (5-9 ms)."""
    cdef _order_job j
    j.pos = pos
    j.n = n
    j.starts = starts
    j.nchunks = nchunks
    j.keys = keys
    j.lo_hi = lo_hi
    j.result = -1
    _populate_prepare(&j.a, slots, slots_bytes, &j.na)
    _populate_prepare(&j.b, slot_pos, slot_pos_bytes, &j.nb)
    j.caller_cpu = rl_current_cpu() if _SPREAD_ON else -1
    parallel_for(num_threads() if j.na + j.nb > 0 else 1, 1 + j.na + j.nb, _order_job_body, &j)
    return j.result


def _spread_py(int caller_cpu=-2):
    """Test hook: what the pooled fill's worker does at a piece with its caller
    on `caller_cpu` (-2: this thread's own CPU), on this thread: (moved, the
    CPU it is on then, its affinity then, its affinity after it put its mask
    back)."""
    import os
    cdef rl_cpu_mask saved
    cdef bint moved
    if caller_cpu == -2:
        caller_cpu = rl_current_cpu()
    moved = _leave_caller_cpu(caller_cpu, 1, &saved)
    cpu = rl_current_cpu()
    during = os.sched_getaffinity(0)
    if moved:
        rl_affinity_restore(0, &saved)
    return bool(moved), cpu, during, os.sched_getaffinity(0)


def _populate_py(a):
    """Test hook: the restore's populate (_populate, on the pool) over a
    writable C-contiguous array's bytes, which it must leave as they are.
    Returns the bytes advised by restores and this hook so far (0 added when
    the array is below the size it starts at, or populate is off)."""
    cdef unsigned char[::1] v = memoryview(a).cast("B")
    if v.shape[0] > 0:
        with nogil:
            _populate(&v[0], v.shape[0])
    return int(_POPULATED)


cdef class ShuffleReader(DecoratedReader):
    """Shuffle through a buffer of `buffer_size` items (tf.data's algorithm).

    Every item comes out exactly once per epoch.  The order is a function of
    (seed, epoch): the same seed gives the same order, and each `reset()`
    starts a new epoch with a new order.  The buffer holds references to
    records, not copies, except for a big buffer of small records from a
    source that lets go of its blocks: those (up to 256 bytes, one cell size
    per buffer) are copied into cells of the buffer's own, so its memory is
    about the buffered payload plus 20 bytes a slot.  Records it references
    that would keep much more memory alive than they are (their source
    blocks) are compacted: the few survivors of mostly-drained blocks are
    copied into blocks of its own, so that memory stays about 1.5-1.6x their
    payload plus 4 MiB.  Neither changes the order.

    Parameters
    ----------
    reader : ReaderBase
    buffer_size : int
        Items held; 1 means no shuffling.
    seed : int, optional
        Pass `seed=` to make the order reproducible; without it a seed is
        drawn from the OS once, at construction.
    """
    # Design: slots[] hold borrowed-then-kept records.  Keeping a record
    # means keeping its block; instead of one atomic incref/decref per
    # record, blocks are counted in a local table (`btab`, non-atomic) and
    # only the first/last local reference touches the block's atomic count.
    # Records arrive in runs from the same block, so the common case is one
    # comparison and one increment.
    #
    # Compaction.  A kept record keeps its whole block: a 1 MiB chunk of 64 B
    # records stays while any one of its ~15 k records is buffered, which for
    # small records pins about ten buffers' worth of chunks.  So the shuffle
    # counts the bytes it pins (distinct blocks) against the payload it holds,
    # and when pinned > 1.5 x payload + 4 MiB (checked when a new block comes
    # in; a pass at most every cap/4 records, so its O(buffer) scan is O(1)
    # per record) it copies the records of small (< 32 KiB) size that sit in
    # blocks it alone holds, used below 3/4, into 1 MiB arena blocks of its own
    # (ordinary refcounted rl_blocks: a consumer that keeps a record still
    # holds a reference) and drops its reference to the old block.  Slots
    # keep their positions and the random draws are untouched, so the order is
    # exactly the one without compaction.  Big records stay referenced.
    #
    # Slots.  16 bytes each: the record's data pointer, its size (32 bits)
    # and its block-table entry (32 bits; the block is btab[ref].block).  A
    # record of 4 GiB or more has size BIG and an entry of its own that
    # holds its size.
    #
    # Inline.  For a big buffer of small records compaction still pins 1.5x
    # the payload plus the arenas (results/shuffle_memory.md).  So when the
    # shuffle sees, early in its first fill, that its source lets go of its
    # blocks (the block before a new one is held by the shuffle alone: copies
    # would free memory), that the buffer's payload will not be tiny (cap x
    # the mean size so far >= 256 KiB: below that, measured, the two copies
    # cost more than the pinning and compaction they save) and that cells of
    # one size would cost less than referencing (n x cell + 2 x the bytes of
    # larger records < 2 x all bytes; 2: compaction's 1.5x plus its arenas),
    # it copies every record of at most `cell` bytes into a cell of its own:
    # slot s's cell is cells + s x cell, written only by a record that comes
    # into slot s (after a slot moves -- the source ran out, a deferred
    # record dropped -- it may point at the cell of a slot index >= count,
    # which is not refilled before the next epoch).  No source block stays
    # pinned for them and compaction has nothing to do for them; larger
    # records take the referenced path (and compaction) as before.  A record
    # handed out is copied from its cell into an output block (OUT_BYTES,
    # appended to; reused from its start when the shuffle is its only holder
    # -- a consumer that keeps a record holds a reference to its block -- or
    # replaced by a fresh one), so the cell can take the slot's next record.
    # The draws do not depend on where a record is kept: the order is the
    # same as without inlining.  Cost: two copies of a small record (in, out)
    # instead of none; memory: cap x (cell + 16 B slot) + positions.
    #
    # Restore.  Over a source whose epoch is addressable (_addressable: item
    # i of the epoch is c_read_at(i)), each slot also keeps its record's
    # source position (slot_pos, 4 bytes), and a ring keeps the source
    # position handed out at each of the last RING steps, with the RNG before
    # every 64th draw.  get_state saves the buffer (positions in slot order),
    # the counts, and the ring's last steps from an anchor (as many as the
    # readers above may have read ahead: _ahead_bound).  set_state's first
    # c_skip(n) on a fresh epoch rebuilds the buffer as it was after n items:
    # the draws from the anchor are recomputed (the counts are known: full
    # until the source ran out at step done_at, one fewer a step after), the
    # steps after n undone (the handed-out record goes back into its slot,
    # the refill goes back to the source), the source positioned with
    # c_skip and the slots filled with c_read_at in file order.  Cost: the
    # buffer's records, whatever n.  Anything else (no random access, an
    # error below this epoch, n outside the saved steps) replays.
    #
    # Restore through filters.  When the source is one or more filters over
    # an addressable source (_filtered_source), a filter's output index is
    # no position to read at, so slot_pos (and the ring) keep the record's
    # position in the source below the filters instead: the lowest filter's
    # input count minus one when the record is taken (filters read one item
    # at a time, none ahead).  The state adds "base_position" (that count
    # at the save; positions are packed back from it).  The
    # restore recomputes the draws as above; an undone refill goes back to
    # the filters (their positions only decrease going back), the filters
    # are positioned at the restored count of their outputs with c_skip (by
    # their own saved counts: get_state asks them for as many outputs back
    # as this shuffle may undo, _upstream_ahead) and the buffer is read from
    # the source below them by position.  No predicate is called: the
    # buffered records passed when they were first read.
    #
    # Maps.  A MapReader over an addressable source is addressable too
    # (MapReader.c_read_at: fn of the source's record; fn is called again
    # for each buffered record, so it is assumed pure, as a replay assumes),
    # below the filters or in place of them.  A map between the shuffle and
    # a filter (its output is not a source's record at a position), or an
    # error below the filters this epoch, replays.
    cdef _slot *slots
    cdef int64_t scap            # allocated slots (grows up to cap)
    cdef _bref *btab
    cdef int64_t btab_free
    cdef int64_t btab_hw         # entries [0, btab_hw) have been used
    cdef int64_t btab_last
    cdef int64_t cap
    cdef int64_t count
    cdef bint filled
    cdef bint upstream_done
    cdef int64_t hold
    cdef int64_t next_j          # the next draw, made one call ahead to prefetch its data
    cdef rl_rng rng
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn    # no seed= given: drawn from the OS (travels in the state)
    cdef int64_t hold_size
    cdef int64_t payload         # bytes of the records referenced (slots + hold)
    cdef int64_t pinned          # bytes of the distinct blocks referenced
    cdef int64_t since           # records taken in since the last compaction pass
    cdef bint due                # a pass runs at the start of the next c_next
    cdef bint c_on
    cdef int64_t c_slack
    cdef double c_factor
    cdef double c_fill
    cdef int64_t gen
    cdef rl_block *arena         # the arena block being filled (one reference)
    cdef int64_t arena_used
    cdef int64_t arena_e         # its btab entry, when one of its records is held
    cdef int64_t n_passes
    cdef int64_t n_copied
    cdef int64_t n_copied_bytes
    # Bounded restore (see "Restore" in the design note).
    cdef readonly bint track      # the source's epoch is addressable by index (c_read_at)
    cdef bint track_ok           # ... and the positions below are valid this epoch
    cdef bint in_upstream        # still set on entry: the last call below raised
    cdef uint32_t *slot_pos      # source position of each slot's record
    cdef int64_t src_pos         # records taken from the source this epoch
    cdef readonly int64_t emitted   # items handed out this epoch
    cdef int64_t done_at         # step at which the source ran out (-1: not yet)
    cdef uint32_t *ring_a        # source position handed out at step t (t % RING)
    cdef rl_rng *ring_s          # RNG before the draw of step t, t % 64 == 0
    cdef int64_t base_t          # ring data valid from this step on (0, or a restore's)
    cdef rl_rng base_rng         # RNG before the draw of step base_t
    cdef object _pending         # set_state's saved buffer, for the first c_skip
    cdef readonly int64_t restores   # bounded restores made (a test hook)
    cdef int64_t fill_off            # a restore's fill order: key (i + fill_off) % count the i-th (_fill)
    cdef readonly object _par_tids   # the last parallel fill: the thread of each piece (a test hook)
    cdef readonly object _par_moved  # ... and whether its worker had left the caller's CPU for it
    cdef readonly object _par_bounds # ... and the pieces' bounds in the file order
    cdef readonly object _par_times  # ... and their start and end (s, from the probe's end)
    cdef readonly int64_t _par_loads # ... and the chunk loads its pieces made (all threads)
    cdef readonly str _fill_order    # the last restore's fill order: "chunk" or "position" (a test hook)
    # Restore through filters (see the design note): slot_pos holds positions in
    # ra_src, the source below the filters, not counts of the filters' outputs
    cdef ReaderBase ra_src       # the reader the restore reads the buffer from (c_read_at)
    cdef object _filters         # the FilterReaders between (None: ra_src is the source)
    cdef const int64_t *f_in     # the lowest filter's input count (NULL: no filters)
    # Inline small records (see "Inline" in the design note).
    cdef char *cells             # scap x cell bytes (NULL: not inline)
    cdef int64_t cell            # a record of at most this many bytes is inlined; -1: none is
    cdef bint i_on               # the settings, copied at construction
    cdef int64_t i_max
    cdef int64_t i_min_payload
    cdef int64_t i_cell
    cdef bint i_decided          # whether to inline is settled (for this reader)
    cdef bint i_probe            # a new block came and the one before is ours alone: decide
    cdef int i_tries
    cdef bint i_restoring        # a restore's fill: the source's chunk cache holds blocks (not a sign)
    cdef rl_block *outb          # the output block being filled (one reference)
    cdef int64_t out_used
    cdef int64_t n_inlined       # records copied into cells (a test hook)

    def __init__(self, reader, buffer_size, seed=None):
        _check_reader(reader, "ShuffleReader")
        cap = _check_positive_int(buffer_size, "buffer_size")
        if cap > MAX_BUFFER:
            raise ValueError(f"buffer_size must be <= {MAX_BUFFER}, got {cap}")
        self.seed_drawn = seed is None
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        DecoratedReader.__init__(self, reader)
        self.cap = cap
        self.count = 0
        self.hold = -1
        self.scap = 0
        self.btab_free = -1
        self.btab_hw = 0
        self.btab_last = -1
        self.arena = NULL
        self.arena_e = -1
        self.c_on = _COMPACT_ON
        self.c_slack = _COMPACT_SLACK
        self.c_factor = _COMPACT_FACTOR
        self.c_fill = _COMPACT_FILL
        self.cells = NULL
        self.cell = -1
        self.outb = NULL
        self.i_on = _INLINE_ON
        self.i_max = _INLINE_MAX
        self.i_min_payload = _INLINE_MIN_PAYLOAD
        self.i_cell = _INLINE_CELL
        self.i_decided = not self.i_on
        self.ra_src = <ReaderBase>reader
        self.track = _addressable(reader, True)
        fsrc = None if self.track else _filtered_source(reader, True)
        if fsrc is not None:
            self._filters, self.ra_src = fsrc
            self.f_in = <const int64_t *><size_t>self._filters[len(self._filters) - 1]._input_count_address()
            self.track = True
        if self.track:
            self.ring_a = <uint32_t *>malloc(RING * sizeof(uint32_t))
            self.ring_s = <rl_rng *>malloc(ANCHORS * sizeof(rl_rng))
            if self.ring_a == NULL or self.ring_s == NULL:
                raise MemoryError("shuffle restore ring")
        self._grow(min(cap, 1024))
        self.seed = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        self.epoch = 0
        self._restart()

    cdef int _grow(self, int64_t n) except -1 nogil:
        """Room for n buffered items (the buffer grows as it fills: a huge
        buffer_size over a small dataset costs only what is used)."""
        cdef int64_t i, old = self.scap
        cdef _slot *s2
        cdef uint32_t *p2
        cdef _bref *b2
        cdef char *c2
        if n <= old:
            return 0
        s2 = <_slot *>realloc(self.slots, n * sizeof(_slot))
        if s2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.slots = s2
        if self.track:
            p2 = <uint32_t *>realloc(self.slot_pos, n * sizeof(uint32_t))
            if p2 == NULL:
                with gil:
                    raise MemoryError(f"shuffle buffer of {n} items")
            self.slot_pos = p2
        # at most (items + 1) distinct blocks are held (+1 while a compaction
        # moves a record): n + 2 table entries.  Entries are handed out from a
        # high-water mark, then recycled through the free list, so only as
        # many are touched as blocks were ever held at once (not n).
        b2 = <_bref *>realloc(self.btab, (n + 2) * sizeof(_bref))
        if b2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.btab = b2
        if self.cells != NULL:
            c2 = <char *>realloc(self.cells, n * self.cell)
            if c2 == NULL:
                with gil:
                    raise MemoryError(f"shuffle buffer of {n} items")
            if c2 != self.cells:            # the inline slots point into the cells
                for i in range(self.count):
                    if self.slots[i].ref == INL:
                        self.slots[i].data = c2 + (self.slots[i].data - self.cells)
            self.cells = c2
        self.scap = n
        return 0

    cdef inline int64_t _new_entry(self) noexcept nogil:
        cdef int64_t i = self.btab_free
        if i >= 0:
            self.btab_free = self.btab[i].next_free
            return i
        i = self.btab_hw                   # < scap + 2: at most scap + 2 entries are in use
        self.btab_hw += 1
        return i

    cdef inline int64_t _acquire(self, rl_block *b, int64_t size) noexcept nogil:
        cdef int64_t i = self.btab_last
        self.payload += size
        self.since += 1
        if i >= 0 and self.btab[i].block == b and size < BIG:
            self.btab[i].count += 1
            self.btab[i].bytes += size
            return i
        return self._acquire_new(b, size)

    cdef int64_t _acquire_new(self, rl_block *b, int64_t size) noexcept nogil:
        # a block not the last one's (out of line: _acquire stays small enough
        # to be inlined into the per-record paths)
        cdef int64_t i = self.btab_last
        if not self.i_decided and i >= 0:
            # the block before this one: held by the shuffle alone (the source
            # let go of it), copies would free memory
            if self.btab[i].block.refcnt == 1:
                self.i_probe = True
            elif not self.i_restoring:
                self.i_tries += 1
                self.i_decided = self.i_tries >= INLINE_PROBES
        i = self._new_entry()
        self.btab[i].block = b
        self.btab[i].count = 1
        self.btab[i].bytes = size
        self.btab[i].mark = 0
        self.btab[i].bigsize = size
        rl_block_incref(b)
        self.btab_last = i
        self.pinned += b.size
        if (self.c_on and self.pinned > self.c_factor * self.payload + self.c_slack
                and 4 * self.since >= self.cap):
            self.due = True
        return i

    cdef inline void _put(self, int64_t s, const rl_record *rec, int64_t ref) noexcept nogil:
        __builtin_prefetch(rec.data)
        __builtin_prefetch(rec.data + 63)
        self.slots[s].data = rec.data
        self.slots[s].size = <uint32_t>(rec.size if rec.size < BIG else BIG)
        self.slots[s].ref = <uint32_t>ref

    cdef inline void _take(self, int64_t s, const rl_record *rec) noexcept nogil:
        # slot s <- the source's record: into its cell when it fits and is not
        # deferred (a chunk of big records can hold small ones too: their bytes
        # are unverified, and may not even be readable, until the batch copies
        # them), else referenced
        if rl_shuffle_rare(rec.size <= self.cell and not rl_record_is_deferred(rec)):
            self._take_cell(s, rec)
        else:
            self._put(s, rec, self._acquire(rec.block, rec.size))

    cdef inline void _take_cell(self, int64_t s, const rl_record *rec) noexcept nogil:
        # slot s <- a copy of the record in its cell (rec.size <= cell)
        cdef char *p = self.cells + s * self.cell
        rl_shuffle_copy_small(p, rec.data, <size_t>rec.size)
        self.slots[s].data = p
        self.slots[s].size = <uint32_t>rec.size
        self.slots[s].ref = INL
        self.n_inlined += 1

    cdef inline bint _slot_deferred(self, int64_t s) noexcept nogil:
        # slot s (referenced) holds a deferred record: never copied into a cell (see _take)
        cdef rl_record cur
        cur.block = self.btab[self.slots[s].ref].block
        return rl_record_is_deferred(&cur)

    cdef inline void _unref(self, int64_t s) noexcept nogil:
        # slot s lets go of its record
        if self.slots[s].ref != INL:
            self._release(self.slots[s].ref, self._size(s))

    cdef void _decide(self, const int64_t *idx, int64_t n) noexcept nogil:
        """Whether to inline, from the n records buffered so far (slots idx[:n],
        or 0..n-1): see "Inline" in the design note.  Yes: the cells are made
        and those records copied into them.  Out of memory: no (compaction
        goes on as before)."""
        cdef int64_t *cnt
        cdef int64_t i, s, z, c, best_c = -1, e, total = 0, small = 0
        cdef double cost, best
        cdef char *p
        self.i_probe = False
        if self.i_decided or n <= 0:
            return
        self.i_decided = True
        cnt = <int64_t *>calloc(self.i_max + 1, sizeof(int64_t))
        if cnt == NULL:
            return
        for i in range(n):
            s = idx[i] if idx != NULL else i
            z = self._size(s)
            total += z
            if z <= self.i_max and self.slots[s].ref != INL and not self._slot_deferred(s):
                cnt[z] += 1
        if <double>self.cap * total < <double>self.i_min_payload * n:
            free(cnt)
            return
        # cost(c) = n x c + 2 x bytes of records > c, against 2 x all bytes
        best = 2.0 * total
        if self.i_cell > 0:
            best_c = self.i_cell
        else:
            for c in range(1, self.i_max + 1):
                small += cnt[c] * c
                if cnt[c] == 0:
                    continue
                cost = <double>n * c + 2.0 * (total - small)
                if cost < best:
                    best = cost
                    best_c = c
        free(cnt)
        if best_c <= 0:
            return
        self.cells = <char *>malloc(self.scap * best_c)
        if self.cells == NULL:
            return
        if self.i_restoring:                # (fresh, about to be filled at once)
            if _HUGE_ON:
                rl_shuffle_hugepages(self.cells, <size_t>(self.scap * best_c))
            _populate(self.cells, self.scap * best_c)
        self.cell = best_c
        for i in range(n):
            s = idx[i] if idx != NULL else i
            e = self.slots[s].ref
            if e == INL:
                continue
            z = self._size(s)
            if z > best_c or self._slot_deferred(s):
                continue
            p = self.cells + s * best_c
            memcpy(p, self.slots[s].data, <size_t>z)
            self.slots[s].data = p
            self.slots[s].ref = INL
            self.n_inlined += 1
            self._release(e, z)

    cdef int _out_room(self, int64_t need) except -1 nogil:
        """Room for `need` bytes in the output block: the block's start again
        when nobody else holds it (the record handed out last was borrowed
        until this call), else a fresh block.  Raises with nothing moved."""
        if self.outb != NULL:
            if self.out_used + need <= self.outb.size:
                return 0
            if rl_shuffle_sole(self.outb) and need <= self.outb.size:
                self.out_used = 0
                return 0
            rl_block_decref(self.outb)
        self.outb = rl_block_new(max(<int64_t>OUT_BYTES, need))
        self.out_used = 0
        if self.outb == NULL:
            with gil:
                raise MemoryError(f"shuffle output block of {max(<int64_t>OUT_BYTES, need)} bytes")
        return 0

    cdef inline void _out(self, int64_t j, int64_t need, rl_record *out) noexcept nogil:
        # the record of inline slot j, copied into the output block (room made)
        cdef char *p = self.outb.data + self.out_used
        rl_shuffle_copy_small(p, self.slots[j].data, self.slots[j].size)
        self.out_used += need
        out.block = self.outb
        out.data = p
        out.size = self.slots[j].size

    cdef inline int64_t _size(self, int64_t s) noexcept nogil:
        cdef int64_t z = self.slots[s].size
        return z if z != BIG else self.btab[self.slots[s].ref].bigsize

    cdef inline void _get(self, int64_t s, rl_record *out) noexcept nogil:
        out.block = self.btab[self.slots[s].ref].block
        out.data = self.slots[s].data
        out.size = self._size(s)

    cdef inline void _release(self, int64_t i, int64_t size) noexcept nogil:
        cdef rl_block *b
        self.payload -= size
        self.btab[i].count -= 1
        self.btab[i].bytes -= size
        if self.btab[i].count == 0:
            b = self.btab[i].block
            self.pinned -= b.size
            rl_block_decref(b)
            self.btab[i].block = NULL
            self.btab[i].next_free = self.btab_free
            self.btab_free = i
            if self.btab_last == i:
                self.btab_last = -1

    cdef char *_arena_alloc(self, int64_t size) noexcept nogil:
        """Room for a copy of one record in the arena (NULL: out of memory)."""
        cdef int64_t need = (size + 7) & ~(<int64_t>7)
        cdef char *p
        if self.arena == NULL or self.arena_used + need > self.arena.size:
            self._drop_arena()
            self.arena = rl_block_new(ARENA_BYTES)
            if self.arena == NULL:
                return NULL
        p = self.arena.data + self.arena_used
        self.arena_used += need
        return p

    cdef void _drop_arena(self) noexcept nogil:
        # the slab lives on while slots (btab) or consumers hold its records
        if self.arena != NULL:
            rl_block_decref(self.arena)
            self.arena = NULL
        self.arena_used = 0
        self.arena_e = -1

    cdef int64_t _arena_take(self, int64_t size) noexcept nogil:
        """One more local reference to the arena block (a record copied into it)."""
        cdef int64_t i = self.arena_e
        self.payload += size
        if i >= 0 and self.btab[i].block == self.arena:
            self.btab[i].count += 1
            self.btab[i].bytes += size
            return i
        i = self._new_entry()
        self.btab[i].block = self.arena
        self.btab[i].count = 1
        self.btab[i].bytes = size
        self.btab[i].mark = -self.gen      # its records are not copied again in this pass
        self.btab[i].bigsize = 0
        rl_block_incref(self.arena)
        self.pinned += self.arena.size
        self.arena_e = i
        return i

    cdef void _compact(self) noexcept nogil:
        """One compaction pass over the buffer (see the design note).  Every
        step leaves a consistent buffer: a failed allocation ends the pass."""
        cdef int64_t s, e, a, size
        cdef rl_block *b
        cdef char *p
        self.due = False
        self.since = 0
        self.gen += 1
        self.n_passes += 1
        for s in range(self.count):
            e = self.slots[s].ref
            if e == INL:                       # in its cell: nothing pinned
                continue
            if self.btab[e].mark != self.gen:
                if self.btab[e].mark == -self.gen:
                    continue
                b = self.btab[e].block
                # only blocks nobody else holds (dropping them frees memory),
                # not the one still arriving, used below `fill`
                if (e != self.btab_last and b != self.arena and b.refcnt == 1
                        and self.btab[e].bytes < self.c_fill * b.size):
                    self.btab[e].mark = self.gen
                else:
                    self.btab[e].mark = -self.gen
                    continue
            size = self._size(s)
            if size >= COMPACT_MAX_RECORD:
                continue
            p = self._arena_alloc(size)
            if p == NULL:
                return
            memcpy(p, self.slots[s].data, <size_t>size)
            a = self._arena_take(size)
            self.slots[s].data = p
            self.slots[s].ref = <uint32_t>a
            self.n_copied += 1
            self.n_copied_bytes += size
            self._release(e, size)

    cdef void _drop(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.count):
            self._unref(i)
        self.count = 0
        if self.hold >= 0:
            self._release(self.hold, self.hold_size)
            self.hold = -1
        self._drop_arena()
        if self.outb != NULL:
            rl_block_decref(self.outb)
            self.outb = NULL
        self.out_used = 0
        self.due = False
        self.since = 0

    cdef void _restart(self) noexcept nogil:
        self._drop()
        self.filled = False
        self.upstream_done = False
        self.next_j = -1
        rl_rng_seed(&self.rng, self.seed, <uint64_t>self.epoch)
        self.src_pos = 0
        self.emitted = 0
        self.done_at = -1
        self.track_ok = self.track
        self.in_upstream = False
        self.base_t = 0
        self.base_rng = self.rng

    def __dealloc__(self):
        if self.slots != NULL and self.btab != NULL:
            self._drop()
        free(self.slots)
        free(self.btab)
        free(self.cells)
        self.cells = NULL
        free(self.slot_pos)
        free(self.ring_a)
        free(self.ring_s)
        self.slot_pos = NULL
        self.ring_a = NULL
        self.ring_s = NULL
        self.slots = NULL
        self.btab = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef rl_record cur
        cdef int r
        cdef uint64_t j
        if self.hold >= 0:
            self._release(self.hold, self.hold_size)
            self.hold = -1
        if self.in_upstream:            # the last call below raised: positions may have shifted
            self.in_upstream = False
            if self.f_in == NULL:
                self.track_ok = False
            else:                       # (not when a predicate raised: the filters' counts hold)
                with gil:
                    self._check_filters()
        if rl_shuffle_rare(self.due or self.i_probe):
            if self.i_probe:
                self._decide(NULL, self.count)
            if self.due:
                self._compact()
        if not self.filled:
            while self.count < self.cap:
                if self.count == self.scap:
                    self._grow(min(self.cap, 2 * self.scap))
                # an exception here leaves the buffer as it was: the next
                # call goes on filling it
                self.in_upstream = True
                r = self.reader.c_next(&rec)
                self.in_upstream = False
                if r == 0:
                    self.upstream_done = True
                    self.done_at = self.emitted
                    break
                if rl_shuffle_rare(rec.size <= self.cell and not rl_record_is_deferred(&rec)):  # (_take, spelled out)
                    self._take_cell(self.count, &rec)
                else:
                    self._put(self.count, &rec, self._acquire(rec.block, rec.size))
                if self.track:
                    self._took(self.count)
                self.count += 1
                if self.i_probe:
                    self._decide(NULL, self.count)
            self.filled = True
        if self.count == 0:
            return 0
        if self.next_j >= 0:
            j = <uint64_t>self.next_j
        else:
            j = self._draw()
            # kept until the slot is emitted: if the refill below raises, the
            # next call emits this same slot (the order is the one the
            # failed record's absence gives, and nothing is lost or repeated)
            self.next_j = <int64_t>j
        if rl_shuffle_rare(self.slots[j].ref == INL):
            return self._next_inline(j, out)
        self._get(j, &cur)
        if rl_record_is_deferred(&cur) and not rl_deferred_may_go_out(&cur):
            self._verify_slot(j)
        # Refill first, emit after.  c_next is `except -1`: an exception jumps
        # straight out of this function, so nothing may be half-moved when it
        # is called (the buffer keeps every record it holds, `hold` is empty).
        if not self.upstream_done:
            self.in_upstream = True
            r = self.reader.c_next(&rec)
            self.in_upstream = False
            self.next_j = -1
            self._get(j, out)
            self.hold = self.slots[j].ref   # the slot's reference moves to `hold`
            self.hold_size = out.size
            if self.track:
                self.ring_a[self.emitted & RING_MASK] = self.slot_pos[j]
            self.emitted += 1
            if r == 1:
                if rl_shuffle_rare(rec.size <= self.cell and not rl_record_is_deferred(&rec)):
                    self._take_cell(j, &rec)
                else:
                    self._put(j, &rec, self._acquire(rec.block, rec.size))
                if self.track:
                    self._took(j)
                self._draw_ahead()
                return 1
            self.upstream_done = True
            self.done_at = self.emitted - 1
        else:
            self.next_j = -1
            self._get(j, out)
            self.hold = self.slots[j].ref
            self.hold_size = out.size
            if self.track:
                self.ring_a[self.emitted & RING_MASK] = self.slot_pos[j]
            self.emitted += 1
        self.count -= 1
        self.slots[j] = self.slots[self.count]
        if self.track:
            self.slot_pos[j] = self.slot_pos[self.count]
        self._draw_ahead()
        return 1

    cdef int _next_inline(self, int64_t j, rl_record *out) except -1 nogil:
        """c_next's step when the drawn slot j holds its record in its cell: the
        same step, the record handed out as a copy in the output block."""
        cdef rl_record rec
        cdef int r
        cdef int64_t need = (<int64_t>self.slots[j].size + 7) & ~(<int64_t>7)
        self._out_room(need)              # may raise: nothing has moved yet
        if not self.upstream_done:
            self.in_upstream = True
            r = self.reader.c_next(&rec)  # may raise: the next call emits slot j again
            self.in_upstream = False
            self.next_j = -1
            self._out(j, need, out)       # out of the cell before the refill overwrites it
            if self.track:
                self.ring_a[self.emitted & RING_MASK] = self.slot_pos[j]
            self.emitted += 1
            if r == 1:
                if rl_shuffle_rare(rec.size <= self.cell and not rl_record_is_deferred(&rec)):
                    self._take_cell(j, &rec)
                else:
                    self._put(j, &rec, self._acquire(rec.block, rec.size))
                if self.track:
                    self._took(j)
                self._draw_ahead()
                return 1
            self.upstream_done = True
            self.done_at = self.emitted - 1
        else:
            self.next_j = -1
            self._out(j, need, out)
            if self.track:
                self.ring_a[self.emitted & RING_MASK] = self.slot_pos[j]
            self.emitted += 1
        self.count -= 1
        self.slots[j] = self.slots[self.count]
        if self.track:
            self.slot_pos[j] = self.slot_pos[self.count]
        self._draw_ahead()
        return 1

    cdef int _verify_slot(self, int64_t j) except -1 nogil:
        """Slot j holds a deferred record and the caller is not the batch that
        asked for it: a verified copy replaces it (or, failing, the slot is
        dropped and the error raised: reading on loses only that record, and
        get_state refuses this epoch, see ReaderBase._dropped)."""
        cdef int code
        cdef int64_t off, size = self._size(j)
        cdef rl_record cur
        cdef rl_block *nb
        self._get(j, &cur)
        nb = deferred_verified_copy(&cur, &self.layout, &code, &off)
        if nb == NULL:
            with gil:
                from readerlib.formats._recordio import _deferred_error_py
                err = _deferred_error_py(<size_t>cur.block, code, off,
                                         self.schema if code == RL_DEF_LAYOUT else None)
                self._dropped = str(err)
            self._release(self.slots[j].ref, size)
            self.count -= 1
            self.slots[j] = self.slots[self.count]
            if self.track:
                self.slot_pos[j] = self.slot_pos[self.count]
            self.track_ok = False           # a record is lost: the positions no longer add up
            self.next_j = -1
            with gil:
                raise err
        self._release(self.slots[j].ref, size)
        self.slots[j].ref = <uint32_t>self._acquire(nb, size)
        rl_block_decref(nb)               # the buffer's reference is the one left
        self.slots[j].data = nb.data
        return 0

    cdef inline void _took(self, int64_t s) noexcept nogil:
        # slot s now holds the source's record number src_pos (through filters:
        # the record the lowest filter read last, of the source below it)
        cdef int64_t p = self.src_pos
        if self.f_in != NULL:
            p = self.f_in[0] - 1
        if p >= (<int64_t>1 << 32) - 1:
            self.track_ok = False
        self.slot_pos[s] = <uint32_t>p
        self.src_pos += 1

    cdef inline uint64_t _draw(self) noexcept nogil:
        # the draw of step `emitted` (over `count` slots); every 64th step the
        # RNG before it is kept, so a restore can recompute the draws from there
        if self.track and (self.emitted & ((1 << ANCHOR_SHIFT) - 1)) == 0:
            self.ring_s[(self.emitted >> ANCHOR_SHIFT) & (ANCHORS - 1)] = self.rng
        return rl_rng_below(&self.rng, <uint64_t>self.count)

    cdef inline void _draw_ahead(self) noexcept nogil:
        # Same draws in the same order as drawing on demand; doing it now lets
        # the next record's first cache lines load while the caller copies.
        cdef rl_rng peek
        cdef uint64_t k
        if self.count > 0:
            self.next_j = <int64_t>self._draw()
            __builtin_prefetch(self.slots[self.next_j].data)
            __builtin_prefetch(self.slots[self.next_j].data + 63)
            if self.count > PEEK_MIN:
                # The two draws after it, computed on a copy of the RNG (the
                # real draws are untouched): the slot of the second one, and
                # the record of the first (whose slot came a step earlier),
                # so neither is a demand miss when the buffer is beyond L1.
                # They may turn out wrong (count changed): only a prefetch.
                peek = self.rng
                k = rl_rng_below(&peek, <uint64_t>self.count)
                __builtin_prefetch(self.slots[k].data)
                __builtin_prefetch(self.slots[k].data + 63)
                k = rl_rng_below(&peek, <uint64_t>self.count)
                __builtin_prefetch(&self.slots[k])

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._dropped = None
        self._restart()
        return self.reader.c_reset()

    # -- restore (set_state) ------------------------------------------------
    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # A fresh epoch positions without replaying where it can (_skip_fresh);
        # anything else drops items as c_next hands them out.
        cdef int64_t got
        if n <= 0:
            return 0
        if self.emitted == 0 and not self.filled and self.count == 0 and self.hold < 0:
            with gil:
                got = self._skip_fresh(n)
            if got >= 0:
                return got
        return ReaderBase.c_skip(self, n)

    def _skip_fresh(self, int64_t n):
        """Skip n items of an epoch not yet read without replaying it: from the
        buffer set_state saved (the same epoch), or the whole epoch when n is at
        least its length.  -1: neither applies (the caller replays)."""
        cdef int64_t got, N
        info = self._pending
        if info is not None and int(info.get("epoch", -1)) <= self.epoch:
            self._pending = None            # (an earlier epoch: a pass below a multi_pass)
            if int(info["epoch"]) == self.epoch and self.track and _addressable(self.ra_src):
                got = self._restore(n, info)
                if got >= 0:
                    return got
        from readerlib.readers._slice import length_of
        try:
            m = length_of(self.reader) if self.track else None
        except DataLossError:
            m = None                        # (a damaged file with no index: counted by reading, replay)
        if m is None and self.f_in != NULL:     # an earlier pass through the filters, if they saved it
            m = self.reader._saved_pass_outputs()
        if m is None or n < m:
            return -1
        N = m
        with nogil:
            got = self.reader.c_skip(N)
        # every record of the epoch has gone through: the buffer is empty
        self.src_pos = got
        self.emitted = got
        self.filled = True
        self.upstream_done = True
        self.done_at = 0
        self.track_ok = False
        return got

    def _restore(self, int64_t n, dict info):
        """Rebuild the buffer as it was after `n` items (see the design note); -1
        when the saved buffer cannot reach n (the caller replays)."""
        cdef int64_t E = int(info["emitted"]), t_a = int(info["anchor"])
        cdef int64_t cnt = int(info["count"]), D = int(info["done_at"]), src = int(info["source_position"])
        cdef int64_t i, s_, t, c, jj, a, cn
        cdef rl_rng g
        cdef rl_rng g_n
        cdef rl_record rec
        cdef int64_t[::1] pos
        cdef int64_t[::1] tail
        cdef int64_t[::1] js
        cdef uint64_t[::1] keys
        cdef uint64_t[::1] tmpk
        cdef int64_t[::1] order
        cdef int64_t which, lo, hi
        cdef int64_t lo_hi[2]
        cdef int by_chunk
        cdef int64_t[::1] starts
        cdef int64_t B = src, last_b, nrec, dup
        if n > E or n < t_a or E <= 0 or cnt < 0 or cnt > self.cap or t_a < 0:
            return -1
        where = "set_state: the shuffle's saved buffer is inconsistent"
        if src != E + cnt:                  # every record taken is handed out or buffered
            raise ValueError(f"{where} ({src} records taken, {E} handed out + {cnt} buffered)")
        if ("base_position" in info) != (self.f_in != NULL):
            raise ValueError(f"{where} (base_position: {'saved' if 'base_position' in info else 'missing'}, "
                             f"but the shuffle's source is {'' if self.f_in != NULL else 'not '}a filter)")
        if self.f_in != NULL:
            # positions in the source below the filters (see "Restore through filters")
            B = int(info["base_position"])
            below = self.ra_src
            while type(below).__name__ == "MapReader":   # (one record per record of its source)
                below = below.reader
            nrec = (<ReaderBase>below).c_num_records()
            if B < src or B >= (<int64_t>1 << 32) or (nrec >= 0 and B > nrec):
                raise ValueError(f"{where} (base_position {B}: the filters took {src} records "
                                 f"from a source of {nrec})")
        last_b = B
        if E - t_a > RING:                  # get_state saves at most RING steps (_resume_state)
            raise ValueError(f"{where} ({E - t_a} steps from the anchor {t_a} to {E}, "
                             f"more than the {RING} a state holds)")
        _phase_t[0] = rl_shuffle_now()
        pos_a = np.empty(max(self.cap, 1), np.int64)
        pos = pos_a
        _decode_positions(info["slots"], B, cnt, &pos[0], where)
        tail = _unpack_positions(info["tail"], B, E - t_a, where)
        rs = info["rng"]
        for i in range(4):
            g.s[i] = <uint64_t>int(rs[i])
        js = np.empty(max(E - n, 1), np.int64)
        g_n = g
        # the draws from the anchor on (the counts are known: the buffer is full
        # until the source runs out at step D, then shrinks by one a step)
        for t in range(t_a, E):
            if t == n:
                g_n = g
            c = _count_at(t, E, cnt, D)
            if c <= 0 or c > self.cap:
                raise ValueError(f"{where} (count {c} at step {t})")
            jj = <int64_t>rl_rng_below(&g, <uint64_t>c)
            if t >= n:
                js[t - n] = jj
        if n == E:
            g_n = g
        # undo steps E-1 .. n: the handed-out record goes back into its slot
        for t in range(E - 1, n - 1, -1):
            a = tail[t - t_a]
            jj = js[t - n]
            c = _count_at(t, E, cnt, D)
            if D < 0 or t < D:              # the slot was refilled with the source's next record
                if self.f_in != NULL:       # (through filters: positions only decrease going back)
                    if pos[jj] >= last_b:
                        raise ValueError(f"{where} (slot {jj} at step {t})")
                    last_b = pos[jj]
                elif pos[jj] != src - 1:
                    raise ValueError(f"{where} (slot {jj} at step {t})")
                pos[jj] = a
                src -= 1
            else:                           # the last slot had moved into it
                pos[c - 1] = pos[jj]
                pos[jj] = a
        cn = _count_at(n, E, cnt, D)
        # position the source, then take the buffer's records by index
        _phase_t[1] = rl_shuffle_now()
        with nogil:
            got = self.reader.c_skip(src)
        _phase_t[2] = rl_shuffle_now()
        if got != src:
            raise ValueError(f"set_state: the shuffle's source has {got} records, the saved "
                             f"buffer needs {src}")
        cdef bint populate = False          # the fresh slots and slot positions (_populate)
        if self.scap < cn:
            self._grow(cn)
            if _HUGE_ON:
                rl_shuffle_hugepages(self.slots, <size_t>cn * sizeof(_slot))
            populate = True
        order_a = np.empty(max(min(cn, RESTORE_PROBE), 1), np.int64)  # the first slots filled (_decide)
        order = order_a
        keys_a = np.empty(max(cn, 1), np.uint64)        # file order: each chunk loaded once
        keys = keys_a
        # grouped by chunk where the source says where its chunks start
        # (_chunk_order); else, or for the message on a duplicate, sorted
        starts_a = self._order_chunk_starts() if cn > 0 and _CHUNK_ORDER_ON else None
        by_chunk = -1
        if starts_a is not None:
            starts = starts_a
            if populate and _ORDER_WITH_POPULATE:
                with nogil:                 # (the fresh arrays populated meanwhile, on the pool)
                    by_chunk = _order_populating(&pos[0], cn, &starts[0], starts.shape[0] - 1, &keys[0],
                                                 lo_hi, self.slots, cn * <int64_t>sizeof(_slot),
                                                 self.slot_pos, cn * <int64_t>sizeof(uint32_t))
                populate = False
            else:
                with nogil:
                    by_chunk = _chunk_order(&pos[0], cn, &starts[0], starts.shape[0] - 1, &keys[0], lo_hi)
        if populate:
            with nogil:
                _populate(self.slots, cn * <int64_t>sizeof(_slot))
                _populate(self.slot_pos, cn * <int64_t>sizeof(uint32_t))
        if by_chunk != 0:
            tmp_a = np.empty(max(cn, 1), np.uint64)
            tmpk = tmp_a
            which = _file_order(&pos[0], cn, &keys[0], &tmpk[0]) if cn > 0 else 0
            if which:
                keys = tmpk
        self._fill_order = "chunk" if by_chunk == 0 else "position"
        _phase_t[3] = rl_shuffle_now()
        lo = 0
        hi = -1
        if by_chunk == 0:
            lo = lo_hi[0]
            hi = lo_hi[1]
        elif cn > 0:
            lo = pos[<int64_t><uint32_t>keys[0]] - <int64_t>(keys[0] >> 32)
            hi = lo + <int64_t>(keys[cn - 1] >> 32)
        dup = -1
        if by_chunk != 0:
            with nogil:                     # (sorted: one record in two slots is adjacent)
                for i in range(1, cn):
                    if (keys[i] >> 32) == (keys[i - 1] >> 32):
                        dup = i
                        break
        if dup >= 0:
            raise ValueError(f"{where} (slot positions: position "
                             f"{lo + <int64_t>(keys[dup] >> 32)} is in slots "
                             f"{<int64_t><uint32_t>keys[dup - 1]} and {<int64_t><uint32_t>keys[dup]})")
        if self.f_in != NULL:
            # the filters, positioned by their counts, are past every buffered record
            # and not past the next one to come (the last refill undone)
            if (cn > 0 and hi >= self.f_in[0]) or \
                    (last_b < B and self.f_in[0] > last_b) or self.f_in[0] > B:
                raise ValueError(f"{where} (base_position {B} and the positions do not fit the "
                                 f"filter's saved counts: it is at {self.f_in[0]})")
        cdef bint in_memory = self._in_memory()
        cdef bint copy = self.c_on and not in_memory
        self.count = 0
        self.i_restoring = True
        try:
            self._fill(&keys[0], lo, cn, copy, &order[0])
        except BaseException:
            for i in range(self.count):     # slots filled so far, in fill order (_fill)
                s_ = <int64_t><uint32_t>keys[(i + self.fill_off) % cn]
                self._unref(s_)
            self.count = 0
            # the fill's chunk cache (a descriptor, a chunk or two) too: a
            # failed restore holds nothing (a retry opens a fresh one)
            try:
                self._close_random_access()
            except BaseException:
                pass                        # (the fill's error is the one to see)
            raise
        finally:
            self.i_restoring = False
        _phase_t[5] = rl_shuffle_now()
        with nogil:                         # in slot order: one random write per record fewer
            for i in range(cn):
                self.slot_pos[i] = <uint32_t>pos[i]
        self._close_random_access()
        if not copy:
            # records left in their source blocks: an in-memory array (shared with
            # its view, nothing to free) or compaction off; no pass is due for them
            self.due = False
            self.since = 0
        # the blocks are the buffer's alone now: decide -- except an array's,
        # shared with its view (a run over it never probes either; deciding on
        # the first batch copied the whole buffer into cells: 30-60 ms for 1M)
        self.i_probe = not self.i_decided and not in_memory
        self.filled = True
        if D >= 0 and D < n:
            self.upstream_done = True
            self.done_at = D
        else:
            self.upstream_done = False
            self.done_at = -1
        self.rng = g_n
        self.next_j = -1
        self.emitted = n
        self.src_pos = src
        self.base_t = n
        self.base_rng = g_n
        self.track_ok = True
        self.restores += 1
        _phase_t[6] = rl_shuffle_now()
        return n

    cdef int _fill(self, const uint64_t *keys, int64_t lo, int64_t cn, bint copy,
                   int64_t *order) except -1:
        # The fill of keys [0, cn).  From a file: first the last RESTORE_PROBE
        # keys in file order, serially, up to the inline decision -- the newest
        # records, a chunk or two (the first ones are the oldest: at 90% of an
        # epoch they lie in a hundred chunks, all loaded before the decision);
        # then keys [0, cn - RESTORE_PROBE), on the pool when it is the plain
        # case (_fill_parallel), else serially.  fill_off: self.count counts
        # the slots filled in that order, key (i + fill_off) % cn the i-th.
        cdef int64_t uni = -1
        cdef int64_t off = cn - RESTORE_PROBE if copy and cn > RESTORE_PROBE else 0
        self.fill_off = off
        with nogil:
            self._fill_by_index(keys, lo, off, cn, cn, copy, order, &uni)
        _phase_t[4] = rl_shuffle_now()
        if off > 0 and not self._fill_parallel(keys, lo, 0, off, cn, copy, order, &uni):
            with nogil:
                self._fill_by_index(keys, lo, 0, off, cn, copy, order, &uni)
        return 0

    cdef bint _probe_uniform(self, const int64_t *order, int64_t n, int64_t uni) noexcept nogil:
        # Whether the probe's n slots (order[:n]) all hold inline records of
        # the preset size uni: the pieces' plain case.  Otherwise the records
        # vary in size (or are deferred, or too big for a cell) and a piece
        # would stop at the first one not of size uni, leaving nearly all of
        # it to the serial fill: the extra caches and the pool's wake-up
        # would buy nothing.
        cdef int64_t i, s
        if uni < 0:
            return False
        for i in range(n):
            s = order[i]
            if self.slots[s].ref != INL or <int64_t>self.slots[s].size != uni:
                return False
        return True

    cdef bint _fill_parallel(self, const uint64_t *keys, int64_t lo, int64_t first, int64_t last,
                             int64_t cn, bint copy, int64_t *order, int64_t *uni) except -1:
        """Keys [first, last) on the pool (see "the restore's parallel fill"
        above), after the probe; False, having done nothing, when that is not
        the case here."""
        cdef int T = _PAR_THREADS if _PAR_THREADS > 0 else num_threads()
        cdef _par_fill c
        cdef int64_t P, b, nb, i, ci, prev, total, acc, k, pos_, nchunks
        cdef int64_t[::1] cost
        cdef const int64_t *st
        cdef int64_t[::1] starts
        cdef int64_t[::1] bounds
        cdef int64_t[::1] stop
        cdef int[::1] tid_of
        cdef PyObject *caches[PAR_MAX_THREADS]
        cdef int t
        if T > PAR_MAX_THREADS:
            T = PAR_MAX_THREADS
        if not _PAR_EMULATE and (not _POOL_CONCURRENT or num_threads() < 2):
            # the pool would run every piece on the caller (a READERLIB_NO_THREADS
            # build, set_num_threads(1)): the extra caches would buy nothing
            return False
        if T < 2 or uni[0] < 0 or self.cells == NULL or last - first < max(_PAR_MIN_RECORDS, 1):
            return False
        if not self._probe_uniform(order, min(cn - last, <int64_t>RESTORE_PROBE), uni[0]):
            return False
        from readerlib.readers._random_access import ChunkCache, open_random_access
        ra = self.ra_src._random_access
        if type(ra) is not ChunkCache:
            return False
        starts_a = np.ascontiguousarray(ra.chunk_starts(), dtype=np.int64)
        starts = starts_a
        nchunks = starts.shape[0] - 1
        # pieces of about equal cost: a record write each, a chunk load each
        # chunk the keys reach into (estimated a block of PAR_BLOCK keys at a time)
        P = T * PAR_PIECES_PER_THREAD
        nb = (last - first + PAR_BLOCK - 1) // PAR_BLOCK
        cost_a = np.empty(nb + 1, np.int64)
        bounds_a = np.empty(P + 1, np.int64)
        stop_a = np.empty(P, np.int64)
        tid_a = np.full(P, -1, np.intc)
        times_a = np.zeros(2 * P, np.float64)
        moved_a = np.zeros(P, np.intc)
        cdef double[::1] times = times_a
        cdef int[::1] moved = moved_a
        bounds = bounds_a
        stop = stop_a
        tid_of = tid_a
        cost = cost_a
        st = &starts[0]
        with nogil:
            ci = 0
            prev = -1
            acc = 0
            cost[0] = 0
            for b in range(nb):
                k = min(first + (b + 1) * PAR_BLOCK, last)
                pos_ = lo + <int64_t>(keys[k - 1] >> 32)
                while ci + 1 < nchunks and st[ci + 1] <= pos_:
                    ci += 1
                acc += (k - first - b * PAR_BLOCK) + (ci - prev) * PAR_LOAD_COST
                prev = ci
                cost[b + 1] = acc
            total = acc
            bounds[0] = first
            b = 0
            for i in range(1, P):
                while b < nb and cost[b] * P < total * i:
                    b += 1
                # on the nearest chunk boundary (the keys are in chunk order):
                # a chunk cut between two pieces was loaded by both
                bounds[i] = max(_chunk_edge(keys, lo, st, nchunks, min(first + b * PAR_BLOCK, last),
                                            first, last), bounds[i - 1])
            bounds[P] = last
        extra = []
        try:
            caches[0] = <PyObject *>ra
            for t in range(1, T):
                try:
                    e = open_random_access(self.ra_src)
                except Exception:
                    # (too many open files, the file replaced since the fill's
                    # own cache opened it...): the serial fill needs no second
                    # cache, and an error here is none it would have raised
                    return False
                extra.append(e)
                if type(e) is not ChunkCache:
                    return False
                caches[t] = <PyObject *>e
            c.keys = keys
            c.lo = lo
            c.cells = self.cells
            c.cell = self.cell
            c.uni = uni[0]
            c.bounds = &bounds[0]
            c.stop = &stop[0]
            c.tid_of = &tid_of[0]
            c.times = &times[0]
            c.caches = caches
            c.fatal = NULL
            c.moved = &moved[0]
            c.caller_cpu = rl_current_cpu() if _SPREAD_ON and not _PAR_EMULATE else -1
            for i in range(P):
                stop[i] = bounds[i]
            loads0 = sum((<object>caches[t]).chunk_loads for t in range(T))
            with nogil:
                if _PAR_EMULATE:
                    for i in range(P):
                        _par_fill_body(&c, i, i + 1, <int>(i % T))
                else:
                    parallel_for(T, P, _par_fill_body, &c)
        finally:
            _close_all(extra)
        if c.fatal != NULL:
            err = <object>c.fatal
            Py_DECREF(err)
            raise err
        self._par_tids = tid_a
        self._par_moved = moved_a
        self._par_loads = ra.chunk_loads + sum(e.chunk_loads for e in extra) - loads0
        self._par_times = times_a.reshape(P, 2) - _phase_t[4]
        self._par_bounds = bounds_a
        # what the pieces left (a record of another size, a deferred one, an
        # error): serially, in file order, raising the format's own error
        for i in range(P):
            self.n_inlined += stop[i] - bounds[i]
        for i in range(P):
            self.count = (cn - last) + (stop[i] - first)     # (fill order: the probe came first)
            if stop[i] < bounds[i + 1]:
                with nogil:
                    self._fill_by_index(keys, lo, stop[i], bounds[i + 1], cn, copy, order, uni)
        self.count = (cn - last) + (last - first)
        return True

    cdef int _fill_by_index(self, const uint64_t *keys, int64_t lo, int64_t begin, int64_t end,
                            int64_t cn, bint copy, int64_t *order, int64_t *uni_) except -1 nogil:
        # slot keys[i] & 0xFFFFFFFF <- the source's record lo + (keys[i] >> 32)
        # (_file_order), for i in [begin, end); self.count counts the slots
        # filled (in that order; it is begin on entry), for the caller's
        # cleanup on an error.
        # copy: small records are copied into the shuffle's own arena blocks
        # as they are read (file sources, compaction on): the buffer's records
        # are scattered over many chunks, which the first compaction pass after
        # the restore would otherwise copy them out of (a 1M buffer: 55-100 ms
        # on the first batch), and only two chunks are held at a time.
        # Deferred (mapped, unverified) records never are.  Records that fit
        # the inline cell (when inlining is on) go into their slots' cells;
        # from a file, whether to inline is decided after the first
        # RESTORE_PROBE records (not on the first batch after the fill).
        # order[i - begin]: the slot filled i-th, for the first RESTORE_PROBE (for
        # _decide, which may run mid-fill; order holds no more).
        # slot_pos is written by the caller afterwards, in slot order.
        # uni >= 0: the slots not filled yet were preset in slot order as in
        # their cells with records of uni bytes (_preset_cells), so a record of
        # that size only writes its cell: one random write a record, not two.
        cdef int64_t i, s_, nx, at, uni = uni_[0]
        cdef rl_record rec
        cdef char *p
        for i in range(begin, end):
            if i + 32 < end:                    # the slot written 32 records from now
                nx = <int64_t><uint32_t>keys[i + 32]
                if uni < 0:
                    __builtin_prefetch(&self.slots[nx], 1)
                if self.cells != NULL:          # and its cell (random writes: store-bound without)
                    __builtin_prefetch(self.cells + nx * self.cell, 1)
            s_ = <int64_t><uint32_t>keys[i]
            if i - begin < RESTORE_PROBE:
                order[i - begin] = s_
            at = lo + <int64_t>(keys[i] >> 32)
            self.ra_src.c_read_at(at, &rec)
            if rec.size <= self.cell and not rl_record_is_deferred(&rec):   # inline: into its cell (see _take)
                if rec.size == uni:             # its slot says so already
                    rl_shuffle_copy_small(self.cells + s_ * self.cell, rec.data, <size_t>rec.size)
                    self.n_inlined += 1
                else:
                    self._take_cell(s_, &rec)
            else:
                p = NULL
                if copy and rec.size < COMPACT_MAX_RECORD and not rl_record_is_deferred(&rec):
                    p = self._arena_alloc(rec.size)
                if p != NULL:
                    memcpy(p, rec.data, <size_t>rec.size)
                    self.slots[s_].data = p
                    self.slots[s_].size = <uint32_t>rec.size
                    self.slots[s_].ref = <uint32_t>self._arena_take(rec.size)
                else:
                    self._put(s_, &rec, self._acquire(rec.block, rec.size))
            self.count += 1
            if self.i_probe or (copy and self.count == RESTORE_PROBE and not self.i_decided):
                # from a file the records are copied anyway and the chunk cache
                # lets go of each chunk: decide now, from the sizes so far, so
                # that the rest go straight into cells (deciding after the fill
                # re-copied every arena copy into a cell on the first batch: a
                # 1M buffer's random reads cost 30-65 ms there)
                self._decide(order, min(i + 1 - begin, <int64_t>RESTORE_PROBE))
                if self.cells != NULL and uni < 0:
                    uni = self._preset_cells(keys + begin, i + 1 - begin, cn)
                    uni_[0] = uni
        return 0

    cdef int64_t _preset_cells(self, const uint64_t *keys, int64_t filled, int64_t cn) noexcept nogil:
        """Slots 0..cn-1 not among the `filled` first of `keys`, in slot order:
        in their cells, holding records of u bytes, u the size of the last
        record filled (which is inline); returns u, or -1 (nothing preset:
        it is not inline, or no scratch).  The fill then overwrites a preset
        slot whose record is of another size or not inlined; a slot not
        reached (an error) is never read (count says which were filled)."""
        cdef int64_t j, s, u
        cdef _slot *saved
        cdef _preset pc
        if filled <= 0:
            return -1
        s = <int64_t><uint32_t>keys[filled - 1]
        if self.slots[s].ref != INL:
            return -1
        u = self.slots[s].size
        saved = <_slot *>malloc(filled * sizeof(_slot))
        if saved == NULL:
            return -1
        for j in range(filled):
            saved[j] = self.slots[<int64_t><uint32_t>keys[j]]
        pc.slots = self.slots
        pc.cells = self.cells
        pc.cell = self.cell
        pc.size = <uint32_t>u
        parallel_for(threads_for(cn * (<int64_t>sizeof(_slot) + self.cell)), cn, _preset_body, &pc)
        for j in range(filled):
            self.slots[<int64_t><uint32_t>keys[j]] = saved[j]
        free(saved)
        return u

    def _order_chunk_starts(self):
        """Where the restore's source's chunks start (int64, one past the last
        at the end), for the fill's chunk order (_chunk_order); None when it
        does not say (the fill's order is then sorted by position)."""
        from readerlib.formats._recordio import RecordIOReader
        from readerlib.readers._random_access import ChunkCache
        src = self.ra_src
        while type(src).__name__ == "MapReader":    # (reads through it: its source's)
            src = src.reader
        ra = (<ReaderBase>src)._random_access
        if type(ra) is ChunkCache:
            return np.ascontiguousarray(ra.chunk_starts(), dtype=np.int64)
        if type(src) is RecordIOReader:
            _, nrec = src.chunk_table()
            return np.concatenate([[0], np.cumsum(np.asarray(nrec, dtype=np.int64))]).astype(np.int64)
        return None

    def _in_memory(self):
        # the source's random access is a view of an array in memory
        # (readers/_random_access.pyx _ArrayRecords: no descriptor, no cache):
        # referencing its records costs nothing, copying them would
        cdef ReaderBase src = self.ra_src
        if src._random_access is None and type(src).__name__ == "ArrayReader":
            src._random_access = src._open_random_access()
        return type(src._random_access).__name__ == "_ArrayRecords"

    def _close_random_access(self):
        # the buffer holds references to the records it took; the chunk cache
        # (a second descriptor, 2 chunks) is not needed any more.  An in-memory
        # view stays: the array block it shares with the buffer is then not
        # one that compaction would copy records out of (to free nothing)
        cdef ReaderBase src = self.ra_src
        while type(src).__name__ == "MapReader":    # (reads through it: its source's cache)
            src = src.reader
        ra = src._random_access
        if ra is not None and type(src).__name__ != "GlobalShuffleReader" and not self._in_memory():
            src._random_access = None
            ra.close()

    def _resume_state(self, above):
        """get_state's live part: what rebuilds this buffer without replaying the
        epoch (None when that is not possible here: the caller replays)."""
        cdef int64_t E = self.emitted, lo, want, t_a, i, k
        cdef rl_rng g
        if (not self.track or not self.track_ok or E <= 0 or not self.filled
                or not _addressable(self.ra_src)
                or (self.in_upstream and self.f_in == NULL)
                or (self._filters is not None and not self._filters_exact())):
            return {"buffer": None}
        G = _ahead_bound(above, self)
        lo = max(self.base_t, E - RING + 64, 0)
        want = lo if G is None else max(E - <int64_t>G, lo)
        # t_a: the latest step <= want whose RNG is known (an anchor every 64th
        # step, the restore point, or now), else the earliest one after it
        t_a = -1
        if lo <= self.base_t <= want:
            t_a = self.base_t
        i = (want >> ANCHOR_SHIFT) << ANCHOR_SHIFT
        if lo <= i and i > t_a and (i < E or self.next_j >= 0):
            t_a = i
        if t_a < 0:
            i = ((lo + 63) >> ANCHOR_SHIFT) << ANCHOR_SHIFT
            if i < E or (i == E and self.next_j >= 0):
                t_a = i
            elif self.next_j < 0:
                t_a = E
            else:
                return {"buffer": None}
        if t_a == self.base_t:
            g = self.base_rng
        elif t_a == E and self.next_j < 0:
            g = self.rng
        else:
            g = self.ring_s[(t_a >> ANCHOR_SHIFT) & (ANCHORS - 1)]
        k = E - t_a
        tail_a = np.empty(max(k, 1), np.uint32)
        cdef uint32_t[::1] tail = tail_a
        for i in range(k):
            tail[i] = self.ring_a[(t_a + i) & RING_MASK]
        B = self.f_in[0] if self.f_in != NULL else self.src_pos   # (filters: >= every position)
        buf = {
            "epoch": int(self.epoch), "emitted": int(E), "source_position": int(self.src_pos),
            "count": int(self.count), "done_at": int(self.done_at), "anchor": int(t_a),
            "rng": [int(g.s[0]), int(g.s[1]), int(g.s[2]), int(g.s[3])],
            "slots": _pack_ages(self.slot_pos, self.count, B),
            "tail": _pack_ages(&tail[0], k, B)}
        if self.f_in != NULL:
            buf["base_position"] = int(B)    # positions are in the source below the filters
        return {"buffer": buf}

    def _check_filters(self):
        if not self._filters_exact():
            self.track_ok = False

    def _filters_exact(self):
        # the filters' counts are exact (a predicate that raised keeps them so;
        # an error below them does not): positions taken through them hold
        return self._filters is not None and all(f._counts_exact() for f in self._filters)

    def _restores_through_filters(self):
        """True: this shuffle's source is filters over a source with random access
        (its restore positions them by their saved counts, _upstream_ahead)."""
        return self.f_in != NULL

    cdef int c_close(self) except -1:
        self._drop()
        # no slot refers to a cell now: a later epoch (a reopened source) decides again
        free(self.cells)
        self.cells = NULL
        self.cell = -1
        self.i_decided = not self.i_on
        self.i_probe = False
        self.i_tries = 0
        self.reader.close()
        return 0

    @property
    def buffer_size(self):
        return self.cap

    def _memory_stats(self):
        """Test hook: what the buffer holds now.  `pinned_bytes`: the sizes of
        the distinct blocks it references; `payload_bytes`: of the records it
        references; `passes` / `copied_records` / `copied_bytes`: compaction so
        far; `cell` (0: not inlining), `cells_bytes` (allocated),
        `inline_records` / `inline_payload_bytes` (in cells now),
        `inlined_records` (copied into cells so far)."""
        cdef int64_t i, blocks = 0, inl = 0, inl_bytes = 0
        for i in range(self.btab_hw):
            if self.btab[i].block != NULL:
                blocks += 1
        for i in range(self.count):
            if self.slots[i].ref == INL:
                inl += 1
                inl_bytes += self.slots[i].size
        return {"pinned_bytes": int(self.pinned), "payload_bytes": int(self.payload),
                "blocks": int(blocks), "passes": int(self.n_passes),
                "copied_records": int(self.n_copied), "copied_bytes": int(self.n_copied_bytes),
                "cell": int(max(self.cell, 0)), "cells_bytes": int(self.scap * self.cell if self.cells != NULL else 0),
                "inline_records": int(inl), "inline_payload_bytes": int(inl_bytes),
                "inlined_records": int(self.n_inlined)}

    def _pinned_bytes(self):
        """Test hook: bytes of the distinct blocks the buffer references now."""
        return int(self.pinned)

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    def _describe(self):
        # a drawn seed is not part of what the chain is: a restore adopts the saved one
        d = {"buffer_size": int(self.cap)}
        if not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def _check_epoch_state(self, state):
        _check_saved_seed_epoch(state)
        buf = state.get("buffer")
        if buf is not None and not isinstance(buf, dict):
            raise ValueError(f"the shuffle's saved buffer must be a dict, got {type(buf).__name__}")
        if buf is not None:
            _check_saved_buffer(buf)

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])      # (checked: _check_epoch_state)
        self.epoch = int(state["epoch"])
        self._restart()
        self._pending = state.get("buffer")

    def _reduce_args(self):
        return (int(self.cap),), {"seed": None if self.seed_drawn else int(self.seed)}

    def __repr__(self):
        return f"ShuffleReader({self.reader!r}, buffer_size={self.cap}, seed={self.seed})"


