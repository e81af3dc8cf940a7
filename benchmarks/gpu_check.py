#!/usr/bin/env python
"""The one prepared GPU check for readerlib's CUDA kernels (issue 4).

    python benchmarks/gpu_check.py [--out DIR] [--skip-tests] [--budget SECONDS]

Run from the repository root on a machine with an NVIDIA GPU, CuPy and (for the
peers) PyTorch.  In order, and in under 5 minutes on an H200:

1. builds the Cython extensions in place if any is missing or older than its
   ``.pyx`` (``python setup.py build_ext --inplace``), so the CPU kernels can be
   the reference; nothing else is built (CuPy compiles the ``.cu`` files itself);
2. runs the GPU tests: ``python -m pytest -m gpu -q tests``;
3. prints a table of CUDA-vs-CPU equality for every kernel on random inputs
   (bitwise for data, indices, values, shapes; relative error for neg_sum; for
   RNN-T at the benchmark's model size, labels and timestamps exactly and scores
   within 1e-4);
4. times the issue's benchmarks against peers measured in the same run --
   ``torch.index_select`` / ``cupy.take`` (forward), ``index_add_`` atomic and
   deterministic (backward), a CTC greedy decoder written with PyTorch ops -- and
   prints ms, the ratio to the peer, achieved TB/s and its share of the copy
   bandwidth measured at the start (about 4.3 TB/s read+write on an H200).

Timing: CUDA events around each call, followed by a synchronize; median of
repeated calls after warm-up; inputs rotate over several buffers when one set
would fit in L2.  "ours" is the public GPU path including its index check (one
small device-to-host copy); "ours kernel" is the copy kernel alone.

Three lighter modes:

    python benchmarks/gpu_check.py --smoke      # the equality table only
    python benchmarks/gpu_check.py --sanitize   # --smoke under compute-sanitizer
                                                # memcheck and racecheck (~2 min)
    python benchmarks/gpu_check.py --emulate    # the equality table with no GPU: the
                                                # real CUDA code on the CPU emulator
                                                # (tests/support/cuda_emu); no timings

Exit status: 1 if the build, a GPU test, an equality check, a benchmark or a
sanitizer pass failed; 0 otherwise (missed performance targets are reported,
not fatal).
With ``--out DIR`` the full results are also written to DIR/gpu_check.json and
DIR/gpu_check.md.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

# The shapes: reindex (N output rows, M input rows, inner), CTC (T, B, V).
REINDEX_SHAPES = ((4096, 8192, 2048), (1 << 20, 1 << 20, 64), (256, 512, 150528))
CTC_SHAPES = ((500, 32, 1025), (200, 128, 129), (1000, 16, 5001), (1000, 128, 5001))
RNNT_SHAPE = (32, 375)   # (batch, frames) of the RNN-T equality rows
COPY_BYTES = 1 << 31
WALL_BUDGET_S = 270

T0 = time.monotonic()
FAILURES = []
RESULTS = {"equality": [], "benchmarks": [], "notes": []}


def log(msg=""):
    print(msg, flush=True)


def elapsed():
    return time.monotonic() - T0


def fail(what, detail=""):
    FAILURES.append(what)
    log(f"!! FAIL: {what} {detail}".rstrip())


# ---- 1. build ----------------------------------------------------------------------

def stale_extensions():
    stale = []
    for pyx in glob.glob(os.path.join(ROOT, "readerlib", "**", "*.pyx"), recursive=True):
        built = glob.glob(pyx[:-4] + ".*.so") + glob.glob(pyx[:-4] + ".*.pyd")
        if not built or max(os.path.getmtime(b) for b in built) < os.path.getmtime(pyx):
            stale.append(os.path.relpath(pyx, ROOT))
    return stale


def build():
    stale = stale_extensions()
    if not stale:
        log("build: nothing to build (every .pyx has an up-to-date extension)")
        return
    log(f"build: {len(stale)} extension(s) missing or stale -> setup.py build_ext --inplace")
    t = time.monotonic()
    jobs = str(min(16, os.cpu_count() or 1))
    env = dict(os.environ, READERLIB_BUILD_JOBS=jobs)   # parallel cythonize too
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-j", jobs],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    if r.returncode:
        log(r.stdout[-3000:] + r.stderr[-3000:])
        fail("build", f"(setup.py exited {r.returncode})")
    else:
        log(f"build: done in {time.monotonic() - t:.0f} s")


# ---- 2. tests ----------------------------------------------------------------------

def run_gpu_tests(timeout):
    log(f"tests: python -m pytest -m gpu -q tests (timeout {timeout:.0f} s)")
    t = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                            "tests"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log((e.stdout or "")[-2000:] if isinstance(e.stdout, str) else "")
        fail("gpu tests", f"(timed out after {timeout:.0f} s)")
        return
    tail = (r.stdout + r.stderr).strip().splitlines()
    log("\n".join(tail[-25:]))
    RESULTS["tests"] = {"returncode": r.returncode, "summary": tail[-1] if tail else "",
                        "seconds": round(time.monotonic() - t, 1)}
    if r.returncode:
        fail("gpu tests", f"(pytest exited {r.returncode})")
    elif "passed" not in (tail[-1] if tail else ""):
        fail("gpu tests", "(nothing passed: were they all skipped?)")


# ---- helpers -----------------------------------------------------------------------

def import_stack():
    import cupy as cp
    from readerlib.kernels import _gpu
    import kernel_reference as ref
    try:
        import readerlib.kernels as public
        have_cpu = all(callable(getattr(public, f, None))
                       for f in ("batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder"))
    except ImportError:
        public, have_cpu = None, False
    try:
        import torch
    except ImportError:
        torch = None
    return cp, _gpu, ref, (public if have_cpu else None), torch


def bitwise_equal(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    diff = a.view(np.uint8) != b.view(np.uint8)
    return (not diff.any()), (f"{int(diff.sum())} bytes differ" if diff.any() else "")


def time_call(cp, fn, budget_s=1.0, min_reps=5, max_reps=200):
    """Median ms of fn(i) over repeated calls, each bracketed by events and a sync."""
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for i in range(2):
        fn(i)
    cp.cuda.runtime.deviceSynchronize()
    t = time.perf_counter()
    fn(2)
    cp.cuda.runtime.deviceSynchronize()
    one = max(time.perf_counter() - t, 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / one)))
    times = []
    for i in range(reps):
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), reps


def rotations(cp, bytes_per_call, free_bytes_cap):
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice()).get("l2CacheSize", 50 << 20)
    k = 1
    while k < 8 and k * bytes_per_call < 4 * l2 and (k + 1) * bytes_per_call < free_bytes_cap:
        k += 1
    return k


# ---- 3. equality -------------------------------------------------------------------

def equality_table(cp, gpu, ref, public):
    cpu_name = "readerlib CPU kernels" if public else "NumPy reference (CPU kernels not built)"
    log(f"\nequality: CUDA vs {cpu_name}, random inputs")
    rng = np.random.default_rng(2024)
    rows = RESULTS["equality"]

    def cpu(name, *args, **kw):
        return getattr(public or ref, name)(*args, **kw)

    def record(kernel, dtype, shape, ok, detail="", extra="", equal="bitwise equal"):
        rows.append({"kernel": kernel, "dtype": dtype, "shape": shape, "equal": ok,
                     "detail": detail, "extra": extra})
        log(f"  {kernel:<26} {dtype:<9} {shape:<22} {equal if ok else 'MISMATCH'}"
            f" {detail} {extra}".rstrip())
        if not ok:
            fail(f"equality {kernel} {dtype} {shape}", detail)

    from helpers import random_array

    def rand(shape, dtype):
        return random_array(rng, shape, dtype)

    dtypes = ["float16", "float32", "float64", "int32", "int64", "uint8"]
    for dt in dtypes:
        for it in ("int32", "int64"):
            try:
                x, idx = rand((2000, 37), dt), rng.integers(0, 2000, 3001).astype(it)
                ok, d = bitwise_equal(gpu.batch_reindex(cp.asarray(x), cp.asarray(idx)).get(),
                                      cpu("batch_reindex", x, idx))
                record("batch_reindex", dt, f"x(2000,37) idx:{it}", ok, d)
            except Exception as e:
                record("batch_reindex", dt, it, False, f"{type(e).__name__}: {e}")
    try:
        x, idx = rand((513, 1024), "float32"), rng.integers(0, 513, 700)
        buf = cp.zeros(x.nbytes + 4, np.uint8)
        xd = buf[4:].view(np.float32).reshape(x.shape)
        xd[...] = cp.asarray(x)
        ok, d = bitwise_equal(gpu.batch_reindex(xd, cp.asarray(idx)).get(), cpu("batch_reindex", x, idx))
        record("batch_reindex", "float32", "misaligned +4 B", ok, d)
    except Exception as e:
        record("batch_reindex", "float32", "misaligned", False, f"{type(e).__name__}: {e}")
    for dt in dtypes:
        for inner, n, m in (((37,), 3000, 1000), ((64,), 20000, 50), ((8,), 4000, 1)):
            try:
                dy, idx = rand((n,) + inner, dt), rng.integers(0, m, n)
                ok, d = bitwise_equal(gpu.batch_reindex_grad(cp.asarray(dy), cp.asarray(idx), m).get(),
                                      cpu("batch_reindex_grad", dy, idx, m))
                record("batch_reindex_grad", dt, f"dy{(n,) + inner} rows {m}", ok, d)
            except Exception as e:
                record("batch_reindex_grad", dt, f"{n}->{m}", False, f"{type(e).__name__}: {e}")
    try:
        lengths = rng.integers(0, 40, 300)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        data, idx = rand((int(offsets[-1]), 19), "float32"), rng.integers(0, 300, 500)
        gd, go = gpu.batch_reindex_lod(cp.asarray(data), cp.asarray(offsets), cp.asarray(idx))
        wd, wo = ref.batch_reindex_lod(data, offsets, idx)
        ok1, d1 = bitwise_equal(gd.get(), wd)
        ok2, d2 = bitwise_equal(go.get(), wo)
        record("batch_reindex_lod", "float32", "300 seqs -> 500", ok1 and ok2, d1 + d2)
    except Exception as e:
        record("batch_reindex_lod", "float32", "", False, f"{type(e).__name__}: {e}")

    try:
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        bf16 = None
    for dt in ("float32", "float64", "float16", "bfloat16"):
        for merge in (True, False):
            shape = (100, 16, 1025)
            try:
                if dt == "bfloat16" and bf16 is None:
                    RESULTS["notes"].append("bfloat16 CTC not checked: ml_dtypes missing")
                    continue
                if dt in ("float16", "bfloat16"):
                    x = rng.integers(-4, 4, size=shape).astype(bf16 if dt == "bfloat16" else dt)
                    x32 = x.astype(np.float32)
                else:
                    x = x32 = rng.standard_normal(shape).astype(dt)
                lengths = rng.integers(0, 101, 16).astype(np.int32)
                blank = int(rng.integers(0, 1025))
                (st,), neg = gpu.ctc_greedy_decoder(cp.asarray(x), cp.asarray(lengths), merge, blank)
                want = cpu("ctc_greedy_decoder", x32, lengths, merge_repeated=merge, blank_index=blank)
                if public:
                    (ws,), wneg = want
                    wi, wv, wsh = (np.asarray(a) for a in (ws.indices, ws.values, ws.dense_shape))
                else:
                    (wi, wv, wsh), wneg = want
                oks = [bitwise_equal(g.get(), np.asarray(w, np.int64))
                       for g, w in ((st.indices, wi), (st.values, wv), (st.dense_shape, wsh))]
                rel = float(np.max(np.abs(neg.get() - np.asarray(wneg)) /
                                   np.maximum(1, np.abs(np.asarray(wneg, np.float64)))))
                ok = all(o for o, _ in oks) and rel < (1e-10 if dt == "float64" else 1e-5)
                record("ctc_greedy_decoder", dt, f"{shape} merge={merge}", ok,
                       "; ".join(d for _, d in oks if d), f"neg_sum rel err {rel:.1e}")
            except Exception as e:
                record("ctc_greedy_decoder", dt, f"merge={merge}", False, f"{type(e).__name__}: {e}")
    try:
        lengths = rng.integers(0, 80, 40)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        data = rng.standard_normal((int(offsets[-1]), 129)).astype(np.float32)
        padded = np.zeros((80, 40, 129), np.float32)
        for b in range(40):
            padded[:lengths[b], b] = data[offsets[b]:offsets[b + 1]]
        (st,), neg = gpu.ctc_greedy_decoder_lod(cp.asarray(data), cp.asarray(offsets), True, 0)
        (wi, wv, wsh), wneg = ref.ctc_greedy_decoder(padded, lengths.astype(np.int32), True, 0)
        oks = [bitwise_equal(st.indices.get(), wi), bitwise_equal(st.values.get(), wv),
               bitwise_equal(st.dense_shape.get(), wsh)]
        rel = float(np.max(np.abs(neg.get() - wneg) / np.maximum(1, np.abs(wneg))))
        record("ctc_greedy_decoder_lod", "float32", "40 utts, V=129", all(o for o, _ in oks) and rel < 1e-5,
               "; ".join(d for _, d in oks if d), f"neg_sum rel err {rel:.1e}")
    except Exception as e:
        record("ctc_greedy_decoder_lod", "float32", "", False, f"{type(e).__name__}: {e}")

    # RNN-T (issue 5): the benchmark's model size, every batched algorithm against the
    # CPU's loop_labels; labels and timestamps exactly, scores within 1e-4 (float32).
    try:
        from readerlib.rnnt import RNNTModel, rnnt_greedy_decode
        model = RNNTModel.random(1024, 640, 640, 640, blank_bias=1.25, dtype=np.float32, rng=0)
        B, T = RNNT_SHAPE
        x = rng.standard_normal((B, T, 640)).astype(np.float32)
        lengths = rng.integers(T // 2, T + 1, B)
        want = rnnt_greedy_decode(model, x, lengths, algorithm="loop_labels")
        gmodel, gx, gl = model.to(cp), cp.asarray(x), cp.asarray(lengths)
        for alg, kw in (("loop_labels", {}), ("loop_labels", {"window": 1}), ("loop_frames", {})):
            got = rnnt_greedy_decode(gmodel, gx, gl, algorithm=alg, **kw)
            same = len(got) == len(want) and all(a.y_sequence.tolist() == b.y_sequence.tolist() and
                       a.timestamps.tolist() == b.timestamps.tolist() for a, b in zip(want, got))
            err = max(abs(a.score - b.score) for a, b in zip(want, got))
            name = alg + ("_w1" if kw else "")
            record(f"rnnt {name}", "float32", f"B={B} T={T} V=1025", same and err < 1e-4,
                   "" if same else "labels/timestamps differ",
                   f"{sum(len(h.y_sequence) for h in got)} labels, max score diff {err:.1e}",
                   equal="labels+timestamps equal")
    except Exception as e:
        record("rnnt", "float32", "", False, f"{type(e).__name__}: {e}")


# ---- 4. benchmarks ----------------------------------------------------------------

def torch_ctc_greedy(torch, logits, seq_len, blank, merge=True):
    """CTC greedy decoding written with framework ops (the issue's peer)."""
    T, B, _ = logits.shape
    m, a = logits.max(dim=2)                                   # first index on ties
    valid = torch.arange(T, device=logits.device)[:, None] < seq_len[None, :]
    neg = -torch.where(valid, m, torch.zeros_like(m)).sum(0).unsqueeze(1)
    prev = torch.cat([torch.full((1, B), -1, device=a.device, dtype=a.dtype), a[:-1]], 0)
    emit = valid & (a != blank)
    if merge:
        emit &= a != prev
    emit_bt = emit.T
    pos = torch.cumsum(emit_bt, 1) - 1
    b_idx, t_idx = torch.nonzero(emit_bt, as_tuple=True)      # host sync
    values = a.T[b_idx, t_idx]
    indices = torch.stack([b_idx, pos[b_idx, t_idx]], 1)
    longest = int(emit_bt.sum(1).max()) if B else 0            # host sync
    return indices, values, (B, longest), neg


class Bench:
    def __init__(self, cp, torch, copy_tbs):
        self.cp, self.torch, self.copy_tbs = cp, torch, copy_tbs

    def row(self, group, shape, name, ms, nbytes, peer_ms=None, peer=None, target=None, met=None,
            note=""):
        tbs = nbytes / (ms * 1e-3) / 1e12 if ms else float("nan")
        r = {"group": group, "shape": shape, "impl": name, "ms": round(ms, 4), "TB/s": round(tbs, 3),
             "copy_fraction": round(tbs / self.copy_tbs, 3) if self.copy_tbs else None,
             "peer": peer, "ratio_vs_peer": round(peer_ms / ms, 3) if peer_ms else None,
             "target": target, "met": met, "note": note}
        RESULTS["benchmarks"].append(r)
        ratio = f"{peer_ms / ms:6.2f}x {peer}" if peer_ms else ""
        tgt = f"  target {target}: {'met' if met else 'MISSED'}" if target else ""
        log(f"  {group:<9} {shape:<22} {name:<26} {ms:9.4f} ms {tbs:7.3f} TB/s "
            f"({100 * tbs / self.copy_tbs:5.1f}% of copy) {ratio}{tgt} {note}".rstrip())


def measure_copy(cp):
    n = COPY_BYTES
    src, dst = cp.empty(n, np.uint8), cp.empty(n, np.uint8)
    src.fill(1)
    ms, _ = time_call(cp, lambda i: dst.data.copy_from_device_async(src.data, n), budget_s=0.5)
    tbs = 2 * n / (ms * 1e-3) / 1e12
    src = dst = None  # free before the benchmarks
    log(f"\ncopy: device-to-device memcpy of {n >> 20} MiB: {ms:.3f} ms = {tbs:.2f} TB/s (read+write)")
    RESULTS["copy_TBps"] = round(tbs, 3)
    return tbs


def bench_forward(b, gpu, budget):
    cp, torch = b.cp, b.torch
    log("\nreindex forward, float32 (bytes = rows read + rows written + idx)")
    for n, m, inner in REINDEX_SHAPES:
        shape = f"({n},{m},{inner})"
        try:
            row_bytes = inner * 4
            nbytes = 2 * n * row_bytes + 8 * n
            k = rotations(cp, m * row_bytes + n * row_bytes, 24 << 30)
            xs = [cp.random.standard_normal((m, inner), dtype=np.float32) for _ in range(k)]
            idxs = [cp.random.randint(0, m, n, dtype=np.int64) for _ in range(k)]
            ys = [cp.empty((n, inner), np.float32) for _ in range(k)]
            ours, _ = time_call(cp, lambda i: gpu.batch_reindex(xs[i % k], idxs[i % k]), budget)
            kern, _ = time_call(cp, lambda i: gpu._launch_reindex_rows(cp, xs[i % k], idxs[i % k],
                                                                        ys[i % k]), budget)
            ok, d = bitwise_equal(gpu.batch_reindex(xs[0], idxs[0]).get(), cp.take(xs[0], idxs[0], 0).get())
            if not ok:
                fail(f"forward {shape} differs from cupy.take", d)
            take, _ = time_call(cp, lambda i: cp.take(xs[i % k], idxs[i % k], axis=0), budget)
            peer = None
            if torch is not None:
                txs = [torch.from_dlpack(x) for x in xs]
                tis = [torch.from_dlpack(i) for i in idxs]
                peer, _ = time_call(cp, lambda i: torch.index_select(txs[i % k], 0, tis[i % k]), budget)
            if peer is not None:
                b.row("forward", shape, "torch.index_select", peer, nbytes)
            b.row("forward", shape, "cupy.take", take, nbytes)
            met = (peer is None or ours <= peer) and (inner < 2048 or nbytes / (ours * 1e-3) / 1e12 >= 0.8 * b.copy_tbs)
            b.row("forward", shape, "ours (check + copy)", ours, nbytes, peer, "index_select",
                  ">=1x index_select" + (", >=80% copy" if inner >= 2048 else ""), met)
            b.row("forward", shape, "ours kernel only", kern, nbytes, peer, "index_select")
            xs = idxs = ys = None
        except Exception as e:
            fail(f"forward benchmark {shape}", f"{type(e).__name__}: {e}")
            traceback.print_exc()
        cp.get_default_memory_pool().free_all_blocks()


def bench_backward(b, gpu, budget):
    cp, torch = b.cp, b.torch
    log("\nreindex backward, float32 (bytes = dy read + dx written + idx)")
    for n, m, inner in REINDEX_SHAPES:
        shape = f"({n},{m},{inner})"
        try:
            row_bytes = inner * 4
            nbytes = n * row_bytes + m * row_bytes + 8 * n
            k = rotations(cp, nbytes, 24 << 30)
            dys = [cp.random.standard_normal((n, inner), dtype=np.float32) for _ in range(k)]
            idxs = [cp.random.randint(0, m, n, dtype=np.int64) for _ in range(k)]
            ours, _ = time_call(cp, lambda i: gpu.batch_reindex_grad(dys[i % k], idxs[i % k], m), budget)
            first = gpu.batch_reindex_grad(dys[0], idxs[0], m)
            again = gpu.batch_reindex_grad(dys[0], idxs[0], m)
            ok, d = bitwise_equal(first.get(), again.get())
            if not ok:
                fail(f"backward {shape} not deterministic", d)
            atomic = det = None
            det_note = ""
            if torch is not None:
                tdy = [torch.from_dlpack(x) for x in dys]
                tix = [torch.from_dlpack(i) for i in idxs]

                def index_add(i):
                    return torch.zeros((m, inner), device="cuda", dtype=torch.float32).index_add_(
                        0, tix[i % k], tdy[i % k])
                atomic, _ = time_call(cp, index_add, budget)
                ref_dx = index_add(0)
                diff = float((torch.from_dlpack(first) - ref_dx).abs().max())
                torch.use_deterministic_algorithms(True)
                try:
                    det, _ = time_call(cp, index_add, budget)
                    det_note = "index_add_ (deterministic mode)"
                except RuntimeError as e:
                    det_note = f"index_put_(accumulate) (index_add_ refused: {str(e)[:60]})"

                    def index_put(i):
                        return torch.zeros((m, inner), device="cuda", dtype=torch.float32).index_put_(
                            (tix[i % k],), tdy[i % k], accumulate=True)
                    det, _ = time_call(cp, index_put, budget)
                finally:
                    torch.use_deterministic_algorithms(False)
                b.row("backward", shape, "torch index_add_ atomic", atomic, nbytes,
                      note=f"max |ours - torch| = {diff:.2e}")
                b.row("backward", shape, "torch deterministic", det, nbytes, note=det_note)
            met = None if atomic is None else (ours <= atomic / 0.8 and ours <= det)
            b.row("backward", shape, "ours (deterministic)", ours, nbytes, atomic, "index_add_",
                  ">=0.8x atomic, >=1x deterministic", met,
                  note=f"{det / ours:.2f}x deterministic" if det else "")
            if n <= gpu._SMALL_SORT_MAX:   # the same with the library sort, for comparison
                os.environ["READERLIB_GPU_SMALL_SORT"] = "0"
                try:
                    lib, _ = time_call(cp, lambda i: gpu.batch_reindex_grad(dys[i % k], idxs[i % k], m),
                                       budget)
                finally:
                    del os.environ["READERLIB_GPU_SMALL_SORT"]
                b.row("backward", shape, "ours, keys by cupy.sort", lib, nbytes, atomic, "index_add_")
            dys = idxs = first = again = None
        except Exception as e:
            fail(f"backward benchmark {shape}", f"{type(e).__name__}: {e}")
            traceback.print_exc()
        cp.get_default_memory_pool().free_all_blocks()


def bench_ctc(b, gpu, budget):
    cp, torch = b.cp, b.torch
    log("\nCTC greedy decoding, float32, full lengths (bytes = logits read)")
    shapes = CTC_SHAPES
    for T, B, V in shapes:
        shape = f"({T},{B},{V})"
        try:
            nbytes = T * B * V * 4
            k = rotations(cp, nbytes, 24 << 30)
            xs = [cp.random.standard_normal((T, B, V), dtype=np.float32) for _ in range(k)]
            lens = cp.full(B, T, dtype=np.int32)
            blank = V - 1
            ours, _ = time_call(cp, lambda i: gpu.ctc_greedy_decoder(xs[i % k], lens, True, blank), budget)
            peer = None
            if torch is not None:
                txs = [torch.from_dlpack(x) for x in xs]
                tl = torch.from_dlpack(lens)
                peer, _ = time_call(cp, lambda i: torch_ctc_greedy(torch, txs[i % k], tl, blank), budget)
                (st,), _ = gpu.ctc_greedy_decoder(xs[0], lens, True, blank)
                ti, tv, tshape, _ = torch_ctc_greedy(torch, txs[0], tl, blank)
                same = (np.array_equal(st.indices.get(), ti.cpu().numpy())
                        and np.array_equal(st.values.get(), tv.cpu().numpy())
                        and st.dense_shape.get().tolist() == list(tshape))
                if not same:
                    fail(f"ctc {shape}: ours differs from the torch-ops decode")
                b.row("ctc", shape, "torch ops (max/mask/nonzero)", peer, nbytes)
            largest = (T, B, V) == shapes[-1]
            tbs = nbytes / (ours * 1e-3) / 1e12
            met = (tbs >= 3.0) if largest else (None if peer is None else peer / ours >= 5)
            b.row("ctc", shape, "ours", ours, nbytes, peer, "torch ops",
                  ">=3 TB/s" if largest else ">=5x torch ops", met)
            xs = None
        except Exception as e:
            fail(f"ctc benchmark {shape}", f"{type(e).__name__}: {e}")
            traceback.print_exc()
        cp.get_default_memory_pool().free_all_blocks()


# ---- compute-sanitizer ------------------------------------------------------------

def sanitize(timeout_each=150):
    """Run --smoke under compute-sanitizer memcheck and racecheck (out-of-bounds, races)."""
    import shutil
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        for guess in glob.glob("/usr/local/cuda*/bin/compute-sanitizer") + \
                glob.glob("/opt/nvidia/*/compute-sanitizer"):
            tool = guess
            break
    if tool is None:
        fail("sanitize", "(compute-sanitizer not found)")
        return
    for check in ("memcheck", "racecheck"):
        log(f"\nsanitize: {check} on --smoke (timeout {timeout_each} s)")
        t = time.monotonic()
        try:
            r = subprocess.run([tool, "--tool", check, "--error-exitcode", "99",
                                "--print-limit", "20", sys.executable, os.path.abspath(__file__),
                                "--smoke"], cwd=ROOT, capture_output=True, text=True,
                               timeout=timeout_each)
        except subprocess.TimeoutExpired:
            fail(f"sanitize {check}", f"(timed out after {timeout_each} s)")
            continue
        out = (r.stdout + r.stderr).strip().splitlines()
        errors = [line for line in out if "=========" in line and "ERROR SUMMARY" not in line]
        summary = [line for line in out if "ERROR SUMMARY" in line]
        log("\n".join(errors[:40] + summary))
        RESULTS.setdefault("sanitize", {})[check] = {"returncode": r.returncode,
                                                    "summary": summary[-1] if summary else "",
                                                    "seconds": round(time.monotonic() - t, 1)}
        if r.returncode:
            fail(f"sanitize {check}", f"(exit {r.returncode})")


# ---- main --------------------------------------------------------------------------

def write_outputs(out):
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    RESULTS["failures"] = FAILURES
    RESULTS["seconds"] = round(elapsed(), 1)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(f"# gpu_check ({RESULTS.get('device', '?')})\n\n")
        if RESULTS["benchmarks"]:
            f.write(f"copy: {RESULTS.get('copy_TBps')} TB/s\n\n| group | shape | impl | ms | TB/s | "
                    "of copy | vs peer | target | met |\n|---|---|---|---|---|---|---|---|---|\n")
        else:
            f.write("no timings in this run\n")
        for r in RESULTS["benchmarks"]:
            f.write(f"| {r['group']} | {r['shape']} | {r['impl']} | {r['ms']} | {r['TB/s']} | "
                    f"{r['copy_fraction']} | {r['ratio_vs_peer'] or ''} {r['peer'] or ''} | "
                    f"{r['target'] or ''} | {'' if r['met'] is None else r['met']} |\n")
        f.write("\n| kernel | dtype | shape | bitwise equal | detail |\n|---|---|---|---|---|\n")
        for r in RESULTS["equality"]:
            f.write(f"| {r['kernel']} | {r['dtype']} | {r['shape']} | {r['equal']} | "
                    f"{r['detail']} {r['extra']} |\n")


def emulate(args):
    """--emulate: the equality table, with CuPy replaced by tests/support/fake_cupy.py whose
    kernel launches run the real .cu code compiled for the CPU (tests/support/cuda_emu.py)."""
    import pytest
    import fake_cupy
    log("emulate: no GPU used -- CUDA kernels compiled with g++ and run by tests/support/cuda_emu")
    RESULTS["device"] = "CPU emulator (tests/support/cuda_emu), not a GPU"
    with pytest.MonkeyPatch.context() as mp:
        cp = fake_cupy.install(mp, run_cuda=True)
        _, gpu, ref, public, _ = import_stack()
        try:
            equality_table(cp, gpu, ref, public)
        except Exception as e:
            fail("equality table", f"{type(e).__name__}: {e}")
            traceback.print_exc()
    log(f"\nemulate ({elapsed():.0f} s): {len(FAILURES)} failure(s)")
    write_outputs(args.out)
    return 1 if FAILURES else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json/.md")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--no-build", action="store_true",
                    help="do not build the Cython extensions (the CPU reference is then NumPy)")
    ap.add_argument("--budget", type=float, default=0.6, help="seconds of timing per measurement")
    ap.add_argument("--smoke", action="store_true", help="equality table only")
    ap.add_argument("--sanitize", action="store_true",
                    help="run --smoke under compute-sanitizer memcheck and racecheck, nothing else")
    ap.add_argument("--emulate", action="store_true",
                    help="no GPU: the equality table on the CPU emulator of the kernels")
    args = ap.parse_args()
    if args.emulate:
        return emulate(args)

    log(f"readerlib gpu_check: python {platform.python_version()}, numpy {np.__version__}, cwd {ROOT}")
    if args.sanitize:
        sanitize()
        log(f"\nsummary ({elapsed():.0f} s): {len(FAILURES)} failure(s)")
        write_outputs(args.out)
        return 1 if FAILURES else 0
    try:
        if not args.no_build:
            build()
    except Exception as e:
        fail("build", f"{type(e).__name__}: {e}")
    try:
        cp, gpu, ref, public, torch = import_stack()
        dev = cp.cuda.runtime.getDevice()
        props = cp.cuda.runtime.getDeviceProperties(dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        RESULTS["device"] = name
        log(f"device: {name}, {props['multiProcessorCount']} SMs, L2 {props.get('l2CacheSize', 0) >> 20} MiB, "
            f"cupy {cp.__version__}, torch {getattr(torch, '__version__', 'missing')}, "
            f"CPU reference: {'readerlib.kernels' if public else 'NumPy (kernels not built)'}")
    except Exception as e:
        fail("import", f"{type(e).__name__}: {e}")
        traceback.print_exc()
        write_outputs(args.out)
        return 1

    if not (args.skip_tests or args.smoke):
        run_gpu_tests(timeout=max(60.0, 170.0 - elapsed()))
    try:
        equality_table(cp, gpu, ref, public)
    except Exception as e:
        fail("equality table", f"{type(e).__name__}: {e}")
        traceback.print_exc()
    if args.smoke:
        log(f"\nsmoke ({elapsed():.0f} s): {len(FAILURES)} failure(s)")
        return 1 if FAILURES else 0

    try:
        copy_tbs = measure_copy(cp)
    except Exception as e:
        fail("copy bandwidth", f"{type(e).__name__}: {e}")
        copy_tbs = 4.3
    b = Bench(cp, torch, copy_tbs)
    if torch is None:
        RESULTS["notes"].append("PyTorch missing: no torch peers")
    for section in (bench_forward, bench_backward, bench_ctc):
        if elapsed() > WALL_BUDGET_S:
            fail(f"{section.__name__}", f"(skipped: over the {WALL_BUDGET_S} s budget)")
            continue
        section(b, gpu, args.budget)

    log(f"\nsummary ({elapsed():.0f} s): {len(FAILURES)} failure(s)")
    missed = [f"{r['group']} {r['shape']}" for r in RESULTS["benchmarks"] if r["met"] is False]
    log(f"  targets missed: {', '.join(missed) if missed else 'none'}")
    for f in FAILURES:
        log(f"  FAIL {f}")
    write_outputs(args.out)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
