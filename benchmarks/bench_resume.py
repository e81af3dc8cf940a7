"""Resume cost: set_state + the first batch, at 10% / 50% / 90% of an epoch.

For each source (an in-memory ArrayReader, a RecordIO file) of N small
records (one float32[4] field, 16 bytes) and each chain, the chain is read to
the position (batches of 256), its state taken, and a freshly built chain
restored from it and asked for its first batch; the time of that restore +
first batch is reported (best and median of repeats).

Chains ("old" reproduces the replay set_state did before c_skip: a
ReaderHolder on top, which has no c_skip, makes set_state call c_next once per
item, exactly the old code path):
    unshuffled      src.batch(256)                          new: O(chunks) skip
    unshuffled/old  ReaderHolder(src.batch(256))            replay
    global          src.global_shuffle(seed).batch(256)     new: O(1)
    window          src.shuffle(10k, mode="window").batch   new: <= one window read
    buffer          src.shuffle(10k).batch(256)             new: the buffer's records by index
    buffer/old      ReaderHolder(src.shuffle(10k).batch)    replay (buffer shuffle)
    map/prefetch    src.shuffle(10k).map(f).batch(256).prefetch(2)
                                                            new: map and prefetch skip below
    map/prefetch/old  ReaderHolder(the same)                replay (f called again)
    filter          src.filter(keep).batch(256)              new: the filter's saved input
                                                            counts, skipped below (c_skip)
    filter/old      ReaderHolder(the same)                  replay (the predicate called again
                                                            for every record before the position)

"state KB" is the JSON size of the state (the buffer shuffle's saved buffer:
its records' source positions).  `--big-buffer`: one more table, shuffle(1M)
over N = the largest size, restored at 10%, 50% and 90% (state size and
times); `--big-buffer-only`: that table alone.  `--restore-threads 1 2`: the
RecordIO rows once per thread count of the restore's fill (1: serial; the
in-memory fill is serial whatever the count); each position also prints the
last restore's phases.

Also: read throughput of one epoch (records/s) for sequential, global
shuffle and buffer shuffle over the same source, in the same run.

Usage:
    python benchmarks/bench_resume.py [--sizes 1000000 10000000] [--repeats 3] [--old-repeats 1]
        [--throughput-size 1000000] [--dir /tmp] [--window-sweep] [--big-buffer]
        [--big-buffer-only] [--big-buffer-repeats R] [--restore-threads T ...] [--quick] [--busy N] [--out FILE.md]
The RecordIO files are deleted at the end.  The tables go through the shared
harness's report (harness.Report: command, date, machine, load); restore times
are best and median of ``--repeats`` restores (``--old-repeats`` for the replay
chains), epoch rates the best of ``--repeats`` epochs.  ``--quick``: N = 20,000,
a smoke run.
"""
import json
import os
import statistics
import tempfile
import time

import harness
import numpy as np

import readerlib as rl

BATCH = 256
BUFFER = 10_000


def _ident(x):
    return x


def _keep(x):
    """The filter's predicate: drops one record in 8 (a Python call per record)."""
    return int(x[0][0]) % 32 != 0


def make_chain(src_factory, kind, buffer=BUFFER):
    if kind.endswith("/old"):
        return rl.ReaderHolder(make_chain(src_factory, kind[:-4], buffer))
    s = src_factory()
    if kind in FILTER_SHUFFLE:
        return FILTER_SHUFFLE[kind](s)
    if kind == "unshuffled":
        return s.batch(BATCH)
    if kind == "global":
        return s.global_shuffle(seed=0).batch(BATCH)
    if kind == "window":
        return s.shuffle(buffer, seed=0, mode="window").batch(BATCH)
    if kind == "buffer":
        return s.shuffle(buffer, seed=0).batch(BATCH)
    if kind == "map/prefetch":
        return s.shuffle(buffer, seed=0).map(_ident, output_schema=s.schema).batch(BATCH).prefetch(2)
    if kind == "filter":
        return s.filter(_keep).batch(BATCH)
    raise ValueError(kind)


