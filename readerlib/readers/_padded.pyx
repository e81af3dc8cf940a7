# cython: freethreading_compatible=False
"""Padded batches and batches bucketed by sequence length.

Design:
    Both readers hold referenced records (no copy) until a batch is complete,
    then copy each record once into a fresh batch block, with the GIL
    released.  A padded batch stores every sequence field dense, as
    [B, T, *shape] rows (T = the longest sequence of the batch, rounded up to
    `pad_to_multiple_of`, or the bucket's boundary - 1), each instance's rows
    followed by pad rows; its batch header marks those fields PADDED_FIELD
    (readers/_codec.pxd) so that every reader wraps them as [B, T, ...].  An
    int64 field `<name>_length` per sequence field, appended after the
    schema's fields, holds the lengths.

    BucketByLengthReader (tf.data's bucket_by_sequence_length): an instance
    of length L goes to bucket i with boundaries[i-1] <= L < boundaries[i]; a
    bucket that reaches its batch size (or whose next instance would take it
    past `max_tokens` padded rows) becomes a batch.  At the end of the input
    the partial buckets are emitted in bucket order (tf.data's order too),
    unless drop_remainder.  The output is a function of the input order only:
    deterministic, every instance exactly once (drop_remainder aside).
    Memory: at most sum(batch sizes) records referenced.
"""
import numpy as np
cimport numpy as cnp
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset

from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    ReaderBase, DecoratedReader, rl_block, rl_record, rl_layout, rl_block_incref, rl_block_decref,
    rl_block_new, rl_record_consumed, rl_store_i64, layout_parse, ITEM_INSTANCE, ITEM_BATCH,
    RL_MAX_FIELDS, rl_core_import)
from readerlib.readers._base import _check_positive_int, _check_reader, _record_schema_error
from readerlib.readers._align cimport _align64
from readerlib.readers._codec cimport PADDED_FIELD
from readerlib.tensor import Field, Schema

cnp.import_array()
rl_core_import()

__all__ = ["PaddedBatchReader", "BucketByLengthReader"]


cdef void _fill_pattern(char *dst, const char *pat, int64_t patlen, int64_t count) noexcept nogil:
    """`count` copies of the `patlen`-byte pattern at dst (doubling copies)."""
    cdef int64_t done, total = patlen * count, step
    if total <= 0:
        return
    memcpy(dst, pat, patlen)
    done = patlen
    while done < total:
        step = done if done <= total - done else total - done
        memcpy(dst + done, dst, step)
        done += step


def _pad_rows(schema, pad_value):
    """Per field: one step of padding as bytes (None for fixed fields)."""
    rows = []
    for f in schema:
        if not f.lod_level:
            rows.append(None)
            continue
        v = pad_value.get(f.name, 0) if isinstance(pad_value, dict) else pad_value
        try:
            a = np.asarray(v)
            if a.dtype.kind in "iu" and f.dtype.kind in "iu":
                info = np.iinfo(f.dtype)
                if not (info.min <= int(a) <= info.max):
                    raise ValueError(f"out of range for {f.dtype}")
            row = np.full(f.shape, v, dtype=f.dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"pad_value {v!r} does not fit field {f.name!r} ({f.dtype}): {e}") from None
        rows.append(row.tobytes())
    if isinstance(pad_value, dict):
        unknown = [k for k in pad_value if k not in schema.names or not schema[k].lod_level]
        if unknown:
            raise ValueError(f"pad_value names fields that are not sequence fields: {unknown}")
    return rows


def padded_schema(schema):
    """The schema of padded batches: the fields, then `<name>_length` (int64) per sequence field."""
    fields = list(schema.fields)
    for f in schema:
        if f.lod_level:
            name = f"{f.name}_length"
            if name in schema.names:
                raise ValueError(f"padded batches add a field {name!r} for the lengths of {f.name!r}; "
                                 f"the schema already has one (rename it)")
            fields.append(Field(name, "int64"))
    return Schema(fields)


