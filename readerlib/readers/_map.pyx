# cython: freethreading_compatible=False
"""User functions in a compiled chain: map (per instance), map_batches, filter.

Design:
    A map is a compiled DecoratedReader: its c_next pulls records from the
    reader below without the GIL, decodes them to NumPy (fresh, writable
    arrays, as read_next() gives them), calls the function once per instance,
    checks each output against the output schema and encodes the outputs back
    into one block, which compiled readers after it (batch, shuffle,
    prefetch) move like any other.  The Python call is the only per-record
    Python work.

    Memory and allocation: outputs are carved from shared blocks (one
    thread: 64 KiB blocks; threads: one block per chunk), and for fixed-size
    schemas the last input's tuple and arrays are refilled in place when
    their refcounts show that nothing but the map holds them (a function
    that keeps its inputs gets fresh ones): allocating them per record cost
    as much as everything else together.

    Threads: with num_threads=T > 1 the map pulls a chunk of up to
    CHUNK_PER_THREAD * T records (at most CHUNK_MAX_BYTES of input, so that
    hand-offs between threads are rare), splits the function calls into T
    contiguous slices (the calling thread runs one, a pool of T - 1 threads
    the others) and encodes the outputs in input order, so the output is the
    same, record for record, whatever T is.  This pays when the function
    releases the GIL (NumPy, image decoders, most C extensions); for one
    that holds it the hand-offs cost ~10% of a cheap function's rate, so the
    map times a chunk's calls on the threads and on the calling thread alone
    and calls on whichever was faster, re-timing the other every 16 chunks
    (_threads_pay).  With T = 1 there is no chunk: one record in, one call,
    one record out.

    Errors: the outcome of every call (output or exception) is kept in input
    order; an exception is raised by the c_next that would have returned its
    record, after every record before it, with a note naming the position
    (the map's input this epoch) and the source.  The failed record is
    dropped: reading on continues with the next one, so an epoch read through
    errors yields every other record exactly once.

    State: a map keeps nothing across epochs and no randomness, so it adds
    nothing to get_state(); restoring skips its input (`c_skip`: map and
    map_batches, threaded or not, without calling the function for the
    skipped records).  A filter cannot know how many inputs its first k
    outputs took without calling the predicate, so its state records them:
    the input count after each of its last outputs (as far back as the
    readers above may have read ahead), and a restore skips that many inputs
    below (FilterReader's docstring).

    Output schema: declared with output_schema=, or inferred from the
    function's output on the first instance (read and then rewound with
    get_state()/set_state() when the map is built).  That output is kept and
    used for the first record of the first epoch, so the function still runs
    once per instance.
"""
import _thread
import threading
import os
from time import perf_counter as _perf_counter

import numpy as np
cimport cython
cimport numpy as cnp
from libc.stdlib cimport malloc, free, realloc

from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    _Chain,
    ReaderBase, DecoratedReader, rl_block, rl_record, rl_block_incref, rl_block_decref,
    rl_block_new, rl_record_consumed, ITEM_INSTANCE, ITEM_BATCH, rl_core_import)
from readerlib.readers._base import _check_positive_int, _check_reader
from readerlib.readers._codec cimport InstanceCodec, BatchCodec
from readerlib.tensor import Field, LoDTensor, Schema
from readerlib._keyed cimport keyed_of
from readerlib._keyed import _Keyed

cnp.import_array()
rl_core_import()

__all__ = ["MapReader", "MapBatchesReader", "FilterReader"]

DEF CHUNK_PER_THREAD = 512       # big chunks: a hand-off between threads costs ~10-30 us
DEF CHUNK_MAX_BYTES = 4194304     # ... but at most 4 MiB of input records in flight
DEF ARENA_BYTES = 65536          # one thread's outputs are carved from blocks of this size


def _source_of(reader):
    """The file reader at the bottom of a chain (for error messages), or None."""
    seen = 0
    while reader is not None and seen < 100:
        up = reader._upstream()
        if not up:
            return reader
        if len(up) > 1:
            return reader          # several sources (open_files): the reader names them
        reader = up[0]
        seen += 1
    return None


def _note(exc, text):
    if hasattr(exc, "add_note"):
        exc.add_note(text)


def _callable_name(fn):
    """A user function as a state describes it: its module and qualified name
    (a state saved with one function is refused by a chain mapping another)."""
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _field_name(i, in_schema, n_out):
    if in_schema is not None and i < len(in_schema):
        return in_schema.fields[i].name
    return f"f{i}"


def infer_instance_schema(output, in_schema, what):
    """The schema of one function output (tuple / dict / single array).

    Containers are tuples and dicts; anything else is one field's value.
    Names: a dict's (or a keyed Instance's / Batch's) keys; a tuple's values take the input's field names
    position by position, values past those f<i>.  A field named like an input sequence field stays
    a sequence when its value has a time axis; every other field is fixed, with
    the shape of this first output (declare output_schema= for new sequences).
    """
    if isinstance(output, (dict, _Keyed)):
        items = list(output.items())
    elif isinstance(output, tuple):
        items = [(_field_name(i, in_schema, len(output)), v) for i, v in enumerate(output)]
    else:                                   # one value (a list is a value, as in PythonReader)
        items = [(_field_name(0, in_schema, 1), output)]
    if not items:
        raise ValueError(f"{what}: the function returned an empty instance")
    fields = []
    for name, v in items:
        if not isinstance(name, str):
            raise TypeError(f"{what}: field names are str, got {name!r}")
        a = np.asarray(v)
        if a.dtype.kind in "OUSV":
            raise TypeError(f"{what}: field {name!r} has dtype {a.dtype}, not a numeric array; "
                            f"return NumPy arrays of numbers")
        src = None
        if in_schema is not None and name in in_schema.names:
            src = in_schema[name]
        if src is not None and src.lod_level and a.ndim == len(src.shape) + 1:
            fields.append(Field(name, a.dtype, a.shape[1:], lod_level=1))
        else:
            fields.append(Field(name, a.dtype, a.shape))
    return Schema(fields)


def infer_batch_schema(output, in_schema, in_padded, what):
    """(schema, padded flags) of one map_batches output (tuple / dict of LoDTensor or arrays)."""
    if isinstance(output, (dict, _Keyed)):
        items = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = [(_field_name(i, in_schema, len(output)), v) for i, v in enumerate(output)]
    else:
        items = [(in_schema.fields[0].name if len(in_schema) == 1 else "f0", output)]
    if not items:
        raise ValueError(f"{what}: the function returned an empty batch")
    fields, padded = [], []
    for name, v in items:
        if isinstance(v, LoDTensor):
            data, lod = np.asarray(v.data), v.lod
        else:
            data, lod = np.asarray(v), []
        if data.dtype.kind in "OUSV":
            raise TypeError(f"{what}: field {name!r} has dtype {data.dtype}, not a numeric array")
        if data.ndim == 0:
            raise ValueError(f"{what}: field {name!r} is a scalar; a batch field has the batch "
                             f"dimension first")
        if len(lod) > 1:
            raise ValueError(f"{what}: field {name!r} has {len(lod)} lod levels; at most one")
        was_padded = False
        if in_schema is not None and name in in_schema.names:
            was_padded = in_padded[in_schema.index(name)]
        if lod:
            fields.append(Field(name, data.dtype, data.shape[1:], lod_level=1))
            padded.append(False)
        elif was_padded and data.ndim == len(in_schema[name].shape) + 2:
            fields.append(Field(name, data.dtype, data.shape[2:], lod_level=1))
            padded.append(True)
        else:
            fields.append(Field(name, data.dtype, data.shape[1:]))
            padded.append(False)
    return Schema(fields), tuple(padded)


def _lod(data, lod):
    t = LoDTensor.__new__(LoDTensor)       # checked by BatchCodec.normalize
    t.data = data
    t.lod = lod
    return t


def padded_flags(reader):
    """Per field of a batch reader: is it a dense padded sequence field?"""
    r = reader
    for _ in range(100):
        flags = getattr(r, "padded_flags", None)
        if flags is not None:
            return tuple(flags)
        up = r._upstream()
        if len(up) != 1 or up[0].item_kind != ITEM_BATCH or up[0].schema != r.schema:
            break
        r = up[0]
    return (False,) * len(reader.schema)


def _probe_first(ReaderBase reader, fn, what):
    """fn(first item of the reader), leaving the reader where it was (top of an epoch)."""
    state = reader.get_state()
    try:
        first = reader.read_next()
    except BaseException:
        reader.set_state(state)
        raise
    if first is None:
        reader.set_state(state)
        raise ValueError(f"{what}: cannot infer the output schema, the reader is empty; "
                         f"pass output_schema=")
    try:
        out = fn(first)
    except BaseException as e:
        _note(e, f"raised by the function of {what} on the first item, called to infer the output "
                 f"schema (pass output_schema= to skip this call)")
        reader.set_state(state)
        raise
    reader.set_state(state)
    return out


