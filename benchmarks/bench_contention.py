"""Threads on a shared machine (issue 11): the core chains with and without a competitor.

The core chains (bench_core.py / ``readerlib bench``): file -> shuffle(10k) ->
batch(256) over 64 B records and over 64 KiB records, with 0 and 1 competing
busy processes (``while True: pass`` in a subprocess, killed at the end), each
run with readerlib's default thread count and with ``set_num_threads(1)``,
alternating in the same process, ``--repeats`` times; best and median.

``--main DIR`` also runs the same chains against another build of readerlib
(e.g. ``/work/main``, the OpenMP build before this change) in the same run, so
the old and the new default are compared under the same load.

``--sweep`` measures where a 2-thread split starts to pay (chunk checksum and
batch_reindex gather, 1 vs 2 threads by size, with and without a competitor):
the numbers behind ``readerlib._parallel.MIN_BYTES_PER_THREAD``.

``--cli`` also runs ``readerlib bench`` (small and large datasets, --scale
0.25) with and without a competitor.

    python benchmarks/bench_contention.py [--repeats 5] [--scale 1] [--main /work/main]
                                          [--sweep] [--cli] [--out FILE]
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KINDS = {"small": ("64 B records", 2_000_000), "large": ("64 KiB records", 4096)}

WORKER = r"""
import json, os, sys, time, statistics
import readerlib as rl
paths, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
default = rl.get_num_threads()
out = {"default_threads": default, "module": rl.__file__}
for kind, path in paths.items():
    times = {"default": [], "1 thread": []}
    for rep in range(repeats + 1):          # the first pass warms caches and is dropped
        for mode, n in (("default", default), ("1 thread", 1)) if rep % 2 == 0 else \
                (("1 thread", 1), ("default", default)):
            rl.set_num_threads(n)
            chain = rl.RecordIOReader(path).shuffle(10_000, seed=rep).batch(256)
            k = 0
            t = time.perf_counter()
            for b in chain:
                k += len(b[0])
            dt = time.perf_counter() - t
            chain.close()
            if rep:
                times[mode].append((k, dt))
    out[kind] = times
rl.set_num_threads(default)
try:
    from readerlib import _parallel
    out["pool"] = {"workers": _parallel._pool_workers(), "losing_splits": _parallel._losing_splits()}
except ImportError:        # an OpenMP build
    out["pool"] = None
