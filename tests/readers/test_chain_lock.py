"""One chain, one lock: reading a reader from inside a chain (ReaderBase._check_chain).

A decorator joins its reader's chain (readers/_base.pyx, _Chain): the readers
of a chain share one lock, a count of closed readers and the list of their
prefetchers.  Before, each reader had its own lock, and
- reading an inner reader in one thread while the outer reader was read in
  another ran the same shuffle buffer from two threads: SIGSEGV;
- reading a chain after closing its source (`with RecordIOReader(p) as r:
  chain = r.shuffle(..).batch(..)`, then reading the chain outside the `with`)
  read freed chunk buffers: SIGSEGV;
- reading a reader that a PrefetchReader's thread reads raced with that thread.

The crash-prone cases run in a fresh interpreter with a time limit.
"""
import os
import textwrap
import threading

import numpy as np
import pytest

import readerlib as rl
from helpers import run_ok_script

N = 2048


def _write(path, n=N, width=1024):
    x = np.zeros((n, width), dtype=np.uint8)
    x[:, :8] = np.arange(n, dtype=np.int64).view(np.uint8).reshape(n, 8)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (width,))])) as w:
        w.write_batch({"x": x})
    return x


def _ids_of_batch(b):
    return b[0].data.reshape(-1, b[0].data.shape[-1])[:, :8].copy().view(np.int64).ravel()


def _ids_of_instance(inst):
    return np.asarray(inst[0])[:8].copy().view(np.int64)


# -- crashes before: in a subprocess ------------------------------------------

_SETUP = """
import os, sys, tempfile, threading
import numpy as np
import readerlib as rl
d = tempfile.mkdtemp()
p = os.path.join(d, "a.rio")
n, width = {n}, {width}
x = np.zeros((n, width), dtype=np.uint8)
x[:, :8] = np.arange(n, dtype=np.int64).view(np.uint8).reshape(n, 8)
with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (width,))])) as w:
    w.write_batch({{"x": x}})
def src_of(kind):
    return rl.RecordIOReader(p) if kind == "recordio" else rl.ArrayReader({{"x": x}})
def must_raise(call, exc, *words):
    try:
        call()
    except exc as e:
        assert all(w in str(e) for w in words), e
    else:
        raise AssertionError(f"{{call}} did not raise {{exc.__name__}}")
"""


@pytest.mark.parametrize("kind", ["recordio", "array"])
@pytest.mark.parametrize("width", [1024, 65536])
def test_inner_reader_read_in_another_thread_is_serialised(kind, width):
    """An inner reader (the shuffle) read in one thread while the batch above it
    is read in another: every record goes to exactly one of them, per epoch,
    and nothing crashes (SIGSEGV before, 3 runs of 3)."""
    code = _SETUP.format(n=1024, width=width) + textwrap.dedent(f"""
        src = src_of({kind!r})
        sh = src.shuffle(128, seed=1)
        b = sh.batch(16)
        got_inner, errors = [], []
        epoch_done = threading.Event()
        go = threading.Event()
        def inner():
            go.wait()
            while not epoch_done.is_set():
                try:
                    r = sh.read_next()
                except Exception as e:
                    errors.append(repr(e)); return
                if r is None:
                    return
                got_inner.append(int(np.asarray(r[0])[:8].copy().view(np.int64)[0]))
        for epoch in range(3):
            got_inner.clear()
            epoch_done.clear(); go.clear()
            th = threading.Thread(target=inner)
            th.start()
            outer = []
            go.set()
            while (bb := b.read_next()) is not None:
                outer.extend(bb[0].data.reshape(-1, width)[:, :8].copy().view(np.int64).ravel().tolist())
            epoch_done.set()
            th.join(60)
            assert not th.is_alive()
            assert not errors, errors
            both = sorted(outer + got_inner)
            assert both == list(range(n)), (len(outer), len(got_inner), len(both))
            b.reset()
        print("OK")
    """)
    run_ok_script(code, timeout=180)


