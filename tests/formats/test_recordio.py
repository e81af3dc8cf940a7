"""RecordIO format: round trips, corruption and truncation, crc32c (readerlib/formats/_recordio.pyx)."""
import os
import subprocess
import sys
import textwrap
import warnings
import zlib

import numpy as np
import pytest

import readerlib as rl
from readerlib.tensor import SUPPORTED_DTYPES
from helpers import (canon, drain, drain_canon, make_columns, read_all, scratch,  # noqa: F401 (a fixture)
                     write_recordio)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _values(dtype, shape, rng):
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    a = (rng.standard_normal(shape) * 1e3).astype(dtype)
    flat = a.reshape(-1)
    special = np.array([np.nan, np.inf, -np.inf, -0.0], dtype=dtype)
    flat[:min(4, flat.size)] = special[:min(4, flat.size)]
    return a


def _schema_all_shapes(dtype):
    return rl.Schema([rl.Field("scalar", dtype), rl.Field("vec", dtype, (3,)),
                      rl.Field("mat_seq", dtype, (2, 3), lod_level=1),
                      rl.Field("scalar_seq", dtype, (), lod_level=1)])


def _instances(dtype, n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append((_values(dtype, (), rng), _values(dtype, (3,), rng),
                    _values(dtype, (i % 4, 2, 3), rng), _values(dtype, ((i * 7) % 5,), rng)))
    return out


def _trailer_index_offset(data):
    return int.from_bytes(data[-16:-8], "little")


# ================================================================ round trips
@pytest.mark.parametrize("compressor", ["none", "zlib"])
@pytest.mark.parametrize("how", ["write_tuple", "write_dict", "write_batch"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_round_trip_every_dtype(tmp_path, dtype, how, compressor):
    schema = _schema_all_shapes(dtype)
    insts = _instances(dtype, 13)
    path = tmp_path / "x.rio"
    with rl.RecordIOWriter(path, schema, chunk_size=200, compressor=compressor) as w:
        if how == "write_tuple":
            for inst in insts:
                w.write(inst)
        elif how == "write_dict":
            for inst in insts:
                w.write(dict(zip(schema.names, inst)))
        else:
            w.write_batch({"scalar": np.stack([i[0] for i in insts]),
                           "vec": np.stack([i[1] for i in insts]),
                           "mat_seq": [i[2] for i in insts],
                           "scalar_seq": rl.LoDTensor.from_sequences([i[3] for i in insts])})
        assert w.num_records == 13
    r = rl.RecordIOReader(path)
    assert r.schema == schema                      # read back from the file
    assert [f.dtype for f in r.schema] == [np.dtype(dtype)] * 4
    assert r.num_records == len(r) == 13 and r.has_index
    got = drain(r)
    assert [canon(g) for g in got] == [canon(i) for i in insts]
    for g in got:
        assert g[0].shape == () and g[1].shape == (3,) and g[2].shape[1:] == (2, 3)
    r.reset()
    assert drain_canon(r.batch(4)) == [canon(i) for i in insts]


@pytest.mark.parametrize("compressor", ["none", "zlib"])
def test_zero_records(tmp_path, compressor):
    schema = rl.Schema([rl.Field("s", "float32", (4,), 1)])
    path = tmp_path / "empty.rio"
    with rl.RecordIOWriter(path, schema, compressor=compressor) as w:
        assert w.num_chunks == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = rl.RecordIOReader(path)
    assert r.schema == schema and r.num_records == 0 and r.num_chunks == 0 and r.has_index
    assert r.read_next() is None and drain(r.shuffle(3, seed=0).batch(2)) == []


def test_empty_sequences_and_zero_size_fields(tmp_path):
    schema = rl.Schema([rl.Field("s", "int32", (2,), 1), rl.Field("e", "float32", (0,)),
                        rl.Field("es", "float32", (0, 3), 1), rl.Field("y", "int8")])
    insts = [(np.zeros((0, 2), np.int32), np.zeros(0, np.float32), np.zeros((k, 0, 3), np.float32),
              np.int8(k)) for k in range(5)]
    insts.append((np.ones((3, 2), np.int32), np.zeros(0, np.float32), np.zeros((0, 0, 3), np.float32),
                  np.int8(-1)))
    path = tmp_path / "e.rio"
    with rl.RecordIOWriter(path, schema) as w:
        for i in insts:
            w.write(i)
    got = drain(rl.RecordIOReader(path))
    assert [canon(g) for g in got] == [canon(i) for i in insts]
    assert [g[2].shape for g in got][:3] == [(0, 0, 3), (1, 0, 3), (2, 0, 3)]
    (s, e, es, y), = drain(rl.RecordIOReader(path).batch(10))
    assert s.lod[0].tolist() == [0, 0, 0, 0, 0, 0, 3] and e.shape == (6, 0)
    assert es.lod[0].tolist() == [0, 0, 1, 3, 6, 10, 10] and es.shape == (10, 0, 3)


@pytest.mark.parametrize("compressor", ["none", "zlib"])
@pytest.mark.parametrize("chunk_size", [1, 50, 500, 1 << 20])
def test_chunking(tmp_path, chunk_size, compressor):
    cols, schema, want = make_columns(40, lod=True, seed=1)
    path = tmp_path / "c.rio"
    with rl.RecordIOWriter(path, schema, chunk_size=chunk_size, compressor=compressor) as w:
        for i in range(40):
            w.write(tuple(cols[k][i] for k in schema.names))
        writer_chunks = w.num_chunks
    r = rl.RecordIOReader(path)
    assert r.num_chunks == writer_chunks and r.num_records == 40
    if chunk_size == 1:
        assert r.num_chunks == 40                   # a chunk holds at least one record
    if chunk_size == 1 << 20:
        assert r.num_chunks == 1
    offs, nrec = r.chunk_table()
    assert offs[0] == r.data_start and np.all(np.diff(offs) > 0) and nrec.sum() == 40
    assert np.all(nrec >= 1)
    if compressor == "none":
        # the chunk stays within chunk_size unless one record alone is bigger
        sizes = np.diff(np.append(offs, _trailer_index_offset(path.read_bytes()))) - 32
        assert np.all((sizes <= chunk_size) | (nrec == 1))
    assert drain_canon(r) == want
    # chunks can be selected (sharding), in any order
    sel = list(range(r.num_chunks))[::-1]
    r.select_chunks(sel)
    per_chunk = np.split(np.arange(40), np.cumsum(nrec)[:-1])
    assert [canon(i) for i in drain(r)] == [want[j] for c in sel for j in per_chunk[c]]
    with pytest.raises(IndexError):
        r.select_chunks([r.num_chunks])


def test_write_batch_then_write_and_flush(tmp_path):
    schema = rl.Schema([rl.Field("x", "float64", (2,)), rl.Field("s", "uint16", (), 1)])
    path = tmp_path / "m.rio"
    w = rl.RecordIOWriter(path, schema, chunk_size=64)
    w.write_batch((np.arange(10.0).reshape(5, 2), [np.arange(k, dtype=np.uint16) for k in range(5)]))
    w.flush()
    w.write((np.array([9.0, 9.0]), np.array([7], np.uint16)))
    w.write({"x": [1, 2], "s": [1, 2, 3]})            # lists cast to the field dtype
    assert w.num_records == 7
    w.close()
    w.close()                                         # idempotent
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.write((np.zeros(2), np.zeros(0, np.uint16)))
    with pytest.raises(ValueError, match="closed"):
        w.flush()
    got = drain(rl.RecordIOReader(path))
    assert len(got) == 7
    assert got[5][1].tolist() == [7] and got[6][0].tolist() == [1.0, 2.0] and got[6][1].tolist() == [1, 2, 3]
    assert [g[1].tolist() for g in got[:5]] == [list(range(k)) for k in range(5)]


def test_large_record_bigger_than_chunk_size(tmp_path):
    schema = rl.Schema([rl.Field("b", "uint8", (), 1)])
    big = np.arange(100_000, dtype=np.int64).astype(np.uint8)
    path = tmp_path / "big.rio"
    with rl.RecordIOWriter(path, schema, chunk_size=1000, compressor="zlib") as w:
        w.write((big[:10],))
        w.write((big,))
        w.write((big[:5],))
    r = rl.RecordIOReader(path)
    assert r.num_chunks == 3
    got = drain(r)
    assert [g[0].tolist() for g in got] == [big[:10].tolist(), big.tolist(), big[:5].tolist()]


def test_writer_context_manager_closes_on_exception(tmp_path):
    path = tmp_path / "x.rio"
    with pytest.raises(RuntimeError):
        with rl.RecordIOWriter(path, [("x", "int64")]) as w:
            w.write((1,))
            raise RuntimeError
    assert w.closed
    assert [int(g[0]) for g in drain(rl.RecordIOReader(path))] == [1]


def test_writer_bad_instance_names_the_field(tmp_path):
    schema = rl.Schema([rl.Field("feats", "float32", (80,), 1), rl.Field("label", "int64")])
    with rl.RecordIOWriter(tmp_path / "x.rio", schema) as w:
        w.write((np.zeros((3, 80), np.float32), 7))
        with pytest.raises(ValueError, match="'feats'"):
            w.write((np.zeros((3, 81), np.float32), 7))
        with pytest.raises(ValueError, match="'label'"):
            w.write((np.zeros((3, 80), np.float32), [7, 8]))
        with pytest.raises(ValueError, match="missing"):
            w.write({"feats": np.zeros((3, 80), np.float32)})
        with pytest.raises(TypeError, match="'label'"):
            w.write((np.zeros((3, 80), np.float32), 7.5))
        with pytest.raises(ValueError, match="'feats'"):
            w.write_batch({"feats": np.zeros((3, 80), np.float32), "label": np.arange(3)})
        assert w.num_records == 1
    assert len(drain(rl.RecordIOReader(tmp_path / "x.rio"))) == 1


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(compressor="lz4"), ValueError, "compressor"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size="1M"), TypeError, "chunk_size"),
    (dict(compression_level=10), ValueError, "compression_level"),
    (dict(compression_level=-1), ValueError, "compression_level"),
])
def test_writer_bad_input(tmp_path, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rl.RecordIOWriter(tmp_path / "x.rio", [("x", "int64")], **kwargs)
    assert not (tmp_path / "x.rio").exists()          # nothing created on bad arguments


def test_writer_bad_schema_and_path(tmp_path):
    with pytest.raises(TypeError, match="schema"):
        rl.RecordIOWriter(tmp_path / "x.rio", None)
    with pytest.raises(OSError):
        rl.RecordIOWriter(tmp_path, [("x", "int64")])          # a directory
    with pytest.raises(TypeError):
        rl.RecordIOWriter(3.5, [("x", "int64")])


def test_reader_bad_input(tmp_path):
    path = write_recordio(str(tmp_path / "x.rio"), {"x": np.arange(3)}, rl.Schema([rl.Field("x", "int64")]))
    with pytest.raises(ValueError, match="on_error"):
        rl.RecordIOReader(path, on_error="ignore")
    with pytest.raises(TypeError):
        rl.RecordIOReader(3.5)
    with pytest.raises(FileNotFoundError):
        rl.RecordIOReader(tmp_path / "missing.rio")
    r = rl.RecordIOReader(os.fsencode(path)) if False else rl.RecordIOReader(tmp_path / "x.rio")
    assert r.path == path


@pytest.mark.parametrize("content", [b"", b"RLREC", b"hello world, this is not a recordio file\n" * 3,
                                     bytes(range(256)), b"RLRECIO1" + b"\xff" * 40])
def test_not_a_recordio_file(tmp_path, content):
    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    with pytest.raises(rl.RecordIOError, match="junk.bin") as e:
        drain(rl.RecordIOReader(path))
    assert e.value.path == str(path) and e.value.offset is not None
    assert "byte offset" in str(e.value)
    assert isinstance(e.value, rl.DataLossError) and isinstance(e.value, OSError)


def test_a_tfrecord_or_npy_file_is_rejected(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100))
    with pytest.raises(rl.RecordIOError, match="not a readerlib RecordIO file"):
        rl.RecordIOReader(tmp_path / "a.npy")


