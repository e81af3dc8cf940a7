"""RecordIO: chunked, checksummed, self-describing, seekable record files.

Design:
    See RECORDIO.md next to this file for the byte layout.  A chunk is read
    with pread(2) into a block the reader owns (page-aligned like the file,
    see rl_mmap.h), verified there (header CRC, body CRC-32C, sizes, every
    record against the schema) when it is first touched, then its records
    are handed downstream as pointers into that block (no further copy)
    while the block is referenced.  zlib chunks are read into a scratch
    buffer and inflated into a block.  The bytes checked are the bytes
    handed out: a file truncated or rewritten while it is read gives a
    RecordIOError (or, for chunks already checked, the data as it was),
    never SIGBUS (as a mapping would) nor unchecked bytes.  Any single
    corrupted or truncated byte fails a check; the error names the file and
    byte offset.  Version-2 big records read for a BatchReader are deferred
    (include/rl_mapped.h): checked tables, the bytes read and CRC-checked by
    the batch into the batch, one copy (RECORDIO.md, "Version 2").
"""
import os
import warnings
import zlib as _pyzlib

import numpy as np
cimport numpy as cnp
from libc.stdlib cimport malloc, free, realloc, calloc
from libc.string cimport memcpy, memcmp
from libc.errno cimport errno

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t, uint8_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, layout_from_schema, rl_block, rl_record, rl_layout, rl_columns,
    rl_block_incref, rl_block_decref, rl_block_new, rl_crc32c, rl_core_import,
    rl_load_u32, rl_load_u64, rl_store_u32, rl_store_u64,
    layout_parse, crc32c_parallel, columns_encoded_size, columns_encode, encode_instance,
    ITEM_INSTANCE, RL_MAX_FIELDS)
from readerlib.readers._base import _check_positive_int, _file_identity
from readerlib.readers._sources cimport ArrayReader
from readerlib.formats._writer cimport FileWriter
from readerlib.formats._writer import _PieceFile
from readerlib.tensor import Schema
from readerlib.errors import RecordIOError, RecordIOSchemaError, RecordIOWarning

cnp.import_array()
rl_core_import()

cdef extern from "zlib.h":
    ctypedef unsigned long uLongf
    ctypedef unsigned long uLong
    int Z_OK
    int uncompress(unsigned char *dest, uLongf *destLen, const unsigned char *source, uLong sourceLen) nogil

cdef extern from "rl_mmap.h":
    rl_block *rl_fileblock_new(int64_t file_off, int64_t size, int drop_pages) nogil
    int64_t rl_pread_full(int fd, char *dst, int64_t n, int64_t off) nogil
    int64_t rl_pread2(int fd, char *a, int64_t na, char *b, int64_t nb, int64_t off) nogil
    int64_t rl_fileblocks_live() nogil
    ctypedef struct rl_iov:
        void *iov_base
        size_t iov_len
    int64_t rl_preadv_full(int fd, rl_iov *iov, int cnt, int64_t off) nogil
    int rl_all_zero(const char *p, int64_t n) nogil

cdef extern from "rl_crccopy.h":
    void rl_cc_init()
    uint32_t rl_crc32c_copy(uint32_t crc, char *dst, const char *src, size_t n) nogil
    uint32_t rl_crc32c_copy_nt(uint32_t crc, char *dst, const char *src, size_t n) nogil
    void rl_cc_fence() nogil
    int rl_cc_uses_hardware() nogil

rl_cc_init()

# ---- big records in one copy (include/rl_mapped.h, RECORDIO.md "Reading and the checks")
from posix.mman cimport mmap, munmap, madvise, PROT_READ, MAP_SHARED, MAP_FAILED, MADV_DONTNEED

from readerlib._mapped cimport (
    rl_map, rl_dblock, rl_dchunk, rl_mapped_api, rl_mapped, rl_mapped_import,
    rl_record_is_deferred, rl_dchunk_new, rl_dchunk_done, rl_deferred_new, deferred_verified_copy, rl_map_all_zero,
    rl_map_incref, rl_map_new, rl_map_defers, RL_MAP_PREAD_BASE, RL_MAP_RECORDIO, RL_DEF_OK, RL_DEF_MISMATCH, RL_DEF_SHRUNK, RL_DEF_NOMEM, RL_DEF_LAYOUT,
    RL_DEF_PADDING, RL_DEF_IO, RL_MAP_TFRECORD)

rl_mapped_import()

# Version-2 big records read for a BatchReader (negotiated through shuffle,
# multi_pass and holder only): the file is mapped and records go out deferred,
# verified by the batch's fused CRC + copy (one copy per byte instead of two).
# READERLIB_MAPPED_READS=0 or _set_mapped_reads(False): the pread path (A/B).
cdef bint _mapped = os.environ.get("READERLIB_MAPPED_READS", "1") != "0"
# a mapping's pages are dropped (one madvise over the range copied) once this
# much has been copied out of it since the last drop: the bound on the file
# pages a mapped chain keeps resident
cdef int64_t _map_budget = 32 << 20
# How the batch takes a deferred record's bytes.  "pread" reads them with
# pread(2) into a cache-resident staging buffer and copies them into the batch
# with the fused CRC + copy; "mmap" maps the file and copies from the mapping
# with the fused CRC + copy, SIGBUS-guarded.  "auto" (the default): pread for
# a reader with low_memory=True, the mapping with its pages kept (rl_map.keep)
# for low_memory=False.  Measured on the 64 KiB chain
# (benchmarks/results/big_records.md): a fault maps a whole page-cache folio
# (512 KiB here), so a mapping whose pages are dropped as records are copied
# (what bounds the file pages a low_memory chain keeps resident) refaults each
# folio once per record in it and costs as much as the kernel copy saves; a
# mapping whose pages are kept costs one fault per folio per mapping and no
# drop, and reads each byte once.  READERLIB_DEFERRED_READS=pread|mmap forces
# one mode for every reader (mmap keeps the pages only for low_memory=False);
# "keep" maps with kept pages for every reader (the A/B, and the tests of that
# path).
_DEFERRED_MODES = ("auto", "pread", "mmap", "keep")
_deferred_mode = os.environ.get("READERLIB_DEFERRED_READS") or "auto"
if _deferred_mode not in _DEFERRED_MODES:
    warnings.warn(f"READERLIB_DEFERRED_READS={_deferred_mode!r} is not one of {_DEFERRED_MODES}: "
                  f"using 'auto'", RuntimeWarning, stacklevel=2)
    _deferred_mode = "auto"


# The zero padding before a deferred record (page-aligned chunks): checked by
# the batch's read of the record, in the same pread (True, the default), or
# read and checked here at chunk load, one pread a record (False: the A/B).
cdef bint _pads_at_batch = True


def _set_deferred_pads_at_batch(flag):
    """A/B and test hook: see _pads_at_batch; returns the old setting."""
    global _pads_at_batch
    old = bool(_pads_at_batch)
    _pads_at_batch = bool(flag)
    return old


def _set_deferred_mode(mode):
    """A/B and test hook: "auto", "pread", "mmap" or "keep" (see above) for
    chains negotiated from now on; returns the old mode."""
    global _deferred_mode
    if mode not in _DEFERRED_MODES:
        raise ValueError(f"mode must be one of {_DEFERRED_MODES}, got {mode!r}")
    old = _deferred_mode
    _deferred_mode = mode
    return old


def _set_mapped_reads(flag):
    """Test / benchmark switch: mapped (deferred) reads of v2 big records for
    chains that end in a batch; returns the old setting.  Chains built
    afterwards (or reset: each epoch negotiates) take it."""
    global _mapped
    old = bool(_mapped)
    _mapped = bool(flag)
    return old


def _set_map_budget(nbytes):
    """Test hook: bytes copied out of a mapping between page drops; returns the old value."""
    global _map_budget
    old = int(_map_budget)
    _map_budget = max(1, int(nbytes))
    return old


def _deferred_error(path, chunk, index, code, offset, schema=None):
    """The RecordIOError of a deferred record that failed where it was copied
    (the same messages as the reader's own checks)."""
    if code == RL_DEF_LAYOUT:             # CRC good, the bytes do not fit the schema (sequence records)
        msg = f"{_CHUNK_ERRORS[CK_RECORD]} (record {index} of chunk {chunk})"
        return RecordIOSchemaError(f"{path}: {msg} at byte offset {offset}: schema {schema}",
                                   path, offset, index)
    if code == RL_DEF_NOMEM:
        return MemoryError(f"{path}: out of memory copying record {index} of chunk {chunk}")
    if code >= RL_DEF_IO:                 # the read failed (errno), as CK_IO on the reader's path
        msg = f"{_CHUNK_ERRORS[CK_IO]} (record {index} of chunk {chunk}) ({os.strerror(code - RL_DEF_IO)})"
    else:
        msg = _CHUNK_ERRORS[CK_SHRUNK if code == RL_DEF_SHRUNK else CK_PADDING if code == RL_DEF_PADDING
                            else CK_RECORD_CRC]
        msg += f" (record {index} of chunk {chunk})"
    return RecordIOError(f"{path}: {msg} at byte offset {offset}", path, offset)


cdef object _deferred_error_of(const rl_record *r, int code, int64_t offset, schema=None):
    cdef rl_dblock *d = <rl_dblock *>r.block
    return _deferred_error(d.map.path.decode("utf-8", "surrogateescape"), d.chunk, d.index, code, offset,
                           schema)


def _deferred_error_py(size_t block, int code, int64_t offset, schema=None):
    """_deferred_error for a deferred record's block (its address), for the
    modules that copy deferred records (the batch, the shuffle).  A TFRecord
    file's deferred record raises the TFRecord reader's own error."""
    cdef rl_record r
    r.block = <rl_block *>block
    if (<rl_dblock *>r.block).map.format == RL_MAP_TFRECORD:
        from readerlib.formats._tfrecord import _deferred_error_py as tfrecord_error
        return tfrecord_error(block, code, offset, schema)
    return _deferred_error_of(&r, code, offset, schema)

# Version-2 big records: (False, the default) read a group straight into the
# records' blocks and CRC each there, still in cache; or (True) read it into a
# cache-resident staging buffer and copy each record to its block with the
# fused CRC + copy and streaming stores.  Measured on the 64 KiB chain
# (benchmarks/results/big_records.md): staged 3.80 GB/s median against 4.16
# direct -- the extra user-space copy costs more than the read-for-ownership
# it saves.  Kept as a switch for that A/B and for the tests.
cdef bint _staged = False


