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


# 2. (checked sound, kept as a guard) The strided run a fixed-size RecordIO
#    chunk loads as (ChunkCache + RecordIOReader._current_run) hands out only
#    verified bytes: one flipped byte anywhere in a chunk -- header, sizes,
#    CRC table, body; version 1/2, zlib -- met through reader[i], read_many or
#    a buffer shuffle's restore raises the reader's error naming the file and
#    the byte offset, never wrong data.  In a subprocess (a bad read past a
#    block would crash).
_CORRUPT_SCRIPT = r"""
import json, os, shutil, sys
import numpy as np
import readerlib as rl
d, ver, comp, rc = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
S = rl.Schema([rl.Field("x", "int64")])
N = 40000
os.makedirs(os.path.join(d, "good"), exist_ok=True)
os.makedirs(os.path.join(d, "bad"), exist_ok=True)
good = os.path.join(d, "good", "f.rio")
bad = os.path.join(d, "bad", "f.rio")         # the same name: the same file identity
kw = dict(version=ver, compressor=comp)
if ver == 2 and comp == "none":
    kw["record_crc"] = rc
with rl.RecordIOWriter(good, S, chunk_size=1024, **kw) as w:
    w.write_batch({"x": np.arange(N, dtype=np.int64)})
r = rl.RecordIOReader(good); offs, nrec = r.chunk_table(); r.close()
starts = np.concatenate([[0], np.cumsum(nrec)])
c = int(np.searchsorted(starts, 20500, side="right") - 1)   # buffered at the state below
lo, hi = int(starts[c]), int(starts[c + 1])
size = int(offs[c + 1] - offs[c])
a = rl.RecordIOReader(good).shuffle(2000, seed=1); it = iter(a)
for _ in range(20000):
    next(it)
state = json.loads(json.dumps(a.get_state())); a.close()
out = []
for at in sorted({0, 5, 13, 29, 33, 40, 47, size // 3, size // 2, size - 9, size - 1}):
    shutil.copy(good, bad)
    with open(bad, "r+b") as f:
        f.seek(int(offs[c]) + at); b = f.read(1); f.seek(int(offs[c]) + at); f.write(bytes([b[0] ^ 0x5A]))
    for mode in ("getitem", "read_many", "restore"):
        try:
            rd = rl.RecordIOReader(bad)
            if mode == "getitem":
                [rd[i] for i in range(lo, hi)]
            elif mode == "read_many":
                rd.read_many(list(range(hi - 1, lo - 1, -1)))
            else:
                rd = rd.shuffle(2000, seed=1)
                rd.set_state(state)
                assert rd.restores == 1
            out.append([at, mode, "no error"])
        except rl.RecordIOError as e:
            if bad not in str(e) or "byte offset" not in str(e):
                out.append([at, mode, str(e)[:200]])
        rd.close()
print("RESULT", json.dumps(out))
"""


@pytest.mark.parametrize("ver,comp,rc", [(1, "none", 0), (1, "zlib", 0), (2, "none", 0),
                                         (2, "none", 1), (2, "zlib", 0)])
def test_a_flipped_byte_in_a_strided_chunk_is_always_the_readers_error(tmp_path, ver, comp, rc):
    import os
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", _CORRUPT_SCRIPT, str(tmp_path), str(ver), comp, str(rc)],
                       capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout
    assert json.loads(line[0][7:]) == [], line[0]
