"""Data model: Field, Schema, LoDTensor, SparseTensor.

A *batch* is one :class:`LoDTensor` per field.  ``data`` holds every
instance's rows stacked along dim 0; ``lod`` is a list of int64 offset arrays
(Paddle's level-of-detail).  Fixed-shape fields batch to ``[B, *shape]`` with
an empty ``lod``; a ``lod_level=1`` field batches to ``[sum(len_i), *shape]``
with ``lod == [offsets]`` where ``offsets[0] == 0`` and
``offsets[-1] == len(data)``.

Arrays are NumPy on the CPU and CuPy on the GPU; both hand over to PyTorch or
JAX through DLPack without a copy.
"""
from __future__ import annotations

import contextlib
import json
import math
import numbers

import numpy as np

__all__ = ["Field", "Schema", "LoDTensor", "SparseTensor", "SUPPORTED_DTYPES"]

_MAX_ROW_BYTES = (1 << 63) - 1          # compiled readers hold row sizes in int64

#: dtypes a Field may carry (what RecordIO stores byte-exactly).
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "float16", "float32", "float64"))


from .gpu import array_module as _array_module  # noqa: E402


class Field:
    """One named slot of an instance.

    Parameters
    ----------
    name : str
        Unique within a schema.
    dtype : numpy dtype-like
        One of :data:`SUPPORTED_DTYPES`.
    shape : tuple of int, optional
        The fixed shape of one value (``lod_level=0``) or of one step of a
        sequence (``lod_level=1``).  ``()`` is a scalar.
    lod_level : {0, 1}
        1 when the first dimension varies per instance (a sequence).

    Raises
    ------
    TypeError, ValueError
        For a bad name, dtype, shape or lod level.

    Examples
    --------
    >>> Field("feats", "float32", (80,), lod_level=1)
    Field('feats', 'float32', (80,), lod_level=1)
    """

    __slots__ = ("name", "dtype", "shape", "lod_level")

    def __init__(self, name, dtype, shape=(), lod_level=0):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Field name must be a non-empty str, got {name!r}")
        try:
            dt = np.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"Field {name!r}: dtype {dtype!r} is not a NumPy dtype") from e
        if dt.newbyteorder("=") not in SUPPORTED_DTYPES or dt.byteorder == ">":
            raise TypeError(
                f"Field {name!r}: dtype {dt} is not supported; use one of "
                + ", ".join(str(d) for d in SUPPORTED_DTYPES))
        if isinstance(shape, numbers.Integral):
            shape = (shape,)
        try:
            shape = tuple(shape)
        except TypeError:
            raise TypeError(f"Field {name!r}: shape must be a tuple of ints, got {shape!r}") from None
        for d in shape:
            if not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 0:
                raise ValueError(f"Field {name!r}: shape {shape!r} must hold non-negative ints")
        if lod_level not in (0, 1) or isinstance(lod_level, bool):
            raise ValueError(
                f"Field {name!r}: lod_level must be 0 (fixed shape) or 1 (sequence), got {lod_level!r}")
        shape = tuple(int(d) for d in shape)
        # compiled readers keep row sizes in int64: a shape whose row does not
        # fit is an error here, not a size that wrapped around later
        if math.prod(shape) * dt.itemsize > _MAX_ROW_BYTES:
            raise ValueError(
                f"Field {name!r}: shape {shape!r} of {dt} is {math.prod(shape) * dt.itemsize} bytes "
                f"per {'step' if lod_level else 'value'}, more than the 2**63 - 1 a row may have")
        self.name = name
        self.dtype = dt.newbyteorder("=")
        self.shape = shape
        self.lod_level = int(lod_level)

    @property
    def row_elems(self):
        """Elements in one value (lod 0) or in one step of a sequence (lod 1)."""
        return math.prod(self.shape)

    @property
    def row_bytes(self):
        return self.row_elems * self.dtype.itemsize

    def to_dict(self):
        return {"name": self.name, "dtype": self.dtype.str.lstrip("<>=|"),
                "shape": list(self.shape), "lod_level": self.lod_level}

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d.get("lod_level", 0))

    def __eq__(self, other):
        return (isinstance(other, Field) and self.name == other.name and self.dtype == other.dtype
                and self.shape == other.shape and self.lod_level == other.lod_level)

    def __hash__(self):
        return hash((self.name, self.dtype.str, self.shape, self.lod_level))

    def __repr__(self):
        lod = f", lod_level={self.lod_level}" if self.lod_level else ""
        return f"Field({self.name!r}, {str(self.dtype)!r}, {self.shape!r}{lod})"


