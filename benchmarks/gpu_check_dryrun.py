#!/usr/bin/env python
"""Run benchmarks/gpu_check.py without a GPU, on the NumPy stand-in for CuPy, with tiny shapes.

    python benchmarks/gpu_check_dryrun.py

Checks the script's own logic (sections, tables, peers, cross-checks, output
files) before device time is spent on it.  Kernels run on the CPU emulator
(tests/support/cuda_emu) and "torch" is the CPU build if installed: every number it prints
is meaningless; the equality rows are real checks of the CUDA code.
"""
import os
import sys
import tempfile
import threading
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "benchmarks")]

import numpy as np  # noqa: E402

import fake_cupy as fc  # noqa: E402
import readerlib.tensor as tensor  # noqa: E402
from readerlib import gpu as rl_gpu  # noqa: E402
from readerlib.kernels import _cuda_loader, _gpu  # noqa: E402


def install_fake_cupy():
    import pytest
    # fc.install: the stand-in module (NumPy behind every other cupy.* name), the
    # real kernels on the CPU emulator (tests/support/cuda_emu), readerlib pointed at it;
    # never undone (one process).
    cp = fc.install(pytest.MonkeyPatch(), run_cuda=True)
    cp.__version__ = "stand-in"
    rng = np.random.default_rng(0)
    cp.random = types.SimpleNamespace(
        standard_normal=lambda shape, dtype=float: fc._fake(rng.standard_normal(shape).astype(dtype)),
        randint=lambda lo, hi, size, dtype=np.int64: fc._fake(rng.integers(lo, hi, size).astype(dtype)))
    cp.take = lambda a, i, axis=0: fc._fake(np.take(np.asarray(a), np.asarray(i), axis=axis))
    cp.full = lambda shape, v, dtype=None: fc._fake(np.full(shape, v, dtype=dtype))
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)

    class Event:
        def __init__(self, *a, **k):
            self.t = 0.0

        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    cp.cuda.Event = Event
    cp.cuda.get_elapsed_time = lambda a, b: (b.t - a.t) * 1e3
    cp.cuda.runtime = types.SimpleNamespace(**{k: getattr(cp.cuda.runtime, k) for k in dir(cp.cuda.runtime)
                                               if not k.startswith("__")})
    cp.cuda.runtime.deviceSynchronize = lambda: None
    cp.cuda.runtime.getDeviceProperties = \
        lambda d: {"name": b"stand-in", "multiProcessorCount": 4, "l2CacheSize": 1 << 20}
    fc._Ptr.copy_from_device_async = lambda self, src, n, stream=None: None
    try:
        import torch
        zeros = torch.zeros
        torch.zeros = lambda *a, device=None, **k: zeros(*a, **k)   # "cuda" -> CPU
    except ImportError:
        pass


def main():
    install_fake_cupy()
    import gpu_check
    gpu_check.REINDEX_SHAPES = ((40, 80, 20), (100, 100, 4), (3, 5, 1000))
    gpu_check.CTC_SHAPES = ((20, 3, 11), (10, 8, 5), (30, 2, 51), (30, 4, 51))
    gpu_check.COPY_BYTES = 1 << 20
    gpu_check.RNNT_SHAPE = (4, 50)
    out = tempfile.mkdtemp(prefix="gpu_check_dryrun_")
    sys.argv = ["gpu_check.py", "--skip-tests", "--budget", "0.05", "--out", out]
    rc = gpu_check.main()
    print(f"dry run: gpu_check exited {rc}; outputs in {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