def _set_staged_reads(flag):
    """Test / benchmark hook: choose how v2 big records are read; returns the old setting."""
    global _staged
    old = bool(_staged)
    _staged = bool(flag)
    return old


def _live_file_blocks():
    """Test hook: file blocks of RecordIO readers alive in this process (and
    deferred records: descriptors of a file's bytes)."""
    return rl_fileblocks_live() + rl_mapped.live

def _crc32c_copy(dst, src, uint32_t crc=0):
    """Test and benchmark hook: copy `src` into `dst` (writable, same length)
    with the fused CRC + copy loop (rl_crccopy.h); returns the CRC-32C of the
    bytes stored."""
    cdef const unsigned char[::1] s = memoryview(src).cast("B")
    cdef unsigned char[::1] d = memoryview(dst).cast("B")
    cdef size_t n = s.shape[0]
    if d.shape[0] != s.shape[0]:
        raise ValueError(f"dst has {d.shape[0]} bytes, src {s.shape[0]}")
    if n == 0:
        return crc
    with nogil:
        crc = rl_crc32c_copy(crc, <char *>&d[0], <const char *>&s[0], n)
    return crc


def _gather_copy(dst, src, offsets, bint fused, bint nt=False):
    """Benchmark hook (the mmap floor, benchmarks/bench_big_records.py): row i
    of `dst` (a C-contiguous uint8 [B, size] array) <- src[offsets[i]:+size],
    with the fused CRC + copy (returns the rows' CRCs; `nt`: its streaming
    stores, as the batch's copy) or plain memcpy."""
    cdef unsigned char[:, ::1] d = dst
    cdef const unsigned char[::1] s = memoryview(src).cast("B")
    cdef const int64_t[::1] o = np.ascontiguousarray(offsets, dtype=np.int64)
    cdef int64_t B = d.shape[0], size = d.shape[1], i
    if o.shape[0] != B:
        raise ValueError("one offset per row")
    for i in range(B):
        if o[i] < 0 or o[i] + size > s.shape[0]:
            raise IndexError(f"row {i}: offset {o[i]} out of range")
    crcs = np.zeros(B, np.uint32)
    cdef uint32_t[::1] c = crcs
    with nogil:
        for i in range(B):
            if fused and nt:
                c[i] = rl_crc32c_copy_nt(0, <char *>&d[i, 0], <const char *>&s[0] + o[i], size)
            elif fused:
                c[i] = rl_crc32c_copy(0, <char *>&d[i, 0], <const char *>&s[0] + o[i], size)
            else:
                memcpy(&d[i, 0], <const char *>&s[0] + o[i], size)
        rl_cc_fence()
    return crcs


def _crc32c_copy_uses_hardware():
    return bool(rl_cc_uses_hardware())

__all__ = ["RecordIOWriter", "RecordIOReader", "FILE_MAGIC", "FILE_MAGICS"]

# The format version is the magic's last byte.  Version 2 adds a CRC-32C per
# record to uncompressed chunks of big records (RECORDIO.md): a record can be
# verified on its own, right after it is read, while it is still in cache.
FILE_MAGIC = b"RLRECIO2"                 # what the writer writes by default
FILE_MAGICS = {b"RLRECIO1": 1, b"RLRECIO2": 2}
DEF GROUP_BYTES = 524288            # v2 big records: read (one preadv) and verified in L2-sized groups
DEF GROUP_RECORDS = 64
DEF HEADER_FIXED = 24
DEF CHUNK_HEADER = 32
DEF TRAILER = 16
cdef uint32_t CHUNK_MAGIC = 0x4B484352      # b"RCHK" little endian
cdef uint32_t INDEX_MAGIC = 0x58444952      # b"RIDX"
cdef uint32_t TRAILER_MAGIC = 0x31584952    # b"RIX1"
COMPRESSORS = {"none": 0, "zlib": 1}
DEF PAGE = 4096
DEF FLAG_ALIGNED = 0x100            # compressor field: records start on page boundaries
DEF ALIGN_MIN_RECORD = 32768        # page_align="auto": mean record size that turns it on
DEF FLAG_BODY_CRC = 0x200           # version 2, compressor 0: no CRC table, body_crc covers the whole
                                    # body (the version-1 body), for chunks of small records
DEF RECORD_CRC_MIN_RECORD = 32768   # record_crc="auto": mean record size that gets a CRC table
                                    # (measured: below it the whole-body CRC reads faster at every
                                    # size, benchmarks/results/recordio_versions.md)

# error codes of a chunk check (messages in _CHUNK_ERRORS)
cdef enum:
    CK_OK = 0
    CK_TRUNC_HEADER = 1
    CK_MAGIC = 2
    CK_HEADER_CRC = 3
    CK_COMPRESSOR = 4
    CK_TRUNC_BODY = 5
    CK_BODY_CRC = 6
    CK_COUNT = 7
    CK_INFLATE = 8
    CK_SIZES = 9
    CK_RECORD = 10
    CK_NOMEM = 11
    CK_SHRUNK = 12
    CK_IO = 13
    CK_TABLE_CRC = 14
    CK_RECORD_CRC = 15
    CK_PADDING = 16
    CK_FLAGS = 17

_CHUNK_ERRORS = {
    CK_TRUNC_HEADER: "truncated chunk header",
    CK_MAGIC: "bad chunk magic (not a chunk boundary: corrupt or truncated file)",
    CK_HEADER_CRC: "chunk header checksum mismatch",
    CK_COMPRESSOR: "unknown chunk compressor",
    CK_TRUNC_BODY: "truncated chunk body",
    CK_BODY_CRC: "chunk body checksum mismatch",
    CK_COUNT: "chunk record count disagrees with the index footer",
    CK_INFLATE: "chunk body does not inflate to its recorded size",
    CK_SIZES: "record sizes disagree with the chunk size",
    CK_RECORD: "record does not match the schema",
    CK_NOMEM: "out of memory decoding chunk",
    CK_SHRUNK: "the file is shorter than when it was opened (truncated while being read?)",
    CK_IO: "read error",
    CK_TABLE_CRC: "chunk record table checksum mismatch",
    CK_RECORD_CRC: "record checksum mismatch",
    CK_PADDING: "nonzero padding before a page-aligned record",
    CK_FLAGS: "unknown chunk flags (a newer RecordIO format than this readerlib reads?)",
}


cdef extern from *:
    """
    /* Every one of the n little-endian u32 sizes at p is `size`: one pass with
     * no early exit, so the compiler vectorises it (the 52k sizes of a 1 MiB
     * chunk of 16-byte records in a few us; a record-by-record check with
     * its bounds and schema tests took ~30 us; out of line: inlined into
     * _load_chunk, gcc kept the accumulator on the stack and did not vectorise). */
    __attribute__((noinline)) static int rl_rio_sizes_all(const char *p, int64_t n, uint32_t size) {
        uint32_t acc = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v;
            memcpy(&v, p + 4 * i, 4);
            acc |= v ^ size;
        }
        return acc == 0;
    }
    """
    bint _sizes_all "rl_rio_sizes_all" (const char *sizes, int64_t n, uint32_t size) nogil


cdef inline uint32_t _chunk_header_crc(uint32_t salt, const char *h) noexcept nogil:
    # Salted with the file's random id: while resynchronising after damage,
    # chunk-like bytes from another file (e.g. inside a record) never pass.
    return rl_crc32c(salt, h, 28)


