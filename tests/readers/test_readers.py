"""Reader chains: sources, shuffle, batch, multi_pass, holder (readerlib/readers/_base.pyx)."""
import collections
import itertools
import math
import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import readerlib as rl
from helpers import (array_reader, assert_distinct_subset, assert_exactly_once, canon, drain,
                     drain_canon, drain_instances, make_columns, split_passes, to_python,
                     unbatch, write_recordio)


def ids_of(reader):
    """The ids (field 0) delivered in the rest of the epoch, in order."""
    return [int(inst[0]) for inst in drain_instances(reader)]


# READERLIB_TEST_EXAMPLES=2000 runs the exactly-once property test harder (default 100, ~10 s).


def ints(n, dtype=np.int64):
    return rl.ArrayReader({"id": np.arange(n, dtype=dtype)})


# ===================================================== exactly once (property)
def _source(kind, cols, schema, path, chunk):
    if kind == "array":
        return array_reader(cols, schema)
    if kind == "python":                 # one fresh block per record: many blocks held by a shuffle
        n = len(cols["id"])
        return rl.PythonReader(lambda: (tuple(cols[k][i] for k in schema.names) for i in range(n)), schema)
    return rl.RecordIOReader(path)


def _reference_epochs(kind, cols, schema, path, buf, seed, epochs):
    """Delivery order of a bare shuffle for shuffle epochs 0..epochs-1."""
    ref = rl.ShuffleReader(_source(kind, cols, schema, path, None), buf, seed=seed)
    out = []
    for e in range(epochs):
        if e:
            ref.reset()
        out.append(drain_canon(ref))
    return out


@settings(max_examples=int(os.environ.get("READERLIB_TEST_EXAMPLES", 100)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(n=st.integers(0, 300), buf=st.integers(1, 400), bs=st.integers(1, 64),
       drop_last=st.booleans(), passes=st.integers(1, 3), lod=st.booleans(),
       batch_first=st.booleans(), kind=st.sampled_from(["array", "recordio", "python"]),
       chunk=st.sampled_from([64, 300, 1 << 20]), seed=st.integers(0, 2**64 - 1))
def test_exactly_once_shuffle_batch_multi_pass(n, buf, bs, drop_last, passes, lod, batch_first,
                                               kind, chunk, seed):
    """Every instance exactly once per pass; drop_last drops exactly the tail of the stream it batches.

    batch_first: shuffle -> batch -> multi_pass.  Every pass re-reads the
    batched stream, so each pass drops its own last ``n % bs`` instances.
    Otherwise shuffle -> multi_pass -> batch: batches run across pass
    boundaries and only the last ``(n * passes) % bs`` of the whole epoch drop.
    In both cases the delivered instances are, in order, exactly the bare
    shuffle's order (shuffle epoch j for pass j) minus the dropped tail.
    """
    cols, schema, want = make_columns(n, lod=lod, seed=n)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.rio")
        if kind == "recordio":
            write_recordio(path, cols, schema, chunk_size=chunk)
        src = _source(kind, cols, schema, path, chunk)
        if batch_first:
            chain = src.shuffle(buf, seed=seed).batch(bs, drop_last=drop_last).multi_pass(passes)
        else:
            chain = src.shuffle(buf, seed=seed).multi_pass(passes).batch(bs, drop_last=drop_last)
        batches = drain(chain)
        refs = _reference_epochs(kind, cols, schema, path, buf, seed, passes)
        for r in refs:
            assert_exactly_once(r, want)

        # batch sizes
        sizes = [len(unbatch(b)) for b in batches]
        if batch_first:
            per_pass = n // bs if drop_last else -(-n // bs)
            assert len(batches) == per_pass * passes
            for p in range(passes):
                group = sizes[p * per_pass:(p + 1) * per_pass]
                assert all(s == bs for s in group[:-1])
                if group:
                    assert group[-1] == (bs if drop_last or n % bs == 0 else n % bs)
            got = [canon(i) for b in batches for i in unbatch(b)]
            kept = n - (n % bs if drop_last else 0)
            for p, piece in enumerate(split_passes(got, kept)):
                assert piece == refs[p][:kept], f"pass {p} differs from shuffle epoch {p}"
                assert_distinct_subset(piece, want)
            assert len(got) == kept * passes
        else:
            total = n * passes
            kept = total - (total % bs if drop_last else 0)
            assert sum(sizes) == kept
            assert all(s == bs for s in sizes[:-1])
            got = [canon(i) for b in batches for i in unbatch(b)]
            stream = [x for r in refs for x in r]
            assert got == stream[:kept]
            for piece in split_passes(got, n):
                if len(piece) == n:
                    assert_exactly_once(piece, want)
                else:
                    assert_distinct_subset(piece, want)

        # the next epoch (for loop) is again exactly once per pass
        again = [canon(i) for b in chain for i in unbatch(b)]
        assert len(again) == len(got)
        if not drop_last:
            assert collections.Counter(again) == collections.Counter(want * passes)
        chain.close()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 200), buf=st.integers(1, 250), seed=st.integers(0, 2**32))
