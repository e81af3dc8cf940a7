# cython: freethreading_compatible=False
"""Random access to indexed sources: ``reader[i]``, ``read_many``, global_shuffle.

Design:
    A source with an index (RecordIO's footer, TFRecord's chunk table,
    ArrayReader's arrays) is read at record `i` by loading the chunk that
    holds `i` and handing out a pointer into it, as sequential reading does:
    no Python object per record, and every check sequential reading makes
    (chunk CRC, schema, TFRecord data CRC) is made by the same code, because a
    chunk is loaded by a *second reader of the same file* (`clone`) whose
    sequential path reads exactly that chunk (``select_chunks([c])``, then
    `c_next` for each of its records).  The clone has its own descriptor and
    position, so random access never disturbs the source's own iteration,
    and nothing here depends on how a format lays out or verifies a chunk.
    One shortcut, which the format vouches for: when the clone says that the
    rest of the chunk its first record came from are fixed-size records at a
    stride in that record's block (``_current_run``: RecordIO, whose chunk is
    read and verified whole before its first record comes out), the slot
    takes them as that run instead of one `c_next` per record (52k calls and
    a 1.2 MB table for a 1 MiB chunk of 16-byte records: half the load's
    0.4 ms).

    `ChunkCache` keeps the records of the last `slots` chunks (least recently
    used goes first), each as (block, pointer, size) plus one reference per
    distinct block.  A hit is a comparison and a copy of three words; a miss
    costs one chunk load (pread + checks), the same work sequential reading
    does per chunk.  Memory: `slots` chunks.

    ArrayReader over one fixed field (its zero-copy case) needs no chunks:
    record i is a pointer into the array (`_ArrayRecords`).

    Deferred records.  A BatchReader above a global shuffle asks, through
    it, for the clone's deferred records (`_mapped_negotiate`: RecordIO
    version 2 chunks of big records, or an uncompressed TFRecord file's, as
    sequential reading gives them to a batch): a chunk loaded while that
    batch pulls holds descriptors (file offset, size, the record's CRC from
    the chunk's verified table, or TFRecord's own data CRC), and the
    batch reads each record straight into its row and checks it there -- one
    copy of the bytes instead of the chunk's pread plus the batch's copy.  A
    deferred record asked for at any other time (``reader[i]``, a consumer
    other than that batch) reloads its chunk the ordinary way first, so
    nobody else ever sees a descriptor.
"""
import numpy as np
cimport numpy as cnp
from libc.stdlib cimport malloc, calloc, realloc, free

from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, rl_block, rl_record, rl_core_import,
    rl_block_incref, rl_block_decref, rl_block_new_static, ITEM_INSTANCE)
from readerlib.readers._sources cimport _ChunkedSource, ArrayReader
from readerlib._mapped cimport (
    rl_map, rl_mapped, rl_mapped_import, rl_record_is_deferred, rl_deferred_may_go_out, gate_ref, gate_file)
from readerlib.errors import DataLossError

cnp.import_array()
rl_core_import()
rl_mapped_import()

__all__ = ["open_random_access", "ChunkCache", "MultiFileRecords"]


cdef struct _slot:
    int64_t chunk          # -1: empty
    int64_t tick           # last use (LRU)
    int64_t n              # records
    rl_record *recs
    int64_t rcap
    rl_block **blocks      # one reference per distinct block of recs
    int64_t nblocks
    int64_t bcap
    bint strided           # record j = base + j * stride in one block: no table to touch
    bint deferred          # loaded while a batch above pulled: its records are descriptors
    const char *base
    int64_t stride


cdef void _slot_release(_slot *s) noexcept nogil:
    cdef int64_t i
    for i in range(s.nblocks):
        rl_block_decref(s.blocks[i])
        s.blocks[i] = NULL
    s.nblocks = 0
    s.n = 0
    s.chunk = -1
    s.strided = False
    s.deferred = False


