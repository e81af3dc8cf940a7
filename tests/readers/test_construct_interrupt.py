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
import sys, tempfile
sys.path.insert(0, SUPPORT)
import numpy as np
import readerlib as rl
from helpers import interrupt_each_call, make_byte_files

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


for name in ONLY:
    hits, n_items = interrupt_each_call(CHAINS[name], name)
    assert n_items > 0, name
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
