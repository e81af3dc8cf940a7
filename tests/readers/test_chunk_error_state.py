"""A chunk that fails its checks, and the states saved after it.

A RecordIO chunk that fails a check (here its body CRC) is raised once
(on_error="raise") or skipped with a RecordIOWarning (on_error="skip"); either
way reading on gives every record of the epoch but the chunk's.  A TFRecord
record failing its data CRC drops the rest of its chunk the same way, and a
record header failing its checks in a chunk that the index knows drops the
chunk.  What a state saved after that restores to, per chain:

* raise mode: the position counts delivered items, and set_state positions
  by the chunk table (c_skip steps whole chunks by their index counts): the
  lost records shifted it, so a restore read the bad chunk again (set_state
  raised the checksum error while the original read on) or, past it, came
  out other records than the original.  Now get_state refuses (RuntimeError
  naming the file, chunk and offset: ReaderBase._dropped) until the next
  epoch; a state saved before the error restores exactly, the error
  included.  The same for TFRecord, whose indexed chunk failing its header
  checks was raised on every read (now stepped over, as RecordIO's), and
  whose chunk cache failed a buffer shuffle's restore of a state saved
  before the error (it now keeps the records before the bad one).
* skip mode: a RecordIO reader in skip mode positions by reading (its c_skip
  reads), so a restore skips the same chunk and counts the same: exact, and
  these tests keep it so.  open_files over files opened in skip mode stepped
  over whole units by the plan's chunk counts, the skipped chunk's too (the
  restore came out records later than the original); their units now count
  as unknown without reading, so the restore reads them: exact.
* open_files in raise mode raised the same error on every call until reset;
  it now raises a file's data error once and reads on, and refuses get_state
  after it (as the readers do).
* global_shuffle raised the error on every read without moving on (an epoch
  that could never end); it now raises once (skips, with the warning, over a
  skip-mode source) and reads on with every other record once.  Its states
  after the loss were refused (its O(1) set_state positioned by the
  permutation, where the lost chunk's records still counted); since session
  18 they record the lost chunks ("lost", version 4) and restore exactly.
"""
import os
import warnings

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats._tfrecord import TFRecordReader, TFRecordWriter, build_index
from readerlib.readers.files import open_files, register_file_reader, unregister_file_reader

from helpers import corrupt_chunk, read_events

N = 400                    # records 0 .. N-1 (an int64 field holding the record's number)
BAD = 3                    # the corrupt chunk: 16 records a chunk, records 48 .. 63
LIMIT = 12                 # errors in one pass beyond which a reader counts as stuck


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rl.RecordIOWarning)
        yield


def _write_rio(path):
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(N, dtype=np.int64)})
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    r.close()
    assert len(offs) > BAD + 4 and nrec[BAD] == 16
    bad, lost = corrupt_chunk(path, chunk=BAD, at=40)
    # the message: "PATH: chunk body checksum mismatch (chunk 3) at byte offset OFF" (the body)
    return lost, int(offs[BAD]) + 32


@pytest.fixture
def rio(tmp_path):
    path = str(tmp_path / "bad.rio")
    lost, off = _write_rio(path)
    return path, lost, off


def _ids(item):
    """The record numbers in an item (an instance, or a batch of them)."""
    if isinstance(item[0], rl.LoDTensor):
        t = item[0]
        if t.lod:                                   # TFRecord byte records: the number is in the first 8 bytes
            d, o = np.asarray(t.data), np.asarray(t.lod[0])
            return tuple(int(d[o[i]:o[i] + 8].view(np.int64)[0]) for i in range(len(o) - 1))
        return tuple(int(v) for v in np.asarray(t.data).reshape(-1))
    a = np.asarray(item[0])
    return (int(a[:8].view(np.int64)[0]),) if a.dtype == np.uint8 else (int(a),)


def _read(chain, save=True):
    """(events, states, errors) of the rest of the epoch (helpers.read_events)."""
    return read_events(chain, _ids, save, LIMIT)


def _records(events):
    return sorted(i for e in events if e != "err" for i in e)


