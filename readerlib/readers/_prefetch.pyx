# cython: freethreading_compatible=False
"""PrefetchReader: run the chain below in a background thread (Paddle's double buffer).

Design:
    One *run* = one background thread + one `_pf_state` (a bounded ring of
    `capacity` records, a pthread mutex and two condition variables).  The
    thread (a daemon `threading.Thread`) loops, with the GIL released:

        wait until the ring has room (or stop)  ->  upstream.c_next(&rec)
        ->  rl_block_incref(rec.block)  ->  push (publish `produced`)

    so the ring holds *references* to the records the chain produced (no
    copy) and at most `capacity` of them (a full ring waits until it has
    drained to capacity // 2, then refills in a burst: fewer wake-ups): the
    thread asks for the next item only when there is room, so memory is
    bounded by capacity + the item the consumer holds.  The consumer's
    `c_next` pops the oldest record and keeps its reference until its next
    call (the LoDTensors returned by `read_next` take their own reference on
    the block, so they stay valid); references to one block handed out in a
    row are dropped together when the block changes.

    Items move through the ring without the mutex (two counters, one per
    side: see "The ring" below), so an item costs no lock, no signal and no
    wake-up: a prefetcher below a batch passes every instance through it.
    The mutex and the condition variables are for sleeping and for the
    run's flags.

    Waits happen on the pthread condition variables with the GIL released:
    neither side holds the GIL while blocked, and the thread never asks for
    the GIL while it holds the ring mutex (so no lock-order deadlock, and a
    thread killed by interpreter finalisation never dies holding the mutex).
    The consumer waits in 100 ms slices and checks for signals between them,
    so Ctrl-C interrupts a consumer waiting on a stalled chain.

    Ending a run: `stop` (under the mutex) + broadcast; the thread sees it
    between items (or while waiting for room) and exits.  The thread holds
    only the run (`_Pump`) and the chain below, never the PrefetchReader, so
    dropping the last reference to a PrefetchReader stops its thread (from
    `__dealloc__`, through a C pointer that survives GC's tp_clear).
    `reset()` stops and joins the thread, releases the ring and resets the
    chain below; the next run starts with the next read (so `set_state()`
    can adjust the chain below in between).  The first run starts at
    construction, so the first batches are ready when the loop begins.  `close()` joins for at most a few seconds;
    a thread stuck inside a user function is left to exit on its own and
    closes the chain below itself when it does.

    Errors: an exception raised by the chain in the thread stops the run; it
    is kept (with its traceback) and raised in the consumer once, after the
    items produced before it, by the next `read_next()`; the read after that
    resumes the run, which reads on from where the chain stands -- as the
    chain without a prefetcher does (a data error raised once, then the next
    chunk or file; the item after one a map function raised on).  It is the same
    exception object, so its type, message (file, offset, instance index) and
    original frames are intact.

    The thread runs under SCHED_BATCH on Linux (no wake-up preemption of
    the training step; see `_deprioritise_wakeups`).

    Runs are per thread: a thread that could not be stopped keeps its own
    ring, so a new run never shares memory with it.  After `fork()` the
    child has no thread; a run that was live is marked and must be `reset()`.
"""
import atexit
import os
import threading
import weakref
from collections import deque

import numpy as np

from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from cpython.exc cimport PyErr_CheckSignals as _check_signals    # (raises: except -1)

from readerlib._typedefs cimport int64_t
from readerlib._sync cimport (
    pthread_mutex_t, pthread_cond_t, pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_lock,
    pthread_mutex_unlock, pthread_cond_destroy, pthread_cond_broadcast, pthread_cond_signal,
    pthread_cond_wait, cond_init_monotonic, cond_wait_until, now_ns as _now_ns,
    __atomic_add_fetch, __atomic_sub_fetch, __ATOMIC_RELAXED, __ATOMIC_ACQ_REL)
from readerlib.readers._base cimport (
    ReaderBase, DecoratedReader, rl_block, rl_record, rl_block_incref, rl_block_decref,
    ITEM_BATCH, ITEM_INSTANCE, rl_core_import)
from readerlib.readers._base import (_check_positive_int, _check_reader, _epoch_step, _pump_of_thread,
                                     _restore_epoch_states)
from readerlib._parallel import start_threads
from readerlib.tensor import LoDTensor

rl_core_import()

__all__ = ["PrefetchReader"]


cdef extern from "Python.h":
    ctypedef struct PyThreadState:
        pass
    int PyGILState_Check() nogil
    int PyErr_CheckSignals()            # no `except`: the caller restores its thread state first
    PyThreadState *PyEval_SaveThread() nogil
    void PyEval_RestoreThread(PyThreadState *) nogil


# ------------------------------------------------------------- run state
cdef extern from *:
    """
    /* The ring's counters and flags, read without the mutex (readerlib/readers/_prefetch.pyx). */
    static inline int64_t pf_load_acq(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline int64_t pf_load_sc(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline int64_t pf_load_rlx(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void pf_store_sc(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline void pf_store_rlx(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    static inline int pf_iload_sc(const int *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
    static inline int pf_iload_rlx(const int *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
    static inline void pf_istore_sc(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
    static inline void pf_istore_rlx(int *p, int v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
    /* Drop n references to b at once (rl_block_decref n times). */
    static inline void pf_block_decref_n(rl_block *b, int64_t n) {
        if (b && __atomic_sub_fetch(&b->refcnt, n, __ATOMIC_ACQ_REL) == 0) b->release(b);
    }
    """
    int64_t pf_load_acq(const int64_t *p) nogil
    int64_t pf_load_sc(const int64_t *p) nogil
    int64_t pf_load_rlx(const int64_t *p) nogil
    void pf_store_sc(int64_t *p, int64_t v) nogil
    void pf_store_rlx(int64_t *p, int64_t v) nogil
    int pf_iload_sc(const int *p) nogil
    int pf_iload_rlx(const int *p) nogil
    void pf_istore_sc(int *p, int v) nogil
    void pf_istore_rlx(int *p, int v) nogil
    void pf_block_decref_n(rl_block *b, int64_t n) nogil


