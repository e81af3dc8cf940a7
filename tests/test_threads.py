"""Threads (readerlib/_parallel.pyx): fork safety, the thread-count policy, the pool,
and results that do not depend on the thread count.

Anything that can hang (a child process stuck in a thread pool inherited over
fork()) runs in a subprocess with a time limit, in its own session, so a hang
fails the test instead of stalling the suite.
"""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import readerlib as rl
from readerlib import _parallel

HANG_S = 90   # generous: the machine is shared; a healthy run takes ~1-3 s

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
needs_threads = pytest.mark.skipif(not _parallel.threads_enabled(),
                                   reason="built with READERLIB_NO_THREADS=1")


def run_script(code, *args, timeout=HANG_S):
    """Run `code` in a fresh interpreter (and session); fail on a hang or non-zero exit."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)    # the script and any child it forked
        out, err = p.communicate()
        pytest.fail(f"hung for {timeout} s (deadlock?)\nstdout:\n{out}\nstderr:\n{err}")
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out


# ---- fork safety ---------------------------------------------------------------

# Chunks of 4 MiB (64 KiB records): a chunk's checksum and a batch's copy are
# big enough to run on several threads in the parent before the fork.
_WRITE_BIG = """
import os, sys
import numpy as np
import readerlib as rl
path = sys.argv[1]
x = np.random.default_rng(0).integers(0, 256, size=(96, 65536), dtype=np.uint8)
with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (65536,))]), chunk_size=4 << 20) as w:
    w.write_batch({"x": x})
"""

_FORK_AND_WAIT = """
def fork_and_check(child):
    pid = os.fork()
    if pid == 0:
        try:
            ok = child()
        except BaseException:
            import traceback; traceback.print_exc()
            ok = False
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, f"child failed: status {status}"
"""


@needs_fork
def test_child_reads_after_parent_read_a_big_chunk(tmp_path):
    """Issue 11, finding 1 without torch: the parent checksums one >= 256 KiB chunk
    (one read_next), forks, and the child reads the whole file, twice in a row
    and through a batch of big records (parallel copies).  Hung on the OpenMP build."""
    run_script(_WRITE_BIG + _FORK_AND_WAIT + """
r = rl.RecordIOReader(path)
assert r.read_next() is not None            # parent: one chunk checksummed (threads)
big = rl.RecordIOReader(path).batch(32)
first = big.read_next()                     # parent: a 2 MiB batch copied (threads)

def child():
    n = sum(1 for _ in rl.RecordIOReader(path))
    b = [len(t[0]) for t in rl.RecordIOReader(path).shuffle(20, seed=1).batch(32)]
    again = rl.RecordIOReader(path).batch(32).read_next()
    return n == 96 and b == [32, 32, 32] and np.array_equal(again[0].data, first[0].data)

fork_and_check(child)
fork_and_check(child)          # a second child, after the parent's pool served the first
assert sum(1 for _ in rl.RecordIOReader(path)) == 96   # the parent's pool still works
print("ok")
""", tmp_path / "big.rio")


@needs_fork
def test_child_runs_kernels_after_parent_ran_them(tmp_path):
    """The kernels' parallel loops in the parent, then the same in a forked child."""
    run_script("""
import os
import numpy as np
import readerlib as rl
""" + _FORK_AND_WAIT + """
rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 256)).astype(np.float32)           # 4 MiB
idx = rng.integers(0, 4096, 8192)
logits = rng.standard_normal((200, 16, 64)).astype(np.float32)    # [T, B, V], 800 KiB
lengths = rng.integers(0, 201, 16).astype(np.int32)

def run():
    y = rl.batch_reindex(x, idx, num_threads=2)
    g = rl.batch_reindex_grad(y, idx, 4096, num_threads=2)
    (sp,), neg = rl.ctc_greedy_decoder(logits, lengths, num_threads=2)
    return y, g, (sp.indices, sp.values, sp.dense_shape, neg)

want = run()

def child():
    got = run()
    return (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
            and all(np.array_equal(a, b) for a, b in zip(got[2], want[2])))

fork_and_check(child)
print("ok")
""")


