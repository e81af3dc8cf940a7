"""An interrupted read loses nothing.

A KeyboardInterrupt that lands inside a read -- in a map's function, a
filter's predicate, map_batches' function, while the chain waits for a
threaded map's calls -- and a MemoryError while a read makes the item's
Python objects, leave the item in the chain: reading on gives exactly the
epoch an uninterrupted run gives (nothing lost, nothing twice), and a
get_state() taken right after the interrupt restores, on a fresh chain, to
the item that was interrupted.  (An Exception the function raises for an
item is that item's outcome: raised, the item dropped -- tests/readers/
test_transforms.py.)

The interrupts are injected deterministically at every Python call of one
read (sys.settrace), and by a real SIGALRM at random times; the allocation
failures at every allocation of one read (_testcapi.set_nomemory).  In a
child with a time limit: a crash or a hang is a failure.
"""
import pytest

from helpers import SUPPORT_DIR, run_ok_script

_PRELUDE = r'''
import gc, os, random, signal, sys, tempfile, threading, time
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
from helpers import AlarmInterrupt, InjectedInterrupt, call_tracer, make_byte_files

d = tempfile.mkdtemp()
paths, _ = make_byte_files(d, ["rio", "rio"], [700, 500], chunk_size=1024, rec_size=24)
rio0, rio1 = paths


def _same(x):
    return x


def ident(x):                 # a few Python calls per item: places for an interrupt to land
    return _same(_same(x))


def keep_most(x):             # drops every 5th record (x: the BYTES schema's one uint8 field)
    return bool(_same(int(x[0][0]) % 5 != 0))


def keep_batch(b):
    return bool(_same(int(b[0].data[0]) % 3 != 1))


CHAINS = {
    "map": lambda: rl.RecordIOReader(rio0).map(ident).batch(8),
    "map_threads": lambda: rl.RecordIOReader(rio0).map(ident, num_threads=2).batch(8),
    "map_shuffle": lambda: rl.RecordIOReader(rio0).map(ident).shuffle(100, seed=3).batch(8),
    "map_top": lambda: rl.RecordIOReader(rio0).map(ident),
    "map_batches": lambda: rl.RecordIOReader(rio0).batch(8).map_batches(ident),
    "map_batches_inner": lambda: rl.RecordIOReader(rio0).batch(8).map_batches(ident).take(10 ** 6),
    "filter": lambda: rl.RecordIOReader(rio0).filter(keep_most).batch(8),
    "filter_batches": lambda: rl.RecordIOReader(rio0).batch(4).filter(keep_batch),
    "shuffle_filter": lambda: rl.RecordIOReader(rio0).shuffle(64, seed=2).filter(keep_most).batch(8),
    "filter_shuffle": lambda: rl.RecordIOReader(rio0).filter(keep_most).shuffle(64, seed=4).batch(8),
    "open_files_map": lambda: rl.open_files(paths, num_threads=2).map(ident).batch(8),
    "shuffle_top": lambda: rl.RecordIOReader(rio0).shuffle(64, seed=5),
    "prefetch": lambda: rl.RecordIOReader(rio0).shuffle(64, seed=6).batch(8).prefetch(2),
}


def key(item):
    return tuple((np.asarray(t.data if hasattr(t, "data") else t).tobytes(),
                  tuple(np.asarray(l).tolist() for l in getattr(t, "lod", ())))
                 for t in item)


def rest(r):
    out = []
    while True:
        item = r.read_next()
        if item is None:
            return out
        out.append(key(item))


_ARMED = []


def interrupted_first_on_this_thread(x):
    if _ARMED and threading.current_thread() is threading.main_thread():
        _ARMED.clear()
        raise KeyboardInterrupt
    return x


def interrupted_threaded_map():
    """A threaded map over rio0 whose first read was interrupted on this thread,
    in its own piece of the chunk (the chunk held, the other piece posted)."""
    c = rl.RecordIOReader(rio0).map(interrupted_first_on_this_thread, num_threads=2)
    _ARMED.append(1)
    try:
        c.read_next()
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        pass
    return c


def epoch_with_failed_allocation(make, before, n):
    """A fresh chain's epoch when, after `before` items, the next read's n-th
    allocation fails (_testcapi.set_nomemory) and reading goes on after the
    MemoryError: (the items, whether that read raised)."""
    import _testcapi
    c = make()
    got = [key(c.read_next()) for _ in range(before)]
    raised = False
    _testcapi.set_nomemory(n, n + 1)
    try:
        item = c.read_next()
    except MemoryError:
        raised = True
    finally:
        _testcapi.remove_mem_hooks()
    if not raised and item is not None:
        got.append(key(item))
    got += rest(c)
    c.close()
    return got, raised


def failed_allocations_lose_nothing(sources, allocations):
    """For each chain of `sources`: the epoch is exact when the n-th allocation
    of its 4th read fails, n = 1 .. allocations - 1; {name: reads that raised}."""
    hits = {}
    for name, make in sources.items():
        c = make()
        ref = rest(c)
        c.close()
        hits[name] = 0
        for n in range(1, allocations):
            got, raised = epoch_with_failed_allocation(make, 3, n)
            hits[name] += raised
            assert got == ref, (name, n, len(got), len(ref))
    return hits
'''

