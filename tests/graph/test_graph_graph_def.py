"""GraphDef: TensorFlow's wire format both ways, import_graph_def."""
import numpy as np
import pytest

import readerlib as rl
import readerlib.graph as rg
from graph_backends import B, rl_backend, tf_backend  # noqa: F401 (fixture)


def basic_graph(B):
    g = B.Graph()
    with g.as_default():
        p = B.placeholder(np.float32, shape=[None, 2], name="p")
        c = B.constant(np.array([[1.5, -2.0]], np.float32), name="c")
        k = B.constant(3, name="k")
        with g.device("/cpu:0"):
            s = B.add(p, c, name="s")
        with g.control_dependencies([k]):
            out = B.identity(s, name="out")
        B.identity(k, name="kk")
    return g


def node_summary(gd):
    out = {}
    for n in gd.node:
        attrs = {}
        for key in sorted(n.attr):
            v = n.attr[key]
            which = v.WhichOneof("value")
            if which == "type":
                attrs[key] = int(v.type)
            elif which == "shape":
                attrs[key] = [d.size for d in v.shape.dim] if not v.shape.unknown_rank else None
            elif which == "tensor":
                attrs[key] = int(v.tensor.dtype)
            else:
                attrs[key] = which
        out[n.name] = (n.op, list(n.input), n.device, attrs)
    return out


def test_graph_def_structure(B):
    gd = basic_graph(B).as_graph_def()
    s = node_summary(gd)
    assert list(s) == ["p", "c", "k", "s", "out", "kk"]
    assert s["p"] == ("Placeholder", [], "", {"dtype": 1, "shape": [-1, 2]})
    assert s["c"] == ("Const", [], "", {"dtype": 1, "value": 1})
    assert s["k"][3]["dtype"] == 3 and "_has_manual_control_dependencies" in s["k"][3]
    assert s["s"] == ("AddV2", ["p", "c"], "/device:CPU:0", {"T": 1})
    assert s["out"] == ("Identity", ["s", "^k"], "", {"T": 1})
    assert gd.versions.producer > 0


def test_rl_graph_def_runs_in_tensorflow():
    tf = pytest.importorskip("tensorflow")
    g = basic_graph(rl_backend())
    data = g.as_graph_def().SerializeToString()
    tf_gd = tf.compat.v1.GraphDef.FromString(data)
    feed = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    with rg.Session(graph=g) as sess:
        want = sess.run(["out:0", "kk:0"], {"p:0": feed})
    tg = tf.Graph()
    with tg.as_default():
        tf.compat.v1.import_graph_def(tf_gd, name="")
    with tf.compat.v1.Session(graph=tg) as sess:
        got = sess.run(["out:0", "kk:0"], {"p:0": feed})
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] == 3


def test_tf_graph_def_runs_in_readerlib():
    tfb = tf_backend()
    tf = tfb.tf
    g = basic_graph(tfb)
    with g.as_default():
        tf.constant(np.arange(6, dtype=np.int64).reshape(2, 3), name="ints")
        tf.constant([True, False], name="bools")
        tf.constant(np.float16(1.5), name="half")
        tf.constant(0.0, shape=[3], name="filled")
    data = g.as_graph_def().SerializeToString()
    feed = np.array([[1.0, 2.0]], np.float32)
    with tf.compat.v1.Session(graph=g) as sess:
        want = sess.run(["out:0", "ints:0", "bools:0", "half:0", "filled:0"], {"p:0": feed})
    rgg = rg.Graph()
    with rgg.as_default():
        rg.import_graph_def(rg.GraphDef.FromString(data), name="")
    assert rgg.get_operation_by_name("s").device == "/device:CPU:0"
    assert [c.name for c in rgg.get_operation_by_name("out").control_inputs] == ["k"]
    with rg.Session(graph=rgg) as sess:
        got = sess.run(["out:0", "ints:0", "bools:0", "half:0", "filled:0"], {"p:0": feed})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
        assert np.asarray(a).dtype == np.asarray(b).dtype
    with rgg.as_default():      # TF's own message class is accepted too
        rg.import_graph_def(g.as_graph_def(), name="again")
    assert rgg.get_operation_by_name("again/out").type == "Identity"


