"""TFRecord big records in one copy: deferred records under a negotiating batch.

A BatchReader over an uncompressed TFRecordReader (through shuffle /
multi_pass / holder) negotiates deferred records: the reader's scan reads and
checks each big record's header and reads its data CRC, not its data; the
batch reads the record straight into its row and checks the CRC there
(TFRECORD.md, "Big records in one copy").  The reference everywhere is the
two-copy path of before (`_set_deferred_reads(False)`); `_records_deferred`
(records handed out deferred) proves the path ran.
"""
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import readerlib as rl
from readerlib.errors import TFRecordError
from readerlib.formats import _recordio as R
from readerlib.formats import _tfrecord as T
from readerlib.readers import _batch

from helpers import (assert_checkpoint_equal, assert_exactly_once, canon, read_past_errors, run_ok_script,
                     unbatch)

SIZE = 40000                      # >= 32 KiB (RL_CONSUMED_MIN): deferred
BIG = 32768                       # the smallest deferred size
LOD = rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])
F32 = rl.Schema([rl.Field("v", "float32", (), lod_level=1)])
FIXED = rl.Schema([rl.Field("x", "uint8", (SIZE,))])


@pytest.fixture(params=["unstaged", "staged"])
def staged(request):
    """The batch's two ways of reading a deferred record (straight into the
    row, the default; through a cached buffer with the fused CRC + copy)."""
    old = _batch._set_staged_deferred_reads(request.param == "staged")
    yield request.param
    _batch._set_staged_deferred_reads(old)


@pytest.fixture(autouse=True)
def _deferral_on():
    old = T._set_deferred_reads(True)
    yield
    T._set_deferred_reads(old)


def _write(path, records):
    with T.TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    return path


def _records(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(s), dtype=np.uint8).tobytes() for s in sizes]


def _mixed_sizes(n, seed=0):
    """Big and small records mixed: runs of each, lone ones, sizes at the threshold."""
    rng = np.random.default_rng(seed)
    pick = [8, 100, 4000, 20000, BIG - 4, BIG, BIG + 4, SIZE, 65536, 150000]
    return [int(rng.choice(pick)) // 4 * 4 for _ in range(n)]


def _source(chain):
    while not isinstance(chain, T.TFRecordReader):
        chain = chain.reader
    return chain


def _batches(chain):
    return [[canon(i) for i in unbatch(b)] for b in chain]


def _reference(make_chain):
    old = T._set_deferred_reads(False)
    try:
        c = make_chain()
        assert not c._mapped
        got = _batches(c)
        assert _source(c)._records_deferred == 0
        c.close()
    finally:
        T._set_deferred_reads(old)
    return got


def _want(records, schema):
    dt = np.dtype(schema[0].dtype)
    if schema[0].lod_level:
        return [canon((np.frombuffer(r, dt),)) for r in records]
    return [canon((np.frombuffer(r, dt).reshape(schema[0].shape),)) for r in records]


CHAINS = {
    "batch": lambda p, s: T.TFRecordReader(p, schema=s).batch(8),
    "shuffle-batch": lambda p, s: T.TFRecordReader(p, schema=s).shuffle(25, seed=3).batch(8),
    "multipass-shuffle-batch": lambda p, s: T.TFRecordReader(p, schema=s).multi_pass(2).shuffle(25, seed=3).batch(7),
    "holder-shuffle-batch": lambda p, s: rl.ReaderHolder(T.TFRecordReader(p, schema=s)).shuffle(25, seed=3).batch(8),
}


# ------------------------------------------------------------ bitwise the two-copy path
@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("schema", ["lod", "fixed"])
def test_big_records_are_bitwise_the_two_copy_path(tmp_path, staged, copy_path, chain, schema):
    sch = FIXED if schema == "fixed" else LOD
    records = _records([SIZE] * 70)                       # 3 chunks
    p = _write(str(tmp_path / "big.tfrecord"), records)
    make = lambda: CHAINS[chain](p, sch)
    ref = _reference(make)
    c = make()
    assert c._mapped, "the batch took deferred records"
    got = _batches(c)
    passes = 2 if "multipass" in chain else 1
    assert _source(c)._records_deferred == 70 * passes    # every record went the one-copy way
    c.close()
    assert got == ref                                     # same batches, same order, bit for bit
    assert_exactly_once([i for b in got for i in b], _want(records, sch) * passes)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("schema", ["lod", "f32"])
def test_mixed_sizes_are_bitwise_the_two_copy_path(tmp_path, copy_path, seed, schema):
    sch = F32 if schema == "f32" else LOD
    sizes = _mixed_sizes(120, seed)
    records = _records(sizes, seed)
    p = _write(str(tmp_path / "mixed.tfrecord"), records)
    for make in (lambda: T.TFRecordReader(p, schema=sch).batch(9),
                 lambda: T.TFRecordReader(p, schema=sch).shuffle(40, seed=seed).batch(16)):
        ref = _reference(make)
        c = make()
        assert c._mapped
        got = _batches(c)
        deferred = _source(c)._records_deferred
        c.close()
        assert got == ref
        # big records go deferred unless a window of small ones already read them
        assert 0 < deferred <= sum(s >= BIG for s in sizes)
        assert_exactly_once([i for b in got for i in b], _want(records, sch))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 4, 100, 4000, BIG - 4, BIG, SIZE, 70000, 300000]), min_size=1,
                      max_size=40),
       batch=st.integers(1, 9), buffer=st.sampled_from([0, 1, 7, 64]), seed=st.integers(0, 2 ** 16))
