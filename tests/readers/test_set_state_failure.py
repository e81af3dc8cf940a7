"""A set_state() that fails part-way (after the chain began to take up the
saved epoch) must not leave a chain that reads on silently from wherever the
failure left it: reads raise, naming the failure, until a set_state()
succeeds or reset() starts the next epoch."""
import os
import shutil

import numpy as np
import pytest

import readerlib as rl
from helpers import corrupt_chunk
from test_restore_chunk_load import _items, _write_fixed
from test_resume_bounded import _state_at


def _make(path):
    return rl.RecordIOReader(path).shuffle(12000, seed=3)


def test_a_corrupt_chunk_met_by_the_restore_leaves_a_chain_that_refuses_to_read(tmp_path):
    os.makedirs(tmp_path / "g")
    os.makedirs(tmp_path / "b")
    good = _write_fixed(str(tmp_path / "g" / "f.rio"), 60000)
    bad = str(tmp_path / "b" / "f.rio")
    shutil.copy(good, bad)
    st = _state_at(lambda: _make(good), 20000)
    r = rl.RecordIOReader(good)
    _, nrec = r.chunk_table()
    r.close()
    starts = np.concatenate([[0], np.cumsum(nrec)])
    # a chunk the buffer's records come from (before the source position)
    c = int(np.searchsorted(starts, st["buffer"]["source_position"] - 5000, side="right") - 1)
    corrupt_chunk(bad, chunk=c, at=60)
    o = _make(bad)
    with pytest.raises(rl.RecordIOError) as err:
        o.set_state(st)
    with pytest.raises(RuntimeError, match="last set_state\\(\\) failed part-way") as again:
        o.read_next()
    assert "RecordIOError" in str(again.value) and str(err.value)[:40] in str(again.value)
    with pytest.raises(RuntimeError, match="failed part-way"):
        list(o)                                    # iter() of an unread chain: still refused
    o.close()


def test_a_position_past_the_end_refuses_reads_until_reset_or_a_good_state(tmp_path):
    path = _write_fixed(str(tmp_path / "f.rio"), 5000)
    st = _state_at(lambda: _make(path), 1000)
    want = _items(_make_at(path, st))
    bad = dict(st, position=10 ** 9)
    o = _make(path)
    with pytest.raises(ValueError, match="past the end of the epoch"):
        o.set_state(bad)
    with pytest.raises(RuntimeError, match="ValueError: state position"):
        o.read_next()
    o.set_state(st)                                # a state that restores clears it
    assert _items(o) == want
    with pytest.raises(ValueError):
        o.set_state(bad)
    o.reset()                                      # so does starting the next epoch
    ids = sorted(i for i, _ in _items(o))
    assert ids == list(range(5000))                # that epoch whole, each record once
    o.close()


def test_a_state_refused_before_the_chain_moves_leaves_it_as_it_was(tmp_path):
    path = _write_fixed(str(tmp_path / "f.rio"), 3000)
    o = _make(path)
    first = o.read_next()
    with pytest.raises(ValueError):
        o.set_state({"version": -1})
    assert o.read_next() is not None and first is not None   # reads on: nothing was touched
    o.close()


def _make_at(path, st):
    o = _make(path)
    o.set_state(st)
    return o
