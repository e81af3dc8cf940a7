"""Session: runs the part of a Graph that a fetch needs (TF 1's ``tf.compat.v1.Session``).

Design: ``run(fetches, feed_dict)`` maps the fetch structure to a flat list
of unique elements (TensorFlow's ``_FetchMapper``), prunes the graph to the
ops those elements need (data and control inputs, stopping at fed tensors),
orders them by creation (a topological order: inputs and control inputs
always exist before their consumer), picks each op's kernel from its device
and compiles a plan: a list of ``(kernel, context, input slots, output
slots)`` over one flat value list.  The plan is cached per (fetch structure,
fed tensors) and re-made when the graph changes; a step then costs a key
lookup, the feed conversion and one Python call per op.  Each op runs at
most once per ``run``.  Every ``run`` has its own value list, so concurrent
runs from several threads are safe; stateful kernels (readers) serialise on
their own locks.  Reader variables and other resources live in the Session
(Paddle's Scope), keyed by ``(container, op name)``: a new Session starts
from the beginning, ``close()`` releases them.
"""
from __future__ import annotations

import collections.abc
import threading

import numpy as np

from .. import errors as _errors
from ..gpu import is_cupy_array
from ..tensor import LoDTensor
from . import dtypes as _dt
from .ops import Graph, InaccessibleTensorError, Operation, Tensor, device_type_of, get_default_graph
from .registry import KernelContext

__all__ = ["Session", "get_default_session"]


class _SessionStack(threading.local):
    def __init__(self):
        self.stack = []


_sessions = _SessionStack()


def get_default_session():
    """The innermost Session entered with ``with sess:`` / ``sess.as_default()`` in this thread."""
    return _sessions.stack[-1] if _sessions.stack else None


# -- fetch structures ---------------------------------------------------------------------

def _fetch_key(f):
    """A hashable key of a fetch structure (None when it has none; no caching then)."""
    if isinstance(f, (Tensor, Operation, str)):
        return f
    t = type(f)
    if t is list or t is tuple or isinstance(f, tuple):
        keys = tuple(_fetch_key(x) for x in f)
        return None if None in keys else (t, keys)
    if isinstance(f, collections.abc.Mapping):
        try:
            keys = tuple((k, _fetch_key(v)) for k, v in f.items())
        except TypeError:
            return None
        return None if any(v is None for _, v in keys) else (t, keys)
    return None


def _element(graph, fetch):
    if fetch is None:
        raise TypeError(f'Argument `fetch` = {fetch} has invalid type "{type(fetch).__name__}". '
                        "Cannot be None")
    try:
        return graph.as_graph_element(fetch, allow_tensor=True, allow_operation=True)
    except TypeError as e:
        raise TypeError(f'Argument `fetch` = {fetch} has invalid type "{type(fetch).__name__}" '
                        f"must be a string or Tensor. ({e})") from None
    except (ValueError, KeyError) as e:
        raise ValueError(f"Argument `fetch` = {fetch} cannot be interpreted as a Tensor. ({e})") \
            from None


def _compile_fetch(graph, fetch, unique, index):
    """A builder ``values -> result`` for ``fetch``; appends its elements to ``unique``."""
    if isinstance(fetch, (list, tuple)):
        builders = [_compile_fetch(graph, f, unique, index) for f in fetch]
        t = type(fetch)
        if t is list:
            return lambda vals: [b(vals) for b in builders]
        if t is tuple:
            return lambda vals: tuple(b(vals) for b in builders)
        if hasattr(fetch, "_fields"):          # namedtuple
            return lambda vals: t(*[b(vals) for b in builders])
        return lambda vals: t(b(vals) for b in builders)
    if isinstance(fetch, collections.abc.Mapping):
        items = [(k, _compile_fetch(graph, v, unique, index)) for k, v in fetch.items()]
        t = type(fetch)
        if t is dict:
            return lambda vals: {k: b(vals) for k, b in items}
        if isinstance(fetch, collections.defaultdict):
            factory = fetch.default_factory
            def build_dd(vals):
                out = t(factory)
                for k, b in items:
                    out[k] = b(vals)
                return out
            return build_dd
        def build_map(vals):
            out = t()
            for k, b in items:
                out[k] = b(vals)
            return out
        return build_map
    el = _element(graph, fetch)
    if el not in index:
        index[el] = len(unique)
        unique.append(el)
    i = index[el]
    if isinstance(el, Operation):
        return lambda vals: None
    return lambda vals: vals[i]


