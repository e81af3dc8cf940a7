"""Global shuffle throughput from files: one RecordIO file and 16 files via open_files.

For each dataset (N records of one uint8[S] field) and each source (one
RecordIO file; the same records in 16 RecordIO files read by
``open_files(paths, num_threads=2)``), one epoch of each chain is timed,
the contenders interleaved round after round (harness.interleaved):

    sequential      src.batch(B)
    buffer          src.shuffle(buf, seed=0).batch(B)          tf.data's buffer shuffle
    window          src.shuffle(buf, seed=0, mode="window").batch(B)
    global          src.global_shuffle(seed=0).batch(B)        every record anywhere (window_chunks=8)
    grain global    grain.MapDataset.source(records).shuffle(seed=0).batch(B): Grain's
                    global shuffle (index_shuffle) over the same records held in
                    memory as one NumPy array (only when `grain` imports)

Grain over the same records in ArrayRecord files (group_size:1, what Grain's
random access needs) is timed apart, on the first ARRAY_RECORD_SUBSET records:
ArrayRecordDataSource reads one 32 KiB buffer per record (a pread each) and
ran at ~1-2 k records/s here, so a whole epoch of 1 M records would take
minutes.

Records/s and GB/s (record payload) are best and median over the rounds; the
ratios to the buffer shuffle and to sequential are taken in the same run.
Also: restore time (set_state + the first batch) over the 16 files at 10%,
50%, 90% of an epoch, with and without the c_skip of open_files (the old
path: `.multi_pass(1)` on top replays the epoch).

Usage:
    python benchmarks/bench_global_shuffle.py [--repeats 5] [--dir /tmp] [--only small|large]
        [--quick] [--busy N] [--peers all|none|grain] [--out FILE.md]

Datasets: small = 1,000,000 x 64 B (batch 256, buffer 10,000), large =
16,384 x 64 KiB (1 GiB; batch 32, buffer 1,000: 64 MiB of buffer).  Grain
is not a dependency: with it installed elsewhere, put it on PYTHONPATH
(``pip install --target DIR grain array-record etils portpicker``).
The files are written to --dir and deleted at the end.  ``--quick``: 20,000
x 64 B and 64 x 64 KiB, 4 files, a smoke run.
"""
import os
import shutil
import tempfile
import time

import harness
import numpy as np

import readerlib as rl

NFILES = 16


