# cython: freethreading_compatible=False
"""The reader protocol: what every reader is and how items move (Paddle Fluid's readers, in Cython).

Design:
    ReaderBase        c_next / c_reset / c_close, Python read_next / reset / close,
                      state (get_state / set_state), pickling, the fluent methods
    FileReader        base of the sources: readers/_sources.pyx (ArrayReader,
                      RandomDataGenerator, PythonReader), formats/_recordio.pyx,
                      formats/_tfrecord.pyx, readers/_multifile.pyx
    DecoratedReader   wraps `reader`: one transformation per module beside this
                      one (_shuffle, _batch, _passes, _prefetch, _map, _slice, _padded)
    ReaderHolder      type erasure: holds any chain, same interface

    Items move as `rl_record`s through `c_next` with the GIL released.  Shuffle
    keeps *references* to records (no copy); BatchReader copies each record
    once, into one freshly allocated batch block that the returned NumPy
    arrays view without a further copy.  Python objects appear only for what
    leaves the chain (`read_next`).  The fluent methods (`.shuffle()`,
    `.batch()`, ...) import their class when called (tf.data's dataset_ops
    way), so this module depends on none of them.

    Also here, shared by the readers: the schema -> rl_layout compilation, the
    instance encoding, the views that wrap blocks as NumPy arrays.
"""
import os
import threading
import warnings
from _thread import RLock as _RLock
from _thread import get_ident as _get_ident

import numpy as np

from readerlib._signature import ClassSignature as _ClassSignature
cimport numpy as cnp
from cpython.ref cimport PyObject
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.object cimport PyTypeObject

cdef extern from "Python.h":
    void PyType_Modified(PyTypeObject *t)
from libc.stdlib cimport malloc, free, calloc, realloc
from libc.string cimport memcpy, memset

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib._keyed cimport keyed_of
from readerlib._keyed import _Keyed
from readerlib.tensor import Field, LoDTensor, Schema
from readerlib.errors import RecordSchemaError

cnp.import_array()
rl_core_import()

__all__ = ["ReaderBase", "FileReader", "DecoratedReader", "ReaderHolder"]

cdef double _CLOSE_LOCK_WAIT_S = 0.25   # close() waits this long for a read in another thread
cdef double _PUMP_LEAVE_S = 5.0         # a read waits this long for a dropped prefetcher's thread to leave

# Bumped in every forked child (os.register_at_fork, below): a chain whose
# _Chain.fork_gen differs has not been looked at since the fork (_fork_check).
cdef int64_t _fork_gen = 0
# The main thread (in a forked child, the thread that forked: _bump_fork_gen):
# never a prefetcher's, so _fork_check skips the dictionary lookup for it.  Not
# the thread that imported readerlib: once that thread ends, a prefetcher's
# thread may get its ident, and its call into its own chain waited for ever.
cdef unsigned long _main_thread = threading.main_thread().ident


def _bump_fork_gen():
    global _fork_gen, _main_thread
    _fork_gen += 1
    _main_thread = PyThread_get_thread_ident()   # (the forking thread: the child's only one)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_bump_fork_gen)


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


# The most rows a record may hold of a zero-width sequence field (shape with
# a 0, e.g. (0,)): its byte size does not bound the count, and summed over a
# batch a count near 2^63 would wrap (negative dimensions).  Also _batch.pyx.
cdef int64_t RL_MAX_EMPTY_ROWS = (<int64_t>1) << 31


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
            if not L.row_bytes[f] and n > RL_MAX_EMPTY_ROWS:
                return -1                   # (a batch's row count would wrap)
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
    if isinstance(instance, dict) or (isinstance(instance, _Keyed) and instance.keys() != schema.names):
        # by name: a dict, or a Batch/Instance of other names (of the same names: a tuple)
        missing = [f.name for f in schema if f.name not in instance]
        extra = [k for k in instance.keys() if k not in schema.names]
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


# Batch block (readers/_batch.pyx): int64 header [n, nfields, (rows, data_off,
# lod_off) * nfields], then 64-byte aligned sections.
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


def _misfit(schema, data, bare=False):
    """(why, field name) an encoded instance `data` (bytes) does not fit `schema`."""
    n = len(data)
    if bare:
        f = schema[0]
        return (f"{n} bytes, not a whole number of field {f.name!r}'s rows "
                f"({f.row_bytes} bytes of {f.dtype}{list(f.shape)})"), f.name
    pos = 0
    for f in schema:
        if f.lod_level == 0:
            need = f.row_bytes
            what = f"field {f.name!r} needs {need} bytes ({f.dtype}{list(f.shape)})"
        else:
            if n - pos < 8:
                return f"{n} bytes: field {f.name!r}'s row count (8 bytes at byte {pos}) is cut off", f.name
            rows = int.from_bytes(data[pos:pos + 8], "little", signed=True)
            if rows < 0:
                return f"field {f.name!r} has a negative row count ({rows}) at byte {pos}", f.name
            pos += 8
            need = rows * f.row_bytes
            what = f"field {f.name!r} needs {rows} rows of {f.row_bytes} bytes"
        if n - pos < need:
            return f"{n} bytes: {what} at byte {pos}, {n - pos} are left", f.name
        pos += need
    return f"{n} bytes: {n - pos} bytes left over after the last field ({schema[-1].name!r})", None