@needs_fork
@needs_threads
def test_forked_child_forgets_the_pool_and_starts_its_own():
    """Workers are re-created lazily in a child (pthread_atfork), never inherited."""
    run_script("""
import os
from readerlib import _parallel as p
p._parallel_for_py(2, 64, work=100000)
assert p._pool_workers() >= 1
pid = os.fork()
if pid == 0:
    ok = p._pool_workers() == 0                       # nothing inherited
    tids, _ = p._parallel_for_py(2, 64, work=100000)
    ok = ok and set(tids.tolist()) <= {0, 1} and p._pool_workers() == 1
    os._exit(0 if ok else 3)
_, st = os.waitpid(pid, 0)
assert os.WEXITSTATUS(st) == 0, st
print("ok")
""")


@needs_fork
def test_fork_while_another_thread_runs_parallel_loops():
    """fork() from one thread while another is inside parallel loops (the pool's
    lock may be taken, a job in flight): every child still runs its own loops."""
    run_script("""
import os, threading
import numpy as np
from readerlib import _parallel as p
import readerlib as rl
stop = threading.Event()
def spin():
    x = np.ones((2048, 512), np.float32)
    while not stop.is_set():
        tids, _ = p._parallel_for_py(2, 256, work=2000)
        assert (tids >= 0).all()
        rl.batch_reindex(x, np.arange(2048)[::-1], num_threads=2)
t = threading.Thread(target=spin)
t.start()
try:
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            tids, _ = p._parallel_for_py(2, 256, work=2000)
            y = rl.batch_reindex(np.arange(4096.0).reshape(512, 8), np.arange(512), num_threads=2)
            os._exit(0 if (tids >= 0).all() and y[-1, -1] == 4095.0 else 3)
        _, st = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(st) == 0, st
finally:
    stop.set()
    t.join()
print("ok")
""")


def test_concurrent_loops_from_several_threads_are_correct():
    """Loops started from several Python threads at once: one gets the pool, the
    others run serially on their own threads; all results are right."""
    run_script("""
import threading
import numpy as np
import readerlib as rl
from readerlib import _parallel as p
rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 256)).astype(np.float32)
idx = rng.integers(0, 4096, 4096)
want = x[idx]
errors = []
def work():
    try:
        for _ in range(30):
            tids, _ = p._parallel_for_py(2, 300, work=500)
            assert (tids >= 0).all() and (tids < 2).all()
            assert np.array_equal(rl.batch_reindex(x, idx, num_threads=2), want)
    except BaseException as e:
        errors.append(e)
ts = [threading.Thread(target=work) for _ in range(4)]
for t in ts: t.start()
for t in ts: t.join()
assert not errors, errors
print("ok")
""")


def test_torch_dataloader_workers_after_torch_and_readerlib_ran_threads(tmp_path):
    """Issue 11, finding 1 as users hit it: torch ran a big op (its OpenMP pool),
    readerlib read a big chunk, then DataLoader forks 2 workers that read."""
    pytest.importorskip("torch")
    out = run_script(_WRITE_BIG + """
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

a = torch.randn(2000, 2000)
torch.mm(a, a)                                          # torch's thread pool ran
assert rl.RecordIOReader(path).read_next() is not None  # readerlib's threads ran

class Records(IterableDataset):
    def __iter__(self):
        w = get_worker_info()
        for k, (b,) in enumerate(rl.RecordIOReader(path).batch(8)):
            if k % w.num_workers == w.id:
                yield torch.from_numpy(b.data[:, :8].copy())

dl = DataLoader(Records(), batch_size=None, num_workers=2, multiprocessing_context="fork")
rows = torch.cat(list(dl))
assert rows.shape == (96, 8), rows.shape
print("ok")
""", tmp_path / "big.rio", timeout=180)
    assert "ok" in out


# ---- the pool ------------------------------------------------------------------

@pytest.mark.parametrize("n_threads,n_items", [(1, 10), (2, 1), (2, 7), (2, 1000), (3, 64), (8, 5)])
def test_every_item_runs_once_on_a_valid_thread(n_threads, n_items):
    tids, calls = _parallel._parallel_for_py(n_threads, n_items, work=2000)
    assert (tids >= 0).all() and (tids < max(n_threads, 1)).all()
    # ranges: at most SHARES_PER_THREAD per thread, never more ranges than items
    assert 1 <= calls <= min(n_items, n_threads * _parallel.SHARES_PER_THREAD)
    if n_threads == 1 or n_items == 1:
        assert calls == 1 and (tids == 0).all()
    # contiguous ranges: a thread id changes at most once per range boundary
    assert np.count_nonzero(np.diff(tids)) <= calls - 1


