"""PyTorch hand-off: an IterableDataset over a reader chain, zero-copy tensors.

Examples
--------
>>> from readerlib.integrations.torch import IterableDataset
>>> ds = IterableDataset(lambda: rl.RecordIOReader("train.rio").shuffle(10_000, seed=0).batch(256))
>>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
>>> for epoch in range(3):          # each pass is the next epoch (a new shuffle order)
...     for feats, label in loader:
...         ...

See docs/training_loop.md.
"""
import os
from collections import namedtuple

import numpy as np
import torch
import torch.utils.data

from readerlib._keyed import _Keyed
from readerlib.readers._base import ReaderBase
from readerlib.tensor import LoDTensor

from . import _sharding
from ._sharding import (_shard_chain, chain_sharding, rank_and_world_size, ranks_trimmed_to_equal,
                        unseeded_shuffles)

__all__ = ["IterableDataset", "TensorWithLoD", "to_torch"]

#: A sequence field of a batch in torch: ``data`` [rows, *shape] and ``lod``,
#: a tuple of int64 offset tensors (``lod[0][i]:lod[0][i+1]`` are instance i's rows).
TensorWithLoD = namedtuple("TensorWithLoD", ["data", "lod"])


def _tensor(a):
    # DLPack: the tensor shares the array's memory (and keeps it alive).
    if isinstance(a, np.ndarray) and any(s < 0 for s in a.strides):
        # torch aborts the process (an uncaught C++ error, not an exception)
        # on a DLPack tensor with a negative stride (a[::-1]): copy those
        a = np.ascontiguousarray(a)
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
        reader's memory (DLPack); they keep it alive.  (A NumPy array with a
        negative stride, which a chain never hands out, is copied: torch
        cannot view it.)
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
    return type(item)._make(out) if isinstance(item, _Keyed) else tuple(out)   # keeps the keys



