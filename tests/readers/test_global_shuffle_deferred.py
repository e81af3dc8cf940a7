"""A batch over a global shuffle takes big RecordIO records as descriptors
(readers/_random_access.pyx, Design, "Deferred records"): one copy of the
bytes, the same items in the same order, every corrupted byte caught, and no
other consumer of the shuffle or its cache ever handed a descriptor."""
import re

import numpy as np
import pytest

import readerlib as rl
from helpers import assert_checkpoint_equal, corrupt_chunk, drain, run_ok_script

RB = 40000          # a big record: chunks of them carry per-record CRCs (v2)


def _write(path, n, per=50, seed=0):
    x = np.random.default_rng(seed).integers(0, 256, size=(n, RB), dtype=np.uint8)
    with rl.RecordIOWriter(str(path), rl.Schema([rl.Field("x", "uint8", (RB,))])) as w:
        for s in range(0, n, per):
            w.write_batch({"x": x[s:s + per]})
    return x


def _rows(batch):
    return np.asarray(batch["x"]).reshape(-1, RB)


@pytest.mark.parametrize("low_memory", [True, False])
def test_batch_over_global_shuffle_takes_descriptors_and_gives_the_same_bytes(tmp_path, low_memory):
    p = tmp_path / "big.rio"
    x = _write(p, 300)
    g = rl.RecordIOReader(str(p), low_memory=low_memory).global_shuffle(seed=3, window_chunks=2)
    b = g.batch(16)
    assert b._mapped
    for _ in range(2):                                  # two epochs, two permutations
        got = np.concatenate([_rows(bt) for bt in b])
        perm = g.permutation()                          # the epoch just read
        assert sorted(perm.tolist()) == list(range(len(x)))
        assert np.array_equal(got, x[perm])
    assert g._records_deferred >= 2 * len(x)
    b.close()


def test_a_corrupted_big_record_raises_naming_the_file(tmp_path):
    p = tmp_path / "big.rio"
    _write(p, 200)
    corrupt_chunk(str(p), chunk=2, at=20000)            # inside a record's payload
    b = rl.RecordIOReader(str(p)).global_shuffle(seed=1).batch(16)
    assert b._mapped
    with pytest.raises(rl.RecordIOError, match=re.escape(str(p))):
        drain(b)
    b.close()


def _no_descriptor_escapes(tmp_path, src, x):
    """A batch above `src`'s global shuffle (`src`: Python source making the
    reader; `x`: its records in index order) takes descriptors, and reading
    the shuffle directly or by index never gives one: in a child, where a
    descriptor read as bytes would be a wild pointer (a crash)."""
    np.save(tmp_path / "x.npy", x)
    run_ok_script(f"""
import numpy as np, readerlib as rl
RB = {RB}
x = np.load({str(tmp_path / "x.npy")!r})
g = ({src}).global_shuffle(seed=5)
perm = g.permutation()
b = g.batch(4)
it = iter(b)
first = np.asarray(next(it)["x"]).reshape(-1, RB)       # the window built in the batch's pull
assert g._records_deferred > 0
assert np.array_equal(first, x[perm[:4]])
loads = g.chunk_loads
inst = g.read_next()                                    # the shuffle read directly
assert g.chunk_loads > loads, "the window was not reloaded"
assert np.array_equal(np.asarray(inst["x"]), x[perm[4]])
it2 = iter(b)                                           # (a new epoch of the batch: descriptors again)
first2 = np.asarray(next(it2)["x"]).reshape(-1, RB)
perm2 = g.permutation()
assert np.array_equal(first2, x[perm2[:4]])
for i in range(len(x)):                                 # random access into the cached chunks
    assert np.array_equal(np.asarray(g[i]["x"]), x[perm2[i]]), i
rest = np.concatenate([np.asarray(bt["x"]).reshape(-1, RB) for bt in it2])
assert np.array_equal(rest, x[perm2[4:]])
print("OK")
""", timeout=120)


def test_other_consumers_never_see_a_descriptor(tmp_path):
    p = tmp_path / "big.rio"
    x = _write(p, 100)                                  # 4 chunks: all stay in the cache
    _no_descriptor_escapes(tmp_path, f"rl.RecordIOReader({str(p)!r})", x)


def test_other_consumers_of_a_global_shuffle_of_files_never_see_a_descriptor(tmp_path):
    paths = [tmp_path / f"part{k}.rio" for k in range(3)]
    x = np.concatenate([_write(p, 20, per=5, seed=k) for k, p in enumerate(paths)])
    _no_descriptor_escapes(tmp_path, f"rl.open_files({[str(p) for p in paths]!r})", x)


def test_resume_is_exact(tmp_path):
    p = tmp_path / "big.rio"
    _write(p, 120, per=30)
    assert_checkpoint_equal(lambda: rl.RecordIOReader(str(p)).global_shuffle(seed=2, window_chunks=2).batch(16))


# -- an uncompressed TFRecord file under the global shuffle (its own data CRCs) --

def _write_tfrecord(path, n, seed=0):
    from readerlib.formats._tfrecord import TFRecordWriter
    x = np.random.default_rng(seed).integers(0, 256, size=(n, RB), dtype=np.uint8)
    with TFRecordWriter(str(path)) as w:
        w.write_batch(x)
    return x


def _tfrecord_reader(path):
    return rl.TFRecordReader(str(path), schema=rl.Schema([rl.Field("x", "uint8", (RB,))]))


