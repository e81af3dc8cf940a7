"""Graph, Operation, Tensor: TensorFlow 1's ``tf.Graph`` semantics.

Design: follows ``tensorflow/python/framework/ops.py`` (TF 2.21, graph mode)
method by method -- ``unique_name``, name scopes and their two regexes,
control-dependency controllers with TF's pruning, the device-function stack
merged innermost first, colocation, containers, collections, finalize,
feed/fetch guards, gradient override maps.  The per-thread state (name,
device, colocation and control-dependency stacks, container, override map)
is thread-local from the start, as TF 2's ``Graph.__init__`` does through
``switch_to_thread_local()``; the op table, names in use and collections are
shared and guarded by one lock.  Ops are plain Python objects; kernels run
only in :class:`readerlib.graph.Session`.
"""
from __future__ import annotations

import contextlib
import re
import threading

import numpy as np

from . import dtypes as _dt
from .registry import get_op_type

__all__ = ["Graph", "Operation", "Tensor", "GraphKeys", "get_default_graph", "reset_default_graph",
           "name_scope", "control_dependencies", "device", "colocate_with", "container",
           "InaccessibleTensorError", "DeviceSpec"]

# Copied from TF's ops.py ("copied from core/framework/node_def_util.cc").
_VALID_OP_NAME_REGEX = re.compile(r"^[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*$")
_VALID_SCOPE_NAME_REGEX = re.compile(r"^[A-Za-z0-9_.\\/>-]*$")


class InaccessibleTensorError(ValueError):
    """A fetch of an op marked not fetchable (TensorFlow's InaccessibleTensorError)."""


class GraphKeys:
    """Standard collection names (TensorFlow's ``tf.compat.v1.GraphKeys``)."""
    GLOBAL_VARIABLES = "variables"
    LOCAL_VARIABLES = "local_variables"
    TRAINABLE_VARIABLES = "trainable_variables"
    UPDATE_OPS = "update_ops"
    LOSSES = "losses"
    SUMMARIES = "summaries"
    QUEUE_RUNNERS = "queue_runners"
    TABLE_INITIALIZERS = "table_initializer"
    ASSET_FILEPATHS = "asset_filepaths"
    #: readerlib: every reader-creating op's reader variable.
    READERS = "readers"


def _name_from_scope_name(name):
    return name[:-1] if (name and name[-1] == "/") else name


# -- Tensor / Operation ----------------------------------------------------------

class Tensor:
    """One output of an Operation: a symbolic value, computed by ``Session.run``.

    Hashable and compared by identity (usable as a ``feed_dict`` key).
    ``dtype`` is a NumPy dtype; ``shape`` a :class:`TensorShape`.
    """

    __slots__ = ("_op", "_value_index", "_dtype", "_shape", "__weakref__")

    def __init__(self, op, value_index, dtype, shape):
        self._op = op
        self._value_index = value_index
        self._dtype = dtype
        self._shape = shape

    op = property(lambda self: self._op, doc="The Operation that produces this tensor.")
    value_index = property(lambda self: self._value_index, doc="Output index in ``op.outputs``.")
    dtype = property(lambda self: self._dtype, doc="NumPy dtype of the value.")
    shape = property(lambda self: self._shape, doc="Static TensorShape.")
    graph = property(lambda self: self._op._graph, doc="The Graph of the op.")
    device = property(lambda self: self._op._device, doc="The op's device.")

    @property
    def name(self):
        """``"<op name>:<index>"``."""
        return f"{self._op._name}:{self._value_index}"

    def get_shape(self):
        return self._shape

    def eval(self, feed_dict=None, session=None):
        """``session.run(self, feed_dict)`` (default: the default session)."""
        from .session import get_default_session
        session = session or get_default_session()
        if session is None:
            raise ValueError("Cannot evaluate tensor using `eval()`: No default session is "
                             "registered. Use `with sess.as_default()` or pass an explicit "
                             "session to `eval(session=sess)`")
        return session.run(self, feed_dict)

    def consumers(self):
        """Operations that take this tensor as input."""
        return [op for op in self._op._graph._ops if any(t is self for t in op._inputs)]

    def __repr__(self):
        return f"<rg.Tensor '{self.name}' shape={self._shape} dtype={self._dtype}>"

    def __str__(self):
        return f'Tensor("{self.name}", shape={self._shape}, dtype={self._dtype})'

    def __iter__(self):
        raise TypeError("Iterating over a symbolic `rg.Tensor` is not allowed: a Tensor is a "
                        "graph value; pass a list of Tensors where several are meant")

    def __bool__(self):
        raise TypeError("Using a symbolic `rg.Tensor` as a Python `bool` is not allowed; "
                        "its value exists only inside Session.run")

    def __add__(self, other):
        from .array_ops import add
        return add(self, other)

    def __radd__(self, other):
        from .array_ops import add
        return add(other, self)

    __hash__ = object.__hash__


