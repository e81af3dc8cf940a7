"""RecordIO version 2: the writer chooses per chunk between a CRC table (big
records) and one CRC over the whole body (small records, chunk flag 0x200).

RECORDIO.md, "Version 2"; the measurement behind the threshold is in
benchmarks/results/recordio_versions.md.
"""
import base64
import warnings
import zlib

import numpy as np
import pytest

import readerlib as rl
from helpers import read_all, scratch  # noqa: F401 (scratch: a fixture)

BYTES = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])


def _write(path, recs, **kw):
    with rl.RecordIOWriter(path, BYTES, **kw) as w:
        for x in recs:
            w.write((np.frombuffer(x, np.uint8),))
    return recs


def _chunks(path):
    """[(offset, num_records, flags, body_crc, stored)] from the chunk headers."""
    data = path.read_bytes()
    offs, _ = rl.RecordIOReader(path).chunk_table()
    out = []
    for o in map(int, offs):
        h = data[o:o + 32]
        out.append((o, int.from_bytes(h[4:8], "little"), int.from_bytes(h[8:12], "little"),
                    int.from_bytes(h[12:16], "little"), int.from_bytes(h[16:24], "little")))
    return out


def _reheader(data, off, flags):
    """`data` with chunk `off`'s flags set to `flags` and its salted header CRC made valid again."""
    b = bytearray(data)
    salt = rl.crc32c(bytes(b[16:24]))                     # crc32c(file_id)
    b[off + 8:off + 12] = flags.to_bytes(4, "little")
    b[off + 28:off + 32] = rl.crc32c(bytes(b[off:off + 28]), salt).to_bytes(4, "little")
    return bytes(b)


def _records(path, **kw):
    with rl.RecordIOReader(path, **kw) as r:
        return [bytes(v[0]) for v in r]


def _payloads(got):
    """The bytes of field "b" of each record read_all returned (canonical: dtype, shape, bytes)."""
    return [rec[0][2] for rec in got]


def _enc(x):
    return len(x).to_bytes(8, "little") + x          # a sequence record: i64 row count, then the rows


def _mixed(rng, small=40, big=3, big_size=40_000):
    """Small records, then big ones, then small again: three kinds of chunk in one file."""
    s = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(0, 60, small)]
    b = [rng.integers(0, 256, big_size, dtype=np.uint8).tobytes() for _ in range(big)]
    return s + b + s[::-1]


# ------------------------------------------------------------------ the choice
@pytest.mark.parametrize("page_align", ["auto", False, True])
def test_auto_gives_small_record_chunks_a_whole_body_crc_and_big_ones_a_table(tmp_path, page_align):
    path = tmp_path / "m.rio"
    recs = _write(path, _mixed(np.random.default_rng(0)), chunk_size=2048, page_align=page_align)
    assert path.read_bytes()[:8] == b"RLRECIO2"
    data = path.read_bytes()
    kinds = set()
    verified = k = 0
    for off, n, flags, body_crc, stored in _chunks(path):
        sizes = np.frombuffer(data[off + 32:off + 32 + 4 * n], "<u4")
        big = sizes.sum() >= 32768 * n
        aligned = page_align is True or (page_align == "auto" and big)
        assert flags == (0x100 if aligned else 0) | (0 if big else 0x200), (n, sizes, hex(flags))
        body = data[off + 32:off + 32 + stored]
        if big:                 # the table: each record's CRC after the sizes; the header CRC covers both
            assert body_crc == rl.crc32c(body[:8 * n])
            crcs = np.frombuffer(body[4 * n:8 * n], "<u4")
            pos = off + 32 + 8 * n
            for s, c in zip(sizes, crcs):
                pos += -pos % 4096 if aligned else 0
                assert rl.crc32c(data[pos:pos + int(s)]) == c
                pos += int(s)
            verified += int(sizes.sum())
        else:                   # version 1's body: sizes, then the records; one CRC over all of it
            assert body_crc == rl.crc32c(body)
            if not aligned:
                assert body[4 * n:] == b"".join(_enc(x) for x in recs[k:k + n])
        kinds.add((big, aligned))
        k += n
    assert {k[0] for k in kinds} == {False, True}
    for low_memory in (True, False):
        r = rl.RecordIOReader(path, low_memory=low_memory)
        assert [bytes(v[0]) for v in r] == recs
        # only the big records are checked one by one; the others by their chunk's CRC
        assert r._bytes_verified == verified > 0
    b = next(iter(rl.RecordIOReader(path).shuffle(1000, seed=1).batch(len(recs))))
    assert sorted(bytes(b[0].sequence(i)) for i in range(len(recs))) == sorted(recs)


