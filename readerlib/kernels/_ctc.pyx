# cython: language_level=3
"""CTC greedy (best-path) decoding on the CPU, with tf.nn.ctc_greedy_decoder's semantics.

Design:
  The work is one pass over the logits; everything after it touches
  ``O(frames)`` small arrays.

  1. Frame pass (``_frames_argmax``): a parallel loop (readerlib's pool,
     contiguous ranges) over frames (rows of
     ``num_classes`` logits).  Padded input ``[T, B, V]`` is viewed as
     ``T * B`` rows in memory order, so each thread streams one contiguous
     block; frames past a sequence's length are skipped.  A LoD batch
     ``[F, V]`` is the same loop with every frame valid.  Per frame we store
     the argmax (int32) and the max logit.
     The row argmax reproduces TensorFlow's ``RowMax`` exactly: start at
     element 0, replace on strictly greater; so the first index wins ties,
     a NaN at index 0 wins (``(0, nan)``) and any other NaN is never chosen.
     It runs in two steps over a row that is hot in L1 after the first:
     a branch-free max over independent lanes (4 registers of MAXPS, whose
     semantics are exactly ``v > m ? v : m``: a NaN ``v`` keeps ``m``, and
     each lane is its own running max, so nothing is reassociated), then a
     search for the first element equal to that max, a block at a time.
     GCC -O3 does not vectorise the same loop written in Cython (``a > b ?
     a : b`` on floats is no MAX_EXPR without -ffinite-math-only), hence
     intrinsics (``readerlib/include/rl_argmax.h``, each body one macro): SSE2 everywhere on x86-64, AVX2 / AVX-512 bodies compiled
     with target attributes and picked at import (``isa()``), a scalar
     fallback elsewhere.  AVX-512 rows of >= 128 logits take a one-pass body
     instead (per-lane running max + first index, merged at the end): the
     second pass cost half the bandwidth at V = 1025.  The max loop prefetches 4 KiB ahead: perf showed it
     stalled on loads at ~7 GB/s per thread because the hardware prefetcher
     loses the stream at every row's data-dependent end (13 GB/s with it).
  2. Collapse (``_collapse_one``): per sequence, in time order, sum ``-max``
     into an accumulator of the input dtype (TF's order and type, so
     ``neg_sum_logits`` is bitwise TF's) and emit the argmax when it is not
     blank and not (``merge_repeated`` and equal to the previous frame's
     argmax; blank frames update "previous" too).
  3. Pack: prefix sum of the per-sequence counts, then a copy into TF's
     sparse layout (``indices [N, 2]``, ``values [N]`` int64).

  Steps 2 and 3 are serial: they touch ~12 bytes per frame (1/V of step 1)
  and every extra parallel section costs a wake-up and a join, which on a
  loaded machine waits for a descheduled thread (measured with OpenMP: worse
  than the work itself).

  Memory traffic: the logits once (``T * B * V`` elements, less for padding
  frames, which are never read), plus ~12 bytes per frame.

Invariants: inputs C-contiguous float32/float64; lengths int32 in
``[0, max_time]`` (the Python layer validates with TF's messages and clips
negative lengths to 0 as TF's loop does); LoD offsets validated int64.
"""
cimport cython

cimport numpy as cnp
import numpy as np
from readerlib.kernels._isa import Dispatch

from readerlib._typedefs cimport float32_t, float64_t, int32_t, int64_t, intp_t, real_t
from libc.stdlib cimport free, malloc

from readerlib._parallel cimport parallel_for, threads_for

cnp.import_array()

# The SIMD row argmax (TensorFlow RowMax) and its run-time ISA dispatch.
cdef extern from "rl_argmax.h":
    intp_t rl_argmax_f32(const float32_t* row, intp_t n) noexcept nogil
    intp_t rl_argmax_f64(const float64_t* row, intp_t n) noexcept nogil
    int rl_ctc_select_isa(int want) noexcept nogil


def _select(int want):
    return rl_ctc_select_isa(want)


_DISPATCH = Dispatch(_select)          # (readerlib/kernels/_isa.py, include/rl_isa.h)


