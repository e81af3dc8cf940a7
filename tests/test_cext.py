"""The Cython extension point for maps (readerlib/transform.pxd): a user's
`cdef class` deriving from RecordTransform, built the way a user builds it
(cythonize against the readerlib under test, in a temp dir, in a subprocess
with a time limit), run by `.map(transform)`.

Built here: examples/normalize (int16 -> float32 normalisation, compared with
the same map in NumPy) and tests/cext/probe.pyx (a sequence output of another
length, a new field, error codes from output_rows and transform).
"""
import importlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import readerlib as rl
from readerlib import _parallel
from readerlib.transform import RecordTransform, TransformReader

from helpers import assert_checkpoint_equal, assert_exactly_once, canon, drain, unbatch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUILD_TIMEOUT = 600          # two small modules; the machine may be busy

MEAN = np.array([1.5, -2.0, 3.0, 0.25, 0.0, 100.0], np.float32)
STD = np.array([100.0, 200.0, 3.5, 1e4, 1.0, 0.3], np.float32)
D = len(MEAN)


def _build(src_dir, dst_dir, module):
    """Copy a user's extension folder and build it as a user would; import it."""
    shutil.copytree(src_dir, dst_dir, ignore=shutil.ignore_patterns("build", "*.c", "*.so"))
    env = dict(os.environ)              # conftest.py's PYTHONPATH: the readerlib under test
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                          cwd=dst_dir, env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    assert proc.returncode == 0, f"building {module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    sys.path.insert(0, str(dst_dir))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(dst_dir))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("cext")
    normalize = _build(os.path.join(ROOT, "examples", "normalize"), base / "normalize", "normalize")
    probe = _build(os.path.join(HERE, "cext"), base / "probe", "probe")
    yield normalize, probe
    for name in ("normalize", "probe"):
        sys.modules.pop(name, None)


@pytest.fixture
def normalize(built):
    return built[0]


@pytest.fixture
def probe(built):
    return built[1]


@pytest.fixture
def split_everything():
    """Every chunk is split over 4 threads (the pool's threshold lowered)."""
    old_min = _parallel._set_min_bytes_per_thread(1)
    old_n = rl.get_num_threads()
    rl.set_num_threads(4)
    _parallel._reset_backoff()
    try:
        yield
    finally:
        rl.set_num_threads(old_n)
        _parallel._set_min_bytes_per_thread(old_min)


SCHEMA = rl.Schema([rl.Field("feats", np.int16, (D,), lod_level=1), rl.Field("label", np.int64)])


def make_data(n, seed=0, max_len=40):
    rng = np.random.default_rng(seed)
    feats = [rng.integers(-32768, 32768, size=(int(rng.integers(0, max_len)), D), dtype=np.int16)
             for _ in range(n)]
    return {"feats": feats, "label": np.arange(n, dtype=np.int64)}


def python_map(normalize):
    def fn(x):
        return normalize.normalize_numpy(x, SCHEMA.names, "feats", MEAN, STD)
    return fn


def reference(normalize, cols):
    fn = python_map(normalize)
    return [canon(fn((f, np.int64(l)))) for f, l in zip(cols["feats"], cols["label"])]


# -- results: the same as the map written in NumPy -------------------------------------------

def test_normalize_equals_numpy_map_serial(normalize):
    cols = make_data(500)
    r = rl.ArrayReader(cols, schema=SCHEMA).map(normalize.Normalize("feats", MEAN, STD), num_threads=1)
    assert isinstance(r, TransformReader)
    assert r.schema == rl.Schema([rl.Field("feats", np.float32, (D,), lod_level=1),
                                  rl.Field("label", np.int64)])
    got = [canon(x) for x in drain(r)]
    assert got == reference(normalize, cols)          # bitwise, in order


@pytest.mark.parametrize("num_threads", [None, 1, 2, 3, 4])
def test_normalize_same_for_any_thread_count(normalize, split_everything, num_threads):
    cols = make_data(6000, seed=1)          # > one chunk (4096 records): chunk boundaries too
    r = rl.ArrayReader(cols, schema=SCHEMA).map(normalize.Normalize("feats", MEAN, STD),
                                                num_threads=num_threads)
    got = [canon(x) for x in drain(r)]
    assert got == reference(normalize, cols)
    if _parallel.threads_enabled() and num_threads != 1:
        assert _parallel._pool_workers() >= 1      # the chunks went to the pool


