"""Big records in one pass (issue 16 item 1): 64 KiB records, file -> shuffle(10k) -> batch(256).

Peers, in the same process, interleaved (the order rotates every repeat), best
and median of ``--repeats``:

* ``rio v2``      readerlib RecordIO, format version 2 (the default writer), read
                  the default way: the batch negotiates deferred records and reads
                  each record straight into its row (pread), checking the row's
                  CRC-32C -- one copy per byte
* ``rio v2 mmap`` the same with the file mapped: each record copied from the
                  mapping into the batch by the fused CRC + copy, SIGBUS-guarded
                  (``_recordio._set_deferred_mode("mmap")``)
* ``rio v2 low_memory=False``  the same chain over ``RecordIOReader(path,
                  low_memory=False)``: the batch copies each record from a
                  mapping of the file whose pages stay mapped until the reader
                  closes (no kernel copy, no page drop; a fresh reader, so a
                  fresh mapping, every pass, as for the other peers)
* ``rio v2 low_memory=False, one reader``  the same, one chain iterated once
                  per pass (the epochs of a training job: the pages mapped in
                  the first epoch are not faulted in again)
* ``rio v2 cached staging``  the default until 2026-12-05: each deferred record
                  pread into a per-thread 68 KiB buffer, then the fused CRC +
                  streaming copy into the batch
                  (``readers._batch._set_staged_deferred_reads(True)``); the
                  default now preads straight into the batch row and CRCs it there
* ``rio v2 two-copy``  the path before deferred records
                  (``_recordio._set_mapped_reads(False)``): each record read into a
                  block of its own and verified there, then copied into the batch
* ``rio v2 staged``  the two-copy path with each group read into an L2-resident
                  buffer and copied to the records' blocks by the fused CRC + copy
                  loop with streaming stores (``_recordio._set_staged_reads(True)``)
* ``rio v2 LoD``  the same bytes as a sequence (LoD) field, 64 rows of 1 KiB a
                  record, read the default way (deferred: the batch sizes from each
                  record's size, one fused CRC + copy per record)
* ``rio v2 LoD two-copy``  that file with ``_set_mapped_reads(False)``
* ``rio v1``      the same data in format version 1 (one CRC per chunk)
* ``tfrecord``    readerlib's TFRecord reader over the same records
* ``open_files 16``  the same records split over 16 v2 files, read through
                  ``rl.open_files(files)`` (one worker thread) -> shuffle -> batch:
                  the batch negotiates deferred records with open_files, whose
                  worker reads only the chunks' tables (readers/_multifile.pyx)
* ``open_files 16 two-copy``  the same with deferred records off
                  (``_recordio._set_mapped_reads(False)``): the path before
* ``torch``       a PyTorch DataLoader (shuffle=True, batch_size=256,
                  num_workers=0, torch's default threads) over a uint8 tensor
                  of the same bytes held in memory (no file, no checksum); the
                  first ``--torch-batches`` batches of each epoch are timed
* ``memcpy``      memcpy of the same bytes: each 256-record batch copied from a
                  contiguous in-memory array (np.copyto), in file order
* ``memcpy gather``   the same, rows gathered in a shuffled order (the DRAM
                  floor of a shuffled batch)
* ``mmap fused``  the floor of option (b), not a reader: the v2 file mapped, each
                  batch's records (shuffled order) copied from the mapping with
                  the fused CRC + copy loop (readerlib/include/rl_crccopy.h) and
                  their CRCs compared; no SIGBUS guard, no chain
* ``mmap fused nt``  the same with the fused loop's streaming stores (what
                  the batch's mapped copy used before: it now uses plain stores,
                  this row shows why)
* ``mmap memcpy`` the same gather from the mapping with plain memcpy

GB/s counts record payload bytes (65,536 per record).  The machine's copy
bandwidth (one thread, np.copyto of 256 MiB, harness.copy_bandwidth) is printed
beside the figures.  ``--busy-sweep 0,1`` (the default) repeats everything with
0 and then 1 competing busy process (harness.Competitors, as
bench_contention.py); the shared ``--busy N`` keeps N more for the whole run.
Peak RSS of the default v2 chain is measured in a fresh child
(harness.run_child) and compared with shuffle buffer + 64 MB.  ``--quick``:
300 records, a smoke run.  The peers run in interleaved rounds
(harness.interleaved); ``torch`` is left out when it is not installed or not
in ``--peers``.

    python benchmarks/bench_big_records.py [--records 16384] [--repeats 5] [--busy-sweep 0,1]
                                           [--torch-batches 16] [--workdir DIR] [--json FILE]
                                           [--quick] [--busy N] [--peers torch|none] [--out FILE.md]

(Before the harness, ``--busy 0,1`` was this sweep and ``--out`` wrote JSON: now
``--busy-sweep 0,1`` and ``--json``.)
"""
import itertools
import json
import mmap
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import harness
import numpy as np

