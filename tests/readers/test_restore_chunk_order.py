"""The restore's fill order grouped by chunk (issue 16 item 3).

A restore from a RecordIO file fills its buffer in an order that loads each
chunk once: the keys grouped by chunk, slots in increasing order within a
chunk (`_chunk_order`: one counting pass where the position sort made three),
with the duplicate check a chunk at a time.  Where the chunks are not known,
or the order does not apply, the fill's order is the position sort, as
before.  These tests pin the order against a NumPy reference, that a restore
gives the same buffer and the same rest of the epoch in either order (serial,
pooled, through a map, through a filter), that a position in two slots is
refused with the same message, and that the pooled fill's pieces split at
chunk boundaries (no chunk loaded by two pieces).
"""
import contextlib
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hst

import readerlib as rl
from readerlib import _parallel
from readerlib.readers import _shuffle
from test_restore_chunk_load import _items, _shuffle_of, _write_fixed
from test_restore_parallel import _fill_mode
from test_resume_bounded import _state_at


def _reference(pos, starts):
    """(chunk of each key, slot, position) in the order _chunk_order promises:
    by chunk, then by slot."""
    pos = np.asarray(pos, np.int64)
    chunk = np.searchsorted(starts, pos, side="right") - 1
    slot = np.lexsort((np.arange(len(pos)), chunk))
    return chunk[slot], slot, pos[slot]


@settings(max_examples=200, deadline=None)
@given(lens=hst.lists(hst.integers(0, 70), min_size=1, max_size=40), data=hst.data())
def test_the_chunk_order_groups_keys_by_chunk_slots_increasing(lens, data):
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    total = int(starts[-1])
    if total == 0:
        assert _shuffle._chunk_order_py(np.array([0]), starts) == -1    # outside every chunk
        return
    n = data.draw(hst.integers(1, min(total, 200)))
    pos = np.array(data.draw(hst.lists(hst.integers(0, total - 1), min_size=n, max_size=n, unique=True)),
                   np.int64)
    keys = _shuffle._chunk_order_py(pos, starts)
    _, slot, p = _reference(pos, starts)
    assert isinstance(keys, np.ndarray), keys
    assert np.array_equal((keys & 0xFFFFFFFF).astype(np.int64), slot)
    assert np.array_equal((keys >> 32).astype(np.int64) + pos.min(), p)
    # a position in two slots: refused (1), whichever two slots
    if n >= 2:
        i, j = data.draw(hst.tuples(hst.integers(0, n - 1), hst.integers(0, n - 1)).filter(lambda t: t[0] != t[1]))
        dup = pos.copy()
        dup[j] = dup[i]
        assert _shuffle._chunk_order_py(dup, starts) == 1


def test_the_chunk_order_leaves_to_the_sort_what_it_does_not_fit():
    starts = np.arange(0, 3000, 2, dtype=np.int64)          # 1,499 chunks of 2 records
    pos = np.array([0, 2990], np.int64)
    assert _shuffle._chunk_order_py(pos, starts) == -1        # more than 1024 chunks in the span
    assert isinstance(_shuffle._chunk_order_py(np.array([0, 1000]), starts), np.ndarray)
    assert _shuffle._chunk_order_py(np.array([5, 3000]), starts) == -1   # past the last chunk
    assert _shuffle._chunk_order_py(np.array([-1, 3]), starts) == -1


@contextlib.contextmanager
def _chunk_order(on):
    old = _shuffle._restore_parallel_settings(chunk_order=on)
    try:
        yield
    finally:
        _shuffle._restore_parallel_settings(**old)


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    return _write_fixed(str(tmp_path_factory.mktemp("order") / "f.rio"), 60_000, chunk_size=4096)


_CHAINS = {
    "shuffle": lambda p: rl.RecordIOReader(p).shuffle(12_000, seed=2),
    "map": lambda p: rl.RecordIOReader(p).map(lambda x: x).shuffle(9_000, seed=3),
    "filter": lambda p: rl.RecordIOReader(p).filter(lambda x: int(x[0]) % 5 != 0).shuffle(9_000, seed=4),
}


@pytest.mark.parametrize("chain", sorted(_CHAINS))
@pytest.mark.parametrize("mode", ["serial", "pool", "emulated"])
def test_a_restore_in_chunk_order_is_the_restore_in_position_order(fixed, chain, mode):
    make = lambda: _CHAINS[chain](fixed)
    ref = _items(make())
    n = len(ref)
    for k in (n // 10, n // 2, n - 5000):
        st = _state_at(make, k)
        got = {}
        for on in (False, True):
            with _fill_mode(mode), _chunk_order(on):
                other = make()
                other.set_state(st)
                sh = _shuffle_of(other)
                assert sh.restores == 1, (chain, mode, on)
                assert sh._fill_order == ("chunk" if on else "position")
                st2 = json.loads(json.dumps(other.get_state()))
                got[on] = (sh._memory_stats()["inline_records"], _items(other))
                other.close()
            for key in ("slots", "source_position", "count", "emitted"):
                assert st2["buffer"][key] == st["buffer"][key], (chain, mode, on, k, key)
            assert got[on][1] == ref[k:], (chain, mode, on, k)
        assert got[False] == got[True]


def test_a_position_in_two_slots_is_refused_alike_in_either_order(fixed):
    make = lambda: _CHAINS["shuffle"](fixed)
    st = _state_at(make, 20_000)
    buf = st["buffer"]
    src, cnt = buf["source_position"], buf["count"]
    pos = _shuffle._unpack_positions(buf["slots"], src, cnt, "t")
    # two slots no step after the anchor refills (the step-back keeps them)
    pos[-1] = pos[-2]
    buf["slots"] = _shuffle._pack_positions(pos, src)
    msgs = {}
    for on in (False, True):
        with _chunk_order(on):
            other = make()
            with pytest.raises(ValueError, match="is in slots") as e:
                other.set_state(json.loads(json.dumps(st)))
                _items(other)
            other.close()
            msgs[on] = str(e.value)
    assert msgs[False] == msgs[True]


def test_the_pooled_fill_loads_each_chunk_of_its_pieces_once(fixed):
    make = lambda: _CHAINS["shuffle"](fixed)
    r = rl.RecordIOReader(fixed)
    _, nrec = r.chunk_table()
    r.close()
    starts = np.concatenate([[0], np.cumsum(nrec)])
    n = int(starts[-1])
    for k in (n // 10, n // 2):
        st = _state_at(make, k)
        for on in (False, True):
            with _fill_mode("emulated"), _chunk_order(on):
                other = make()
                other.set_state(st)
                sh = _shuffle_of(other)
                bounds = np.asarray(sh._par_bounds)
                loads = sh._par_loads
                other.close()
            buf = st["buffer"]
            pos = _shuffle._unpack_positions(buf["slots"], buf["source_position"], buf["count"], "t")
            keys = _shuffle._chunk_order_py(pos, starts) if on else _shuffle._file_order_py(pos)
            chunk = np.searchsorted(starts, (keys >> 32).astype(np.int64) + pos.min(), side="right") - 1
            pieces = [set(chunk[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]
            # no chunk in two pieces, and each piece's chunks loaded once
            assert sum(len(p) for p in pieces) == len(set().union(*pieces)), (on, k)
            assert loads == sum(len(p) for p in pieces), (on, k, loads)
