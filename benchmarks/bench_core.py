"""Core chain benchmark (issue 2): file -> shuffle(10k) -> batch(256) -> NumPy.

Side by side in one run: readerlib, the same chain in plain Python, tf.data
(TFRecordDataset -> shuffle -> batch -> decode_raw) and a PyTorch DataLoader
over an in-memory tensor, when those are installed.  Also a memory copy of the
same size (this machine's ceiling) and the peak memory of one pass over a
2 GB file (in a subprocess).

    python benchmarks/bench_core.py [--scale S] [--only small,large,seq,memory] [--out FILE]

Prints a Markdown table; --out writes it to a file as well.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import readerlib as rl
from readerlib import bench

BUFFER, BATCH = 10_000, 256


def best_of(fn, repeat):
    """Best (records, seconds) of `repeat` runs (the machine is shared: noise only slows)."""
    best = None
    for _ in range(repeat):
        n, dt = fn()
        if best is None or dt < best[1]:
            best = (n, dt)
    return best


def copy_gbps(nbytes):
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    t = time.perf_counter()
    np.copyto(b, a)
    return nbytes / (time.perf_counter() - t) / 1e9


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
    return n, time.perf_counter() - t


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
    return n, time.perf_counter() - t


def fixed_case(kind, n_records, rec_bytes, tmp, repeat, rows, peers):
    path = os.path.join(tmp, f"{kind}.rio")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(n_records, rec_bytes), dtype=np.uint8)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec_bytes,))])) as w:
        w.write_batch({"x": x})
    payload = x.nbytes
    bench.time_readerlib(path)          # warm page cache
    n, dt = best_of(lambda: bench.time_readerlib(path), repeat)
    copy = copy_gbps(min(payload, 1 << 30))
    row = {"case": f"{kind}: {n_records:,} x {rec_bytes} B", "readerlib_rec_s": n / dt,
           "readerlib_GB_s": payload / dt / 1e9, "copy_GB_s": copy}
    if rec_bytes >= 32768:              # the speed side of the memory trade-off
        n2, dt2 = best_of(lambda: bench.time_readerlib(path, low_memory=False), repeat)
        rows.append({"case": f"{kind}: {n_records:,} x {rec_bytes} B, low_memory=False",
                     "readerlib_rec_s": n2 / dt2, "readerlib_GB_s": payload / dt2 / 1e9, "copy_GB_s": copy})
    limit = min(n_records, 400_000)
    schema = rl.RecordIOReader(path).schema
    pn, pdt = bench.time_python(path, schema, limit=limit)
    row["python_rec_s"] = pn / pdt
    if "tf" in peers:
        try:
            ntf = min(n_records, 1_000_000 if rec_bytes < 1024 else n_records)
            path_tf = os.path.join(tmp, f"{kind}.tfrecord")
            write_tfrecord(path_tf, x[:ntf])
            tfdata_run(path_tf, rec_bytes)
            tn, tdt = best_of(lambda: tfdata_run(path_tf, rec_bytes), max(1, repeat - 1))
            row["tf_rec_s"] = tn / tdt
            os.unlink(path_tf)
        except ImportError:
            pass
    if "torch" in peers:
        try:
            tn, tdt = best_of(lambda: torch_run(x[: min(n_records, 1_000_000)]), max(1, repeat - 1))
            row["torch_rec_s"] = tn / tdt
        except ImportError:
            pass
    os.unlink(path)
    rows.append(row)


def seq_case(n_records, tmp, repeat, rows):
    path = os.path.join(tmp, "seq.rio")
    schema, payload = bench.make_dataset(path, "seq", n_records)
    bench.time_readerlib(path)
    n, dt = best_of(lambda: bench.time_readerlib(path), repeat)
    pn, pdt = bench.time_python(path, schema)
    rows.append({"case": f"seq: {n_records:,} x (50..500 x 80 f32)", "readerlib_rec_s": n / dt,
                 "readerlib_GB_s": payload / dt / 1e9, "python_rec_s": pn / pdt,
                 "copy_GB_s": copy_gbps(min(payload, 1 << 30))})
    os.unlink(path)


MEMORY_CHILD = r"""
import sys, time, resource, readerlib as rl
path = sys.argv[1]
def status():
    d = {}
    for line in open('/proc/self/status'):
        k, v = line.split(':', 1)
        if k in ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile'):
            d[k] = int(v.split()[0]) / 1024
    return d
