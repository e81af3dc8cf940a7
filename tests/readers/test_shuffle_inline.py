"""ShuffleReader's inline small records (issue 16 items 1 and 5: a big buffer
of small records within the buffer's payload + 64 MB): records of at most
`cell` bytes are copied into cells of the shuffle's own, no source block
stays pinned for them, and what goes out is a copy in an output block.

The order must be bitwise the one of the referenced path (inline off): the
same records, in the same order, for a given seed.  The referenced path is
checked against a pure-Python model in test_shuffle_memory.py.
"""
import collections
import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import readerlib as rl
from readerlib.formats import _recordio
from readerlib.readers import _shuffle
from helpers import (SUPPORT_DIR, assert_checkpoint_equal, corrupt_chunk, drain_instances,
                     read_past_errors, unbatch)


@contextlib.contextmanager
def inline_settings(**kw):
    old = _shuffle._inline_settings(**kw)
    try:
        yield
    finally:
        _shuffle._inline_settings(**old)


@pytest.fixture
def inline():
    """Inline on at a test's small scale (no minimum payload)."""
    with inline_settings(enabled=True, min_payload=0, cell=0):
        yield


# ------------------------------------------------------------ sources
# Fixed-size records: an id and `pad` bytes that are a function of it (a record
# read from a cell or an output block that was overwritten shows).  Encoded
# size: 8 + pad.
FIXED = lambda pad: rl.Schema([rl.Field("id", "int64", ()), rl.Field("pad", "uint8", (pad,))])
# Variable-size records: an id and a sequence of bytes.  Encoded size:
# 8 (id) + 8 (row count) + len.
VAR = rl.Schema([rl.Field("id", "int64", ()), rl.Field("pad", "uint8", (), lod_level=1)])


def pad_of(i, k):
    return ((i * 131 + np.arange(k) * 7) % 251).astype(np.uint8)


def fixed_columns(n, pad):
    ids = np.arange(n, dtype=np.int64)
    return {"id": ids, "pad": ((ids[:, None] * 131 + np.arange(pad)[None, :] * 7) % 251).astype(np.uint8)}


def var_columns(n, lengths):
    ids = np.arange(n, dtype=np.int64)
    return {"id": ids, "pad": [pad_of(i, int(lengths[i])) for i in range(n)]}


def write(path, cols, schema, chunk_size):
    with rl.RecordIOWriter(path, schema, chunk_size=chunk_size) as w:
        if schema is VAR:
            for i in range(len(cols["id"])):
                w.write((cols["id"][i], cols["pad"][i]))
        else:
            w.write_batch(cols)
    return path


def check_intact(inst):
    i = int(inst[0])
    p = np.asarray(inst[1])
    assert np.array_equal(p, pad_of(i, len(p))), f"record {i}'s bytes changed"
    return i


def ids_of(reader):
    return [check_intact(inst) for inst in drain_instances(reader)]


def ids_of_batches(chain):
    got = []
    for b in chain:
        got.extend(check_intact(inst) for inst in unbatch(b))
    return got


def both_ways(make, read=ids_of):
    """(order with inline off, order with inline on, the inline shuffle's stats)."""
    with inline_settings(enabled=False):
        ref_chain = make()
        ref = read(ref_chain)
        ref_chain.close()
    with inline_settings(enabled=True, min_payload=0):
        chain = make()
        got = read(chain)
        sh = chain if isinstance(chain, _shuffle.ShuffleReader) else chain.reader
        stats = sh._memory_stats()
        chain.close()
    return ref, got, stats


# ------------------------------------------------------------ the order
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 2500), buf=st.integers(1, 1200), seed=st.integers(0, 2**64 - 1),
       pad=st.integers(0, 300), chunk=st.integers(1, 300), cell=st.sampled_from([0, 0, 8, 40, 64, 200]),
       variable=st.booleans(), data=st.data())
def test_order_same_as_referenced_path(n, buf, seed, pad, chunk, cell, variable, data):
    """Random sources, buffers, seeds, record sizes (fixed, or varying around
    the cell) and cells: inline on gives exactly the records, in exactly the
    order, of inline off, each intact."""
    if variable:
        lengths = np.array(data.draw(st.lists(st.integers(0, 2 * pad + 8), min_size=n, max_size=n)))
        cols, schema = var_columns(n, lengths), VAR
    else:
        cols, schema = fixed_columns(n, pad), FIXED(pad)
    make = lambda: rl.ArrayReader(cols, schema=schema, chunk_records=chunk).shuffle(buf, seed=seed)
    with inline_settings(cell=cell):
        ref, got, stats = both_ways(make)
    assert got == ref
    assert sorted(got) == list(range(n))


