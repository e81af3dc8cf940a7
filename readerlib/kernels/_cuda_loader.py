"""Load the CUDA sources shipped in ``readerlib/kernels/cuda`` as CuPy RawModules.

One helper for every GPU kernel (CuPy's cupyx and httomolibgpu do the same):

* the ``.cu`` files are package data, read from next to this module;
* ``#include "x.cuh"`` of a file in that folder is pasted in place (NVRTC has no
  include path of ours, and CuPy's on-disk cache is keyed on the source text, so an
  edited header must change the text it hashes), with ``#line`` markers before and
  after so a compiler error names the real file and line;
* the :class:`cupy.RawModule` is built on first use and memoized per device;
  importing this module needs neither CuPy nor a GPU.
"""
from __future__ import annotations

import os
import re
import threading

from ..gpu import require_cupy

__all__ = ["CUDA_DIR", "cuda_sources", "read_source", "get_module", "get_kernel"]

#: Folder holding the ``.cu`` / ``.cuh`` files.
CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")

#: Extra NVRTC options.  CuPy adds ``-arch`` for the current device, ``-std=c++17``
#: and ``-ftz=true`` itself (the kernels are written so that -ftz cannot change
#: a result; see cuda/common.cuh).
NVRTC_OPTIONS = ()

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$')

_lock = threading.Lock()
_modules = {}   # (source name, device id) -> cupy.RawModule
_kernels = {}   # (source name, device id, kernel name) -> cupy.RawKernel


def cuda_sources():
    """Names of the ``.cu`` files shipped with readerlib (sorted)."""
    return sorted(f for f in os.listdir(CUDA_DIR) if f.endswith(".cu"))


def _line_marker(line, path):
    return '#line %d "%s"\n' % (line, path.replace("\\", "/"))


def _expand(path, seen):
    out = [_line_marker(1, path)]
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        m = _INCLUDE.match(line.rstrip("\r\n"))
        if m is None:
            out.append(line if line.endswith("\n") else line + "\n")
            continue
        header = os.path.join(os.path.dirname(path), m.group(1))
        if not os.path.isfile(header):
            raise FileNotFoundError(f"{path}:{number}: included file {m.group(1)!r} not found")
        header = os.path.abspath(header)
        if header not in seen:
            seen.add(header)
            out.extend(_expand(header, seen))
        out.append(_line_marker(number + 1, path))
    return out


def read_source(name):
    """The text of ``cuda/<name>`` as compiled: local includes pasted in, ``#line`` first.

    Parameters
    ----------
    name : str
        A file name from :func:`cuda_sources`, e.g. ``"reindex.cu"``.

    Raises
    ------
    FileNotFoundError
        If the file (or a file it includes) is not in the package.
    """
    path = os.path.join(CUDA_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"CUDA source {name!r} is not in {CUDA_DIR}; shipped sources: {cuda_sources()}")
    return "".join(_expand(os.path.abspath(path), set()))


def get_module(name):
    """The :class:`cupy.RawModule` of ``cuda/<name>`` for the current device.

    Built (not yet compiled: CuPy compiles on the first ``get_function``) once per
    device and process.

    Raises
    ------
    ImportError
        When CuPy is missing, saying what to install.
    """
    cp = require_cupy()
    key = (name, cp.cuda.runtime.getDevice())
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cp.RawModule(code=read_source(name), options=NVRTC_OPTIONS)
                _modules[key] = mod
    return mod


def get_kernel(name, kernel):
    """The kernel ``kernel`` (an ``extern "C"`` name) of ``cuda/<name>`` on this device."""
    cp = require_cupy()
    key = (name, cp.cuda.runtime.getDevice(), kernel)
    fn = _kernels.get(key)
    if fn is None:
        fn = get_module(name).get_function(kernel)
        with _lock:
            _kernels.setdefault(key, fn)
    return fn
