"""A deferred record (a big v2 RecordIO record handed out as a file offset and
its CRC, to the batch that negotiated it) asked for by another consumer is
replaced by a verified copy (readerlib/_mapped.pxd: hand_out_verified, the
buffer shuffle's _verify_slot, the RecordIO reader's _materialize).  When that
copy fails its CRC the record is dropped and the error raised: the reader has
taken one record more than its position says.  Before, get_state then saved
the same position as before the failing read (a restore re-reads the dropped
record: it raised the checksum error in set_state, where the reader itself read
on), so now get_state refuses, naming the record, as BatchReader does for a
record dropped by its own copy, until the next epoch.

Only a chain whose batch negotiated defers anything: a shuffle (or map) read
with no batch above it reads the chunk the ordinary way, and its error is the
chunk's (the first test)."""
import numpy as np
import pytest

import readerlib as rl

RB = 65536                      # >= 32 KiB: v2 chunks carry per-record CRCs, the batch defers them
N, BAD = 48, 9


@pytest.fixture
def big(tmp_path):
    """A v2 RecordIO file of N 64 KiB records, record BAD's payload corrupted
    (not the chunk tables); returns (path, records, the bad record's offset)."""
    p = str(tmp_path / "big.rio")
    x = np.random.default_rng(0).integers(0, 256, size=(N, RB), dtype=np.uint8)
    with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (RB,))])) as w:
        w.write_batch({"x": x})
    data = bytearray(open(p, "rb").read())
    off = data.find(x[BAD].tobytes())
    assert off > 0
    data[off + 1234] ^= 0x40
    with open(p, "wb") as f:
        f.write(data)
    return p, x, off


def _id(x, rows):
    """Record numbers of `rows` (instances' or a batch's)."""
    rows = np.asarray(rows).reshape(-1, RB)
    return [int(np.flatnonzero((x[:, :64] == r[:64]).all(axis=1))[0]) for r in rows]


def _chain(p, kind):
    """(source, the reader read directly, a batch above it: negotiated)."""
    src = rl.open_files([p], num_threads=1) if kind == "open_files" else rl.RecordIOReader(p)
    if kind == "window":
        mid = src.shuffle(16, seed=1, mode="window")
    elif kind == "buffer":
        mid = src.shuffle(16, seed=4)
    else:
        mid = src
    return src, mid, mid.batch(2)


def test_with_no_batch_above_nothing_is_deferred(big):
    p, x, off = big
    src = rl.RecordIOReader(p)
    w = src.shuffle(16, seed=1, mode="window")
    with pytest.raises(rl.RecordIOError, match="record checksum mismatch"):
        w.read_next()                                   # the fill's ordinary chunk read fails
    assert src._records_deferred == 0


@pytest.mark.parametrize("kind", ["window", "buffer", "source", "open_files"])
def test_get_state_refuses_after_a_failed_verified_copy_until_the_next_epoch(big, kind):
    p, x, off = big
    src, mid, b = _chain(p, kind)
    got = _id(x, b.read_next()["x"])                    # filled in the batch's pull: descriptors
    assert BAD not in got and b._mapped
    assert (mid if kind == "open_files" else src)._records_deferred > 0
    while True:                                         # the reader read directly: verified copies
        try:
            item = mid.read_next()
        except rl.RecordIOError as e:
            err = e
            break
        assert item is not None
        got += _id(x, item[0])
    assert "record checksum mismatch" in str(err) and f"at byte offset {off}" in str(err)
    # the record is gone: the position is the one `before` saved, but reading
    # on now goes on after the dropped record, not at it
    want = f"{type(mid).__name__} dropped a record this epoch .*record checksum mismatch .*at byte offset {off}"
    for r in (mid, b):                                  # any chain over the reader
        with pytest.raises(RuntimeError, match=want):
            r.get_state()
    while (item := mid.read_next()) is not None:        # reading on loses only that record
        got += _id(x, item[0])
    assert sorted(got) == [i for i in range(N) if i != BAD]
    mid.reset()                                         # the next epoch: positions add up again
    assert mid.get_state()["position"] == 0
    mid.close()
