"""Graph / Operation / Tensor: every test body runs on readerlib.graph and, when
TensorFlow is installed, on tf.compat.v1, and both must give the asserted
names, attrs and exception types."""
import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import readerlib.graph as rg
from graph_backends import B, as_np_dtype, tf_backend  # noqa: F401 (fixture)


def names(g):
    return [op.name for op in g.get_operations()]


# -- names and scopes -----------------------------------------------------------------

def test_default_names_and_types(B):
    g = B.Graph()
    with g.as_default():
        c = B.constant(1.0)
        c1 = B.constant(2.0)
        p = B.placeholder(np.float32, shape=[2])
        i = B.identity(c)
        a = B.add(c, c1)
        b = B.add(c, 1.0)
        j = B.identity([1.0, 2.0])
    assert names(g) == ["Const", "Const_1", "Placeholder", "Identity", "Add", "Add_1/y", "Add_1",
                        "Identity_1/input", "Identity_1"]
    assert [c.op.type, p.op.type, i.op.type, a.op.type] == ["Const", "Placeholder", "Identity", "AddV2"]
    assert c.name == "Const:0" and c.value_index == 0 and c.op.outputs[0] is c
    assert c.graph is g and c.op.graph is g and i.op.inputs[0] is c
    assert as_np_dtype(j.dtype) == np.float32 and list(p.shape) == [2]
    assert b.op.inputs[1].op.name == "Add_1/y"


def test_name_scope_nesting_and_absolute(B):
    g = B.Graph()
    got = []
    with g.as_default():
        with g.name_scope("nested") as s:
            got.append(s)
            with g.name_scope("inner") as s:
                got.append(s)
            with g.name_scope("inner") as s:
                got.append(s)
                got.append(g.get_name_scope())
                with g.name_scope("nested/") as s:
                    got.append(s)
                    got.append(B.constant(1, name="c").name)
                with g.name_scope("deep/") as s:
                    got.append(s)
                with g.name_scope("") as s:
                    got.append(s)
                    got.append(B.constant(1, name="root").name)
                with g.name_scope(None) as s:
                    got.append(s)
        with g.name_scope("nested") as s:
            got.append(s)
        got.append(g.get_name_scope())
        with g.name_scope("my_layer") as scope:
            got.append(B.identity(B.constant(1.0), name=scope).op.name)
    assert got == ["nested/", "nested/inner/", "nested/inner_1/", "nested/inner_1", "nested/",
                   "nested/c:0", "deep/", "", "root:0", "", "nested_1/", "", "my_layer"]


@pytest.mark.parametrize("bad", ["_x", "-x", "a b", "/abs", "a b/"])
def test_invalid_root_scope(B, bad):
    g = B.Graph()
    with pytest.raises(ValueError, match=re.escape(f"'{bad}' is not a valid root scope name. "
                                                   "A root scope name has to match")):
        with g.name_scope(bad):
            pass


def test_scope_regex_below_root(B):
    g = B.Graph()
    with g.name_scope("ok"):
        with g.name_scope("_x") as s:
            assert s == "ok/_x/"
        with pytest.raises(ValueError, match="is not a valid scope name"):
            with g.name_scope("a b"):
                pass
    with g.name_scope("a>b") as s:
        assert s == "a>b/"
    with pytest.raises(TypeError):
        with g.name_scope(3):
            pass


def test_scopes_and_ops_share_names(B):
    g = B.Graph()
    with g.as_default():
        B.constant(1, name="clash")
        with g.name_scope("clash") as s:
            assert s == "clash_1/"
        with g.name_scope("sc"):
            pass
        assert B.constant(1, name="sc").op.name == "sc_1"


def test_unique_name_examples(B):
    g = B.Graph()
    assert [g.unique_name("foo") for _ in range(3)] == ["foo", "foo_1", "foo_2"]
    assert [g.unique_name(n) for n in ["q_1", "q", "q", "q"]] == ["q_1", "q", "q_2", "q_3"]
    assert [g.unique_name(n) for n in ["bar", "bar", "bar_1", "bar"]] == \
        ["bar", "bar_1", "bar_1_1", "bar_2"]
    assert g.unique_name("Bar") == "Bar_3"
    assert [g.unique_name("z", mark_as_used=False) for _ in range(2)] == ["z", "z"]
    assert [g.unique_name("z"), g.unique_name("z")] == ["z", "z_1"]
    with B.Graph().as_default():
        assert [B.constant(1, name=n).op.name for n in ["Foo", "foo", "FOO"]] == \
            ["Foo", "foo_1", "FOO_2"]