def write_rio(path, n, size, start, chunk_size=1 << 20):
    schema = rl.Schema([rl.Field("x", "uint8", (size,))])
    with rl.RecordIOWriter(path, schema, chunk_size=chunk_size) as w:
        step = max(1, (16 << 20) // size)
        for a in range(start, start + n, step):
            b = min(start + n, a + step)
            x = np.empty((b - a, size), np.uint8)
            x[:] = (np.arange(a, b) % 251).astype(np.uint8)[:, None]
            x[:, :8] = np.arange(a, b, dtype=np.int64).view(np.uint8).reshape(-1, 8)
            w.write_batch({"x": x})


def write_array_record(path, n, size, start):
    from array_record.python.array_record_module import ArrayRecordWriter
    w = ArrayRecordWriter(path, "group_size:1")
    x = np.empty(size, np.uint8)
    for k in range(start, start + n):
        x[:] = k % 251
        x[:8] = np.frombuffer(int(k).to_bytes(8, "little"), np.uint8)
        w.write(x.tobytes())
    w.close()


def epoch(make):
    """One epoch of a chain: a Sample of its records (set-up and close not timed)."""
    def run():
        chain = make()
        t0 = time.perf_counter()
        n = 0
        for b in chain:
            n += b[0].data.shape[0]
        dt = time.perf_counter() - t0
        chain.close()
        return harness.Sample(dt, n)
    return run


ARRAY_RECORD_SUBSET = {"small": 5_000, "large": 1_000}


def grain_epoch(grain, source, batch, decode=False):
    def run():
        ds = grain.MapDataset.source(source).shuffle(seed=0)
        if decode:
            ds = ds.map(lambda b: np.frombuffer(b, np.uint8))
        ds = ds.batch(batch)
        t0 = time.perf_counter()
        n = 0
        for b in ds:
            n += b.shape[0]
        return harness.Sample(time.perf_counter() - t0, n)
    return run


def restore_ms(make, position, repeats):
    """Best and median ms of set_state(state at `position` batches) + the first batch."""
    ref = make()
    it = iter(ref)
    for _ in range(position):
        next(it)
    state = ref.get_state()
    ref.close()
    times = []
    for _ in range(repeats):
        chain = make()
        t0 = time.perf_counter()
        chain.set_state(state)
        next(iter(chain))
        times.append((time.perf_counter() - t0) * 1e3)
        chain.close()
    times.sort()
    return times[0], times[len(times) // 2]


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--only", choices=["small", "large"])
    args = harness.parse(p, argv)
    grain = None
    if harness.want(args, "grain"):
        grain = harness.try_import("grain")
        if grain is not None:
            try:
                import array_record.python.array_record_module  # noqa: F401
            except Exception as e:
                print(f"# grain: array_record unavailable ({e}): no Grain peer")
                grain = None
    if args.quick:
        sets = [("small", 20_000, 64, 256, 2_000, 4), ("large", 64, 65536, 8, 16, 4)]
    else:
        sets = [("small", 1_000_000, 64, 256, 10_000, NFILES), ("large", 16_384, 65536, 32, 1_000, NFILES)]
    if args.only:
        sets = [s for s in sets if s[0] == args.only]
    root = tempfile.mkdtemp(prefix="bench_global_shuffle-", dir=args.dir)
    try:
        with harness.Report(args, "Global shuffle from files (issue 16 items 2-3)") as rep:
            rep.add("", harness.bounds_line(copy=harness.copy_bandwidth(64 << 20, 3)), "")
            if grain is None:
                rep.add("Grain: not importable in this run (no peer row).", "")
            for name, n, size, batch, buf, nfiles in sets:
                run_set(rep, args, grain, root, name, n, size, batch, buf, nfiles)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_set(rep, args, grain, root, name, n, size, batch, buf, nfiles):
    d = os.path.join(root, name)
    os.makedirs(d)
    one = os.path.join(d, "all.rio")
    write_rio(one, n, size, 0)
    per = -(-n // nfiles)
    many = []
    for k in range(nfiles):
        a, b = k * per, min(n, (k + 1) * per)
        path = os.path.join(d, f"part-{k:02d}.rio")
        write_rio(path, b - a, size, a)
        many.append(path)
    records = None
    if grain is not None:                  # the same records, in memory, for Grain's shuffle
        records = np.concatenate([b[0].data for b in rl.RecordIOReader(one).batch(4096)])
    sources = {"RecordIO file": lambda: rl.RecordIOReader(one),
               f"open_files({nfiles} files)": lambda: rl.open_files(many, num_threads=2)}
    nbytes = n * size
    for sname, src in sources.items():
        contenders = {
            "sequential": epoch(lambda src=src: src().batch(batch)),
            f"buffer shuffle({buf:,})": epoch(lambda src=src: src().shuffle(buf, seed=0).batch(batch)),
            f"window shuffle({buf:,})": epoch(lambda src=src: src().shuffle(buf, seed=0, mode="window").batch(batch)),
            "global_shuffle": epoch(lambda src=src: src().global_shuffle(seed=0).batch(batch)),
        }
        if grain is not None and sname == "RecordIO file":     # (the same peer for both tables)
            contenders["grain MapDataset.shuffle (records in memory)"] = grain_epoch(grain, records, batch)
        stats = harness.interleaved(contenders, args.repeats, warmup=1)
        buf_key = f"buffer shuffle({buf:,})"
        rows = []
        for cname, s in stats.items():
            b, m = harness.speedup(stats, cname, buf_key)
            q, _ = harness.speedup(stats, cname, "sequential")
            rows.append([cname, f"{s.rate_best / 1e6:.2f} / {s.rate_median / 1e6:.2f}",
                         f"{s.rate_best * size / 1e9:.2f} / {s.rate_median * size / 1e9:.2f}",
                         f"{b:.2f} / {m:.2f}", f"{q:.2f}"])
        rep.table(["chain", "Mrec/s best / median", "GB/s best / median", "vs buffer best / median",
                   "vs sequential (best)"], rows,
                  title=f"#### {name}: {n:,} x {size} B ({nbytes / 1e9:.2f} GB), {sname}, batch {batch}, "
                        f"{args.repeats} interleaved rounds")
    if grain is not None:
        m = min(n, ARRAY_RECORD_SUBSET[name])
        ar = os.path.join(d, "subset.array_record")
        write_array_record(ar, m, size, 0)
        sub = os.path.join(d, "subset.rio")
        write_rio(sub, m, size, 0)
        stats = harness.interleaved({
            "grain MapDataset.shuffle (ArrayRecordDataSource)": grain_epoch(
                grain, grain.sources.ArrayRecordDataSource([ar]), batch, decode=True),
            "readerlib global_shuffle (RecordIO)": epoch(
                lambda: rl.RecordIOReader(sub).global_shuffle(seed=0).batch(batch))},
            max(1, min(args.repeats, 2)), warmup=0)
        rep.table(["chain", "records/s best / median", "GB/s best"],
                  [[k, f"{harness.fmt_rate(s.rate_best)} / {harness.fmt_rate(s.rate_median)}",
                    f"{s.rate_best * size / 1e9:.3f}"] for k, s in stats.items()],
                  title=f"#### {name}: Grain from files: the first {m:,} records in one ArrayRecord file "
                        f"(group_size:1) against one RecordIO file")
    # restore over the 16 files: c_skip of open_files against the replay
    total = -(-n // batch)
    reps = max(1, min(args.repeats, 5))
    rows = []
    chains = {"open_files.batch": lambda: rl.open_files(many, num_threads=2).batch(batch),
              "open_files.batch (old: replay)": lambda: rl.open_files(many, num_threads=2).batch(batch).multi_pass(1),
              "open_files.global_shuffle.batch": lambda: rl.open_files(many).global_shuffle(seed=0).batch(batch)}
    for cname, make in chains.items():
        cells = []
        for frac in (0.1, 0.5, 0.9):
            best, med = restore_ms(make, max(1, int(frac * total)), reps)
            cells.append(f"{best:.2f} / {med:.2f}")
        rows.append([cname] + cells)
    rep.table(["chain", "10% best / median ms", "50%", "90%"], rows,
              title=f"#### {name}: restore (set_state + first batch) over open_files({nfiles} files), "
                    f"{reps} restores each")


if __name__ == "__main__":
    main()