# The ring is a single-producer single-consumer queue on two counters:
# `produced` (written by the thread only) and `popped` (by the consumer only);
# item i is in slot i & mask and the ring holds produced - popped <= cap items.
# An item moves without the mutex: the thread writes the slot, then publishes
# `produced`; the consumer reads the slot, then publishes `popped`.
#
# Waiting.  A side that has to wait (the consumer on an empty ring, the
# thread on a full one) posts what it waits for in its `*_need` (a value of
# the other side's counter), sets its `*_sleeping` under the mutex and sleeps
# on its condition variable; the other side, on publishing its counter, looks
# at the need and, once it is reached, clears it and signals ("rings"): one
# wake-up per wait, never a mutex or a signal per item.  A store of a counter
# or a need and the load of the other that follows are seq_cst, so of two
# sides racing, one sees the other.  A full ring waits until it has drained
# to capacity // 2 (the thread then refills in a burst: one wake-up per
# capacity // 2 items, and the slots' cache lines move between the cores in
# runs); an empty one wakes at the first item.
#
# (Measured, benchmarks/results/prefetch.md: spinning before sleeping, on
# either side, and waking the consumer only for a run of items both cost
# more CPU per item on the 2 shared cores here than they saved.)
cdef struct pf_state:
    pthread_mutex_t mu
    pthread_cond_t not_empty        # consumer sleeps: items arrived or the run ended
    pthread_cond_t not_full         # producer sleeps: room in the ring or stop
    rl_record *ring
    int64_t cap                     # the ring holds at most cap items
    int64_t mask                    # slots - 1 (slots: cap rounded up to a power of two)
    int64_t low_water               # a full ring waits until it has drained to this
    int seen_end                    # the consumer was told the run ended (end or error)
    int64_t noted                   # epoch steps the thread noted (_Pump._note_epoch_step)
    int64_t mark                    # the first noted epoch step (_Pump.log) the consumer has
                                    # not gone past: item `mark` comes after it (-1: none)
    int64_t refcnt                  # owners: the PrefetchReader (current run) and the _Pump
    int stop                        # consumer -> producer: exit between items
    int done                        # producer -> consumer: no more items (end, error or stop)
    int failed                      # the run ended with an exception (kept on the _Pump)
    int finished                    # the thread has left the chain for good
    int close_upstream              # close() gave up joining: the thread closes the chain
    int forked                      # this process forked while the run was live
    char _pad0[64]
    int64_t produced                # items pushed in this run (the thread writes it)
    char _pad1[64]
    int64_t popped                  # items the consumer took in this run (the consumer writes it)
    int64_t limit                   # the consumer may take items below this without looking
                                    # at `produced` or `mark` again (consumer only)
    char _pad2[64]
    int64_t prod_need               # the thread waits for popped >= this (0: it does not)
    int prod_sleeping               # ... asleep on not_full (or about to be)
    char _pad3[64]
    int64_t cons_need               # the consumer waits for produced >= this (0: it does not)
    int cons_sleeping               # ... asleep on not_empty (or about to be)
    char _pad4[64]


# Return codes of _pf_pop.
cdef enum:
    POP_ITEM = 1
    POP_END = 0
    POP_ERROR = -2
    POP_TIMEOUT = -3
    POP_FORKED = -4
    POP_EMPTY = -5                  # non-blocking pop found nothing yet
    POP_SLICE = -6                  # a wait slice elapsed (check signals, go on)
    POP_MARK = -7                   # the next item (or the end) comes after a noted epoch
                                    # step: _cross_mark first (nothing was taken)

cdef int64_t SLICE_NS = 100000000   # 100 ms: how often a waiting consumer checks for Ctrl-C


cdef pf_state *_pf_new(int64_t cap) except NULL:
    cdef pf_state *st = <pf_state *>calloc(1, sizeof(pf_state))
    cdef int64_t slots = 1
    if st == NULL:
        raise MemoryError()
    while slots < cap:
        slots *= 2
    st.ring = <rl_record *>calloc(slots, sizeof(rl_record))
    if st.ring == NULL:
        free(st)
        raise MemoryError(f"prefetch ring of {cap} items")
    st.cap = cap
    st.mask = slots - 1
    st.low_water = cap // 2
    st.mark = -1
    st.refcnt = 1
    _pf_init_sync(st)
    return st


cdef void _pf_init_sync(pf_state *st) noexcept nogil:
    pthread_mutex_init(&st.mu, NULL)
    cond_init_monotonic(&st.not_empty)       # deadlines immune to wall-clock jumps
    cond_init_monotonic(&st.not_full)


cdef void _pf_drain(pf_state *st) noexcept nogil:
    """Drop the ring's references (the thread is gone or never ran; the
    caller holds the mutex or owns the state alone)."""
    cdef int64_t i, end = pf_load_acq(&st.produced)
    for i in range(st.popped, end):
        rl_block_decref(st.ring[i & st.mask].block)
        st.ring[i & st.mask].block = NULL
    pf_store_sc(&st.popped, end)
    st.limit = end


cdef void _pf_incref(pf_state *st) noexcept nogil:
    __atomic_add_fetch(&st.refcnt, 1, __ATOMIC_RELAXED)


cdef void _pf_decref(pf_state *st) noexcept nogil:
    if st != NULL and __atomic_sub_fetch(&st.refcnt, 1, __ATOMIC_ACQ_REL) == 0:
        _pf_drain(st)
        pthread_cond_destroy(&st.not_empty)
        pthread_cond_destroy(&st.not_full)
        pthread_mutex_destroy(&st.mu)
        free(st.ring)
        free(st)


cdef void _pf_request_stop(pf_state *st) noexcept nogil:
    pthread_mutex_lock(&st.mu)
    pf_istore_rlx(&st.stop, 1)
    pthread_cond_broadcast(&st.not_full)
    pthread_cond_broadcast(&st.not_empty)
    pthread_mutex_unlock(&st.mu)


