"""ctc_greedy_decoder: TensorFlow's cases and messages, the loop reference, LoD input."""
import re

import numpy as np
import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ISAS, FakeCupyArray, cpu_flags, forced_isa, install_gpu_stub

from readerlib.kernels import (FailedPreconditionError, InvalidArgumentError, _ctc,
                               ctc_greedy_decoder)
from readerlib.kernels.reference import (ctc_greedy_decoder_reference,
                                         ctc_greedy_decoder_vectorized, tf_row_argmax)
from readerlib.tensor import LoDTensor


def decode(*args, **kwargs):
    """(indices, values, dense_shape, neg_sum_logits) as NumPy arrays."""
    (sp,), neg = ctc_greedy_decoder(*args, **kwargs)
    assert sp.indices.dtype == np.int64 and sp.values.dtype == np.int64
    assert sp.dense_shape.dtype == np.int64
    return sp.indices, sp.values, sp.dense_shape, neg


def assert_same(got, want):
    gi, gv, gs, gn = got
    wi, wv, ws, wn = want
    np.testing.assert_array_equal(gi.reshape(-1, 2), wi.reshape(-1, 2))
    np.testing.assert_array_equal(gv, wv)
    np.testing.assert_array_equal(gs, ws)
    assert gn.shape == wn.shape and gn.dtype == wn.dtype
    # bitwise (same accumulation type and order as TF); NaNs only by position,
    # since IEEE leaves the sign of a NaN result unspecified (-m vs. a subtraction)
    nan = np.isnan(gn)
    np.testing.assert_array_equal(nan, np.isnan(wn))
    u = f"u{gn.dtype.itemsize}"
    np.testing.assert_array_equal(gn[~nan].view(u), wn[~nan].view(u))


def tf_case_probs():
    # tensorflow/python/kernel_tests/nn_ops/ctc_decoder_ops_test.py, testCTCGreedyDecoder
    seq_len_0 = 4
    input_prob_matrix_0 = np.asarray(
        [[1.0, 0.0, 0.0, 0.0],    # t=0
         [0.0, 0.0, 0.4, 0.6],    # t=1
         [0.0, 0.0, 0.4, 0.6],    # t=2
         [0.0, 0.9, 0.1, 0.0],    # t=3
         [0.0, 0.0, 0.0, 0.0],    # t=4 (ignored)
         [0.0, 0.0, 0.0, 0.0]],   # t=5 (ignored)
        dtype=np.float32)
    seq_len_1 = 5
    input_prob_matrix_1 = np.asarray(
        [[0.1, 0.9, 0.0, 0.0],    # t=0
         [0.0, 0.9, 0.1, 0.0],    # t=1
         [0.0, 0.0, 0.1, 0.9],    # t=2
         [0.0, 0.9, 0.1, 0.1],    # t=3
         [0.9, 0.1, 0.0, 0.0],    # t=4
         [0.0, 0.0, 0.0, 0.0]],   # t=5 (ignored)
        dtype=np.float32)
    probs = np.stack([input_prob_matrix_0, input_prob_matrix_1], axis=1)   # [6, 2, 4]
    return probs, np.array([seq_len_0, seq_len_1], np.int32)


