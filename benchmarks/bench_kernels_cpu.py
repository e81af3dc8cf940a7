"""Side-by-side CPU benchmarks of readerlib's kernels against their peers.

    python benchmarks/bench_kernels_cpu.py [--rounds 7] [--only ctc|fwd|bwd] [--cpu-time] [--out FILE]

Every case runs all its contenders in interleaved rounds (A B C A B C ...), so
a burst of load from another process hits them all alike; the table reports
the best round of each (the least disturbed), the ratio to readerlib, and the
bandwidth: logits read for CTC; bytes read + written for reindex, to set
against the machine's copy bandwidth measured in the same run (np.copyto of
256 MiB: read + write).  Results are checked for equality before timing.

``--cpu-time`` runs every contender on one thread (readerlib num_threads=1,
torch.set_num_threads(1), TF intra/inter-op pools of 1) and reports CPU
seconds of the whole process per call instead of wall time: a per-core
efficiency figure that time slices lost to other processes do not distort
(memory-bandwidth contention still does).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from readerlib.kernels import (_ctc, batch_reindex, batch_reindex_grad,  # noqa: E402
                               ctc_greedy_decoder)
from readerlib.kernels.reference import ctc_greedy_decoder_vectorized  # noqa: E402
from readerlib import _parallel as rl_parallel  # noqa: E402

CTC_SHAPES = [(500, 32, 1025), (200, 128, 129), (1000, 16, 5001)]
REINDEX_SHAPES = [(4096, 8192, 2048), (65536, 65536, 64), (256, 512, 150528)]


CLOCK = time.perf_counter
ONE_THREAD = False
NT = None          # readerlib's num_threads: its default, or 1 with --cpu-time


def interleaved(fns, rounds):
    """Best and median seconds per contender, the contenders alternating each round."""
    if ONE_THREAD:
        fns = {k: f for k, f in fns.items() if k != "readerlib 1 thread"}
    times = {k: [] for k in fns}
    for f in fns.values():   # warm up: page faults, lazy imports, thread pools
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = CLOCK()
            f()
            times[k].append(CLOCK() - t0)
    return {k: (min(v), float(np.median(v))) for k, v in times.items()}


def copy_bandwidth(rounds):
    a = np.ones(64 << 20, np.float32)
    b = np.empty_like(a)
    t = interleaved({"copy": lambda: np.copyto(b, a)}, rounds)["copy"][0]
    return 2 * a.nbytes / t / 1e9


def try_import(name):
    try:
        return __import__(name)
    except Exception as e:   # not installed, or broken
        print(f"# {name} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def table(title, head, rows):
    out = [f"#### {title}", "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def bench_ctc(rounds, tf):
    rows = []
    rng = np.random.default_rng(0)
    for T, B, V in CTC_SHAPES:
        x = rng.standard_normal((T, B, V), dtype=np.float32)
        lengths = np.full(B, T, np.int32)
        lengths[::3] = T * 3 // 4             # some padding, as in real batches
        gb = float(np.sum(lengths)) * V * 4 / 1e9
        fns = {
            "readerlib": lambda: ctc_greedy_decoder(x, lengths, num_threads=NT),
            "readerlib 1 thread": lambda: ctc_greedy_decoder(x, lengths, num_threads=1),
            "numpy (vectorised)": lambda: ctc_greedy_decoder_vectorized(x, lengths),
        }
        (mine,), neg = ctc_greedy_decoder(x, lengths)
        ref = ctc_greedy_decoder_vectorized(x, lengths)
        assert np.array_equal(mine.values, ref[1]) and np.array_equal(neg, ref[3])
        if tf is not None:
            xt, lt = tf.constant(x), tf.constant(lengths)
            (sp,), tneg = tf.nn.ctc_greedy_decoder(xt, lt)
            assert np.array_equal(sp.values.numpy(), mine.values)
            assert np.array_equal(tneg.numpy(), neg)
            fns["tf.nn.ctc_greedy_decoder"] = lambda: tf.nn.ctc_greedy_decoder(xt, lt)
        res = interleaved(fns, rounds)
        base = res["readerlib"][0]
        for k, (best, med) in res.items():
            rows.append([f"({T}, {B}, {V})", k, f"{best * 1e3:.2f}", f"{med * 1e3:.2f}",
                         f"{gb / best:.1f}", f"{best / base:.2f}x"])
    return table("CTC greedy decoder, float32, time-major [T, B, V] (lengths: 2/3 full, 1/3 at 3T/4)",
                 ["(T, B, V)", "contender", "best ms", "median ms", "GB/s of logits read",
                  "time / readerlib"], rows)


def bench_reindex_fwd(rounds, torch):
    rows = []
    rng = np.random.default_rng(1)
    for N, M, inner in REINDEX_SHAPES:
        x = rng.standard_normal((M, inner), dtype=np.float32)
        idx = rng.integers(0, M, N).astype(np.int64)
        gb = 2 * N * inner * 4 / 1e9
        buf = np.empty((N, inner), np.float32)
        fns = {
            "readerlib": lambda: batch_reindex(x, idx, num_threads=NT),
            "readerlib 1 thread": lambda: batch_reindex(x, idx, num_threads=1),
            "np.take": lambda: np.take(x, idx, axis=0),
        }
        assert np.array_equal(batch_reindex(x, idx), np.take(x, idx, axis=0))
        if torch is not None:
            xt, it = torch.from_numpy(x), torch.from_numpy(idx)
            tbuf = torch.from_numpy(buf)
            assert np.array_equal(torch.index_select(xt, 0, it).numpy(), x[idx])
            fns["torch.index_select"] = lambda: torch.index_select(xt, 0, it)
        fns["readerlib out="] = lambda: batch_reindex(x, idx, out=buf, num_threads=NT)
        fns["np.take out="] = lambda: np.take(x, idx, axis=0, out=buf)
        if torch is not None:
            fns["torch.index_select out="] = lambda: torch.index_select(xt, 0, it, out=tbuf)
        res = interleaved(fns, rounds)
        for k, (best, med) in res.items():
            base = res["readerlib out=" if "out=" in k else "readerlib"][0]
            rows.append([f"({N}, {M}, {inner})", k, f"{best * 1e3:.2f}", f"{med * 1e3:.2f}",
                         f"{gb / best:.1f}", f"{best / base:.2f}x"])
    return table("batch_reindex forward, float32: y[N, inner] = x[M, inner][idx] "
                 "(fresh output per call, then `out=` a reused buffer; ratios within each group)",
                 ["(N, M, inner)", "contender", "best ms", "median ms",
                  "GB/s (read + write)", "time / readerlib"], rows)


def bench_reindex_bwd(rounds, torch):
    rows = []
    rng = np.random.default_rng(2)
    for N, M, inner in REINDEX_SHAPES:
        dy = rng.standard_normal((N, inner), dtype=np.float32)
        idx = rng.integers(0, M, N).astype(np.int64)
        gb = (N + M) * inner * 4 / 1e9          # dy read once, dx written once

        def add_at():
            dx = np.zeros((M, inner), np.float32)
            np.add.at(dx, idx, dy)
            return dx

        fns = {
            "readerlib": lambda: batch_reindex_grad(dy, idx, M, num_threads=NT),
            "readerlib 1 thread": lambda: batch_reindex_grad(dy, idx, M, num_threads=1),
            "np.add.at": add_at,
        }
        mine = batch_reindex_grad(dy, idx, M)
        assert np.array_equal(mine, add_at())
        if torch is not None:
            dyt, it = torch.from_numpy(dy), torch.from_numpy(idx)

            def index_add():
                return torch.zeros((M, inner), dtype=torch.float32).index_add_(0, it, dyt)

            np.testing.assert_allclose(index_add().numpy(), mine, rtol=1e-5, atol=1e-5)
            fns["torch.index_add_"] = index_add
        buf = np.empty((M, inner), np.float32)

        def add_at_out():
            buf.fill(0)
            np.add.at(buf, idx, dy)

        fns["readerlib out="] = lambda: batch_reindex_grad(dy, idx, M, out=buf, num_threads=NT)
        fns["np.add.at out= (zeroed)"] = add_at_out
        if torch is not None:
            tbuf = torch.from_numpy(buf)
            fns["torch.index_add_ out= (zeroed)"] = lambda: tbuf.zero_().index_add_(0, it, dyt)
        res = interleaved(fns, rounds)
        for k, (best, med) in res.items():
            base = res["readerlib out=" if "out=" in k else "readerlib"][0]
            rows.append([f"({N}, {M}, {inner})", k, f"{best * 1e3:.2f}", f"{med * 1e3:.2f}",
                         f"{gb / best:.1f}", f"{best / base:.2f}x"])
    return table("batch_reindex_grad (deterministic), float32: dx[M, inner] from dy[N, inner] "
                 "(fresh output per call, then `out=` a reused buffer; the peers must zero it, "
                 "readerlib overwrites every element)",
                 ["(N, M, inner)", "contender", "best ms", "median ms",
                  "GB/s (dy read + dx written)", "time / readerlib"], rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", choices=["ctc", "fwd", "bwd"], action="append")
    p.add_argument("--cpu-time", action="store_true",
                   help="one thread everywhere; report process CPU seconds per call")
    p.add_argument("--out", help="also write the markdown here")
    args = p.parse_args(argv)
    global CLOCK, ONE_THREAD, NT
    only = set(args.only or ["ctc", "fwd", "bwd"])
    tf = try_import("tensorflow") if "ctc" in only else None
    torch = try_import("torch") if only & {"fwd", "bwd"} else None
    if args.cpu_time:
        CLOCK, ONE_THREAD, NT = time.process_time, True, 1
        if torch is not None:
            torch.set_num_threads(1)
        if tf is not None:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
    parts = []
    load0 = os.getloadavg()
    bw = copy_bandwidth(args.rounds)
    head = [f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"readerlib threads {rl_parallel.get_num_threads() if rl_parallel.threads_enabled() else 'off'}, "
            f"CTC row argmax: {_ctc.isa()}",
            f"- numpy {np.__version__}" + (f", tensorflow {tf.__version__}" if tf else "")
            + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ""),
            f"- copy bandwidth in this run (np.copyto 256 MiB, read + write): {bw:.1f} GB/s",
            f"- load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
            "- timing: " + ("process CPU seconds per call, every contender on ONE thread "
                            "(ms columns are CPU ms; GB/s is per CPU-second)"
                            if args.cpu_time else "wall clock, default threads")]
    if "ctc" in only:
        parts.append(bench_ctc(args.rounds, tf))
    if "fwd" in only:
        parts.append(bench_reindex_fwd(args.rounds, torch))
    if "bwd" in only:
        parts.append(bench_reindex_bwd(args.rounds, torch))
    load1 = os.getloadavg()
    head.append(f"- load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    text = "\n".join(head) + "\n\n" + "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
