"""Basic ops with TensorFlow's op types and default names: Const, Placeholder,
Identity, AddV2 (named ``Add``), NoOp, OnesLike, AddN."""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from . import dtypes as _dt
from .ops import Operation, Tensor, get_default_graph
from .registry import register_op

__all__ = ["constant", "placeholder", "identity", "add", "no_op", "ones_like", "add_n",
           "convert_to_tensor", "apply_op"]


def _graph_of(values):
    for v in values:
        if isinstance(v, (Tensor, Operation)):
            return v.graph
    return get_default_graph()


def convert_to_tensor(value, dtype=None, name=None):
    """``value`` itself when a Tensor (its dtype checked against ``dtype``), else a Const."""
    if isinstance(value, Tensor):
        if dtype is not None and value.dtype != _dt.as_dtype(dtype):
            raise ValueError(f"Tensor conversion requested dtype {_dt.as_dtype(dtype)} for Tensor "
                             f"with dtype {value.dtype}: {value}")
        return value
    if isinstance(value, Operation):
        raise TypeError(f"Can not convert an Operation into a Tensor: {value!r}")
    return constant(value, dtype=dtype, name=name or "Const")


def apply_op(op_type, inputs=(), attrs=None, name=None, default_name=None, input_names=None):
    """Create one op the way TF's generated wrappers do: inside ``name_scope(name or
    default_name)``, non-Tensor inputs converted to Consts named after the input
    (``Add/y``) with the dtype of the type attr already inferred.  Returns the Operation."""
    from .registry import get_op_type
    spec = get_op_type(op_type)
    g = _graph_of(list(inputs))
    with g.as_default(), g.name_scope(name or default_name or op_type) as scope:
        specs = spec.inputs if spec is not None else []
        specs = [specs[i] if i < len(specs) else (f"input_{i}", None) for i in range(len(inputs))]
        # type attrs that Tensor inputs fix; other inputs are converted to them (TF converts
        # in order: readerlib also accepts a Python value before the Tensor, as in add(1, x))
        known = dict(attrs or {})
        for (_, tspec), x in zip(specs, inputs):
            if isinstance(tspec, str) and isinstance(x, Tensor) and known.get(tspec) is None:
                known[tspec] = x.dtype
        tensors = []
        for i, ((iname, tspec), x) in enumerate(zip(specs, inputs)):
            if not isinstance(x, Tensor):
                want = known.get(tspec) if isinstance(tspec, str) else tspec
                x = constant(x, dtype=want, name=input_names[i] if input_names else iname)
                if isinstance(tspec, str) and known.get(tspec) is None:
                    known[tspec] = x.dtype
            tensors.append(x)
        return g.create_op(op_type, tensors, name=scope, attrs=attrs)


# -- Const --------------------------------------------------------------------------------

def _const_value(value, dtype):
    if dtype is not None:
        dtype = _dt.as_dtype(dtype)
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        if arr.dtype.kind == "U":
            arr = arr.astype("S")
        if dtype is not None and arr.dtype != dtype:
            _check_cast(arr, dtype, value)
            arr = arr.astype(dtype)
        return arr
    if isinstance(value, str):
        value = value.encode()
    arr = np.asarray(value)
    if arr.dtype.kind == "U":
        arr = np.asarray(value, dtype="S")
    if arr.dtype == object:
        raise TypeError(f"Can not convert {value!r} to a constant: ragged or mixed values")
    if dtype is not None:
        _check_cast(arr, dtype, value)
        return arr.astype(dtype)
    if arr.dtype.kind == "f":
        return arr.astype(np.float32)
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            return arr.astype(np.int64)
        return arr.astype(np.int32)
    if arr.dtype.kind == "c":
        return arr.astype(np.complex128)
    return arr


def _check_cast(arr, dtype, value):
    if dtype.kind in "iub" and arr.dtype.kind == "f" and arr.size \
            and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
        raise TypeError(f"Expected {dtype}, but got {value!r} of type '{type(value).__name__}'.")
    if dtype.kind in "iu" and arr.dtype.kind in "iu" and arr.size:
        info = np.iinfo(dtype)
        if arr.min() < info.min or arr.max() > info.max:
            raise TypeError(f"Expected {dtype}, but got {value!r} of type "
                            f"'{type(value).__name__}' (out of range).")


