"""Fault injection for readers and decorators: errors mid-chain, Ctrl-C, close().

1. Every error position.  A PythonReader source raises at item k (for every
   k of a small source), under each decorator and chains of them; the test
   catches the error and reads on.  The oracle is the same chain over the
   same source *without* item k: a chain that survives an error must give
   exactly what the oracle gives (same items, same order, same batch
   boundaries -- so exactly once, nothing lost but the failed item, nothing
   repeated), every instance bit-identical to the source's instance of its
   id (no garbage), and a following epoch identical to the oracle's.
   Prefetchers and open_files end their run at an error and raise it again
   on every later read until reset() (a clear error): what they gave before
   it must be a prefix of the oracle's output (for plain open_files, every
   record before the failed one), and after reset() the next epoch is whole.
2. Ctrl-C and close() from another thread at every blocking point (a
   prefetcher's queue, open_files' queues, a slow PythonReader source; each
   both stalled and slow-but-steady) must return within 1 s, and reading on
   after a Ctrl-C loses nothing.

Everything that could crash (the use-after-free this suite was written for)
or hang runs in a child interpreter with a time limit; the child reports
what it read as JSON and the assertions are made here.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

import readerlib as rl

from helpers import canon

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(os.path.dirname(HERE), "support")     # helpers.py, for child interpreters

# ------------------------------------------------------------------ sources
FIXED = rl.Schema([rl.Field("id", "int64"), rl.Field("v", "float32", (2,))])
SEQ = rl.Schema([rl.Field("id", "int64"), rl.Field("s", "float32", (3,), lod_level=1)])
BIG = rl.Schema([rl.Field("x", "uint8", (32768,))])       # BatchReader's parallel-copy path
SCHEMAS = {"fixed": FIXED, "seq": SEQ, "big": BIG}


def instance(kind, i):
    """Item i of a source of this kind: every byte depends on i."""
    if kind == "fixed":
        return (np.int64(i), np.array([i * 0.5, -i], np.float32))
    if kind == "seq":
        return (np.int64(i), (i + np.arange((i % 4) * 3, dtype=np.float32)).reshape(-1, 3))
    x = np.full(32768, i % 251, np.uint8)
    x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return (x,)


def instance_id(kind, inst):
    return int(np.asarray(inst[0])[:8].view(np.int64)[0]) if kind == "big" else int(inst[0])


class FaultySource:
    """Items 0..n-1; at item k it raises instead (once), or skips it (the oracle)."""

    def __init__(self, kind, n, k, skip=False, ids=None):
        self.kind, self.k, self.skip = kind, k, skip
        self.ids = list(range(n)) if ids is None else ids
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self.pos >= len(self.ids):
                raise StopIteration
            i = self.ids[self.pos]
            self.pos += 1
            if self.pos - 1 == self.k:
                if self.skip:
                    continue
                raise RuntimeError(f"injected fault at item {i}")
            return instance(self.kind, i)


def source(kind, n, k, skip):
    """A PythonReader whose *first* iterator fails (or, for the oracle, skips)
    at item k; later iterators (next pass, next epoch) are whole."""
    first = [True]

    def make():
        kk = k if first[0] else -1
        first[0] = False
        return FaultySource(kind, n, kk, skip)
    return rl.PythonReader(make, SCHEMAS[kind])


# ------------------------------------------------------------------- chains
N = 23           # items of a PythonReader source (odd: no batch size divides it)
N_BIG = 11       # 32 KiB items: fewer, to keep the suite fast
FILES, PER_FILE = 3, 8

# name -> (kind, chain over a source, sticky: the chain raises on every read after an error)
CHAINS = {
    "shuffle16": ("fixed", lambda r: r.shuffle(16, seed=3), False),
    "shuffle4-seq": ("seq", lambda r: r.shuffle(4, seed=3), False),
    "batch4": ("fixed", lambda r: r.batch(4), False),
    "batch4-drop-last": ("fixed", lambda r: r.batch(4, drop_last=True), False),
    "batch5-seq": ("seq", lambda r: r.batch(5), False),
    "batch3-parallel-copy": ("big", lambda r: r.batch(3), False),
    "multi-pass": ("fixed", lambda r: r.multi_pass(2), False),
    "shard": ("fixed", lambda r: r.shard(3, 1), False),
    "holder": ("seq", lambda r: rl.ReaderHolder(r), False),
    "shuffle-batch": ("seq", lambda r: r.shuffle(8, seed=5).batch(3), False),
    "shard-shuffle-batch": ("fixed", lambda r: r.shard(2, 0).shuffle(8, seed=5).batch(3), False),
    "multipass-shuffle-batch": ("seq", lambda r: r.multi_pass(2).shuffle(8, seed=1).batch(3, drop_last=True),
                                False),
    "batch-shuffle": ("fixed", lambda r: r.batch(2).shuffle(4, seed=9), False),
    "prefetch": ("fixed", lambda r: r.prefetch(2), False),
    "prefetch-below-shuffle-batch": ("seq", lambda r: r.prefetch(2).shuffle(8, seed=2).batch(3), False),
    "shuffle-batch-prefetch": ("fixed", lambda r: r.shuffle(8, seed=2).batch(3).prefetch(2), False),
    "open-files": ("fixed", None, True),
    "open-files-shuffle-batch": ("seq", lambda r: r.shuffle(8, seed=4).batch(3), True),
}


def _flatten(kind, item):
    """Instances of an item (a batch is split), as tuples of arrays."""
    if isinstance(item[0], rl.LoDTensor):
        from helpers import unbatch
        return unbatch(item)
    return [item]


def _summarise(kind, item, bad):
    """The ids of an item's instances; counts instances that differ from their id's."""
    ids = []
    for inst in _flatten(kind, item):
        i = instance_id(kind, inst)
        if canon(inst) != canon(instance(kind, i)):
            bad[0] += 1
        ids.append(i)
    return ids


def _read_on(kind, r, max_errors):
    """read_next() to the end of the epoch, catching errors: (items as id lists, error messages, bad)."""
    items, errors, bad = [], [], [0]
    while True:
        try:
            item = r.read_next()
        except RuntimeError as e:
            errors.append(str(e))
            if len(errors) > max_errors:
                break
            continue
        if item is None:
            break
        items.append(_summarise(kind, item, bad))
    return items, errors, bad[0]


def _drain(kind, r):
    items, errors, bad = _read_on(kind, r, 0)
    assert not errors and not bad, (errors, bad)
    return items


def _open_files_case(kind, d, k, skip, chain):
    """open_files over FILES Python-read files; the first read of item k fails (or is skipped)."""
    from readerlib.readers.files import open_files, register_file_reader
    first = [True]

    def factory(path, schema=None):
        f = int(os.path.basename(path).split(".")[0][1:])
        ids = list(range(f * PER_FILE, (f + 1) * PER_FILE))

        def make():
            kk = -1
            if first[0] and k // PER_FILE == f:
                first[0] = False
                kk = k % PER_FILE
            return FaultySource(kind, 0, kk, skip, ids=ids)
        return rl.PythonReader(make, SCHEMAS[kind])

    suffix = ".oracle" if skip else ".faulty"      # each chain keeps its own factory
    register_file_reader(suffix, factory, replace=True)
    paths = []
    for f in range(FILES):
        p = os.path.join(d, f"f{f}{suffix}")
        open(p, "w").close()
        paths.append(p)
    r = open_files(paths, num_threads=2)
    return chain(r) if chain is not None else r


def force_parallel_copies():
    """Make BatchReader copy big fixed records on threads even for small batches."""
    from readerlib._parallel import set_num_threads
    set_num_threads(2)
    try:                              # a build whose thread pool splits by bytes
        from readerlib._parallel import _set_min_bytes_per_thread
    except ImportError:
        return
    _set_min_bytes_per_thread(1)


def _positions(name):
    if name.startswith("open-files"):
        return FILES * PER_FILE
    return N_BIG if CHAINS[name][0] == "big" else N


def child_error_positions(name):
    """Run in a child: every error position for chain `name`; print JSON per position."""
    kind, chain, sticky = CHAINS[name]
    if kind == "big":
        force_parallel_copies()
    d = tempfile.mkdtemp()
    n = _positions(name)
    out = []
    for k in range(n):
        if name.startswith("open-files"):
            real = _open_files_case(kind, d, k, False, chain)
            oracle = _open_files_case(kind, d, k, True, chain)
        else:
            real = chain(source(kind, n, k, False))
            oracle = chain(source(kind, n, k, True))
        items, errors, bad = _read_on(kind, real, 3 if sticky else 5)
        want = _drain(kind, oracle)
        real.reset()
        oracle.reset()
        out.append({"k": k, "items": items, "errors": errors, "bad": bad, "oracle": want,
                    "next_epoch": _drain(kind, real), "oracle_next_epoch": _drain(kind, oracle)})
        real.close()
        oracle.close()
    shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(out))


def _child_env():
    where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([where, HERE, SUPPORT, os.environ.get("PYTHONPATH", "")]))


def _run_child(code, timeout):
    p = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=_child_env(), cwd=tempfile.gettempdir())
    assert p.returncode == 0, f"child exited with {p.returncode} (a crash is < 0):\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.mark.parametrize("name", list(CHAINS))
def test_every_error_position_then_read_on(name):
    kind, _, sticky = CHAINS[name]
    out = json.loads(_run_child(f"import test_faults_readers as t; t.child_error_positions({name!r})",
                                timeout=120).splitlines()[-1])
    n = _positions(name)
    assert [c["k"] for c in out] == list(range(n))
    for c in out:
        k, items, errors, want = c["k"], c["items"], c["errors"], c["oracle"]
        where = f"{name}, error at item {k}"
        assert c["bad"] == 0, f"{where}: {c['bad']} delivered instances are not the source's (garbage)"
        assert errors, f"{where}: the injected error never surfaced"
        assert all(e.startswith(f"injected fault at item {k}") for e in errors), (where, errors)
        if sticky:
            # a clear error: raised again on every later read until reset()
            assert len(errors) == 4, (where, errors)
            assert items == want[:len(items)], f"{where}: what came before the error is not the oracle's"
            if name == "open-files":
                assert sum(items, []) == list(range(k)), f"{where}: records before the error lost"
        else:
            assert len(errors) == 1, (where, errors)
            assert items == want, f"{where}: reading on after the error differs from the chain " \
                                  f"over the source without item {k}"
            if name in ("shuffle16", "shuffle4-seq", "batch4", "batch5-seq", "batch3-parallel-copy",
                        "holder", "shuffle-batch", "batch-shuffle"):
                # exactly once, whatever the oracle says
                assert sorted(sum(items, [])) == [i for i in range(n) if i != k], where
        assert c["next_epoch"] == c["oracle_next_epoch"], f"{where}: the next epoch differs"
        assert sorted(sum(c["next_epoch"], [])) == sorted(sum(c["oracle_next_epoch"], []))


def test_oracle_sanity():
    """The oracle itself: a chain over the source without item k gives every other item once."""
    for k in (0, 7, N - 1):
        items = _drain("seq", source("seq", N, k, True).shuffle(8, seed=5).batch(3))
        assert sorted(sum(items, [])) == [i for i in range(N) if i != k]


# ------------------------------------------------- a corrupt chunk under shuffle
def test_recordio_bad_chunk_under_shuffle_and_batch_read_on(tmp_path):
    """The issue's scenario: catch RecordIOError, log, continue -- under a shuffle.

    The bad chunk's records are lost, every other record comes out once and
    intact (on the old code: pointer-like garbage ids or 'malformed record').
    """
    path = str(tmp_path / "one-bad-chunk.rio")
    with rl.RecordIOWriter(path, SEQ, chunk_size=256) as w:
        for i in range(300):
            w.write(instance("seq", i))
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    r.close()
    bad_chunk = len(offs) // 2
    lost = set(range(int(nrec[:bad_chunk].sum()), int(nrec[:bad_chunk + 1].sum())))
    with open(path, "r+b") as f:                  # one byte of the chunk's body
        f.seek(int(offs[bad_chunk]) + 40)
        b = f.read(1)
        f.seek(int(offs[bad_chunk]) + 40)
        f.write(bytes([b[0] ^ 0x5A]))
    code = f"""
    import json, readerlib as rl
    import test_faults_readers as t
    for chain in (lambda r: r.shuffle(16, seed=0), lambda r: r.shuffle(64, seed=1).batch(5),
                  lambda r: r.batch(4)):
        reader = chain(rl.RecordIOReader({path!r}))
        items, errors, bad = [], [], [0]
        while True:
            try:
                item = reader.read_next()
            except rl.RecordIOError as e:
                errors.append(str(e))
                continue
            if item is None:
                break
            items.append(t._summarise("seq", item, bad))
        print(json.dumps({{"ids": sum(items, []), "errors": errors, "bad": bad[0]}}))
    """
    for line in _run_child(code, timeout=60).splitlines():
        c = json.loads(line)
        assert c["bad"] == 0
        assert len(c["errors"]) == 1 and "one-bad-chunk.rio" in c["errors"][0]
        assert sorted(c["ids"]) == sorted(set(range(300)) - lost)


def test_tfrecord_bad_record_under_shuffle_and_batch_read_on(tmp_path):
    """A TFRecord record that fails its CRC, under shuffle and batch: one error
    (the rest of that 1 MiB chunk is dropped), then the following chunks; nothing
    repeated, nothing that is not a record."""
    from readerlib.formats._tfrecord import CHUNK_BYTES, TFRecordWriter
    path = str(tmp_path / "one-bad-record.tfrecord")
    size = 4096
    n, bad = 4 * CHUNK_BYTES // size, CHUNK_BYTES // size + 40     # a record of the second chunk

    def record(i):
        x = np.full(size, i % 251, np.uint8)
        x[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
        return x
    with TFRecordWriter(path) as w:
        for i in range(n):
            w.write(record(i))
    with open(path, "r+b") as f:                  # per record: 12 bytes of header, the data, a 4-byte CRC
        f.seek((size + 16) * bad + 12 + 100)
        f.write(b"\xff")
    code = f"""
    import json, numpy as np, readerlib as rl
    from readerlib.formats._tfrecord import TFRecordReader
    for chain in (lambda r: r.shuffle(16, seed=0), lambda r: r.shuffle(32, seed=1).batch(5),
                  lambda r: r.batch(4)):
        reader = chain(TFRecordReader({path!r}))
        ids, errors = [], []
        while True:
            try:
                item = reader.read_next()
            except rl.DataLossError as e:
                errors.append(str(e))
                continue
            if item is None:
                break
            t = item[0]
            if isinstance(t, rl.LoDTensor):
                off = np.asarray(t.lod[0])
                recs = [np.asarray(t.data[off[i]:off[i + 1]]) for i in range(len(off) - 1)]
            else:
                recs = [np.asarray(t)]
            for x in recs:
                i = int(x[:8].view(np.int64)[0]) if x.size == {size} else -1
                ok = i >= 0 and bool(np.all(x[8:] == i % 251))
                ids.append(i if ok else -1)
        print(json.dumps({{"ids": ids, "errors": errors}}))
    """
    for line in _run_child(code, timeout=60).splitlines():
        c = json.loads(line)
        ids = c["ids"]
        assert len(c["errors"]) == 1 and "one-bad-record.tfrecord" in c["errors"][0], c["errors"]
        assert len(ids) == len(set(ids)) and set(ids) <= set(range(n)) - {bad}, "repeated or invented"
        assert set(range(bad)) <= set(ids) and n - 1 in ids, "records before or after the bad one lost"


# ---------------------------------------------------- Ctrl-C and close()
PRELUDE = """
import atexit, os, shutil, signal, sys, tempfile, threading, time
import numpy as np
import readerlib as rl
from readerlib.readers.files import open_files, register_file_reader
# a background job inherits SIGINT ignored, and Python then installs no handler
signal.signal(signal.SIGINT, signal.default_int_handler)
X = rl.Schema([rl.Field("x", "int64")])
B = rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])
events = {}

