"""Benchmark 8(a): how long a training loop waits for data, with and without prefetch.

A simulated training loop takes a batch, then "computes" for a fixed time
(`--step-ms`, default 2 ms).  We time every `next()` the loop makes: that is
the time the step was blocked on data.  Target (issue 6): with `.prefetch()`
the loop waits < 2% of its step time once the reader is faster than the step.

Two kinds of "compute":
  sleep  the step releases the GIL (like a PyTorch/JAX/CUDA step: kernels run
         without the GIL)
  spin   the step busy-waits in Python holding the GIL (worst case: a
         pure-Python step; the prefetch thread needs no GIL, so it still runs)

The chain: RecordIO file of variable-length float32 sequences (50-500 x 80,
as `readerlib bench`) -> shuffle -> batch, read from the page cache.  The
reader's own time per batch is measured first (no compute), so the table
shows how much faster than the step it is.

Run:  PYTHONPATH=. python benchmarks/bench_prefetch.py [--repeats 5] [--quick] [--out FILE]

(--repeats: runs per row, the median reported, all listed.)
"""
import os
import tempfile
import time

import harness
import numpy as np

import readerlib as rl


def write_dataset(path, n, seed=0):
    rng = np.random.default_rng(seed)
    schema = rl.Schema([rl.Field("feats", "float32", (80,), lod_level=1), rl.Field("label", "int64")])
    nbytes = 0
    with rl.RecordIOWriter(path, schema, chunk_size=1 << 20) as w:
        for i in range(n):
            length = int(rng.integers(50, 501))
            feats = rng.random((length, 80), dtype=np.float32)
            w.write((feats, i))
            nbytes += feats.nbytes + 8
    return nbytes


def make_chain(path, batch, shuffle, seed):
    return rl.RecordIOReader(path).shuffle(shuffle, seed=seed).batch(batch)


def compute(step_s, mode):
    if mode == "sleep":
        # sleep most of it (GIL released), then spin the last bit for an exact step
        end = time.perf_counter() + step_s
        if step_s > 3e-4:
            time.sleep(step_s - 3e-4)
        while time.perf_counter() < end:
            pass
    else:
        end = time.perf_counter() + step_s
        while time.perf_counter() < end:
            pass


