# cython: freethreading_compatible=False
"""Python <-> block conversions for the transformations (see _codec.pxd).

Design:
    A map decodes a record to Python, calls the user's function and encodes
    the result back into a block, so that compiled readers after it keep
    moving records without the GIL.  The checks on a function's output are
    the expensive part of that round trip for small records, so the common
    case -- a C-contiguous ndarray of the field's exact dtype and shape -- is
    recognised with a few C comparisons per field (no NumPy call); anything
    else takes the slow path, which casts like `PythonReader` does (same-kind
    casts, integers range-checked) and raises naming the field.
"""
import numpy as np
cimport numpy as cnp
from libc.string cimport memcpy, memset
from cpython.ref cimport Py_INCREF, Py_REFCNT
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM, PyTuple_GET_SIZE

from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport (
    rl_block, rl_record, rl_layout, rl_block_incref, rl_block_decref, rl_block_new,
    rl_load_i64, rl_store_i64, layout_from_schema, layout_parse, RL_MAX_FIELDS, trusted_lod, rl_core_import)
from readerlib.readers._base import _cast_to_field, _record_schema_error
from readerlib._keyed cimport keyed_type, keyed_new, keyed_from_seq
from readerlib.readers._align cimport _align64
from readerlib._keyed import _Keyed
from readerlib.tensor import Field, LoDTensor, Schema

cnp.import_array()
rl_core_import()

_OFFSETS_FIELD = Field("offsets", "int64")


cdef object _view(object owner, const char *ptr, int nd, cnp.npy_intp *dims, int typenum):
    arr = cnp.PyArray_SimpleNewFromData(nd, dims, typenum, <void *>ptr)
    cnp.set_array_base(arr, owner)
    return arr


def _as_field_array_slow(value, field, what):
    """The checks of PythonReader's instances, for one value (readers/_base.pyx)."""
    arr = _cast_to_field(np.asarray(value), field, what)
    if field.lod_level:
        if arr.ndim == len(field.shape):
            raise ValueError(f"{what}: field {field.name!r} is a sequence (lod_level=1) of steps "
                             f"{field.shape}; got shape {arr.shape} (no time axis)")
        if arr.shape[1:] != field.shape:
            raise ValueError(f"{what}: field {field.name!r} steps have shape {field.shape}, "
                             f"got value of shape {arr.shape}")
    elif arr.shape != field.shape:
        if arr.size == 1 and field.shape == ():
            arr = arr.reshape(())
        else:
            hint = ("; if its length varies per instance, declare it a sequence "
                    "(lod_level=1) in output_schema=") if arr.ndim == len(field.shape) and arr.ndim else ""
            raise ValueError(f"{what}: field {field.name!r} has shape {field.shape}, "
                             f"got {arr.shape}{hint}")
    return np.ascontiguousarray(arr)


def _values_by_name(schema, instance, what):
    """A dict's (or a keyed item's of other names) values in schema order.  Not
    inline in normalize: its generator expressions would give normalize a
    closure, one allocation per call on the fast path too."""
    if len(instance) != len(schema) or any(fd.name not in instance for fd in schema.fields):
        missing = [fd.name for fd in schema.fields if fd.name not in instance]
        extra = [key for key in instance.keys() if key not in schema.names]
        raise ValueError(f"{what}: instance keys do not match the schema "
                         f"(missing {missing}, unknown {extra})")
    return [instance[fd.name] for fd in schema.fields]