def test_reader_close_and_context_manager(tmp_path):
    path = write_recordio(str(tmp_path / "x.rio"), {"x": np.arange(30)}, rl.Schema([rl.Field("x", "int64")]),
                          chunk_size=40)
    with rl.RecordIOReader(path) as r:
        first = r.read_next()
    assert r.closed and int(first[0]) == 0
    with pytest.raises(ValueError, match="I/O operation on closed reader"):
        r.read_next()
    # batches from a closed chain stay valid
    chain = rl.RecordIOReader(path).shuffle(8, seed=0).batch(7)
    batches = list(chain)
    chain.close()
    assert sorted(np.concatenate([b[0].data for b in batches]).tolist()) == list(range(30))


def _run_py(code):
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_decorating_a_closed_reader_is_an_error_not_a_crash(tmp_path):
    path = write_recordio(str(tmp_path / "x.rio"), {"x": np.arange(10)}, rl.Schema([rl.Field("x", "int64")]))
    p = _run_py(f"""
        import readerlib as rl
        r = rl.RecordIOReader({path!r}); r.close()
        for make in (lambda: r.batch(2), lambda: rl.ReaderHolder(r), lambda: r.shuffle(3, seed=0)):
            try:
                make().read_next()
            except ValueError as e:
                assert "closed" in str(e), e
            else:
                raise SystemExit("no error")
        """)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])