# -- waiting (either side)
cdef void _pf_ring(pf_state *st, int64_t *need, int *sleeping, pthread_cond_t *cond) noexcept nogil:
    """The other side waits for what this side just published: clear its need
    (no second ring) and wake it if it sleeps."""
    pf_store_sc(need, 0)
    if pf_iload_sc(sleeping):
        pthread_mutex_lock(&st.mu)
        pthread_cond_signal(cond)
        pthread_mutex_unlock(&st.mu)


# -- the consumer's side (one consumer at a time: the chain's lock)
cdef inline bint _pf_take(pf_state *st, rl_record *out) noexcept nogil:
    """Take the next item if it is known to be there (no mutex, no wait)."""
    cdef int64_t i = st.popped, need
    if i >= st.limit:
        return False
    out[0] = st.ring[i & st.mask]
    i += 1
    pf_store_sc(&st.popped, i)                # the slot is the thread's again
    need = pf_load_sc(&st.prod_need)
    if need != 0 and i >= need:
        _pf_ring(st, &st.prod_need, &st.prod_sleeping, &st.not_full)
    return True


cdef inline void _pf_refresh(pf_state *st) noexcept nogil:
    """How far the consumer may take items: up to what the thread published,
    and not past the next noted epoch step (POP_MARK comes first).  A mark
    noted after this is at or past `produced` as read here."""
    cdef int64_t p = pf_load_acq(&st.produced)
    cdef int64_t m = pf_load_rlx(&st.mark)    # (set before the item at it was published)
    if m >= 0 and m < p:
        p = m if m > st.popped else st.popped
    st.limit = p


cdef int _pf_pop(pf_state *st, rl_record *out, int64_t deadline_ns, bint blocking) noexcept nogil:
    """Pop the oldest item into `out` (the ring's reference moves to the caller).

    Waits at most one slice, and never past `deadline_ns` (-1: none).
    """
    cdef int64_t until, p
    cdef int code
    if not st.forked:
        if _pf_take(st, out):
            return POP_ITEM
        _pf_refresh(st)
        if _pf_take(st, out):
            return POP_ITEM
    pthread_mutex_lock(&st.mu)
    if blocking and not st.done and not st.forked and pf_load_acq(&st.produced) == st.popped:
        until = _now_ns() + SLICE_NS
        if deadline_ns >= 0 and deadline_ns < until:
            until = deadline_ns
        pf_store_sc(&st.cons_need, st.popped + 1)
        pf_istore_sc(&st.cons_sleeping, 1)
        while not st.done and not st.forked and pf_load_sc(&st.produced) == st.popped:
            if cond_wait_until(&st.not_empty, &st.mu, until) != 0 and _now_ns() >= until:
                break
        pf_istore_rlx(&st.cons_sleeping, 0)
        pf_store_rlx(&st.cons_need, 0)
    p = pf_load_acq(&st.produced)
    if st.forked:
        code = POP_FORKED
    elif st.mark >= 0 and st.mark <= st.popped and (p > st.popped or st.done):
        code = POP_MARK
    elif p > st.popped:
        code = POP_ITEM                         # taken below (a take may ring: the mutex)
    elif st.done:
        code = POP_ERROR if st.failed else POP_END
        st.seen_end = 1
    elif not blocking:
        code = POP_EMPTY
    elif deadline_ns >= 0 and _now_ns() >= deadline_ns:
        code = POP_TIMEOUT
    else:
        code = POP_SLICE
    pthread_mutex_unlock(&st.mu)
    if code == POP_ITEM:
        _pf_refresh(st)
        _pf_take(st, out)
    return code


# -- the thread's side
cdef inline void _pf_publish(pf_state *st, int64_t produced) noexcept nogil:
    cdef int64_t need
    pf_store_sc(&st.produced, produced)
    need = pf_load_sc(&st.cons_need)
    if need != 0 and produced >= need:
        _pf_ring(st, &st.cons_need, &st.cons_sleeping, &st.not_empty)


cdef bint _pf_wait_room(pf_state *st, int64_t produced) noexcept nogil:
    """The ring is full: wait until the consumer has drained it to low water,
    then refill in a burst.  False: told to stop."""
    cdef int64_t target = produced - st.low_water     # popped >= target: drained enough
    cdef bint stopped
    pthread_mutex_lock(&st.mu)
    pf_store_sc(&st.prod_need, target)
    pf_istore_sc(&st.prod_sleeping, 1)
    while not st.stop and pf_load_sc(&st.popped) < target:
        pthread_cond_wait(&st.not_full, &st.mu)
    pf_istore_rlx(&st.prod_sleeping, 0)
    pf_store_rlx(&st.prod_need, 0)
    stopped = st.stop
    pthread_mutex_unlock(&st.mu)
    return not stopped


# ------------------------------------------------------------------- a run
# id(pump) -> weakref.ref(pump), without a callback: each pump takes itself out
# in __dealloc__ (C only).  Not a WeakSet: its Python callback ran at every
# pump's dealloc, and a signal handler's KeyboardInterrupt raised inside it
# was swallowed ("Exception ignored in ... WeakSet"): a lost Ctrl-C.
_live_pumps = {}


def _pumps_alive():
    return [p for p in (r() for r in list(_live_pumps.values())) if p is not None]


