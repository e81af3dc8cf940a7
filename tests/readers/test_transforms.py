"""Transformations (issue 14): map, map_batches, filter, take/skip/repeat,
padded_batch, bucket_by_length, element_spec and len.

Every transformation is checked for exactly-once delivery per epoch against a
plain-Python reference, for the same output whatever num_threads, for
checkpoint/resume at every position (helpers.assert_checkpoint_equal), and on
its error paths (the error names the position or the field, and reading on
stays consistent).
"""
import collections
import threading

import numpy as np
import pytest

import readerlib as rl
from helpers import (canon_value, array_reader, assert_checkpoint_equal, assert_exactly_once, canon, drain,
                     drain_canon, drain_instances, make_columns, unbatch, write_recordio)

N = 37


@pytest.fixture(scope="module")
def data():
    cols, schema, want = make_columns(N, lod=True, seed=3, max_len=6)
    return cols, schema, want


def src(data):
    cols, schema, _ = data
    return array_reader(cols, schema)


def instances(data):
    """The source instances as tuples of arrays, in order."""
    cols, schema, _ = data
    return [tuple(np.asarray(cols[f.name][i]) for f in schema) for i in range(N)]


def double_seq(inst):
    i, s, f = inst
    return (i, s * 2, f + 1)


def add_length(inst):
    """Changes the schema: a new fixed field, a dict output."""
    i, s, f = inst
    return {"id": i, "seq": s, "n": np.int32(len(s))}


# ------------------------------------------------------------------------- map
@pytest.mark.parametrize("nt", [1, 2, 4])
def test_map_yields_fn_of_every_instance_in_order(data, nt):
    got = drain_canon(src(data).map(double_seq, num_threads=nt))
    assert got == [canon(double_seq(x)) for x in instances(data)]


def test_map_same_output_for_any_thread_count_through_shuffle_and_batch(data):
    outs = []
    for nt in (1, 2, 4):
        c = src(data).shuffle(9, seed=5).map(double_seq, num_threads=nt).batch(4)
        outs.append([drain_canon(c) for _ in range(2)])     # two epochs, two shuffle orders
        c.close()
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][0] != outs[0][1]
    assert_exactly_once(outs[0][0], [canon(double_seq(x)) for x in instances(data)])


def test_map_changes_the_schema_inferred_from_the_first_output(data):
    r = src(data).map(add_length)
    assert r.schema == rl.Schema([rl.Field("id", "int64"), rl.Field("seq", "float32", (3,), lod_level=1),
                                  rl.Field("n", "int32")])
    assert drain_canon(r) == [canon(tuple(add_length(x).values())) for x in instances(data)]
    # and the compiled batch after it sees the new schema
    b = src(data).map(add_length).batch(5)
    assert [canon(x) for x in drain_instances(b)] == [canon(tuple(add_length(x).values()))
                                                      for x in instances(data)]


def test_map_with_declared_output_schema_and_a_new_sequence_field(data):
    out = rl.Schema([rl.Field("id", "int64"), rl.Field("rep", "int16", (), lod_level=1)])
    fn = lambda x: (x[0], np.full(int(x[0]) % 4, 7, np.int16))          # noqa: E731
    r = src(data).map(fn, output_schema=out)
    assert r.schema == out
    assert drain_canon(r) == [canon(fn(x)) for x in instances(data)]


def test_map_calls_fn_once_per_instance_schema_inference_included(data):
    calls = collections.Counter()

    def fn(x):
        calls[int(x[0])] += 1
        return x
    r = src(data).map(fn)
    assert sum(calls.values()) == 1             # the inference call, at construction
    drain(r)
    assert calls == collections.Counter(range(N))   # its output was used for instance 0
    r.reset()
    drain(r)
    assert calls == collections.Counter({i: 2 for i in range(N)})


def test_map_runs_on_several_threads_when_asked():
    seen = set()
    barrier = threading.Barrier(2, timeout=10)

    def fn(x):
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            barrier.wait()         # returns only when two threads are in fn at once
        return x
    r = rl.ArrayReader(np.arange(200)).map(fn, num_threads=2, output_schema=rl.Schema(
        [rl.Field("f0", "int64")]))
    assert [int(v[0]) for v in r] == list(range(200))
    assert len(seen) == 2