cdef inline void _slot_get(const _slot *s, int64_t j, rl_record *out) noexcept nogil:
    if s.strided:
        out.block = s.blocks[0]
        out.data = s.base + j * s.stride
        out.size = s.stride
    else:
        out[0] = s.recs[j]


cdef void _slot_stride(_slot *s) noexcept nogil:
    # Fixed-size records packed in one block (RecordIO and ArrayReader chunks of
    # a fixed schema): a hit then reads only the record, not a 24-byte table
    # entry too -- random access over a window of chunks is cache-miss bound.
    cdef int64_t j
    s.strided = False
    if s.n == 0 or s.nblocks != 1:
        return
    s.base = s.recs[0].data
    s.stride = s.recs[0].size
    for j in range(1, s.n):
        if s.recs[j].size != s.stride or s.recs[j].data != s.base + j * s.stride:
            return
    s.strided = True


cdef class ChunkCache(FileReader):
    """Records of a source by index, through a cache of its last chunks.

    Internal: what a source's `c_read_at` delegates to (see the module's
    Design).  `chunk_loads` counts chunk loads (a test and benchmark hook).
    """
    cdef ReaderBase clone
    cdef bint chunked_source       # clone is a _ChunkedSource (no select_chunks)
    cdef int64_t *starts           # chunk c holds records [starts[c], starts[c + 1])
    cdef readonly int64_t num_chunks
    cdef readonly int64_t num_records
    cdef _slot *slots
    cdef readonly int nslots
    cdef int last                  # slot of the last hit
    cdef int64_t tick
    cdef readonly int64_t chunk_loads
    cdef object _name
    cdef object run_of             # clone._current_run (RecordIO) or None
    cdef object defer_pread        # _mapped_negotiate: the batch preads deferred records (else a mapping)
    cdef rl_map *gated             # the clone's map, gated by a MultiFileRecords (a reference), or NULL
    cdef bint skip_errors          # the source skips bad chunks (RecordIOReader(on_error="skip"))

    def __init__(self, ReaderBase clone not None, starts, int nslots=2, name="", defer_pread=None,
                 skip_errors=False):
        cdef int64_t i
        st = np.ascontiguousarray(starts, dtype=np.int64)
        if st.ndim != 1 or st.shape[0] < 1 or st[0] != 0 or np.any(np.diff(st) < 0):
            raise ValueError(f"ChunkCache: bad chunk starts for {name}")
        if nslots < 1:
            raise ValueError(f"ChunkCache: nslots must be >= 1, got {nslots}")
        self._set_schema(clone.schema, ITEM_INSTANCE)
        self.layout.bare = clone.layout.bare
        self.clone = clone
        self.chunked_source = isinstance(clone, _ChunkedSource)
        self.run_of = getattr(clone, "_current_run", None)
        self.num_chunks = st.shape[0] - 1
        self.num_records = int(st[st.shape[0] - 1])
        self.starts = <int64_t *>malloc(st.shape[0] * sizeof(int64_t))
        self.slots = <_slot *>calloc(nslots, sizeof(_slot))
        if self.starts == NULL or self.slots == NULL:
            raise MemoryError()
        for i in range(st.shape[0]):
            self.starts[i] = st[i]
        self.nslots = nslots
        for i in range(nslots):
            self.slots[i].chunk = -1
        self.last = 0
        self._name = name
        self.defer_pread = defer_pread
        self.skip_errors = bool(skip_errors)

    def __dealloc__(self):
        cdef int i
        if self.gated != NULL:
            rl_mapped.map_decref(self.gated)
            self.gated = NULL
        if self.slots != NULL:
            for i in range(self.nslots):
                _slot_release(&self.slots[i])
                free(self.slots[i].recs)
                free(self.slots[i].blocks)
            free(self.slots)
            self.slots = NULL
        free(self.starts)
        self.starts = NULL

    def chunk_starts(self):
        """The chunk boundaries as an int64 array (num_chunks + 1 entries)."""
        out = np.empty(self.num_chunks + 1, np.int64)
        cdef int64_t i
        for i in range(self.num_chunks + 1):
            out[i] = self.starts[i]
        return out

    cdef int64_t c_num_records(self) except -2:
        return self.num_records

    cdef inline int64_t _chunk_of(self, int64_t index) noexcept nogil:
        cdef int64_t lo = 0, hi = self.num_chunks - 1, mid
        while lo < hi:                     # the last chunk whose start is <= index
            mid = (lo + hi + 1) >> 1
            if self.starts[mid] <= index:
                lo = mid
            else:
                hi = mid - 1
        while lo + 1 < self.num_chunks and self.starts[lo + 1] <= index:
            lo += 1                        # empty chunks share a start: take the one holding it
        return lo

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        cdef _slot *s = &self.slots[self.last]
        cdef int64_t c
        cdef int k, victim
        if s.chunk >= 0 and self.starts[s.chunk] <= index < self.starts[s.chunk] + s.n:
            _slot_get(s, index - self.starts[s.chunk], out)
            if not s.deferred or not rl_record_is_deferred(out) or rl_deferred_may_go_out(out):
                return 1
            with gil:                      # a descriptor, and not for the batch that asked
                self._load(self.last, s.chunk, index - self.starts[s.chunk])
            _slot_get(s, index - self.starts[s.chunk], out)
            return 1
        if index < 0 or index >= self.num_records:
            with gil:
                raise IndexError(f"{self._name}: index {index} out of range for "
                                 f"{self.num_records} records")
        c = self._chunk_of(index)
        self.tick += 1
        victim = 0
        for k in range(self.nslots):
            if self.slots[k].chunk == c:
                if index - self.starts[c] < self.slots[k].n:
                    victim = -1
                    self.last = k
                else:                      # kept part of a chunk whose load failed: load it again
                    victim = k
                break
            if self.slots[k].tick < self.slots[victim].tick:
                victim = k
        if victim >= 0:
            with gil:
                self._load(victim, c, index - self.starts[c])
            self.last = victim
        s = &self.slots[self.last]
        s.tick = self.tick
        _slot_get(s, index - self.starts[c], out)
        if s.deferred and rl_record_is_deferred(out) and not rl_deferred_may_go_out(out):
            with gil:                      # (as above: loaded during the batch's pull)
                self._load(self.last, c, index - self.starts[c])
            _slot_get(s, index - self.starts[c], out)
        return 1

    def _skip_message(self, err):
        """The RecordIOWarning message with which the source (on_error="skip")
        skips the chunk whose load raised `err` (what a global shuffle over it
        does), or None: the source raises it (raise mode, TFRecord, or not a
        chunk fault: a read error, a file that shrank)."""
        f = getattr(self.clone, "_skip_message", None)
        return f(err) if self.skip_errors and f is not None else None

    cdef int _load(self, int k, int64_t c, int64_t want) except -1:
        """Chunk c into slot k, read by the clone's sequential path (every check).

        A chunk whose load fails part-way (TFRecord hands out the records before
        a record that fails its CRC, as TensorFlow does) keeps the records read
        before the failure when record `want` of it is one of them: a read of
        one of those succeeds, as sequential reading gives them, and a read of
        a record after them loads the chunk again (and raises)."""
        cdef _slot *s = &self.slots[k]
        cdef int64_t n = self.starts[c + 1] - self.starts[c], i, got = 0
        cdef rl_record rec
        cdef rl_block *lastb = NULL
        cdef rl_record *r2
        cdef rl_block **b2
        cdef _ChunkedSource cs
        cdef int r = 1
        cdef object run
        _slot_release(s)
        if n > s.rcap:
            r2 = <rl_record *>realloc(s.recs, n * sizeof(rl_record))
            if r2 == NULL:
                raise MemoryError(f"{self._name}: chunk {c} of {n} records")
            s.recs = r2
            s.rcap = n
            b2 = <rl_block **>realloc(s.blocks, n * sizeof(rl_block *))
            if b2 == NULL:
                raise MemoryError(f"{self._name}: chunk {c} of {n} records")
            s.blocks = b2
            s.bcap = n
        if self.chunked_source:
            cs = <_ChunkedSource>self.clone
            cs.c_reset()
            cs.next_index = self.starts[c]
        else:
            (<object>self.clone).select_chunks([c])
        self.chunk_loads += 1
        try:
            if self.run_of is not None and n > 1:
                # the first record loads and verifies the whole chunk; when the
                # rest follow it at a fixed stride in its block (the format says
                # so: _current_run), they are not read one c_next at a time
                with nogil:
                    r = self.clone.c_next(&rec)
                if r == 1:
                    run = self.run_of()
                    if run is not None and run[0] == rec.size and run[1] == n - 1:
                        rl_block_incref(rec.block)
                        s.blocks[0] = rec.block
                        s.nblocks = 1
                        s.base = rec.data
                        s.stride = rec.size
                        s.strided = True
                        got = n
                    else:
                        rl_block_incref(rec.block)
                        s.blocks[0] = rec.block
                        s.nblocks = 1
                        lastb = rec.block
                        s.recs[0] = rec
                        got = 1
                        s.deferred = rl_record_is_deferred(&rec)
            with nogil:
                while got < n:
                    r = self.clone.c_next(&rec)
                    if r != 1:
                        break
                    if rec.block != lastb:
                        rl_block_incref(rec.block)
                        s.blocks[s.nblocks] = rec.block
                        s.nblocks += 1
                        lastb = rec.block
                    s.recs[got] = rec
                    got += 1
                    if rl_record_is_deferred(&rec):
                        s.deferred = True
            if got != n:
                raise ValueError(f"{self._name}: chunk {c} gave {got} records, its index says {n}")
            if not s.strided:
                _slot_stride(s)
        except DataLossError:
            if s.strided or got <= want or got >= n:
                _slot_release(s)
                raise
            n = got                       # the records before the failure (see above)
            _slot_stride(s)
        except BaseException:
            _slot_release(s)
            raise
        finally:
            self.clone.c_reset()          # the clone lets go of its own references
        s.n = n
        s.chunk = c
        return 0

    @property
    def records_deferred(self):
        """Records the clone handed out as descriptors (a test hook)."""
        return int(getattr(self.clone, "_records_deferred", 0))

    def _mapped_negotiate(self):
        """For a BatchReader above a global shuffle over this cache (see
        Design, "Deferred records"): the clone's map with a reference for
        the caller, or 0 (not a RecordIO or TFRecord clone, or the clone says
        no).  A TFRecord clone's deferred records are always pread."""
        from readerlib.formats._recordio import RecordIOReader
        from readerlib.formats._tfrecord import TFRecordReader
        if type(self.clone) is RecordIOReader:
            return self.clone._mapped_negotiate(pread=self.defer_pread)
        if type(self.clone) is TFRecordReader:
            return self.clone._mapped_negotiate()
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        with gil:
            raise TypeError("ChunkCache is read by index (c_read_at), not sequentially")

    cdef int c_close(self) except -1:
        cdef int i
        for i in range(self.nslots):
            _slot_release(&self.slots[i])
        self.clone.close()
        if self.gated != NULL:               # (deferred records still out hold their own)
            rl_mapped.map_decref(self.gated)
            self.gated = NULL
        return 0

    def __repr__(self):
        return (f"ChunkCache({self._name}, {self.num_records} records in {self.num_chunks} chunks, "
                f"{self.nslots} slots)")


