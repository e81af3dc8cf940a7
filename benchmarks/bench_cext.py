"""Compiled map (readerlib.transform) against the same map in Python (issue 14 item 2).

    python benchmarks/bench_cext.py [--repeats R] [--no-compiled] [--quick] [--busy N] [--out FILE]

Builds examples/normalize (int16 -> float32 feature normalisation) in a temp
dir, then times, on the same in-memory data, interleaved (every case once per
round, R rounds; best and median reported, ratios within the same run):

- the chain without a map:            ArrayReader -> batch(B)
- the Python/NumPy map:               ... .map(normalize_numpy) ... on 1 and 2 threads
- the compiled map:                   ... .map(Normalize(...)) ... on 1 thread and on
                                      readerlib's threads (readerlib.get_num_threads())

on two data sets: "small" (fixed [32] int16 instances, 64 B each: the Python
call per instance dominates) and "frames" (sequences of 50..500 frames x 80
int16, ~44 KB each: the arithmetic and memory traffic dominate).

The rounds are the harness's (harness.interleaved: the order rotates each
round).  ``--repeat R`` is the older spelling of ``--repeats R``.  ``--quick``:
2,000 small instances and 30 sequences, a smoke run; it still builds the
example (``--no-compiled`` skips the build and the compiled map, and says so
in the report).
"""
import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

import harness
import numpy as np

