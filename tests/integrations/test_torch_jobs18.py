"""PyTorch training-job set-ups the other torch tests do not cover.

Each job runs in subprocesses with a time limit (a hang fails, it does not
stall CI).
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl

import torch  # noqa: F401  (in the test extra: these tests run in CI)
from helpers import run_ok_script


def _env():
    env = dict(os.environ)          # conftest's PYTHONPATH: the readerlib under test
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["GLOO_SOCKET_IFNAME"] = "lo"     # gloo between local processes (a CI host name may not resolve)
    return env


def _run_all(scripts, timeout=120):
    """Start every (path, args) at once (ranks rendezvous), wait for all; their stdouts."""
    procs = [subprocess.Popen([sys.executable, path, *args], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for path, args in scripts]
    outs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{p.args} did not finish within {timeout} s")
            assert p.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


# ---------------------------------------- torch.distributed without RANK / WORLD_SIZE
DIST_RANK = textwrap.dedent("""
    import glob, json, os, sys
    import torch, torch.distributed as dist
    import readerlib as rl
    from readerlib.integrations.torch import IterableDataset

    data, store, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    paths = sorted(glob.glob(os.path.join(data, "*.rio")))

    def make_chain():               # the chain splits the chunks between ranks, the dataset its workers
        return rl.open_files(paths, shard="auto").shuffle(29, seed=1).batch(8)

    if __name__ == "__main__":
        # as under mp.spawn / a custom launcher: the group has the rank, the environment not
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
        ds = IterableDataset(make_chain)
        assert ds.shard() == (2, rank)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2,
                                             multiprocessing_context="spawn", persistent_workers=True)
        print(json.dumps([[i for (ids,) in loader for i in ids.tolist()] for _ in range(2)]))
        dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def id_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("jobs18")
    schema = rl.Schema([rl.Field("id", "int64")])
    for f in range(3):
        with rl.RecordIOWriter(str(d / f"part-{f}.rio"), schema, chunk_size=200) as w:
            w.write_batch({"id": np.arange(100 * f, 100 * f + 100, dtype=np.int64)})
    return d


def test_spawned_workers_of_a_distributed_job_take_the_groups_rank(tmp_path, id_files):
    """torch.distributed initialised with rank= / world_size= and no RANK /
    WORLD_SIZE in the environment (mp.spawn and custom launchers): spawn and
    forkserver DataLoader workers have no process group, took themselves for
    rank 0 of 1, and every rank read every record (each twice per epoch over
    two ranks).  Now they take the main process's rank, for the dataset and
    for open_files(shard="auto") in the chain alike."""
    script = tmp_path / "rank.py"
    script.write_text(DIST_RANK)
    store = str(tmp_path / "store")
    outs = [json.loads(o.strip().splitlines()[-1])
            for o in _run_all([(str(script), [str(id_files), store, str(r)]) for r in range(2)])]
    for epoch in range(2):
        got = outs[0][epoch] + outs[1][epoch]
        assert sorted(got) == list(range(300)), (epoch, len(got), len(set(got)))
    assert outs[0][0] != outs[0][1]


# ------------------------------------------------------------------ to_torch
def test_to_torch_of_a_negatively_strided_array_is_a_tensor_not_an_abort():
    """torch.from_dlpack of a[::-1] aborted the interpreter ("Storage size
    calculation overflowed", an uncaught C++ error: no exception, the process
    died).  to_torch now copies such an array; the others stay views."""
    run_ok_script(textwrap.dedent("""
        import numpy as np, torch
        from readerlib.integrations.torch import to_torch
        a = np.arange(12, dtype=np.float32).reshape(3, 4)
        rev, view = to_torch((a[::-1], a[:, ::2]))
        assert torch.equal(rev, torch.from_numpy(a[::-1].copy()))
        assert torch.equal(view, torch.from_numpy(a[:, ::2].copy()))
        assert view.data_ptr() == a.ctypes.data          # still zero-copy where torch can view it
        (rows,) = to_torch((np.arange(5)[::-2],))
        assert rows.tolist() == [4, 2, 0]
        print("OK")
    """), timeout=60)


# ------------------------------------------------ Ctrl-C, then save and resume
CTRL_C = textwrap.dedent("""
    import os, signal, time
    import numpy as np
    import readerlib as rl
    from readerlib.integrations.torch import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    N = 80
    pressed = []

    def slow_then_ctrl_c(item):     # runs in the prefetch thread while the loop waits for batch 6
        if int(item[0]) == 25 and not pressed:
            pressed.append(True)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        return item

    def make_chain():               # num_workers=0 with .prefetch() at the end, as the docs advise
        return rl.ArrayReader({"id": np.arange(N, dtype=np.int64)}).map(slow_then_ctrl_c).batch(4).prefetch(2)

    def loader():
        return StatefulDataLoader(IterableDataset(make_chain, rank=0, world_size=1), batch_size=None,
                                  num_workers=0)

    run, seen = loader(), []
    try:
        for (ids,) in run:
            seen.extend(ids.tolist())
        raise AssertionError("no KeyboardInterrupt")
    except KeyboardInterrupt:       # a job's handler: save a checkpoint, then exit
        state = run.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [i for (ids,) in resumed for i in ids.tolist()]
    assert seen + rest == list(range(N)), (len(seen), sorted(set(range(N)) - set(seen + rest)))
    print("OK")
""")


def test_ctrl_c_while_the_loop_waits_on_a_prefetching_chain_loses_no_batch():
    """Ctrl-C while the loop waited in a prefetching chain's read: the read
    returned its batch and Python raised KeyboardInterrupt before the dataset
    handed it on (the interpreter checks for signals when a call returns), so
    the batch was counted as handed out.  A checkpoint saved in the
    KeyboardInterrupt handler then resumed one batch later: 4 records lost.
    The dataset now counts the batches it yields, not those its chain read."""
    pytest.importorskip("torchdata.stateful_dataloader")
    run_ok_script(CTRL_C, timeout=60)
