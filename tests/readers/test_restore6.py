"""The restore's pooled fill (issue 16 item 3): when it splits, what a failed
restore leaves open, and the position decoder on crafted strings.

- the fill splits only when the pool can run pieces concurrently: not after
  `set_num_threads(1)` (even with the pieces' thread count forced), not in a
  READERLIB_NO_THREADS build (there parallel_for runs every piece on the
  caller: the extra chunk caches bought nothing);
- it splits only when the probe's records were all of the preset size: with
  records of varying size a piece stops at the first other size and the
  serial fill redoes the rest, so variable-size restores stay serial (and
  still deliver exactly the rest of the epoch and the next one); a uniform
  probe over older records of other sizes still splits, and is exact;
- a restore that fails in its fill (a corrupt chunk) leaves no descriptor
  open, before the reader is closed too;
- closing the pieces' extra caches closes every one even when one close is
  interrupted, then raises the first error;
- the bit-packed position decoder stops at the first byte past the n
  positions it was asked for (its bit buffer once shifted past 64 bits on
  such a string): a ValueError saying so.
"""
import os
import shutil

import numpy as np
import pytest

import readerlib as rl
from readerlib import _parallel
from readerlib.readers import _shuffle
from helpers import corrupt_chunk
from test_resume_bounded import _state_at
from test_restore_chunk_load import VAR, _good_file_state, _items, _shuffle_of, _write_fixed, _write_var
from test_restore_parallel import BUF, _fill_mode, _restore
from test_restore_parallel_review import _write_mixed


def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    return _write_fixed(str(tmp_path_factory.mktemp("r6") / "f.rio"), 60_000, chunk_size=4096)


# ---- 1. no split when the pool cannot run pieces concurrently ----------------------

def test_one_thread_restores_serially_even_with_the_pieces_thread_count_forced(fixed):
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=2)
    ref = _items(make())
    k = 20_000
    st = _state_at(make, k)
    old_n = rl.get_num_threads()
    with _fill_mode("pool"):                    # threads=2: two caches, pieces from any size
        try:
            # the control: with two threads this restore splits (where the
            # build has threads)
            rl.set_num_threads(2)
            other, sh = _restore(make, st)
            assert (sh._par_tids is not None) == _parallel.threads_enabled()
            assert _items(other) == ref[k:]
            other.close()
            rl.set_num_threads(1)
            before = _fds()
            other, sh = _restore(make, st)
            assert sh._par_tids is None, sh._par_tids     # one thread: no pieces
            assert _items(other) == ref[k:]
            other.close()
            assert _fds() == before
        finally:
            rl.set_num_threads(old_n)


def test_the_pool_flag_is_the_builds():
    assert _shuffle._restore_pool_concurrent() == _parallel.threads_enabled()


def test_a_pool_that_runs_pieces_on_the_caller_does_not_split(fixed):
    # as in a READERLIB_NO_THREADS build (the flag forced here; in such a
    # build it is the default, and the pool mode below is that build's own)
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=3)
    ref = _items(make())
    k = 25_000
    st = _state_at(make, k)
    old = _shuffle._restore_pool_concurrent(False)
    try:
        with _fill_mode("pool"):
            other, sh = _restore(make, st)
            assert sh._par_tids is None, sh._par_tids
            assert _items(other) == ref[k:]
            other.close()
        with _fill_mode("emulated"):            # the test mode still runs its pieces
            other, sh = _restore(make, st)
            assert sh._par_tids is not None
            assert _items(other) == ref[k:]
            other.close()
    finally:
        _shuffle._restore_pool_concurrent(old)
    assert _shuffle._restore_pool_concurrent() == old


# ---- 2. variable-size records: no split -------------------------------------------

def _epochs(make):
    chain = make()
    ep0 = _items(chain)
    chain.reset()
    ep1 = _items(chain)
    chain.close()
    return ep0, ep1


def _restore_two_epochs(make, st):
    """Restore `st` on a fresh chain: (its pieces' thread ids, the rest of
    the epoch, the whole next epoch)."""
    other, sh = _restore(make, st)
    tids = sh._par_tids
    rest = _items(other)
    other.reset()
    nxt = _items(other)
    other.close()
    return tids, rest, nxt


@pytest.mark.parametrize("kind", ["var", "mixed"])
def test_variable_size_restores_do_not_split_and_are_exact(tmp_path, kind):
    n = 40_000
    path = (_write_var if kind == "var" else _write_mixed)(str(tmp_path / "v.rio"), n)
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=5)
    ep0, ep1 = _epochs(make)
    assert sorted(i for i, _ in ep0) == list(range(n)) and ep0 != ep1
    for k in (3_000, 15_000, 27_000):
        st = _state_at(make, k)
        for mode in ("pool", "emulated"):
            with _fill_mode(mode):
                before = _fds()
                tids, rest, nxt = _restore_two_epochs(make, st)
                assert _fds() == before
            assert tids is None, (kind, mode, k, tids)      # no pieces, no extra caches
            assert rest == ep0[k:], (kind, mode, k)
            assert nxt == ep1, (kind, mode, k, "the next epoch")


