"""A file writer in a process forked from the one that opened it.

A forked child that exited normally (sys.exit, the end of its script) collected
the writer it inherited and finished the file -- its buffered records and the
index footer, written at the offsets of the fork -- over the records the parent
wrote after the fork, after the parent's close() had returned: the file no
longer read.  A child whose parent had a thread inside write_batch at the fork
hung on the writer's lock.  Now the file is the opening process's: in a child,
writes raise RuntimeError naming both processes and close() (or collection)
releases the descriptor without writing.

Each case runs in a fresh interpreter with a time limit.
"""
import os

import pytest

from helpers import run_ok_script

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

PRELUDE = r"""
import os, sys, time, threading, signal
import numpy as np
import readerlib as rl

KIND = %r
PATH = %r
schema = rl.Schema([rl.Field("x", "int64")])

def open_writer(path=PATH):
    return rl.RecordIOWriter(path, schema) if KIND == "rio" else rl.TFRecordWriter(path)

def rec(i):
    return (i,) if KIND == "rio" else b"%%08d" %% i

def read_back(path=PATH):
    r = rl.RecordIOReader(path) if KIND == "rio" else rl.TFRecordReader(path)
    out = [int(x[0]) if KIND == "rio" else int(bytes(x[0])) for x in r]
    r.close()
    return out
"""

KINDS = ["rio", "tfr"]


def _script(kind, tmp_path, body):
    return PRELUDE % (kind, str(tmp_path / f"f.{kind}")) + body


@pytest.mark.parametrize("kind", KINDS)
def test_child_exiting_normally_leaves_the_parents_file_whole(kind, tmp_path):
    # The child outlives the parent's close(): its exit used to write its own
    # ending over the parent's records.
    run_ok_script(_script(kind, tmp_path, r"""
w = open_writer()
for i in range(10):
    w.write(rec(i))
pid = os.fork()
if pid == 0:
    time.sleep(0.5)
    sys.exit(0)                          # a normal exit: the inherited writer is collected
for i in range(10, 3000):
    w.write(rec(i))
w.close()
_, st = os.waitpid(pid, 0)
assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
assert read_back() == list(range(3000))
print("OK")
"""), timeout=120)


@pytest.mark.parametrize("kind", KINDS)
def test_child_writes_are_refused_naming_both_processes(kind, tmp_path):
    run_ok_script(_script(kind, tmp_path, r"""
w = open_writer()
for i in range(5):
    w.write(rec(i))
parent = os.getpid()
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    code = 0
    for call in (lambda: w.write(rec(99)), lambda: w.write_batch([rec(98)]) if KIND == "tfr"
                 else w.write_batch({"x": np.array([98], np.int64)}), lambda: w.flush()):
        try:
            call()
            code = 4
        except RuntimeError as e:
            msg = str(e)
            if not (f"opened by process {parent}" in msg and str(os.getpid()) in msg and PATH in msg):
                print(msg); code = 5
    w.close()                            # releases the child's descriptor, writes nothing
    assert w.closed
    os._exit(code)
_, st = os.waitpid(pid, 0)
assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
for i in range(5, 20):
    w.write(rec(i))
w.close()
assert read_back() == list(range(20))
print("OK")
"""), timeout=120)


@pytest.mark.parametrize("kind", ["tfr"])
def test_child_of_a_parent_inside_write_batch_does_not_hang(kind, tmp_path):
    # A thread of the parent held the writer's lock at the fork (inside a
    # write_batch over a slow iterable): the child's close() and exit used to
    # wait on it for ever.
    run_ok_script(_script(kind, tmp_path, r"""
w = open_writer()
entered, go = threading.Event(), threading.Event()
def slow():
    for i in range(10):
        if i == 3:
            entered.set(); go.wait()
        yield rec(i)
t = threading.Thread(target=lambda: w.write_batch(slow()), daemon=True)
t.start()
entered.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    try:
        w.write(rec(50))
        os._exit(4)
    except RuntimeError:
        pass
    w.close()
    sys.exit(0)                          # a normal exit, the writer collected
_, st = os.waitpid(pid, 0)
go.set(); t.join(10)
assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
w.close()
assert read_back() == list(range(10))
print("OK")
"""), timeout=120)


@pytest.mark.parametrize("kind", KINDS)
def test_writer_opened_in_the_child_is_the_childs(kind, tmp_path):
    # Only inherited writers are refused: one the child opens works there,
    # also when the child forks in turn and its own child exits.
    run_ok_script(_script(kind, tmp_path, r"""
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    try:
        w = open_writer(PATH + ".child")
        for i in range(100):
            w.write(rec(i))
        g = os.fork()
        if g == 0:
            sys.exit(0)
        os.waitpid(g, 0)
        for i in range(100, 200):
            w.write(rec(i))
        w.close()
        assert read_back(PATH + ".child") == list(range(200))
    except BaseException:
        import traceback; traceback.print_exc(); os._exit(3)
    os._exit(0)
_, st = os.waitpid(pid, 0)
assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, st
assert read_back(PATH + ".child") == list(range(200))
print("OK")
"""), timeout=120)


@pytest.mark.parametrize("kind", KINDS)
def test_pickling_a_writer_says_why_not(kind, tmp_path):
    # (multiprocessing with spawn pickles what a worker gets: a writer there
    # got Cython's "cannot be converted to a Python object for pickling")
    import copy
    import pickle

    import readerlib as rl
    p = str(tmp_path / f"f.{kind}")
    w = rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "int64")])) if kind == "rio" else rl.TFRecordWriter(p)
    try:
        for attempt in (pickle.dumps, copy.copy):
            with pytest.raises(TypeError, match="belongs to the process that opened its file") as e:
                attempt(w)
            assert p in str(e.value)
    finally:
        w.close()