def test_shuffle_buffer_bounds_positions(n, buf, seed):
    """A buffer of b items: output k comes from the first b + k inputs (tf.data's algorithm)."""
    out = ids_of(rl.ShuffleReader(ints(n), buf, seed=seed))
    assert sorted(out) == list(range(n))
    for k, v in enumerate(out):
        assert v < buf + k, (k, v)
    if buf == 1:
        assert out == list(range(n))


@pytest.mark.parametrize("bs,drop_last,want_batches", [
    (3, False, [[0, 1, 2], [3, 4, 5], [6]]),
    (3, True, [[0, 1, 2], [3, 4, 5]]),
    (7, True, [[0, 1, 2, 3, 4, 5, 6]]),
    (8, True, []),
    (8, False, [[0, 1, 2, 3, 4, 5, 6]]),
])
@pytest.mark.parametrize("lod", [False, True])
def test_batch_drop_last_drops_the_tail(bs, drop_last, want_batches, lod):
    cols, schema, _ = make_columns(7, lod=lod)
    got = [b[0].data.tolist() for b in array_reader(cols, schema).batch(bs, drop_last=drop_last)]
    assert got == want_batches


def test_drop_last_with_multi_pass_before_and_after_batch():
    # multi_pass then batch: batches cross pass boundaries; only the epoch's tail drops
    r = ints(5).multi_pass(2).batch(3, drop_last=True)
    assert [b[0].data.tolist() for b in r] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    # batch then multi_pass: each pass drops its own tail
    r = ints(5).batch(3, drop_last=True).multi_pass(2)
    assert [b[0].data.tolist() for b in r] == [[0, 1, 2], [0, 1, 2]]
    r = ints(5).batch(3).multi_pass(2)
    assert [b[0].data.tolist() for b in r] == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]


# ================================================================ seeds
def test_same_seed_same_order_reset_new_order():
    a = rl.ShuffleReader(ints(100), 30, seed=7)
    b = ints(100).shuffle(30, seed=7)
    ea, eb = ids_of(a), ids_of(b)
    assert ea == eb
    assert sorted(ea) == list(range(100)) and ea != list(range(100))
    a.reset()
    ea2 = ids_of(a)
    assert sorted(ea2) == list(range(100)) and ea2 != ea
    b.reset()
    assert ids_of(b) == ea2                 # epoch 1 is reproducible too
    assert a.epoch == 1 and a.seed == 7 and a.buffer_size == 30


def test_for_twice_is_two_epochs():
    r = ints(50).shuffle(50, seed=3)
    e0 = [int(x[0]) for x in r]
    e1 = [int(x[0]) for x in r]
    assert sorted(e0) == sorted(e1) == list(range(50)) and e0 != e1
    fresh = ints(50).shuffle(50, seed=3)
    assert [int(x[0]) for x in fresh] == e0
    fresh.reset()
    assert [int(x[0]) for x in fresh] == e1


def test_epoch_order_does_not_depend_on_how_far_the_previous_epoch_got():
    a = ints(40).shuffle(16, seed=11)
    b = ints(40).shuffle(16, seed=11)
    ids_of(a)
    for _ in range(5):
        b.read_next()
    a.reset()
    b.reset()
    assert ids_of(a) == ids_of(b)


def test_different_seeds_differ():
    orders = {tuple(ids_of(ints(64).shuffle(64, seed=s))) for s in range(20)}
    assert len(orders) == 20


def test_seed_none_draws_a_seed():
    a, b = ints(64).shuffle(64), ints(64).shuffle(64)
    assert a.seed != b.seed
    oa = ids_of(a)
    assert sorted(oa) == list(range(64))
    assert oa != ids_of(b)
    # the drawn seed reproduces the order
    assert ids_of(ints(64).shuffle(64, seed=a.seed)) == oa


def test_large_seed_values():
    for s in (0, 2**63 - 1, 2**64 - 1, np.uint64(2**64 - 1), np.int64(-1)):
        assert sorted(ids_of(ints(20).shuffle(8, seed=s))) == list(range(20))


def test_full_buffer_shuffle_is_uniform():
    counts = collections.Counter(tuple(ids_of(ints(4).shuffle(4, seed=s))) for s in range(2400))
    assert len(counts) == 24
    assert min(counts.values()) > 50 and max(counts.values()) < 160   # expected 100 each


def test_multi_pass_passes_get_new_orders():
    r = ints(30).shuffle(30, seed=5).multi_pass(3)
    out = ids_of(r)
    p = split_passes(out, 30)
    assert len(p) == 3 and all(sorted(x) == list(range(30)) for x in p)
    assert len({tuple(x) for x in p}) == 3


# ================================================================ reset, end, re-iteration
def test_reset_mid_epoch_restarts_cleanly():
    cols, schema, want = make_columns(57, lod=True)
    chain = array_reader(cols, schema).shuffle(10, seed=1).batch(4)
    first = chain.read_next()
    assert len(unbatch(first)) == 4
    chain.read_next()
    chain.reset()
    assert_exactly_once(drain_canon(chain), want)
    # reset twice in a row, then a partial read, then `for`
    chain.reset()
    chain.reset()
    chain.read_next()
    assert_exactly_once([canon(i) for b in chain for i in unbatch(b)], want)


