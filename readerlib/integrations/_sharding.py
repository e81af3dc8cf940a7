"""Which slice of a chain a process (rank x data-loader worker) reads.

One home for the rank/world answer (`rank_and_world_size`): `open_files(...,
shard="auto")` and the framework integrations both ask it, so a chain and
the integration around it never disagree on who this process is.
"""
import os

from readerlib.readers._base import ReaderBase

__all__ = ["rank_and_world_size", "chain_sharding", "unseeded_shuffles", "ranks_trimmed_to_equal"]


# (rank, world_size) of the torch.distributed group of the process that started
# this one, set in a DataLoader worker started by spawn or forkserver (where
# torch.distributed is not initialised) by readerlib.integrations.torch: the
# worker then gets its parent's answer, as a forked worker does.
_parent_distributed = None


def _env_int(env, name, default):
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def rank_and_world_size(rank=None, world_size=None, environ=None):
    """(rank, world_size): the arguments, else torch.distributed, else RANK/WORLD_SIZE.

    torch.distributed is asked only when it is already imported and
    initialised (in a PyTorch DataLoader worker: in the main process);
    `torchrun` sets RANK and WORLD_SIZE in the environment.

    Parameters
    ----------
    rank, world_size : int, optional
    environ : mapping, optional
        Where to read RANK/WORLD_SIZE (default `os.environ`).

    Raises
    ------
    ValueError
        When rank is not in ``[0, world_size)``, or RANK/WORLD_SIZE are not integers.
    """
    env = os.environ if environ is None else environ
    if rank is None or world_size is None:
        dist_rank = dist_world = None
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and environ is None:
            dist = getattr(torch, "distributed", None)
            if dist is not None and dist.is_available() and dist.is_initialized():
                dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
            elif _parent_distributed is not None:
                dist_rank, dist_world = _parent_distributed
        if rank is None:
            rank = dist_rank if dist_rank is not None else _env_int(env, "RANK", 0)
        if world_size is None:
            world_size = dist_world if dist_world is not None else _env_int(env, "WORLD_SIZE", 1)
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def chain_sharding(chain):
    """The sharding already inside a chain: a list of (description, kind, value)
    for each `open_files(shard=(rank, world))` with world > 1 (kind "files",
    value (rank, world)) and each `.shard(n, i)` (kind "items", value (n, i))."""
    from readerlib.readers._multifile import MultiFileReader
    from readerlib.readers._passes import ShardReader
    found = []
    for r in chain._walk():
        if isinstance(r, ShardReader):
            found.append((f".shard({r.num_shards}, {r.index})", "items", (int(r.num_shards), int(r.index))))
        elif isinstance(r, MultiFileReader):
            shard = getattr(r.plan, "shard", None)
            if shard is not None and shard[1] > 1:
                found.append((f"open_files(shard=({shard[0]}, {shard[1]}))", "files", tuple(shard)))
    return found


def ranks_trimmed_to_equal(chain):
    """Whether every `open_files(shard=(rank, world))` (world > 1) in a chain
    trims the ranks to one record count (``equal_batches=True``); False when
    there is none."""
    from readerlib.readers._multifile import MultiFileReader
    found = [r for r in chain._walk() if isinstance(r, MultiFileReader)
             and getattr(r.plan, "shard", None) is not None and r.plan.shard[1] > 1]
    return bool(found) and all(getattr(r.plan, "equal_batches", False) for r in found)


def unseeded_shuffles(chain):
    """Descriptions of the shuffles in a chain that drew their own seed (no `seed=`)."""
    from readerlib.readers._shuffle import ShuffleReader
    from readerlib.readers._multifile import MultiFileReader
    found = []
    for r in chain._walk():
        if isinstance(r, ShuffleReader) and r.seed_drawn:
            found.append(f".shuffle({r.buffer_size})")
        elif isinstance(r, MultiFileReader) and getattr(r.plan, "shuffle_files", False) \
                and getattr(r.plan, "seed_drawn", False):
            found.append("open_files(..., shuffle_files=True)")
        elif getattr(r, "seed_drawn", False) and hasattr(r, "_shuffle_description"):
            found.append(r._shuffle_description())      # global_shuffle, shuffle(mode="window")
    return found


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
