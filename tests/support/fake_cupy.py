"""A NumPy stand-in for CuPy that runs readerlib's GPU launchers without a GPU.

It lets the GPU tests (tests/gpu) execute readerlib's GPU path -- allocation,
views, launch geometry, status words, error selection, and the kernels
themselves -- on a machine with no CUDA driver.  Each RawKernel is replaced by

* a **signature check** against the kernel's real ``extern "C"`` parameter list,
  taken from the ``.cu`` source after the C preprocessor has expanded the wrapper
  macros: the argument count, pointer vs scalar, the scalar's width (``np.int32`` for
  ``int``, ``np.int64`` for ``i64``), the element dtype behind each pointer and its
  alignment (a 16-byte word kernel gets 16-byte aligned arrays);
* a **launch-shape check** (block <= 1024 threads, grid y <= 65535, nothing empty);
* the kernel's **real CUDA code**, compiled for the CPU by tests/support/cuda_emu.py
  (what tests/conftest.py's ``xp_gpu`` gives on a machine without a GPU): the
  GPU tests compare real kernel output with the CPU kernels and the NumPy
  reference (readerlib/kernels/reference.py).  What that still
does not test is the hardware: timing, memory races between blocks, NVRTC itself,
and the four inline-PTX helpers of common.cuh (their C++ twins run instead).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import types

import numpy as np

from readerlib.kernels import _cuda_loader

try:
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BFLOAT16 = None


# ---- arrays -----------------------------------------------------------------------

class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeArray(np.ndarray):
    """ndarray with CuPy's ``.data.ptr`` and ``.get()``."""

    @property
    def data(self):
        return _Ptr(self.__array_interface__["data"][0])

    def set(self, arr, stream=None):
        """Host -> "device" copy (synchronous here)."""
        arr = np.asarray(arr)
        assert arr.shape == self.shape and arr.dtype == self.dtype, (arr.shape, arr.dtype)
        np.copyto(np.asarray(self).view(np.ndarray), arr)

    def get(self, stream=None, order="C", out=None, blocking=True):
        host = np.asarray(self).view(np.ndarray)
        if out is None:
            return host.copy()
        assert isinstance(out, np.ndarray) and out.shape == self.shape and out.dtype == self.dtype
        np.copyto(out, host)
        return out


def _fake(a):
    return a.view(FakeArray)


def asarray(a, dtype=None):
    return _fake(np.asarray(a, dtype=dtype))


def ascontiguousarray(a, dtype=None):
    if isinstance(a, FakeArray) and a.flags.c_contiguous and (dtype is None or a.dtype == dtype):
        return a
    return _fake(np.ascontiguousarray(np.asarray(a), dtype=dtype))


def empty(shape, dtype=float):
    a = np.empty(shape, dtype=dtype)
    if a.size:
        a.view(np.uint8).reshape(-1)[:] = 0xA5  # poison: unwritten output shows
    return _fake(a)


def zeros(shape, dtype=float):
    return _fake(np.zeros(shape, dtype=dtype))


def cumsum(a, axis=None, dtype=None, out=None):
    return np.cumsum(np.asarray(a), axis=axis, dtype=dtype, out=out)


