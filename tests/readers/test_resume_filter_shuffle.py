"""A buffer shuffle above filters restores without replaying the epoch (issue 16 item 3).

`src.filter(keep).shuffle(b)` over a source with random access: the shuffle
keeps each buffered record's position in the source below the filters (the
lowest filter's input count when it took the record), and set_state reads
the buffer there by index while the filters are positioned by their own
saved counts.  The old code replayed the epoch, calling the predicate for
every item before the position.  Exactness: the shared
`assert_checkpoint_equal` (every position of two epochs) and hypothesis
(positions, seeds, predicates, buffer and batch sizes, passes, epochs, a
second save right after a restore); "does not replay": the predicate's calls
during set_state (0), the shuffle's `restores` hook and a corrupt chunk
before the position that a replay would read.  A map below the filters
(or a map alone) is read through (fn called once per buffered record).
Chains that still replay (a map between the shuffle and a filter, a filter
over a source without random access) and states made before this change
restore exactly by replay.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import readerlib as rl
from readerlib.readers._map import FilterReader, _callable_name
from readerlib.readers._shuffle import ShuffleReader
from helpers import assert_checkpoint_equal, assert_resumes_past_errors, corrupt_chunk

from test_resume_bounded import _rest_items, _state_at

I64 = rl.Schema([rl.Field("x", "int64")])


class Pred:
    """Keeps x with x % mod not in `drop`; counts its calls (all instances)."""

    calls = 0

    def __init__(self, mod=3, drop=(0,)):
        self.mod, self.drop = mod, tuple(drop)

    def __call__(self, x):
        Pred.calls += 1
        return int(x[0]) % self.mod not in self.drop


def keep3(x):
    Pred.calls += 1
    return int(x[0]) % 3 != 0


def _double(x):
    return (x[0] * 2,)


def _arr(n):
    return rl.ArrayReader(np.arange(n, dtype=np.int64))


def _shuffle_of(chain):
    return next(r for r in chain._walk() if isinstance(r, ShuffleReader))


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def rio(tmp_path_factory):
    d = tmp_path_factory.mktemp("filtshuf")
    paths = {}
    for n in (1, 37, 600, 1500):
        p = str(d / f"r{n}.rio")
        with rl.RecordIOWriter(p, I64, chunk_size=1024) as w:      # ~128 records a chunk
            w.write_batch({"x": np.arange(n, dtype=np.int64)})
        paths[n] = p
    return paths


def _chains(rio):
    r = lambda: rl.RecordIOReader(rio[600])
    return {
        "memory": lambda: _arr(600).filter(Pred()).shuffle(50, seed=3).batch(4),
        "recordio": lambda: r().filter(Pred()).shuffle(50, seed=3).batch(4),
        "plain": lambda: _arr(600).filter(Pred(4, (1, 2))).shuffle(64, seed=7),
        "two_filters": lambda: r().filter(Pred()).filter(Pred(5, (1,))).shuffle(40, seed=1).batch(3),
        "big_buffer": lambda: _arr(600).filter(Pred()).shuffle(1000, seed=2).batch(7),
        "multi_pass": lambda: r().filter(Pred()).shuffle(30, seed=4).multi_pass(2).batch(5),
        "repeat_take": lambda: _arr(300).filter(Pred()).shuffle(30, seed=4).repeat(2).take(350),
        "shuffle_filter_shuffle": lambda: _arr(600).shuffle(20, seed=1).filter(Pred()).shuffle(30, seed=2),
        "filter_shuffle_filter": lambda: r().filter(Pred()).shuffle(30, seed=2).filter(Pred(5, (1,))).batch(4),
    }


NAMES = ["memory", "recordio", "plain", "two_filters", "big_buffer", "multi_pass", "repeat_take",
         "shuffle_filter_shuffle", "filter_shuffle_filter"]
# the shuffle whose source is a filter over a source *without* random access
# (another shuffle) replays: it is the lower one that restores by position
REPLAYS = {"shuffle_filter_shuffle"}


@pytest.mark.parametrize("name", NAMES)
def test_shuffle_above_filters_resumes_exactly_everywhere(rio, name):
    assert_checkpoint_equal(_chains(rio)[name])


@pytest.mark.parametrize("name", sorted(set(NAMES) - REPLAYS))
def test_restore_calls_no_predicate(rio, name):
    # the old code replayed: the predicate ran once per item below up to the position
    make = _chains(rio)[name]
    ref = _rest_items(make())
    for k in (1, len(ref) // 10, len(ref) // 2, len(ref) * 9 // 10, len(ref) - 1, len(ref)):
        state = _state_at(make, k)
        other = make()
        Pred.calls = 0
        other.set_state(state)
        assert Pred.calls == 0, f"{name}: set_state at {k} called the predicate {Pred.calls} times"
        sh = [r for r in other._walk() if isinstance(r, ShuffleReader)][-1]
        if 0 < k < len(ref):
            assert sh.restores == 1, (name, k)
        assert _same(_rest_items(other), ref[k:]), (name, k)


def test_a_shuffle_over_a_filter_over_a_shuffle_replays_exactly(rio):
    # the upper shuffle's source is a filter over a source without random access
    # (a buffer shuffle): it replays the epoch (the predicate called again)
    make = _chains(rio)["shuffle_filter_shuffle"]
    ref = _rest_items(make())
    state = _state_at(make, 200)
    assert state["buffer"] is None
    other = make()
    Pred.calls = 0
    other.set_state(state)
    assert Pred.calls >= 200 and other.restores == 0
    assert _same(_rest_items(other), ref[200:])


class Fn:
    """A map function (pure) that counts its calls (all instances)."""

    calls = 0

    def __call__(self, x):
        Fn.calls += 1
        return (x[0] * 2,)


# A map between the source and the filters (or the shuffle): the buffer is read
# through it (MapReader.c_read_at: fn of the source's record), so fn is called
# once per buffered record in set_state -- at most the buffer size, whatever
# the position -- and the predicate never.
MAPPED = {
    "map_below_filter": lambda rio: rl.RecordIOReader(rio[600]).map(Fn(), output_schema=I64).filter(Pred())
    .shuffle(30, seed=1).batch(3),
    "threaded_map_below_filter": lambda rio: _arr(600).map(Fn(), num_threads=2, output_schema=I64)
    .filter(Pred()).shuffle(30, seed=1).batch(3),
    "map_no_filter": lambda rio: _arr(600).map(Fn(), output_schema=I64).shuffle(30, seed=1).batch(3),
    "filter_map_filter": lambda rio: _arr(600).filter(Pred(5, (2,))).map(Fn(), output_schema=I64)
    .filter(Pred()).shuffle(30, seed=1),
}


@pytest.mark.parametrize("name", sorted(MAPPED))
def test_a_map_below_the_filters_restores_by_position(rio, name):
    make = lambda: MAPPED[name](rio)
    ref = _rest_items(make())
    for k in (1, len(ref) // 2, len(ref) * 9 // 10):
        state = _state_at(make, k)
        other = make()
        Pred.calls = Fn.calls = 0
        other.set_state(state)
        if name == "filter_map_filter":       # a filter below the map: not random access
            assert Pred.calls > 0 and _shuffle_of(other).restores == 0
        else:
            assert Pred.calls == 0 and _shuffle_of(other).restores == 1, (name, k)
            assert Fn.calls <= 30, (name, k, Fn.calls)     # the buffer's records, no more
        assert _same(_rest_items(other), ref[k:]), (name, k)
    assert_checkpoint_equal(make, epochs=2)


# a map between the shuffle and the filter: the filter's output is not the
# record at a position of a source, so these replay (correct, the predicate and
# the function called again)
FALLBACK = {
    "map_between": lambda: _arr(400).filter(Pred()).map(_double, output_schema=I64).shuffle(30, seed=1).batch(3),
    "no_random_access": lambda: rl.PythonReader(lambda: iter([(np.int64(i),) for i in range(400)]), I64)
    .filter(Pred()).shuffle(30, seed=1).batch(3),
}


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_chains_that_still_replay_do_so_exactly(name):
    make = FALLBACK[name]
    assert_checkpoint_equal(make, epochs=1)
    ref = _rest_items(make())
    state = _state_at(make, 50)
    assert state["parent"]["buffer"] is None
    other = make()
    Pred.calls = 0
    other.set_state(state)
    assert Pred.calls >= 50 * 3 and _shuffle_of(other).restores == 0
    assert _same(_rest_items(other), ref[50:])


def test_restore_from_recordio_reads_no_chunk_before_the_buffer(tmp_path):
    # a corrupt chunk long before the buffer's oldest record: a replay reads it
    # (and raises); the restore reads the buffer by index and positions the
    # filter by its counts, stepping over the chunk without reading it
    path = str(tmp_path / "f.rio")
    n = 20000
    with rl.RecordIOWriter(path, I64, chunk_size=4096) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    make = lambda p: rl.RecordIOReader(p).filter(Pred(4, (1, 2))).shuffle(100, seed=5).batch(16)
    ref = _rest_items(make(path))
    k = len(ref) * 3 // 4
    state = _state_at(lambda: make(path), k)
    os.mkdir(tmp_path / "bad")
    bad = str(tmp_path / "bad" / "f.rio")
    shutil.copy(path, bad)
    corrupt_chunk(bad, chunk=1, at=60)  # chunk 1: records ~500-1000
    with pytest.raises(rl.RecordIOError):
        _rest_items(make(bad))           # the corruption is there
    other = make(bad)
    other.set_state(state)
    assert _same(_rest_items(other), ref[k:])


def test_predicate_errors_resume_exactly_without_replay():
    # an error raised by the predicate leaves the filter's counts exact (the item
    # is counted as read and dropped), so the shuffle keeps its positions; the old
    # code replayed, and the replay raised the error again inside set_state
    def keep(x):
        v = int(x[0])
        if v == 40:
            raise KeyError(v)
        return v % 3 != 0

    def restored_by_position(k, other):
        assert k < 8 or other.restores == 1, k      # (before: the buffer is still filling)
    seen = assert_resumes_past_errors(lambda: _arr(300).filter(keep).shuffle(20, seed=1),
                                      check=restored_by_position)
    assert "err" in seen


# States made by the code before this change (a shuffle over a filter saved no
# buffer, "buffer": null): they restore by replay, exactly.  Made with
# ArrayReader(arange(400)).filter(keep3).shuffle(30, seed=5).batch(4), 20 batches in, and
# ArrayReader(arange(200)).filter(keep3).shuffle(30, seed=5).multi_pass(2).batch(4), 50 in.
_OLD_SCHEMA = "{\"fields\": [{\"dtype\": \"i8\", \"lod_level\": 0, \"name\": \"f0\", \"shape\": []}]}"
OLD_STATES = [
    (lambda: _arr(400).filter(keep3).shuffle(30, seed=5).batch(4), 20, {
        "version": 2, "position": 20, "type": "BatchReader", "batch_size": 4, "drop_last": False,
        "parent": {"type": "ShuffleReader", "buffer_size": 30, "seed": 5, "epoch": 0, "buffer": None,
                   "parent": {"type": "FilterReader", "predicate": "PRED", "epoch": 0,
                              "filter": {"epoch": 0, "first": 0, "n": 111, "count0": 0,
                                         "counts": "eAFjYoAARijNNMoHh8BoeEASwmh6gIQDtdIDACKHAKY=",
                                         "end": -1, "ended": -1, "passes": []},
                              "parent": {"type": "ArrayReader", "num_instances": 400,
                                         "schema": _OLD_SCHEMA}}}}),
    (lambda: _arr(200).filter(keep3).shuffle(30, seed=5).multi_pass(2).batch(4), 50, {
        "version": 2, "position": 50, "type": "BatchReader", "batch_size": 4, "drop_last": False,
        "parent": {"type": "MultiPassReader", "num_passes": 2,
                   "parent": {"type": "ShuffleReader", "buffer_size": 30, "seed": 5, "epoch": 0, "buffer": None,
                              "parent": {"type": "FilterReader", "predicate": "PRED", "epoch": 0,
                                         "filter": {"epoch": 1, "first": 0, "n": 98, "count0": 0,
                                                    "counts": "eAFjYoAARijNNMoHh8BoeEASwkhJDwDimACT",
                                                    "end": -1, "ended": -1, "passes": [[0, 133, 200]]},
                                         "parent": {"type": "ArrayReader", "num_instances": 200,
                                                    "schema": _OLD_SCHEMA}}}}}),
]


@pytest.mark.parametrize("which", [0, 1])
def test_states_made_before_this_change_restore_exactly_by_replay(which):
    make, k, state = OLD_STATES[which]
    state = json.loads(json.dumps(state).replace('"PRED"', json.dumps(_callable_name(keep3))))
    ref = _rest_items(make())
    other = make()
    Pred.calls = 0
    other.set_state(state)
    assert Pred.calls > 0 and _shuffle_of(other).restores == 0      # replayed
    assert _same(_rest_items(other), ref[k:])
    # and a state saved now from that chain restores without replay
    again = json.loads(json.dumps(other.get_state()))
    assert (again.get("parent") or {}).get("buffer") or again["parent"]["parent"]["buffer"]


def test_the_filter_saves_only_the_counts_the_shuffle_may_undo():
    # the shuffle tells the filter below it how far back it may rewind it (the
    # steps read ahead above it: a batch of 4 here), not the whole ring
    state = _state_at(lambda: _arr(3000).filter(Pred()).shuffle(100, seed=1).batch(4), 300)
    f = state["parent"]["parent"]["filter"]
    assert 1 <= f["n"] <= 5 + 1, f
    b = state["parent"]["buffer"]
    assert b["base_position"] >= b["source_position"]


# ------------------------------------------------------------ hypothesis
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(src=st.sampled_from(["memory", "recordio"]), n=st.sampled_from([1, 37, 600, 1500]),
       mod=st.integers(1, 7), drop=st.sets(st.integers(0, 6), max_size=3),
       drop2=st.one_of(st.none(), st.integers(0, 4)),
       buf=st.integers(1, 300), bs=st.integers(1, 40), seed=st.integers(0, 2 ** 32),
       passes=st.integers(1, 3), epoch2=st.booleans(), where=st.floats(0, 1),
       again=st.floats(0, 1), mapped=st.booleans())
def test_resume_at_random_positions(rio, src, n, mod, drop, drop2, buf, bs, seed, passes, epoch2,
                                    where, again, mapped):
    def make():
        c = _arr(n) if src == "memory" else rl.RecordIOReader(rio[n])
        if mapped:                        # read through by the restore (fn per buffered record)
            c = c.map(_double, output_schema=I64)
        c = c.filter(Pred(mod, drop))
        if drop2 is not None:
            c = c.filter(Pred(5, (drop2,)))
        c = c.shuffle(buf, seed=seed)
        if passes > 1:
            c = c.multi_pass(passes)
        return c.batch(bs)

    ref_chain = make()
    ref = _rest_items(ref_chain)
    if epoch2:                            # the second epoch (a new shuffle order)
        ref_chain.reset()
        ref = _rest_items(ref_chain)
    ref_chain.close()
    k = int(where * len(ref))
    c = make()
    if epoch2:
        _rest_items(c)
        c.reset()
    for _ in range(k):
        c.read_next()
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    other = make()
    Pred.calls = 0
    other.set_state(state)
    assert Pred.calls == 0
    # read on a little, save again (a state of a restored chain), restore that
    j = int(again * (len(ref) - k))
    got = [other.read_next() for _ in range(j)]
    got = [np.concatenate([np.asarray(v.data).reshape(-1) for v in x]) for x in got]
    state2 = json.loads(json.dumps(other.get_state()))
    rest = _rest_items(other)
    assert _same(got + rest, ref[k:]), (k, j)
    third = make()
    Pred.calls = 0
    third.set_state(state2)
    assert Pred.calls == 0
    assert _same(_rest_items(third), ref[k + j:])
    # exactly once: what came before the position and what came after it
    if passes == 1 and ref:
        assert np.array_equal(np.sort(np.concatenate(ref[:k] + got + rest)), np.sort(np.concatenate(ref)))


# ------------------------------------------------------------ damaged states
_DAMAGED_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import readerlib as rl
    src = lambda: rl.ArrayReader(np.arange(3000, dtype=np.int64))
    if sys.argv[2] == "mapped":
        src = lambda: rl.ArrayReader(np.arange(3000, dtype=np.int64)).map(lambda x: (x[0] + 1,),
                                                                           output_schema=rl.Schema([rl.Field("x", "int64")]))
    make = lambda: src().filter(lambda x: int(x[0]) % 3 != 0).shuffle(100, seed=1).batch(5)
    c = make()
    it = iter(c)
    for _ in range(50):
        next(it)
    state = json.loads(json.dumps(c.get_state()))
    buf = state["parent"]["buffer"]
    assert "base_position" in buf, buf
    for case in json.loads(sys.argv[1]):
        st = json.loads(json.dumps(state))
        where, key, value = case
        d = st["parent"]["buffer"] if where == "buffer" else st["parent"]["parent"]["filter"]
        if value == "DELETE":
            del d[key]
        elif value == "ADD":
            d[key] = d[key] + 7
        elif value == "TIMES":
            d[key] = d[key] * 50
        else:
            d[key] = value
        try:
            other = make()
            other.set_state(st)
            for _ in other:
                pass
        except ValueError as e:
            print("VALUEERROR", json.dumps(case), e)
        else:
            print("NO ERROR", json.dumps(case))
    print("DONE")
""")

