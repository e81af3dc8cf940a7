"""A chain called from inside its own read by the reading thread.

A map or filter function, a PythonReader's iterator or a signal handler runs
in the middle of a read of the chain, with its lock held by that same thread
(an RLock lets it in).  Reading or resetting the chain there ran the shuffle
buffer or batch under construction twice: a reset from a map function under
a batch crashed (SIGSEGV), a read from it lost records silently.  Now those
calls raise RuntimeError; get_state() there is exact; close() there is done
when the read returns.  Each case runs in a fresh interpreter (the old code
crashes).
"""
import pytest

from helpers import run_ok_script

PRELUDE = r"""
import numpy as np, readerlib as rl, signal, sys
N = 200
calls = [0]
holder = {}

def make(fn, source=None):
    src = source or rl.ArrayReader({"x": np.arange(N, dtype=np.int64)})
    sh = src.shuffle(16, seed=1)
    m = sh.map(fn, output_schema=sh.schema)
    b = m.batch(8)
    holder.update(src=src, sh=sh, m=m, b=b)
    return b

def rest(reader):
    out = []
    while (item := reader.read_next()) is not None:
        out.extend(int(v) for v in np.asarray(item[0]).ravel())
    return out
"""


@pytest.mark.parametrize("target", ["src", "sh", "m", "b"])
@pytest.mark.parametrize("call", ["read_next", "reset", "_skip", "set_state"])
def test_moving_the_chain_from_its_own_map_function_raises(target, call):
    run_ok_script(PRELUDE + f"""
errors = []
def fn(x):
    calls[0] += 1
    if calls[0] in (27, 90):
        r = holder[{target!r}]
        try:
            if {call!r} == "read_next":
                r.read_next()
            elif {call!r} == "reset":
                r.reset()
            elif {call!r} == "_skip":
                r._skip(3)
            else:
                r.set_state(state0)
        except RuntimeError as e:
            errors.append(str(e))
    return x
chain = make(fn)
state0 = chain.get_state()
got = rest(chain)
assert sorted(got) == list(range(N)), (len(got), len(set(got)))
assert len(errors) == 2, errors
assert "called from inside a read" in errors[0] and {call!r} + "()" in errors[0], errors[0]
# the next epoch is whole too
assert sorted(rest(chain) if chain.reset() is None else []) == list(range(N))
print("OK")
""", timeout=120)


def test_get_state_from_inside_the_read_is_exact():
    run_ok_script(PRELUDE + r"""
saved = []
def fn(x):
    calls[0] += 1
    if calls[0] in (27, 61) and "b" in holder:
        saved.append((calls[0], holder["b"].get_state()))
    return x
chain = make(fn)
delivered = []
while (item := chain.read_next()) is not None:
    delivered.append([int(v) for v in np.asarray(item[0])])
    for c, st in saved:
        if c is not None:
            saved[saved.index((c, st))] = (None, (len(delivered) - 1, st))
flat = [v for b in delivered for v in b]
assert sorted(flat) == list(range(N))
assert len(saved) == 2
for _, (nb, st) in saved:
    # taken while batch nb was being made: the restore gives that batch and on
    calls[0] = -10**9
    again = make(fn)
    again.set_state(st)
    tail = rest(again)
    assert tail == [v for b in delivered[nb:] for v in b], (nb, tail[:10])
print("OK")
""", timeout=120)


@pytest.mark.parametrize("target", ["src", "b"])
def test_close_from_inside_the_read_finishes_the_read_first(target, tmp_path):
    path = str(tmp_path / "f.rio")
    run_ok_script(PRELUDE + f"""
import os
schema = rl.Schema([rl.Field("x", "int64")])
with rl.RecordIOWriter({path!r}, schema) as w:
    w.write_batch({{"x": np.arange(N, dtype=np.int64)}})
def fds():
    return sum(1 for f in os.listdir("/proc/self/fd")
               if os.path.realpath("/proc/self/fd/" + f) == {path!r})
def fn(x):
    calls[0] += 1
    if calls[0] == 27:
        holder[{target!r}].close()
    return x
chain = make(fn, rl.RecordIOReader({path!r}))
got = []
err = None
try:
    while (item := chain.read_next()) is not None:
        got.extend(int(v) for v in np.asarray(item[0]))
except ValueError as e:
    err = str(e)
assert err is not None and "closed reader" in err, err
assert len(got) >= 8 and len(set(got)) == len(got), got     # the batch being made came out whole
assert holder[{target!r}].closed
chain.close()
assert fds() == 0, fds()
print("OK")
""", timeout=120)


