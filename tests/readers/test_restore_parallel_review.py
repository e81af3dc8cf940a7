"""Review of the restore's pooled fill (issue 16 item 3): the cases its own
tests leave out.

- a chunk cache that cannot be opened for a pool thread (too many open files,
  the file replaced): the fill is the serial one, not an error the serial
  fill would never have raised;
- no descriptor is left open after a pooled restore, after a corrupt chunk
  met in a piece, and a retry on the same reader once the file is good again
  restores exactly;
- a mix of inline records of the common size, inline records of other sizes
  and records too big for a cell: exactly the rest of the epoch and the whole
  next epoch, for the serial, emulated and pooled fills;
- set_num_threads(1) (in a child, with a time limit);
- crafted position strings: a ValueError or the packed positions, never a
  crash (hypothesis, in a child so that a crash is a failure, not a lost run).
"""
import errno
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl
from readerlib import _parallel
from readerlib.readers import _random_access, _shuffle
from helpers import corrupt_chunk
from test_resume_bounded import _state_at
from test_restore_chunk_load import VAR, _good_file_state, _items, _shuffle_of, _write_fixed
from test_restore_parallel import BUF, _fill_mode, _restore


def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    return _write_fixed(str(tmp_path_factory.mktemp("rev") / "f.rio"), 60_000, chunk_size=4096)


def test_a_thread_cache_that_cannot_open_leaves_the_fill_serial(fixed, monkeypatch):
    # the pooled fill opens a chunk cache per extra thread; when that fails
    # (EMFILE) the serial fill, which needs none, still restores
    make = lambda: rl.RecordIOReader(fixed).shuffle(BUF, seed=4)
    ref = _items(make())
    k = 25_000
    st = _state_at(make, k)
    real = _random_access.open_random_access
    calls = []

    def failing(source, *a, **kw):
        # the restore's own cache opens first (the probe), then one a thread
        # past the first: the last of those fails
        calls.append(source)
        if len(calls) >= allow + 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(source, *a, **kw)

    for threads in (2, 3):
        calls.clear()
        allow = threads - 1
        monkeypatch.setattr(_random_access, "open_random_access", failing)
        with _fill_mode("pool"):
            _shuffle._restore_parallel_settings(threads=threads)
            before = _fds()
            other, sh = _restore(make, st)
            assert sh._par_tids is None               # no pieces: the serial fill
            assert _items(other) == ref[k:], threads
            other.close()
            assert _fds() == before


def test_no_descriptor_is_left_open_and_a_retry_on_the_same_reader_restores(tmp_path):
    n, k = 60_000, 20_000
    good, make, st, starts = _good_file_state(tmp_path, n, k, BUF)
    bad = str(tmp_path / "bad" / "f.rio")
    shutil.copy(good, bad)
    ref = _items(make(good))
    src = st["buffer"]["source_position"]
    c = int(np.searchsorted(starts, src - 25_000, side="right") - 1)   # met in a piece
    for mode in ("emulated", "pool"):
        with _fill_mode(mode):
            before = _fds()
            ok = make(good)
            ok.set_state(st)
            # (a READERLIB_NO_THREADS build's pool does not split)
            assert (_shuffle_of(ok)._par_tids is not None) == (mode == "emulated" or _parallel.threads_enabled())
            ok.close()
            assert _fds() == before, "a pooled restore left a descriptor open"
            shutil.copy(good, bad)
            corrupt_chunk(bad, chunk=c, at=60)
            other = make(bad)
            with pytest.raises(rl.RecordIOError, match=r"bad/f\.rio.*byte offset"):
                other.set_state(st)
            # the same reader, the file good again (rewritten in place)
            with open(good, "rb") as f, open(bad, "r+b") as g:
                g.write(f.read())
            other.set_state(st)
            assert _shuffle_of(other).restores == 1
            assert _items(other) == ref[k:], mode
            other.close()
            assert _fds() == before, "an error in a piece left a descriptor open"


def _write_mixed(path, n, chunk_size=8192):
    # most records 16 bytes of pad (the common, preset size); some other small
    # sizes (inline, not preset); some too big for any cell (referenced)
    rng = np.random.default_rng(7)
    kind = rng.random(n)
    with rl.RecordIOWriter(path, VAR, chunk_size=chunk_size) as w:
        for i in range(n):
            m = 16 if kind[i] < 0.9 else (int(rng.integers(0, 40)) if kind[i] < 0.97 else 3000)
            w.write((np.int64(i), np.full(m, i % 251, np.uint8)))
    return path