def test_auto_threshold_is_a_mean_of_32_KiB_per_record(tmp_path):
    """Encoded size (8-byte row count + rows) averaging 32 KiB: a table; one byte less: none."""
    for mean, table in ((32768, True), (32767, False)):
        path = tmp_path / f"t{mean}.rio"
        recs = [b"\x01" * (mean - 8 - 100), b"\x02" * (mean - 8 + 100)]
        _write(path, recs, page_align=False)
        [(off, n, flags, _, stored)] = _chunks(path)
        assert n == 2 and flags == (0 if table else 0x200)
        assert stored == (8 if table else 4) * n + 2 * mean
        assert _records(path) == recs


def test_64_KiB_records_get_the_table_by_default(tmp_path):
    path = tmp_path / "big.rio"
    rng = np.random.default_rng(3)
    recs = _write(path, [rng.integers(0, 256, 65536, dtype=np.uint8).tobytes() for _ in range(40)])
    chunks = _chunks(path)
    assert len(chunks) >= 2 and all(flags == 0x100 for _, _, flags, _, _ in chunks)
    r = rl.RecordIOReader(path)
    assert [bytes(v[0]) for v in r] == recs and r._bytes_verified == 40 * (65536 + 8)


def test_64_B_records_get_one_crc_per_chunk_by_default(tmp_path):
    path = tmp_path / "small.rio"
    x = np.random.default_rng(4).integers(0, 256, (20_000, 64), dtype=np.uint8)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (64,))])) as w:
        w.write_batch({"x": x})
    data = path.read_bytes()
    chunks = _chunks(path)
    assert len(chunks) >= 2
    for off, n, flags, body_crc, stored in chunks:
        assert flags == 0x200 and stored == 68 * n
        assert body_crc == rl.crc32c(data[off + 32:off + 32 + stored])
    r = rl.RecordIOReader(path)
    np.testing.assert_array_equal(np.stack([v[0] for v in r]), x)
    assert r._bytes_verified == 0


@pytest.mark.parametrize("page_align", ["auto", False, True])
def test_record_crc_forces_the_choice(tmp_path, page_align):
    recs = _mixed(np.random.default_rng(5))
    for record_crc, want in ((True, 0), (False, 0x200)):
        path = tmp_path / f"{record_crc}.rio"
        _write(path, recs, chunk_size=2048, page_align=page_align, record_crc=record_crc)
        data = path.read_bytes()
        for off, n, flags, body_crc, stored in _chunks(path):
            big = np.frombuffer(data[off + 32:off + 32 + 4 * n], "<u4").sum() >= 32768 * n
            aligned = page_align is True or (page_align == "auto" and big)
            assert flags == want | (0x100 if aligned else 0)
            if record_crc:
                assert body_crc == rl.crc32c(data[off + 32:off + 32 + 8 * n])
            else:
                assert body_crc == rl.crc32c(data[off + 32:off + 32 + stored])
        r = rl.RecordIOReader(path)
        assert [bytes(v[0]) for v in r] == recs
        assert (r._bytes_verified > 0) == record_crc


def test_version1_is_unchanged_and_record_crc_is_checked(tmp_path):
    recs = _mixed(np.random.default_rng(6))
    for record_crc in ("auto", False):
        path = tmp_path / f"v1{record_crc}.rio"
        _write(path, recs, chunk_size=2048, version=1, record_crc=record_crc)
        assert path.read_bytes()[:8] == b"RLRECIO1"
        assert {flags for _, _, flags, _, _ in _chunks(path)} == {0, 0x100}
        assert _records(path) == recs
    for bad in ("yes", None, 1, 0, "Auto"):
        with pytest.raises(ValueError, match="record_crc must be 'auto', True or False"):
            rl.RecordIOWriter(tmp_path / "bad.rio", BYTES, record_crc=bad)
    with pytest.raises(ValueError, match="record_crc=True needs version=2"):
        rl.RecordIOWriter(tmp_path / "bad.rio", BYTES, record_crc=True, version=1)


