# cython: language_level=3
"""BatchReindex (Caffe) on the CPU: forward gather and deterministic backward.

Design:
  Forward, ``y[n] = x[idx[n]]``.  A row of ``x`` is ``row_bytes`` contiguous
  bytes, so the forward never looks at the dtype: each output row is one
  ``memcpy`` from its source row (float16 is just 2-byte words).  Rows of 1, 2,
  4 or 8 bytes are copied as one machine word instead (a ``memcpy`` call per
  element would dominate), and short rows that are a multiple of 32 bytes
  (up to 1 KiB) as inlined moves (libc's call and size dispatch per
  256-byte row cost ~12%): AVX-512 64-byte moves for rows of 64-byte
  multiples, else AVX2 32-byte moves, else SSE2 (the widest the CPU has,
  picked at import: ``isa()``; 32-byte rows always SSE2).  Outputs of ``STREAM_MIN_BYTES`` or more
  (rows a multiple of 16 bytes, output 16-byte aligned) are written with
  streaming stores instead.  Both of these loops (include/rl_gather.h)
  prefetch the source row ``PREFETCH_ROWS`` indices ahead: the reads are at
  random rows, which the hardware prefetchers cannot predict; the AVX2 /
  AVX-512 cached loops also prefetch the output row they write that many
  rows later (its store would otherwise wait for the line: 16 MiB of
  256-byte rows, 2 threads, 0.73 -> 0.60-0.62 ms best).  The loop over ``n`` runs
  on readerlib's pool (``readerlib._parallel.parallel_for``); on 2+ threads
  every thread claims the next ``CHUNK_BYTES`` of rows with an atomic add
  (see _gather_body), and every chunk writes a disjoint block of ``y``.
  Whether a big call splits at all is measured on the running machine: the
  recent calls' times per MiB on one thread and on the split decide (see
  "the thread count, measured" below; a busy second core makes the split
  lose).  Traffic: ``len(idx) * row_bytes`` read + the same written, the
  minimum for a gather.

  Backward, ``dx[k] = sum(dy[n] for idx[n] == k)``.  Scattering with atomics
  (or letting threads race) makes float sums depend on timing.  Instead a
  stable counting sort groups ``n`` by ``idx[n]`` (``O(len(idx) + num_rows)``,
  serial, on indices only), then a parallel loop over the *output* rows
  sums each group in ascending ``n`` order: every ``dx`` row is written by one
  thread, once, with a fixed order of additions, so the result is bitwise the
  same for any thread count.  ``dx[k] = 0 + dy[n0] + dy[n1] + ...`` exactly as
  ``np.add.at`` on zeros (the ``0 +`` keeps ``-0.0`` behaving like NumPy).
  Traffic: ``len(idx)`` rows read, each referenced ``dx`` row written once
  (groups of several rows re-read their output row from cache).  Rows no
  index refers to are zeroed, or, when the caller passes a fresh
  ``np.zeros`` array (lazily mapped zero pages), not touched at all: for
  random indices that is a fraction ``exp(-len(idx) / num_rows)`` of ``dx``.
  (With transparent huge pages, which NumPy requests for large arrays, the
  kernel zeroes a whole 2 MiB page when any row in it is written, so the
  saving is real only for big rows or sparse indices: perf at (4096, 8192,
  2048) still shows page zeroing at 38% of a call, the sums at 16%.  Pass
  ``out=`` a reused buffer to avoid page faults altogether.)
  float16 is accumulated in float32 (per-thread scratch row) and rounded
  once at the end (round to nearest even, as NumPy's ``astype(float16)``;
  the scratch rows are indexed by the running thread's id);
  integer sums wrap.

  Indices are validated (a min/max pass) before any byte is written; the C
  functions return ``ERR_NEGATIVE`` / ``ERR_TOO_LARGE`` and the Python wrappers
  raise Caffe's messages.

Invariants: ``x``/``dy``/outputs C-contiguous; indices int32 or int64; the
output is allocated by the caller with the right shape.
"""
cimport cython
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

cimport numpy as cnp
import numpy as np
from readerlib.kernels._isa import Dispatch

from readerlib._typedefs cimport (float32_t, float64_t, index_t, int32_t, int64_t,
                                  intp_t, uint8_t, uint16_t, uint32_t, uint64_t)
from readerlib._parallel cimport parallel_for, place_late_workers, threads_for
from readerlib._parallel import threads_enabled