def test_zero_items_and_nested_loops():
    tids, calls = _parallel._parallel_for_py(2, 0)
    assert len(tids) == 0 and calls == 0
    # a loop inside a loop's body runs serially on the thread that runs the body
    tids, calls = _parallel._parallel_for_py(2, 64, nested_threads=2, work=20000)
    assert (tids >= 0).all(), "a nested loop used the pool"


@needs_threads
def test_workers_take_part_in_long_loops():
    """With enough work, a worker claims shares (else the 'parallel' loop is serial)."""
    seen = set()
    for _ in range(20):
        _parallel._reset_backoff()       # a busy machine may have made earlier splits lose
        tids, _ = _parallel._parallel_for_py(2, 64, work=200000)
        seen |= set(tids.tolist())
        if seen == {0, 1}:
            break
    assert seen == {0, 1}


def _thread_masks():
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


@needs_threads
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux affinity")
@pytest.mark.parametrize("placement", [True, False])
def test_placement_keeps_items_and_affinity(placement):
    """After idle pauses the woken worker is often queued on the caller's CPU and
    moved off it (Design, "Placement"): every item still runs exactly once on a
    valid thread, and every thread ends with the affinity mask it had."""
    import time
    old = _parallel._set_placement(placement)
    try:
        _parallel._parallel_for_py(2, 64, work=2000)         # the workers exist
        masks = _thread_masks()
        moved = _parallel._moved_workers()
        for k in range(24):
            if k % 3 == 0:
                time.sleep(0.01)
            _parallel._reset_backoff()
            tids, calls = _parallel._parallel_for_py(2, 64, work=20000)
            assert (tids >= 0).all() and (tids < 2).all() and 1 <= calls <= 8
        after = _thread_masks()
        assert {t: m for t, m in after.items() if t in masks} == {t: masks[t] for t in after if t in masks}
        if not placement:
            assert _parallel._moved_workers() == moved
    finally:
        _parallel._set_placement(old)


@needs_threads
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_placement_with_one_allowed_cpu_moves_nothing():
    # a process held to one CPU: there is nowhere to move a worker to; the loops
    # still split (2 threads asked for) and give every item once
    run_script("""
        import os
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        from readerlib import _parallel as p
        for _ in range(10):
            p._reset_backoff()
            tids, calls = p._parallel_for_py(2, 64, work=20000)
            assert (tids >= 0).all() and (tids < 2).all(), tids
        assert p._moved_workers() == 0, p._moved_workers()
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in os.listdir("/proc/self/task"))
    """)


@needs_threads
def test_a_losing_split_makes_the_next_loops_serial():
    """A split whose worker is slow (here: the caller's items are cheap and the
    worker's are not -- as if the worker were descheduled) backs off to serial."""
    _parallel._reset_backoff()
    before = _parallel._losing_splits()
    lost = False
    for _ in range(50):
        tids, _ = _parallel._parallel_for_py(2, 64, work=20000, slow_tid=1)
        if _parallel._losing_splits() > before:
            lost = True
            break
    assert lost
    tids, calls = _parallel._parallel_for_py(2, 64, work=20000)
    assert calls == 1 and (tids == 0).all()      # the next loop ran serially
    _parallel._reset_backoff()


def test_small_work_stays_on_one_thread():
    old = rl.get_num_threads()
    try:
        rl.set_num_threads(4)
        m = _parallel.MIN_BYTES_PER_THREAD
        assert _parallel._threads_for_py(0) == 1
        assert _parallel._threads_for_py(m - 1) == 1
        assert _parallel._threads_for_py(2 * m) == 2
        assert _parallel._threads_for_py(100 * m) == 4
        rl.set_num_threads(1)
        assert _parallel._threads_for_py(100 * m) == 1
    finally:
        rl.set_num_threads(old)


@pytest.mark.parametrize("how", ["env", "call"])
def test_one_thread_means_no_worker_threads(tmp_path, how):
    """READERLIB_NUM_THREADS=1 or set_num_threads(1): big chunks, big batches and
    kernels all run on the calling thread; no worker is ever started."""
    code = _WRITE_BIG + """
if sys.argv[2] == "call":
    rl.set_num_threads(1)
from readerlib import _parallel
assert rl.get_num_threads() == 1
assert sum(len(b[0]) for b in rl.RecordIOReader(path).shuffle(30, seed=0).batch(32)) == 96
y = rl.batch_reindex(np.ones((4096, 1024), np.float32), np.arange(4096))
assert _parallel._pool_workers() == 0, _parallel._pool_workers()
print("ok")
"""
    env = dict(os.environ)
    env.pop("READERLIB_NUM_THREADS", None)
    if how == "env":
        env["READERLIB_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.rio"), how], env=env,
                       capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


