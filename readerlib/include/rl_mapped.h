/* rl_mapped.h -- big records in one copy: deferred records and the SIGBUS guard.
 *
 * Design:
 *   A RecordIO reader whose chain ends in a BatchReader (through decorators
 *   that only move items: shuffle, multi_pass, holder) maps the file
 *   read-only and, for version-2 uncompressed chunks of big records, hands
 *   out *deferred* records instead of pread-ing them: an rl_dblock whose
 *   data points into the mapping, with the record's expected CRC-32C (from
 *   the chunk's checked CRC table), its chunk and index.  The batch copies
 *   it into the batch with the fused CRC + copy (rl_crccopy.h), so each byte
 *   is read once, and compares the CRC of the bytes it stored: nothing
 *   unverified ever leaves the batch copy.  Every other consumer gets either
 *   pread records (the file reader hands out deferred records only while
 *   its map's `pull` flag is set, i.e. during a pull made by the negotiated
 *   batch) or, for a deferred record already buffered that reaches another
 *   consumer, a verified copy (rl_deferred_materialize).
 *
 *   Under open_files (readers/_multifile.pyx) the batch negotiates with the
 *   multi-file reader, whose map stands for no file: it is the *gate* of
 *   every file map its workers negotiate (rl_map_set_gate).  A gated file's
 *   reader defers in every load (its `pull` is 1 for good: the workers read
 *   ahead of the batch), and rl_deferred_may_go_out asks the gate's `pull`.
 *
 *   An uncompressed TFRecord reader under such a batch hands out deferred
 *   records too (pread mode only: rl_map.fd >= 0, format RL_MAP_TFRECORD):
 *   its scan reads and checks each big record's header and reads its data
 *   CRC, not its data; the expected CRC is the unmasked data CRC.
 *
 *   A file truncated while mapped makes an access past its new end raise
 *   SIGBUS.  Every read of a mapping is done inside a guard: a thread-local
 *   pointer (readerlib._core's, initial-exec TLS: no allocation in the
 *   handler) to an rl_guard on the copying function's stack, holding a
 *   sigjmp_buf (sigsetjmp(.., 0): no syscall) and the address range it
 *   covers.  readerlib._core installs one SIGBUS handler per process
 *   (SA_SIGINFO | SA_NODEFER) that jumps back to the guard when the fault is
 *   inside the armed range, and otherwise hands the signal to the previous
 *   handler (faulthandler's, or the default action).  rl_guard_ensure()
 *   (re)installs it on top of whatever handler is there now (called when a
 *   chain negotiates, and after fork).
 *
 * The state (TLS slot, handler, the deferred blocks' release function, whose
 * address identifies a deferred record) exists once per process, in
 * readerlib._core (RL_MAPPED_OWNER); other modules call rl_mapped_import()
 * at init.
 */
#ifndef READERLIB_RL_MAPPED_H
#define READERLIB_RL_MAPPED_H
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "rl_core.h"
#include "rl_crccopy.h"

/* One mapping of a file, shared by the reader and every deferred record. */
typedef struct rl_map {
    int64_t refcnt;
    char *base;
    int64_t len;
    int pull;                   /* 1 while the negotiated batch pulls: deferred records may go out */
    int64_t dirty;              /* bytes copied since the last page drop */
    int64_t budget;             /* drop the copied records' pages once `dirty` passes it */
    uintptr_t *ranges;          /* [lo, hi) pairs of the records copied since (RL_MAP_RANGES) */
    int nranges;
    char *path;                 /* for error messages (UTF-8, owned) */
    int fd;                     /* >= 0: no mapping; records are read (pread) straight into
                                   the batch (base is then the file offset 0, never dereferenced) */
    int64_t off0;
    int keep;                   /* 1: no page drops; the pages stay mapped until the map goes
                                   (low_memory=False: no refaults, the file's pages count in RSS) */
    int format;                 /* whose file: RL_MAP_RECORDIO (0, calloc's) or RL_MAP_TFRECORD;
                                   says whose error a deferred record that fails raises */
    struct rl_map *gate;        /* NULL, or the map whose `pull` says whether this map's deferred
                                   records may go out (one reference): a file read ahead by a
                                   worker of open_files, whose reader defers in every load
                                   (`pull` 1 for good) while the multi-file reader's own map
                                   (the one its batch negotiated and sets) says who pulls now */
    int64_t gated;              /* a gate: the maps it gates that are still alive (atomic) */
} rl_map;

