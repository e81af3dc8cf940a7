""".prefetch() over multi_pass / repeat changes nothing a chain yields.

The prefetcher's thread reads up to `capacity` items ahead, so it starts the
next pass of a multi_pass or repeat below (a c_reset of the reader below: a
shuffle's epoch moves on) before the consumer gets there.  What the chain
yields in every epoch after a reset() -- at any point, also mid-pass and with
the thread well into the next pass -- and what a state saved at any point
restores to must be what the chain without the prefetcher gives, whatever
the thread's timing (tests/readers/test_chain_fuzz.py found both wrong).

Each case runs twice: with the thread let fill its ring before every reset
and get_state (`settle`: the read-ahead as far as it goes), and without
(whatever it has done by then).  Every prefetcher has a timeout, so a hang
fails instead of blocking.
"""
import json
import time

import numpy as np
import pytest

import readerlib as rl
from readerlib.readers._prefetch import PrefetchReader

from helpers import assert_checkpoint_equal, canon

N = 10                      # items of the source
PASSES = 3
CAPS = (1, 2, 3, 64)


def _prefetchers(r):
    return [x for x in r._walk() if isinstance(x, PrefetchReader)]


def settle(r, wait_s=5.0):
    """Let every prefetcher's thread read ahead as far as it goes: a full ring, the
    end, or (a ring that waits to drain to half before it refills) no change for a while."""
    deadline = time.monotonic() + wait_s
    for p in reversed(_prefetchers(r)):    # the inner first: the outer reads its items
        last, same = -1, 0
        while time.monotonic() < deadline and same < 4:
            t = p.thread
            q = p.qsize
            if t is None or not t.is_alive() or q >= p.capacity:
                break
            same = same + 1 if q == last else 0
            last = q
            time.sleep(0.002)


def build(cap, passes="multi_pass", shuffle="buffer", where="end", n=N, extra=None):
    """source -> shuffle -> multi_pass/repeat -> [extra] -> prefetch (cap None: none)."""
    r = rl.ArrayReader(np.arange(n)).shuffle(4, seed=3, mode=shuffle)
    r = r.multi_pass(PASSES) if passes == "multi_pass" else r.repeat(PASSES)
    if extra == "shard":
        r = r.shard(2, 1)
    elif extra == "filter":
        r = r.filter(lambda x: int(x[0]) % 3 != 1)
    elif extra == "map":
        src = rl.ArrayReader(np.arange(1))
        r = r.map(lambda x: x, output_schema=src.schema)
    if where == "batch":                 # below a batch: the batch reads the prefetcher
        if cap is not None:
            r = r.prefetch(cap, timeout=30)
        return r.batch(4)
    if cap is not None:
        r = r.prefetch(cap, timeout=30)
    if where == "nested" and cap is not None:
        r = r.map(lambda x: x, output_schema=r.schema).prefetch(2, timeout=30)
    return r


def ids(item):
    if isinstance(item[0], rl.LoDTensor):
        return [int(v) for v in np.asarray(item[0].data).ravel()]
    return [int(item[0])]


def run_script(r, script, wait):
    """Per epoch: read `k` items (None: to the end), then reset().  All ids read, per epoch."""
    out = []
    for k in script:
        got = []
        while k is None or len(got) < k:
            item = r.read_next()
            if item is None:
                break
            got.append(ids(item))
        out.append(got)
        if wait:
            settle(r)
        r.reset()
    if wait:
        settle(r)
    out.append([ids(x) for x in iter(r.read_next, None)])     # and the epoch after
    r.close()
    return out


# reset after: nothing, one item, mid-pass, the last item of pass 1, the first
# of pass 2, mid pass 3, the end (asked for or not)
SCRIPTS = [
    [None, None, None],
    [0, 1, 5],
    [N - 1, N, N + 1],
    [N, 2 * N, PASSES * N],
    [PASSES * N - 1, 2 * N + 3, None],
]