def test_select_chunks_with_repeats_longer_than_num_chunks(tmp_path):
    path = write_recordio(str(tmp_path / "x.rio"), {"x": np.arange(10)}, rl.Schema([rl.Field("x", "int64")]))
    p = _run_py(f"""
        import readerlib as rl
        r = rl.RecordIOReader({path!r})
        assert r.num_chunks == 1
        try:
            r.select_chunks([0] * 1000)
        except ValueError:
            pass                      # refusing is fine
        else:
            got = [int(x[0]) for x in r]
            assert got == list(range(10)) * 1000, len(got)
        """)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])


# ================================================================ corruption
def _small_file(path, compressor, kind="lod"):
    """A few hundred bytes, several chunks: sequence records, fixed records, or no records."""
    cols, schema, want = make_columns(0 if kind == "empty" else 6, lod=kind != "fixed", max_len=2,
                                      inner=(1,), seed=3)
    version = 1 if compressor.endswith("-v1") else 2
    write_recordio(path, cols, schema, chunk_size=60 if kind != "fixed" else 24,
                   compressor=compressor.replace("-v1", ""), version=version)
    return want


# "-v1": the same files in format version 1 (readers keep reading it)
KINDS = [("none", "lod"), ("zlib", "lod"), ("none", "fixed"), ("zlib", "fixed"), ("none", "empty"),
         ("none-v1", "lod"), ("none-v1", "fixed")]


def _check_error(e, path, flipped_at=None):
    assert isinstance(e, rl.RecordIOError)
    assert str(path) in str(e) and e.path == str(path)
    assert "byte offset" in str(e) and e.offset is not None
    assert f"byte offset {e.offset}" in str(e)
    if flipped_at is not None:
        assert 0 <= e.offset <= flipped_at, (e.offset, flipped_at, str(e))


@pytest.mark.parametrize("compressor,kind", KINDS)
def test_every_byte_flipped_is_detected(scratch, compressor, kind):
    """Any single corrupted byte: RecordIOError naming the file and offset, or (footer only) a warning and all data."""
    src = scratch / "good.rio"
    want = _small_file(src, compressor, kind)
    data = src.read_bytes()
    assert rl.RecordIOReader(src).num_chunks >= (0 if kind == "empty" else 4)
    bad = scratch / "bad.rio"
    for mask in (0x01, 0x80, 0xFF):
        for i in range(len(data)):
            b = bytearray(data)
            b[i] ^= mask
            bad.write_bytes(bytes(b))
            try:
                got, ws, _ = read_all(bad)
            except rl.RecordIOError as e:
                _check_error(e, bad, flipped_at=i)
                continue
            # not an error: only acceptable as the complete, correct data plus a warning
            assert got == want, f"byte {i} ^ {mask:#x}: different data delivered"
            assert ws, f"byte {i} ^ {mask:#x}: corruption went unnoticed"


@pytest.mark.parametrize("compressor,kind", KINDS)
def test_every_byte_flipped_skip_mode(scratch, compressor, kind):
    """on_error='skip': only correct records, in order; fewer records -> a warning and a skip count."""
    src = scratch / "good.rio"
    want = _small_file(src, compressor, kind)
    data = src.read_bytes()
    header_end = rl.RecordIOReader(src).data_start
    bad = scratch / "bad.rio"
    skipped_seen = 0
    for mask in (0x01, 0xFF):
        for i in range(len(data)):
            b = bytearray(data)
            b[i] ^= mask
            bad.write_bytes(bytes(b))
            try:
                got, ws, r = read_all(bad, on_error="skip")
            except rl.RecordIOError as e:
                # only the file header (magic, schema) cannot be skipped
                assert i < header_end, f"byte {i}: skip mode raised {e}"
                _check_error(e, bad, flipped_at=i)
                continue
            assert got == [w for w in want if w in got], f"byte {i} ^ {mask:#x}: records not a subsequence"
            assert len(set(got)) == len(got)
            if len(got) < len(want):
                assert ws and r.skipped_chunks > 0, f"byte {i}: records lost without a warning"
                skipped_seen += 1
            else:
                assert ws, f"byte {i} ^ {mask:#x}: corruption went unnoticed"
    assert skipped_seen > 0 or kind == "empty"


