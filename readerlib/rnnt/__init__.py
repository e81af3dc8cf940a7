"""Batched greedy RNN-T decoding (loop frames, loop labels) for NeMo-compatible models.

Public names: :func:`rnnt_greedy_decode`, :class:`Hypothesis`, :class:`RNNTModel`,
:class:`LSTMPredictor`, :class:`StatelessPredictor`, :class:`Joint`.
"""
from .decode import ALGORITHMS, Hypothesis, rnnt_greedy_decode
from .models import Joint, LSTMPredictor, RNNTModel, StatelessPredictor

__all__ = ["rnnt_greedy_decode", "Hypothesis", "ALGORITHMS", "RNNTModel", "LSTMPredictor",
           "StatelessPredictor", "Joint"]
