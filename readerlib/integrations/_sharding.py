"""Which slice of a chain a process (rank x data-loader worker) reads."""
import os

from readerlib.readers._base import ReaderBase

__all__ = ["rank_and_world_size"]


def _env_int(name, default):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def rank_and_world_size(rank=None, world_size=None):
    """(rank, world_size): the arguments, else torch.distributed, else RANK/WORLD_SIZE.

    torch.distributed is asked only when it is already imported and
    initialised; `torchrun` sets RANK and WORLD_SIZE in the environment.

    Raises
    ------
    ValueError
        When rank is not in ``[0, world_size)``.
    """
    if rank is None or world_size is None:
        dist_rank = dist_world = None
        import sys
        torch = sys.modules.get("torch")
        if torch is not None:
            dist = getattr(torch, "distributed", None)
            if dist is not None and dist.is_available() and dist.is_initialized():
                dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
        if rank is None:
            rank = dist_rank if dist_rank is not None else _env_int("RANK", 0)
        if world_size is None:
            world_size = dist_world if dist_world is not None else _env_int("WORLD_SIZE", 1)
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def _shard_chain(chain, num_shards, index):
    """Shard `index` of `num_shards` of a chain's items (each exactly once overall).

    Every k-th item in compiled code (`chain.shard`, a ShardReader), which
    works on any chain but makes every shard read the whole chain below; for
    files, `open_files(..., shard=(rank, world))` splits by chunk instead.
    """
    if not isinstance(chain, ReaderBase):
        raise TypeError(f"expected a readerlib reader chain, got {type(chain).__name__}")
    if num_shards == 1:
        return chain
    return chain.shard(num_shards, index)