@pytest.mark.parametrize("compressor,kind", KINDS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_truncation_at_every_offset(scratch, compressor, kind, on_error):
    """Truncated anywhere: an error, or a warning and a correct prefix -- never silently fewer records."""
    src = scratch / "good.rio"
    want = _small_file(src, compressor, kind)
    data = src.read_bytes()
    r0 = rl.RecordIOReader(src)
    offs, nrec = r0.chunk_table()
    index_off = _trailer_index_offset(data)
    boundaries = {int(o): int(nrec[:k].sum()) for k, o in enumerate(offs)}
    boundaries[index_off] = len(want)
    cut_file = scratch / "cut.rio"
    for cut in range(len(data)):
        cut_file.write_bytes(data[:cut])
        try:
            got, ws, r = read_all(cut_file, on_error=on_error)
        except rl.RecordIOError as e:
            _check_error(e, cut_file)
            assert e.offset <= cut
            if on_error == "raise":
                assert cut not in boundaries, f"cut at chunk boundary {cut}: should be readable with a warning"
            else:
                assert cut < r0.data_start, f"cut at {cut}: skip mode raised {e}"
            continue
        assert ws, f"cut at {cut}: truncated file read without a warning"
        assert got == want[:len(got)], f"cut at {cut}: not a prefix of the records"
        if on_error == "raise":
            assert cut in boundaries, f"cut at {cut} (mid-chunk) read without an error"
            assert len(got) == boundaries[cut]
            assert not r.has_index and r.num_records == len(got)
        else:
            # everything before the cut chunk is there
            complete = max(v for k, v in boundaries.items() if k <= cut)
            assert len(got) >= complete, f"cut at {cut}: lost records of complete chunks"


def test_writer_that_never_closed(tmp_path):
    """A writer that died after flush(): the file has no footer and is read by scanning, with a warning."""
    cols, schema, want = make_columns(25, lod=True, seed=9)
    path = tmp_path / "live.rio"
    w = rl.RecordIOWriter(path, schema, chunk_size=100)
    for i in range(20):
        w.write(tuple(cols[k][i] for k in schema.names))
    w.flush()
    snapshot = path.read_bytes()                 # what a crash would leave behind
    for i in range(20, 25):
        w.write(tuple(cols[k][i] for k in schema.names))
    w.close()
    dead = tmp_path / "dead.rio"
    dead.write_bytes(snapshot)
    with pytest.warns(rl.RecordIOWarning, match="no index footer"):
        r = rl.RecordIOReader(dead)
    assert not r.has_index and r.num_records == 20 and r.schema == schema
    assert drain_canon(r) == want[:20]
    # the same for the finished file cut right before its footer
    data = path.read_bytes()
    dead.write_bytes(data[:_trailer_index_offset(data)])
    got, ws, r = read_all(dead)
    assert got == want and ws and r.num_records == 25 and not r.has_index
    # and the finished file is whole
    got, ws, r = read_all(path)
    assert got == want and not ws and r.has_index


def test_skip_mode_counts_skipped_chunks(tmp_path):
    cols, schema, want = make_columns(30, lod=False, seed=2)
    path = tmp_path / "x.rio"
    write_recordio(path, cols, schema, chunk_size=64)
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    data = bytearray(path.read_bytes())
    data[int(offs[2]) + 40] ^= 0x10              # body of chunk 2
    data[int(offs[5]) + 2] ^= 0x10               # header of chunk 5
    path.write_bytes(bytes(data))
    with pytest.warns(rl.RecordIOWarning, match="skipped chunk"):
        r = rl.RecordIOReader(path, on_error="skip")
        got = drain_canon(r)
    assert r.skipped_chunks == 2
    lost = set(range(int(nrec[:2].sum()), int(nrec[:3].sum()))) | set(range(int(nrec[:5].sum()), int(nrec[:6].sum())))
    assert got == [w for k, w in enumerate(want) if k not in lost]
    with pytest.raises(rl.RecordIOError, match=rf"byte offset {int(offs[2]) + 32}"):
        drain(rl.RecordIOReader(path))


def test_skip_mode_never_delivers_records_that_were_not_written(tmp_path):
    schema = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])
    inner = tmp_path / "inner.rio"
    with rl.RecordIOWriter(inner, schema) as w:
        w.write((np.array([1, 2, 3], np.uint8),))
    d = inner.read_bytes()
    start = rl.RecordIOReader(inner).data_start
    fake_chunk = np.frombuffer(d[start:_trailer_index_offset(d)], np.uint8)
    path = tmp_path / "outer.rio"
    with rl.RecordIOWriter(path, schema) as w:     # one chunk: [payload that embeds a valid chunk]
        w.write((np.arange(10, dtype=np.uint8),))
        w.write((fake_chunk,))
        w.write((np.arange(50, dtype=np.uint8),))
    data = path.read_bytes()
    want = drain_canon(rl.RecordIOReader(path))
    cut = tmp_path / "cut.rio"
    cut.write_bytes(data[:_trailer_index_offset(data) - 20])     # truncated inside the only chunk
    got, ws, r = read_all(cut, on_error="skip")
    assert ws
    assert got == [w for w in want if w in got], "skip mode delivered a record that was never written"


# ================================================================ crc32c
KNOWN = [
    (b"", 0x00000000),
    (b"a", 0xC1D04330),
    (b"123456789", 0xE3069283),
    (b"\x00" * 32, 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"The quick brown fox jumps over the lazy dog", 0x22620404),
]


@pytest.mark.parametrize("data,want", KNOWN)
def test_crc32c_known_vectors(data, want):
    assert rl.crc32c(data) == want
    assert rl.crc32c(bytearray(data)) == want
    assert rl.crc32c(memoryview(data)) == want
    assert rl.crc32c(np.frombuffer(data, np.uint8)) == want


def _lengths():
    ls = set(range(0, 300)) | {511, 512, 513, 767, 768, 769, 1023, 1024, 4095, 4096, 8191, 8192, 8193,
                               24575, 24576, 24577, 24576 + 767, 24576 + 768, 24576 + 769, 49152,
                               49151, 49153, 65536, 73727, 73728, 73729, 99999, 100000}
    for k in range(1, 12):
        ls |= {256 * 3 * k - 1, 256 * 3 * k, 256 * 3 * k + 1, 8192 * 3 * k % 100001}
    return sorted(ls)