import readerlib as rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_example(where):
    src = os.path.join(ROOT, "examples", "normalize")
    dst = os.path.join(where, "normalize")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "*.c", "*.so"))
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=dst, env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        raise SystemExit(f"building examples/normalize failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    # load the built module from its file (no sys.path entry)
    (so,) = glob.glob(os.path.join(dst, "normalize*.so")) or glob.glob(os.path.join(dst, "normalize*.pyd"))
    spec = importlib.util.spec_from_file_location("normalize", so)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["normalize"] = mod
    spec.loader.exec_module(mod)
    return mod


class NumpyOnly:
    """The example's NumPy map without the compiled module (``--no-compiled``)."""

    def __init__(self):
        path = os.path.join(ROOT, "examples", "normalize", "normalize.pyx")
        src = open(path).read()
        # normalize_numpy is a plain `def` in pure Python syntax: take it from the source
        start = src.index("def normalize_numpy")
        end = src.find("\ncdef ", start)
        ns = {"np": np}
        exec(compile(src[start:end if end >= 0 else None], path, "exec"), ns)
        self.normalize_numpy = ns["normalize_numpy"]


def datasets(rng, quick=False):
    small_n = 2_000 if quick else 200_000
    small = ({"x": rng.integers(-32768, 32768, size=(small_n, 32), dtype=np.int16)},
             rl.Schema([rl.Field("x", np.int16, (32,))]), "x", 32, 256)
    frames_n = 30 if quick else 1500
    feats = [rng.integers(-32768, 32768, size=(int(t), 80), dtype=np.int16)
             for t in rng.integers(50, 501, size=frames_n)]
    frames = ({"feats": feats, "label": np.arange(frames_n, dtype=np.int64)},
              rl.Schema([rl.Field("feats", np.int16, (80,), lod_level=1), rl.Field("label", np.int64)]),
              "feats", 80, 64)
    return {"small": small, "frames": frames}


def cases(normalize, cols, schema, field, dim, batch, compiled=True):
    rng = np.random.default_rng(1)
    mean = rng.normal(size=dim).astype(np.float32)
    std = (rng.random(dim) + 0.5).astype(np.float32)
    names = schema.names
    nbytes = sum(np.asarray(v).nbytes for v in cols.values()) if field == "x" else \
        sum(f.nbytes for f in cols["feats"])

    def py_fn(x):
        return normalize.normalize_numpy(x, names, field, mean, std)

    def run(make):
        def go():
            r = make(rl.ArrayReader(cols, schema=schema)).batch(batch)
            n = 0
            t = time.perf_counter()
            for b in r:
                n += len(b[0]) if not b[0].lod else len(b[0].lod[0]) - 1
            dt = time.perf_counter() - t
            r.close()
            return harness.Sample(dt, n)
        return go

    nt = rl.get_num_threads()
    cs = {
        "no map": run(lambda r: r),
        "Python map, 1 thread": run(lambda r: r.map(py_fn, num_threads=1)),
        "Python map, 2 threads": run(lambda r: r.map(py_fn, num_threads=2)),
    }
    if compiled:
        cs["compiled map, 1 thread"] = run(lambda r: r.map(normalize.Normalize(field, mean, std), num_threads=1))
        cs[f"compiled map, {nt} threads (pool)"] = run(lambda r: r.map(normalize.Normalize(field, mean, std)))
    return nbytes, cs


def check_equal(normalize, cols, schema, field, dim):
    """The two maps give the same bytes (on a slice), so the timings compare like with like."""
    mean = np.linspace(-3, 3, dim).astype(np.float32)
    std = np.linspace(0.5, 2, dim).astype(np.float32)
    sub = {k: v[:200] for k, v in cols.items()}
    a = list(rl.ArrayReader(sub, schema=schema).map(normalize.Normalize(field, mean, std)))
    b = list(rl.ArrayReader(sub, schema=schema).map(
        lambda x: normalize.normalize_numpy(x, schema.names, field, mean, std)))
    assert all(all(np.array_equal(u, v) for u, v in zip(x, y)) for x, y in zip(a, b)) and len(a) == len(b)


def main(argv=None):
    p = harness.parser(__doc__, repeats=5)
    p.add_argument("--repeat", dest="repeats", type=int, help=argparse.SUPPRESS)   # the older spelling
    p.add_argument("--no-compiled", action="store_true",
                   help="skip building examples/normalize and the compiled map (the NumPy map only)")
    args = harness.parse(p, argv)
    with harness.Report(args, "Compiled map (readerlib.transform) against the same map in Python") as rep, \
            tempfile.TemporaryDirectory() as tmp:
        if args.no_compiled:
            normalize = NumpyOnly()
            print("bench_cext: --no-compiled: examples/normalize not built, the compiled map not timed", flush=True)
            rep.add("- **compiled map skipped** (--no-compiled): examples/normalize was not built")
        else:
            t = time.perf_counter()
            normalize = build_example(tmp)
            rep.add(f"- examples/normalize built in {time.perf_counter() - t:.1f} s")
        rng = np.random.default_rng(0)
        rep.add(f"- readerlib.get_num_threads() = {rl.get_num_threads()}, os.cpu_count() = {os.cpu_count()}, "
                f"{args.repeats} interleaved rounds; records/s (best, median), input MB/s at the best, "
                f"ratio of best to the Python map on 1 thread in the same run.", "")
        for name, (cols, schema, field, dim, batch) in datasets(rng, args.quick).items():
            if not args.no_compiled:
                check_equal(normalize, cols, schema, field, dim)
            nbytes, cs = cases(normalize, cols, schema, field, dim, batch, compiled=not args.no_compiled)
            st = harness.interleaved(cs, args.repeats, warmup=0)
            base = st["Python map, 1 thread"].rate_best
            n_items = st["no map"].units
            rows = []
            for k, v in st.items():
                mbs = v.rate_best * nbytes / v.units / 1e6
                rows.append([k, f"{v.rate_best:,.0f}", f"{v.rate_median:,.0f}", f"{mbs:,.0f}",
                             f"{v.rate_best / base:.2f}x"])
            rep.table(["case", "records/s best", "records/s median", "input MB/s (best)", "vs Python map, 1 thread"],
                      rows, title=f"#### {name}: {n_items:.0f} instances, {nbytes / 1e6:.1f} MB of int16 input, "
                                  f"batch {batch}")


if __name__ == "__main__":
    main()