cdef class _ArrayRecords(FileReader):
    """Record i of a one-field fixed ArrayReader: a pointer into its array."""
    cdef ArrayReader source           # keeps the array alive
    cdef rl_block *block              # a static block over the whole array
    cdef const char *base
    cdef int64_t size, n
    cdef readonly int64_t chunk_loads

    def __init__(self, ArrayReader source not None):
        self.source = source
        self._set_schema(source.schema, ITEM_INSTANCE)
        self.base = source.C.ptr[0]
        self.size = source.layout.fixed_size
        self.n = source.num_instances
        self.block = rl_block_new_static(<char *>self.base, self.size * self.n)
        if self.block == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.block != NULL:
            rl_block_decref(self.block)
            self.block = NULL

    cdef int64_t c_num_records(self) except -2:
        return self.n

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        if index < 0 or index >= self.n:
            with gil:
                raise IndexError(f"ArrayReader: index {index} out of range for {self.n} records")
        out.block = self.block
        out.data = self.base + index * self.size
        out.size = self.size
        return 1

    def chunk_starts(self):
        cr = 4096
        return np.append(np.arange(0, self.n, cr, dtype=np.int64), np.int64(self.n))

    cdef int c_next(self, rl_record *out) except -1 nogil:
        with gil:
            raise TypeError("_ArrayRecords is read by index (c_read_at), not sequentially")


