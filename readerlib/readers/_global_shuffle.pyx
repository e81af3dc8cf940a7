# cython: freethreading_compatible=False
"""A global shuffle over random-access sources, and a window shuffle for streams.

Design:
    GlobalShuffleReader visits every record of a source with random access
    once per epoch, in a permutation that is a pure function of
    (seed, epoch) -- nothing of size O(records) is stored, and the record
    at position p is found from p alone, so set_state is O(1).

    The permutation has two levels:
      1. the source's chunks are permuted by a keyed Feistel bijection over
         the next even power of two >= the chunk count, with cycle walking
         (Grain's index_shuffle, TF's random_index_shuffle; key from
         (seed, epoch)); consecutive runs of `window_chunks` permuted chunks
         form windows;
      2. the records of window k are permuted among themselves by a
         Fisher-Yates shuffle drawn from a generator seeded by
         (seed, epoch, k): a uniform permutation of the window.
    Position p falls in window k (window starts: O(chunks) integers, per
    epoch) and maps to record `start of its chunk + offset`.

    Cost.  Reading window k loads its chunks once each, in file order
    (sequential-ish I/O: chunks in a permuted order), keeps a description of
    each (base + stride for fixed-size records packed in one block, else a
    copy of its record table) and one reference per block, and draws the
    window's order: 4 bytes a record, one pass.  c_next is then a sequential
    read of that order, a branch-free chunk lookup (<= 16 chunks) and a
    pointer computation; it prefetches the record RING positions ahead, since
    consecutive records come from anywhere in megabytes of chunks.  A
    restore computes the window's order again (O(window), about a
    millisecond per 100k records) when it reads the window's chunks anyway.
    The first version evaluated a Feistel network per record and looked
    each record up in the chunk cache: 3.6 Mrec/s of 64-byte records from
    RecordIO (0.27x the buffer shuffle) in one run here; 6.4 and 9.2 Mrec/s
    (0.70x and 1.14x the buffer shuffle, same runs) after
    (benchmarks/results/global_shuffle.md).

    Random access to the shuffled order (`g[i]`, `permutation()`) draws the
    order of i's window into a second table, so it never disturbs the
    window the sequential path is reading.

    WindowShuffleReader (``shuffle(n, mode="window")``, Grain's WindowShuffle)
    permutes each run of `window_size` consecutive items of any reader, the
    permutation drawn from (seed, epoch, window index) by an inside-out
    Fisher-Yates pass when the window is filled (as a global shuffle's
    window).  A restore skips the windows before the position (c_skip: free
    over an indexed source) and reads one window: at most `window_size`
    items are replayed, wherever the position is in the epoch.  Until
    2026-12-05 the permutation was the Feistel bijection's, evaluated per
    item (28-45 ns an item with its cycle walking, 3-4x the whole buffer
    shuffle's cost a record in memory); a state saved then (no "order" key)
    restores to that order, which the reader keeps from then on.
"""
import os
import warnings

import numpy as np
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memset

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, DecoratedReader, rl_record, rl_block, rl_block_incref, rl_block_decref,
    rl_hash3, rl_core_import, ITEM_INSTANCE)
from readerlib.readers._base import _check_positive_int, _check_reader, _check_saved_seed_epoch
from readerlib._mapped cimport (
    rl_mapped_import, rl_record_is_deferred, rl_deferred_may_go_out, hand_out_verified)
from readerlib.errors import DataLossError, RecordIOWarning

rl_core_import()
rl_mapped_import()

__all__ = ["GlobalShuffleReader", "WindowShuffleReader"]

DEF ROUNDS = 4                  # Luby-Rackoff: 4 rounds of a pseudo-random function give a strong PRP
cdef uint64_t _UNITS = 0x756e697473        # key domains ("units", "window")
cdef uint64_t _WINDOW = 0x77696e646f77
DEF RING = 16                   # c_next requests a record's first cache line this many positions ahead


cdef extern from *:
    """
    #define rl_gs_prefetch(p) __builtin_prefetch((const void *)(p), 0, 0)
    /* The window shuffle's: into every level (a non-temporal request, the
     * global shuffle's, left an in-memory source's records at DRAM latency
     * for the batch's copy: 51 against 32 ns a record, 64 B, window 10k) */
    #define rl_ws_prefetch(p) __builtin_prefetch((const void *)(p), 0, 3)
    /* wyrand (Wang Yi): one 128-bit multiply a draw; below(n): Lemire's
       multiply-shift into [0, n) (bias < n / 2^64, unmeasurable here) */
    static inline uint64_t rl_gs_below(uint64_t *s, uint64_t n) {
        *s += 0xa0761d6478bd642fULL;
        __uint128_t t = (__uint128_t)*s * (*s ^ 0xe7037ed1a0b428dbULL);
        uint64_t x = (uint64_t)(t >> 64) ^ (uint64_t)t;
        return (uint64_t)(((__uint128_t)x * n) >> 64);
    }
    """
    void rl_gs_prefetch(const void *p) noexcept nogil
    void rl_ws_prefetch(const void *p) noexcept nogil
    uint64_t rl_gs_below(uint64_t *s, uint64_t n) noexcept nogil


cdef struct _feistel:
    uint64_t key
    uint64_t rk[ROUNDS]                    # round keys, from key
    uint64_t n
    int half
    uint64_t mask


cdef inline void _feistel_init(_feistel *f, uint64_t key, uint64_t n) noexcept nogil:
    cdef int bits = 1
    while bits < 64 and (<uint64_t>1 << bits) < n:
        bits += 1
    bits += bits & 1                       # an even width: two equal halves
    cdef int r
    f.key = key
    for r in range(ROUNDS):
        f.rk[r] = rl_hash3(key, <uint64_t>r, 0x726f756e64)
    f.n = n
    f.half = bits >> 1
    f.mask = (<uint64_t>1 << f.half) - 1


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    # the round function: a 64-bit finaliser (multiply / xor-shift, as
    # splitmix64's) of the half block xor a per-round key -- 2 multiplies
    x ^= x >> 31
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 29
    x *= <uint64_t>0x94d049bb133111eb
    return x ^ (x >> 32)


