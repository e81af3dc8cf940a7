"""Ray Data: readerlib's read_recordio against Ray Data's own readers (issue 17).

    python benchmarks/bench_ray.py [--quick] [--repeats 5] [--sizes 64,65536] [--big-mib 512]
                                   [--fixed-cost] [--out FILE]

The same records (64 B and 64 KiB of random bytes each), written as
  * RecordIO files (one field ``data``: uint8[size]) -> ``readerlib.integrations.ray.read_recordio``
  * TFRecord files of ``tf.train.Example`` (one bytes feature ``data``) -> ``ray.data.read_tfrecords``
  * ``.npy`` files (uint8 [n, size]) -> ``ray.data.read_numpy``
  * TFRecord files of the raw records -> ``readerlib.integrations.ray.read_tfrecord`` (fixed schema)
8 files of each, every reader with ``override_num_blocks=8``, on one local
cluster (``ray.init(num_cpus=2)``) started once for the whole run.  A pass is
building the Dataset and iterating all of it (``iter_batches(batch_size=None,
batch_format="pyarrow")``, as a training loop would) -- planning included.
Each reader runs one untimed pass first (worker start-up, TensorFlow import in
the workers), then `--repeats` timed rounds, the readers interleaved (harness.py); best and median are reported, and
ratios against ``read_tfrecords``: best to best, median to median, and the
median and best of the per-round ratios (a round times every reader once,
back to back, so a round's ratio is paired: both readers saw the same
machine).  The files are in the page cache.  The machine is shared: read
the ratios.

A row "Ray floor" is a source whose read tasks read nothing: each yields a
block of the same rows and bytes (uninitialised memory) -- what a pass costs
in Ray alone (planning, 8 tasks, the put into the object store, the driver's
iteration).  "Ray floor, real bytes" yields real bytes (filled once per
worker, 8 chunks a task like read_recordio's blocks): Ray's put then copies
real pages, not the zero page -- the lowest time any reader of real data can
reach here.  At 64 KiB two more rows leave the block count to Ray
(no ``override_num_blocks``).

In Ray 2.60 a pass shorter than about a second runs its read tasks one at a
time: the streaming executor's resource limits come from the autoscaling
coordinator's reply, which is empty when the executor starts, and are
refreshed once a second (``ResourceManager.GLOBAL_LIMITS_UPDATE_INTERVAL_S``).
Every reader here is measured under that rule (benchmarks/results/ray.md).
"""
import os
import platform
import shutil
import statistics
import tempfile
import time

import harness
import numpy as np

import readerlib as rl

FILES = 8


def example_bytes(payload):
    import tensorflow as tf
    return tf.train.Example(features=tf.train.Features(feature={
        "data": tf.train.Feature(bytes_list=tf.train.BytesList(value=[payload]))})).SerializeToString()