cdef class _SequenceBatcher(DecoratedReader):
    """What padded and bucketed batches share: checks, held records, assembly."""
    cdef readonly tuple padded_flags
    cdef bint padded
    cdef int in_nf
    cdef rl_layout in_layout
    cdef list pad_bytes               # keeps the pad rows alive
    cdef const char *pad_row[RL_MAX_FIELDS]
    cdef bint pad_zero[RL_MAX_FIELDS]
    cdef int64_t multiple
    cdef const char **parsed_ptrs
    cdef int64_t *parsed_rows
    cdef int64_t parsed_cap
    cdef rl_block *hold
    cdef int64_t fixed_T              # >= 0: pad the length field to this (bucket boundary - 1)
    cdef int length_f                 # the length field's index
    cdef dict _args                   # the constructor's keyword arguments (pickling, states)

    def _describe(self):
        return {k: (repr(v) if k == "pad_value" else v) for k, v in self._args.items()}

    def _reduce_args(self):
        return (), dict(self._args)

    cdef int _setup(self, reader, pad_value, pad_to_multiple_of, bint padded, str who) except -1:
        cdef int f
        _check_reader(reader, who)
        if reader.item_kind != ITEM_INSTANCE:
            raise TypeError(f"{who} needs a reader of instances; this one already yields batches")
        if not any(f_.lod_level for f_ in reader.schema):
            raise ValueError(f"{who}: the schema {reader.schema} has no sequence (lod_level=1) "
                             f"field to pad or bucket; use .batch()")
        if pad_to_multiple_of is not None:
            self.multiple = _check_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
        else:
            self.multiple = 1
        rows = _pad_rows(reader.schema, pad_value)
        DecoratedReader.__init__(self, reader)
        self.in_layout = self.layout
        self.in_nf = self.layout.nfields
        self.padded = padded
        self.pad_bytes = rows
        for f in range(self.in_nf):
            if rows[f] is not None:
                self.pad_row[f] = <const char *>rows[f]
                self.pad_zero[f] = not any(rows[f])
        if padded:
            out_schema = padded_schema(reader.schema)
            self.padded_flags = tuple(bool(f_.lod_level) for f_ in reader.schema) + \
                (False,) * (len(out_schema) - self.in_nf)
        else:
            out_schema = reader.schema
            self.padded_flags = (False,) * self.in_nf
        self._set_schema(out_schema, ITEM_BATCH)
        self.layout.bare = 0
        self.fixed_T = -1
        self.length_f = -1
        return 0

    def __dealloc__(self):
        free(self.parsed_ptrs)
        free(self.parsed_rows)
        self.parsed_ptrs = NULL
        self.parsed_rows = NULL
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL

    cdef int _reserve(self, int64_t n) except -1 nogil:
        cdef int64_t want = n * self.in_nf
        cdef const char **p
        cdef int64_t *q
        if want <= self.parsed_cap:
            return 0
        p = <const char **>realloc(self.parsed_ptrs, want * sizeof(char *))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.parsed_ptrs = p
        q = <int64_t *>realloc(self.parsed_rows, want * sizeof(int64_t))
        if q == NULL:
            with gil:
                raise MemoryError()
        self.parsed_rows = q
        self.parsed_cap = want
        return 0

    cdef int64_t _rows_of(self, const rl_record *rec, int f) except -2 nogil:
        """Rows of sequence field f in one record; raises for a malformed record."""
        cdef const char *ptrs[RL_MAX_FIELDS]
        cdef int64_t rows[RL_MAX_FIELDS]
        if layout_parse(&self.in_layout, rec.data, rec.size, ptrs, rows) != 0:
            with gil:
                raise _record_schema_error(type(self).__name__, self.reader.schema,
                                           rec.data[:rec.size], self.in_layout.bare)
        return rows[f]

    cdef int _release_hold(self) except -1 nogil:
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        return 0

    cdef int _assemble(self, rl_record *recs, int64_t n, rl_record *out) except -1 nogil:
        """Build the batch of the n held records into *out (self.hold); the caller releases them."""
        cdef const rl_layout *L = &self.in_layout
        cdef int nf = self.in_nf
        cdef int nout = self.layout.nfields
        cdef int f, g
        cdef int64_t i, k, pos, rb, r, T
        cdef const char **ptrs
        cdef int64_t *rows
        cdef int64_t total[RL_MAX_FIELDS]
        cdef int64_t maxr[RL_MAX_FIELDS]
        cdef int64_t padT[RL_MAX_FIELDS]
        cdef int64_t doff[RL_MAX_FIELDS]
        cdef int64_t loff[RL_MAX_FIELDS]
        cdef char *base
        cdef char *dst
        self._reserve(n)
        for f in range(nf):
            total[f] = 0
            maxr[f] = 0
        for i in range(n):
            ptrs = self.parsed_ptrs + i * nf
            rows = self.parsed_rows + i * nf
            if layout_parse(L, recs[i].data, recs[i].size, ptrs, rows) != 0:
                with gil:
                    raise _record_schema_error(type(self).__name__, self.reader.schema,
                                               recs[i].data[:recs[i].size], L.bare, index=i)
            for f in range(nf):
                if L.lod[f]:
                    total[f] += rows[f]
                    if rows[f] > maxr[f]:
                        maxr[f] = rows[f]
        pos = _align64(16 + 24 * nout)
        for f in range(nf):
            doff[f] = pos
            loff[f] = -1
            if not L.lod[f]:
                pos = _align64(pos + n * L.row_bytes[f])
            elif self.padded:
                T = (maxr[f] + self.multiple - 1) // self.multiple * self.multiple
                if f == self.length_f and self.fixed_T >= 0:
                    T = self.fixed_T
                padT[f] = T
                loff[f] = PADDED_FIELD
                pos = _align64(pos + n * T * L.row_bytes[f])
            else:
                pos = _align64(pos + total[f] * L.row_bytes[f])
                loff[f] = pos
                pos = _align64(pos + (n + 1) * 8)
        for g in range(nf, nout):                 # the lengths
            doff[g] = pos
            loff[g] = -1
            pos = _align64(pos + n * 8)
        cdef rl_block *b = rl_block_new(pos)
        if b == NULL:
            with gil:
                raise MemoryError(f"batch of {pos} bytes")
        base = b.data
        rl_store_i64(base, n)
        rl_store_i64(base + 8, nout)
        for f in range(nout):
            if f < nf and L.lod[f]:
                r = padT[f] if self.padded else total[f]
            else:
                r = n
            rl_store_i64(base + 16 + 24 * f, r)
            rl_store_i64(base + 24 + 24 * f, doff[f])
            rl_store_i64(base + 32 + 24 * f, loff[f])
        for f in range(nf):
            rb = L.row_bytes[f]
            if L.lod[f] and not self.padded:
                (<int64_t *>(base + loff[f]))[0] = 0
                k = 0
                for i in range(n):
                    r = self.parsed_rows[i * nf + f]
                    memcpy(base + doff[f] + k * rb, self.parsed_ptrs[i * nf + f], r * rb)
                    k += r
                    (<int64_t *>(base + loff[f]))[i + 1] = k
            elif L.lod[f]:
                T = padT[f]
                for i in range(n):
                    r = self.parsed_rows[i * nf + f]
                    if r > T:
                        rl_block_decref(b)
                        with gil:
                            raise ValueError(
                                f"{type(self).__name__}: field {self.reader.schema[f].name!r} of "
                                f"instance {i} of the batch has {r} steps, more than the bucket's "
                                f"padded length {T} (pad_to_bucket_boundary=True needs lengths "
                                f"below the last boundary)")
                    dst = base + doff[f] + i * T * rb
                    memcpy(dst, self.parsed_ptrs[i * nf + f], r * rb)
                    if self.pad_zero[f]:
                        memset(dst + r * rb, 0, (T - r) * rb)
                    else:
                        _fill_pattern(dst + r * rb, self.pad_row[f], rb, T - r)
            else:
                for i in range(n):
                    memcpy(base + doff[f] + i * rb, self.parsed_ptrs[i * nf + f], rb)
        g = nf
        for f in range(nf):
            if L.lod[f] and self.padded:
                for i in range(n):
                    (<int64_t *>(base + doff[g]))[i] = self.parsed_rows[i * nf + f]
                g += 1
        for i in range(n):
            rl_record_consumed(&recs[i])
        out.block = b
        out.data = base
        out.size = pos
        self.hold = b
        return 0