def test_random_files_are_bitwise_the_two_copy_path(tmp_path, sizes, batch, buffer, seed):
    records = _records(sizes, seed)
    p = _write(str(tmp_path / f"r{seed}.tfrecord"), records)
    if buffer:
        make = lambda: T.TFRecordReader(p, schema=F32, index=False).shuffle(buffer, seed=seed).batch(batch)
    else:
        make = lambda: T.TFRecordReader(p, schema=F32, index=False).batch(batch)
    ref = _reference(make)
    c = make()
    got = _batches(c)
    assert _source(c)._records_deferred <= sum(s >= BIG for s in sizes)
    c.close()
    assert got == ref


def test_a_file_of_small_records_reads_as_before(tmp_path):
    records = _records([64] * 40000)                      # 2.5 chunks of small records
    p = _write(str(tmp_path / "small.tfrecord"), records)
    make = lambda: T.TFRecordReader(p).batch(256)
    ref = _reference(make)
    c = make()
    assert c._mapped and _batches(c) == ref
    assert _source(c)._records_deferred == 0


def test_one_record_bigger_than_a_chunk(tmp_path):
    records = _records([100, 3 << 20, 100, SIZE])
    p = _write(str(tmp_path / "huge.tfrecord"), records)
    for index in (False, "auto", "auto"):                 # scanned, then through the index it wrote
        make = lambda: T.TFRecordReader(p, index=index).batch(3)
        ref = _reference(make)
        c = make()
        assert _batches(c) == ref
        assert _source(c)._records_deferred == 2


# ------------------------------------------------------------ everything else reads as today
def test_what_never_negotiates(tmp_path):
    records = _records([SIZE] * 30)
    p = _write(str(tmp_path / "big.tfrecord"), records)
    want = _want(records, LOD)
    with T.TFRecordWriter(str(tmp_path / "big.tfrecord.gz"), compression="GZIP") as w:
        for r in records:
            w.write(r)
    gz = T.TFRecordReader(str(tmp_path / "big.tfrecord.gz"), compression="GZIP").batch(4)
    mapped = T.TFRecordReader(p).map(lambda x: x).batch(4)
    pre = T.TFRecordReader(p)
    pre._prefixed_instances()
    prefixed = pre.batch(4)
    for c in (gz, mapped, prefixed):
        assert not c._mapped, c
        got = [i for b in _batches(c) for i in b]
        assert got == want, c
        c.close()
    # open_files negotiates for its files' readers (readers/_multifile.pyx):
    # this one (bare sequence records) defers, the same items come out
    mf = rl.open_files([p])
    mixed = mf.batch(4)
    assert mixed._mapped
    assert [i for b in _batches(mixed) for i in b] == want
    assert mf._records_deferred == len(records)
    mixed.close()
    old = T._set_deferred_reads(False)                    # the switch
    try:
        c = T.TFRecordReader(p).batch(4)
        assert not c._mapped
    finally:
        T._set_deferred_reads(old)


