# cython: freethreading_compatible=False
"""A global shuffle over random-access sources, and a window shuffle for streams.

Design:
    GlobalShuffleReader visits every record of a source with random access
    once per epoch, in a permutation that is a pure function of
    (seed, epoch, position) -- nothing of size O(records) is stored, and
    position p's record is computed directly, so set_state is O(1).

    The permutation is made of two bijections, each a keyed Feistel network
    over the next even power of two >= the domain, with cycle walking (apply
    again until the value falls inside the domain) -- the construction of
    Grain's index_shuffle and TF's random_index_shuffle:
      1. the source's chunks are permuted (key from (seed, epoch));
      2. consecutive runs of `window_chunks` permuted chunks form windows;
         within window k, the window's records are permuted (key from
         (seed, epoch, k)).
    Position p falls in window k (a binary search over the per-epoch window
    starts: O(chunks) integers, recomputed per epoch in microseconds) and
    maps to record `start of its chunk + offset`.  So a window's chunks are
    read once each (the chunk cache holds window_chunks + 1 of them) and the
    file is read chunk by chunk in a permuted order: sequential-ish I/O.
    Records far apart in the file do become neighbours (unlike a buffer
    shuffle), and every record can land anywhere in the epoch; what the
    construction gives up against a uniform permutation is that records of
    one window stay within that window's stretch of the epoch.

    Each Feistel evaluation is 4 rounds of a 64-bit mix keyed per round; cycle
    walking takes < 4 evaluations on average (the domain is < 4x the range).

    WindowShuffleReader (``shuffle(n, mode="window")``, Grain's WindowShuffle)
    permutes each run of `window_size` consecutive items of any reader with
    the same Feistel bijection, keyed by (seed, epoch, window index).  A
    restore skips the windows before the position (c_skip: free over an
    indexed source) and reads one window: at most `window_size` items are
    replayed, wherever the position is in the epoch.
"""
import os

import numpy as np
from libc.stdlib cimport malloc, calloc, realloc, free

from readerlib._typedefs cimport int64_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, DecoratedReader, rl_record, rl_block, rl_block_incref, rl_block_decref,
    rl_hash3, rl_core_import, ITEM_INSTANCE)
from readerlib.readers._base import _check_positive_int, _check_reader

rl_core_import()

__all__ = ["GlobalShuffleReader", "WindowShuffleReader"]

DEF ROUNDS = 4                  # Luby-Rackoff: 4 rounds of a pseudo-random function give a strong PRP
cdef uint64_t _UNITS = 0x756e697473        # key domains ("units", "window")
cdef uint64_t _WINDOW = 0x77696e646f77


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


