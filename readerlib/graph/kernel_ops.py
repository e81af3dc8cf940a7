"""readerlib's kernels as graph ops: BatchReindex, BatchReindexGrad,
CTCGreedyDecoder (TF's raw op: one op, four outputs), RNNTGreedyDecode.

Each op's CPU kernel is the eager function (the Cython kernel), so results
equal the eager ones bit for bit; its GPU kernel moves the inputs to the
device with CuPy and calls the same function, which dispatches to the CuPy
RawKernels.  Placement (``rg.device("/device:GPU:0")``) picks the kernel at
``Session.run``.
"""
from __future__ import annotations

import numpy as np

from .. import kernels as _k
from ..errors import FailedPreconditionError
from ..tensor import LoDTensor
from .array_ops import apply_op
from .registry import register_op

__all__ = ["batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder", "rnnt_greedy_decode",
           "row_count"]


def _to_gpu(v):
    from ..gpu import require_cupy
    cp = require_cupy()
    if isinstance(v, LoDTensor):
        return v.to("cuda")
    return cp.asarray(v)


def _gpu(kernel):
    """The GPU form of a CPU kernel: inputs moved to the device first."""
    def run(ctx, inputs):
        return kernel(ctx, [_to_gpu(x) for x in inputs])
    return run


# -- BatchReindex ------------------------------------------------------------------------

def _reindex_infer(inputs, attrs):
    x = inputs[0]
    dims = None if x.shape.dims is None else (None,) + x.shape.dims[1:]
    return [(x.dtype, dims)]


def _reindex_kernel(ctx, inputs):
    return (_k.batch_reindex(inputs[0], inputs[1]),)


register_op("BatchReindex", inputs=[("x", "T"), ("indices", "Tidx")], outputs=[("y", "T")],
            attrs={"T": ("type", None), "Tidx": ("type", np.dtype(np.int64))},
            infer=_reindex_infer,
            kernels={"CPU": _reindex_kernel, "GPU": _gpu(_reindex_kernel)})


def batch_reindex(x, idx, name=None):
    """``y[n] = x[idx[n]]`` (Caffe's BatchReindex; op type ``BatchReindex``).

    A LoD value of ``x`` (a LoD field read from a reader) reindexes whole
    sequences.  Its gradient is ``BatchReindexGrad`` (deterministic).
    """
    return apply_op("BatchReindex", [x, idx], None, name, "BatchReindex",
                    input_names=["x", "indices"]).outputs[0]


def _reindex_grad_infer(inputs, attrs):
    dy = inputs[0]
    dims = None if dy.shape.dims is None else (None,) + dy.shape.dims[1:]
    return [(dy.dtype, dims)]


def _reindex_grad_kernel(ctx, inputs):
    dy, idx, n = inputs
    return (_k.batch_reindex_grad(dy, idx, int(np.asarray(n))),)


register_op("BatchReindexGrad", inputs=[("dy", "T"), ("indices", "Tidx"), ("num_rows", "Tn")],
            outputs=[("dx", "T")],
            attrs={"T": ("type", None), "Tidx": ("type", np.dtype(np.int64)),
                   "Tn": ("type", np.dtype(np.int64))},
            infer=_reindex_grad_infer,
            kernels={"CPU": _reindex_grad_kernel,
                     "GPU": lambda ctx, inputs: _reindex_grad_kernel(
                         ctx, [_to_gpu(inputs[0]), _to_gpu(inputs[1]), inputs[2]])})


def batch_reindex_grad(dy, idx, num_rows, name=None):
    """``dx[k] = sum(dy[n] for idx[n] == k)``, ``num_rows`` rows (op ``BatchReindexGrad``)."""
    return apply_op("BatchReindexGrad", [dy, idx, num_rows], None, name, "BatchReindexGrad",
                    input_names=["dy", "indices", "num_rows"]).outputs[0]


register_op("RowCount", inputs=[("x", "T")], outputs=[("n", np.int64)],
            attrs={"T": ("type", None)},
            infer=lambda inputs, attrs: [(np.int64, ())],
            kernels={"CPU": lambda ctx, inputs: (np.int64(
                len(inputs[0].data) if isinstance(inputs[0], LoDTensor) else inputs[0].shape[0]),)})


def row_count(x, name=None):
    """The number of rows of ``x`` (its first dimension) as an int64 scalar."""
    return apply_op("RowCount", [x], None, name, "RowCount").outputs[0]


# -- CTCGreedyDecoder ----------------------------------------------------------------------

def _ctc_infer(inputs, attrs):
    logits = inputs[0]
    b = None if logits.shape.dims is None or len(logits.shape.dims) < 2 else logits.shape.dims[1]
    i64 = np.dtype(np.int64)
    return [(i64, (None, 2)), (i64, (None,)), (i64, (2,)), (logits.dtype, (b, 1))]


