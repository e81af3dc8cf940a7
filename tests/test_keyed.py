"""Batches and instances keyed by field name (issue 14 item 5; readerlib/_keyed.pyx).

What read_next() returns is a tuple (unpacking, [0], len: the old code keeps
working) and a read-only mapping (["feats"], keys(), in, dict()): checked for
every kind of reader that makes items, through map / map_batches / filter
(whose functions get keyed items and may return keyed items, tuples or
dicts), padded and bucketed batches, pickling, the torch / JAX / Ray
hand-offs and the graph ReadOp; plus exactly-once, the same output for any
num_threads, and checkpoint/resume with keyed outputs.
"""
import copy
import pickle

import numpy as np
import pytest

import readerlib as rl
from helpers import (array_reader, assert_checkpoint_equal, assert_exactly_once, canon, drain_canon,
                     make_columns, write_recordio)

N = 29


@pytest.fixture(scope="module")
def data():
    return make_columns(N, lod=True, seed=5, max_len=6)      # fields id, seq (lod), fixed


def src(data):
    cols, schema, _ = data
    return array_reader(cols, schema)


def chains(data, tmp_path):
    """Every kind of item maker: (name, reader, batched)."""
    cols, schema, _ = data
    path = write_recordio(str(tmp_path / "k.rio"), cols, schema)
    return [
        ("array", src(data), False),
        ("recordio", rl.RecordIOReader(path), False),
        ("python", rl.PythonReader(lambda: iter([(cols["id"][i], cols["seq"][i], cols["fixed"][i])
                                                 for i in range(N)]), schema), False),
        ("shuffle", src(data).shuffle(8, seed=1), False),
        ("map", src(data).map(lambda x: x), False),
        ("filter", src(data).filter(lambda x: int(x["id"]) % 2 == 0), False),
        ("batch", src(data).batch(4), True),
        ("prefetch", src(data).batch(4).prefetch(2), True),
        ("map_batches", src(data).batch(4).map_batches(lambda b: b), True),
        ("padded", src(data).padded_batch(4), True),
        ("bucketed", src(data).bucket_by_length([2, 4], [4, 4, 4]), True),
        ("take", src(data).batch(3).take(2), True),
    ]


# ------------------------------------------------------------- the two faces
def test_every_reader_yields_keyed_items_named_by_its_element_spec(data, tmp_path):
    for name, r, batched in chains(data, tmp_path):
        items = list(r)
        assert items, name
        for item in items:
            assert isinstance(item, rl.Batch if batched else rl.Instance), (name, type(item))
            assert isinstance(item, tuple), name
            assert item.keys() == r.element_spec.names, name
            assert len(item) == len(r.element_spec), name
            for k, key in enumerate(item.keys()):
                assert item[key] is item[k], (name, key)      # the same object both ways
        try:
            assert len(r) == len(items), name               # len() where known agrees with reading
        except TypeError:
            pass
        r.close()


def test_unpacks_and_indexes_like_the_tuple_it_was(data):
    cols, schema, _ = data
    i, s, f = next(iter(src(data)))                          # old code: unpacking in schema order
    assert int(i) == 0 and np.array_equal(s, cols["seq"][0]) and np.array_equal(f, cols["fixed"][0])
    b = next(iter(src(data).batch(5)))
    ids, seq, fixed = b
    assert b[0] is ids and b[-1] is fixed and b[:2] == (ids, seq)
    assert type(b[:2]) is tuple
    assert list(b) == [ids, seq, fixed]
    assert tuple(b) == (ids, seq, fixed)
    assert np.array_equal(b["id"].data, np.arange(5))
    assert np.array_equal(b["seq"].lod[0], seq.lod[0])


