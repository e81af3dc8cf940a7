# cython: freethreading_compatible=False
"""Batches and instances keyed by field name: tuples that are also read-only mappings.

Design:
    What `read_next()` returns is a tuple subclass, one class per (kind, field
    names) -- like `collections.namedtuple` -- so everything that handled the
    bare tuples keeps working unchanged: unpacking in schema order
    (``feats, label = batch``), ``batch[0]``, ``len``, ``isinstance(b,
    tuple)``, and the namedtuple protocol that torch's ``default_collate`` /
    ``default_convert`` and JAX's pytrees follow (``_fields``, ``type(b)(*values)``),
    which keeps the keys through them.  On top come the read-only mapping
    methods a dict user reaches for: ``batch["feats"]``, ``keys()``,
    ``values()``, ``items()``, ``get()``, ``"feats" in batch``, ``dict(batch)``.

    Iterating yields the *values* (a tuple's meaning, so unpacking works), not
    the keys as a dict would; for that reason the class is not registered as a
    `collections.abc.Mapping` (torch would then rebuild it as a dict of keys).

    Cost: the names live on the class, so an object is a plain tuple in
    memory; building one is one allocation (``tp_alloc``, `keyed_new`), the
    same as a tuple.  The class of a schema is found by the schema object's
    identity (`keyed_type`), a dict lookup, so wrapping a batch costs about a
    tuple's construction plus ~50 ns.

    Tuple subclasses cannot be `cdef class`es with C fields (Cython refuses
    variable-size bases), hence a Python class compiled here.
"""
import numpy as np
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_SET_ITEM

from readerlib.tensor import LoDTensor

__all__ = ["Batch", "Instance"]


from cpython.object cimport PyTypeObject

cdef extern from "Python.h":
    object PyType_GenericAlloc(PyTypeObject *cls, Py_ssize_t nitems)


def _short(v):
    """A value as repr shows it: small arrays in full, larger ones by shape and dtype."""
    if isinstance(v, np.ndarray) and v.size > 8:
        return f"ndarray(shape={v.shape}, dtype={v.dtype})"
    return repr(v)


def _arrays_equal(a, b):
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and \
            bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    try:
        sa, sb = a.shape, b.shape
    except AttributeError:
        return bool(a == b)
    if sa != sb or getattr(a, "dtype", None) != getattr(b, "dtype", None):
        return False
    return bool((a == b).all())           # other array types (CuPy, torch)


def _values_equal(a, b):
    """Values compared as records: arrays by dtype, shape and contents (NaN equals
    NaN), LoDTensors by data and offsets, anything else with ==."""
    if a is b:
        return True
    if isinstance(a, LoDTensor) or isinstance(b, LoDTensor):
        if not (isinstance(a, LoDTensor) and isinstance(b, LoDTensor)) or len(a.lod) != len(b.lod):
            return False
        return _arrays_equal(a.data, b.data) and all(_arrays_equal(x, y) for x, y in zip(a.lod, b.lod))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _arrays_equal(np.asarray(a), np.asarray(b))
    return _arrays_equal(a, b)


cdef dict _CLASSES = {}          # (base, names) -> class


def _class_for(base, names):
    """The class of `base` (Batch or Instance) for these field names (cached)."""
    names = tuple(names)
    key = (base, names)
    cls = _CLASSES.get(key)
    if cls is None:
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"{base.__name__}: field names are str, got {n!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"{base.__name__}: field names must be unique, got {list(names)}")
        if not names:
            raise ValueError(f"{base.__name__} needs at least one field")
        cls = type(base)(base.__name__, (base,), {
            "__slots__": (), "__module__": base.__module__, "__qualname__": base.__qualname__,
            "_fields": names, "_index": {n: i for i, n in enumerate(names)},
            "__doc__": base.__doc__})
        _CLASSES[key] = cls
    return cls


def _rebuild(base, names, values):
    """Unpickle: the class for (base, names), then the values."""
    return keyed_from_seq(_class_for(base, names), values)


