# cython: freethreading_compatible=False
"""ShuffleReader: shuffle through a buffer of items (tf.data's algorithm)."""
import os

import numpy as np
from libc.stdlib cimport malloc, free, calloc, realloc

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64,
    layout_parse, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _check_reader

rl_core_import()

__all__ = ["ShuffleReader"]


cdef extern from *:
    void __builtin_prefetch(const void *p) nogil


cdef struct _bref:
    rl_block *block
    int64_t count        # references held by this shuffle (slots + output)
    int64_t next_free


cdef class ShuffleReader(DecoratedReader):
    """Shuffle through a buffer of `buffer_size` items (tf.data's algorithm).

    Every item comes out exactly once per epoch.  The order is a function of
    (seed, epoch): the same seed gives the same order, and each `reset()`
    starts a new epoch with a new order.  The buffer holds references to
    records, not copies.

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
    cdef rl_record *slots
    cdef int64_t *slot_ref
    cdef int64_t scap            # allocated slots (grows up to cap)
    cdef _bref *btab
    cdef int64_t btab_free
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

    def __init__(self, reader, buffer_size, seed=None):
        _check_reader(reader, "ShuffleReader")
        cap = _check_positive_int(buffer_size, "buffer_size")
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
        self.btab_last = -1
        self._grow(min(cap, 1024))
        self.seed = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        self.epoch = 0
        self._restart()

    cdef int _grow(self, int64_t n) except -1 nogil:
        """Room for n buffered items (the buffer grows as it fills: a huge
        buffer_size over a small dataset costs only what is used)."""
        cdef int64_t i, old = self.scap
        cdef rl_record *s2
        cdef int64_t *r2
        cdef _bref *b2
        if n <= old:
            return 0
        s2 = <rl_record *>realloc(self.slots, n * sizeof(rl_record))
        if s2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.slots = s2
        r2 = <int64_t *>realloc(self.slot_ref, n * sizeof(int64_t))
        if r2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.slot_ref = r2
        # at most (items + 1) distinct blocks are held: n + 2 table entries
        b2 = <_bref *>realloc(self.btab, (n + 2) * sizeof(_bref))
        if b2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.btab = b2
        for i in range((old + 2) if old else 0, n + 2):
            self.btab[i].block = NULL
            self.btab[i].count = 0
            self.btab[i].next_free = i + 1 if i + 1 < n + 2 else self.btab_free
        self.btab_free = (old + 2) if old else 0
        self.scap = n
        return 0

    cdef inline int64_t _acquire(self, rl_block *b) noexcept nogil:
        cdef int64_t i = self.btab_last
        if i >= 0 and self.btab[i].block == b:
            self.btab[i].count += 1
            return i
        i = self.btab_free                 # never empty: at most cap + 1 blocks are held
        self.btab_free = self.btab[i].next_free
        self.btab[i].block = b
        self.btab[i].count = 1
        rl_block_incref(b)
        self.btab_last = i
        return i

    cdef inline void _release(self, int64_t i) noexcept nogil:
        self.btab[i].count -= 1
        if self.btab[i].count == 0:
            rl_block_decref(self.btab[i].block)
            self.btab[i].block = NULL
            self.btab[i].next_free = self.btab_free
            self.btab_free = i
            if self.btab_last == i:
                self.btab_last = -1

    cdef void _drop(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.count):
            self._release(self.slot_ref[i])
        self.count = 0
        if self.hold >= 0:
            self._release(self.hold)
            self.hold = -1

    cdef void _restart(self) noexcept nogil:
        self._drop()
        self.filled = False
        self.upstream_done = False
        self.next_j = -1
        rl_rng_seed(&self.rng, self.seed, <uint64_t>self.epoch)

    def __dealloc__(self):
        if self.slots != NULL and self.slot_ref != NULL and self.btab != NULL:
            self._drop()
        free(self.slots)
        free(self.slot_ref)
        free(self.btab)
        self.slots = NULL
        self.slot_ref = NULL
        self.btab = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r
        cdef uint64_t j
        if self.hold >= 0:
            self._release(self.hold)
            self.hold = -1
        if not self.filled:
            while self.count < self.cap:
                if self.count == self.scap:
                    self._grow(min(self.cap, 2 * self.scap))
                # an exception here leaves the buffer as it was: the next
                # call goes on filling it
                r = self.reader.c_next(&rec)
                if r == 0:
                    self.upstream_done = True
                    break
                self.slot_ref[self.count] = self._acquire(rec.block)
                self.slots[self.count] = rec
                self.count += 1
            self.filled = True
        if self.count == 0:
            return 0
        if self.next_j >= 0:
            j = <uint64_t>self.next_j
        else:
            j = rl_rng_below(&self.rng, <uint64_t>self.count)
            # kept until the slot is emitted: if the refill below raises, the
            # next call emits this same slot (the order is the one the
            # failed record's absence gives, and nothing is lost or repeated)
            self.next_j = <int64_t>j
        # Refill first, emit after.  c_next is `except -1`: an exception jumps
        # straight out of this function, so nothing may be half-moved when it
        # is called (the buffer keeps every record it holds, `hold` is empty).
        if not self.upstream_done:
            r = self.reader.c_next(&rec)
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]    # the slot's reference moves to `hold`
            if r == 1:
                self.slot_ref[j] = self._acquire(rec.block)
                self.slots[j] = rec
                self._draw_ahead()
                return 1
            self.upstream_done = True
        else:
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]
        self.count -= 1
        self.slots[j] = self.slots[self.count]
        self.slot_ref[j] = self.slot_ref[self.count]
        self._draw_ahead()
        return 1

    cdef inline void _draw_ahead(self) noexcept nogil:
        # Same draws in the same order as drawing on demand; doing it now lets
        # the next record's first cache lines load while the caller copies.
        if self.count > 0:
            self.next_j = <int64_t>rl_rng_below(&self.rng, <uint64_t>self.count)
            __builtin_prefetch(self.slots[self.next_j].data)
            __builtin_prefetch(self.slots[self.next_j].data + 63)

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._restart()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._drop()
        self.reader.close()
        return 0

    @property
    def buffer_size(self):
        return self.cap

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    def _describe(self):
        # a drawn seed is not part of what the chain is: a restore adopts the saved one
        d = {"buffer_size": int(self.cap)}
        if not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
        self._restart()

    def _reduce_args(self):
        return (int(self.cap),), {"seed": None if self.seed_drawn else int(self.seed)}

    def __repr__(self):
        return f"ShuffleReader({self.reader!r}, buffer_size={self.cap}, seed={self.seed})"


