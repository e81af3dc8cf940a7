"""Reader-creating ops, ReadOp and ReInit: the graph chain equals the eager chain."""
import threading

import numpy as np
import pytest

import readerlib as rl
import readerlib.graph as rg

SCHEMA = rl.Schema([rl.Field("feats", "float32", (4,), lod_level=1), rl.Field("label", "int64")])


@pytest.fixture
def rio(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "train.rio")
    n = 300
    with rl.RecordIOWriter(path, SCHEMA, chunk_size=4096) as w:
        w.write_batch({"feats": [rng.standard_normal((int(k), 4), dtype=np.float32)
                                 for k in rng.integers(1, 6, n)],
                       "label": np.arange(n)})
    return path


def run_to_end(sess, fetches, feed_dict=None, limit=10_000):
    out = []
    for _ in range(limit):
        try:
            out.append(sess.run(fetches, feed_dict))
        except rg.OutOfRangeError:
            return out
    raise AssertionError("no OutOfRangeError")


def assert_batches_equal(graph_batches, eager_batches):
    assert len(graph_batches) == len(eager_batches) > 0
    for got, want in zip(graph_batches, eager_batches):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if w.lod:
                assert isinstance(g, rl.LoDTensor)
                assert np.array_equal(g.data, w.data)
                assert all(np.array_equal(a, b) for a, b in zip(g.lod, w.lod))
            else:
                assert isinstance(g, np.ndarray) and np.array_equal(g, w.data)


def build(path, buffer=50, batch=32, seed=7, extra=None):
    g = rg.Graph()
    with g.as_default():
        r = rg.create_recordio_reader(path)
        r = rg.create_shuffle_reader(r, buffer, seed=seed)
        r = rg.create_batch_reader(r, batch)
        if extra is not None:
            r = extra(r)
        fields = rg.read(r)
        reset = rg.reset_reader(r)
    return g, r, fields, reset


def test_chain_equals_eager_chain_across_epochs(rio):
    g, r, fields, reset = build(rio)
    eager = rl.RecordIOReader(rio).shuffle(50, seed=7).batch(32)
    with rg.Session(graph=g) as sess:
        epoch1 = run_to_end(sess, fields)
        with pytest.raises(rg.OutOfRangeError) as ei:     # keeps raising until reset
            sess.run(fields)
        assert ei.value.op is fields[0].op and ei.value.error_code == 11
        assert sess.run(reset) is None
        epoch2 = run_to_end(sess, fields)
    assert_batches_equal(epoch1, list(eager))
    assert_batches_equal(epoch2, list(eager))        # the eager chain's second epoch
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(epoch1, epoch2))


def test_issue_example_fetches(rio):
    g = rg.Graph()
    with g.as_default():
        with rg.name_scope("input"):
            r = rg.create_recordio_reader(rio)
            r = rg.create_shuffle_reader(r, 10_000, seed=0)
            r = rg.create_batch_reader(r, 32)
            feats, labels = rg.read(r)
        idx = rg.placeholder(np.int64, shape=[None], name="idx")
        picked = rg.batch_reindex(feats, idx)
    assert [op.name for op in g.get_operations()][:4] == [
        "input/create_recordio_reader", "input/create_shuffle_reader",
        "input/create_batch_reader", "input/read"]
    assert feats.dtype == np.float32 and feats.shape.as_list() == [None, 4]
    assert labels.dtype == np.int64 and labels.shape.as_list() == [None]
    assert r.dtype is rg.resource and r.op.type == "CreateBatchReader"
    assert len(r.op.inputs) == 1 and r.op.get_attr("batch_size") == 32
    with rg.Session(graph=g) as sess:
        got = run_to_end(sess, {"picked": picked, "labels": labels}, {idx: [2, 0, 1]})
    eager = list(rl.RecordIOReader(rio).shuffle(10_000, seed=0).batch(32))
    assert len(got) == len(eager)
    for o, (f, lab) in zip(got, eager):
        assert np.array_equal(o["labels"], lab.data)
        want = rl.batch_reindex(f, [2, 0, 1])
        assert np.array_equal(o["picked"].data, want.data)
        assert np.array_equal(o["picked"].lod[0], want.lod[0])


def test_new_session_starts_from_the_beginning(rio):
    g, r, (feats, labels), reset = build(rio)
    with rg.Session(graph=g) as s1:
        first = s1.run(labels)
        s1.run(labels)
        with rg.Session(graph=g) as s2:
            assert np.array_equal(s2.run(labels), first)


def test_one_run_reads_once_and_two_reads_share_state(rio):
    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_recordio_reader(rio), 10)
        f1, l1 = rg.read(r)
        f2, l2 = rg.read(r)
    eager = list(rl.RecordIOReader(rio).batch(10))
    with rg.Session(graph=g) as sess:
        a, b = sess.run([l1, f1])              # one read op: both fields from one batch
        assert np.array_equal(a, eager[0][1].data) and np.array_equal(b.data, eager[0][0].data)
        x, y = sess.run([l1, l2])              # two read ops: two batches, in op order
        assert np.array_equal(x, eager[1][1].data) and np.array_equal(y, eager[2][1].data)
        assert np.array_equal(sess.run(l2), eager[3][1].data)