@pytest.mark.parametrize("variable", [False, True])
def test_inline_is_used_and_order_over_epochs(tmp_path, variable):
    """RecordIO, 3 epochs (each a new order): the same as the referenced path,
    epoch by epoch, and the records really went through cells."""
    n = 6000
    if variable:
        cols = var_columns(n, np.random.default_rng(0).integers(0, 40, n))
    else:
        cols = fixed_columns(n, 56)
    path = write(str(tmp_path / "r.rio"), cols, VAR if variable else FIXED(56), chunk_size=4096)

    def three_epochs(sh):
        out = []
        for _ in range(3):
            out.append(ids_of(sh))
            sh.reset()
        return out
    ref, got, stats = both_ways(lambda: rl.RecordIOReader(path).shuffle(700, seed=5), read=three_epochs)
    assert got == ref
    assert got[0] != got[1] != got[2]
    for e in got:
        assert collections.Counter(e) == collections.Counter(range(n))
    assert stats["cell"] > 0 and stats["inlined_records"] >= 2 * n, stats


# ------------------------------------------------------------ the cell's edge
@pytest.mark.parametrize("at_cap", [True, False])
def test_record_at_the_cell_and_one_byte_over(tmp_path, at_cap):
    """Cell forced to 48 B: records of exactly 48 B are inlined (none pinned);
    49 B ones take the referenced path (no cell use).  Both: exactly once
    per epoch, the referenced path's order, exact resume."""
    cell, pad = 48, (40 if at_cap else 41)          # encoded: 8 + pad
    n = 3000
    path = write(str(tmp_path / "e.rio"), fixed_columns(n, pad), FIXED(pad), chunk_size=2048)
    with inline_settings(cell=cell):
        ref, got, stats = both_ways(lambda: rl.RecordIOReader(path).shuffle(400, seed=7))
        assert got == ref and sorted(got) == list(range(n))
        assert stats["cell"] == cell
        if at_cap:
            assert stats["inlined_records"] == n and stats["pinned_bytes"] == 0, stats
        else:
            assert stats["inlined_records"] == 0, stats
        with inline_settings(enabled=True, min_payload=0):
            assert_checkpoint_equal(lambda: rl.RecordIOReader(path).shuffle(400, seed=7).batch(64))


def test_variable_sizes_around_the_cell(tmp_path, inline):
    """Sizes 16..80 B against a 48 B cell: the small ones in cells, the rest
    referenced, side by side in one buffer; the order of the referenced path."""
    n = 4000
    lengths = np.random.default_rng(3).integers(0, 65, n)          # encoded 16..80
    cols = var_columns(n, lengths)
    path = write(str(tmp_path / "v.rio"), cols, VAR, chunk_size=2048)
    with inline_settings(cell=48):
        ref, got, stats = both_ways(lambda: rl.RecordIOReader(path).shuffle(500, seed=11))
    assert got == ref and sorted(got) == list(range(n))
    fits = int((16 + lengths <= 48).sum())
    assert stats["inlined_records"] == fits, (stats, fits)


# ------------------------------------------------------------ exactly once, resume
@pytest.mark.parametrize("variable", [False, True])
def test_exact_resume_inline(tmp_path, inline, variable):
    """get_state before every batch, restored in a fresh chain: the rest of
    the epoch exactly (two epochs), fixed and variable-size records, with
    the records inlined (bounded restores fill the cells by index)."""
    n = 1500
    if variable:
        cols, schema = var_columns(n, np.random.default_rng(1).integers(0, 30, n)), VAR
    else:
        cols, schema = fixed_columns(n, 24), FIXED(24)
    path = write(str(tmp_path / "x.rio"), cols, schema, chunk_size=2048)
    make = lambda: rl.RecordIOReader(path).shuffle(300, seed=8).batch(64)
    probe = make()
    assert sorted(ids_of_batches(probe)) == list(range(n))
    assert probe.reader._memory_stats()["cell"] > 0
    probe.close()
    assert_checkpoint_equal(make, epochs=2)
    # a restore mid-epoch goes through the bounded path and inlines there
    ref = make()
    it = iter(ref)
    for _ in range(10):
        next(it)
    state = json.loads(json.dumps(ref.get_state()))
    rest_ref = ids_of_batches(it)
    other = make()
    other.set_state(state)
    assert ids_of_batches(other) == rest_ref
    assert other.reader.restores == 1
    assert other.reader._memory_stats()["inlined_records"] > 0
    other.close()
    ref.close()