def _to_host(v):
    t = type(v)
    if t is np.ndarray:
        return v[()] if v.ndim == 0 else v
    if is_cupy_array(v):
        v = v.get()
        return v[()] if v.ndim == 0 else v
    if t is LoDTensor and is_cupy_array(v.data):
        return v.to("cpu") if hasattr(v, "to") else v
    return v


class _Plan:
    __slots__ = ("steps", "n_slots", "feed_slots", "fetch_slots", "build", "mutation", "single",
                 "template", "feed_tensors", "fast", "__weakref__")

    def __init__(self, session, fetches, feed_tensors):
        graph = session._graph
        unique, index = [], {}
        self.build = _compile_fetch(graph, fetches, unique, index)
        self.single = isinstance(fetches, Tensor)
        for el in unique:
            op = el if isinstance(el, Operation) else el._op
            if not graph.is_fetchable(op):
                raise InaccessibleTensorError(
                    f"Operation {op.name} has been marked as not fetchable. Typically this "
                    "happens when it is defined in another function or code block. Use return "
                    "values, explicit Python locals or TensorFlow collections to access it.")
        fed = set(feed_tensors)
        # prune: the ops the fetches need, stopping at fed tensors
        needed = set()
        stack = []
        for el in unique:
            if isinstance(el, Operation):
                stack.append(el)
            elif el not in fed:
                stack.append(el._op)
        while stack:
            op = stack.pop()
            if op in needed:
                continue
            needed.add(op)
            for t in op._inputs:
                if t not in fed and t._op not in needed:
                    stack.append(t._op)
            for c in op._control_inputs:
                # a control input whose outputs are all fed is satisfied by the feed (TF
                # replaces a fed node)
                if c not in needed and not (c._outputs and all(t in fed for t in c._outputs)):
                    stack.append(c)
        order = sorted(needed, key=lambda op: op._id)
        slots = {}

        def slot(t):
            s = slots.get(t)
            if s is None:
                s = slots[t] = len(slots)
            return s

        self.feed_slots = [slot(t) for t in feed_tensors]
        steps = []
        for op in order:
            kernel, ctx = session._kernel_for(op)
            ins = [slot(t) for t in op._inputs]
            outs = [slot(t) if t not in fed else -1 for t in op._outputs]   # -1: keep the fed value
            steps.append((kernel, ctx, ins, outs, op._op_type.constant_per_session))
        self.steps = steps
        self.fetch_slots = [None if isinstance(el, Operation) else slot(el) for el in unique]
        self.n_slots = len(slots)
        self.template = [None] * self.n_slots     # values of folded (constant per session) ops
        self.feed_tensors = tuple(feed_tensors)
        self.mutation = graph._mutation
        self.fast = None
        self.fast = self._make_fast()

    def _make_fast(self):
        """The common steady state -- one op left to run (the rest folded), no feeds, one
        tensor fetched -- as one closure: its inputs are fixed, so no value list is built."""
        if self.feed_slots or not self.single or len(self.steps) != 1:
            return None
        kernel, ctx, ins, outs, fold = self.steps[0]
        fetch = self.fetch_slots[0]
        if fold or fetch not in outs:
            return None
        k = outs.index(fetch)
        args = [self.template[i] for i in ins]

        def fast():
            try:
                res = kernel(ctx, args.copy())
            except _errors.OpError as e:
                _attach(e, ctx.op)
                raise
            except Exception as e:
                raise _attach(_as_op_error(e, ctx.op), ctx.op) from e
            return _to_host(res[k])
        return fast

    def fold(self, step, res):
        """Keep a constant-per-session op's outputs and drop its step from now on."""
        for s, v in zip(step[3], res):
            if s >= 0:
                self.template[s] = v
        self.steps = [x for x in self.steps if x is not step]

    def execute(self, feed_values):
        vals = self.template.copy()
        for s, v in zip(self.feed_slots, feed_values):
            vals[s] = v
        for step in self.steps:
            kernel, ctx, ins, outs, fold = step
            try:
                res = kernel(ctx, [vals[i] for i in ins])
            except _errors.OpError as e:
                _attach(e, ctx.op)
                raise
            except Exception as e:
                raise _attach(_as_op_error(e, ctx.op), ctx.op) from e
            for s, v in zip(outs, res):
                if s >= 0:
                    vals[s] = v
            if fold:
                self.fold(step, res)
                self.fast = self._make_fast()
        if self.single:
            return _to_host(vals[self.fetch_slots[0]])
        return self.build([None if s is None else _to_host(vals[s]) for s in self.fetch_slots])