def isa():
    """The instruction set the float32 row argmax uses ('sse2', 'avx2' or 'avx512')."""
    return _DISPATCH.name()


def _set_isa(name=None):
    """Force the float32 row-argmax body (tests and benchmarks); None picks the best.

    Returns the name in use (a request above what the CPU has falls back).
    Not thread-safe: call it while no decode is running.
    """
    return _DISPATCH.force(name)


cdef inline intp_t _row_argmax(const real_t* row, intp_t n) noexcept nogil:
    """TensorFlow's RowMax index (see include/rl_argmax.h); ``n >= 1``."""
    if real_t is float32_t:
        return rl_argmax_f32(row, n)
    else:
        return rl_argmax_f64(row, n)


cdef inline void _frame(const real_t* x, intp_t r, intp_t num_classes, int32_t* amax,
                        real_t* mval) noexcept nogil:
    cdef const real_t* row = x + r * num_classes
    cdef intp_t a = _row_argmax(row, num_classes)
    amax[r] = <int32_t> a
    mval[r] = row[a]


# Layouts of the frames (rows of ``num_classes`` logits) a decode reads.
cdef enum:
    LAYOUT_LOD = 0            # data [F, V]: every row a frame, sequences given by offsets
    LAYOUT_TIME_MAJOR = 1     # [T, B, V]: row t * B + b is frame t of utterance b
    LAYOUT_BATCH_MAJOR = 2    # [B, T, V]: row b * T + t is frame t of utterance b


cdef void _frames_range(const real_t* x, intp_t num_classes, int layout,
                       const int32_t* lengths, intp_t batch, intp_t max_time,
                       int32_t* amax, real_t* mval, intp_t begin, intp_t end) noexcept nogil:
    """Items [begin, end): frames (LoD), time steps (time-major) or rows (batch-major)."""
    cdef intp_t r, t, b, lo, hi
    if layout == LAYOUT_LOD:
        for r in range(begin, end):
            _frame(x, r, num_classes, amax, mval)
    elif layout == LAYOUT_TIME_MAJOR:
        for t in range(begin, end):
            for b in range(batch):
                if t < lengths[b]:
                    _frame(x, t * batch + b, num_classes, amax, mval)
    else:
        # rows [begin, end) cut across utterances; within utterance b only its
        # first lengths[b] rows are frames (padding rows are never read)
        b = begin // max_time
        while b * max_time < end:
            lo = b * max_time
            hi = lo + lengths[b]
            if lo < begin:
                lo = begin
            if hi > end:
                hi = end
            for r in range(lo, hi):
                _frame(x, r, num_classes, amax, mval)
            b += 1


cdef struct _frames_job:
    const void* x
    bint f32
    int layout
    intp_t num_classes
    const int32_t* lengths
    intp_t batch
    intp_t max_time
    int32_t* amax
    void* mval


