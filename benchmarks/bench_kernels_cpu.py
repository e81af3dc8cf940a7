"""Side-by-side CPU benchmarks of readerlib's kernels against their peers.

    python benchmarks/bench_kernels_cpu.py [--repeats 7] [--only ctc|fwd|bwd] [--cpu-time]
                                           [--sweep] [--quick] [--peers tf,torch] [--out FILE]

Every case runs all its contenders in interleaved rounds (A B C A B C ...), so
a burst of load from another process hits them all alike; the table reports
the best round of each (the least disturbed), the ratio to readerlib, and the
bandwidth: logits read for CTC; bytes read + written for reindex, to set
against the machine's copy bandwidth measured in the same run (np.copyto of
256 MiB: read + write) and its read bandwidth on 1 and 2 threads (the faster
of np.sum / np.max over the CTC logits of the (1000, 16, 5001) case, one
half per thread on 2 threads).  Results are checked for equality before
timing.  Each contender's timed call includes freeing its own output, an
untimed pause follows every torch contender, so the next one does not share
the cores with torch's spinning OpenMP workers (TORCH_SETTLE_S), and every
round runs the contenders in a new (seeded) random order, so none always
follows the same neighbour.
The small CTC shape (50, 1, 29) is a single streaming utterance; its
peers are the loops a user writes (NumPy per utterance, torch argmax +
unique_consecutive) and tf.nn.ctc_greedy_decoder.

``--sweep`` adds the measurements behind three settings: CTC on 1 vs 2
threads as the logits grow (``readerlib._parallel.MIN_BYTES_PER_THREAD``),
the reindex forward with and without streaming stores as the output grows
(``readerlib.kernels._reindex.STREAM_MIN_BYTES``), and its prefetch distance
(``readerlib.kernels._reindex.PREFETCH_ROWS``).

The forward table ends each shape with the machine's bound for the same
bytes, timed in the same rounds (np.copyto of ``len(idx)`` contiguous rows
into the reused buffer), and the target ratio: the faster of np.take /
torch.index_select over readerlib, fresh outputs, best and median (each the
lower of the two peers' figures).

``--cpu-time`` runs every contender on one thread (readerlib num_threads=1,
torch.set_num_threads(1), TF intra/inter-op pools of 1) and reports CPU
seconds of the whole process per call instead of wall time: a per-core
efficiency figure that time slices lost to other processes do not distort
(memory-bandwidth contention still does).
"""
from __future__ import annotations

import os
import platform
import time

import harness
import numpy as np

from readerlib.kernels import (_ctc, batch_reindex, batch_reindex_grad,
                               ctc_greedy_decoder)
from readerlib.kernels import _reindex
from readerlib.kernels.reference import (ctc_greedy_decoder_loop,
                                         ctc_greedy_decoder_vectorized)
from readerlib import _parallel as rl_parallel

CTC_SHAPES = [(50, 1, 29), (500, 32, 1025), (200, 128, 129), (1000, 16, 5001)]
#: The shape whose 2-thread bandwidth is compared with the machine's read bandwidth.
CTC_BW_SHAPE = (1000, 16, 5001)
REINDEX_SHAPES = [(4096, 8192, 2048), (65536, 65536, 64), (256, 512, 150528)]
#: The forward table's bound: the same bytes copied contiguously (np.copyto).
BOUND = "(bound: np.copyto of the same bytes, contiguous)"


CLOCK = time.perf_counter
ONE_THREAD = False
NT = None          # readerlib's num_threads: its default, or 1 with --cpu-time


#: After a torch call, the contender timed next waits this long, untimed: torch's
#: OpenMP workers spin-wait for several ms after a parallel region (libgomp's
#: default GOMP_SPINCOUNT; measured 4-9 ms of CPU burnt after one
#: torch.index_select on 2 threads), and whoever ran next shared the cores with
#: them (2026-12-01: the contender listed after torch.index_select was 1.5-2.5x
#: slower at the median than the same call elsewhere in the rotation).
TORCH_SETTLE_S = 0.015


