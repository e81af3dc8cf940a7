"""The held input of map (one thread and threaded), map_batches and filter.

An input whose processing an own failure interrupted (a KeyboardInterrupt /
SystemExit, or a MemoryError of the reader's own) is held and handed again
to the next read (readers/_map.pyx, the comment above `_NOT_CALLED`).  The
four readers share one implementation of it (`_HeldInput`); these tests pin
what the copies it replaced did differently:

* a failure *after* the function returned (while its output is checked,
  converted or encoded) keeps the output with the input: the retry does not
  call the function again on that item.  The threaded map kept its chunk's
  outputs; map with one thread, map_batches (read directly or inside a
  chain) and filter called the function a second time.
* the kept output goes with its input: a skip, reset or set_state drops
  both (the next input gets its own call).
* a filter positioned by saved counts for a later pass (a multi_pass above
  it) counts its held input among the inputs it skips below (it skipped one
  item too many below: "the reader below ... has fewer items").

Interrupts are raised by the test's own objects, once, at a chosen place:
`Late.__array__` (an output converted by np.asarray) and `LateBool.__bool__`
(a predicate's verdict).
"""
import numpy as np
import pytest

import readerlib as rl
from helpers import SUPPORT_DIR, run_ok_script

N = 24


def _src(n=N):
    return rl.ArrayReader(np.arange(n, dtype=np.int64))


I64 = _src().schema


def _first(v):
    return int(np.asarray(getattr(v, "data", v)).reshape(-1)[0])


def _key(item):
    return tuple(np.asarray(getattr(t, "data", t)).tobytes() for t in item)


def _rest(r):
    out = []
    while True:
        item = r.read_next()
        if item is None:
            return out
        out.append(_key(item))


class Arm:
    """Which input value's output raises, and what: set by each test."""
    at = None
    exc = KeyboardInterrupt

    @classmethod
    def fire(cls, v):
        if cls.at is not None and v == cls.at:
            cls.at = None
            raise cls.exc()


class Late:
    """An output value whose conversion (np.asarray) raises Arm.exc once, for
    the armed input: the function itself has returned."""

    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        Arm.fire(_first(self.a))
        return np.asarray(self.a, dtype=dtype)


class LateBool(int):
    """A predicate's verdict whose bool() raises Arm.exc once for the armed input."""

    def __bool__(self):
        Arm.fire(self.v)
        return int(self) != 0


class Fn:
    """Counts its calls per input value (the first value of the first field)."""

    def __init__(self, kind):
        self.kind, self.calls = kind, []

    def __call__(self, x):
        v = _first(x[0])
        self.calls.append(v)
        if self.kind == "map":
            return (Late(x[0]),)
        if self.kind == "map_batches":
            return (Late(x[0].data),)
        k = LateBool(v % 3 != 1)
        k.v = v
        return k


CHAINS = {
    "map": ("map", lambda f: _src().map(f, output_schema=I64)),
    "map_inner": ("map", lambda f: _src().map(f, output_schema=I64).batch(5)),
    "map_batches": ("map_batches", lambda f: _src().batch(3).map_batches(f, output_schema=I64)),
    "map_batches_inner": ("map_batches",
                          lambda f: _src().batch(3).map_batches(f, output_schema=I64).take(10 ** 6)),
    "filter": ("filter", lambda f: _src().filter(f)),
    "filter_batches": ("filter", lambda f: _src().batch(2).filter(f)),
}


def _interrupted_run(name, at, exc, after):
    """A chain whose conversion of input `at`'s output raises `exc` once; the
    items read before, and what `after(chain)` gives once it has."""
    kind, make = CHAINS[name]
    fn = Fn(kind)
    c = make(fn)
    Arm.at, Arm.exc = at, exc
    got = []
    try:
        while True:
            item = c.read_next()
            assert item is not None, "not interrupted"
            got.append(_key(item))
    except exc:
        pass
    finally:
        Arm.at = None
    rest = after(c)
    c.close()
    return fn, got, rest