cdef inline uint64_t _feistel_round_trip(const _feistel *f, uint64_t x) noexcept nogil:
    cdef uint64_t L = x >> f.half, R = x & f.mask, t
    cdef int r
    for r in range(ROUNDS):
        t = L ^ (_mix(R ^ f.rk[r]) & f.mask)
        L = R
        R = t
    return (L << f.half) | R


cdef inline uint64_t _permute(const _feistel *f, uint64_t x) noexcept nogil:
    """A bijection of [0, n): x's image (cycle walking keeps it in range)."""
    if f.n <= 1:
        return 0
    x = _feistel_round_trip(f, x)
    while x >= f.n:
        x = _feistel_round_trip(f, x)
    return x


def _permute_py(uint64_t x, uint64_t n, uint64_t key):
    """Test hook: the Feistel bijection of [0, n) under `key`, at x."""
    cdef _feistel f
    if x >= n:
        raise ValueError(f"x must be in [0, {n}), got {x}")
    _feistel_init(&f, key, n)
    return int(_permute(&f, x))


def _check_seed(seed):
    if seed is None:
        return int.from_bytes(os.urandom(8), "little"), True
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return int(seed) & 0xFFFFFFFFFFFFFFFF, False


cdef struct _wchunk:            # one chunk of the window the sequential path reads
    rl_block *block             # fixed-size records packed in one block: record o at base + o * stride
                                # (a chunk lost this epoch: block NULL, base NULL, stride 0)
    const char *base
    int64_t stride
    rl_record *recs             # otherwise its records (rtab); NULL when strided
    rl_record *rtab
    int64_t rcap


cdef struct _order:             # one window's order: tab[i] = window-local record at its position i
    int64_t k                   # the window (-1: none)
    int64_t n                   # records in it
    int64_t nch                 # chunks in it
    int64_t *cum                # window-local record index of chunk j's first record (nch + 1)
    uint32_t *tab
    int64_t cap


cdef inline void _fisher_yates(uint32_t *tab, int64_t n, uint64_t key) noexcept nogil:
    # tab[0..n) = a uniform permutation of [0, n) drawn from `key`: inside-out
    # Fisher-Yates, one pass, the table's random accesses independent
    cdef uint64_t st = key
    cdef int64_t i, j
    for i in range(n):
        j = <int64_t>rl_gs_below(&st, <uint64_t>(i + 1))
        tab[i] = tab[j]
        tab[j] = <uint32_t>i


cdef int _order_make(_order *o, int64_t k, int64_t n, int64_t nch, uint64_t key) except -1 nogil:
    """o.tab = a uniform permutation of [0, n) drawn from `key` (o.cum: the caller's)."""
    cdef uint32_t *t2
    o.k = -1
    if n > <int64_t>0xFFFFFFFF:
        with gil:
            raise ValueError(f"global_shuffle: a window of {n} records; use a smaller window_chunks")
    if n > o.cap:
        t2 = <uint32_t *>realloc(o.tab, n * sizeof(uint32_t))
        if t2 == NULL:
            with gil:
                raise MemoryError(f"global_shuffle: a window of {n} records")
        o.tab = t2
        o.cap = n
    _fisher_yates(o.tab, n, key)
    o.n = n
    o.nch = nch
    o.k = k
    return 0


cdef inline int64_t _order_chunk(const _order *o, int64_t r) noexcept nogil:
    """The window slot j whose chunk holds window-local record r."""
    cdef int64_t j = 0, jj
    if o.nch <= 16:
        for jj in range(1, o.nch):         # branch-free: records are random, a branch mispredicts
            j += o.cum[jj] <= r
        return j
    while o.cum[j + 1] <= r:
        j += 1
    return j


# ------------------------------------------------------------------ global
_MAX_WINDOW_CHUNKS = (1 << 30)


cdef int _LOST_HISTORY = 4096      # losses a GlobalShuffleReader keeps for its states (see _resume_state)


