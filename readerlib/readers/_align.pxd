# The start of the next 64-byte aligned section of a batch block (the block
# layouts: readers/_codec.pxd).  The one definition, cimported by
# readers/_batch.pyx, _codec.pyx and _padded.pyx.  A .pxd with no .pyx and no
# cdef class on purpose: cimporting it adds no import at module init.
from readerlib._typedefs cimport int64_t


cdef inline int64_t _align64(int64_t x) noexcept nogil:
    return (x + 63) & ~(<int64_t>63)
