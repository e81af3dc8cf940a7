"""open_files(shuffle_files=True): the file order of an epoch is drawn from
(seed, epoch) over the list of files alone -- the same whether a TFRecord
file's .idx sidecar exists or a RecordIO file has its index footer, however
many units (chunks, or one whole file) a file has, empty files included, on
every rank of a shard -- so a state restores in any process to the records
it was saved at.  States saved before 2026-12-06 (no "file_order") restore
to the order they were read in, or are refused when that order cannot be
known."""
import faulthandler
import json
import os

import numpy as np
import pytest

import readerlib as rl
from readerlib.formats._tfrecord import TFRecordWriter
from readerlib.readers.files import open_files

from helpers import make_byte_files

# records per file: empty files, and files of several 1 MiB TFRecord chunks
SIZES = [0, 3, 1, 25, 0, 2, 12]
REC = 100_000
SEEDS = [0, 1, 7, 12345]
EPOCHS = 3


@pytest.fixture(autouse=True)
def _hang_guard():
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def ids(reader, n=None):
    """Record ids (their first 8 bytes) of the rest of the epoch, or of the next n."""
    out = []
    while n is None or len(out) < n:
        x = reader.read_next()
        if x is None:
            break
        out.append(int.from_bytes(np.asarray(x[0])[:8].tobytes(), "little"))
    return out


def run_epochs(reader, n=EPOCHS):
    out = []
    for _ in range(n):
        out.append(ids(reader))
        reader.reset()
    return out


def file_ids(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [list(range(starts[f], starts[f + 1])) for f in range(len(sizes))]


def expected(seed, epoch, sizes, mine=None):
    """The rule: the files permuted by (seed, epoch), their records concatenated;
    a rank's share (`mine`, a set of ids) in that order."""
    per_file = file_ids(sizes)
    order = np.random.default_rng([seed, epoch]).permutation(len(sizes))
    got = [k for f in order for k in per_file[f]]
    return got if mine is None else [k for k in got if k in mine]


def sidecars(paths):
    return [p + ".idx" for p in paths if os.path.exists(p + ".idx")]


def remove_sidecars(paths):
    for s in sidecars(paths):
        os.remove(s)


# ------------------------------------------------------------------ TFRecord
@pytest.mark.parametrize("shard,equal_batches", [(None, False), ((0, 1), False), ((0, 2), False),
                                                 ((1, 2), False), ((2, 3), True)])
def test_tfrecord_order_is_the_same_with_and_without_sidecars(tmp_path, shard, equal_batches):
    paths, _ = make_byte_files(str(tmp_path), ["tfrecord"] * len(SIZES), SIZES, rec_size=REC)
    share = None
    if shard is not None:
        share = set(ids(open_files(paths, shard=shard)))
    for seed in SEEDS:
        remove_sidecars(paths)

        def make():
            return open_files(paths, shuffle_files=True, seed=seed, shard=shard, equal_batches=equal_batches)

        before = make()                       # planned before any sidecar exists
        if shard is None:
            assert not sidecars(paths)
            assert len(before.plan.units) == len(SIZES)      # a whole-file unit each, empty ones too
        # states of `before` at points of its epochs 0 and 1 (epoch 0 writes the sidecars)
        run, states = [], []
        for e in range(EPOCHS):
            got = []
            for k in (0, 1, 17):
                got += ids(before, k - len(got))
                states.append((e, len(got), json.loads(json.dumps(before.get_state()))))
            run.append(got + ids(before))
            before.reset()
        assert sorted(sidecars(paths)) == sorted(p + ".idx" for p in paths)   # every file's, by now
        after = make()                        # planned with every sidecar: chunk units, none for empty files
        if shard is None:
            assert len(after.plan.units) > len(before.plan.units)
        assert run_epochs(after) == run, seed
        for e in range(EPOCHS):
            want = expected(seed, e, SIZES, share)
            if equal_batches:
                assert run[e] == want[:len(run[e])]
            else:
                assert run[e] == want, (seed, e)
        # a state of the chain planned before the sidecars, restored in one planned after them
        # (and the other way round: the sidecars gone again)
        for e, k, state in states:
            if e == EPOCHS - 1:
                continue
            b = make()
            b.set_state(state)
            assert ids(b) == run[e][k:], (seed, e, k)
            b.reset()
            assert ids(b) == run[e + 1], (seed, e, k)
        remove_sidecars(paths)
        e, k, state = states[4]
        b = make()
        b.set_state(json.loads(json.dumps(after.get_state())))
        b.set_state(state)
        assert ids(b) == run[e][k:]


# ------------------------------------------------------------------ RecordIO
def _cut_footer(path):
    """The file without its index footer (what a writer that died leaves): read by a scan."""
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:int.from_bytes(data[-16:-8], "little")])


