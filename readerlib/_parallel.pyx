# cython: language_level=3
"""readerlib's thread policy and worker pool (one per process).

Design:
    Why not OpenMP.  libgomp is not fork-safe: once a process has run an
    OpenMP region (readerlib's own, or torch's, which shares the library),
    a forked child (a DataLoader worker) that enters one blocks forever in
    GOMP_parallel.  And libgomp's idle threads spin (GOMP_SPINCOUNT), so on a
    busy machine every fork/join waits for a thread that is descheduled and
    burns the core a competitor needs: measured 10-20x slower than one thread
    (benchmarks/RESULTS.md, "Threads on a shared machine").  So no module is
    compiled with -fopenmp; this pool replaces every `prange`.

    The pool.  Worker threads are pthreads started lazily by the first
    parallel loop that needs them (ids 1..n-1; the caller is 0).  They wait on
    a condition variable: passive, no spinning, a blocked worker costs nothing
    on a busy machine.  A loop publishes one job (body, ctx, n_items), wakes
    the workers it wants, and then works itself: the items are split
    statically into SHARES_PER_THREAD * n_threads contiguous ranges ("shares")
    and every thread, the caller included, claims the next unclaimed share
    with one atomic add until none is left.  A worker that wakes late, or is
    descheduled by a competing process, simply claims fewer shares: the caller
    takes them back, so a loop is never slower than the caller running it
    alone by more than one share of work plus the wake-up call (a few us).
    The caller then waits (condition variable) only for shares a worker has
    already started.  That wait is the one way a split can lose against one
    thread (a worker descheduled in the middle of a share by a competing
    process), so the caller times it: when the wait exceeded what the
    workers' shares would have cost the caller itself, the next loops run
    serially (1, 2, 4 ... up to 256 loops while splits keep losing; halved
    again after a split that paid).  On an idle machine splits pay and the
    back-off never starts.

    Placement.  Linux often queues the woken worker on the caller's own CPU
    while another CPU idles (its idle-CPU search is skipped when the LLC
    looks busy, and the worker's previous CPU is often the caller's): the
    worker then runs only when the caller has done every share itself, and
    the split takes the 1-thread time.  Measured on the 2-vCPU Xeon VM
    (reindex forward, 16 MiB of 256-byte rows, 15 ms pauses between calls):
    the worker joined after the caller had finished in about half of the
    calls, and those made the median.  So after its first share (or first
    chunk, for bodies that claim their own: `rl_pool_place_late_workers`)
    the caller moves every worker that has not joined the job yet off its
    own CPU: the worker's affinity narrowed to the other CPUs it may use,
    which moves a queued thread at once, then restored (it stays where it
    now is).  Three syscalls per late worker, no spinning, no yield; a
    worker already on another CPU does not move.  (A worker that has joined
    but shares the caller's CPU is not moved here; the shuffle's restore fill
    has its worker move itself in that case, _leave_caller_cpu in
    readers/_shuffle.pyx, measured there.)

    One job at a time: a loop that finds the pool taken (a nested loop inside
    a body, a loop started on a worker, or a second thread's loop running at
    the same time) runs serially on its caller, never deadlocks and never
    oversubscribes the cores.

    Fork: a `pthread_atfork` child handler forgets the parent's workers (they
    do not exist in the child) and re-initialises the lock and conditions;
    the child starts its own workers lazily on its first parallel loop.  The
    prepare/parent handlers hold the pool lock across fork(), so the child
    never inherits it locked.  (pthread_atfork rather than
    os.register_at_fork: it also covers fork() called from C, and runs even
    when the GIL-holding thread is not the forking one.)

    Thread count.  `_default_num_threads` derives it like scikit-learn's
    `_openmp_effective_n_threads`: READERLIB_NUM_THREADS if set, else the CPUs
    this process may run on (sched_getaffinity, capped by a cgroup v2/v1 CPU
    quota), capped by OMP_NUM_THREADS if set.  `set_num_threads` changes it at
    run time.  Small loops use fewer threads (`threads_for`).

Invariants: a body never raises (nogil, noexcept), writes only its own items'
outputs (and its tid's scratch), and gives results independent of which
thread runs which share; so every kernel is bitwise identical for any thread
count.
"""
import math
import os

