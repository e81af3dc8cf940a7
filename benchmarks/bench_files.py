"""Benchmarks (b) open_files over 16 files and (c) TFRecord reading against tf.data.

    python benchmarks/bench_files.py [--quick] [--repeats R] [--dir DIR] [--out FILE]

(b) 16 TFRecord files of 64-byte records, open_files(...).batch(256) with 1
    and 2 worker threads, next to reading the same files one after another
    in the consumer thread (no pool).
(c) One TFRecord file of 64 B records and one of 64 KiB records, read to
    batches of 256 by readerlib and by tf.data.TFRecordDataset (several
    variants, the fastest is the peer), in the same run; ratios are
    readerlib / fastest tf.data.

The contenders of a table run interleaved, `--repeats` rounds (harness.py),
over files already in the page cache; best and median reported (ratios best / best and
median / median).  Machines here are shared and noisy: read the ratios.
"""
import os
import shutil
import tempfile

import harness
import numpy as np

import readerlib as rl
from readerlib import TFRecordReader, TFRecordWriter, open_files


def write_file(path, n, size, seed, compression=None):
    rng = np.random.default_rng(seed)
    with TFRecordWriter(path, compression=compression) as w:
        step = max(1, (8 << 20) // max(size, 1))
        for i in range(0, n, step):
            k = min(step, n - i)
            w.write_batch(rng.integers(0, 256, size=(k, size), dtype=np.uint8))
    return path


def best_all(fns, repeat):
    """{name: (best seconds, median seconds, records of the last pass)}, the contenders interleaved."""
    counts = {}

    def counted(name, fn):
        def run():
            counts[name] = fn()
        return run
    st = harness.interleaved({k: counted(k, f) for k, f in fns.items()}, repeat)
    return {k: (st[k].best, st[k].median, counts[k]) for k in fns}


def drain(reader):
    n = 0
    for (t,) in reader:
        n += t.data.shape[0] if not t.lod else len(t.lod[0]) - 1
    return n


def bench_open_files(d, n_files, per_file, repeat):
    paths = [write_file(os.path.join(d, f"part-{i:02d}.tfrecord"), per_file, 64, i) for i in range(n_files)]
    gz = [write_file(os.path.join(d, f"part-{i:02d}.tfrecord.gz"), per_file // 4, 64, i, "GZIP")
          for i in range(n_files)]
    schema = rl.Schema([rl.Field("x", "uint8", (64,))])
    for p in paths:
        TFRecordReader(p, schema=schema).__len__()            # index + page cache
    total = n_files * per_file
    rows = []

    def sequential():
        n = 0
        for p in paths:
            n += drain(TFRecordReader(p, schema=schema).batch(256))
        return n

    def pooled(files, threads, sch=schema):
        def run():
            with open_files(files, num_threads=threads, **({"schema": sch} if sch else {})) as r:
                return drain(r.batch(256))
        return run

    res = best_all({"files one after another, consumer thread (no pool)": sequential,
                    "open_files(16 files, num_threads=1).batch(256)": pooled(paths, 1),
                    "open_files(16 files, num_threads=2).batch(256)": pooled(paths, 2),
                    # the default schema (records as uint8 sequences, one copy into LoD form)
                    "open_files(16 files, num_threads=2).batch(256), uint8 LoD records":
                        pooled(paths, 2, None)}, repeat)
    rows = [(name, t, tm, n) for name, (t, tm, n) in res.items()]
    assert all(n == total for *_, n in rows), rows
    # GZIP files: the workers inflate, the part a pool can spread over cores
    for p in gz:
        TFRecordReader(p, schema=schema, compression="GZIP").__len__()

    def gz_sequential():
        return sum(drain(TFRecordReader(p, schema=schema, compression="GZIP").batch(256)) for p in gz)

    def gz_pooled(threads):
        def run():
            with open_files(gz, num_threads=threads, schema=schema) as r:
                return drain(r.batch(256))
        return run

    res = best_all({"GZIP files one after another, consumer thread (no pool)": gz_sequential,
                    "open_files(16 GZIP files, num_threads=1).batch(256)": gz_pooled(1),
                    "open_files(16 GZIP files, num_threads=2).batch(256)": gz_pooled(2)}, repeat)
    gz_rows = [(name, t, tm, n) for name, (t, tm, n) in res.items()]
    n = gz_rows[0][3]
    return rows, total * 64, gz_rows, n * 64


def bench_tf(path, n, size, repeat):
    import tensorflow as tf
    rows = []
    fixed = rl.Schema([rl.Field("x", "uint8", (size,))])
    TFRecordReader(path).__len__()

    def rl_lod():
        return drain(TFRecordReader(path).batch(256))

    def rl_fixed():
        return drain(TFRecordReader(path, schema=fixed).batch(256))

    def tf_iter(ds):
        def f():
            k = 0
            for b in ds:
                k += int(b.shape[0]) if b.shape.rank else 1
            return k
        return f

    variants = [
        ("tf.data TFRecordDataset().batch(256)", tf.data.TFRecordDataset(path).batch(256)),
        ("tf.data TFRecordDataset(buffer_size=8MiB).batch(256).prefetch(AUTOTUNE)",
         tf.data.TFRecordDataset(path, buffer_size=8 << 20).batch(256).prefetch(tf.data.AUTOTUNE)),
    ]
    if size >= 4096:     # per-record variants: ~50x slower than batched on 64 B records
        variants.append(("tf.data ... .map(decode_raw).batch(256).prefetch(AUTOTUNE)",
                         tf.data.TFRecordDataset(path, buffer_size=8 << 20)
                         .map(lambda x: tf.io.decode_raw(x, tf.uint8), num_parallel_calls=tf.data.AUTOTUNE)
                         .batch(256).prefetch(tf.data.AUTOTUNE)))
        variants.append(("tf.data TFRecordDataset() per record", tf.data.TFRecordDataset(path)))
    fns = {"readerlib TFRecordReader().batch(256) (uint8 LoD)": rl_lod,
           "readerlib TFRecordReader(schema=uint8[size]).batch(256)": rl_fixed}
    fns.update((name, tf_iter(ds)) for name, ds in variants)
    for name, (t, tm, k) in best_all(fns, repeat).items():
        assert k == n, (name, k, n)
        rows.append(("rl" if name.startswith("readerlib") else "tf", name, t, tm))
    return rows


def main(argv=None):
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--dir", default=None, help="where to write the data (default: a temp dir)")
    args = harness.parse(ap, argv)
    d = args.dir or tempfile.mkdtemp(prefix="rl_bench_files_")
    os.makedirs(d, exist_ok=True)
    scale = 0.004 if args.quick else 1.0
    rep = harness.Report(args, "open_files and TFRecord (benchmarks (b) and (c))")
    out = rep.add
    try:
        with rep:
            copy = harness.copy_bandwidth(16 << 20 if args.quick else 256 << 20, args.repeats)
            out(harness.bounds_line(copy) + " (page cache reads are bounded by memcpy)")
            out()
            per_file = max(100, int(125_000 * scale))
            rows, nbytes, gz_rows, gz_bytes = bench_open_files(d, 16, per_file, args.repeats)
            out(f"#### (b) open_files over 16 TFRecord files, {16 * per_file} records of 64 B "
                f"(fixed schema uint8[64] unless noted)")
            out()
            out("| chain | s (best / median) | records/s (best) | payload GB/s (best) "
                "| vs no pool (best / median) |")
            out("|---|---:|---:|---:|---:|")
            base, basem = rows[0][1], rows[0][2]
            for name, t, tm, n in rows:
                out(f"| {name} | {t:.3f} / {tm:.3f} | {n / t / 1e6:.2f} M | {nbytes / t / 1e9:.2f} | "
                    f"{base / t:.2f}x / {basem / tm:.2f}x |")
            base, basem = gz_rows[0][1], gz_rows[0][2]
            for name, t, tm, n in gz_rows:
                out(f"| {name} ({n} records) | {t:.3f} / {tm:.3f} | {n / t / 1e6:.2f} M | "
                    f"{gz_bytes / t / 1e9:.2f} | {base / t:.2f}x / {basem / tm:.2f}x |")
            out()
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)

            tf = harness.try_import("tensorflow") if harness.want(args, "tf") else None
            if tf is None:
                out("tensorflow not run: (c) skipped.")
            else:
                out(f"#### (c) TFRecord read throughput against tf.data (TensorFlow {tf.__version__})")
                out()
                out("| records | reader | s (best / median) | records/s (best) | payload GB/s (best) |")
                out("|---|---|---:|---:|---:|")
                summary = []
                for size, n, target in [(64, max(1000, int(2_000_000 * scale)), 10),
                                        (65536, max(16, int(4000 * scale)), 3)]:
                    path = write_file(os.path.join(d, f"r{size}.tfrecord"), n, size, 99)
                    rows = bench_tf(path, n, size, args.repeats)
                    for kind, name, t, tm in rows:
                        out(f"| {n} x {size} B | {name} | {t:.3f} / {tm:.3f} | {n / t / 1e6:.3f} M | "
                            f"{n * size / t / 1e9:.2f} |")
                    # the peer: the tf.data variant fastest at its best (its median beside it)
                    _, _, tf_b, tf_m = min((r for r in rows if r[0] == "tf"), key=lambda r: r[2])
                    (_, _, lod_b, lod_m), (_, _, fix_b, fix_m) = rows[0], rows[1]
                    summary.append((size, tf_b / lod_b, tf_m / lod_m, tf_b / fix_b, tf_m / fix_m, target))
                    os.unlink(path)
                out()
                out("| records | readerlib / fastest tf.data (uint8 LoD), best / median "
                    "| (fixed schema), best / median | target |")
                out("|---|---:|---:|---:|")
                for size, lod_b, lod_m, fix_b, fix_m, target in summary:
                    out(f"| {size} B | {lod_b:.1f}x / {lod_m:.1f}x | {fix_b:.1f}x / {fix_m:.1f}x | >= {target}x |")
                out()
    finally:
        if not args.dir:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