print(json.dumps(out))
"""


class Competitors:
    """`n` busy processes spinning in Python, killed on exit."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        time.sleep(0.3 if self.n else 0)   # let them reach the loop
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def run_worker(pythonpath, paths, repeats, env_extra=None):
    env = dict(os.environ, PYTHONPATH=pythonpath, OPENBLAS_NUM_THREADS="1")
    env.pop("READERLIB_NUM_THREADS", None)
    env.update(env_extra or {})
    # -P: the build under test comes from PYTHONPATH, never from the current directory
    r = subprocess.run([sys.executable, "-P", "-c", WORKER, json.dumps(paths), str(repeats)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"worker failed ({pythonpath}):\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def rates(samples):
    return [k / dt for k, dt in samples]


def fmt_rate(kind, r):
    return f"{r / 1e6:.2f} M rec/s" if kind == "small" else f"{r * 65536 / 1e9:.2f} GB/s"


def chains(args, out):
    sys.path.insert(0, ROOT)
    from readerlib import bench
    tmp = tempfile.mkdtemp(prefix="rl-contention-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    paths = {}
    for kind, (_, n) in KINDS.items():
        paths[kind] = os.path.join(tmp, f"{kind}.rio")
        bench.make_dataset(paths[kind], kind, max(1, int(n * args.scale)))
    builds = [("this branch", ROOT)] + ([("main (OpenMP)", args.main)] if args.main else [])
    rows, pools = [], []
    try:
        for n_comp in (0, 1):
            with Competitors(n_comp):
                for name, pp in builds:
                    res = run_worker(pp, paths, args.repeats)
                    assert os.path.realpath(res["module"]).startswith(os.path.realpath(pp)), res["module"]
                    if res.get("pool"):
                        pools.append(f"{n_comp} competitor(s), {name}: {res['pool']['workers']} worker "
                                     f"thread(s) started, {res['pool']['losing_splits']} split(s) lost "
                                     "against one thread (each starts a serial back-off)")
                    for kind in KINDS:
                        d, o = rates(res[kind]["default"]), rates(res[kind]["1 thread"])
                        rows.append((KINDS[kind][0], n_comp, name, res["default_threads"], kind, d, o))
                        print(f"  {KINDS[kind][0]}, {n_comp} competitor(s), {name}: default "
                              f"{fmt_rate(kind, max(d))} / 1 thread {fmt_rate(kind, max(o))}", flush=True)
    finally:
        for p in paths.values():
            os.unlink(p)
        os.rmdir(tmp)
    out.append("| chain | busy competitors | build | default threads | default: best / median | "
               "1 thread: best / median | default / 1 thread (median) |")
    out.append("|---|---|---|---|---|---|---|")
    for chain, n_comp, name, dthreads, kind, d, o in rows:
        out.append(f"| {chain} | {n_comp} | {name} | {dthreads} | {fmt_rate(kind, max(d))} / "
                   f"{fmt_rate(kind, statistics.median(d))} | {fmt_rate(kind, max(o))} / "
                   f"{fmt_rate(kind, statistics.median(o))} | "
                   f"{statistics.median(d) / statistics.median(o):.2f}x |")
    out.append("")
    out.extend(f"- pool: {p}" for p in pools)


def sweep(args, out):
    sys.path.insert(0, ROOT)
    import numpy as np
    import readerlib as rl
    from readerlib import _core, _parallel
    old_min = _parallel._set_min_bytes_per_thread(1)   # always split: measure the split itself
    sizes = [32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20]
    rows = []

    def best_us(fn, total_bytes):
        reps = max(20, min(2000, int((256 << 20) / max(total_bytes, 1))))
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            ts.append((time.perf_counter() - t) / reps * 1e6)
        return min(ts), statistics.median(ts)

    try:
        for n_comp in (0, 1):
            with Competitors(n_comp):
                for size in sizes:
                    # cold data, as a chunk fresh from the page cache: each call
                    # reads the next slice of a 64 MiB buffer (2x the L3 cache)
                    pool = np.frombuffer(os.urandom(64 << 20), np.uint8)
                    slices = [memoryview(pool[o:o + size]) for o in range(0, len(pool) - size + 1, size)]
                    x = pool.reshape(-1, 256)
                    rng = np.random.default_rng(0)
                    idxs = [rng.integers(0, len(x), size // 256) for _ in range(16)]
                    y = np.empty((size // 256, 256), np.uint8)
                    res = {}
                    for t in (1, 2):
                        rl.set_num_threads(t)
                        it = iter(range(1 << 62))
                        res[("crc", t)] = best_us(
                            lambda: _core._crc32c_parallel_py(slices[next(it) % len(slices)]), size)
                        res[("gather", t)] = best_us(
                            lambda: rl.batch_reindex(x, idxs[next(it) % 16], out=y, num_threads=t), 2 * size)
                    rows.append((n_comp, size, res))
                    print(f"  sweep {n_comp} competitor(s) {size >> 10} KiB: "
                          + ", ".join(f"{k[0]} {k[1]}t {v[0]:.1f} us" for k, v in res.items()), flush=True)
    finally:
        _parallel._set_min_bytes_per_thread(old_min)
        rl.set_num_threads(_parallel._default_num_threads())
    out.append("Time per call, best of 5 rounds (median in parentheses); cold data (a 64 MiB "
               "buffer read slice by slice); the split forced on (threshold 1 byte).")
    out.append("")
    out.append("| busy competitors | bytes | crc32c 1 thread (us) | crc32c 2 threads (us) | "
               "gather 1 thread (us) | gather 2 threads (us) |")
    out.append("|---|---|---|---|---|---|")
    for n_comp, size, res in rows:
        out.append(f"| {n_comp} | {size >> 10} KiB | " + " | ".join(
            f"{res[(k, t)][0]:.1f} (med {res[(k, t)][1]:.1f})" for k in ("crc", "gather") for t in (1, 2)) + " |")


def cli(args, out):
    env = dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1")
    code = "from readerlib.cli import main; main(['bench', '--datasets', 'small,large', '--scale', '0.25'])"
    for n_comp in (0, 1):
        with Competitors(n_comp):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                               timeout=1800)
        out.append(f"`readerlib bench --datasets small,large --scale 0.25`, {n_comp} busy competitor(s):")
        out.append("```")
        out.extend(line for line in r.stdout.splitlines() if not line.startswith("readerlib bench:"))
        out.append("```")
        print("\n".join(out[-6:]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--main", default=None, help="another readerlib tree to compare (PYTHONPATH)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cli", action="store_true")
    ap.add_argument("--no-chains", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    out = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
           f"Python {platform.python_version()}.  Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  "
           f"Load average (1 min) before: {load:.1f}.", ""]
    if not args.no_chains:
        chains(args, out)
        out.append("")
    if args.sweep:
        sweep(args, out)
        out.append("")
    if args.cli:
        cli(args, out)
    out.append(f"Load average (1 min) after: {os.getloadavg()[0]:.1f}.")
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