def constant(value, dtype=None, shape=None, name="Const"):
    """A Const op holding ``value``; returns its Tensor.

    dtype inference as TensorFlow: Python int -> int32 (int64 if it does not
    fit), float -> float32, bool -> bool, str/bytes -> string; NumPy values
    keep their dtype.  ``shape`` broadcasts a scalar (or reshapes).
    """
    arr = _const_value(value, dtype)
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        arr = np.broadcast_to(arr, shape) if arr.size == 1 or arr.shape == () else arr.reshape(shape)
    arr = np.array(arr, copy=True)
    arr.setflags(write=False)
    g = get_default_graph()
    op = g.create_op("Const", [], attrs={"value": arr, "dtype": arr.dtype}, name=name)
    return op.outputs[0]


def _const_kernel(ctx, inputs):
    return (ctx.attrs["value"],)


def _const_infer(inputs, attrs):
    v = attrs["value"]
    return [(v.dtype, v.shape)]


register_op("Const", outputs=[("output", "dtype")], attrs={"value": ("tensor", None),
                                                          "dtype": ("type", None)},
            infer=_const_infer, constant_per_session=True,
            kernels={"CPU": _const_kernel, "GPU": _const_kernel})


# -- Placeholder ------------------------------------------------------------------------

def placeholder(dtype, shape=None, name=None):
    """A value fed at ``Session.run`` (``feed_dict``); running it unfed raises
    InvalidArgumentError.  ``shape`` None: any shape; ``None`` dims: any size."""
    attrs = {"dtype": _dt.as_dtype(dtype), "shape": _dt.as_shape(shape)}
    return apply_op("Placeholder", [], attrs, name, "Placeholder").outputs[0]


def _placeholder_kernel(ctx, inputs):
    op = ctx.op
    dtype, shape = ctx.attrs["dtype"], ctx.attrs["shape"]
    raise InvalidArgumentError(
        None, op, f"You must feed a value for placeholder tensor '{op.name}' with dtype "
                  f"{_dt.tf_name(dtype)}" + ("" if shape.dims is None else
                                             f" and shape {shape.tf_string()}"))


register_op("Placeholder", outputs=[("output", "dtype")],
            attrs={"dtype": ("type", None), "shape": ("shape", _dt.TensorShape(None))},
            infer=lambda inputs, attrs: [(attrs["dtype"], attrs["shape"])],
            kernels={"CPU": _placeholder_kernel, "GPU": _placeholder_kernel})


# -- Identity / AddV2 / NoOp / OnesLike / AddN ---------------------------------------------

def _same_as_input(inputs, attrs):
    return [(inputs[0].dtype, inputs[0].shape)]


def _identity_kernel(ctx, inputs):
    return inputs


register_op("Identity", inputs=[("input", "T")], outputs=[("output", "T")],
            attrs={"T": ("type", None)}, infer=_same_as_input,
            kernels={"CPU": _identity_kernel, "GPU": _identity_kernel})


def identity(input, name=None):  # noqa: A002 - TF's argument name
    """A tensor with the same value (op type ``Identity``)."""
    return apply_op("Identity", [input], None, name, "Identity").outputs[0]


def _add_infer(inputs, attrs):
    return [(inputs[0].dtype, _dt.broadcast_shape(inputs[0].shape, inputs[1].shape))]


def _add_kernel(ctx, inputs):
    return (np.add(inputs[0], inputs[1]),)


register_op("AddV2", inputs=[("x", "T"), ("y", "T")], outputs=[("z", "T")],
            attrs={"T": ("type", None)}, infer=_add_infer,
            kernels={"CPU": _add_kernel})


def add(x, y, name=None):
    """``x + y`` with broadcasting (op type ``AddV2``, default name ``Add``)."""
    return apply_op("AddV2", [x, y], None, name, "Add").outputs[0]


register_op("NoOp", kernels={"CPU": lambda ctx, inputs: (), "GPU": lambda ctx, inputs: ()})


def no_op(name=None):
    """An op that does nothing (a target for control dependencies)."""
    return apply_op("NoOp", [], None, name, "NoOp")


register_op("OnesLike", inputs=[("x", "T")], outputs=[("y", "T")], attrs={"T": ("type", None)},
            infer=_same_as_input,
            kernels={"CPU": lambda ctx, inputs: (np.ones_like(np.asarray(inputs[0])),)})


def ones_like(x, name=None):
    return apply_op("OnesLike", [x], None, name, "ones_like").outputs[0]


def add_n(inputs, name=None):
    """Sum of same-shape tensors (pairwise ``AddV2`` in list order; deterministic)."""
    inputs = list(inputs)
    if not inputs:
        raise ValueError("add_n needs at least one input")
    if len(inputs) == 1:
        return inputs[0]
    g = _graph_of(inputs)
    with g.as_default(), g.name_scope(name or "AddN"):
        acc = inputs[0]
        for t in inputs[1:]:
            acc = add(acc, t)
    return acc
