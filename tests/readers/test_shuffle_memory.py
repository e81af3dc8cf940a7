"""ShuffleReader's compaction (issue 16 item 1: memory within the shuffle
buffer + a constant): small records that would pin their whole source block
are copied into blocks the shuffle owns, without changing the order.

The order is checked against a pure-Python model of the algorithm (tf.data's
buffer shuffle over readerlib's xoshiro256** / Lemire draws, seeded from
(seed, epoch) as in rl_core.h), written from the C source and independent of
the build, so a compaction that moved a slot or a draw would show.
"""
import collections
import gc

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats import _recordio
from readerlib.readers import _shuffle
from helpers import assert_checkpoint_equal, corrupt_chunk, drain_instances, read_past_errors, unbatch

M64 = (1 << 64) - 1


# ------------------------------------------------------------ the reference
class _Rng:
    """rl_rng_seed / rl_rng_below of rl_core.h, in Python."""

    def __init__(self, seed, stream):
        x = (seed ^ ((stream * 0xd1342543de82ef95 + 0x2545f4914f6cdd1d) & M64)) & M64
        self.s = []
        for _ in range(4):
            x = (x + 0x9e3779b97f4a7c15) & M64
            z = x
            z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
            z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
            self.s.append(z ^ (z >> 31))

    def next(self):
        s = self.s
        rotl = lambda v, k: ((v << k) | (v >> (64 - k))) & M64
        result = (rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return result

    def below(self, n):
        m = self.next() * n
        if (m & M64) < n:
            t = (-n % (1 << 64)) % n
            while (m & M64) < t:
                m = self.next() * n
        return m >> 64


def model_shuffle(items, buffer_size, seed, epoch=0):
    """tf.data's buffer shuffle as ShuffleReader.c_next does it: fill, then
    per output draw a slot, emit it, refill it (or move the last slot in)."""
    rng = _Rng(seed, epoch)
    it = iter(items)
    buf = []
    for x in it:
        buf.append(x)
        if len(buf) == buffer_size:
            break
    done = len(buf) < buffer_size
    out = []
    while buf:
        j = rng.below(len(buf))
        out.append(buf[j])
        nxt = None if done else next(it, None)
        if nxt is not None:
            buf[j] = nxt
        else:
            done = True
            buf[j] = buf[-1]
            buf.pop()
    return out


# ------------------------------------------------------------ sources
@pytest.fixture
def forced():
    """Compaction with no slack: it runs at a test's small scale (inline
    records off: these tests are about the referenced path; the inline one
    is tests/readers/test_shuffle_inline.py)."""
    old = _shuffle._compaction_settings(enabled=True, slack_bytes=0)
    old_inline = _shuffle._inline_settings(enabled=False)
    yield
    _shuffle._compaction_settings(**old)
    _shuffle._inline_settings(**old_inline)


def _payload(n, rec):
    # record i: its id, then bytes that are a function of the id (so a record
    # read from freed or reused memory shows)
    ids = np.arange(n, dtype=np.int64)
    pad = ((ids[:, None] * 131 + np.arange(max(rec - 8, 0))[None, :] * 7) % 251).astype(np.uint8)
    return ids, pad


SCHEMA = lambda rec: rl.Schema([rl.Field("id", "int64", ()), rl.Field("pad", "uint8", (max(rec - 8, 0),))])


def recordio(tmp_path, n, rec, chunk_size):
    path = str(tmp_path / f"r{n}_{rec}_{chunk_size}.rio")
    ids, pad = _payload(n, rec)
    with rl.RecordIOWriter(path, SCHEMA(rec), chunk_size=chunk_size) as w:
        w.write_batch({"id": ids, "pad": pad})
    return path


def array(n, rec, chunk_records):
    ids, pad = _payload(n, rec)
    # two fields: not the zero-copy path, so records sit in chunk blocks of chunk_records
    return rl.ArrayReader({"id": ids, "pad": pad}, schema=SCHEMA(rec), chunk_records=chunk_records)


def check_intact(inst):
    i = int(inst[0])
    want = ((i * 131 + np.arange(len(inst[1])) * 7) % 251).astype(np.uint8)
    assert np.array_equal(np.asarray(inst[1]), want), f"record {i}'s bytes changed"
    return i


def ids_of(reader):
    return [check_intact(inst) for inst in drain_instances(reader)]


# ------------------------------------------------------------ the order
def test_model_matches_the_shuffle_without_compaction():
    """The reference itself: with compaction off the build and the model agree."""
    old = _shuffle._compaction_settings(enabled=False)
    try:
        for n, buf, seed in [(1, 1, 0), (50, 7, 3), (300, 300, 1), (1000, 64, 2**63 + 5), (257, 1000, 9)]:
            sh = rl.ArrayReader({"id": np.arange(n, dtype=np.int64)}).shuffle(buf, seed=seed)
            assert [int(x[0]) for x in drain_instances(sh)] == model_shuffle(range(n), buf, seed)
            assert sh._memory_stats()["passes"] == 0
            sh.close()
    finally:
        _shuffle._compaction_settings(**old)


@pytest.mark.parametrize("rec,buf,seed", [(16, 500, 0), (64, 2000, 1), (64, 333, 2**40 + 7),
                                          (1000, 300, 5), (40 * 1024, 64, 3)])
def test_order_unchanged_by_compaction_recordio(tmp_path, forced, rec, buf, seed):
    """Same seed, same order as the model, over two epochs, while blocks are
    compacted (small records) or, for 40 KiB records, referenced as before."""
    n = 6000 if rec < 40000 else 600
    path = recordio(tmp_path, n, rec, chunk_size=max(4096, 8 * rec))
    sh = rl.RecordIOReader(path).shuffle(buf, seed=seed)
    for epoch in range(2):
        assert ids_of(sh) == model_shuffle(range(n), buf, seed, epoch), f"epoch {epoch}"
        sh.reset()
    st = sh._memory_stats()
    if rec < 32 * 1024:
        assert st["passes"] > 0 and st["copied_records"] > 0, st
    else:
        assert st["copied_records"] == 0, st      # big records stay referenced (zero copy)
    sh.close()


@pytest.mark.parametrize("buf,seed,chunk", [(100, 0, 16), (1000, 11, 64), (4000, 12, 1000)])
def test_order_unchanged_by_compaction_array_and_batches(forced, buf, seed, chunk):
    n = 20_000
    sh = array(n, 64, chunk).shuffle(buf, seed=seed)
    got = []
    for b in sh.batch(97):
        got.extend(check_intact(inst) for inst in unbatch(b))
    assert got == model_shuffle(range(n), buf, seed)
    assert sh._memory_stats()["copied_records"] > 0
    sh.close()


def test_nested_shuffles_compact_each_others_blocks(forced):
    """An outer shuffle holds records in the inner one's arena blocks: the
    inner one must not drop them (it only compacts blocks nobody else holds),
    and the outer one may compact them in turn.  Order: the model composed."""
    n = 12_000
    inner = array(n, 48, 32).shuffle(700, seed=1)
    outer = inner.shuffle(1500, seed=2)
    assert ids_of(outer) == model_shuffle(model_shuffle(range(n), 700, 1), 1500, 2)
    assert inner._memory_stats()["copied_records"] > 0
    assert outer._memory_stats()["copied_records"] > 0
    outer.close()


# ------------------------------------------------------------ exactly once, resume
def test_exactly_once_over_epochs_with_compaction(forced):
    n = 9000
    sh = array(n, 24, 50).shuffle(1200, seed=4)
    for _ in range(3):
        got = ids_of(sh)
        assert collections.Counter(got) == collections.Counter(range(n))
        sh.reset()
    assert sh._memory_stats()["passes"] >= 3
    sh.close()


def test_exact_resume_with_compaction(forced, tmp_path):
    path = recordio(tmp_path, 1500, 64, chunk_size=2048)
    make = lambda: rl.RecordIOReader(path).shuffle(300, seed=8).batch(64)
    probe = make()
    for _ in probe:
        pass
    assert probe.reader._memory_stats()["copied_records"] > 0       # the chain compacts
    probe.close()
    assert_checkpoint_equal(make, epochs=2)


# ------------------------------------------------------------ the bound
def test_pinned_bytes_bounded_small_records(tmp_path, forced):
    """64 B records in 64 KiB chunks through shuffle(20k) (1.3 MB payload):
    without compaction the buffer keeps ~10 payloads of chunks alive (the
    whole 4 MB file here); with it, at most 2 x payload + one chunk + one
    arena block, counted both by the shuffle and by the file's live blocks."""
    n, rec, buf, chunk = 64_000, 64, 20_000, 64 * 1024
    path = recordio(tmp_path, n, rec, chunk_size=chunk)
    gc.collect()
    live0 = _recordio._live_file_blocks()
    sh = rl.RecordIOReader(path).shuffle(buf, seed=0)
    chain = sh.batch(256)
    payload = buf * rec
    worst_pinned, worst_live = 0, 0
    got = []
    for b in chain:
        got.extend(int(inst[0]) for inst in unbatch(b))
        st = sh._memory_stats()
        worst_pinned = max(worst_pinned, st["pinned_bytes"])
        worst_live = max(worst_live, _recordio._live_file_blocks() - live0)
        assert st["payload_bytes"] <= payload + rec
    assert sorted(got) == list(range(n))
    assert worst_pinned <= 2 * payload + chunk + (1 << 20) + 2 * chunk, worst_pinned
    # file blocks are 64 KiB: 2 x 1.3 MB of them is ~40 (+ the reader's current one)
    assert worst_live <= 2 * payload // chunk + 4, worst_live
    chain.close()
    assert _recordio._live_file_blocks() == live0


def test_default_settings_bound_at_scale():
    """Default settings (1.5 x payload + 4 MiB), 1 MiB chunks of 64 B records
    as in the benchmark: pinned stays within 2 x payload + 4 MiB + a chunk +
    an arena block (without compaction: ~10 x payload, the whole 25 MB here).
    Inline records off (they would take these records out of the blocks:
    test_shuffle_inline.py)."""
    n, buf = 400_000, 40_000
    old = _shuffle._inline_settings(enabled=False)
    try:
        sh = array(n, 64, 16384).shuffle(buf, seed=1)     # 16384 x 64 B: 1 MiB blocks
    finally:
        _shuffle._inline_settings(**old)
    worst = 0
    seen = np.zeros(n, np.int64)
    for b in sh.batch(512):
        seen[np.asarray(b[0]) if not isinstance(b[0], rl.LoDTensor) else np.asarray(b[0].data)] += 1
        worst = max(worst, sh._memory_stats()["pinned_bytes"])
    assert (seen == 1).all()
    assert worst <= 2 * buf * 64 + (4 << 20) + 2 * (1 << 20), worst
    assert sh._memory_stats()["passes"] > 0
    sh.close()


def test_big_records_are_not_copied(tmp_path):
    """Records >= 32 KiB stay referenced even when their blocks are mostly drained."""
    old = _shuffle._compaction_settings(enabled=True, slack_bytes=0)
    try:
        path = recordio(tmp_path, 200, 48 * 1024, chunk_size=400 * 1024)   # ~8 per chunk
        sh = rl.RecordIOReader(path).shuffle(50, seed=0)
        got = ids_of(sh)
        assert sorted(got) == list(range(200))
        assert sh._memory_stats()["copied_records"] == 0
        sh.close()
    finally:
        _shuffle._compaction_settings(**old)


# ------------------------------------------------------------ records kept downstream
def test_records_kept_downstream_stay_valid(forced):
    """Instances read through a prefetch (its queue holds records), and the
    arrays kept by the caller, stay intact after their source blocks were
    compacted away and the arena blocks recycled."""
    n = 15_000
    sh = array(n, 64, 40).shuffle(900, seed=6)
    chain = sh.prefetch(16)
    kept = []
    it = iter(chain)
    for inst in it:
        kept.append(inst)            # not copied: views keep their block alive
    assert sh._memory_stats()["copied_records"] > 0
    gc.collect()
    got = [check_intact(inst) for inst in kept]
    assert got == model_shuffle(range(n), 900, 6)
    chain.close()


def test_kept_batches_of_compacted_records(forced):
    n = 10_000
    sh = array(n, 200, 25).shuffle(600, seed=9)
    batches = list(sh.batch(50))             # all kept until the end
    assert sh._memory_stats()["copied_records"] > 0
    got = []
    for b in batches:
        got.extend(check_intact(inst) for inst in unbatch(b))
    assert got == model_shuffle(range(n), 600, 9)


# ------------------------------------------------------------ error paths
def test_settings_are_checked():
    before = _shuffle._compaction_settings()
    with pytest.raises(ValueError, match="slack_bytes"):
        _shuffle._compaction_settings(slack_bytes=-1)
    with pytest.raises(ValueError, match="factor"):
        _shuffle._compaction_settings(factor=0.5)
    with pytest.raises(ValueError, match="fill"):
        _shuffle._compaction_settings(fill=0)
    with pytest.raises(ValueError, match="fill"):
        _shuffle._compaction_settings(fill=1.5)
    with pytest.raises(ValueError, match="factor"):
        _shuffle._compaction_settings(fill=0.6, factor=0.9, slack_bytes=0)
    assert _shuffle._compaction_settings() == before     # a refused setting changes nothing


def test_bad_chunk_mid_epoch_with_compaction(tmp_path, forced):
    """A corrupt chunk under a compacting shuffle: one RecordIOError, reading
    on gives every other record exactly once and intact."""
    n = 5000
    path = recordio(tmp_path, n, 64, chunk_size=2048)
    bad, lost = corrupt_chunk(path)
    sh = rl.RecordIOReader(path).shuffle(400, seed=3)
    got, errs = read_past_errors(sh, check_intact)
    errors = [str(e) for e in errs]
    assert len(errors) == 1 and "r5000_64_2048.rio" in errors[0], errors
    assert sorted(got) == sorted(set(range(n)) - lost)
    assert sh._memory_stats()["copied_records"] > 0
    sh.close()


def test_close_and_reset_release_everything(forced, tmp_path):
    path = recordio(tmp_path, 4000, 64, chunk_size=2048)
    gc.collect()
    live0 = _recordio._live_file_blocks()
    sh = rl.RecordIOReader(path).shuffle(500, seed=0)
    it = iter(sh)
    for _ in range(2500):
        next(it)
    assert sh._memory_stats()["copied_records"] > 0
    sh.reset()
    st = sh._memory_stats()
    assert st["pinned_bytes"] == 0 and st["payload_bytes"] == 0 and st["blocks"] == 0, st
    for _ in range(2500):
        sh.read_next()
    sh.close()
    assert sh._memory_stats()["pinned_bytes"] == 0
    gc.collect()
    assert _recordio._live_file_blocks() == live0


def test_one_block_per_record_source(forced):
    """A source that makes a fresh block per record (the worst case for the
    block table: as many entries as slots): nothing to compact, same order."""
    n, rec = 3000, 40
    ids, pad = _payload(n, rec)
    src = rl.PythonReader(lambda: ((ids[i], pad[i]) for i in range(n)), SCHEMA(rec))
    sh = src.shuffle(700, seed=5)
    assert ids_of(sh) == model_shuffle(range(n), 700, 5)
    st = sh._memory_stats()
    assert st["copied_records"] == 0 and st["blocks"] == 0, st
    sh.close()


def test_upstream_error_after_compaction_surfaces(forced):
    """An exception from the reader below (a map function), raised during a
    refill after compaction passes, comes out as itself; what was delivered
    before is intact and distinct, and close releases everything."""
    n, boom = 30_000, 25_000

    def fn(inst):
        if int(inst[0]) == boom:
            raise RuntimeError(f"map failed at record {int(inst[0])}")
        return inst
    sh = array(n, 64, 64).map(fn).shuffle(2000, seed=1)
    got = []
    with pytest.raises(RuntimeError, match="failed at record 25000"):
        while True:
            inst = sh.read_next()
            if inst is None:
                break
            got.append(check_intact(inst))
    assert len(got) == len(set(got)) and len(got) > 20_000
    assert sh._memory_stats()["copied_records"] > 0
    sh.close()
    assert sh._memory_stats()["pinned_bytes"] == 0
