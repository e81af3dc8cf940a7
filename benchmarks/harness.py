"""The benchmarks' one harness: timing, the machine's bounds, reports.

Every script in this folder imports it (``import harness``: Python puts the
script's own folder first on ``sys.path``; readerlib itself comes from the
environment -- the in-place build with ``PYTHONPATH=.``, or an install).

What it gives a benchmark:

- :func:`parser`: the flags every benchmark shares -- ``--repeats N``
  (interleaved rounds), ``--peers`` (which peers run beside readerlib),
  ``--quick`` (tiny sizes: a smoke run whose figures
  mean nothing), ``--busy N`` (N competing busy processes for the whole run)
  and ``--out FILE`` (the Markdown report, also printed).
- :func:`interleaved`: several contenders timed round after round in the
  same run (A B C, B C A, C A B ...), so a burst of load from another
  process hits them all alike; :class:`Stats` per contender (best, median,
  spread) and :func:`speedup` against a named peer, best and median.
- :class:`Competitors`: busy processes (a Python busy loop each) for a
  benchmark of behaviour under contention.
- :func:`copy_bandwidth` / :func:`read_bandwidth`: the machine's memcpy and
  read bandwidth measured in the same run, to print next to the figures they
  bound (:func:`bounds_line`).
- :func:`run_child`: a Python snippet in a fresh interpreter, with a time
  limit, returning what it ``emit``-ted and its peak RSS (VmHWM): memory
  figures and start-up times never mix with the parent's state.
- :class:`Report`: the Markdown report with its header (command, date,
  machine, load before and after, busy competitors).

Machines here are shared: best figures are the least disturbed runs, medians
say how stable they were; compare ratios taken in the same run.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# One BLAS thread: on 2 shared cores an oversubscribed OpenBLAS spins (measured
# up to 100x slower per small product); every contender gets the same BLAS.
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")      # TensorFlow's start-up chatter

import numpy as np  # noqa: E402

__all__ = ["parser", "parse", "want", "Sample", "Stats", "interleaved", "speedup", "Competitors", "copy_bandwidth",
           "read_bandwidth", "bounds_line", "run_child", "Report", "fmt_rate", "try_import"]


def parser(doc, repeats=5):
    """An ArgumentParser with the shared flags; ``doc`` is the script's docstring."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"interleaved rounds per contender; best and median over them (default {repeats})")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, at most 2 rounds: a smoke run (its figures mean nothing)")
    p.add_argument("--busy", type=int, default=0,
                   help="competing busy processes (a Python busy loop each) during the whole run")
    p.add_argument("--peers", default="all",
                   help="peers to run beside readerlib: 'all', 'none' or a list (tf,torch,numpy,...)")
    p.add_argument("--out", help="also write the Markdown report to this file")
    return p


def parse(p, argv=None):
    """Parse the flags; ``--quick`` caps the rounds at 2."""
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
    return args


def want(args, peer):
    """Whether ``--peers`` asks for ``peer`` (the caller checks that it imports: :func:`try_import`)."""
    if args.peers == "none" or (args.peers != "all" and peer not in args.peers.split(",")):
        return False
    return True


class Sample:
    """What a contender returns to time itself: ``seconds`` for ``units`` of work
    (records, bytes, calls).  A contender returning anything else is timed by
    :func:`interleaved` around the call, one unit per call."""

    __slots__ = ("seconds", "units")

    def __init__(self, seconds, units=1):
        self.seconds, self.units = float(seconds), units


class Stats:
    """Seconds per round of one contender, and the units of work of a round."""

    def __init__(self, name, seconds, units):
        if not seconds:
            raise ValueError(f"{name}: no rounds timed")
        self.name, self.seconds, self.units = name, list(seconds), units

    @property
    def best(self):
        return min(self.seconds)

    @property
    def median(self):
        return statistics.median(self.seconds)

    @property
    def spread(self):
        """(slowest - fastest) / median: how much the machine moved this figure."""
        return (max(self.seconds) - min(self.seconds)) / self.median if self.median else 0.0

    @property
    def rate_best(self):
        return self.units / self.best

    @property
    def rate_median(self):
        return self.units / self.median

    def __repr__(self):
        return (f"Stats({self.name!r}, best={self.best:.6g} s, median={self.median:.6g} s, "
                f"spread={self.spread:.0%}, units={self.units})")


