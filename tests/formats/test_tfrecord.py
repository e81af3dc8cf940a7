"""TFRecord: byte compatibility with TensorFlow, corruption, compression, sidecar index."""
import faulthandler
import os
import shutil
import sys

import numpy as np
import pytest

import readerlib as rl
from readerlib.errors import TFRecordError
from readerlib.formats._tfrecord import (CHUNK_BYTES, TFRecordReader, TFRecordWriter, build_index,
                                         masked_crc32c)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
sys.path.insert(0, DATA)
from make_tfrecord import tf_records  # noqa: E402

TF_FILES = [("tf_written.tfrecord", None), ("tf_written.tfrecord.gz", "GZIP"),
            ("tf_written.tfrecord.zlib", "ZLIB")]


@pytest.fixture(autouse=True)
def _hang_guard():
    """A hang fails the run (with every thread's stack) instead of blocking it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def read_all(path, **kw):
    with TFRecordReader(path, **kw) as r:
        return [inst[0].tobytes() for inst in r]


def write(path, records, compression=None):
    with TFRecordWriter(path, compression=compression) as w:
        for rec in records:
            w.write(rec)
    return path


def record_starts(records):
    out, pos = [], 0
    for rec in records:
        out.append(pos)
        pos += 16 + len(rec)
    return out, pos


# ------------------------------------------------------------ compatibility
@pytest.mark.parametrize("name,comp", TF_FILES)
def test_reads_files_written_by_tensorflow(name, comp, tmp_path):
    src = tmp_path / name
    shutil.copy(os.path.join(DATA, name), src)
    assert read_all(src, compression=comp) == tf_records()


@pytest.mark.parametrize("name,comp", TF_FILES)
def test_writer_is_byte_identical_to_tensorflow(name, comp, tmp_path):
    out = write(tmp_path / name, tf_records(), comp)
    with open(out, "rb") as a, open(os.path.join(DATA, name), "rb") as b:
        assert a.read() == b.read()


def test_masked_crc_matches_the_tfrecord_format():
    # the 8-byte length 0 of an empty record, as every TFRecord file spells it
    with open(os.path.join(DATA, "tf_written.tfrecord"), "rb") as f:
        head = f.read(12)
    assert int.from_bytes(head[:8], "little") == 0
    assert masked_crc32c(head[:8]) == int.from_bytes(head[8:12], "little")


@pytest.mark.parametrize("comp", [None, "GZIP", "ZLIB"])
def test_tensorflow_reads_our_files(comp, tmp_path):
    tf = pytest.importorskip("tensorflow")
    recs = tf_records()
    path = write(tmp_path / "ours.tfrecord", recs, comp)
    got = [x.numpy() for x in tf.data.TFRecordDataset(str(path), compression_type=comp or "")]
    assert got == recs


# --------------------------------------------------------------- round trip
@pytest.mark.parametrize("comp", [None, "GZIP", "ZLIB"])
def test_round_trip_and_lod_batches(comp, tmp_path):
    rng = np.random.default_rng(0)
    recs = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
            for n in [0, 1, 5, 300_000, 17] + rng.integers(0, 3000, size=200).tolist()]
    path = write(tmp_path / "rt.tfrecord", recs, comp)
    assert read_all(path, compression=comp) == recs
    r = TFRecordReader(path, compression=comp).batch(32)
    got = []
    for (t,) in r:
        assert t.data.dtype == np.uint8 and t.lod[0][0] == 0 and t.lod[0][-1] == len(t.data)
        got += [t.sequence(i).tobytes() for i in range(len(t.lod[0]) - 1)]
    assert got == recs
    # a second epoch (now with the sidecar index) is identical
    assert [t.sequence(i).tobytes() for (t,) in r for i in range(len(t.lod[0]) - 1)] == recs


def test_fixed_schema_reinterprets_bytes_like_decode_raw(tmp_path):
    x = np.arange(50 * 16, dtype=np.float32).reshape(50, 16)
    path = tmp_path / "f.tfrecord"
    with TFRecordWriter(path) as w:
        w.write_batch(x)
    schema = rl.Schema([rl.Field("x", "float32", (16,))])
    (t,) = next(iter(TFRecordReader(path, schema=schema).batch(64)))
    np.testing.assert_array_equal(t.data, x)
    # a one-field sequence schema of another dtype: rows of that dtype
    seq = rl.Schema([rl.Field("v", "float32", (4,), lod_level=1)])
    (t,) = next(iter(TFRecordReader(path, schema=seq).batch(64)))
    np.testing.assert_array_equal(t.data, x.reshape(-1, 4))
    assert t.lengths().tolist() == [4] * 50


def test_fixed_schema_wrong_size_names_file_and_offset(tmp_path):
    path = write(tmp_path / "bad.tfrecord", [b"\0" * 64, b"\0" * 64, b"\0" * 60])
    schema = rl.Schema([rl.Field("x", "float32", (16,))])
    with pytest.raises(ValueError, match=rf"bad.tfrecord: record at {2 * 80} has 60 bytes.*64 bytes"):
        list(TFRecordReader(path, schema=schema))
    seq = rl.Schema([rl.Field("v", "int64", (), lod_level=1)])
    with pytest.raises(ValueError, match=r"record at 160 has 60 bytes; .*multiple of 8"):
        list(TFRecordReader(path, schema=seq))


def test_bad_arguments(tmp_path):
    path = write(tmp_path / "a.tfrecord", [b"x"])
    with pytest.raises(ValueError, match="compression"):
        TFRecordReader(path, compression="LZ4")
    with pytest.raises(ValueError, match="one field"):
        TFRecordReader(path, schema=rl.Schema([rl.Field("a", "uint8"), rl.Field("b", "uint8")]))
    with pytest.raises(FileNotFoundError):
        TFRecordReader(tmp_path / "missing.tfrecord")
    with pytest.raises(ValueError, match="compression"):
        TFRecordWriter(tmp_path / "b.tfrecord", compression="zip")
    w = TFRecordWriter(tmp_path / "c.tfrecord")
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write(b"x")
    with pytest.raises(TypeError):
        TFRecordWriter(tmp_path / "d.tfrecord").write("text")
    r = TFRecordReader(path)
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.read_next()


def test_empty_file(tmp_path):
    path = write(tmp_path / "e.tfrecord", [])
    r = TFRecordReader(path)
    assert list(r) == [] and len(r) == 0


# --------------------------------------------------------------- corruption
def _small_records():
    return [b"", b"abc", bytes(range(40)), b"z" * 9]


def test_every_flipped_byte_raises_data_loss(tmp_path):
    recs = _small_records()
    data = open(write(tmp_path / "ok.tfrecord", recs), "rb").read()
    starts, end = record_starts(recs)
    assert end == len(data)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        p = tmp_path / "flip.tfrecord"
        p.write_bytes(bytes(bad))
        with pytest.raises(TFRecordError) as ei:
            read_all(p, index=False)
        rec_start = max(s for s in starts if s <= i)
        assert f"corrupted record at {rec_start}" in str(ei.value), (i, str(ei.value))
        assert "flip.tfrecord" in str(ei.value) and ei.value.offset == rec_start
        assert isinstance(ei.value, rl.DataLossError)


def test_flipped_bytes_in_zero_copy_records(tmp_path):
    # fixed-size records are handed out of the memory map, each verified as it goes
    recs = [bytes([i]) * 8 for i in range(5)]
    data = open(write(tmp_path / "ok.tfrecord", recs), "rb").read()
    schema = rl.Schema([rl.Field("x", "uint8", (8,))])
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01
        p = tmp_path / "flip.tfrecord"
        p.write_bytes(bytes(bad))
        got = []
        with pytest.raises(TFRecordError, match=rf"corrupted record at {(i // 24) * 24}\b"):
            for inst in TFRecordReader(p, schema=schema, index=False):
                got.append(inst[0].tobytes())
        assert got == recs[:len(got)] and len(got) <= i // 24     # never different data


def test_truncation_at_every_offset(tmp_path):
    recs = _small_records()
    data = open(write(tmp_path / "ok.tfrecord", recs), "rb").read()
    starts, _ = record_starts(recs)
    for n in range(len(data)):
        p = tmp_path / "trunc.tfrecord"
        p.write_bytes(data[:n])
        if n in starts:         # a record boundary: a valid, shorter file (TF reads it too)
            assert read_all(p, index=False) == recs[:starts.index(n)]
            continue
        with pytest.raises(TFRecordError, match=r"truncated record at \d+"):
            read_all(p, index=False)


@pytest.mark.parametrize("comp", ["GZIP", "ZLIB"])
def test_compressed_corruption_never_gives_different_data(comp, tmp_path):
    recs = _small_records() * 3
    data = open(write(tmp_path / "ok.tfrecord", recs, comp), "rb").read()
    errors = 0
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        p = tmp_path / "flip.tfrecord"
        p.write_bytes(bytes(bad))
        try:
            got = read_all(p, compression=comp, index=False)
        except TFRecordError as e:
            assert "flip.tfrecord" in str(e)
            errors += 1
            continue
        assert got == recs, i        # only header fields zlib ignores (gzip mtime, OS) may change
    assert errors >= len(data) - 10
    for n in range(len(data)):
        p = tmp_path / "trunc.tfrecord"
        p.write_bytes(data[:n])
        with pytest.raises(TFRecordError, match="truncated record"):
            read_all(p, compression=comp, index=False)


# -------------------------------------------------------------------- index
def _big_file(tmp_path, comp=None, n=60, size=100_000):
    rng = np.random.default_rng(1)
    recs = [rng.integers(0, 256, size=size + i, dtype=np.uint8).tobytes() for i in range(n)]
    return write(tmp_path / ("big.tfrecord" + (".gz" if comp else "")), recs, comp), recs


@pytest.mark.parametrize("comp", [None, "GZIP"])
def test_index_built_on_first_full_pass_then_used(comp, tmp_path):
    path, recs = _big_file(tmp_path, comp)
    idx = str(path) + ".idx"
    r = TFRecordReader(path, compression=comp)
    assert not r.has_index and not os.path.exists(idx)
    assert [x[0].tobytes() for x in r] == recs
    assert os.path.exists(idx)
    r2 = TFRecordReader(path, compression=comp)
    assert r2.has_index and r2.num_records == len(recs)
    offs, counts = r2.chunk_table()
    assert counts.sum() == len(recs) and len(counts) > 3       # ~1 MiB chunks of 100 KB records
    assert offs[0] == 0 and np.all(np.diff(offs) <= CHUNK_BYTES + 200_000)
    # seek: chunks in any order give exactly their records
    r2.select_chunks([2, 0])
    first = np.concatenate([[0], np.cumsum(counts)])
    want = recs[first[2]:first[3]] + recs[first[0]:first[1]]
    assert [x[0].tobytes() for x in r2] == want


def test_stale_or_corrupt_index_is_ignored(tmp_path):
    path, recs = _big_file(tmp_path, n=30)
    idx = build_index(path)
    assert idx == str(path) + ".idx" and TFRecordReader(path).has_index
    raw = bytearray(open(idx, "rb").read())
    raw[70] ^= 1
    open(idx, "wb").write(raw)
    assert not TFRecordReader(path).has_index                   # checksum fails: rebuilt later
    build_index(path)
    write(path, recs[:10])                                      # the file changes: index is stale
    r = TFRecordReader(path)
    assert not r.has_index and [x[0].tobytes() for x in r] == recs[:10]


def test_index_disabled_and_read_only_directory(tmp_path):
    path, recs = _big_file(tmp_path, n=12)
    r = TFRecordReader(path, index=False)
    assert [x[0].tobytes() for x in r] == recs
    assert not os.path.exists(str(path) + ".idx")
    # an explicit sidecar path
    side = tmp_path / "elsewhere.idx"
    r = TFRecordReader(path, index=str(side))
    list(r)
    assert side.exists() and TFRecordReader(path, index=str(side)).has_index


def test_concatenated_gzip_members(tmp_path):
    a = write(tmp_path / "a.tfrecord.gz", [b"one", b"two"], "GZIP")
    b = write(tmp_path / "b.tfrecord.gz", [b"three"], "GZIP")
    both = tmp_path / "ab.tfrecord.gz"
    both.write_bytes(open(a, "rb").read() + open(b, "rb").read())      # `cat a.gz b.gz`
    assert read_all(both, compression="GZIP") == [b"one", b"two", b"three"]


@pytest.mark.parametrize("comp", [None, "GZIP"])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_sequence_records_are_bare_and_every_chain_reads_them(comp, dtype, tmp_path):
    """Sequence records go downstream without the row-count prefix (zero copy from the
    mapping); every decorator passes them on and every consumer parses them, each
    record exactly once per epoch; prefixed on request, with the same result."""
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal(n).astype(dtype) if dtype == "float32" else
            rng.integers(0, 256, n, dtype=np.uint8) for n in rng.integers(0, 2000, 300)]
    rows[3] = rows[3][:0]
    path = write(tmp_path / "s.tfrecord", [r.tobytes() for r in rows], comp)
    schema = rl.Schema([rl.Field("x", dtype, (), lod_level=1)])

    def open_(prefixed=False):
        r = TFRecordReader(path, schema=schema, compression=comp)
        if prefixed:
            r._prefixed_instances()
        return r

    assert open_().bare_instances and not open_(prefixed=True).bare_instances
    want = sorted(r.tobytes() for r in rows)
    for prefixed in (False, True):
        assert [inst[0].tobytes() for inst in open_(prefixed)] == [r.tobytes() for r in rows]
        chains = [open_(prefixed).shuffle(64, seed=2).batch(16),
                  open_(prefixed).multi_pass(2).batch(7),
                  rl.ReaderHolder(open_(prefixed)).prefetch(3).batch(33),
                  open_(prefixed).shuffle(10, seed=1).shard(1, 0).batch(50, drop_last=False)]
        for k, chain in enumerate(chains):
            assert chain.bare_instances is False          # batches are never bare
            got = []
            for (t,) in chain:
                assert t.data.dtype == np.dtype(dtype)
                got += [t.sequence(i).tobytes() for i in range(len(t.lod[0]) - 1)]
            assert sorted(got) == (sorted(want * 2) if k == 1 else want)
            chain.close()
    # a record that is not a whole number of rows is refused, with its offset
    if dtype == "float32":
        bad = write(tmp_path / "bad.tfrecord", [b"\0" * 8, b"\0" * 6], comp)
        with pytest.raises(ValueError, match=r"bad\.tfrecord: record at 24.* has 6 bytes"):
            list(TFRecordReader(bad, schema=schema, compression=comp))


def test_open_files_keeps_tfrecord_sequences_bare_unless_mixed(tmp_path):
    recs = [bytes([i]) * i for i in range(50)]
    a = write(tmp_path / "a.tfrecord", recs[:25])
    b = write(tmp_path / "b.tfrecord", recs[25:])
    assert rl.open_files([a, b]).bare_instances
    with rl.RecordIOWriter(str(tmp_path / "c.rio"), rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])) as w:
        for r in recs[:10]:
            w.write((np.frombuffer(r, np.uint8),))
    mixed = rl.open_files([a, str(tmp_path / "c.rio"), b], num_threads=2)
    assert not mixed.bare_instances
    got = [t.sequence(i).tobytes() for (t,) in mixed.batch(8) for i in range(len(t.lod[0]) - 1)]
    assert got == recs[:25] + recs[:10] + recs[25:]


def test_reader_holder_swaps_keep_the_chain_s_instance_form(tmp_path):
    """Decorators take the holder's instance form when built; a swapped-in reader must
    give the same form (a TFRecord reader is asked to prefix) or is refused."""
    recs = [bytes([i]) * (i % 7) for i in range(30)]
    tf = write(tmp_path / "a.tfrecord", recs)
    rio = str(tmp_path / "b.rio")
    with rl.RecordIOWriter(rio, rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])) as w:
        for r in recs:
            w.write((np.frombuffer(r, np.uint8),))

    def seqs(chain):
        return [t.sequence(i).tobytes() for (t,) in chain for i in range(len(t.lod[0]) - 1)]

    h = rl.ReaderHolder(rl.RecordIOReader(rio))
    b = h.batch(4)
    assert seqs(b) == recs
    h.reset_reader(TFRecordReader(tf))            # bare reader into a prefixed chain: prefixed
    assert not h.reader.bare_instances
    assert seqs(b) == recs

    h = rl.ReaderHolder(TFRecordReader(tf))
    b = h.batch(4)
    with pytest.raises(ValueError, match="bare instances"):
        h.reset_reader(rl.RecordIOReader(rio))
    assert seqs(b) == recs                        # the chain is untouched
