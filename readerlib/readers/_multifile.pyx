# cython: freethreading_compatible=False
"""Many files read by a pool of threads into one deterministic stream; sharding.

Design:
    The stream is a list of *units* (a chunk of a file, or a whole file when
    its reader has no chunk table), in an order fixed by (seed, epoch) --
    never by thread timing.  Unit u is read by thread u % T, which walks its
    units in order and pushes *packets* into its own bounded queue: up to
    PACKET_RECORDS records (or PACKET_BYTES of record data) as borrowed
    pointers plus one reference per run of records from the same block (no
    copy, one atomic per block run).  The last packet of a unit is flagged.
    The consumer pops unit 0's packets from queue 0, unit 1's from queue 1,
    ... so the output is the units' records concatenated in unit order,
    whatever T is; threads work ahead by up to QUEUE_BYTES of records
    (QUEUE_PACKETS packets) each, enough to hold whole units of small files
    so that T threads really overlap.

    Workers are Python threads that drop the GIL around the compiled
    readers' c_next (a PythonReader re-acquires it per record).  An exception
    in a worker is stored and an error packet takes the place of the rest of
    its unit: the consumer raises it (the original object, traceback and
    all; DataLoss errors name file and offset, others get a note naming the
    file) after every record that came before it.  The consumer waits in
    100 ms slices, so Ctrl-C and `timeout=` work while it waits.

    Memory: at most T * QUEUE_BYTES of records in flight (plus the rest of
    the chunks they live in, which they pin).
"""
import threading
import time

from libc.stdlib cimport malloc, free
from posix.time cimport timespec, clock_gettime, CLOCK_REALTIME
from cpython.exc cimport PyErr_CheckSignals

from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_block_incref, rl_block_decref,
    ITEM_INSTANCE)
from readerlib.readers._base import _check_positive_int, _check_reader
from readerlib.errors import DataLossError

__all__ = ["MultiFileReader", "ShardReader"]

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, const void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const timespec *t)

DEF PACKET_RECORDS = 1024
DEF PACKET_BYTES = 4194304
DEF QUEUE_PACKETS = 256
DEF QUEUE_BYTES = 33554432        # record bytes a thread may queue ahead (32 MiB)


cdef struct _packet:
    int64_t n
    int64_t nbytes
    int64_t nblocks
    int64_t unit
    int last                      # last packet of its unit
    int error                     # stands for an exception stored by the worker
    rl_record recs[PACKET_RECORDS]
    rl_block *blocks[PACKET_RECORDS]


cdef struct _queue:
    pthread_mutex_t mu
    pthread_cond_t cv             # broadcast on push, pop and stop
    _packet *ring[QUEUE_PACKETS]
    int64_t head
    int64_t count
    int64_t nbytes


cdef _packet *_packet_new(int64_t unit) noexcept nogil:
    cdef _packet *p = <_packet *>malloc(sizeof(_packet))
    if p != NULL:
        p.n = 0
        p.nbytes = 0
        p.nblocks = 0
        p.unit = unit
        p.last = 0
        p.error = 0
    return p


cdef void _packet_free(_packet *p) noexcept nogil:
    cdef int64_t i
    if p == NULL:
        return
    for i in range(p.nblocks):
        rl_block_decref(p.blocks[i])
    free(p)


