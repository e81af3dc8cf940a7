# cython: freethreading_compatible=False
"""In-memory and generated sources: ArrayReader (arrays / LoDTensors),
RandomDataGenerator (random instances from (seed, index)), PythonReader (any
Python iterator of instances).

Design:
    ArrayReader and RandomDataGenerator encode instances into blocks a chunk
    at a time (_ChunkedSource); PythonReader encodes each instance as it
    comes, under the GIL.
"""
import numpy as np
cimport numpy as cnp
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, DecoratedReader, rl_block, rl_record, rl_layout, rl_columns, rl_rng,
    rl_core_import, rl_block_incref, rl_block_decref, rl_block_new, rl_block_new_static,
    rl_record_consumed, rl_copy_big, rl_copy_fence, rl_rng_seed, rl_rng_below, rl_store_i64,
    layout_parse, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, ITEM_BATCH, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _cast_to_field
from readerlib.tensor import Field, LoDTensor, Schema

cnp.import_array()
rl_core_import()

__all__ = ["ArrayReader", "RandomDataGenerator", "PythonReader"]


cdef class _ChunkedSource(FileReader):
    """A source that encodes instances into blocks, a chunk of them at a time.

    Subclasses fill `self.cur` (a block of encoded records) and the record
    offsets `self.rec_off[0..ncur]` in `_load(chunk_start)`.
    """
    cdef int _reserve(self, int64_t n) except -1:
        if n + 1 > self.rec_off_cap:
            free(self.rec_off)
            self.rec_off = <int64_t *>malloc((n + 1) * sizeof(int64_t))
            if self.rec_off == NULL:
                self.rec_off_cap = 0
                raise MemoryError()
            self.rec_off_cap = n + 1
        return 0

    cdef int _load(self, int64_t start, int64_t count) except -1:
        raise NotImplementedError

    def __dealloc__(self):
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        free(self.rec_off)
        self.rec_off = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int64_t count
        if self.icur >= self.ncur:
            if self.next_index >= self.num_instances:
                return 0
            count = self.num_instances - self.next_index
            if count > self.chunk_records:
                count = self.chunk_records
            with gil:
                if self.cur != NULL:
                    rl_block_decref(self.cur)
                    self.cur = NULL
                self._load(self.next_index, count)
            self.next_index += count
            self.ncur = count
            self.icur = 0
        out.block = self.cur
        if self.layout.n_lod == 0:          # fixed-size records: no offset table needed
            out.data = self.cur.data + self.icur * self.layout.fixed_size
            out.size = self.layout.fixed_size
        else:
            out.data = self.cur.data + self.rec_off[self.icur]
            out.size = self.rec_off[self.icur + 1] - self.rec_off[self.icur]
        self.icur += 1
        return 1

    cdef int c_reset(self) except -1:
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        self.ncur = 0
        self.icur = 0
        self.next_index = 0
        return 0

    cdef int c_close(self) except -1:
        return self.c_reset()

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # Chunks start at multiples of chunk_records (what instance i is made of
        # may depend on its chunk: RandomDataGenerator): jump to the chunk that
        # holds the target, load it, and move inside it.
        cdef int64_t left = self.ncur - self.icur, base, target, start, k
        cdef rl_record rec
        if n <= left:
            self.icur += n
            return n
        base = self.next_index              # the first instance after the current chunk
        target = base + (n - left)
        if target > self.num_instances:
            target = self.num_instances
        start = target - target % self.chunk_records
        if start < base:
            start = base
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        self.ncur = 0
        self.icur = 0
        self.next_index = start
        if target > start:
            self.c_next(&rec)                 # loads the chunk at `start`
            k = target - start - 1
            if k > self.ncur - self.icur:
                k = self.ncur - self.icur
            self.icur += k
            return left + (start - base) + 1 + k
        return left + (start - base)

    def _random_access_size(self):
        return self.num_instances

    def __len__(self):
        return self.num_instances


