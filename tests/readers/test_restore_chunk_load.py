"""The buffer shuffle's restore from a file: chunk loads and the fill (issue 16 item 3).

A restore reads its buffer's records by random access, in file order, one
chunk load each (`ChunkCache`).  A chunk of fixed-size records is taken as
one strided run once its first record has loaded and verified it
(`RecordIOReader._current_run`), not one `c_next` per record; a fill from a
file decides the shuffle's inline cells after its first records, so the rest
go straight into cells (one copy, and no pass on the first batch).  These
tests pin that the records handed out are still exactly the file's, that a
restore stays exact across chunk boundaries (fixed, variable, zlib chunks),
and that a corrupt chunk met in the middle of the fill is still the format's
error, naming the file, with nothing left held.
"""
import contextlib
import json
import shutil

import numpy as np
import pytest

import readerlib as rl
from readerlib.readers import _shuffle
from readerlib.errors import RecordIOSchemaError
from helpers import corrupt_chunk
from test_resume_bounded import _state_at

I64 = rl.Schema([rl.Field("x", "int64")])
VAR = rl.Schema([rl.Field("id", "int64", ()), rl.Field("pad", "uint8", (), lod_level=1)])
BUF = 6000            # above the restore's probe (4096 records): it decides mid-fill


def _write_fixed(path, n, chunk_size=4096, **kw):
    with rl.RecordIOWriter(path, I64, chunk_size=chunk_size, **kw) as w:
        w.write_batch({"x": np.arange(n, dtype=np.int64)})
    return path


def _good_file_state(tmp_path, n, k, buf):
    """The corrupt-chunk tests' set-up: `n` int64 records in good/f.rio (an
    empty bad/ beside it, for a corrupted copy of the same name, so the same
    file identity), the maker of shuffle(buf, seed=3) over a path, its state
    after `k` reads of the good file, and each chunk's first record index
    (chunks + 1 entries).  Returns (good, make, state, starts)."""
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    good = _write_fixed(str(tmp_path / "good" / "f.rio"), n, chunk_size=4096)
    make = lambda p: rl.RecordIOReader(p).shuffle(buf, seed=3)
    st = _state_at(lambda: make(good), k)
    r = rl.RecordIOReader(good)
    _, nrec = r.chunk_table()
    r.close()
    return good, make, st, np.concatenate([[0], np.cumsum(nrec)])


def _write_var(path, n, chunk_size=4096):
    with rl.RecordIOWriter(path, VAR, chunk_size=chunk_size) as w:
        for i in range(n):
            w.write((np.int64(i), np.full(i % 37, i % 251, np.uint8)))
    return path


def _ids(chain):
    return [i for i, _ in _items(chain)]


def _items(chain):
    """The rest of the epoch as (id, every field's bytes): a record handed out
    with a wrong size or from a wrong cell shows."""
    out = []
    while True:
        x = chain.read_next()
        if x is None:
            return out
        fields = [np.asarray(getattr(v, "data", v)) for v in x]
        out.append((int(fields[0].reshape(-1)[0]), tuple(f.tobytes() for f in fields)))


def _values(instances):
    return [int(x[0]) for x in instances]


@contextlib.contextmanager
def _inline(on):
    """Inline cells at this small scale (on: no minimum payload), or the defaults
    (off here: 6000 x 8 bytes is below the minimum payload)."""
    old = _shuffle._inline_settings(enabled=True, min_payload=0, cell=0) if on else None
    try:
        yield
    finally:
        if old is not None:
            _shuffle._inline_settings(**old)


def _shuffle_of(chain):
    return next(r for r in chain._walk() if isinstance(r, rl.readers._shuffle.ShuffleReader))


