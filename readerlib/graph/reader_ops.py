"""Paddle's reader ops in the graph: reader-creating ops, ReadOp, ReInit.

Design (PaddlePaddle PR 8009): every reader has a *creating op*.  A file
reader's creating op takes no input; a decorated reader's creating op takes
exactly one input, the underlying reader variable (sizes and seeds are
attrs).  Each outputs a reader variable (dtype :data:`resource`) that holds a
``ReaderHolder``.  ``read`` is the ReadOp: it calls ``read_next`` on the
holder and splits the item into one output per schema field.

The chain a Session builds is exactly the eager chain: the shuffle creating
op wraps the *held* reader of its input in ``ShuffleReader(reader, n, seed)``
as ``reader.shuffle(n, seed)`` does, so the same batches come out in the same
order.  The schema is known at build time (read from the file header, or
passed) and stored as the ``schema`` attr (JSON) with ``batched``, so
``read`` knows its outputs' dtypes and shapes and a GraphDef carries them.

Reader variables live in the Session (Paddle's Scope), keyed by the op's
``(container, shared_name or name)``: creating ops are stateful and run
once per Session (later runs find the variable).  A new Session starts from
the beginning.  The end of the input raises ``OutOfRangeError`` on that run
and every later one, until ``reset_reader(reader)`` (Paddle's ReInit) runs:
it restarts the whole chain (the next epoch; shuffles draw that epoch's order).
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidArgumentError, OutOfRangeError
from ..tensor import Schema
from . import dtypes as _dt
from .array_ops import apply_op
from .ops import Tensor
from .registry import register_op

__all__ = ["create_recordio_reader", "create_tfrecord_reader", "create_shuffle_reader",
           "create_batch_reader", "create_multi_pass_reader", "create_prefetch_reader",
           "read", "reset_reader", "ReaderVariable"]


class ReaderVariable:
    """A Session's reader variable: a ``ReaderHolder`` plus the end-of-input flag."""

    __slots__ = ("holder", "exhausted", "batched", "read_next", "__weakref__")

    def __init__(self, reader, batched):
        from ..readers._base import ReaderHolder
        self.holder = reader if isinstance(reader, ReaderHolder) else ReaderHolder(reader)
        self.exhausted = False
        self.batched = batched
        # ReadOp reads the held chain itself (one lock and call fewer per batch than through
        # the holder; the same items: the holder only forwards)
        self.read_next = self.holder.reader.read_next

    @property
    def reader(self):
        """The held chain."""
        return self.holder.reader

    def close(self):
        self.holder.close()

    def __repr__(self):
        return f"ReaderVariable({self.holder.reader!r}, exhausted={self.exhausted})"


_RESOURCE_ATTRS = {"container": ("string", b""), "shared_name": ("string", b""),
                   "schema": ("string", None), "batched": ("bool", False)}


def _reader_infer(inputs, attrs):
    return [(_dt.resource, ())]


def _creating_kernel(build):
    def kernel(ctx, inputs):
        a = ctx.attrs
        key = (a["container"], a["shared_name"] or ctx.op.name.encode())
        var = ctx.resources.get(key)
        if var is None:
            with ctx.lock:
                var = ctx.resources.get(key)
                if var is None:
                    var = ReaderVariable(build(a, inputs), a["batched"])
                    ctx.resources[key] = var
        return (var,)
    return kernel


def _register_creating(op_type, inputs, attrs, build):
    all_attrs = dict(_RESOURCE_ATTRS)
    all_attrs.update(attrs)
    register_op(op_type, inputs=inputs, outputs=[("reader", _dt.resource)], attrs=all_attrs,
                infer=_reader_infer, stateful=True, constant_per_session=True,
                kernels={"CPU": _creating_kernel(build)})


def _recordio(a, inputs):
    from ..formats._recordio import RecordIOReader
    r = RecordIOReader(a["filename"].decode())
    _check_schema(r, a)
    return r