def _write_new_fixed_old_var(path, n, cut):
    # records from `cut` on: 16-byte pads (the probe, the newest, sees only
    # these); before it: 0-36 bytes
    with rl.RecordIOWriter(path, VAR, chunk_size=4096) as w:
        for i in range(n):
            w.write((np.int64(i), np.full(16 if i >= cut else i % 37, i % 251, np.uint8)))
    return path


def test_a_uniform_probe_over_older_records_of_other_sizes_splits_and_is_exact(tmp_path):
    # the pieces stop at the first record of another size, the serial fill
    # takes the rest of each: exact, this epoch and the next
    n, k = 60_000, 20_000
    path = _write_new_fixed_old_var(str(tmp_path / "nv.rio"), n, 24_000)
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=3)
    ep0, ep1 = _epochs(make)
    st = _state_at(make, k)
    for mode in ("emulated", "pool"):
        with _fill_mode(mode):
            tids, rest, nxt = _restore_two_epochs(make, st)
        if mode == "emulated" or _parallel.threads_enabled():
            assert tids is not None, mode
        assert rest == ep0[k:], mode
        assert nxt == ep1, mode


# ---- 3. a failed restore leaves no descriptor open ----------------------------------

@pytest.mark.parametrize("mode", ["serial", "emulated", "pool"])
def test_a_restore_failing_in_its_fill_leaves_no_descriptor_open(tmp_path, mode):
    n, k = 60_000, 20_000
    good, make, st, starts = _good_file_state(tmp_path, n, k, BUF)
    bad = str(tmp_path / "bad" / "f.rio")
    src = st["buffer"]["source_position"]
    for back in (25_000, 2_000):                # met in a piece / in the probe
        shutil.copy(good, bad)
        c = int(np.searchsorted(starts, src - back, side="right") - 1)
        corrupt_chunk(bad, chunk=c, at=60)
        with _fill_mode(mode):
            other = make(bad)
            before = _fds()                     # the reader's own descriptor open
            with pytest.raises(rl.RecordIOError, match=r"bad/f\.rio.*byte offset"):
                other.set_state(st)
            assert _fds() == before, (mode, back, "the fill's chunk cache is still open")
            stats = other._memory_stats()
            assert stats["blocks"] == 0 and stats["payload_bytes"] == 0, stats
            # the same reader, the file good again: a retry opens a fresh cache
            with open(good, "rb") as f, open(bad, "r+b") as g:
                g.write(f.read())
            other.set_state(st)
            assert _shuffle_of(other).restores == 1
            assert len(_items(other)) == n - k
            other.close()


# ---- 4. closing the extra caches: every one, even when one close is interrupted ------

class _Cache:
    def __init__(self, log, name, exc=None):
        self.log, self.name, self.exc = log, name, exc

    def close(self):
        self.log.append(self.name)
        if self.exc is not None:
            raise self.exc


def test_closing_the_extra_caches_closes_every_one_when_a_close_is_interrupted():
    log = []
    caches = [_Cache(log, "a", KeyboardInterrupt()), _Cache(log, "b"),
              _Cache(log, "c", OSError("EIO")), _Cache(log, "d")]
    with pytest.raises(KeyboardInterrupt):      # the first error, after all are closed
        _shuffle._close_all(caches)
    assert log == ["a", "b", "c", "d"]
    log.clear()
    _shuffle._close_all([_Cache(log, "a"), _Cache(log, "b")])
    assert log == ["a", "b"]
    _shuffle._close_all([])


# ---- 5. the position decoder: bytes past the n positions --------------------------

@pytest.mark.parametrize("w, n, extra", [(8, 1, 40), (1, 3, 30), (0, 4, 12), (32, 2, 25),
                                         (17, 5, 100)])
def test_positions_with_bytes_past_the_last_one_are_a_value_error(w, n, extra):
    # good groups past the n positions (the old decoder kept shifting them in,
    # 8 bits a byte, past 64 bits), with a padded last group (the byte-wise
    # path), and without
    src = 1 << 32
    want = (n * w + 7) // 8
    for tail in ("AA==", "AAA=", "AAAA"):
        text = f"p{w}:" + "A" * (4 * ((want + 2) // 3)) + "AAAA" * extra + tail
        with pytest.raises(ValueError, match=rf"t \(more than the {want} bytes of {n} {w}-bit"):
            _shuffle._unpack_positions(text, src, n, "t")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 100])
def test_packed_positions_still_decode(n):
    rng = np.random.default_rng(n)
    for src in (1, 2, 1000, 1 << 20, 1 << 32):
        pos = rng.integers(0, src, n)
        text = _shuffle._pack_positions(pos, src)
        assert np.array_equal(_shuffle._unpack_positions(text, src, n, "t"), pos)
        body = text.partition(":")[2]
        if n:
            # one more group: more bytes than n positions take
            with pytest.raises(ValueError, match="t "):
                _shuffle._unpack_positions(text.partition(":")[0] + ":" + body.rstrip("=") +
                                           "A" * (-len(body.rstrip("=")) % 4) + "AAAA", src, n, "t")
