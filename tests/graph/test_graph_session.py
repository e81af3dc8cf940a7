"""Session: fetch structures, feeds, pruning, errors -- each body on readerlib and
on tf.compat.v1 when installed."""
import collections
import re
import threading

import numpy as np
import pytest

import readerlib.graph as rg
from graph_backends import B  # noqa: F401 (fixture)

Pair = collections.namedtuple("Pair", "x y")


def small_graph(B):
    g = B.Graph()
    with g.as_default():
        a = B.constant(1.0, name="a")
        b = B.constant([1.0, 2.0], name="b")
        p = B.placeholder(np.float32, shape=[2], name="p")
        s = B.add(b, p, name="s")
    return g, a, b, p, s


def test_fetch_structures(B):
    g, a, b, p, s = small_graph(B)
    with B.Session(graph=g) as sess:
        assert sess.graph is g
        v = sess.run(a)
        assert isinstance(v, np.float32) and v == 1.0
        assert sess.run(a.op) is None and sess.run("a") is None
        assert sess.run("a:0") == 1.0
        out = sess.run({"k": [a, (b, a.op)], "n": Pair(a, b)})
        assert type(out) is dict and type(out["k"]) is list and type(out["k"][1]) is tuple
        assert out["k"][1][1] is None and isinstance(out["n"], Pair)
        np.testing.assert_array_equal(out["n"].y, [1.0, 2.0])
        assert sess.run([]) == [] and sess.run({}) == {} and sess.run(()) == ()
        od = sess.run(collections.OrderedDict([("z", a), ("y", b)]))
        assert type(od) is collections.OrderedDict and list(od) == ["z", "y"]
        r = sess.run([a, a, b])
        assert r[0] == r[1] == 1.0


def test_fetch_errors(B):
    g, a, b, p, s = small_graph(B)
    other = B.Graph()
    with other.as_default():
        o = B.constant(1.0, name="o")
    with B.Session(graph=g) as sess:
        with pytest.raises(TypeError, match=re.escape('Argument `fetch` = None has invalid type "NoneType". Cannot be None')):
            sess.run(None)
        with pytest.raises(TypeError, match="Cannot be None"):
            sess.run([a, None])
        with pytest.raises(TypeError, match=re.escape('Argument `fetch` = 1 has invalid type "int" must be a string or Tensor. (Can not convert a int into a Tensor or Operation.)')):
            sess.run(1)
        with pytest.raises(TypeError, match='invalid type "set"'):
            sess.run({a})
        for bad in ["zz:0", "a:1", o]:
            with pytest.raises(ValueError, match="cannot be interpreted as a Tensor"):
                sess.run(bad)


def test_feeds(B):
    g, a, b, p, s = small_graph(B)
    other = B.Graph()
    with other.as_default():
        o = B.placeholder(np.float32, name="o")
    with B.Session(graph=g) as sess:
        np.testing.assert_array_equal(sess.run(s, {p: [1, 2]}), [2.0, 4.0])
        np.testing.assert_array_equal(sess.run(s, {"p:0": np.array([1.5, 2.5])}), [2.5, 4.5])
        assert sess.run(s, {p: np.array([1, 2], np.float64)}).dtype == np.float32
        np.testing.assert_array_equal(sess.run(s, {b: [10, 20], p: [1, 2]}), [11.0, 22.0])
        assert sess.run(a, {a: 5.0}) == 5.0
        with pytest.raises(ValueError, match=re.escape("Cannot feed value of shape (3,) for Tensor p:0, which has shape (2,)")):
            sess.run(s, {p: [1, 2, 3]})
        with pytest.raises(TypeError, match="Cannot interpret feed_dict key as Tensor: The name 'p' refers to an Operation, not a Tensor."):
            sess.run(s, {"p": [1, 2]})
        with pytest.raises(TypeError, match="Cannot interpret feed_dict key as Tensor: Can not convert a int into a Tensor."):
            sess.run(s, {1: [1, 2]})
        with pytest.raises(TypeError, match="Cannot interpret feed_dict key as Tensor: .*is not an element of this graph"):
            sess.run(s, {o: 1.0})
        with pytest.raises(TypeError, match="The value of a feed cannot be a tf.Tensor object."):
            sess.run(s, {p: a})
        with pytest.raises(ValueError):
            sess.run(s, {p: ["x", "y"]})


