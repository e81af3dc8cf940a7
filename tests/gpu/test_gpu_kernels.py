"""CUDA kernels and their launchers against the CPU kernels and the NumPy reference.

Marked ``gpu`` and ``cuda_emu``: on a GPU the bodies run on CuPy; without one, on
tests/support/fake_cupy.py whose launches run the real .cu code on the CPU
emulator (tests/support/cuda_emu) after checking each launch against the
kernel's parameter list.  The second half pins the launchers' choices (word
sizes, grids, sort paths, status words, error messages); the tests that read
the launch log run on the emulator only.

Each test body builds NumPy inputs, runs the CPU reference -- readerlib.kernels'
public functions when they are built, otherwise the NumPy reference of
readerlib/kernels/reference.py -- and the CUDA launcher on the same inputs moved to the
device, and compares: bitwise for reindexed data, backward sums, decoded indices,
values and shapes; within float rounding for neg_sum_logits.
"""
import numpy as np
import pytest

import fake_cupy as fc

from readerlib.kernels import reference as ref
from helpers import random_array
from readerlib.kernels import _cuda_loader, _gpu
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
    """The GPU launcher raises what the CPU path raises for it (readerlib.errors)."""
    from readerlib.errors import FailedPreconditionError, InvalidArgumentError
    inputs, _ = tf_case()
    lengths = np.array([6, 7], np.int32)
    with pytest.raises(FailedPreconditionError, match=r"sequence_length\(1\) <= 6") as gpu_err:
        gpu_ctc(cp, inputs, lengths, True, 3)
    if HAVE_CPU:
        with pytest.raises(FailedPreconditionError) as cpu_err:
            _public.ctc_greedy_decoder(inputs, lengths, blank_index=3)
        assert type(cpu_err.value) is type(gpu_err.value) and str(cpu_err.value) == str(gpu_err.value)
    with pytest.raises(InvalidArgumentError, match="inputs is not a 3-Tensor"):
        gpu_ctc(cp, inputs[0], lengths, True, 3)


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


# ==== the launchers: word sizes, grids, sort paths, status words, messages ============

GRAD_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]


@pytest.fixture(scope="module")
def signatures():
    return {name: fc.kernel_signatures(_cuda_loader.read_source(name))
            for name in _cuda_loader.cuda_sources()}


@pytest.fixture
def launches(cp):
    """The kernels launched so far (the stand-in records them; real CuPy does not)."""
    if not hasattr(cp, "launches"):
        pytest.skip("launch log: only on the CPU emulator's stand-in for CuPy")
    return cp.launches


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a).view(np.ndarray)


