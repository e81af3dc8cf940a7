"""Review of 2026-12-02's merged changes (start_threads, the prefetch pump
registry, ReaderBase's never-initialised checks, the half-made deallocs).

* readerlib._parallel.start_threads waited, uninterruptibly, for threads
  started on a launcher thread.  Any allocation there -- or on a new thread
  before its start() returned (threading's _bootstrap_inner) -- may run the
  cyclic collector, which runs the garbage's finalizers on that thread.  A
  finalizer that takes a lock the caller holds (a reader's RLock, held by
  the reading thread in read_next: a __del__ or weakref.finalize that closes
  the reader) then blocks for good, and the caller waits for it for good: a
  deadlock (the same finalizer on the caller's thread re-enters the RLock).
  The collector is now off while the threads start; the collection comes at
  the caller's next allocation.
* start_threads after finalisation began (a finalizer run at exit that
  first reads a prefetch or open_files chain) waited for good: a thread made
  then exits as it first takes the GIL.  It raises RuntimeError now.

Each check runs in a child with a time limit, so a hang is a failure.
"""

from helpers import run_ok_script

# Garbage (a cycle, so only the collector frees it) whose finalizer takes an
# RLock the starting thread holds.  The collector's threshold is set a few
# allocations ahead (every offset K in turn), so that some collection lands
# in start_threads' own window: on the launcher, or on a new thread before
# start() returns.
_DEADLOCK = r'''
import gc, threading
from readerlib._parallel import start_threads

lk = threading.RLock()


class Garbage:
    def __init__(self):
        self.me = self

    def __del__(self):
        with lk:            # re-entrant on the thread that holds it; blocks elsewhere
            pass


def run():
    for K in range(16):
        for rep in range(2):
            ths = [threading.Thread(target=int, daemon=True) for _ in range(2)]
            gc.collect()
            gc.disable()
            for i in range(4):
                Garbage()
            gc.set_threshold(gc.get_count()[0] + K)
            gc.enable()
            with lk:
                start_threads(ths)
            gc.set_threshold(700, 10, 10)
            for t in ths:
                t.join(10)
                assert not t.is_alive()
    gc.collect()


if CALLER == "main":
    run()
else:
    out = []
    def body():
        try:
            run()
            out.append("done")
        except BaseException as e:
            out.append(repr(e))
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(60)
    assert out == ["done"], out
print("OK")
'''


def test_start_threads_on_the_main_thread_runs_no_finalizer_on_the_launcher():
    run_ok_script("CALLER = 'main'\n" + _DEADLOCK, timeout=90)


def test_start_threads_on_another_thread_runs_no_finalizer_on_the_new_threads():
    run_ok_script("CALLER = 'other'\n" + _DEADLOCK, timeout=90)


def test_start_threads_leaves_the_collector_as_it_found_it():
    run_ok_script(r'''
import gc, threading
from readerlib._parallel import start_threads
for enabled in (True, False, True):
    (gc.enable if enabled else gc.disable)()
    ths = [threading.Thread(target=int) for _ in range(3)]
    start_threads(ths)
    assert gc.isenabled() == enabled, enabled
    for t in ths:
        t.join()
    # and when a start() raises
    t = threading.Thread(target=int)
    t.start(); t.join()
    try:
        start_threads([t])
    except RuntimeError as e:
        assert "once" in str(e), e
    else:
        raise AssertionError("a second start() did not raise")
    assert gc.isenabled() == enabled, enabled
gc.enable()
print("OK")
''', timeout=60)


def test_start_threads_at_interpreter_shutdown_raises_instead_of_hanging():
    # A thread made after finalisation began exits as it first takes the GIL
    # (CPython 3.11), before its start() returns: start_threads' wait -- and
    # Thread.start()'s own -- never ended.  Now: RuntimeError, said so.
    import os
    import subprocess
    import sys
    code = r'''
import gc, sys, threading
from readerlib._parallel import start_threads

gc.disable()      # (the collection at finalisation runs all the same)


class Late:
    def __del__(self):
        try:
            start_threads([threading.Thread(target=int, daemon=True)])
            sys.stderr.write("LATE started\n")
        except RuntimeError as e:
            sys.stderr.write("LATE raised %s\n" % e)


x = Late()
x.me = x          # a cycle: freed by the last collection, during finalisation
del x
print("OK")
'''
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ))
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    assert "LATE raised readerlib: can't start a thread at interpreter shutdown" in p.stderr, p.stderr
