"""A/B regression check of two readerlib builds in the same run (issue 13).

    python benchmarks/bench_ab.py --old /path/to/old/tree --new . [--repeats 11] [--inner 5] [--n64 N] [--n64k N] [--out FILE] [--quick]

Each build runs in its own fresh interpreter per round (``python -P`` with
``PYTHONPATH`` set to that build's tree, nothing else on the path; the child
checks that ``readerlib`` came from there), old and new alternating which
goes first, round after round.  A round's figure for a case is the best of a
few calls inside that child; over the rounds the report gives best and
median seconds per build and the new/old ratio of each (> 1: new is slower).

Cases (the hot paths users feel):

- RecordIO file -> shuffle(10k) -> batch(256), 64 B and 64 KiB records, each
  file written by that build's own writer (the new writer's default is
  RecordIO v2), and for the new build also a v1 file written by it
  (``version=1``), to separate the format from the code;
- ArrayReader (in memory) -> shuffle(10k) -> batch(256), 64 B and 64 KiB;
- TFRecordReader -> shuffle(10k) -> batch(256), 64 B;
- RecordIO 64 B -> shuffle(10k) -> map(identity) (1 thread) -> batch(256),
  and -> batch(256) -> map_batches(identity);
- batch_reindex (forward) and ctc_greedy_decoder at two shapes each,
  ``num_threads=1`` (the kernel itself, not the 2-core machine's scheduling);
- ``import readerlib``: wall time of a fresh ``python -P -X importtime -c
  "import readerlib"`` and the cumulative import time it reports for
  readerlib.

``--quick``: tiny sizes, 2 rounds (a smoke run; the figures mean nothing).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import harness

#: Written by each build into its own folder: a schema of one uint8 field.
SETUP = r'''
import os, sys, json
import numpy as np
import readerlib as rl
root, out, n64, n64k = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
here = os.path.realpath(os.path.dirname(os.path.dirname(rl.__file__)))
assert here == os.path.realpath(root), f"readerlib came from {here}, not {root}"
rng = np.random.default_rng(0)
files = {}
def rio(name, n, rec, **kw):
    p = os.path.join(out, name)
    with rl.RecordIOWriter(p, rl.Schema([rl.Field("x", "uint8", (rec,))]), **kw) as w:
        for s in range(0, n, 4096):
            w.write_batch({"x": rng.integers(0, 256, size=(min(4096, n - s), rec), dtype=np.uint8)})
    return p
files["rio64"] = rio("r64.rio", n64, 64)
files["rio64k"] = rio("r64k.rio", n64k, 65536)
try:                       # a v1 file from a writer that writes v2 by default
    files["rio64_v1"] = rio("r64_v1.rio", n64, 64, version=1)
    files["rio64k_v1"] = rio("r64k_v1.rio", n64k, 65536, version=1)
except TypeError:          # a writer without versions (it writes v1)
    pass
p = os.path.join(out, "t64.tfrecord")
with rl.TFRecordWriter(p) as w:
    for s in range(0, n64, 4096):
        w.write_batch(rng.integers(0, 256, size=(min(4096, n64 - s), 64), dtype=np.uint8))
files["tf64"] = p
emit(files)
'''

#: One round of one build: every case, best of ``inner`` calls each.
ROUND = r'''
import os, sys, json, time
import numpy as np
import readerlib as rl
from readerlib.kernels import batch_reindex, ctc_greedy_decoder
root, files, inner, quick = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
here = os.path.realpath(os.path.dirname(os.path.dirname(rl.__file__)))
assert here == os.path.realpath(root), f"readerlib came from {here}, not {root}"
BUF, BATCH = 10000, 256

def identity(x):
    return x

def drain(make):
    def run():
        r = make()
        n, t = 0, time.perf_counter()
        for b in r:
            n += len(b[0])
        dt = time.perf_counter() - t
        r.close()
        return dt, n
    return run

def calls(fn, number):
    def run():
        t = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - t) / number, 1
    return run

rng = np.random.default_rng(1)
cases = {}
for key, label in (("rio64", "RecordIO 64 B"), ("rio64k", "RecordIO 64 KiB"),
                   ("rio64_v1", "RecordIO 64 B, v1 file"), ("rio64k_v1", "RecordIO 64 KiB, v1 file")):
    if key in files:
        cases[label + " -> shuffle -> batch"] = drain(
            lambda p=files[key]: rl.RecordIOReader(p).shuffle(BUF, seed=0).batch(BATCH))
x64 = rng.integers(0, 256, size=(int(sys.argv[5]), 64), dtype=np.uint8)
x64k = rng.integers(0, 256, size=(int(sys.argv[6]), 65536), dtype=np.uint8)
cases["ArrayReader 64 B -> shuffle -> batch"] = drain(
    lambda: rl.ArrayReader({"x": x64}).shuffle(BUF, seed=0).batch(BATCH))
cases["ArrayReader 64 KiB -> shuffle -> batch"] = drain(
    lambda: rl.ArrayReader({"x": x64k}).shuffle(BUF, seed=0).batch(BATCH))
cases["TFRecord 64 B -> shuffle -> batch"] = drain(
    lambda: rl.TFRecordReader(files["tf64"]).shuffle(BUF, seed=0).batch(BATCH))
cases["RecordIO 64 B -> shuffle -> map(identity) -> batch"] = drain(
    lambda: rl.RecordIOReader(files["rio64"]).shuffle(BUF, seed=0).map(identity).batch(BATCH))
cases["RecordIO 64 B -> shuffle -> batch -> map_batches(identity)"] = drain(
    lambda: rl.RecordIOReader(files["rio64"]).shuffle(BUF, seed=0).batch(BATCH).map_batches(identity))
if "rio64_v1" in files:
    cases["RecordIO 64 B, v1 file -> shuffle -> batch -> map_batches(identity)"] = drain(
        lambda: rl.RecordIOReader(files["rio64_v1"]).shuffle(BUF, seed=0).batch(BATCH).map_batches(identity))

for N, M, inner_dim, number in ((256, 512, 64, 200), (65536, 65536, 64, 5)):
    if quick:
        N, M, number = min(N, 1024), min(M, 1024), 2
    x = rng.standard_normal((M, inner_dim), dtype=np.float32)
    idx = rng.integers(0, M, N).astype(np.int64)
    cases[f"batch_reindex {(N, M, inner_dim)}"] = calls(
        lambda x=x, idx=idx: batch_reindex(x, idx, num_threads=1), number)
for T, B, V, number in ((50, 1, 29, 300), (200, 128, 129, 3)):
    if quick:
        T, number = min(T, 20), 2
    x = rng.standard_normal((T, B, V), dtype=np.float32)
    lengths = np.full(B, T, np.int32)
    lengths[::3] = max(1, T * 3 // 4)
    cases[f"ctc_greedy_decoder {(T, B, V)}"] = calls(
        lambda x=x, lengths=lengths: ctc_greedy_decoder(x, lengths, num_threads=1), number)

only = [w for w in sys.argv[7].split(",") if w]
out = {}
for name, fn in cases.items():
    if only and not any(w in name for w in only):
        continue
    fn()                                   # warm-up: page cache, lazy imports, pools
    best = min((fn() for _ in range(inner)), key=lambda s: s[0])
    out[name] = best
emit(out)
'''

IMPORT_RE = re.compile(r"import time:\s*(\d+)\s*\|\s*(\d+)\s*\|\s*readerlib\s*$")


def import_time(root):
    """(wall seconds, readerlib's cumulative import seconds) of one fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("PYTHONSAFEPATH", None)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-P", "-X", "importtime", "-c", "import readerlib"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=root)
    wall = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"import readerlib from {root} failed:\n{r.stderr[-3000:]}")
    cum = [int(m.group(2)) for m in map(IMPORT_RE.match, r.stderr.splitlines()) if m]
    return wall, (cum[-1] / 1e6 if cum else float("nan"))