cnp.import_array()

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* IEEE half <-> float, exact decode and round-to-nearest-even encode
       (F. Giesen's float_to_half_fast3_rtne); bit-identical to NumPy. */
    static inline float rl_half_to_float(uint16_t h) {
        uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
        uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
        float out;
        if (exp == 0x1fu) {
            bits = sign | 0x7f800000u | (mant << 13);
        } else if (exp != 0) {
            bits = sign | ((exp + 112u) << 23) | (mant << 13);
        } else if (mant == 0) {
            bits = sign;
        } else {
            out = (float)mant * 5.9604644775390625e-08f;   /* mant * 2^-24, exact */
            memcpy(&bits, &out, 4);
            bits |= sign;
        }
        memcpy(&out, &bits, 4);
        return out;
    }

    static inline uint16_t rl_float_to_half(float value) {
        uint32_t u, sign, o;
        float f;
        memcpy(&u, &value, 4);
        sign = u & 0x80000000u;
        u ^= sign;
        if (u >= ((127u + 16u) << 23)) {                  /* >= 65536: inf or nan */
            o = (u > 0x7f800000u) ? (0x7e00u | ((u >> 13) & 0x3ffu)) : 0x7c00u;
        } else if (u < (113u << 23)) {                    /* half subnormal or zero */
            const uint32_t magic_u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
            float magic;
            memcpy(&magic, &magic_u, 4);
            memcpy(&f, &u, 4);
            f += magic;                                   /* FPU rounds to nearest even */
            memcpy(&o, &f, 4);
            o -= magic_u;
        } else {
            uint32_t mant_odd = (u >> 13) & 1u;
            u += ((uint32_t)(15 - 127) << 23) + 0xfffu;
            u += mant_odd;
            o = u >> 13;
        }
        return (uint16_t)(o | (sign >> 16));
    }

    /* Ask for the first lines of a row we will read soon (the backward reads
       dy rows in group order, i.e. at random; longer rows stream by themselves). */
    static inline void rl_prefetch_row(const void* p, Py_ssize_t nbytes) {
    #if defined(__GNUC__)
        const char* c = (const char*)p;
        Py_ssize_t o;
        if (nbytes > 512) nbytes = 512;
        for (o = 0; o < nbytes; o += 64) __builtin_prefetch(c + o, 0, 3);
    #else
        (void)p; (void)nbytes;
    #endif
    }

    """
    void rl_prefetch_row(const void* p, intp_t nbytes) noexcept nogil
    float rl_half_to_float(uint16_t h) noexcept nogil
    uint16_t rl_float_to_half(float value) noexcept nogil

# The forward's row loops (cached and streaming, with prefetch) and the
# cached loop's run-time ISA dispatch.
cdef extern from "rl_gather.h":
    int RL_GATHER_SSE2
    int rl_gather_select_isa(int want) noexcept nogil
    void rl_gather_cached_i32(const char* src, intp_t rb, const int32_t* idx, intp_t b,
                              intp_t e, char* dst, intp_t pf) noexcept nogil
    void rl_gather_cached_i64(const char* src, intp_t rb, const int64_t* idx, intp_t b,
                              intp_t e, char* dst, intp_t pf) noexcept nogil
    void rl_gather_stream_i32(const char* src, intp_t rb, const int32_t* idx, intp_t b,
                              intp_t e, char* dst, intp_t pf) noexcept nogil
    void rl_gather_stream_i64(const char* src, intp_t rb, const int64_t* idx, intp_t b,
                              intp_t e, char* dst, intp_t pf) noexcept nogil


def _select(int want):
    return rl_gather_select_isa(want)


_DISPATCH = Dispatch(_select)          # (readerlib/kernels/_isa.py, include/rl_isa.h)


def isa():
    """The instruction set of the forward's cached row loop ('sse2', 'avx2' or
    'avx512'; with 'avx512', rows that are not a multiple of 64 bytes use AVX2,
    and 32-byte rows always use SSE2)."""
    return _DISPATCH.name()


def _set_isa(name=None):
    """Force the forward's cached row loop (tests and benchmarks); None picks the best.

    Returns the name in use (a request above what the CPU has falls back).
    Not thread-safe: call it while no gather is running.
    """
    return _DISPATCH.force(name)


# Rows up to this size (and a multiple of 32 bytes) are copied with inlined moves.
cdef enum:
    SHORT_ROW_BYTES = 1024

#: The forward prefetches the source row this many indices ahead (rl_gather.h).
PREFETCH_ROWS = 16
cdef intp_t _prefetch_rows = PREFETCH_ROWS


def _set_prefetch_rows(n):
    """Change the forward's prefetch distance (benchmarks' sweep; returns the old value)."""
    global _prefetch_rows
    old = _prefetch_rows
    _prefetch_rows = max(0, int(n))
    return old

#: Outputs at least this big are written with streaming stores (see
#: rl_gather.h); smaller ones stay in the caches, where the caller will read
#: them next.  Measured with benchmarks/bench_kernels_cpu.py --sweep on a
#: Zen 4 EPYC (one thread, output and source both this big, cached vs
#: streaming: 256-byte rows 1.06x at 8 MiB, 2.3x at 16 MiB; 8 KiB rows 0.83x
#: at 8, 1.5x at 16), then raised to 32 MiB on the 2-vCPU Xeon (2026-12-05,
#: L3 shared with other tenants): 16 MiB of 256-byte rows in the interleaved
#: benchmark (the peers write the same recycled heap pages with cached stores
#: between our calls), cached stores won the medians in 3 runs of 3 (fresh
#: output 1.29-1.56 vs 1.60-2.14 ms; out= 1.26-1.48 vs 2.71-3.57), bests
#: equal (0.73-0.78 vs 0.75-0.87); an interleaved A/B against torch and
#: np.take, 60 rounds twice: median 1.87-1.90 ms vs 3.13-3.14; at 128 MiB
#: streaming wins ~2x (C driver, 2 threads, 4.7-5.1 vs 8-10 ms).
STREAM_MIN_BYTES = 32 << 20
cdef int64_t _stream_min_bytes = STREAM_MIN_BYTES


def _set_stream_min_bytes(n):
    """Change the streaming-store threshold (benchmarks' sweep; returns the old value)."""
    global _stream_min_bytes
    old = _stream_min_bytes
    _stream_min_bytes = max(0, int(n))
    return old


# The backward prefetches the dy rows of the output row this many rows ahead.
cdef enum:
    PREFETCH_GROUPS = 16

# Return codes of the nogil functions (pysam's habit: C codes, Python raises).
cdef enum:
    OK = 0
    ERR_NEGATIVE = -1
    ERR_TOO_LARGE = -2

MSG_NEGATIVE = "Index specified for reindex layer was negative."
MSG_TOO_LARGE = "Index specified for reindex layer was greater than batch size."

# Element types the backward sums natively (float16 has its own path).
ctypedef fused sum_t:
    float32_t
    float64_t
    int32_t
    int64_t
    uint8_t

# Word sizes the forward copies without memcpy.
ctypedef fused word_t:
    uint8_t
    uint16_t
    uint32_t
    uint64_t


def openmp_enabled():
    """Always False: no module uses OpenMP any more (readerlib._parallel runs the
    threads; see ``threads_enabled``).  Kept for old callers."""
    return False


cdef inline int _check_indices(const index_t* idx, intp_t n, intp_t limit) noexcept nogil:
    """OK, or ERR_NEGATIVE / ERR_TOO_LARGE for ``idx`` against ``[0, limit)``.

    Caffe's check_batch_reindex loops in order, so the FIRST bad index decides the
    message.  The common case (all good) is a branch-free min/max pass; only a
    failing batch is scanned again for its first offender.
    """
    cdef intp_t i
    cdef int64_t lo, hi, v
    if n == 0:
        return OK
    lo = idx[0]
    hi = idx[0]
    for i in range(1, n):
        v = idx[i]
        lo = v if v < lo else lo
        hi = v if v > hi else hi
    if lo >= 0 and hi < limit:
        return OK
    for i in range(n):
        v = idx[i]
        if v < 0:
            return ERR_NEGATIVE
        if v >= limit:
            return ERR_TOO_LARGE
    return OK


cdef inline void _gather_words(const word_t* src, const index_t* idx, intp_t begin, intp_t end,
                               word_t* dst) noexcept nogil:
    cdef intp_t i
    for i in range(begin, end):
        dst[i] = src[idx[i]]


cdef inline void _gather_bytes(const char* src, intp_t row_bytes, const index_t* idx,
                               intp_t begin, intp_t end, char* dst) noexcept nogil:
    cdef intp_t i
    for i in range(begin, end):
        memcpy(dst + i * row_bytes, src + <intp_t> idx[i] * row_bytes, row_bytes)


cdef inline void _gather_range(const char* src, intp_t row_bytes, const index_t* idx,
                               intp_t begin, intp_t end, char* dst, bint stream) noexcept nogil:
    if stream:
        if index_t is int32_t:
            rl_gather_stream_i32(src, row_bytes, idx, begin, end, dst, _prefetch_rows)
        else:
            rl_gather_stream_i64(src, row_bytes, idx, begin, end, dst, _prefetch_rows)
    elif row_bytes == 1:
        _gather_words(<const uint8_t*> src, idx, begin, end, <uint8_t*> dst)
    elif row_bytes == 2:
        _gather_words(<const uint16_t*> src, idx, begin, end, <uint16_t*> dst)
    elif row_bytes == 4:
        _gather_words(<const uint32_t*> src, idx, begin, end, <uint32_t*> dst)
    elif row_bytes == 8:
        _gather_words(<const uint64_t*> src, idx, begin, end, <uint64_t*> dst)
    elif row_bytes % 32 == 0 and row_bytes <= SHORT_ROW_BYTES:
        if index_t is int32_t:
            rl_gather_cached_i32(src, row_bytes, idx, begin, end, dst, _prefetch_rows)
        else:
            rl_gather_cached_i64(src, row_bytes, idx, begin, end, dst, _prefetch_rows)
    else:
        _gather_bytes(src, row_bytes, idx, begin, end, dst)


cdef extern from *:
    """
    static inline int64_t rl_reindex_claim(int64_t* next) {
        return __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    }
    static inline void rl_reindex_mark(int* flag) {
        __atomic_store_n(flag, 1, __ATOMIC_RELAXED);
    }
    """
    int64_t rl_reindex_claim(int64_t* next) noexcept nogil
    void rl_reindex_mark(int* flag) noexcept nogil


#: With more than one thread, the forward's rows are handed out in chunks of
#: about this many output bytes, one atomic claim each, instead of the pool's
#: 4 static shares per thread (see _gather_body).  0: the pool's shares.
CHUNK_BYTES = 256 << 10
cdef int64_t _chunk_bytes = CHUNK_BYTES


def _set_chunk_bytes(n):
    """Change the forward's chunk size (benchmarks, tests; returns the old value)."""
    global _chunk_bytes
    old = _chunk_bytes
    _chunk_bytes = max(0, int(n))
    return old


cdef struct _gather_job:
    const char* src
    intp_t row_bytes
    const void* idx
    bint idx32
    bint stream
    char* dst
    int64_t n               # rows
    int64_t chunk           # rows per claim; 0: [begin, end) as the pool gives it
    int64_t next            # next chunk to claim (atomic)
    int64_t items           # the n_items given to parallel_for
    int pooled              # the pool split the loop (a body call on a share, not
                            # on the whole range: parallel_for ran it serially) (atomic)


cdef inline void _gather_job_range(_gather_job* j, int64_t begin, int64_t end) noexcept nogil:
    if j.idx32:
        _gather_range(j.src, j.row_bytes, <const int32_t*> j.idx, begin, end, j.dst, j.stream)
    else:
        _gather_range(j.src, j.row_bytes, <const int64_t*> j.idx, begin, end, j.dst, j.stream)


cdef void _gather_body(void* ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    """The pool's share [begin, end); or, chunked, claim chunks until none is left.

    Chunked: the loop runs as one share per thread, and every thread claims
    the next ``chunk`` rows with one atomic add.  A worker that wakes late or
    is descheduled by a competing process leaves the rest to the caller, and
    the caller can only be kept waiting for the one chunk that worker is in
    (~30-100 us of work here) rather than a static share (an eighth of the
    call).  Results do not depend on who copies which rows.  After its first
    chunk the caller moves workers that have not started off its CPU (the
    pool's placement rule, readerlib/_parallel.pyx: one queued behind the
    caller would start when the caller has copied everything).
    """
    cdef _gather_job* j = <_gather_job*> ctx
    cdef int64_t c, b
    cdef bint split = begin != 0 or end != j.items
    cdef bint first = tid == 0 and split
    if split:
        rl_reindex_mark(&j.pooled)
    if j.chunk == 0:
        _gather_job_range(j, begin, end)
        return
    while True:
        c = rl_reindex_claim(&j.next)
        b = c * j.chunk
        if b >= j.n:
            return
        _gather_job_range(j, b, b + j.chunk if b + j.chunk < j.n else j.n)
        if first:
            first = False
            place_late_workers()


cdef int _gather_rows(const char* src, intp_t n_src, intp_t row_bytes, const index_t* idx,
                      intp_t n, char* dst, int n_threads, int* pooled) noexcept nogil:
    """``*pooled``: set when the pool split the loop into shares; left 0 when it
    ran the loop on the caller alone (its back-off, another thread's loop)."""
    cdef int rc = _check_indices(idx, n, n_src)
    cdef _gather_job j
    if rc != OK or row_bytes == 0:
        return rc
    j.src = src
    j.row_bytes = row_bytes
    j.idx = idx
    j.idx32 = index_t is int32_t
    j.dst = dst
    j.stream = (RL_GATHER_SSE2 and n * row_bytes >= _stream_min_bytes and row_bytes % 16 == 0
                and (<size_t> dst) % 16 == 0)
    j.n = n
    j.next = 0
    j.pooled = 0
    j.chunk = 0
    if n_threads > 1 and _chunk_bytes > 0:
        j.chunk = max(<int64_t> 1, _chunk_bytes // row_bytes)
    if j.chunk > 0 and j.chunk < n:
        j.items = n_threads
        parallel_for(n_threads, n_threads, _gather_body, &j)
    else:
        j.chunk = 0
        j.items = n
        parallel_for(n_threads, n, _gather_body, &j)
    pooled[0] = j.pooled
    return OK


# -- fresh outputs without page faults ---------------------------------------------
#
# A fresh output of 32 MiB or more is a new mmap (glibc's mmap threshold tops
# out at 32 MiB), so every call pays a page fault and the kernel's zeroing for
# every page of it before the copy can write it: at (4096, 8192, 2048) that
# was 7 ms of a 9.7 ms call (perf: clear_page / clear_huge_page), the copy
# itself 2.9 ms.  Smaller blocks are recycled by malloc already.  So big
# outputs come from a small cache of blocks that earlier outputs released
# (the block is the array's base; when the array dies, the block returns
# here): a training loop that gathers a batch per step reuses the same pages.
# Bounded: at most CACHE_SLOTS idle blocks and CACHE_MAX_BYTES in all; every
# byte of such an output is overwritten by the gather, so reuse is invisible.

cdef extern from *:
    """
    #include <stdlib.h>
    #if defined(__linux__)
    #include <sys/mman.h>
    #endif
    #define RL_CACHE_SLOTS 2
    #define RL_BLOCK_ALIGN ((size_t)2 << 20)
    static struct { void* ptr; size_t size; } rl_cache[RL_CACHE_SLOTS];
    static size_t rl_cache_max_bytes = (size_t)512 << 20;

    static size_t rl_block_round(size_t n) { return (n + RL_BLOCK_ALIGN - 1) & ~(RL_BLOCK_ALIGN - 1); }

    /* A block of rl_block_round(n) bytes: an idle cached one of that size, else new. */
    static void* rl_block_get(size_t n) {
        size_t size = rl_block_round(n);
        void* p = NULL;
        int k;
        for (k = 0; k < RL_CACHE_SLOTS; ++k) {
            if (rl_cache[k].ptr && rl_cache[k].size == size) {
                p = rl_cache[k].ptr;
                rl_cache[k].ptr = NULL;
                return p;
            }
        }
        if (posix_memalign(&p, RL_BLOCK_ALIGN, size) != 0) return NULL;
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        madvise(p, size, MADV_HUGEPAGE);   /* as NumPy does for big arrays */
    #endif
        return p;
    }

    static size_t rl_cache_bytes(void) {
        size_t t = 0;
        int k;
        for (k = 0; k < RL_CACHE_SLOTS; ++k) if (rl_cache[k].ptr) t += rl_cache[k].size;
        return t;
    }

    /* Keep a released block for the next output (evicting the oldest), or free it. */
    static void rl_block_put(void* p, size_t n) {
        size_t size = rl_block_round(n);
        int k;
        if (size > rl_cache_max_bytes) { free(p); return; }
        if (rl_cache[RL_CACHE_SLOTS - 1].ptr) free(rl_cache[RL_CACHE_SLOTS - 1].ptr);
        for (k = RL_CACHE_SLOTS - 1; k > 0; --k) rl_cache[k] = rl_cache[k - 1];
        rl_cache[0].ptr = p;
        rl_cache[0].size = size;
        while (rl_cache_bytes() > rl_cache_max_bytes) {
            for (k = RL_CACHE_SLOTS - 1; k >= 0 && !rl_cache[k].ptr; --k) {}
            free(rl_cache[k].ptr);
            rl_cache[k].ptr = NULL;
        }
    }

    static void rl_cache_clear(void) {
        int k;
        for (k = 0; k < RL_CACHE_SLOTS; ++k) { free(rl_cache[k].ptr); rl_cache[k].ptr = NULL; }
    }
    """
    void* rl_block_get(size_t n) noexcept nogil
    void rl_block_put(void* p, size_t n) noexcept nogil
    size_t rl_cache_bytes() noexcept nogil
    void rl_cache_clear() noexcept nogil

#: Fresh outputs at least this big come from the block cache (smaller: np.empty).
CACHED_OUTPUT_BYTES = 32 << 20


cdef class _Block:
    """Owner of a cached block: the base of the arrays made by :func:`empty_output`."""
    cdef void* ptr
    cdef size_t nbytes

    def __dealloc__(self):
        if self.ptr != NULL:
            rl_block_put(self.ptr, self.nbytes)   # the GIL serialises the cache
            self.ptr = NULL


def empty_output(shape, dtype):
    """An uninitialised C-contiguous array for a kernel output that the kernel
    overwrites entirely; from the block cache when it is big (see above)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    cdef intp_t nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes < CACHED_OUTPUT_BYTES or not dtype.isnative or len(shape) > 32:
        return np.empty(shape, dtype=dtype)
    cdef _Block block = _Block.__new__(_Block)
    block.ptr = rl_block_get(<size_t> nbytes)
    if block.ptr == NULL:
        return np.empty(shape, dtype=dtype)       # let NumPy raise its MemoryError
    block.nbytes = <size_t> nbytes
    cdef cnp.npy_intp dims[32]
    cdef int nd = len(shape), k
    for k in range(nd):
        dims[k] = shape[k]
    cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(nd, dims, dtype.num, block.ptr)
    cnp.set_array_base(arr, block)
    return arr


def cached_bytes():
    """Bytes held by idle cached output blocks (tests)."""
    return rl_cache_bytes()


def release_cached_outputs():
    """Free the idle cached output blocks (they are otherwise kept for reuse)."""
    rl_cache_clear()


def index_error(idx, intp_t limit):
    """Caffe's IndexError for the first bad entry of ``idx`` (in order: the
    first bad one decides the message, as Caffe's loop does), with a note
    naming that entry, its value and the valid range.  The message itself
    stays Caffe's; the note shows in tracebacks (``add_note``).  None when
    every entry is in [0, limit)."""
    a = np.asarray(idx)
    bad = np.flatnonzero((a < 0) | (a >= limit))
    if bad.shape[0] == 0:
        return None
    k = int(bad[0])
    v = int(a[k])
    err = IndexError(MSG_NEGATIVE if v < 0 else MSG_TOO_LARGE)
    err.add_note(f"idx[{k}] = {v}; valid indices are 0 <= i < {limit} "
                 f"({'no rows' if limit == 0 else str(limit) + ' rows'}), {a.shape[0]} indices")
    return err


def _raise_for(int rc, idx, intp_t limit):
    if rc == OK:
        return
    err = index_error(idx, limit)
    if err is None:             # cannot happen: the C check and NumPy agree
        err = IndexError(MSG_NEGATIVE if rc == ERR_NEGATIVE else MSG_TOO_LARGE)
    raise err


# -- the thread count, measured on the running machine --------------------------
#
# On an idle machine a big gather is ~10-20% faster on two threads than on one
# (256-byte rows, 16 MiB: the second core's outstanding misses when the source
# is not cached); on a machine whose other core is busy the split loses
# heavily: the worker shares a CPU with the caller or with the competitor, is
# descheduled in the middle of a chunk, and the caller waits a scheduler slice
# for it (medians 2-4x the 1-thread run, benchmarks/results/kernels_cpu.md).
# Which case holds changes from one second to the next and no cheap probe
# tells (the worker wakes within ~3 us in both: it preempts someone).  So the
# gather measures: for each kind of call (cached / streaming stores) it keeps
# the time per MiB of its last TUNE_WINDOW calls on one thread and on the
# split, runs the split when its TUNE_QUANTILE_PCT quantile is lower by
# TUNE_MARGIN_PCT (a tie goes to one thread), else one thread, and every
# TUNE_EXPLORE-th call the other mode, so a change of load is seen within a
# few dozen calls.
# Since 2026-12-05 (Intel Xeon VM; the AVX-512 loop and the pool's placement
# rule): the lower quartile, no margin.  The split now gains ~40% undisturbed
# at 16 MiB of 256-byte rows (0.60-0.65 ms against 0.97-1.02 on one thread),
# and a late worker costs the caller little (chunks; the placement rule), so
# the split's slow calls are noise of the machine that one thread suffers
# too; with the old rule (upper quartile, 25%) the default call's median
# stayed near one thread's (1.17 / 1.21 ms against 0.83 / 1.06 for the
# split, two 300-round runs).  Interleaved against np.take / torch (benchmarks/results/
# kernels_cpu.md, 150 rounds per process, processes alternated), median ms
# of the default call, four runs at load 2 from other jobs: upper quartile
# + 25% 1.33 / 1.41 / 1.36 / 1.39, lower quartile 1.19 / 1.08 / 1.06 / 1.28,
# median 1.19 / 1.25 / 1.40 / 1.13; means 1.39-1.59 against 1.20-1.62; with
# two spinning processes beside it, three runs, medians 2.33 / 2.36 / 1.76
# against 2.28 / 2.72 / 1.58 (means 4.61 / 4.22 / 2.61 against 4.41 / 5.66
# / 2.45): no worse.  The rule still keeps one thread where most splits lose
# (the lower quartile of the split's window is then slow too).
# Before (the EPYC, the SSE2 loop, no placement rule), measured at (65536, 65536, 64) float32, 16 MiB, load 4-5 from other jobs,
# 400 interleaved rounds in random order (median ms, with one busy competitor
# after the slash): split 6.32 / 7.72, one thread 3.78 / 5.57, this chooser
# without a margin 4.21 / 7.05; with 10% 4.45 (one thread 3.04, split 6.78 in
# that run; it had run the split on 24% of the calls, in stretches after a few
# fast splits, and those calls' median was 5.2 ms against 3.0 on one thread).
# Hence 25%: the split's times are bimodal on a shared machine, and at this
# shape (the 16 MiB source in L3, the 0.6 ms floor of writing 16 MiB reached
# on one thread) it gains at most ~15% undisturbed.  8 KiB rows from a 64 MiB
# source (DRAM reads) gain ~35% and still split.  And the upper quartile of
# each window rather than its median (TUNE_QUANTILE_PCT): with the median the
# chooser still ran losing splits under one busy competitor (bench run:
# default 6.26 ms median against 3.52 on one thread); with the quartile,
# 250 rounds at load 4 + one competitor: chooser 3.55 ms median / 0.86 best,
# one thread 3.38 / 1.01, split 4.57 / 1.17; no competitor (load 3.4-3.8):
# 2.12 / 0.84, 2.12 / 1.03, 2.01 / 0.82.  Only calls of TUNE_MIN_BYTES or
# more take part (smaller ones use the thread count they are given, already 1
# below 1 MiB per thread).
# Results do not depend on the mode (every row is copied the same way).

cdef enum:
    TUNE_WINDOW = 8
    TUNE_EXPLORE = 8
    TUNE_MARGIN_PCT = 0
    TUNE_QUANTILE_PCT = 25

cdef int _tune_margin_pct = TUNE_MARGIN_PCT
cdef int _tune_quantile_pct = TUNE_QUANTILE_PCT


def _set_tune_rule(quantile_pct, margin_pct):
    """Change the chooser's quantile and margin (benchmarks' A/B); returns the old pair."""
    global _tune_margin_pct, _tune_quantile_pct
    old = (_tune_quantile_pct, _tune_margin_pct)
    _tune_quantile_pct = min(100, max(0, int(quantile_pct)))
    _tune_margin_pct = max(0, int(margin_pct))
    return old

#: Gathers of at least this many output bytes choose 1 thread or the split by
#: their measured recent times (see above).
TUNE_MIN_BYTES = 4 << 20
cdef int64_t _tune_min_bytes = TUNE_MIN_BYTES

cdef int64_t _tune_win[2][2][TUNE_WINDOW]     # [kind][mode] ns per MiB, ring buffers
cdef int _tune_n[2][2]                        # samples held (<= TUNE_WINDOW)
cdef int _tune_pos[2][2]
cdef int64_t _tune_calls[2]
cdef bint _tune_on = True


cdef int64_t _tune_quantile(int kind, int mode) noexcept nogil:
    cdef int64_t v[TUNE_WINDOW]
    cdef int m = _tune_n[kind][mode], a, b
    cdef int64_t t
    for a in range(m):
        v[a] = _tune_win[kind][mode][a]
    for a in range(1, m):                     # insertion sort, 8 values
        t = v[a]
        b = a - 1
        while b >= 0 and v[b] > t:
            v[b + 1] = v[b]
            b -= 1
        v[b + 1] = t
    a = (m * _tune_quantile_pct) // 100 if m > 1 else 0
    return v[a if a < m else m - 1]


cdef int _tune_choose(int kind) noexcept nogil:
    """0: run on one thread, 1: the split (see above)."""
    cdef int best
    _tune_calls[kind] += 1
    if _tune_n[kind][0] < TUNE_WINDOW // 2 or _tune_n[kind][1] < TUNE_WINDOW // 2:
        return <int> (_tune_calls[kind] & 1)            # fill both windows first
    # the split takes a second core: it runs only when it is faster (a tie: one thread)
    best = 0
    if _tune_quantile(kind, 1) * (100 + _tune_margin_pct) < _tune_quantile(kind, 0) * 100:
        best = 1
    if _tune_calls[kind] % TUNE_EXPLORE == 0:
        return 1 - best
    return best


cdef void _tune_record(int kind, int mode, int64_t ns_per_mib) noexcept nogil:
    _tune_win[kind][mode][_tune_pos[kind][mode]] = ns_per_mib
    _tune_pos[kind][mode] = (_tune_pos[kind][mode] + 1) % TUNE_WINDOW
    if _tune_n[kind][mode] < TUNE_WINDOW:
        _tune_n[kind][mode] += 1


def _tune_reset():
    """Forget every measured call (tests, benchmarks)."""
    cdef int k, m
    for k in range(2):
        _tune_calls[k] = 0
        for m in range(2):
            _tune_n[k][m] = 0
            _tune_pos[k][m] = 0


def _set_tune(flag):
    """Switch the measured choice on or off (off: the split whenever more than one
    thread is given, the behaviour before; benchmarks' A/B).  Returns the old value."""
    global _tune_on
    old = bool(_tune_on)
    _tune_on = bool(flag)
    return old


def _set_tune_min_bytes(n):
    """Change the size from which calls choose by measurement (returns the old value)."""
    global _tune_min_bytes
    old = _tune_min_bytes
    _tune_min_bytes = max(0, int(n))
    return old


def _tune_record_py(int kind, int mode, int64_t ns_per_mib):
    """Feed one measured call to the chooser (tests)."""
    _tune_record(kind, mode, ns_per_mib)


def _tune_choose_py(int kind):
    """The chooser's next decision, 0 (one thread) or 1 (split), as a call would
    take it (tests)."""
    return _tune_choose(kind)


def _tune_state():
    """{kind: (calls, one-thread samples, split samples)}; kind 0 cached, 1 streaming."""
    return {k: (_tune_calls[k], [_tune_win[k][0][i] for i in range(_tune_n[k][0])],
                [_tune_win[k][1][i] for i in range(_tune_n[k][1])]) for k in range(2)}


cdef extern from *:
    """
    #include <time.h>
    static inline int64_t rl_reindex_now_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
    }
    """
    int64_t rl_reindex_now_ns() noexcept nogil


def gather_rows(cnp.ndarray x, cnp.ndarray idx, cnp.ndarray out, int n_threads):
    """``out[n] = x[idx[n]]`` row-wise (rows = everything after axis 0).

    ``x`` and ``out`` C-contiguous with equal dtype and inner shape, ``idx``
    1-D contiguous int32/int64.  Raises Caffe's IndexError before writing.
    Calls of ``TUNE_MIN_BYTES`` or more on ``n_threads > 1`` run on one thread
    or on ``n_threads``, whichever recent calls measured faster (see above).
    """
    cdef intp_t n = idx.shape[0]
    cdef intp_t n_src = x.shape[0]
    cdef intp_t row_bytes = (x.nbytes // n_src) if n_src else 0
    cdef const char* src = <const char*> cnp.PyArray_DATA(x)
    cdef char* dst = <char*> cnp.PyArray_DATA(out)
    cdef void* pidx = cnp.PyArray_DATA(idx)
    cdef int rc
    cdef int64_t nbytes = <int64_t> n * row_bytes, t0 = 0, t1 = 0
    cdef int kind = 0, mode = -1, pooled = 0
    # one row cannot be split (the pool runs it on the caller): nothing to choose
    if _tune_on and n_threads > 1 and n > 1 and nbytes >= _tune_min_bytes and nbytes > 0:
        # the GIL serialises the chooser's state; the kind is _gather_rows' own
        # test for streaming stores (rows of 16-byte multiples, aligned output)
        kind = 1 if (RL_GATHER_SSE2 and nbytes >= _stream_min_bytes and row_bytes % 16 == 0
                     and (<size_t> dst) % 16 == 0) else 0
        mode = _tune_choose(kind)
        if mode == 0:
            n_threads = 1
    # timed inside the nogil block: re-taking the GIL from another Python
    # thread (up to a switch interval) is not the gather's time
    if idx.dtype == np.int32:
        with nogil:
            t0 = rl_reindex_now_ns()
            rc = _gather_rows(src, n_src, row_bytes, <const int32_t*> pidx, n, dst, n_threads, &pooled)
            t1 = rl_reindex_now_ns()
    else:
        with nogil:
            t0 = rl_reindex_now_ns()
            rc = _gather_rows(src, n_src, row_bytes, <const int64_t*> pidx, n, dst, n_threads, &pooled)
            t1 = rl_reindex_now_ns()
    # a split the pool ran on the caller alone (its back-off after losing
    # splits, the pool taken by another thread's loop) measured no split
    if mode >= 0 and rc == OK and (mode == 0 or pooled):
        _tune_record(kind, mode, (t1 - t0) * 1048576 // nbytes)
    _raise_for(rc, idx, n_src)
    return out


cdef inline bint _reindex_dtype_ok(cnp.ndarray a) noexcept:
    """A dtype batch_reindex accepts (kernels.REINDEX_DTYPES), native byte order."""
    cdef int t = cnp.PyArray_TYPE(a)
    return ((t == cnp.NPY_FLOAT16 or t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT64
             or t == cnp.NPY_INT32 or t == cnp.NPY_INT64 or t == cnp.NPY_UINT8)
            and cnp.PyArray_ISNOTSWAPPED(a))


#: The most threads one loop may use (readerlib._parallel.MAX_THREADS).
cdef int _MAX_THREADS = 256


def gather_fast(x, idx, out, num_threads):
    """``batch_reindex`` for the common case in one compiled call, or None.

    The common case: ``x`` an ndarray (exact type) of a supported dtype,
    C-contiguous, ndim >= 1; ``idx`` a 1-D contiguous int32/int64 ndarray;
    ``out`` None or a writeable C-contiguous ndarray of the right shape and
    dtype that does not overlap ``x``; ``num_threads`` None or an int >= 1.
    Anything else returns None before doing anything, and the caller takes
    the full path (conversions, foreign arrays, the error messages).  The
    thread count, output allocation and gather are those of the full path;
    a bad index raises the same IndexError.  (At (256, 512, 64) float32 the
    full path's Python checks cost ~15 us against ~5 us for the gather.)
    """
    cdef cnp.ndarray xa, ia, oa
    cdef int nd, k, nt
    cdef intp_t n, nbytes
    cdef cnp.npy_intp dims[32]
    cdef char* o0
    cdef char* x0
    if not (cnp.PyArray_CheckExact(x) and cnp.PyArray_CheckExact(idx)):
        return None
    xa = <cnp.ndarray> x
    ia = <cnp.ndarray> idx
    nd = cnp.PyArray_NDIM(xa)
    if (nd < 1 or nd > 32 or not cnp.PyArray_IS_C_CONTIGUOUS(xa) or not _reindex_dtype_ok(xa)
            or cnp.PyArray_NDIM(ia) != 1 or not cnp.PyArray_IS_C_CONTIGUOUS(ia)
            or not cnp.PyArray_ISNOTSWAPPED(ia)
            or (cnp.PyArray_TYPE(ia) != cnp.NPY_INT32 and cnp.PyArray_TYPE(ia) != cnp.NPY_INT64)):
        return None
    n = cnp.PyArray_DIM(ia, 0)
    dims[0] = n
    nbytes = n * cnp.PyArray_ITEMSIZE(xa)
    for k in range(1, nd):
        dims[k] = cnp.PyArray_DIM(xa, k)
        nbytes *= dims[k]
    if num_threads is None:
        nt = -1
    elif type(num_threads) is int and num_threads >= 1:
        nt = <int> min(num_threads, _MAX_THREADS)
    else:
        return None
    if out is None:
        if nbytes >= CACHED_OUTPUT_BYTES:
            oa = empty_output(tuple([dims[k] for k in range(nd)]), xa.dtype)
        else:
            oa = cnp.PyArray_EMPTY(nd, dims, cnp.PyArray_TYPE(xa), 0)
    else:
        if not cnp.PyArray_CheckExact(out):
            return None
        oa = <cnp.ndarray> out
        if (cnp.PyArray_NDIM(oa) != nd or cnp.PyArray_TYPE(oa) != cnp.PyArray_TYPE(xa)
                or not cnp.PyArray_ISNOTSWAPPED(oa) or not cnp.PyArray_IS_C_CONTIGUOUS(oa)
                or not cnp.PyArray_ISWRITEABLE(oa)):
            return None
        for k in range(nd):
            if cnp.PyArray_DIM(oa, k) != dims[k]:
                return None
        o0 = <char*> cnp.PyArray_DATA(oa)
        x0 = <char*> cnp.PyArray_DATA(xa)
        if nbytes and cnp.PyArray_NBYTES(xa) and (o0 < x0 + cnp.PyArray_NBYTES(xa)
                                                   and x0 < o0 + nbytes):
            return None                          # overlap: the full path raises
    if nt < 0:
        nt = threads_for(2 * nbytes)
    if n == 0:
        return oa
    return gather_rows(xa, ia, oa, nt)


cdef struct _segments_job:
    const char* src
    const int64_t* src_row
    const int64_t* n_rows
    const int64_t* dst_row
    intp_t row_bytes
    char* dst


cdef void _copy_segments_body(void* ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _segments_job* j = <_segments_job*> ctx
    cdef intp_t i, rb = j.row_bytes
    for i in range(begin, end):
        memcpy(j.dst + j.dst_row[i] * rb, j.src + j.src_row[i] * rb, j.n_rows[i] * rb)


cdef void _copy_segments(const char* src, const int64_t* src_row, const int64_t* n_rows,
                         const int64_t* dst_row, intp_t n, intp_t row_bytes, char* dst,
                         int n_threads) noexcept nogil:
    cdef _segments_job j
    j.src = src
    j.src_row = src_row
    j.n_rows = n_rows
    j.dst_row = dst_row
    j.row_bytes = row_bytes
    j.dst = dst
    parallel_for(n_threads, n, _copy_segments_body, &j)


def copy_segments(cnp.ndarray src, cnp.ndarray src_row, cnp.ndarray n_rows,
                  cnp.ndarray dst_row, cnp.ndarray out, int n_threads):
    """Copy ``n_rows[i]`` rows from ``src[src_row[i]:]`` to ``out[dst_row[i]:]``.

    The segment arrays are int64 and already checked by the caller (LoD path:
    they come from validated offsets); segments of ``out`` must not overlap.
    """
    cdef intp_t n = src_row.shape[0]
    cdef intp_t row_bytes = (src.nbytes // src.shape[0]) if src.shape[0] else 0
    if n == 0 or row_bytes == 0:
        return out
    with nogil:
        _copy_segments(<const char*> cnp.PyArray_DATA(src),
                       <const int64_t*> cnp.PyArray_DATA(src_row),
                       <const int64_t*> cnp.PyArray_DATA(n_rows),
                       <const int64_t*> cnp.PyArray_DATA(dst_row), n, row_bytes,
                       <char*> cnp.PyArray_DATA(out), n_threads)
    return out


cdef void _group_by_index(const index_t* idx, intp_t n, intp_t num_rows,
                          int64_t* start, int64_t* order) noexcept nogil:
    """Stable counting sort: rows ``order[start[k]:start[k+1]]`` have ``idx == k``, ascending."""
    cdef intp_t i, k
    cdef int64_t total = 0, c
    memset(start, 0, (num_rows + 1) * sizeof(int64_t))
    for i in range(n):
        start[idx[i] + 1] += 1
    for k in range(num_rows + 1):
        c = start[k]
        start[k] = total
        total += c
    # start[k] is now the beginning of group k; use start[k + 1] as a cursor
    # for group k, then shift back (no second array needed).
    for i in range(n):
        k = idx[i]
        order[start[k + 1]] = i
        start[k + 1] += 1
    # now start[k + 1] == end of group k == beginning of group k + 1: already right.


cdef inline void _segment_sum_range(const sum_t* dy, intp_t inner, const int64_t* start,
                                    const int64_t* order, intp_t num_rows, sum_t* dx,
                                    bint dx_is_zero, intp_t k0, intp_t k1) noexcept nogil:
    cdef intp_t k, j
    cdef int64_t p
    cdef sum_t* out
    cdef const sum_t* row
    for k in range(k0, k1):
        out = dx + k * inner
        if k + PREFETCH_GROUPS < num_rows:
            for p in range(start[k + PREFETCH_GROUPS], start[k + PREFETCH_GROUPS + 1]):
                rl_prefetch_row(dy + order[p] * inner, inner * sizeof(sum_t))
        if start[k] == start[k + 1]:
            if not dx_is_zero:
                memset(out, 0, inner * sizeof(sum_t))
            continue
        row = dy + order[start[k]] * inner
        for j in range(inner):
            out[j] = <sum_t> 0 + row[j]
        for p in range(start[k] + 1, start[k + 1]):
            row = dy + order[p] * inner
            for j in range(inner):
                out[j] = out[j] + row[j]


cdef void _segment_sum_half_range(const uint16_t* dy, intp_t inner, const int64_t* start,
                                  const int64_t* order, uint16_t* dx, bint dx_is_zero,
                                  float* acc, intp_t k0, intp_t k1) noexcept nogil:
    """float16 rows summed in the float32 scratch row ``acc``, rounded once."""
    cdef intp_t k, j
    cdef int64_t p
    cdef const uint16_t* row
    for k in range(k0, k1):
        if start[k] == start[k + 1]:
            if not dx_is_zero:
                memset(dx + k * inner, 0, inner * sizeof(uint16_t))
            continue
        row = dy + order[start[k]] * inner
        for j in range(inner):
            acc[j] = <float> 0 + rl_half_to_float(row[j])
        for p in range(start[k] + 1, start[k + 1]):
            row = dy + order[p] * inner
            for j in range(inner):
                acc[j] = acc[j] + rl_half_to_float(row[j])
        for j in range(inner):
            dx[k * inner + j] = rl_float_to_half(acc[j])


cdef struct _segment_sum_job:
    const void* dy
    void* dx
    intp_t inner
    const int64_t* start
    const int64_t* order
    intp_t num_rows
    bint dx_is_zero
    int num                 # NumPy type number of dy / dx
    float* scratch          # float16: one float32 row per thread id


cdef void _segment_sum_body(void* ctx, int64_t k0, int64_t k1, int tid) noexcept nogil:
    cdef _segment_sum_job* j = <_segment_sum_job*> ctx
    if j.num == cnp.NPY_FLOAT32:
        _segment_sum_range(<const float32_t*> j.dy, j.inner, j.start, j.order, j.num_rows,
                           <float32_t*> j.dx, j.dx_is_zero, k0, k1)
    elif j.num == cnp.NPY_FLOAT64:
        _segment_sum_range(<const float64_t*> j.dy, j.inner, j.start, j.order, j.num_rows,
                           <float64_t*> j.dx, j.dx_is_zero, k0, k1)
    elif j.num == cnp.NPY_INT32:
        _segment_sum_range(<const int32_t*> j.dy, j.inner, j.start, j.order, j.num_rows,
                           <int32_t*> j.dx, j.dx_is_zero, k0, k1)
    elif j.num == cnp.NPY_INT64:
        _segment_sum_range(<const int64_t*> j.dy, j.inner, j.start, j.order, j.num_rows,
                           <int64_t*> j.dx, j.dx_is_zero, k0, k1)
    elif j.num == cnp.NPY_UINT8:
        _segment_sum_range(<const uint8_t*> j.dy, j.inner, j.start, j.order, j.num_rows,
                           <uint8_t*> j.dx, j.dx_is_zero, k0, k1)
    elif j.num == cnp.NPY_FLOAT16:
        _segment_sum_half_range(<const uint16_t*> j.dy, j.inner, j.start, j.order,
                                <uint16_t*> j.dx, j.dx_is_zero, j.scratch + tid * j.inner, k0, k1)


cdef void _segment_sum_dispatch(cnp.ndarray dy, intp_t inner, const int64_t* start,
                                const int64_t* order, intp_t num_rows, cnp.ndarray dx,
                                bint z, int n_threads) except *:
    cdef _segment_sum_job j
    j.dy = cnp.PyArray_DATA(dy)
    j.dx = cnp.PyArray_DATA(dx)
    j.inner = inner
    j.start = start
    j.order = order
    j.num_rows = num_rows
    j.dx_is_zero = z
    j.num = dy.dtype.num
    j.scratch = NULL
    if j.num not in (cnp.NPY_FLOAT32, cnp.NPY_FLOAT64, cnp.NPY_INT32, cnp.NPY_INT64,
                     cnp.NPY_UINT8, cnp.NPY_FLOAT16):   # the public function validates dtypes first
        raise TypeError(f"batch_reindex_grad: unsupported dtype {dy.dtype}")
    if n_threads > num_rows:
        n_threads = <int> max(num_rows, 1)
    if j.num == cnp.NPY_FLOAT16:
        j.scratch = <float*> malloc(n_threads * inner * sizeof(float) + 1)
        if j.scratch == NULL:
            raise MemoryError("batch_reindex_grad: could not allocate a float32 scratch row")
    try:
        with nogil:
            parallel_for(n_threads, num_rows, _segment_sum_body, &j)
    finally:
        free(j.scratch)


def scatter_add_rows(cnp.ndarray dy, cnp.ndarray idx, intp_t num_rows, cnp.ndarray out,
                     int n_threads, bint out_is_zero=False):
    """``out[k] = sum(dy[n] for idx[n] == k)``, deterministic (see module Design).

    ``dy`` and ``out`` C-contiguous, same dtype and inner shape, ``out`` has
    ``num_rows`` rows; ``idx`` 1-D contiguous int32/int64 with ``len(dy)``
    entries.  Raises Caffe's IndexError before writing.  ``out_is_zero``:
    ``out`` is known to hold zeros (fresh ``np.zeros``: untouched pages of a
    large calloc), so rows nobody references are not written at all, and
    their pages are never faulted in.
    """
    cdef intp_t n = idx.shape[0]
    cdef intp_t inner = (dy.size // n) if n else 0
    cdef void* pidx = cnp.PyArray_DATA(idx)
    cdef bint is32 = idx.dtype == np.int32
    cdef int rc
    with nogil:
        if is32:
            rc = _check_indices(<const int32_t*> pidx, n, num_rows)
        else:
            rc = _check_indices(<const int64_t*> pidx, n, num_rows)
    _raise_for(rc, idx, num_rows)
    if num_rows == 0:
        return out
    if n == 0 or inner == 0:
        if not out_is_zero:
            out.fill(0)
        return out
    cdef cnp.ndarray start_arr = np.empty(num_rows + 1, dtype=np.int64)
    cdef cnp.ndarray order_arr = np.empty(n, dtype=np.int64)
    cdef int64_t* start = <int64_t*> cnp.PyArray_DATA(start_arr)
    cdef int64_t* order = <int64_t*> cnp.PyArray_DATA(order_arr)
    with nogil:
        if is32:
            _group_by_index(<const int32_t*> pidx, n, num_rows, start, order)
        else:
            _group_by_index(<const int64_t*> pidx, n, num_rows, start, order)
    _segment_sum_dispatch(dy, inner, start, order, num_rows, out, out_is_zero, n_threads)
    return out


# -- test helpers: expose the nogil float16 conversions ----------------------
def _half_to_float_py(cnp.ndarray bits):
    """float32 array from uint16 half bit patterns (tests compare with NumPy)."""
    cdef const uint16_t[::1] b = bits
    cdef float32_t[::1] out = np.empty(bits.shape[0], dtype=np.float32)
    cdef intp_t i
    for i in range(b.shape[0]):
        out[i] = rl_half_to_float(b[i])
    return np.asarray(out)


def _float_to_half_py(cnp.ndarray values):
    """uint16 half bit patterns from a float32 array (tests compare with NumPy)."""
    cdef const float32_t[::1] v = values
    cdef uint16_t[::1] out = np.empty(values.shape[0], dtype=np.uint16)
    cdef intp_t i
    for i in range(v.shape[0]):
        out[i] = rl_float_to_half(v[i])
    return np.asarray(out)
