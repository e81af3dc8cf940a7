"""Writers shared by threads (FileWriter's lock).

Four threads writing batches to one RecordIOWriter left a file whose index
disagreed with its chunks ("index record total disagrees with its entries"),
after close() had reported success: records were reported written and the
file did not read back.  Writes, flush() and close() now take the writer's
lock; every record comes back whole, exactly once, in a file that opens.
"""
import threading
from collections import Counter

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter, TFRecordReader

THREADS, BATCHES, ROWS, WIDTH = 4, 150, 16, 64
SCHEMA = rl.Schema([rl.Field("x", "int64", (WIDTH,))])


def _write_from_threads(w, write):
    errors = []
    start = threading.Barrier(THREADS)

    def work(t):
        try:
            start.wait()
            for i in range(BATCHES):
                write(w, np.full((ROWS, WIDTH), t * 100_000 + i, dtype=np.int64))
                if i % 50 == 49:
                    w.flush()
        except BaseException as e:       # pragma: no cover - reported below
            errors.append(e)

    ths = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert not errors, errors
    w.close()


def _check_records(rows):
    counts = Counter()
    for a in rows:
        a = np.asarray(a).reshape(-1)
        assert (a == a[0]).all(), "a record mixes two writes"
        counts[int(a[0])] += 1
    want = {t * 100_000 + i: ROWS for t in range(THREADS) for i in range(BATCHES)}
    assert counts == want


@pytest.mark.parametrize("chunk_size", [1 << 12, 1 << 16])
def test_recordio_writer_shared_by_threads(tmp_path, chunk_size):
    p = str(tmp_path / "a.rio")
    w = rl.RecordIOWriter(p, SCHEMA, chunk_size=chunk_size)
    _write_from_threads(w, lambda w, x: w.write_batch({"x": x}))
    r = rl.RecordIOReader(p)
    _check_records(inst[0] for inst in r)
    assert r.num_records == THREADS * BATCHES * ROWS


def test_recordio_writer_per_instance_writes_from_threads(tmp_path):
    p = str(tmp_path / "a.rio")
    w = rl.RecordIOWriter(p, SCHEMA, chunk_size=1 << 12)
    def write(w, x):
        for row in x:
            w.write((row,))
    _write_from_threads(w, write)
    _check_records(inst[0] for inst in rl.RecordIOReader(p))


@pytest.mark.parametrize("compression", [None, "ZLIB"])
def test_tfrecord_writer_shared_by_threads(tmp_path, compression):
    p = str(tmp_path / "a.tfrecord")
    w = TFRecordWriter(p, compression=compression)
    _write_from_threads(w, lambda w, x: w.write_batch(x))
    r = TFRecordReader(p, SCHEMA, compression=compression)
    _check_records(inst[0] for inst in r)
