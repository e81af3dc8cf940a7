"""A chunk that fails its checks, and the states saved after it.

A RecordIO chunk that fails a check (here its body CRC) is raised once
(on_error="raise") or skipped with a RecordIOWarning (on_error="skip"); either
way reading on gives every record of the epoch but the chunk's.  What a state saved after that restores to, per chain:

* raise mode: the position counts delivered items, and set_state positions
  by the chunk table (c_skip steps whole chunks by their index counts): the
  lost records shifted it, so a restore read the bad chunk again (set_state
  raised the checksum error while the original read on) or, past it, came
  out other records than the original.  Now get_state refuses (RuntimeError
  naming the file, chunk and offset: ReaderBase._dropped) until the next
  epoch; a state saved before the error restores exactly, the error
  included.
* skip mode: a RecordIO reader in skip mode positions by reading (its c_skip
  reads), so a restore skips the same chunk and counts the same: exact, and
  these tests keep it so.
"""
import json
import warnings

import numpy as np
import pytest

import readerlib as rl

from helpers import corrupt_chunk

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
    """The rest of the epoch read with read_next, going on past DataLossErrors:
    (events, states, errors).  events[k]: what read k gave (a tuple of record
    numbers, or "err"); states[k]: get_state() before read k (through JSON),
    or the RuntimeError it raised."""
    events, states, errors = [], [], []
    while True:
        if save:
            try:
                states.append(json.loads(json.dumps(chain.get_state())))
            except RuntimeError as e:
                states.append(e)
        try:
            item = chain.read_next()
        except rl.DataLossError as e:
            events.append("err")
            errors.append(e)
            if len(errors) > LIMIT:
                return events, states, errors
            continue
        if item is None:
            return events, states, errors
        events.append(_ids(item))


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
