"""The prefetcher's ring (readerlib/readers/_prefetch.pyx).

Items pass between the thread and the consumer without the mutex, on two
counters (slot = counter & mask, the slots a power of two, the capacity any
number); the consumer drops the references of the items of one block that it
handed out in a row together, when the block changes.  What that must keep:
every item once and in order at every capacity, an exact state at every
position (also with the prefetcher below a batch, where every instance goes
through the ring), blocks freed neither early nor never, errors after the
items before them, close with items in the ring.
"""
import gc
import time

import numpy as np
import pytest

import readerlib as rl
from readerlib import _core
from readerlib.readers._prefetch import PrefetchReader

from helpers import assert_checkpoint_equal, run_ok_script

CAPACITIES = [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65]
ROW = 64 << 10                       # 64 KiB rows: chunks of 16 rows are 1 MiB blocks, which the
                                     # block pool takes back and hands to the next chunk load


def _rows(n):
    x = np.empty((n, ROW), np.uint8)
    for i in range(n):
        x[i] = i % 251
    return x, np.arange(n, dtype=np.int64)


def _big_chain(x, labels, capacity, batch):
    """Two fields (not zero-copy): the source encodes 16 rows per pooled block."""
    return PrefetchReader(rl.ArrayReader((x, labels), chunk_records=16), capacity=capacity).batch(batch)


def _arrays(n=90, seed=4):
    rng = np.random.default_rng(seed)
    return {
        "x": np.arange(n, dtype=np.int64),
        "s": [rng.random((int(k), 2)).astype(np.float32) for k in rng.integers(0, 6, n)],
    }


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_every_item_once_in_order_at_every_capacity(capacity):
    # 1000 instances wrap every ring many times (its slots: capacity rounded
    # up to a power of two); two epochs; below a batch and alone.
    p = PrefetchReader(rl.ArrayReader(np.arange(1000, dtype=np.int64)), capacity=capacity)
    for _ in range(2):
        got = [int(v[0]) for v in p]
        assert got == list(range(1000))
    p.close()
    b = rl.ArrayReader(np.arange(1000, dtype=np.int64)).prefetch(capacity).batch(7)
    for _ in range(2):
        got = np.concatenate([t[0].data for t in b])
        np.testing.assert_array_equal(got, np.arange(1000))
    b.close()


@pytest.mark.parametrize("capacity", [1, 3, 64])
def test_blocks_are_freed_neither_early_nor_never(capacity):
    # The consumer holds the ring's references to the items of one block it
    # handed out in a row and drops them together when the block changes: one
    # reference too few and a chunk's block goes back to the pool (and is
    # filled by the next chunk load) while the batch above still copies from
    # it -- wrong rows; one too many and no block ever goes back.
    x, labels = _rows(160)
    _core._pool_drain()
    r = _big_chain(x, labels, capacity, 5)
    for _ in range(2):
        k = 0
        for b in r:
            lab = b[1].data.reshape(-1)
            np.testing.assert_array_equal(lab, np.arange(k, k + 5))
            rows = b[0].data.reshape(5, ROW)
            for j in range(5):
                assert (rows[j] == (k + j) % 251).all(), (k + j, rows[j][:4])
            k += 5
        assert k == 160
    r.close()
    del r, b, rows
    gc.collect()
    n, _ = _core._pool_stats()
    assert n >= 1, "no chunk block went back to the pool: references were kept"


@pytest.mark.parametrize("capacity", [1, 3, 5, 64])
def test_state_below_a_batch_at_every_position(capacity):
    # Below a batch, the batch's get_state counts instances through the
    # prefetcher: the ring's items (and those the consumer holds) are read-ahead.
    def make():
        return rl.ArrayReader(_arrays()).shuffle(30, seed=4).prefetch(capacity).batch(4)
    assert sum(1 for _ in make()) == 23
    assert_checkpoint_equal(make, epochs=2)        # every position of epochs 0 and 1


