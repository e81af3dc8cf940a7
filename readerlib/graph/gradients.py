"""Symbolic gradients: ``gradients(ys, xs, grad_ys=None)`` over a gradient registry.

Design (TensorFlow's ``gradients_util``): the ops between ``xs`` and ``ys``
(reachable forward from ``xs`` along data edges and backward from ``ys``)
are visited in reverse creation order; each one's output gradients are
summed (pairwise ``Add`` in the order they were made, so the graph is
deterministic), and its gradient function -- looked up by the op's
``_gradient_op_type`` attr (set by ``Graph.gradient_override_map``) or else
its type -- builds the input gradients under ``<scope>/<op>_grad``.  All of
this happens at build time; the result is more ops.  Registered here:
``Identity``, ``AddV2`` (summed over broadcast dimensions), ``BatchReindex``
(-> ``BatchReindexGrad``, deterministic) and ``BatchReindexGrad``
(-> ``BatchReindex``).
"""
from __future__ import annotations

import threading
import traceback

import numpy as np

from .array_ops import add, apply_op
from .kernel_ops import batch_reindex, batch_reindex_grad, row_count
from .ops import Tensor
from .registry import register_op

__all__ = ["gradients", "RegisterGradient", "NotDifferentiable", "get_gradient_function"]

_lock = threading.Lock()
_gradients = {}           # name -> (fn, where it was registered)


class RegisterGradient:
    """Decorator registering ``fn(op, *output_grads) -> [grad per input]`` under a
    global unique name (an op type, or a name for ``gradient_override_map``).

    Raises
    ------
    TypeError
        ``op_type`` is not a string.
    KeyError
        The name is registered already.
    """

    def __init__(self, op_type):
        if not isinstance(op_type, str):
            raise TypeError("op_type must be a string")
        self._op_type = op_type

    def __call__(self, fn):
        where = traceback.extract_stack(limit=2)[0]
        with _lock:
            if self._op_type in _gradients:
                prev = _gradients[self._op_type][1]
                raise KeyError(f"Registering two gradient with name '{self._op_type}'! "
                               f"(Previous registration was in {prev})")
            _gradients[self._op_type] = (fn, f"{where.name} {where.filename}:{where.lineno}")
        return fn


def NotDifferentiable(op_type):  # noqa: N802 - TF's name
    """Declare that ops of ``op_type`` have no gradient (their inputs get None)."""
    if not isinstance(op_type, str):
        raise TypeError("op_type must be a string")
    with _lock:
        _gradients[op_type] = (None, "NotDifferentiable")


def get_gradient_function(op):
    """The gradient function of ``op`` (None if not differentiable).

    Raises
    ------
    LookupError
        No gradient is registered for its type (or its override name).
    """
    name = op._attrs.get("_gradient_op_type")
    name = name.decode() if isinstance(name, bytes) else op.type
    entry = _gradients.get(name)
    if entry is None:
        raise LookupError(
            f"No gradient defined for operation'{op.name}' (op type: {op.type}). In general "
            "every operation must have an associated `@RegisterGradient` for correct autodiff, "
            "which this op is lacking.")
    return entry[0]


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _sum(grads):
    grads = [g for g in grads if g is not None]
    if not grads:
        return None
    acc = grads[0]
    for g in grads[1:]:
        acc = add(acc, g)
    return acc


