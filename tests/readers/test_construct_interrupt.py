"""An exception at any point while a reader is being made -- a
KeyboardInterrupt from a signal handler, above all -- propagates as that
exception: never a crash, never a descriptor left open.

The defect this pins: ReaderBase.__cinit__ called threading.RLock(), a Python
function, whose frame ran a pending SIGINT/SIGALRM handler.  When that
handler raised, CPython deallocated the half-made reader through the
subclass's tp_dealloc with the base class's vtable still in place, and
RecordIOReader.__dealloc__ called `self._release_cur()` through a slot the
base vtable does not have: SIGSEGV.  A pooled restore opens a chunk cache
per thread (a RecordIOReader each), so a Ctrl-C during `set_state` crashed
the process (found by CI, 2026-12-01).

The test injects a KeyboardInterrupt at the k-th call of a Python function
while the chain is made (sys.settrace), for every k until the chain is made
with none, for each kind of reader; in a child
with a time limit, so that a crash is a failure, not a lost run.
"""

import pytest

from helpers import SUPPORT_DIR, run_ok_script

_CHILD = r'''
import gc, os, sys, tempfile, time
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
from helpers import make_byte_files, open_fds

d = tempfile.mkdtemp()
(rio, tfr), _ = make_byte_files(d, ["rio", "tfrecord"], [200, 200])
arr = np.arange(100, dtype=np.int64)
CHAINS = {
    "recordio": lambda: rl.RecordIOReader(rio),
    "recordio_eager": lambda: rl.RecordIOReader(rio, low_memory=False),
    "tfrecord": lambda: rl.TFRecordReader(tfr),
    "array": lambda: rl.ArrayReader(arr),
    "python": lambda: rl.PythonReader(lambda: iter([(1,), (2,)]), rl.Schema([rl.Field("x", "int64")])),
    "decorators": lambda: rl.RecordIOReader(rio).shuffle(64, seed=1).map(lambda x: x)
                          .filter(lambda x: True).repeat(2).skip(1).take(50).shard(2, 0)
                          .batch(4).prefetch(2),
    "global_shuffle": lambda: rl.RecordIOReader(rio).global_shuffle(seed=1).padded_batch(4)
                              .map_batches(lambda b: b),
    "tfrecord_chain": lambda: rl.TFRecordReader(tfr).shuffle(32, seed=2).batch(8),
}
ONLY = sys.argv[1:] or list(CHAINS)


class Injected(KeyboardInterrupt):
    pass


fds = open_fds


for name in ONLY:
    build = CHAINS[name]
    r = build()                          # warm: imports, caches, first-use set-up
    r.close()
    del r
    gc.collect()
    before = fds()
    k, hits = 1, 0
    while True:
        seen = [0]

        def tracer(frame, event, arg):
            # (calls only: an exception a tracer raises at a *line* event in an
            # except block leaves CPython 3.11's handled-exception state set,
            # and that stale traceback keeps the half-made chain alive)
            seen[0] += 1
            if seen[0] == k:
                raise Injected(k)
            return None

        r = None
        sys.settrace(tracer)
        try:
            r = build()
        except BaseException as e:
            # the injected exception, or one it caused inside the stdlib's
            # own code (threading.Condition.wait interrupted before it took
            # its lock back raises "release unlocked lock" on the way out)
            c = e
            while c is not None and not isinstance(c, Injected):
                c = c.__context__
            if c is None:
                raise
            hits += 1
            del e, c
        finally:
            sys.settrace(None)
        if r is not None:
            r.close()
            del r
        # a prefetch thread started before the interrupt stops on its own
        # (its reader's dealloc asks it to) and closes the chain: wait for it
        deadline = time.monotonic() + 10
        while True:
            gc.collect()
            now = fds()
            if now == before or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert now == before, (name, k, "descriptors left", set(now.items()) - set(before.items()))
        if seen[0] < k:                  # made with no injection: every event tried
            break
        k += 1
    assert hits == k - 1 and hits > 0, (name, hits, k)
    # the reader still works after all that
    r = build()
    n = sum(1 for _ in r)
    assert n > 0, name
    r.close()
    print(name, hits)
print("OK")
'''


@pytest.mark.parametrize("chains", [["recordio", "recordio_eager", "tfrecord", "array", "python"],
                                    ["decorators"], ["global_shuffle", "tfrecord_chain"]])
def test_an_interrupt_anywhere_while_a_reader_is_made_propagates(chains):
    code = f"SUPPORT = {SUPPORT_DIR!r}\n" + _CHILD
    p = run_ok_script(code.replace("ONLY = sys.argv[1:] or list(CHAINS)", f"ONLY = {chains!r}"),
                      timeout=300)
    for name in chains:
        assert any(line.startswith(name + " ") for line in p.stdout.splitlines()), p.stdout
