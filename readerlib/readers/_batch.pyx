# cython: freethreading_compatible=False
"""BatchReader: group instances into one batch block (Paddle's BatchReader)."""
import numpy as np
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memmove, memset

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib._parallel cimport parallel_for, threads_for
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64, rl_load_i64,
    layout_parse, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _check_reader, _record_schema_error
from readerlib.tensor import LoDTensor

cdef int64_t RL_MAX_EMPTY_ROWS = (<int64_t>1) << 31           # as layout_parse (_base.pyx) caps a zero-width sequence field

rl_core_import()

# ---- deferred records (include/rl_mapped.h): big records of a v2 RecordIO
# file or an uncompressed TFRecord file, read and verified here, into the batch
from readerlib._mapped cimport (
    rl_map, rl_mapped_api, rl_dblock, rl_mapped, rl_mapped_import, rl_record_is_deferred,
    rl_deferred_copy, rl_deferred_copy1, rl_deferred_peek, rl_deferred_materialize, RL_DEF_LAYOUT, RL_DEF_MAX_PIECES,
    rl_map_copied, rl_stage_reads, rl_stage_nt)


def _set_staged_deferred_reads(flag):
    """A/B and test hook: deferred records (pread mode) read straight into
    the batch row, CRC-checked there (False, the default), or through a small
    cached buffer and the fused CRC + copy (True); "malloc": staged through a
    buffer allocated per record (the A/B against the per-thread buffer);
    returns the old setting."""
    global rl_stage_reads
    old = "malloc" if rl_stage_reads == 2 else bool(rl_stage_reads)
    rl_stage_reads = 2 if flag == "malloc" else int(bool(flag))
    return old

def _set_staged_stores(mode):
    """A/B hook: the staged pread copy's stores into the batch, "nt"
    (streaming, the default) or "plain"; returns the old mode."""
    global rl_stage_nt
    if mode not in ("nt", "plain"):
        raise ValueError(f"mode must be 'nt' or 'plain', got {mode!r}")
    old = "nt" if rl_stage_nt else "plain"
    rl_stage_nt = mode == "nt"
    return old


rl_mapped_import()

__all__ = ["BatchReader"]


def _pass_through_types():
    # decorators that only move items (never read a record's bytes): a batch
    # above them may take deferred records from the file reader below
    # (the shuffles, which buffer items, hand a deferred one to any other consumer verified)
    from readerlib.readers._shuffle import ShuffleReader
    from readerlib.readers._global_shuffle import WindowShuffleReader
    from readerlib.readers._passes import MultiPassReader, ShardReader
    from readerlib.readers._base import ReaderHolder
    return (ShuffleReader, WindowShuffleReader, MultiPassReader, ShardReader, ReaderHolder)


cdef object _mapped_source(object reader):
    """The file reader (RecordIOReader, TFRecordReader), open_files' reader
    (its workers' file readers answer) or global shuffle (its chunk cache's
    clone answers) at the bottom of a chain of pass-through decorators, or None."""
    from readerlib.formats._recordio import RecordIOReader
    from readerlib.formats._tfrecord import TFRecordReader
    from readerlib.readers._global_shuffle import GlobalShuffleReader
    from readerlib.readers._multifile import MultiFileReader
    through = _pass_through_types()
    while True:
        if (type(reader) is RecordIOReader or type(reader) is TFRecordReader
                or type(reader) is GlobalShuffleReader or type(reader) is MultiFileReader):
            return reader
        if type(reader) not in through:
            return None
        reader = reader.reader


cdef inline void _copied(const rl_record *r) noexcept nogil:
    rl_map_copied((<rl_dblock *>r.block).map, r.data, r.size)


# Batch block: int64 header [n, nfields, (rows, data_off, lod_off) * nfields],
# then 64-byte aligned sections (read by readers/_base.pyx: _wrap_batch).
from readerlib.readers._align cimport _align64


# Parallel batch copies (readerlib._parallel bodies): each item is one instance
# copied to its own place in the batch, so any split gives the same bytes.
cdef struct _copy_fixed_job:
    char *dst
    rl_record *recs
    int64_t rb
    int *codes                    # deferred records: RL_DEF_* of each copy (NULL: none deferred)
    int64_t *offs