def _verdict(make, state, want):
    """What restoring `state` in a fresh chain gives, against `want` (the rest
    of the original pass): for the assertion messages."""
    other = make()
    try:
        other.set_state(state)
    except Exception as e:
        return f"set_state raised {type(e).__name__}: {e}"
    rest = _read(other, save=False)[0]
    other.close()
    if rest == want:
        return "restores exactly"
    return f"restores to a different sequence ({rest[:4]}... against {want[:4]}...)"


def _restores_exactly(make, states, events, ks):
    for k in ks:
        assert isinstance(states[k], dict), f"get_state before read {k} raised {states[k]}"
        v = _verdict(make, states[k], events[k:])
        assert v == "restores exactly", f"state saved before read {k}: {v}"


def _sample(lo, hi, step=9):
    """Indices in [lo, hi): every step-th, and both ends."""
    return sorted({k for k in range(lo, hi, step)} | ({lo, hi - 1} if hi > lo else set()))


def _check_refused_after(make, states, events, k_err, match):
    """States saved before the error (read k_err) restore exactly, the error
    included; every one saved after it is refused, naming the fault."""
    _restores_exactly(make, states, events, _sample(0, k_err + 1))
    for k in range(k_err + 1, len(states)):
        st = states[k]
        assert isinstance(st, RuntimeError), (
            f"get_state after the error (before read {k}, the error at read {k_err}) saved a "
            f"state that {_verdict(make, st, events[k:])}")
    for k in _sample(k_err + 1, len(states), 37):
        assert _match(match, str(states[k])), states[k]


def _match(pattern, text):
    import re
    return re.search(pattern, text) is not None


CHAINS = {
    "reader": lambda r: r,
    "buffer": lambda r: r.shuffle(32, seed=1),
    "window": lambda r: r.shuffle(32, seed=1, mode="window"),
    "batch": lambda r: r.batch(7),
    "buffer_batch": lambda r: r.shuffle(32, seed=1).batch(7),
    "window_batch": lambda r: r.shuffle(40, seed=2, mode="window").batch(5),
}


# -------------------------------------------------------------- RecordIO, raise
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_raise_mode_a_state_after_the_bad_chunk_is_refused(rio, chain):
    path, lost, off = rio
    make = lambda: CHAINS[chain](rl.RecordIOReader(path))
    c = make()
    events, states, errors = _read(c)
    assert len(errors) == 1 and isinstance(errors[0], rl.RecordIOError), errors
    msg = f"chunk body checksum mismatch \\(chunk {BAD}\\) at byte offset {off}"
    assert _match(f"{path}: {msg}", str(errors[0]))
    assert _records(events) == sorted(set(range(N)) - lost)        # reading on loses only the chunk
    _check_refused_after(make, states, events, events.index("err"),
                         f"RecordIOReader dropped a record this epoch \\({path}: {msg}")
    c.reset()                                                       # the next epoch saves again
    assert c.get_state()["position"] == 0
    events2, states2, errors2 = _read(c)
    assert _records(events2) == _records(events) and len(errors2) == 1
    c.close()


# -------------------------------------------------------------- RecordIO, skip
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_skip_mode_a_state_after_the_skipped_chunk_restores_exactly(rio, chain):
    path, lost, off = rio
    make = lambda: CHAINS[chain](rl.RecordIOReader(path, on_error="skip"))
    c = make()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        events, states, errors = _read(c)
    skipped = [str(w.message) for w in ws if issubclass(w.category, rl.RecordIOWarning)]
    assert errors == [] and len(skipped) == 1, skipped
    assert f"skipped chunk: chunk body checksum mismatch (chunk {BAD}) at byte offset {off}" in skipped[0]
    assert c._walk()[-1].skipped_chunks == 1 and c._walk()[-1].on_error == "skip"
    assert _records(events) == sorted(set(range(N)) - lost)
    # every state, before and after the chunk: the restored reader skips it
    # too, and its position counts what was delivered (not the chunk table)
    _restores_exactly(make, states, events, _sample(0, len(states), 5))
    c.close()


# -------------------------------------------------------------- TFRecord
SIZE = 8192                # 8 KiB records: 128 a chunk (1 MiB), not deferred (< 32 KiB)


