"""The CUDA sources compile, and the GPU module degrades cleanly without CuPy -- no GPU needed.

* every ``.cu`` compiles with nvcc for sm_90 (skipped without nvcc), warnings as
  errors, and through NVRTC the way CuPy compiles it (skipped without CuPy's
  compiler and libnvrtc);
* the PTX holds every kernel the launchers may ask for, 16-byte loads where the
  design says so, and no flush-to-zero instruction even under ``-ftz=true``;
* the loader pastes headers in with ``#line`` markers that map every line back
  to its file, so compiler errors point at the real source;
* ``readerlib.kernels._gpu`` imports without CuPy, and a call then raises
  ``ImportError`` saying what to install.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from readerlib.kernels import _cuda_loader, _gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
SOURCES = _cuda_loader.cuda_sources()


def test_sources_are_shipped():
    assert {"reindex.cu", "ctc.cu"} <= set(SOURCES)
    assert set(_gpu.kernel_names()) <= set(SOURCES)


def _entries(ptx):
    """{kernel name: its PTX body}."""
    parts = re.split(r"(?=^\.visible \.entry )", ptx, flags=re.M)
    return {re.match(r"\.visible \.entry (\w+)", p).group(1): p for p in parts[1:]}


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not on PATH")
    out = {}
    tmp = tmp_path_factory.mktemp("ptx")
    for name in SOURCES:
        path = tmp / (name + ".ptx")
        subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-ftz=true", "--ptx",
                        os.path.join(_cuda_loader.CUDA_DIR, name), "-o", str(path)],
                       check=True, capture_output=True, text=True)
        out[name] = path.read_text()
    return out


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles_without_warnings(name, tmp_path):
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-c",
                        os.path.join(_cuda_loader.CUDA_DIR, name), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_nvcc_compiles_the_loader_text(name, tmp_path):
    """What NVRTC is given (headers pasted in, #line markers) is valid CUDA too."""
    src = tmp_path / name
    src.write_text(_cuda_loader.read_source(name))
    r = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-c",
                        str(src), "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_every_launched_kernel_is_in_the_ptx(ptx):
    for name, kernels in _gpu.kernel_names().items():
        missing = set(kernels) - set(_entries(ptx[name]))
        assert not missing, f"{name} lacks {sorted(missing)}"


def test_no_flush_to_zero_under_cupy_flags(ptx):
    for name, text in ptx.items():
        bad = [line.strip() for line in text.splitlines() if ".ftz" in line]
        assert not bad, f"{name}: {bad[:5]}"


def test_wide_loads_where_designed(ptx):
    entries = {**_entries(ptx["reindex.cu"]), **_entries(ptx["ctc.cu"])}
    wide = [k for k in entries if re.search(r"_w16_|_v16$|^ctc_frame_argmax_", k)]
    assert len(wide) == 4 + 6 + 8
    for k in wide:
        assert re.search(r"ld\.global(\.nc)?\.(v4\.[uf]32|v2\.[uf]64)", entries[k]), \
            f"{k}: no 16-byte load"
    for k in (k for k in wide if "reindex" in k):
        assert re.search(r"st\.global\.v(2|4)\.", entries[k]), f"{k}: no 16-byte store"


def test_line_markers_map_every_line_back(tmp_path):
    for name in SOURCES:
        current, line_no = None, 0
        for text in _cuda_loader.read_source(name).splitlines():
            m = re.fullmatch(r'#line (\d+) "(.+)"', text)
            if m:
                line_no, current = int(m.group(1)), m.group(2)
                continue
            with open(current, encoding="utf-8") as f:
                original = f.read().splitlines()
            assert original[line_no - 1] == text, (current, line_no)
            line_no += 1


@needs_nvcc
def test_compiler_errors_point_at_the_header(tmp_path, monkeypatch):
    (tmp_path / "h.cuh").write_text("// a header\n\nint broken = ;  // line 3\n")
    (tmp_path / "k.cu").write_text('// kernel\n#include "h.cuh"\n__global__ void k() {}\n')
    monkeypatch.setattr(_cuda_loader, "CUDA_DIR", str(tmp_path))
    src = tmp_path / "expanded.cu"
    src.write_text(_cuda_loader.read_source("k.cu"))
    r = subprocess.run([NVCC, "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert re.search(r"h\.cuh\(3\): error", r.stderr), r.stderr
    assert "expanded.cu(" not in r.stderr


def test_missing_source_says_what_is_shipped():
    with pytest.raises(FileNotFoundError, match="reindex.cu"):
        _cuda_loader.read_source("nope.cu")


def _nvrtc_program():
    try:
        from cupy.cuda import compiler
        compiler._get_nvrtc_version()
        return compiler._NVRTCProgram
    except Exception as e:  # no CuPy, no libnvrtc, or CuPy internals moved
        pytest.skip(f"NVRTC through CuPy unavailable: {type(e).__name__}: {e}")


@pytest.mark.parametrize("name", SOURCES)
def test_nvrtc_compiles_like_cupy(name):
    """The options CuPy's RawModule uses (C++17, -ftz=true, default device space)."""
    program = _nvrtc_program()
    prog = program(_cuda_loader.read_source(name), "", (), (), name_expressions=None, method="ptx")
    options = ("-std=c++17", "-arch=compute_90", "--device-as-default-execution-space",
               "-ftz=true") + tuple(_cuda_loader.NVRTC_OPTIONS)
    text, _ = prog.compile(options)
    text = text.decode() if isinstance(text, bytes) else text
    assert set(_gpu.kernel_names()[name]) <= set(_entries(text))
    assert ".ftz" not in text


def _run_python(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True)


def test_import_needs_no_cupy_and_calls_say_what_to_install():
    r = _run_python("""
        import sys
        sys.modules["cupy"] = None          # as if CuPy were not installed
        import numpy as np
        import readerlib.kernels._gpu as g
        import readerlib.kernels._cuda_loader as loader
        assert loader.read_source("ctc.cu").startswith("#line 1 ")
        for call in (lambda: g.batch_reindex(np.zeros((2, 2)), np.zeros(1, np.int64)),
                     lambda: g.batch_reindex_grad(np.zeros((1, 2)), np.zeros(1, np.int64), 2),
                     lambda: g.ctc_greedy_decoder(np.zeros((1, 1, 2)), np.ones(1, np.int32)),
                     lambda: loader.get_module("ctc.cu")):
            try:
                call()
            except ImportError as e:
                print("ImportError:", e)
            else:
                raise SystemExit("no ImportError")
    """)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = r.stdout.splitlines()
    assert len(lines) == 4
    for line in lines:
        assert "pip install" in line and "cupy" in line, line


def test_importing_the_gpu_module_does_not_import_cupy():
    r = _run_python("""
        import sys
        import readerlib.kernels._gpu, readerlib.kernels._cuda_loader
        print("cupy" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
