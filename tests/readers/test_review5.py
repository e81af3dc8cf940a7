"""Review of filtshuf + riorestore (review5): findings proven by tests.

1. A hand-edited shuffle state whose buffer holds one source position in two
   slots restored silently and handed that record out twice (and another one
   never): the restore now refuses it, from the file-order keys it sorts
   anyway (adjacent equal positions), with a ValueError naming the positions.
"""
import json

import numpy as np
import pytest

import readerlib as rl
from readerlib.readers._shuffle import ShuffleReader, _pack_positions, _unpack_positions

from test_resume_bounded import _rest_items, _state_at

I64 = rl.Schema([rl.Field("x", "int64")])


def _keep(x):
    return int(x[0]) % 3 != 0


def _chains(tmp_path):
    p = str(tmp_path / "r.rio")
    with rl.RecordIOWriter(p, I64, chunk_size=1024) as w:
        w.write_batch({"x": np.arange(900, dtype=np.int64)})
    arr = lambda: rl.ArrayReader(np.arange(900, dtype=np.int64))
    return {
        "array": lambda: arr().shuffle(60, seed=3).batch(4),
        "recordio": lambda: rl.RecordIOReader(p).shuffle(60, seed=3).batch(4),
        "filter": lambda: arr().filter(_keep).shuffle(60, seed=3).batch(4),
        "filter_recordio": lambda: rl.RecordIOReader(p).filter(_keep).shuffle(60, seed=3).batch(4),
    }


@pytest.mark.parametrize("name", ["array", "recordio", "filter", "filter_recordio"])
def test_duplicate_slot_positions_are_a_value_error(tmp_path, name):
    make = _chains(tmp_path)[name]
    state = _state_at(make, 30)
    buf = state["parent"]["buffer"]
    assert buf is not None and buf["count"] == 60
    ref = buf.get("base_position", buf["source_position"])
    pos = _unpack_positions(buf["slots"], ref, buf["count"], "test")
    assert len(set(pos.tolist())) == len(pos)
    # the untouched state restores (the test's edit is what is refused)
    ok = make()
    ok.set_state(json.loads(json.dumps(state)))
    ok.close()
    # a slot no step after the anchor refills (so the step-back keeps it): its
    # position copied into another such slot
    pos = pos.copy()
    pos[-1] = pos[-2]
    buf["slots"] = _pack_positions(pos, ref)
    other = make()
    with pytest.raises(ValueError, match="slot"):
        other.set_state(state)
        _rest_items(other)