def open_random_access(ReaderBase source not None, int slots=2):
    """A reader whose `c_read_at(i)` gives record i of `source` (see the module's Design).

    Each call makes a new one (its own chunk cache and, for files, its own
    descriptor), so a chain's global shuffle and a user's ``reader[i]`` never
    evict each other's records.

    Raises
    ------
    TypeError
        `source` has no index to address records by.
    """
    from readerlib.formats._recordio import RecordIOReader
    from readerlib.formats._tfrecord import TFRecordReader, _reopen_tfrecord
    from readerlib.readers._multifile import MultiFileReader
    cdef _ChunkedSource cs
    name = repr(source)
    if isinstance(source, MultiFileReader):
        return source._open_random_access()
    if isinstance(source, ArrayReader) and (<ArrayReader>source).zero_copy:
        return _ArrayRecords(source)
    if isinstance(source, _ChunkedSource):
        cs = source
        args, kwargs = source._reduce_args()
        clone = source._rebuild_with()(*args, **kwargs)
        (<_ChunkedSource>clone).chunk_records = cs.chunk_records
        n, cr = int(cs.num_instances), max(1, int(cs.chunk_records))
        starts = np.append(np.arange(0, n, cr, dtype=np.int64), np.int64(n))
        return ChunkCache(clone, starts, slots, name)
    defer_pread = None
    skip_errors = False
    if isinstance(source, RecordIOReader):
        # raise on every error (a skipped chunk cannot be addressed: the cache
        # says what the source would skip, _skip_message); low_memory off:
        # cached records are read again after a consumer copied them (deferred
        # records, though, are read as the source would read them for a batch)
        clone = RecordIOReader(source.path, on_error="raise", low_memory=False)
        defer_pread = bool(source.low_memory)
        skip_errors = source.on_error == "skip"
    elif isinstance(source, TFRecordReader):
        source._ensure_index()
        args, kwargs = source._reduce_args()
        clone = _reopen_tfrecord(*args, **kwargs)
    else:
        raise TypeError(f"{type(source).__name__} has no random access")
    if clone._describe() != source._describe():
        clone.close()
        raise ValueError(f"{name}: the file changed since it was opened (its identity "
                         f"{clone._describe()} differs): reopen it for random access")
    _, nrec = clone.chunk_table()
    starts = np.concatenate([[0], np.cumsum(np.asarray(nrec, dtype=np.int64))]).astype(np.int64)
    if int(starts[-1]) != len(source):
        clone.close()
        raise ValueError(f"{name}: the chunk table holds {int(starts[-1])} records, the reader "
                         f"{len(source)}")
    return ChunkCache(clone, starts, slots, name, defer_pread, skip_errors)