def misaligned(a, offset):
    """A copy of ``a`` whose data pointer is ``offset`` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 64 + offset, dtype=np.uint8)
    start = (-buf.__array_interface__["data"][0]) % 64 + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_launchers_ask_only_for_kernels_that_exist(signatures):
    for source, names in _gpu.kernel_names().items():
        assert set(names) == set(signatures[source]), source


# ---- batch_reindex -------------------------------------------------------------------

def test_launcher_caffe_case(cp):
    x = np.arange(120, dtype=np.float32).reshape(5, 4, 3, 2)
    perm = np.array([4, 0, 4, 0, 1, 2], dtype=np.int64)
    y = host(_gpu.batch_reindex(cp.asarray(x), cp.asarray(perm)))
    assert y.shape == (6, 4, 3, 2)
    flat = x.reshape(-1)
    for n in range(6):
        for inner in range(24):
            assert y.reshape(6, 24)[n, inner] == flat[perm[n] * 24 + inner]


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64", "uint8"])
@pytest.mark.parametrize("inner", [(), (1,), (3,), (4,), (2, 8), (5, 7)])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_batch_reindex_matches_reference(cp, dtype, inner, index_dtype):
    rng = np.random.default_rng(0)
    x = random_array(rng, (9,) + inner, dtype)
    idx = rng.integers(0, 9, size=13).astype(index_dtype)
    assert_bitwise(_gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)), ref.batch_reindex(x, idx))


@pytest.mark.parametrize("offset,word", [(0, 16), (8, 8), (4, 4), (2, 2), (1, 1)])
def test_batch_reindex_picks_the_widest_aligned_word(cp, launches, offset, word):
    rng = np.random.default_rng(1)
    x = misaligned(rng.integers(0, 255, size=(6, 32), dtype=np.uint8), offset)
    idx = np.array([5, 0, 3], dtype=np.int64)
    assert_bitwise(_gpu.batch_reindex(cp.ascontiguousarray(x), cp.asarray(idx)), x[idx])
    copies = [name for name, _, _ in launches if name.startswith("batch_reindex_w")]
    assert copies == [f"batch_reindex_w{word}_int64"]


def test_batch_reindex_long_rows_use_column_tiles(cp, launches):
    x = np.arange(3 * 40000, dtype=np.float32).reshape(3, 40000)
    idx = np.array([2, 2, 0, 1], dtype=np.int32)
    assert_bitwise(_gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)), x[idx])
    (name, grid, block), = [l for l in launches if l[0].startswith("batch_reindex_w")]
    assert block == (256, 1) and grid == (4, 10)   # 10000 words / (256 * 4) -> 10 tiles


def test_batch_reindex_empty(cp):
    x = np.ones((4, 3), np.float32)
    y = _gpu.batch_reindex(cp.asarray(x), cp.asarray(np.zeros(0, np.int64)))
    assert host(y).shape == (0, 3)
    y = _gpu.batch_reindex(cp.asarray(np.ones((4, 0))), cp.asarray(np.array([1, 3])))
    assert host(y).shape == (2, 0)


@pytest.mark.parametrize("idx,message", [
    ([0, -1, 1], ref.NEGATIVE_INDEX_MESSAGE),
    ([0, 3, 1], ref.INDEX_TOO_LARGE_MESSAGE),
    ([0, 7, -1], ref.INDEX_TOO_LARGE_MESSAGE),   # the first bad index decides
    ([-5, 7, 0], ref.NEGATIVE_INDEX_MESSAGE),
])
def test_launcher_batch_reindex_errors(cp, idx, message):
    x = np.zeros((3, 2), np.float32)
    with pytest.raises(IndexError, match=message) as e:
        ref.batch_reindex(x, np.array(idx))
    assert str(e.value) == message
    with pytest.raises(IndexError) as e:
        _gpu.batch_reindex(cp.asarray(x), cp.asarray(np.array(idx, np.int64)))
    assert str(e.value) == message


def test_batch_reindex_rejects_float_indices(cp):
    with pytest.raises(TypeError):
        _gpu.batch_reindex(cp.asarray(np.zeros((3, 2))), cp.asarray(np.zeros(2)))


# ---- batch_reindex_grad --------------------------------------------------------------

@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("inner", [(), (3,), (16,), (4, 8)])
def test_batch_reindex_grad_matches_reference(cp, dtype, inner):
    rng = np.random.default_rng(2)
    dy = random_array(rng, (40,) + inner, dtype)
    idx = rng.integers(0, 7, size=40)
    got = _gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 9)   # rows 7, 8 unused
    assert_bitwise(got, ref.batch_reindex_grad(dy, idx, 9))
    assert not host(got)[7:].any()


@pytest.mark.parametrize("n", [1, 2, 3, 1000])
def test_batch_reindex_grad_key_packing(cp, n):
    rng = np.random.default_rng(n)
    dy = rng.standard_normal((n, 4)).astype(np.float32)
    idx = rng.integers(0, 5, size=n).astype(np.int32)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 5),
                   ref.batch_reindex_grad(dy, idx, 5))


@pytest.mark.parametrize("n,small", [(1, True), (4096, True), (4097, False)])
@pytest.mark.parametrize("switch", ["1", "0"])
def test_batch_reindex_grad_sort_paths(cp, launches, monkeypatch, n, small, switch):
    monkeypatch.setenv("READERLIB_GPU_SMALL_SORT", switch)
    rng = np.random.default_rng(n)
    dy = rng.standard_normal((n, 2)).astype(np.float32)
    idx = rng.integers(0, 50, size=n)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 50),
                   ref.batch_reindex_grad(dy, idx, 50))
    used = {name for name, _, _ in launches}
    assert ("reindex_sort_small_int64" in used) == (small and switch == "1")
    assert ("reindex_check_keys_int64" in used) == (not small or switch == "0")


def test_batch_reindex_grad_vector_path_needs_alignment(cp, launches):
    rng = np.random.default_rng(3)
    dy = misaligned(rng.standard_normal((10, 8)).astype(np.float32), 4)
    idx = rng.integers(0, 4, size=10)
    assert_bitwise(_gpu.batch_reindex_grad(cp.ascontiguousarray(dy), cp.asarray(idx), 4),
                   ref.batch_reindex_grad(dy, idx, 4))
    assert [l[0] for l in launches if l[0].startswith("batch_reindex_grad")] == \
        ["batch_reindex_grad_float32"]


def test_launcher_batch_reindex_grad_float16_rounds_once(cp):
    # 2048 + 1 + 1 in float16 steps is 2048 (each +1 rounds away); in float32 then
    # rounded once it is 2050.
    dy = np.array([[2048], [1], [1]], dtype=np.float16)
    idx = np.array([0, 0, 0])
    got = host(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 1))
    assert got[0, 0] == np.float16(2050)


def test_batch_reindex_grad_negative_zero_sums_from_plus_zero(cp):
    dy = np.array([[-0.0]], dtype=np.float32)
    got = host(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(np.array([0])), 2))
    assert_bitwise(got, np.zeros((2, 1), np.float32))   # +0 + -0 == +0, like np.add.at


def test_batch_reindex_grad_empty_and_errors(cp):
    got = _gpu.batch_reindex_grad(cp.asarray(np.zeros((0, 3), np.float32)),
                                  cp.asarray(np.zeros(0, np.int64)), 4)
    assert_bitwise(got, np.zeros((4, 3), np.float32))
    with pytest.raises(IndexError, match="greater than batch size"):
        _gpu.batch_reindex_grad(cp.asarray(np.ones((2, 3), np.float32)),
                                cp.asarray(np.array([0, 4])), 4)
    with pytest.raises(IndexError, match="negative"):
        _gpu.batch_reindex_grad(cp.asarray(np.ones((2, 3), np.float32)),
                                cp.asarray(np.array([-1, 4])), 4)
    with pytest.raises(IndexError, match="greater than batch size"):
        _gpu.batch_reindex_grad(cp.asarray(np.ones((1, 3), np.float32)),
                                cp.asarray(np.array([0])), 0)


# ---- batch_reindex_lod -----------------------------------------------------------

@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float32", "uint8", "float64"])
def test_batch_reindex_lod_matches_reference(cp, index_dtype, dtype):
    rng = np.random.default_rng(4)
    lengths = np.array([3, 0, 5, 1, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = random_array(rng, (offsets[-1], 3), dtype)
    idx = np.array([2, 2, 0, 1, 4, 3], dtype=index_dtype)
    new_data, new_offsets = _gpu.batch_reindex_lod(cp.asarray(data), cp.asarray(offsets),
                                                   cp.asarray(idx))
    want_data, want_offsets = ref.batch_reindex_lod(data, offsets, idx)
    assert_bitwise(new_data, want_data)
    assert_bitwise(new_offsets, want_offsets)


def test_batch_reindex_lod_errors_and_empty(cp):
    offsets = np.array([0, 2, 3], np.int64)
    data = np.ones((3, 2), np.float32)
    with pytest.raises(IndexError, match="greater than batch size"):
        _gpu.batch_reindex_lod(cp.asarray(data), cp.asarray(offsets), cp.asarray(np.array([2])))
    d, o = _gpu.batch_reindex_lod(cp.asarray(data), cp.asarray(offsets),
                                  cp.asarray(np.zeros(0, np.int64)))
    assert host(d).shape == (0, 2) and host(o).tolist() == [0]


# ---- ctc_greedy_decoder ------------------------------------------------------------

def decode(cp, inputs, lengths, merge=True, blank=None):
    (st,), neg = _gpu.ctc_greedy_decoder(cp.asarray(inputs), cp.asarray(lengths), merge, blank)
    return host(st.indices), host(st.values), host(st.dense_shape), host(neg)


def assert_decoded_ref(got, want):
    (gi, gv, gs, gneg), ((wi, wv, ws), wneg) = got, want
    assert_bitwise(gi, wi)
    assert_bitwise(gv, wv)
    assert_bitwise(gs, ws)
    assert gneg.dtype == wneg.dtype and gneg.shape == wneg.shape
    np.testing.assert_allclose(gneg, wneg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blank_column,blank", [(3, None), (3, 3), (2, 2), (2, -2)])
def test_launcher_ctc_tensorflow_case(cp, blank_column, blank):
    inputs, lengths = tf_case(blank_column)
    got = decode(cp, inputs, lengths, True, blank)
    assert got[1].tolist() == [0, 1, 1, 1, 0]
    assert got[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    assert got[2].tolist() == [2, 3]
    assert_decoded_ref(got, ref.ctc_greedy_decoder(inputs, lengths, True, blank))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("merge", [True, False])
def test_ctc_random_matches_reference(cp, dtype, merge):
    if dtype == "bfloat16" and fc.BFLOAT16 is None:
        pytest.skip("ml_dtypes not installed")
    rng = np.random.default_rng(5)
    dt = fc.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    inputs = rng.integers(0, 4, size=(12, 5, 6)).astype(dt)   # small ints: ties and repeats
    lengths = np.array([12, 0, 7, 1, 12], np.int32)
    got = decode(cp, inputs, lengths, merge, 0)
    assert_decoded_ref(got, ref.ctc_greedy_decoder(inputs, lengths, merge, 0))


def test_ctc_nan_and_inf_rows(cp):
    nan, inf = np.nan, np.inf
    rows = [[nan, 5, 6], [1, nan, 0], [-inf, -inf, -inf], [0, nan, nan], [-0.0, 0.0, -1]]
    inputs = np.array(rows, np.float32)[:, None, :]
    got = decode(cp, inputs, np.array([5], np.int32), False, 2)
    want = ref.ctc_greedy_decoder(inputs, np.array([5]), False, 2)
    assert want[0][1].tolist() == [0, 0, 0, 0, 0]   # NaN at 0 wins; -0.0 ties +0.0 -> first
    assert_decoded_ref(got, want)


def test_launcher_ctc_length_above_max_time(cp):
    inputs, _ = tf_case()
    with pytest.raises(ValueError, match=r"sequence_length\(1\) <= 6"):
        decode(cp, inputs, np.array([6, 7], np.int32))


def test_launcher_ctc_lod_equals_padded(cp):
    rng = np.random.default_rng(6)
    lengths = np.array([4, 0, 9, 1], np.int64)
    padded = rng.integers(0, 3, size=(9, 4, 5)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = np.concatenate([padded[:lengths[b], b] for b in range(4)])
    (st,), neg = _gpu.ctc_greedy_decoder_lod(cp.asarray(data), cp.asarray(offsets), True, 1)
    got = host(st.indices), host(st.values), host(st.dense_shape), host(neg)
    assert_decoded_ref(got, ref.ctc_greedy_decoder(padded, lengths.astype(np.int32), True, 1))
    assert_decoded_ref(got, ref.ctc_greedy_decoder_lod(data, offsets, True, 1))


def test_ctc_nothing_emitted(cp):
    inputs = np.zeros((3, 2, 4), np.float32)
    inputs[..., 3] = 1.0                              # every frame is blank
    got = decode(cp, inputs, np.array([3, 2], np.int32))
    assert got[0].shape == (0, 2) and got[1].shape == (0,) and got[2].tolist() == [2, 0]
    np.testing.assert_array_equal(got[3], [[-3.0], [-2.0]])


# ---- property tests over shapes -----------------------------------------------------


# The stand-in patched in by the `cp` fixture is stateless between examples.
_property = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), t=st.integers(1, 9), b=st.integers(1, 6),
       v=st.integers(1, 11), merge=st.booleans(), blank_draw=st.integers(0, 10 ** 6))
def test_launcher_ctc_property(cp, seed, t, b, v, merge, blank_draw):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(-2, 2, size=(t, b, v)).astype(np.float32)   # ties and repeats
    lengths = rng.integers(0, t + 1, size=b).astype(np.int32)
    blank = blank_draw % (2 * v) - v                                   # in [-v, v)
    got = decode(cp, inputs, lengths, merge, blank)
    assert_decoded_ref(got, ref.ctc_greedy_decoder(inputs, lengths, merge, blank))


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(0, 40), m=st.integers(1, 12),
       inner=st.sampled_from([(), (1,), (3,), (8,), (2, 4)]),
       dtype=st.sampled_from(["float16", "float32", "int32", "uint8"]))
def test_launcher_grad_property(cp, seed, n, m, inner, dtype):
    rng = np.random.default_rng(seed)
    dy = random_array(rng, (n,) + inner, dtype)
    idx = rng.integers(0, m, size=n)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), m),
                   ref.batch_reindex_grad(dy, idx, m))