import readerlib as rl
from readerlib.formats._recordio import _gather_copy, _set_staged_reads, _set_mapped_reads, _set_deferred_mode
from readerlib.formats._tfrecord import TFRecordReader, TFRecordWriter

SIZE = 65536
BUFFER, BATCH = 10_000, 256
FILES = 16                   # the open_files peers: the records split over this many files
LOD_ROW = 1024
LOD_SCHEMA = rl.Schema([rl.Field("s", "uint8", (LOD_ROW,), lod_level=1)])


def write_files(d, n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, SIZE), dtype=np.uint8)
    schema = rl.Schema([rl.Field("x", "uint8", (SIZE,))])
    paths = {"rio v2": os.path.join(d, "v2.rio"), "rio v1": os.path.join(d, "v1.rio"),
             "tfrecord": os.path.join(d, "x.tfrecord"), "rio v2 LoD": os.path.join(d, "lod.rio")}
    for key, version in (("rio v2", 2), ("rio v1", 1)):
        with rl.RecordIOWriter(paths[key], schema, version=version) as w:
            for i in range(0, n, 256):
                w.write_batch({"x": x[i:i + 256]})
    with rl.RecordIOWriter(paths["rio v2 LoD"], LOD_SCHEMA) as w:
        for i in range(0, n, 256):
            w.write_batch({"s": [r.reshape(-1, LOD_ROW) for r in x[i:i + 256]]})
    with TFRecordWriter(paths["tfrecord"]) as w:
        for i in range(0, n, 256):
            w.write_batch(x[i:i + 256])
    per = -(-n // FILES)
    paths["open_files"] = []
    for f in range(FILES):
        p = os.path.join(d, f"part{f:02d}.rio")
        with rl.RecordIOWriter(p, schema) as w:
            for i in range(f * per, min(n, (f + 1) * per), 256):
                w.write_batch({"x": x[i:min(i + 256, (f + 1) * per, n)]})
        paths["open_files"].append(p)
    return x, schema, paths


def v2_record_offsets(path):
    """(file offset, CRC) of every record of a v2 file (from its tables)."""
    r = rl.RecordIOReader(path)
    offs, nrec = r.chunk_table()
    out, crcs = [], []
    with open(path, "rb") as f:
        for o, n in zip(map(int, offs), map(int, nrec)):
            f.seek(o)
            h = f.read(32 + 8 * n)
            flag = int.from_bytes(h[8:12], "little")
            sizes = np.frombuffer(h[32:32 + 4 * n], "<u4")
            crcs.extend(np.frombuffer(h[32 + 4 * n:32 + 8 * n], "<u4").tolist())
            pos = o + 32 + 8 * n
            for s in sizes:
                if flag & 0x100:
                    pos += -pos % 4096
                out.append(pos)
                pos += int(s)
    r.close()
    return np.array(out, np.int64), np.array(crcs, np.uint32)


def run_chain(chain, close=True):
    n = 0
    for (t,) in chain:
        n += len(t.lod[0]) - 1 if t.lod else t.data.shape[0]
    if close:
        chain.close()
    return n


def make_peers(x, schema, paths, torch_batches, with_torch=True):
    n = x.shape[0]
    offsets, crcs = v2_record_offsets(paths["rio v2"])
    if with_torch:
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        tx = torch.from_numpy(x)
    out = np.empty((BATCH, SIZE), np.uint8)

    def rio(key):
        return lambda seed: run_chain(rl.RecordIOReader(paths[key]).shuffle(BUFFER, seed=seed).batch(BATCH))

    def tfr(seed):
        return run_chain(TFRecordReader(paths["tfrecord"], schema=schema).shuffle(BUFFER, seed=seed)
                         .batch(BATCH))

    def torch_dl(seed):
        # the first torch_batches batches of a shuffled epoch (its rate does not depend on how
        # much of the epoch is timed: in memory, no buffer to fill)
        g = torch.Generator().manual_seed(seed)
        k = 0
        for j, (b,) in enumerate(DataLoader(TensorDataset(tx), batch_size=BATCH, shuffle=True,
                                            generator=g)):
            k += b.shape[0]
            if j + 1 == torch_batches:
                break
        return k

    def memcpy(seed):
        for i in range(0, n, BATCH):
            m = min(BATCH, n - i)
            np.copyto(out[:m], x[i:i + m])
        return n

    flat = x.reshape(-1)

    def memcpy_gather(seed):
        # the shuffled gather of the same bytes from memory: one compiled memcpy per
        # record into the reused batch (np.take(axis=0, out=) ran at a third of this:
        # its per-item copy loop, not the shuffle, set the old figure)
        perm = np.random.default_rng(seed).permutation(n)
        for i in range(0, n, BATCH):
            idx = perm[i:i + BATCH]
            _gather_copy(out[:len(idx)], flat, idx * SIZE, False)
        return n

    def mmap_gather(fused, nt=False):
        def f(seed):
            perm = np.random.default_rng(seed).permutation(n)
            with open(paths["rio v2"], "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                try:
                    for i in range(0, n, BATCH):
                        idx = perm[i:i + BATCH]
                        got = _gather_copy(out[:len(idx)], mm, offsets[idx], fused, nt)
                        if fused and not np.array_equal(got, crcs[idx]):
                            raise AssertionError("mmap fused: CRC mismatch")
                finally:
                    mm.close()
            return n
        return f

    def rio_staged(seed):
        old, old_m = _set_staged_reads(True), _set_mapped_reads(False)
        try:
            return rio("rio v2")(seed)
        finally:
            _set_staged_reads(old)
            _set_mapped_reads(old_m)

    def rio_cached_staging(seed):
        # the default before 2026-12-05: each deferred record through a per-thread
        # 68 KiB buffer, then the fused CRC + streaming copy into the batch
        from readerlib.readers._batch import _set_staged_deferred_reads
        old = _set_staged_deferred_reads(True)
        try:
            return rio("rio v2")(seed)
        finally:
            _set_staged_deferred_reads(old)

    def rio_two_copy(seed):
        old = _set_mapped_reads(False)
        try:
            return rio("rio v2")(seed)
        finally:
            _set_mapped_reads(old)

    def open_files(seed):
        return run_chain(rl.open_files(paths["open_files"]).shuffle(BUFFER, seed=seed).batch(BATCH))

    def open_files_two_copy(seed):
        old = _set_mapped_reads(False)
        try:
            return open_files(seed)
        finally:
            _set_mapped_reads(old)

    def rio_lod_two_copy(seed):
        old = _set_mapped_reads(False)
        try:
            return rio("rio v2 LoD")(seed)
        finally:
            _set_mapped_reads(old)

    def rio_mmap(seed):
        old = _set_deferred_mode("mmap")
        try:
            return rio("rio v2")(seed)
        finally:
            _set_deferred_mode(old)

    def rio_keep(seed):
        return run_chain(rl.RecordIOReader(paths["rio v2"], low_memory=False).shuffle(BUFFER, seed=seed)
                         .batch(BATCH), close=True)

    one_chain = []

    def rio_keep_one(seed):
        # one chain for every pass: each iteration is a new epoch (its own order)
        if not one_chain:
            one_chain.append(rl.RecordIOReader(paths["rio v2"], low_memory=False).shuffle(BUFFER, seed=seed)
                             .batch(BATCH))
        return run_chain(one_chain[0], close=False)

    peers = {"rio v2": rio("rio v2"), "rio v2 low_memory=False": rio_keep,
             "rio v2 low_memory=False, one reader": rio_keep_one,
             "rio v2 mmap": rio_mmap, "rio v2 two-copy": rio_two_copy,
             "rio v2 cached staging": rio_cached_staging, "rio v2 staged": rio_staged, "rio v2 LoD": rio("rio v2 LoD"),
             "rio v2 LoD two-copy": rio_lod_two_copy, "rio v1": rio("rio v1"), "tfrecord": tfr,
             "open_files 16": open_files, "open_files 16 two-copy": open_files_two_copy,
             "torch": torch_dl, "memcpy": memcpy, "memcpy gather": memcpy_gather, "mmap fused": mmap_gather(True),
             "mmap fused nt": mmap_gather(True, nt=True),
             "mmap memcpy": mmap_gather(False)}
    if not with_torch:
        del peers["torch"]
    return peers


def _cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(peers, n, repeats, cpu=None):
    """GB/s of payload per peer: interleaved rounds (harness.interleaved), the order rotating;
    every call gets a new shuffle seed (0 for the warm-up, then 1, 2, ...).  `cpu`, a dict:
    filled with each peer's CPU seconds (all of this process's threads) per GB of each call,
    the cost that decides a rate on cores shared with a busy process."""
    def contender(name, fn):
        seeds = itertools.count()

        def go():
            c, t = _cpu_s(), time.perf_counter()
            k = fn(next(seeds))
            dt, dc = time.perf_counter() - t, _cpu_s() - c
            assert k == n or name == "torch", (name, k, n)
            if cpu is not None:
                cpu.setdefault(name, []).append(dc / (k * SIZE / 1e9))
            return harness.Sample(dt, k * SIZE / 1e9)
        return go
    return harness.interleaved({name: contender(name, fn) for name, fn in peers.items()}, repeats)


# VmHWM after the import (the child's baseline), then its VmHWM at exit (harness.run_child)
PEAK = """
import os, sys, readerlib as rl
base = rss_mb()["VmHWM"]
n = 0
low = os.environ.get("BENCH_LOW_MEMORY", "1") == "1"
for (t,) in rl.RecordIOReader(sys.argv[1], low_memory=low).shuffle(10_000, seed=0).batch(256):
    n += t.data.shape[0]
emit([n, base])
"""


def peak_rss(path, **env_extra):
    """(peak MB of the chain's process, its peak after the import alone)."""
    env = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__))), **env_extra}
    (res,), peak = harness.run_child(PEAK, [path], timeout=600, env=env, python_flags=("-P",))
    return peak["peak_MB"], res[1]


