"""torchrun-like: RANK/WORLD_SIZE over 3 processes x 2 DataLoader workers each (issue 11).

Every record exactly once per epoch across the ranks, a different order each
epoch, and a rank SIGKILLed mid-epoch and restarted from its last
``StatefulDataLoader.state_dict()`` delivers exactly what an uninterrupted
run delivers.  Each rank is a subprocess with a time limit, so a hang fails
instead of stalling CI.
"""
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl

import torch  # noqa: F401  (in the test extra)

# CI installs torchdata (.ci/run); resuming a rank needs StatefulDataLoader
pytest.importorskip("torchdata.stateful_dataloader")

WORLD = 3
FILES = 4
PER_FILE = 300
EPOCHS = 3

RANK_SCRIPT = textwrap.dedent("""
    import glob, os, pickle, signal, sys
    import readerlib as rl
    from readerlib.integrations.torch import IterableDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    data, ckpt, epochs, die_at, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    paths = sorted(glob.glob(os.path.join(data, "*.rio")))

    def make_chain():               # open_files splits the chunks between ranks (RANK/WORLD_SIZE)
        return (rl.open_files(paths, shard="auto", shuffle_files=True, seed=3)
                  .shuffle(97, seed=5).batch(8))

    loader = StatefulDataLoader(IterableDataset(make_chain), batch_size=None, num_workers=2)
    epoch, step, log = 0, 0, []     # log: (epoch, ids) of every batch the "training" consumed
    if os.path.exists(ckpt):
        with open(ckpt, "rb") as f:
            c = pickle.load(f)
        loader.load_state_dict(c["loader"])
        epoch, step, log = c["epoch"], c["step"], c["log"]

    def save():
        tmp = ckpt + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"loader": loader.state_dict(), "epoch": epoch, "step": step, "log": log}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt)

    while epoch < epochs:
        for (ids,) in loader:
            log.append((epoch, ids.tolist()))
            step += 1
            if step % every == 0:
                save()
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)      # no clean-up, like a lost node
        epoch += 1
        save()
    with open(ckpt + ".done", "wb") as f:
        pickle.dump(log, f)
""")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("mp")
    schema = rl.Schema([rl.Field("id", "int64")])
    for f in range(FILES):
        with rl.RecordIOWriter(str(d / f"part-{f}.rio"), schema, chunk_size=400) as w:
            w.write_batch({"id": np.arange(PER_FILE * f, PER_FILE * (f + 1), dtype=np.int64)})
    return d


def _env(rank):
    where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                PYTHONPATH=where + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run_ranks(tmp_path, data_dir, tag, die_at):
    """Run WORLD ranks at once; rank r is killed at its step die_at[r] (0: never),
    then restarted from its checkpoint until it finishes.  Returns each rank's log."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ckpts = [str(tmp_path / f"{tag}-rank{r}.ckpt") for r in range(WORLD)]
    pending = {r: die_at[r] for r in range(WORLD)}
    kills = {r: 0 for r in range(WORLD)}
    while pending:
        procs = {r: subprocess.Popen([sys.executable, "-P", str(script), str(data_dir), ckpts[r], str(EPOCHS),
                                      str(pending[r]), "3"],
                                     env=_env(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in pending}
        for r, p in procs.items():
            try:
                _, err = p.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                pytest.fail(f"rank {r} ({tag}) did not finish within 240 s")
            if p.returncode == -signal.SIGKILL and pending[r]:
                kills[r] += 1
                pending[r] = 0                  # restart it, from its last state_dict
            else:
                assert p.returncode == 0, f"rank {r} ({tag}) failed:\n{err}"
                del pending[r]
    assert all(kills[r] == (1 if die_at[r] else 0) for r in range(WORLD))
    logs = []
    for c in ckpts:
        with open(c + ".done", "rb") as f:
            logs.append(pickle.load(f))
    return logs


def test_torchrun_like_ranks_x_workers_exactly_once_new_order_each_epoch_exact_resume(tmp_path, data_dir):
    ref = _run_ranks(tmp_path, data_dir, "ref", [0] * WORLD)
    total = FILES * PER_FILE
    per_rank_epoch = {}
    for r, log in enumerate(ref):
        for e in range(EPOCHS):
            per_rank_epoch[r, e] = [i for ep, ids in log if ep == e for i in ids]
    for e in range(EPOCHS):
        ids = [i for r in range(WORLD) for i in per_rank_epoch[r, e]]
        assert sorted(ids) == list(range(total)), f"epoch {e}: not every record exactly once"
    for r in range(WORLD):
        assert len(set(tuple(per_rank_epoch[r, e]) for e in range(EPOCHS))) == EPOCHS, \
            f"rank {r}: the same order in two epochs"
    # kill rank 0 in the middle of epoch 0 and rank 2 in the middle of epoch 1
    # (checkpoints every 3 steps: the restart rewinds to the last one)
    n0 = sum(1 for ep, _ in ref[0] if ep == 0)
    n2 = sum(1 for ep, _ in ref[2] if ep == 0)
    resumed = _run_ranks(tmp_path, data_dir, "kill", [n0 // 2 + 1, 0, n2 + n2 // 2 + 2])
    for r in range(WORLD):
        assert resumed[r] == ref[r], f"rank {r}: the resumed run delivered other batches"