def _record_schema_error(who, schema, data, bare=False, index=None, path=None, offset=None):
    """The RecordSchemaError for an encoded instance `data` that does not fit
    `schema` (every reader raises this one, naming what it knows: `who` -- the
    file or the reader --, the byte offset, the index in the batch, the field)."""
    why, field = _misfit(schema, data, bare)
    what = "record" if index is None else f"instance {index} of the batch"
    if offset is not None:
        what += f" at byte offset {offset}"
    return RecordSchemaError(f"{who}: {what} does not fit schema {schema}: {why}",
                             path, offset, index, field)


cdef object _decode_instance(ReaderBase r, rl_record *rec):
    cdef const char *ptrs[RL_MAX_FIELDS]
    cdef int64_t rows[RL_MAX_FIELDS]
    cdef int f
    if layout_parse(&r.layout, rec.data, rec.size, ptrs, rows) != 0:
        raise _record_schema_error(type(r).__name__, r.schema,
                                   (<const char *>rec.data)[:rec.size], r.layout.bare)
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
# The newest version read here.  A state is STATE_VERSION unless a reader of
# its chain needs a later one (its `_state_version()`): one a readerlib from
# before could not restore right, which refuses any version but 2.
# 3: open_files' "files" order; 4: global_shuffle's lost chunks ("lost").
STATE_VERSION_MAX = 4


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
cdef long _Py_TPFLAGS_HEAPTYPE = 1 << 9
# compiled bases a Python class cannot complete, and the methods that produce items
_ABSTRACT_READERS = frozenset({"ReaderBase", "FileReader", "DecoratedReader", "_ChunkedSource"})
_ITEM_METHODS = ("read_next", "reset", "__iter__", "__next__", "_skip")


# The prefetch threads (thread ident -> its run, readers/_prefetch.pyx _Pump):
# a pass of multi_pass/repeat that such a thread starts is read ahead of the
# prefetcher's consumer, and is noted (_epoch_step) so that the consumer's
# epoch state can be told from the thread's (PrefetchReader._below_states).
_pump_of_thread = {}
cdef dict _pumps_by_thread = _pump_of_thread    # (the same dict, tested in C: _fork_check)


def _restore_epoch_states(ReaderBase top, states):
    """Each reader of `top`'s chain back to its epoch state in `states`
    (top._chain_epoch_state(False), taken before a c_reset of `top` that
    raised part-way), so that the retried c_reset moves each epoch on once.
    A shuffle moves its epoch before it resets the reader below it: when that
    one raised (Ctrl-C in open_files' thread join), the retry moved it again,
    an order no uninterrupted run draws and no saved state restores (a state
    taken in the pass replays the step once).  Readers below a prefetcher
    whose thread is still inside the chain are left alone (the reset did not
    get past that prefetcher; its own c_reset undoes its read-ahead).  Also a
    prefetcher's undoing of its thread's read-ahead (_undo_read_ahead).
    Returns False, changing nothing, when the chain is no longer the one the
    states describe (another chain below now: nothing to undo)."""
    readers = top._walk()
    if len(readers) != len(states) or any(type(r).__name__ != d.get("type")
                                          for r, d in zip(readers, states)):
        return False
    skip = set()
    for r, d in zip(readers, states):
        if id(r) in skip:
            continue
        inside = getattr(r, "_thread_inside", None)
        if inside is not None and inside():
            skip.update(id(b) for b in (<DecoratedReader>r).reader._walk())
            continue
        s = {k: v for k, v in d.items() if k != "type"}
        if r._epoch_state() != s:
            r._set_epoch_state(s)
    return True


def _epoch_step():
    """Called (with the GIL) by a reader just before it moves the epoch of the
    readers below it on in the middle of its own (a multi_pass or repeat starting
    a pass: c_reset below).  On a prefetcher's thread, the prefetcher notes the
    epoch state of its chain before it; anywhere else, nothing."""
    if _pump_of_thread:
        p = _pump_of_thread.get(_get_ident())
        if p is not None:
            p._note_epoch_step()


cdef class _Chain:
    """What the readers of one chain share: a decorator joins its reader's
    chain when it is built (_join_chain), so a reader and everything built on
    it take one lock.  Reading an inner reader of a chain while its outer reader
    is read in another thread is then serialised, as read_next() is on one
    reader (the two took separate locks and ran the same shuffle buffer from
    two threads: SIGSEGV).  `closed` lets a read refuse, in two loads, a chain
    with a closed reader below (whose buffers are gone); `pumps` (with
    `version`, bumped when one is added) lets a read refuse a reader that a
    prefetcher's thread reads."""
    def __cinit__(self):
        self.lock = _RLock()            # (the C type: no Python frame, see ReaderBase.__cinit__)
        self.pumps = []
        self.fork_gen = _fork_gen