TF_INDICES = [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
TF_VALUES = [0, 1, 1, 1, 0]
TF_SHAPE = [2, 3]


def tf_log_prob_truth():
    return np.array([np.sum(-np.log([1.0, 0.6, 0.6, 0.9])),
                     np.sum(-np.log([0.9, 0.9, 0.9, 0.9, 0.9]))], np.float32)[:, None]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tf_greedy_case_blank_3(dtype):
    probs, lengths = tf_case_probs()
    with np.errstate(divide="ignore"):
        inputs = np.log(probs).astype(dtype)
    ind, val, shape, neg = decode(inputs, lengths)          # default blank: 4 - 1 = 3
    assert ind.tolist() == TF_INDICES and val.tolist() == TF_VALUES and shape.tolist() == TF_SHAPE
    assert neg.dtype == dtype and neg.shape == (2, 1)
    np.testing.assert_allclose(neg, tf_log_prob_truth(), rtol=1e-6)
    assert_same((ind, val, shape, neg), ctc_greedy_decoder_reference(inputs, lengths))


@pytest.mark.parametrize("blank_index", [2, -2])
def test_tf_greedy_case_blank_moved_to_2(blank_index):
    probs, lengths = tf_case_probs()
    probs = probs[:, :, [0, 1, 3, 2]]            # the blank column is now 2
    with np.errstate(divide="ignore"):
        inputs = np.log(probs)
    ind, val, shape, neg = decode(inputs, lengths, blank_index=blank_index)
    assert ind.tolist() == TF_INDICES and val.tolist() == TF_VALUES and shape.tolist() == TF_SHAPE
    np.testing.assert_allclose(neg, tf_log_prob_truth(), rtol=1e-6)


def test_tf_docstring_example_with_inf():
    inf = np.inf
    logits = np.array([[[0., -inf, -inf], [-2.3, -inf, -0.1]],
                       [[-inf, -0.5, -inf], [-inf, -inf, -0.1]],
                       [[-inf, -inf, -inf], [-0.1, -inf, -2.3]]], np.float32)
    ind, val, shape, neg = decode(logits, np.array([2, 3], np.int32), blank_index=1)
    assert ind.tolist() == [[0, 0], [1, 0], [1, 1]]
    assert val.tolist() == [0, 2, 0]
    assert shape.tolist() == [2, 2]
    np.testing.assert_array_equal(neg.ravel(), np.array([0.5, 0.3], np.float32))


def one_hot_logits(labels, num_classes):
    x = np.full((len(labels), 1, num_classes), -5.0, np.float32)
    for t, c in enumerate(labels):
        x[t, 0, c] = 0.0
    return x


def test_merge_repeated_semantics():
    A, B, blank = 0, 1, 2
    x = one_hot_logits([A, B, B, blank, B, blank, B], 3)
    n = np.array([7], np.int32)
    assert decode(x, n, merge_repeated=True)[1].tolist() == [A, B, B, B]
    assert decode(x, n, merge_repeated=False)[1].tolist() == [A, B, B, B, B]
    x = one_hot_logits([A, A, A, blank, A], 3)
    assert decode(x, np.array([5], np.int32))[1].tolist() == [A, A]
    assert decode(x, np.array([5], np.int32), merge_repeated=False)[1].tolist() == [A, A, A, A]


def test_ties_take_the_first_index():
    x = np.array([[[1.0, 1.0, 0.0]],      # tie 0/1 -> 0
                  [[0.0, 2.0, 2.0]],      # tie 1/blank -> 1 (emitted)
                  [[3.0, 0.0, 3.0]],      # tie 0/blank -> 0
                  [[0.0, 0.0, 0.0]]],     # all equal -> 0 (merged with previous 0)
                 np.float32)
    ind, val, shape, neg = decode(x, np.array([4], np.int32))
    assert val.tolist() == [0, 1, 0]
    assert neg.ravel().tolist() == [-6.0]


def test_nan_follows_tensorflow_rowmax():
    nan = np.nan
    x = np.array([[[nan, 5.0, 1.0]],      # NaN first: TF picks 0 and the sum is NaN
                  [[0.0, nan, 1.0]],      # later NaNs are never the max
                  [[0.0, 1.0, nan]]], np.float32)
    ind, val, shape, neg = decode(x, np.array([3], np.int32), blank_index=0)
    assert val.tolist() == [2, 1]
    assert np.isnan(neg[0, 0])
    ind, val, shape, neg = decode(x[1:], np.array([2], np.int32), blank_index=0)
    assert val.tolist() == [2, 1] and neg[0, 0] == -2.0


def test_all_minus_inf_and_zero_length():
    x = np.full((3, 2, 4), -np.inf, np.float32)
    ind, val, shape, neg = decode(x, np.array([2, 0], np.int32))
    assert val.tolist() == [0] and ind.tolist() == [[0, 0]] and shape.tolist() == [2, 1]
    assert neg[0, 0] == np.inf and neg[1, 0] == 0.0
    # negative lengths decode nothing, as TF's loop does not run
    ind, val, shape, neg = decode(x, np.array([-3, -1], np.int32))
    assert val.size == 0 and ind.shape == (0, 2) and shape.tolist() == [2, 0]
    assert neg.ravel().tolist() == [0.0, 0.0]


# -- the row argmax: every SIMD body, every block boundary -------------------------------

@pytest.fixture(params=ISAS)
def isa(request):
    """Run with each float32 row-argmax body the CPU has (others fall back: skipped)."""
    yield from forced_isa(_ctc, request.param)


def test_import_picks_the_widest_isa_the_cpu_has():
    flags = cpu_flags()
    want = ("avx512" if "avx512f" in flags and "avx2" in flags      # (include/rl_isa.h)
            else "avx2" if "avx2" in flags else "sse2")
    assert _ctc.isa() == want


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 200), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["ties", "nan", "inf", "normal"]))
def test_row_argmax_is_tf_rowmax(isa, n, dtype, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        row = rng.standard_normal(n)
    else:
        row = rng.integers(-2, 3, n).astype(np.float64)
        if kind == "nan":
            row[rng.random(n) < 0.3] = np.nan
        elif kind == "inf":
            row[rng.random(n) < 0.3] = -np.inf
            row[rng.random(n) < 0.1] = np.inf
    row = row.astype(dtype)
    assert _ctc._row_argmax_py(row) == tf_row_argmax(row)[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(128, 5100), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["ties", "nan", "inf", "zeros", "late"]))
