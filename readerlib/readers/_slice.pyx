# cython: freethreading_compatible=False
"""take / skip / repeat, and the length of a chain where it is known.

Design:
    Each is a compiled DecoratedReader that only counts: records pass on
    unchanged, without the GIL.  They work on instances and batches alike.

    State: the position in the epoch is what get_state() stores; on restore
    take, skip and repeat pass it down with `c_skip` (O(1) where the reader
    below positions without reading), so they need nothing more.  A
    repeat's passes are part of its one (possibly endless) epoch: each pass
    resets the reader below, which starts that reader's next epoch (a new
    shuffle order), exactly as MultiPassReader does; restoring replays from
    the repeat's start, through the passes already read (each pass with the
    reader below's c_skip: free over indexed sources; a reader that cannot
    position replays its items).
"""
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport ReaderBase, DecoratedReader, rl_record, rl_core_import
from readerlib.readers._base import _check_positive_int, _check_reader, _epoch_step, _restore_epoch_states

rl_core_import()

__all__ = ["TakeReader", "SkipReader", "RepeatReader", "length_of"]


def length_of(reader):
    """Items per epoch of `reader`, or None when it is not known without reading."""
    from readerlib.readers import _base, _batch, _passes, _prefetch, _shuffle, _sources
    from readerlib.formats._recordio import RecordIOReader
    from readerlib.formats._tfrecord import TFRecordReader
    f = getattr(reader, "_length", None)
    if f is not None:
        return f()
    if isinstance(reader, (_sources._ChunkedSource, RecordIOReader, TFRecordReader)):
        return len(reader)
    if isinstance(reader, (_shuffle.ShuffleReader, _base.ReaderHolder, _prefetch.PrefetchReader)):
        return length_of(reader._upstream()[0])
    if isinstance(reader, _batch.BatchReader):
        n = length_of(reader.reader)
        if n is None:
            return None
        b = reader.batch_size
        return n // b if reader.drop_last else -(-n // b)
    if isinstance(reader, _passes.MultiPassReader):
        n = length_of(reader.reader)
        return None if n is None else n * reader.num_passes
    if isinstance(reader, _passes.ShardReader):
        n = length_of(reader.reader)
        if n is None:
            return None
        return max(0, -(-(n - reader.index) // reader.num_shards))
    return None


cdef class TakeReader(DecoratedReader):
    """The first `count` items of each epoch (tf.data's take).

    Parameters
    ----------
    reader : ReaderBase
    count : int
        >= 0; an epoch shorter than that ends early.
    """
    cdef readonly int64_t count
    cdef int64_t taken

    def __init__(self, reader, count):
        _check_reader(reader, "TakeReader")
        n = _check_positive_int(count, "count", allow_zero=True)
        DecoratedReader.__init__(self, reader)
        self.count = n
        self.taken = 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r
        if self.taken >= self.count:
            return 0
        r = self.reader.c_next(out)
        if r == 1:
            self.taken += 1
        return r

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        cdef int64_t got
        if n > self.count - self.taken:
            n = self.count - self.taken
        if n <= 0:
            return 0
        got = self.reader.c_skip(n)
        self.taken += got
        return got

    cdef int c_reset(self) except -1:
        self.taken = 0
        return self.reader.c_reset()

    def _length(self):
        r = self.reader
        if isinstance(r, RepeatReader) and (<RepeatReader>r).num_passes < 0:
            m = length_of(r.reader)          # endless unless the reader below is empty
            return None if m is None else (0 if m == 0 else self.count)
        n = length_of(r)
        return None if n is None else min(n, self.count)

    def __repr__(self):
        return f"TakeReader({self.reader!r}, count={self.count})"

    def _describe(self):
        return {"count": int(self.count)}

    def _reduce_args(self):
        return (int(self.count),), {}

cdef class SkipReader(DecoratedReader):
    """Each epoch without its first `count` items (tf.data's skip).

    The skipped items are stepped over with the reader below's `c_skip`
    (nothing is read where it can position without reading: indexed files,
    global shuffles, batch/map over them), one at a time when read on,
    so an error below in the middle leaves the count exact; set_state skips
    them together with the position in one call.
    """
    cdef readonly int64_t count
    cdef int64_t nskipped
    cdef bint lost                  # a bulk skip raised: how far it got is unknown

    def __init__(self, reader, count):
        _check_reader(reader, "SkipReader")
        n = _check_positive_int(count, "count", allow_zero=True)
        DecoratedReader.__init__(self, reader)
        self.count = n
        self.nskipped = 0

    cdef int _check_lost(self) except -1 nogil:
        if self.lost:
            with gil:
                raise RuntimeError(
                    f"SkipReader(count={self.count}): an error from the reader below interrupted "
                    f"a skip, so the position in the epoch is unknown; reset() the chain (or "
                    f"set_state() it again)")
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        self._check_lost()
        # one at a time: after an error below, `nskipped` is exact and the next
        # call skips on (c_skip(1) reads nothing over indexed sources)
        while self.nskipped < self.count:
            if self.reader.c_skip(1) != 1:
                return 0
            self.nskipped += 1
        return self.reader.c_next(out)

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # the rest of the prefix and the n items in one call below (set_state:
        # O(1) over a reader that positions without reading)
        cdef int64_t pre, got
        self._check_lost()
        if n <= 0:
            return 0
        pre = self.count - self.nskipped
        self.lost = True
        got = self.reader.c_skip(pre + n)
        self.lost = False
        if got <= pre:
            self.nskipped += got
            return 0
        self.nskipped = self.count
        return got - pre

    cdef int c_reset(self) except -1:
        self.nskipped = 0
        self.lost = False
        return self.reader.c_reset()

    def _length(self):
        n = length_of(self.reader)
        return None if n is None else max(0, n - self.count)

    def __repr__(self):
        return f"SkipReader({self.reader!r}, count={self.count})"

    def _describe(self):
        return {"count": int(self.count)}

    def _reduce_args(self):
        return (int(self.count),), {}

cdef class RepeatReader(DecoratedReader):
    """The reader's epochs one after another: `count` of them, or forever.

    Each pass is a new epoch of the reader below (a shuffle below draws a new
    order), like `multi_pass`, but endless by default (tf.data's
    `repeat()`).  A reader below that yields nothing ends the repeat instead
    of looping forever.

    Parameters
    ----------
    reader : ReaderBase
    count : int or None
        Passes per epoch of the repeat; None (default) repeats forever.
    """
    cdef readonly int64_t num_passes       # -1: forever
    cdef readonly int64_t pass_id
    cdef int64_t in_pass                    # items read in this pass
    cdef object _step_from                  # epoch states below before a pass step that raised, or None
    cdef bint stepping                      # a pass step is under way (it raised: the next call retries it first)

    def __init__(self, reader, count=None):
        _check_reader(reader, "RepeatReader")
        n = -1 if count is None else _check_positive_int(count, "count", allow_zero=True)
        DecoratedReader.__init__(self, reader)
        self.num_passes = n
        self.pass_id = 0
        self.in_pass = 0

    @property
    def count(self):
        return None if self.num_passes < 0 else self.num_passes

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r
        if self.num_passes == 0:
            return 0
        if self.stepping:                   # the last pass step raised part-way: the reader
            with gil:                       # below is half reset (a prefetcher refuses reads)
                self._start_pass()
            self.pass_id += 1
            self.in_pass = 0
        while True:
            r = self.reader.c_next(out)
            if r != 0:
                if r == 1:
                    self.in_pass += 1
                return r
            if self.in_pass == 0 or (self.num_passes > 0 and self.pass_id + 1 >= self.num_passes):
                return 0            # done, or the reader below is empty: never spin
            with gil:
                self._start_pass()
            # after the reset: one that raises leaves the pass where it was (a
            # get_state then saves it so), and the next call retries it
            self.pass_id += 1
            self.in_pass = 0

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # pass by pass, as c_next moves on: each pass's reader skips its part
        cdef int64_t done = 0, got
        if self.num_passes == 0 or n <= 0:
            return 0
        if self.stepping:                   # (as in c_next)
            with gil:
                self._start_pass()
            self.pass_id += 1
            self.in_pass = 0
        while True:
            got = self.reader.c_skip(n - done)
            done += got
            self.in_pass += got
            if done >= n:
                return done
            if self.in_pass == 0 or (self.num_passes > 0 and self.pass_id + 1 >= self.num_passes):
                return done
            with gil:
                self._start_pass()
            self.pass_id += 1             # (after the reset, as in c_next)
            self.in_pass = 0

    def _start_pass(self):
        """The next pass of the reader below: its c_reset in the middle of this
        reader's epoch.  One that raised part-way is retried from the epoch
        states it started from (_restore_epoch_states): a shuffle below moved
        its epoch twice, and a state saved in that pass restored another order."""
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
        self.in_pass = 0
        self.stepping = False
        self._step_from = None
        return self.reader.c_reset()

    def _length(self):
        if self.num_passes < 0:
            return None
        n = length_of(self.reader)
        return None if n is None else n * self.num_passes

    def __repr__(self):
        return f"RepeatReader({self.reader!r}, count={self.count})"

    def _describe(self):
        return {"count": None if self.num_passes < 0 else int(self.num_passes)}

    def _reduce_args(self):
        return (None if self.num_passes < 0 else int(self.num_passes),), {}