# ------------------------------------------------------------------- writer
cdef class RecordIOWriter(FileWriter):
    """Write instances to a RecordIO file.

    Parameters
    ----------
    path : str or os.PathLike
    schema : Schema
        Stored in the file: readers need no shapes from the user.
    chunk_size : int
        Target uncompressed bytes per chunk (a chunk holds at least one
        record).  Chunks are the unit of checksumming, seeking and sharding.
    compressor : {"none", "zlib"}
    compression_level : int
    page_align : {"auto", True, False}
        Start every record of an uncompressed chunk on a page of the file
        (zero padding).  "auto": when a chunk's records average >= 32 KiB, so
        that readers can release a big record's memory as soon as it is
        copied.
    version : {2, 1}
        File format version (RECORDIO.md).  2 (default): uncompressed chunks
        of big records carry a CRC-32C per record, so readers verify each
        record alone, right after reading it (see `record_crc`).  1: the
        previous format, for readers older than version 2 support.
    record_crc : {"auto", True, False}
        Version 2, uncompressed chunks: store a table of each record's
        CRC-32C.  "auto" (default): for chunks whose records average >= 32
        KiB (the ones readers read into a block per record); a chunk of
        smaller records keeps one CRC over its whole body (chunk flag 0x200),
        checked once per chunk at memory speed -- cheaper for them, measured
        in benchmarks/results/recordio_versions.md.  True: a table in every
        uncompressed chunk (the files version-2 readers of before 0x200 can
        read).  False: no table anywhere.  Version 1 has no tables ("auto" or
        False only).

    Examples
    --------
    >>> with RecordIOWriter(path, Schema([Field("x", "float32", (3,))])) as w:
    ...     w.write((np.zeros(3, np.float32),))
    """
    cdef readonly object path
    cdef readonly object schema
    cdef rl_layout layout
    cdef char *payload
    cdef int64_t payload_len, payload_cap
    cdef uint32_t *sizes
    cdef int64_t nsizes, sizes_cap
    cdef readonly int64_t chunk_size
    cdef int compressor
    cdef int level
    cdef list _index
    cdef int64_t _pos
    cdef readonly int64_t num_records
    cdef uint32_t salt
    cdef object page_align
    cdef readonly int version
    cdef uint32_t *crcs                # version 2: each record's CRC-32C (sizes_cap of them)
    cdef object record_crc

    def __init__(self, path, schema, chunk_size=1 << 20, compressor="none", compression_level=6,
                 page_align="auto", version=2, record_crc="auto"):
        if version not in (1, 2) or isinstance(version, bool):
            raise ValueError(f"version must be 1 or 2, got {version!r}")
        self.version = version
        if record_crc not in ("auto", True, False) or not isinstance(record_crc, (bool, str)):
            raise ValueError(f"record_crc must be 'auto', True or False, got {record_crc!r}")
        if record_crc is True and version == 1:
            raise ValueError("record_crc=True needs version=2 (version 1 has no per-record CRCs)")
        self.record_crc = record_crc
        self.schema = Schema.coerce(schema)
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {sorted(COMPRESSORS)}, got {compressor!r}")
        self.chunk_size = _check_positive_int(chunk_size, "chunk_size")
        if not 0 <= compression_level <= 9:
            raise ValueError(f"compression_level must be in 0..9, got {compression_level}")
        layout_from_schema(&self.layout, self.schema)
        self.compressor = COMPRESSORS[compressor]
        self.level = compression_level
        if page_align not in ("auto", True, False):
            raise ValueError(f"page_align must be 'auto', True or False, got {page_align!r}")
        self.page_align = page_align
        self.path = os.fspath(path)
        self._index = []
        # the file is opened last, right before the try that closes it on failure:
        # an exception while the header is made (a KeyboardInterrupt in to_json's
        # Python frames, a MemoryError) left its descriptor open for good
        # (__del__ closes only an open writer; _PieceFile has no finaliser)
        schema_bytes = self.schema.to_json().encode()
        file_id = os.urandom(8)
        magic = b"RLRECIO2" if version == 2 else b"RLRECIO1"
        head = bytearray(magic + len(schema_bytes).to_bytes(4, "little") + bytes(4) + file_id)
        crc = rl_crc32c(rl_crc32c(rl_crc32c(0, <const char *>head, 12), <const char *>file_id, 8),
                        <const char *>schema_bytes, len(schema_bytes))
        head[12:16] = crc.to_bytes(4, "little")
        head += schema_bytes
        self.salt = rl_crc32c(0, <const char *>file_id, 8)
        self._f = _PieceFile(self.path)
        try:
            self._f.write(head)
        except BaseException:
            self._f.close()
            raise
        self._pos = len(head)
        self._closed = False

    def _gc_warning(self):
        return RecordIOWarning

    def __dealloc__(self):
        free(self.payload)
        free(self.sizes)
        free(self.crcs)

    cdef int _reserve(self, int64_t nbytes) except -1:
        cdef int64_t cap
        cdef char *p
        cdef uint32_t *q
        if self.payload_len + nbytes > self.payload_cap:
            cap = max(self.payload_cap * 2, self.payload_len + nbytes, 1 << 16)
            p = <char *>realloc(self.payload, cap)
            if p == NULL:
                raise MemoryError()
            self.payload = p
            self.payload_cap = cap
        if self.nsizes + 1 > self.sizes_cap:
            cap = max(self.sizes_cap * 2, 1024)
            q = <uint32_t *>realloc(self.sizes, cap * sizeof(uint32_t))
            if q == NULL:
                raise MemoryError()
            self.sizes = q
            q = <uint32_t *>realloc(self.crcs, cap * sizeof(uint32_t))
            if q == NULL:
                raise MemoryError()
            self.crcs = q
            self.sizes_cap = cap
        return 0

    cdef int _add(self, const char *data, int64_t size) except -1:
        if size > 0xFFFFFFFF - 64:
            raise ValueError(f"a record of {size} bytes exceeds the 4 GiB record limit")
        if self.nsizes and self.payload_len + size + 4 * (self.nsizes + 1) > self.chunk_size:
            self._write_chunk()
        self._reserve(size)
        memcpy(self.payload + self.payload_len, data, size)
        self.payload_len += size
        self.sizes[self.nsizes] = <uint32_t>size
        self.nsizes += 1
        self.num_records += 1
        return 0

    def write(self, instance):
        """Append one instance: a tuple, list or dict of values (one per field)."""
        cdef rl_block *b
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:                 # (FileWriter: writes from several threads)
            self._check_open()
            b = encode_instance(self.schema, &self.layout, instance)
            try:
                self._add(b.data, b.size)
            finally:
                rl_block_decref(b)

    def write_batch(self, columns):
        """Append many instances given column-wise, as ArrayReader takes them.

        `columns` is a dict name -> array (or LoDTensor / list of sequences
        for sequence fields) or a tuple in schema order; row i of each is
        instance i.  Much faster than `write` per instance.
        """
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:                 # (FileWriter: writes from several threads)
            self._write_batch(columns)

    def _write_batch(self, columns):
        self._check_open()
        if not isinstance(columns, (dict, tuple, list)) or (
                isinstance(columns, list) and len(self.schema) == 1 and self.schema[0].lod_level):
            columns = (columns,)          # one field given bare
        cdef ArrayReader src = ArrayReader(
            columns if isinstance(columns, dict) else tuple(columns), schema=self.schema)
        cdef int64_t i, n, s
        n = src.num_instances
        for i in range(n):
            s = columns_encoded_size(&self.layout, &src.C, i)
            if self.nsizes and self.payload_len + s + 4 * (self.nsizes + 1) > self.chunk_size:
                self._write_chunk()
            self._reserve(s)
            columns_encode(&self.layout, &src.C, i, self.payload + self.payload_len)
            self.payload_len += s
            self.sizes[self.nsizes] = <uint32_t>s
            self.nsizes += 1
            self.num_records += 1

    cdef int _write_chunk(self) except -1:
        if self.nsizes == 0:
            return 0
        cdef int64_t n = self.nsizes
        sizes_mv = <char[:n * 4]><char *>self.sizes
        payload_mv = <char[:self.payload_len]>self.payload if self.payload_len else b""
        cdef bytes body_c
        cdef uint32_t body_crc
        cdef int64_t raw_size = 4 * n + self.payload_len
        cdef uint32_t flags = self.compressor
        # version 2: a CRC table for chunks of big records only (record_crc="auto")
        cdef bint tables = self.compressor == 0 and self.version == 2 and (self.record_crc is True or (
            self.record_crc == "auto" and self.payload_len >= RECORD_CRC_MIN_RECORD * n))
        if self.compressor == 0 and self.version == 2 and not tables:
            flags = FLAG_BODY_CRC
        if self.compressor == 0 and (self.page_align is True or (
                self.page_align == "auto" and self.payload_len >= ALIGN_MIN_RECORD * n)):
            return self._write_aligned_chunk(True, tables, flags)
        if tables:
            return self._write_aligned_chunk(False, True, 0)
        if self.compressor == 1:
            body_c = _pyzlib.compress(bytes(sizes_mv) + bytes(payload_mv), self.level)
            body_crc = rl_crc32c(0, <const char *>body_c, len(body_c))
            stored = len(body_c)
        else:
            body_crc = rl_crc32c(0, self.sizes, n * 4)
            body_crc = rl_crc32c(body_crc, self.payload, self.payload_len)
            stored = raw_size
        # one piece, all or nothing: a failed write leaves the file at the last
        # complete chunk and the chunk buffered, so a retry rewrites it in place
        head = self._chunk_header(n, flags, body_crc, stored, raw_size)
        if self.compressor == 1:
            self._f.write(head, body_c)
        else:
            self._f.write(head, sizes_mv, payload_mv)
        self._index.append((self._pos, n))
        self._pos += 32 + stored
        self.nsizes = 0
        self.payload_len = 0
        return 0

    cdef bytes _chunk_header(self, int64_t n, uint32_t flags, uint32_t body_crc, int64_t stored,
                             int64_t raw_size):
        if raw_size > 0xFFFFFFFF:
            raise ValueError("chunk over 4 GiB; lower chunk_size")
        head = bytearray(32)
        cdef char *h = <char *>head
        rl_store_u32(h, CHUNK_MAGIC)
        rl_store_u32(h + 4, <uint32_t>n)
        rl_store_u32(h + 8, flags)
        rl_store_u32(h + 12, body_crc)
        rl_store_u64(h + 16, <uint64_t>stored)
        rl_store_u32(h + 24, <uint32_t>raw_size)
        rl_store_u32(h + 28, _chunk_header_crc(self.salt, h))
        return bytes(head)

    cdef int _write_aligned_chunk(self, bint aligned, bint tables, uint32_t flags) except -1:
        """Uncompressed chunk whose records each start on a page boundary of the
        file (zero padding between them): a reader can then drop each big
        record's pages, all of them, as soon as it has been copied.

        Version 2 with `tables` (aligned or not): the size table is followed by
        a table of each record's CRC-32C, and the chunk header's CRC covers
        both tables; padding is covered by being required to be zero (not by
        a CRC).  Without: the body CRC covers everything (version 1's body;
        `flags` adds FLAG_BODY_CRC to it in a version-2 file)."""
        cdef int64_t n = self.nsizes, i, pos = 0, src = 0, pad = 0, n_loop
        cdef int64_t tbl = (8 if tables else 4) * n
        cdef int64_t payload_abs = self._pos + CHUNK_HEADER + tbl
        cdef uint32_t crc = rl_crc32c(0, self.sizes, n * 4)
        cdef bytes zeros = bytes(PAGE)
        payload_mv = memoryview(<char[:max(self.payload_len, 1)]>self.payload)
        pieces = [memoryview(<char[:n * 4]><char *>self.sizes)]     # views: no copy of the payload
        if tables:
            for i in range(n):
                self.crcs[i] = rl_crc32c(0, self.payload + src, self.sizes[i])
                src += self.sizes[i]
            src = 0
            crc = rl_crc32c(crc, self.crcs, n * 4)          # the tables' CRC, not the records'
            pieces.append(memoryview(<char[:n * 4]><char *>self.crcs))
        if not aligned:                     # version 2 unaligned: the payload in one piece
            if self.payload_len:
                pieces.append(payload_mv[:self.payload_len])
            pos = self.payload_len
            n_loop = 0
        else:
            n_loop = n
        for i in range(n_loop):
            pad = (-(payload_abs + pos)) & (PAGE - 1)
            if pad:
                pieces.append(zeros[:pad])
                if not tables:
                    crc = rl_crc32c(crc, <const char *>zeros, pad)
            if self.sizes[i]:
                pieces.append(payload_mv[src:src + self.sizes[i]])
                if not tables:
                    crc = rl_crc32c(crc, self.payload + src, self.sizes[i])
            pos += pad + self.sizes[i]
            src += self.sizes[i]
        cdef int64_t stored = tbl + pos
        self._f.write(self._chunk_header(n, flags | (FLAG_ALIGNED if aligned else 0), crc, stored, stored),
                      *pieces)
        self._index.append((self._pos, n))
        self._pos += 32 + stored
        self.nsizes = 0
        self.payload_len = 0
        return 0

    def flush(self):
        """End the current chunk and push it to the OS."""
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:
            self._check_open()
            self._write_chunk()
            self._f.flush()

    def _finish(self):
        """The last chunk, the index footer and the trailer (close() calls this)."""
        self._write_chunk()
        n = len(self._index)
        idx = bytearray(24 + 16 * n)
        idx[0:4] = INDEX_MAGIC.to_bytes(4, "little")
        idx[8:16] = n.to_bytes(8, "little")
        idx[16:24] = self.num_records.to_bytes(8, "little")
        if n:
            table = np.array(self._index, dtype="<u8").reshape(-1)
            idx[24:] = table.tobytes()
        crc = rl_crc32c(0, <const char *>idx, len(idx))
        idx += crc.to_bytes(4, "little")
        index_offset = self._pos
        off = index_offset.to_bytes(8, "little")
        trailer = off + rl_crc32c(0, <const char *>off, 8).to_bytes(4, "little") + \
            TRAILER_MAGIC.to_bytes(4, "little")
        self._f.write(bytes(idx) + trailer)

    @property
    def num_chunks(self):
        return len(self._index) + (1 if self.nsizes else 0)



