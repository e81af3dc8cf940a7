# cython: freethreading_compatible=False
"""Reader hierarchy (Paddle Fluid's readers, in Cython).

Design:
    ReaderBase        c_next / c_reset / c_close, Python read_next / reset / close
    FileReader        sources: ArrayReader, RandomDataGenerator, PythonReader,
                      RecordIOReader (formats/_recordio.pyx), TFRecordReader
    DecoratedReader   wraps `reader`: ShuffleReader, BatchReader, MultiPassReader
    ReaderHolder      type erasure: holds any chain, same interface

    Items move as `rl_record`s through `c_next` with the GIL released.  Shuffle
    keeps *references* to records (no copy); BatchReader copies each record
    once, into one freshly allocated batch block that the returned NumPy
    arrays view without a further copy.  Python objects appear only for what
    leaves the chain (`read_next`).
"""
import os
import threading
import warnings

import numpy as np
cimport numpy as cnp
from cpython.ref cimport PyObject
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib._parallel cimport parallel_for, threads_for
from readerlib._keyed cimport keyed_of
from readerlib.tensor import Field, LoDTensor, Schema

cnp.import_array()
rl_crc32c_init()


# Threads: one pool and one thread count per process, owned by readerlib._parallel
# (set_num_threads / get_num_threads are re-exported here for old callers).
from readerlib._parallel import get_num_threads, set_num_threads


cdef enum:
    _PAR_MAX_PARTS = 64         # a chunk checksum uses at most 2 * 64 parts
cdef double _CLOSE_LOCK_WAIT_S = 0.25   # close() waits this long for a read in another thread


cdef struct _crc_job:
    const char *p
    int64_t n
    int64_t part_len          # every part but the last; a multiple of 64
    int64_t n_parts
    uint32_t *crcs