class _Event:
    def __init__(self, block=False, blocking=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Stream:
    """A CUDA stream: work on it runs at once here, so waiting is a no-op."""

    def __init__(self, non_blocking=False, null=False, ptr=0):
        self.ptr = ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_event(self, event):
        assert isinstance(event, _Event), type(event)

    def synchronize(self):
        pass


class _Runtime:
    memcpyDeviceToHost = 2

    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def memcpyAsync(dst, src, size, kind, stream):
        assert kind == _Runtime.memcpyDeviceToHost and isinstance(stream, int)
        ctypes.memmove(dst, src, size)   # both are host addresses here

    @staticmethod
    def getDeviceProperties(dev):
        # small by default: grid-stride loops must loop.  RLEMU_SM_COUNT=132 (an H200)
        # gives the launch geometry of the real device instead (CI's second pass).
        return {"multiProcessorCount": int(os.environ.get("RLEMU_SM_COUNT", "4"))}


def _alloc_pinned_memory(size):
    return bytearray(size)


def make_module():
    """A module object with the parts of the CuPy API that readerlib's launchers use."""
    cp = types.ModuleType("fake_cupy_module")
    cp.ndarray = FakeArray
    cp.asarray, cp.ascontiguousarray = asarray, ascontiguousarray
    cp.empty, cp.zeros, cp.cumsum = empty, zeros, cumsum
    cp.cuda = types.SimpleNamespace(runtime=_Runtime, Event=_Event,
                                    alloc_pinned_memory=_alloc_pinned_memory,
                                    get_current_stream=lambda: _Stream())
    return cp


# ---- signatures from the .cu sources -------------------------------------------------

def preprocessor():
    return shutil.which("cpp")


def kernel_signatures(source_text):
    """``{name: [param type strings]}`` of every ``__global__`` function (all are
    ``extern "C"``: one by one, or inside an ``extern "C" { }`` block)."""
    out = subprocess.run([preprocessor(), "-P", "-x", "c++", "-std=c++17", "-"],
                         input=source_text, capture_output=True, text=True, check=True).stdout
    sigs = {}
    for m in re.finditer(r'__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                         r'(\w+)\s*\(([^)]*)\)', out):
        params = []
        for p in m.group(2).split(","):
            p = " ".join(p.replace("__restrict__", " ").replace("const ", " ").split())
            params.append(p.rsplit(" ", 1)[0].replace(" *", "*"))  # drop the name
        sigs[m.group(1)] = params
    return sigs


_POINTEE = {
    "float": {np.dtype(np.float32)}, "double": {np.dtype(np.float64)},
    "int": {np.dtype(np.int32)}, "i64": {np.dtype(np.int64)}, "long long": {np.dtype(np.int64)},
    "u64": {np.dtype(np.uint64), np.dtype(np.int64)}, "unsigned char": {np.dtype(np.uint8)},
    "u8": {np.dtype(np.uint8)},
    "rl::half_t": {np.dtype(np.float16)}, "rl::bf16_t": {BFLOAT16},
    "rl::Acc<rl::half_t>::type": {np.dtype(np.float32)},
    "rl::Acc<rl::bf16_t>::type": {np.dtype(np.float32)},
    "rl::Acc<float>::type": {np.dtype(np.float32)},
    "rl::Acc<double>::type": {np.dtype(np.float64)},
}
_SCALAR = {"i64": np.int64, "int": np.int32}


def check_args(name, params, grid, block, args):
    assert len(args) == len(params), f"{name}: {len(args)} args for {len(params)} params {params}"
    assert 1 <= len(grid) <= 3 and 1 <= len(block) <= 3, (name, grid, block)
    assert all(isinstance(g, int) and g >= 1 for g in grid), (name, grid)
    assert all(isinstance(b, int) and b >= 1 for b in block), (name, block)
    assert int(np.prod(block)) <= 1024 and grid[0] < 2 ** 31, (name, grid, block)
    if len(grid) > 1:
        assert grid[1] <= 65535, (name, grid)
    for i, (p, a) in enumerate(zip(params, args)):
        where = f"{name} arg {i} ({p})"
        if p.endswith("*"):
            assert isinstance(a, FakeArray), f"{where}: expected an array, got {type(a).__name__}"
            assert a.flags.c_contiguous, f"{where}: not contiguous"
            base = p[:-1]
            word = re.fullmatch(r"rl::Word<(\d+)>::type", base)
            if word:
                assert a.data.ptr % int(word.group(1)) == 0, f"{where}: misaligned"
            else:
                assert a.dtype in _POINTEE[base], f"{where}: dtype {a.dtype}"
                assert a.data.ptr % a.dtype.itemsize == 0, f"{where}: misaligned"
        else:
            want = _SCALAR[p]
            assert type(a) is want, f"{where}: expected {want.__name__}, got {type(a).__name__}"


class FakeKernel:
    def __init__(self, name, params, log, source):
        """Runs the real kernel of the .cu file `source` (tests/support/cuda_emu.py)."""
        import cuda_emu
        self.name, self.params, self.log = name, params, log
        lib = cuda_emu.build(source)
        self.launch = lambda grid, block, args, shared_mem: cuda_emu.launch(
            lib, name, grid, block, args, shared_mem)

    def __call__(self, grid, block, args, shared_mem=0):
        check_args(self.name, self.params, tuple(grid), tuple(block), tuple(args))
        assert 0 <= shared_mem <= 48 * 1024, (self.name, shared_mem)
        if self.name.startswith("reindex_sort_small_"):   # extern __shared__ i64[p]
            assert grid == (1,) and shared_mem == 8 * int(args[-1]), (grid, shared_mem)
        self.log.append((self.name, tuple(grid), tuple(block)))
        self.launch(tuple(grid), tuple(block), tuple(args), shared_mem)


def make_get_kernel(signatures, log, run_cuda=True):
    """A drop-in for readerlib.kernels._cuda_loader.get_kernel.

    ``signatures`` maps a source name to its kernel signatures; sources missing from
    it (the RNN-T kernels, named by absolute path) are read on first use.
    """
    kernels = {}

    def get_kernel(source, name):
        if source not in signatures:
            signatures[source] = kernel_signatures(_cuda_loader.read_source(source))
        sigs = signatures[source]
        assert name in sigs, f"{source} has no kernel {name!r}"
        key = (source, name)    # one compiled library per source; the kernel object is reusable
        if key not in kernels:
            kernels[key] = FakeKernel(name, sigs[name], log, source)
        return kernels[key]
    return get_kernel


# ---- the whole stand-in, as the GPU tests' xp_gpu fixture ------------------------------

_signatures = {}


def _wrap_numpy(fn):
    def call(*args, **kwargs):
        args = [np.asarray(a).view(np.ndarray) if isinstance(a, FakeArray) else a for a in args]
        out = fn(*args, **kwargs)
        if isinstance(out, np.ndarray) and not isinstance(out, FakeArray):
            return _fake(out)
        if isinstance(out, tuple):
            return tuple(_fake(o) if isinstance(o, np.ndarray) else o for o in out)
        return out
    call.__name__ = getattr(fn, "__name__", "fn")
    return call


def install(monkeypatch, run_cuda=True):
    """Make readerlib see this module as CuPy for one test; returns the module.

    Launches execute the real CUDA code on the CPU (tests/support/cuda_emu.py;
    ``run_cuda`` must be True: there are no NumPy kernel emulators any more, the
    NumPy reference is readerlib/kernels/reference.py).  Everything else CuPy would do (array functions,
    ``cupy.sort``, ``cupy.cumsum``, matrix products) is NumPy's.
    """
    import contextlib
    import sys
    import threading

    import readerlib.tensor as _tensor
    assert run_cuda, "the NumPy kernel emulators are gone: kernels run on tests/support/cuda_emu"
    from readerlib import gpu as _rl_gpu
    from readerlib.kernels import _gpu

    mod = make_module()
    mod.launches = []
    mod.cuda.Stream = _Stream
    mod.cuda.Device = lambda dev=None: contextlib.nullcontext()

    def fallback(attr):   # cupy.<anything else> -> numpy's, returning device arrays
        value = getattr(np, attr)
        if callable(value) and not isinstance(value, type):
            return _wrap_numpy(value)
        return value
    mod.__getattr__ = fallback
    mod.asnumpy = lambda a: np.asarray(a).view(np.ndarray).copy()
    monkeypatch.setattr(FakeArray, "__module__", "cupy._fake")   # readerlib: a device array
    monkeypatch.setitem(sys.modules, "cupy", mod)
    monkeypatch.setattr(_rl_gpu, "_cupy", mod)
    monkeypatch.setattr(_cuda_loader, "get_kernel",
                        make_get_kernel(_signatures, mod.launches, run_cuda))
    monkeypatch.setattr(_gpu, "get_kernel", _cuda_loader.get_kernel)
    monkeypatch.setattr(_gpu, "_sm_counts", {})
    monkeypatch.setattr(_gpu, "_local", threading.local())
    array_module = _tensor._array_module
    monkeypatch.setattr(_tensor, "_array_module",
                        lambda a: mod if isinstance(a, FakeArray) else array_module(a))
    return mod
