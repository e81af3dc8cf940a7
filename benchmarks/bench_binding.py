"""Does Cython's binding=True (real signatures for inspect) slow the per-batch path?

    python benchmarks/bench_binding.py TREE_A TREE_B [--repeat R]

TREE_A and TREE_B are two builds of the same readerlib source (the package's
parent folders), compiled with ``"binding": True`` and ``"binding": False``
in setup.py's directives.  Each round runs, in a fresh interpreter per tree
(alternating), the per-batch path where a method call per batch is the cost:
64 B records in memory, ``ArrayReader -> batch(B)``, iterated with ``for`` and
with ``read_next()``, for B = 1, 16 and 256.  Reports batches/s best and
median per tree and the ratio of the bests (same run).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time, numpy as np, readerlib as rl
out = {}
x = np.zeros((200_000, 8), np.int64)
for b in (1, 16, 256):
    n = min(200_000, 20_000 * b)
    r = rl.ArrayReader(x[:n]).batch(b)
    for mode in ("for", "read_next"):
        best = 0.0
        for _ in range(3):
            r.reset()
            t = time.perf_counter()
            k = 0
            if mode == "for":
                for _batch in r:
                    k += 1
            else:
                rn = r.read_next
                while rn() is not None:
                    k += 1
            best = max(best, k / (time.perf_counter() - t))
        out[f"batch {b}, {mode}"] = best
print(json.dumps(out))
"""


def run(tree):
    env = dict(os.environ, PYTHONPATH=tree)
    p = subprocess.run([sys.executable, "-P", "-c", CHILD], env=env, capture_output=True, text=True,
                       timeout=600, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree_a")
    p.add_argument("tree_b")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    res = {args.tree_a: [], args.tree_b: []}
    for _ in range(args.repeat):
        for t in (args.tree_a, args.tree_b):
            res[t].append(run(t))
    keys = list(res[args.tree_a][0])
    print(f"| case | A best | A median | B best | B median | A/B (best) |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        a = [r[k] for r in res[args.tree_a]]
        b = [r[k] for r in res[args.tree_b]]
        print(f"| {k} | {max(a):,.0f} | {statistics.median(a):,.0f} | {max(b):,.0f} | "
              f"{statistics.median(b):,.0f} | {max(a) / max(b):.3f} |")
    print(f"\nA = {args.tree_a}, B = {args.tree_b}, {args.repeat} interleaved rounds; batches/s")


if __name__ == "__main__":
    main()
