# The C core's process-wide state (include/rl_core.h: the CRC-32C tables and
# the block pool) is owned by this extension; other modules reach it through
# rl_core_import() (declared in readers/_base.pxd) and cimport from here:
from readerlib._typedefs cimport int64_t, uint32_t

# CRC-32C of a buffer; a large one is split over readerlib's worker threads
# (readerlib._parallel: readerlib.set_num_threads, READERLIB_NUM_THREADS).
cdef uint32_t crc32c_parallel(const char *p, int64_t n) noexcept nogil