def test_long_row_argmax_is_tf_rowmax(isa, n, seed, kind):
    """Rows long enough for the one-pass AVX-512 body (>= 128): ties across lanes
    and unrolled blocks, NaNs, infinities, +-0 and a maximum in the masked tail."""
    rng = np.random.default_rng(seed)
    row = rng.integers(-3, 3, n).astype(np.float32)
    if kind == "nan":
        row[rng.random(n) < 0.3] = np.nan
    elif kind == "inf":
        row[rng.random(n) < 0.2] = -np.inf
        row[rng.random(n) < 0.01] = np.inf
    elif kind == "zeros":
        row = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0))
        row[rng.random(n) < 0.5] = -1
    elif kind == "late":
        row[rng.integers(n - 20, n, 2)] = 7          # the maximum in the last block / tail
    assert _ctc._row_argmax_py(row) == tf_row_argmax(row)[0]


def _structured_rows(n):
    """Rows of length ``n`` that hit every branch of the bodies in rl_argmax.h: the
    maximum (or a tie of two) at each position, so in every unrolled block, single
    vector, masked tail and scalar tail; NaN at 0 and elsewhere; -inf and +inf."""
    for p in range(n):
        row = np.zeros(n)
        row[p] = 1.0
        yield row                                   # a single maximum at p
        row = np.full(n, -np.inf)
        row[p] = -1e30
        yield row                                   # -inf everywhere else
        row = np.arange(n, dtype=np.float64)
        row[p] = np.nan
        yield row                                   # one NaN (at 0 it wins)
        for q in sorted({p + 1, p + 3, n - 1} - {p}):
            if q < n:
                row = np.zeros(n)
                row[[p, q]] = 2.0
                yield row                           # a tie: p wins
                row[q] = np.inf
                yield row                           # +inf after the tie
    yield np.full(n, -np.inf)                       # all -inf: index 0
    yield np.full(n, np.nan)                        # all NaN: index 0
    row = np.full(n, np.nan)
    row[0] = -np.inf
    yield row                                       # NaNs never win after row[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_argmax_every_position_every_isa(isa, dtype):
    """Every length 1..70 (around the 4/8/16-lane vector and 16/32/64-element block
    sizes) and the one-pass threshold (128) and 4 * 64 + 1, exhaustively."""
    for n in list(range(1, 71)) + [127, 128, 129, 257]:
        for row in _structured_rows(n):
            row = row.astype(dtype)
            want = tf_row_argmax(row)[0]
            assert _ctc._row_argmax_py(row) == want, (isa, n, row.tolist())


# -- against the reference on random inputs -------------------------------------------