def _tfrecord(a, inputs):
    from ..formats._tfrecord import TFRecordReader
    comp = a["compression"].decode() or None
    return TFRecordReader(a["filename"].decode(), schema=Schema.from_json(a["schema"].decode()),
                          compression=comp)


def _check_schema(reader, a):
    want = Schema.from_json(a["schema"].decode())
    if reader.schema != want:
        raise InvalidArgumentError(f"{reader.path}: the file's schema {reader.schema!r} is not the "
                                   f"schema the graph was built with {want!r}")


def _upstream(inputs):
    v = inputs[0]
    if not isinstance(v, ReaderVariable):
        raise InvalidArgumentError(f"expected a reader variable, got {type(v).__name__}")
    return v.holder.reader


_register_creating("CreateRecordIOReader", [], {"filename": ("string", None)}, _recordio)
_register_creating("CreateTFRecordReader", [], {"filename": ("string", None),
                                                "compression": ("string", b"")}, _tfrecord)
_register_creating("CreateShuffleReader", [("underlying_reader", _dt.resource)],
                   {"buffer_size": ("int", None), "seed": ("int", -1)},
                   lambda a, i: _upstream(i).shuffle(a["buffer_size"],
                                                    None if a["seed"] < 0 else a["seed"]))
_register_creating("CreateBatchReader", [("underlying_reader", _dt.resource)],
                   {"batch_size": ("int", None), "drop_last": ("bool", False)},
                   lambda a, i: _upstream(i).batch(a["batch_size"], a["drop_last"]))
_register_creating("CreateMultiPassReader", [("underlying_reader", _dt.resource)],
                   {"num_passes": ("int", None)},
                   lambda a, i: _upstream(i).multi_pass(a["num_passes"]))
_register_creating("CreatePrefetchReader", [("underlying_reader", _dt.resource)],
                   {"capacity": ("int", 2)},
                   lambda a, i: _upstream(i).prefetch(a["capacity"]))


def _graph_schema(reader):
    if not isinstance(reader, Tensor) or reader.dtype is not _dt.resource:
        raise TypeError(f"expected a reader variable (the output of a create_*_reader op), "
                        f"got {reader!r}")
    return reader.op._attrs["schema"], reader.op._attrs["batched"]


def _positive(value, what, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            value < (0 if allow_zero else 1):
        raise ValueError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} int, "
                         f"got {value!r}")
    return int(value)


def _schema_json(schema):
    return Schema.coerce(schema).to_json()


def create_recordio_reader(path, schema=None, name=None):
    """A RecordIO file reader's creating op; returns the reader variable.

    The schema is read from the file's header now (build time) unless
    given; a given schema is checked against the file when the Session
    opens it.
    """
    path = os.fspath(path)
    if schema is None:
        from ..formats._recordio import RecordIOReader
        with RecordIOReader(path) as r:
            schema = r.schema
    attrs = {"filename": path, "schema": _schema_json(schema), "batched": False}
    return apply_op("CreateRecordIOReader", [], attrs, name, "create_recordio_reader").outputs[0]


def create_tfrecord_reader(path, schema=None, compression=None, name=None):
    """A TFRecord file reader's creating op (default schema: one LoD uint8 field
    ``data``, as :class:`readerlib.TFRecordReader`)."""
    path = os.fspath(path)
    if schema is None:
        from ..tensor import Field
        schema = Schema([Field("data", "uint8", (), lod_level=1)])
    attrs = {"filename": path, "schema": _schema_json(schema), "batched": False,
             "compression": compression or ""}
    return apply_op("CreateTFRecordReader", [], attrs, name, "create_tfrecord_reader").outputs[0]


def _decorate(op_type, reader, attrs, name, default_name, batched=None):
    schema, was_batched = _graph_schema(reader)
    attrs = dict(attrs, schema=schema, batched=was_batched if batched is None else batched)
    return apply_op(op_type, [reader], attrs, name, default_name).outputs[0]


