"""Batched greedy RNN-T decoding: frame looping, label looping, and a reference.

Design:
    Three algorithms with identical results (NeMo's semantics):

    ``single``       one utterance at a time, frame by frame; for each frame
                     evaluate the joint until it emits blank or ``max_symbols``
                     labels were emitted on that frame.  Plain NumPy/CuPy, no
                     kernels: the reference the batched decoders are checked
                     against (NeMo's ``GreedyRNNTInfer``).
    ``loop_frames``  NeMo's classic batched ``_greedy_decode_blank_as_pad``:
                     for each frame, call predictor + joint on the whole batch
                     until every utterance has emitted blank on that frame; rows
                     that emitted blank keep their previous predictor state
                     (state replacement under a mask).  Predictor calls =
                     sum over frames of (1 + the most labels any row emits there).
    ``loop_labels``  NeMo's label looping (``GreedyBatchedRNNTLoopLabelsComputer``):
                     one predictor call per emitted label "column"; after it,
                     evaluate only the joint, advancing each row's own frame
                     index over blanks until every active row has found a
                     non-blank label (or ran off its end).  Predictor calls =
                     1 + the longest hypothesis.
                     One change to NeMo: while a row searches, its prediction
                     output is fixed, so the joint at its next ``window``
                     frames is one GEMM and the kernel scans them in order
                     (``window=1`` is NeMo's search).  On the CPU a joint call
                     is bound by reading the output weights (2.6 MB for
                     640 x 1025 float32) whatever the row count, and NeMo's
                     search costs ~(1 + the longest blank run in the batch)
                     joint calls per label column; the window divides that by
                     ~window for ~2x the joint rows.

    Both batched decoders are written once against the array module (NumPy on
    the CPU, CuPy on the GPU): the matrix products go to the array library,
    and each step's bookkeeping (argmax + log-softmax at the argmax, blank /
    active / advance masks, time indices, masked writes of labels, timestamps,
    scores and alignment records, state replacement under a mask) is one call
    into a kernel set: Cython (``_rnnt_cpu.pyx``) or CUDA RawKernels
    (``cuda/rnnt.cu`` via ``_rnnt_gpu.py``) with the same signatures.

    The only behavioural switch is ``compact``: on the CPU the kernels return
    the list of rows that still need work and the decoder runs the predictor
    and joint only on those rows (gathered); on the GPU every step runs on the
    full batch under masks, so nothing but one int (the number / presence of
    rows still working) is read back per loop iteration.  ``compact=False`` on
    the CPU runs exactly the GPU control flow, which is how the GPU decoder's
    logic is tested on machines without a GPU.

    Outputs are per-utterance buffers ``[B, capacity]`` filled by the kernels;
    capacity is grown on the host from counters the host already knows (each
    loop iteration adds at most one label / alignment record per row), so
    growing needs no device read.

Semantics pinned (NeMo): the start symbol is blank (zero embedding, zero
state); a blank never changes the predictor state; ``score`` is the sum of
the log-softmax values of the emitted labels; ``max_symbols`` caps the labels
emitted per frame, after which decoding moves to the next frame as if blank
had been emitted (no blank is recorded in the alignment); ``None`` means no
cap (a model that never emits blank then never stops, as in NeMo).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from ..tensor import LoDTensor

__all__ = ["Hypothesis", "rnnt_greedy_decode", "ALGORITHMS"]

ALGORITHMS = ("loop_labels", "loop_frames", "single")


@dataclass
class Hypothesis:
    """One decoded utterance.

    Attributes
    ----------
    y_sequence : ndarray of int64
        Emitted labels (blank never appears).
    timestamps : ndarray of int64
        Encoder frame of each label.
    score : float
        Sum of the log-softmax probabilities of the emitted labels.
    alignments : list of list of (int, float), or None
        With ``return_alignments``: one list per frame of the utterance, holding
        ``(label, log_prob)`` for every joint evaluation on that frame, in order
        (labels, then the blank that ended the frame unless ``max_symbols``
        ended it).
    """

    y_sequence: np.ndarray
    timestamps: np.ndarray
    score: float = 0.0
    alignments: Optional[List[List[Tuple[int, float]]]] = None

    def __len__(self):
        return int(self.y_sequence.shape[0])


from ..gpu import array_module as _array_module, is_cupy_array  # noqa: E402


def _grow(xp, a, cap):
    """``a`` ``[B, old]`` widened to ``[B, cap]`` (new columns zero)."""
    out = xp.zeros((a.shape[0], cap), dtype=a.dtype)
    out[:, :a.shape[1]] = a
    return out


class _Buffers:
    """Per-utterance outputs, written by the kernels, grown by the host."""

    def __init__(self, xp, B, cap_h, cap_a, record):
        self.xp = xp
        self.hyp_labels = xp.zeros((B, cap_h), dtype=np.int64)
        self.hyp_times = xp.zeros((B, cap_h), dtype=np.int64)
        self.hyp_len = xp.zeros(B, dtype=np.int64)
        self.hyp_score = xp.zeros(B, dtype=np.float64)
        self.record = record
        cap_a = cap_a if record else 1
        self.al_labels = xp.zeros((B, cap_a), dtype=np.int64)
        self.al_times = xp.zeros((B, cap_a), dtype=np.int64)
        self.al_logp = xp.zeros((B, cap_a), dtype=np.float64)
        self.al_len = xp.zeros(B, dtype=np.int64)
        self.n_records = 0  # host-side bound on records per row so far

    def ensure_hyp(self, n):
        """Room for ``n`` labels per row."""
        cap = self.hyp_labels.shape[1]
        if n > cap:
            cap = max(n, 2 * cap)
            self.hyp_labels = _grow(self.xp, self.hyp_labels, cap)
            self.hyp_times = _grow(self.xp, self.hyp_times, cap)

    def ensure_align(self, n):
        """Room for ``n`` alignment records per row."""
        if not self.record:
            return
        cap = self.al_labels.shape[1]
        if n > cap:
            cap = max(n, 2 * cap)
            self.al_labels = _grow(self.xp, self.al_labels, cap)
            self.al_times = _grow(self.xp, self.al_times, cap)
            self.al_logp = _grow(self.xp, self.al_logp, cap)

    def hypotheses(self, lengths):
        """Copy to the host once and cut into :class:`Hypothesis` objects."""
        get = (lambda a: a.get()) if self.xp is not np else (lambda a: a)
        hl, ht, hn, hs = (get(a) for a in (self.hyp_labels, self.hyp_times, self.hyp_len, self.hyp_score))
        if self.record:
            al, at, ap, an = (get(a) for a in (self.al_labels, self.al_times, self.al_logp, self.al_len))
        out = []
        for b in range(hn.shape[0]):
            n = int(hn[b])
            h = Hypothesis(hl[b, :n].copy(), ht[b, :n].copy(), float(hs[b]))
            if self.record:
                h.alignments = _frames(int(lengths[b]), al[b, :an[b]], at[b, :an[b]], ap[b, :an[b]])
            out.append(h)
        return out


def _frames(T, labels, times, logps):
    frames = [[] for _ in range(T)]
    for k, t, p in zip(labels.tolist(), times.tolist(), logps.tolist()):
        frames[t].append((k, p))
    return frames


class _CpuKernels:
    """The Cython kernel set (NumPy arrays); see ``_rnnt_cpu.pyx``."""

    def __init__(self, compact=True):
        from . import _rnnt_cpu
        self._k = _rnnt_cpu
        self.compact = compact
        # compact=False mirrors the GPU exactly, including when "any active" is known
        self.deferred_active = not compact
        self.counts = np.zeros(2, dtype=np.int64)

    def prepare(self, B):
        self.adv_rows = np.empty(B, dtype=np.int64)
        self.act_rows = np.empty(B, dtype=np.int64)

    def ll_joint_step(self, S, buf, logits, rows, window, first):
        return self._k.loop_labels_joint_step(
            logits, rows, window, first, S.blank, S.labels, S.scores, S.time, S.time_cur, S.safe_time,
            S.lengths, S.active, S.advance, buf.record, buf.al_labels, buf.al_times, buf.al_logp,
            buf.al_len, self.adv_rows, self.counts)

    def any_active(self):
        """After a ``first`` joint step: were any rows active (deferred mode)?"""
        return bool(self.counts[1])

    def ll_store(self, S, buf, rows, max_symbols):
        n = self._k.loop_labels_store(
            rows, max_symbols, S.labels, S.scores, S.time, S.time_cur, S.safe_time, S.lengths,
            S.active, buf.hyp_labels, buf.hyp_times, buf.hyp_len, buf.hyp_score, S.last_ts,
            S.ts_count, self.act_rows)
        return 1 if self.deferred_active else n

    def fl_joint_step(self, S, buf, logits, t):
        return self._k.loop_frames_joint_step(
            logits, t, S.blank, S.done, S.last_label, S.emitted, buf.hyp_labels, buf.hyp_times,
            buf.hyp_len, buf.hyp_score, buf.record, buf.al_labels, buf.al_times, buf.al_logp,
            buf.al_len)

    def masked_replace_rows(self, dst, src, mask):
        self._k.masked_replace_rows(dst.reshape(dst.shape[0], -1), src.reshape(src.shape[0], -1), mask)


def _kernels_for(xp, compact):
    if xp is np:
        return _CpuKernels(compact=True if compact is None else compact)
    from ._rnnt_gpu import GpuKernels
    if compact:
        raise ValueError("compact=True needs a host-side row list; the GPU decoder runs full-batch under masks")
    return GpuKernels()


class _State:
    pass


def _check_max_symbols(max_symbols):
    if max_symbols is None:
        return 0
    if isinstance(max_symbols, bool) or not isinstance(max_symbols, (int, np.integer)):
        raise TypeError(f"max_symbols must be an int or None, got {type(max_symbols).__name__}")
    if max_symbols <= 0:
        raise ValueError(f"Expected max_symbols_per_step > 0 (or None), got {max_symbols}")
    return int(max_symbols)


def _prepare_inputs(model, encoder_output, encoder_lengths):
    """Project the encoder output once; return (encp [B, T, J], lengths int64 [B] on xp, host lengths)."""
    xp = model.xp
    joint = model.joint
    if isinstance(encoder_output, LoDTensor):
        if encoder_lengths is not None:
            raise ValueError("encoder_lengths must be None when encoder_output is a LoDTensor "
                             "(the lengths come from its lod)")
        data, lod = encoder_output.validated()     # may have been changed after construction
        if len(lod) != 1:
            raise ValueError(f"encoder_output LoDTensor must have one LoD level, got {len(lod)}")
        if data.ndim != 2:
            raise ValueError(f"encoder_output LoDTensor data must be [frames, H], got shape {tuple(data.shape)}")
        offsets = lod[0]
        offsets_h = offsets.get() if hasattr(offsets, "get") and not isinstance(offsets, np.ndarray) else np.asarray(offsets)
        lengths_h = np.diff(offsets_h).astype(np.int64)
        B = lengths_h.shape[0]
        T = int(lengths_h.max()) if B else 0
        proj = joint.project_encoder(xp.asarray(data, dtype=model.dtype))
        encp = xp.zeros((B, T, proj.shape[1]), dtype=proj.dtype)
        if proj.shape[0]:
            # scatter rows to (utterance, frame) without a Python loop over utterances
            utt = np.repeat(np.arange(B), lengths_h)
            frame = np.arange(proj.shape[0]) - np.repeat(offsets_h[:-1], lengths_h)
            encp[xp.asarray(utt), xp.asarray(frame)] = proj
        return encp, xp.asarray(lengths_h), lengths_h
    if encoder_output.ndim != 3:
        raise ValueError(f"encoder_output must be [B, T, H] or a LoDTensor, got shape {tuple(encoder_output.shape)}")
    B, T, _ = encoder_output.shape
    if encoder_lengths is None:
        lengths_h = np.full(B, T, dtype=np.int64)
    else:
        lh = encoder_lengths.get() if hasattr(encoder_lengths, "get") and not isinstance(encoder_lengths, np.ndarray) \
            else np.asarray(encoder_lengths)
        if lh.ndim != 1 or lh.shape[0] != B:
            raise ValueError(f"encoder_lengths must have shape ({B},), got {tuple(lh.shape)}")
        if lh.dtype.kind not in "iu":
            raise TypeError(f"encoder_lengths must hold integers, got {lh.dtype}")
        if B and (lh.min() < 0 or lh.max() > T):      # in the caller's dtype: a uint64 cannot wrap
            raise ValueError(f"encoder_lengths must be in [0, {T}] (the padded length), got "
                             f"min {lh.min()}, max {lh.max()}")
        lengths_h = lh.astype(np.int64)
    if is_cupy_array(encoder_output) != (xp is not np):
        raise TypeError("encoder_output and the model must live on the same device "
                        "(use model.to(cupy) or model.to(numpy))")
    encp = joint.project_encoder(xp.asarray(encoder_output, dtype=model.dtype))
    return encp, xp.asarray(lengths_h), lengths_h


def rnnt_greedy_decode(model, encoder_output, encoder_lengths=None, max_symbols=10,
                       algorithm="loop_labels", return_alignments=False, *, window=None, compact=None,
                       stats=None):
    """Greedy (best-path) RNN-T decoding of a batch.

    Parameters
    ----------
    model : RNNTModel
        NumPy model for NumPy input, CuPy model for CuPy input.
    encoder_output : array ``[B, T, H]`` or LoDTensor
        Encoder frames; a LoDTensor holds ``[sum(T_i), H]`` rows with one LoD
        level (no padding).
    encoder_lengths : int array ``[B]``, optional
        Valid frames per utterance (defaults to ``T``); must be None for a
        LoDTensor.
    max_symbols : int or None, default 10
        Most labels emitted per frame; None means no cap.
    algorithm : {'loop_labels', 'loop_frames', 'single'}
    return_alignments : bool
        Fill :attr:`Hypothesis.alignments`.
    window : int, optional
        ``loop_labels`` only: frames evaluated per row in one joint call while
        it searches for its next label (its prediction output is fixed
        meanwhile, so they are independent).  1 is NeMo's frame-by-frame
        search; larger windows trade wasted joint rows (frames after the
        label) for fewer, larger GEMMs and fewer loop iterations (on the GPU:
        fewer host reads).  Results do not depend on it.  Default 8 on the
        CPU, 32 on the GPU.
    compact : bool, optional
        CPU only: run predictor and joint only on the rows that need work
        (default).  ``False`` runs the GPU's full-batch masked control flow.
    stats : dict, optional
        If given, filled with ``predictor_calls``, ``predictor_rows``,
        ``joint_calls`` and ``joint_rows`` (rows actually computed).

    Returns
    -------
    list of Hypothesis
        One per utterance, in input order (zero-length utterances give empty
        hypotheses).

    Raises
    ------
    ValueError
        ``max_symbols`` <= 0, unknown ``algorithm``, bad shapes or lengths.

    Examples
    --------
    >>> from readerlib.rnnt import RNNTModel
    >>> m = RNNTModel.random(vocab_size=6, encoder_dim=4, pred_dim=5, joint_dim=3, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 7, 4)).astype(np.float32)
    >>> hyps = rnnt_greedy_decode(m, x, np.array([7, 3]))
    >>> len(hyps)
    2
    """
    cap = _check_max_symbols(max_symbols)
    if window is None:
        window = 8 if model.xp is np else 32
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    encp, lengths, lengths_h = _prepare_inputs(model, encoder_output, encoder_lengths)
    counters = {"predictor_calls": 0, "predictor_rows": 0, "joint_calls": 0, "joint_rows": 0}
    B = encp.shape[0]
    if B == 0:
        hyps = []
    elif int(lengths_h.max()) == 0:
        hyps = [Hypothesis(np.zeros(0, np.int64), np.zeros(0, np.int64), 0.0,
                           [] if return_alignments else None) for _ in range(B)]
    elif algorithm == "single":
        hyps = _decode_single(model, encp, lengths_h, cap, return_alignments, counters)
    else:
        kernels = _kernels_for(model.xp, compact)
        if algorithm == "loop_labels":
            hyps = _decode_loop_labels(model, encp, lengths, lengths_h, cap, return_alignments, kernels,
                                       counters, window)
        else:
            hyps = _decode_loop_frames(model, encp, lengths, lengths_h, cap, return_alignments, kernels,
                                       counters)
    if stats is not None:
        stats.update(counters)
    return hyps


def _decode_loop_labels(model, encp, lengths, lengths_h, cap, record, K, counters, window):
    xp = model.xp
    pred, joint = model.predictor, model.joint
    B, T, J = encp.shape
    K.prepare(B)
    S = _State()
    S.blank = model.blank_index
    S.lengths = lengths
    S.labels = xp.full(B, model.blank_index, dtype=np.int64)
    S.scores = xp.zeros(B, dtype=np.float64)
    S.time = xp.zeros(B, dtype=np.int64)
    S.time_cur = xp.zeros(B, dtype=np.int64)
    S.safe_time = xp.zeros(B, dtype=np.int64)
    S.active = (lengths > 0).astype(np.uint8)
    S.advance = xp.zeros(B, dtype=np.uint8)
    S.last_ts = xp.full(B, -1, dtype=np.int64)
    S.ts_count = xp.zeros(B, dtype=np.int64)
    buf = _Buffers(xp, B, T + 1, 2 * T + 1, record)
    state = pred.initial_state(B)
    all_rows = xp.arange(B, dtype=np.int64)
    gp = xp.zeros((B, J), dtype=model.dtype)

    if K.compact:
        rows = np.flatnonzero(lengths_h > 0).astype(np.int64)
        n_active = rows.shape[0]
    else:
        rows = all_rows
        n_active = int((lengths_h > 0).sum())
    n_outer = 0
    while n_active > 0:
        # stage 1: one predictor step for every active row (blank = start symbol at first)
        if K.compact and n_active < B:
            sub = tuple(s[rows] for s in state)
            g, new_sub = pred.step(S.labels[rows], sub)
            for s, ns in zip(state, new_sub):
                s[rows] = ns
            gp[rows] = joint.project_prednet(g)
        else:
            g, state = pred.step(S.labels, state)
            gp = joint.project_prednet(g)
        counters["predictor_calls"] += 1
        counters["predictor_rows"] += rows.shape[0]

        # stage 2: joint at each row's own frames; the prediction output is fixed
        # while a row searches, so `window` frames per row go into one GEMM and
        # the kernel scans them in order; rows that saw only blanks search on
        n_adv = _search(S, buf, K, joint, encp, gp, rows, window, True, counters)
        if K.deferred_active and not K.any_active():
            # the GPU learns "nothing was active" here, with the first search's flag,
            # rather than paying a read after each store; this last step changed nothing
            break
        while n_adv > 0:
            adv = K.adv_rows[:n_adv].copy() if K.compact else all_rows
            n_adv = _search(S, buf, K, joint, encp, gp, adv, window, False, counters)

        # stage 3: append the found labels; force a frame advance at the cap
        n_outer += 1
        buf.ensure_hyp(n_outer)
        n_active = K.ll_store(S, buf, rows, cap)
        if K.compact:
            rows = K.act_rows[:n_active].copy()
    return buf.hypotheses(lengths_h)


def _search(S, buf, K, joint, encp, gp, rows, window, first, counters):
    """One windowed joint evaluation for ``rows`` and its bookkeeping kernel."""
    xp = joint.xp
    buf.n_records += window
    buf.ensure_align(buf.n_records)
    if window == 1:
        f = encp[rows, S.safe_time[rows]]
        logits = joint.joint_after_projection(f, gp[rows])
    else:
        last = xp.maximum(S.lengths[rows] - 1, 0)[:, None]
        frames = xp.minimum(S.time[rows][:, None] + xp.arange(window, dtype=np.int64), last)
        f = encp[rows[:, None], frames]                      # [n, W, J]
        logits = joint.joint_after_projection(f, gp[rows][:, None, :])
        logits = logits.reshape(rows.shape[0] * window, -1)
    counters["joint_calls"] += 1
    counters["joint_rows"] += rows.shape[0] * window
    return K.ll_joint_step(S, buf, logits, rows, window, first)


def _decode_loop_frames(model, encp, lengths, lengths_h, cap, record, K, counters):
    xp = model.xp
    pred, joint = model.predictor, model.joint
    B, T, J = encp.shape
    K.prepare(B)
    S = _State()
    S.blank = model.blank_index
    S.last_label = xp.full(B, model.blank_index, dtype=np.int64)
    S.done = xp.zeros(B, dtype=np.uint8)
    S.emitted = xp.zeros(B, dtype=np.uint8)
    buf = _Buffers(xp, B, T + 1, 2 * T + 1, record)
    state = pred.initial_state(B)
    n_calls = 0
    for t in range(int(lengths_h.max())):
        f = encp[:, t]
        S.done[...] = lengths <= t
        symbols = 0
        while cap == 0 or symbols < cap:
            g, new_state = pred.step(S.last_label, state)
            logits = joint.joint_after_projection(f, joint.project_prednet(g))
            counters["predictor_calls"] += 1
            counters["predictor_rows"] += B
            counters["joint_calls"] += 1
            counters["joint_rows"] += B
            n_calls += 1
            buf.ensure_hyp(n_calls)
            buf.ensure_align(n_calls)
            n_left = K.fl_joint_step(S, buf, logits, t)
            if n_left == 0:
                break
            # rows that emitted a label move to the new state; blank rows keep theirs
            for s, ns in zip(state, new_state):
                K.masked_replace_rows(s, ns, S.emitted)
            symbols += 1
    return buf.hypotheses(lengths_h)


def _decode_single(model, encp, lengths_h, cap, record, counters):
    """Reference: NeMo's ``GreedyRNNTInfer._greedy_decode``, one utterance at a time."""
    xp = model.xp
    pred, joint = model.predictor, model.joint
    blank = model.blank_index
    hyps = []
    for b in range(encp.shape[0]):
        T = int(lengths_h[b])
        labels, times, score = [], [], 0.0
        frames = [[] for _ in range(T)] if record else None
        state = pred.initial_state(1)
        last = np.array([blank], dtype=np.int64)
        g = new_state = None
        for t in range(T):
            f = encp[b, t][None]
            emitted = 0
            while cap == 0 or emitted < cap:
                if g is None:  # the prediction for (last label, state) is computed once
                    out, new_state = pred.step(xp.asarray(last), state)
                    g = joint.project_prednet(out)
                    counters["predictor_calls"] += 1
                    counters["predictor_rows"] += 1
                logits = joint.joint_after_projection(f, g)[0]
                counters["joint_calls"] += 1
                counters["joint_rows"] += 1
                x = logits.astype(np.float64)
                k = int(xp.argmax(x))
                lp = float(-xp.log(xp.exp(x - x[k]).sum()))
                if record:
                    frames[t].append((k, lp))
                if k == blank:
                    break
                labels.append(k)
                times.append(t)
                score += lp
                state = new_state
                last = np.array([k], dtype=np.int64)
                g = None
                emitted += 1
        hyps.append(Hypothesis(np.array(labels, dtype=np.int64), np.array(times, dtype=np.int64),
                               score, frames))
    return hyps
