"""CUDA kernels against the CPU kernels (marked ``gpu``: skipped without CuPy and a GPU).

Each test body builds NumPy inputs, runs the CPU reference -- readerlib.kernels'
public functions when they are built, otherwise the NumPy reference of
tests/support/kernel_reference.py -- and the CUDA launcher on the same inputs moved to the
device, and compares: bitwise for reindexed data, backward sums, decoded indices,
values and shapes; within float rounding for neg_sum_logits.
"""
import numpy as np
import pytest

import kernel_reference as ref
from helpers import random_array
from readerlib.kernels import _gpu
from readerlib.tensor import LoDTensor

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emu]

try:
    import readerlib.kernels as _public
    HAVE_CPU = all(callable(getattr(_public, f, None))
                   for f in ("batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder"))
except ImportError:  # pragma: no cover
    _public, HAVE_CPU = None, False

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None


@pytest.fixture
def cp(xp_gpu):
    return xp_gpu


# ---- the CPU side ------------------------------------------------------------------

def cpu_reindex(x, idx):
    return _public.batch_reindex(x, idx) if HAVE_CPU else ref.batch_reindex(x, idx)


def cpu_grad(dy, idx, num_rows):
    return _public.batch_reindex_grad(dy, idx, num_rows) if HAVE_CPU else \
        ref.batch_reindex_grad(dy, idx, num_rows)


def cpu_reindex_lod(data, offsets, idx):
    if HAVE_CPU:
        try:
            out = _public.batch_reindex(LoDTensor(data, [offsets]), idx)
        except TypeError:          # the CPU side takes no LoDTensor: use the NumPy reference
            out = None
        if isinstance(out, LoDTensor):
            return out.data, out.lod[0]
    return ref.batch_reindex_lod(data, offsets, idx)


def cpu_ctc(inputs, lengths, merge, blank):
    """-> (indices, values, dense_shape, neg_sum) as NumPy; 16-bit logits widened exactly."""
    if inputs.dtype.itemsize == 2:
        inputs = inputs.astype(np.float32)
    if HAVE_CPU:
        (st,), neg = _public.ctc_greedy_decoder(inputs, lengths, merge_repeated=merge,
                                                blank_index=blank)
        return np.asarray(st.indices), np.asarray(st.values), np.asarray(st.dense_shape), \
            np.asarray(neg)
    (i, v, s), neg = ref.ctc_greedy_decoder(inputs, lengths, merge, blank)
    return i, v, s, neg


def gpu_ctc(cp, inputs, lengths, merge, blank):
    (st,), neg = _gpu.ctc_greedy_decoder(cp.asarray(inputs), cp.asarray(lengths), merge, blank)
    for a in (st.indices, st.values, st.dense_shape, neg):
        assert type(a).__module__.startswith("cupy")
    assert st.indices.dtype == st.values.dtype == st.dense_shape.dtype == np.int64
    return st.indices.get(), st.values.get(), st.dense_shape.get(), neg.get()


# ---- comparisons -------------------------------------------------------------------

def assert_bitwise(got, want):
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        (got.shape, got.dtype, want.shape, want.dtype)
    same = np.ascontiguousarray(got).view(np.uint8) == np.ascontiguousarray(want).view(np.uint8)
    assert same.all(), f"{(~same).sum()} bytes differ"


def assert_decoded(got, want, neg_dtype):
    for g, w in zip(got[:3], want[:3]):
        assert_bitwise(g, np.asarray(w, dtype=np.int64))
    assert got[3].dtype == neg_dtype and got[3].shape == want[3].shape
    scale = np.maximum(1.0, np.abs(np.asarray(want[3], np.float64)))
    tol = 1e-12 if neg_dtype == np.float64 else 1e-5
    np.testing.assert_array_less(np.abs(got[3] - want[3]) / scale, tol * 10, err_msg="neg_sum")