cdef class PaddedBatchReader(_SequenceBatcher):
    """Batches with dense, padded sequence fields (tf.data's padded_batch).

    Each sequence field becomes a [B, T, *shape] array, T the batch's longest
    sequence (rounded up to `pad_to_multiple_of`), padded with `pad_value`;
    an int64 field `<name>_length` [B] per sequence field follows the
    schema's fields.  Fixed fields batch to [B, *shape] as in `.batch()`.

    Parameters
    ----------
    reader : ReaderBase
        Yields instances with at least one sequence field.
    batch_size : int
    pad_value : scalar or dict name -> scalar
        Cast to each field's dtype (must fit).
    pad_to_multiple_of : int, optional
    drop_last : bool

    Examples
    --------
    >>> feats, label, feats_length = next(iter(reader.padded_batch(32)))
    """
    cdef readonly int64_t batch_size
    cdef readonly bint drop_last
    cdef rl_record *recs
    cdef int64_t nrecs

    def __init__(self, reader, batch_size, pad_value=0, pad_to_multiple_of=None, drop_last=False):
        bs = _check_positive_int(batch_size, "batch_size")
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be a bool, got {type(drop_last).__name__}")
        self._setup(reader, pad_value, pad_to_multiple_of, True, "PaddedBatchReader")
        self._args = dict(batch_size=bs, pad_value=pad_value, pad_to_multiple_of=pad_to_multiple_of,
                          drop_last=bool(drop_last))
        self.batch_size = bs
        self.drop_last = bool(drop_last)
        self.recs = <rl_record *>calloc(bs, sizeof(rl_record))
        if self.recs == NULL:
            raise MemoryError()

    cdef void _release(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.nrecs):
            rl_block_decref(self.recs[i].block)
        self.nrecs = 0

    def __dealloc__(self):
        if self.recs != NULL:
            self._release()
            free(self.recs)
            self.recs = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r
        self._release_hold()
        while self.nrecs < self.batch_size:      # after an error below, the records held stay
            r = self.reader.c_next(&rec)
            if r < 0:
                return -1
            if r == 0:
                break
            rl_block_incref(rec.block)
            self.recs[self.nrecs] = rec
            self.nrecs += 1
        if self.nrecs == 0 or (self.nrecs < self.batch_size and self.drop_last):
            self._release()
            return 0
        try:
            self._assemble(self.recs, self.nrecs, out)
        finally:
            self._release()          # a malformed record is not retried
        return 1

    cdef int c_reset(self) except -1:
        self._release_hold()
        self._release()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._release_hold()
        self._release()
        self.reader.close()
        return 0

    def _length(self):
        from readerlib.readers._slice import length_of
        n = length_of(self.reader)
        if n is None:
            return None
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __repr__(self):
        return f"PaddedBatchReader({self.reader!r}, batch_size={self.batch_size})"


