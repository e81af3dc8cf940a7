"""Batch kernels: BatchReindex (Caffe) and CTC greedy decoding (TensorFlow).

Each public function validates its arguments (with the messages of the system
the kernel comes from) before any kernel runs, then dispatches on the array
type: NumPy arrays go to the Cython kernels in ``_reindex`` / ``_ctc``, CuPy
arrays to ``_gpu`` (imported only when a CuPy array is seen).  Both paths
return the same results: integers bitwise, floats within rounding.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..gpu import is_cupy_array
from ..tensor import LoDTensor, SparseTensor
from .. import _parallel
from . import _ctc, _reindex

__all__ = [
    "batch_reindex",
    "batch_reindex_grad",
    "ctc_greedy_decoder",
    "InvalidArgumentError",
    "FailedPreconditionError",
]


# In readerlib.errors (TensorFlow's taxonomy): OpErrors that are ValueErrors.
from ..errors import FailedPreconditionError, InvalidArgumentError  # noqa: E402


#: dtypes batch_reindex / batch_reindex_grad accept.
REINDEX_DTYPES = tuple(np.dtype(t) for t in
                       ("float16", "float32", "float64", "int32", "int64", "uint8"))
#: dtypes ctc_greedy_decoder accepts (TensorFlow's CPU kernel registrations).
CTC_DTYPES = (np.dtype("float32"), np.dtype("float64"))


#: Above this size a fresh np.zeros comes straight from mmap (glibc's dynamic
#: mmap threshold tops out at 32 MiB), so its untouched pages cost nothing;
#: below it calloc may memset the whole block, and np.empty plus zeroing only
#: the unreferenced rows is cheaper (perf: memset was 10% at 16 MiB).
LAZY_ZERO_BYTES = 32 << 20

def _threads(num_threads, work_bytes=None):
    """Threads for a kernel: ``num_threads`` exactly when given, else readerlib's
    thread count (``readerlib.get_num_threads``) capped so each thread gets at
    least ``_parallel.MIN_BYTES_PER_THREAD`` of work (one policy for readers and
    kernels: readerlib/_parallel.pyx)."""
    if num_threads is None:
        if work_bytes is None:
            return _parallel.get_num_threads()
        return _parallel._threads_for_py(int(work_bytes))
    if not isinstance(num_threads, numbers.Integral) or isinstance(num_threads, bool) \
            or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    return min(int(num_threads), _parallel.MAX_THREADS)


# -- foreign arrays: PyTorch tensors and DLPack producers ------------------------

#: DLPack device types whose memory the CPU kernels can read (kDLCPU, kDLCUDAHost)
#: and those the CuPy kernels can (kDLCUDA, kDLCUDAManaged).
_DLPACK_CPU = (1, 3)
_DLPACK_CUDA = (2, 13)


def _is_foreign(a):
    """A tensor of another framework: has ``__dlpack__`` and is neither NumPy nor CuPy."""
    return (not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__")
            and hasattr(a, "__dlpack_device__") and not is_cupy_array(a))


def _native(a, what, detach=False):
    """``(array, wrap)``: a NumPy (CPU) or CuPy (CUDA) view of a PyTorch tensor or
    other DLPack producer ``a``, without a copy, and ``wrap``, which turns a
    result array back into ``a``'s kind (torch in -> torch out; another
    producer -> its module's ``from_dlpack`` when it has one, else the NumPy /
    CuPy array).  ``wrap`` is None for anything else (returned unchanged).

    ``detach``: a torch tensor that requires grad is read as its ``.detach()``;
    otherwise it is refused, since the result could not carry the gradient.
    """
    if not _is_foreign(a):
        return a, None
    kind = type(a).__module__.split(".")[0]
    if kind == "torch":
        import torch
        if a.requires_grad:
            if not detach:
                raise TypeError(f"{what} requires grad, and this kernel is not recorded by "
                                f"autograd: pass {what}.detach() (the backward of batch_reindex "
                                "is batch_reindex_grad)")
            a = a.detach()
        if a.device.type == "cpu":
            try:
                return a.resolve_conj().resolve_neg().numpy(), torch.from_numpy
            except TypeError as e:   # a dtype NumPy has no equivalent for (bfloat16 ...)
                raise TypeError(f"{what} has dtype {a.dtype}, which the CPU kernels do not "
                                f"read ({e}); cast it, e.g. {what}.float()") from None
        if a.device.type == "cuda":
            from ..gpu import require_cupy
            return require_cupy().from_dlpack(a), torch.from_dlpack
        raise TypeError(f"{what} is a torch tensor on {a.device}; pass a CPU or CUDA tensor "
                        f"({what}.cpu())")
    dev_type = int(a.__dlpack_device__()[0])
    if dev_type in _DLPACK_CPU:
        arr = np.from_dlpack(a)
    elif dev_type in _DLPACK_CUDA:
        from ..gpu import require_cupy
        arr = require_cupy().from_dlpack(a)
    else:
        raise TypeError(f"{what} lives on DLPack device type {dev_type}; the kernels read "
                        "CPU (NumPy) and CUDA (CuPy) memory: copy it to one of those first")
    import sys
    back = getattr(sys.modules.get(kind), "from_dlpack", None)
    return arr, (back if callable(back) else (lambda r: r))


def _wrap_all(wrap, *results):
    """Apply ``wrap`` (from :func:`_native`) to result arrays; identity when None."""
    if wrap is None:
        return results
    return tuple(wrap(r) for r in results)


def _sparse(indices, values, dense_shape):
    """A SparseTensor from the kernels' int64 arrays, without re-checking them."""
    sp = SparseTensor.__new__(SparseTensor)
    sp.indices, sp.values, sp.dense_shape = indices, values, dense_shape
    return sp


