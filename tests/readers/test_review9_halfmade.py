"""Half-made readers and writers: an exception while one is being made -- a
KeyboardInterrupt from a signal handler, a MemoryError -- propagates as that
exception: never a crash, never a descriptor left open or someone else's
closed.

What b8a1624 (ReaderBase.__cinit__ uses _thread.RLock) left, found by its
review:

* ReaderBase.__cinit__ still fails when its lock cannot be allocated
  (MemoryError, or RuntimeError "can't allocate lock").  CPython then frees
  the half-made object through the *subclass's* tp_dealloc, with the base's
  vtable and the subclass's object fields NULL (its tp_new had not reached
  them) and its C fields 0: RecordIOReader, TFRecordReader,
  GlobalShuffleReader, MapReader and TransformReader called their own cdef
  methods through the base vtable there -- SIGSEGV -- and the file readers
  would have closed fd 0 (their `fd = -1` is in their own __cinit__).
  Each now returns early when its own part was never made.
* A reader whose __init__ never ran -- `cls.__new__(cls)`, or a Python
  subclass whose __init__ does not call super().__init__ -- segfaulted on
  read_next / reset / len / close (ShuffleReader, the decorators: their
  compiled methods read fields nothing set).  Such a reader now raises
  TypeError ("never initialised"), and such a subclass is refused when made.
* RecordIOWriter.__init__ opened its file before making the header (Schema
  .to_json runs Python code): an exception there left the descriptor open for
  good (the writer is not open yet, so __del__ does not close it, and
  _PieceFile has no finaliser).  The file is now opened last.

Every check runs in a child with a time limit, so a crash is a failure.
"""

import pytest

from helpers import SUPPORT_DIR, run_ok_script

# every ReaderBase subclass of readerlib's compiled modules, and a Python
# subclass of a concrete one (the allowed kind: adds methods)
_CLASSES = r'''
import gc, importlib, os, sys, tempfile
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
import readerlib.readers._base as B

MODS = ["readerlib.formats._recordio", "readerlib.formats._tfrecord", "readerlib.readers._sources",
        "readerlib.readers._multifile", "readerlib.readers._random_access",
        "readerlib.readers._shuffle", "readerlib.readers._global_shuffle",
        "readerlib.readers._batch", "readerlib.readers._padded", "readerlib.readers._map",
        "readerlib.transform", "readerlib.readers._slice", "readerlib.readers._passes",
        "readerlib.readers._prefetch", "readerlib.readers._base"]
CLASSES = []
for m in MODS:
    mod = importlib.import_module(m)
    for k, v in sorted(vars(mod).items()):
        if isinstance(v, type) and issubclass(v, B.ReaderBase) and v.__module__ == m:
            CLASSES.append(v)


class PyRecordIO(rl.RecordIOReader):
    def first(self):
        return self.read_next()


CLASSES.append(PyRecordIO)
assert len(CLASSES) >= 30, [c.__name__ for c in CLASSES]
for c in ("RecordIOReader", "TFRecordReader", "GlobalShuffleReader", "MapReader",
          "TransformReader", "ShuffleReader", "PrefetchReader", "MultiFileReader"):
    assert c in {k.__name__ for k in CLASSES}, c


from helpers import open_fds
fds = open_fds


# fd 0: a file of ours, so that a reader that closes it by mistake shows
_d0 = tempfile.mkdtemp()
_f0 = os.open(os.path.join(_d0, "fd0"), os.O_RDONLY | os.O_CREAT, 0o600)
os.dup2(_f0, 0)
os.close(_f0)
INO0 = os.fstat(0).st_ino


def fd0_intact(what):
    assert os.fstat(0).st_ino == INO0, (what, "fd 0 was closed or replaced")
'''