@pytest.mark.parametrize("capacity", [1, 3, 8])
def test_state_of_instances_at_every_position(capacity):
    def make():
        return PrefetchReader(rl.ArrayReader(np.arange(40, dtype=np.int64)), capacity=capacity)
    ref = make()
    for pos in range(41):
        # let the thread read ahead (a ring refills once it has drained to
        # capacity // 2): the state must not count what it read ahead
        deadline = time.monotonic() + 5
        while ref.qsize < min(capacity // 2 + 1, 40 - pos) and time.monotonic() < deadline:
            time.sleep(0.001)
        state = ref.get_state()
        r = make()
        r.set_state(state)
        assert [int(v[0]) for v in r] == list(range(pos, 40))
        r.close()
        v = ref.read_next()
        assert (v is None) if pos == 40 else int(v[0]) == pos
    ref.close()


def _raising_at(k, n=200):
    def items():
        for i in range(n):
            if i == k:
                raise ValueError(f"bad instance {i} in shard-3")
            yield np.int64(i)
    return rl.PythonReader(items, rl.Schema([rl.Field("x", "int64")]))


@pytest.mark.parametrize("k", [0, 1, 9, 10, 63, 64, 65, 130])
def test_error_below_a_batch_after_the_batches_before_it(k):
    r = _raising_at(k).prefetch(64).batch(10)
    got = []
    with pytest.raises(ValueError, match=f"bad instance {k} in shard-3"):
        for b in r:
            got.append(b[0].data.copy())
    assert len(got) == k // 10
    if got:
        np.testing.assert_array_equal(np.concatenate(got), np.arange(k // 10 * 10))
    # raised once; reading on gives what the chain without the prefetcher
    # gives after the error (the batch's records before it, then the end)
    bare = _raising_at(k).batch(10)
    with pytest.raises(ValueError, match=f"bad instance {k}"):
        for _ in bare:
            pass
    rest = [b[0].data.copy() for b in iter(r.read_next, None)]     # (iter(r) would start an epoch)
    want = [b[0].data.copy() for b in iter(bare.read_next, None)]
    assert len(rest) == len(want) and all(np.array_equal(a, b) for a, b in zip(rest, want))
    r.close()
    bare.close()


@pytest.mark.parametrize("k", [0, 1, 5, 64])
def test_error_after_the_instances_before_it(k):
    p = PrefetchReader(_raising_at(k), capacity=5)
    got = []
    with pytest.raises(ValueError, match=f"bad instance {k} in shard-3"):
        for v in p:
            got.append(int(v[0]))
    assert got == list(range(k))
    p.reset()
    with pytest.raises(ValueError, match=f"bad instance {k}"):
        for v in p:
            pass
    p.close()


@pytest.mark.parametrize("capacity", [1, 5, 16])
def test_close_with_items_in_the_ring_and_in_the_consumers_hands(capacity):
    x, labels = _rows(96)
    _core._pool_drain()
    p = PrefetchReader(rl.ArrayReader((x, labels), chunk_records=16), capacity=capacity)
    deadline = time.monotonic() + 5
    while p.qsize < capacity and time.monotonic() < deadline:
        time.sleep(0.001)
    assert p.qsize == capacity                    # a full ring
    held = [p.read_next() for _ in range(3)]      # the consumer holds references to a block
    assert p.qsize >= capacity - 3                # (a full ring refills from capacity // 2)
    t = p.thread
    p.close()
    assert not t.is_alive()
    assert [int(h[1]) for h in held] == [0, 1, 2]
    assert all((h[0] == i % 251).all() for i, h in enumerate(held))   # still valid
    del held
    del p
    gc.collect()
    assert _core._pool_stats()[0] >= 1            # the ring's blocks were released


def test_reset_with_items_in_the_ring_starts_over():
    p = PrefetchReader(rl.ArrayReader(np.arange(500, dtype=np.int64)), capacity=7)
    for cut in (0, 1, 6, 7, 8, 250, 499):
        got = []
        for v in p:
            got.append(int(v[0]))
            if len(got) == cut:
                break
        p.reset()
        assert [int(v[0]) for v in p] == list(range(500))
        p.reset()
    p.close()


@pytest.mark.parametrize("capacity", [3, 64])
def test_skip_through_the_ring(capacity):
    # set_state on a started prefetcher skips: the ring's items first, then below
    p = PrefetchReader(rl.ArrayReader(np.arange(300, dtype=np.int64)), capacity=capacity)
    ref = PrefetchReader(rl.ArrayReader(np.arange(300, dtype=np.int64)), capacity=capacity)
    for n in (1, 2, capacity - 1, capacity, capacity + 1, 100):
        ref.reset()
        for _ in range(n):
            ref.read_next()
        state = ref.get_state()
        p.reset()
        p.read_next()
        p.set_state(state)
        assert [int(v[0]) for v in p] == list(range(n, 300))
    p.close()
    ref.close()


# Ctrl-C while a reset / set_state / close waits for the prefetch thread to
# stop, and the call retried.  On CPython 3.11 an interrupted Thread.join()
# marks the thread stopped while it is still running (threading's bpo-45274
# mend releases the running thread's own lock); the prefetcher trusted it,
# so the retried call reset or closed the chain below under the thread: the
# batch block it was copying into was freed (AddressSanitizer: heap use after
# free in BatchReader._next_fixed; glibc aborted "unaligned tcache chunk
# detected" as the thread exited), and two threads then read the chain
# (records lost).  A torchdata StatefulDataLoader job resumed after Ctrl-C hit
# it.  Now the prefetcher waits for the thread's own "left the chain" flag.
_RETRY_AFTER_CTRL_C = r"""
import signal, sys, time
import numpy as np
import readerlib as rl

how = sys.argv[1] if len(sys.argv) > 1 else HOW
N = 40
inside, slept = [0], []
def slow(x):                        # item 7 takes a second, once: the thread is in here
    inside[0] += 1
    try:
        if int(x[0]) == 7 and not slept:
            slept.append(1)
            time.sleep(1.0)
    finally:
        inside[0] -= 1
    return x

def ctrl_c(*a):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, ctrl_c)

p = rl.ArrayReader({"x": np.arange(N, dtype=np.int64)}).map(slow).batch(5).prefetch(2)
state0 = p.get_state()
first = p.read_next()
deadline = time.monotonic() + 30
while not inside[0]:                # the thread is inside slow(7)
    assert time.monotonic() < deadline
    time.sleep(0.005)
call = {"reset": p.reset, "set_state": lambda: p.set_state(state0), "close": p.close}[how]
signal.setitimer(signal.ITIMER_REAL, 0.1)
try:
    call()                          # waits for the thread: Ctrl-C there
    raise AssertionError("not interrupted")
except KeyboardInterrupt:
    pass
if how == "close":
    # closed already (no retry to come back to it): the chain below is closed
    # by the thread as it leaves (it stayed open for good)
    assert p.closed
    below = p.reader
    while not below.closed:
        assert time.monotonic() < deadline, "the chain below the prefetcher was left open"
        time.sleep(0.01)
    assert inside[0] == 0
else:
    call()                          # the retry: returns once the thread has left the chain
    assert inside[0] == 0, "the retried call went on while the prefetch thread was inside the chain"
    got = [int(v) for b in iter(p.read_next, None) for v in b[0].data]
    assert got == list(range(N)), got
    p.close()
print("OK")
"""


@pytest.mark.parametrize("how", ["reset", "set_state", "close"])
def test_a_call_retried_after_ctrl_c_in_its_wait_for_the_thread_waits_for_it_again(how):
    run_ok_script(f"HOW = {how!r}\n" + _RETRY_AFTER_CTRL_C, timeout=60)


def test_ctrl_c_while_a_run_starts_its_thread_leaves_no_run_without_one():
    # A KeyboardInterrupt inside threading.Thread() as the prefetcher started a
    # run (its first read after a reset) left that run published with no
    # thread: the next read waited for ever for its items (here: the timeout).
    run_ok_script(r"""
import sys, threading, numpy as np, readerlib as rl
p = rl.ArrayReader(np.arange(20, dtype=np.int64)).prefetch(2, timeout=5)
assert int(p.read_next()[0]) == 0
p.reset()
def tracer(frame, event, arg):
    if (event == "call" and frame.f_code.co_name == "__init__" and
            frame.f_code.co_filename.endswith("threading.py") and type(frame.f_locals.get("self")) is threading.Thread):
        sys.settrace(None)
        raise KeyboardInterrupt("in Thread()")
sys.settrace(tracer)
try:
    p.read_next()
    raise AssertionError("not interrupted")
except KeyboardInterrupt:
    pass
finally:
    sys.settrace(None)
assert [int(v[0]) for v in iter(p.read_next, None)] == list(range(20))
p.close()
print("OK")
""", timeout=60)