def _write_tfrecord(path, n, bad, what, index):
    """n records, record i's first 8 bytes = i; record `bad` damaged in its data
    ("data") or its length's CRC ("length").  With `index`, the sidecar index is
    built first and the file's mtime kept, so the index still holds."""
    with TFRecordWriter(path) as w:
        for i in range(n):
            x = np.full(SIZE, i % 251, np.uint8)
            x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
            w.write(x)
    if index:
        build_index(path)
    st = os.stat(path)
    at = (SIZE + 16) * bad + (12 + 100 if what == "data" else 9)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return (SIZE + 16) * bad            # the bad record's offset


TF_CASES = [("data", True), ("data", False), ("length", True)]   # (a length without an index: nothing after it is reachable)


@pytest.mark.parametrize("what,index", TF_CASES)
@pytest.mark.parametrize("chain", ["reader", "batch", "buffer"])
def test_tfrecord_a_state_after_a_dropped_chunk_is_refused(tmp_path, what, index, chain):
    path = str(tmp_path / "bad.tfrecord")
    n, bad = 640, 128 + 40                                  # a record of the second chunk
    off = _write_tfrecord(path, n, bad, what, index)
    make = lambda: CHAINS[chain](TFRecordReader(path, index=path + ".idx" if index else False))
    c = make()
    assert c._walk()[-1].has_index == index
    lo, hi = 128, 256                                       # the bad record's chunk (128 records a chunk)
    events, states, errors = _read(c)
    assert len(errors) == 1 and isinstance(errors[0], rl.TFRecordError), errors
    why = "data checksum mismatch" if what == "data" else "length checksum mismatch"
    assert f"{path}: corrupted record at {off} ({why})" in str(errors[0])
    gone = set(range(bad, hi)) if what == "data" else set(range(lo, hi))
    assert _records(events) == sorted(set(range(n)) - gone)
    _check_refused_after(make, states, events, events.index("err"),
                         f"TFRecordReader dropped a record this epoch .*{path}: corrupted record at {off}")
    c.reset()
    assert c.get_state()["position"] == 0
    c.close()


def test_tfrecord_random_access_gives_the_records_before_a_bad_one_in_its_chunk(tmp_path):
    """As sequential reading gives them (TensorFlow's order): the chunk cache
    keeps the records read before the failure, so a read of one of them
    succeeds -- a buffer shuffle over the file restores a state saved before
    the error by reading its buffer so (set_state raised the error) --, and a
    read of one after them raises it."""
    path = str(tmp_path / "bad.tfrecord")
    off = _write_tfrecord(path, 640, 168, "data", True)
    r = TFRecordReader(path, index=path + ".idx")
    assert [_ids(x) for x in r.read_many([130, 167, 0, 300])] == [(130,), (167,), (0,), (300,)]
    for i in (168, 200, 255):
        with pytest.raises(rl.TFRecordError, match=f"corrupted record at {off} "):
            r[i]
    assert _ids(r[131]) == (131,)
    r.close()


# -------------------------------------------------------------- open_files
def test_open_files_raise_mode_reads_on_and_refuses_a_state_after_the_error(rio):
    # (the rule until session 18: after a worker's error, the same error on
    # every call until reset, and a state saved after it restored to that;
    # now a file's data error is raised once and reading goes on:
    # tests/readers/test_leftovers18.py)
    path, lost, off = rio
    make = lambda: open_files([path], num_threads=2)
    c = make()
    events, states, errors = _read(c)
    k = events.index("err")
    assert events[:k] == [(i,) for i in range(min(lost))] and len(errors) == 1
    assert _records(events) == sorted(set(range(N)) - lost)
    _check_refused_after(make, states, events, k,
                         f"MultiFileReader dropped a record this epoch \\({path}: chunk body checksum mismatch")
    c.close()


@pytest.fixture
def skip_suffix():
    register_file_reader(".skip.rio", lambda p, schema=None: rl.RecordIOReader(p, on_error="skip"))
    yield ".skip.rio"
    unregister_file_reader(".skip.rio")


