"""Random access, global shuffle and O(1) resume over many files (open_files),
and the global shuffle's window table (readers/_global_shuffle.pyx)."""
import faulthandler
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import readerlib as rl
from readerlib.readers.files import open_files, register_file_reader, unregister_file_reader

from helpers import BYTES, assert_checkpoint_equal, assert_exactly_once, make_byte_files

FIXED = rl.Schema([rl.Field("id", "int64"), rl.Field("x", "float32", (3,))])


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


make_files = make_byte_files


def read(reader):
    return [inst[0].tobytes() for inst in reader]


def ids(reader):
    return [int.from_bytes(b[:8], "little") for b in read(reader)]


@pytest.fixture
def mixed(tmp_path):
    """RecordIO (many chunks), TFRecord, gzip TFRecord, an empty RecordIO file: 960 records."""
    return make_files(str(tmp_path), ["rio", "tfrecord", "rio", "tfrecord.gz", "rio", "tfrecord"],
                      [300, 120, 0, 90, 250, 200])


@pytest.fixture
def rios(tmp_path):
    """Four fixed-schema RecordIO files of 40 chunks and more: (paths, ids in stream order)."""
    paths, start = [], 0
    for k, n in enumerate([1500, 700, 2200, 900]):
        p = str(tmp_path / f"f{k}.rio")
        with rl.RecordIOWriter(p, FIXED, chunk_size=4096) as w:
            w.write_batch({"id": np.arange(start, start + n),
                           "x": np.repeat(np.arange(start, start + n, dtype=np.float32)[:, None], 3, 1)})
        start += n
        paths.append(p)
    return paths, list(range(start))


# ------------------------------------------------------------ reader[i] over files
@pytest.mark.parametrize("threads", [1, 3])
def test_getitem_over_files_is_the_sequential_read_bitwise(mixed, threads):
    paths, recs = mixed
    r = open_files(paths, num_threads=threads)
    assert read(r) == recs
    assert len(r) == len(recs) == 960
    assert [r[i][0].tobytes() for i in range(len(recs))] == recs
    assert r[-1][0].tobytes() == recs[-1] and r[-960][0].tobytes() == recs[0]
    picks = [959, 0, 420, 419, 300, 301, 5, 959]
    assert [x[0].tobytes() for x in r.read_many(picks)] == [recs[i] for i in picks]
    assert read(r) == recs                      # random access did not disturb the stream
    assert len(r.batch(100)) == 10


def test_getitem_uses_the_canonical_file_order_whatever_shuffle_files_does(mixed):
    paths, recs = mixed
    r = open_files(paths, shuffle_files=True, seed=3)
    assert read(r) != recs                      # the stream is in a shuffled file order
    assert [r[i][0].tobytes() for i in range(0, 960, 7)] == recs[::7]


def test_indices_address_the_ranks_share_under_shard(rios):
    paths, want = rios
    seen = []
    for rank in range(3):
        r = open_files(paths, shard=(rank, 3))
        mine = ids(r)
        assert len(r) == len(mine) > 0
        assert [int(r[i][0]) for i in range(len(r))] == mine
        seen += mine
    assert_exactly_once(seen, want)
    # equal_batches: the first `limit` records of the rank's share
    r = open_files(paths, shard=(1, 3), equal_batches=True)
    mine = ids(open_files(paths, shard=(1, 3)))
    assert len(r) == len(ids(r)) == r.limit
    assert [int(r[i][0]) for i in range(len(r))] == mine[:r.limit]
    with pytest.raises(IndexError, match=f"index {r.limit} out of range for {r.limit} records"):
        r[r.limit]


def test_index_errors_name_index_and_length(mixed):
    paths, _ = mixed
    r = open_files(paths)
    for bad in (960, -961, 10 ** 12):
        with pytest.raises(IndexError, match=f"index {bad} out of range for 960 records"):
            r[bad]
    with pytest.raises(TypeError, match="integers"):
        r["3"]
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r[0]


def test_a_corrupt_chunk_raises_naming_file_offset_and_stream_index(rios):
    paths, _ = rios
    r0 = rl.RecordIOReader(paths[2])
    offs, nrec = r0.chunk_table()
    r0.close()
    c = len(offs) // 2
    data = bytearray(open(paths[2], "rb").read())
    data[int(offs[c]) + 40] ^= 0x01               # inside chunk c's body (not the identity's 4 KiB ends)
    open(paths[2], "wb").write(bytes(data))
    first = 1500 + 700 + int(np.sum(nrec[:c]))     # the stream index of chunk c's first record
    r = open_files(paths)
    assert int(r[first - 1][0]) == first - 1        # chunk c - 1 is fine
    with pytest.raises(rl.RecordIOError, match=r"f2\.rio.*at byte offset") as ei:
        r[first + 3]
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert f"record {first + 3} of the stream" in notes and "f2.rio" in notes, notes
    assert int(r[first + int(nrec[c])][0]) == first + int(nrec[c])   # the next chunk still reads
    with pytest.raises(rl.RecordIOError, match=r"f2\.rio"):
        for _ in open_files(paths).global_shuffle(seed=0):
            pass