class Operation:
    """A node of a Graph: an op type applied to input Tensors, with attrs.

    Attributes
    ----------
    name, type, inputs, outputs, control_inputs, device, graph
    """

    __slots__ = ("_graph", "_name", "_type", "_op_type", "_inputs", "_outputs", "_control_inputs",
                 "_attrs", "_device", "_id", "__weakref__")

    def __init__(self, graph, name, op_type, inputs, attrs, output_specs, control_inputs, op_id):
        self._graph = graph
        self._name = name
        self._op_type = op_type
        self._type = op_type.name
        self._inputs = tuple(inputs)
        self._attrs = attrs
        self._control_inputs = list(control_inputs)
        self._device = ""
        self._id = op_id
        self._outputs = [Tensor(self, i, d, s) for i, (d, s) in enumerate(output_specs)]

    name = property(lambda self: self._name, doc="Unique name in the graph.")
    type = property(lambda self: self._type, doc="The op type (``NodeDef.op``).")
    inputs = property(lambda self: self._inputs, doc="Data input Tensors (a tuple).")
    outputs = property(lambda self: list(self._outputs), doc="Output Tensors (a list).")
    control_inputs = property(lambda self: list(self._control_inputs),
                              doc="Operations that run before this one.")
    device = property(lambda self: self._device, doc="Device string (``\"\"`` when unplaced).")
    graph = property(lambda self: self._graph)

    def values(self):
        """The outputs as a tuple."""
        return tuple(self._outputs)

    def get_attr(self, name):
        """The attr's value: NumPy dtype for types, bytes for strings, TensorShape for
        shapes, ndarray for tensors, list for lists.

        Raises
        ------
        ValueError
            ``Operation '{name}' has no attr named '{attr}'.``
        """
        try:
            return self._attrs[name]
        except KeyError:
            raise ValueError(f"Operation '{self._name}' has no attr named '{name}'.") from None

    def _set_attr(self, name, value):
        self._attrs[name] = value

    @property
    def node_def(self):
        """This op's NodeDef message (TensorFlow's wire format)."""
        from .graph_def import node_def_of
        return node_def_of(self)

    def colocation_groups(self):
        """``[b"loc:@<name>"]`` or the op's ``_class`` groups."""
        default = [b"loc:@" + self._name.encode()]
        groups = [c for c in self._attrs.get("_class", ()) if c.startswith(b"loc:@")]
        return groups or default

    def run(self, feed_dict=None, session=None):
        from .session import get_default_session
        (session or get_default_session()).run(self, feed_dict)

    def __repr__(self):
        return f"<rg.Operation '{self._name}' type={self._type}>"

    def __str__(self):
        return f'name: "{self._name}"\nop: "{self._type}"'

    __hash__ = object.__hash__


# -- devices ------------------------------------------------------------------------

_VALID_DEVICE_TYPES = ("CPU", "GPU", "TPU")