DAMAGED = [
    ("buffer", "base_position", -1, "base_position"),
    ("buffer", "base_position", 2 ** 64, "base_position"),
    ("buffer", "base_position", "x", "base_position"),
    ("buffer", "base_position", 10 ** 6, "base_position"),       # past the source's end
    ("buffer", "base_position", 5, "base_position"),             # fewer than the records taken
    ("buffer", "base_position", "ADD", "base_position"),         # positions shifted past the filter
    ("buffer", "base_position", "DELETE", "base_position"),
    ("buffer", "slots", "p7:AAAA", "positions"),                 # wrong length
    ("buffer", "slots", "p40:AAAA", "positions"),
    ("buffer", "tail", "p7:", "positions"),
    ("buffer", "count", 99, "buffer"),
    ("buffer", "source_position", "ADD", "records taken"),
    ("filter", "count0", "TIMES", "filter"),
    ("filter", "n", 1000, "filter"),
]


@pytest.mark.parametrize("chain", ["plain", "mapped"])
def test_a_damaged_state_is_a_value_error_naming_the_field_in_a_subprocess(chain):
    # never a crash, a hang, an IndexError from the source or wrong data
    cases = [[w, k, v] for w, k, v, _ in DAMAGED]
    p = subprocess.run([sys.executable, "-c", _DAMAGED_SCRIPT, json.dumps(cases), chain],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "DONE" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("VALUEERROR", "NO ERROR"))]
    assert len(lines) == len(DAMAGED), p.stdout
    for (w, k, v, what), line in zip(DAMAGED, lines):
        assert line.startswith("VALUEERROR"), (w, k, v, line)
        assert what in line, (w, k, v, line)