def test_batch_over_a_global_shuffle_of_tfrecord_takes_deferred_records(tmp_path):
    p = tmp_path / "big.tfrecord"
    x = _write_tfrecord(p, 200)
    g = _tfrecord_reader(p).global_shuffle(seed=3, window_chunks=2)
    b = g.batch(16)
    assert b._mapped
    seen = 0
    for _ in range(2):
        got = np.concatenate([_rows(bt) for bt in b])
        perm = g.permutation()
        assert sorted(perm.tolist()) == list(range(len(x)))
        assert np.array_equal(got, x[perm])
        assert g._records_deferred > seen           # chunks loaded in the epoch came as descriptors
        seen = g._records_deferred
    b.close()


def test_a_corrupted_tfrecord_record_under_a_global_shuffle_raises_naming_the_file(tmp_path):
    p = tmp_path / "big.tfrecord"
    _write_tfrecord(p, 60)
    with open(p, "r+b") as f:                      # inside record 7's data
        f.seek(7 * (RB + 16) + 12 + 999)
        v = f.read(1)
        f.seek(7 * (RB + 16) + 12 + 999)
        f.write(bytes([v[0] ^ 0x40]))
    b = _tfrecord_reader(p).global_shuffle(seed=1).batch(8)
    with pytest.raises(rl.TFRecordError, match=re.escape(f"{p}: corrupted record at {7 * (RB + 16)}")):
        drain(b)
    b.close()


def test_a_global_shuffle_of_tfrecord_never_hands_a_descriptor_to_another_consumer(tmp_path):
    p = tmp_path / "big.tfrecord"
    x = _write_tfrecord(p, 60)
    _no_descriptor_escapes(tmp_path, f"rl.TFRecordReader({str(p)!r}, schema=rl.Schema([rl.Field('x', 'uint8', ({RB},))]))", x)


def test_a_global_shuffle_of_tfrecord_resumes_exactly(tmp_path):
    p = tmp_path / "big.tfrecord"
    _write_tfrecord(p, 60)
    assert_checkpoint_equal(lambda: _tfrecord_reader(p).global_shuffle(seed=2, window_chunks=2).batch(8))


# -- the window shuffle passes deferred records through, as the buffer shuffle does --

def _window_want(p, w, seed):
    return np.stack([np.asarray(i[0]) for i in drain(rl.RecordIOReader(str(p)).shuffle(w, seed=seed, mode="window"))])


def test_batch_over_a_window_shuffle_takes_deferred_records(tmp_path):
    p = tmp_path / "big.rio"
    x = _write(p, 150)
    want = _window_want(p, 32, 4)                       # the ordinary path
    src = rl.RecordIOReader(str(p))
    b = src.shuffle(32, seed=4, mode="window").batch(16)
    assert b._mapped
    got = np.concatenate([_rows(bt) for bt in b])
    assert np.array_equal(got, want)
    assert sorted(map(bytes, got)) == sorted(map(bytes, x))
    assert src._records_deferred == len(x)
    b.close()


def test_a_corrupted_record_under_a_window_shuffle_raises_naming_the_file(tmp_path):
    p = tmp_path / "big.rio"
    _write(p, 100)
    corrupt_chunk(str(p), chunk=1, at=20000)
    b = rl.RecordIOReader(str(p)).shuffle(16, seed=1, mode="window").batch(8)
    with pytest.raises(rl.RecordIOError, match=re.escape(str(p))):
        drain(b)
    b.close()


def test_a_window_shuffle_never_hands_a_descriptor_to_another_consumer(tmp_path):
    p = tmp_path / "big.rio"
    _write(p, 100)
    np.save(tmp_path / "want.npy", _window_want(p, 32, 6))
    run_ok_script(f"""
import numpy as np, readerlib as rl
RB = {RB}
want = np.load({str(tmp_path / "want.npy")!r})
src = rl.RecordIOReader({str(p)!r})
w = src.shuffle(32, seed=6, mode="window")
b = w.batch(4)
it = iter(b)
assert np.array_equal(np.asarray(next(it)["x"]).reshape(-1, RB), want[:4])
assert src._records_deferred > 0                        # the window was filled in the batch's pull
for i in range(4, 20):                                  # the window shuffle read directly
    assert np.array_equal(np.asarray(w.read_next()["x"]), want[i]), i
rest = np.concatenate([np.asarray(t["x"]).reshape(-1, RB) for t in it])
assert np.array_equal(rest, want[20:])
print("OK")
""", timeout=120)


def test_a_window_shuffle_with_deferred_records_resumes_exactly(tmp_path):
    p = tmp_path / "big.rio"
    _write(p, 90, per=30)
    assert_checkpoint_equal(lambda: rl.RecordIOReader(str(p)).shuffle(16, seed=2, mode="window").batch(8))


@pytest.mark.parametrize("shuffle", ["buffer", "window", "global"])
def test_a_shard_passes_deferred_records_through(tmp_path, shuffle):
    # shard only moves items (tf.data's shard: keeps every k-th, skips the rest)
    p = tmp_path / "big.rio"
    x = _write(p, 120)

    def chain(src):
        s = src.global_shuffle(seed=5) if shuffle == "global" else src.shuffle(24, seed=5, mode=shuffle)
        return s, s.shard(3, 1)
    want = np.stack([np.asarray(i[0]) for i in drain(chain(rl.RecordIOReader(str(p)))[1])])
    src = rl.RecordIOReader(str(p))
    s, sh = chain(src)
    b = sh.batch(8)
    assert b._mapped
    assert np.array_equal(np.concatenate([_rows(t) for t in b]), want)
    assert len(want) == 40
    deferred = s._records_deferred if shuffle == "global" else src._records_deferred
    assert deferred >= len(x)                           # (the shard's skipped ones never read)
    b.close()