def test_random_access_and_read_many_next_to_a_one_copy_chain(tmp_path):
    records = _records(_mixed_sizes(60, 5), 5)
    p = _write(str(tmp_path / "mixed.tfrecord"), records)

    def session():
        r = T.TFRecordReader(p)
        b = r.batch(5)
        out = [[canon(i) for i in unbatch(b.read_next())]]
        out.append([r[i][0].tobytes() for i in (0, 17, 59, 33)])
        out.append([x[0].tobytes() for x in r.read_many([3, 58, 21])])
        out.append(_batches(b))
        return out, b._mapped, r._records_deferred
    old = T._set_deferred_reads(False)
    try:
        ref, mapped, deferred = session()
    finally:
        T._set_deferred_reads(old)
    assert not mapped and deferred == 0
    got, mapped, deferred = session()
    assert mapped and deferred > 0
    assert got == ref
    assert got[1] == [records[i] for i in (0, 17, 59, 33)]
    assert got[2] == [records[i] for i in (3, 58, 21)]


def test_index_written_by_a_one_copy_pass_is_the_scanned_one(tmp_path):
    records = _records(_mixed_sizes(200, 7), 7)
    p = _write(str(tmp_path / "mixed.tfrecord"), records)
    c = T.TFRecordReader(p).batch(16)
    assert c._mapped
    _batches(c)
    assert _source(c)._records_deferred > 0
    c.close()
    idx = open(p + ".idx", "rb").read()
    q = _write(str(tmp_path / "same.tfrecord"), records)
    T.build_index(q)
    assert T.TFRecordReader(q, index=False).chunk_table()[0].tolist() == \
        T.TFRecordReader(p).chunk_table()[0].tolist()
    table = lambda raw: raw[80 + 0:len(raw) - 4]              # past the header (stat, fingerprints)
    assert table(idx) == table(open(q + ".idx", "rb").read())
    # sharded chunks through the index, one-copy
    r = T.TFRecordReader(p)
    offs, nrec = r.chunk_table()
    sel = [len(offs) - 1, 0]
    r.select_chunks(sel)
    got = [i for b in _batches(r.batch(7)) for i in b]
    starts = np.concatenate([[0], np.cumsum(nrec)])
    assert got == [x for k in sel for x in _want(records[starts[k]:starts[k + 1]], LOD)]


# ------------------------------------------------------------ corruption
def _flip(path, at, mask=0x40):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


EVERY_BYTE = """
import os
import numpy as np, readerlib as rl
from readerlib.formats import _tfrecord as T
T._set_deferred_reads(True)
rng = np.random.default_rng(0)
records = [rng.integers(0, 256, k, dtype=np.uint8).tobytes() for k in (100, {big}, 52)]
p = {path!r}
with T.TFRecordWriter(p) as w:
    for r in records:
        w.write(r)

def read():
    c = T.TFRecordReader(p, index=False).batch(3)
    try:
        (t,) = c.read_next()
        off = np.asarray(t.lod[0])
        got = [np.asarray(t.data[off[i]:off[i + 1]]).tobytes() for i in range(3)]
        assert c.read_next() is None
    except rl.DataLossError:
        got = None
    n = c.reader._records_deferred
    c.close()
    return got, n
assert read() == (records, 1)
data = range(116 + 12, 116 + 12 + {big})         # the big record's data
deferred = 0
with open(p, "r+b") as f:
    for at in range(os.path.getsize(p)):
        f.seek(at); b = f.read(1)
        f.seek(at); f.write(bytes([b[0] ^ 0x40])); f.flush()
        got, n = read()
        f.seek(at); f.write(b); f.flush()
        assert got is None, f"byte {{at}} flipped: no error"
        deferred += n if at in data else 0
assert deferred == len(data), deferred            # each caught by the batch's check of its row
assert read() == (records, 1)
print("OK")
"""