# An interrupt at the k-th Python call of read number j, for every k until a
# read has fewer calls than k; then read on (even k) or checkpoint and restore
# on a fresh chain (odd k).
_EACH_CALL = _PRELUDE + r'''
def attempt(make, j, k, ref):
    c = make()
    got = [key(c.read_next()) for _ in range(j)]
    tracer, seen = call_tracer(k)
    hit = False
    sys.settrace(tracer)
    try:
        item = c.read_next()
    except InjectedInterrupt:
        hit = True
    finally:
        sys.settrace(None)
    if not hit:
        got += [key(item)] + rest(c)
    elif k % 2 == 0:
        got += rest(c)                       # read on
    else:
        st = c.get_state()                   # checkpoint right after the interrupt
        c2 = make()
        c2.set_state(st)
        got += rest(c2)
        c2.close()
    c.close()
    assert got == ref, (NAME, j, k, "read on" if k % 2 == 0 else "restored", len(got), len(ref),
                        next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None))
    return hit, seen[0]


make = CHAINS[NAME]
c = make()
ref = rest(c)
c.close()
hits = 0
for j in (0, len(ref) // 2):
    k = 1
    while True:
        hit, calls = attempt(make, j, k, ref)
        hits += hit
        if not hit:
            break
        # every call up to 48, then spread over the rest (a threaded map's
        # read has over a thousand)
        k = k + 1 if k < 48 else k + max(1, calls // 40)
print(NAME, hits)
print("OK")
'''

# Real signals: SIGALRM at random times raises KeyboardInterrupt in whatever
# runs; the loop reads on after each (several per epoch).  It consumes as a
# training loop does, `for item in iterator`: an assignment from a call
# (`x = reader.read_next()`) would lose the item in the caller's own frame
# (CPython runs a pending handler right after a call returns, before the
# assignment), whatever the reader does; a for loop's next item is bound
# before any handler runs.
_SIGNALS = _PRELUDE + r'''
Armed = AlarmInterrupt
Armed.install()
rnd = random.Random(7)
for name in NAMES:
    make = CHAINS[name]
    c = make()
    t0 = time.perf_counter()
    ref = rest(c)
    dur = time.perf_counter() - t0             # the timer's range follows the epoch's length:
    c.close()
    for _ in range(2):                         # its shortest of three (one epoch slowed by the
        c = make()                             # machine's other load put most alarms after the
        t0 = time.perf_counter()               # end of a 0.4 ms epoch: no hit in 12 attempts)
        rest(c)
        dur = min(dur, time.perf_counter() - t0)
        c.close()
    hits = 0
    for attempt in range(12):
        c = make()
        items = []
        append = items.append
        it = iter(c)
        while True:
            try:
                Armed.on = True
                signal.setitimer(signal.ITIMER_REAL, max(1e-5, rnd.uniform(0.02, 0.5) * dur))
                for item in it:
                    append(item)
                done = True
            except KeyboardInterrupt:
                hits += 1
                done = False
            finally:
                Armed.on = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            if done:
                break
        got = [key(b) for b in items]
        c.close()
        assert got == ref, (name, attempt, len(got), len(ref))
    assert hits > 0, name
    print(name, hits)
print("OK")
'''