# Interrupted calls.  An exception the function raises for an item (an
# Exception: it failed on that item) is that item's outcome: raised, and the
# item is gone, as in tf.data.  Any other BaseException (KeyboardInterrupt,
# SystemExit: the run was interrupted, not the item) leaves the input where
# it was: the reader holds it (its record still borrowed from the reader
# below, its count undone) and the next read takes it up again, so an
# interrupted run that reads on loses nothing and a get_state meanwhile
# counts it as not taken.  So does a MemoryError of the reader's own
# (_own_failure).  Where the failure came after the function had returned
# (its output being checked, converted or encoded), that output is kept with
# the input and the retry goes on from it: a completed call is not made
# again.  An interrupted call is: the function may be called more than once
# for an item whose call was interrupted (at least once, not exactly once).
#
# MapReader with one thread, MapBatchesReader and FilterReader hold their
# input with one _HeldInput each (taken with `next` and `output`, held with
# `hold`, dropped by c_skip with `skip` and by c_reset / c_close with
# `drop`); the threaded map holds a whole chunk instead (MapReader._fill: its
# records referenced, its completed outputs kept in the chunk's lists).
_NOT_CALLED = object()       # no completed call (a held input's, a threaded chunk's output slot)
_IN_CALL = object()          # a threaded chunk's output slot whose call runs now
_REDECODE = object()         # an input whose call was interrupted: decoded afresh before its next call


cdef inline bint _interrupted(BaseException e):
    return not isinstance(e, Exception)


cdef inline bint _own_failure(BaseException e, bint fn_raised):
    """An exception that leaves the input held: an interrupt, or a MemoryError
    of the reader's own (making the input's objects, encoding the output) --
    not the function's, which is its item's outcome."""
    return _interrupted(e) or (isinstance(e, MemoryError) and not fn_raised)


@cython.final
cdef class _HeldInput:
    """The input an own failure interrupted (see above), handed again to the
    next read: its record, borrowed from the reader below (valid until that
    reader's next c_next, which is not called while an input is held), and
    the function's output for it when the call had completed.

    The reader counts its inputs (`in_pos`: taken this epoch); a held input
    is not counted (`hold` puts the count back), a skipped one is (`skip`).
    Every read takes the kept output (`output`) before anything else, so an
    output never outlives the retry of its own input."""
    cdef rl_record rec
    cdef bint has
    cdef bint has_out
    cdef object out              # has_out: the held input's completed call's output

    def __cinit__(self):
        self.out = _NOT_CALLED

    cdef inline int next(self, ReaderBase reader, rl_record *rec) except -1 nogil:
        """*rec = the held input if there is one, else the reader's next; c_next's return."""
        if self.has:
            rec[0] = self.rec
            self.has = False
            return 1
        return reader.c_next(rec)

    cdef inline object output(self):
        """The output kept for the input `next` just handed again (let go
        here), or _NOT_CALLED: call the function."""
        if not self.has_out:
            return _NOT_CALLED
        out = self.out
        self.out = _NOT_CALLED
        self.has_out = False
        return out

    cdef inline bint hold(self, BaseException e, bint fn_raised, const rl_record *rec, object out,
                          int64_t *in_pos, int64_t pos):
        """`e` interrupted the processing of input `rec` (taken when the count
        was `pos`): an own failure holds it, with `out` (the function's output
        when its call had completed, else _NOT_CALLED), and puts the count
        back; True then.  False: `e` is the item's outcome, the input is gone."""
        if not _own_failure(e, fn_raised):
            return False
        self.rec = rec[0]
        self.has = True
        self.out = out
        self.has_out = out is not _NOT_CALLED
        in_pos[0] = pos
        return True

    cdef inline int64_t skip(self, int64_t *in_pos) noexcept nogil:
        """c_skip: the held input is the first one skipped (dropped: its record
        done with, counted in *in_pos, its kept output let go); 1 if there was one."""
        if not self.has:
            return 0
        self.has = False
        rl_record_consumed(&self.rec)
        in_pos[0] += 1
        if self.has_out:
            with gil:
                self.output()
        return 1

    cdef inline void drop(self) noexcept:
        """c_reset / c_close: the held input belonged to the epoch (or chain) left."""
        self.has = False
        self.has_out = False
        self.out = _NOT_CALLED

    cdef inline int count(self) noexcept nogil:
        """Inputs held: taken from the reader below, not counted (0 or 1)."""
        return 1 if self.has else 0


cdef class _CallPool:
    """The threaded map's workers: worker k calls the piece of a chunk posted
    to it.  The hand-offs are `_thread` locks, taken and given in compiled code:
    an interrupt while the caller waits for a piece raises before the lock is
    taken (nothing half-done), and the retry waits again.  (The stdlib's
    ThreadPoolExecutor runs Python code between its locks: an interrupt
    there left its Condition broken -- "release unlocked lock".)"""
    cdef list go          # worker k's lock: held until a piece (or the stop) is posted
    cdef list done        # worker k's lock: held until its piece is done
    cdef list jobs
    cdef list raised      # worker k: what interrupted its last piece (not an Exception), or None
    cdef list threads
    cdef readonly object pid
    cdef bint stop

    def __init__(self, int n, str name):
        cdef int k
        self.go = [_thread.allocate_lock() for k in range(n)]
        self.done = [_thread.allocate_lock() for k in range(n)]
        for k in range(n):
            self.go[k].acquire()
            self.done[k].acquire()
        self.jobs = [None] * n
        self.raised = [None] * n
        self.pid = os.getpid()
        self.threads = [threading.Thread(target=_call_pool_worker, args=(self, k), daemon=True,
                                         name=f"{name}-{k}") for k in range(n)]
        from readerlib._parallel import start_threads
        start_threads(self.threads)

    cdef post(self, int k, object job):
        self.jobs[k] = job
        self.go[k].release()

    cdef wait(self, int k):
        """Worker k's piece is done: what interrupted it (the caller raises it), or None."""
        self.done[k].acquire()
        e = self.raised[k]
        self.raised[k] = None
        return e

    def shutdown(self, bint wait):
        """Workers end after their piece in hand (a piece posted but not yet
        taken is not called); `wait`: join them."""
        cdef int k
        if not self.stop:
            self.stop = True
            for k in range(len(self.go)):
                self.jobs[k] = None
                # unlocked: a piece was posted and its worker has not taken it
                # yet; it will, see `stop` and end.  (Releasing it again raised
                # "release unlocked lock": a reset() right after an interrupt
                # in the caller's piece left the chunk held, and the next read
                # waited forever on the retired pool.)
                if self.go[k].locked():
                    self.go[k].release()
        if wait and os.getpid() == self.pid:
            for t in self.threads:
                if t.is_alive() and t is not threading.current_thread():
                    t.join()


def _call_pool_worker(_CallPool pool, int k):
    go = pool.go[k]
    done = pool.done[k]
    while True:
        go.acquire()
        job = pool.jobs[k]
        pool.jobs[k] = None
        if pool.stop or job is None:
            return
        try:
            job[0](*job[1:])
        except BaseException as e:
            # (an Exception is caught per input by _call_slice: this is the
            # function's SystemExit, KeyboardInterrupt...) raised from the
            # read by the caller, which calls the piece's rest next time
            pool.raised[k] = e
            e = None
        finally:
            job = None
            done.release()