def test_mapping_methods(data):
    b = next(iter(src(data).batch(5)))
    assert b.keys() == ("id", "seq", "fixed")
    assert b.values() == tuple(b)
    assert b.items() == tuple(zip(("id", "seq", "fixed"), b))
    assert "seq" in b and "nope" not in b
    assert b.get("fixed") is b[2] and b.get("nope") is None and b.get("nope", 7) == 7
    d = dict(b)
    assert list(d) == ["id", "seq", "fixed"] and d["seq"] is b[1]
    assert b._asdict() == d
    assert type(b)._fields == ("id", "seq", "fixed")
    with pytest.raises(KeyError, match=r"no field named 'nope'; fields are \['id', 'seq', 'fixed'\]"):
        b["nope"]
    with pytest.raises(IndexError):
        b[3]
    with pytest.raises(TypeError):
        b[0] = 1                                              # read-only


def test_one_class_per_kind_and_names(data):
    a = next(iter(src(data)))
    b = next(iter(src(data).shuffle(4, seed=0)))
    assert type(a) is type(b)                                  # cached by names
    assert type(a) is not type(next(iter(src(data).batch(2))))  # an Instance is not a Batch
    assert type(rl.Instance(id=1, seq=2, fixed=3)) is type(a)
    z = type(next(iter(src(data).map(lambda x: {"z": x["id"]}))))
    assert z is not type(a) and z._fields == ("z",) and issubclass(z, rl.Instance)


def test_equality_repr_and_pickling(data):
    r = src(data).batch(5)
    b1 = next(iter(r))
    b2 = next(iter(r))                                         # a new epoch: the same first batch
    assert b1 is not b2 and b1 == b2 and not (b1 != b2)
    assert b1 != next(r)                                        # the second batch differs
    assert b1 == {k: v for k, v in b1.items()}
    assert b1 == tuple(b1)
    assert b1 != dict(list(b1.items())[:2])
    other_names = rl.Batch(a=b1[0], b=b1[1], c=b1[2])
    assert other_names != b1 and other_names == tuple(b1)       # names count between keyed items
    with pytest.raises(TypeError):
        hash(b1)
    text = repr(b1)
    assert text.startswith("Batch(id=LoDTensor(") and "seq=LoDTensor(shape=" in text and "fixed=" in text
    inst = next(iter(src(data)))
    assert repr(inst).startswith("Instance(id=array(0)")
    for item in (b1, inst):
        back = pickle.loads(pickle.dumps(item))
        assert type(back) is type(item) and back == item and back.keys() == item.keys()
        assert copy.copy(item) is item
        deep = copy.deepcopy(item)
        assert deep == item and deep[0] is not item[0]
    nan = rl.Instance(x=np.array([np.nan, 1.0]))
    assert nan == pickle.loads(pickle.dumps(nan))             # values compare as records
    assert rl.Instance(x=np.array([1, 2], np.int32)) != rl.Instance(x=np.array([1, 2], np.int64))


def test_constructors_and_their_errors():
    b = rl.Batch({"a": np.arange(2), "b": np.ones(2)})
    assert b.keys() == ("a", "b") and type(b)(*b) == b and type(b)(a=b[0], b=b[1]) == b
    assert type(b)._make(list(b)) == b
    r = b._replace(b=np.zeros(2))
    assert type(r) is type(b) and np.array_equal(r["b"], np.zeros(2)) and r["a"] is b["a"]
    with pytest.raises(ValueError, match=r"_replace: no fields \['c'\]"):
        b._replace(c=1)
    with pytest.raises(TypeError, match=r"takes 2 values \['a', 'b'\], got 1"):
        type(b)(1)
    with pytest.raises(TypeError, match=r"missing \['b'\], unknown \['c'\]"):
        type(b)(a=1, c=2)
    with pytest.raises(TypeError, match="field names are str"):
        rl.Instance({1: 2})
    with pytest.raises(ValueError, match="at least one field"):
        rl.Instance({})