cdef class InstanceCodec:
    """Decode / check / encode instances of one schema (see _codec.pxd)."""

    def __init__(self, schema, bint bare=False):
        cdef int f, k
        self.schema = Schema.coerce(schema)
        layout_from_schema(&self.L, self.schema)
        self.L.bare = bare
        self.fields = list(self.schema.fields)
        self.dtypes = [fd.dtype for fd in self.fields]
        self.keyed = keyed_type(self.schema, False)
        for f, fd in enumerate(self.fields):
            self.typenum[f] = fd.dtype.num
            nd = len(fd.shape) + (1 if fd.lod_level else 0)
            self.vndim[f] = nd
            self.fast[f] = nd <= CODEC_MAX_NDIM
            if self.fast[f]:
                k = 0
                if fd.lod_level:
                    self.vdims[f][0] = -1
                    k = 1
                for d in fd.shape:
                    self.vdims[f][k] = d
                    k += 1

    cdef object decode(self, const char *data, int64_t size):
        cdef const char *ptrs[RL_MAX_FIELDS]
        cdef int64_t rows[RL_MAX_FIELDS]
        cdef cnp.npy_intp dims[CODEC_MAX_NDIM]
        cdef int f, k, nd
        cdef int64_t nbytes
        if layout_parse(&self.L, data, size, ptrs, rows) != 0:
            raise _record_schema_error("InstanceCodec", self.schema, data[:size], self.L.bare)
        out = keyed_new(self.keyed, self.L.nfields)       # an Instance
        for f in range(self.L.nfields):
            nd = self.vndim[f]
            nbytes = rows[f] * self.L.row_bytes[f]
            if self.fast[f]:
                for k in range(nd):
                    dims[k] = self.vdims[f][k]
                if self.L.lod[f]:
                    dims[0] = rows[f]
                a = cnp.PyArray_EMPTY(nd, dims, self.typenum[f], 0)
            else:
                fd = self.fields[f]
                a = np.empty(((rows[f],) if fd.lod_level else ()) + fd.shape, dtype=fd.dtype)
            if nbytes:
                memcpy(cnp.PyArray_DATA(<cnp.ndarray>a), ptrs[f], nbytes)
            Py_INCREF(a)
            PyTuple_SET_ITEM(out, f, a)
        return out

    cdef bint refill(self, tuple spare, const char *data, int64_t size) except -1:
        cdef int f, k
        cdef cnp.ndarray a
        cdef cnp.npy_intp *shp
        if self.L.n_lod != 0 or self.L.bare or size != self.L.fixed_size or \
                Py_REFCNT(spare) != 1 or PyTuple_GET_SIZE(spare) != self.L.nfields:
            return False
        for f in range(self.L.nfields):
            v = spare[f]                                 # the tuple's reference + this one
            if not self.fast[f] or not cnp.PyArray_CheckExact(v) or Py_REFCNT(v) != 2:
                return False
            a = <cnp.ndarray>v
            if cnp.PyArray_TYPE(a) != self.typenum[f] or cnp.PyArray_NDIM(a) != self.vndim[f] or \
                    not cnp.PyArray_CHKFLAGS(a, cnp.NPY_ARRAY_OWNDATA | cnp.NPY_ARRAY_WRITEABLE |
                                             cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_ALIGNED) or \
                    not cnp.PyArray_ISNOTSWAPPED(a) or cnp.PyArray_NBYTES(a) != self.L.row_bytes[f]:
                return False
            shp = cnp.PyArray_DIMS(a)
            for k in range(self.vndim[f]):
                if shp[k] != self.vdims[f][k]:
                    return False
        for f in range(self.L.nfields):
            a = <cnp.ndarray>spare[f]
            if self.L.row_bytes[f]:
                memcpy(cnp.PyArray_DATA(a), data + self.L.fixed_offset[f], self.L.row_bytes[f])
        return True

    cdef object normalize(self, object instance, str what):
        cdef int n = self.L.nfields
        cdef int f, k, nd
        cdef cnp.ndarray a
        cdef cnp.npy_intp *shp
        cdef bint ok
        if type(instance) is tuple or type(instance) is self.keyed:
            if len(<tuple>instance) != n:
                raise ValueError(f"{what}: instance has {len(instance)} values, the schema has {n} "
                                 f"fields {list(self.schema.names)}")
            values = instance          # by position (an Instance of these very names too)
        elif isinstance(instance, (dict, _Keyed)):
            values = _values_by_name(self.schema, instance, what)
        elif isinstance(instance, tuple) or (isinstance(instance, list) and n > 1):
            if len(instance) != n:
                raise ValueError(f"{what}: instance has {len(instance)} values, the schema has {n} "
                                 f"fields {list(self.schema.names)}")
            values = list(instance)
        elif n == 1:
            values = (instance,)
        else:
            raise TypeError(f"{what}: an instance is a tuple or dict of {n} values, "
                            f"got {type(instance).__name__}")
        out = None
        cdef bint is_tuple = isinstance(values, tuple)
        for f in range(n):
            v = (<tuple>values)[f] if is_tuple else values[f]   # not an Instance's __getitem__
            ok = False
            if self.fast[f] and cnp.PyArray_CheckExact(v):
                a = <cnp.ndarray>v
                nd = self.vndim[f]
                if cnp.PyArray_TYPE(a) == self.typenum[f] and cnp.PyArray_ISNOTSWAPPED(a) and \
                        cnp.PyArray_IS_C_CONTIGUOUS(a) and cnp.PyArray_NDIM(a) == nd:
                    shp = cnp.PyArray_DIMS(a)
                    ok = True
                    for k in range(1 if self.L.lod[f] else 0, nd):
                        if shp[k] != self.vdims[f][k]:
                            ok = False
                            break
            if not ok:
                if out is None:
                    out = list(values)
                out[f] = _as_field_array_slow(v, self.fields[f], what)
        if out is None:                 # every value fits as it is
            return values if is_tuple else tuple(values)     # a tuple or an Instance, as it came
        return tuple(out)

    cdef int64_t encoded_size(self, object arrays) except -1:
        cdef int f
        cdef int64_t s = 0
        for f in range(self.L.nfields):
            if self.L.lod[f]:
                s += 8
            s += cnp.PyArray_NBYTES(<cnp.ndarray>(<tuple>arrays)[f])
        return s

    cdef int64_t encode_into(self, object arrays, char *out) except -1:
        cdef int f
        cdef int64_t pos = 0, nb
        cdef cnp.ndarray a
        for f in range(self.L.nfields):
            a = <cnp.ndarray>(<tuple>arrays)[f]
            nb = cnp.PyArray_NBYTES(a)
            if self.L.lod[f]:
                rl_store_i64(out + pos, cnp.PyArray_DIMS(a)[0])
                pos += 8
            if nb:
                memcpy(out + pos, cnp.PyArray_DATA(a), nb)
            pos += nb
        return pos