def test_multi_pass_prefetch_and_unbatched(rio):
    g = rg.Graph()
    with g.as_default():
        base = rg.create_recordio_reader(rio)
        mp = rg.create_batch_reader(rg.create_multi_pass_reader(
            rg.create_shuffle_reader(base, 64, seed=3), 2), 50, drop_last=True)
        mp_fields = rg.read(mp)
    with rg.Session(graph=g) as sess:
        got = run_to_end(sess, mp_fields)
    assert_batches_equal(got, list(rl.RecordIOReader(rio).shuffle(64, seed=3).multi_pass(2)
                                   .batch(50, drop_last=True)))

    g = rg.Graph()
    with g.as_default():
        pf = rg.create_prefetch_reader(rg.create_batch_reader(rg.create_recordio_reader(rio), 40), 3)
        pf_fields = rg.read(pf)
    with rg.Session(graph=g) as sess:
        got = run_to_end(sess, pf_fields)
    assert_batches_equal(got, list(rl.RecordIOReader(rio).batch(40).prefetch(3)))

    g = rg.Graph()
    with g.as_default():
        feats, label = rg.read(rg.create_recordio_reader(rio))
    assert feats.shape.as_list() == [None, 4] and label.shape.as_list() == []
    with rg.Session(graph=g) as sess:
        got = run_to_end(sess, [feats, label])
    eager = list(rl.RecordIOReader(rio))
    assert len(got) == len(eager)
    for (f, lab), (ef, el) in zip(got, eager):
        assert np.array_equal(f, ef) and lab == el


def test_tfrecord_reader_equals_eager(tmp_path):
    path = str(tmp_path / "x.tfrecord")
    rng = np.random.default_rng(1)
    with rl.TFRecordWriter(path) as w:
        for k in rng.integers(1, 30, 120):
            w.write(rng.integers(0, 256, int(k), dtype=np.uint8).tobytes())
    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_shuffle_reader(rg.create_tfrecord_reader(path), 30, seed=1), 16)
        (data,) = rg.read(r)
    assert data.dtype == np.uint8
    with rg.Session(graph=g) as sess:
        got = run_to_end(sess, [data])
    assert_batches_equal(got, list(rl.TFRecordReader(path, index=False).shuffle(30, seed=1).batch(16)))


def test_container_attr_and_resource_keys(rio):
    g = rg.Graph()
    with g.as_default():
        with g.container("box"):
            r = rg.create_recordio_reader(rio)
            b = rg.create_batch_reader(r, 8)
        plain = rg.create_recordio_reader(rio)
        (f, lab) = rg.read(b)
    assert r.op.get_attr("container") == b"box" and b.op.get_attr("container") == b"box"
    assert plain.op.get_attr("container") == b""
    with rg.Session(graph=g) as sess:
        sess.run(lab)
        assert (b"box", b"create_batch_reader") in sess._resources


def test_errors_at_run(rio, tmp_path):
    missing = str(tmp_path / "missing.rio")
    g = rg.Graph()
    with g.as_default():
        r = rg.create_recordio_reader(missing, schema=SCHEMA)
        f, lab = rg.read(rg.create_batch_reader(r, 4))
    with rg.Session(graph=g) as sess:
        with pytest.raises(rg.NotFoundError) as ei:
            sess.run(lab)
        assert ei.value.op is r.op
    with pytest.raises(FileNotFoundError):
        with rg.Graph().as_default():
            rg.create_recordio_reader(missing)
    # a corrupt chunk: DataLossError (still an OSError) with the op attached
    bad = str(tmp_path / "bad.rio")
    data = bytearray(open(rio, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    g = rg.Graph()
    with g.as_default():
        f, lab = rg.read(rg.create_batch_reader(rg.create_recordio_reader(bad), 300))
    with rg.Session(graph=g) as sess:
        with pytest.raises(rg.DataLossError) as ei:
            sess.run(lab)
        assert isinstance(ei.value, OSError) and ei.value.op is lab.op
    # a schema given at build time that the file does not have
    other = rl.Schema([rl.Field("x", "uint8", (3,))])
    g = rg.Graph()
    with g.as_default():
        (x,) = rg.read(rg.create_recordio_reader(rio, schema=other))
    with rg.Session(graph=g) as sess:
        with pytest.raises(rg.InvalidArgumentError, match="not the schema the graph was built with"):
            sess.run(x)


def test_build_time_argument_errors(rio):
    with rg.Graph().as_default():
        r = rg.create_recordio_reader(rio)
        with pytest.raises(ValueError, match="buffer_size must be a positive int"):
            rg.create_shuffle_reader(r, 0)
        with pytest.raises(TypeError, match="expected a reader variable"):
            rg.read(rg.constant(1.0))
        with pytest.raises(ValueError, match="gives batches already"):
            rg.create_batch_reader(rg.create_batch_reader(r, 2), 2)


def test_concurrent_runs_share_one_reader(rio):
    g = rg.Graph()
    with g.as_default():
        (f, lab) = rg.read(rg.create_batch_reader(rg.create_recordio_reader(rio), 7))
    seen, errs = [], []
    with rg.Session(graph=g) as sess:
        def work():
            try:
                while True:
                    try:
                        seen.append(sess.run(lab))
                    except rg.OutOfRangeError:
                        return
            except Exception as e:  # pragma: no cover
                errs.append(e)
        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert not errs
    assert sorted(np.concatenate(seen).tolist()) == list(range(300))