def test_map_over_bare_tfrecord_instances(tmp_path):
    p = str(tmp_path / "t.tfrecord")
    with rl.TFRecordWriter(p) as w:
        for i in range(11):
            w.write(bytes([i]) * i)
    r = rl.TFRecordReader(p).map(lambda x: (x[0][::-1].copy(), np.int64(len(x[0]))))
    got = [(bytes(a), int(n)) for a, n in r]
    assert got == [(bytes([i]) * i, i) for i in range(11)]


class Boom(Exception):
    pass


def fails_at(*bad):
    def fn(x):
        if int(x[0]) in bad:
            raise Boom(f"bad {int(x[0])}")
        return double_seq(x)
    return fn


@pytest.mark.parametrize("nt", [1, 4])
def test_map_exception_names_the_position_and_reading_on_skips_only_that_record(data, nt):
    r = src(data).map(fails_at(5, 6, 30), num_threads=nt)
    got, errors = [], []
    while True:
        try:
            item = r.read_next()
        except Boom as e:
            errors.append((len(got), str(e), "\n".join(getattr(e, "__notes__", []))))
            continue
        if item is None:
            break
        got.append(canon(item))
    want = [canon(double_seq(x)) for x in instances(data) if int(x[0]) not in (5, 6, 30)]
    assert got == want
    assert [e[:2] for e in errors] == [(5, "bad 5"), (5, "bad 6"), (28, "bad 30")]
    assert "instance 5 of this epoch's input to MapReader" in errors[0][2]
    assert "instance 30 " in errors[2][2]
    assert "ArrayReader" in errors[0][2]           # the source it read


def test_map_exception_names_the_file(tmp_path, data):
    cols, schema, _ = data
    p = write_recordio(str(tmp_path / "x.rio"), cols, schema)
    r = rl.RecordIOReader(p).map(fails_at(3))
    with pytest.raises(Boom) as ei:
        drain(r)
    assert p in "\n".join(ei.value.__notes__) and "instance 3 " in "\n".join(ei.value.__notes__)


def test_map_wrong_output_names_the_field_and_reading_on_continues(data):
    def fn(x):
        i, s, f = x
        if int(i) == 4:
            return (i, s[:, :2], f)          # steps of the wrong shape
        if int(i) == 9:
            return (i, s, f.astype(np.complex64))
        if int(i) == 11:
            return (i, s)
        return x
    r = src(data).map(fn)
    errs, got = [], []
    while True:
        try:
            item = r.read_next()
        except (ValueError, TypeError) as e:
            errs.append(str(e) + "\n".join(getattr(e, "__notes__", [])))
            continue
        if item is None:
            break
        got.append(int(item[0]))
    assert got == [i for i in range(N) if i not in (4, 9, 11)]
    assert "field 'seq'" in errs[0] and "(3,)" in errs[0] and "instance 4 " in errs[0]
    assert "field 'fixed'" in errs[1] and "complex64" in errs[1]
    assert "2 values" in errs[2] and "3 fields" in errs[2]


def test_map_inferred_fixed_shape_that_varies_says_to_declare_a_sequence():
    r = rl.ArrayReader(np.arange(5)).map(lambda x: (np.zeros(int(x[0]) + 1),))
    assert r.schema[0].shape == (1,)
    r.read_next()
    with pytest.raises(ValueError, match=r"field 'f0' has shape \(1,\), got \(2,\).*lod_level=1"):
        r.read_next()


def test_map_bad_arguments(data):
    with pytest.raises(TypeError, match="callable"):
        src(data).map(3)
    with pytest.raises(TypeError, match="map_batches"):
        src(data).batch(2).map(lambda b: b)
    with pytest.raises(ValueError, match="num_threads"):
        src(data).map(lambda x: x, num_threads=0)
    with pytest.raises(ValueError, match="empty.*output_schema"):
        rl.ArrayReader(np.arange(5)).take(0).map(lambda x: x)
    with pytest.raises(Boom, match="bad 0") as ei:
        src(data).map(fails_at(0))
    assert "infer the output schema" in "\n".join(ei.value.__notes__)


def test_map_inference_does_not_move_the_shuffle_order(data):
    plain = drain_canon(src(data).shuffle(8, seed=1))
    mapped = drain_canon(src(data).shuffle(8, seed=1).map(lambda x: x))
    assert mapped == plain


# ----------------------------------------------------------------- map_batches
def test_map_batches_identity_is_the_batches_unchanged(data):
    want = drain(src(data).shuffle(6, seed=2).batch(5))
    got = drain(src(data).shuffle(6, seed=2).batch(5).map_batches(lambda b: b))
    assert [[canon(i) for i in unbatch(b)] for b in got] == [[canon(i) for i in unbatch(b)] for b in want]


