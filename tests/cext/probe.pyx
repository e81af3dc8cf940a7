# cython: language_level=3, boundscheck=False, wraparound=False
"""Test transforms for tests/test_cext.py (built with examples/normalize next to it).

Subsample(k): every k-th row of input field 0 (a sequence) as "frames", plus a
new fixed field "n_in" (int64, the input's row count): a sequence output whose
length differs from its input's (output_rows overridden), a field that is not
in the input, error codes from output_rows (< 0) and from transform (> 0).
"""
from libc.stdint cimport int64_t
from libc.string cimport memcpy

import numpy as np

from readerlib.transform cimport RecordTransform, rl_core_import

rl_core_import()

cdef enum:
    ERR_EMPTY = -5         # output_rows: an instance without rows
    ERR_MARKED = 9         # transform: first row's first byte is 0x7f


cdef class Subsample(RecordTransform):
    cdef readonly int64_t k
    cdef int64_t row_bytes

    def __init__(self, k):
        super().__init__()
        self.k = int(k)

    def output_schema_for(self, input_schema):
        import readerlib as rl
        f = input_schema.fields[0]
        return rl.Schema([rl.Field("frames", f.dtype, f.shape, lod_level=1),
                          rl.Field("n_in", np.int64)])

    def prepare(self, input_schema, output_schema):
        if not input_schema.fields[0].lod_level:
            raise TypeError("Subsample: field 0 must be a sequence")
        self.row_bytes = input_schema.fields[0].row_bytes

    def error_message(self, int code):
        if code == ERR_EMPTY:
            return "an instance without rows"
        if code == ERR_MARKED:
            return "a marked row"
        return RecordTransform.error_message(self, code)

    def __reduce__(self):
        return (type(self), (self.k,))

    cdef int64_t output_rows(self, int field, const char **src,
                             const int64_t *src_rows) noexcept nogil:
        if src_rows[0] == 0:
            return ERR_EMPTY
        return (src_rows[0] + self.k - 1) // self.k

    cdef int transform(self, const char **src, const int64_t *src_rows,
                       char **dst, const int64_t *dst_rows) noexcept nogil:
        cdef int64_t j, n = src_rows[0]
        if self.row_bytes and <unsigned char>src[0][0] == 0x7f:
            return ERR_MARKED
        for j in range(dst_rows[0]):
            memcpy(dst[0] + j * self.row_bytes, src[0] + j * self.k * self.row_bytes, self.row_bytes)
        memcpy(dst[1], &n, 8)
        return 0