def interleaved(contenders, repeats, number=1, warmup=1, clock=time.perf_counter):
    """Time every contender ``repeats`` rounds, rotating the order each round.

    Parameters
    ----------
    contenders : dict name -> callable
        Each call is one unit of work, or returns a :class:`Sample` (it timed
        itself, e.g. to leave set-up out, and says how many units it did).
    repeats : int
        Rounds.
    number : int
        Calls per round (tiny cases: a round of one call is below the clock's
        resolution); seconds are per call.
    warmup : int
        Untimed calls of each contender first (page cache, lazy imports, pools).
    clock : callable
        ``time.perf_counter`` (wall) or ``time.process_time`` (CPU of the process).

    Returns
    -------
    dict name -> Stats, in the order given.
    """
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    seconds = {k: [] for k in names}
    units = {k: 1 for k in names}
    for r in range(max(1, repeats)):
        k0 = r % len(names)
        for name in names[k0:] + names[:k0]:
            fn = contenders[name]
            t0 = clock()
            total, n = 0.0, 0
            for _ in range(number):
                out = fn()
                if isinstance(out, Sample):
                    total += out.seconds
                    n += out.units
            if n or total:
                seconds[name].append(total / number)
                units[name] = n / number
            else:
                seconds[name].append((clock() - t0) / number)
    return {k: Stats(k, seconds[k], units[k]) for k in names}


def speedup(stats, name, peer):
    """(best, median) rate of ``name`` over the rate of ``peer``: > 1 is faster."""
    a, b = stats[name], stats[peer]
    return a.rate_best / b.rate_best, a.rate_median / b.rate_median


#: A busy loop that ends by itself once its parent is gone (a benchmark killed
#: hard leaves no spinning orphan behind).
SPIN = ("import os\np = os.getppid()\ni = 0\nwhile True:\n    i += 1\n"
        "    if not i & 0xFFFFF and os.getppid() != p:\n        break\n")


class Competitors:
    """``n`` busy processes spinning in Python while the block runs, killed on
    exit (and at interpreter exit, should the block never be left normally)."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", SPIN]))
        if self.n:
            atexit.register(self.__exit__, None, None, None)
            time.sleep(0.3)        # let them reach the loop
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def copy_bandwidth(nbytes=256 << 20, repeats=5):
    """memcpy (``np.copyto``) of a ``nbytes`` buffer, best of ``repeats``:
    ``{"copy": GB copied per second, "rw": GB read + written per second}``."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    t = interleaved({"copy": lambda: np.copyto(b, a)}, repeats)["copy"].best
    return {"copy": nbytes / t / 1e9, "rw": 2 * nbytes / t / 1e9, "bytes": nbytes}


