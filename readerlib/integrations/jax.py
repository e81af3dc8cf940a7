"""JAX hand-off: readerlib items as jax arrays through DLPack.

JAX is imported on first use, so this module imports without it.

Examples
--------
>>> from readerlib.integrations.jax import to_jax
>>> for batch in chain.prefetch(2):
...     feats, label = to_jax(batch)
"""
from collections import namedtuple

from readerlib._keyed import _Keyed
from readerlib.tensor import LoDTensor

__all__ = ["ArrayWithLoD", "to_jax"]

#: A sequence field of a batch in JAX: ``data`` and ``lod`` (tuple of int64 offset arrays).
ArrayWithLoD = namedtuple("ArrayWithLoD", ["data", "lod"])


def _jax():
    try:
        import jax
        import jax.dlpack
    except ImportError as e:
        raise ImportError("readerlib.integrations.jax needs JAX: pip install jax") from e
    return jax


def _array(jax, a):
    # DLPack: zero-copy where XLA accepts the memory (readerlib's batch
    # sections are 64-byte aligned, which XLA's CPU client requires); JAX
    # arrays are immutable, so treat the source as read-only afterwards.
    return jax.dlpack.from_dlpack(a)


def to_jax(item):
    """A readerlib item (batch or instance) as jax arrays.

    Returns a tuple with one entry per field: a jax array for fixed fields
    (and instance values), an `ArrayWithLoD` for sequence fields.  NumPy
    batches land on the CPU device, CuPy batches on their GPU.
    """
    jax = _jax()
    out = []
    for v in item:
        if isinstance(v, LoDTensor):
            data = _array(jax, v.data)
            if v.lod:
                out.append(ArrayWithLoD(data, tuple(_array(jax, l) for l in v.lod)))
            else:
                out.append(data)
        else:
            out.append(_array(jax, v))
    return type(item)._make(out) if isinstance(item, _Keyed) else tuple(out)   # keeps the keys