def reference_unique_name(names_in_use, name_stack, name, mark_as_used=True):
    """TensorFlow's Graph.unique_name, transcribed from ops.py."""
    if name_stack:
        name = name_stack + "/" + name
    name_key = name.lower()
    i = names_in_use.get(name_key, 0)
    if mark_as_used:
        names_in_use[name_key] = i + 1
    if i > 0:
        base = name_key
        while name_key in names_in_use:
            name_key = "%s_%d" % (base, i)
            i += 1
        if mark_as_used:
            names_in_use[name_key] = 1
        name = "%s_%d" % (name, i - 1)
    return name


_name = st.sampled_from(["a", "A", "a_1", "a_2", "b", "a_1_1", "B_1", "x.y", "a>b"])
_steps = st.lists(st.tuples(st.sampled_from(["unique", "peek", "scope", "op"]), _name,
                            st.booleans()), max_size=25)


def _replay(B, steps):
    g = B.Graph()
    out = []
    with g.as_default():
        for kind, name, nest in steps:
            if kind == "unique":
                out.append(g.unique_name(name))
            elif kind == "peek":
                out.append(g.unique_name(name, mark_as_used=False))
            elif kind == "scope":
                with g.name_scope(name) as s:
                    out.append(s)
                    if nest:
                        out.append(g.unique_name(name))
                        out.append(B.constant(0, name=name).op.name)
            else:
                out.append(B.constant(0, name=name).op.name)
    return out


@settings(max_examples=150, deadline=None)
@given(_steps)
def test_unique_name_matches_tensorflow_algorithm(steps):
    """readerlib's names equal TF's algorithm replayed on a names-in-use dict."""
    used = {}
    expect = []
    for kind, name, nest in steps:
        if kind == "unique":
            expect.append(reference_unique_name(used, "", name))
        elif kind == "peek":
            expect.append(reference_unique_name(used, "", name, False))
        elif kind == "scope":
            scope = reference_unique_name(used, "", name)
            expect.append(scope + "/")
            if nest:
                expect.append(reference_unique_name(used, scope, name))
                expect.append(reference_unique_name(used, scope, name))
        else:
            expect.append(reference_unique_name(used, "", name))
    from graph_backends import rl_backend
    assert _replay(rl_backend(), steps) == expect


@settings(max_examples=40, deadline=None)
@given(_steps)
def test_unique_name_matches_tensorflow_itself(steps):
    tfb = tf_backend()
    from graph_backends import rl_backend
    assert _replay(rl_backend(), steps) == _replay(tfb, steps)


@pytest.mark.parametrize("bad", ["-bad", "_bad", "a b", "a:0"])
def test_invalid_op_names(B, bad):
    g = B.Graph()
    with g.as_default():
        with pytest.raises(ValueError, match="is not a valid node name"):
            B.constant(1.0, name=bad)
        with pytest.raises(ValueError, match="is not a valid root scope name"):
            B.identity(B.constant(1.0), name=bad)


def test_absolute_op_name_and_duplicate(B):
    g = B.Graph()
    with g.as_default():
        x = B.constant(1.0, name="x")
        assert B.identity(x, name="absname/").op.name == "absname"
        with pytest.raises(ValueError, match="Duplicate node name in graph: 'x'"):
            B.identity(x, name="x/")


# -- default graph and threads --------------------------------------------------------------

def test_as_default_stack_and_threads(B):
    g1, g2 = B.Graph(), B.Graph()
    with g1.as_default() as x:
        assert x is g1 and B.get_default_graph() is g1
        with g2.as_default():
            assert B.get_default_graph() is g2
            c = B.constant(1.0)
        assert B.get_default_graph() is g1
        seen = []
        t = threading.Thread(target=lambda: seen.append(B.get_default_graph()))
        t.start()
        t.join()
        assert seen[0] is not g1
    assert c.graph is g2


def test_name_stack_is_thread_local_and_names_shared(B):
    g = B.Graph()
    out = []
    with g.as_default(), g.name_scope("main"):
        B.constant(1.0, name="c")

        def work():
            with g.as_default():
                out.append(B.constant(1.0, name="c").op.name)
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert out == ["c"]


# -- collections ------------------------------------------------------------------------------

