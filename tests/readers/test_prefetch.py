"""PrefetchReader: same items, bounded memory, errors that surface, no hangs.

Tests that could hang if the implementation were wrong run in a subprocess
with a timeout, so a hang fails the test instead of blocking CI.
"""
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import numpy as np
import pytest

import readerlib as rl
from readerlib.readers._prefetch import PrefetchReader

from helpers import assert_same_items as _assert_same, snapshot_item as _snapshot

X = rl.Schema([rl.Field("x", "int64")])


# ------------------------------------------------------------------ helpers
def _arrays(n=203, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": np.arange(n, dtype=np.int64),
        "v": rng.random((n, 3)).astype(np.float32),
        "s": [rng.random((int(k), 2)).astype(np.float32) for k in rng.integers(0, 9, n)],
    }


def _epoch(reader):
    return [_snapshot(item) for item in reader]


def _child_env():
    """The environment for a child interpreter that imports the readerlib under test.

    The tests may run against an installed package (`python -P -m pytest`), so
    the child gets the directory this process imported readerlib from, not
    the source tree.
    """
    where = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    return dict(os.environ, PYTHONPATH=where + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run_script(code, timeout=60, cwd=None):
    """Run `code` in a fresh interpreter; return (returncode, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=_child_env(), cwd=cwd or tempfile.gettempdir())
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _counting_reader(n, counter, sleep=0.0):
    def make():
        for i in range(n):
            counter[0] += 1
            if sleep:
                time.sleep(sleep)
            yield np.int64(i)
    return rl.PythonReader(make, X)


# ------------------------------------------------------- same items, same order
CHAINS = {
    "fixed-batches": lambda: rl.ArrayReader({k: v for k, v in _arrays().items() if k != "s"}).batch(16),
    "lod-batches": lambda: rl.ArrayReader(_arrays()).batch(7),
    "lod-shuffled": lambda: rl.ArrayReader(_arrays()).shuffle(50, seed=5).batch(10, drop_last=True),
    "instances": lambda: rl.ArrayReader(_arrays()).shuffle(20, seed=1),
    "one-field-zero-copy": lambda: rl.ArrayReader(np.arange(1000, dtype=np.float64)).batch(33),
}


@pytest.mark.parametrize("capacity", [1, 2, 5, 64])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_same_items_same_order(chain, capacity):
    want = CHAINS[chain]()
    got = PrefetchReader(CHAINS[chain](), capacity=capacity)
    for _ in range(3):                      # three epochs: shuffles draw the same new orders
        _assert_same(_epoch(got), _epoch(want))
    got.close()


def test_recordio_chain_and_fluent_decorators_above(tmp_path):
    path = str(tmp_path / "d.rio")
    a = _arrays(500)
    schema = rl.Schema([rl.Field("x", "int64"), rl.Field("v", "float32", (3,)),
                        rl.Field("s", "float32", (2,), lod_level=1)])
    with rl.RecordIOWriter(path, schema, chunk_size=512) as w:
        for i in range(500):
            w.write((a["x"][i], a["v"][i], a["s"][i]))
    want = rl.RecordIOReader(path).shuffle(64, seed=2).batch(32)
    got = PrefetchReader(rl.RecordIOReader(path).shuffle(64, seed=2).batch(32), capacity=3)
    _assert_same(_epoch(got), _epoch(want))
    # decorators above a prefetcher (MultiPass resets it from inside c_next)
    mp = rl.MultiPassReader(PrefetchReader(rl.RecordIOReader(path).batch(100)), 3)
    assert [len(b[0].data) for b in mp] == [100] * 15


def test_nested_prefetchers_and_a_shuffle_of_prefetched_batches():
    want = rl.ArrayReader(_arrays()).batch(5).shuffle(7, seed=3)
    got = PrefetchReader(PrefetchReader(rl.ArrayReader(_arrays()).batch(5), capacity=2),
                         capacity=3).shuffle(7, seed=3)
    for _ in range(2):
        _assert_same(_epoch(got), _epoch(want))
    got.close()


def test_batches_stay_valid_after_the_reader_moves_on():
    p = PrefetchReader(rl.ArrayReader(_arrays()).batch(9), capacity=2)
    kept = list(p)                           # every batch kept while later ones are produced
    _assert_same([_snapshot(b) for b in kept], _epoch(rl.ArrayReader(_arrays()).batch(9)))


def test_reset_mid_epoch_restarts_the_chain():
    want = rl.ArrayReader(_arrays()).shuffle(30, seed=9).batch(8)
    got = PrefetchReader(rl.ArrayReader(_arrays()).shuffle(30, seed=9).batch(8), capacity=3)
    for _ in range(4):
        got.read_next()
        want.read_next()
    got.reset()
    want.reset()
    _assert_same(_epoch(got), _epoch(want))


def test_end_of_epoch_is_sticky_until_reset():
    p = PrefetchReader(rl.ArrayReader(np.arange(5)).batch(2))
    assert len(list(p)) == 3
    assert p.read_next() is None and p.read_next() is None
    p.reset()
    assert p.read_next() is not None


# ------------------------------------------------------------ bounded queue
@pytest.mark.parametrize("capacity", [1, 2, 3, 8])
def test_queue_is_bounded(capacity):
    produced = [0]
    p = PrefetchReader(_counting_reader(1000, produced), capacity=capacity)
    low = capacity // 2          # a full ring refills once it has drained to capacity // 2
    peak = 0
    for k in range(0, 20):
        deadline = time.monotonic() + 5
        while produced[0] - k <= low and time.monotonic() < deadline:
            time.sleep(0.002)               # let the thread catch up
        time.sleep(0.02)
        ahead = produced[0] - k
        assert low < ahead <= capacity      # ready items, and never more than capacity
        assert p.qsize == ahead
        peak = max(peak, ahead)
        assert int(p.read_next()[0]) == k
    assert peak == capacity                 # it does fill the ring
    p.close()


# ---------------------------------------------------------- errors surface
def _gen_raising_at(k):
    def user_items():
        for i in range(100):
            if i == k:
                raise ValueError(f"bad instance {i} in shard-7.txt")
            yield np.int64(i)
    return user_items


def test_python_reader_error_surfaces_with_message_and_traceback():
    k = 13
    p = PrefetchReader(rl.PythonReader(_gen_raising_at(k), X), capacity=4)
    got = []
    with pytest.raises(ValueError, match=r"bad instance 13 in shard-7\.txt") as info:
        for item in p:
            got.append(int(item[0]))
    assert got == list(range(k))             # every item before the error, in order
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "user_items" in frames            # the frame that raised, from the thread
    assert any(f.endswith("PrefetchReader.read_next") for f in frames)   # ... via the consumer
    assert any(f.endswith("_Pump._run") for f in frames)
    # raised once: the next read reads on as the chain below does (the
    # generator ended with its error, so the epoch ends)
    assert p.read_next() is None
    p.reset()
    assert [int(p.read_next()[0]) for _ in range(5)] == [0, 1, 2, 3, 4]
    p.close()


def test_error_below_batch_and_shuffle_surfaces():
    chain = rl.PythonReader(_gen_raising_at(40), X).shuffle(8, seed=0).batch(4)
    p = PrefetchReader(chain, capacity=2)
    n = 0
    with pytest.raises(ValueError, match="bad instance 40"):
        for b in p:
            n += len(b[0].data)
    assert n <= 40


def test_corrupt_recordio_chunk_in_the_middle(tmp_path):
    path = str(tmp_path / "bad.rio")
    schema = rl.Schema([rl.Field("x", "int64"), rl.Field("s", "float32", lod_level=1)])
    with rl.RecordIOWriter(path, schema, chunk_size=256) as w:
        for i in range(400):
            w.write((i, np.full(i % 5, i, np.float32)))
    offs, nrec = rl.RecordIOReader(path).chunk_table()
    assert len(offs) >= 6
    mid = len(offs) // 2
    bad_at = int(offs[mid]) + 40              # inside the middle chunk's body
    with open(path, "r+b") as f:
        f.seek(bad_at)
        byte = f.read(1)
        f.seek(bad_at)
        f.write(bytes([byte[0] ^ 0x5A]))
    before = int(nrec[:mid].sum())

    p = PrefetchReader(rl.RecordIOReader(path).batch(10), capacity=3)
    xs = []
    with pytest.raises(rl.RecordIOError) as info:
        for b in p:
            xs.extend(b[0].data.tolist())
    err = info.value
    assert path in str(err) and err.path == path and err.offset is not None
    assert str(err.offset) in str(err)
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert any(f.endswith("RecordIOReader.c_next") for f in frames)     # the thread's frames
    assert any(f.endswith("_Pump._run") for f in frames)
    assert xs == list(range(len(xs))) and len(xs) <= before
    # the same error as the plain chain raises
    with pytest.raises(rl.RecordIOError) as plain:
        for _ in rl.RecordIOReader(path).batch(10):
            pass
    assert str(plain.value) == str(err)
    # reset() works: the chain starts again from the top
    p.reset()
    assert p.read_next()[0].data.tolist() == list(range(10))
    p.close()


# ------------------------------------------------------------------ timeout
def _stalling_reader(stall_at, seconds, epochs_that_stall=1):
    epochs = [0]

    def make():
        epochs[0] += 1
        for i in range(5):
            if i == stall_at and epochs[0] <= epochs_that_stall:
                time.sleep(seconds)
            yield np.int64(i)
    return rl.PythonReader(make, X)


def test_stall_raises_timeout_error_naming_the_chain():
    p = PrefetchReader(_stalling_reader(2, 1.5).batch(1), capacity=2, timeout=0.3)
    assert int(p.read_next()[0].data[0]) == 0
    assert int(p.read_next()[0].data[0]) == 1
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"PythonReader") as info:
        p.read_next()
    waited = time.monotonic() - t0
    assert 0.25 < waited < 1.2
    assert "BatchReader" in str(info.value) and "0.3" in str(info.value)
    # waiting again picks the item up once the reader is past its stall
    deadline = time.monotonic() + 10
    while True:
        try:
            item = p.read_next()
            break
        except TimeoutError:
            assert time.monotonic() < deadline
    assert int(item[0].data[0]) == 2
    p.close()


def test_no_timeout_waits_for_a_slow_reader():
    p = PrefetchReader(_stalling_reader(1, 0.5), capacity=1)
    assert [int(x[0]) for x in p] == [0, 1, 2, 3, 4]


# ------------------------------------------------------------ validation
def test_bad_arguments():
    src = lambda: rl.ArrayReader(np.arange(4))
    with pytest.raises(TypeError):
        PrefetchReader([1, 2, 3])
    with pytest.raises(ValueError):
        PrefetchReader(src(), capacity=0)
    with pytest.raises(TypeError):
        PrefetchReader(src(), capacity=1.5)
    with pytest.raises(ValueError):
        PrefetchReader(src(), timeout=0)
    with pytest.raises(TypeError):
        PrefetchReader(src(), timeout="1")
    with pytest.raises(ValueError, match="device"):
        PrefetchReader(src().batch(2), device="tpu")
    with pytest.raises(TypeError, match=r"\.batch\(\)"):
        PrefetchReader(src(), device="cuda")


def test_repr_and_closed_reader():
    p = PrefetchReader(rl.ArrayReader(np.arange(4)).batch(2), capacity=3, timeout=2)
    assert repr(p).startswith("PrefetchReader(BatchReader(") and "capacity=3" in repr(p)
    p.close()
    p.close()                                    # idempotent
    assert p.closed and p.thread is None
    with pytest.raises(ValueError, match="closed"):
        p.read_next()


# ------------------------------------------------- threads end, never hang
def _live_prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("readerlib-prefetch")]


def test_close_during_prefetch_stops_the_thread_and_closes_the_chain():
    base = rl.ArrayReader(np.arange(100_000)).batch(10)
    p = PrefetchReader(base, capacity=4)
    p.read_next()
    t = p.thread
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 1.0
    assert not t.is_alive()
    assert base.closed


def test_close_while_the_thread_is_inside_a_slow_user_function():
    produced = [0]
    inner = _counting_reader(100, produced, sleep=3.0)
    p = PrefetchReader(inner, capacity=2)
    time.sleep(0.2)                               # the thread is asleep in the user's function
    t = p.thread
    t0 = time.monotonic()
    p.close()                                     # bounded wait, then the thread closes the chain
    assert time.monotonic() - t0 < 2.0
    t.join(10)
    assert not t.is_alive() and inner.closed


def test_dropping_a_running_prefetcher_stops_its_thread():
    p = PrefetchReader(rl.ArrayReader(np.arange(100_000)).batch(3), capacity=2)
    p.read_next()
    t = p.thread
    del p
    gc.collect()
    t.join(5)
    assert not t.is_alive()


def test_prefetcher_in_a_reference_cycle_is_collected_and_stops():
    class Holder:
        pass
    h = Holder()
    h.p = PrefetchReader(rl.ArrayReader(np.arange(100_000)).batch(3), capacity=2)
    h.self = h
    h.p.read_next()
    t = h.p.thread
    del h
    gc.collect()
    t.join(5)
    assert not t.is_alive()


SUBPROCESS_PRELUDE = """
import os, signal, sys, threading, time
import numpy as np
import readerlib as rl
from readerlib.readers._prefetch import PrefetchReader
X = rl.Schema([rl.Field("x", "int64")])
# A process started from a non-interactive shell's background job inherits
# SIGINT ignored, and Python then installs no handler: install it explicitly.
signal.signal(signal.SIGINT, signal.default_int_handler)
def stalling():
    yield np.int64(0)
    time.sleep(600)
    yield np.int64(1)
"""


def test_interpreter_exit_with_running_prefetchers_does_not_hang():
    code = SUBPROCESS_PRELUDE + """
full = PrefetchReader(rl.ArrayReader(np.arange(10**6)).batch(7), capacity=4)   # thread waits for room
stuck = PrefetchReader(rl.PythonReader(stalling, X), capacity=2)              # thread inside sleep(600)
busy = PrefetchReader(rl.ArrayReader(np.arange(10**7)).shuffle(1000, seed=0).batch(3), capacity=64)
full.read_next(); stuck.read_next(); busy.read_next()
print("exiting", flush=True)
"""
    rc, out, err, secs = _run_script(code, timeout=60)
    assert rc == 0, err
    assert "exiting" in out and secs < 30


def test_keyboard_interrupt_while_waiting_on_a_stalled_reader():
    code = SUBPROCESS_PRELUDE + """
p = PrefetchReader(rl.PythonReader(stalling, X), capacity=2)       # no timeout: would wait forever
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    for item in p:
        pass
except KeyboardInterrupt:
    print("interrupted after %.2f s" % (time.monotonic() - t0), flush=True)
t0 = time.monotonic()
p.close()
print("closed in %.2f s" % (time.monotonic() - t0), flush=True)
"""
    rc, out, err, secs = _run_script(code, timeout=60)
    assert rc == 0, err
    assert "interrupted after" in out and "closed in" in out
    assert float(out.split("interrupted after ")[1].split()[0]) < 2.0
    assert secs < 30


def test_keyboard_interrupt_in_the_loop_body_then_exit():
    code = SUBPROCESS_PRELUDE + """
p = PrefetchReader(rl.ArrayReader(np.arange(10**6)).shuffle(100, seed=0).batch(5), capacity=3)
try:
    for i, b in enumerate(p):
        if i == 50:
            raise KeyboardInterrupt        # what Ctrl-C in the training step looks like
except KeyboardInterrupt:
    print("interrupted", flush=True)
# no close(): interpreter exit must still be clean
"""
    rc, out, err, secs = _run_script(code, timeout=60)
    assert rc == 0, err
    assert "interrupted" in out and secs < 30


def test_uncaught_error_in_the_loop_exits_with_its_traceback():
    code = SUBPROCESS_PRELUDE + """
p = PrefetchReader(rl.ArrayReader(np.arange(10**6)).batch(5), capacity=3)
for i, b in enumerate(p):
    if i == 10:
        raise RuntimeError("step failed")
"""
    rc, out, err, secs = _run_script(code, timeout=60)
    assert rc == 1 and "step failed" in err and secs < 30


def test_fork_while_running_requires_reset_in_the_child():
    code = SUBPROCESS_PRELUDE + """
p = PrefetchReader(rl.ArrayReader(np.arange(1000)).batch(10), capacity=3)
p.read_next()
time.sleep(0.1)
pid = os.fork()
if pid == 0:
    try:
        p.read_next()
        os._exit(3)
    except RuntimeError as e:
        ok = "reset()" in str(e)
    p.reset()
    xs = [int(v) for b in p for v in b[0].data]
    os._exit(0 if ok and xs == list(range(1000)) else 4)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
assert p.read_next()[0].data.tolist() == list(range(10, 20))     # the parent goes on
"""
    rc, out, err, secs = _run_script(code, timeout=60)
    assert rc == 0, err
    assert "child 0" in out


def test_reset_after_timeout_waits_for_the_stalled_call():
    # reset() must not touch the chain while the thread is inside it
    p = PrefetchReader(_stalling_reader(1, 0.6), capacity=1, timeout=0.2)
    p.read_next()
    with pytest.raises(TimeoutError):
        p.read_next()
    t0 = time.monotonic()
    p.reset()                                    # joins the thread (it leaves the sleep by itself)
    assert time.monotonic() - t0 < 3.0
    assert [int(x[0]) for x in p] == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.cuda_emu          # without a GPU: the staging logic on tests/support/fake_cupy.py
@pytest.mark.parametrize("capacity", [1, 3])
def test_cuda_prefetch_matches_host_batches(xp_gpu, capacity):
    cp = xp_gpu
    want = _epoch(rl.ArrayReader(_arrays()).shuffle(40, seed=3).batch(8))
    p = PrefetchReader(rl.ArrayReader(_arrays()).shuffle(40, seed=3).batch(8), capacity=capacity,
                       device="cuda")
    got = []
    for batch in p:
        for t in batch:
            assert t.device == "cuda"
        got.append([(cp.asnumpy(t.data), [cp.asnumpy(l) for l in t.lod]) for t in batch])
    _assert_same(got, want)
    p.reset()
    assert len(list(p)) == len(want)
    p.close()


@pytest.mark.gpu
@pytest.mark.cuda_emu          # without a GPU: the staging logic on tests/support/fake_cupy.py
def test_cuda_prefetch_error_after_staged_batches(xp_gpu):
    p = PrefetchReader(rl.PythonReader(_gen_raising_at(20), X).batch(4), capacity=3, device="cuda")
    n = 0
    with pytest.raises(ValueError, match="bad instance 20"):
        for b in p:
            n += int(b[0].data.shape[0])
    assert n == 20


@pytest.mark.gpu
@pytest.mark.cuda_emu          # without a GPU: the staging logic on tests/support/fake_cupy.py
@pytest.mark.parametrize("at", [1, 2, 5])
def test_cuda_prefetch_interrupted_while_staging_loses_nothing(xp_gpu, monkeypatch, at):
    # A KeyboardInterrupt inside stage() (Python code: the packing, CuPy's
    # calls) left its host batch read and not staged, and the position counted
    # it: reading on skipped it.  Now the batch is staged first next time and
    # the position counts only batches handed out.
    from readerlib.readers._cuda_stager import CudaStager
    cp = xp_gpu

    def make():
        return PrefetchReader(rl.ArrayReader(_arrays()).shuffle(40, seed=3).batch(8), capacity=2,
                              device="cuda")
    want = [[(cp.asnumpy(t.data), [cp.asnumpy(l) for l in t.lod]) for t in b] for b in make()]
    real = CudaStager.stage
    calls = [0]

    def stage(self, hb):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return real(self, hb)

    monkeypatch.setattr(CudaStager, "stage", stage)
    p = make()
    got, interrupted = [], 0
    while True:
        try:
            b = p.read_next()
        except KeyboardInterrupt:
            interrupted += 1
            state = p.get_state()
            r = make()                  # a checkpoint taken right after it restores to the same batch
            r.set_state(state)
            rest = [[(cp.asnumpy(t.data), [cp.asnumpy(l) for l in t.lod]) for t in x] for x in r]
            r.close()
            _assert_same(got + rest, want)
            continue
        if b is None:
            break
        got.append([(cp.asnumpy(t.data), [cp.asnumpy(l) for l in t.lod]) for t in b])
    assert interrupted == 1
    _assert_same(got, want)
    p.close()


# ------------------------------------------------------ checkpoint / resume
def test_get_state_set_state_through_prefetch_at_every_position():
    def make():
        return PrefetchReader(rl.ArrayReader(_arrays(90)).shuffle(30, seed=4).batch(8), capacity=3)
    ref = make()
    ref.reset()                                   # epoch 1: the shuffle's second order
    states, items = [], []
    while True:
        states.append(ref.get_state())
        item = ref.read_next()
        if item is None:
            break
        items.append(_snapshot(item))
    assert len(items) == 12
    for pos, state in enumerate(states):
        r = make()
        r.set_state(state)
        _assert_same(_epoch(r), items[pos:])
        r.close()
    ref.close()
