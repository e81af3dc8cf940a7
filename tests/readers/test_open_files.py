"""open_files: threads, deterministic order, suffix registry, errors that surface, sharding."""
import faulthandler
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import readerlib as rl
from readerlib.errors import DataLossError, RecordIOError, TFRecordError
from readerlib.readers.files import (ShardReader, open_files, register_file_reader, shard_from_env,
                                     unregister_file_reader)

from helpers import BYTES, byte_record, make_byte_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _hang_guard():
    """A hang fails the run (with every thread's stack) instead of blocking it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def rec(k):
    return byte_record(k)


def make_files(d, kinds, per_file=700):
    """Files of the given kinds, many chunks each; record k holds the 8 bytes
    of k.  Returns (paths, records)."""
    return make_byte_files(d, kinds, [per_file] * len(kinds))


def read(reader):
    return [inst[0].tobytes() for inst in reader]


@pytest.fixture
def files(tmp_path):
    return make_files(str(tmp_path), ["rio", "tfrecord", "rio", "tfrecord.gz", "rio", "tfrecord"])


# ------------------------------------------------------------- exactly once
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_every_record_once_in_file_order(files, threads):
    paths, recs = files
    with open_files(paths, num_threads=threads) as r:
        assert read(r) == recs
        assert read(r) == recs               # second epoch
        r.reset()
        assert read(r) == recs


def test_glob_and_mixed_suffixes(files, tmp_path):
    paths, recs = files
    r = open_files(str(tmp_path / "part-*"), num_threads=2)
    assert r.plan.paths == sorted(paths)
    assert read(r) == recs
    # the TFRecord sidecar indexes now exist; the glob still matches data files only
    assert any(f.endswith(".idx") for f in os.listdir(tmp_path))
    assert read(open_files(str(tmp_path / "part-*"), num_threads=2)) == recs


def test_an_existing_path_with_glob_characters_is_that_file(tmp_path):
    """'data[1].rio' exists: it is read, not taken as the pattern 'data1.rio'."""
    paths, recs = make_files(str(tmp_path), ["rio", "rio"], per_file=5)
    literal = str(tmp_path / "data[1].rio")
    os.rename(paths[0], literal)
    assert read(open_files([literal])) == recs[:5]
    assert read(open_files(literal)) == recs[:5]
    # nothing matches literally: then it is a pattern ("[1]" matches "1")
    os.rename(paths[1], str(tmp_path / "other1.rio"))
    assert read(open_files(str(tmp_path / "other[1].rio"))) == recs[5:]
    with pytest.raises(FileNotFoundError, match=r"no file matches"):
        open_files(str(tmp_path / "other[2].rio"))


LEAK_CHILD = """
import gc, os, shutil, sys, tempfile, threading, time
import numpy as np
import readerlib as rl
d = tempfile.mkdtemp(dir=sys.argv[1])
S = rl.Schema([rl.Field("x", "uint8", (65536,))])
paths = []
for i in range(2):                         # two 40 MiB files: more than a worker queues ahead
    p = os.path.join(d, "f%d.rio" % i)
    with rl.RecordIOWriter(p, S) as w:
        for k in range(640):
            w.write((np.full(65536, k % 251, np.uint8),))
    paths.append(p)
def maps():
    return sum(1 for line in open("/proc/self/maps") if d in line)
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
gc.collect()
threads0, maps0, rss0 = threading.active_count(), maps(), rss_mb()
for _ in range(4):
    for x in rl.open_files(paths, num_threads=2).batch(4):
        break                              # the epoch is abandoned
del x
gc.collect()
deadline = time.monotonic() + 5            # the workers leave at their next record or queue wait
while time.monotonic() < deadline and (threading.active_count() > threads0 or maps() > maps0):
    time.sleep(0.05)
print("threads=%d maps=%d rss_mb=%.0f" % (threading.active_count() - threads0, maps() - maps0,
                                          rss_mb() - rss0))
