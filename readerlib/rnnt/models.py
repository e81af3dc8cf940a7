"""RNN-T prediction and joint networks in NumPy / CuPy (no PyTorch needed).

The networks mirror NVIDIA NeMo's ``RNNTDecoder`` (LSTM prediction network),
``StatelessTransducerDecoder`` (concatenated label embeddings) and
``RNNTJoint`` closely enough that a NeMo checkpoint's tensors load unchanged
(:meth:`RNNTModel.from_nemo_state_dict`).  Only inference is implemented:
no dropout, no training-time state.

Every array of a model lives in one array module (NumPy or CuPy) and has one
float dtype (float32 or float64); :meth:`RNNTModel.to` moves a model.

Decoder state is *batch-major*: every state array has the batch on axis 0 and
is C-contiguous, so "select rows" and "replace rows under a mask" are plain
row operations, done by the same kernels for every predictor
(``h, c : [B, num_layers, hidden]`` for the LSTM, ``context : [B, C-1]`` int64
for the stateless net).
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["LSTMPredictor", "StatelessPredictor", "Joint", "RNNTModel"]


from ..gpu import array_module as _xp_of  # noqa: E402


def _float_dtype(dtype):
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"model dtype must be float32 or float64, got {dt}")
    return dt


def _sigmoid(xp, x):
    # 0.5 * (1 + tanh(x / 2)) never overflows, unlike 1 / (1 + exp(-x))
    return 0.5 * (1.0 + xp.tanh(0.5 * x))


def _activation(name):
    if name not in ("relu", "tanh", "sigmoid"):
        raise ValueError(f"joint activation must be 'relu', 'tanh' or 'sigmoid', got {name!r}")
    return name


class LSTMPredictor:
    """NeMo's ``RNNTDecoder`` prediction network: embedding then stacked LSTM.

    Parameters
    ----------
    embedding : array ``[vocab + 1, E]``
        ``prediction.embed.weight``.  The row of ``blank_index`` is treated as
        zeros whatever it holds (NeMo's ``padding_idx``): blank embeds to zeros
        and doubles as the start symbol.
    weights_ih, weights_hh : list of arrays ``[4H, in]``, ``[4H, H]``
        One per layer, PyTorch gate order i, f, g, o.
    biases_ih, biases_hh : list of arrays ``[4H]``
    blank_index : int
    dtype : float32 or float64, optional
        Defaults to the embedding's dtype.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> p = LSTMPredictor.random(vocab_size=5, hidden=4, num_layers=1, rng=rng)
    >>> out, st = p.step(np.array([5, 2]), p.initial_state(2))
    >>> out.shape, st[0].shape
    ((2, 4), (2, 1, 4))
    """

    def __init__(self, embedding, weights_ih, weights_hh, biases_ih, biases_hh,
                 blank_index, dtype=None):
        xp = _xp_of(embedding)
        dt = _float_dtype(dtype if dtype is not None else embedding.dtype)
        emb = xp.array(embedding, dtype=dt, copy=True)
        if not 0 <= blank_index < emb.shape[0]:
            raise ValueError(f"blank_index {blank_index} is outside the embedding's {emb.shape[0]} rows")
        emb[blank_index] = 0
        self.xp = xp
        self.dtype = dt
        self.blank_index = int(blank_index)
        self.embedding = emb
        self.num_layers = len(weights_ih)
        if not (len(weights_hh) == len(biases_ih) == len(biases_hh) == self.num_layers >= 1):
            raise ValueError("weights_ih, weights_hh, biases_ih, biases_hh need one entry per layer")
        self.hidden = int(weights_hh[0].shape[1])
        # One matmul per layer: [x, h] @ [W_ih, W_hh]^T, stored transposed and contiguous.
        self._w = []
        self._b = []
        for k in range(self.num_layers):
            w = xp.concatenate([xp.asarray(weights_ih[k], dtype=dt), xp.asarray(weights_hh[k], dtype=dt)], axis=1)
            self._w.append(xp.ascontiguousarray(w.T))
            self._b.append(xp.asarray(biases_ih[k], dtype=dt) + xp.asarray(biases_hh[k], dtype=dt))
        self._params = (embedding, weights_ih, weights_hh, biases_ih, biases_hh)

    @classmethod
    def random(cls, vocab_size, hidden, num_layers=1, embed_dim=None, blank_index=None,
               dtype=np.float32, rng=None, scale=None):
        """A randomly initialised predictor (PyTorch's uniform(-1/sqrt(H), 1/sqrt(H)))."""
        rng = np.random.default_rng(rng)
        embed_dim = hidden if embed_dim is None else embed_dim
        blank_index = vocab_size if blank_index is None else blank_index
        s = 1.0 / np.sqrt(hidden) if scale is None else scale
        emb = rng.standard_normal((vocab_size + 1, embed_dim))
        wi, wh, bi, bh = [], [], [], []
        for k in range(num_layers):
            n_in = embed_dim if k == 0 else hidden
            wi.append(rng.uniform(-s, s, (4 * hidden, n_in)))
            wh.append(rng.uniform(-s, s, (4 * hidden, hidden)))
            bi.append(rng.uniform(-s, s, 4 * hidden))
            bh.append(rng.uniform(-s, s, 4 * hidden))
        return cls(emb.astype(dtype), [w.astype(dtype) for w in wi], [w.astype(dtype) for w in wh],
                   [b.astype(dtype) for b in bi], [b.astype(dtype) for b in bh], blank_index)

    @property
    def output_size(self):
        return self.hidden

    def to(self, xp=None, dtype=None):
        """A copy on another array module (numpy / cupy) and/or dtype."""
        xp = self.xp if xp is None else xp
        dtype = self.dtype if dtype is None else dtype
        conv = (lambda a: xp.asarray(_to_host(a), dtype=dtype))
        emb, wi, wh, bi, bh = self._params
        return LSTMPredictor(conv(emb), [conv(w) for w in wi], [conv(w) for w in wh],
                             [conv(b) for b in bi], [conv(b) for b in bh], self.blank_index, dtype)

    def initial_state(self, batch):
        """Zero state ``(h, c)``, each ``[batch, num_layers, hidden]``."""
        z = self.xp.zeros((batch, self.num_layers, self.hidden), dtype=self.dtype)
        return (z, z.copy())

    def step(self, labels, state):
        """One prediction step for a batch.

        Parameters
        ----------
        labels : int array ``[B]``
            The last emitted label of each row (blank = start symbol).
        state : tuple ``(h, c)``

        Returns
        -------
        output : array ``[B, hidden]``
        new_state : tuple ``(h, c)`` (new arrays; ``state`` is not modified)
        """
        xp = self.xp
        h, c = state
        x = self.embedding[labels]
        new_h = xp.empty_like(h)
        new_c = xp.empty_like(c)
        H = self.hidden
        for k in range(self.num_layers):
            gates = xp.concatenate([x, h[:, k]], axis=1) @ self._w[k]
            gates += self._b[k]
            i = _sigmoid(xp, gates[:, :H])
            f = _sigmoid(xp, gates[:, H:2 * H])
            g = xp.tanh(gates[:, 2 * H:3 * H])
            o = _sigmoid(xp, gates[:, 3 * H:])
            ck = f * c[:, k] + i * g
            hk = o * xp.tanh(ck)
            new_c[:, k] = ck
            new_h[:, k] = hk
            x = hk
        return x, (new_h, new_c)


class StatelessPredictor:
    """NeMo's ``StatelessTransducerDecoder``: concatenated embeddings of the last labels.

    Output for a step is ``concat(embeds[0][y_t], embeds[1][y_{t-1}], ...)``
    (most recent label first), optionally layer-normalised without affine
    parameters (NeMo's ``normalization_mode='layer'``).  The state is the
    ``context_size - 1`` previous labels, ``[B, context_size - 1]`` int64,
    blank-filled at the start.

    Parameters
    ----------
    embeddings : list of arrays ``[vocab + 1, E_i]``
        ``prediction.embeds.{i}.weight``; blank rows are treated as zeros.
    blank_index : int
    normalization : {None, 'layer'}
    dtype : float32 or float64, optional
    """

    def __init__(self, embeddings, blank_index, normalization=None, dtype=None):
        if not embeddings:
            raise ValueError("StatelessPredictor needs at least one embedding (context_size >= 1)")
        xp = _xp_of(embeddings[0])
        dt = _float_dtype(dtype if dtype is not None else embeddings[0].dtype)
        if normalization not in (None, "layer"):
            raise ValueError(f"normalization must be None or 'layer', got {normalization!r}")
        self.xp = xp
        self.dtype = dt
        self.blank_index = int(blank_index)
        self.normalization = normalization
        self.context_size = len(embeddings)
        self.embeddings = []
        for e in embeddings:
            e = xp.array(e, dtype=dt, copy=True)
            if e.shape[0] != embeddings[0].shape[0]:
                raise ValueError("all stateless embeddings need the same number of rows")
            e[self.blank_index] = 0
            self.embeddings.append(e)
        self._params = embeddings

    @classmethod
    def random(cls, vocab_size, embed_dim, context_size=2, blank_index=None, normalization=None,
               dtype=np.float32, rng=None):
        """Random embeddings split as NeMo does (half the width to the most recent label)."""
        rng = np.random.default_rng(rng)
        blank_index = vocab_size if blank_index is None else blank_index
        embs = []
        for i in range(context_size):
            if i:
                size = embed_dim // 2 // context_size
            else:
                size = embed_dim - (embed_dim // 2 // context_size) * (context_size - 1)
            embs.append(rng.standard_normal((vocab_size + 1, size)).astype(dtype))
        return cls(embs, blank_index, normalization)

    @property
    def output_size(self):
        return sum(int(e.shape[1]) for e in self.embeddings)

    def to(self, xp=None, dtype=None):
        """A copy on another array module (numpy / cupy) and/or dtype."""
        xp = self.xp if xp is None else xp
        dtype = self.dtype if dtype is None else dtype
        return StatelessPredictor([xp.asarray(_to_host(e), dtype=dtype) for e in self._params],
                                  self.blank_index, self.normalization, dtype)

    def initial_state(self, batch):
        """``(context,)`` with ``context`` ``[batch, context_size - 1]`` filled with blank."""
        return (self.xp.full((batch, self.context_size - 1), self.blank_index, dtype=np.int64),)

    def step(self, labels, state):
        """One step; see :meth:`LSTMPredictor.step`."""
        xp = self.xp
        (ctx,) = state
        labels = labels.astype(np.int64, copy=False)
        full = xp.concatenate([ctx, labels[:, None]], axis=1)  # oldest ... newest
        C = self.context_size
        out = xp.concatenate([self.embeddings[i][full[:, C - 1 - i]] for i in range(C)], axis=1)
        if self.normalization == "layer":
            mu = out.mean(axis=1, keepdims=True)
            var = out.var(axis=1, keepdims=True)
            out = (out - mu) / xp.sqrt(var + 1e-5)
        return out, (xp.ascontiguousarray(full[:, 1:]),)


class Joint:
    """NeMo's ``RNNTJoint`` split into projections and the post-projection part.

    ``joint(f, g) = joint_after_projection(project_encoder(f), project_prednet(g))``
    with ``joint_after_projection(f, g) = Linear(activation(f + g))``.  The
    encoder output is projected once per utterance; the decoders then only
    pay for ``joint_after_projection`` per step.

    Parameters
    ----------
    enc_weight, enc_bias : ``[J, H_enc]``, ``[J]``  (``enc.weight``, ``enc.bias``)
    pred_weight, pred_bias : ``[J, H_pred]``, ``[J]``  (``pred.weight``, ``pred.bias``)
    out_weight, out_bias : ``[V + 1, J]``, ``[V + 1]``  (``joint_net.{i}.weight/bias``)
    activation : {'relu', 'tanh', 'sigmoid'}
    dtype : float32 or float64, optional
    """

    def __init__(self, enc_weight, enc_bias, pred_weight, pred_bias, out_weight, out_bias,
                 activation="relu", dtype=None):
        xp = _xp_of(enc_weight)
        dt = _float_dtype(dtype if dtype is not None else enc_weight.dtype)
        self.xp = xp
        self.dtype = dt
        self.activation = _activation(activation)
        c = (lambda a: xp.ascontiguousarray(xp.asarray(a, dtype=dt)))
        self._enc_wt, self._enc_b = c(xp.asarray(enc_weight).T), c(enc_bias)
        self._pred_wt, self._pred_b = c(xp.asarray(pred_weight).T), c(pred_bias)
        self._out_wt, self._out_b = c(xp.asarray(out_weight).T), c(out_bias)
        self.num_classes_with_blank = int(out_weight.shape[0])
        self._params = (enc_weight, enc_bias, pred_weight, pred_bias, out_weight, out_bias)

    @classmethod
    def random(cls, encoder_dim, pred_dim, joint_dim, num_classes_with_blank, activation="relu",
               dtype=np.float32, rng=None):
        """Random weights, PyTorch Linear's uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        rng = np.random.default_rng(rng)

        def lin(n_out, n_in):
            s = 1.0 / np.sqrt(n_in)
            return rng.uniform(-s, s, (n_out, n_in)).astype(dtype), rng.uniform(-s, s, n_out).astype(dtype)
        ew, eb = lin(joint_dim, encoder_dim)
        pw, pb = lin(joint_dim, pred_dim)
        ow, ob = lin(num_classes_with_blank, joint_dim)
        return cls(ew, eb, pw, pb, ow, ob, activation)

    def to(self, xp=None, dtype=None):
        """A copy on another array module (numpy / cupy) and/or dtype."""
        xp = self.xp if xp is None else xp
        dtype = self.dtype if dtype is None else dtype
        return Joint(*[xp.asarray(_to_host(a), dtype=dtype) for a in self._params],
                     activation=self.activation, dtype=dtype)

    def project_encoder(self, f):
        """``enc`` Linear: ``[..., H_enc] -> [..., J]``."""
        return f @ self._enc_wt + self._enc_b

    def project_prednet(self, g):
        """``pred`` Linear: ``[..., H_pred] -> [..., J]``."""
        return g @ self._pred_wt + self._pred_b

    def joint_after_projection(self, f, g):
        """``Linear(activation(f + g))`` on projected inputs -> logits ``[..., V + 1]``."""
        xp = self.xp
        z = f + g
        if self.activation == "relu":
            xp.maximum(z, 0, out=z)
        elif self.activation == "tanh":
            xp.tanh(z, out=z)
        else:
            z = _sigmoid(xp, z)
        out = z @ self._out_wt
        out += self._out_b
        return out

    def joint(self, f, g):
        """Logits from unprojected encoder and prediction outputs."""
        return self.joint_after_projection(self.project_encoder(f), self.project_prednet(g))


def _to_host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


_LSTM_RE = re.compile(r"^prediction\.dec_rnn\.lstm\.(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)$")
_EMBEDS_RE = re.compile(r"^prediction\.embeds\.(\d+)\.weight$")
_JOINT_NET_RE = re.compile(r"^joint_net\.(\d+)\.(weight|bias)$")


class RNNTModel:
    """An RNN-T model for decoding: prediction network + joint + blank index.

    Parameters
    ----------
    predictor : LSTMPredictor or StatelessPredictor
    joint : Joint
    blank_index : int
        Must equal the predictor's blank index (the start symbol).

    Examples
    --------
    >>> m = RNNTModel.random(vocab_size=8, encoder_dim=6, pred_dim=5, joint_dim=4, rng=0)
    >>> m.blank_index, m.joint.num_classes_with_blank
    (8, 9)
    """

    def __init__(self, predictor, joint, blank_index):
        if predictor.blank_index != blank_index:
            raise ValueError(f"predictor blank index {predictor.blank_index} != model blank index {blank_index}")
        if not 0 <= blank_index < joint.num_classes_with_blank:
            raise ValueError(f"blank_index {blank_index} outside the joint's {joint.num_classes_with_blank} outputs")
        if predictor.xp is not joint.xp or predictor.dtype != joint.dtype:
            raise ValueError("predictor and joint must share one array module and dtype (use .to())")
        self.predictor = predictor
        self.joint = joint
        self.blank_index = int(blank_index)

    @property
    def xp(self):
        return self.joint.xp

    @property
    def dtype(self):
        return self.joint.dtype

    def to(self, xp=None, dtype=None):
        """A copy of the model on ``xp`` (numpy or cupy) and/or ``dtype``."""
        return RNNTModel(self.predictor.to(xp, dtype), self.joint.to(xp, dtype), self.blank_index)

    @classmethod
    def random(cls, vocab_size, encoder_dim, pred_dim, joint_dim, num_layers=1, predictor="lstm",
               context_size=2, activation="relu", blank_bias=0.0, dtype=np.float32, rng=None):
        """A random model (blank last); ``blank_bias`` is added to the blank logit's bias."""
        rng = np.random.default_rng(rng)
        if predictor == "lstm":
            pred = LSTMPredictor.random(vocab_size, pred_dim, num_layers, dtype=dtype, rng=rng)
        elif predictor == "stateless":
            pred = StatelessPredictor.random(vocab_size, pred_dim, context_size, dtype=dtype, rng=rng)
        else:
            raise ValueError(f"predictor must be 'lstm' or 'stateless', got {predictor!r}")
        joint = Joint.random(encoder_dim, pred.output_size, joint_dim, vocab_size + 1, activation, dtype, rng)
        if blank_bias:
            b = np.array(joint._params[5], dtype=dtype, copy=True)
            b[vocab_size] += blank_bias
            p = list(joint._params)
            p[5] = b
            joint = Joint(*p, activation=activation)
        return cls(pred, joint, vocab_size)

    @classmethod
    def from_nemo_state_dict(cls, state_dict, blank_index=None, activation="relu",
                             normalization=None, dtype=None, xp=None):
        """Build a model from NeMo parameter names.

        ``state_dict`` maps names to arrays (NumPy, CuPy, or anything with
        ``__array__``, e.g. CPU torch tensors) from a NeMo RNN-T model's
        ``decoder.state_dict()`` and ``joint.state_dict()`` merged, or from the
        whole model: when names carry ``decoder.`` / ``joint.`` prefixes, those
        entries are used (prefix stripped) and the rest (``encoder.*`` ...)
        ignored.

        LSTM prediction network: ``prediction.embed.weight`` and
        ``prediction.dec_rnn.lstm.{weight_ih,weight_hh,bias_ih,bias_hh}_l{k}``.
        Stateless: ``prediction.embeds.{i}.weight``.  Joint: ``enc.{weight,bias}``,
        ``pred.{weight,bias}`` and ``joint_net.{i}.{weight,bias}`` (the final
        Linear; ``i`` is 1 or 2 depending on dropout in NeMo).

        Parameters
        ----------
        state_dict : mapping str -> array
        blank_index : int, optional
            Defaults to ``vocab_size`` (NeMo puts blank last).
        activation : {'relu', 'tanh', 'sigmoid'}
        normalization : {None, 'layer'}
            Stateless predictor only.
        dtype : float32 or float64, optional
            Defaults to the embedding's dtype (float32 unless float64).
        xp : module, optional
            numpy (default) or cupy.

        Raises
        ------
        ValueError
            Listing every unknown, missing or wrongly shaped parameter.
        """
        xp = np if xp is None else xp
        sd = {}
        # A whole model's dict (decoder.* / joint.* next to encoder.*, preprocessor.*, ...):
        # keep the decoder and joint, drop the prefixes.
        whole = any(k.startswith(("decoder.", "joint.")) for k in state_dict)
        for name, value in state_dict.items():
            if whole:
                if not name.startswith(("decoder.", "joint.")):
                    continue
                name = name.split(".", 1)[1]
            sd[name] = _to_host(value.detach().cpu().numpy() if hasattr(value, "detach") else value)

        problems = []
        unknown = []
        lstm = {}
        embeds = {}
        joint_net = {}
        for name in sd:
            m = _LSTM_RE.match(name)
            if m:
                lstm[(m.group(1), int(m.group(2)))] = name
                continue
            m = _EMBEDS_RE.match(name)
            if m:
                embeds[int(m.group(1))] = name
                continue
            m = _JOINT_NET_RE.match(name)
            if m:
                joint_net.setdefault(int(m.group(1)), {})[m.group(2)] = name
                continue
            if name not in ("prediction.embed.weight", "enc.weight", "enc.bias", "pred.weight", "pred.bias"):
                unknown.append(name)
        if unknown:
            problems.append("unknown parameters: " + ", ".join(sorted(unknown)))

        stateless = bool(embeds)
        if stateless and ("prediction.embed.weight" in sd or lstm):
            problems.append("both stateless (prediction.embeds.*) and LSTM (prediction.embed.weight, "
                            "prediction.dec_rnn.*) parameters given")

        def need(name, shape=None, ndim=None):
            if name not in sd:
                problems.append(f"missing parameter: {name}")
                return None
            a = sd[name]
            if ndim is not None and a.ndim != ndim:
                problems.append(f"{name}: expected {ndim} dimensions, got shape {tuple(a.shape)}")
                return None
            if shape is not None and tuple(a.shape) != tuple(shape):
                problems.append(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
                return None
            return a

        pred_out = None
        n_rows = None
        if stateless:
            C = max(embeds) + 1
            embs = []
            for i in range(C):
                a = need(f"prediction.embeds.{i}.weight", ndim=2)
                if a is not None:
                    if n_rows is None:
                        n_rows = a.shape[0]
                    elif a.shape[0] != n_rows:
                        problems.append(f"prediction.embeds.{i}.weight: expected {n_rows} rows, got {a.shape[0]}")
                    embs.append(a)
            pred_out = sum(e.shape[1] for e in embs) if len(embs) == C else None
        else:
            emb = need("prediction.embed.weight", ndim=2)
            n_rows = None if emb is None else emb.shape[0]
            layers = sorted({k for (_, k) in lstm})
            L = (max(layers) + 1) if layers else 0
            if L == 0:
                problems.append("missing parameter: prediction.dec_rnn.lstm.weight_ih_l0 (and its siblings)")
            H = None
            w_hh0 = sd.get("prediction.dec_rnn.lstm.weight_hh_l0")
            if w_hh0 is not None and w_hh0.ndim == 2:
                H = w_hh0.shape[1]
            wi, wh, bi, bh = [], [], [], []
            for k in range(L):
                n_in = (emb.shape[1] if emb is not None else None) if k == 0 else H
                wi.append(need(f"prediction.dec_rnn.lstm.weight_ih_l{k}",
                               (4 * H, n_in) if H is not None and n_in is not None else None, ndim=2))
                wh.append(need(f"prediction.dec_rnn.lstm.weight_hh_l{k}", (4 * H, H) if H else None, ndim=2))
                bi.append(need(f"prediction.dec_rnn.lstm.bias_ih_l{k}", (4 * H,) if H else None, ndim=1))
                bh.append(need(f"prediction.dec_rnn.lstm.bias_hh_l{k}", (4 * H,) if H else None, ndim=1))
            pred_out = H

        enc_w = need("enc.weight", ndim=2)
        J = None if enc_w is None else enc_w.shape[0]
        need("enc.bias", (J,) if J else None, ndim=1)
        need("pred.weight", (J, pred_out) if J and pred_out else None, ndim=2)
        need("pred.bias", (J,) if J else None, ndim=1)
        if len(joint_net) != 1:
            if not joint_net:
                problems.append("missing parameter: joint_net.{i}.weight / joint_net.{i}.bias (final Linear)")
            else:
                problems.append("expected one joint_net.{i} Linear, got indices "
                                + ", ".join(str(i) for i in sorted(joint_net)))
            out_name = None
        else:
            (i,) = joint_net
            out_name = f"joint_net.{i}"
            ow = need(out_name + ".weight", (n_rows, J) if n_rows and J else None, ndim=2)
            need(out_name + ".bias", (ow.shape[0],) if ow is not None else None, ndim=1)

        if problems:
            raise ValueError("NeMo state dict does not describe an RNN-T model:\n  " + "\n  ".join(problems))

        V1 = n_rows
        blank = V1 - 1 if blank_index is None else int(blank_index)
        dt = _float_dtype(dtype if dtype is not None else
                          (np.float64 if sd["enc.weight"].dtype == np.float64 else np.float32))
        a = (lambda name: xp.asarray(np.asarray(sd[name]), dtype=dt))
        if stateless:
            pred = StatelessPredictor([a(f"prediction.embeds.{i}.weight") for i in range(C)], blank,
                                      normalization, dt)
        else:
            pred = LSTMPredictor(a("prediction.embed.weight"),
                                 [a(f"prediction.dec_rnn.lstm.weight_ih_l{k}") for k in range(L)],
                                 [a(f"prediction.dec_rnn.lstm.weight_hh_l{k}") for k in range(L)],
                                 [a(f"prediction.dec_rnn.lstm.bias_ih_l{k}") for k in range(L)],
                                 [a(f"prediction.dec_rnn.lstm.bias_hh_l{k}") for k in range(L)], blank, dt)
        joint = Joint(a("enc.weight"), a("enc.bias"), a("pred.weight"), a("pred.bias"),
                      a(out_name + ".weight"), a(out_name + ".bias"), activation, dt)
        return cls(pred, joint, blank)

    def to_nemo_state_dict(self):
        """NumPy arrays under NeMo's parameter names (inverse of :meth:`from_nemo_state_dict`)."""
        out = {}
        p = self.predictor
        if isinstance(p, LSTMPredictor):
            emb, wi, wh, bi, bh = p._params
            out["prediction.embed.weight"] = _to_host(emb)
            for k in range(p.num_layers):
                out[f"prediction.dec_rnn.lstm.weight_ih_l{k}"] = _to_host(wi[k])
                out[f"prediction.dec_rnn.lstm.weight_hh_l{k}"] = _to_host(wh[k])
                out[f"prediction.dec_rnn.lstm.bias_ih_l{k}"] = _to_host(bi[k])
                out[f"prediction.dec_rnn.lstm.bias_hh_l{k}"] = _to_host(bh[k])
        else:
            for i, e in enumerate(p._params):
                out[f"prediction.embeds.{i}.weight"] = _to_host(e)
        ew, eb, pw, pb, ow, ob = self.joint._params
        out.update({"enc.weight": _to_host(ew), "enc.bias": _to_host(eb), "pred.weight": _to_host(pw),
                    "pred.bias": _to_host(pb), "joint_net.2.weight": _to_host(ow), "joint_net.2.bias": _to_host(ob)})
        return out
