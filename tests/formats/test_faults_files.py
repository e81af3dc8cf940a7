"""Fault injection on files, writers and kernels (issue 12).

Files truncated / rewritten / grown under every reader, crafted indexes and
footers with valid checksums, failing and killed writers, mutated LoD tensors
and hostile kernel arguments.  Anything that could crash runs in a subprocess
with a time limit, so a SIGBUS or SIGSEGV shows as a failed test.
"""
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import readerlib as rl
from readerlib.errors import DataLossError, RecordIOWarning, TFRecordWarning
from readerlib.formats._tfrecord import TFRecordReader, TFRecordWriter, build_index, INDEX_MAGIC
from readerlib.formats._writer import _PieceFile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = rl.Schema([rl.Field("x", "uint8", (1000,))])


def run_py(code, timeout=60):
    """Run `code` in a fresh interpreter; a signal death is a test failure."""
    # the environment conftest.py set: the child imports the readerlib under test (installed
    # in CI), never the uncompiled source tree
    p = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode >= 0, f"killed by signal {-p.returncode}:\n{p.stdout}\n{p.stderr}"
    assert p.returncode == 0, f"rc={p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _crc(b):
    # plain (unmasked) CRC-32C, Castagnoli, bitwise (tests only)
    crc = 0xFFFFFFFF
    for x in bytes(b):
        crc ^= x
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


# ------------------------------------------------- files changing under a reader
WRITE_FILE = """
import os, sys, numpy as np, readerlib as rl
from readerlib.formats._tfrecord import TFRecordReader, TFRecordWriter
kind, path = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
recs = [rng.integers(0, 256, 1000, dtype=np.uint8) for _ in range(3000)]
if kind.startswith("rio"):
    comp = "zlib" if "zlib" in kind else "none"
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (1000,))]), chunk_size=1 << 16,
                           compressor=comp) as w:
        for r in recs: w.write((r,))
else:
    comp = {"tfgz": "GZIP", "tfzlib": "ZLIB"}.get(kind)
    with TFRecordWriter(path, compression=comp) as w:
        for r in recs: w.write(r)
def open_reader():
    if kind == "rio_lm0": return rl.RecordIOReader(path, low_memory=False)
    if kind.startswith("rio"): return rl.RecordIOReader(path)
    if kind == "tf_open_files": return rl.open_files([path], num_threads=1)
    comp = {"tf": None, "tfgz": "GZIP", "tfzlib": "ZLIB"}[kind]
    return TFRecordReader(path, compression=comp, index=False)
"""

READERS = ["rio", "rio_lm0", "rio_zlib", "tf", "tfgz", "tfzlib", "tf_open_files"]


@pytest.mark.parametrize("kind", READERS)
@pytest.mark.parametrize("change", ["truncate", "rewrite", "grow"])
def test_file_changed_under_reader(kind, change, tmp_path):
    """Truncated: a DataLossError naming the file (never SIGBUS).  Rewritten in
    place with other bytes of the same size: every record handed out is one
    of the originals (the bytes checked are the bytes handed out) or an error.
    Grown: the reader reads what was there when it opened."""
    ext = ".rio" if kind.startswith("rio") else ".tfrecord"
    path = str(tmp_path / ("f" + ext))
    out = run_py((WRITE_FILE + f"""
import warnings; warnings.simplefilter("ignore")
change = {change!r}
orig = set(r.tobytes() for r in recs)
r = open_reader()
it = iter(r)
first = next(it)[0]
size = os.path.getsize(path)
if change == "truncate":
    os.truncate(path, 16384)
elif change == "rewrite":
    with open(path, "r+b") as f:          # same size, other bytes, in place (the chunk
        f.write(os.urandom(size))         # being read included)
else:
    with open(path, "ab") as f:
        f.write(os.urandom(1 << 20))
n, bad = 1, 0
try:
    for inst in it:
        n += 1
        bad += np.asarray(inst[0]).tobytes() not in orig
    print("END", n, bad)
except rl.DataLossError as e:
    assert path in str(e), e
    print("ERR", n, bad, type(e).__name__)
""").replace("sys.argv[1], sys.argv[2]", f"{kind!r}, {path!r}"))
    status, n, bad = out.split()[:3]
    assert int(bad) == 0, out
    if change == "truncate":
        # open_files' workers may have read (and checked) everything before the
        # cut: then every record, as it was, is the right answer
        assert status == "ERR" or (kind == "tf_open_files" and int(n) == 3000), out
    if change == "grow" and kind != "tf_open_files":
        assert status == "END" and int(n) == 3000, out


