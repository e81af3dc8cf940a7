"""Dry-run the GPU tests on the NumPy stand-in for CuPy with the NumPy kernel emulators.

    PYTHONPATH=tests python -m pytest tests/gpu/test_gpu_kernels.py --noconftest -p fake_gpu_plugin

Swaps the ``xp_gpu`` fixture for tests/support/fake_cupy.py with ``run_cuda=False``: kernels
are checked against their real signatures, then their contract is emulated in NumPy,
so a mistake in a GPU test or launcher shows up on its own.  Passing here says nothing
about the CUDA kernels themselves; the normal run (tests/conftest.py) executes them
on the CPU emulator when there is no GPU.
"""
import pytest

import fake_cupy as fc


@pytest.fixture
def xp_gpu(monkeypatch):
    return fc.install(monkeypatch, run_cuda=False)
