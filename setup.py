"""Build the Cython extensions.

Every ``readerlib/**/*.pyx`` becomes an extension module, so adding a kernel
needs no edit here.  Environment switches:

``READERLIB_NO_THREADS=1``  build without threads: every parallel loop runs on the
                           calling thread (``READERLIB_NO_OPENMP=1``, its old name, too)
``READERLIB_BOUNDSCHECK=1`` turn Cython bounds/wraparound checks on (crash hunting)
``READERLIB_ANNOTATE=1``    write Cython's annotated HTML next to each .pyx
"""
import glob
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext


class build_ext(_build_ext):
    """Compile extensions in parallel by default (READERLIB_BUILD_JOBS to override)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = int(os.environ.get("READERLIB_BUILD_JOBS", "0")) or os.cpu_count() or 1


def _flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# No module is compiled with -fopenmp: libgomp is not fork-safe and its idle
# threads spin (see readerlib/_parallel.pyx); readerlib runs its own pool.
THREADS = not (_flag("READERLIB_NO_THREADS") or _flag("READERLIB_NO_OPENMP"))
CHECKS = _flag("READERLIB_BOUNDSCHECK")

directives = {
    "language_level": 3,
    "boundscheck": CHECKS,
    "wraparound": CHECKS,
    "initializedcheck": CHECKS,
    "cdivision": True,
    "embedsignature": True,
    # real signatures for inspect.signature (Cython 3's default, stated: the stubs and
    # tests/test_typing.py rely on it); measured not to slow the per-batch path
    # (benchmarks/bench_binding.py, benchmarks/results/cext_map.md)
    "binding": True,
}

# POSIX only (pthreads, pread/pwritev, mmap): no other platform's flags.
compile_args = ["-O3", "-pthread"]
link_args = ["-pthread"]
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if not THREADS:
    macros.append(("READERLIB_NO_THREADS", "1"))

include_dirs = [np.get_include(), os.path.join("readerlib", "include")]

extensions = []
for pyx in sorted(glob.glob("readerlib/**/*.pyx", recursive=True)):
    module = pyx[:-4].replace(os.sep, ".").replace("/", ".")
    extensions.append(Extension(
        module, [pyx],
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        libraries=["z"],
    ))

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        annotate=_flag("READERLIB_ANNOTATE"),
        nthreads=int(os.environ.get("READERLIB_BUILD_JOBS", "0")) or None,
    ),
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