def _distributed():
    """(rank, world_size) of this process's initialised torch.distributed, else None."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


_SLOTS = 256                # DataLoader worker ids the shared epoch counters cover
_STATE_VERSION = 1
# a later iter() repositioned the chain this pass reads: reading on would
# split the new pass's items between the two iterators
_INVALIDATED = ("this iterator of the IterableDataset was invalidated: another iterator was created "
                "from the same dataset in this process (a new pass, e.g. a second iter(loader)), and "
                "both read one reader chain.  Finish or drop an iterator before starting the next pass")


class IterableDataset(torch.utils.data.IterableDataset):
    """A reader chain as a `torch.utils.data.IterableDataset`.

    Every (rank, worker) pair reads its own shard of the chain's items, so
    across all ranks and DataLoader workers each item is seen exactly once
    per epoch (with `equal_batches`, each item it keeps: the default in a
    DDP job).  Use it with ``DataLoader(ds, batch_size=None, ...)``: the
    chain already batches.

    Parameters
    ----------
    chain : ReaderBase or callable
        A zero-argument callable that builds the chain (each process then
        builds its own), or a chain object (it pickles, so ``spawn`` and
        ``forkserver`` workers work too).  **Every shard must see the same
        order**: give every ``.shuffle()`` (and ``open_files(...,
        shuffle_files=True)``) a ``seed=``; an unseeded one read by more
        than one shard raises ValueError.  A chain object positioned by
        ``set_state`` continues from there in the first epoch.
    rank, world_size : int, optional
        Default: torch.distributed when initialised, else the RANK and
        WORLD_SIZE environment variables (what torchrun sets), else 0 and 1.
    convert : bool, default True
        Hand out torch tensors (`to_torch`, zero-copy); False hands out the
        readerlib items themselves.
    equal_batches : bool or None, default None
        True: every DataLoader worker of every rank gets the same number of
        items per epoch, so a DDP loop never waits in an all-reduce for a
        step another rank does not take.  The epoch is cut to whole groups
        of k items (k = world_size x num_workers): the last ``N % k`` items
        of the chain's epoch (the same on every rank) are dropped, and with
        fewer than k items every shard's epoch is empty.  None (the
        default): True when torch.distributed is initialised with more than
        one process and the dataset splits between ``world_size > 1`` ranks,
        else False.  False: every item, and ranks may differ by one.  With a
        chain split by rank by ``open_files(..., shard=...)`` the ranks'
        counts are that ``open_files``' business: True there needs
        ``open_files(..., equal_batches=True)`` (ValueError otherwise) and
        evens out the rank's workers; None leaves the chain's counts as
        they are.

    Notes
    -----
    **Sharding happens in one place.**  By default the dataset splits the
    chain's items: shard i of k takes items i, i+k, ... (k = world_size x
    num_workers), so every shard reads the chain below in full and ranks may
    differ by one item per epoch.  A chain built with
    ``open_files(..., shard="auto")`` (or ``shard=(rank, world_size)``) is
    already split between ranks, by chunk: the dataset sees that and splits
    only between the rank's DataLoader workers.  Any other sharding inside
    the chain (another rank/world, a ``.shard()``) together with the
    dataset's own raises ValueError naming both, instead of losing data.

    **Equal counts for DDP**: with ``equal_batches`` (the default under an
    initialised torch.distributed group of more than one process) each
    shard looks ahead, past its own item, over the other shards' items of
    the item's group of k (which it reads anyway) and keeps the item only
    when the group is complete, as ``DistributedSampler(drop_last=True)``
    keeps only whole rounds.  No length is needed.

    **Epochs advance by themselves**: each new pass over the DataLoader
    (each ``iter()`` of the dataset in a worker) is the next epoch, with a
    new shuffle order -- with ``persistent_workers=True`` too.  The first
    is epoch 0, whatever ``num_workers``.  `set_epoch(epoch)` chooses the
    next epoch explicitly (like DistributedSampler).

    **Checkpoints**: `state_dict()` / `load_state_dict()` follow torchdata's
    ``StatefulDataLoader`` protocol (called in each worker, restored per
    worker), so a job resumed from ``loader.state_dict()`` continues with
    exactly the batches it would have seen.  Resume with the same chain,
    world size and ``num_workers``.

    With ``num_workers > 0`` the DataLoader moves each batch from its worker
    through shared memory (one copy, made by PyTorch); with
    ``num_workers=0`` batches reach the loop without any copy.  Do not put
    `.prefetch()` inside a chain read by DataLoader workers: the DataLoader
    already prefetches; use ``num_workers=0`` with ``.prefetch()`` instead.
    """

    def __init__(self, chain, rank=None, world_size=None, convert=True, equal_batches=None):
        super().__init__()
        if equal_batches is not None and not isinstance(equal_batches, (bool, np.bool_)):
            raise TypeError(f"equal_batches must be True, False or None, got {equal_batches!r}")
        if isinstance(chain, ReaderBase):
            chain._check_open()
            if chain._epoch_started():        # like iter(chain): read from, so the next epoch
                chain.reset()
            self._chain, self._factory = chain, None
            # the dataset's epoch 0 starts here (a chain positioned by set_state continues)
            self._origin = chain.get_state()
        elif callable(chain):
            self._chain, self._factory = None, chain
            self._origin = None
        else:
            raise TypeError("IterableDataset needs a reader chain or a callable returning one, "
                            f"got {type(chain).__name__}")
        self.rank = rank
        self.world_size = world_size
        self.convert = bool(convert)
        self.equal_batches = None if equal_batches is None else bool(equal_batches)
        # Next epoch per DataLoader worker id, in shared memory: workers that
        # are new processes every epoch, persistent ones and set_epoch() in
        # the main process all see the same counters.
        self._epochs = torch.zeros(_SLOTS, dtype=torch.int64).share_memory_()
        self._pending = None          # a load_state_dict() state, for the next iter()
        self._local = None            # this process's chain (pid, base, origin, epoch it is in)
        self._cur = None              # the iteration running in this process
        self._parent_dist = None      # torch.distributed's (rank, world) where we were pickled

    # -- pickling (spawn / forkserver workers) ----------------------------------
    def __getstate__(self):
        d = dict(self.__dict__)
        d["_local"] = None            # chains of this process stay here
        d["_cur"] = None
        # A spawn / forkserver worker has no torch.distributed: it would take
        # itself for rank 0 of 1 (or read RANK/WORLD_SIZE, which mp.spawn-style
        # launchers do not set), and every rank would read every item.  The
        # worker gets the rank of the process that pickled the dataset.
        d["_parent_dist"] = _distributed() or self._parent_dist
        return d

    def __setstate__(self, d):
        d.setdefault("_parent_dist", None)
        d.setdefault("equal_batches", False)
        self.__dict__.update(d)

    def _adopt_parent_rank(self):
        # in a DataLoader worker without torch.distributed of its own, the main
        # process's group is this process's (for the dataset and for a chain the
        # factory builds with open_files(..., shard="auto") alike)
        if (self._parent_dist is not None and torch.utils.data.get_worker_info() is not None
                and _distributed() is None):
            _sharding._parent_distributed = tuple(self._parent_dist)

    # -- epochs -------------------------------------------------------------------
    def set_epoch(self, epoch):
        """Make the next pass over the data epoch `epoch` (then epoch + 1, ...)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epochs.fill_(int(epoch))

    @property
    def epoch(self):
        """The epoch being read in this process (None before the first pass)."""
        return None if self._cur is None else self._cur["epoch"]

    def _worker(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if nw > _SLOTS:
            raise ValueError(f"IterableDataset supports up to {_SLOTS} DataLoader workers, got {nw}")
        return wid, nw

    def _note_epoch_begun(self, wid, nw, epoch):
        # worker wid owns the counters wid, wid + nw, ...: after a pass with nw
        # workers every counter agrees, whatever num_workers the next pass has
        self._epochs[wid::nw] = epoch + 1

    def shard(self):
        """(num_shards, index) of the calling process (rank x worker), before any
        sharding the chain does itself (see Notes)."""
        self._adopt_parent_rank()
        rank, world = rank_and_world_size(self.rank, self.world_size)
        wid, nw = self._worker()
        return world * nw, rank * nw + wid

    # -- the chain of this process ------------------------------------------------
    def _base_chain(self):
        pid = os.getpid()
        if self._local is not None and self._local["pid"] == pid:
            return self._local
        if self._factory is not None:
            chain = self._factory()
            if not isinstance(chain, ReaderBase):
                raise TypeError(f"the chain factory returned {type(chain).__name__}, not a reader chain")
            if chain._epoch_started():
                chain.reset()
            origin = chain.get_state()
        else:
            chain, origin = self._chain, self._origin
        self._local = {"pid": pid, "base": chain, "origin": origin, "epoch": None}
        return self._local

    def _split(self, base, rank, world, wid, nw):
        """(num_shards, index, by_files) this process takes of `base`'s items;
        by_files: the chain itself splits by rank (open_files(shard=...))."""
        total, index = world * nw, rank * nw + wid
        found = chain_sharding(base)
        if not found or total == 1:
            return total, index, False
        if len(found) == 1 and found[0][1] == "files" and found[0][2] == (rank, world):
            return nw, wid, True        # the chain splits by rank (by chunk); we split its workers
        chain_says = " and ".join(d for d, _, _ in found)
        raise ValueError(
            f"the chain is already sharded ({chain_says}) and IterableDataset shards it again by "
            f"rank and DataLoader worker (rank {rank} of {world}, worker {wid} of {nw}): records "
            f"would be lost.  Shard in one place: drop the chain's sharding (IterableDataset "
            f"splits between ranks and workers), or use open_files(..., shard='auto') with the "
            f"rank and world size IterableDataset uses ({rank}, {world}).")

    def _position(self, loc, epoch, start):
        """Bring this process's chain to the start of `epoch` (or to `start`, a
        saved epoch start); return the epoch's start state."""
        base = loc["base"]
        if start is not None:
            base.set_state(start)
        elif loc["epoch"] is not None and loc["epoch"] + 1 == epoch:
            base.reset()                         # one reset: the next epoch
        else:
            origin = loc["origin"]
            if epoch == 0:
                base.set_state(origin)
            else:
                base.set_state(dict(origin, position=0))
                for _ in range(epoch):
                    base.reset()
        loc["epoch"] = epoch
        return base.get_state()

    def __iter__(self):
        pending = self._pending
        try:
            it = self._start_pass(pending)
        except BaseException:
            self._pending = pending           # a loaded state is not lost by a failed start
            raise
        self._pending = None
        return it

    def close(self):
        """Close the chain this process built (a factory's); the dataset can be iterated again."""
        loc, self._local, self._cur = self._local, None, None
        if loc is not None and loc["pid"] == os.getpid() and self._factory is not None:
            loc["base"].close()

    def _start_pass(self, pending):
        self._adopt_parent_rank()
        rank, world = rank_and_world_size(self.rank, self.world_size)
        wid, nw = self._worker()
        epoch = int(pending["epoch"]) if pending is not None else int(self._epochs[wid])
        loc = self._base_chain()
        base = loc["base"]
        k, index, by_files = self._split(base, rank, world, wid, nw)
        whole_groups = self._whole_groups(base, k, rank, world, by_files)
        if k > 1:
            unseeded = unseeded_shuffles(base)
            if unseeded:
                raise ValueError(
                    f"{' and '.join(unseeded)} in the chain has no seed, and the chain is read by "
                    f"{k} shards (rank {rank} of {world} x {nw} DataLoader workers): each would "
                    f"draw its own order, so records would be repeated and others never seen.  "
                    f"Pass seed= (the same in every process), e.g. .shuffle(n, seed=0) or "
                    f"open_files(..., shuffle_files=True, seed=0)")
        if pending is not None and pending["shard"] != [k, index]:
            raise ValueError(
                f"load_state_dict: the state was saved by shard {pending['shard'][1]} of "
                f"{pending['shard'][0]}; this process is shard {index} of {k} (rank {rank} of "
                f"{world}, worker {wid} of {nw}): resume with the same world size and num_workers")
        start = self._position(loc, epoch, pending["start"] if pending is not None else None)
        taken = int(pending["taken"]) if pending is not None else 0
        if whole_groups:
            # the shard reads `base` itself: after its j-th item it stands at
            # (j + 1) * k, the end of that item's group.  (A state saved without
            # equal_batches after the shard's last item may stand short of
            # taken * k: that epoch is over all the same.)
            view = base
            past_end = taken and view._skip(taken * k) < index + (taken - 1) * k + 1
        else:
            view = _shard_chain(base, k, index)
            past_end = taken and view._skip(taken) != taken
        if past_end:
            raise ValueError(f"load_state_dict: the state's position ({taken} items into epoch "
                             f"{epoch}) is past the end of this shard's epoch")
        self._note_epoch_begun(wid, nw, epoch)
        # "taken" counts the items this pass has yielded, not those the chain
        # has read: a KeyboardInterrupt raised as a read returns (Python checks
        # for signals when a call returns; a loop waiting in a prefetcher's read
        # gets Ctrl-C there) drops the item the chain counted, and the state
        # must hand it out again after a resume.
        cur = {"epoch": epoch, "start": start, "shard": [k, index], "view": view,
               "taken": taken, "rank": rank, "world": world}
        self._cur = cur
        if whole_groups:
            return self._generate_whole_groups(view, k, index, cur)
        return self._generate(view, cur)

    def _whole_groups(self, base, k, rank, world, by_files):
        """Whether this pass keeps only whole groups of k items (equal_batches)."""
        equal = self.equal_batches
        if by_files:
            # open_files splits the ranks: only it can make their counts equal
            if equal and not ranks_trimmed_to_equal(base):
                raise ValueError(
                    f"equal_batches=True: the chain is split between ranks by open_files(shard=...) "
                    f"(rank {rank} of {world}), which reads only this rank's files, so the dataset "
                    f"cannot see the other ranks' counts.  Pass open_files(..., equal_batches=True) "
                    f"(it trims every rank to the same record count; the dataset then evens out "
                    f"the rank's DataLoader workers), or let the dataset split the ranks (no shard= "
                    f"in open_files)")
            return bool(equal) and k > 1
        if equal is None:                     # a DDP-style job: equal counts, else it hangs
            group = _distributed() or _sharding._parent_distributed
            equal = world > 1 and group is not None and group[1] > 1
        return bool(equal) and k > 1

    def _generate(self, view, cur):
        convert = self.convert
        while True:
            if self._cur is not cur:
                raise RuntimeError(_INVALIDATED)
            item = view.read_next()
            if item is None:
                return
            out = to_torch(item) if convert else item
            cur["taken"] += 1
            yield out

    def _generate_whole_groups(self, base, k, index, cur):
        # shard `index` of k reads `base` itself: the other shards' items before
        # its own, its own, then the rest of that item's group of k -- which the
        # next item's skip would read anyway -- to know the group is whole.  The
        # partial last group is dropped by every shard alike.
        convert = self.convert
        after = k - 1 - index
        while True:
            if self._cur is not cur:
                raise RuntimeError(_INVALIDATED)
            if index and base._skip(index) != index:
                return
            item = base.read_next()
            if item is None:
                return
            if after and base._skip(after) != after:
                return                        # the last, partial group: nobody's
            out = to_torch(item) if convert else item
            cur["taken"] += 1
            yield out

    # -- checkpoints (torchdata StatefulDataLoader protocol) ----------------------
    def state_dict(self):
        """This process's position: the epoch, where the epoch started (the
        chain's state) and how many items this shard has handed out.  A small
        JSON-serialisable dict.  StatefulDataLoader calls it in each worker."""
        cur = self._cur
        if cur is None:
            pending = self._pending
            if pending is not None:
                return dict(pending)
            wid, _ = self._worker()
            return {"version": _STATE_VERSION, "epoch": int(self._epochs[wid]), "start": None,
                    "taken": 0, "shard": None}
        return {"version": _STATE_VERSION, "epoch": int(cur["epoch"]), "start": cur["start"],
                "taken": int(cur["taken"]), "shard": list(cur["shard"])}

    def load_state_dict(self, state):
        """Continue from `state_dict()` on the next pass (see there)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or not {
                "epoch", "start", "taken", "shard"} <= set(state):
            raise ValueError(f"load_state_dict takes a dict made by IterableDataset.state_dict() "
                             f"(version {_STATE_VERSION}), got {state!r:.200}")
        if state["start"] is None:       # saved before the epoch began: just its number
            self._pending = None
            wid, nw = self._worker()
            self._epochs[wid::nw] = int(state["epoch"])
            return
        self._pending = dict(state)
        self._cur = None
