"""Build the example: ``python setup.py build_ext --inplace`` (needs readerlib installed
or on PYTHONPATH, Cython and a C compiler)."""
# (the ignores: Cython and older setuptools ship no type information; mypy --strict checks examples/)
from Cython.Build import cythonize  # type: ignore[import-untyped, unused-ignore]
from setuptools import Extension, setup  # type: ignore[import-untyped, unused-ignore]

import readerlib

setup(
    name="readerlib-example-normalize",
    ext_modules=cythonize(  # type: ignore[no-untyped-call, unused-ignore]
        [Extension("normalize", ["normalize.pyx"], include_dirs=[readerlib.get_include()],
                   extra_compile_args=["-O3"])],
        compiler_directives={"language_level": 3},
    ),
    zip_safe=False,
)
