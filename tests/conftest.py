import os

import pytest

from readerlib.gpu import cupy_available

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
