"""set_state without replaying the epoch through decorators and the buffer shuffle (issue 16 item 3).

Each decorator that hands out one item per item below (map, threaded map,
map_batches, prefetch, take, skip, repeat, multi_pass) positions the reader
below with `c_skip`; the buffer shuffle rebuilds its buffer from the saved
source positions by random access.  Exactness is checked with the shared
`assert_checkpoint_equal` (every position of two epochs); "does not replay"
by counting the user function's calls during `set_state`, by the shuffle's
`restores` hook, and by a corrupt chunk before the position that a replay
would read.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl
from readerlib import TFRecordReader, TFRecordWriter
from helpers import SUPPORT_DIR, assert_checkpoint_equal, run_ok_script

I64 = rl.Schema([rl.Field("x", "int64")])
N = 600


def _src(n=N):
    return rl.ArrayReader(np.arange(n, dtype=np.int64))


class Counter:
    """A map function that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return (x[0] * 2,)


def _flat(item):
    return np.concatenate([np.asarray(getattr(v, "data", v)).reshape(-1) for v in item])


def _epoch(chain):
    return [_flat(x) for x in chain]


def _rest_items(chain):
    out = []
    while True:
        x = chain.read_next()
        if x is None:
            return out
        out.append(_flat(x))


def _rest(chain):
    """The rest of the current epoch (iter() would start the next one)."""
    out = []
    while True:
        x = chain.read_next()
        if x is None:
            return out
        out.append(int(_flat(x)[0]))


def _state_at(make, k):
    """The state of a fresh chain after k items, through a JSON round trip."""
    c = make()
    it = iter(c)
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    return state


def _restore_at(make, k):
    """A fresh chain restored to the state at k (its next item is item k)."""
    state = _state_at(make, k)
    other = make()
    other.set_state(state)
    return other


def _shuffle_of(chain):
    return next(r for r in chain._walk() if isinstance(r, rl.readers._shuffle.ShuffleReader))


# ------------------------------------------------------------ 1:1 decorators
DECORATED = {
    "map": lambda f: _src().map(f, output_schema=I64),
    "map_threads": lambda f: _src().map(f, num_threads=2, output_schema=I64),
    "map_batches": lambda f: _src().map(f, output_schema=I64).batch(7).map_batches(lambda b: b),
    "take": lambda f: _src().map(f, output_schema=I64).take(450),
    "skip": lambda f: _src().map(f, output_schema=I64).skip(37),
    "repeat": lambda f: _src().map(f, output_schema=I64).repeat(2),
    "multi_pass": lambda f: _src().map(f, output_schema=I64).multi_pass(3),
    "batch_prefetch": lambda f: _src().map(f, output_schema=I64).batch(5).prefetch(3),
}


@pytest.mark.parametrize("name", sorted(DECORATED))
def test_decorator_restore_calls_no_function(name):
    # the old code replayed through these (threaded map, map_batches, prefetch,
    # take, skip, repeat, multi_pass): fn ran again for every record before the position
    make = DECORATED[name]
    ref = _epoch(make(Counter()))
    for k in (5, len(ref) // 2, len(ref) - 1, len(ref)):
        f = Counter()
        c = make(f)
        it = iter(c)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(c.get_state()))
        c.close()
        g = Counter()
        other = make(g)
        before = g.calls                 # map_batches infers its schema from batch 0
        other.set_state(state)
        # (a prefetcher starts reading when it is built: at most its ring and the
        # batch being made, 4 batches of 5, whatever k; the old replay: 5 k)
        allowed = 20 if name == "batch_prefetch" else 0
        calls = g.calls - before
        assert calls <= allowed, f"{name}: set_state at {k} called the function {calls} times"
        rest = _epoch(other)
        assert len(rest) == len(ref) - k
        assert all(np.array_equal(a, b) for a, b in zip(rest, ref[k:]))


