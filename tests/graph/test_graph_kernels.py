"""Kernel ops: results equal the eager functions bit for bit (and TF's raw
CTCGreedyDecoder where TensorFlow is installed)."""
import numpy as np
import pytest

import readerlib as rl
import readerlib.graph as rg
from graph_backends import B  # noqa: F401 (fixture)


def run(fetches, feed=None, graph=None):
    with rg.Session(graph=graph or rg.get_default_graph()) as sess:
        return sess.run(fetches, feed)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.float16])
def test_batch_reindex_dense(dtype):
    rng = np.random.default_rng(0)
    xv = (rng.standard_normal((6, 3, 2)) * 50).astype(dtype)
    idx_v = np.array([5, 0, 0, 3], np.int64)
    g = rg.Graph()
    with g.as_default():
        x = rg.placeholder(dtype, [None, 3, 2])
        idx = rg.placeholder(np.int64, [None])
        y = rg.batch_reindex(x, idx)
        dx = rg.batch_reindex_grad(y, idx, 6)
    assert y.op.type == "BatchReindex" and y.shape.as_list() == [None, 3, 2]
    assert dx.op.type == "BatchReindexGrad" and dx.dtype == dtype
    got_y, got_dx = run([y, dx], {x: xv, idx: idx_v}, g)
    want_y = rl.batch_reindex(xv, idx_v)
    assert got_y.tobytes() == want_y.tobytes()
    assert got_dx.tobytes() == rl.batch_reindex_grad(want_y, idx_v, 6).tobytes()


def test_batch_reindex_lod_reindexes_whole_sequences():
    t = rl.LoDTensor.from_sequences([np.full((k, 2), k, np.float32) for k in (1, 3, 2)])
    g = rg.Graph()
    with g.as_default():
        x = rg.placeholder(np.float32, [None, 2])
        y = rg.batch_reindex(x, [2, 0, 2])
    got = run(y, {x: t}, g)
    want = rl.batch_reindex(t, np.array([2, 0, 2]))
    assert isinstance(got, rl.LoDTensor)
    assert got.data.tobytes() == want.data.tobytes() and np.array_equal(got.lod[0], want.lod[0])


def test_ctc_greedy_decoder_op_equals_eager_and_tf(B):
    rng = np.random.default_rng(3)
    logits = rng.integers(-2, 2, size=(6, 4, 5)).astype(np.float32)   # tie-heavy
    seq = np.array([6, 3, 0, 5], np.int32)
    for blank in (-1, 0, -4, 3):
        for merge in (True, False):
            g = B.Graph()
            with g.as_default():
                x = B.placeholder(np.float32, shape=[None, None, 5], name="x")
                n = B.placeholder(np.int32, shape=[None], name="n")
                outs = B.ctc_greedy_decoder_raw(x, n, merge_repeated=merge, blank_index=blank)
            assert len(outs) == 4 and outs[0].op is outs[3].op
            assert outs[0].op.type == "CTCGreedyDecoder" and outs[0].op.name == "CTCGreedyDecoder"
            with B.Session(graph=g) as sess:
                got = sess.run(list(outs), {x: logits, n: seq})
            (sp,), neg = rl.ctc_greedy_decoder(logits, seq, merge_repeated=merge, blank_index=blank)
            for a, w in zip(got, [sp.indices, sp.values, sp.dense_shape, neg]):
                assert a.dtype == w.dtype and a.tobytes() == w.tobytes()


def test_ctc_errors_are_op_errors():
    g = rg.Graph()
    with g.as_default():
        x = rg.placeholder(np.float32, [None, None, 3])
        outs = rg.ctc_greedy_decoder(x, [5])
    with rg.Session(graph=g) as sess:
        with pytest.raises(rg.FailedPreconditionError, match="sequence_length") as ei:
            sess.run(outs[0], {x: np.zeros((2, 1, 3), np.float32)})
        assert ei.value.op is outs[0].op
        with pytest.raises(rg.InvalidArgumentError, match="inputs must not be empty"):
            sess.run(outs[0], {x: np.zeros((2, 0, 3), np.float32)})


