# cython: language_level=3
"""CPU bookkeeping kernels for batched RNN-T greedy decoding.

Design:
    The decoders (readerlib/rnnt/decode.py) run the matrix products with the
    array library and hand everything else to one fused kernel per step, so a
    step costs one Python call instead of a dozen NumPy passes over [B] masks.

    * For every logits row it needs, a kernel takes the argmax and the
      log-softmax value there, ``lp = -log(sum(exp(x - max)))`` accumulated in
      double (ties -> lowest index and NaN -> the first NaN, like numpy.argmax).  Only rows that are
      still searching are reduced (a window's frames after the first label
      are skipped), so the pass is serial: it costs ~1/J of the GEMM that made
      the logits.  ``argmax_logsoftmax`` is the parallel version (readerlib's
      pool; reference and tests).
    * In the same pass: blank/active/advance masks, time-index updates,
      masked writes of labels, timestamps and scores into per-utterance
      buffers ``[B, capacity]``, alignment records, and the compacted list of
      rows still to work on (``out_rows``).  The caller guarantees capacity
      (a row gains at most one hypothesis entry per call, and at most
      ``window`` alignment records).

    Rows are passed as an int64 list (``rows[r]`` is the batch index of logits
    row ``r``) so the same kernel serves the compacted CPU path (only the rows
    that need work) and the full-batch masked path (``rows = arange(B)``,
    rows with a false mask are skipped) that mirrors the GPU kernels.

    Memory traffic per call: one read of the logits (n x V) plus O(n) words.

Invariants (loop labels): ``active[b] == time[b] < lengths[b]``;
``advance[b]`` implies ``active[b]`` and that ``labels[b]`` is blank;
``safe_time[b] == min(time[b], lengths[b] - 1)`` (always a valid frame).
"""
cimport cython
from libc.math cimport exp, log
from libc.stdint cimport int64_t, uint8_t

from readerlib._typedefs cimport float32_t, float64_t, real_t
from readerlib._parallel cimport parallel_for

ctypedef fused row_t:
    float32_t
    float64_t
    int64_t


cdef inline void _record_alignment(Py_ssize_t b, int64_t k, int64_t t, double lp,
                                   int64_t[:, ::1] al_labels, int64_t[:, ::1] al_times,
                                   double[:, ::1] al_logp, int64_t[::1] al_len) noexcept nogil:
    """Append (label, frame, log-prob) to row b's alignment (capacity ensured by the caller)."""
    cdef int64_t pos = al_len[b]
    al_labels[b, pos] = k
    al_times[b, pos] = t
    al_logp[b, pos] = lp
    al_len[b] = pos + 1


cdef inline void _argmax_logsoftmax(const real_t* x, Py_ssize_t V, int64_t* k_out,
                                    double* lp_out) noexcept nogil:
    cdef Py_ssize_t j, k = 0
    cdef double m = x[0], s = 0.0, v
    for j in range(1, V):
        v = x[j]
        # numpy.argmax's rule (PyTorch's too): the first NaN wins, else the
        # first maximum (strict >).  Once m is NaN nothing replaces it.
        if v > m or (v != v and m == m):
            m = v
            k = j
    for j in range(V):
        s += exp(<double>x[j] - m)
    k_out[0] = k
    lp_out[0] = -log(s)


cdef struct _rows_job:
    const void* logits
    bint f32
    Py_ssize_t V
    int64_t* k
    double* lp