# -- batch_reindex --------------------------------------------------------------

def _check_reindex_dtype(a, what):
    if a.dtype not in REINDEX_DTYPES or not a.dtype.isnative:
        raise TypeError(f"{what} dtype {a.dtype} is not supported; use one of "
                        + ", ".join(str(d) for d in REINDEX_DTYPES))


def _reindex_operand(a, what):
    """(array, array module, on_gpu) for x / dy: a batch axis and a supported dtype."""
    xp = _xp(a)
    on_gpu = is_cupy_array(a)
    if not hasattr(a, "dtype"):
        a = np.asarray(a)
    if a.ndim < 1:
        raise ValueError(f"{what} must have a batch axis (ndim >= 1), got shape {tuple(a.shape)}")
    _check_reindex_dtype(a, what)
    return a, xp, on_gpu


def _as_index(idx, xp):
    """1-D int32/int64 contiguous index array; TypeError / ValueError otherwise."""
    if not hasattr(idx, "dtype"):
        idx = xp.asarray(idx)
        if idx.size == 0:
            idx = idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"idx must hold integers (int32 or int64), got {idx.dtype}; "
                        "a float index is not rounded silently (Caffe casts it)")
    if idx.ndim != 1:
        raise ValueError(f"idx must be 1-D, got shape {tuple(idx.shape)}")
    if idx.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        if idx.dtype == np.uint64 and idx.size and int(idx.max()) > np.iinfo(np.int64).max:
            k = int(np.argmax(idx > np.iinfo(np.int64).max))
            err = IndexError(_reindex.MSG_TOO_LARGE)
            err.add_note(f"idx[{k}] = {int(idx[k])}, past int64; {idx.shape[0]} indices")
            raise err
        idx = idx.astype(np.int64)
    return xp.ascontiguousarray(idx)


def _check_bounds(idx, limit):
    """Caffe's index checks in NumPy (the kernels repeat them in C): the first bad index,
    in order, decides the message."""
    if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= limit):
        raise _reindex.index_error(idx, limit)


from ..gpu import array_module as _xp  # noqa: E402


def _check_out(out, shape, dtype, src):
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a NumPy array here, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must have shape {shape} and dtype {dtype}, "
                         f"got {out.shape} and {out.dtype}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out must be a writeable C-contiguous array")
    if np.may_share_memory(out, src):
        raise ValueError("out must not overlap the input (rows would be overwritten before they are read)")
    return out