class Schema:
    """An ordered list of :class:`Field` with unique names.

    Examples
    --------
    >>> s = Schema([Field("x", "float32", (3,)), Field("y", "int64")])
    >>> s.names
    ('x', 'y')
    """

    __slots__ = ("fields", "_index")

    def __init__(self, fields):
        if isinstance(fields, Schema):
            fields = fields.fields
        try:
            fields = tuple(fields)
        except TypeError:
            raise TypeError(f"Schema takes a list of Field, got {type(fields).__name__}") from None
        if not fields:
            raise ValueError("Schema needs at least one Field")
        for f in fields:
            if not isinstance(f, Field):
                raise TypeError(f"Schema takes Field objects, got {f!r}")
        names = [f.name for f in fields]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Schema field names must be unique; repeated: {dup}")
        self.fields = fields
        self._index = {f.name: i for i, f in enumerate(fields)}

    @property
    def names(self):
        return tuple(f.name for f in self.fields)

    def index(self, name):
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no field named {name!r}; fields are {list(self.names)}") from None

    def __len__(self):
        return len(self.fields)

    def __iter__(self):
        return iter(self.fields)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.fields[self.index(key)]
        return self.fields[key]

    def __eq__(self, other):
        return isinstance(other, Schema) and self.fields == other.fields

    def __hash__(self):
        return hash(self.fields)

    def __repr__(self):
        return "Schema([" + ", ".join(repr(f) for f in self.fields) + "])"

    def to_json(self):
        return json.dumps({"fields": [f.to_dict() for f in self.fields]}, sort_keys=True)

    @classmethod
    def from_json(cls, text):
        d = json.loads(text)
        return cls([Field.from_dict(f) for f in d["fields"]])

    @classmethod
    def coerce(cls, schema):
        """Accept a Schema, a list of Field, or a list of (name, dtype[, shape[, lod]]) tuples."""
        if isinstance(schema, Schema):
            return schema
        if schema is None:
            raise TypeError("a schema is required")
        if isinstance(schema, (str, bytes)) or not hasattr(schema, "__iter__"):
            raise TypeError(f"schema must be a Schema or a list of Field, got {type(schema).__name__}")
        fields = []
        for f in schema:
            fields.append(f if isinstance(f, Field) else Field(*f))
        return cls(fields)


def _check_offsets(level, name):
    if level.ndim != 1:
        raise ValueError(f"LoD {name} must be 1-D offsets, got shape {level.shape}")
    if level.shape[0] == 0:
        raise ValueError(f"LoD {name} is empty; offsets start with 0")
    xp = _array_module(level)
    first = int(level[0])
    if first != 0:
        raise ValueError(f"LoD {name} must start at 0, starts at {first}")
    if level.shape[0] > 1:
        d = xp.diff(level)
        bad = xp.nonzero(d < 0)[0]
        if bad.shape[0]:
            i = int(bad[0])
            raise ValueError(
                f"LoD {name} decreases at index {i + 1}: {int(level[i])} -> {int(level[i + 1])}")


def _validated(data, lod):
    """(data, levels) checked: data has a row axis; each level is 1-D int64
    offsets from 0, never decreasing, ending at the next level's entries (the
    last level at the rows of data).  An unsigned level above int64's range
    is rejected before any cast could wrap it."""
    if not (hasattr(data, "__array_interface__") or hasattr(data, "__cuda_array_interface__")):
        data = np.asarray(data)
    if data.ndim < 1:
        raise ValueError(f"LoDTensor data must have at least one dimension, got shape {data.shape}")
    xp = _array_module(data)
    levels = []
    for k, level in enumerate([] if lod is None else lod):
        arr = xp.asarray(level)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"LoD level {k} must hold integers, got {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError(f"LoD level {k} holds an offset above 2**63 - 1 ({int(arr.max())})")
        arr = arr.astype(np.int64, copy=False)
        _check_offsets(arr, f"level {k}")
        levels.append(arr)
    for k, level in enumerate(levels):
        end = int(level[-1])
        want = data.shape[0] if k == len(levels) - 1 else levels[k + 1].shape[0] - 1
        what = "rows in data" if k == len(levels) - 1 else f"entries of level {k + 1}"
        if end != want:
            raise ValueError(f"LoD level {k} ends at {end} but there are {want} {what}")
    return data, levels