def test_chain_equals_python_map_chain_batches_and_exactly_once(normalize, split_everything):
    cols = make_data(700, seed=2)

    def chain(fn):
        return rl.ArrayReader(cols, schema=SCHEMA).shuffle(128, seed=7).map(fn).batch(32)

    c = chain(normalize.Normalize("feats", MEAN, STD))
    p = chain(python_map(normalize))
    orders = []
    for _ in range(2):                                    # two epochs: new order each, same in both
        c.reset()
        p.reset()
        got, want = drain(c), drain(p)
        assert len(got) == len(want) == -(-700 // 32)
        for gb, wb in zip(got, want):
            assert [canon(i) for i in unbatch(gb)] == [canon(i) for i in unbatch(wb)]
        assert_exactly_once([canon(i) for b in got for i in unbatch(b)], reference(normalize, cols))
        orders.append([int(v) for b in got for v in b[1].data])
    assert orders[0] != orders[1]


def test_checkpoint_resume(normalize):
    cols = make_data(60, seed=3)
    assert_checkpoint_equal(
        lambda: rl.ArrayReader(cols, schema=SCHEMA).shuffle(16, seed=1)
        .map(normalize.Normalize("feats", MEAN, STD)).batch(7))


def test_fixed_field_and_bare_tfrecord_input(normalize, tmp_path):
    # a fixed [D] int16 field (rows of 1) ...
    rng = np.random.default_rng(4)
    x = rng.integers(-32768, 32768, size=(300, D), dtype=np.int16)
    sch = rl.Schema([rl.Field("x", np.int16, (D,))])
    got = [canon(v) for v in drain(rl.ArrayReader({"x": x}, schema=sch)
                                   .map(normalize.Normalize("x", MEAN, STD)))]
    want = [canon(((v.astype(np.float32) - MEAN) * (np.float32(1) / STD),)) for v in x]
    assert got == want
    # ... and TFRecord records that are the rows alone (layout.bare)
    cols = make_data(200, seed=5)
    path = tmp_path / "f.tfrecord"
    with rl.TFRecordWriter(path) as w:
        for f in cols["feats"]:
            w.write(f.tobytes())
    sch = rl.Schema([rl.Field("feats", np.int16, (D,), lod_level=1)])
    r = rl.TFRecordReader(path, schema=sch).map(normalize.Normalize("feats", MEAN, STD))
    got = [canon(v) for v in drain(r)]
    want = [canon(((f.astype(np.float32) - MEAN) * (np.float32(1) / STD),)) for f in cols["feats"]]
    assert got == want


def test_transform_py_matches(normalize):
    t = normalize.Normalize("feats", MEAN, STD)
    t.bind(SCHEMA)
    f = np.arange(3 * D, dtype=np.int16).reshape(3, D) - 5
    out = t.transform_py((f, np.int64(4)))
    assert canon(out) == canon(python_map(normalize)((f, np.int64(4))))


# -- a sequence output of another length, a new field ----------------------------------------

def test_output_rows_override_and_new_field(probe, split_everything):
    cols = make_data(3000, seed=6)
    # no empty instance, no first byte 0x7f: the probe's error cases
    cols["feats"] = [(f % 100).astype(np.int16) if len(f) else np.ones((1, D), np.int16)
                     for f in cols["feats"]]
    r = rl.ArrayReader(cols, schema=SCHEMA).map(probe.Subsample(3))
    assert r.schema.names == ("frames", "n_in") or list(r.schema.names) == ["frames", "n_in"]
    got = drain(r)
    assert len(got) == 3000
    for (frames, n_in), f in zip(got, cols["feats"]):
        np.testing.assert_array_equal(frames, f[::3])
        assert int(n_in) == len(f)


# -- errors: file and index, reading on, clear refusals ---------------------------------------

def test_transform_error_names_file_and_index_and_reading_goes_on(normalize, tmp_path, split_everything):
    cols = make_data(400, seed=8)
    path = str(tmp_path / "feats.rio")
    with rl.RecordIOWriter(path, SCHEMA) as w:
        for f, l in zip(cols["feats"], cols["label"]):
            w.write((f, l))
    too_long = [i for i, f in enumerate(cols["feats"]) if len(f) > 30]
    assert 0 < len(too_long) < 400
    r = rl.RecordIOReader(path).map(normalize.Normalize("feats", MEAN, STD, max_rows=30))
    got, errors = [], []
    while True:
        try:
            item = r.read_next()
        except ValueError as e:
            errors.append(str(e))
            continue
        if item is None:
            break
        got.append(canon(item))
    assert len(errors) == len(too_long)
    first = errors[0]
    assert "max_rows=30" in first and f"instance {too_long[0]} " in first and "feats.rio" in first, first
    keep = [i for i in range(400) if i not in set(too_long)]
    assert got == [reference(normalize, cols)[i] for i in keep]      # the others, once, in order


def test_output_rows_and_transform_error_codes(probe):
    f = [np.ones((2, D), np.int16), np.zeros((0, D), np.int16), np.full((4, D), 0x7f, np.int16),
         np.ones((5, D), np.int16)]
    cols = {"feats": f, "label": np.arange(4, dtype=np.int64)}
    r = rl.ArrayReader(cols, schema=SCHEMA).map(probe.Subsample(2))
    assert len(r.read_next()[0]) == 1
    with pytest.raises(ValueError, match=r"an instance without rows \(code -5\) at instance 1 "):
        r.read_next()
    with pytest.raises(ValueError, match=r"a marked row \(code 9\) at instance 2 "):
        r.read_next()
    frames, n_in = r.read_next()
    assert len(frames) == 3 and int(n_in) == 5
    assert r.read_next() is None


def test_base_class_transform_is_refused_at_read():
    r = rl.ArrayReader(np.arange(3, dtype=np.int64)).map(RecordTransform())
    with pytest.raises(ValueError, match="transform is not implemented.*instance 0 "):
        r.read_next()


def test_schema_refusals(normalize):
    sch = rl.Schema([rl.Field("feats", np.float32, (D,), lod_level=1)])
    r = rl.ArrayReader({"feats": [np.zeros((2, D), np.float32)]}, schema=sch)
    with pytest.raises(TypeError, match="'feats' must be int16"):
        r.map(normalize.Normalize("feats", MEAN, STD))
    r = rl.ArrayReader(make_data(3), schema=SCHEMA)
    with pytest.raises(ValueError, match="no field 'audio'"):
        r.map(normalize.Normalize("audio", MEAN, STD))
    with pytest.raises(ValueError, match="last dimension"):
        r.map(normalize.Normalize("feats", MEAN[:2], STD[:2]))
    with pytest.raises(ValueError, match="std must be > 0"):
        normalize.Normalize("feats", MEAN, np.zeros(D))
    with pytest.raises(ValueError, match="num_threads"):
        r.map(normalize.Normalize("feats", MEAN, STD), num_threads=0)
    batches = rl.ArrayReader(make_data(3), schema=SCHEMA).batch(2)
    with pytest.raises(TypeError, match="instances"):
        batches.map(normalize.Normalize("feats", MEAN, STD))
    with pytest.raises(TypeError, match="RecordTransform"):
        TransformReader(r, lambda x: x)


def test_a_refused_bind_leaves_the_transform_as_it_was(normalize):
    t = normalize.Normalize("feats", MEAN, STD)
    cols = make_data(20, seed=9)
    r = rl.ArrayReader(cols, schema=SCHEMA).map(t)
    bad = rl.ArrayReader({"feats": [np.zeros((2, D), np.float32)]},
                         schema=rl.Schema([rl.Field("feats", np.float32, (D,), lod_level=1)]))
    with pytest.raises(TypeError):
        bad.map(t)
    assert t.input_schema == SCHEMA
    assert [canon(x) for x in drain(r)] == reference(normalize, cols)


def test_the_shipped_pxd_and_headers():
    assert os.path.isfile(os.path.join(rl.get_include(), "rl_core.h"))
    pkg = os.path.dirname(rl.__file__)
    assert os.path.isfile(os.path.join(pkg, "transform.pxd"))


def test_a_chain_with_a_compiled_map_pickles(normalize):
    # spawn DataLoader workers and Ray tasks get the chain pickled
    import pickle
    cols = make_data(50, seed=10)
    chain = rl.ArrayReader(cols, schema=SCHEMA).map(normalize.Normalize("feats", MEAN, STD, max_rows=100)).batch(8)
    other = pickle.loads(pickle.dumps(chain))
    assert isinstance(other.reader, TransformReader)
    assert other.reader.transform.max_rows == 100
    got = [canon(i) for b in drain(other) for i in unbatch(b)]
    assert got == [canon(i) for b in drain(chain) for i in unbatch(b)]
