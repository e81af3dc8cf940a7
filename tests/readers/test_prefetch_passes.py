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