cdef class MultiFileReader(FileReader):
    """The reader `rl.open_files` returns: units of files read by threads.

    Not built directly: see `readerlib.open_files`.
    """
    cdef object _plan
    cdef list _units
    cdef int64_t nunits
    cdef readonly int num_threads
    cdef _queue *queues
    cdef _packet **partial
    cdef list _threads
    cdef list _errors
    cdef int stop
    cdef bint running
    cdef bint failed
    cdef object _failure
    cdef int64_t cur_unit
    cdef _packet *hold
    cdef int64_t hold_i
    cdef readonly int64_t limit
    cdef readonly int64_t emitted
    cdef readonly int64_t epoch
    cdef double timeout

    def __cinit__(self):
        self.queues = NULL
        self.partial = NULL

    def __init__(self, plan, schema, num_threads=1, limit=-1, timeout=None):
        cdef int t
        n = _check_positive_int(num_threads, "num_threads")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self._set_schema(schema, ITEM_INSTANCE)
        self.layout.bare = bool(getattr(plan, "bare", False))   # FilePlan.open enforces it
        self._plan = plan
        self.num_threads = n
        self.limit = limit
        self.timeout = -1.0 if timeout is None else float(timeout)
        self.queues = <_queue *>malloc(n * sizeof(_queue))
        self.partial = <_packet **>malloc(n * sizeof(_packet *))
        if self.queues == NULL or self.partial == NULL:
            raise MemoryError()
        for t in range(n):
            pthread_mutex_init(&self.queues[t].mu, NULL)
            pthread_cond_init(&self.queues[t].cv, NULL)
            self.queues[t].head = 0
            self.queues[t].count = 0
            self.queues[t].nbytes = 0
            self.partial[t] = NULL
        self._threads = []
        self._errors = [None] * n
        self.epoch = 0
        self.running = False

    def __dealloc__(self):
        cdef int t
        if self.queues != NULL:
            for t in range(self.num_threads):
                while self.queues[t].count:
                    _packet_free(self.queues[t].ring[self.queues[t].head])
                    self.queues[t].head = (self.queues[t].head + 1) % QUEUE_PACKETS
                    self.queues[t].count -= 1
                pthread_mutex_destroy(&self.queues[t].mu)
                pthread_cond_destroy(&self.queues[t].cv)
            free(self.queues)
            self.queues = NULL
        if self.partial != NULL:
            for t in range(self.num_threads):
                _packet_free(self.partial[t])
            free(self.partial)
            self.partial = NULL
        _packet_free(self.hold)
        self.hold = NULL

    # -- queues (no GIL) -------------------------------------------------------
    cdef int _push(self, int t, _packet *p) noexcept nogil:
        """0 when queued; -1 when the reader is stopping (the caller frees p)."""
        cdef _queue *q = &self.queues[t]
        pthread_mutex_lock(&q.mu)
        while (q.count == QUEUE_PACKETS or (q.count > 0 and q.nbytes >= QUEUE_BYTES)) and not self.stop:
            pthread_cond_wait(&q.cv, &q.mu)
        if self.stop:
            pthread_mutex_unlock(&q.mu)
            return -1
        q.ring[(q.head + q.count) % QUEUE_PACKETS] = p
        q.count += 1
        q.nbytes += p.nbytes
        pthread_cond_broadcast(&q.cv)
        pthread_mutex_unlock(&q.mu)
        return 0

    cdef int _pop(self, int t, _packet **out) except -1 nogil:
        cdef _queue *q = &self.queues[t]
        cdef timespec ts
        cdef double waited = 0.0
        pthread_mutex_lock(&q.mu)
        while q.count == 0:
            clock_gettime(CLOCK_REALTIME, &ts)
            ts.tv_nsec += 100000000
            if ts.tv_nsec >= 1000000000:
                ts.tv_nsec -= 1000000000
                ts.tv_sec += 1
            pthread_cond_timedwait(&q.cv, &q.mu, &ts)
            if q.count:
                break
            pthread_mutex_unlock(&q.mu)
            waited += 0.1
            with gil:
                PyErr_CheckSignals()          # Ctrl-C while waiting
                self._check_stall(t, waited)
            pthread_mutex_lock(&q.mu)
        out[0] = q.ring[q.head]
        q.head = (q.head + 1) % QUEUE_PACKETS
        q.count -= 1
        q.nbytes -= out[0].nbytes
        pthread_cond_broadcast(&q.cv)
        pthread_mutex_unlock(&q.mu)
        return 0

    def _check_stall(self, int t, double waited):
        unit = self._units[self.cur_unit] if self.cur_unit < self.nunits else None
        if self.timeout > 0 and waited >= self.timeout:
            raise TimeoutError(f"open_files: no record from {unit[0]!r} (unit {self.cur_unit}, thread {t}) "
                               f"for {waited:.1f} s (timeout={self.timeout})")
        if t < len(self._threads) and not self._threads[t].is_alive() and self.queues[t].count == 0:
            raise RuntimeError(f"open_files: worker thread {t} ended without finishing "
                               f"{unit[0] if unit else '?'!r}")

    # -- workers -----------------------------------------------------------------
    cdef int _pump(self, ReaderBase rd, int t, int64_t u) except -1 nogil:
        """Read one unit into packets.  0: done; 1: stopped."""
        cdef rl_record rec
        cdef int64_t nbytes = 0
        cdef _packet *p = _packet_new(u)
        if p == NULL:
            with gil:
                raise MemoryError()
        self.partial[t] = p
        while True:
            if rd.c_next(&rec) == 0:
                break
            if p.nblocks == 0 or p.blocks[p.nblocks - 1] != rec.block:
                rl_block_incref(rec.block)
                p.blocks[p.nblocks] = rec.block
                p.nblocks += 1
            p.recs[p.n] = rec
            p.n += 1
            nbytes += rec.size
            p.nbytes = nbytes
            if p.n == PACKET_RECORDS or nbytes >= PACKET_BYTES:
                self.partial[t] = NULL
                if self._push(t, p) != 0:
                    _packet_free(p)
                    return 1
                nbytes = 0
                p = _packet_new(u)
                if p == NULL:
                    with gil:
                        raise MemoryError()
                self.partial[t] = p
            if self.stop:
                return 1
        p.last = 1
        self.partial[t] = NULL
        if self._push(t, p) != 0:
            _packet_free(p)
            return 1
        return 0

    def _worker(self, int t):
        cdef ReaderBase rd
        cdef int r
        cdef int64_t u = t
        cdef _packet *p
        cache_path = None
        cache = None
        path = None
        try:
            while u < self.nunits and not self.stop:
                path, chunks = self._units[u]
                if cache_path != path:
                    if cache is not None:
                        cache.close()
                        cache = None
                    cache_path = path
                    cache = self._plan.open(path)
                    if (<ReaderBase>cache).layout.bare != self.layout.bare:
                        raise ValueError(f"open_files: {path!r} gives "
                                         f"{'bare' if cache.bare_instances else 'prefixed'} "
                                         f"instances, the stream the other form")
                rd = cache
                if chunks is not None:
                    cache.select_chunks(chunks)
                else:
                    rd.c_reset()
                with nogil:
                    r = self._pump(rd, t, u)
                if r:
                    break
                u += self.num_threads
        except BaseException as e:
            if not self.stop:
                if not isinstance(e, DataLossError) or str(path) not in str(e):
                    e.add_note(f"open_files: while reading {path!r} (unit {u}, worker thread {t})")
                self._errors[t] = e
                # what was read before the error still comes out, in order
                p = self.partial[t]
                self.partial[t] = NULL
                if p != NULL and p.n > 0:
                    if self._push(t, p) != 0:
                        _packet_free(p)
                        p = NULL
                else:
                    _packet_free(p)
                p = _packet_new(u)
                if p != NULL:
                    p.error = 1
                    if self._push(t, p) != 0:
                        _packet_free(p)
        finally:
            _packet_free(self.partial[t])
            self.partial[t] = NULL
            if cache is not None:
                try:
                    cache.close()
                except Exception:
                    pass

    cdef int _start(self) except -1:
        cdef int t
        if self.failed:
            raise self._failure
        self._units = list(self._plan.epoch_units(self.epoch))
        self.nunits = len(self._units)
        self.cur_unit = 0
        self.emitted = 0
        self.stop = 0
        self._errors = [None] * self.num_threads
        self._threads = []
        for t in range(min(self.num_threads, max(self.nunits, 1))):
            th = threading.Thread(target=self._worker, args=(t,), daemon=True,
                                  name=f"readerlib-open_files-{t}")
            self._threads.append(th)
        self.running = True
        for th in self._threads:
            th.start()
        return 0

    cdef int _stop_threads(self) except -1:
        cdef int t
        cdef _queue *q
        self.stop = 1
        for t in range(self.num_threads):
            q = &self.queues[t]
            pthread_mutex_lock(&q.mu)
            pthread_cond_broadcast(&q.cv)
            pthread_mutex_unlock(&q.mu)
        for th in self._threads:
            th.join()
        self._threads = []
        for t in range(self.num_threads):
            q = &self.queues[t]
            while q.count:
                _packet_free(q.ring[q.head])
                q.head = (q.head + 1) % QUEUE_PACKETS
                q.count -= 1
            q.head = 0
            q.nbytes = 0
        _packet_free(self.hold)
        self.hold = NULL
        self.hold_i = 0
        self.running = False
        return 0

    cdef int _raise_worker_error(self, int t) except -1:
        e = self._errors[t]
        if e is None:
            e = RuntimeError(f"open_files: worker thread {t} failed")
        self.failed = True
        self._failure = e
        raise e

    # -- the consumer --------------------------------------------------------------
    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef _packet *p
        cdef int t
        if self.failed:
            with gil:
                raise self._failure
        if self.limit >= 0 and self.emitted >= self.limit:
            return 0
        while True:
            if self.hold != NULL:
                if self.hold_i < self.hold.n:
                    out[0] = self.hold.recs[self.hold_i]
                    self.hold_i += 1
                    self.emitted += 1
                    return 1
                if self.hold.last:
                    self.cur_unit += 1
                _packet_free(self.hold)
                self.hold = NULL
            if not self.running:
                with gil:
                    self._start()
            if self.cur_unit >= self.nunits:
                return 0
            t = <int>(self.cur_unit % self.num_threads)
            self._pop(t, &p)
            if p.error:
                _packet_free(p)
                with gil:
                    self._raise_worker_error(t)
            self.hold = p
            self.hold_i = 0

    cdef int c_reset(self) except -1:
        if self.running:
            self._stop_threads()
        self.failed = False
        self._failure = None
        self.epoch += 1
        self.emitted = 0
        self.cur_unit = 0
        return 0

    cdef int c_close(self) except -1:
        if self.running:
            self._stop_threads()
        return 0

    # checkpoint: (seed, epoch) fix the unit order; the core replays the position.
    # The seed is in the state even when open_files drew it (no seed=), so a
    # chain restored in another process draws the same file order.
    def _epoch_state(self):
        d = {"epoch": int(self.epoch)}
        if getattr(self._plan, "shuffle_files", False):
            d["seed"] = int(self._plan.seed)
        return d

    def _set_epoch_state(self, state):
        self.epoch = int(state.get("epoch", self.epoch))
        if "seed" in state and getattr(self._plan, "shuffle_files", False):
            self._plan.seed = int(state["seed"])

    def _describe(self):
        describe = getattr(self._plan, "describe", None)
        d = dict(describe()) if describe is not None else {}
        d["limit"] = int(self.limit)
        return d

    def _rebuild_with(self):
        from readerlib.readers.files import _reopen_files
        return _reopen_files

    def _reduce_args(self):
        if not hasattr(self._plan, "open_files_args"):
            raise TypeError(f"{type(self).__name__} over {type(self._plan).__name__} cannot be pickled")
        kwargs = dict(self._plan.open_files_args())
        kwargs["num_threads"] = int(self.num_threads)
        kwargs["timeout"] = None if self.timeout < 0 else float(self.timeout)
        return (), kwargs

    @property
    def plan(self):
        """The file/chunk plan (paths, units, shard) this reader follows."""
        return self._plan

    def __repr__(self):
        return f"MultiFileReader({self._plan!r}, num_threads={self.num_threads})"


