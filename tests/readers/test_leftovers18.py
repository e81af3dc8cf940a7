"""Reliability left-overs (session 18): errors that repeated forever, counters
that moved before the step they count, a state checked after the chain was
touched.

1. A TFRecord file read without a chunk table (no .idx) with a corrupt
   record length: nothing after the bad length can be located, and every
   later read raised the same error again -- a loop that goes on past errors
   (tf.data's ignore_errors, a retry loop) never ended, and the records of
   the chunk before the bad one were lost too.  Now: the records before it
   come out (TensorFlow's order), the error is raised once naming the file
   and byte offset, then the file is over for this epoch (tf.data's
   TFRecordDataset goes on to its next file the same way); get_state
   refuses after it (the position no longer adds up), reset() starts a
   whole next epoch that raises once again at the same place.
3. RepeatReader moved its pass counter before the reset below; a reset that
   raised (an interrupt inside open_files' thread join) left the counter
   moved and the pass count at zero, so the next read ended the whole
   repeat: the remaining passes were lost.  Now the counter moves after the
   reset, and the next read retries it.
4. FilterReader checked its saved counts inside _set_epoch_state, after
   set_state had reset the chain: a damaged filter state left the chain
   part-way (every read raised).  Now _check_epoch_state checks them before
   anything is touched, and the chain reads on where it was.
"""
import copy
import json
import os
import sys
import warnings

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats._tfrecord import TFRecordReader, TFRecordWriter
from readerlib.readers.files import open_files

from helpers import InjectedInterrupt, call_tracer, read_events

SIZE = 8192                # 8 KiB records: 128 a chunk (1 MiB)
N = 640
BAD = 168                  # a record of the second chunk (records 128 .. 255)
LIMIT = 12                 # errors in one pass beyond which a reader counts as stuck


def _write(path, n=N, bad=BAD, how="length", compression=None):
    """n records (record i's first 8 bytes = i); record `bad`'s length damaged
    ("length": a bit of its length, so its length CRC fails; "huge": length
    and CRC rewritten to a valid 2 TiB length; "trunc": the file cut inside it)."""
    with TFRecordWriter(path, compression=compression) as w:
        for i in range(n):
            x = np.full(SIZE, i % 251, np.uint8)
            x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
            w.write(x)
    off = (SIZE + 16) * bad
    if compression is not None:
        return off
    with open(path, "r+b") as f:
        if how == "length":
            f.seek(off + 1)
            b = f.read(1)
            f.seek(off + 1)
            f.write(bytes([b[0] ^ 0x5A]))
        elif how == "huge":
            from readerlib.formats._tfrecord import masked_crc32c
            head = (1 << 41).to_bytes(8, "little")
            f.seek(off)
            f.write(head + masked_crc32c(head).to_bytes(4, "little"))
        elif how == "trunc":
            f.truncate(off + 100)
    return off


def _id(item):
    """The record numbers in an item (an instance, or a batch of them)."""
    t = item[0]
    if isinstance(t, rl.LoDTensor):
        d, o = np.asarray(t.data), np.asarray(t.lod[0])
        return tuple(int(d[o[i]:o[i] + 8].view(np.int64)[0]) for i in range(len(o) - 1))
    return (int(np.asarray(t)[:8].view(np.int64)[0]),)


def _read(chain, save=True):
    """(events, states, errors) of the rest of the epoch (helpers.read_events)."""
    return read_events(chain, _id, save, LIMIT)


def _records(events):
    return sorted(i for e in events if e != "err" for i in e)


CHAINS = {
    "reader": lambda r: r,
    "batch": lambda r: r.batch(7),
    "buffer": lambda r: r.shuffle(32, seed=1),
}