class _Keyed(tuple):
    __slots__ = ()
    _fields = ()
    _index = {}

    def __new__(cls, *args, **kwargs):
        if not cls._fields:          # the public base: Batch({"a": x}) / Batch(a=x) / Batch([("a", x)])
            if len(args) > 1:
                raise TypeError(f"{cls.__name__}() takes a mapping or (name, value) pairs, "
                                f"got {len(args)} positional arguments")
            d = dict(*args, **kwargs)
            return keyed_from_seq(_class_for(cls, d.keys()), list(d.values()))
        fields = cls._fields
        if kwargs:
            if args:
                raise TypeError(f"{cls.__name__}() takes the values by position or by name, not both")
            missing = [n for n in fields if n not in kwargs]
            extra = [k for k in kwargs if k not in cls._index]
            if missing or extra:
                raise TypeError(f"{cls.__name__}() fields are {list(fields)}: missing {missing}, "
                                f"unknown {extra}")
            return keyed_from_seq(cls, [kwargs[n] for n in fields])
        if len(args) != len(fields):
            raise TypeError(f"{cls.__name__}() takes {len(fields)} values {list(fields)}, "
                            f"got {len(args)}")
        return keyed_from_seq(cls, args)

    @classmethod
    def _make(cls, iterable):
        """From values in field order (namedtuple's `_make`)."""
        values = list(iterable)
        if len(values) != len(cls._fields):
            raise TypeError(f"{cls.__name__}._make: {len(cls._fields)} values {list(cls._fields)}, "
                            f"got {len(values)}")
        return keyed_from_seq(cls, values)

    # -- the mapping face
    def __getitem__(self, key):
        if type(key) is str:
            try:
                return tuple.__getitem__(self, type(self)._index[key])
            except KeyError:
                raise KeyError(f"no field named {key!r}; fields are {list(type(self)._fields)}") from None
        return tuple.__getitem__(self, key)

    def __contains__(self, key):
        """A name: is it a field?  Anything else: is it one of the values (a tuple's meaning)."""
        if type(key) is str:
            return key in type(self)._index
        return tuple.__contains__(self, key)

    def keys(self):
        """The field names, in schema order."""
        return type(self)._fields

    def values(self):
        """The values, in schema order (the tuple itself)."""
        return tuple(self)

    def items(self):
        """(name, value) pairs, in schema order."""
        return tuple(zip(type(self)._fields, self))

    def get(self, key, default=None):
        i = type(self)._index.get(key) if type(key) is str else None
        return default if i is None else tuple.__getitem__(self, i)

    def _asdict(self):
        """A dict of the fields (namedtuple's `_asdict`; `dict(item)` gives the same)."""
        return dict(zip(type(self)._fields, self))

    def _replace(self, **kwargs):
        """A copy with some fields replaced (namedtuple's `_replace`)."""
        extra = [k for k in kwargs if k not in type(self)._index]
        if extra:
            raise ValueError(f"{type(self).__name__}._replace: no fields {extra}; "
                             f"fields are {list(type(self)._fields)}")
        return keyed_from_seq(type(self), [kwargs.get(n, v) for n, v in zip(type(self)._fields, self)])

    # -- comparisons, repr, pickling
    def __eq__(self, other):
        """Equal to an item with the same names (in order) and equal values, to a dict
        with the same keys and values, or to a plain tuple of equal values."""
        if isinstance(other, _Keyed):
            if type(other)._fields != type(self)._fields:
                return False
        elif isinstance(other, dict):
            if len(other) != len(self) or any(n not in other for n in type(self)._fields):
                return False
            other = [other[n] for n in type(self)._fields]
        elif not isinstance(other, (tuple, list)):
            return NotImplemented
        if len(other) != len(self):
            return False
        return all(_values_equal(a, b) for a, b in zip(self, other))

    def __ne__(self, other):
        r = self.__eq__(other)
        return r if r is NotImplemented else not r

    __hash__ = None            # equality compares arrays' contents

    def __repr__(self):
        return f"{type(self).__name__}(" + ", ".join(
            f"{n}={_short(v)}" for n, v in zip(type(self)._fields, self)) + ")"

    def __reduce__(self):
        base = type(self).__mro__[1]
        return (_rebuild, (base, type(self)._fields, tuple(self)))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        import copy
        return keyed_from_seq(type(self), [copy.deepcopy(v, memo) for v in self])


class Batch(_Keyed):
    """A batch: one `LoDTensor` per field, keyed by name, in schema order.

    A tuple (``feats, label = batch``, ``batch[0]``) and a read-only mapping
    (``batch["feats"]``, ``batch.keys()``, ``"feats" in batch``,
    ``dict(batch)``) at once; iterating yields the values.  Equality compares
    names and contents; it pickles; torch's collate and JAX's tree functions
    treat it as a namedtuple and keep its keys.

    ``readerlib.Batch({"feats": t, "label": l})`` (or keywords) builds one;
    ``type(batch)(*values)`` one with the same names.

    Examples
    --------
    >>> b = Batch(x=np.arange(3), y=np.zeros(3))
    >>> b.keys(), list(b["x"])
    (('x', 'y'), [0, 1, 2])
    """
    __slots__ = ()


class Instance(_Keyed):
    """An instance: one NumPy array per field, keyed by name, in schema order.

    What `read_next()` returns for instances and what `map` / `filter`
    functions get; it behaves like `Batch` (a tuple that is also a read-only
    mapping).  Functions may return it, a plain tuple or a dict.
    """
    __slots__ = ()


Batch.__module__ = Instance.__module__ = "readerlib"      # their public home


# ------------------------------------------------------- C-level constructors
cdef object keyed_new(object cls, Py_ssize_t n):
    return PyType_GenericAlloc(<PyTypeObject *>cls, n)


cdef object keyed_from_seq(object cls, object values):
    cdef Py_ssize_t i, n = len(values)
    out = PyType_GenericAlloc(<PyTypeObject *>cls, n)
    for i in range(n):
        v = values[i]
        Py_INCREF(v)
        PyTuple_SET_ITEM(out, i, v)
    return out


cdef dict _BY_SCHEMA = {}          # id(schema) -> (schema, batch class, instance class)


cdef object keyed_type(object schema, bint batch):
    e = _BY_SCHEMA.get(id(schema))
    if e is None or (<tuple>e)[0] is not schema:
        if len(_BY_SCHEMA) > 4096:      # schemas come and go with readers: keep the cache small
            _BY_SCHEMA.clear()
        names = schema.names
        e = (schema, _class_for(Batch, names), _class_for(Instance, names))
        _BY_SCHEMA[id(schema)] = e
    return (<tuple>e)[1] if batch else (<tuple>e)[2]


cdef object keyed_of(object schema, bint batch, object values):
    return keyed_from_seq(keyed_type(schema, batch), values)


def keyed_type_of(schema, batched):
    """The class of a reader's items for `schema` (Batch or Instance subclass)."""
    return keyed_type(schema, bool(batched))


def as_keyed(schema, batched, values):
    """`values` (a sequence in schema order) as a Batch / Instance of `schema`."""
    return keyed_of(schema, bool(batched), values)


def is_keyed(obj):
    return isinstance(obj, _Keyed)
