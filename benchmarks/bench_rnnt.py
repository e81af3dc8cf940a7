"""Batched greedy RNN-T decoding: loop frames vs loop labels vs single.

Realistic random model (issue 5): LSTM predictor 1 x 640, joint 640, encoder
dim 640, vocabulary 1024 + blank (blank last), blank bias calibrated so about
85% of joint evaluations emit blank, T = 375 frames (30 s at 80 ms), float32.

Times are per batch (best and median of --repeats runs, the algorithms
interleaved round by round, harness.py) on the same data in the same process,
reported with their ratios to the first row (best / best, median / median).
A batch whose slowest first run takes over --max-first-s seconds gets no
further rounds (the rounds column says how many ran); --max-first-s 0 always
runs them all.  Also reports
predictor and joint calls and rows (rows = utterance-steps actually computed),
which is where the difference between the algorithms comes from.

Usage::

    python benchmarks/bench_rnnt.py                 # CPU, batches 1 16 32 128
    python benchmarks/bench_rnnt.py --device gpu    # CuPy (loop_labels, loop_frames)
    python benchmarks/bench_rnnt.py --quick --out FILE
"""
import os
import time

# One BLAS thread: the box is shared, and an oversubscribed OpenBLAS spins
# (measured 100x slower per small GEMM).  Every algorithm gets the same BLAS.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import harness  # noqa: E402
import numpy as np  # noqa: E402

from readerlib.rnnt import RNNTModel, rnnt_greedy_decode  # noqa: E402

V, H, J, ENC, T = 1024, 640, 640, 640, 375

#: name -> (algorithm, extra keyword arguments)
VARIANTS = {
    "loop_labels": ("loop_labels", {}),                        # window 8, compacted rows
    "loop_labels_w1": ("loop_labels", {"window": 1}),          # NeMo's frame-by-frame search
    "loop_labels_masked": ("loop_labels", {"compact": False}),  # the GPU control flow on the CPU
    "loop_frames": ("loop_frames", {}),
    "single": ("single", {}),
}


def blank_fraction(model, x, lengths):
    st = {}
    # window=1 + compacted rows: joint_rows is exactly the number of evaluations
    hyps = rnnt_greedy_decode(model, x, lengths, algorithm="loop_labels", window=1, stats=st)
    labels = sum(len(h) for h in hyps)
    return 1.0 - labels / st["joint_rows"]