def test_map_batches_changes_values_and_schema(data):
    def fn(b):
        ids, seq, fixed = b
        return {"id": ids, "seq": rl.LoDTensor(seq.data * 3, seq.lod), "total": fixed.data.sum(axis=1)}
    r = src(data).batch(4).map_batches(fn)
    assert r.schema.names == ("id", "seq", "total") and r.schema["seq"].lod_level == 1
    got = drain_instances(r)
    ref = [(x[0], x[1] * 3, x[2].sum()) for x in instances(data)]
    assert [canon(g) for g in got] == [canon(x) for x in ref]


def test_map_batches_calls_once_per_batch_and_errors_name_the_batch(data):
    calls = []

    def fn(b):
        calls.append(len(b[0].data))
        if len(calls) == 4:
            raise Boom("four")
        return b
    r = src(data).batch(5).map_batches(fn)
    assert calls == [5]
    got = []
    with pytest.raises(Boom) as ei:
        while (b := r.read_next()) is not None:
            got.append(b)
    assert "batch 3 of this epoch" in "\n".join(ei.value.__notes__)
    rest = drain(r)
    assert len(got) == 3 and len(rest) == 8 - 1 - 3
    assert sum(calls) == N - 5 + 5          # every batch once (the first through inference)


def test_map_batches_wrong_output_names_the_field(data):
    def fn(b):
        ids, seq, fixed = b
        return (ids, seq, rl.LoDTensor(fixed.data[:-1]))
    with pytest.raises(ValueError, match="field 'fixed' holds 3 instances"):
        src(data).batch(4).map_batches(fn, output_schema=src(data).schema).read_next()
    with pytest.raises(TypeError, match="map_batches works on batches"):
        src(data).map_batches(lambda b: b)


def test_map_batches_after_padded_batch_keeps_padded_fields(data):
    r = src(data).padded_batch(4, pad_value=-1).map_batches(lambda b: (b[0], rl.LoDTensor(b[1].data + 1),
                                                                        b[2], b[3]))
    ref = drain(src(data).padded_batch(4, pad_value=-1))
    got = drain(r)
    assert len(got) == len(ref)
    for g, w in zip(got, ref):
        np.testing.assert_array_equal(g[1].data, w[1].data + 1)
        assert g[1].data.shape == w[1].data.shape and g[3].data.tolist() == w[3].data.tolist()


# ---------------------------------------------------------------------- filter
def test_filter_keeps_what_the_predicate_accepts(data):
    r = src(data).shuffle(7, seed=4).filter(lambda x: len(x[1]) % 2 == 0).batch(3)
    got = drain_canon(r)
    want = [canon(x) for x in instances(data) if len(x[1]) % 2 == 0]
    assert_exactly_once(got, want)
    assert rl.ArrayReader(np.arange(6)).batch(2).filter(lambda b: b[0].data[0] > 1).read_next()[0].data.tolist() \
        == [2, 3]


def test_filter_errors_name_the_position_and_reading_on_continues(data):
    def pred(x):
        if int(x[0]) == 7:
            raise Boom("seven")
        if int(x[0]) == 8:
            return np.array([True, False])
        return True
    r = src(data).filter(pred)
    got = [int(x[0]) for x in drain(r.take(7))]
    with pytest.raises(Boom) as ei:
        r.read_next()
    assert "item 7 of this epoch" in "\n".join(ei.value.__notes__)
    with pytest.raises(TypeError, match="must return a bool.*shape \\(2,\\).*item 8"):
        r.read_next()
    assert got + [int(x[0]) for x in drain(r)] == [i for i in range(N) if i not in (7, 8)]


# ----------------------------------------------------------- take, skip, repeat
def test_take_skip_values_and_lengths(data):
    ids = lambda r: [int(x[0]) for x in drain_instances(r)]                 # noqa: E731
    assert ids(src(data).take(5)) == list(range(5))
    assert ids(src(data).skip(30)) == list(range(30, N))
    assert ids(src(data).skip(50)) == []
    assert ids(src(data).take(0)) == []
    assert ids(src(data).skip(3).take(4)) == [3, 4, 5, 6]
    assert len(src(data).take(5)) == 5 and len(src(data).take(500)) == N
    assert len(src(data).skip(30)) == N - 30 and len(src(data).skip(50)) == 0
    assert len(src(data).batch(5).take(3)) == 3
    r = src(data).take(4)
    assert ids(r) == [0, 1, 2, 3]
    r.reset()
    assert ids(r) == [0, 1, 2, 3]                    # every epoch
    with pytest.raises(ValueError, match="count"):
        src(data).take(-1)


