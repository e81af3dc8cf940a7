"""A prefetcher reads on past an error as the chain below it does.

The chain without a prefetcher raises a data error once, in its place, and
the next read goes on (RecordIO and TFRecord readers, open_files,
global_shuffle; tf.data's readers and its prefetch the same way); a map
function's exception is raised and its item dropped, and the next read goes
on (tf.data the same, through its prefetch too).  A prefetcher's run used to
end at the first error and raise it again on every later read until
reset(): a loop reading on past data errors never ended, and an epoch
through `.prefetch()` lost everything after the first bad chunk.  Now the
next read after the error resumes the run, so the prefetched chain gives
exactly the events of the chain without it.
"""
import numpy as np
import pytest

import readerlib as rl
from helpers import corrupt_chunk, read_events

N = 600


def _file(tmp_path, bad=(3, 9)):
    path = str(tmp_path / "f.rio")
    schema = rl.Schema([rl.Field("x", "int64")])
    with rl.RecordIOWriter(path, schema, chunk_size=512) as w:
        for i in range(0, N, 50):
            w.write_batch({"x": np.arange(i, i + 50, dtype=np.int64)})
    lost = set()
    for c in bad:
        lost |= corrupt_chunk(path, chunk=c, at=40)[1]
    return path, lost


def _ids(item):
    x = np.asarray(item[0] if isinstance(item, tuple) else item["x"] if isinstance(item, dict) else item)
    return tuple(int(v) for v in x.reshape(-1))


CHAINS = {
    "records": lambda p: rl.RecordIOReader(p),
    "batch": lambda p: rl.RecordIOReader(p).batch(7),
    "shuffle batch": lambda p: rl.RecordIOReader(p).shuffle(64, seed=3).batch(5),
    "global_shuffle": lambda p: rl.RecordIOReader(p).global_shuffle(seed=1, window_chunks=4),
    "open_files": lambda p: rl.open_files([p, p]),
}


@pytest.mark.parametrize("capacity", [1, 4, 64])
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_a_prefetched_chain_reads_on_past_data_errors_as_the_chain_does(tmp_path, name, capacity):
    path, lost = _file(tmp_path)
    make = CHAINS[name]
    bare = make(path)
    r = make(path).prefetch(capacity)
    for epoch in range(2):
        want, _, want_err = read_events(bare, _ids, save=False)
        assert want_err, "the file's damage raised nothing"
        got, _, errs = read_events(r, _ids, save=False)
        assert got == want, (epoch, len(got), len(want))
        assert [str(e) for e in errs] == [str(e) for e in want_err]
        seen = [v for ev in got if ev != "err" for v in ev]
        assert len(seen) == len(set(seen)) or name == "open_files"     # (the file twice there)
        if name != "open_files":
            assert set(seen) == set(range(N)) - lost
        r.reset()
        bare.reset()
    r.close()
    bare.close()


def _failing_map_chain(n, prefetch):
    """ArrayReader(0..n-1).map(f), f raising ValueError once, at item 37
    (each chain its own f); under prefetch(prefetch) when given."""
    failed = []

    def f(x):
        if int(np.asarray(x[0] if isinstance(x, tuple) else x)) == 37 and not failed:
            failed.append(1)
            raise ValueError("transient failure at 37")
        return x
    r = rl.ArrayReader(np.arange(n, dtype=np.int64)).map(f)
    return r.prefetch(prefetch) if prefetch else r


def _read_on_values(r, states=None, limit=1000):
    """The rest of the epoch, reading on past ValueErrors (their text in their
    place); get_state() through JSON before every read into `states`."""
    import json
    out = []
    for _ in range(limit):
        if states is not None:
            states.append(json.loads(json.dumps(r.get_state())))
        try:
            item = r.read_next()
        except ValueError as e:
            out.append(str(e))
            continue
        if item is None:
            return out
        out.append(_ids(item))
    raise AssertionError("the epoch never ended")


def test_a_map_function_that_fails_once_gives_what_the_chain_without_a_prefetcher_gives(tmp_path):
    # the chain's own rule (reliability.md: the function's exception is the
    # item's outcome, raised, the item dropped): the next read goes on
    want = _read_on_values(_failing_map_chain(100, 0))
    assert "transient failure at 37" in want
    assert _read_on_values(_failing_map_chain(100, 8)) == want


def test_an_error_raised_again_without_moving_on_is_raised_on_each_read_as_without_a_prefetcher():
    # a source stuck on an error raises it on every read, with or without a
    # prefetcher (each read resumes the run, which meets it again)
    class Stuck:
        def __init__(self):
            self.i = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.i += 1
            if self.i > 5:
                raise rl.DataLossError("stuck at byte offset 7", "x", 7)
            return np.int64(self.i)
    for prefetch in (False, True):
        r = rl.PythonReader(Stuck, rl.Schema([rl.Field("x", "int64")])) if hasattr(rl, "PythonReader") else None
        if r is None:
            pytest.skip("no PythonReader")
        if prefetch:
            r = r.prefetch(4)
        got = []
        for _ in range(9):
            try:
                item = r.read_next()
                got.append(_ids(item) if item is not None else None)
            except rl.DataLossError:
                got.append("err")
        assert got[:5] == [(i,) for i in range(1, 6)], got
        assert got[5:] == ["err"] * 4, (prefetch, got)
        r.close()


def test_states_around_a_failed_map_item_restore_as_without_a_prefetcher():
    # get_state before every read, the failure and the read after it
    # included: a fresh prefetched chain restored from each gives what a
    # fresh chain without the prefetcher restored from the same state gives.
    # (Not the original's tail after the failure: a state saved after a map
    # function's exception restores to before the dropped item, whose call is
    # made again -- the chain's own rule, with or without a prefetcher.)
    events = {}
    for prefetch in (0, 4):
        states = []
        r = _failing_map_chain(60, prefetch)
        events[prefetch] = (_read_on_values(r, states), states)
        r.close()
    assert events[4][0] == events[0][0]
    assert events[4][0].count("transient failure at 37") == 1 and len(events[4][0]) == 60   # (37 dropped)
    assert [st["position"] for st in events[4][1]] == [st["position"] for st in events[0][1]]
    for k in range(len(events[4][1])):
        got = {}
        for prefetch in (0, 4):
            o = _failing_map_chain(60, prefetch)
            o.set_state(events[prefetch][1][k])
            got[prefetch] = _read_on_values(o)
            o.close()
        assert got[4] == got[0], (k, got[4][:3], got[0][:3])
        if k <= 37:
            assert got[4] == events[4][0][k:], k
