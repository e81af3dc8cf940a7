"""Scaling (issue 16 item 5): how the cost per record moves as the job grows.

    python benchmarks/bench_scaling.py [--repeats 3] [--only records,buffer,batch,threads,rss,startup]
                                       [--quick] [--busy N] [--peers tf,torch] [--out FILE]

Tables (each row's contenders interleaved, --repeats rounds, harness.py):

- records: 64 B records, source -> shuffle(10k) -> batch(256), 1e5, 1e6 and
  1e7 records, from a RecordIO file (page cache) and from memory
  (ArrayReader); ns per record, and each point against the smallest.
- buffer: the same chain over 2e6 records from memory, shuffle buffer 1k,
  10k, 100k, 1M.
- batch: 2e6 records from memory, shuffle(10k), batch 32, 256, 1024, 4096.
- threads: RecordIO file -> shuffle(10k) -> batch(256) with
  ``set_num_threads(1)`` and ``(2)``, 64 B records (2e6) and 64 KiB (4096).
- rss: peak RSS (VmHWM, a fresh process each) of one pass over 1e6 x 64 B
  records through shuffle(100k) -> batch(256): readerlib (RecordIO file)
  against tf.data (TFRecordDataset of the same records), each also after
  its import alone; readerlib again with shuffle(10k) and shuffle(1M).
- startup: wall time in a fresh interpreter from before ``import readerlib``
  (resp. tensorflow, torch) to the first batch of file -> shuffle(10k) ->
  batch(256) over 1e5 x 64 B records; tf.data reads a TFRecord file of them,
  the torch DataLoader a TensorDataset over an ``np.memmap`` of the raw bytes.

Files are written once per table into a temporary folder (at most ~0.7 GB)
and deleted after.  The memcpy and read bandwidth of this run are printed
beside the tables: a pass cannot beat memcpy of its payload.
"""
import os
import shutil
import tempfile
import time

import harness
import numpy as np

import readerlib as rl

REC = 64
BUFFER, BATCH = 10_000, 256


def write_recordio(path, n, rec=REC, step=1 << 20):
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec,))])) as w:
        for s in range(0, n, step):
            w.write_batch({"x": rng.integers(0, 256, size=(min(step, n - s), rec), dtype=np.uint8)})
    return path


def write_tfrecord(path, n, rec=REC, step=1 << 20):
    rng = np.random.default_rng(0)
    with rl.TFRecordWriter(path) as w:      # byte-compatible with tf.io.TFRecordWriter
        for s in range(0, n, step):
            w.write_batch(rng.integers(0, 256, size=(min(step, n - s), rec), dtype=np.uint8))
    return path


def drain(make):
    """A contender: one pass over the chain ``make()`` builds (construction not timed)."""
    def run():
        chain = make()
        n = 0
        t = time.perf_counter()
        for (x,) in chain:
            n += len(x)
        dt = time.perf_counter() - t
        chain.close()
        return harness.Sample(dt, n)
    return run


def ns(stats):
    return 1e9 / stats.rate_best, 1e9 / stats.rate_median


def rows_against_first(st, label):
    """Rows: label, ns/record best / median, spread, best against the first contender's best."""
    first = next(iter(st.values()))
    out = []
    for k, v in st.items():
        b, m = ns(v)
        out.append([label(k), f"{b:.1f}", f"{m:.1f}", f"{v.spread:.0%}", f"{b / ns(first)[0]:.2f}x"])
    return out


HEAD = ["ns per record: best", "median", "spread", "time per record, best / first row's"]


def records_table(rep, args, tmp, sizes):
    arrays = {}
    rows = []
    for n in sizes:
        path = write_recordio(os.path.join(tmp, f"r{n}.rio"), n)
        x = np.random.default_rng(0).integers(0, 256, size=(n, REC), dtype=np.uint8)
        st = harness.interleaved({
            ("file", n): drain(lambda: rl.RecordIOReader(path).shuffle(BUFFER, seed=0).batch(BATCH)),
            ("memory", n): drain(lambda: rl.ArrayReader({"x": x}).shuffle(BUFFER, seed=0).batch(BATCH)),
        }, args.repeats)
        arrays.update(st)
        os.unlink(path)
        del x
    for src in ("file", "memory"):
        first = arrays[(src, sizes[0])]
        for n in sizes:
            v = arrays[(src, n)]
            b, m = ns(v)
            rows.append([f"{'RecordIO file' if src == 'file' else 'ArrayReader (memory)'}, {n:,} records",
                         f"{b:.1f}", f"{m:.1f}", f"{v.spread:.0%}", f"{b / ns(first)[0]:.2f}x"])
    rep.table(["64 B records -> shuffle(10k) -> batch(256)"] + HEAD, rows,
              title="#### Records: 1e5 -> 1e7 (each size's file and memory rounds interleaved)")