def device_misaligned(cp, a, offset):
    """``a`` on the device at ``offset`` bytes past a 256-byte boundary."""
    buf = cp.zeros(a.nbytes + offset, dtype=np.uint8)
    out = buf[offset:].view(a.dtype).reshape(a.shape)
    out[...] = cp.asarray(a)
    return out


# ---- batch_reindex -----------------------------------------------------------------

def test_caffe_case(cp):
    x = np.arange(120, dtype=np.float32).reshape(5, 4, 3, 2)
    perm = np.array([4, 0, 4, 0, 1, 2])
    y = _gpu.batch_reindex(cp.asarray(x), cp.asarray(perm)).get()
    assert y.shape == (6, 4, 3, 2)
    for n in range(6):
        np.testing.assert_array_equal(y.reshape(6, 24)[n], x.reshape(-1)[perm[n] * 24 + np.arange(24)])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "uint8"])
@pytest.mark.parametrize("inner", [(), (1,), (3,), (4,), (5, 7), (64,), (2048,)])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_batch_reindex(cp, dtype, inner, index_dtype):
    rng = np.random.default_rng(hash((dtype, inner, index_dtype)) % 2 ** 32)
    x = random_array(rng, (37,) + inner, dtype)
    idx = rng.integers(0, 37, size=53).astype(index_dtype)
    assert_bitwise(_gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)), cpu_reindex(x, idx))


@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8, 12])
def test_batch_reindex_misaligned(cp, offset):
    rng = np.random.default_rng(offset)
    x = rng.integers(0, 255, size=(11, 48), dtype=np.uint8)
    idx = rng.integers(0, 11, size=17)
    y = _gpu.batch_reindex(device_misaligned(cp, x, offset), cp.asarray(idx))
    assert_bitwise(y, cpu_reindex(x, idx))


@pytest.mark.parametrize("shape,n", [((200003, 3), 150001), ((3, 300001), 5), ((64, 16), 1)])
def test_batch_reindex_grid_stride(cp, shape, n):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    idx = rng.integers(0, shape[0], size=n)
    assert_bitwise(_gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)), cpu_reindex(x, idx))


@pytest.mark.parametrize("idx,message", [
    ([0, -1, 1], ref.NEGATIVE_INDEX_MESSAGE),
    ([0, 3, 1], ref.INDEX_TOO_LARGE_MESSAGE),
    ([0, 7, -1], ref.INDEX_TOO_LARGE_MESSAGE),
    ([-5, 7, 0], ref.NEGATIVE_INDEX_MESSAGE),
])
def test_batch_reindex_errors(cp, idx, message):
    x = np.zeros((3, 2), np.float32)
    for fn, args in ((_gpu.batch_reindex, (cp.asarray(x), cp.asarray(np.array(idx)))),
                     (_gpu.batch_reindex_grad, (cp.zeros((3, 2), np.float32),
                                                cp.asarray(np.array(idx)), 3))):
        with pytest.raises(IndexError) as e:
            fn(*args)
        assert str(e.value) == message
    with pytest.raises(IndexError) as e:
        cpu_reindex(x, np.array(idx))
    assert str(e.value) == message


# ---- batch_reindex_grad ------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "uint8"])
@pytest.mark.parametrize("inner", [(), (3,), (16,), (4, 8), (2048,)])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_batch_reindex_grad(cp, dtype, inner, index_dtype):
    rng = np.random.default_rng(hash((dtype, inner)) % 2 ** 32)
    dy = random_array(rng, (300,) + inner, dtype)
    idx = rng.integers(0, 40, size=300).astype(index_dtype)     # ~7 contributions per row
    got = _gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 45)
    assert_bitwise(got, cpu_grad(dy, idx, 45))