# ------------------------------------------------------- user functions see keys
def test_map_gets_instances_and_may_return_them_tuples_or_dicts(data):
    cols, schema, _ = data
    seen = []

    def by_name(x):
        seen.append(type(x))
        return x._replace(seq=x["seq"] * 2)                  # an Instance back

    got = drain_canon(src(data).map(by_name))
    want = [canon((cols["id"][i], cols["seq"][i] * 2, cols["fixed"][i])) for i in range(N)]
    assert got == want
    assert all(t is type(next(iter(src(data)))) for t in seen)
    as_tuple = drain_canon(src(data).map(lambda x: (x["id"], x["seq"] * 2, x["fixed"])))
    as_dict = drain_canon(src(data).map(lambda x: {**dict(x), "seq": x["seq"] * 2}))
    assert as_tuple == as_dict == want


def test_map_output_keyed_by_other_names_is_matched_by_name(data):
    cols, schema, _ = data
    # inferred: the names are the keys of the returned Instance
    r = src(data).map(lambda x: rl.Instance(n=np.int32(len(x["seq"])), id=x["id"]))
    assert r.element_spec.names == ("n", "id")
    first = next(iter(r))
    assert first.keys() == ("n", "id") and int(first["id"]) == 0
    # declared in another order: matched by name, not by position
    out = rl.Schema([rl.Field("id", "int64"), rl.Field("n", "int32")])
    r2 = src(data).map(lambda x: rl.Instance(n=np.int32(len(x["seq"])), id=x["id"]), output_schema=out)
    got = [(int(a["id"]), int(a["n"])) for a in r2]
    assert got == [(i, len(cols["seq"][i])) for i in range(N)]
    bad = src(data).map(lambda x: rl.Instance(m=x["id"]), output_schema=out)
    with pytest.raises(ValueError, match=r"missing \['id', 'n'\], unknown \['m'\]"):
        next(iter(bad))


def test_map_identity_on_keyed_instances_takes_the_positional_path(data):
    # the Instance of the input names is read by position, without a copy of
    # its values, and the input arrays are still refilled in place (fixed schema)
    cols, schema, want = make_columns(50, lod=False, seed=1)
    r = array_reader(cols, schema).map(lambda x: x)
    assert drain_canon(r) == want
    assert r.reused > 0


def test_map_batches_gets_batches_and_returning_them_is_free(data):
    seen = []

    def same(b):
        seen.append(b.keys())
        return b

    base = src(data).batch(4)
    r = src(data).batch(4).map_batches(same)
    for a, b in zip(base, r):
        assert a == b and type(a) is type(b)
    assert seen and all(k == ("id", "seq", "fixed") for k in seen)
    # read through a compiled reader after it: the block is handed on (no copy, same memory)
    r2 = src(data).batch(4).map_batches(same).prefetch(2)
    assert [canon(x) for b in r2 for x in zip(*(t.data for t in b[::2]))]
    # a replaced field by name, and a dict
    r3 = src(data).batch(4).map_batches(lambda b: b._replace(fixed=b["fixed"].data * 0))
    r4 = src(data).batch(4).map_batches(lambda b: {**dict(b), "fixed": b["fixed"].data * 0})
    for a, b in zip(r3, r4):
        assert a == b and not a["fixed"].data.any()


def test_map_batches_unchanged_check_respects_names(data):
    # a Batch holding the input tensors under other names is not "unchanged":
    # with a declared output schema of the input's names it is matched by name
    schema = data[1]
    r = src(data).batch(4).map_batches(lambda b: rl.Batch(fixed=b[2], id=b[0], seq=b[1]),
                                       output_schema=schema)
    for a, b in zip(src(data).batch(4), r):
        assert a == b


