"""Optional CuPy support: one place that imports it and says what to install,
and the one answer to "is this a CuPy array" / "which array module is it"."""
import numpy as np

__all__ = ["cupy_available", "require_cupy", "is_cupy_array", "array_module"]

_cupy = None


def cupy_available():
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        cp = require_cupy()
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def require_cupy():
    """Return the cupy module, or raise ImportError saying what to install."""
    global _cupy
    if _cupy is not None:
        return _cupy
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA runtime load failure
        raise ImportError(
            "this operation needs CuPy and a CUDA GPU: pip install 'readerlib[gpu]' "
            f"(cupy-cuda13x) on a machine with an NVIDIA driver ({type(e).__name__}: {e})") from e
    _cupy = cupy
    return cupy


def is_cupy_array(a):
    """True for a CuPy array (checked by type, without importing CuPy)."""
    return type(a).__module__.startswith("cupy")


def array_module(a):
    """numpy, or cupy for a CuPy array (imported only when one is seen)."""
    if is_cupy_array(a):
        return require_cupy()
    return np