cdef class ReaderBase:
    """Base of every reader: `read_next()` returns the next item or None.

    Items are instances (a tuple of NumPy arrays, one per schema field) or,
    after `.batch()`, batches (a tuple of LoDTensor).  `iter(reader)` starts
    a new epoch when anything has been read since the last reset (like a
    tf.data Dataset), and otherwise continues the current one (a fresh
    reader, or one positioned by `set_state`).  `reset()` restarts the chain.

    Python subclasses: a subclass of a concrete reader that adds methods works
    in a chain; one that would have to produce items itself (a direct subclass
    of ReaderBase, FileReader or DecoratedReader, or one that overrides
    read_next / reset / iteration) is refused when the class is created, since
    the compiled readers downstream never call Python methods for items.  Use
    `PythonReader` (a source over any Python iterator) or `.map()` instead.
    """
    # inspect.signature(cls) of every subclass, from its own docstring (readerlib/_signature.py)
    __signature__ = _ClassSignature()

    def __cinit__(self, *args, **kwargs):
        # Must not fail: when it does, CPython deallocates the half-made object
        # through the *subclass's* tp_dealloc while its vtable is still this
        # class's, and a subclass __dealloc__ that calls one of its own cdef
        # methods (RecordIOReader._release_cur) jumps through a slot this
        # vtable lacks: SIGSEGV (and one whose own __cinit__ never ran would
        # close fd 0).  So no Python-level call here: threading.RLock() is a
        # Python function, whose frame ran a pending signal's handler -- a
        # KeyboardInterrupt during a pooled restore's open_random_access
        # crashed the process (tests/readers/test_construct_interrupt.py).
        # _thread.RLock is the C type threading.RLock() returns.  It can still
        # raise MemoryError (its allocation): so a subclass __dealloc__ that
        # calls its own cdef methods or closes a descriptor first checks that
        # its own part was made -- `if <void *>self.<an object field> == NULL:
        # return` (NULL, not None: tp_new had not reached the subclass's fields;
        # its C fields are 0).  tests/readers/test_review9_halfmade.py.
        self._closed = False
        self._started = False
        self.item_kind = ITEM_INSTANCE
        self._chain = _Chain()
        self._lock = self._chain.lock

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

    # -- positioning and random access (docs/random_access.md) ----------------
    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        cdef rl_record rec
        cdef int64_t i = 0
        while i < n:
            if self.c_next(&rec) != 1:
                break
            i += 1
        return i

    cdef int64_t c_num_records(self) except -2:
        return self._random_access_size()

    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil:
        if self._random_access is None:
            with gil:
                self._random_access = self._open_random_access()
        return self._random_access.c_read_at(index, out)

    def _random_access_size(self):
        """Records c_read_at addresses, or -1 (no random access).  File readers
        with a chunk table (select_chunks + chunk_table: RecordIO, TFRecord) have it."""
        if isinstance(self, FileReader) and hasattr(self, "select_chunks") and hasattr(self, "chunk_table"):
            return len(self)
        return -1

    def _open_random_access(self):
        """The reader c_read_at delegates to (a chunk cache, readers/_random_access.pyx)."""
        if self._random_access_size() >= 0:
            from readerlib.readers._random_access import open_random_access
            return open_random_access(self)
        raise TypeError(f"{type(self).__name__} has no random access (reader[i], read_many, "
                        f"global_shuffle): it needs an indexed source (RecordIOReader, "
                        f"TFRecordReader, ArrayReader) or a global_shuffle() of one")

    def __getitem__(self, index):
        """Instance `index` of a source with random access (negative indices count
        from the end), independent of the sequential position.

        Raises
        ------
        IndexError
            `index` outside ``[-len, len)``, naming both.
        TypeError
            The reader has no random access (a decorator other than global_shuffle,
            a stream).
        """
        return self.read_many([index])[0]

    def read_many(self, indices):
        """The instances at `indices` (ints), as a list in that order.

        A list, like PyTorch's ``Dataset.__getitems__`` and Grain's random-access
        datasets: batch it yourself, or use ``global_shuffle().batch()`` for a
        compiled batch.  Each instance is a tuple of arrays (copies).
        """
        cdef rl_record rec
        cdef int64_t n, i
        cdef _Chain ch
        cdef bint was_busy
        self._fork_check()
        try:
            with self._lock:
                self._check_open()
                self._check_chain()
                # Allowed inside a read of the chain (a map function looking up
                # another record of its source: random access does not move the
                # sequential position, and reads through its own chunk cache);
                # marked busy meanwhile, so that nothing moves the chain while a
                # record of the cache is being decoded (a signal handler).
                ch = self._chain
                was_busy = ch.busy
                ch.busy = True
                try:
                    n = self.c_num_records()
                    if n < 0:
                        self._open_random_access()          # raises, naming the reader
                        raise TypeError(f"{type(self).__name__} has no random access")
                    out = []
                    for index in indices:
                        try:
                            j = index.__index__()
                        except AttributeError:
                            raise TypeError(f"{type(self).__name__} indices must be integers, got "
                                            f"{type(index).__name__}") from None
                        if j < 0:
                            j += n
                        if j < 0 or j >= n:               # (before the int64: 2**70 is out of range too)
                            raise IndexError(f"{type(self).__name__} index {index} out of range for "
                                             f"{n} records")
                        i = j
                        with nogil:
                            self.c_read_at(i, &rec)
                        out.append(_decode_instance(self, &rec))
                    return out
                finally:
                    ch.busy = was_busy
        finally:
            # (as read_next; one called inside a read of the chain leaves them to that read)
            if self._chain.close_pending and not self._chain.busy:
                self._deferred_closes()

    def _check_open(self):
        if self._closed:
            raise ValueError(f"I/O operation on closed reader ({type(self).__name__})")
        if self.schema is None:
            _not_initialised(self)

    def read_next(self):
        """The next instance or batch, or None at the end of the epoch.

        Safe to call from several threads: calls on one reader are serialised
        (each item still goes to exactly one caller).
        """
        cdef rl_record rec
        cdef int r
        cdef _Chain ch
        if self._closed:                     # without waiting for a read in another thread
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
                    if self._has_held:
                        rec = self._held
                    else:
                        with nogil:
                            r = self.c_next(&rec)
                        if r == 0:
                            return None
                        # Taken from the chain but not yet handed over: making its
                        # Python objects can raise (a KeyboardInterrupt that lands in
                        # Python code they call, a MemoryError).  Then it stays here,
                        # borrowed (no c_next before it is handed out), uncounted, and
                        # the next read_next hands it out: nothing is lost, and a
                        # get_state meanwhile counts it as not read.
                        self._held = rec
                        self._has_held = True
                    # the record is borrowed until the next c_next: wrap it under the lock
                    if self.item_kind == ITEM_BATCH:
                        item = _wrap_batch(self, &rec)
                    else:
                        item = _decode_instance(self, &rec)
                    self._has_held = False
                    self._position += 1
                    return item
                finally:
                    ch.busy = False
        finally:
            if self._chain.close_pending and not self._chain.busy:   # a close() left to this read
                self._deferred_closes()

    def _deferred_closes(self):
        """Run the close() calls left to the entry point of this reader that is
        returning (made from inside it -- a map function, a signal handler -- or
        by another thread while it held the chain): this reader's and those of
        the readers below it, so a reader closed in the middle of a read lets
        go of its files as that read ends, not at the chain's next call.  (A
        reader above this one closed meanwhile is closed by its own next call
        or close().)"""
        self._chain.close_pending = False    # (first: a KeyboardInterrupt below leaves the
        for r in self._walk():               #  rest to the next read's _check_below_open)
            if (<ReaderBase>r)._close_pending:
                r.close()

    def _held_items(self):
        """1 while an item taken from the chain waits to be handed out (its
        hand-over raised), else 0: a reader below that saves a live state must
        be able to go back that far (see ShuffleReader._resume_state)."""
        return 1 if self._has_held else 0

    def reset(self):
        """Restart the whole chain; shuffles draw a new order (next epoch)."""
        cdef _Chain ch
        self._fork_check()
        try:
            with self._lock:
                self._check_open()
                self._check_chain()
                ch = self._enter("reset")
                try:
                    self._reset_chain()
                finally:
                    ch.busy = False
        finally:
            if self._chain.close_pending and not self._chain.busy:   # a close() left to this call
                self._deferred_closes()

    def _reset_chain(self):
        """reset()'s body, under the chain's lock.  A c_reset that raised part-way
        (Ctrl-C in open_files' thread join, a prefetcher's thread that did not
        stop) leaves some readers moved on -- a shuffle moves its epoch before
        it resets the reader below it -- and others not: the chain is refused
        until reset() is called again, and that retry starts from the epoch
        states the failed one started from, so each epoch moves on once (it
        moved twice: a retried reset gave an order that no uninterrupted run,
        and with a prefetcher's read-ahead no run without it, gives)."""
        before = self._reset_from
        if before is None:
            before = self._chain_epoch_state(False)
        else:
            _restore_epoch_states(self, before)
        self._has_held = False                   # the item belonged to the epoch being left
        try:
            self.c_reset()
        except BaseException as e:
            self._reset_from = before
            self._restore_error = f"{type(e).__name__}: {e}"
            raise
        self._reset_from = None
        self._resuming = False
        self._restore_error = None
        self._position = 0
        self._mark_started(False)

    cdef int _begin_read(self) except -1:
        if self.schema is None:
            _not_initialised(self)
        if self._restore_error is not None:
            if self._reset_from is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: the last reset() failed part-way ({self._restore_error}); "
                    "call reset() again")
            raise RuntimeError(
                f"{type(self).__name__}: the last set_state() failed part-way ({self._restore_error}); "
                "call set_state() again with a state that restores, or reset() to start the next epoch")
        if not self._started:
            if self._resuming:
                self._resuming = False
            else:
                self._epoch_snapshot = self._chain_epoch_state()
                self._position = 0
            self._mark_started(True)
        return 0

    # -- the chain this reader belongs to (_Chain) ----------------------------
    cdef int _join_chain(self, ReaderBase up) except -1:
        """This reader reads `up`: from now on it takes up's chain's lock."""
        self._chain = up._chain
        self._lock = up._chain.lock
        self._free_at = -1                   # checked on the first read
        self._closed_ok = -1
        return 0

    cdef int _move_chain(self, _Chain c) except -1:
        """This reader and everything below it join `c` (a holder took it)."""
        cdef _Chain old = self._chain
        cdef ReaderBase rb
        if old is c:
            return 0
        for r in self._walk():
            rb = <ReaderBase>r
            rb._chain = c
            rb._lock = c.lock
            rb._free_at = -1
            rb._closed_ok = -1
            if rb._closed:
                c.closed += 1
        have = {id(e) for e in c.pumps}
        c.pumps.extend(e for e in old.pumps if id(e) not in have)
        c.version += 1                       # what each reader of c reads changed
        return 0

    cdef int _set_closed(self) except -1:
        if not self._closed:
            self._closed = True
            self._chain.closed += 1
        return 0

    cdef int _fork_check(self, bint may_raise=True) except -1:
        cdef unsigned long ident
        if self._chain.fork_gen != _fork_gen:
            self._forked_chain(may_raise)
        if _pumps_by_thread and self._chain.pumps and may_raise:
            # (the lookup in C: a loop on another thread than the main one
            # reads a prefetcher through here on every item)
            ident = PyThread_get_thread_ident()
            if ident != _main_thread:
                pump = _pumps_by_thread.get(ident)
                if pump is not None:
                    self._check_not_pump_thread(pump)
        return 0

    def _check_not_pump_thread(self, p):
        """A prefetcher's thread calling the chain it reads (a map function below
        the prefetcher that reads, resets or saves its own chain): the consumer's
        read holds the chain's lock while it waits for that thread's next item,
        so the call would wait for ever.  Raise instead (`p`: the calling thread's
        pump, found by _fork_check)."""
        if (<ReaderBase>p.upstream)._chain is self._chain:
            raise RuntimeError(
                f"{type(self).__name__}: called from the thread of a PrefetchReader of its own "
                f"chain (a map or filter function, or a PythonReader's iterator, below the "
                f"prefetcher): the read of the prefetcher waits for that thread while it holds "
                f"the chain, so the call would wait for ever; call it from the loop instead")

    def _forked_chain(self, bint may_raise):
        """The first entry into this chain since the process forked, or a torn chain.

        A thread holding the chain's lock at the fork does not exist in the
        child: its hold would never be released, so the first read, reset or
        state call in the child blocked for ever (a DataLoader worker forked
        while another thread -- an async checkpoint's get_state, a second
        loop -- was inside the chain hung).  A lock that cannot be taken at
        once here is such a hold (a thread of this process that holds it
        entered after this check, which runs with the GIL held and no Python
        code between the test and the update): it is re-initialised and the
        chain is marked torn (fork_gen -1), since that thread left its state
        half-updated; every entry point then raises, naming what to do.
        close() frees the lock and then closes the chain (may_raise false)."""
        cdef _Chain c = self._chain
        if c.fork_gen >= 0:
            if c.lock.acquire(False):
                c.fork_gen = _fork_gen
                c.lock.release()
                return
            c.lock._at_fork_reinit()
            c.fork_gen = -1
            # that thread's read, reset or set_state left busy set: it never
            # returns here, so close() must not leave the close to it (the
            # child kept the chain's files open)
            c.busy = False
        if may_raise:
            raise RuntimeError(
                f"{type(self).__name__}: this process was forked while another thread of its "
                f"parent was inside this chain (a read, reset or state call), so the chain's state "
                f"here is what that thread left half-done and it cannot be used; build the chain "
                f"in this process (IterableDataset(make_chain) does, in each DataLoader worker), "
                f"or fork while no other thread uses it")

    cdef _Chain _enter(self, str what):
        cdef _Chain ch = self._chain
        if ch.busy:
            raise RuntimeError(
                f"{type(self).__name__}.{what}() called from inside a read, reset or set_state of "
                f"the same chain (a map or filter function, a PythonReader's iterator or a signal "
                f"handler calling the chain it runs in): the chain is in the middle of that call; "
                f"call it after the call returns (get_state() and close() may be called there)")
        ch.busy = True
        return ch

    cdef int _check_chain(self) except -1:
        if self._chain.closed != self._closed_ok:
            self._check_below_open()
        if self._free_at != self._chain.version:
            self._check_not_pumped()
        return 0

    def _check_below_open(self):
        for r in self._walk():
            if (<ReaderBase>r)._closed:
                if r is self:
                    self._check_open()
                if (<ReaderBase>r)._close_pending:
                    r.close()                # its close() left it to whoever holds the lock: us
                raise ValueError(
                    f"I/O operation on closed reader ({type(r).__name__}, which {type(self).__name__} "
                    f"reads): a chain cannot be read once a reader in it is closed")
        self._closed_ok = self._chain.closed  # (another branch's reader: not ours)

    def _pumps_reading(self):
        """The prefetchers whose thread reads what this reader reads (this
        reader, or one below it) while this reader does not read through them:
        [(prefetcher, its current run's pump)], outermost first.  An open
        prefetcher counts (it starts its thread again on its next read); a
        closed or dropped one while its last thread is still inside the chain
        (prefetcher None when dropped)."""
        mine = self._walk()
        ids = {id(r) for r in mine}
        live, out = [], []
        for entry in self._chain.pumps:
            p, pump = entry[0](), (entry[1]() if entry[1] is not None else None)
            # (inside the chain, not Thread.is_alive(): see _Pump._inside)
            running = pump is not None and pump._inside()
            if running and pump.thread.ident == _get_ident():
                continue                     # its own thread (closing the chain as it leaves)
            if not running and (p is None or (<ReaderBase>p)._closed):
                continue                     # gone for good
            live.append(entry)
            if p is not None and id(p) in ids:
                continue                     # read through it (its ring)
            below = (pump.upstream if pump is not None else (<DecoratedReader>p).reader)._walk()
            if any(id(r) in ids for r in below):
                out.append((len(below), None if p is not None and (<ReaderBase>p)._closed else p, pump))
        self._chain.pumps = live
        out.sort(key=lambda t: -t[0])
        return [(p, pump) for _, p, pump in out]

    def _check_not_pumped(self):
        for p, pump in self._pumps_reading():
            if p is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: a PrefetchReader's thread reads this chain ({p!r}); "
                    f"while it runs it owns the readers below it.  Read, reset and save the state "
                    f"through the PrefetchReader (or a reader built on it), or close the "
                    f"PrefetchReader first")
            # closed or dropped: its thread was told to stop and leaves after its item
            if not pump._wait_left(_PUMP_LEAVE_S):
                raise RuntimeError(
                    f"{type(self).__name__}: the thread of a closed or dropped PrefetchReader is "
                    f"still inside this chain after {_PUMP_LEAVE_S:g} s (a slow source?); "
                    f"try again later")
        self._free_at = self._chain.version

    def _close_pumps_reading(self):
        """close(): the prefetchers reading this reader close first; returns
        False when a thread of one is still inside the chain (it closes the
        chain below its prefetcher when it leaves)."""
        for p, pump in self._pumps_reading():
            if p is not None:
                p.close()                    # stops its thread, or hands it the close
        for p, pump in self._pumps_reading():
            if not pump._wait_left(_CLOSE_LOCK_WAIT_S):
                return False
        return True

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

    def _state_inexact(self):
        """Why this epoch's position cannot be saved exactly (None: it can)."""
        return self._dropped

    def _check_epoch_state(self, state):
        """Raise ValueError naming what in `state` (this reader's entry of a
        saved state) `_set_epoch_state` could not take.  set_state calls it for
        every reader before it touches the chain, so a refused state leaves
        the chain reading where it was."""
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

    def _chain_epoch_state(self, describe=True):
        """Each reader's epoch state (after its type and, with `describe`, its
        _describe()), in _walk() order: the chain's epoch as its reader sees it.
        Below a prefetcher that is what its consumer has read, not what its
        thread read ahead (a pass it started: PrefetchReader._below_states)."""
        readers = self._walk()
        seen = {}
        for r in readers:                    # outermost prefetcher first (its states cover the inner ones')
            f = getattr(r, "_below_states", None)
            if f is None or id(r) in seen:
                continue
            states = f()
            below = (<DecoratedReader>r).reader._walk()
            if states is not None and len(states) == len(below):
                for b, s in zip(below, states):
                    seen[id(b)] = s
        out = []
        for r in readers:
            d = {"type": type(r).__name__}
            if describe:
                d.update(r._describe())
            s = seen.get(id(r))
            if s is None:
                d.update(r._epoch_state())
            else:
                d.update({k: v for k, v in s.items() if k != "type"})
            out.append(d)
        return out

    def get_state(self):
        """The chain's position as a small JSON-serialisable dict.

        `set_state(state)` on an identically built chain (in this or another
        process) makes it yield exactly what this one yields next.  A buffer
        shuffle over a source with random access stores its buffer's source
        positions (~3-4 bytes a slot), so the restore reads the buffer instead
        of replaying the epoch; other shuffle buffers are recomputed from
        (seed, epoch, position) by replaying the epoch up to the position.

        The dict describes the reader it was taken from and nests the
        description of the reader below under ``"parent"``: type, the
        parameters that decide what comes out (batch size, shuffle buffer
        and seed, ...), the identity of its file (name, size and a checksum
        of its first and last 4 KiB), and its epoch.
        """
        self._fork_check()
        with self._lock:                     # not while another thread reads the chain
            if not self._closed:
                self._check_chain()
            return self._get_state()

    def _get_state(self):
        """get_state's body, under the chain's lock (no read of the chain meanwhile)."""
        readers = self._walk()
        for r in readers:
            why = r._state_inexact()
            if why is not None:
                raise RuntimeError(
                    f"get_state: {type(r).__name__} dropped a record this epoch ({why}); "
                    "the position can no longer be saved exactly: save a state taken before "
                    "the error, or after the next epoch starts")
        if self._epoch_snapshot is None or not self._started:
            if not self._resuming:
                self._epoch_snapshot = self._chain_epoch_state()
                self._position = 0
        state = {"version": STATE_VERSION, "position": int(self._position)}
        flat = [dict(d) for d in self._epoch_snapshot]
        live = [k for k, r in enumerate(readers) if hasattr(r, "_resume_state")]
        if live and len(readers) == len(flat):
            # live parts: what a reader needs to take up its position without
            # replaying (a buffer shuffle's buffer), given the readers above it;
            # background readers (prefetch) stop between items while they are read
            paused = []
            try:
                if any(getattr(readers[k], "track", False) for k in live):
                    for r in readers:
                        f = getattr(r, "_pause_for_state", None)
                        if f is not None:
                            paused.append((r, f()))
                for k in live:
                    flat[k].update(readers[k]._resume_state(readers[:k]))
            finally:
                for r, token in reversed(paused):
                    r._resume_after_state(token)
        state.update(_nest(flat))
        state["version"] = max([STATE_VERSION] + [r._state_version() for r in readers
                                                  if hasattr(r, "_state_version")])
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
        self._fork_check()
        try:
            with self._lock:                 # not while another thread reads the chain
                self._check_open()
                self._check_chain()
                ch = self._enter("set_state")
                try:
                    self._set_state(state)
                finally:
                    ch.busy = False
        finally:
            if self._chain.close_pending and not self._chain.busy:   # a close() left to this call
                self._deferred_closes()

    def _set_state(self, state):
        if not isinstance(state, dict) or state.get("version") not in range(STATE_VERSION, STATE_VERSION_MAX + 1):
            raise ValueError(f"set_state takes a dict made by get_state() (version {STATE_VERSION} to {STATE_VERSION_MAX}), "
                             f"got {'version ' + repr(state.get('version')) if isinstance(state, dict) else type(state).__name__}")
        readers = self._walk()
        saved = _flatten(state)
        _check_fits(readers, saved)
        position = state.get("position")
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"state position must be an int >= 0, got {position!r}")
        for k, (r, d) in enumerate(zip(readers, saved)):
            try:
                r._check_epoch_state({key: v for key, v in d.items() if key != "type"})
            except ValueError as e:
                raise ValueError(f"set_state: reader {k} from the top ({type(r).__name__}): {e}") from None
        cdef int64_t i, n_skip = position
        # from here a failure leaves the chain part-way into the saved epoch:
        # reads raise (naming the failure) until a set_state() succeeds or reset()
        self._restore_error = None
        self._reset_from = None                 # (every epoch state comes from `state`)
        self._has_held = False
        try:
            self.c_reset()
            for r, d in zip(readers, saved):
                r._set_epoch_state({key: v for key, v in d.items() if key != "type"})
            with nogil:
                i = self.c_skip(n_skip)       # O(1) where the chain can position without reading
            if i != n_skip:
                raise ValueError(f"state position {position} is past the end of the epoch ({i} items)")
        except BaseException as e:
            self._restore_error = f"{type(e).__name__}: {e}"
            raise
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
        cdef int64_t i = 0, held = 0, want = n
        cdef _Chain ch
        self._fork_check()
        try:
            with self._lock:
                self._check_open()
                self._check_chain()
                ch = self._enter("_skip")
                try:
                    self._begin_read()
                    if want > 0 and self._has_held:  # the next item is the one read_next holds
                        self._has_held = False
                        held = 1
                        want -= 1
                    with nogil:
                        i = self.c_skip(want)
                    self._position += held + i
                finally:
                    ch.busy = False
        finally:
            if self._chain.close_pending and not self._chain.busy:   # a close() left to this call
                self._deferred_closes()
        return int(held + i)

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
        if self.schema is None:          # never initialised: nothing of it is open
            self._set_closed()
            return
        if self._chain.pumps:
            # a prefetcher's thread reads this reader: it goes first (its
            # close() stops the thread, then closes the chain below it)
            if not self._close_pumps_reading():
                self._close_pending = True   # the next read through this reader, or the
                self._set_closed()           # thread as it leaves, closes it
                return
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
        self._fork_check(False)              # (a lock a thread of the parent held: freed)
        if not self._lock.acquire(True, _CLOSE_LOCK_WAIT_S):
            self._close_pending = True
            self._chain.close_pending = True  # the call holding the lock closes it as it returns
            self._set_closed()              # reads from now on raise
            if not self._lock.acquire(False):
                return
        if self._chain.busy:
            # called from inside a read of this chain by the reading thread
            # (a map function, a signal handler): the read is using the
            # buffers, so the read's end closes it (_deferred_closes: this
            # reader is the one read or below it), else the next read of the
            # chain (_check_below_open)
            self._close_pending = True
            self._chain.close_pending = True
            self._set_closed()
            self._lock.release()
            return
        try:
            if self._close_pending or not self._closed:
                self._close_pending = False
                self._set_closed()
                self._has_held = False
                self.c_close()
                if self._random_access is not None:
                    ra, self._random_access = self._random_access, None
                    ra.close()
        finally:
            self._lock.release()

    @property
    def closed(self):
        return self._closed

    @property
    def _shared_chain(self):
        """Test hook: what every reader of this chain shares (its lock, ...)."""
        return self._chain

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
    def shuffle(self, buffer_size, seed=None, mode="buffer"):
        """`ShuffleReader(self, buffer_size, seed)` (mode="buffer", tf.data's), or
        `WindowShuffleReader` (mode="window": each run of `buffer_size` items permuted,
        restored by reading one window); for a true global shuffle see `global_shuffle`."""
        if mode == "window":
            from readerlib.readers._global_shuffle import WindowShuffleReader
            return WindowShuffleReader(self, buffer_size, seed)
        if mode == "global":
            raise ValueError("a global shuffle has no buffer: use reader.global_shuffle(seed)")
        if mode != "buffer":
            raise ValueError(f"shuffle mode must be 'buffer' or 'window', got {mode!r}")
        from readerlib.readers._shuffle import ShuffleReader
        return ShuffleReader(self, buffer_size, seed)

    def global_shuffle(self, seed=None, window_chunks=8):
        """`GlobalShuffleReader(self, seed, window_chunks)`: every record of a source
        with random access, once per epoch, in a permutation of the whole dataset."""
        from readerlib.readers._global_shuffle import GlobalShuffleReader
        return GlobalShuffleReader(self, seed, window_chunks)

    def batch(self, batch_size, drop_last=False):
        """`BatchReader(self, batch_size, drop_last)`."""
        from readerlib.readers._batch import BatchReader
        return BatchReader(self, batch_size, drop_last)

    def multi_pass(self, num_passes):
        """`MultiPassReader(self, num_passes)`."""
        from readerlib.readers._passes import MultiPassReader
        return MultiPassReader(self, num_passes)

    def shard(self, num_shards, index):
        """`ShardReader(self, num_shards, index)`: every `num_shards`-th item from `index`."""
        from readerlib.readers._passes import ShardReader
        return ShardReader(self, num_shards, index)

    def prefetch(self, capacity=2, device=None, timeout=None):
        """`PrefetchReader(self, capacity, device, timeout)`: a background thread keeps
        up to `capacity` items ready (on the GPU with device="cuda")."""
        from readerlib.readers._prefetch import PrefetchReader
        return PrefetchReader(self, capacity, device=device, timeout=timeout)

    # -- transformations (readers/_map.pyx, _slice.pyx, _padded.pyx; docs/transformations.md)
    def map(self, fn, num_threads=None, deterministic=True, output_schema=None):
        """`MapReader(self, fn, ...)`: `fn(instance) -> instance` on every instance,
        on `num_threads` threads (None: 1), in input order; the chain stays compiled.
        A `readerlib.transform.RecordTransform` instance runs as a TransformReader
        instead: without the GIL, on up to `num_threads` of readerlib's threads
        (None: readerlib.get_num_threads())."""
        from readerlib.transform import RecordTransform, TransformReader
        if isinstance(fn, RecordTransform):
            return TransformReader(self, fn, num_threads=num_threads, deterministic=deterministic,
                                   output_schema=output_schema)
        from readerlib.readers._map import MapReader
        return MapReader(self, fn, num_threads=1 if num_threads is None else num_threads,
                         deterministic=deterministic, output_schema=output_schema)

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
        if self.schema is None:
            _not_initialised(self)
        n = length_of(self)
        if n is None:
            raise TypeError(f"the length of {type(self).__name__} is not known without reading it")
        return n

    def __bool__(self):
        return True         # a reader is a reader, whatever len() says