cdef class GlobalShuffleReader(DecoratedReader):
    """Every record of a random-access source once per epoch, globally shuffled.

    The order is a function of (seed, epoch) only (see the module's Design):
    the same seed gives the same order, each `reset()` starts a new epoch
    with a new order, and `set_state` jumps to any position without reading
    what comes before it.  Chunks are visited in a permuted order, records
    are permuted within each window of `window_chunks` chunks; each chunk is
    loaded once per epoch.

    Parameters
    ----------
    reader : ReaderBase
        A source with random access: RecordIOReader, TFRecordReader (its
        index is built on first use), ArrayReader, RandomDataGenerator,
        open_files(...) over such files.
    seed : int, optional
        Pass `seed=` to make the order reproducible (required when several
        processes read shards of one order, e.g. DataLoader workers); without
        it a seed is drawn from the OS once and travels in the state.
    window_chunks : int
        Chunks whose records are mixed together (memory: that many chunks,
        plus 4 bytes a record of the window for its order).

    Raises
    ------
    TypeError
        `reader` has no random access (a stream or a decorated chain: put
        global_shuffle directly on the source, decorators after it).
    DataLossError
        From read_next, once, when a chunk fails to load (the format's error,
        naming file, chunk and offset; a source opened with on_error="skip"
        skips it with its RecordIOWarning instead).  Reading on gives every
        other record of the epoch once, where the permutation puts it.  A
        state saved after it records the lost chunks (version 4) and
        restores exactly, without loading them again; under a prefetcher
        get_state raises RuntimeError naming the chunk until the next epoch.

    Examples
    --------
    >>> r = rl.RecordIOReader("train.rio").global_shuffle(seed=0).batch(256)
    >>> r.set_state(saved)      # O(1): no record before the position is read
    """
    cdef ReaderBase ra              # the source's records by index (open_random_access)
    cdef int64_t *ustart            # chunk c holds records [ustart[c], ustart[c + 1])
    cdef int64_t nunits
    cdef readonly int64_t num_records
    cdef readonly int64_t window_chunks
    cdef int64_t wcap               # window slots allocated: min(window_chunks, chunks)
    cdef int64_t *slot_unit         # this epoch: chunk order
    cdef int64_t *wstart            # window k: positions [wstart[k], wstart[k + 1])
    cdef int64_t nwin
    cdef int64_t pos
    cdef int64_t owed               # items a c_skip claimed inside the window at pos, not read yet (_step)
    cdef _feistel uperm
    # the sequential path's window (see _build): its order, chunks and block references
    cdef _order seq
    cdef _wchunk *wch               # window_chunks of them
    cdef rl_block **wblocks         # one reference per run of records from one block
    cdef int64_t nwb
    cdef int64_t wbcap
    cdef rl_record ring[RING]       # the records of the next RING positions, their data prefetched
                                    # (block NULL: a record of a lost chunk, skipped)
    cdef int64_t rnext              # window-local position the ring starts at (-1: refill)
    cdef bint wdeferred             # the window holds descriptors (built while a batch above pulled)
    # random access (c_read_at, permutation): a second window order, so that g[i]
    # never invalidates the sequential path's window
    cdef _order rnd
    # chunks whose load failed with the format's error this epoch (_lose): their
    # records are skipped where the permutation puts them
    cdef char *ulost                # per chunk: 1 when lost
    cdef int64_t *lost_at           # per lost chunk: the position when it was lost (its places
                                    # before it were stepped over by c_skip, as items)
    cdef int64_t nlost
    cdef int64_t loading            # the chunk _build is reading (-1: none)
    cdef list _lost_hist            # [epoch, chunk, position] of every loss of the recent epochs
    cdef int64_t _hist_cut          # losses of epochs <= this were dropped from _lost_hist (-1: none)
    cdef list _lost_pending         # set_state's losses of later epochs (passes of a multi_pass above)
    cdef bint _saved_lost           # the last _resume_state saved losses (its state is version 4)
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn

    def __cinit__(self):
        self.seq.k = -1
        self.rnd.k = -1
        self.rnext = -1
        self.loading = -1
        self._lost_hist = []
        self._hist_cut = -1

    def __init__(self, reader, seed=None, window_chunks=8):
        _check_reader(reader, "GlobalShuffleReader")
        w = _check_positive_int(window_chunks, "window_chunks")
        if w > _MAX_WINDOW_CHUNKS:          # (the chunk cache's size is a C int)
            raise ValueError(f"window_chunks must be <= {_MAX_WINDOW_CHUNKS}, got {w}")
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError("global_shuffle shuffles a source's records; this reader yields batches "
                            "(call .global_shuffle() before .batch())")
        if (<ReaderBase>reader).c_num_records() < 0:
            reader._open_random_access()      # raises TypeError naming the reader
        s, drawn = _check_seed(seed)
        DecoratedReader.__init__(self, reader)
        from readerlib.readers._random_access import open_random_access
        # a window never holds more chunks than the source has (nor, but for
        # empty chunks, than it has records): what is allocated for one is
        # sized by that, so window_chunks=10**9 ("one window: all of it") over
        # a small file costs what the file's chunk count does
        n0 = (<ReaderBase>reader).c_num_records()
        self.ra = open_random_access(reader, int(w if n0 < 0 else min(w, max(n0, 1))) + 1)
        starts = self.ra.chunk_starts()
        cdef int64_t i
        self.nunits = starts.shape[0] - 1
        self.num_records = int(starts[self.nunits])
        self.window_chunks = w
        self.wcap = min(w, max(self.nunits, 1))
        self.ustart = <int64_t *>malloc((self.nunits + 1) * sizeof(int64_t))
        self.slot_unit = <int64_t *>malloc(max(self.nunits, 1) * sizeof(int64_t))
        self.nwin = (self.nunits + w - 1) // w
        self.wstart = <int64_t *>malloc((self.nwin + 1) * sizeof(int64_t))
        self.seq.cum = <int64_t *>malloc((self.wcap + 1) * sizeof(int64_t))
        self.rnd.cum = <int64_t *>malloc((self.wcap + 1) * sizeof(int64_t))
        self.wch = <_wchunk *>calloc(self.wcap, sizeof(_wchunk))
        self.ulost = <char *>calloc(max(self.nunits, 1), 1)
        self.lost_at = <int64_t *>calloc(max(self.nunits, 1), sizeof(int64_t))
        if not (self.ustart and self.slot_unit and self.wstart and self.seq.cum and self.rnd.cum
                and self.wch and self.ulost and self.lost_at):
            raise MemoryError(f"global_shuffle: {self.nunits} chunks, windows of {self.wcap}")
        for i in range(self.nunits + 1):
            self.ustart[i] = starts[i]
        self.seed = <uint64_t>s
        self.seed_drawn = drawn
        self.epoch = 0
        self._plan()

    def __dealloc__(self):
        cdef int64_t j
        if <void *>self.ra == NULL:
            return                   # half-made (ReaderBase.__cinit__ failed): see _base.pyx
        self._drop_window()
        if self.wch != NULL:
            for j in range(self.wcap):
                free(self.wch[j].rtab)
            free(self.wch)
            self.wch = NULL
        free(self.wblocks)
        self.wblocks = NULL
        free(self.seq.tab); free(self.seq.cum); free(self.rnd.tab); free(self.rnd.cum)
        self.seq.tab = self.rnd.tab = NULL
        self.seq.cum = self.rnd.cum = NULL
        free(self.ustart); free(self.slot_unit); free(self.wstart)
        self.ustart = self.slot_unit = self.wstart = NULL
        free(self.ulost)
        self.ulost = NULL
        free(self.lost_at)
        self.lost_at = NULL

    # -- the plan: chunk order and windows ------------------------------------
    cdef void _plan(self) noexcept nogil:
        """This epoch's chunk order and window starts (O(chunks))."""
        cdef int64_t s, k, u, acc = 0
        _feistel_init(&self.uperm, rl_hash3(self.seed, <uint64_t>self.epoch, _UNITS),
                      <uint64_t>self.nunits)
        for s in range(self.nunits):
            self.slot_unit[s] = <int64_t>_permute(&self.uperm, <uint64_t>s)
        for k in range(self.nwin):
            self.wstart[k] = acc
            for s in range(k * self.window_chunks, min64((k + 1) * self.window_chunks, self.nunits)):
                u = self.slot_unit[s]
                acc += self.ustart[u + 1] - self.ustart[u]
        self.wstart[self.nwin] = acc
        self.rnd.k = -1
        self._drop_window()
        self.pos = 0
        self.owed = 0

    cdef int64_t _window_of(self, int64_t p) noexcept nogil:
        """The window holding position p (0 <= p < num_records)."""
        cdef int64_t lo = 0, hi = self.nwin - 1, mid
        if self.seq.k >= 0 and p >= self.wstart[self.seq.k]:
            lo = self.seq.k                # reading on: this window or one after it
            if lo + 1 >= self.nwin or p < self.wstart[lo + 1]:
                return lo
        while lo < hi:                     # the last window starting at or before p
            mid = (lo + hi + 1) >> 1
            if self.wstart[mid] <= p:
                lo = mid
            else:
                hi = mid - 1
        while lo + 1 < self.nwin and self.wstart[lo + 1] <= p:
            lo += 1                        # windows of empty chunks share a start
        return lo

    cdef int _order_of(self, _order *o, int64_t k) except -1 nogil:
        """Window k's order into o: chunk boundaries and a permutation of its records
        drawn from (seed, epoch, k)."""
        cdef int64_t j, s0 = k * self.window_chunks, u, nch
        nch = min64(self.window_chunks, self.nunits - s0)
        o.cum[0] = 0
        for j in range(nch):
            u = self.slot_unit[s0 + j]
            o.cum[j + 1] = o.cum[j] + self.ustart[u + 1] - self.ustart[u]
        return _order_make(o, k, o.cum[nch], nch,
                           rl_hash3(self.seed ^ _WINDOW, <uint64_t>self.epoch, <uint64_t>k))

    cdef int64_t _index_at(self, int64_t p) except -1 nogil:
        """The source record at position p (0 <= p < num_records) of this epoch."""
        cdef int64_t k, r, j
        cdef _order *o = &self.rnd
        if o.k < 0 or p < self.wstart[o.k] or p >= self.wstart[o.k + 1]:
            k = self._window_of(p)
            if k == self.seq.k:
                o = &self.seq
            else:
                self._order_of(o, k)
        r = o.tab[p - self.wstart[o.k]]
        j = _order_chunk(o, r)
        return self.ustart[self.slot_unit[o.k * self.window_chunks + j]] + (r - o.cum[j])

    # -- the sequential path ----------------------------------------------------
    cdef void _drop_window(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.nwb):
            rl_block_decref(self.wblocks[i])
            self.wblocks[i] = NULL
        self.nwb = 0
        self.seq.k = -1
        self.rnext = -1
        self.wdeferred = False

    cdef int _hold_block(self, rl_block *b) except -1 nogil:
        cdef rl_block **b2
        if self.nwb == self.wbcap:
            b2 = <rl_block **>realloc(self.wblocks, (2 * self.wbcap + 16) * sizeof(rl_block *))
            if b2 == NULL:
                with gil:
                    raise MemoryError()
            self.wblocks = b2
            self.wbcap = 2 * self.wbcap + 16
        rl_block_incref(b)
        self.wblocks[self.nwb] = b
        self.nwb += 1
        return 0

    cdef int _build(self, int64_t k) except -1 nogil:
        """Window k loaded: its chunks read once each and described, its order drawn.

        Each chunk of the window is read once, in file order (every
        c_read_at a hit of the cache's current chunk): a chunk of fixed-size
        records packed in one block is kept as (block, base, stride), any
        other as a copy of its record table; the window holds a reference on
        every block it points into, so its records stay valid however the
        cache evicts.  c_next is then a read of the order table (sequential)
        and a pointer computation: no per-record lookup.
        """
        cdef int64_t j, o, s0, u, base, cnt, i
        cdef rl_record rec, first
        cdef rl_block *lastb
        cdef _wchunk *c
        cdef rl_record *r2
        cdef bint strided
        self._drop_window()
        s0 = k * self.window_chunks
        for j in range(min64(self.window_chunks, self.nunits - s0)):
            c = &self.wch[j]
            u = self.slot_unit[s0 + j]
            base = self.ustart[u]
            cnt = self.ustart[u + 1] - base
            c.recs = NULL
            c.stride = 0
            if self.ulost[u]:              # lost this epoch: its records come out as block NULL
                c.block = NULL
                c.base = NULL
                continue
            lastb = NULL
            strided = True
            self.loading = u
            for o in range(cnt):
                self.ra.c_read_at(base + o, &rec)   # raises (the format's error): nothing is kept
                if o == 0:
                    first = rec
                elif strided and (rec.block != first.block or rec.size != first.size
                                  or rec.data != first.data + o * first.size):
                    strided = False        # this chunk needs its table: what came before first
                    if cnt > c.rcap:
                        r2 = <rl_record *>realloc(c.rtab, cnt * sizeof(rl_record))
                        if r2 == NULL:
                            with gil:
                                raise MemoryError(f"global_shuffle: a chunk of {cnt} records")
                        c.rtab = r2
                        c.rcap = cnt
                    for i in range(o):
                        c.rtab[i].block = first.block
                        c.rtab[i].data = first.data + i * first.size
                        c.rtab[i].size = first.size
                if rec.block != lastb:
                    self._hold_block(rec.block)
                    lastb = rec.block
                    if rl_record_is_deferred(&rec):
                        self.wdeferred = True
                if not strided:
                    c.rtab[o] = rec
            self.loading = -1
            if cnt and strided:
                c.block = first.block
                c.base = first.data
                c.stride = first.size
            elif cnt:
                c.recs = c.rtab
        self._order_of(&self.seq, k)
        self.rnext = -1
        return 0

    cdef int _build_window(self, int64_t k) except -1 nogil:
        """_build(k); a chunk whose load raises the format's error is lost to
        this epoch (_lose): the error raised once (the position stays; the next
        read builds the window without it), or skipped with the source's
        warning where the source skips bad chunks.  (The GIL once a window.)"""
        with gil:
            return self._build_lossy(k)

    cdef int _build_lossy(self, int64_t k) except -1:
        cdef int64_t u
        while True:
            try:
                with nogil:
                    self._build(k)
                return 0
            except DataLossError as e:
                u = self.loading
                self.loading = -1
                if u < 0 or self.ulost[u] or not self._lose(u, e):
                    raise

    def _lose(self, int64_t u, err):
        """Chunk u failed to load (`err`, naming file and offset): its records
        are not in this epoch, and reading on gives every other record once,
        where the permutation puts it.  The loss (chunk, position) is kept
        for the states (_resume_state), whose set_state marks it again and
        positions without counting its places (_step).  True: the
        source skips the chunk (on_error="skip"; its warning is given),
        False: raise `err`."""
        cdef int64_t a = self.ustart[u], b = self.ustart[u + 1]
        f = getattr(self.ra, "_skip_message", None)
        skip = f(err) if f is not None else None
        self.ulost[u] = 1
        self.lost_at[u] = self.pos
        self.nlost += 1
        self._lost_hist.append([int(self.epoch), int(u), int(self.pos)])
        if len(self._lost_hist) > _LOST_HISTORY:
            self._hist_cut = max(self._hist_cut, self._lost_hist[0][0])
            del self._lost_hist[0]
        self._dropped = (f"{type(err).__name__}: {err}; the chunk's {b - a} records ({a} to {b - 1} "
                         f"of the source) are not in this epoch")
        if skip is not None:
            warnings.warn(skip, RecordIOWarning, stacklevel=2)
        return skip is not None

    cdef inline void _rec_at(self, int64_t i, rl_record *out) noexcept nogil:
        """The record at window-local position i of the loaded window."""
        cdef int64_t r = self.seq.tab[i]
        cdef int64_t j = _order_chunk(&self.seq, r)
        cdef _wchunk *c = &self.wch[j]
        r -= self.seq.cum[j]
        if c.recs != NULL:
            out[0] = c.recs[r]
        else:
            out.block = c.block
            out.data = c.base + r * c.stride
            out.size = c.stride

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int64_t i, n, q
        while True:
            if self.pos >= self.num_records:
                return 0
            if self.seq.k < 0 or self.pos >= self.wstart[self.seq.k + 1] or self.pos < self.wstart[self.seq.k]:
                if self.owed:                  # a skip's claim (see _step: the position is then
                    self._step(self.owed, True)    # outside the window read); may raise: it holds
                    continue
                self._build_window(self._window_of(self.pos))    # raises (the format's error): the position stays
            i = self.pos - self.wstart[self.seq.k]
            n = self.seq.n
            # records come from anywhere in a window of chunks (MBs): each one's
            # first cache line is requested RING positions before it is handed out
            if i != self.rnext:                # entered the window here (a build, a skip)
                for q in range(i, min64(i + RING, n)):
                    self._rec_at(q, &self.ring[q % RING])
                    rl_gs_prefetch(self.ring[q % RING].data)
            out[0] = self.ring[i % RING]
            if out.block != NULL and self.wdeferred and rl_record_is_deferred(out) and \
                    not rl_deferred_may_go_out(out):
                # a descriptor (the window was built while a batch above pulled:
                # _mapped_negotiate) asked for by another consumer: the window
                # again, its chunks reloaded the ordinary way (the cache's rule)
                self._build_window(self.seq.k)
                self._rec_at(i, out)
                self.rnext = -1
                self.pos += 1
                if out.block == NULL:          # its chunk failed to load now (skipped)
                    continue
                return 1
            if i + RING < n:
                self._rec_at(i + RING, &self.ring[i % RING])
                rl_gs_prefetch(self.ring[i % RING].data)
            self.rnext = i + 1
            self.pos += 1
            if out.block != NULL:
                return 1
            # a record of a chunk lost this epoch (_lose): its place is skipped

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # n items on, without loading anything (_step); a step that ends inside
        # a window not read yet is settled by the next c_next (`owed`)
        cdef int64_t prior = self.owed, got
        if n <= 0:
            return 0
        if n > self.num_records:
            n = self.num_records            # (never more items than records; no overflow below)
        got = self._step(prior + n, False)
        return got - prior if got > prior else 0

    cdef int64_t _step(self, int64_t n, bint settle) except -1 nogil:
        """n items on from the position (fewer at the end of the epoch: the
        count is returned).  Which places are items: a lost chunk's places
        from the position where it was lost on are not (c_next skips them),
        the ones before it are (a step went over them before the loss was
        known), and a window that is not read (built) and has no known loss
        counts every place -- when a skip goes over all of it.  A skip that
        ends inside such a window does not decide there: which of its chunks
        load is known only once it is read.  c_skip (`settle` False) claims
        the rest (`owed`, returned as done) and the next c_next settles it
        (`settle`: each window it enters is read first, its losses known from
        its start on; a claim in the last window that its losses cannot fill
        ends the epoch there).  So the items are the same whatever mix of
        skips and reads got there, as long as no skip goes over a whole window
        not read: every shard of a chain (ShardReader, a DataLoader worker's
        share: skips shorter than a window) counts the same items, and
        set_state positions as the original read -- without loading anything
        before the position: windows without a lost chunk are stepped over
        whole, a window with one is walked through its order (O(window)
        integer work).  set_state comes here with the lost chunks its state
        recorded."""
        cdef int64_t done = 0, k, end, p, r, j, w0, u, t
        cdef bint any_lost
        cdef _order *o = &self.rnd
        if self.nlost == 0 and not settle:
            # no loss known this epoch (O(log windows)): the target t; inside a
            # window not read yet, the part of the step in it is claimed
            t = self.pos + min64(n, self.num_records - self.pos)
            self.owed = 0
            if t >= self.num_records:
                done = t - self.pos
                self.pos = t
                return done
            k = self._window_of(t)
            if t == self.wstart[k] or k == self.seq.k:
                done = t - self.pos
                self.pos = t
                return done
            if self.pos < self.wstart[k]:
                self.pos = self.wstart[k]
            self.owed = t - self.pos
            return n
        while done < n and self.pos < self.num_records:
            k = self._window_of(self.pos)
            end = self.wstart[k + 1]
            w0 = k * self.window_chunks
            any_lost = False
            for j in range(min64(self.window_chunks, self.nunits - w0)):
                u = self.slot_unit[w0 + j]
                if self.ulost[u] and self.lost_at[u] < end:
                    any_lost = True
                    break
            if not any_lost and k != self.seq.k and (settle or n - done < end - self.pos):
                # the step ends inside a window not read yet (settling: any
                # window it enters, read now rather than counted whole)
                self.owed = n - done
                if not settle:
                    return n
                self._build_window(k)      # may raise (the format's error): pos and owed hold
                continue                   # (read now: its losses are known)
            if not any_lost:
                p = min64(n - done, end - self.pos)
                self.pos += p
                done += p
                continue
            if o.k != k:
                self._order_of(o, k)
            for p in range(self.pos, end):
                r = o.tab[p - self.wstart[k]]
                u = self.slot_unit[w0 + _order_chunk(o, r)]
                self.pos = p + 1
                if not (self.ulost[u] and p >= self.lost_at[u]):
                    done += 1
                    if done == n:
                        break
        self.owed = 0
        return done

    def _has_lost(self):
        """True when chunks are lost this epoch: item i is then not the record
        at position i (a buffer shuffle above restores by replaying)."""
        return self.nlost > 0

    cdef int64_t c_num_records(self) except -2:
        return self.num_records

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        # random access in this epoch's order: item `index` of the epoch
        if index < 0 or index >= self.num_records:
            with gil:
                raise IndexError(f"GlobalShuffleReader index {index} out of range for "
                                 f"{self.num_records} records")
        return self.ra.c_read_at(self._index_at(index), out)

    def _open_random_access(self):
        return self

    @property
    def _records_deferred(self):
        """Records loaded as descriptors for a batch above (a test hook)."""
        return int(getattr(self.ra, "records_deferred", 0))

    def _mapped_negotiate(self):
        """A BatchReader above asks for deferred records (readers/_batch.pyx):
        the source's chunk cache answers (readers/_random_access.pyx, Design,
        "Deferred records"); 0 where it cannot."""
        f = getattr(self.ra, "_mapped_negotiate", None)
        return 0 if f is None else f()

    def _random_access_size(self):
        return self.num_records

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._clear_lost()
        self._plan()
        if self._lost_pending:
            self._mark_lost(self._lost_pending)
            self._lost_pending = [l for l in self._lost_pending if l[0] > self.epoch] or None
        return self.reader.c_reset()

    cdef int _clear_lost(self) except -1:
        if self.nlost:
            memset(self.ulost, 0, max(self.nunits, 1))
            self.nlost = 0
        self._dropped = None
        return 0

    def _mark_lost(self, lost):
        """The losses of `lost` ([epoch, chunk, position] of a state) that are
        this epoch's: marked lost, as they were when the state was saved."""
        for e, u, at in lost:
            if e == self.epoch and not self.ulost[u]:
                self.ulost[u] = 1
                self.lost_at[u] = at
                self.nlost += 1
        if self.nlost:
            self._dropped = f"chunk(s) lost before the state was saved: {[l for l in lost if l[0] == self.epoch][:8]}"

    cdef int c_close(self) except -1:
        self._drop_window()
        self.ra.close()
        self.reader.close()
        return 0

    def permutation(self, epoch=None):
        """The source indices in the order epoch `epoch` (default: the current one)
        visits them, as an int64 array -- O(records) memory: for inspection and tests."""
        cdef int64_t e0 = self.epoch, p
        out = np.empty(self.num_records, np.int64)
        cdef int64_t[::1] o = out
        if epoch is not None and int(epoch) != e0:
            self.epoch = int(epoch)
            self._plan_keep_pos()
        try:
            with nogil:
                for p in range(self.num_records):
                    o[p] = self._index_at(p)
        finally:
            if self.epoch != e0:
                self.epoch = e0
                self._plan_keep_pos()
        return out

    cdef void _plan_keep_pos(self) noexcept nogil:
        cdef int64_t p = self.pos, w = self.owed
        self._plan()
        self.pos = p
        self.owed = w

    def _length(self):
        return int(self.num_records)

    @property
    def chunk_loads(self):
        """Chunks loaded so far through this shuffle's cache (a test and benchmark hook)."""
        return int(getattr(self.ra, "chunk_loads", 0))

    def _shuffle_description(self):
        return f".global_shuffle(window_chunks={self.window_chunks})"

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    # States after a lost chunk (_lose): the position counts delivered items,
    # and the chunks lost so far (found mid-epoch, so a live part: "lost", as
    # [epoch, chunk, position when lost], for every epoch of this reader since
    # the chain's epoch started -- a multi_pass above runs several) travel in
    # the state.  set_state marks them lost as each of those epochs starts,
    # before anything is positioned (_step counts a lost chunk's places
    # before its position as items, as the c_skip before the loss did), so the
    # restored chain reads on as the original does, without loading them again
    # (no error, no second warning).  Such a state is version 4: a readerlib
    # from before it would count the lost places as items, so it refuses the
    # version instead.  Under a prefetcher the thread's losses run ahead of what
    # its consumer saw (and the prefetcher ends its run at an error): refused.
    def _state_inexact(self):
        return None

    def _resume_state(self, above):
        self._saved_lost = False
        if not self._lost_hist:
            return {}
        top = above[0] if above else self
        snap = (<ReaderBase>top)._epoch_snapshot
        e0 = None
        if snap is not None and len(snap) > len(above):
            e0 = snap[len(above)].get("epoch")
        if not isinstance(e0, int):
            e0 = int(self.epoch)
        saved = [list(l) for l in self._lost_hist if l[0] >= e0]
        if not saved:
            return {}
        why = None
        if any(hasattr(r, "_below_states") for r in above):
            why = "under a prefetcher"
        elif self._hist_cut >= e0:
            why = f"more than {_LOST_HISTORY} chunks lost since the epoch started"
        if why is not None:
            raise RuntimeError(
                f"get_state: {type(self).__name__} dropped a record this epoch "
                f"({self._dropped or saved[:4]}); {why} the position can no longer be saved exactly: "
                f"save a state taken before the error, or after the next epoch starts")
        self._saved_lost = True
        return {"lost": saved}

    def _state_version(self):
        return 4 if self._saved_lost else 2

    def _check_epoch_state(self, state):
        _check_saved_seed_epoch(state)
        self._lost_of(state)

    def _lost_of(self, state):
        """The [epoch, chunk, position] losses a state's "lost" lists (checked),
        [] without one."""
        lost = state.get("lost", [])
        if not isinstance(lost, list) or len(lost) > _LOST_HISTORY:
            raise ValueError(f"malformed 'lost' {lost!r:.80} (a list of [epoch, chunk, position])")
        out = []
        for item in lost:
            if not isinstance(item, list) or len(item) != 3 or any(
                    isinstance(v, bool) or not isinstance(v, int) for v in item):
                raise ValueError(f"malformed 'lost': {item!r:.60} is not an [epoch, chunk, position]")
            e, u, at = item
            if not 0 <= u < self.nunits or not 0 <= at <= self.num_records or not 0 <= e < (1 << 62):
                raise ValueError(f"malformed 'lost': chunk {u} (of {self.nunits}) lost at position "
                                 f"{at} (of {self.num_records}) in epoch {e}")
            out.append([e, u, at])
        if len({(e, u) for e, u, _ in out}) != len(out):
            raise ValueError(f"malformed 'lost': a chunk listed twice for one epoch")
        return out

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])      # (checked: _check_epoch_state)
        self.epoch = int(state["epoch"])
        self._clear_lost()
        self._plan()
        lost = self._lost_of(state)
        self._lost_hist = [list(l) for l in lost]
        self._hist_cut = -1
        self._lost_pending = [l for l in lost if l[0] > self.epoch] or None
        self._mark_lost(lost)

    def _describe(self):
        d = {"window_chunks": int(self.window_chunks), "num_records": int(self.num_records)}
        if not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def _reduce_args(self):
        return (None if self.seed_drawn else int(self.seed), int(self.window_chunks)), {}

    def __repr__(self):
        return (f"GlobalShuffleReader({self.reader!r}, seed={self.seed}, "
                f"window_chunks={self.window_chunks})")