def test_a_filtered_buffer_given_to_an_unfiltered_shuffle_is_a_value_error():
    # the shuffle's source is not a filter: a saved "base_position" cannot be its
    state = _state_at(lambda: _arr(3000).shuffle(100, seed=1).batch(5), 50)
    state["parent"]["buffer"]["base_position"] = 4000
    with pytest.raises(ValueError, match="base_position"):
        _arr(3000).shuffle(100, seed=1).batch(5).set_state(state)


def test_a_map_that_fails_while_the_buffer_is_read_through_raises_from_set_state():
    # fn is assumed pure; one that raises now for a buffered record (it did not
    # when the record was first read) raises from set_state, naming the record,
    # and the chain can be restored again once it works
    fail = [False]

    def fn(x):
        if fail[0] and int(x[0]) == 250:
            raise KeyError("no")
        return (x[0] * 2,)

    make = lambda: _arr(600).map(fn, output_schema=I64).shuffle(100, seed=3).batch(4)
    ref = _rest_items(make())
    k = 40                               # 160 handed out of the 260 taken
    state = _state_at(make, k)
    assert 500 not in np.concatenate(ref[:k])          # record 250 is still in the buffer
    fail[0] = True
    other = make()
    with pytest.raises(KeyError) as e:
        other.set_state(state)
    assert "record 250" in str(e.value.__notes__), e.value.__notes__
    fail[0] = False
    other.set_state(state)
    assert _shuffle_of(other).restores == 1
    assert _same(_rest_items(other), ref[k:])
