import json
import os
import subprocess
import sys

import numpy as np
import pytest

import readerlib as rl
from readerlib import cli


def test_bench_tiny_run_reports_every_dataset(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc = cli.main(["bench", "--scale", "0.002", "--epochs", "1", "--workdir", str(tmp_path),
                   "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "small" in text and "large" in text and "seq" in text
    rows = json.loads(out_json.read_text())
    assert [r["dataset"] for r in rows] == ["small", "large", "seq"]
    for r in rows:
        assert r["readerlib_rec_s"] > 0 and r["python_rec_s"] > 0
        assert r["python_records"] <= r["records"]
    assert list(tmp_path.glob("readerlib-bench-*")) == []      # temp data cleaned up


def test_bench_python_peer_reads_the_same_records(tmp_path):
    from readerlib import bench
    path = str(tmp_path / "s.rio")
    schema, _ = bench.make_dataset(path, "seq", 50, seed=1, chunk_size=4096)
    recs = [bytes(r) for r in bench._python_records(path)]
    assert len(recs) == 50
    first = rl.RecordIOReader(path).read_next()
    feats, offsets, labels = bench._python_batch(recs[:1], schema, fixed=False)
    np.testing.assert_array_equal(feats, first[0])
    assert labels[0] == first[1]


def _write(path, n=20):
    s = rl.Schema([rl.Field("x", "int32", (3,))])
    with rl.RecordIOWriter(path, s, chunk_size=64) as w:
        w.write_batch({"x": np.arange(3 * n, dtype=np.int32).reshape(n, 3)})


def test_inspect_ok_and_corrupt(tmp_path, capsys):
    good = tmp_path / "good.rio"
    _write(good)
    assert cli.main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "records: 20" in out and "-> ok" in out
    bad = tmp_path / "bad.rio"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert cli.main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "byte offset" in out


def test_console_script_runs(tmp_path):
    # run outside the source tree, importing the readerlib these tests import
    import os
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__))))
    r = subprocess.run([sys.executable, "-m", "readerlib.cli", "--help"], capture_output=True, text=True,
                       cwd=tmp_path, env=env)
    assert r.returncode == 0 and "bench" in r.stdout


def test_index_command_writes_a_sidecar_that_the_reader_uses(tmp_path, capsys):
    path = str(tmp_path / "a.tfrecord")
    with rl.TFRecordWriter(path) as w:
        for i in range(50):
            w.write(bytes([i]) * (i + 1))
    assert cli.main(["index", path]) == 0
    assert "index written" in capsys.readouterr().out
    assert (tmp_path / "a.tfrecord.idx").exists()
    assert [len(x[0]) for x in rl.TFRecordReader(path)] == list(range(1, 51))
    assert cli.main(["index", str(tmp_path / "missing.tfrecord")]) == 1


# -- readerlib bench --repeats ------------------------------------------------------------------

