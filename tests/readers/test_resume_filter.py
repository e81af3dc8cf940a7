"""set_state through a filter without calling the predicate again (issue 16 item 3).

A filter's state records how many items it took from the reader below for
each of its last outputs (as far back as the readers above it may have read
ahead); set_state skips that many below with `c_skip`.  Exactness: the shared
`assert_checkpoint_equal` (every position of two epochs) and hypothesis
(random chains and positions); "does not replay": the predicate's calls
during set_state, the filter's `restores` hook, and a predicate changed
between the save and the restore (a replay would keep other items).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

import readerlib as rl
from readerlib.readers._map import FilterReader
from helpers import SUPPORT_DIR, assert_checkpoint_equal, assert_resumes_past_errors, corrupt_chunk, run_ok_script

from test_resume_bounded import _flat, _rest_items as _items, _state_at

I64 = rl.Schema([rl.Field("x", "int64")])


def _src(n=600):
    return rl.ArrayReader(np.arange(n, dtype=np.int64))


class Pred:
    """Keeps x with x % mod not in `drop`; counts its calls."""

    def __init__(self, mod=3, drop=(0,)):
        self.mod, self.drop, self.calls = mod, tuple(drop), 0

    def __call__(self, x):
        self.calls += 1
        return int(np.asarray(getattr(x[0], "data", x[0])).reshape(-1)[0]) % self.mod not in self.drop


def _double(x):
    return (x[0] * 2,)


def _filter_of(chain):
    return next(r for r in chain._walk() if isinstance(r, FilterReader))


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


# chains without background threads (the predicate runs only when read)
CHAINS = {
    "filter": lambda p: _src().filter(p),
    "filter_batch": lambda p: _src().filter(p).batch(7),
    "filter_under_shuffle": lambda p: _src().filter(p).shuffle(50, seed=3),
    "shuffle_under_filter": lambda p: _src().shuffle(50, seed=3).filter(p).batch(4),
    "filter_map_threads_batch": lambda p: _src().filter(p).map(
        _double, num_threads=2, output_schema=I64).batch(5),
    "two_filters": lambda p: _src().filter(p).map(_double, output_schema=I64).filter(Pred(5, (1,))),
    "filter_of_batches": lambda p: _src().batch(5).filter(p),
    "filter_multi_pass": lambda p: _src(100).filter(p).multi_pass(2).batch(3),
    "multi_pass_filter": lambda p: _src(100).multi_pass(2).filter(p).take(100),
    "filter_repeat_skip": lambda p: _src(100).filter(p).repeat(2).skip(5),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_filter_chains_resume_exactly_everywhere(name):
    assert_checkpoint_equal(lambda: CHAINS[name](Pred()))


# the predicate is called again only where the position must be replayed:
# none of these (a buffer shuffle right above a filter over a source with
# random access restores by position: tests/readers/test_resume_filter_shuffle.py)
REPLAYS = set()


@pytest.mark.parametrize("name", sorted(set(CHAINS) - REPLAYS))
def test_restore_through_a_filter_does_not_call_the_predicate(name):
    # the old code replayed: the predicate ran once per item below up to the position
    make = CHAINS[name]
    ref = _items(make(Pred()))
    for k in (1, len(ref) // 2, len(ref) - 1, len(ref)):
        state = _state_at(lambda: make(Pred()), k)
        p = Pred()
        other = make(p)
        before = p.calls
        other.set_state(state)
        assert p.calls - before == 0, f"{name}: set_state at {k} called the predicate {p.calls - before} times"
        if "multi_pass" not in name and "repeat" not in name:
            assert _filter_of(other).restores == 1
        assert _same(_items(other), ref[k:])


def test_filter_and_map_under_a_shuffle_replay_exactly():
    # a map between the shuffle and the filter: the shuffle's source has no
    # random access and is not filters over one: it replays, and the filter
    # below it is read, not skipped
    make = lambda p: _src().filter(p).map(_double, output_schema=I64).shuffle(50, seed=3)
    ref = _items(make(Pred()))
    state = _state_at(lambda: make(Pred()), 200)
    p = Pred()
    other = make(p)
    other.set_state(state)
    assert p.calls >= 200 and _filter_of(other).restores == 0
    assert _same(_items(other), ref[200:])


def test_a_changed_predicate_keeps_the_saved_position():
    # A replay calls the predicate again: one that decides otherwise now (random,
    # stateful, or changed) would put the chain elsewhere.  The saved counts put
    # it where the saved chain was: the rest is the items after the last one read.
    mode = [3]

    def keep(x):
        return int(x[0]) % mode[0] != 0

    make = lambda: _src(3000).filter(keep)
    c = make()
    got = [int(c.read_next()[0]) for _ in range(500)]
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    mode[0] = 2                          # a replay would keep only odd items, reaching 999
    other = make()
    other.set_state(state)
    rest = [int(x[0]) for x in other]
    assert rest[0] == got[-1] + 1 + (1 if (got[-1] + 1) % 2 == 0 else 0)
    assert rest == [i for i in range(got[-1] + 1, 3000) if i % 2 != 0]


def test_a_random_predicate_resumes_at_the_saved_source_position():
    rng = np.random.default_rng(0)
    make = lambda: _src(4000).filter(lambda x: bool(rng.random() < 0.5))
    c = make()
    got = [int(c.read_next()[0]) for _ in range(800)]
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    other = make()
    other.set_state(state)
    rest = [int(x[0]) for x in other]
    assert rest and min(rest) > got[-1] and len(set(got) | set(rest)) == len(got) + len(rest)


def test_restore_from_recordio_reads_no_chunk_before_the_position(tmp_path):
    # a corrupt chunk before the position: a replay reads it (and raises); the
    # filter's c_skip positions the file by its index
    path = str(tmp_path / "f.rio")
    n = 20000
    with rl.RecordIOWriter(path, I64, chunk_size=4096) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    make = lambda p: rl.RecordIOReader(p).filter(Pred(4, (1, 2))).batch(16)
    ref = _items(make(path))
    k = len(ref) * 3 // 4
    c = make(path)
    for _ in range(k):
        c.read_next()
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    os.mkdir(tmp_path / "bad")
    bad = str(tmp_path / "bad" / "f.rio")
    shutil.copy(path, bad)
    corrupt_chunk(bad, chunk=1, at=60)  # chunk 1: records ~500-1000, long before the position
    with pytest.raises(rl.RecordIOError):
        _items(make(bad))                # the corruption is there
    other = make(bad)
    other.set_state(state)
    assert _same(_items(other), ref[k:])


def test_predicate_errors_resume_exactly():
    def keep(x):
        v = int(x[0])
        if v in (10, 11, 40):
            raise KeyError(v)
        return v % 3 != 0

    assert_resumes_past_errors(lambda: _src(100).filter(keep))


def test_old_states_and_damaged_counts():
    make = lambda p: _src().filter(p).batch(5)
    state = _state_at(lambda: make(Pred()), 30)
    ref = _items(make(Pred()))
    f = state["parent"]
    assert f["type"] == "FilterReader" and f["filter"]["n"] >= 1
    # a state without the counts (an older one) replays, exactly
    old = json.loads(json.dumps(state))
    del old["parent"]["filter"]
    p = Pred()
    other = make(p)
    other.set_state(old)
    assert p.calls > 0 and _filter_of(other).restores == 0
    assert _same(_items(other), ref[30:])
    for key, value, what in (("counts", "!!", "do not decode"), ("n", 5, "bytes of input counts"),
                             ("first", -1, "first output"), ("count0", "x", "ValueError")):
        bad = json.loads(json.dumps(state))
        bad["parent"]["filter"][key] = value
        with pytest.raises(ValueError, match=what):
            make(Pred()).set_state(bad)
    bad = json.loads(json.dumps(state))
    bad["parent"]["filter"] = [1, 2]
    with pytest.raises(ValueError, match="must be a dict"):
        make(Pred()).set_state(bad)


def test_a_state_needing_more_items_than_the_source_has_says_so():
    state = _state_at(lambda: _src(600).filter(Pred()), 300)
    f = state["filter"]
    assert f["n"] == 1 and f["count0"] == f["end"] == 450
    f["count0"] += 1000                   # as if the source had been longer
    f["end"] += 1000
    with pytest.raises(ValueError, match="filter's saved position needs 1450 items from the reader "
                                         "below it, which has 600"):
        _src(600).filter(Pred()).set_state(state)


KINDS = ["plain", "batch", "shuffle_below", "map_threads", "shuffle_below_map_threads", "take"]


def _make(kind, n, mod, drop, bs):
    def make(p):
        c = _src(n)
        if kind.startswith("shuffle_below"):
            c = c.shuffle(17, seed=mod)
        c = c.filter(p)
        if kind.endswith("map_threads"):
            c = c.map(_double, num_threads=2, output_schema=I64)
        if kind == "take":
            c = c.take(n // 3)
        if kind != "plain":
            c = c.batch(bs)
        return c
    return make


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), n=st.integers(0, 3000), mod=st.integers(1, 7),
       drop=st.sets(st.integers(0, 6), max_size=3), bs=st.integers(1, 40),
       where=st.floats(0, 1), epoch2=st.booleans())
def test_filter_resume_at_random_positions(kind, n, mod, drop, bs, where, epoch2):
    make = _make(kind, n, mod, drop, bs)
    ref0 = make(Pred(mod, drop))
    ref = _items(ref0)
    if epoch2:                            # the second epoch (a new shuffle order)
        ref0.reset()
        ref = _items(ref0)
    k = int(where * len(ref))
    c = make(Pred(mod, drop))
    if epoch2:
        _items(c)
        c.reset()
    for _ in range(k):
        c.read_next()
    state = json.loads(json.dumps(c.get_state()))
    c.close()
    p = Pred(mod, drop)
    other = make(p)
    other.set_state(state)
    assert p.calls == 0
    rest = _items(other)
    assert _same(rest, ref[k:]), (kind, n, k)
    # exactly once: what came before the position and what came after it
    got = np.concatenate(ref[:k] + rest) if ref else np.zeros(0, np.int64)
    want = np.concatenate(ref) if ref else np.zeros(0, np.int64)
    assert np.array_equal(np.sort(got), np.sort(want))


_PREFETCH_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import readerlib as rl
    sys.path.insert(0, {support!r})
    from helpers import assert_checkpoint_equal
    from readerlib.readers._map import FilterReader
    I64 = rl.Schema([rl.Field("x", "int64")])
    src = lambda n: rl.ArrayReader(np.arange(n, dtype=np.int64))
    class Pred:
        def __init__(self):
            self.calls = 0
        def __call__(self, x):
            self.calls += 1
            return int(x[0]) % 3 != 0
    dbl = lambda x: (x[0] * 2,)
    chains = [
        lambda p: src(900).filter(p).map(dbl, output_schema=I64).prefetch(3).batch(7),
        lambda p: src(900).filter(p).map(dbl, num_threads=2, output_schema=I64).batch(5).prefetch(2),
        lambda p: src(900).shuffle(40, seed=2).filter(p).batch(6).prefetch(4),
    ]
    for make in chains:
        assert_checkpoint_equal(lambda: make(Pred()))
        ref = [x for x in make(Pred())]
        flat = lambda items: [np.asarray(v.data if hasattr(v, "data") else v).tolist() for it in items for v in it]
        for k in (1, len(ref) // 2, len(ref) - 1):
            c = make(Pred())
            it = iter(c)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(c.get_state()))
            c.close()
            p = Pred()
            other = make(p)
            time.sleep(0.2)                  # the prefetcher's read-ahead at construction
            before = p.calls
            other.set_state(state)
            f = next(r for r in other._walk() if isinstance(r, FilterReader))
            assert f.restores == 1, (k, f.restores)
            assert p.calls - before <= 0, (k, p.calls - before)
            assert flat(list(other)) == flat(ref[k:]), k
            other.close()
    print("OK")
""")