cdef class BatchCodec:
    """View / build batch blocks of one schema (see _codec.pxd).

    Parameters
    ----------
    schema : Schema
    padded : sequence of bool, optional
        Per field: a dense padded sequence field ([B, T, *shape], no offsets).
    """

    def __init__(self, schema, padded=None):
        self.schema = Schema.coerce(schema)
        self.fields = list(self.schema.fields)
        if padded is None:
            padded = [False] * len(self.fields)
        self.padded = tuple(bool(p) for p in padded)
        if len(self.padded) != len(self.fields):
            raise ValueError("one padded flag per field")
        for fd, p in zip(self.fields, self.padded):
            if p and not fd.lod_level:
                raise ValueError(f"field {fd.name!r}: only a sequence field can be padded")
        self.keyed = keyed_type(self.schema, True)

    cdef object wrap(self, const rl_record *rec):
        cdef BlockRef owner = block_ref(rec.block)
        cdef const char *base = rec.data
        cdef int64_t n = rl_load_i64(base)
        cdef int nf = <int>rl_load_i64(base + 8)
        cdef int f, k, nd
        cdef int64_t rows, doff, loff
        cdef cnp.npy_intp dims[34]
        out = [None] * nf
        for f in range(nf):
            rows = rl_load_i64(base + 16 + 24 * f)
            doff = rl_load_i64(base + 24 + 24 * f)
            loff = rl_load_i64(base + 32 + 24 * f)
            fd = self.fields[f]
            shape = fd.shape
            if len(shape) > 32:
                raise ValueError("too many dimensions")
            if loff == PADDED_FIELD:
                dims[0] = n
                dims[1] = rows
                nd = 2
            else:
                dims[0] = rows if loff >= 0 else n
                nd = 1
            for k in range(len(shape)):
                dims[nd + k] = shape[k]
            data = _view(owner, base + doff, nd + len(shape), dims, fd.dtype.num)
            if loff >= 0:
                dims[0] = n + 1
                lod = [_view(owner, base + loff, 1, dims, cnp.NPY_INT64)]
            else:
                lod = []
            out[f] = trusted_lod(data, lod)
        return keyed_from_seq(self.keyed, out)     # a Batch

    cdef list normalize(self, object batch, str what):
        """[(data, offsets or None, n)] per field, checked against the schema."""
        nf = len(self.fields)
        if isinstance(batch, dict) or (isinstance(batch, _Keyed) and
                                       type(batch) is not self.keyed):
            # by name (a Batch of other names too; one of these names is a tuple)
            if len(batch) != nf or any(fd.name not in batch for fd in self.fields):
                missing = [fd.name for fd in self.fields if fd.name not in batch]
                extra = [key for key in batch.keys() if key not in self.schema.names]
                raise ValueError(f"{what}: batch keys do not match the schema "
                                 f"(missing {missing}, unknown {extra})")
            values = [batch[fd.name] for fd in self.fields]
        elif isinstance(batch, (tuple, list)):
            if len(batch) != nf:
                raise ValueError(f"{what}: batch has {len(batch)} values, the schema has {nf} "
                                 f"fields {list(self.schema.names)}")
            values = batch
        elif nf == 1:
            values = [batch]
        else:
            raise TypeError(f"{what}: a batch is a tuple or dict of {nf} LoDTensors, "
                            f"got {type(batch).__name__}")
        out = []
        n_seen = None
        for fd, padded, v in zip(self.fields, self.padded, values):
            if isinstance(v, LoDTensor):
                if v.device != "cpu":
                    raise TypeError(f"{what}: field {fd.name!r} is on the GPU; return CPU arrays")
                data, lod = v.data, v.lod
            else:
                data, lod = v, []
            data = _cast_to_field(np.asarray(data), fd, what)
            if fd.lod_level and not padded:
                if len(lod) != 1:
                    raise ValueError(f"{what}: field {fd.name!r} is a sequence field: a LoDTensor "
                                     f"with one lod level, got {len(lod)} levels")
                if data.ndim != 1 + len(fd.shape) or data.shape[1:] != fd.shape:
                    raise ValueError(f"{what}: field {fd.name!r} rows have shape {fd.shape}, "
                                     f"got data of shape {data.shape}")
                off = np.ascontiguousarray(lod[0], dtype=np.int64)
                if off.ndim != 1 or off.shape[0] < 1 or off[0] != 0 or \
                        off[off.shape[0] - 1] != data.shape[0] or \
                        (off.shape[0] > 1 and np.any(np.diff(off) < 0)):
                    raise ValueError(f"{what}: field {fd.name!r} has malformed offsets "
                                     f"(need 0 .. {data.shape[0]}, non-decreasing)")
                n = off.shape[0] - 1
            else:
                if lod:
                    raise ValueError(f"{what}: field {fd.name!r} is "
                                     f"{'padded' if padded else 'fixed'}; got a LoDTensor with offsets")
                inner = ((None,) if padded else ()) + fd.shape
                if data.ndim != 1 + len(inner) or (padded and data.shape[2:] != fd.shape) or \
                        (not padded and data.shape[1:] != fd.shape):
                    want = "[B, T, " + ", ".join(map(str, fd.shape)) + "]" if padded else \
                        "[B" + "".join(f", {d}" for d in fd.shape) + "]"
                    raise ValueError(f"{what}: field {fd.name!r} needs shape {want}, "
                                     f"got {data.shape}")
                off = None
                n = data.shape[0]
            if n_seen is None:
                n_seen = n
            elif n != n_seen:
                raise ValueError(f"{what}: field {fd.name!r} holds {n} instances, the fields before "
                                 f"it {n_seen}")
            out.append((np.ascontiguousarray(data), off))
        if not n_seen:
            raise ValueError(f"{what}: a batch needs at least one instance")
        return out

    cdef rl_block *encode(self, object batch, str what) except NULL:
        parts = self.normalize(batch, what)
        cdef int nf = len(parts)
        cdef int f
        cdef int64_t n, pos, rows
        cdef cnp.ndarray d, o
        cdef list doffs = [], loffs = []
        n = parts[0][1].shape[0] - 1 if parts[0][1] is not None else parts[0][0].shape[0]
        pos = _align64(16 + 24 * nf)
        for f in range(nf):
            d = parts[f][0]
            doffs.append(pos)
            pos = _align64(pos + cnp.PyArray_NBYTES(d))
            if parts[f][1] is not None:
                loffs.append(pos)
                pos = _align64(pos + (n + 1) * 8)
            else:
                loffs.append(PADDED_FIELD if self.padded[f] else -1)
        cdef rl_block *b = rl_block_new(pos)
        if b == NULL:
            raise MemoryError(f"batch of {pos} bytes")
        cdef char *base = b.data
        rl_store_i64(base, n)
        rl_store_i64(base + 8, nf)
        for f in range(nf):
            d = parts[f][0]
            if self.padded[f]:
                rows = d.shape[1]
            else:
                rows = d.shape[0]
            rl_store_i64(base + 16 + 24 * f, rows)
            rl_store_i64(base + 24 + 24 * f, doffs[f])
            rl_store_i64(base + 32 + 24 * f, loffs[f])
            if cnp.PyArray_NBYTES(d):
                memcpy(base + <int64_t>doffs[f], cnp.PyArray_DATA(d), cnp.PyArray_NBYTES(d))
            if parts[f][1] is not None:
                o = parts[f][1]
                memcpy(base + <int64_t>loffs[f], cnp.PyArray_DATA(o), (n + 1) * 8)
        return b
