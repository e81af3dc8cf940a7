"""Shared helpers for the core tests: drain a chain, canonical values, exactly-once checks.

Instances are compared through a canonical, hashable form (dtype, shape,
bytes per field) so that a multiset of delivered instances can be compared
with the multiset that went in, bit for bit.
"""
import collections
import json
import os
import warnings

import numpy as np

import readerlib as rl


def canon_value(a):
    """(dtype, shape, bytes) of one field value: equal iff the arrays are bitwise equal."""
    a = np.asarray(a)
    return (a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())


def canon(instance):
    """Hashable form of an instance (a tuple of per-field values)."""
    return tuple(canon_value(v) for v in instance)


def unbatch(batch):
    """Split a batch (tuple of LoDTensor) back into instances (tuples of arrays).

    Fixed fields: row i of ``data``; sequence fields: rows ``lod[0][i]:lod[0][i+1]``.
    Checks the batch's own invariants on the way (offsets well formed, every
    field holds the same number of instances).
    """
    assert isinstance(batch, tuple), type(batch)
    ns = set()
    for t in batch:
        assert isinstance(t, rl.LoDTensor), type(t)
        if t.lod:
            off = np.asarray(t.lod[0])
            assert off.dtype == np.int64
            assert off[0] == 0 and off[-1] == t.data.shape[0]
            assert np.all(np.diff(off) >= 0)
            ns.add(len(off) - 1)
        else:
            ns.add(t.data.shape[0])
    assert len(ns) == 1, f"fields of one batch disagree on the batch size: {ns}"
    n = ns.pop()
    out = []
    for i in range(n):
        inst = []
        for t in batch:
            if t.lod:
                off = t.lod[0]
                inst.append(np.asarray(t.data[int(off[i]):int(off[i + 1])]))
            else:
                inst.append(np.asarray(t.data[i]))
        out.append(tuple(inst))
    return out


def drain(reader, max_items=10_000_000):
    """Read the rest of the current epoch with ``read_next()``: a list of items.

    Items are returned as they come (instance tuples of arrays, or batches);
    arrays are copied so that later reads cannot change them.
    """
    items = []
    while True:
        item = reader.read_next()
        if item is None:
            return items
        if isinstance(item[0], rl.LoDTensor):
            item = tuple(rl.LoDTensor(np.array(t.data), [np.array(l) for l in t.lod]) for t in item)
        else:
            item = tuple(np.array(v) for v in item)
        items.append(item)
        assert len(items) <= max_items, "reader does not end"


def snapshot_item(item):
    """A deep copy of an item (batch or instance) that outlives the reader:
    [(values, [lod arrays])] per field."""
    out = []
    for v in item:
        if isinstance(v, rl.LoDTensor):
            out.append((np.array(v.data), [np.array(x) for x in v.lod]))
        else:
            out.append((np.array(v), []))
    return out


def assert_same_items(a, b):
    """Two lists of snapshot_item()s are equal: dtypes, shapes, values, LoD."""
    assert len(a) == len(b)
    for ia, ib in zip(a, b):
        assert len(ia) == len(ib)
        for (da, la), (db, lb) in zip(ia, ib):
            assert da.dtype == db.dtype and da.shape == db.shape
            np.testing.assert_array_equal(da, db)
            assert len(la) == len(lb)
            for x, y in zip(la, lb):
                np.testing.assert_array_equal(x, y)


def read_events(chain, decode, save=True, limit=12):
    """(events, states, errors) of the rest of the epoch, reading on past
    DataLossErrors: events[k] is what read k gave (decode(item), or "err"),
    states[k] get_state() before it, through JSON (or the RuntimeError it
    raised); stops after more than `limit` errors (a stuck reader)."""
    import json
    events, states, errors = [], [], []
    while True:
        if save:
            try:
                states.append(json.loads(json.dumps(chain.get_state())))
            except RuntimeError as e:
                states.append(e)
        try:
            item = chain.read_next()
        except rl.DataLossError as e:
            events.append("err")
            errors.append(e)
            if len(errors) > limit:
                return events, states, errors
            continue
        if item is None:
            return events, states, errors
        events.append(decode(item))


