"""PyTorch / JAX hand-off: every item exactly once across workers and ranks, zero-copy."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl
from readerlib.integrations import _shard_chain, rank_and_world_size
from readerlib.readers._prefetch import PrefetchReader
from readerlib.readers._multifile import ShardReader as StrideReader

try:
    import torch
    from readerlib.integrations.torch import IterableDataset, TensorWithLoD, to_torch
except ImportError:            # the sharding tests below still run without torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch")

N = 257


def make_chain(batch=True, prefetch=False):
    seqs = [np.full((i % 4, 2), i, np.float32) for i in range(N)]
    r = rl.ArrayReader({"id": np.arange(N, dtype=np.int64), "seq": seqs}).shuffle(31, seed=7)
    if batch:
        r = r.batch(6)
    if prefetch:
        r = PrefetchReader(r, capacity=2)
    return r


def _ids(loader):
    out = []
    for item in loader:
        ids = item[0]
        assert isinstance(ids, torch.Tensor)
        out.extend(ids.reshape(-1).tolist())
    return out


# ------------------------------------------------------------ StrideReader
@pytest.mark.parametrize("k", [1, 2, 3, 7, 300])
def test_stride_shards_partition_the_items(k):
    seen = []
    for i in range(k):
        s = StrideReader(rl.ArrayReader(np.arange(100)), k, i)
        mine = [int(x[0]) for x in s]
        assert mine == list(range(i, 100, k))
        assert [int(x[0]) for x in s] == mine            # next epoch, same shard
        seen += mine
    assert sorted(seen) == list(range(100))


def test_stride_bad_arguments():
    with pytest.raises(ValueError):
        StrideReader(rl.ArrayReader(np.arange(3)), 2, 2)
    with pytest.raises(ValueError):
        StrideReader(rl.ArrayReader(np.arange(3)), 0, 0)
    with pytest.raises(TypeError):
        StrideReader("not a reader", 2, 0)


def test_shard_chain_identity_for_one_shard():
    c = rl.ArrayReader(np.arange(3))
    assert _shard_chain(c, 1, 0) is c
    assert isinstance(_shard_chain(c, 2, 1), StrideReader)


def test_rank_and_world_size_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world_size() == (2, 4)
    assert rank_and_world_size(rank=1, world_size=2) == (1, 2)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError):
        rank_and_world_size()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert rank_and_world_size() == (0, 1)


# ------------------------------------------------- DataLoader, exactly once
@needs_torch
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch", [True, False])
def test_dataloader_sees_every_instance_once(num_workers, batch):
    ds = IterableDataset(lambda: make_chain(batch=batch), rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    ids = _ids(loader)
    assert sorted(ids) == list(range(N))


@needs_torch
@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_over_a_chain_object(num_workers):
    ds = IterableDataset(make_chain(), rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    for _ in range(2):
        assert sorted(_ids(loader)) == list(range(N))


@needs_torch
def test_dataloader_over_a_prefetching_chain_object_forked_into_workers():
    chain = make_chain(prefetch=True)
    chain.read_next()                        # its thread is running, mid-epoch, at fork time
    ds = IterableDataset(chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    assert sorted(_ids(loader)) == list(range(N))
    chain.close()


@needs_torch
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_and_workers_together_see_every_instance_once(num_workers):
    ids = []
    for rank in range(3):
        ds = IterableDataset(make_chain, rank=rank, world_size=3)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
        ids += _ids(loader)
    assert sorted(ids) == list(range(N))


@needs_torch
def test_set_epoch_changes_the_order_consistently_across_workers():
    ds = IterableDataset(make_chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        ids = _ids(loader)
        assert sorted(ids) == list(range(N))           # exactly once in every epoch
        orders.append(ids)
    assert orders[0] != orders[1] != orders[2]
    ds.set_epoch(1)
    assert _ids(loader) == orders[1]                   # an epoch's order is reproducible
    # the same epoch read by a single process holds the same items per position
    single = IterableDataset(make_chain, rank=0, world_size=1)
    single.set_epoch(1)
    want = make_chain()
    want.reset()
    assert [int(v) for b in want for v in b[0].data] == _ids(
        torch.utils.data.DataLoader(single, batch_size=None, num_workers=0))


@needs_torch
def test_torchrun_like_processes_see_every_instance_once(tmp_path):
    """Two processes with RANK/WORLD_SIZE set (as torchrun does), 2 workers each."""
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np, torch
        import readerlib as rl
        from readerlib.integrations.torch import IterableDataset
        N = {N}

        def make_chain():
            seqs = [np.full((i % 4, 2), i, np.float32) for i in range(N)]
            return rl.ArrayReader({{"id": np.arange(N, dtype=np.int64), "seq": seqs}}).shuffle(
                31, seed=7).batch(6)

        ds = IterableDataset(make_chain)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        print(json.dumps([int(v) for b in loader for v in b[0]]))
    """)
    procs = []
    for rank in range(2):
        where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                   PYTHONPATH=where + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path)))
    ids = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        ids += json.loads(out.strip().splitlines()[-1])
    assert sorted(ids) == list(range(N))