@st.composite
def ctc_case(draw):
    T = draw(st.integers(1, 9))
    B = draw(st.integers(1, 5))
    V = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    kind = draw(st.sampled_from(["normal", "ties", "special"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        x = rng.standard_normal((T, B, V))
    else:
        x = rng.integers(-2, 2, (T, B, V)).astype(np.float64)   # many ties, repeats, blanks
        if kind == "special":
            x[rng.random(x.shape) < 0.1] = -np.inf
            x[rng.random(x.shape) < 0.05] = np.nan
    lengths = rng.integers(-1, T + 1, B).astype(np.int32)
    blank = draw(st.one_of(st.none(), st.integers(-V, V - 1)))
    merge = draw(st.booleans())
    return x.astype(dtype), lengths, merge, blank


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=ctc_case(), threads=st.integers(1, 4))
def test_matches_reference(isa, case, threads):
    x, lengths, merge, blank = case
    got = decode(x, lengths, merge_repeated=merge, blank_index=blank, num_threads=threads)
    assert_same(got, ctc_greedy_decoder_reference(x, lengths, merge, blank))


@settings(max_examples=150, deadline=None)
@given(ctc_case())
def test_vectorized_peer_matches_reference(case):
    x, lengths, merge, blank = case
    if np.isnan(x).any():
        return   # NumPy's argmax takes NaN as the max; the peer is for NaN-free logits
    got = ctc_greedy_decoder_vectorized(x, lengths, merge, blank)
    want = ctc_greedy_decoder_reference(x, lengths, merge, blank)
    gi, gv, gs, gn = got
    wi, wv, ws, wn = want
    np.testing.assert_array_equal(gi, wi)
    np.testing.assert_array_equal(gv, wv)
    np.testing.assert_array_equal(gs, ws)
    np.testing.assert_array_equal(gn, wn)


def test_threads_agree_on_a_larger_batch():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((50, 9, 37)).astype(np.float32)
    lengths = rng.integers(0, 51, 9).astype(np.int32)
    ref = decode(x, lengths, num_threads=1)
    assert_same(ref, ctc_greedy_decoder_reference(x, lengths))
    for threads in (2, 3, 8):
        assert_same(decode(x, lengths, num_threads=threads), ref)


def test_sequence_length_types_and_layouts():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3, 6)).astype(np.float32)
    want = ctc_greedy_decoder_reference(x, [5, 2, 4])
    for lengths in ([5, 2, 4], np.array([5, 2, 4], np.int64), np.array([5, 2, 4], np.uint8)):
        assert_same(decode(x, lengths), want)
    xf = np.asfortranarray(x)                       # any layout is accepted
    assert_same(decode(xf, [5, 2, 4]), want)


# -- LoDTensor input --------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=6), st.integers(1, 20),
       st.booleans(), st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float64]))
def test_lod_matches_padded(lengths, V, merge, seed, dtype):
    if sum(lengths) == 0:
        lengths = lengths[:-1] + [1]
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(-2, 2, (n, V)).astype(dtype) for n in lengths]
    t = LoDTensor.from_sequences(seqs)
    padded, lens = t.to_padded(pad_value=7)          # [B, T, V]; padding must not matter
    time_major = np.ascontiguousarray(padded.transpose(1, 0, 2))
    got = decode(t, merge_repeated=merge)
    assert_same(got, decode(time_major, lens.astype(np.int32), merge_repeated=merge))
    assert_same(got, ctc_greedy_decoder_reference(time_major, lens, merge))


def test_lod_errors():
    t = LoDTensor.from_sequences([np.zeros((2, 3), np.float32)])
    with pytest.raises(TypeError, match="sequence_length=None"):
        ctc_greedy_decoder(t, [2])
    with pytest.raises(InvalidArgumentError, match=re.escape("blank_index expected to be between -3 and 2 but was 3")):
        ctc_greedy_decoder(t, blank_index=3)
    with pytest.raises(InvalidArgumentError, match="^inputs must not be empty$"):
        ctc_greedy_decoder(LoDTensor(np.zeros((2, 0), np.float32), [np.array([0, 2])]))
    with pytest.raises(InvalidArgumentError, match="^max_time is 0$"):
        ctc_greedy_decoder(LoDTensor(np.zeros((0, 4), np.float32), [np.array([0, 0])]))
    with pytest.raises(InvalidArgumentError, match="2-Tensor"):
        ctc_greedy_decoder(LoDTensor(np.zeros((2, 3, 1), np.float32), [np.array([0, 2])]))
    with pytest.raises(ValueError, match="one lod level"):
        ctc_greedy_decoder(LoDTensor(np.zeros((2, 3), np.float32)))
    with pytest.raises(TypeError, match="float32 or float64"):
        ctc_greedy_decoder(LoDTensor.from_sequences([np.zeros((2, 3), np.int32)]))