_BASE_FAILS = _CLASSES + r'''
from helpers import make_byte_files
from readerlib.transform import RecordTransform
d = tempfile.mkdtemp()
(rio, tfr), _ = make_byte_files(d, ["rio", "tfrecord"], [100, 100])
arr = np.arange(50, dtype=np.int64)


class Boom(Exception):
    pass


def boom():
    raise MemoryError("injected: ReaderBase.__cinit__'s lock")


real = B._RLock
# the public constructors too: upstreams made before the failure is switched on
UP = {"rio": rl.RecordIOReader(rio), "tfr": rl.TFRecordReader(tfr), "arr": rl.ArrayReader(arr)}
CTORS = {
    "RecordIOReader": lambda: rl.RecordIOReader(rio),
    "TFRecordReader": lambda: rl.TFRecordReader(tfr),
    "PyRecordIO": lambda: PyRecordIO(rio),
    "GlobalShuffleReader": lambda: UP["rio"].global_shuffle(seed=1),
    "MapReader": lambda: UP["arr"].map(lambda x: x),
    "TransformReader": lambda: UP["arr"].map(RecordTransform()),
    "ShuffleReader": lambda: UP["tfr"].shuffle(8, seed=1),
    "BatchReader": lambda: UP["rio"].batch(4),
    "PrefetchReader": lambda: UP["arr"].prefetch(2),
    "read_many": lambda: UP["tfr"].read_many([0, 5]),      # opens a chunk cache: a RecordIO clone
}
for cls in CLASSES:
    name = cls.__name__
    print("class", name, flush=True)
    gc.collect()
    before = fds()
    B._RLock = boom
    try:
        try:
            cls.__new__(cls)
        except MemoryError:
            pass
        else:
            raise AssertionError((name, "the injected failure did not happen"))
        if name in CTORS:
            try:
                CTORS[name]()
            except MemoryError:
                pass
            else:
                raise AssertionError((name, "the constructor did not fail"))
    finally:
        B._RLock = real
    gc.collect()
    fd0_intact(name)
    assert fds() == before, (name, set(fds().items()) ^ set(before.items()))
# all still usable afterwards
assert sum(1 for _ in rl.RecordIOReader(rio)) == 100
assert sum(1 for _ in UP["rio"].global_shuffle(seed=1)) == 100
print("OK")
'''


def test_a_failed_readerbase_cinit_frees_every_reader_safely():
    """ReaderBase.__cinit__ fails (its lock allocation, injected) for every
    reader class: MemoryError, no SIGSEGV, fd 0 and every other descriptor
    untouched (the old RecordIOReader / TFRecordReader / GlobalShuffleReader /
    MapReader / TransformReader __dealloc__ jumped through the base vtable)."""
    p = run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _BASE_FAILS, timeout=180)
    assert "class RecordIOReader" in p.stdout and "class TransformReader" in p.stdout


_NOMEM = _CLASSES + r'''
try:
    import _testcapi
except ImportError:
    print("NO_TESTCAPI OK")
    sys.exit(0)
failed = {}
for cls in CLASSES:
    x = cls.__new__(cls)                 # warm: caches, interned names
    del x
    gc.collect()
    before = fds()
    for k in range(8):                   # the k-th allocation from here fails
        x = None
        _testcapi.set_nomemory(k, k + 1)
        try:
            x = cls.__new__(cls)
        except (MemoryError, RuntimeError):   # RuntimeError: "can't allocate lock"
            _testcapi.remove_mem_hooks()
            failed[cls.__name__] = failed.get(cls.__name__, 0) + 1
        else:
            _testcapi.remove_mem_hooks()
        del x
        gc.collect()
    fd0_intact(cls.__name__)
    assert fds() == before, cls.__name__
print(sorted(failed.items()))
# the allocations that fail include the lock's, for the file readers above all
for name in ("RecordIOReader", "TFRecordReader", "MapReader"):
    assert failed.get(name, 0) >= 2, (name, failed)
print("OK")
'''


def test_a_real_allocation_failure_while_a_reader_is_made_raises():
    """The same with real allocation failures (_testcapi.set_nomemory): each of
    the first allocations of `cls.__new__(cls)` fails in turn -- the object's,
    the lock's, the lock's own -- for every reader class."""
    p = run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NOMEM, timeout=180)
    if "NO_TESTCAPI" in p.stdout:
        pytest.skip("this Python has no _testcapi")


_NEW_ONLY = _CLASSES + r'''
for cls in CLASSES:
    gc.collect()
    before = fds()
    x = cls.__new__(cls)               # __cinit__ ran, __init__ never did
    del x
    gc.collect()
    fd0_intact(cls.__name__)
    assert fds() == before, cls.__name__
print("OK")
'''


def test_a_reader_whose_init_never_ran_is_freed_safely():
    """`cls.__new__(cls)` then collected: every __dealloc__ copes with the
    fields __cinit__ set and nothing else."""
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NEW_ONLY, timeout=120)