def test_rewrite_after_check_hands_out_checked_bytes(tmp_path):
    """A chunk already checked keeps its bytes when the file is rewritten."""
    path = str(tmp_path / "a.tfrecord")
    recs = [bytes([i % 256]) * 100 for i in range(50)]
    with TFRecordWriter(path) as w:
        for r in recs:
            w.write(r)
    r = TFRecordReader(path, index=False)
    it = iter(r)
    got = [next(it)[0].tobytes()]
    with open(path, "r+b") as f:
        f.write(b"\xff" * os.path.getsize(path))
    got += [x[0].tobytes() for x in it]
    assert got == recs


# ------------------------------------------------------------- TFRecord index
def _tf_file(path, n, size=100_000, seed=1):
    rng = np.random.default_rng(seed)
    recs = [rng.integers(0, 256, size=size + i, dtype=np.uint8).tobytes() for i in range(n)]
    with TFRecordWriter(path) as w:
        for r in recs:
            w.write(r)
    return recs


def _craft_index(path, table, nrec=None, end=None):
    """Rewrite path's index with another chunk table, with a valid CRC."""
    idx = path + ".idx"
    raw = open(idx, "rb").read()
    head = np.frombuffer(raw, "<u8", count=9, offset=8).copy()
    table = np.asarray(table, "<i8").reshape(-1, 3)
    head[3] = table[:, 2].sum() if nrec is None else nrec
    head[4] = len(table)
    if end is not None:
        head[5] = end
    body = INDEX_MAGIC + head.tobytes() + table.tobytes()
    open(idx, "wb").write(body + _crc(body).to_bytes(4, "little"))


def test_index_of_a_file_grown_during_the_first_pass_hides_nothing(tmp_path):
    path = str(tmp_path / "g.tfrecord")
    recs = _tf_file(path, 10, size=1000)
    r = TFRecordReader(path)
    it = iter(r)
    next(it)
    more = _tf_file(str(tmp_path / "more"), 10, size=1000, seed=2)
    with open(path, "ab") as f:
        f.write(open(str(tmp_path / "more"), "rb").read())
    assert len(list(it)) == 9                       # what was there at open
    r2 = TFRecordReader(path)
    assert r2.num_records == 20
    assert [x[0].tobytes() for x in r2] == recs + more