def test_a_file_without_random_access_is_named(tmp_path, mixed):
    paths, _ = mixed
    lines = tmp_path / "extra.lines"
    lines.write_text("a\nb\n")

    def factory(path, schema=None):
        rows = [np.frombuffer(s.encode(), np.uint8) for s in open(path).read().split()]
        return rl.PythonReader(lambda: iter([(x,) for x in rows]), BYTES)

    register_file_reader(".lines", factory)
    try:
        r = open_files(paths + [str(lines)])
        assert len(read(r)) == 962                   # the stream reads it
        with pytest.raises(TypeError, match=r"extra\.lines.*no random access"):
            r[0]
        with pytest.raises(TypeError, match=r"extra\.lines.*no random access"):
            r.global_shuffle(seed=0)
        with pytest.raises(TypeError, match="not known without reading"):
            len(r)
    finally:
        unregister_file_reader(".lines")


def test_a_file_changed_since_planning_is_named(rios):
    paths, _ = rios
    r = open_files(paths)
    with rl.RecordIOWriter(paths[1], FIXED, chunk_size=4096) as w:     # rewritten: another identity
        w.write_batch({"id": np.arange(5), "x": np.zeros((5, 3), np.float32)})
    assert int(r[10][0]) == 10                       # file 0 is as planned
    with pytest.raises(ValueError, match=r"f1\.rio.*changed since open_files planned"):
        r[1600]


# ------------------------------------------------------------ global shuffle over files
def test_global_shuffle_over_files_is_exactly_once_and_new_each_epoch(mixed):
    paths, recs = mixed
    g = open_files(paths).global_shuffle(seed=11, window_chunks=3)
    e0 = read(g)
    assert_exactly_once(e0, recs)
    assert e0 != recs
    e1 = read(g)
    assert_exactly_once(e1, recs)
    assert e1 != e0
    assert read(open_files(paths, num_threads=2).global_shuffle(seed=11, window_chunks=3)) == e0
    assert read(open_files(paths).global_shuffle(seed=12, window_chunks=3)) != e0
    h = open_files(paths).global_shuffle(seed=11, window_chunks=3)
    assert [recs[i] for i in h.permutation(epoch=1)] == e1
    assert [h[i][0].tobytes() for i in range(0, 960, 13)] == e0[::13]
    assert len(h) == 960


def test_global_shuffle_over_files_loads_each_chunk_once_and_mixes_files(rios):
    paths, want = rios
    n_chunks = sum(rl.RecordIOReader(p).num_chunks for p in paths)
    bounds = np.cumsum([0, 1500, 700, 2200, 900])
    g = open_files(paths).global_shuffle(seed=2, window_chunks=4)
    got = ids(g)
    assert_exactly_once(got, want)
    assert g.chunk_loads == n_chunks
    # records far apart -- in different files -- are neighbours: the first
    # window (4 chunks drawn from anywhere) already spans several files
    files_of = np.searchsorted(bounds, got, side="right") - 1
    assert len(set(files_of[:200].tolist())) >= 2
    assert len(set(files_of[:50].tolist())) >= 2              # interleaved, not one file after another


def test_global_shuffle_over_files_exactly_once_across_shards(rios):
    paths, want = rios
    got = []
    for i in range(3):
        got += ids(open_files(paths).global_shuffle(seed=5).shard(3, i))
    assert_exactly_once(got, want)
    got = []
    for rank in range(2):                           # open_files' own shard: disjoint shares
        got += ids(open_files(paths, shard=(rank, 2)).global_shuffle(seed=5))
    assert_exactly_once(got, want)


# ------------------------------------------------------------ exact resume
def test_resume_global_shuffle_over_files_exact(tmp_path):
    paths, _ = make_files(str(tmp_path), ["rio", "tfrecord", "rio"], [70, 25, 45], chunk_size=256)
    assert_checkpoint_equal(lambda: open_files(paths).global_shuffle(seed=4, window_chunks=2).batch(6))


@pytest.mark.parametrize("threads", [1, 2])
def test_resume_open_files_exact(tmp_path, threads):
    paths, _ = make_files(str(tmp_path), ["rio", "tfrecord", "rio", "tfrecord.gz"], [40, 25, 0, 30],
                          chunk_size=256)
    assert_checkpoint_equal(lambda: open_files(paths, num_threads=threads).batch(4))
    assert_checkpoint_equal(lambda: open_files(paths, num_threads=threads, shuffle_files=True, seed=1))