def state_at(src_factory, kind, position, buffer=BUFFER):
    """The state of a chain `position` batches into its epoch (reached with _skip,
    i.e. as cheaply as the chain allows; the state is the same as after reading),
    through JSON (as a checkpoint stores it)."""
    c = make_chain(src_factory, kind, buffer)
    iter(c)
    c._skip(position)
    st = json.loads(json.dumps(c.get_state()))
    c.close()
    return st


def _settle(chain, timeout=2.0):
    """A prefetcher starts reading when it is built: let its thread fill its ring
    first, so that the timing below is the restore's, not the construction's
    read-ahead (which set_state's reset waits for)."""
    pf = [r for r in chain._walk() if type(r).__name__ == "PrefetchReader"]
    t_end = time.perf_counter() + timeout
    for r in pf:
        while r.qsize < r.capacity and time.perf_counter() < t_end:
            time.sleep(0.001)


def time_restore(src_factory, kind, state, repeats, buffer=BUFFER):
    """[(set_state + first batch, set_state alone, CPU time of set_state + first
    batch on this thread)] seconds, one per repeat.  The CPU time leaves out the
    time the thread waited for a core (a shared machine) but not what another
    process's use of the caches and memory costs it."""
    out = []
    for _ in range(repeats):
        c = make_chain(src_factory, kind, buffer)   # built outside the timing
        _settle(c)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        c.set_state(state)
        t1 = time.perf_counter()
        b = c.read_next()
        dt = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        assert b is not None
        c.close()
        out.append((dt, t1 - t0, cpu))
    return out


def time_epoch(src_factory, kind):
    c = make_chain(src_factory, kind)
    t0 = time.perf_counter()
    n = 0
    for b in c:
        n += b[0].data.shape[0]
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def window_sweep(n, repeats, where, rep):
    """global_shuffle(window_chunks=w).batch(256) epoch throughput, memory and RecordIO."""
    data = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
    fd, path = tempfile.mkstemp(suffix=".rio", dir=where)
    os.close(fd)
    rows = []
    try:
        with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "float32", (4,))])) as w:
            w.write_batch({"x": data})
        mem, rio = (lambda: rl.ArrayReader(data)), (lambda: rl.RecordIOReader(path))
        for wc in (1, 2, 8, 32):
            rates = []
            for f in (mem, rio):
                def chain(f=f, wc=wc):
                    return f().global_shuffle(seed=0, window_chunks=wc).batch(BATCH)
                rates.append(max(_epoch_rate(chain) for _ in range(repeats)))
            rows.append([wc, f"{rates[0] / 1e6:.1f}", f"{rates[1] / 1e6:.1f}"])
            print(f"  window_chunks {wc}: {rates[0] / 1e6:.1f} / {rates[1] / 1e6:.1f} Mrec/s", flush=True)
        seq = max(_epoch_rate(lambda: rio().batch(BATCH)) for _ in range(repeats))
        rows.append(["sequential RecordIO", "", f"{seq / 1e6:.1f}"])
    finally:
        os.unlink(path)
    rep.table([f"window_chunks (N={n:,})", "memory Mrec/s", "recordio Mrec/s"], rows,
              title=f"global_shuffle(seed=0, window_chunks=w).batch({BATCH}), best epoch of {repeats}:")


def _epoch_rate(make):
    c = make()
    t0 = time.perf_counter()
    n = sum(b[0].data.shape[0] for b in c)
    dt = time.perf_counter() - t0
    c.close()
    return n / dt


