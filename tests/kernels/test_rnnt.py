"""Batched greedy RNN-T decoding: models, kernels, and the three algorithms."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readerlib.rnnt import (Hypothesis, Joint, LSTMPredictor, RNNTModel, StatelessPredictor,
                            rnnt_greedy_decode)
from readerlib.rnnt import _rnnt_cpu
from readerlib.tensor import LoDTensor

BATCHED = [  # (algorithm, options): every batched variant is checked against "single"
    ("loop_labels", dict()),
    ("loop_labels", dict(window=1)),
    ("loop_labels", dict(window=8)),
    ("loop_labels", dict(window=3, compact=False)),   # the GPU control flow, on NumPy
    ("loop_labels", dict(window=1, compact=False)),
    ("loop_frames", dict()),
    ("loop_frames", dict(compact=False)),
]


def make_model(predictor="lstm", vocab=7, enc=5, pred=6, joint=4, layers=1, blank_bias=0.0,
               seed=0, dtype=np.float64, activation="relu"):
    return RNNTModel.random(vocab, enc, pred, joint, num_layers=layers, predictor=predictor,
                            activation=activation, blank_bias=blank_bias, dtype=dtype, rng=seed)


def assert_same(ref, out, tol=1e-5):
    assert len(ref) == len(out)
    for a, b in zip(ref, out):
        assert isinstance(b, Hypothesis)
        assert a.y_sequence.tolist() == b.y_sequence.tolist()
        assert a.timestamps.tolist() == b.timestamps.tolist()
        assert b.y_sequence.dtype == np.int64 and b.timestamps.dtype == np.int64
        assert abs(a.score - b.score) <= tol
        if a.alignments is None:
            assert b.alignments is None
            continue
        assert len(a.alignments) == len(b.alignments)
        for fa, fb in zip(a.alignments, b.alignments):
            assert [k for k, _ in fa] == [k for k, _ in fb]
            np.testing.assert_allclose([p for _, p in fa], [p for _, p in fb], atol=tol, rtol=0)


def decode_all(model, x, lengths, max_symbols, alignments=True):
    ref = rnnt_greedy_decode(model, x, lengths, max_symbols, "single", alignments)
    for alg, kw in BATCHED:
        out = rnnt_greedy_decode(model, x, lengths, max_symbols, alg, alignments, **kw)
        assert_same(ref, out)
    return ref


# -- agreement of the algorithms ---------------------------------------------------------

@pytest.mark.parametrize("predictor", ["lstm", "stateless"])
@pytest.mark.parametrize("max_symbols", [None, 1, 2, 10])
def test_batched_algorithms_match_single(predictor, max_symbols):
    rng = np.random.default_rng(1)
    # no cap needs a model that does emit blank; with a cap, let it emit a lot
    bias = 3.0 if max_symbols is None else -1.0
    for seed in range(4):
        model = make_model(predictor, blank_bias=bias, seed=seed)
        x = rng.standard_normal((5, 13, 5))
        lengths = np.array([13, 0, 7, 1, 12])
        ref = decode_all(model, x, lengths, max_symbols)
        assert len(ref[1]) == 0 and ref[1].alignments == []


def test_two_layer_lstm_and_activations():
    rng = np.random.default_rng(2)
    for act in ("relu", "tanh", "sigmoid"):
        model = make_model("lstm", layers=2, activation=act, seed=3)
        x = rng.standard_normal((3, 9, 5))
        decode_all(model, x, np.array([9, 4, 6]), 3)


def test_float32_model_agrees():
    rng = np.random.default_rng(3)
    model = make_model("lstm", vocab=30, enc=16, pred=24, joint=20, blank_bias=1.0, seed=5,
                       dtype=np.float32)
    x = rng.standard_normal((6, 40, 16)).astype(np.float32)
    lengths = np.array([40, 33, 0, 12, 40, 5])
    ref = rnnt_greedy_decode(model, x, lengths, 5, "single", True)
    for alg, kw in BATCHED:
        assert_same(ref, rnnt_greedy_decode(model, x, lengths, 5, alg, True, **kw), tol=1e-4)


def test_many_labels_per_frame_hit_the_cap():
    # a strongly non-blank model: the cap decides where frames end
    rng = np.random.default_rng(4)
    model = make_model("lstm", blank_bias=-6.0, seed=1)
    x = rng.standard_normal((4, 6, 5))
    lengths = np.array([6, 5, 2, 6])
    for cap in (1, 2, 4):
        ref = decode_all(model, x, lengths, cap)
        for h, T in zip(ref, lengths):
            counts = np.bincount(h.timestamps, minlength=T)
            assert counts.max() <= cap
            for t, frame in enumerate(h.alignments):
                labels = [k for k, _ in frame]
                n_nonblank = sum(k != model.blank_index for k in labels)
                assert n_nonblank == counts[t]
                # a frame ends with blank unless the cap ended it
                assert labels[-1] == model.blank_index or n_nonblank == cap


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1),
       predictor=st.sampled_from(["lstm", "stateless"]),
       batch=st.integers(1, 6),
       max_time=st.integers(1, 10),
       max_symbols=st.sampled_from([None, 1, 2, 3, 10]),
       vocab=st.integers(1, 6),
       window=st.integers(1, 5))
def test_property_batched_equals_single(seed, predictor, batch, max_time, max_symbols, vocab, window):
    rng = np.random.default_rng(seed)
    bias = float(rng.uniform(2.0, 4.0)) if max_symbols is None else float(rng.uniform(-3.0, 3.0))
    model = RNNTModel.random(vocab, 3, 4, 5, predictor=predictor, blank_bias=bias,
                             dtype=np.float64, rng=seed)
    x = rng.standard_normal((batch, max_time, 3))
    lengths = rng.integers(0, max_time + 1, batch)
    ref = rnnt_greedy_decode(model, x, lengths, max_symbols, "single", True)
    for alg, kw in BATCHED:
        kw = dict(kw)
        if alg == "loop_labels":
            kw["window"] = window
        assert_same(ref, rnnt_greedy_decode(model, x, lengths, max_symbols, alg, True, **kw))
    for h, T in zip(ref, lengths):
        assert len(h.alignments) == T
        assert np.all(np.diff(h.timestamps) >= 0)
        assert np.all(h.y_sequence != model.blank_index)
        # score = sum of the emitted labels' log-probabilities
        emitted = [p for frame in h.alignments for k, p in frame if k != model.blank_index]
        assert abs(h.score - sum(emitted)) < 1e-9


def test_blank_index_zero():
    rng = np.random.default_rng(6)
    base = make_model("lstm", seed=2)
    sd = base.to_nemo_state_dict()
    model = RNNTModel.from_nemo_state_dict(sd, blank_index=0)
    assert model.blank_index == 0
    x = rng.standard_normal((3, 8, 5))
    ref = decode_all(model, x, np.array([8, 3, 5]), 4)
    assert all(0 not in h.y_sequence.tolist() for h in ref)


# -- inputs ---------------------------------------------------------------------------------

def test_lod_input_equals_padded_input():
    rng = np.random.default_rng(7)
    model = make_model("lstm", seed=4)
    lengths = [5, 0, 3, 8]
    seqs = [rng.standard_normal((n, 5)) for n in lengths]
    padded = np.zeros((4, 8, 5))
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    lod = LoDTensor.from_sequences(seqs)
    for alg in ("single", "loop_labels", "loop_frames"):
        assert_same(rnnt_greedy_decode(model, padded, np.array(lengths), 3, alg, True),
                    rnnt_greedy_decode(model, lod, None, 3, alg, True), tol=1e-12)
    with pytest.raises(ValueError, match="encoder_lengths must be None"):
        rnnt_greedy_decode(model, lod, np.array(lengths))


def test_zero_length_utterances_give_empty_hypotheses():
    model = make_model("lstm")
    x = np.zeros((3, 4, 5))
    for alg in ("single", "loop_labels", "loop_frames"):
        hyps = rnnt_greedy_decode(model, x, np.zeros(3, dtype=np.int64), algorithm=alg,
                                  return_alignments=True)
        assert [len(h) for h in hyps] == [0, 0, 0]
        assert all(h.score == 0.0 and h.alignments == [] for h in hyps)
    assert rnnt_greedy_decode(model, np.zeros((0, 4, 5)), np.zeros(0, dtype=np.int64)) == []


def test_lengths_default_to_full():
    rng = np.random.default_rng(8)
    model = make_model("lstm")
    x = rng.standard_normal((2, 6, 5))
    assert_same(rnnt_greedy_decode(model, x), rnnt_greedy_decode(model, x, np.array([6, 6])))


@pytest.mark.parametrize("bad", [0, -1, -10])
def test_max_symbols_must_be_positive(bad):
    model = make_model()
    with pytest.raises(ValueError, match=r"Expected max_symbols_per_step > 0 \(or None\), got"):
        rnnt_greedy_decode(model, np.zeros((1, 2, 5)), np.array([2]), max_symbols=bad)


def test_argument_errors():
    model = make_model()
    x = np.zeros((2, 3, 5))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        rnnt_greedy_decode(model, x, np.array([3, 3]), algorithm="beam")
    with pytest.raises(ValueError, match=r"encoder_lengths must be in \[0, 3\]"):
        rnnt_greedy_decode(model, x, np.array([4, 3]))
    with pytest.raises(ValueError, match=r"encoder_lengths must be in"):
        rnnt_greedy_decode(model, x, np.array([-1, 3]))
    with pytest.raises(ValueError, match="shape"):
        rnnt_greedy_decode(model, x, np.array([3]))
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        rnnt_greedy_decode(model, np.zeros((3, 5)), np.array([3]))
    with pytest.raises(TypeError, match="integers"):
        rnnt_greedy_decode(model, x, np.array([3.0, 3.0]))
    for bad in (0, -1, True, 2.0, "wide"):
        with pytest.raises(ValueError, match="window"):
            rnnt_greedy_decode(model, x, np.array([3, 3]), window=bad)
    with pytest.raises(TypeError, match="max_symbols"):
        rnnt_greedy_decode(model, x, np.array([3, 3]), max_symbols=2.5)


def test_stats_count_calls():
    rng = np.random.default_rng(9)
    model = make_model("lstm", blank_bias=1.0, seed=3)
    x = rng.standard_normal((4, 10, 5))
    lengths = np.array([10, 10, 10, 10])
    hyps = None
    for alg in ("loop_labels", "loop_frames", "single"):
        stats = {}
        hyps = rnnt_greedy_decode(model, x, lengths, 10, alg, stats=stats)
        assert set(stats) == {"predictor_calls", "predictor_rows", "joint_calls", "joint_rows"}
        if alg == "loop_frames":
            assert stats["predictor_calls"] == stats["joint_calls"] >= 10
        if alg == "loop_labels":
            # one predictor call per label "column", plus the start
            assert stats["predictor_calls"] <= max(len(h) for h in hyps) + 1 + 10
    stats = {}
    rnnt_greedy_decode(model, x, lengths, 10, "single", stats=stats)
    assert stats["predictor_calls"] == sum(len(h) for h in hyps) + 4
    # the GPU control flow learns "nothing active" one (wasted) predictor step late,
    # instead of reading a flag after every store
    compact, masked = {}, {}
    rnnt_greedy_decode(model, x, lengths, 10, "loop_labels", stats=compact)
    rnnt_greedy_decode(model, x, lengths, 10, "loop_labels", compact=False, stats=masked)
    assert masked["predictor_calls"] == compact["predictor_calls"] + 1


# -- models -------------------------------------------------------------------------------

def test_lstm_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    p = LSTMPredictor.random(vocab_size=9, hidden=6, num_layers=2, embed_dim=5, dtype=np.float64, rng=rng)
    lstm = torch.nn.LSTM(5, 6, num_layers=2, batch_first=True).double()
    emb, wi, wh, bi, bh = p._params
    with torch.no_grad():
        for k in range(2):
            getattr(lstm, f"weight_ih_l{k}").copy_(torch.from_numpy(wi[k]))
            getattr(lstm, f"weight_hh_l{k}").copy_(torch.from_numpy(wh[k]))
            getattr(lstm, f"bias_ih_l{k}").copy_(torch.from_numpy(bi[k]))
            getattr(lstm, f"bias_hh_l{k}").copy_(torch.from_numpy(bh[k]))
    labels = np.array([[9, 3, 4], [1, 9, 8]])  # 9 = blank -> zero embedding
    e = emb.copy()
    e[9] = 0
    with torch.no_grad():
        ref, (h, c) = lstm(torch.from_numpy(e[labels]))
    state = p.initial_state(2)
    for u in range(3):
        out, state = p.step(labels[:, u], state)
        np.testing.assert_allclose(out, ref[:, u].numpy(), atol=1e-12)
    np.testing.assert_allclose(state[0], h.numpy().transpose(1, 0, 2), atol=1e-12)
    np.testing.assert_allclose(state[1], c.numpy().transpose(1, 0, 2), atol=1e-12)


def test_stateless_predictor_context():
    rng = np.random.default_rng(11)
    p = StatelessPredictor.random(vocab_size=5, embed_dim=8, context_size=3, dtype=np.float64, rng=rng)
    assert [e.shape[1] for e in p.embeddings] == [6, 1, 1]   # NeMo's split
    state = p.initial_state(1)
    seq = [5, 2, 3, 4]
    hist = [5, 5]
    for y in seq:
        out, state = p.step(np.array([y]), state)
        ctx = hist + [y]  # oldest ... newest
        want = np.concatenate([p.embeddings[i][ctx[2 - i]] for i in range(3)])
        np.testing.assert_allclose(out[0], want)
        hist = ctx[1:]
    np.testing.assert_allclose(p.step(np.array([5]), p.initial_state(1))[0], 0)
    q = StatelessPredictor(p._params, 5, normalization="layer")
    out, _ = q.step(np.array([1, 2]), q.initial_state(2))
    np.testing.assert_allclose(out.mean(axis=1), 0, atol=1e-12)


def test_joint_split_composes():
    rng = np.random.default_rng(12)
    j = Joint.random(5, 6, 4, 8, activation="tanh", dtype=np.float64, rng=rng)
    f = rng.standard_normal((3, 5))
    g = rng.standard_normal((3, 6))
    ew, eb, pw, pb, ow, ob = j._params
    want = np.tanh(f @ ew.T + eb + g @ pw.T + pb) @ ow.T + ob
    np.testing.assert_allclose(j.joint(f, g), want, atol=1e-12)
    np.testing.assert_allclose(j.joint_after_projection(j.project_encoder(f), j.project_prednet(g)), want)


def test_nemo_state_dict_round_trip():
    for predictor in ("lstm", "stateless"):
        m = make_model(predictor, seed=1)
        sd = m.to_nemo_state_dict()
        sd = {("decoder." if k.startswith("prediction") else "joint.") + k: v for k, v in sd.items()}
        sd["encoder.pre_encode.conv.0.weight"] = np.zeros((2, 2))  # whole-model dicts hold more
        m2 = RNNTModel.from_nemo_state_dict(sd)
        assert type(m2.predictor) is type(m.predictor)
        x = np.random.default_rng(0).standard_normal((2, 5, 5))
        assert_same(rnnt_greedy_decode(m, x, np.array([5, 3]), return_alignments=True),
                    rnnt_greedy_decode(m2, x, np.array([5, 3]), return_alignments=True), tol=1e-12)


def test_nemo_state_dict_errors_list_every_problem():
    sd = make_model("lstm").to_nemo_state_dict()
    sd["prediction.dec_rnn.lstm.bias_hh_l0"] = np.zeros(3)
    del sd["pred.bias"]
    sd["joint_net.2.weight"] = np.zeros((8, 3))
    sd["prediction.extra"] = np.zeros(1)
    with pytest.raises(ValueError) as e:
        RNNTModel.from_nemo_state_dict(sd)
    msg = str(e.value)
    assert "prediction.dec_rnn.lstm.bias_hh_l0: expected shape (24,), got (3,)" in msg
    assert "missing parameter: pred.bias" in msg
    assert "joint_net.2.weight: expected shape (8, 4), got (8, 3)" in msg
    assert "unknown parameters: prediction.extra" in msg
    with pytest.raises(ValueError, match="missing parameter: prediction.embed.weight"):
        RNNTModel.from_nemo_state_dict({k: v for k, v in make_model().to_nemo_state_dict().items()
                                        if k != "prediction.embed.weight"})


def test_nemo_state_dict_from_torch_tensors():
    torch = pytest.importorskip("torch")
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in make_model().to_nemo_state_dict().items()}
    m = RNNTModel.from_nemo_state_dict(sd)
    assert m.dtype == np.float64


# -- kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_logsoftmax_kernel(dtype):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((37, 11)).astype(dtype)
    x[3, [2, 7]] = 5.0  # tie -> lowest index, like numpy
    k = np.empty(37, np.int64)
    lp = np.empty(37)
    _rnnt_cpu.argmax_logsoftmax(x, k, lp, 2)
    x64 = x.astype(np.float64)
    np.testing.assert_array_equal(k, x.argmax(1))
    want = x64.max(1) - np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) - x64.max(1)
    np.testing.assert_allclose(lp, want, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_masked_replace_rows_kernel(dtype):
    dst = np.arange(12, dtype=dtype).reshape(4, 3)
    src = -np.arange(12, dtype=dtype).reshape(4, 3)
    mask = np.array([1, 0, 0, 1], np.uint8)
    want = np.where(mask[:, None].astype(bool), src, dst)
    _rnnt_cpu.masked_replace_rows(dst, src, mask)
    np.testing.assert_array_equal(dst, want)
    with pytest.raises(ValueError, match="do not match"):
        _rnnt_cpu.masked_replace_rows(dst, src[:2], mask)


@pytest.mark.parametrize("context_size", [1, 3])
def test_stateless_context_sizes(context_size):
    rng = np.random.default_rng(14)
    model = RNNTModel.random(6, 4, 6, 3, predictor="stateless", context_size=context_size,
                             dtype=np.float64, rng=context_size)
    x = rng.standard_normal((4, 9, 4))
    decode_all(model, x, np.array([9, 2, 0, 5]), 3)
