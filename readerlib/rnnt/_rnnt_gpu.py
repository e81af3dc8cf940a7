"""GPU kernel set for the batched RNN-T decoders (CuPy RawKernels from ``cuda/rnnt.cu``).

Design:
    Same methods and arguments as ``decode._CpuKernels`` so ``decode.py``
    drives both with one control flow.  Differences: ``compact`` is False
    (rows are always ``arange(B)``; masks select), and each step method returns
    0 or 1, read from a device flag that the kernel raises when some row needs
    more work.  Label looping reads it once per label column (after the first
    search, which also reports whether any row was active, so the store step
    needs no read) plus once per extra search window; frame looping once per
    inner step.  Launches are otherwise asynchronous on the current stream.

    The module is compiled lazily by NVRTC (``cupy.RawModule``) with
    ``#line 1 "<file>"`` prepended so compiler errors name the real file, and
    memoized per device.  Importing this file needs neither CuPy nor a GPU.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from ..gpu import require_cupy

__all__ = ["GpuKernels", "get_kernel", "source"]

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "rnnt.cu")
_THREADS = 256  # RNNT_THREADS in rnnt.cu
_MAX_BLOCKS = 65535
_lock = threading.Lock()
_modules = {}
_kernels = {}


def source():
    """The CUDA source as compiled (with its ``#line`` marker)."""
    with open(_SRC, encoding="utf-8") as f:
        return '#line 1 "%s"\n' % _SRC.replace("\\", "/") + f.read()


def get_kernel(name):
    """Kernel ``name`` (an ``extern "C"`` symbol of rnnt.cu) on the current device."""
    cp = require_cupy()
    dev = cp.cuda.runtime.getDevice()
    fn = _kernels.get((dev, name))
    if fn is None:
        with _lock:
            mod = _modules.get(dev)
            if mod is None:
                mod = _modules[dev] = cp.RawModule(code=source())
            fn = _kernels.setdefault((dev, name), mod.get_function(name))
    return fn


_SUFFIX = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.int64): "int64"}


def _suffix(a):
    try:
        return _SUFFIX[np.dtype(a.dtype)]
    except KeyError:
        raise TypeError(f"no CUDA kernel for dtype {a.dtype}") from None


class GpuKernels:
    """Fused bookkeeping kernels on CuPy arrays (see ``cuda/rnnt.cu``)."""

    compact = False
    deferred_active = True

    def __init__(self):
        self.cp = require_cupy()
        self._any_active = True

    def prepare(self, B):
        # flag[0]: some row needs more work; flag[1]: some row was processed
        self.flag = self.cp.zeros(2, dtype=np.int32)

    def _read_flag(self):
        # the one device -> host read per loop iteration (8 bytes)
        f = self.flag.get()
        self._any_active = bool(f[1])
        return int(f[0])

    def any_active(self):
        """After a ``first`` joint step: were any rows active?"""
        return self._any_active

    def ll_joint_step(self, S, buf, logits, rows, window, first):
        cp = self.cp
        logits = cp.ascontiguousarray(logits)
        n = rows.shape[0]
        self.flag.fill(0)
        get_kernel("loop_labels_joint_step_" + _suffix(logits))(
            (min(n, _MAX_BLOCKS),), (_THREADS,),
            (logits, cp.int64(logits.shape[1]), rows, cp.int64(n), cp.int64(window), cp.int32(bool(first)),
             cp.int64(S.blank), S.labels, S.scores, S.time, S.time_cur, S.safe_time, S.lengths,
             S.active, S.advance, cp.int32(bool(buf.record)), buf.al_labels, buf.al_times, buf.al_logp,
             buf.al_len, cp.int64(buf.al_labels.shape[1]), self.flag))
        return self._read_flag()

    def ll_store(self, S, buf, rows, max_symbols):
        cp = self.cp
        n = rows.shape[0]
        self.flag.fill(0)
        blocks = min((n + _THREADS - 1) // _THREADS, _MAX_BLOCKS)
        get_kernel("loop_labels_store")(
            (blocks,), (_THREADS,),
            (rows, cp.int64(n), cp.int64(max_symbols), S.labels, S.scores, S.time, S.time_cur,
             S.safe_time, S.lengths, S.active, buf.hyp_labels, buf.hyp_times, buf.hyp_len,
             cp.int64(buf.hyp_labels.shape[1]), buf.hyp_score, S.last_ts, S.ts_count, self.flag))
        # not read: whether anything is still active is learnt from the next
        # first joint step's flag[1], so a label column costs one read, not two
        return 1

    def fl_joint_step(self, S, buf, logits, t):
        cp = self.cp
        logits = cp.ascontiguousarray(logits)
        B = logits.shape[0]
        self.flag.fill(0)
        get_kernel("loop_frames_joint_step_" + _suffix(logits))(
            (min(B, _MAX_BLOCKS),), (_THREADS,),
            (logits, cp.int64(logits.shape[1]), cp.int64(B), cp.int64(t), cp.int64(S.blank), S.done,
             S.last_label, S.emitted, buf.hyp_labels, buf.hyp_times, buf.hyp_len,
             cp.int64(buf.hyp_labels.shape[1]), buf.hyp_score, cp.int32(bool(buf.record)),
             buf.al_labels, buf.al_times, buf.al_logp, buf.al_len, cp.int64(buf.al_labels.shape[1]),
             self.flag))
        return self._read_flag()

    def masked_replace_rows(self, dst, src, mask):
        cp = self.cp
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"masked_replace_rows: {dst.shape}/{dst.dtype} vs {src.shape}/{src.dtype}")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError("masked_replace_rows needs C-contiguous state arrays")
        B = dst.shape[0]
        K = dst.size // B if B else 0
        total = B * K
        if total == 0:
            return
        blocks = min((total + _THREADS - 1) // _THREADS, _MAX_BLOCKS)
        get_kernel("masked_replace_rows_" + _suffix(dst))(
            (blocks,), (_THREADS,), (dst, src, mask, cp.int64(B), cp.int64(K)))