def test_every_byte_of_a_big_record_is_checked(tmp_path):
    """Flipping any byte of the file -- a small record, the big one's header,
    each byte of its data, its data CRC -- raises DataLossError and never
    gives different data, through the one-copy path (in a child: a crash or
    a hang fails the test, not the run)."""
    run_ok_script(EVERY_BYTE.format(big=BIG, path=str(tmp_path / "one-big.tfrecord")), timeout=240)


def test_a_bad_record_raises_from_the_batch_with_file_and_offset(tmp_path, staged, copy_path):
    records = _records([SIZE] * 40)
    p = _write(str(tmp_path / "bad.tfrecord"), records)
    k = 17
    start = k * (SIZE + 16)
    _flip(p, start + 12 + 1234)
    c = T.TFRecordReader(p).shuffle(12, seed=4).batch(6)
    assert c._mapped
    batches, errors = read_past_errors(c, lambda b: [canon(i) for i in unbatch(b)], errors=rl.DataLossError)
    assert len(errors) == 1, errors
    e = errors[0]
    assert type(e) is TFRecordError
    assert str(e) == f"{p}: corrupted record at {start} (data checksum mismatch)"
    assert e.path == p and e.offset == start
    # reading on lost only that record
    want = _want(records, LOD)
    assert_exactly_once(sum(batches, []), want[:k] + want[k + 1:])
    # the two-copy path names the same record
    old = T._set_deferred_reads(False)
    try:
        with pytest.raises(TFRecordError) as ei:
            _batches(T.TFRecordReader(p).batch(6))
    finally:
        T._set_deferred_reads(old)
    assert str(ei.value) == str(e)


@pytest.mark.parametrize("sizes", [[100] * 2000, [100] * 300 + [SIZE] * 3 + [100] * 300])
def test_a_bad_small_record_under_the_batch_names_its_own_offset(tmp_path, sizes):
    # A deferring scan reads a chunk's small records in windows, so a record's
    # place in the block is not its place in the chunk: the batch path named
    # offset 174188 for the record at 174000 (tests/integrations/test_ray.py
    # caught it).  The error names the record's start, as the reader alone does.
    p = _write(str(tmp_path / "small.tfrecord"), _records(sizes))
    k = len(sizes) - 150                      # a small record after the big ones (if any)
    start = sum(n + 16 for n in sizes[:k])
    _flip(p, start + 12 + 50)
    want = f"{p}: corrupted record at {start} (data checksum mismatch)"
    for c in (T.TFRecordReader(p), T.TFRecordReader(p).batch(64)):
        with pytest.raises(TFRecordError) as ei:
            for _ in c:
                pass
        assert str(ei.value) == want and ei.value.offset == start, type(c).__name__
    assert c._mapped                          # the batch negotiated: the deferring scan ran


def test_get_state_refuses_after_a_dropped_record(tmp_path):
    records = _records([SIZE] * 20)
    p = _write(str(tmp_path / "bad.tfrecord"), records)
    _flip(p, 5 * (SIZE + 16) + 12 + 7)
    c = T.TFRecordReader(p).batch(4)
    n = 0
    while n < 2:
        try:
            assert c.read_next() is not None
        except TFRecordError:
            continue
        n += 1
    with pytest.raises(RuntimeError, match="dropped a record this epoch .*data checksum mismatch"):
        c.get_state()


