"""One error taxonomy (readerlib/errors.py): the same fault raises the same
exception type on every path, with a message naming file, offset, index, field."""
import struct

import numpy as np
import pytest

import readerlib as rl
from readerlib.errors import (DataLossError, FailedPreconditionError, InvalidArgumentError,
                              RecordSchemaError)


# ---- a record that does not fit the schema -----------------------------------------

def _swapped_holder_chain(make_chain):
    """A chain built over a holder of int64 instances, whose holder then gets a
    reader of int32 instances: every record the chain sees is 4 bytes short."""
    holder = rl.ReaderHolder(rl.ArrayReader({"x": np.arange(6, dtype=np.int64)}))
    chain = make_chain(holder)
    holder.reset_reader(rl.ArrayReader({"x": np.arange(6, dtype=np.int32)}))
    return chain


@pytest.mark.parametrize("make_chain, who", [
    (lambda r: r.batch(4), "BatchReader"),
    (lambda r: r.batch(4, drop_last=True), "BatchReader"),
    (lambda r: r.shuffle(3, seed=0), "ShuffleReader"),
])
def test_a_chain_over_records_of_another_schema(make_chain, who):
    chain = _swapped_holder_chain(make_chain)
    with pytest.raises(RecordSchemaError) as e:
        chain.read_next()
    assert type(e.value) is RecordSchemaError
    assert who in str(e.value) and "4 bytes" in str(e.value), str(e.value)
    assert e.value.field == "x" and "field 'x' needs 8 bytes" in str(e.value), str(e.value)


def test_a_batch_names_the_instance_and_the_field():
    holder = rl.ReaderHolder(rl.ArrayReader({"s": [np.zeros((2, 3), np.float32)] * 4}))
    chain = holder.batch(4)
    holder.reset_reader(rl.ArrayReader({"s": [np.zeros((2, 2), np.float32)] * 4}))
    with pytest.raises(RecordSchemaError) as e:
        chain.read_next()
    msg = str(e.value)
    assert e.value.index == 0 and e.value.field == "s", msg
    assert "instance 0 of the batch" in msg and "field 's' needs 2 rows of 12 bytes" in msg, msg


def _tfrecord(path, records):
    with open(path, "wb") as f:
        for r in records:
            n = struct.pack("<Q", len(r))
            f.write(n + struct.pack("<I", rl.masked_crc32c(n)) + r + struct.pack("<I", rl.masked_crc32c(r)))
    return str(path)


def test_tfrecord_record_not_fitting_the_schema(tmp_path):
    path = _tfrecord(tmp_path / "bad.tfrecord", [b"\0" * 64, b"\0" * 60])
    schema = rl.Schema([rl.Field("x", "float32", (16,))])
    with pytest.raises(RecordSchemaError) as e:
        list(rl.TFRecordReader(path, schema=schema))
    assert type(e.value) is RecordSchemaError
    assert e.value.path == path and e.value.offset == 80 and e.value.field == "x"
    assert "bad.tfrecord: record at 80 has 60 bytes" in str(e.value)


def test_recordio_record_not_fitting_the_schema(tmp_path):
    # a sequence record whose row count (5) is more than its bytes hold (2 rows),
    # with every checksum recomputed: only the schema check can find it.  Written as
    # version 1 (one body CRC to recompute); version 2's per-record checks name the
    # record the same way (tests/formats/test_recordio.py)
    path = tmp_path / "bad.rio"
    schema = rl.Schema([rl.Field("s", "float32", (), lod_level=1)])
    with rl.RecordIOWriter(path, schema, version=1) as w:
        for _ in range(3):
            w.write((np.zeros(2, np.float32),))
    data = bytearray(path.read_bytes())
    off = int(rl.RecordIOReader(path).chunk_table()[0][0])
    head = data[off:off + 32]
    stored = int.from_bytes(head[16:24], "little")
    body = off + 32
    assert data[body:body + 12] == struct.pack("<III", 16, 16, 16)        # the sizes table
    rec1 = body + 12 + 16                                                 # record 1's row count
    assert int.from_bytes(data[rec1:rec1 + 8], "little") == 2
    data[rec1:rec1 + 8] = struct.pack("<q", 5)
    data[off + 12:off + 16] = struct.pack("<I", rl.crc32c(bytes(data[body:body + stored])))
    salt = rl.crc32c(bytes(data[16:24]))
    data[off + 28:off + 32] = struct.pack("<I", rl.crc32c(bytes(data[off:off + 28]), salt))
    path.write_bytes(bytes(data))
    with pytest.raises(RecordSchemaError) as e:
        list(rl.RecordIOReader(path))
    assert isinstance(e.value, rl.RecordIOError)          # as every other RecordIO check
    assert isinstance(e.value, DataLossError) and isinstance(e.value, ValueError)
    assert e.value.path == str(path) and e.value.offset == off and e.value.index == 1, str(e.value)
    assert "bad.rio" in str(e.value) and "record 1 of chunk 0" in str(e.value)
    with pytest.warns(rl.RecordIOWarning, match="does not match the schema"):   # skip still skips
        assert list(rl.RecordIOReader(path, on_error="skip")) == []


def test_record_schema_error_is_caught_as_before():
    """TFRecord and the batches raised ValueError, RecordIO a DataLossError: both still catch it."""
    assert issubclass(RecordSchemaError, ValueError) and issubclass(RecordSchemaError, DataLossError)
    assert rl.RecordSchemaError is RecordSchemaError


# ---- CTC: a sequence length above max_time -----------------------------------------

def test_ctc_length_above_max_time_on_the_cpu():
    logits = np.zeros((6, 2, 4), np.float32)
    with pytest.raises(FailedPreconditionError, match=r"sequence_length\(1\) <= 6"):
        rl.ctc_greedy_decoder(logits, np.array([6, 7], np.int32))
    with pytest.raises(InvalidArgumentError, match="inputs is not a 3-Tensor"):
        rl.ctc_greedy_decoder(logits[0], np.array([6, 7], np.int32))


def test_kernel_exceptions_live_in_errors():
    import readerlib.kernels as k
    assert k.FailedPreconditionError is FailedPreconditionError
    assert k.InvalidArgumentError is InvalidArgumentError
    assert FailedPreconditionError.__module__ == "readerlib.errors"


@pytest.mark.parametrize("make, exc, words", [
    (lambda r: r.batch(2 ** 62), MemoryError, ["BatchReader", "batch_size=4611686018427387904"]),
    (lambda r: r.global_shuffle(seed=0, window_chunks=2 ** 40), ValueError,
     ["window_chunks must be <= 1073741824, got 1099511627776"]),
    (lambda r: r[2 ** 70], IndexError, ["ArrayReader index 1180591620717411303424 out of range for 10"]),
    (lambda r: r.read_many([3, -2 ** 70]), IndexError, ["out of range for 10 records"]),
])
def test_absurd_sizes_and_indices_are_named(make, exc, words):
    """Sizes and indices beyond what the C fields hold raise naming the
    argument and its value (they raised a bare MemoryError(), or OverflowError
    "Python int too large to convert to C long")."""
    r = rl.ArrayReader({"x": np.arange(10, dtype=np.int64)})
    with pytest.raises(exc) as e:
        make(r)
    assert all(w in str(e.value) for w in words), e.value