# -------------------------------------------- files of the writers before 0x200
# Written by the previous writer (version 2 with a table in every uncompressed
# chunk, and version 1), ids 0..4, rows arange(k) + id for k in (3, 0, 17, 5, 40),
# chunk_size=64; zlib + base64 of the files' bytes.
OLD_V2 = """
eNoL8glydfb0N2pmYGAQnF53+MFjN4HMVxpm1Uppmak5KcVKVgrR1UopJZUFqUCmUqaFko6CUk5+SnxOallqDlDIAMjPS8yF
yKaAZIszEsGKo2NrdRSQ9JYaous1RNKbhKY1tjbI2cObiQECBPp65I2hbBDtMSusWRgkDsT5L0t+i0yv2QCVZmCGMRiZGBlQ
AbKRb4SMMt2gbBBt8+3PQ0UgLQrEG80fHH+7N3Q+TK0glGZiZmFlY+fg5OLm4eXjFxAUgtnFCrMbJA+yBWZzXU9/mAOUDaID
fY59tQDShTvDwlig4hpQGs1sYRFRMXEJSSlpGVk5eQVFJWUVVTV1DU0t7SBPlwhkj8Isnw1zJZR+h8YPgToK5ra17t2RW6Cc
tGeOFUGeEYYArlFZTg==
"""
OLD_V2_ALIGNED = """
eNrt2ztLw1AUwPHU+n6man1r06itr8G6WFwUVLAoKIGWghRRUrFSX1gF8bE4CUVxcnAQN0ddBAdnv4A4iTjoIOjq4uJN20At
4qzy/0FyzsnNhXC35NxoY9rwoG+8Z1eSpEvXXTC2En8P9ZWebaqzkXBUX1X7lMlNVY9tLIdFqka8apeiRpf0qWh4PRwVl7pF
vTi9kBzVjdHVuenEzZOh7S4lbe6aJ3OuJ23uTMbU0LY2ODKaJR5LskiSvB93+B1SghHd+vtthchlcSy9xD4qj7bOJQAAAAAA
8DOrmViyWAwAAAAAAP4ZS0ad3nR/Le+JPKea7kZ8cs6cO0VuF8dF7+PN27X/hBUEAAAAAOD3M7v9NrO2Zufk5uUXFBYVl5SW
ybZylggAAAAAgD/P3PefY9bG67+xCSCxMUCcduIHAaucGhSxYb7f4RX5ylUgwPIBAAAAAPAnZKdim1l/7f5XVNqrqmtq6+ob
GpscilNtbml1udvaOzo131Dwu+8Hx6lo7iuQla+1fSAZzf8OHg4O770TyfzUvXeq+YKeT9dRWTI=
"""
OLD_V1 = """
eNoL8glydfb0N2xmYGAIers348E0Z5VWZbXcaqW0zNSclGIlK4XoaqWUksqCVCBTKdNCSUdBKSc/JT4ntSw1ByhkAOTnJeZC
ZFNAssUZiWDF0bG1OgpIeksN0fUaIulNQtMaWxvk7OHNxAABP/LKO7WhbBD9e56HkjCQFmBAAGYYg5GJkQEVIBv1RC17nx2U
DaL3n53trgikRYEYpkYQSjMxs7CysXNwcnHz8PLxCwgKwexghdkJkgeZDrNxz4FNNTZQNojeMUlspwWQZoGKaUBpNHOFRUTF
xCUkpaRlZOXkFRSVlFVU1dQ1NLW0gzxdIpA9B7N4NsyFUPoZGt8F6iCYu3bPL1++AMrZn6t1N8gzwhAA5atPyQ==
"""
OLD_SCHEMA = rl.Schema([rl.Field("id", "int64"), rl.Field("b", "uint8", (), lod_level=1)])
OLD_ROWS = [(i, (np.arange(k, dtype=np.uint8) + i).tobytes()) for i, k in enumerate((3, 0, 17, 5, 40))]


def _fixture(text, path):
    path.write_bytes(zlib.decompress(base64.b64decode("".join(text.split()))))
    return path


@pytest.mark.parametrize("text, version, flags", [(OLD_V2, 2, {0}), (OLD_V2_ALIGNED, 2, {0x100}),
                                                  (OLD_V1, 1, {0})], ids=["v2", "v2-aligned", "v1"])
