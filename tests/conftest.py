import os
import sys

import pytest

# The tests' shared helpers (helpers.py, fake_cupy.py, the CUDA emulator, ...)
# live in tests/support; test files import them by bare name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

import readerlib
from readerlib.gpu import cupy_available

# Child interpreters started by tests (python -c ...) must import the readerlib
# under test -- the installed one in CI, the in-place build in development --
# never the uncompiled source tree that the current directory may hold.
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(readerlib.__file__)))
os.environ["PYTHONSAFEPATH"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_PKG_PARENT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

_HAS_GPU = None


def has_gpu():
    global _HAS_GPU
    if _HAS_GPU is None:
        # a sanitizer pass checks the emulated kernels, never CuPy's
        _HAS_GPU = not os.environ.get("RLEMU_SANITIZE") and cupy_available()
    return _HAS_GPU


def cuda_emulation():
    """Whether gpu tests marked cuda_emu run on the CPU emulator when there is no GPU:
    it needs g++ and cpp (tests/support/cuda_emu.py); READERLIB_TEST_CUDA_EMU=0 turns it off."""
    if os.environ.get("READERLIB_TEST_CUDA_EMU", "1") == "0":
        return False
    import cuda_emu
    return cuda_emu.available()


def pytest_report_header(config):
    if has_gpu():
        return "gpu tests: CuPy on a CUDA GPU"
    if cuda_emulation():
        return ("gpu tests: no GPU -- tests marked cuda_emu run the CUDA kernels on the CPU "
                "emulator (tests/support/cuda_emu); the other gpu tests are skipped")
    return "gpu tests: skipped (no GPU, no emulator)"


def pytest_collection_modifyitems(config, items):
    """GPU tests are marked `gpu` and skipped when CuPy or a GPU is missing -- except
    those also marked `cuda_emu`, which then run on the CPU emulator of the kernels."""
    # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold
    # directory names, and a checkout in a folder named gpu would skip everything.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or has_gpu():
        return
    emulate = cuda_emulation()
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in gpu_items:
        if not (emulate and item.get_closest_marker("cuda_emu") is not None):
            item.add_marker(skip)


@pytest.fixture
def xp_gpu(request, monkeypatch):
    """The cupy module (GPU tests only), or without a GPU the NumPy stand-in for it
    whose kernel launches execute the real CUDA code on the CPU (tests/support/fake_cupy.py)."""
    if has_gpu():
        import cupy
        return cupy
    assert request.node.get_closest_marker("cuda_emu") is not None, "not a cuda_emu test"
    import fake_cupy
    return fake_cupy.install(monkeypatch, run_cuda=True)