def batch_reindex(x, idx, *, out=None, num_threads=None):
    """Gather along the batch axis: ``y[n] = x[idx[n]]`` (Caffe's BatchReindex forward).

    Parameters
    ----------
    x : ndarray or LoDTensor
        ``[batch, *inner]``, any rank >= 1; float16, float32, float64, int32,
        int64 or uint8.  NumPy (CPU kernel) or CuPy (GPU kernel).  For a
        LoDTensor with ``lod``, whole sequences (top-level LoD entries) are
        reindexed and the offsets rebuilt: the way to shuffle or resample a
        batch of sequences.
    idx : array_like of int
        1-D, int32 or int64 (other integer types are converted; floats are
        rejected), each in ``[0, batch)``.  Repeats and omissions are fine.
    out : ndarray, optional
        C-contiguous ``[len(idx), *inner]`` array of ``x``'s dtype to write
        into (NumPy input, no LoDTensor).  Reusing a buffer skips the
        kernel's page zeroing of a fresh allocation, which costs as much as
        the copy for large outputs.
    num_threads : int, optional
        Threads for the CPU kernel.  Default: ``readerlib.get_num_threads()``,
        fewer for small inputs (see ``readerlib.set_num_threads``).

    Returns
    -------
    ndarray or LoDTensor
        ``[len(idx), *inner]`` with ``x``'s dtype; a LoDTensor for LoDTensor
        input.  An empty ``idx`` gives an empty result without running a kernel.

    Raises
    ------
    TypeError
        Unsupported ``x`` dtype, or a non-integer ``idx``.
    ValueError
        ``x`` is 0-d, or ``idx`` is not 1-D.
    IndexError
        "Index specified for reindex layer was negative." /
        "Index specified for reindex layer was greater than batch size."
        (Caffe's messages), raised before anything is written, with a note
        (``__notes__``, shown in tracebacks) naming the first bad entry, its
        value and the valid range: ``idx[7] = -3; valid indices are ...``.

    Examples
    --------
    >>> x = np.arange(6).reshape(3, 2)
    >>> batch_reindex(x, [2, 0, 2]).tolist()
    [[4, 5], [0, 1], [4, 5]]
    """
    if type(x) is np.ndarray and type(idx) is np.ndarray:
        # the common case in one compiled call; None: the full path below
        y = _reindex.gather_fast(x, idx, out, num_threads)
        if y is not None:
            return y
    if isinstance(x, LoDTensor):
        if out is not None:
            raise TypeError("out= is not supported for LoDTensor input")
        return _batch_reindex_lod(x, idx, num_threads)
    if _is_foreign(x) or _is_foreign(idx) or _is_foreign(out):
        return _batch_reindex_foreign(x, idx, out, num_threads)
    x, xp, on_gpu = _reindex_operand(x, "x")
    idx = _as_index(idx, xp)
    if on_gpu:
        if out is not None:
            raise NotImplementedError("out= is not supported for CuPy arrays")
        from . import _gpu
        return _gpu.batch_reindex(x, idx)
    if out is None:   # every byte is overwritten: may reuse a released block
        out = _reindex.empty_output((idx.shape[0],) + x.shape[1:], x.dtype)
    out = _check_out(out, (idx.shape[0],) + x.shape[1:], x.dtype, x)
    n_threads = _threads(num_threads, 2 * out.nbytes)
    if idx.shape[0] == 0:
        return out
    if not x.flags.c_contiguous:
        _check_bounds(idx, x.shape[0])   # before paying for the contiguous copy
    _reindex.gather_rows(np.ascontiguousarray(x), idx, out, n_threads)
    return out


def _batch_reindex_foreign(x, idx, out, num_threads):
    """batch_reindex for torch tensors / DLPack producers: zero-copy views in,
    the result handed back as ``x``'s kind (``out`` itself when given)."""
    x_arr, wrap = _native(x, "x")
    idx_arr, _ = _native(idx, "idx")
    out_arr, _ = _native(out, "out")
    y = batch_reindex(x_arr, idx_arr, out=out_arr, num_threads=num_threads)
    if out is not None:
        return out
    return _wrap_all(wrap, y)[0]


