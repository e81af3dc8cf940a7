"""Plain-NumPy references for the reindex and CTC kernels (the semantics, slowly).

Used by the GPU tests and benchmarks/gpu_check.py when the CPU kernels
(``readerlib.kernels``) are not importable, and by tests/gpu/test_gpu_launchers.py.
They state the contract the CPU and CUDA kernels share:

* reindex indices are checked in order; the first bad one decides the message
  (Caffe's loop: ``CHECK_GE(idx, 0)`` then ``CHECK_LT(idx, num)``);
* the backward sums each output row's contributions in ascending ``n``, starting
  from +0, in float32 for float16 (rounded once), wrapping for integers;
* the CTC argmax is TF's RowMax: ``p = x[0]``, then ``x[c]`` replaces it only when
  ``x[c] > p`` -- first maximum wins, NaN at c > 0 never wins, NaN at 0 wins.
"""
import numpy as np

NEGATIVE_INDEX_MESSAGE = "Index specified for reindex layer was negative."
INDEX_TOO_LARGE_MESSAGE = "Index specified for reindex layer was greater than batch size."


def check_indices(idx, limit):
    idx = np.asarray(idx)
    bad = np.flatnonzero((idx < 0) | (idx >= limit))
    if bad.size:
        raise IndexError(NEGATIVE_INDEX_MESSAGE if idx[bad[0]] < 0 else INDEX_TOO_LARGE_MESSAGE)


def batch_reindex(x, idx):
    x, idx = np.asarray(x), np.asarray(idx)
    check_indices(idx, x.shape[0])
    return x[idx]


def grad_accumulator(dtype):
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def batch_reindex_grad(dy, idx, num_rows):
    dy, idx = np.asarray(dy), np.asarray(idx)
    check_indices(idx, num_rows)
    acc = grad_accumulator(dy.dtype)
    dx = np.zeros((num_rows,) + dy.shape[1:], dtype=acc)
    np.add.at(dx, idx, dy.astype(acc))  # in order of n, from +0
    return dx.astype(dy.dtype)


def batch_reindex_lod(data, offsets, idx):
    data, offsets, idx = np.asarray(data), np.asarray(offsets, np.int64), np.asarray(idx)
    check_indices(idx, offsets.shape[0] - 1)
    parts = [data[offsets[i]:offsets[i + 1]] for i in idx]
    lengths = np.array([p.shape[0] for p in parts], dtype=np.int64)
    new_offsets = np.zeros(idx.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    new_data = np.concatenate(parts, axis=0) if parts else data[:0]
    return new_data, new_offsets


def row_max(row):
    """TensorFlow's RowMax on one row (float32/float64): (max value, first argmax)."""
    x = np.asarray(row)
    if np.isnan(x[0]):
        return x[0], 0
    y = np.where(np.isnan(x), -np.inf, x)
    i = int(np.argmax(y))  # first maximum; all -inf -> 0
    return y[i], i


def _acc_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _decode_utterance(frames, merge_repeated, blank):
    labels = []
    acc = frames.dtype.type
    neg = acc(0)
    prev = -1
    for t in range(frames.shape[0]):
        m, a = row_max(frames[t])
        neg = acc(neg + acc(-m))
        if a != blank and not (merge_repeated and a == prev):
            labels.append(a)
        prev = a
    return labels, neg


def _to_sparse(per_utt):
    indices = [[b, p] for b, labels in enumerate(per_utt) for p in range(len(labels))]
    values = [v for labels in per_utt for v in labels]
    longest = max((len(l) for l in per_utt), default=0)
    return (np.array(indices, dtype=np.int64).reshape(-1, 2), np.array(values, dtype=np.int64),
            np.array([len(per_utt), longest], dtype=np.int64))


def _normalise_blank(num_classes, blank_index):
    if blank_index is None:
        return num_classes - 1
    return int(blank_index) % num_classes


def ctc_greedy_decoder(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """-> ((indices, values, dense_shape), neg_sum_logits [batch, 1])."""
    inputs = np.asarray(inputs)
    acc = _acc_dtype(inputs.dtype)
    x = inputs.astype(acc)  # float16/bfloat16 widen exactly
    max_time, batch, num_classes = x.shape
    blank = _normalise_blank(num_classes, blank_index)
    lengths = np.asarray(sequence_length)
    per_utt, neg = [], np.zeros((batch, 1), dtype=acc)
    for b in range(batch):
        labels, neg[b, 0] = _decode_utterance(x[:max(0, int(lengths[b])), b], merge_repeated, blank)
        per_utt.append(labels)
    return _to_sparse(per_utt), neg


def ctc_greedy_decoder_lod(data, offsets, merge_repeated=True, blank_index=None):
    data = np.asarray(data)
    acc = _acc_dtype(data.dtype)
    x = data.astype(acc)
    offsets = np.asarray(offsets, np.int64)
    blank = _normalise_blank(x.shape[1], blank_index)
    batch = offsets.shape[0] - 1
    per_utt, neg = [], np.zeros((batch, 1), dtype=acc)
    for b in range(batch):
        labels, neg[b, 0] = _decode_utterance(x[offsets[b]:offsets[b + 1]], merge_repeated, blank)
        per_utt.append(labels)
    return _to_sparse(per_utt), neg
