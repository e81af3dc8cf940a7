"""Dry-run the GPU tests on the NumPy stand-in for CuPy (checks the test code, not CUDA).

    PYTHONPATH=tests python -m pytest tests/test_gpu_kernels.py --noconftest -p fake_gpu_plugin

Swaps the ``xp_gpu`` fixture for tests/fake_cupy.py (kernels checked against
their real signatures, then emulated in NumPy), so a mistake in a GPU test or
launcher shows up before any device time is spent.  Passing here says nothing
about the CUDA kernels themselves.
"""
import contextlib
import threading

import numpy as np
import pytest

import fake_cupy as fc
import readerlib.tensor as _tensor
from readerlib import gpu as _rl_gpu
from readerlib.kernels import _cuda_loader, _gpu

_signatures = None
_array_module = _tensor._array_module
fc.FakeArray.__module__ = "cupy._fake"   # readerlib treats it as a device array


@pytest.fixture
def xp_gpu(monkeypatch):
    global _signatures
    if _signatures is None:
        _signatures = {n: fc.kernel_signatures(_cuda_loader.read_source(n))
                       for n in _cuda_loader.cuda_sources()}
    mod = fc.make_module()
    mod.launches = []
    mod.arange = lambda *a, **k: fc._fake(np.arange(*a, **k))
    mod.ones = lambda *a, **k: fc._fake(np.ones(*a, **k))
    mod.float32 = np.float32
    mod.diff = lambda a: fc._fake(np.diff(np.asarray(a)))
    mod.nonzero = lambda a: tuple(fc._fake(i) for i in np.nonzero(np.asarray(a)))
    mod.cuda.Stream = lambda non_blocking=False: contextlib.nullcontext()
    monkeypatch.setattr(_rl_gpu, "_cupy", mod)
    monkeypatch.setattr(_gpu, "get_kernel", fc.make_get_kernel(_signatures, mod.launches))
    monkeypatch.setattr(_gpu, "_sm_counts", {})
    monkeypatch.setattr(_gpu, "_local", threading.local())
    monkeypatch.setattr(_tensor, "_array_module",
                        lambda a: mod if isinstance(a, fc.FakeArray) else _array_module(a))
    return mod