def test_unfed_placeholder_is_invalid_argument(B):
    g, a, b, p, s = small_graph(B)
    with B.Session(graph=g) as sess:
        with pytest.raises(B.errors.InvalidArgumentError) as ei:
            sess.run(s)
        e = ei.value
        assert isinstance(e, B.errors.OpError) and e.error_code == 3 and e.op.name == "p"
        assert e.node_def.name == "p" and e.node_def.op == "Placeholder"
        assert "You must feed a value for placeholder tensor 'p' with dtype float and shape [2]" in e.message
        assert sess.run(a) == 1.0          # the unfed placeholder is pruned away


def test_pruning_runs_control_inputs_only_when_needed(B):
    """Only the subgraph a fetch needs runs: an unfed placeholder elsewhere is no error,
    and control inputs of a needed op run (an unfed one fails)."""
    g = B.Graph()
    with g.as_default():
        p = B.placeholder(np.float32, name="p")
        a = B.constant(1.0, name="a")
        with g.control_dependencies([p]):
            c = B.constant(2.0, name="c")
        n = B.no_op(name="n")
    with B.Session(graph=g) as sess:
        assert sess.run(a) == 1.0
        assert sess.run(n) is None
        with pytest.raises(B.errors.InvalidArgumentError):
            sess.run(c)
        assert sess.run(c, {p: 0.0}) == 2.0


def test_session_lifecycle(B):
    g, a, b, p, s = small_graph(B)
    sess = B.Session(graph=g)
    assert sess.run(a) == 1.0
    sess.close()
    sess.close()
    with pytest.raises(RuntimeError, match="Attempted to use a closed Session."):
        sess.run(a)
    with pytest.raises(RuntimeError, match="The Session graph is empty. Add operations to the graph before calling run()."):
        B.Session(graph=B.Graph()).run([])
    with pytest.raises(TypeError, match='Argument `graph` must be a tf.Graph, but got "str"'):
        B.Session(graph="x")
    with g.as_default():
        assert B.Session().graph is g


def test_errors_taxonomy(B):
    E = B.errors
    codes = {"CancelledError": 1, "UnknownError": 2, "InvalidArgumentError": 3,
             "DeadlineExceededError": 4, "NotFoundError": 5, "AlreadyExistsError": 6,
             "PermissionDeniedError": 7, "UnauthenticatedError": 16, "ResourceExhaustedError": 8,
             "FailedPreconditionError": 9, "AbortedError": 10, "OutOfRangeError": 11,
             "UnimplementedError": 12, "InternalError": 13, "UnavailableError": 14,
             "DataLossError": 15}
    for name, code in codes.items():
        cls = getattr(E, name)
        assert issubclass(cls, E.OpError)
        e = cls(None, None, "msg")
        assert e.error_code == code and e.message == "msg" and e.op is None and e.node_def is None


# -- readerlib only ----------------------------------------------------------------------------

def test_eager_exceptions_join_the_taxonomy():
    import readerlib as rl
    from readerlib import errors
    assert rl.InvalidArgumentError is errors.InvalidArgumentError
    assert issubclass(rl.InvalidArgumentError, ValueError) and issubclass(rl.InvalidArgumentError, errors.OpError)
    assert issubclass(rl.FailedPreconditionError, ValueError) and issubclass(rl.FailedPreconditionError, errors.OpError)
    for cls in (rl.DataLossError, rl.RecordIOError, rl.TFRecordError):
        assert issubclass(cls, OSError) and issubclass(cls, errors.OpError)
    e = rl.RecordIOError("f: bad", "f", 12)
    assert (str(e), e.path, e.offset, e.op) == ("f: bad", "f", 12, None)
    assert rg.errors is errors and rg.OutOfRangeError is errors.OutOfRangeError
    with pytest.raises(rl.InvalidArgumentError, match="inputs is not a 3-Tensor"):
        rl.ctc_greedy_decoder(np.zeros((2, 2), np.float32), [1, 1])