from readerlib._typedefs cimport int64_t

cdef extern from *:
    """
    #include <pthread.h>
    #include <signal.h>
    #include "rl_affinity.h"
    #if defined(__linux__)
    #include <sys/syscall.h>
    #include <unistd.h>
    #endif
    #include <stdint.h>
    #include <string.h>
    #include <time.h>

    #define RL_MAX_THREADS 256
    #define RL_MAX_BACKOFF 256
    #define RL_SHARES_PER_THREAD 4

    typedef void (*rl_pool_body)(void *ctx, int64_t begin, int64_t end, int tid);

    typedef struct {
        pthread_mutex_t mu;
        pthread_cond_t work;        /* workers wait here for a new job */
        pthread_cond_t done;        /* the caller waits here for the last worker */
        int n_workers;              /* workers started: ids 1..n_workers */
        int busy;                   /* a job holds the pool: other loops run serially */
        uint64_t gen;               /* job number; each worker joins a job at most once */
        int open;                   /* workers may still join the current job */
        int active;                 /* workers inside the current job */
        rl_pool_body body;          /* the current job */
        void *ctx;
        int64_t n_items, n_shares;
        int n_threads;
        int64_t next;               /* next unclaimed share (atomic) */
        int placed;                 /* the caller has placed the late workers (once a job) */
        int tid[RL_MAX_THREADS];    /* workers' kernel thread ids (0: not known) */
        uint64_t joined[RL_MAX_THREADS]; /* the job each worker joined last (gen) (atomic) */
        int64_t moved_workers;      /* statistics: workers moved off the caller's CPU */
        int backoff;                /* loops left to run serially after a losing split */
        int backoff_next;           /* the next back-off (doubles while splits lose) */
        int64_t losing_splits;      /* statistics for tests and benchmarks */
    } rl_pool_t;

    static rl_pool_t rl_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER,
                                .done = PTHREAD_COND_INITIALIZER, .backoff_next = 1};

    /* Move worker thread `tid` off `cpu` (see Design, "Placement"): its
       affinity narrowed, then its mask restored (rl_affinity.h); returns 1
       when it asked the kernel to move it.  tid 0: not known yet. */
    static int rl_pool_move_off(int tid, int cpu) {
        rl_cpu_mask had;
        if (tid <= 0 || !rl_affinity_leave(tid, cpu, &had)) return 0;
        rl_affinity_restore(tid, &had);
        return 1;
    }

    /* Called by the caller (tid 0) of a split loop after its first share or
       chunk: every worker of this job that has not joined it yet is moved off
       the caller's CPU (see Design, "Placement").  Once per job; nothing for
       a loop run serially (the pool not open: the body was given the whole
       range).  Only the thread that published the job may call it. */
    static int rl_pool_placement = 1;   /* off: as the scheduler places them (benchmarks) */

    static void rl_pool_place_late_workers(void) {
        int k, cpu, n;
        uint64_t gen;
        if (!__atomic_load_n(&rl_pool.open, __ATOMIC_RELAXED) || rl_pool.placed
                || !__atomic_load_n(&rl_pool_placement, __ATOMIC_RELAXED)) return;
        rl_pool.placed = 1;
        cpu = rl_current_cpu();
        if (cpu < 0) return;
        gen = rl_pool.gen;                  /* written by this thread */
        n = rl_pool.n_threads;
        for (k = 1; k < n; ++k) {
            if (__atomic_load_n(&rl_pool.joined[k], __ATOMIC_RELAXED) == gen) continue;
            if (rl_pool_move_off(__atomic_load_n(&rl_pool.tid[k], __ATOMIC_RELAXED), cpu))
                __atomic_fetch_add(&rl_pool.moved_workers, 1, __ATOMIC_RELAXED);
        }
    }

    /* Claim and run shares until none is left; returns how many this thread ran. */
    static int64_t rl_pool_run_shares(rl_pool_body body, void *ctx, int64_t n_items,
                                      int64_t n_shares, int tid) {
        int64_t mine = 0;
        for (;;) {
            int64_t s = __atomic_fetch_add(&rl_pool.next, 1, __ATOMIC_RELAXED);
            if (s >= n_shares) return mine;
            body(ctx, s * n_items / n_shares, (s + 1) * n_items / n_shares, tid);
            if (tid == 0 && mine == 0) rl_pool_place_late_workers();
            mine++;
        }
    }

    static inline int64_t rl_now_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
    }

    static void *rl_pool_worker(void *arg) {
        int id = (int)(intptr_t)arg;
        uint64_t seen = UINT64_MAX;     /* != gen: join the job in flight, if still open */
        pthread_mutex_lock(&rl_pool.mu);
    #if defined(__linux__)
        __atomic_store_n(&rl_pool.tid[id], (int)syscall(SYS_gettid), __ATOMIC_RELAXED);
    #endif
        for (;;) {
            while (rl_pool.gen == seen)
                pthread_cond_wait(&rl_pool.work, &rl_pool.mu);
            seen = rl_pool.gen;
            if (!rl_pool.open || id >= rl_pool.n_threads) continue;
            __atomic_store_n(&rl_pool.joined[id], seen, __ATOMIC_RELAXED);
            rl_pool.active++;
            rl_pool_body body = rl_pool.body;
            void *ctx = rl_pool.ctx;
            int64_t n_items = rl_pool.n_items, n_shares = rl_pool.n_shares;
            pthread_mutex_unlock(&rl_pool.mu);
            rl_pool_run_shares(body, ctx, n_items, n_shares, id);
            pthread_mutex_lock(&rl_pool.mu);
            if (--rl_pool.active == 0) pthread_cond_signal(&rl_pool.done);
        }
        return NULL;
    }

    /* Start workers up to id n-1 (under the lock); returns how many exist. */
    static int rl_pool_grow(int n) {
        sigset_t all, old;
        if (n - 1 <= rl_pool.n_workers) return rl_pool.n_workers;
        sigfillset(&all);       /* signals stay with Python's threads */
        /* ...except the synchronous fault signals: one raised in a thread that
         * blocks it kills the process without running any handler (the SIGBUS
         * guard of rl_mapped.h, faulthandler) */
        sigdelset(&all, SIGBUS); sigdelset(&all, SIGSEGV); sigdelset(&all, SIGFPE); sigdelset(&all, SIGILL);
        pthread_sigmask(SIG_BLOCK, &all, &old);
        while (rl_pool.n_workers < n - 1) {
            pthread_t t;
            pthread_attr_t attr;
            int rc;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&attr, 256 * 1024);
            rc = pthread_create(&t, &attr, rl_pool_worker,
                                (void *)(intptr_t)(rl_pool.n_workers + 1));
            pthread_attr_destroy(&attr);
            if (rc != 0) break;  /* fewer threads: the caller does their shares */
            rl_pool.n_workers++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        return rl_pool.n_workers;
    }

    static void rl_parallel_for(int n_threads, int64_t n_items, rl_pool_body body, void *ctx) {
        int64_t n_shares;
        if (n_items <= 0) return;
    #ifndef READERLIB_NO_THREADS
        if (n_threads > RL_MAX_THREADS) n_threads = RL_MAX_THREADS;
        if (n_threads > n_items) n_threads = (int)n_items;
        if (n_threads > 1 && pthread_mutex_trylock(&rl_pool.mu) == 0) {
            if (!rl_pool.busy) {
                int have = rl_pool_grow(n_threads);
                if (have + 1 < n_threads) n_threads = have + 1;
            }
            if (!rl_pool.busy && rl_pool.backoff > 0) {
                rl_pool.backoff--;          /* recent splits lost: stay serial a while */
                n_threads = 1;
            }
            if (rl_pool.busy || n_threads < 2) {
                pthread_mutex_unlock(&rl_pool.mu);
            } else {
                int64_t t0, t1, t2, mine;
                n_shares = (int64_t)n_threads * RL_SHARES_PER_THREAD;
                if (n_shares > n_items) n_shares = n_items;
                rl_pool.busy = 1;
                rl_pool.body = body;
                rl_pool.ctx = ctx;
                rl_pool.n_items = n_items;
                rl_pool.n_shares = n_shares;
                rl_pool.n_threads = n_threads;
                rl_pool.next = 0;
                rl_pool.placed = 0;
                rl_pool.open = 1;
                rl_pool.gen++;
                pthread_mutex_unlock(&rl_pool.mu);
                t0 = rl_now_ns();
                pthread_cond_broadcast(&rl_pool.work);
                mine = rl_pool_run_shares(body, ctx, n_items, n_shares, 0);
                t1 = rl_now_ns();
                pthread_mutex_lock(&rl_pool.mu);
                rl_pool.open = 0;       /* late workers skip this job */
                while (rl_pool.active > 0)
                    pthread_cond_wait(&rl_pool.done, &rl_pool.mu);
                t2 = rl_now_ns();
                /* Did the split lose against running it all here?  The caller ran
                   `mine` shares in t1 - t0, so alone it would have taken about
                   (t1 - t0) * n_shares / mine; it lost if the wait for the
                   workers' last shares (a descheduled worker) exceeded what
                   those shares would have cost the caller.  Then run the next
                   loops serially, twice as many each time it happens again. */
                if (mine > 0 && mine < n_shares) {
                    if ((t2 - t1) * mine > (t1 - t0) * (n_shares - mine)) {
                        rl_pool.backoff = rl_pool.backoff_next;
                        rl_pool.losing_splits++;
                        if (rl_pool.backoff_next < RL_MAX_BACKOFF) rl_pool.backoff_next *= 2;
                    } else if (rl_pool.backoff_next > 1) {
                        rl_pool.backoff_next /= 2;
                    }
                }
                rl_pool.busy = 0;
                pthread_mutex_unlock(&rl_pool.mu);
                return;
            }
        }
    #endif
        body(ctx, 0, n_items, 0);
    }

    static int64_t rl_pool_losing_splits(void) {
        int64_t n;
        pthread_mutex_lock(&rl_pool.mu);
        n = rl_pool.losing_splits;
        pthread_mutex_unlock(&rl_pool.mu);
        return n;
    }

    static void rl_pool_reset_backoff(void) {
        pthread_mutex_lock(&rl_pool.mu);
        rl_pool.backoff = 0;
        rl_pool.backoff_next = 1;
        pthread_mutex_unlock(&rl_pool.mu);
    }

    static int64_t rl_pool_moved_workers(void) {
        return __atomic_load_n(&rl_pool.moved_workers, __ATOMIC_RELAXED);
    }

    static int rl_pool_workers(void) {
        int n;
        pthread_mutex_lock(&rl_pool.mu);
        n = rl_pool.n_workers;
        pthread_mutex_unlock(&rl_pool.mu);
        return n;
    }

    static void rl_pool_before_fork(void) { pthread_mutex_lock(&rl_pool.mu); }
    static void rl_pool_after_fork_parent(void) { pthread_mutex_unlock(&rl_pool.mu); }
    static void rl_pool_after_fork_child(void) {
        /* Only the forking thread exists here: forget the parent's workers
           and any job in flight; new workers start on the first loop. */
        memset(&rl_pool, 0, sizeof rl_pool);
        rl_pool.backoff_next = 1;
        pthread_mutex_init(&rl_pool.mu, NULL);
        pthread_cond_init(&rl_pool.work, NULL);
        pthread_cond_init(&rl_pool.done, NULL);
    }
    static int rl_pool_install_fork_handlers(void) {
        return pthread_atfork(rl_pool_before_fork, rl_pool_after_fork_parent,
                              rl_pool_after_fork_child);
    }

    #ifdef READERLIB_NO_THREADS
    #define RL_THREADS_ENABLED 0
    #else
    #define RL_THREADS_ENABLED 1
    #endif
    """
    int RL_MAX_THREADS
    int RL_SHARES_PER_THREAD
    int RL_THREADS_ENABLED
    void rl_parallel_for(int n_threads, int64_t n_items, rl_body_fn body, void *ctx) noexcept nogil
    int rl_pool_workers() noexcept nogil
    int64_t rl_pool_losing_splits() noexcept nogil
    int64_t rl_pool_moved_workers() noexcept nogil
    void rl_pool_place_late_workers() noexcept nogil
    int rl_pool_placement
    void rl_pool_reset_backoff() noexcept nogil
    int rl_pool_install_fork_handlers() noexcept