@pytest.mark.parametrize("wait", [True, False], ids=["settled", "racing"])
@pytest.mark.parametrize("shuffle", ["buffer", "window"])
@pytest.mark.parametrize("passes", ["multi_pass", "repeat"])
@pytest.mark.parametrize("cap", CAPS)
def test_epochs_after_resets_are_those_without_prefetch(cap, passes, shuffle, wait):
    for script in SCRIPTS:
        want = run_script(build(None, passes, shuffle), script, False)
        got = run_script(build(cap, passes, shuffle), script, wait)
        assert got == want, (script, got, want)


@pytest.mark.parametrize("where,extra", [("batch", None), ("nested", None), ("end", "shard"),
                                         ("end", "filter"), ("end", "map"), ("nested", "shard")])
@pytest.mark.parametrize("cap", [1, 3, 64])
def test_epochs_after_resets_with_readers_around_the_prefetcher(cap, where, extra):
    scripts = SCRIPTS if where != "batch" else [[None, None], [0, 1, 2], [2, 3, 7], [5, 8, 1]]
    for script in scripts:
        want = run_script(build(None, where=where, extra=extra), script, False)
        for wait in (True, False):
            got = run_script(build(cap, where=where, extra=extra), script, wait)
            assert got == want, (script, wait, got, want)


def _rest_and_next(r):
    rest = [ids(x) for x in iter(r.read_next, None)]
    r.reset()
    nxt = [ids(x) for x in iter(r.read_next, None)]
    r.close()
    return rest, nxt