def _pure_crc32c(data, crc=0):
    """Bitwise reference (slow, used on short inputs)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_against_reference_all_lengths_and_alignments():
    buf = np.random.default_rng(0).integers(0, 256, size=100_010, dtype=np.uint8).tobytes()
    try:
        import crc32c as ref_mod
        ref = ref_mod.crc32c
    except ImportError:
        ref = None
    mv = memoryview(buf)
    for n in _lengths():
        for align in (0, 1, 3, 7):
            piece = mv[align:align + n]
            got = rl.crc32c(piece)
            if ref is not None:
                assert got == ref(piece.tobytes()), (n, align)
            elif n <= 300:
                assert got == _pure_crc32c(piece.tobytes()), (n, align)
    for n in range(0, 40):
        assert rl.crc32c(buf[:n]) == _pure_crc32c(buf[:n])


def test_crc32c_continues():
    buf = np.random.default_rng(1).integers(0, 256, size=100_000, dtype=np.uint8).tobytes()
    whole = rl.crc32c(buf)
    for cut in (0, 1, 255, 256, 8192 * 3, 50_001, 100_000):
        assert rl.crc32c(buf[cut:], rl.crc32c(buf[:cut])) == whole
    assert rl.crc32c(b"6789", rl.crc32c(b"12345")) == 0xE3069283


def test_crc32c_software_path_equals_hardware_path():
    from readerlib._core import _crc32c_uses_hardware
    lengths = _lengths()
    code = f"""
        import numpy as np, readerlib as rl
        from readerlib._core import _crc32c_uses_hardware
        buf = np.random.default_rng(0).integers(0, 256, size=100_010, dtype=np.uint8).tobytes()
        mv = memoryview(buf)
        print(int(_crc32c_uses_hardware()))
        print(" ".join(str(rl.crc32c(mv[a:a + n])) for n in {lengths!r} for a in (0, 1, 3, 7)))
        """
    env_sw = dict(os.environ, READERLIB_NO_HW_CRC="1",
                  PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env_sw, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    hw_flag, values = p.stdout.split("\n")[:2]
    assert hw_flag == "0"                             # the switch turns the hardware path off
    buf = np.random.default_rng(0).integers(0, 256, size=100_010, dtype=np.uint8).tobytes()
    mv = memoryview(buf)
    here = [rl.crc32c(mv[a:a + n]) for n in lengths for a in (0, 1, 3, 7)]
    assert [int(v) for v in values.split()] == here
    if not _crc32c_uses_hardware():
        pytest.skip("this CPU has no SSE4.2: both runs used the software path")


def test_crc32c_bad_input():
    with pytest.raises(TypeError):
        rl.crc32c("text")
    with pytest.raises((TypeError, OverflowError)):
        rl.crc32c(b"x", -1)


def test_file_checksums_are_crc32c(tmp_path):
    """Version 1: the chunk header's body checksum is CRC-32C of the stored body (spec cross-check)."""
    path = tmp_path / "x.rio"
    write_recordio(path, {"x": np.arange(5)}, rl.Schema([rl.Field("x", "int64")]), version=1)
    data = path.read_bytes()
    r = rl.RecordIOReader(path)
    off = int(r.chunk_table()[0][0])
    head = data[off:off + 32]
    stored = int.from_bytes(head[16:24], "little")
    body = data[off + 32:off + 32 + stored]
    assert int.from_bytes(head[12:16], "little") == rl.crc32c(body)
    # the chunk header CRC is salted with the file id (header bytes 16..24)
    salt = rl.crc32c(data[16:24])
    assert int.from_bytes(head[28:32], "little") == rl.crc32c(head[:28], salt)
    assert int.from_bytes(head[28:32], "little") != rl.crc32c(head[:28])
    assert data[:8] == b"RLRECIO1"
    assert rl.RecordIOReader(path).version == 1
    # zlib chunks: the checksum covers the compressed bytes, and they inflate to sizes + payload
    for version in (1, 2):
        write_recordio(path, {"x": np.arange(5)}, rl.Schema([rl.Field("x", "int64")]), compressor="zlib",
                       version=version)
        _check_zlib_chunk(path)


def _check_zlib_chunk(path):
    data = path.read_bytes()
    off = int(rl.RecordIOReader(path).chunk_table()[0][0])
    head = data[off:off + 32]
    stored = int.from_bytes(head[16:24], "little")
    body = data[off + 32:off + 32 + stored]
    assert int.from_bytes(head[12:16], "little") == rl.crc32c(body)
    raw = zlib.decompress(body)
    assert raw[:20] == b"\x08\x00\x00\x00" * 5 and raw[20:] == np.arange(5, dtype="<i8").tobytes()


@pytest.mark.parametrize("page_align", [False, True])
def test_version2_layout_per_record_crcs(tmp_path, page_align):
    """Version 2 (the default) with per-record CRCs (forced here: "auto" gives
    records this small a whole-body CRC, tests/formats/test_recordio_chunk_crc.py):
    after the size table, a table of each record's CRC-32C; the header's
    checksum covers the two tables; padding is zero."""
    path = tmp_path / "x.rio"
    recs = [np.arange(k, dtype=np.uint8) for k in (5, 0, 300, 7)]
    schema = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])
    with rl.RecordIOWriter(path, schema, page_align=page_align, record_crc=True) as w:
        assert w.version == 2
        for x in recs:
            w.write((x,))
    data = path.read_bytes()
    assert data[:8] == b"RLRECIO2"
    r = rl.RecordIOReader(path)
    assert r.version == 2
    off = int(r.chunk_table()[0][0])
    head = data[off:off + 32]
    n = int.from_bytes(head[4:8], "little")
    assert n == 4 and int.from_bytes(head[8:12], "little") == (0x100 if page_align else 0)
    tables = data[off + 32:off + 32 + 8 * n]
    assert int.from_bytes(head[12:16], "little") == rl.crc32c(tables)
    sizes = np.frombuffer(tables[:4 * n], "<u4")
    crcs = np.frombuffer(tables[4 * n:], "<u4")
    pos = off + 32 + 8 * n
    for i, x in enumerate(recs):
        enc = len(x).to_bytes(8, "little") + x.tobytes()          # i64 row count, then the rows
        assert sizes[i] == len(enc)
        if page_align:
            pad = -pos % 4096
            assert data[pos:pos + pad] == bytes(pad)
            pos += pad
        assert data[pos:pos + len(enc)] == enc and crcs[i] == rl.crc32c(enc)
        pos += len(enc)
    assert pos == off + 32 + int.from_bytes(head[16:24], "little")
    assert [bytes(v[0]) for v in r] == [x.tobytes() for x in recs]
    assert r._bytes_verified == sum(8 + len(x) for x in recs)


