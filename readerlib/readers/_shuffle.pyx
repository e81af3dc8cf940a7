# cython: freethreading_compatible=False
"""ShuffleReader: shuffle through a buffer of items (tf.data's algorithm)."""
import os

import numpy as np
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64,
    layout_parse, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _check_reader

rl_core_import()

# Deferred records (include/rl_mapped.h: mapped big records that only the batch
# that asked for them may copy, verifying them) are moved like any other; one
# that would go to another consumer of this shuffle is verified first.  Compaction
# never copies one: a deferred record is alone in its block (bytes == block size).
cdef extern from "rl_mapped.h":
    int rl_mapped_import() except -1
    bint rl_record_is_deferred(const rl_record *r) nogil
    bint rl_deferred_may_go_out(const rl_record *r) nogil
    rl_block *rl_deferred_materialize(const rl_record *r, int *code, int64_t *off) nogil

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


cdef extern from *:
    void __builtin_prefetch(const void *p) nogil


cdef struct _bref:
    rl_block *block
    int64_t count        # references held by this shuffle (slots + output)
    int64_t next_free
    int64_t bytes        # payload of those records
    int64_t mark         # compaction pass `gen`: +gen copy out, -gen keep (0: not looked at)


cdef class ShuffleReader(DecoratedReader):
    """Shuffle through a buffer of `buffer_size` items (tf.data's algorithm).

    Every item comes out exactly once per epoch.  The order is a function of
    (seed, epoch): the same seed gives the same order, and each `reset()`
    starts a new epoch with a new order.  The buffer holds references to
    records, not copies; when small records would keep much more memory alive
    than they are (their source blocks), it copies the few survivors of
    mostly-drained blocks into blocks of its own, so that its memory stays
    about 1.5-1.6x the buffered payload plus 4 MiB.  Compaction never changes
    the order.

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
    cdef rl_record *slots
    cdef int64_t *slot_ref
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
        self.btab_hw = 0
        self.btab_last = -1
        self.arena = NULL
        self.arena_e = -1
        self.c_on = _COMPACT_ON
        self.c_slack = _COMPACT_SLACK
        self.c_factor = _COMPACT_FACTOR
        self.c_fill = _COMPACT_FILL
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
        # at most (items + 1) distinct blocks are held (+1 while a compaction
        # moves a record): n + 2 table entries.  Entries are handed out from a
        # high-water mark, then recycled through the free list, so only as
        # many are touched as blocks were ever held at once (not n).
        b2 = <_bref *>realloc(self.btab, (n + 2) * sizeof(_bref))
        if b2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.btab = b2
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
        if i >= 0 and self.btab[i].block == b:
            self.btab[i].count += 1
            self.btab[i].bytes += size
            return i
        i = self._new_entry()
        self.btab[i].block = b
        self.btab[i].count = 1
        self.btab[i].bytes = size
        self.btab[i].mark = 0
        rl_block_incref(b)
        self.btab_last = i
        self.pinned += b.size
        if (self.c_on and self.pinned > self.c_factor * self.payload + self.c_slack
                and 4 * self.since >= self.cap):
            self.due = True
        return i

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
        rl_block_incref(self.arena)
        self.pinned += self.arena.size
        self.arena_e = i
        return i

    cdef void _compact(self) noexcept nogil:
        """One compaction pass over the buffer (see the design note).  Every
        step leaves a consistent buffer: a failed allocation ends the pass."""
        cdef int64_t s, e, a
        cdef rl_block *b
        cdef rl_record *r
        cdef char *p
        self.due = False
        self.since = 0
        self.gen += 1
        self.n_passes += 1
        for s in range(self.count):
            e = self.slot_ref[s]
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
            r = &self.slots[s]
            if r.size >= COMPACT_MAX_RECORD:
                continue
            p = self._arena_alloc(r.size)
            if p == NULL:
                return
            memcpy(p, r.data, <size_t>r.size)
            a = self._arena_take(r.size)
            r.block = self.arena
            r.data = p
            self.slot_ref[s] = a
            self.n_copied += 1
            self.n_copied_bytes += r.size
            self._release(e, r.size)

    cdef void _drop(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.count):
            self._release(self.slot_ref[i], self.slots[i].size)
        self.count = 0
        if self.hold >= 0:
            self._release(self.hold, self.hold_size)
            self.hold = -1
        self._drop_arena()
        self.due = False
        self.since = 0

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
            self._release(self.hold, self.hold_size)
            self.hold = -1
        if self.due:
            self._compact()
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
                self.slot_ref[self.count] = self._acquire(rec.block, rec.size)
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
        if rl_record_is_deferred(&self.slots[j]) and not rl_deferred_may_go_out(&self.slots[j]):
            self._verify_slot(j)
        # Refill first, emit after.  c_next is `except -1`: an exception jumps
        # straight out of this function, so nothing may be half-moved when it
        # is called (the buffer keeps every record it holds, `hold` is empty).
        if not self.upstream_done:
            r = self.reader.c_next(&rec)
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]    # the slot's reference moves to `hold`
            self.hold_size = out.size
            if r == 1:
                self.slot_ref[j] = self._acquire(rec.block, rec.size)
                self.slots[j] = rec
                self._draw_ahead()
                return 1
            self.upstream_done = True
        else:
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]
            self.hold_size = out.size
        self.count -= 1
        self.slots[j] = self.slots[self.count]
        self.slot_ref[j] = self.slot_ref[self.count]
        self._draw_ahead()
        return 1

    cdef int _verify_slot(self, int64_t j) except -1 nogil:
        """Slot j holds a deferred record and the caller is not the batch that
        asked for it: a verified copy replaces it (or, failing, the slot is
        dropped and the error raised: reading on loses only that record)."""
        cdef int code
        cdef int64_t off, size = self.slots[j].size
        cdef rl_block *nb = rl_deferred_materialize(&self.slots[j], &code, &off)
        if nb == NULL:
            with gil:
                from readerlib.formats._recordio import _deferred_error_py
                err = _deferred_error_py(<size_t>self.slots[j].block, code, off)
            self._release(self.slot_ref[j], size)
            self.count -= 1
            self.slots[j] = self.slots[self.count]
            self.slot_ref[j] = self.slot_ref[self.count]
            self.next_j = -1
            with gil:
                raise err
        self._release(self.slot_ref[j], size)
        self.slot_ref[j] = self._acquire(nb, size)
        rl_block_decref(nb)               # the buffer's reference is the one left
        self.slots[j].block = nb
        self.slots[j].data = nb.data
        return 0

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

    def _memory_stats(self):
        """Test hook: what the buffer holds now.  `pinned_bytes`: the sizes of
        the distinct blocks it references; `payload_bytes`: of the records;
        `passes` / `copied_records` / `copied_bytes`: compaction so far."""
        cdef int64_t i, blocks = 0
        for i in range(self.btab_hw):
            if self.btab[i].block != NULL:
                blocks += 1
        return {"pinned_bytes": int(self.pinned), "payload_bytes": int(self.payload),
                "blocks": int(blocks), "passes": int(self.n_passes),
                "copied_records": int(self.n_copied), "copied_bytes": int(self.n_copied_bytes)}

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

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
        self._restart()

    def _reduce_args(self):
        return (int(self.cap),), {"seed": None if self.seed_drawn else int(self.seed)}

    def __repr__(self):
        return f"ShuffleReader({self.reader!r}, buffer_size={self.cap}, seed={self.seed})"