cdef inline int64_t min64(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


# ------------------------------------------------------------------ window
cdef void _window_order(uint32_t *tab, int64_t n, uint64_t key, bint feistel) noexcept nogil:
    """tab[0..n) = window shuffle's order of a window of n items drawn from `key`:
    a global shuffle window's Fisher-Yates pass, or (`feistel`) the Feistel bijection's."""
    cdef _feistel f
    cdef int64_t i
    if not feistel:
        _fisher_yates(tab, n, key)
        return
    _feistel_init(&f, key, <uint64_t>n)
    for i in range(n):
        tab[i] = <uint32_t>_permute(&f, <uint64_t>i)


def _window_order_py(uint64_t seed, int64_t epoch, int64_t window, int64_t n, bint feistel=False):
    """Window shuffle's order of window `window` of n items (tests)."""
    t = np.empty(max(n, 1), np.uint32)
    cdef uint32_t[::1] tv = t
    _window_order(&tv[0], n, rl_hash3(seed, <uint64_t>epoch, <uint64_t>window), feistel)
    return t[:n].tolist()


cdef class WindowShuffleReader(DecoratedReader):
    """Shuffle each run of `window_size` consecutive items (Grain's WindowShuffle).

    Items ``[k*W, (k+1)*W)`` of the upstream epoch come out as a permutation
    of themselves, keyed by (seed, epoch, k): every item exactly once per
    epoch, the same order for the same seed, a new one each epoch.  Weaker
    mixing than ``shuffle(W)`` (an item never leaves its window), but a
    restore reads at most one window, wherever the position is.

    A filled window holds one reference per run of its items from the same
    block (not one per item: an in-memory source's items share one block)
    and its order as a table (see the module doc).  A batch above negotiates
    deferred records through it (readers/_batch.pyx, as through a buffer
    shuffle): a window filled during that batch's pull may hold them, and
    one asked for by anyone else goes out as a verified copy
    (hand_out_verified).  Each item's first cache line is requested as it
    enters the window (in source order, so an in-memory source streams in)
    and again RING places before it goes out.

    Parameters
    ----------
    reader : ReaderBase
    window_size : int
    seed : int, optional
        As for `shuffle`.
    """
    cdef rl_record *buf
    cdef rl_block **blocks         # one reference per run of the window's items from one block
    cdef int64_t nblocks
    cdef uint32_t *tab             # the window's order: item tab[i] goes out i-th
    cdef rl_block *mat             # the last verified copy handed out (hand_out_verified), or NULL
    cdef bint feistel_order        # the order of states saved before 2026-12-05 (see the module doc)
    cdef readonly int64_t window_size
    cdef int64_t count             # items in the current window
    cdef int64_t i                 # next slot of the window to hand out
    cdef int64_t win               # windows started this epoch
    cdef bint filling              # a fill an exception interrupted: go on with it
    cdef bint upstream_done
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn

    def __init__(self, reader, window_size, seed=None):
        _check_reader(reader, "WindowShuffleReader")
        w = _check_positive_int(window_size, "window_size")
        s, drawn = _check_seed(seed)
        DecoratedReader.__init__(self, reader)
        if w > 0xFFFFFFFF:
            raise ValueError(f"window_size must be at most {0xFFFFFFFF}, got {w}")
        self.buf = <rl_record *>calloc(w, sizeof(rl_record))
        self.blocks = <rl_block **>calloc(w, sizeof(rl_block *))
        self.tab = <uint32_t *>malloc(w * sizeof(uint32_t))
        if self.buf == NULL or self.blocks == NULL or self.tab == NULL:
            raise MemoryError(f"window of {w} items")
        self.window_size = w
        self.seed = <uint64_t>s
        self.seed_drawn = drawn
        self._restart()

    cdef void _release(self) noexcept nogil:
        cdef int64_t k
        for k in range(self.nblocks):
            rl_block_decref(self.blocks[k])
        self.nblocks = 0
        self.count = 0
        self.i = 0

    cdef void _restart(self) noexcept nogil:
        self._release()
        self.win = 0
        self.filling = False
        self.upstream_done = False

    def __dealloc__(self):
        if self.blocks != NULL:
            self._release()
        if self.mat != NULL:
            rl_block_decref(self.mat)
            self.mat = NULL
        free(self.buf)
        free(self.blocks)
        free(self.tab)
        self.buf = NULL
        self.blocks = NULL
        self.tab = NULL

    cdef int _fill(self) except -1 nogil:
        """The next window into buf (count items; 0 at the end of the epoch)."""
        cdef rl_record rec
        cdef int64_t k
        if not self.filling:
            self._release()
            if self.upstream_done:
                return 0
            self.filling = True
        while self.count < self.window_size:
            if self.reader.c_next(&rec) != 1:     # may raise: the next call goes on filling
                self.upstream_done = True
                break
            if self.nblocks == 0 or self.blocks[self.nblocks - 1] != rec.block:
                rl_block_incref(rec.block)
                self.blocks[self.nblocks] = rec.block
                self.nblocks += 1
            if not rl_record_is_deferred(&rec):  # (a deferred one's data is a file offset)
                rl_ws_prefetch(rec.data)
            self.buf[self.count] = rec
            self.count += 1
        self.filling = False
        self.i = 0
        if self.count:
            _window_order(self.tab, self.count, rl_hash3(self.seed, <uint64_t>self.epoch, <uint64_t>self.win),
                          self.feistel_order)
            self.win += 1
            for k in range(min64(RING, self.count)):
                rl_ws_prefetch(self.buf[self.tab[k]].data)
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        if self.filling or self.i >= self.count:
            self._fill()
            if self.count == 0:
                return 0
        out[0] = self.buf[self.tab[self.i]]
        if self.i + RING < self.count:
            rl_ws_prefetch(self.buf[self.tab[self.i + RING]].data)
        self.i += 1
        if rl_record_is_deferred(out) and not rl_deferred_may_go_out(out):
            hand_out_verified(self, out, &self.mat)    # (raises: the item is dropped)
        return 1


    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        cdef int64_t done = 0, k, whole, got
        if self.filling or n <= 0:
            return ReaderBase.c_skip(self, n)
        k = self.count - self.i
        if n <= k:
            self.i += n
            return n
        done = k
        n -= k
        self._release()
        whole = n // self.window_size
        if whole and not self.upstream_done:
            got = self.reader.c_skip(whole * self.window_size)
            self.win += (got + self.window_size - 1) // self.window_size
            done += got
            n -= got
            if got < whole * self.window_size:
                self.upstream_done = True
        if n > 0 and not self.upstream_done:
            self._fill()
            k = n if n < self.count else self.count
            self.i = k
            done += k
        return done

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._dropped = None
        self._restart()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._release()
        if self.mat != NULL:
            rl_block_decref(self.mat)
            self.mat = NULL
        self.reader.close()
        return 0

    def _length(self):
        from readerlib.readers._slice import length_of
        return length_of(self.reader)

    def _shuffle_description(self):
        return f".shuffle({self.window_size}, mode='window')"

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch),
                "order": "feistel" if self.feistel_order else "fisher-yates"}

    def _state_version(self):
        # a readerlib from before the Fisher-Yates order (it reads version 2
        # only) would restore such a window in the Feistel order: other items
        return 2 if self.feistel_order else 3

    def _check_epoch_state(self, state):
        _check_saved_seed_epoch(state)
        order = state.get("order", "feistel")        # (no key: saved before 2026-12-05)
        if not isinstance(order, str) or order not in ("feistel", "fisher-yates"):
            raise ValueError(f"unknown window shuffle order {order!r:.80} in 'order' "
                             f"(a state saves 'fisher-yates', or 'feistel' before 2026-12-05)")

    def _set_epoch_state(self, state):
        order = state.get("order", "feistel")        # (checked: _check_epoch_state)
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
        self.feistel_order = order == "feistel"
        self._restart()

    def _describe(self):
        d = {"window_size": int(self.window_size)}
        if not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def _rebuild_with(self):
        return _window_shuffle

    def _reduce_args(self):
        return (int(self.window_size), None if self.seed_drawn else int(self.seed)), {}

    def __repr__(self):
        return (f"WindowShuffleReader({self.reader!r}, window_size={self.window_size}, "
                f"seed={self.seed})")


def _window_shuffle(reader, window_size, seed):
    return WindowShuffleReader(reader, window_size, seed)