def _not_initialised(reader):
    # every reader's __init__ sets its schema: None means it never ran (cls.__new__(cls),
    # or a subclass __init__ that did not call super().__init__), and the compiled
    # methods would read fields nothing set (a SIGSEGV, tests/readers/test_review9_halfmade.py)
    raise TypeError(f"{type(reader).__name__} was never initialised: its __init__ did not run "
                    f"(a subclass's __init__ must call super().__init__(...))")


def _checked_init(init):
    # a Python subclass's __init__, then the check that the reader was initialised
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if (<ReaderBase>self).schema is None:
            raise TypeError(f"{type(self).__name__}.__init__ must call super().__init__(...): "
                            f"the compiled reader below it was never initialised")
    __init__.__wrapped__ = init
    for a in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(__init__, a, getattr(init, a, None))
    return __init__


def _reader_init_subclass(cls, **kwargs):
    """ReaderBase.__init_subclass__: refuse a Python class that could not work in a chain."""
    # Called for classes defined in Python only (compiled subclasses are static
    # types, which type.__new__ never makes).
    super(ReaderBase, cls).__init_subclass__(**kwargs)
    compiled = next(b for b in cls.__mro__ if not (b.__flags__ & _Py_TPFLAGS_HEAPTYPE))
    if compiled.__name__ in _ABSTRACT_READERS:
        why = f"it subclasses {compiled.__name__}, whose items come from compiled c_next"
    else:
        python_classes = cls.__mro__[:cls.__mro__.index(compiled)]
        overridden = sorted({name for k in python_classes for name in _ITEM_METHODS if name in vars(k)})
        if not overridden:
            if "__init__" in vars(cls):
                type.__setattr__(cls, "__init__", _checked_init(vars(cls)["__init__"]))
            return
        why = (f"it overrides {', '.join(overridden)}, which the compiled readers of a chain "
               f"never call (they take items from {compiled.__name__}'s c_next)")
    raise TypeError(f"{cls.__name__} cannot be a readerlib reader: {why}.  Wrap Python code "
                    f"that yields instances in readerlib.PythonReader(make_iterator, schema), "
                    f"or transform items with .map(fn) / .filter(fn)")


