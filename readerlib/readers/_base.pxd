# The C-level reader API: what other Cython code may `cimport` (a Cython
# reader of a new format cimports this one file).
#
# A chain moves `rl_record`s (block, data, size) between compiled readers
# without the GIL and without a Python object per record.  A record returned
# by `c_next` is *borrowed*: valid until the producer's next `c_next`,
# `c_reset` or `c_close`.  A consumer that keeps it longer takes a reference
# on `record.block` (`rl_block_incref`) and drops it when done.
#
# Two kinds of items flow: instances (one serialized instance, layout below)
# and batches (a block built by BatchReader).  Decorators that only move
# items (shuffle, multi_pass, holder) accept both.
#
# Instance encoding, fields in schema order, no padding:
#   lod_level 0: row_bytes bytes
#   lod_level 1: int64 n_rows (little endian), then n_rows * row_bytes bytes
# except for "bare" instances (rl_layout.bare): a schema of ONE lod_level-1
# field whose records are just the rows (n_rows = size / row_bytes), so a file
# format without a row-count prefix (TFRecord) can hand out pointers into the
# file.  A reader's `layout.bare` says which form its instances take; decorators
# inherit it from their source, and every consumer parses with layout_parse.
from readerlib._typedefs cimport int64_t, uint32_t, uint64_t

cdef extern from "rl_core.h":
    ctypedef struct rl_block:
        int64_t refcnt
        char *data
        int64_t size
        void *ctx
        int64_t aux
    ctypedef struct rl_record:
        rl_block *block
        const char *data
        int64_t size
    ctypedef struct rl_rng:
        uint64_t s[4]
    void rl_record_consumed(const rl_record *r) nogil
    void rl_block_incref(rl_block *b) nogil
    void rl_block_decref(rl_block *b) nogil
    rl_block *rl_block_new(int64_t size) nogil
    rl_block *rl_block_new_static(char *data, int64_t size) nogil
    void rl_copy_big(char *dst, const char *src, size_t n) nogil
    void rl_copy_fence() nogil
    # At module init, once, before any other rl_* call: points this module at
    # the process's one C core state (readerlib._core: CRC tables, block pool).
    int rl_core_import() except -1
    uint32_t rl_crc32c(uint32_t crc, const void *buf, size_t length) nogil
    uint32_t rl_crc32c_mask(uint32_t crc) nogil
    uint32_t rl_crc32c_unmask(uint32_t masked) nogil
    uint32_t rl_crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) nogil
    void rl_rng_seed(rl_rng *r, uint64_t seed, uint64_t stream) nogil
    uint64_t rl_rng_next(rl_rng *r) nogil
    uint64_t rl_rng_below(rl_rng *r, uint64_t n) nogil
    uint64_t rl_hash3(uint64_t seed, uint64_t a, uint64_t b) nogil
    uint32_t rl_load_u32(const char *p) nogil
    uint64_t rl_load_u64(const char *p) nogil
    int64_t rl_load_i64(const char *p) nogil
    void rl_store_u32(char *p, uint32_t v) nogil
    void rl_store_u64(char *p, uint64_t v) nogil
    void rl_store_i64(char *p, int64_t v) nogil

cdef enum:
    ITEM_INSTANCE = 0
    ITEM_BATCH = 1
    RL_MAX_FIELDS = 64

# The schema as compiled code sees it.
cdef struct rl_layout:
    int nfields
    int n_lod                     # fields with lod_level 1
    int64_t fixed_size            # encoded bytes when n_lod == 0, else -1
    int64_t row_bytes[RL_MAX_FIELDS]
    int lod[RL_MAX_FIELDS]
    int64_t fixed_offset[RL_MAX_FIELDS]   # byte offset of a field when n_lod == 0
    int bare                      # instances are the rows alone (see above)

# Column-major instances (ArrayReader, writers): field f of instance i is row i
# of ptr[f] (fixed) or rows off[f][i]:off[f][i+1] of ptr[f] (sequence).
cdef struct rl_columns:
    int n
    const char *ptr[RL_MAX_FIELDS]
    const int64_t *off[RL_MAX_FIELDS]

cdef int64_t columns_encoded_size(const rl_layout *L, const rl_columns *C, int64_t i) noexcept nogil
cdef int64_t columns_encode(const rl_layout *L, const rl_columns *C, int64_t i, char *out) noexcept nogil

cdef int layout_from_schema(rl_layout *L, object schema) except -1

# The owner (NumPy base object) of arrays that view a block: holds one reference.
cdef class BlockRef:
    cdef rl_block *block

cdef BlockRef block_ref(rl_block *b)

# A LoDTensor over arrays the caller built well formed (a batch block's views):
# no re-validation.
cdef object trusted_lod(object data, list lod)

# CRC-32C of a buffer; a large one is split over readerlib's worker threads.
from readerlib._core cimport crc32c_parallel

# Split an encoded instance into per-field (pointer, rows); -1 if malformed.
cdef int layout_parse(const rl_layout *L, const char *data, int64_t size,
                      const char **ptrs, int64_t *rows) noexcept nogil

# Python instance (tuple / dict / single array) -> a fresh block holding its
# encoding (refcount 1).  Raises ValueError/TypeError naming the field.
cdef rl_block *encode_instance(object schema, const rl_layout *L, object instance) except NULL