# ------------------------------------------------------------------ many files
cdef class MultiFileRecords(FileReader):
    """Record i of an `open_files` stream's files, read through one chunk cache per file.

    Internal: what `open_files(...)[i]`, `read_many` and `global_shuffle`
    read through (see `open_random_access`).  The records are the rank's
    units (its share of the files' chunks under ``shard=``) in canonical
    order -- files in the order given, chunks in file order -- whatever
    ``shuffle_files`` does to the sequential stream, cut at the
    ``equal_batches`` limit.  A segment is a run of consecutive records of
    one file (a unit); the segment of the last read is tried first, then a
    binary search over the segments' starts.

    Files are opened on first use (each its own descriptor and a 2-chunk
    cache), at most `max_open` at a time (least recently used closed first).
    A corrupt chunk raises the format's error (naming file and offset) with
    a note naming the stream's index; a file that changed since
    `open_files` planned it raises ValueError naming it.

    Deferred records (a BatchReader above a global shuffle over this, as
    over one file's chunk cache: see the module's Design): this answers with
    a map of its own that stands for no file, the *gate* the batch's pulls
    set, and gates each open file's clone map by it (rl_map_set_gate, not
    `always`: a clone defers while the gate's pull is set, i.e. while the
    batch pulls, as a single file's clone does while its own is).
    """
    cdef object plan
    cdef int64_t nseg
    cdef int64_t *gstart           # segment s: records [gstart[s], gstart[s + 1]) of the stream
    cdef int64_t *lstart           # ... = records [lstart[s], ...) of file sfile[s]
    cdef int64_t *sfile
    cdef readonly int64_t num_records
    cdef int64_t cur_seg           # segment of the last read (-1: none)
    cdef ChunkCache cur            # its file's cache
    cdef list caches               # per file: ChunkCache or None
    cdef list lru                  # open file indices, least recently used first
    cdef int max_open
    cdef object _chunk_starts
    cdef dict _expect              # file -> record counts its chunks must have (from the plan)
    cdef int64_t closed_loads
    cdef rl_map *gate              # a batch above negotiated (see the class doc), or NULL
    cdef int64_t closed_deferred   # records_deferred of the caches closed since

    def __init__(self, plan, segments, chunk_starts, caches, expect, int max_open=64):
        cdef int64_t s
        self.plan = plan
        self._set_schema(plan.schema, ITEM_INSTANCE)
        self.layout.bare = bool(plan.bare)
        self.nseg = len(segments)
        self.gstart = <int64_t *>malloc((self.nseg + 1) * sizeof(int64_t))
        self.lstart = <int64_t *>malloc(max(self.nseg, 1) * sizeof(int64_t))
        self.sfile = <int64_t *>malloc(max(self.nseg, 1) * sizeof(int64_t))
        if self.gstart == NULL or self.lstart == NULL or self.sfile == NULL:
            raise MemoryError()
        acc = 0
        for s, (f, l0, n) in enumerate(segments):
            self.gstart[s] = acc
            self.lstart[s] = l0
            self.sfile[s] = f
            acc += n
        self.gstart[self.nseg] = acc
        self.num_records = acc
        self._chunk_starts = np.asarray(chunk_starts, dtype=np.int64)
        self.caches = list(caches)
        self.lru = [f for f, c in enumerate(self.caches) if c is not None]
        self._expect = dict(expect)
        self.max_open = max(1, max_open)
        self.cur_seg = -1

    def __dealloc__(self):
        free(self.gstart); free(self.lstart); free(self.sfile)
        self.gstart = self.lstart = self.sfile = NULL
        if self.gate != NULL:
            rl_mapped.map_decref(self.gate)
            self.gate = NULL

    def _mapped_negotiate(self):
        """For a BatchReader above a global shuffle over these files: this
        reader's gate (see the class doc) with a reference for the caller.
        Each file's clone still decides (RecordIO version 2 big records)."""
        cdef bint first = self.gate == NULL
        cdef size_t addr = gate_ref(&self.gate)
        if first:
            for c in self.caches:
                if c is not None:
                    self._gate_cache(c)
        return addr

    cdef _gate_cache(self, ChunkCache c):
        """c's clone defers while the gate's pull is set (the cache keeps the
        map's reference); not beyond RL_MAP_MAX_GATED files' maps alive (each
        holds a descriptor while a deferred record of it is out: a window or
        a buffer above can hold records of many small files)."""
        if c.gated == NULL:
            c.gated = <rl_map *>gate_file(self.gate, c, 0)

    cdef _cache_closed(self, ChunkCache c):
        """A file's cache is about to close: its counts kept."""
        self.closed_loads += c.chunk_loads
        self.closed_deferred += c.records_deferred

    @property
    def records_deferred(self):
        """Records the files' clones handed out as descriptors (a test hook)."""
        return int(self.closed_deferred + sum(c.records_deferred for c in self.caches if c is not None))

    def chunk_starts(self):
        """Chunk boundaries over the whole stream (every file's chunks, in order)."""
        return self._chunk_starts.copy()

    @property
    def chunk_loads(self):
        """Chunks loaded so far, all files together (a test and benchmark hook)."""
        return int(self.closed_loads + sum(c.chunk_loads for c in self.caches if c is not None))

    @property
    def open_file_count(self):
        return sum(c is not None for c in self.caches)

    cdef int64_t c_num_records(self) except -2:
        return self.num_records

    cdef int64_t _segment_of(self, int64_t index) noexcept nogil:
        cdef int64_t lo = 0, hi = self.nseg - 1, mid
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            if self.gstart[mid] <= index:
                lo = mid
            else:
                hi = mid - 1
        while lo + 1 < self.nseg and self.gstart[lo + 1] <= index:
            lo += 1                        # empty segments share a start
        return lo

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        cdef int64_t s = self.cur_seg, local
        cdef _slot *sl
        if s < 0 or index < self.gstart[s] or index >= self.gstart[s + 1]:
            if index < 0 or index >= self.num_records:
                with gil:
                    raise IndexError(f"open_files ({len(self.caches)} files): index {index} out of "
                                     f"range for {self.num_records} records")
            s = self._segment_of(index)
            with gil:
                self._switch(s)
        local = self.lstart[s] + (index - self.gstart[s])
        sl = &self.cur.slots[self.cur.last]
        if sl.chunk >= 0 and self.cur.starts[sl.chunk] <= local < self.cur.starts[sl.chunk] + sl.n:
            _slot_get(sl, local - self.cur.starts[sl.chunk], out)     # the current chunk: no call
            if not sl.deferred or not rl_record_is_deferred(out) or rl_deferred_may_go_out(out):
                return 1                   # (a descriptor for anyone else: the cache reloads it)
        with gil:
            return self._read_slow(s, local, index, out)

    cdef int _read_slow(self, int64_t s, int64_t local, int64_t index, rl_record *out) except -1:
        try:
            return self.cur.c_read_at(local, out)
        except BaseException as e:
            f = self.sfile[s]
            e.add_note(f"open_files: while reading record {index} of the stream (record {local} "
                       f"of file {f}, {self.plan.paths[f]!r})")
            raise

    cdef int _switch(self, int64_t s) except -1:
        f = self.sfile[s]
        c = self.caches[f]
        if c is None:
            self.cur_seg = -1             # until the open below succeeds: no stale current file
            while len(self.lru) >= self.max_open:
                old = self.lru.pop(0)
                oc = self.caches[old]
                self.caches[old] = None       # first: a close that raises leaves lru and caches agreeing
                self._cache_closed(oc)
                oc.close()
            c = open_file_records(self.plan, f, self._expect.get(f))
            self.caches[f] = c
            self.lru.append(f)                # (before the gating below, which may raise)
            if self.gate != NULL:
                self._gate_cache(c)
        else:
            self.lru.remove(f)
            self.lru.append(f)
        self.cur = c
        self.cur_seg = s
        return 0

    def _skip_message(self, err):
        """ChunkCache._skip_message of the file whose chunk raised `err` (the
        last read's: its file's cache is the current one)."""
        return None if self.cur is None else self.cur._skip_message(err)

    cdef int c_next(self, rl_record *out) except -1 nogil:
        with gil:
            raise TypeError("MultiFileRecords is read by index (c_read_at), not sequentially")

    cdef int c_close(self) except -1:
        for f, c in enumerate(self.caches):
            if c is not None:
                self._cache_closed(c)
                c.close()
                self.caches[f] = None
        self.lru = []
        self.cur = None
        self.cur_seg = -1
        return 0

    def __repr__(self):
        return (f"MultiFileRecords({len(self.caches)} files, {self.num_records} records in "
                f"{self._chunk_starts.shape[0] - 1} chunks)")


