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


KEPT_TRUNCATE = """
import os
{faulthandler}
import numpy as np, readerlib as rl
from readerlib import _parallel
rl.set_num_threads({threads}); _parallel._set_min_bytes_per_thread(1)
p = {p!r}
if {lod!r}:
    s = rl.Schema([rl.Field("w", "int32", (), lod_level=1), rl.Field("v", "uint8", (), lod_level=1)])
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(p, s, chunk_size=1 << 18) as w:
        for i in range(200):
            w.write((np.arange(int(rng.integers(1, 40)), dtype=np.int32),
                     np.ones(int(rng.integers(33000, 45000)), np.uint8)))
else:
    with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (40000,))]), chunk_size=1 << 18) as w:
        w.write_batch({{"x": np.ones((200, 40000), np.uint8)}})
c = rl.RecordIOReader(p, low_memory=False).shuffle(300, seed=0).batch(16)
assert sum(1 for _ in c) > 0 and c._mapped     # one whole epoch: every page of the file stays mapped
it = iter(c)                                    # the second epoch
n_of = lambda b: len(b[0].lod[0]) - 1 if b[0].lod else b[0].data.shape[0]     # instances
rows = n_of(next(it))                           # every record is in the buffer, its page mapped
if {grow!r}:
    with open(p, "ab") as f:                    # grown: the reader reads what was there at open
        f.write(bytes([255]) * (1 << 20))
else:
    os.truncate(p, os.path.getsize(p) // 3)
errors = 0
while True:
    try:
        rows += n_of(next(it))
    except StopIteration:
        break
    except rl.RecordIOError as e:
        assert str(e).startswith(p) and "of chunk" in str(e) and "at byte offset" in str(e), e
        assert "the file is shorter than when it was opened" in str(e), e
        errors += 1
print("ERRORS", errors, "ROWS", rows)
"""


