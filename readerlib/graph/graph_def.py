"""GraphDef in TensorFlow's wire format, and ``import_graph_def``.

Design: the message classes (GraphDef, NodeDef, AttrValue, TensorProto,
TensorShapeProto, VersionDef) are made at import time by the ``protobuf``
package from a ``FileDescriptorProto`` written here in Python with
TensorFlow's field numbers and types (``graph.proto``, ``node_def.proto``,
``attr_value.proto``, ``tensor.proto``, ``tensor_shape.proto``,
``types.proto``, ``versions.proto``), in a private descriptor pool so they
never clash with TensorFlow's own classes in the same process.  protobuf
does all the encoding: ``SerializeToString()`` is bytes TensorFlow's
``GraphDef.FromString`` reads, and the other way round.  Fields readerlib
does not model (``library``, ``debug_info``, ``experimental_*``) are left
out of the schema; protobuf keeps them as unknown fields when parsing.
"""
from __future__ import annotations

import numpy as np

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("readerlib.graph's GraphDef support needs protobuf: "
                      "pip install 'readerlib[graph]' (or protobuf)") from e

from .. import errors as _errors
from . import dtypes as _dt
from .ops import Tensor, get_default_graph
from .registry import get_op_type

__all__ = ["GraphDef", "NodeDef", "AttrValue", "TensorProto", "TensorShapeProto", "VersionDef",
           "graph_to_graph_def", "import_graph_def", "tensor_proto", "tensor_from_proto",
           "PRODUCER_VERSION"]

#: versions.producer written into GraphDefs (TensorFlow 2.21's TF_GRAPH_DEF_VERSION).
PRODUCER_VERSION = 2474

