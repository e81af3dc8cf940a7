# The Cython extension point for maps: what a user's `.pyx` cimports.
#
#     from readerlib.transform cimport RecordTransform
#
#     cdef class Normalize(RecordTransform):
#         cdef int transform(self, const char **src, const int64_t *src_rows,
#                            char **dst, const int64_t *dst_rows) noexcept nogil:
#             ...                      # read field f at src[f], write it at dst[f]
#             return 0
#
#     reader.map(Normalize(...))     # runs without the GIL, on readerlib's threads
#
# Build the user's module with `include_dirs=[readerlib.get_include()]` (the
# C headers this file's cimports name); readerlib ships its `.pxd` files.
# A module that also calls rl_core.h functions (rl_block_new ...) calls
# `rl_core_import()` (cimported from here) once at module level first.
#
# One call per instance.  `src[f]` points at input field f's rows and
# `src_rows[f]` counts them (1 for a fixed field); `dst[f]` is room for output
# field f, `dst_rows[f]` rows of output_schema[f].row_bytes.  Rows are packed
# (the instance encoding of readers/_base.pxd), so a pointer is only as
# aligned as the bytes before it: read and write through `memcpy`, or casts
# the target tolerates (x86-64 and AArch64 do for the usual dtypes).  Fields
# are in schema order and little endian.
#
# Threads: records are transformed in chunks; a chunk big enough to pay is
# split over readerlib's worker threads (readerlib.set_num_threads), so
# `transform` and `output_rows` run concurrently on several records: they
# must only read `self` (set everything up in `prepare`), write only their
# own `dst`, and hold no Python object (they run without the GIL).  The
# output is the same, byte for byte, for any number of threads.
#
# Errors: return a code > 0 from `transform` (or < 0 from `output_rows`);
# the read that would have returned that record raises ValueError with
# `error_message(code)`, the record's position and the file it came from.
# The record is dropped and reading on continues with the next one, as with
# a Python map.
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport rl_layout, RL_MAX_FIELDS, rl_core_import


cdef class RecordTransform:
    # The declared output schema (None: output_schema_for decides; a subclass
    # may set it in __init__).
    cdef public object output_schema
    # Set by `bind` (the reader calls it when the map is built): the input and
    # output schemas (readerlib.Schema) and their compiled layouts.
    cdef readonly object input_schema
    cdef readonly object bound_output_schema
    cdef rl_layout in_layout
    cdef rl_layout out_layout
    # Per output field: the input field of the same name and lod level, or -1
    # (what the default `output_rows` copies for a sequence field).
    cdef int rows_from[RL_MAX_FIELDS]
    cdef bint bound

    # Rows of output sequence field `field` (lod_level 1) for this instance:
    # >= 0, or < 0 for an error code.  Called once per sequence field before
    # `transform`.  Default: the rows of the input field of the same name.
    cdef int64_t output_rows(self, int field, const char **src,
                             const int64_t *src_rows) noexcept nogil

    # Transform one instance: 0 on success, an error code > 0 otherwise.
    # Default: the error code 1 ("transform is not implemented").
    cdef int transform(self, const char **src, const int64_t *src_rows,
                       char **dst, const int64_t *dst_rows) noexcept nogil