def read_bandwidth(nbytes=256 << 20, repeats=5, data=None):
    """Read GB/s on 1 and 2 threads: the faster of ``np.sum`` / ``np.max`` over a
    buffer (``data``, or ``nbytes`` of float32); on 2 threads one half each
    (NumPy releases the GIL).  Returns ``{"1": GB/s, "2": GB/s, "bytes": n}``."""
    a = data.reshape(-1) if data is not None else \
        np.random.default_rng(3).standard_normal(nbytes // 4, dtype=np.float32)
    h = a.shape[0] // 2
    halves = [a[:h], a[h:]]
    with ThreadPoolExecutor(2) as pool:
        res = interleaved({
            "sum 1": lambda: a.sum(), "max 1": lambda: a.max(),
            "sum 2": lambda: list(pool.map(np.sum, halves)),
            "max 2": lambda: list(pool.map(np.max, halves)),
        }, repeats)
    gb = a.nbytes / 1e9
    return {"1": gb / min(res["sum 1"].best, res["max 1"].best),
            "2": gb / min(res["sum 2"].best, res["max 2"].best), "bytes": a.nbytes}


def bounds_line(copy=None, read=None):
    """One line stating the bounds measured in this run."""
    parts = []
    if copy:
        parts.append(f"memcpy of {copy['bytes'] >> 20} MiB: {copy['copy']:.1f} GB/s copied "
                     f"({copy['rw']:.1f} GB/s read + write)")
    if read:
        parts.append(f"read ({read['bytes'] >> 20} MiB, np.sum/np.max): {read['1']:.1f} GB/s on 1 thread, "
                     f"{read['2']:.1f} GB/s on 2")
    return "- machine bounds in this run (best of the rounds): " + "; ".join(parts)


CHILD_PRELUDE = r'''
import json as _json, sys as _sys
def rss_mb():
    """{'VmRSS', 'VmHWM', 'RssAnon', 'RssFile'} of this process, MB."""
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) / 1024
    return d
BASELINE_RSS_MB = rss_mb()["VmRSS"]
def emit(obj):
    """Hand ``obj`` (JSON) back to the parent."""
    print("__HARNESS__ " + _json.dumps(obj), flush=True)
'''


def run_child(code, argv=(), timeout=600, env=None, python_flags=()):
    """Run ``code`` in a fresh interpreter with a time limit.

    ``env`` updates the environment (a value of None unsets the variable).
    The code sees ``emit(obj)``, ``rss_mb()`` and ``BASELINE_RSS_MB`` (the
    interpreter's RSS before the code ran) and ``sys.argv[1:] == argv``.

    Returns ``(emitted, peak)``: the list of objects the child emitted, and
    ``{"peak_MB": VmHWM at exit, "baseline_MB": ...}``.  Raises
    ``RuntimeError`` with the child's stderr when it fails.
    """
    tail = "\nemit({'__rss__': {'peak_MB': rss_mb()['VmHWM'], 'baseline_MB': BASELINE_RSS_MB}})\n"
    e = dict(os.environ)
    for k, v in (env or {}).items():       # None: unset
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    r = subprocess.run([sys.executable, *python_flags, "-c", CHILD_PRELUDE + code + tail, *map(str, argv)],
                       capture_output=True, text=True, timeout=timeout, env=e)
    if r.returncode:
        raise RuntimeError(f"benchmark child exited {r.returncode}:\n{r.stderr[-4000:]}")
    got = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines()
           if line.startswith("__HARNESS__ ")]
    peak = got.pop()["__rss__"]
    return got, peak


def fmt_rate(v, unit=""):
    """A rate with 3 significant figures, k/M/G suffixed."""
    for scale, s in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {s}{unit}"
    return f"{v:.3g} {unit}".rstrip()


def try_import(name):
    """The module, or None (with a note on stderr) when it is missing or broken."""
    try:
        return __import__(name)
    except Exception as e:
        print(f"# {name} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


class Report:
    """A Markdown report: a header (command, date, machine, load), then what the
    benchmark adds.  Use as a context manager around the measurements:
    ``--busy`` competitors run inside it, and on exit the report is printed
    and written to ``--out``."""

    def __init__(self, args, title=None):
        self.args = args
        self.lines = []
        self.load0 = os.getloadavg()
        self._competitors = Competitors(getattr(args, "busy", 0) or 0)
        cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
        if title:
            self.lines += [f"### {title}", ""]
        self.lines += [
            f"- command: `{cmd}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
            f"Python {platform.python_version()}, NumPy {np.__version__}",
            f"- repeats: {args.repeats} (best and median over them); "
            f"busy competitors: {getattr(args, 'busy', 0) or 0}"
            + ("; QUICK smoke run: the figures mean nothing" if getattr(args, "quick", False) else ""),
            f"- load average (1 min) at start: {self.load0[0]:.2f}",
        ]

    def __enter__(self):
        self._competitors.__enter__()
        return self

    def __exit__(self, exc_type, *exc):
        self._competitors.__exit__(exc_type, *exc)
        if exc_type is None:
            self.finish()

    def add(self, *lines):
        self.lines.extend(lines or [""])
        return self

    def table(self, head, rows, title=None):
        if title:
            self.lines += [title, ""]
        self.lines.append("| " + " | ".join(head) + " |")
        self.lines.append("|" + "|".join("---" for _ in head) + "|")
        self.lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        self.lines.append("")
        return self

    def text(self):
        return "\n".join(self.lines) + "\n"

    def finish(self):
        self.lines.insert(self.lines.index(next(x for x in self.lines if x.startswith("- load average"))) + 1,
                          f"- load average (1 min) at end: {os.getloadavg()[0]:.2f}")
        text = self.text()
        print(text, flush=True)
        if self.args.out:
            with open(self.args.out, "w") as f:
                f.write(text)