def stalled():                       # one item, then a user function that does not return
    try:
        yield np.int64(0)
        time.sleep(float(os.environ.get("STALL_S", "600")))
        yield np.int64(1)
    finally:
        events["source closed"] = time.monotonic()

def steady(n=10**9, every=0.05):     # an item every 50 ms
    for i in range(n):
        time.sleep(every)
        yield np.int64(i)

def as_bytes(gen):
    def make():
        return (np.frombuffer(np.int64(x).tobytes(), np.uint8) for x in gen())
    return make

def files_of(make):
    register_file_reader(".slow", lambda path, schema=None: rl.PythonReader(as_bytes(make), B), replace=True)
    d = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, d, True)
    p = os.path.join(d, "a.slow")
    open(p, "w").close()
    return open_files([p], num_threads=1)

CHAINS = {
    "prefetch-queue-stalled": lambda: rl.PythonReader(stalled, X).prefetch(2),
    "prefetch-queue-steady": lambda: rl.PythonReader(steady, X).prefetch(1).batch(10**6),
    "open_files-queue-stalled": lambda: files_of(stalled),
    "open_files-queue-steady": lambda: files_of(steady).batch(10**6),
    "python-source-stalled": lambda: rl.PythonReader(stalled, X),
    "python-source-steady": lambda: rl.PythonReader(steady, X).batch(10**6),
}
# read the one item first, so that the next read blocks in the stall (open_files
# hands records over by packets: there the first read already waits on the queue)
PREREAD = {"prefetch-queue-stalled", "python-source-stalled"}
"""

BLOCKING = ["prefetch-queue-stalled", "prefetch-queue-steady", "open_files-queue-stalled",
            "open_files-queue-steady", "python-source-stalled", "python-source-steady"]


def _child_lines(code, timeout=60):
    out = _run_child(PRELUDE + textwrap.dedent(code), timeout=timeout)
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.mark.parametrize("point", BLOCKING)
def test_ctrl_c_at_every_blocking_point_within_one_second(point):
    res = _child_lines(f"""
    r = CHAINS[{point!r}]()
    if {point!r} in PREREAD:
        r.read_next()                    # the one item: the next read blocks
    sent = []
    def interrupt():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)
    threading.Timer(0.5, interrupt).start()
    try:
        r.read_next()
        print("result=returned")
    except KeyboardInterrupt:
        print("result=KeyboardInterrupt")
        print("latency=%.3f" % (time.monotonic() - sent[0]))
    t0 = time.monotonic()
    r.close()
    print("close=%.3f" % (time.monotonic() - t0))
    """)
    assert res["result"] == "KeyboardInterrupt", res
    assert float(res["latency"]) < 1.0, res
    assert float(res["close"]) < 1.0, res


@pytest.mark.parametrize("point", BLOCKING)
def test_close_from_another_thread_at_every_blocking_point_within_one_second(point):
    res = _child_lines(f"""
    r = CHAINS[{point!r}]()
    if {point!r} in PREREAD:
        r.read_next()
    done = {{}}
    def read():
        try:
            item = r.read_next()
            done["read"] = "None" if item is None else "item"
        except BaseException as e:
            done["read"] = type(e).__name__
        done["t"] = time.monotonic()
    th = threading.Thread(target=read, daemon=True)
    th.start()
    time.sleep(0.5)                      # the read is now blocked
    t0 = time.monotonic()
    r.close()
    print("close=%.3f" % (time.monotonic() - t0))
    print("closed=%s" % r.closed)
    th.join(1.0)
    if "t" in done:
        print("read=%s" % done["read"])
        print("read_after_close=%.3f" % (done["t"] - t0))
    try:
        r.read_next()
        print("again=returned")
    except ValueError as e:
        print("again=%s" % ("closed" if "closed reader" in str(e) else e))
    """)
    assert float(res["close"]) < 1.0, res
    assert res["closed"] == "True" and res["again"] == "closed", res
    if point != "python-source-stalled":
        # a read waiting on a queue or a steady source returns: the end of the
        # stream, or the partial batch read so far; never an exception or a hang
        assert res["read"] in ("None", "item"), res
        assert float(res["read_after_close"]) < 1.0, res
    # (a read inside the user's own function returns when that function does)


def test_close_while_a_user_function_runs_in_the_reading_thread_closes_the_chain_after_it():
    res = _child_lines("""
    os.environ["STALL_S"] = "1.5"
    r = rl.PythonReader(stalled, X)
    r.read_next()
    got = {}
    def read():
        got["item"] = int(r.read_next()[0])       # inside sleep(1.5), then item 1
        got["t"] = time.monotonic()
    th = threading.Thread(target=read)
    th.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r.close()
    print("close=%.3f" % (time.monotonic() - t0))
    th.join(10)
    print("item=%d" % got["item"])
    # the read that was running closed the chain on its way out: the source is gone
    print("source_closed_after_read=%s" % (events.get("source closed", 1e9) <= time.monotonic()))
    """)
    assert float(res["close"]) < 1.0, res
    assert res["item"] == "1" and res["source_closed_after_read"] == "True", res


@pytest.mark.parametrize("point", ["prefetch-queue-steady", "open_files-queue-steady"])
def test_reading_on_after_ctrl_c_loses_nothing(point):
    res = _child_lines(f"""
    def steady30():
        return steady(30, 0.03)
    if {point!r}.startswith("prefetch"):
        r = rl.PythonReader(steady30, X).prefetch(1).batch(10**6)
    else:
        r = files_of(steady30).batch(10**6)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    interrupts = 0
    while True:
        try:
            b = r.read_next()
            break
        except KeyboardInterrupt:
            interrupts += 1
    data = np.asarray(b[0].data)
    ids = data.view(np.int64).reshape(-1).tolist() if data.dtype == np.uint8 else data.reshape(-1).tolist()
    print("interrupts=%d" % interrupts)
    print("ids=%s" % ids)
    print("end=%s" % (r.read_next() is None))
    r.close()
    """)
    assert res["interrupts"] == "1", res
    assert res["ids"] == str(list(range(30))), res
    assert res["end"] == "True"


# ------------------------------------------- what an interrupted batch holds
@pytest.mark.parametrize("schema_kind", ["seq", "big"])
def test_close_after_an_error_mid_batch_unmaps_the_file(tmp_path, schema_kind):
    """A batch interrupted by a bad chunk holds the earlier chunk's records
    (views of the file's blocks); close() must let them go (they leaked, and
    the file stayed mapped, when readers mapped files; now the blocks are
    counted and the reader's descriptor must be closed)."""
    path = str(tmp_path / f"mid-batch-{schema_kind}.rio")
    n = 40 if schema_kind == "seq" else 12
    with rl.RecordIOWriter(path, SCHEMAS[schema_kind], chunk_size=300 if schema_kind == "seq" else 70000) as w:
        for i in range(n):
            w.write(instance(schema_kind, i))
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    r.close()
    assert len(offs) >= 3
    with open(path, "r+b") as f:                  # the second chunk's body
        f.seek(int(offs[1]) + 40)
        b = f.read(1)
        f.seek(int(offs[1]) + 40)
        f.write(bytes([b[0] ^ 0xFF]))
    code = f"""
    import readerlib as rl
    import test_faults_readers as t
    t.force_parallel_copies()
    import os
    from readerlib.formats._recordio import _live_file_blocks
    def held():        # the file's mappings and descriptors, and live file blocks
        maps = sum(1 for line in open("/proc/self/maps") if {path!r} in line)
        fds = sum(1 for fd in os.listdir("/proc/self/fd")
                  if os.path.realpath("/proc/self/fd/" + fd) == {path!r})
        return maps, fds, _live_file_blocks()
    chain = rl.RecordIOReader({path!r}).batch({n})          # the error comes mid-batch
    try:
        chain.read_next()
        print("error=none")
    except rl.RecordIOError:
        print("error=raised")
    print("before_close=%d,%d,%d" % held())
    chain.close()
    print("after_close=%d,%d,%d" % held())
    """
    res = dict(l.split("=") for l in _run_child(code, timeout=60).split())
    maps, fds, blocks = map(int, res["before_close"].split(","))
    assert res["error"] == "raised" and maps + fds >= 1 and blocks >= 1, res
    assert res["after_close"] == "0,0,0", res
