"""CRC-32C by AVX-512 VPCLMULQDQ folding against the crc32-instruction
streams, in the same process (the switch is `_core._set_crc32c_folding`,
flipped between contenders; rounds interleaved by the shared harness):

- the plain CRC of 64 KiB, 1 MiB and 16 MiB buffers (GB/s);
- the fused CRC + copy of 64 KiB records gathered in shuffled order from
  memory into a reused 16 MiB batch, plain and streaming stores, beside a
  plain memcpy gather of the same rows (the copy's bound);
- the 64 KiB chain of bench_big_records (file -> shuffle(10k) -> batch(256),
  the default reader and `low_memory=False`), with and without folding,
  beside a PyTorch DataLoader over the same data in memory.

Run from the repository root: `PYTHONPATH=. python benchmarks/bench_crc_fold.py`.
On a CPU without AVX-512 VPCLMULQDQ only the crc32 rows run."""
import os
import sys
import tempfile
import time

import numpy as np

import harness  # noqa: E402
import bench_big_records as bb  # noqa: E402

from readerlib import _core  # noqa: E402
from readerlib.formats._recordio import _gather_copy  # noqa: E402

SIZE, BATCH = 65536, 256


def _modes():
    return [False, True] if _core._cpu_can_fold() and _core._crc32c_uses_hardware() else [False]


def _tag(fold):
    return "fold" if fold else "crc32"


def _switched(fold, fn):
    def run():
        old = _core._set_crc32c_folding(fold)
        try:
            return fn()
        finally:
            _core._set_crc32c_folding(old)
    return run


def _plain(buf, calls):
    def run():
        t = time.perf_counter()
        for _ in range(calls):
            _core.crc32c(buf)
        return harness.Sample(time.perf_counter() - t, calls * len(buf))
    return run


def _gather(flat, out, n, fused, nt, seed=0):
    perm = np.random.default_rng(seed).permutation(n)

    def run():
        t = time.perf_counter()
        for i in range(0, n - BATCH + 1, BATCH):
            _gather_copy(out, flat, perm[i:i + BATCH] * SIZE, fused, nt)
        return harness.Sample(time.perf_counter() - t, (n // BATCH) * BATCH * SIZE)
    return run


def _chain(peer, n):
    seed = [0]

    def run():
        seed[0] += 1
        t = time.perf_counter()
        k = peer(seed[0])
        return harness.Sample(time.perf_counter() - t, k * SIZE)
    return run


def _rows(st, base=None):
    rows = []
    for k, v in st.items():
        r = [k, f"{v.rate_best / 1e9:.2f}", f"{v.rate_median / 1e9:.2f}", f"{v.spread:.0%}"]
        if base:
            b = base(k)
            r.append(" / ".join(f"{x:.2f}" for x in harness.speedup(st, k, b)) if b in st and b != k else "")
        rows.append(r)
    return rows


def main(argv=None):
    p = harness.parser(__doc__, repeats=7)
    p.add_argument("--records", type=int, default=16384, help="64 KiB records of the chain and the gather")
    a = harness.parse(p, argv)
    if a.quick:
        a.records = 300
    modes = _modes()
    with harness.Competitors(a.busy), \
            harness.Report(a, "CRC-32C: AVX-512 folding against the crc32 streams") as rep, \
            tempfile.TemporaryDirectory(prefix="bench-crc-") as d:
        rep.add(f"- folding available on this CPU: {len(modes) == 2}",
                harness.bounds_line(copy=harness.copy_bandwidth(16 << 20 if a.quick else 256 << 20)), "")
        rng = np.random.default_rng(0)
        plain = {}
        for size in (1 << 16, 1 << 20, 1 << 24):
            buf = rng.integers(0, 256, size, dtype=np.uint8)
            calls = max(1, ((16 << 20) if a.quick else (512 << 20)) // size)
            for fold in modes:
                plain[f"crc {size >> 10} KiB, {_tag(fold)}"] = _switched(fold, _plain(buf, calls))
        st = harness.interleaved(plain, a.repeats)
        rep.table(["contender", "GB/s best", "GB/s median", "spread", "fold / crc32 (best / median)"],
                  _rows(st, lambda k: k.replace("fold", "crc32")),
                  title=f"Plain CRC, {a.repeats} interleaved rounds")

        n = a.records
        x, schema, paths = bb.write_files(d, n)
        flat = x.reshape(-1)
        out = np.empty((BATCH, SIZE), np.uint8)
        gathers = {"memcpy gather": _gather(flat, out, n, False, False)}
        for fold in modes:
            gathers[f"fused gather, {_tag(fold)}"] = _switched(fold, _gather(flat, out, n, True, False))
            gathers[f"fused gather nt, {_tag(fold)}"] = _switched(fold, _gather(flat, out, n, True, True))
        st = harness.interleaved(gathers, a.repeats)
        rep.table(["contender", "GB/s best", "GB/s median", "spread", "/ memcpy gather (best / median)"],
                  _rows(st, lambda k: "memcpy gather"),
                  title=f"64 KiB rows gathered in shuffled order from memory into a reused batch, "
                        f"{a.repeats} interleaved rounds")

        with_torch = harness.want(a, "torch") and harness.try_import("torch") is not None
        peers = bb.make_peers(x, schema, paths, 1 if a.quick else 16, with_torch)
        chains = {}
        for fold in modes:
            chains[f"rio v2 (default), {_tag(fold)}"] = _switched(fold, _chain(peers["rio v2"], n))
            chains[f"rio v2 low_memory=False, {_tag(fold)}"] = _switched(
                fold, _chain(peers["rio v2 low_memory=False"], n))
        if with_torch:
            chains["torch"] = _chain(peers["torch"], n)
        st = harness.interleaved(chains, a.repeats)
        rep.table(["contender", "GB/s best", "GB/s median", "spread", "/ torch (best / median)"],
                  [r[:4] + [r[4]] for r in _rows(st, lambda k: "torch")] if with_torch else _rows(st),
                  title=f"64 KiB chain, file -> shuffle(10k) -> batch(256), {n:,} records, "
                        f"{a.repeats} interleaved rounds ({a.busy} busy processes)")
        rep.add("The machine is shared with other jobs: compare the ratios within one table.")


if __name__ == "__main__":
    main()
