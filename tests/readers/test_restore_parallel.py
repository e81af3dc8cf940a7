"""The buffer shuffle's restore fill on the pool (issue 16 item 3).

After the probe (the newest 4096 buffered records, which decide the inline
cells), a restore from a file fills the rest in pieces of the file order on
readerlib's threads, each thread through a chunk cache of its own; a piece
stops at a record not of the preset size, or at an error, and the rest of it
is filled serially (which raises the format's own error).  These tests pin
that the pooled fill, the emulated one (every piece on the caller, piece p as
thread p % threads, each "thread" with its own cache) and the serial one give
the same buffer and the same epoch as an uninterrupted run, and that a corrupt
chunk met in a piece is the format's error naming the file, nothing held.
"""
import contextlib
import json
import os
import shutil
import threading

import numpy as np
import pytest

import readerlib as rl
from readerlib import _parallel
from readerlib.readers import _shuffle
from helpers import corrupt_chunk
from test_resume_bounded import _state_at
from test_restore_chunk_load import _good_file_state, _items, _shuffle_of, _write_fixed, _write_var

BUF = 12_000          # the probe (4096) and then 7,904 records in pieces


@contextlib.contextmanager
def _fill_mode(mode):
    """'serial', 'pool' (readerlib's threads, at least 2) or 'emulated'; inline
    cells on at this scale, the pieces from any size."""
    threads = {"serial": 1, "pool": 2, "emulated": 2}[mode]
    old_i = _shuffle._inline_settings(enabled=True, min_payload=0, cell=0)
    old_p = _shuffle._restore_parallel_settings(min_records=0, threads=threads,
                                                emulate=mode == "emulated")
    old_n = rl.get_num_threads()
    rl.set_num_threads(max(2, old_n))
    _parallel._reset_backoff()
    try:
        yield
    finally:
        rl.set_num_threads(old_n)
        _shuffle._restore_parallel_settings(**old_p)
        _shuffle._inline_settings(**old_i)