def _own_result(f):
    """``f`` that drops its own result inside the timed call, so each contender
    pays for freeing its output (harness.interleaved keeps the last result
    until the next contender's call returns, which charged the free -- a
    munmap of 16-150 MB for NumPy and torch outputs -- to the next in line)."""
    def call():
        r = f()
        return r if isinstance(r, harness.Sample) else None
    return call


def interleaved(fns, rounds, number=1):
    """{contender: (best, median) seconds per call}, the contenders interleaved
    (harness.interleaved on this run's clock); ``number`` calls per round (tiny cases).

    Each contender frees its own output.  With ``number == 1``, every torch
    contender is followed by an untimed pause of TORCH_SETTLE_S (see there),
    and every round runs the contenders in a new random order (seeded): in a
    fixed rotation each contender always follows the same one and inherits
    its after-effects (torch's spinning workers, a core gone idle in the pause).
    """
    if ONE_THREAD:
        fns = {k: f for k, f in fns.items() if k != "readerlib 1 thread"}
    timed = {k: _own_result(f) for k, f in fns.items()}
    if number != 1 or len(timed) < 2:
        st = harness.interleaved(timed, rounds, number=number, clock=CLOCK)
        return {k: (st[k].best, st[k].median) for k in fns}
    settle = (lambda: time.sleep(TORCH_SETTLE_S)) if not ONE_THREAD else None
    for f in timed.values():                     # warm up (page cache, lazy imports, pools)
        f()
    rng = np.random.default_rng(len(timed) * 1000 + rounds)
    names = list(timed)
    seconds = {k: [] for k in names}
    for _ in range(max(1, rounds)):
        order = {}
        for i in rng.permutation(len(names)):
            k = names[i]
            order[k] = timed[k]
            if settle is not None and str(k).startswith("torch"):
                order[f"(settle after {k})"] = settle
        st = harness.interleaved(order, 1, warmup=0, clock=CLOCK)
        for k in names:
            seconds[k] += st[k].seconds
    st = {k: harness.Stats(k, v, 1) for k, v in seconds.items()}
    return {k: (st[k].best, st[k].median) for k in fns}


