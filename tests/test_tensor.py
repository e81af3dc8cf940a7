"""Data model: Field, Schema, LoDTensor, SparseTensor (readerlib/tensor.py)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import readerlib as rl
from readerlib.tensor import SUPPORTED_DTYPES


# ---------------------------------------------------------------- Field
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_field_accepts_every_supported_dtype(dtype):
    f = rl.Field("x", dtype, (2, 3), lod_level=1)
    assert f.dtype == dtype and f.shape == (2, 3) and f.lod_level == 1
    assert f.row_elems == 6
    assert f.row_bytes == 6 * dtype.itemsize


def test_field_defaults_and_shape_forms():
    f = rl.Field("y", "int64")
    assert f.shape == () and f.lod_level == 0 and f.row_elems == 1 and f.row_bytes == 8
    assert rl.Field("v", "float32", 5).shape == (5,)
    assert rl.Field("v", "float32", [2, 3]).shape == (2, 3)
    assert rl.Field("v", "float32", (np.int64(4),)).shape == (4,)
    assert rl.Field("e", "float32", (0,)).row_bytes == 0
    assert rl.Field("l", "<f4").dtype == np.float32


@pytest.mark.parametrize("name", ["", None, 3, b"x"])
def test_field_bad_name(name):
    with pytest.raises(TypeError, match="name"):
        rl.Field(name, "float32")


@pytest.mark.parametrize("dtype", ["object", "complex64", "U5", "datetime64[s]", ">f4", "V8"])
def test_field_unsupported_dtype_names_it(dtype):
    with pytest.raises(TypeError, match="x"):
        rl.Field("x", dtype)


def test_field_not_a_dtype():
    with pytest.raises(TypeError, match="dtype"):
        rl.Field("x", "not-a-dtype-name")


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (1.5,), (True,), ("3",)])
def test_field_bad_shape_values(shape):
    with pytest.raises(ValueError, match="shape"):
        rl.Field("x", "float32", shape)


def test_field_shape_not_iterable():
    with pytest.raises(TypeError, match="shape"):
        rl.Field("x", "float32", 1.5)


@pytest.mark.parametrize("lod", [2, -1, True, 0.5, "1"])
def test_field_bad_lod_level(lod):
    with pytest.raises(ValueError, match="lod_level"):
        rl.Field("x", "float32", (), lod_level=lod)


def test_field_equality_hash_repr():
    a = rl.Field("x", "float32", (3,), lod_level=1)
    b = rl.Field("x", np.float32, [3], 1)
    assert a == b and hash(a) == hash(b)
    assert a != rl.Field("x", "float32", (3,))
    assert a != rl.Field("x", "float64", (3,), lod_level=1)
    assert a != rl.Field("y", "float32", (3,), lod_level=1)
    assert repr(a) == "Field('x', 'float32', (3,), lod_level=1)"
    assert eval(repr(a), {"Field": rl.Field}) == a


# ---------------------------------------------------------------- Schema
def test_schema_basics():
    s = rl.Schema([rl.Field("x", "float32", (3,)), rl.Field("y", "int64")])
    assert s.names == ("x", "y") and len(s) == 2
    assert s["y"].dtype == np.int64 and s[0].name == "x" and s.index("y") == 1
    assert [f.name for f in s] == ["x", "y"]
    assert rl.Schema(s) == s and hash(rl.Schema(s)) == hash(s)
    with pytest.raises(KeyError, match="z"):
        s.index("z")
    with pytest.raises(KeyError, match="z"):
        s["z"]


def test_schema_duplicate_names():
    with pytest.raises(ValueError, match="unique.*'x'"):
        rl.Schema([rl.Field("x", "float32"), rl.Field("y", "int64"), rl.Field("x", "int64")])


def test_schema_empty_and_bad_members():
    with pytest.raises(ValueError, match="at least one"):
        rl.Schema([])
    with pytest.raises(TypeError, match="Field"):
        rl.Schema([("x", "float32")])
    with pytest.raises(TypeError, match="list of Field"):
        rl.Schema(3)


def test_schema_coerce():
    s = rl.Schema.coerce([("x", "float32", (3,), 1), ("y", "int64")])
    assert s == rl.Schema([rl.Field("x", "float32", (3,), 1), rl.Field("y", "int64")])
    assert rl.Schema.coerce(s) is s
    with pytest.raises(TypeError, match="schema is required"):
        rl.Schema.coerce(None)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape,lod", [((), 0), ((3,), 0), ((2, 0, 4), 1), ((), 1)])
def test_schema_json_round_trip(dtype, shape, lod):
    s = rl.Schema([rl.Field("a b/é", dtype, shape, lod), rl.Field("id", "int64")])
    text = s.to_json()
    json.loads(text)                      # valid JSON
    back = rl.Schema.from_json(text)
    assert back == s
    assert [f.dtype for f in back] == [f.dtype for f in s]
    assert back.to_json() == text


def test_schema_from_json_validates():
    bad = json.dumps({"fields": [{"name": "x", "dtype": "object", "shape": [], "lod_level": 0}]})
    with pytest.raises(TypeError):
        rl.Schema.from_json(bad)


# ---------------------------------------------------------------- LoDTensor
def _padded_reference(seqs, pad):
    """Plain-Python to_padded."""
    max_len = max((len(s) for s in seqs), default=0)
    inner = seqs[0].shape[1:] if seqs else ()
    out = np.full((len(seqs), max_len) + inner, pad, dtype=seqs[0].dtype)
    for i, s in enumerate(seqs):
        for t in range(len(s)):
            out[i, t] = s[t]
    return out, np.array([len(s) for s in seqs], np.int64)


def test_lod_tensor_fixed():
    t = rl.LoDTensor(np.arange(6).reshape(3, 2))
    assert t.lod == [] and len(t) == 3 and t.lod_level == 0 and t.shape == (3, 2)
    assert t.sequence(1).tolist() == [2, 3]
    assert t.device == "cpu"
    with pytest.raises(ValueError, match="lod"):
        t.lengths()
    with pytest.raises(ValueError, match="one lod level"):
        t.to_padded()
    t2 = rl.LoDTensor([[1, 2], [3, 4]])
    assert isinstance(t2.data, np.ndarray) and t2.shape == (2, 2)


def test_lod_tensor_scalar_data_rejected():
    with pytest.raises(ValueError, match="at least one dimension"):
        rl.LoDTensor(np.float32(3))


@pytest.mark.parametrize("lod,match", [
    ([[1, 2, 3]], "start at 0"),
    ([[0, 2, 1, 3]], "decreases at index 2"),
    ([[0, 1, 2]], "ends at 2 but there are 3 rows"),
    ([[0, 1, 4]], "ends at 4 but there are 3 rows"),
    ([np.array([], np.int64)], "empty"),
    ([[[0, 3]]], "1-D"),
])
def test_lod_tensor_bad_offsets(lod, match):
    with pytest.raises(ValueError, match=match):
        rl.LoDTensor(np.zeros((3, 2)), lod)


def test_lod_tensor_float_offsets_rejected():
    with pytest.raises(TypeError, match="integers"):
        rl.LoDTensor(np.zeros((3, 2)), [np.array([0.0, 3.0])])


def test_lod_tensor_offsets_are_int64():
    t = rl.LoDTensor(np.zeros((3, 2)), [np.array([0, 1, 3], np.int32)])
    assert t.lod[0].dtype == np.int64 and t.lod[0].tolist() == [0, 1, 3]


def test_lod_tensor_two_levels():
    # 2 paragraphs of (2, 1) sentences; sentences of (1, 2, 3) words
    data = np.arange(6 * 2).reshape(6, 2)
    t = rl.LoDTensor(data, [[0, 2, 3], [0, 1, 3, 6]])
    assert len(t) == 2 and t.lod_level == 2
    assert t.lengths(0).tolist() == [2, 1] and t.lengths(1).tolist() == [1, 2, 3]
    sub = t.sequence(0)
    assert isinstance(sub, rl.LoDTensor)
    assert sub.lod[0].tolist() == [0, 1, 3] and sub.data.tolist() == data[:3].tolist()
    sub1 = t.sequence(1)
    assert sub1.lod[0].tolist() == [0, 3] and sub1.data.tolist() == data[3:].tolist()
    with pytest.raises(ValueError, match="level 0 ends at 2 but there are 3 entries of level 1"):
        rl.LoDTensor(data, [[0, 2], [0, 1, 3, 6]])


def test_lod_tensor_sequence_bounds_and_negative():
    t = rl.LoDTensor.from_sequences([np.ones((2, 3)), np.zeros((1, 3))])
    assert t.lod[0].tolist() == [0, 2, 3] and t.lengths().tolist() == [2, 1]
    assert t.sequence(-1).tolist() == [[0, 0, 0]]
    assert np.shares_memory(t.sequence(0), t.data)
    with pytest.raises(IndexError, match="out of range"):
        t.sequence(2)
    with pytest.raises(IndexError, match="out of range"):
        t.sequence(-3)


seq_lists = st.lists(st.integers(0, 6), min_size=1, max_size=12).flatmap(
    lambda lens: st.tuples(st.just(lens), st.sampled_from([(), (3,), (2, 2)]),
                           st.sampled_from(["float32", "int16", "float64", "bool"])))


@settings(max_examples=60, deadline=None)
@given(seq_lists, st.integers(-5, 5))
def test_from_sequences_lengths_sequence_to_padded(spec, pad):
    lens, inner, dtype = spec
    rng = np.random.default_rng(len(lens))
    seqs = [(rng.standard_normal((k,) + inner) * 10).astype(dtype) for k in lens]
    t = rl.LoDTensor.from_sequences(seqs)
    assert t.dtype == np.dtype(dtype) and t.shape == (sum(lens),) + inner
    assert t.lod[0].dtype == np.int64
    assert t.lod[0].tolist() == [0] + list(np.cumsum(lens))
    assert t.lengths().tolist() == lens and len(t) == len(lens)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(t.sequence(i), s)
    padded, lengths = t.to_padded(pad_value=pad)
    ref, ref_len = _padded_reference(seqs, np.array(pad).astype(dtype))
    assert padded.dtype == ref.dtype and padded.shape == ref.shape
    np.testing.assert_array_equal(padded, ref)
    np.testing.assert_array_equal(lengths, ref_len)
    # the same through an explicit constructor
    t2 = rl.LoDTensor(t.data, [t.lod[0].tolist()])
    np.testing.assert_array_equal(t2.to_padded(pad)[0], ref)


def test_to_padded_all_empty():
    t = rl.LoDTensor(np.zeros((0, 4), np.float32), [[0, 0, 0]])
    padded, lengths = t.to_padded(7)
    assert padded.shape == (2, 0, 4) and lengths.tolist() == [0, 0]


def test_from_sequences_errors():
    with pytest.raises(ValueError, match="at least one"):
        rl.LoDTensor.from_sequences([])
    with pytest.raises(ValueError, match="sequence 1 has inner shape"):
        rl.LoDTensor.from_sequences([np.zeros((2, 3)), np.zeros((2, 4))])
    with pytest.raises(ValueError, match="scalar"):
        rl.LoDTensor.from_sequences([np.zeros((2,)), np.float32(1)])
    t = rl.LoDTensor.from_sequences([[1, 2], [3]], dtype=np.int32)
    assert t.dtype == np.int32 and t.data.tolist() == [1, 2, 3]


def test_array_protocol():
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    t = rl.LoDTensor(data, [[0, 1, 4]])
    a = np.asarray(t)
    assert a.dtype == np.float32 and a.shape == (4, 3)
    np.testing.assert_array_equal(a, data)
    assert np.shares_memory(a, data)                 # no copy
    b = np.asarray(t, dtype=np.float64)
    assert b.dtype == np.float64
    np.testing.assert_array_equal(b, data)
    c = np.array(t, copy=True)
    assert not np.shares_memory(c, data)
    np.testing.assert_array_equal(c, data)


def test_dlpack_to_numpy():
    data = np.arange(12, dtype=np.int32).reshape(4, 3)
    t = rl.LoDTensor(data, [[0, 2, 4]])
    assert t.__dlpack_device__() == data.__dlpack_device__()
    a = np.from_dlpack(t)
    assert a.dtype == np.int32 and a.shape == (4, 3)
    np.testing.assert_array_equal(a, data)
    assert np.shares_memory(a, data)


def test_repr_and_to_cpu():
    t = rl.LoDTensor.from_sequences([np.zeros((k, 2), np.float32) for k in range(8)])
    r = repr(t)
    assert "LoDTensor(shape=(28, 2)" in r and "float32" in r and "..." in r and "cpu" in r
    assert t.to("cpu") is t
    with pytest.raises(ValueError, match="device"):
        t.to("tpu")


# ---------------------------------------------------------------- SparseTensor
def test_sparse_to_dense():
    s = rl.SparseTensor([[0, 1], [2, 0], [1, 3]], [5, 6, 7], [3, 4])
    assert s.indices.dtype == np.int64 and s.dense_shape.dtype == np.int64
    d = s.to_dense()
    ref = np.zeros((3, 4), np.int64)
    ref[0, 1], ref[2, 0], ref[1, 3] = 5, 6, 7
    np.testing.assert_array_equal(d, ref)
    ref[ref == 0] = -1
    np.testing.assert_array_equal(s.to_dense(default_value=-1), ref)
    assert s.device == "cpu" and s.to("cpu") is s
    assert "nnz=3" in repr(s)


def test_sparse_empty():
    s = rl.SparseTensor(np.zeros((0, 2), np.int64), np.zeros(0, np.int64), [2, 3])
    np.testing.assert_array_equal(s.to_dense(), np.zeros((2, 3), np.int64))


@pytest.mark.parametrize("indices,values,shape,match", [
    ([0, 1], [5], [3, 4], "indices must be 2-D"),
    ([[0, 1]], [5, 6], [3, 4], "values must be 1-D with 1 entries"),
    ([[0, 1]], [[5]], [3, 4], "values must be 1-D"),
    ([[0, 1]], [5], [3], "dense_shape must have 2 entries"),
    ([[0, 1]], [5], [[3, 4]], "dense_shape"),
])
def test_sparse_validation(indices, values, shape, match):
    with pytest.raises(ValueError, match=match):
        rl.SparseTensor(indices, values, shape)


def test_sequence_three_levels():
    # 2 documents of (2, 1) paragraphs; paragraphs of (1, 2, 1) sentences; sentences of (1, 1, 2, 1) words
    t = rl.LoDTensor(np.arange(5), [[0, 2, 3], [0, 1, 3, 4], [0, 1, 2, 4, 5]])
    d0 = t.sequence(0)
    assert [l.tolist() for l in d0.lod] == [[0, 1, 3], [0, 1, 2, 4]] and d0.data.tolist() == [0, 1, 2, 3]
    d1 = t.sequence(1)
    assert [l.tolist() for l in d1.lod] == [[0, 1], [0, 1]] and d1.data.tolist() == [4]


def test_array_copy_false_never_copies():
    t = rl.LoDTensor(np.arange(3, dtype=np.int64))
    assert np.shares_memory(np.asarray(t, copy=False), t.data)
    with pytest.raises(ValueError):
        np.asarray(t, dtype=np.float64, copy=False)


@pytest.mark.parametrize("dtype,shape", [("float32", (2**62 + 1, 4)), ("int8", (2**32, 2**32)),
                                         ("float64", (2**31, 2**31, 2)), ("uint8", (2**63,))])
@pytest.mark.parametrize("lod", [0, 1])
def test_field_whose_row_overflows_int64_is_rejected(dtype, shape, lod):
    # it used to wrap: (2**62 + 1, 4) float32 had row_bytes == 16, (2**32, 2**32) had 0
    with pytest.raises(ValueError, match=r"'x'.*more than the 2\*\*63 - 1"):
        rl.Field("x", dtype, shape, lod_level=lod)


def test_field_row_sizes_up_to_int64_are_exact():
    f = rl.Field("x", "int8", (2**31, 2**31))              # 2**62 bytes: fits
    assert f.row_elems == 2**62 and f.row_bytes == 2**62
    assert rl.Field("y", "uint8", (2**63 - 1,)).row_bytes == 2**63 - 1
    assert rl.Field("z", "float32", (0, 2**62)).row_bytes == 0
