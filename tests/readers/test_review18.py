"""Review of the fork and re-entry guards of a chain (942d5a3, 67588a1, 60d738b).

- close() of a chain torn by a fork, in the child: the busy flag the parent's
  dead thread left set made close() defer itself for ever, so the child kept
  the chain's files open (its `closed` said True).
- ReaderHolder.reset_reader(r) from inside a read of r's own chain (a map
  function): the holder took r while the read was using it, and reading or
  resetting through the holder then repeated or lost records -- the re-entry
  the busy flag refuses everywhere else.
- The check that a prefetcher's thread does not call its own chain skipped the
  thread that imported readerlib; a prefetcher's thread can get that ident
  again once the importing thread has ended (an import on a worker thread),
  and the call then waited for ever.

Each case runs in a fresh interpreter with a time limit (the old code hangs
or reads wrong data).
"""
import os

import pytest

from helpers import run_ok_script

PRELUDE = r"""
import os, sys, threading, signal, tempfile
import numpy as np
import readerlib as rl

schema = rl.Schema([rl.Field("x", "int64")])

def rest(reader):
    out = []
    while (item := reader.read_next()) is not None:
        out.extend(int(v) for v in np.asarray(item[0]).ravel())
    return out
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("shape", ["map", "shuffle", "prefetch"])
def test_close_of_a_torn_chain_in_the_child_releases_its_files(shape):
    run_ok_script(PRELUDE + f"""
d = tempfile.mkdtemp()
path = os.path.join(d, "a.rio")
with rl.RecordIOWriter(path, schema, chunk_size=256) as w:
    for i in range(400):
        w.write((np.int64(i),))
entered, go = threading.Event(), threading.Event()
def fn(x):
    if int(x[0]) == 50:
        entered.set()
        go.wait()
    return x
src = rl.RecordIOReader(path)
shape = {shape!r}
if shape == "map":
    chain = src.map(fn, output_schema=schema).batch(4)
elif shape == "shuffle":
    chain = rl.PythonReader(lambda: (fn((np.int64(i),)) for i in range(400)), schema)
    src = chain
    chain = chain.shuffle(8, seed=1).batch(4)
else:
    # the loop's thread inside the prefetcher's read (it holds the chain's
    # lock while it waits for the prefetcher's thread, held up in fn)
    chain = src.map(fn, output_schema=schema).batch(4).prefetch(2)
t = threading.Thread(target=lambda: rest(chain), daemon=True)
t.start()
entered.wait()
if shape == "prefetch":
    import time; time.sleep(0.3)         # (the loop's read is waiting on the ring by now)

def rio_fds():
    out = []
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{{f}}") == path:
                out.append(f)
        except OSError:
            pass
    return out

r, w = os.pipe()
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    try:
        try:
            chain.read_next()
        except RuntimeError as e:
            assert "forked while another thread" in str(e), str(e)
        else:
            raise AssertionError("a torn chain was read")
        chain.close()
        assert chain.closed and src.closed, (chain.closed, src.closed)
        if shape != "shuffle":
            assert rio_fds() == [], rio_fds()   # the child's descriptor of the file: closed
        chain.close()                        # idempotent
        os.write(w, b"child ok")
    except BaseException:
        import traceback; traceback.print_exc()
        os._exit(3)
    os._exit(0)
os.close(w)
_, st = os.waitpid(pid, 0)
msg = os.read(r, 100)
go.set()
t.join(10)
assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 and msg == b"child ok", (st, msg)
assert not t.is_alive()
chain.close()
print("OK")
""", timeout=120)


@pytest.mark.parametrize("then", ["read_next", "reset"])
def test_holder_refuses_a_reader_whose_chain_is_inside_a_read(then):
    run_ok_script(PRELUDE + f"""
N = 2000
src = rl.ArrayReader({{"x": np.arange(N, dtype=np.int64)}}).shuffle(64, seed=1)
other = rl.ReaderHolder(rl.ArrayReader({{"x": np.arange(3, dtype=np.int64)}}))
calls, errors = [0], []
def fn(x):
    calls[0] += 1
    if calls[0] == 30:
        try:
            other.reset_reader(src)          # src is in the middle of this very read
        except RuntimeError as e:
            errors.append(str(e))
        else:
            getattr(other, {then!r})()       # (the old code: a record repeated or lost)
    return x
