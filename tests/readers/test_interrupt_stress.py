"""KeyboardInterrupts from a signal handler at random points while chains
run: reading, get_state, set_state on a fresh chain, reading on -- over
threaded chains (prefetch, open_files with a pool, a threaded map, the
pooled restore fill).

Each interrupted attempt either completes exactly (the items before the
checkpoint and after the restore are the reference epoch) or raises
KeyboardInterrupt; afterwards no descriptor and no thread is left, and a
clean run is exact.  In a child with a time limit: a crash or a hang is a
failure, not a lost run.  (The crash this class of test first found: a
KeyboardInterrupt in ReaderBase.__cinit__ -- tests/readers/test_construct_interrupt.py.)
"""
import pytest

from helpers import SUPPORT_DIR, run_ok_script

_CHILD = r'''
import gc, os, random, signal, sys, tempfile, threading, time
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
from helpers import AlarmInterrupt, make_byte_files, open_fds

from readerlib.readers import _shuffle

rl.set_num_threads(2)
_shuffle._restore_parallel_settings(min_records=0)      # every file restore fills on the pool
d = tempfile.mkdtemp()
paths, _ = make_byte_files(d, ["rio", "rio", "tfrecord", "tfrecord.gz"], [3000, 3000, 3000, 2000],
                           chunk_size=4096, rec_size=24)
rio0, rio1, tfr, tgz = paths
CHAINS = {
    "shuffle_batch_prefetch": lambda: rl.RecordIOReader(rio0).shuffle(1000, seed=1).batch(32).prefetch(2),
    "open_files_pool": lambda: rl.open_files([rio0, rio1, tfr], num_threads=2).shuffle(500, seed=2).batch(16),
    "threaded_map": lambda: rl.RecordIOReader(rio1).map(lambda x: x, num_threads=2).shuffle(300, seed=3).batch(8),
    "global_shuffle": lambda: rl.RecordIOReader(rio0).global_shuffle(seed=4).batch(32),
    "big_buffer": lambda: rl.RecordIOReader(rio0).shuffle(2500, seed=5).batch(64),
    "gzip_padded": lambda: rl.open_files([tgz, rio1], num_threads=2).shuffle(400, seed=6).padded_batch(16),
}
ONLY = NAMES


def items(it, limit=None):
    out = []
    for b in it:
        out.append(tuple((t.data.tobytes(), tuple(np.asarray(l).tolist() for l in t.lod)) for t in b))
        if limit is not None and len(out) == limit:
            break
    return out


Armed = AlarmInterrupt
Armed.install()


fds = open_fds


def running_threads():
    # threads that run (not a Thread object left in threading's limbo: a
    # ThreadPoolExecutor.submit -- the threaded map's -- interrupted inside
    # its Thread.start() before the thread was launched leaves one, never
    # started; the stdlib's, noted in the issue's closing note)
    return sum(1 for t in threading.enumerate() if t.is_alive())


def stacks():
    import traceback
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(i, i): "".join(traceback.format_stack(f)[-6:])
            for i, f in sys._current_frames().items() if i != threading.get_ident()}


def settle(before_fds, before_threads):
    deadline = time.monotonic() + 20
    while True:
        gc.collect()
        ok = fds() == before_fds and running_threads() <= before_threads
        if ok or time.monotonic() > deadline:
            return ok
        time.sleep(0.02)


rnd = random.Random(1234)
for name in ONLY:
    make = CHAINS[name]
    c = make()
    ref = items(c)
    c.close()
    n = len(ref)
    del c
    gc.collect()
    before_fds, before_threads = fds(), running_threads()
    # the timer's range follows this chain's own round-trip time here (fixed
    # values gave a fast chain no interrupt at all in some runs)
    durs = []
    for _ in range(3):
        t0 = time.perf_counter()
        a = make()
        got = items(a, n // 2)
        st = a.get_state()
        b = make()
        b.set_state(st)
        got += items(b)
        durs.append(time.perf_counter() - t0)
        a.close()
        b.close()
        assert got == ref, name
    dur = sorted(durs)[1]
    del a, b
    done = hits = 0
    for attempt in range(ATTEMPTS):
        k = rnd.randrange(1, n)
        a = b = None
        Armed.on = True
        signal.setitimer(signal.ITIMER_REAL, max(1e-5, rnd.uniform(0.02, 1.5) * dur))
        try:
            a = make()
            got = items(a, k)
            st = a.get_state()
            b = make()
            b.set_state(st)
            got += items(b)
            Armed.on = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert got == ref, (name, attempt, k, len(got), n)
            done += 1
        except KeyboardInterrupt:
            hits += 1
        finally:
            Armed.on = False
            signal.setitimer(signal.ITIMER_REAL, 0)
        for r in (a, b):
            if r is not None:
                r.close()
        del a, b
    assert settle(before_fds, before_threads), (name, "left", set(fds().items()) - set(before_fds.items()),
                                                running_threads(), before_threads,
                                                [(t.name, t.is_alive(), t.ident) for t in threading.enumerate()],
                                                stacks())
    c = make()
    assert items(c) == ref, name
    c.close()
    print(name, done, hits)
print("OK")
'''


@pytest.mark.parametrize("names", [["shuffle_batch_prefetch", "open_files_pool", "gzip_padded"],
                                   ["threaded_map", "global_shuffle", "big_buffer"]])
def test_interrupts_anywhere_in_a_checkpointed_run(names):
    code = (f"SUPPORT = {SUPPORT_DIR!r}\nNAMES = {names!r}\nATTEMPTS = 80\n" + _CHILD)
    p = run_ok_script(code, timeout=400)
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    for name in names:
        done, hits = map(int, lines[name].split())
        # both outcomes happen: interrupts land inside the runs, and some runs complete
        assert done + hits == 80 and hits > 0 and done > 0, (name, done, hits)