def write_all(root, n, size, seed=0):
    """The same n records of `size` bytes in four formats, FILES files each."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    schema = rl.Schema([rl.Field("data", "uint8", (size,))])
    out = {k: [] for k in ("rio", "tfex", "npy", "tfraw")}
    for d in out:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for i, part in enumerate(np.array_split(data, FILES)):
        p = os.path.join(root, "rio", f"part-{i}.rio")
        with rl.RecordIOWriter(p, schema) as w:
            w.write_batch({"data": part})
        out["rio"].append(p)
        p = os.path.join(root, "tfex", f"part-{i}.tfrecords")
        with rl.TFRecordWriter(p) as w:          # byte-compatible with tf.io.TFRecordWriter
            for rec in part:
                w.write(example_bytes(rec.tobytes()))
        out["tfex"].append(p)
        p = os.path.join(root, "npy", f"part-{i}.npy")
        np.save(p, part)
        out["npy"].append(p)
        p = os.path.join(root, "tfraw", f"part-{i}.tfrecord")
        with rl.TFRecordWriter(p) as w:
            w.write_batch(part)
        out["tfraw"].append(p)
    return out, schema


def floor_source(n, size, real=False):
    """A Ray Datasource of FILES tasks that read nothing: each yields one block of
    its share of the n rows (a uint8[size] column over uninitialised memory).

    `real`: the bytes are real (filled once per worker process and kept), in
    8 tensor chunks per task as read_recordio's 8 MiB batches make them --
    what Ray's put into the object store costs on real pages (uninitialised
    memory maps the zero page, which copies from cache), so the fastest any
    reader of real data can be here."""
    import pyarrow as pa
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class RayFloor(Datasource):
        def estimate_inmemory_data_size(self):
            return n * size

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            def read(rows):
                if real:
                    import sys
                    from ray.data.extensions import ArrowTensorArray
                    # per worker process, outside any module Ray pickles by value
                    cache = sys.__dict__.setdefault("_bench_ray_floor_buffers", {})
                    if (rows, size) not in cache:
                        cache[(rows, size)] = [np.full((k, size), 7, np.uint8)
                                               for k in np.diff(np.linspace(0, rows, 9).astype(int)) if k]
                    for buf in cache[(rows, size)]:
                        yield pa.table({"data": ArrowTensorArray.from_numpy(buf)})
                    return
                flat = pa.py_buffer(np.empty(rows * size, np.uint8))
                values = pa.Array.from_buffers(pa.uint8(), rows * size, [None, flat])
                yield pa.table({"data": pa.FixedSizeListArray.from_arrays(values, size)})
            return [ReadTask(lambda rows=len(part): read(rows),
                             BlockMetadata(num_rows=len(part), size_bytes=len(part) * size,
                                           input_files=None, exec_stats=None))
                    for part in np.array_split(np.arange(n), FILES)]
    return RayFloor()


def one_pass(make):
    t = time.perf_counter()
    ds = make()
    n = 0
    for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        n += b.num_rows
    return time.perf_counter() - t, n


def main(argv=None):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--sizes", default="64,65536", help="record sizes in bytes, comma-separated")
    ap.add_argument("--big-mib", type=int, default=512,
                    help="MiB of 64 KiB records (default 512: 8,000 records; a bigger set weighs Ray's "
                         "fixed cost per pass less)")
    ap.add_argument("--fixed-cost", action="store_true",
                    help="only time passes over 8 files of 10 records (Ray's fixed cost per pass)")
    args = harness.parse(ap, argv)
    args.repeat = args.repeats

    import ray
    import readerlib.integrations.ray as rlray
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=1_500_000_000,
             log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    # 64 B: 200k records (read_tfrecords parses ~6k Examples/s here); 64 KiB: 512 MiB, so
    # that Ray's fixed cost per pass (planning, scheduling 8 tasks: ~0.1 s) is not the figure
    count = {64: 2_000 if args.quick else 200_000, 64 << 10: 16 if args.quick else args.big_mib * 16}
    if args.fixed_cost:
        root = tempfile.mkdtemp(prefix="bench_ray_")
        try:
            paths, _ = write_all(root, 80, 64)
            make = lambda: rlray.read_recordio(paths["rio"], override_num_blocks=FILES)  # noqa: E731
            one_pass(make)
            ts = [one_pass(make)[0] for _ in range(10)]
            print(f"80-record pass, {FILES} tasks: best {min(ts):.3f} s, median {statistics.median(ts):.3f} s")
        finally:
            shutil.rmtree(root, ignore_errors=True)
            ray.shutdown()
        return
    cases = [(int(s), count.get(int(s), max(1, (13 << 20 if args.quick else 128 << 20) // int(s))))
             for s in args.sizes.split(",")]
    report = harness.Report(args, "Ray Data source")
    report.__enter__()
    copy = harness.copy_bandwidth(16 << 20 if args.quick else 256 << 20, args.repeats)
    lines = [harness.bounds_line(copy), "", f"###### Ray Data readers, {FILES} files each, override_num_blocks={FILES}, "
             f"ray.init(num_cpus=2), best / median of {args.repeat} passes (Ray {ray.__version__}, "
             f"pyarrow {__import__('pyarrow').__version__}, Python {platform.python_version()})",
             "", "| records | reader | best rec/s | median rec/s | best GB/s | median GB/s | "
             "vs read_tfrecords: best / median | per-round ratio: median (best) |",
             "|---|---|---|---|---|---|---|---|"]
    root = tempfile.mkdtemp(prefix="bench_ray_")
    try:
        for size, n in cases:
            paths, schema = write_all(os.path.join(root, str(size)), n, size)
            readers = [
                ("readerlib read_recordio", lambda: rlray.read_recordio(paths["rio"], override_num_blocks=FILES)),
                ("ray.data.read_tfrecords", lambda: ray.data.read_tfrecords(paths["tfex"], override_num_blocks=FILES)),
                ("ray.data.read_numpy", lambda: ray.data.read_numpy(paths["npy"], override_num_blocks=FILES)),
                ("readerlib read_tfrecord (raw records)",
                 lambda: rlray.read_tfrecord(paths["tfraw"], schema=schema, override_num_blocks=FILES)),
                ("Ray floor (tasks read nothing)",
                 lambda: ray.data.read_datasource(floor_source(n, size), override_num_blocks=FILES)),
                ("Ray floor, real bytes (tasks copy nothing)",
                 lambda: ray.data.read_datasource(floor_source(n, size, real=True), override_num_blocks=FILES)),
            ]
            if size >= 4096:
                # the block count left to Ray (read_tfrecords: one task per file; read_recordio:
                # one per file or per 128 MiB; before, one per chunk up to Ray's 200)
                readers += [
                    ("readerlib read_recordio, Ray's block count",
                     lambda: rlray.read_recordio(paths["rio"])),
                    ("ray.data.read_tfrecords, Ray's block count", lambda: ray.data.read_tfrecords(paths["tfex"])),
                ]
            def contender(name, make):
                def run():
                    t, got = one_pass(make)
                    assert got == n, (name, got, n)
                    return harness.Sample(t, got)
                return run
            # the warm-up pass: workers, imports, page cache
            st = harness.interleaved({name: contender(name, make) for name, make in readers}, args.repeat)
            times = {name: v.seconds for name, v in st.items()}
            for name, ts in times.items():
                print(f"{size} B  {name}: best {n / min(ts):,.0f} rec/s, median {n / statistics.median(ts):,.0f}",
                      flush=True)
            peer = times["ray.data.read_tfrecords"]
            label = f"{n:,} x {size if size < 1024 else str(size >> 10) + ' Ki'}B"
            for name, ts in times.items():
                best, med = min(ts), statistics.median(ts)
                paired = [p / t for p, t in zip(peer, ts)]       # round r of both readers
                lines.append(f"| {label} | {name} | {n / best:,.0f} | {n / med:,.0f} | {n * size / best / 1e9:.3f} | "
                             f"{n * size / med / 1e9:.3f} | {min(peer) / best:.1f}x / "
                             f"{statistics.median(peer) / med:.1f}x | "
                             f"{statistics.median(paired):.1f}x ({max(paired):.1f}x) |")
            shutil.rmtree(os.path.join(root, str(size)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()
    report.add(*lines)
    report.__exit__(None, None, None)


if __name__ == "__main__":
    main()
