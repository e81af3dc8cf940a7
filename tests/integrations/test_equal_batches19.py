"""IterableDataset(equal_batches=...): the same batch count on every rank and worker.

By default the dataset gives shard i of k (k = ranks x DataLoader workers) the
chain's batches i, i + k, ...: with N batches, shards get N // k or one more,
and a DDP loop hangs at the end of the epoch (the rank with a batch more waits
in its all-reduce for ever).  equal_batches keeps only whole groups of k
batches -- on by default under an initialised process group of more than one
process -- so every shard gets N // k; the dropped ones are the last N % k,
the same on every rank.
"""
import json
import textwrap

import numpy as np
import pytest

import readerlib as rl

import torch  # noqa: F401  (in the test extra: these tests run in CI)
import readerlib.integrations.torch as rl_torch
from readerlib.integrations.torch import IterableDataset
from helpers import run_ok_script

B = 3                                   # ids per batch (every batch full)


def chain_of(n_batches, prefetch=False):
    def make():
        c = rl.ArrayReader({"id": np.arange(n_batches * B, dtype=np.int64)}).shuffle(13, seed=3).batch(B)
        return c.prefetch(2) if prefetch else c
    return make


def reference(make, epochs=2):
    """The chain's own epochs, as lists of batches (tuples of ids)."""
    c = make()
    out = [[tuple(b[0].data.tolist()) for b in c] for _ in range(epochs)]
    c.close()
    return out


def as_worker(ds, wid, nw):
    ds._worker = lambda: (wid, nw)      # what get_worker_info() says in DataLoader worker wid of nw
    return ds


def passes(ds, epochs=2):
    return [[tuple(b[0].tolist()) for b in ds] for _ in range(epochs)]