def gradients(ys, xs, grad_ys=None, name="gradients"):
    """Symbolic derivatives of ``sum(ys)`` with respect to each of ``xs``.

    Parameters
    ----------
    ys, xs : Tensor or list of Tensor
    grad_ys : list of Tensor (or values), optional
        Initial gradients of ``ys``; default ones.

    Returns
    -------
    list
        One Tensor per ``x``, or None where ``x`` does not reach ``ys``.

    Raises
    ------
    LookupError
        An op on the path has no registered gradient.
    ValueError
        A gradient function returned the wrong number of gradients.
    """
    ys, xs = _as_list(ys), _as_list(xs)
    for t in ys + xs:
        if not isinstance(t, Tensor):
            raise TypeError(f"gradients: ys and xs must be Tensors, got {t!r}")
    g = ys[0].graph
    if grad_ys is None:
        grad_ys = [None] * len(ys)
    grad_ys = _as_list(grad_ys)
    if len(grad_ys) != len(ys):
        raise ValueError(f"Passed {len(grad_ys)} grad_ys for {len(ys)} ys")
    with g.as_default(), g.name_scope(name):
        # ops reachable forward from xs
        consumers = {}
        for op in g.get_operations():
            for t in op._inputs:
                consumers.setdefault(t._op, []).append(op)
        reached, stack = set(), [x._op for x in xs]
        while stack:
            op = stack.pop()
            if op in reached:
                continue
            reached.add(op)
            stack.extend(consumers.get(op, ()))
        # ... and backward from ys
        between, stack = set(), [y._op for y in ys]
        while stack:
            op = stack.pop()
            if op in between or op not in reached:
                continue
            between.add(op)
            stack.extend(t._op for t in op._inputs)
        grads = {}
        for i, (y, gy) in enumerate(zip(ys, grad_ys)):
            if gy is None:
                gy = apply_op("OnesLike", [y], None, f"grad_ys_{i}").outputs[0]
            elif not isinstance(gy, Tensor):
                from .array_ops import constant
                gy = constant(gy, dtype=y.dtype, name=f"grad_ys_{i}")
            grads.setdefault(y, []).append(gy)
        for op in sorted(between, key=lambda o: o._id, reverse=True):
            if not op._inputs:
                continue
            out_grads = [_sum(grads.get(t, ())) for t in op._outputs]
            if all(gr is None for gr in out_grads):
                continue
            fn = get_gradient_function(op)
            if fn is None:
                continue
            with g.name_scope(op.name + "_grad"):
                out_grads = [gr if gr is not None else
                             apply_op("ZerosLike", [t], None, "zeros_like").outputs[0]
                             for gr, t in zip(out_grads, op._outputs)]
                in_grads = fn(op, *out_grads)
            in_grads = _as_list(in_grads)
            if len(in_grads) != len(op._inputs):
                raise ValueError(f"Num gradients {len(in_grads)} generated for op {op.node_def} "
                                 f"do not match num inputs {len(op._inputs)}")
            for t, gr in zip(op._inputs, in_grads):
                if gr is not None:
                    grads.setdefault(t, []).append(gr)
        return [_sum(grads.get(x, ())) for x in xs]


# -- helper ops ------------------------------------------------------------------------------

register_op("ZerosLike", inputs=[("x", "T")], outputs=[("y", "T")], attrs={"T": ("type", None)},
            infer=lambda inputs, attrs: [(inputs[0].dtype, inputs[0].shape)],
            kernels={"CPU": lambda ctx, inputs: (np.zeros_like(np.asarray(inputs[0])),)})


def _sum_to_shape_kernel(ctx, inputs):
    grad, like = np.asarray(inputs[0]), np.asarray(inputs[1])
    lead = grad.ndim - like.ndim
    if lead:
        grad = grad.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, d in enumerate(like.shape) if d == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return (grad.astype(like.dtype, copy=False),)


register_op("SumToShapeOf", inputs=[("grad", "T"), ("like", "T")], outputs=[("y", "T")],
            attrs={"T": ("type", None)},
            infer=lambda inputs, attrs: [(inputs[0].dtype, inputs[1].shape)],
            kernels={"CPU": _sum_to_shape_kernel})


def _sum_to_shape_of(grad, x):
    if grad.shape.is_fully_defined() and x.shape.is_fully_defined() and \
            grad.shape.dims == x.shape.dims:
        return grad
    return apply_op("SumToShapeOf", [grad, x], None, "SumToShapeOf").outputs[0]


# -- registered gradients -----------------------------------------------------------------------

@RegisterGradient("Identity")
def _identity_grad(op, grad):
    return [grad]


@RegisterGradient("AddV2")
def _add_grad(op, grad):
    x, y = op.inputs
    return [_sum_to_shape_of(grad, x), _sum_to_shape_of(grad, y)]


@RegisterGradient("BatchReindex")
def _batch_reindex_grad(op, grad):
    x, idx = op.inputs
    return [batch_reindex_grad(grad, idx, row_count(x)), None]


@RegisterGradient("BatchReindexGrad")
def _batch_reindex_grad_grad(op, grad):
    dy, idx, n = op.inputs
    return [batch_reindex(grad, idx), None, None]


for _t in ("Const", "Placeholder", "OnesLike", "ZerosLike", "RowCount", "Read", "NoOp",
           "CreateRecordIOReader", "CreateTFRecordReader", "CreateShuffleReader",
           "CreateBatchReader", "CreateMultiPassReader", "CreatePrefetchReader", "ResetReader",
           "CTCGreedyDecoder", "RNNTGreedyDecode"):
    NotDifferentiable(_t)

