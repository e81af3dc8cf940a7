# cython: freethreading_compatible=False
"""The C core's state, once per process.

Design:
    include/rl_core.h is compiled into every extension, but its state -- the
    CRC-32C tables (slicing-by-8, the hardware loop's shift operators, the
    combine operators) and the block pool with its 64 MiB bound -- is one
    `rl_core_state`, defined here and filled at import.  The other modules
    get a pointer to it from the capsule `_C_CORE` (rl_core_import() at their
    init), so one process has one pool and one set of tables however many
    extensions use them.

    Also here: the CRC-32C entry points (`crc32c`, and `crc32c_parallel`, the
    checksum of a large buffer split over readerlib's worker threads).
"""
from cpython.pycapsule cimport PyCapsule_New
from libc.errno cimport errno

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib._parallel cimport parallel_for, threads_for

cdef extern from *:
    """
    #define RL_CORE_OWNER 1
    """

cdef extern from "rl_core.h":
    ctypedef struct rl_core_state:
        int crc_hw
        int crc_fold
        int pool_n
        int64_t pool_bytes
    const char *RL_CORE_CAPSULE
    void rl_core_state_init(rl_core_state *st)
    uint32_t rl_crc32c(uint32_t crc, const void *buf, size_t length) nogil
    uint32_t rl_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) nogil

cdef extern from *:
    """
    static int rl_core_cpu_can_fold(void) {
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
    #else
        return 0;
    #endif
    }
    """
    int rl_core_cpu_can_fold()


def _cpu_can_fold():
    return bool(rl_core_cpu_can_fold())


cdef extern from *:
    """
    /* test hook: free every pooled block */
    static void rl_core_pool_drain(void) {
        rl_pool_lock();
        while (rl_pool_n > 0) {
            rl_block *b = rl_pool[--rl_pool_n];
            rl_pool_bytes -= b->aux;
            free(b->data);
            free(b);
        }
        rl_pool_unlock();
    }
    """
    void rl_core_pool_drain()

cdef rl_core_state _state
rl_core_state_init(&_state)
_C_CORE = PyCapsule_New(&_state, RL_CORE_CAPSULE, NULL)

# The one-copy path's process state (include/rl_mapped.h): the SIGBUS guard's
# thread-local slot and handler, and the release function that identifies a
# deferred record.  The handler goes in at import and again (on top of
# whatever is there then, e.g. faulthandler's) each time a chain negotiates
# mapped reads, and in a forked child.
cdef extern from *:
    """
    #define RL_MAPPED_OWNER 1
    """

cdef extern from "rl_mapped.h":
    ctypedef struct rl_mapped_api:
        int (*guard_ensure)() noexcept nogil
    rl_mapped_api rl_mapped_state
    const char *RL_MAPPED_CAPSULE
    int rl_guard_installed

_C_MAPPED = PyCapsule_New(&rl_mapped_state, RL_MAPPED_CAPSULE, NULL)


def _sigbus_guard_ensure():
    """(Re)install the SIGBUS guard's handler on top of the current one; True
    when it is installed (also a test hook)."""
    import os
    if rl_mapped_state.guard_ensure() != 0:
        e = errno
        raise OSError(e, f"sigaction(SIGBUS) failed: {os.strerror(e)}")
    return bool(rl_guard_installed)


_sigbus_guard_ensure()
import os as _os
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_sigbus_guard_ensure)
del _os

__all__ = ["crc32c"]


cdef enum:
    _PAR_MAX_PARTS = 64         # a chunk checksum uses at most 2 * 64 parts


cdef struct _crc_job:
    const char *p
    int64_t n
    int64_t part_len          # every part but the last; a multiple of 64
    int64_t n_parts
    uint32_t *crcs


cdef void _crc_parts(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _crc_job *j = <_crc_job *>ctx
    cdef int64_t k, start
    for k in range(begin, end):
        start = k * j.part_len
        j.crcs[k] = rl_crc32c(0, j.p + start,
                              j.part_len if k + 1 < j.n_parts else j.n - start)


cdef uint32_t crc32c_parallel(const char *p, int64_t n) noexcept nogil:
    """CRC-32C of n bytes: serial below 2 * MIN_BYTES_PER_THREAD, else parts
    checksummed on the pool's threads and combined in order (zlib's
    crc32_combine; the result never depends on the thread count)."""
    cdef int t = threads_for(n)
    cdef _crc_job j
    cdef uint32_t crcs[2 * _PAR_MAX_PARTS]
    cdef uint32_t acc
    cdef int64_t k
    if t < 2:
        return rl_crc32c(0, p, n)
    j.n_parts = 2 * t if 2 * t <= 2 * _PAR_MAX_PARTS else 2 * _PAR_MAX_PARTS
    j.part_len = (n // j.n_parts) & ~(<int64_t>63)
    j.p = p
    j.n = n
    j.crcs = crcs
    parallel_for(t, j.n_parts, _crc_parts, &j)
    acc = crcs[0]
    for k in range(1, j.n_parts):
        acc = rl_crc32c_combine(acc, crcs[k], j.part_len if k + 1 < j.n_parts else n - k * j.part_len)
    return acc


def _crc32c_parallel_py(data):
    """Test hook: crc32c_parallel over a bytes-like object."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    if view.shape[0] == 0:
        return 0
    return crc32c_parallel(<const char *>&view[0], view.shape[0])


def crc32c(data, uint32_t crc=0):
    """CRC-32C (Castagnoli) of a bytes-like object, continuing from `crc`."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef uint32_t out
    with nogil:
        out = rl_crc32c(crc, &view[0] if view.shape[0] else NULL, view.shape[0])
    return out


def _crc32c_uses_hardware():
    return _state.crc_hw == 1


def _crc32c_uses_folding():
    """Whether long inputs take the AVX-512 VPCLMULQDQ folding (rl_core.h)."""
    return _state.crc_fold == 1


def _set_crc32c_folding(flag):
    """Test / benchmark hook: the folding on (where the CPU has it) or off, for
    every module of the process (the state is shared); returns the old setting.
    Turning it on without the CPU's support is refused (ValueError)."""
    old = _state.crc_fold == 1
    if flag and not old and not _state.crc_hw:
        raise ValueError("no hardware CRC on this machine")
    if flag and not old and not _cpu_can_fold():
        raise ValueError("this CPU has no AVX-512 VPCLMULQDQ")
    _state.crc_fold = 1 if flag else 0
    return old


def _pool_stats():
    """Test hook: (blocks, bytes) in the process's one block pool."""
    return int(_state.pool_n), int(_state.pool_bytes)


def _pool_drain():
    """Test hook: empty the block pool."""
    rl_core_pool_drain()