def fmt_s(s):
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def main():
    p = harness.parser(__doc__, repeats=11)
    p.add_argument("--old", required=True, help="tree of the old build (built in place)")
    p.add_argument("--new", required=True, help="tree of the new build (built in place)")
    p.add_argument("--inner", type=int, default=5, help="calls per case in a round's child; its best counts")
    p.add_argument("--n64", type=int, default=1_000_000, help="64 B records per file / array")
    p.add_argument("--n64k", type=int, default=2000, help="64 KiB records per file / array")
    p.add_argument("--only", default="", help="comma-separated substrings: only the cases whose name has one")
    p.add_argument("--imports", type=int, default=10, help="fresh `import readerlib` processes per build")
    args = harness.parse(p)
    old, new = os.path.abspath(args.old), os.path.abspath(args.new)
    n64, n64k = (3000, 40) if args.quick else (args.n64, args.n64k)
    inner = 1 if args.quick else args.inner
    imports = 2 if args.quick else args.imports
    if args.only and "import" not in args.only:
        imports = 0
    builds = {"old": old, "new": new}
    tmp = tempfile.mkdtemp(prefix="bench_ab_")
    title = "A/B: old vs new build, same run, interleaved rounds (issue 13)"
    try:
        with harness.Report(args, title) as rep:
            files = {}
            for name, root in builds.items():
                d = os.path.join(tmp, name)
                os.mkdir(d)
                (files[name],), _ = harness.run_child(SETUP, [root, d, n64, n64k], timeout=600,
                                                      env={"PYTHONPATH": root, "PYTHONSAFEPATH": None},
                                                      python_flags=("-P",))
            secs = {b: {} for b in builds}
            units = {}
            for r in range(args.repeats):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for b in order:
                    (got,), _ = harness.run_child(
                        ROUND, [builds[b], json.dumps(files[b]), inner, int(args.quick), n64, n64k, args.only],
                        timeout=600, env={"PYTHONPATH": builds[b], "PYTHONSAFEPATH": None},
                        python_flags=("-P",))
                    for case, (s, n) in got.items():
                        secs[b].setdefault(case, []).append(s)
                        units[case] = n
            walls = {b: [] for b in builds}
            cums = {b: [] for b in builds}
            for i in range(imports):
                for b in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
                    w, c = import_time(builds[b])
                    walls[b].append(w)
                    cums[b].append(c)

            rep.add(f"- old: `{old}`", f"- new: `{new}`",
                    f"- sizes: 64 B x {n64:,} records, 64 KiB x {n64k:,} records; shuffle(10,000), batch(256); "
                    f"a round's figure is the best of {inner} call(s) in that build's fresh child",
                    "- ratio = new seconds / old seconds (> 1: new slower); flagged `**` above 1.10 in the median",
                    "")
            rows = []
            v1_note = {"RecordIO 64 B, v1 file -> shuffle -> batch": "RecordIO 64 B -> shuffle -> batch",
                       "RecordIO 64 KiB, v1 file -> shuffle -> batch": "RecordIO 64 KiB -> shuffle -> batch",
                       "RecordIO 64 B, v1 file -> shuffle -> batch -> map_batches(identity)":
                           "RecordIO 64 B -> shuffle -> batch -> map_batches(identity)"}
            for case in secs["new"]:
                # a v1 file read by the new build is compared with the old build's (v1) file
                oc = case if case in secs["old"] else v1_note.get(case)
                so = harness.Stats("old", secs["old"][oc], units.get(oc, 1))
                sn = harness.Stats("new", secs["new"][case], units[case])
                rb, rm = sn.best / so.best, sn.median / so.median
                flag = " **" if rm > 1.10 else ""
                rows.append([case + ("" if oc == case else " (old: its own file)"),
                             f"{fmt_s(so.best)} / {fmt_s(so.median)}", f"{fmt_s(sn.best)} / {fmt_s(sn.median)}",
                             f"{so.spread:.0%} / {sn.spread:.0%}", f"{rb:.3f}", f"{rm:.3f}{flag}"])
            for label, d in (("import readerlib, wall of a fresh process", walls),
                             ("import readerlib, cumulative (-X importtime)", cums)) if imports else ():
                so, sn = harness.Stats("old", d["old"], 1), harness.Stats("new", d["new"], 1)
                rm = sn.median / so.median
                rows.append([label + f" ({imports} each)", f"{fmt_s(so.best)} / {fmt_s(so.median)}",
                             f"{fmt_s(sn.best)} / {fmt_s(sn.median)}", f"{so.spread:.0%} / {sn.spread:.0%}",
                             f"{sn.best / so.best:.3f}", f"{rm:.3f}" + (" **" if rm > 1.10 else "")])
            rep.table(["case", "old best / median", "new best / median", "spread old / new",
                       "new/old best", "new/old median"], rows)
            rep.add("- per round, seconds: " + json.dumps(
                {b: {c: [round(x, 6) for x in v] for c, v in secs[b].items()} for b in builds}), "")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