class DeviceSpec:
    """A parsed device string (TensorFlow's DeviceSpec): job, replica, task, type, index."""

    __slots__ = ("job", "replica", "task", "device_type", "device_index")

    def __init__(self, job=None, replica=None, task=None, device_type=None, device_index=None):
        self.job = job
        self.replica = replica
        self.task = task
        self.device_type = device_type.upper() if device_type in ("cpu", "gpu") else device_type
        self.device_index = device_index

    @classmethod
    def from_string(cls, spec):
        """Parse as TF does (``"/cpu:0"``, ``"/job:w/gpu:2"``, ``"/device:GPU:0"``)."""
        job = replica = task = device_type = device_index = None
        spec = spec or ""
        for y in (x.split(":") for x in spec.split("/")):
            ly = len(y)
            if not y:
                continue
            if ly == 2 and y[0] == "job":
                job = y[1]
            elif ly == 2 and y[0] == "replica":
                replica = int(y[1])
            elif ly == 2 and y[0] == "task":
                task = int(y[1])
            elif ly in (1, 2) and y[0].upper() in _VALID_DEVICE_TYPES:
                if device_type is not None:
                    raise ValueError(f"Multiple device types are not allowed while parsing the "
                                     f"device spec: {spec}.")
                device_type = y[0].upper()
                if ly == 2 and y[1] != "*":
                    device_index = int(y[1])
            elif ly == 3 and y[0] == "device":
                if device_type is not None:
                    raise ValueError(f"Multiple device types are not allowed while parsing the "
                                     f"device spec: {spec}.")
                device_type = y[1]
                if y[2] != "*":
                    device_index = int(y[2])
            elif ly and y[0] != "":
                raise ValueError(f"Unknown attribute '{y[0]}' is encountered while parsing the "
                                 f"device spec: '{spec}'.")
        return cls(job, replica, task, device_type, device_index)

    def merged_into(self, dev):
        """``dev``'s fields where set, else this spec's (TF's make_merged_spec)."""
        return DeviceSpec(
            dev.job if dev.job is not None else self.job,
            dev.replica if dev.replica is not None else self.replica,
            dev.task if dev.task is not None else self.task,
            dev.device_type if dev.device_type is not None else self.device_type,
            dev.device_index if dev.device_index is not None else self.device_index)

    def to_string(self):
        out = []
        if self.job is not None:
            out.append(f"/job:{self.job}")
        if self.replica is not None:
            out.append(f"/replica:{self.replica}")
        if self.task is not None:
            out.append(f"/task:{self.task}")
        if self.device_type is not None:
            idx = "*" if self.device_index is None else self.device_index
            out.append(f"/device:{self.device_type}:{idx}")
        return "".join(out)


def canonical_device(spec):
    """``"/cpu:0"`` -> ``"/device:CPU:0"`` (TensorFlow's canonical device string)."""
    return DeviceSpec.from_string(spec).to_string()


def device_type_of(device):
    """``"CPU"``, ``"GPU"`` ... of a device string; ``"CPU"`` when unset."""
    if not device:
        return "CPU"
    try:
        t = DeviceSpec.from_string(device).device_type
    except ValueError:
        return "CPU"
    return t or "CPU"


class _DeviceEntry:
    __slots__ = ("function", "spec", "is_null_merge")

    def __init__(self, device_name_or_function):
        if device_name_or_function is None:
            self.function, self.spec, self.is_null_merge = None, None, False
        elif callable(device_name_or_function):
            self.function, self.spec, self.is_null_merge = device_name_or_function, None, False
        else:
            if isinstance(device_name_or_function, bytes):
                device_name_or_function = device_name_or_function.decode()
            self.spec = DeviceSpec.from_string(device_name_or_function)
            self.function = True
            self.is_null_merge = not self.spec.to_string()

    def merge(self, op):
        if self.spec is not None:
            return self.spec.merged_into(DeviceSpec.from_string(op._device)).to_string()
        result = self.function(op)
        if isinstance(result, DeviceSpec):
            result = result.to_string()
        if isinstance(result, bytes):
            result = result.decode()
        if not isinstance(result, str):
            raise TypeError(f"Expected binary or unicode string, got {result!r}")
        return result


# -- control dependencies ----------------------------------------------------------

class _ControlDependenciesController:
    """One ``control_dependencies`` block (TF's _ControlDependenciesController)."""

    def __init__(self, graph, control_inputs):
        self._graph = graph
        if control_inputs is None:
            control_inputs, self._new_stack = [], True
        else:
            self._new_stack = False
        self.control_inputs = control_inputs
        self._seen = set()

    def __enter__(self):
        st = self._graph._thread_state
        if self._new_stack:
            self._old_stack = st.control_stack
            st.control_stack = []
        st.control_stack.append(self)

    def __exit__(self, *exc):
        st = self._graph._thread_state
        st.control_stack.pop()
        if self._new_stack:
            st.control_stack = self._old_stack

    def add_op(self, op):
        self._seen.add(op)

    def op_in_group(self, op):
        return op in self._seen


# -- Graph ------------------------------------------------------------------------------

class _ThreadState(threading.local):
    def __init__(self):
        self.name_stack = ""
        self.control_stack = []
        self.device_stack = []
        self.colocation_stack = []
        self.container = ""
        self.gradient_override_map = {}


