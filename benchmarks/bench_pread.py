"""Cost of reading through pread into owned blocks (issue 12) instead of a mapping.

    python benchmarks/bench_pread.py --old OLD_CHECKOUT [--repeats 5] [--scale 1] [--quick] [--out FILE]

OLD_CHECKOUT: a built copy of the version before (e.g. `git archive f1dfb28 | tar -x -C /tmp/oldrl`
then `python setup.py build_ext --inplace` there).  Without --old, the build
under test is compared with itself (a smoke run: the ratios measure noise).

Writes the files once, then alternates, round after round, a subprocess that
imports readerlib from `--old` (a checkout whose build maps the files) and
one that imports it from this checkout (pread), so both see the same machine
load.  Each subprocess times every chain in CPU seconds (user + system, all
threads: on a shared machine far steadier than wall time, and it counts the
kernel's work -- page faults, pread copies) as the best of 2 passes over a
file in the page cache; reported are records per CPU second, best and
median over rounds, and the ratio new / old of each.

Chains (bench_core's and bench_files'):
  RecordIO: RecordIOReader(p, low_memory=...).shuffle(10000).batch(256)
  TFRecord: TFRecordReader(p, index=False).batch(256)
at 64 B and 64 KiB records.
"""
import json
import os
import statistics
import tempfile

import harness

CHILD = r"""
import json, sys, time
import readerlib as rl
try:
    TFRecordReader = rl.TFRecordReader
except AttributeError:      # an older build
    from readerlib.formats._tfrecord import TFRecordReader
files = json.loads(sys.argv[1])
out = {}
def best(make, passes=2):
    # CPU seconds (user + system, all threads) per pass: on a shared machine
    # they move far less than wall time, and they count the kernel's share
    # (page faults, pread copies) that this comparison is about
    b = w = None
    for _ in range(passes):
        r = make()
        t, t0 = time.process_time(), time.perf_counter()
        n = 0
        for (x,) in r:
            n += len(x)
        dt, dw = time.process_time() - t, time.perf_counter() - t0
        r.close()
        b = dt if b is None else min(b, dt)
        w = dw if w is None else min(w, dw)
    return n / b, n / w
for name, (kind, path) in files.items():
    if kind == "rio":
        out[name + ", low_memory=True"] = best(lambda: rl.RecordIOReader(path).shuffle(10000, seed=0).batch(256))
        out[name + ", low_memory=False"] = best(
            lambda: rl.RecordIOReader(path, low_memory=False).shuffle(10000, seed=0).batch(256))
    else:
        out[name] = best(lambda: TFRecordReader(path, index=False).batch(256))
emit(out)
"""


def build_root():
    """The folder that holds the readerlib under test (the in-place build or an install)."""
    import readerlib
    return os.path.dirname(os.path.dirname(os.path.abspath(readerlib.__file__)))


def write_files(tmp, scale):
    import numpy as np
    import readerlib as rl
    from readerlib import TFRecordWriter
    files = {}
    for size, n in ((64, max(1000, int(1_000_000 * scale))), (65536, max(16, int(4096 * scale)))):
        rng = np.random.default_rng(size)
        x = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        p = os.path.join(tmp, f"r{size}.rio")
        with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (size,))])) as w:
            w.write_batch({"x": x})
        files[f"RecordIO {n:,} x {size} B"] = ("rio", p)
        p = os.path.join(tmp, f"r{size}.tfrecord")
        with TFRecordWriter(p) as w:
            w.write_batch(x)
        files[f"TFRecord {n:,} x {size} B"] = ("tf", p)
    return files


def main(argv=None):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--old", default=None, help="checkout with the old build (default: this build)")
    ap.add_argument("--scale", type=float, default=1.0)
    a = harness.parse(ap, argv)
    if a.quick:
        a.scale = min(a.scale, 0.005)
    new_root = build_root()
    old_root = a.old or new_root
    with harness.Report(a, "Reading through pread (new) against a mapping (old)") as rep, \
            tempfile.TemporaryDirectory(prefix="rl-pread-") as tmp:
        rep.add(f"- old: `{old_root}`, new: `{new_root}`" + ("" if a.old else " (no --old: the same build)"), "")
        files = write_files(tmp, a.scale)
        res = {"old": [], "new": []}
        for _ in range(a.repeats):      # rounds alternate old and new under the same load
            for which, root in (("old", old_root), ("new", new_root)):
                (got,), _ = harness.run_child(CHILD, [json.dumps(files)], timeout=1800,
                                              env={"PYTHONPATH": root, "OMP_NUM_THREADS": "1"},
                                              python_flags=("-P",))
                res[which].append(got)
        for k, unit in ((0, "rec/CPU-s"), (1, "rec/s (wall)")):
            rows = []
            for case in res["old"][0]:
                o = [r[case][k] for r in res["old"]]
                n = [r[case][k] for r in res["new"]]
                rows.append([case, f"{max(o):,.0f}", f"{max(n):,.0f}", f"{max(n) / max(o):.2f}",
                             f"{statistics.median(o):,.0f}", f"{statistics.median(n):,.0f}",
                             f"{statistics.median(n) / statistics.median(o):.2f}"])
            rep.table(["chain", f"old best {unit}", "new best", "best new/old", "old median", "new median",
                       "median new/old"], rows)


if __name__ == "__main__":
    main()
