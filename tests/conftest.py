import os

import pytest

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
        _HAS_GPU = cupy_available()
    return _HAS_GPU


def pytest_collection_modifyitems(config, items):
    """GPU tests are marked `gpu` and skipped when CuPy or a GPU is missing."""
    # get_closest_marker, not `"gpu" in item.keywords`: keywords also hold
    # directory names, and a checkout in a folder named gpu would skip everything.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not has_gpu():
        skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def xp_gpu():
    """The cupy module (GPU tests only)."""
    import cupy
    return cupy