class Graph:
    """A dataflow graph of Operations and Tensors (TensorFlow 1's ``tf.Graph``).

    Build under ``with g.as_default():`` (or pass ops the graph of their
    inputs), run with ``Session(graph=g)``.

    Examples
    --------
    >>> g = Graph()
    >>> with g.as_default():
    ...     with name_scope("a"):
    ...         c = constant(1.0, name="c")
    >>> c.name, g.unique_name("a")
    ('a/c:0', 'a_1')
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._ops = []
        self._nodes_by_name = {}
        self._names_in_use = {}
        self._collections = {}
        self._finalized = False
        self._version = 0
        self._mutation = 0          # bumps whenever a cached Session plan could go stale
        self._unfeedable = set()
        self._unfetchable = set()
        self._thread_state = _ThreadState()
        self._gradient_function_map = {}
        self._seed = None

    # -- default graph ---------------------------------------------------------
    @contextlib.contextmanager
    def as_default(self):
        """Make this the default graph of the current thread for the block (a stack)."""
        stack = _default_graph_stack()
        stack.append(self)
        try:
            yield self
        finally:
            # pop this graph (tolerate a caller that left inner blocks unbalanced)
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break

    def switch_to_thread_local(self):
        """No-op: the name, device, colocation and control stacks are per thread already
        (TensorFlow 2's Graph calls this in ``__init__``)."""

    # -- properties ----------------------------------------------------------------
    @property
    def finalized(self):
        return self._finalized

    @property
    def version(self):
        """Number of ops created so far (TF: the last op's id)."""
        return self._version

    @property
    def collections(self):
        """Every collection key, tuples included."""
        return list(self._collections)

    @property
    def building_function(self):
        return False

    @property
    def seed(self):
        """The graph-level random seed (None unless set)."""
        return self._seed

    @seed.setter
    def seed(self, seed):
        self._seed = seed

    @property
    def graph_def_versions(self):
        """The VersionDef written into this graph's GraphDefs."""
        from .graph_def import PRODUCER_VERSION, VersionDef
        return VersionDef(producer=PRODUCER_VERSION)

    def finalize(self):
        """Make the graph read-only: creating ops, importing and collection edits then raise
        ``RuntimeError: Graph is finalized and cannot be modified.``"""
        self._finalized = True

    def _check_not_finalized(self):
        if self._finalized:
            raise RuntimeError("Graph is finalized and cannot be modified.")

    # -- names ------------------------------------------------------------------------
    def unique_name(self, name, mark_as_used=True):
        """A name not yet used in this graph under the current name scope (TF's algorithm:
        case-insensitive, ``foo``, ``foo_1``, ``foo_2``; the caller's case is kept)."""
        name_stack = self._thread_state.name_stack
        if name_stack:
            name = name_stack + "/" + name
        name_key = name.lower()
        with self._lock:
            names = self._names_in_use
            i = names.get(name_key, 0)
            if mark_as_used:
                names[name_key] = i + 1
            if i > 0:
                base_key = name_key
                while name_key in names:
                    name_key = "%s_%d" % (base_key, i)
                    i += 1
                if mark_as_used:
                    names[name_key] = 1
                name = "%s_%d" % (name, i - 1)
        return name

    def get_name_scope(self):
        """The current name scope without the trailing ``/`` (``""`` at the root)."""
        return self._thread_state.name_stack

    @contextlib.contextmanager
    def name_scope(self, name):
        """A scope for op names: yields ``"name/"`` (unique-ified); a name ending in ``/``
        is absolute; ``""`` or None resets to the root.

        Raises
        ------
        ValueError
            A name that does not match TensorFlow's root or scope regex.
        """
        st = self._thread_state
        if name:
            if isinstance(name, bytes):
                name = name.decode()
            if st.name_stack:
                if not _VALID_SCOPE_NAME_REGEX.match(name):
                    raise ValueError(
                        f"'{name}' is not a valid scope name. A scope name has to match the "
                        f"following pattern: {_VALID_SCOPE_NAME_REGEX.pattern}")
            elif not _VALID_OP_NAME_REGEX.match(name):
                raise ValueError(
                    f"'{name}' is not a valid root scope name. A root scope name has to match "
                    f"the following pattern: {_VALID_OP_NAME_REGEX.pattern}")
        old_stack = st.name_stack
        if not name:
            new_stack, returned = "", ""
        elif name[-1] == "/":
            new_stack, returned = _name_from_scope_name(name), name
        else:
            new_stack = self.unique_name(name)
            returned = new_stack + "/"
        st.name_stack = new_stack
        try:
            yield returned
        finally:
            st.name_stack = old_stack

    # -- op creation ----------------------------------------------------------------------
    def create_op(self, op_type, inputs, dtypes=None, input_types=None, name=None, attrs=None,
                  op_def=None, compute_shapes=True, compute_device=True):
        """Add an op of a registered type; returns the Operation.

        ``dtypes``, ``input_types``, ``op_def`` and ``compute_shapes`` are
        accepted for TensorFlow compatibility and ignored (output types and
        shapes come from the op registry).  Type attrs (``T``) are inferred
        from the inputs when not given.

        Raises
        ------
        RuntimeError
            A finalized graph; an op type that is not registered.
        TypeError
            A non-Tensor input, or an input whose dtype does not match.
        ValueError
            An invalid or duplicate name; another graph's tensor.
        """
        self._check_not_finalized()
        if name is None:
            name = op_type
        if name and name[-1] == "/":
            name = _name_from_scope_name(name)
        else:
            name = self.unique_name(name)
        if not _VALID_OP_NAME_REGEX.match(name):
            raise ValueError(f"`{name}` is not a valid node name. Accepted names conform to "
                             f"Regex /{_VALID_OP_NAME_REGEX}/")
        inputs = list(inputs)
        for idx, a in enumerate(inputs):
            if not isinstance(a, Tensor):
                raise TypeError("Input #%d is not a tensor: %s" % (idx, a))
            if a._op._graph is not self:
                raise ValueError(f"Tensor {a} is not an element of this graph.")
        spec = get_op_type(op_type)
        if spec is None:
            raise RuntimeError(_not_registered(op_type))
        full_attrs = _resolve_attrs(spec, inputs, dict(attrs or {}))
        output_specs = spec.output_specs(inputs, full_attrs)
        input_ops = {t._op for t in inputs}
        with self._lock:
            if name in self._nodes_by_name:
                raise ValueError(f"Duplicate node name in graph: '{name}'")
            control_inputs = self._control_dependencies_for_inputs(input_ops)
            op = Operation(self, name, spec, inputs, full_attrs, output_specs, control_inputs,
                           self._version + 1)
            self._add_op(op)
        self._create_op_helper(op, compute_device)
        return op

    def _add_op(self, op):
        self._ops.append(op)
        self._nodes_by_name[op._name] = op
        self._version += 1
        self._mutation += 1
        key = op._name.lower()
        if key not in self._names_in_use:
            self._names_in_use[key] = 1

    def _create_op_helper(self, op, compute_device=True):
        st = self._thread_state
        mapped = st.gradient_override_map.get(op._type)
        if mapped is not None:
            op._attrs["_gradient_op_type"] = mapped.encode()
        for controller in st.control_stack:
            controller.add_op(op)
        if compute_device:
            self._apply_device_functions(op)
        if st.colocation_stack:
            groups = []
            device_set = False
            for colo_op in reversed(st.colocation_stack):
                groups.extend(colo_op.colocation_groups())
                if colo_op._device and not device_set:
                    op._device = colo_op._device
                    device_set = True
            op._attrs["_class"] = sorted(set(groups))
        if st.container and op._op_type.stateful and op._attrs.get("container", None) == b"":
            op._attrs["container"] = st.container.encode()

    def _apply_device_functions(self, op):
        for entry in reversed(self._thread_state.device_stack):
            if entry.is_null_merge:
                continue
            if entry.function is None:
                break
            op._device = entry.merge(op)

    # -- control dependencies -------------------------------------------------------------
    def _control_dependencies_for_inputs(self, input_ops):
        ret = []
        for controller in self._thread_state.control_stack:
            dominated = False
            for op in input_ops:
                if controller.op_in_group(op):
                    dominated = True
                    break
            if not dominated:
                ret.extend(c for c in controller.control_inputs if c not in input_ops)
        return ret

    def _current_control_dependencies(self):
        ret = set()
        for controller in self._thread_state.control_stack:
            ret.update(controller.control_inputs)
        return ret

    def control_dependencies(self, control_inputs):
        """Ops created in the block run after ``control_inputs`` (Operations, Tensors or
        names); nested blocks add up; None clears.  TF's pruning: a block adds nothing to
        an op that takes a data input created inside the block, and never a control input
        that is already a data input."""
        if control_inputs is None:
            return _ControlDependenciesController(self, None)
        if isinstance(control_inputs, Tensor):
            iter(control_inputs)        # TF: "Iterating over a symbolic Tensor is not allowed"
        control_ops = []
        current = self._current_control_dependencies()
        for c in control_inputs:
            c = self.as_graph_element(c)
            if isinstance(c, Tensor):
                c = c._op
            elif not isinstance(c, Operation):
                raise TypeError(f"Control input must be Operation or Tensor: {c}")
            if c not in current:
                control_ops.append(c)
                current.add(c)
                c._attrs["_has_manual_control_dependencies"] = True
        return _ControlDependenciesController(self, control_ops)

    # -- device, colocation, container, gradient override --------------------------------
    @contextlib.contextmanager
    def device(self, device_name_or_function):
        """Default device of new ops: a string (merged field by field with the enclosing
        ones, innermost first), a function ``f(op) -> str``, or None (ignore enclosing)."""
        entry = _DeviceEntry(device_name_or_function)
        stack = self._thread_state.device_stack
        stack.append(entry)
        try:
            yield
        finally:
            stack = self._thread_state.device_stack
            if not stack or stack[-1] is not entry:
                raise RuntimeError("Exiting device scope without proper scope nesting.")
            stack.pop()

    @contextlib.contextmanager
    def colocate_with(self, op, ignore_existing=False):
        """Ops created in the block are colocated with ``op`` (attr ``_class``) and take
        its device."""
        if op is None and not ignore_existing:
            raise ValueError("Trying to reset colocation (op is None) but ignore_existing is "
                             "not True")
        if isinstance(op, Tensor):
            op = op._op
        elif op is not None and not isinstance(op, Operation):
            from .array_ops import constant
            op = constant(op)._op    # TF converts anything else to a tensor
        st = self._thread_state
        device_tmp = st.device_stack
        st.device_stack = []
        if ignore_existing:
            colo_tmp = st.colocation_stack
            st.colocation_stack = []
        if op is not None:
            st.colocation_stack.append(op)
        try:
            yield
        finally:
            st.device_stack = device_tmp
            if op is not None:
                st.colocation_stack.pop()
            if ignore_existing:
                st.colocation_stack = colo_tmp

    @contextlib.contextmanager
    def container(self, container_name):
        """Stateful ops with a ``container`` attr created in the block get this container
        (reader variables live per (container, name) in a Session)."""
        st = self._thread_state
        original = st.container
        st.container = container_name
        try:
            yield container_name
        finally:
            st.container = original

    @contextlib.contextmanager
    def gradient_override_map(self, op_type_map):
        """Ops of a mapped type created in the block use the mapped gradient
        (attr ``_gradient_op_type``)."""
        if not isinstance(op_type_map, dict):
            raise TypeError("op_type_map must be a dictionary mapping strings to strings")
        st = self._thread_state
        saved = {}
        for op_type, mapped in op_type_map.items():
            if not (isinstance(op_type, str) and isinstance(mapped, str)):
                raise TypeError("op_type_map must be a dictionary mapping strings to strings")
            saved[op_type] = st.gradient_override_map.get(op_type)
            st.gradient_override_map[op_type] = mapped
        try:
            yield
        finally:
            for op_type, old in saved.items():
                if old is None:
                    del st.gradient_override_map[op_type]
                else:
                    st.gradient_override_map[op_type] = old

    # -- lookup ------------------------------------------------------------------------------
    def get_operations(self):
        """Every Operation in creation order (a new list)."""
        with self._lock:
            return list(self._ops)

    def get_operation_by_name(self, name):
        if not isinstance(name, str):
            raise TypeError(f"Operation names are strings (or similar), not {type(name).__name__}.")
        return self.as_graph_element(name, allow_tensor=False, allow_operation=True)

    def get_tensor_by_name(self, name):
        if not isinstance(name, str):
            raise TypeError(f"Tensor names are strings (or similar), not {type(name).__name__}.")
        return self.as_graph_element(name, allow_tensor=True, allow_operation=False)

    def as_graph_element(self, obj, allow_tensor=True, allow_operation=True):
        """The Tensor or Operation that ``obj`` (an element or its name) denotes, with
        TensorFlow's messages for every way it can fail."""
        if allow_tensor and allow_operation:
            types_str = "Tensor or Operation"
        elif allow_tensor:
            types_str = "Tensor"
        elif allow_operation:
            types_str = "Operation"
        else:
            raise ValueError("allow_tensor and allow_operation can't both be False.")
        temp = getattr(obj, "_as_graph_element", None)
        if temp is not None and not isinstance(obj, (Tensor, Operation)):
            obj = temp() or obj
        if isinstance(obj, bytes):
            obj = obj.decode()
        if isinstance(obj, str):
            name = obj
            if ":" in name and allow_tensor:
                try:
                    op_name, out_n = name.split(":")
                    out_n = int(out_n)
                except (ValueError, TypeError):
                    raise ValueError(
                        f"The name {name!r} looks a like a Tensor name, but is not a valid one. "
                        'Tensor names must be of the form "<op_name>:<output_index>".') from None
                op = self._nodes_by_name.get(op_name)
                if op is None:
                    raise KeyError(
                        f"The name {name!r} refers to a Tensor which does not exist. The "
                        f"operation, {op_name!r}, does not exist in the graph.")
                try:
                    return op._outputs[out_n]
                except IndexError:
                    raise KeyError(
                        f"The name {name!r} refers to a Tensor which does not exist. The "
                        f"operation, {op_name!r}, exists but only has "
                        f"{len(op._outputs)} outputs.") from None
            elif ":" in name and not allow_tensor:
                raise ValueError(f"Name {name!r} appears to refer to a Tensor, not a {types_str}.")
            elif ":" not in name and allow_operation:
                op = self._nodes_by_name.get(name)
                if op is None:
                    raise KeyError(f"The name {name!r} refers to an Operation not in the graph.")
                return op
            else:
                if name in self._nodes_by_name:
                    raise ValueError(
                        f"The name {name!r} refers to an Operation, not a {types_str}. Tensor "
                        'names must be of the form "<op_name>:<output_index>".')
                raise ValueError(
                    f"The name {name!r} looks like an (invalid) Operation name, not a "
                    f'{types_str}. Tensor names must be of the form "<op_name>:<output_index>".')
        elif isinstance(obj, Tensor) and allow_tensor:
            if obj.graph is not self:
                raise ValueError(f"Tensor {obj} is not an element of this graph.")
            return obj
        elif isinstance(obj, Operation) and allow_operation:
            if obj._graph is not self:
                raise ValueError(f"Operation {obj} is not an element of this graph.")
            return obj
        else:
            kind = "SymbolicTensor" if isinstance(obj, Tensor) else type(obj).__name__
            raise TypeError(f"Can not convert a {kind} into a {types_str}.")

    # -- collections ------------------------------------------------------------------------
    def add_to_collection(self, name, value):
        self._check_not_finalized()
        with self._lock:
            self._collections.setdefault(name, []).append(value)

    def add_to_collections(self, names, value):
        names = (names,) if isinstance(names, str) else set(names)
        for name in names:
            self.add_to_collection(name, value)

    def get_collection_ref(self, name):
        """The collection's live list (created empty when missing)."""
        with self._lock:
            coll = self._collections.get(name)
            if coll is None:
                coll = self._collections[name] = []
            return coll

    def get_collection(self, name, scope=None):
        """A copy of the collection; with ``scope``, the items whose ``.name`` matches it
        (``re.match``, a prefix)."""
        with self._lock:
            coll = self._collections.get(name)
            if coll is None:
                return []
            if scope is None:
                return list(coll)
            out = []
            regex = re.compile(scope)
            for item in coll:
                try:
                    if regex.match(item.name):
                        out.append(item)
                except AttributeError:
                    pass
            return out

    def get_all_collection_keys(self):
        with self._lock:
            return [k for k in self._collections if isinstance(k, str)]

    def clear_collection(self, name):
        self._check_not_finalized()
        with self._lock:
            self._collections.pop(name, None)

    # -- feed / fetch guards --------------------------------------------------------------------
    def prevent_feeding(self, tensor):
        self._unfeedable.add(tensor)
        self._mutation += 1

    def is_feedable(self, tensor):
        return tensor not in self._unfeedable

    def prevent_fetching(self, op):
        self._unfetchable.add(op)
        self._mutation += 1

    def is_fetchable(self, tensor_or_op):
        if isinstance(tensor_or_op, Tensor):
            return tensor_or_op._op not in self._unfetchable
        return tensor_or_op not in self._unfetchable

    # -- GraphDef --------------------------------------------------------------------------------
    def as_graph_def(self, from_version=None, add_shapes=False):
        """This graph as a GraphDef message (TensorFlow's wire format).

        ``from_version`` selects the ops created after the graph had that
        ``version`` (what TF's docstring says; TF 2.21 ignores it).
        """
        from .graph_def import graph_to_graph_def
        return graph_to_graph_def(self, from_version, add_shapes)

    def _get_control_flow_context(self):
        return None


def _not_registered(op_type):
    import socket
    return (f"Op type not registered '{op_type}' in binary running on {socket.gethostname()}. "
            "Make sure the Op and Kernel are registered in the binary running in this process "
            "(readerlib.graph.register_op).")


def _resolve_attrs(spec, inputs, attrs):
    """Fill defaults and type attrs from the inputs; check arity and dtypes (TF's
    _apply_op_helper messages)."""
    if len(inputs) != len(spec.inputs):
        raise ValueError(f"{spec.name} takes {len(spec.inputs)} input(s) "
                         f"({', '.join(n for n, _ in spec.inputs) or 'none'}), got {len(inputs)}")
    inferred_from = {}
    for (iname, tspec), t in zip(spec.inputs, inputs):
        if isinstance(tspec, str):
            if tspec in attrs and attrs[tspec] is not None:
                want = _dt.as_dtype(attrs[tspec])
                if t._dtype != want:
                    if tspec in inferred_from:
                        raise TypeError(
                            f"Input '{iname}' of '{spec.name}' Op has type {t._dtype} that does not "
                            f"match type {want} of argument '{inferred_from[tspec]}'.")
                    raise TypeError(f"Input '{iname}' of '{spec.name}' Op has type {t._dtype} "
                                    f"that does not match expected type of {want}.")
            else:
                attrs[tspec] = t._dtype
                inferred_from[tspec] = iname
        elif tspec is not None and t._dtype != tspec:
            raise TypeError(f"Input '{iname}' of '{spec.name}' Op has type {t._dtype} that does "
                            f"not match expected type of {tspec}.")
    for k, (kind, default) in spec.attrs.items():
        if k not in attrs or attrs[k] is None:
            if default is None:
                raise ValueError(f"{spec.name}: attr '{k}' ({kind}) is required")
            attrs[k] = default
        attrs[k] = _coerce_attr(kind, attrs[k], spec.name, k)
    for k, v in attrs.items():
        if k not in spec.attrs and isinstance(v, str):
            attrs[k] = v.encode()
    return attrs


def _coerce_attr(kind, v, op_type, name):
    try:
        if kind == "type":
            return _dt.as_dtype(v)
        if kind == "shape":
            return _dt.as_shape(v)
        if kind == "string":
            return v.encode() if isinstance(v, str) else bytes(v)
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"expected an int, got {v!r}")
            return int(v)
        if kind == "float":
            return float(v)
        if kind == "bool":
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"expected a bool, got {v!r}")
            return bool(v)
        if kind == "tensor":
            return np.asarray(v)
        if kind == "list(string)":
            return [x.encode() if isinstance(x, str) else bytes(x) for x in v]
        if kind == "list(int)":
            return [int(x) for x in v]
        if kind == "list(float)":
            return [float(x) for x in v]
        if kind == "list(bool)":
            return [bool(x) for x in v]
        if kind == "list(type)":
            return [_dt.as_dtype(x) for x in v]
        if kind == "list(shape)":
            return [_dt.as_shape(x) for x in v]
    except (TypeError, ValueError) as e:
        raise TypeError(f"attr '{name}' of {op_type} must be {kind}: {e}") from None
    return v


