"""The main job: time file -> shuffle -> batch on a seeded dataset.

Used by `readerlib bench` and by benchmarks/bench_core.py.  The peer in the
same run is the same chain written in plain Python (file reads, a Python
list as shuffle buffer, NumPy to stack batches).  The plain-Python chain does
*not* verify checksums (pure-Python CRC-32C would dominate); readerlib does.
"""
from __future__ import annotations

import os
import random
import resource
import struct
import sys
import tempfile
import time

import numpy as np

from . import Field, RecordIOReader, RecordIOWriter, Schema

__all__ = ["make_dataset", "time_readerlib", "time_python", "run", "main_bench"]


class Progress:
    """A small stderr progress bar (no dependency); silent when not a TTY unless forced."""

    def __init__(self, total, label, enabled=None, width=30):
        self.total = max(1, total)
        self.label = label
        self.width = width
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.last = 0.0
        self.done = 0

    def update(self, n):
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * self.width)
            sys.stderr.write(f"\r{self.label:<28} [{bar:<{self.width}}] {frac * 100:5.1f}%")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def make_dataset(path, kind, num_records, seed=0, chunk_size=1 << 20, progress=None):
    """Write a seeded RecordIO dataset; returns (schema, payload bytes per epoch).

    kind: "small" (64-byte records), "large" (64 KiB records) or "seq"
    (float32 sequences, lengths 50..500 x 80, plus an int64 label).
    """
    rng = np.random.default_rng(seed)
    if kind == "small":
        schema = Schema([Field("x", "uint8", (64,))])
    elif kind == "large":
        schema = Schema([Field("x", "uint8", (65536,))])
    elif kind == "seq":
        schema = Schema([Field("feats", "float32", (80,), lod_level=1), Field("label", "int64")])
    else:
        raise ValueError(f"unknown dataset kind {kind!r}")
    step = {"small": 1 << 18, "large": 256, "seq": 256}[kind]
    payload = 0
    with RecordIOWriter(path, schema, chunk_size=chunk_size) as w:
        for start in range(0, num_records, step):
            n = min(step, num_records - start)
            if kind == "seq":
                lengths = rng.integers(50, 501, size=n)
                seqs = [rng.standard_normal((int(k), 80), dtype=np.float32) for k in lengths]
                labels = rng.integers(0, 1000, size=n)
                w.write_batch({"feats": seqs, "label": labels})
                payload += int(lengths.sum()) * 320 + 8 * n
            else:
                x = rng.integers(0, 256, size=(n, schema[0].shape[0]), dtype=np.uint8)
                w.write_batch({"x": x})
                payload += x.nbytes
            if progress:
                progress.update(n)
    return schema, payload


def time_readerlib(path, buffer_size=10_000, batch_size=256, seed=0, epochs=1, progress=None,
                   low_memory=True):
    """(records, seconds) for `epochs` passes of file -> shuffle -> batch."""
    reader = RecordIOReader(path, low_memory=low_memory)
    chain = reader.shuffle(buffer_size, seed=seed).batch(batch_size)
    n = 0
    t0 = time.perf_counter()
    for _ in range(epochs):
        for batch in chain:
            k = len(batch[0])
            n += k
            if progress:
                progress.update(k)
    dt = time.perf_counter() - t0
    chain.close()
    return n, dt


def _python_records(path):
    """Plain-Python RecordIO record iterator (no checksum verification)."""
    with open(path, "rb") as f:
        data = f.read()
    (slen,) = struct.unpack_from("<I", data, 8)
    pos = 24 + slen
    (ioff,) = struct.unpack_from("<Q", data, len(data) - 16)
    mv = memoryview(data)
    while pos < ioff:
        _magic, n, comp, _crc, stored, _raw, _hcrc = struct.unpack_from("<IIIIQII", data, pos)
        body = pos + 32
        sizes = struct.unpack_from(f"<{n}I", data, body)
        p = body + 4 * n
        for s in sizes:
            if comp & 0x100:                      # page-aligned records
                p += -p % 4096
            yield mv[p:p + s]
            p += s
        pos = body + stored