cdef void _copy_fixed_records(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _copy_fixed_job *j = <_copy_fixed_job *>ctx
    cdef int64_t i
    for i in range(begin, end):
        if j.codes != NULL and rl_record_is_deferred(&j.recs[i]):
            # fused CRC + copy from the mapping (SIGBUS-guarded on this thread)
            j.codes[i] = rl_deferred_copy1(&j.recs[i], j.dst + i * j.rb, 1, &j.offs[i])
        else:
            rl_copy_big(j.dst + i * j.rb, j.recs[i].data, j.rb)
    rl_copy_fence()   # streaming stores: each copying thread fences its own


cdef struct _assemble_job:
    const rl_layout *L
    char *base
    const int64_t *doff
    const int64_t *loff
    const char **parsed_ptrs
    int64_t *parsed_rows
    rl_record *recs
    int *codes                    # deferred records: RL_DEF_* of each copy (NULL: none deferred)
    int64_t *offs


cdef int _copy_deferred_instance(_assemble_job *j, int64_t i) noexcept nogil:
    """Deferred sequence record i to its places in the batch, in one fused
    CRC + copy: its pieces in record order (each sequence field's row count
    to a scratch word, then its rows; fixed fields to their rows); then the
    counts read are checked against the ones the batch was sized with."""
    cdef const rl_layout *L = j.L
    cdef int nf = L.nfields
    cdef int f, k = 0, code
    cdef int64_t rb, pos = 0
    cdef int64_t *rows = j.parsed_rows + i * nf
    cdef int64_t counts[RL_MAX_FIELDS]
    cdef char *dst[2 * RL_MAX_FIELDS]
    cdef int64_t src[2 * RL_MAX_FIELDS]
    cdef int64_t lens[2 * RL_MAX_FIELDS]
    if L.bare:                    # the rows alone (TFRecord): one piece, checked by the CRC only
        dst[0] = j.base + j.doff[0] + (<int64_t *>(j.base + j.loff[0]))[i] * L.row_bytes[0]
        src[0] = 0
        lens[0] = rows[0] * L.row_bytes[0]
        return rl_deferred_copy(&j.recs[i], 1, dst, src, lens, 1, &j.offs[i])
    for f in range(nf):
        rb = L.row_bytes[f]
        if L.lod[f]:
            dst[k] = <char *>&counts[f]
            src[k] = pos
            lens[k] = 8
            pos += 8
            k += 1
            dst[k] = j.base + j.doff[f] + (<int64_t *>(j.base + j.loff[f]))[i] * rb
            lens[k] = rows[f] * rb
        else:
            dst[k] = j.base + j.doff[f] + i * rb
            lens[k] = rb
        src[k] = pos
        pos += lens[k]
        k += 1
    code = rl_deferred_copy(&j.recs[i], k, dst, src, lens, 1, &j.offs[i])
    if code == 0:
        for f in range(nf):
            if L.lod[f] and rl_load_i64(<char *>&counts[f]) != rows[f]:
                return RL_DEF_LAYOUT
    return code


cdef void _copy_instances(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    """Copy held instances [begin, end) (parsed) into their places in the batch
    (the caller lets them go afterwards, see _next_fixed_parallel)."""
    cdef _assemble_job *j = <_assemble_job *>ctx
    cdef const rl_layout *L = j.L
    cdef int nf = L.nfields
    cdef int f
    cdef int64_t i, rb, row0
    cdef const char **ptrs
    cdef int64_t *rows
    for i in range(begin, end):
        if j.codes != NULL and rl_record_is_deferred(&j.recs[i]):
            j.codes[i] = _copy_deferred_instance(j, i)
            continue
        ptrs = j.parsed_ptrs + i * nf
        rows = j.parsed_rows + i * nf
        for f in range(nf):
            rb = L.row_bytes[f]
            if L.lod[f]:
                row0 = (<int64_t *>(j.base + j.loff[f]))[i]
                rl_copy_big(j.base + j.doff[f] + row0 * rb, ptrs[f], rows[f] * rb)
            else:
                memcpy(j.base + j.doff[f] + i * rb, ptrs[f], rb)
    rl_copy_fence()   # streaming stores: each copying thread fences its own


def _no_slots(bs):
    raise MemoryError(f"BatchReader: no memory for batch_size={bs}'s per-record slots "
                      f"(about {bs * (sizeof(rl_record) + sizeof(int) + sizeof(int64_t)):,} bytes)")


cdef class BatchReader(DecoratedReader):
    """Group `batch_size` instances into one batch (Paddle's BatchReader).

    Each field becomes a LoDTensor: fixed fields stack to `[B, *shape]`;
    sequence fields concatenate their rows and carry offsets `lod[0]`
    (each instance's offsets shifted by the running total).

    Parameters
    ----------
    reader : ReaderBase
        Must yield instances (not batches).
    batch_size : int
    drop_last : bool
        Drop a final batch smaller than `batch_size`.
    """
    cdef readonly int64_t batch_size
    cdef readonly bint drop_last
    # A batch an exception interrupted (the upstream raised, or a record did
    # not fit the schema) is kept, not dropped: the next call goes on filling
    # it, so reading on after an error loses only the record that failed.
    # c_next is `except -1` (an exception jumps straight out), so this state
    # is kept up to date *before* every upstream call, never fixed up after.
    cdef rl_record *recs          # records held (sequence schemas, parallel copy)
    cdef int64_t nrecs
    cdef bint recs_deferred       # recs[:nrecs] holds a deferred record (set as it arrives)
    cdef rl_block *pend           # fixed schemas: the batch being filled
    cdef int64_t pend_n           # rows of `pend` already copied
    cdef rl_block *hold
    cdef const char **parsed_ptrs
    cdef int64_t *parsed_rows
    cdef rl_map *dmap             # negotiated: the file reader below hands out deferred records
    cdef int *dcodes              # per record of a parallel copy: RL_DEF_* (deferred records)
    cdef int d_last               # sequence schemas: the last sequence field with rows of > 0
                                  # bytes (its row count follows from the size), or -1
    cdef int64_t d_min            # the smallest record the schema allows (no rows)
    cdef int64_t *doffs
    # A deferred record that failed its check this epoch was dropped: the
    # batches after it hold one record more of the source than position x
    # batch_size says, so get_state refuses (ReaderBase._dropped names it)
    # until the next epoch.

    def __init__(self, reader, batch_size, drop_last=False):
        _check_reader(reader, "BatchReader")
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError("BatchReader needs a reader of instances; this one already yields "
                            "batches (call .batch() once)")
        bs = _check_positive_int(batch_size, "batch_size")
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be a bool, got {type(drop_last).__name__}")
        DecoratedReader.__init__(self, reader)
        self.item_kind = ITEM_BATCH
        self.batch_size = bs
        self.drop_last = bool(drop_last)
        self.recs = <rl_record *>calloc(bs, sizeof(rl_record))
        if self.recs == NULL:
            _no_slots(bs)
        if self.layout.n_lod:
            # per-record parse of a sequence batch, kept between sizing and copying
            self.parsed_ptrs = <const char **>calloc(bs * self.layout.nfields, sizeof(char *))
            self.parsed_rows = <int64_t *>calloc(bs * self.layout.nfields, sizeof(int64_t))
            if self.parsed_ptrs == NULL or self.parsed_rows == NULL:
                _no_slots(bs)
        self.dcodes = <int *>calloc(bs, sizeof(int))
        self.doffs = <int64_t *>calloc(bs, sizeof(int64_t))
        if self.dcodes == NULL or self.doffs == NULL:
            _no_slots(bs)
        self._negotiate()

    def _negotiate(self):
        """Ask the source chain for deferred records (big v2 RecordIO records,
        big records of uncompressed TFRecord files; read and verified by this
        batch's copy): only through
        decorators that only move items (fixed-size and sequence schemas).
        Every epoch asks again (the switch, a holder's new reader).  Bare
        sequence records (TFRecord's) too: the source decides what it defers."""
        cdef size_t addr = 0
        cdef int f
        self.d_min = 0
        self.d_last = -1
        for f in range(self.layout.nfields):
            self.d_min += 8 if self.layout.lod[f] else self.layout.row_bytes[f]
            if self.layout.lod[f]:
                self.d_last = f if self.layout.row_bytes[f] > 0 else self.d_last
        if self.layout.bare:
            self.d_min = 0               # no row-count word: the size is the rows
        src = _mapped_source(self.reader)
        if src is not None:
            addr = src._mapped_negotiate()
        if self.dmap != NULL:
            rl_mapped.map_decref(self.dmap)
            self.dmap = NULL
        if addr:
            from readerlib._core import _sigbus_guard_ensure
            self.dmap = <rl_map *>addr
            _sigbus_guard_ensure()       # on top of any handler installed since (faulthandler)

    @property
    def _mapped(self):
        """Test hook: True when this batch takes deferred records."""
        return self.dmap != NULL

    cdef inline int _pull(self, rl_record *rec) except -1 nogil:
        """The upstream's next item; deferred records may come only in this call."""
        cdef int r
        if self.dmap == NULL:
            return self.reader.c_next(rec)
        self.dmap.pull = 1
        try:
            r = self.reader.c_next(rec)
        finally:
            self.dmap.pull = 0
        return r

    cdef object _deferred_error(self, const rl_record *r, int code, int64_t off):
        from readerlib.formats._recordio import _deferred_error_py
        err = _deferred_error_py(<size_t>r.block, code, off, self.schema)
        self._dropped = str(err)
        return err

    cdef void _release(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.nrecs):
            rl_block_decref(self.recs[i].block)
        self.nrecs = 0
        self.recs_deferred = False

    cdef void _drop_partial(self) noexcept nogil:
        """Let go of an interrupted batch (reset, close)."""
        self._release()
        if self.pend != NULL:
            rl_block_decref(self.pend)
            self.pend = NULL
        self.pend_n = 0

    def __dealloc__(self):
        free(self.parsed_ptrs)
        free(self.parsed_rows)
        free(self.dcodes)
        free(self.doffs)
        if self.recs != NULL:
            self._drop_partial()
            free(self.recs)
            self.recs = NULL
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        if self.dmap != NULL:
            rl_mapped.map_decref(self.dmap)
            self.dmap = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r
        cdef int nf = self.layout.nfields
        cdef int64_t n = self.nrecs       # > 0: a batch an exception interrupted
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        if self.layout.n_lod == 0:
            return self._next_fixed(out)
        while n < self.batch_size:
            r = self._pull(&rec)          # may raise: recs[:nrecs] stay held
            if r == 0:
                break
            # parsed as it arrives (the data is hot), so that a malformed
            # record is rejected alone and the batch around it survives
            if self.dmap != NULL and rl_record_is_deferred(&rec):
                self._deferred_rows(&rec, self.parsed_rows + n * nf)   # may raise (the record is dropped)
                self.recs_deferred = True
            elif layout_parse(&self.layout, rec.data, rec.size, self.parsed_ptrs + n * nf,
                              self.parsed_rows + n * nf) != 0:
                with gil:
                    raise _record_schema_error("BatchReader", self.schema,
                                               rec.data[:rec.size], self.layout.bare, index=n)
            rl_block_incref(rec.block)
            self.recs[n] = rec
            n += 1
            self.nrecs = n
        if n == 0 or (n < self.batch_size and self.drop_last):
            self._release()
            return 0
        r = self._assemble(n, out)        # may raise (MemoryError): the records stay held
        self._release()
        return r

    cdef int _next_fixed(self, rl_record *out) except -1 nogil:
        """Fixed-size instances: copy each into the batch as it arrives."""
        cdef const rl_layout *L = &self.layout
        cdef int nf = L.nfields
        cdef int f, r
        cdef int64_t n = 0, rb, B = self.batch_size
        cdef int64_t doff[RL_MAX_FIELDS]
        cdef rl_record rec
        cdef int64_t pos = _align64(16 + 24 * nf)
        for f in range(nf):
            doff[f] = pos
            pos = _align64(pos + B * L.row_bytes[f])
        cdef rl_block *b = self.pend      # not NULL: a batch an exception interrupted
        if b == NULL:
            b = rl_block_new(pos)
            if b == NULL:
                with gil:
                    raise MemoryError(f"batch of {pos} bytes")
            self.pend = b
            self.pend_n = 0
        n = self.pend_n
        cdef char *base = b.data
        rb = L.row_bytes[0]
        # an interrupted parallel batch holds records (nrecs > 0): it goes on there
        if self.nrecs > 0 or (n == 0 and nf == 1 and rb >= 32768 and threads_for(B * rb) > 1):
            return self._next_fixed_parallel(out, b, doff[0], pos)
        cdef char *dsts[RL_MAX_FIELDS]
        cdef int code
        cdef int64_t foff
        while n < B:
            r = self._pull(&rec)          # may raise: pend / pend_n keep the rows so far
            if r == 0:
                break
            if rec.size != L.fixed_size:
                if self.dmap != NULL and rl_record_is_deferred(&rec):
                    self._deferred_bad(&rec)  # bytes not in memory (pread: data is an offset): raises
                with gil:
                    raise _record_schema_error("BatchReader", self.schema,
                                               rec.data[:rec.size], L.bare, index=n)
            if self.dmap != NULL and rl_record_is_deferred(&rec):
                # verified as it is copied; a record that fails is dropped (its row is reused)
                for f in range(nf):
                    dsts[f] = base + doff[f] + n * L.row_bytes[f]
                code = rl_deferred_copy(&rec, nf, dsts, L.fixed_offset, L.row_bytes, 1, &foff)
                if code != 0:
                    rl_copy_fence()
                    with gil:
                        raise self._deferred_error(&rec, code, foff)
                _copied(&rec)
            elif nf == 1:
                rl_copy_big(base + doff[0] + n * rb, rec.data, rb)
            else:
                for f in range(nf):
                    rl_copy_big(base + doff[f] + n * L.row_bytes[f], rec.data + L.fixed_offset[f],
                                L.row_bytes[f])
            rl_record_consumed(&rec)
            n += 1
            self.pend_n = n
        self.pend = NULL
        self.pend_n = 0
        rl_copy_fence()
        if n == 0 or (n < B and self.drop_last):
            rl_block_decref(b)
            return 0
        rl_store_i64(base, n)
        rl_store_i64(base + 8, nf)
        for f in range(nf):
            rl_store_i64(base + 16 + 24 * f, n)
            rl_store_i64(base + 24 + 24 * f, doff[f])
            rl_store_i64(base + 32 + 24 * f, -1)
        out.block = b
        out.data = base
        out.size = pos
        self.hold = b
        return 1

    cdef int _next_fixed_parallel(self, rl_record *out, rl_block *b, int64_t doff, int64_t size) except -1 nogil:
        """One big fixed field: gather the batch's records, then copy them on
        several threads (one core's copy does not reach the memory bandwidth)."""
        cdef int64_t n = self.nrecs, i, B = self.batch_size, rb = self.layout.row_bytes[0]
        cdef int r
        cdef rl_record rec
        cdef char *base = b.data
        while n < B:
            r = self._pull(&rec)          # may raise: pend and recs[:nrecs] stay held
            if r == 0:
                break
            if rec.size != rb:
                if self.dmap != NULL and rl_record_is_deferred(&rec):
                    self._deferred_bad(&rec)  # bytes not in memory (pread: data is an offset): raises
                with gil:
                    raise _record_schema_error("BatchReader", self.schema,
                                               rec.data[:rec.size], self.layout.bare, index=n)
            rl_block_incref(rec.block)
            self.recs[n] = rec
            n += 1
            self.nrecs = n
        self.pend = NULL                  # b is this call's from here on
        if n == 0 or (n < B and self.drop_last):
            self._release()
            rl_block_decref(b)
            return 0
        cdef _copy_fixed_job job
        job.dst = base + doff
        job.recs = self.recs
        job.rb = rb
        job.codes = self.dcodes if self.dmap != NULL else NULL
        job.offs = self.doffs
        if job.codes != NULL:
            for i in range(n):
                job.codes[i] = 0
        parallel_for(threads_for(n * rb), n, _copy_fixed_records, &job)
        rl_copy_fence()
        if job.codes != NULL:
            for i in range(n):
                if job.codes[i] != 0:
                    self._deferred_failed(i, b)     # raises; the batch goes on without record i
                if rl_record_is_deferred(&self.recs[i]):
                    _copied(&self.recs[i])
        # Then let the records go (low_memory: one madvise each), on this thread
        # after the copies: a madvise while another thread of the process runs
        # sends it a TLB-shootdown interrupt, 256 per batch if done in the loop.
        for i in range(n):
            rl_record_consumed(&self.recs[i])
        self._release()
        rl_store_i64(base, n)
        rl_store_i64(base + 8, 1)
        rl_store_i64(base + 16, n)
        rl_store_i64(base + 24, doff)
        rl_store_i64(base + 32, -1)
        out.block = b
        out.data = base
        out.size = size
        self.hold = b
        return 1

    cdef int _deferred_failed(self, int64_t i, rl_block *b) except -1 nogil:
        """Record i of a parallel copy failed its check: raise its error, and
        keep the batch being filled (pend) with the records around it, so that
        reading on loses only that record (the next call copies them again)."""
        cdef int64_t k
        cdef rl_record bad = self.recs[i]
        with gil:
            err = self._deferred_error(&bad, self.dcodes[i], self.doffs[i])
        for k in range(i + 1, self.nrecs):
            self.recs[k - 1] = self.recs[k]
        self.nrecs -= 1
        self.pend = b
        rl_block_decref(bad.block)
        with gil:
            raise err

    cdef int _deferred_rows(self, const rl_record *r, int64_t *rows) except -1 nogil:
        """A deferred sequence record's rows per field, from its size and (for
        all but the last sequence field) the row counts read from the file:
        what layout_parse checks of a record in memory.  The counts are not
        verified yet: the fused copy checks the CRC of every byte and that the
        counts it copied are these.  A record that does not fit raises (its
        CRC error if its bytes are bad, else the schema error), and is dropped."""
        cdef const rl_layout *L = &self.layout
        cdef int f, code
        cdef int64_t pos = 0, rest = r.size - self.d_min, n, rb, foff
        cdef char word[8]
        if rest < 0:
            return self._deferred_bad(r)
        if L.bare:                       # the rows alone: their count is the size's
            if L.row_bytes[0] == 0 or rest % L.row_bytes[0]:
                return self._deferred_bad(r)
            rows[0] = rest // L.row_bytes[0]
            return 0
        for f in range(L.nfields):
            rb = L.row_bytes[f]
            if not L.lod[f]:
                rows[f] = 1
                pos += rb
                continue
            if f == self.d_last:
                if rest % rb:
                    return self._deferred_bad(r)
                n = rest // rb
            else:
                code = rl_deferred_peek(r, pos, word, 8, &foff)
                if code != 0:
                    with gil:
                        raise self._deferred_error(r, code, foff)
                n = rl_load_i64(word)
                if n < 0 or (rb and n > rest // rb) or (not rb and n > RL_MAX_EMPTY_ROWS):
                    return self._deferred_bad(r)
            rows[f] = n
            rest -= n * rb
            pos += 8 + n * rb
        if rest != 0:
            return self._deferred_bad(r)
        return 0

    cdef int _deferred_bad(self, const rl_record *r) except -1 nogil:
        """A deferred record whose sizes do not fit the schema: its bytes read
        and checked (a bad CRC is the error to report, as the reader's own
        path reports it), else the schema error; raises either way."""
        cdef int code
        cdef int64_t off
        cdef rl_block *nb = rl_deferred_materialize(r, &code, &off)
        if nb != NULL:
            rl_block_decref(nb)
            code = RL_DEF_LAYOUT
            off = r.data - (<rl_dblock *>r.block).map.base
        with gil:
            raise self._deferred_error(r, code, off)

    cdef int _deferred_failed_seq(self, int64_t i) except -1 nogil:
        """Record i of a sequence batch failed its check at the copy: raise its
        error and keep the others held (with their parse), so that reading on
        loses only that record (the next call sizes and copies the batch again)."""
        cdef int64_t k
        cdef int nf = self.layout.nfields
        cdef rl_record bad = self.recs[i]
        with gil:
            err = self._deferred_error(&bad, self.dcodes[i], self.doffs[i])
        for k in range(i + 1, self.nrecs):
            self.recs[k - 1] = self.recs[k]
        memmove(self.parsed_rows + i * nf, self.parsed_rows + (i + 1) * nf,
                (self.nrecs - i - 1) * nf * sizeof(int64_t))
        memmove(self.parsed_ptrs + i * nf, self.parsed_ptrs + (i + 1) * nf,
                (self.nrecs - i - 1) * nf * sizeof(char *))
        self.nrecs -= 1
        rl_block_decref(bad.block)
        with gil:
            raise err

    cdef int _assemble(self, int64_t n, rl_record *out) except -1 nogil:
        """Sequence schemas: parse each held record once, size the batch, copy."""
        cdef const rl_layout *L = &self.layout
        cdef int nf = L.nfields
        cdef int f
        cdef int64_t i, pos, size, rb
        cdef int64_t *rows
        cdef int64_t total_rows[RL_MAX_FIELDS]
        cdef int64_t doff[RL_MAX_FIELDS]
        cdef int64_t loff[RL_MAX_FIELDS]
        cdef char *base
        for f in range(nf):
            total_rows[f] = 0 if L.lod[f] else n
        for i in range(n):
            rows = self.parsed_rows + i * nf      # parsed (and checked) in c_next
            for f in range(nf):
                if L.lod[f]:
                    total_rows[f] += rows[f]
        pos = _align64(16 + 24 * nf)
        for f in range(nf):
            doff[f] = pos
            pos = _align64(pos + total_rows[f] * L.row_bytes[f])
            if L.lod[f]:
                loff[f] = pos
                pos = _align64(pos + (n + 1) * 8)
            else:
                loff[f] = -1
        size = pos
        cdef rl_block *b = rl_block_new(size)
        if b == NULL:
            with gil:
                raise MemoryError(f"batch of {size} bytes")
        base = b.data
        rl_store_i64(base, n)
        rl_store_i64(base + 8, nf)
        cdef int64_t data_bytes = 0
        for f in range(nf):
            rl_store_i64(base + 16 + 24 * f, total_rows[f])
            rl_store_i64(base + 24 + 24 * f, doff[f])
            rl_store_i64(base + 32 + 24 * f, loff[f])
            data_bytes += total_rows[f] * L.row_bytes[f]
            if L.lod[f]:
                total_rows[f] = 0
                (<int64_t *>(base + loff[f]))[0] = 0
        # the offset tables first (sequential, n words), so that the copies are
        # independent and a batch of big records can be copied on several threads
        # (one core's copy does not reach the memory bandwidth; see _next_fixed_parallel)
        for i in range(n):
            rows = self.parsed_rows + i * nf
            for f in range(nf):
                if L.lod[f]:
                    total_rows[f] += rows[f]
                    (<int64_t *>(base + loff[f]))[i + 1] = total_rows[f]
        cdef _assemble_job job
        job.L = L
        job.base = base
        job.doff = doff
        job.loff = loff
        job.parsed_ptrs = self.parsed_ptrs
        job.parsed_rows = self.parsed_rows
        job.recs = self.recs
        # per-record codes only for a batch that holds a deferred record: a
        # negotiated batch of small records (a TFRecord file of 64 B records)
        # skips their bookkeeping (three passes over the batch, 6% of a 64 B pass)
        job.codes = self.dcodes if self.recs_deferred else NULL
        job.offs = self.doffs
        if job.codes != NULL:
            for i in range(n):
                job.codes[i] = 0
        if data_bytes >= (4 << 20) and data_bytes >= n * 32768:
            parallel_for(threads_for(data_bytes), n, _copy_instances, &job)
        else:
            _copy_instances(&job, 0, n, 0)
        rl_copy_fence()
        if job.codes != NULL:
            for i in range(n):
                if job.codes[i] != 0:
                    rl_block_decref(b)
                    self._deferred_failed_seq(i)    # raises; the records around it stay held
            for i in range(n):
                if rl_record_is_deferred(&self.recs[i]):
                    _copied(&self.recs[i])
        for i in range(n):
            rl_record_consumed(&self.recs[i])
        out.block = b
        out.data = b.data
        out.size = size
        self.hold = b
        return 1

    cdef int c_reset(self) except -1:
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        self._drop_partial()
        self._dropped = None
        self.reader.c_reset()
        self._negotiate()
        return 0

    cdef int c_close(self) except -1:
        # what it holds pins the upstream's blocks (and so a file's mapping)
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        self._drop_partial()
        self.reader.close()
        if self.dmap != NULL:
            rl_mapped.map_decref(self.dmap)
            self.dmap = NULL
        return 0

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # whole batches: skip their instances upstream (a batch an exception
        # interrupted is finished the ordinary way)
        cdef int64_t got, B = self.batch_size
        if self.nrecs > 0 or self.pend != NULL or n <= 0:
            return ReaderBase.c_skip(self, n)
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        if self.dmap != NULL:
            self.dmap.pull = 1           # skipped items are dropped, never read
        try:
            got = self.reader.c_skip(n * B)
        finally:
            if self.dmap != NULL:
                self.dmap.pull = 0
        if got % B and not self.drop_last:
            return got // B + 1
        return got // B

    def __repr__(self):
        return f"BatchReader({self.reader!r}, batch_size={self.batch_size}, drop_last={self.drop_last})"

    def _describe(self):
        return {"batch_size": int(self.batch_size), "drop_last": bool(self.drop_last)}

    def _reduce_args(self):
        return (int(self.batch_size),), {"drop_last": bool(self.drop_last)}