def test_reset_mid_epoch_multi_pass():
    r = ints(10).multi_pass(3)
    got = [int(r.read_next()[0]) for _ in range(15)]
    assert got == list(range(10)) + list(range(5))
    assert r.pass_id == 1
    r.reset()
    assert r.pass_id == 0
    assert ids_of(r) == list(range(10)) * 3


def test_end_of_epoch_is_sticky():
    for r in (ints(3), ints(3).shuffle(2, seed=0), ints(3).batch(2), ints(3).multi_pass(2),
              ints(3).batch(2, drop_last=True).multi_pass(2), rl.ReaderHolder(ints(3))):
        drain(r)
        for _ in range(3):
            assert r.read_next() is None


def test_empty_sources():
    empty = rl.ArrayReader({"id": np.zeros(0, np.int64)})
    assert len(empty) == 0 and empty.read_next() is None
    for chain in (empty.shuffle(5, seed=0).batch(3).multi_pass(4),
                  rl.ArrayReader({"id": np.zeros(0, np.int64)}).multi_pass(1000).batch(2)):
        assert drain(chain) == []
        assert list(chain) == []


def test_decorating_a_started_reader_restarts_it():
    src = ints(10)
    src.read_next()
    src.read_next()
    assert [b[0].data.tolist() for b in src.batch(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# ================================================================ LoD merge (Paddle)
def test_paddle_lod_merge_example():
    # three instances, sequences of lengths 2, 3, 1 (steps of width 2), plus a label
    seqs = [np.arange(4, dtype=np.float32).reshape(2, 2),
            np.arange(10, 16, dtype=np.float32).reshape(3, 2),
            np.array([[99, 98]], np.float32)]
    schema = rl.Schema([rl.Field("w", "float32", (2,), lod_level=1), rl.Field("label", "int64")])
    r = rl.ArrayReader({"w": seqs, "label": np.array([7, 8, 9])}, schema=schema)
    (w, label), = list(r.batch(3))
    assert isinstance(w, rl.LoDTensor) and isinstance(label, rl.LoDTensor)
    assert [l.tolist() for l in w.lod] == [[0, 2, 5, 6]]
    assert w.lod[0].dtype == np.int64
    np.testing.assert_array_equal(w.data, np.concatenate(seqs))
    assert w.dtype == np.float32 and w.shape == (6, 2)
    assert label.lod == [] and label.data.tolist() == [7, 8, 9] and label.shape == (3,)
    assert w.lengths().tolist() == [2, 3, 1]
    for i in range(3):
        np.testing.assert_array_equal(w.sequence(i), seqs[i])
    # batch size 2: offsets restart in each batch
    b = list(rl.ArrayReader({"w": seqs, "label": np.array([7, 8, 9])}, schema=schema).batch(2))
    assert [t[0].lod[0].tolist() for t in b] == [[0, 2, 5], [0, 1]]
    np.testing.assert_array_equal(b[1][0].data, seqs[2])


def test_lod_merge_two_sequence_fields_and_empty_sequences():
    a = [np.zeros((0,), np.int32), np.array([1, 2], np.int32), np.zeros((0,), np.int32), np.array([3], np.int32)]
    c = [np.ones((3, 2, 2), np.float64), np.zeros((0, 2, 2)), 2 * np.ones((1, 2, 2)), np.zeros((2, 2, 2))]
    schema = rl.Schema([rl.Field("a", "int32", (), 1), rl.Field("c", "float64", (2, 2), 1)])
    (ta, tc), = list(rl.ArrayReader({"a": a, "c": c}, schema=schema).batch(4))
    assert ta.lod[0].tolist() == [0, 0, 2, 2, 3] and ta.data.tolist() == [1, 2, 3]
    assert tc.lod[0].tolist() == [0, 3, 3, 4, 6] and tc.shape == (6, 2, 2)
    np.testing.assert_array_equal(tc.data, np.concatenate(c))
    padded, lengths = ta.to_padded(-1)
    assert padded.tolist() == [[-1, -1], [1, 2], [-1, -1], [3, -1]] and lengths.tolist() == [0, 2, 0, 1]


@pytest.mark.parametrize("dtype", rl.tensor.SUPPORTED_DTYPES, ids=str)
def test_batch_outputs_dtype_and_shape(dtype):
    rng = np.random.default_rng(0)
    n = 10
    fixed = (rng.integers(0, 2, size=(n, 2, 3)) if dtype.kind == "b" else rng.integers(0, 100, size=(n, 2, 3))).astype(dtype)
    seqs = [fixed[i, : i % 3].reshape(-1, 3) for i in range(n)]
    schema = rl.Schema([rl.Field("f", dtype, (2, 3)), rl.Field("s", dtype, (3,), 1),
                        rl.Field("scalar", dtype)])
    r = rl.ArrayReader({"f": fixed, "s": seqs, "scalar": fixed[:, 0, 0]}, schema=schema)
    batches = list(r.batch(4))
    assert [len(b[0]) for b in batches] == [4, 4, 2]
    for k, (f, s, sc) in enumerate(batches):
        assert f.dtype == s.dtype == sc.dtype == dtype
        assert f.lod == [] and sc.lod == [] and len(s.lod) == 1
        assert f.shape[1:] == (2, 3) and sc.shape == (len(f),) and s.shape[1:] == (3,)
        np.testing.assert_array_equal(f.data, fixed[4 * k:4 * k + 4])
        np.testing.assert_array_equal(sc.data, fixed[4 * k:4 * k + 4, 0, 0])
        for i in range(len(f)):
            np.testing.assert_array_equal(s.sequence(i), seqs[4 * k + i])


def test_instances_are_tuples_of_arrays():
    schema = rl.Schema([rl.Field("x", "float32", (2, 3)), rl.Field("s", "int16", (4,), 1),
                        rl.Field("y", "uint8")])
    r = rl.ArrayReader({"x": np.ones((3, 2, 3), np.float32),
                        "s": [np.ones((k, 4), np.int16) for k in (0, 1, 5)],
                        "y": np.array([1, 2, 3], np.uint8)}, schema=schema)
    for k, inst in enumerate(r):
        assert isinstance(inst, tuple) and len(inst) == 3
        assert all(isinstance(v, np.ndarray) for v in inst)
        x, s, y = inst
        assert x.shape == (2, 3) and x.dtype == np.float32
        assert s.shape == ((0, 1, 5)[k], 4) and s.dtype == np.int16
        assert y.shape == () and y.dtype == np.uint8 and int(y) == k + 1
    assert not r.is_batched and r.batch(2).is_batched


def test_returned_items_stay_valid():
    """Batches and instances own (or keep alive) their memory: later reads, resets and close don't change them."""
    cols, schema, want = make_columns(200, lod=True, seed=4)
    for chain in (array_reader(cols, schema).shuffle(7, seed=2).batch(9),
                  array_reader(cols, schema).shuffle(7, seed=2)):
        items = []
        while (it := chain.read_next()) is not None:
            items.append(it)
        chain.reset()
        drain(chain)
        chain.close()
        got = []
        for it in items:
            got.extend(unbatch(it) if chain.is_batched else [it])
        assert_exactly_once([canon(i) for i in got], want)
    # fixed-size fast path (one field: zero-copy source)
    x = np.arange(1000, dtype=np.float64)
    chain = rl.ArrayReader(x).shuffle(50, seed=1).batch(64)
    items = list(chain)
    del chain
    assert sorted(np.concatenate([b[0].data for b in items]).tolist()) == x.tolist()


# ================================================================ holder
def test_holder_type_erasure():
    cols, schema, want = make_columns(33, lod=True)
    chain = array_reader(cols, schema).shuffle(8, seed=4).batch(5)
    h = rl.ReaderHolder(chain)
    assert h.reader is chain
    assert h.schema == chain.schema and h.is_batched
    assert isinstance(h, rl.ReaderBase)
    ref = drain_canon(array_reader(cols, schema).shuffle(8, seed=4).batch(5))
    assert drain_canon(h) == ref
    # reset through the holder = reset of the chain (next shuffle epoch)
    h.reset()
    ref_chain = array_reader(cols, schema).shuffle(8, seed=4).batch(5)
    drain(ref_chain)
    ref_chain.reset()
    assert drain_canon(h) == drain_canon(ref_chain)
    # swap the held reader
    other = ints(4)
    h.reset_reader(other)
    assert h.reader is other and not h.is_batched and h.schema == other.schema
    assert ids_of(h) == [0, 1, 2, 3]
    with pytest.raises(TypeError, match="ReaderHolder"):
        h.reset_reader([1, 2])
    with pytest.raises(TypeError, match="ReaderHolder"):
        rl.ReaderHolder(object())


def test_holder_can_be_decorated_and_closes_its_chain():
    src = ints(10)
    h = rl.ReaderHolder(src)
    assert [b[0].data.tolist() for b in h.batch(5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    h.close()
    assert h.closed and src.closed


# ================================================================ close / context manager
def test_context_manager_and_close():
    with ints(5).shuffle(3, seed=0).batch(2) as r:
        assert len(drain(r)) == 3
    assert r.closed and r.reader.closed and r.reader.reader.closed
    for call in (r.read_next, r.reset, lambda: iter(r), lambda: list(r)):
        with pytest.raises(ValueError, match="I/O operation on closed reader"):
            call()
    r.close()                                  # idempotent


def test_close_mid_epoch_source_and_decorators():
    src = ints(100)
    chain = src.shuffle(10, seed=0).batch(3).multi_pass(2)
    chain.read_next()
    chain.close()
    assert src.closed
    with pytest.raises(ValueError, match="I/O operation on closed reader"):
        src.read_next()
    with pytest.raises(ValueError, match="I/O operation on closed reader"):
        chain.read_next()


def test_exit_on_exception_closes():
    with pytest.raises(RuntimeError):
        with ints(3) as r:
            raise RuntimeError
    assert r.closed


# ================================================================ bad input
@pytest.mark.parametrize("make,exc,match", [
    (lambda r: rl.ShuffleReader(r, 0), ValueError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, -3), ValueError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, "x"), TypeError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, 2.0), TypeError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, True), TypeError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, None), TypeError, "buffer_size"),
    (lambda r: rl.ShuffleReader(r, 4, seed="a"), TypeError, "seed"),
    (lambda r: rl.ShuffleReader(r, 4, seed=1.5), TypeError, "seed"),
    (lambda r: r.shuffle(0), ValueError, "buffer_size"),
    (lambda r: rl.BatchReader(r, 0), ValueError, "batch_size"),
    (lambda r: rl.BatchReader(r, -1), ValueError, "batch_size"),
    (lambda r: rl.BatchReader(r, "8"), TypeError, "batch_size"),
    (lambda r: rl.BatchReader(r, 8.0), TypeError, "batch_size"),
    (lambda r: r.batch(-1), ValueError, "batch_size"),
    (lambda r: r.batch(2).batch(2), TypeError, "batches"),
    (lambda r: rl.MultiPassReader(r, 0), ValueError, "num_passes"),
    (lambda r: rl.MultiPassReader(r, -2), ValueError, "num_passes"),
    (lambda r: rl.MultiPassReader(r, "x"), TypeError, "num_passes"),
    (lambda r: r.multi_pass(None), TypeError, "num_passes"),
    (lambda r: rl.ShuffleReader([1, 2], 3), TypeError, "ShuffleReader"),
    (lambda r: rl.ShuffleReader(None, 3), TypeError, "ShuffleReader"),
    (lambda r: rl.BatchReader(np.arange(3), 3), TypeError, "BatchReader"),
    (lambda r: rl.MultiPassReader("file.rio", 3), TypeError, "MultiPassReader"),
])
def test_decorator_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make(ints(5))


