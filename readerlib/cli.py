"""Command line: `readerlib bench | inspect FILE | index FILE | convert SRC DST | --version`.

Formats are told apart by their bytes, never by file names: a RecordIO file
starts with the magic "RLRECIO1"; a TFRecord file starts with a record header
(u64 length, u32 masked CRC-32C of it); a GZIP (1f 8b) or ZLIB (RFC 1950
header) stream is inflated far enough to find that header inside.

Errors in the data or the arguments print one line naming the file (and the
record or offset) and exit non-zero: 1 for bad data, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import numpy as np

RECORDIO_MAGIC = b"RLRECIO1"
_SUFFIXES = {".rio": "recordio", ".recordio": "recordio",
             ".tfrecord": "tfrecord", ".tfrecords": "tfrecord", ".tfr": "tfrecord"}
_CONVERT_BATCH = 512


class CliError(Exception):
    """A problem to report in one line, without a traceback (exit status `code`)."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


# -- format detection ---------------------------------------------------------------------------

def _tfrecord_head_ok(head):
    """True when `head` (>= 12 bytes) starts with a TFRecord length and its masked CRC-32C."""
    from . import masked_crc32c
    return len(head) >= 12 and masked_crc32c(head[:8]) == int.from_bytes(head[8:12], "little")


def detect_format(path):
    """Tell a file's format from its first bytes.

    Returns
    -------
    (kind, compression) : ("recordio", None) or ("tfrecord", None | "GZIP" | "ZLIB")

    Raises
    ------
    CliError
        The file is neither, naming what its first bytes are not; OSError when
        it cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if head.startswith(RECORDIO_MAGIC) or head.startswith(b"RLRECIO2"):
        return "recordio", None
    if head.startswith(RECORDIO_MAGIC[:7]):
        raise CliError(f"{path}: RecordIO version {head[7:8]!r} is not supported (this readerlib reads "
                       f"{RECORDIO_MAGIC.decode()} and RLRECIO2)")
    if not head:
        return "tfrecord", None                 # a TFRecord file with no records (TF reads it so)
    if _tfrecord_head_ok(head):
        return "tfrecord", None
    comp = None
    if head[:2] == b"\x1f\x8b":
        comp, wbits = "GZIP", 31
    elif len(head) >= 2 and head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0:
        comp, wbits = "ZLIB", 15
    if comp is not None:
        try:
            inner = zlib.decompressobj(wbits).decompress(head, 12)
        except zlib.error as e:
            raise CliError(f"{path}: starts like {comp} data but does not inflate ({e}); "
                           "neither RecordIO nor TFRecord") from None
        if inner == b"" or _tfrecord_head_ok(inner):
            return "tfrecord", comp
        raise CliError(f"{path}: {comp}-compressed, but the data inside is not TFRecord (its first "
                       "12 bytes are not a record length with a valid checksum)")
    raise CliError(f"{path}: not a RecordIO file (no {RECORDIO_MAGIC.decode()!r} magic) nor a TFRecord "
                   "file (the first 12 bytes are not a record length with a valid checksum, "
                   "and it is not GZIP or ZLIB data)")


def _describe_format(kind, comp):
    return "RecordIO" if kind == "recordio" else f"TFRecord{f' ({comp})' if comp else ''}"


# -- schema specs -------------------------------------------------------------------------------

SCHEMA_HELP = """\
a schema for TFRecord records: comma-separated fields NAME:DTYPE[:SHAPE][:lod], SHAPE as
dims joined by 'x' (e.g. 'feats:float32:80:lod,label:int64' or 'img:uint8:32x32x3'), or
a JSON file / string as Schema.to_json writes it ({"fields": [...]}).  One field: each
record is that field's raw bytes (tf.io.decode_raw; a lod field's rows, no count).  Several
fields: each record is readerlib's instance encoding (fields in order; a lod field is an
int64 row count then its rows), as `readerlib convert` writes from RecordIO.
Default: one uint8 lod field 'data' (each record a byte string)."""


def parse_schema(spec):
    """A Schema from a compact spec (see SCHEMA_HELP), a JSON string or a JSON file path."""
    from . import Field, Schema
    text = spec.strip()
    if not text.startswith(("{", "[")) and (text.endswith(".json") or os.path.isfile(text)):
        try:
            with open(text) as f:
                text = f.read().strip()
        except OSError as e:
            raise CliError(f"--schema: cannot read {spec!r}: {e.strerror}", 2) from None
    if text.startswith(("{", "[")):
        try:
            d = json.loads(text)
            fields = d["fields"] if isinstance(d, dict) else d
            return Schema([Field.from_dict(f) for f in fields])
        except (ValueError, KeyError, TypeError) as e:
            raise CliError(f"--schema {spec!r}: not a schema in JSON ({{'fields': [{{'name', 'dtype', "
                           f"'shape', 'lod_level'}}, ...]}}): {e}", 2) from None
    fields = []
    for i, part in enumerate(text.split(",")):
        bits = [b.strip() for b in part.split(":")]
        lod = 0
        if len(bits) > 2 and bits[-1].lower() == "lod":
            lod = 1
            bits = bits[:-1]
        if len(bits) not in (2, 3) or not bits[0] or not bits[1]:
            raise CliError(f"--schema {spec!r}: field {i} {part!r} is not NAME:DTYPE[:SHAPE][:lod]", 2)
        shape = ()
        if len(bits) == 3 and bits[2] not in ("", "()"):
            try:
                shape = tuple(int(d) for d in bits[2].lower().split("x"))
            except ValueError:
                raise CliError(f"--schema {spec!r}: field {bits[0]!r}: shape {bits[2]!r} is not dims "
                               "joined by 'x' (e.g. 80 or 32x32x3)", 2) from None
        try:
            fields.append(Field(bits[0], bits[1], shape, lod))
        except (TypeError, ValueError) as e:
            raise CliError(f"--schema {spec!r}: {e}", 2) from None
    try:
        return Schema(fields)
    except (TypeError, ValueError) as e:
        raise CliError(f"--schema {spec!r}: {e}", 2) from None


def schema_to_spec(schema):
    """The compact spec of a schema (its JSON when a name would not survive the spec)."""
    if any(c in f.name for f in schema for c in ":,") or any(not f.name.strip() == f.name for f in schema):
        return schema.to_json()
    parts = []
    for f in schema:
        s = f"{f.name}:{f.dtype.name}"
        if f.shape:
            s += ":" + "x".join(map(str, f.shape))
        if f.lod_level:
            s += ":lod"
        parts.append(s)
    return ",".join(parts)


# -- record codecs: batches of a schema <-> TFRecord byte strings --------------------------------

def _check_tfrecord_schema(schema):
    """A one-field lod schema stores rows alone: rows of 0 bytes would lose their count."""
    if len(schema) == 1 and schema[0].lod_level and schema[0].row_bytes == 0:
        raise CliError(f"field {schema[0].name!r} has rows of 0 bytes: a one-field TFRecord record is "
                       "the rows alone and could not carry their count", 2)


def _encode_batch(batch, schema):
    """TFRecord records for one batch (tuple of LoDTensor): a 2-D uint8 array or a list of bytes.

    One field: its raw bytes (a lod field: the rows alone).  Several: readerlib's
    instance encoding, the same bytes RecordIO stores for the instance.
    """
    if all(f.lod_level == 0 for f in schema):
        n = len(batch[0])
        cols = [np.ascontiguousarray(batch[i].data).reshape(n, -1).view(np.uint8) for i in range(len(schema))]
        return cols[0] if len(cols) == 1 else np.concatenate(cols, axis=1)
    n = len(batch[0])
    parts = []
    for j, f in enumerate(schema):
        t = batch[j]                       # by position: a batch may also be keyed by name
        data = np.ascontiguousarray(t.data)
        if f.lod_level:
            off = [int(o) for o in t.lod[0]]
            raw = data.reshape(-1).view(np.uint8)
            rb = f.row_bytes
            parts.append([(off[i + 1] - off[i], raw[off[i] * rb:off[i + 1] * rb].tobytes()) for i in range(n)])
        else:
            parts.append([data[i].tobytes() for i in range(n)])
    if len(schema) == 1:
        return [p[1] for p in parts[0]]
    out = []
    for i in range(n):
        rec = []
        for f, p in zip(schema, parts):
            if f.lod_level:
                k, raw = p[i]
                rec.append(k.to_bytes(8, "little", signed=True))
                rec.append(raw)
            else:
                rec.append(p[i])
        out.append(b"".join(rec))
    return out


class _Decoder:
    """TFRecord byte strings -> columns of `schema` for RecordIOWriter.write_batch.

    Keeps the record count and the record's offset in the (uncompressed)
    stream, so a record that does not fit names its file, index and offset.
    """

    def __init__(self, path, schema):
        _check_tfrecord_schema(schema)
        self.path = path
        self.schema = schema
        self.index = 0          # records decoded so far
        self.offset = 0         # stream offset of the next record

    def _bad(self, i, sizes, msg):
        off = self.offset + int(np.sum(sizes[:i])) + 16 * i
        raise CliError(f"{self.path}: record {self.index + i} (offset {off}) does not fit the schema: {msg}")

    def decode(self, data, lod):
        offs = np.asarray(lod, dtype=np.int64)
        sizes = np.diff(offs)
        n = len(sizes)
        s = self.schema
        if all(f.lod_level == 0 for f in s):
            need = sum(f.row_bytes for f in s)
            bad = np.flatnonzero(sizes != need)
            if bad.size:
                i = int(bad[0])
                what = (f"field {s[0].name!r} needs {need} bytes" if len(s) == 1 else
                        f"the fixed fields {list(s.names)} need {need} bytes")
                self._bad(i, sizes, f"it has {int(sizes[i])} bytes; {what}")
            rows = data.reshape(n, need)
            cols, p = {}, 0
            for f in s:
                cols[f.name] = np.ascontiguousarray(rows[:, p:p + f.row_bytes]).view(f.dtype).reshape((n,) + f.shape)
                p += f.row_bytes
        elif len(s) == 1:
            f = s[0]
            bad = np.flatnonzero(sizes % f.row_bytes)
            if bad.size:
                i = int(bad[0])
                self._bad(i, sizes, f"it has {int(sizes[i])} bytes, not a whole number of rows of "
                                    f"{f.row_bytes} bytes for field {f.name!r}")
            from . import LoDTensor
            cols = {f.name: LoDTensor(data.view(f.dtype).reshape((-1,) + f.shape), [offs // f.row_bytes])}
        else:
            cols = {f.name: [] for f in s}
            for i in range(n):
                rec = data[offs[i]:offs[i + 1]]
                p = 0
                for f in s:
                    left = len(rec) - p
                    if f.lod_level:
                        if left < 8:
                            self._bad(i, sizes, f"field {f.name!r} needs an 8-byte row count at byte {p}, "
                                                f"{left} left")
                        k = int(rec[p:p + 8].view(np.int64)[0])
                        p += 8
                        if k < 0 or k * f.row_bytes > left - 8:
                            self._bad(i, sizes, f"field {f.name!r} has a row count of {k} ({k} x "
                                                f"{f.row_bytes} bytes) with {left - 8} bytes left")
                        nb = k * f.row_bytes
                        cols[f.name].append(rec[p:p + nb].view(f.dtype).reshape((k,) + f.shape))
                    else:
                        nb = f.row_bytes
                        if nb > left:
                            self._bad(i, sizes, f"field {f.name!r} needs {nb} bytes at byte {p}, {left} left")
                        cols[f.name].append(rec[p:p + nb].view(f.dtype).reshape(f.shape))
                    p += nb
                if p != len(rec):
                    self._bad(i, sizes, f"{len(rec) - p} bytes left after the last field "
                                        f"({len(rec)} bytes, the fields use {p})")
            for f in s:
                if not f.lod_level:
                    cols[f.name] = (np.stack(cols[f.name]) if n else np.empty((0,) + f.shape, f.dtype))
        self.index += n
        self.offset += int(sizes.sum()) + 16 * n
        return cols


# -- commands -----------------------------------------------------------------------------------

def _cmd_bench(args):
    from . import bench
    kinds = args.datasets.split(",")
    for k in kinds:
        if k not in bench.DEFAULTS:
            raise CliError(f"readerlib bench: unknown dataset {k!r}; choose from {sorted(bench.DEFAULTS)}", 2)
    if args.repeats < 1:
        raise CliError(f"readerlib bench: --repeats must be >= 1, got {args.repeats}", 2)
    print("readerlib bench: file -> shuffle(10000) -> batch(256), seeded data in a temp dir, "
          f"{args.repeats} repeat(s) of {args.epochs} epoch(s) after a warm-up pass; peer: the same chain "
          "in plain Python (no checksum verification)", flush=True)
    results = bench.run(kinds=kinds, scale=args.scale, epochs=args.epochs, workdir=args.workdir,
                        progress=True if args.progress else None, seed=args.seed,
                        python_baseline=not args.no_python, repeats=args.repeats)
    print(bench.format_table(results))
    print(f"peak RSS: {bench.peak_rss_mb():.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _detect_or_report(path):
    """(kind, compression), or None after printing why the file cannot be read."""
    try:
        return detect_format(path)
    except CliError as e:
        msg = str(e)
        print(f"{path}: ERROR {msg[len(path) + 2:] if msg.startswith(path + ': ') else msg}")
    except OSError as e:
        print(f"{path}: ERROR {e.strerror or e}")
    return None


def _cmd_inspect(args):
    import warnings

    from . import RecordIOReader, TFRecordReader
    from .errors import DataLossError
    rc = 0
    for path in args.files:
        fmt = _detect_or_report(path)
        if fmt is None:
            rc = 1
            continue
        kind, comp = fmt
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if kind == "recordio":
                    r = RecordIOReader(path, on_error="skip" if args.skip else "raise")
                else:
                    r = TFRecordReader(path, compression=comp, index=False)
            except (OSError, ValueError) as e:
                print(f"{path}: ERROR {e}")
                rc = 1
                continue
            print(f"{path}")
            print(f"  format:  {_describe_format(kind, comp)}")
            try:
                if kind == "recordio":
                    print(f"  schema:  {r.schema}")
                    print(f"  records: {r.num_records}   chunks: {r.num_chunks}   "
                          f"index footer: {'yes' if r.has_index else 'no'}")
                else:
                    print(f"  schema:  none stored (records are byte strings; "
                          f"`readerlib convert --schema` gives them one)")
                    print(f"  records: {r.num_records}   chunks: {r.num_chunks}   sidecar index: "
                          f"{'yes' if os.path.exists(path + '.idx') else 'no'}")
                # verify every record: reading through checks every checksum
                n = 0
                for b in r.batch(4096):
                    n += len(b[0])
                skipped = r.skipped_chunks if kind == "recordio" else 0
                status = "ok" if n == r.num_records and not skipped else "PROBLEMS"
                if status != "ok":
                    rc = 1
                print(f"  verified: {n} records, {skipped} chunk(s) skipped -> {status}")
            except (DataLossError, ValueError) as e:
                print(f"  verify FAILED: {e}")
                rc = 1
        for w in caught:
            print(f"  warning: {w.message}")
    return rc


def _cmd_index(args):
    from . import RecordIOReader
    from .formats._tfrecord import build_index
    rc = 0
    for path in args.files:
        fmt = _detect_or_report(path)
        if fmt is None:
            rc = 1
            continue
        kind, comp = fmt
        try:
            if kind == "recordio":
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r = RecordIOReader(path)
                if r.has_index:
                    print(f"{path}: RecordIO, its index is in the file's footer ({r.num_chunks} chunks, "
                          f"{r.num_records} records); nothing to write")
                else:
                    print(f"{path}: RecordIO without its index footer (its writer was not closed); "
                          f"`readerlib convert {path} NEW.rio` writes a complete copy")
                    rc = 1
                continue
            out = build_index(path, compression=args.compression or comp)
        except (OSError, ValueError) as e:
            print(f"{path}: ERROR {e}")
            rc = 1
            continue
        print(f"{path}: index written{f' to {out}' if isinstance(out, str) else ''}")
    return rc


def _dst_format(dst, to, compression):
    """(kind, compression) for the output: --to, else the suffix (.gz / .zlib after it ok)."""
    low = dst.lower()
    comp_by_suffix = None
    for suf, c in ((".gz", "GZIP"), (".gzip", "GZIP"), (".zlib", "ZLIB")):
        if low.endswith(suf):
            comp_by_suffix, low = c, low[:-len(suf)]
            break
    kind = to or _SUFFIXES.get(os.path.splitext(low)[1])
    if kind is None and comp_by_suffix:
        kind = "tfrecord"
    if kind is None:
        raise CliError(f"readerlib convert: cannot tell the format of {dst!r} from its suffix "
                       f"({', '.join(sorted(_SUFFIXES))}); pass --to recordio or --to tfrecord", 2)
    if compression is not None:
        c = compression.upper()
        if kind == "tfrecord":
            if c not in ("GZIP", "ZLIB", "NONE"):
                raise CliError(f"readerlib convert: --compression for TFRecord output is GZIP, ZLIB or none, "
                               f"got {compression!r}", 2)
            return kind, None if c == "NONE" else c
        if c not in ("ZLIB", "NONE"):
            raise CliError(f"readerlib convert: --compression for RecordIO output is zlib or none "
                           f"(chunks are compressed one by one), got {compression!r}", 2)
        return kind, "zlib" if c == "ZLIB" else "none"
    if kind == "tfrecord":
        return kind, comp_by_suffix
    if comp_by_suffix:
        raise CliError(f"readerlib convert: {dst!r}: a RecordIO file is not GZIP/ZLIB as a whole; "
                       "use --compression zlib (per chunk) and a .rio name", 2)
    return kind, "none"


def _cmd_convert(args):
    from . import RecordIOReader, RecordIOWriter, TFRecordReader, TFRecordWriter
    from .bench import Progress
    src, dst = args.src, args.dst
    out_kind, out_comp = _dst_format(dst, args.to, args.compression)
    schema = parse_schema(args.schema) if args.schema is not None else None
    if args.chunk_size is not None and args.chunk_size <= 0:
        raise CliError(f"readerlib convert: --chunk-size must be > 0, got {args.chunk_size}", 2)
    try:
        in_kind, in_comp = detect_format(src)
    except OSError as e:
        raise CliError(f"{src}: {e.strerror or e}") from None
    out_dir = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(out_dir):
        raise CliError(f"{dst}: cannot write it, the directory {out_dir!r} does not exist")
    if os.path.isdir(dst):
        raise CliError(f"{dst}: is a directory; DST is the output file's path", 2)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        raise CliError(f"readerlib convert: {src!r} and {dst!r} are the same file", 2)
    if in_kind == "recordio":
        if schema is not None:
            raise CliError(f"readerlib convert: --schema is for TFRecord input; {src} is RecordIO and "
                           "carries its schema", 2)
        reader = RecordIOReader(src)
        schema = reader.schema
        total = reader.num_records
        decoder = None
    else:
        from . import Field, Schema
        reader = TFRecordReader(src, compression=in_comp, index=False)   # no sidecar written beside SRC
        total = reader.num_records if in_comp is None else None          # a compressed stream: unknown
        if schema is None:
            schema = Schema([Field("data", "uint8", (), lod_level=1)])
        decoder = _Decoder(src, schema)
    if out_kind == "tfrecord":
        _check_tfrecord_schema(schema)
    chain = reader.batch(_CONVERT_BATCH)
    # written beside DST and renamed at the end: DST never holds a partial file
    tmp = os.path.join(out_dir, f".{os.path.basename(dst)}.partial-{os.getpid()}")
    if out_kind == "recordio":
        kw = {"chunk_size": args.chunk_size} if args.chunk_size else {}
        writer = RecordIOWriter(tmp, schema, compressor=out_comp, **kw)
    else:
        writer = TFRecordWriter(tmp, compression=out_comp)
    n = 0
    t0 = time.perf_counter()
    ok = False
    try:
        with Progress(total, f"{os.path.basename(src)} -> {os.path.basename(dst)}",
                      args.progress) as bar:
            for batch in chain:
                if decoder is not None:
                    data = batch[0]
                    cols = decoder.decode(np.asarray(data.data), data.lod[0])
                    if out_kind == "recordio":
                        writer.write_batch(cols)
                    else:                  # TFRecord -> TFRecord: the same bytes, (re)compressed
                        writer.write_batch(_encode_batch(_as_batch(cols, schema), schema))
                else:
                    recs = _encode_batch(batch, schema)
                    if out_kind == "tfrecord":
                        writer.write_batch(recs)
                    else:
                        writer.write_batch({f.name: _column(batch[i], f) for i, f in enumerate(schema)})
                k = len(batch[0])
                n += k
                bar.update(k)
        writer.close()
        ok = True
    finally:
        chain.close()
        if not ok:
            try:
                writer.close()
            except Exception:                  # the original error is the one to report
                pass
            if os.path.exists(tmp):
                os.unlink(tmp)
    os.replace(tmp, dst)
    dt = max(time.perf_counter() - t0, 1e-9)
    in_mb, out_mb = os.path.getsize(src) / 1e6, os.path.getsize(dst) / 1e6
    print(f"{src} ({_describe_format(in_kind, in_comp)}) -> {dst} "
          f"({_describe_format(out_kind, out_comp if out_kind == 'tfrecord' else None)}"
          f"{', zlib chunks' if out_comp == 'zlib' else ''}): {n:,} records, "
          f"{in_mb:,.1f} MB read, {out_mb:,.1f} MB written in {dt:.2f} s: "
          f"{n / dt:,.0f} records/s, {in_mb / dt:,.1f} MB/s read, {out_mb / dt:,.1f} MB/s written")
    if out_kind == "tfrecord" and in_kind == "recordio":
        print(f"schema (TFRecord stores none; to convert back pass): --schema '{schema_to_spec(schema)}'")
    return 0


def _column(t, f):
    """A batch's LoDTensor as a write_batch column."""
    return t if f.lod_level else np.asarray(t.data)


