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
2. global_shuffle counted a lost chunk's places as items when a skip went
   over them before the loss was known (`lost_at`: the position where the
   chunk failed to load), so which places were items depended on how the
   epoch was walked.  A ShardReader (`.shard(k, i)`, and so every
   DataLoader worker of the torch IterableDataset) steps over the other
   shards' items with c_skip: a shard that skipped into the bad chunk's
   window before reading in it counted places that a shard which read first
   did not, and from there on the shards disagreed on the numbering --
   records delivered by two shards, others by none, for the rest of the
   epoch (silently, over a source opened with on_error="skip").  Now a skip
   that ends inside a window not read yet leaves the rest of it to the next
   read, which reads the window first: a chunk lost there is lost from the
   window's start, for every shard, and set_state still loads nothing.
3. global_shuffle sized its chunk cache and window tables by window_chunks,
   not by the chunks the source has: window_chunks=2**30 (accepted, meaning
   "one window: all of it") raised a bare MemoryError() over any file, and
   10**7 over a 25-chunk file took 3 s and 875 MB.  Now they are sized by
   min(window_chunks, chunks); the order is the same.
"""
import collections
import json
import os
import warnings

import numpy as np
import pytest

import readerlib as rl

from helpers import corrupt_chunk, read_events, run_ok_script

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


# ------------------------------------------------------------------ item 2
N2 = 400            # records 0 .. N2-1, 16 a chunk (chunk_size=200)


def _bad_rio(path, bad=(3,)):
    """N2 int64 records (record i holds i), chunks `bad` corrupt; returns the
    records of those chunks."""
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64", ())]), chunk_size=200) as w:
        w.write_batch({"x": np.arange(N2, dtype=np.int64)})
    lost = set()
    for c in bad:
        lost |= corrupt_chunk(path, chunk=c, at=40)[1]
    return lost


def _ids(item):
    t = item[0]
    if isinstance(t, rl.LoDTensor):
        return tuple(int(v) for v in np.asarray(t.data).reshape(-1))
    return (int(np.asarray(t)),)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rl.RecordIOWarning)
        yield


def _gs(path, on_error, window_chunks, batch):
    g = rl.RecordIOReader(path, on_error=on_error).global_shuffle(seed=5, window_chunks=window_chunks)
    return g.batch(4) if batch else g


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("window_chunks", [1, 3, 8])
@pytest.mark.parametrize("shards,batch", [(2, False), (3, False), (2, True)])
def test_global_shuffle_shards_after_a_lost_chunk_are_disjoint_and_complete(
        tmp_path, on_error, window_chunks, shards, batch):
    path = str(tmp_path / "bad.rio")
    lost = _bad_rio(path, bad=(3, 11))
    got, per_shard = [], []
    for i in range(shards):
        c = _gs(path, on_error, window_chunks, batch).shard(shards, i)
        events, _, errors = read_events(c, _ids, False, 12)
        assert len(errors) <= 2, errors[:3]
        mine = [x for e in events if e != "err" for x in e]
        per_shard.append(len(mine))
        got += mine
        c.close()
    count = collections.Counter(got)
    twice = sorted(x for x, n in count.items() if n > 1)
    missing = sorted(set(range(N2)) - lost - set(count))
    assert not twice and not missing, (
        f"{len(twice)} records delivered by two shards ({twice[:5]}), {len(missing)} by none "
        f"({missing[:5]}); per shard {per_shard}")
    assert set(count) == set(range(N2)) - lost


@pytest.mark.parametrize("batch", [False, True])
def test_global_shuffle_shard_states_after_a_lost_chunk_restore_exactly(tmp_path, batch):
    # every state of a shard, before and after the losses, in a fresh chain
    # (through JSON): the rest of the pass, errors in the same places
    path = str(tmp_path / "bad.rio")
    _bad_rio(path, bad=(3, 11))
    make = lambda: _gs(path, "raise", 3, batch).shard(3, 1)
    c = make()
    for epoch in range(2):
        events, states, errors = read_events(c, _ids, True, 12)
        assert 1 <= len(errors) <= 2
        for k, st in enumerate(states):
            assert isinstance(st, dict), f"epoch {epoch}: get_state before read {k} raised {st}"
            other = make()
            other.set_state(json.loads(json.dumps(st)))
            rest = read_events(other, _ids, False, 12)[0]
            assert rest == events[k:], f"epoch {epoch}: restored at read {k}"
            other.close()
        c.reset()
    c.close()


def test_global_shuffle_skip_into_an_unread_window_then_read_matches_reading(tmp_path):
    # one reader: skips that end inside the window of the bad chunk, then
    # reads, give the same items as reading all the way (and as a restore)
    path = str(tmp_path / "bad.rio")
    lost = _bad_rio(path, bad=(3,))
    ref = _gs(path, "skip", 2, False)
    want = read_events(ref, _ids, False, 12)[0]
    assert "err" not in want and len(want) == N2 - len(lost)
    for step in (1, 2, 5, 15):              # (less than a window: a skip over a whole window
                                            # not read yet counts all its places, see _step)
        g = _gs(path, "skip", 2, False)
        got, k = [], 0
        while True:
            n = g._skip(step)
            k += n
            x = g.read_next()
            if x is None:
                break
            got.append((k, _ids(x)))
            k += 1
        assert got == [(j, want[j] if j < len(want) else None) for j, _ in got], f"skips of {step}"
        assert got[-1][0] >= len(want) - step - 1
        g.close()


def test_global_shuffle_set_state_still_loads_nothing(tmp_path):
    path = str(tmp_path / "bad.rio")
    _bad_rio(path, bad=())
    g = _gs(path, "raise", 2, False)
    g.set_state(dict(g.get_state(), position=101))
    assert g.chunk_loads == 0
    ref = _gs(path, "raise", 2, False)
    assert ref._skip(101) == 101
    a = read_events(g, _ids, False)[0]
    assert a == read_events(ref, _ids, False)[0] and len(a) == N2 - 101
    assert g.chunk_loads <= 25


def test_torch_workers_over_a_skipping_global_shuffle_deliver_each_record_once(tmp_path):
    # the realistic case: a source that skips bad chunks, DataLoader workers
    # (each reads every num_workers-th item of the chain): silently duplicated
    # and missing records, before
    torch = pytest.importorskip("torch")
    from readerlib.integrations.torch import IterableDataset
    path = str(tmp_path / "bad.rio")
    lost = _bad_rio(path, bad=(3, 11))
    ds = IterableDataset(lambda: rl.RecordIOReader(path, on_error="skip")
                         .global_shuffle(seed=5, window_chunks=3))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, timeout=60)
    got = [int(x[0]) for x in loader]
    count = collections.Counter(got)
    assert sorted(count) == sorted(set(range(N2)) - lost) and max(count.values()) == 1, (
        f"{sum(n > 1 for n in count.values())} records twice, "
        f"{len(set(range(N2)) - lost - set(count))} missing")


# ------------------------------------------------------------------ item 3
@pytest.mark.parametrize("source", ["rio", "open_files"])
def test_global_shuffle_a_window_larger_than_the_source_costs_what_the_source_does(tmp_path, source):
    # window_chunks=2**30 (accepted: <= _MAX_WINDOW_CHUNKS), "one window, all
    # of it", over a 25-chunk file: a bare MemoryError() (the chunk cache and
    # window tables were sized by window_chunks, not by the chunks there are)
    from readerlib.readers.files import open_files
    path = str(tmp_path / "a.rio")
    _bad_rio(path, bad=())
    make = {"rio": lambda: rl.RecordIOReader(path), "open_files": lambda: open_files([path])}[source]
    big = make().global_shuffle(seed=3, window_chunks=1 << 30)
    ref = make().global_shuffle(seed=3, window_chunks=25)        # the same single window
    assert big.window_chunks == 1 << 30
    assert big.permutation().tolist() == ref.permutation().tolist()
    got = [int(x[0]) for x in big]
    assert got == [int(x[0]) for x in ref] and sorted(got) == list(range(N2))
    st = big.get_state()
    assert st["window_chunks"] == 1 << 30
    big.close()
    ref.close()


def test_global_shuffle_a_pending_skip_survives_permutation_and_get_state(tmp_path):
    # (guards item 2's claim: a skip that ends inside a window not read yet is
    # settled by the next read, whatever happens in between)
    path = str(tmp_path / "bad.rio")
    lost = _bad_rio(path, bad=(3,))
    for k in (5, 40, 100, 230):
        ref = _gs(path, "skip", 2, False)       # the same skip, nothing in between
        assert ref._skip(k) == k
        want = read_events(ref, _ids, False)[0]
        assert want and not set(lost) & {x for e in want for x in e}
        g = _gs(path, "skip", 2, False)
        assert g._skip(k) == k
        g.permutation(epoch=7)                  # another epoch's plan, then back
        st = json.loads(json.dumps(g.get_state()))
        assert st["position"] == k
        assert read_events(g, _ids, False)[0] == want, k
        other = _gs(path, "skip", 2, False)
        other.set_state(st)
        assert read_events(other, _ids, False)[0] == want, k
        ref.close()
        g.close()
        other.close()