def _batch_reindex_lod(t, idx, num_threads):
    data, lod = t.validated()     # data / lod may have been changed after construction
    if not lod:
        return LoDTensor(batch_reindex(data, idx, num_threads=num_threads))
    _check_reindex_dtype(data, "x")
    xp = _xp(data)
    on_gpu = is_cupy_array(data)
    idx = _as_index(idx, xp)
    if on_gpu:
        if len(lod) != 1:
            raise NotImplementedError("batch_reindex of a multi-level LoDTensor on the GPU; "
                                      "use .to('cpu') or a one-level LoDTensor")
        from . import _gpu
        new_data, new_offsets = _gpu.batch_reindex_lod(data, lod[0], idx)
        return LoDTensor(new_data, [new_offsets])
    n_seq = lod[0].shape[0] - 1
    _check_bounds(idx, n_seq)
    sel = idx.astype(np.int64)
    # Walk down the levels: the selected entries of each level are contiguous
    # runs [begin, end) per top-level entry; rebuild each level's offsets
    # from the lengths of the entries in those runs.
    begin, end = sel, sel + 1
    new_lod = []
    for level in lod:
        lengths = np.diff(level)
        run = end - begin
        # entries of this level that are selected, in output order
        entries = np.repeat(begin - np.cumsum(np.r_[0, run[:-1]]), run) + np.arange(run.sum())
        offs = np.zeros(entries.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths[entries], out=offs[1:])
        new_lod.append(offs)
        begin, end = level[begin], level[end]
    # begin/end are now row ranges of data, one per idx entry
    n_rows = end - begin
    dst_row = np.zeros(n_rows.shape[0], dtype=np.int64)
    if n_rows.shape[0] > 1:
        np.cumsum(n_rows[:-1], out=dst_row[1:])
    total = int(n_rows.sum())
    out = _reindex.empty_output((total,) + data.shape[1:], data.dtype)
    if total:
        _reindex.copy_segments(np.ascontiguousarray(data), np.ascontiguousarray(begin),
                               np.ascontiguousarray(n_rows), dst_row, out,
                               _threads(num_threads, 2 * out.nbytes))
    return LoDTensor(out, new_lod)


def batch_reindex_grad(dy, idx, num_rows, *, out=None, num_threads=None):
    """Backward of :func:`batch_reindex`: ``dx[k] = sum(dy[n] for idx[n] == k)``.

    Deterministic: the output is bitwise the same for any number of threads.
    Indices are grouped by a stable counting sort, then every output row is
    written by one thread, as ``0 + dy[n0] + dy[n1] + ...`` in ascending
    ``n`` (the order ``np.add.at`` uses); rows nobody references are 0.

    Parameters
    ----------
    dy : ndarray
        ``[len(idx), *inner]``, gradient of the forward output; float16,
        float32, float64, int32, int64 or uint8.  float16 is accumulated in
        float32 and rounded once per element at the end (round to nearest
        even), so it is more accurate than a float16 running sum.  Integer
        sums wrap around like NumPy's.
    idx : array_like of int
        The forward's indices: 1-D int32/int64, each in ``[0, num_rows)``.
    num_rows : int
        Rows of ``dx`` (the forward input's batch size).
    out : ndarray, optional
        C-contiguous ``[num_rows, *inner]`` array of ``dy``'s dtype to write
        into (every element is overwritten; no need to zero it).
    num_threads : int, optional
        Threads for the CPU kernel.  Default: ``readerlib.get_num_threads()``,
        fewer for small inputs (see ``readerlib.set_num_threads``).

    Returns
    -------
    ndarray
        ``dx``, ``[num_rows, *inner]`` with ``dy``'s dtype.

    Raises
    ------
    TypeError
        Unsupported ``dy`` dtype, a non-integer ``idx`` or ``num_rows``.
    ValueError
        ``idx`` not 1-D, ``len(dy) != len(idx)``, ``num_rows < 0``.
    IndexError
        Caffe's messages for a negative index or one ``>= num_rows``.

    Examples
    --------
    >>> batch_reindex_grad(np.ones((3, 2)), [2, 0, 2], 3).tolist()
    [[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]
    """
    if _is_foreign(dy) or _is_foreign(idx) or _is_foreign(out):
        dy_arr, wrap = _native(dy, "dy")
        out_arr, _ = _native(out, "out")
        dx = batch_reindex_grad(dy_arr, _native(idx, "idx")[0], num_rows, out=out_arr,
                                num_threads=num_threads)
        return out if out is not None else _wrap_all(wrap, dx)[0]
    dy, xp, on_gpu = _reindex_operand(dy, "dy")
    if not isinstance(num_rows, numbers.Integral) or isinstance(num_rows, bool):
        raise TypeError(f"num_rows must be an int, got {type(num_rows).__name__}")
    num_rows = int(num_rows)
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    idx = _as_index(idx, xp)
    if dy.shape[0] != idx.shape[0]:
        raise ValueError(f"dy has {dy.shape[0]} rows but idx has {idx.shape[0]} entries; "
                         "they must match (dy is the gradient of batch_reindex(x, idx))")
    if on_gpu:
        if out is not None:
            raise NotImplementedError("out= is not supported for CuPy arrays")
        from . import _gpu
        return _gpu.batch_reindex_grad(dy, idx, num_rows)
    nbytes = num_rows * dy.itemsize * int(np.prod(dy.shape[1:], dtype=np.int64))
    lazy_zero = out is None and nbytes > LAZY_ZERO_BYTES
    if lazy_zero:
        # A large np.zeros is a fresh mmap of zero pages: rows no index refers
        # to are then never written (nor faulted in) at all.
        out = np.zeros((num_rows,) + dy.shape[1:], dtype=dy.dtype)
    else:
        out = _check_out(out, (num_rows,) + dy.shape[1:], dy.dtype, dy)
    if not dy.flags.c_contiguous:
        _check_bounds(idx, num_rows)     # before paying for the contiguous copy
    _reindex.scatter_add_rows(np.ascontiguousarray(dy), idx, num_rows, out,
                              _threads(num_threads, dy.nbytes + out.nbytes), lazy_zero)
    return out