def read_past_errors(reader, convert=lambda item: item, errors=rl.RecordIOError, max_errors=None):
    """Read the rest of the epoch with ``read_next()``, going on after each
    `errors` exception (the reader's "reading on loses only what failed").
    Returns (the items, each through `convert` as it comes; the exceptions).
    With `max_errors`, stops after that many more than it (a reader that
    would fail forever)."""
    items, seen = [], []
    while True:
        try:
            item = reader.read_next()
        except errors as e:
            seen.append(e)
            if max_errors is not None and len(seen) > max_errors:
                return items, seen
            continue
        if item is None:
            return items, seen
        items.append(convert(item))


def assert_resumes_past_errors(make, errors=KeyError, value=lambda x: int(x[0]), check=None):
    """One pass of make() read with read_next(), going on past `errors` (each
    marked "err" in the sequence where it came), its state saved (through JSON)
    before every read; then each state restored in a fresh make(): the rest of
    the pass is the same sequence, errors in the same places.  `check(k, chain)`
    runs after the restore at read k.  Returns the sequence."""
    def rest_of(c):
        out = []
        while True:
            try:
                x = c.read_next()
            except errors:
                out.append("err")
                continue
            if x is None:
                return out
            out.append(value(x))
    c = make()
    seen, states = [], []
    while True:
        states.append(json.loads(json.dumps(c.get_state())))
        try:
            x = c.read_next()
        except errors:
            seen.append("err")
            continue
        if x is None:
            break
        seen.append(value(x))
    for k, state in enumerate(states):
        other = make()
        other.set_state(state)
        assert rest_of(other) == seen[k:], f"restored at call {k}"
        if check is not None:
            check(k, other)
    return seen


def drain_instances(reader):
    """The rest of the epoch as a flat list of instances (batches split)."""
    out = []
    for item in drain(reader):
        if isinstance(item[0], rl.LoDTensor):
            out.extend(unbatch(item))
        else:
            out.append(item)
    return out


def drain_canon(reader):
    """The rest of the epoch as a list of canonical instances, in delivery order."""
    return [canon(i) for i in drain_instances(reader)]


def to_python(reader):
    """The rest of the epoch as plain Python values (lists / scalars), batches split."""
    return [tuple(np.asarray(v).tolist() for v in inst) for inst in drain_instances(reader)]


def assert_same_multiset(got, want, what="delivered instances"):
    """Multisets of canonical instances equal; the message says what is missing or extra."""
    cg, cw = collections.Counter(got), collections.Counter(want)
    if cg != cw:
        missing = cw - cg
        extra = cg - cw
        raise AssertionError(
            f"{what}: {len(got)} delivered, {len(want)} expected; "
            f"{sum(missing.values())} missing, {sum(extra.values())} extra or duplicated")


def assert_exactly_once(got, want):
    """``got`` is a permutation of ``want`` (every instance exactly once)."""
    assert_same_multiset(got, want)


def assert_distinct_subset(got, want):
    """Every delivered instance is one of ``want``, none more often than it occurs there."""
    cg, cw = collections.Counter(got), collections.Counter(want)
    extra = cg - cw
    assert not extra, f"{sum(extra.values())} delivered instances are not in the input (or repeated)"


def split_passes(seq, n):
    """Split a delivered stream into consecutive pieces of ``n`` (the last may be shorter)."""
    if n == 0:
        assert not seq
        return []
    return [seq[i:i + n] for i in range(0, len(seq), n)]


def sequence_schema(dtype="float32", inner=(3,)):
    """id (int64) + a sequence field + a fixed field: enough to tell instances apart."""
    return rl.Schema([rl.Field("id", "int64"),
                      rl.Field("seq", dtype, inner, lod_level=1),
                      rl.Field("fixed", "float32", (2,))])