def _schedstat(native_id):
    """(cpu ns, run-queue wait ns) of one thread of this process, or None."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            cpu, wait, _ = f.read().split()
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return None


class ThreadStats:
    """Sum of schedstat deltas over the prefetch threads (a new one per epoch)."""

    def __init__(self, chain):
        self.chain = chain
        self.seen = {}

    def sample(self):
        t = self.chain.thread
        if t is None or t.native_id is None:
            return
        now = _schedstat(t.native_id)
        if now is not None:
            first = self.seen.get(t.native_id, (now, now))[0]
            self.seen[t.native_id] = (first, now)

    def totals(self):
        cpu = sum(last[0] - first[0] for first, last in self.seen.values())
        rq = sum(last[1] - first[1] for first, last in self.seen.values())
        return cpu, rq


def training_loop(chain, epochs, step_s, mode, skip, stats=None):
    """Returns (waits, steps): per-step seconds blocked in next(), seconds computing."""
    waits, steps, cold = [], [], []
    for _ in range(epochs):
        it = iter(chain)
        k = 0
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            compute(step_s, mode)
            if k < skip:
                cold.append(t1 - t0)        # an epoch's first batch: shuffle buffer fill
            else:
                waits.append(t1 - t0)
                steps.append(time.perf_counter() - t1)
            k += 1
            del batch
            if stats is not None:
                stats.sample()          # outside both timed regions
    return waits, steps, cold


def reader_time_per_batch(path, batch, shuffle, seed, epochs):
    chain = make_chain(path, batch, shuffle, seed)
    for _ in chain:              # warm the page cache
        pass
    n = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for _ in chain:
            n += 1
    dt = time.perf_counter() - t0
    chain.close()
    return dt / n, n // epochs


def main(argv=None):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--records", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--shuffle", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--capacities", default="1,2,4,8")
    ap.add_argument("--modes", default="sleep,spin")
    ap.add_argument("--skip", type=int, default=1,
                    help="leading steps of every epoch left out of the steady-state figures "
                         "(the cold start: the shuffle buffer fills)")
    ap.add_argument("--normal-sched", default="2",
                    help="capacities to run again with the prefetch thread under the normal scheduler "
                         "policy (READERLIB_PREFETCH_SCHED=normal), for comparison")
    args = harness.parse(ap, argv)
    if args.quick:
        args.records, args.epochs, args.capacities, args.normal_sched = 96, 1, "2", ""
    args.trials = args.repeats
    report = harness.Report(args, "8(a) Training-loop simulation: time blocked waiting for data")
    report.__enter__()
    report.add(harness.bounds_line(harness.copy_bandwidth(16 << 20 if args.quick else 256 << 20, args.repeats))
               + " (the reader alone copies every byte once into its batch)", "")

    tmp = tempfile.mkdtemp(prefix="rl-bench-prefetch-")
    path = os.path.join(tmp, "seq.rio")
    nbytes = write_dataset(path, args.records)
    step_s = args.step_ms / 1e3
    seed = 0
    t_read, nbatches = reader_time_per_batch(path, args.batch, args.shuffle, seed, args.epochs)
    print(f"dataset: {args.records} records, {nbytes / 1e6:.0f} MB, {nbatches} batches of {args.batch}/epoch; "
          f"reader alone: {t_read * 1e3:.3f} ms/batch "
          f"({nbytes / nbatches / t_read / 1e9:.2f} GB/s), step {args.step_ms} ms", flush=True)

    rows = []
    caps = [int(c) for c in args.capacities.split(",") if c]
    for mode in args.modes.split(","):
        normal = [int(c) for c in args.normal_sched.split(",") if c]
        for cap, sched in [(0, "batch")] + [(c, "batch") for c in caps] + [(c, "normal") for c in normal]:
            os.environ["READERLIB_PREFETCH_SCHED"] = sched
            trials = []
            for _ in range(args.trials):
                chain = make_chain(path, args.batch, args.shuffle, seed)
                if cap:
                    chain = chain.prefetch(capacity=cap)
                    time.sleep(0.05)       # the time a real loop spends building its model
                stats = ThreadStats(chain) if cap else None
                if stats:
                    stats.sample()
                waits, steps, cold = training_loop(chain, args.epochs, step_s, mode, args.skip, stats)
                chain.close()
                # The prefetch thread's CPU time and time spent runnable but not running
                # (waiting for a core), per step: is a wait the reader or the machine?
                if stats and stats.seen:
                    nst = len(waits) + len(cold)
                    cpu, rq = stats.totals()
                    thr = (cpu / nst / 1e6, rq / nst / 1e6)
                else:
                    thr = (float("nan"), float("nan"))
                trials.append((sum(waits) / sum(steps), float(np.mean(waits)), float(np.percentile(waits, 99)),
                               float(np.max(waits)), sum(cold) / max(len(cold), 1), len(waits), thr))
            trials.sort(key=lambda t: t[0])
            med = trials[len(trials) // 2]
            label = "none" if cap == 0 else f"capacity={cap}" + (" (thread not SCHED_BATCH)" if sched == "normal" else "")
            row = dict(mode=mode, prefetch=label,
                       frac=med[0], mean_ms=med[1] * 1e3, p99_ms=med[2] * 1e3, max_ms=med[3] * 1e3,
                       cold_ms=med[4] * 1e3, steps=med[5], thr_cpu=med[6][0], thr_rq=med[6][1],
                       fracs=", ".join(f"{t[0] * 100:.2f}" for t in trials))
            rows.append(row)
            print(f"{mode:5s} {row['prefetch']:38s} wait/step {row['frac'] * 100:6.2f}%  "
                  f"mean {row['mean_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms  max {row['max_ms']:.3f} ms  "
                  f"thread cpu {row['thr_cpu']:.3f} ms, runqueue {row['thr_rq']:.3f} ms /step "
                  f"(trials: {row['fracs']} %)", flush=True)

    lines = [
        f"Chain: RecordIO ({args.records} variable-length float32 sequences 50-500 x 80, "
        f"{nbytes / 1e6:.0f} MB, page cache) -> shuffle({args.shuffle}, seed=0) -> batch({args.batch}); "
        f"{nbatches} batches/epoch, {args.epochs} epochs per run.  "
        f"Reader alone: **{t_read * 1e3:.3f} ms/batch** ({nbytes / nbatches / t_read / 1e9:.2f} GB/s), "
        f"i.e. {step_s / t_read:.1f}x faster than the {args.step_ms:g} ms step.",
        "",
        f"Wait = time inside `next()`, per step; steady state leaves out the first {args.skip} step(s) "
        f"of every epoch (cold start: the shuffle buffer fills before the first batch, with or without "
        f"prefetch), shown apart as \"first step's wait\" (mean over epochs).  Median of {args.trials} runs "
        f"(all runs listed).  sleep = step releases the GIL (framework kernels); spin = step holds the GIL "
        f"(pure Python).  The prefetch thread runs under SCHED_BATCH (no wake-up preemption of the step); "
        f"rows marked \"not SCHED_BATCH\" run it under the normal policy for comparison.",
        "",
        "Prefetch thread: its CPU time per step, and its run-queue time per step (runnable, waiting for a "
        "core: /proc/self/task/TID/schedstat).  A run-queue time near the loop's wait means the waits "
        "come from CPU contention on the machine, not from the reader.",
        "",
        "| step | prefetch | wait / step time | mean wait | p99 wait | max wait | first step's wait "
        "| thread CPU / step | thread run-queue / step | runs (wait %) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} {args.step_ms:g} ms | {r['prefetch']} | **{r['frac'] * 100:.2f}%** | "
                     f"{r['mean_ms']:.3f} ms | {r['p99_ms']:.3f} ms | {r['max_ms']:.3f} ms | "
                     f"{r['cold_ms']:.3f} ms | "
                     + ("- | - |" if r['thr_cpu'] != r['thr_cpu'] else
                        f"{r['thr_cpu']:.3f} ms | {r['thr_rq']:.3f} ms |")
                     + f" {r['fracs']} |")
    report.add(*lines)
    report.__exit__(None, None, None)
    os.remove(path)
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