cdef void _crc_parts(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _crc_job *j = <_crc_job *>ctx
    cdef int64_t k, start
    for k in range(begin, end):
        start = k * j.part_len
        j.crcs[k] = rl_crc32c(0, j.p + start,
                              j.part_len if k + 1 < j.n_parts else j.n - start)


cdef uint32_t crc32c_parallel(const char *p, int64_t n) noexcept nogil:
    """CRC-32C of n bytes: serial below 2 * MIN_BYTES_PER_THREAD, else parts
    checksummed on the pool's threads and combined in order (zlib's
    crc32_combine; the result never depends on the thread count)."""
    cdef int t = threads_for(n)
    cdef _crc_job j
    cdef uint32_t crcs[2 * _PAR_MAX_PARTS]
    cdef uint32_t acc
    cdef int64_t k
    if t < 2:
        return rl_crc32c(0, p, n)
    j.n_parts = 2 * t if 2 * t <= 2 * _PAR_MAX_PARTS else 2 * _PAR_MAX_PARTS
    j.part_len = (n // j.n_parts) & ~(<int64_t>63)
    j.p = p
    j.n = n
    j.crcs = crcs
    parallel_for(t, j.n_parts, _crc_parts, &j)
    acc = crcs[0]
    for k in range(1, j.n_parts):
        acc = rl_crc32c_combine(acc, crcs[k], j.part_len if k + 1 < j.n_parts else n - k * j.part_len)
    return acc


def _crc32c_parallel_py(data):
    """Test hook: crc32c_parallel over a bytes-like object."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    if view.shape[0] == 0:
        return 0
    return crc32c_parallel(<const char *>&view[0], view.shape[0])

__all__ = ["set_num_threads", "get_num_threads", "ReaderBase", "FileReader", "DecoratedReader", "ReaderHolder",
           "ShuffleReader", "BatchReader", "MultiPassReader", "ArrayReader",
           "RandomDataGenerator", "PythonReader", "crc32c"]


def crc32c(data, uint32_t crc=0):
    """CRC-32C (Castagnoli) of a bytes-like object, continuing from `crc`."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef uint32_t out
    with nogil:
        out = rl_crc32c(crc, &view[0] if view.shape[0] else NULL, view.shape[0])
    return out


cdef extern from "rl_core.h":
    int rl_crc32c_hw


def _crc32c_uses_hardware():
    return rl_crc32c_hw == 1


# --------------------------------------------------------------------- layout
cdef int layout_from_schema(rl_layout *L, object schema) except -1:
    cdef int i
    memset(L, 0, sizeof(rl_layout))
    if len(schema) > RL_MAX_FIELDS:
        raise ValueError(f"a schema may have at most {RL_MAX_FIELDS} fields, got {len(schema)}")
    L.nfields = len(schema)
    L.n_lod = 0
    cdef int64_t off = 0
    for i, f in enumerate(schema):
        L.row_bytes[i] = f.row_bytes
        L.lod[i] = f.lod_level
        L.fixed_offset[i] = off
        off += f.row_bytes
        if f.lod_level:
            L.n_lod += 1
    L.fixed_size = off if L.n_lod == 0 else -1
    return 0


cdef int layout_parse(const rl_layout *L, const char *data, int64_t size,
                      const char **ptrs, int64_t *rows) noexcept nogil:
    cdef int f
    cdef int64_t pos = 0, n, nbytes
    if L.bare:                      # one sequence field, no row-count prefix
        if size < 0 or (L.row_bytes[0] and size % L.row_bytes[0]):
            return -1
        ptrs[0] = data
        rows[0] = size // L.row_bytes[0] if L.row_bytes[0] else 0
        return 0
    if L.n_lod == 0:
        if size != L.fixed_size:
            return -1
        for f in range(L.nfields):
            ptrs[f] = data + L.fixed_offset[f]
            rows[f] = 1
        return 0
    for f in range(L.nfields):
        if L.lod[f]:
            if size - pos < 8:
                return -1
            n = rl_load_i64(data + pos)
            pos += 8
            if n < 0:
                return -1
            if L.row_bytes[f] and n > (size - pos) // L.row_bytes[f]:
                return -1
            nbytes = n * L.row_bytes[f]
            rows[f] = n
        else:
            nbytes = L.row_bytes[f]
            rows[f] = 1
            if size - pos < nbytes:
                return -1
        ptrs[f] = data + pos
        pos += nbytes
    return 0 if pos == size else -1


cdef int64_t columns_encoded_size(const rl_layout *L, const rl_columns *C, int64_t i) noexcept nogil:
    cdef int f
    cdef int64_t s = 0
    if L.n_lod == 0:
        return L.fixed_size
    for f in range(L.nfields):
        if L.lod[f]:
            s += 8 + (C.off[f][i + 1] - C.off[f][i]) * L.row_bytes[f]
        else:
            s += L.row_bytes[f]
    return s


cdef int64_t columns_encode(const rl_layout *L, const rl_columns *C, int64_t i, char *out) noexcept nogil:
    """Encode instance i of the columns at `out`; returns bytes written."""
    cdef int f
    cdef int64_t pos = 0, r0, n, nb
    for f in range(L.nfields):
        if L.lod[f]:
            r0 = C.off[f][i]
            n = C.off[f][i + 1] - r0
            rl_store_i64(out + pos, n)
            pos += 8
            nb = n * L.row_bytes[f]
            memcpy(out + pos, C.ptr[f] + r0 * L.row_bytes[f], nb)
        else:
            nb = L.row_bytes[f]
            memcpy(out + pos, C.ptr[f] + i * nb, nb)
        pos += nb
    return pos


def _check_int_range(arr, field, what):
    """Integers that do not fit the field's integer dtype are an error, not a wrap-around."""
    if field.dtype.kind in "iu" and arr.dtype.kind in "iu" and arr.size:
        info = np.iinfo(field.dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{what}: field {field.name!r} ({field.dtype}) cannot hold "
                             f"{lo if lo < info.min else hi}")


def _cast_to_field(arr, field, what):
    """`arr` in the field's dtype: same-kind casts and bool/int -> int/float,
    with integers range-checked; anything else is a TypeError naming the field."""
    if arr.dtype == field.dtype:
        return arr
    if arr.dtype.kind == "O":
        raise TypeError(f"{what}: field {field.name!r} got an object array, expected {field.dtype}")
    if not np.can_cast(arr.dtype, field.dtype, casting="same_kind") and not (
            arr.dtype.kind in "iub" and field.dtype.kind in "iuf"):
        raise TypeError(f"{what}: field {field.name!r} has dtype {field.dtype}, got {arr.dtype}")
    _check_int_range(arr, field, what)
    return arr.astype(field.dtype)


cdef object _as_field_array(object value, object field, str what):
    """One instance's value for `field` as a C-contiguous array of the right dtype/shape."""
    arr = _cast_to_field(np.asarray(value), field, what)
    if field.lod_level:
        if arr.ndim == len(field.shape):            # a single step given without the time axis
            raise ValueError(f"{what}: field {field.name!r} is a sequence (lod_level=1) of steps "
                             f"{field.shape}; got shape {arr.shape} (no time axis)")
        if arr.shape[1:] != field.shape:
            raise ValueError(f"{what}: field {field.name!r} steps have shape {field.shape}, "
                             f"got value of shape {arr.shape}")
    elif arr.shape != field.shape:
        if arr.size == field.row_elems and arr.size == 1 and field.shape == ():
            arr = arr.reshape(())
        else:
            raise ValueError(f"{what}: field {field.name!r} has shape {field.shape}, got {arr.shape}")
    return np.ascontiguousarray(arr)


cdef list _instance_values(object schema, object instance, str what):
    """Normalise a tuple / list / dict / single value into a list of arrays."""
    n = len(schema)
    if isinstance(instance, dict):
        missing = [f.name for f in schema if f.name not in instance]
        extra = [k for k in instance if k not in schema.names]
        if missing or extra:
            raise ValueError(f"{what}: instance keys do not match the schema "
                             f"(missing {missing}, unknown {extra})")
        values = [instance[f.name] for f in schema]
    elif isinstance(instance, tuple) or (isinstance(instance, list) and n > 1):
        if len(instance) != n:
            raise ValueError(f"{what}: instance has {len(instance)} values, the schema has {n} fields "
                             f"{list(schema.names)}")
        values = list(instance)
    elif n == 1:
        values = [instance]
    else:
        raise TypeError(f"{what}: an instance is a tuple, list or dict of {n} values, "
                        f"got {type(instance).__name__}")
    return [_as_field_array(v, f, what) for v, f in zip(values, schema)]


cdef rl_block *encode_instance(object schema, const rl_layout *L, object instance) except NULL:
    values = _instance_values(schema, instance, "instance")
    cdef rl_columns C
    cdef int64_t offs[RL_MAX_FIELDS * 2]
    cdef int f
    cdef cnp.ndarray a
    C.n = L.nfields
    for f in range(L.nfields):
        a = values[f]
        C.ptr[f] = <const char *>cnp.PyArray_DATA(a)
        if L.lod[f]:
            offs[2 * f] = 0
            offs[2 * f + 1] = a.shape[0]
            C.off[f] = &offs[2 * f]
        else:
            C.off[f] = NULL
    cdef int64_t size = columns_encoded_size(L, &C, 0)
    cdef rl_block *b = rl_block_new(size)
    if b == NULL:
        raise MemoryError()
    columns_encode(L, &C, 0, b.data)
    return b


# -------------------------------------------------------------- Python views
cdef class BlockRef:
    """Keeps an rl_block alive for NumPy arrays that view it."""

    def __dealloc__(self):
        if self.block != NULL:
            rl_block_decref(self.block)
            self.block = NULL


cdef BlockRef block_ref(rl_block *b):
    cdef BlockRef r = BlockRef.__new__(BlockRef)
    rl_block_incref(b)
    r.block = b
    return r


cdef object _view(object owner, const char *ptr, int64_t rows, object field):
    cdef cnp.npy_intp dims[33]
    cdef int nd = 1 + len(field.shape)
    cdef int k
    if nd > 32:
        raise ValueError("too many dimensions")
    dims[0] = rows
    for k in range(1, nd):
        dims[k] = field.shape[k - 1]
    arr = cnp.PyArray_SimpleNewFromData(nd, dims, field.dtype.num, <void *>ptr)
    cnp.set_array_base(arr, owner)
    return arr


cdef object trusted_lod(object data, list lod):
    t = LoDTensor.__new__(LoDTensor)
    t.data = data
    t.lod = lod
    return t


# Batch block: int64 header [n, nfields, (rows, data_off, lod_off) * nfields],
# then 64-byte aligned sections.
cdef inline int64_t _align64(int64_t x) noexcept nogil:
    return (x + 63) & ~(<int64_t>63)


cdef object _wrap_batch(ReaderBase r, rl_record *rec):
    cdef BlockRef owner = block_ref(rec.block)
    cdef const char *base = rec.data
    cdef int64_t n = rl_load_i64(base)
    cdef int nf = <int>rl_load_i64(base + 8)
    cdef int f
    cdef int64_t rows, doff, loff
    out = []
    for f in range(nf):
        rows = rl_load_i64(base + 16 + 24 * f)
        doff = rl_load_i64(base + 24 + 24 * f)
        loff = rl_load_i64(base + 32 + 24 * f)
        field = r.schema.fields[f]
        if loff >= 0:
            data = _view(owner, base + doff, rows, field)
            lod = [_view(owner, base + loff, n + 1, _OFFSETS_FIELD)]
        elif loff == -2:    # a padded sequence field, dense [n, rows, *shape] (readers/_codec.pxd)
            data = _view(owner, base + doff, n * rows, field).reshape((n, rows) + field.shape)
            lod = []
        else:
            data = _view(owner, base + doff, n, field)
            lod = []
        out.append(trusted_lod(data, lod))
    return keyed_of(r.schema, True, out)       # a Batch: a tuple keyed by field name (readerlib/_keyed.pyx)


_OFFSETS_FIELD = Field("offsets", "int64")


cdef object _decode_instance(ReaderBase r, rl_record *rec):
    cdef const char *ptrs[RL_MAX_FIELDS]
    cdef int64_t rows[RL_MAX_FIELDS]
    cdef int f
    if layout_parse(&r.layout, rec.data, rec.size, ptrs, rows) != 0:
        raise ValueError(f"malformed record of {rec.size} bytes for schema {r.schema}")
    out = []
    for f in range(r.layout.nfields):
        field = r.schema.fields[f]
        dt = field.dtype
        if r.layout.lod[f]:
            shape = (rows[f],) + field.shape
        else:
            shape = field.shape
        nbytes = rows[f] * r.layout.row_bytes[f]
        a = np.empty(shape, dtype=dt)
        if nbytes:
            memcpy(cnp.PyArray_DATA(a), ptrs[f], nbytes)
        out.append(a)
    return keyed_of(r.schema, False, out)      # an Instance (readerlib/_keyed.pyx)



# ------------------------------------------------------- state (checkpoints)
STATE_VERSION = 2


def _nest(flat):
    """[top, parent, ...] reader dicts -> one dict nesting each parent's under "parent"."""
    out = None
    for d in reversed(flat):
        d = dict(d)
        if out is not None:
            d["parent"] = out
        out = d
    return out


def _flatten(state):
    """The nested reader dicts of a state, top first (position/version dropped)."""
    flat = []
    d = state
    while d is not None:
        if not isinstance(d, dict) or "type" not in d:
            raise ValueError(f"set_state: malformed state (a reader entry without a type: {d!r:.200})")
        e = {k: v for k, v in d.items() if k not in ("parent", "version", "position")}
        flat.append(e)
        d = d.get("parent")
    return flat


def _check_fits(readers, saved):
    """Raise ValueError naming the first way `saved` (flat reader dicts) was
    not made by a chain built like `readers`."""
    chain_types = [type(r).__name__ for r in readers]
    saved_types = [d.get("type") for d in saved]
    for k, r in enumerate(readers):
        where = f"reader {k} from the top ({chain_types[k]})"
        if k >= len(saved):
            raise ValueError(f"state does not fit this chain: it has {len(saved)} readers "
                             f"{saved_types}, this chain {len(readers)} {chain_types}")
        d = saved[k]
        if d.get("type") != chain_types[k]:
            raise ValueError(f"state does not fit this chain: {where} is a {d.get('type')} in the "
                             f"state (state {saved_types}, chain {chain_types})")
        for key, want in r._describe().items():
            if key not in d:
                raise ValueError(f"state does not fit this chain: {where}: the state has no {key!r}")
            if d[key] != want:
                raise ValueError(f"state does not fit this chain: {where}: {key} is {d[key]!r} in "
                                 f"the state, {want!r} in this chain")
    if len(saved) != len(readers):
        raise ValueError(f"state does not fit this chain: it has {len(saved)} readers {saved_types}, "
                         f"this chain {len(readers)} {chain_types}")


def _file_identity(fd, path, int64_t size):
    """What tells one file from another in a state: its name, size, and a
    CRC-32C of its first and last 4 KiB (a RecordIO header holds a random
    file id, its last bytes the index checksum) -- read with pread, so a
    copy of the file (new mtime, same bytes) still fits and another does not."""
    head = os.pread(fd, 4096, 0) if size > 0 else b""
    tail = os.pread(fd, 4096, max(0, size - 4096)) if size > 4096 else b""
    cdef const char *h = head
    cdef const char *t = tail
    crc = rl_crc32c(rl_crc32c(0, h, len(head)), t, len(tail))
    return {"name": os.path.basename(os.fspath(path)), "size": int(size), "crc32c": int(crc)}


def _rebuild_chain(spec, state, started):
    """Unpickle a chain: build it from its description, then restore its state."""
    r = None
    for make, args, kwargs in spec:
        r = make(*args, **kwargs) if r is None else make(r, *args, **kwargs)
    (<ReaderBase>r).set_state(state)
    if started:                  # it was mid-epoch: iter() starts the next one, as the original would
        (<ReaderBase>r)._resuming = False
        r._mark_started(True)
    return r


# ------------------------------------------------------------------ the base
cdef class ReaderBase:
    """Base of every reader: `read_next()` returns the next item or None.

    Items are instances (a tuple of NumPy arrays, one per schema field) or,
    after `.batch()`, batches (a tuple of LoDTensor).  `iter(reader)` starts
    a new epoch when anything has been read since the last reset (like a
    tf.data Dataset), and otherwise continues the current one (a fresh
    reader, or one positioned by `set_state`).  `reset()` restarts the chain.
    """

    def __cinit__(self, *args, **kwargs):
        self._closed = False
        self._started = False
        self.item_kind = ITEM_INSTANCE
        self._lock = threading.RLock()

    cdef int _set_schema(self, object schema, int item_kind) except -1:
        self.schema = Schema.coerce(schema)
        layout_from_schema(&self.layout, self.schema)
        self.item_kind = item_kind
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__} does not implement c_next")

    cdef int c_reset(self) except -1:
        return 0

    cdef int c_close(self) except -1:
        return 0

    def _check_open(self):
        if self._closed:
            raise ValueError(f"I/O operation on closed reader ({type(self).__name__})")

    def read_next(self):
        """The next instance or batch, or None at the end of the epoch.

        Safe to call from several threads: calls on one reader are serialised
        (each item still goes to exactly one caller).
        """
        cdef rl_record rec
        cdef int r
        if self._closed:                     # without waiting for a read in another thread
            self._check_open()
        try:
            with self._lock:
                if self._closed:
                    self._check_open()
                self._begin_read()
                with nogil:
                    r = self.c_next(&rec)
                if r == 0:
                    return None
                self._position += 1
                # the record is borrowed until the next c_next: wrap it under the lock
                if self.item_kind == ITEM_BATCH:
                    return _wrap_batch(self, &rec)
                return _decode_instance(self, &rec)
        finally:
            if self._close_pending:          # close() from another thread left it to us
                self.close()

    def reset(self):
        """Restart the whole chain; shuffles draw a new order (next epoch)."""
        with self._lock:
            self._check_open()
            self.c_reset()
            self._resuming = False
            self._position = 0
            self._mark_started(False)

    cdef int _begin_read(self) except -1:
        if not self._started:
            if self._resuming:
                self._resuming = False
            else:
                self._epoch_snapshot = self._chain_epoch_state()
                self._position = 0
            self._mark_started(True)
        return 0

    def _mark_started(self, bint started):
        """Flag every reader of the chain as mid-epoch (or fresh after reset)."""
        for r in self._walk():
            (<ReaderBase>r)._started = started

    # -- checkpoint / resume -------------------------------------------------
    def _upstream(self):
        """The readers this one reads from (to walk a chain)."""
        r = getattr(self, "reader", None)
        return [r] if isinstance(r, ReaderBase) else []

    def _walk(self):
        """This reader and everything upstream, breadth first."""
        out = [self]
        i = 0
        while i < len(out):
            out.extend(out[i]._upstream())
            i += 1
        return out

    def _epoch_state(self):
        """What this reader needs, besides the position, to replay an epoch."""
        return {}

    def _set_epoch_state(self, state):
        pass

    def _describe(self):
        """What makes this reader yield what it yields (its parameters, its
        file's identity), as JSON values: a state is refused by a reader
        whose description differs (see set_state)."""
        return {}

    def _reduce_args(self):
        """(args, kwargs) that rebuild this reader (decorators: after the
        upstream reader), for pickling; see __reduce__."""
        raise TypeError(f"{type(self).__name__} cannot be pickled (it does not describe how to "
                        f"rebuild it); build the chain in each process instead")

    def _rebuild_with(self):
        """The callable _reduce_args' arguments go to (default: the class)."""
        return type(self)

    def _chain_epoch_state(self):
        out = []
        for r in self._walk():
            d = {"type": type(r).__name__}
            d.update(r._describe())
            d.update(r._epoch_state())
            out.append(d)
        return out

    def get_state(self):
        """The chain's position as a small JSON-serialisable dict.

        `set_state(state)` on an identically built chain (in this or another
        process) makes it yield exactly what this one yields next.  Nothing
        large is stored: shuffle buffers are recomputed from (seed, epoch,
        position) by replaying the epoch up to the position.

        The dict describes the reader it was taken from and nests the
        description of the reader below under ``"parent"``: type, the
        parameters that decide what comes out (batch size, shuffle buffer
        and seed, ...), the identity of its file (name, size and a checksum
        of its first and last 4 KiB), and its epoch.
        """
        if self._epoch_snapshot is None or not self._started:
            if not self._resuming:
                self._epoch_snapshot = self._chain_epoch_state()
                self._position = 0
        state = {"version": STATE_VERSION, "position": int(self._position)}
        state.update(_nest([dict(d) for d in self._epoch_snapshot]))
        return state

    def set_state(self, state):
        """Restore a position from `get_state()` (see there).

        Raises
        ------
        ValueError
            When the state was not made by a chain built like this one: it
            names the first difference (a reader's type, a parameter such
            as ``batch_size`` or ``seed``, a file's identity).  A seed that
            a shuffle drew itself (no ``seed=``) is taken from the state.
        """
        self._check_open()
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"set_state takes a dict made by get_state() (version {STATE_VERSION}), "
                             f"got {'version ' + repr(state.get('version')) if isinstance(state, dict) else type(state).__name__}")
        readers = self._walk()
        saved = _flatten(state)
        _check_fits(readers, saved)
        position = state.get("position")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"state position must be an int >= 0, got {position!r}")
        self.c_reset()
        for r, d in zip(readers, saved):
            r._set_epoch_state({key: v for key, v in d.items() if key != "type"})
        cdef rl_record rec
        cdef int64_t i, n_skip = position
        cdef int got = 1
        with nogil:
            i = 0
            while i < n_skip:
                got = self.c_next(&rec)
                if got != 1:
                    break
                i += 1
        if got != 1:
            raise ValueError(f"state position {position} is past the end of the epoch ({i} items)")
        self._mark_started(False)
        self._epoch_snapshot = [dict(d) for d in saved]
        self._position = position
        self._resuming = True

    def _epoch_started(self):
        """True when items were read since the last reset (iter() would start the next epoch)."""
        return bool(self._started)

    def _skip(self, n):
        """Read and drop `n` items in compiled code (no Python objects); returns
        how many there were (fewer at the end of the epoch).  Counts as read."""
        cdef rl_record rec
        cdef int64_t i = 0, want = n
        cdef int got = 1
        with self._lock:
            self._check_open()
            self._begin_read()
            with nogil:
                while i < want:
                    got = self.c_next(&rec)
                    if got != 1:
                        break
                    i += 1
            self._position += i
        return int(i)

    def __reduce__(self):
        # A chain pickles as its description: how to rebuild each reader
        # (source first) and the chain's state, so an unpickled chain (a
        # spawn/forkserver DataLoader worker) continues where this one is.
        spec = []
        for r in reversed(self._walk()):
            args, kwargs = r._reduce_args()
            spec.append((r._rebuild_with(), tuple(args), dict(kwargs)))
        return (_rebuild_chain, (spec, self.get_state(), bool(self._started)))

    def _interrupt(self):
        """Wake a read_next() blocked in this reader (close() from another thread)."""
        pass

    def close(self):
        """Release files and buffers of the whole chain.  Idempotent.

        May be called from another thread while a read_next() is waiting on a
        prefetcher or open_files: that read returns None (or the partial batch
        read so far) and the chain is then closed.  While a read_next() in
        another thread is inside a slow user function, close() returns after
        0.25 s with the reader marked closed, and that read closes the chain
        when it returns.
        """
        if self._closed and not self._close_pending:
            return
        for r in self._walk():
            r._interrupt()
        # The interrupts wake a read_next() (another thread's, holding the lock)
        # that waits on a prefetcher or open_files.  One inside a slow user
        # function (a PythonReader's iterator) cannot be woken: close() does not
        # wait for it, it leaves the close to that read, which does it as soon as
        # it returns (the checks below make one of the two do it, whatever the
        # interleaving).
        if not self._lock.acquire(True, _CLOSE_LOCK_WAIT_S):
            self._close_pending = True
            self._closed = True             # reads from now on raise
            if not self._lock.acquire(False):
                return
        try:
            if self._close_pending or not self._closed:
                self._close_pending = False
                self._closed = True
                self.c_close()
        finally:
            self._lock.release()

    @property
    def closed(self):
        return self._closed

    @property
    def bare_instances(self):
        """True when this reader's instances are a single sequence field's rows
        without the int64 row-count prefix (see readers/_base.pxd)."""
        return bool(self.layout.bare) and self.item_kind == ITEM_INSTANCE

    def _prefixed_instances(self):
        """Make a reader with bare instances give prefixed ones instead (before
        reading); `open_files` uses it when it mixes formats.  Only sources that
        can produce both forms implement it."""
        if self.layout.bare:
            raise NotImplementedError(f"{type(self).__name__} cannot prefix its instances")

    @property
    def is_batched(self):
        return self.item_kind == ITEM_BATCH

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __iter__(self):
        """A new epoch's iterator (resetting the chain if it was read from).

        Like a tf.data Dataset: every `iter(reader)` / `for` starts an epoch,
        and iterating the returned iterator again continues it.
        """
        self._check_open()
        if self._started:
            self.reset()
        return _EpochIterator(self)

    def __next__(self):
        item = self.read_next()
        if item is None:
            raise StopIteration
        return item

    # -- fluent decoration -------------------------------------------------
    def shuffle(self, buffer_size, seed=None):
        """`ShuffleReader(self, buffer_size, seed)`."""
        return ShuffleReader(self, buffer_size, seed)

    def batch(self, batch_size, drop_last=False):
        """`BatchReader(self, batch_size, drop_last)`."""
        return BatchReader(self, batch_size, drop_last)

    def multi_pass(self, num_passes):
        """`MultiPassReader(self, num_passes)`."""
        return MultiPassReader(self, num_passes)

    def shard(self, num_shards, index):
        """`ShardReader(self, num_shards, index)`: every `num_shards`-th item from `index`."""
        from readerlib.readers._multifile import ShardReader
        return ShardReader(self, num_shards, index)

    def prefetch(self, capacity=2, device=None, timeout=None):
        """`PrefetchReader(self, capacity, device, timeout)`: a background thread keeps
        up to `capacity` items ready (on the GPU with device="cuda")."""
        from readerlib.readers._prefetch import PrefetchReader
        return PrefetchReader(self, capacity, device=device, timeout=timeout)

    # -- transformations (readers/_map.pyx, _slice.pyx, _padded.pyx; docs/transformations.md)
    def map(self, fn, num_threads=1, deterministic=True, output_schema=None):
        """`MapReader(self, fn, ...)`: `fn(instance) -> instance` on every instance,
        on `num_threads` threads, in input order; the chain stays compiled."""
        from readerlib.readers._map import MapReader
        return MapReader(self, fn, num_threads=num_threads, deterministic=deterministic,
                         output_schema=output_schema)

    def map_batches(self, fn, output_schema=None):
        """`MapBatchesReader(self, fn, output_schema)`: `fn(batch) -> batch` on every batch."""
        from readerlib.readers._map import MapBatchesReader
        return MapBatchesReader(self, fn, output_schema=output_schema)

    def filter(self, predicate):
        """`FilterReader(self, predicate)`: the items for which `predicate(item)` is true."""
        from readerlib.readers._map import FilterReader
        return FilterReader(self, predicate)

    def take(self, count):
        """`TakeReader(self, count)`: the first `count` items of each epoch."""
        from readerlib.readers._slice import TakeReader
        return TakeReader(self, count)

    def skip(self, count):
        """`SkipReader(self, count)`: each epoch without its first `count` items."""
        from readerlib.readers._slice import SkipReader
        return SkipReader(self, count)

    def repeat(self, count=None):
        """`RepeatReader(self, count)`: `count` epochs of this reader in one, or forever (None);
        each pass a new epoch below (a new shuffle order)."""
        from readerlib.readers._slice import RepeatReader
        return RepeatReader(self, count)

    def padded_batch(self, batch_size, pad_value=0, pad_to_multiple_of=None, drop_last=False):
        """`PaddedBatchReader(self, ...)`: batches whose sequence fields are dense
        [B, T, ...] arrays, padded with `pad_value`, plus an int64 `<name>_length` field each."""
        from readerlib.readers._padded import PaddedBatchReader
        return PaddedBatchReader(self, batch_size, pad_value=pad_value,
                                 pad_to_multiple_of=pad_to_multiple_of, drop_last=drop_last)

    def bucket_by_length(self, boundaries, batch_sizes=None, length_field=None, drop_remainder=False,
                         max_tokens=None, pad_value=0, pad_to_bucket_boundary=False, padded=True):
        """`BucketByLengthReader(self, ...)`: batches of similar lengths (tf.data's
        `bucket_by_sequence_length`), or of at most `max_tokens` padded rows."""
        from readerlib.readers._padded import BucketByLengthReader
        return BucketByLengthReader(self, boundaries, batch_sizes, length_field=length_field,
                                    drop_remainder=drop_remainder, max_tokens=max_tokens,
                                    pad_value=pad_value, pad_to_bucket_boundary=pad_to_bucket_boundary,
                                    padded=padded)

    @property
    def element_spec(self):
        """The schema of what read_next() returns; `is_batched` says whether items are
        batches (then every field has the batch dimension first)."""
        return self.schema

    def __len__(self):
        """Items per epoch where the chain knows it without reading (sources with an
        index, and take/skip/batch/shuffle/map/repeat(count) over them); else TypeError."""
        from readerlib.readers._slice import length_of
        n = length_of(self)
        if n is None:
            raise TypeError(f"the length of {type(self).__name__} is not known without reading it")
        return n

    def __bool__(self):
        return True         # a reader is a reader, whatever len() says


