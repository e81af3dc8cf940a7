"""Dtypes and static shapes of graph tensors.

Tensor dtypes are NumPy dtypes.  Two graph-only kinds: :data:`resource`
(a reader variable; TensorFlow's ``DT_RESOURCE``) and :data:`string`
(``bytes`` values; ``DT_STRING``).  ``DataType`` numbers are TensorFlow's
(``types.proto``), so GraphDefs carry the same enum values.
"""
from __future__ import annotations

import numpy as np

__all__ = ["as_dtype", "resource", "string", "TensorShape", "as_shape",
           "datatype_enum", "dtype_from_enum", "tf_name"]

#: A reader variable (Paddle's ReaderHolder in a Variable); DT_RESOURCE.
resource = np.dtype(object)
#: Byte strings; DT_STRING.
string = np.dtype("S")

_ENUM = {
    np.dtype("float32"): 1, np.dtype("float64"): 2, np.dtype("int32"): 3, np.dtype("uint8"): 4,
    np.dtype("int16"): 5, np.dtype("int8"): 6, string: 7, np.dtype("complex64"): 8,
    np.dtype("int64"): 9, np.dtype("bool"): 10, np.dtype("uint16"): 17, np.dtype("complex128"): 18,
    np.dtype("float16"): 19, resource: 20, np.dtype("uint32"): 22, np.dtype("uint64"): 23,
}
_FROM_ENUM = {v: k for k, v in _ENUM.items()}
_TF_NAMES = {1: "float", 2: "double", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
             8: "complex64", 9: "int64", 10: "bool", 17: "uint16", 18: "complex128", 19: "half",
             20: "resource", 22: "uint32", 23: "uint64"}


def as_dtype(x):
    """A supported NumPy dtype from a dtype-like (``np.float32``, ``"int64"``, a dtype)."""
    if isinstance(x, np.dtype) and x in _ENUM:
        return x
    if x is bytes or x is str:
        return string
    if x is object:
        return resource
    dt = np.dtype(x)
    if dt.kind in "SU":
        return string
    if dt not in _ENUM:
        raise TypeError(f"dtype {dt} is not supported by readerlib.graph; use one of "
                        + ", ".join(str(d) for d in _ENUM if d.kind not in "OS"))
    return dt


def datatype_enum(dtype):
    """TensorFlow's DataType number of ``dtype``."""
    try:
        return _ENUM[as_dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no TensorFlow DataType") from None


def dtype_from_enum(e):
    """The dtype of TensorFlow's DataType number ``e``."""
    try:
        return _FROM_ENUM[int(e)]
    except KeyError:
        raise TypeError(f"TensorFlow DataType {e} is not supported by readerlib.graph") from None


def tf_name(dtype):
    """TensorFlow's short name of a dtype, as in its messages (``float``, ``int64``)."""
    return _TF_NAMES.get(_ENUM.get(dtype), str(dtype))


class TensorShape:
    """A static shape: a tuple of ints and ``None`` (unknown size), or unknown rank.

    Compares equal to another TensorShape or to a list/tuple of the same dims.
    """

    __slots__ = ("dims",)

    def __init__(self, dims):
        if dims is None:
            self.dims = None
        else:
            out = []
            for d in dims:
                if d is None or (isinstance(d, (int, np.integer)) and d < 0):
                    out.append(None)
                else:
                    out.append(int(d))
            self.dims = tuple(out)

    @property
    def rank(self):
        return None if self.dims is None else len(self.dims)

    ndims = rank

    def as_list(self):
        if self.dims is None:
            raise ValueError("as_list() is not defined on an unknown TensorShape.")
        return list(self.dims)

    def is_fully_defined(self):
        return self.dims is not None and None not in self.dims

    def is_compatible_with(self, other):
        other = as_shape(other)
        if self.dims is None or other.dims is None:
            return True
        if len(self.dims) != len(other.dims):
            return False
        return all(a is None or b is None or a == b for a, b in zip(self.dims, other.dims))

    def __len__(self):
        if self.dims is None:
            raise ValueError("Cannot take the length of shape with unknown rank.")
        return len(self.dims)

    def __iter__(self):
        if self.dims is None:
            raise ValueError("Cannot iterate over a shape with unknown rank.")
        return iter(self.dims)

    def __getitem__(self, i):
        return self.dims[i]

    def __eq__(self, other):
        if isinstance(other, (list, tuple)):
            other = TensorShape(other)
        if not isinstance(other, TensorShape):
            return NotImplemented
        return self.dims == other.dims

    def __hash__(self):
        return hash(self.dims)

    def __str__(self):
        if self.dims is None:
            return "<unknown>"
        if len(self.dims) == 1:
            return f"({self.dims[0]},)"
        return "(" + ", ".join(str(d) for d in self.dims) + ")"

    def __repr__(self):
        return "TensorShape(None)" if self.dims is None else f"TensorShape({list(self.dims)})"

    def tf_string(self):
        """TensorFlow's form in messages: ``[2]``, ``[?,2]``, ``<unknown>``."""
        if self.dims is None:
            return "<unknown>"
        return "[" + ",".join("?" if d is None else str(d) for d in self.dims) + "]"


def as_shape(x):
    """A TensorShape from a TensorShape, a list/tuple of dims, or None (unknown rank)."""
    if isinstance(x, TensorShape):
        return x
    return TensorShape(x)


def broadcast_shape(a, b):
    """Static NumPy broadcasting of two TensorShapes (unknown where it cannot be told)."""
    if a.dims is None or b.dims is None:
        return TensorShape(None)
    x, y = list(a.dims), list(b.dims)
    n = max(len(x), len(y))
    x = [1] * (n - len(x)) + x
    y = [1] * (n - len(y)) + y
    out = []
    for p, q in zip(x, y):
        if p == 1:
            out.append(q)
        elif q == 1:
            out.append(p)
        elif p is None or q is None:
            out.append(p if q is None else q)
        elif p == q:
            out.append(p)
        else:
            raise ValueError(f"Dimensions must be equal, but are {p} and {q} for shapes "
                             f"{a.tf_string()} and {b.tf_string()}")
    return TensorShape(out)