def test_no_extension_links_libgomp():
    """No OpenMP runtime is loaded by readerlib (not fork-safe, spins when idle)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps")
    run_script("""
import importlib, pkgutil
import readerlib
for m in pkgutil.walk_packages(readerlib.__path__, "readerlib."):
    if m.name.split(".")[-1].startswith("_") and not m.ispkg:
        try:
            importlib.import_module(m.name)
        except ImportError:
            pass      # optional pure-Python parts (GPU, frameworks)
maps = open("/proc/self/maps").read()
assert "libgomp" not in maps and "libomp" not in maps and "libiomp" not in maps, \\
    [l for l in maps.splitlines() if "omp" in l]
print("ok")
""")


# ---- the thread count ----------------------------------------------------------

def _cgroup(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("files,want", [
    ({}, None),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 2),          # 1.5 CPUs -> 2 threads
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu.max": "400000 100000\n"}, 4),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "100000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 1),
    ({"cpu.max": "garbage\n"}, None),
])
def test_cgroup_cpu_quota(tmp_path, files, want):
    assert _parallel._cgroup_cpu_limit(_cgroup(tmp_path, files)) == want


def test_default_thread_count_policy(tmp_path):
    d = _parallel._default_num_threads
    none = str(tmp_path / "no-cgroup")
    eight = set(range(8))
    assert d({}, affinity=eight, cgroup_root=none) == 8
    assert d({}, affinity={3}, cgroup_root=none) == 1
    quota = _cgroup(tmp_path / "q", {"cpu.max": "250000 100000"})
    assert d({}, affinity=eight, cgroup_root=quota) == 3            # the quota caps affinity
    assert d({}, affinity={0, 1}, cgroup_root=quota) == 2           # and affinity caps the quota
    assert d({"OMP_NUM_THREADS": "2"}, affinity=eight, cgroup_root=none) == 2
    assert d({"OMP_NUM_THREADS": "16"}, affinity=eight, cgroup_root=none) == 8   # capped by CPUs
    assert d({"OMP_NUM_THREADS": "4,2"}, affinity=eight, cgroup_root=none) == 4  # outer level
    assert d({"OMP_NUM_THREADS": "junk"}, affinity=eight, cgroup_root=none) == 8  # ignored, as OpenMP does
    # READERLIB_NUM_THREADS wins over everything, even beyond the CPUs (the user asked)
    env = {"READERLIB_NUM_THREADS": "5", "OMP_NUM_THREADS": "1"}
    assert d(env, affinity={0}, cgroup_root=quota) == 5
    assert d({"READERLIB_NUM_THREADS": "100000"}, affinity=eight, cgroup_root=none) == _parallel.MAX_THREADS
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match="READERLIB_NUM_THREADS"):
            d({"READERLIB_NUM_THREADS": bad}, affinity=eight, cgroup_root=none)
    assert d({}, affinity=None, cgroup_root=none, cpu_count=6) in (6, len(os.sched_getaffinity(0))
                                                                  if hasattr(os, "sched_getaffinity") else 6)


@pytest.mark.parametrize("env,want", [
    ({"READERLIB_NUM_THREADS": "3"}, 3),
    ({"READERLIB_NUM_THREADS": "1", "OMP_NUM_THREADS": "4"}, 1),
    ({"OMP_NUM_THREADS": "1"}, 1),
])
def test_environment_sets_the_default_at_import(env, want):
    code = """
