"""Transformations benchmark (issue 14): what a map, map_batches, padding and
bucketing cost, side by side with the same chain without them and tf.data.

    python benchmarks/bench_transforms.py [--records N] [--seq-records N] [--repeats R] [--quick]
                                          [--peers tf] [--out FILE]

Cases (each timed R times, interleaved by harness.py so that a noisy neighbour hits every
case alike; best and median reported, ratios taken within the same run):

- 64 B records, file -> shuffle(10k) -> batch(256) -> NumPy (bench_core's chain),
  then the same with .map(identity) before the batch on 1 and 2 threads, and
  with .map_batches(identity) after it;
- tf.data on the same records: TFRecordDataset -> shuffle(10k) -> [map(identity,
  num_parallel_calls=AUTOTUNE)] -> batch(256) -> map(decode_raw) -> prefetch;
- a map whose function releases the GIL (a [T, 80] x [80, 80] float32 product
  per instance of the sequence data) on 1 and 2 threads;
- the sequence data of bench_core (lengths 50..500 x 80 float32): the fraction
  of padding in plain padded batches of 64 against bucketed ones.
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

import harness
import numpy as np

import readerlib as rl
from readerlib import bench

BUFFER, BATCH = 10_000, 256


def identity(x):
    return x


def count_batches(chain):
    n = 0
    t = time.perf_counter()
    for b in chain:
        n += len(b[0])
    return n, time.perf_counter() - t


def round_robin(cases, repeat):
    """{name: [records/s per round]}: the cases interleaved (harness.interleaved),
    each returning (records, seconds); the caller warms them up."""
    def sample(run):
        def f():
            n, dt = run()
            return harness.Sample(dt, n)
        return f
    st = harness.interleaved({k: sample(v) for k, v in cases.items()}, repeat, warmup=0)
    return {k: [v.units / t for t in v.seconds] for k, v in st.items()}


def tfdata_case(path_tf, with_map):
    import tensorflow as tf

    def run():
        ds = tf.data.TFRecordDataset(path_tf, buffer_size=8 << 20).shuffle(BUFFER, seed=0)
        if with_map:
            ds = ds.map(lambda x: x, num_parallel_calls=tf.data.AUTOTUNE)
        ds = (ds.batch(BATCH)
              .map(lambda x: tf.io.decode_raw(x, tf.uint8), num_parallel_calls=tf.data.AUTOTUNE)
              .prefetch(tf.data.AUTOTUNE))
        n = 0
        t = time.perf_counter()
        for b in ds.as_numpy_iterator():
            n += b.shape[0]
        return n, time.perf_counter() - t
    return run


def python_floor(n=300_000):
    """records/s of the least a per-record Python function costs here: one fresh
    64-byte array per instance (what a map hands the function), a tuple, the call."""
    fn = identity
    empty = np.empty
    u8 = np.uint8
    t = time.perf_counter()
    for _ in range(n):
        fn((empty(64, u8),))
    return n, time.perf_counter() - t


def small_cases(tmp, n_records, repeat, peers, floor_n=300_000):
    path = os.path.join(tmp, "small.rio")
    bench.make_dataset(path, "small", n_records)

    def chain(kind):
        def run():
            r = rl.RecordIOReader(path).shuffle(BUFFER, seed=0)
            if kind == "map1":
                r = r.map(identity)
            elif kind == "map2":
                r = r.map(identity, num_threads=2)
            r = r.batch(BATCH)
            if kind == "map_batches":
                r = r.map_batches(identity)
            try:
                return count_batches(r)
            finally:
                r.close()
        return run

    cases = {
        "chain": chain("plain"),
        "chain + map(identity), 1 thread": chain("map1"),
        "chain + map(identity), 2 threads": chain("map2"),
        "chain + map_batches(identity)": chain("map_batches"),
        "Python floor: fn((np.empty(64, uint8),)) in a loop, no chain": lambda: python_floor(floor_n),
    }
    if "tf" in peers and harness.try_import("tensorflow"):
        if True:
            import tensorflow as tf
            path_tf = os.path.join(tmp, "small.tfrecord")
            ntf = min(n_records, 1_000_000)
            with tf.io.TFRecordWriter(path_tf) as w:
                for (x,) in rl.RecordIOReader(path).take(ntf):
                    w.write(x.tobytes())
            cases["tf.data chain"] = tfdata_case(path_tf, False)
            cases["tf.data chain + map(identity, AUTOTUNE)"] = tfdata_case(path_tf, True)
    for run in cases.values():       # warm page cache, TF's graph building
        run()
    res = round_robin(cases, repeat)
    os.unlink(path)
    return res


def batch_cpu_cases(repeat, n_records=2_000_000):
    """Thread CPU time per batch of 256 x 64 B (in memory, no file), without and
    with map_batches(identity): robust to a busy machine, unlike wall time."""
    x = np.zeros((n_records, 64), np.uint8)

    def run(mb):
        r = rl.ArrayReader({"x": x}).shuffle(BUFFER, seed=0).batch(BATCH)
        if mb:
            r = r.map_batches(identity)
        n = 0
        t = time.thread_time()
        for b in r:
            n += 1
        return (time.thread_time() - t) / n * 1e6

    out = {"batch(256)": [], "batch(256).map_batches(identity)": []}
    for _ in range(repeat):
        out["batch(256)"].append(run(False))
        out["batch(256).map_batches(identity)"].append(run(True))
    return out


def cpu_cost_cases(repeat, peers, n_records=1_000_000):
    """CPU seconds (all threads of the process) per record, in memory (no file, no
    checksum threads): what each chain costs, which a busy machine does not
    change much -- unlike its wall-clock rate.  Not a throughput: tf.data's
    AUTOTUNE threads may turn up to a 2x lower CPU rate into the same wall rate
    on two cores."""
    x = np.random.default_rng(0).integers(0, 256, size=(n_records, 64), dtype=np.uint8)

    def ours(kind):
        def run():
            r = rl.ArrayReader({"x": x}).shuffle(BUFFER, seed=0)
            if kind == "map1":
                r = r.map(identity)
            elif kind == "map2":
                r = r.map(identity, num_threads=2)
            r = r.batch(BATCH)
            if kind == "map_batches":
                r = r.map_batches(identity)
            n = 0
            t = time.process_time()
            for b in r:
                n += len(b[0])
            return n, time.process_time() - t
        return run

    cases = {"chain": ours("plain"), "chain + map(identity), 1 thread": ours("map1"),
             "chain + map(identity), 2 threads": ours("map2"),
             "chain + map_batches(identity)": ours("map_batches")}
    if "tf" in peers and harness.try_import("tensorflow"):
        if True:
            import tensorflow as tf

            def tf_run():
                ds = (tf.data.Dataset.from_tensor_slices(x).shuffle(BUFFER, seed=0)
                      .map(lambda v: v, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)
                      .prefetch(tf.data.AUTOTUNE))
                n = 0
                t = time.process_time()
                for b in ds.as_numpy_iterator():
                    n += b.shape[0]
                return n, time.process_time() - t
            cases["tf.data from_tensor_slices + map(identity, AUTOTUNE)"] = tf_run
    for run in cases.values():
        run()
    return round_robin(cases, repeat)


def gil_free_cases(tmp, n_records, repeat):
    path = os.path.join(tmp, "seq.rio")
    bench.make_dataset(path, "seq", n_records)
    w = np.random.default_rng(0).standard_normal((80, 80)).astype(np.float32)

    def project(x):
        feats, label = x
        return feats @ w, label          # BLAS releases the GIL

    def chain(nt):
        def run():
            r = rl.RecordIOReader(path).map(project, num_threads=nt).batch(64)
            try:
                return count_batches(r)
            finally:
                r.close()
        return run

    cases = {"seq: map(feats @ W), 1 thread": chain(1), "seq: map(feats @ W), 2 threads": chain(2)}
    for run in cases.values():
        run()
    res = round_robin(cases, repeat)
    os.unlink(path)
    return res


def padding_cases(tmp, n_records):
    """Padding fraction and records/s of padded vs bucketed batches of the sequence data."""
    path = os.path.join(tmp, "seq.rio")
    bench.make_dataset(path, "seq", n_records)
    boundaries = list(range(100, 501, 50))            # 9 boundaries, 10 buckets of 50 steps
    chains = {
        "batch(64) (LoD, no padding)": lambda r: r.batch(64),
        "padded_batch(64)": lambda r: r.padded_batch(64),
        f"bucket_by_length({boundaries[0]}..{boundaries[-1]} step 50, 64 each)":
            lambda r: r.bucket_by_length(boundaries, [64] * (len(boundaries) + 1)),
        "bucket_by_length(same boundaries, max_tokens=64*275)":
            lambda r: r.bucket_by_length(boundaries, max_tokens=64 * 275),
    }
    rows = []
    for name, make in chains.items():
        r = make(rl.RecordIOReader(path).shuffle(BUFFER, seed=0))
        real = padded = n = batches = 0
        t = time.perf_counter()
        for b in r:
            batches += 1
            if len(b) == 3:                           # padded: feats [B, T, 80], label, feats_length
                lengths = b[2].data
                real += int(lengths.sum())
                padded += b[0].data.shape[0] * b[0].data.shape[1]
                n += len(lengths)
            else:
                real += b[0].data.shape[0]
                padded += b[0].data.shape[0]
                n += len(b[1].data)
        dt = time.perf_counter() - t
        r.close()
        rows.append((name, n, batches, real, padded, 1 - real / padded, n / dt))
    os.unlink(path)
    return rows


def main(argv=None):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--records", type=int, default=1_000_000, help="64 B records")
    ap.add_argument("--seq-records", type=int, default=4000)
    args = harness.parse(ap, argv)
    big = 1_000_000
    if args.quick:
        args.records, args.seq_records, big = 5000, 40, 5000
    peers = {p for p in ("tf",) if harness.want(args, p)}
    tmp = tempfile.mkdtemp(prefix="rl-bench-transforms-",
                           dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    report = harness.Report(args, "Transformations: map, map_batches, padding, bucketing")
    report.__enter__()
    lines = report.lines
    small = small_cases(tmp, args.records, args.repeats, peers, floor_n=min(300_000, big))
    cpu = batch_cpu_cases(args.repeats, n_records=2 * big)
    cost = cpu_cost_cases(args.repeats, peers, n_records=big)
    gil = gil_free_cases(tmp, args.seq_records, args.repeats)
    pad = padding_cases(tmp, args.seq_records)
    lines.append("")
    lines.append(f"###### {args.records:,} x 64 B records, file -> shuffle({BUFFER}) -> batch({BATCH})")
    lines.append("")
    lines.append("| chain | best rec/s | median rec/s | best / chain | median / chain |")
    lines.append("|---|---|---|---|---|")
    base_best, base_med = max(small["chain"]), statistics.median(small["chain"])
    for name, v in small.items():
        b, m = max(v), statistics.median(v)
        lines.append(f"| {name} | {b:,.0f} | {m:,.0f} | {b / base_best:.1%} | {m / base_med:.1%} |")
    if "tf.data chain + map(identity, AUTOTUNE)" in small:
        tfb = max(small["tf.data chain + map(identity, AUTOTUNE)"])
        tfm = statistics.median(small["tf.data chain + map(identity, AUTOTUNE)"])
        lines.append("")
        for name in ("chain + map(identity), 1 thread", "chain + map(identity), 2 threads"):
            lines.append(f"- {name} vs tf.data + map(identity, AUTOTUNE): {max(small[name]) / tfb:.1f}x "
                         f"(best), {statistics.median(small[name]) / tfm:.1f}x (median)")
    lines.append("")
    lines.append(f"###### CPU cost: records per CPU second, all threads ({big:,} x 64 B in memory "
                 "-> shuffle(10000) -> ... -> batch(256))")
    lines.append("")
    lines.append("| chain | best rec/CPU-s | median rec/CPU-s | best / chain | median / chain |")
    lines.append("|---|---|---|---|---|")
    c0, cm = max(cost["chain"]), statistics.median(cost["chain"])
    for name, v in cost.items():
        b, m = max(v), statistics.median(v)
        lines.append(f"| {name} | {b:,.0f} | {m:,.0f} | {b / c0:.1%} | {m / cm:.1%} |")
    lines.append("")
    lines.append(f"###### thread CPU time per batch (ArrayReader of {2 * big:,} x 64 B -> shuffle -> batch(256))")
    lines.append("")
    lines.append("| chain | best us/batch | median us/batch | cost vs batch(256), best | median |")
    lines.append("|---|---|---|---|---|")
    b0, m0 = min(cpu["batch(256)"]), statistics.median(cpu["batch(256)"])
    for name, v in cpu.items():
        b, m = min(v), statistics.median(v)
        lines.append(f"| {name} | {b:.2f} | {m:.2f} | {b / b0 - 1:+.1%} | {m / m0 - 1:+.1%} |")
    lines.append("")
    lines.append(f"###### map with a function that releases the GIL ({args.seq_records:,} sequences "
                 f"50..500 x 80 float32, file -> map(feats @ W) -> batch(64))")
    lines.append("")
    lines.append("| chain | best rec/s | median rec/s |")
    lines.append("|---|---|---|")
    for name, v in gil.items():
        lines.append(f"| {name} | {max(v):,.0f} | {statistics.median(v):,.0f} |")
    lines.append("")
    lines.append(f"###### padding: {args.seq_records:,} sequences 50..500 x 80 float32, "
                 f"file -> shuffle({BUFFER}) -> ...")
    lines.append("")
    lines.append("| batches | instances | batches | real rows | rows incl. padding | padding fraction | rec/s (one run) |")
    lines.append("|---|---|---|---|---|---|---|")
    for name, n, nb, real, padded, frac, rate in pad:
        lines.append(f"| {name} | {n:,} | {nb} | {real:,} | {padded:,} | {frac:.1%} | {rate:,.0f} |")
    lines.append("")
    report.__exit__(None, None, None)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