def test_stale_index_with_matching_size_and_mtime_is_not_trusted(tmp_path):
    """cp -p / rsync -a: same size and mtime, other records."""
    a, b = str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")
    recs_a = _tf_file(a, 20, size=1000)
    rng = np.random.default_rng(5)
    recs_b = [rng.integers(0, 256, 497 if i < 39 else 487, dtype=np.uint8).tobytes()
              for i in range(40)]                      # the same total size, twice the records
    with TFRecordWriter(b) as w:
        for r in recs_b:
            w.write(r)
    assert os.path.getsize(a) == os.path.getsize(b)
    build_index(a)
    st = os.stat(a)
    os.replace(b, a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.warns(TFRecordWarning, match="other contents"):
        r = TFRecordReader(a)
    assert r.num_records == 40
    assert [x[0].tobytes() for x in r] == recs_b


@pytest.mark.parametrize("case", ["negative", "repeated", "beyond", "count", "misaligned"])
def test_crafted_index_with_valid_crc_is_rejected(case, tmp_path):
    path = str(tmp_path / "c.tfrecord")
    recs = _tf_file(path, 30)
    build_index(path)
    offs, counts = TFRecordReader(path).chunk_table()
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    table = np.stack([offs, first, counts], 1)
    if case == "negative":
        table[1, 0] = -(1 << 40)
    elif case == "repeated":
        table[2, 0] = table[1, 0]
    elif case == "beyond":
        table[-1, 0] = os.path.getsize(path) + 4096
    elif case == "count":
        table[1, 2] += 1
        table[2:, 1] += 1
    else:
        table[1, 0] += 8                      # lands inside a record
    _craft_index(path, table)
    code = f"""
import warnings, readerlib as rl
from readerlib.formats._tfrecord import TFRecordReader
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    r = TFRecordReader({path!r})
    try:
        got = [x[0].tobytes() for x in r]
        print("OK", len(got), len(set(got)), r.has_index, len(w))
    except rl.DataLossError as e:
        print("ERR", e)
"""
    out = run_py(code).split()
    if out[0] == "OK":
        assert out[1] == out[2] == str(len(recs)), out      # every record exactly once
    else:
        assert "index" in " ".join(out), out


# ------------------------------------------------------- RecordIO index footer
def _rio_file(path, n=200, chunk=4096):
    with rl.RecordIOWriter(path, SCHEMA, chunk_size=chunk) as w:
        for i in range(n):
            w.write((np.full(1000, i % 251, np.uint8),))


def _craft_footer(path, entries, total=None):
    raw = bytearray(open(path, "rb").read())
    ioff = int.from_bytes(raw[-16:-8], "little")
    entries = np.asarray(entries, "<u8").reshape(-1, 2)
    idx = bytearray(raw[ioff:ioff + 8])
    idx += len(entries).to_bytes(8, "little")
    idx += int(entries[:, 1].sum() if total is None else total).to_bytes(8, "little")
    idx += entries.tobytes()
    idx += _crc(idx).to_bytes(4, "little")
    off = ioff.to_bytes(8, "little")
    raw = raw[:ioff] + idx + off + _crc(off).to_bytes(4, "little") + raw[-4:]
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("case", ["negative", "repeated", "swapped", "count", "huge_count", "total"])
def test_crafted_recordio_footer_with_valid_crc(case, tmp_path):
    path = str(tmp_path / "f.rio")
    _rio_file(path)
    offs, counts = rl.RecordIOReader(path).chunk_table()
    e = np.stack([offs, counts], 1).astype(np.int64)
    total = None
    if case == "negative":
        e[1, 0] = -(1 << 40)
    elif case == "repeated":
        e[2, 0] = e[1, 0]
    elif case == "swapped":
        e[[1, 2]] = e[[2, 1]]
    elif case == "count":
        e[1, 1] += 1
    elif case == "huge_count":
        e[1, 1] = 1 << 62
    else:
        total = int(counts.sum()) + 1
    _craft_footer(path, e.view(np.uint64), total)
    out = run_py(f"""
import warnings, readerlib as rl
warnings.simplefilter("ignore")
try:
    r = rl.RecordIOReader({path!r})
    got = [int(x[0][0]) for x in r]
    print("OK", len(got))
except rl.RecordIOError as e:
    print("ERR", e)
""").split()
    if out[0] == "OK":
        assert out[1] == "200"
    else:
        assert path in " ".join(out)


# ------------------------------------------------------------------- writers
class _Flaky:
    """os.pwritev that fails with `err` on calls in `fail_at` (after writing
    `partial` bytes of the call: a torn write)."""

    def __init__(self, fail_at, err, partial=0):
        self.n, self.fail_at, self.err, self.partial = 0, set(fail_at), err, partial
        self.fired = 0
        self.real = os.pwritev

    def __call__(self, fd, bufs, off):
        self.n += 1
        if self.n in self.fail_at:
            self.fired += 1
            if self.partial:
                flat = b"".join(bytes(b) for b in bufs)[:self.partial]
                os.pwrite(fd, flat, off)
            raise OSError(self.err, os.strerror(self.err))
        return self.real(fd, bufs, off)


def _write_rio(path, n, fail, comp="none", chunk=4096):
    acked = 0
    w = rl.RecordIOWriter(path, SCHEMA, chunk_size=chunk, compressor=comp)
    for i in range(n):
        try:
            w.write((np.full(1000, i % 251, np.uint8),))
        except OSError:
            continue                 # not taken: the writer keeps its state
        acked += 1
    return w, acked


@pytest.mark.parametrize("comp", ["none", "zlib"])
@pytest.mark.parametrize("partial", [0, 17])
def test_recordio_writer_transient_enospc(comp, partial, tmp_path, monkeypatch):
    import errno
    path = str(tmp_path / "w.rio")
    flaky = _Flaky({3, 4, 9}, errno.ENOSPC, partial)
    monkeypatch.setattr(os, "pwritev", flaky)
    w, acked = _write_rio(path, 40, flaky, comp)
    w.close()
    monkeypatch.undo()
    assert flaky.fired == 3 and acked < 40
    r = rl.RecordIOReader(path)
    assert r.has_index and len(r) == acked == w.num_records
    vals = [int(x[0][0]) for x in r]
    assert len(vals) == acked


def test_recordio_writer_failed_close_raises_and_keeps_a_readable_prefix(tmp_path, monkeypatch):
    import errno
    path = str(tmp_path / "w.rio")
    w, acked = _write_rio(path, 30, None)
    w.flush()
    monkeypatch.setattr(os, "pwritev", _Flaky(set(range(1, 100)), errno.ENOSPC, 5))
    with pytest.raises(OSError, match="No space"):
        w.close()
    assert not w.closed
    monkeypatch.undo()
    with pytest.warns(RecordIOWarning):           # no footer: complete chunks, a warning
        r = rl.RecordIOReader(path)
    assert len(list(r)) == 30
    w.close()                                     # space is back: the retry finishes the file
    r = rl.RecordIOReader(path)
    assert r.has_index and len(list(r)) == 30


@pytest.mark.parametrize("kind", ["rio", "tf"])
def test_writer_collected_after_failed_finish_warns_with_path(kind, tmp_path):
    path = str(tmp_path / ("gc." + kind))
    out = run_py(f"""
import errno, gc, os, warnings, numpy as np, readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter
if {kind!r} == "rio":
    w = rl.RecordIOWriter({path!r}, rl.Schema([rl.Field("x", "uint8", (1000,))]))
    for i in range(1000): w.write((np.zeros(1000, np.uint8),))
else:
    w = TFRecordWriter({path!r})
    for i in range(1000): w.write(b"x" * 100)
def fail(*a): raise OSError(errno.ENOSPC, "No space left on device")
os.pwritev = fail
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    del w
    gc.collect()
print([str(x.category.__name__) + ":" + str(x.message) for x in ws])
""")
    assert path in out and ("RecordIOWarning" in out or "TFRecordWarning" in out), out


@pytest.mark.parametrize("comp", [None, "GZIP"])
def test_tfrecord_writer_transient_enospc(comp, tmp_path, monkeypatch):
    import errno
    path = str(tmp_path / "w.tfrecord")
    flaky = _Flaky({2, 3}, errno.ENOSPC, 9)
    monkeypatch.setattr(os, "pwritev", flaky)
    w = TFRecordWriter(path, compression=comp)
    acked = []
    for i in range(300):
        rec = bytes([i % 256]) * 10_000
        try:
            w.write(rec)
        except OSError:
            continue                 # not taken
        acked.append(rec)
        if i % 10 == 9:
            try:
                w.flush()            # a failed flush keeps what it could not write
            except OSError:
                pass
    w.close()
    monkeypatch.undo()
    assert flaky.fired == 2
    got = [x[0].tobytes() for x in TFRecordReader(path, compression=comp, index=False)]
    assert got == acked and len(acked) >= 298


@pytest.mark.parametrize("kind", ["rio", "rio_zlib", "tf", "tfgz"])
def test_rlimit_fsize_on_writers(kind, tmp_path):
    """Past RLIMIT_FSIZE (SIGXFSZ ignored) writes fail with EFBIG: the writer
    raises, close() raises, and what is on disk reads back as a clean prefix."""
    path = str(tmp_path / ("lim." + kind))
    out = run_py(f"""
import resource, signal, warnings, numpy as np, readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter, TFRecordReader
warnings.simplefilter("ignore")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))
kind = {kind!r}
if kind.startswith("rio"):
    w = rl.RecordIOWriter({path!r}, rl.Schema([rl.Field("x", "uint8", (1000,))]), chunk_size=1 << 14,
                          compressor="zlib" if kind == "rio_zlib" else "none")
    put = lambda i: w.write((np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8),))
else:
    w = TFRecordWriter({path!r}, compression="GZIP" if kind == "tfgz" else None)
    put = lambda i: (w.write(np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8)), w.flush())
acked, failed = 0, 0
for i in range(1000):
    try:
        put(i); acked += 1
    except OSError as e:
        assert e.errno == 27, e           # EFBIG
        failed += 1
        break
try:
    w.close(); closed = True
except OSError:
    closed = False
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
if kind.startswith("rio"):
    got = [np.asarray(x[0]) for x in rl.RecordIOReader({path!r}, on_error="skip")]
else:
    got = []
    try:
        for x in TFRecordReader({path!r}, compression="GZIP" if kind == "tfgz" else None, index=False):
            got.append(x[0])
    except rl.DataLossError:
        pass
for i, g in enumerate(got):
    assert np.array_equal(g, np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8)), i
print(failed, closed, acked, len(got))
""")
    failed, closed, acked, n = out.split()
    assert failed == "1" and closed == "False", out
    if kind.startswith("tf"):
        assert int(n) >= int(acked), out           # every flushed record is there


KILLED_WRITER = """
import os, sys, numpy as np, readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter
kind, path = sys.argv[1], sys.argv[2]
if kind.startswith("rio"):
    w = rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (1000,))]), chunk_size=1 << 14,
                          compressor="zlib" if kind == "rio_zlib" else "none")
else:
    w = TFRecordWriter(path, compression="GZIP" if kind == "tfgz" else None)
print(0, flush=True)                      # started: nothing acknowledged yet
for i in range(100000):
    rec = np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8)
    w.write((rec,) if kind.startswith("rio") else rec)
    if i % 7 == 6:
        w.flush()
        print(i + 1, flush=True)          # acknowledged: i + 1 records
"""


@pytest.mark.parametrize("kind", ["rio", "rio_zlib", "tf", "tfgz"])
def test_sigkill_writer_at_random_points(kind, tmp_path):
    import time
    rng = np.random.default_rng(12)
    env = dict(os.environ)          # conftest.py's PYTHONPATH: the readerlib under test
    for trial in range(3):
        path = str(tmp_path / f"k{trial}.{kind}")
        p = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, kind, path], stdout=subprocess.PIPE,
                             text=True, env=env)
        first = p.stdout.readline()            # the writer exists (imports can be slow here)
        time.sleep(rng.random() * 0.5)
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        out = first + out
        acked = int(out.split()[-1])
        code = f"""
import warnings, numpy as np, readerlib as rl
from readerlib.formats._tfrecord import TFRecordReader
warnings.simplefilter("ignore")
kind, path = {kind!r}, {path!r}
got, err = [], None
try:
    r = (rl.RecordIOReader(path, on_error="skip") if kind.startswith("rio") else
         TFRecordReader(path, compression="GZIP" if kind == "tfgz" else None, index=False))
    for x in r:
        got.append(np.asarray(x[0]))
except rl.DataLossError as e:
    err = e
for i, g in enumerate(got):
    assert np.array_equal(g, np.random.default_rng(i).integers(0, 256, 1000, dtype=np.uint8)), i
print(len(got))
"""
        n = int(run_py(code).split()[-1])
        assert n >= acked, (kind, trial, n, acked)