# ------------------------------------------------------------------ item 1
@pytest.mark.parametrize("how", ["length", "huge"])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_unindexed_bad_length_raises_once_then_the_file_is_over(tmp_path, chain, how):
    path = str(tmp_path / "bad.tfrecord")
    off = _write(path, how=how)
    make = lambda: CHAINS[chain](TFRecordReader(path, index=False))
    c = make()
    for epoch in range(2):                     # reset(): the next epoch raises again, once
        events, states, errors = _read(c)
        assert len(errors) == 1, f"epoch {epoch}: {len(errors)} errors: {errors[0]}"
        why = "length checksum mismatch" if how == "length" else "length 2199023255552 out of range"
        assert isinstance(errors[0], rl.TFRecordError) and errors[0].offset == off
        assert f"{path}: corrupted record at {off} ({why})" in str(errors[0])
        # every record before the bad one (its chunk's too), none after it
        assert _records(events) == list(range(BAD)), (epoch, _records(events)[-3:])
        k = events.index("err")
        if chain == "reader":
            assert events[k + 1:] == []                             # then the end of the epoch
        # a state saved before the error restores exactly, the error included
        for j in sorted({0, k // 2, k}):
            other = make()
            other.set_state(states[j])
            rest, _, errs = _read(other, save=False)
            assert rest == events[j:] and len(errs) == 1, (j, rest[:3], events[j:j + 3])
            other.close()
        # after it the position no longer adds up: refused, naming file and offset
        for j in range(k + 1, len(states)):
            assert isinstance(states[j], RuntimeError), f"a state saved after the error: {states[j]}"
            assert f"{path}: corrupted record at {off}" in str(states[j])
            assert "the rest of the file was not read" in str(states[j])
        c.reset()
        assert c.get_state()["position"] == 0
    c.close()


def test_unindexed_truncated_file_raises_once(tmp_path):
    # a file cut inside a record: every complete record, the error once, the end
    path = str(tmp_path / "cut.tfrecord")
    off = _write(path, how="trunc")
    r = TFRecordReader(path, index=False)
    events, _, errors = _read(r, save=False)
    assert len(errors) == 1 and f"truncated record at {off}" in str(errors[0])
    assert _records(events) == list(range(BAD)) and events[-1] == "err"
    r.close()


def test_unindexed_damaged_compressed_stream_raises_once(tmp_path):
    path = str(tmp_path / "bad.tfrecord.gz")
    _write(path, compression="GZIP")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:                # garbage in the middle of the deflate stream
        f.seek(size // 2)
        f.write(b"\xff" * 64)
    r = TFRecordReader(path, compression="GZIP", index=False)
    events, _, errors = _read(r, save=False)
    assert len(errors) == 1, [str(e) for e in errors[:2]]
    assert isinstance(errors[0], rl.TFRecordError) and path in str(errors[0])
    got = _records(events)
    assert got == list(range(len(got))) and 0 < len(got) < N
    r.close()


def _num(x):
    a = np.asarray(x[0])
    return int(a[:8].view(np.int64)[0]) if a.dtype == np.uint8 else int(a)


def _read_ids(chain, save=True):
    """_read over items of one record each, as (record ids, "err")."""
    return read_events(chain, _num, save, LIMIT)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["tfrecord", "recordio"])
def test_open_files_raises_a_files_data_error_once_then_reads_on(tmp_path, kind, threads):
    """The file's error once, in its place; then what that file's reader reads
    on to (TFRecord without an index: nothing; RecordIO: the next chunk) and
    the next files -- it raised the same error on every later read."""
    if kind == "tfrecord":
        bad = str(tmp_path / "a.tfrecord")
        off = _write(bad)
        good = str(tmp_path / "b.tfrecord")
        _write(good, n=300, how=None)            # (no damage)
        msg = f"{bad}: corrupted record at {off} (length checksum mismatch)"
        want = list(range(BAD)) + list(range(300))
    else:
        bad, good = str(tmp_path / "a.rio"), str(tmp_path / "b.rio")
        lost = _bad_rio(bad)
        with rl.RecordIOWriter(good, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
            w.write_batch({"x": np.arange(1000, 1300, dtype=np.int64)})
        msg = f"{bad}: chunk body checksum mismatch (chunk 3)"
        want = [i for i in range(400) if i not in lost] + list(range(1000, 1300))
    make = lambda: open_files([bad, good], num_threads=threads)
    c = make()
    for epoch in range(2):
        events, states, errors = _read_ids(c)
        assert len(errors) == 1, f"epoch {epoch}: {len(errors)} errors: {errors[0]}"
        assert msg in str(errors[0])
        assert [e for e in events if e != "err"] == want
        k = events.index("err")
        assert events[k - 1] == want[k - 1] and events[k + 1] == want[k]      # in its place
        for j in sorted({0, k // 2, k}):           # states before the error restore exactly
            other = make()
            other.set_state(states[j])
            rest, _, errs = _read_ids(other, save=False)
            assert rest == events[j:] and len(errs) == 1, (j, rest[:3], events[j:j + 3])
            other.close()
        for j in _sample(k + 1, len(states)):      # after it: refused, naming the error
            assert isinstance(states[j], RuntimeError) and msg in str(states[j]), states[j]
        c.reset()
    c.close()


def _sample(lo, hi, step=97):
    return sorted({*range(lo, hi, step), hi - 1}) if hi > lo else []


def test_open_files_a_reader_that_does_not_move_on_ends_the_run(tmp_path):
    # a reader raising the same DataLossError without a record in between: the
    # old rule (the run ends, the error again on every call until reset), never a loop
    from readerlib.readers.files import register_file_reader, unregister_file_reader

    class Stuck:                        # one record, then the same error on every call
        def __init__(self, path):
            self.path, self.i = path, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            if self.i == 1:
                return (np.int64(1),)
            raise rl.DataLossError(f"{self.path}: stuck at byte offset 7", self.path, 7)

    def stuck(path, schema=None):
        return rl.PythonReader(lambda: Stuck(path), rl.Schema([rl.Field("x", "int64", ())]))

    register_file_reader(".stuck", stuck)
    try:
        path = str(tmp_path / "a.stuck")
        open(path, "wb").close()
        c = open_files([path])
        events, _, errors = _read_ids(c, save=False)
        assert events[0] == 1 and len(errors) == LIMIT + 1
        assert {str(e) for e in errors} == {f"{path}: stuck at byte offset 7"}
        c.close()
    finally:
        unregister_file_reader(".stuck")


def test_no_index_is_written_for_a_file_whose_scan_stopped(tmp_path):
    # the table stops at the bad record: no sidecar index of a part of the file
    path = str(tmp_path / "bad.tfrecord")
    _write(path)
    r = TFRecordReader(path)                     # index="auto": written after a complete pass
    for _ in range(2):
        events, _, errors = _read(r, save=False)
        assert len(errors) == 1 and _records(events) == list(range(BAD))
        r.reset()
    assert not r.has_index and not os.path.exists(path + ".idx")
    r.close()


# ------------------------------------------------------------------ item 2
def _bad_rio(path):
    from helpers import corrupt_chunk
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(400, dtype=np.int64)})
    _, lost = corrupt_chunk(path, chunk=3, at=40)
    return lost


SKIP_CHAINS = {
    "reader": lambda p: rl.RecordIOReader(p, on_error="skip"),
    "buffer": lambda p: rl.RecordIOReader(p, on_error="skip").shuffle(32, seed=1),
    "batch": lambda p: rl.RecordIOReader(p, on_error="skip").batch(7),
}


def _drain(c):
    out = []
    while (x := c.read_next()) is not None:
        out.append(np.asarray(x[0]).tolist())
    return out


@pytest.mark.parametrize("chain", sorted(SKIP_CHAINS))
def test_a_restore_in_place_does_not_count_or_warn_a_skipped_chunk_again(tmp_path, chain):
    path = str(tmp_path / "bad.rio")
    _bad_rio(path)
    c = SKIP_CHAINS[chain](path)
    src = c._walk()[-1]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(12):                    # past the bad chunk (records 48 .. 63)
            c.read_next()
        st = c.get_state()
        rest = _drain(c)
        assert src.skipped_chunks == 1 and len(ws) == 1
        for k in range(3):                      # back into the epoch, again and again
            c.set_state(st)
            assert _drain(c) == rest
        assert src.skipped_chunks == 1, "a restore counted the skipped chunk again"
        assert len(ws) == 1, [str(w.message) for w in ws]
        c.reset()                               # the next epoch skips it (and says so) again
        st0 = c.get_state()
        epoch2 = _drain(c)
        assert src.skipped_chunks == 2 and len(ws) == 2
        # back to the start of the epoch that skipped it: reading it again, not twice
        c.set_state(st0)
        assert _drain(c) == epoch2
        assert src.skipped_chunks == 2 and len(ws) == 2
    # a chain restored afresh (another process) counts and warns it once
    other = SKIP_CHAINS[chain](path)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        other.set_state(st)
        assert _drain(other) == rest
    assert other._walk()[-1].skipped_chunks == 1 and len(ws) == 1 and "skipped chunk" in str(ws[0].message)
    other.close()
    c.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_open_files_skip_mode_restore_in_place_warns_once(tmp_path, threads):
    # the stream's readers are opened afresh by each run: the chunks a file
    # skipped this epoch are the stream's to remember
    from readerlib.readers.files import register_file_reader, unregister_file_reader
    register_file_reader(".skip18.rio", lambda p, schema=None: rl.RecordIOReader(p, on_error="skip"))
    try:
        paths = [str(tmp_path / f"f{i}.skip18.rio") for i in range(2)]
        for p in paths:
            _bad_rio(p)
        c = open_files(paths, num_threads=threads)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            for _ in range(100):                     # past the first file's bad chunk
                c.read_next()
            st = c.get_state()
            rest = _drain(c)
            assert len(ws) == 2                      # one a file
            c.set_state(st)
            assert _drain(c) == rest
            assert len(ws) == 2, [str(w.message) for w in ws]
            c.reset()                                # the next epoch: once a file again
            _drain(c)
            assert len(ws) == 4
        c.close()
    finally:
        unregister_file_reader(".skip18.rio")


# ------------------------------------------------------------------ item 3
def _rio(path, n=40):
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})


def _interrupt_next_read(c):
    """read_next() with an InjectedInterrupt at its first Python-level call
    (open_files' reset joins its threads in Python): True when it was hit."""
    tracer, seen = call_tracer(1)
    sys.settrace(tracer)
    try:
        c.read_next()
        return False
    except InjectedInterrupt:
        return True
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("kind", ["repeat", "repeat_forever", "multi_pass"])
def test_a_failed_reset_below_leaves_the_pass_where_it_was(tmp_path, kind):
    path = str(tmp_path / "a.rio")
    _rio(path)
    make = {"repeat": lambda: open_files([path]).repeat(3),
            "repeat_forever": lambda: open_files([path]).repeat(),
            "multi_pass": lambda: open_files([path]).multi_pass(3)}[kind]
    c = make()
    first = [int(c.read_next()[0]) for _ in range(40)]
    assert first == list(range(40))
    top = c._walk()[0]
    assert _interrupt_next_read(c)             # the reset below (the second pass) interrupted
    assert top.pass_id == 0                    # the pass has not moved
    st = c.get_state()
    assert st["position"] == 40
    # the next read retries the reset: the remaining passes come out whole
    rest = [int(c.read_next()[0]) for _ in range(80)]
    assert rest == list(range(40)) * 2 and top.pass_id == 2
    # and the state saved after the failed reset restores to the same
    other = make()
    other.set_state(st)
    assert [int(other.read_next()[0]) for _ in range(80)] == rest
    if kind != "repeat_forever":
        assert c.read_next() is None and other.read_next() is None
    other.close()
    c.close()


# ------------------------------------------------------------------ item 4
def _filter_chain():
    return rl.ArrayReader(np.arange(300, dtype=np.int64)).filter(lambda x: int(x[0]) % 3 != 0)


def _rest(c):
    out = []
    while (x := c.read_next()) is not None:     # (iter() would start the next epoch)
        out.append(int(x[0]))
    return out


def _damage(state, how):
    s = copy.deepcopy(state)
    f = s["filter"]
    if how == "counts":
        f["counts"] = "zz"
    elif how == "first":
        f["first"] = -5
    elif how == "passes":
        f["passes"] = 5
    elif how == "epoch":
        s["epoch"] = "x"
    elif how == "not_a_dict":
        s["filter"] = [1, 2]
    return s


@pytest.mark.parametrize("how", ["counts", "first", "passes", "epoch", "not_a_dict"])
def test_a_damaged_filter_state_leaves_the_chain_where_it_was(how):
    c = _filter_chain()
    for _ in range(30):
        c.read_next()
    good = c.get_state()
    for _ in range(5):
        c.read_next()
    before = c.get_state()
    with pytest.raises(ValueError, match=r"FilterReader\): set_state: the filter's saved"):
        c.set_state(_damage(good, how))
    # nothing touched: the chain reads on where it was, its state as it was
    assert c.get_state() == before
    ref = _filter_chain()
    ref.set_state(before)
    assert _rest(c) == _rest(ref)
    # and a good state still restores
    c.set_state(good)
    ref.set_state(good)
    assert _rest(c) == _rest(ref)


# ------------------------------------------------------------------ item 5
def _gs(path, on_error):
    return rl.RecordIOReader(path, on_error=on_error).global_shuffle(seed=5, window_chunks=3)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_global_shuffle_a_state_after_a_lost_chunk_restores_in_place_without_loading_it(tmp_path, on_error):
    path = str(tmp_path / "bad.rio")
    lost = _bad_rio(path)
    c = _gs(path, on_error)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        errors = 0
        while True:                                   # up to just past the loss
            try:
                c.read_next()
            except rl.RecordIOError:
                errors += 1
            st = c.get_state()
            if st["version"] == 4:
                break
        assert [u for _, u, _ in st["lost"]] == [3] and errors == (on_error == "raise")
        rest = _drain(c)
        assert len(ws) == (on_error == "skip")
        for _ in range(2):                            # back to it, in place: no error, no warning
            c.set_state(st)
            assert _drain(c) == rest
        assert len(ws) == (on_error == "skip")
        assert rest and not set(lost) & set(rest)
    c.close()


@pytest.mark.parametrize("lost", [[99], [3, 3], "3", [True], [-1], None, [[3, 0]], [[0, 3, -1]],
                                  [[0, 3, 10 ** 9]], [[0, 99, 0]], [[-1, 3, 0]], [[0, 3, 0], [0, 3, 5]],
                                  [[0, 3, 0.5]], [[0, 3, True]]])
def test_global_shuffle_a_damaged_lost_list_is_refused_before_anything_is_touched(tmp_path, lost):
    path = str(tmp_path / "bad.rio")
    _bad_rio(path)
    c = _gs(path, "raise")
    with pytest.raises(rl.RecordIOError):
        while True:
            c.read_next()
    st = c.get_state()
    assert st["version"] == 4 and [u for _, u, _ in st["lost"]] == [3]
    for _ in range(20):
        c.read_next()
    before = c.get_state()
    with pytest.raises(ValueError, match="malformed 'lost'"):
        c.set_state(dict(st, lost=lost))
    assert c.get_state() == before                    # untouched: reads on where it was
    ref = _gs(path, "raise")
    ref.set_state(before)
    assert _drain(c) == _drain(ref)


def test_global_shuffle_states_without_a_loss_stay_version_2(tmp_path):
    path = str(tmp_path / "good.rio")
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(400, dtype=np.int64)})
    c = rl.RecordIOReader(path).global_shuffle(seed=5, window_chunks=3).batch(4)
    c.read_next()
    st = c.get_state()
    assert st["version"] == 2 and "lost" not in json.dumps(st)
    c.close()