def test_collections(B):
    g = B.Graph()
    with g.as_default():
        a = B.constant(1.0, name="a")
        with g.name_scope("s1"):
            b = B.constant(1.0, name="b")
        with g.name_scope("s10"):
            b10 = B.constant(1.0, name="b")
    for item in [a, b, b10, 42, b.op]:
        g.add_to_collection("things", item)
    g.add_to_collection("things", a)
    assert g.get_collection("things") == [a, b, b10, 42, b.op, a]
    assert g.get_collection("things") is not g.get_collection("things")
    assert g.get_collection("things", "s1") == [b, b10, b.op]
    assert g.get_collection("things", "s1/") == [b, b.op]
    assert g.get_collection("things", "b") == []
    assert g.get_collection("things", "") == [a, b, b10, b.op, a]
    assert g.get_collection("missing") == [] and "missing" not in g.get_all_collection_keys()
    ref = g.get_collection_ref("live")
    assert ref is g.get_collection_ref("live") and "live" in g.get_all_collection_keys()
    ref.append(1)
    assert g.get_collection("live") == [1]
    g.add_to_collections(["x", "y", "x"], 5)
    g.add_to_collections("xy", 6)
    assert g.get_collection("x") == [5] and g.get_collection("xy") == [6]
    g.add_to_collection(("tuple", "key"), 1)
    assert ("tuple", "key") not in g.get_all_collection_keys()
    assert ("tuple", "key") in g.collections
    g.clear_collection("things")
    g.clear_collection("never")
    assert "things" not in g.get_all_collection_keys()
    g.add_to_collection("things", 1)
    assert g.get_all_collection_keys()[-1] == "things"
    assert B.GraphKeys.GLOBAL_VARIABLES == "variables"
    assert B.GraphKeys.TABLE_INITIALIZERS == "table_initializer"


# -- control dependencies -----------------------------------------------------------------------

def test_control_dependencies_pruning(B):
    g = B.Graph()
    with g.as_default():
        a = B.constant(1.0, name="a")
        b = B.constant(2.0, name="b")
        c = B.constant(3.0, name="c")
        d = B.constant(4.0, name="d")
        with g.control_dependencies([b, a, b]):
            x = B.constant(5.0, name="x")
            ix = B.identity(x)
            ia = B.identity(a)
            s = B.add(c, d)
            with g.control_dependencies([c]):
                ix2 = B.identity(x)
            with g.control_dependencies(None):
                free = B.constant(0.0, name="free")
                with g.control_dependencies([d]):
                    only_d = B.constant(0.0, name="only_d")
            after = B.constant(0.0, name="after")
    ci = lambda t: [o.name for o in t.op.control_inputs]  # noqa: E731
    assert ci(x) == ["b", "a"]
    assert ci(ix) == []
    assert ci(ia) == ["b"]
    assert ci(s) == ["b", "a"]
    assert ci(ix2) == ["c"]
    assert ci(free) == [] and ci(only_d) == ["d"] and ci(after) == ["b", "a"]
    assert a.op.get_attr("_has_manual_control_dependencies") is True
    node = {n.name: n for n in g.as_graph_def().node}["x"]
    assert list(node.input) == ["^a", "^b"]


def test_control_dependencies_errors(B):
    g, other = B.Graph(), B.Graph()
    with other.as_default():
        o = B.constant(1.0, name="o")
    with g.as_default():
        B.constant(1.0, name="a")
        with pytest.raises(TypeError, match="Can not convert a int into a Tensor or Operation."):
            g.control_dependencies([1])
        with pytest.raises(ValueError, match="is not an element of this graph"):
            g.control_dependencies([o])
        with pytest.raises(KeyError):
            g.control_dependencies(["nope"])
        with pytest.raises(TypeError):
            g.control_dependencies(B.constant(1.0))
        with g.control_dependencies(["a", "a:0"]):
            assert [op.name for op in B.constant(2.0).op.control_inputs] == ["a"]


# -- devices ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,want", [
    ("/cpu:0", "/device:CPU:0"), ("gpu:0", "/device:GPU:0"), ("/GPU:0", "/device:GPU:0"),
    ("/device:gpu:0", "/device:GPU:0"), ("/job:w/gpu:2", "/job:w/device:GPU:2"),
    ("cpu", "/device:CPU:*"), ("/job:w/replica:0/task:1/device:CPU:0", "/job:w/replica:0/task:1/device:CPU:0"),
])
def test_device_canonical(B, spec, want):
    g = B.Graph()
    with g.as_default(), g.device(spec):
        assert B.constant(1.0).op.device == want