def buffer_table(rep, args, n, buffers):
    x = np.random.default_rng(0).integers(0, 256, size=(n, REC), dtype=np.uint8)
    st = harness.interleaved({b: drain(lambda b=b: rl.ArrayReader({"x": x}).shuffle(b, seed=0).batch(BATCH))
                              for b in buffers}, args.repeats)
    rep.table([f"ArrayReader ({n:,} x 64 B) -> shuffle(B) -> batch(256)"] + HEAD,
              rows_against_first(st, lambda b: f"shuffle buffer {b:,}"),
              title="#### Shuffle buffer: 1k -> 1M (interleaved)")


def batch_table(rep, args, n, batches):
    x = np.random.default_rng(0).integers(0, 256, size=(n, REC), dtype=np.uint8)
    st = harness.interleaved({b: drain(lambda b=b: rl.ArrayReader({"x": x}).shuffle(BUFFER, seed=0).batch(b))
                              for b in batches}, args.repeats)
    rep.table([f"ArrayReader ({n:,} x 64 B) -> shuffle(10k) -> batch(B)"] + HEAD,
              rows_against_first(st, lambda b: f"batch {b:,}"),
              title="#### Batch: 32 -> 4096 (interleaved)")


def threads_table(rep, args, tmp, cases):
    rows = []
    default = rl.get_num_threads()
    for rec, n in cases:
        path = write_recordio(os.path.join(tmp, f"t{rec}.rio"), n, rec, step=max(1, (64 << 20) // rec))

        def on(t):
            def make():
                rl.set_num_threads(t)
                return rl.RecordIOReader(path).shuffle(BUFFER, seed=0).batch(BATCH)
            return drain(make)
        try:
            st = harness.interleaved({1: on(1), 2: on(2)}, args.repeats)
        finally:
            rl.set_num_threads(default)
        os.unlink(path)
        for t, v in st.items():
            b, m = ns(v)
            rows.append([f"{n:,} x {rec if rec < 1024 else str(rec >> 10) + ' Ki'}B, {t} thread(s)",
                         f"{b:.1f}", f"{m:.1f}", f"{v.spread:.0%}", f"{b / ns(st[1])[0]:.2f}x",
                         f"{n * rec / v.best / 1e9:.2f}"])
    rep.table(["RecordIO file -> shuffle(10k) -> batch(256)"] + HEAD + ["GB/s (best)"], rows,
              title=f"#### Threads: 1 -> 2 (`set_num_threads`; default here {default}; interleaved)")


RSS_RL = r"""
import sys, readerlib as rl
after_import = rss_mb()["VmRSS"]
r = rl.RecordIOReader(sys.argv[1]).shuffle(int(sys.argv[2]), seed=0).batch(256)
n = 0
for (x,) in r:
    n += len(x)
emit([n, after_import])
"""

RSS_TF = r"""
import sys
import tensorflow as tf
after_import = rss_mb()["VmRSS"]
ds = (tf.data.TFRecordDataset(sys.argv[1]).shuffle(int(sys.argv[2]), seed=0).batch(256)
      .map(lambda x: tf.io.decode_raw(x, tf.uint8)))
n = 0
for b in ds.as_numpy_iterator():
    n += b.shape[0]
emit([n, after_import])
"""


def rss_table(rep, args, tmp, n, buffer):
    rio = write_recordio(os.path.join(tmp, "rss.rio"), n)
    name_rl = "readerlib RecordIOReader.shuffle.batch"
    children = {(name_rl, buffer): (RSS_RL, rio)}
    if harness.want(args, "tf"):
        children[("tf.data TFRecordDataset.shuffle.batch.map(decode_raw)", buffer)] = (
            RSS_TF, write_tfrecord(os.path.join(tmp, "rss.tfrecord"), n))
    for b in (buffer // 10, min(10 * buffer, n)):   # how readerlib's peak follows the buffer
        children[(name_rl, b)] = (RSS_RL, rio)
    peaks = {k: [] for k in children}
    for _ in range(max(1, min(args.repeats, 3))):      # interleaved, a fresh process each
        for key, (code, path) in children.items():
            (got,), peak = harness.run_child(code, [path, key[1]], timeout=1800)
            assert got[0] == n, (key, got, n)
            peaks[key].append(dict(peak, import_MB=got[1]))
    for path in {p for _, p in children.values()}:
        os.unlink(path)
    rows = []
    for (name, b), ps in peaks.items():
        hi = [p["peak_MB"] for p in ps]
        imp = min(p["import_MB"] for p in ps)
        rows.append([f"{name}, shuffle({b:,})", f"{min(hi):.0f} / {max(hi):.0f}",
                     f"{min(p['baseline_MB'] for p in ps):.0f}", f"{imp:.0f}", f"{min(hi) - imp:.0f}",
                     f"{min(b, n) * REC / 2**20:.1f}"])
    rep.table(["chain (one pass, fresh process)", "peak RSS MB (min / max of runs)",
               "interpreter MB", "after the import MB", "peak above the import MB",
               "shuffle buffer payload MB"], rows,
              title=f"#### Peak RSS: {n:,} x 64 B records, shuffle -> batch(256), one pass")


START_RL = r"""
import sys, time
t0 = time.perf_counter()
import readerlib as rl
r = rl.RecordIOReader(sys.argv[1]).shuffle(10000, seed=0).batch(256)
(x,) = next(iter(r))
emit([time.perf_counter() - t0, len(x)])
"""

START_TF = r"""
import sys, time
t0 = time.perf_counter()
import tensorflow as tf
ds = (tf.data.TFRecordDataset(sys.argv[1]).shuffle(10000, seed=0).batch(256)
      .map(lambda x: tf.io.decode_raw(x, tf.uint8)))
x = next(iter(ds.as_numpy_iterator()))
emit([time.perf_counter() - t0, len(x)])
"""

START_TORCH = r"""
import sys, time
t0 = time.perf_counter()
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
raw = np.memmap(sys.argv[1], dtype=np.uint8, mode="r").reshape(-1, 64)
ds = TensorDataset(torch.from_numpy(np.asarray(raw)))
dl = DataLoader(ds, batch_size=256, shuffle=True, generator=torch.Generator().manual_seed(0))
(x,) = next(iter(dl))
emit([time.perf_counter() - t0, len(x)])
"""


def startup_table(rep, args, tmp, n):
    rio = write_recordio(os.path.join(tmp, "s.rio"), n)
    children = {"readerlib": (START_RL, rio)}
    if harness.want(args, "tf"):
        children["tf.data"] = (START_TF, write_tfrecord(os.path.join(tmp, "s.tfrecord"), n))
    if harness.want(args, "torch"):
        raw = os.path.join(tmp, "s.raw")
        np.random.default_rng(0).integers(0, 256, size=(n, REC), dtype=np.uint8).tofile(raw)
        children["torch DataLoader"] = (START_TORCH, raw)

    def child(code, path):
        def run():
            t = time.perf_counter()
            (got,), _ = harness.run_child(code, [path], timeout=600)
            wall = time.perf_counter() - t
            assert got[1] == BATCH, got
            walls.setdefault(code, []).append(wall)
            return harness.Sample(got[0], 1)
        return run
    walls = {}
    # warm-up: the page cache of the interpreters' own files (a first import reads them from disk)
    st = harness.interleaved({k: child(*v) for k, v in children.items()}, args.repeats)
    rows = []
    for name, v in st.items():
        w = walls[children[name][0]][1:]           # without the warm-up
        rows.append([name, f"{v.best * 1e3:.0f}", f"{v.median * 1e3:.0f}", f"{min(w) * 1e3:.0f}",
                     f"{v.best / st['readerlib'].best:.1f}x"])
    for _, p in children.values():
        if os.path.exists(p):
            os.unlink(p)
    rep.table(["library", "import -> first batch, ms: best", "median", "whole process (best, ms)",
               "best / readerlib"], rows,
              title=f"#### Start-up: fresh interpreter, import to the first batch of "
                    f"file ({n:,} x 64 B) -> shuffle(10k) -> batch(256) (interleaved)")


def main(argv=None):
    p = harness.parser(__doc__, repeats=3)
    p.add_argument("--only", default="records,buffer,batch,threads,rss,startup")
    a = harness.parse(p, argv)
    only = set(a.only.split(","))
    if a.quick:
        sizes, n_mem, buffers, batches = [1000, 4000], 20_000, [1000, 10_000], [32, 4096]
        threads_cases, rss_n, rss_buffer, start_n = [(64, 20_000), (65536, 64)], 20_000, 2000, 12_000
    else:
        sizes, n_mem = [100_000, 1_000_000, 10_000_000], 2_000_000
        buffers, batches = [1000, 10_000, 100_000, 1_000_000], [32, 256, 1024, 4096]
        threads_cases, rss_n, rss_buffer, start_n = [(64, 2_000_000), (65536, 4096)], 1_000_000, 100_000, 100_000
    tmp = tempfile.mkdtemp(prefix="rl-bench-scaling-")
    try:
        with harness.Report(a, "Scaling: cost per record as the job grows") as rep:
            copy = harness.copy_bandwidth(16 << 20 if a.quick else 256 << 20, a.repeats)
            read = harness.read_bandwidth(16 << 20 if a.quick else 256 << 20, a.repeats)
            rep.add(harness.bounds_line(copy, read),
                    f"- a 64 B record is at best 64 B / memcpy rate = {64 / copy['copy']:.1f} ns "
                    f"(it is read, checksummed, copied into its batch)", "")
            if "records" in only:
                records_table(rep, a, tmp, sizes)
            if "buffer" in only:
                buffer_table(rep, a, n_mem, buffers)
            if "batch" in only:
                batch_table(rep, a, n_mem, batches)
            if "threads" in only:
                threads_table(rep, a, tmp, threads_cases)
            if "rss" in only:
                rss_table(rep, a, tmp, rss_n, rss_buffer)
            if "startup" in only:
                startup_table(rep, a, tmp, start_n)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