@pytest.mark.parametrize("kind", ["recordio", "array"])
def test_reading_a_chain_after_its_source_closed_raises(kind):
    """`with RecordIOReader(p) as src: chain = src.shuffle().batch()`, then the
    chain read after the `with`: a ValueError naming the closed reader and
    the one reading it (SIGSEGV before for RecordIO; ArrayReader went on)."""
    code = _SETUP.format(n=512, width=1024) + textwrap.dedent(f"""
        with src_of({kind!r}) as src:
            b = src.shuffle(64, seed=1).batch(8)
            first = b.read_next()
        for call in (b.read_next, b.reset, b.get_state, lambda: b._skip(3), lambda: list(b)):
            must_raise(call, ValueError, "closed reader", type(src).__name__)
        mid = b.reader
        must_raise(mid.read_next, ValueError, type(src).__name__, "ShuffleReader")
        b.close()                   # still closes cleanly
        assert b.closed and mid.closed
        print("OK")
    """)
    run_ok_script(code, timeout=120)


def test_closing_a_middle_reader_stops_the_chain_above(tmp_path):
    code = _SETUP.format(n=512, width=1024) + textwrap.dedent("""
        src = src_of("recordio")
        sh = src.shuffle(64, seed=1)
        b = sh.batch(8)
        b.read_next()
        sh.close()
        assert src.closed          # a decorator's close closes what it reads
        must_raise(b.read_next, ValueError, "closed reader", "ShuffleReader")
        print("OK")
    """)
    run_ok_script(code, timeout=120)


# -- prefetchers own the chain below them --------------------------------------

def test_reader_under_a_running_prefetcher_is_refused(tmp_path):
    """A PrefetchReader's thread starts reading at once; reading, resetting or
    saving a reader below it (or another reader built on them) raises a
    RuntimeError naming the prefetcher, and the prefetcher's own output is
    untouched: every record exactly once, in the order of a chain without the
    refused calls."""
    p = str(tmp_path / "a.rio")
    _write(p)
    def build():
        src = rl.RecordIOReader(p)
        sh = src.shuffle(256, seed=3)
        return src, sh, sh.batch(32).prefetch(4)
    ref = [_ids_of_batch(b) for b in build()[2]]
    src, sh, pf = build()
    sibling = src.batch(4)           # another reader built on the prefetcher's source
    got = [_ids_of_batch(pf.read_next())]
    for call in (src.read_next, sh.read_next, src.reset, sh.get_state,
                 lambda: sh.set_state({}), lambda: sh._skip(2), sibling.read_next):
        with pytest.raises(RuntimeError, match="PrefetchReader's thread reads this chain"):
            call()
    got += [_ids_of_batch(b) for b in iter(pf.read_next, None)]
    assert len(got) == len(ref) and all(np.array_equal(a, b) for a, b in zip(got, ref))
    assert sorted(np.concatenate(got).tolist()) == list(range(N))
    # the prefetcher's own state and the readers above it are not refused
    pf.reset()
    st = pf.get_state()
    pf.read_next()
    pf.set_state(st)
    pf.close()


def test_reader_is_free_again_once_its_prefetcher_is_gone(tmp_path):
    p = str(tmp_path / "a.rio")
    _write(p, n=256)
    src = rl.RecordIOReader(p)
    pf = src.prefetch(2)
    with pytest.raises(RuntimeError):
        src.read_next()
    pf.read_next()
    del pf                         # dropped: its thread is told to stop and leaves after its item
    import gc
    gc.collect()
    rest = sum(1 for _ in iter(src.read_next, None))     # waits for that thread to leave, then reads on where it stopped
    assert 0 < rest < 256
    src.reset()
    assert sum(1 for _ in src) == 256


def test_closing_a_reader_under_a_prefetcher_closes_the_prefetcher_first(tmp_path):
    """close() of a source a prefetcher's thread reads: the prefetcher is closed
    first (its thread stopped), then the source; no crash, reads then raise."""
    code = _SETUP.format(n=2048, width=4096) + textwrap.dedent("""
        for rep in range(5):
            src = src_of("recordio")
            pf = src.shuffle(256, seed=rep).batch(16).prefetch(4)
            pf.read_next()
            src.close()
            assert pf.closed and src.closed
            must_raise(pf.read_next, ValueError, "closed reader")
        print("OK")
    """)
    run_ok_script(code, timeout=120)


# -- the lock is the chain's ------------------------------------------------