def test_piece_file_rolls_back_a_torn_write(tmp_path, monkeypatch):
    import errno
    f = _PieceFile(str(tmp_path / "p"))
    f.write(b"abc")
    monkeypatch.setattr(os, "pwritev", _Flaky({1}, errno.EIO, 2))
    with pytest.raises(OSError, match="byte offset 3"):
        f.write(b"defg", b"hij")
    monkeypatch.undo()
    assert open(str(tmp_path / "p"), "rb").read() == b"abc"
    f.write(b"de")
    f.close()
    assert open(str(tmp_path / "p"), "rb").read() == b"abcde"


# ------------------------------------------------------------------- kernels
KERNEL_CRASH = """
import numpy as np, readerlib as rl
from readerlib.kernels import ctc_greedy_decoder, batch_reindex
case = {case!r}
t = rl.LoDTensor.from_sequences([np.ones((2, 3), np.float32), np.ones((1, 3), np.float32),
                                 np.ones((2, 3), np.float32)])
try:
    if case == "ctc_lod_offset":
        t.lod[0][2] = 1 << 40
        ctc_greedy_decoder(t)
    elif case == "ctc_lod_negative":
        t.lod[0][1] = -(1 << 40)
        ctc_greedy_decoder(t)
    elif case == "reindex_short_data":
        t.data = np.full((1, 3), 7, np.float32)
        batch_reindex(t, [1])
    elif case == "reindex_lod_replaced":
        t.lod = [np.array([0, 5, 1 << 50, 5])]
        batch_reindex(t, [2, 0])
    elif case == "reindex_lod_uint64":
        t.lod[0] = np.array([0, 2, 2**64 - 1, 5], np.uint64)
        batch_reindex(t, [1])
    print("NO ERROR")
except (ValueError, TypeError, IndexError) as e:
    print("OK", type(e).__name__, e)
"""


