"""readerlib files on Ray Data (readerlib.integrations.ray, issue 17).

One local cluster for the module (2 CPUs, loopback, small object store),
shut down at the end.  Records carry their index in an ``id`` field, so
exactly-once is a check that the ids read are 0..N-1, each once; bit-for-bit
is a comparison of every instance with what was written.
"""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")

import readerlib as rl  # noqa: E402
import readerlib.integrations.ray as rlray  # noqa: E402

from helpers import canon  # noqa: E402

SCHEMA = rl.Schema([rl.Field("id", "int64"),
                    rl.Field("x", "float32", (2, 3)),
                    rl.Field("flag", "bool"),
                    rl.Field("seq", "int16", (2,), lod_level=1),
                    rl.Field("tok", "uint8", lod_level=1)])


def instance(k):
    """Record k: every field derived from k (sequence lengths 0..6)."""
    n = k % 7
    return (np.int64(k), np.arange(6, dtype=np.float32).reshape(2, 3) + k, np.bool_(k % 3 == 0),
            np.full((n, 2), k, np.int16) + np.arange(2, dtype=np.int16), (np.arange(k % 5) + k).astype(np.uint8))


def write_files(directory, sizes, chunk_size=4000, start=0):
    """RecordIO files holding `sizes[i]` consecutive records each; their paths."""
    os.makedirs(directory, exist_ok=True)
    paths, k = [], start
    for i, n in enumerate(sizes):
        p = os.path.join(directory, f"part-{i:03d}.rio")
        with rl.RecordIOWriter(p, SCHEMA, chunk_size=chunk_size) as w:
            for _ in range(n):
                w.write(instance(k))
                k += 1
        paths.append(p)
    return paths


