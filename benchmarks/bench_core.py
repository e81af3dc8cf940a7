"""Core chain benchmark (issue 2): file -> shuffle(10k) -> batch(256) -> NumPy.

Side by side in one run: readerlib, the same chain in plain Python, tf.data
(TFRecordDataset -> shuffle -> batch -> decode_raw) and a PyTorch DataLoader
over an in-memory tensor, when those are installed.  Also a memory copy of the
same size (this machine's ceiling) and the peak memory of one pass over a
2 GB file (in a subprocess).

    python benchmarks/bench_core.py [--scale S] [--only small,large,seq,memory] [--memory-gb G]
                                    [--repeats R] [--quick] [--busy N] [--peers tf,torch] [--out FILE]

All contenders of a case run interleaved, --repeats rounds (harness.py);
best / median reported, ratios of best to best and median to median.
"""
import os
import tempfile
import time

import harness
import numpy as np

import readerlib as rl
from readerlib import bench

BUFFER, BATCH = 10_000, 256


def tfdata_run(path_tf, rec_bytes):
    import tensorflow as tf
    ds = (tf.data.TFRecordDataset(path_tf, buffer_size=8 << 20)
          .shuffle(BUFFER, seed=0)
          .batch(BATCH)
          .map(lambda x: tf.io.decode_raw(x, tf.uint8), num_parallel_calls=tf.data.AUTOTUNE)
          .prefetch(tf.data.AUTOTUNE))
    n = 0
    t = time.perf_counter()
    for b in ds.as_numpy_iterator():
        n += b.shape[0]
    return harness.Sample(time.perf_counter() - t, n)


def write_tfrecord(path_tf, x):
    import tensorflow as tf
    with tf.io.TFRecordWriter(path_tf) as w:
        for row in x:
            w.write(row.tobytes())


def torch_run(x):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    ds = TensorDataset(torch.from_numpy(x))
    g = torch.Generator().manual_seed(0)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=True, generator=g, num_workers=0)
    n = 0
    t = time.perf_counter()
    for (b,) in dl:
        n += b.shape[0]
    return harness.Sample(time.perf_counter() - t, n)


def timed(fn, *a, **kw):
    """A contender: ``fn`` returns (records, seconds)."""
    def run():
        n, dt = fn(*a, **kw)
        return harness.Sample(dt, n)
    return run


def fixed_case(kind, n_records, rec_bytes, tmp, args, rows, copy):
    path = os.path.join(tmp, f"{kind}.rio")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n_records, rec_bytes), dtype=np.uint8)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec_bytes,))])) as w:
        w.write_batch({"x": x})
    payload = x.nbytes
    limit = min(n_records, 400_000)
    schema = rl.RecordIOReader(path).schema
    contenders = {"readerlib": timed(bench.time_readerlib, path)}
    if rec_bytes >= 32768:              # the speed side of the memory trade-off
        contenders["low_memory=False"] = timed(bench.time_readerlib, path, low_memory=False)
    contenders["python"] = timed(bench.time_python, path, schema, limit=limit)
    if harness.want(args, "tf") and harness.try_import("tensorflow"):
        ntf = min(n_records, 1_000_000 if rec_bytes < 1024 else n_records)
        path_tf = os.path.join(tmp, f"{kind}.tfrecord")
        write_tfrecord(path_tf, x[:ntf])
        contenders["tf"] = lambda: tfdata_run(path_tf, rec_bytes)
    if harness.want(args, "torch") and harness.try_import("torch"):
        xt = x[: min(n_records, 1_000_000)]
        contenders["torch"] = lambda: torch_run(xt)
    st = harness.interleaved(contenders, args.repeats)   # the warm-up fills the page cache
    for name in ("readerlib", "low_memory=False"):
        if name not in st:
            continue
        s0 = st[name]
        row = {"case": f"{kind}: {n_records:,} x {rec_bytes} B" + (", low_memory=False" if name != "readerlib"
                                                                  else ""),
               "readerlib_rec_s": (s0.rate_best, s0.rate_median),
               "readerlib_GB_s": (payload / s0.best / 1e9, payload / s0.median / 1e9), "copy_GB_s": copy}
        if name == "readerlib":
            for peer, key in (("python", "python_rec_s"), ("tf", "tf_rec_s"), ("torch", "torch_rec_s")):
                if peer in st:
                    row[key] = (st[peer].rate_best, st[peer].rate_median)
        rows.append(row)
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))


def seq_case(n_records, tmp, args, rows, copy):
    path = os.path.join(tmp, "seq.rio")
    schema, payload = bench.make_dataset(path, "seq", n_records)
    st = harness.interleaved({"readerlib": timed(bench.time_readerlib, path),
                              "python": timed(bench.time_python, path, schema)}, args.repeats)
    s0 = st["readerlib"]
    rows.append({"case": f"seq: {n_records:,} x (50..500 x 80 f32)",
                 "readerlib_rec_s": (s0.rate_best, s0.rate_median),
                 "readerlib_GB_s": (payload / s0.best / 1e9, payload / s0.median / 1e9),
                 "python_rec_s": (st["python"].rate_best, st["python"].rate_median), "copy_GB_s": copy})
    os.unlink(path)