def test_global_shuffle_under_a_prefetcher_still_refuses_after_a_loss(tmp_path):
    # the prefetcher's thread loses the chunk ahead of what its consumer saw
    path = str(tmp_path / "bad.rio")
    _bad_rio(path)
    c = _gs(path, "skip").prefetch(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = 0
        while True:
            try:
                c.get_state()
            except RuntimeError as e:
                assert "under a prefetcher" in str(e) and f"{path}: chunk body checksum mismatch (chunk 3)" in str(e)
                break
            assert c.read_next() is not None
            n += 1
    c.close()


def _rio_many_bad(path):
    from helpers import corrupt_chunk
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(600, dtype=np.int64)})
    for ch in (3, 4, 20):                          # two in one window, one in another
        corrupt_chunk(path, chunk=ch, at=40)


GS_CHAINS = {
    # a shard steps over the other shards' places with c_skip, also over a chunk
    # not known to be bad yet (counted as items): the position of each loss travels
    "shard": lambda g: g.shard(3, 2),
    # each pass is an epoch of the global shuffle: the losses of every pass travel
    "multi_pass": lambda g: g.multi_pass(2),
    "repeat_buffer": lambda g: g.repeat(2).shuffle(10, seed=1),
    # a buffer shuffle that restores by index falls back to replaying after a loss
    "buffer": lambda g: g.shuffle(20, seed=4),
    "skip_take_batch": lambda g: g.skip(50).take(300).batch(3),
}


def _events(c, save=True):
    """(events, states) of the rest of the epoch, each item's values flattened."""
    flat = lambda x: np.asarray(getattr(x[0], "data", x[0])).reshape(-1).tolist()
    return read_events(c, flat, save, limit=float("inf"))[:2]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("chain", sorted(GS_CHAINS))
def test_global_shuffle_every_state_after_losses_restores_exactly(tmp_path, chain, on_error):
    path = str(tmp_path / "bad.rio")
    _rio_many_bad(path)
    make = lambda: GS_CHAINS[chain](
        rl.RecordIOReader(path, on_error=on_error).global_shuffle(seed=7, window_chunks=3))
    c = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for epoch in range(2):
            events, states = _events(c)
            refused = [s for s in states if isinstance(s, RuntimeError)]
            assert not refused, refused[0]
            assert sum(s["version"] == 4 for s in states) > len(states) // 2
            for k in range(epoch, len(states), 5):
                other = make()
                other.set_state(states[k])
                rest = _events(other, save=False)[0]
                assert rest == events[k:], f"epoch {epoch}, state before read {k}: {rest[:4]} != {events[k:k + 4]}"
                other.close()
            c.reset()
    c.close()
