"""CUDA launchers for readerlib's kernels: CuPy arrays in, CuPy arrays out.

The public functions in :mod:`readerlib.kernels` validate argument types and
shapes and hand CuPy arrays to the functions here, which launch the RawKernels of
``cuda/reindex.cu`` and ``cuda/ctc.cu`` (see the "Design:" block of each) on the
current device and stream.  Results equal the CPU kernels': integers and reindexed
data bitwise, the backward's sums bitwise (same order, same accumulator), and
``neg_sum_logits`` within float rounding.

Importing this module needs neither CuPy nor a GPU; calling a function without
CuPy raises ``ImportError`` saying what to install.

Host synchronisation: ``batch_reindex`` and ``batch_reindex_grad`` wait only for
their index check (a few bytes copied back), never for the copy or the sums, which
stay queued on the stream; ``batch_reindex_lod`` and the CTC decoders wait once, to
learn the size of their outputs.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ..errors import FailedPreconditionError, InvalidArgumentError
from ..gpu import require_cupy
from ..tensor import SparseTensor
from ._cuda_loader import get_kernel

__all__ = [
    "batch_reindex", "batch_reindex_grad", "batch_reindex_lod",
    "ctc_greedy_decoder", "ctc_greedy_decoder_lod", "kernel_names",
    "NEGATIVE_INDEX_MESSAGE", "INDEX_TOO_LARGE_MESSAGE",
]

NEGATIVE_INDEX_MESSAGE = "Index specified for reindex layer was negative."
INDEX_TOO_LARGE_MESSAGE = "Index specified for reindex layer was greater than batch size."

_REINDEX_CU = "reindex.cu"
_CTC_CU = "ctc.cu"

_BLOCK = 256            # threads per block, every launch
_UNROLL = 4             # kUnroll in reindex.cu: words per thread per column tile
_MAX_GRID_Y = 65535
_WORD_BYTES = (16, 8, 4, 2, 1)
_SMALL_SORT_MAX = 4096  # backward keys sorted in one block's shared memory (32 KiB)
_SMALL_SORT_THREADS = 1024
_INDEX_NAMES = {np.dtype(np.int32): "int32", np.dtype(np.int64): "int64"}
_GRAD_NAMES = {np.dtype(t): np.dtype(t).name for t in
               (np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8)}
_CTC_NAMES = ("float16", "bfloat16", "float32", "float64")


# ---- kernel names (one place, so tests can check each exists in the PTX) ----------

def _reindex_copy_name(word_bytes, index_name, lod=False):
    return f"batch_reindex{'_lod' if lod else ''}_w{word_bytes}_{index_name}"


def _reindex_grad_name(dtype_name, vec16):
    return f"batch_reindex_grad_{dtype_name}{'_v16' if vec16 else ''}"


def _ctc_argmax_name(dtype_name, lod):
    return f"ctc_frame_argmax_{'lod' if lod else 'padded'}_{dtype_name}"


def _ctc_scan_name(acc_name, lod):
    return f"ctc_emit_scan_{'lod' if lod else 'padded'}_{acc_name}"


def _ctc_compact_name(lod):
    return f"ctc_compact_{'lod' if lod else 'padded'}"


def kernel_names():
    """``{source file: [every extern "C" kernel name this module may launch]}``."""
    reindex = ["reindex_segments"]
    for index_name in ("int32", "int64"):
        reindex += [f"reindex_check_{index_name}", f"reindex_check_keys_{index_name}",
                    f"reindex_sort_small_{index_name}", f"reindex_lod_lengths_{index_name}"]
        for w in _WORD_BYTES:
            reindex += [_reindex_copy_name(w, index_name), _reindex_copy_name(w, index_name, True)]
    for dtype_name in _GRAD_NAMES.values():
        reindex += [_reindex_grad_name(dtype_name, False), _reindex_grad_name(dtype_name, True)]
    ctc = []
    for lod in (False, True):
        ctc += [_ctc_argmax_name(d, lod) for d in _CTC_NAMES]
        ctc += [_ctc_scan_name(a, lod) for a in ("float32", "float64")]
        ctc.append(_ctc_compact_name(lod))
    return {_REINDEX_CU: sorted(reindex), _CTC_CU: sorted(ctc)}


# ---- helpers --------------------------------------------------------------------

_props_lock = threading.Lock()
_sm_counts = {}


def _sm_count(cp):
    dev = cp.cuda.runtime.getDevice()
    n = _sm_counts.get(dev)
    if n is None:
        n = int(cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
        with _props_lock:
            _sm_counts[dev] = n
    return n


def _max_blocks(cp):
    # 8 resident blocks of 256 threads per SM, 4 waves: enough to hide latency,
    # few enough that grid-stride loops amortise the per-block setup.
    return _sm_count(cp) * 32


def _cdiv(a, b):
    return -(-a // b)


def _row_layout(words):
    """Block shape (tx, ty) for rows of ``words`` words: tx ~ words / _UNROLL, a power of two."""
    per_thread = _cdiv(max(words, 1), _UNROLL)
    tx = 1
    while tx < per_thread and tx < _BLOCK:
        tx *= 2
    return tx, _BLOCK // tx


def _row_grid(cp, n_rows, ty, words, tx):
    gx = max(1, min(_cdiv(n_rows, ty), _max_blocks(cp)))
    gy = max(1, min(_cdiv(words, tx * _UNROLL), _MAX_GRID_Y))
    return gx, gy


def _word_bytes(row_bytes, *arrays):
    for w in _WORD_BYTES:
        if row_bytes % w == 0 and all(a.data.ptr % w == 0 for a in arrays):
            return w
    return 1


def _index_name(idx):
    name = _INDEX_NAMES.get(np.dtype(idx.dtype))
    if name is None or idx.ndim != 1:
        raise TypeError(f"reindex indices must be a 1-D int32 or int64 array, got "
                        f"{idx.ndim}-D {idx.dtype}")
    return name


def _device(cp, a, dtype=None):
    """A C-contiguous CuPy array (a host array is copied over, as CuPy's asarray does)."""
    if (isinstance(a, cp.ndarray) and a.flags.c_contiguous
            and (dtype is None or a.dtype == dtype)):
        return a                                   # the common case, without two calls
    return cp.ascontiguousarray(cp.asarray(a, dtype=dtype))


_local = threading.local()


def _fetch_async(cp, dev_array):
    """Queue a copy of a small device array to page-locked host memory.

    Returns ``(host, done)``: ``host`` is valid once the event ``done`` has
    completed.  The buffer and the event are reused per thread and device (so a
    call costs no allocation); the caller must read ``host`` before its thread
    makes the next call.  Copy and event go on the *current* stream, where the
    kernels that wrote ``dev_array`` ran.
    """
    dev = cp.cuda.runtime.getDevice()
    slots = getattr(_local, "slots", None)
    if slots is None:
        slots = _local.slots = {}
    nbytes = dev_array.nbytes
    slot = slots.get(dev)
    if slot is None or slot[0].nbytes < nbytes:
        size = max(nbytes, 64)
        # np.frombuffer keeps the PinnedMemoryPointer alive through .base
        slot = slots[dev] = (np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size),
                             cp.cuda.Event(block=False, disable_timing=True))
    buffer, done = slot
    done.synchronize()   # an earlier copy into this buffer (left by an exception) has landed
    stream = cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyAsync(buffer.ctypes.data, dev_array.data.ptr, nbytes,
                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    done.record(stream)
    return buffer[:nbytes].view(dev_array.dtype), done


def _raise_index_error(n, neg, big):
    """Caffe checks each index in order (negative, then too large): the first bad one decides.

    ``neg`` / ``big`` are ``n - first position`` (0 when there is none).
    """
    neg, big = int(neg), int(big)
    if not neg and not big:
        return
    first_neg = n - neg if neg else n
    first_big = n - big if big else n
    err = IndexError(NEGATIVE_INDEX_MESSAGE if first_neg < first_big else INDEX_TOO_LARGE_MESSAGE)
    err.add_note(f"idx[{min(first_neg, first_big)}] is the first bad entry of {n} indices")
    raise err


# ---- batch_reindex --------------------------------------------------------------

def _launch_reindex_rows(cp, x, idx, y):
    """Queue y[n] = x[idx[n]] (rows with a bad index are skipped).  No checks, no sync."""
    n = idx.shape[0]
    row_bytes = y.nbytes // n if n else 0
    if n == 0 or row_bytes == 0 or x.shape[0] == 0:
        return
    w = _word_bytes(row_bytes, x, y)
    words = row_bytes // w
    tx, ty = _row_layout(words)
    grid = _row_grid(cp, n, ty, words, tx)
    kern = get_kernel(_REINDEX_CU, _reindex_copy_name(w, _index_name(idx)))
    kern(grid, (tx, ty), (x, idx, y, np.int64(n), np.int64(x.shape[0]), np.int64(words)))


def _launch_check(cp, idx, limit, status, keys=None, shift=0):
    n = idx.shape[0]
    grid = max(1, min(_cdiv(n, _BLOCK), _max_blocks(cp)))
    name = _index_name(idx)
    if keys is None:
        get_kernel(_REINDEX_CU, f"reindex_check_{name}")(
            (grid,), (_BLOCK,), (idx, np.int64(n), np.int64(limit), status))
    else:
        get_kernel(_REINDEX_CU, f"reindex_check_keys_{name}")(
            (grid,), (_BLOCK,), (idx, np.int64(n), np.int64(limit), status, keys, np.int32(shift)))


def batch_reindex(x, idx):
    """``y[n] = x[idx[n]]`` on the GPU (Caffe's BatchReindex forward).

    Parameters
    ----------
    x : cupy.ndarray
        ``[num_rows, *inner]``, any dtype (the rows are copied as bytes).
    idx : cupy.ndarray
        1-D int32 or int64.

    Returns
    -------
    cupy.ndarray
        ``[len(idx), *inner]``, dtype of ``x``.

    Raises
    ------
    IndexError
        Caffe's messages, for the first index (in order) that is negative or
        ``>= x.shape[0]``.  Checked on the device; the host reads back 16 bytes.
    """
    cp = require_cupy()
    x = _device(cp, x)
    idx = _device(cp, idx)
    _index_name(idx)
    if x.ndim < 1:
        raise ValueError("batch_reindex needs x with at least one dimension (the batch)")
    n = idx.shape[0]
    y = cp.empty((n,) + x.shape[1:], dtype=x.dtype)
    if n == 0:
        return y
    status = cp.zeros(2, dtype=np.uint64)
    _launch_check(cp, idx, x.shape[0], status)
    host, checked = _fetch_async(cp, status)
    _launch_reindex_rows(cp, x, idx, y)   # queued behind the check; host does not wait for it
    checked.synchronize()
    _raise_index_error(n, host[0], host[1])
    return y


def batch_reindex_grad(dy, idx, num_rows):
    """``dx[k] = sum of dy[n] over idx[n] == k`` in ascending ``n``, without atomics.

    Bitwise equal to the CPU kernel: every element of ``dx`` is summed by one thread
    in ascending ``n``, from +0, in float32 for float16 (rounded once at the end),
    in the dtype otherwise (integers wrap).  Unreferenced rows are zero.

    Parameters
    ----------
    dy : cupy.ndarray
        ``[len(idx), *inner]``; float16, float32, float64, int32, int64 or uint8.
    idx : cupy.ndarray
        1-D int32 or int64, the forward's indices.
    num_rows : int
        ``x.shape[0]`` of the forward.

    Returns
    -------
    cupy.ndarray
        ``[num_rows, *inner]``, dtype of ``dy``.

    Raises
    ------
    IndexError
        As :func:`batch_reindex`, against ``num_rows``.
    ValueError
        If ``len(idx) * num_rows >= 2**62`` (the sort key would overflow).

    Notes
    -----
    Up to 4096 indices are sorted by one block in shared memory (one launch);
    more go through ``cupy.sort``.  ``READERLIB_GPU_SMALL_SORT=0`` forces the latter.
    """
    cp = require_cupy()
    dy = _device(cp, dy)
    idx = _device(cp, idx)
    _index_name(idx)
    dtype_name = _GRAD_NAMES.get(np.dtype(dy.dtype))
    if dtype_name is None:
        raise TypeError(f"batch_reindex_grad does not support dtype {dy.dtype}; use one of "
                        + ", ".join(_GRAD_NAMES.values()))
    n, m = idx.shape[0], int(num_rows)
    if dy.ndim < 1 or dy.shape[0] != n:
        raise ValueError(f"dy must have len(idx) = {n} rows, got shape {dy.shape}")
    if m < 0:
        raise ValueError(f"num_rows must be >= 0, got {m}")
    if n == 0:
        return cp.zeros((m,) + dy.shape[1:], dtype=dy.dtype)
    shift = (n - 1).bit_length()
    if (m + 1).bit_length() + shift > 63:
        raise ValueError(f"batch_reindex_grad on the GPU needs len(idx) * num_rows < 2**62, "
                         f"got {n} * {m}")
    dx = cp.empty((m,) + dy.shape[1:], dtype=dy.dtype)
    status = cp.zeros(2, dtype=np.uint64)
    keys = cp.empty(n, dtype=np.int64)
    # Unique keys (idx << shift | n): sorting them orders by (idx, n).
    if n <= _SMALL_SORT_MAX and os.environ.get("READERLIB_GPU_SMALL_SORT", "1") != "0":
        p = 1 << (n - 1).bit_length()
        get_kernel(_REINDEX_CU, f"reindex_sort_small_{_index_name(idx)}")(
            (1,), (_SMALL_SORT_THREADS,),
            (idx, np.int64(n), np.int64(m), status, keys, np.int32(shift), np.int32(p)),
            shared_mem=p * 8)
        host, checked = _fetch_async(cp, status)
    else:
        _launch_check(cp, idx, m, status, keys, shift)
        host, checked = _fetch_async(cp, status)
        if m:
            keys.sort()
    if m:
        seg = cp.zeros(2 * m, dtype=np.int64)  # absent rows: empty range [0, 0)
        grid = max(1, min(_cdiv(n, _BLOCK), _max_blocks(cp)))
        get_kernel(_REINDEX_CU, "reindex_segments")(
            (grid,), (_BLOCK,), (keys, np.int64(n), np.int32(shift), np.int64(m), seg))
        _launch_grad_rows(cp, dy, keys, seg, dx, dtype_name, shift)
    checked.synchronize()
    _raise_index_error(n, host[0], host[1])
    return dx


def _launch_grad_rows(cp, dy, keys, seg, dx, dtype_name, shift):
    m = dx.shape[0]
    row_elems = dx.size // m if m else 0
    if row_elems == 0:
        return
    per_pack = 16 // dx.itemsize
    vec16 = row_elems % per_pack == 0 and dy.data.ptr % 16 == 0 and dx.data.ptr % 16 == 0
    row_packs = row_elems // per_pack if vec16 else row_elems
    tx, ty = _row_layout(row_packs)
    grid = _row_grid(cp, m, ty, row_packs, tx)
    get_kernel(_REINDEX_CU, _reindex_grad_name(dtype_name, vec16))(
        grid, (tx, ty), (dy, keys, seg, dx, np.int64(m), np.int64(row_packs), np.int32(shift)))


def batch_reindex_lod(data, offsets, idx):
    """Reindex whole sequences of a one-level LoD batch on the GPU.

    Parameters
    ----------
    data : cupy.ndarray
        ``[total_rows, *inner]``.
    offsets : cupy.ndarray
        int64 ``[num_sequences + 1]``, a valid LoD level of ``data``.
    idx : cupy.ndarray
        1-D int32 or int64, sequences to pick.

    Returns
    -------
    (cupy.ndarray, cupy.ndarray)
        ``new_data`` (the picked sequences' rows, in order) and ``new_offsets``
        (int64, ``[len(idx) + 1]``).

    Raises
    ------
    IndexError
        Caffe's messages, against the number of sequences.
    """
    cp = require_cupy()
    data = _device(cp, data)
    offsets = _device(cp, offsets, np.int64)
    idx = _device(cp, idx)
    index_name = _index_name(idx)
    n_seq = offsets.shape[0] - 1
    n = idx.shape[0]
    new_offsets = cp.zeros(n + 1, dtype=np.int64)
    if n == 0:
        return cp.empty((0,) + data.shape[1:], dtype=data.dtype), new_offsets
    lengths = cp.empty(n, dtype=np.int64)
    status = cp.zeros(4, dtype=np.uint64)  # neg, big, longest, total
    grid = max(1, min(_cdiv(n, _BLOCK), _max_blocks(cp)))
    get_kernel(_REINDEX_CU, f"reindex_lod_lengths_{index_name}")(
        (grid,), (_BLOCK,), (offsets, np.int64(n_seq), idx, np.int64(n), lengths, status))
    cp.cumsum(lengths, out=new_offsets[1:])
    host = status.get()                    # the one sync: the output size
    _raise_index_error(n, host[0], host[1])
    longest, total = int(host[2]), int(host[3])
    new_data = cp.empty((total,) + data.shape[1:], dtype=data.dtype)
    row_bytes = new_data.nbytes // total if total else 0
    if total and row_bytes:
        w = _word_bytes(row_bytes, data, new_data)
        row_words = row_bytes // w
        tx, ty = _row_layout(_cdiv(total, n) * row_words)   # sized to the mean sequence
        grid = _row_grid(cp, n, ty, longest * row_words, tx)
        get_kernel(_REINDEX_CU, _reindex_copy_name(w, index_name, lod=True))(
            grid, (tx, ty), (data, offsets, idx, new_offsets, new_data, np.int64(n),
                             np.int64(n_seq), np.int64(row_words)))
    return new_data, new_offsets


# ---- ctc_greedy_decoder ---------------------------------------------------------

def _ctc_dtype_name(dtype):
    name = np.dtype(dtype).name
    if name not in _CTC_NAMES:
        raise TypeError(f"ctc_greedy_decoder on the GPU takes float16, bfloat16, float32 or "
                        f"float64 logits, got {dtype}")
    return name


def _blank(num_classes, blank_index):
    """num_classes checked; blank_index: None -> num_classes - 1, negative counts from the end."""
    if not 0 < num_classes < 2 ** 31:
        raise ValueError(f"num_classes must be in [1, 2**31), got {num_classes}")
    if blank_index is None:
        return num_classes - 1
    blank_index = int(blank_index)
    if not -num_classes <= blank_index < num_classes:
        raise ValueError(f"blank_index must be in [-{num_classes}, {num_classes}), got {blank_index}")
    return blank_index % num_classes


def _ctc_decode(cp, logits, num_classes, batch, max_time, seq_len, offsets,
                merge_repeated, blank_index):
    """The launch chain shared by the padded (seq_len) and LoD (offsets) forms."""
    lod = offsets is not None
    dtype_name = _ctc_dtype_name(logits.dtype)
    acc = np.dtype(np.float64 if dtype_name == "float64" else np.float32)
    n_rows = logits.shape[0] if lod else max_time * batch
    cap = n_rows                                    # every frame emitted, at most
    # One int64 allocation (a single memset zeroes the status words) holds
    # status[4] | dense_shape[2] | counts[batch] | row_start[batch] | indices[cap, 2] | values[cap];
    # the outputs are views of it (sized for every frame emitted: the sizes are
    # known only at the end, and allocating then would cost a second round trip).
    ws = cp.zeros(6 + 2 * batch + 3 * cap, dtype=np.int64)
    status, dense_shape = ws[0:4], ws[4:6]
    counts, row_start = ws[6:6 + batch], ws[6 + batch:6 + 2 * batch]
    indices = ws[6 + 2 * batch:6 + 2 * batch + 2 * cap].reshape(cap, 2)
    values = ws[6 + 2 * batch + 2 * cap:]
    frames = cp.empty(2 * cap, dtype=np.int32)      # argmax | emitted position (-1: none)
    best_idx, pos = frames[:cap], frames[cap:]
    best_val = cp.empty(cap, dtype=acc)
    neg_sum = cp.empty((batch, 1), dtype=acc)
    if batch:
        if n_rows:
            grid = max(1, min(_cdiv(n_rows, _BLOCK // 32), _max_blocks(cp)))
            kern = get_kernel(_CTC_CU, _ctc_argmax_name(dtype_name, lod))
            if lod:
                kern((grid,), (_BLOCK,), (logits, np.int64(n_rows), np.int32(num_classes),
                                          best_idx, best_val))
            else:
                kern((grid,), (_BLOCK,), (logits, seq_len, np.int64(max_time), np.int64(batch),
                                          np.int32(num_classes), best_idx, best_val))
        grid = max(1, min(batch, _max_blocks(cp)))
        scan = get_kernel(_CTC_CU, _ctc_scan_name(acc.name, lod))
        compact = get_kernel(_CTC_CU, _ctc_compact_name(lod))
        span = (offsets,) if lod else (seq_len, np.int64(max_time))
        scan((grid,), (_BLOCK,), (best_idx, best_val) + span + (
            np.int64(batch), np.int32(blank_index), np.int32(bool(merge_repeated)), pos, neg_sum,
            counts, row_start, status, dense_shape))
        compact((grid,), (_BLOCK,), (best_idx, pos) + span + (
            row_start, np.int64(batch), indices, values))
    host, done = _fetch_async(cp, status)
    done.synchronize()                               # the one sync: learn the output size
    if int(host[3]):
        b = batch - int(host[3])
        raise FailedPreconditionError(f"sequence_length({b}) <= {max_time}")
    total = int(host[1])
    return [SparseTensor(indices[:total], values[:total], dense_shape)], neg_sum


def ctc_greedy_decoder(inputs, sequence_length, merge_repeated=True, blank_index=None):
    """``tf.nn.ctc_greedy_decoder`` on the GPU, for time-major padded logits.

    Parameters
    ----------
    inputs : cupy.ndarray
        ``[max_time, batch, num_classes]``; float32, float64, float16 or bfloat16.
    sequence_length : cupy.ndarray
        ``[batch]`` int32 (other integer dtypes are converted).
    merge_repeated : bool
    blank_index : int, optional
        Already normalised to ``[0, num_classes)``; ``None`` means ``num_classes - 1``.

    Returns
    -------
    ([SparseTensor], cupy.ndarray)
        The decoded labels (int64 ``indices [N, 2]``, ``values [N]``,
        ``dense_shape [batch, max decoded length]``, all on the device) and
        ``neg_sum_logits [batch, 1]`` (float64 for float64 logits, else float32).

    Raises
    ------
    InvalidArgumentError, FailedPreconditionError (ValueErrors)
        What the CPU path raises for the same fault (readerlib.errors), e.g.
        TensorFlow's ``sequence_length(b) <= max_time`` when a length exceeds
        ``max_time`` (found on the device, reported at the one sync).
    """
    cp = require_cupy()
    inputs = _device(cp, inputs)
    if inputs.ndim != 3:
        raise InvalidArgumentError("inputs is not a 3-Tensor")
    max_time, batch, num_classes = (int(d) for d in inputs.shape)
    blank_index = _blank(num_classes, blank_index)
    seq_len = _device(cp, sequence_length, np.int32)
    if max_time == 0:
        raise InvalidArgumentError("max_time is 0")
    if seq_len.ndim != 1:
        raise InvalidArgumentError("sequence_length is not a vector")
    if seq_len.shape[0] != batch:
        raise FailedPreconditionError(f"len(sequence_length) != batch_size.  len(sequence_length):  "
                                      f"{seq_len.shape[0]} batch_size: {batch}")
    return _ctc_decode(cp, inputs, num_classes, batch, max_time, seq_len, None,
                       merge_repeated, blank_index)


def ctc_greedy_decoder_lod(data, offsets, merge_repeated=True, blank_index=None):
    """Greedy CTC decoding of a one-level LoD batch (no padding) on the GPU.

    Parameters
    ----------
    data : cupy.ndarray
        ``[total_frames, num_classes]``, every utterance's frames stacked.
    offsets : cupy.ndarray
        int64 ``[batch + 1]``, a valid LoD level of ``data`` (one utterance each).
    merge_repeated, blank_index
        As :func:`ctc_greedy_decoder`.

    Returns
    -------
    ([SparseTensor], cupy.ndarray)
        As :func:`ctc_greedy_decoder`: the same values as the padded form of the
        same utterances.
    """
    cp = require_cupy()
    data = _device(cp, data)
    if data.ndim != 2:
        raise ValueError(f"LoD logits must be [total_frames, num_classes], got shape {data.shape}")
    num_classes = int(data.shape[1])
    blank_index = _blank(num_classes, blank_index)
    offsets = _device(cp, offsets, np.int64)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be a 1-D LoD level [batch + 1], got shape {offsets.shape}")
    batch = int(offsets.shape[0]) - 1
    return _ctc_decode(cp, data, num_classes, batch, 0, None, offsets,
                       merge_repeated, blank_index)