cdef class _Pump:
    """One background run: the thread, its ring, and what it ended with."""
    cdef pf_state *st
    cdef readonly ReaderBase upstream
    cdef readonly object thread
    cdef readonly object error
    cdef object error_tb
    cdef object __weakref__
    # The passes this run's thread started below (a multi_pass or repeat's c_reset
    # of the reader below, _note_epoch_step): [(item, the epoch state of the chain
    # below before it)], the item being made then -- it comes after the step --
    # in increasing order, one (the earliest) an item; rebound, never changed.
    cdef list log
    cdef object start_view          # the chain's epoch state when a run starts an epoch, or None

    def __cinit__(self, ReaderBase upstream, int64_t cap):
        self.st = _pf_new(cap)
        self.upstream = upstream
        self.log = []

    def _note_epoch_step(self):
        """On this run's thread, a reader below is about to start a pass (c_reset
        below it): its consumer has not got there, so note the chain's epoch
        state before the step, at the item being made.  Once a pass, not an item."""
        cdef pf_state *st = self.st
        cdef int64_t at, keep
        with nogil:
            at = st.produced                    # (this thread writes it)
            keep = pf_load_rlx(&st.popped) - st.cap - 1     # (a device stager holds popped items back)
        log = self.log
        if log and log[len(log) - 1][0] == at:
            return                              # the state before the first step to item `at` counts
        snap = self.upstream._chain_epoch_state(False)
        self.log = [e for e in log if e[0] >= keep] + [(at, snap)]
        with nogil:
            pthread_mutex_lock(&st.mu)
            st.noted += 1
            if st.mark < 0:
                pf_store_rlx(&st.mark, at)      # (before item `at` is published: _pf_refresh)
            pthread_mutex_unlock(&st.mu)

    def __dealloc__(self):
        live = _live_pumps
        if live is not None:                # (None: the module torn down at exit)
            live.pop(id(self), None)
        _pf_decref(self.st)
        self.st = NULL

    def start(self, name):
        t = threading.Thread(target=self._run, name=name, daemon=True)
        _live_pumps[id(self)] = weakref.ref(self)
        try:
            start_threads((t,))     # (a KeyboardInterrupt never leaves it half-started)
        except BaseException:
            with nogil:             # not started: no thread is inside (a resumed run's flag)
                pthread_mutex_lock(&self.st.mu)
                self.st.finished = 1
                pthread_mutex_unlock(&self.st.mu)
            raise
        self.thread = t

    # Whether the thread is still inside the chain is `finished` (set by the
    # thread, under the mutex, as it leaves), never Thread.is_alive() or
    # Thread.join(): on CPython 3.11 a join() that Ctrl-C interrupts while the
    # thread runs marks that thread stopped (threading's bpo-45274 mend
    # releases the running thread's own lock), so the next join() returned at
    # once and is_alive() said False while the thread was still reading the
    # chain -- a retried reset() then reset the chain under it: a batch block
    # freed while the thread copied into it (AddressSanitizer: use after free;
    # glibc: "unaligned tcache chunk detected" as the thread exited), records lost.
    def _inside(self):
        """Whether this run's thread may still be inside the chain (started and not left)."""
        cdef pf_state *st = self.st
        cdef bint left
        if self.thread is None:
            return False
        with nogil:
            pthread_mutex_lock(&st.mu)
            left = st.finished or st.forked
            pthread_mutex_unlock(&st.mu)
        return not left

    def _wait_left(self, timeout):
        """Wait until the thread has left the chain, at most `timeout` seconds
        (None: as long as it takes), with the GIL released; Ctrl-C raises.
        Returns whether it left."""
        cdef pf_state *st = self.st
        cdef int64_t deadline = -1, until
        cdef bint left = False
        if self.thread is None:
            return True
        if timeout is not None:
            deadline = _now_ns() + <int64_t>(max(float(timeout), 0.0) * 1e9)
        while True:
            with nogil:
                pthread_mutex_lock(&st.mu)
                until = _now_ns() + SLICE_NS
                if deadline >= 0 and deadline < until:
                    until = deadline
                while not st.finished and not st.forked:
                    if cond_wait_until(&st.not_empty, &st.mu, until) != 0 and _now_ns() >= until:
                        break
                left = st.finished or st.forked
                pthread_mutex_unlock(&st.mu)
            if left:
                return True
            if deadline >= 0 and _now_ns() >= deadline:
                return False
            _check_signals()                 # Ctrl-C while waiting for a thread in a slow function

    cdef int _loop(self) except -1 nogil:
        cdef pf_state *st = self.st
        cdef rl_record rec
        cdef int r
        cdef int64_t produced = st.produced     # (only this thread writes it; a resumed run goes on)
        cdef int64_t popped = pf_load_acq(&st.popped)
        while True:
            if pf_iload_rlx(&st.stop):
                return 0
            if produced - popped >= st.cap:
                popped = pf_load_acq(&st.popped)
                if produced - popped >= st.cap:
                    if not _pf_wait_room(st, produced):
                        return 0
                    popped = pf_load_acq(&st.popped)
            r = self.upstream.c_next(&rec)      # may take the GIL (Python sources, chunk loads)
            if r == 0:
                return 0
            rl_block_incref(rec.block)
            # pushed even when told to stop (there is room: only this thread
            # adds): the item has left the chain, and a c_skip that stops the
            # run to skip below counts it (a reset or close drops it with the ring)
            st.ring[produced & st.mask] = rec
            produced += 1
            _pf_publish(st, produced)

    def _run(self):
        cdef pf_state *st = self.st
        cdef int failed = 0, close_upstream
        me = threading.get_ident()
        _pump_of_thread[me] = self              # (the passes it starts are noted: _epoch_step)
        _deprioritise_wakeups()
        try:
            with nogil:
                self._loop()
        except BaseException as e:       # re-raised in the consumer, never lost here
            self.error = e
            self.error_tb = e.__traceback__
            failed = 1
        finally:
            _pump_of_thread.pop(me, None)
        with nogil:
            pthread_mutex_lock(&st.mu)
            pf_istore_rlx(&st.done, 1)
            st.failed = failed
            st.finished = 1
            close_upstream = st.close_upstream
            pthread_cond_broadcast(&st.not_empty)
            pthread_mutex_unlock(&st.mu)
        if close_upstream:
            self.upstream.close()

    cdef bint stop_and_join(self, timeout) except -1:
        """Ask the thread to stop and wait until it has left the chain (see
        _inside); False if it is still inside after `timeout` seconds."""
        _pf_request_stop(self.st)
        if self.st.forked or self.thread is None:
            return True
        if not self._wait_left(timeout):
            return False
        self.thread.join(timeout)       # (out of the chain: it ends at once; a stopped run is joined)
        return True

    cdef bint hand_over_close(self):
        """close() could not join: let the thread close the chain when it leaves it.

        Returns True if the thread already left (the caller closes the chain).
        """
        cdef bint left
        with nogil:
            pthread_mutex_lock(&self.st.mu)
            left = self.st.finished or self.st.forked
            if not left:
                self.st.close_upstream = 1
            pthread_mutex_unlock(&self.st.mu)
        return left

    def _after_fork_in_child(self):
        # The thread does not exist in the child and may have held the mutex.
        _pf_init_sync(self.st)
        self.st.forked = 1
        self.st.done = 1
        self.st.limit = self.st.popped          # (the consumer looks at `forked` first)
        self.st.prod_need = 0
        self.st.cons_need = 0
        self.st.prod_sleeping = 0
        self.st.cons_sleeping = 0
        self.thread = None


