"""A batch over open_files takes big records as deferred records
(readers/_multifile.pyx, Design, "Big records in one copy"): the workers read
only the chunks' tables, the batch reads each record straight into its row
and checks it there.  The same items in the same order as the ordinary path,
every corrupted byte caught (naming the file), exact resume, no descriptor
ever handed to another consumer, and no descriptor left open."""
import gc
import os
import re

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter
from helpers import assert_checkpoint_equal, corrupt_chunk, drain, run_ok_script

RB = 40000          # a big record: chunks of them carry per-record CRCs (v2)
SCHEMA = rl.Schema([rl.Field("x", "uint8", (RB,))])


def _write(d, files, per_file, per_chunk=10, seed=0, tfrecord=False):
    x = np.random.default_rng(seed).integers(0, 256, size=(files * per_file, RB), dtype=np.uint8)
    paths = []
    for f in range(files):
        rows = x[f * per_file:(f + 1) * per_file]
        if tfrecord:
            p = str(d / f"part{f:03d}.tfrecord")
            with TFRecordWriter(p) as w:
                w.write_batch(rows)
        else:
            p = str(d / f"part{f:03d}.rio")
            with rl.RecordIOWriter(p, SCHEMA, chunk_size=per_chunk * RB) as w:
                for s in range(0, per_file, per_chunk):
                    w.write_batch({"x": rows[s:s + per_chunk]})
        paths.append(p)
    return x, paths


def _rows(batch):
    return np.asarray(batch["x"]).reshape(-1, RB)


def _instances(reader):
    return np.stack([np.asarray(i[0]) for i in drain(reader)])


def _open(paths, threads, tfrecord):
    return rl.open_files(paths, num_threads=threads, schema=SCHEMA if tfrecord else None)


@pytest.mark.parametrize("tfrecord", [False, True], ids=["recordio", "tfrecord"])
@pytest.mark.parametrize("threads", [1, 3])
def test_batch_over_open_files_takes_deferred_records_and_gives_the_same_bytes(tmp_path, threads, tfrecord):
    x, paths = _write(tmp_path, 6, 25, tfrecord=tfrecord)
    want = _instances(_open(paths, threads, tfrecord).shuffle(40, seed=7))   # the ordinary path
    mf = _open(paths, threads, tfrecord)
    b = mf.shuffle(40, seed=7).batch(16)
    assert b._mapped
    got = np.concatenate([_rows(t) for t in b])
    assert np.array_equal(got, want)
    assert sorted(map(bytes, got)) == sorted(map(bytes, x))      # exactly once
    assert mf._records_deferred == len(x)
    got2 = np.concatenate([_rows(t) for t in b])                   # a second epoch: deferred again
    assert len(got2) == len(x) and mf._records_deferred == 2 * len(x)
    b.close()


def test_unshuffled_batches_are_the_files_in_order(tmp_path):
    x, paths = _write(tmp_path, 4, 30)
    mf = rl.open_files(paths, num_threads=2)
    b = mf.batch(7)
    assert np.array_equal(np.concatenate([_rows(t) for t in b]), x)
    assert mf._records_deferred == len(x)
    b.close()


def test_a_corrupted_big_record_raises_naming_its_file(tmp_path):
    x, paths = _write(tmp_path, 5, 30)
    corrupt_chunk(paths[3], chunk=1, at=20000)          # inside a record's payload, not a table
    mf = rl.open_files(paths, num_threads=2)
    b = mf.shuffle(20, seed=1).batch(8)
    with pytest.raises(rl.RecordIOError, match=re.escape(paths[3])):
        drain(b)
    assert mf._records_deferred > 0                     # the error came from the batch's check
    b.close()


def test_other_consumers_get_verified_copies(tmp_path):
    # in a child: a descriptor read as bytes would be a wild pointer (a crash)
    x, paths = _write(tmp_path, 4, 20)
    np.save(tmp_path / "x.npy", x)
    corrupt_chunk(paths[2], chunk=0, at=30000)          # record 40 (file 2's first) is bad
    run_ok_script(f"""
import numpy as np, readerlib as rl
RB = {RB}
x = np.load({str(tmp_path / "x.npy")!r})
paths = {paths!r}
mf = rl.open_files(paths, num_threads=2)
b = mf.batch(4)
it = iter(b)
assert np.array_equal(np.asarray(next(it)["x"]).reshape(-1, RB), x[:4])
assert mf._records_deferred == 4
for i in range(4, 40):                      # read directly: the workers' deferred records, copied
    assert np.array_equal(np.asarray(mf.read_next()["x"]), x[i]), i
assert mf._records_deferred == 4
try:
    mf.read_next()
except rl.RecordIOError as e:
    assert paths[2] in str(e), e
else:
    raise AssertionError("the corrupted record was handed out")
assert np.array_equal(np.asarray(mf.read_next()["x"]), x[41])   # reading on loses only that record

# through a shuffle: a buffered deferred record read from the shuffle directly
s = rl.open_files(paths[:2], num_threads=2).shuffle(16, seed=3)
want = [np.asarray(i["x"]).copy() for i in iter(rl.open_files(paths[:2], num_threads=2).shuffle(16, seed=3))]
b2 = s.batch(4)
it2 = iter(b2)
first = np.asarray(next(it2)["x"]).reshape(-1, RB)
assert np.array_equal(first, np.stack(want[:4]))
for i in range(4, 12):
    assert np.array_equal(np.asarray(s.read_next()["x"]), want[i]), i
rest = np.concatenate([np.asarray(t["x"]).reshape(-1, RB) for t in it2])
assert np.array_equal(rest, np.stack(want[12:]))
print("OK")
""", timeout=120)