shutil.rmtree(d)
"""


def test_an_abandoned_iteration_leaves_no_thread_mapping_or_memory(tmp_path):
    # it used to leak forever: +8 threads, 16 mappings, +290 MB after four abandoned epochs
    where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    p = subprocess.run([sys.executable, "-P", "-c", LEAK_CHILD, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=where))
    assert p.returncode == 0, p.stderr
    got = dict(kv.split("=") for kv in p.stdout.split())
    assert got["threads"] == "0" and got["maps"] == "0", got
    assert float(got["rss_mb"]) < 64, got


def test_shuffled_file_order_is_deterministic(files):
    paths, recs = files
    runs = []
    for threads in (1, 2, 4):
        with open_files(paths, num_threads=threads, shuffle_files=True, seed=7) as r:
            runs.append((read(r), read(r)))
    assert runs[0] == runs[1] == runs[2]              # same seed: same order, whatever the threads
    e0, e1 = runs[0]
    assert sorted(e0) == sorted(recs) == sorted(e1)
    assert e0 != recs and e0 != e1                   # files permuted, a new order each epoch
    other = read(open_files(paths, shuffle_files=True, seed=8))
    assert other != e0


def test_resume_mid_epoch_gives_the_same_rest(files):
    paths, recs = files
    def chain():
        return ShardReader(open_files(paths, num_threads=2, shuffle_files=True, seed=5), 2, 1).batch(16)
    def rest_of(r):
        out = []
        while (item := r.read_next()) is not None:
            out.append(item[0].data.tobytes())
        return out

    a = chain()
    list(a)                                     # finish epoch 0: the state is in epoch 1
    a.reset()
    for _ in range(7):
        a.read_next()
    state = a.get_state()
    rest = rest_of(a)
    b = chain()
    b.set_state(state)
    assert rest_of(b) == rest and rest
    a.close()
    b.close()


def test_batches_through_shuffle(files):
    paths, recs = files
    r = open_files(paths, num_threads=2).shuffle(500, seed=0).batch(64)
    got = []
    for (t,) in r:
        got += [t.sequence(i).tobytes() for i in range(len(t.lod[0]) - 1)]
    assert sorted(got) == sorted(recs) and got != recs


def test_schema_mismatch_names_both_files(tmp_path):
    paths, _ = make_files(str(tmp_path), ["rio", "rio"], per_file=10)
    other = str(tmp_path / "x.rio")
    with rl.RecordIOWriter(other, rl.Schema([rl.Field("y", "int64")])) as w:
        w.write((1,))
    with pytest.raises(ValueError, match=r"x\.rio.*part-000\.rio"):
        open_files(paths + [other])


def test_bad_arguments(files, tmp_path):
    paths, _ = files
    with pytest.raises(FileNotFoundError):
        open_files(str(tmp_path / "nothing-*.rio"))
    with pytest.raises(FileNotFoundError):
        open_files([str(tmp_path / "missing.rio")])
    with pytest.raises(ValueError, match="no file reader registered"):
        p = tmp_path / "a.unknown"
        p.write_bytes(b"")
        open_files([str(p)])
    with pytest.raises(ValueError, match="num_threads"):
        open_files(paths, num_threads=0)
    with pytest.raises(ValueError, match="rank"):
        open_files(paths, shard=(3, 3))
    with pytest.raises(TypeError, match="shard"):
        open_files(paths, shard="everything")
    with pytest.raises(ValueError):
        ShardReader(rl.ArrayReader(np.arange(4)), 2, 2)


# ------------------------------------------------------------------ registry
def _lines_factory(path, schema=None):
    def lines():
        with open(path, "rb") as f:
            for line in f:
                yield np.frombuffer(line.rstrip(b"\n"), np.uint8)
    return rl.PythonReader(lines, BYTES)


def test_registry_with_a_python_reader(files, tmp_path):
    paths, recs = files
    txt = tmp_path / "notes.lines"
    txt.write_bytes(b"alpha\nbeta\ngamma\n")
    register_file_reader(".lines", _lines_factory)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_file_reader(".lines", lambda p, schema=None: None)
        r = open_files(paths[:2] + [str(txt)] + paths[2:], num_threads=2)
        n0 = 2 * 700
        assert read(r) == recs[:n0] + [b"alpha", b"beta", b"gamma"] + recs[n0:]
    finally:
        unregister_file_reader(".lines")


# -------------------------------------------------------------------- errors
def _corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("threads", [1, 2])
def test_corrupt_tfrecord_in_the_middle_names_the_file(tmp_path, threads):
    paths, recs = make_files(str(tmp_path), ["rio", "rio", "tfrecord", "rio", "rio"], per_file=400)
    bad = 100 * 24 + 20                  # inside record 100 of the TFRecord file (24 bytes each)
    _corrupt(paths[2], bad)
    r = open_files(paths, num_threads=threads)
    got = []
    with pytest.raises(TFRecordError) as ei:
        for inst in r:
            got.append(inst[0].tobytes())
    assert paths[2] in str(ei.value) and f"corrupted record at {100 * 24}" in str(ei.value)
    assert ei.value.offset == 100 * 24
    assert got == recs[:800]             # every record before the bad chunk (verified whole), in order
    # then it reads on (raised once, as tf.data's TFRecordDataset): the file's
    # scan stopped at the bad chunk (no index), so the next files; it used to
    # raise the same error on every later call until reset
    rest = []
    while (inst := r.read_next()) is not None:
        rest.append(inst[0].tobytes())
    assert rest == recs[1200:]
    r.reset()
    with pytest.raises(TFRecordError):   # reset restarts it (the file is still corrupt)
        read(r)
    r.close()


def test_corrupt_recordio_chunk_with_threads(tmp_path):
    paths, recs = make_files(str(tmp_path), ["rio"] * 4, per_file=3000)
    size = os.path.getsize(paths[1])
    _corrupt(paths[1], size // 2)
    with open_files(paths, num_threads=2) as r:
        with pytest.raises(RecordIOError, match=r"part-001\.rio.*byte offset \d+"):
            read(r)


def test_user_reader_exception_surfaces_with_file_name(files, tmp_path):
    paths, _ = files
    bad = tmp_path / "broken.lines"
    bad.write_bytes(b"x\n")

    def factory(path, schema=None):
        def it():
            yield np.zeros(3, np.uint8)
            raise KeyError("user bug")
        return rl.PythonReader(it, BYTES)

    register_file_reader(".lines", factory)
    try:
        r = open_files(paths[:1] + [str(bad)] + paths[1:], num_threads=2)
        with pytest.raises(KeyError, match="user bug") as ei:
            read(r)
        assert any("broken.lines" in n for n in getattr(ei.value, "__notes__", []))
        r.close()
    finally:
        unregister_file_reader(".lines")


def test_stalled_reader_times_out(files, tmp_path):
    paths, _ = files
    slow = tmp_path / "slow.lines"
    slow.write_bytes(b"")

    def factory(path, schema=None):
        def it():
            time.sleep(3)
            yield np.zeros(1, np.uint8)
        return rl.PythonReader(it, BYTES)

    register_file_reader(".lines", factory)
    try:
        r = open_files([str(slow)] + paths, num_threads=2, timeout=0.5)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="slow.lines"):
            read(r)
        assert time.monotonic() - t0 < 2.5
        workers = [t for t in threading.enumerate() if t.name.startswith("readerlib-open_files")]
        t0 = time.monotonic()
        r.close()                   # bounded: the worker asleep in the user's function is left
        assert time.monotonic() - t0 < 1.0
        for t in workers:           # ... and leaves on its own when the function returns
            t.join(10)
            assert not t.is_alive()
    finally:
        unregister_file_reader(".lines")


def test_close_mid_epoch_does_not_hang(tmp_path):
    paths, _ = make_files(str(tmp_path), ["rio"] * 4, per_file=20000)
    r = open_files(paths, num_threads=2)
    for _ in range(10):
        r.read_next()               # workers are now blocked on full queues
    t0 = time.monotonic()
    r.close()
    assert time.monotonic() - t0 < 5 and r.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("readerlib-open_files")]


# ------------------------------------------------------------------ sharding
def test_shard_reader_every_kth_item():
    src = rl.ArrayReader(np.arange(23))
    parts = [[int(x[0]) for x in ShardReader(rl.ArrayReader(np.arange(23)), 4, i)] for i in range(4)]
    assert sorted(sum(parts, [])) == list(range(23))
    assert parts[1] == list(range(1, 23, 4))
    b = ShardReader(src.batch(5), 2, 1)          # works on batches too
    assert [t.data.tolist() for (t,) in b] == [list(range(5, 10)), list(range(15, 20))]


def test_in_process_shards_are_disjoint_and_equal(files):
    paths, recs = files
    parts = [read(open_files(paths, num_threads=2, shard=(k, 3))) for k in range(3)]
    assert sorted(sum(parts, [])) == sorted(recs)
    eq = [read(open_files(paths, num_threads=2, shard=(k, 4), equal_batches=True)) for k in range(4)]
    assert len({len(p) for p in eq}) == 1 and len(eq[0]) > 0.9 * len(recs) / 4
    assert len(set(sum(eq, []))) == sum(len(p) for p in eq)


def test_shard_from_env():
    assert shard_from_env({"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert shard_from_env({}) == (0, 1)
    with pytest.raises(ValueError):
        shard_from_env({"RANK": "4", "WORLD_SIZE": "4"})


_WORKER = textwrap.dedent("""
    import json, sys
    from readerlib.readers.files import open_files
    r = open_files(sys.argv[1], num_threads=2, shard="auto", equal_batches=sys.argv[2] == "1")
    out = [int.from_bytes(inst[0].tobytes(), "little") for inst in r]
    batches = sum(1 for _ in open_files(sys.argv[1], shard="auto",
                                        equal_batches=sys.argv[2] == "1").batch(32))
    print(json.dumps({"records": out, "batches": batches}))
""")


@pytest.mark.parametrize("equal", [False, True])
def test_ranks_in_separate_processes_see_every_record_once(tmp_path, equal):
    paths, recs = make_files(str(tmp_path), ["rio", "tfrecord", "rio", "tfrecord", "rio"],
                             per_file=1000)
    pattern = str(tmp_path / "part-*")
    world = 3
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                   PYTHONPATH=os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, pattern, "1" if equal else "0"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err.decode()
        results.append(json.loads(out))
    seen = [r["records"] for r in results]
    flat = sum(seen, [])
    assert len(flat) == len(set(flat))                       # disjoint
    if equal:
        assert len({len(s) for s in seen}) == 1 and len({r["batches"] for r in results}) == 1
        assert len(flat) >= 0.6 * len(recs)                  # trimmed to the smallest rank
    else:
        assert sorted(flat) == list(range(len(recs)))        # together: every record exactly once