def _ctc_kernel(ctx, inputs):
    a = ctx.attrs
    (sp,), neg = _k.ctc_greedy_decoder(inputs[0], inputs[1], a["merge_repeated"], a["blank_index"])
    return (sp.indices, sp.values, sp.dense_shape, neg)


register_op("CTCGreedyDecoder", inputs=[("inputs", "T"), ("sequence_length", np.int32)],
            outputs=[("decoded_indices", np.int64), ("decoded_values", np.int64),
                     ("decoded_shape", np.int64), ("log_probability", "T")],
            attrs={"merge_repeated": ("bool", False), "blank_index": ("int", -1),
                   "T": ("type", np.dtype(np.float32))},
            infer=_ctc_infer, kernels={"CPU": _ctc_kernel, "GPU": _gpu(_ctc_kernel)})


def ctc_greedy_decoder(logits, seq_len, merge_repeated=True, blank_index=None, name=None):
    """Greedy CTC decoding as one ``CTCGreedyDecoder`` op with TF's raw op's four outputs.

    Returns
    -------
    (decoded_indices, decoded_values, decoded_shape, log_probability)
        int64 ``[N, 2]``, int64 ``[N]``, int64 ``[2]`` and ``[B, 1]`` in the
        logits' dtype (minus the sum of each frame's max logit), equal to
        :func:`readerlib.ctc_greedy_decoder`'s bit for bit.
    """
    attrs = {"merge_repeated": bool(merge_repeated),
             "blank_index": -1 if blank_index is None else int(blank_index)}
    if not hasattr(seq_len, "op"):
        seq_len = np.asarray(seq_len, dtype=np.int32)
    op = apply_op("CTCGreedyDecoder", [logits, seq_len], attrs, name, "CTCGreedyDecoder",
                  input_names=["inputs", "sequence_length"])
    return tuple(op.outputs)


# -- RNN-T greedy decoding ---------------------------------------------------------------------

def _rnnt_infer(inputs, attrs):
    return [(np.int64, (None,)), (np.int64, (None,)), (np.float32, (None,))]


def _rnnt_kernel(ctx, inputs):
    from ..rnnt import rnnt_greedy_decode as decode
    model = ctx.attrs.get("_py_model")
    if model is None:
        raise FailedPreconditionError(
            None, ctx.op, f"RNNTGreedyDecode '{ctx.op.name}' has no model attached (a model is a "
                          "Python object and does not travel in a GraphDef); build the op with "
                          "rg.rnnt_greedy_decode(model, ...)")
    enc, lengths = inputs
    if isinstance(enc, LoDTensor) or ctx.attrs.get("_py_no_lengths"):
        lengths = None
    max_symbols = ctx.attrs["max_symbols"]
    hyps = decode(model, enc, lengths, max_symbols=None if max_symbols <= 0 else max_symbols,
                  algorithm=ctx.attrs["algorithm"].decode())
    offsets = np.zeros(len(hyps) + 1, np.int64)
    np.cumsum([len(h) for h in hyps], out=offsets[1:])
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa
    labels = LoDTensor(cat([np.asarray(h.y_sequence) for h in hyps]), [offsets])
    times = LoDTensor(cat([np.asarray(h.timestamps) for h in hyps]), [offsets])
    scores = np.array([h.score for h in hyps], np.float32)
    return (labels, times, scores)


register_op("RNNTGreedyDecode", inputs=[("encoder_output", "T"), ("encoder_lengths", "Tlen")],
            outputs=[("labels", np.int64), ("timestamps", np.int64), ("scores", np.float32)],
            attrs={"T": ("type", None), "Tlen": ("type", np.dtype(np.int64)),
                   "max_symbols": ("int", 10), "algorithm": ("string", b"loop_labels")},
            infer=_rnnt_infer, kernels={"CPU": _rnnt_kernel})


def rnnt_greedy_decode(model, encoder_output, encoder_lengths=None, max_symbols=10,
                       algorithm="loop_labels", name=None):
    """Greedy RNN-T decoding over ``model`` as one ``RNNTGreedyDecode`` op.

    Returns
    -------
    (labels, timestamps, scores)
        ``labels`` and ``timestamps`` fetch as LoDTensors (one sequence per
        utterance), ``scores`` as float32 ``[B]``: the fields of
        :func:`readerlib.rnnt_greedy_decode`'s Hypotheses.  ``model`` is kept
        on the op (attr ``_py_model``; not serialised into GraphDefs).
    """
    if encoder_lengths is None:
        encoder_lengths = np.zeros(0, np.int64)
        lengths_given = False
    else:
        lengths_given = True
    attrs = {"_py_model": model, "max_symbols": 0 if max_symbols is None else int(max_symbols),
             "algorithm": algorithm}
    if not lengths_given:
        attrs["_py_no_lengths"] = True
    op = apply_op("RNNTGreedyDecode", [encoder_output, encoder_lengths], attrs, name,
                  "RNNTGreedyDecode", input_names=["encoder_output", "encoder_lengths"])
    return tuple(op.outputs)