@pytest.mark.parametrize("args,kwargs,exc,match", [
    (({"a": np.zeros(3), "b": np.zeros(4)},), {}, ValueError, "disagree on the number of instances"),
    (({"a": np.zeros(3), "s": [np.zeros(2)] * 4},), {}, ValueError, "disagree"),
    ((np.float32(1.0),), {}, ValueError, "scalar"),
    ((np.array([object(), object()]),), {}, TypeError, "object"),
    (({},), {}, ValueError, "at least one array"),
    (([],), {}, ValueError, "empty"),
    (({"x": np.zeros((3, 2))},), {"schema": [("x", "float64", (3,))]}, ValueError, "'x'.*shape"),
    (({"x": np.zeros((3, 2))},), {"schema": [("x", "int64", (2,))]}, TypeError, "'x'.*dtype"),
    (({"x": np.zeros((3, 2))},), {"schema": [("x", "float64", (2,), 1)]}, ValueError, "'x'.*lod_level"),
    (({"x": [np.zeros((1, 2))]},), {"schema": [("x", "float64", (2,))]}, ValueError, "'x'.*lod_level"),
    (({"x": np.zeros(3)},), {"schema": [("x", "float64"), ("y", "int64")]}, ValueError, r"missing \['y'\]"),
    ((np.zeros(3),), {"schema": [("x", "float64"), ("y", "int64")]}, ValueError, "2 fields"),
    (({"x": np.zeros(3), "z": np.zeros(3)},), {"schema": [("x", "float64"), ("y", "int64")]},
     ValueError, r"missing \['y'\]; not in the schema \['z'\]"),
    (({"x": np.zeros(3)},), {"chunk_records": 0}, ValueError, "chunk_records"),
])
def test_array_reader_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rl.ArrayReader(*args, **kwargs)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(num_instances=-1), ValueError, "num_instances"),
    (dict(num_instances="3"), TypeError, "num_instances"),
    (dict(num_instances=3, seed="s"), TypeError, "seed"),
    (dict(num_instances=3, length_range=(5, 2)), ValueError, "length_range"),
    (dict(num_instances=3, length_range=(-1, 2)), ValueError, "length_range"),
    (dict(num_instances=3, low=1.0, high=1.0), ValueError, "high > low"),
])
def test_random_data_generator_bad_input(kwargs, exc, match):
    schema = rl.Schema([rl.Field("x", "float32", (3,), 1)])
    with pytest.raises(exc, match=match):
        rl.RandomDataGenerator(schema, **kwargs)