_F = descriptor_pb2.FieldDescriptorProto
_OPT, _REP = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_T = {"int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32,
      "uint64": _F.TYPE_UINT64, "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE,
      "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES}
_PKG = "tensorflow"


def _build_file():
    fd = descriptor_pb2.FileDescriptorProto(name="readerlib/graph/tensorflow_graph.proto",
                                            package=_PKG, syntax="proto3")
    enum = fd.enum_type.add(name="DataType")
    for name, num in [("DT_INVALID", 0), ("DT_FLOAT", 1), ("DT_DOUBLE", 2), ("DT_INT32", 3),
                      ("DT_UINT8", 4), ("DT_INT16", 5), ("DT_INT8", 6), ("DT_STRING", 7),
                      ("DT_COMPLEX64", 8), ("DT_INT64", 9), ("DT_BOOL", 10), ("DT_QINT8", 11),
                      ("DT_QUINT8", 12), ("DT_QINT32", 13), ("DT_BFLOAT16", 14),
                      ("DT_QINT16", 15), ("DT_QUINT16", 16), ("DT_UINT16", 17),
                      ("DT_COMPLEX128", 18), ("DT_HALF", 19), ("DT_RESOURCE", 20),
                      ("DT_VARIANT", 21), ("DT_UINT32", 22), ("DT_UINT64", 23)]:
        enum.value.add(name=name, number=num)

    def msg(parent, name):
        return parent.message_type.add(name=name) if hasattr(parent, "message_type") \
            else parent.nested_type.add(name=name)

    def field(m, name, number, kind, label=_OPT, type_name=None, packed=None, oneof=None):
        f = m.field.add(name=name, number=number, label=label)
        if kind in _T:
            f.type = _T[kind]
        elif kind == "enum":
            f.type = _F.TYPE_ENUM
            f.type_name = type_name
        else:
            f.type = _F.TYPE_MESSAGE
            f.type_name = type_name
        if packed is not None:
            f.options.packed = packed
        if oneof is not None:
            f.oneof_index = oneof
        return f

    dt = f".{_PKG}.DataType"
    # tensor_shape.proto
    shape = msg(fd, "TensorShapeProto")
    dim = msg(shape, "Dim")
    field(dim, "size", 1, "int64")
    field(dim, "name", 2, "string")
    field(shape, "dim", 2, "msg", _REP, f".{_PKG}.TensorShapeProto.Dim")
    field(shape, "unknown_rank", 3, "bool")
    # tensor.proto
    tp = msg(fd, "TensorProto")
    field(tp, "dtype", 1, "enum", type_name=dt)
    field(tp, "tensor_shape", 2, "msg", type_name=f".{_PKG}.TensorShapeProto")
    field(tp, "version_number", 3, "int32")
    field(tp, "tensor_content", 4, "bytes")
    field(tp, "half_val", 13, "int32", _REP, packed=True)
    field(tp, "float_val", 5, "float", _REP, packed=True)
    field(tp, "double_val", 6, "double", _REP, packed=True)
    field(tp, "int_val", 7, "int32", _REP, packed=True)
    field(tp, "string_val", 8, "bytes", _REP)
    field(tp, "scomplex_val", 9, "float", _REP, packed=True)
    field(tp, "int64_val", 10, "int64", _REP, packed=True)
    field(tp, "bool_val", 11, "bool", _REP, packed=True)
    field(tp, "dcomplex_val", 12, "double", _REP, packed=True)
    field(tp, "uint32_val", 16, "uint32", _REP, packed=True)
    field(tp, "uint64_val", 17, "uint64", _REP, packed=True)
    # attr_value.proto
    av = msg(fd, "AttrValue")
    av.oneof_decl.add(name="value")
    lv = msg(av, "ListValue")
    field(lv, "s", 2, "bytes", _REP)
    field(lv, "i", 3, "int64", _REP, packed=True)
    field(lv, "f", 4, "float", _REP, packed=True)
    field(lv, "b", 5, "bool", _REP, packed=True)
    field(lv, "type", 6, "enum", _REP, type_name=dt, packed=True)
    field(lv, "shape", 7, "msg", _REP, f".{_PKG}.TensorShapeProto")
    field(lv, "tensor", 8, "msg", _REP, f".{_PKG}.TensorProto")
    field(lv, "func", 9, "msg", _REP, f".{_PKG}.NameAttrList")
    field(av, "s", 2, "bytes", oneof=0)
    field(av, "i", 3, "int64", oneof=0)
    field(av, "f", 4, "float", oneof=0)
    field(av, "b", 5, "bool", oneof=0)
    field(av, "type", 6, "enum", type_name=dt, oneof=0)
    field(av, "shape", 7, "msg", type_name=f".{_PKG}.TensorShapeProto", oneof=0)
    field(av, "tensor", 8, "msg", type_name=f".{_PKG}.TensorProto", oneof=0)
    field(av, "list", 1, "msg", type_name=f".{_PKG}.AttrValue.ListValue", oneof=0)
    field(av, "func", 10, "msg", type_name=f".{_PKG}.NameAttrList", oneof=0)
    field(av, "placeholder", 9, "string", oneof=0)

    def attr_map(m, number):
        entry = msg(m, "AttrEntry")
        entry.options.map_entry = True
        field(entry, "key", 1, "string")
        field(entry, "value", 2, "msg", type_name=f".{_PKG}.AttrValue")
        field(m, "attr", number, "msg", _REP, f".{m_full(m)}.AttrEntry")

    def m_full(m):
        return f"{_PKG}.{m.name}"

    nal = msg(fd, "NameAttrList")
    field(nal, "name", 1, "string")
    attr_map(nal, 2)
    # node_def.proto
    nd = msg(fd, "NodeDef")
    field(nd, "name", 1, "string")
    field(nd, "op", 2, "string")
    field(nd, "input", 3, "string", _REP)
    field(nd, "device", 4, "string")
    attr_map(nd, 5)
    # versions.proto
    vd = msg(fd, "VersionDef")
    field(vd, "producer", 1, "int32")
    field(vd, "min_consumer", 2, "int32")
    field(vd, "bad_consumers", 3, "int32", _REP, packed=True)
    # graph.proto
    gd = msg(fd, "GraphDef")
    field(gd, "node", 1, "msg", _REP, f".{_PKG}.NodeDef")
    field(gd, "versions", 4, "msg", type_name=f".{_PKG}.VersionDef")
    field(gd, "version", 3, "int32")
    return fd


_pool = descriptor_pool.DescriptorPool()
_file = _pool.Add(_build_file())


def _cls(name):
    desc = _pool.FindMessageTypeByName(f"{_PKG}.{name}")
    if hasattr(message_factory, "GetMessageClass"):          # protobuf >= 4.21
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(_pool).GetPrototype(desc)


GraphDef = _cls("GraphDef")
NodeDef = _cls("NodeDef")
AttrValue = _cls("AttrValue")
NameAttrList = _cls("NameAttrList")
TensorProto = _cls("TensorProto")
TensorShapeProto = _cls("TensorShapeProto")
VersionDef = _cls("VersionDef")


# -- values <-> protos ------------------------------------------------------------------

def shape_proto(shape, out=None):
    out = TensorShapeProto() if out is None else out
    shape = _dt.as_shape(shape)
    if shape.dims is None:
        out.unknown_rank = True
    else:
        for d in shape.dims:
            out.dim.add(size=-1 if d is None else d)
    return out


def shape_from_proto(p):
    if p.unknown_rank:
        return _dt.TensorShape(None)
    return _dt.TensorShape([None if d.size < 0 else d.size for d in p.dim])


# make_tensor_proto: these dtypes go to tensor_content when there is more than one element
_CONTENT = {np.dtype(t) for t in ("float16", "float32", "float64", "int32", "uint8", "int16",
                                  "int8", "int64", "uint16", "uint32", "uint64",
                                  "complex64", "complex128")}
_VAL_FIELD = {np.dtype("float32"): "float_val", np.dtype("float64"): "double_val",
              np.dtype("int32"): "int_val", np.dtype("int16"): "int_val",
              np.dtype("int8"): "int_val", np.dtype("uint8"): "int_val",
              np.dtype("uint16"): "int_val", np.dtype("int64"): "int64_val",
              np.dtype("uint32"): "uint32_val", np.dtype("uint64"): "uint64_val",
              np.dtype("bool"): "bool_val", np.dtype("float16"): "half_val",
              np.dtype("complex64"): "scomplex_val", np.dtype("complex128"): "dcomplex_val"}


def tensor_proto(arr, out=None):
    """A TensorProto of an ndarray, as TensorFlow's ``make_tensor_proto`` lays it out."""
    arr = np.asarray(arr)
    out = TensorProto() if out is None else out
    if arr.dtype.kind in "SU":
        out.dtype = 7
        shape_proto(arr.shape, out.tensor_shape)
        out.string_val.extend(x if isinstance(x, bytes) else str(x).encode() for x in arr.ravel())
        return out
    dtype = _dt.as_dtype(arr.dtype)
    out.dtype = _dt.datatype_enum(dtype)
    shape_proto(arr.shape, out.tensor_shape)
    if dtype in _CONTENT and arr.size > 1:
        out.tensor_content = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<")).tobytes()
        return out
    flat = arr.ravel()
    field = _VAL_FIELD[dtype]
    if dtype == np.float16:
        flat = flat.view(np.uint16).astype(np.int32)
    elif dtype.kind == "c":
        flat = np.stack([flat.real, flat.imag], axis=-1).ravel()
    getattr(out, field).extend(flat.tolist())
    return out


def tensor_from_proto(p):
    """The ndarray of a TensorProto (``tensor_content``, or ``*_val`` with TF's rule
    that a short list is padded with its last value)."""
    dtype = _dt.dtype_from_enum(p.dtype)
    shape = tuple(d.size for d in p.tensor_shape.dim)
    size = int(np.prod(shape, dtype=np.int64))
    if dtype is _dt.string:
        vals = list(p.string_val)
        if len(vals) < size:
            vals += [vals[-1] if vals else b""] * (size - len(vals))
        arr = np.array(vals, dtype=object).reshape(shape) if vals else np.zeros(shape, "S1")
        return np.asarray(arr.tolist(), dtype="S") if size else np.zeros(shape, "S1")
    if p.tensor_content:
        return np.frombuffer(p.tensor_content, dtype=dtype.newbyteorder("<")) \
            .astype(dtype).reshape(shape)
    field = _VAL_FIELD[dtype]
    vals = np.asarray(getattr(p, field))
    if dtype == np.float16:
        vals = vals.astype(np.uint16).view(np.float16)
    elif dtype.kind == "c":
        vals = vals.reshape(-1, 2)
        vals = vals[:, 0] + 1j * vals[:, 1]
    vals = vals.astype(dtype)
    if vals.size < size:
        fill = vals[-1] if vals.size else np.zeros((), dtype)
        vals = np.concatenate([vals, np.full(size - vals.size, fill, dtype)])
    return vals[:size].reshape(shape)


def _attr_proto(kind, value, out):
    if kind is None:
        kind = _guess_kind(value)
    if kind == "type":
        out.type = _dt.datatype_enum(value)
    elif kind == "shape":
        shape_proto(value, out.shape)
    elif kind == "tensor":
        tensor_proto(value, out.tensor)
    elif kind == "int":
        out.i = int(value)
    elif kind == "float":
        out.f = float(value)
    elif kind == "bool":
        out.b = bool(value)
    elif kind == "string":
        out.s = value if isinstance(value, bytes) else str(value).encode()
    elif kind.startswith("list("):
        inner = kind[5:-1]
        lst = out.list
        lst.SetInParent()
        for v in value:
            if inner == "type":
                lst.type.append(_dt.datatype_enum(v))
            elif inner == "shape":
                shape_proto(v, lst.shape.add())
            elif inner == "tensor":
                tensor_proto(v, lst.tensor.add())
            elif inner == "int":
                lst.i.append(int(v))
            elif inner == "float":
                lst.f.append(float(v))
            elif inner == "bool":
                lst.b.append(bool(v))
            else:
                lst.s.append(v if isinstance(v, bytes) else str(v).encode())
    else:
        raise TypeError(f"attr kind {kind!r} cannot be serialised")


def _guess_kind(value):
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, (bytes, str)):
        return "string"
    if isinstance(value, np.dtype):
        return "type"
    if isinstance(value, _dt.TensorShape):
        return "shape"
    if isinstance(value, np.ndarray):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "list(" + (_guess_kind(value[0]) if value else "string") + ")"
    raise TypeError(f"attr value {value!r} of type {type(value).__name__} cannot be serialised")