@pytest.mark.parametrize("wait", [True, False], ids=["settled", "racing"])
@pytest.mark.parametrize("shuffle", ["buffer", "window"])
@pytest.mark.parametrize("passes", ["multi_pass", "repeat"])
@pytest.mark.parametrize("cap", CAPS)
def test_states_restore_exactly(cap, passes, shuffle, wait):
    # at 0 (nothing read: the thread may be in pass 2 already), mid-pass, at a pass
    # boundary (the last item of a pass read, and the first of the next), at the end
    for epoch in (0, 1):
        for pos in (0, 3, N - 1, N, N + 1, 2 * N, PASSES * N):
            r = build(cap, passes, shuffle)
            for _ in range(epoch):
                for _ in range(pos // 2 + 1):
                    r.read_next()
                if wait:
                    settle(r)
                r.reset()
            head = [ids(r.read_next()) for _ in range(pos)]
            if wait:
                settle(r)
            state = json.loads(json.dumps(r.get_state()))
            assert state["position"] == pos
            rest, nxt = _rest_and_next(r)
            plain = build(None, passes, shuffle)
            for _ in range(epoch):
                for _ in range(pos // 2 + 1):
                    plain.read_next()
                plain.reset()
            assert head == [ids(plain.read_next()) for _ in range(pos)]
            assert (rest, nxt) == _rest_and_next(plain), (epoch, pos)
            c = build(cap, passes, shuffle)
            c.set_state(state)
            assert _rest_and_next(c) == (rest, nxt), (epoch, pos)


@pytest.mark.parametrize("where,extra", [("batch", None), ("nested", None), ("end", "shard"),
                                         ("end", "filter")])
@pytest.mark.parametrize("cap", [1, 3, 64])
def test_states_restore_exactly_with_readers_around_the_prefetcher(cap, where, extra):
    total = len(run_script(build(None, where=where, extra=extra), [], False)[0])
    for pos in sorted({0, 1, total // 3, total // 2, total - 1, total}):
        r = build(cap, where=where, extra=extra)
        head = [ids(r.read_next()) for _ in range(pos)]
        settle(r)
        state = json.loads(json.dumps(r.get_state()))
        rest, nxt = _rest_and_next(r)
        plain = build(None, where=where, extra=extra)
        assert head == [ids(plain.read_next()) for _ in range(pos)]
        assert _rest_and_next(plain) == (rest, nxt), pos
        c = build(cap, where=where, extra=extra)
        c.set_state(state)
        assert _rest_and_next(c) == (rest, nxt), pos


@pytest.mark.parametrize("pos", [0, 1, 2])
def test_state_of_a_batched_multi_pass_under_prefetch(pos):
    # a batch spans the two passes; the thread has read both passes by the time it is saved
    def make(pf):
        r = rl.ArrayReader(np.arange(100)).shuffle(50, seed=0).multi_pass(2).batch(64)
        return r.prefetch(2, timeout=30) if pf else r
    r = make(True)
    head = [ids(r.read_next()) for _ in range(pos)]
    settle(r)
    state = json.loads(json.dumps(r.get_state()))
    rest, nxt = _rest_and_next(r)
    plain = make(False)
    assert head == [ids(plain.read_next()) for _ in range(pos)]
    assert _rest_and_next(plain) == (rest, nxt)
    c = make(True)
    c.set_state(state)
    assert _rest_and_next(c) == (rest, nxt)


def test_endless_repeat_under_prefetch_keeps_no_history():
    # one pass per item: the thread starts a pass per item it reads; what it notes
    # of them is dropped once the consumer has gone past (memory stays bounded)
    r = rl.ArrayReader(np.arange(1)).shuffle(1, seed=0).repeat().prefetch(8, timeout=30)
    for _ in range(5000):
        assert r.read_next() is not None
    settle(r)
    assert len(r._read_ahead_steps()) <= 8 + 2 * r.capacity + 2
    r.reset()
    assert r.read_next() is not None
    r.close()


# --------------------------------------------- a pass step or reset that raised, retried
# A shuffle moves its epoch before it resets the reader below it.  When that
# reset raised (Ctrl-C while open_files joins its threads: injected here) and
# the call was retried -- a repeat/multi_pass's pass step by the next read, a
# reset() by calling it again -- the shuffle moved its epoch a second time:
# the pass was read in an order no uninterrupted run draws, and a state saved
# in it replays the step once, so a job resumed from it repeated some records
# and lost others.  Under a prefetcher whose thread had read ahead into the
# next pass, a retried reset() also lost the undoing of that read-ahead: the
# next epoch differed from the chain's without the prefetcher.  Now a retried
# step or reset starts from the epoch states its failed attempt started from.
class Interrupted(KeyboardInterrupt):
    pass


@pytest.fixture
def rio_files(tmp_path):
    schema = rl.Schema([rl.Field("x", "int64")])
    paths = []
    for f in range(2):
        p = str(tmp_path / f"p{f}.rio")
        with rl.RecordIOWriter(p, schema) as w:
            w.write_batch({"x": np.arange(f * N // 2, (f + 1) * N // 2, dtype=np.int64)})
        paths.append(p)
    return paths


@pytest.fixture
def interrupt_join(monkeypatch):
    """arm(): the next join of an open_files worker (its reset or close) raises Interrupted, once."""
    import threading
    armed, hits = [False], []
    join = threading.Thread.join

    def interrupted_join(self, timeout=None):
        if armed[0] and self.name.startswith("readerlib-open_files"):
            armed[0] = False
            hits.append(threading.current_thread().name)
            raise Interrupted("Ctrl-C in open_files' join")
        return join(self, timeout)

    monkeypatch.setattr(threading.Thread, "join", interrupted_join)

    def arm():
        armed[0] = True
    arm.hits = hits
    return arm


def _wait_threads_left(r, timeout=30.0):
    """Wait until every prefetcher's thread in `r` has read ahead to the end and
    left the chain.  Below a repeat its pass steps join open_files' workers: a
    Ctrl-C armed before it left landed in the thread's join (a quarter of the
    runs), not in the reset() the test interrupts; settle() can return while
    the thread still reads, on a loaded machine."""
    deadline = time.monotonic() + timeout
    for p in _prefetchers(r):
        while p._thread_inside() and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not p._thread_inside(), "the prefetch thread did not reach the end"


def _files_chain(paths, passes, where, cap=64):
    r = rl.open_files(paths).shuffle(4, seed=3)
    if where == "above":                 # the pass step resets a prefetcher (the loop's thread)
        r = r.prefetch(cap, timeout=30)
    r = r.multi_pass(PASSES) if passes == "multi_pass" else r.repeat(PASSES)
    if where == "below":                 # the step runs on the prefetcher's thread
        r = r.prefetch(cap, timeout=30)
    return r


@pytest.mark.parametrize("where", ["none", "above"])
@pytest.mark.parametrize("passes", ["multi_pass", "repeat"])
def test_a_pass_step_that_raised_and_is_retried_moves_each_epoch_once(rio_files, interrupt_join, passes, where):
    plain = _files_chain(rio_files, passes, where)
    want = [[[canon(x)] for x in plain] for _ in range(2)]     # (as assert_checkpoint_equal keeps them)
    plain.close()
    built = []

    def make():
        c = _files_chain(rio_files, passes, where)
        built.append(c)
        if len(built) == 1:
            interrupt_join()             # the first chain's first pass step raises, once
        return c

    got = assert_checkpoint_equal(make, epochs=2, retry=(Interrupted,))
    assert interrupt_join.hits == ["MainThread"]
    assert got == want                   # what an uninterrupted run yields
    for epoch in want:                   # every record once a pass
        for k in range(PASSES):
            assert sorted(epoch[k * N:(k + 1) * N]) == sorted([canon((np.int64(i),))] for i in range(N))


@pytest.mark.parametrize("where", ["none", "below", "above"])
@pytest.mark.parametrize("passes", ["multi_pass", "repeat"])
def test_a_reset_that_raised_and_is_retried_starts_the_next_epoch_once(rio_files, interrupt_join, passes, where):
    def run(interrupt):
        r = _files_chain(rio_files, passes, where)
        head = [ids(r.read_next()) for _ in range(3)]
        _wait_threads_left(r)            # (below: the thread reads ahead into the next passes)
        if interrupt:
            interrupt_join()
            with pytest.raises(Interrupted):
                r.reset()
        r.reset()
        state = json.loads(json.dumps(r.get_state()))
        epoch = [ids(x) for x in iter(r.read_next, None)]
        r.close()
        return head, state, epoch

    want = run(False)
    got = run(True)
    assert got == want
    c = _files_chain(rio_files, passes, where)
    c.set_state(got[1])
    assert [ids(x) for x in iter(c.read_next, None)] == got[2]
    c.close()


@pytest.mark.parametrize("where", ["none", "below"])
def test_a_chain_whose_reset_raised_is_read_only_after_reset_again(rio_files, interrupt_join, where):
    # reading a chain reset part-way read the readers reset (the next epoch)
    # beside those that were not; as after a set_state that failed part-way
    # (and as a prefetcher did already), reads raise until reset() succeeds
    r = _files_chain(rio_files, "repeat", where)
    for _ in range(3):
        r.read_next()
    _wait_threads_left(r)
    interrupt_join()
    with pytest.raises(Interrupted):
        r.reset()
    with pytest.raises(RuntimeError, match=r"reset\(\)"):
        r.read_next()
    r.reset()
    epoch = [ids(x) for x in iter(r.read_next, None)]
    assert sorted(v for x in epoch for v in x) == sorted(list(range(N)) * PASSES)
    r.close()


@pytest.mark.gpu
@pytest.mark.cuda_emu          # without a GPU: the staging logic on tests/support/fake_cupy.py
@pytest.mark.parametrize("cap", [1, 3])
def test_device_staging_counts_the_batches_handed_out(xp_gpu, cap):
    # device="cuda" takes up to `capacity` batches ahead of the ones it hands out:
    # the next epoch after a reset is the one the batches handed out lead to
    def make(device):
        r = rl.ArrayReader(np.arange(6)).shuffle(4, seed=3).multi_pass(3).batch(2)
        return r.prefetch(cap, device="cuda", timeout=30) if device else r

    def batch_ids(b):
        return [int(v) for v in xp_gpu.asnumpy(b[0].data).ravel()]

    for k in (0, 2, 3, 4, 8):
        plain = make(False)
        for _ in range(k):
            plain.read_next()
        plain.reset()
        want = [ids(x) for x in iter(plain.read_next, None)]
        r = make(True)
        for _ in range(k):
            r.read_next()
        settle(r)
        r.reset()
        assert [batch_ids(x) for x in iter(r.read_next, None)] == want, k
        r.close()
