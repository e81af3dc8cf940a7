"""Plain NumPy references for every kernel (tests and benchmarks compare against these).

The one NumPy reference module: the CPU tests, the GPU tests (on a GPU and on
the CUDA emulator) and benchmarks/gpu_check.py all compare against it.  They
favour being obviously right over being fast, except
:func:`ctc_greedy_decoder_vectorized`, the vectorised NumPy peer of the
benchmarks (itself tested against the loop reference).

The contract the CPU and CUDA kernels share:

* reindex indices are checked in order; the first bad one decides the message
  (Caffe's loop: ``CHECK_GE(idx, 0)`` then ``CHECK_LT(idx, num)``);
* the backward sums each output row's contributions in ascending ``n``, starting
  from +0, in float32 for float16 (rounded once), wrapping for integers;
* the CTC argmax is TF's RowMax: ``p = x[0]``, then ``x[c]`` replaces it only when
  ``x[c] > p`` -- first maximum wins, NaN at c > 0 never wins, NaN at 0 wins;
  float16/bfloat16 logits are widened exactly to float32 and decoded there.
"""
from __future__ import annotations

import numpy as np

from ..tensor import LoDTensor

__all__ = [
    "batch_reindex_reference",
    "batch_reindex_grad_reference",
    "batch_reindex_lod_reference",
    "ctc_greedy_decoder_reference",
    "ctc_greedy_decoder_vectorized",
    "tf_row_argmax",
    # the GPU tests' spelling (arrays in, arrays out; LoD as (data, offsets))
    "check_indices", "batch_reindex", "batch_reindex_grad", "batch_reindex_lod", "row_max",
    "ctc_greedy_decoder", "ctc_greedy_decoder_lod",
]

NEGATIVE_INDEX_MESSAGE = "Index specified for reindex layer was negative."
INDEX_TOO_LARGE_MESSAGE = "Index specified for reindex layer was greater than batch size."


def check_indices(idx, limit):
    """Caffe's checks in Caffe's order: the first bad index decides the message."""
    idx = np.asarray(idx)
    bad = np.flatnonzero((idx < 0) | (idx >= limit))
    if bad.size:
        raise IndexError(NEGATIVE_INDEX_MESSAGE if idx[bad[0]] < 0 else INDEX_TOO_LARGE_MESSAGE)


def _check_idx(idx, n):
    check_indices(idx, n)
    return np.asarray(idx).astype(np.int64)


def batch_reindex_reference(x, idx):
    """``x[idx]`` along axis 0, Caffe's checks."""
    x = np.asarray(x)
    return x[_check_idx(idx, x.shape[0])]


def batch_reindex_grad_reference(dy, idx, num_rows):
    """``np.add.at`` on zeros: ``dx[k] = 0 + dy[n0] + dy[n1] + ...`` in ascending ``n``.

    float16 is accumulated in float32 and rounded at the end (what the kernel
    documents); integer sums wrap.
    """
    dy = np.asarray(dy)
    idx = _check_idx(idx, num_rows)
    acc_dtype = np.float32 if dy.dtype == np.float16 else dy.dtype
    dx = np.zeros((num_rows,) + dy.shape[1:], dtype=acc_dtype)
    np.add.at(dx, idx, dy.astype(acc_dtype))
    return dx.astype(dy.dtype)


def batch_reindex_lod_reference(t, idx):
    """Reindex the top-level sequences of a LoDTensor (any number of levels)."""
    n_seq = t.lod[0].shape[0] - 1
    idx = _check_idx(idx, n_seq)
    seqs = [t.sequence(int(i)) for i in idx]
    if len(t.lod) == 1:
        if not seqs:
            return LoDTensor(t.data[:0], [np.zeros(1, np.int64)])
        return LoDTensor.from_sequences(seqs, dtype=t.data.dtype)
    # multi-level: concatenate the sub-tensors, shifting every level.
    data = np.concatenate([s.data for s in seqs]) if seqs else t.data[:0]
    levels = [[0] for _ in t.lod]
    for s in seqs:
        levels[0].append(levels[0][-1] + len(s))
        for k, lvl in enumerate(s.lod):
            base = levels[k + 1][-1]
            levels[k + 1].extend(int(v) + base for v in lvl[1:])
    return LoDTensor(data, [np.array(l, np.int64) for l in levels])


def tf_row_argmax(row):
    """TensorFlow's RowMax: start at element 0, replace on strictly greater."""
    best, arg = row[0], 0
    for i in range(1, row.shape[0]):
        if row[i] > best:
            best, arg = row[i], i
    return arg, best