def test_threaded_map_batches_resume_exactly_everywhere():
    f = Counter()
    assert_checkpoint_equal(lambda: _src(200).map(f, num_threads=2, output_schema=I64).batch(9))
    assert_checkpoint_equal(lambda: _src(200).batch(8).map_batches(lambda b: b).take(20).repeat(2))


def test_threaded_map_skip_mid_chunk_is_exact():
    # c_skip inside a chunk in flight: its computed outcomes first, then the input below
    ref = [int(x[0]) for x in _src().map(Counter(), num_threads=2, output_schema=I64)]
    for first, k in ((1, 5), (10, 2000), (300, 299), (0, 600)):
        f = Counter()
        c = _src().map(f, num_threads=2, output_schema=I64)
        got = [int(c.read_next()[0]) for _ in range(first)]
        skipped = c._skip(k)
        rest = _rest(c)
        assert skipped == min(k, N - first)
        assert got + rest == ref[:first] + ref[first + skipped:]


def test_threaded_map_skip_over_a_failed_record_raises_as_reading_does():
    def f(x):
        if int(x[0]) == 7:
            raise KeyError("seven")
        return (x[0],)
    c = _src(50).map(f, num_threads=2, output_schema=I64)
    assert int(c.read_next()[0]) == 0
    with pytest.raises(KeyError, match="seven"):
        c._skip(10)                      # items 1..6 go, the failed 7th raises
    assert int(c.read_next()[0]) == 8    # reading on: the failed record is dropped, as c_next does


class _FlakyIter:
    """Yields 0, 1, ... but raises once, instead of `bad` (which is lost)."""

    def __init__(self, n, bad):
        self.i, self.n, self.bad = 0, n, bad

    def __iter__(self):
        return self

    def __next__(self):
        i = self.i
        if i >= self.n:
            raise StopIteration
        self.i += 1
        if i == self.bad:
            raise OSError(f"flaky at {i}")
        return (np.int64(i),)


def test_skip_reader_count_stays_exact_across_an_error_below():
    c = rl.PythonReader(lambda: _FlakyIter(40, 5), I64).skip(10)
    with pytest.raises(OSError, match="flaky at 5"):
        c.read_next()
    # 10 items skipped in all: 0-4, then 6-10 (5 was lost below)
    assert _rest(c) == list(range(11, 40))


def test_skip_reader_bulk_skip_interrupted_says_so():
    c = rl.PythonReader(lambda: _FlakyIter(40, 5), I64).skip(3)
    with pytest.raises(OSError, match="flaky at 5"):
        c._skip(10)                      # one call below for 3 + 10: how far it got is unknown
    with pytest.raises(RuntimeError, match="position in the epoch is unknown"):
        c.read_next()
    c.reset()
    assert [int(c.read_next()[0]) for _ in range(2)] == [3, 4]


def test_take_and_repeat_restore_through_passes():
    assert_checkpoint_equal(lambda: _src(40).shuffle(8, seed=2).take(25).repeat(3).batch(4))
    assert_checkpoint_equal(lambda: _src(30).multi_pass(2).skip(7).shard(3, 2))


