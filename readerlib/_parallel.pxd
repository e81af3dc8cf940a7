# readerlib's own worker threads: the one place that starts threads for a
# parallel loop (checksums, batch copies, kernels).  Other compiled modules
# `cimport` these functions; Cython exports them through this module's C API,
# so the pool and the thread count exist once per process.
#
# A parallel loop is a body over a range of items:
#     body(ctx, begin, end, tid)   runs items [begin, end) on thread `tid`
# `tid` is in [0, n_threads): 0 is the calling thread; per-thread scratch is
# indexed by it (a thread may run several ranges, one at a time).  Each item is
# run exactly once, by one thread; which thread runs which range is NOT fixed
# (idle threads take unclaimed ranges), so a body must give the same result
# whatever thread runs it.
from readerlib._typedefs cimport int64_t

ctypedef void (*rl_body_fn)(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil

# Run `body` over [0, n_items) on up to `n_threads` threads (the caller is one
# of them) and return when every item is done.  Runs serially, on the caller,
# when n_threads <= 1, n_items <= 1, the build has no threads, or the call is
# nested (from inside a body or while another thread's loop holds the pool).
cdef void parallel_for(int n_threads, int64_t n_items, rl_body_fn body, void *ctx) noexcept nogil

# For a body that claims its own chunks inside one share (the reindex forward):
# called on tid 0 after its first chunk, it moves the workers that have not
# joined the loop yet off the caller's CPU (see _parallel.pyx, "Placement");
# the pool does this itself after the caller's first share.  Once per loop;
# nothing when the loop runs serially.  Only tid 0 may call it.
cdef void place_late_workers() noexcept nogil

# The process-wide thread count (readerlib.set_num_threads / READERLIB_NUM_THREADS).
cdef int num_threads() noexcept nogil

# Threads worth using for `work_bytes` bytes of memory traffic: num_threads(),
# capped so each thread gets at least MIN_BYTES_PER_THREAD (see _parallel.pyx).
cdef int threads_for(int64_t work_bytes) noexcept nogil