def _as_column(value, name):
    """(array, offsets or None) for one ArrayReader column."""
    if isinstance(value, LoDTensor):
        if value.device != "cpu":
            raise TypeError(f"ArrayReader column {name!r}: LoDTensor is on the GPU; use .to('cpu')")
        if len(value.lod) != 1:
            raise ValueError(f"ArrayReader column {name!r}: needs one lod level, got {len(value.lod)}")
        return np.ascontiguousarray(value.data), np.ascontiguousarray(value.lod[0], dtype=np.int64)
    if isinstance(value, list):
        if not value:
            raise ValueError(f"ArrayReader column {name!r}: empty list of sequences")
        t = LoDTensor.from_sequences([np.asarray(v) for v in value])
        return np.ascontiguousarray(t.data), t.lod[0]
    arr = np.asarray(value)
    if arr.ndim == 0:
        raise ValueError(f"ArrayReader column {name!r}: needs at least one dimension (instances), "
                         f"got a scalar")
    if arr.dtype.kind == "O":
        raise TypeError(f"ArrayReader column {name!r}: object arrays are not supported")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return np.ascontiguousarray(arr), None


cdef class ArrayReader(_ChunkedSource):
    """Instances from NumPy arrays (one per field), memory-mapped `.npy` included.

    Parameters
    ----------
    arrays : array, sequence of arrays, or dict name -> array
        Row i of every array is instance i.  A LoDTensor, or a list of
        arrays, makes a sequence field (lod_level=1).
    schema : Schema, optional
        Checked against the arrays; inferred (names `f0`, `f1`, ... or the
        dict's keys) when omitted.  A dict's keys must be the schema's field
        names (in any order); they are matched by name.

    Examples
    --------
    >>> r = ArrayReader({"x": np.zeros((10, 3), np.float32), "y": np.arange(10)})
    >>> len(list(r))
    10
    """
    def __init__(self, arrays, schema=None, chunk_records=None):
        if schema is not None:
            schema = Schema.coerce(schema)
        if isinstance(arrays, dict):
            names = list(arrays)
            if schema is not None and names != list(schema.names):
                # by name, in the schema's order (they were paired by position:
                # {"b": .., "a": ..} swapped same-typed fields silently)
                missing = [n for n in schema.names if n not in arrays]
                unknown = [n for n in names if n not in schema.names]
                if missing or unknown:
                    raise ValueError(
                        f"ArrayReader: the dict's keys {names} are not the schema's fields "
                        f"{list(schema.names)}" + (f"; missing {missing}" if missing else "")
                        + (f"; not in the schema {unknown}" if unknown else ""))
                names = list(schema.names)
            values = [arrays[n] for n in names]
        elif isinstance(arrays, (tuple, list)) and arrays and not (
                isinstance(arrays, list) and all(isinstance(a, np.ndarray) for a in arrays)
                and schema is not None and len(schema) == 1 and schema[0].lod_level):
            names = [f"f{i}" for i in range(len(arrays))]
            values = list(arrays)
        else:
            names = ["f0"]
            values = [arrays]
        if not values:
            raise ValueError("ArrayReader needs at least one array")
        cols = [_as_column(v, n) for v, n in zip(values, names)]
        if schema is None:
            schema = Schema([Field(n, a.dtype, a.shape[1:], lod_level=1 if off is not None else 0)
                             for n, (a, off) in zip(names, cols)])
        else:
            schema = Schema.coerce(schema)
            if len(schema) != len(cols):
                raise ValueError(f"ArrayReader: {len(cols)} arrays for a schema of {len(schema)} fields")
            fixed = []
            for f, (a, off) in zip(schema, cols):
                if (off is not None) != bool(f.lod_level):
                    raise ValueError(f"ArrayReader: field {f.name!r} has lod_level {f.lod_level} but "
                                     f"its array is {'a sequence column' if off is not None else 'fixed'}")
                if a.shape[1:] != f.shape:
                    raise ValueError(f"ArrayReader: field {f.name!r} has shape {f.shape}, "
                                     f"array rows have shape {a.shape[1:]}")
                a = _cast_to_field(a, f, "ArrayReader")
                fixed.append((a, off))
            cols = fixed
        counts = [(len(off) - 1 if off is not None else a.shape[0]) for a, off in cols]
        if len(set(counts)) != 1:
            raise ValueError(f"ArrayReader: arrays disagree on the number of instances: "
                             f"{dict(zip(schema.names, counts))}")
        self._set_schema(schema, ITEM_INSTANCE)
        self._cols = []
        cdef cnp.ndarray a_, o_
        self.C.n = len(cols)
        for f, (a, off) in enumerate(cols):
            a_ = a
            self._cols.append(a_)
            self.C.ptr[f] = <const char *>cnp.PyArray_DATA(a_)
            if off is not None:
                o_ = np.ascontiguousarray(off, dtype=np.int64)
                if o_[0] != 0 or np.any(np.diff(o_) < 0) or o_[o_.shape[0] - 1] != a_.shape[0]:
                    raise ValueError(f"ArrayReader: bad offsets for field {schema[f].name!r}")
                self._cols.append(o_)
                self.C.off[f] = <const int64_t *>cnp.PyArray_DATA(o_)
            else:
                self.C.off[f] = NULL
        self.num_instances = counts[0]
        self.zero_copy = self.layout.nfields == 1 and self.layout.n_lod == 0
        if chunk_records is None:
            avg = max(1, self.layout.fixed_size if self.layout.fixed_size > 0 else 1024)
            chunk_records = max(1, min(4096, (1 << 20) // avg))
        self.chunk_records = _check_positive_int(chunk_records, "chunk_records")
        if self.zero_copy:
            self.chunk_records = max(self.num_instances, 1)
        self.c_reset()

    cdef int _load(self, int64_t start, int64_t count) except -1:
        cdef int64_t i, size = 0
        cdef const rl_layout *L = &self.layout
        if self.zero_copy:
            self.cur = rl_block_new_static(<char *>self.C.ptr[0] + start * L.fixed_size, count * L.fixed_size)
            if self.cur == NULL:
                raise MemoryError()
            return 0
        self._reserve(count)
        with nogil:
            self.rec_off[0] = 0
            for i in range(count):
                size += columns_encoded_size(L, &self.C, start + i)
                self.rec_off[i + 1] = size
        self.cur = rl_block_new(size)
        if self.cur == NULL:
            raise MemoryError()
        with nogil:
            for i in range(count):
                columns_encode(L, &self.C, start + i, self.cur.data + self.rec_off[i])
        return 0

    def __repr__(self):
        return f"ArrayReader({self.num_instances} instances, {self.schema})"

    def _describe(self):
        return {"num_instances": int(self.num_instances), "schema": self.schema.to_json()}

    def _reduce_args(self):
        cols = {}
        k = 0
        for f in self.schema:
            if f.lod_level:
                cols[f.name] = LoDTensor(self._cols[k], [self._cols[k + 1]])
                k += 2
            else:
                cols[f.name] = self._cols[k]
                k += 1
        return (cols,), {"schema": self.schema, "chunk_records": max(1, int(self.chunk_records))}


cdef class RandomDataGenerator(_ChunkedSource):
    """Seeded random instances for a schema (Paddle's, made reproducible).

    Instance i depends only on (seed, i): every epoch, every reset and every
    `num_instances` yields the same data for the same index.  Floats are uniform in [low, high), integers
    uniform in [low, high), sequence lengths uniform in `length_range`
    (inclusive).

    Parameters
    ----------
    schema : Schema
    num_instances : int
    seed : int
    low, high : float
    length_range : (int, int)
    """
    cdef readonly uint64_t seed
    cdef object low, high, length_range

    def __init__(self, schema, num_instances, seed=0, low=0.0, high=1.0, length_range=(1, 16)):
        schema = Schema.coerce(schema)
        self.num_instances = _check_positive_int(num_instances, "num_instances", allow_zero=True)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        lo, hi = length_range
        if not (0 <= lo <= hi):
            raise ValueError(f"length_range must satisfy 0 <= low <= high, got {length_range}")
        if not high > low:
            raise ValueError(f"need high > low, got low={low}, high={high}")
        self._set_schema(schema, ITEM_INSTANCE)
        self.seed = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        self.low, self.high, self.length_range = low, high, (int(lo), int(hi))
        self.chunk_records = 1024
        self.c_reset()

    cdef int _load(self, int64_t start, int64_t count) except -1:
        # Draw the whole 1024-instance chunk and keep `count`: instance i then
        # depends only on (seed, i), not on num_instances.
        cdef int64_t want = count
        count = 1024
        rng = np.random.default_rng([self.seed, start // 1024])
        cols = []
        offs = []
        for f in self.schema:
            if f.lod_level:
                lengths = rng.integers(self.length_range[0], self.length_range[1] + 1, size=count)
                off = np.zeros(count + 1, np.int64)
                np.cumsum(lengths, out=off[1:])
                rows = int(off[count])
            else:
                off = None
                rows = count
            shape = (rows,) + f.shape
            if f.dtype.kind == "f":
                a = (rng.random(shape) * (self.high - self.low) + self.low).astype(f.dtype)
            elif f.dtype.kind == "b":
                a = rng.integers(0, 2, size=shape).astype(bool)
            else:
                lo = max(int(np.floor(self.low)), int(np.iinfo(f.dtype).min))
                hi = min(int(np.ceil(self.high)), int(np.iinfo(f.dtype).max))
                if hi <= lo:
                    hi = lo + 1
                a = rng.integers(lo, hi, size=shape, dtype=np.int64).astype(f.dtype)
            cols.append(np.ascontiguousarray(a))
            offs.append(off)
        cdef rl_columns C
        cdef cnp.ndarray a_, o_
        cdef int k
        C.n = len(cols)
        for k in range(C.n):
            a_ = cols[k]
            C.ptr[k] = <const char *>cnp.PyArray_DATA(a_)
            if offs[k] is not None:
                o_ = offs[k]
                C.off[k] = <const int64_t *>cnp.PyArray_DATA(o_)
            else:
                C.off[k] = NULL
        cdef int64_t i, size = 0
        self._reserve(want)
        self.rec_off[0] = 0
        for i in range(want):
            size += columns_encoded_size(&self.layout, &C, i)
            self.rec_off[i + 1] = size
        self.cur = rl_block_new(size)
        if self.cur == NULL:
            raise MemoryError()
        for i in range(want):
            columns_encode(&self.layout, &C, i, self.cur.data + self.rec_off[i])
        return 0

    def __repr__(self):
        return f"RandomDataGenerator({self.schema}, num_instances={self.num_instances}, seed={self.seed})"

    def _describe(self):
        return {"num_instances": int(self.num_instances), "seed": int(self.seed),
                "low": float(self.low), "high": float(self.high),
                "length_range": [int(v) for v in self.length_range], "schema": self.schema.to_json()}

    def _reduce_args(self):
        return (self.schema, int(self.num_instances)), {
            "seed": int(self.seed), "low": self.low, "high": self.high, "length_range": self.length_range}


cdef class PythonReader(FileReader):
    """A file reader written in Python (the slow path).

    Parameters
    ----------
    make_iterator : callable
        Called at the start of each epoch; returns an iterator of instances
        (tuples, dicts, or single arrays for one-field schemas).
    schema : Schema
    """
    cdef object make_iterator
    cdef object _it
    cdef rl_block *cur
    cdef readonly int64_t index
    cdef bint _interrupted          # close() from another thread: end at the next item

    def __init__(self, make_iterator, schema):
        if not callable(make_iterator):
            raise TypeError("PythonReader needs a callable that returns an iterator of instances")
        self._set_schema(schema, ITEM_INSTANCE)
        self.make_iterator = make_iterator
        self._it = None
        self.index = 0

    def __dealloc__(self):
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        with gil:
            return self._next_py(out)

    cdef int _next_py(self, rl_record *out) except -1:
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        if self._interrupted:
            return 0
        if self._it is None:
            self._it = iter(self.make_iterator())
        try:
            item = next(self._it)
        except StopIteration:
            return 0
        except BaseException as e:
            if hasattr(e, "add_note"):
                e.add_note(f"raised by the iterator of {self!r} at instance {self.index}")
            raise
        try:
            self.cur = encode_instance(self.schema, &self.layout, item)
        except (TypeError, ValueError) as e:
            raise type(e)(f"PythonReader instance {self.index}: {e}") from None
        self.index += 1
        out.block = self.cur
        out.data = self.cur.data
        out.size = self.cur.size
        return 1

    cdef int c_reset(self) except -1:
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        self._it = None
        self.index = 0
        return 0

    def _interrupt(self):
        # close() from another thread while a read (a batch of a slow source)
        # is running: the stream ends at the next item, so that read returns
        # and closes the chain; a call inside the user's function is not cut short
        self._interrupted = True

    def __repr__(self):
        name = getattr(self.make_iterator, "__qualname__", type(self.make_iterator).__name__)
        return f"PythonReader({name}, {self.schema})"

    def _describe(self):
        return {"schema": self.schema.to_json()}

    def _reduce_args(self):
        return (self.make_iterator, self.schema), {}

    cdef int c_close(self) except -1:
        return self.c_reset()