MEMORY_CHILD = r"""
import sys, readerlib as rl
path = sys.argv[1]
r = rl.RecordIOReader(path, low_memory=sys.argv[2] == "1").shuffle(10000, seed=0).batch(256)
peak_anon = peak_file = peak_rss = 0
n = 0
for i, (x,) in enumerate(r):
    n += len(x)
    if i % 4 == 0:
        s = rss_mb()
        peak_anon = max(peak_anon, s['RssAnon']); peak_file = max(peak_file, s['RssFile'])
        peak_rss = max(peak_rss, s['VmRSS'])
emit([n, peak_rss, peak_anon, peak_file])
"""


def memory_case(tmp, gb, rows_out):
    rec = 65536
    n = max(1, int(gb * (1 << 30)) // rec)
    path = os.path.join(tmp, "mem.rio")
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec,))])) as w:
        for s in range(0, n, 1024):
            w.write_batch({"x": rng.integers(0, 256, size=(min(1024, n - s), rec), dtype=np.uint8)})
    for low in ("1", "0"):
        (res,), peak = harness.run_child(MEMORY_CHILD, [path, low], timeout=1800)
        cnt, peak_rss, peak_anon, peak_file = res
        base = peak["baseline_MB"]
        buffer_mb = min(BUFFER, n) * rec / (1 << 20)
        rows_out.append({"file_GB": os.path.getsize(path) / 1e9, "records": int(cnt), "baseline_MB": base,
                         "peak_rss_MB": peak["peak_MB"], "peak_anon_MB": peak_anon, "peak_file_MB": peak_file,
                         "buffer_MB": buffer_mb, "limit_MB": buffer_mb + 64 + base,
                         "low_memory": low == "1"})
    os.unlink(path)


def fmt(v, unit=""):
    return "-" if v is None else f"{v:,.0f}{unit}" if v >= 100 else f"{v:.2f}{unit}"


def bm(pair, unit=""):
    """best / median"""
    return f"{fmt(pair[0], unit)} / {fmt(pair[1], unit)}"


def main(argv=None):
    p = harness.parser(__doc__, repeats=3)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--only", default="small,large,seq,memory")
    p.add_argument("--memory-gb", type=float, default=2.0)
    a = harness.parse(p, argv)
    if a.quick:
        a.scale, a.memory_gb = 0.005, 0.02
    only = a.only.split(",")
    rows, mem = [], []
    with harness.Report(a, "Core chain: file -> shuffle(10k) -> batch(256)") as rep:
        copy = harness.copy_bandwidth(16 << 20 if a.quick else 1 << 30, a.repeats)
        rep.add(harness.bounds_line(copy), "")
        with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
            if "small" in only:
                fixed_case("small", max(1000, int(4_000_000 * a.scale)), 64, tmp, a, rows, copy)
            if "large" in only:
                fixed_case("large", max(64, int(16_384 * a.scale)), 65536, tmp, a, rows, copy)
            if "seq" in only:
                seq_case(max(20, int(4_000 * a.scale)), tmp, a, rows, copy)
            if "memory" in only:
                memory_case(tmp, a.memory_gb, mem)
        body = []
        for r in rows:
            rr = r["readerlib_rec_s"]
            ratio = lambda k: f"{rr[0] / r[k][0]:.1f}x / {rr[1] / r[k][1]:.1f}x" if r.get(k) else "-"  # noqa
            opt = lambda k: bm(r[k]) if r.get(k) else "-"  # noqa
            body.append([r["case"], bm(rr), bm(r["readerlib_GB_s"]), f"{r['copy_GB_s']['copy']:.2f}",
                         opt("python_rec_s"), opt("tf_rec_s"), opt("torch_rec_s"),
                         ratio("python_rec_s"), ratio("tf_rec_s"), ratio("torch_rec_s")])
        if body:
            rep.table(["case", "readerlib rec/s (best / median)", "readerlib GB/s", "memcpy GB/s",
                       "plain Python rec/s", "tf.data rec/s", "torch DataLoader rec/s", "vs Python",
                       "vs tf.data", "vs torch"], body)
        if mem:
            rep.table(["pass over file", "records", "baseline RSS MB", "peak RSS MB", "peak anon MB",
                       "peak file-backed MB", "shuffle buffer MB", "limit (buffer + 64 MB + baseline)"],
                      [[f"{m['file_GB']:.2f} GB, 64 KiB records, low_memory={m['low_memory']}",
                        f"{m['records']:,}", f"{m['baseline_MB']:.0f}", f"{m['peak_rss_MB']:.0f}",
                        f"{m['peak_anon_MB']:.0f}", f"{m['peak_file_MB']:.0f}", f"{m['buffer_MB']:.0f}",
                        f"{m['limit_MB']:.0f}"] for m in mem])


if __name__ == "__main__":
    main()