@pytest.mark.parametrize("n", [1, 2, 4096, 4097])
@pytest.mark.parametrize("switch", ["1", "0"])   # READERLIB_GPU_SMALL_SORT: one-block sort or cupy.sort
def test_batch_reindex_grad_both_sort_paths(cp, monkeypatch, n, switch):
    monkeypatch.setenv("READERLIB_GPU_SMALL_SORT", switch)
    rng = np.random.default_rng(n)
    dy = rng.standard_normal((n, 5)).astype(np.float32)
    idx = rng.integers(0, 300, size=n).astype(np.int32)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 300),
                   cpu_grad(dy, idx, 300))
    idx[n // 2] = 300
    with pytest.raises(IndexError, match="greater than batch size"):
        _gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 300)


def test_batch_reindex_grad_one_hot_row(cp):
    """Every n lands on row 3: one long ascending sum, order visible in the rounding."""
    rng = np.random.default_rng(8)
    dy = (rng.standard_normal((5000, 33)) * 10.0 ** rng.integers(-6, 6, size=(5000, 1))).astype(np.float32)
    idx = np.full(5000, 3)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 5),
                   cpu_grad(dy, idx, 5))


def test_batch_reindex_grad_subnormals_are_not_flushed(cp):
    tiny = np.float32(1e-40)                                 # subnormal
    dy = np.full((4, 8), tiny, dtype=np.float32)
    got = _gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(np.array([0, 0, 1, 1])), 2).get()
    assert (got > 0).all()
    assert_bitwise(got, cpu_grad(dy, np.array([0, 0, 1, 1]), 2))


def test_batch_reindex_grad_float16_rounds_once(cp):
    dy = np.array([[2048], [1], [1]], dtype=np.float16)
    got = _gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(np.zeros(3, np.int64)), 1).get()
    assert got[0, 0] == np.float16(2050)


def test_batch_reindex_grad_is_deterministic(cp):
    rng = np.random.default_rng(9)
    dy = cp.asarray(rng.standard_normal((100000, 64)).astype(np.float32))
    idx = cp.asarray(rng.integers(0, 1000, size=100000))
    first = _gpu.batch_reindex_grad(dy, idx, 1000)
    for _ in range(3):
        assert_bitwise(_gpu.batch_reindex_grad(dy, idx, 1000), first.get())