#define RL_MAP_RECORDIO 0
#define RL_MAP_TFRECORD 1

/* The base of a pread-mode map: never dereferenced (deferred records' data
 * pointers are base + file offset, and only the offsets are used). */
#define RL_MAP_PREAD_BASE ((char *)((size_t)1 << 40))

/* A new map (one reference) of the file `path` of `len` bytes: `base` its
 * mapping and fd -1, or RL_MAP_PREAD_BASE and a descriptor the map owns
 * (closed, or the mapping unmapped, when the last reference goes: the
 * owner's map_decref).  NULL when out of memory (nothing taken over). */
static inline rl_map *rl_map_new(const char *path, char *base, int64_t len, int fd, int format) {
    size_t n = strlen(path) + 1;
    rl_map *m = (rl_map *)calloc(1, sizeof(rl_map));
    if (m) m->path = (char *)malloc(n);
    if (!m || !m->path) { free(m); return NULL; }
    memcpy(m->path, path, n);
    m->refcnt = 1;
    m->base = base;
    m->len = len;
    m->fd = fd;
    m->format = format;
    return m;
}

/* The deferred records of one chunk: when the last is released, the chunk's
 * pages leave this process (one madvise; its records' pages were faulted in
 * together, by fault-around, so dropping them together wastes none). */
typedef struct rl_dchunk {
    int64_t refcnt;
    rl_map *map;
    uintptr_t lo, hi;           /* the chunk's records */
} rl_dchunk;

/* A deferred record: b.data points into map, b.size bytes, b.ctx == its chunk. */
typedef struct rl_dblock {
    rl_block b;
    rl_map *map;
    int64_t chunk;
    int64_t index;              /* record index within its chunk */
    uint32_t crc;               /* expected CRC-32C (from the checked table) */
    int32_t pad;                /* bytes of padding before the record (page-aligned chunks) that
                                   the copy reads with the record and checks are zero (0: none,
                                   or checked by the reader) */
} rl_dblock;

typedef struct rl_guard {
    sigjmp_buf jb;
    uintptr_t lo, hi;           /* faults inside [lo, hi) are this guard's */
    volatile uintptr_t fault;   /* set by the handler */
    struct rl_guard *prev;
} rl_guard;

typedef struct {
    void (*deferred_release)(rl_block *b);
    rl_guard **(*guard_slot)(void);     /* this thread's slot */
    int (*guard_ensure)(void);          /* (re)install the handler: 0 or -1 (errno) */
    void (*map_decref)(rl_map *m);
    int64_t live;                       /* deferred records alive (a test hook: leaks) */
} rl_mapped_api;

#define RL_MAPPED_CAPSULE "readerlib._core._C_MAPPED"

#ifdef RL_MAPPED_OWNER
/* ---------------------------------------------------------- owner side */
static __thread rl_guard *rl_guard_cur __attribute__((tls_model("initial-exec")));
static rl_mapped_api rl_mapped_state;      /* defined below */
static struct sigaction rl_guard_prev_action;
static int rl_guard_installed = 0;

/* Set while a signal that is not ours is passed to the previous handler: a
   previous handler that re-raises into us (faulthandler restores the handler
   it saved -- ours, when it was enabled after readerlib -- and raises again)
   gets the default action, instead of a loop between the two handlers. */
static __thread int rl_guard_delegating __attribute__((tls_model("initial-exec")));

static rl_guard **rl_guard_slot_impl(void) { return &rl_guard_cur; }

