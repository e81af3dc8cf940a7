# cython: freethreading_compatible=False
"""Compiled maps: a `RecordTransform` (subclassed in Cython) run by `.map(...)`.

Design:
    A user's transform is a `cdef class` deriving from RecordTransform
    (transform.pxd is its API); `reader.map(transform)` builds a
    TransformReader, a DecoratedReader whose c_next never takes the GIL
    while records flow: it pulls a chunk of records from the reader below
    (references taken, up to CHUNK_RECORDS records or CHUNK_MAX_BYTES of
    input), then

      pass 1  parses each record (layout_parse) and asks the transform for
              the rows of each output sequence field: the record's output
              size;
      serial  prefix sum of the sizes -> one output block for the chunk;
      pass 2  parses again, writes the row counts and calls `transform` with
              pointers into the block.

    Both passes are readerlib parallel loops (_parallel.pxd): split over
    the worker threads when the chunk's bytes pay for them (threads_for),
    serial otherwise.  Every record writes only its own bytes, so the output
    is the same for any thread count.  Memory: the chunk's inputs (held
    blocks) and one output block; no Python object per record.

    Errors: a malformed input record, a negative `output_rows` or a nonzero
    `transform` code is kept per record; the c_next that would have returned
    that record takes the GIL and raises ValueError naming the position, the
    file, the transform and its `error_message(code)`, then reading on
    continues with the next record (the Python map's contract).  An
    exception from the reader below is raised at once; the records pulled
    before it stay held and come next (as BatchReader does), so reading on
    still yields every other record exactly once.

    State: nothing across epochs and no randomness; get_state() stores the
    position, restoring replays the epoch (the transform runs again on the
    replayed records).
"""
from cpython.ref cimport PyObject
from libc.stdlib cimport malloc, free
from libc.string cimport memset

from readerlib._typedefs cimport int64_t
from readerlib._parallel cimport parallel_for, threads_for
from readerlib.readers._base cimport (
    ReaderBase, DecoratedReader, rl_block, rl_record, rl_layout, RL_MAX_FIELDS,
    rl_block_incref, rl_block_decref, rl_block_new, rl_record_consumed, rl_store_i64,
    layout_from_schema, layout_parse, ITEM_INSTANCE, rl_core_import)
from readerlib.readers._base import _check_positive_int, _check_reader
from readerlib.tensor import Schema
from readerlib._signature import ClassSignature

__all__ = ["RecordTransform", "TransformReader"]

rl_core_import()

cdef enum:
    CHUNK_RECORDS = 4096
    CHUNK_MAX_BYTES = 4194304        # at most 4 MiB of input records held

    FAIL_NONE = 0
    FAIL_MALFORMED = 1               # layout_parse refused the input record
    FAIL_ROWS = 2                    # output_rows returned an error code (< 0)
    FAIL_TOO_BIG = 3                 # output_rows gave more rows than MAX_OUTPUT_BYTES holds
    FAIL_TRANSFORM = 4               # transform returned an error code (> 0)

cdef int64_t MAX_OUTPUT_BYTES = (<int64_t>1) << 40    # one output record larger than this is refused