cdef class ShardReader(DecoratedReader):
    """Keep every `num_shards`-th item, starting at `index` (tf.data's shard).

    Works on any reader (instances or batches).  For files, prefer
    `open_files(..., shard=(rank, world))`, which skips other ranks' chunks
    instead of reading and dropping them.

    Parameters
    ----------
    reader : ReaderBase
    num_shards : int
    index : int
        0 <= index < num_shards.
    """
    cdef readonly int64_t num_shards
    cdef readonly int64_t index
    cdef int64_t pos

    def __init__(self, reader, num_shards, index):
        _check_reader(reader, "ShardReader")
        n = _check_positive_int(num_shards, "num_shards")
        i = _check_positive_int(index, "index", allow_zero=True)
        if i >= n:
            raise ValueError(f"index must be in [0, num_shards={n}), got {i}")
        DecoratedReader.__init__(self, reader)
        self.num_shards = n
        self.index = i
        self.pos = 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r
        cdef int64_t k
        while True:
            r = self.reader.c_next(out)
            if r <= 0:
                return r
            k = self.pos
            self.pos += 1
            if k % self.num_shards == self.index:
                return 1

    cdef int c_reset(self) except -1:
        self.pos = 0
        return self.reader.c_reset()

    def __repr__(self):
        return f"ShardReader({self.reader!r}, num_shards={self.num_shards}, index={self.index})"

    def _describe(self):
        return {"num_shards": int(self.num_shards), "index": int(self.index)}

    def _reduce_args(self):
        return (int(self.num_shards), int(self.index)), {}