def _restore(make, st):
    other = make()
    other.set_state(st)
    sh = _shuffle_of(other)
    assert sh.restores == 1
    return other, sh


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    return _write_fixed(str(tmp_path_factory.mktemp("par") / "f.rio"), 60_000, chunk_size=4096)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_pooled_and_emulated_fills_restore_exactly_as_the_serial_one(fixed, seed):
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=seed)
    ref = _items(make())
    n = len(ref)
    rng = np.random.default_rng(seed)
    for k in sorted(set(rng.integers(1, n - 10, 3).tolist()) | {n // 2}):
        st = _state_at(make, k)
        got = {}
        for mode in ("serial", "emulated", "pool"):
            with _fill_mode(mode):
                other, sh = _restore(make, st)
                stats = sh._memory_stats()
                tids, bounds = sh._par_tids, sh._par_bounds
                # the state right after the restore is the saved one
                st2 = json.loads(json.dumps(other.get_state()))
                rest = _items(other)
                other.close()
            for key in ("slots", "source_position", "count", "emitted"):
                assert st2["buffer"][key] == st["buffer"][key], (mode, key)
            assert rest == ref[k:], f"{mode}: restored at {k}, the rest differs"
            held = min(BUF, n - k)
            if mode == "serial" or held <= 4096 or (mode == "pool" and not _parallel.threads_enabled()):
                assert tids is None                 # no pieces (a pool without threads: no split)
            else:
                # every piece ran, on a thread in range; the pieces tile the
                # file order after the probe
                assert np.all((tids >= 0) & (tids < 2)), tids
                assert bounds[0] == 0 and bounds[-1] == held - 4096 and np.all(np.diff(bounds) >= 0)
                if mode == "emulated":
                    assert set(tids.tolist()) == {0, 1}   # both caches used
            # all of the buffer in cells, as the serial fill leaves it
            assert stats["inline_records"] == held and stats["blocks"] <= 1, (mode, stats)
            got[mode] = stats["inline_records"]
        assert len(set(got.values())) == 1


def test_variable_records_stop_the_pieces_and_the_serial_fill_takes_the_rest(tmp_path):
    path = _write_var(str(tmp_path / "v.rio"), 30_000, chunk_size=4096)
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=5)
    ref = _items(make())
    for k in (3000, 15_000):
        st = _state_at(make, k)
        for mode in ("emulated", "pool", "serial"):
            with _fill_mode(mode):
                other, sh = _restore(make, st)
                assert _items(other) == ref[k:], (mode, k)
                other.close()


@pytest.mark.parametrize("mode", ["emulated", "pool"])
def test_a_corrupt_chunk_met_in_a_piece_raises_naming_the_file(tmp_path, mode):
    n, k = 60_000, 20_000
    good, make, st, starts = _good_file_state(tmp_path, n, k, BUF)
    src = st["buffer"]["source_position"]
    held = _shuffle._unpack_positions(st["buffer"]["slots"], src, st["buffer"]["count"], "test")
    # for each piece position: an old chunk (the first pieces), a middle one
    for back in (25_000, 14_000):
        c = int(np.searchsorted(starts, src - back, side="right") - 1)
        assert np.sum((held >= starts[c]) & (held < starts[c + 1])) > 0     # the fill reads it
        assert np.sum(held >= starts[c + 1]) > 4096                         # ... after the probe
        bad = str(tmp_path / "bad" / "f.rio")      # the same name: the same file identity
        shutil.copy(good, bad)
        corrupt_chunk(bad, chunk=c, at=60)
        with _fill_mode(mode):
            other = make(bad)
            with pytest.raises(rl.RecordIOError, match=r"bad/f\.rio.*byte offset"):
                other.set_state(st)
            stats = other._memory_stats()
            assert stats["cell"] > 0               # decided, pieces run, before the error
            assert stats["blocks"] == 0 and stats["payload_bytes"] == 0, stats
            other.close()
            again = make(good)
            again.set_state(st)
            assert _shuffle_of(again).restores == 1 and len(_items(again)) == n - k
            again.close()


def test_huge_pages_are_a_hint_only(fixed):
    # the restore's slots and cells with and without the huge-page advice:
    # the same buffer and the same rest of the epoch
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=9)
    ref = _items(make())
    st = _state_at(make, 20_000)
    for huge in (False, True):
        old = _shuffle._restore_parallel_settings(hugepages=huge)
        try:
            with _fill_mode("pool"):
                other, _ = _restore(make, st)
                assert _items(other) == ref[20_000:], huge
                other.close()
        finally:
            _shuffle._restore_parallel_settings(**old)


@pytest.mark.parametrize("overlap", [False, True])
def test_populating_the_fresh_arrays_leaves_their_bytes_and_the_restore_unchanged(tmp_path, overlap):
    # The restore faults in its fresh slots and cells up front (one madvise a
    # piece, on the pool) from 2 MiB on: 140k slots of 16 bytes and 140k
    # cells of 16-byte records are both over it; the slots while the caller
    # makes the chunk order (overlap) or before it.  The buffer and the rest
    # of the epoch are the same with and without, and as uninterrupted.
    a = np.random.default_rng(5).integers(0, 256, 5 << 20, dtype=np.uint8)
    b = a.copy()
    before = _shuffle._populate_py(np.zeros(0, np.uint8))
    assert _shuffle._populate_py(a) == before + a.nbytes
    assert np.array_equal(a, b)                             # the advice never writes
    assert _shuffle._populate_py(np.zeros(1 << 20, np.uint8)) == before + a.nbytes  # (1 MiB: below it)
    path = str(tmp_path / "w.rio")
    schema = rl.Schema([rl.Field("x", "int64", (2,))])
    n, buf, k = 200_000, 140_000, 30_000
    with rl.RecordIOWriter(path, schema, chunk_size=64 << 10) as w:
        w.write_batch({"x": np.arange(2 * n, dtype=np.int64).reshape(n, 2)})
    make = lambda: rl.RecordIOReader(path).shuffle(buf, seed=4)
    ref = _items(make())
    st = _state_at(make, k)
    slots = []
    for populate in (False, True):
        old = _shuffle._restore_parallel_settings(populate=populate, overlap=overlap)
        try:
            with _fill_mode("pool"):
                p0 = _shuffle._populate_py(np.zeros(0, np.uint8))
                other, sh = _restore(make, st)
                advised = _shuffle._populate_py(np.zeros(0, np.uint8)) - p0
                assert sh._fill_order == "chunk" and sh._par_tids is not None
                assert sh._memory_stats()["inline_records"] == buf
                slots.append(json.loads(json.dumps(other.get_state())))
                assert _items(other) == ref[k:], populate
                other.close()
        finally:
            _shuffle._restore_parallel_settings(**old)
        # slots (16 B) and cells (16 B) over 2 MiB each; slot positions (4 B) under
        assert advised == (2 * 16 * buf if populate else 0)
    assert slots[0] == slots[1]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to move between")