cdef class RecordTransform:
    """Base class of compiled per-instance transforms (subclass it in Cython).

    Override the `nogil` method `transform` (and `output_rows` when an output
    sequence field does not keep the rows of the input field of its name);
    see ``readerlib/transform.pxd`` for the contract.  Python-level hooks:
    `prepare` (check the schemas, precompute what `transform` reads) and
    `error_message` (text for an error code).

    Parameters
    ----------
    output_schema : Schema or list of Field, optional
        The schema of the outputs; None keeps the input schema.  A subclass
        may instead set ``self.output_schema`` in its ``__init__``, or the
        map's ``output_schema=`` may give it.

    Examples
    --------
    In ``my_transform.pyx``, built with ``include_dirs=[readerlib.get_include()]``::

        from readerlib.transform cimport RecordTransform
        from libc.stdint cimport int64_t
        from libc.string cimport memcpy

        cdef class Copy(RecordTransform):
            cdef int transform(self, const char **src, const int64_t *src_rows,
                               char **dst, const int64_t *dst_rows) noexcept nogil:
                memcpy(dst[0], src[0], src_rows[0] * self.in_layout.row_bytes[0])
                return 0

    then ``reader.map(Copy())``.
    """
    __signature__ = ClassSignature()        # inspect.signature(cls): see readerlib/_signature.py

    def __init__(self, output_schema=None):
        self.output_schema = None if output_schema is None else Schema.coerce(output_schema)

    def bind(self, input_schema, output_schema=None):
        """Fix the schemas this transform works between (TransformReader calls it).

        `output_schema` overrides `output_schema_for(input_schema)`; then
        `prepare` runs.
        Returns the output schema.  A transform serves one chain at a time:
        binding it again (another chain) replaces the schemas.
        """
        cdef int f, g
        cdef rl_layout L, O
        input_schema = Schema.coerce(input_schema)
        if output_schema is None:
            output_schema = self.output_schema_for(input_schema)
        output_schema = input_schema if output_schema is None else Schema.coerce(output_schema)
        layout_from_schema(&L, input_schema)
        layout_from_schema(&O, output_schema)
        self.prepare(input_schema, output_schema)        # may refuse: nothing changed yet
        self.in_layout = L
        self.out_layout = O
        for f, fld in enumerate(output_schema):
            self.rows_from[f] = -1
            if fld.lod_level and fld.name in input_schema.names:
                g = input_schema.index(fld.name)
                if input_schema.fields[g].lod_level:
                    self.rows_from[f] = g
        self.input_schema = input_schema
        self.bound_output_schema = output_schema
        self.bound = True
        return output_schema

    def output_schema_for(self, input_schema):
        """The output schema for `input_schema` (when the map gives none):
        ``self.output_schema``, or the input schema when that is None.
        Override it for a schema change that depends on the input."""
        return input_schema if self.output_schema is None else self.output_schema

    def prepare(self, input_schema, output_schema):
        """Hook called by `bind`: check the schemas (raise TypeError/ValueError
        naming the field) and set up what `transform` reads.  Default: nothing."""
        pass

    def error_message(self, int code):
        """The text for an error code `transform` (> 0) or `output_rows` (< 0) returned."""
        if code == 1:
            return "transform is not implemented (override the cdef method transform)"
        if code == -1:
            return "output_rows is not implemented for this field (override it)"
        return f"error code {code}"

    def transform_py(self, instance):
        """Apply the transform to one instance (tuple of arrays in input-schema
        order) and return the output tuple: the compiled path, for tests and
        for checking a transform against a Python reference."""
        import numpy as np
        from readerlib import ArrayReader
        if not self.bound:
            raise ValueError(f"{type(self).__name__} is not bound to a schema: call bind(schema) first")
        if len(instance) != len(self.input_schema):
            raise ValueError(f"transform_py: the instance has {len(instance)} fields, the input "
                             f"schema {len(self.input_schema)}")
        cols = {}
        for fld, v in zip(self.input_schema, instance):
            a = np.asarray(v, dtype=fld.dtype)
            cols[fld.name] = [a] if fld.lod_level else a[None]
        r = TransformReader(ArrayReader(cols, schema=self.input_schema), self, num_threads=1,
                            output_schema=self.bound_output_schema)
        out = r.read_next()
        r.close()
        return out

    cdef int64_t output_rows(self, int field, const char **src,
                             const int64_t *src_rows) noexcept nogil:
        if self.rows_from[field] < 0:
            return -1
        return src_rows[self.rows_from[field]]

    cdef int transform(self, const char **src, const int64_t *src_rows,
                       char **dst, const int64_t *dst_rows) noexcept nogil:
        return 1

    def __repr__(self):
        return f"{type(self).__name__}()"