def test_resume_is_exact(tmp_path):
    _, paths = _write(tmp_path, 3, 20)
    assert_checkpoint_equal(lambda: rl.open_files(paths, num_threads=2).shuffle(16, seed=2).batch(8))


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_many_small_files_keep_a_bounded_number_of_descriptors(tmp_path):
    # each deferred file's map holds a descriptor until its last record goes;
    # a buffer spanning many files must not run the process out of them
    x, paths = _write(tmp_path, 100, 2, per_chunk=2)
    want = _instances(rl.open_files(paths, num_threads=2).shuffle(150, seed=4))
    before = _open_fds()
    mf = rl.open_files(paths, num_threads=2)
    b = mf.shuffle(150, seed=4).batch(10)
    it = iter(b)
    got = [_rows(next(it))]
    assert _open_fds() - before <= 64 + 2 * 2 + 4      # gated maps, the workers' open files, slack
    got += [_rows(t) for t in it]
    assert np.array_equal(np.concatenate(got), want)
    assert 0 < mf._records_deferred < len(x)            # beyond the bound, files read the ordinary way
    b.close()
    del b, mf, it
    gc.collect()
    assert _open_fds() <= before


# -- a global shuffle over open_files (readers/_random_access.pyx, MultiFileRecords) --

def test_batch_over_a_global_shuffle_of_files_takes_deferred_records(tmp_path):
    x, paths = _write(tmp_path, 5, 24, per_chunk=6)
    g = rl.open_files(paths).global_shuffle(seed=3, window_chunks=2)
    b = g.batch(16)
    assert b._mapped
    seen = 0
    for _ in range(2):                                  # two epochs, two permutations
        got = np.concatenate([_rows(t) for t in b])
        perm = g.permutation()
        assert sorted(perm.tolist()) == list(range(len(x)))
        assert np.array_equal(got, x[perm])
        # every chunk loaded in the epoch came as descriptors (those still
        # cached from the epoch before are not loaded again)
        assert g._records_deferred >= seen + (len(x) if seen == 0 else 1)
        seen = g._records_deferred
    b.close()


def test_a_global_shuffle_of_files_reports_a_corrupted_record_naming_its_file(tmp_path):
    _, paths = _write(tmp_path, 4, 20)
    corrupt_chunk(paths[1], chunk=1, at=25000)
    b = rl.open_files(paths).global_shuffle(seed=1).batch(8)
    with pytest.raises(rl.RecordIOError, match=re.escape(paths[1])):
        drain(b)
    b.close()


def test_a_global_shuffle_of_files_resumes_exactly(tmp_path):
    _, paths = _write(tmp_path, 3, 20, per_chunk=5)
    assert_checkpoint_equal(lambda: rl.open_files(paths).global_shuffle(seed=2, window_chunks=2).batch(8))


def test_a_global_shuffle_of_many_small_files_keeps_a_bounded_number_of_descriptors(tmp_path):
    # one chunk cache per file, each gated map holding a descriptor while a
    # deferred record of its file is out: a window over 100 files' chunks
    x, paths = _write(tmp_path, 100, 2, per_chunk=2)
    before = _open_fds()
    g = rl.open_files(paths).global_shuffle(seed=4, window_chunks=100)
    b = g.batch(10)
    it = iter(b)
    got = [_rows(next(it))]
    assert _open_fds() - before <= 64 + 64 + 4          # gated maps, the caches' open files, slack
    got += [_rows(t) for t in it]
    perm = g.permutation()
    assert np.array_equal(np.concatenate(got), x[perm])
    assert 0 < g._records_deferred < len(x)             # beyond the bound, files read the ordinary way
    b.close()
    del b, g, it
    gc.collect()
    assert _open_fds() <= before
