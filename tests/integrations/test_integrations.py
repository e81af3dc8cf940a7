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
from readerlib.readers._passes import ShardReader as StrideReader

import torch          # in the test extra: these tests run in CI
from readerlib.integrations.torch import IterableDataset, TensorWithLoD, to_torch

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
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch", [True, False])
def test_dataloader_sees_every_instance_once(num_workers, batch):
    ds = IterableDataset(lambda: make_chain(batch=batch), rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    ids = _ids(loader)
    assert sorted(ids) == list(range(N))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_over_a_chain_object(num_workers):
    ds = IterableDataset(make_chain(), rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
    for _ in range(2):
        assert sorted(_ids(loader)) == list(range(N))


def test_dataloader_over_a_prefetching_chain_object_forked_into_workers():
    chain = make_chain(prefetch=True)
    chain.read_next()                        # its thread is running, mid-epoch, at fork time
    ds = IterableDataset(chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    assert sorted(_ids(loader)) == list(range(N))
    chain.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_and_workers_together_see_every_instance_once(num_workers):
    ids = []
    for rank in range(3):
        ds = IterableDataset(make_chain, rank=rank, world_size=3)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
        ids += _ids(loader)
    assert sorted(ids) == list(range(N))


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


def test_to_torch_instances():
    item = rl.ArrayReader({"a": np.arange(3.0), "b": np.arange(3)}).read_next()
    a, b = to_torch(item)
    assert a.item() == 0.0 and b.item() == 0 and b.dtype == torch.int64


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


# ------------------------------------------- one place decides sharding (issue 11)
SCHEMA_ID = rl.Schema([rl.Field("id", "int64")])


@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    """4 RecordIO files of 500 ids each, small chunks (so there is something to shard)."""
    d = tmp_path_factory.mktemp("ids")
    paths = []
    for f in range(4):
        p = str(d / f"part-{f}.rio")
        with rl.RecordIOWriter(p, SCHEMA_ID, chunk_size=512) as w:
            w.write_batch({"id": np.arange(500 * f, 500 * (f + 1), dtype=np.int64)})
        paths.append(p)
    return paths


def _loader_ids(ds, num_workers, **kw):
    return _ids(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers, **kw))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_open_files_shard_auto_inside_the_dataset_loses_nothing(id_files, monkeypatch, num_workers):
    # The README's open_files(shard="auto") wrapped in the dataset: it used to shard twice
    # (1000 of 2000 ids per epoch); the dataset now splits only the rank's workers.
    monkeypatch.setenv("WORLD_SIZE", "2")
    ids = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = IterableDataset(lambda: rl.open_files(id_files, shard="auto").shuffle(64, seed=1).batch(16))
        ids += _loader_ids(ds, num_workers)
    assert sorted(ids) == list(range(2000))


def test_chain_and_dataset_sharding_that_disagree_raise_naming_both(id_files):
    ds = IterableDataset(lambda: rl.open_files(id_files, shard=(0, 2)).batch(16), rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"open_files\(shard=\(0, 2\)\).*rank 0 of 3"):
        next(iter(ds))
    ds = IterableDataset(lambda: rl.ArrayReader(np.arange(10)).shard(2, 0).batch(2), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"\.shard\(2, 0\).*rank 0 of 2"):
        next(iter(ds))
    with pytest.raises(ValueError, match=r"\.shard\(2, 1\)"):       # raised in a worker, re-raised here
        _loader_ids(IterableDataset(lambda: rl.ArrayReader(np.arange(10)).shard(2, 1).batch(2),
                                    rank=0, world_size=1), 2)
    # a .shard() the dataset does not add to (one process, no workers) is the user's own
    ds = IterableDataset(lambda: rl.ArrayReader(np.arange(10)).shard(2, 1).batch(2), rank=0, world_size=1)
    assert _loader_ids(ds, 0) == [1, 3, 5, 7, 9]


def test_rank_helper_is_shared_by_open_files_and_the_dataset(monkeypatch):
    from readerlib.readers.files import shard_from_env
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert shard_from_env() == rank_and_world_size() == (1, 3)
    monkeypatch.setenv("RANK", "x")
    for f in (shard_from_env, rank_and_world_size):
        with pytest.raises(ValueError, match="RANK"):
            f()


# ------------------------------------------------- unseeded shuffles (issue 11)
def _unseeded_chain():
    return rl.ArrayReader(np.arange(200)).shuffle(64).batch(8)


def test_unseeded_shuffle_under_two_workers_raises_saying_to_pass_seed():
    # it used to give 1507 distinct of 2000, 493 twice
    ds = IterableDataset(_unseeded_chain, rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"\.shuffle\(64\).*no seed.*seed="):
        _loader_ids(ds, 2)


def test_unseeded_shuffle_under_two_ranks_raises():
    with pytest.raises(ValueError, match="seed="):
        _loader_ids(IterableDataset(_unseeded_chain, rank=1, world_size=2), 0)


def test_unseeded_file_shuffle_under_two_workers_raises(id_files):
    ds = IterableDataset(lambda: rl.open_files(id_files, shuffle_files=True).batch(16), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"shuffle_files=True.*seed="):
        _loader_ids(ds, 2)


def test_unseeded_shuffle_in_one_process_still_works():
    ds = IterableDataset(_unseeded_chain, rank=0, world_size=1)
    assert sorted(_loader_ids(ds, 0)) == list(range(200))


# ------------------------------------------------------------ epochs (issue 11)
def _reference_epochs(make, n):
    """The ids of epochs 0..n-1 of a chain read directly (the truth)."""
    c = make()
    out = [[int(v) for b in c for v in b[0].data] for _ in range(n)]
    c.close()
    return out


@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_epochs_advance_by_themselves(num_workers, persistent):
    ds = IterableDataset(make_chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers,
                                         persistent_workers=persistent)
    got = [_ids(loader) for _ in range(3)]
    want = _reference_epochs(make_chain, 3)
    assert all(sorted(g) == list(range(N)) for g in got)
    assert got[0] != got[1] != got[2] != got[0]                     # a new order every epoch
    # epoch k is the chain's own epoch k: workers take every other batch of it and the
    # DataLoader interleaves them round-robin, so even the order is the chain's
    assert got == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epoch_zero_is_the_same_for_every_num_workers(num_workers):
    # "epoch 0" with num_workers=2 used to be the chain's epoch 1: compare as multisets of
    # batches (workers interleave batches, each batch's content is fixed by the epoch)
    def batches(nw, chain_object):
        ds = IterableDataset(make_chain() if chain_object else make_chain, rank=0, world_size=1)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=nw)
        return sorted(tuple(b[0].tolist()) for b in loader)
    ref = make_chain()
    want = sorted(tuple(b[0].data.tolist()) for b in ref)          # epoch 0 of the chain itself
    # with 2 workers each worker reads every other batch of the same epoch-0 stream
    for chain_object in (False, True):
        got = batches(num_workers, chain_object)
        assert got == want, f"num_workers={num_workers}, chain object={chain_object}"


def test_set_epoch_reaches_persistent_workers():
    # with persistent_workers=True set_epoch used to be ignored (the same order 3 times)
    ds = IterableDataset(make_chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in (0, 1, 1, 2):
        ds.set_epoch(epoch)
        orders.append(_ids(loader))
    assert orders[1] == orders[2]                                  # set_epoch(1) twice: the same
    assert orders[0] != orders[1] != orders[3]
    ref = _reference_epochs(make_chain, 3)
    assert [sorted(o) for o in orders] == [sorted(ref[e]) for e in (0, 1, 1, 2)]


def test_a_chain_object_positioned_by_set_state_continues_from_there():
    # the dataset used to reset the chain: 63 batches came back instead of the 58 left
    ref = make_chain()
    all_batches = [b[0].data.tolist() for b in ref]
    src = make_chain()
    it = iter(src)
    for _ in range(5):
        next(it)
    state = src.get_state()
    chain = make_chain()
    chain.set_state(state)
    ds = IterableDataset(chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    assert [b[0].tolist() for b in loader] == all_batches[5:]
    # ... and the next pass is the chain's next epoch, in full
    ref.reset()
    assert [b[0].tolist() for b in loader] == [b[0].data.tolist() for b in ref]


# ------------------------------------------------- checkpoints: the protocol
def _collect(loader, stop_after=None):
    out = []
    for b in loader:
        out.append(tuple(b[0].tolist()))
        if stop_after is not None and len(out) == stop_after:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_protocol_per_worker_resumes_exactly(num_workers):
    """The StatefulDataLoader protocol done by hand: each worker's dataset state
    after its j-th item, restored in a fresh dataset, gives that worker's rest."""
    k = max(num_workers, 1)
    for wid in range(k):
        ds = IterableDataset(make_chain, rank=0, world_size=1)
        ds._worker = lambda wid=wid: (wid, k)             # what get_worker_info() says in a worker
        for epoch in range(2):
            it = iter(ds)
            states = [json.loads(json.dumps(ds.state_dict()))]
            items = []
            for b in it:
                items.append(tuple(b[0].tolist()))
                states.append(json.loads(json.dumps(ds.state_dict())))
            assert ds.state_dict()["epoch"] == epoch
            for j in range(0, len(states), 5):
                other = IterableDataset(make_chain, rank=0, world_size=1)
                other._worker = ds._worker
                other.load_state_dict(states[j])
                assert [tuple(b[0].tolist()) for b in other] == items[j:], (wid, epoch, j)
                # ... and the pass after it is the next epoch
                assert other.state_dict()["epoch"] == epoch
                nxt = [tuple(b[0].tolist()) for b in other]
                assert other.state_dict()["epoch"] == epoch + 1 and len(nxt) > 0


def test_load_state_dict_refuses_another_shard_or_chain():
    ds = IterableDataset(make_chain, rank=0, world_size=2)
    it = iter(ds)
    next(it)
    st = ds.state_dict()
    other = IterableDataset(make_chain, rank=0, world_size=3)
    other.load_state_dict(st)
    with pytest.raises(ValueError, match="shard 0 of 2.*shard 0 of 3"):
        iter(other)
    other = IterableDataset(lambda: make_chain().reader.batch(7), rank=0, world_size=2)
    other.load_state_dict(st)
    with pytest.raises(ValueError, match="batch_size is 6 in the state, 7 in this chain"):
        iter(other)
    with pytest.raises(ValueError, match="state_dict"):
        other.load_state_dict({"position": 3})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_with_exactly_the_batches_left(num_workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def loader():
        return sdl.StatefulDataLoader(IterableDataset(make_chain, rank=0, world_size=1), batch_size=None,
                                      num_workers=num_workers)
    ref = loader()
    want = [_collect(ref) for _ in range(3)]
    assert want[0] != want[1] and sorted(sum(want[0], ())) == sorted(sum(want[1], ())) == list(range(N))
    for epoch, cut in [(0, 0), (0, 7), (1, 1), (1, 20), (0, len(want[0]))]:
        run = loader()
        for e in range(epoch):
            _collect(run)
        # (the end-of-epoch case saves after the loop has finished the epoch, as a training loop does)
        part = _collect(run, stop_after=cut if cut < len(want[0]) else None) if cut else []
        sd = run.state_dict()
        del run
        resumed = loader()
        resumed.load_state_dict(sd)
        rest = _collect(resumed)
        if cut == len(want[0]):           # saved at the end of the epoch: the next one follows
            assert rest == want[epoch + 1]
        else:
            assert part + rest == want[epoch], (epoch, cut)
            assert _collect(resumed) == want[epoch + 1]


# ------------------------------------------------------ spawn / forkserver workers
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_chain_object_under_spawn_and_forkserver_workers(context):
    # a chain object used to fail to pickle: TypeError: no default __reduce__ ...
    chain = make_chain()
    ds = IterableDataset(chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    got = [_ids(loader) for _ in range(2)]
    assert [sorted(g) for g in got] == [list(range(N))] * 2
    assert got == _reference_epochs(make_chain, 2)          # the chain's epochs 0 and 1, in order


def test_a_failed_start_keeps_the_loaded_state_and_close_releases_the_chain():
    ds = IterableDataset(make_chain, rank=0, world_size=1)
    it = iter(ds)
    for _ in range(3):
        next(it)
    st = ds.state_dict()
    rest = [tuple(b[0].tolist()) for b in it]
    other = IterableDataset(make_chain, rank=0, world_size=1)
    other.load_state_dict(st)
    other.rank, other.world_size = 0, 3                 # a wrong world size: refused ...
    with pytest.raises(ValueError, match="shard 0 of 1"):
        iter(other)
    other.rank, other.world_size = 0, 1                 # ... and the state is still there
    assert [tuple(b[0].tolist()) for b in other] == rest
    chain = other._local["base"]
    other.close()
    assert chain.closed
    assert sorted(_loader_ids(other, 0)) == list(range(N))   # a new chain on the next pass


def test_a_second_iterator_in_one_process_invalidates_the_first():
    """Two passes over one dataset in one process share its chain: the first
    iterator, read on after a second was made, got items of the second's pass
    (each item to one of the two, silently).  Now it raises, like torchdata's
    single-iterator rule; the second pass is a whole epoch."""
    ds = IterableDataset(make_chain, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    first = iter(loader)
    head = next(first)[0].reshape(-1).tolist()
    second = iter(loader)
    got = [t for item in second for t in item[0].reshape(-1).tolist()]
    with pytest.raises(RuntimeError, match="invalidated: another iterator was created"):
        next(first)
    want = _reference_epochs(make_chain, 2)
    assert head == want[0][:len(head)] and got == want[1]
