"""PyTorch hand-off: an IterableDataset over a reader chain, zero-copy tensors.

Examples
--------
>>> from readerlib.integrations.torch import IterableDataset
>>> ds = IterableDataset(lambda: rl.RecordIOReader("train.rio").shuffle(10_000, seed=0).batch(256))
>>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
>>> for epoch in range(3):
...     ds.set_epoch(epoch)
...     for feats, label in loader:
...         ...

See docs/training_loop.md.
"""
from collections import namedtuple

import numpy as np
import torch
import torch.utils.data

from readerlib.readers._base import ReaderBase
from readerlib.tensor import LoDTensor

from ._sharding import _shard_chain, rank_and_world_size

__all__ = ["IterableDataset", "TensorWithLoD", "to_torch"]

#: A sequence field of a batch in torch: ``data`` [rows, *shape] and ``lod``,
#: a tuple of int64 offset tensors (``lod[0][i]:lod[0][i+1]`` are instance i's rows).
TensorWithLoD = namedtuple("TensorWithLoD", ["data", "lod"])


def _tensor(a):
    # DLPack: the tensor shares the array's memory (and keeps it alive).
    return torch.from_dlpack(a)


def to_torch(item):
    """A readerlib item as torch tensors, without copying.

    Parameters
    ----------
    item : tuple
        A batch (tuple of LoDTensor) or an instance (tuple of arrays), as
        `read_next()` returns it; NumPy (CPU) or CuPy (GPU) arrays alike.

    Returns
    -------
    tuple
        One entry per field: a tensor for fixed fields (and for instance
        values), a `TensorWithLoD` for sequence fields.  The tensors view the
        reader's memory (DLPack); they keep it alive.
    """
    out = []
    for v in item:
        if isinstance(v, LoDTensor):
            data = _tensor(v.data)
            if v.lod:
                out.append(TensorWithLoD(data, tuple(_tensor(l) for l in v.lod)))
            else:
                out.append(data)
        else:
            out.append(_tensor(v))
    return tuple(out)


class IterableDataset(torch.utils.data.IterableDataset):
    """A reader chain as a `torch.utils.data.IterableDataset`.

    Every (rank, worker) pair reads its own shard of the chain's items, so
    across all ranks and DataLoader workers each item is seen exactly once
    per epoch.  Use it with ``DataLoader(ds, batch_size=None, ...)``: the
    chain already batches.

    Parameters
    ----------
    chain : ReaderBase or callable
        Preferably a zero-argument callable that builds the chain (each
        worker then builds its own, and nothing is shared across fork).  A
        chain object also works.  **Every shard must see the same order**:
        pass ``seed=`` to every ``.shuffle()``.
    rank, world_size : int, optional
        Default: torch.distributed when initialised, else the RANK and
        WORLD_SIZE environment variables (what torchrun sets), else 0 and 1.
    convert : bool, default True
        Hand out torch tensors (`to_torch`, zero-copy); False hands out the
        readerlib items themselves.

    Notes
    -----
    Sharding is by item (`_shard_chain`): shard i of k takes items i, i+k,
    ...  of the chain, so every shard reads the chain below in full; ranks
    may differ by one item per epoch.  With ``num_workers > 0`` the
    DataLoader moves each batch from its worker through shared memory (one
    copy, made by PyTorch); with ``num_workers=0`` batches reach the loop
    without any copy.  Do not put `.prefetch()` inside a chain read by
    DataLoader workers: the DataLoader already prefetches; use
    ``num_workers=0`` with ``.prefetch()`` instead.

    Call `set_epoch(epoch)` before each epoch (like DistributedSampler):
    it brings the chain to that epoch, so shuffles draw that epoch's order
    in every worker and rank.
    """

    def __init__(self, chain, rank=None, world_size=None, convert=True):
        super().__init__()
        if isinstance(chain, ReaderBase):
            self._chain, self._factory = chain, None
        elif callable(chain):
            self._chain, self._factory = None, chain
        else:
            raise TypeError("IterableDataset needs a reader chain or a callable returning one, "
                            f"got {type(chain).__name__}")
        self.rank = rank
        self.world_size = world_size
        self.convert = bool(convert)
        self._epoch = None
        self._resets = 0        # resets applied to the chain object in this process

    def set_epoch(self, epoch):
        """Read epoch `epoch` next (shuffles draw the order of (seed, epoch))."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch = int(epoch)

    def shard(self):
        """(num_shards, index) of the calling process (rank x worker)."""
        rank, world = rank_and_world_size(self.rank, self.world_size)
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return world * nw, rank * nw + wid

    def _chain_for_epoch(self):
        if self._factory is not None:
            chain = self._factory()
            if not isinstance(chain, ReaderBase):
                raise TypeError(f"the chain factory returned {type(chain).__name__}, not a reader chain")
            for _ in range(self._epoch or 0):
                chain.reset()
            return chain
        # A chain object: always restart it (in a DataLoader worker it is a
        # fork-time copy, possibly mid-epoch or with a prefetch thread that
        # did not survive the fork), then bring it to the requested epoch.
        n = 1 if self._epoch is None else max(1, self._epoch - self._resets)
        for _ in range(n):
            self._chain.reset()
        self._resets += n
        return self._chain

    def __iter__(self):
        num_shards, index = self.shard()
        chain = _shard_chain(self._chain_for_epoch(), num_shards, index)
        try:
            for item in chain:
                yield to_torch(item) if self.convert else item
        finally:
            if self._factory is not None:
                chain.close()