def big_buffer(args, rep, workdir, made, schema):
    """shuffle(1M) over the largest N: state size and restore at 10%, 50%, 90%.

    The RecordIO file is the one the restore tables wrote (`--big-buffer`), or
    written here (`--big-buffer-only`)."""
    n = max(args.sizes)
    buf = min(1_000_000, n // 2)
    path = os.path.join(workdir, f"r{n}.rio")
    data = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
    if args.big_buffer_only and not os.path.exists(path):
        with rl.RecordIOWriter(path, schema) as w:
            for k in range(0, n, 1 << 20):
                w.write_batch({"x": data[k:k + (1 << 20)]})
        made.append(path)
    reps = args.big_buffer_repeats or max(1, args.old_repeats)
    nb = -(-n // BATCH)
    rows = []
    from readerlib.readers import _shuffle
    par = getattr(_shuffle, "_restore_parallel_settings", None)   # (not in older builds)
    states = {}
    for sname, factory, threads in [(s, f, t) for s, f in {"memory": lambda: rl.ArrayReader(data),
                                                           "recordio": lambda: rl.RecordIOReader(path)}.items()
                                    for t in (args.restore_threads if par and s == "recordio" else [0])]:
        if sname == "recordio" and not os.path.exists(path):
            continue
        if par:
            par(threads=threads)
        if threads:
            sname = f"{sname.split()[0]} fill threads {threads}"
        cells, bests, alone, cpus, size = [], [], [], [], 0
        for frac in (0.1, 0.5, 0.9):
            key = (sname.split()[0], frac)
            if key not in states:
                states[key] = state_at(factory, "buffer", int(nb * frac), buffer=buf)
            st = states[key]
            size = max(size, len(json.dumps(st)))
            ts = time_restore(factory, "buffer", st, reps, buffer=buf)
            phases = getattr(_shuffle, "_restore_phases", None)
            if phases is not None:
                print(f"    (last restore's phases, ms: " +
                      ", ".join(f"{k} {1e3 * v:.1f}" for k, v in phases().items()) + ")", flush=True)
            tot = [t[0] for t in ts]
            bests.append(min(tot))
            alone.append(min(t[1] for t in ts))
            cpus.append(f"{1e3 * min(t[2] for t in ts):.1f} / {1e3 * statistics.median(t[2] for t in ts):.1f}")
            cells.append(f"{1e3 * min(tot):.1f} / {1e3 * statistics.median(tot):.1f}")
            print(f"  shuffle({buf:,}) {sname} at {frac:.0%}: restore {1e3 * min(tot):.1f} / "
                  f"{1e3 * statistics.median(tot):.1f} ms", flush=True)
        rows.append([sname, f"{n:,}", f"{buf:,}", *cells, f"{max(bests) / min(bests):.2f}",
                     " / ".join(f"{1e3 * a:.1f}" for a in alone), " ; ".join(cpus), f"{size / 1e6:.2f}"])
    if par:
        par(threads=0)
    rep.table(["source", "N", "buffer", "10% best / median ms", "50%", "90%", "max/min (best)",
               "set_state alone, best ms (10/50/90%)", "CPU ms best / median (10% ; 50% ; 90%)",
               "state MB (JSON, max)"],
              rows, title=f"a big buffer, restore + first batch ({reps} restores):")


def main(argv=None):
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--old-repeats", type=int, default=1)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--throughput-size", type=int, default=1_000_000)
    ap.add_argument("--big-buffer", action="store_true",
                    help="also: shuffle(1M) over the largest size, state size and restore at 10/50/90%%")
    ap.add_argument("--filter-shuffle", action="store_true",
                    help="only: shuffle(100k) above a filter, restore at 10/50/90%% (new vs replay)")
    ap.add_argument("--big-buffer-only", action="store_true",
                    help="only the --big-buffer table (no restore or epoch tables)")
    ap.add_argument("--big-buffer-repeats", type=int, default=0,
                    help="restores per position for the big buffer (default: --old-repeats)")
    ap.add_argument("--restore-threads", type=int, nargs="+", default=[0],
                    help="big buffer: one row per restore-fill thread count (0: readerlib's "
                         "count, 1: serial; builds without the parallel fill: one row)")
    ap.add_argument("--window-sweep", action="store_true",
                    help="only: global_shuffle throughput by window_chunks (1, 2, 8, 32), N=--throughput-size")
    args = harness.parse(ap, argv)
    if args.quick:
        args.sizes, args.throughput_size, args.old_repeats = [20_000], 20_000, 1
    if args.big_buffer_only:
        # the report's header states the restores the one table made (it said --repeats' 3)
        args.repeats = args.big_buffer_repeats or max(1, args.old_repeats)
    title = "Resume cost: set_state + the first batch" if not args.window_sweep else \
        "global_shuffle throughput by window_chunks"
    with harness.Report(args, title) as rep:
        rep.add(f"- batch {BATCH}, buffer/window {BUFFER}, records float32[4] (16 B); "
                f"readerlib threads {rl.get_num_threads()}", "")
        if args.filter_shuffle:
            filter_shuffle_rows(args, rep)
        elif args.window_sweep:
            window_sweep(args.throughput_size, args.repeats, args.dir, rep)
        elif args.big_buffer_only:
            workdir = tempfile.mkdtemp(prefix="bench_resume_", dir=args.dir)
            made = []
            try:
                big_buffer(args, rep, workdir, made, rl.Schema([rl.Field("x", "float32", (4,))]))
            finally:
                for p in made:
                    os.unlink(p)
                os.rmdir(workdir)
        else:
            restores_and_epochs(args, rep)


def _write_sources(workdir, n, schema):
    """An n x 4 float32 array and the same records in a RecordIO file under workdir:
    (path, {"memory": factory, "recordio": factory})."""
    data = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
    path = os.path.join(workdir, f"r{n}.rio")
    with rl.RecordIOWriter(path, schema) as w:
        for k in range(0, n, 1 << 20):
            w.write_batch({"x": data[k:k + (1 << 20)]})
    return path, {"memory": lambda d=data: rl.ArrayReader(d), "recordio": lambda p=path: rl.RecordIOReader(p)}


def restore_row(args, factory, sname, n, kind):
    """One table row: restore + first batch of `kind` over factory's n records at
    10/50/90% of its epoch (best / median ms), max/min of the bests, set_state alone,
    the largest state.  /old chains (replay) get --old-repeats restores."""
    reps = args.old_repeats if kind.endswith("/old") else args.repeats
    # the filter keeps 7 records in 8 (i % 8 != 0): its epoch is shorter
    nbk = -(-(n - -(-n // 8)) // BATCH) if kind.startswith("filter") else -(-n // BATCH)
    cells, bests, alone, size = [], [], [], 0
    for frac in (0.1, 0.5, 0.9):
        st = state_at(factory, kind, int(nbk * frac))
        size = max(size, len(json.dumps(st)))
        ts = time_restore(factory, kind, st, reps)
        tot = [t[0] for t in ts]
        bests.append(min(tot))
        alone.append(min(t[1] for t in ts))
        cells.append(f"{1e3 * min(tot):.2f} / {1e3 * statistics.median(tot):.2f}")
    print(f"  {sname} {n:,} {kind}: " + ", ".join(cells) + f" ms; state {size} B", flush=True)
    return [sname, f"{n:,}", kind, *cells, f"{max(bests) / min(bests):.2f}",
            " / ".join(f"{1e3 * a:.2f}" for a in alone), f"{size / 1e3:.1f}"]


def restores_and_epochs(args, rep):
    workdir = tempfile.mkdtemp(prefix="bench_resume_", dir=args.dir)
    schema = rl.Schema([rl.Field("x", "float32", (4,))])
    rows = []
    made = []
    try:
        for n in args.sizes:
            path, sources = _write_sources(workdir, n, schema)
            made.append(path)
            for sname, factory in sources.items():
                for kind in ("unshuffled", "global", "window", "buffer", "map/prefetch", "filter",
                             "unshuffled/old", "buffer/old", "map/prefetch/old", "filter/old"):
                    if kind in ("map/prefetch/old", "filter/old") and n > 1_000_000:
                        continue                # calls the function 2 x 15 M times: the 1 M row says it
                    rows.append(restore_row(args, factory, sname, n, kind))
        rep.table(["source", "N", "chain", "10% best / median ms", "50%", "90%", "max/min (best)",
                   "set_state alone, best ms (10/50/90%)", "state KB (max)"], rows,
                  title=f"restore + first batch ({args.repeats} restores; {args.old_repeats} for the replay "
                        "chains, /old):")
        if args.big_buffer:
            big_buffer(args, rep, workdir, made, schema)
        # throughput, same run
        n = args.throughput_size
        path = os.path.join(workdir, f"r{n}.rio")
        if not os.path.exists(path):
            data = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
            with rl.RecordIOWriter(path, schema) as w:
                w.write_batch({"x": data})
            made.append(path)
        data = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
        rows = []
        for sname, factory in {"memory": lambda: rl.ArrayReader(data),
                               "recordio": lambda: rl.RecordIOReader(path)}.items():
            rates = {}
            for kind in ("unshuffled", "global", "buffer", "window"):
                rates[kind] = max(time_epoch(factory, kind) for _ in range(args.repeats))
            rows.append([sname] + [f"{rates[k] / 1e6:.1f}" for k in ("unshuffled", "global", "buffer", "window")])
        rep.table([f"source (N={n:,})", "sequential Mrec/s", "global_shuffle", "buffer shuffle(10k)", "window(10k)"],
                  rows, title=f"one epoch, best of {args.repeats}:")
    finally:
        for p in made:
            try:
                os.unlink(p)
            except OSError:
                pass
        try:
            os.rmdir(workdir)
        except OSError:
            pass


# A buffer shuffle above a filter (results/resume.md, 2026-12-01 21:xx): the
# shuffle keeps its records' positions in the source below the filter and
# restores by reading them there; "/old" replays (a ReaderHolder on top: the
# predicate called again for every record before the position, the shuffle
# run again).
FILTER_SHUFFLE_BUFFER = 100_000
FILTER_SHUFFLE = {
    "filter/shuffle": lambda s: s.filter(_keep).shuffle(FILTER_SHUFFLE_BUFFER, seed=1).batch(BATCH),
    # a map read through by the restore (fn called once per buffered record)
    "map/shuffle": lambda s: s.map(_ident, output_schema=s.schema).shuffle(FILTER_SHUFFLE_BUFFER, seed=1)
    .batch(BATCH),
}


def filter_shuffle_rows(args, rep):
    """src.filter(keep).shuffle(100k, seed=1).batch(256) and src.map(identity).shuffle(100k,
    seed=1).batch(256): restore + first batch at 10/50/90% of the epoch (the filter's:
    7/8 of N, keep drops one record in 8), new and replay."""
    workdir = tempfile.mkdtemp(prefix="bench_resume_fs_", dir=args.dir)
    schema = rl.Schema([rl.Field("x", "float32", (4,))])
    rows = []
    try:
        for n in args.sizes:
            path, sources = _write_sources(workdir, n, schema)
            for sname, factory in sources.items():
                for kind in ("filter/shuffle", "filter/shuffle/old", "map/shuffle", "map/shuffle/old"):
                    rows.append(restore_row(args, factory, sname, n, kind))
            os.unlink(path)
    finally:
        for f in os.listdir(workdir):
            os.unlink(os.path.join(workdir, f))
        os.rmdir(workdir)
    rep.table(["source", "N", "chain", "10% best / median ms", "50%", "90%", "max/min (best)",
               "set_state alone, best ms (10/50/90%)", "state KB (max)"], rows,
              title=f"filter(keep) / map(identity) .shuffle({FILTER_SHUFFLE_BUFFER:,}, seed=1).batch({BATCH}): "
                    f"restore + first "
                    f"batch ({args.repeats} restores; {args.old_repeats} for the replay, /old):")


if __name__ == "__main__":
    main()