if rl_pool_install_fork_handlers() != 0:
    raise OSError("readerlib: pthread_atfork failed; the thread pool would not be fork-safe")

#: The most threads one loop may use (set_num_threads refuses more).
MAX_THREADS = RL_MAX_THREADS
#: Contiguous ranges per thread that idle threads claim (see Design).
SHARES_PER_THREAD = RL_SHARES_PER_THREAD

#: Below this much memory traffic per thread, a loop uses fewer threads: waking
#: a worker costs a few microseconds when idle and a scheduler slice when the
#: machine is busy, and a chunk checksummed by the caller alone is still in its
#: cache when it parses the records.  Measured on this 2-core machine (shared
#: with other jobs, so noisy; `python benchmarks/bench_contention.py --no-chains
#: --sweep`, cold data, table in benchmarks/RESULTS.md "Threads on a shared
#: machine"), best of 5, 1 vs 2 threads, no competitor: crc32c 256 KiB 20.3 vs
#: 23.2 us, 1 MiB 78.4 vs 88.9 us, 4 MiB 403 vs 244 us; gather 1 MiB 239 vs
#: 392 us, 4 MiB 924 vs 974 us.  So a split pays from a few MiB: 1 MiB per
#: thread (the kernels' old threshold too).  A default 1 MiB RecordIO chunk is
#: checksummed on one thread; a 16 MiB batch of 64 KiB records is copied on two.
MIN_BYTES_PER_THREAD = 1 << 20
cdef int64_t _min_bytes_per_thread = MIN_BYTES_PER_THREAD