def test_random_data_generator_needs_schema():
    with pytest.raises(TypeError, match="schema"):
        rl.RandomDataGenerator(None, 3)


def test_python_reader_not_callable():
    with pytest.raises(TypeError, match="callable"):
        rl.PythonReader([1, 2, 3], rl.Schema([rl.Field("x", "int64")]))


_PY_SCHEMA = rl.Schema([rl.Field("x", "float32", (3,)), rl.Field("s", "int64", (2,), 1)])


def _good(i):
    return (np.full(3, i, np.float32), np.full((i % 3, 2), i, np.int64))


@pytest.mark.parametrize("bad,exc,match", [
    ((np.zeros(4, np.float32), np.zeros((1, 2), np.int64)), ValueError, r"instance 3\b.*'x'.*shape"),
    ((np.zeros(3, np.float32), np.zeros((1, 3), np.int64)), ValueError, r"instance 3\b.*'s'"),
    ((np.zeros(3, np.float32), np.zeros(2, np.int64)), ValueError, r"instance 3\b.*'s'.*time axis"),
    ((np.zeros(3, np.float32), np.zeros((1, 2), np.float64)), TypeError, r"instance 3\b.*'s'.*dtype"),
    ((np.zeros(3, np.float32),), ValueError, r"instance 3\b.*1 values"),
    ({"x": np.zeros(3, np.float32)}, ValueError, r"instance 3\b.*missing \['s'\]"),
    ({"x": np.zeros(3, np.float32), "s": np.zeros((0, 2)), "z": 1}, ValueError, r"instance 3\b.*unknown \['z'\]"),
    ((np.array(["a", "b", "c"], dtype=object), np.zeros((1, 2), np.int64)), TypeError, r"instance 3\b.*'x'"),
    (7, TypeError, r"instance 3\b"),
])
@pytest.mark.parametrize("batched", [False, True])
def test_python_reader_bad_instance_names_field_and_index(bad, exc, match, batched):
    def gen():
        for i in range(3):
            yield _good(i)
        yield bad
        yield _good(4)
    r = rl.PythonReader(gen, _PY_SCHEMA)
    if batched:
        r = r.shuffle(1, seed=0).batch(2)
    with pytest.raises(exc, match=match):
        drain(r)