def _attr_value(p):
    which = p.WhichOneof("value")
    if which == "type":
        return _dt.dtype_from_enum(p.type)
    if which == "shape":
        return shape_from_proto(p.shape)
    if which == "tensor":
        arr = tensor_from_proto(p.tensor)
        arr.setflags(write=False)
        return arr
    if which in ("s", "i", "f", "b"):
        return getattr(p, which)
    if which == "list":
        lst = p.list
        for name in ("s", "i", "f", "b"):
            if len(getattr(lst, name)):
                return list(getattr(lst, name))
        if len(lst.type):
            return [_dt.dtype_from_enum(t) for t in lst.type]
        if len(lst.shape):
            return [shape_from_proto(s) for s in lst.shape]
        if len(lst.tensor):
            return [tensor_from_proto(t) for t in lst.tensor]
        return []
    if which is None:
        return None
    raise _errors.UnimplementedError(None, None, f"AttrValue field {which!r} is not supported")


def _input_name(t):
    return t._op._name if t._value_index == 0 else f"{t._op._name}:{t._value_index}"


def node_def_of(op, add_shapes=False):
    """The NodeDef of one Operation."""
    nd = NodeDef(name=op._name, op=op._type, device=op._device)
    nd.input.extend(_input_name(t) for t in op._inputs)
    nd.input.extend("^" + c for c in sorted(c._name for c in op._control_inputs))
    declared = op._op_type.attrs
    for k, v in op._attrs.items():
        if k.startswith("_py_"):
            continue        # Python-only attrs (never serialised)
        kind = declared[k][0] if k in declared else None
        _attr_proto(kind, v, nd.attr[k])
    if add_shapes and op._outputs:
        _attr_proto("list(shape)", [t._shape for t in op._outputs], nd.attr["_output_shapes"])
    return nd