def test_filter_gets_keyed_items(data):
    got = [int(x["id"]) for x in src(data).filter(lambda x: len(x["seq"]) > 2)]
    assert got == [i for i in range(N) if len(data[0]["seq"][i]) > 2]
    got_b = [len(b["id"]) for b in src(data).batch(5).filter(lambda b: "seq" in b and len(b["id"]) == 5)]
    assert got_b == [5] * (N // 5)


def test_padded_and_bucketed_batches_name_their_length_fields(data):
    cols = data[0]
    for r in (src(data).padded_batch(6), src(data).bucket_by_length([3], [5, 5])):
        ids = []
        for b in r:
            assert b.keys() == ("id", "seq", "fixed", "seq_length") == r.element_spec.names
            assert b["seq"].data.ndim == 3 and b["seq"].data.shape[0] == len(b["seq_length"].data)
            for k, n in zip(b["id"].data, b["seq_length"].data):
                assert n == len(cols["seq"][int(k)])
            ids.extend(int(k) for k in b["id"].data)
        assert sorted(ids) == list(range(N))


# --------------------------------------------- exactly once, threads, checkpoints
def keyed_fn(x):
    return {"id": x["id"], "seq": x["seq"] + 1, "len": np.int64(len(x["seq"]))}


@pytest.mark.parametrize("nt", [1, 2, 3])
def test_keyed_map_exactly_once_and_same_for_any_thread_count(data, nt):
    ref = [canon(x) for x in src(data).map(keyed_fn)]
    r = src(data).shuffle(7, seed=3).map(keyed_fn, num_threads=nt).batch(4)
    got = []
    for b in r:
        assert b.keys() == ("id", "seq", "len")
        got.extend(canon(x) for x in zip(b["id"].data, [b["seq"].sequence(i) for i in range(len(b["id"]))],
                                          b["len"].data))
    assert_exactly_once(got, ref)
    one = src(data).shuffle(7, seed=3).map(keyed_fn, num_threads=1).batch(4)
    this = src(data).shuffle(7, seed=3).map(keyed_fn, num_threads=nt).batch(4)
    for epoch in range(2):                      # the same batches, epoch after epoch
        pairs = list(zip(one, this))
        assert len(pairs) == len(r)
        for a, b in pairs:
            assert a == b


def test_keyed_chain_checkpoint_resume(data):
    assert_checkpoint_equal(lambda: src(data).shuffle(6, seed=2).map(keyed_fn, num_threads=2)
                            .filter(lambda x: x["len"] != 3).batch(4)
                            .map_batches(lambda b: b._replace(len=b["len"].data * 2)))
    assert_checkpoint_equal(lambda: src(data).map(keyed_fn).padded_batch(5))


def test_errors_in_keyed_functions_name_the_position(data):
    def boom(x):
        if int(x["id"]) == 3:
            return {"id": x["id"]}                           # missing fields
        return keyed_fn(x)

    r = src(data).map(boom, output_schema=src(data).map(keyed_fn).element_spec)
    got = []
    with pytest.raises(ValueError, match=r"missing \['seq', 'len'\]") as e:
        for x in r:
            got.append(int(x["id"]))
    assert "instance 3 of this epoch's input to MapReader" in "".join(getattr(e.value, "__notes__", []))
    assert got == [0, 1, 2]
    rest = []
    while (x := r.read_next()) is not None:                     # reading on: the rest, once
        rest.append(int(x["id"]))
    assert rest == list(range(4, N))


# ----------------------------------------------------------------- integrations
def test_torch_collate_and_convert_keep_the_keys(data):
    torch = pytest.importorskip("torch")
    from torch.utils.data import default_collate, default_convert
    from readerlib.integrations.torch import to_torch
    cols, schema, _ = data
    fixed = array_reader({"id": cols["id"], "fixed": cols["fixed"]},
                         rl.Schema([schema["id"], schema["fixed"]]))
    insts = list(fixed)[:4]
    c = default_collate(insts)                                  # a namedtuple to torch: keys kept
    assert type(c) is type(insts[0]) and c.keys() == ("id", "fixed")
    assert torch.equal(c["id"], torch.arange(4)) and c["fixed"].shape == (4, 2)
    v = default_convert(insts[0])
    assert type(v) is type(insts[0]) and isinstance(v["fixed"], torch.Tensor)
    b = next(iter(src(data).batch(4)))
    t = to_torch(b)
    assert type(t) is type(b) and t.keys() == b.keys()
    assert torch.equal(t["id"], torch.arange(4)) and torch.equal(t["seq"].lod[0], torch.from_numpy(b[1].lod[0]))
    ids, seq, fixed_t = t                                         # still unpacks
    assert ids is t["id"]


def test_jax_keeps_the_keys(data):
    jax = pytest.importorskip("jax")
    from readerlib.integrations.jax import to_jax
    b = next(iter(src(data).batch(4)))
    j = to_jax(b)
    assert type(j) is type(b) and j.keys() == b.keys()
    leaves, tree = jax.tree_util.tree_flatten(j)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert type(back) is type(b) and back.keys() == b.keys()


def test_ray_iter_lod_batches_yields_keyed_batches(data):
    pytest.importorskip("ray")
    pytest.importorskip("pyarrow")
    from readerlib.integrations import ray as rlray
    cols, schema, _ = data
    batches = list(src(data).batch(8))

    class Source:                          # what iter_lod_batches reads: iter_batches(pyarrow)
        def iter_batches(self, batch_size, batch_format, drop_last):
            assert batch_format == "pyarrow"
            for b in batches:
                yield rlray.batch_to_arrow(b, schema)

    got = list(rlray.iter_lod_batches(Source(), 8, schema=schema))
    assert len(got) == len(batches)
    for a, b in zip(got, batches):
        assert isinstance(a, rl.Batch) and a.keys() == schema.names
        assert np.array_equal(a["id"].data, b["id"].data)
        assert np.array_equal(a["seq"].lod[0], b["seq"].lod[0]) and np.array_equal(a["seq"].data, b["seq"].data)


def test_graph_read_op_over_keyed_items(data, tmp_path):
    # the ReadOp hands out one tensor per field: the same values, field by field
    import readerlib.graph as rg
    cols, schema, _ = data
    path = write_recordio(str(tmp_path / "g.rio"), cols, schema)
    for batched in (False, True):
        g = rg.Graph()
        with g.as_default():
            r = rg.create_recordio_reader(path)
            if batched:
                r = rg.create_batch_reader(r, 4)
            fields = rg.read(r)
        eager = rl.RecordIOReader(path).batch(4) if batched else rl.RecordIOReader(path)
        with rg.Session(graph=g) as sess:
            for want in eager:
                got = sess.run(fields)
                for name, value in zip(schema.names, got):
                    w = want[name]
                    if batched:
                        assert np.array_equal(getattr(value, "data", value), w.data)
                    else:
                        assert np.array_equal(value, w)
        eager.close()


def test_sources_and_writers_take_keyed_instances_by_name(tmp_path):
    # an Instance of the schema's names by position; one of other names by name, as a dict
    schema = rl.Schema([rl.Field("feats", "float32", (2,), lod_level=1), rl.Field("label", "int64")])
    f = np.arange(6, dtype=np.float32).reshape(3, 2)
    items = [rl.Instance(label=np.int64(7), feats=f),             # other order: by name
             rl.Instance(feats=f, label=np.int64(8))]             # the schema's names
    got = [(x["feats"].tolist(), int(x["label"])) for x in rl.PythonReader(lambda: iter(items), schema)]
    assert got == [(f.tolist(), 7), (f.tolist(), 8)]
    path = str(tmp_path / "w.rio")
    with rl.RecordIOWriter(path, schema) as w:
        for x in items:
            w.write(x)
    assert [int(x["label"]) for x in rl.RecordIOReader(path)] == [7, 8]
    with pytest.raises(ValueError, match=r"missing \['label'\], unknown \['lbl'\]"):
        next(iter(rl.PythonReader(lambda: iter([rl.Instance(feats=f, lbl=1)]), schema)))