def test_version1_files_still_read_and_version_is_checked(tmp_path):
    schema = rl.Schema([rl.Field("x", "uint8", (40000,))])
    x = np.random.default_rng(1).integers(0, 256, (9, 40000), dtype=np.uint8)
    for version, page_align in [(1, "auto"), (1, False), (2, "auto"), (2, False)]:
        path = tmp_path / f"v{version}{page_align}.rio"
        with rl.RecordIOWriter(path, schema, version=version, page_align=page_align,
                               chunk_size=200_000) as w:
            w.write_batch({"x": x})
        assert path.read_bytes()[:8] == b"RLRECIO%d" % version
        for low_memory in (True, False):
            r = rl.RecordIOReader(path, low_memory=low_memory)
            assert r.version == version
            np.testing.assert_array_equal(np.stack([v[0] for v in r]), x)
            b = next(iter(rl.RecordIOReader(path).shuffle(4, seed=0).batch(9)))
            assert sorted(map(bytes, np.asarray(b[0].data))) == sorted(map(bytes, x))
    with pytest.raises(ValueError, match="version"):
        rl.RecordIOWriter(tmp_path / "bad.rio", schema, version=3)
    good = (tmp_path / "v2auto.rio").read_bytes()
    (tmp_path / "v9.rio").write_bytes(good[:7] + b"9" + good[8:])
    with pytest.raises(rl.RecordIOError, match="version b'9' is not supported"):
        rl.RecordIOReader(tmp_path / "v9.rio")


def test_fused_crc_copy_equals_crc_then_copy():
    """rl_crccopy.h: the copy is exact and its CRC is rl_crc32c's, at every
    length around the stream boundaries (3 x 8 KiB, 3 x 256) and alignment."""
    from readerlib.formats._recordio import _crc32c_copy, _gather_copy
    src = np.random.default_rng(2).integers(0, 256, 80_000, dtype=np.uint8).tobytes()
    for n in [0, 1, 7, 8, 9, 767, 768, 769, 775, 24575, 24576, 24577, 25344, 49152 + 768 + 9, 79_000]:
        for a in (0, 1, 5):
            d = bytearray(n)
            assert _crc32c_copy(d, src[a:a + n]) == rl.crc32c(src[a:a + n]), (n, a)
            assert bytes(d) == src[a:a + n]
    d = bytearray(100)
    assert _crc32c_copy(d, src[100:200], rl.crc32c(src[:100])) == rl.crc32c(src[:200])
    with pytest.raises(ValueError):
        _crc32c_copy(bytearray(3), b"abcd")
    dst = np.zeros((3, 1000), np.uint8)
    crcs = _gather_copy(dst, src, [5000, 0, 77], True)
    assert [bytes(r) for r in dst] == [src[5000:6000], src[:1000], src[77:1077]]
    assert list(crcs) == [rl.crc32c(src[o:o + 1000]) for o in (5000, 0, 77)]
    with pytest.raises(IndexError):
        _gather_copy(dst, src, [0, 0, 79_500], False)


def test_fused_crc_copy_software_path_equals_hardware_path():
    code = ("import numpy as np; from readerlib.formats._recordio import _crc32c_copy, "
            "_crc32c_copy_uses_hardware as hw; src = np.arange(30000, dtype=np.uint32).tobytes(); "
            "d = bytearray(len(src)); print(hw(), _crc32c_copy(d, src), bytes(d) == src)")
    env = dict(os.environ, READERLIB_NO_HW_CRC="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True).stdout.split()
    src = np.arange(30000, dtype=np.uint32).tobytes()
    assert out == ["False", str(rl.crc32c(src)), "True"]


def test_unclosed_writer_finishes_its_file_when_collected(tmp_path):
    import gc
    path = tmp_path / "x.rio"
    w = rl.RecordIOWriter(path, [("x", "int64")], chunk_size=40)
    for i in range(10):
        w.write((i,))
    del w
    gc.collect()
    got, ws, r = read_all(path)
    assert not ws and r.has_index and [int.from_bytes(g[0][2], "little") for g in got] == list(range(10))


def test_writer_refuses_out_of_range_ints(tmp_path):
    with rl.RecordIOWriter(tmp_path / "x.rio", [("v", "uint8"), ("w", "int16")]) as w:
        w.write((1, 2))
        with pytest.raises((ValueError, TypeError, OverflowError), match="'v'"):
            w.write((300, 2))
        with pytest.raises((ValueError, TypeError, OverflowError), match="'w'"):
            w.write((1, 70000))
    assert len(drain(rl.RecordIOReader(tmp_path / "x.rio"))) == 1


def test_parallel_crc_equals_serial_at_split_boundaries():
    """Big chunks are checksummed in parts on several threads and combined
    (readerlib._parallel); the split threshold is lowered so that every size
    here splits, into parts whose lengths are not all equal."""
    import os
    from readerlib import _parallel
    from readerlib import _core, _parallel
    old_threads = rl.get_num_threads()
    old_min = _parallel._set_min_bytes_per_thread(1)
    try:
        for t in (1, 2, 3):
            rl.set_num_threads(t)
            for n in (0, 1, 63, 64, 65, 262143, 262144, 262145, 1000001, 3 << 20):
                data = os.urandom(n)
                assert _core._crc32c_parallel_py(data) == rl.crc32c(data), (t, n)
    finally:
        _parallel._set_min_bytes_per_thread(old_min)
        rl.set_num_threads(old_threads)
    for n in (262144, 1 << 20, (1 << 20) + 1, 3 << 20):   # and at the real threshold
        data = os.urandom(n)
        assert _core._crc32c_parallel_py(data) == rl.crc32c(data), n


def test_big_records_batch_identically_with_one_and_two_threads(tmp_path):
    from readerlib import _core, _parallel
    x = np.random.default_rng(0).integers(0, 256, size=(40, 40000), dtype=np.uint8)
    path = tmp_path / "big.rio"
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (40000,))])) as w:
        w.write_batch({"x": x})
    outs = []
    from readerlib import _parallel
    old = _parallel.get_num_threads()
    old_min = _parallel._set_min_bytes_per_thread(1)    # split even these 240 KB batches
    try:
        for t in (1, 2):
            _parallel.set_num_threads(t)
            outs.append(np.concatenate([b[0].data for b in rl.RecordIOReader(path).shuffle(7, seed=3).batch(6)]))
    finally:
        _parallel.set_num_threads(old)
        _parallel._set_min_bytes_per_thread(old_min)
    np.testing.assert_array_equal(outs[0], outs[1])
    assert sorted(map(bytes, outs[0])) == sorted(map(bytes, x))