def test_a_worker_on_its_callers_cpu_leaves_it_and_puts_its_affinity_back():
    # (on a thread of its own: affinity is per thread, this one's is left alone)
    allowed = os.sched_getaffinity(0)
    out = {}

    def run():
        try:
            here = sorted(allowed)[0]
            os.sched_setaffinity(0, {here})         # on `here` now ...
            os.sched_setaffinity(0, allowed)        # ... and free to stay there
            out["same"] = _shuffle._spread_py()     # the caller on this thread's CPU
            out["other"] = _shuffle._spread_py(-1)  # no caller CPU: nothing moves
        finally:
            os.sched_setaffinity(0, allowed)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    moved, cpu, during, after = out["same"]
    assert moved and cpu not in (-1, sorted(allowed)[0])
    assert during == allowed - {sorted(allowed)[0]} and after == allowed
    moved, _, during, after = out["other"]
    assert not moved and during == after == allowed


@pytest.mark.parametrize("spread", [False, True])
def test_spreading_the_fill_leaves_the_restore_unchanged(fixed, spread):
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=8)
    ref = _items(make())
    st = _state_at(make, 25_000)
    old = _shuffle._restore_parallel_settings(spread=spread)
    try:
        with _fill_mode("pool"):
            other, sh = _restore(make, st)
            assert sh._par_moved is not None and (spread or not sh._par_moved.any())
            assert _items(other) == ref[25_000:]
            other.close()
    finally:
        _shuffle._restore_parallel_settings(**old)


def test_the_parallel_settings_hook_checks_its_arguments():
    old = _shuffle._restore_parallel_settings()
    assert set(old) == {"min_records", "threads", "emulate", "hugepages", "chunk_order", "populate",
                        "spread", "overlap"}
    with pytest.raises(ValueError, match="threads"):
        _shuffle._restore_parallel_settings(threads=99)
    with pytest.raises(ValueError, match="min_records"):
        _shuffle._restore_parallel_settings(min_records=-1)
    assert _shuffle._restore_parallel_settings() == old


# ------------------------------------------------------------ the positions' decoder
from hypothesis import given, settings, strategies as hs


@settings(max_examples=200, deadline=None)
@given(hs.integers(1, 1 << 32), hs.integers(0, 300), hs.randoms(use_true_random=False))
def test_the_positions_decode_to_what_was_packed(src, n, rnd):
    # every width (the ages' bit length) and every padding of the last quad:
    # the decoder takes three bytes a step except at the padded end
    top = rnd.choice([1, 2, 255, 4096, 1 << 20, src])
    pos = np.array([src - 1 - rnd.randrange(min(top, src)) for _ in range(n)], np.int64)
    text = _shuffle._pack_positions(pos, src)
    assert np.array_equal(_shuffle._unpack_positions(text, src, n, "t"), pos)


def test_non_ascii_positions_are_a_clear_error():
    text = _shuffle._pack_positions(np.arange(10), 10)
    bad = text[:-2] + "é" + text[-1:]
    with pytest.raises(ValueError, match="positions do not decode"):
        _shuffle._unpack_positions(bad, 10, 10, "t")