def test_files_of_the_previous_writers_still_read(tmp_path, text, version, flags):
    path = _fixture(text, tmp_path / "old.rio")
    r = rl.RecordIOReader(path)
    assert r.version == version and r.schema == OLD_SCHEMA
    assert {f for _, _, f, _, _ in _chunks(path)} == flags
    assert [(int(v[0]), bytes(v[1])) for v in r] == OLD_ROWS
    if version == 2:            # the table's CRCs were checked, record by record
        assert r._bytes_verified == sum(8 + 8 + len(b) for _, b in OLD_ROWS)
    # the new writer, told to, writes the same layout (the bytes differ only by the random file id)
    new = tmp_path / "new.rio"
    with rl.RecordIOWriter(new, OLD_SCHEMA, chunk_size=64, version=version,
                           page_align=flags == {0x100}, record_crc=version == 2) as w:
        for row in OLD_ROWS:
            w.write((row[0], np.frombuffer(row[1], np.uint8)))
    a, b = bytearray(path.read_bytes()), bytearray(new.read_bytes())
    assert len(a) == len(b)
    for off, _, _, _, _ in _chunks(path):
        a[off + 28:off + 32] = b[off + 28:off + 32] = b"\0" * 4        # header CRCs (salted by the id)
    a[12:24] = b[12:24] = b"\0" * 12                                   # file header CRC and id
    assert a == b


# ------------------------------------------------------------- every byte checked
def _check_error(e, path, flipped_at):
    assert isinstance(e, rl.RecordIOError)
    assert e.path == str(path) and str(path) in str(e)
    assert e.offset is not None and f"byte offset {e.offset}" in str(e)
    assert 0 <= e.offset <= flipped_at, (e.offset, flipped_at, str(e))


def _flip_all(data, want, bad, positions, masks=(0x01, 0x80, 0xFF)):
    """Each position flipped with each mask: an error naming the file and an
    offset at or before the byte, or (footer only) all the data and a warning."""
    for mask in masks:
        for i in positions:
            b = bytearray(data)
            b[i] ^= mask
            bad.write_bytes(bytes(b))
            try:
                got, ws, _ = read_all(bad)
            except rl.RecordIOError as e:
                _check_error(e, bad, i)
                continue
            assert _payloads(got) == want, f"byte {i} ^ {mask:#x}: different data delivered"
            assert ws, f"byte {i} ^ {mask:#x}: corruption went unnoticed"


@pytest.mark.parametrize("page_align", [False, True])
@pytest.mark.parametrize("record_crc", ["auto", True], ids=["new-default", "old-v2"])
def test_every_byte_of_a_small_record_file_is_checked(scratch, page_align, record_crc):
    """Small records, several chunks: every byte (file header, chunk headers and
    their flags, bodies, index, trailer) flipped three ways."""
    rng = np.random.default_rng(7)
    want = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in (3, 0, 11, 5, 1, 9, 2)]
    src = scratch / "good.rio"
    _write(src, want, chunk_size=40, page_align=page_align, record_crc=record_crc)
    chunks = _chunks(src)
    assert len(chunks) >= 3
    assert {f & 0x200 for _, _, f, _, _ in chunks} == ({0x200} if record_crc == "auto" else {0})
    data = src.read_bytes()
    # page-aligned: padding is zero runs of up to 4 KiB; all of the rest, and the ends of each run
    positions = [i for i in range(len(data))
                 if not page_align or data[i] or i == 0 or data[i - 1] or i + 1 == len(data) or data[i + 1]
                 or i % 997 == 0]
    _flip_all(data, want, scratch / "bad.rio", positions)


def test_every_structural_byte_and_sampled_payload_of_a_mixed_file(scratch):
    """Small-record chunks (0x200) and big-record chunks (table, page-aligned)
    in one file: every byte outside the big payloads, and every 499th inside."""
    want = _mixed(np.random.default_rng(8), small=12, big=2, big_size=33_000)
    src = scratch / "good.rio"
    _write(src, want, chunk_size=300)
    data = src.read_bytes()
    chunks = _chunks(src)
    flags = [f for _, _, f, _, _ in chunks]
    assert 0x200 in flags and 0x100 in flags
    payload = set()
    for off, n, f, _, stored in chunks:
        if f == 0x100:
            payload.update(range(off + 32 + 8 * n, off + 32 + stored))
    positions = [i for i in range(len(data)) if i not in payload or i % 499 == 0]
    _flip_all(data, want, scratch / "bad.rio", positions, masks=(0x01, 0xFF))


def test_skip_mode_drops_only_the_damaged_small_record_chunk(tmp_path):
    want = _mixed(np.random.default_rng(9), small=12, big=2)
    path = tmp_path / "m.rio"
    _write(path, want, chunk_size=300)
    chunks = _chunks(path)
    off, n, flags, _, stored = chunks[1]
    assert flags == 0x200
    data = bytearray(path.read_bytes())
    data[off + 32 + stored - 1] ^= 0x10          # the last byte of its last record
    path.write_bytes(bytes(data))
    with pytest.raises(rl.RecordIOError, match=rf"chunk body checksum mismatch \(chunk 1\) at byte offset {off + 32}"):
        _records(path)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        r = rl.RecordIOReader(path, on_error="skip")
        got = [bytes(v[0]) for v in r]
    n0 = chunks[0][1]
    assert got == want[:n0] + want[n0 + n:] and r.skipped_chunks == 1
    assert any("skipped chunk" in str(w.message) for w in ws)