# ---- the thread count -------------------------------------------------------------

def _cgroup_cpu_limit(root="/sys/fs/cgroup"):
    """CPUs allowed by a cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    rounded up; None when there is no quota (or no cgroup file)."""
    candidates = [(os.path.join(root, "cpu.max"), None)]
    for sub in ("cpu", "cpu,cpuacct"):
        candidates.append((os.path.join(root, sub, "cpu.cfs_quota_us"),
                           os.path.join(root, sub, "cpu.cfs_period_us")))
    for quota_path, period_path in candidates:
        try:
            with open(quota_path) as f:
                text = f.read().split()
            if period_path is None:          # v2: "<quota|max> <period>"
                quota, period = text[0], text[1] if len(text) > 1 else "100000"
            else:                            # v1: two files, quota -1 = none
                with open(period_path) as f:
                    period = f.read().strip()
                quota = text[0]
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            q, p = int(quota), int(period)
        except ValueError:
            continue
        if q > 0 and p > 0:
            return max(1, math.ceil(q / p))
    return None


def _positive_int_env(environ, name, strict):
    """``environ[name]`` as an int >= 1; None when unset.  Invalid: ValueError when
    ``strict``, else ignored (OpenMP ignores an invalid OMP_NUM_THREADS too)."""
    v = environ.get(name, "").strip()
    if not v:
        return None
    if name == "OMP_NUM_THREADS":
        v = v.split(",")[0].strip()       # a nesting list: the outermost level
    try:
        n = int(v)
        if n < 1:
            raise ValueError
    except ValueError:
        if strict:
            raise ValueError(f"{name} must be a positive integer, got {environ[name]!r}") from None
        return None
    return n


