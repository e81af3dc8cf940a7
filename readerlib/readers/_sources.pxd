# The sources other compiled modules reach into: RecordIOWriter.write_columns
# reuses ArrayReader's validated columns (`C`).
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport FileReader, rl_block, rl_columns


# Sources that encode instances into blocks a chunk at a time.
cdef class _ChunkedSource(FileReader):
    cdef rl_block *cur
    cdef int64_t *rec_off
    cdef int64_t rec_off_cap
    cdef int64_t ncur
    cdef int64_t icur
    cdef readonly int64_t num_instances
    cdef int64_t next_index
    cdef int64_t chunk_records
    cdef int _reserve(self, int64_t n) except -1
    cdef int _load(self, int64_t start, int64_t count) except -1


cdef class ArrayReader(_ChunkedSource):
    cdef list _cols
    cdef rl_columns C          # the validated columns (writers reuse them)
    cdef bint zero_copy