@pytest.mark.parametrize("outer,inner,want", [
    ("/job:w", "/device:GPU:0", "/job:w/device:GPU:0"),
    ("/job:w/device:GPU:0", "/job:ps", "/job:ps/device:GPU:0"),
    ("/job:w/device:GPU:0", "/cpu:1", "/job:w/device:CPU:1"),
    ("/gpu:0", "/job:w", "/job:w/device:GPU:0"),
    ("/job:w", "/task:3", "/job:w/task:3"),
    ("/job:w", "", "/job:w"),
    ("/job:w", None, ""),
])
def test_device_merging(B, outer, inner, want):
    g = B.Graph()
    with g.as_default(), g.device(outer), g.device(inner):
        assert B.constant(1.0).op.device == want


def test_device_functions(B):
    g = B.Graph()
    seen = []

    def f(op):
        seen.append((op.type, op.device))
        return "/cpu:0"
    with g.as_default():
        with g.device(f):
            assert B.constant(1.0).op.device == "/cpu:0"
            with g.device("/job:w"):
                assert B.constant(1.0).op.device == "/cpu:0"
        assert seen[-1] == ("Const", "/job:w")
        with g.device("/job:w"), g.device(f):
            assert B.constant(1.0).op.device == "/job:w/device:CPU:0"
        with g.device("/job:w"), g.device(lambda op: ""):
            assert B.constant(1.0).op.device == "/job:w"
        with g.device(lambda op: None):
            with pytest.raises(TypeError, match="Expected binary or unicode string, got None"):
                B.constant(1.0)
        with pytest.raises(ValueError, match="Unknown attribute 'foo' is encountered while "
                                             "parsing the device spec: '/foo:bar'."):
            with g.device("/foo:bar"):
                pass
        with pytest.raises(AttributeError):
            with g.device(3):
                pass


# -- colocation, container -----------------------------------------------------------------------

def test_colocate_with(B):
    g = B.Graph()
    with g.as_default():
        with g.device("/device:GPU:1"):
            a = B.constant(1.0, name="a")
        b = B.constant(1.0, name="b")
        with g.device("/job:w"):
            with g.colocate_with(a):
                x = B.constant(1.0, name="x")
                with g.device("/cpu:0"):
                    y = B.constant(1.0, name="y")
                with g.colocate_with(b):
                    z = B.constant(1.0, name="z")
                with g.colocate_with(b.op, ignore_existing=True):
                    w = B.constant(1.0, name="w")
            with g.colocate_with(b):
                v = B.constant(1.0, name="v")
                with g.device("/cpu:0"):
                    u = B.constant(1.0, name="u")
        with pytest.raises(ValueError, match="Trying to reset colocation"):
            with g.colocate_with(None):
                pass
        with g.colocate_with(a):
            with g.colocate_with(None, ignore_existing=True):
                free = B.constant(1.0, name="free")
    assert x.op.get_attr("_class") == [b"loc:@a"] and x.op.device == "/device:GPU:1"
    assert y.op.device == "/device:GPU:1"
    assert z.op.get_attr("_class") == [b"loc:@a", b"loc:@b"]
    assert w.op.get_attr("_class") == [b"loc:@b"]
    assert v.op.device == "" and u.op.device == "/device:CPU:0"
    with pytest.raises(ValueError, match="Operation 'a' has no attr named '_class'."):
        a.op.get_attr("_class")
    assert a.op.colocation_groups() == [b"loc:@a"]
    with pytest.raises(ValueError):
        free.op.get_attr("_class")


def test_container_on_stateless_op(B):
    g = B.Graph()
    with g.as_default(), g.container("box") as c:
        assert c == "box"
        cst = B.constant(1.0, name="cst")
    with pytest.raises(ValueError, match="Operation 'cst' has no attr named 'container'."):
        cst.op.get_attr("container")


# -- finalize -----------------------------------------------------------------------------------------