cdef void _frames_body(void* ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _frames_job* j = <_frames_job*> ctx
    if j.f32:
        _frames_range(<const float32_t*> j.x, j.num_classes, j.layout, j.lengths, j.batch,
                      j.max_time, j.amax, <float32_t*> j.mval, begin, end)
    else:
        _frames_range(<const float64_t*> j.x, j.num_classes, j.layout, j.lengths, j.batch,
                      j.max_time, j.amax, <float64_t*> j.mval, begin, end)


cdef void _frames_argmax(const void* x, bint f32, intp_t n_frames, intp_t num_classes,
                         int layout, const int32_t* lengths, intp_t batch, intp_t max_time,
                         int32_t* amax, void* mval, int n_threads) noexcept nogil:
    """Argmax and max of every frame (see the layouts).  Time-major loops over
    ``t`` so that no division is needed per frame and each thread still
    streams a contiguous block; batch-major over rows (one division per range)."""
    cdef _frames_job j
    cdef int64_t n_items = n_frames
    j.x = x
    j.f32 = f32
    j.layout = layout
    j.num_classes = num_classes
    j.lengths = lengths
    j.batch = batch
    j.max_time = max_time
    j.amax = amax
    j.mval = mval
    if layout == LAYOUT_TIME_MAJOR:
        n_items = max_time
    if n_threads <= 1:
        _frames_body(&j, 0, n_items, 0)     # the serial path: no pool, no atomics
    else:
        parallel_for(n_threads, n_items, _frames_body, &j)


cdef inline int64_t _collapse_one(const int32_t* amax, const real_t* mval, int64_t first,
                                  intp_t stride, int64_t length, int32_t blank, bint merge,
                                  int32_t* labels, real_t* neg_sum) noexcept nogil:
    cdef int64_t t, r, count = 0
    cdef int32_t a, prev = -1
    cdef real_t acc = 0
    for t in range(length):
        r = first + t * stride
        a = amax[r]
        acc = acc + (-mval[r])      # TF: log_prob_t(b, 0) += -RowMax(...)
        if a != blank and not (merge and a == prev):
            labels[count] = a
            count += 1
        prev = a
    neg_sum[0] = acc
    return count


cdef void _collapse(const int32_t* amax, const real_t* mval, const int64_t* first,
                    intp_t stride, const int64_t* length, const int64_t* lab_base,
                    intp_t n_seq, int32_t blank, bint merge, int32_t* labels,
                    int64_t* counts, real_t* neg_sum) noexcept nogil:
    cdef intp_t u
    for u in range(n_seq):
        counts[u] = _collapse_one(amax, mval, first[u], stride, length[u], blank, merge,
                                  labels + lab_base[u], neg_sum + u)


cdef void _pack(const int32_t* labels, const int64_t* lab_base, const int64_t* counts,
                intp_t n_seq, int64_t* indices, int64_t* values) noexcept nogil:
    cdef intp_t u
    cdef int64_t c, o = 0
    for u in range(n_seq):
        for c in range(counts[u]):
            values[o + c] = labels[lab_base[u] + c]
            indices[2 * (o + c)] = u
            indices[2 * (o + c) + 1] = c
        o += counts[u]


cdef inline cnp.ndarray _empty(int nd, intp_t d0, intp_t d1, int typenum):
    cdef cnp.npy_intp dims[2]
    dims[0] = d0
    dims[1] = d1
    return <cnp.ndarray> cnp.PyArray_EMPTY(nd, dims, typenum, 0)


cdef object _decode(cnp.ndarray x, int layout, intp_t n_frames, intp_t num_classes,
                    intp_t max_time, intp_t batch, const int32_t* lengths,
                    const int64_t* offsets, intp_t n_seq, int32_t blank, bint merge,
                    int n_threads):
    """Decode ``n_seq`` sequences of ``x`` (C-contiguous float32/float64, ``n_frames``
    rows of ``num_classes``).  LoD: ``offsets [n_seq + 1]`` (validated).  Padded:
    ``lengths [n_seq]`` int32 in ``[0, max_time]``, ``batch == n_seq``.

    Scratch (argmax, max, labels, per-sequence bookkeeping) is one malloc'd
    block and the outputs are made with the C API: at (T, B, V) = (50, 1, 29)
    the ~15 NumPy calls this replaced cost more than the decode itself.
    """
    cdef int typenum = cnp.PyArray_TYPE(x)
    cdef bint f32 = typenum == cnp.NPY_FLOAT32
    cdef intp_t isz = 4 if f32 else 8
    cdef intp_t u, stride
    cdef int64_t total = 0, max_len = 0
    cdef cnp.ndarray neg_sum = _empty(2, n_seq, 1, typenum)
    # one block: mval (8-aligned first), then the int64 arrays, then the int32 ones
    cdef char* block = <char*> malloc(n_frames * isz + 5 * n_seq * 8 + 2 * n_frames * 4 + 8)
    if block == NULL:
        raise MemoryError("ctc_greedy_decoder: could not allocate the decode scratch")
    cdef void* mval = block
    cdef int64_t* first = <int64_t*> (block + n_frames * isz)
    cdef int64_t* length = first + n_seq
    cdef int64_t* lab_base = length + n_seq
    cdef int64_t* counts = lab_base + n_seq
    cdef int32_t* amax = <int32_t*> (counts + n_seq)
    cdef int32_t* labels = amax + n_frames
    cdef void* pneg = cnp.PyArray_DATA(neg_sum)
    cdef cnp.ndarray indices, values, dense_shape
    cdef int64_t* pshape
    try:
        with nogil:
            if layout == LAYOUT_LOD:
                stride = 1
                for u in range(n_seq):
                    first[u] = offsets[u]
                    length[u] = offsets[u + 1] - offsets[u]
                    lab_base[u] = offsets[u]
            else:
                stride = batch if layout == LAYOUT_TIME_MAJOR else 1
                for u in range(n_seq):
                    first[u] = u if layout == LAYOUT_TIME_MAJOR else u * max_time
                    length[u] = lengths[u]
                    lab_base[u] = u * max_time
            _frames_argmax(cnp.PyArray_DATA(x), f32, n_frames, num_classes, layout, lengths,
                           batch, max_time, amax, mval, n_threads)
            if f32:
                _collapse(amax, <const float32_t*> mval, first, stride, length, lab_base, n_seq,
                          blank, merge, labels, counts, <float32_t*> pneg)
            else:
                _collapse(amax, <const float64_t*> mval, first, stride, length, lab_base, n_seq,
                          blank, merge, labels, counts, <float64_t*> pneg)
            for u in range(n_seq):
                total += counts[u]
                if counts[u] > max_len:
                    max_len = counts[u]
        indices = _empty(2, total, 2, cnp.NPY_INT64)
        values = _empty(1, total, 0, cnp.NPY_INT64)
        with nogil:
            _pack(labels, lab_base, counts, n_seq, <int64_t*> cnp.PyArray_DATA(indices),
                  <int64_t*> cnp.PyArray_DATA(values))
    finally:
        free(block)
    dense_shape = _empty(1, 2, 0, cnp.NPY_INT64)
    pshape = <int64_t*> cnp.PyArray_DATA(dense_shape)
    pshape[0] = n_seq
    pshape[1] = max_len
    return indices, values, dense_shape, neg_sum


def decode_padded(cnp.ndarray inputs, cnp.ndarray lengths, int blank, bint merge, int n_threads,
                  bint time_major=True):
    """Greedy-decode padded ``inputs`` (C-contiguous float32/float64): time-major
    ``[T, B, V]``, or batch-major ``[B, T, V]`` when ``time_major`` is False.

    ``lengths`` int32 ``[B]`` in ``[0, T]``.  Returns ``(indices, values,
    dense_shape, neg_sum_logits)`` in TensorFlow's layout.
    """
    cdef intp_t T, B, V = inputs.shape[2]
    if time_major:
        T, B = inputs.shape[0], inputs.shape[1]
    else:
        B, T = inputs.shape[0], inputs.shape[1]
    lengths = np.ascontiguousarray(lengths, dtype=np.int32)
    return _decode(inputs, LAYOUT_TIME_MAJOR if time_major else LAYOUT_BATCH_MAJOR, T * B, V,
                   T, B, <const int32_t*> cnp.PyArray_DATA(lengths), NULL, B, blank, merge,
                   n_threads)


def decode_lod(cnp.ndarray data, cnp.ndarray offsets, int blank, bint merge, int n_threads):
    """Greedy-decode a LoD batch: ``data [F, V]``, int64 ``offsets [B + 1]`` (validated).

    Same outputs as :func:`decode_padded` on the padded form.
    """
    cdef intp_t F = data.shape[0], V = data.shape[1]
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    return _decode(data, LAYOUT_LOD, F, V, 0, 0, NULL,
                   <const int64_t*> cnp.PyArray_DATA(offsets), offsets.shape[0] - 1, blank,
                   merge, n_threads)


cdef inline bint _plain(object a, int nd):
    """``a`` is an exact, aligned, native-order, C-contiguous ndarray of rank ``nd``."""
    return (cnp.PyArray_CheckExact(a) and cnp.PyArray_NDIM(<cnp.ndarray> a) == nd
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray> a)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray> a))