def time_python(path, schema, buffer_size=10_000, batch_size=256, seed=0, limit=None, progress=None):
    """(records, seconds) for the same chain in plain Python (first `limit` records)."""
    rnd = random.Random(seed)
    fixed = all(f.lod_level == 0 for f in schema)
    t0 = time.perf_counter()
    buf = []
    batch = []
    n = 0

    def emit(rec):
        nonlocal batch, n
        batch.append(rec)
        if len(batch) == batch_size:
            _python_batch(batch, schema, fixed)
            n += len(batch)
            if progress:
                progress.update(len(batch))
            batch = []

    for i, rec in enumerate(_python_records(path)):
        if limit is not None and i >= limit:
            break
        if len(buf) < buffer_size:
            buf.append(rec)
            continue
        j = rnd.randrange(len(buf))
        emit(buf[j])
        buf[j] = rec
    rnd.shuffle(buf)
    for rec in buf:
        emit(rec)
    if batch:
        _python_batch(batch, schema, fixed)
        n += len(batch)
    return n, time.perf_counter() - t0


def _python_batch(records, schema, fixed):
    if fixed:
        f = schema[0]
        return np.frombuffer(b"".join(records), dtype=f.dtype).reshape((len(records),) + f.shape)
    feats, labels, lengths = [], [], []
    for rec in records:
        (k,) = struct.unpack_from("<q", rec, 0)
        feats.append(np.frombuffer(rec[8:8 + k * 320], dtype=np.float32).reshape(k, 80))
        labels.append(struct.unpack_from("<q", rec, 8 + k * 320)[0])
        lengths.append(k)
    offsets = np.zeros(len(records) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.concatenate(feats), offsets, np.array(labels)


DEFAULTS = {  # kind: (records, plain-Python limit)
    "small": (4_000_000, 400_000),
    "large": (16_384, 16_384),
    "seq": (4_000, 4_000),
}


def run(kinds=("small", "large", "seq"), scale=1.0, epochs=2, workdir=None, progress=None, seed=0,
        python_baseline=True):
    """Run the main job; returns a list of result dicts (one per dataset kind)."""
    results = []
    tmp = tempfile.TemporaryDirectory(prefix="readerlib-bench-", dir=workdir)
    try:
        for kind in kinds:
            total, limit = DEFAULTS[kind]
            total = max(1, int(total * scale))
            limit = max(1, min(total, int(limit * scale)))
            path = os.path.join(tmp.name, f"{kind}.rio")
            bar = Progress(total, f"writing {kind}", progress)
            schema, payload = make_dataset(path, kind, total, seed=seed, progress=bar)
            bar.close()
            size = os.path.getsize(path)
            time_readerlib(path, seed=seed, epochs=1)          # warm the page cache
            bar = Progress(total * epochs, f"readerlib {kind}", progress)
            n, dt = time_readerlib(path, seed=seed, epochs=epochs, progress=bar)
            bar.close()
            row = {"dataset": kind, "records": total, "file_bytes": size,
                   "readerlib_rec_s": n / dt, "readerlib_GB_s": payload * epochs / dt / 1e9}
            if python_baseline:
                bar = Progress(limit, f"plain Python {kind}", progress)
                pn, pdt = time_python(path, schema, seed=seed, limit=limit, progress=bar)
                bar.close()
                per_rec = payload / total
                row.update({"python_records": pn, "python_rec_s": pn / pdt,
                            "python_GB_s": pn * per_rec / pdt / 1e9,
                            "speedup": (n / dt) / (pn / pdt)})
            results.append(row)
            os.unlink(path)
    finally:
        tmp.cleanup()
    return results


def format_table(results):
    head = (f"{'dataset':<8} {'records':>9} {'readerlib rec/s':>16} {'GB/s':>7} "
            f"{'python rec/s':>13} {'GB/s':>7} {'speedup':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['dataset']:<8} {r['records']:>9,} {r['readerlib_rec_s']:>16,.0f} {r['readerlib_GB_s']:>7.2f} "
            + (f"{r['python_rec_s']:>13,.0f} {r['python_GB_s']:>7.2f} {r['speedup']:>7.1f}x"
               if "python_rec_s" in r else f"{'-':>13} {'-':>7} {'-':>8}"))
    return "\n".join(lines)


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