cdef class MapReader(DecoratedReader):
    """Apply `fn` to every instance (tf.data's / Grain's map), in a compiled chain.

    Parameters
    ----------
    reader : ReaderBase
        Yields instances (for batches use `map_batches`).
    fn : callable
        Takes an instance (tuple of NumPy arrays in schema order, fresh and
        writable) and returns one: a tuple or dict of arrays (a single
        array for a one-field schema).  It may change the schema.
    num_threads : int
        Threads calling `fn` (pays when `fn` releases the GIL).  The output
        order is the input order whatever the number.
    deterministic : bool
        Accepted for tf.data compatibility; the output order is always the
        input order (False permits reordering but does not reorder).
    output_schema : Schema, optional
        The schema of `fn`'s outputs.  Inferred from the output for the first
        instance when omitted (see `infer_instance_schema`).

    Resume: `set_state` skips the reader below without calling `fn`.  A
    buffer shuffle above a map over a source with random access (directly or
    through filters) restores its buffer by reading the buffered records
    through the map, calling `fn` once for each of them (at most the buffer
    size, whatever the position): `fn` is assumed pure there, as a replay of
    the epoch assumes it.

    Raises
    ------
    Whatever `fn` raises, from the read that would have returned that
    record, with a note naming its position; TypeError / ValueError naming
    the field when an output does not fit the output schema.  Reading on
    continues with the next record.  An interrupt inside `fn` (a
    KeyboardInterrupt, SystemExit: not an Exception) leaves the record in
    the chain: reading on calls `fn` on it again (docs/reliability.md), so
    `fn` may be called more than once for an item whose call was
    interrupted.  One after `fn` returned (while its output is checked or
    encoded) keeps that output: reading on goes on from it.

    Examples
    --------
    >>> r = ArrayReader(np.arange(4)).map(lambda x: (x[0] * 2,))
    >>> [int(v[0]) for v in r]
    [0, 2, 4, 6]
    """
    cdef readonly object fn
    cdef readonly int num_threads
    cdef readonly bint deterministic
    cdef InstanceCodec incodec
    cdef InstanceCodec outcodec
    cdef rl_record *recs          # the chunk's input records (referenced) while decoding
    cdef int64_t nrecs
    cdef int64_t cap              # records per chunk
    cdef rl_block *chunk          # encoded outputs of the current chunk
    cdef int64_t *offs            # output record i is chunk.data[offs[i]:offs[i + 1]]
    cdef int64_t nchunk           # outcomes in the chunk
    cdef int64_t ichunk           # next outcome to hand out
    cdef list failures            # None, or per outcome None / the exception to raise
    cdef bint has_failures        # failures is not None
    cdef int64_t chunk_pos        # input position of outcome 0
    cdef int64_t in_pos           # inputs pulled this epoch
    cdef object upstream_error    # raised after the chunk's outcomes
    cdef object _probe            # the inference call's output, for input 0 of the first epoch
    cdef rl_block *arena          # num_threads=1: outputs are carved from it (no malloc per record)
    cdef object _spare            # num_threads=1: the last input, to refill (see _one)
    cdef object _spare_at         # ... likewise for c_read_at
    cdef object _spares           # num_threads>1: the last chunk's inputs, likewise
    cdef bint spare_ok            # fixed-size input schema: refilling can apply
    cdef readonly int64_t reused  # inputs refilled in place (a test hook)
    cdef int64_t arena_used
    cdef object _pool             # num_threads>1: the workers (_CallPool), made on first use
    cdef object _source
    cdef double spr_threads       # seconds per record of a chunk's calls on the threads (0: not measured)
    cdef double spr_serial        # ... on the calling thread alone (see _threads_pay)
    cdef int64_t fills            # chunks called so far (all epochs)
    cdef readonly int64_t threaded_chunks   # chunks whose calls ran on the threads (a test hook)
    cdef _HeldInput held          # num_threads=1: the input an own failure interrupted (see _HeldInput)
    cdef bint fn_raised           # the last call of the function raised (its item's outcome: see _own_failure)
    cdef bint pulled              # num_threads>1: recs[:nrecs] pulled and counted, their chunk not made yet
    cdef object _held_chunk       # num_threads>1: [inputs, outputs, failures, futures, probe] of a chunk
                                  # whose calls were interrupted (its records stay in recs[:nrecs])

    def __cinit__(self, *args, **kwargs):
        self.held = _HeldInput()

    def __init__(self, reader, fn, num_threads=1, deterministic=True, output_schema=None):
        _check_reader(reader, "MapReader")
        if not callable(fn):
            raise TypeError(f"map needs a callable, got {type(fn).__name__}")
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError("map works on instances and this reader yields batches; use "
                            ".map_batches(fn) for batches, or map before .batch()")
        nt = _check_positive_int(num_threads, "num_threads")
        if nt > 256:
            raise ValueError(f"num_threads must be <= 256, got {nt}")
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
        in_schema = reader.schema
        self.incodec = InstanceCodec(in_schema, (<ReaderBase>reader).layout.bare)
        probe = None
        if output_schema is None:
            reader._check_open()
            if (<ReaderBase>reader)._started:
                reader.reset()
            probe = _probe_first(reader, fn, "map")
            output_schema = infer_instance_schema(probe, in_schema, "map: the function's output")
        output_schema = Schema.coerce(output_schema)
        self.outcodec = InstanceCodec(output_schema)
        if probe is not None:
            self._probe = self.outcodec.normalize(probe, "map: output for instance 0")
        DecoratedReader.__init__(self, reader)
        self._set_schema(output_schema, ITEM_INSTANCE)
        self.layout.bare = 0
        self.fn = fn
        self.num_threads = nt
        self.deterministic = bool(deterministic)
        self.cap = 1 if nt == 1 else CHUNK_PER_THREAD * nt
        self.recs = <rl_record *>malloc(self.cap * sizeof(rl_record))
        self.offs = <int64_t *>malloc((self.cap + 1) * sizeof(int64_t))
        if self.recs == NULL or self.offs == NULL:
            raise MemoryError()
        self._source = _source_of(reader)
        self.spare_ok = self.incodec.L.n_lod == 0 and not self.incodec.L.bare

    def __dealloc__(self):
        if <void *>self.fn == NULL:
            return                   # half-made (ReaderBase.__cinit__ failed): see _base.pyx
        self._drop_chunk()
        self._drop_arena()
        free(self.recs)
        free(self.offs)
        self.recs = NULL
        self.offs = NULL
        if self._pool is not None:           # its workers end (they hold the pool, not this reader)
            self._pool.shutdown(False)

    cdef void _drop_chunk(self) noexcept:
        cdef int64_t i
        if self.recs != NULL:
            for i in range(self.nrecs):
                rl_block_decref(self.recs[i].block)
        self.nrecs = 0
        if self.chunk != NULL:
            rl_block_decref(self.chunk)
            self.chunk = NULL
        self.nchunk = 0
        self.ichunk = 0
        self.failures = None
        self.has_failures = False
        held = self._held_chunk
        self._held_chunk = None           # (first: nothing below may leave it held)
        if self.held is not None:         # (None: half-made, see __dealloc__)
            self.held.drop()
        self.pulled = False
        if held is not None and held[3] and self._pool is not None:
            # an interrupted chunk dropped with pieces still out: their workers
            # would signal "done" into the next chunk's wait; this pool retires
            # (its workers end after those pieces; close() joins them) and the
            # next chunk makes one
            pool, self._pool = self._pool, None
            pool.shutdown(False)

    cdef void _drop_arena(self) noexcept:
        if self.arena != NULL:
            rl_block_decref(self.arena)
            self.arena = NULL
        self.arena_used = 0

    cdef char *_arena_alloc(self, int64_t size) except NULL:
        """Room for one output record.  Bump allocation: a record handed out stays
        valid while its block lives (consumers that keep it hold a reference)."""
        cdef int64_t need = (size + 15) & ~(<int64_t>15)
        cdef char *p
        if self.arena == NULL or self.arena_used + need > self.arena.size:
            self._drop_arena()
            self.arena = rl_block_new(need if need > ARENA_BYTES else ARENA_BYTES)
            if self.arena == NULL:
                raise MemoryError(f"map output of {size} bytes")
        p = self.arena.data + self.arena_used
        self.arena_used += need
        return p

    cdef int _pull(self) except -1 nogil:
        """Fill recs[] from the reader below (references taken); self.nrecs counts them."""
        cdef rl_record rec
        cdef int r
        cdef int64_t nbytes = 0
        while self.nrecs < self.cap and (nbytes < CHUNK_MAX_BYTES or self.nrecs < self.num_threads):
            r = self.reader.c_next(&rec)
            if r <= 0:
                return r
            rl_block_incref(rec.block)
            self.recs[self.nrecs] = rec
            self.nrecs += 1
            nbytes += rec.size
        return 1

    def _inputs_held(self):
        """1 while an interrupted call's input waits here (num_threads=1, see _HeldInput)."""
        return self.held.count()

    def _where(self, int64_t pos):
        src = f", reading {self._source!r}" if self._source is not None else ""
        return f"instance {pos} of this epoch's input to {type(self).__name__}{src}"

    def _call_slice(self, list inputs, list outputs, list failures, Py_ssize_t a, Py_ssize_t b):
        # the inputs of [a, b) whose call has not completed (all of them, but
        # after an interrupt): an interrupted call's input is decoded afresh
        # before it is called again (the function may have changed it)
        fn = self.fn
        for i in range(a, b):
            x = inputs[i]
            if x is None or outputs[i] is not _NOT_CALLED:
                continue
            outputs[i] = _IN_CALL
            try:
                outputs[i] = fn(x)
            except Exception as e:
                failures[i] = (e, True)
                outputs[i] = None
            except BaseException:
                inputs[i] = _REDECODE
                outputs[i] = _NOT_CALLED
                raise

    cdef _CallPool _get_pool(self):
        pid = os.getpid()
        if self._pool is None or (<_CallPool>self._pool).pid != pid:   # a fork()ed child makes its own
            self._pool = _CallPool(self.num_threads - 1, "readerlib-map")
        return <_CallPool>self._pool

    cdef bint _threads_pay(self):
        """Call this chunk's function on the threads?  Whichever of the threads
        and the calling thread alone was faster per record when last timed:
        a function that holds the GIL gains nothing from threads and pays the
        hand-offs.  The threads are timed first (the first chunk always uses
        them), then the calling thread; every 16th chunk re-times the mode not
        in use.  The output is the same either way (input order)."""
        self.fills += 1
        if self.spr_threads == 0:
            return True
        if self.spr_serial == 0:
            return False
        if self.fills % 16 == 0:
            return self.spr_threads >= self.spr_serial
        return self.spr_threads < self.spr_serial

    cdef void _timed(self, bint threads, double spr) noexcept:
        cdef double *t = &self.spr_threads if threads else &self.spr_serial
        t[0] = spr if t[0] == 0 else 0.5 * (t[0] + spr)
        if t[0] == 0:
            t[0] = 1e-12

    cdef int _fill(self) except -1:
        """Read, decode, call, encode the next chunk.  0: nothing left.  An
        interrupt (see _interrupted) or a MemoryError of this reader's while
        decoding, calling or encoding leaves the chunk held: the next _fill
        finishes it."""
        cdef int64_t i, n, size, pos
        cdef int r = 1
        held = self._held_chunk
        self._held_chunk = None
        if held is None:
            held = self._fill_read()
            if held is None:
                return 0
        try:
            return self._fill_finish(held)
        except BaseException as e:
            # (the function's own exceptions are the items' outcomes, caught
            # per input: a MemoryError here is this reader's, as in _fill_read)
            if _own_failure(e, False):
                self._held_chunk = held
            raise

    cdef object _fill_read(self):
        """Pull and decode the next chunk: [inputs, outputs, failures, futures, probe],
        or None at the end.  Its records stay referenced in recs[:nrecs] until its
        calls complete."""
        cdef int64_t i, n
        cdef int r = 1
        if not self.pulled:
            self._drop_chunk()
            try:
                with nogil:
                    r = self._pull()
            except BaseException as e:
                self.upstream_error = e
            n = self.nrecs
            if n == 0:
                if self.upstream_error is not None:
                    e = self.upstream_error
                    self.upstream_error = None
                    raise e
                return None
            self.chunk_pos = self.in_pos
            self.in_pos += n
            # from here a MemoryError making the chunk's lists leaves the
            # records for the next read (they were dropped with the chunk)
            self.pulled = True
        n = self.nrecs
        probe = self._probe if self.chunk_pos == 0 else None
        inputs = [_REDECODE] * n       # decoded below
        if probe is not None:
            inputs[0] = None           # its output is the inference call's
        failures = [None] * n          # None, or (exception, raised by fn?)
        held = [inputs, [_NOT_CALLED] * n, failures, None, probe]
        self.pulled = False
        self._probe = None
        spares = self._spares            # the last chunk's inputs, refilled where unshared
        self._spares = None
        nspare = len(spares) if spares is not None else 0
        try:
            for i in range(1 if probe is not None else 0, n):
                x = None
                if i < nspare:
                    x = spares[i]
                    spares[i] = None
                if x is not None and self.incodec.refill(<tuple>x, self.recs[i].data, self.recs[i].size):
                    self.reused += 1
                else:
                    x = None
                    try:
                        x = self.incodec.decode(self.recs[i].data, self.recs[i].size)
                    except ValueError as e:
                        failures[i] = (e, False)
                inputs[i] = x
                x = None
        except BaseException as e:
            if _own_failure(e, False):
                # this reader's own allocation failed (not the record's fault,
                # nor the function's): the chunk is held, the inputs not made
                # yet are decoded on the next read (the next read dropped the
                # chunk: one MemoryError lost all of it)
                self._held_chunk = held
            raise
        return held

    cdef int _redecode(self, list inputs, list failures) except -1:
        """Decode the inputs marked _REDECODE (an interrupted call's, or not
        decoded yet when the chunk was held) from their records."""
        cdef Py_ssize_t i
        for i in range(len(inputs)):
            if inputs[i] is _REDECODE:
                try:
                    inputs[i] = self.incodec.decode(self.recs[i].data, self.recs[i].size)
                except ValueError as e:
                    failures[i] = (e, False)
                    inputs[i] = None
        return 0

    cdef int _wait_pieces(self, list held) except -1:
        """Wait for the workers' pieces of the held chunk still out (held[3]).
        What interrupted a piece (the function's SystemExit on a worker) is
        raised here, as on the calling thread: the chunk stays held and the
        next read calls the piece's rest.  In a fork()ed child the parent's
        workers are gone: a call one of them had in progress counts as not
        made, and the caller calls what is left."""
        cdef _CallPool pool = <_CallPool>self._pool
        futs = held[3]
        if pool is None or pool.pid != os.getpid():
            inputs, outputs = held[0], held[1]
            for i in range(len(outputs)):
                if outputs[i] is _IN_CALL:
                    outputs[i] = _NOT_CALLED
                    inputs[i] = _REDECODE
            held[3] = None
            self._pool = None                # (_get_pool makes this process's own)
            return 0
        err = None
        while futs:
            e = pool.wait(futs[len(futs) - 1])
            futs.pop()
            if err is None:
                err = e
        held[3] = None
        if err is not None:
            raise err
        return 0

    cdef int _fill_finish(self, list held) except -1:
        """Call the function on the held chunk's inputs not yet called, encode the outputs."""
        cdef int64_t i, n, size, pos
        inputs, outputs, failures, futs, probe = held
        n = len(inputs)
        if futs is not None:
            # an interrupted chunk: the workers' pieces finish first, then the
            # calls left run here
            self._wait_pieces(held)
            futs = None
            self._redecode(inputs, failures)
            self._call_slice(inputs, outputs, failures, 0, n)
        elif self.nrecs == n:
            self._redecode(inputs, failures)
            nt = self.num_threads if n > 1 else 1
            if nt > 1 and not self._threads_pay():
                nt = 1
            t0 = _perf_counter()
            if nt == 1:
                self._call_slice(inputs, outputs, failures, 0, n)
            else:
                self.threaded_chunks += 1
                pool = self._get_pool()
                bounds = [(k * n) // nt for k in range(nt + 1)]
                futs = held[3] = []          # the workers whose pieces are out
                for k in range(1, nt):
                    (<_CallPool>pool).post(k - 1, (self._call_slice, inputs, outputs, failures,
                                                   bounds[k], bounds[k + 1]))
                    futs.append(k - 1)
                self._call_slice(inputs, outputs, failures, bounds[0], bounds[1])
                self._wait_pieces(held)
                futs = None
            if self.num_threads > 1 and n > 1:
                self._timed(nt > 1, (_perf_counter() - t0) / n)
        if self.nrecs:
            # every call completed: the input records go
            for i in range(self.nrecs):
                rl_record_consumed(&self.recs[i])
                rl_block_decref(self.recs[i].block)
            self.nrecs = 0
        any_failure = False
        arrays = [None] * n
        size = 0
        if self.chunk != NULL:         # an interrupted encoding's
            rl_block_decref(self.chunk)
            self.chunk = NULL
        for i in range(n):
            if failures[i] is not None:
                any_failure = True
                continue
            if i == 0 and probe is not None:
                arrays[0] = probe                               # checked when the map was built
            else:
                try:
                    arrays[i] = self.outcodec.normalize(outputs[i], "map: the function's output")
                except (TypeError, ValueError) as e:
                    failures[i] = (e, False)
                    any_failure = True
                    continue
            size += self.outcodec.encoded_size(arrays[i])
        self.chunk = rl_block_new(size)
        if self.chunk == NULL:
            raise MemoryError(f"map chunk of {size} bytes")
        pos = 0
        for i in range(n):
            self.offs[i] = pos
            if arrays[i] is not None:
                pos += self.outcodec.encode_into(arrays[i], self.chunk.data + pos)
        self.offs[n] = pos
        outputs = None
        arrays = None
        if self.spare_ok:
            self._spares = inputs
        held[:] = [None] * 5
        self.nchunk = n
        self.ichunk = 0
        self.failures = failures if any_failure else None
        self.has_failures = any_failure
        return 1

    cdef int _next_py(self, rl_record *out) except -1:
        cdef int64_t i
        while True:
            if self.ichunk >= self.nchunk:
                if self._held_chunk is None and not self.pulled and self.upstream_error is not None:
                    e = self.upstream_error
                    self.upstream_error = None
                    self._drop_chunk()
                    raise e
                if self._fill() == 0:
                    return 0
            i = self.ichunk
            self.ichunk += 1
            if self.failures is not None and self.failures[i] is not None:
                e, by_fn = self.failures[i]
                self.failures[i] = None
                where = self._where(self.chunk_pos + i)
                _note(e, f"raised by the function of MapReader on {where}" if by_fn else f"at {where}")
                raise e
            out.block = self.chunk
            out.data = self.chunk.data + self.offs[i]
            out.size = self.offs[i + 1] - self.offs[i]
            return 1

    cdef int _one(self, rl_record *rec, rl_record *out) except -1:
        """num_threads=1: the record just read -> one call -> one record out (no
        read-ahead).  An own failure holds the record (see _HeldInput): the
        next c_next takes it up again -- calling the function again if its
        call was what the failure interrupted, else going on from the output
        that call returned."""
        cdef int64_t pos = self.in_pos
        self.in_pos += 1
        self.fn_raised = False
        x = None
        y = self.held.output()                    # a held input's completed call's output
        try:
            if self._probe is not None and pos == 0:
                arrays = self._probe              # the inference call's output, checked
            else:
                self._probe = None
                if y is _NOT_CALLED:
                    # The last input's tuple and arrays are refilled in place when
                    # the function kept no reference to them (fixed-size schemas):
                    # nobody can tell, and it saves allocating them per record.
                    spare = self._spare
                    self._spare = None
                    x = self._decode(spare, rec, pos, False)
                    if x is spare:
                        self.reused += 1
                    spare = None
                    y = self._fn(x, pos, False)
                arrays = self._normalize(y, pos, False)
            self._emit(arrays, out)
        except BaseException as e:
            if not self.held.hold(e, self.fn_raised, rec, y, &self.in_pos, pos):
                rl_record_consumed(rec)          # the item's outcome: its record is done with
            raise
        # consumed once its output is made (a big record's pages may go: a held
        # record is read again)
        rl_record_consumed(rec)
        self._probe = None
        if self.spare_ok:
            self._spare = x
        return 1

    cdef object _decode(self, object spare, rl_record *rec, int64_t pos, bint at_index):
        """The input tuple of record `rec`: `spare` (the last one, when fn kept
        no reference to it) refilled in place, else a new one; a bad record's
        error gets a note naming the item (see _call)."""
        if spare is not None and self.incodec.refill(<tuple>spare, rec.data, rec.size):
            return spare
        try:
            return self.incodec.decode(rec.data, rec.size)
        except ValueError as e:
            _note(e, f"at {self._where_item(pos, at_index)}")
            raise

    cdef object _call(self, object x, int64_t pos, bint at_index):
        """fn(x), normalized to the output schema's arrays; errors get a note
        naming the item (instance `pos` of this epoch's input, or, at_index,
        record `pos` of the source)."""
        return self._normalize(self._fn(x, pos, at_index), pos, at_index)

    cdef object _fn(self, object x, int64_t pos, bint at_index):
        """fn(x); what it raises gets a note naming the item (see _call) and
        sets fn_raised (see _own_failure)."""
        try:
            return self.fn(x)
        except Exception as e:
            self.fn_raised = True
            _note(e, f"raised by the function of MapReader on {self._where_item(pos, at_index)}")
            raise

    cdef object _normalize(self, object y, int64_t pos, bint at_index):
        """fn's output `y` as the output schema's arrays; a misfit's error gets
        a note naming the item (see _call)."""
        try:
            return self.outcodec.normalize(y, "map: the function's output")
        except (TypeError, ValueError) as e:
            _note(e, f"at {self._where_item(pos, at_index)}")
            raise

    cdef int _emit(self, object arrays, rl_record *out) except -1:
        """The output arrays encoded into the arena, as record `out`."""
        cdef int64_t size = self.outcodec.encoded_size(arrays)
        cdef char *p = self._arena_alloc(size)
        self.outcodec.encode_into(arrays, p)
        out.block = self.arena
        out.data = p
        out.size = size
        return 1

    def _where_item(self, int64_t pos, bint at_index):
        return f"record {pos} of the source of {type(self).__name__}" if at_index else self._where(pos)

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        # fn(the record `index` of the source), for a buffer shuffle above that
        # restores its buffer by position (ShuffleReader, "Restore through maps
        # and filters"): fn is called again for each buffered record, so it is
        # assumed pure (as a replay, which calls it for every earlier record, is).
        # The sequential position is untouched.  Valid until the next call.
        cdef rl_record rec
        self.reader.c_read_at(index, &rec)
        with gil:
            return self._call_at(index, &rec, out)

    cdef int _call_at(self, int64_t index, rl_record *rec, rl_record *out) except -1:
        # the last input's tuple is refilled in place when fn kept no reference
        # to it (as _one does): a restore reads a whole buffer through here
        x = self._spare_at
        self._spare_at = None
        x = self._decode(x, rec, index, True)
        self._emit(self._call(x, index, True), out)
        if self.spare_ok:
            self._spare_at = x
        return 1

    cdef int c_next(self, rl_record *out) except -1 nogil:
        # The GIL only for the Python work: once per record (one thread), once
        # per chunk (threads; its records are handed out without it).
        cdef rl_record rec
        cdef int r
        cdef int64_t i
        if self.num_threads == 1:
            r = self.held.next(self.reader, &rec)   # (see _one)
            if r <= 0:
                return r
            with gil:
                return self._one(&rec, out)
        if self.ichunk < self.nchunk and not self.has_failures:
            i = self.ichunk
            self.ichunk += 1
            out.block = self.chunk
            out.data = self.chunk.data + self.offs[i]
            out.size = self.offs[i + 1] - self.offs[i]
            return 1
        with gil:
            return self._next_py(out)

    cdef int c_reset(self) except -1:
        self._drop_chunk()
        self._drop_arena()
        self._spare = None
        self._spares = None
        self.in_pos = 0
        self.upstream_error = None
        self._probe = None
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        pool = self._pool                    # (a pool _drop_chunk retires is joined too)
        self._drop_chunk()
        self._drop_arena()
        self._spare = None
        self._spares = None
        self._probe = None
        self._pool = None
        if pool is not None:
            pool.shutdown(True)
        self.reader.close()
        return 0

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # One output per input: skipping outputs skips inputs, without calling fn
        # (so set_state over a map is as cheap as over its source).  Threads:
        # the outcomes already computed (the chunk in flight) come first, each
        # as c_next would hand it out (a failed one raises, as there), then
        # the inputs below; the chunk is dropped, so the next read pulls the
        # next input.
        cdef int64_t got, done = 0
        cdef rl_record rec
        cdef bint pending
        if n <= 0:
            return 0
        if self.num_threads == 1:
            done = self.held.skip(&self.in_pos)   # the next input is the held one, if any
            got = self.reader.c_skip(n - done)
            self.in_pos += got
            return done + got
        with gil:
            pending = self._held_chunk is not None or self.pulled
            if pending:                      # an interrupted chunk's calls are finished first
                self._fill()
        while done < n and self.ichunk < self.nchunk:
            if self.has_failures:
                if self.c_next(&rec) != 1:
                    return done
            else:
                self.ichunk += 1
            done += 1
        if done == n:
            return done
        with gil:
            pending = self.upstream_error is not None
        if pending:
            # the chunk ended with an error below: c_next raises it now
            if self.c_next(&rec) != 1:
                return done
            done += 1
            if done == n:
                return done
        with gil:
            self._drop_chunk()
        got = self.reader.c_skip(n - done)
        self.in_pos += got
        return done + got

    def _length(self):
        from readerlib.readers._slice import length_of
        return length_of(self.reader)

    def _describe(self):
        return {"fn": _callable_name(self.fn), "schema": self.schema.to_json()}

    def _reduce_args(self):
        return (self.fn,), {"num_threads": int(self.num_threads), "deterministic": bool(self.deterministic),
                            "output_schema": self.schema}

    def __repr__(self):
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"MapReader({self.reader!r}, {name}, num_threads={self.num_threads})"


cdef class MapBatchesReader(DecoratedReader):
    """Apply `fn` to every batch (vectorised work), in a compiled chain.

    Parameters
    ----------
    reader : ReaderBase
        Yields batches (after `.batch()`, `.padded_batch()` ...).
    fn : callable
        Takes a batch (tuple of LoDTensor in schema order, views of the batch)
        and returns one: a tuple, list or dict of LoDTensor (NumPy arrays for
        fixed fields), all holding the same number of instances.  Returning
        the input tensors unchanged costs no copy.
    output_schema : Schema, optional
        Inferred from the output for the first batch when omitted.

    Raises
    ------
    Whatever `fn` raises, with a note naming the batch's position; ValueError
    / TypeError naming the field when an output does not fit the schema.
    An interrupt (not an Exception) leaves the batch in the chain, as for
    `map`: `fn` is called on it again if its call was interrupted, not if
    it had returned.
    """
    cdef readonly object fn
    cdef BatchCodec incodec
    cdef BatchCodec outcodec
    cdef readonly tuple padded_flags
    cdef rl_block *hold
    cdef int64_t in_pos
    cdef bint same_schema
    cdef object _probe
    cdef object _source
    cdef _HeldInput held          # the input batch an own failure interrupted (see _HeldInput)
    cdef bint fn_raised           # the last call of the function raised (its item's outcome: see _own_failure)

    def __cinit__(self, *args, **kwargs):
        self.held = _HeldInput()

    def __init__(self, reader, fn, output_schema=None):
        _check_reader(reader, "MapBatchesReader")
        if not callable(fn):
            raise TypeError(f"map_batches needs a callable, got {type(fn).__name__}")
        if reader.item_kind != ITEM_BATCH:
            raise TypeError("map_batches works on batches and this reader yields instances; call "
                            ".batch(n) first, or use .map(fn) for instances")
        in_padded = padded_flags(reader)
        self.incodec = BatchCodec(reader.schema, in_padded)
        probe = None
        if output_schema is None:
            reader._check_open()
            if (<ReaderBase>reader)._started:
                reader.reset()
            probe = _probe_first(reader, fn, "map_batches")
            output_schema, flags = infer_batch_schema(probe, reader.schema, in_padded,
                                                      "map_batches: the function's output")
        else:
            output_schema = Schema.coerce(output_schema)
            flags = tuple(f.lod_level == 1 and f.name in reader.schema.names
                          and in_padded[reader.schema.index(f.name)] for f in output_schema)
        self.outcodec = BatchCodec(output_schema, flags)
        self.padded_flags = flags
        if probe is not None:
            self.outcodec.normalize(probe, "map_batches: output for batch 0")
            self._probe = probe
        DecoratedReader.__init__(self, reader)
        self._set_schema(output_schema, ITEM_BATCH)
        self.fn = fn
        self.same_schema = output_schema == reader.schema and flags == in_padded
        self._source = _source_of(reader)

    def __dealloc__(self):
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL

    cdef tuple _call(self, rl_record *rec, int64_t pos):
        """(fn's output, the input batch or None): the one Python call per batch."""
        if self._probe is not None and pos == 0:
            res = self._probe
            return res, None
        self._probe = None
        batch = self.incodec.wrap(rec)
        try:
            res = self.fn(batch)
        except Exception as e:
            self.fn_raised = True
            src = f", reading {self._source!r}" if self._source is not None else ""
            _note(e, f"raised by the function of MapBatchesReader on batch {pos} of this "
                     f"epoch{src}")
            raise
        return res, batch

    cdef bint _unchanged(self, object res, object batch):
        """fn returned its input tensors themselves (in a tuple)."""
        cdef Py_ssize_t k
        if not self.same_schema or batch is None or not isinstance(res, tuple) or \
                len(<tuple>res) != len(<tuple>batch):
            return False
        if isinstance(res, _Keyed) and type(res) is not type(batch):
            return False                     # keyed by other names: matched by name
        for k in range(len(<tuple>res)):
            if (<tuple>res)[k] is not (<tuple>batch)[k]:
                return False
        return True

    cdef object _process(self, rl_record *rec, rl_record *out):
        """Input batch `rec` -> fn -> its output, encoded as record *out
        (c_next), or with out NULL returned as a batch (read_next).  An own
        failure holds the input (see _HeldInput): the next read takes it up
        again -- calling fn again if its call was what the failure
        interrupted, else going on from the output that call returned."""
        cdef int64_t pos = self.in_pos
        self.in_pos += 1
        self.fn_raised = False
        result = None
        done = self.held.output()            # a held input's completed call's (output, input batch)
        try:
            if done is _NOT_CALLED:
                done = self._call(rec, pos)
            res, batch = <tuple>done
            if out != NULL:
                self._apply(rec, out, res, batch, pos)
            else:
                result = self._as_batch(res, batch, pos)
        except BaseException as e:
            self.held.hold(e, self.fn_raised, rec, done, &self.in_pos, pos)
            raise
        self._probe = None                   # (batch 0's output came from the inference call)
        return result

    def _inputs_held(self):
        """1 while an interrupted call's input batch waits here (see _HeldInput)."""
        return self.held.count()

    cdef int _apply(self, rl_record *rec, rl_record *out, object res, object batch,
                    int64_t pos) except -1:
        """fn's output `res` for input `rec` (wrapped as `batch`) as record *out."""
        if self._unchanged(res, batch):      # hand the input record on, no copy
            rl_block_incref(rec.block)
            self.hold = rec.block
            out[0] = rec[0]
            return 1
        try:
            self.hold = self.outcodec.encode(res, "map_batches: the function's output")
        except (TypeError, ValueError) as e:
            _note(e, f"at batch {pos} of this epoch's input to MapBatchesReader")
            raise
        out.block = self.hold
        out.data = self.hold.data
        out.size = self.hold.size
        return 1

    cdef object _as_batch(self, object res, object batch, int64_t pos):
        """fn's output `res` for input `batch` as the batch read_next returns."""
        if self._unchanged(res, batch):
            return batch
        try:
            parts = self.outcodec.normalize(res, "map_batches: the function's output")
        except (TypeError, ValueError) as e:
            _note(e, f"at batch {pos} of this epoch's input to MapBatchesReader")
            raise
        return keyed_of(self.schema, True, [_lod(d, [] if o is None else [o]) for d, o in parts])

    def read_next(self):
        """The next batch, or None at the end of the epoch (see ReaderBase.read_next).

        Read directly (the last reader of a chain), the function's output is
        returned as it is, checked but not copied into a block and wrapped
        again; the bookkeeping mirrors ReaderBase.read_next.
        """
        cdef rl_record rec
        cdef int r
        cdef _Chain ch
        if self._closed:
            self._check_open()
        self._fork_check()
        try:
            with self._lock:
                if self._closed:
                    self._check_open()
                self._check_chain()
                ch = self._enter("read_next")
                try:
                    self._begin_read()
                    if self.hold != NULL:
                        rl_block_decref(self.hold)
                        self.hold = NULL
                    with nogil:
                        r = self.held.next(self.reader, &rec)
                    if r == 0:
                        return None
                    batch = self._process(&rec, NULL)
                    self._position += 1
                    return batch
                finally:
                    ch.busy = False
        finally:
            if self._chain.close_pending and not self._chain.busy:
                # a close() that found this read holding the chain (from another
                # thread, or from inside it) left the closing to it: as ReaderBase.read_next
                self._deferred_closes()

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        r = self.held.next(self.reader, &rec)
        if r <= 0:
            return r
        with gil:
            self._process(&rec, out)
        return 1

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # one batch out per batch in: skip below, without calling fn
        cdef int64_t got, done
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        if n <= 0:
            return 0
        done = self.held.skip(&self.in_pos)  # the next input is the held one, if any
        got = self.reader.c_skip(n - done)
        self.in_pos += got
        return done + got

    cdef int c_reset(self) except -1:
        self.held.drop()
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        self.in_pos = 0
        self._probe = None
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self.held.drop()
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        self._probe = None
        self.reader.close()
        return 0

    def _length(self):
        from readerlib.readers._slice import length_of
        return length_of(self.reader)

    def _describe(self):
        return {"fn": _callable_name(self.fn), "schema": self.schema.to_json()}

    def _reduce_args(self):
        return (self.fn,), {}       # the output schema and padding are inferred again

    def __repr__(self):
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"MapBatchesReader({self.reader!r}, {name})"


DEF F_RING = 65536            # outputs a filter's restore can rewind (items read ahead above it)
DEF F_MASK = F_RING - 1
DEF F_PASSES = 64             # ... and passes of a multi_pass/repeat above it that it skips whole


def _pack_counts(counts):
    """Non-decreasing input counts as a short string: the first, then the
    differences as uint64, deflated, base64."""
    import base64, zlib
    c = np.asarray(counts, np.int64)
    raw = np.diff(c).astype("<u8").tobytes() if c.shape[0] > 1 else b""
    return int(c[0]) if c.shape[0] else 0, base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def _unpack_counts(int64_t first, text, int64_t n, where):
    import base64, zlib
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except Exception as e:
        raise ValueError(f"{where} (input counts do not decode: {e})") from None
    if len(raw) != 8 * max(n - 1, 0):
        raise ValueError(f"{where} ({len(raw)} bytes of input counts, expected {8 * max(n - 1, 0)})")
    d = np.frombuffer(raw, "<u8")
    if d.shape[0] and (d > (1 << 62)).any():
        raise ValueError(f"{where} (an input count out of range)")
    out = np.empty(n, np.int64)
    if n:
        out[0] = first
        np.cumsum(d.astype(np.int64), out=out[1:])
        out[1:] += first
    return out


cdef class FilterReader(DecoratedReader):
    """Keep the items for which `predicate(item)` is true (tf.data's filter).

    The predicate gets an instance (tuple of fresh NumPy arrays) or a batch
    (tuple of LoDTensor) and returns a bool.  Kept records pass on unchanged
    (no copy).  An exception in the predicate is raised with a note naming the
    position; reading on continues with the next item.  An interrupt (not an
    Exception) leaves the item in the chain, as for `map`: the predicate is
    called on it again if its call was interrupted, not if it had returned.

    Resume: `get_state()` records how many items the filter took from the
    reader below for each of its last outputs (as many as the readers above it
    may have read ahead), so `set_state()` positions the reader below with
    `c_skip` (O(1) over sources with random access) instead of calling the
    predicate again for every item up to the position.  The restored chain
    yields what the saved one would have, even when the predicate is not
    deterministic (a random or stateful predicate): a replay would call it
    again and could keep a different set of items, so this is more exact
    than replaying, not less.  Where the count is not known exactly (an error
    below the filter this epoch, a position further back than the saved
    outputs reach, an earlier pass of a multi_pass/repeat above it) the
    restore replays, calling the predicate: never a wrong position.

    A buffer shuffle directly above (one or more) filters over a source with
    random access keeps each buffered record's position in that source and
    restores its buffer by reading those records there: the predicate is not
    called for them (they passed it when first read), and this filter is
    positioned by its saved counts.  Only the fallback replay calls the
    predicate again, and so assumes it deterministic (as tf.data and Grain
    assume for checkpoints): a random predicate may then keep other items.
    """
    cdef readonly object predicate
    cdef object _spare
    cdef InstanceCodec incodec
    cdef BatchCodec batchcodec
    cdef int64_t in_pos
    cdef object _source
    # Resume (see the docstring): ring[e & F_MASK] = in_pos after output e
    cdef int64_t *ring
    cdef readonly int64_t emitted    # items kept (handed out) this epoch
    cdef readonly int64_t epoch      # resets so far (each pass of a multi_pass above is one)
    cdef int64_t base_n              # the ring holds outputs from base_n on (a restore's position)
    cdef int64_t base_in             # in_pos at base_n outputs
    cdef bint track_ok               # the counts are valid this epoch (no error below)
    cdef bint in_upstream            # still set on entry: the last call below raised
    cdef bint at_end                 # the reader below ran out this epoch (in_pos: all its items)
    cdef bint has_pending
    cdef object _pending             # set_state's saved counts: (epoch, first output, counts, end, ended)
    cdef object _passes              # epoch -> (outputs, inputs) of the last epochs read to their end
    cdef object _saved_passes        # ... as set_state found them in the state
    cdef readonly int64_t restores   # positioned without the predicate (a test hook)
    cdef _HeldInput held             # the item an own failure interrupted (see _HeldInput)
    cdef bint fn_raised           # the last call of the function raised (its item's outcome: see _own_failure)

    def __cinit__(self, *args, **kwargs):
        self.ring = <int64_t *>malloc(F_RING * sizeof(int64_t))
        if self.ring == NULL:
            raise MemoryError()
        self.track_ok = True
        self.held = _HeldInput()

    def __dealloc__(self):
        free(self.ring)
        self.ring = NULL

    def __init__(self, reader, predicate):
        _check_reader(reader, "FilterReader")
        if not callable(predicate):
            raise TypeError(f"filter needs a callable, got {type(predicate).__name__}")
        DecoratedReader.__init__(self, reader)
        if reader.item_kind == ITEM_INSTANCE:
            self.incodec = InstanceCodec(reader.schema, (<ReaderBase>reader).layout.bare)
        else:
            self.batchcodec = BatchCodec(reader.schema, padded_flags(reader))
        self.predicate = predicate
        self._source = _source_of(reader)

    @property
    def padded_flags(self):
        return None if self.batchcodec is None else self.batchcodec.padded

    @property
    def track(self):
        """True: get_state reads this filter's counts (background readers above pause)."""
        return True

    cdef int _keep_or_hold(self, rl_record *rec) except -1:
        """Keep input `rec`?  (1 / 0.)  An own failure holds the input (see
        _HeldInput): the next c_next takes it up again -- calling the predicate
        again if its call was what the failure interrupted, else going on from
        the verdict that call returned."""
        cdef int64_t pos = self.in_pos
        self.in_pos += 1
        self.fn_raised = False
        k = self.held.output()               # a held input's completed call's verdict
        try:
            if k is _NOT_CALLED:
                k = self._predicate(rec, pos)
            return self._verdict(k, pos)
        except BaseException as e:
            self.held.hold(e, self.fn_raised, rec, k, &self.in_pos, pos)
            raise

    cdef object _predicate(self, rl_record *rec, int64_t pos):
        """predicate(item `pos`, made from `rec`)."""
        item = None
        if self.incodec is not None:
            item = self._spare             # refilled when the predicate kept nothing (see MapReader)
            self._spare = None
            if item is None or not self.incodec.refill(<tuple>item, rec.data, rec.size):
                item = None
                item = self.incodec.decode(rec.data, rec.size)
        else:
            item = self.batchcodec.wrap(rec)
        try:
            k = self.predicate(item)
        except Exception as e:
            self.fn_raised = True
            src = f", reading {self._source!r}" if self._source is not None else ""
            _note(e, f"raised by the predicate of FilterReader on item {pos} of this epoch{src}")
            raise
        if self.incodec is not None and self.incodec.L.n_lod == 0 and not self.incodec.L.bare:
            self._spare = item
        return k

    cdef int _verdict(self, object k, int64_t pos) except -1:
        """The predicate's return `k` as 1 (keep) / 0; a TypeError if it is not a bool."""
        if isinstance(k, (bool, np.bool_)):
            return 1 if k else 0
        if isinstance(k, (int, np.integer)) or (isinstance(k, np.ndarray) and k.shape == ()):
            return 1 if bool(k) else 0
        raise TypeError(f"filter: the predicate must return a bool, got {type(k).__name__}"
                        f"{' of shape ' + str(k.shape) if isinstance(k, np.ndarray) else ''} "
                        f"for item {pos} of this epoch")

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r, keep
        if self.has_pending:
            with gil:
                self._drop_pending(False)
        if self.in_upstream:
            self.track_ok = False           # the reader below raised: its count no longer adds up
        while True:
            self.in_upstream = True
            r = self.held.next(self.reader, out)
            self.in_upstream = False
            if r <= 0:
                if not self.at_end and self.track_ok:
                    with gil:
                        self._passed()
                self.at_end = True
                return r
            with gil:
                keep = self._keep_or_hold(out)
            if keep:
                self.ring[self.emitted & F_MASK] = self.in_pos
                self.emitted += 1
                return 1

    def _passed(self):
        # an epoch read to its end: how many outputs and inputs (a restore through a
        # multi_pass/repeat above skips this pass whole with them)
        if self._passes is None:
            self._passes = {}
        self._passes[int(self.epoch)] = (int(self.emitted), int(self.in_pos))
        while len(self._passes) > F_PASSES:
            del self._passes[min(self._passes)]

    def _drop_pending(self, bint later_too):
        # reading drops the saved counts of this (or an earlier) epoch; those of
        # a later pass wait for it
        info = self._pending
        if info is not None and (later_too or info[0] <= self.epoch):
            self._pending = None
            self.has_pending = False

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # From set_state's saved counts where they reach (the reader below skips
        # with its own c_skip, the predicate is not called); else replay.
        cdef int64_t got
        if n <= 0:
            return 0
        if self.has_pending:
            with gil:
                got = self._skip_saved(n)
            if got >= 0:
                return got
        return ReaderBase.c_skip(self, n)

    cdef int _skip_below_to(self, int64_t up, str what) except -1:
        """The reader below skips to its item `up` with its own c_skip (the
        predicate is not called); a ValueError when it has fewer items.  An
        input held (an interrupted predicate call's) was taken from below
        already: it is the first of those skipped."""
        cdef int64_t want, got
        if up > self.in_pos:
            self.held.skip(&self.in_pos)
        want = up - self.in_pos
        self.in_upstream = True
        try:
            with nogil:
                got = self.reader.c_skip(want)
        finally:
            self.in_upstream = False
        if got != want:
            self.in_pos += got
            self.track_ok = False
            raise ValueError(f"set_state: the filter's saved {what} needs {up} items from the "
                             f"reader below it, which has {self.in_pos}")
        self.in_pos = up
        return 0

    def _skip_saved(self, int64_t n):
        """Skip n outputs by the saved input counts; -1 when they do not reach."""
        cdef int64_t first, target, up, last, ended, before = self.emitted
        ep, first, counts, end, ended = self._pending
        if ep < self.epoch:
            self._drop_pending(True)
            return -1
        if self.in_upstream or not self.track_ok:
            return -1
        if ep > self.epoch:
            # an earlier pass of a multi_pass/repeat above: skipped whole if it was read to its end
            whole = self._saved_passes.get(int(self.epoch)) if self._saved_passes else None
            if whole is None or self.emitted + n < whole[0] or whole[1] < self.in_pos:
                return -1
            self._skip_below_to(whole[1], f"pass {self.epoch}")
            self.emitted = whole[0]
            self.base_n = self.emitted
            self.base_in = self.in_pos
            self.at_end = True
            self._passed()
            self._spare = None
            return self.emitted - before
        target = self.emitted + n
        last = first + counts.shape[0] - 1
        if target >= last and ended >= 0:
            # the epoch ends there: every item below goes (those after the last
            # output were dropped: the saved chain read them), and this pass is
            # recorded even if nothing above asks this filter again
            target = last
            up = ended
        elif target < first or target > last:
            return -1
        else:
            up = end if (end >= 0 and target == last) else int(counts[target - first])
        if up < self.in_pos:
            return -1
        self._skip_below_to(up, "position")
        self.emitted = target
        self.base_n = target
        self.base_in = up
        self.at_end = ended >= 0 and up == ended
        if self.at_end:
            # positioned at the end: a reader above that asks no further (a buffer
            # shuffle whose source had run out) must still find this pass recorded
            self._passed()
        self._spare = None
        self.restores += 1
        return target - before

    cdef int64_t _count(self, int64_t m) noexcept:
        # in_pos after m outputs, for base_n <= m <= emitted (and m > emitted - F_RING)
        if m == self.base_n:
            return self.base_in
        return self.ring[(m - 1) & F_MASK]

    def _input_count_address(self):
        """For a buffer shuffle above: the address of this filter's input count
        (in_pos; its last output is input in_pos - 1), which the shuffle reads
        once per record it takes to keep that record's position in the source
        below (see ShuffleReader, "Restore through filters").  Valid while this
        reader lives; the shuffle holds it as its source."""
        return <size_t>&self.in_pos

    def _saved_pass_outputs(self):
        """For a buffer shuffle above: how many items this filter hands out in this
        epoch, when set_state's saved counts know it (the epoch, or this pass of a
        multi_pass/repeat above, was read to its end); else None.  The shuffle
        then skips the epoch whole with c_skip, which skips below by the counts."""
        info = self._pending
        if info is None or info[0] < self.epoch:
            return None
        if info[0] == self.epoch:
            ep, first, counts, end, ended = info
            return int(first + counts.shape[0] - 1) if ended >= 0 else None
        whole = self._saved_passes.get(int(self.epoch)) if self._saved_passes else None
        return None if whole is None else int(whole[0])

    def _counts_exact(self):
        """True while in_pos counts exactly the items taken from the reader below
        this epoch (no error below, no call below in progress)."""
        return bool(self.track_ok and not self.in_upstream)

    def _inputs_ahead(self, a):
        """For a shuffle below: how many items this filter may have taken beyond
        the chain's position when the readers above hold up to `a` of its
        outputs read ahead (None: not known)."""
        cdef int64_t E = self.emitted, lo
        if a is None:
            return None
        lo = max(self.base_n, E - F_RING + 1)
        if E - <int64_t>a < lo:
            return None
        # (an item held by an interrupted predicate call was taken too)
        return int(self.in_pos - self._count(E - <int64_t>a)) + self.held.count()

    def _resume_state(self, above):
        """get_state's live part: the input counts after each of the outputs the
        chain's position can fall on (None: not known exactly, restore replays)."""
        from readerlib.readers._shuffle import _ahead_bound
        cdef int64_t E = self.emitted, lo, want, m
        if not self.track_ok or self.in_upstream:
            return {"filter": None}
        G = _ahead_bound(above, self)
        lo = max(self.base_n, E - F_RING + 1, 0)
        want = lo if G is None else max(E - <int64_t>G, lo)
        counts = np.empty(E - want + 1, np.int64)
        for m in range(want, E + 1):
            counts[m - want] = self._count(m)
        first_count, text = _pack_counts(counts)
        return {"filter": {"epoch": int(self.epoch), "first": int(want), "n": int(E - want + 1),
                           "count0": first_count, "counts": text,
                           # nothing above reads ahead: the position is exactly now, inputs
                           # dropped after the last output (a predicate that raised) included
                           "end": int(self.in_pos) if G == 0 else -1,
                           # the reader below ran out: a position past the last output is the end
                           "ended": int(self.in_pos) if self.at_end else -1,
                           "passes": [[e, o, i] for e, (o, i) in sorted((self._passes or {}).items())
                                      if e < self.epoch]}}

    def _epoch_state(self):
        return {"epoch": int(self.epoch)}

    def _check_epoch_state(self, state):
        # set_state calls this before it touches the chain: a bad state leaves it as it was
        self._parse_epoch_state(state)

    def _set_epoch_state(self, state):
        ep, passes, pending = self._parse_epoch_state(state)      # (checked: _check_epoch_state)
        self.epoch = ep
        self._pending = pending
        self.has_pending = pending is not None
        if pending is not None:
            self._saved_passes = passes

    def _parse_epoch_state(self, state):
        """(epoch, saved passes, pending counts) from this filter's entry of a
        state; ValueError naming what does not fit.  Touches nothing."""
        ep = state.get("epoch", self.epoch)
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < -1 or ep > (1 << 62):
            raise ValueError(f"set_state: the filter's saved epoch {ep!r} is not an int in range")
        epoch = ep
        info = state.get("filter")
        if info is None:
            return epoch, None, None
        where = "set_state: the filter's saved counts are inconsistent"
        if not isinstance(info, dict):
            raise ValueError(f"set_state: the filter's saved counts must be a dict, got "
                             f"{type(info).__name__}")
        try:
            ep, first, n = int(info["epoch"]), int(info["first"]), int(info["n"])
            count0, end, text = int(info["count0"]), int(info["end"]), info["counts"]
            ended = int(info.get("ended", -1))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where} ({e!r})") from None
        # hand-edited values past int64 would raise OverflowError in the C-typed code
        for name, v in (("epoch", ep), ("first", first), ("count0", count0), ("end", end),
                        ("ended", ended)):
            if v < -1 or v > (1 << 62):
                raise ValueError(f"{where} ({name} {v} out of range)")
        if first < 0 or n < 1 or n > F_RING + 1 or count0 < first or not isinstance(text, str):
            raise ValueError(f"{where} (first output {first}, {n} counts from {count0})")
        counts = _unpack_counts(count0, text, n, where)
        if (np.diff(counts) < 1).any() or (end >= 0 and end < counts[n - 1]) or \
                (ended >= 0 and ended < counts[n - 1]):
            raise ValueError(f"{where} (the counts do not grow by at least one per output)")
        passes = {}
        saved = info.get("passes", [])
        if not isinstance(saved, list):
            raise ValueError(f"{where} (passes must be a list, got {type(saved).__name__})")
        for item in saved:
            try:
                e, o, i = (int(v) for v in item)
            except (TypeError, ValueError) as err:
                raise ValueError(f"{where} (a pass {item!r}: {err})") from None
            if o < 0 or i < o or i > (1 << 62) or e < -1 or e > (1 << 62):
                raise ValueError(f"{where} (pass {e}: {o} outputs from {i} inputs)")
            passes[e] = (o, i)
        return epoch, passes, (ep, first, counts, end, ended)

    cdef int c_reset(self) except -1:
        self.in_pos = 0
        self.emitted = 0
        self.base_n = 0
        self.base_in = 0
        self.at_end = False
        self.epoch += 1
        self.track_ok = True
        self.in_upstream = False
        self.held.drop()
        self._spare = None
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self.held.drop()
        self._spare = None
        self.reader.close()
        return 0

    def _describe(self):
        return {"predicate": _callable_name(self.predicate)}

    def _reduce_args(self):
        return (self.predicate,), {}

    def __repr__(self):
        name = getattr(self.predicate, "__qualname__", type(self.predicate).__name__)
        return f"FilterReader({self.reader!r}, {name})"
