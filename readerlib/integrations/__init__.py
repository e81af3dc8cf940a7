"""Hand-off to training frameworks: PyTorch (`readerlib.integrations.torch`) and JAX
(`readerlib.integrations.jax`).

Each submodule imports its framework; this package imports neither, so
``import readerlib`` never pulls in torch or jax.
"""
from ._sharding import _shard_chain, rank_and_world_size

__all__ = ["rank_and_world_size"]