# ------------------------------------------------------------ the strided chunk load
@pytest.mark.parametrize("compressor", ["none", "zlib"])
def test_a_fixed_chunk_is_one_strided_run_of_verified_records(tmp_path, compressor):
    path = _write_fixed(str(tmp_path / "f.rio"), 5000, chunk_size=2048, compressor=compressor)
    r = rl.RecordIOReader(path)
    _, nrec = r.chunk_table()
    assert r._current_run() is None                  # nothing loaded yet
    first = r.read_next()
    assert int(first[0]) == 0
    assert r._current_run() == (8, int(nrec[0]) - 1)  # the rest of chunk 0, 8 bytes apart
    for _ in range(int(nrec[0]) - 1):
        r.read_next()
    assert r._current_run() == (8, 0)
    r.close()
    # random access over every record, in a random order, gives the file's records
    r = rl.RecordIOReader(path)
    idx = np.random.default_rng(0).permutation(5000)
    assert _values(r.read_many(idx)) == idx.tolist()
    r.close()


def test_variable_and_page_aligned_chunks_are_read_record_by_record(tmp_path):
    r = rl.RecordIOReader(_write_var(str(tmp_path / "v.rio"), 300))
    r.read_next()
    assert r._current_run() is None
    idx = np.random.default_rng(1).permutation(300)
    assert _values(r.read_many(idx)) == idx.tolist()
    r.close()
    big = rl.Schema([rl.Field("x", "uint8", (40000,))])
    path = str(tmp_path / "a.rio")
    with rl.RecordIOWriter(path, big, page_align=True) as w:
        w.write_batch({"x": np.arange(4, dtype=np.uint8)[:, None].repeat(40000, 1)})
    r = rl.RecordIOReader(path)
    r.read_next()
    assert r._current_run() is None
    r.close()


def test_random_access_counts_one_load_per_chunk_and_raises_on_a_corrupt_one(tmp_path):
    from readerlib.readers._random_access import open_random_access
    path = _write_fixed(str(tmp_path / "f.rio"), 4000, chunk_size=1024)
    r = rl.RecordIOReader(path)
    n_chunks = r.num_chunks
    cache = open_random_access(r)
    assert _values(cache.read_many(np.arange(4000))) == list(range(4000))
    assert cache.chunk_loads == n_chunks
    # two chunks cached: back and forth between them loads nothing more
    prev = int(cache.chunk_starts()[-2]) - 1             # the last record of the chunk before the last
    idx = [3999, prev, 3998, prev - 1]
    assert _values(cache.read_many(idx)) == idx
    assert cache.chunk_loads == n_chunks
    cache.close()
    r.close()
    bad, lost = corrupt_chunk(path, at=40)
    r = rl.RecordIOReader(path)
    ok = min(lost) - 1
    assert _values(r.read_many([ok])) == [ok]
    with pytest.raises(rl.RecordIOError, match=r"f\.rio.*byte offset"):
        r.read_many([min(lost)])
    r.close()


# ------------------------------------------------------------ the restore's fill
SOURCES = {
    "fixed": lambda d: _write_fixed(str(d / "f.rio"), 40_000, chunk_size=4096),
    "zlib": lambda d: _write_fixed(str(d / "z.rio"), 40_000, chunk_size=4096, compressor="zlib"),
    "var": lambda d: _write_var(str(d / "v.rio"), 20_000, chunk_size=4096),
}


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_a_big_buffer_restores_exactly_across_chunk_boundaries(tmp_path, kind, inline):
    with _inline(inline):
        _restores_exactly(SOURCES[kind](tmp_path), kind, inline)