def test_python_reader_round_trip_and_epochs():
    calls = []

    def gen():
        calls.append(1)
        return (_good(i) if i % 2 else {"x": _good(i)[0], "s": _good(i)[1]} for i in range(7))
    r = rl.PythonReader(gen, _PY_SCHEMA)
    for epoch in range(2):
        got = drain_instances(r)
        assert len(got) == 7
        for i, (x, s) in enumerate(got):
            np.testing.assert_array_equal(x, _good(i)[0])
            np.testing.assert_array_equal(s, _good(i)[1])
            assert s.dtype == np.int64 and x.dtype == np.float32
        r.reset()
    assert len(calls) == 2
    # one-field schema: bare values; ints widen to the field dtype
    one = rl.PythonReader(lambda: iter(range(5)), rl.Schema([rl.Field("v", "float64")]))
    assert [v[0].item() for v in one] == [0.0, 1.0, 2.0, 3.0, 4.0]
    b = rl.PythonReader(lambda: iter(range(5)), [("v", "int32")]).batch(2)
    assert [t[0].data.tolist() for t in b] == [[0, 1], [2, 3], [4]]


# ================================================================ sources
def test_array_reader_matches_a_dicts_keys_to_the_schema_by_name(tmp_path):
    """A dict in another key order than the schema: its arrays go to the fields
    of their names.  They were paired by position, so same-typed fields came out
    swapped, silently, and RecordIOWriter.write_batch (which reads a dict of
    columns through ArrayReader) wrote them swapped."""
    schema = rl.Schema([rl.Field("a", "int64"), rl.Field("b", "int64")])
    cols = {"b": np.array([1, 2]), "a": np.array([10, 20])}
    inst = rl.ArrayReader(cols, schema=schema).read_next()
    assert (int(inst["a"]), int(inst["b"])) == (10, 1)
    p = str(tmp_path / "ab.rio")
    with rl.RecordIOWriter(p, schema) as w:
        w.write_batch(cols)
    assert [(int(i["a"]), int(i["b"])) for i in rl.RecordIOReader(p)] == [(10, 1), (20, 2)]


def test_array_reader_forms():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.arange(6)
    assert to_python(rl.ArrayReader(x)) == [(r,) for r in x.tolist()]
    r = rl.ArrayReader((x, y))
    assert r.schema.names == ("f0", "f1") and len(r) == 6
    assert to_python(r) == list(zip(x.tolist(), y.tolist()))
    r = rl.ArrayReader({"x": x, "y": y})
    assert r.schema == rl.Schema([rl.Field("x", "float32", (2,)), rl.Field("y", "int64")])
    # sequences as a list, as a LoDTensor, and as a list with a one-field schema
    seqs = [np.ones((k, 2), np.float32) * k for k in (1, 0, 3)]
    r = rl.ArrayReader({"s": seqs})
    assert r.schema["s"].lod_level == 1
    assert [i[0].shape for i in r] == [(1, 2), (0, 2), (3, 2)]
    r = rl.ArrayReader({"s": rl.LoDTensor.from_sequences(seqs)})
    assert [i[0].tolist() for i in r] == [s.tolist() for s in seqs]
    r = rl.ArrayReader(seqs, schema=rl.Schema([rl.Field("s", "float32", (2,), 1)]))
    assert [i[0].tolist() for i in r] == [s.tolist() for s in seqs]