def _default_num_threads(environ=None, affinity=None, cgroup_root="/sys/fs/cgroup",
                         cpu_count=None):
    """The default thread count (scikit-learn's ``_openmp_effective_n_threads``).

    ``READERLIB_NUM_THREADS`` if set (highest priority, used as given, at most
    MAX_THREADS); else the usable CPUs, ``len(sched_getaffinity(0))`` capped by
    the cgroup CPU quota, further capped by ``OMP_NUM_THREADS`` if set.  The
    arguments exist for tests: an environment mapping, an affinity set, a
    cgroup directory, a CPU count for platforms without affinity.
    """
    environ = os.environ if environ is None else environ
    n = _positive_int_env(environ, "READERLIB_NUM_THREADS", strict=True)
    if n is not None:
        return min(n, RL_MAX_THREADS)
    if affinity is None and hasattr(os, "sched_getaffinity"):
        affinity = os.sched_getaffinity(0)
    cpus = len(affinity) if affinity is not None else (cpu_count or os.cpu_count() or 1)
    quota = _cgroup_cpu_limit(cgroup_root)
    if quota is not None:
        cpus = min(cpus, quota)
    omp = _positive_int_env(environ, "OMP_NUM_THREADS", strict=False)
    if omp is not None:
        cpus = min(cpus, omp)
    return max(1, min(cpus, RL_MAX_THREADS))


