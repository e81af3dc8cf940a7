# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""int16 -> float32 feature normalisation, a compiled readerlib map.

``Normalize(field, mean, std)`` turns the int16 features of one field (a
sequence of frames, ``[T, D]``, or a fixed ``[D]`` / ``[..., D]`` array) into
float32 ``(x - mean[d]) / std[d]`` per feature ``d`` (computed as
``(x - mean) * (1 / std)`` in float32, exactly as the NumPy reference does);
the other fields pass through unchanged.  Instances with more than
``max_rows`` frames are refused (an error naming the record, the read goes
on), which a corrupted length field in real data would otherwise turn into
a huge batch.

Build: ``python setup.py build_ext --inplace`` in this folder (see
setup.py); use: ``reader.map(Normalize("feats", mean, std))``.
"""
from libc.stdint cimport int16_t, int64_t
from libc.string cimport memcpy

import numpy as np

from readerlib.transform cimport RecordTransform, rl_core_import

rl_core_import()          # this module shares readerlib's C core (see readerlib/transform.pxd)

cdef enum:
    BLOCK = 256           # values converted per step (stack buffers: rows are not aligned)
    ERR_TOO_LONG = 2      # an error code transform returns (see error_message)


cdef class Normalize(RecordTransform):
    """Normalise an int16 field to float32 with per-feature mean and std.

    Parameters
    ----------
    field : str
        The int16 field (its last dimension has ``len(mean)`` features).
    mean, std : sequence of float
        Per feature; every ``std`` > 0.
    max_rows : int, optional
        Refuse instances whose field has more rows (frames) than this.
    """
    cdef readonly str field
    cdef readonly object mean          # float32 [D]
    cdef readonly object inv_std       # float32 [D], 1 / std
    cdef readonly int64_t max_rows
    cdef const float *m                # views of the arrays above (read by transform)
    cdef const float *s
    cdef int dim
    cdef int index                     # the field's position (set by prepare)
    cdef int64_t values_per_row        # int16 values in one row of the field

    def __init__(self, field, mean, std, max_rows=None):
        mean = np.ascontiguousarray(mean, dtype=np.float32).reshape(-1)
        std = np.ascontiguousarray(std, dtype=np.float32).reshape(-1)
        if mean.shape != std.shape or mean.size == 0:
            raise ValueError(f"Normalize: mean and std need the same, non-zero length, got "
                             f"{mean.size} and {std.size}")
        if not np.all(std > 0):
            raise ValueError(f"Normalize: every std must be > 0, got {std.tolist()}")
        super().__init__()
        self.field = str(field)
        self.mean = mean
        self.inv_std = np.float32(1.0) / std
        self.max_rows = -1 if max_rows is None else int(max_rows)
        cdef float[::1] mv = self.mean
        cdef float[::1] sv = self.inv_std
        self.m = &mv[0]
        self.s = &sv[0]
        self.dim = mean.size

    def output_schema_for(self, input_schema):
        """The input schema with `field` turned into float32 (same shape and lod level)."""
        import readerlib as rl
        if self.field not in input_schema.names:
            raise ValueError(f"Normalize: the input has no field {self.field!r} "
                             f"(fields: {list(input_schema.names)})")
        return rl.Schema([rl.Field(f.name, np.float32, f.shape, lod_level=f.lod_level)
                          if f.name == self.field else f for f in input_schema])

    def prepare(self, input_schema, output_schema):
        i = input_schema.index(self.field)
        fin, fout = input_schema.fields[i], output_schema.fields[i]
        if fin.dtype != np.int16:
            raise TypeError(f"Normalize: field {self.field!r} must be int16, got {fin.dtype}")
        shape = tuple(fin.shape)
        if not shape or shape[len(shape) - 1] != self.dim:
            raise ValueError(f"Normalize: field {self.field!r} has shape {shape}; its last "
                             f"dimension must be the {self.dim} features of mean/std")
        if (fout.name, fout.dtype, tuple(fout.shape), fout.lod_level) != \
                (fin.name, np.float32, shape, fin.lod_level) or len(output_schema) != len(input_schema):
            raise ValueError(f"Normalize: the output schema must be the input's with "
                             f"{self.field!r} as float32, got {output_schema}")
        self.index = i
        self.values_per_row = fin.row_bytes // 2

    def error_message(self, int code):
        if code == ERR_TOO_LONG:
            return f"field {self.field!r} has more than max_rows={self.max_rows} rows"
        return RecordTransform.error_message(self, code)

    def __reduce__(self):
        return (type(self), (self.field, self.mean, np.float32(1.0) / self.inv_std,
                             None if self.max_rows < 0 else self.max_rows))

    def __repr__(self):
        return f"Normalize({self.field!r}, dim={self.dim})"

    cdef int transform(self, const char **src, const int64_t *src_rows,
                       char **dst, const int64_t *dst_rows) noexcept nogil:
        cdef int f
        cdef int64_t g, ngroups, j, j0, step
        cdef const char *x
        cdef char *y
        cdef const float *m
        cdef const float *s
        cdef int16_t xin[BLOCK]
        cdef float yout[BLOCK]
        for f in range(self.in_layout.nfields):
            if f != self.index:
                memcpy(dst[f], src[f], src_rows[f] * self.in_layout.row_bytes[f])
        if self.max_rows >= 0 and src_rows[self.index] > self.max_rows:
            return ERR_TOO_LONG
        # Values are row-major with the D features last: groups of D values,
        # each converted through stack buffers (the input and output rows are
        # not aligned) in a loop the compiler vectorises.
        x = src[self.index]
        y = dst[self.index]
        ngroups = src_rows[self.index] * (self.values_per_row // self.dim)
        for g in range(ngroups):
            j0 = 0
            while j0 < self.dim:
                step = self.dim - j0 if self.dim - j0 < BLOCK else BLOCK
                memcpy(xin, x, 2 * step)
                m = self.m + j0
                s = self.s + j0
                for j in range(step):
                    yout[j] = (<float>xin[j] - m[j]) * s[j]
                memcpy(y, yout, 4 * step)
                x += 2 * step
                y += 4 * step
                j0 += step
        return 0


def normalize_numpy(instance, names, field, mean, std):
    """The same map in NumPy (the reference the tests compare with)."""
    i = list(names).index(field)
    inv = np.float32(1.0) / np.asarray(std, dtype=np.float32)
    x = instance[i]
    y = (x.astype(np.float32) - np.asarray(mean, dtype=np.float32)) * inv
    return instance[:i] + (y.astype(np.float32),) + instance[i + 1:]