OPEN_FILES_RATIOS = [("open_files 16", p) for p in ("memcpy", "torch", "rio v2", "open_files 16 two-copy")]
LOD_RATIOS = [("rio v2 LoD", "rio v2 LoD two-copy"), ("rio v2 LoD", "torch"), ("rio v2 LoD", "rio v2")]
RATIO_PEERS = ("memcpy", "memcpy gather", "torch", "rio v2 cached staging", "rio v2 two-copy", "rio v2 mmap",
               "rio v1", "rio v2 staged",
               "tfrecord", "mmap fused")
# the low_memory=False chains against the same peers as the default
KEEP_RATIOS = [(k, peer) for k in ("rio v2 low_memory=False", "rio v2 low_memory=False, one reader")
               for peer in ("torch", "memcpy", "memcpy gather", "mmap fused", "rio v2")]


def main(argv=None):
    ap = harness.parser(__doc__, repeats=5)
    ap.add_argument("--records", type=int, default=16384)
    ap.add_argument("--busy-sweep", default="0,1",
                    help="comma list: everything measured once per count of competing busy processes")
    ap.add_argument("--json", help="also write the raw figures (JSON) to this file")
    ap.add_argument("--torch-batches", type=int, default=16,
                    help="batches of the torch DataLoader epoch that are timed")
    ap.add_argument("--workdir", help="where the files go (default: the temp dir; read from the page cache)")
    av = sys.argv[1:] if argv is None else list(argv)
    if any(a.startswith("--busy=") and "," in a or a == "--busy" and i + 1 < len(av) and "," in av[i + 1]
           for i, a in enumerate(av)):
        ap.error("--busy N is now N competing processes for the whole run (the shared flag); "
                 "the sweep 0,1 of earlier runs is --busy-sweep 0,1")
    args = harness.parse(ap, argv)
    if args.quick:
        args.records, args.torch_batches = 300, 1
    with_torch = harness.want(args, "torch") and harness.try_import("torch") is not None
    with harness.Report(args, "Big records in one pass: 64 KiB records, file -> shuffle(10k) -> batch(256)") as rep, \
            tempfile.TemporaryDirectory(prefix="bench-big-", dir=args.workdir) as d:
        x, schema, paths = write_files(d, args.records)
        peers = make_peers(x, schema, paths, args.torch_batches, with_torch)
        copy = harness.copy_bandwidth(16 << 20 if args.quick else 256 << 20, 5)
        result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  "records": args.records, "record_bytes": SIZE, "repeats": args.repeats,
                  "threads": rl.get_num_threads() if hasattr(rl, "get_num_threads") else None,
                  "copy_GB_s": copy["copy"], "runs": {}}
        rep.add(f"- {args.records:,} records of {SIZE} B ({args.records * SIZE / 1e9:.2f} GB of payload), "
                f"read from the page cache; GB/s of payload; readerlib threads: {result['threads']}"
                + ("" if with_torch else "; torch left out (not installed or not in --peers)"),
                harness.bounds_line(copy), "")
        for busy in [int(b) for b in args.busy_sweep.split(",")]:
            with harness.Competitors(busy):
                cpu = {}
                st = measure(peers, args.records, args.repeats, cpu)
            result["runs"][busy] = {k: {"best": v.rate_best, "median": v.rate_median,
                                        "all": [v.units / t for t in v.seconds],
                                        "cpu_s_per_GB": cpu.get(k, [])[-args.repeats:]} for k, v in st.items()}
            rep.table(["peer", "GB/s best", "GB/s median", "spread", "CPU s/GB best", "CPU s/GB median"],
                      [[k, f"{v.rate_best:.2f}", f"{v.rate_median:.2f}", f"{v.spread:.0%}",
                        f"{min(cpu[k][-args.repeats:]):.3f}", f"{statistics.median(cpu[k][-args.repeats:]):.3f}"]
                       for k, v in st.items()],
                      title=f"{busy} competing busy process(es), best / median of {args.repeats} rounds "
                            "(CPU s/GB: this process's CPU time, every thread, per GB of payload; the "
                            "warm-up call left out):")
            rep.table(["ratio", "best", "median"],
                      [[f"{mine} / {peer}", *(f"{r:.2f}" for r in harness.speedup(st, mine, peer))]
                       for mine, peer in [("rio v2", p) for p in RATIO_PEERS] + OPEN_FILES_RATIOS + LOD_RATIOS + KEEP_RATIOS
                       if peer in st and mine in st])
        buf = min(BUFFER, args.records) * SIZE / 2**20
        result["peak_rss_MB"] = {"shuffle_buffer": buf}
        for label, env in (("default v2 chain", {}), ("v2 low_memory=False", {"BENCH_LOW_MEMORY": "0"}),
                           ("v2 mmap", {"READERLIB_DEFERRED_READS": "mmap"}),
                           ("v2 two-copy", {"READERLIB_MAPPED_READS": "0"})):
            mb, base = peak_rss(paths["rio v2"], **env)
            result["peak_rss_MB"][label] = {"chain": mb, "import_only": base}
            rep.add(f"- peak RSS, {label} in a fresh process: {mb:.0f} MB (import readerlib alone "
                    f"{base:.0f} MB; shuffle buffer {buf:.0f} MB; bound buffer + 64 MB = {buf + 64:.0f} MB "
                    f"above the import: {'within' if mb - base <= buf + 64 else 'OVER'})"
                    + ("; the file's pages stay mapped, by design: the bound is the default's"
                       if "low_memory=False" in label else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