def test_signal_handler_reading_the_chain_mid_read_loses_nothing():
    # A handler that calls read_next lands inside a read (in the map function's
    # Python code) or between two.  Inside, it gets the RuntimeError; between,
    # an ordinary read.  Every record comes out once, to the loop or to it.
    run_ok_script(PRELUDE + r"""
import time
hits, outside = [], []
def handler(signum, frame):
    try:
        item = holder["b"].read_next()
    except RuntimeError as e:
        assert "called from inside a read" in str(e), str(e)
        hits.append(1)
        return
    if item is not None:
        outside.extend(int(v) for v in np.asarray(item[0]))
def fn(x):
    t = time.perf_counter()
    while time.perf_counter() - t < 2e-4:
        pass
    return x
chain = make(fn)
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
try:
    got = rest(chain)
finally:
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
assert sorted(got + outside) == list(range(N)), (len(got), len(outside), len(set(got + outside)))
assert hits, "the handler never landed inside a read"
print("OK")
""", timeout=120)


def test_python_reader_iterator_reading_its_own_chain_raises():
    run_ok_script(PRELUDE + r"""
schema = rl.Schema([rl.Field("x", "int64")])
errors = []
def gen():
    for i in range(50):
        if i == 10:
            try:
                holder["chain"].read_next()
            except RuntimeError as e:
                errors.append(str(e))
        yield (np.int64(i),)
chain = rl.PythonReader(gen, schema).batch(4)
holder["chain"] = chain
got = rest(chain)
assert got == list(range(50)), got
assert len(errors) == 1 and "called from inside a read" in errors[0]
print("OK")
""", timeout=120)


@pytest.mark.parametrize("target", ["p", "m", "src"])
@pytest.mark.parametrize("call", ["read_next", "get_state", "reset"])
def test_prefetch_thread_calling_its_own_chain_raises_instead_of_hanging(target, call):
    # The map function runs on the prefetcher's thread; the loop's read of the
    # prefetcher holds the chain's lock while it waits for that thread's item.
    run_ok_script(PRELUDE + f"""
errors = []
def fn(x):
    calls[0] += 1
    if calls[0] in (27, 120):
        try:
            getattr(holder[{target!r}], {call!r})()
        except RuntimeError as e:
            errors.append(str(e))
    return x
src = rl.ArrayReader({{"x": np.arange(N, dtype=np.int64)}})
m = src.map(fn, output_schema=src.schema)
p = m.batch(8).prefetch(2)
holder.update(p=p, m=m, src=src)
got = rest(p)
p.close()
assert sorted(got) == list(range(N)), (len(got), len(set(got)))
assert len(errors) == 2 and "thread of a PrefetchReader of its own chain" in errors[0], errors
print("OK")
""", timeout=60)


@pytest.mark.parametrize("call", ["read_next", "_skip", "set_state"])
@pytest.mark.parametrize("target", ["src", "holder"])
def test_a_reader_closed_inside_a_read_lets_go_of_its_file_as_that_read_ends(target, call, tmp_path):
    # A filter function closes a reader below the one read (the source, or a
    # ReaderHolder over it): the close waits for the read, which is using the
    # chain's buffers.  It kept the file open until the chain's next call (a
    # loop that stopped there, or a chain left alone, held it for good); the
    # call that deferred it now runs it as it returns.
    path = str(tmp_path / "f.rio")
    run_ok_script(PRELUDE + f"""
import os
schema = rl.Schema([rl.Field("x", "int64")])
with rl.RecordIOWriter({path!r}, schema, chunk_size=256) as w:
    w.write_batch({{"x": np.arange(N, dtype=np.int64)}})
def fds():
    return sum(1 for f in os.listdir("/proc/self/fd")
               if os.path.realpath("/proc/self/fd/" + f) == {path!r})
src = rl.RecordIOReader({path!r})
held = rl.ReaderHolder(src)
target = src if {target!r} == "src" else held
closed_at = []
def keep(x):
    calls[0] += 1
    if calls[0] == 27:
        target.close()
        closed_at.append(fds())         # left to the call in progress
    return True
chain = held.shuffle(16, seed=1).filter(keep).batch(8)
state = chain.get_state()
for _ in range(3):
    chain.read_next()                   # 3 batches: 24 calls
assert calls[0] == 24 and fds() == 1, (calls[0], fds())
if {call!r} == "read_next":
    item = chain.read_next()
    assert len(item[0].data) == 8       # the read the close came from ends whole
elif {call!r} == "_skip":
    assert chain._skip(2) == 2
else:
    calls[0] = 0
    chain.set_state(dict(state, position=4))    # replays 4 batches: 27 and more calls
assert closed_at == [1], closed_at
assert target.closed
assert fds() == 0, "the file stays open after the call the close came from returned"
try:
    chain.read_next()
    raise AssertionError("read a chain whose source is closed")
except ValueError as e:
    assert "closed reader" in str(e), str(e)
chain.close()
assert fds() == 0
print("OK")
""", timeout=120)