def test_exactly_once_array_source_and_drain(inline):
    """An ArrayReader in small chunks, buffer larger than the epoch (the whole
    epoch drains through slot moves), three epochs."""
    n = 3000
    cols = fixed_columns(n, 32)
    sh = rl.ArrayReader(cols, schema=FIXED(32), chunk_records=50).shuffle(5000, seed=2)
    for _ in range(3):
        got = ids_of(sh)
        assert collections.Counter(got) == collections.Counter(range(n))
        sh.reset()
    assert sh._memory_stats()["inlined_records"] >= 2 * n
    sh.close()


# ------------------------------------------------------------ records kept downstream
def test_records_kept_downstream_stay_valid(inline):
    """A prefetch queue between the shuffle and the batch holds up to 1000
    records (4 output blocks of 64 B records) while the shuffle, on the
    prefetch thread, goes on: an output block they are in is not reused."""
    n = 30_000
    cols = fixed_columns(n, 56)
    make = lambda: rl.ArrayReader(cols, schema=FIXED(56), chunk_records=40).shuffle(900, seed=6)
    with inline_settings(enabled=False):
        ref = ids_of(make())
    sh = make()
    chain = sh.prefetch(1000).batch(128)
    assert ids_of_batches(chain) == ref
    assert sh._memory_stats()["inlined_records"] >= n
    chain.close()


def test_variable_size_batches_hold_records(tmp_path, inline):
    """A batch of variable-size records holds each record (a reference to its
    block) until it assembles: 1000 records of 16..66 B span several output
    blocks, none of which is reused under it; batches kept to the end stay
    intact."""
    n = 8000
    cols = var_columns(n, np.random.default_rng(4).integers(0, 50, n))
    path = write(str(tmp_path / "b.rio"), cols, VAR, chunk_size=2048)
    make = lambda: rl.RecordIOReader(path).shuffle(600, seed=9).batch(1000)
    with inline_settings(enabled=False):
        ref = ids_of_batches(make())
    chain = make()
    batches = list(chain)
    assert chain.reader._memory_stats()["inlined_records"] == n
    got = []
    for b in batches:
        got.extend(check_intact(inst) for inst in unbatch(b))
    assert got == ref


def test_nested_shuffles_inline(inline):
    """An outer shuffle over an inner one (whose output blocks it copies from)."""
    n = 8000
    cols = fixed_columns(n, 40)
    make = lambda: rl.ArrayReader(cols, schema=FIXED(40), chunk_records=32).shuffle(700, seed=1).shuffle(1500, seed=2)
    ref, got, stats = both_ways(make)
    assert got == ref and sorted(got) == list(range(n))
    assert stats["inlined_records"] > 0


# ------------------------------------------------------------ memory
def test_no_block_pinned_and_close_releases(tmp_path, inline):
    """Inlined records pin no file block: at most the reader's current chunk
    is alive besides the buffer; reset and close release everything."""
    n = 20_000
    path = write(str(tmp_path / "m.rio"), fixed_columns(n, 56), FIXED(56), chunk_size=8192)
    gc.collect()
    live0 = _recordio._live_file_blocks()
    sh = rl.RecordIOReader(path).shuffle(5000, seed=0)
    worst = 0
    got = []
    for b in sh.batch(256):
        got.extend(int(x) for x in np.asarray(b[0]))
        worst = max(worst, _recordio._live_file_blocks() - live0)
        assert sh._memory_stats()["pinned_bytes"] == 0
    assert sorted(got) == list(range(n))
    assert worst <= 2, worst
    st = sh._memory_stats()
    assert st["cell"] == 64 and st["cells_bytes"] == 5000 * 64, st
    sh.reset()
    assert sh._memory_stats()["inline_records"] == 0
    sh.close()
    gc.collect()
    assert _recordio._live_file_blocks() == live0


