"""TFRecord: TensorFlow's record files, read and written byte-compatibly.

Design:
    See TFRECORD.md next to this file.  A record on disk is
    ``uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)``.
    Records are grouped into *chunks* (consecutive records, greedily until
    CHUNK_BYTES of file bytes or CHUNK_RECORDS records), the unit of
    verification, seeking and sharding -- the same rule whether the chunk
    table comes from a scan or from the sidecar index, so both agree.

    Uncompressed files are read a chunk at a time with pread(2) into a block
    the reader owns (one read for a chunk the table knows, ~2 for one being
    scanned); nothing is memory-mapped, so a file truncated or rewritten
    while it is read gives a TFRecordError or the bytes as they were read --
    never SIGBUS, never bytes no checksum covered.  A chunk's record headers
    (length CRCs, sizes against the schema) are verified when it is loaded,
    without the GIL; each data CRC is computed next to the copy that follows
    it (so the copy finds the record in cache).  Records are handed
    downstream as pointers into the chunk's block (no further copy, like
    RecordIO), each verified, in that block, as it is handed out: fixed-size ones as they are, variable-length ones (the
    default: uint8 sequences) as "bare" instances -- the rows without the
    int64 row-count prefix of the instance encoding, which a TFRecord record
    does not have (layout.bare; see readers/_base.pxd).  `_prefixed_instances()`
    switches to copying each record into a block behind a prefix instead, for
    `open_files` streams that mix TFRecord with other formats.

    Big records (>= 32 KiB) in one copy: under a negotiating BatchReader
    (`_mapped_negotiate`, include/rl_mapped.h) a chunk loaded during the
    batch's pull is scanned through windows (`_dget`): each big record's
    header and data CRC are read (16 adjacent bytes), not its data, and it
    goes out as a deferred record (file offset, size, unmasked data CRC)
    that the batch reads straight into its row and checks there.  cur_off < 0
    marks such a record (-1 - its file offset); one pulled by anyone else is
    read and checked here (`_next_big`).  ZLIB/GZIP
    files are inflated (zlib, windowBits 15 / 31; concatenated gzip members
    are accepted) into a reused buffer and copied into blocks a chunk at a time;
    their input is pread too.

    The chunk table (start offset, first record, record count) of a file is
    saved in ``<file>.idx`` after the first complete pass (or by
    `build_index`), with the file's size and mtime *as it was opened* (not
    written if the file changed during the pass), CRC-32Cs of its first and
    last 4 KiB and a CRC-32C of the index, so later readers can count, seek
    and shard without scanning.  An index is never trusted blindly: on load
    its chunks must start at 0, increase, leave room for their records and
    end at the stream's end (else a TFRecordWarning and a rescan), and each
    chunk read through it must hold exactly its record count, filling exactly
    the bytes up to the next chunk (else a TFRecordError naming the index).
"""
import os
import threading
import zlib as _pyzlib

import numpy as np
cimport numpy as cnp
from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy, memmove
from libc.errno cimport errno
import warnings

from readerlib._typedefs cimport int64_t, uint32_t, uint64_t
from readerlib.readers._base cimport (
    ReaderBase, FileReader, rl_block, rl_record, rl_block_decref, rl_block_new,
    rl_crc32c, rl_crc32c_mask, rl_crc32c_unmask, rl_core_import, rl_load_u32, rl_load_u64,
    rl_store_u32, rl_store_u64, rl_store_i64, ITEM_INSTANCE)
from readerlib.tensor import Field, Schema
from readerlib.errors import RecordSchemaError, TFRecordError, TFRecordWarning
from readerlib.readers._base import _file_identity
from readerlib.formats._writer cimport FileWriter
from readerlib.formats._writer import _PieceFile

cnp.import_array()
rl_core_import()

cdef extern from "zlib.h" nogil:
    ctypedef struct z_stream:
        const unsigned char *next_in
        unsigned int avail_in
        unsigned long total_in
        unsigned char *next_out
        unsigned int avail_out
        unsigned long total_out
        const char *msg
        void *zalloc
        void *zfree
        void *opaque
    int Z_OK, Z_STREAM_END, Z_BUF_ERROR, Z_NO_FLUSH, Z_MEM_ERROR
    int inflateInit2(z_stream *strm, int windowBits)
    int inflate(z_stream *strm, int flush)
    int inflateReset(z_stream *strm)
    int inflateEnd(z_stream *strm)

cdef extern from *:
    int64_t __atomic_load_n(int64_t *p, int order) nogil

cdef extern from "rl_mmap.h":
    rl_block *rl_fileblock_new(int64_t file_off, int64_t size, int drop_pages) nogil
    int64_t rl_pread_full(int fd, char *dst, int64_t n, int64_t off) nogil

# ---- big records in one copy (include/rl_mapped.h; TFRECORD.md "Big records in one copy")
cdef extern from "rl_core.h":
    int RL_CONSUMED_MIN

from readerlib._mapped cimport (
    rl_map, rl_dblock, rl_dchunk, rl_mapped_api, rl_mapped, rl_mapped_import,
    rl_dchunk_new, rl_dchunk_done, rl_deferred_new, rl_map_incref, rl_map_new, rl_map_defers, RL_MAP_PREAD_BASE, RL_DEF_MISMATCH, RL_DEF_SHRUNK,
    RL_DEF_NOMEM, RL_DEF_LAYOUT, RL_DEF_IO, RL_MAP_TFRECORD)

rl_mapped_import()

# Big records (>= RL_CONSUMED_MIN, 32 KiB) of uncompressed files, read for a
# negotiated BatchReader, go out deferred: the scan reads their headers and
# data CRCs, the batch reads their bytes straight into its rows and checks
# them there.  READERLIB_MAPPED_READS=0 or _set_deferred_reads(False): the
# two-copy path (the A/B, and the tests' reference).
cdef bint _deferred = os.environ.get("READERLIB_MAPPED_READS", "1") != "0"
# the scan's first window at a chunk's start, and after a deferred record
# (it doubles while records keep being small: see _dget)
cdef int64_t _WIN0 = 4096


def _set_deferred_reads(flag):
    """Test / benchmark switch: deferred big records for chains that end in
    a batch; returns the old setting.  Chains built (or reset) afterwards take it."""
    global _deferred
    old = bool(_deferred)
    _deferred = bool(flag)
    return old


def _deferred_error_py(size_t block, int code, int64_t offset, schema=None):
    """The error of a deferred TFRecord record that failed where it was read
    (the batch, a shuffle's check): the reader's own messages, naming the file
    and the record's offset.  Called through _recordio._deferred_error_py."""
    cdef rl_dblock *d = <rl_dblock *>block
    path = d.map.path.decode("utf-8", "surrogateescape")
    cdef int64_t start = (<rl_block *>block).data - d.map.base - 12     # the record's header
    if code == RL_DEF_NOMEM:
        return MemoryError(f"{path}: out of memory reading the record at {start}")
    if code == RL_DEF_MISMATCH:
        return TFRecordError(f"{path}: corrupted record at {start} (data checksum mismatch)", path, start)
    if code == RL_DEF_SHRUNK:
        return TFRecordError(f"{path}: truncated record at {offset} (the file is shorter than when it "
                             f"was opened: truncated while being read?)", path, offset)
    if code >= RL_DEF_IO:
        return TFRecordError(f"{path}: read error at byte offset {offset} ({os.strerror(code - RL_DEF_IO)})",
                             path, offset)
    # RL_DEF_LAYOUT: the reader checked the size at its scan, so only a
    # consumer with another schema gets here
    size = (<rl_block *>block).size
    return RecordSchemaError(f"{path}: record at {start} has {size} bytes, which do not fit the "
                             f"schema {schema}", path, start, None, None)

__all__ = ["TFRecordReader", "TFRecordWriter", "build_index", "masked_crc32c",
           "CHUNK_BYTES", "CHUNK_RECORDS"]

