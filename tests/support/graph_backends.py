"""The two implementations the graph tests run against: readerlib.graph and,
when installed, TensorFlow's tf.compat.v1 (graph mode).  A test body takes a
backend ``B`` and uses only names both have, so the same body checks that
readerlib agrees with TensorFlow."""
import os
import types

import numpy as np
import pytest

import readerlib.graph as rg

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def rl_backend():
    return types.SimpleNamespace(
        name="rl", Graph=rg.Graph, Session=rg.Session, constant=rg.constant,
        placeholder=rg.placeholder, identity=rg.identity, add=rg.add, no_op=rg.no_op,
        errors=rg.errors, GraphKeys=rg.GraphKeys, get_default_graph=rg.get_default_graph,
        gradients=rg.gradients, RegisterGradient=rg.RegisterGradient,
        import_graph_def=rg.import_graph_def,
        InaccessibleTensorError=rg.InaccessibleTensorError,
        ctc_greedy_decoder_raw=lambda logits, seq_len, merge_repeated=True, blank_index=-1:
            rg.ctc_greedy_decoder(logits, seq_len, merge_repeated=merge_repeated,
                                  blank_index=blank_index),
    )


_tf = None


def tf_backend():
    global _tf
    tf = pytest.importorskip("tensorflow")
    if _tf is None:
        from tensorflow.python.framework.errors_impl import InaccessibleTensorError  # noqa
        v1 = tf.compat.v1
        _tf = types.SimpleNamespace(
            name="tf", Graph=tf.Graph, Session=v1.Session, constant=tf.constant,
            placeholder=v1.placeholder, identity=tf.identity, add=tf.add, no_op=tf.no_op,
            errors=tf.errors, GraphKeys=v1.GraphKeys, get_default_graph=v1.get_default_graph,
            gradients=v1.gradients, RegisterGradient=tf.RegisterGradient,
            import_graph_def=v1.import_graph_def, InaccessibleTensorError=InaccessibleTensorError,
            ctc_greedy_decoder_raw=lambda logits, seq_len, merge_repeated=True, blank_index=-1:
                tf.raw_ops.CTCGreedyDecoder(inputs=logits, sequence_length=seq_len,
                                            merge_repeated=merge_repeated,
                                            blank_index=blank_index),
            tf=tf,
        )
    return _tf


@pytest.fixture(params=["rl", "tf"])
def B(request):
    """Each test body runs on readerlib.graph, then on tf.compat.v1 when installed."""
    return rl_backend() if request.param == "rl" else tf_backend()


def as_np_dtype(dtype):
    """A backend's dtype as a NumPy dtype (TF DType or NumPy)."""
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