# ------------------------------------------------------------------ global
cdef class GlobalShuffleReader(DecoratedReader):
    """Every record of a random-access source once per epoch, globally shuffled.

    The order is a function of (seed, epoch, position) only (see the module's
    Design): the same seed gives the same order, each `reset()` starts a new
    epoch with a new order, and `set_state` jumps to any position without
    reading what comes before it.  The records are read through a cache of
    ``window_chunks + 1`` chunks (its own file descriptor): chunks in a
    permuted order, records permuted within each window of chunks.

    Parameters
    ----------
    reader : ReaderBase
        A source with random access: RecordIOReader, TFRecordReader (its
        index is built on first use), ArrayReader, RandomDataGenerator.
    seed : int, optional
        Pass `seed=` to make the order reproducible (required when several
        processes read shards of one order, e.g. DataLoader workers); without
        it a seed is drawn from the OS once and travels in the state.
    window_chunks : int
        Chunks whose records are mixed together (memory: that many chunks).

    Raises
    ------
    TypeError
        `reader` has no random access (a stream or a decorated chain: put
        global_shuffle directly on the source, decorators after it).

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
    cdef int64_t *slot_unit         # this epoch: chunk order
    cdef int64_t *wstart            # window k: positions [wstart[k], wstart[k + 1])
    cdef int64_t nwin
    cdef int64_t pos
    cdef int64_t cur_win            # window whose tables below are ready (-1: none)
    cdef int64_t *cw_cum            # records before slot j of the current window
    cdef int64_t cw_n               # chunks in the current window
    cdef _feistel wperm
    cdef _feistel uperm
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn

    def __init__(self, reader, seed=None, window_chunks=8):
        _check_reader(reader, "GlobalShuffleReader")
        w = _check_positive_int(window_chunks, "window_chunks")
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError("global_shuffle shuffles a source's records; this reader yields batches "
                            "(call .global_shuffle() before .batch())")
        if (<ReaderBase>reader).c_num_records() < 0:
            reader._open_random_access()      # raises TypeError naming the reader
        s, drawn = _check_seed(seed)
        DecoratedReader.__init__(self, reader)
        from readerlib.readers._random_access import open_random_access
        self.ra = open_random_access(reader, int(w) + 1)
        starts = self.ra.chunk_starts()
        cdef int64_t i
        self.nunits = starts.shape[0] - 1
        self.num_records = int(starts[self.nunits])
        self.window_chunks = w
        self.ustart = <int64_t *>malloc((self.nunits + 1) * sizeof(int64_t))
        self.slot_unit = <int64_t *>malloc(max(self.nunits, 1) * sizeof(int64_t))
        self.nwin = (self.nunits + w - 1) // w
        self.wstart = <int64_t *>malloc((self.nwin + 1) * sizeof(int64_t))
        self.cw_cum = <int64_t *>malloc((w + 1) * sizeof(int64_t))
        if not (self.ustart and self.slot_unit and self.wstart and self.cw_cum):
            raise MemoryError()
        for i in range(self.nunits + 1):
            self.ustart[i] = starts[i]
        self.seed = <uint64_t>s
        self.seed_drawn = drawn
        self.epoch = 0
        self._plan()

    def __dealloc__(self):
        free(self.ustart); free(self.slot_unit); free(self.wstart); free(self.cw_cum)
        self.ustart = self.slot_unit = self.wstart = self.cw_cum = NULL

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
        self.cur_win = -1
        self.pos = 0

    cdef void _enter(self, int64_t k) noexcept nogil:
        cdef int64_t j, s0 = k * self.window_chunks, u
        self.cw_n = min64(self.window_chunks, self.nunits - s0)
        self.cw_cum[0] = 0
        for j in range(self.cw_n):
            u = self.slot_unit[s0 + j]
            self.cw_cum[j + 1] = self.cw_cum[j] + self.ustart[u + 1] - self.ustart[u]
        _feistel_init(&self.wperm, rl_hash3(self.seed ^ _WINDOW, <uint64_t>self.epoch, <uint64_t>k),
                      <uint64_t>self.cw_cum[self.cw_n])
        self.cur_win = k

    cdef int64_t _index_at(self, int64_t p) noexcept nogil:
        """The source record at position p (0 <= p < num_records) of this epoch."""
        cdef int64_t k = self.cur_win, lo, hi, mid, r, j
        if k < 0 or p < self.wstart[k] or p >= self.wstart[k + 1]:
            lo = 0
            hi = self.nwin - 1
            while lo < hi:                 # the last window starting at or before p
                mid = (lo + hi + 1) >> 1
                if self.wstart[mid] <= p:
                    lo = mid
                else:
                    hi = mid - 1
            while lo + 1 < self.nwin and self.wstart[lo + 1] <= p:
                lo += 1                    # windows of empty chunks share a start
            self._enter(lo)
            k = lo
        r = <int64_t>_permute(&self.wperm, <uint64_t>(p - self.wstart[k]))
        j = 0
        while self.cw_cum[j + 1] <= r:
            j += 1
        return self.ustart[self.slot_unit[k * self.window_chunks + j]] + (r - self.cw_cum[j])

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int64_t idx
        if self.pos >= self.num_records:
            return 0
        idx = self._index_at(self.pos)
        self.ra.c_read_at(idx, out)       # raises (the format's error): the position stays
        self.pos += 1
        return 1

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        cdef int64_t k = self.num_records - self.pos
        if n < k:
            k = n if n > 0 else 0
        self.pos += k
        return k

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

    def _random_access_size(self):
        return self.num_records

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._plan()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self.ra.close()
        self.reader.close()
        return 0

    def permutation(self, epoch=None):
        """The source indices in the order epoch `epoch` (default: the current one)
        visits them, as an int64 array -- O(records) memory: for inspection and tests."""
        cdef int64_t e0 = self.epoch, p
        out = np.empty(self.num_records, np.int64)
        cdef int64_t[::1] o = out
        if epoch is not None:
            self.epoch = int(epoch)
            self._plan_keep_pos(e0)
        try:
            for p in range(self.num_records):
                o[p] = self._index_at(p)
        finally:
            if epoch is not None:
                self.epoch = e0
                self._plan_keep_pos(e0)
        return out

    cdef void _plan_keep_pos(self, int64_t e0) noexcept nogil:
        cdef int64_t p = self.pos
        self._plan()
        self.pos = p

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

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
        self._plan()

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
cdef class WindowShuffleReader(DecoratedReader):
    """Shuffle each run of `window_size` consecutive items (Grain's WindowShuffle).

    Items ``[k*W, (k+1)*W)`` of the upstream epoch come out as a permutation
    of themselves, keyed by (seed, epoch, k): every item exactly once per
    epoch, the same order for the same seed, a new one each epoch.  Weaker
    mixing than ``shuffle(W)`` (an item never leaves its window), but a
    restore reads at most one window, wherever the position is.

    Parameters
    ----------
    reader : ReaderBase
    window_size : int
    seed : int, optional
        As for `shuffle`.
    """
    cdef rl_record *buf
    cdef readonly int64_t window_size
    cdef int64_t count             # items in the current window
    cdef int64_t i                 # next slot of the window to hand out
    cdef int64_t win               # windows started this epoch
    cdef bint filling              # a fill an exception interrupted: go on with it
    cdef bint upstream_done
    cdef _feistel perm
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn

    def __init__(self, reader, window_size, seed=None):
        _check_reader(reader, "WindowShuffleReader")
        w = _check_positive_int(window_size, "window_size")
        s, drawn = _check_seed(seed)
        DecoratedReader.__init__(self, reader)
        self.buf = <rl_record *>calloc(w, sizeof(rl_record))
        if self.buf == NULL:
            raise MemoryError(f"window of {w} items")
        self.window_size = w
        self.seed = <uint64_t>s
        self.seed_drawn = drawn
        self._restart()

    cdef void _release(self) noexcept nogil:
        cdef int64_t k
        for k in range(self.count):
            rl_block_decref(self.buf[k].block)
        self.count = 0
        self.i = 0

    cdef void _restart(self) noexcept nogil:
        self._release()
        self.win = 0
        self.filling = False
        self.upstream_done = False

    def __dealloc__(self):
        if self.buf != NULL:
            self._release()
            free(self.buf)
            self.buf = NULL

    cdef int _fill(self) except -1 nogil:
        """The next window into buf (count items; 0 at the end of the epoch)."""
        cdef rl_record rec
        if not self.filling:
            self._release()
            if self.upstream_done:
                return 0
            self.filling = True
        while self.count < self.window_size:
            if self.reader.c_next(&rec) != 1:     # may raise: the next call goes on filling
                self.upstream_done = True
                break
            rl_block_incref(rec.block)
            self.buf[self.count] = rec
            self.count += 1
        self.filling = False
        self.i = 0
        if self.count:
            _feistel_init(&self.perm, rl_hash3(self.seed, <uint64_t>self.epoch, <uint64_t>self.win),
                          <uint64_t>self.count)
            self.win += 1
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        if self.filling or self.i >= self.count:
            self._fill()
            if self.count == 0:
                return 0
        out[0] = self.buf[_permute(&self.perm, <uint64_t>self.i)]
        self.i += 1
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
        self._restart()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._release()
        self.reader.close()
        return 0

    def _length(self):
        from readerlib.readers._slice import length_of
        return length_of(self.reader)

    def _shuffle_description(self):
        return f".shuffle({self.window_size}, mode='window')"

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
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