def open_file_records(plan, int f, expect=None):
    """File f of an open_files plan as a ChunkCache (its own descriptor), opened the
    way the stream opens it (prefixed instances where the stream mixes forms).

    `expect`: the record counts of its chunks the plan was made with; a file
    whose chunk table now differs raises ValueError naming it.
    """
    from readerlib.readers.files import _identity_of
    path = plan.paths[f]
    src = plan.open(path)
    try:
        ident = _identity_of(src, path)
        if ident != plan.identities[f]:
            raise ValueError(f"open_files: {path!r} changed since open_files planned the stream "
                             f"(its identity {ident} differs from {plan.identities[f]}): reopen the files")
        try:
            cache = open_random_access(src, 2)
        except TypeError as e:
            raise TypeError(f"open_files: {path!r} has no random access ({e}): reader[i], read_many "
                            f"and global_shuffle need indexed files (RecordIO, TFRecord)") from None
    finally:
        src.close()
    if not isinstance(cache, ChunkCache) or bool((<ChunkCache>cache).layout.bare) != bool(plan.bare):
        cache.close()
        raise ValueError(f"open_files: {path!r} gives another instance form for random access "
                         f"than the stream does")
    if expect is not None:
        got = np.diff(cache.chunk_starts())
        if got.shape[0] != len(expect) or np.any(got != np.asarray(expect, dtype=np.int64)):
            cache.close()
            raise ValueError(f"open_files: {path!r} changed since open_files planned the stream "
                             f"(its chunk table differs): reopen the files")
    return cache


