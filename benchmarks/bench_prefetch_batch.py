"""The prefetcher *below* a batch: what `.prefetch(k)` costs per instance.

Users put the prefetcher below the batch (after an expensive per-instance
`.map`, or out of tf.data habit, where `prefetch` anywhere is nearly free).
Then the ring carries instances, not batches: its cost is paid per instance.

Contenders, timed in interleaved rounds (harness.interleaved), ns per instance:

  chain               ArrayReader(x).batch(256)                  (no prefetcher)
  prefetch(64) below  ArrayReader(x).prefetch(64).batch(256)
  prefetch(k) below   the same with the capacities of --capacities (a larger ring: fewer
                      sleeps and wake-ups per instance)
  prefetch(2) above   ArrayReader(x).batch(256).prefetch(2)      (the usual place)
  map chain           ArrayReader(x).map(f).batch(256)           (f: a cheap Python function,
  map prefetch below  ArrayReader(x).map(f).prefetch(64).batch(256)    fewer instances)
  tf.data             from_tensor_slices(x).batch(256), and .prefetch(64).batch(256)
                      (fewer instances: tf.data's per-element cost is microseconds)

x: float32 (n, 16), i.e. 64-byte records, in memory.  Every round reads one
whole epoch of a fresh chain (construction left out of the time).

After the rounds, one more epoch of each readerlib contender gives the
process's CPU time per instance (every thread) and its voluntary context
switches per 1000 instances (getrusage): a prefetcher's thread and consumer
that sleep and wake each other show there.
``--busy-sweep 0,1`` repeats everything with 0 and then 1 competing busy
process (harness.Competitors).

Run:  PYTHONPATH=. python benchmarks/bench_prefetch_batch.py [--repeats 7] [--busy-sweep 0,1]
                  [--records 1048576] [--capacities 256,1024,4096] [--peers tf|none]
                  [--quick] [--out FILE.md]
"""
import resource
import time

import harness
import numpy as np

import readerlib as rl

BATCH = 256


def _epoch(make, units):
    def run():
        r = make()
        t0 = time.perf_counter()
        for _ in r:
            pass
        dt = time.perf_counter() - t0
        r.close()
        return harness.Sample(dt, units)
    return run


def _tf_epoch(ds, units):
    def run():
        t0 = time.perf_counter()
        for _ in ds:
            pass
        return harness.Sample(time.perf_counter() - t0, units)
    return run


def _same(a):
    return a


def readerlib_chains(args, x, xs):
    """name -> (a function making the chain, instances in its epoch)."""
    n, ns = len(x), len(xs)
    c = {
        "chain": (lambda: rl.ArrayReader(x).batch(BATCH), n),
        "prefetch(64) below": (lambda: rl.ArrayReader(x).prefetch(64).batch(BATCH), n),
    }
    for k in args.capacity_list:
        c[f"prefetch({k}) below"] = (lambda k=k: rl.ArrayReader(x).prefetch(k).batch(BATCH), n)
    c["prefetch(2) above"] = (lambda: rl.ArrayReader(x).batch(BATCH).prefetch(2), n)
    c["map chain"] = (lambda: rl.ArrayReader(xs).map(_same).batch(BATCH), ns)
    c["map prefetch(64) below"] = (lambda: rl.ArrayReader(xs).map(_same).prefetch(64).batch(BATCH), ns)
    return c


def contenders(args, x, xs, tf):
    c = {k: _epoch(make, units) for k, (make, units) in readerlib_chains(args, x, xs).items()}
    if tf is not None:
        ns = len(xs)
        base = tf.data.Dataset.from_tensor_slices(xs)
        c["tf.data batch"] = _tf_epoch(base.batch(BATCH), ns)
        c["tf.data prefetch(64).batch"] = _tf_epoch(base.prefetch(64).batch(BATCH), ns)
    return c


def cpu_and_switches(make, units):
    """One epoch: (process CPU ns per instance, voluntary context switches per 1000 instances)."""
    r = make()
    time.sleep(0.05)                     # (the thread fills its ring first, as in a real loop)
    c0, u0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in r:
        pass
    c1, u1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    r.close()
    return (c1 - c0) / units * 1e9, (u1 - u0) / units * 1000


RATIOS = [("prefetch(64) below", "chain"), ("prefetch(2) above", "chain"),
          ("map prefetch(64) below", "map chain"), ("tf.data prefetch(64).batch", "tf.data batch")]


def main(argv=None):
    ap = harness.parser(__doc__, repeats=7)
    ap.add_argument("--records", type=int, default=1 << 20)
    ap.add_argument("--small", type=int, default=1 << 16,
                    help="instances for the map and tf.data contenders (their per-instance cost is microseconds)")
    ap.add_argument("--capacities", default="256,1024,4096",
                    help="more capacities of the prefetcher below the batch (besides 64)")
    ap.add_argument("--busy-sweep", default="0,1",
                    help="comma list: everything measured once per count of competing busy processes")
    args = harness.parse(ap, argv)
    if args.quick:
        args.records, args.small = 1 << 14, 1 << 12
    args.capacity_list = [int(k) for k in args.capacities.split(",") if k and int(k) != 64]
    tf = harness.try_import("tensorflow") if harness.want(args, "tf") else None
    x = np.random.default_rng(0).standard_normal((args.records, 16), dtype=np.float32)
    xs = x[:args.small].copy()
    with harness.Report(args, "Prefetch below a batch: ns per 64-byte instance") as rep:
        rep.add(f"- {args.records:,} instances of 64 B (float32 x 16) in memory ({args.small:,} for the map "
                f"and tf.data contenders); batch {BATCH}; ns per instance, one epoch per round"
                + ("" if tf is not None else "; tf.data left out"), "")
        for busy in [int(b) for b in args.busy_sweep.split(",")]:
            with harness.Competitors(busy):
                st = harness.interleaved(contenders(args, x, xs, tf), args.repeats)
                cs = {k: cpu_and_switches(make, units) for k, (make, units) in readerlib_chains(args, x, xs).items()}
            rep.table(["contender", "ns/instance best", "ns/instance median", "spread"],
                      [[k, f"{1e9 / v.rate_best:.1f}", f"{1e9 / v.rate_median:.1f}", f"{v.spread:.0%}"]
                       for k, v in st.items()],
                      title=f"{busy} competing busy process(es), best / median of {args.repeats} rounds:")
            rep.table(["cost ratio (time per instance)", "best", "median"],
                      [[f"{a} / {b}", *(f"{1 / r:.2f}" for r in harness.speedup(st, a, b))]
                       for a, b in RATIOS + [(f"prefetch({k}) below", "chain") for k in args.capacity_list]
                       if a in st and b in st])
            rep.table(["contender (one more epoch)", "process CPU ns/instance", "voluntary switches / 1000 instances"],
                      [[k, f"{c:.1f}", f"{w:.1f}"] for k, (c, w) in cs.items()])


if __name__ == "__main__":
    main()