def ids_of(ds):
    return np.sort(np.concatenate([b["id"] for b in ds.iter_batches(batch_size=None, batch_format="numpy")]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Ray puts the driver's current directory on its workers' sys.path: started
    # from a source checkout, workers would import the uncompiled source tree
    # instead of the readerlib under test (CI runs from the checkout).
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray-cwd"))
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200_000_000,
                 log_to_driver=False, configure_logging=False)
    finally:
        os.chdir(here)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # the workers cannot import this test module: ship its helpers by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def files(tmp_path_factory, cluster):
    """Four files of very different sizes (1900 records)."""
    return write_files(str(tmp_path_factory.mktemp("rio")), [1000, 50, 600, 250])


N = 1900


# ---------------------------------------------------------------- arrow layout (no tasks)
def test_arrow_layout_round_trips_a_batch_without_copies():
    batch = next(iter(rl.ArrayReader(
        {f.name: [instance(k)[i] for k in range(40)] if f.lod_level else
         np.stack([instance(k)[i] for k in range(40)]) for i, f in enumerate(SCHEMA)},
        schema=SCHEMA).batch(40)))
    table = rlray.batch_to_arrow(batch, SCHEMA)
    assert table.schema == rlray.arrow_schema(SCHEMA)
    assert rlray.schema_from_arrow(table.schema) == SCHEMA
    assert pa.types.is_large_list(table.schema.field("seq").type)
    # the Arrow columns wrap the batch's buffers (zero copy), bool excepted
    seq = table.column("seq").chunk(0)
    assert np.shares_memory(seq.values.flatten().to_numpy(), batch[3].data)
    assert np.shares_memory(seq.offsets.to_numpy(), batch[3].lod[0])             # the LoD level itself
    assert np.shares_memory(table.column("id").chunk(0).to_numpy(), batch[0].data)
    x = table.column("x").chunk(0)                                               # Ray's tensor column
    assert np.shares_memory(x.to_numpy(), batch[1].data) and x.to_numpy().shape == (40, 2, 3)
    # and back: arrow_to_columns wraps the Arrow buffers, bool excepted
    back = rlray.arrow_to_columns(table, SCHEMA)
    assert np.shares_memory(back[3].data, batch[3].data) and np.shares_memory(back[1], batch[1].data)
    # a sliced table (offsets not starting at 0) converts back exactly
    for lo, hi in [(0, 40), (7, 23), (39, 40), (5, 5)]:
        cols = rlray.arrow_to_columns(table.slice(lo, hi - lo), SCHEMA)
        for k in range(lo, hi):
            want = instance(k)
            got = tuple(c.sequence(k - lo) if isinstance(c, rl.LoDTensor) else c[k - lo] for c in cols)
            assert canon(got) == canon(want)
    # inferred without the metadata
    bare = table.replace_schema_metadata(None)
    assert rlray.schema_from_arrow(bare.schema) == SCHEMA


def test_arrow_nulls_and_wrong_shapes_are_named():
    t = pa.table({"id": pa.array([1, None], pa.int64())})
    with pytest.raises(ValueError, match="'id'.*null"):
        rlray.arrow_to_columns(t, rl.Schema([rl.Field("id", "int64")]))
    t = pa.table({"s": pa.array([[1, 2], [3]], pa.large_list(pa.int32()))})
    with pytest.raises(ValueError, match="'s'.*shape"):
        rlray.arrow_to_columns(t, rl.Schema([rl.Field("s", "int32", (2,), lod_level=1)]))
    with pytest.raises(KeyError, match="'nope'"):
        rlray.arrow_to_columns(t, rl.Schema([rl.Field("nope", "int32")]))
    # casts: lossless ones pass, lossy ones are named
    t = pa.table({"v": pa.array([1, 2, 300], pa.int64())})
    (v,) = rlray.arrow_to_columns(t, rl.Schema([rl.Field("v", "int16")]))
    assert v.dtype == np.int16 and v.tolist() == [1, 2, 300]
    with pytest.raises(ValueError, match="'v'.*row 2"):
        rlray.arrow_to_columns(t, rl.Schema([rl.Field("v", "uint8")]))
    t = pa.table({"v": pa.array([1.0, 2.5])})
    with pytest.raises(ValueError, match="'v'.*row 1"):
        rlray.arrow_to_columns(t, rl.Schema([rl.Field("v", "int64")]))
    with pytest.raises(TypeError, match="'s'.*string"):
        rlray.schema_from_arrow(pa.schema([("s", pa.string())]))


# ----------------------------------------------------------------------- reading
def test_read_tasks_are_chunk_groups_balanced_by_bytes(files):
    src = rlray.RecordIODatasource(files)
    chunks = sum(rl.RecordIOReader(p).num_chunks for p in files)
    assert src.num_records == N
    # chunk bytes: from each file's first chunk (after its header) to its end
    sizes = sum(os.path.getsize(p) - int(rl.RecordIOReader(p).chunk_table()[0][0]) for p in files)
    biggest_chunk = max(np.diff(np.append(rl.RecordIOReader(p).chunk_table()[0], os.path.getsize(p))).max()
                        for p in files)
    for p in (1, 2, 3, 5, 16, chunks + 10):
        tasks = src.get_read_tasks(p)
        assert len(tasks) == min(p, chunks)
        assert sum(t.metadata.num_rows for t in tasks) == N
        assert sum(t.metadata.size_bytes for t in tasks) == sizes
        # by bytes, not by files: no task is more than one chunk over its share
        assert max(t.metadata.size_bytes for t in tasks) <= sizes / len(tasks) + biggest_chunk
    # with 3 tasks the 1000-record file (over half the bytes) is split between two (by chunks)
    t0, t1, _ = src.get_read_tasks(3)
    assert files[0] in t0.metadata.input_files and files[0] in t1.metadata.input_files
    # running each task's function directly: disjoint ids that together are all of them
    for p in (2, 5):
        seen = [np.concatenate([b.column("id").to_numpy() for b in t()]) for t in src.get_read_tasks(p)]
        allids = np.concatenate(seen)
        assert np.array_equal(np.sort(allids), np.arange(N))


@pytest.mark.parametrize("blocks", [1, 3, 7, 1000])
def test_every_record_exactly_once(files, blocks):
    ds = rlray.read_recordio(files, override_num_blocks=blocks)
    assert np.array_equal(ids_of(ds), np.arange(N))


class _Ctx:
    """A stand-in for the DataContext Ray hands get_read_tasks (only the block size)."""

    def __init__(self, target_max_block_size):
        self.target_max_block_size = target_max_block_size


def _ids_by_task(tasks):
    return [np.concatenate([b.column("id").to_numpy() for b in t()] or [np.zeros(0, np.int64)]) for t in tasks]


@pytest.mark.parametrize("layout", [[1900], [1000, 50, 600, 250], [5] * 12 + [1500], [300] * 6])
def test_ray_chosen_block_counts_make_a_task_per_file_or_per_target_block(tmp_path, layout):
    # Ray's own count (override_num_blocks not given) is sized for 200 blocks; a task
    # per 4 KB chunk would make the pass Ray's cost per task.  Capped like Ray's file
    # sources: one task per file, or per target_max_block_size bytes if that makes more.
    paths = write_files(str(tmp_path), layout)
    n = sum(layout)
    src = rlray.RecordIODatasource(paths, auto_tasks=True)
    chunks = sum(rl.RecordIOReader(p).num_chunks for p in paths)
    total = sum(t.metadata.size_bytes for t in src.get_read_tasks(1))
    assert chunks > 2 * len(paths)                      # so that a task per chunk would be many more
    for parallelism in (1, 3, 200, 10_000):
        for block in (128 << 20, total // 5, total // 40, 1):
            tasks = src.get_read_tasks(parallelism, data_context=_Ctx(block))
            want = min(parallelism, chunks, max(len(paths), -(-total // block)))
            assert len(tasks) == want, (parallelism, block)
            # still balanced by bytes (a big file split between tasks), every record once
            biggest = max(np.diff(np.append(rl.RecordIOReader(p).chunk_table()[0], os.path.getsize(p))).max()
                          for p in paths)
            assert max(t.metadata.size_bytes for t in tasks) <= total / len(tasks) + biggest
            seen = _ids_by_task(tasks)
            assert sum(len(s) for s in seen) == n == sum(t.metadata.num_rows for t in tasks)
            assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(n))
    # a count the caller asked for is not capped: one task per chunk at most
    asked = rlray.RecordIODatasource(paths)
    assert len(asked.get_read_tasks(10_000, data_context=_Ctx(128 << 20))) == chunks


def test_read_recordio_without_a_block_count_reads_a_task_per_file(files, cluster, monkeypatch):
    made = []                                            # read tasks per planning, in the driver
    plain = rlray.RecordIODatasource.get_read_tasks

    def counted(self, parallelism, *a, **k):
        tasks = plain(self, parallelism, *a, **k)
        made.append((parallelism, len(tasks)))
        return tasks
    monkeypatch.setattr(rlray.RecordIODatasource, "get_read_tasks", counted)
    two = files[:2]                                      # 1050 records, ~60 chunks
    assert np.array_equal(ids_of(rlray.read_recordio(two)), np.arange(1050))
    # Ray asks for more (2 x CPUs at least; 1 when it only plans), the files cap it
    assert any(asked > 2 for asked, _ in made) and all(got == min(asked, 2) for asked, got in made), made
    # asked for: honoured, as before
    made.clear()
    assert np.array_equal(ids_of(rlray.read_recordio(two, override_num_blocks=7)), np.arange(1050))
    assert (7, 7) in made and all(got == asked for asked, got in made), made


def test_tensor_columns_built_by_hand_match_rays_own():
    from ray.data.extensions import ArrowTensorArray
    for dtype, shape in [("float32", (3, 0)), ("int64", (0,)), ("float64", (2, 3)), ("bool", (4,)), ("uint8", (5,))]:
        for rows in (0, 1, 6):
            x = (np.arange(rows * int(np.prod(shape))) % 3).astype(dtype).reshape(rows, *shape)
            sch = rl.Schema([rl.Field("a", dtype, shape)])
            col = rlray.batch_to_arrow((rl.LoDTensor(x),), sch).column("a").chunk(0)
            ref = ArrowTensorArray.from_numpy(x)
            assert col.type == ref.type and col.equals(ref), (dtype, shape, rows)
            assert col.to_numpy().shape == x.shape and np.array_equal(col.to_numpy(), x)
            if rows and x.size and dtype != "bool":
                assert np.shares_memory(col.to_numpy(), x)      # no copy


def test_blocks_hold_the_records_bit_for_bit(files):
    ds = rlray.read_recordio(os.path.dirname(files[0]), override_num_blocks=3)
    assert ds.schema().names == list(SCHEMA.names)
    rows = ds.take(10)
    seen = 0
    for batch in rlray.iter_lod_batches(ds, 128, schema=SCHEMA):
        cols = [t.data if not t.lod else t for t in batch]
        for i in range(len(batch[0])):
            k = int(cols[0][i])
            got = tuple(c.sequence(i) if isinstance(c, rl.LoDTensor) else c[i] for c in cols)
            assert canon(got) == canon(instance(k))
            seen += 1
    assert seen == N
    # Ray's own row view: NumPy for fixed fields
    assert rows[0]["x"].shape == (2, 3) and rows[0]["x"].dtype == np.float32


def test_columns_and_a_checked_schema(files):
    ds = rlray.read_recordio(files, columns=["id", "seq"], override_num_blocks=2)
    assert ds.schema().names == ["id", "seq"]
    assert np.array_equal(ids_of(ds), np.arange(N))
    with pytest.raises(ValueError, match="no field 'nope'"):
        rlray.read_recordio(files, columns=["nope"])
    with pytest.raises(ValueError, match="differs"):
        rlray.read_recordio(files, schema=rl.Schema([rl.Field("id", "int64")]))


def test_relative_paths_work_in_tasks_run_elsewhere(tmp_path, cluster, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_files("rel", [120, 80])
    ds = rlray.read_recordio("rel/*.rio", override_num_blocks=2)
    assert np.array_equal(ids_of(ds), np.arange(200))
    out = rlray.write_recordio(ds, "out/part")
    assert all(os.path.isabs(p) and p.startswith(str(tmp_path / "out")) for p in out)
    assert sorted(int(i[0]) for p in out for i in rl.RecordIOReader(p)) == list(range(200))


def test_a_corrupted_chunk_raises_in_its_task_naming_file_and_offset(tmp_path, cluster):
    paths = write_files(str(tmp_path), [300, 300])
    offs, _ = rl.RecordIOReader(paths[1]).chunk_table()
    bad = int(offs[2]) + 32 + 40                     # inside chunk 2's body (after its 32-byte header)
    with open(paths[1], "r+b") as f:
        f.seek(bad)
        b = f.read(1)
        f.seek(bad)
        f.write(bytes([b[0] ^ 0x20]))
    # planning opens only headers and index footers: no error in the driver yet
    ds = rlray.read_recordio(paths, override_num_blocks=4)
    with pytest.raises(rl.RecordIOError) as e:
        ds.materialize()
    msg = str(e.value)
    assert paths[1] in msg and f"byte offset {int(offs[2]) + 32}" in msg
    assert "checksum" in msg
    assert "ReadRecordIO" in msg               # raised in the Ray read task, not in the driver


def test_read_tfrecord_by_index_chunks(tmp_path, cluster):
    paths = []
    k = 0
    for i, n in enumerate([3000, 500]):
        p = str(tmp_path / f"t{i}.tfrecord")
        with rl.TFRecordWriter(p) as w:
            for _ in range(n):
                w.write(np.int64(k).tobytes() + bytes(k % 11))
                k += 1
        paths.append(p)
    for blocks in (1, 4):
        ds = rlray.read_tfrecord(paths, override_num_blocks=blocks)
        recs = [np.asarray(r, np.uint8).tobytes() for b in ds.iter_batches(batch_size=None, batch_format="pyarrow")
                for r in b.column("data").to_pylist()]
        got = sorted(int(np.frombuffer(r[:8], np.int64)[0]) for r in recs)
        assert got == list(range(k))
        assert all(len(r) == 8 + int(np.frombuffer(r[:8], np.int64)[0]) % 11 for r in recs)


@pytest.mark.skipif(bool(os.environ.get("READERLIB_NUM_THREADS")), reason="READERLIB_NUM_THREADS is set")
def test_a_task_uses_the_cpus_ray_gave_it(cluster):
    # two 1-CPU tasks on a 2-core node must not each run 2 threads (oversubscribed
    # OpenMP regions spin: ~10x slower on a busy machine)
    @ray.remote(num_cpus=1)
    def threads():
        from readerlib._parallel import get_num_threads
        rlray._threads_for_this_task()
        return get_num_threads()
    assert ray.get(threads.remote()) == 1


def test_a_corrupted_tfrecord_names_file_and_offset(tmp_path, cluster):
    p = str(tmp_path / "c.tfrecord")
    with rl.TFRecordWriter(p) as w:
        for k in range(2000):
            w.write(bytes([k % 251]) * 100)
    bad = 1500 * (16 + 100) + 12 + 50                # inside record 1500's payload
    with open(p, "r+b") as f:
        f.seek(bad)
        b = f.read(1)
        f.seek(bad)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(rl.TFRecordError) as e:
        rlray.read_tfrecord(p, override_num_blocks=3).materialize()
    assert p in str(e.value) and f"corrupted record at {1500 * 116}" in str(e.value)


def test_a_read_task_called_outside_ray_starts_no_cluster(tmp_path):
    # run in a fresh interpreter: this module's cluster is up here
    paths = write_files(str(tmp_path), [30])
    code = ("import ray, readerlib.integrations.ray as rlray\n"
            f"tasks = rlray.RecordIODatasource({paths!r}).get_read_tasks(2)\n"
            "n = sum(b.num_rows for t in tasks for b in t())\n"
            "print(n, ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["30", "False"]


# ----------------------------------------------------------------------- writing
def test_write_then_read_back_bit_for_bit(files, tmp_path):
    ds = rlray.read_recordio(files, override_num_blocks=3)
    out = rlray.write_recordio(ds, str(tmp_path / "out" / "train"), records_per_file=400)
    assert out and all(os.path.exists(p) for p in out)
    assert not glob.glob(str(tmp_path / "out" / "*.tmp-*"))
    got = {}
    for p in out:
        r = rl.RecordIOReader(p)
        assert r.schema == SCHEMA and r.num_records <= 400
        for inst in r:
            got[int(inst[0])] = canon(inst)
    assert sorted(got) == list(range(N))
    assert all(got[k] == canon(instance(k)) for k in range(N))
    # and Ray reads them again
    assert np.array_equal(ids_of(rlray.read_recordio(out)), np.arange(N))


def test_write_a_native_ray_dataset(tmp_path, cluster):
    items = [{"id": k, "v": np.arange(3, dtype=np.float64) * k} for k in range(100)]
    ds = ray.data.from_items(items)
    out = rlray.write_recordio(ds, str(tmp_path / "n"),
                               schema=rl.Schema([rl.Field("id", "int64"), rl.Field("v", "float64", (3,))]))
    rows = sorted((int(i), v.tolist()) for p in out for i, v in rl.RecordIOReader(p))
    assert rows == [(k, [0.0, k, 2.0 * k]) for k in range(100)]
    # list columns (pandas-free, Arrow) infer a sequence field
    tbl = pa.table({"id": pa.array(range(10), pa.int64()),
                    "s": pa.array([list(range(k)) for k in range(10)], pa.list_(pa.int32()))})
    out = rlray.write_recordio(ray.data.from_arrow(tbl), str(tmp_path / "l"))
    r = rl.RecordIOReader(out[0])
    assert r.schema == rl.Schema([rl.Field("id", "int64"), rl.Field("s", "int32", lod_level=1)])
    assert sorted((int(i), s.tolist()) for p in out for i, s in rl.RecordIOReader(p)) == \
        [(k, list(range(k))) for k in range(10)]


class _KillOnce:
    """A sink hook that kills the write task's process (SIGKILL-like os._exit)
    after its first batch went into a temporary file, once per marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __call__(self, tmp_path):
        if not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(tmp_path)
            os._exit(9)


def _killing_sink(prefix, marker, records_per_file):
    hook = _KillOnce(marker)

    class KillingSink(rlray.RecordIODatasink):
        def _after_batch(self, tmp_path):
            hook(tmp_path)
    return KillingSink(prefix, records_per_file=records_per_file)


def test_a_task_killed_mid_write_leaves_no_final_file(files, tmp_path):
    ds = rlray.read_recordio(files[:1], override_num_blocks=1)
    marker = str(tmp_path / "killed")
    sink = _killing_sink(str(tmp_path / "w" / "part"), marker, records_per_file=200)
    with pytest.raises(Exception):
        ds.write_datasink(sink, ray_remote_args={"max_retries": 0})
    killed_tmp = open(marker).read()
    assert ".rio.tmp-" in killed_tmp
    # nothing under a final name; the killed attempt's temporary file is removed by the driver
    assert glob.glob(str(tmp_path / "w" / "*")) == []


def test_a_retried_killed_task_writes_every_record_once(files, tmp_path):
    ds = rlray.read_recordio(files[:2], override_num_blocks=2)
    marker = str(tmp_path / "killed")
    sink = _killing_sink(str(tmp_path / "w" / "part"), marker, records_per_file=300)
    ds.write_datasink(sink, ray_remote_args={"max_retries": 2})
    assert os.path.exists(marker)                      # one attempt did die
    left = sorted(glob.glob(str(tmp_path / "w" / "*")))
    assert left == sink.files and all(p.endswith(".rio") for p in left)
    ids = sorted(int(i[0]) for p in left for i in rl.RecordIOReader(p))
    assert ids == list(range(1050))


def test_a_failing_task_removes_its_files(files, tmp_path):
    ds = rlray.read_recordio(files[:1], override_num_blocks=1)

    class FailingSink(rlray.RecordIODatasink):
        n = 0

        def _after_batch(self, tmp_path):
            type(self).n += 1
            if type(self).n == 3:                      # after one complete file
                raise RuntimeError("preprocessing bug")
    with pytest.raises(Exception, match="preprocessing bug"):
        ds.write_datasink(FailingSink(str(tmp_path / "f" / "part"), records_per_file=100),
                          ray_remote_args={"max_retries": 0})
    assert glob.glob(str(tmp_path / "f" / "*")) == []


# ---------------------------------------------------------------------- training
@ray.remote(num_cpus=0)
class _Worker:
    """A Ray Train-like worker: consumes its shard with readerlib batches."""

    def __init__(self, rank):
        self.rank = rank

    def epoch(self, it, batch_size, **iter_args):
        ids = []
        for feats in rlray.iter_lod_batches(it, batch_size, **iter_args):
            ident, x, flag, seq, tok = feats
            assert not ident.lod and seq.lod and len(seq.lod[0]) == len(ident) + 1
            for i in range(len(ident)):
                k = int(ident.data[i])
                assert np.array_equal(seq.sequence(i), instance(k)[3])
                assert np.array_equal(x.data[i], instance(k)[1])
            ids.extend(int(v) for v in ident.data)
        return ids

    def open_files_shard(self, paths, world):
        # the other path: each rank reads its share of the files' chunks itself
        r = rl.open_files(paths, shard=(self.rank, world)).batch(100)
        return [int(v) for (ident, *_) in r for v in ident.data]


def test_streaming_split_workers_see_each_record_once_per_epoch(files):
    ds = rlray.read_recordio(files, override_num_blocks=4)
    world = 2
    its = ds.streaming_split(world, equal=False)
    workers = [_Worker.remote(r) for r in range(world)]
    for epoch in range(2):
        per_rank = ray.get([w.epoch.remote(it, 64) for w, it in zip(workers, its)])
        allids = [k for ids in per_rank for k in ids]
        assert sorted(allids) == list(range(N)), f"epoch {epoch}"
        assert all(per_rank)                          # both workers got data


def test_shuffled_epochs_are_exactly_once_in_a_new_order_each(files):
    # what a training job does: shuffle per epoch (Ray re-executes the dataset,
    # and the local shuffle buffer, for every epoch), each worker its split
    ds = rlray.read_recordio(files, override_num_blocks=4).randomize_block_order()
    world = 2
    its = ds.streaming_split(world, equal=True)
    workers = [_Worker.remote(r) for r in range(world)]
    epochs = []
    for epoch in range(3):
        per_rank = ray.get([w.epoch.remote(it, 64, local_shuffle_buffer_size=300) for w, it in zip(workers, its)])
        assert sorted(k for ids in per_rank for k in ids) == list(range(N)), f"epoch {epoch}"
        assert [len(ids) for ids in per_rank] == [N // world] * world      # equal=True: 950 each
        epochs.append(per_rank)
    # a different order every epoch, on every rank, and not file order
    for rank in range(world):
        orders = [tuple(e[rank]) for e in epochs]
        assert len(set(orders)) == 3, f"rank {rank}: an epoch repeated another's order"
        assert all(list(o) != sorted(o) for o in orders)


def test_open_files_shard_in_workers_is_exactly_once(files):
    world = 3
    workers = [_Worker.remote(r) for r in range(world)]
    per_rank = ray.get([w.open_files_shard.remote(files, world) for w in workers])
    assert sorted(k for ids in per_rank for k in ids) == list(range(N))
    assert all(per_rank)


# -------------------------------------------------------------------------- docs
def test_scale_out_doc_examples_run(tmp_path, cluster):
    """docs/scale_out.md's python blocks, as one script in a subprocess joined
    to this module's cluster (RAY_ADDRESS), with a time limit."""
    from test_docs import _available, code_blocks
    doc = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "scale_out.md")
    blocks = [code for req, code in code_blocks(doc) if req is None or _available(req)]
    assert len([req for req, _ in code_blocks(doc) if req is None]) >= 5
    script = tmp_path / "scale_out.py"
    script.write_text("\n\n".join(blocks) + "\nprint('DOC OK')\n")
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    try:
        out = subprocess.run([sys.executable, "-P", str(script)], cwd=str(tmp_path), env=env,
                             capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"docs/scale_out.md examples did not finish within 180 s\n{e.stderr}")
    assert out.returncode == 0, f"docs/scale_out.md examples failed:\n{out.stderr[-4000:]}"
    assert "DOC OK" in out.stdout


# ------------------------------------------------------------- Ray Train itself
_TRAIN_SCRIPT = r'''
import json, os, sys
import numpy as np
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
import readerlib.integrations.ray as rlray

files, out = json.loads(sys.argv[1]), sys.argv[2]
ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
ray.data.DataContext.get_current().enable_progress_bars = False


def train_loop_per_worker(config):
    import ray.train
    import torch.distributed as dist
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    assert dist.is_initialized() and dist.get_world_size() == world    # a real process group
    shard = ray.train.get_dataset_shard("train")
    epochs = []
    for epoch in range(config["epochs"]):
        ids = []
        for ident, x, flag, seq, tok in rlray.iter_lod_batches(shard, 64, local_shuffle_buffer_size=300):
            assert not ident.lod and len(seq.lod[0]) == len(ident) + 1
            for i, k in enumerate(ident.data.tolist()):           # the rows belong to their ids
                assert np.array_equal(seq.sequence(i), np.full((k % 7, 2), k, np.int16) + np.arange(2, dtype=np.int16))
                assert np.array_equal(x.data[i], np.arange(6, dtype=np.float32).reshape(2, 3) + k)
            padded, lengths = seq.to_padded(0)
            assert padded.shape[0] == len(ident) and (lengths == np.diff(seq.lod[0])).all()
            ids.extend(ident.data.tolist())
        epochs.append(ids)
        # every rank's count, summed through the process group (what a training step would all-reduce)
        t = __import__("torch").tensor([len(ids)])
        dist.all_reduce(t)
        assert int(t) == config["n"], (int(t), config["n"])
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
        json.dump(epochs, f)


ds = rlray.read_recordio(files, override_num_blocks=4).randomize_block_order()
result = TorchTrainer(train_loop_per_worker,
                      train_loop_config={"epochs": 2, "out": out, "n": 1900},
                      datasets={"train": ds},
                      scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                      run_config=RunConfig(storage_path=os.path.join(out, "store"), name="rl")).fit()
assert result.error is None, result.error
print("TRAIN OK")
'''


@pytest.mark.slow          # Ray Train's controller and worker actors: 20-60 s here
def test_ray_train_torch_workers_get_each_record_once_per_epoch(files, tmp_path, cluster):
    """TorchTrainer (2 workers, gloo process group) on read_recordio: in each
    epoch the workers' LoD batches hold every record exactly once between
    them, in a new order.  In a subprocess joined to this module's cluster,
    with a time limit (Ray Train starts a controller and worker actors)."""
    pytest.importorskip("ray.train.torch")
    import json
    script = tmp_path / "train.py"
    script.write_text(_TRAIN_SCRIPT)
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    try:
        out = subprocess.run([sys.executable, "-P", str(script), json.dumps(files), str(tmp_path)],
                             cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"TorchTrainer did not finish within 240 s\n{e.stderr}")
    assert out.returncode == 0 and "TRAIN OK" in out.stdout, out.stderr[-4000:]
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        ids = [k for rank in per_rank for k in rank[epoch]]
        assert sorted(ids) == list(range(N)), f"epoch {epoch}"
        assert all(rank[epoch] for rank in per_rank)
    assert all(rank[0] != rank[1] for rank in per_rank)        # the order changes between epochs