def test_batch_reindex_grad_numerical_gradient(cp):
    """<dL/dx, v> for L = sum(w * reindex(x)) equals the finite difference."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 5))
    idx = np.array([4, 0, 4, 0, 1, 2])
    w = rng.standard_normal((6, 5))
    dx = _gpu.batch_reindex_grad(cp.asarray(w), cp.asarray(idx), 6).get()
    v = rng.standard_normal(x.shape)
    eps = 1e-6
    loss = lambda xx: float(np.sum(w * _gpu.batch_reindex(cp.asarray(xx), cp.asarray(idx)).get()))
    numeric = (loss(x + eps * v) - loss(x - eps * v)) / (2 * eps)
    assert abs(numeric - float(np.sum(dx * v))) < 1e-6


# ---- batch_reindex_lod -------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "uint8", "float16"])
def test_batch_reindex_lod(cp, dtype):
    rng = np.random.default_rng(11)
    lengths = rng.integers(0, 30, size=50)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = random_array(rng, (int(offsets[-1]), 7), dtype)
    idx = rng.integers(0, 50, size=80)
    got_data, got_offsets = _gpu.batch_reindex_lod(cp.asarray(data), cp.asarray(offsets),
                                                   cp.asarray(idx))
    want_data, want_offsets = cpu_reindex_lod(data, offsets, idx)
    assert_bitwise(got_data, want_data)
    assert_bitwise(got_offsets, want_offsets)


# ---- ctc_greedy_decoder ------------------------------------------------------------

def tf_case(blank_column=3):
    p0 = [[1, 0, 0, 0], [0, 0, .4, .6], [0, 0, .4, .6], [0, .9, .1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    p1 = [[.1, .9, 0, 0], [0, .9, .1, 0], [0, 0, .1, .9], [0, .9, .1, .1], [.9, .1, 0, 0],
          [0, 0, 0, 0]]
    probs = np.array([p0, p1], dtype=np.float32).transpose(1, 0, 2)
    if blank_column != 3:
        probs[..., [blank_column, 3]] = probs[..., [3, blank_column]]
    with np.errstate(divide="ignore"):
        return np.log(probs), np.array([4, 5], np.int32)


@pytest.mark.parametrize("blank_column,blank", [(3, 3), (2, 2), (2, -2)])
def test_ctc_tensorflow_case(cp, blank_column, blank):
    inputs, lengths = tf_case(blank_column)
    got = gpu_ctc(cp, inputs, lengths, True, blank)
    assert got[1].tolist() == [0, 1, 1, 1, 0]
    assert got[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    assert got[2].tolist() == [2, 3]
    assert_decoded(got, cpu_ctc(inputs, lengths, True, blank % 4), np.float32)


def _logits(rng, shape, dtype):
    if dtype == "bfloat16":
        if BFLOAT16 is None:
            pytest.skip("ml_dtypes not installed")
        return rng.integers(-3, 3, size=shape).astype(BFLOAT16)    # exact, with ties
    if dtype == "float16":
        return rng.integers(-3, 3, size=shape).astype(np.float16)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("num_classes", [1, 2, 3, 5, 8, 129, 1025, 5001])
@pytest.mark.parametrize("merge", [True, False])
def test_ctc_random(cp, dtype, num_classes, merge):
    rng = np.random.default_rng(num_classes)
    inputs = _logits(rng, (40, 9, num_classes), dtype)
    lengths = rng.integers(0, 41, size=9).astype(np.int32)
    lengths[0] = 40
    blank = int(rng.integers(0, num_classes))
    got = gpu_ctc(cp, inputs, lengths, merge, blank)
    neg_dtype = np.float64 if dtype == "float64" else np.float32
    assert_decoded(got, cpu_ctc(inputs, lengths, merge, blank), neg_dtype)


def test_ctc_ties_nan_inf_and_subnormals(cp):
    nan, inf = np.nan, np.inf
    rows = [[nan, 5, 6, 0], [1, nan, 0, 1], [-inf, -inf, -inf, -inf], [0, nan, nan, nan],
            [-0.0, 0.0, -1, 0.0], [0, 1e-45, 0, 0], [-1e-45, -0.0, 0, 0], [2, 2, 2, 2],
            [-inf, nan, -inf, -3]]
    inputs = np.array(rows, np.float32)[:, None, :]
    lengths = np.array([len(rows)], np.int32)
    got = gpu_ctc(cp, inputs, lengths, False, 3)
    want = cpu_ctc(inputs, lengths, False, 3)
    # NaN at 0 wins; ties (incl. -0.0 vs +0.0) go to the first index; a subnormal beats 0
    # (with flush-to-zero rows 5 and 6 would decode to 0); the last row's max is blank.
    assert got[1].tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    for g, w in zip(got[:3], want[:3]):
        assert_bitwise(g, np.asarray(w, np.int64))
    np.testing.assert_array_equal(np.isnan(got[3]), np.isnan(want[3]))


def test_ctc_long_and_wide_batches(cp):
    """More utterances than blocks (grid-stride + the last-block scan), odd num_classes."""
    rng = np.random.default_rng(12)
    inputs = rng.standard_normal((7, 6000, 13)).astype(np.float32)
    lengths = rng.integers(0, 8, size=6000).astype(np.int32)
    assert_decoded(gpu_ctc(cp, inputs, lengths, True, 12),
                   cpu_ctc(inputs, lengths, True, 12), np.float32)


def test_ctc_length_above_max_time(cp):
    inputs, _ = tf_case()
    with pytest.raises(ValueError, match=r"sequence_length\(1\) <= 6"):
        gpu_ctc(cp, inputs, np.array([6, 7], np.int32), True, 3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ctc_lod_equals_padded(cp, dtype):
    rng = np.random.default_rng(13)
    lengths = rng.integers(0, 50, size=33)
    padded = _logits(rng, (50, 33, 29), dtype)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = np.concatenate([padded[:lengths[b], b] for b in range(33)])
    (st,), neg = _gpu.ctc_greedy_decoder_lod(cp.asarray(data), cp.asarray(offsets), True, 0)
    got = st.indices.get(), st.values.get(), st.dense_shape.get(), neg.get()
    assert_decoded(got, cpu_ctc(padded, lengths.astype(np.int32), True, 0), np.float32)


def test_ctc_on_a_side_stream(cp):
    inputs, lengths = tf_case()
    with cp.cuda.Stream(non_blocking=True):
        got = gpu_ctc(cp, inputs, lengths, True, 3)
        y = _gpu.batch_reindex(cp.arange(12.0).reshape(4, 3), cp.asarray([3, 1])).get()
    assert got[1].tolist() == [0, 1, 1, 1, 0]
    assert y.tolist() == [[9, 10, 11], [3, 4, 5]]


# ---- property tests --------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_property = settings(max_examples=40, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), t=st.integers(1, 30), b=st.integers(1, 20),
       v=st.integers(1, 70), merge=st.booleans(), dtype=st.sampled_from(["float32", "float64"]))
def test_ctc_property(cp, seed, t, b, v, merge, dtype):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(-2, 2, size=(t, b, v)).astype(dtype)
    lengths = rng.integers(0, t + 1, size=b).astype(np.int32)
    blank = int(rng.integers(0, v))
    assert_decoded(gpu_ctc(cp, inputs, lengths, merge, blank),
                   cpu_ctc(inputs, lengths, merge, blank), np.dtype(dtype))


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(0, 6000), m=st.integers(1, 300),
       inner=st.sampled_from([(), (1,), (3,), (8,), (2, 4), (33,)]),
       dtype=st.sampled_from(["float16", "float32", "float64", "int32", "int64", "uint8"]))
def test_grad_property(cp, seed, n, m, inner, dtype):
    rng = np.random.default_rng(seed)
    dy = random_array(rng, (n,) + inner, dtype)
    idx = rng.integers(0, m, size=n)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), m),
                   cpu_grad(dy, idx, m))


# ---- device data ----------------------------------------------------------------------

def test_lod_tensor_to_device_and_back_and_dlpack(cp):
    t = LoDTensor.from_sequences([np.arange(6, dtype=np.float32).reshape(2, 3),
                                  np.full((1, 3), 7, np.float32)])
    g = t.to("cuda")
    assert g.device == "cuda" and type(g.lod[0]).__module__.startswith("cupy")
    back = g.to("cpu")
    np.testing.assert_array_equal(back.data, t.data)
    np.testing.assert_array_equal(back.lod[0], t.lod[0])
    torch = pytest.importorskip("torch")
    tt = torch.from_dlpack(g)                     # no copy: same device memory
    assert tt.data_ptr() == g.data.data.ptr and tuple(tt.shape) == (3, 3)


# ---- dispatch through the public functions ------------------------------------------

@pytest.mark.skipif(not HAVE_CPU, reason="readerlib.kernels public functions not built")
def test_public_functions_dispatch_cupy_arrays(cp):
    x = cp.arange(12, dtype=cp.float32).reshape(4, 3)
    y = _public.batch_reindex(x, cp.asarray([3, 1]))
    assert type(y).__module__.startswith("cupy")
    dx = _public.batch_reindex_grad(cp.ones((2, 3), cp.float32), cp.asarray([3, 3]), 4)
    assert type(dx).__module__.startswith("cupy") and dx.get()[3].tolist() == [2, 2, 2]
    inputs, lengths = tf_case()
    (st,), neg = _public.ctc_greedy_decoder(cp.asarray(inputs), cp.asarray(lengths))
    assert type(st.values).__module__.startswith("cupy")
    assert st.values.get().tolist() == [0, 1, 1, 1, 0]