cdef int _num_threads = _default_num_threads()


def _check_count(n, what):
    import numbers
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"{what} must be an int, got {type(n).__name__}")
    if not 1 <= n <= RL_MAX_THREADS:
        raise ValueError(f"{what} must be in [1, {RL_MAX_THREADS}], got {n}")
    return int(n)


def set_num_threads(n):
    """Set how many threads readerlib's compiled code may use for one loop.

    Applies to every parallel section: RecordIO chunk checksums, batch copies
    of big records, and the batch_reindex / ctc_greedy_decoder / RNN-T
    kernels called without ``num_threads=``.  Small loops use fewer threads.

    Parameters
    ----------
    n : int
        1 to ``MAX_THREADS``.  1 runs everything on the calling thread.

    Raises
    ------
    TypeError, ValueError
        ``n`` is not an int in range.

    Examples
    --------
    >>> import readerlib as rl
    >>> old = rl.get_num_threads(); rl.set_num_threads(1); rl.set_num_threads(old)
    """
    global _num_threads
    _num_threads = _check_count(n, "num_threads")


def get_num_threads():
    """The thread count readerlib's parallel sections use (see set_num_threads).

    Default: ``READERLIB_NUM_THREADS``, else the CPUs this process may use
    (affinity and cgroup CPU quota), capped by ``OMP_NUM_THREADS``.
    """
    return _num_threads


def threads_enabled():
    """False when readerlib was built with READERLIB_NO_THREADS=1 (every loop serial)."""
    return bool(RL_THREADS_ENABLED)


def _threads_for_py(work_bytes):
    """threads_for(work_bytes), for the Python-level kernels and tests."""
    return threads_for(work_bytes)


def _set_min_bytes_per_thread(n):
    """Change the split threshold (benchmarks' sweep; returns the old value)."""
    global _min_bytes_per_thread
    old = _min_bytes_per_thread
    _min_bytes_per_thread = max(1, int(n))
    return old


