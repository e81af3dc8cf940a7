"""Compile readerlib's CUDA sources for the CPU and launch their kernels on host arrays.

See tests/cuda_emu/emu.h for the execution model.  Used by tests/support/fake_cupy.py: with
``run_cuda=True`` its RawKernel stand-ins execute the real kernel code here instead of
the NumPy statement of each kernel's contract, so the GPU tests check the CUDA code
itself on a machine without a GPU.

    lib = build("reindex.cu")                 # cached by source hash
    launch(lib, "reindex_check_int64", (4,), (256,), (idx, np.int64(n), ...))
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from readerlib.kernels import _cuda_loader

EMU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_emu")
EMU_HEADER = os.path.join(EMU_DIR, "emu.h")
CXX = os.environ.get("CXX", "g++")
# No -ffast-math and no FMA contraction: the kernels' float arithmetic must round as
# the GPU's does (common.cuh's add.rn.f32), so results compare bitwise with the CPU.
CXXFLAGS = ["-std=c++17", "-O1", "-g0", "-fPIC", "-shared", "-ffp-contract=off",
            "-fno-fast-math", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function",
            "-Werror",
            # each library keeps its own emulator state (GCC would otherwise unify
            # the inline variables of every loaded library, process-wide)
            "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-gnu-unique",
            # the fiber switch returns with `ret` onto another stack: no CET shadow stack
            "-fcf-protection=none"]

# RLEMU_SANITIZE=address builds the kernels with AddressSanitizer: an access outside
# any NumPy array then stops the run with a report.  The interpreter must load the
# runtime first:
#   LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \
#   RLEMU_SANITIZE=address python -m pytest -m cuda_emu tests
if os.environ.get("RLEMU_SANITIZE"):
    CXXFLAGS += [f"-fsanitize={os.environ['RLEMU_SANITIZE']}", "-fno-omit-frame-pointer"]

_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([\w:<>]+(?:\s+[\w:<>]+)*)\s+(\w+)\s*\[\s*\]\s*;")

_lock = threading.Lock()
_libs = {}


def available():
    """Whether this machine can build the emulated kernels (a C++17 compiler and cpp)."""
    return shutil.which(CXX) is not None and shutil.which("cpp") is not None


def kernel_names(source_text):
    """Names of every ``__global__`` function, after the preprocessor (macros expanded)."""
    out = subprocess.run(["cpp", "-P", "-x", "c++", "-std=c++17", "-"], input=source_text,
                         capture_output=True, text=True, check=True).stdout
    return sorted(set(_GLOBAL.findall(out)))


def emulation_source(text):
    """The text g++ compiles for a CUDA source as NVRTC gets it: dynamic shared arrays
    turned into pointers to the launch's buffer, and one exported launcher per kernel;
    and the kernel names."""
    names = kernel_names(text)
    text = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = "
                  f"reinterpret_cast<{m.group(1)}*>(::rl_emu::dynamic_shared());", text)
    exports = "".join(f"RLEMU_EXPORT({k})\n" for k in names)
    return text + "\n// ---- tests/support/cuda_emu launchers\n" + exports, names


def _cache_dir():
    """A folder only this user can write (libraries from it are loaded)."""
    d = os.path.join(tempfile.gettempdir(), f"readerlib-cuda-emu-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{d} is not a private folder of this user; remove it or set TMPDIR")
    return d


def build(name):
    """Compile ``cuda/<name>`` (a name from ``_cuda_loader.cuda_sources()`` or an absolute
    path) for the CPU; returns the loaded library.  Cached on disk by content."""
    with _lock:
        lib = _libs.get(name)
        if lib is None:
            lib = _libs[name] = build_text(_cuda_loader.read_source(name),
                                           os.path.splitext(os.path.basename(name))[0])
        return lib


def build_text(source_text, stem, defines=()):
    """Compile CUDA source text (local includes already pasted in) for the CPU; the
    library is cached on disk by content, under the temp directory.  ``defines``:
    extra ``-D`` macros (``RLEMU_UCONTEXT`` selects the portable fiber switch)."""
    text, names = emulation_source(source_text)
    with open(EMU_HEADER, "rb") as f:
        header = f.read()
    flags = CXXFLAGS + [f"-D{d}" for d in defines]
    key = hashlib.sha256(text.encode() + header + " ".join([CXX] + flags).encode())
    so = os.path.join(_cache_dir(), f"{stem}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(so):
        tag = f"{os.getpid()}.{threading.get_ident()}"
        src, tmp = f"{so[:-3]}.{tag}.cc", f"{so}.{tag}.tmp"
        with open(src, "w") as f:
            f.write(text)
        try:
            proc = subprocess.run([CXX, *flags, "-include", EMU_HEADER, "-o", tmp, src],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"compiling {stem} for the CPU emulator failed:\n"
                                   f"{proc.stderr[-6000:]}")
            os.replace(tmp, so)   # atomic: parallel test runs may build the same file
        finally:
            for leftover in (src, tmp):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    lib = ctypes.CDLL(so)
    lib.rlemu_names = names
    return lib


def _arg(a):
    """A ctypes object holding the kernel argument's bytes (cuLaunchKernel's convention)."""
    if isinstance(a, np.ndarray):
        return ctypes.c_void_p(a.__array_interface__["data"][0])
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.float64):
        return ctypes.c_double(float(a))
    raise TypeError(f"cannot pass {type(a).__name__} to a kernel")


def _dims(d):
    d = tuple(int(v) for v in d) + (1, 1)
    return (ctypes.c_uint * 3)(*d[:3])


def launch(lib, kernel, grid, block, args, shared_mem=0):
    """Run ``kernel`` over the whole grid; raises AssertionError on what a GPU leaves
    undefined (see emu.h)."""
    fn = getattr(lib, "rlemu_launch_" + kernel)
    held = [_arg(a) for a in args]
    ptrs = (ctypes.c_void_p * max(len(held), 1))(
        *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in held])
    err = ctypes.create_string_buffer(1024)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_char_p, ctypes.c_size_t]
    rc = fn(_dims(grid), _dims(block), int(shared_mem), ptrs, err, len(err))
    if rc:
        raise AssertionError(f"{kernel} grid={tuple(grid)} block={tuple(block)}: "
                             f"{err.value.decode(errors='replace')}")
