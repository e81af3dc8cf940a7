"""What a user's Cython extension needs to build against readerlib."""
import os

__all__ = ["get_include"]


def get_include() -> str:
    """The directory of readerlib's C headers (``rl_core.h`` ...).

    A Cython module that cimports readerlib's ``.pxd`` files (for example
    ``from readerlib.transform cimport RecordTransform``) compiles against
    these headers: pass ``include_dirs=[readerlib.get_include()]`` to its
    ``Extension``, as NumPy's ``numpy.get_include()``.

    Returns
    -------
    str
        An absolute path inside the installed package.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for sub in ("include", os.path.join("core")):        # the header folder, before and after issue 13's layout
        d = os.path.join(here, sub)
        if os.path.exists(os.path.join(d, "rl_core.h")):
            return d
    raise FileNotFoundError(f"readerlib's C headers (rl_core.h) are not installed under {here}")