class Session:
    """Runs ops of a Graph (TensorFlow 1's ``tf.compat.v1.Session``).

    Parameters
    ----------
    target, config
        Accepted for TensorFlow compatibility; ignored (runs in process).
    graph : Graph, optional
        Default: the default graph at construction.

    Examples
    --------
    >>> g = Graph()
    >>> with g.as_default():
    ...     x = placeholder(np.float32, [2])
    ...     y = add(x, 1.0)
    >>> with Session(graph=g) as sess:
    ...     sess.run(y, {x: [1, 2]}).tolist()
    [2.0, 3.0]
    """

    def __init__(self, target="", graph=None, config=None):
        if graph is None:
            graph = get_default_graph()
        elif not isinstance(graph, Graph):
            raise TypeError(f'Argument `graph` must be a tf.Graph, but got "{type(graph).__name__}"')
        self._graph = graph
        self._closed = False
        self._resources = {}
        self._resource_lock = threading.RLock()
        self._plans = {}
        self._kernels = {}
        self._context_stack = []

    @property
    def graph(self):
        return self._graph

    @property
    def graph_def(self):
        return self._graph.as_graph_def()

    # -- context management ---------------------------------------------------------------
    def as_default(self):
        """Make this the default session of the thread for a ``with`` block."""
        return _DefaultSession(self)

    def __enter__(self):
        g_cm = self._graph.as_default()
        g_cm.__enter__()
        _sessions.stack.append(self)
        self._context_stack.append(g_cm)
        return self

    def __exit__(self, *exc):
        if _sessions.stack and _sessions.stack[-1] is self:
            _sessions.stack.pop()
        if self._context_stack:
            self._context_stack.pop().__exit__(*exc)
        self.close()

    def close(self):
        """Release the Session's resources (reader chains); closing twice is fine."""
        if self._closed:
            return
        self._closed = True
        with self._resource_lock:
            res, self._resources = self._resources, {}
        for r in res.values():
            close = getattr(r, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- kernels ----------------------------------------------------------------------------
    def _kernel_for(self, op):
        cached = self._kernels.get(op)
        if cached is not None:
            return cached
        spec = op._op_type
        dev = device_type_of(op._device)
        kernel = spec.kernels.get(dev)
        if kernel is None:
            if dev == "CPU" or not spec.kernels:
                raise _errors.UnimplementedError(
                    None, op, f"No {dev} kernel is registered for op '{op.name}' of type "
                              f"{op.type}")
            raise _errors.InvalidArgumentError(
                None, op, f"Cannot assign a device for operation '{op.name}': Could not satisfy "
                          f"explicit device specification '{op.device}' because no supported "
                          f"kernel for {dev} devices is available (op type {op.type} has "
                          f"{'/'.join(sorted(spec.kernels))} kernels)")
        if dev == "GPU":
            from ..gpu import cupy_available
            if not cupy_available():
                raise _errors.InvalidArgumentError(
                    None, op, f"Cannot assign a device for operation '{op.name}': Could not "
                              f"satisfy explicit device specification '{op.device}' because no "
                              "GPU is available here (GPU kernels need CuPy and a CUDA device: "
                              "pip install 'readerlib[gpu]'); place it on '/device:CPU:0'")
        cached = (kernel, KernelContext(op, self, dev))
        self._kernels[op] = cached
        return cached

    # -- run --------------------------------------------------------------------------------------
    def _feeds(self, feed_dict):
        graph = self._graph
        tensors, values = [], []
        for key, val in feed_dict.items():
            if type(key) is Tensor and key._op._graph is graph:
                t = key
            else:
                try:
                    t = graph.as_graph_element(key, allow_tensor=True, allow_operation=False)
                except Exception as e:
                    raise TypeError(f"Cannot interpret feed_dict key as Tensor: {e.args[0]}") \
                        from None
            if isinstance(val, Tensor):
                raise TypeError(
                    "The value of a feed cannot be a tf.Tensor object. Acceptable feed values "
                    "include Python scalars, strings, lists, numpy ndarrays, or TensorHandles. "
                    f"For reference, the tensor object was {val} which was passed to the "
                    f"argument `feed_dict` with key {key}.")
            dtype = t._dtype
            if isinstance(val, LoDTensor) or dtype is _dt.resource or \
                    is_cupy_array(val):
                shape = val.data.shape if isinstance(val, LoDTensor) else getattr(val, "shape", None)
            else:
                if type(val) is not np.ndarray or val.dtype != dtype:
                    val = np.asarray(val, dtype=dtype)
                shape = val.shape
            if shape is not None and not t._shape.is_compatible_with(shape):
                raise ValueError(f"Cannot feed value of shape {tuple(shape)} for Tensor {t.name}, "
                                 f"which has shape {t._shape}")
            if not graph.is_feedable(t):
                raise ValueError(f"Tensor {t.name} may not be fed.")
            tensors.append(t)
            values.append(val)
        return tensors, values

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Run the ops ``fetches`` need and return their values in the same structure.

        Parameters
        ----------
        fetches : Tensor, Operation, name, or a list / tuple / namedtuple / dict of them
            Tensors fetch as NumPy arrays (0-d as NumPy scalars; LoD values as
            LoDTensor), Operations as None.
        feed_dict : dict, optional
            Tensor (or ``"name:0"``) -> value; values are converted to the
            tensor's dtype and checked against its static shape.

        Raises
        ------
        TypeError, ValueError
            Bad fetches or feeds (TensorFlow's messages).
        OpError
            A run-time failure, with ``.op`` the failing op: OutOfRangeError at
            the end of a reader, InvalidArgumentError for an unfed placeholder or a
            kernel's bad argument, DataLossError for a corrupt file ...
        RuntimeError
            A closed Session or an empty graph.
        """
        if self._closed:
            raise RuntimeError("Attempted to use a closed Session.")
        graph = self._graph
        if not feed_dict and type(fetches) is Tensor:     # the common step: one tensor, no feeds
            plan = self._plans.get(fetches)
            if plan is not None and plan.mutation == graph._mutation:
                fast = plan.fast
                return fast() if fast is not None else plan.execute(())
        if graph._version == 0:
            raise RuntimeError("The Session graph is empty. Add operations to the graph before "
                               "calling run().")
        if feed_dict:
            feed_tensors, feed_values = self._feeds(feed_dict)
        else:
            feed_tensors, feed_values = (), ()
        fkey = _fetch_key(fetches)
        plan = None
        if fkey is not None:
            key = (fkey, tuple(feed_tensors)) if feed_tensors or type(fkey) is not Tensor else fkey
            plan = self._plans.get(key)
            if plan is not None and plan.mutation != graph._mutation:
                plan = None
        if plan is None:
            plan = _Plan(self, fetches, feed_tensors)
            if fkey is not None:
                self._plans[key] = plan
        return plan.execute(feed_values)

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        """A function ``f(*feed_values)`` that runs ``fetches`` with ``feed_list`` fed
        (TF's ``Session.make_callable``): the fetch and feed lookup is done once here."""
        feed_list = list(feed_list or [])
        tensors = [self._graph.as_graph_element(t, allow_tensor=True, allow_operation=False)
                   for t in feed_list]
        state = {}

        def call(*args):
            if self._closed:
                raise RuntimeError("Attempted to use a closed Session.")
            if len(args) != len(tensors):
                raise TypeError(f"expected {len(tensors)} feed values, got {len(args)}")
            plan = state.get("plan")
            if plan is None or plan.mutation != self._graph._mutation:
                plan = state["plan"] = _Plan(self, fetches, tensors)
            if args:
                _, values = self._feeds(dict(zip(tensors, args)))
                return plan.execute(values)
            fast = plan.fast
            return fast() if fast is not None else plan.execute(())
        return call


def _attach(e, op):
    """Give an OpError its failing op and that op's NodeDef (TF's ``.op``, ``.node_def``)."""
    if e.op is None:
        e.op = op
    if e.node_def is None and e.op is op:
        try:
            e.node_def = op.node_def
        except ImportError:      # no protobuf: no NodeDef
            pass
    return e


def _as_op_error(e, op):
    """An exception from a kernel as the OpError TensorFlow would raise (``.op`` set)."""
    if isinstance(e, FileNotFoundError):
        cls = _errors.NotFoundError
    elif isinstance(e, (ValueError, TypeError, IndexError, KeyError)):
        cls = _errors.InvalidArgumentError
    elif isinstance(e, MemoryError):
        cls = _errors.ResourceExhaustedError
    elif isinstance(e, NotImplementedError):
        cls = _errors.UnimplementedError
    elif isinstance(e, ImportError):
        cls = _errors.FailedPreconditionError
    else:
        cls = _errors.UnknownError
    msg = str(e) if not isinstance(e, KeyError) else (e.args[0] if e.args else "")
    return cls(None, op, f"{msg} (in op '{op.name}' of type {op.type}: {type(e).__name__})")


class _DefaultSession:
    def __init__(self, sess):
        self._sess = sess

    def __enter__(self):
        _sessions.stack.append(self._sess)
        return self._sess

    def __exit__(self, *exc):
        if _sessions.stack and _sessions.stack[-1] is self._sess:
            _sessions.stack.pop()