def _deprioritise_wakeups():
    """Put the calling (prefetch) thread under SCHED_BATCH, where Linux supports it.

    Measured on a 2-core machine: when the ring drains to low water the
    consumer wakes this thread, and the scheduler tends to run the woken
    thread on the waker's core *right away*, preempting the training step in
    the middle of `read_next()` (waits of ~0.5-1 ms per step with a CPU-bound
    step).  SCHED_BATCH keeps the thread's fair share of CPU but gives up
    wake-up preemption, so it runs on idle time or another core instead.
    READERLIB_PREFETCH_SCHED=normal turns this off.
    """
    if os.environ.get("READERLIB_PREFETCH_SCHED", "batch") != "batch":
        return
    if hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))   # 0: this thread
        except OSError:
            pass


def _stop_all_at_exit():
    """Stop every live thread before finalisation, so none is cut off mid-item."""
    pumps = _pumps_alive()
    for p in pumps:
        _pf_request_stop((<_Pump>p).st)
    for p in pumps:
        t = (<_Pump>p).thread
        if t is not None and t.is_alive():
            t.join(0.5)


def _reinit_after_fork():
    _pump_of_thread.clear()                  # (no thread of the parent's runs lives here)
    for p in _pumps_alive():
        p._after_fork_in_child()


atexit.register(_stop_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


cdef double _CLOSE_JOIN_S = 0.5     # close() waits this long for a thread inside a slow user function
_NOT_READY = object()


# ------------------------------------------------------------ the reader
cdef class PrefetchReader(DecoratedReader):
    """Read the chain below in a background thread, `capacity` items ahead.

    The thread runs the compiled chain with the GIL released and keeps up to
    `capacity` items (usually batches) ready as references to the chain's
    blocks (no copy), so a training step overlaps reading the next batches.
    Items come out exactly as the chain below yields them, in the same order.

    Parameters
    ----------
    reader : ReaderBase
        The chain to run in the background.  The prefetcher owns it: reading,
        resetting or saving the state of `reader` (or of a reader below it, or
        another reader built on those) raises RuntimeError while the
        prefetcher is open; closing one of them closes the prefetcher first.
    capacity : int, default 2
        Items kept ready (2 is Paddle's double buffer).  Memory: `capacity`
        items plus the one the consumer holds.
    device : {None, "cpu", "cuda", "cuda:N"}
        "cuda": batches are staged through reused pinned host buffers and
        copied on a side CUDA stream (CuPy); `read_next` returns LoDTensors
        on the GPU, `capacity` copies ahead, and the current stream waits
        on each copy's event (the host never blocks on it).  Needs batches.
    timeout : float, optional
        Seconds `read_next` may wait for an item before raising
        `TimeoutError` (naming the chain) instead of hanging on a stalled
        reader.  None (default): wait as long as it takes.

    Raises
    ------
    Exception
        Whatever the chain raised in the background thread (a corrupt
        chunk, a user function), with its message and original traceback,
        once, on the next `read_next()` after the items read before it; the
        call after that reads on as the chain below does (the next chunk or
        file after a data error; the item after one a map function raised on).
    TimeoutError
        No item within `timeout` seconds.

    Examples
    --------
    >>> r = PrefetchReader(ArrayReader(np.arange(10)).batch(4), capacity=2)
    >>> [len(b[0].data) for b in r]
    [4, 4, 2]
    """
    cdef readonly int64_t capacity
    cdef readonly object timeout
    cdef readonly object device
    cdef int64_t timeout_ns
    cdef _Pump pump
    cdef pf_state *st                       # the current run's state (survives tp_clear)
    cdef rl_block *handed                   # the block of the item the consumer holds
    cdef int64_t handed_refs                # references held on it: the ring's of the items
                                            # of that block handed out in a row (dropped at
                                            # once when the block changes: no atomic per item
                                            # on a line the thread's incref writes too)
    cdef bint nonblocking                   # device staging: pop only what is ready
    cdef bint would_block
    cdef bint reset_pending                 # a reset() could not stop the thread
    cdef bint fresh                         # nothing taken this epoch (the next run starts it)
    cdef int64_t signals_ns                 # when c_next last checked for Ctrl-C
    cdef object _stager
    cdef object __weakref__                 # (the chain's list of prefetchers, _Chain.pumps)
    cdef object _chain_entry                # [weakrefs to self and to the current run's _Pump]: in _Chain.pumps

    def __init__(self, reader, capacity=2, device=None, timeout=None):
        _check_reader(reader, "PrefetchReader")
        cap = _check_positive_int(capacity, "capacity")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
                raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
            if not timeout > 0:
                raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
            timeout = float(timeout)
        dev = _parse_device(device)
        if dev is not None and reader.item_kind != ITEM_BATCH:
            raise TypeError("PrefetchReader(device='cuda') stages batches; call .batch() before "
                            ".prefetch(device='cuda')")
        DecoratedReader.__init__(self, reader)
        # From here this thread reads the chain below: reads, resets and states
        # of the readers below (or of another reader built on them) are refused
        # while it runs (ReaderBase._check_chain), closing one closes this first.
        self._chain_entry = [weakref.ref(self), None]
        self._chain.pumps.append(self._chain_entry)
        self._chain.version += 1
        self.fresh = True
        self.capacity = cap
        self.timeout = timeout
        self.timeout_ns = -1 if timeout is None else <int64_t>(timeout * 1e9)
        self.device = device if dev is not None else None
        if dev is not None:
            from readerlib.readers._cuda_stager import CudaStager
            self._stager = CudaStager(dev, cap)
        self._start_run()

    def __dealloc__(self):
        self._drop_handed()
        if self.st != NULL:
            _pf_request_stop(self.st)       # the thread exits on its own; nothing here waits
            _pf_decref(self.st)
            self.st = NULL

    cdef inline void _drop_handed(self) noexcept nogil:
        if self.handed != NULL:
            pf_block_decref_n(self.handed, self.handed_refs)
            self.handed = NULL
            self.handed_refs = 0

    # -- runs ---------------------------------------------------------------
    cdef int _start_run(self) except -1:
        pump = _Pump(self.reader, self.capacity)
        if self.fresh:                           # the epoch as its reading starts
            pump.start_view = self.reader._chain_epoch_state(False)
        # started before it becomes this reader's run: a KeyboardInterrupt in
        # start() (threading.Thread() is Python code) left a run with no thread,
        # and the next read waited for ever for its items
        pump.start(f"readerlib-prefetch-{id(self):x}")
        _pf_incref(pump.st)
        if self.st != NULL:
            _pf_decref(self.st)
        self.st = pump.st
        self.pump = pump
        self._chain_entry[1] = weakref.ref(pump) # (a dropped prefetcher's thread may outlive it;
                                                 # weak: the chain must not keep its reader alive)
        return 0

    cdef int _end_run(self, join_timeout, bint for_close) except -1:
        """Stop the current run.  Returns 1 if its thread stopped, else 0."""
        cdef _Pump pump = self.pump
        self._drop_handed()
        if pump is None:
            return 1
        if not pump.stop_and_join(join_timeout):
            if for_close and pump.hand_over_close():
                pass                        # it left the chain after all: fall through
            else:
                return 0
        self.pump = None
        if self.st != NULL:
            with nogil:
                pthread_mutex_lock(&self.st.mu)
                _pf_drain(self.st)
                pthread_mutex_unlock(&self.st.mu)
            _pf_decref(self.st)
            self.st = NULL
        return 1

    # -- the C-level reader API --------------------------------------------
    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r
        while True:
            r = self._take(out)
            if r != POP_MARK:
                return r
            with gil:
                self._cross_mark()

    cdef int _take(self, rl_record *out) except -1 nogil:
        """c_next, or POP_MARK (nothing taken): the next item comes after a
        pass the thread started (_cross_mark, then again)."""
        cdef int code
        cdef PyThreadState *saved = NULL
        cdef int64_t deadline = -1, now
        if self.st == NULL or self.reset_pending:
            with gil:
                self._ensure_running()
        code = _pf_pop(self.st, out, -1, False)     # an item ready: no clock, no wait
        if code == POP_EMPTY and not self.nonblocking:
            # About to wait.  Ctrl-C: items that arrive slowly but steadily (one
            # every 50 ms under a batch of 10**6) never leave a whole wait slice
            # below, so look here too, at most once a slice, before anything is
            # taken from the ring (an interrupted caller loses nothing).
            now = _now_ns()
            if now - self.signals_ns >= SLICE_NS:
                self.signals_ns = now
                with gil:
                    code = PyErr_CheckSignals()
                if code < 0:
                    return -1
            if self.timeout_ns >= 0:
                deadline = now + self.timeout_ns
            if PyGILState_Check():           # called with the GIL held: never wait holding it
                saved = PyEval_SaveThread()
            while True:
                code = _pf_pop(self.st, out, deadline, True)
                if code != POP_SLICE:
                    break
                if pf_iload_rlx(&self.st.stop):     # close() from another thread: stop waiting
                    code = POP_END
                    break
                with gil:
                    code = PyErr_CheckSignals()     # Ctrl-C while waiting on a slow chain
                if code < 0:
                    break
        if saved != NULL:
            PyEval_RestoreThread(saved)
        if code == -1:
            return -1                           # KeyboardInterrupt (or another signal's exception)
        if code == POP_ITEM:
            if out.block != self.handed:
                self._drop_handed()
                self.handed = out.block
            if out.block != NULL:
                self.handed_refs += 1
            return 1
        self._drop_handed()
        if code == POP_END:
            return 0
        if code == POP_MARK:
            return POP_MARK
        if code == POP_EMPTY:
            self.would_block = True
            return 0
        with gil:
            self._raise(code)
        return -1

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # Exact: the items already produced (the ring) are the next ones, so
        # they are dropped first; then the thread is stopped (the item it was
        # producing lands in the ring: taken too, or kept for the next read),
        # and the chain below skips the rest with its own c_skip (O(1) where it
        # can position).  The next read starts a new run.  With no run live
        # (after reset / set_state) the chain below skips directly.
        cdef rl_record rec
        cdef int code
        cdef int64_t done = 0
        self._drop_handed()
        if n <= 0:
            return 0
        if self._stager is not None or self.reset_pending:
            return ReaderBase.c_skip(self, n)   # staged device batches are handed out first
        self.fresh = False
        if self.st == NULL:
            return self.reader.c_skip(n)
        while done < n:
            code = _pf_pop(self.st, &rec, -1, False)
            if code == POP_MARK:
                with gil:
                    self._cross_mark()
                continue
            if code != POP_ITEM:
                break
            rl_block_decref(rec.block)
            done += 1
        if done == n:
            return done
        if code == POP_END:
            return done
        if code != POP_EMPTY:
            with gil:
                self._raise(code)
        with gil:
            self._stop_for_skip()
        while done < n:                          # the thread is gone: what it pushed
            code = _pf_pop(self.st, &rec, -1, False)
            if code == POP_MARK:
                with gil:
                    self._cross_mark()
                continue
            if code != POP_ITEM:
                break
            rl_block_decref(rec.block)
            done += 1
        if done == n:
            with gil:
                self._resume_run()               # items left in the ring: the run goes on
            return done
        with gil:
            self._end_skip_run()
        return done + self.reader.c_skip(n - done)

    def _end_skip_run(self):
        if self.pump.error is not None:
            self._raise(POP_ERROR)               # the run ended with an error: as c_next would
        self._end_run(None, False)               # its ring is empty; the next read starts a run

    def _stop_for_skip(self):
        join_timeout = None if self.timeout is None else max(self.timeout, _CLOSE_JOIN_S)
        if not self.pump.stop_and_join(join_timeout):
            self.reset_pending = True
            raise TimeoutError(
                f"PrefetchReader: skipping needs the reader thread stopped and it did not stop "
                f"within {join_timeout:g} s; it is stuck inside the chain {self.reader!r}.  "
                f"Call reset()")

    def _pause_for_state(self):
        """get_state: stop the thread between items (the item it was making lands
        in the ring), so the chain below can be looked at; _resume_after_state
        starts it again over the ring.  Returns whether it stopped a run."""
        if self.st == NULL or self.pump is None or self.reset_pending:
            return False
        self._stop_for_skip()
        return True

    def _resume_after_state(self, token):
        if token and self.pump is not None:
            self._resume_run()

    def _resume_run(self):
        """Start the stopped run's thread again over the items left in its ring."""
        cdef pf_state *st = self.st
        if self.pump.error is not None:
            return                               # ended with an error: raised after the ring
        with nogil:
            pthread_mutex_lock(&st.mu)
            pf_istore_rlx(&st.stop, 0)
            pf_istore_rlx(&st.done, 0)
            st.failed = 0
            st.finished = 0
            st.prod_need = 0
            st.cons_need = 0
            st.prod_sleeping = 0
            st.cons_sleeping = 0
            pthread_mutex_unlock(&st.mu)
        self.pump.start(f"readerlib-prefetch-{id(self):x}")

    def _ensure_running(self):
        if self._closed:
            raise ValueError("I/O operation on closed reader (PrefetchReader)")
        if self.reset_pending:
            raise RuntimeError("PrefetchReader: a reset() did not finish (its reader thread was stuck "
                               "in the chain, or the chain's reset raised); call reset() again")
        self._start_run()

    def _raise(self, int code):
        cdef _Pump pump = self.pump
        cdef pf_state *st = self.st
        if code == POP_ERROR:
            # Raised once, in its place; the next read resumes the run, as the
            # chain without a prefetcher reads on after an error (a data error
            # raised once, then the next chunk or file; a map function's
            # exception raised, its item dropped, then the next).  It used to
            # be raised again by every read until reset(): a loop reading on
            # past data errors never ended.
            err, tb = pump.error, pump.error_tb
            pump.error = None
            pump.error_tb = None
            with nogil:                          # the error was not the run's end: it goes on
                pthread_mutex_lock(&st.mu)
                st.seen_end = 0
                pthread_mutex_unlock(&st.mu)
            self._resume_run()
            raise err.with_traceback(tb)
        if code == POP_TIMEOUT:
            raise TimeoutError(
                f"PrefetchReader: no item from the reader chain {self.reader!r} within "
                f"{self.timeout:g} s (timeout={self.timeout:g}); the reader thread is still running "
                f"and may be stalled.  read_next() again to keep waiting, reset() to restart the "
                f"chain, or pass a larger timeout=")
        raise RuntimeError("this process forked while the PrefetchReader's thread was running; "
                           "the thread does not exist here: call reset() to start a new one")

    # -- the epoch as the consumer reads it -------------------------------------
    # The thread reads up to `capacity` items ahead.  Where that takes it into
    # the next pass of a multi_pass or repeat below, the pass starts (c_reset
    # of the reader below it: a shuffle's epoch moves on) before the consumer
    # gets there.  Without the prefetcher the chain would not have started it,
    # so what the chain's epoch state is -- saved by get_state, and what
    # reset() moves on from -- is taken as of the consumer's position: the
    # thread notes the state before each pass it starts (_Pump.log), and
    # _below_states / c_reset use the first one the consumer has not reached.

    def _cross_mark(self):
        """The consumer goes past a pass the thread started (POP_MARK).  On a
        thread that reads for another prefetcher, that pass was read ahead of
        *its* consumer: noted there too (before this one counts it as seen)."""
        cdef pf_state *st = self.st
        cdef int64_t m, n0, nxt
        cdef bint settled = False
        with nogil:
            pthread_mutex_lock(&st.mu)
            m = st.mark
            pthread_mutex_unlock(&st.mu)
        _epoch_step()
        while not settled:
            with nogil:
                pthread_mutex_lock(&st.mu)
                n0 = st.noted
                pthread_mutex_unlock(&st.mu)
            nxt = -1
            for e in self.pump.log:             # (the thread rebinds the list, never changes it)
                if e[0] > m:
                    nxt = e[0]
                    break
            with nogil:
                pthread_mutex_lock(&st.mu)
                if st.noted == n0:              # else the thread noted one meanwhile: look again
                    pf_store_rlx(&st.mark, nxt)
                    st.limit = st.popped        # (_pf_refresh looks at the new mark)
                    settled = True
                pthread_mutex_unlock(&st.mu)

    def _seen(self):
        """Items of the current run the consumer has read (+1 once it read the end)."""
        cdef pf_state *st = self.st
        cdef int64_t popped
        cdef int end
        with nogil:
            pthread_mutex_lock(&st.mu)
            popped = pf_load_rlx(&st.popped)
            end = st.seen_end
            pthread_mutex_unlock(&st.mu)
        stager = self._stager
        if stager is not None:                   # popped, staged, not handed out
            held = len(stager.inflight) + (stager.unstaged is not None)
            if held:
                return popped - held
        return popped + end

    def _view_at(self, _Pump pump, seen, bint at_start):
        """The chain's epoch state (_chain_epoch_state(False)) as of `seen` items
        of `pump`'s run: before the first pass the thread started that the
        consumer has not reached; at the epoch's start (at_start), as the run
        found it.  None: as it is (the thread started no pass ahead)."""
        for e in pump.log:
            if e[0] >= seen:
                return e[1]
        if at_start and seen == 0:
            return pump.start_view
        return None

    def _below_states(self):
        """_chain_epoch_state(False) of the chain below, as the consumer has read it."""
        cdef _Pump pump = self.pump
        if pump is None or self.st == NULL or self.reset_pending:
            return None                          # no thread reads it: as it is
        seen = self._seen()
        v = self._view_at(pump, seen, True)
        if v is not None:
            return v
        states = self.reader._chain_epoch_state(False)
        v = self._view_at(pump, seen, False)     # the thread started a pass while it was read
        return states if v is None else v

    def _thread_inside(self):
        """Whether a thread of this prefetcher may still be inside the chain below."""
        return self.pump is not None and self.pump._inside()

    def _read_ahead_steps(self):
        """Test hook: the items of the current run after which its thread started a pass."""
        return [] if self.pump is None else [int(e[0]) for e in self.pump.log]

    def _undo_read_ahead(self, view):
        """After c_reset below: the chain's epoch state back to `view` (the
        thread's read-ahead had moved it on), and c_reset again from there."""
        if _restore_epoch_states(self.reader, view):     # (False: another chain below now)
            self.reader.c_reset()

    cdef int c_reset(self) except -1:
        cdef _Pump pump = self.pump
        join_timeout = None if self.timeout is None else max(self.timeout, _CLOSE_JOIN_S)
        self.reset_pending = True
        seen = self._seen() if pump is not None and self.st != NULL else 0
        if not self._end_run(join_timeout, False):
            raise TimeoutError(
                f"PrefetchReader.reset(): the reader thread did not stop within {join_timeout:g} s; "
                f"it is stuck inside the chain {self.reader!r}.  Call reset() again later")
        if self._stager is not None:
            self._stager.clear()
        # the epoch the consumer read: passes the thread started ahead of it undone
        view = self._view_at(pump, seen, False) if pump is not None else None
        self.reader.c_reset()
        if view is not None:
            self._undo_read_ahead(view)
        self.fresh = True
        # The next run starts on the next c_next, not here: between a reset
        # and the first read the chain below is the caller's to adjust
        # (set_state() restores each reader's epoch state after c_reset()).
        self.reset_pending = False
        return 0

    cdef int c_close(self) except -1:
        cdef _Pump pump
        try:
            stopped = self._end_run(_CLOSE_JOIN_S, True)
        except BaseException:
            # Ctrl-C while waiting for the thread: close() has marked this reader
            # closed, so no later close() comes back to the chain below -- it
            # stayed open.  The thread closes it as it leaves (or it has left).
            pump = self.pump
            if pump is None or pump.hand_over_close():
                self.reader.close()
            raise
        if self._stager is not None:
            self._stager.clear()
        if stopped:
            self.reader.close()
        # else: the thread closes the chain when it leaves it (hand_over_close)
        return 0

    def _interrupt(self):
        # close() from another thread while a read_next() waits here: ask the
        # thread to stop, and the waiting read returns None within one slice.
        if self.st != NULL:
            _pf_request_stop(self.st)

    # -- Python API -----------------------------------------------------------
    def read_next(self):
        """The next item (instance or batch), or None at the end of the epoch.

        Raises the background thread's exception, or TimeoutError (see the
        class docstring).
        """
        if self._stager is None:
            return ReaderBase.read_next(self)
        return self._read_next_device()

    def _read_host(self, bint blocking):
        """Host batch, None at the end, or _NOT_READY (non-blocking, nothing ready)."""
        self.nonblocking = not blocking
        self.would_block = False
        try:
            item = ReaderBase.read_next(self)
        finally:
            self.nonblocking = False
        if item is None and self.would_block:
            return _NOT_READY
        return item

    def _read_next_device(self):
        st = self._stager
        # get_state() counts batches handed out, not batches staged: every
        # host read below bumps _position, so put it back afterwards.
        handed = self._position if (self._started or self._resuming) else 0
        try:
            self._stage_ahead(st)
        except BaseException:
            # (an interrupt in stage(): its host batch stays in st.unstaged and
            # is staged first next time; nothing was handed out)
            self._position = handed
            raise
        if not st.inflight:
            self._position = handed
            if st.pending is not None:
                e = st.pending
                st.pending = None            # the host ring raises it again on the next call
                raise e
            return None
        batch = st.hand_out()
        self._position = handed + 1
        return batch

    def _stage_ahead(self, st):
        # Keep up to `capacity` batches in flight on the GPU: take every host
        # batch already waiting, and block only when nothing is in flight.
        while len(st.inflight) < self.capacity and not st.host_end and st.pending is None:
            hb = st.unstaged
            if hb is None:
                try:
                    hb = self._read_host(not st.inflight)
                except BaseException as e:
                    if not st.inflight:
                        raise
                    st.pending = e           # hand out the batches read before it first
                    break
                if hb is _NOT_READY:
                    break
                if hb is None:
                    st.host_end = True
                    break
                st.unstaged = hb             # held until staged (stage() runs Python code)
            entry = st.stage(hb)
            st.inflight.append(entry)
            st.unstaged = None

    def _reduce_args(self):
        return (int(self.capacity),), {"device": self.device, "timeout": self.timeout}

    @property
    def qsize(self):
        """Items ready in the queue now (for monitoring; changes as you look)."""
        cdef int64_t n
        if self.st == NULL:
            return 0
        with nogil:
            n = pf_load_rlx(&self.st.popped)
            n = pf_load_rlx(&self.st.produced) - n
        return n

    @property
    def thread(self):
        """The current background thread (None after close())."""
        return None if self.pump is None else self.pump.thread

    def __repr__(self):
        extra = ""
        if self.device is not None:
            extra += f", device={self.device!r}"
        if self.timeout is not None:
            extra += f", timeout={self.timeout:g}"
        return f"PrefetchReader({self.reader!r}, capacity={self.capacity}{extra})"


def _parse_device(device):
    """None for the host, else the CUDA device ordinal."""
    if device is None or device == "cpu":
        return None
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        if device == "cuda":
            return -1                         # the current device
        try:
            return int(device.split(":", 1)[1])
        except ValueError:
            pass
    raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")