def graph_to_graph_def(graph, from_version=None, add_shapes=False):
    gd = GraphDef()
    gd.versions.producer = PRODUCER_VERSION
    with graph._lock:
        ops = list(graph._ops)
    for op in ops:
        if from_version is not None and op._id <= from_version:
            continue
        gd.node.append(node_def_of(op, add_shapes))
    return gd


# -- import ------------------------------------------------------------------------------------

def _parse_input(s):
    if s.startswith("^"):
        return s[1:], -1
    name, _, idx = s.partition(":")
    return name, int(idx) if idx else 0


def import_graph_def(graph_def, input_map=None, return_elements=None, name=None, op_dict=None,
                     producer_op_list=None):
    """Import a GraphDef into the default graph (TensorFlow's ``import_graph_def``).

    Accepts readerlib's GraphDef, TensorFlow's (any message with the same
    fields is re-read from its bytes), or serialised bytes.  Ops are prefixed
    with ``name`` (default ``"import"``, unique-ified, under the current name
    scope; ``""`` keeps the names, unique-ifying clashes); ``input_map`` maps
    ``"name:0"`` of the GraphDef to Tensors of this graph.

    Returns
    -------
    None, or the list of Tensors / Operations named in ``return_elements``.

    Raises
    ------
    TypeError
        Not a GraphDef.
    ValueError
        An input that names no node of the GraphDef.
    NotFoundError
        An op type that is not registered.
    """
    if isinstance(graph_def, (bytes, bytearray, memoryview)):
        graph_def = GraphDef.FromString(bytes(graph_def))
    elif not isinstance(graph_def, GraphDef):
        if type(graph_def).__name__ == "GraphDef" and hasattr(graph_def, "SerializeToString"):
            graph_def = GraphDef.FromString(graph_def.SerializeToString())
        else:
            raise TypeError("Argument `graph_def` must be a GraphDef proto.")
    graph = get_default_graph()
    input_map = dict(input_map or {})
    for k, v in input_map.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"input_map values must be Tensors, got {type(v).__name__} for {k!r}")
    nodes = list(graph_def.node)
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        for s in n.input:
            src, _ = _parse_input(s)
            if src not in by_name:
                raise ValueError(f"Node '{n.name}': Unknown input node '{s}'")
        if get_op_type(n.op) is None:
            raise _errors.NotFoundError(None, None, _not_registered_msg(n.op))
    # topological order (GraphDefs need not be sorted)
    order, state = [], {}

    def visit(n):
        stack = [(n, False)]
        while stack:
            node, done = stack.pop()
            if done:
                if state.get(node.name) != 2:
                    state[node.name] = 2
                    order.append(node)
                continue
            if state.get(node.name) == 2:
                continue
            if state.get(node.name) == 1:
                raise ValueError(f"GraphDef has a cycle through node '{node.name}'")
            state[node.name] = 1
            stack.append((node, True))
            for s in reversed(node.input):
                src, _ = _parse_input(s)
                if state.get(src) != 2:
                    if state.get(src) == 1:
                        raise ValueError(f"GraphDef has a cycle through node '{src}'")
                    stack.append((by_name[src], False))
    for n in nodes:
        if state.get(n.name) != 2:
            visit(n)
    with graph.name_scope(name if name == "" else (name or "import")) as scope:
        prefix = scope
        created = {}
        for n in order:
            inputs, controls = [], []
            for s in n.input:
                src, idx = _parse_input(s)
                if idx < 0:
                    controls.append(created[src])
                    continue
                key = f"{src}:{idx}"
                if key in input_map:
                    inputs.append(input_map[key])
                elif idx == 0 and src in input_map:
                    inputs.append(input_map[src])
                else:
                    outs = created[src]._outputs
                    if idx >= len(outs):
                        raise ValueError(f"Node '{n.name}': Connecting to invalid output {idx} of "
                                         f"source node {src} which has {len(outs)} outputs.")
                    inputs.append(outs[idx])
            attrs = {k: _attr_value(v) for k, v in n.attr.items()}
            new_name = prefix + n.name if prefix else n.name
            if not prefix and new_name.lower() in graph._names_in_use:
                new_name = graph.unique_name(new_name)
            with graph.name_scope(""):
                op = graph.create_op(n.op, inputs, name=new_name + "/", attrs=attrs,
                                     compute_device=False)
            # the enclosing device scopes fill the fields the NodeDef's device leaves open
            op._device = n.device
            graph._apply_device_functions(op)
            # the NodeDef's control inputs, then every enclosing control_dependencies block
            # (TF gives each imported op all of them, without pruning)
            for c in controls + [c for ctl in graph._thread_state.control_stack
                                 for c in ctl.control_inputs]:
                if c not in op._control_inputs:
                    op._control_inputs.append(c)
            created[n.name] = op
    if return_elements is None:
        return None
    out = []
    for el in return_elements:
        src, _, idx = el.partition(":")
        if src not in created:
            raise ValueError(f"Requested return_element {el!r} not found in graph_def.")
        op = created[src]
        out.append(op._outputs[int(idx)] if idx else op)
    return out


def _not_registered_msg(op_type):
    from .ops import _not_registered
    return _not_registered(op_type)