# -- ctc_greedy_decoder -----------------------------------------------------------

def _check_num_classes(num_classes):
    if num_classes > np.iinfo(np.int32).max:   # class ids are int32 in the kernels, as in TF
        raise InvalidArgumentError("num_classes cannot exceed max int")


def _check_blank(blank_index, num_classes):
    if blank_index is None:
        return num_classes - 1
    if not isinstance(blank_index, numbers.Integral) or isinstance(blank_index, bool):
        raise TypeError(f"blank_index must be an int or None, got {type(blank_index).__name__}")
    b = int(blank_index)
    resolved = num_classes + b if b < 0 else b
    if not 0 <= resolved < num_classes:
        raise InvalidArgumentError(f"blank_index expected to be between {-num_classes} and "
                                   f"{num_classes - 1} but was {b}")
    return resolved


def _check_ctc_dtype(a):
    if a.dtype not in CTC_DTYPES:
        raise TypeError(f"inputs must be float32 or float64 logits, got {a.dtype}; "
                        "cast with .astype(np.float32)")


def ctc_greedy_decoder(inputs, sequence_length=None, merge_repeated=True, blank_index=None,
                       *, time_major=True, num_threads=None):
    """Greedy (best-path) CTC decoding, as ``tf.nn.ctc_greedy_decoder``.

    At every frame the argmax class is taken (the first one on ties; TF's
    ``RowMax``: a NaN counts only when it is the frame's first logit).  It is
    emitted unless it is the blank, or ``merge_repeated`` is set and it equals
    the previous frame's argmax (blank frames count as previous too), so
    ``A B B * B * B`` gives ``A B B B`` merged and ``A B B B B`` unmerged.

    Parameters
    ----------
    inputs : ndarray, torch.Tensor, DLPack producer or LoDTensor
        Logits, time-major ``[max_time, batch_size, num_classes]`` float32 or
        float64 (NumPy: CPU kernel; CuPy: GPU kernel; a PyTorch tensor or any
        ``__dlpack__`` producer is read in place, CPU -> CPU kernel, CUDA ->
        GPU kernel, and the results come back as the same kind of array),
        or ``[batch_size, max_time, num_classes]`` with ``time_major=False``
        (``LoDTensor.to_padded``'s layout, decoded in place).  Or a one-level
        LoDTensor ``data [total_frames, num_classes]`` holding one sequence
        per utterance, decoded without padding (same outputs as the padded
        form).
    sequence_length : array_like of int, shape [batch_size]
        Frames to decode per utterance (TF: int32; other integer types are
        accepted).  Required for padded inputs; leave it None for a LoDTensor,
        whose offsets give the lengths.  A negative length decodes nothing,
        as in TensorFlow.
    merge_repeated : bool, default True
        Merge consecutive repeats of the same class.
    blank_index : int, optional
        Class of the blank; default ``num_classes - 1``.  Negative values count
        from ``num_classes`` (``-1`` is the default).
    time_major : bool, default True
        False: padded ``inputs`` are batch-major ``[batch_size, max_time,
        num_classes]``; same outputs as ``inputs.transpose(1, 0, 2)`` with True.
    num_threads : int, optional
        Threads for the CPU kernel.  Default: ``readerlib.get_num_threads()``,
        fewer for small inputs (see ``readerlib.set_num_threads``).

    Returns
    -------
    decoded : list of one SparseTensor
        ``indices [N, 2]`` int64 rows ``[batch, position]``, ``values [N]``
        int64 classes, ``dense_shape [2]`` = ``[batch_size, max_decoded_length]``.
    neg_sum_logits : ndarray, shape [batch_size, 1]
        Minus the sum over each utterance's frames of the frame's max logit
        (blank frames included), accumulated in the input dtype in time order
        (bitwise TensorFlow's).

    Raises
    ------
    TypeError
        ``inputs`` not float32/float64, ``sequence_length`` not integer, a
        bad ``blank_index`` type, a LoDTensor with ``sequence_length``.
    InvalidArgumentError (a ValueError)
        With TensorFlow's messages: "inputs is not a 3-Tensor", "inputs must
        not be empty", "max_time is 0", "sequence_length is not a vector",
        "blank_index expected to be between -C and C-1 but was B".
    FailedPreconditionError (a ValueError)
        "len(sequence_length) != batch_size.  len(sequence_length):  L
        batch_size: B" and "sequence_length(b) <= max_time" (TF's wording:
        the condition that failed).

    Examples
    --------
    The example of TensorFlow's docstring, blank 1:

    >>> inf = np.inf
    >>> logits = np.array([[[0., -inf, -inf], [-2.3, -inf, -0.1]],
    ...                    [[-inf, -0.5, -inf], [-inf, -inf, -0.1]],
    ...                    [[-inf, -inf, -inf], [-0.1, -inf, -2.3]]], np.float32)
    >>> (decoded,), neg_sum = ctc_greedy_decoder(logits, [2, 3], blank_index=1)
    >>> decoded.to_dense().tolist(), neg_sum.ravel().tolist()
    ([[0, 0], [2, 0]], [0.5, 0.30000001192092896])
    """
    if type(inputs) is np.ndarray and (time_major is True or time_major is False):
        # The common case in one compiled call (validation included); None when
        # an argument needs a conversion or a message: then the full path below.
        r = _ctc.decode_fast(inputs, sequence_length, blank_index, merge_repeated,
                             num_threads, time_major)
        if r is not None:
            return [_sparse(r[0], r[1], r[2])], r[3]
    if isinstance(inputs, LoDTensor):
        return _ctc_lod(inputs, sequence_length, merge_repeated, blank_index, num_threads)
    if not isinstance(time_major, (bool, np.bool_)):
        raise TypeError(f"time_major must be True ([max_time, batch, classes]) or False "
                        f"([batch, max_time, classes]), got {time_major!r}")
    if _is_foreign(inputs) or _is_foreign(sequence_length):
        return _ctc_foreign(inputs, sequence_length, merge_repeated, blank_index,
                            bool(time_major), num_threads)
    if not time_major:
        inputs = _time_major_view(inputs)
    xp = _xp(inputs)
    on_gpu = is_cupy_array(inputs)
    if not hasattr(inputs, "dtype"):
        inputs = np.asarray(inputs, dtype=np.float32)
    _check_ctc_dtype(inputs)
    if sequence_length is None:
        raise TypeError("sequence_length is required for padded inputs "
                        "(it may be None only for a LoDTensor)")
    if not hasattr(sequence_length, "dtype"):
        sequence_length = xp.asarray(sequence_length)
        if sequence_length.size == 0:
            sequence_length = sequence_length.astype(np.int32)
    if sequence_length.dtype.kind not in "iu":
        raise TypeError(f"sequence_length must hold integers (int32), got {sequence_length.dtype}")
    # TensorFlow's checks, in TensorFlow's order.
    if inputs.ndim != 3:
        raise InvalidArgumentError("inputs is not a 3-Tensor")
    if inputs.size == 0:
        raise InvalidArgumentError("inputs must not be empty")
    max_time, batch_size, num_classes = (int(d) for d in inputs.shape)
    if max_time == 0:  # unreachable after the empty check; kept in TF's order
        raise InvalidArgumentError("max_time is 0")
    if sequence_length.ndim != 1:
        raise InvalidArgumentError("sequence_length is not a vector")
    if sequence_length.shape[0] != batch_size:
        raise FailedPreconditionError(
            "len(sequence_length) != batch_size.  len(sequence_length):  "
            f"{sequence_length.shape[0]} batch_size: {batch_size}")
    # compared in the caller's dtype, before any cast: a uint64 2**64 - 1 is
    # too long, not -1 (which would decode nothing), on either device
    if on_gpu and not is_cupy_array(sequence_length):
        sequence_length = xp.asarray(sequence_length)
    too_long = xp.flatnonzero(sequence_length > max_time)
    if too_long.size:
        raise FailedPreconditionError(f"sequence_length({int(too_long[0])}) <= {max_time}")
    _check_num_classes(num_classes)
    blank = _check_blank(blank_index, num_classes)
    # TF's loop runs 0 times for < 0; clamped before the int32 cast, which would
    # otherwise turn e.g. -2**32 + 5 into 5
    lengths = xp.maximum(sequence_length.astype(np.int64), 0).astype(np.int32)
    if on_gpu:
        from . import _gpu        # int32 lengths go as they are (the kernel treats < 0 as 0)
        return _gpu.ctc_greedy_decoder(inputs, sequence_length if sequence_length.dtype == np.int32
                                       else lengths, bool(merge_repeated), blank)
    indices, values, shape, neg = _ctc.decode_padded(
        np.ascontiguousarray(inputs), lengths, blank, bool(merge_repeated),
        _threads(num_threads, inputs.nbytes))
    return [SparseTensor(indices, values, shape)], neg


