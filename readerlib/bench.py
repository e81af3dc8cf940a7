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
    """A progress bar on stderr (rich); silent when stderr is not a TTY unless forced.

    Parameters
    ----------
    total : int or None
        Units of work (records); None when unknown (a count and a rate only).
    label : str
    enabled : bool or None
        None: on when stderr is a terminal.
    """

    def __init__(self, total, label, enabled=None):
        self.total = total
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.done = 0
        self._bar = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as _RichProgress,
                                       TaskProgressColumn, TextColumn, TimeElapsedColumn)
            self._bar = _RichProgress(
                TextColumn("{task.description:<24}"), BarColumn(), TaskProgressColumn(),
                MofNCompleteColumn(), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def update(self, n):
        self.done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self):
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
    """Plain-Python RecordIO record iterator (no checksum verification).

    Reads chunk by chunk, as a plain-Python reader would: the cost is that of
    the records taken, not of the whole file (the peer times a prefix).
    """
    with open(path, "rb") as f:
        head = f.read(24)
        v2 = head[7:8] == b"2"          # version 2: uncompressed chunks add a table of record CRCs
        (slen,) = struct.unpack_from("<I", head, 8)
        f.seek(24 + slen)
        while True:
            h = f.read(32)
            if len(h) < 32 or h[:4] == b"RIDX":
                return
            _magic, n, comp, _crc, stored, _raw, _hcrc = struct.unpack("<IIIIQII", h)
            base = f.tell()                       # file offset of the body
            body = f.read(stored)
            mv = memoryview(body)
            sizes = struct.unpack_from(f"<{n}I", body, 0)
            # version 2, uncompressed: a CRC table too, unless flag 0x200 (whole-body CRC)
            p = 8 * n if v2 and comp & 0xFF == 0 and not comp & 0x200 else 4 * n
            for s in sizes:
                if comp & 0x100:                  # page-aligned records
                    p += -(base + p) % 4096
                yield mv[p:p + s]
                p += s


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


DEFAULTS = {  # kind: (records, plain-Python records per repeat)
    "small": (4_000_000, 150_000),
    "large": (16_384, 6_000),
    "seq": (4_000, 1_500),
}


def _spread(rates):
    """median, min, max of a list of rates."""
    return float(np.median(rates)), float(min(rates)), float(max(rates))


def run(kinds=("small", "large", "seq"), scale=1.0, epochs=1, workdir=None, progress=None, seed=0,
        python_baseline=True, repeats=3):
    """Run the main job; returns a list of result dicts (one per dataset kind).

    Each measurement is repeated `repeats` times (readerlib: `epochs` passes
    over the file; plain Python: the first DEFAULTS[kind][1] * scale records)
    and reported as median, min and max of records/s; `speedup` is the
    ratio of the medians.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    results = []
    tmp = tempfile.TemporaryDirectory(prefix="readerlib-bench-", dir=workdir)
    try:
        for kind in kinds:
            total, limit = DEFAULTS[kind]
            total = max(1, int(total * scale))
            limit = max(1, min(total, int(limit * scale)))
            path = os.path.join(tmp.name, f"{kind}.rio")
            with Progress(total, f"writing {kind}", progress) as bar:
                schema, payload = make_dataset(path, kind, total, seed=seed, progress=bar)
            size = os.path.getsize(path)
            per_rec = payload / total
            # Untimed warm-up of each contender (the page cache, and each one's
            # own heap), then the rounds interleaved: readerlib, Python,
            # readerlib, ... so that both run in the same conditions (load,
            # memory state left by the other) rather than one after the other.
            time_readerlib(path, seed=seed, epochs=1)
            if python_baseline:
                time_python(path, schema, seed=seed, limit=limit)
            rates, prates = [], []
            work = total * epochs * repeats + (limit * repeats if python_baseline else 0)
            label = f"{kind}: readerlib" + (" + Python" if python_baseline else "")
            with Progress(work, label, progress) as bar:
                for rep in range(repeats):
                    n, dt = time_readerlib(path, seed=seed + rep, epochs=epochs, progress=bar)
                    rates.append(n / dt)
                    if python_baseline:
                        pn, pdt = time_python(path, schema, seed=seed + rep, limit=limit,
                                              progress=bar)
                        prates.append(pn / pdt)
            med, lo, hi = _spread(rates)
            row = {"dataset": kind, "records": total, "file_bytes": size, "repeats": repeats,
                   "readerlib_rec_s": med, "readerlib_rec_s_min": lo, "readerlib_rec_s_max": hi,
                   "readerlib_GB_s": med * per_rec / 1e9}
            if python_baseline:
                pmed, plo, phi = _spread(prates)
                row.update({"python_records": pn, "python_rec_s": pmed, "python_rec_s_min": plo,
                            "python_rec_s_max": phi, "python_GB_s": pmed * per_rec / 1e9,
                            "speedup": med / pmed})
            results.append(row)
            os.unlink(path)
    finally:
        tmp.cleanup()
    return results


def _si(x):
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def format_table(results):
    """The results as a plain-text table (rendered by rich; no colour codes)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    ascii_head = box.Box("    \n    \n -- \n    \n    \n    \n    \n    \n")   # SIMPLE_HEAD in ASCII
    t = Table(box=ascii_head, pad_edge=False)
    for name in ("dataset", "records", "readerlib rec/s", "spread", "GB/s",
                 "python rec/s", "spread", "GB/s", "ratio"):
        t.add_column(name, justify="left" if name == "dataset" else "right", no_wrap=True)
    for r in results:
        row = [r["dataset"], f"{r['records']:,}", f"{r['readerlib_rec_s']:,.0f}",
               f"{_si(r['readerlib_rec_s_min'])}-{_si(r['readerlib_rec_s_max'])}",
               f"{r['readerlib_GB_s']:.2f}"]
        if "python_rec_s" in r:
            row += [f"{r['python_rec_s']:,.0f}",
                    f"{_si(r['python_rec_s_min'])}-{_si(r['python_rec_s_max'])}",
                    f"{r['python_GB_s']:.2f}", f"{r['speedup']:.1f}x"]
        else:
            row += ["-"] * 4
        t.add_row(*row)
    reps = sorted({r.get("repeats", 1) for r in results})
    t.caption = (f"rec/s: median of {'/'.join(map(str, reps))} repeats; spread: min-max; "
                 "ratio: readerlib median / python median")
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None, highlight=False).print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n")


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