def make_columns(n, lod=True, seed=0, max_len=5, inner=(3,)):
    """Columns for ``n`` distinct instances: ``(columns dict, schema, canonical instances)``.

    With ``lod`` the schema is :func:`sequence_schema` (lengths 0..max_len,
    empty sequences included); without it, an id plus a fixed float field.
    """
    rng = np.random.default_rng(seed)
    ids = np.arange(n, dtype=np.int64)
    fixed = rng.standard_normal((n, 2)).astype(np.float32)
    if lod:
        schema = sequence_schema(inner=inner)
        lengths = rng.integers(0, max_len + 1, size=n)
        seqs = [rng.standard_normal((int(k),) + inner).astype(np.float32) for k in lengths]
        cols = {"id": ids, "seq": seqs, "fixed": fixed}
        inst = [(ids[i], seqs[i], fixed[i]) for i in range(n)]
    else:
        schema = rl.Schema([rl.Field("id", "int64"), rl.Field("fixed", "float32", (2,))])
        cols = {"id": ids, "fixed": fixed}
        inst = [(ids[i], fixed[i]) for i in range(n)]
    return cols, schema, [canon(i) for i in inst]


def array_reader(cols, schema):
    """ArrayReader over ``cols`` (an empty sequence column needs a LoDTensor, not [])."""
    fixed = {}
    for f in schema:
        v = cols[f.name]
        if f.lod_level and isinstance(v, list) and not v:
            v = rl.LoDTensor(np.zeros((0,) + f.shape, f.dtype), [np.zeros(1, np.int64)])
        fixed[f.name] = v
    return rl.ArrayReader(fixed, schema=schema)


def write_recordio(path, cols, schema, **kw):
    """Write ``cols`` instance by instance; returns the path."""
    names = schema.names
    n = len(cols[names[0]])
    with rl.RecordIOWriter(path, schema, **kw) as w:
        for i in range(n):
            w.write(tuple(cols[k][i] for k in names))
    return path


def read_all(path, on_error="raise"):
    """(canonical records, warnings list, reader) for a whole RecordIO file."""
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        r = rl.RecordIOReader(path, on_error=on_error)
        try:
            got = drain_canon(r)
        finally:
            r.close()
    return got, [w for w in ws if issubclass(w.category, rl.RecordIOWarning)], r


def scratch_dir(tmp_path):
    """A directory for many small rewrites: RAM-backed (/dev/shm) when there is one, else tmp_path.

    The corruption tests rewrite a file thousands of times; on this machine's
    disk that costs ~5 ms a write, in /dev/shm ~30 us.
    """
    import pathlib
    import tempfile
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return pathlib.Path(tempfile.mkdtemp(prefix="readerlib-tests-", dir="/dev/shm"))
    return tmp_path


def _scratch(tmp_path):
    """RAM-backed scratch directory (removed afterwards) for tests that rewrite files many times."""
    import shutil
    d = scratch_dir(tmp_path)
    yield d
    if d != tmp_path:
        shutil.rmtree(d, ignore_errors=True)


def _make_scratch_fixture():
    import pytest
    return pytest.fixture(name="scratch")(_scratch)


# the `scratch` fixture: a test module takes it with `from helpers import scratch`
scratch = _make_scratch_fixture()


def assert_checkpoint_equal(make_chain, epochs=2, retry=()):
    """Grain's "equal output after checkpoint", for any chain.

    Runs a chain from `make_chain()` to the end of each epoch, recording
    `get_state()` before every item; then, for every recorded state, a fresh
    chain restored from its JSON round trip must yield exactly the rest of
    that epoch (compared as canonical instances, batch boundaries included).
    A read of the first chain that raises one of `retry` (exception types) is
    retried, as a loop that goes on after an interrupt does; the state taken
    after the failure must restore the same rest.  Returns the first chain's
    items, per epoch.
    """
    import json
    ref = make_chain()
    out = []
    for _ in range(epochs):
        it = iter(ref)
        states, items = [], []
        while True:
            states.append((len(items), json.loads(json.dumps(ref.get_state()))))
            try:
                item = next(it, None)
            except retry:
                continue
            if item is None:
                break
            items.append([canon(i) for i in (unbatch(item) if isinstance(item[0], rl.LoDTensor) else [item])])
        out.append(items)
        for k, state in states:
            other = make_chain()
            other.set_state(state)
            rest = []
            for item in other:
                rest.append([canon(i) for i in (unbatch(item) if isinstance(item[0], rl.LoDTensor) else [item])])
            assert rest == items[k:], f"restored at item {k} of {len(items)}: the rest differs"
            other.close()
    ref.close()
    return out


