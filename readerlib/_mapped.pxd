# The one-copy path's C API (include/rl_mapped.h: deferred records, the file
# "map" they describe, the batch's read of them), declared once for the
# modules that make, move or copy deferred records: formats/_recordio,
# formats/_tfrecord, readers/_batch, readers/_shuffle.  Declarations only:
# each of them still calls rl_mapped_import() at its init (the header's API
# pointer is one per module), and readerlib._core, which owns the process's
# state, includes the header itself (RL_MAPPED_OWNER).
from readerlib._typedefs cimport int64_t, uint32_t
from readerlib.readers._base cimport (
    ReaderBase, rl_block, rl_record, rl_layout, layout_parse, rl_block_decref, RL_MAX_FIELDS)

cdef extern from "rl_mapped.h":
    ctypedef struct rl_map:
        int64_t refcnt
        char *base
        int64_t len
        int pull
        int64_t dirty
        int64_t budget
        char *path
        int fd
        int keep
        int format
        rl_map *gate
        int64_t gated
    ctypedef struct rl_dblock:
        rl_map *map
        int pad
        int64_t chunk
        int64_t index
        uint32_t crc
    ctypedef struct rl_dchunk:
        pass
    ctypedef struct rl_mapped_api:
        void (*map_decref)(rl_map *m) noexcept nogil
        int64_t live
    rl_mapped_api *rl_mapped
    int rl_mapped_import() except -1
    char *RL_MAP_PREAD_BASE
    rl_map *rl_map_new(const char *path, char *base, int64_t len, int fd, int format) nogil

    # made by the file readers
    rl_dchunk *rl_dchunk_new(rl_map *m, const char *lo, const char *hi) nogil
    void rl_dchunk_done(rl_dchunk *c) nogil
    rl_block *rl_deferred_new(rl_dchunk *c, const char *data, int64_t size, uint32_t crc,
                              int64_t chunk, int64_t index) nogil
    void rl_map_incref(rl_map *m) nogil
    void rl_map_set_gate(rl_map *m, rl_map *g, int always) nogil
    bint rl_map_defers(const rl_map *m) nogil
    int rl_map_all_zero(rl_map *m, const char *p, int64_t n, int64_t *fault_off) nogil
    # moved and copied
    bint rl_record_is_deferred(const rl_record *r) nogil
    bint rl_deferred_may_go_out(const rl_record *r) nogil
    rl_block *rl_deferred_materialize(const rl_record *r, int *code, int64_t *off) nogil
    int rl_deferred_copy(const rl_record *r, int nf, char **dst, const int64_t *src_off,
                         const int64_t *len, int nt, int64_t *fault_off) nogil
    int rl_deferred_copy1(const rl_record *r, char *dst, int nt, int64_t *fault_off) nogil
    int rl_deferred_peek(const rl_record *r, int64_t at, char *dst, int64_t n, int64_t *fault_off) nogil
    void rl_map_copied(rl_map *m, const char *p, int64_t n) nogil
    # the batch's read of a record (A/B switches: per module, readers/_batch's count)
    int rl_stage_reads
    int rl_stage_nt

    int RL_DEF_OK, RL_DEF_MISMATCH, RL_DEF_SHRUNK, RL_DEF_NOMEM, RL_DEF_LAYOUT, RL_DEF_PADDING, RL_DEF_IO
    int RL_DEF_MAX_PIECES
    int RL_MAP_RECORDIO, RL_MAP_TFRECORD
    int RL_MAP_MAX_GATED


cdef inline rl_block *deferred_verified_copy(const rl_record *r, const rl_layout *L, int *code,
                                            int64_t *off) noexcept nogil:
    """A verified copy (refcount 1) of deferred record r, for a consumer other
    than the batch that negotiated it; NULL on failure, with *code (RL_DEF_*)
    and *off (the file offset) for formats/_recordio's _deferred_error_py.  A
    sequence schema's copy must also parse (RL_DEF_LAYOUT at the record's
    offset): the batch checks that itself, other consumers take it as read."""
    cdef const char *ptrs[RL_MAX_FIELDS]
    cdef int64_t rows[RL_MAX_FIELDS]
    cdef rl_block *nb = rl_deferred_materialize(r, code, off)
    if nb != NULL and L.n_lod and layout_parse(L, nb.data, nb.size, ptrs, rows) != 0:
        rl_block_decref(nb)
        code[0] = RL_DEF_LAYOUT
        off[0] = r.data - (<rl_dblock *>r.block).map.base
        return NULL
    return nb


cdef inline int hand_out_verified(ReaderBase reader, rl_record *out, rl_block **held) except -1 nogil:
    """For a reader that buffers deferred records (open_files' reader, the
    window shuffle): *out, one asked for by a consumer other than the batch
    that negotiated it, replaced by a verified copy that *held keeps until
    the next call (the previous one let go then), or its error (file,
    offset) raised (the record is then dropped, and `reader._dropped` says
    so: the caller's position no longer counts it, see ReaderBase)."""
    cdef int code
    cdef int64_t off
    cdef rl_block *nb = deferred_verified_copy(out, &reader.layout, &code, &off)
    if nb == NULL:
        with gil:
            from readerlib.formats._recordio import _deferred_error_py
            err = _deferred_error_py(<size_t>out.block, code, off,
                                     reader.schema if code == RL_DEF_LAYOUT else None)
            reader._dropped = str(err)
            raise err
    if held[0] != NULL:
        rl_block_decref(held[0])
    held[0] = nb
    out.block = nb
    out.data = nb.data
    out.size = nb.size
    return 0


cdef inline size_t gate_ref(rl_map **gate) except 0:
    """A reader that stands for many files (open_files' reader, a global
    shuffle's per-file caches) answers a batch's negotiation with a *gate*
    (rl_map_set_gate): made in *gate on first use, a map of no file.
    Returns its address with a reference for the caller."""
    if gate[0] == NULL:
        gate[0] = rl_map_new(b"open_files", NULL, 0, -1, RL_MAP_RECORDIO)
        if gate[0] == NULL:
            raise MemoryError()
    rl_map_incref(gate[0])
    return <size_t>gate[0]


cdef inline size_t gate_file(rl_map *gate, object reader, int always) except? 0:
    """`reader`'s map, gated by `gate` (rl_map_set_gate, `always` as there),
    with its negotiation's reference for the caller to let go; 0 when the
    reader declines, or RL_MAP_MAX_GATED maps are gated already."""
    cdef size_t addr = 0
    if gate.gated >= RL_MAP_MAX_GATED:
        return 0
    f = getattr(reader, "_mapped_negotiate", None)
    if f is not None:
        addr = f()
    if addr:
        rl_map_set_gate(<rl_map *>addr, gate, always)
    return addr
