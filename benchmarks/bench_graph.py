"""Graph layer benchmark (issue 10).

1. Session.run overhead on a trivial graph (constant -> identity), readerlib
   against tf.compat.v1.Session.run on the same graph, in the same run.
2. 64-byte records through shuffle(10k) -> batch(256): the graph
   (create_* ops -> read, one Session.run per batch) against the eager chain
   (``for batch in chain``), same file, same run.

    python benchmarks/bench_graph.py [--records N] [--repeats R] [--calls C] [--quick] [--out FILE]

Prints a Markdown table (best and median of interleaved rounds, harness.py);
--out writes it too.
"""
import os
import statistics
import sys
import tempfile
import time

import harness
import numpy as np

import readerlib as rl
import readerlib.graph as rg

BUFFER, BATCH = 10_000, 256


def session_runner(graph_of, session_of, n):
    """A contender: ``n`` Session.run calls of a constant -> identity graph (one built per contender)."""
    sess, y = session_of(graph_of())

    def run():
        t = time.perf_counter()
        for _ in range(n):
            sess.run(y)
        return harness.Sample(time.perf_counter() - t, n)
    return run, sess


def rl_graph():
    g = rg.Graph()
    with g.as_default():
        y = rg.identity(rg.constant(1.0))
    return g, y


def tf_graph():
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        y = tf.identity(tf.constant(1.0))
    return g, y


def rl_session(gy):
    return rg.Session(graph=gy[0]), gy[1]


def tf_session(gy):
    import tensorflow as tf
    return tf.compat.v1.Session(graph=gy[0]), gy[1]


def eager_pass(path, clock=time.perf_counter):
    chain = rl.RecordIOReader(path).shuffle(BUFFER, seed=0).batch(BATCH)
    n = 0
    t = clock()
    for (x,) in chain:
        n += len(x)
    dt = clock() - t
    chain.close()
    return n, dt


def graph_pass(path, callable_=False, clock=time.perf_counter):
    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_shuffle_reader(rg.create_recordio_reader(path),
                                                            BUFFER, seed=0), BATCH)
        (x,) = rg.read(r)
    n = 0
    with rg.Session(graph=g) as sess:
        step = sess.make_callable(x) if callable_ else (lambda: sess.run(x))
        t = clock()
        while True:
            try:
                n += len(step())
            except rg.OutOfRangeError:
                break
        dt = clock() - t
    return n, dt


def best_stretch(step, stop, k=50):
    """Seconds per call of the cheapest run of ``k`` consecutive calls over one pass
    (on a busy shared machine, the stretches nobody preempted)."""
    best = float("inf")
    try:
        while True:
            t = time.perf_counter()
            for _ in range(k):
                step()
            best = min(best, time.perf_counter() - t)
    except stop:
        pass
    return best / k


def stretch_eager(path):
    chain = rl.RecordIOReader(path).shuffle(BUFFER, seed=0).batch(BATCH)
    it = iter(chain)
    try:
        return best_stretch(lambda: next(it), StopIteration)
    finally:
        chain.close()


def stretch_graph(path):
    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_shuffle_reader(rg.create_recordio_reader(path),
                                                            BUFFER, seed=0), BATCH)
        (x,) = rg.read(r)
    with rg.Session(graph=g) as sess:
        return best_stretch(lambda: sess.run(x), rg.OutOfRangeError)


def stats(values):
    return min(values), statistics.median(values)


