"""The GPU launchers (readerlib/kernels/_gpu.py) run end to end on a NumPy stand-in for CuPy.

No GPU needed: every RawKernel launch is checked against the kernel's real
parameter list (count, pointer/scalar, scalar width, dtype and alignment behind
each pointer) and launch shape, then emulated in NumPy (tests/support/fake_cupy.py).
This pins the Python half of the GPU path -- word-size choice, views into
workspaces, status words, error messages, output sizes -- against the NumPy
reference.  The CUDA code itself is tested by tests/gpu/test_gpu_kernels.py on a GPU.
"""
import threading

import numpy as np
import pytest

import fake_cupy as fc
import kernel_reference as ref
from helpers import random_array
from readerlib import gpu as rl_gpu
from readerlib.kernels import _cuda_loader, _gpu

pytestmark = pytest.mark.skipif(fc.preprocessor() is None, reason="needs the C preprocessor (cpp)")

GRAD_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]


@pytest.fixture(scope="module")
def signatures():
    return {name: fc.kernel_signatures(_cuda_loader.read_source(name))
            for name in _cuda_loader.cuda_sources()}


@pytest.fixture
def cp(monkeypatch, signatures):
    mod = fc.make_module()
    mod.launches = []
    monkeypatch.setattr(rl_gpu, "_cupy", mod)
    monkeypatch.setattr(_gpu, "get_kernel", fc.make_get_kernel(signatures, mod.launches))
    monkeypatch.setattr(_gpu, "_sm_counts", {})
    monkeypatch.setattr(_gpu, "_local", threading.local())   # no real pinned buffers/events
    return mod


def host(a):
    return np.asarray(a).view(np.ndarray)


def assert_bitwise(got, want):
    got, want = host(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert np.array_equal(np.ascontiguousarray(got).view(np.uint8),
                          np.ascontiguousarray(want).view(np.uint8)), (got, want)


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

def test_caffe_case(cp):
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
def test_batch_reindex_picks_the_widest_aligned_word(cp, offset, word):
    rng = np.random.default_rng(1)
    x = misaligned(rng.integers(0, 255, size=(6, 32), dtype=np.uint8), offset)
    idx = np.array([5, 0, 3], dtype=np.int64)
    assert_bitwise(_gpu.batch_reindex(cp.ascontiguousarray(x), cp.asarray(idx)), x[idx])
    copies = [name for name, _, _ in cp.launches if name.startswith("batch_reindex_w")]
    assert copies == [f"batch_reindex_w{word}_int64"]


def test_batch_reindex_long_rows_use_column_tiles(cp):
    x = np.arange(3 * 40000, dtype=np.float32).reshape(3, 40000)
    idx = np.array([2, 2, 0, 1], dtype=np.int32)
    assert_bitwise(_gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)), x[idx])
    (name, grid, block), = [l for l in cp.launches if l[0].startswith("batch_reindex_w")]
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
def test_batch_reindex_errors(cp, idx, message):
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
def test_batch_reindex_grad_sort_paths(cp, monkeypatch, n, small, switch):
    monkeypatch.setenv("READERLIB_GPU_SMALL_SORT", switch)
    rng = np.random.default_rng(n)
    dy = rng.standard_normal((n, 2)).astype(np.float32)
    idx = rng.integers(0, 50, size=n)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), 50),
                   ref.batch_reindex_grad(dy, idx, 50))
    used = {name for name, _, _ in cp.launches}
    assert ("reindex_sort_small_int64" in used) == (small and switch == "1")
    assert ("reindex_check_keys_int64" in used) == (not small or switch == "0")


def test_batch_reindex_grad_vector_path_needs_alignment(cp):
    rng = np.random.default_rng(3)
    dy = misaligned(rng.standard_normal((10, 8)).astype(np.float32), 4)
    idx = rng.integers(0, 4, size=10)
    assert_bitwise(_gpu.batch_reindex_grad(cp.ascontiguousarray(dy), cp.asarray(idx), 4),
                   ref.batch_reindex_grad(dy, idx, 4))
    assert [l[0] for l in cp.launches if l[0].startswith("batch_reindex_grad")] == \
        ["batch_reindex_grad_float32"]


def test_batch_reindex_grad_float16_rounds_once(cp):
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