static void rl_sigbus_handler(int sig, siginfo_t *si, void *uc) {
    rl_guard *g = rl_guard_cur;
    uintptr_t a = (uintptr_t)si->si_addr;
    if (g && a >= g->lo && a < g->hi) {
        g->fault = a;
        siglongjmp(g->jb, 1);
    }
    /* not ours: the previous handler's, as if we were not here */
    struct sigaction *p = &rl_guard_prev_action;
    if (!rl_guard_delegating) {
        if (p->sa_flags & SA_SIGINFO) {
            if (p->sa_sigaction) {
                rl_guard_delegating = 1;
                p->sa_sigaction(sig, si, uc);
                rl_guard_delegating = 0;
                return;
            }
        } else if (p->sa_handler == SIG_IGN) {
            if (si->si_code <= 0) return;      /* sent by kill(): ignored, as before */
        } else if (p->sa_handler != SIG_DFL) {
            rl_guard_delegating = 1;
            p->sa_handler(sig);
            rl_guard_delegating = 0;
            return;
        }
    }
    /* the default action (terminate, core): for a fault and for kill() alike */
    signal(sig, SIG_DFL);
    raise(sig);
}

static int rl_guard_ensure_impl(void) {
    struct sigaction cur, sa;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return -1;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == rl_sigbus_handler) return 0;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = rl_sigbus_handler;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &rl_guard_prev_action) != 0) return -1;
    rl_guard_installed = 1;
    return 0;
}

static void rl_map_decref_impl(rl_map *m) {
    if (m && __atomic_sub_fetch(&m->refcnt, 1, __ATOMIC_ACQ_REL) == 0) {
        rl_map *g = m->gate;
        if (m->fd >= 0) close(m->fd);
        else if (m->base && m->len > 0) munmap(m->base, (size_t)m->len);
        free(m->ranges);
        free(m->path);
        free(m);
        if (g) {
            __atomic_sub_fetch(&g->gated, 1, __ATOMIC_RELAXED);
            rl_map_decref_impl(g);
        }
    }
}

static void rl_drop_range(uintptr_t lo, uintptr_t hi) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    lo &= ~(page - 1);
    hi = (hi + page - 1) & ~(page - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);   /* file pages: they refault from the page cache */
}

static void rl_deferred_release_impl(rl_block *b) {
    rl_dchunk *c = (rl_dchunk *)b->ctx;
    __atomic_sub_fetch(&rl_mapped_state.live, 1, __ATOMIC_RELAXED);
    if (__atomic_sub_fetch(&c->refcnt, 1, __ATOMIC_ACQ_REL) == 0) {
        if (c->map->fd < 0 && !c->map->keep) rl_drop_range(c->lo, c->hi);
        rl_map_decref_impl(c->map);
        free(c);
    }
    free(b);
}

static rl_mapped_api rl_mapped_state = {
    rl_deferred_release_impl, rl_guard_slot_impl, rl_guard_ensure_impl, rl_map_decref_impl, 0};
static rl_mapped_api *rl_mapped = &rl_mapped_state;
#else
static rl_mapped_api *rl_mapped = NULL;
/* At module init, under the GIL: 0, or -1 with a Python exception set. */
static int rl_mapped_import(void) {
    if (rl_mapped) return 0;
    rl_mapped = (rl_mapped_api *)PyCapsule_Import(RL_MAPPED_CAPSULE, 0);
    return rl_mapped ? 0 : -1;
}
#endif

/* ---------------------------------------------------------- both sides */
static inline int rl_record_is_deferred(const rl_record *r) {
    return r->block != NULL && r->block->release == rl_mapped->deferred_release;
}

static inline int rl_deferred_may_go_out(const rl_record *r) {
    const rl_map *m = ((rl_dblock *)r->block)->map;
    if (m->gate) m = m->gate;
    return __atomic_load_n(&m->pull, __ATOMIC_RELAXED);
}

/* Whether m's reader hands out deferred records now: its own pull flag (the
 * negotiated batch pulls, or for good), or its gate's. */