cdef enum:
    _CHUNK_BYTES = 1048576
    _CHUNK_RECORDS = 65536
    _INDEX_HEAD = 80            # magic + 9 u64
    _FINGERPRINT = 4096         # bytes at each end of the file the index's CRCs cover
    _ZIN = 262144               # compressed input read per pread
CHUNK_BYTES = _CHUNK_BYTES
CHUNK_RECORDS = _CHUNK_RECORDS
INDEX_MAGIC = b"RLTFIX02"       # 02: open-time stat, head/tail CRCs, checked structure
INDEX_SUFFIX = ".idx"
_ZTYPES = {None: 0, "": 0, "NONE": 0, "ZLIB": 1, "GZIP": 2}
_ZNAMES = {0: None, 1: "ZLIB", 2: "GZIP"}

cdef enum:
    E_OK = 0
    E_TRUNC = 1
    E_LEN_CRC = 2
    E_DATA_CRC = 3
    E_SIZE = 4
    E_NOMEM = 5
    E_ZDATA = 6
    E_ZTRUNC = 7
    E_INDEX = 8
    E_LENGTH = 9
    E_SHRUNK = 10
    E_IO = 11


def masked_crc32c(data):
    """TFRecord's masked CRC-32C of a bytes-like object."""
    cdef const unsigned char[::1] v = memoryview(data).cast("B")
    return rl_crc32c_mask(rl_crc32c(0, &v[0] if v.shape[0] else NULL, v.shape[0]))


def _compression_code(compression):
    key = compression.upper() if isinstance(compression, str) else compression
    if key not in _ZTYPES:
        raise ValueError(f"compression must be None, 'ZLIB' or 'GZIP' (TFRecordOptions), got {compression!r}")
    return _ZTYPES[key]


def _record_schema(schema):
    """(schema, lod_mode, row_bytes, fixed_size) for a TFRecord reader."""
    if schema is None:
        schema = Schema([Field("data", "uint8", (), lod_level=1)])
    schema = Schema.coerce(schema)
    if len(schema) != 1:
        raise ValueError(f"a TFRecord record is one byte string: the schema must have one field "
                         f"(its bytes are reinterpreted, like tf.io.decode_raw); got {len(schema)} fields")
    f = schema[0]
    if f.lod_level > 1:
        raise ValueError(f"field {f.name!r}: lod_level must be 0 or 1, got {f.lod_level}")
    if f.row_bytes == 0:
        raise ValueError(f"field {f.name!r} has rows of 0 bytes")
    return schema, bool(f.lod_level), f.row_bytes, (-1 if f.lod_level else f.row_bytes)


def _index_path_for(path, index):
    if index is False or index is None:
        return None
    if index is True or index == "auto":
        return os.fspath(path) + INDEX_SUFFIX
    return os.fspath(index)


def _reopen_tfrecord(path, schema, compression, index, prefixed):
    """Unpickle a TFRecordReader (see ReaderBase.__reduce__)."""
    r = TFRecordReader(path, schema=schema, compression=compression, index=index)
    if prefixed:
        r._prefixed_instances()
    return r