def test_finalize(B):
    g = B.Graph()
    with g.as_default():
        x = B.constant(1.0, name="x")
    g.finalize()
    assert g.finalized
    msg = "Graph is finalized and cannot be modified."
    with g.as_default():
        for build in [lambda: B.constant(1.0), lambda: B.identity(x),
                      lambda: g.add_to_collection("c", 1), lambda: g.add_to_collections(["c"], 1),
                      lambda: g.clear_collection("c")]:
            with pytest.raises(RuntimeError, match=msg):
                build()
        with g.name_scope("still_ok") as s:
            assert s.startswith("still_ok")
        g.unique_name("fine")
        g.get_collection_ref("made")
        g.finalize()
    with B.Session(graph=g) as sess:
        assert sess.run(x) == 1.0


# -- lookup ----------------------------------------------------------------------------------------------

def test_lookup_messages(B):
    g, other = B.Graph(), B.Graph()
    with other.as_default():
        o = B.constant(1.0, name="o")
    with g.as_default():
        c = B.constant(1.0, name="c")
    assert g.get_tensor_by_name("c:0") is c and g.get_operation_by_name("c") is c.op
    assert g.as_graph_element(b"c") is c.op and g.as_graph_element(c) is c
    cases = [
        (lambda: g.get_tensor_by_name("c"), ValueError, "The name 'c' refers to an Operation, not a Tensor."),
        (lambda: g.get_tensor_by_name("zz"), ValueError, "The name 'zz' looks like an (invalid) Operation name, not a Tensor."),
        (lambda: g.get_tensor_by_name("c:x"), ValueError, "The name 'c:x' looks a like a Tensor name, but is not a valid one."),
        (lambda: g.get_tensor_by_name("c:0:0"), ValueError, "looks a like a Tensor name"),
        (lambda: g.get_tensor_by_name("c:1"), KeyError, "The operation, 'c', exists but only has 1 outputs."),
        (lambda: g.get_tensor_by_name("zz:0"), KeyError, "The operation, 'zz', does not exist in the graph."),
        (lambda: g.get_operation_by_name("c:0"), ValueError, "Name 'c:0' appears to refer to a Tensor, not a Operation."),
        (lambda: g.get_operation_by_name("zz"), KeyError, "The name 'zz' refers to an Operation not in the graph."),
        (lambda: g.get_tensor_by_name(b"c:0"), TypeError, "Tensor names are strings (or similar), not bytes."),
        (lambda: g.get_operation_by_name(c), TypeError, "Operation names are strings (or similar)"),
        (lambda: g.as_graph_element(c, allow_tensor=False), TypeError, "Can not convert a SymbolicTensor into a Operation."),
        (lambda: g.as_graph_element(c.op, allow_operation=False), TypeError, "Can not convert a Operation into a Tensor."),
        (lambda: g.as_graph_element(1), TypeError, "Can not convert a int into a Tensor or Operation."),
        (lambda: g.as_graph_element(None), TypeError, "Can not convert a NoneType into a Tensor or Operation."),
        (lambda: g.as_graph_element(c, False, False), ValueError, "allow_tensor and allow_operation can't both be False."),
        (lambda: g.as_graph_element(o), ValueError, "is not an element of this graph."),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=re.escape(msg)):
            fn()


def test_operations_version_and_tensor(B):
    g = B.Graph()
    assert g.version == 0
    with g.as_default():
        a = B.constant(np.float64(1.0), name="a")
        p = B.placeholder(np.float32, shape=[None, 2], name="p")
        q = B.placeholder(np.float32, name="q")
        s = B.add(p, B.constant([[1.0, 2.0]]))
    assert g.version == 5
    ops = g.get_operations()
    assert ops is not g.get_operations() and [o.name for o in ops][:3] == ["a", "p", "q"]
    assert as_np_dtype(a.dtype) == np.float64
    assert p.shape.as_list() == [None, 2] and q.shape.rank is None
    assert s.shape.as_list() == [None, 2]
    assert {p: 1, q: 2}[p] == 1 and len({p, q}) == 2
    assert s.op.values() == tuple(s.op.outputs) and isinstance(s.op.inputs, tuple)
    assert as_np_dtype(s.op.get_attr("T")) == np.float32
    with pytest.raises(ValueError, match="Operation 'Add' has no attr named 'zz'."):
        s.op.get_attr("zz")


