"""Review 19: open_files reading on past a file's data error, global_shuffle's
lost chunks and their states (the code of sessions 17-18), adversarially.

1. open_files' worker queued the records before an error, and the error's
   packet, with the GIL held (`_Run._read_on_after`, and the worker's
   `except` for the errors that end the run): `_push` waits while the
   thread's queue is full (QUEUE_PACKETS packets or QUEUE_BYTES of records
   ahead of the consumer), and a wait holding the GIL never ends -- the
   consumer needs the GIL to take the next packet.  So a data error met
   more than 256 packets (262,144 small records, or 32 MiB) ahead of the
   consumer hung the process for good, Ctrl-C included (the main thread
   cannot run its signal handler without the GIL).  Now the worker waits
   for queue space with the GIL released.
"""
import pytest

from helpers import run_ok_script

PRELUDE = r"""
import faulthandler, os, sys, tempfile, time
import numpy as np
import readerlib as rl
from readerlib.readers.files import open_files, register_file_reader

faulthandler.dump_traceback_later(60, exit=True)    # a hang: every thread's stack, then exit 1
schema = rl.Schema([rl.Field("x", "int64", ())])
d = tempfile.mkdtemp()

def read_past_errors(r):
    got, errors = [], []
    while True:
        try:
            x = r.read_next()
        except Exception as e:
            errors.append(e)
            if len(errors) > 12:
                return got, errors
            continue
        if x is None:
            return got, errors
        got.append(int(x[0]))

def corrupt_chunk(path, chunk, at=40):
    # one byte flipped in the chunk's body: its records (a set) fail the chunk's checksum
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    r.close()
    with open(path, "r+b") as f:
        f.seek(int(offs[chunk]) + at)
        b = f.read(1)
        f.seek(int(offs[chunk]) + at)
        f.write(bytes([b[0] ^ 0x5A]))
    return set(range(int(nrec[:chunk].sum()), int(nrec[:chunk + 1].sum())))
"""


# ------------------------------------------------------------------ item 1
@pytest.mark.parametrize("threads", [1, 2])
def test_open_files_a_data_error_met_with_a_full_queue_does_not_deadlock(threads):
    # small records: the worker(s) run 256 packets (262,144 records) each
    # ahead of a consumer that starts late, and meet the corrupt chunk with
    # a full queue; the consumer then gets every other record and the error once
    # (chunks are units: with 2 threads, each reads every other chunk)
    run_ok_script(PRELUDE + f"""
N = {threads} * 300_000 + 60_000
path = os.path.join(d, "big.rio")
with rl.RecordIOWriter(path, schema, chunk_size=1 << 16) as w:
    w.write_batch({{"x": np.arange(N, dtype=np.int64)}})
r = rl.RecordIOReader(path)
offs, nrec = r.chunk_table()
r.close()
bad = int(np.searchsorted(np.cumsum(nrec), N - 30_000))
lost = corrupt_chunk(path, bad)
r = open_files([path], num_threads={threads})
first = r.read_next()
time.sleep(1.0)                    # the workers fill their queues meanwhile
got, errors = read_past_errors(r)
got = [int(first[0])] + got
assert len(errors) == 1 and "checksum" in str(errors[0]), errors
assert got == [i for i in range(N) if i not in lost], (len(got), N - len(lost))
r.close()
print("OK")
""", timeout=120)


def test_open_files_a_worker_error_met_with_a_full_queue_does_not_deadlock():
    # an error that ends the run (not a data error) takes the same way out of
    # the worker: the records before it, then the error, raised on every call.
    # The consumer holds the first packet of 1,024 records and waits: the
    # worker queues 256 more (full), reads 500 into the next, and fails
    run_ok_script(PRELUDE + r"""
N = 257 * 1024 + 500

def make(path, schema=None):
    def gen():
        for i in range(N):
            yield (np.int64(i),)
        raise ValueError("the reader broke after record %d" % (N - 1))
    return rl.PythonReader(gen, rl.Schema([rl.Field("x", "int64", ())]))

register_file_reader(".broken19", make)
path = os.path.join(d, "a.broken19")
open(path, "wb").close()
r = open_files([path])
first = r.read_next()
time.sleep(3.0)
got, errors = read_past_errors(r)
assert [int(first[0])] + got == list(range(N)), len(got)
assert len(errors) == 13 and all("the reader broke" in str(e) for e in errors), errors[:2]
r.close()
print("OK")
""", timeout=120)

