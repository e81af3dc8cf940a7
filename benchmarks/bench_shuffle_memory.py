"""Shuffle memory (compaction, inline small records): ns per record and peak RSS, this build against another.

    python benchmarks/bench_shuffle_memory.py --old /tmp/compact_old [--repeats 3] [--big] [--out FILE]

`--old` is a copy of the tree with the build before the change (its
readerlib/ is put first on PYTHONPATH in the "old" children; without it the
current build is compared with itself).  `--quick`: tiny files, a smoke run.  Every
measurement is a fresh child process; old and new alternate run by run.
Files go to --tmp and are deleted at the end.  `--big` adds the 10 M x 64 B
(640 MB) file through shuffle(1M).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness

import readerlib  # noqa: E402  (the build under test: the in-place tree or an install)

# the folder holding the readerlib under test (the source tree when built in
# place, site-packages when installed): the "new" children import it from there
HERE = os.path.dirname(os.path.dirname(os.path.abspath(readerlib.__file__)))

SPEED = r"""
import sys, time, json, resource
import numpy as np
import readerlib as rl
import os, readerlib.readers._shuffle as _s; assert _s.__file__.startswith(os.getcwd()), (_s.__file__, os.getcwd())
kind, arg, n, buf, rec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
imp = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if kind == "array":
    src = rl.ArrayReader({"x": np.random.default_rng(0).integers(0, 256, (n, rec), dtype=np.uint8)})
else:
    src = rl.RecordIOReader(arg)
chain = src.shuffle(buf, seed=0).batch(256)
k = 0
t = time.perf_counter()
for (x,) in chain:
    k += len(x)
dt = time.perf_counter() - t
assert k == n, (k, n)
print(json.dumps({"ns": dt * 1e9 / k, "import_MB": imp,
                  "peak_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

RSS_TF = r"""
import sys, json, resource
import tensorflow as tf
path, buf = sys.argv[1], int(sys.argv[2])
imp = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
ds = (tf.data.TFRecordDataset(path).shuffle(buf, seed=0).batch(256)
      .map(lambda x: tf.io.decode_raw(x, tf.uint8)))
k = 0
for x in ds.as_numpy_iterator():
    k += len(x)
print(json.dumps({"n": k, "import_MB": imp,
                  "peak_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def child(code, args, pythonpath, timeout=900):
    env = dict(os.environ, PYTHONPATH=pythonpath, TF_CPP_MIN_LOG_LEVEL="3")
    # cwd: `-c` puts the working directory first on sys.path, before PYTHONPATH
    p = subprocess.run([sys.executable, "-c", code] + [str(a) for a in args], env=env, cwd=pythonpath,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


WRITE = r"""
import sys
import numpy as np
import readerlib as rl
kind, path, n, rec = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
step = max(1, (64 << 20) // rec)
if kind == "rio":
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (rec,))])) as w:
        for s in range(0, n, step):
            w.write_batch({"x": rng.integers(0, 256, size=(min(step, n - s), rec), dtype=np.uint8)})
else:
    with rl.TFRecordWriter(path) as w:      # byte-compatible with tf.io.TFRecordWriter
        for s in range(0, n, step):
            w.write_batch(rng.integers(0, 256, size=(min(step, n - s), rec), dtype=np.uint8))
