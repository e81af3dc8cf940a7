"""A chain in a process forked while another thread was inside it.

The thread that held the chain's lock at the fork does not exist in the
child, so its hold was never released: the child's first read, reset or
state call blocked for ever (a DataLoader worker forked while an async
checkpoint's get_state or a second loop was inside the chain hung).  Now the
child frees the lock and refuses the chain (its state is what that thread
left half-done) with a RuntimeError saying what to do; chains nobody was
inside at the fork read on in the child exactly as in the parent.

Each case runs in a fresh interpreter with a time limit: the old code hangs.
"""
import os

import pytest

from helpers import run_ok_script

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

PRELUDE = r"""
import os, sys, threading, signal
import numpy as np
import readerlib as rl

schema = rl.Schema([rl.Field("x", "int64")])
entered, go = threading.Event(), threading.Event()

def gen(block_at):
    def make():
        for i in range(40):
            if i == block_at:
                entered.set()
                go.wait()
            yield (np.int64(i),)
    return make

def values(reader):
    # The rest of the current epoch (read_next: iter() would start the next one).
    out = []
    while (item := reader.read_next()) is not None:
        out.extend(int(v) for v in np.asarray(item[0] if not hasattr(item[0], "data") else item[0].data).ravel())
    return out

def child(fn):
    # Run fn in a forked child; its exit status says whether it passed (a hang: SIGALRM).
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        try:
            fn()
        except BaseException as e:
            import traceback; traceback.print_exc()
            os._exit(3)
        os._exit(0)
    return pid

def wait_ok(pid):
    _, st = os.waitpid(pid, 0)
    go.set()                             # (a failed child must not leave the parent's thread waiting)
    assert os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0, f"child failed: status {st}"
"""


def test_lock_held_by_another_thread_at_fork_refuses_instead_of_hanging():
    run_ok_script(PRELUDE + r"""
src = rl.PythonReader(gen(5), schema)
chain = src.shuffle(8, seed=1).batch(4)
t = threading.Thread(target=lambda: values(chain), daemon=True)
t.start()
entered.wait()                           # the thread is inside chain.read_next, holding the lock

def in_child():
    for reader in (chain, src):          # the outer reader and one below: one chain, one lock
        for what, call in [("read_next", lambda: reader.read_next()),
                           ("reset", lambda: reader.reset()),
                           ("get_state", lambda: reader.get_state()),
                           ("_skip", lambda: reader._skip(1))]:
            try:
                call()
            except RuntimeError as e:
                assert "forked while another thread" in str(e), str(e)
                assert "build the chain in this process" in str(e), str(e)
            else:
                raise AssertionError(f"{what} on a torn chain did not raise")
    # the state cannot be restored into it either
    try:
        chain.set_state({"version": 1})
    except RuntimeError as e:
        assert "forked" in str(e)
    else:
        raise AssertionError("set_state did not raise")
    chain.close()                        # close works (nothing to wait for)
    assert chain.closed if hasattr(chain, "closed") else True
    # a chain built here reads normally
    global entered, go
    fresh = rl.PythonReader(lambda: ((np.int64(i),) for i in range(40)), schema).shuffle(8, seed=1).batch(4)
    assert sorted(values(fresh)) == list(range(40))

pid = child(in_child)
wait_ok(pid)
go.set()
t.join(10)
assert not t.is_alive()
# the parent's chain is untouched by all this
print("OK")
""", timeout=120)


def test_chain_nobody_was_inside_reads_on_in_the_child_as_in_the_parent():
    run_ok_script(PRELUDE + r"""
chain = rl.ArrayReader({"x": np.arange(100, dtype=np.int64)}).shuffle(16, seed=3).batch(5)
first = [chain.read_next() for _ in range(4)]
# another thread that used the chain before and is idle now (it released the lock)
t = threading.Thread(target=lambda: chain.get_state())
t.start(); t.join()

def in_child():
    rest = values(chain)                 # the rest of the epoch, in the child
    os.write(w, repr(rest).encode())

r, w = os.pipe()
pid = child(in_child)
os.close(w)
data = b""
while True:
    b = os.read(r, 65536)
    if not b:
        break
    data += b
wait_ok(pid)
rest_child = eval(data.decode())
rest_parent = values(chain)
assert rest_child == rest_parent and len(rest_parent) == 80, (rest_child, rest_parent)
print("OK")
""", timeout=120)


def test_fork_from_inside_the_chain_by_the_reading_thread_itself():
    # The thread that forks holds the lock itself (a PythonReader's iterator
    # forks): in the child it is the same thread, its hold is real, and the
    # read goes on.
    run_ok_script(PRELUDE + r"""
r, w = os.pipe()
forked = []
def make():
    for i in range(30):
        if i == 7 and not forked:
            pid = os.fork()
            forked.append(pid)
            if pid == 0:
                signal.alarm(20)
        yield (np.int64(i),)
chain = rl.PythonReader(make, schema).batch(4)
got = values(chain)
if forked[0] == 0:                       # the child: finished the epoch it was forked in
    try:
        assert got == list(range(30)), got
        chain.reset()
        assert values(chain) == list(range(30))
    except BaseException:
        import traceback; traceback.print_exc(); os._exit(3)
    os._exit(0)
wait_ok(forked[0])
assert got == list(range(30))
print("OK")
""", timeout=120)


def test_grandchild_of_a_chain_used_in_the_child():
    run_ok_script(PRELUDE + r"""
chain = rl.ArrayReader({"x": np.arange(60, dtype=np.int64)}).batch(6)
def in_child():
    assert values(chain) == list(range(60))
    chain.reset()
    chain.read_next()                    # the lock taken and released in this process
    def in_grandchild():
        assert values(chain) == list(range(6, 60))
    wait_ok(child(in_grandchild))
wait_ok(child(in_child))
print("OK")
""", timeout=120)


def test_holder_refuses_a_torn_reader():
    run_ok_script(PRELUDE + r"""
src = rl.PythonReader(gen(3), schema)
chain = src.batch(2)
t = threading.Thread(target=lambda: values(chain), daemon=True)
t.start()
entered.wait()
def in_child():
    holder = rl.ReaderHolder(rl.ArrayReader({"x": np.arange(4, dtype=np.int64)}))
    try:
        holder.reset_reader(src)
    except RuntimeError as e:
        assert "forked while another thread" in str(e), str(e)
    else:
        raise AssertionError("a torn reader was taken")
    assert [int(x[0]) for x in holder] == [0, 1, 2, 3]
wait_ok(child(in_child))
go.set(); t.join(10)
print("OK")
""", timeout=120)