# ----------------------------------------------------------------- zero-copy
@needs_torch
def test_to_torch_is_zero_copy_and_keeps_memory_alive():
    chain = rl.ArrayReader({"x": np.arange(40, dtype=np.float32).reshape(10, 4),
                            "s": [np.full((i % 3, 2), i, np.int32) for i in range(10)]}).batch(5)
    batch = chain.read_next()
    x, s = to_torch(batch)
    assert x.data_ptr() == batch[0].data.ctypes.data
    assert isinstance(s, TensorWithLoD)
    assert s.data.data_ptr() == batch[1].data.ctypes.data
    assert s.lod[0].data_ptr() == batch[1].lod[0].ctypes.data
    assert s.lod[0].tolist() == batch[1].lod[0].tolist()
    want = x.clone()
    del batch
    for _ in chain:                          # the reader moves on; our tensor's block stays alive
        pass
    chain.close()
    assert torch.equal(x, want)


@needs_torch
def test_dataset_hands_out_zero_copy_tensors_with_num_workers_0(monkeypatch):
    import readerlib.integrations.torch as rt
    pairs = []

    def spy(item):
        out = to_torch(item)
        pairs.append((item[0].data.ctypes.data, out[0].data_ptr()))
        return out
    monkeypatch.setattr(rt, "to_torch", spy)
    chain = PrefetchReader(rl.ArrayReader(np.arange(60, dtype=np.int64).reshape(20, 3)).batch(4))
    ds = IterableDataset(chain, rank=0, world_size=1)
    seen = []
    for (x,) in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0):
        seen.append((x.data_ptr(), x))
    assert [p for _, p in pairs] == [p for p, _ in seen]            # the loop gets those tensors
    assert all(a == b for a, b in pairs)                            # ... viewing the batch memory
    assert torch.equal(torch.cat([x for _, x in seen]), torch.arange(60).reshape(20, 3))
    chain.close()


@needs_torch
def test_to_torch_instances():
    item = rl.ArrayReader({"a": np.arange(3.0), "b": np.arange(3)}).read_next()
    a, b = to_torch(item)
    assert a.item() == 0.0 and b.item() == 0 and b.dtype == torch.int64


@needs_torch
def test_dataset_rejects_non_chains():
    with pytest.raises(TypeError):
        IterableDataset(42)
    ds = IterableDataset(lambda: 42)
    with pytest.raises(TypeError, match="factory"):
        next(iter(ds))


# ----------------------------------------------------------------------- JAX
def test_to_jax_zero_copy():
    jax = pytest.importorskip("jax")
    from readerlib.integrations.jax import ArrayWithLoD, to_jax
    chain = rl.ArrayReader({"x": np.arange(40, dtype=np.float32).reshape(10, 4),
                            "s": [np.full((i % 3, 2), i, np.int32) for i in range(10)]}).batch(5)
    batch = chain.read_next()
    x, s = to_jax(batch)
    np.testing.assert_array_equal(np.asarray(x), batch[0].data)
    assert isinstance(s, ArrayWithLoD)
    np.testing.assert_array_equal(np.asarray(s.lod[0]), batch[1].lod[0])
    assert x.unsafe_buffer_pointer() == batch[0].data.ctypes.data