# -- TensorFlow's error messages ---------------------------------------------------------

ERRORS = [
    # (inputs shape, sequence_length, kwargs, exception, exact message)
    ((3, 4), [1, 1, 1], {}, InvalidArgumentError, "inputs is not a 3-Tensor"),
    ((3, 0, 4), np.zeros(0, np.int32), {}, InvalidArgumentError, "inputs must not be empty"),
    ((3, 2, 0), [1, 1], {}, InvalidArgumentError, "inputs must not be empty"),
    ((0, 2, 4), [0, 0], {}, InvalidArgumentError, "inputs must not be empty"),
    ((3, 2, 4), [[1, 1]], {}, InvalidArgumentError, "sequence_length is not a vector"),
    ((3, 1, 4), np.int32(1), {}, InvalidArgumentError, "sequence_length is not a vector"),
    ((3, 2, 4), [1, 1, 1], {}, FailedPreconditionError,
     "len(sequence_length) != batch_size.  len(sequence_length):  3 batch_size: 2"),
    ((3, 2, 4), [1, 4], {}, FailedPreconditionError, "sequence_length(1) <= 3"),
    ((3, 2, 4), [1, 1], {"blank_index": 4}, InvalidArgumentError,
     "blank_index expected to be between -4 and 3 but was 4"),
    ((3, 2, 4), [1, 1], {"blank_index": -5}, InvalidArgumentError,
     "blank_index expected to be between -4 and 3 but was -5"),
]


@pytest.mark.parametrize("shape, lengths, kwargs, exc, msg", ERRORS)
def test_tf_error_messages(shape, lengths, kwargs, exc, msg):
    with pytest.raises(exc, match=f"^{re.escape(msg)}$") as info:
        ctc_greedy_decoder(np.zeros(shape, np.float32), lengths, **kwargs)
    assert isinstance(info.value, ValueError)


def test_num_classes_beyond_int32():
    # a zero-stride view: 2**31 classes without the memory (checked before any copy)
    x = np.broadcast_to(np.zeros((1, 1, 1), np.float32), (1, 1, 2**31))
    with pytest.raises(InvalidArgumentError, match="^num_classes cannot exceed max int$"):
        ctc_greedy_decoder(x, [1])


def test_type_errors():
    x = np.zeros((3, 2, 4), np.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        ctc_greedy_decoder(x.astype(np.float16), [1, 1])
    with pytest.raises(TypeError, match="float32 or float64"):
        ctc_greedy_decoder(x.astype(np.int32), [1, 1])
    with pytest.raises(TypeError, match="integers"):
        ctc_greedy_decoder(x, np.array([1.0, 1.0]))
    with pytest.raises(TypeError, match="required"):
        ctc_greedy_decoder(x)
    with pytest.raises(TypeError, match="blank_index"):
        ctc_greedy_decoder(x, [1, 1], blank_index=1.0)


# -- TensorFlow itself, when installed -----------------------------------------------------

@pytest.fixture(scope="module")
def tf():
    tf = pytest.importorskip("tensorflow")
    tf.config.set_visible_devices([], "GPU")
    return tf


@settings(max_examples=60, deadline=None)
@given(ctc_case())
def test_bitwise_equal_to_tensorflow(tf, case):
    x, lengths, merge, blank = case
    # tf.constant: TF 2.21 eager sometimes runs a raw float64 NumPy array as
    # float32 (seen with shape (1, 1, 1)); a tensor keeps its dtype.
    (sp,), neg = tf.nn.ctc_greedy_decoder(tf.constant(x), lengths, merge_repeated=merge,
                                          blank_index=blank)
    want = (sp.indices.numpy(), sp.values.numpy(), sp.dense_shape.numpy(), neg.numpy())
    assert_same(decode(x, lengths, merge_repeated=merge, blank_index=blank), want)


@pytest.mark.parametrize("shape, lengths, kwargs, exc, msg", ERRORS)
def test_messages_are_tensorflows(tf, shape, lengths, kwargs, exc, msg):
    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.FailedPreconditionError)) as info:
        tf.nn.ctc_greedy_decoder(np.zeros(shape, np.float32), lengths, **kwargs)
    assert msg in info.value.message
    tf_kind = type(info.value).__name__
    assert tf_kind == exc.__name__