cdef struct _bucket:
    rl_record *recs
    int64_t n
    int64_t cap
    int64_t max_len          # longest length-field sequence held
    int64_t rows             # sum of the held lengths


cdef class BucketByLengthReader(_SequenceBatcher):
    """Batches of instances of similar length (tf.data's bucket_by_sequence_length).

    Parameters
    ----------
    reader : ReaderBase
        Yields instances with at least one sequence field.
    boundaries : list of int
        Increasing upper length boundaries: bucket i holds lengths L with
        boundaries[i-1] <= L < boundaries[i] (len(boundaries) + 1 buckets).
    batch_sizes : list of int, optional
        One per bucket.  Optional with `max_tokens` (then a bucket's batch is
        bounded by the tokens only).
    length_field : str, optional
        The sequence field whose length buckets an instance (default: the
        first sequence field).
    drop_remainder : bool
        Drop the partial batches left in the buckets at the end of an epoch.
    max_tokens : int, optional
        Token budget: a batch holds at most this many rows of the length field
        in total, counting padding (B * T) for padded batches and the rows
        themselves (sum of lengths) for LoD batches.  A single instance longer
        than that is an error.
    pad_value : scalar or dict
    pad_to_bucket_boundary : bool
        Pad the length field to boundaries[i] - 1 instead of the batch's
        longest (tf.data's option); lengths must then stay below the last
        boundary.
    padded : bool
        True (default): padded batches as `padded_batch` gives them; False:
        LoD batches as `.batch()` gives them (no padding at all).
    """
    cdef list _boundaries
    cdef list _batch_sizes
    cdef int64_t *bnd
    cdef int64_t *bsz
    cdef int nb
    cdef _bucket *buckets
    cdef readonly bint drop_remainder
    cdef readonly object max_tokens
    cdef int64_t max_tok             # -1: no token budget
    cdef bint pad_to_boundary
    cdef bint flushing
    cdef int flush_next
    cdef int64_t in_pos

    def __init__(self, reader, boundaries, batch_sizes=None, length_field=None, drop_remainder=False,
                 max_tokens=None, pad_value=0, pad_to_bucket_boundary=False, padded=True):
        cdef int i
        try:
            bnd = [_check_positive_int(b, "each boundary") for b in boundaries]
        except TypeError:
            raise TypeError(f"boundaries must be a list of ints, got {boundaries!r}") from None
        if not bnd:
            raise ValueError("boundaries must hold at least one length")
        if any(b2 <= b1 for b1, b2 in zip(bnd, bnd[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {bnd}")
        if max_tokens is not None:
            mt = _check_positive_int(max_tokens, "max_tokens")
        else:
            mt = -1
            if batch_sizes is None:
                raise ValueError("bucket_by_length needs batch_sizes= (one per bucket, "
                                 f"{len(bnd) + 1} here) or max_tokens=")
        if batch_sizes is not None:
            bs = [_check_positive_int(b, "each batch size") for b in batch_sizes]
            if len(bs) != len(bnd) + 1:
                raise ValueError(f"batch_sizes needs len(boundaries) + 1 = {len(bnd) + 1} entries "
                                 f"(one per bucket), got {len(bs)}")
        else:
            bs = [mt] * (len(bnd) + 1)
        if not isinstance(drop_remainder, (bool, np.bool_)):
            raise TypeError(f"drop_remainder must be a bool, got {type(drop_remainder).__name__}")
        self._setup(reader, pad_value, None, bool(padded), "BucketByLengthReader")
        self._args = dict(boundaries=bnd, batch_sizes=batch_sizes if batch_sizes is None else bs,
                          length_field=length_field, drop_remainder=bool(drop_remainder),
                          max_tokens=max_tokens, pad_value=pad_value,
                          pad_to_bucket_boundary=bool(pad_to_bucket_boundary), padded=bool(padded))
        in_schema = self.reader.schema
        if length_field is None:
            lf = next(k for k, f in enumerate(in_schema) if f.lod_level)
        else:
            if length_field not in in_schema.names:
                raise ValueError(f"length_field {length_field!r} is not a field; fields are "
                                 f"{list(in_schema.names)}")
            lf = in_schema.index(length_field)
            if not in_schema[lf].lod_level:
                raise ValueError(f"length_field {length_field!r} is not a sequence (lod_level=1) field")
        self.length_f = lf
        self._boundaries = bnd
        self._batch_sizes = bs
        self.nb = len(bnd) + 1
        self.bnd = <int64_t *>malloc(len(bnd) * sizeof(int64_t))
        self.bsz = <int64_t *>malloc(self.nb * sizeof(int64_t))
        self.buckets = <_bucket *>calloc(self.nb, sizeof(_bucket))
        if self.bnd == NULL or self.bsz == NULL or self.buckets == NULL:
            raise MemoryError()
        for i in range(len(bnd)):
            self.bnd[i] = bnd[i]
        for i in range(self.nb):
            self.bsz[i] = bs[i]
        self.drop_remainder = bool(drop_remainder)
        self.max_tokens = None if mt < 0 else mt
        self.max_tok = mt
        self.pad_to_boundary = bool(pad_to_bucket_boundary)
        if self.pad_to_boundary and not self.padded:
            raise ValueError("pad_to_bucket_boundary needs padded=True")
        self.flushing = False
        self.flush_next = 0
        self.in_pos = 0

    @property
    def boundaries(self):
        return list(self._boundaries)

    @property
    def batch_sizes(self):
        return list(self._batch_sizes)

    cdef void _release_all(self) noexcept nogil:
        cdef int j
        cdef int64_t i
        if self.buckets == NULL:
            return
        for j in range(self.nb):
            for i in range(self.buckets[j].n):
                rl_block_decref(self.buckets[j].recs[i].block)
            self.buckets[j].n = 0
            self.buckets[j].max_len = 0
            self.buckets[j].rows = 0

    def __dealloc__(self):
        cdef int j
        if self.buckets != NULL:
            self._release_all()
            for j in range(self.nb):
                free(self.buckets[j].recs)
            free(self.buckets)
            self.buckets = NULL
        free(self.bnd)
        free(self.bsz)
        self.bnd = NULL
        self.bsz = NULL

    cdef int _bucket_of(self, int64_t length) noexcept nogil:
        cdef int j = 0
        while j < self.nb - 1 and length >= self.bnd[j]:
            j += 1
        return j

    cdef inline int64_t _padded_len(self, int j, int64_t max_len) noexcept nogil:
        if self.pad_to_boundary and j < self.nb - 1:
            return self.bnd[j] - 1
        return max_len

    cdef bint _over_budget(self, int j, int64_t length) noexcept nogil:
        """Would adding an instance of `length` take bucket j past max_tokens?"""
        cdef _bucket *B = &self.buckets[j]
        cdef int64_t m
        if self.max_tok < 0 or B.n == 0:
            return False
        if self.padded:
            m = B.max_len if B.max_len > length else length
            return (B.n + 1) * self._padded_len(j, m) > self.max_tok
        return B.rows + length > self.max_tok

    cdef int _emit(self, int j, rl_record *out) except -1 nogil:
        cdef _bucket *B = &self.buckets[j]
        cdef int64_t i
        self.fixed_T = self.bnd[j] - 1 if self.pad_to_boundary and j < self.nb - 1 else -1
        try:
            self._assemble(B.recs, B.n, out)
        finally:
            self._drop_bucket(j)
        return 1

    cdef int _add(self, int j, const rl_record *rec, int64_t length) except -1 nogil:
        cdef _bucket *B = &self.buckets[j]
        cdef rl_record *p
        cdef int64_t c
        if B.n == B.cap:
            c = B.cap * 2 if B.cap else 16
            if c > self.bsz[j]:
                c = self.bsz[j]
            p = <rl_record *>realloc(B.recs, c * sizeof(rl_record))
            if p == NULL:
                with gil:
                    raise MemoryError()
            B.recs = p
            B.cap = c
        rl_block_incref(rec.block)
        B.recs[B.n] = rec[0]
        B.n += 1
        if length > B.max_len:
            B.max_len = length
        B.rows += length
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r, j
        cdef int64_t length, pos
        self._release_hold()
        while not self.flushing:
            r = self.reader.c_next(&rec)
            if r < 0:
                return -1
            if r == 0:
                self.flushing = True
                self.flush_next = 0
                break
            pos = self.in_pos
            self.in_pos += 1
            length = self._rows_of(&rec, self.length_f)
            j = self._bucket_of(length)
            if self.pad_to_boundary and j == self.nb - 1:
                with gil:
                    raise ValueError(
                        f"BucketByLengthReader: instance {pos} of the epoch has length {length}, not "
                        f"below the last boundary {self._boundaries[len(self._boundaries) - 1]} (pad_to_bucket_boundary=True)")
            if self.max_tok >= 0 and (self._padded_len(j, length) if self.padded else length) > self.max_tok:
                with gil:
                    raise ValueError(
                        f"BucketByLengthReader: instance {pos} of the epoch has length {length}, "
                        f"more than max_tokens={self.max_tok} alone")
            if self._over_budget(j, length):
                self._emit(j, out)
                self._add(j, &rec, length)
                return 1
            self._add(j, &rec, length)
            if self.buckets[j].n >= self.bsz[j]:
                return self._emit(j, out)
        while self.flush_next < self.nb:
            j = self.flush_next
            self.flush_next += 1
            if self.buckets[j].n == 0:
                continue
            if self.drop_remainder:
                self._drop_bucket(j)
                continue
            return self._emit(j, out)
        return 0

    cdef void _drop_bucket(self, int j) noexcept nogil:
        cdef int64_t i
        for i in range(self.buckets[j].n):
            rl_block_decref(self.buckets[j].recs[i].block)
        self.buckets[j].n = 0
        self.buckets[j].max_len = 0
        self.buckets[j].rows = 0

    cdef int c_reset(self) except -1:
        self._release_hold()
        self._release_all()
        self.flushing = False
        self.flush_next = 0
        self.in_pos = 0
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._release_hold()
        self._release_all()
        self.reader.close()
        return 0

    def __repr__(self):
        return (f"BucketByLengthReader({self.reader!r}, boundaries={self._boundaries}, "
                f"batch_sizes={self._batch_sizes}, max_tokens={self.max_tokens})")