base = status()['VmRSS']
r = rl.RecordIOReader(path, low_memory=sys.argv[2] == "1").shuffle(10000, seed=0).batch(256)
peak_anon = peak_file = peak_rss = 0
n = 0
for i, (x,) in enumerate(r):
    n += len(x)
    if i % 4 == 0:
        s = status()
        peak_anon = max(peak_anon, s['RssAnon']); peak_file = max(peak_file, s['RssFile'])
        peak_rss = max(peak_rss, s['VmRSS'])
print(n, base, status()['VmHWM'], peak_rss, peak_anon, peak_file)
"""


def memory_case(tmp, gb, rows_out):
    rec = 65536
    n = int(gb * (1 << 30)) // rec
    path = os.path.join(tmp, "mem.rio")
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec,))])) as w:
        for s in range(0, n, 1024):
            w.write_batch({"x": rng.integers(0, 256, size=(min(1024, n - s), rec), dtype=np.uint8)})
    for low in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, path, low], capture_output=True, text=True,
                             check=True)
        cnt, base, hwm, peak_rss, peak_anon, peak_file = map(float, out.stdout.split())
        buffer_mb = BUFFER * rec / (1 << 20)
        rows_out.append({"file_GB": os.path.getsize(path) / 1e9, "records": int(cnt), "baseline_MB": base,
                         "peak_rss_MB": hwm, "peak_anon_MB": peak_anon, "peak_file_MB": peak_file,
                         "buffer_MB": buffer_mb, "limit_MB": buffer_mb + 64 + base,
                         "low_memory": low == "1"})
    os.unlink(path)


def fmt(v, unit=""):
    return "-" if v is None else f"{v:,.0f}{unit}" if v >= 100 else f"{v:.2f}{unit}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="small,large,seq,memory")
    p.add_argument("--peers", default="tf,torch")
    p.add_argument("--memory-gb", type=float, default=2.0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    only = a.only.split(",")
    peers = a.peers.split(",")
    rows, mem = [], []
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        if "small" in only:
            fixed_case("small", int(4_000_000 * a.scale), 64, tmp, a.repeat, rows, peers)
        if "large" in only:
            fixed_case("large", int(16_384 * a.scale), 65536, tmp, a.repeat, rows, peers)
        if "seq" in only:
            seq_case(int(4_000 * a.scale), tmp, a.repeat, rows)
        if "memory" in only:
            memory_case(tmp, a.memory_gb, mem)
    lines = ["| case | readerlib rec/s | readerlib GB/s | copy GB/s | plain Python rec/s | tf.data rec/s | "
             "torch DataLoader rec/s | vs Python | vs tf.data | vs torch |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rr = r["readerlib_rec_s"]
        ratio = lambda k: f"{rr / r[k]:.1f}x" if r.get(k) else "-"
        lines.append(f"| {r['case']} | {fmt(rr)} | {r['readerlib_GB_s']:.2f} | {r['copy_GB_s']:.2f} | "
                     f"{fmt(r.get('python_rec_s'))} | {fmt(r.get('tf_rec_s'))} | {fmt(r.get('torch_rec_s'))} | "
                     f"{ratio('python_rec_s')} | {ratio('tf_rec_s')} | {ratio('torch_rec_s')} |")
    if mem:
        lines += ["", "| pass over file | records | baseline RSS MB | peak RSS MB | peak anon MB | peak file-backed MB "
                  "| shuffle buffer MB | limit (buffer + 64 MB + baseline) |", "|---|---|---|---|---|---|---|---|"]
    for m in mem:
        lines += [f"| {m['file_GB']:.2f} GB, 64 KiB records, low_memory={m['low_memory']} | {m['records']:,} | "
                  f"{m['baseline_MB']:.0f} | "
                  f"{m['peak_rss_MB']:.0f} | {m['peak_anon_MB']:.0f} | {m['peak_file_MB']:.0f} | "
                  f"{m['buffer_MB']:.0f} | {m['limit_MB']:.0f} |"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
