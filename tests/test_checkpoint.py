"""Checkpoint/resume for every reader and chain shape (issue 6, item 6)."""
import numpy as np
import pytest

import readerlib as rl
from helpers import assert_checkpoint_equal

SEQ = rl.Schema([rl.Field("s", "float32", (2,), lod_level=1), rl.Field("y", "int64")])


def _cols(n=23):
    rng = np.random.default_rng(0)
    return {"s": [rng.random((int(k), 2), dtype=np.float32) for k in rng.integers(0, 4, n)],
            "y": np.arange(n)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    paths = []
    for i in range(3):
        p = str(d / f"f{i}.rio")
        with rl.RecordIOWriter(p, SEQ, chunk_size=96) as w:
            cols = _cols(11 + i)
            cols["y"] = cols["y"] + 100 * i
            w.write_batch(cols)
        paths.append(p)
    tf = str(d / "t.tfrecord")
    with rl.TFRecordWriter(tf) as w:
        for i in range(17):
            w.write(bytes([i]) * (i % 5))
    return {"rio": paths, "tfrecord": tf}


def _python_reader():
    cols = _cols(13)
    return rl.PythonReader(lambda: iter(zip(cols["s"], cols["y"])), SEQ)


CHAINS = {
    "array": lambda f: rl.ArrayReader(_cols(), schema=SEQ),
    "random": lambda f: rl.RandomDataGenerator(SEQ, 19, seed=4),
    "python": lambda f: _python_reader(),
    "recordio": lambda f: rl.RecordIOReader(f["rio"][0]),
    "tfrecord": lambda f: rl.TFRecordReader(f["tfrecord"]),
    "shuffle": lambda f: rl.ArrayReader(_cols(), schema=SEQ).shuffle(5, seed=1),
    "shuffle-no-seed": lambda f: rl.ArrayReader(_cols(), schema=SEQ).shuffle(5),
    "batch": lambda f: rl.RecordIOReader(f["rio"][1]).batch(4),
    "shuffle-batch-drop": lambda f: rl.RecordIOReader(f["rio"][1]).shuffle(6, seed=2).batch(4, drop_last=True),
    "multipass-shuffle-batch": lambda f: rl.ArrayReader(_cols(), schema=SEQ).shuffle(7, seed=3).batch(3)
                                           .multi_pass(2),
    "batch-multipass": lambda f: rl.ArrayReader(_cols(), schema=SEQ).shuffle(4, seed=3).multi_pass(3).batch(5),
    "shard": lambda f: rl.ArrayReader(_cols(), schema=SEQ).shuffle(6, seed=9).shard(3, 1).batch(2),
    "holder": lambda f: rl.ReaderHolder(rl.RecordIOReader(f["rio"][2]).shuffle(4, seed=5)),
    "prefetch": lambda f: rl.RecordIOReader(f["rio"][0]).shuffle(4, seed=6).batch(3).prefetch(2),
    "open_files": lambda f: rl.open_files(f["rio"], num_threads=2, shuffle_files=True, seed=7)
                              .shuffle(5, seed=8).batch(4),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_restore_at_every_position_yields_the_rest(name, files):
    # ("shuffle-no-seed": the seed drawn at construction travels in the state,
    # so a fresh chain, which draws another seed, still continues exactly.)
    chain = CHAINS[name]
    assert_checkpoint_equal(lambda: chain(files))


def test_state_is_small_and_json(files):
    import json
    c = rl.RecordIOReader(files["rio"][0]).shuffle(10_000, seed=0).batch(2)
    it = iter(c)
    next(it)
    s = json.dumps(c.get_state())
    assert len(s) < 1000


def test_state_of_another_chain_is_refused(files):
    a = rl.ArrayReader(np.arange(5)).shuffle(2, seed=0)
    b = rl.ArrayReader(np.arange(5)).batch(2)
    with pytest.raises(ValueError, match="does not fit"):
        b.set_state(a.get_state())
    with pytest.raises(ValueError, match="past the end"):
        st = a.get_state()
        st["position"] = 99
        rl.ArrayReader(np.arange(5)).shuffle(2, seed=0).set_state(st)