_NEVER_INIT = _CLASSES + r'''
import pickle
METHODS = {
    "read_next": lambda r: r.read_next(),
    "reset": lambda r: r.reset(),
    "len": lambda r: len(r),
    "next": lambda r: next(iter(r)),
    "set_state": lambda r: r.set_state({}),
    "skip": lambda r: r._skip(3),
    "read_many": lambda r: r.read_many([0]),
    "getitem": lambda r: r[0],
    "decorate": lambda r: r.shuffle(4),
    "get_state": lambda r: r.get_state(),
    "repr": lambda r: repr(r),
    "pickle": lambda r: pickle.dumps(r),
    "close": lambda r: (r.close(), r.close()),
}
MUST_REFUSE = ("read_next", "reset", "len", "next", "set_state", "skip", "read_many", "decorate")
ABSTRACT = ("ReaderBase", "FileReader", "DecoratedReader", "_ChunkedSource")
for cls in CLASSES:
    for m, call in METHODS.items():
        print(cls.__name__, m, flush=True)
        # (a source's own __len__ reads a count, 0 here: no need to refuse)
        must = m in MUST_REFUSE and not (m == "len" and cls.__len__ is not B.ReaderBase.__len__)
        r = cls.__new__(cls)               # __cinit__ ran, __init__ never did
        try:
            call(r)
        except Exception as e:
            if must and cls.__name__ not in ABSTRACT:
                assert isinstance(e, TypeError) and "never initialised" in str(e), (cls, m, repr(e))
        else:
            assert not must, (cls, m, "no error")
        del r
        gc.collect()
print("OK")
'''


def test_a_reader_whose_init_never_ran_refuses_every_read():
    """Methods on `cls.__new__(cls)`: read_next, reset, len, iteration,
    set_state, _skip, read_many and decorating it raised nothing useful or
    crashed (ShuffleReader, the decorators over a None reader: SIGSEGV); now
    TypeError "was never initialised", and close() is a no-op."""
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NEVER_INIT, timeout=180)


_NO_SUPER = r'''
import numpy as np
import readerlib as rl
from readerlib.readers._shuffle import ShuffleReader


class Forgot(ShuffleReader):
    def __init__(self, reader, n):
        self.n = n                          # no super().__init__(reader, n)


class Calls(ShuffleReader):
    """A shuffle that remembers its buffer size."""
    def __init__(self, reader, n):
        super().__init__(reader, n, seed=1)
        self.n = n


class NoInit(rl.ArrayReader):
    def total(self):
        return sum(int(x[0]) for x in self)


up = rl.ArrayReader(np.arange(10, dtype=np.int64))
try:
    Forgot(up, 3)
except TypeError as e:
    assert "Forgot.__init__ must call super().__init__" in str(e), e
else:
    raise AssertionError("Forgot was made")
c = Calls(up, 3)
assert c.n == 3 and sorted(int(x[0]) for x in c) == list(range(10))
assert Calls.__init__.__wrapped__.__doc__ is None and Calls.__init__.__name__ == "__init__"
assert NoInit(np.arange(4, dtype=np.int64)).total() == 6
print("OK")
'''


def test_a_python_subclass_whose_init_skips_super_is_refused():
    """A Python subclass of a concrete reader whose __init__ forgets
    super().__init__ gave an object whose reads, reset, len and close
    segfaulted (a ShuffleReader's); it is refused when made."""
    run_ok_script(_NO_SUPER, timeout=60)


