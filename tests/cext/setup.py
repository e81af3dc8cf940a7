"""Build tests/cext/probe.pyx (tests/test_cext.py runs it in a temp dir)."""
from Cython.Build import cythonize
from setuptools import Extension, setup

import readerlib

setup(
    name="readerlib-test-cext-probe",
    ext_modules=cythonize([Extension("probe", ["probe.pyx"], include_dirs=[readerlib.get_include()])],
                          compiler_directives={"language_level": 3}),
    zip_safe=False,
)