def _time_major_view(inputs):
    """``[B, T, V]`` logits as a ``[T, B, V]`` view, for the full path (copied to
    contiguous later; the compiled fast path reads ``[B, T, V]`` in place)."""
    if not hasattr(inputs, "ndim"):
        inputs = np.asarray(inputs, dtype=np.float32)
    if inputs.ndim != 3:
        raise InvalidArgumentError("inputs is not a 3-Tensor")
    inputs = inputs.transpose(1, 0, 2)
    return _xp(inputs).ascontiguousarray(inputs) if is_cupy_array(inputs) else inputs


def _ctc_foreign(inputs, sequence_length, merge_repeated, blank_index, time_major, num_threads):
    """ctc_greedy_decoder for torch tensors / DLPack producers: decoded in place
    (NumPy or CuPy view), every output array handed back as ``inputs``' kind."""
    x, wrap = _native(inputs, "inputs", detach=True)
    lengths, _ = _native(sequence_length, "sequence_length", detach=True)
    if is_cupy_array(x) and isinstance(lengths, np.ndarray):
        lengths = _xp(x).asarray(lengths)
    elif isinstance(x, np.ndarray) and is_cupy_array(lengths):
        lengths = lengths.get()
    if hasattr(x, "dtype") and x.dtype not in CTC_DTYPES:
        raise TypeError(f"inputs must be float32 or float64 logits, got {inputs.dtype}; "
                        "cast with .float() (torch) or .astype(np.float32)")
    (sp,), neg = ctc_greedy_decoder(x, lengths, merge_repeated, blank_index,
                                    time_major=time_major, num_threads=num_threads)
    indices, values, shape, neg = _wrap_all(wrap, sp.indices, sp.values, sp.dense_shape, neg)
    return [_sparse(indices, values, shape)], neg