@pytest.mark.parametrize("threads", [1, 2])
def test_open_files_over_skip_mode_files_restores_exactly_after_a_skipped_chunk(tmp_path, skip_suffix, threads):
    paths = [str(tmp_path / f"f{i}{skip_suffix}") for i in range(2)]
    for p in paths:
        _write_rio(p)                     # each file: its chunk 3 corrupt (records 48..63 of each)
    make = lambda: open_files(paths, num_threads=threads)
    c = make()
    events, states, errors = _read(c)
    assert errors == [] and len(events) == 2 * (N - 16)
    # the restore steps over whole units by the plan's chunk counts only where a
    # count is certain: a unit of a skip-mode file may deliver fewer
    _restores_exactly(make, states, events, _sample(0, len(states), 23))
    c.close()


# -------------------------------------------------------------- global shuffle
def _tfrecord_source(tmp_path):
    path = str(tmp_path / "bad.tfrecord")
    off = _write_tfrecord(path, 640, 128 + 40, "data", True)
    return (lambda: TFRecordReader(path, index=path + ".idx"), set(range(128, 256)), 640,
            f"{path}: corrupted record at {off} \\(data checksum mismatch\\)")


SOURCES = ["rio", "rio_skip", "open_files", "open_files_skip", "tfrecord"]


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("source", SOURCES)
def test_global_shuffle_reads_on_past_a_bad_chunk(tmp_path, source, batch, request):
    if source == "tfrecord":
        src, chunk, n, msg = _tfrecord_source(tmp_path)
    else:
        path = str(tmp_path / ("bad.skip.rio" if source == "open_files_skip" else "bad.rio"))
        if source == "open_files_skip":
            request.getfixturevalue("skip_suffix")
        chunk, off = _write_rio(path)
        n = N
        msg = f"{path}: chunk body checksum mismatch \\(chunk {BAD}\\) at byte offset {off}"
        src = {"rio": lambda: rl.RecordIOReader(path),
               "rio_skip": lambda: rl.RecordIOReader(path, on_error="skip"),
               "open_files": lambda: open_files([path]),
               "open_files_skip": lambda: open_files([path])}[source]
    skip = source.endswith("_skip")
    make = lambda: (src().global_shuffle(seed=5, window_chunks=3).batch(6) if batch
                    else src().global_shuffle(seed=5, window_chunks=3))
    c = make()
    for epoch in range(2):                                  # the next epoch meets the chunk again
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            events, states, errors = _read(c)
        assert len(errors) <= LIMIT, f"stuck: {len(errors)} errors, {errors[0]}"
        skipped = [str(w.message) for w in ws if issubclass(w.category, rl.RecordIOWarning)]
        if skip:
            assert errors == [] and len(skipped) == 1 and _match(msg.replace(": chunk body", ": skipped chunk: chunk body"),
                                                                 skipped[0]), skipped
        else:
            assert len(errors) == 1 and _match(msg, str(errors[0])), errors
        # every record not in the bad chunk, exactly once
        assert _records(events) == sorted(set(range(n)) - chunk)
        # every state, before and after the loss, restores exactly: the states
        # after it carry the lost chunk ("lost", version 4), so the restore
        # neither loads it again (no error, no second warning) nor counts its
        # places as items (they were refused until session 18)
        k_err = events.index("err") if not skip else next(
            k for k, st in enumerate(states) if st.get("version") == 4) - 1
        assert all(st["version"] == 4 for st in states[k_err + 1:])
        _restores_exactly(make, states, events, _sample(0, k_err + 1, 31))
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            _restores_exactly(make, states, events, _sample(k_err + 1, len(states), 31))
        assert not [str(w.message) for w in ws if issubclass(w.category, rl.RecordIOWarning)]
        c.reset()
    c.close()


def test_global_shuffle_skip_after_a_lost_chunk_counts_records(rio):
    """A bulk skip (c_skip: shard, skip, ...) after a lost chunk drops records,
    not the lost chunk's places in the permutation."""
    path, lost, off = rio
    a = rl.RecordIOReader(path).global_shuffle(seed=5, window_chunks=3)
    b = rl.RecordIOReader(path).global_shuffle(seed=5, window_chunks=3)
    for r in (a, b):
        while True:
            try:
                r.read_next()
            except rl.RecordIOError:
                break
    assert a._skip(40) == 40
    for _ in range(40):
        assert b.read_next() is not None
    assert _read(a, save=False)[0] == _read(b, save=False)[0]
    a.close()
    b.close()