# -- GPU dispatch contract (runs without a GPU: a stand-in for CuPy and _gpu) ----------

@pytest.fixture
def fake_gpu(monkeypatch):
    return install_gpu_stub(monkeypatch, ctc_greedy_decoder=lambda *a: "gpu",
                            ctc_greedy_decoder_lod=lambda *a: "gpu")


def test_cupy_input_goes_to_gpu_module(fake_gpu):
    x = np.zeros((3, 2, 5), np.float32).view(FakeCupyArray)
    lengths = np.array([3, 1], np.int32).view(FakeCupyArray)
    assert ctc_greedy_decoder(x, lengths, merge_repeated=0, blank_index=-2) == "gpu"
    name, gx, glen, merge, blank = fake_gpu[-1]
    # blank_index arrives resolved to [0, num_classes); merge as a bool
    assert name == "ctc_greedy_decoder" and gx is x and glen is lengths and merge is False and blank == 3
    ctc_greedy_decoder(x, lengths)
    assert fake_gpu[-1][3:] == (True, 4)
    data = np.zeros((4, 5), np.float64).view(FakeCupyArray)
    t = LoDTensor(data, [np.array([0, 3, 4])])
    assert ctc_greedy_decoder(t, blank_index=0) == "gpu"
    name, gdata, goffs, merge, blank = fake_gpu[-1]
    assert name == "ctc_greedy_decoder_lod" and gdata is data and goffs.tolist() == [0, 3, 4] and blank == 0


@pytest.mark.parametrize("shape, lengths, kwargs, exc, msg",
                         [e for e in ERRORS if "sequence_length(1) <= 3" not in e[4]])
def test_cupy_input_shares_shape_validation(fake_gpu, shape, lengths, kwargs, exc, msg):
    # everything but the data-dependent length check is raised before dispatch
    x = np.zeros(shape, np.float32).view(FakeCupyArray)
    with pytest.raises(exc, match=f"^{re.escape(msg)}$"):
        ctc_greedy_decoder(x, lengths, **kwargs)
    assert fake_gpu == []


# -- fast path, time_major=False, torch / DLPack input (issues 14 and 16) ----------

def _random_case(rng, T, B, V, dtype=np.float32):
    x = rng.standard_normal((T, B, V)).astype(dtype)
    x[rng.random((T, B)) < 0.3, V - 1] = 9.0            # blanks
    x[1::2] = x[0::2][: x[1::2].shape[0]]                # repeats
    lengths = rng.integers(-2, T + 1, B).astype(np.int32)
    return x, lengths


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(50, 1, 29), (7, 3, 5), (4, 70, 3), (33, 2, 130)])
@pytest.mark.parametrize("merge", [True, False])
def test_time_major_false_equals_transposed(dtype, shape, merge):
    rng = np.random.default_rng(sum(shape))
    x, lengths = _random_case(rng, *shape, dtype=dtype)
    want = ctc_greedy_decoder_reference(x, np.maximum(lengths, 0), merge)
    xb = np.ascontiguousarray(x.transpose(1, 0, 2))
    assert_same(decode(x, lengths, merge), want)
    assert_same(decode(xb, lengths, merge, time_major=False), want)
    # the full Python path (a non-contiguous view is copied) gives the same
    assert_same(decode(x.transpose(1, 0, 2), lengths, merge, time_major=False), want)
    assert_same(decode(xb, lengths.astype(np.int64), merge, blank_index=np.int64(-1),
                       time_major=False, num_threads=2), want)


def test_time_major_false_checks_use_batch_major_shape():
    x = np.zeros((2, 5, 3), np.float32)                  # [B=2, T=5, V=3]
    with pytest.raises(FailedPreconditionError, match=re.escape("sequence_length(1) <= 5")):
        ctc_greedy_decoder(x, [5, 6], time_major=False)
    with pytest.raises(FailedPreconditionError, match="len.sequence_length. != batch_size"):
        ctc_greedy_decoder(x, [5, 5, 5], time_major=False)
    with pytest.raises(TypeError, match=r"time_major must be True .* or False"):
        ctc_greedy_decoder(x, [5, 5], time_major="no")