static inline int rl_map_defers(const rl_map *m) {
    return m->pull || (m->gate && __atomic_load_n(&m->gate->pull, __ATOMIC_RELAXED));
}

static inline void rl_map_incref(rl_map *m) { __atomic_add_fetch(&m->refcnt, 1, __ATOMIC_RELAXED); }

/* The most maps one gate keeps gated at once (open_files' workers, a global
 * shuffle's chunk caches): each holds a descriptor (pread mode) while one of
 * its deferred records is out, and a buffer or window above can hold records
 * of many small files; files opened beyond it are read the ordinary way. */
#define RL_MAP_MAX_GATED 64

/* m's deferred records go out when g's pull says so (m takes a reference to
 * g); m's reader defers in every load from now on (`always`: a reader that
 * reads ahead of the batch, open_files' workers), or while g's pull is set
 * (a chunk cache under a global shuffle: it loads during the batch's pull).
 * Once, before m's reader hands out a record. */
static inline void rl_map_set_gate(rl_map *m, rl_map *g, int always) {
    rl_map_incref(g);
    __atomic_add_fetch(&g->gated, 1, __ATOMIC_RELAXED);
    m->gate = g;
    if (always) m->pull = 1;
}

/* The chunk of deferred records over [lo, hi) of m (one reference, for the
 * loader: rl_dchunk_done drops it; takes a map reference). */
static inline rl_dchunk *rl_dchunk_new(rl_map *m, const char *lo, const char *hi) {
    rl_dchunk *c = (rl_dchunk *)malloc(sizeof(rl_dchunk));
    if (!c) return NULL;
    c->refcnt = 1;
    c->map = m;
    c->lo = (uintptr_t)lo;
    c->hi = (uintptr_t)hi;
    rl_map_incref(m);
    return c;
}

/* The loader lets go of the chunk (its records hold it from here on). */
static inline void rl_dchunk_done(rl_dchunk *c) {
    if (__atomic_sub_fetch(&c->refcnt, 1, __ATOMIC_ACQ_REL) == 0) {
        rl_mapped->map_decref(c->map);
        free(c);
    }
}

/* A deferred record over [data, data + size) of chunk c's mapping (refcnt 1;
 * takes a chunk reference). */
static inline rl_block *rl_deferred_new(rl_dchunk *c, const char *data, int64_t size, uint32_t crc,
                                        int64_t chunk, int64_t index) {
    rl_dblock *d = (rl_dblock *)malloc(sizeof(rl_dblock));
    if (!d) return NULL;
    d->b.refcnt = 1;
    d->b.release = rl_mapped->deferred_release;
    d->b.consumed = NULL;
    d->b.data = (char *)data;
    d->b.size = size;
    d->b.ctx = c;
    d->b.aux = 0;
    d->map = c->map;
    d->chunk = chunk;
    d->index = index;
    d->crc = crc;
    d->pad = 0;
    __atomic_add_fetch(&c->refcnt, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&rl_mapped->live, 1, __ATOMIC_RELAXED);
    return &d->b;
}