def test_low_memory_drops_pages_without_changing_data(tmp_path):
    """Big records' pages are dropped after the batch copy; re-reads refault the same bytes."""
    x = np.random.default_rng(1).integers(0, 256, size=(60, 70000), dtype=np.uint8)
    path = tmp_path / "big.rio"
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (70000,))]), chunk_size=300000) as w:
        w.write_batch({"x": x})
    outs = []
    for low in (True, False):
        r = rl.RecordIOReader(path, low_memory=low)
        assert r.low_memory is low
        chain = r.shuffle(20, seed=5).batch(7)
        for _ in range(2):                       # second epoch reads dropped pages again
            outs.append(np.concatenate([b[0].data for b in chain]))
    for o in outs[1:]:
        np.testing.assert_array_equal(o[np.argsort([bytes(v) for v in o])],
                                      outs[0][np.argsort([bytes(v) for v in outs[0]])])
    np.testing.assert_array_equal(outs[0], outs[2])       # same seed and epoch -> same order
    assert sorted(map(bytes, outs[0])) == sorted(map(bytes, x))


def _aligned_file(path, records, page_align=True):
    s = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])
    with rl.RecordIOWriter(path, s, chunk_size=3 * 4096, page_align=page_align) as w:
        for r in records:
            w.write((np.frombuffer(r, np.uint8),))
    return s


def test_page_aligned_records_start_on_file_pages_and_round_trip(tmp_path):
    recs = [bytes([i + 1]) * n for i, n in enumerate([1, 100, 4096, 5000, 0, 70000, 3])]
    path = tmp_path / "a.rio"
    _aligned_file(path, recs)
    data = path.read_bytes()
    r = rl.RecordIOReader(path)
    assert [bytes(x[0]) for x in r] == recs
    offs, _ = r.chunk_table()
    first = int(offs[0])
    # aligned flag, and 0x200: records this small keep the whole-body CRC (record_crc="auto")
    assert int.from_bytes(data[first + 8:first + 12], "little") == 0x300
    # every record (its int64 row count, then its bytes) starts at a multiple of 4096
    for rec in recs:
        if len(rec) >= 100:
            pos = data.find(len(rec).to_bytes(8, "little") + rec)
            assert pos > 0 and pos % 4096 == 0, (len(rec), pos)
    # auto: small records are not padded, big ones are
    _aligned_file(tmp_path / "b.rio", [b"x" * 10] * 5, page_align="auto")
    assert (tmp_path / "b.rio").stat().st_size < 4096


def test_every_byte_of_a_page_aligned_file_is_checked(tmp_path):
    recs = [bytes([i + 1]) * n for i, n in enumerate([10, 300, 7])]
    path = tmp_path / "a.rio"
    _aligned_file(path, recs)
    good = path.read_bytes()
    bad_path = tmp_path / "bad.rio"
    for i in range(0, len(good)):
        flipped = bytearray(good)
        flipped[i] ^= 0x5A
        bad_path.write_bytes(bytes(flipped))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = [bytes(x[0]) for x in rl.RecordIOReader(bad_path)]
        except rl.RecordIOError:
            continue
        raise AssertionError(f"flip at byte {i} of {len(good)} went undetected: {got != recs}")


# ----------------------------------------------- issue 12: crafted headers and indexes
def _crc(data):
    return rl.crc32c(data)


def test_schema_with_more_fields_than_readers_take_names_the_file(tmp_path):
    """A header (valid checksum) holding a 65-field schema: a ValueError naming the file."""
    from readerlib.formats._recordio import FILE_MAGIC
    schema = rl.Schema([rl.Field(f"f{i}", "int8") for i in range(65)])
    body = schema.to_json().encode()
    file_id = os.urandom(8)
    head = FILE_MAGIC + len(body).to_bytes(4, "little")
    crc = rl.crc32c(body, rl.crc32c(file_id, rl.crc32c(head)))
    path = tmp_path / "wide.rio"
    path.write_bytes(head + crc.to_bytes(4, "little") + file_id + body)
    with pytest.raises(ValueError, match=r"wide\.rio.*at most 64 fields, got 65"):
        rl.RecordIOReader(str(path))


def _overflowing_index(path):
    """Rewrite a two-chunk file's index so its counts (2**62 + 2**62) sum past 2**63,
    with every checksum valid."""
    data = bytearray(open(path, "rb").read())
    S = len(data)
    ioff = int.from_bytes(data[S - 16:S - 8], "little")
    n = int.from_bytes(data[ioff + 8:ioff + 16], "little")
    assert n == 2
    for i in range(n):
        data[ioff + 32 + 16 * i:ioff + 40 + 16 * i] = (2**62).to_bytes(8, "little")
    data[ioff + 16:ioff + 24] = (2**63 % 2**64).to_bytes(8, "little")     # what the wrapped sum gives
    data[ioff + 24 + 16 * n:ioff + 28 + 16 * n] = _crc(bytes(data[ioff:ioff + 24 + 16 * n])).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))


