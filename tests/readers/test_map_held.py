"""The held input of map (one thread and threaded), map_batches and filter.

An input whose processing an own failure interrupted (a KeyboardInterrupt /
SystemExit, or a MemoryError of the reader's own) is held and handed again
to the next read (readers/_map.pyx, the comment above `_NOT_CALLED`).  The
readers share one implementation of it (`_HeldInput`); these tests pin
what the copies it replaced did differently:

* a filter positioned by saved counts for a later pass (a multi_pass above
  it) counts its held input among the inputs it skips below (it skipped one
  item too many below: "the reader below ... has fewer items").
"""
import numpy as np
import pytest

import readerlib as rl

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