cdef void _rows_body(void* ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _rows_job* j = <_rows_job*> ctx
    cdef int64_t r
    for r in range(begin, end):
        if j.f32:
            _argmax_logsoftmax((<const float32_t*> j.logits) + r * j.V, j.V, j.k + r, j.lp + r)
        else:
            _argmax_logsoftmax((<const float64_t*> j.logits) + r * j.V, j.V, j.k + r, j.lp + r)


cdef void _rows_argmax(const real_t[:, ::1] logits, Py_ssize_t n, int64_t[::1] k,
                       double[::1] lp, int n_threads) noexcept nogil:
    cdef _rows_job j
    if n == 0:
        return
    j.logits = &logits[0, 0]
    j.f32 = real_t is float32_t
    j.V = logits.shape[1]
    j.k = &k[0]
    j.lp = &lp[0]
    parallel_for(n_threads, n, _rows_body, &j)


def argmax_logsoftmax(const real_t[:, ::1] logits, int64_t[::1] labels, double[::1] logp,
                      int n_threads=1):
    """Row-wise argmax and log-softmax value at the argmax (test/reference helper)."""
    cdef Py_ssize_t n = logits.shape[0]
    if labels.shape[0] < n or logp.shape[0] < n:
        raise ValueError("output buffers shorter than the number of rows")
    if logits.shape[1] == 0:
        raise ValueError("logits need at least one column")
    with nogil:
        _rows_argmax(logits, n, labels, logp, n_threads)


def loop_labels_joint_step(const real_t[:, ::1] logits, const int64_t[::1] rows, Py_ssize_t window,
                           bint first, int64_t blank,
                           int64_t[::1] labels, double[::1] scores, int64_t[::1] time,
                           int64_t[::1] time_cur, int64_t[::1] safe_time, const int64_t[::1] lengths,
                           uint8_t[::1] active, uint8_t[::1] advance,
                           bint record, int64_t[:, ::1] al_labels, int64_t[:, ::1] al_times,
                           double[:, ::1] al_logp, int64_t[::1] al_len, int64_t[::1] out_rows,
                           int64_t[::1] counts):
    """Consume one (windowed) joint evaluation of the label-looping decoder.

    ``logits[r * window + w]`` is the joint of row ``b = rows[r]`` at frame
    ``time[b] + w`` (its prediction-network output does not change while it
    searches, so the frames of a window are independent).  Row ``b`` is
    processed when ``active[b]`` (``first``: right after a predictor step) or
    ``advance[b]`` (later searches): the window is scanned in order, each
    evaluation recorded, blanks advance ``time[b]``; the scan stops at the
    first non-blank label or at the row's end.  Rows that exhausted the window
    on blanks keep ``advance`` set and are written to ``out_rows``; returns
    their number, also stored in ``counts[0]``; ``counts[1]`` is the number of
    rows processed (for ``first``: the rows that were active).
    """
    cdef Py_ssize_t n = rows.shape[0], r, w, cnt = 0, seen = 0, V = logits.shape[1]
    cdef int64_t b, k, t, pos, last
    cdef double lp
    cdef bint is_blank = False, act = False
    if logits.shape[0] < n * window:
        raise ValueError(f"{logits.shape[0]} logits rows for {n} rows x window {window}")
    if window < 1:
        raise ValueError("window must be >= 1")
    with nogil:
        for r in range(n):
            b = rows[r]
            if first:
                if not active[b]:
                    continue
            elif not advance[b]:
                continue
            seen = seen + 1
            t = time[b]
            act = True
            for w in range(window):
                _argmax_logsoftmax(&logits[r * window + w, 0], V, &k, &lp)
                labels[b] = k
                scores[b] = lp
                time_cur[b] = t
                if record:
                    _record_alignment(b, k, t, lp, al_labels, al_times, al_logp, al_len)
                is_blank = k == blank
                if not is_blank:
                    break
                t = t + 1
                if t >= lengths[b]:
                    act = False
                    break
            time[b] = t
            last = lengths[b] - 1
            safe_time[b] = t if t < last else last
            active[b] = act
            advance[b] = act and is_blank
            if act and is_blank:
                out_rows[cnt] = b
                cnt = cnt + 1
    counts[0] = cnt
    counts[1] = seen
    return cnt


def loop_labels_store(const int64_t[::1] rows, int64_t max_symbols,
                      const int64_t[::1] labels, const double[::1] scores, int64_t[::1] time,
                      const int64_t[::1] time_cur, int64_t[::1] safe_time,
                      const int64_t[::1] lengths, uint8_t[::1] active,
                      int64_t[:, ::1] hyp_labels, int64_t[:, ::1] hyp_times, int64_t[::1] hyp_len,
                      double[::1] hyp_score, int64_t[::1] last_ts, int64_t[::1] ts_count,
                      int64_t[::1] out_rows):
    """After the inner loop: append each active row's label to its hypothesis.

    ``max_symbols > 0`` forces a frame advance for a row that has emitted
    ``max_symbols`` labels on its current frame (as if blank were emitted).
    Writes the rows still active to ``out_rows`` and returns their number.
    """
    cdef Py_ssize_t n = rows.shape[0], r, cnt = 0
    cdef int64_t b, pos, t
    with nogil:
        for r in range(n):
            b = rows[r]
            if not active[b]:
                continue
            pos = hyp_len[b]
            t = time_cur[b]
            hyp_labels[b, pos] = labels[b]
            hyp_times[b, pos] = t
            hyp_len[b] = pos + 1
            hyp_score[b] += scores[b]
            if last_ts[b] == t:
                ts_count[b] += 1
            else:
                last_ts[b] = t
                ts_count[b] = 1
            if max_symbols > 0 and ts_count[b] >= max_symbols:
                t = time[b] + 1
                time[b] = t
                safe_time[b] = t if t < lengths[b] - 1 else lengths[b] - 1
                if t >= lengths[b]:
                    active[b] = 0
                    continue
            out_rows[cnt] = b
            cnt = cnt + 1
    return cnt


def loop_frames_joint_step(const real_t[:, ::1] logits, int64_t t, int64_t blank,
                           uint8_t[::1] done, int64_t[::1] last_label, uint8_t[::1] emitted,
                           int64_t[:, ::1] hyp_labels, int64_t[:, ::1] hyp_times, int64_t[::1] hyp_len,
                           double[::1] hyp_score,
                           bint record, int64_t[:, ::1] al_labels, int64_t[:, ::1] al_times,
                           double[:, ::1] al_logp, int64_t[::1] al_len):
    """Consume one joint evaluation of the frame-looping decoder at frame ``t``.

    Row ``b`` (logits row ``b``) is processed unless ``done[b]`` (already
    emitted blank on this frame, or past its length): blank sets ``done``,
    anything else is appended to the hypothesis and becomes ``last_label``;
    ``emitted[b]`` says which rows must keep their new predictor state.
    Returns the number of rows not done.
    """
    cdef Py_ssize_t B = logits.shape[0], b, n_left = 0, V = logits.shape[1]
    cdef int64_t k, pos
    cdef double lp
    if done.shape[0] < B or emitted.shape[0] < B or last_label.shape[0] < B:
        raise ValueError("state arrays shorter than the number of logits rows")
    with nogil:
        for b in range(B):
            emitted[b] = 0
            if done[b]:
                continue
            _argmax_logsoftmax(&logits[b, 0], V, &k, &lp)
            if record:
                _record_alignment(b, k, t, lp, al_labels, al_times, al_logp, al_len)
            if k == blank:
                done[b] = 1
                continue
            pos = hyp_len[b]
            hyp_labels[b, pos] = k
            hyp_times[b, pos] = t
            hyp_len[b] = pos + 1
            hyp_score[b] += lp
            last_label[b] = k
            emitted[b] = 1
            n_left = n_left + 1
    return n_left


def masked_replace_rows(row_t[:, ::1] dst, const row_t[:, ::1] src, const uint8_t[::1] mask):
    """``dst[b] = src[b]`` where ``mask[b]`` (decoder state replacement under a mask)."""
    cdef Py_ssize_t B = dst.shape[0], K = dst.shape[1], b, j
    if src.shape[0] != B or src.shape[1] != K or mask.shape[0] != B:
        raise ValueError(f"masked_replace_rows: shapes {(B, K)}, {(src.shape[0], src.shape[1])}, "
                         f"mask {mask.shape[0]} do not match")
    with nogil:
        for b in range(B):
            if mask[b]:
                for j in range(K):
                    dst[b, j] = src[b, j]
