"""Compiled map (readerlib.transform) against the same map in Python (issue 14 item 2).

    python benchmarks/bench_cext.py [--repeat R] [--out FILE]

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
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import readerlib as rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_example(where):
    src = os.path.join(ROOT, "examples", "normalize")
    dst = os.path.join(where, "normalize")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build", "*.c", "*.so"))
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__)))
    env = dict(os.environ, PYTHONPATH=pkg_parent + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=dst, env=env,
                   check=True, capture_output=True, timeout=600)
    sys.path.insert(0, dst)
    import normalize
    return normalize


def datasets(rng):
    small_n = 200_000
    small = ({"x": rng.integers(-32768, 32768, size=(small_n, 32), dtype=np.int16)},
             rl.Schema([rl.Field("x", np.int16, (32,))]), "x", 32, 256)
    frames_n = 1500
    feats = [rng.integers(-32768, 32768, size=(int(t), 80), dtype=np.int16)
             for t in rng.integers(50, 501, size=frames_n)]
    frames = ({"feats": feats, "label": np.arange(frames_n, dtype=np.int64)},
              rl.Schema([rl.Field("feats", np.int16, (80,), lod_level=1), rl.Field("label", np.int64)]),
              "feats", 80, 64)
    return {"small": small, "frames": frames}


def cases(normalize, cols, schema, field, dim, batch):
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
            return n, dt
        return go

    nt = rl.get_num_threads()
    return nbytes, {
        "no map": run(lambda r: r),
        "Python map, 1 thread": run(lambda r: r.map(py_fn, num_threads=1)),
        "Python map, 2 threads": run(lambda r: r.map(py_fn, num_threads=2)),
        "compiled map, 1 thread": run(lambda r: r.map(normalize.Normalize(field, mean, std), num_threads=1)),
        f"compiled map, {nt} threads (pool)": run(lambda r: r.map(normalize.Normalize(field, mean, std))),
    }


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=None, help="write the Markdown table here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        normalize = build_example(tmp)
        rng = np.random.default_rng(0)
        lines = [f"readerlib.get_num_threads() = {rl.get_num_threads()}, os.cpu_count() = {os.cpu_count()}, "
                 f"{args.repeat} interleaved rounds; records/s (best, median), input MB/s at the best, "
                 f"ratio of best to the Python map on 1 thread in the same run.", ""]
        for name, (cols, schema, field, dim, batch) in datasets(rng).items():
            check_equal(normalize, cols, schema, field, dim)
            nbytes, cs = cases(normalize, cols, schema, field, dim, batch)
            res = {k: [] for k in cs}
            n_items = {}
            for _ in range(args.repeat):
                for k, go in cs.items():
                    n, dt = go()
                    n_items[k] = n
                    res[k].append(n / dt)
            base = max(res["Python map, 1 thread"])
            lines += [f"### {name}: {n_items['no map']} instances, {nbytes / 1e6:.1f} MB of int16 input, "
                      f"batch {batch}", "",
                      "| case | records/s best | records/s median | input MB/s (best) | vs Python map, 1 thread |",
                      "|---|---|---|---|---|"]
            for k, v in res.items():
                best, med = max(v), statistics.median(v)
                mbs = best * nbytes / n_items[k] / 1e6
                lines.append(f"| {k} | {best:,.0f} | {med:,.0f} | {mbs:,.0f} | {best / base:.2f}x |")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