@pytest.mark.parametrize("case", ["ctc_lod_offset", "ctc_lod_negative", "reindex_short_data",
                                  "reindex_lod_replaced", "reindex_lod_uint64"])
def test_mutated_lodtensor_is_rejected_by_kernels(case):
    out = run_py(KERNEL_CRASH.format(case=case))
    assert out.startswith("OK") and "LoD level" in out, out


@pytest.mark.parametrize("dtype", [np.uint64, np.uint32, np.int64])
def test_ctc_lengths_checked_before_the_cast(dtype):
    from readerlib.kernels import ctc_greedy_decoder, FailedPreconditionError
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    big = np.iinfo(dtype).max
    with pytest.raises(FailedPreconditionError, match=r"sequence_length\(1\) <= 4"):
        ctc_greedy_decoder(x, np.array([4, big], dtype))
    with pytest.raises(FailedPreconditionError, match=r"sequence_length\(1\) <= 4"):
        ctc_greedy_decoder(x, np.array([4, 5], dtype))
    if dtype == np.int64:        # a negative int64 that int32 would wrap to 3 decodes nothing
        (d,), neg = ctc_greedy_decoder(x, np.array([4, -(1 << 32) + 3], dtype))
        (d0,), neg0 = ctc_greedy_decoder(x, np.array([4, 0], np.int32))
        assert d.indices.tolist() == d0.indices.tolist() and neg.tolist() == neg0.tolist()


