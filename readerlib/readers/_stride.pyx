# cython: freethreading_compatible=False
"""StrideReader: every k-th item of a chain (generic item-level sharding).

Design:
    Shard `index` of `num_shards` takes items index, index + k, index + 2k, ...
    of every epoch (k = num_shards) and skips the others in compiled code:
    a skipped item costs one upstream `c_next` and no Python object.  Every
    shard reads the whole chain below, so together the shards see each item
    exactly once *provided every shard's chain yields the same items in the
    same order* (same files, same shuffle seed).  Sharding by chunk or file
    (`.shard()`, `open_files(shard=...)`) avoids the redundant reads; this is
    the fallback that works on any chain.
"""
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport ReaderBase, DecoratedReader, rl_record
from readerlib.readers._base import _check_positive_int, _check_reader

__all__ = ["StrideReader"]


cdef class StrideReader(DecoratedReader):
    """Items `index`, `index + num_shards`, ... of each epoch of `reader`.

    Parameters
    ----------
    reader : ReaderBase
    num_shards : int
    index : int
        In ``[0, num_shards)``.

    Examples
    --------
    >>> [int(x[0]) for x in StrideReader(ArrayReader(np.arange(10)), 3, 1)]
    [1, 4, 7]
    """
    cdef readonly int64_t num_shards
    cdef readonly int64_t index
    cdef bint begun

    def __init__(self, reader, num_shards, index):
        _check_reader(reader, "StrideReader")
        k = _check_positive_int(num_shards, "num_shards")
        i = _check_positive_int(index, "index", allow_zero=True)
        if i >= k:
            raise ValueError(f"index must be in [0, num_shards) = [0, {k}), got {i}")
        DecoratedReader.__init__(self, reader)
        self.num_shards = k
        self.index = i
        self.begun = False

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int64_t skip = self.num_shards - 1 if self.begun else self.index
        cdef int r
        self.begun = True
        while skip > 0:
            r = self.reader.c_next(out)
            if r <= 0:
                return r
            skip -= 1
        return self.reader.c_next(out)

    cdef int c_reset(self) except -1:
        self.begun = False
        return self.reader.c_reset()

    def __repr__(self):
        return f"StrideReader({self.reader!r}, num_shards={self.num_shards}, index={self.index})"
