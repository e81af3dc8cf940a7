"""gradients / RegisterGradient / gradient_override_map, on readerlib and tf.compat.v1."""
import itertools

import numpy as np
import pytest

import readerlib as rl
import readerlib.graph as rg
from graph_backends import B, tf_backend  # noqa: F401 (fixture)

_ids = itertools.count()


def test_identity_and_add_gradients(B):
    g = B.Graph()
    with g.as_default():
        x = B.placeholder(np.float32, shape=[3], name="x")
        y = B.placeholder(np.float32, shape=[3], name="y")
        b = B.placeholder(np.float32, shape=[1], name="b")
        z = B.add(B.identity(x), B.add(x, y))
        w = B.add(z, b)
        u = B.placeholder(np.float32, shape=[3], name="u")
        gx, gy, gu = B.gradients(z, [x, y, u])
        gb, gx2 = B.gradients(w, [b, x], grad_ys=[B.constant([1.0, 2.0, 3.0])])
    assert gu is None
    feed = {x: [1, 2, 3], y: [4, 5, 6], b: [0.5]}
    with B.Session(graph=g) as sess:
        vx, vy, vb, vx2 = sess.run([gx, gy, gb, gx2], feed)
    np.testing.assert_array_equal(vx, [2, 2, 2])
    np.testing.assert_array_equal(vy, [1, 1, 1])
    np.testing.assert_array_equal(vb, [6.0])
    np.testing.assert_array_equal(vx2, [2, 4, 6])


def test_register_gradient_and_override_map(B):
    name = f"TestDoubleGrad{next(_ids)}_{B.name}"

    @B.RegisterGradient(name)
    def _double(op, grad):
        return [B.add(grad, grad)]
    with pytest.raises(KeyError, match=f"Registering two gradient with name '{name}'!"):
        B.RegisterGradient(name)(_double)
    with pytest.raises(TypeError, match="op_type must be a string"):
        B.RegisterGradient(3)
    g = B.Graph()
    with g.as_default():
        x = B.placeholder(np.float32, shape=[2], name="x")
        with g.gradient_override_map({"Identity": name}):
            y = B.identity(x, name="m")
        with g.gradient_override_map({"Identity": f"Unregistered{name}"}):
            bad = B.identity(x, name="bad")
        (gx,) = B.gradients(y, [x])
        with pytest.raises(LookupError, match="No gradient defined for operation'bad' "
                                              r"\(op type: Identity\)"):
            B.gradients(bad, [x])
    with B.Session(graph=g) as sess:
        np.testing.assert_array_equal(sess.run(gx, {x: [1, 1]}), [2, 2])


def test_wrong_number_of_gradients(B):
    name = f"TestBadGrad{next(_ids)}_{B.name}"

    @B.RegisterGradient(name)
    def _bad(op, grad):
        return [grad]
    g = B.Graph()
    with g.as_default():
        x = B.placeholder(np.float32, shape=[2], name="x")
        with g.gradient_override_map({"AddV2": name}):
            y = B.add(x, x)
        with pytest.raises(ValueError, match="(?s)Num gradients 1 generated for op .* do not match num inputs 2"):
            B.gradients(y, [x])


def test_batch_reindex_gradient_is_batch_reindex_grad():
    g = rg.Graph()
    rng = np.random.default_rng(0)
    xv = rng.standard_normal((5, 3)).astype(np.float32)
    idx_v = np.array([4, 0, 4, 2, 4], np.int64)
    dyv = rng.standard_normal((5, 3)).astype(np.float32)
    with g.as_default():
        x = rg.placeholder(np.float32, [None, 3], name="x")
        idx = rg.placeholder(np.int64, [None], name="idx")
        dy = rg.placeholder(np.float32, [None, 3], name="dy")
        y = rg.batch_reindex(x, idx)
        (gx,) = rg.gradients(y, [x], grad_ys=[dy])
        (ggy,) = rg.gradients(gx, [dy])
    assert gx.op.type == "BatchReindexGrad" and gx.op.name.startswith("gradients/")
    with rg.Session(graph=g) as sess:
        got = sess.run(gx, {x: xv, idx: idx_v, dy: dyv})
        gg = sess.run(ggy, {x: xv, idx: idx_v, dy: dyv})
    assert got.tobytes() == rl.batch_reindex_grad(dyv, idx_v, 5).tobytes()
    np.testing.assert_array_equal(gg, np.ones((5, 3), np.float32)[idx_v] * 0 + 1)


def test_batch_reindex_gradient_matches_tf_gather():
    tfb = tf_backend()
    tf = tfb.tf
    xv = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx_v = np.array([3, 1, 3, 3], np.int64)
    dyv = np.arange(12, dtype=np.float32).reshape(4, 3) - 5   # integer-valued: sums are exact
    tg = tf.Graph()
    with tg.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.gather(x, idx_v)
        (gx,) = tf.compat.v1.gradients(y, [x], grad_ys=[tf.constant(dyv)])
        dense = tf.convert_to_tensor(gx)
    with tf.compat.v1.Session(graph=tg) as sess:
        want = sess.run(dense, {x: xv})
    g = rg.Graph()
    with g.as_default():
        x = rg.placeholder(np.float32, [None, 3])
        (gx,) = rg.gradients(rg.batch_reindex(x, idx_v), [x], grad_ys=[dyv])
    with rg.Session(graph=g) as sess:
        np.testing.assert_array_equal(sess.run(gx, {x: xv}), want)
