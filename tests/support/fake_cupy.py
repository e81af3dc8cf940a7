"""A NumPy stand-in for CuPy that runs readerlib's GPU launchers without a GPU.

It lets tests/gpu/test_gpu_launchers.py execute the Python half of the GPU path
(allocation, views, launch geometry, status words, error selection) on a machine
with no CUDA driver.  Each RawKernel is replaced by

* a **signature check** against the kernel's real ``extern "C"`` parameter list,
  taken from the ``.cu`` source after the C preprocessor has expanded the wrapper
  macros: the argument count, pointer vs scalar, the scalar's width (``np.int32`` for
  ``int``, ``np.int64`` for ``i64``), the element dtype behind each pointer and its
  alignment (a 16-byte word kernel gets 16-byte aligned arrays);
* a **launch-shape check** (block <= 1024 threads, grid y <= 65535, nothing empty);
* an **emulator**: the kernel's contract written in NumPy, so the launcher's
  later steps see the outputs they expect.

With ``run_cuda=True`` (what tests/conftest.py's ``xp_gpu`` uses on a machine
without a GPU) the emulator step is replaced by the kernel's real CUDA code,
compiled for the CPU by tests/support/cuda_emu.py: then the launchers AND the kernels run,
and the GPU tests compare real kernel output with the CPU kernels.  What that still
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


# ---- emulators: each kernel's contract in NumPy --------------------------------------

def _bytes(a):
    return np.asarray(a).view(np.ndarray).reshape(-1).view(np.uint8)


def _first_bad(idx, n, limit):
    idx = np.asarray(idx[:n])
    neg, big = np.flatnonzero(idx < 0), np.flatnonzero(idx >= limit)
    return (n - int(neg[0]) if neg.size else 0), (n - int(big[0]) if big.size else 0)


def _atomic_max(status, i, v):
    status[i] = max(int(status[i]), int(v))


def emu_copy(word, x, idx, y, n_out, n_in, row_words):
    rb = int(row_words) * word
    xb, yb = _bytes(x), _bytes(y)
    for n in range(int(n_out)):
        s = int(idx[n])
        if 0 <= s < n_in:
            yb[n * rb:(n + 1) * rb] = xb[s * rb:(s + 1) * rb]


def emu_copy_lod(word, x, offsets, idx, new_offsets, y, n_out, n_seq, row_words):
    rb = int(row_words) * word
    xb, yb = _bytes(x), _bytes(y)
    for n in range(int(n_out)):
        s = int(idx[n])
        if 0 <= s < n_seq:
            nbytes = int(new_offsets[n + 1] - new_offsets[n]) * rb
            d, src = int(new_offsets[n]) * rb, int(offsets[s]) * rb
            yb[d:d + nbytes] = xb[src:src + nbytes]


def emu_check(idx, n, limit, status, keys=None, shift=None):
    neg, big = _first_bad(idx, int(n), int(limit))
    _atomic_max(status, 0, neg)
    _atomic_max(status, 1, big)
    if keys is not None:
        i = np.arange(int(n), dtype=np.int64)
        k = np.asarray(idx[:n]).astype(np.int64)
        k = np.where((k < 0) | (k >= limit), int(limit), k)
        keys[:n] = (k << int(shift)) | i


def emu_sort_small(idx, n, limit, status, keys, shift, p):
    assert p & (p - 1) == 0 and p >= n and p * 8 <= 48 * 1024, (n, p)
    emu_check(idx, n, limit, status, keys, shift)
    keys[:n] = np.sort(keys[:n])


def emu_lod_lengths(offsets, n_seq, idx, n, lengths, status):
    neg, big = _first_bad(idx, int(n), int(n_seq))
    _atomic_max(status, 0, neg)
    _atomic_max(status, 1, big)
    for i in range(int(n)):
        s = int(idx[i])
        lengths[i] = offsets[s + 1] - offsets[s] if 0 <= s < n_seq else 0
    if n:
        _atomic_max(status, 2, int(np.max(lengths[:n])))
    status[3] = int(status[3]) + int(np.sum(lengths[:n]))


def emu_segments(keys, n, shift, m, seg):
    k = np.asarray(keys[:n]) >> int(shift)
    for j in range(int(n)):
        if k[j] >= m:
            continue
        if j == 0 or k[j - 1] != k[j]:
            seg[k[j]] = j
        if j == n - 1 or k[j + 1] != k[j]:
            seg[m + k[j]] = j + 1


def emu_grad(vec16, dy, keys, seg, dx, m, row_packs, shift):
    m, shift = int(m), int(shift)
    row_elems = dx.size // m
    per_pack = 16 // dx.itemsize if vec16 else 1
    assert int(row_packs) * per_pack == row_elems, "row_packs does not match the row"
    if vec16:
        assert dy.data.ptr % 16 == 0 and dx.data.ptr % 16 == 0
    acc = np.dtype(np.float32) if dx.dtype == np.float16 else dx.dtype
    src = np.asarray(dy).view(np.ndarray).reshape(-1, row_elems)
    dst = np.asarray(dx).view(np.ndarray).reshape(m, row_elems)
    mask = (1 << shift) - 1
    for k in range(m):
        total = np.zeros(row_elems, dtype=acc)
        for j in range(int(seg[k]), int(seg[m + k])):
            total = (total + src[int(keys[j]) & mask].astype(acc)).astype(acc)
        dst[k] = total.astype(dx.dtype)


def _row_max(row):
    if np.isnan(row[0]):
        return row[0], 0
    y = np.where(np.isnan(row), -np.inf, row)
    i = int(np.argmax(y))
    return y[i], i


def _acc_view(logits, num_classes, acc_dtype):
    return np.asarray(logits).view(np.ndarray).reshape(-1, int(num_classes)).astype(acc_dtype)


def emu_argmax_padded(logits, seq_len, max_time, batch, num_classes, best_idx, best_val):
    x = _acc_view(logits, num_classes, best_val.dtype)
    for r in range(int(max_time) * int(batch)):
        t, b = divmod(r, int(batch))
        if t >= seq_len[b]:
            continue
        best_val[b * max_time + t], best_idx[b * max_time + t] = _row_max(x[r])


def emu_argmax_lod(logits, n_frames, num_classes, best_idx, best_val):
    x = _acc_view(logits, num_classes, best_val.dtype)
    for r in range(int(n_frames)):
        best_val[r], best_idx[r] = _row_max(x[r])


def _spans(batch, seq_len=None, max_time=None, offsets=None):
    for b in range(int(batch)):
        if offsets is not None:
            start, length = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        else:
            start, length = b * int(max_time), min(int(seq_len[b]), int(max_time))
        yield b, start, max(length, 0)


def _emit_scan(spans, best_idx, best_val, batch, blank, merge, pos, neg_sum, counts, row_start,
               status, dense_shape):
    acc = best_val.dtype.type
    for b, start, length in spans:
        c, s = 0, acc(0)
        for t in range(length):
            a = int(best_idx[start + t])
            prev = int(best_idx[start + t - 1]) if t else -1
            emit = a != blank and not (merge and a == prev)
            pos[start + t] = c if emit else -1
            c += emit
            s = acc(s + acc(-best_val[start + t]))
        counts[b], neg_sum[b] = c, s
    row_start[:batch] = np.cumsum(counts[:batch]) - counts[:batch]
    status[0] = int(status[0]) + 1
    status[1] = int(np.sum(counts[:batch]))
    status[2] = int(np.max(counts[:batch])) if batch else 0
    dense_shape[0], dense_shape[1] = batch, status[2]


def emu_scan_padded(best_idx, best_val, seq_len, max_time, batch, blank, merge, pos, neg_sum,
                    counts, row_start, status, dense_shape):
    for b in range(int(batch)):
        if seq_len[b] > max_time:
            _atomic_max(status, 3, int(batch) - b)
    _emit_scan(_spans(batch, seq_len, max_time), best_idx, best_val, int(batch), int(blank),
               bool(merge), pos, neg_sum, counts, row_start, status, dense_shape)


def emu_scan_lod(best_idx, best_val, offsets, batch, blank, merge, pos, neg_sum, counts,
                 row_start, status, dense_shape):
    _emit_scan(_spans(batch, offsets=offsets), best_idx, best_val, int(batch), int(blank),
               bool(merge), pos, neg_sum, counts, row_start, status, dense_shape)


def _compact(spans, best_idx, pos, row_start, indices, values):
    for b, start, length in spans:
        for t in range(length):
            p = int(pos[start + t])
            if p >= 0:
                j = int(row_start[b]) + p
                indices[j] = (b, p)
                values[j] = best_idx[start + t]


def emu_compact_padded(best_idx, pos, seq_len, max_time, row_start, batch, indices, values):
    _compact(_spans(batch, seq_len, max_time), best_idx, pos, row_start, indices, values)


def emu_compact_lod(best_idx, pos, offsets, row_start, batch, indices, values):
    _compact(_spans(batch, offsets=offsets), best_idx, pos, row_start, indices, values)


def emulator(name):
    m = re.fullmatch(r"batch_reindex(_lod)?_w(\d+)_int(32|64)", name)
    if m:
        word = int(m.group(2))
        if m.group(1):
            return lambda *a: emu_copy_lod(word, *a)
        return lambda *a: emu_copy(word, *a)
    if re.fullmatch(r"reindex_check_int(32|64)", name):
        return emu_check
    if re.fullmatch(r"reindex_check_keys_int(32|64)", name):
        return emu_check
    if re.fullmatch(r"reindex_sort_small_int(32|64)", name):
        return emu_sort_small
    if re.fullmatch(r"reindex_lod_lengths_int(32|64)", name):
        return emu_lod_lengths
    if name == "reindex_segments":
        return emu_segments
    m = re.fullmatch(r"batch_reindex_grad_\w+?(_v16)?", name)
    if m:
        vec16 = name.endswith("_v16")
        return lambda *a: emu_grad(vec16, *a)
    table = {"ctc_compact_padded": emu_compact_padded, "ctc_compact_lod": emu_compact_lod}
    if name in table:
        return table[name]
    if name.startswith("ctc_frame_argmax_padded_"):
        return emu_argmax_padded
    if name.startswith("ctc_frame_argmax_lod_"):
        return emu_argmax_lod
    if name.startswith("ctc_emit_scan_padded_"):
        return emu_scan_padded
    if name.startswith("ctc_emit_scan_lod_"):
        return emu_scan_lod
    raise KeyError(f"no emulator for kernel {name}")


class FakeKernel:
    def __init__(self, name, params, log, source=None):
        """``source`` given: run the real kernel of that .cu file (tests/support/cuda_emu.py);
        otherwise its NumPy emulator above."""
        self.name, self.params, self.log = name, params, log
        if source is None:
            self.run = emulator(name)
        else:
            import cuda_emu
            lib = cuda_emu.build(source)
            self.run = None
            self.launch = lambda grid, block, args, shared_mem: cuda_emu.launch(
                lib, name, grid, block, args, shared_mem)

    def __call__(self, grid, block, args, shared_mem=0):
        check_args(self.name, self.params, tuple(grid), tuple(block), tuple(args))
        assert 0 <= shared_mem <= 48 * 1024, (self.name, shared_mem)
        if self.name.startswith("reindex_sort_small_"):   # extern __shared__ i64[p]
            assert grid == (1,) and shared_mem == 8 * int(args[-1]), (grid, shared_mem)
        self.log.append((self.name, tuple(grid), tuple(block)))
        if self.run is None:
            self.launch(tuple(grid), tuple(block), tuple(args), shared_mem)
        else:
            self.run(*args)


def make_get_kernel(signatures, log, run_cuda=False):
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
        if run_cuda:   # one compiled library per source; the kernel object is reusable
            key = (source, name)
            if key not in kernels:
                kernels[key] = FakeKernel(name, sigs[name], log, source)
            return kernels[key]
        return FakeKernel(name, sigs[name], log)
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


def install(monkeypatch, run_cuda):
    """Make readerlib see this module as CuPy for one test; returns the module.

    ``run_cuda``: launches execute the real CUDA code on the CPU (tests/support/cuda_emu.py)
    instead of the NumPy emulators.  Everything else CuPy would do (array functions,
    ``cupy.sort``, ``cupy.cumsum``, matrix products) is NumPy's.
    """
    import contextlib
    import sys
    import threading

    import readerlib.tensor as _tensor
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