def test_reindex_index_checks_before_the_cast():
    from readerlib.kernels import batch_reindex, batch_reindex_grad
    x = np.arange(12.0).reshape(4, 3)
    for bad in (np.array([1, 2**64 - 1], np.uint64), np.array([1, 4]), np.array([-1, 0]),
                np.array([1, -(1 << 40)], np.int64)):
        with pytest.raises(IndexError):
            batch_reindex(x, bad)
        with pytest.raises(IndexError):
            batch_reindex_grad(np.ones((2, 3)), bad, 4)
        t = rl.LoDTensor.from_sequences([np.ones((2, 3)), np.ones((1, 3)), np.ones((1, 3)), np.ones((3, 3))])
        with pytest.raises(IndexError):
            batch_reindex(t, bad)


def _rnnt_nan_model(dtype=np.float64, seed=0):
    from readerlib.rnnt import RNNTModel
    model = RNNTModel.random(11, 6, 8, 7, predictor="lstm", blank_bias=0.0, dtype=dtype, rng=seed)
    return model


@pytest.mark.parametrize("where", ["frame_inf", "bias_nan"])
def test_rnnt_nan_rule_is_numpys_in_every_algorithm(where):
    """A NaN logit wins the argmax (the first NaN, numpy.argmax / torch.argmax);
    every algorithm agrees with `single`, which uses numpy.argmax."""
    from readerlib.rnnt import rnnt_greedy_decode
    model = _rnnt_nan_model()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 9, 6))
    if where == "frame_inf":
        x[1, 2, :] = np.inf          # inf - inf inside the joint: some logits NaN, some not
        x[3, 5, 0] = np.inf
        x[4, 0, 1] = -np.inf
    else:
        model.joint._out_b[4] = np.nan   # class 4 is NaN in every frame
    lengths = np.array([9, 6, 9, 8, 3])
    ref = rnnt_greedy_decode(model, x, lengths, 3, "single", True)
    if where == "bias_nan":
        assert all(set(h.y_sequence.tolist()) <= {4} and len(h.y_sequence) for h in ref)
    for alg, kw in [("loop_labels", {}), ("loop_labels", {"window": 1}), ("loop_labels", {"window": 4}),
                    ("loop_frames", {})]:
        out = rnnt_greedy_decode(model, x, lengths, 3, alg, True, **kw)
        for a, b in zip(ref, out):
            assert a.y_sequence.tolist() == b.y_sequence.tolist(), (alg, kw)
            assert a.timestamps.tolist() == b.timestamps.tolist(), (alg, kw)