def ctc_greedy_decoder_reference(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """Loop-for-loop port of TensorFlow's CTCGreedyDecoderOp (no validation).

    Returns ``(indices, values, dense_shape, neg_sum_logits)`` as NumPy arrays.
    """
    inputs = np.asarray(inputs)
    max_time, batch, num_classes = inputs.shape
    blank = num_classes - 1 if blank_index is None else blank_index
    if blank < 0:
        blank += num_classes
    dtype = inputs.dtype.type
    seqs, neg = [], np.zeros((batch, 1), dtype=inputs.dtype)
    for b in range(batch):
        seq, prev, acc = [], -1, dtype(0)
        for t in range(int(sequence_length[b])):
            arg, best = tf_row_argmax(inputs[t, b])
            acc = dtype(acc + dtype(-best))
            if arg != blank and not (merge_repeated and arg == prev):
                seq.append(arg)
            prev = arg
        seqs.append(seq)
        neg[b, 0] = acc
    indices = np.array([[b, i] for b, s in enumerate(seqs) for i in range(len(s))],
                       dtype=np.int64).reshape(-1, 2)
    values = np.array([v for s in seqs for v in s], dtype=np.int64)
    shape = np.array([batch, max((len(s) for s in seqs), default=0)], dtype=np.int64)
    return indices, values, shape, neg


def ctc_greedy_decoder_vectorized(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """The same decoder with whole-array NumPy operations (benchmark peer).

    One ``argmax`` pass over the logits (NumPy's argmax returns the first
    maximum, like TF, and treats NaN as the maximum, unlike TF: inputs
    without NaN only), then ``O(frames)`` array work.
    """
    max_time, batch, num_classes = inputs.shape
    blank = num_classes - 1 if blank_index is None else blank_index
    if blank < 0:
        blank += num_classes
    lengths = np.asarray(sequence_length, dtype=np.int64)
    arg = inputs.argmax(axis=2)                                       # [T, B]
    best = np.take_along_axis(inputs, arg[:, :, None], axis=2)[:, :, 0]
    valid = np.arange(max_time)[:, None] < lengths[None, :]
    neg = -np.cumsum(np.where(valid, best, 0), axis=0, dtype=inputs.dtype)[-1][:, None]
    keep = valid & (arg != blank)
    if merge_repeated:
        prev = np.empty_like(arg)
        prev[0] = -1
        prev[1:] = arg[:-1]
        keep &= arg != prev
    b_idx, t_idx = np.nonzero(keep.T)                                 # batch-major order
    values = arg.T[b_idx, t_idx].astype(np.int64)
    counts = np.bincount(b_idx, minlength=batch)
    starts = np.zeros(batch, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    pos = np.arange(b_idx.shape[0]) - starts[b_idx]
    indices = np.stack([b_idx, pos], axis=1).astype(np.int64)
    shape = np.array([batch, counts.max() if batch else 0], dtype=np.int64)
    return indices, values, shape, neg


def ctc_greedy_decoder_loop(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """The decoder as a user writes it: per utterance, argmax, merge repeats, drop
    blanks (benchmark peer for small, streaming shapes).

    Returns one int64 label array per utterance (no ``neg_sum_logits``, no
    sparse packing: less work than the kernel does).  NumPy's argmax treats NaN
    as the maximum, unlike TF: inputs without NaN only.
    """
    max_time, batch, num_classes = inputs.shape
    blank = num_classes - 1 if blank_index is None else blank_index
    if blank < 0:
        blank += num_classes
    out = []
    for b in range(batch):
        a = inputs[:max(int(sequence_length[b]), 0), b].argmax(axis=1)
        if merge_repeated and a.shape[0] > 1:
            keep = np.empty(a.shape[0], dtype=bool)
            keep[0] = True
            np.not_equal(a[1:], a[:-1], out=keep[1:])
            a = a[keep]
        out.append(a[a != blank])
    return out


# ---- the GPU tests' spelling ---------------------------------------------------------

batch_reindex = batch_reindex_reference
batch_reindex_grad = batch_reindex_grad_reference


def batch_reindex_lod(data, offsets, idx):
    """``batch_reindex`` of a one-level LoD batch given as ``(data, offsets)``."""
    data, offsets, idx = np.asarray(data), np.asarray(offsets, np.int64), np.asarray(idx)
    check_indices(idx, offsets.shape[0] - 1)
    parts = [data[offsets[i]:offsets[i + 1]] for i in idx]
    new_offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum([p.shape[0] for p in parts], out=new_offsets[1:])
    return (np.concatenate(parts, axis=0) if parts else data[:0]), new_offsets


def row_max(row):
    """TensorFlow's RowMax on one row: (max value, first argmax)."""
    arg, best = tf_row_argmax(np.asarray(row))
    return best, arg


def _widened(logits):
    """float16/bfloat16 logits widened exactly to float32 (float64 stays)."""
    logits = np.asarray(logits)
    return logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)


def _blank(num_classes, blank_index):
    return num_classes - 1 if blank_index is None else int(blank_index) % num_classes


def ctc_greedy_decoder(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """Any float dtype -> ``((indices, values, dense_shape), neg_sum_logits [batch, 1])``."""
    x = _widened(inputs)
    lengths = np.maximum(np.asarray(sequence_length).astype(np.int64), 0)
    i, v, s, neg = ctc_greedy_decoder_reference(x, lengths, merge_repeated, _blank(x.shape[2], blank_index))
    return (i, v, s), neg


def ctc_greedy_decoder_lod(data, offsets, merge_repeated=True, blank_index=None):
    """``ctc_greedy_decoder`` of a one-level LoD batch ``(data [frames, classes], offsets)``."""
    x = _widened(data)
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    batch, t_max = lengths.shape[0], int(lengths.max(initial=0))
    padded = np.zeros((max(t_max, 1), batch, x.shape[1]), x.dtype)
    for b in range(batch):
        padded[:lengths[b], b] = x[offsets[b]:offsets[b + 1]]
    return ctc_greedy_decoder(padded, lengths, merge_repeated, blank_index)