def test_resume_open_files_under_shard_and_equal_batches_exact(rios):
    paths, _ = rios

    def make():
        return open_files(paths, num_threads=2, shard=(1, 3), equal_batches=True).batch(97)

    assert_checkpoint_equal(make, epochs=1)


def test_set_state_over_open_files_does_not_read_the_files_before_the_position(rios):
    # The old c_skip replayed the epoch: it read (and checked) every record
    # before the position.  Now whole chunks are stepped over by their counts:
    # a corrupt chunk of file 0 is not touched by a restore into file 2.
    paths, want = rios
    ref = open_files(paths, num_threads=2).batch(100)
    it = iter(ref)
    for _ in range(25):                              # 2500 records: into file 2
        next(it)
    state = json.loads(json.dumps(ref.get_state()))
    rest = [b[0].data.tolist() for b in it]
    ref.close()
    r0 = rl.RecordIOReader(paths[0])
    offs, _ = r0.chunk_table()
    r0.close()
    data = bytearray(open(paths[0], "rb").read())
    data[int(offs[len(offs) // 2]) + 40] ^= 0x01
    open(paths[0], "wb").write(bytes(data))
    with pytest.raises(rl.RecordIOError):            # the corruption is there to be found
        read(open_files(paths))
    chain = open_files(paths, num_threads=2).batch(100)
    chain.set_state(state)
    assert [b[0].data.tolist() for b in chain] == rest
    assert sum(len(b) for b in rest) == len(want) - 2500


def test_set_state_past_the_end_of_open_files_is_refused(rios):
    paths, _ = rios
    r = open_files(paths)
    state = r.get_state()
    with pytest.raises(ValueError, match="past the end of the epoch"):
        open_files(paths).set_state(dict(state, position=5301))
    other = open_files(paths)
    other.set_state(dict(state, position=5300))
    assert read(other) == []


# ------------------------------------------------------------ the window table (single file)
def test_random_access_to_the_shuffled_order_while_iterating_it(rios):
    # g[i] draws its window's order into a table of its own and the sequential
    # path holds its window's chunks: interleaving the two changes neither's
    # records, and g[i] costs at most its own chunk loads.  (A guard for the
    # window table's two-table design; the old per-record path passed it too.)
    path = rios[0][2]
    g = rl.RecordIOReader(path).global_shuffle(seed=3, window_chunks=4)
    n_chunks = rl.RecordIOReader(path).num_chunks
    perm = g.permutation()
    got, calls = [], 0
    rng = np.random.default_rng(0)
    for k, x in enumerate(g):
        got.append(int(x[0]))
        if k % 50 == 0:                              # file 2's ids start at 1500 + 700
            j = int(rng.integers(len(perm)))
            assert int(g[j][0]) == 2200 + int(perm[j])
            calls += 1
    assert got == [2200 + int(p) for p in perm]
    assert g.chunk_loads <= n_chunks + calls


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=5),
       chunk=st.sampled_from([128, 512, 4096]), window=st.integers(1, 5),
       seed=st.integers(0, 2 ** 64 - 1), frac=st.floats(0, 1))
def test_property_files_random_access_shuffle_and_resume(tmp_path_factory, sizes, chunk, window, seed, frac):
    d = str(tmp_path_factory.mktemp("prop"))
    kinds = ["rio" if i % 2 == 0 else "tfrecord" for i in range(len(sizes))]
    paths, recs = make_files(d, kinds, sizes, chunk_size=chunk, rec_size=24)
    r = open_files(paths, num_threads=2)
    assert len(r) == len(recs)
    assert [r[i][0].tobytes() for i in range(len(recs))] == recs == read(r)
    g = open_files(paths).global_shuffle(seed=seed, window_chunks=window)
    e0 = read(g)
    assert_exactly_once(e0, recs)
    assert [recs[i] for i in g.permutation(epoch=0)] == e0
    e1 = read(g)
    assert_exactly_once(e1, recs)
    # resume at a position drawn by hypothesis, in epoch 1
    pos = int(frac * len(recs))
    h = open_files(paths).global_shuffle(seed=seed, window_chunks=window)
    h.reset()                                        # epoch 1
    it = iter(h)
    for _ in range(pos):
        next(it)
    state = json.loads(json.dumps(h.get_state()))
    k = open_files(paths).global_shuffle(seed=seed, window_chunks=window)
    k.set_state(state)
    assert read(k) == e1[pos:]
    # the sequential stream resumes at the same position too
    s = open_files(paths, num_threads=2)
    s.set_state(_stream_state(paths, pos))
    assert read(s) == recs[pos:]


def _stream_state(paths, pos):
    r = open_files(paths)
    it = iter(r)
    for _ in range(pos):
        next(it)
    state = json.loads(json.dumps(r.get_state()))
    r.close()
    return state