def _losing_splits():
    """Parallel loops so far that lost against one thread (and started a serial
    back-off).  Benchmarks and tests."""
    return rl_pool_losing_splits()


def _reset_backoff():
    """Forget past losing splits (tests that need the next loop to split)."""
    rl_pool_reset_backoff()


def _moved_workers():
    """Workers moved off the caller's CPU so far (see Design, "Placement").  Test hook."""
    return rl_pool_moved_workers()


def _set_placement(flag):
    """Switch the placement rule (Design, "Placement") on or off; returns the old
    value.  Benchmarks' A/B; not thread-safe with a loop in flight."""
    global rl_pool_placement
    old = bool(rl_pool_placement)
    rl_pool_placement = 1 if flag else 0
    return old


def _pool_workers():
    """Worker threads this process has started (0 until the first parallel loop;
    0 again right after fork() in the child).  Test hook."""
    return rl_pool_workers()


cdef void parallel_for(int n_threads, int64_t n_items, rl_body_fn body, void *ctx) noexcept nogil:
    rl_parallel_for(n_threads, n_items, body, ctx)


cdef void place_late_workers() noexcept nogil:
    rl_pool_place_late_workers()


cdef int num_threads() noexcept nogil:
    return _num_threads


cdef int threads_for(int64_t work_bytes) noexcept nogil:
    cdef int64_t n = work_bytes // _min_bytes_per_thread
    if n < 1:
        return 1
    return <int>n if n < _num_threads else _num_threads


# ---- test hook: run a loop that records who ran each item ------------------------

cdef extern from *:
    """
    static inline void rl_atomic_inc_i64(int64_t *p) { __atomic_add_fetch(p, 1, __ATOMIC_RELAXED); }
    static inline void rl_burn(int64_t n) { volatile int64_t x = 0; while (n-- > 0) x += n; }
    """
    void _rl_atomic_inc "rl_atomic_inc_i64"(int64_t *p) noexcept nogil
    void rl_burn(int64_t n) noexcept nogil