def _as_batch(cols, schema):
    """Decoded columns back into a tuple of LoDTensor (for TFRecord -> TFRecord)."""
    from . import LoDTensor
    out = []
    for f in schema:
        c = cols[f.name]
        if isinstance(c, LoDTensor) or not f.lod_level:
            out.append(c if isinstance(c, LoDTensor) else LoDTensor(c))
        else:
            out.append(LoDTensor.from_sequences(c, dtype=f.dtype) if c else
                       LoDTensor(np.empty((0,) + f.shape, f.dtype), [np.zeros(1, np.int64)]))
    return tuple(out)


def _version():
    from . import __version__
    return f"readerlib {__version__}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="readerlib", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="time file -> shuffle -> batch on an embedded seeded dataset")
    b.add_argument("--datasets", default="small,large,seq", help="comma list of small,large,seq")
    b.add_argument("--scale", type=float, default=1.0, help="multiply dataset sizes (e.g. 0.1 for a quick run)")
    b.add_argument("--epochs", type=int, default=1, help="epochs per readerlib measurement")
    b.add_argument("--repeats", type=int, default=3,
                   help="measurements per dataset and reader; the table shows their median and min-max")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--workdir", default=None, help="where to write the temporary dataset")
    b.add_argument("--no-python", action="store_true", help="skip the plain-Python peer")
    b.add_argument("--progress", action="store_true", help="force the progress bars (default: on a TTY)")
    b.add_argument("--json", default=None, help="also write results to this JSON file")
    b.set_defaults(func=_cmd_bench)
    i = sub.add_parser("inspect", help="print format, schema, record and chunk counts; verify checksums")
    i.add_argument("files", nargs="+")
    i.add_argument("--skip", action="store_true", help="RecordIO: skip bad chunks instead of stopping")
    i.set_defaults(func=_cmd_inspect)
    x = sub.add_parser("index", help="build the sidecar index of TFRecord files (for seeking and sharding)")
    x.add_argument("files", nargs="+")
    x.add_argument("--compression", default=None, choices=[None, "ZLIB", "GZIP"],
                   help="the files' compression (default: from their bytes)")
    x.set_defaults(func=_cmd_index)
    c = sub.add_parser("convert", help="convert TFRecord <-> RecordIO (SRC's format from its bytes)",
                       description="Convert SRC to DST.  SRC's format is read from its bytes; DST's from "
                                   "--to or its suffix (.rio/.recordio, .tfrecord/.tfrecords/.tfr, "
                                   "optionally followed by .gz/.zlib).  RecordIO -> TFRecord -> RecordIO "
                                   "gives back the same records, bit for bit.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="--schema: " + SCHEMA_HELP)
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", choices=["recordio", "tfrecord"], default=None, help="DST's format (default: its suffix)")
    c.add_argument("--schema", default=None, help="TFRecord input: the records' schema (see below)")
    c.add_argument("--compression", default=None,
                   help="TFRecord output: GZIP, ZLIB or none (default: by suffix .gz/.zlib); "
                        "RecordIO output: zlib or none (per chunk)")
    c.add_argument("--chunk-size", type=int, default=None, help="RecordIO output: bytes per chunk (default 1 MiB)")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar (default: on a TTY)")
    c.set_defaults(func=_cmd_convert)
    args = p.parse_args(argv)
    import warnings

    from .errors import DataLossError

    def one_line(message, category, *_args, **_kw):       # warnings without source lines
        print(f"readerlib {args.cmd}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            return args.func(args)
    except CliError as e:
        print(f"readerlib {args.cmd}: {e}" if not str(e).startswith("readerlib") else str(e), file=sys.stderr)
        return e.code
    except (DataLossError, ValueError, TypeError, OSError) as e:
        # the readers' messages name the file and the byte offset
        print(f"readerlib {args.cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"readerlib {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