def test_recordio_order_is_the_same_with_and_without_index_footers(tmp_path):
    os.mkdir(tmp_path / "footer")
    os.mkdir(tmp_path / "scan")
    with_footer, _ = make_byte_files(str(tmp_path / "footer"), ["rio"] * len(SIZES), SIZES,
                                     chunk_size=4 * REC, rec_size=REC)
    scanned, _ = make_byte_files(str(tmp_path / "scan"), ["rio"] * len(SIZES), SIZES,
                                 chunk_size=4 * REC, rec_size=REC)
    for p in scanned:
        _cut_footer(p)
    with pytest.warns(rl.RecordIOWarning, match="no index footer"):
        assert not rl.RecordIOReader(scanned[0]).has_index
    assert rl.RecordIOReader(with_footer[0]).has_index
    for seed in SEEDS:
        def make(paths, shard=None):
            return open_files(paths, shuffle_files=True, seed=seed, shard=shard)

        with pytest.warns(rl.RecordIOWarning):
            a = make(scanned)
        b = make(with_footer)
        assert len(a.plan.units) == len(SIZES) < len(b.plan.units)   # whole files / chunks, none if empty
        with pytest.warns(rl.RecordIOWarning):
            got = run_epochs(a)
        assert got == run_epochs(b) == [expected(seed, e, SIZES) for e in range(EPOCHS)], seed
        # a restore in a fresh chain, mid-epoch 1, for both
        for paths in (scanned, with_footer):
            with pytest.warns(rl.RecordIOWarning) if paths is scanned else _nothing():
                r = make(paths)
                run_epochs(r, 1)
                head = ids(r, 20)
                state = json.loads(json.dumps(r.get_state()))
                c = make(paths)
                c.set_state(state)
                assert head + ids(c) == expected(seed, 1, SIZES)
                c.reset()
                assert ids(c) == expected(seed, 2, SIZES)
        # each rank of a shard: the same file order, its share
        for rank in range(2):
            with pytest.warns(rl.RecordIOWarning):
                got = run_epochs(make(scanned, (rank, 2)))
            mine = set(ids(open_files(with_footer, shard=(rank, 2))))
            assert got == run_epochs(make(with_footer, (rank, 2))) == [
                expected(seed, e, SIZES, mine) for e in range(EPOCHS)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------ states of before the fix
# TFRecord files whose bytes (so identities) are fixed: part{f}.tfrecord holds
# the 8-byte records np.full(8, i) for i in OLD_FILES[f]
OLD_FILES = [[0, 1, 2], [], [3], [4, 5, 6, 7], [8, 9], [10]]
OLD_SCHEMA = rl.Schema([rl.Field("x", "uint8", (8,))])
OLD_IDENTITIES = [{"name": "part0.tfrecord", "size": 72, "crc32c": 2711678813},
                  {"name": "part1.tfrecord", "size": 0, "crc32c": 0},
                  {"name": "part2.tfrecord", "size": 24, "crc32c": 3954366336},
                  {"name": "part3.tfrecord", "size": 96, "crc32c": 3146906536},
                  {"name": "part4.tfrecord", "size": 48, "crc32c": 44332519},
                  {"name": "part5.tfrecord", "size": 24, "crc32c": 4222006485}]


def write_old_files(d, files):
    paths = []
    for f, recs in enumerate(files):
        paths.append(os.path.join(str(d), f"part{f}.tfrecord"))
        with TFRecordWriter(paths[-1]) as w:
            for i in recs:
                w.write(np.full(8, i, np.uint8))
    return paths


def old_state(shard, seed, epoch, position, identities=OLD_IDENTITIES):
    """A state as readerlib saved it before 2026-12-06: no "file_order"."""
    return {"version": 2, "position": position, "type": "MultiFileReader", "files": identities,
            "shard": shard, "shuffle_files": True, "seed": seed, "limit": -1, "epoch": epoch}


def fixed_ids(reader, n=None):
    out = []
    while n is None or len(out) < n:
        x = reader.read_next()
        if x is None:
            break
        out.append(int(x[0][0]))
    return out


# what those readerlibs read after the state (rest of epoch 1 at position 1, then epoch 2):
# sharded, the files permuted were the ones holding units of the rank
OLD_RUNS = {(0, 2): ([4, 5, 6, 7, 10], [3, 10, 4, 5, 6, 7]),
            (1, 2): ([1, 2, 8, 9], [0, 1, 2, 8, 9]),
            (0, 1): ([10, 0, 1, 2, 4, 5, 6, 7, 8, 9], [10, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9])}


@pytest.mark.parametrize("shard", [(0, 2), (1, 2), (0, 1)])
def test_a_sharded_state_saved_before_the_file_order_fix_restores_to_its_records(tmp_path, shard):
    paths = write_old_files(tmp_path, OLD_FILES)
    for sidecar_first in (False, True):
        if sidecar_first:
            run_epochs(open_files(paths, schema=OLD_SCHEMA), 1)
            assert len(sidecars(paths)) == len(paths)
        r = open_files(paths, shuffle_files=True, seed=3, shard=shard, schema=OLD_SCHEMA)
        assert r.plan.describe()["files"] == OLD_IDENTITIES
        r.set_state(old_state(list(shard), 3, 1, 1))
        rest, nxt = OLD_RUNS[shard]
        assert fixed_ids(r) == rest
        r.reset()
        state = r.get_state()          # the restored chain keeps the old order: version 2 says so
        assert state["file_order"] == "units" and state["version"] == 2
        assert fixed_ids(r) == nxt
        b = open_files(paths, shuffle_files=True, seed=3, shard=shard, schema=OLD_SCHEMA)
        b.set_state(state)
        assert fixed_ids(b) == nxt
        # a chain started now reads all the files permuted, and says so
        new = open_files(paths, shuffle_files=True, seed=3, shard=shard, schema=OLD_SCHEMA)
        state = new.get_state()
        assert state["file_order"] == "files" and state["version"] == 3
        mine = set(fixed_ids(open_files(paths, shard=shard, schema=OLD_SCHEMA)))
        assert fixed_ids(new) == expected(3, 0, [len(f) for f in OLD_FILES], mine)
        remove_sidecars(paths)


def test_an_unsharded_state_saved_before_the_fix(tmp_path):
    # no empty file: the old order was already every file permuted, wherever it was saved
    full = write_old_files(tmp_path, [[0, 1, 2], [3], [4, 5]])
    idents = open_files(full, schema=OLD_SCHEMA).plan.describe()["files"]
    for e in range(3):
        r = open_files(full, shuffle_files=True, seed=5, schema=OLD_SCHEMA)
        r.set_state(old_state(None, 5, e, 2, idents))
        assert fixed_ids(r) == expected(5, e, [3, 1, 2])[2:]
        new = open_files(full, shuffle_files=True, seed=5, schema=OLD_SCHEMA)
        assert new.get_state()["version"] == 2              # the old readerlib reads the same order
    # an empty TFRecord file: the old order depended on its sidecar when the state's chain was
    # planned -- refused where the two orders differ (epoch 1), restored where they agree (0)
    os.mkdir(tmp_path / "empty")
    paths = write_old_files(tmp_path / "empty", [[], [0], [1]])
    idents = open_files(paths, schema=OLD_SCHEMA).plan.describe()["files"]
    for sidecar_first in (False, True):
        if sidecar_first:
            run_epochs(open_files(paths, schema=OLD_SCHEMA), 1)
        r = open_files(paths, shuffle_files=True, seed=1, schema=OLD_SCHEMA)
        r.set_state(json.loads(json.dumps(r.get_state())))
        with pytest.raises(ValueError, match=r"before 2026-12-06 .*'part0.tfrecord'.* epoch 1: it "
                                             r"cannot be restored exactly"):
            r.set_state(old_state(None, 1, 1, 1, idents))
        assert fixed_ids(r) == expected(1, 0, [0, 1, 1])       # refused: the chain reads on as it was
        r.set_state(old_state(None, 1, 0, 1, idents))
        assert fixed_ids(r) == [1]
        assert "file_order" not in r.get_state()               # (the epoch it restored)
        r.reset()
        assert r.get_state()["file_order"] == "units"          # the chain keeps the old order
        # a chain started now: an old readerlib might read another order (the sidecar)
        assert open_files(paths, shuffle_files=True, seed=1, schema=OLD_SCHEMA).get_state()["version"] == 3
        remove_sidecars(paths)


def test_a_state_with_an_unknown_file_order_is_refused(tmp_path):
    paths = write_old_files(tmp_path, OLD_FILES)
    r = open_files(paths, shuffle_files=True, seed=3, schema=OLD_SCHEMA)
    state = r.get_state()
    assert state["file_order"] == "files"
    state["file_order"] = "sorted"
    with pytest.raises(ValueError, match="unknown file order 'sorted'"):
        r.set_state(state)