def make_model(target, seed=0, xp=np):
    """Bisection on the blank logit bias until ~target of evaluations are blank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 120, ENC)).astype(np.float32)
    lengths = np.full(2, 120)
    lo, hi = 0.5, 3.0   # a low bias emits up to max_symbols labels per frame: slow to probe
    for _ in range(7):
        mid = 0.5 * (lo + hi)
        m = RNNTModel.random(V, ENC, H, J, blank_bias=mid, rng=seed)
        frac = blank_fraction(m, x, lengths)
        if frac < target:
            lo = mid
        else:
            hi = mid
    m = RNNTModel.random(V, ENC, H, J, blank_bias=0.5 * (lo + hi), rng=seed)
    return m, 0.5 * (lo + hi), blank_fraction(m, x, lengths)


def main(argv=None):
    global V, H, J, ENC, T
    ap = harness.parser(__doc__, repeats=3)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 128])
    ap.add_argument("--single-max-utts", type=int, default=8,
                    help="'single' is timed on at most this many utterances and scaled to the batch")
    ap.add_argument("--blank-target", type=float, default=0.85)
    ap.add_argument("--algorithms", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--masked-max-batch", type=int, default=32,
                    help="loop_labels_masked (full batch every step) only up to this batch")
    ap.add_argument("--max-first-s", type=float, default=5.0,
                    help="no further rounds for a batch whose slowest first run took longer "
                         "(0: always run --repeats rounds)")
    args = harness.parse(ap, argv)
    if args.quick:
        V, H, J, ENC, T = 63, 32, 32, 32, 24
        args.batches = [1, 4]
    report = harness.Report(args, "Batched RNN-T greedy decoding")
    report.__enter__()
    out = report.add

    model, bias, frac = make_model(args.blank_target)
    xp = np
    if args.device == "gpu":
        import cupy
        xp = cupy
        model = model.to(cupy)
    out(f"- model: LSTM 1x{H}, joint {J}, vocab {V}+blank, enc {ENC}, T={T}, float32; "
          f"blank bias {bias:.3f} -> {100 * frac:.1f}% blank evaluations (loop_labels, 2 utts x 120 frames)")
    cut = (f"fewer rounds where a first run took over {args.max_first_s:g} s, see the rounds column"
           if args.max_first_s > 0 else "every round run")
    out(f"- device: {args.device}; repeats {args.repeats} (best and median; {cut})", "")
    out("| batch | algorithm | time / batch (ms), median | best (ms) | rounds | ms / utt (median) "
        "| predictor calls | predictor rows | joint calls | joint rows | time vs first row, best / median |")
    out("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(123)
    for B in args.batches:
        x_h = rng.standard_normal((B, T, ENC)).astype(np.float32)
        L_h = np.full(B, T, dtype=np.int64)
        x, L = xp.asarray(x_h), xp.asarray(L_h)
        results, runs = {}, {}
        for name in args.algorithms:
            alg, kw = VARIANTS[name]
            if args.device == "gpu" and "compact" in kw:
                continue
            if name == "loop_labels_masked" and B > args.masked_max_batch:
                continue
            xb, Lb, scale = x, L, 1.0
            if alg == "single" and B > args.single_max_utts:
                xb, Lb, scale = x[:args.single_max_utts], L[:args.single_max_utts], B / args.single_max_utts
            if xp is not np:  # compile the kernels and warm cuBLAS outside the timing
                rnnt_greedy_decode(model, xb[:1, :20], Lb[:1] * 0 + 20, 10, alg, **kw)
                xp.cuda.runtime.deviceSynchronize()
            st = {}
            t0 = time.perf_counter()
            hyps = rnnt_greedy_decode(model, xb, Lb, 10, alg, stats=st, **kw)  # first run + counts
            if xp is not np:
                xp.cuda.runtime.deviceSynchronize()
            first = time.perf_counter() - t0

            def run(xb=xb, Lb=Lb, alg=alg, kw=kw):
                rnnt_greedy_decode(model, xb, Lb, 10, alg, **kw)
                if xp is not np:
                    xp.cuda.runtime.deviceSynchronize()
            runs[name] = run
            results[name] = (first, st, [h.y_sequence.tolist() for h in hyps], scale, xb.shape[0])
        # the first run counts; further rounds (interleaved) unless one first run took over 5 s
        firsts = {k: [v[0]] for k, v in results.items()}
        slowest = max(v[0] for v in results.values())
        if args.repeats > 1 and (args.max_first_s <= 0 or slowest <= args.max_first_s):
            more = harness.interleaved(runs, args.repeats - 1, warmup=0)
            for k in firsts:
                firsts[k] += more[k].seconds
        base = None
        for name, (_, st, _, scale, nb) in results.items():
            t = float(np.median(firsts[name])) * scale
            tb = float(np.min(firsts[name])) * scale
            base = base or (tb, t)
            note = f" (timed on {nb} utts, scaled x{scale:g})" if scale != 1.0 else ""
            out(f"| {B} | {name}{note} | {1e3 * t:.1f} | {1e3 * tb:.1f} | {len(firsts[name])} | {1e3 * t / B:.2f} | "
                f"{st['predictor_calls']} | {st['predictor_rows']} | {st['joint_calls']} | {st['joint_rows']} | "
                f"{tb / base[0]:.2f}x / {t / base[1]:.2f}x |")
        n = min(len(r[2]) for r in results.values())
        first_labels = next(iter(results.values()))[2][:n]
        for name in results:
            assert results[name][2][:n] == first_labels, f"{name} disagrees"
    out()
    report.__exit__(None, None, None)


if __name__ == "__main__":
    main()
