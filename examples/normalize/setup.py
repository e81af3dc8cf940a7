"""Build the example: ``python setup.py build_ext --inplace`` (needs readerlib installed
or on PYTHONPATH, Cython and a C compiler)."""
from Cython.Build import cythonize
from setuptools import Extension, setup

import readerlib

setup(
    name="readerlib-example-normalize",
    ext_modules=cythonize(
        [Extension("normalize", ["normalize.pyx"], include_dirs=[readerlib.get_include()],
                   extra_compile_args=["-O3"])],
        compiler_directives={"language_level": 3},
    ),
    zip_safe=False,
)
