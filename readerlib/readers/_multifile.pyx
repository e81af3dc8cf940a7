# cython: freethreading_compatible=False
"""Many files read by a pool of threads into one deterministic stream.

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
    file) after every record that came before it, and again on every later
    call until reset().  A file's data error (a DataLossError from its
    reader's c_next: a bad chunk, a bad TFRecord record) does not end the
    run: the worker queues a *soft* error packet (error 2: the exception in
    `_Run.soft[t]`) and reads on in the same reader, which reads on past its
    errors (the chunk's records are lost; a TFRecord file without an index:
    the rest of the file), so the consumer raises it once, in its place, and
    goes on with the records after it (tf.data's TFRecordDataset goes on
    to its next file).  A reader that raises the same error again without a
    record in between does not move on: that one ends the run.  The consumer waits in
    100 ms slices, so Ctrl-C and `timeout=` work while it waits (and it
    looks for Ctrl-C every 100 ms when records arrive slowly but steadily).

    Lifetime: an epoch's threads and queues are a *run* (`_Run` + `_shared`,
    reference counted).  Workers hold the run, never the reader: a reader
    dropped mid-epoch (`for x in open_files(...): break`) is collected, its
    __dealloc__ tells the run to stop, and the workers leave at their next
    record or queue wait, closing their files; the last owner frees the
    queued packets.  reset() and close() join the workers for at most
    _JOIN_S; one stuck in a slow reader is left to leave on its own (no
    later run shares its queues), so close() never hangs.

    Memory: at most T * QUEUE_BYTES of records in flight (plus the rest of
    the chunks they live in, which they pin).

    Big records in one copy (include/rl_mapped.h): a BatchReader above this
    reader (through decorators that only move items: shuffle, multi_pass)
    negotiates with it as with a single file reader.  This reader answers
    with a map of its own that stands for no file (`umap`, the *gate*: the
    batch sets its `pull` flag while it pulls), and each worker, as it opens
    a file, negotiates with that file's reader and gates the file's map by
    `umap` (rl_map_set_gate): the file reader then defers its big records in
    every load (the worker reads ahead, long before the batch pulls them),
    while whether a deferred record may go out is `umap.pull`'s to say (the
    shuffle asks rl_deferred_may_go_out, which follows the gate).  So the
    workers read only the chunks' headers and CRC tables, and the batch
    reads each record straight into its row and checks its CRC there, as
    for one file.  A deferred record that this reader hands to anyone but
    the negotiated batch (umap.pull 0: read_next on it directly, say) is
    replaced here by a verified copy first.  At most RL_MAP_MAX_GATED files' maps
    live at once (each holds a descriptor until its last deferred record
    goes: a shuffle buffer can hold records of many small files); files
    opened beyond that are read the ordinary way.

    Positioning: c_skip at the start of an epoch (set_state) steps over
    whole units by the plan's record counts and starts the run at the unit
    the target falls in (`_start(first)`: worker t reads units first + t,
    first + t + T, ...), so the files before it are not opened; the rest of
    one unit is read and dropped.  Random access (reader[i], read_many,
    global_shuffle) goes through MultiFileRecords (readers/_random_access.pyx):
    one chunk cache per file, indices in the canonical order of the rank's
    units, independent of the threads.
"""
import collections
import threading
import time

from libc.stdlib cimport malloc, calloc, free
from cpython.exc cimport PyErr_CheckSignals

from readerlib._typedefs cimport int64_t
from readerlib._sync cimport (
    pthread_mutex_t, pthread_cond_t, pthread_mutex_init, pthread_mutex_destroy, pthread_mutex_lock,
    pthread_mutex_unlock, pthread_cond_destroy, pthread_cond_broadcast, pthread_cond_wait,
    cond_init_monotonic, cond_wait_until, now_ns as _now_ns,
    __atomic_add_fetch, __atomic_sub_fetch, __ATOMIC_RELAXED, __ATOMIC_ACQ_REL)
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_block_incref, rl_block_decref,
    ITEM_INSTANCE, rl_core_import)
