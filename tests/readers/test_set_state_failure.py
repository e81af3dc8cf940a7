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


# -- a window shuffle's saved epoch refused before anything changes ---------------

def _window_chain(batched):
    r = rl.ArrayReader(np.arange(300, dtype=np.int64)).shuffle(16, mode="window")   # a drawn seed
    return r.batch(4) if batched else r


def _window_ids(reader, n=None):
    out = []
    while n is None or len(out) < n:
        item = reader.read_next()
        if item is None:
            break
        t = item[0]
        out.extend(int(v) for v in np.asarray(t.data if isinstance(t, rl.LoDTensor) else t).reshape(-1))
    return out


def _window_entry(state):
    d = state
    while d.get("type") != "WindowShuffleReader":
        d = d["parent"]
    return d


_BAD_WINDOW_EPOCHS = [
    ("order", "bogus", "unknown window shuffle order 'bogus'"),
    ("order", "Fisher-Yates", "unknown window shuffle order"),
    ("order", list(range(16)), "unknown window shuffle order \\[0, 1, 2"),      # a table, not a name
    ("order", None, "unknown window shuffle order None"),
    ("order", 3, "unknown window shuffle order 3"),
    ("seed", -1, "'seed' must be an int in \\[0, 2\\*\\*64\\), got -1"),
    ("seed", 1 << 64, "'seed' must be an int"),
    ("seed", "7", "'seed' must be an int in \\[0, 2\\*\\*64\\), got '7'"),
    ("seed", True, "'seed' must be an int"),
    ("seed", None, "'seed' must be an int"),
    ("epoch", -1, "'epoch' must be an int in \\[0, 2\\*\\*63\\), got -1"),
    ("epoch", 1 << 63, "'epoch' must be an int"),
    ("epoch", 0.0, "'epoch' must be an int"),
    ("epoch", "0", "'epoch' must be an int"),
]


@pytest.mark.parametrize("batched", [False, True], ids=["window", "batch-over-window"])
@pytest.mark.parametrize("key,value,message", _BAD_WINDOW_EPOCHS,
                         ids=[f"{k}={v!r:.12}" for k, v, _ in _BAD_WINDOW_EPOCHS])
def test_a_window_shuffle_state_with_a_bad_epoch_is_refused_before_the_chain_moves(batched, key, value,
                                                                                   message):
    # tf.data / Grain / StatefulDataLoader: a state that cannot be restored
    # raises naming what is wrong and leaves the iterator as it was; before,
    # the window shuffle refused its saved epoch after the chain was reset
    # (reads then raised "the last set_state() failed part-way")
    import json
    r = _window_chain(batched)
    head = _window_ids(r, 40)
    a = json.loads(json.dumps(r.get_state()))
    assert a["version"] == 3 and _window_entry(a)["order"] == "fisher-yates"
    mid = _window_ids(r, 24)                             # past A, into the next windows
    ref = _window_chain(batched)
    ref.set_state(a)
    want = _window_ids(ref)                              # the rest of the epoch from A
    assert want[:len(mid)] == mid and len(head) + len(want) == 300
    bad = json.loads(json.dumps(a))
    _window_entry(bad)[key] = value
    with pytest.raises(ValueError, match=message) as err:
        r.set_state(bad)
    assert "WindowShuffleReader" in str(err.value)
    assert _window_ids(r) == want[len(mid):]             # read on from where it was: untouched
    r.set_state(a)                                       # A still restores
    assert _window_ids(r) == want
    r.close()
    ref.close()


def test_a_window_shuffle_state_without_its_seed_is_refused_naming_the_key():
    r = _window_chain(False)
    first = _window_ids(r, 5)
    bad = r.get_state()
    del bad["seed"]
    with pytest.raises(ValueError, match="WindowShuffleReader.*the state has no 'seed'"):
        r.set_state(bad)
    assert len(first) == 5 and len(_window_ids(r)) == 295
    r.close()


def _shuffle_chain(kind):
    src = rl.ArrayReader(np.arange(300, dtype=np.int64))
    return src.global_shuffle() if kind == "global" else src.shuffle(32)      # drawn seeds


_BAD_SHUFFLE_EPOCHS = [(kind, key, value) for kind in ("buffer", "global")
                       for key, value in [("seed", "7"), ("seed", -1), ("epoch", 2.5), ("epoch", 1 << 63)]] + \
    [("buffer", "buffer", [1, 2]), ("buffer", "buffer", {"rng": [0, 0, 0, 0]})]   # (a global shuffle saves none)


@pytest.mark.parametrize("kind,key,value", _BAD_SHUFFLE_EPOCHS)
def test_a_shuffle_state_with_a_bad_epoch_is_refused_before_the_chain_moves(kind, key, value):
    # as the window shuffle's: the buffer and global shuffles' saved seed,
    # epoch and buffer were converted / checked after the chain was reset
    r = _shuffle_chain(kind)
    _window_ids(r, 50)
    a = r.get_state()
    want = _window_ids(r, 30)
    bad = dict(a, **{key: value})
    with pytest.raises(ValueError, match=f"reader 0 from the top \\({type(r).__name__}\\)") as err:
        r.set_state(bad)
    assert "buffer" in str(err.value) if key == "buffer" else repr(key) in str(err.value)
    rest = _window_ids(r)                               # reads on where it was
    r.set_state(a)
    assert _window_ids(r) == want + rest
    r.close()
