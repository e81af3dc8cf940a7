# Python <-> block conversions shared by the transformations (map, filter,
# padded and bucketed batches): what they `cimport` from here.
#
# InstanceCodec decodes one encoded instance (readers/_base.pxd) into fresh,
# writable NumPy arrays -- what read_next() gives for instances -- and checks
# and normalises a Python instance against a schema, naming the field that
# does not fit.  BatchCodec views a batch block as LoDTensors (no copy) and
# builds a batch block from LoDTensors.
#
# Batch block header, as BatchReader writes it: int64 [n, nfields,
# (rows, data_off, lod_off) * nfields], then 64-byte aligned sections.
# lod_off >= 0: a sequence field (rows stacked, n + 1 offsets at lod_off);
# lod_off == -1: a fixed field [n, *shape];
# lod_off == PADDED_FIELD (-2): a padded sequence field, dense [n, rows, *shape]
# (rows is the padded length T), written by the padded/bucketed batches.
from readerlib._typedefs cimport int64_t
from readerlib.readers._base cimport rl_block, rl_record, rl_layout, RL_MAX_FIELDS, BlockRef, block_ref

cdef enum:
    PADDED_FIELD = -2
    CODEC_MAX_NDIM = 8        # value shapes up to this many dims take the fast checks



cdef class InstanceCodec:
    cdef readonly object schema
    cdef rl_layout L
    cdef list fields
    cdef list dtypes
    cdef int typenum[RL_MAX_FIELDS]
    cdef int fast[RL_MAX_FIELDS]                    # shape fits the fast check
    cdef int vndim[RL_MAX_FIELDS]                   # dims of one value (sequence: with the time axis)
    cdef Py_ssize_t vdims[RL_MAX_FIELDS][CODEC_MAX_NDIM]
    cdef object keyed                               # the schema's Instance class (readerlib/_keyed.pyx)
    # record bytes -> an Instance (readerlib/_keyed.pyx: a tuple keyed by field
    # name) of fresh arrays; ValueError if malformed
    cdef object decode(self, const char *data, int64_t size)
    # copy a fixed-size record into `spare`, a tuple decode() made, when nothing
    # but the caller's one reference holds it or its arrays (then no one can see
    # the reuse); False (nothing written) otherwise
    cdef bint refill(self, tuple spare, const char *data, int64_t size) except -1
    # a tuple / list / dict / Instance / single value -> a tuple (or an Instance
    # of this schema, itself a tuple) of C-contiguous arrays of the schema's
    # dtypes and shapes: the instance itself when it is one already (an
    # Instance of this schema's names is read by position, one of other names
    # by name, like a dict); TypeError/ValueError naming `what` and the field
    cdef object normalize(self, object instance, str what)
    # encoded size of normalised arrays (what normalize returned), and the encoding itself
    cdef int64_t encoded_size(self, object arrays) except -1
    cdef int64_t encode_into(self, object arrays, char *out) except -1


cdef class BatchCodec:
    cdef readonly object schema
    cdef list fields
    cdef readonly tuple padded            # per field: True for a dense padded sequence field
    cdef object keyed                     # the schema's Batch class (readerlib/_keyed.pyx)
    # a batch block -> a Batch (readerlib/_keyed.pyx) of LoDTensors viewing it
    cdef object wrap(self, const rl_record *rec)
    # a tuple / dict of LoDTensor (or arrays for fixed fields) -> a new batch block
    cdef rl_block *encode(self, object batch, str what) except NULL
    cdef list normalize(self, object batch, str what)