def _restores_exactly(path, kind, inline):
    n = len(rl.RecordIOReader(path))
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=7)
    ref = _items(make())
    assert sorted(i for i, _ in ref) == list(range(n))
    for k in (1, 2500, n // 2, n - BUF - 3, n - 10):
        st = _state_at(make, k)
        other = make()
        other.set_state(st)
        sh = _shuffle_of(other)
        assert sh.restores == 1
        stats = sh._memory_stats()
        if inline and min(BUF, n - k) >= 4096:
            # decided during the fill: the buffer's records are in cells already
            # (fixed 8-byte records all; variable ones up to the chosen cell)
            assert stats["cell"] > 0 and stats["inline_records"] > 0, stats
            if kind != "var":
                assert stats["inline_records"] == min(BUF, n - k) and stats["blocks"] <= 1, stats
        elif not inline:
            assert stats["cell"] == 0 and stats["payload_bytes"] > 0, stats
        # the state taken right after the restore holds the same buffer (each
        # slot's source position, written in slot order after the fill)
        st2 = json.loads(json.dumps(other.get_state()))
        for key in ("slots", "source_position", "count", "emitted"):
            assert st2["buffer"][key] == st["buffer"][key], key
        again = make()
        again.set_state(st2)
        assert _items(again) == ref[k:]
        again.close()
        rest = _items(other)
        assert rest == ref[k:], f"restored at {k}: the rest differs"
        other.close()


def test_the_first_batch_after_a_restore_copies_nothing_more(tmp_path):
    with _inline(True):
        _first_batch_copies_nothing(tmp_path)


def _first_batch_copies_nothing(tmp_path):
    path = _write_fixed(str(tmp_path / "f.rio"), 40_000, chunk_size=4096)
    make = lambda: rl.RecordIOReader(path).shuffle(BUF, seed=2).batch(32)
    st = _state_at(make, 300)
    other = make()
    other.set_state(st)
    sh = _shuffle_of(other)
    before = sh._memory_stats()
    assert before["inline_records"] == BUF, before        # in cells before the first batch
    other.read_next()
    after = sh._memory_stats()
    # the first batch copies only its 32 refills into cells (deciding after the
    # fill copied the whole buffer there on the first batch)
    assert after["inlined_records"] - before["inlined_records"] == 32, (before, after)
    assert after["passes"] == 0, after
    other.close()


def test_a_corrupt_chunk_met_after_the_fill_decided_raises_naming_the_file(tmp_path):
    with _inline(True):
        _corrupt_mid_fill(tmp_path)


def _corrupt_mid_fill(tmp_path):
    n, k = 40_000, 15_000
    good, make, st, starts = _good_file_state(tmp_path, n, k, BUF)
    src = st["buffer"]["source_position"]
    # the fill takes the newest 4096 buffered records first (the probe, which
    # decides the cells), then the rest from the oldest on: a chunk with
    # buffered records, older than the probe's (more than 4096 buffered
    # records after it in file order)
    held = _shuffle._unpack_positions(st["buffer"]["slots"], src, st["buffer"]["count"], "test")
    c = int(np.searchsorted(starts, src - 9000, side="right") - 1)
    assert np.sum((held >= starts[c]) & (held < starts[c + 1])) > 0
    assert np.sum(held >= starts[c + 1]) > 4096
    bad = str(tmp_path / "bad" / "f.rio")        # the same name: the same file identity
    shutil.copy(good, bad)
    corrupt_chunk(bad, chunk=c, at=60)
    other = make(bad)
    with pytest.raises(rl.RecordIOError, match=r"bad/f\.rio.*byte offset"):
        other.set_state(st)
    stats = other._memory_stats()
    assert stats["cell"] > 0                   # it had decided, and filled cells, before the error
    assert stats["blocks"] == 0 and stats["payload_bytes"] == 0, stats
    other.close()
    again = make(good)
    again.set_state(st)
    assert _shuffle_of(again).restores == 1 and len(_ids(again)) == n - k
    again.close()


# ------------------------------------------------------------ the chunk's size check
def _forge_sizes(path, new_sizes):
    """Rewrite chunk 0's record sizes (a fixed-schema, one-chunk file) and make
    its body and header checksums agree, so that only the size check can fail."""
    from readerlib.formats import _recordio as R

    def crc(b, start=0):
        return R._crc32c_copy(bytearray(len(b)), bytes(b), start)
    data = bytearray(open(path, "rb").read())
    offs, nrec = rl.RecordIOReader(path).chunk_table()
    assert len(offs) == 1
    h, m = int(offs[0]), int(nrec[0])
    stored = int.from_bytes(data[h + 16:h + 24], "little")
    assert crc(data[h + 32:h + 32 + stored]) == int.from_bytes(data[h + 12:h + 16], "little")
    for i, s in new_sizes.items():
        data[h + 32 + 4 * i:h + 36 + 4 * i] = int(s).to_bytes(4, "little")
    data[h + 12:h + 16] = crc(data[h + 32:h + 32 + stored]).to_bytes(4, "little")
    data[h + 28:h + 32] = crc(data[h:h + 28], crc(data[16:24])).to_bytes(4, "little")
    open(path, "wb").write(data)
    return h


@pytest.mark.parametrize("sizes, record", [({5: 9, 6: 7}, 5),     # the sum still fills the body
                                           ({7: 16}, 7),           # one record too long
                                           ({0: 0}, 0)])           # the body not filled
def test_a_wrong_record_size_in_a_fixed_chunk_is_still_found_and_named(tmp_path, sizes, record):
    path = _write_fixed(str(tmp_path / "f.rio"), 50, chunk_size=1 << 20)
    h = _forge_sizes(path, sizes)
    msg = rf"f\.rio: record does not match the schema \(record {record} of chunk 0\) at byte offset {h}"
    with pytest.raises(RecordIOSchemaError, match=msg):
        list(rl.RecordIOReader(path))
    with pytest.raises(RecordIOSchemaError, match=msg):
        rl.RecordIOReader(path).read_many([10])


# ------------------------------------------------------------ the file order
@pytest.mark.parametrize("span", [1, 2, 4095, 4096, 4097, 1 << 20, (1 << 24) - 1, 1 << 24, (1 << 32) - 1])
def test_the_file_order_is_the_sorted_position_slot_keys(span):
    rng = np.random.default_rng(span)
    n = min(span, 5000)
    base = 1_000_003
    pos = base + np.sort(rng.choice(span, size=n, replace=False)) if span < 1 << 22 else \
        base + np.unique(np.concatenate([[0, span - 1], rng.integers(0, span, n)]))
    pos = rng.permutation(pos).astype(np.int64)          # slot order: any
    want = np.sort(((pos - pos.min()).astype(np.uint64) << np.uint64(32)) | np.arange(len(pos), dtype=np.uint64))
    assert np.array_equal(_shuffle._file_order_py(pos), want)
    dup = np.repeat(pos[:7], 3)                          # equal positions: slots in order
    want = np.sort(((dup - dup.min()).astype(np.uint64) << np.uint64(32)) | np.arange(len(dup), dtype=np.uint64))
    assert np.array_equal(_shuffle._file_order_py(dup), want)


def test_a_restore_from_an_array_keeps_referencing_it_as_a_run_does():
    # an ArrayReader's one block is shared with its view: a run over it never
    # decides to inline, and neither does a restore (its first batch copied the
    # whole buffer into cells)
    data = np.arange(40_000, dtype=np.int64)
    make = lambda: rl.ArrayReader(data).shuffle(BUF, seed=4).batch(16)
    with _inline(True):
        run = make()
        it = iter(run)
        for _ in range(200):
            next(it)
        assert _shuffle_of(run)._memory_stats()["cell"] == 0
        ref = [np.asarray(b[0].data).copy() for b in it]
        run.close()
        st = _state_at(make, 200)
        other = make()
        other.set_state(st)
        first = np.asarray(other.read_next()[0].data).copy()
        stats = _shuffle_of(other)._memory_stats()
        assert stats["cell"] == 0 and stats["inlined_records"] == 0, stats
        rest = [first]
        while (b := other.read_next()) is not None:       # (iter() would start the next epoch)
            rest.append(np.asarray(b[0].data).copy())
        other.close()
    assert len(rest) == len(ref) and all(np.array_equal(a, b) for a, b in zip(rest, ref))