def open_multi_file_records(plan, int64_t limit=-1):
    """`MultiFileRecords` over an open_files plan (see there); TypeError naming a
    file that has no random access."""
    per_file = {}                          # file -> record counts of its chunks (from the plan)
    for i, chunks, n in plan.units:
        if chunks is not None:
            per_file.setdefault(i, []).append(int(n))
    local_of = {}
    for i, counts in per_file.items():
        acc = 0
        for c, n in enumerate(counts):
            local_of[(i, c)] = acc
            acc += n
    caches = [None] * len(plan.paths)
    segments, chunk_lens = [], []
    try:
        for i, chunks, n in plan.mine:
            if chunks is not None:
                segments.append((i, local_of[(i, int(chunks[0]))], int(n)))
                chunk_lens.append(int(n))
            else:                          # a whole-file unit: its chunk table from the file itself
                if caches[i] is None:
                    caches[i] = open_file_records(plan, i)
                st = caches[i].chunk_starts()
                segments.append((i, 0, int(st[len(st) - 1])))
                chunk_lens.extend(np.diff(st).tolist())
    except BaseException:
        for c in caches:
            if c is not None:
                c.close()
        raise
    if limit >= 0:                         # equal_batches: the first `limit` records
        cut, acc = [], 0
        for f, l0, n in segments:
            take = min(n, limit - acc)
            if take <= 0:
                break
            cut.append((f, l0, take))
            acc += take
        segments = cut
        lens, acc = [], 0
        for n in chunk_lens:
            take = min(n, limit - acc)
            if take <= 0:
                break
            lens.append(take)
            acc += take
        chunk_lens = lens
    starts = np.concatenate([[0], np.cumsum(np.asarray(chunk_lens, dtype=np.int64))]).astype(np.int64)
    return MultiFileRecords(plan, segments, starts, caches, per_file)