@pytest.mark.parametrize("seed", [0, 11])
def test_mixed_sizes_restore_exactly_once_over_this_epoch_and_the_next(tmp_path, seed):
    path = _write_mixed(str(tmp_path / "m.rio"), 40_000)
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=seed)
    ref_chain = make()
    ep0 = _items(ref_chain)
    ref_chain.reset()
    ep1 = _items(ref_chain)
    ref_chain.close()
    assert sorted(i for i, _ in ep0) == list(range(40_000)) and ep0 != ep1
    for k in (1, 5_000, 21_000, 33_000):
        st = _state_at(make, k)
        for mode in ("serial", "emulated", "pool"):
            with _fill_mode(mode):
                other, sh = _restore(make, st)
                stats = sh._memory_stats()
                rest = _items(other)
                other.reset()
                nxt = _items(other)
                other.close()
            assert rest == ep0[k:], (mode, k)
            assert nxt == ep1, (mode, k, "the next epoch")
            if k < 33_000:
                assert stats["inline_records"] > 0 and stats["blocks"] > 0, stats   # both kinds held


_CHILD = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[2:]
    import readerlib as rl
    from readerlib.readers import _shuffle
    from test_resume_bounded import _state_at
    from test_restore_chunk_load import _items, _shuffle_of
    path = sys.argv[1]
    if "{how}" == "set1":
        rl.set_num_threads(1)
    _shuffle._inline_settings(enabled=True, min_payload=0, cell=0)
    _shuffle._restore_parallel_settings(min_records=0, threads=0)
    make = lambda: rl.RecordIOReader(path).shuffle(12000, seed=2)
    ref = _items(make())
    st = _state_at(make, 30000)
    other = make()
    other.set_state(st)
    sh = _shuffle_of(other)
    assert sh.restores == 1
    assert sh._par_tids is None, sh._par_tids      # one thread: no pieces
    assert _items(other) == ref[30000:]
    print("OK")
""")


@pytest.mark.parametrize("how", ["set1"])
def test_one_thread_restores_serially(fixed, how):
    # (READERLIB_NO_THREADS is a build switch, not read at run time)
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    support = os.path.join(os.path.dirname(here), "support")
    p = subprocess.run([sys.executable, "-c", _CHILD.replace("{how}", how), fixed, here, support],
                       env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr


_FUZZ = textwrap.dedent("""
    import base64, numpy as np
    from hypothesis import given, settings, strategies as hs, HealthCheck
    from readerlib.readers import _shuffle

    ALPHA = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="

    def check(text, src, n):
        try:
            got = _shuffle._unpack_positions(text, src, n, "t")
        except ValueError:
            return
        assert got.shape == (n,)
        assert n == 0 or (got.min() >= 0 and got.max() < src), (text, src, n)

    @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(hs.integers(1, 1 << 33), hs.integers(0, 64), hs.data())
    def fuzz(src, n, data):
        pos = np.array(data.draw(hs.lists(hs.integers(0, src - 1), min_size=n, max_size=n)), np.int64)
        good = _shuffle._pack_positions(pos, src) if src <= (1 << 32) else "p33:AAAA"
        how = data.draw(hs.sampled_from(["truncate", "flip", "insert", "head", "garbage", "n"]))
        if how == "truncate":
            text = good[:data.draw(hs.integers(0, len(good)))]
        elif how == "flip":
            i = data.draw(hs.integers(0, max(len(good) - 1, 0)))
            text = good[:i] + data.draw(hs.sampled_from(list(ALPHA) + ["\\x00", "\\u00e9", ":", "-", "\\U0001f600"])) + good[i + 1:]
        elif how == "insert":
            i = data.draw(hs.integers(0, len(good)))
            text = good[:i] + data.draw(hs.text(max_size=6)) + good[i:]
        elif how == "head":
            text = data.draw(hs.sampled_from(["p", "p:", "p-1:", "p99:", "p00:", "p\\u00b2:", "p\\u0663:", "q5:", ":"])) + good.partition(":")[2]
        elif how == "garbage":
            text = data.draw(hs.text(max_size=40))
        else:
            text = good
            n = data.draw(hs.integers(0, 70))
        check(text, src, n)
        check(base64.b64encode(text.encode("utf-8", "surrogatepass")).decode(), src, n)   # the old form's path

    fuzz()
    print("OK")
