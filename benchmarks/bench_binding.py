"""Does Cython's binding=True (real signatures for inspect) slow the per-batch path?

    python benchmarks/bench_binding.py TREE_A TREE_B [--repeats R] [--out FILE]
    python benchmarks/bench_binding.py --quick [TREE_A TREE_B]

TREE_A and TREE_B are two builds of the same readerlib source (the package's
parent folders), compiled with ``"binding": True`` and ``"binding": False``
in setup.py's directives.  Each round runs, in a fresh interpreter per tree
(harness.run_child, ``python -P`` with PYTHONPATH=TREE; the order alternates
A B, B A, ...), the per-batch path where a method call per batch is the cost:
64 B records in memory, ``ArrayReader -> batch(B)``, iterated with ``for`` and
with ``read_next()``, for B = 1, 16 and 256 (each the best of 3 passes in the
child).  Reports batches/s best and median per tree over the rounds and the
ratio of the bests (same run).

``--quick`` (a smoke run) needs no trees: without them it compares the build
under test (the readerlib this interpreter imports) with itself, on 1/20 of
the records.  ``--repeat R`` is the older spelling of ``--repeats R``.
"""
import argparse
import os
import statistics

import harness

CHILD = r"""
import sys, time, numpy as np, readerlib as rl
per = int(sys.argv[1])          # batches per pass (20,000; fewer in --quick)
out = {"module": rl.__file__}
x = np.zeros((200_000, 8), np.int64)
for b in (1, 16, 256):
    n = min(200_000, per * b)
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
emit(out)
"""


def run(tree, per):
    # -P: the build under test comes from PYTHONPATH, never from the current directory
    (res,), _ = harness.run_child(CHILD, [per], timeout=600, env={"PYTHONPATH": tree}, python_flags=("-P",))
    mod = res.pop("module")
    if not os.path.realpath(mod).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"{tree}: the child imported readerlib from {mod}, not from this tree")
    return res


def main(argv=None):
    p = harness.parser(__doc__, repeats=5)
    p.add_argument("tree_a", nargs="?")
    p.add_argument("tree_b", nargs="?")
    p.add_argument("--repeat", dest="repeats", type=int, help=argparse.SUPPRESS)   # the older spelling
    args = harness.parse(p, argv)
    if args.tree_a is None or args.tree_b is None:
        if not args.quick or args.tree_a is not None:
            p.error("give two trees, TREE_A and TREE_B (only --quick may omit both)")
        import readerlib
        args.tree_a = args.tree_b = os.path.dirname(os.path.dirname(os.path.abspath(readerlib.__file__)))
    per = 1_000 if args.quick else 20_000
    same = os.path.realpath(args.tree_a) == os.path.realpath(args.tree_b)
    with harness.Report(args, "Cython binding=True against binding=False: the per-batch path") as rep:
        rep.add(f"- A = {args.tree_a}, B = {args.tree_b}" + (" (the same build: A/B shows the noise)" if same else ""),
                f"- {args.repeats} rounds, a fresh interpreter per tree per round (order alternating); "
                f"batches/s, each the best of 3 passes of {per:,} batches (fewer for batch 256) in the child", "")
        res = {"A": [], "B": []}
        for r in range(args.repeats):
            for key in (("A", "B") if r % 2 == 0 else ("B", "A")):
                res[key].append(run(args.tree_a if key == "A" else args.tree_b, per))
        rows = []
        for k in res["A"][0]:
            a = [r[k] for r in res["A"]]
            b = [r[k] for r in res["B"]]
            rows.append([k, f"{max(a):,.0f}", f"{statistics.median(a):,.0f}", f"{max(b):,.0f}",
                         f"{statistics.median(b):,.0f}", f"{max(a) / max(b):.3f}"])
        rep.table(["case", "A best", "A median", "B best", "B median", "A/B (best)"], rows)


if __name__ == "__main__":
    main()
