"""batch_reindex / batch_reindex_grad: Caffe's cases, NumPy references, determinism, errors."""
import os
import re
import time

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ISAS, FakeCupyArray, cpu_flags, forced_isa, install_gpu_stub, random_array

from readerlib import _parallel
from readerlib.kernels import _reindex, batch_reindex, batch_reindex_grad
from readerlib.kernels.reference import (batch_reindex_grad_reference,
                                         batch_reindex_lod_reference,
                                         batch_reindex_reference)
from readerlib.tensor import LoDTensor

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
NEG = "Index specified for reindex layer was negative."
BIG = "Index specified for reindex layer was greater than batch size."


def bits(a):
    """Bit pattern view, so float comparisons are bitwise (-0.0 != 0.0, NaN payloads)."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


# -- Caffe's own tests -----------------------------------------------------------

def test_caffe_forward_5x4x3x2():
    # caffe/src/caffe/test/test_batch_reindex_layer.cpp: input 5x4x3x2 = 0..119,
    # permutation {4, 0, 4, 0, 1, 2} -> 6x4x3x2 with top[i] == bottom[perm[n]*24 + inner].
    x = np.arange(120, dtype=np.float32).reshape(5, 4, 3, 2)
    perm = np.array([4, 0, 4, 0, 1, 2])
    y = batch_reindex(x, perm)
    assert y.shape == (6, 4, 3, 2) and y.dtype == np.float32
    inner = 4 * 3 * 2
    flat = y.reshape(-1)
    for i in range(flat.shape[0]):
        n, c = divmod(i, inner)
        assert flat[i] == x.reshape(-1)[perm[n] * inner + c]


def test_caffe_backward_5x4x3x2():
    x_rows = 5
    perm = np.array([4, 0, 4, 0, 1, 2])
    dy = np.arange(6 * 24, dtype=np.float64).reshape(6, 4, 3, 2)
    dx = batch_reindex_grad(dy, perm, x_rows)
    want = np.zeros((5, 4, 3, 2))
    want[4] = dy[0] + dy[2]
    want[0] = dy[1] + dy[3]
    want[1] = dy[4]
    want[2] = dy[5]
    np.testing.assert_array_equal(dx, want)   # row 3 is never referenced: zeros


def test_numerical_gradient():
    # Caffe's GradientChecker in miniature: loss = sum(w * reindex(x, idx)).
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 4, 3, 2))
    idx = np.array([4, 0, 4, 0, 1, 2])
    w = rng.standard_normal((6, 4, 3, 2))

    def loss(xv):
        return float(np.sum(w * batch_reindex(xv, idx)))

    analytic = batch_reindex_grad(w, idx, x.shape[0])
    numeric = np.zeros_like(x)
    eps = 1e-3
    for i in range(x.size):
        xp, xm = x.copy(), x.copy()
        xp.flat[i] += eps
        xm.flat[i] -= eps
        numeric.flat[i] = (loss(xp) - loss(xm)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    assert np.all(analytic[3] == 0)


# -- references on random inputs ---------------------------------------------------

@st.composite
def reindex_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n_src = draw(st.integers(0, 9))
    inner = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    n = draw(st.integers(0, 14)) if n_src else 0
    idx = draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n)) if n_src else []
    idx_dtype = draw(st.sampled_from(["int32", "int64"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = random_array(rng, (n_src,) + inner, dtype)
    return x, np.array(idx, dtype=idx_dtype)


@settings(max_examples=300, deadline=None)
@given(reindex_case(), st.integers(1, 4))
def test_forward_matches_reference(case, threads):
    x, idx = case
    y = batch_reindex(x, idx, num_threads=threads)
    want = batch_reindex_reference(x, idx)
    assert y.shape == want.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(bits(y), bits(want))


@settings(max_examples=300, deadline=None)
@given(reindex_case(), st.integers(1, 4), st.integers(0, 3))
def test_backward_matches_reference(case, threads, extra_rows):
    x, idx = case
    num_rows = x.shape[0] + extra_rows
    rng = np.random.default_rng(len(idx))
    dy = random_array(rng, (len(idx),) + x.shape[1:], x.dtype)
    dx = batch_reindex_grad(dy, idx, num_rows, num_threads=threads)
    want = batch_reindex_grad_reference(dy, idx, num_rows)
    assert dx.shape == want.shape and dx.dtype == dy.dtype
    # same additions in the same order (np.add.at on zeros): bitwise equal
    np.testing.assert_array_equal(bits(dx), bits(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [(), (1,), (3,), (2, 2), (8,), (64,), (4, 64), (264,), (1000,)])
def test_row_sizes(dtype, inner):
    # every copy path: 1/2/4/8-byte words, short rows of 32-byte chunks
    # (e.g. 8 or 64 float32, 4x64 float32 = 1024 bytes), memcpy rows
    rng = np.random.default_rng(1)
    x = random_array(rng, (7,) + inner, dtype)
    idx = rng.integers(0, 7, size=40)
    np.testing.assert_array_equal(bits(batch_reindex(x, idx)), bits(x[idx]))
    dy = random_array(rng, (40,) + inner, dtype)
    np.testing.assert_array_equal(bits(batch_reindex_grad(dy, idx, 9)),
                                  bits(batch_reindex_grad_reference(dy, idx, 9)))


def test_float16_accumulates_in_float32():
    # 2048 + 1 + 1 + ... in float16 sticks at 2048 (spacing 2); float32 accumulation does not.
    dy = np.array([2048] + [1] * 8, dtype=np.float16)[:, None]
    dx = batch_reindex_grad(dy, np.zeros(9, np.int64), 1)
    assert dx.dtype == np.float16 and dx[0, 0] == 2056
    running = np.float16(0)
    for v in dy[:, 0]:
        running = np.float16(running + v)
    assert running == 2048   # what a float16 running sum would have given


def test_integer_sums_wrap():
    dy = np.array([[200], [100]], dtype=np.uint8)
    assert batch_reindex_grad(dy, [0, 0], 1)[0, 0] == 44
    dy = np.array([[2**62], [2**62]], dtype=np.int64)
    assert batch_reindex_grad(dy, [1, 1], 2)[1, 0] == -(2**63)


def test_negative_zero_like_numpy():
    dy = np.array([[-0.0], [-0.0], [3.0]], dtype=np.float32)
    dx = batch_reindex_grad(dy, [0, 0, 1], 2)
    want = np.zeros((2, 1), np.float32)
    np.add.at(want, [0, 0, 1], dy)
    np.testing.assert_array_equal(bits(dx), bits(want))   # 0 + -0 == +0


# -- determinism -----------------------------------------------------------------

def test_backward_bitwise_deterministic_across_threads():
    rng = np.random.default_rng(3)
    n, num_rows, inner = 20000, 64, 33     # ~312 addends per row: order matters in float32
    dy = (rng.standard_normal((n, inner)) * 10.0 ** rng.integers(-6, 6, (n, 1))).astype(np.float32)
    idx = rng.integers(0, num_rows, n)
    ref = batch_reindex_grad(dy, idx, num_rows, num_threads=1)
    np.testing.assert_array_equal(bits(ref), bits(batch_reindex_grad_reference(dy, idx, num_rows)))
    for threads in (2, 3, 4, 7):
        for _ in range(3):
            got = batch_reindex_grad(dy, idx, num_rows, num_threads=threads)
            assert got.tobytes() == ref.tobytes()
    # the order matters at all: a different summation order gives different bits
    perm = rng.permutation(n)
    shuffled = batch_reindex_grad(dy[perm], idx[perm], num_rows)
    assert shuffled.tobytes() != ref.tobytes()


def test_forward_threads_agree():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 17)).astype(np.float32)
    idx = rng.integers(0, 300, 5000)
    for threads in (1, 2, 5):
        np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=threads), x[idx])


# -- arguments ---------------------------------------------------------------------

def test_empty_idx():
    x = np.ones((4, 3, 2), np.float64)
    y = batch_reindex(x, np.array([], np.int64))
    assert y.shape == (0, 3, 2) and y.dtype == np.float64
    y = batch_reindex(x, [])
    assert y.shape == (0, 3, 2)
    dx = batch_reindex_grad(np.ones((0, 3, 2)), np.array([], np.int32), 4)
    assert dx.shape == (4, 3, 2) and not dx.any()
    assert batch_reindex_grad(np.ones((0, 3)), [], 0).shape == (0, 3)


def test_index_types_and_layouts():
    x = np.arange(40, dtype=np.int32).reshape(10, 4)
    for idx in ([3, 1, 3], np.array([3, 1, 3], np.int32), np.array([3, 1, 3], np.uint8),
                np.array([3, 1, 3], np.uint64), np.array([9, 9, 0, 1, 3])[[0, 3, 4]][[2, 1, 2]]):
        np.testing.assert_array_equal(batch_reindex(x, idx), x[np.asarray(idx, np.int64)])
    strided = np.arange(200, dtype=np.float64).reshape(10, 20)[:, ::3]   # not contiguous
    np.testing.assert_array_equal(batch_reindex(strided, [9, 0]), strided[[9, 0]])
    x1 = np.arange(5, dtype=np.uint8)   # rank 1: one-byte rows
    np.testing.assert_array_equal(batch_reindex(x1, [4, 4, 0]), [4, 4, 0])


@pytest.mark.parametrize("bad, msg", [([0, -1, 2], NEG), ([0, 5], BIG), ([7, -3], BIG), ([-3, 7], NEG),
                                      ([0, 9, -1, 2], BIG),
                                      ([2**62], BIG), ([-(2**62)], NEG)])
def test_caffe_index_errors(bad, msg):
    x = np.zeros((5, 2), np.float32)
    with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
        batch_reindex(x, np.array(bad, np.int64))
    with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
        batch_reindex(x, np.array(bad, np.int64), num_threads=1)
    with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
        batch_reindex_grad(np.zeros((len(bad), 2), np.float32), np.array(bad, np.int64), 5)
    if all(-(2**31) <= v < 2**31 for v in bad):
        with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
            batch_reindex(x, np.array(bad, np.int32))


def test_index_errors_with_non_contiguous_inputs():
    x = np.zeros((5, 4), np.float32)[:, ::2]
    with pytest.raises(IndexError, match=re.escape(NEG)):
        batch_reindex(x, [1, -1])
    with pytest.raises(IndexError, match=re.escape(BIG)):
        batch_reindex_grad(x, [0, 1, 2, 3, 9], 6)


def test_index_error_on_empty_batch_and_uint64():
    with pytest.raises(IndexError, match=re.escape(BIG)):
        batch_reindex(np.zeros((0, 3)), [0])
    with pytest.raises(IndexError, match=re.escape(BIG)):
        batch_reindex(np.zeros((3, 3)), np.array([2**64 - 1], np.uint64))


def test_argument_errors():
    x = np.zeros((5, 2), np.float32)
    with pytest.raises(ValueError, match="1-D"):
        batch_reindex(x, np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="integers"):
        batch_reindex(x, np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="integers"):
        batch_reindex(x, np.array([True, False]))
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex(np.zeros((5, 2), np.complex64), [0])
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex(np.zeros((5, 2), np.int16), [0])
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex(np.zeros((5, 2), ">f4"), [0])
    with pytest.raises(ValueError, match="ndim >= 1"):
        batch_reindex(np.float32(1), [0])
    with pytest.raises(ValueError, match="num_threads"):
        batch_reindex(x, [0], num_threads=0)
    with pytest.raises(ValueError, match="must match"):
        batch_reindex_grad(np.zeros((3, 2)), [0, 1], 5)
    with pytest.raises(ValueError, match="num_rows"):
        batch_reindex_grad(np.zeros((2, 2)), [0, 1], -1)
    with pytest.raises(TypeError, match="num_rows"):
        batch_reindex_grad(np.zeros((2, 2)), [0, 1], 5.0)
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex_grad(np.zeros((2, 2), bool), [0, 1], 5)
    with pytest.raises(ValueError, match="1-D"):
        batch_reindex_grad(np.zeros((2, 2)), [[0, 1]], 5)


# -- LoDTensor ---------------------------------------------------------------------

@st.composite
def lod_case(draw):
    n_seq = draw(st.integers(1, 6))
    levels = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    entries = n_seq
    lod = []
    for _ in range(levels):
        lengths = rng.integers(0, 4, entries)
        offs = np.zeros(entries + 1, np.int64)
        np.cumsum(lengths, out=offs[1:])
        lod.append(offs)
        entries = int(offs[-1])
    dtype = draw(st.sampled_from(DTYPES))
    data = random_array(rng, (entries, 3), dtype)
    idx = draw(st.lists(st.integers(0, n_seq - 1), max_size=8))
    return LoDTensor(data, lod), np.array(idx, np.int64)


@settings(max_examples=200, deadline=None)
@given(lod_case())
def test_lod_reindex_matches_reference(case):
    t, idx = case
    got = batch_reindex(t, idx)
    want = batch_reindex_lod_reference(t, idx)
    assert isinstance(got, LoDTensor) and got.lod_level == t.lod_level
    for g, w in zip(got.lod, want.lod):
        np.testing.assert_array_equal(g, w)
    assert got.data.shape == want.data.shape and got.data.dtype == t.data.dtype
    np.testing.assert_array_equal(bits(got.data), bits(want.data))


def test_lod_shuffle_sequences():
    seqs = [np.full((n, 2), n, np.float32) for n in (2, 0, 3, 1)]
    t = LoDTensor.from_sequences(seqs)
    got = batch_reindex(t, [2, 3, 0, 1, 2])
    assert got.lod[0].tolist() == [0, 3, 4, 6, 6, 9]
    assert got.data[:, 0].tolist() == [3, 3, 3, 1, 2, 2, 3, 3, 3]
    with pytest.raises(IndexError, match=re.escape(BIG)):
        batch_reindex(t, [4])
    with pytest.raises(IndexError, match=re.escape(NEG)):
        batch_reindex(t, [-1])
    fixed = LoDTensor(np.arange(6).reshape(3, 2))    # no lod: rows are the instances
    got = batch_reindex(fixed, [2, 2])
    assert got.lod == [] and got.data.tolist() == [[4, 5], [4, 5]]


# -- float16 helpers -----------------------------------------------------------------

def test_half_conversions_match_numpy():
    h = np.arange(2**16, dtype=np.uint16)
    f = _reindex._half_to_float_py(h)
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(f), nan)
    np.testing.assert_array_equal(f[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # float -> half: every half exactly, midpoints between halves, random bit patterns
    back = _reindex._float_to_half_py(np.ascontiguousarray(f[~nan]))
    np.testing.assert_array_equal(back, h[~nan])
    fin = want[np.isfinite(want)].astype(np.float64)
    fin.sort()
    mids = ((fin[1:] + fin[:-1]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for vals in (mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                 rand, np.array([65504, 65519.99, 65520, 1e30, -1e30, 2**-25, 2**-26], np.float32)):
        vals = vals[~np.isnan(vals)]
        got = _reindex._float_to_half_py(np.ascontiguousarray(vals))
        with np.errstate(over="ignore"):   # |v| >= 65520 rounds to inf, as intended
            want16 = vals.astype(np.float16).view(np.uint16)
        np.testing.assert_array_equal(got, want16)
    nan16 = _reindex._float_to_half_py(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(nan16.view(np.float16)).all()


def test_out_buffers():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    idx = np.array([5, 0, 5, 2])
    out = np.full((4, 5), np.nan, np.float32)
    assert batch_reindex(x, idx, out=out) is out
    np.testing.assert_array_equal(out, x[idx])
    dx = np.full((7, 5), np.nan, np.float32)            # every element is overwritten
    assert batch_reindex_grad(out, idx, 7, out=dx) is dx
    np.testing.assert_array_equal(dx, batch_reindex_grad_reference(out, idx, 7))
    with pytest.raises(ValueError, match="shape"):
        batch_reindex(x, idx, out=np.empty((3, 5), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        batch_reindex(x, idx, out=np.empty((4, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        batch_reindex(x, idx, out=np.empty((5, 4), np.float32).T)
    with pytest.raises(ValueError, match="overlap"):
        batch_reindex(x, [0, 1, 2, 3, 4, 5], out=x)
    with pytest.raises(ValueError, match="overlap"):
        batch_reindex_grad(x, [0, 1, 2, 3, 4, 5], 6, out=x)
    with pytest.raises(TypeError, match="LoDTensor"):
        batch_reindex(LoDTensor.from_sequences([x]), [0], out=out)


# -- GPU dispatch contract (runs without a GPU: a stand-in for CuPy and _gpu) ----------

@pytest.fixture
def fake_gpu(monkeypatch):
    return install_gpu_stub(monkeypatch, batch_reindex=lambda *a: "gpu",
                            batch_reindex_grad=lambda *a: "gpu",
                            batch_reindex_lod=lambda *a: (a[0], a[1]))


def test_cupy_input_goes_to_gpu_module(fake_gpu):
    x = np.arange(12, dtype=np.float32).reshape(4, 3).view(FakeCupyArray)
    assert batch_reindex(x, np.array([3, 1], np.int32)) == "gpu"
    name, gx, gidx = fake_gpu[-1]
    assert name == "batch_reindex" and gx is x and gidx.dtype == np.int32
    assert batch_reindex_grad(x, np.array([0, 1, 1, 2], np.uint8), 5) == "gpu"
    name, gdy, gidx, rows = fake_gpu[-1]
    assert name == "batch_reindex_grad" and gdy is x and gidx.dtype == np.int64 and rows == 5
    t = LoDTensor(x, [np.array([0, 1, 4])])
    got = batch_reindex(t, np.array([1, 0], np.int64))
    name, gdata, goffs, gidx = fake_gpu[-1]
    assert name == "batch_reindex_lod" and gdata is x and goffs.tolist() == [0, 1, 4]
    assert isinstance(got, LoDTensor)


def test_cupy_input_shares_argument_validation(fake_gpu):
    x = np.zeros((4, 3), np.float32).view(FakeCupyArray)
    with pytest.raises(ValueError, match="1-D"):
        batch_reindex(x, np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="integers"):
        batch_reindex(x, np.array([0.5]))
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex(x.astype(np.int16).view(FakeCupyArray), [0])
    with pytest.raises(ValueError, match="must match"):
        batch_reindex_grad(x, [0, 1], 4)
    assert fake_gpu == []     # nothing reached the GPU module


def test_backward_large_fresh_output_lazy_zero_path():
    # > LAZY_ZERO_BYTES: dx comes from np.zeros and unreferenced rows are skipped
    from readerlib.kernels import LAZY_ZERO_BYTES
    inner = 1024
    num_rows = LAZY_ZERO_BYTES // (4 * inner) + 100
    rng = np.random.default_rng(9)
    dy = rng.standard_normal((5, inner)).astype(np.float32)
    idx = np.array([num_rows - 1, 7, 7, 0, num_rows - 1])
    for threads in (1, 2):
        dx = batch_reindex_grad(dy, idx, num_rows, num_threads=threads)
        assert dx.nbytes > LAZY_ZERO_BYTES
        np.testing.assert_array_equal(dx[[0, 7, num_rows - 1]],
                                      np.stack([dy[3], dy[1] + dy[2], dy[0] + dy[4]]))
        touched = np.zeros(num_rows, bool)
        touched[idx] = True
        assert not dx[~touched].any()


# -- torch tensors and DLPack producers (issue 14) ---------------------------------

def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 3, 2)).astype(np.float32)
    idx = np.array([5, 0, 0, 2], np.int64)
    y = batch_reindex(torch.from_numpy(x), torch.from_numpy(idx))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), x[idx])
    dx = batch_reindex_grad(torch.from_numpy(x[idx]), torch.from_numpy(idx), 6)
    assert isinstance(dx, torch.Tensor)
    np.testing.assert_array_equal(dx.numpy(), batch_reindex_grad_reference(x[idx], idx, 6))
    # NumPy x with a torch index: the result follows x (NumPy)
    assert isinstance(batch_reindex(x, torch.from_numpy(idx)), np.ndarray)


def test_torch_zero_copy_in_and_out():
    torch = pytest.importorskip("torch")
    from readerlib.kernels import _native
    xt = torch.arange(24, dtype=torch.float64).reshape(8, 3)
    view, _ = _native(xt, "x")
    assert view.ctypes.data == xt.data_ptr()                  # read in place
    out = torch.empty((3, 3), dtype=torch.float64)
    y = batch_reindex(xt, torch.tensor([7, 1, 7]), out=out)
    assert y is out and y.data_ptr() == out.data_ptr()        # written in place
    np.testing.assert_array_equal(out.numpy(), xt.numpy()[[7, 1, 7]])
    y = batch_reindex(xt, [2, 3])
    assert y.data_ptr() == _native(y, "y")[0].ctypes.data     # torch.from_numpy: a view
    dxo = torch.empty((8, 3), dtype=torch.float64)
    assert batch_reindex_grad(y, [1, 1], 8, out=dxo) is dxo
    np.testing.assert_array_equal(dxo.numpy()[1], xt.numpy()[2] + xt.numpy()[3])


def test_torch_bad_arguments_name_the_argument():
    torch = pytest.importorskip("torch")
    x = torch.zeros((4, 2), requires_grad=True)
    with pytest.raises(TypeError, match=r"x requires grad.*x\.detach\(\)"):
        batch_reindex(x, [0])
    with pytest.raises(TypeError, match=r"x has dtype torch.bfloat16.*x\.float\(\)"):
        batch_reindex(torch.zeros((4, 2), dtype=torch.bfloat16), [0])
    with pytest.raises(TypeError, match="idx must hold integers"):
        batch_reindex(torch.zeros((4, 2)), torch.tensor([0.0]))
    with pytest.raises(TypeError, match=r"dy requires grad.*dy\.detach\(\)"):
        batch_reindex_grad(x, [0, 1, 2, 3], 4)
    with pytest.raises(ValueError, match="out must have shape"):
        batch_reindex(torch.zeros((4, 2)), [0], out=torch.zeros((2, 2)))


def test_dlpack_producer_input():
    class Producer:
        __module__ = "otherframework"

        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kwargs):
            return self._a.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    x = np.arange(12, dtype=np.int32).reshape(4, 3)
    y = batch_reindex(Producer(x), Producer(np.array([3, 3, 0])))
    np.testing.assert_array_equal(y, x[[3, 3, 0]])


# -- streaming stores and the output block cache (issue 16) ----------------------

@pytest.fixture
def stream_always():
    old = _reindex._set_stream_min_bytes(0)
    yield
    _reindex._set_stream_min_bytes(old)


@pytest.mark.parametrize("row_bytes", [16, 48, 64, 256, 1040, 8192, 20, 24])
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("threads", [1, 2])
def test_streaming_gather_equals_take(stream_always, row_bytes, idx_dtype, threads):
    rng = np.random.default_rng(row_bytes)
    x = rng.integers(0, 255, (37, row_bytes), dtype=np.uint8)
    idx = rng.integers(0, 37, 101).astype(idx_dtype)
    np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=threads), x[idx])
    out = np.empty(101 * row_bytes + 1, np.uint8)[1:].reshape(101, row_bytes)
    assert out.ctypes.data % 16 != 0                      # misaligned: the cached path
    np.testing.assert_array_equal(batch_reindex(x, idx, out=out, num_threads=threads), x[idx])


def test_big_fresh_outputs_reuse_released_blocks():
    _reindex.release_cached_outputs()
    rows = (_reindex.CACHED_OUTPUT_BYTES // 4096) + 3      # a little over the threshold
    x = np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024)
    idx = np.arange(rows) % 16
    y = batch_reindex(x, idx)
    assert y.flags.c_contiguous and y.flags.writeable and y.ctypes.data % 64 == 0
    np.testing.assert_array_equal(y, x[idx])
    addr = y.ctypes.data
    del y                                                   # its block is kept ...
    assert _reindex.cached_bytes() >= rows * 4096
    y2 = batch_reindex(x[::-1].copy(), idx)                 # ... and reused, fully overwritten
    assert y2.ctypes.data == addr
    np.testing.assert_array_equal(y2, x[::-1][idx])
    view = y2[5:]
    del y2                                                  # a view keeps the block alive
    np.testing.assert_array_equal(view[:2], x[::-1][idx[5:7]])
    del view
    _reindex.release_cached_outputs()
    assert _reindex.cached_bytes() == 0
    # small outputs stay plain NumPy arrays
    assert batch_reindex(x, [0, 1]).base is None


# -- the forward's row loops: every branch, prefetch distances, alignment (issue 16) ---

@pytest.fixture(params=["cached", "stream"])
def store_kind(request):
    old = _reindex._set_stream_min_bytes(0 if request.param == "stream" else 1 << 62)
    yield request.param
    _reindex._set_stream_min_bytes(old)


@pytest.fixture(params=ISAS)
def isa(request):
    """Run with each cached row-loop body the CPU has (others fall back: skipped)."""
    yield from forced_isa(_reindex, request.param)


def test_gather_isa_is_the_widest_the_cpu_has():
    flags = cpu_flags()
    want = ("avx512" if "avx512f" in flags and "avx2" in flags
            else "avx2" if "avx2" in flags else "sse2")
    assert _reindex.isa() == want


def test_every_kernel_probes_the_cpu_alike():
    # one probe (include/rl_isa.h): CTC's argmax had taken AVX-512F alone as
    # its widest level, where reindex asked for AVX2 as well
    from readerlib.kernels import _ctc
    assert _ctc.isa() == _reindex.isa()


# each side of every branch of _gather_range: machine words (1, 2, 4, 8), the
# memcpy loop (12, 20, 40, 1040: not a multiple of 32 / longer than 1 KiB),
# cached moves (32 .. 1024: with AVX-512, 64-byte multiples take the 64-byte
# body, 96 and 160 the AVX2 one, 32 the SSE2 one), streaming (multiples of 16)
ROW_BYTES = [1, 2, 4, 8, 12, 16, 20, 24, 32, 40, 48, 64, 96, 160, 192, 256, 272, 1008, 1024,
             1040, 1056, 4096]


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("prefetch", [0, 1, 16, 500])
def test_gather_loops_bitwise(isa, store_kind, row_bytes, prefetch):
    rng = np.random.default_rng(row_bytes * 7 + prefetch)
    old = _reindex._set_prefetch_rows(prefetch)
    try:
        for n_src, n in [(1, 1), (5, 3), (61, 203)]:
            # source rows at an odd address: the loops load unaligned
            raw = rng.integers(0, 256, n_src * row_bytes + 1, dtype=np.uint8)
            x = raw[1:].reshape(n_src, row_bytes)
            assert x.flags.c_contiguous and x.ctypes.data % 2 == 1
            for idx_dtype in (np.int32, np.int64):
                idx = rng.integers(0, n_src, n).astype(idx_dtype)
                idx[-1] = n_src - 1                  # the last row, read last
                want = x[idx]
                for threads in (1, 2):
                    np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=threads), want)
                    # into outputs at every alignment: 16-byte aligned ones may stream,
                    # others take the cached loops; the bytes around are untouched
                    for shift in (0, 1, 8, 16):
                        buf = np.full(n * row_bytes + 64, 0xA5, np.uint8)
                        base = (-buf.ctypes.data) % 16 + shift
                        out = buf[base:base + n * row_bytes].reshape(n, row_bytes)
                        batch_reindex(x, idx, out=out, num_threads=threads)
                        np.testing.assert_array_equal(out, want)
                        assert np.all(buf[:base] == 0xA5) and np.all(buf[base + n * row_bytes:] == 0xA5)
    finally:
        _reindex._set_prefetch_rows(old)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_gather_loops_float_bits(isa, store_kind, dtype):
    # NaN payloads, -0.0, subnormals go through the row loops as bytes
    rng = np.random.default_rng(3)
    x = random_array(rng, (33, 64), dtype)
    idx = rng.integers(0, 33, 130)
    np.testing.assert_array_equal(bits(batch_reindex(x, idx, num_threads=2)), bits(x[idx]))


@pytest.mark.parametrize("row_bytes", [8, 48, 256, 1040])
@pytest.mark.parametrize("where", [0, 17, -1])
@pytest.mark.parametrize("bad, msg", [(-1, NEG), (61, BIG), (2**40, BIG)])
def test_gather_loops_bad_index_writes_nothing(isa, store_kind, row_bytes, where, bad, msg):
    # a bad index anywhere (also past the prefetch distance, and the last one)
    # raises Caffe's message before any row is written, on every loop
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (61, row_bytes), dtype=np.uint8)
    for idx_dtype in (np.int32, np.int64):
        if idx_dtype is np.int32 and bad > 2**31:
            continue
        idx = rng.integers(0, 61, 64).astype(idx_dtype)
        idx[where] = bad
        out = np.full((64, row_bytes), 7, np.uint8)
        for threads in (1, 2):
            with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
                batch_reindex(x, idx, out=out, num_threads=threads)
            assert np.all(out == 7)
            with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
                batch_reindex(x, idx, num_threads=threads)


@st.composite
def cached_rows_case(draw):
    """Rows the cached loops take (multiples of 32 bytes up to 1 KiB), enough of
    them that the prefetching part and the tail of every chunk both run."""
    row_bytes = 32 * draw(st.integers(1, 32))
    n_src = draw(st.integers(1, 300))
    n = draw(st.integers(1, 700))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, n_src * row_bytes + 1, dtype=np.uint8)
    x = raw[draw(st.integers(0, 1)):][:n_src * row_bytes].reshape(n_src, row_bytes)
    idx = rng.integers(0, n_src, n).astype(draw(st.sampled_from(["int32", "int64"])))
    return x, idx


@pytest.mark.parametrize("isa_name", ["sse2", "avx2", "avx512"])
@settings(max_examples=60, deadline=None)
@given(case=cached_rows_case(), threads=st.integers(1, 3), prefetch=st.integers(0, 40),
       chunk_bytes=st.sampled_from([0, 256, 4096, 256 << 10]), shift=st.integers(0, 63))
def test_cached_loops_match_reference(isa_name, case, threads, prefetch, chunk_bytes, shift):
    # every cached body against the NumPy reference, bitwise, at any output
    # alignment; the output prefetch must leave the bytes around the output alone
    x, idx = case
    got = _reindex._set_isa(isa_name)
    old = (_reindex._set_prefetch_rows(prefetch), _reindex._set_chunk_bytes(chunk_bytes),
           _reindex._set_stream_min_bytes(1 << 62))
    try:
        if got != isa_name:
            pytest.skip(f"CPU lacks {isa_name}")
        n, rb = idx.shape[0], x.shape[1]
        buf = np.full(n * rb + 128, 0x5A, np.uint8)
        base = (-buf.ctypes.data) % 64 + shift
        out = buf[base:base + n * rb].reshape(n, rb)
        batch_reindex(x, idx, out=out, num_threads=threads)
        np.testing.assert_array_equal(out, batch_reindex_reference(x, idx))
        assert np.all(buf[:base] == 0x5A) and np.all(buf[base + n * rb:] == 0x5A)
        np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=threads),
                                      batch_reindex_reference(x, idx))
    finally:
        _reindex._set_isa(None)
        _reindex._set_prefetch_rows(old[0])
        _reindex._set_chunk_bytes(old[1])
        _reindex._set_stream_min_bytes(old[2])


def test_prefetch_setting_is_clamped_and_restored():
    old = _reindex._set_prefetch_rows(-5)                 # negative: no prefetch
    try:
        assert _reindex._set_prefetch_rows(3) == 0
        assert _reindex._set_prefetch_rows(old) == 3
    finally:
        _reindex._set_prefetch_rows(old)
    assert _reindex.PREFETCH_ROWS == old


# -- the compiled fast path (issue 16: small calls) --------------------------------

class _Sub(np.ndarray):
    pass


def test_fast_path_common_cases(monkeypatch):
    calls = []
    real = _reindex.gather_fast

    def spy(*args):
        r = real(*args)
        calls.append(r is not None)
        return r

    monkeypatch.setattr(_reindex, "gather_fast", spy)
    rng = np.random.default_rng(11)
    for dtype in DTYPES:
        for shape in [(7,), (7, 3), (7, 2, 64), (0, 4)]:
            x = random_array(rng, shape, dtype)
            for idx_dtype in (np.int32, np.int64):
                idx = rng.integers(0, max(shape[0], 1), 9 if shape[0] else 0).astype(idx_dtype)
                for nt in (None, 1, 3, 1000):
                    calls.clear()
                    y = batch_reindex(x, idx, num_threads=nt)
                    assert calls == [True]
                    assert y.shape == (len(idx),) + shape[1:] and y.dtype == x.dtype
                    assert y.flags.c_contiguous and y.flags.writeable and y.flags.owndata
                    np.testing.assert_array_equal(bits(y), bits(x[idx]))
                    out = np.empty_like(y)
                    calls.clear()
                    assert batch_reindex(x, idx, out=out, num_threads=nt) is out
                    assert calls == [True]
                    np.testing.assert_array_equal(bits(out), bits(x[idx]))


def test_fast_path_declines_everything_else():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([3, 0, 3])
    out = np.empty((3, 3), np.float32)
    declined = [
        (x.tolist(), idx, None, None), (x, idx.tolist(), None, None),
        (x.view(_Sub), idx, None, None), (x, idx.view(_Sub), None, None),
        (x[:, ::2], idx, None, None), (np.asfortranarray(x), idx, None, None),
        (x.astype(">f4"), idx, None, None), (x.astype(bool), idx, None, None),
        (x.astype(np.uint16), idx, None, None), (np.float32(1), idx, None, None),
        (x, idx.astype(np.uint16), None, None), (x, idx.astype(">i8"), None, None),
        (x, idx.astype(np.float64), None, None), (x, idx.reshape(3, 1), None, None),
        (x, np.stack([idx, idx], 1)[:, 0], None, None),
        (x, idx, np.empty((3, 4), np.float32), None), (x, idx, np.empty((3, 3)), None),
        (x, idx, np.empty((3, 3, 1), np.float32), None), (x, idx, np.empty((3, 6), np.float32)[:, ::2], None),
        (x, idx, out.view(_Sub), None), (x, idx, [[0] * 3] * 3, None),
        (x, idx, x[:3], None),                                   # overlaps x
        (x, idx, out, 0), (x, idx, out, -1), (x, idx, out, True), (x, idx, out, 2.0),
        (x, idx, out, np.int64(2)),
    ]
    ro = out.copy()
    ro.flags.writeable = False
    declined.append((x, idx, ro, None))
    for args in declined:
        assert _reindex.gather_fast(*args) is None, args
    # and the full path still answers them as before
    with pytest.raises(ValueError, match="must not overlap"):
        batch_reindex(x, idx, out=x[:3])
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        batch_reindex(x, idx, out=ro)
    with pytest.raises(ValueError, match="num_threads"):
        batch_reindex(x, idx, num_threads=0)
    with pytest.raises(TypeError, match="not supported"):
        batch_reindex(x.astype(">f4"), idx)
    np.testing.assert_array_equal(batch_reindex(x, idx, num_threads=np.int64(2)), x[idx])
    np.testing.assert_array_equal(batch_reindex(x[:, ::2], idx), x[:, ::2][idx])


def test_fast_path_bad_index_messages():
    x = np.zeros((5, 2), np.float32)
    for bad, msg in [([0, -1, 2], NEG), ([0, 5], BIG), ([7, -3], BIG)]:
        for idx_dtype in (np.int32, np.int64):
            with pytest.raises(IndexError, match=f"^{re.escape(msg)}\n"):
                _reindex.gather_fast(x, np.array(bad, idx_dtype), None, None)


@pytest.mark.parametrize("chunk_bytes", [0, 1, 100, 256, 4096, 1 << 30])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_gather_chunked_claims_cover_every_row(isa, store_kind, chunk_bytes, threads):
    # chunks of one row, of a few rows with a short last chunk, of more rows
    # than there are (the pool's static shares), and none at all
    rng = np.random.default_rng(chunk_bytes + threads)
    old = _reindex._set_chunk_bytes(chunk_bytes)
    try:
        for row_bytes, n in [(256, 1), (256, 37), (48, 1001), (8, 513), (1040, 77)]:
            x = rng.integers(0, 256, (53, row_bytes), dtype=np.uint8)
            idx = rng.integers(0, 53, n).astype(np.int32 if n % 2 else np.int64)
            out = np.full((n, row_bytes), 3, np.uint8)
            batch_reindex(x, idx, out=out, num_threads=threads)
            np.testing.assert_array_equal(out, x[idx])
    finally:
        _reindex._set_chunk_bytes(old)
    assert _reindex._set_chunk_bytes(-1) == old and _reindex._set_chunk_bytes(old) == 0


@pytest.mark.parametrize("bad, k, v", [([0, -1, 2], 1, -1), ([0, 5], 1, 5), ([7, -3], 0, 7),
                                       ([0, 1, 2, 3, 4, -9], 5, -9)])
def test_index_errors_name_the_entry(bad, k, v):
    # the message stays Caffe's; a note names the first bad entry, its value and the range
    note = f"idx[{k}] = {v}; valid indices are 0 <= i < 5 (5 rows), {len(bad)} indices"
    x = np.zeros((5, 2), np.float32)
    calls = [lambda i: batch_reindex(x, i), lambda i: batch_reindex(x, i, num_threads=1),
             lambda i: batch_reindex(x[:, ::2], i),               # the NumPy pre-check
             lambda i: batch_reindex_grad(np.zeros((len(bad), 2), np.float32), i, 5)]
    for dtype in (np.int32, np.int64):
        for call in calls:
            with pytest.raises(IndexError) as ei:
                call(np.array(bad, dtype))
            assert str(ei.value) in (NEG, BIG)
            assert ei.value.__notes__ == [note]
    lod = LoDTensor(np.arange(10, dtype=np.float32), [np.array([0, 2, 4, 6, 8, 10])])
    with pytest.raises(IndexError) as ei:
        batch_reindex(lod, np.array(bad, np.int64))
    assert ei.value.__notes__ == [note]


def test_uint64_index_error_names_the_entry():
    with pytest.raises(IndexError, match=f"^{re.escape(BIG)}\n") as ei:
        batch_reindex(np.zeros((3, 3)), np.array([1, 2**64 - 1], np.uint64))
    assert ei.value.__notes__ == [f"idx[1] = {2**64 - 1}, past int64; 2 indices"]


def test_gpu_index_error_names_the_first_bad_position():
    from readerlib.kernels import _gpu
    # neg / big are `n - first position` (the device reductions' encoding)
    with pytest.raises(IndexError, match=f"^{re.escape(NEG)}\n") as ei:
        _gpu._raise_index_error(10, 10 - 3, 10 - 7)
    assert ei.value.__notes__ == ["idx[3] is the first bad entry of 10 indices"]
    with pytest.raises(IndexError, match=f"^{re.escape(BIG)}\n") as ei:
        _gpu._raise_index_error(10, 0, 10 - 4)
    assert ei.value.__notes__ == ["idx[4] is the first bad entry of 10 indices"]
    _gpu._raise_index_error(10, 0, 0)          # nothing bad: returns


# -- the split's placement (the pool moves late workers off the caller's CPU) -------

@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux affinity")
@pytest.mark.parametrize("placement", [True, False])
@pytest.mark.parametrize("isa_name", ["sse2", "avx512"])
def test_split_placement_keeps_results_and_affinity(placement, isa_name):
    # After its first chunk the caller may narrow a late worker's affinity for a
    # moment (readerlib/_parallel.pyx, "Placement"); afterwards every thread has
    # the mask it had, and the rows are the reference's bytes whichever thread
    # copied them (many small chunks, so both threads take part, and calls
    # separated by idle pauses, after which the worker tends to be woken onto
    # the caller's CPU).
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4096, 64), dtype=np.float32)
    idx = rng.integers(0, 4096, 8192)
    want = batch_reindex_reference(x, idx)
    old = (_parallel._set_placement(placement), _reindex._set_chunk_bytes(4096),
           _reindex._set_tune(False), _reindex._set_isa(isa_name))
    try:
        batch_reindex(x, idx, num_threads=2)            # the pool's workers exist
        masks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
        for k in range(20):
            if k % 4 == 0:
                time.sleep(0.01)
            _parallel._reset_backoff()
            np.testing.assert_array_equal(bits(batch_reindex(x, idx, num_threads=2)), bits(want))
        for t, m in masks.items():
            if os.path.exists(f"/proc/self/task/{t}"):
                assert os.sched_getaffinity(t) == m, t
    finally:
        _parallel._set_placement(old[0])
        _reindex._set_chunk_bytes(old[1])
        _reindex._set_tune(old[2])
        _reindex._set_isa(None)