print("{}")
"""


# Files are written by children: a child forked from a big parent would start
# with the parent's maxrss (Linux keeps ru_maxrss across fork + exec).
def write_recordio(path, n, rec):
    child(WRITE, ["rio", path, n, rec], HERE)
    return path


def write_tfrecord(path, n, rec):
    child(WRITE, ["tf", path, n, rec], HERE)
    return path


def main(argv=None):
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--old", default=HERE, help="tree with the build to compare against (default: this one)")
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--no-tf", action="store_true")
    args = harness.parse(ap, argv)
    if not harness.want(args, "tf"):
        args.no_tf = True
    q = 100 if args.quick else 1                # --quick: 1/100 of every size
    builds = {"old": args.old, "new": HERE}
    rep = harness.Report(args, "Shuffle memory (compaction, inline small records): ns per record and peak RSS, old and new build")
    with rep:
        _run(args, q, builds, rep)


def _run(args, q, builds, rep):
    print = rep.add                             # the report collects the lines
    tmp = tempfile.mkdtemp(prefix="shufmem-", dir=args.tmp)
    files = []
    try:
        rio2m = write_recordio(os.path.join(tmp, "2m.rio"), 2_000_000 // q, 64); files.append(rio2m)
        rio64k = write_recordio(os.path.join(tmp, "64k.rio"), 4096 // q, 65536); files.append(rio64k)
        speed = [(f"ArrayReader {2_000_000 // q:,} x 64 B", "array", "-", 2_000_000 // q, b // q, 64)
                 for b in (1_000, 10_000, 100_000, 1_000_000)]
        speed += [(f"RecordIO {2_000_000 // q:,} x 64 B", "file", rio2m, 2_000_000 // q, b // q, 64) for b in (10_000, 100_000)]
        speed += [(f"RecordIO {4096 // q:,} x 64 KiB", "file", rio64k, 4096 // q, 1_000 // q, 65536)]
        res = {}
        for _ in range(args.repeats):
            for case in speed:
                for name, pp in builds.items():
                    r = child(SPEED, case[1:], pp)
                    res.setdefault((case, name), []).append(r)
        print("", "| chain -> shuffle(B) -> batch(256) | B | old ns/rec best / median | new ns/rec best / median | new / old (best) | old peak above import MB | new peak above import MB |")
        print("|---|---|---|---|---|---|---|")
        # (ArrayReader rows: the peak includes the 128 MB source array)
        for case in speed:
            o, nw = res[(case, "old")], res[(case, "new")]
            on = [r["ns"] for r in o]; nn = [r["ns"] for r in nw]
            print(f"| {case[0]} | {case[4]:,} | {min(on):.1f} / {statistics.median(on):.1f} | "
                  f"{min(nn):.1f} / {statistics.median(nn):.1f} | {min(nn) / min(on):.2f}x | "
                  f"{min(r['peak_MB'] - r['import_MB'] for r in o):.0f} | "
                  f"{min(r['peak_MB'] - r['import_MB'] for r in nw):.0f} |")
        for f in files:
            os.unlink(f)
        files.clear()

        rss = []
        rio1m = write_recordio(os.path.join(tmp, "1m.rio"), 1_000_000 // q, 64); files.append(rio1m)
        rss.append((f"RecordIO {1_000_000 // q:,} x 64 B", rio1m, 1_000_000 // q, 100_000 // q))
        tfr = None
        if not args.no_tf:
            tfr = write_tfrecord(os.path.join(tmp, "1m.tfrecord"), 1_000_000 // q, 64); files.append(tfr)
        out = {}
        for _ in range(args.repeats):
            for label, path, n, b in rss:
                for name, pp in builds.items():
                    out.setdefault((label, b, name), []).append(child(SPEED, ["file", path, n, b, 64], pp))
            if tfr:
                out.setdefault((f"TFRecord {1_000_000 // q:,} x 64 B", 100_000 // q, "tf.data"), []).append(
                    child(RSS_TF, [tfr, 100_000 // q], HERE))
        if args.big and not args.quick:
            for f in files:
                os.unlink(f)
            files.clear()
            rio10m = write_recordio(os.path.join(tmp, "10m.rio"), 10_000_000, 64); files.append(rio10m)
            for _ in range(min(args.repeats, 2)):
                for name, pp in builds.items():
                    out.setdefault(("RecordIO 10,000,000 x 64 B", 1_000_000, name), []).append(
                        child(SPEED, ["file", rio10m, 10_000_000, 1_000_000, 64], pp, timeout=1800))
        print("", "| one pass, fresh process: file -> shuffle(B) -> batch(256) | B | build | peak RSS MB (min / max) | after import MB | peak above import MB (min) | buffer payload MB | ns/rec (best) |")
        print("|---|---|---|---|---|---|---|---|")
        for (label, b, name), rs in out.items():
            pk = [r["peak_MB"] for r in rs]
            ns = min(r.get("ns", float("nan")) for r in rs)
            print(f"| {label} | {b:,} | {name} | {min(pk):.0f} / {max(pk):.0f} | {min(r['import_MB'] for r in rs):.0f} | "
                  f"{min(r['peak_MB'] - r['import_MB'] for r in rs):.0f} | {b * 64 / 1e6:.1f} | "
                  f"{'-' if ns != ns else f'{ns:.1f}'} |")
    finally:
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
