"""Every benchmark still runs: each script in --quick mode (tiny sizes) in a
subprocess with a time limit, its --out report checked for the rows it must
have; and the shared harness (benchmarks/harness.py) itself.

The figures of a quick run mean nothing and are not checked.  TensorFlow is
a peer only in bench_files (its import costs seconds); the others run with
--peers none or torch, so the file stays fast on a 2-core machine.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
# the folder holding the readerlib under test (the tree when built in place,
# site-packages when installed, as in CI): what an A/B of a build with itself runs
PKGROOT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("readerlib").__file__)))


def _have(mod):
    return importlib.util.find_spec(mod) is not None


def _load_harness():
    spec = importlib.util.spec_from_file_location("harness", os.path.join(BENCH, "harness.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


harness = _load_harness()

# script, extra flags, strings the report must contain, modules it needs
CASES = [
    ("bench_core.py", ["--peers", "torch"],
     ["| small: 20,000 x 64 B |", "| large: 81 x 65536 B, low_memory=False |", "| seq: 20 x",
      "64 KiB records, low_memory=True |", "64 KiB records, low_memory=False |", "memcpy of 16 MiB"], ["torch"]),
    ("bench_crc_fold.py", ["--peers", "torch"],
     ["| crc 64 KiB, crc32 |", "| memcpy gather |", "| fused gather nt, crc32 |",
      "| rio v2 (default), crc32 |", "| torch |"], ["torch"]),
    ("bench_contention.py", ["--sweep"],
     ["| 64 B records | 0 | this branch |", "| 64 KiB records | 1 | this branch |", "| 1 | 64 KiB |"], []),
    ("bench_files.py", [],
     ["open_files(16 files, num_threads=2).batch(256) |", "open_files(16 GZIP files, num_threads=2)",
      "| 65536 B |", "| vs no pool (best / median) |", "(fixed schema), best / median |"], ["tensorflow"]),
    ("bench_graph.py", ["--peers", "none"],
     ["| Session.run(constant -> identity), us per run |", "`sess.make_callable(x)` per batch",
      "cheapest 50-batch stretch"], []),
    ("bench_kernels_cpu.py", ["--peers", "torch", "--sweep"],
     ["| (50, 1, 29) | readerlib |", "| (40, 4, 129) | (read bandwidth: np.max, 2 threads) |",
      "| CTC (4, 8, 1025) |",
      "| (256, 512, 64) | torch.index_select out= |", "| (256, 512, 64) | np.add.at |",
      "copy bandwidth in this run"], ["torch"]),
    ("bench_pread.py", [],
     ["| RecordIO 5,000 x 64 B, low_memory=True |", "| TFRecord 20 x 65536 B |", "rec/CPU-s"], []),
    ("bench_prefetch.py", [],
     ["| sleep 2 ms | none |", "| spin 2 ms | capacity=2 |"], []),
    ("bench_prefetch_batch.py", ["--peers", "none", "--busy-sweep", "0"],
     ["| chain |", "| prefetch(64) below |", "| prefetch(4096) below |", "| prefetch(2) above |",
      "| map prefetch(64) below |", "| prefetch(64) below / chain |", "voluntary switches / 1000 instances"], []),
    ("bench_rnnt.py", [],
     ["| 1 | loop_labels |", "| 4 | loop_frames |", "| 4 | single |", "| best (ms) | rounds |"], []),
    ("bench_transforms.py", ["--peers", "none"],
     ["| chain + map(identity), 2 threads |", "| padded_batch(64) |", "| batch(256).map_batches(identity) |",
      "seq: map(feats @ W), 2 threads"], []),
    ("bench_scaling.py", ["--peers", "none"],
     ["| RecordIO file, 4,000 records |", "| ArrayReader (memory), 4,000 records |",
      "| shuffle buffer 10,000 |", "| batch 4,096 |", "| 64 x 64 KiB, 2 thread(s) |",
      "| readerlib RecordIOReader.shuffle.batch, shuffle(2,000) |", "| readerlib |", "memcpy of 16 MiB"], []),
    ("bench_big_records.py", ["--peers", "torch"],
     ["| rio v2 |", "| rio v2 staged |", "| rio v1 |", "| tfrecord |", "| torch |", "| memcpy gather |",
      "| mmap fused |", "| rio v2 / memcpy |", "| rio v2 / torch |", "| rio v2 / mmap fused |",
      "0 competing busy process(es)", "1 competing busy process(es)", "300 records of 65536 B",
      "peak RSS, default v2 chain", "memcpy of 16 MiB"], ["torch"]),
    ("bench_resume.py", [],
     ["| memory | 20,000 | unshuffled |", "| memory | 20,000 | buffer/old |", "| recordio | 20,000 | global |",
      "| recordio | 20,000 | buffer |", "| memory | 20,000 | map/prefetch |", "| recordio | 20,000 | map/prefetch/old |",
      "| recordio | 20,000 | window |", "| recordio | 20,000 | unshuffled/old |", "| source (N=20,000) |",
      "| recordio |"], []),
    ("bench_resume.py", ["--big-buffer-only", "--big-buffer-repeats", "1"],
     ["| memory | 20,000 | 10,000 |", "| recordio | 20,000 | 10,000 |", "state MB (JSON, max)", "CPU ms best / median"], []),
    ("bench_resume.py", ["--window-sweep"],
     ["| window_chunks (N=20,000) |", "| 1 |", "| 32 |", "| sequential RecordIO |"], []),
    ("bench_resume.py", ["--filter-shuffle"],
     ["| memory | 20,000 | filter/shuffle |", "| recordio | 20,000 | filter/shuffle/old |",
      "| memory | 20,000 | map/shuffle |", "| recordio | 20,000 | map/shuffle/old |"], []),
    ("bench_global_shuffle.py", ["--peers", "none"],
     ["20,000 x 64 B (0.00 GB), RecordIO file, batch 256", "open_files(4 files), batch 256",
      "| global_shuffle |", "| window shuffle(2,000) |", "| buffer shuffle(16) |",
      "restore (set_state + first batch) over open_files(4 files)", "| open_files.batch (old: replay) |",
      "memcpy of 64 MiB"], []),
    ("bench_cext.py", [],
     ["examples/normalize built in", "#### small: 2000 instances", "#### frames: 30 instances",
      "| Python map, 1 thread |", "| compiled map, 1 thread |", "threads (pool) |"], ["Cython"]),
    ("bench_cext.py", ["--no-compiled"],
     ["compiled map skipped", "| no map |", "| Python map, 2 threads |"], []),
    ("bench_shuffle_memory.py", ["--peers", "none"],
     ["| ArrayReader 20,000 x 64 B | 10,000 |", "| RecordIO 40 x 64 KiB | 10 |",
      "| RecordIO 10,000 x 64 B | 1,000 | new |"], []),
    ("bench_recordio_versions.py", ["--sweep"],
     ["| v1 | version=1 | 0x0 |", "| v2 tables (record_crc=True) | record_crc=True | 0x0 |",
      "| v2 default | (defaults) | 0x200 |", "file -> shuffle(10,000) -> batch(256), 2 interleaved",
      "file -> batch(256), 2 interleaved", "| 32 x 64 KiB, defaults | 0x100 | 32 |", "| 4,096 B | 256 |"], []),
    ("bench_binding.py", [],
     ["(the same build: A/B shows the noise)", "| batch 1, for |", "| batch 256, read_next |"], []),
    # the A/B regression check, the current build against itself
    ("bench_ab.py", ["--old", PKGROOT, "--new", PKGROOT],
     ["| RecordIO 64 B -> shuffle -> batch |", "| RecordIO 64 KiB, v1 file -> shuffle -> batch |",
      "| ArrayReader 64 KiB -> shuffle -> batch |", "| TFRecord 64 B -> shuffle -> batch |",
      "| RecordIO 64 B -> shuffle -> batch -> map_batches(identity) |", "| batch_reindex (",
      "| ctc_greedy_decoder (", "| import readerlib, wall of a fresh process"], []),
    # Ray's start-up alone takes 10-30 s here: run it with -m slow
    pytest.param("bench_ray.py", ["--sizes", "64", "--repeats", "1"],
                 ["| 2,000 x 64B | readerlib read_recordio |", "| 2,000 x 64B | ray.data.read_tfrecords |"],
                 ["ray"], marks=pytest.mark.slow),
]


def _env():
    env = dict(os.environ)
    # the script's own folder must come first on sys.path (that is how `import harness`
    # works); readerlib comes from PYTHONPATH (conftest puts the build under test there)
    env.pop("PYTHONSAFEPATH", None)
    return env


@pytest.mark.parametrize("script, flags, expected, needs", CASES)
def test_benchmark_quick(script, flags, expected, needs, tmp_path):
    for mod in needs:
        if not _have(mod):
            pytest.skip(f"{mod} is not installed")
    out = tmp_path / "report.md"
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), "--quick", "--out", str(out), *flags],
                       cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert "QUICK smoke run" in text and "- command: `python " in text
    missing = [s for s in expected if s not in text]
    assert not missing, f"{script}: rows missing from the report: {missing}\n{text}"
    assert not [p for p in os.listdir(tmp_path) if p != "report.md"], "the benchmark left files behind"


def test_no_benchmark_edits_sys_path_or_imports_tests():
    for name in sorted(os.listdir(BENCH)):
        if not (name.startswith("bench_") and name.endswith(".py")) and name != "harness.py":
            continue
        src = open(os.path.join(BENCH, name)).read()
        assert not re.search(r"sys\.path\s*(\.|\[|=|\+)", src), f"{name} edits sys.path"
        assert "from tests" not in src and "import tests" not in src, name
        assert "--write" not in src, f"{name}: one flag for the report, --out"
        assert "import harness" in src or name == "harness.py", f"{name} does not use the harness"


def test_interleaved_rotates_the_order_and_reports_best_median_spread():
    calls = []

    def contender(name):
        return lambda: calls.append(name)
    st = harness.interleaved({"a": contender("a"), "b": contender("b"), "c": contender("c")}, 3, warmup=1)
    # warm-up in order, then each round starts one contender later: no contender always runs first
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert set(st) == {"a", "b", "c"} and all(len(v.seconds) == 3 for v in st.values())

    s = harness.Stats("x", [2.0, 1.0, 4.0], units=10)
    assert (s.best, s.median, s.spread) == (1.0, 2.0, 1.5)
    assert (s.rate_best, s.rate_median) == (10.0, 5.0)
    with pytest.raises(ValueError, match="x: no rounds"):
        harness.Stats("x", [], 1)


def test_a_contender_that_times_itself_and_speedup():
    ticks = iter(range(100))
    st = harness.interleaved({
        "fast": lambda: harness.Sample(1.0, 100),            # 100 units per second
        "slow": lambda: harness.Sample(2.0 + next(ticks) % 2, 100),
    }, 4, warmup=0)
    assert st["fast"].units == 100 and st["fast"].seconds == [1.0] * 4
    best, median = harness.speedup(st, "fast", "slow")
    assert best == pytest.approx(2.0) and median == pytest.approx(2.5)


def test_run_child_returns_what_it_emitted_and_its_peak_rss():
    code = "import sys\nx = bytearray(int(sys.argv[1]) << 20)\nemit({'n': len(x)})\n"
    got, peak = harness.run_child(code, [64], timeout=60)
    assert got == [{"n": 64 << 20}]
    # the 64 MiB buffer is in the child's peak, above its baseline
    assert peak["peak_MB"] - peak["baseline_MB"] >= 60, peak
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        harness.run_child("1 / 0", timeout=60)
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_child("import time; time.sleep(30)", timeout=1)


def test_competitors_run_and_are_killed():
    with harness.Competitors(1) as c:
        (p,) = c.procs
        assert p.poll() is None           # spinning
    assert p.returncode is not None and not c.procs


def test_bandwidths_and_report(tmp_path):
    copy = harness.copy_bandwidth(4 << 20, repeats=2)
    read = harness.read_bandwidth(4 << 20, repeats=2)
    assert copy["rw"] == pytest.approx(2 * copy["copy"]) and copy["copy"] > 0.1
    assert read["1"] > 0.1 and read["2"] > 0.1
    line = harness.bounds_line(copy, read)
    assert "memcpy of 4 MiB" in line and "on 2" in line
    args = harness.parse(harness.parser("doc"), ["--quick", "--out", str(tmp_path / "r.md"), "--peers", "torch"])
    assert args.repeats == 2 and harness.want(args, "torch") and not harness.want(args, "tf")
    with harness.Report(args, "T") as rep:
        rep.table(["a", "b"], [[1, 2]])
    text = (tmp_path / "r.md").read_text()
    assert text.startswith("### T\n") and "| 1 | 2 |" in text and "load average (1 min) at end" in text


def test_big_records_old_busy_sweep_spelling_is_refused_with_the_new_one(tmp_path):
    # results/big_records.md was measured with `--busy 0,1` (the sweep before the harness);
    # it must not be read as something else: a clear error naming --busy-sweep
    r = subprocess.run([sys.executable, os.path.join(BENCH, "bench_big_records.py"), "--quick", "--busy", "0,1"],
                       cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--busy-sweep 0,1" in r.stderr, r.stderr[-2000:]