# What the readers of one chain share (every decorator joins its reader's):
# the lock that serialises their Python entry points, how many of them were
# closed, and the prefetchers whose thread reads them.
cdef class _Chain:
    cdef readonly object lock       # _thread.RLock
    cdef int64_t closed             # readers of the chain closed (or with a close pending)
    cdef list pumps                 # weakrefs to the chain's PrefetchReaders
    cdef int64_t version            # bumped when a prefetcher joins or a holder swaps its chain
    # The process's fork generation (_fork_gen in _base.pyx) when the lock was
    # last known to be free of dead threads' holds; -1 once found torn: the
    # process was forked while another thread was inside the chain (_fork_check).
    cdef int64_t fork_gen
    # True while an entry point that moves the chain (read_next, _skip,
    # read_many, reset, set_state) runs, under the lock: the same thread coming
    # back in (a map function, a PythonReader iterator or a signal handler
    # calling the chain it runs inside) is refused (ReaderBase._enter), and its
    # close() is left to that entry point (close_pending).
    cdef bint busy
    # A close() was left to the entry point holding the chain (one called from
    # inside it, or from another thread while it held the lock: a reader's
    # _close_pending); that entry point runs it as it returns (_deferred_closes).
    cdef bint close_pending


cdef class ReaderBase:
    cdef readonly object schema
    cdef readonly int item_kind
    cdef rl_layout layout
    cdef bint _closed
    cdef bint _started
    cdef bint _resuming             # set_state() positioned the chain mid-epoch
    cdef readonly int64_t _position  # items read_next() returned this epoch
    cdef object _epoch_snapshot     # per-reader epoch state at the epoch's start
    cdef object _lock               # serialises read_next/reset/close across threads: the chain's (_chain.lock)
    cdef _Chain _chain              # shared with every reader of the chain (see _Chain)
    cdef int64_t _free_at           # the chain's version at which no prefetcher's thread read
                                    # what this reader reads (_check_chain), or -1
    cdef int64_t _closed_ok         # the chain's `closed` count at which none below this reader was
    cdef bint _close_pending        # close() from another thread did not get the lock: the read holding it closes
    cdef object _restore_error      # why the last set_state() or reset() failed part-way (reads raise until reset/set_state), or None
    cdef object _reset_from         # the chain's epoch states before a reset() that raised part-way: the retry starts from them
    # Why a record this reader took this epoch was lost (a deferred record whose
    # verified copy failed its check: BatchReader's own copy, or hand_out_verified
    # in readerlib/_mapped.pxd), or None.  Reading on goes on after it, one record
    # more than the position says: get_state refuses (naming it) until this
    # reader's c_reset clears it.
    cdef object _dropped
    # An item c_next gave read_next whose hand-over raised (a KeyboardInterrupt in
    # the Python objects' making, a MemoryError): still borrowed (no c_next since),
    # not counted in _position; the next read_next hands it out.
    cdef rl_record _held
    cdef bint _has_held
    # 1: *out holds the next item; 0: end of the epoch; -1: exception set.
    cdef int c_next(self, rl_record *out) except -1 nogil
    # Restart the whole chain below (next epoch).
    cdef int c_reset(self) except -1
    cdef int c_close(self) except -1
    cdef int _set_schema(self, object schema, int item_kind) except -1
    # Called under _lock before an item is read: starts the epoch if it has not
    # started (snapshot of the chain's epoch state, position 0), or takes up a
    # set_state() position.  Every reading entry point calls it.
    cdef int _begin_read(self) except -1
    # Called under _lock by every entry point that uses the chain below this
    # reader: raises when a reader below was closed, or when a prefetcher's
    # thread reads this reader.  Two loads when neither can be.
    cdef int _check_chain(self) except -1
    # Called by every entry point *before* it takes _lock: in a forked child,
    # the first call frees a lock that a thread of the parent (which does not
    # exist here) held at the fork, and marks the chain torn; a torn chain
    # raises RuntimeError (unless may_raise is false: close()).  One compare
    # otherwise.
    cdef int _fork_check(self, bint may_raise=*) except -1
    # Under _lock: raises when the chain is busy (re-entered by this thread),
    # else marks it busy and returns it (the caller clears busy in a finally).
    cdef _Chain _enter(self, str what)
    cdef int _join_chain(self, ReaderBase up) except -1
    cdef int _move_chain(self, _Chain c) except -1
    cdef int _set_closed(self) except -1
    # Positioning and random access (readers/_random_access.pyx, docs/random_access.md).
    # Drop the next n items of the epoch, as n c_next calls would; returns how
    # many there were (fewer at the end).  Default: c_next n times.  Readers that
    # can move without reading override it, so set_state is O(1) over them.
    cdef int64_t c_skip(self, int64_t n) except -1 nogil
    # Records addressable by c_read_at (the whole source, whatever its selection
    # or position); -1: this reader has no random access.
    cdef int64_t c_num_records(self) except -2
    # *out = record `index` (0 <= index < c_num_records()), borrowed like c_next's
    # until the next c_read_at, c_reset or c_close; the sequential position is
    # unaffected.  Default: raises TypeError naming the reader type.
    cdef int c_read_at(self, int64_t index, rl_record *out) except -1 nogil
    cdef ReaderBase _random_access  # what c_read_at delegates to (a chunk cache), made on first use


cdef class FileReader(ReaderBase):
    pass


cdef class DecoratedReader(ReaderBase):
    cdef readonly ReaderBase reader      # the decorated (upstream) reader
