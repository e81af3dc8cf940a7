import json
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