def test_a_chain_shares_one_lock_and_a_holder_joins_it(tmp_path):
    p = str(tmp_path / "a.rio")
    _write(p, n=64)
    src = rl.RecordIOReader(p)
    b = src.shuffle(8, seed=0).batch(4)
    assert len({id(r._shared_chain) for r in b._walk()}) == 1
    other = rl.ArrayReader({"x": np.zeros((8, 1024), np.uint8)})
    h = rl.ReaderHolder(src)
    top = h.batch(2)
    assert top._shared_chain is h._shared_chain is src._shared_chain
    h.reset_reader(other)
    assert other._shared_chain is h._shared_chain is top._shared_chain
    assert sum(1 for _ in top) == 4


def _slow_source():
    """A Python source of 8 int64 instances that stops inside its third until
    `release` is set (`inside` says it got there)."""
    inside = threading.Event()
    release = threading.Event()
    def gen():
        for i in range(8):
            if i == 2:
                inside.set()
                release.wait(30)
            yield (np.array([i], dtype=np.int64),)
    return inside, release, rl.PythonReader(gen, rl.Schema([rl.Field("i", "int64", (1,))]))


def test_a_thread_blocked_on_the_chain_lock_waits_for_the_read(tmp_path):
    """While one thread is inside a read of the outer reader (a slow Python
    source), a read of the inner reader waits for it instead of running beside
    it."""
    inside, release, src = _slow_source()
    b = src.batch(4)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", b.read_next()))
    t.start()
    assert inside.wait(30)
    got = []
    t2 = threading.Thread(target=lambda: got.append(src.read_next()))
    t2.start()
    t2.join(0.3)
    assert t2.is_alive()           # waiting for the batch's read, not interleaving with it
    release.set()
    t.join(30)
    t2.join(30)
    assert np.asarray(out["b"][0].data).ravel().tolist() == [0, 1, 2, 3]
    assert int(np.asarray(got[0][0]).ravel()[0]) == 4


def test_a_holder_does_not_swap_its_reader_under_a_read(tmp_path):
    """ReaderHolder.reset_reader waits for a read of the chain that is inside
    the held reader (it dropped that reader under the read before), and is
    refused while a prefetcher's thread reads the holder."""
    inside, release, slow = _slow_source()
    h = rl.ReaderHolder(slow)
    b = h.batch(4)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", b.read_next()))
    t.start()
    assert inside.wait(30)
    new = rl.ArrayReader({"i": np.arange(100, 104, dtype=np.int64).reshape(4, 1)})
    t2 = threading.Thread(target=lambda: h.reset_reader(new))
    t2.start()
    t2.join(0.3)
    assert t2.is_alive()           # waiting for the read inside the old reader
    release.set()
    t.join(30)
    t2.join(30)
    assert np.asarray(out["b"][0].data).ravel().tolist() == [0, 1, 2, 3]
    b.reset()
    assert [int(v) for bb in b for v in np.asarray(bb[0].data).ravel()] == [100, 101, 102, 103]
    pf = rl.ReaderHolder(rl.ArrayReader({"i": np.arange(8, dtype=np.int64).reshape(8, 1)}))
    top = pf.prefetch(2)
    with pytest.raises(RuntimeError, match="PrefetchReader's thread"):
        pf.reset_reader(new)
    top.close()


def test_a_dropped_prefetcher_chain_is_freed_by_reference_counting(tmp_path):
    """The chain's list of prefetchers holds weak references only: a dropped
    chain with a prefetcher goes (its file closed) when its thread leaves,
    without waiting for the cyclic garbage collector."""
    import gc
    p = str(tmp_path / "a.rio")
    _write(p, n=256)
    def fds_of_file():
        return sum(1 for fd in os.listdir("/proc/self/fd")
                   if os.path.realpath(f"/proc/self/fd/{fd}") == os.path.realpath(p))
    gc.collect()
    gc.disable()
    try:
        src = rl.RecordIOReader(p)
        pf = src.shuffle(64, seed=0).batch(8).prefetch(2)
        pf.read_next()
        thread = pf.thread
        assert fds_of_file() >= 1
        del src, pf
        thread.join(10)
        assert not thread.is_alive()
        assert fds_of_file() == 0
    finally:
        gc.enable()
