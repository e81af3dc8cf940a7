"""RecordIO versions on small records: version 1, version 2 with a CRC table in
every chunk (the writer before chunk flag 0x200), and the writer's default now
(a table only for chunks of big records, flag 0x200 elsewhere).

    python benchmarks/bench_recordio_versions.py [--repeats 9] [--records 1000000] [--sweep] [--quick] [--out FILE]

Same build, same process: the three files of 64 B records are written once,
then each chain is timed on each file, interleaved round after round
(harness.interleaved), files in the page cache:

  file -> shuffle(10,000) -> batch(256)      RecordIOReader(p).shuffle(10000, seed=0).batch(256)
  file -> batch(256)                          RecordIOReader(p).batch(256), the plain sequential read

Reported: best and median seconds per pass, ns per record, and each file's
time over version 1's (> 1: slower).  The chunk flags each file got are
printed, and a 64 KiB file written with the defaults is checked to carry the
per-record table (flag 0x100, records CRC-checked one by one).

--sweep adds the measurement behind record_crc="auto"'s threshold: record
sizes 64 B .. 32,000 B (about 48 MiB a file), a plain sequential read of the
whole file (compiled, no batching), version-1 body (record_crc=False) against
table (record_crc=True) in the same version-2 file format, page_align=False.
"""
import os
import tempfile
import time

import numpy as np

import harness
import readerlib as rl


def _write(path, x, **kw):
    with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (x.shape[1],))]), **kw) as w:
        w.write_batch({"x": x})
    return path


def _flags(path):
    data = open(path, "rb").read()
    offs, _ = rl.RecordIOReader(path).chunk_table()
    return sorted({int.from_bytes(data[int(o) + 8:int(o) + 12], "little") for o in offs})


def _chain(path, shuffle):
    def run():
        r = rl.RecordIOReader(path)
        chain = r.shuffle(10_000, seed=0).batch(256) if shuffle else r.batch(256)
        n = 0
        t0 = time.perf_counter()
        for (b,) in chain:
            n += len(b)
        dt = time.perf_counter() - t0
        chain.close()
        return harness.Sample(dt, n)
    return run


def _read_all(path):
    """Every record through c_next, no chain (on_error='skip' reads each chunk; nothing is skipped)."""
    def run():
        r = rl.RecordIOReader(path, on_error="skip")
        t0 = time.perf_counter()
        n = r._skip(1 << 62)
        dt = time.perf_counter() - t0
        assert r.skipped_chunks == 0
        r.close()
        return harness.Sample(dt, n)
    return run


def _ns(st):
    return f"{st.best / st.units * 1e9:.1f} / {st.median / st.units * 1e9:.1f}"


def main(argv=None):
    p = harness.parser(__doc__, repeats=9)
    p.add_argument("--records", type=int, default=1_000_000, help="64 B records per file (default 1,000,000)")
    p.add_argument("--sweep", action="store_true", help="also the record-size sweep (the threshold)")
    a = harness.parse(p, argv)
    n = 20_000 if a.quick else a.records
    files = {"v1": dict(version=1), "v2 tables (record_crc=True)": dict(record_crc=True),
             "v2 default": {}}
    with harness.Report(a, "RecordIO versions on small records (issue 16)") as rep, \
            tempfile.TemporaryDirectory(prefix="rl-versions-") as tmp:
        rep.add(harness.bounds_line(copy=harness.copy_bandwidth(64 << 20 if a.quick else 256 << 20)), "")
        x = np.random.default_rng(0).integers(0, 256, (n, 64), dtype=np.uint8)
        paths = {k: _write(os.path.join(tmp, f"f{i}.rio"), x, **kw) for i, (k, kw) in enumerate(files.items())}
        rep.table(["file", "writer options", "chunk flags", "file bytes"],
                  [(k, ", ".join(f"{o}={v!r}" for o, v in files[k].items()) or "(defaults)",
                    ", ".join(f"{f:#x}" for f in _flags(pk)), f"{os.path.getsize(pk):,}")
                   for k, pk in paths.items()], title=f"Files: {n:,} x 64 B records, chunk_size 1 MiB")
        for title, shuffle in (("file -> shuffle(10,000) -> batch(256)", True), ("file -> batch(256)", False)):
            st = harness.interleaved({k: _chain(pk, shuffle) for k, pk in paths.items()}, a.repeats)
            base = st["v1"]
            rep.table(["file", "best / median", "ns per record, best / median", "spread", "/ v1, best",
                       "/ v1, median"],
                      [(k, f"{s.best * 1e3:.2f} ms / {s.median * 1e3:.2f} ms", _ns(s), f"{s.spread:.0%}",
                        f"{s.best / base.best:.3f}", f"{s.median / base.median:.3f}") for k, s in st.items()],
                      title=f"{title}, {a.repeats} interleaved rounds (seconds per pass)")

        # 64 KiB records, the defaults: the per-record table (and page alignment) stays
        big = np.random.default_rng(1).integers(0, 256, (32 if a.quick else 256, 65536), dtype=np.uint8)
        pb = _write(os.path.join(tmp, "big.rio"), big)
        r = rl.RecordIOReader(pb)
        got = sum(len(b) for (b,) in r.batch(64))
        per_record = r._bytes_verified
        r.close()
        rep.table(["file", "chunk flags", "records", "bytes CRC-checked record by record"],
                  [(f"{len(big)} x 64 KiB, defaults", ", ".join(f"{f:#x}" for f in _flags(pb)), got,
                    f"{per_record:,} ({per_record / (len(big) * 65536):.0%} of the payload)")],
                  title="64 KiB records keep the per-record table")
        os.unlink(pb)

        if a.sweep:
            rows = []
            sizes = [64, 512, 4096] if a.quick else [64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32000]
            for size in sizes:
                k = max(200, ((1 << 20) if a.quick else (48 << 20)) // size)
                y = np.random.default_rng(size).integers(0, 256, (k, size), dtype=np.uint8)
                pv = {rc: _write(os.path.join(tmp, f"s{rc}.rio"), y, page_align=False, record_crc=rc)
                      for rc in (False, True)}
                st = harness.interleaved({rc: _read_all(pv[rc]) for rc in pv}, a.repeats)
                b0, b1 = st[False], st[True]
                rows.append((f"{size:,} B", f"{k:,}", _ns(b0), _ns(b1), f"{b1.best / b0.best:.2f}",
                             f"{b1.median / b0.median:.2f}",
                             f"{(b1.best - b0.best) / k * 1e9:.1f}"))
                for pk in pv.values():
                    os.unlink(pk)
            rep.table(["record size", "records", "whole-body CRC: ns/record best / median",
                       "CRC table: ns/record best / median", "table / body, best", "table / body, median",
                       "ns per record more, best"],
                      rows, title=f"Sweep: sequential read of a whole file (~{'1' if a.quick else '48'} MiB), "
                                  f"version-2 format, page_align=False, {a.repeats} interleaved rounds")
        rep.add("Figures from a machine shared with other jobs: compare ratios within a table.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