# --------------------------------------------- the flag itself, crafted headers
def test_a_flag_changed_under_a_valid_header_crc_still_fails(tmp_path):
    """Even with the header's CRC made valid again, turning 0x200 off (the body
    then read as tables) or on (a table read as a version-1 body) fails the
    body's own CRC: the flag cannot make wrong data pass."""
    want = _mixed(np.random.default_rng(10), small=12, big=2)
    path = tmp_path / "m.rio"
    _write(path, want, chunk_size=300, page_align=False)
    data = path.read_bytes()
    for off, n, flags, _, _ in _chunks(path):
        path.write_bytes(_reheader(data, off, flags ^ 0x200))
        with pytest.raises(rl.RecordIOError) as e:
            _records(path)
        assert f"byte offset {off + 32}" in str(e.value) and "checksum mismatch" in str(e.value), str(e.value)


def test_unknown_flags_and_0x200_where_it_means_nothing_are_errors(tmp_path):
    recs = [b"abc", b"", b"defgh"]
    path = tmp_path / "s.rio"
    _write(path, recs)
    [(off, _, flags, _, _)] = _chunks(path)
    assert flags == 0x200
    data = path.read_bytes()
    for bad in (0x400 | 0x200, 0x80000000 | 0x200, 0x200 | 1):
        path.write_bytes(_reheader(data, off, bad))
        with pytest.raises(rl.RecordIOError) as e:
            _records(path)
        msg = "unknown chunk compressor" if bad == 0x201 else "unknown chunk flags"
        assert msg in str(e.value) and f"at byte offset {off}" in str(e.value), str(e.value)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            r = rl.RecordIOReader(path, on_error="skip")
            assert [bytes(v[0]) for v in r] == [] and r.skipped_chunks == 1
    # in a version-1 file 0x200 is unknown
    v1 = tmp_path / "v1.rio"
    _write(v1, recs, version=1)
    [(off, _, flags, _, _)] = _chunks(v1)
    assert flags == 0
    v1.write_bytes(_reheader(v1.read_bytes(), off, 0x200))
    with pytest.raises(rl.RecordIOError, match="unknown chunk flags"):
        _records(v1)


# ------------------------------------------------------------- other readers
def test_the_plain_python_bench_peer_reads_whole_body_crc_chunks(tmp_path):
    from readerlib import bench
    path = tmp_path / "m.rio"
    want = _write(path, _mixed(np.random.default_rng(11), small=12, big=2), chunk_size=300)
    assert {f for _, _, f, _, _ in _chunks(path)} == {0x200, 0x100}
    assert [bytes(r) for r in bench._python_records(str(path))] == [_enc(x) for x in want]


@pytest.mark.parametrize("record_crc", ["auto", True], ids=["new-default", "old-v2"])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_truncation_at_every_offset(scratch, record_crc, on_error):
    """Cut anywhere: an error naming the file and an offset at or before the cut,
    or a warning and records that are a prefix (raise: exactly the complete chunks)."""
    rng = np.random.default_rng(12)
    want = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in (3, 0, 11, 5, 1, 9, 2)]
    src = scratch / "good.rio"
    _write(src, want, chunk_size=40, record_crc=record_crc)
    data = src.read_bytes()
    r0 = rl.RecordIOReader(src)
    offs, nrec = r0.chunk_table()
    boundaries = {int(o): int(nrec[:k].sum()) for k, o in enumerate(offs)}
    cut_file = scratch / "cut.rio"
    for cut in range(len(data)):
        cut_file.write_bytes(data[:cut])
        try:
            got, ws, r = read_all(cut_file, on_error=on_error)
        except rl.RecordIOError as e:
            _check_error(e, cut_file, cut)
            if on_error == "skip":
                assert cut < r0.data_start, f"cut at {cut}: skip mode raised {e}"
            continue
        got = _payloads(got)
        assert ws, f"cut at {cut}: truncated file read without a warning"
        assert got == want[:len(got)], f"cut at {cut}: not a prefix of the records"
        if on_error == "raise":
            assert cut in boundaries or cut >= int(offs[-1]) + 32 + _chunks(src)[-1][4], cut
            assert len(got) == boundaries.get(cut, len(want))