class LoDTensor:
    """Rows stacked along dim 0 plus level-of-detail offsets (Paddle's LoDTensor).

    Parameters
    ----------
    data : array (NumPy or CuPy)
        ``[rows, *inner]``.
    lod : list of 1-D int arrays, optional
        Offset levels.  Level ``k`` indexes into level ``k + 1``; the last level
        indexes rows of ``data``.  Empty (default) for a fixed-shape batch.

    Raises
    ------
    ValueError
        Offsets that do not start at 0, decrease, or do not end at the number
        of rows (or of the next level's entries).

    Examples
    --------
    >>> t = LoDTensor.from_sequences([np.ones((2, 3)), np.zeros((1, 3))])
    >>> t.lod[0].tolist(), t.lengths().tolist()
    ([0, 2, 3], [2, 1])
    """

    __slots__ = ("data", "lod")

    def __init__(self, data, lod=None):
        self.data, self.lod = _validated(data, lod)

    def validated(self):
        """``(data, lod)`` after checking them again, as the constructor does.

        ``data`` and ``lod`` are plain attributes that code may reassign or
        mutate after construction; kernels call this first (cheap: O(levels
        + sequences)), so a tensor made inconsistent raises here -- ValueError
        naming the level and index -- instead of sending a kernel past the
        end of ``data``.
        """
        lod = self.lod
        if not isinstance(lod, (list, tuple)):
            raise TypeError(f"LoDTensor.lod must be a list of offset arrays, got {type(lod).__name__}")
        return _validated(self.data, lod)

    # -- construction -------------------------------------------------------
    @classmethod
    def from_sequences(cls, sequences, dtype=None):
        """Stack a list of arrays ``[len_i, *inner]`` into one-level LoD form."""
        seqs = list(sequences)
        if not seqs:
            raise ValueError("from_sequences needs at least one sequence (inner shape unknown)")
        xp = _array_module(seqs[0])
        seqs = [xp.asarray(s, dtype=dtype) for s in seqs]
        inner = seqs[0].shape[1:]
        for i, s in enumerate(seqs):
            if s.ndim < 1:
                raise ValueError(f"sequence {i} is a scalar; sequences need a first (time) dimension")
            if s.shape[1:] != inner:
                raise ValueError(f"sequence {i} has inner shape {s.shape[1:]}, sequence 0 has {inner}")
        lengths = np.array([s.shape[0] for s in seqs], dtype=np.int64)
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = xp.concatenate(seqs, axis=0)
        return cls(data, [xp.asarray(offsets)])

    # -- inspection ---------------------------------------------------------
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def lod_level(self):
        return len(self.lod)

    @property
    def device(self):
        return "cuda" if _array_module(self.data) is not np else "cpu"

    def __len__(self):
        """Number of instances: sequences for LoD data, rows otherwise."""
        return self.lod[0].shape[0] - 1 if self.lod else self.data.shape[0]

    def lengths(self, level=0):
        """Length of each entry at ``level`` (rows for the last level)."""
        if not self.lod:
            raise ValueError("lengths() needs a LoD tensor; this one has no lod levels")
        xp = _array_module(self.lod[level])
        return xp.diff(self.lod[level])

    def sequence(self, i):
        """The rows of instance ``i`` (one-level LoD), as a view of ``data``."""
        if not self.lod:
            return self.data[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences")
        i %= n
        lo, hi = int(self.lod[0][i]), int(self.lod[0][i + 1])
        if len(self.lod) == 1:
            return self.data[lo:hi]
        # walk down the levels: [lo, hi) is a range of entries of the next level
        sub = []
        for lvl in self.lod[1:]:
            sub.append(lvl[lo:hi + 1] - lvl[lo])
            lo, hi = int(lvl[lo]), int(lvl[hi])
        return LoDTensor(self.data[lo:hi], sub)

    def to_padded(self, pad_value=0):
        """``(array [B, max_len, *inner], lengths [B] int64)`` for one-level LoD."""
        if len(self.lod) != 1:
            raise ValueError(f"to_padded needs exactly one lod level, this tensor has {len(self.lod)}")
        xp = _array_module(self.data)
        lengths = xp.diff(self.lod[0])
        b = lengths.shape[0]
        max_len = int(lengths.max()) if b else 0
        out = xp.full((b, max_len) + tuple(self.data.shape[1:]), pad_value, dtype=self.data.dtype)
        if b and max_len:
            # row r of data belongs to sequence seq[r] at step r - offsets[seq[r]]
            rows = self.data.shape[0]
            seq = xp.repeat(xp.arange(b), lengths)
            step = xp.arange(rows) - xp.repeat(self.lod[0][:-1], lengths)
            out[seq, step] = self.data
        return out, lengths

    # -- interchange --------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        if _array_module(self.data) is not np:
            raise TypeError("this LoDTensor lives on the GPU; call .to('cpu') first")
        if copy is False and dtype is not None and np.dtype(dtype) != self.data.dtype:
            raise ValueError(f"converting {self.data.dtype} to {np.dtype(dtype)} needs a copy (copy=False)")
        a = self.data if dtype is None else self.data.astype(dtype, copy=False)
        return np.array(a, copy=True) if copy else a

    def __dlpack__(self, *args, **kwargs):
        return self.data.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()

    def to(self, device):
        """Copy to ``"cpu"`` (NumPy) or ``"cuda"`` (CuPy); offsets travel too."""
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cpu":
            if self.device == "cpu":
                return self
            return LoDTensor(self.data.get(), [lvl.get() for lvl in self.lod])
        from .gpu import require_cupy
        cp = require_cupy()
        dev = int(str(device).split(":")[1]) if ":" in str(device) else None
        with (cp.cuda.Device(dev) if dev is not None else contextlib.nullcontext()):
            return LoDTensor(cp.asarray(self.data), [cp.asarray(lvl) for lvl in self.lod])

    def __repr__(self):
        lod = ", lod=[" + ", ".join(str(list(map(int, l[:6]))) + ("..." if l.shape[0] > 6 else "")
                                     for l in self.lod) + "]" if self.lod else ""
        return f"LoDTensor(shape={tuple(self.data.shape)}, dtype={self.data.dtype}{lod}, device={self.device})"


class SparseTensor:
    """COO matrix as TensorFlow returns it: ``indices [N, 2]``, ``values [N]``, ``dense_shape [2]``.

    All three are int64 arrays (NumPy or CuPy).
    """

    __slots__ = ("indices", "values", "dense_shape")

    def __init__(self, indices, values, dense_shape):
        xp = _array_module(indices)
        indices = xp.asarray(indices, dtype=np.int64)
        values = xp.asarray(values)
        dense_shape = xp.asarray(dense_shape, dtype=np.int64)
        if indices.ndim != 2:
            raise ValueError(f"SparseTensor indices must be 2-D [N, rank], got shape {indices.shape}")
        if values.ndim != 1 or values.shape[0] != indices.shape[0]:
            raise ValueError(
                f"SparseTensor values must be 1-D with {indices.shape[0]} entries, got shape {values.shape}")
        if dense_shape.ndim != 1 or dense_shape.shape[0] != indices.shape[1]:
            raise ValueError(
                f"SparseTensor dense_shape must have {indices.shape[1]} entries, got shape {dense_shape.shape}")
        self.indices = indices
        self.values = values
        self.dense_shape = dense_shape

    @property
    def device(self):
        return "cuda" if _array_module(self.values) is not np else "cpu"

    def to_dense(self, default_value=0):
        xp = _array_module(self.values)
        shape = tuple(int(d) for d in self.dense_shape.tolist())
        out = xp.full(shape, default_value, dtype=self.values.dtype)
        if self.values.shape[0]:
            out[tuple(self.indices[:, k] for k in range(self.indices.shape[1]))] = self.values
        return out

    def to(self, device):
        if device == "cpu":
            if self.device == "cpu":
                return self
            return SparseTensor(self.indices.get(), self.values.get(), self.dense_shape.get())
        from .gpu import require_cupy
        cp = require_cupy()
        return SparseTensor(cp.asarray(self.indices), cp.asarray(self.values), cp.asarray(self.dense_shape))

    def __repr__(self):
        return (f"SparseTensor(nnz={self.values.shape[0]}, dense_shape={self.dense_shape.tolist()}, "
                f"device={self.device})")