def test_ctc_graph_def_runs_in_tensorflow_with_same_outputs():
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    logits = rng.integers(-2, 2, size=(7, 3, 5)).astype(np.float32)   # many ties
    seq = np.array([7, 4, 0], np.int32)
    for blank in (-1, 0, 3):
        g = rg.Graph()
        with g.as_default():
            x = rg.placeholder(np.float32, [None, None, 5], name="x")
            n = rg.placeholder(np.int32, [None], name="n")
            outs = rg.ctc_greedy_decoder(x, n, blank_index=blank, name="ctc")
        assert [t.name for t in outs] == [f"ctc:{i}" for i in range(4)]
        with rg.Session(graph=g) as sess:
            want = sess.run(list(outs), {x: logits, n: seq})
        (sp,), neg = rl.ctc_greedy_decoder(logits, seq, blank_index=blank)
        for a, b in zip(want, [sp.indices, sp.values, sp.dense_shape, neg]):
            assert a.tobytes() == b.tobytes()
        tg = tf.Graph()
        with tg.as_default():
            tf.compat.v1.import_graph_def(
                tf.compat.v1.GraphDef.FromString(g.as_graph_def().SerializeToString()), name="")
        with tf.compat.v1.Session(graph=tg) as sess:
            got = sess.run([f"ctc:{i}" for i in range(4)], {"x:0": logits, "n:0": seq})
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_import_graph_def_names_input_map_return_elements(B):
    src = B.Graph()
    with src.as_default():
        p = B.placeholder(np.float32, shape=[], name="p")
        B.add(p, B.constant(1.0, name="one"), name="sum")
    gd = src.as_graph_def()
    g = B.Graph()
    with g.as_default():
        B.constant(0.0, name="p")
        x = B.constant(10.0, name="x")
        assert B.import_graph_def(gd, name="imp") is None
        t, op = B.import_graph_def(gd, name="imp", input_map={"p:0": x},
                                   return_elements=["sum:0", "one"])
        with g.name_scope("outer"):
            B.import_graph_def(gd, name="in")
        B.import_graph_def(gd, name="")
        B.import_graph_def(gd)
    names = [o.name for o in g.get_operations()]
    assert "imp/sum" in names and "imp_1/sum" in names and "outer/in/sum" in names
    assert "p_1" in names and "sum" in names and "import/sum" in names
    assert t.name == "imp_1/sum:0" and op.name == "imp_1/one"
    with B.Session(graph=g) as sess:
        assert sess.run(t) == 11.0


def test_import_errors(B):
    g = B.Graph()
    with g.as_default():
        with pytest.raises(TypeError, match="Argument `graph_def` must be a GraphDef proto."):
            B.import_graph_def("nope")
    gd = rg.GraphDef()
    n = gd.node.add(name="x", op="Identity", input=["nothere"])
    n.attr["T"].type = 1
    unknown = rg.GraphDef()
    unknown.node.add(name="y", op="NoSuchOp")
    if B.name == "tf":
        gd = B.tf.compat.v1.GraphDef.FromString(gd.SerializeToString())
        unknown = B.tf.compat.v1.GraphDef.FromString(unknown.SerializeToString())
    with g.as_default():
        with pytest.raises(ValueError, match="Node 'x': Unknown input node 'nothere'"):
            B.import_graph_def(gd, name="")
        with pytest.raises(B.errors.NotFoundError, match="Op type not registered 'NoSuchOp'"):
            B.import_graph_def(unknown, name="")


def test_add_shapes_and_from_version():
    g = basic_graph(rl_backend())
    gd = g.as_graph_def(add_shapes=True)
    node = {n.name: n for n in gd.node}["s"]
    assert [d.size for d in node.attr["_output_shapes"].list.shape[0].dim] == [-1, 2]
    with g.as_default():
        rg.constant(1.0, name="late")
    # readerlib follows the docstring (TF 2.21 ignores from_version)
    assert [n.name for n in g.as_graph_def(from_version=6).node] == ["late"]