# -- the default graph (a thread-local stack; the global default is per thread too) ----------

class _DefaultStack(threading.local):
    def __init__(self):
        self.stack = []
        self.global_graph = None


_default = _DefaultStack()


def _default_graph_stack():
    return _default.stack


def get_default_graph():
    """The innermost ``as_default()`` graph of this thread, else this thread's global graph."""
    stack = _default.stack
    if stack:
        return stack[-1]
    if _default.global_graph is None:
        _default.global_graph = Graph()
    return _default.global_graph


def reset_default_graph():
    """Replace this thread's global default graph with a new one."""
    if _default.stack:
        raise AssertionError("Do not use tf.reset_default_graph() to clear nested graphs. If you "
                             "need a cleared graph, exit the nesting and create a new graph.")
    _default.global_graph = Graph()


def name_scope(name):
    """``get_default_graph().name_scope(name)``."""
    return get_default_graph().name_scope(name)


def control_dependencies(control_inputs):
    """``get_default_graph().control_dependencies(control_inputs)``."""
    return get_default_graph().control_dependencies(control_inputs)


def device(device_name_or_function):
    """``get_default_graph().device(device_name_or_function)``."""
    return get_default_graph().device(device_name_or_function)


def colocate_with(op, ignore_existing=False):
    return get_default_graph().colocate_with(op, ignore_existing)


def container(container_name):
    return get_default_graph().container(container_name)