_PREFETCH_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import readerlib as rl
    sys.path.insert(0, {support!r})
    from helpers import assert_checkpoint_equal
    src = lambda n: rl.ArrayReader(np.arange(n, dtype=np.int64))
    # resume at every position, epochs 1 and 2
    assert_checkpoint_equal(lambda: src(300).batch(7).prefetch(2))
    assert_checkpoint_equal(lambda: src(300).shuffle(40, seed=5).batch(6).prefetch(4))
    # c_skip while the thread runs: ring first, then the thread stopped, then below
    ref = [int(x[0]) for x in src(3000).prefetch(8)]
    for first, k in ((0, 1), (5, 3), (5, 8), (20, 500), (100, 5000), (2999, 1)):
        c = src(3000).prefetch(8)
        got = [int(c.read_next()[0]) for _ in range(first)]
        n = c._skip(k)
        rest = []
        while True:
            x = c.read_next()
            if x is None:
                break
            rest.append(int(x[0]))
        assert n == min(k, 3000 - first), (first, k, n)
        assert got + rest == ref[:first] + ref[first + n:], (first, k)
        c.close()
    # shard over prefetch: every other item skipped with c_skip(1) while the thread runs
    a = [int(x[0]) for x in src(500).prefetch(3).shard(4, 1)]
    assert a == list(range(1, 500, 4)), a[:10]
    # an error below that ended the run: c_skip raises it after the items before
    # it, as reading does (a skip that stops the thread first skips below instead,
    # without calling the map's function: no error there)
    import time
    def bad(x):
        if int(x[0]) == 1:
            raise KeyError("one")
        return (x[0],)
    c = src(100).map(bad, output_schema=rl.Schema([rl.Field("x", "int64")])).prefetch(4)
    assert int(c.read_next()[0]) == 0
    time.sleep(0.3)                          # the thread has met the error and ended
    try:
        c._skip(10)
    except KeyError:
        pass
    else:
        raise AssertionError("no KeyError")
    c.close()
    print("OK")
