"""Command line: `readerlib bench | inspect FILE | index FILE`."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_bench(args):
    from . import bench
    kinds = args.datasets.split(",")
    for k in kinds:
        if k not in bench.DEFAULTS:
            raise SystemExit(f"readerlib bench: unknown dataset {k!r}; choose from {sorted(bench.DEFAULTS)}")
    print("readerlib bench: file -> shuffle(10000) -> batch(256), seeded data in a temp dir, "
          f"{args.epochs} epoch(s) after a warm-up pass; peer: the same chain in plain Python "
          "(no checksum verification)", flush=True)
    results = bench.run(kinds=kinds, scale=args.scale, epochs=args.epochs, workdir=args.workdir,
                        progress=True if args.progress else None, seed=args.seed,
                        python_baseline=not args.no_python)
    print(bench.format_table(results))
    print(f"peak RSS: {bench.peak_rss_mb():.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _cmd_inspect(args):
    import warnings

    import numpy as np

    from . import RecordIOReader
    from .errors import DataLossError
    rc = 0
    for path in args.files:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                r = RecordIOReader(path, on_error="skip" if args.skip else "raise")
            except (OSError, ValueError) as e:
                print(f"{path}: ERROR {e}")
                rc = 1
                continue
            print(f"{path}")
            print(f"  schema:  {r.schema}")
            print(f"  records: {r.num_records}   chunks: {r.num_chunks}   "
                  f"index footer: {'yes' if r.has_index else 'no'}")
            # verify every chunk: reading through checks every checksum
            n = 0
            try:
                chain = r.batch(4096)
                for b in chain:
                    n += len(b[0])
                status = "ok" if n == r.num_records and not r.skipped_chunks else "PROBLEMS"
                if status != "ok":
                    rc = 1
                print(f"  verified: {n} records, {r.skipped_chunks} chunk(s) skipped -> {status}")
            except DataLossError as e:
                print(f"  verify FAILED: {e}")
                rc = 1
        for w in caught:
            print(f"  warning: {w.message}")
    return rc


def _cmd_index(args):
    from .formats._tfrecord import build_index
    rc = 0
    for path in args.files:
        try:
            comp = args.compression
            if comp is None:                      # by suffix, as open_files does
                low = path.lower()
                comp = "GZIP" if low.endswith(".gz") else "ZLIB" if low.endswith(".zlib") else None
            out = build_index(path, compression=comp)
        except (OSError, ValueError) as e:
            print(f"{path}: ERROR {e}")
            rc = 1
            continue
        print(f"{path}: index written{f' to {out}' if isinstance(out, str) else ''}")
    return rc


def main(argv=None):
    p = argparse.ArgumentParser(prog="readerlib", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time file -> shuffle -> batch on an embedded seeded dataset")
    b.add_argument("--datasets", default="small,large,seq", help="comma list of small,large,seq")
    b.add_argument("--scale", type=float, default=1.0, help="multiply dataset sizes (e.g. 0.1 for a quick run)")
    b.add_argument("--epochs", type=int, default=2)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--workdir", default=None, help="where to write the temporary dataset")
    b.add_argument("--no-python", action="store_true", help="skip the plain-Python peer")
    b.add_argument("--progress", action="store_true", help="force the progress bar (default: on a TTY)")
    b.add_argument("--json", default=None, help="also write results to this JSON file")
    b.set_defaults(func=_cmd_bench)
    i = sub.add_parser("inspect", help="print schema, record and chunk counts; verify checksums")
    i.add_argument("files", nargs="+")
    i.add_argument("--skip", action="store_true", help="skip bad chunks instead of stopping")
    i.set_defaults(func=_cmd_inspect)
    x = sub.add_parser("index", help="build the sidecar index of TFRecord files (for seeking and sharding)")
    x.add_argument("files", nargs="+")
    x.add_argument("--compression", default=None, choices=[None, "ZLIB", "GZIP"],
                   help="the files' compression (default: by suffix)")
    x.set_defaults(func=_cmd_index)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