def _ctc_lod(t, sequence_length, merge_repeated, blank_index, num_threads):
    if sequence_length is not None:
        raise TypeError("pass sequence_length=None with a LoDTensor: its offsets give the lengths")
    data, lod = t.validated()     # data / lod may have been changed after construction
    _check_ctc_dtype(data)
    if len(lod) != 1:
        raise ValueError(f"ctc_greedy_decoder needs a LoDTensor with one lod level (one sequence "
                         f"per utterance), got {len(lod)} levels")
    if data.ndim != 2:
        raise InvalidArgumentError(
            f"inputs is not a 2-Tensor [total_frames, num_classes] (LoDTensor data), "
            f"got shape {tuple(data.shape)}")
    offsets = lod[0]
    batch_size = offsets.shape[0] - 1
    num_classes = int(data.shape[1])
    # The padded form's checks: [max_len, batch, classes] empty <=> batch or classes 0.
    if batch_size == 0 or num_classes == 0:
        raise InvalidArgumentError("inputs must not be empty")
    if data.shape[0] == 0:
        raise InvalidArgumentError("max_time is 0")
    _check_num_classes(num_classes)
    blank = _check_blank(blank_index, num_classes)
    if is_cupy_array(data):
        from . import _gpu
        return _gpu.ctc_greedy_decoder_lod(data, offsets, bool(merge_repeated), blank)
    indices, values, shape, neg = _ctc.decode_lod(
        np.ascontiguousarray(data), np.ascontiguousarray(offsets, dtype=np.int64), blank,
        bool(merge_repeated), _threads(num_threads, data.nbytes))
    return [SparseTensor(indices, values, shape)], neg