def test_array_reader_list_of_sequences_with_tuple_schema():
    seqs = [np.ones((k, 2), np.float32) * k for k in (1, 0, 3)]
    r = rl.ArrayReader(seqs, schema=[("s", "float32", (2,), 1)])
    assert [i[0].tolist() for i in r] == [s.tolist() for s in seqs]
    r = rl.ArrayReader([np.zeros(3), np.ones(3)], schema=[("a", "float64"), ("b", "float64")])
    assert to_python(r) == [(0.0, 1.0)] * 3


def test_array_reader_casts_to_schema_and_byte_order():
    r = rl.ArrayReader({"x": np.arange(4, dtype=np.int32)}, schema=[("x", "int64")])
    assert [i[0].dtype for i in r] == [np.int64] * 4
    big = np.arange(5, dtype=">i4")
    assert [int(i[0]) for i in rl.ArrayReader(big)] == [0, 1, 2, 3, 4]
    nc = np.arange(20, dtype=np.float64).reshape(5, 4)[:, ::2]        # not contiguous
    assert to_python(rl.ArrayReader(nc)) == [(row,) for row in nc.tolist()]


@pytest.mark.parametrize("chunk_records", [1, 3, 7, 1000])
@pytest.mark.parametrize("lod", [False, True])
def test_array_reader_chunks_in_order(chunk_records, lod):
    cols, schema, want = make_columns(23, lod=lod)
    r = rl.ArrayReader(cols, schema=schema, chunk_records=chunk_records)
    assert drain_canon(r) == want
    r.reset()
    assert drain_canon(r.batch(5)) == want