def table(title, head, rows):
    out = [f"#### {title}", "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def ms(seconds):
    """Milliseconds with 3 significant digits at least (tiny cases are microseconds)."""
    v = seconds * 1e3
    return f"{v:.2f}" if v >= 1 else f"{v:.4f}" if v >= 0.01 else f"{v:.5f}"


def torch_greedy(torch, xt, lengths, blank):
    """The decode a torch user writes: argmax, then per utterance unique_consecutive
    and drop blanks (no neg_sum_logits, no sparse packing)."""
    a = xt.argmax(dim=2)
    out = []
    for b in range(a.shape[1]):
        u = torch.unique_consecutive(a[:int(lengths[b]), b])
        out.append(u[u != blank])
    return out


def bench_ctc(rounds, tf, torch):
    rows = []
    rng = np.random.default_rng(0)
    for T, B, V in CTC_SHAPES:
        x = rng.standard_normal((T, B, V), dtype=np.float32)
        lengths = np.full(B, T, np.int32)
        lengths[::3] = T * 3 // 4             # some padding, as in real batches
        if B == 1:
            lengths[:] = T                    # one streaming utterance, whole
        xb = np.ascontiguousarray(x.transpose(1, 0, 2))
        gb = float(np.sum(lengths)) * V * 4 / 1e9
        fns = {
            "readerlib": lambda: ctc_greedy_decoder(x, lengths, num_threads=NT),
            "readerlib 1 thread": lambda: ctc_greedy_decoder(x, lengths, num_threads=1),
            "readerlib [B, T, V] (time_major=False)":
                lambda: ctc_greedy_decoder(xb, lengths, time_major=False, num_threads=NT),
            "numpy per-utterance loop": lambda: ctc_greedy_decoder_loop(x, lengths),
            "numpy (vectorised)": lambda: ctc_greedy_decoder_vectorized(x, lengths),
        }
        (mine,), neg = ctc_greedy_decoder(x, lengths)
        ref = ctc_greedy_decoder_vectorized(x, lengths)
        assert np.array_equal(mine.values, ref[1]) and np.array_equal(neg, ref[3])
        assert np.array_equal(np.concatenate(ctc_greedy_decoder_loop(x, lengths)), mine.values)
        (mb,), negb = ctc_greedy_decoder(xb, lengths, time_major=False)
        assert np.array_equal(mb.values, mine.values) and np.array_equal(negb, neg)
        if torch is not None:
            xt = torch.from_numpy(x)
            got = torch_greedy(torch, xt, lengths, V - 1)
            assert np.array_equal(torch.cat(got).numpy(), mine.values)
            fns["torch argmax + unique_consecutive"] = lambda: torch_greedy(torch, xt, lengths, V - 1)
        if tf is not None:
            xt_, lt = tf.constant(x), tf.constant(lengths)
            (sp,), tneg = tf.nn.ctc_greedy_decoder(xt_, lt)
            assert np.array_equal(sp.values.numpy(), mine.values)
            assert np.array_equal(tneg.numpy(), neg)
            fns["tf.nn.ctc_greedy_decoder"] = lambda: tf.nn.ctc_greedy_decoder(xt_, lt)
        reads = {}
        if (T, B, V) == CTC_BW_SHAPE:
            # the machine's read bandwidth over the same logits, in the same rounds
            from concurrent.futures import ThreadPoolExecutor
            pool = ThreadPoolExecutor(2)
            flat = x.reshape(-1)
            halves = [flat[:flat.shape[0] // 2], flat[flat.shape[0] // 2:]]
            reads = {"(read bandwidth: np.max, 1 thread)": lambda: flat.max(),
                     "(read bandwidth: np.max, 2 threads)": lambda: list(pool.map(np.max, halves))}
            fns.update(reads)
        res = interleaved(fns, rounds * 4, number=200) if gb < 1e-3 else interleaved(fns, rounds)
        base = res["readerlib"][0]
        peers = [k for k in res if not k.startswith(("readerlib", "("))]
        fastest = min(peers, key=lambda k: res[k][0])
        read2 = x.nbytes / 1e9 / res["(read bandwidth: np.max, 2 threads)"][0] if reads else None
        for k, (best, med) in res.items():
            kb = x.nbytes / 1e9 if k in reads else gb
            bw = f"{kb / best:.1f}"
            if read2 and k == "readerlib":
                bw += f" ({gb / best / read2:.0%} of the 2-thread read)"
            rows.append([f"({T}, {B}, {V})", k, ms(best), ms(med), bw,
                         "" if k in reads else
                         f"{best / base:.2f}x" + (" (fastest peer)" if k == fastest else "")])
    return table("CTC greedy decoder, float32, time-major [T, B, V] (lengths: 2/3 full, 1/3 at 3T/4; "
                 "B = 1: full); peers: TF, and the loops a user writes (no neg_sum / sparse packing)",
                 ["(T, B, V)", "contender", "best ms", "median ms", "GB/s of logits read",
                  "time / readerlib"], rows)


def sweep(rounds):
    """The measurements behind the CTC split threshold and the streaming-store threshold."""
    rows = []
    rng = np.random.default_rng(4)
    for T, B, V in [(4, 8, 1025), (16, 8, 1025), (64, 8, 1025), (128, 8, 1025),
                    (256, 8, 1025), (512, 8, 1025), (1024, 8, 1025)]:
        x = rng.standard_normal((T, B, V), dtype=np.float32)
        lengths = np.full(B, T, np.int32)
        res = interleaved({t: (lambda t=t: ctc_greedy_decoder(x, lengths, num_threads=t))
                           for t in (1, 2)}, rounds * 3)
        rows.append([f"CTC ({T}, {B}, {V})", f"{x.nbytes / 2**20:.2f}",
                     f"{res[1][0] * 1e3:.3f}", f"{res[2][0] * 1e3:.3f}",
                     f"{res[1][0] / res[2][0]:.2f}x"])
    out = table("Sweep: CTC on 1 vs 2 threads (the pool splits from 2 x "
                f"{rl_parallel.MIN_BYTES_PER_THREAD >> 20} MiB of logits)",
                ["case", "MiB", "1 thread ms", "2 threads ms", "2-thread speed-up"], rows)
    rows = []
    for inner in (64, 2048):
        for mib in (1, 2, 4, 8, 16, 32):
            n = (mib << 20) // (inner * 4)
            x = rng.standard_normal((n, inner), dtype=np.float32)
            idx = rng.integers(0, n, n).astype(np.int64)
            buf = np.empty((n, inner), np.float32)
            res = {}
            for name, th in (("streaming", 0), ("cached", 1 << 62)):
                old = _reindex._set_stream_min_bytes(th)
                try:
                    res[name] = interleaved({name: lambda: batch_reindex(x, idx, out=buf,
                                                                          num_threads=1)},
                                            rounds * 3)[name][0]
                finally:
                    _reindex._set_stream_min_bytes(old)
            rows.append([f"{inner * 4} B rows", f"{mib}", f"{res['cached'] * 1e3:.3f}",
                         f"{res['streaming'] * 1e3:.3f}",
                         f"{res['cached'] / res['streaming']:.2f}x"])
    out += "\n" + table("Sweep: reindex forward, one thread, `out=` reused, stores cached vs "
                        f"streaming (streaming from {_reindex.STREAM_MIN_BYTES >> 20} MiB of output)",
                        ["rows", "output MiB", "cached ms", "streaming ms", "streaming speed-up"],
                        rows)
    rows = []
    dists = (0, 4, 8, 16, 32, 64)
    for inner, mib in ((64, 2), (64, 16), (2048, 16)):
        n = (mib << 20) // (inner * 4)
        x = rng.standard_normal((n, inner), dtype=np.float32)
        idx = rng.integers(0, n, n).astype(np.int64)
        buf = np.empty((n, inner), np.float32)

        def at(d):
            def run():
                old = _reindex._set_prefetch_rows(d)
                try:
                    batch_reindex(x, idx, out=buf, num_threads=1)
                finally:
                    _reindex._set_prefetch_rows(old)
            return run

        res = interleaved({d: at(d) for d in dists}, rounds * 3)
        kind = "streaming" if n * inner * 4 >= _reindex.STREAM_MIN_BYTES else "cached"
        rows.append([f"{inner * 4} B rows", f"{mib} ({kind})"]
                    + [f"{res[d][0] * 1e3:.3f}" for d in dists])
    out += "\n" + table("Sweep: reindex forward, one thread, `out=` reused, best ms by prefetch "
                        f"distance in rows (default {_reindex.PREFETCH_ROWS})",
                        ["rows", "output MiB"] + [f"{d} ahead" for d in dists], rows)
    return out


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
        # the machine's bound for the same bytes, in the same rounds: one contiguous
        # copy of len(idx) rows (no gather), cached stores, into the reused buffer
        fns[BOUND] = lambda: np.copyto(buf, x[:N])
        res = interleaved(fns, rounds)
        for group in ("", "out="):
            peers = [k for k in res if not k.startswith(("readerlib", "("))
                     and ("out=" in k) == bool(group)]
            if peers:
                fastest = min(peers, key=lambda k: res[k][0])
                res[fastest] = res[fastest] + ("fastest peer",)
        for k, v in res.items():
            best, med = v[0], v[1]
            base = res["readerlib out=" if "out=" in k else "readerlib"][0]
            rows.append([f"({N}, {M}, {inner})", k, f"{best * 1e3:.2f}", f"{med * 1e3:.2f}",
                         f"{gb / best:.1f}",
                         f"{best / base:.2f}x" + (" (fastest peer)" if len(v) > 2 else "")])
        if res:
            # the faster peer per statistic: the lowest best, and the lowest median
            # (the peer with the lowest best may not have the lowest median)
            fresh = [res[k] for k in res if not k.startswith(("readerlib", "(")) and "out=" not in k]
            peer = (min(v[0] for v in fresh), min(v[1] for v in fresh))
            mine = res["readerlib"]
            rows.append([f"({N}, {M}, {inner})", "**faster peer / readerlib (fresh output)**",
                         "", "", "", f"best {peer[0] / mine[0]:.2f}x, median {peer[1] / mine[1]:.2f}x"])
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
    global CTC_SHAPES, CTC_BW_SHAPE, REINDEX_SHAPES
    p = harness.parser(__doc__, repeats=7)
    p.add_argument("--only", choices=["ctc", "fwd", "bwd"], action="append")
    p.add_argument("--cpu-time", action="store_true",
                   help="one thread everywhere; report process CPU seconds per call")
    p.add_argument("--sweep", action="store_true",
                   help="also the CTC split and streaming-store threshold sweeps")
    args = harness.parse(p, argv)
    args.rounds = args.repeats
    if args.quick:
        CTC_SHAPES = [(50, 1, 29), (40, 4, 129)]
        CTC_BW_SHAPE = CTC_SHAPES[-1]
        REINDEX_SHAPES = [(256, 512, 64)]
    global CLOCK, ONE_THREAD, NT
    only = set(args.only or ["ctc", "fwd", "bwd"])
    tf = harness.try_import("tensorflow") if "ctc" in only and harness.want(args, "tf") else None
    torch = harness.try_import("torch") if harness.want(args, "torch") else None
    if torch is not None and not args.cpu_time:
        # harness sets MKL_NUM_THREADS=1 (for NumPy's BLAS), from which torch takes
        # 1 intra-op thread; give it its own default, one per CPU, like readerlib
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    if args.cpu_time:
        CLOCK, ONE_THREAD, NT = time.process_time, True, 1
        if torch is not None:
            torch.set_num_threads(1)
        if tf is not None:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
    parts = []
    rep = harness.Report(args, "CPU kernels: ctc_greedy_decoder, batch_reindex, batch_reindex_grad")
    rep.__enter__()
    copy = harness.copy_bandwidth(16 << 20 if args.quick else 256 << 20, args.rounds)
    read = harness.read_bandwidth(repeats=args.rounds, data=np.random.default_rng(3).standard_normal(
        int(np.prod(CTC_BW_SHAPE)), dtype=np.float32))
    bw, rbw1, rbw2 = copy["rw"], read["1"], read["2"]
    head = [f"- cpu: {platform.processor() or platform.machine()}, "
            f"readerlib threads {rl_parallel.get_num_threads() if rl_parallel.threads_enabled() else 'off'}, "
            f"CTC row argmax: {_ctc.isa()}",
            f"- numpy {np.__version__}" + (f", tensorflow {tf.__version__}" if tf else "")
            + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else ""),
            f"- copy bandwidth in this run (np.copyto {copy['bytes'] >> 20} MiB, read + write): {bw:.1f} GB/s",
            f"- read bandwidth at the start of this run (np.sum / np.max over "
            f"{read['bytes'] / 2**20:.3g} MiB, best; 2 threads: one half each): "
            f"{rbw1:.1f} GB/s on 1 thread, {rbw2:.1f} GB/s on 2 threads (the CTC table repeats "
            "it interleaved with the (1000, 16, 5001) rounds)",
            "- timing: " + ("process CPU seconds per call, every contender on ONE thread "
                            "(ms columns are CPU ms; GB/s is per CPU-second)"
                            if args.cpu_time else "wall clock, default threads")]
    if "ctc" in only:
        parts.append(bench_ctc(args.rounds, tf, torch))
    if "fwd" in only:
        parts.append(bench_reindex_fwd(args.rounds, torch))
    if "bwd" in only:
        parts.append(bench_reindex_bwd(args.rounds, torch))
    if args.sweep:
        parts.append(sweep(args.rounds))
    rep.add(*head, "", *parts)
    rep.__exit__(None, None, None)


if __name__ == "__main__":
    main()