def test_not_inlined_where_it_would_not_help(tmp_path):
    """Defaults: a tiny buffer (payload < 256 KiB) stays referenced, and so
    does a source that keeps its block (one array: copies would free
    nothing); records of mixed sizes where cells would cost more than
    referencing (sizes spread evenly over 16..2000 B) are not inlined."""
    with inline_settings(enabled=True, min_payload=256 << 10, cell=0):
        sh = rl.ArrayReader(fixed_columns(20_000, 56), schema=FIXED(56), chunk_records=64).shuffle(1000, seed=0)
        assert sorted(ids_of(sh)) == list(range(20_000))
        assert sh._memory_stats()["cell"] == 0
        sh = rl.ArrayReader({"x": np.zeros((50_000, 64), np.uint8)}).shuffle(20_000, seed=0)
        assert sum(1 for _ in sh) == 50_000 and sh._memory_stats()["cell"] == 0
    with inline_settings(enabled=True, min_payload=0, cell=0):
        cols = var_columns(3000, np.random.default_rng(2).integers(0, 1985, 3000))
        sh = rl.ArrayReader(cols, schema=VAR, chunk_records=20).shuffle(1000, seed=0)
        assert sorted(ids_of(sh)) == list(range(3000))
        assert sh._memory_stats()["cell"] == 0


PEAK = textwrap.dedent(r"""
    import json, sys
    import numpy as np
    import readerlib as rl
    path, n, buf, inline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    from readerlib.readers import _shuffle
    _shuffle._inline_settings(enabled=inline)

    def peak_MiB():
        # VmHWM: this address space's peak (ru_maxrss would carry the forking
        # parent's -- pytest's -- peak across fork + exec)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    imp = peak_MiB()
    sh = rl.RecordIOReader(path).shuffle(buf, seed=0)
    k = 0
    for (x,) in sh.batch(256):
        k += len(x)
    assert k == n, (k, n)
    print(json.dumps({"above_MiB": peak_MiB() - imp,
                      "cell": sh._memory_stats()["cell"]}))
""")

WRITE = textwrap.dedent(r"""
    import sys
    import numpy as np
    import readerlib as rl
    path, n = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (64,))])) as w:
        for s in range(0, n, 250_000):
            w.write_batch({"x": rng.integers(0, 256, size=(min(250_000, n - s), 64), dtype=np.uint8)})
""")


def _run(code, *args, timeout=240):
    # conftest's PYTHONPATH (the readerlib under test: the installed package in
    # CI, never the uncompiled source tree), plus tests/support for `helpers`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [SUPPORT_DIR]))
    p = subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_peak_memory_within_the_payload_bound(tmp_path):
    """1 M x 64 B records (1 MiB chunks) through shuffle(200k) -> batch(256), in
    a fresh process: the peak RSS above `import readerlib` within the bound
    the cells give -- payload (12.2 MiB) + the 16 B slots and 4 B positions
    (3.8 MiB) + 8 MiB (the reader's chunk, output and batch blocks, the
    allocator) = 24 MiB -- where the referenced path (compaction's 1.5 x
    payload + 4 MiB, pinned chunks) goes above it.  A memory check, not a
    timing one: the time limit only guards against a hang."""
    n, buf = 1_000_000, 200_000
    path = str(tmp_path / "peak.rio")
    _run(WRITE, path, n)
    payload = buf * 64 / 2**20
    bound = payload + buf * 20 / 2**20 + 8
    new = json.loads(_run(PEAK, path, n, buf, 1).splitlines()[-1])
    assert new["cell"] == 64, new
    assert new["above_MiB"] <= bound, (new, bound)
    old = json.loads(_run(PEAK, path, n, buf, 0).splitlines()[-1])
    assert old["above_MiB"] > bound, (old, bound)       # the check can tell the two apart


# ------------------------------------------------------------ errors
def test_corrupt_chunk_detected_through_inline(tmp_path, inline):
    """A corrupted chunk under an inlining shuffle: one RecordIOError naming
    the file, the chunk and an offset inside it; reading on gives every other record
    exactly once and intact."""
    n = 5000
    path = write(str(tmp_path / "bad.rio"), fixed_columns(n, 56), FIXED(56), chunk_size=2048)
    r = rl.RecordIOReader(path)
    offs, _ = r.chunk_table()
    r.close()
    bad, lost = corrupt_chunk(path)
    sh = rl.RecordIOReader(path).shuffle(400, seed=3)
    got, errs = read_past_errors(sh, check_intact)
    errors = [str(e) for e in errs]
    assert len(errors) == 1 and "bad.rio" in errors[0] and f"(chunk {bad})" in errors[0], errors
    at = int(re.search(r"at byte offset (\d+)", errors[0]).group(1))
    assert int(offs[bad]) <= at < int(offs[bad + 1]), (errors, int(offs[bad]))
    assert sorted(got) == sorted(set(range(n)) - lost)
    assert sh._memory_stats()["inlined_records"] > 0
    sh.close()