def test_constant_dtype_inference(B):
    g = B.Graph()
    with g.as_default():
        got = [as_np_dtype(B.constant(v).dtype) for v in [1, 2 ** 40, 1.5, True, [1.0, 2.0],
                                                           np.arange(3, dtype=np.int16)]]
        assert got == [np.int32, np.int64, np.float32, np.bool_, np.float32, np.int16]
        with pytest.raises(TypeError, match="Expected int32, but got 1.5 of type 'float'."):
            B.constant(1.5, dtype=np.int32)
        x = B.constant(1, name="xi")
        with pytest.raises(TypeError, match="Input 'y' of 'AddV2' Op has type float32 that does "
                                            "not match type int32 of argument 'x'."):
            B.add(x, B.constant(1.0))
        assert B.add(x, x).op.name == "Add_1"     # the failed op still used its name


def test_create_op(B):
    g = B.Graph()
    with g.as_default():
        c = B.constant(1.0, name="c")
        op = g.create_op("Identity", [c])
        op2 = g.create_op("Identity", [c])
        assert (op.name, op2.name, op.type) == ("Identity", "Identity_1", "Identity")
        assert as_np_dtype(op.outputs[0].dtype) == np.float32
        with pytest.raises(TypeError, match="Input #0 is not a tensor: 1.0"):
            g.create_op("Identity", [1.0])
        with pytest.raises((RuntimeError, B.errors.NotFoundError),
                           match="Op type not registered 'NoSuchOp'"):
            g.create_op("NoSuchOp", [])
        with g.device("/cpu:0"):
            assert g.create_op("Identity", [c], compute_device=False).device == ""


# -- feed / fetch guards, gradient override map --------------------------------------------------------

def test_feed_fetch_guards(B):
    g = B.Graph()
    with g.as_default():
        p = B.placeholder(np.float32, shape=[2], name="p")
        a = B.identity(p, name="a")
        b = B.identity(a, name="b")
    assert g.is_feedable(p) and g.is_fetchable(a) and g.is_fetchable(a.op)
    g.prevent_feeding(p)
    g.prevent_fetching(a.op)
    assert not g.is_feedable(p) and not g.is_fetchable(a) and not g.is_fetchable(a.op)
    with B.Session(graph=g) as sess:
        with pytest.raises(ValueError, match="may not be fed"):
            sess.run(b, {p: [1, 2]})
        for fetch in [a, a.op, "a", "a:0"]:
            with pytest.raises(B.InaccessibleTensorError,
                               match="Operation a has been marked as not fetchable."):
                sess.run(fetch)


def test_gradient_override_map(B):
    g = B.Graph()
    with g.as_default():
        c = B.constant(1.0)
        with pytest.raises(TypeError, match="op_type_map must be a dictionary mapping strings to strings"):
            with g.gradient_override_map([("Identity", "X")]):
                pass
        with g.gradient_override_map({"Identity": "MyGrad"}):
            i = B.identity(c)
            with g.gradient_override_map({"Identity": "Inner"}):
                j = B.identity(c)
            k = B.identity(c)
        m = B.identity(c)
    assert i.op.get_attr("_gradient_op_type") == b"MyGrad"
    assert j.op.get_attr("_gradient_op_type") == b"Inner"
    assert k.op.get_attr("_gradient_op_type") == b"MyGrad"
    with pytest.raises(ValueError):
        m.op.get_attr("_gradient_op_type")
    with pytest.raises(ValueError):
        c.op.get_attr("_gradient_op_type")


# -- readerlib-only -------------------------------------------------------------------------------------

def test_top_level_namespace_has_no_graph_names():
    import readerlib as rl
    for name in ["Graph", "Session", "placeholder", "name_scope", "OpError", "OutOfRangeError"]:
        assert not hasattr(rl, name)


def test_device_scope_exit_out_of_order():
    g = rg.Graph()
    a = g.device("/cpu:0")
    b = g.device("/gpu:0")
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="Exiting device scope without proper scope nesting."):
        a.__exit__(None, None, None)


def test_user_registered_op_with_python_kernel():
    name = "TestTimesThree"
    if rg.get_op_type(name) is None:
        rg.register_op(name, inputs=[("x", "T")], outputs=[("y", "T")], attrs={"T": ("type", None)},
                       kernels={"CPU": lambda ctx, inputs: [inputs[0] * 3]})
    with pytest.raises(KeyError, match="already registered"):
        rg.register_op(name)
    g = rg.Graph()
    with g.as_default():
        p = rg.placeholder(np.int64, [None])
        y = rg.apply_op(name, [p]).outputs[0]
    assert y.op.type == name and y.dtype == np.int64 and y.op.name == name
    with rg.Session(graph=g) as s:
        assert s.run(y, {p: [1, 2]}).tolist() == [3, 6]