# A MemoryError while a read makes the item's Python objects (every
# allocation of one read in turn): the item stays, reading on is exact.
_NOMEMORY = _PRELUDE + r'''
SOURCES = {
    "rio_instances": lambda: rl.RecordIOReader(rio0),
    "rio_batches": lambda: rl.RecordIOReader(rio0).batch(8),
    "array_batches": lambda: rl.ArrayReader(np.arange(300, dtype=np.int64)).batch(7),
    "shuffle_prefetch": lambda: rl.RecordIOReader(rio0).shuffle(64, seed=6).batch(8).prefetch(2),
}
for name, hits in failed_allocations_lose_nothing(SOURCES, 60).items():
    print(name, hits)
print("OK")
'''


@pytest.mark.parametrize("name", ["map", "map_threads", "map_shuffle", "map_top", "map_batches",
                                  "map_batches_inner", "filter", "filter_batches", "shuffle_filter",
                                  "filter_shuffle", "open_files_map"])
def test_an_interrupt_at_any_call_of_a_read_loses_nothing(name):
    p = run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\nNAME = {name!r}\n" + _EACH_CALL, timeout=300)
    hits = int(p.stdout.split()[1])
    assert hits > 0, p.stdout          # the interrupts did land inside the reads


def test_real_signals_while_reading_lose_nothing():
    names = ["map", "map_threads", "map_batches", "filter_shuffle", "shuffle_top", "prefetch",
             "open_files_map"]
    p = run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\nNAMES = {names!r}\n" + _SIGNALS, timeout=300)
    assert p.stdout.count("\n") == len(names) + 1, p.stdout


def test_a_memory_error_while_an_item_is_handed_over_loses_nothing():
    p = run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NOMEMORY, timeout=300)
    counts = dict(line.split() for line in p.stdout.splitlines() if line != "OK")
    # the failures did land in the reads (an allocation made after the item was taken)
    assert all(int(v) > 0 for v in counts.values()), counts


# The threaded map's workers.  An exception that is not an Exception raised by
# the function on a worker thread (a SystemExit: sys.exit() in the function)
# is that of an interrupted call, as on the calling thread: raised from the
# read, and reading on calls the function again on the rest of that worker's
# piece -- not swallowed with the piece's later inputs reported as outputs of
# the wrong type.
_WORKER_RAISES = _PRELUDE + r'''
import threading
ref = rest(rl.RecordIOReader(rio0).map(ident, num_threads=2))
fired = []


def exits_once_on_a_worker(x):
    if not fired and threading.current_thread() is not threading.main_thread():
        fired.append(1)
        sys.exit(3)
    return x


c = rl.RecordIOReader(rio0).map(exits_once_on_a_worker, num_threads=2)
got, raised = [], []
while True:
    try:
        item = c.read_next()
    except SystemExit as e:
        raised.append(e.code)
        continue
    if item is None:
        break
    got.append(key(item))
c.close()
assert fired and raised == [3], (fired, raised)
assert got == ref, (len(got), len(ref))
print("OK")
'''


def test_a_system_exit_raised_by_the_function_on_a_worker_thread_is_raised_and_loses_nothing():
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _WORKER_RAISES, timeout=120)