# Cython refuses __init_subclass__ in a cdef class body: set it in the type's
# dict (as type.__new__ would) and tell the type cache.
(<object>(<PyTypeObject *>ReaderBase).tp_dict)["__init_subclass__"] = classmethod(_reader_init_subclass)
PyType_Modified(<PyTypeObject *>ReaderBase)


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


cdef class DecoratedReader(ReaderBase):
    """A reader that transforms the items of another (`self.reader`)."""

    def __init__(self, ReaderBase reader not None):
        reader._check_open()
        if reader._started:          # a fresh chain starts at the top of an epoch
            reader.reset()
        self.reader = reader
        self._join_chain(reader)
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


def _check_saved_seed_epoch(state):
    """A shuffle's `_check_epoch_state`: its saved "seed" (uint64) and "epoch"
    (int64 >= 0) are ints its C fields hold (a hand-edited or truncated
    state: a string, a float, a negative or huge number)."""
    for key, top in (("seed", 64), ("epoch", 63)):
        if key not in state:
            raise ValueError(f"the state has no {key!r}")
        v = state[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < (1 << top):
            raise ValueError(f"{key!r} must be an int in [0, 2**{top}), got {v!r:.80}")


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
        (<ReaderBase>reader)._fork_check()   # (its chain joins this one: not one left torn)
        self._fork_check()
        with self._lock:                     # not while a read of this chain is inside the held reader
            if self._chain.busy:
                self._enter("reset_reader")  # (raises: the read inside is this thread's own)
            if (<ReaderBase>reader)._chain.busy:
                # a read, reset or set_state of the new reader's own chain is
                # using it (this thread's, a map function calling this; or
                # another thread's): taken here, its records would be read
                # twice or lost
                raise RuntimeError(
                    f"ReaderHolder.reset_reader({type(reader).__name__}): the reader is inside a read, "
                    f"reset or set_state of its own chain (this call came from a map or filter "
                    f"function, a PythonReader's iterator or a signal handler of that call, or the "
                    f"call runs in another thread); call it after that call returns")
            if self._free_at != self._chain.version:
                self._check_not_pumped()     # nor while a prefetcher's thread is
            self._reset_reader(reader)

    def _reset_reader(self, reader):
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
        (<ReaderBase>reader)._move_chain(self._chain)
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


