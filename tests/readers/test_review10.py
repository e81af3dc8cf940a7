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
* (of the first fix) a fork from another thread while the collector is off
  for a start left the child with it off: the child turns it back on.

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


def test_a_process_forked_while_threads_start_has_the_collector_on():
    # start_threads turns the collector off while the threads start; a fork
    # from another thread in that window (here: the launcher itself, in a
    # Thread subclass's start()) left the child with it off for good -- no
    # start_threads call there to turn it back on.
    run_ok_script(r'''
import gc, os, threading
from readerlib._parallel import start_threads


class ForkingStart(threading.Thread):
    def start(self):
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(wr, b"1" if gc.isenabled() else b"0")
            os._exit(0)
        os.close(wr)
        ForkingStart.child = os.read(rd, 1)
        os.close(rd)
        os.waitpid(pid, 0)
        super().start()


assert gc.isenabled()
for caller in ("main", "other"):
    ForkingStart.child = None
    t = ForkingStart(target=int)
    if caller == "main":
        start_threads([t])
    else:
        h = threading.Thread(target=start_threads, args=([t],))
        h.start(); h.join(30)
    t.join(30)
    assert ForkingStart.child == b"1", (caller, ForkingStart.child, "the child's collector is off")
    assert gc.isenabled(), caller
print("OK")
''', timeout=60)