def _reference(name):
    kind, make = CHAINS[name]
    fn = Fn(kind)
    c = make(fn)
    ref = _rest(c)
    c.close()
    return ref, fn.calls


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("name", list(CHAINS))
def test_map_held_a_completed_call_is_not_made_again_after_a_later_failure(name, exc):
    ref, ref_calls = _reference(name)
    at = ref_calls[len(ref_calls) // 2]
    fn, got, rest = _interrupted_run(name, at, exc, _rest)
    assert got + rest == ref
    # every input's function called once, the interrupted one included
    assert fn.calls == ref_calls, (at, fn.calls)


@pytest.mark.parametrize("name", list(CHAINS))
def test_map_held_the_kept_output_goes_with_its_input_on_skip_reset_and_set_state(name):
    ref, ref_calls = _reference(name)
    at = ref_calls[len(ref_calls) // 2]

    def skip_one(c):
        assert c._skip(1) == 1
        return _rest(c)

    def reset(c):
        c.reset()
        return _rest(c)

    def restore(c):
        st = c.get_state()
        c.set_state(st)
        return _rest(c)

    def interrupted_again(c):
        # a second failure of the same conversion: still held, still one call
        Arm.at = at
        try:
            c.read_next()
            raise AssertionError("not interrupted")
        except KeyboardInterrupt:
            pass
        return _rest(c)

    for what, after in (("skip", skip_one), ("reset", reset), ("set_state", restore),
                        ("again", interrupted_again)):
        fn, got, rest = _interrupted_run(name, at, KeyboardInterrupt, after)
        if what == "skip":
            assert got + rest == ref[:len(got)] + ref[len(got) + 1:], what
            # the input after the dropped one got its own call (not the kept output)
            assert fn.calls == ref_calls, (what, fn.calls)
        elif what == "reset":
            assert rest == ref, what
        else:
            assert got + rest == ref, what
            if what == "again":
                assert fn.calls == ref_calls, (what, fn.calls)


# The threaded map kept its chunk's outputs already: the same check, in a
# child with a time limit (its workers must not hang the run).
_THREADED = r'''
import sys
sys.path.insert(0, SUPPORT)
sys.path.insert(0, TESTS)
import test_map_held as t
t.CHAINS["map_threads"] = ("map", lambda f: t._src(2000).map(f, num_threads=2, output_schema=t.I64))
for exc in (KeyboardInterrupt, MemoryError):
    ref, ref_calls = t._reference("map_threads")
    at = 1500
    fn, got, rest = t._interrupted_run("map_threads", at, exc, t._rest)
    assert got + rest == ref, exc
    assert sorted(fn.calls) == sorted(ref_calls), (exc, len(fn.calls), len(ref_calls))
print("OK")
'''


def test_map_held_threaded_map_keeps_completed_outputs_too():
    import os
    tests = os.path.dirname(os.path.abspath(__file__))
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\nTESTS = {tests!r}\n" + _THREADED, timeout=120)


# A filter below a multi_pass positioned by a state whose counts are for a
# later pass than the one it reads (what a reader reading ahead above the
# multi_pass saves: its filter a pass ahead of the chain's position; made
# here by moving a saved state's position back into the first pass): reading
# keeps those counts for that pass, and a skip to the end of this pass skips
# below by the saved pass's input count.  With an input held by an
# interrupted predicate call the reader below was one item further on.
def test_map_held_filter_skip_by_saved_pass_counts_the_held_input():
    class Pred:
        armed = None

        def __call__(self, x):
            v = int(x[0])
            if v == self.armed:
                self.armed = None
                raise KeyboardInterrupt
            return v % 3 != 1

    def make():
        return _src(30).filter(Pred()).multi_pass(2)

    ref = _rest(make())
    per_pass = len(ref) // 2                    # 20 outputs of 30 inputs a pass
    c = make()
    for _ in range(per_pass + 2):               # into the second pass
        c.read_next()
    st = c.get_state()
    f = st["parent"]
    assert f["type"] == "FilterReader" and f["filter"]["epoch"] == f["epoch"] + 1, f
    assert f["filter"]["passes"] == [[f["epoch"], per_pass, 30]], f["filter"]
    st["position"] = 5                          # back in the first pass
    c = make()
    c.set_state(st)
    pred = c.reader.predicate
    pred.armed = 7                              # the next input (outputs 0 2 3 5 6 taken)
    with pytest.raises(KeyboardInterrupt):
        c.read_next()
    assert c._skip(per_pass - 5) == per_pass - 5     # to the end of the first pass
    assert _rest(c) == ref[per_pass:]