def tf_case(blank_column=3):
    """TensorFlow's ctc_greedy_decoder test: 6 steps, 4 classes, lengths [4, 5]."""
    p0 = [[1, 0, 0, 0], [0, 0, .4, .6], [0, 0, .4, .6], [0, .9, .1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    p1 = [[.1, .9, 0, 0], [0, .9, .1, 0], [0, 0, .1, .9], [0, .9, .1, .1], [.9, .1, 0, 0],
          [0, 0, 0, 0]]
    probs = np.array([p0, p1], dtype=np.float32).transpose(1, 0, 2)   # [time, batch, classes]
    if blank_column != 3:
        probs[..., [blank_column, 3]] = probs[..., [3, blank_column]]
    with np.errstate(divide="ignore"):
        return np.log(probs), np.array([4, 5], np.int32)


def decode(cp, inputs, lengths, merge=True, blank=None):
    (st,), neg = _gpu.ctc_greedy_decoder(cp.asarray(inputs), cp.asarray(lengths), merge, blank)
    return host(st.indices), host(st.values), host(st.dense_shape), host(neg)


def assert_decoded(got, want):
    (gi, gv, gs, gneg), ((wi, wv, ws), wneg) = got, want
    assert_bitwise(gi, wi)
    assert_bitwise(gv, wv)
    assert_bitwise(gs, ws)
    assert gneg.dtype == wneg.dtype and gneg.shape == wneg.shape
    np.testing.assert_allclose(gneg, wneg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blank_column,blank", [(3, None), (3, 3), (2, 2), (2, -2)])
def test_ctc_tensorflow_case(cp, blank_column, blank):
    inputs, lengths = tf_case(blank_column)
    got = decode(cp, inputs, lengths, True, blank)
    assert got[1].tolist() == [0, 1, 1, 1, 0]
    assert got[0].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    assert got[2].tolist() == [2, 3]
    assert_decoded(got, ref.ctc_greedy_decoder(inputs, lengths, True, blank))


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
    assert_decoded(got, ref.ctc_greedy_decoder(inputs, lengths, merge, 0))


def test_ctc_nan_and_inf_rows(cp):
    nan, inf = np.nan, np.inf
    rows = [[nan, 5, 6], [1, nan, 0], [-inf, -inf, -inf], [0, nan, nan], [-0.0, 0.0, -1]]
    inputs = np.array(rows, np.float32)[:, None, :]
    got = decode(cp, inputs, np.array([5], np.int32), False, 2)
    want = ref.ctc_greedy_decoder(inputs, np.array([5]), False, 2)
    assert want[0][1].tolist() == [0, 0, 0, 0, 0]   # NaN at 0 wins; -0.0 ties +0.0 -> first
    assert_decoded(got, want)


def test_ctc_length_above_max_time(cp):
    inputs, _ = tf_case()
    with pytest.raises(ValueError, match=r"sequence_length\(1\) <= 6"):
        decode(cp, inputs, np.array([6, 7], np.int32))


def test_ctc_lod_equals_padded(cp):
    rng = np.random.default_rng(6)
    lengths = np.array([4, 0, 9, 1], np.int64)
    padded = rng.integers(0, 3, size=(9, 4, 5)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = np.concatenate([padded[:lengths[b], b] for b in range(4)])
    (st,), neg = _gpu.ctc_greedy_decoder_lod(cp.asarray(data), cp.asarray(offsets), True, 1)
    got = host(st.indices), host(st.values), host(st.dense_shape), host(neg)
    assert_decoded(got, ref.ctc_greedy_decoder(padded, lengths.astype(np.int32), True, 1))
    assert_decoded(got, ref.ctc_greedy_decoder_lod(data, offsets, True, 1))


def test_ctc_nothing_emitted(cp):
    inputs = np.zeros((3, 2, 4), np.float32)
    inputs[..., 3] = 1.0                              # every frame is blank
    got = decode(cp, inputs, np.array([3, 2], np.int32))
    assert got[0].shape == (0, 2) and got[1].shape == (0,) and got[2].tolist() == [2, 0]
    np.testing.assert_array_equal(got[3], [[-3.0], [-2.0]])


# ---- property tests over shapes -----------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

# The stand-in patched in by the `cp` fixture is stateless between examples.
_property = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), t=st.integers(1, 9), b=st.integers(1, 6),
       v=st.integers(1, 11), merge=st.booleans(), blank_draw=st.integers(0, 10 ** 6))
def test_ctc_property(cp, seed, t, b, v, merge, blank_draw):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(-2, 2, size=(t, b, v)).astype(np.float32)   # ties and repeats
    lengths = rng.integers(0, t + 1, size=b).astype(np.int32)
    blank = blank_draw % (2 * v) - v                                   # in [-v, v)
    got = decode(cp, inputs, lengths, merge, blank)
    assert_decoded(got, ref.ctc_greedy_decoder(inputs, lengths, merge, blank))


@_property
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(0, 40), m=st.integers(1, 12),
       inner=st.sampled_from([(), (1,), (3,), (8,), (2, 4)]),
       dtype=st.sampled_from(["float16", "float32", "int32", "uint8"]))
def test_grad_property(cp, seed, n, m, inner, dtype):
    rng = np.random.default_rng(seed)
    dy = random_array(rng, (n,) + inner, dtype)
    idx = rng.integers(0, m, size=n)
    assert_bitwise(_gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), m),
                   ref.batch_reindex_grad(dy, idx, m))