cdef void _probe_nested(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef int *out = <int *>ctx
    if tid > out[0]:
        out[0] = tid


cdef struct _probe_ctx:
    int *tids
    int64_t *calls
    int nested_threads
    int64_t work
    int slow_tid


cdef void _probe_body(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _probe_ctx *c = <_probe_ctx *>ctx
    cdef int64_t i
    cdef int inner_tid = -1
    _rl_atomic_inc(c.calls)
    if c.nested_threads > 1:   # a nested loop must run serially on this thread
        parallel_for(c.nested_threads, 4, _probe_nested, &inner_tid)
    for i in range(begin, end):
        rl_burn(c.work * 50 if tid == c.slow_tid else c.work)
        c.tids[i] = tid if inner_tid <= 0 else -100 - inner_tid


def _parallel_for_py(int n_threads, int64_t n_items, int nested_threads=0, int64_t work=0,
                     int slow_tid=-1):
    """Run a probe loop; return (tid of the thread that ran each item, number of
    ranges run).  Each item spins ``work`` iterations (50x on thread
    ``slow_tid``: a stand-in for a descheduled worker); a nested loop of
    ``nested_threads`` marks items whose nested loop did not run serially
    (tid <= -101).  Test hook."""
    import numpy as np
    tids = np.full(max(n_items, 0), -1, dtype=np.intc)
    cdef int[::1] tv = tids
    cdef int64_t calls = 0
    cdef _probe_ctx c
    c.tids = &tv[0] if n_items > 0 else NULL
    c.calls = &calls
    c.nested_threads = nested_threads
    c.work = work
    c.slow_tid = slow_tid
    with nogil:
        parallel_for(n_threads, n_items, _probe_body, &c)
    return tids, calls


# --------------------------------------------------- Python threads, started whole
# threading.Thread.start() is Python code: on the main thread a pending
# signal's handler runs inside it, and a KeyboardInterrupt there leaves a
# thread that may or may not run (started before Event.wait, or left in
# threading's limbo), which join() then refuses ("cannot join thread before
# it is started") and whose work never comes (open_files waits on a worker
# that does not exist).  start_threads() runs the start() calls on a launcher
# thread -- signal handlers run only on the main thread -- while the caller
# waits in C, GIL released, where no handler runs: every thread is started,
# or start() raised its own error, and a pending KeyboardInterrupt comes at
# the caller's next Python call, after the threads are consistent.
from readerlib._sync cimport (pthread_mutex_t, pthread_cond_t, pthread_mutex_init, pthread_mutex_destroy,
                              pthread_mutex_lock, pthread_mutex_unlock, pthread_cond_init,
                              pthread_cond_destroy, pthread_cond_wait, pthread_cond_broadcast)
import _thread
import sys as _sys
import threading as _threading

cdef extern from "Python.h":
    int PyGC_Enable()               # (3.10+) each returns whether the collector was enabled
    int PyGC_Disable()

# start_threads calls that turned the collector off and have not turned it back
# on: a process forked meanwhile (from another thread) has no such call left to
# do it, so its child turns it back on (else it ran with no cyclic collection)
cdef int _gc_held = 0


def _gc_after_fork_in_child():
    global _gc_held
    if _gc_held:
        _gc_held = 0
        PyGC_Enable()


import os as _os
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_gc_after_fork_in_child)


cdef class _Launch:
    cdef pthread_mutex_t mu
    cdef pthread_cond_t cv
    cdef int done
    cdef object threads
    cdef object error

    def __cinit__(self):
        pthread_mutex_init(&self.mu, NULL)
        pthread_cond_init(&self.cv, NULL)

    def __dealloc__(self):
        pthread_cond_destroy(&self.cv)
        pthread_mutex_destroy(&self.mu)

    def run(self):
        try:
            for t in self.threads:
                t.start()
        except BaseException as e:
            self.error = e
        finally:
            with nogil:
                pthread_mutex_lock(&self.mu)
                self.done = 1
                pthread_cond_broadcast(&self.cv)
                pthread_mutex_unlock(&self.mu)


def start_threads(threads):
    """Start each threading.Thread of `threads`, never half-way: on the main
    thread the start() calls run on a launcher thread while this one waits
    with the GIL released (see above); elsewhere (no signal handler runs
    there) they run here.  Raises what a start() raised; threads before it
    are started.

    The cyclic collector is off while they start: a collection triggered on
    the launcher, or on a new thread before its start() returns, ran the
    garbage's finalizers there, and one that took a lock the caller holds
    (a reader's RLock, which the reading thread holds in read_next: a
    weakref.finalize or __del__ that closes the reader) blocked for good
    with the caller waiting for that start (tests/readers/test_review10.py).
    The collection comes at the caller's next allocation instead."""
    global _gc_held
    cdef _Launch L
    cdef int gc_was
    threads = list(threads)
    if not threads:
        return
    if _sys.is_finalizing():
        # (3.11) a thread made now exits as it first takes the GIL, before
        # its start() returns: this wait, and start()'s own, never ended
        raise RuntimeError("readerlib: can't start a thread at interpreter shutdown "
                           "(a reader first read from a finalizer that ran at exit)")
    L = None
    gc_was = PyGC_Disable()
    _gc_held += gc_was
    try:
        if _thread.get_ident() != _threading.main_thread().ident:
            for t in threads:
                t.start()
        else:
            L = _Launch()
            L.threads = threads
            _thread.start_new_thread(L.run, ())
            with nogil:
                pthread_mutex_lock(&L.mu)
                while not L.done:
                    pthread_cond_wait(&L.cv, &L.mu)
                pthread_mutex_unlock(&L.mu)
    finally:
        if gc_was and _gc_held:
            _gc_held -= 1
            PyGC_Enable()
    if L is not None and L.error is not None:
        raise L.error
