"""readerlib: Cython-accelerated reader chains, LoD batches and decode kernels."""
from .tensor import Field, LoDTensor, Schema, SparseTensor

__version__ = "0.1.0"

__all__ = ["Field", "Schema", "LoDTensor", "SparseTensor"]