from readerlib.readers._base import _check_positive_int, _check_reader
from readerlib._parallel import start_threads
from readerlib.errors import DataLossError
from readerlib._mapped cimport (
    rl_map, rl_mapped, rl_mapped_import, rl_map_incref, rl_record_is_deferred, hand_out_verified, gate_ref,
    gate_file)

rl_core_import()
rl_mapped_import()

__all__ = ["MultiFileReader"]

cdef enum:
    PACKET_RECORDS = 1024
    PACKET_BYTES = 4194304
    QUEUE_PACKETS = 256
    QUEUE_BYTES = 33554432        # record bytes a thread may queue ahead (32 MiB)


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


# -- one run's shared state ------------------------------------------------------
# The queues of one run (an epoch's threads), shared by the MultiFileReader
# and the run's worker threads through a reference count: either side may go
# first.  The workers hold only the run (`_Run`), never the reader, so an
# abandoned reader is collected, its __dealloc__ sets `stop`, and the workers
# leave at their next record or queue wait; the last owner frees the queues
# and the packets still in them (which pin the files' blocks and mappings).
cdef struct _shared:
    int64_t refcnt
    int stop                      # consumer -> workers: leave now
    int nq
    _queue *queues
    _packet **partial             # per worker: the packet being filled


cdef _shared *_sh_new(int n) except NULL:
    cdef int t
    cdef _shared *sh = <_shared *>calloc(1, sizeof(_shared))
    if sh == NULL:
        raise MemoryError()
    sh.queues = <_queue *>calloc(n, sizeof(_queue))
    sh.partial = <_packet **>calloc(n, sizeof(_packet *))
    if sh.queues == NULL or sh.partial == NULL:
        free(sh.queues)
        free(sh.partial)
        free(sh)
        raise MemoryError()
    for t in range(n):
        pthread_mutex_init(&sh.queues[t].mu, NULL)
        cond_init_monotonic(&sh.queues[t].cv)
    sh.nq = n
    sh.refcnt = 1
    return sh


cdef void _sh_incref(_shared *sh) noexcept nogil:
    __atomic_add_fetch(&sh.refcnt, 1, __ATOMIC_RELAXED)


cdef void _sh_decref(_shared *sh) noexcept nogil:
    cdef int t
    cdef _queue *q
    if sh == NULL or __atomic_sub_fetch(&sh.refcnt, 1, __ATOMIC_ACQ_REL) != 0:
        return
    for t in range(sh.nq):
        q = &sh.queues[t]
        while q.count:
            _packet_free(q.ring[q.head])
            q.head = (q.head + 1) % QUEUE_PACKETS
            q.count -= 1
        pthread_mutex_destroy(&q.mu)
        pthread_cond_destroy(&q.cv)
        _packet_free(sh.partial[t])
    free(sh.queues)
    free(sh.partial)
    free(sh)


cdef void _sh_stop(_shared *sh) noexcept nogil:
    """Ask the run's workers to leave, and wake any that wait on a full queue."""
    cdef int t
    for t in range(sh.nq):
        pthread_mutex_lock(&sh.queues[t].mu)
        sh.stop = 1
        pthread_cond_broadcast(&sh.queues[t].cv)
        pthread_mutex_unlock(&sh.queues[t].mu)


cdef double _JOIN_S = 0.5         # reset()/close() wait this long for workers inside a slow reader