cdef class _EpochIterator:
    """What iter(reader) returns: yields the rest of the epoch; iter() of it is itself."""
    cdef ReaderBase reader

    def __init__(self, ReaderBase reader):
        self.reader = reader

    def __iter__(self):
        return self

    def __next__(self):
        item = self.reader.read_next()
        if item is None:
            raise StopIteration
        return item


cdef class FileReader(ReaderBase):
    """A source of instances (a file, arrays, a generator)."""
    pass


class _PieceFile:
    """A file written in whole pieces at known offsets (pwritev): a piece is
    either all in the file or rolled back (the file truncated to where the
    piece began), so a failed write -- ENOSPC, EFBIG past RLIMIT_FSIZE, EIO --
    leaves the file exactly as it was after the last complete piece, and the
    same piece can be written again.  Writers keep what they had not yet
    written when a write fails, so a retry (the next write, flush or close)
    continues the file correctly.  SQLite's rule: a committed write survives,
    a torn one is detected (here: removed, or, after a kill, left for the
    reader's checks)."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.pos = 0                 # bytes committed: the file's size after the last good piece

    def write(self, *pieces):
        """Append the pieces (bytes-like), all or nothing; returns the bytes written."""
        views = [memoryview(x).cast("B") for x in pieces if len(x)]
        total = sum(len(v) for v in views)
        done = 0
        try:
            while views:
                n = os.pwritev(self.fd, views, self.pos + done)
                done += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, self.pos)      # roll back the torn piece
            except OSError:
                pass
            raise type(e)(e.errno, f"{e.strerror}: writing {total} bytes at byte offset {self.pos} "
                          f"failed; the file keeps the {self.pos} bytes written before (the write "
                          f"can be retried)", self.path) from e
        self.pos += total
        return total

    def flush(self):
        pass                         # nothing is buffered here: every piece is with the OS

    def close(self):
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


cdef class FileWriter:
    """What every file writer shares: it is open from ``__init__`` (which sets
    ``self._f`` to a `_PieceFile` and ``self._closed = False``) until
    ``close()``, which runs the subclass's ``_finish()`` (last buffered data,
    footers) and then closes the file, once.  A context manager.

    A failed write raises (OSError naming the file and offset) and leaves the
    file readable up to its last complete piece; what was not written stays
    buffered, so a later write, flush() or close() retries it.  close()
    raises when the file cannot be finished (and can be called again); it
    never reports success for a file that does not read back.  An unclosed
    writer still finishes its file when collected; if that fails, a warning
    (`_gc_warning`, a RecordIOWarning / TFRecordWarning) names the path."""

    def __cinit__(self, *args, **kwargs):
        self._closed = True

    def __del__(self):
        if not self._closed and self._f is not None:
            try:
                self.close()
            except Exception as e:
                warnings.warn(f"{type(self).__name__}({getattr(self, 'path', '?')!r}) was "
                              f"garbage-collected unclosed and finishing the file failed ({e}); the "
                              f"file holds only what was written before (records still buffered are "
                              f"lost): close() writers explicitly", self._gc_warning(), stacklevel=1)
                self._closed = True
                try:
                    self._f.close()
                except Exception:
                    pass

    def _gc_warning(self):
        return ResourceWarning

    def _check_open(self):
        if self._closed:
            raise ValueError(f"I/O operation on closed {type(self).__name__}")

    def _finish(self):
        """Write what is still buffered and any footer (subclasses)."""

    def close(self):
        """Finish the file and close it.  Idempotent once it succeeded.

        Raises (OSError) when the file cannot be finished; the writer then
        stays open, so close() can be retried (e.g. after freeing space)."""
        if self._closed:
            return
        self._finish()               # raises: still open, the file ends at its last good piece
        self._closed = True
        self._f.close()

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


cdef class DecoratedReader(ReaderBase):
    """A reader that transforms the items of another (`self.reader`)."""

    def __init__(self, ReaderBase reader not None):
        reader._check_open()
        if reader._started:          # a fresh chain starts at the top of an epoch
            reader.reset()
        self.reader = reader
        self._set_schema(reader.schema, reader.item_kind)
        # instances pass through unchanged, in the form their source gives them
        self.layout.bare = reader.layout.bare if reader.item_kind == ITEM_INSTANCE else 0

    cdef int c_reset(self) except -1:
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self.reader.close()
        return 0

    def __repr__(self):
        return f"{type(self).__name__}({self.reader!r})"


def _check_positive_int(value, name, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return int(value)


def _check_reader(reader, who):
    if not isinstance(reader, ReaderBase):
        raise TypeError(f"{who} decorates a readerlib reader, got {type(reader).__name__}")
    return reader


# ------------------------------------------------------------------ holder
cdef class ReaderHolder(ReaderBase):
    """Type-erasing holder: any reader in, the same interface out.

    `holder.reader` gives the held chain back; `holder.reset_reader(r)`
    swaps it (Paddle's ReaderHolder).
    """
    cdef ReaderBase _held

    def __init__(self, reader):
        self.reset_reader(reader)

    def reset_reader(self, reader):
        _check_reader(reader, "ReaderHolder")
        reader._check_open()
        if self._held is not None and reader.item_kind == ITEM_INSTANCE and \
                reader.bare_instances != self.bare_instances:
            # decorators above took this holder's instance form when they were
            # built: the new reader must give the same one
            if self.bare_instances:
                raise ValueError(
                    f"ReaderHolder.reset_reader: the held reader gives bare instances (no row-count "
                    f"prefix, e.g. TFRecord sequences) and {type(reader).__name__} does not; "
                    f"build a new chain over it instead")
            try:
                reader._prefixed_instances()
            except (NotImplementedError, RuntimeError) as e:
                raise ValueError(f"ReaderHolder.reset_reader: {e}") from None
        self._held = reader
        self._set_schema(reader.schema, reader.item_kind)
        self.layout.bare = (<ReaderBase>reader).layout.bare if reader.item_kind == ITEM_INSTANCE else 0

    @property
    def reader(self):
        return self._held

    def _upstream(self):
        return [self._held]

    def _reduce_args(self):
        return (), {}

    cdef int c_next(self, rl_record *out) except -1 nogil:
        return self._held.c_next(out)

    cdef int c_reset(self) except -1:
        return self._held.c_reset()

    cdef int c_close(self) except -1:
        self._held.close()
        return 0


# ----------------------------------------------------------------- shuffle
cdef extern from *:
    void __builtin_prefetch(const void *p) nogil


cdef struct _bref:
    rl_block *block
    int64_t count        # references held by this shuffle (slots + output)
    int64_t next_free


cdef class ShuffleReader(DecoratedReader):
    """Shuffle through a buffer of `buffer_size` items (tf.data's algorithm).

    Every item comes out exactly once per epoch.  The order is a function of
    (seed, epoch): the same seed gives the same order, and each `reset()`
    starts a new epoch with a new order.  The buffer holds references to
    records, not copies.

    Parameters
    ----------
    reader : ReaderBase
    buffer_size : int
        Items held; 1 means no shuffling.
    seed : int, optional
        Pass `seed=` to make the order reproducible; without it a seed is
        drawn from the OS once, at construction.
    """
    # Design: slots[] hold borrowed-then-kept records.  Keeping a record
    # means keeping its block; instead of one atomic incref/decref per
    # record, blocks are counted in a local table (`btab`, non-atomic) and
    # only the first/last local reference touches the block's atomic count.
    # Records arrive in runs from the same block, so the common case is one
    # comparison and one increment.
    cdef rl_record *slots
    cdef int64_t *slot_ref
    cdef int64_t scap            # allocated slots (grows up to cap)
    cdef _bref *btab
    cdef int64_t btab_free
    cdef int64_t btab_last
    cdef int64_t cap
    cdef int64_t count
    cdef bint filled
    cdef bint upstream_done
    cdef int64_t hold
    cdef int64_t next_j          # the next draw, made one call ahead to prefetch its data
    cdef rl_rng rng
    cdef readonly uint64_t seed
    cdef readonly int64_t epoch
    cdef readonly bint seed_drawn    # no seed= given: drawn from the OS (travels in the state)

    def __init__(self, reader, buffer_size, seed=None):
        _check_reader(reader, "ShuffleReader")
        cap = _check_positive_int(buffer_size, "buffer_size")
        self.seed_drawn = seed is None
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        DecoratedReader.__init__(self, reader)
        self.cap = cap
        self.count = 0
        self.hold = -1
        self.scap = 0
        self.btab_free = -1
        self.btab_last = -1
        self._grow(min(cap, 1024))
        self.seed = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        self.epoch = 0
        self._restart()

    cdef int _grow(self, int64_t n) except -1 nogil:
        """Room for n buffered items (the buffer grows as it fills: a huge
        buffer_size over a small dataset costs only what is used)."""
        cdef int64_t i, old = self.scap
        cdef rl_record *s2
        cdef int64_t *r2
        cdef _bref *b2
        if n <= old:
            return 0
        s2 = <rl_record *>realloc(self.slots, n * sizeof(rl_record))
        if s2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.slots = s2
        r2 = <int64_t *>realloc(self.slot_ref, n * sizeof(int64_t))
        if r2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.slot_ref = r2
        # at most (items + 1) distinct blocks are held: n + 2 table entries
        b2 = <_bref *>realloc(self.btab, (n + 2) * sizeof(_bref))
        if b2 == NULL:
            with gil:
                raise MemoryError(f"shuffle buffer of {n} items")
        self.btab = b2
        for i in range((old + 2) if old else 0, n + 2):
            self.btab[i].block = NULL
            self.btab[i].count = 0
            self.btab[i].next_free = i + 1 if i + 1 < n + 2 else self.btab_free
        self.btab_free = (old + 2) if old else 0
        self.scap = n
        return 0

    cdef inline int64_t _acquire(self, rl_block *b) noexcept nogil:
        cdef int64_t i = self.btab_last
        if i >= 0 and self.btab[i].block == b:
            self.btab[i].count += 1
            return i
        i = self.btab_free                 # never empty: at most cap + 1 blocks are held
        self.btab_free = self.btab[i].next_free
        self.btab[i].block = b
        self.btab[i].count = 1
        rl_block_incref(b)
        self.btab_last = i
        return i

    cdef inline void _release(self, int64_t i) noexcept nogil:
        self.btab[i].count -= 1
        if self.btab[i].count == 0:
            rl_block_decref(self.btab[i].block)
            self.btab[i].block = NULL
            self.btab[i].next_free = self.btab_free
            self.btab_free = i
            if self.btab_last == i:
                self.btab_last = -1

    cdef void _drop(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.count):
            self._release(self.slot_ref[i])
        self.count = 0
        if self.hold >= 0:
            self._release(self.hold)
            self.hold = -1

    cdef void _restart(self) noexcept nogil:
        self._drop()
        self.filled = False
        self.upstream_done = False
        self.next_j = -1
        rl_rng_seed(&self.rng, self.seed, <uint64_t>self.epoch)

    def __dealloc__(self):
        if self.slots != NULL and self.slot_ref != NULL and self.btab != NULL:
            self._drop()
        free(self.slots)
        free(self.slot_ref)
        free(self.btab)
        self.slots = NULL
        self.slot_ref = NULL
        self.btab = NULL

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef rl_record rec
        cdef int r
        cdef uint64_t j
        if self.hold >= 0:
            self._release(self.hold)
            self.hold = -1
        if not self.filled:
            while self.count < self.cap:
                if self.count == self.scap:
                    self._grow(min(self.cap, 2 * self.scap))
                # an exception here leaves the buffer as it was: the next
                # call goes on filling it
                r = self.reader.c_next(&rec)
                if r == 0:
                    self.upstream_done = True
                    break
                self.slot_ref[self.count] = self._acquire(rec.block)
                self.slots[self.count] = rec
                self.count += 1
            self.filled = True
        if self.count == 0:
            return 0
        if self.next_j >= 0:
            j = <uint64_t>self.next_j
        else:
            j = rl_rng_below(&self.rng, <uint64_t>self.count)
            # kept until the slot is emitted: if the refill below raises, the
            # next call emits this same slot (the order is the one the
            # failed record's absence gives, and nothing is lost or repeated)
            self.next_j = <int64_t>j
        # Refill first, emit after.  c_next is `except -1`: an exception jumps
        # straight out of this function, so nothing may be half-moved when it
        # is called (the buffer keeps every record it holds, `hold` is empty).
        if not self.upstream_done:
            r = self.reader.c_next(&rec)
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]    # the slot's reference moves to `hold`
            if r == 1:
                self.slot_ref[j] = self._acquire(rec.block)
                self.slots[j] = rec
                self._draw_ahead()
                return 1
            self.upstream_done = True
        else:
            self.next_j = -1
            out[0] = self.slots[j]
            self.hold = self.slot_ref[j]
        self.count -= 1
        self.slots[j] = self.slots[self.count]
        self.slot_ref[j] = self.slot_ref[self.count]
        self._draw_ahead()
        return 1

    cdef inline void _draw_ahead(self) noexcept nogil:
        # Same draws in the same order as drawing on demand; doing it now lets
        # the next record's first cache lines load while the caller copies.
        if self.count > 0:
            self.next_j = <int64_t>rl_rng_below(&self.rng, <uint64_t>self.count)
            __builtin_prefetch(self.slots[self.next_j].data)
            __builtin_prefetch(self.slots[self.next_j].data + 63)

    cdef int c_reset(self) except -1:
        self.epoch += 1
        self._restart()
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        self._drop()
        self.reader.close()
        return 0

    @property
    def buffer_size(self):
        return self.cap

    def _epoch_state(self):
        return {"seed": int(self.seed), "epoch": int(self.epoch)}

    def _describe(self):
        # a drawn seed is not part of what the chain is: a restore adopts the saved one
        d = {"buffer_size": int(self.cap)}
        if not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def _set_epoch_state(self, state):
        self.seed = <uint64_t>int(state["seed"])
        self.epoch = int(state["epoch"])
        self._restart()

    def _reduce_args(self):
        return (int(self.cap),), {"seed": None if self.seed_drawn else int(self.seed)}

    def __repr__(self):
        return f"ShuffleReader({self.reader!r}, buffer_size={self.cap}, seed={self.seed})"


# ------------------------------------------------------------------- batch
# Parallel batch copies (readerlib._parallel bodies): each item is one instance
# copied to its own place in the batch, so any split gives the same bytes.
cdef struct _copy_fixed_job:
    char *dst
    rl_record *recs
    int64_t rb


cdef void _copy_fixed_records(void *ctx, int64_t begin, int64_t end, int tid) noexcept nogil:
    cdef _copy_fixed_job *j = <_copy_fixed_job *>ctx
    cdef int64_t i
    for i in range(begin, end):
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
    cdef rl_block *pend           # fixed schemas: the batch being filled
    cdef int64_t pend_n           # rows of `pend` already copied
    cdef rl_block *hold
    cdef const char **parsed_ptrs
    cdef int64_t *parsed_rows

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
            raise MemoryError()
        if self.layout.n_lod:
            # per-record parse of a sequence batch, kept between sizing and copying
            self.parsed_ptrs = <const char **>calloc(bs * self.layout.nfields, sizeof(char *))
            self.parsed_rows = <int64_t *>calloc(bs * self.layout.nfields, sizeof(int64_t))
            if self.parsed_ptrs == NULL or self.parsed_rows == NULL:
                raise MemoryError()

    cdef void _release(self) noexcept nogil:
        cdef int64_t i
        for i in range(self.nrecs):
            rl_block_decref(self.recs[i].block)
        self.nrecs = 0

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
        if self.recs != NULL:
            self._drop_partial()
            free(self.recs)
            self.recs = NULL
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL

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
            r = self.reader.c_next(&rec)  # may raise: recs[:nrecs] stay held
            if r == 0:
                break
            # parsed as it arrives (the data is hot), so that a malformed
            # record is rejected alone and the batch around it survives
            if layout_parse(&self.layout, rec.data, rec.size, self.parsed_ptrs + n * nf,
                            self.parsed_rows + n * nf) != 0:
                with gil:
                    raise ValueError(
                        f"BatchReader: instance {n} of the batch is malformed "
                        f"({rec.size} bytes) for schema {self.schema}")
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
        while n < B:
            r = self.reader.c_next(&rec)  # may raise: pend / pend_n keep the rows so far
            if r == 0:
                break
            if rec.size != L.fixed_size:
                with gil:
                    raise ValueError(
                        f"BatchReader: instance {n} of the batch has {rec.size} bytes, "
                        f"the schema needs {L.fixed_size}")
            if nf == 1:
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
            r = self.reader.c_next(&rec)  # may raise: pend and recs[:nrecs] stay held
            if r == 0:
                break
            if rec.size != rb:
                with gil:
                    raise ValueError(f"BatchReader: instance {n} of the batch has {rec.size} bytes, "
                                     f"the schema needs {rb}")
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
        parallel_for(threads_for(n * rb), n, _copy_fixed_records, &job)
        rl_copy_fence()
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
        if data_bytes >= (4 << 20) and data_bytes >= n * 32768:
            parallel_for(threads_for(data_bytes), n, _copy_instances, &job)
        else:
            _copy_instances(&job, 0, n, 0)
        rl_copy_fence()
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
        return self.reader.c_reset()

    cdef int c_close(self) except -1:
        # what it holds pins the upstream's blocks (and so a file's mapping)
        if self.hold != NULL:
            rl_block_decref(self.hold)
            self.hold = NULL
        self._drop_partial()
        self.reader.close()
        return 0

    def __repr__(self):
        return f"BatchReader({self.reader!r}, batch_size={self.batch_size}, drop_last={self.drop_last})"

    def _describe(self):
        return {"batch_size": int(self.batch_size), "drop_last": bool(self.drop_last)}

    def _reduce_args(self):
        return (int(self.batch_size),), {"drop_last": bool(self.drop_last)}


# --------------------------------------------------------------- multipass
cdef class MultiPassReader(DecoratedReader):
    """Read the decorated reader `num_passes` times per epoch (Paddle's)."""
    cdef readonly int64_t num_passes
    cdef readonly int64_t pass_id

    def __init__(self, reader, num_passes):
        _check_reader(reader, "MultiPassReader")
        n = _check_positive_int(num_passes, "num_passes")
        DecoratedReader.__init__(self, reader)
        self.num_passes = n
        self.pass_id = 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int r = self.reader.c_next(out)
        while r == 0 and self.pass_id + 1 < self.num_passes:
            with gil:
                self.reader.c_reset()
            self.pass_id += 1             # after the reset: if it raises, the next call retries it
            r = self.reader.c_next(out)
        return r

    cdef int c_reset(self) except -1:
        self.pass_id = 0
        return self.reader.c_reset()

    def __repr__(self):
        return f"MultiPassReader({self.reader!r}, num_passes={self.num_passes})"

    def _describe(self):
        return {"num_passes": int(self.num_passes)}

    def _reduce_args(self):
        return (int(self.num_passes),), {}


# ---------------------------------------------------------- block sources
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
        dict's keys) when omitted.

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
            values = list(arrays.values())
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