def test_rnnt_greedy_decode_op_equals_eager():
    from readerlib.rnnt import RNNTModel
    m = RNNTModel.random(vocab_size=6, encoder_dim=4, pred_dim=5, joint_dim=3, rng=0)
    enc = np.random.default_rng(1).standard_normal((3, 7, 4)).astype(np.float32)
    lengths = np.array([7, 4, 0], np.int64)
    g = rg.Graph()
    with g.as_default():
        e = rg.placeholder(np.float32, [None, None, 4])
        n = rg.placeholder(np.int64, [None])
        labels, times, scores = rg.rnnt_greedy_decode(m, e, n)
        labels_nolen, _, _ = rg.rnnt_greedy_decode(m, e)
    got_l, got_t, got_s, got_all = run([labels, times, scores, labels_nolen], {e: enc, n: lengths}, g)
    hyps = rl.rnnt_greedy_decode(m, enc, lengths)
    for i, h in enumerate(hyps):
        assert np.array_equal(got_l.sequence(i), h.y_sequence)
        assert np.array_equal(got_t.sequence(i), h.timestamps)
        assert got_s[i] == np.float32(h.score)
    for i, h in enumerate(rl.rnnt_greedy_decode(m, enc)):
        assert np.array_equal(got_all.sequence(i), h.y_sequence)
    nd = g.as_graph_def()      # the model is not serialised; the op still is
    assert "_py_model" not in {k for n in nd.node for k in n.attr}
    g2 = rg.Graph()
    with g2.as_default():
        rg.import_graph_def(nd, name="")
    with pytest.raises(rg.FailedPreconditionError, match="no model attached"):
        run("RNNTGreedyDecode:0", {"Placeholder:0": enc, "Placeholder_1:0": lengths}, g2)


def test_gpu_placement_runs_the_gpu_kernels(monkeypatch):
    """Placed on /device:GPU:0, the ops move their inputs to the device and take the
    eager functions' CuPy path (a stand-in for CuPy and kernels._gpu, no GPU needed)."""
    import types

    import readerlib.gpu
    from helpers import FakeCupyArray, install_gpu_stub
    calls = install_gpu_stub(
        monkeypatch, batch_reindex=lambda x, idx: np.asarray(x)[np.asarray(idx)],
        ctc_greedy_decoder=lambda x, n, merge, blank: rl.ctc_greedy_decoder(
            np.asarray(x), np.asarray(n), merge, blank))
    class FakeCupy(types.ModuleType):          # NumPy, whose asarray claims to be CuPy's
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(v, dtype=None):
            return np.asarray(v, dtype=dtype).view(FakeCupyArray)
    fake_cp = FakeCupy("cupy")
    monkeypatch.setattr(readerlib.gpu, "require_cupy", lambda: fake_cp)
    monkeypatch.setattr(readerlib.gpu, "cupy_available", lambda: True)
    logits = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    g = rg.Graph()
    with g.as_default(), rg.device("/device:GPU:0"):
        x = rg.constant(np.arange(6.0, dtype=np.float32).reshape(3, 2))
        y = rg.batch_reindex(x, np.array([2, 0], np.int64))
        outs = rg.ctc_greedy_decoder(logits, [4, 2])
    with rg.Session(graph=g) as sess:
        got_y, got_v = sess.run([y, outs[1]])
    assert got_y.tolist() == [[4, 5], [0, 1]]
    assert [c[0] for c in calls] == ["batch_reindex", "ctc_greedy_decoder"]
    assert isinstance(calls[0][1], FakeCupyArray) and isinstance(calls[1][1], FakeCupyArray)
    (sp,), _ = rl.ctc_greedy_decoder(logits, [4, 2])
    assert got_v.tolist() == sp.values.tolist()