@pytest.mark.parametrize("lod", [False, True])
def test_memory_mapped_npy(tmp_path, lod):
    x = np.random.default_rng(0).standard_normal((500, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "big.npy", np.arange(500, dtype=">i8"))
    xm = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert isinstance(xm, np.memmap)
    if lod:
        off = np.arange(0, 501, 5)
        col = rl.LoDTensor(xm, [off])
        r = rl.ArrayReader({"x": col, "i": np.arange(100)})
        got = to_python(r.batch(7))
        assert got == [(x[5 * i:5 * i + 5].tolist(), i) for i in range(100)]
    else:
        r = rl.ArrayReader(xm)                       # one fixed field: zero-copy path
        assert to_python(r) == [(row,) for row in x.tolist()]
        out = np.concatenate([b[0].data for b in rl.ArrayReader(xm).shuffle(64, seed=0).batch(32)])
        assert sorted(map(tuple, out.tolist())) == sorted(map(tuple, x.tolist()))
        r2 = rl.ArrayReader({"x": xm, "b": np.load(tmp_path / "big.npy", mmap_mode="r")})
        assert to_python(r2.batch(500)) == [(row, i) for i, row in enumerate(x.tolist())]


def test_random_data_generator_seeded():
    schema = rl.Schema([rl.Field("f", "float32", (3,), 1), rl.Field("i", "int16", (2,)),
                        rl.Field("b", "bool"), rl.Field("u", "uint8")])
    g = rl.RandomDataGenerator(schema, 2500, seed=5, low=-2.0, high=3.0, length_range=(0, 4))
    assert len(g) == 2500 and g.seed == 5
    e0 = drain_canon(g)
    g.reset()
    assert drain_canon(g) == e0
    assert drain_canon(rl.RandomDataGenerator(schema, 2500, seed=5, low=-2.0, high=3.0,
                                              length_range=(0, 4))) == e0
    assert drain_canon(rl.RandomDataGenerator(schema, 2500, seed=6, low=-2.0, high=3.0,
                                              length_range=(0, 4))) != e0
    insts = drain_instances(g.batch(100))
    assert len(insts) == 2500
    lens = [len(f) for f, _, _, _ in insts]
    assert min(lens) == 0 and max(lens) == 4
    f = np.concatenate([x[0] for x in insts])
    assert f.dtype == np.float32 and f.min() >= -2.0 and f.max() < 3.0
    i = np.stack([x[1] for x in insts])
    assert i.dtype == np.int16 and i.min() >= -2 and i.max() < 3
    assert {bool(x[2]) for x in insts} == {False, True}


def test_random_data_generator_prefix_does_not_depend_on_num_instances():
    schema = rl.Schema([rl.Field("f", "float32", (3,), 1), rl.Field("u", "uint8")])
    long = drain_canon(rl.RandomDataGenerator(schema, 2500, seed=5))
    short = drain_canon(rl.RandomDataGenerator(schema, 10, seed=5))
    assert short == long[:10]


def test_random_data_generator_zero():
    g = rl.RandomDataGenerator([("x", "float64")], 0)
    assert g.read_next() is None and drain(g.batch(3)) == []


def test_repr():
    r = ints(5).shuffle(3, seed=9).batch(2).multi_pass(2)
    s = repr(r)
    assert "MultiPassReader" in s and "BatchReader" in s and "ShuffleReader" in s and "seed=9" in s


def test_constructor_forms_equal_fluent_forms():
    cols, schema, want = make_columns(40, lod=True)
    fluent = array_reader(cols, schema).shuffle(9, seed=4).batch(6, drop_last=True).multi_pass(2)
    ctor = rl.MultiPassReader(rl.BatchReader(rl.ShuffleReader(array_reader(cols, schema), 9, 4), 6, True), 2)
    assert drain_canon(fluent) == drain_canon(ctor)
    assert isinstance(fluent, rl.DecoratedReader) and isinstance(fluent.reader, rl.BatchReader)
    assert isinstance(fluent.reader.reader.reader, rl.FileReader)
    assert fluent.num_passes == 2 and fluent.reader.batch_size == 6 and fluent.reader.drop_last


# ================================================================ threads
_THREADS = r"""
import sys, threading
import numpy as np
import readerlib as rl
n = 20000
cols = {"x": [np.ones((k % 7, 3), np.float32) for k in range(n)], "id": np.arange(n)}
for trial in range(5):
    r = rl.ArrayReader(cols).shuffle(500, seed=trial).batch(16)
    out, errs = [], []
    def work():
        try:
            while (b := r.read_next()) is not None:
                out.append(b[1].data.copy())
        except RuntimeError as e:          # refusing concurrent use is fine
            errs.append(e)
    ts = [threading.Thread(target=work) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ids = sorted(np.concatenate(out).tolist()) if out else []
    if not errs and ids != list(range(n)):
        sys.exit(f"trial {trial}: {len(ids)} ids delivered, {len(set(ids))} distinct, of {n}")
print("ok")
"""


def test_one_reader_read_from_several_threads():
    """Several threads sharing one chain get each instance exactly once, or a clean RuntimeError -- never a crash."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _THREADS], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout[-500:], p.stderr[-1500:])


@pytest.mark.parametrize("shuffle", [False, True])
def test_large_batches_stay_valid(shuffle):
    """Batches of several MB (blocks the core recycles through a pool) are not reused while referenced."""
    n, width = 96, 16384                              # 64 KiB records, 2 MiB batches of 32
    x = np.arange(n, dtype=np.float32)[:, None] + np.zeros((1, width), np.float32)
    seqs = [np.full((1 + k % 3, 1024), k, np.float32) for k in range(n)]
    r = rl.ArrayReader({"x": x, "id": np.arange(n), "s": seqs})
    if shuffle:
        r = r.shuffle(40, seed=1)
    chain = r.batch(32).multi_pass(3)
    kept = list(chain)                                 # not copied
    for epoch in range(2):
        drain(chain)                                   # more batches through the same pool
        chain.reset()
    ids = []
    for xb, idb, sb in kept:
        assert xb.data.shape == (32, width)
        np.testing.assert_array_equal(xb.data, idb.data[:, None].astype(np.float32) + np.zeros((1, width), np.float32))
        for i, k in enumerate(idb.data.tolist()):
            np.testing.assert_array_equal(sb.sequence(i), seqs[k])
        ids.extend(idb.data.tolist())
    assert sorted(ids) == sorted(list(range(n)) * 3)


@pytest.mark.parametrize("make", [
    lambda: rl.RandomDataGenerator(3, 5),
    lambda: rl.PythonReader(lambda: iter([]), 3),
    lambda: rl.ArrayReader(np.arange(3), schema=3),
], ids=["RandomDataGenerator", "PythonReader", "ArrayReader"])
def test_bad_schema_argument_names_the_schema(make):
    with pytest.raises(TypeError, match="[Ss]chema"):
        make()


@pytest.mark.parametrize("value", [300, -1, 2**40])
def test_python_reader_out_of_range_int_is_an_error_not_wrapped(value):
    r = rl.PythonReader(lambda: iter([1, value]), rl.Schema([rl.Field("v", "uint8")]))
    with pytest.raises((ValueError, TypeError, OverflowError), match=r"'v'"):
        drain(r)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_big_sequence_batches_copied_on_threads_equal_one_thread(threads):
    """A batch of big sequence records (>= 4 MiB, >= 32 KiB each) is copied on several
    threads; the result must not depend on how many."""
    from readerlib import _core, _parallel
    rng = np.random.default_rng(4)
    seqs = [rng.standard_normal((int(n), 3)).astype(np.float32) for n in rng.integers(0, 16000, 90)]
    seqs[5] = seqs[5][:0]
    ids = np.arange(90, dtype=np.int64)
    schema = rl.Schema([rl.Field("x", "float32", (3,), lod_level=1), rl.Field("id", "int64")])
    old = _parallel.get_num_threads()
    try:
        _parallel.set_num_threads(threads)
        batches = list(rl.PythonReader(lambda: iter(zip(seqs, ids)), schema).shuffle(30, seed=1).batch(60))
    finally:
        _parallel.set_num_threads(old)
    got = {}
    for x, i in batches:
        for k in range(len(i.data)):
            got[int(i.data[k])] = x.sequence(k)
    assert sorted(got) == list(range(90))
    for k in range(90):
        np.testing.assert_array_equal(got[k], seqs[k])