# --------------------------------------------------------------------- counts
@pytest.mark.parametrize("world,nw", [(2, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("case", ["k*m", "k*m+1", "k*m+k-1", "k-1", "1"])
def test_every_shard_gets_n_over_k_and_the_kept_batches_exactly_once(world, nw, case):
    k, m = world * nw, 3
    n = {"k*m": k * m, "k*m+1": k * m + 1, "k*m+k-1": k * m + k - 1, "k-1": k - 1, "1": 1}[case]
    make = chain_of(n)
    ref = reference(make)
    got = {}
    for rank in range(world):
        for wid in range(nw):
            ds = as_worker(IterableDataset(make, rank=rank, world_size=world, equal_batches=True), wid, nw)
            got[rank * nw + wid] = passes(ds)
    for epoch in range(2):
        kept = (n // k) * k                # fewer than k batches: an empty epoch everywhere
        for index, eps in got.items():
            # shard i's batches of the chain's epoch, cut at the last whole group
            assert eps[epoch] == ref[epoch][index:kept:k], (index, epoch)
            assert len(eps[epoch]) == n // k
        union = sorted(b for eps in got.values() for b in eps[epoch])
        assert union == sorted(ref[epoch][:kept])           # each kept batch once
    assert ref[0] != ref[1] or n < 2                         # epochs advanced (a new order)


def test_without_equal_batches_ranks_still_differ_by_one_and_nothing_is_dropped():
    make = chain_of(7)
    counts = [len(passes(IterableDataset(make, rank=r, world_size=2, equal_batches=False), 1)[0])
              for r in range(2)]
    assert counts == [4, 3]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_workers_and_a_prefetching_chain(num_workers):
    # real DataLoader workers (fork) interleave the shards of one rank; with no
    # workers a chain ending in .prefetch() is read (and looked ahead) the same way
    n, world = 11, 2
    k = world * max(num_workers, 1)
    for prefetch in ([False, True] if num_workers == 0 else [False]):
        make = chain_of(n, prefetch=prefetch)
        ref = reference(chain_of(n))
        per_rank = []
        for rank in range(world):
            ds = IterableDataset(make, rank=rank, world_size=world, equal_batches=True)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers)
            per_rank.append([[tuple(b[0].tolist()) for b in loader] for _ in range(2)])
        for epoch in range(2):
            assert [len(r[epoch]) for r in per_rank] == [n // k * max(num_workers, 1)] * world
            assert sorted(b for r in per_rank for b in r[epoch]) == sorted(ref[epoch][:n // k * k])


def test_set_epoch_chooses_the_epoch_that_is_cut():
    make = chain_of(9)
    ref = reference(make, 4)
    ds = IterableDataset(make, rank=1, world_size=2, equal_batches=True)
    ds.set_epoch(3)
    assert passes(ds, 1)[0] == ref[3][1:8:2]
    assert ds.epoch == 3


def test_bad_equal_batches_is_a_type_error():
    with pytest.raises(TypeError, match="equal_batches must be True, False or None"):
        IterableDataset(chain_of(4), equal_batches="yes")


# --------------------------------------------------------------------- resume
def _states_and_items(ds, epochs=2):
    """Per epoch: the state before each item and after the last, and the items."""
    out = []
    for _ in range(epochs):
        it = iter(ds)
        states, items = [json.loads(json.dumps(ds.state_dict()))], []
        for b in it:
            items.append(tuple(b[0].tolist()))
            states.append(json.loads(json.dumps(ds.state_dict())))
        out.append((states, items))
    return out


def test_resume_at_every_cut_point_over_two_epochs():
    world, nw = 2, 2
    k = world * nw
    make = chain_of(k * 3 + k - 1)
    for rank in range(world):
        for wid in range(nw):
            def dataset():
                return as_worker(IterableDataset(make, rank=rank, world_size=world, equal_batches=True),
                                 wid, nw)
            run = _states_and_items(dataset())
            for epoch, (states, items) in enumerate(run):
                assert len(items) == 3
                for j, state in enumerate(states):
                    other = dataset()
                    other.load_state_dict(state)
                    assert passes(other, 1)[0] == items[j:], (rank, wid, epoch, j)
                    assert other.state_dict()["epoch"] == epoch
                    nxt = passes(other, 1)[0]                # then the next epoch, cut alike
                    if epoch + 1 < len(run):
                        assert nxt == run[epoch + 1][1]
                    assert len(nxt) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_mid_epoch_with_the_kept_batches_left(num_workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    make = chain_of(13)               # k = 2 or 4: 12 kept either way

    def loader():
        return sdl.StatefulDataLoader(IterableDataset(make, rank=0, world_size=2, equal_batches=True),
                                      batch_size=None, num_workers=num_workers)

    def collect(run, stop=None):
        out = []
        for b in run:
            out.append(tuple(b[0].tolist()))
            if stop is not None and len(out) == stop:
                break
        return out
    ref = loader()
    want = [collect(ref) for _ in range(2)]
    assert len(want[0]) == len(want[1]) == 6              # of rank 0's 7 (4 + 3 over 2 workers)
    for epoch, cut in [(0, 1), (0, 3), (1, 2), (1, len(want[1]) - 1)]:
        run = loader()
        for _ in range(epoch):
            collect(run)
        part = collect(run, stop=cut)
        sd = run.state_dict()
        del run
        resumed = loader()
        resumed.load_state_dict(sd)
        assert part + collect(resumed) == want[epoch], (epoch, cut)


def test_a_state_saved_without_equal_batches_after_the_shards_last_item_resumes_to_the_end():
    make = chain_of(7)                                   # shard 0 of 2: 4 batches, 3 when cut
    old = IterableDataset(make, rank=0, world_size=2, equal_batches=False)
    assert len(passes(old, 1)[0]) == 4
    state = old.state_dict()
    new = IterableDataset(make, rank=0, world_size=2, equal_batches=True)
    new.load_state_dict(state)
    assert passes(new, 1)[0] == []                       # that epoch is over ...
    assert passes(new, 1)[0] == reference(make)[1][0:6:2]   # ... and the next is cut
    bad = dict(state, taken=5)
    new.load_state_dict(bad)
    with pytest.raises(ValueError, match="past the end"):
        iter(new)


# ------------------------------------------------- the default (None: auto)
@pytest.mark.parametrize("group,world,want", [
    (None, 2, [4, 3]),                      # no process group: every batch, as before
    ((0, 2), 2, [3, 3]),                    # a DDP job: equal counts
    ((0, 2), 1, [7]),                       # each rank reads everything: nothing to even out
    ((0, 1), 2, [4, 3]),                    # a group of one process
])
def test_the_default_evens_out_ranks_under_an_initialised_process_group(monkeypatch, group, world, want):
    monkeypatch.setattr(rl_torch, "_distributed", lambda: group)
    make = chain_of(7)
    assert [len(passes(IterableDataset(make, rank=r, world_size=world), 1)[0]) for r in range(world)] == want
    # explicit False is never cut
    assert len(passes(IterableDataset(make, rank=0, world_size=world, equal_batches=False), 1)[0]) == \
        (7 + world - 1) // world


# --------------------------------------------- open_files(shard=...) chains
@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eq19")
    schema = rl.Schema([rl.Field("id", "int64")])
    paths = []
    for f, n in enumerate([130, 70, 95]):
        p = str(d / f"part-{f}.rio")
        with rl.RecordIOWriter(p, schema, chunk_size=128) as w:
            w.write_batch({"id": np.arange(1000 * f, 1000 * f + n, dtype=np.int64)})
        paths.append(p)
    return paths


def test_a_file_sharded_chain_needs_open_files_equal_batches(id_files):
    ds = IterableDataset(lambda: rl.open_files(id_files, shard=(0, 2)).batch(8), rank=0, world_size=2,
                         equal_batches=True)
    with pytest.raises(ValueError, match=r"equal_batches=True.*open_files\(shard=\.\.\.\).*"
                                         r"open_files\(\.\.\., equal_batches=True\)"):
        next(iter(ds))
    # with num_workers=0 too: the dataset splits nothing, the ranks would still differ
    ds = IterableDataset(lambda: rl.open_files(id_files, shard=(1, 2)).batch(8), rank=1, world_size=2,
                         equal_batches=True)
    with pytest.raises(ValueError, match="open_files"):
        next(iter(ds))


def test_open_files_equal_batches_then_the_dataset_evens_out_the_workers(id_files):
    world, nw = 2, 2
    counts, ids = {}, []
    for rank in range(world):
        def make(rank=rank):
            return (rl.open_files(id_files, shard=(rank, world), equal_batches=True)
                      .shuffle(16, seed=2).batch(8))
        full = reference(make, 1)[0]                  # the rank's own batches (open_files cut them)
        for wid in range(nw):
            ds = as_worker(IterableDataset(make, rank=rank, world_size=world, equal_batches=True), wid, nw)
            got = passes(ds, 1)[0]
            assert got == full[wid:len(full) // nw * nw:nw]
            counts[rank, wid] = len(got)
            ids += [i for b in got for i in b]
        # the default leaves a file-sharded chain's counts to open_files: every batch
        split = [passes(as_worker(IterableDataset(make, rank=rank, world_size=world), wid, nw), 1)[0]
                 for wid in range(nw)]
        assert split == [full[0::2], full[1::2]]
    assert len(set(counts.values())) == 1 and len(ids) == len(set(ids))


# ----------------------------------------------------- a real 2-process DDP job
DDP_RANK = textwrap.dedent("""
    import datetime, json, sys
    import numpy as np, torch, torch.distributed as dist
    import readerlib as rl
    from readerlib.integrations.torch import IterableDataset

    N = 23                              # batches: 23 = 2 * 11 + 1 = 4 * 5 + 3

    def make_chain():
        return rl.ArrayReader({"id": np.arange(N * 3, dtype=np.int64)}).shuffle(13, seed=3).batch(3)

    if __name__ == "__main__":
        store, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        # a lost step would hang the all-reduce: the group's timeout turns that into an error
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        log = {}
        for name, kw in [("workers0", dict(num_workers=0)),
                         ("fork2", dict(num_workers=2)),
                         ("spawn2", dict(num_workers=2, multiprocessing_context="spawn",
                                         persistent_workers=True))]:
            loader = torch.utils.data.DataLoader(IterableDataset(make_chain), batch_size=None, **kw)
            for epoch in range(2):
                ids = []
                for (b,) in loader:
                    loss = model(b.float().unsqueeze(1)).sum()
                    opt.zero_grad()
                    loss.backward()         # the all-reduce: every rank must take the step
                    opt.step()
                    ids.append(b.tolist())
                log[f"{name}/{epoch}"] = ids
            del loader
        dist.barrier()
        with open(out, "w") as f:
            json.dump(log, f)
        dist.destroy_process_group()
""")

DDP_DRIVER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, tempfile, time
    import numpy as np
    import readerlib as rl

    d = tempfile.mkdtemp()
    script = os.path.join(d, "rank.py")
    with open(script, "w") as f:
        f.write(RANK_SCRIPT)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    outs = [os.path.join(d, f"rank{r}.json") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, script, os.path.join(d, "store"), str(r), outs[r]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for r in range(2)]
    deadline = time.time() + 150
    try:
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r}: the DDP job hung")
            assert p.returncode == 0, f"rank {r} failed:\\n{err[-3000:]}"
    finally:
        for p in procs:                 # a rank and its DataLoader workers, never left behind
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    logs = []
    for o in outs:
        with open(o) as f:
            logs.append(json.load(f))
    c = rl.ArrayReader({"id": np.arange(23 * 3, dtype=np.int64)}).shuffle(13, seed=3).batch(3)
    ref = [[b[0].data.tolist() for b in c] for _ in range(2)]
    for name, k in [("workers0", 2), ("fork2", 4), ("spawn2", 4)]:
        for epoch in range(2):
            got = [logs[r][f"{name}/{epoch}"] for r in range(2)]
            assert [len(g) for g in got] == [23 // k * k // 2] * 2, (name, epoch, [len(g) for g in got])
            assert sorted(got[0] + got[1]) == sorted(ref[epoch][:23 // k * k]), (name, epoch)
    print("OK")
""")


def test_a_ddp_job_over_unequal_shards_ends_with_equal_counts():
    """2 ranks (gloo), DDP over a linear model, 23 batches: with the old default
    rank 0 took one step more per epoch (12 and 11 batches with no workers; 6,
    6, 6, 5 over 2 x 2 workers) and its last all-reduce waited for ever.  Under
    the initialised process group the dataset now cuts every epoch to whole
    groups of k: both ranks take the same steps, with fork and spawn workers."""
    run_ok_script(DDP_DRIVER.replace("RANK_SCRIPT", repr(DDP_RANK)), timeout=180)