cdef class _Run:
    """One epoch's worker threads: what they read and where they put it.

    The threads' target is a method of this object, so they keep it (and the
    shared queues) alive while they run -- and nothing else: not the reader.
    """
    cdef _shared *sh
    cdef object plan
    cdef list units
    cdef int64_t nunits
    cdef int64_t first            # the run starts at this unit (a skip stepped over the ones before)
    cdef int num_threads
    cdef int bare
    cdef list errors
    cdef list soft                # per thread: a deque of the data errors read on past (soft packets)
    cdef dict skipped             # path -> chunks skipped this epoch (skip-mode readers share it)
    cdef rl_map *umap             # the reader's gate (a reference), or NULL: no batch negotiated

    def __dealloc__(self):
        _sh_decref(self.sh)
        self.sh = NULL
        if self.umap != NULL:
            rl_mapped.map_decref(self.umap)
            self.umap = NULL

    def _gate(self, cache):
        """The worker's new file reader defers its big records for the batch
        that negotiated with the reader (see Design): the file's map, gated,
        with a reference the worker lets go with the file; 0 where not."""
        return 0 if self.umap == NULL else gate_file(self.umap, cache, 1)

    # -- queues (no GIL) -------------------------------------------------------
    cdef int _push(self, int t, _packet *p) noexcept nogil:
        """0 when queued; -1 when the reader is stopping (the caller frees p)."""
        cdef _queue *q = &self.sh.queues[t]
        pthread_mutex_lock(&q.mu)
        while (q.count == QUEUE_PACKETS or (q.count > 0 and q.nbytes >= QUEUE_BYTES)) and not self.sh.stop:
            pthread_cond_wait(&q.cv, &q.mu)
        if self.sh.stop:
            pthread_mutex_unlock(&q.mu)
            return -1
        q.ring[(q.head + q.count) % QUEUE_PACKETS] = p
        q.count += 1
        q.nbytes += p.nbytes
        pthread_cond_broadcast(&q.cv)
        pthread_mutex_unlock(&q.mu)
        return 0

    cdef int _push_released(self, int t, _packet *p) noexcept:
        """_push for a caller holding the GIL (a worker's error path): the wait
        for queue space lets go of it -- the consumer needs the GIL to take
        packets, so a wait holding it never ends (and Ctrl-C never comes)."""
        cdef int r
        with nogil:
            r = self._push(t, p)
        return r

    # -- workers -----------------------------------------------------------------
    cdef int _pump(self, ReaderBase rd, int t, int64_t u) except -1 nogil:
        """Read one unit into packets.  0: done; 1: stopped."""
        cdef rl_record rec
        cdef int64_t nbytes = 0
        cdef _packet *p = _packet_new(u)
        if p == NULL:
            with gil:
                raise MemoryError()
        self.sh.partial[t] = p
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
                self.sh.partial[t] = NULL
                if self._push(t, p) != 0:
                    _packet_free(p)
                    return 1
                nbytes = 0
                p = _packet_new(u)
                if p == NULL:
                    with gil:
                        raise MemoryError()
                self.sh.partial[t] = p
            if self.sh.stop:
                return 1
        p.last = 1
        self.sh.partial[t] = NULL
        if self._push(t, p) != 0:
            _packet_free(p)
            return 1
        return 0

    def _read_on_after(self, int t, int64_t u, path, e, last):
        """A data error from the reader of unit u: the records before it and a
        soft error packet queued, for the consumer to raise once.  Returns the
        error's text (the next call's `last`), None when the reader is stopping;
        re-raises `e` (ending the run) when the reader raised the same error as
        the last time with no record in between: it does not move on."""
        cdef _packet *p = self.sh.partial[t]
        cdef int64_t n = 0 if p == NULL else p.n
        text = str(e)
        if n == 0 and text == last:
            raise e
        if str(path) not in text:
            e.add_note(f"open_files: while reading {path!r} (unit {u}, worker thread {t})")
        self.sh.partial[t] = NULL
        if p != NULL and p.n > 0:
            if self._push_released(t, p) != 0:
                _packet_free(p)
                return None
        else:
            _packet_free(p)
        p = _packet_new(u)
        if p == NULL:
            raise MemoryError()
        p.error = 2
        self.soft[t].append(e)
        if self._push_released(t, p) != 0:
            _packet_free(p)
            return None
        return text

    def _worker(self, int t):
        cdef ReaderBase rd
        cdef int r
        cdef int64_t u = self.first + t
        cdef _packet *p
        cdef size_t gated = 0          # the current file's gated map (a reference), or 0
        cache_path = None
        cache = None
        path = None
        try:
            while u < self.nunits and not self.sh.stop:
                path, chunks = self.units[u]
                if cache_path != path:
                    if cache is not None:
                        cache.close()
                        cache = None
                    if gated:
                        rl_mapped.map_decref(<rl_map *>gated)
                        gated = 0
                    cache_path = path
                    cache = self.plan.open(path)
                    if (<ReaderBase>cache).layout.bare != self.bare:
                        raise ValueError(f"open_files: {path!r} gives "
                                         f"{'bare' if cache.bare_instances else 'prefixed'} "
                                         f"instances, the stream the other form")
                    gated = self._gate(cache)
                rd = cache
                if chunks is not None:
                    cache.select_chunks(chunks)
                else:
                    rd.c_reset()
                share = getattr(cache, "_share_skipped", None)
                if share is not None:               # (a skip-mode file: once an epoch, see _skipped_of)
                    share(self.skipped.setdefault(str(path), set()))
                last = None
                while True:
                    try:
                        with nogil:
                            r = self._pump(rd, t, u)
                        break
                    except DataLossError as e:
                        # the file's data: raised once in its place, then read on (see Design)
                        last = self._read_on_after(t, u, path, e, last)
                        if last is None:
                            r = 1                   # (stopping)
                            break
                if r:
                    break
                u += self.num_threads
        except BaseException as e:
            if not self.sh.stop:
                if not isinstance(e, DataLossError) or str(path) not in str(e):
                    e.add_note(f"open_files: while reading {path!r} (unit {u}, worker thread {t})")
                self.errors[t] = e
                # what was read before the error still comes out, in order
                p = self.sh.partial[t]
                self.sh.partial[t] = NULL
                if p != NULL and p.n > 0:
                    if self._push_released(t, p) != 0:
                        _packet_free(p)
                        p = NULL
                else:
                    _packet_free(p)
                p = _packet_new(u)
                if p != NULL:
                    p.error = 1
                    if self._push_released(t, p) != 0:
                        _packet_free(p)
        finally:
            _packet_free(self.sh.partial[t])
            self.sh.partial[t] = NULL
            if cache is not None:
                try:
                    cache.close()
                except Exception:
                    pass
            if gated:
                rl_mapped.map_decref(<rl_map *>gated)