def test_filter_with_prefetch_resumes_exactly_in_a_subprocess():
    run_ok_script(_PREFETCH_SCRIPT.format(support=SUPPORT_DIR))


@pytest.mark.parametrize("key", ["count0", "end", "ended", "first", "epoch"])
@pytest.mark.parametrize("value", [2 ** 63, 2 ** 64, -2 ** 64])
def test_saved_counts_past_int64_are_a_value_error(key, value):
    # the old code let these through to int64-typed code: OverflowError, not
    # the ValueError every other damaged count gives
    state = _state_at(lambda: _src(600).filter(Pred()), 300)
    state["filter"][key] = value
    if key == "first":
        state["filter"]["count0"] = value
    with pytest.raises(ValueError, match="filter's saved counts are inconsistent"):
        other = _src(600).filter(Pred())
        other.set_state(state)
        _items(other)


def test_a_saved_pass_past_int64_is_a_value_error():
    state = _state_at(lambda: _src(100).filter(Pred()).multi_pass(2), 90)
    f = state["parent"]["filter"]
    assert f["passes"], f
    f["passes"][0][2] = 2 ** 64
    with pytest.raises(ValueError, match="filter's saved counts are inconsistent"):
        other = _src(100).filter(Pred()).multi_pass(2)
        other.set_state(state)
        _items(other)


@pytest.mark.parametrize("where, value", [("epoch", None), ("epoch", [1]), ("epoch", 2 ** 64),
                                          ("passes", None), ("passes", 5), ("passes", "x")])
def test_a_damaged_epoch_or_passes_is_a_value_error(where, value):
    # the old code raised TypeError / OverflowError for these
    state = _state_at(lambda: _src(100).filter(Pred()).multi_pass(2), 90)
    if where == "epoch":
        state["parent"]["epoch"] = value
    else:
        state["parent"]["filter"]["passes"] = value
    with pytest.raises(ValueError, match="set_state: the filter's saved"):
        other = _src(100).filter(Pred()).multi_pass(2)
        other.set_state(state)
        _items(other)