""")


def test_crafted_position_strings_raise_value_error_and_never_crash():
    p = subprocess.run([sys.executable, "-c", _FUZZ], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def _plus(x):
    return (x[0] + 1_000_000,)


@pytest.mark.parametrize("chain", ["map", "map_filter", "filter"])
def test_a_restore_through_a_map_or_a_filter_reads_the_mapped_records(fixed, chain):
    # a MapReader's records by index are fn(its source's): a piece must never
    # read the source's chunk cache underneath it
    def make():
        r = rl.RecordIOReader(fixed)
        if chain in ("map", "map_filter"):
            r = r.map(_plus)
        if chain in ("map_filter", "filter"):
            r = r.filter(lambda x: int(np.asarray(x[0]).reshape(-1)[0]) % 7 != 3)
        return r.shuffle(BUF, seed=6)
    ref = _items(make())
    k = 20_000
    st = _state_at(make, k)
    for mode in ("emulated", "pool"):
        with _fill_mode(mode):
            other = make()
            other.set_state(st)
            rest = _items(other)
            other.close()
        assert rest == ref[k:], (chain, mode)


from hypothesis import given, settings, strategies as hs


@settings(max_examples=150, deadline=None)
@given(hs.integers(0, 32), hs.integers(1, 3000), hs.integers(0, 2**31), hs.randoms(use_true_random=False))
def test_the_file_order_sorts_every_span_width(bits, n, base, rnd):
    # spans of every bit width (1 to 4 passes, 1 to 10 bits a digit): the keys
    # are (pos - lo) << 32 | slot in increasing order, every slot once
    span = (1 << bits) - 1
    n = min(n, span + 1)
    pos = np.array(rnd.sample(range(span + 1), n), np.int64) + base
    if n > 1:
        pos[rnd.randrange(n)] = base                    # the span's both ends
        pos[rnd.randrange(n)] = base + span
        pos = np.unique(pos)
        rnd.shuffle(pos)
    keys = _shuffle._file_order_py(pos)
    slots = (keys & 0xFFFFFFFF).astype(np.int64)
    assert sorted(slots.tolist()) == list(range(len(pos)))
    assert np.array_equal(pos[slots], np.sort(pos))
    assert np.array_equal((keys >> np.uint64(32)).astype(np.int64), np.sort(pos) - pos.min())


# the children's common start: a 60,000-record file, a pooled restore forced, the reference epoch
_POOL_CHILD = 'import sys, os, signal, threading\nsys.path[:0] = sys.argv[2:]\nimport numpy as np, readerlib as rl\nfrom readerlib.readers import _shuffle\nfrom test_resume_bounded import _state_at\nfrom test_restore_chunk_load import _items, _shuffle_of, _write_fixed\npath = _write_fixed(sys.argv[1], 60000, chunk_size=4096)\n_shuffle._inline_settings(enabled=True, min_payload=0, cell=0)\n_shuffle._restore_parallel_settings(min_records=0, threads=2)\nrl.set_num_threads(2)\nmake = lambda: rl.RecordIOReader(path).shuffle(12000, seed=2)\nref = _items(make()); st = _state_at(make, 20000)\n'


def _run_child(script, tmp_path):
    """Run one of the scripts below in a fresh interpreter (time limit: a
    deadlock fails, it does not hang the run); it must print OK."""
    here = os.path.dirname(os.path.abspath(__file__))
    support = os.path.join(os.path.dirname(here), "support")
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "f.rio"), here, support],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]


_FORK = _POOL_CHILD + 'stop = False; bad = []\ndef loop():\n    while not stop:\n        o = make(); o.set_state(st)\n        if _items(o) != ref[20000:]: bad.append(1)\n        o.close()\nth = threading.Thread(target=loop); th.start()\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n        try:\n            o = make(); o.set_state(st)\n            ok = _items(o) == ref[20000:] and (_shuffle_of(o)._par_tids is not None) == rl._parallel.threads_enabled()\n            os._exit(0 if ok else 3)\n        except BaseException:\n            os._exit(4)\n    _, s = os.waitpid(pid, 0)\n    assert os.WEXITSTATUS(s) == 0, s\nstop = True; th.join()\nassert not bad\nprint("OK")\n'


def test_a_fork_while_another_thread_restores_on_the_pool(tmp_path):
    # a DataLoader-style fork while a second thread's restore fills on the
    # pool: every child restores on its own pool, exactly (a child, with a
    # time limit: a deadlock is a failure, not a hung run)
    _run_child(_FORK, tmp_path)


_INTERRUPT = _POOL_CHILD + 'armed = [False]\ndef h(sig, frm):\n    if armed[0]:\n        armed[0] = False\n        raise KeyboardInterrupt\nsignal.signal(signal.SIGALRM, h)\nfd0 = len(os.listdir("/proc/self/fd"))\nhits = 0\nfor i in range(60):\n    o = make()\n    try:\n        armed[0] = True\n        signal.setitimer(signal.ITIMER_REAL, 0.0002 * (i % 20 + 1))\n        o.set_state(st)\n        armed[0] = False\n        signal.setitimer(signal.ITIMER_REAL, 0)\n        got = _items(o)\n        assert got == ref[20000:], i\n    except KeyboardInterrupt:\n        hits += 1\n        signal.setitimer(signal.ITIMER_REAL, 0)\n        s = o._memory_stats()\n        assert s["blocks"] <= 2, s\n    finally:\n        armed[0] = False\n    o.close()\nassert len(os.listdir("/proc/self/fd")) == fd0, "descriptors left"\no = make(); o.set_state(st); assert _items(o) == ref[20000:]; o.close()\nprint("OK", hits)\n'


@pytest.mark.parametrize("threads", [1, 2])
def test_keyboard_interrupts_during_pooled_restores(tmp_path, threads):
    # SIGALRM handlers raising KeyboardInterrupt at 0.2-4 ms into set_state,
    # 60 times: each restore either completes exactly or raises
    # KeyboardInterrupt; no descriptor is left, no crash, no hang, and a
    # restore afterwards is exact (a child, with a time limit)
    _run_child(_INTERRUPT.replace("_restore_parallel_settings(min_records=0, threads=2)",
                                  f"_restore_parallel_settings(min_records=0, threads={threads})"), tmp_path)