cdef class MultiFileReader(FileReader):
    """The reader `rl.open_files` returns: units of files read by threads.

    Not built directly: see `readerlib.open_files`.
    """
    cdef object _plan
    cdef list _units
    cdef int64_t nunits
    cdef readonly int num_threads
    cdef _Run run                 # the current epoch's threads (None between runs)
    cdef _shared *sh              # its queues (a C pointer: survives GC's tp_clear)
    cdef list _threads
    cdef bint running
    cdef bint failed
    cdef object _failure
    cdef dict _skipped_epochs     # epoch -> {path: chunks skipped} (_skipped_of)
    cdef int interrupted          # close() from another thread: a waiting read returns
    cdef int64_t cur_unit
    cdef int64_t first_unit       # the run's first unit (c_skip)
    cdef _packet *hold
    cdef int64_t hold_i
    cdef readonly int64_t limit
    cdef readonly int64_t emitted
    cdef readonly int64_t epoch
    cdef double timeout
    cdef int64_t signals_ns       # when c_next last checked for Ctrl-C
    cdef rl_map *umap             # the gate a batch above negotiated (see Design), or NULL
    cdef rl_block *mat            # the last verified copy handed out (hand_out_verified), or NULL
    cdef readonly int64_t _records_deferred   # test hook: deferred records handed to the batch

    def __cinit__(self):
        self.sh = NULL
        self.umap = NULL
        self.mat = NULL

    def __init__(self, plan, schema, num_threads=1, limit=-1, timeout=None):
        n = _check_positive_int(num_threads, "num_threads")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self._set_schema(schema, ITEM_INSTANCE)
        self.layout.bare = bool(getattr(plan, "bare", False))   # FilePlan.open enforces it
        self._plan = plan
        self.num_threads = n
        self.limit = limit
        self.timeout = -1.0 if timeout is None else float(timeout)
        self._threads = []
        self.epoch = 0
        self.running = False

    def __dealloc__(self):
        _packet_free(self.hold)
        self.hold = NULL
        if self.mat != NULL:
            rl_block_decref(self.mat)
            self.mat = NULL
        if self.umap != NULL:
            rl_mapped.map_decref(self.umap)
            self.umap = NULL
        if self.sh != NULL:
            _sh_stop(self.sh)             # the workers leave on their own; nothing here waits
            _sh_decref(self.sh)
            self.sh = NULL

    # -- the consumer's queue wait (no GIL) ---------------------------------------
    cdef int _pop(self, int t, _packet **out) except -1 nogil:
        """0: *out is the next packet of thread t; 1: close() from another thread."""
        cdef _queue *q = &self.sh.queues[t]
        cdef double waited = 0.0
        pthread_mutex_lock(&q.mu)
        while q.count == 0:
            if self.interrupted:
                pthread_mutex_unlock(&q.mu)
                return 1
            cond_wait_until(&q.cv, &q.mu, _now_ns() + 100000000)
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
        if t < len(self._threads) and not self._threads[t].is_alive() and self.sh.queues[t].count == 0:
            raise RuntimeError(f"open_files: worker thread {t} ended without finishing "
                               f"{unit[0] if unit else '?'!r}")

    def _interrupt(self):
        # close() from another thread: a read_next() waiting for a packet returns
        # (end of stream) within one 100 ms slice, so close() can take the lock
        self.interrupted = 1

    cdef int _start(self, int64_t first=0) except -1:
        """Start the epoch's run at unit `first` (c_skip stepped over the ones before)."""
        cdef int t
        cdef _Run run
        if self.failed:
            raise self._failure
        run = _Run.__new__(_Run)
        run.plan = self._plan
        run.units = list(self._plan.epoch_units(self.epoch))
        run.nunits = len(run.units)
        run.first = min(max(first, 0), run.nunits)
        run.num_threads = self.num_threads
        run.bare = self.layout.bare
        run.errors = [None] * self.num_threads
        run.soft = [collections.deque() for _ in range(self.num_threads)]
        run.skipped = self._skipped_of(self.epoch)
        run.umap = self.umap
        if run.umap != NULL:
            rl_map_incref(run.umap)
        run.sh = _sh_new(self.num_threads)
        _sh_incref(run.sh)
        if self.sh != NULL:                 # a start interrupted before its threads ran
            _sh_decref(self.sh)
        self.sh = run.sh
        self.run = run
        self._units = run.units
        self.nunits = run.nunits
        self.cur_unit = run.first
        self.first_unit = run.first
        self.emitted = 0
        self._threads = []
        ths = []
        for t in range(min(self.num_threads, max(self.nunits - run.first, 1))):
            ths.append(threading.Thread(target=run._worker, args=(t,), daemon=True,
                                        name=f"readerlib-open_files-{t}"))
        # all started or none (a KeyboardInterrupt never leaves a worker unstarted,
        # whose units the stream would wait for, or that _stop_threads cannot join)
        try:
            start_threads(ths)
        except BaseException:
            # a start() failed (no thread could be made): stop the ones it started
            self._threads = [th for th in ths if th.ident is not None]
            self.running = True
            self._stop_threads()
            self.running = False
            raise
        self._threads = ths
        self.running = True
        return 0

    def _skipped_of(self, epoch):
        """The chunks skip-mode files skipped in `epoch` ({path: set}), shared by
        the readers of every run of it: a set_state back into the epoch starts a
        run whose readers skip those chunks again without a second warning (a
        RecordIOReader's own rule, across the readers a run opens afresh).  The
        last few epochs are kept (a restore goes back into a recent one)."""
        if self._skipped_epochs is None:
            self._skipped_epochs = {}
        d = self._skipped_epochs.get(epoch)
        if d is None:
            d = self._skipped_epochs[epoch] = {}
            while len(self._skipped_epochs) > 4:
                del self._skipped_epochs[next(iter(self._skipped_epochs))]     # (the oldest made)
        return d

    cdef int _stop_threads(self) except -1:
        """End the run: workers told to stop, joined for at most _JOIN_S.

        A worker still inside a slow reader after that (a user function that
        sleeps) is left to leave on its own: it holds only its run, whose
        queues no later run shares, and closes its file when it goes.
        """
        if self.sh != NULL:
            with nogil:
                _sh_stop(self.sh)
        deadline = time.monotonic() + _JOIN_S
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self._threads = []
        _packet_free(self.hold)
        self.hold = NULL
        self.hold_i = 0
        if self.mat != NULL:
            rl_block_decref(self.mat)
            self.mat = NULL
        self.run = None
        _sh_decref(self.sh)
        self.sh = NULL
        self.running = False
        return 0

    cdef int _raise_soft_error(self, int t) except -1:
        # a file's data error the worker read on past: raised once, here (its
        # place in the stream); the records it lost leave the position short
        # of what set_state's unit counts say: get_state refuses this epoch
        e = self.run.soft[t].popleft()
        self._dropped = f"{e} (open_files read on after it)"
        raise e

    cdef int _raise_worker_error(self, int t) except -1:
        e = self.run.errors[t]
        if e is None:
            e = RuntimeError(f"open_files: worker thread {t} failed")
        self.failed = True
        self._failure = e
        raise e

    # -- the consumer --------------------------------------------------------------
    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef _packet *p
        cdef int t
        cdef int64_t now
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
                    if self.umap != NULL and rl_record_is_deferred(out):
                        if not self.umap.pull:
                            hand_out_verified(self, out, &self.mat)    # (raises: the record is dropped)
                        else:
                            self._records_deferred += 1
                    return 1
                if self.hold.last:
                    self.cur_unit += 1
                _packet_free(self.hold)
                self.hold = NULL
            if self.interrupted:
                return 0
            if not self.running:
                with gil:
                    self._start()
            if self.cur_unit >= self.nunits:
                return 0
            # Ctrl-C: a consumer fed slowly but steadily never waits a whole
            # slice in _pop; look here too (once a packet, at most every 100 ms),
            # before anything is taken
            now = _now_ns()
            if now - self.signals_ns >= 100000000:
                self.signals_ns = now
                with gil:
                    PyErr_CheckSignals()
            t = <int>((self.cur_unit - self.first_unit) % self.num_threads)
            if self._pop(t, &p):
                return 0                      # closed from another thread
            if p.error == 2:
                _packet_free(p)
                with gil:
                    self._raise_soft_error(t)
            if p.error:
                _packet_free(p)
                with gil:
                    self._raise_worker_error(t)
            self.hold = p
            self.hold_i = 0


    def _mapped_negotiate(self):
        """A BatchReader above (through decorators that only move items) asks
        for deferred records: returns the address of this reader's gate (see
        Design) with a reference for the caller.  Runs started from now on
        let their files' readers defer; each file's reader still decides
        (version-2 big records, not compressed, deferred reads on)."""
        return gate_ref(&self.umap)

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # At the start of an epoch (set_state: after c_reset) whole units are
        # stepped over by their record counts (the plan's chunk tables) and the
        # run starts at the unit the target falls in: the files before it are
        # not opened.  At most one unit (a chunk, or a file without a count) is
        # read and dropped, plus every unit from the first one whose count is
        # unknown without reading (a whole-file unit).  Mid-epoch (threads
        # running, records queued) it reads and drops.
        cdef int64_t done = 0, want = n
        if n <= 0:
            return 0
        if self.failed or self.running or self.hold != NULL or self.emitted != 0:
            return ReaderBase.c_skip(self, n)
        if self.limit >= 0 and want > self.limit:
            want = self.limit
        with gil:
            first, done = self._units_before(want)
            self._start(first)
            self.emitted = done
        return done + ReaderBase.c_skip(self, n - done)

    def _units_before(self, int64_t n):
        """(u, records in units [0, u)): the most whole units of this epoch, from the
        start, whose known record counts add up to at most n."""
        epoch_counts = getattr(self._plan, "epoch_counts", None)
        counts = epoch_counts(self.epoch) if epoch_counts is not None else []
        u = done = 0
        for k in counts:
            if k is None or done + k > n:
                break
            done += k
            u += 1
        return u, done

    # -- random access (readers/_random_access.pyx, docs/random_access.md) ---------
    def _open_random_access(self):
        """Record i of the stream's files in canonical order (MultiFileRecords): file
        order as given, this rank's chunks, cut at equal_batches' limit."""
        from readerlib.readers._random_access import open_multi_file_records
        return open_multi_file_records(self._plan, self.limit)

    def _random_access_size(self):
        if self._random_access is None:
            try:
                self._random_access = self._open_random_access()
            except TypeError:
                return -1
        return self._random_access.c_num_records()

    def _length(self):
        n = self._random_access_size()
        return None if n < 0 else int(n)

    cdef int c_reset(self) except -1:
        if self.running:
            self._stop_threads()
        self.failed = False
        self._failure = None
        self._dropped = None
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
    # chain restored in another process draws the same file order.  So is the
    # plan's file_order (FilePlan): "files" (all the files permuted), or "units"
    # (only those with units: states saved before 2026-12-06, which have no
    # "file_order", and a chain restored from one, keep it).
    def _epoch_state(self):
        d = {"epoch": int(self.epoch)}
        if getattr(self._plan, "shuffle_files", False):
            d["seed"] = int(self._plan.seed)
            if hasattr(self._plan, "file_order"):
                d["file_order"] = str(self._plan.file_order)
        return d

    def _state_version(self):
        # a readerlib from before the "files" order (it reads version 2 only)
        # reads the "units" order: version 2 only where the two are the same
        plan = self._plan
        if (not getattr(plan, "shuffle_files", False) or getattr(plan, "file_order", "units") == "units"
                or plan.units_order_is_files_order()):
            return 2
        return 3

    def _check_epoch_state(self, state):
        plan = self._plan
        if not getattr(plan, "shuffle_files", False) or not hasattr(plan, "file_order"):
            return
        order = state.get("file_order", "units")        # (no key: saved before 2026-12-06)
        if not isinstance(order, str) or order not in plan.FILE_ORDERS:
            raise ValueError(f"unknown file order {order!r:.80} in 'file_order' (a state saves "
                             f"'files', or none before 2026-12-06)")
        if order == "units":
            seed, epoch = state.get("seed", plan.seed), state.get("epoch", self.epoch)
            if (isinstance(seed, bool) or not isinstance(seed, int)
                    or isinstance(epoch, bool) or not isinstance(epoch, int)):
                raise ValueError(f"malformed seed {seed!r:.40} or epoch {epoch!r:.40}")
            why = plan.legacy_order_problem(seed, epoch)
            if why is not None:
                raise ValueError(f"this state was saved by a readerlib from before 2026-12-06 "
                                 f"(no 'file_order'), and {why}: it cannot be restored exactly; "
                                 f"start the chain afresh (its states restore exactly now)")

    def _set_epoch_state(self, state):
        self.epoch = int(state.get("epoch", self.epoch))
        if "seed" in state and getattr(self._plan, "shuffle_files", False):
            self._plan.seed = int(state["seed"])
        if getattr(self._plan, "shuffle_files", False) and hasattr(self._plan, "file_order"):
            self._plan.file_order = state.get("file_order", "units")      # (checked: _check_epoch_state)

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