def test_a_bad_record_read_directly_between_batches(tmp_path):
    """A deferred chunk is current and the reader is read directly: each big
    record is read and checked by the reader (its own error, the rest of the
    chunk dropped, as before)."""
    records = _records([SIZE] * 30)
    p = _write(str(tmp_path / "big.tfrecord"), records)
    r = T.TFRecordReader(p)
    b = r.batch(3)
    got = [canon(i) for i in unbatch(b.read_next())]
    assert r._records_deferred == 3
    while True:
        item = r.read_next()
        if item is None:
            break
        got.append(canon(item))
    assert got == _want(records, LOD)
    assert r._records_deferred == 3
    _flip(p, 5 * (SIZE + 16) + 12 + 99)
    r = T.TFRecordReader(p)
    b = r.batch(3)
    b.read_next()
    items, errors = read_past_errors(r, canon, errors=rl.DataLossError)
    assert [str(e) for e in errors] == [f"{p}: corrupted record at {5 * (SIZE + 16)} (data checksum mismatch)"]
    chunk = 1 << 20
    per_chunk = -(-chunk // (SIZE + 16))                   # records of the first chunk
    assert items == _want(records[3:5] + records[per_chunk:], LOD)


def test_a_bad_record_reaching_another_consumer_of_a_shuffle(tmp_path):
    """A shuffle filled with deferred records by a batch, then read directly:
    each record it hands out is checked first; the error is TFRecord's."""
    records = _records([SIZE] * 40)
    p = _write(str(tmp_path / "big.tfrecord"), records)
    want = _want(records, LOD)
    s = T.TFRecordReader(p).shuffle(40, seed=0)
    b = s.batch(2)
    assert b._mapped
    seen = [canon(i) for i in unbatch(b.read_next())]     # the whole file is in the buffer now
    k = next(i for i in range(40) if want[i] not in seen)
    _flip(p, k * (SIZE + 16) + 12 + 99)
    items, errs = read_past_errors(s, canon, errors=rl.DataLossError)
    assert [str(e) for e in errs] == [f"{p}: corrupted record at {k * (SIZE + 16)} (data checksum mismatch)"]
    assert type(errs[0]) is TFRecordError
    assert sorted(seen + items) == sorted(want[:k] + want[k + 1:])


# ------------------------------------------------------------ truncation
def _read_until_error(make):
    got, err = [], None
    c = make()
    try:
        for bt in c:
            got += [canon(i) for i in unbatch(bt)]
    except rl.DataLossError as e:
        err = str(e)
    c.close()
    return (got, err), _source(c)._records_deferred


def _check_truncation_at_every_kind_of_offset(d):
    sizes = [SIZE, 100, SIZE, SIZE, 60000, 8, SIZE]
    records = _records(sizes)
    full = open(_write(os.path.join(d, "full.tfrecord"), records), "rb").read()
    starts = np.cumsum([0] + [s + 16 for s in sizes])
    cuts = set()
    for s0, s1 in zip(starts[:-1], starts[1:]):
        cuts.update({s0 + 1, s0 + 11, s0 + 12, s0 + 13, (s0 + s1) // 2, s1 - 4, s1 - 3, s1 - 1, s1})
    p = os.path.join(d, "cut.tfrecord")
    deferred = 0
    for cut in sorted(cuts):
        open(p, "wb").write(full[:cut])
        make = lambda: T.TFRecordReader(p, index=False).batch(2)
        old = T._set_deferred_reads(False)
        try:
            ref, _ = _read_until_error(make)
        finally:
            T._set_deferred_reads(old)
        T._set_deferred_reads(True)
        got, n = _read_until_error(make)
        assert got == ref, cut
        deferred += n
        if cut not in starts:
            assert ref[1] is not None and "truncated record" in ref[1], (cut, ref[1])
    assert deferred > 2 * len(cuts)             # the one-copy path read them (136 of 63 cuts)
    return len(cuts)


def test_truncation_at_every_kind_of_offset(tmp_path):
    """A file cut anywhere (inside a header, a big record's data, its CRC, a
    small record) reads as the two-copy path reads it: the same records, then
    the same error (in a child: a crash or a hang fails the test, not the run)."""
    here = os.path.dirname(os.path.abspath(__file__))
    support = os.path.join(os.path.dirname(here), "support")
    run_ok_script(f"import sys; sys.path[:0] = [{here!r}, {support!r}]\n"
                  f"import test_tfrecord_deferred as t\n"
                  f"assert t._check_truncation_at_every_kind_of_offset({str(tmp_path)!r}) > 50\n"
                  f"print('OK')\n", timeout=240)


TRUNCATED_WHILE_READ = """
import os
import numpy as np, readerlib as rl
from readerlib import _parallel
from readerlib.formats import _tfrecord as T
rl.set_num_threads(2); _parallel._set_min_bytes_per_thread(1)
p = {path!r}
with T.TFRecordWriter(p) as w:
    w.write_batch(np.ones(({n}, {size}), np.uint8))
c = T.TFRecordReader(p, index=False).shuffle({n} + 10, seed=0).batch(16)
assert c._mapped
it = iter(c)
next(it)                       # every record is in the buffer, deferred: the reads meet the cut
os.truncate(p, os.path.getsize(p) // 3)
try:
    for b in it:
        pass
except rl.DataLossError as e:
    assert type(e).__name__ == "TFRecordError", e
    assert "the file is shorter than when it was opened" in str(e), e
    assert str(e).startswith(p + ": truncated record at "), e
    print("OK", e)
else:
    print("NO ERROR")
"""


def test_truncated_while_read_raises_and_exits_normally(tmp_path):
    run_ok_script(TRUNCATED_WHILE_READ.format(path=str(tmp_path / "t.tfrecord"), n=60, size=SIZE), timeout=120)


# ------------------------------------------------------------ epochs, resume
@pytest.mark.parametrize("chain", ["batch", "shuffle-batch", "multipass-shuffle-batch"])
def test_exactly_once_per_epoch_and_exact_resume(tmp_path, chain):
    records = _records(_mixed_sizes(50, 3), 3)
    p = _write(str(tmp_path / "mixed.tfrecord"), records)
    make = lambda: CHAINS[chain](p, LOD)
    c = make()
    assert c._mapped
    passes = 2 if "multipass" in chain else 1
    for epoch in range(2):
        got = [i for b in _batches(c) for i in b]
        assert_exactly_once(got, _want(records, LOD) * passes)
    assert _source(c)._records_deferred > 0
    c.close()
    assert_checkpoint_equal(make, epochs=2)


def test_no_deferred_record_outlives_its_chain(tmp_path):
    records = _records([SIZE] * 40)
    p = _write(str(tmp_path / "big.tfrecord"), records)
    before = R._live_file_blocks()
    c = T.TFRecordReader(p).shuffle(30, seed=1).batch(4)
    it = iter(c)
    next(it)
    next(it)
    assert R._live_file_blocks() > before        # deferred records in the shuffle's buffer
    c.close()
    del it, c
    assert R._live_file_blocks() == before


def test_state_json_is_the_same_either_way(tmp_path):
    records = _records([SIZE] * 20)
    p = _write(str(tmp_path / "big.tfrecord"), records)
    c = T.TFRecordReader(p).shuffle(8, seed=0).batch(3)
    c.read_next()
    a = json.dumps(c.get_state(), sort_keys=True)
    old = T._set_deferred_reads(False)
    try:
        d = T.TFRecordReader(p).shuffle(8, seed=0).batch(3)
        d.read_next()
        assert json.dumps(d.get_state(), sort_keys=True) == a
        assert not d._mapped
    finally:
        T._set_deferred_reads(old)