def test_index_counts_that_overflow_int64_are_rejected(tmp_path):
    # len(reader) used to fail with "SystemError: returned NULL without setting an exception"
    path = str(tmp_path / "counts.rio")
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "int64")]), chunk_size=64) as w:
        for i in range(10):
            w.write((i,))
    assert rl.RecordIOReader(path).num_chunks == 2
    _overflowing_index(path)
    # each count (2**62) is past what a chunk can hold (2**30 records): the entry is refused
    # before any sum is formed
    with pytest.raises(rl.RecordIOError, match=r"counts\.rio: index entry disagrees with the chunk layout at byte offset"):
        rl.RecordIOReader(path)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        r = rl.RecordIOReader(path, on_error="skip")       # the index is not used: chunks scanned
    assert any("index entry disagrees with the chunk layout" in str(w.message) for w in ws)
    assert len(r) == 10 and [int(x[0]) for x in r] == list(range(10))


# ------------------------------------- issue 16: version 2, big records read a block each
def _big_v2_file(path, sizes=(33_000, 40_000, 36_000, 50_000, 33_333), page_align="auto", seed=4):
    """Sequence records of >= 32 KiB (so the per-record path: a block each, read
    in groups), two chunks, with padding when page-aligned."""
    rng = np.random.default_rng(seed)
    recs = [rng.integers(1, 256, k, dtype=np.uint8) for k in sizes]
    schema = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])
    with rl.RecordIOWriter(path, schema, chunk_size=130_000, page_align=page_align) as w:
        for x in recs:
            w.write((x,))
    return [x.tobytes() for x in recs]


def _big_v2_regions(path):
    """Byte ranges of a v2 file that are not record payload: headers, tables,
    padding, record row-count prefixes, footer (every one of them is flipped)."""
    data = path.read_bytes()
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    keep = set(range(r.data_start))
    for o, n in zip(map(int, offs), map(int, nrec)):
        keep.update(range(o, o + 32 + 8 * n))
        sizes = np.frombuffer(data[o + 32:o + 32 + 4 * n], "<u4")
        pos = o + 32 + 8 * n
        flag = int.from_bytes(data[o + 8:o + 12], "little")
        for s in sizes:
            if flag & 0x100:
                pad = -pos % 4096           # its ends and a few bytes between
                keep.update(x for x in (pos, pos + 1, pos + pad // 2, pos + pad - 2, pos + pad - 1)
                            if pos <= x < pos + pad)
                pos += pad
            keep.update(range(pos, pos + 8))
            keep.add(pos + int(s) - 1)
            pos += int(s)
    keep.update(range(_trailer_index_offset(data), len(data)))
    return data, sorted(keep)


@pytest.fixture(params=[False, True], ids=["direct", "staged"])
def staged(request):
    """Both ways of reading v2 big records (_recordio._set_staged_reads)."""
    from readerlib.formats._recordio import _set_staged_reads
    old = _set_staged_reads(request.param)
    yield request.param
    _set_staged_reads(old)


@pytest.mark.parametrize("page_align", ["auto", False])
def test_v2_big_records_every_structural_byte_and_sampled_payload_bytes(tmp_path, page_align, staged):
    """The per-record path (a block each, read a group at a time): flipping any
    header, table, padding, prefix or footer byte, and a sample of payload bytes
    (hypothesis), raises a RecordIOError naming the file and an offset at or
    before the byte (a record's error also names the record), or -- footer
    only -- warns and delivers all the data unchanged."""
    from hypothesis import given, settings, strategies as st, HealthCheck
    path = tmp_path / "big.rio"
    want = _big_v2_file(path, page_align=page_align)
    r = rl.RecordIOReader(path)
    assert r.version == 2 and r.num_chunks == 2
    assert [bytes(v[0]) for v in r] == want and r._bytes_verified == sum(8 + len(w) for w in want)
    data, structural = _big_v2_regions(path)
    bad = tmp_path / "bad.rio"

    def check(i, mask):
        b = bytearray(data)
        b[i] ^= mask
        bad.write_bytes(bytes(b))
        try:
            got, ws, _ = read_all(bad)
        except rl.RecordIOError as e:
            _check_error(e, bad, flipped_at=i)
            if "record checksum" in str(e):
                assert "(record " in str(e), str(e)
            return
        assert [g[0] for g in got] == want and ws, f"byte {i} ^ {mask:#x} went unnoticed"

    for i in structural:
        check(i, 0x41)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(data) - 1), st.integers(1, 255))
    def any_byte(i, mask):
        check(i, mask)
    any_byte()


def test_v2_record_error_names_file_offset_and_record(tmp_path, staged):
    path = tmp_path / "big.rio"
    want = _big_v2_file(path)
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    data = bytearray(path.read_bytes())
    # the third record of chunk 0, well inside its payload
    o, n = int(offs[0]), int(nrec[0])
    sizes = np.frombuffer(bytes(data[o + 32:o + 32 + 4 * n]), "<u4")
    pos = o + 32 + 8 * n
    for k in range(2):
        pos += -pos % 4096 + int(sizes[k])
    pos += -pos % 4096
    data[pos + 1000] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(rl.RecordIOError) as e:
        list(rl.RecordIOReader(path))
    assert str(path) in str(e.value) and f"byte offset {pos}" in str(e.value)
    assert "record checksum mismatch (record 2 of chunk 0)" in str(e.value)
    # skip mode: the bad chunk goes, the other chunk's records come, nothing else
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rs = rl.RecordIOReader(path, on_error="skip")
        got = [bytes(v[0]) for v in rs]
    assert got == want[n:] and rs.skipped_chunks == 1


@pytest.mark.parametrize("version", [1, 2])
def test_big_records_resume_exactly_and_exactly_once(tmp_path, version, staged):
    from helpers import assert_checkpoint_equal, assert_exactly_once
    path = str(tmp_path / "big.rio")
    x = np.random.default_rng(5).integers(0, 256, (37, 40_000), dtype=np.uint8)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (40_000,))]), chunk_size=200_000,
                           version=version) as w:
        w.write_batch({"x": x})
    assert rl.RecordIOReader(path).version == version
    assert_checkpoint_equal(lambda: rl.RecordIOReader(path).shuffle(8, seed=3).batch(5))
    chain = rl.RecordIOReader(path).shuffle(10, seed=1).batch(4)
    for _ in range(2):
        got = [row.tobytes() for (b,) in chain for row in np.asarray(b.data)]
        assert_exactly_once(got, [row.tobytes() for row in x])