# Utterances whose clipped lengths decode_fast keeps on the stack (more: malloc).
cdef enum:
    FAST_LEN_STACK = 64


def decode_fast(inputs, sequence_length, blank_index, merge_repeated, num_threads,
                bint time_major):
    """The whole padded decode for well-formed NumPy arguments, or None.

    None means "not the common case" (another array type, a cast or copy
    needed, or an argument the full validation must reject with its
    message): the caller then runs the Python path, which raises TF's
    messages.  Accepted: C-contiguous float32/float64 ``inputs`` of rank 3
    and size > 0, int32/int64 ``sequence_length [B]`` with every value
    ``<= T`` (negatives decode nothing, as in TF), ``blank_index`` None or
    an int in ``[-V, V)``, ``num_threads`` None or an int >= 1.
    Exists because at (T, B, V) = (50, 1, 29) the decode is ~1 us and the
    Python-level checks and NumPy calls were ~15 us (py-spy; RESULTS.md).
    """
    cdef cnp.ndarray x, sl
    cdef intp_t T, B, V, b, n_threads
    cdef int typenum, lt
    cdef int64_t v, blank
    cdef int32_t stack_len[FAST_LEN_STACK]
    cdef int32_t* lens
    if not _plain(inputs, 3) or not _plain(sequence_length, 1):
        return None
    x = <cnp.ndarray> inputs
    sl = <cnp.ndarray> sequence_length
    typenum = cnp.PyArray_TYPE(x)
    lt = cnp.PyArray_TYPE(sl)
    if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
        return None
    if lt != cnp.NPY_INT32 and lt != cnp.NPY_INT64:
        return None
    if time_major:
        T, B = x.shape[0], x.shape[1]
    else:
        B, T = x.shape[0], x.shape[1]
    V = x.shape[2]
    if T == 0 or B == 0 or V == 0 or V > 2147483647 or sl.shape[0] != B:
        return None
    if blank_index is None:
        blank = V - 1
    elif type(blank_index) is int:
        blank = blank_index
        if blank < 0:
            blank += V
        if not 0 <= blank < V:
            return None
    else:
        return None
    if num_threads is None:
        # Serial below 4 MiB of logits, i.e. 2 MiB per thread, twice the pool's
        # default: measured (bench_kernels_cpu.py --sweep, [T, 8, 1025]) the
        # split at 2 MiB 0.97x one thread, at 4 MiB 1.21x, at 16 MiB 1.45x.
        n_threads = threads_for(<int64_t> cnp.PyArray_NBYTES(x) // 2)
    elif type(num_threads) is int and num_threads >= 1:
        n_threads = min(<intp_t> num_threads, 256)
    else:
        return None
    if B <= FAST_LEN_STACK:
        lens = &stack_len[0]
    else:
        lens = <int32_t*> malloc(B * sizeof(int32_t))
    if lens == NULL:
        raise MemoryError("ctc_greedy_decoder: could not allocate the lengths")
    try:
        for b in range(B):
            v = (<const int32_t*> cnp.PyArray_DATA(sl))[b] if lt == cnp.NPY_INT32 \
                else (<const int64_t*> cnp.PyArray_DATA(sl))[b]
            if v > T:
                return None          # the full path raises TF's FailedPrecondition
            lens[b] = <int32_t> (v if v > 0 else 0)   # TF's loop runs 0 times for < 0
        return _decode(x, LAYOUT_TIME_MAJOR if time_major else LAYOUT_BATCH_MAJOR, T * B, V,
                       T, B, lens, NULL, B, <int32_t> blank, bool(merge_repeated),
                       <int> n_threads)
    finally:
        if lens != &stack_len[0]:
            free(lens)


def _row_argmax_py(cnp.ndarray row):
    """TF-RowMax index of a 1-D contiguous float32/float64 row (exposed for tests)."""
    if row.dtype.num == cnp.NPY_FLOAT32:
        return _row_argmax(<const float32_t*> cnp.PyArray_DATA(row), row.shape[0])
    return _row_argmax(<const float64_t*> cnp.PyArray_DATA(row), row.shape[0])