def test_upstream_error_mid_refill_inline(inline):
    """An exception from below during an inline slot's refill: it comes out as
    itself and the drawn slot is handed out by the next call (nothing lost
    or repeated among what came out)."""
    n, boom = 20_000, 15_000
    cols = fixed_columns(n, 56)

    def fn(inst):
        if int(inst[0]) == boom:
            raise RuntimeError(f"map failed at record {int(inst[0])}")
        return inst
    sh = rl.ArrayReader(cols, schema=FIXED(56), chunk_records=64).map(fn).shuffle(2000, seed=1)
    got = []
    with pytest.raises(RuntimeError, match="failed at record 15000"):
        while True:
            inst = sh.read_next()
            if inst is None:
                break
            got.append(check_intact(inst))
    while True:
        inst = sh.read_next()
        if inst is None:
            break
        got.append(check_intact(inst))
    assert sorted(got) == sorted(set(range(n)) - {boom})
    assert sh._memory_stats()["inlined_records"] > 0
    sh.close()


def test_settings_are_checked():
    before = _shuffle._inline_settings()
    with pytest.raises(ValueError, match="max_cell"):
        _shuffle._inline_settings(max_cell=0)
    with pytest.raises(ValueError, match="max_cell"):
        _shuffle._inline_settings(max_cell=5000)
    with pytest.raises(ValueError, match="cell"):
        _shuffle._inline_settings(cell=-1)
    with pytest.raises(ValueError, match="min_payload"):
        _shuffle._inline_settings(min_payload=-1, max_cell=100)
    assert _shuffle._inline_settings() == before


# ------------------------------------------------------------ deferred records
DEFERRED_SMALL = textwrap.dedent("""
    import sys
    import numpy as np
    import readerlib as rl
    from readerlib.formats import _recordio as R
    from readerlib.readers import _shuffle
    from helpers import unbatch
    path, mode, flip = sys.argv[1], sys.argv[2], int(sys.argv[3])
    R._set_mapped_reads(True)
    R._set_deferred_mode(mode)
    _shuffle._inline_settings(enabled=True, min_payload=0, cell=0)
    # chunks of page-aligned records with per-record CRCs: nine of 16 B (encoded)
    # for each one of 400 kB, so each chunk's records are read deferred
    s = rl.Schema([rl.Field("b", "uint8", (), lod_level=1)])
    recs = [bytes([i % 251]) * (400_000 if i % 10 == 9 else 8) for i in range(200)]
    with rl.RecordIOWriter(path, s, chunk_size=1 << 20, page_align=True, record_crc=True) as w:
        for r in recs:
            w.write((np.frombuffer(r, np.uint8),))
    if flip >= 0:                      # one small record's byte flipped
        data = bytearray(open(path, "rb").read())
        at = data.find((8).to_bytes(8, "little") + bytes([flip]) * 8)
        data[at + 8] ^= 0xFF
        open(path, "wb").write(bytes(data))
    src = rl.RecordIOReader(path)
    chain = src.shuffle(100, seed=3).batch(8)
    got, errs = [], []
    it = iter(chain)
    while True:
        try:
            b = next(it)
        except StopIteration:
            break
        except rl.RecordIOError as e:
            errs.append(str(e))
            continue
        got.extend(bytes(np.asarray(inst[0])) for inst in unbatch(b))
    print(src._records_deferred, repr(errs))
    for g in got:
        assert g == bytes([g[0]]) * len(g) if g else True, ("a record's bytes changed", g[:8])
    if flip < 0:
        assert sorted(got) == sorted(recs)
""")


@pytest.mark.parametrize("mode", ["pread", "mmap"])
@pytest.mark.parametrize("flip", [-1, 35])
def test_small_deferred_records_are_never_inlined(tmp_path, mode, flip):
    """A chunk of big records (deferred: unverified, pread mode not even read
    until the batch copies them) holds small ones too.  Those must stay
    referenced for the batch to verify, not be copied into cells: in pread
    mode that copy crashed the process, in mmap mode it handed a corrupt
    record out without its CRC check.  In a subprocess (a crash)."""
    out = _run(DEFERRED_SMALL, str(tmp_path / "d.rio"), mode, flip, timeout=120)
    deferred, errs = out.split(" ", 1)
    assert int(deferred) > 0, out                     # the records did go out deferred
    if flip < 0:
        assert eval(errs) == [], out
    else:
        errs = eval(errs)
        assert len(errs) == 1 and "d.rio" in errs[0] and "checksum" in errs[0], out