# reset() or close() right after an interrupt in the calling thread's piece,
# while a worker has not yet taken the piece posted to it: the interrupted
# chunk is dropped (its pool retired) without an error ignored in the
# dropping ("release unlocked lock" left the chunk held: the next read waited
# forever for the retired pool), and the next epoch is exact.  The long
# switch interval keeps the GIL on this thread until it blocks, so the worker
# cannot have taken its piece by then.
_DROP_AFTER_INTERRUPT = _PRELUDE + r'''
sys.setswitchinterval(30)
unraisable = []
sys.unraisablehook = lambda u: unraisable.append(repr(u.exc_value))
ref = rest(rl.RecordIOReader(rio0).map(ident, num_threads=2))
for how in ("reset", "close"):
    c = interrupted_threaded_map()
    if how == "reset":
        c.reset()
        assert rest(c) == ref, how
    c.close()
    assert not unraisable, (how, unraisable)
    # close() leaves no worker behind, the retired pool's included
    left = [t.name for t in threading.enumerate() if t.name.startswith("readerlib-map")]
    assert not left, (how, left)
print("OK")
'''


def test_reset_or_close_right_after_an_interrupt_in_a_threaded_map_drops_the_chunk_cleanly():
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _DROP_AFTER_INTERRUPT, timeout=120)


# fork() after an interrupt that left a threaded map's chunk held with pieces
# out: the child has none of the parent's workers, so it calls what is left
# itself (waiting for them hung the child).
_FORK_AFTER_INTERRUPT = _PRELUDE + r'''
sys.setswitchinterval(30)          # (the workers are still on their pieces at the fork)
ref = rest(rl.RecordIOReader(rio0).map(ident, num_threads=2))
c = interrupted_threaded_map()
pid = os.fork()
if pid == 0:
    signal.alarm(60)                 # a hang fails the child, not the run
    ok = rest(c) == ref
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert status == 0, status
assert rest(c) == ref
c.close()
print("OK")
'''


def test_a_fork_after_an_interrupt_in_a_threaded_map_reads_on_in_the_child():
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _FORK_AFTER_INTERRUPT, timeout=180)


# A MemoryError of the threaded map's own (making a chunk's lists, decoding
# its inputs, its output block; at each allocation of the read that fills the
# second chunk in turn) leaves the chunk held, as an interrupt does: one
# MemoryError lost the whole chunk (1024 items), the next read dropping it.
_NOMEMORY_THREADED_MAP = _PRELUDE + r'''
big, _ = make_byte_files(d, ["rio"], [2500], chunk_size=1024, rec_size=24)
schema = rl.RecordIOReader(big[0]).schema


def make():
    return rl.RecordIOReader(big[0]).map(_same, num_threads=2, output_schema=schema)


ref = rest(make())
hits = 0
for n in range(1, 40):
    got, raised = epoch_with_failed_allocation(make, 1024, n)     # after the first chunk's items
    hits += raised
    assert got == ref, (n, len(ref) - len(got))
assert hits > 0
print("OK")
'''


def test_a_memory_error_filling_a_threaded_maps_chunk_loses_nothing():
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NOMEMORY_THREADED_MAP, timeout=180)


# Likewise one item at a time: a MemoryError of the reader's own (decoding the
# input for the function or predicate, encoding the output) leaves the input
# held -- it was lost; a MemoryError the function raises stays its item's
# outcome (raised, dropped: tests/readers/test_transforms.py).  The functions
# here allocate nothing (a MemoryError in them would be theirs).
_NOMEMORY_ONE_AT_A_TIME = _PRELUDE + r'''
SOURCES = {
    "map": lambda: rl.RecordIOReader(rio0).map(_same),
    "map_batch": lambda: rl.RecordIOReader(rio0).map(_same).batch(8),
    "filter": lambda: rl.RecordIOReader(rio0).filter(bool),
    "filter_batches": lambda: rl.RecordIOReader(rio0).batch(4).filter(bool),
    "map_batches": lambda: rl.RecordIOReader(rio0).batch(8).map_batches(_same),
    "map_batches_inner": lambda: rl.RecordIOReader(rio0).batch(8).map_batches(_same).take(10 ** 6),
}
for name, hits in failed_allocations_lose_nothing(SOURCES, 40).items():
    assert hits > 0, name
print("OK")
'''


def test_a_memory_error_of_a_map_or_filter_of_its_own_loses_nothing():
    run_ok_script(f"SUPPORT = {SUPPORT_DIR!r}\n" + _NOMEMORY_ONE_AT_A_TIME, timeout=180)
