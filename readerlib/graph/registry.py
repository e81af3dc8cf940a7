"""The op registry: every op type declared once, looked up by name.

An :class:`OpType` says what an op takes and gives (inputs, outputs, attrs),
how its output dtypes and static shapes follow from its inputs
(``infer``), whether it is stateful, and its kernels, at most one per device
type (``"CPU"``, ``"GPU"``).  Graph construction only calls ``infer``;
``Session.run`` only calls kernels.

A kernel is ``kernel(ctx, inputs) -> sequence of outputs`` where ``ctx`` is
the op's :class:`KernelContext` in one Session (``ctx.op``, ``ctx.attrs``,
``ctx.resources``); it may return ``inputs`` items but must not modify the
list or the arrays in it.  Users register their own op types with a Python kernel::

    rg.register_op("Double", inputs=[("x", "T")], outputs=[("y", "T")],
                   attrs={"T": ("type", None)},
                   kernels={"CPU": lambda ctx, inputs: [inputs[0] * 2]})
    y = rg.apply_op("Double", [x])
"""
from __future__ import annotations

import threading

from . import dtypes as _dt

__all__ = ["OpType", "KernelContext", "register_op", "get_op_type", "registered_op_types",
           "ATTR_KINDS"]

#: Attr kinds (TensorFlow's OpDef attr types).
ATTR_KINDS = ("type", "shape", "tensor", "int", "float", "bool", "string",
              "list(type)", "list(shape)", "list(int)", "list(float)", "list(bool)", "list(string)")

_lock = threading.Lock()
_registry = {}


class KernelContext:
    """What a kernel sees of its op and its Session.

    Attributes
    ----------
    op : Operation
    attrs : dict
        The op's attrs (name -> Python value).
    resources : dict
        The Session's resource table (reader variables), keyed by
        ``(container, name)``; shared by every op of that Session.
    session : Session
    device : str
        ``"CPU"`` or ``"GPU"``: the kernel that was picked.
    """

    __slots__ = ("op", "attrs", "resources", "session", "device", "lock")

    def __init__(self, op, session, device):
        self.op = op
        self.attrs = op._attrs
        self.session = session
        self.resources = session._resources if session is not None else {}
        self.lock = session._resource_lock if session is not None else threading.RLock()
        self.device = device


class OpType:
    """One op type's declaration.

    Parameters
    ----------
    name : str
        The op type (``NodeDef.op``), e.g. ``"Identity"``.
    inputs : list of (name, typespec)
        ``typespec`` is an attr name (``"T"``: the input's dtype sets or must
        match that type attr), a dtype, or None (any dtype).
    outputs : list of (name, typespec)
        As ``inputs``; used when ``infer`` is None (shapes then unknown).
    attrs : dict name -> (kind, default)
        ``kind`` one of :data:`ATTR_KINDS`; ``default`` None means required
        (type attrs are also filled from the inputs).
    infer : callable, optional
        ``infer(inputs, attrs) -> list of (dtype, shape)``: output dtypes and
        static shapes (``shape`` a list of dims, None for unknown rank).
        It may raise ``TypeError`` / ``ValueError`` for bad inputs.
    stateful : bool
        Stateful ops are never folded or deduplicated and honour
        ``Graph.container`` when they have a ``container`` attr.
    kernels : dict device type -> kernel
        ``"CPU"`` and/or ``"GPU"``.
    constant_per_session : bool
        The outputs never change within one Session once computed (Const, a
        reader-creating op's variable): a Session's plan keeps them after the
        first run and skips the op from then on.
    """

    __slots__ = ("name", "inputs", "outputs", "attrs", "infer", "stateful", "kernels",
                 "constant_per_session")

    def __init__(self, name, inputs=(), outputs=(), attrs=None, infer=None, stateful=False,
                 kernels=None, constant_per_session=False):
        if not isinstance(name, str) or not name:
            raise TypeError(f"op type must be a non-empty str, got {name!r}")
        self.name = name
        self.inputs = [(n, _typespec(t)) for n, t in inputs]
        self.outputs = [(n, _typespec(t)) for n, t in outputs]
        self.attrs = {}
        for k, v in (attrs or {}).items():
            kind, default = v
            if kind not in ATTR_KINDS:
                raise ValueError(f"attr {k!r} of op type {name!r}: unknown kind {kind!r}; "
                                 f"use one of {', '.join(ATTR_KINDS)}")
            self.attrs[k] = (kind, default)
        self.infer = infer
        self.stateful = bool(stateful)
        self.kernels = dict(kernels or {})
        self.constant_per_session = bool(constant_per_session)
        for dev in self.kernels:
            if dev not in ("CPU", "GPU"):
                raise ValueError(f"kernel device type must be 'CPU' or 'GPU', got {dev!r}")

    def output_specs(self, inputs, attrs):
        """[(dtype, TensorShape)] for an op with these input Tensors and attrs."""
        if self.infer is not None:
            return [(_dt.as_dtype(d), _dt.as_shape(s)) for d, s in self.infer(inputs, attrs)]
        out = []
        for oname, spec in self.outputs:
            if isinstance(spec, str):
                dtype = attrs.get(spec)
                if dtype is None:
                    raise TypeError(f"output {oname!r} of {self.name}: type attr {spec!r} is not set")
            elif spec is None:
                raise TypeError(f"output {oname!r} of {self.name} needs a dtype or an infer function")
            else:
                dtype = spec
            out.append((_dt.as_dtype(dtype), _dt.TensorShape(None)))
        return out

    def __repr__(self):
        return f"OpType({self.name!r}, kernels={sorted(self.kernels)})"


def _typespec(t):
    if t is None or isinstance(t, str):
        return t
    return _dt.as_dtype(t)


def register_op(name, inputs=(), outputs=(), attrs=None, infer=None, stateful=False,
                kernels=None, *, constant_per_session=False, replace=False):
    """Declare an op type (see :class:`OpType`); returns it.

    Raises
    ------
    KeyError
        ``name`` is registered already (pass ``replace=True`` to redefine it).
    """
    op_type = name if isinstance(name, OpType) else OpType(
        name, inputs, outputs, attrs, infer, stateful, kernels, constant_per_session)
    with _lock:
        if op_type.name in _registry and not replace:
            raise KeyError(f"Op type {op_type.name!r} is already registered; "
                           "pass replace=True to redefine it")
        _registry[op_type.name] = op_type
    return op_type


def get_op_type(name):
    """The registered OpType, or None."""
    return _registry.get(name)


def registered_op_types():
    """Sorted names of every registered op type."""
    return sorted(_registry)