def test_repeat_each_pass_is_a_new_epoch_with_a_new_order(data):
    r = src(data).shuffle(10, seed=7).repeat(3)
    got = drain_canon(r)
    assert len(got) == 3 * N and len(r) == 3 * N
    passes = [got[k * N:(k + 1) * N] for k in range(3)]
    for p in passes:
        assert_exactly_once(p, [canon(x) for x in instances(data)])
    assert passes[0] != passes[1] != passes[2]
    # the same orders as the shuffle's own epochs 0, 1, 2
    s = src(data).shuffle(10, seed=7)
    own = []
    for _ in range(3):
        own.append(drain_canon(s))
        s.reset()
    assert passes == own


def test_repeat_forever_and_its_length(data):
    r = src(data).repeat()
    with pytest.raises(TypeError, match="not known"):
        len(r)
    assert bool(r)
    got = [int(x[0]) for x in drain(r.take(3 * N + 5))]
    assert got == list(range(N)) * 3 + list(range(5))
    assert len(src(data).repeat().take(100)) == 100
    assert drain(rl.ArrayReader(np.arange(3)).take(0).repeat()) == []       # empty below: ends
    assert drain(src(data).repeat(0)) == []


# ------------------------------------------------------------------ padded batch
def padded_reference(insts, schema, bs, pad_value=0, multiple=1, drop_last=False):
    out = []
    for k in range(0, len(insts), bs):
        group = insts[k:k + bs]
        if drop_last and len(group) < bs:
            break
        fields, lengths = [], []
        for j, f in enumerate(schema):
            vals = [g[j] for g in group]
            if f.lod_level:
                t = max([len(v) for v in vals] + [0])
                t = -(-t // multiple) * multiple
                a = np.full((len(vals), t) + f.shape, pad_value, f.dtype)
                for i, v in enumerate(vals):
                    a[i, :len(v)] = v
                fields.append(a)
                lengths.append(np.array([len(v) for v in vals], np.int64))
            else:
                fields.append(np.stack(vals).astype(f.dtype))
        out.append(fields + lengths)
    return out


def as_arrays(batches):
    return [[np.asarray(t.data) for t in b] for b in batches]


@pytest.mark.parametrize("kw", [{}, {"pad_value": -1.5}, {"pad_to_multiple_of": 4},
                                {"drop_last": True}, {"pad_value": 2, "pad_to_multiple_of": 3}])
def test_padded_batch_matches_the_reference(data, kw):
    cols, schema, _ = data
    r = src(data).padded_batch(5, **kw)
    assert r.schema.names == ("id", "seq", "fixed", "seq_length") and r.is_batched
    got = as_arrays(drain(r))
    want = padded_reference(instances(data), schema, 5, kw.get("pad_value", 0),
                            kw.get("pad_to_multiple_of", 1), kw.get("drop_last", False))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    assert len(r) == (N // 5 if kw.get("drop_last") else -(-N // 5))


def test_padded_batch_through_prefetch_and_a_shuffle(data):
    a = as_arrays(drain(src(data).shuffle(8, seed=3).padded_batch(4)))
    b = as_arrays(drain(src(data).shuffle(8, seed=3).padded_batch(4).prefetch(2)))
    assert all(all(np.array_equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b)) and len(a) == len(b)


def test_padded_batch_bad_arguments(data):
    with pytest.raises(ValueError, match="pad_value.*'seq'"):
        src(data).padded_batch(4, pad_value="x")
    with pytest.raises(ValueError, match="no sequence"):
        rl.ArrayReader(np.arange(4)).padded_batch(2)
    s = rl.Schema([rl.Field("s", "int8", (), lod_level=1)])
    with pytest.raises(ValueError, match="pad_value 300"):
        rl.ArrayReader([np.zeros(2, np.int8)], schema=s).padded_batch(2, pad_value=300)
    s = rl.Schema([rl.Field("s", "int8", (), lod_level=1), rl.Field("s_length", "int64")])
    with pytest.raises(ValueError, match="already has one"):
        rl.ArrayReader({"s": [np.zeros(2, np.int8)], "s_length": np.zeros(1, np.int64)},
                       schema=s).padded_batch(2)


# ------------------------------------------------------------ bucket by length
def bucket_reference(lengths, boundaries, batch_sizes, drop_remainder=False):
    """tf.data's bucket_by_sequence_length grouping, on indices."""
    buckets = [[] for _ in batch_sizes]
    out = []
    for i, n in enumerate(lengths):
        j = int(np.searchsorted(boundaries, n, side="right"))
        buckets[j].append(i)
        if len(buckets[j]) == batch_sizes[j]:
            out.append(buckets[j])
            buckets[j] = []
    if not drop_remainder:
        out.extend(b for b in buckets if b)
    return out


@pytest.mark.parametrize("drop", [False, True])
def test_bucket_by_length_matches_the_reference(data, drop):
    cols, schema, _ = data
    lengths = [len(s) for s in cols["seq"]]
    r = src(data).bucket_by_length([2, 4], [3, 2, 4], drop_remainder=drop)
    got = drain(r)
    want = bucket_reference(lengths, [2, 4], [3, 2, 4], drop)
    assert [b[0].data.tolist() for b in got] == want
    for b in got:
        ids = b[0].data
        t = max(lengths[i] for i in ids)
        assert b[1].data.shape == (len(ids), t, 3) and b[3].data.tolist() == [lengths[i] for i in ids]
    if not drop:
        assert sorted(i for b in want for i in b) == list(range(N))


def test_bucket_by_length_agrees_with_tf_data(data):
    tf = pytest.importorskip("tensorflow")
    cols, schema, _ = data
    ds = tf.data.Dataset.from_generator(
        lambda: ((np.int64(i), s) for i, s in zip(cols["id"], cols["seq"])),
        output_signature=(tf.TensorSpec((), tf.int64), tf.TensorSpec((None, 3), tf.float32)))
    ds = ds.bucket_by_sequence_length(lambda i, s: tf.shape(s)[0], [2, 4], [3, 2, 4], padding_values=(
        np.int64(0), np.float32(-1)))
    want = [(i.numpy().tolist(), s.numpy()) for i, s in ds]
    got = [(b[0].data.tolist(), b[1].data) for b in src(data).bucket_by_length([2, 4], [3, 2, 4],
                                                                               pad_value=-1)]
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_bucket_pad_to_boundary_and_lod_mode(data):
    cols, schema, _ = data
    small = src(data).filter(lambda x: len(x[1]) < 6)
    for b in small.bucket_by_length([2, 4, 6], [3, 3, 3, 3], pad_to_bucket_boundary=True):
        lens = b[3].data
        bound = [1, 3, 5][int(np.searchsorted([2, 4, 6], lens.max(), side="right"))]
        assert b[1].data.shape[1] == bound
    with pytest.raises(ValueError, match="not below the last boundary"):
        drain(src(data).bucket_by_length([2, 4], [3, 3, 3], pad_to_bucket_boundary=True))
    lod = drain(src(data).bucket_by_length([2, 4], [3, 2, 4], padded=False))
    assert all(len(b) == 3 and b[1].lod for b in lod)
    assert_exactly_once([canon(i) for b in lod for i in unbatch(b)], [canon(x) for x in instances(data)])


@pytest.mark.parametrize("padded", [True, False])
def test_bucket_token_budget(data, padded):
    cols, schema, _ = data
    lengths = [len(s) for s in cols["seq"]]
    r = src(data).shuffle(9, seed=1).bucket_by_length([3], max_tokens=10, padded=padded)
    got = drain(r)
    ids = []
    for b in got:
        bi = b[0].data.tolist()
        ids.extend(bi)
        tokens = len(bi) * max(lengths[i] for i in bi) if padded else sum(lengths[i] for i in bi)
        assert tokens <= 10
    assert sorted(ids) == list(range(N))
    again = drain(src(data).shuffle(9, seed=1).bucket_by_length([3], max_tokens=10, padded=padded))
    assert [b[0].data.tolist() for b in again] == [b[0].data.tolist() for b in got]
    with pytest.raises(ValueError, match="more than max_tokens=3 alone"):
        drain(src(data).bucket_by_length([3], max_tokens=3))


def test_bucket_bad_arguments(data):
    with pytest.raises(ValueError, match="len\\(boundaries\\) \\+ 1 = 3"):
        src(data).bucket_by_length([2, 4], [3, 3])
    with pytest.raises(ValueError, match="strictly increasing"):
        src(data).bucket_by_length([4, 2], [3, 3, 3])
    with pytest.raises(ValueError, match="batch_sizes= .* or max_tokens="):
        src(data).bucket_by_length([4])
    with pytest.raises(ValueError, match="not a sequence"):
        src(data).bucket_by_length([4], [2, 2], length_field="id")


# -------------------------------------------------------------- spec and length
def test_element_spec_and_len(data):
    r = src(data)
    assert r.element_spec == r.schema and not r.is_batched
    b = r.shuffle(4, seed=0).batch(5)
    assert b.element_spec == r.schema and b.is_batched and len(b) == -(-N // 5)
    assert len(src(data).batch(5, drop_last=True)) == N // 5
    assert len(src(data).map(lambda x: x)) == N
    assert len(src(data).repeat(3).batch(2)) == -(-3 * N // 2)
    with pytest.raises(TypeError, match="not known"):
        len(src(data).filter(lambda x: True))
    assert len(rl.RandomDataGenerator(r.schema, 19).multi_pass(2).shard(3, 1)) == 13
    assert bool(src(data).filter(lambda x: True))


# ------------------------------------------------------------ checkpoint/resume
CHAINS = {
    "map": lambda d: src(d).map(double_seq),
    "map-threads": lambda d: src(d).shuffle(6, seed=1).map(double_seq, num_threads=4).batch(3),
    "map-schema": lambda d: src(d).map(add_length).batch(4),
    "map_batches": lambda d: src(d).batch(4).map_batches(lambda b: (b[0], b[1], rl.LoDTensor(b[2].data * 2))),
    "filter": lambda d: src(d).shuffle(5, seed=2).filter(lambda x: int(x[0]) % 3 != 0).batch(2),
    "take-skip": lambda d: src(d).shuffle(5, seed=3).skip(4).take(20),
    "repeat": lambda d: src(d).shuffle(7, seed=4).repeat(2).batch(5),
    "repeat-forever": lambda d: src(d).shuffle(7, seed=4).repeat().take(2 * N + 3),
    "padded": lambda d: src(d).shuffle(7, seed=5).padded_batch(4, pad_value=-1),
    "bucket": lambda d: src(d).shuffle(7, seed=6).bucket_by_length([2, 4], [3, 2, 4]),
    "bucket-tokens": lambda d: src(d).bucket_by_length([3], max_tokens=9, padded=False),
    "prefetch": lambda d: src(d).map(double_seq, num_threads=2).padded_batch(3).prefetch(2),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_restore_at_every_position_yields_the_rest(data, name):
    assert_checkpoint_equal(lambda: CHAINS[name](data))


def test_state_of_a_map_restores_under_another_thread_count(data):
    a = src(data).shuffle(6, seed=1).map(double_seq, num_threads=1)
    it = iter(a)
    for _ in range(10):
        next(it)
    state = a.get_state()
    rest = drain_canon(a)
    b = src(data).shuffle(6, seed=1).map(double_seq, num_threads=4)
    b.set_state(state)
    assert drain_canon(b) == rest


@pytest.mark.parametrize("nt", [1, 3])
def test_map_outputs_kept_long_by_a_shuffle_stay_intact(data, nt):
    # one thread carves outputs from shared blocks: a shuffle after the map keeps
    # records of many blocks at once; none may be overwritten or freed early
    got = drain_canon(src(data).map(double_seq, num_threads=nt).shuffle(30, seed=1).batch(7))
    assert_exactly_once(got, [canon(double_seq(x)) for x in instances(data)])
    big = rl.ArrayReader(np.arange(6)).map(lambda x: (np.full(40_000, x[0], np.int32),), num_threads=nt)
    got = [b[0].data for b in big.shuffle(4, seed=0).batch(2)]
    assert sorted(int(r[0]) for g in got for r in g) == list(range(6))
    assert all((r == r[0]).all() for g in got for r in g)


def test_map_over_a_python_source_and_under_prefetch(data):
    insts = instances(data)
    schema = data[1]
    r = rl.PythonReader(lambda: iter(insts), schema).map(double_seq, num_threads=2).prefetch(2)
    assert drain_canon(r) == [canon(double_seq(x)) for x in insts]
    r.close()
    assert r.closed


def test_map_batches_read_directly_or_through_a_reader_after_it_agree(data):
    def fn(b):
        ids, seq, fixed = b
        return {"fixed": fixed.data.astype(np.float64), "id": ids.data + 1,
                "seq": rl.LoDTensor(seq.data[:, :1].copy(), seq.lod)}
    out = rl.Schema([rl.Field("id", "int64"), rl.Field("seq", "float32", (1,), lod_level=1),
                     rl.Field("fixed", "float32", (2,))])
    direct = drain(src(data).batch(4).map_batches(fn, output_schema=out))
    nested = drain(src(data).batch(4).map_batches(fn, output_schema=out).prefetch(2))
    assert [[canon(i) for i in unbatch(b)] for b in direct] == [[canon(i) for i in unbatch(b)] for b in nested]
    assert direct[0][2].data.dtype == np.float32        # cast to the schema on both paths
    assert direct[0][0].data.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("nt", [1, 3])
def test_map_refills_inputs_only_when_the_function_kept_no_reference(nt):
    x = np.arange(12000, dtype=np.int64).reshape(4000, 3)
    r = rl.ArrayReader({"x": x}).map(lambda inst: inst, num_threads=nt)
    assert np.array_equal(np.stack([v[0] for v in r]), x)
    assert r.reused >= 2000                      # identity keeps nothing: inputs are refilled
    kept = []

    def keep(inst):
        kept.append(inst)                        # the tuple ...
        return inst
    r = rl.ArrayReader({"x": x}).map(keep, num_threads=nt)
    drain(r)
    kept.sort(key=lambda k: int(k[0][0]))        # threads append in any order
    assert r.reused == 0 and np.array_equal(np.stack([k[0] for k in kept]), x)
    views = []

    def keep_view(inst):
        views.append(inst[0][1:])                # ... or a view of an array: never refilled
        return (inst[0] * 2,)
    r = rl.ArrayReader({"x": x}).map(keep_view, num_threads=nt)
    assert np.array_equal(np.stack([v[0] for v in r]), x * 2)
    views.sort(key=lambda v: int(v[0]))
    assert r.reused == 0 and np.array_equal(np.stack(views), x[:, 1:])


def test_filter_predicate_may_keep_its_inputs():
    x = np.arange(300, dtype=np.int64).reshape(100, 3)
    kept = []
    r = rl.ArrayReader({"x": x}).filter(lambda inst: kept.append(inst) or True)
    assert np.array_equal(np.stack([v[0] for v in r]), x)
    assert np.array_equal(np.stack([k[0] for k in kept]), x)
    r = rl.ArrayReader({"x": x}).filter(lambda inst: int(inst[0][0]) % 2 == 0)
    assert np.array_equal(np.stack([v[0] for v in r]), x[::2])


@pytest.mark.parametrize("nt", [1, 4])
def test_map_an_error_below_comes_after_the_records_before_it(nt):
    def gen():
        for i in range(50):
            if i == 17:
                raise Boom("source broke")
            yield (np.int64(i),)
    src_ = rl.PythonReader(gen, rl.Schema([rl.Field("i", "int64")]))
    r = src_.map(lambda x: (x[0] * 10,), num_threads=nt)
    got = []
    with pytest.raises(Boom, match="source broke"):
        while (item := r.read_next()) is not None:
            got.append(int(item[0]))
    assert got == [10 * i for i in range(17)]
    assert r.read_next() is None                 # the generator is done after raising
    r.reset()
    with pytest.raises(Boom):
        drain(r)                                 # a new epoch reads (and fails) again


def test_padded_and_bucketed_batches_of_bare_tfrecord_instances(tmp_path):
    p = str(tmp_path / "t.tfrecord")
    with rl.TFRecordWriter(p) as w:
        for i in range(10):
            w.write(bytes([i + 1]) * i)
    b = next(iter(rl.TFRecordReader(p).padded_batch(4, pad_value=255)))
    assert b[0].data.tolist() == [[255, 255, 255], [2, 255, 255], [3, 3, 255], [4, 4, 4]]
    assert b[1].data.tolist() == [0, 1, 2, 3]
    got = [b[1].data.tolist() for b in rl.TFRecordReader(p).bucket_by_length([3, 6], [2, 2, 2])]
    assert got == bucket_reference(list(range(10)), [3, 6], [2, 2, 2])


def test_the_docs_examples_run(tmp_path):
    """docs/transformations.md's python blocks, as one script, in a subprocess
    with a time limit (a hang fails instead of stalling the suite)."""
    import os
    import re
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "transformations.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 3
    script = tmp_path / "transformations.py"
    script.write_text("\n\n".join(blocks) + "\nprint('DOC OK')\n")
    where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    env = dict(os.environ, PYTHONPATH=where + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-P", str(script)], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "DOC OK" in out.stdout


# ------------------------------------------------- pickling and refused states
def not_multiple_of_3(inst):
    return int(inst[0]) % 3 != 0


def scale_floats(batch):
    return (batch[0], batch[1], rl.LoDTensor(batch[2].data * 2))


PICKLABLE = {
    "map": lambda d: src(d).shuffle(6, seed=1).map(double_seq, num_threads=2).batch(3),
    "map_batches": lambda d: src(d).batch(4).map_batches(scale_floats),
    "filter": lambda d: src(d).filter(not_multiple_of_3).batch(2),
    "take-skip-repeat": lambda d: src(d).shuffle(5, seed=3).skip(4).take(20).repeat(2),
    "repeat-forever": lambda d: src(d).repeat().take(2 * N + 3),
    "padded": lambda d: src(d).padded_batch(4, pad_value=-1, pad_to_multiple_of=2),
    "bucket": lambda d: src(d).bucket_by_length([2, 4], [3, 2, 4], drop_remainder=True),
    "bucket-tokens": lambda d: src(d).bucket_by_length([3], max_tokens=9, padded=False),
}


def _items(reader):
    """The rest of the epoch, item by item (a batch as its fields' data and offsets)."""
    out = []
    while (x := reader.read_next()) is not None:
        out.append(tuple((canon_value(np.asarray(v.data)), tuple(canon_value(l) for l in v.lod))
                         if isinstance(v, rl.LoDTensor) else canon_value(v) for v in x))
    return out


@pytest.mark.parametrize("name", sorted(PICKLABLE))
def test_a_pickled_transformation_chain_continues_where_it_was(data, name):
    import pickle
    full = _items(PICKLABLE[name](data))
    for k in (0, 1, len(full) // 2):
        c = PICKLABLE[name](data)
        head = [c.read_next() for _ in range(k)]
        assert all(h is not None for h in head)
        other = pickle.loads(pickle.dumps(c))
        assert _items(other) == full[k:], f"{name}: pickled after {k} items"


@pytest.mark.parametrize("a, b, what", [
    (lambda d: src(d).take(20), lambda d: src(d).take(21), "count"),
    (lambda d: src(d).skip(2), lambda d: src(d).skip(3), "count"),
    (lambda d: src(d).repeat(2), lambda d: src(d).repeat(), "count"),
    (lambda d: src(d).map(double_seq), lambda d: src(d).map(add_length), "fn"),
    (lambda d: src(d).filter(not_multiple_of_3), lambda d: src(d).filter(lambda x: True), "predicate"),
    (lambda d: src(d).padded_batch(4), lambda d: src(d).padded_batch(5), "batch_size"),
    (lambda d: src(d).padded_batch(4), lambda d: src(d).padded_batch(4, pad_value=-1), "pad_value"),
    (lambda d: src(d).bucket_by_length([2, 4], [3, 2, 4]),
     lambda d: src(d).bucket_by_length([2, 5], [3, 2, 4]), "boundaries"),
])
def test_a_state_of_another_transformation_is_refused_naming_the_difference(data, a, b, what):
    ra = a(data)
    next(iter(ra))
    with pytest.raises(ValueError, match=what):
        b(data).set_state(ra.get_state())


def test_map_threads_are_timed_against_the_calling_thread_and_the_output_stays_the_same():
    # num_threads > 1: the first chunk calls on the threads, the second on the
    # calling thread alone, then the faster of the two (re-timed every 16
    # chunks); whichever runs a chunk, the output is the input order's
    x = np.arange(20_000, dtype=np.int64)
    one = [int(v[0]) for v in rl.ArrayReader(x).map(lambda v: (v[0] * 3,))]
    r = rl.ArrayReader(x).map(lambda v: (v[0] * 3,), num_threads=2)   # 20 chunks of 1024
    assert [int(v[0]) for v in r] == one == [3 * i for i in range(20_000)]
    chunks = -(-20_000 // 1024)
    assert 1 <= r.threaded_chunks < chunks            # both ways ran
    again = [int(v[0]) for v in r]                     # the next epoch: the same again
    assert again == one