def main(argv=None):
    p = harness.parser(__doc__, repeats=5)
    p.add_argument("--records", type=int, default=2_000_000)
    p.add_argument("--calls", type=int, default=20_000)
    a = harness.parse(p, argv)
    if a.quick:
        a.records, a.calls = 20_000, 200
    a.repeat = a.repeats
    rep = harness.Report(a, "Graph layer: Session.run overhead and the reader ops")
    rep.__enter__()
    lines = rep.lines
    lines += ["| case | readerlib | peer | ratio (best) | ratio (median) |", "|---|---|---|---|---|"]

    contenders, sessions = {}, []
    run, sess = session_runner(rl_graph, rl_session, a.calls)
    contenders["readerlib"], _ = run, sessions.append(sess)
    if harness.want(a, "tf") and harness.try_import("tensorflow"):
        run, sess = session_runner(tf_graph, tf_session, a.calls // 4)
        contenders["tf"], _ = run, sessions.append(sess)
    st = harness.interleaved(contenders, a.repeat)
    for sess in sessions:
        sess.close()
    rb, rm = 1 / st["readerlib"].rate_best, 1 / st["readerlib"].rate_median
    if "tf" in st:
        tb, tm = 1 / st["tf"].rate_best, 1 / st["tf"].rate_median
        lines.append(f"| Session.run(constant -> identity), us per run | {rb * 1e6:.2f} (median "
                     f"{rm * 1e6:.2f}) | tf.compat.v1 {tb * 1e6:.2f} (median {tm * 1e6:.2f}) | "
                     f"{tb / rb:.1f}x | {tm / rm:.1f}x |")
    else:
        lines.append(f"| Session.run(constant -> identity), us per run | {rb * 1e6:.2f} | "
                     "(TensorFlow not run) | | |")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "small.rio")
        rng = np.random.default_rng(0)
        with rl.RecordIOWriter(path, rl.Schema([rl.Field("x", "uint8", (64,))])) as w:
            for start in range(0, a.records, 1 << 18):
                k = min(1 << 18, a.records - start)
                w.write_batch({"x": rng.integers(0, 256, size=(k, 64), dtype=np.uint8)})
        eager_pass(path)                  # warm the page cache
        eager, graph, call = [], [], []
        for _ in range(a.repeat):         # interleaved: the machine is shared
            n, dt = eager_pass(path)
            eager.append(n / dt)
            n2, dt2 = graph_pass(path)
            assert n2 == n
            graph.append(n2 / dt2)
            n3, dt3 = graph_pass(path, callable_=True)
            call.append(n3 / dt3)
        (eb, em), (gb, gm), (cb, cm) = stats([-v for v in eager]), stats([-v for v in graph]), \
            stats([-v for v in call])
        eb, em, gb, gm, cb, cm = -eb, -em, -gb, -gm, -cb, -cm
        lines.append(f"| {a.records:,} x 64 B, shuffle(10k) -> batch(256) -> read, M rec/s: "
                     f"Session.run per batch | {gb / 1e6:.2f} (median {gm / 1e6:.2f}) | eager chain "
                     f"{eb / 1e6:.2f} (median {em / 1e6:.2f}) | {gb / eb:.2f}x | {gm / em:.2f}x |")
        lines.append(f"| same, `sess.make_callable(x)` per batch | {cb / 1e6:.2f} (median "
                     f"{cm / 1e6:.2f}) | eager chain {eb / 1e6:.2f} | {cb / eb:.2f}x | {cm / em:.2f}x |")
        pairs = sorted(gv / ev for gv, ev in zip(graph, eager))
        lines.append(f"| graph / eager, ratio of adjacent passes (min, median, max of "
                     f"{len(pairs)}) | | | | {pairs[0]:.2f}x, {statistics.median(pairs):.2f}x, "
                     f"{pairs[-1]:.2f}x |")
        # CPU time of the process (all threads): what each loop costs, less the time a busy
        # shared machine takes the core away
        cpu = sorted((eager_pass(path, time.process_time)[1] / graph_pass(path, False, time.process_time)[1])
                     for _ in range(a.repeat))
        lines.append(f"| graph / eager in process CPU time, adjacent passes (min, median, max of "
                     f"{len(cpu)}) | | | | {cpu[0]:.2f}x, {statistics.median(cpu):.2f}x, {cpu[-1]:.2f}x |")
        se, sg = [], []
        for _ in range(a.repeat):
            se.append(stretch_eager(path))
            sg.append(stretch_graph(path))
        lines.append(f"| per batch, cheapest 50-batch stretch of a pass (best of {a.repeat}), us | "
                     f"{min(sg) * 1e6:.2f} | eager chain {min(se) * 1e6:.2f} | "
                     f"{min(se) / min(sg):.2f}x | {statistics.median(se) / statistics.median(sg):.2f}x |")
    rep.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