def test_bench_repeats_reports_median_and_spread(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    rc = cli.main(["bench", "--scale", "0.001", "--repeats", "2", "--datasets", "small,seq",
                   "--workdir", str(tmp_path), "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    head = next(line for line in text.splitlines() if line.lstrip().startswith("dataset"))
    assert "spread" in head and "ratio" in head
    assert "median of 2 repeats" in text and "min-max" in text
    rows = json.loads(out_json.read_text())
    assert [r["dataset"] for r in rows] == ["small", "seq"]
    for r in rows:
        assert r["repeats"] == 2
        for who in ("readerlib", "python"):
            lo, med, hi = r[f"{who}_rec_s_min"], r[f"{who}_rec_s"], r[f"{who}_rec_s_max"]
            assert 0 < lo <= med <= hi
        assert r["speedup"] == pytest.approx(r["readerlib_rec_s"] / r["python_rec_s"])
        line = next(line for line in text.splitlines() if line.lstrip().startswith(r["dataset"] + " "))
        assert f"{r['readerlib_rec_s']:,.0f}" in line and f"{r['speedup']:.1f}x" in line
    assert cli.main(["bench", "--repeats", "0"]) == 2


# -- format detection ---------------------------------------------------------------------------

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
sys.path.insert(0, DATA)
from make_tfrecord import tf_records  # noqa: E402


def _files_of_each_kind(tmp_path):
    """name -> (path, expected detect_format result or None for 'neither')."""
    import gzip
    import shutil
    import zlib
    rio = tmp_path / "a.rio"
    _write(rio)
    out = {"recordio": (rio, ("recordio", None))}
    # names that hide the format: detection must read the bytes
    for src, comp in (("tf_written.tfrecord", None), ("tf_written.tfrecord.gz", "GZIP"),
                      ("tf_written.tfrecord.zlib", "ZLIB")):
        dst = tmp_path / f"{comp or 'plain'}.bin"
        shutil.copy(os.path.join(DATA, src), dst)
        out[f"tfrecord-{comp}"] = (dst, ("tfrecord", comp))
    (tmp_path / "empty.dat").write_bytes(b"")
    out["empty"] = (tmp_path / "empty.dat", ("tfrecord", None))     # TF reads it: no records
    junk = b"just some text, neither format\n" * 4
    (tmp_path / "junk.tfrecord").write_bytes(junk)
    out["junk"] = (tmp_path / "junk.tfrecord", None)
    (tmp_path / "junk.gz").write_bytes(gzip.compress(junk))
    out["gzip-junk"] = (tmp_path / "junk.gz", None)
    (tmp_path / "junk.zlib").write_bytes(zlib.compress(junk))
    out["zlib-junk"] = (tmp_path / "junk.zlib", None)
    (tmp_path / "short.rio").write_bytes(b"RLREC")
    out["short"] = (tmp_path / "short.rio", None)
    return out


def test_detect_format_reads_the_bytes(tmp_path):
    for name, (path, want) in _files_of_each_kind(tmp_path).items():
        if want is None:
            with pytest.raises(cli.CliError, match=str(path)):
                cli.detect_format(str(path))
        else:
            assert cli.detect_format(str(path)) == want, name


def test_inspect_and_index_each_kind_of_file(tmp_path, capsys):
    n_tf = len(tf_records())
    for name, (path, want) in _files_of_each_kind(tmp_path).items():
        rc = cli.main(["inspect", str(path)])
        out = capsys.readouterr().out
        if want is None:
            assert rc == 1, name
            assert f"{path}: ERROR" in out and "not" in out and "checksum mismatch" not in out, name
            assert cli.main(["index", str(path)]) == 1
            assert f"{path}: ERROR" in capsys.readouterr().out
            continue
        assert rc == 0, (name, out)
        assert "-> ok" in out, name
        kind, comp = want
        if kind == "recordio":
            assert "format:  RecordIO" in out and "records: 20" in out
            assert cli.main(["index", str(path)]) == 0
            assert "index is in the file's footer" in capsys.readouterr().out
        else:
            assert f"format:  TFRecord{f' ({comp})' if comp else ''}" in out, (name, out)
            n = 0 if name == "empty" else n_tf
            assert f"records: {n}" in out and f"verified: {n} records" in out, (name, out)
            assert cli.main(["index", str(path)]) == 0, name       # compression from the bytes
            assert "index written" in capsys.readouterr().out
            assert os.path.exists(str(path) + ".idx")


def test_inspect_corrupt_tfrecord_names_file_and_offset(tmp_path, capsys):
    data = bytearray(open(os.path.join(DATA, "tf_written.tfrecord"), "rb").read())
    data[len(data) // 2] ^= 0x01
    bad = tmp_path / "bad.tfrecord"
    bad.write_bytes(bytes(data))
    assert cli.main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "format:  TFRecord" in out and str(bad) in out and "corrupted record at" in out


# -- readerlib --version ------------------------------------------------------------------------

def _run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__))))
    return subprocess.run([sys.executable, "-m", "readerlib.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)


def test_version(tmp_path):
    r = _run_cli("--version", cwd=tmp_path)
    assert r.returncode == 0
    assert r.stdout.strip() == f"readerlib {rl.__version__}"


# -- readerlib convert --------------------------------------------------------------------------

def _schema_cases():
    rng = np.random.default_rng(7)
    n = 37
    lens = [0, 1, 5, 0, 9] + rng.integers(0, 12, size=n - 5).tolist()
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)       # noqa: E731
    return {
        "one-fixed": (rl.Schema([rl.Field("x", "int32", (3,))]),
                      {"x": rng.integers(-2**31, 2**31, size=(n, 3), dtype=np.int32)}),
        "one-lod": (rl.Schema([rl.Field("feats", "float32", (4,), lod_level=1)]),
                    {"feats": [f32(k, 4) for k in lens]}),
        "fixed-fields": (rl.Schema([rl.Field("img", "uint8", (2, 3)), rl.Field("w", "float64"),
                                    rl.Field("y", "int64")]),
                         {"img": rng.integers(0, 256, size=(n, 2, 3), dtype=np.uint8),
                          "w": rng.standard_normal(n), "y": rng.integers(-9, 9, size=n)}),
        "lod-and-fixed": (rl.Schema([rl.Field("feats", "float32", (4,), lod_level=1),
                                     rl.Field("label", "int64"),
                                     rl.Field("ids", "int16", (), lod_level=1),
                                     rl.Field("mask", "bool", (2,))]),
                          {"feats": [f32(k, 4) for k in lens], "label": np.arange(n) - 5,
                           "ids": [rng.integers(-300, 300, size=(k * 3) % 7, dtype=np.int16) for k in lens],
                           "mask": rng.integers(0, 2, size=(n, 2)).astype(bool)}),
    }


def _raw_records(path):
    from readerlib import bench
    return [bytes(r) for r in bench._python_records(str(path))]


@pytest.mark.parametrize("case", sorted(_schema_cases()))
@pytest.mark.parametrize("tf_suffix,comp", [(".tfrecord", None), (".tfrecord.gz", "GZIP"),
                                            (".tfr", "ZLIB")])
def test_convert_recordio_tfrecord_recordio_is_bit_exact(tmp_path, capsys, case, tf_suffix, comp):
    schema, cols = _schema_cases()[case]
    src = tmp_path / "src.rio"
    with rl.RecordIOWriter(src, schema, chunk_size=256) as w:
        w.write_batch(cols)
    mid = tmp_path / f"mid{tf_suffix}"
    extra = ["--compression", comp] if comp == "ZLIB" else []
    assert cli.main(["convert", str(src), str(mid), *extra]) == 0
    out = capsys.readouterr().out
    n = len(next(iter(cols.values())))
    assert f"{n:,} records" in out and "records/s" in out and "MB/s" in out
    assert cli.detect_format(str(mid)) == ("tfrecord", comp)
    spec = out.split("--schema '")[1].split("'")[0]           # the schema the tool tells us to pass
    assert cli.parse_schema(spec) == schema
    back = tmp_path / "back.rio"
    assert cli.main(["convert", str(mid), str(back), "--schema", spec, "--chunk-size", "1000"]) == 0
    capsys.readouterr()
    assert rl.RecordIOReader(back).schema == schema
    assert _raw_records(back) == _raw_records(src)
    assert len(_raw_records(src)) == n
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_convert_one_field_tfrecord_is_the_raw_value_bytes(tmp_path, capsys):
    # a one-field TFRecord is what tf.io.decode_raw / TFRecordReader(schema) read back
    schema, cols = _schema_cases()["one-lod"]
    src = tmp_path / "s.rio"
    with rl.RecordIOWriter(src, schema) as w:
        w.write_batch(cols)
    assert cli.main(["convert", str(src), str(tmp_path / "s.tfrecord")]) == 0
    got = [x[0] for x in rl.TFRecordReader(str(tmp_path / "s.tfrecord"), schema=schema, index=False)]
    assert len(got) == len(cols["feats"])
    for a, b in zip(got, cols["feats"]):
        np.testing.assert_array_equal(a, b)


def test_convert_tensorflow_written_files(tmp_path, capsys):
    recs = tf_records()
    # no schema: each record a uint8 sequence
    assert cli.main(["convert", os.path.join(DATA, "tf_written.tfrecord.zlib"), str(tmp_path / "t.rio")]) == 0
    r = rl.RecordIOReader(tmp_path / "t.rio")
    assert r.schema == rl.Schema([rl.Field("data", "uint8", (), lod_level=1)])
    assert [x[0].tobytes() for x in r] == recs
    # TFRecord -> TFRecord (GZIP): the bytes TensorFlow's writer made
    assert cli.main(["convert", os.path.join(DATA, "tf_written.tfrecord"), str(tmp_path / "t.gz")]) == 0
    with open(os.path.join(DATA, "tf_written.tfrecord.gz"), "rb") as f:
        assert (tmp_path / "t.gz").read_bytes() == f.read()
    # and back from RecordIO: the uncompressed file, byte for byte
    assert cli.main(["convert", str(tmp_path / "t.rio"), str(tmp_path / "u"), "--to", "tfrecord"]) == 0
    with open(os.path.join(DATA, "tf_written.tfrecord"), "rb") as f:
        assert (tmp_path / "u").read_bytes() == f.read()


def test_convert_schema_from_json_file(tmp_path, capsys):
    schema, cols = _schema_cases()["lod-and-fixed"]
    src = tmp_path / "s.rio"
    with rl.RecordIOWriter(src, schema) as w:
        w.write_batch(cols)
    assert cli.main(["convert", str(src), str(tmp_path / "m.tfrecord")]) == 0
    (tmp_path / "schema.json").write_text(schema.to_json())
    assert cli.main(["convert", str(tmp_path / "m.tfrecord"), str(tmp_path / "b.rio"),
                     "--schema", str(tmp_path / "schema.json")]) == 0
    assert _raw_records(tmp_path / "b.rio") == _raw_records(src)


@pytest.mark.parametrize("spec,want", [
    ("feats:float32:80:lod,label:int64",
     rl.Schema([rl.Field("feats", "float32", (80,), lod_level=1), rl.Field("label", "int64")])),
    ("img:uint8:32x32x3", rl.Schema([rl.Field("img", "uint8", (32, 32, 3))])),
    ("tok:int32::lod", rl.Schema([rl.Field("tok", "int32", (), lod_level=1)])),
    ('{"fields": [{"name": "x", "dtype": "float16", "shape": [2], "lod_level": 0}]}',
     rl.Schema([rl.Field("x", "float16", (2,))])),
])
def test_parse_schema(spec, want):
    assert cli.parse_schema(spec) == want
    assert cli.parse_schema(cli.schema_to_spec(want)) == want


def _tf_file(tmp_path, records, name="in.tfrecord"):
    path = tmp_path / name
    with rl.TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    return path


@pytest.mark.parametrize("spec,fragment", [
    ("x:flot32", "flot32"),
    ("x:float32:8x:lod", "shape '8x'"),
    ("justname", "NAME:DTYPE"),
    ("a:int64,a:int32", "unique"),
    ("{not json", "JSON"),
])
def test_convert_bad_schema_exits_2_with_a_message(tmp_path, spec, fragment):
    src = _tf_file(tmp_path, [b"12345678"])
    r = _run_cli("convert", src, tmp_path / "o.rio", "--schema", spec)
    assert r.returncode == 2, r.stderr
    assert fragment in r.stderr and "--schema" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o.rio").exists()


def test_convert_record_that_does_not_fit_names_file_record_and_offset(tmp_path):
    good = (3).to_bytes(8, "little") + bytes(12) + (7).to_bytes(8, "little")   # 3 x int32, then label
    cases = [
        ([good, good, good[:-1]], "feats:int32:1:lod,label:int64", "record 2 (offset 88)", "label"),
        ([good, b"\x01" * 3], "feats:int32:1:lod,label:int64", "record 1 (offset 44)", "row count"),
        ([good, good + b"!"], "feats:int32:1:lod,label:int64", "record 1 (offset 44)", "1 bytes left"),
        ([bytes(8), bytes(8), bytes(7)], "x:float32:2", "record 2 (offset 48)", "needs 8 bytes"),
        ([bytes(8), bytes(6)], "x:float32:1:lod", "record 1 (offset 24)", "whole number of rows"),
        ([(2 ** 40).to_bytes(8, "little") + bytes(8)], "feats:int32:1:lod,label:int64",
         "record 0 (offset 0)", "row count"),
    ]
    for recs, spec, where, what in cases:
        src = _tf_file(tmp_path, recs)
        dst = tmp_path / "o.rio"
        r = _run_cli("convert", src, dst, "--schema", spec)
        assert r.returncode == 1, (spec, r.stderr)
        assert str(src) in r.stderr and where in r.stderr and what in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert not dst.exists() and [p for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_convert_corrupt_or_foreign_input_exits_1(tmp_path):
    data = bytearray(open(os.path.join(DATA, "tf_written.tfrecord"), "rb").read())
    data[len(data) // 2] ^= 0x01
    bad_tf = tmp_path / "bad.tfrecord"
    bad_tf.write_bytes(bytes(data))
    good_rio = tmp_path / "good.rio"
    _write(good_rio)
    rio = bytearray(good_rio.read_bytes())
    rio[len(rio) // 2] ^= 0xFF
    bad_rio = tmp_path / "bad.rio"
    bad_rio.write_bytes(bytes(rio))
    junk = tmp_path / "junk.rio"
    junk.write_bytes(b"hello, not a data file\n" * 3)
    for src, fragment in ((bad_tf, "corrupted record at"), (bad_rio, "byte offset"),
                          (junk, "not a RecordIO file"), (tmp_path / "missing.rio", "No such file")):
        for dst in ("o.rio", "o.tfrecord"):
            r = _run_cli("convert", src, tmp_path / dst)
            assert r.returncode == 1, (src, r.stderr)
            assert str(src) in r.stderr and fragment in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
            assert not (tmp_path / dst).exists()
    assert [p for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_convert_argument_errors_exit_2(tmp_path, capsys):
    src = tmp_path / "a.rio"
    _write(src)
    (tmp_path / "d.rio").mkdir()
    for args, fragment in ((["o.data"], "--to"), (["o.tfrecord", "--compression", "lz4"], "GZIP, ZLIB or none"),
                           (["o.rio", "--compression", "GZIP"], "zlib or none"),
                           (["o.rio.gz"], "not GZIP/ZLIB as a whole"),
                           (["o.tfrecord", "--schema", "x:int32:3"], "carries its schema"),
                           (["a.rio"], "same file"), (["d.rio"], "is a directory")):
        assert cli.main(["convert", str(src), str(tmp_path / args[0]), *args[1:]]) == 2, args
        err = capsys.readouterr().err
        assert fragment in err, (args, err)
    assert cli.main(["convert", str(src), str(tmp_path / "no" / "such" / "dir.rio")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["convert", str(src), str(tmp_path / "z.rio"), "--compression", "zlib"]) == 0
    z, a = list(rl.RecordIOReader(tmp_path / "z.rio")), list(rl.RecordIOReader(src))
    assert len(z) == len(a) == 20
    for x, y in zip(z, a):
        np.testing.assert_array_equal(x[0], y[0])
    assert (tmp_path / "z.rio").stat().st_size < src.stat().st_size       # zlib chunks


def test_convert_progress_bar_when_asked(tmp_path, capsys):
    src = tmp_path / "a.rio"
    _write(src)
    assert cli.main(["convert", str(src), str(tmp_path / "b.tfrecord"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert "a.rio -> b.tfrecord" in err and "100%" in err and "20/20" in err
    assert cli.main(["convert", str(src), str(tmp_path / "c.tfrecord")]) == 0     # not a TTY: quiet
    assert capsys.readouterr().err == ""


def test_convert_empty_file_and_zero_byte_rows(tmp_path, capsys):
    s = rl.Schema([rl.Field("x", "float32", (2,), lod_level=1), rl.Field("y", "int8")])
    with rl.RecordIOWriter(tmp_path / "e.rio", s):
        pass
    assert cli.main(["convert", str(tmp_path / "e.rio"), str(tmp_path / "e.tfrecord.gz")]) == 0
    assert cli.main(["convert", str(tmp_path / "e.tfrecord.gz"), str(tmp_path / "e2.rio"),
                     "--schema", "x:float32:2:lod,y:int8"]) == 0
    assert "0 records" in capsys.readouterr().out
    assert rl.RecordIOReader(tmp_path / "e2.rio").num_records == 0
    # rows of 0 bytes: with another field the count travels; alone it could not
    s = rl.Schema([rl.Field("x", "float32", (0,), lod_level=1), rl.Field("y", "int8")])
    with rl.RecordIOWriter(tmp_path / "z.rio", s) as w:
        w.write((np.zeros((3, 0), np.float32), 1))
    assert cli.main(["convert", str(tmp_path / "z.rio"), str(tmp_path / "z.tfrecord")]) == 0
    assert cli.main(["convert", str(tmp_path / "z.tfrecord"), str(tmp_path / "z2.rio"),
                     "--schema", "x:float32:0:lod,y:int8"]) == 0
    assert _raw_records(tmp_path / "z2.rio") == _raw_records(tmp_path / "z.rio")
    capsys.readouterr()
    assert cli.main(["convert", str(tmp_path / "z.tfrecord"), str(tmp_path / "z3.rio"),
                     "--schema", "x:float32:0:lod"]) == 2
    assert "rows of 0 bytes" in capsys.readouterr().err


def test_convert_a_recordio_file_without_its_footer(tmp_path):
    # an unfinished file (writer killed): readable with a warning; convert writes a complete copy
    good = tmp_path / "good.rio"
    _write(good)
    raw = good.read_bytes()
    cut = tmp_path / "cut.rio"
    cut.write_bytes(raw[:raw.index(b"RIDX")])
    r = _run_cli("convert", cut, tmp_path / "fixed.rio")
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "Traceback" not in r.stderr and "warnings.warn" not in r.stderr
    assert rl.RecordIOReader(tmp_path / "fixed.rio").has_index
    assert _raw_records(tmp_path / "fixed.rio") == _raw_records(good)
    r = _run_cli("index", cut)
    assert r.returncode == 1 and "without its index footer" in r.stdout


def _random_case(draw):
    from hypothesis import strategies as st
    dtypes = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64"]
    nf = draw(st.integers(1, 3))
    fields = [rl.Field(f"f{i}", draw(st.sampled_from(dtypes)),
                       tuple(draw(st.lists(st.integers(1, 3), max_size=2))),
                       draw(st.integers(0, 1))) for i in range(nf)]
    schema = rl.Schema(fields)
    n = draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)

    def values(f, rows):
        raw = rng.integers(0, 256, size=rows * f.row_bytes, dtype=np.uint8)   # any bit pattern (NaNs too)
        if f.dtype == np.bool_:
            raw = (raw & 1).astype(np.uint8)
        return raw.view(f.dtype).reshape((rows,) + f.shape)
    cols = {f.name: ([values(f, int(rng.integers(0, 5))) for _ in range(n)] if f.lod_level else values(f, n))
            for f in schema}
    return schema, cols, draw(st.sampled_from([".tfrecord", ".tfrecord.gz", ".tfrecord.zlib"]))


def test_convert_round_trip_property(tmp_path_factory):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=30, deadline=None)
    @given(st.data())
    def check(data):
        schema, cols, suffix = _random_case(data.draw)
        d = tmp_path_factory.mktemp("rt")
        with rl.RecordIOWriter(d / "a.rio", schema, chunk_size=128) as w:
            if len(next(iter(cols.values()))):
                w.write_batch(cols)
        assert cli.main(["convert", str(d / "a.rio"), str(d / f"m{suffix}"), "--no-progress"]) == 0
        assert cli.main(["convert", str(d / f"m{suffix}"), str(d / "b.rio"),
                         "--schema", cli.schema_to_spec(schema)]) == 0
        assert _raw_records(d / "b.rio") == _raw_records(d / "a.rio")
    check()