def test_reader_graph_round_trips_through_a_file(tmp_path):
    schema = rl.Schema([rl.Field("x", "uint8", (8,))])
    path = str(tmp_path / "d.rio")
    with rl.RecordIOWriter(path, schema) as w:
        w.write_batch({"x": np.random.default_rng(0).integers(0, 255, (100, 8), dtype=np.uint8)})
    g = rg.Graph()
    with g.as_default():
        with g.container("c1"):
            r = rg.create_batch_reader(rg.create_shuffle_reader(rg.create_recordio_reader(path), 30, seed=2), 16)
        (x,) = rg.read(r, name="x_read")
        idx = rg.placeholder(np.int64, [None], name="idx")
        rg.batch_reindex(x, idx, name="picked")
        rg.reset_reader(r, name="reinit")
    gd_path = tmp_path / "graph.pb"
    gd_path.write_bytes(g.as_graph_def().SerializeToString())

    g2 = rg.Graph()
    with g2.as_default():
        rg.import_graph_def(rg.GraphDef.FromString(gd_path.read_bytes()), name="")
    op = g2.get_operation_by_name("create_shuffle_reader")
    assert op.type == "CreateShuffleReader" and op.get_attr("seed") == 2
    assert op.get_attr("container") == b"c1"
    chain = rl.RecordIOReader(path).shuffle(30, seed=2).batch(16)
    with rg.Session(graph=g2) as sess:
        for epoch in range(2):           # the second epoch follows the eager chain's second
            for (b,) in chain:
                got = sess.run("picked:0", {"idx:0": [1, 0]})
                np.testing.assert_array_equal(got, b.data[[1, 0]])
            with pytest.raises(rg.OutOfRangeError):
                sess.run("x_read:0")
            sess.run("reinit")


def test_tensor_proto_round_trip():
    from readerlib.graph.graph_def import tensor_from_proto, tensor_proto
    for arr in [np.float32(2.5), np.arange(5, dtype=np.int16), np.array([True, False]),
                np.arange(4, dtype=np.float16).reshape(2, 2), np.array([1 + 2j], np.complex64),
                np.array([b"ab", b"c"]), np.zeros((0, 3), np.float64), np.uint64(2 ** 63)]:
        back = tensor_from_proto(rg.graph_def.TensorProto.FromString(
            tensor_proto(arr).SerializeToString()))
        assert back.shape == np.shape(arr)
        np.testing.assert_array_equal(back, arr)


def test_import_applies_device_and_control_scopes(B):
    src = B.Graph()
    with src.as_default():
        p = B.placeholder(np.float32, shape=[], name="p")
        with src.device("/cpu:0"):
            B.identity(p, name="pinned")
        B.identity(p, name="free")
    gd = src.as_graph_def()
    g = B.Graph()
    with g.as_default():
        gate = B.constant(1.0, name="gate")
        with g.device("/job:w"), g.control_dependencies([gate]):
            B.import_graph_def(gd, name="i")
    ops = {o.name: o for o in g.get_operations()}
    for name in ("i/p", "i/pinned", "i/free"):
        assert [c.name for c in ops[name].control_inputs] == ["gate"]
    assert ops["i/free"].device == "/job:w"
    assert ops["i/pinned"].device == "/job:w/device:CPU:0"


def test_wire_format_round_trips_through_both_parsers(tmp_path):
    """Every field readerlib writes means the same to TensorFlow's parser and back,
    and a TF GraphDef survives readerlib's parser unchanged (unknown fields kept)."""
    tfb = tf_backend()
    tf = tfb.tf
    g = basic_graph(rl_backend())
    with g.as_default():
        rg.constant(np.arange(6, dtype=np.int64).reshape(2, 3), name="ints")
        rg.constant(np.array([b"ab", b""]), name="strs")
        rg.constant(np.float16(1.5), name="half")
        with g.colocate_with(g.get_operation_by_name("ints")):
            rg.identity(g.get_tensor_by_name("ints:0"), name="colo")
    ours = g.as_graph_def(add_shapes=True)
    theirs = tf.compat.v1.GraphDef.FromString(ours.SerializeToString())
    assert rg.GraphDef.FromString(theirs.SerializeToString()) == ours
    assert [n.name for n in theirs.node] == [n.name for n in ours.node]
    colo = [n for n in theirs.node if n.name == "colo"][0]
    assert list(colo.attr["_class"].list.s) == [b"loc:@ints"]
    tg = basic_graph(tfb)
    tf_gd = tg.as_graph_def(add_shapes=True)
    back = tf.compat.v1.GraphDef.FromString(rg.GraphDef.FromString(
        tf_gd.SerializeToString()).SerializeToString())
    assert back == tf_gd