# What the parallel passes share (read-only, but for each record's own slots).
ctypedef struct chunk_ctx:
    PyObject *t                  # the RecordTransform (borrowed: the reader holds it)
    const rl_layout *L           # input layout (with the source's `bare`)
    const rl_layout *O           # output layout
    const rl_record *recs
    int64_t *orows               # [n, O.nfields] output rows
    int64_t *offs                # pass 1: record i's size at offs[i + 1]; pass 2: its start at offs[i]
    int *fail                    # FAIL_* per record
    int *code                    # the error code per record
    char *base                   # the chunk's output block


cdef void _sizes_body(void *vctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef chunk_ctx *c = <chunk_ctx *>vctx
    cdef const rl_layout *O = c.O
    cdef const char *src[RL_MAX_FIELDS]
    cdef int64_t rows[RL_MAX_FIELDS]
    cdef int64_t i, r, size
    cdef int f
    for i in range(begin, end):
        c.fail[i] = FAIL_NONE
        c.offs[i + 1] = 0
        if layout_parse(c.L, c.recs[i].data, c.recs[i].size, src, rows) < 0:
            c.fail[i] = FAIL_MALFORMED
            c.orows[i * O.nfields] = c.recs[i].size      # for the message
            continue
        size = 0
        for f in range(O.nfields):
            if O.lod[f]:
                r = (<RecordTransform>c.t).output_rows(f, src, rows)
                if r < 0:
                    c.fail[i] = FAIL_ROWS
                    c.code[i] = <int>r if r >= -2147483647 else -2147483647
                    break
                if O.row_bytes[f] and r > MAX_OUTPUT_BYTES // O.row_bytes[f]:
                    c.fail[i] = FAIL_TOO_BIG
                    c.orows[i * O.nfields + f] = r
                    break
                c.orows[i * O.nfields + f] = r
                size += 8 + r * O.row_bytes[f]
            else:
                c.orows[i * O.nfields + f] = 1
                size += O.row_bytes[f]
            if size > MAX_OUTPUT_BYTES:
                c.fail[i] = FAIL_TOO_BIG
                c.orows[i * O.nfields + f] = r
                break
        if c.fail[i] == FAIL_NONE:
            c.offs[i + 1] = size


cdef void _transform_body(void *vctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef chunk_ctx *c = <chunk_ctx *>vctx
    cdef const rl_layout *O = c.O
    cdef const char *src[RL_MAX_FIELDS]
    cdef int64_t rows[RL_MAX_FIELDS]
    cdef char *dst[RL_MAX_FIELDS]
    cdef const int64_t *drows
    cdef int64_t i
    cdef int f, rc
    cdef char *p
    for i in range(begin, end):
        if c.fail[i] != FAIL_NONE:
            continue
        layout_parse(c.L, c.recs[i].data, c.recs[i].size, src, rows)   # pass 1 checked it
        drows = c.orows + i * O.nfields
        p = c.base + c.offs[i]
        for f in range(O.nfields):
            if O.lod[f]:
                rl_store_i64(p, drows[f])
                p += 8
                dst[f] = p
                p += drows[f] * O.row_bytes[f]
            else:
                dst[f] = p
                p += O.row_bytes[f]
        rc = (<RecordTransform>c.t).transform(src, rows, dst, drows)
        if rc != 0:
            c.fail[i] = FAIL_TRANSFORM
            c.code[i] = rc


cdef class TransformReader(DecoratedReader):
    """Run a compiled `RecordTransform` on every instance (what ``.map(t)`` builds).

    Parameters
    ----------
    reader : ReaderBase
        Yields instances.
    transform : RecordTransform
        An instance of a Cython subclass; bound to the reader's schema here.
    num_threads : int, optional
        At most this many of readerlib's worker threads per chunk; None: as
        many as readerlib.set_num_threads allows (fewer for small chunks).
        The output is the same for any number.
    output_schema : Schema, optional
        Overrides the transform's own output schema.

    Raises
    ------
    ValueError
        From the read that would have returned a record the transform
        refused (its error_message, the position and the file), or whose
        input bytes do not fit the schema.  Reading on continues with the
        next record.
    """
    cdef readonly RecordTransform transform
    cdef readonly object num_threads          # None or the cap
    cdef int max_threads                      # 0: no cap
    cdef rl_layout in_layout                  # the transform's, with the source's `bare`
    cdef rl_record *recs                      # the chunk's input records (referenced)
    cdef int64_t nrecs
    cdef rl_block *chunk                      # the chunk's outputs
    cdef int64_t *offs
    cdef int64_t *orows
    cdef int *fail
    cdef int *code
    cdef int64_t nchunk                       # records in the chunk (outputs or failures)
    cdef int64_t ichunk                       # next one to hand out
    cdef int64_t chunk_pos                    # input position of the chunk's record 0
    cdef int64_t in_pos                       # input records processed this epoch
    cdef bint ended                           # the reader below reported the end of the epoch
    cdef object _source

    def __init__(self, reader, transform, num_threads=None, deterministic=True, output_schema=None):
        _check_reader(reader, "TransformReader")
        if not isinstance(transform, RecordTransform):
            raise TypeError(f"TransformReader needs a readerlib.transform.RecordTransform, got "
                            f"{type(transform).__name__}")
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError("map works on instances and this reader yields batches; map before "
                            ".batch()")
        if num_threads is not None:
            nt = _check_positive_int(num_threads, "num_threads")
            if nt > 256:
                raise ValueError(f"num_threads must be <= 256, got {nt}")
            self.max_threads = nt
        self.num_threads = num_threads
        out_schema = transform.bind(reader.schema, output_schema)
        DecoratedReader.__init__(self, reader)
        self._set_schema(out_schema, ITEM_INSTANCE)
        self.layout.bare = 0
        self.transform = transform
        self.in_layout = (<RecordTransform>transform).in_layout
        self.in_layout.bare = (<ReaderBase>reader).layout.bare
        self.recs = <rl_record *>malloc(CHUNK_RECORDS * sizeof(rl_record))
        self.offs = <int64_t *>malloc((CHUNK_RECORDS + 1) * sizeof(int64_t))
        self.orows = <int64_t *>malloc(CHUNK_RECORDS * max(1, len(out_schema)) * sizeof(int64_t))
        self.fail = <int *>malloc(CHUNK_RECORDS * sizeof(int))
        self.code = <int *>malloc(CHUNK_RECORDS * sizeof(int))
        if self.recs == NULL or self.offs == NULL or self.orows == NULL or self.fail == NULL \
                or self.code == NULL:
            raise MemoryError()
        from readerlib.readers._map import _source_of
        self._source = _source_of(reader)

    def __dealloc__(self):
        if <void *>self.transform == NULL:
            return                   # half-made (ReaderBase.__cinit__ failed): see _base.pyx
        self._drop()
        free(self.recs)
        free(self.offs)
        free(self.orows)
        free(self.fail)
        free(self.code)
        self.recs = NULL
        self.offs = NULL
        self.orows = NULL
        self.fail = NULL
        self.code = NULL

    cdef void _drop_inputs(self) noexcept nogil:
        cdef int64_t i
        if self.recs != NULL:
            for i in range(self.nrecs):
                rl_block_decref(self.recs[i].block)
        self.nrecs = 0

    cdef void _drop(self) noexcept nogil:
        self._drop_inputs()
        if self.chunk != NULL:
            rl_block_decref(self.chunk)
            self.chunk = NULL
        self.nchunk = 0
        self.ichunk = 0

    cdef int _pull(self) except -1 nogil:
        """Add records from the reader below to recs[] (references taken) until the
        chunk is full; 0 at the end of the epoch.  An exception jumps out with
        recs[:nrecs] still held: they are processed by the next call."""
        cdef rl_record rec
        cdef int r
        cdef int64_t nbytes = 0, i
        for i in range(self.nrecs):
            nbytes += self.recs[i].size
        while self.nrecs < CHUNK_RECORDS and nbytes < CHUNK_MAX_BYTES:
            r = self.reader.c_next(&rec)
            if r == 0:
                self.ended = True
                return 0
            rl_block_incref(rec.block)
            self.recs[self.nrecs] = rec
            self.nrecs += 1
            nbytes += rec.size
        return 1

    cdef int _run(self) except -1 nogil:
        """Transform recs[:nrecs] into a new chunk (both passes, see the module doc)."""
        cdef chunk_ctx c
        cdef int64_t n = self.nrecs, i, total = 0, in_bytes = 0
        cdef int nt
        if self.chunk != NULL:
            rl_block_decref(self.chunk)
            self.chunk = NULL
        c.t = <PyObject *>self.transform
        c.L = &self.in_layout
        c.O = &self.layout
        c.recs = self.recs
        c.orows = self.orows
        c.offs = self.offs
        c.fail = self.fail
        c.code = self.code
        c.base = NULL
        for i in range(n):
            in_bytes += self.recs[i].size
        # Threads pay for the memory traffic (in + out ~ 2x in, typically).
        nt = threads_for(2 * in_bytes)
        if self.max_threads and nt > self.max_threads:
            nt = self.max_threads
        parallel_for(nt, n, _sizes_body, &c)
        self.offs[0] = 0
        for i in range(n):
            total += self.offs[i + 1]
            self.offs[i + 1] = total
        self.chunk = rl_block_new(total if total > 0 else 1)
        if self.chunk == NULL:
            with gil:
                raise MemoryError(f"map output chunk of {total} bytes")
        c.base = self.chunk.data
        parallel_for(nt, n, _transform_body, &c)
        for i in range(n):
            rl_record_consumed(&self.recs[i])
        self._drop_inputs()
        self.chunk_pos = self.in_pos
        self.in_pos += n
        self.nchunk = n
        self.ichunk = 0
        return 0

    def _where(self, int64_t pos):
        src = f", reading {self._source!r}" if self._source is not None else ""
        return f"instance {pos} of this epoch's input to {type(self).__name__}{src}"

    cdef int _raise(self, int64_t i) except -1:
        cdef int kind = self.fail[i]
        name = type(self.transform).__name__
        where = self._where(self.chunk_pos + i)
        if kind == FAIL_MALFORMED:
            msg = (f"map: a record of {self.orows[i * len(self.schema)]} bytes does not fit the "
                   f"input schema {self.transform.input_schema} at {where}")
        elif kind == FAIL_TOO_BIG:
            msg = (f"map: {name}.output_rows gave an output larger than {MAX_OUTPUT_BYTES} bytes "
                   f"at {where}")
        else:
            code = self.code[i]
            msg = f"map: {name} failed: {self.transform.error_message(code)} (code {code}) at {where}"
        raise ValueError(msg)

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int64_t i
        cdef int r
        while True:
            if self.ichunk < self.nchunk:
                i = self.ichunk
                self.ichunk += 1
                if self.fail[i] != FAIL_NONE:
                    with gil:
                        self._raise(i)
                out.block = self.chunk
                out.data = self.chunk.data + self.offs[i]
                out.size = self.offs[i + 1] - self.offs[i]
                return 1
            r = 0
            if not self.ended:
                r = self._pull()           # may raise: the records pulled stay held
            if self.nrecs == 0:
                return 0
            self._run()

    cdef int c_reset(self) except -1:
        self._drop()
        self.in_pos = 0
        self.ended = False
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._drop()
        self.reader.close()
        return 0

    def _length(self):
        from readerlib.readers._slice import length_of
        return length_of(self.reader)

    def _describe(self):
        t = type(self.transform)
        return {"fn": f"{t.__module__}.{t.__qualname__}", "schema": self.schema.to_json()}

    def _reduce_args(self):
        return (self.transform,), {"num_threads": self.num_threads, "output_schema": self.schema}

    def __repr__(self):
        return f"TransformReader({self.reader!r}, {self.transform!r})"
