"""GPU (CuPy) RNN-T decoding: the same decodes on NumPy and CuPy must agree.

Marked ``gpu``: skipped without CuPy and a CUDA device (tests/conftest.py).
"""
import numpy as np
import pytest

from readerlib.rnnt import RNNTModel, rnnt_greedy_decode
from readerlib.tensor import LoDTensor

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emu]


def _assert_same(ref, out, tol):
    assert len(ref) == len(out)
    for a, b in zip(ref, out):
        assert a.y_sequence.tolist() == b.y_sequence.tolist()
        assert a.timestamps.tolist() == b.timestamps.tolist()
        assert abs(a.score - b.score) <= tol
        if a.alignments is not None:
            assert [[k for k, _ in f] for f in a.alignments] == [[k for k, _ in f] for f in b.alignments]
            for fa, fb in zip(a.alignments, b.alignments):
                np.testing.assert_allclose([p for _, p in fa], [p for _, p in fb], atol=tol, rtol=0)


@pytest.mark.parametrize("predictor", ["lstm", "stateless"])
@pytest.mark.parametrize("max_symbols", [None, 1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpu_matches_cpu(xp_gpu, predictor, max_symbols, dtype):
    cp = xp_gpu
    rng = np.random.default_rng(0)
    for seed in range(3):
        bias = 3.0 if max_symbols is None else 0.0
        model = RNNTModel.random(11, 6, 8, 7, predictor=predictor, blank_bias=bias, dtype=dtype, rng=seed)
        gmodel = model.to(cp)
        x = rng.standard_normal((7, 15, 6)).astype(dtype)
        lengths = np.array([15, 0, 3, 15, 9, 1, 14])
        ref = rnnt_greedy_decode(model, x, lengths, max_symbols, "single", True)
        tol = 1e-9 if dtype == np.float64 else 1e-4
        for alg, kw in [("loop_labels", {}), ("loop_labels", {"window": 1}), ("loop_frames", {})]:
            out = rnnt_greedy_decode(gmodel, cp.asarray(x), cp.asarray(lengths), max_symbols, alg, True, **kw)
            _assert_same(ref, out, tol)


def test_gpu_lod_input_and_single(xp_gpu):
    cp = xp_gpu
    rng = np.random.default_rng(1)
    model = RNNTModel.random(9, 5, 6, 4, dtype=np.float64, rng=2)
    seqs = [rng.standard_normal((n, 5)) for n in (4, 0, 7)]
    ref = rnnt_greedy_decode(model, LoDTensor.from_sequences(seqs), None, 4, "loop_labels", True)
    glod = LoDTensor.from_sequences([cp.asarray(s) for s in seqs])
    for alg in ("loop_labels", "loop_frames", "single"):
        _assert_same(ref, rnnt_greedy_decode(model.to(cp), glod, None, 4, alg, True), 1e-9)


def test_gpu_kernels_compile_and_replace_rows(xp_gpu):
    cp = xp_gpu
    from readerlib.rnnt._rnnt_gpu import GpuKernels
    k = GpuKernels()
    for dtype in (np.float32, np.float64, np.int64):
        dst = cp.arange(24, dtype=dtype).reshape(4, 2, 3)
        src = -dst
        mask = cp.asarray([0, 1, 1, 0], dtype=np.uint8)
        want = cp.where(mask[:, None, None].astype(bool), src, dst)
        k.masked_replace_rows(dst, src, mask)
        assert bool((dst == want).all())


def test_gpu_rejects_compact(xp_gpu):
    cp = xp_gpu
    model = RNNTModel.random(5, 3, 4, 4, rng=0).to(cp)
    with pytest.raises(ValueError, match="compact=True"):
        rnnt_greedy_decode(model, cp.zeros((1, 2, 3), dtype=np.float32), cp.asarray([2]), compact=True)


def test_gpu_realistic_model_matches_cpu(xp_gpu):
    """The benchmark's model size (LSTM 1 x 640, joint 640, 1024 labels + blank, ~85%
    blank), so the kernels' block reductions see full 256-thread strides over V."""
    cp = xp_gpu
    model = RNNTModel.random(1024, 640, 640, 640, blank_bias=1.25, dtype=np.float32, rng=0)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 60, 640)).astype(np.float32)
    lengths = np.array([60, 41, 0, 60, 7, 33])
    ref = rnnt_greedy_decode(model, x, lengths, 10, "loop_labels", True)
    assert sum(len(h.y_sequence) for h in ref) >= 10         # the model does emit labels
    gmodel = model.to(cp)
    for alg, kw in [("loop_labels", {}), ("loop_labels", {"window": 1}), ("loop_frames", {})]:
        out = rnnt_greedy_decode(gmodel, cp.asarray(x), cp.asarray(lengths), 10, alg, True, **kw)
        _assert_same(ref, out, 1e-4)