def create_shuffle_reader(reader, buffer_size, seed=None, name=None):
    """``reader.shuffle(buffer_size, seed)`` as a creating op (one input: the reader)."""
    _positive(buffer_size, "buffer_size")
    if seed is not None:
        _positive(seed, "seed", allow_zero=True)
    return _decorate("CreateShuffleReader", reader,
                     {"buffer_size": int(buffer_size), "seed": -1 if seed is None else int(seed)},
                     name, "create_shuffle_reader")


def create_batch_reader(reader, batch_size, drop_last=False, name=None):
    """``reader.batch(batch_size, drop_last)`` as a creating op."""
    _positive(batch_size, "batch_size")
    if _graph_schema(reader)[1]:
        raise ValueError("create_batch_reader: the reader gives batches already")
    return _decorate("CreateBatchReader", reader,
                     {"batch_size": int(batch_size), "drop_last": bool(drop_last)},
                     name, "create_batch_reader", batched=True)


def create_multi_pass_reader(reader, num_passes, name=None):
    """``reader.multi_pass(num_passes)`` as a creating op."""
    _positive(num_passes, "num_passes")
    return _decorate("CreateMultiPassReader", reader, {"num_passes": int(num_passes)}, name,
                     "create_multi_pass_reader")


def create_prefetch_reader(reader, capacity=2, name=None):
    """``reader.prefetch(capacity)`` as a creating op (Paddle's double buffer)."""
    _positive(capacity, "capacity")
    return _decorate("CreatePrefetchReader", reader, {"capacity": int(capacity)}, name,
                     "create_prefetch_reader")


# -- ReadOp and ReInit --------------------------------------------------------------------

def _read_infer(inputs, attrs):
    schema = Schema.from_json(attrs["schema"].decode())
    out = []
    for f in schema:
        shape = tuple(f.shape)
        if attrs["batched"] or f.lod_level:
            shape = (None,) + shape
        out.append((f.dtype, shape))
    return out


def _read_kernel(ctx, inputs):
    var = inputs[0]
    if var.exhausted:
        raise OutOfRangeError(None, ctx.op, "End of sequence")
    item = var.read_next()
    if item is None:
        var.exhausted = True
        raise OutOfRangeError(None, ctx.op, "End of sequence")
    if var.batched:
        if len(item) == 1:
            t = item[0]
            return (t if t.lod else t.data,)
        return [t if t.lod else t.data for t in item]
    return item


register_op("Read", inputs=[("reader", _dt.resource)], outputs=[],
            attrs={"schema": ("string", None), "batched": ("bool", False)},
            infer=_read_infer, stateful=True, kernels={"CPU": _read_kernel})


def read(reader, name=None):
    """Paddle's ReadOp: the next item of ``reader``, one Tensor per schema field.

    LoD fields of a batch fetch as LoDTensor, fixed fields as ndarrays
    ``[B, *shape]``; an unbatched reader gives one instance's arrays.  All
    fields fetched in one ``Session.run`` come from the same item; two
    ``read`` ops on one reader share its state.

    Returns
    -------
    list of Tensor
    """
    schema, batched = _graph_schema(reader)
    op = apply_op("Read", [reader], {"schema": schema, "batched": batched}, name, "read")
    return list(op.outputs)


def _reset_kernel(ctx, inputs):
    var = inputs[0]
    var.holder.reset()
    var.exhausted = False
    return ()


register_op("ResetReader", inputs=[("reader", _dt.resource)], infer=lambda i, a: [],
            stateful=True, kernels={"CPU": _reset_kernel})


def reset_reader(reader, name=None):
    """Paddle's ReInit as an op: running it restarts the reader's whole chain (the
    next epoch) and clears its end-of-input state.  Returns the Operation."""
    _graph_schema(reader)
    return apply_op("ResetReader", [reader], None, name, "reset_reader")
