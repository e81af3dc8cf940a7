# cython: freethreading_compatible=False
"""Decorators that choose which items of a chain pass, and how often:
MultiPassReader (every item `num_passes` times per epoch, Paddle's) and
ShardReader (every `num_shards`-th item, tf.data's shard)."""
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64,
    layout_parse, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _check_reader, _epoch_step, _restore_epoch_states

rl_core_import()

__all__ = ["MultiPassReader", "ShardReader"]


cdef class MultiPassReader(DecoratedReader):
    """Read the decorated reader `num_passes` times per epoch (Paddle's)."""
    cdef readonly int64_t num_passes
    cdef readonly int64_t pass_id
    cdef object _step_from              # epoch states below before a pass step that raised, or None
    cdef bint stepping                  # a pass step is under way (it raised: the next call retries it first)

    def __init__(self, reader, num_passes):
        _check_reader(reader, "MultiPassReader")
        n = _check_positive_int(num_passes, "num_passes")
        DecoratedReader.__init__(self, reader)
        self.num_passes = n
        self.pass_id = 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r
        if self.stepping:                 # the last pass step raised part-way: the reader
            with gil:                     # below is half reset (a prefetcher refuses reads)
                self._start_pass()
            self.pass_id += 1
        r = self.reader.c_next(out)
        while r == 0 and self.pass_id + 1 < self.num_passes:
            with gil:
                self._start_pass()
            self.pass_id += 1             # after the reset: if it raises, the next call retries it
            r = self.reader.c_next(out)
        return r

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # pass by pass, as c_next moves on: the reader below skips its part of
        # each (O(1) where it positions without reading)
        cdef int64_t done = 0
        if n <= 0:
            return 0
        if self.stepping:                 # (as in c_next)
            with gil:
                self._start_pass()
            self.pass_id += 1
        done = self.reader.c_skip(n)
        while done < n and self.pass_id + 1 < self.num_passes:
            with gil:
                self._start_pass()
            self.pass_id += 1
            done += self.reader.c_skip(n - done)
        return done

    def _start_pass(self):
        """The next pass of the reader below (its c_reset); one that raised
        part-way is retried from the epoch states it started from (as
        RepeatReader._start_pass)."""
        if not self.stepping:
            self._step_from = self.reader._chain_epoch_state(False)
            self.stepping = True
        else:
            _restore_epoch_states(self.reader, self._step_from)
        _epoch_step()                     # (a prefetcher's read-ahead: noted)
        self.reader.c_reset()
        self.stepping = False
        self._step_from = None

    cdef int c_reset(self) except -1:
        self.pass_id = 0
        self.stepping = False
        self._step_from = None
        return self.reader.c_reset()

    def __repr__(self):
        return f"MultiPassReader({self.reader!r}, num_passes={self.num_passes})"

    def _describe(self):
        return {"num_passes": int(self.num_passes)}

    def _reduce_args(self):
        return (int(self.num_passes),), {}


cdef class ShardReader(DecoratedReader):
    """Keep every `num_shards`-th item, starting at `index` (tf.data's shard).

    Works on any reader (instances or batches).  For files, prefer
    `open_files(..., shard=(rank, world))`, which skips other ranks' chunks
    instead of reading and dropping them.

    Parameters
    ----------
    reader : ReaderBase
    num_shards : int
    index : int
        0 <= index < num_shards.
    """
    cdef readonly int64_t num_shards
    cdef readonly int64_t index
    cdef int64_t pos

    def __init__(self, reader, num_shards, index):
        _check_reader(reader, "ShardReader")
        n = _check_positive_int(num_shards, "num_shards")
        i = _check_positive_int(index, "index", allow_zero=True)
        if i >= n:
            raise ValueError(f"index must be in [0, num_shards={n}), got {i}")
        DecoratedReader.__init__(self, reader)
        self.num_shards = n
        self.index = i
        self.pos = 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        # other shards' items are skipped (c_skip: free over a global shuffle or an
        # indexed source, read and dropped otherwise), then ours is read
        # one at a time: an exception from upstream leaves `pos` exact (as reading did)
        cdef int r
        while self.pos % self.num_shards != self.index:
            if self.reader.c_skip(1) != 1:
                return 0
            self.pos += 1
        r = self.reader.c_next(out)
        if r <= 0:
            return r
        self.pos += 1
        return 1

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # n of our items: upstream up to just after our n-th
        cdef int64_t first, want, got, k = self.num_shards
        if n <= 0:
            return 0
        first = self.pos + (self.index - self.pos % k + k) % k
        want = first + (n - 1) * k + 1 - self.pos
        got = self.reader.c_skip(want)
        self.pos += got
        if self.pos <= first:
            return 0
        return (self.pos - 1 - first) // k + 1

    cdef int c_reset(self) except -1:
        self.pos = 0
        return self.reader.c_reset()

    def __repr__(self):
        return f"ShardReader({self.reader!r}, num_shards={self.num_shards}, index={self.index})"

    def _describe(self):
        return {"num_shards": int(self.num_shards), "index": int(self.index)}

    def _reduce_args(self):
        return (int(self.num_shards), int(self.index)), {}