""")


def test_prefetch_resume_and_skip_exact_in_a_subprocess():
    # the child imports the readerlib under test through conftest's PYTHONPATH
    # (the installed package in CI, not the uncompiled source tree)
    run_ok_script(_PREFETCH_SCRIPT.format(support=SUPPORT_DIR))


# ------------------------------------------------------------ the buffer shuffle
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounded")
    rio = str(d / "a.rio")
    with rl.RecordIOWriter(rio, I64, chunk_size=1024) as w:      # ~128 records a chunk
        w.write_batch({"x": np.arange(N, dtype=np.int64)})
    tfr = str(d / "a.tfrecord")
    with TFRecordWriter(tfr) as w:
        for i in range(N):
            w.write(np.int64(i).tobytes() * (1 + i % 3))
    noidx = str(d / "noidx.tfrecord")
    import shutil
    shutil.copy(tfr, noidx)
    TFRecordReader(tfr).write_index()            # the sidecar: random access without a scan
    return {"rio": rio, "tfrecord": tfr, "tfrecord_noidx": noidx}


SOURCES = {
    "array": lambda f: _src(),
    "recordio": lambda f: rl.RecordIOReader(f["rio"]),
    "tfrecord": lambda f: TFRecordReader(f["tfrecord"]),
    "global": lambda f: rl.RecordIOReader(f["rio"]).global_shuffle(seed=9, window_chunks=2),
}


@pytest.mark.parametrize("src", sorted(SOURCES))
@pytest.mark.parametrize("around", ["plain", "batch_prefetch", "shard_multi_pass"])
def test_buffer_shuffle_resumes_exactly_by_random_access(files, src, around):
    def make():
        c = SOURCES[src](files).shuffle(64, seed=11)
        if around == "batch_prefetch":
            return c.batch(10).prefetch(2)
        if around == "shard_multi_pass":
            return c.multi_pass(2).shard(3, 1)
        return c
    assert_checkpoint_equal(make)
    ref = _epoch(make())
    for k in (1, len(ref) // 3, len(ref) - 2):
        other = _restore_at(make, k)
        assert _shuffle_of(other).restores == 1       # rebuilt, not replayed
        rest = _epoch(other)
        assert len(rest) == len(ref) - k and all(np.array_equal(a, b) for a, b in zip(rest, ref[k:]))


def test_buffer_larger_than_the_epoch_and_nested_shuffles(files):
    assert_checkpoint_equal(lambda: _src(90).shuffle(500, seed=1).batch(4))
    assert_checkpoint_equal(lambda: _src(90).shuffle(20, seed=1).shuffle(7, seed=2))
    assert_checkpoint_equal(lambda: rl.RecordIOReader(files["rio"]).shuffle(1, seed=1).take(50))


def test_sources_without_random_access_fall_back_to_replay(files):
    def py():
        return rl.PythonReader(lambda: iter([(np.int64(i),) for i in range(200)]), I64)
    chains = [
        lambda: py().shuffle(30, seed=4).batch(3),
        # (a map over a source with random access restores by position now:
        # tests/readers/test_resume_filter_shuffle.py)
        lambda: rl.RecordIOReader(files["rio"]).select_chunks([2, 0, 1]).shuffle(30, seed=4),
        lambda: rl.RecordIOReader(files["rio"], on_error="skip").shuffle(30, seed=4),
    ]
    for make in chains:
        assert_checkpoint_equal(make, epochs=1)
        other = _restore_at(make, 50)
        assert _shuffle_of(other).restores == 0
        other.close()


def test_tfrecord_without_its_index_replays_and_is_not_scanned_for_a_state(files):
    make = lambda: TFRecordReader(files["tfrecord_noidx"]).shuffle(64, seed=11).batch(8)
    c = make()
    it = iter(c)
    for _ in range(10):
        next(it)
    st = c.get_state()
    assert st["parent"]["buffer"] is None
    assert not c._walk()[-1].has_index           # get_state did not scan the file
    assert_checkpoint_equal(make, epochs=1)


def test_restore_does_not_read_the_epoch_before_the_buffer(files, tmp_path):
    # a corrupt chunk early in the file: a replay reads it and raises; the bounded
    # restore takes only the buffer's records (all far after it) and the
    # source's position (chunks stepped over by their counts)
    n = 20000
    path = str(tmp_path / "big.rio")
    with rl.RecordIOWriter(path, I64, chunk_size=4096) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    r0 = rl.RecordIOReader(path)
    offs, nrec = r0.chunk_table()
    r0.close()
    os.mkdir(tmp_path / "bad")
    bad = str(tmp_path / "bad" / "big.rio")           # the same name: the state fits
    data = bytearray(open(path, "rb").read())
    assert offs[3] > 4096 + 64 and len(offs) > 10
    data[int(offs[3]) + 60] ^= 0x01              # inside chunk 3's body (the identity
    #                                              checksums cover the first and last 4 KiB)
    open(bad, "wb").write(bytes(data))
    make = lambda p: rl.RecordIOReader(p).shuffle(100, seed=3).batch(50)
    c = make(path)
    it = iter(c)
    for _ in range(300):                         # 15000 records in
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    rest = _rest_items(c)
    other = make(bad)
    other.set_state(state)                       # the old code replayed: RecordIOError on chunk 3
    got = _epoch(other)
    assert len(got) == len(rest) and all(np.array_equal(a, b) for a, b in zip(got, rest))
    with pytest.raises(rl.RecordIOError):
        _epoch(make(bad))                        # the chunk is corrupt indeed


def test_restore_cost_is_bounded_by_the_buffer():
    # the work of a restore is the buffer's records, whatever the position:
    # the shuffle takes `count` records by index and nothing else
    n = 200000
    make = lambda: rl.ArrayReader(np.arange(n, dtype=np.int64)).shuffle(1000, seed=8).batch(100)
    sizes = []
    for k in (100, 1000, 1990):
        other = _restore_at(make, k)
        sh = _shuffle_of(other)
        assert sh.restores == 1 and sh.emitted == 100 * k
        sizes.append(len(json.dumps(other.get_state())))
        got = _flat(other.read_next())
        ref = make()
        it = iter(ref)
        for _ in range(k):
            next(it)
        assert np.array_equal(got, _flat(next(it)))
    assert max(sizes) < 4 * min(sizes)           # the state is the buffer's, not the epoch's


def test_state_right_after_a_restore_and_pickling():
    import pickle
    make = lambda: _src().shuffle(50, seed=2).batch(4)
    ref = _epoch(make())
    a = _restore_at(make, 40)
    b = make()
    b.set_state(json.loads(json.dumps(a.get_state())))   # not read since its restore
    assert _shuffle_of(b).restores == 1
    c = pickle.loads(pickle.dumps(b))
    for chain in (a, b, c):
        rest = _epoch(chain)
        assert len(rest) == len(ref) - 40 and all(np.array_equal(x, y) for x, y in zip(rest, ref[40:]))


def test_state_from_another_chain_is_refused():
    c = _src().shuffle(50, seed=2)
    it = iter(c)
    for _ in range(100):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    with pytest.raises(ValueError, match="seed"):
        _src().shuffle(50, seed=3).set_state(state)
    with pytest.raises(ValueError, match="buffer_size"):
        _src().shuffle(51, seed=2).set_state(state)
    with pytest.raises(ValueError, match="ShuffleReader"):
        _src().map(Counter(), output_schema=I64).set_state(state)
    bad = json.loads(json.dumps(state))
    bad["buffer"]["slots"] = "not base64!"
    with pytest.raises(ValueError, match="saved buffer is inconsistent"):
        _src().shuffle(50, seed=2).set_state(bad)
    bad = json.loads(json.dumps(state))
    bad["buffer"]["source_position"] += 7                # records that do not add up
    with pytest.raises(ValueError, match="saved buffer is inconsistent"):
        _src().shuffle(50, seed=2).set_state(bad)
    bad = json.loads(json.dumps(state))
    bad["buffer"]["anchor"] -= 1                         # a tail of the wrong length
    with pytest.raises(ValueError, match="saved buffer is inconsistent"):
        _src().shuffle(50, seed=2).set_state(bad)
    bad = json.loads(json.dumps(state))
    bad["buffer"] = [1, 2]
    with pytest.raises(ValueError, match="must be a dict"):
        _src().shuffle(50, seed=2).set_state(bad)


def test_a_corrupt_chunk_in_the_buffer_raises_and_releases(tmp_path):
    # the restore reads the buffer's records: a corrupt chunk among them is the
    # format's error, and the records taken before it are let go
    n = 20000
    os.mkdir(tmp_path / "good")
    os.mkdir(tmp_path / "bad")
    path = str(tmp_path / "good" / "f.rio")
    with rl.RecordIOWriter(path, I64, chunk_size=4096) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    r0 = rl.RecordIOReader(path)
    offs, nrec = r0.chunk_table()
    r0.close()
    starts = np.concatenate([[0], np.cumsum(nrec)])
    make = lambda p: rl.RecordIOReader(p).shuffle(500, seed=3)
    c = make(path)
    it = iter(c)
    for _ in range(10000):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    c = int(np.searchsorted(starts, 10400, side="right") - 1)     # the chunk the source is in
    assert 4096 < offs[c] < offs[-1] - 8192
    bad = str(tmp_path / "bad" / "f.rio")
    data = bytearray(open(path, "rb").read())
    data[int(offs[c]) + 60] ^= 0x01
    open(bad, "wb").write(bytes(data))
    other = make(bad)
    with pytest.raises(rl.RecordIOError, match="f.rio"):
        other.set_state(state)
    assert other._memory_stats()["blocks"] == 0 and other._memory_stats()["payload_bytes"] == 0
    other.close()
    good = make(path)
    good.set_state(state)
    assert _shuffle_of(good).restores == 1 and len(_rest(good)) == n - 10000


def test_rewind_past_a_threaded_maps_read_ahead():
    # a 2-thread map pulls its input 1024 records at a time: at get_state the
    # shuffle below has handed out up to 1024 more than the chain's position,
    # and the restore undoes those steps (draws recomputed from the anchor)
    f = Counter()
    make = lambda: _src(1500).shuffle(40, seed=6).map(f, num_threads=2, output_schema=I64).batch(9)
    assert_checkpoint_equal(make, epochs=1)
    ref = _epoch(make())
    for k in (3, 50, 100, 160, len(ref) - 1):
        c = make()
        it = iter(c)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(c.get_state()))
        sh = _shuffle_of(c)
        assert sh.emitted > 9 * k                 # read ahead
        buf = state["parent"]["parent"]["buffer"]
        assert buf["emitted"] - buf["anchor"] >= sh.emitted - 9 * k
        other = make()
        other.set_state(state)
        assert _shuffle_of(other).restores == 1 and _shuffle_of(other).emitted == 9 * k
        rest = _epoch(other)
        assert len(rest) == len(ref) - k and all(np.array_equal(a, b) for a, b in zip(rest, ref[k:]))


def test_a_position_before_the_saved_steps_replays_exactly():
    make = lambda: _src(1500).shuffle(40, seed=6).map(Counter(), num_threads=2, output_schema=I64).batch(9)
    ref = _epoch(make())
    c = make()
    it = iter(c)
    for _ in range(20):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    buf = state["parent"]["parent"]["buffer"]
    # keep only the last step: the position (180) is before what the state can rewind to
    src, e = buf["source_position"], buf["emitted"]
    from readerlib.readers._shuffle import _pack_positions, _unpack_positions
    tail = _unpack_positions(buf["tail"], src, e - buf["anchor"], "t")
    buf["anchor"], buf["tail"] = e, _pack_positions(tail[:0], src)
    other = make()
    other.set_state(state)
    assert _shuffle_of(other).restores == 0     # replayed
    rest = _epoch(other)
    assert len(rest) == len(ref) - 20 and all(np.array_equal(a, b) for a, b in zip(rest, ref[20:]))


# ------------------------------------------------------- the restore's cost
def test_positions_pack_bit_tight_and_old_states_still_decode():
    from readerlib.readers._shuffle import _pack_positions, _unpack_positions
    import base64
    import zlib
    rng = np.random.default_rng(3)
    for src, n, span in ((1, 0, 1), (1, 1, 1), (10, 7, 1), (5_000_000, 100_000, 4_000_000),
                         ((1 << 32) - 1, 5000, (1 << 32) - 1), (1000, 1000, 1000)):
        pos = src - 1 - rng.integers(0, span, n)
        text = _pack_positions(pos, src)
        width = int(max(src - 1 - pos, default=0)).bit_length()
        assert text.startswith(f"p{width}:")
        assert len(text) <= 4 * -(-(n * width + 7) // 8 // 3) + 8     # base64 of the bits, no more
        assert np.array_equal(_unpack_positions(text, src, n, "t"), pos)
    # the form states were written in before (uint32 ages, deflated): a restore takes it
    pos = np.array([9, 3, 7], np.int64)
    v1 = base64.b64encode(zlib.compress((10 - 1 - pos).astype("<u4").tobytes(), 1)).decode()
    assert np.array_equal(_unpack_positions(v1, 10, 3, "t"), pos)
    for bad, what in (("p3:AAAA", "bytes of 3-bit positions"), ("p40:", "40 bits"),
                      ("p9:!!", "do not decode"), (v1, "positions, expected 4")):
        with pytest.raises(ValueError, match=what):
            _unpack_positions(bad, 10, 4, "t")
    with pytest.raises(ValueError, match="before the epoch's start"):
        _unpack_positions(_pack_positions([0, 1], 1000), 10, 2, "t")


def test_a_state_in_the_older_position_form_restores_exactly():
    from readerlib.readers._shuffle import _unpack_positions
    import base64
    import zlib
    make = lambda: _src(3000).shuffle(200, seed=4).batch(7)
    ref = _epoch(make())
    c = make()
    for _ in range(150):
        c.read_next()
    state = json.loads(json.dumps(c.get_state()))
    buf = state["parent"]["buffer"]
    src = buf["source_position"]
    for key, n in (("slots", buf["count"]), ("tail", buf["emitted"] - buf["anchor"])):
        pos = _unpack_positions(buf[key], src, n, "t")
        buf[key] = base64.b64encode(zlib.compress((src - 1 - pos).astype("<u4").tobytes(), 1)).decode()
    other = make()
    other.set_state(state)
    assert _shuffle_of(other).restores == 1
    rest = _epoch(other)
    assert len(rest) == len(ref) - 150 and all(np.array_equal(a, b) for a, b in zip(rest, ref[150:]))


def test_restored_buffer_needs_no_compaction_pass(tmp_path):
    # A restore from a file copies the buffer's small records into the shuffle's
    # own blocks as it reads them: the chunks they came from are let go, and the
    # first read does not run a compaction pass over the whole buffer (the old
    # restore kept every chunk the buffer touched, then copied them all out on
    # the first batch).  From an array in memory nothing is copied at all.
    from readerlib.readers._shuffle import _compaction_settings
    n = 120_000
    path = str(tmp_path / "f.rio")
    with rl.RecordIOWriter(path, I64, chunk_size=64 << 10) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    old = _compaction_settings(slack_bytes=0)       # compaction at this small scale
    try:
        for make in (lambda: rl.RecordIOReader(path).shuffle(20_000, seed=5).batch(64),
                     lambda: rl.ArrayReader(np.arange(n, dtype=np.int64)).shuffle(20_000, seed=5).batch(64)):
            ref = _epoch(make())
            k = 1000                             # 64,000 records in: the buffer spans ~9 chunks
            other = _restore_at(make, k)
            sh = _shuffle_of(other)
            st = sh._memory_stats()
            assert sh.restores == 1 and st["payload_bytes"] == 20_000 * 8
            if not isinstance(other._walk()[-1], rl.ArrayReader):
                assert st["pinned_bytes"] <= st["payload_bytes"] + (1 << 20), st   # one arena block
            first = _flat(other.read_next())
            st = sh._memory_stats()
            assert st["passes"] == 0 and st["copied_records"] == 0, st
            rest = [first] + _rest_items(other)
            assert len(rest) == len(ref) - k and all(np.array_equal(a, b) for a, b in zip(rest, ref[k:]))
    finally:
        _compaction_settings(**old)


_DAMAGED_BUFFER_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import readerlib as rl
    make = lambda: rl.ArrayReader(np.arange(3000, dtype=np.int64)).shuffle(100, seed=1).batch(5)
    c = make()
    it = iter(c)
    for _ in range(50):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    key, value = json.loads(sys.argv[1])
    if value == "DELETE":
        del state["parent"]["buffer"][key]
    else:
        state["parent"]["buffer"][key] = value
    try:
        make().set_state(state)
    except ValueError as e:
        print("VALUEERROR", e)
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize("key, value", [
    ("rng", [1, 2, 3]),                  # read past the list's end: a crash
    ("rng", [0, 0, 0, 0]),               # the generator's all-zero state: draws forever
    ("rng", [-1, 0, 0, 0]), ("rng", [2 ** 64, 0, 0, 0]), ("rng", 7), ("rng", ["a", 0, 0, 0]),
    ("emitted", 2 ** 64), ("anchor", -2 ** 64), ("count", None), ("done_at", [1]),
    ("source_position", "DELETE"), ("emitted", True)])
def test_a_damaged_saved_buffer_is_a_value_error_in_a_subprocess(key, value):
    # the old code crashed (a 3-word rng), hung (an all-zero one) or raised
    # OverflowError / TypeError / KeyError from the int64-typed restore
    p = subprocess.run([sys.executable, "-c", _DAMAGED_BUFFER_SCRIPT, json.dumps([key, value])],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "VALUEERROR set_state: reader 1 from the top (ShuffleReader): the shuffle's saved buffer" \
        in p.stdout, p.stdout + p.stderr[-2000:]
