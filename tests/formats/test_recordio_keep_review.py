"""Review of low_memory=False's kept mapping (rl_map.keep): a RecordIO reader
opened with low_memory=False hands a batch deferred records that it copies
from a mapping of the file whose pages stay mapped until the mapping goes.

These tests run the default mode ("auto": no _set_deferred_mode call), the
mode a user gets, unlike test_recordio_mapped.py whose fixture forces each
mode on low_memory=True readers.  Anything that can crash or hang (SIGBUS,
fork, truncation) runs in a child interpreter with a time limit.
"""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats import _recordio as R

from helpers import assert_exactly_once, canon, unbatch

SIZE = 40000                      # >= 32 KiB: big records, deferred for a batch


def _child(code, timeout=180):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def _maps_of(path):
    """Mappings of `path` in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(path))


def _batches(chain):
    return [[canon(i) for i in unbatch(b)] for b in chain]


def _write_fixed(path, n=60, seed=0, **kw):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, SIZE), dtype=np.uint8)
    y = np.arange(n, dtype=np.int64) * 3 + seed
    s = rl.Schema([rl.Field("x", "uint8", (SIZE,)), rl.Field("y", "int64", ())])
    with rl.RecordIOWriter(path, s, chunk_size=1 << 18, **kw) as w:
        w.write_batch({"x": x, "y": y})
    return [canon((x[i], y[i])) for i in range(n)]


def _write_lod(path, n=50, seed=0, **kw):
    rng = np.random.default_rng(seed)
    s = rl.Schema([rl.Field("w", "int32", (), lod_level=1), rl.Field("v", "uint8", (), lod_level=1)])
    with rl.RecordIOWriter(path, s, chunk_size=1 << 18, **kw) as w:
        for i in range(n):
            a = rng.integers(0, 1 << 30, size=int(rng.integers(1, 50)), dtype=np.int32)
            b = rng.integers(0, 256, size=int(rng.integers(33000, 60000)), dtype=np.uint8)
            w.write((a, b))


FILES = {
    "v2": lambda p: _write_fixed(p),
    "v2-page-aligned": lambda p: _write_fixed(p, page_align=True),
    "v2-zlib": lambda p: _write_fixed(p, compressor="zlib"),
    "v1": lambda p: _write_fixed(p, version=1),
    "v2-lod": lambda p: _write_lod(p),
    "v1-lod": lambda p: _write_lod(p, version=1),
}
# which files have chunks a batch takes deferred (uncompressed version 2)
DEFERRED = {"v2", "v2-page-aligned", "v2-lod"}


@pytest.mark.parametrize("kind", sorted(FILES))
@pytest.mark.parametrize("chain", ["batch", "shuffle-batch", "batch-shuffle", "multipass-shuffle-batch"])
def test_low_memory_false_epochs_are_the_two_copy_path(tmp_path, kind, chain):
    """Three epochs of one low_memory=False chain, in the default mode: the
    same batches as the path before deferred records, deferred records only
    where the format allows them (zlib chunks and version 1 fall back), one
    mapping of the file across the epochs, none after close, nothing alive."""
    p = str(tmp_path / "f.rio")
    FILES[kind](p)
    make = {
        "batch": lambda: rl.RecordIOReader(p, low_memory=False).batch(7),
        "shuffle-batch": lambda: rl.RecordIOReader(p, low_memory=False).shuffle(20, seed=1).batch(7),
        "batch-shuffle": lambda: rl.RecordIOReader(p, low_memory=False).batch(3).shuffle(5, seed=2),
        "multipass-shuffle-batch":
            lambda: rl.RecordIOReader(p, low_memory=False).multi_pass(2).shuffle(20, seed=1).batch(6),
    }[chain]

    def epochs(c):
        out = []
        for _ in range(3):
            out.append(_batches(c))
            assert _maps_of(p) <= 1
        return out
    old = R._set_mapped_reads(False)
    try:
        ref_chain = make()
        want = epochs(ref_chain)
        ref_chain.close()
    finally:
        R._set_mapped_reads(old)
    c = make()
    got = epochs(c)
    src = c
    while not isinstance(src, rl.RecordIOReader):
        src = src.reader
    assert (src._records_deferred > 0) == (kind in DEFERRED), src._records_deferred
    assert _maps_of(p) == (1 if kind.startswith("v2") else 0)     # v1: never negotiated
    assert got == want
    c.close()
    del c, src
    gc.collect()
    assert _maps_of(p) == 0
    assert R._live_file_blocks() == 0


@pytest.fixture(autouse=True)
def _default_mode():
    """The mode a user gets (whatever READERLIB_DEFERRED_READS the run has)."""
    old, old_on = R._set_deferred_mode("auto"), R._set_mapped_reads(True)
    yield
    R._set_deferred_mode(old)
    R._set_mapped_reads(old_on)


HOLDER_SWAP = """
import numpy as np, readerlib as rl
from readerlib import _parallel
rl.set_num_threads({threads}); _parallel._set_min_bytes_per_thread(1)
pa, pb = {pa!r}, {pb!r}
for p, n in ((pa, 40000), (pb, {size_b})):
    x = np.random.default_rng(0).integers(0, 256, (24, n), dtype=np.uint8)
    with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (n,))]), chunk_size=1 << 18) as w:
        w.write_batch({{"x": x}})
h = rl.ReaderHolder(rl.RecordIOReader(pa, low_memory={low!r}))
c = h.shuffle(8, seed=0).batch(4)
assert sum(t.data.shape[0] for (t,) in c) == 24 and c._mapped
h.reset_reader(rl.RecordIOReader(pb, low_memory={low!r}))    # another schema: the batch's is stale
try:
    for b in c:
        pass
except rl.RecordSchemaError as e:
    print("RAISED", type(e).__name__, e)
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize("low_memory", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size_b", [50000, 33000])
def test_holder_swapped_to_another_schema_raises_not_crashes(tmp_path, low_memory, threads, size_b):
    """A ReaderHolder may swap in a reader of another schema (reset_reader
    takes its schema); a batch built over the old one then meets deferred
    records of another size.  Its schema error quoted the record's bytes
    straight from rec.data: in pread mode (low_memory=True) that is a file
    offset, never an address (SIGSEGV); in the mapped mode an unguarded,
    unverified read of the mapping.  Now: the schema error, naming the file."""
    pb = str(tmp_path / "b.rio")
    res = _child(HOLDER_SWAP.format(pa=str(tmp_path / "a.rio"), pb=pb, size_b=size_b, low=low_memory,
                                    threads=threads))
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    assert "RAISED" in res.stdout, res.stdout + res.stderr[-2000:]
    assert pb in res.stdout and "byte offset" in res.stdout, res.stdout