# ------------------------------------------------------------------- reader
cdef class RecordIOReader(FileReader):
    """Read instances from a RecordIO file (schema comes from the file).

    Parameters
    ----------
    path : str or os.PathLike
    on_error : {"raise", "skip"}
        "raise" (default): any failed check raises RecordIOError naming the
        file and byte offset; reading on goes on at the next chunk, and
        get_state raises RuntimeError (the chunk's records are gone, the
        position no longer adds up) until the next epoch.  "skip": a bad
        chunk is skipped, counted in `skipped_chunks`, and reported with a
        RecordIOWarning; a state saved after it restores exactly.

    Attributes
    ----------
    on_error : str
        As given.
    num_records, num_chunks : int
        From the index footer (or a scan of chunk headers when the file has
        no footer).
    skipped_chunks : int
        Chunks skipped so far (on_error="skip"), each once an epoch: a
        set_state back into an epoch does not count (or warn) again the
        chunks this reader had skipped in the epoch it leaves.
    low_memory : bool
        True (default): the pages of a record of 32 KiB or more leave this
        process as soon as a batch has copied it, so a shuffle over big
        records holds about its buffer's worth of file pages.  False:
        faster, with the file's pages resident.  A batch over big records of
        a version-2 file copies them straight from a mapping of the file
        (one copy per byte, no kernel copy), and the mapping's pages stay
        mapped until the reader is closed: no page drop, no refault, also
        across epochs of the same reader.  They count in the process's RSS
        (RssFile) up to the file's size; they are the page cache that a
        pread fills too, and the kernel can still reclaim them.  Records
        read otherwise go when their whole chunk has been consumed (one
        madvise per chunk, not per record), so a shuffle buffer can keep
        most of a file's chunks, and their pages, alive.
    """
    cdef readonly str path
    cdef int fd                        # open until close(); -1 when closed
    cdef int64_t fsize                 # at open: the chunk table covers this much
    cdef char *zbuf                    # scratch for a zlib chunk's stored body
    cdef int64_t zcap
    cdef int err_errno
    cdef rl_block **cur_blocks         # page-aligned chunks: one block per record
    cdef int64_t cur_blocks_cap
    cdef bint cur_per_record
    cdef int64_t *chunk_off
    cdef int64_t *chunk_nrec
    cdef int64_t *chunk_end            # where the chunk must end (next chunk / index)
    cdef readonly int64_t num_chunks
    cdef readonly int64_t num_records
    cdef int64_t *order                # chunks to read, in order (a selection)
    cdef int64_t norder
    cdef int64_t iorder
    cdef rl_block *cur
    cdef const char *cur_sizes
    cdef const char *cur_payload
    cdef int64_t cur_n, cur_i, cur_pos
    cdef bint cur_aligned
    cdef int64_t cur_payload_abs
    cdef bint skip_errors
    cdef readonly bint low_memory
    cdef readonly int64_t skipped_chunks
    cdef readonly bint has_index
    cdef readonly int64_t data_start
    cdef int64_t err_off
    cdef uint32_t salt
    cdef int err_code
    cdef int64_t err_record
    cdef object _file_id              # name, size, checksum of head and tail (states)
    cdef readonly int version          # the file's format version (1 or 2)
    cdef char *padbuf                  # v2 big records: the padding of a group, checked to be zero
    cdef char *stage                   # v2 big records, staged: a group as read (L2-resident)
    cdef int64_t stage_cap
    cdef readonly int64_t _bytes_verified   # test hook: record bytes CRC-checked on their own (v2)
    cdef const char *_ptrs[RL_MAX_FIELDS]     # scratch of _v2_check's parse
    cdef int64_t _rows[RL_MAX_FIELDS]
    cdef rl_map *dmap                  # the file mapped for a negotiated batch (NULL: none)
    cdef int64_t cur_chunk             # the chunk _load_chunk is loading
    cdef readonly int64_t _records_deferred  # test hook: records handed out deferred
    cdef int64_t _min_size             # the smallest record the schema allows (no rows)
    cdef object _last_error            # (error message, skip mode's warning or None) of the last chunk error
    cdef object _skipped_now           # skip mode: chunks skipped (counted, warned) this epoch, or None
    cdef object _skipped_left          # ... those of the epoch the last c_reset left (see _set_epoch_state)

    def __cinit__(self):
        self.fd = -1

    def __init__(self, path, on_error="raise", low_memory=True):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.low_memory = bool(low_memory)
        self.skip_errors = on_error == "skip"
        self.path = os.fspath(path)
        if not isinstance(self.path, str):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        size = os.fstat(self.fd).st_size
        self.fsize = size
        self._file_id = _file_identity(self.fd, self.path, size)
        if size < HEADER_FIXED:
            raise RecordIOError(f"{self.path}: not a RecordIO file ({size} bytes, truncated header "
                                f"at byte offset {size})", self.path, size)
        self._read_header()
        self._read_footer_or_scan()
        self._select_all()
        self.c_reset()

    def __dealloc__(self):
        if <void *>self.path == NULL:
            return                   # half-made (ReaderBase.__cinit__ failed): see _base.pyx
        self._release_cur()
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        free(self.zbuf)
        self.zbuf = NULL
        free(self.padbuf)
        self.padbuf = NULL
        free(self.stage)
        self.stage = NULL
        free(self.cur_blocks)
        self.cur_blocks = NULL
        free(self.chunk_off)
        free(self.chunk_nrec)
        free(self.chunk_end)
        free(self.order)

    cdef void _release_cur(self) noexcept nogil:
        cdef int64_t i
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        if self.cur_per_record:
            for i in range(self.cur_n):
                if self.cur_blocks[i] != NULL:
                    rl_block_decref(self.cur_blocks[i])
                    self.cur_blocks[i] = NULL
            self.cur_per_record = False

    cdef void _unmap(self) noexcept nogil:
        # the mapping lives on while deferred records (or the batch) hold it
        if self.dmap != NULL:
            if self.dmap.keep and self.dmap.fd < 0:
                # its kept pages go with the reader (what still holds the
                # mapping refaults what it reads): "mapped until the reader closes"
                madvise(self.dmap.base, <size_t>self.dmap.len, MADV_DONTNEED)
            rl_mapped.map_decref(self.dmap)
            self.dmap = NULL

    def _mapped_negotiate(self, pread=None):
        """A BatchReader over this reader (through decorators that only move
        items) asks for deferred records: maps the file (once) and returns the
        mapping's address with a reference for the caller, or 0 (no: mapped
        reads off, version 1, on_error="skip", closed).  `pread` (a chunk
        cache's clone, readers/_random_access.pyx): the batch preads them
        (True) or copies from a mapping (False) whatever this reader's own
        low_memory says; None: as low_memory and READERLIB_DEFERRED_READS say."""
        cdef void *p
        cdef rl_map *m
        cdef int f
        if (not _mapped or self.version != 2 or self.layout.bare or self.skip_errors
                or self.fd < 0 or self.fsize <= 0):
            return 0
        self._min_size = 0
        for f in range(self.layout.nfields):
            self._min_size += 8 if self.layout.lod[f] else self.layout.row_bytes[f]
        cdef bint via_pread = _deferred_mode == "pread" or _deferred_mode == "auto" and self.low_memory
        if pread is not None and _deferred_mode == "auto":
            via_pread = bool(pread)
        if self.dmap == NULL:
            fd = -1
            if via_pread:
                p = RL_MAP_PREAD_BASE
                try:
                    fd = os.dup(self.fd)     # deferred records outlive the reader's descriptor
                except OSError:              # out of descriptors (EMFILE): the reader's own path
                    return 0
            else:
                p = mmap(NULL, <size_t>self.fsize, PROT_READ, MAP_SHARED, self.fd, 0)
                if p == MAP_FAILED:
                    return 0                 # e.g. a file system without mmap: the pread path
            path = self.path.encode("utf-8", "surrogateescape")
            m = rl_map_new(path, <char *>p, self.fsize, fd, RL_MAP_RECORDIO)
            if m == NULL:
                if via_pread:
                    os.close(fd)
                else:
                    munmap(p, <size_t>self.fsize)
                raise MemoryError()
            m.budget = _map_budget
            m.keep = not via_pread and (not self.low_memory or _deferred_mode == "keep")
            self.dmap = m
        rl_map_incref(self.dmap)         # the caller's (records may be let go on other threads)
        return <size_t>self.dmap

    cdef int _load_v2_deferred(self, const char *T, int64_t n, int64_t payload_abs,
                               bint aligned) noexcept nogil:
        """The records of a checked v2 table (sizes, CRCs; layout checked) as
        deferred records over the mapping: the size against the schema and the
        padding (zero) are checked here, each record's CRC by the batch's
        fused copy.  The record bytes are not read."""
        cdef int64_t k, pos = 0, pad, size_i, foff = 0
        cdef int z
        cdef rl_block *blk
        cdef rl_dchunk *dc
        cdef int code = CK_OK
        if self._fresh_cur_blocks(n) != 0:
            return CK_NOMEM
        self.cur_n = n
        self.cur_i = 0
        self.cur_per_record = True
        dc = rl_dchunk_new(self.dmap, self.dmap.base + payload_abs,
                           self.dmap.base + payload_abs + self._v2_payload_len(T, n, payload_abs, aligned))
        if dc == NULL:
            self._release_cur()
            self.cur_n = 0                # no half-made chunk for the next c_next to hand out
            return CK_NOMEM
        code = self._v2_deferred_records(dc, T, n, payload_abs, aligned)
        rl_dchunk_done(dc)                # the records hold the chunk from here on
        if code != CK_OK:
            self._release_cur()
            self.cur_n = 0
            return code
        self._records_deferred += n
        return CK_OK

    cdef int64_t _v2_payload_len(self, const char *T, int64_t n, int64_t payload_abs,
                                 bint aligned) noexcept nogil:
        cdef int64_t k, pos = 0
        for k in range(n):
            if aligned:
                pos += (-(payload_abs + pos)) & (PAGE - 1)
            pos += rl_load_u32(T + 4 * k)
        return pos

    cdef int _v2_deferred_records(self, rl_dchunk *dc, const char *T, int64_t n, int64_t payload_abs,
                                  bint aligned) noexcept nogil:
        cdef int64_t k, pos = 0, pad, size_i, got
        cdef rl_block *blk
        cdef char padbuf[PAGE]
        for k in range(n):
            pad = ((-(payload_abs + pos)) & (PAGE - 1)) if aligned else 0
            size_i = rl_load_u32(T + 4 * k)
            if pad and not _pads_at_batch:
                # read, not mapped: a page faulted in here would stay until its chunk is done
                got = rl_pread_full(self.fd, padbuf, pad, payload_abs + pos)
                if got != pad:
                    self.err_record = k
                    return self._read_failed(got, payload_abs + pos)
                if not rl_all_zero(padbuf, pad):
                    self.err_record = k
                    self.err_off = payload_abs + pos
                    return CK_PADDING
            pos += pad
            # fixed schemas: the size is the whole check; sequence schemas: what
            # the size alone can tell, the row counts are the batch's (it reads them)
            if (size_i != self.layout.fixed_size if self.layout.n_lod == 0
                    else size_i < self._min_size):
                self.err_record = k
                self.err_off = payload_abs + pos
                return CK_RECORD
            blk = rl_deferred_new(dc, self.dmap.base + payload_abs + pos, size_i,
                                  rl_load_u32(T + 4 * (n + k)), self.cur_chunk, k)
            if blk == NULL:
                return CK_NOMEM
            if _pads_at_batch:
                (<rl_dblock *>blk).pad = <int>pad
            self.cur_blocks[k] = blk
            pos += size_i
        return CK_OK

    cdef int _zbuf_reserve(self, int64_t n) noexcept nogil:
        """Make the scratch buffer (zlib input, v2 tables) hold n bytes; -1 when
        out of memory (the buffer is left as it was)."""
        cdef char *zb
        if n > self.zcap:
            zb = <char *>realloc(self.zbuf, n)
            if zb == NULL:
                return -1
            self.zbuf = zb
            self.zcap = n
        return 0

    cdef int _fresh_cur_blocks(self, int64_t n) noexcept nogil:
        """Release the current chunk and make room for n per-record blocks (all
        NULL); -1 when out of memory (nothing else changed)."""
        cdef rl_block **blocks
        cdef int64_t i
        if n > self.cur_blocks_cap:
            blocks = <rl_block **>realloc(self.cur_blocks, n * sizeof(rl_block *))
            if blocks == NULL:
                return -1
            self.cur_blocks = blocks
            self.cur_blocks_cap = n
        self._release_cur()
        for i in range(n):
            self.cur_blocks[i] = NULL
        return 0

    def _fail(self, msg, offset):
        raise RecordIOError(f"{self.path}: {msg} at byte offset {offset}", self.path, offset)

    cdef bytes _pread(self, int64_t off, int64_t n):
        """Exactly n bytes at off (open-time reads); a shorter file fails."""
        data = os.pread(self.fd, n, off)
        if len(data) != n:
            self._fail(_CHUNK_ERRORS[CK_SHRUNK], off + len(data))
        return data

    cdef _read_header(self):
        cdef bytes head = self._pread(0, HEADER_FIXED)
        cdef const char *b = head
        if b[:8] not in FILE_MAGICS:
            if b[:7] == FILE_MAGIC[:7]:
                self._fail(f"RecordIO format version {b[7:8]!r} is not supported (this readerlib "
                           f"reads versions 1 and 2)", 7)
            self._fail("not a readerlib RecordIO file (bad magic)", 0)
        self.version = FILE_MAGICS[b[:8]]
        cdef int64_t slen = rl_load_u32(b + 8)
        if slen > self.fsize - HEADER_FIXED:
            self._fail(f"truncated or corrupt file header (schema of {slen} bytes)", 8)
        cdef bytes schema_bytes = self._pread(HEADER_FIXED, slen)
        crc = rl_crc32c(rl_crc32c(rl_crc32c(0, b, 12), b + 16, 8), <const char *>schema_bytes, slen)
        if crc != rl_load_u32(b + 12):
            self._fail("file header checksum mismatch", 0)
        try:
            schema = Schema.from_json(schema_bytes.decode())
        except Exception as e:
            self._fail(f"unreadable schema in the file header ({e})", HEADER_FIXED)
        try:
            self._set_schema(schema, ITEM_INSTANCE)
        except ValueError as e:             # e.g. more fields than compiled readers take
            raise ValueError(f"{self.path}: the schema in the file header cannot be read here: {e}") from None
        self.salt = rl_crc32c(0, b + 16, 8)
        self.data_start = HEADER_FIXED + slen

    cdef _alloc_table(self, int64_t n):
        self.chunk_off = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        self.chunk_nrec = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        self.chunk_end = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        self.order = <int64_t *>malloc(max(n, 1) * sizeof(int64_t))
        if not (self.chunk_off and self.chunk_nrec and self.chunk_end and self.order):
            raise MemoryError()

    cdef _read_footer_or_scan(self):
        cdef int64_t S = self.fsize
        cdef int64_t ioff, n, i, o, end, nrec
        cdef const char *t
        cdef const char *x
        cdef bytes trailer, index
        problem = None
        trailer = self._pread(S - TRAILER, TRAILER) if S >= self.data_start + TRAILER else b""
        t = trailer
        if trailer and rl_load_u32(t + 12) == TRAILER_MAGIC:
            ioff = <int64_t>rl_load_u64(t)
            if rl_crc32c(0, t, 8) != rl_load_u32(t + 8):
                problem = ("index trailer checksum mismatch", S - 16)
            elif ioff < self.data_start or ioff > S - TRAILER - 28:
                problem = ("index offset out of range", S - 16)
            else:
                index = self._pread(ioff, S - TRAILER - ioff)
                x = index
                n = <int64_t>rl_load_u64(x + 8)
                if rl_load_u32(x) != INDEX_MAGIC:
                    problem = ("bad index magic", ioff)
                elif n < 0 or n > (S - ioff) // 16 or ioff + 24 + 16 * n + 4 != S - TRAILER:
                    problem = ("index size disagrees with the file size", ioff + 8)
                elif rl_crc32c(0, x, 24 + 16 * n) != rl_load_u32(x + 24 + 16 * n):
                    problem = ("index checksum mismatch", ioff)
                else:
                    # A footer with a valid CRC is still cross-checked: chunks tile
                    # [data_start, index) in order, each with room for its header
                    # and its record count's size table (u32 raw_size caps a chunk
                    # at 2^30 records), so the counts are bounded by the file and
                    # every chunk is then verified against its own header on load.
                    self._alloc_table(n)
                    total = 0                       # a Python int: cannot wrap
                    for i in range(n):
                        o = <int64_t>rl_load_u64(x + 24 + 16 * i)
                        nrec = <int64_t>rl_load_u64(x + 32 + 16 * i)
                        self.chunk_off[i] = o
                        self.chunk_nrec[i] = nrec
                        # a chunk ends where the next one starts (the last one at the index)
                        end = <int64_t>rl_load_u64(x + 40 + 16 * i) if i + 1 < n else ioff
                        self.chunk_end[i] = end
                        if (o < self.data_start or end < o + CHUNK_HEADER or end > ioff
                                or nrec < 0 or nrec > (1 << 30) or (i == 0 and o != self.data_start)):
                            problem = ("index entry disagrees with the chunk layout", ioff + 24 + 16 * i)
                            break
                        total += nrec
                    if problem is None and total != rl_load_u64(x + 16):
                        problem = ("index record total disagrees with its entries", ioff + 16)
                    if problem is None:
                        self.num_chunks = n
                        self.num_records = total
                        self.has_index = True
                        return
                    free(self.chunk_off); free(self.chunk_nrec); free(self.chunk_end); free(self.order)
                    self.chunk_off = self.chunk_nrec = self.chunk_end = self.order = NULL
            if not self.skip_errors:
                self._fail(problem[0], problem[1])
            warnings.warn(f"{self.path}: {problem[0]} at byte offset {problem[1]}; "
                          f"reading by scanning chunks", RecordIOWarning, stacklevel=3)
        else:
            warnings.warn(f"{self.path}: no index footer (the writer did not finish, or the file "
                          f"was truncated at byte offset {S}); reading by scanning chunks",
                          RecordIOWarning, stacklevel=3)
        self._scan()

    cdef _scan(self):
        """Build the chunk table from chunk headers (no footer)."""
        cdef int64_t S = self.fsize
        cdef int64_t pos = self.data_start, stored, total = 0
        cdef bytes head
        cdef const char *h
        offs, nrecs, ends = [], [], []
        skipped = 0
        while pos < S:
            code = CK_OK
            head = os.pread(self.fd, CHUNK_HEADER, pos)
            h = head
            if len(head) < CHUNK_HEADER:
                code = CK_TRUNC_HEADER if S - pos < CHUNK_HEADER else CK_SHRUNK
            elif rl_load_u32(h) == INDEX_MAGIC:
                self._fail_or_warn("index footer without a valid trailer (truncated or corrupt footer)",
                                   pos)
                break
            elif rl_load_u32(h) != CHUNK_MAGIC:
                code = CK_MAGIC
            elif _chunk_header_crc(self.salt, h) != rl_load_u32(h + 28):
                code = CK_HEADER_CRC
            else:
                stored = <int64_t>rl_load_u64(h + 16)
                if stored > S - pos - CHUNK_HEADER:
                    code = CK_TRUNC_BODY
            if code != CK_OK:
                if not self.skip_errors or code == CK_SHRUNK:
                    self._fail(_CHUNK_ERRORS[code], pos)
                skipped += 1
                pos = self._resync(pos + 1)
                continue
            offs.append(pos)
            k = rl_load_u32(h + 4)
            nrecs.append(k)
            ends.append(pos + CHUNK_HEADER + stored)
            total += k
            pos += CHUNK_HEADER + stored
        n = len(offs)
        self._alloc_table(n)
        for i in range(n):
            self.chunk_off[i] = offs[i]
            self.chunk_nrec[i] = nrecs[i]
            self.chunk_end[i] = ends[i]
        self.num_chunks = n
        self.num_records = total
        self.has_index = False
        if skipped:
            self.skipped_chunks += skipped
            warnings.warn(f"{self.path}: skipped {skipped} unreadable region(s) while scanning",
                          RecordIOWarning, stacklevel=4)

    def _fail_or_warn(self, msg, offset):
        if not self.skip_errors:
            self._fail(msg, offset)
        warnings.warn(f"{self.path}: {msg} at byte offset {offset}", RecordIOWarning, stacklevel=4)

    cdef int64_t _resync(self, int64_t pos):
        """Next offset >= pos holding a chunk header with a valid checksum."""
        cdef int64_t S = self.fsize, i, L
        cdef bytes window
        cdef const char *w
        while pos + CHUNK_HEADER <= S:
            window = os.pread(self.fd, min(1 << 20, S - pos), pos)
            L = len(window)
            if L < CHUNK_HEADER:
                return S
            w = window
            for i in range(L - CHUNK_HEADER + 1):
                if rl_load_u32(w + i) == CHUNK_MAGIC and _chunk_header_crc(self.salt, w + i) == rl_load_u32(w + i + 28):
                    return pos + i
            pos += L - CHUNK_HEADER + 1
        return S

    # -- chunk loading (no GIL) ---------------------------------------------
    cdef int _load_chunk(self, int64_t c) noexcept nogil:
        """Read chunk c into a block of its own, verify it there and make it
        current.  Returns CK_OK or an error code."""
        cdef int64_t off = self.chunk_off[c]
        cdef int64_t limit = self.chunk_end[c]
        cdef char hbuf[CHUNK_HEADER]
        cdef const char *h = hbuf
        cdef const char *body
        cdef int64_t got
        cdef int64_t stored, raw, n, i, total, pos
        cdef uint32_t comp
        cdef rl_block *blk
        cdef const char *ptrs[RL_MAX_FIELDS]
        cdef int64_t rows[RL_MAX_FIELDS]
        cdef uLongf dest_len
        cdef bint aligned, body_crc, fixed_ok
        cdef int64_t payload_abs, size_i
        self.err_off = off
        self.err_record = -1
        self.cur_chunk = c
        if limit - off < CHUNK_HEADER:
            return CK_TRUNC_HEADER
        got = rl_pread_full(self.fd, hbuf, CHUNK_HEADER, off)
        if got != CHUNK_HEADER:
            return self._read_failed(got, off)
        if rl_load_u32(h) != CHUNK_MAGIC:
            return CK_MAGIC
        if _chunk_header_crc(self.salt, h) != rl_load_u32(h + 28):
            return CK_HEADER_CRC
        n = rl_load_u32(h + 4)
        comp = rl_load_u32(h + 8)
        aligned = (comp & FLAG_ALIGNED) != 0
        body_crc = (comp & FLAG_BODY_CRC) != 0      # version 2: a version-1 body (no CRC table)
        comp &= ~(<uint32_t>(FLAG_ALIGNED | FLAG_BODY_CRC))
        if comp > 0xFF or (body_crc and self.version != 2):
            return CK_FLAGS
        if (aligned or body_crc) and comp != 0:
            return CK_COMPRESSOR
        stored = <int64_t>rl_load_u64(h + 16)
        raw = rl_load_u32(h + 24)
        if n != self.chunk_nrec[c]:
            return CK_COUNT
        if comp > 1:
            return CK_COMPRESSOR
        if stored != limit - off - CHUNK_HEADER:
            return CK_TRUNC_BODY
        if comp == 0 and self.version == 2 and not body_crc:
            if raw != stored:
                return CK_SIZES
            return self._load_v2(off, h, n, stored, aligned)
        if comp == 0 and aligned:
            if raw != stored:
                return CK_SIZES
            return self._load_aligned(off, h, n, stored)
        if comp == 0:
            if raw != stored:
                return CK_SIZES
            blk = rl_fileblock_new(off + CHUNK_HEADER, stored,
                                   (3 if aligned else 2) if self.low_memory else 0)
            if blk == NULL:
                return CK_NOMEM
            body = blk.data
        else:
            if self._zbuf_reserve(stored) != 0:
                return CK_NOMEM
            body = self.zbuf
            blk = NULL
        got = rl_pread_full(self.fd, <char *>body, stored, off + CHUNK_HEADER)
        if got != stored:
            if blk != NULL:
                rl_block_decref(blk)
            return self._read_failed(got, off + CHUNK_HEADER)
        if crc32c_parallel(body, stored) != rl_load_u32(h + 12):
            if blk != NULL:
                rl_block_decref(blk)
            self.err_off = off + CHUNK_HEADER
            return CK_BODY_CRC
        if comp != 0:
            blk = rl_block_new(raw)
            if blk == NULL:
                return CK_NOMEM
            dest_len = raw
            if uncompress(<unsigned char *>blk.data, &dest_len, <const unsigned char *>body,
                          stored) != Z_OK or <int64_t>dest_len != raw:
                rl_block_decref(blk)
                return CK_INFLATE
        # sizes table, then every record against the schema
        if 4 * n > raw:
            rl_block_decref(blk)
            return CK_SIZES
        # One pass: each record (after its padding, for page-aligned chunks;
        # payload_abs is the payload's file offset) must lie inside the body and
        # parse against the schema, and together they must fill it exactly.
        payload_abs = off + CHUNK_HEADER + 4 * n
        # Fixed-size records filling the body exactly: all sizes compared in
        # one vectorised pass (the loop below would pass them; it runs only to
        # find the first bad record for the error).
        fixed_ok = (not aligned and self.layout.n_lod == 0 and self.layout.fixed_size < (<int64_t>1 << 31)
                    and 4 * n + n * self.layout.fixed_size == raw
                    and _sizes_all(blk.data, n, <uint32_t>self.layout.fixed_size))
        if fixed_ok:
            pos = raw - 4 * n
        else:
            pos = 0
            for i in range(n):
                if aligned:
                    pos += (-(payload_abs + pos)) & (PAGE - 1)
                size_i = rl_load_u32(blk.data + 4 * i)
                if 4 * n + pos + size_i > raw:
                    rl_block_decref(blk)
                    return CK_SIZES
                if self.layout.n_lod == 0:
                    if size_i != self.layout.fixed_size:
                        self.err_record = i
                        rl_block_decref(blk)
                        return CK_RECORD
                elif layout_parse(&self.layout, blk.data + 4 * n + pos, size_i, ptrs, rows) != 0:
                    self.err_record = i
                    rl_block_decref(blk)
                    return CK_RECORD
                pos += size_i
        if 4 * n + pos != raw:
            rl_block_decref(blk)
            return CK_SIZES
        self._release_cur()
        self.cur = blk
        self.cur_sizes = blk.data
        self.cur_payload = blk.data + 4 * n
        self.cur_n = n
        self.cur_i = 0
        self.cur_pos = 0
        self.cur_aligned = aligned
        self.cur_payload_abs = payload_abs
        return CK_OK

    cdef int _v2_layout(self, const char *T, int64_t n, int64_t stored, int64_t payload_abs,
                        bint aligned) noexcept nogil:
        """Version 2: every record (after its padding) inside the body, and the
        records filling it exactly (T: the checked tables)."""
        cdef int64_t i, pos = 0, tbl = 8 * n
        for i in range(n):
            if aligned:
                pos += (-(payload_abs + pos)) & (PAGE - 1)
            pos += rl_load_u32(T + 4 * i)
            if tbl + pos > stored:
                return CK_SIZES
        if tbl + pos != stored:
            return CK_SIZES
        return CK_OK

    cdef int _v2_check(self, const char *rec, int64_t size_i, uint32_t want, int64_t i,
                       int64_t file_off) noexcept nogil:
        """One record of a version-2 chunk, just read: its own CRC, then the schema."""
        return self._v2_checked(rec, size_i, rl_crc32c(0, rec, size_i), want, i, file_off)

    cdef int _v2_checked(self, const char *rec, int64_t size_i, uint32_t got, uint32_t want, int64_t i,
                         int64_t file_off) noexcept nogil:
        """_v2_check with the record's CRC already computed (`got`: by the fused copy)."""
        if got != want:
            self.err_record = i
            self.err_off = file_off
            return CK_RECORD_CRC
        self._bytes_verified += size_i
        if self.layout.n_lod == 0:
            if size_i != self.layout.fixed_size:
                self.err_record = i
                self.err_off = file_off
                return CK_RECORD
        elif layout_parse(&self.layout, rec, size_i, self._ptrs, self._rows) != 0:
            self.err_record = i
            self.err_off = file_off
            return CK_RECORD
        return CK_OK

    cdef int _v2_staged_group(self, const char *T, int64_t n, int64_t i, int64_t j,
                              int64_t payload_abs, int64_t pos, int64_t goff, int64_t gbytes,
                              bint aligned) noexcept nogil:
        """Records [i, j) of a v2 chunk (their blocks made, pos: record i's offset
        in the payload): one pread of the group (padding and records are
        contiguous in the file) into the staging buffer, still in this core's
        cache afterwards; then each record is copied to its block by the fused
        CRC + copy with streaming stores -- the CRC is of the bytes stored, and
        the blocks' lines are never read in first (no read-for-ownership), so
        a record costs one cached read and one memory write after the kernel's
        copy, instead of a write-allocate into a cold block and a CRC pass."""
        cdef char *st
        cdef int64_t got, k, pad, rel = 0
        cdef int code
        cdef rl_block *blk
        if gbytes > self.stage_cap:
            st = <char *>realloc(self.stage, gbytes)
            if st == NULL:
                return CK_NOMEM
            self.stage = st
            self.stage_cap = gbytes
        got = rl_pread_full(self.fd, self.stage, gbytes, goff)
        if got != gbytes:
            return self._read_failed(got, goff)
        for k in range(i, j):
            pad = ((-(payload_abs + pos)) & (PAGE - 1)) if aligned else 0
            if pad and not rl_all_zero(self.stage + rel, pad):
                self.err_record = k
                self.err_off = payload_abs + pos
                return CK_PADDING
            pos += pad
            rel += pad
            blk = self.cur_blocks[k]
            code = self._v2_checked(blk.data, blk.size,
                                    rl_crc32c_copy_nt(0, blk.data, self.stage + rel, blk.size),
                                    rl_load_u32(T + 4 * (n + k)), k, payload_abs + pos)
            if code != CK_OK:
                rl_cc_fence()
                return code
            pos += blk.size
            rel += blk.size
        rl_cc_fence()               # the blocks are complete before any thread reads them
        return CK_OK

    cdef int _load_v2(self, int64_t off, const char *h, int64_t n, int64_t stored,
                      bint aligned) noexcept nogil:
        """A version-2 uncompressed chunk.  The tables (sizes, then each record's
        CRC-32C) are read first and checked against the header's CRC; then the
        records are read in L2-sized pieces and each is verified (its CRC, its
        parse) right after its piece is read, while it is still in cache --
        one CRC pass over cached bytes instead of one over memory.  Padding
        must be zero.  Big records (a mean of 32 KiB or more) get a block each
        (recycled, see rl_mmap.h), a group of them read with one preadv;
        smaller ones share one block for the chunk."""
        cdef int64_t tbl = 8 * n, i, j, k, pos, p2, pad, size_i, got, have, piece
        cdef int64_t payload_abs = off + CHUNK_HEADER + tbl
        cdef int64_t gbytes, goff
        cdef char *T
        cdef rl_block *blk
        cdef rl_block **blocks
        cdef rl_iov iov[2 * GROUP_RECORDS]
        cdef int cnt
        cdef int code = CK_OK
        if tbl > stored:
            return CK_SIZES
        if stored - tbl < ALIGN_MIN_RECORD * n or n == 0:
            # ---- small records: one block (tables, then the payload) for the chunk
            blk = rl_fileblock_new(off + CHUNK_HEADER, stored, 0)
            if blk == NULL:
                return CK_NOMEM
            T = blk.data
            got = rl_pread_full(self.fd, T, tbl, off + CHUNK_HEADER)
            if got != tbl:
                rl_block_decref(blk)
                return self._read_failed(got, off + CHUNK_HEADER)
            if rl_crc32c(0, T, tbl) != rl_load_u32(h + 12):
                rl_block_decref(blk)
                self.err_off = off + CHUNK_HEADER
                return CK_TABLE_CRC
            code = self._v2_layout(T, n, stored, payload_abs, aligned)
            if code != CK_OK:
                rl_block_decref(blk)
                return code
            have = 0
            pos = 0
            i = 0
            while True:
                if have < stored - tbl:
                    piece = min(<int64_t>GROUP_BYTES, stored - tbl - have)
                    got = rl_pread_full(self.fd, T + tbl + have, piece, payload_abs + have)
                    if got != piece:
                        rl_block_decref(blk)
                        return self._read_failed(got, payload_abs + have)
                    have += piece
                while i < n:
                    pad = ((-(payload_abs + pos)) & (PAGE - 1)) if aligned else 0
                    size_i = rl_load_u32(T + 4 * i)
                    if pos + pad + size_i > have:
                        break
                    if pad and not rl_all_zero(T + tbl + pos, pad):
                        self.err_record = i
                        self.err_off = payload_abs + pos
                        rl_block_decref(blk)
                        return CK_PADDING
                    pos += pad
                    code = self._v2_check(T + tbl + pos, size_i, rl_load_u32(T + 4 * (n + i)), i,
                                          payload_abs + pos)
                    if code != CK_OK:
                        rl_block_decref(blk)
                        return code
                    pos += size_i
                    i += 1
                if i >= n:
                    break
            self._release_cur()
            self.cur = blk
            self.cur_sizes = T
            self.cur_payload = T + tbl
            self.cur_n = n
            self.cur_i = 0
            self.cur_pos = 0
            self.cur_aligned = aligned
            self.cur_payload_abs = payload_abs
            return CK_OK
        # ---- big records: a block each, read a group at a time, verified per group
        if self._zbuf_reserve(tbl) != 0:
            return CK_NOMEM
        T = self.zbuf
        got = rl_pread_full(self.fd, T, tbl, off + CHUNK_HEADER)
        if got != tbl:
            return self._read_failed(got, off + CHUNK_HEADER)
        if rl_crc32c(0, T, tbl) != rl_load_u32(h + 12):
            self.err_off = off + CHUNK_HEADER
            return CK_TABLE_CRC
        code = self._v2_layout(T, n, stored, payload_abs, aligned)
        if code != CK_OK:
            return code
        if (self.dmap != NULL and rl_map_defers(self.dmap)
                and off + CHUNK_HEADER + stored <= self.dmap.len):
            return self._load_v2_deferred(T, n, payload_abs, aligned)
        if aligned and self.padbuf == NULL:
            self.padbuf = <char *>malloc(GROUP_RECORDS * PAGE)
            if self.padbuf == NULL:
                return CK_NOMEM
        if self._fresh_cur_blocks(n) != 0:
            return CK_NOMEM
        self.cur_n = n
        self.cur_i = 0
        self.cur_per_record = True          # _release_cur frees what was read so far
        i = 0
        pos = 0
        while i < n and code == CK_OK:
            goff = payload_abs + pos
            gbytes = 0
            cnt = 0
            j = i
            p2 = pos
            while j < n and j - i < GROUP_RECORDS:
                pad = ((-(payload_abs + p2)) & (PAGE - 1)) if aligned else 0
                size_i = rl_load_u32(T + 4 * j)
                if j > i and gbytes + pad + size_i > GROUP_BYTES:
                    break
                blk = rl_fileblock_new(payload_abs + p2 + pad, size_i, 0)
                if blk == NULL:
                    code = CK_NOMEM
                    break
                self.cur_blocks[j] = blk
                if pad:
                    iov[cnt].iov_base = self.padbuf + (j - i) * PAGE
                    iov[cnt].iov_len = pad
                    cnt += 1
                if size_i:
                    iov[cnt].iov_base = blk.data
                    iov[cnt].iov_len = size_i
                    cnt += 1
                gbytes += pad + size_i
                p2 += pad + size_i
                j += 1
            if code != CK_OK:
                break
            if _staged:
                code = self._v2_staged_group(T, n, i, j, payload_abs, pos, goff, gbytes, aligned)
                pos = p2
                i = j
                continue
            got = rl_preadv_full(self.fd, iov, cnt, goff)
            if got != gbytes:
                code = self._read_failed(got, goff)
                break
            for k in range(i, j):
                pad = ((-(payload_abs + pos)) & (PAGE - 1)) if aligned else 0
                if pad and not rl_all_zero(self.padbuf + (k - i) * PAGE, pad):
                    self.err_record = k
                    self.err_off = payload_abs + pos
                    code = CK_PADDING
                    break
                pos += pad
                blk = self.cur_blocks[k]
                code = self._v2_check(blk.data, blk.size, rl_load_u32(T + 4 * (n + k)), k,
                                      payload_abs + pos)
                if code != CK_OK:
                    break
                pos += blk.size
            i = j
        if code != CK_OK:
            self._release_cur()
            self.cur_n = 0
            return code
        return CK_OK

    cdef int _load_aligned(self, int64_t off, const char *h, int64_t n, int64_t stored) noexcept nogil:
        """A page-aligned chunk (big records): each record is read into a block
        of its own, so a record leaves memory as soon as its consumer lets go
        of it -- a shuffle over big records holds its buffer's records, not
        their chunks -- and freed blocks are recycled hot (no page dropping
        and refaulting).  The body CRC runs over the pieces in file order."""
        cdef int64_t i, k, pos = 0, pad, size_i, got, rec_off
        cdef char padbuf[PAGE]
        cdef int64_t payload_abs = off + CHUNK_HEADER + 4 * n
        cdef uint32_t crc
        cdef rl_block *blk
        cdef rl_block **blocks
        cdef const char *ptrs[RL_MAX_FIELDS]
        cdef int64_t rows[RL_MAX_FIELDS]
        cdef int code = CK_OK
        if 4 * n > stored:
            return CK_SIZES
        if self._zbuf_reserve(4 * n) != 0:
            return CK_NOMEM
        got = rl_pread_full(self.fd, self.zbuf, 4 * n, off + CHUNK_HEADER)
        if got != 4 * n:
            return self._read_failed(got, off + CHUNK_HEADER)
        crc = rl_crc32c(0, self.zbuf, 4 * n)
        if self._fresh_cur_blocks(n) != 0:
            return CK_NOMEM
        for i in range(n):
            pad = (-(payload_abs + pos)) & (PAGE - 1)
            size_i = rl_load_u32(self.zbuf + 4 * i)
            if 4 * n + pos + pad + size_i > stored:
                code = CK_SIZES
                break
            rec_off = payload_abs + pos
            # the padding goes to a scratch page (checked, not kept), the record
            # into a block of its own
            blk = rl_fileblock_new(rec_off + pad, size_i, 0)
            if blk == NULL:
                code = CK_NOMEM
                break
            self.cur_blocks[i] = blk
            got = rl_pread2(self.fd, padbuf, pad, blk.data, size_i, rec_off)
            if got != pad + size_i:
                code = self._read_failed(got, rec_off)
                break
            crc = rl_crc32c(crc, padbuf, pad)
            crc = rl_crc32c(crc, blk.data, size_i)
            pos += pad + size_i
            if self.layout.n_lod == 0:
                if size_i != self.layout.fixed_size:
                    self.err_record = i
                    code = CK_RECORD
                    break
            elif layout_parse(&self.layout, blk.data, size_i, ptrs, rows) != 0:
                self.err_record = i
                code = CK_RECORD
                break
        if code == CK_OK and 4 * n + pos != stored:
            code = CK_SIZES
        if code == CK_OK and crc != rl_load_u32(h + 12):
            self.err_off = off + CHUNK_HEADER
            self.err_record = -1
            code = CK_BODY_CRC
        self.cur_n = n
        self.cur_i = 0
        self.cur_per_record = True          # _release_cur frees what was read so far
        if code != CK_OK:
            self._release_cur()
            self.cur_n = 0
            return code
        return CK_OK

    cdef int _read_failed(self, int64_t got, int64_t off) noexcept nogil:
        # a short read: the file shrank after open (the table came from its old size)
        if got < 0:
            self.err_errno = errno
            self.err_off = off
            return CK_IO
        self.err_off = off + got
        return CK_SHRUNK

    cdef int c_next(self, rl_record *out) except -1 nogil:
        cdef int code
        cdef uint32_t s
        while self.cur_i >= self.cur_n:
            self._release_cur()
            self.cur_n = 0
            self.cur_i = 0
            if self.iorder >= self.norder:
                return 0
            if self.fd < 0:
                with gil:
                    raise ValueError(f"I/O operation on closed reader (RecordIOReader {self.path!r})")
            code = self._load_chunk(self.order[self.iorder])
            self.iorder += 1
            if code != CK_OK:
                with gil:
                    self._chunk_error(code, self.order[self.iorder - 1])
        if self.cur_per_record:
            # the producer's reference to the previous record goes now (a consumer
            # that keeps a record past this call took its own)
            if self.cur_i > 0 and self.cur_blocks[self.cur_i - 1] != NULL:
                rl_block_decref(self.cur_blocks[self.cur_i - 1])
                self.cur_blocks[self.cur_i - 1] = NULL
            out.block = self.cur_blocks[self.cur_i]
            out.data = out.block.data
            out.size = out.block.size
            self.cur_i += 1
            if self.dmap != NULL and not rl_map_defers(self.dmap) and rl_record_is_deferred(out):
                self._materialize(out)   # not for the negotiated batch: verified here
            return 1
        s = rl_load_u32(self.cur_sizes + 4 * self.cur_i)
        if self.cur_aligned:
            self.cur_pos += (-(self.cur_payload_abs + self.cur_pos)) & (PAGE - 1)
        out.block = self.cur
        out.data = self.cur_payload + self.cur_pos
        out.size = s
        self.cur_pos += s
        self.cur_i += 1
        return 1

    cdef int _materialize(self, rl_record *out) except -1 nogil:
        """A deferred record of the current chunk pulled by a consumer other
        than the negotiated batch: replaced by a verified copy (or an error;
        the record is then dropped, as the pread path drops a chunk, and
        get_state refuses this epoch: ReaderBase._dropped)."""
        cdef int code
        cdef int64_t off
        cdef int64_t i = self.cur_i - 1
        cdef rl_block *nb = deferred_verified_copy(out, &self.layout, &code, &off)
        if nb == NULL:
            with gil:
                err = _deferred_error_of(out, code, off, self.schema if code == RL_DEF_LAYOUT else None)
                self._dropped = str(err)
                rl_block_decref(self.cur_blocks[i])
                self.cur_blocks[i] = NULL
                raise err
        rl_block_decref(self.cur_blocks[i])
        self.cur_blocks[i] = nb
        out.block = nb
        out.data = nb.data
        out.size = nb.size
        return 0

    cdef int _chunk_error(self, int code, int64_t c) except -1:
        # Chunk c failed to load: c_next has stepped past it, so its records
        # are gone from this epoch -- skipped (on_error="skip", with a warning),
        # or raised.  Raised, the position no longer adds up (set_state steps
        # over whole chunks by the index's counts, this one's too): get_state
        # refuses until the next epoch (ReaderBase._dropped).  Skipped, a
        # restore positions by reading (c_skip, skip mode) and skips it again.
        msg = _CHUNK_ERRORS.get(code, f"chunk error {code}")
        if self.err_record >= 0:
            msg += f" (record {self.err_record} of chunk {c})"
        else:
            msg += f" (chunk {c})"
        if code == CK_IO:
            msg += f" ({os.strerror(self.err_errno)})"
        where = f"{self.path}: {msg} at byte offset {self.err_off}"
        # what skip mode would warn for it (None: raised even in skip mode, not
        # the chunk's fault): a chunk cache over a skip-mode reader asks (_skip_message)
        skippable = code not in (CK_NOMEM, CK_SHRUNK, CK_IO)
        skipped = f"{self.path}: skipped chunk: {msg} at byte offset {self.err_off}" if skippable else None
        self._last_error = (where, skipped)
        if skippable and self.skip_errors:
            # once an epoch: a restore into it (set_state reads up to its position,
            # skipping the chunk again) neither counts nor warns a second time
            if self._skipped_now is None:
                self._skipped_now = set()
            if c not in self._skipped_now:
                self._skipped_now.add(c)
                self.skipped_chunks += 1
                warnings.warn(skipped, RecordIOWarning, stacklevel=2)
            return 0
        self._dropped = f"{where}: the chunk's records were not read"
        if code == CK_NOMEM:
            raise MemoryError(f"{self.path}: {msg}")
        if code == CK_RECORD:        # the one exception for a record that does not fit its schema
            raise RecordIOSchemaError(f"{where}: schema {self.schema}", self.path, self.err_off,
                                      self.err_record)
        raise RecordIOError(where, self.path, self.err_off)

    def _skip_message(self, err):
        """The RecordIOWarning message skip mode gives for the chunk whose load
        raised `err` (the last chunk error), or None: not a chunk fault (a read
        error, a file that shrank: raised in skip mode too), or another error."""
        if self._last_error is None or not str(err).startswith(self._last_error[0]):
            return None
        return self._last_error[1]

    @property
    def on_error(self):
        """The on_error given: "raise" or "skip"."""
        return "skip" if self.skip_errors else "raise"

    cdef int c_reset(self) except -1:
        cdef int64_t i
        self._release_cur()
        self.cur_n = 0
        self.cur_i = 0
        self.iorder = 0
        self._dropped = None
        self._skipped_left = self._skipped_now
        self._skipped_now = None
        return 0

    def _share_skipped(self, skipped):
        """open_files: this epoch's skipped chunks are `skipped` (a set the
        stream keeps for the file across the readers its runs open)."""
        self._skipped_now = skipped

    def _set_epoch_state(self, state):
        # set_state: c_reset, then this, then reading up to the saved position.
        # The restore goes back into an epoch, not on to a new one: the chunks
        # the epoch it left had skipped were counted and warned already (an
        # uninterrupted run counts them once).  A chain restored in a fresh
        # process counts and warns them once, while it reads up to the position.
        if self.iorder == 0 and self.cur_n == 0 and self._skipped_left is not None:
            self._skipped_now = self._skipped_left
        self._skipped_left = None

    def _select_all(self):
        cdef int64_t i
        for i in range(self.num_chunks):
            self.order[i] = i
        self.norder = self.num_chunks

    def select_chunks(self, chunks):
        """Read only these chunk indices, in this order (sharding, resume)."""
        sel = np.asarray(chunks, dtype=np.int64).reshape(-1)
        if sel.size and (sel.min() < 0 or sel.max() >= self.num_chunks):
            raise IndexError(f"chunk indices must be in [0, {self.num_chunks}), got {sel.tolist()[:8]}")
        cdef int64_t i
        cdef int64_t *order = <int64_t *>malloc(max(sel.shape[0], 1) * sizeof(int64_t))
        if order == NULL:
            raise MemoryError()
        for i in range(sel.shape[0]):
            order[i] = sel[i]
        free(self.order)
        self.order = order
        self.norder = sel.shape[0]
        self.c_reset()
        return self

    def chunk_table(self):
        """(offsets, record counts) of every chunk, as int64 arrays."""
        offs = np.empty(self.num_chunks, np.int64)
        nrec = np.empty(self.num_chunks, np.int64)
        cdef int64_t i
        for i in range(self.num_chunks):
            offs[i] = self.chunk_off[i]
            nrec[i] = self.chunk_nrec[i]
        return offs, nrec

    cdef int c_close(self) except -1:
        self._release_cur()                  # blocks still held downstream stay valid
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        free(self.zbuf)
        self.zbuf = NULL
        self.zcap = 0
        return 0

    def __len__(self):
        return self.num_records

    def _describe(self):
        return {"file": dict(self._file_id)}

    def _reads_in_file_order(self):
        """True when record i of an epoch is record i of the file (every chunk, in
        order, errors raised): a buffer shuffle's restore reads its records by index."""
        cdef int64_t i
        if self.skip_errors or self.norder != self.num_chunks:
            return False
        for i in range(self.norder):
            if self.order[i] != i:
                return False
        return True

    def _current_run(self):
        """(stride, count) when the `count` records of the current chunk after
        the one c_next handed out last lie, in its block, at that record's
        data + k x stride (k = 1 .. count) -- exactly what the next `count`
        c_next calls would hand out: a chunk of fixed-size records, read into
        one block and verified whole before its first record came out (header,
        body CRC, every size; pread or inflated; not page-aligned, not one
        block per record).  None otherwise (the caller reads on with c_next).
        For the chunk cache's load (readers/_random_access.pyx): one call per
        chunk instead of a c_next per record."""
        if (self.cur == NULL or self.cur_per_record or self.cur_aligned or self.layout.n_lod != 0
                or self.cur_i < 1 or self.cur_i > self.cur_n
                or self.cur_pos != self.cur_i * self.layout.fixed_size):
            return None
        return int(self.layout.fixed_size), int(self.cur_n - self.cur_i)

    def _reduce_args(self):
        return (self.path,), {"on_error": "skip" if self.skip_errors else "raise",
                              "low_memory": bool(self.low_memory)}

    def __repr__(self):
        return (f"RecordIOReader({self.path!r}, {self.num_records} records in {self.num_chunks} chunks"
                f"{'' if self.has_index else ', no index'})")

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # Whole chunks of the order are stepped over by their index counts, not
        # read (set_state is O(chunks) integer steps); the current chunk and the
        # one the target falls in are read as usual.  on_error="skip" reads them
        # all: a chunk it would skip holds no records to count.
        cdef int64_t done = 0, k
        cdef rl_record rec
        if self.skip_errors or n <= 0:
            return ReaderBase.c_skip(self, n)
        while done < n and self.cur_i < self.cur_n:
            self.c_next(&rec)
            done += 1
        while self.iorder < self.norder:
            k = self.chunk_nrec[self.order[self.iorder]]
            if k > n - done:
                break
            done += k
            self.iorder += 1
        return done + ReaderBase.c_skip(self, n - done)

