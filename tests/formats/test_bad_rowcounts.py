"""A record whose zero-width sequence field claims a huge row count.

A field of shape (0,) with lod_level=1 has rows of no bytes, so the record's
size does not bound its row count: a count of 2^62 (checksums recomputed, so
they pass) was accepted, and summed over a batch it wrapped (NumPy's
"negative dimensions are not allowed", no file or offset).  layout_parse
(and the one-copy path's sizing, _deferred_rows) cap such a field at 2^31
rows a record: past it the record does not match the schema, the reader's
usual error naming the file and the record's offset.  Checked in a child
with a timeout, over the two-copy and the one-copy (mapped) path, for a
schema of fixed fields and one of big sequence records, batched and read
record by record; and over TFRecord, which parses with the same code.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import readerlib as rl

CHILD = r'''
import json, sys
import numpy as np
import readerlib as rl
from readerlib.errors import RecordIOSchemaError
from readerlib.formats import _recordio as R

p, kind, mapped, counts = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4])
Z = rl.Field("z", "uint8", (0,), lod_level=1)
n = 12
if kind == "fixed":
    schema = rl.Schema([rl.Field("x", "int64", ()), Z])
    x = np.arange(n, dtype=np.int64) + 1000
    cols = {"x": x, "z": [np.zeros((2, 0), np.uint8)] * n}
    locate = lambda data, k: data.find(x[k].tobytes())      # the record: x, z's count
    before_count = lambda k: 8
else:
    rng = np.random.default_rng(0)
    a = [np.ones((int(k), 3), np.int16) for k in rng.integers(0, 5, n)]
    s = [np.full((int(k), 1024), i + 1, np.uint8) for i, k in enumerate(rng.integers(33, 40, n))]  # >= 32 KiB: deferred
    schema = rl.Schema([rl.Field("a", "int16", (3,), lod_level=1), Z, rl.Field("s", "uint8", (1024,), lod_level=1)])
    cols = {"a": a, "z": [np.zeros((2, 0), np.uint8)] * n, "s": s}
    # the record: a's count and rows, z's count, s's count and rows
    locate = lambda data, k: data.find(s[k].tobytes()) - 8 - 8 - a[k].nbytes - 8
    before_count = lambda k: 8 + a[k].nbytes
with rl.RecordIOWriter(p, schema, chunk_size=1 << 20) as w:
    w.write_batch(cols)

def crc(b, start=0):
    return R._crc32c_copy(bytearray(len(b)), bytes(b), start)

# rewrite z's row count of the records named, and make every checksum agree
data = bytearray(open(p, "rb").read())
offs, nrec = rl.RecordIOReader(p).chunk_table()
assert len(offs) == 1
h, m = int(offs[0]), int(nrec[0])
stored = int.from_bytes(data[h + 16:h + 24], "little")
# small records: one CRC over the sizes and the records; big ones: a table of
# each record's CRC after the sizes, the chunk's CRC over the two tables
flat = crc(data[h + 32:h + 32 + stored]) == int.from_bytes(data[h + 12:h + 16], "little")
sizes = [int.from_bytes(data[h + 32 + 4 * i:h + 36 + 4 * i], "little") for i in range(m)]
start = {int(k): locate(data, int(k)) for k in counts}
for k, c in counts.items():
    k = int(k)
    at = start[k] + before_count(k)
    assert int.from_bytes(data[at:at + 8], "little") == 2
    data[at:at + 8] = int(c).to_bytes(8, "little", signed=True)
    if not flat:
        data[h + 32 + 4 * (m + k):h + 36 + 4 * (m + k)] = crc(data[start[k]:start[k] + sizes[k]]).to_bytes(4, "little")
if flat:
    data[h + 12:h + 16] = crc(data[h + 32:h + 32 + stored]).to_bytes(4, "little")
else:
    data[h + 12:h + 16] = crc(data[h + 32:h + 32 + 8 * m]).to_bytes(4, "little")
data[h + 28:h + 32] = crc(data[h:h + 28], crc(data[16:24])).to_bytes(4, "little")
open(p, "wb").write(data)

R._set_mapped_reads(mapped)
# the error's offset: the record's (a chunk with a CRC a record), else its chunk's
out = {"offsets": {str(k): h if flat else start[int(k)] for k in counts}}
for how in ("batch", "plain"):
    src = c = rl.RecordIOReader(p)
    if how == "batch":
        c = c.batch(4)
        out["mapped"] = c._mapped
    got = []
    try:
        for item in c:
            # the rows of z: a batch's per record (its offsets), a record's
            got.extend(item[1].lengths().tolist() if how == "batch" else [len(item[1])])
        out[how] = ["OK", got]
    except RecordIOSchemaError as e:
        out[how] = ["SCHEMAERROR", str(e), e.path, e.offset]
    except Exception as e:
        out[how] = ["OTHER", type(e).__name__, str(e)]
    if how == "batch":
        out["deferred"] = src._records_deferred
print(json.dumps(out))
'''


def _run(tmp_path, kind, mapped, counts):
    p = str(tmp_path / f"{kind}.rio")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__))))
    res = subprocess.run([sys.executable, "-c", CHILD, p, kind, "1" if mapped else "0", json.dumps(counts)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-3000:])
    return p, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["fixed", "sequence"])
@pytest.mark.parametrize("mapped", [False, True], ids=["two-copy", "one-copy"])
@pytest.mark.parametrize("counts", [{5: 1 << 62, 6: 1 << 62}, {5: (1 << 63) - 1}, {5: (1 << 31) + 1}],
                         ids=["two-2^62", "2^63-1", "2^31+1"])
def test_a_huge_zero_width_row_count_is_the_schema_error(tmp_path, kind, mapped, counts):
    p, out = _run(tmp_path, kind, mapped, counts)
    off = out["offsets"]["5"]
    # the one-copy path did take the big records deferred (sized by _deferred_rows)
    assert out["mapped"] == mapped and (out["deferred"] > 0) == (mapped and kind == "sequence"), out
    for how in ("batch", "plain"):
        got = out[how]
        assert got[0] == "SCHEMAERROR", (how, got)
        assert got[1].startswith(f"{p}: record does not match the schema (record 5 of chunk 0)"), (how, got)
        assert f"at byte offset {off}" in got[1], (how, got)
        assert got[2] == p and got[3] == off, (how, got)


@pytest.mark.parametrize("kind", ["fixed", "sequence"])
@pytest.mark.parametrize("mapped", [False, True], ids=["two-copy", "one-copy"])
def test_the_cap_itself_is_accepted(tmp_path, kind, mapped):
    # 2^31 rows of nothing: at the documented cap, a valid record
    _, out = _run(tmp_path, kind, mapped, {5: 1 << 31})
    assert out["plain"][0] == "OK", out
    assert out["plain"][1][5] == 1 << 31 and out["plain"][1][4] == 2, out
    assert out["batch"] == out["plain"], out