def test_plan_is_cached_and_refreshed_when_the_graph_changes():
    g, a, b, p, s = small_graph(rg_backend())
    with rg.Session(graph=g) as sess:
        sess.run([a, s], {p: [1, 2]})
        sess.run([a, s], {p: [1, 2]})
        assert len(sess._plans) == 1
        plan = next(iter(sess._plans.values()))
        g.prevent_fetching(a.op)
        with pytest.raises(rg.InaccessibleTensorError):
            sess.run([a, s], {p: [1, 2]})
        assert next(iter(sess._plans.values())) is plan    # the stale plan was not used


def test_each_op_runs_once_per_run_and_threads():
    calls = []
    name = "TestCountCalls"
    if rg.get_op_type(name) is None:
        rg.register_op(name, inputs=[("x", "T")], outputs=[("y", "T")], attrs={"T": ("type", None)},
                       stateful=True,
                       kernels={"CPU": lambda ctx, inputs: (calls.append(1), [inputs[0] + 1])[1]})
    g = rg.Graph()
    with g.as_default():
        p = rg.placeholder(np.int64, [])
        y = rg.apply_op(name, [p]).outputs[0]
        z1, z2 = rg.identity(y), rg.add(y, y)
    with rg.Session(graph=g) as sess:
        assert sess.run([y, z1, z2], {p: 1}) == [2, 2, 4]
        assert len(calls) == 1
        results, errors = [], []

        def work(k):
            try:
                for i in range(200):
                    results.append(sess.run(z2, {p: k * 1000 + i}) == 2 * (k * 1000 + i + 1))
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and len(results) == 800 and all(results)


def test_kernel_errors_become_op_errors():
    g = rg.Graph()
    with g.as_default():
        x = rg.constant(np.arange(6.0, dtype=np.float32).reshape(3, 2))
        idx = rg.placeholder(np.int64, [None], name="idx")
        y = rg.batch_reindex(x, idx)
    with rg.Session(graph=g) as sess:
        assert sess.run(y, {idx: [2, 0]}).tolist() == [[4, 5], [0, 1]]
        with pytest.raises(rg.InvalidArgumentError, match="greater than batch size") as ei:
            sess.run(y, {idx: [3]})
        assert ei.value.op is y.op and isinstance(ei.value.__cause__, IndexError)


def test_gpu_placed_op_fails_at_run_not_build(monkeypatch):
    import readerlib.gpu
    monkeypatch.setattr(readerlib.gpu, "cupy_available", lambda: False)
    g = rg.Graph()
    with g.as_default():
        x = rg.constant(np.ones((2, 1, 3), np.float32))
        n = rg.constant(np.array([2], np.int32))
        with rg.device("/device:GPU:0"):
            outs = rg.ctc_greedy_decoder(x, n)
        c = rg.constant(1.0)
    assert outs[0].op.device == "/device:GPU:0"
    with rg.Session(graph=g) as sess:
        assert sess.run(c) == 1.0
        with pytest.raises(rg.InvalidArgumentError, match="no GPU is available"):
            sess.run(outs[0])


def rg_backend():
    from graph_backends import rl_backend
    return rl_backend()


def test_make_callable_and_folded_constants():
    g = rg.Graph()
    with g.as_default():
        c = rg.constant(2.0, name="c")
        p = rg.placeholder(np.float32, [], name="p")
        s = rg.add(c, p)
        i = rg.identity(c)
    with rg.Session(graph=g) as sess:
        f = sess.make_callable(s, [p])
        assert [f(1.0), f(2.0)] == [3.0, 4.0]
        assert sess.run(i) == 2.0 and sess.run(i) == 2.0           # folded Const, fast path
        assert sess.run(i, {c: 5.0}) == 5.0                        # a fed Const in another plan
        assert sess.run(i) == 2.0
        g.prevent_fetching(i.op)
        with pytest.raises(rg.InaccessibleTensorError):
            sess.run(i)                                           # the fast path sees the change
        with pytest.raises(TypeError, match="expected 1 feed values, got 0"):
            f()
    with pytest.raises(RuntimeError, match="closed Session"):
        f(1.0)