# ------------------------------------------------------------------- reader
cdef class TFRecordReader(FileReader):
    """Read a TFRecord file (as written by `tf.io.TFRecordWriter`).

    Parameters
    ----------
    path : str or os.PathLike
    schema : Schema, optional
        Default: one field ``Field("data", "uint8", (), lod_level=1)`` -- each
        record is a byte sequence, batches are LoD byte tensors.  A one-field
        fixed schema reinterprets each record's bytes (like
        `tf.io.decode_raw`); a record of another size raises ValueError
        naming the file and offset.  A one-field sequence schema of another
        dtype splits each record into rows of that dtype.
    compression : {None, "ZLIB", "GZIP"}
        As `tf.io.TFRecordOptions(compression_type=...)`.
    index : "auto", False or path
        "auto": use ``<path>.idx`` when it matches the file, write it after
        the first complete pass.  A path: the same, with that sidecar file.
        False: no sidecar.

    Raises
    ------
    TFRecordError
        A record fails a check: "corrupted record at OFFSET" (checksum) or
        "truncated record at OFFSET", naming the file.  Offsets of compressed
        files are offsets in the uncompressed stream, as TensorFlow reports them.

    Examples
    --------
    >>> r = TFRecordReader("train.tfrecord").batch(256)
    >>> for (data,) in r:           # data: LoDTensor of uint8, one sequence per record
    ...     ...
    """
    cdef readonly str path
    cdef readonly object compression
    cdef readonly object index_path
    cdef int ztype
    cdef bint lod_mode
    cdef bint prefix                # lod_mode: copy records behind an int64 row count
    cdef int64_t row_bytes
    cdef int64_t fixed_size
    # the file (open until close(); everything is pread, nothing mapped)
    cdef int fd
    cdef int64_t fsize              # at open: the reader reads this much
    cdef object _stat               # (size, mtime_ns) at open, what an index records
    cdef int err_errno
    # uncompressed files: the chunk being scanned (build) / a header window (index scan)
    cdef rl_block *pblk
    cdef int64_t phave, pcap, pextent
    cdef char *hwin
    cdef int64_t hwin_off, hwin_len
    # compressed files: input window
    cdef char *zin
    cdef int64_t zin_off, zin_len
    # chunk table (grows during the first sequential pass)
    cdef int64_t *ck_pos
    cdef int64_t *ck_first
    cdef int64_t *ck_n
    cdef int64_t nck, ck_cap
    cdef bint complete
    cdef int64_t total_records
    cdef int64_t stream_end
    cdef bint scan_stopped          # this epoch's scan past the table failed: the file is over
    cdef bint index_written
    cdef int64_t last_bytes
    # chunks to read (None selected: every chunk in file order)
    cdef int64_t *order
    cdef int64_t norder
    cdef bint selected
    cdef int64_t iorder
    # current chunk
    cdef rl_block *cur
    cdef int64_t *cur_off
    cdef int64_t *cur_len
    cdef int64_t cur_n, cur_i, cur_chunk
    cdef bint cur_is_heap
    cdef bint cur_is_view
    cdef rl_block *spare
    cdef int64_t scan_n, scan_bytes
    # compressed stream
    cdef z_stream zs
    cdef bint zs_init, zs_eof
    cdef char *dbuf
    cdef int64_t dcap, dlo, dhi, spos
    # last error
    cdef int err_code
    cdef int64_t err_off, err_val
    cdef object _file_id              # name, size, checksum of head and tail (states)
    # deferred big records (a negotiated batch; see _scan and c_next)
    cdef rl_map *dmap                 # the file for the batch's reads (NULL: not negotiated)
    cdef rl_dchunk *dchunk            # the current chunk's (its deferred records hold it)
    cdef rl_block *dlast              # the last record c_next handed out in a block of its own
    cdef uint32_t *cur_crc            # per record of the chunk: the data CRC (deferred ones)
    cdef int64_t *cur_foff            # ... its data's file offset (a deferring scan's chunk: its
                                      # small records sit in windows, cur_off is not chunk-relative);
                                      # one allocation holds both (cur_crc follows cur_foff)
    cdef bint cur_deferring           # the current chunk came from a deferring scan
    cdef bint defer_scan              # the scan under way defers big records
    cdef int64_t w_lo, w_hi, w_blk    # its window: chunk bytes [w_lo, w_hi) at pblk + w_blk
    cdef int64_t w_next               # the size of the next window read (kept across chunks)
    cdef readonly int64_t _records_deferred   # test hook: records handed out deferred

    def __cinit__(self):
        self.fd = -1
        self.zs_init = False
        self.w_next = _WIN0

    def __init__(self, path, schema=None, compression=None, index="auto"):
        self.path = os.fspath(path)
        if not isinstance(self.path, str):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        self.ztype = _compression_code(compression)
        self.compression = _ZNAMES[self.ztype]
        schema, lod, rb, fs = _record_schema(schema)
        self._set_schema(schema, ITEM_INSTANCE)
        self.lod_mode = lod
        self.prefix = False
        self.layout.bare = lod           # sequence records: the rows alone, zero copy
        self.row_bytes = rb
        self.fixed_size = fs
        self.index_path = _index_path_for(self.path, index)
        self.cur_off = <int64_t *>malloc(_CHUNK_RECORDS * sizeof(int64_t))
        self.cur_len = <int64_t *>malloc(_CHUNK_RECORDS * sizeof(int64_t))
        if self.cur_off == NULL or self.cur_len == NULL:
            raise MemoryError()
        self._grow_table(64)
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self.fd)
        self.fsize = st.st_size
        self._file_id = _file_identity(self.fd, self.path, self.fsize)
        self._stat = (st.st_size, st.st_mtime_ns)
        if self.ztype:
            self.zin = <char *>malloc(_ZIN)
            if self.zin == NULL:
                raise MemoryError()
        if self.index_path is not None:
            self._load_index(st)
        self.c_reset()

    def __dealloc__(self):
        if <void *>self.path == NULL:
            return                   # half-made (ReaderBase.__cinit__ failed): see _base.pyx
        self._release_cur()
        if self.spare != NULL:
            rl_block_decref(self.spare)
            self.spare = NULL
        self._release_file()
        if self.zs_init:
            inflateEnd(&self.zs)
            self.zs_init = False
        free(self.cur_foff); self.cur_foff = NULL; self.cur_crc = NULL     # (one block)
        free(self.dbuf); self.dbuf = NULL
        free(self.ck_pos); free(self.ck_first); free(self.ck_n); free(self.order)
        self.ck_pos = self.ck_first = self.ck_n = self.order = NULL
        free(self.cur_off); free(self.cur_len)
        self.cur_off = self.cur_len = NULL

    cdef void _release_cur(self) noexcept nogil:
        if self.cur != NULL:
            rl_block_decref(self.cur)
            self.cur = NULL
        if self.dlast != NULL:
            rl_block_decref(self.dlast)
            self.dlast = NULL
        if self.dchunk != NULL:
            rl_dchunk_done(self.dchunk)      # its deferred records still out hold it
            self.dchunk = NULL

    cdef _release_file(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.dmap != NULL:                 # deferred records (and the batch) hold their own
            rl_mapped.map_decref(self.dmap)
            self.dmap = NULL
        if self.pblk != NULL:
            rl_block_decref(self.pblk)
            self.pblk = NULL
        self.pcap = self.phave = 0
        free(self.hwin); self.hwin = NULL
        self.hwin_len = 0
        free(self.zin); self.zin = NULL

    cdef void _retire_cur(self) noexcept nogil:
        # A heap chunk nobody else references is kept for the next chunk: its
        # pages are already faulted in (a fresh 1 MiB block costs 256 page faults).
        if self.cur != NULL and self.cur_is_heap and __atomic_load_n(&self.cur.refcnt, 0) == 1:
            if self.spare != NULL:
                rl_block_decref(self.spare)
            self.spare = self.cur
            self.cur = NULL
        self._release_cur()

    cdef rl_block *_take_spare(self, int64_t size) noexcept nogil:
        cdef rl_block *b = self.spare
        if b == NULL or b.aux < size:          # rl_block_new keeps the capacity in aux
            return NULL
        self.spare = NULL
        b.size = size
        return b

    cdef int _grow_table(self, int64_t need) except -1:
        if need <= self.ck_cap:
            return 0
        cdef int64_t cap = max(need, 2 * self.ck_cap, 64)
        cdef int64_t *a = <int64_t *>realloc(self.ck_pos, cap * sizeof(int64_t))
        if a == NULL: raise MemoryError()
        self.ck_pos = a
        a = <int64_t *>realloc(self.ck_first, cap * sizeof(int64_t))
        if a == NULL: raise MemoryError()
        self.ck_first = a
        a = <int64_t *>realloc(self.ck_n, cap * sizeof(int64_t))
        if a == NULL: raise MemoryError()
        self.ck_n = a
        self.ck_cap = cap
        return 0

    # -- sidecar index ---------------------------------------------------------
    def _fingerprint(self):
        """CRC-32Cs of the file's first and last 4 KiB (what an index was built over)."""
        head = os.pread(self.fd, min(_FINGERPRINT, self.fsize), 0)
        tail = os.pread(self.fd, min(_FINGERPRINT, self.fsize), max(0, self.fsize - _FINGERPRINT))
        return (int(rl_crc32c(0, <const char *>head, len(head))),
                int(rl_crc32c(0, <const char *>tail, len(tail))))

    def _reject_index(self, why):
        warnings.warn(f"{self.path}: ignoring the index {self.index_path!r} ({why}); the file is "
                      f"scanned instead and the index rewritten after a full pass",
                      TFRecordWarning, stacklevel=1)
        return False

    def _load_index(self, st):
        """Use the sidecar index if it describes this file; never trust it blindly.

        A file that changed since (size or mtime) is rescanned silently; an
        index whose checksum, fingerprint or structure disagrees is rejected
        with a TFRecordWarning."""
        try:
            with open(self.index_path, "rb") as f:
                raw = f.read()
        except OSError:
            return False
        cdef int64_t n, i, pos, cnt, nxt
        if raw[:8] == b"RLTFIX01":
            return False                 # the previous version: rebuilt on the next full pass
        if raw[:8] != INDEX_MAGIC:
            return self._reject_index("not a readerlib TFRecord index of this version") if raw else False
        if len(raw) < _INDEX_HEAD + 4:
            return self._reject_index("truncated")
        body = raw[:len(raw) - 4]
        if rl_crc32c(0, <const char *>body, len(body)) != int.from_bytes(raw[len(raw) - 4:], "little"):
            return self._reject_index("checksum mismatch")
        h = np.frombuffer(raw, dtype="<u8", count=9, offset=8)
        fsize, mtime, ztype_cb, nrec, nck, end = (int(v) for v in h[:6])
        if fsize != st.st_size or mtime != st.st_mtime_ns:
            return False                 # the file changed: rebuilt on the next full pass
        if ztype_cb != (self.ztype | (_CHUNK_BYTES << 8)) or int(h[6]) != _CHUNK_RECORDS:
            return self._reject_index("built for another compression or chunking")
        if len(raw) != _INDEX_HEAD + 24 * nck + 4:
            return self._reject_index("size disagrees with its chunk count")
        if (int(h[7]), int(h[8])) != self._fingerprint():
            return self._reject_index("built over other contents (same size and mtime)")
        table = np.frombuffer(raw, dtype="<i8", count=3 * nck, offset=_INDEX_HEAD).reshape(nck, 3)
        # structure: chunk 0 at 0, offsets increasing with room for 16 bytes per
        # record, the last ending at the stream's end (the file's, uncompressed)
        if self.ztype == 0 and end != self.fsize:
            return self._reject_index(f"its stream ends at {end}, the file at {self.fsize}")
        total = 0
        for i in range(nck):
            pos, first, cnt = int(table[i, 0]), int(table[i, 1]), int(table[i, 2])
            nxt = int(table[i + 1, 0]) if i + 1 < nck else end
            if (first != total or cnt <= 0 or cnt > _CHUNK_RECORDS or (i == 0 and pos != 0)
                    or pos < 0 or nxt - pos < 16 * cnt):
                return self._reject_index(f"chunk {i} (offset {pos}, {cnt} records) disagrees "
                                          f"with the chunk layout")
            total += cnt
        if total != nrec or (nck == 0 and end != 0):
            return self._reject_index(f"record count {nrec} disagrees with its chunks ({total})")
        self._grow_table(nck + 1)
        for i in range(nck):
            self.ck_pos[i] = table[i, 0]
            self.ck_first[i] = table[i, 1]
            self.ck_n[i] = table[i, 2]
        self.nck = nck
        self.total_records = nrec
        self.stream_end = end
        self.complete = True
        self.index_written = True
        return True

    def _index_bytes(self):
        n = self.nck
        table = np.empty((n, 3), dtype="<i8")
        cdef int64_t i
        for i in range(n):
            table[i, 0] = self.ck_pos[i]
            table[i, 1] = self.ck_first[i]
            table[i, 2] = self.ck_n[i]
        head_crc, tail_crc = self._fingerprint()
        # the stat taken when the file was opened: the index covers what was read then
        head = INDEX_MAGIC + np.array([self._stat[0], self._stat[1], self.ztype | (_CHUNK_BYTES << 8),
                                       self.total_records, n, self.stream_end, _CHUNK_RECORDS,
                                       head_crc, tail_crc], dtype="<u8").tobytes()
        body = head + table.tobytes()
        return body + int(rl_crc32c(0, <const char *>body, len(body))).to_bytes(4, "little")

    def _write_index(self, path=None):
        """Write the sidecar index (atomically); False if the directory is read-only."""
        path = path or self.index_path
        if path is None or not self.complete or self.fd < 0:
            return False
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self._stat:
            return False                 # the file changed while it was read: no index of a mix
        data = self._index_bytes()
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self.index_written = True
        return True

    cdef int _finish_table(self, int64_t end) except -1:
        """The scan reached the end of the stream at `end`: the table is complete."""
        self.complete = True
        self.stream_end = end
        if self.index_path is not None and not self.index_written:
            self._write_index()
        return 0

    # -- compressed stream (no GIL) --------------------------------------------
    cdef int _zrestart(self) noexcept nogil:
        if self.zs_init:
            inflateEnd(&self.zs)
            self.zs_init = False
        memset_zs(&self.zs)
        if inflateInit2(&self.zs, 15 if self.ztype == 1 else 31) != Z_OK:
            self.err_code = E_NOMEM
            return -1
        self.zs_init = True
        self.zin_off = 0
        self.zin_len = 0
        self.zs.next_in = <const unsigned char *>self.zin
        self.zs.avail_in = 0
        self.zs_eof = False
        self.dlo = 0
        self.dhi = 0
        self.spos = 0
        return 0

    cdef int64_t _zavail(self, int64_t need) noexcept nogil:
        """Make `need` bytes past dlo available if the stream has them.

        Returns the bytes available past dlo, or -1 (err_code set)."""
        cdef int64_t consumed, cap, got
        cdef char *p
        cdef int r
        while self.dhi - self.dlo < need and not self.zs_eof:
            if self.dlo > 0:
                memmove(self.dbuf, self.dbuf + self.dlo, self.dhi - self.dlo)
                self.dhi -= self.dlo
                self.dlo = 0
            if need > self.dcap or self.dhi == self.dcap:
                cap = self.dcap * 2
                if cap < need:
                    cap = need
                if cap < (1 << 20):
                    cap = 1 << 20
                p = <char *>realloc(self.dbuf, cap)
                if p == NULL:
                    self.err_code = E_NOMEM
                    return -1
                self.dbuf = p
                self.dcap = cap
            if self.zs.avail_in == 0:
                consumed = self._zconsumed()
                if consumed >= self.fsize:
                    self.err_code = E_ZTRUNC
                    self.err_off = self.fsize
                    return -1
                got = rl_pread_full(self.fd, self.zin, min64(self.fsize - consumed, _ZIN), consumed)
                if got <= 0:
                    self._read_failed(got, consumed)
                    return -1
                self.zin_off = consumed
                self.zin_len = got
                self.zs.next_in = <const unsigned char *>self.zin
                self.zs.avail_in = <unsigned int>got
            self.zs.next_out = <unsigned char *>self.dbuf + self.dhi
            self.zs.avail_out = <unsigned int>min64(self.dcap - self.dhi, 1 << 30)
            r = inflate(&self.zs, Z_NO_FLUSH)
            self.dhi = <char *>self.zs.next_out - self.dbuf
            if r == Z_STREAM_END:
                consumed = self._zconsumed()
                if consumed < self.fsize:
                    inflateReset(&self.zs)          # another gzip member follows
                else:
                    self.zs_eof = True
            elif r == Z_BUF_ERROR:
                consumed = self._zconsumed()
                if consumed >= self.fsize and self.zs.avail_in == 0:
                    self.err_code = E_ZTRUNC
                    self.err_off = self.fsize
                    return -1
            elif r != Z_OK:
                self.err_code = E_NOMEM if r == Z_MEM_ERROR else E_ZDATA
                self.err_off = self._zconsumed()
                return -1
        return self.dhi - self.dlo

    cdef inline int64_t _zconsumed(self) noexcept nogil:
        """File offset of the next compressed byte inflate will take."""
        return self.zin_off + (<const char *>self.zs.next_in - self.zin)

    cdef bint _cut_short(self, int64_t want_n, int64_t i) noexcept nogil:
        """A greedy scan that reaches a truncated record (a killed or failing
        writer, a file cut short) ends its chunk at the last complete record:
        those are handed out, and the next scan, starting at the cut, raises
        (TensorFlow's order: every complete record, then DataLoss)."""
        if want_n < 0 and i > 0 and (self.err_code == E_OK or self.err_code == E_ZTRUNC
                                     or self.err_code == E_SHRUNK):
            self.err_code = E_OK
            return True
        return False

    cdef int _read_failed(self, int64_t got, int64_t off) noexcept nogil:
        # a short read: the file shrank after open (what was read is as it was)
        if got < 0:
            self.err_errno = errno
            self.err_code = E_IO
            self.err_off = off
        else:
            self.err_code = E_SHRUNK
            self.err_off = off + got
        return -1

    cdef int _pgrow(self, int64_t cap) noexcept nogil:
        """The chunk block `pblk` replaced by one of `cap` bytes holding its
        `phave` bytes read so far; -1 (E_NOMEM) when none can be had."""
        cdef rl_block *nb = rl_fileblock_new(0, cap, 0)
        if nb == NULL:
            self.err_code = E_NOMEM
            return -1
        if self.pblk != NULL:
            if self.phave:
                memcpy(nb.data, self.pblk.data, self.phave)
            rl_block_decref(self.pblk)
        self.pblk = nb
        self.pcap = cap
        return 0

    cdef int _pfill(self, int64_t pos, int64_t need) noexcept nogil:
        """Make the chunk block `pblk` hold at least `need` file bytes from `pos`
        (need <= fsize - pos).  The first read takes the whole chunk when its
        extent is known, else up to CHUNK_BYTES; later ones exactly what is
        missing (the tail of the record that crosses CHUNK_BYTES)."""
        cdef int64_t target, cap, got
        if need <= self.phave:
            return 0
        target = need
        if self.phave == 0:
            target = min64(self.fsize - pos, self.pextent if self.pextent >= need else (
                need if need > _CHUNK_BYTES else _CHUNK_BYTES))
        if target > self.pcap:
            cap = target if self.phave == 0 else min64(self.fsize - pos, target if target > 2 * self.pcap
                                                       else 2 * self.pcap)
            if self._pgrow(cap) != 0:
                return -1
        got = rl_pread_full(self.fd, self.pblk.data + self.phave, target - self.phave, pos + self.phave)
        if got < 0 or self.phave + got < need:
            return self._read_failed(got, pos + self.phave)
        self.phave += got
        return 0

    cdef const char *_phdr(self, int64_t off) noexcept nogil:
        """The 12 header bytes at file offset off (index scans of uncompressed
        files read headers only, through a 1 MiB window); NULL on error."""
        cdef int64_t got
        if off >= self.hwin_off and off + 12 <= self.hwin_off + self.hwin_len:
            return self.hwin + (off - self.hwin_off)
        if self.hwin == NULL:
            self.hwin = <char *>malloc(_CHUNK_BYTES)
            if self.hwin == NULL:
                self.err_code = E_NOMEM
                return NULL
        got = rl_pread_full(self.fd, self.hwin, min64(_CHUNK_BYTES, self.fsize - off), off)
        if got < 12:
            self.hwin_len = 0
            self._read_failed(got, off)
            return NULL
        self.hwin_off = off
        self.hwin_len = got
        return self.hwin

    cdef const char *_dget(self, int64_t pos, int64_t rel, int64_t n, int64_t ahead) noexcept nogil:
        """A deferring scan's bytes [rel, rel + n) of the chunk at `pos`
        (n <= fsize - pos - rel, checked by the caller), contiguous in `pblk`;
        NULL on error.  A miss reads one window into `pblk`, appended to what
        the chunk read so far: `ahead` bytes when > 0 (a deferred record's
        data CRC and the next header), else a window of `w_next` bytes, up
        to the chunk's end.  `w_next` doubles with each window and goes back
        to 4 KiB at every big record, across chunks: a file of small records
        is read a chunk at a time after its first chunk (9 reads), and a big
        record's data is read at most a window's worth here.  Returns a pointer that a
        later call may move (the block grows): offsets are what is kept."""
        cdef int64_t L, lim, cap, got
        if rel >= self.w_lo and rel + n <= self.w_hi:
            return self.pblk.data + self.w_blk + (rel - self.w_lo)
        lim = self.pextent if self.pextent >= 0 else _CHUNK_BYTES
        if ahead > 0:
            L = ahead
        else:
            L = min64(self.w_next, lim - rel)
            self.w_next = min64(2 * self.w_next, _CHUNK_BYTES)
        L = min64(L if L > n else n, self.fsize - pos - rel)
        if self.pblk == NULL or self.phave + L > self.pcap:
            cap = self.phave + L
            if self.phave == 0:
                cap = max64(cap, min64(lim, self.fsize - pos) + 4096)    # one block for a chunk, usually
            else:
                cap = max64(cap, 2 * self.pcap)
            if self._pgrow(cap) != 0:
                return NULL
        got = rl_pread_full(self.fd, self.pblk.data + self.phave, L, pos + rel)
        if got < n:
            self._read_failed(got, pos + rel)
            return NULL
        self.w_lo = rel
        self.w_hi = rel + got
        self.w_blk = self.phave
        self.phave += got
        return self.pblk.data + self.w_blk

    cdef int _zseek(self, int64_t pos) noexcept nogil:
        """Position the decompressed stream at `pos` (restarting if behind)."""
        cdef int64_t k, a
        if not self.zs_init or pos < self.spos:
            if self._zrestart() != 0:
                return -1
        while self.spos < pos:
            a = self._zavail(1)
            if a < 0:
                return -1
            if a == 0:
                self.err_code = E_TRUNC
                self.err_off = self.spos
                return -1
            k = min64(a, pos - self.spos)
            self.dlo += k
            self.spos += k
        return 0

    # -- chunk scan (no GIL) -------------------------------------------------------
    cdef int _scan(self, int64_t pos, int64_t want_n, bint build) noexcept nogil:
        """Scan records from stream offset `pos`.

        want_n >= 0: exactly that many records (a known chunk), which must fill
        exactly `pextent` bytes when that is >= 0 (the table's word for the
        chunk: a stale or crafted index fails here, E_INDEX); else greedily,
        one chunk's worth (CHUNK_BYTES / CHUNK_RECORDS), stopping at the end.
        build: verify data CRCs and sizes and make `cur` the chunk's block;
        otherwise only the lengths are checked (index scan).  Returns 0 or -1
        with err_code/err_off set; `scan_n`/`scan_bytes` tell what was read.
        Uncompressed bytes come from pread into `pblk` (build) or the header
        window (index scan): what is checked is what is handed out.
        """
        cdef int64_t rel = 0, i = 0, avail, length, need, total, k
        cdef const char *cb = NULL
        cdef const char *p
        cdef const char *src
        cdef rl_block *blk
        cdef char *dst
        cdef bint z = self.ztype != 0
        cdef uint32_t crc
        # deferring (a negotiated batch pulls, uncompressed): big records not
        # in the window are not read, only their headers and data CRCs
        cdef bint defer = build and not z and self.defer_scan
        cdef int64_t ndef = 0
        cdef rl_dchunk *dc = NULL
        self.defer_scan = False
        self.err_code = E_OK
        self.phave = 0
        self.w_lo = self.w_hi = self.w_blk = 0
        if z and self._zseek(pos) != 0:
            return -1
        while True:
            if want_n >= 0:
                if i == want_n:
                    break
            elif i > 0 and (rel >= _CHUNK_BYTES or i == _CHUNK_RECORDS):
                break
            if z:
                avail = self._zavail(rel + 12)
                if avail < 0:
                    if self._cut_short(want_n, i):
                        break
                    return -1
                cb = self.dbuf + self.dlo
            else:
                avail = self.fsize - pos
            if avail == rel:
                if want_n >= 0:
                    self.err_code = E_INDEX
                    self.err_off = pos + rel
                    return -1
                break
            if avail < rel + 12:
                if self._cut_short(want_n, i):
                    break
                self.err_code = E_TRUNC
                self.err_off = pos + rel
                return -1
            if z:
                p = cb + rel
            elif defer:
                p = self._dget(pos, rel, 12, 0)
                if p == NULL:
                    if self._cut_short(want_n, i):
                        break
                    return -1
            elif build:
                if self._pfill(pos, rel + 12) != 0:
                    if self._cut_short(want_n, i):
                        break
                    return -1
                p = self.pblk.data + rel
            else:
                p = self._phdr(pos + rel)
                if p == NULL:
                    return -1
            length = <int64_t>rl_load_u64(p)
            if rl_crc32c_mask(rl_crc32c(0, p, 8)) != rl_load_u32(p + 8):
                if want_n < 0 and i > 0:
                    break                # (a greedy scan: the records before it come out first)
                self.err_code = E_LEN_CRC
                self.err_off = pos + rel
                return -1
            if rl_load_u64(p) > (<uint64_t>1 << 40):      # 1 TiB: larger is corruption
                if want_n < 0 and i > 0:
                    break
                self.err_code = E_LENGTH
                self.err_off = pos + rel
                self.err_val = length
                return -1
            need = rel + 16 + length
            if z:
                avail = self._zavail(need)
                if avail < 0:
                    if self._cut_short(want_n, i):
                        break
                    return -1
                cb = self.dbuf + self.dlo
            if avail < need:
                if self._cut_short(want_n, i):
                    break
                self.err_code = E_TRUNC
                self.err_off = pos + rel
                return -1
            if build:
                if defer:
                    if length >= RL_CONSUMED_MIN:
                        self.w_next = _WIN0           # big records here: small windows again
                    if length >= RL_CONSUMED_MIN and not (rel + 12 >= self.w_lo and need <= self.w_hi):
                        # deferred: its data CRC (and the next header, 16 bytes in all)
                        p = self._dget(pos, need - 4, 4, 16)
                        if p == NULL:
                            if self._cut_short(want_n, i):
                                break
                            return -1
                        self.cur_off[i] = -1 - (pos + rel + 12)       # < 0: a file offset
                        self.cur_crc[i] = rl_crc32c_unmask(rl_load_u32(p))
                        ndef += 1
                    else:
                        p = self._dget(pos, rel + 12, length + 4, 0)
                        if p == NULL:
                            if self._cut_short(want_n, i):
                                break
                            return -1
                        self.cur_off[i] = p - self.pblk.data
                        self.cur_foff[i] = pos + rel + 12
                elif not z:
                    if self._pfill(pos, need) != 0:
                        if self._cut_short(want_n, i):
                            break
                        return -1
                # data CRCs are checked next to the copy that follows (below, in
                # c_next for zero-copy records, in the batch for deferred ones),
                # while the record is in cache
                if (self.lod_mode and length % self.row_bytes != 0) or (
                        not self.lod_mode and length != self.fixed_size):
                    self.err_code = E_SIZE
                    self.err_off = pos + rel
                    self.err_val = length
                    return -1
                if not defer:
                    self.cur_off[i] = rel + 12
                self.cur_len[i] = length
            rel = need
            i += 1
        if want_n >= 0 and self.pextent >= 0 and rel != self.pextent:
            # the table's chunk ends elsewhere: the index does not describe this file
            self.err_code = E_INDEX
            self.err_off = pos + rel
            return -1
        self.scan_n = i
        self.scan_bytes = rel
        if not build:
            if z:
                self.dlo += rel
                self.spos += rel
            return 0
        # the chunk's block
        if not z and self.pblk == NULL:          # no records (the end of the file)
            self.pblk = rl_fileblock_new(0, 0, 0)
            if self.pblk == NULL:
                self.err_code = E_NOMEM
                return -1
            self.pcap = 0
        if not z:
            cb = self.pblk.data
        if ndef:
            dc = rl_dchunk_new(self.dmap, NULL, NULL)
            if dc == NULL:
                self.err_code = E_NOMEM
                return -1
        if not z and not (self.lod_mode and self.prefix):
            blk = self.pblk                 # owned bytes, handed out as they are
            blk.size = self.phave if defer else rel
            self.pblk = NULL
            self.pcap = self.phave = 0
        else:
            total = 0
            for k in range(i):
                total += self.cur_len[k]
            if self.lod_mode and self.prefix:
                total += 8 * i
            blk = self._take_spare(total)
            if blk == NULL:
                blk = rl_block_new(total)
                if blk == NULL:
                    self.err_code = E_NOMEM
                    return -1
            dst = blk.data
            for k in range(i):
                length = self.cur_len[k]
                src = cb + self.cur_off[k]
                if rl_crc32c_mask(rl_crc32c(0, src, length)) != rl_load_u32(src + length):
                    rl_block_decref(blk)
                    self.err_code = E_DATA_CRC
                    self.err_off = pos + self.cur_off[k] - 12
                    return -1
                self.cur_off[k] = dst - blk.data
                if self.lod_mode and self.prefix:   # the instance encoding: int64 rows, then rows
                    rl_store_i64(dst, length // self.row_bytes)
                    dst += 8
                    self.cur_len[k] = length + 8
                memcpy(dst, src, length)
                dst += length
            if z:
                self.dlo += rel
                self.spos += rel
        self._retire_cur()
        self.cur_deferring = defer
        self.dchunk = dc
        self.cur = blk
        self.cur_is_heap = z or (self.lod_mode and self.prefix)
        self.cur_is_view = not self.cur_is_heap
        self.cur_n = i
        self.cur_i = 0
        return 0

    cdef int _raise(self, lost=None) except -1:
        """Raise the error err_code/err_off describe.  `lost`: what of the
        chunk reading on will not give (the rest of it, or all of it): then the
        epoch's position no longer adds up (set_state steps over chunks by the
        table's counts), and get_state refuses until the next epoch (ReaderBase._dropped)."""
        try:
            self._raise_error()
        except BaseException as e:
            if lost is not None:
                self._dropped = f"{e}: {lost}"
            raise

    def _raise_error(self):
        off = self.err_off
        code = self.err_code
        where = " of the uncompressed stream" if self.ztype else ""
        if code == E_NOMEM:
            raise MemoryError(f"{self.path}: out of memory reading a chunk at {off}")
        if code == E_SIZE:
            f = self.schema[0]
            if self.lod_mode:
                need = f"a multiple of {self.row_bytes} bytes (rows of {f.dtype}{list(f.shape)})"
            else:
                need = f"{self.fixed_size} bytes ({f.dtype}{list(f.shape)})"
            raise RecordSchemaError(f"{self.path}: record at {off}{where} has {self.err_val} bytes; "
                                    f"field {f.name!r} needs {need}", self.path, off, None, f.name)
        msgs = {
            E_TRUNC: f"truncated record at {off}",
            E_LEN_CRC: f"corrupted record at {off} (length checksum mismatch)",
            E_DATA_CRC: f"corrupted record at {off} (data checksum mismatch)",
            E_LENGTH: f"corrupted record at {off} (length {self.err_val} out of range)",
            E_ZDATA: f"corrupted record at {self.spos}{where} (invalid {self.compression} data near "
                     f"byte offset {off} of the file)",
            E_ZTRUNC: f"truncated record at {self.spos}{where} (the {self.compression} stream ends "
                      f"early, at byte offset {off} of the file)",
            E_INDEX: f"record layout at {off} disagrees with the chunk table (the file changed "
                     f"after it was indexed, or the index {self.index_path!r} is stale or corrupt: "
                     f"delete it or pass index=False)",
            E_SHRUNK: f"truncated record at {off} (the file is shorter than when it was opened: "
                      f"truncated while being read?)",
            E_IO: f"read error at byte offset {off} ({os.strerror(self.err_errno)})",
        }
        msg = msgs.get(code, f"record error {code} at {off}")
        if code not in (E_ZDATA, E_ZTRUNC, E_SHRUNK, E_IO) and where:
            msg += where
        raise TFRecordError(f"{self.path}: {msg}", self.path, off)

    # -- reading ---------------------------------------------------------------
    cdef int _next_chunk(self) except -1 nogil:
        """Load the next chunk of the order; 0 at the end."""
        cdef int64_t k, pos, r
        if self.selected:
            if self.iorder >= self.norder:
                return 0
            k = self.order[self.iorder]
        else:
            k = self.iorder
            if k >= self.nck:
                if self.complete or self.scan_stopped:
                    return 0
                pos = 0 if self.nck == 0 else self.ck_pos[self.nck - 1] + self.scan_end_of(self.nck - 1)
                self.pextent = -1
                self.defer_scan = self._may_defer()
                r = self._scan(pos, -1, True)
                if r != 0:
                    if self.err_code == E_NOMEM:
                        with gil:
                            self._raise()          # (nothing lost: a retry scans again)
                    # Past the chunk table nothing after a failed scan can be
                    # located (a bad length hides where the next record starts):
                    # the error is raised once and the file is over for this
                    # epoch (as tf.data's TFRecordDataset goes on to its next
                    # file); reset() scans here again, and raises again.
                    self.scan_stopped = True
                    with gil:
                        self._raise(f"the rest of the file was not read (nothing after it can be "
                                    f"located without a chunk table: build the index)")
                if self.scan_n == 0:
                    self._release_cur()
                    self.cur_n = 0
                    with gil:
                        self._finish_table(pos)
                    return 0
                with gil:
                    self._append_chunk(pos, self.scan_n, self.scan_bytes)
                self.iorder += 1
                self.cur_chunk = k
                return 1
        # the table says where chunk k ends: the records must fill exactly that
        if k + 1 < self.nck:
            self.pextent = self.ck_pos[k + 1] - self.ck_pos[k]
        else:
            self.pextent = (self.stream_end if self.complete else self.ck_pos[k] + self.last_bytes) - self.ck_pos[k]
        self.defer_scan = self._may_defer()
        if self._scan(self.ck_pos[k], self.ck_n[k], True) != 0:
            # the table says where the next chunk starts: reading on goes on
            # there (the chunk's records are gone), as RecordIO's does
            self.iorder += 1
            with gil:
                self._raise(f"chunk {k} was not read")
        self.iorder += 1
        self.cur_chunk = k
        return 1

    cdef inline bint _may_defer(self) noexcept nogil:
        # a chunk loaded during a pull of the negotiated batch defers its big records
        return (self.dmap != NULL and rl_map_defers(self.dmap) and self.ztype == 0 and self.cur_crc != NULL
                and not (self.lod_mode and self.prefix))

    cdef int64_t scan_end_of(self, int64_t k) noexcept nogil:
        # bytes of chunk k: up to the next chunk, or the last scan's length
        if k + 1 < self.nck:
            return self.ck_pos[k + 1] - self.ck_pos[k]
        return self.last_bytes

    cdef int _append_chunk(self, int64_t pos, int64_t n, int64_t nbytes) except -1:
        self._grow_table(self.nck + 1)
        self.ck_pos[self.nck] = pos
        self.ck_first[self.nck] = self.total_records
        self.ck_n[self.nck] = n
        self.nck += 1
        self.total_records += n
        self.last_bytes = nbytes
        return 0

    cdef int c_next(self, rl_record *out) except -1 nogil:
        if self.dlast != NULL:
            # the producer's reference to the last record goes now (a consumer
            # that keeps a record past this call took its own)
            rl_block_decref(self.dlast)
            self.dlast = NULL
        while self.cur_i >= self.cur_n:
            if self._next_chunk() == 0:
                return 0
        if self.cur_off[self.cur_i] < 0:
            return self._next_big(out)
        out.block = self.cur
        out.data = self.cur.data + self.cur_off[self.cur_i]
        out.size = self.cur_len[self.cur_i]
        if self.cur_is_view and rl_crc32c_mask(rl_crc32c(0, out.data, out.size)) != rl_load_u32(
                out.data + out.size):
            # zero-copy records are verified as they are handed out: the CRC pass
            # leaves the record in cache for the consumer's copy
            self.err_code = E_DATA_CRC
            if self.cur_deferring:             # (its small records sit in read windows)
                self.err_off = self.cur_foff[self.cur_i] - 12
            else:
                self.err_off = self.ck_pos[self.cur_chunk] + self.cur_off[self.cur_i] - 12
            self.cur_i = self.cur_n            # the rest of this chunk is not handed out
            with gil:
                self._raise(f"the rest of chunk {self.cur_chunk} was not read")
        self.cur_i += 1
        return 1

    cdef int _next_big(self, rl_record *out) except -1 nogil:
        """A big record the scan did not read: deferred, for a pull of the
        negotiated batch (which reads and checks it); else (the reader read
        directly, a shuffle's other consumer ...) read and checked here, in a
        block of its own.  A failure drops the rest of the chunk, as c_next does."""
        cdef int64_t i = self.cur_i, n = self.cur_len[i], foff = -1 - self.cur_off[i], got
        cdef rl_block *b
        if self.dmap != NULL and rl_map_defers(self.dmap) and self.dchunk != NULL:
            b = rl_deferred_new(self.dchunk, self.dmap.base + foff, n, self.cur_crc[i], self.cur_chunk, i)
            if b == NULL:
                with gil:
                    raise MemoryError(f"{self.path}: out of memory at the record at {foff - 12}")
            self._records_deferred += 1
        else:
            b = rl_block_new(n)
            if b == NULL:
                with gil:
                    raise MemoryError(f"{self.path}: out of memory reading the record at {foff - 12}")
            got = rl_pread_full(self.fd, b.data, n, foff)
            if got != n or rl_crc32c(0, b.data, n) != self.cur_crc[i]:
                rl_block_decref(b)
                if got != n:
                    self._read_failed(got, foff)
                else:
                    self.err_code = E_DATA_CRC
                    self.err_off = foff - 12
                self.cur_i = self.cur_n            # the rest of this chunk is not handed out
                with gil:
                    self._raise(f"the rest of chunk {self.cur_chunk} was not read")
        self.dlast = b
        out.block = b
        out.data = b.data
        out.size = n
        self.cur_i += 1
        return 1

    def _mapped_negotiate(self):
        """A BatchReader over this reader (through decorators that only move
        items) asks for deferred records: returns the address of the file's
        rl_map (pread mode: a descriptor of its own) with a reference for the
        caller, or 0 (no: deferral off, compressed, prefixed instances, closed)."""
        cdef rl_map *m
        if (not _deferred or self.ztype != 0 or (self.lod_mode and self.prefix) or self.fd < 0
                or self.fsize <= 0):
            return 0
        if self.cur_foff == NULL:            # one block: the offsets, then the CRCs
            self.cur_foff = <int64_t *>malloc(_CHUNK_RECORDS * (sizeof(int64_t) + sizeof(uint32_t)))
            if self.cur_foff == NULL:
                raise MemoryError()
            self.cur_crc = <uint32_t *>(self.cur_foff + _CHUNK_RECORDS)
        if self.dmap == NULL:
            try:
                fd = os.dup(self.fd)         # deferred records outlive the reader's descriptor
            except OSError:                  # out of descriptors (EMFILE): the reader's own path
                return 0
            path = self.path.encode("utf-8", "surrogateescape")
            m = rl_map_new(path, RL_MAP_PREAD_BASE, self.fsize, fd, RL_MAP_TFRECORD)
            if m == NULL:
                os.close(fd)
                raise MemoryError()
            m.budget = 1 << 62
            self.dmap = m
        rl_map_incref(self.dmap)             # the caller's
        return <size_t>self.dmap

    def _prefixed_instances(self):
        """Give sequence records with the int64 row-count prefix (one copy each)
        instead of bare; call before reading."""
        if self.lod_mode and not self.prefix:
            if self.cur != NULL or self._started:
                raise RuntimeError(f"{self.path}: _prefixed_instances() after reading started")
            self.prefix = True
            self.layout.bare = 0

    cdef int c_reset(self) except -1:
        self._release_cur()
        self.cur_n = 0
        self.cur_i = 0
        self.iorder = 0
        self.scan_stopped = False
        self._dropped = None
        return 0

    cdef int c_close(self) except -1:
        self._release_cur()                   # blocks still held downstream stay valid
        if self.spare != NULL:
            rl_block_decref(self.spare)
            self.spare = NULL
        self._release_file()
        if self.zs_init:
            inflateEnd(&self.zs)
            self.zs_init = False
        return 0

    # -- index, seeking, sharding -------------------------------------------------
    def _ensure_index(self):
        """Complete the chunk table by scanning the rest of the file (lengths only)."""
        self._check_open()
        cdef int64_t pos
        cdef int r
        while not self.complete:
            pos = 0 if self.nck == 0 else self.ck_pos[self.nck - 1] + self.scan_end_of(self.nck - 1)
            self.pextent = -1
            with nogil:
                r = self._scan(pos, -1, False)
            if r != 0:
                self._raise()
            if self.scan_n == 0:
                self._finish_table(pos)
            else:
                self._append_chunk(pos, self.scan_n, self.scan_bytes)
        return self

    @property
    def has_index(self):
        """True when the chunk table is complete (sidecar loaded or file scanned)."""
        return self.complete

    @property
    def num_records(self):
        """Records in the file (scans the file once when no index is known)."""
        self._ensure_index()
        return self.total_records

    @property
    def num_chunks(self):
        self._ensure_index()
        return self.nck

    def __len__(self):
        return self.num_records

    def chunk_table(self):
        """(offsets, record counts) of every chunk, as int64 arrays (builds the index)."""
        self._ensure_index()
        offs = np.empty(self.nck, np.int64)
        nrec = np.empty(self.nck, np.int64)
        cdef int64_t i
        for i in range(self.nck):
            offs[i] = self.ck_pos[i]
            nrec[i] = self.ck_n[i]
        return offs, nrec

    def select_chunks(self, chunks):
        """Read only these chunk indices, in this order (sharding, resume)."""
        self._ensure_index()
        sel = np.asarray(chunks, dtype=np.int64).reshape(-1)
        if sel.size and (sel.min() < 0 or sel.max() >= self.nck):
            raise IndexError(f"chunk indices must be in [0, {self.nck}), got {sel.tolist()[:8]}")
        cdef int64_t i
        free(self.order)
        self.order = <int64_t *>malloc(max(1, sel.shape[0]) * sizeof(int64_t))
        if self.order == NULL:
            raise MemoryError()
        for i in range(sel.shape[0]):
            self.order[i] = sel[i]
        self.norder = sel.shape[0]
        self.selected = True
        self.c_reset()
        return self

    def select_all(self):
        """Undo `select_chunks`: read every chunk in file order."""
        self.selected = False
        self.norder = 0
        self.c_reset()
        return self

    def write_index(self, path=None):
        """Scan if needed and write the sidecar index; returns its path."""
        self._ensure_index()
        path = path or self.index_path or (self.path + INDEX_SUFFIX)
        if not self._write_index(path):
            raise OSError(f"could not write the index {path!r}")
        return path

    def _describe(self):
        return {"file": dict(self._file_id), "compression": self.compression,
                "schema": self.schema.to_json()}

    def _reads_in_file_order(self):
        """True when record i of an epoch is record i of the file (no select_chunks)."""
        return not self.selected

    def _rebuild_with(self):
        return _reopen_tfrecord

    def _reduce_args(self):
        return (self.path,), {"schema": self.schema, "compression": self.compression,
                              "index": self.index_path if self.index_path is not None else False,
                              "prefixed": bool(self.prefix)}

    cdef int64_t c_skip(self, int64_t n) except -1 nogil:
        # Whole chunks the table knows are stepped over by their counts, not read
        # (set_state is O(chunks)); the current chunk and the target's are read.
        cdef int64_t done = 0, k
        cdef rl_record rec
        if n <= 0:
            return 0
        while done < n and self.cur_i < self.cur_n:
            self.c_next(&rec)
            done += 1
        while True:
            if self.selected:
                if self.iorder >= self.norder:
                    break
                k = self.order[self.iorder]
            else:
                k = self.iorder
                if k >= self.nck:
                    break
            if self.ck_n[k] > n - done:
                break
            done += self.ck_n[k]
            self.iorder += 1
        return done + ReaderBase.c_skip(self, n - done)

    def __repr__(self):
        comp = f", compression={self.compression!r}" if self.compression else ""
        n = f"{self.total_records} records in {self.nck} chunks" if self.complete else "not indexed yet"
        return f"TFRecordReader({self.path!r}{comp}, {n})"


cdef inline int64_t min64(int64_t a, int64_t b) noexcept nogil:
    return a if a < b else b


cdef inline int64_t max64(int64_t a, int64_t b) noexcept nogil:
    return a if a > b else b


cdef inline void memset_zs(z_stream *zs) noexcept nogil:
    zs.next_in = NULL
    zs.avail_in = 0
    zs.total_in = 0
    zs.next_out = NULL
    zs.avail_out = 0
    zs.total_out = 0
    zs.msg = NULL
    zs.zalloc = NULL
    zs.zfree = NULL
    zs.opaque = NULL


def build_index(path, compression=None, index_path=None):
    """Scan a TFRecord file and write its sidecar index (``readerlib index FILE``).

    Returns the index path.  Only record lengths (and their CRCs) are checked;
    data checksums are verified when records are read.
    """
    with TFRecordReader(path, compression=compression,
                        index=index_path if index_path is not None else "auto") as r:
        r._ensure_index()
        return r.write_index(index_path)


# ------------------------------------------------------------------- writer
cdef class TFRecordWriter(FileWriter):
    """Write a TFRecord file, byte-identical to `tf.io.TFRecordWriter`.

    Parameters
    ----------
    path : str or os.PathLike
    compression : {None, "ZLIB", "GZIP"}
    compression_level : int
        zlib level, -1 (zlib's default, TensorFlow's too) or 0..9.

    Examples
    --------
    >>> with TFRecordWriter("out.tfrecord") as w:
    ...     w.write(b"hello")
    ...     w.write(np.arange(4, dtype=np.float32))    # its raw bytes
    """
    cdef readonly str path
    cdef readonly object compression
    cdef readonly int64_t num_records
    cdef object _z
    cdef bytearray _buf
    cdef object _pending            # bytes made for the file but not yet written (a failed write)

    def __init__(self, path, compression=None, compression_level=-1):
        ztype = _compression_code(compression)
        if not isinstance(compression_level, int) or not -1 <= compression_level <= 9:
            raise ValueError(f"compression_level must be -1 or 0..9, got {compression_level!r}")
        self.compression = _ZNAMES[ztype]
        self.path = os.fspath(path)
        # TF's ZlibCompressionOptions: deflate, window 15 (+16 for gzip), memLevel 9
        self._z = (_pyzlib.compressobj(compression_level, _pyzlib.DEFLATED, 15 if ztype == 1 else 31, 9)
                   if ztype else None)
        self._buf = bytearray()
        self._f = _PieceFile(self.path)  # last: nothing after it can fail and leave it open
        self._closed = False

    def _gc_warning(self):
        return TFRecordWarning

    cdef int _append(self, const char *data, int64_t n) except -1:
        cdef char head[12]
        cdef char foot[4]
        if self._pending is not None or len(self._buf) + 16 + n > (1 << 20):
            self._drain()            # before this record: if the write fails, it was not taken
        with nogil:
            rl_store_u64(head, <uint64_t>n)
            rl_store_u32(head + 8, rl_crc32c_mask(rl_crc32c(0, head, 8)))
            rl_store_u32(foot, rl_crc32c_mask(rl_crc32c(0, data, n)))
        self._buf += (<char *>head)[:12]
        if n:
            self._buf += (<char *>data)[:n]
        self._buf += (<char *>foot)[:4]
        self.num_records += 1
        return 0

    cdef _drain(self):
        """Write the buffered records (compressed once: a failed write keeps the
        compressor's output in `_pending`, written again by the next try)."""
        if self._pending is None:
            if not self._buf:
                return
            self._pending = self._z.compress(self._buf) if self._z is not None else self._buf
            self._buf = bytearray()
        self._f.write(self._pending)
        self._pending = None

    def write(self, record):
        """Append one record: bytes-like, or an array (its raw bytes, C order)."""
        cdef const unsigned char[::1] v
        if isinstance(record, np.ndarray):
            record = np.ascontiguousarray(record).reshape(-1).view(np.uint8)
        elif isinstance(record, str):
            raise TypeError("a record is bytes-like (encode str first), got str")
        v = memoryview(record).cast("B")
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:                 # (FileWriter: writes from several threads)
            self._check_open()
            self._append(<const char *>&v[0] if v.shape[0] else <const char *>"", v.shape[0])

    def write_batch(self, records):
        """Append many records: the rows of a 2-D array, or an iterable of bytes-like."""
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:                 # (FileWriter: writes from several threads)
            self._write_batch(records)

    def _write_batch(self, records):
        self._check_open()
        cdef const unsigned char[:, ::1] m
        cdef int64_t i
        if isinstance(records, np.ndarray):
            a = np.ascontiguousarray(records)
            if a.ndim < 2:
                raise ValueError(f"write_batch: an array of records has rows (ndim >= 2), got shape {a.shape}")
            a = a.reshape(a.shape[0], -1)
            m = a.view(np.uint8)
            for i in range(m.shape[0]):
                self._append(<const char *>&m[i, 0] if m.shape[1] else <const char *>"", m.shape[1])
            return
        for r in records:
            self.write(r)

    def flush(self):
        """Push buffered records to the OS (a compressed stream is sync-flushed)."""
        self._check_process()           # (not in a forked child: before the lock)
        with self._lock:
            self._check_open()
            self._drain()
            if self._z is not None:
                self._pending = self._z.flush(_pyzlib.Z_SYNC_FLUSH)
                self._drain()

    def _finish(self):
        """Buffered records and the end of the compressed stream (close() calls this)."""
        self._drain()
        if self._z is not None:
            self._pending = self._z.flush(_pyzlib.Z_FINISH)
            self._z = None           # finished once; a retried close() writes what is pending
            self._drain()

    def __repr__(self):
        return f"TFRecordWriter({self.path!r}, {self.num_records} records)"