import readerlib as rl
from readerlib import _core, _parallel
from readerlib import kernels
n = rl.get_num_threads()
assert n == _parallel.get_num_threads() == kernels._threads(None), (n, kernels._threads(None))
print(n)
"""
    full = dict(os.environ)
    full.pop("READERLIB_NUM_THREADS", None)
    full.pop("OMP_NUM_THREADS", None)
    full.update(env)
    p = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                       timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout) == want


def test_bad_environment_is_refused_at_import():
    env = dict(os.environ, READERLIB_NUM_THREADS="lots")
    p = subprocess.run([sys.executable, "-c", "import readerlib"], env=env, capture_output=True,
                       text=True, timeout=HANG_S)
    assert p.returncode != 0 and "READERLIB_NUM_THREADS must be a positive integer" in p.stderr


def test_set_num_threads_is_one_setting_for_readers_and_kernels():
    from readerlib import kernels
    from readerlib import _core, _parallel
    old = rl.get_num_threads()
    try:
        rl.set_num_threads(3)
        assert rl.get_num_threads() == _parallel.get_num_threads() == kernels._threads(None) == 3
        _parallel.set_num_threads(1)                  # the compiled module's spelling sets the same value
        assert rl.get_num_threads() == 1 and kernels._threads(None) == 1
        assert kernels._threads(None, work_bytes=1 << 30) == 1
    finally:
        rl.set_num_threads(old)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1, ValueError), (100000, ValueError),
                                     (1.5, TypeError), (True, TypeError), ("2", TypeError),
                                     (None, TypeError)])
def test_set_num_threads_validates(bad, exc):
    old = rl.get_num_threads()
    with pytest.raises(exc, match="num_threads"):
        rl.set_num_threads(bad)
    assert rl.get_num_threads() == old


# ---- results do not depend on the thread count ---------------------------------

def _with_threads(n, fn):
    old = rl.get_num_threads()
    try:
        rl.set_num_threads(n)
        return fn()
    finally:
        rl.set_num_threads(old)


def test_kernels_bitwise_equal_for_1_2_3_threads():
    from readerlib.rnnt import _rnnt_cpu
    rng = np.random.default_rng(1)
    x16 = rng.standard_normal((3000, 70)).astype(np.float16)
    x = rng.standard_normal((3000, 70)).astype(np.float32)
    idx = rng.integers(0, 3000, 5000)
    logits = rng.standard_normal((150, 9, 33)).astype(np.float64)
    lengths = rng.integers(0, 151, 9).astype(np.int32)
    rows = rng.standard_normal((777, 50)).astype(np.float32)

    def run(t):
        k = np.empty(777, np.int64)
        lp = np.empty(777, np.float64)
        _rnnt_cpu.argmax_logsoftmax(rows, k, lp, t)
        (sp,), neg = rl.ctc_greedy_decoder(logits, lengths, num_threads=t)
        return [rl.batch_reindex(x, idx, num_threads=t), rl.batch_reindex(x16, idx, num_threads=t),
                rl.batch_reindex_grad(x[idx], idx, 3000, num_threads=t),
                rl.batch_reindex_grad(x16[idx], idx, 3000, num_threads=t),
                k, lp, sp.indices, sp.values, sp.dense_shape, neg]

    ref = run(1)
    for t in (2, 3):
        for a, b in zip(run(t), ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()


def test_readers_bitwise_equal_for_1_and_2_threads(tmp_path):
    from readerlib import _core, _parallel
    rng = np.random.default_rng(2)
    path = tmp_path / "big.rio"
    x = rng.integers(0, 256, size=(64, 200_000), dtype=np.uint8)     # batches of 4 MB: copies split
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (200_000,))]),
                           chunk_size=3 << 20) as w:                  # 3 MiB chunks: CRC split
        w.write_batch({"x": x})
    # sequence batches of ~4.8 MB (>= 4 MiB, >= 32 KiB a record): copies split
    seqs = [rng.standard_normal((int(n), 4)).astype(np.float32) for n in rng.integers(4000, 8000, 100)]
    seq_schema = rl.Schema([rl.Field("s", "float32", (4,), lod_level=1)])

    def run():
        fixed = [b[0].data.copy() for b in rl.RecordIOReader(path).shuffle(16, seed=4).batch(20)]
        seq = [(b[0].data.copy(), [l.copy() for l in b[0].lod])
               for b in rl.PythonReader(lambda: iter((s,) for s in seqs), seq_schema).batch(50)]
        crcs = [_core._crc32c_parallel_py(x.tobytes()[:n]) for n in (0, 1, 262144, 1 << 20, 3 << 20)]
        return fixed, seq, crcs

    one, two = _with_threads(1, run), _with_threads(2, run)
    assert len(one[0]) == len(two[0]) == 4
    for a, b in zip(one[0], two[0]):
        assert a.tobytes() == b.tobytes()
    for (a, la), (b, lb) in zip(one[1], two[1]):
        assert a.tobytes() == b.tobytes() and all(np.array_equal(p, q) for p, q in zip(la, lb))
    assert one[2] == two[2] == [rl.crc32c(x.tobytes()[:n]) for n in (0, 1, 262144, 1 << 20, 3 << 20)]
    assert sorted(map(bytes, np.concatenate(one[0]))) == sorted(map(bytes, x))