def test_fast_path_falls_back_with_tf_messages():
    x = np.zeros((4, 2, 3), np.float32)
    assert _ctc.decode_fast(x, np.array([4, 5], np.int32), None, True, None, True) is None
    assert _ctc.decode_fast(x, np.array([4, 4], np.int32), 3, True, None, True) is None
    assert _ctc.decode_fast(x, [4, 4], None, True, None, True) is None
    with pytest.raises(FailedPreconditionError, match=re.escape("sequence_length(1) <= 4")):
        ctc_greedy_decoder(x, np.array([4, 5], np.int32))
    with pytest.raises(InvalidArgumentError, match="blank_index expected to be between -3 and 2"):
        ctc_greedy_decoder(x, np.array([4, 4], np.int32), blank_index=3)
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        ctc_greedy_decoder(x, np.array([4, 4], np.int32), num_threads=0)


def test_fast_path_large_batch_uses_heap_lengths():
    rng = np.random.default_rng(5)
    x, lengths = _random_case(rng, 6, 200, 4)            # B > the stack buffer of 64
    want = ctc_greedy_decoder_reference(x, np.maximum(lengths, 0))
    assert_same(decode(x, lengths), want)
    assert_same(decode(x, lengths.astype(np.int64)), want)


def test_torch_in_torch_out_zero_copy():
    torch = pytest.importorskip("torch")
    from readerlib.kernels import _native
    rng = np.random.default_rng(6)
    x, lengths = _random_case(rng, 9, 3, 6)
    want = ctc_greedy_decoder_reference(x, np.maximum(lengths, 0))
    xt = torch.from_numpy(x.copy())
    view, wrap = _native(xt, "inputs")
    assert view.ctypes.data == xt.data_ptr() and wrap is torch.from_numpy   # no copy
    (sp,), neg = ctc_greedy_decoder(xt, torch.from_numpy(lengths))
    for a in (sp.indices, sp.values, sp.dense_shape, neg):
        assert isinstance(a, torch.Tensor)
    assert_same((sp.indices.numpy(), sp.values.numpy(), sp.dense_shape.numpy(), neg.numpy()),
                want)
    # batch-major torch logits (to_padded's layout), requires_grad: decoded from .detach()
    xb = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2))).requires_grad_()
    (sp,), neg = ctc_greedy_decoder(xb, lengths, time_major=False)
    assert isinstance(neg, torch.Tensor) and not neg.requires_grad
    np.testing.assert_array_equal(sp.values.numpy(), want[1])


def test_torch_bad_dtype_message_names_argument():
    torch = pytest.importorskip("torch")
    x = torch.zeros((3, 1, 4), dtype=torch.int64)
    with pytest.raises(TypeError, match=r"inputs must be float32 or float64 .*\.float\(\)"):
        ctc_greedy_decoder(x, [3])
    with pytest.raises(TypeError, match=r"inputs has dtype torch.bfloat16.*inputs\.float\(\)"):
        ctc_greedy_decoder(torch.zeros((3, 1, 4), dtype=torch.bfloat16), [3])
    with pytest.raises(TypeError, match="sequence_length must hold integers"):
        ctc_greedy_decoder(torch.zeros((3, 1, 4)), torch.tensor([3.0]))


class _Producer:
    """A minimal DLPack producer of another framework (CPU)."""
    __module__ = "otherframework.tensor"

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_producer_cpu_zero_copy():
    from readerlib.kernels import _native
    rng = np.random.default_rng(7)
    x, lengths = _random_case(rng, 5, 2, 4)
    view, _ = _native(_Producer(x), "inputs")
    assert view.ctypes.data == x.ctypes.data
    want = ctc_greedy_decoder_reference(x, np.maximum(lengths, 0))
    assert_same(decode(_Producer(x), _Producer(lengths)), want)


def test_dlpack_producer_on_unknown_device_is_refused():
    class OnTPU(_Producer):
        def __dlpack_device__(self):
            return (9, 0)
    with pytest.raises(TypeError, match="inputs lives on DLPack device type 9"):
        ctc_greedy_decoder(OnTPU(np.zeros((2, 1, 3), np.float32)), [2])