static int rl_range_cmp(const void *a, const void *b) {
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

/* Drop the pages of the records copied since the last drop: sorted, runs
 * merged, one madvise per run.  Each range is widened to the 64 KiB windows
 * a fault maps at once (fault-around), so no page a copy faulted in stays. */
static void rl_map_drop_copied(rl_map *m) {
    int i, k = 0;
    if (m->nranges == 0) { m->dirty = 0; return; }
    qsort(m->ranges, (size_t)m->nranges, 2 * sizeof(uintptr_t), rl_range_cmp);
    uintptr_t lo = m->ranges[0], hi = m->ranges[1];
    for (i = 1; i < m->nranges; i++) {
        uintptr_t a = m->ranges[2 * i], z = m->ranges[2 * i + 1];
        if (a <= hi) { if (z > hi) hi = z; continue; }
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
        k++;
        lo = a; hi = z;
    }
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
    m->nranges = 0;
    m->dirty = 0;
}

#define RL_MAP_RANGES 4096
#define RL_MAP_WINDOW ((uintptr_t)65536)

/* The copies were made: count them against the map's budget, and drop their
 * pages once they pass it (rl_map_drop_copied).  Called by the consumer's
 * thread after its copies are done (never while another thread copies from
 * the same map: one chain reads one map at a time). */
static inline void rl_map_copied(rl_map *m, const char *p, int64_t n) {
    if (m->fd >= 0 || m->keep) return;
    uintptr_t a = (uintptr_t)p, z = a + (uintptr_t)n;
    uintptr_t base = (uintptr_t)m->base, end = base + (uintptr_t)m->len;
    if (!m->ranges) {
        m->ranges = (uintptr_t *)malloc(2 * RL_MAP_RANGES * sizeof(uintptr_t));
        if (!m->ranges) return;            /* no dropping: only more memory */
    }
    a = base + ((a - base) & ~(RL_MAP_WINDOW - 1));
    z = base + ((z - base + RL_MAP_WINDOW - 1) & ~(RL_MAP_WINDOW - 1));
    if (z > end) z = end;
    {
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        z = (z + page - 1) & ~(page - 1);
    }
    m->ranges[2 * m->nranges] = a;
    m->ranges[2 * m->nranges + 1] = z;
    m->nranges++;
    m->dirty += n;
    if (m->dirty >= m->budget || m->nranges == RL_MAP_RANGES) rl_map_drop_copied(m);
}

/* A guard over map m's range, not armed yet (the caller's sigsetjmp(g->jb, 0)
 * comes next, in the caller's own frame). */
static inline void rl_guard_init(rl_guard *g, const rl_map *m, rl_guard **slot) {
    g->lo = (uintptr_t)m->base;
    g->hi = g->lo + (uintptr_t)m->len;
    g->fault = 0;
    g->prev = *slot;
}

/* Arm: the guard is complete before the handler can see it, and the reads of
 * the mapping start only once it is armed (compiler barriers: the handler
 * runs on this thread, so no CPU fence is needed). */
static inline void rl_guard_arm(rl_guard **slot, rl_guard *g) {
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    *slot = g;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* Disarm: every read of the mapping is done before. */
static inline void rl_guard_disarm(rl_guard **slot, rl_guard *g) {
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    *slot = g->prev;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* Error codes of a guarded read. */
#define RL_DEF_OK 0
#define RL_DEF_MISMATCH 1
#define RL_DEF_SHRUNK 2
#define RL_DEF_NOMEM 3
#define RL_DEF_LAYOUT 4      /* the bytes (CRC good) do not fit the schema, or not the sizes the
                                batch took from them (a sequence record rewritten meanwhile) */
#define RL_DEF_PADDING 5     /* the padding before the record is not zero */
#define RL_DEF_IO 1000       /* + errno: pread/preadv failed (EIO, ...), not a short read */

static const char rl_zero_page[4096];
/* 1 if the n (< 4096) bytes at p are zero */
static inline int rl_pad_is_zero(const char *p, int64_t n) { return memcmp(p, rl_zero_page, (size_t)n) == 0; }

/* The most pieces one record is copied as: a sequence field is two (its
 * row count, to a scratch word, then its rows). */
#define RL_DEF_MAX_PIECES 128

#include <sys/uio.h>
#include <errno.h>
#include <pthread.h>
/* pread mode: 0 (the default) reads straight into the batch's row(s) with
 * one preadv (the padding to a scratch page), then the CRC over the row,
 * which the kernel's copy has just left in this core's cache; 1 reads through
 * a 68 KiB buffer that stays in cache, then the fused CRC + copy with
 * streaming stores into the batch.  Measured (benchmarks/results/big_records.md,
 * 64 KiB records, file -> shuffle(10k) -> batch(256), 2 threads): on the
 * 2026-12-05 Intel Xeon machine the straight read took 13-16% less CPU per GB
 * (0.144-0.150 against 0.166-0.177 s/GB) and ran 15-29% faster, idle and
 * beside a busy process; on the earlier EPYC machines the two were within
 * -8% .. +6% of each other.  68 KiB, not 64: a 64 KiB sequence record is 64
 * KiB of rows plus its 8-byte row count, and one pread of it costs one
 * syscall and page-cache walk, not two. */
#define RL_STAGE_BYTES (65536 + 4096)
static int rl_stage_reads = 0;
static int rl_stage_nt = 1;        /* the staged copy's stores: 1 streaming, 0 plain (the A/B) */      /* 2: a buffer malloc'd per record (the A/B against the per-thread one) */

/* One staging buffer per thread (and per module that includes this header),
 * made on its first use and freed when the thread exits: no malloc / free
 * per record. */
static __thread char *rl_stage_tls;
static pthread_key_t rl_stage_key;
static pthread_once_t rl_stage_once = PTHREAD_ONCE_INIT;
static int rl_stage_key_ok = 0;
static void rl_stage_key_make(void) { rl_stage_key_ok = pthread_key_create(&rl_stage_key, free) == 0; }
static inline char *rl_stage_buffer(void) {
    char *p = rl_stage_tls;
    if (p) return p;
    pthread_once(&rl_stage_once, rl_stage_key_make);
    if (!rl_stage_key_ok) return NULL;           /* then the unstaged read */
    if (posix_memalign((void **)&p, 64, RL_STAGE_BYTES) != 0) return NULL;
    if (pthread_setspecific(rl_stage_key, p) != 0) { free(p); return NULL; }
    rl_stage_tls = p;
    return p;
}

/* pread(2) of n bytes at off into buf, on after EINTR and short reads:
 * RL_DEF_OK, SHRUNK (end of file) or IO + errno; *at: where it stopped. */
static inline int rl_pread_all(int fd, char *buf, int64_t n, int64_t off, int64_t *at) {
    int64_t g = 0;
    while (g < n) {
        ssize_t k = pread(fd, buf + g, (size_t)(n - g), (off_t)(off + g));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) { int e = errno; *at = off + g; return k < 0 ? RL_DEF_IO + e : RL_DEF_SHRUNK; }
        g += k;
    }
    return RL_DEF_OK;
}

/* Copy deferred record r's bytes to dst (r->size bytes, as nf pieces in
 * order, lengths len[], covering the record exactly: piece f is record bytes
 * [src_off[f], src_off[f] + len[f]) to dst[f]; pieces may be empty), fused
 * CRC + copy with streaming stores (plain stores when nt == 0), inside the
 * SIGBUS guard.  Returns RL_DEF_OK / MISMATCH / SHRUNK / IO + errno;
 * *fault_off: the file offset of the fault or of the record. */
static int rl_deferred_read(const rl_record *r, int nf, char *const *dst, const int64_t *src_off,
                            const int64_t *len, int64_t *fault_off) {
    rl_dblock *d = (rl_dblock *)r->block;
    int64_t off = (int64_t)(r->data - d->map->base), want = 0, pad = d->pad;
    uint32_t c = 0;
    int code;
    (void)src_off;           /* pieces are contiguous, in order */
    for (int f = 0; f < nf; f++) want += len[f];
    char *st = rl_stage_reads == 1 ? rl_stage_buffer() : rl_stage_reads == 2 ? (char *)malloc(RL_STAGE_BYTES) : NULL;
    if (st) {
        /* read a piece into a small buffer that stays in this core's cache, then
         * the fused CRC + copy into the batch with streaming stores: the batch's
         * lines are never read in (no read-for-ownership) and there is no
         * separate CRC pass */
        int64_t done = 0, in_f = 0, total = pad + want;     /* the padding first, in the same read */
        int f = 0;
        while (done < total) {
            int64_t piece = total - done < RL_STAGE_BYTES ? total - done : RL_STAGE_BYTES, s = 0;
            code = rl_pread_all(d->map->fd, st, piece, off - pad + done, fault_off);
            if (code != RL_DEF_OK) { rl_cc_fence(); if (rl_stage_reads == 2) free(st); return code; }
            if (done == 0 && pad) {                          /* pad < 4096 < the buffer */
                if (!rl_pad_is_zero(st, pad)) {
                    if (rl_stage_reads == 2) free(st);
                    *fault_off = off - pad;
                    return RL_DEF_PADDING;
                }
                s = pad;
            }
            for (; s < piece;) {
                while (in_f == len[f]) { f++; in_f = 0; }      /* f < nf: the pieces cover want */
                int64_t k = len[f] - in_f < piece - s ? len[f] - in_f : piece - s;
                c = rl_stage_nt ? rl_crc32c_copy_nt(c, dst[f] + in_f, st + s, (size_t)k)
                                : rl_crc32c_copy(c, dst[f] + in_f, st + s, (size_t)k);
                s += k;
                in_f += k;
            }
            done += piece;
        }
        rl_cc_fence();           /* streaming stores: complete before the record is handed on */
        if (rl_stage_reads == 2) free(st);
        *fault_off = off;
        return c == d->crc ? RL_DEF_OK : RL_DEF_MISMATCH;
    }
    struct iovec iov[RL_DEF_MAX_PIECES + 1];
    char padb[4096];
    int cnt = 0;
    int64_t got = 0;
    if (pad) {
        iov[0].iov_base = padb;
        iov[0].iov_len = (size_t)pad;
        cnt = 1;
        want += pad;
    }
    for (int f = 0; f < nf && cnt < RL_DEF_MAX_PIECES + 1; f++) {
        if (len[f] == 0) continue;
        iov[cnt].iov_base = dst[f];
        iov[cnt].iov_len = (size_t)len[f];
        cnt++;
    }
    while (got < want) {
        ssize_t k;
        /* resume after a short read */
        int64_t skip = got;
        struct iovec v[RL_DEF_MAX_PIECES + 1];
        int n = 0;
        for (int i = 0; i < cnt; i++) {
            if (skip >= (int64_t)iov[i].iov_len) { skip -= (int64_t)iov[i].iov_len; continue; }
            v[n].iov_base = (char *)iov[i].iov_base + skip;
            v[n].iov_len = iov[i].iov_len - (size_t)skip;
            skip = 0;
            n++;
        }
        k = preadv(d->map->fd, v, n, (off_t)(off - pad + got));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) { *fault_off = off - pad + got; return k < 0 ? RL_DEF_IO + errno : RL_DEF_SHRUNK; }
        got += k;
    }
    if (pad && !rl_pad_is_zero(padb, pad)) { *fault_off = off - pad; return RL_DEF_PADDING; }
    for (int f = 0; f < nf; f++) c = rl_crc32c(c, dst[f], (size_t)len[f]);
    *fault_off = off;
    return c == d->crc ? RL_DEF_OK : RL_DEF_MISMATCH;
}

static int rl_deferred_copy(const rl_record *r, int nf, char *const *dst, const int64_t *src_off,
                            const int64_t *len, int nt, int64_t *fault_off) {
    rl_dblock *d = (rl_dblock *)r->block;
    if (d->map->fd >= 0) return rl_deferred_read(r, nf, dst, src_off, len, fault_off);
    rl_guard g;
    rl_guard **slot = rl_mapped->guard_slot();
    volatile uint32_t crc = 0;
    rl_guard_init(&g, d->map, slot);
    if (sigsetjmp(g.jb, 0)) {
        *slot = g.prev;
        *fault_off = (int64_t)(g.fault - (uintptr_t)d->map->base);
        return RL_DEF_SHRUNK;
    }
    rl_guard_arm(slot, &g);
    if (d->pad && !rl_pad_is_zero(r->data - d->pad, d->pad)) {
        rl_guard_disarm(slot, &g);
        *fault_off = (int64_t)(r->data - d->pad - d->map->base);
        return RL_DEF_PADDING;
    }
    {
        /* plain stores, whatever nt asks: streaming stores fed from a source
         * that misses the cache (the page cache, through the mapping) were up
         * to 15% faster on a file just written, and 5-6x slower on the same
         * file a minute later in a new process (0.83-1.16 against 0.13-0.21
         * CPU s/GB, 64 KiB records gathered from a mapped 1 GiB file into a
         * 16 MiB batch; the "mmap fused nt" row of
         * benchmarks/results/big_records.md); plain stores ran 4.4-6.9 GB/s
         * in every state.  The pread path's source is its cache-resident
         * staging buffer, where streaming stores win (1.2-1.3x, on both) */
        uint32_t c = 0;
        (void)nt;
        for (int f = 0; f < nf; f++)
            c = rl_crc32c_copy(c, dst[f], r->data + src_off[f], (size_t)len[f]);
        crc = c;
    }
    rl_guard_disarm(slot, &g);
    *fault_off = (int64_t)(r->data - d->map->base);
    return crc == d->crc ? RL_DEF_OK : RL_DEF_MISMATCH;
}

/* One piece (the whole record) to dst. */
static inline int rl_deferred_copy1(const rl_record *r, char *dst, int nt, int64_t *fault_off) {
    int64_t zero = 0, n = r->size;
    return rl_deferred_copy(r, 1, &dst, &zero, &n, nt, fault_off);
}

/* Bytes [at, at + n) of deferred record r to dst, NOT verified (the batch
 * reads a sequence record's row counts to size the batch; the fused copy
 * then checks the CRC of every byte, those included, and that they are still
 * the counts it sized with).  RL_DEF_OK / SHRUNK / IO + errno, *fault_off. */
__attribute__((unused)) static int rl_deferred_peek(const rl_record *r, int64_t at, char *dst, int64_t n, int64_t *fault_off) {
    rl_dblock *d = (rl_dblock *)r->block;
    int64_t off = (int64_t)(r->data - d->map->base) + at;
    if (d->map->fd >= 0) return rl_pread_all(d->map->fd, dst, n, off, fault_off);
    rl_guard g;
    rl_guard **slot = rl_mapped->guard_slot();
    rl_guard_init(&g, d->map, slot);
    if (sigsetjmp(g.jb, 0)) {
        *slot = g.prev;
        *fault_off = (int64_t)(g.fault - (uintptr_t)d->map->base);
        return RL_DEF_SHRUNK;
    }
    rl_guard_arm(slot, &g);
    memcpy(dst, r->data + at, (size_t)n);
    rl_guard_disarm(slot, &g);
    *fault_off = off;
    return RL_DEF_OK;
}

/* 1 if [p, p + n) of map m is all zero, 0 if not, -1 on a fault (*fault_off). */
__attribute__((unused)) static int rl_map_all_zero(rl_map *m, const char *p, int64_t n, int64_t *fault_off) {
    rl_guard g;
    rl_guard **slot = rl_mapped->guard_slot();
    volatile int ok = 1;
    rl_guard_init(&g, m, slot);
    if (sigsetjmp(g.jb, 0)) {
        *slot = g.prev;
        *fault_off = (int64_t)(g.fault - (uintptr_t)m->base);
        return -1;
    }
    rl_guard_arm(slot, &g);
    for (int64_t i = 0; i < n; i++)
        if (p[i]) { ok = 0; break; }
    rl_guard_disarm(slot, &g);
    return ok;
}

/* A verified copy of deferred record r in a block of its own (refcnt 1), for
 * a consumer that is not the fused batch copy; NULL with *code and *off set. */
__attribute__((unused)) static rl_block *rl_deferred_materialize(const rl_record *r, int *code, int64_t *off) {
    rl_block *b = rl_block_new(r->size);
    if (!b) { *code = RL_DEF_NOMEM; *off = 0; return NULL; }
    *code = rl_deferred_copy1(r, b->data, 0, off);
    if (*code != RL_DEF_OK) { rl_block_decref(b); return NULL; }
    return b;
}
#endif