# -- GPU dispatch contract without a GPU: a stand-in for CuPy arrays and kernels._gpu --

class FakeCupyArray(np.ndarray):
    """is_cupy_array() looks at the type's module; this one claims to be CuPy."""


FakeCupyArray.__module__ = "cupy._fake"


def install_gpu_stub(monkeypatch, **results):
    """Replace readerlib.kernels._gpu by a stub whose function NAME records
    ``(NAME, *args)`` in the returned list and returns ``results[NAME](*args)``;
    NumPy stands in for CuPy."""
    import sys
    import types

    import readerlib.gpu
    import readerlib.kernels

    calls = []
    stub = types.ModuleType("readerlib.kernels._gpu")
    for name, result in results.items():
        def fn(*a, _name=name, _result=result):
            calls.append((_name,) + a)
            return _result(*a)
        setattr(stub, name, fn)
    monkeypatch.setitem(sys.modules, "readerlib.kernels._gpu", stub)
    monkeypatch.setattr(readerlib.kernels, "_gpu", stub, raising=False)
    monkeypatch.setattr(readerlib.gpu, "require_cupy", lambda: np)   # xp = numpy stand-in
    monkeypatch.setitem(sys.modules, "cupy", np)                      # for LoDTensor
    return calls


def random_array(rng, shape, dtype):
    """Random values of any dtype: normal floats, integers over the whole range."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


# --- many small files of byte records (open_files and its random access) ---

BYTES = rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])


def byte_record(k, size=8):
    """Record k: its 8 little-endian bytes, padded with k % 251 up to `size`."""
    b = np.full(max(size, 8), k % 251, np.uint8)
    b[:8] = np.frombuffer(int(k).to_bytes(8, "little"), np.uint8)
    return b


def make_byte_files(d, kinds, sizes, chunk_size=2048, rec_size=8):
    """One file per kind ("rio", "tfrecord", "tfrecord.gz") in folder d, with
    sizes[i] records of the BYTES schema; record k of the stream (the files in
    order) holds k.  Returns (paths, the records' bytes in stream order)."""
    from readerlib.formats._tfrecord import TFRecordWriter
    paths, recs, k = [], [], 0
    for i, (kind, n) in enumerate(zip(kinds, sizes)):
        items = [byte_record(k + j, rec_size) for j in range(n)]
        k += n
        if kind == "rio":
            p = os.path.join(d, f"part-{i:03d}.rio")
            with rl.RecordIOWriter(p, BYTES, chunk_size=chunk_size) as w:
                for x in items:
                    w.write((x,))
        else:
            comp = {"tfrecord": None, "tfrecord.gz": "GZIP"}[kind]
            p = os.path.join(d, f"part-{i:03d}.{kind}")
            with TFRecordWriter(p, compression=comp) as w:
                for x in items:
                    w.write(x)
        paths.append(p)
        recs += [x.tobytes() for x in items]
    return paths, recs


def open_fds():
    """{descriptor: what it points to} of this process, without the
    listing's own descriptor (gone by the time it is read)."""
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[f] = os.readlink("/proc/self/fd/" + f)
        except FileNotFoundError:
            pass
    return out


class InjectedInterrupt(KeyboardInterrupt):
    """The KeyboardInterrupt `interrupt_each_call` injects."""


def call_tracer(k):
    """(tracer, seen): a sys.settrace function that raises InjectedInterrupt(k)
    at the k-th call of a Python function it sees (calls only: see
    interrupt_each_call); seen[0] counts the calls.  The caller sets and
    clears it with sys.settrace itself (a helper's own frame would count)."""
    seen = [0]

    def tracer(frame, event, arg):
        seen[0] += 1
        if seen[0] == k:
            raise InjectedInterrupt(k)
        return None

    return tracer, seen


class AlarmInterrupt:
    """SIGALRM raises KeyboardInterrupt while `on` is set, once (the handler
    clears it): install(), then `AlarmInterrupt.on = True` and
    signal.setitimer(signal.ITIMER_REAL, delay)."""
    on = False

    @classmethod
    def handler(cls, sig, frame):
        if cls.on:
            cls.on = False
            raise KeyboardInterrupt

    @classmethod
    def install(cls):
        import signal
        signal.signal(signal.SIGALRM, cls.handler)


def interrupt_each_call(build, what, settle_s=10):
    """Make `build()` once uninterrupted (the warm-up: imports, first-use
    set-up) and count its items; then call it once for each k = 1, 2, ...
    with an InjectedInterrupt raised at the k-th call of a Python function
    (sys.settrace), until
    build() completes with none left to interrupt.  Each attempt must raise
    the injected exception (or one it caused inside the stdlib's own code:
    threading.Condition.wait interrupted before it took its lock back raises
    "release unlocked lock" on the way out) or make the thing, which is then
    closed; after each, the descriptors must come back to what they were
    (waiting up to `settle_s`: a prefetch thread started before the
    interrupt stops on its own, its reader's dealloc asks it to, and closes
    the chain).

    Calls only: an exception a tracer raises at a *line* event inside an
    except block leaves CPython 3.11's handled-exception state set, and that
    stale traceback keeps the half-made chain alive.  At the end, a chain made
    afresh must give as many items as the warm-up's.  Returns (interrupted
    attempts, that item count)."""
    import gc
    import sys
    import time
    r = build()
    n_items = sum(1 for _ in r)
    r.close()
    del r
    gc.collect()
    before = open_fds()
    k, hits = 1, 0
    while True:
        tracer, seen = call_tracer(k)
        r = None
        sys.settrace(tracer)
        try:
            r = build()
        except BaseException as e:
            c = e
            while c is not None and not isinstance(c, InjectedInterrupt):
                c = c.__context__
            if c is None:
                raise
            hits += 1
            del e, c
        finally:
            sys.settrace(None)
        if r is not None:
            r.close()
            del r
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            now = open_fds()
            if now == before or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert now == before, (what, k, "descriptors left", set(now.items()) - set(before.items()))
        if seen[0] < k:                  # made with no injection: every call tried
            break
        k += 1
    assert hits == k - 1 and hits > 0, (what, hits, k)
    r = build()                          # the thing still works after all that
    n = sum(1 for _ in r)
    r.close()
    assert n == n_items, (what, n, n_items)
    return hits, n_items


SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))