def test_rnnt_cpu_argmax_helper_follows_numpy_on_nan():
    from readerlib.rnnt import _rnnt_cpu
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 37))
    a[rng.random(a.shape) < 0.05] = np.nan
    a[3] = np.nan
    a[4, :] = -np.inf
    a[5, 7] = np.inf
    labels = np.empty(64, np.int64)
    logp = np.empty(64)
    _rnnt_cpu.argmax_logsoftmax(a, labels, logp, 1)
    assert labels.tolist() == np.argmax(a, axis=1).tolist()


@pytest.mark.gpu
@pytest.mark.cuda_emu
@pytest.mark.parametrize("alg", ["loop_labels", "loop_frames"])
def test_rnnt_gpu_nan_rule_matches_cpu(xp_gpu, alg):
    """The CUDA kernels' block argmax follows the same rule (run on the emulator
    without a GPU): a NaN logit wins, the first NaN among several."""
    from readerlib.rnnt import rnnt_greedy_decode
    model = _rnnt_nan_model()
    model.joint._out_b[4] = np.nan
    model.joint._out_b[6] = np.nan
    x = np.random.default_rng(3).standard_normal((3, 5, 6))
    lengths = np.array([5, 2, 4])
    ref = rnnt_greedy_decode(model, x, lengths, 2, "single", False)
    gmodel = model.to(xp_gpu)
    out = rnnt_greedy_decode(gmodel, xp_gpu.asarray(x), xp_gpu.asarray(lengths), 2, alg, False)
    for a, b in zip(ref, out):
        assert a.y_sequence.tolist() == b.y_sequence.tolist() == [4] * len(a.y_sequence)
        assert len(a.y_sequence) > 0


# ------------------------------------------- hypothesis over kernel arguments
from hypothesis import given, settings, strategies as st, HealthCheck  # noqa: E402

from readerlib.kernels import reference as kref  # noqa: E402


def _logits(draw, T, B, C):
    x = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, np.nan, np.inf, -np.inf]),
                      min_size=T * B * C, max_size=T * B * C))
    return np.array(x, np.float32).reshape(T, B, C)


@st.composite
def ctc_cases(draw):
    T, B, C = draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    x = _logits(draw, T, B, C)
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint32, np.uint64, np.int16]))
    info = np.iinfo(dtype)
    lens = draw(st.lists(st.one_of(st.integers(max(-3, int(info.min)), T + 1),
                                   st.sampled_from([int(info.min), int(info.max)])),
                         min_size=B, max_size=B))
    return x, np.array(lens, dtype), draw(st.booleans()), draw(st.sampled_from([None, 0, -1]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ctc_cases())
def test_ctc_hypothesis_against_reference(case):
    """Hostile lengths (negative, huge, every integer dtype's extremes) and
    NaN/inf logits: the kernel equals the NumPy reference, or both raise."""
    from readerlib.kernels import ctc_greedy_decoder, FailedPreconditionError
    x, lens, merge, blank = case
    as_int = [int(v) for v in lens]                  # exact values, no cast
    if any(v > x.shape[0] for v in as_int):
        with pytest.raises(FailedPreconditionError):
            ctc_greedy_decoder(x, lens, merge, blank)
        return
    ind, val, shape, rneg = kref.ctc_greedy_decoder_reference(x, as_int, merge, blank)
    (sp,), neg = ctc_greedy_decoder(x, lens, merge, blank)
    assert sp.indices.tolist() == ind.tolist() and sp.values.tolist() == val.tolist()
    assert sp.dense_shape.tolist() == shape.tolist()
    np.testing.assert_array_equal(np.isnan(neg), np.isnan(rneg))


@st.composite
def reindex_cases(draw):
    n = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint32, np.uint64, np.uint8]))
    info = np.iinfo(dtype)
    idx = draw(st.lists(st.one_of(st.integers(max(-2, int(info.min)), n + 1),
                                  st.sampled_from([int(info.min), int(info.max)])), max_size=8))
    return n, np.array(idx, dtype) if idx else np.zeros(0, dtype)