chain = src.map(fn, output_schema=schema).batch(8)
got = rest(chain)
assert sorted(got) == list(range(N)), (len(got), len(set(got)))
assert len(errors) == 1 and "inside a read" in errors[0], errors
# the holder still holds its own reader, and src stays in its chain
assert [int(x[0]) for x in other] == [0, 1, 2], "the holder changed"
chain.reset()
assert sorted(rest(chain)) == list(range(N))
# once the read is over, the holder may take a reader (the usual way)
fresh = rl.ArrayReader({{"x": np.arange(5, dtype=np.int64)}})
other.reset_reader(fresh)
assert [int(x[0]) for x in other] == list(range(5))
print("OK")
""", timeout=120)


def test_prefetch_thread_with_the_ident_of_the_thread_that_imported_readerlib():
    # Thread idents are reused once a thread ends (glibc's pthread_t is the
    # address of its descriptor): readerlib imported on a worker thread, then
    # prefetchers started until one's thread has that ident.
    p = run_ok_script(r"""
import signal, threading
import numpy as np
box = {}
def imp():
    import readerlib
    box["id"] = threading.get_ident()
th = threading.Thread(target=imp); th.start(); th.join()
import readerlib as rl
schema = rl.Schema([rl.Field("x", "int64")])
signal.alarm(60)                          # (the old code: the call below waits for ever)
def rest(reader):
    out = []
    while (item := reader.read_next()) is not None:
        out.extend(int(v) for v in np.asarray(item[0]).ravel())
    return out
for attempt in range(200):
    src = rl.ArrayReader({"x": np.arange(200, dtype=np.int64)})
    hit, errors = [], []
    def fn(x, src=src, hit=hit, errors=errors):
        if int(x[0]) == 27:
            hit.append(threading.get_ident() == box["id"])
            try:
                src.read_next()
            except RuntimeError as e:
                errors.append(str(e))
        return x
    chain = src.map(fn, output_schema=schema).batch(8).prefetch(2)
    got = rest(chain)
    chain.close()
    assert sorted(got) == list(range(200)), len(got)
    assert len(errors) == 1, errors
    if hit[0]:
        assert "thread of a PrefetchReader of its own chain" in errors[0], errors
        print("REUSED", attempt)
        break
print("OK")
""", timeout=120)
    if "REUSED" not in p.stdout:
        pytest.skip("no prefetcher's thread got the importing thread's ident")


@pytest.mark.parametrize("lookup", ["source", "global_shuffle"])
def test_random_access_from_a_map_function_of_the_same_chain(lookup):
    # reader[i] / read_many do not move the chain (random access is
    # independent of the sequential position, through its own chunk cache):
    # a map function looking up a partner record of its own source worked
    # before the re-entry guard (fed4c4c), which then refused it.
    run_ok_script(PRELUDE + f"""
d = tempfile.mkdtemp()
path = os.path.join(d, "a.rio")
N = 3000
with rl.RecordIOWriter(path, schema, chunk_size=64) as w:
    for i in range(N):
        w.write((np.int64(i),))
src = rl.RecordIOReader(path)
g = src.global_shuffle(seed=3, window_chunks=2)
look = src if {lookup!r} == "source" else g
seen = []
def fn(x):
    v = int(x[0])
    js = [(v * 7 + k * 131) % N for k in range(4)]
    got = [int(y[0]) for y in look.read_many(js)] + [int(look[js[0]][0])]
    seen.append((js, got))
    assert int(x[0]) == v                    # the item being mapped is untouched
    return x
chain = (src.shuffle(32, seed=1) if look is src else g).map(fn, output_schema=schema).batch(10)
got = rest(chain)
assert sorted(got) == list(range(N)), (len(got), len(set(got)))
# the same lookups outside the read (the same epoch: g[i] is item i of its order)
for js, got in seen:
    assert got == [int(y[0]) for y in look.read_many(js)] + [int(look[js[0]][0])], (js, got)
if look is src:
    assert all(got[:4] == js for js, got in seen)
chain.reset()
st = chain.get_state()
a = rest(chain)
chain.set_state(st)
assert rest(chain) == a                       # resume is exact with the lookups
print("OK")
""", timeout=120)