def run_ok_script(code, timeout=240):
    """Run `code` in a fresh interpreter (with conftest's PYTHONPATH: the
    readerlib under test, never the uncompiled source tree) and assert it
    exits 0 having printed OK; a hang fails after `timeout` seconds."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, env=dict(os.environ))
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def corrupt_chunk(path, chunk=None, at=40):
    """Flip one byte `at` bytes into a RecordIO file's chunk (default: the
    chunk two thirds in).  Returns (chunk index, the set of record indices
    that chunk holds)."""
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    r.close()
    bad = len(offs) * 2 // 3 if chunk is None else chunk
    lost = set(range(int(nrec[:bad].sum()), int(nrec[:bad + 1].sum())))
    with open(path, "r+b") as f:
        f.seek(int(offs[bad]) + at)
        b = f.read(1)
        f.seek(int(offs[bad]) + at)
        f.write(bytes([b[0] ^ 0x5A]))
    return bad, lost


# -- SIMD bodies a kernel module can be forced to (its isa() / _set_isa()) ----

ISAS = ["sse2", "avx2", "avx512"]


def forced_isa(module, name):
    """Force `module`'s SIMD body to `name` (skip when the CPU lacks it), yield
    it, then let the module pick again: the body of an `isa` fixture."""
    import pytest
    got = module._set_isa(name)
    try:
        if got != name:
            pytest.skip(f"CPU lacks {name}")
        yield got
    finally:
        module._set_isa(None)


def cpu_flags():
    """The x86-64 CPU flags from /proc/cpuinfo (the test is skipped elsewhere)."""
    import platform
    import pytest
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    try:
        with open("/proc/cpuinfo") as f:
            return next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo")