@settings(max_examples=100, deadline=None)
@given(reindex_cases())
def test_reindex_hypothesis_against_reference(case):
    from readerlib.kernels import batch_reindex, batch_reindex_grad
    n, idx = case
    x = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    ok = bool(np.all((idx.astype(object) >= 0) & (idx.astype(object) < n)))
    if not ok:
        with pytest.raises(IndexError):
            batch_reindex(x, idx)
        with pytest.raises(IndexError):
            batch_reindex_grad(np.ones((len(idx), 3)), idx, n)
        t = rl.LoDTensor.from_sequences([np.ones((i % 3, 3)) for i in range(n)])
        with pytest.raises(IndexError):
            batch_reindex(t, idx)
        return
    i64 = idx.astype(np.int64)
    np.testing.assert_array_equal(batch_reindex(x, idx), kref.batch_reindex_reference(x, i64))
    np.testing.assert_array_equal(batch_reindex_grad(np.ones((len(idx), 3)), idx, n),
                                  kref.batch_reindex_grad_reference(np.ones((len(idx), 3)), i64, n))
    t = rl.LoDTensor.from_sequences([np.full((i % 3, 3), float(i)) for i in range(n)])
    got, want = batch_reindex(t, idx), kref.batch_reindex_lod_reference(t, i64)
    np.testing.assert_array_equal(got.data, want.data)
    assert [l.tolist() for l in got.lod] == [l.tolist() for l in want.lod]


def test_ctc_nan_rule_is_tensorflows():
    """tf.nn.ctc_greedy_decoder's RowMax: a NaN wins only as a frame's first
    logit.  Compared with TensorFlow itself when it is installed."""
    tf = pytest.importorskip("tensorflow")
    from readerlib.kernels import ctc_greedy_decoder
    rng = np.random.default_rng(7)
    for _ in range(20):
        x = rng.standard_normal((6, 3, 5)).astype(np.float32)
        x[rng.random(x.shape) < 0.2] = np.nan
        lens = np.array([6, 4, 2], np.int32)
        (sp,), _ = ctc_greedy_decoder(x, lens)
        (tsp,), _ = tf.nn.ctc_greedy_decoder(x, lens)
        assert sp.indices.tolist() == tsp.indices.numpy().tolist()
        assert sp.values.tolist() == tsp.values.numpy().tolist()


@pytest.mark.gpu
@pytest.mark.cuda_emu
def test_ctc_gpu_nan_rule_matches_cpu(xp_gpu):
    from readerlib.kernels import ctc_greedy_decoder
    rng = np.random.default_rng(8)
    x = rng.standard_normal((7, 4, 40)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = np.nan
    x[:, 1, 0] = np.nan
    lens = np.array([7, 5, 0, 3], np.int32)
    (sp,), neg = ctc_greedy_decoder(x, lens)
    (gsp,), gneg = ctc_greedy_decoder(xp_gpu.asarray(x), xp_gpu.asarray(lens))
    assert sp.values.tolist() == np.asarray(gsp.values.get() if hasattr(gsp.values, "get")
                                            else gsp.values).tolist()


def test_big_records_read_one_block_each_survive_every_chain(tmp_path):
    """Page-aligned chunks hand out one block per record, released by the
    reader at its next call: consumers on other threads (prefetch,
    open_files workers) and buffers (shuffle) must still see each record."""
    x = np.random.default_rng(0).integers(0, 256, size=(120, 70_000), dtype=np.uint8)
    paths = []
    for k in range(3):
        p = str(tmp_path / f"big{k}.rio")
        with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (70_000,))])) as w:
            w.write_batch({"x": x[k * 40:(k + 1) * 40]})
        paths.append(p)
    assert rl.RecordIOReader(paths[0]).chunk_table()[1].sum() == 40
    want = sorted(r.tobytes() for r in x)
    for low in (True, False):
        chains = [rl.RecordIOReader(paths[0], low_memory=low).prefetch(4).batch(7),
                  rl.open_files(paths, num_threads=2).batch(5),
                  rl.open_files(paths, num_threads=2).shuffle(50, seed=1).prefetch(2).batch(9)]
        for i, chain in enumerate(chains):
            got = sorted(row.tobytes() for (b,) in chain for row in np.asarray(b))
            assert got == (sorted(r.tobytes() for r in x[:40]) if i == 0 else want)