@pytest.mark.parametrize("lod", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("faulthandler", [False, True])
@pytest.mark.parametrize("grow", [False, True])
def test_truncated_after_an_epoch_of_kept_pages_raises(tmp_path, lod, threads, faulthandler, grow):
    """The kept pages of a low_memory=False mapping (default mode) do not
    outlive a truncation: the kernel unmaps them, the guarded copy meets
    SIGBUS and raises naming the file, the chunk and the offset; the process
    exits normally.  Grown instead: every record, no error."""
    fh = "import faulthandler; faulthandler.enable()" if faulthandler else ""
    res = _child(KEPT_TRUNCATE.format(p=str(tmp_path / "t.rio"), lod=lod, threads=threads, faulthandler=fh,
                                      grow=grow))
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    errors, rows = (int(v) for v in res.stdout.split("ERRORS")[1].split("ROWS"))
    if grow:
        assert errors == 0 and rows == 200, res.stdout
    else:
        assert errors > 0 and rows < 200, res.stdout
    assert "Fatal Python error" not in res.stderr


KEPT_FORK = """
import os, numpy as np, readerlib as rl
from readerlib.formats import _recordio as R
p = {p!r}
x = np.random.default_rng(0).integers(0, 256, (60, 40000), dtype=np.uint8)
with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (40000,))]), chunk_size=1 << 18) as w:
    w.write_batch({{"x": x}})
want = sorted(r.tobytes() for r in x)
rows = lambda it: [r.tobytes() for (t,) in it for r in np.asarray(t.data)]
c = rl.RecordIOReader(p, low_memory=False).shuffle(20, seed=0).batch(5)
assert sorted(rows(c)) == want and c._mapped          # the pages are kept mapped
it = iter(c)
first = rows([next(it)])
pids = []
for k in range(2):                                      # two DataLoader-like workers
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = sorted(first + rows(it)) == want       # the inherited epoch
            ok = ok and all(sorted(rows(c)) == want for _ in range(2)) and c._mapped
            c.close()
            ok = ok and R._live_file_blocks() == 0
        except BaseException as e:
            print("child", repr(e))
        os._exit(0 if ok else 1)
    pids.append(pid)
c.close()                                               # the parent unmaps while they read
print("STATUS", [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids], R._live_file_blocks())
"""


def test_forked_workers_read_a_kept_mapping(tmp_path):
    res = _child(KEPT_FORK.format(p=str(tmp_path / "f.rio")))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "STATUS [0, 0] 0" in res.stdout, res.stdout + res.stderr[-2000:]


def test_reader_closed_mid_epoch_and_resume(tmp_path):
    """The kept mapping outlives the reader's close() while deferred records
    hold it (the shuffle's buffer), then goes with the chain.  The chain is
    not read on after the close (a chain with a closed reader raises, see
    tests/readers/test_chain_lock.py).  get_state / set_state / reset over it
    are exact."""
    p = str(tmp_path / "c.rio")
    want = _write_fixed(p, n=50)
    r = rl.RecordIOReader(p, low_memory=False)
    c = r.shuffle(100, seed=0).batch(8)
    it = iter(c)
    next(it)
    assert c._mapped and R._live_file_blocks() > 0
    r.close()                          # the buffer holds every other record, deferred
    assert R._live_file_blocks() > 0 and _maps_of(p) >= 1
    with pytest.raises(ValueError, match=r"closed reader \(RecordIOReader, which BatchReader"):
        next(it)
    c.close()
    del it, c, r
    gc.collect()
    assert _maps_of(p) == 0 and R._live_file_blocks() == 0

    make = lambda: rl.RecordIOReader(p, low_memory=False).shuffle(20, seed=5).batch(6)
    c = make()
    _batches(c)                        # an epoch first: the pages are mapped
    it = iter(c)
    head = [_batches([next(it)]) for _ in range(3)]
    st = c.get_state()
    tail = _batches(it)
    c2 = make()
    c2.set_state(st)
    assert c2._mapped and _batches(c2) == tail
    c.reset()
    again = _batches(c)
    assert sorted(sum(again, [])) == sorted(want) and head
    c.close()
    c2.close()


@pytest.mark.parametrize("value", ["", "auto", "pread", "mmap", "keep", "mmpa", "MMAP"])
def test_deferred_reads_env_var(value):
    """READERLIB_DEFERRED_READS picks the mode at import (unset or empty:
    "auto"); a value that is none of the modes is not silently taken for
    "auto" (a typo of "mmap" or "pread" would measure the wrong A/B): a
    RuntimeWarning names the variable, the value and the modes."""
    code = """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            from readerlib.formats import _recordio as R
        print("MODE", R._set_deferred_mode("auto"))
        print("WARNED", [str(x.message) for x in w if "READERLIB_DEFERRED_READS" in str(x.message)])
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, READERLIB_DEFERRED_READS=value))
    assert res.returncode == 0, res.stderr[-2000:]
    valid = value in R._DEFERRED_MODES
    assert f"MODE {value if valid else 'auto'}\n" in res.stdout, res.stdout
    warned = eval(res.stdout.split("WARNED ")[1])
    if valid or value == "":
        assert warned == [], warned
    else:
        assert len(warned) == 1 and repr(value) in warned[0] and "'keep'" in warned[0], warned


def _rss_of_mapping(path):
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    kb, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:     # a mapping's first line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                kb += int(head[1])
    return kb


def test_kept_pages_go_when_the_reader_closes(tmp_path):
    """RECORDIO.md, README, the docstring: the pages stay mapped "until the
    reader closes".  The batch holds the mapping too (and buffered records
    may): closing the reader alone while its chain object lives on left the
    whole file resident until the chain went.  Now its pages go with the
    reader's close (the chain is not read on after it: it raises)."""
    p = str(tmp_path / "k.rio")
    _write_fixed(p, n=120)
    r = rl.RecordIOReader(p, low_memory=False)
    c = r.shuffle(200, seed=0).batch(8)
    _batches(c)
    assert _rss_of_mapping(p) >= 3 << 10, _rss_of_mapping(p)      # 120 x 40 kB: kept
    it = iter(c)
    next(it)                                                      # the rest are buffered, deferred
    r.close()
    assert _maps_of(p) == 1                                       # still held, by the batch and buffer
    assert _rss_of_mapping(p) < 1 << 10, _rss_of_mapping(p)
    with pytest.raises(ValueError, match="closed reader"):
        next(it)
    c.close()
    assert _maps_of(p) == 0