# ------------------------------------------------ an interrupt anywhere, more kinds
# As tests/readers/test_construct_interrupt.py (a KeyboardInterrupt at the k-th
# Python call while the thing is made, every k), for the writers and the readers
# and decorators that file does not make.
_INTERRUPT = r'''
import gc, os, sys, tempfile, time
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
from helpers import interrupt_each_call, make_byte_files, BYTES
from readerlib.formats._tfrecord import TFRecordWriter
from readerlib.transform import RecordTransform
from readerlib.readers._base import ReaderHolder

d = tempfile.mkdtemp()
(rio, rio2, tfr, tgz), _ = make_byte_files(d, ["rio", "rio", "tfrecord", "tfrecord.gz"],
                                           [150, 120, 150, 100])
tix = os.path.join(d, "ix.tfrecord")
os.link(tfr, tix)
_r = rl.TFRecordReader(tix, index="auto")
assert sum(1 for _ in _r) == 150         # a complete pass writes the sidecar index
_r.close()
assert os.path.exists(tix + ".idx")
arr = np.arange(100, dtype=np.int64)
S = rl.Schema([rl.Field("x", "int64"), rl.Field("s", "float32", (), lod_level=1)])


class Made:
    """A writer made, closed and counted like a reader (the loop below)."""
    def __init__(self, w):
        self.w = w

    def close(self):
        self.w.close()

    def __iter__(self):
        return iter([self.w.path])


def graph_chain():
    import readerlib.graph as rg
    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_shuffle_reader(rg.create_recordio_reader(rio), 16, seed=1), 8)
        fields = rg.read(r)
    sess = rg.Session(graph=g)
    sess.run(fields)                     # the readers are made when the graph runs

    class G:
        def close(self):
            sess.close()

        def __iter__(self):
            return iter([1])
    return G()


CHAINS = {
    "rio_writer": lambda: Made(rl.RecordIOWriter(os.path.join(d, "w.rio"), BYTES)),
    "rio_writer_zlib_v1": lambda: Made(rl.RecordIOWriter(os.path.join(d, "w1.rio"), S, compressor="zlib",
                                                         version=1)),
    "tfr_writer": lambda: Made(TFRecordWriter(os.path.join(d, "w.tfrecord"))),
    "tfr_writer_gzip": lambda: Made(TFRecordWriter(os.path.join(d, "w.tfrecord.gz"), compression="GZIP")),
    "tfrecord_gzip": lambda: rl.TFRecordReader(tgz, compression="GZIP").shuffle(16, seed=1),
    "tfrecord_index": lambda: rl.TFRecordReader(tix, index="auto").global_shuffle(seed=2),
    "random_data": lambda: rl.RandomDataGenerator(S, 40, seed=1).bucket_by_length([3, 9], [4, 4, 2]),
    "window_holder": lambda: ReaderHolder(rl.RecordIOReader(rio).shuffle(16, seed=1, mode="window")
                                          .multi_pass(2)),
    "padded_bucket": lambda: rl.RecordIOReader(rio2).bucket_by_length([4, 16], [4, 2, 2], padded=False)
                             .map_batches(lambda b: b),
    "open_files": lambda: rl.open_files([rio, rio2, tfr], num_threads=2).shuffle(32, seed=3).batch(8),
    "open_files_global": lambda: rl.open_files([rio, tgz], shuffle_files=True, seed=1)
                                 .global_shuffle(seed=4).prefetch(2),
    "random_access": lambda: (lambda r: (r.read_many([0, 149, 77]), r)[1])(rl.RecordIOReader(rio)),
    "map_threads_transform": lambda: rl.ArrayReader(arr).map(lambda x: x, num_threads=2)
                                     .map(RecordTransform()).take(0),
    "graph": graph_chain,
}
ONLY = sys.argv[1:] or list(CHAINS)


for name in ONLY:
    build = CHAINS[name]
    r = build()                          # (a first make before the warm-up's count)
    r.close()
    del r
    hits, _ = interrupt_each_call(build, name)
    print(name, hits, flush=True)
print("OK")
'''

_GROUPS = [["rio_writer", "rio_writer_zlib_v1", "tfr_writer", "tfr_writer_gzip"],
           ["tfrecord_gzip", "tfrecord_index", "random_data", "window_holder", "padded_bucket"],
           ["open_files", "open_files_global"],
           ["random_access", "map_threads_transform", "graph"]]


@pytest.mark.parametrize("chains", _GROUPS, ids=[g[0] for g in _GROUPS])
def test_an_interrupt_anywhere_while_it_is_made_leaves_no_descriptor(chains):
    """The writers' group fails on the old RecordIOWriter (to_json after the
    file was opened: one descriptor left per injection point there)."""
    code = f"SUPPORT = {SUPPORT_DIR!r}\n" + _INTERRUPT
    p = run_ok_script(code.replace("ONLY = sys.argv[1:] or list(CHAINS)", f"ONLY = {chains!r}"),
                      timeout=400)
    for name in chains:
        assert any(line.startswith(name + " ") for line in p.stdout.splitlines()), p.stdout
