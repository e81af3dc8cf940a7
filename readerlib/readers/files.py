"""`open_files`: many files, a pool of threads, one deterministic stream (Paddle's open_files).

Files are dispatched to readers by suffix through a registry that user file
readers can join (`register_file_reader`).  Sharding splits the files'
chunks between ranks (`shard=(rank, world)` or ``"auto"``, which reads
``RANK``/``WORLD_SIZE`` as set by torchrun).  The threaded reading itself is
compiled (`readerlib/readers/_multifile.pyx`).
"""
import glob as _glob
import hashlib
import json
import os
import threading

import numpy as np

from readerlib.formats._recordio import RecordIOReader
from readerlib.formats._tfrecord import INDEX_SUFFIX, TFRecordReader
from readerlib.readers._base import ReaderBase
from readerlib.readers._multifile import MultiFileReader
from readerlib.readers._passes import ShardReader
from readerlib.tensor import Schema

__all__ = ["open_files", "register_file_reader", "unregister_file_reader", "file_reader_for",
           "open_file", "shard_from_env", "ShardReader", "MultiFileReader"]

_REGISTRY = {}
_REGISTRY_LOCK = threading.Lock()


def register_file_reader(suffix, factory, replace=False):
    """Make `open_files` read files ending in `suffix` with `factory`.

    Parameters
    ----------
    suffix : str
        Like ``".rio"`` or ``".tfrecord.gz"``; matched case-insensitively,
        the longest registered suffix wins.
    factory : callable
        ``factory(path)`` -> a readerlib reader of instances; it is called
        as ``factory(path, schema=schema)`` when `open_files` gets a schema.
        Each worker thread opens its own reader per file.  A reader that has
        ``chunk_table()`` and ``select_chunks()`` is read (and sharded) by
        chunks, any other by whole files.
    replace : bool
        Allow replacing an existing registration.

    Examples
    --------
    >>> def lines(path, schema=None):
    ...     return rl.PythonReader(lambda: (np.frombuffer(l, np.uint8) for l in open(path, "rb")),
    ...                            rl.Schema([rl.Field("line", "uint8", lod_level=1)]))
    >>> rl.register_file_reader(".txt", lines)
    """
    if not isinstance(suffix, str) or not suffix.startswith(".") or len(suffix) < 2:
        raise ValueError(f"suffix must be a string like '.rio', got {suffix!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (path -> reader), got {type(factory).__name__}")
    key = suffix.lower()
    with _REGISTRY_LOCK:
        if key in _REGISTRY and not replace and _REGISTRY[key] is not factory:
            raise ValueError(f"a reader is already registered for {suffix!r}; pass replace=True")
        _REGISTRY[key] = factory


def unregister_file_reader(suffix):
    """Remove a registration (KeyError if there is none)."""
    with _REGISTRY_LOCK:
        del _REGISTRY[suffix.lower()]


def file_reader_for(path):
    """The factory registered for `path` (longest matching suffix)."""
    name = os.fspath(path).lower()
    with _REGISTRY_LOCK:
        best = None
        for suffix in _REGISTRY:
            if name.endswith(suffix) and (best is None or len(suffix) > len(best)):
                best = suffix
        if best is None:
            raise ValueError(f"no file reader registered for {os.fspath(path)!r} (known suffixes: "
                             f"{sorted(_REGISTRY)}); use rl.register_file_reader(suffix, factory)")
        return _REGISTRY[best]


def open_file(path, schema=None):
    """Open one file with the reader its suffix is registered to."""
    factory = file_reader_for(path)
    reader = factory(os.fspath(path)) if schema is None else factory(os.fspath(path), schema=schema)
    if not isinstance(reader, ReaderBase):
        raise TypeError(f"the reader factory for {os.fspath(path)!r} returned "
                        f"{type(reader).__name__}, not a readerlib reader")
    return reader


def _recordio(path, schema=None):
    r = RecordIOReader(path)
    if schema is not None and Schema.coerce(schema) != r.schema:
        raise ValueError(f"{path}: the file's schema {r.schema} differs from schema={schema}")
    return r


def _tfrecord(compression):
    def factory(path, schema=None):
        return TFRecordReader(path, schema=schema, compression=compression)
    factory.__name__ = f"tfrecord_{(compression or 'none').lower()}"
    return factory


for _s in (".rio", ".recordio"):
    register_file_reader(_s, _recordio)
for _s in (".tfrecord", ".tfrecords", ".tfrec"):
    register_file_reader(_s, _tfrecord(None))
    register_file_reader(_s + ".gz", _tfrecord("GZIP"))
    register_file_reader(_s + ".zlib", _tfrecord("ZLIB"))


def shard_from_env(environ=None):
    """(rank, world) of this process: an initialised torch.distributed, else
    ``RANK``/``WORLD_SIZE`` (torchrun); (0, 1) when unset.  The same answer as
    `readerlib.integrations.rank_and_world_size` (one helper for both)."""
    from readerlib.integrations._sharding import rank_and_world_size
    return rank_and_world_size(environ=environ)


def _check_shard(shard):
    if shard is None:
        return None
    if isinstance(shard, str) and shard == "auto":
        return shard_from_env()
    try:
        rank, world = shard
        rank, world = int(rank), int(world)
    except (TypeError, ValueError):
        raise TypeError(f"shard must be (rank, world), 'auto' or None, got {shard!r}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"shard=(rank, world) needs 0 <= rank < world, got {shard!r}")
    return rank, world


def _is_sidecar(path):
    name = os.path.basename(path)
    return name.endswith(INDEX_SUFFIX) or (INDEX_SUFFIX + ".tmp") in name


def _expand(paths_or_glob):
    items = [paths_or_glob] if isinstance(paths_or_glob, (str, os.PathLike)) else list(paths_or_glob)
    if not items:
        raise ValueError("open_files needs at least one path or glob pattern")
    out = []
    for item in items:
        item = os.fspath(item)
        # an existing file is that file, even if its name has glob characters
        # ("data[1].rio"); a pattern is expanded only when nothing matches literally
        if _glob.has_magic(item) and not os.path.exists(item):
            # a pattern like "data/*" also matches the TFRecord index sidecars: not data files
            found = sorted(f for f in _glob.glob(item) if not _is_sidecar(f))
            if not found:
                raise FileNotFoundError(f"open_files: no file matches {item!r}")
            out.extend(found)
        else:
            if not os.path.exists(item):
                raise FileNotFoundError(f"open_files: no such file {item!r}")
            out.append(item)
    return out


class FilePlan:
    """Which units (file chunks, or whole files) a rank reads, in which order.

    Units are listed canonically (files in the given order, chunks in file
    order) and dealt to the ranks balanced by record count (`_assign`); a
    rank reads its units in canonical order.  Each epoch the files (not
    the chunks inside them) are permuted by (seed, epoch) when
    shuffle_files is set.  Every rank computes the same table, so the ranks
    read disjoint units and together all of them.

    File order (`file_order`): "files", the permutation of *all* the plan's
    files drawn from (seed, epoch) -- the same on every rank and in every
    process, whatever units the files have (an empty TFRecord file is one
    whole-file unit without its .idx sidecar and none with it; a file
    without an index is one unit, with one a unit per chunk); a rank reads
    its units in that order.  "units" (states saved before 2026-12-06, which
    have no "file_order"): the permutation of only the files that have units
    among this rank's, which a restored state of that time keeps
    (`legacy_order_problem` says when it cannot be reproduced).
    """

    FILE_ORDERS = ("files", "units")

    def __init__(self, paths, schema, shard, shuffle_files, seed, by_chunks, seed_drawn=False):
        self.paths = paths
        self.schema = schema
        self.shard = shard
        self.shuffle_files = shuffle_files
        self.seed = seed
        self.seed_drawn = bool(seed_drawn)     # no seed= given: the state carries the drawn one
        self.by_chunks = by_chunks
        self.equal_batches = False
        self.identities = []                  # per file: what tells it from another (states)
        # per file: whether its units give exactly their planned counts.  A
        # reader that skips bad chunks (RecordIOReader(on_error="skip") from a
        # registered factory) may give fewer: set_state cannot step over its
        # units by their counts (epoch_counts), it reads them (and skips again)
        self.counts_exact = []
        self.file_order = "files"
        # per file: whether its units could differ between processes for the same
        # file identity (a chunk table known or not: an index outside the file,
        # like TFRecord's .idx sidecar) -- only the "units" order depends on them
        self._index_outside = []
        self._empty = []       # per file: no record (True/False; None: not known without reading)
        self._same_orders = None
        units = []            # (file index, chunks or None, record count or None)
        self._user_schema = schema
        first = None
        bare = []
        for i, p in enumerate(paths):
            r = open_file(p, schema)
            try:
                self.identities.append(_identity_of(r, p))
                self.counts_exact.append(getattr(r, "on_error", "raise") != "skip")
                bare.append(r.bare_instances)
                if r.item_kind != 0:
                    raise TypeError(f"open_files reads instances; the reader for {p!r} yields batches")
                if first is None:
                    first = (p, r.schema)
                elif r.schema != first[1]:
                    raise ValueError(f"open_files: {p!r} has schema {r.schema}, but {first[0]!r} has "
                                     f"{first[1]}; files of one stream share a schema (pass schema=)")
                # a compressed stream cannot be entered mid-way: whole-file units
                chunked = (hasattr(r, "chunk_table") and hasattr(r, "select_chunks")
                           and not getattr(r, "compression", None))
                # (sharding always reads by chunks: its units never depend on an index)
                self._index_outside.append(bool(chunked and not by_chunks
                                                and not isinstance(r, RecordIOReader)))
                if chunked and (by_chunks or getattr(r, "has_index", False)):
                    _, counts = r.chunk_table()
                    units.extend((i, [c], int(n)) for c, n in enumerate(counts))
                    self._empty.append(int(np.sum(counts)) == 0)
                else:
                    n = None
                    if by_chunks:            # sharding: counts balance the ranks
                        try:
                            n = len(r)
                        except TypeError:
                            pass
                    units.append((i, None, n))
                    # an uncompressed TFRecord file without a record has 0 bytes
                    self._empty.append(n == 0 if n is not None else
                                       (os.path.getsize(p) == 0 if isinstance(r, TFRecordReader)
                                        and not getattr(r, "compression", None) else None))
            finally:
                r.close()
        self.schema = first[1]
        # One instance form for the stream: bare (TFRecord sequences, zero copy)
        # only when every file gives it; otherwise `open` prefixes the bare ones.
        self.bare = all(bare)
        self.units = units
        rank, world = shard or (0, 1)
        self.owner = self._assign(units, world)
        self.mine = [u for u, o in zip(units, self.owner) if o == rank]

    @staticmethod
    def _assign(units, world):
        """Rank of each unit: balanced by record count when every count is known
        (largest first, to the least-loaded rank, ties to the lowest rank: LPT);
        round-robin otherwise.  Deterministic, so every rank computes the same."""
        if world == 1:
            return [0] * len(units)
        if any(u[2] is None for u in units):
            return [k % world for k in range(len(units))]
        load = [0] * world
        owner = [0] * len(units)
        for k in sorted(range(len(units)), key=lambda k: -units[k][2]):
            r = min(range(world), key=lambda j: (load[j], j))
            owner[k] = r
            load[r] += units[k][2]
        return owner

    def count(self, unit):
        i, chunks, n = unit
        if n is None:
            r = open_file(self.paths[i], self._user_schema)
            try:
                n = len(r)
            except TypeError:
                raise ValueError(f"equal_batches needs record counts; the reader for "
                                 f"{self.paths[i]!r} has neither chunk_table() nor len()") from None
            finally:
                r.close()
        return n

    def rank_counts(self):
        """Records each rank would read in an epoch."""
        rank, world = self.shard or (0, 1)
        counts = [0] * world
        for u, o in zip(self.units, self.owner):
            counts[o] += self.count(u)
        return counts

    def open(self, path):
        r = open_file(path, self._user_schema)
        if r.bare_instances and not self.bare:
            try:
                r._prefixed_instances()
            except (NotImplementedError, RuntimeError) as e:
                r.close()
                raise ValueError(f"open_files: {path!r} cannot be mixed with prefixed files ({e})") from None
        if r.bare_instances != self.bare:
            r.close()
            raise ValueError(f"open_files: {path!r} now gives {'bare' if r.bare_instances else 'prefixed'} "
                             f"instances, unlike when the stream was planned")
        return r

    @staticmethod
    def _permuted(seed, epoch, files):
        """`files` (file indices) in the order (seed, epoch) draws."""
        perm = np.random.default_rng([seed, epoch]).permutation(len(files))
        return [files[j] for j in perm]

    def _shuffled_files(self, epoch):
        """The file order of `epoch` (see the class doc): file indices, first read first."""
        if self.file_order == "units":
            return self._permuted(self.seed, epoch, sorted({u[0] for u in self.mine}))
        return self._permuted(self.seed, epoch, list(range(len(self.paths))))

    def _epoch_order(self, epoch):
        units = self.mine
        if self.shuffle_files:
            rank_of = {f: pos for pos, f in enumerate(self._shuffled_files(epoch))}
            units = sorted(units, key=lambda u: rank_of[u[0]])      # stable: chunks stay in order
        return units

    def _is_empty(self, i):
        if self._empty[i] is None:
            r = open_file(self.paths[i], self._user_schema)
            try:
                self._empty[i] = len(r) == 0
            except TypeError:          # no count: it might be empty
                self._empty[i] = True
            finally:
                r.close()
        return self._empty[i]

    def _sidecar_dependent(self):
        """Files whose having a unit depends on an index outside them: empty ones
        (no unit with their index, one whole-file unit without)."""
        return [i for i in range(len(self.paths)) if self._index_outside[i] and self._is_empty(i)]

    def units_order_is_files_order(self):
        """True when the "units" order (what a readerlib before 2026-12-06 reads,
        in any process) is this plan's "files" order in every epoch."""
        if not self.shuffle_files:
            return True
        if self._same_orders is None:           # (get_state asks: once)
            self._same_orders = (not self._sidecar_dependent()
                                 and len({u[0] for u in self.mine}) == len(self.paths))
        return self._same_orders

    def legacy_order_problem(self, seed, epoch):
        """None when the "units" order of `epoch` under `seed` is the one the
        process that saved it read (a state without "file_order"); else why not.

        That order permuted the files that had units, and an empty file whose
        index lives outside it (TFRecord's .idx sidecar) had one unit or none
        depending on whether the sidecar existed when that process planned the
        stream: unknowable here.  The order is reproducible when every such
        choice gives the same records in the same order."""
        if not self.shuffle_files:
            return None
        unsure = self._sidecar_dependent()
        if not unsure:
            return None
        if len(unsure) > 10:
            return (f"{len(unsure)} empty files ({self.paths[unsure[0]]!r}, ...) had a unit or none "
                    f"depending on their index sidecars")
        base = sorted({u[0] for u in self.mine} - set(unsure))
        seen = None
        for mask in range(1 << len(unsure)):
            files = sorted(base + [f for k, f in enumerate(unsure) if mask >> k & 1])
            got = [f for f in self._permuted(seed, epoch, files) if f not in unsure]
            if seen is None:
                seen = got
            elif got != seen:
                names = ", ".join(repr(os.path.basename(self.paths[f])) for f in unsure[:3])
                return (f"its file order depended on whether the index sidecar of the empty "
                        f"file(s) {names} existed when that process opened the files, which "
                        f"gives other records in epoch {epoch}")
        return None

    def epoch_units(self, epoch):
        """[(path, chunks or None)] for this rank and epoch, in reading order."""
        return [(self.paths[i], chunks) for i, chunks, _ in self._epoch_order(epoch)]

    def epoch_counts(self, epoch):
        """Record counts of `epoch_units(epoch)`, in that order (None: not known
        without reading the file -- no chunk table, or a reader that skips bad
        chunks --; set_state's skip stops there)."""
        return [n if self.counts_exact[i] else None for i, _, n in self._epoch_order(epoch)]

    def describe(self):
        """What decides this plan's records and their order (for states): the
        files' identities (listed when few, else a digest), the shard, the file
        shuffle and its seed when one was given."""
        if len(self.identities) <= 16:
            files = [dict(i) for i in self.identities]
        else:
            digest = hashlib.sha256(json.dumps(self.identities, sort_keys=True).encode()).hexdigest()[:16]
            files = {"count": len(self.identities), "sha256": digest,
                     "first": dict(self.identities[0]), "last": dict(self.identities[-1])}
        d = {"files": files, "shard": list(self.shard) if self.shard else None,
             "shuffle_files": bool(self.shuffle_files)}
        if self.shuffle_files and not self.seed_drawn:
            d["seed"] = int(self.seed)
        return d

    def open_files_args(self):
        """The `open_files` keyword arguments that rebuild this plan (pickling)."""
        return {"paths_or_glob": list(self.paths), "shuffle_files": bool(self.shuffle_files),
                "seed": None if self.seed_drawn else self.seed, "shard": self.shard,
                "equal_batches": bool(self.equal_batches), "schema": self._user_schema}

    def __repr__(self):
        sh = f", shard={self.shard}" if self.shard else ""
        return f"FilePlan({len(self.paths)} files, {len(self.mine)}/{len(self.units)} units{sh})"


def _identity_of(reader, path):
    ident = reader._describe().get("file") if hasattr(reader, "_describe") else None
    if ident is None:            # a registered reader of another kind: size and mtime
        st = os.stat(path)
        ident = {"name": os.path.basename(path), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}
    return ident


def _reopen_files(paths_or_glob, **kwargs):
    """Unpickle an `open_files` reader (see ReaderBase.__reduce__)."""
    return open_files(paths_or_glob, **kwargs)


def open_files(paths_or_glob, num_threads=1, shuffle_files=False, seed=None, shard=None,
               equal_batches=False, schema=None, timeout=None):
    """Read many files with a pool of threads, as one stream of instances.

    The order is deterministic: the files' records are concatenated in file
    order (or in an order drawn from (seed, epoch) with `shuffle_files`),
    whatever the number of threads and however fast each one runs.  Each
    file is read by the reader registered for its suffix (``.rio``,
    ``.tfrecord``, ``.tfrecord.gz``, ... see `register_file_reader`); all
    files must share one schema.  Follow with ``.shuffle()`` for
    record-level shuffling, ``.batch()`` for batches.

    Parameters
    ----------
    paths_or_glob : str, path, or list of them
        Files or glob patterns (a pattern's matches are sorted).
    num_threads : int
        Worker threads; each runs compiled readers with the GIL released.
    shuffle_files : bool
        Permute the files each epoch, from (seed, epoch) and the list of
        files alone: the same order on every rank (each reads its share in
        it) and in every process, whether or not index sidecars exist.
    seed : int, optional
        Pass `seed=` to make a shuffled file order reproducible.
    shard : (rank, world), "auto" or None
        Read only this rank's share of the files' chunks (whole files for
        readers without chunks); "auto" takes RANK / WORLD_SIZE from the
        environment (torchrun), (0, 1) when unset.  The ranks' shares are
        disjoint and cover every record.
    equal_batches : bool
        Trim every rank to the smallest rank's record count, so that all
        ranks yield the same number of records (and batches).
    schema : Schema, optional
        For readers that take one (TFRecord); checked against the others.
    timeout : float, optional
        Raise TimeoutError when no record arrives for this many seconds.

    Returns
    -------
    MultiFileReader

    Raises
    ------
    FileNotFoundError, ValueError, TypeError
        At construction.  While reading, a worker's exception is raised by
        `read_next()` after every record before it, naming the file.  A
        file's data error (DataLossError: a corrupt chunk or record, naming
        file and offset) is raised once, and reading goes on with the records
        after it (get_state refuses until the next epoch; with
        `equal_batches`, a rank that lost records yields fewer than the
        others).  Any other exception ends the stream: raised again by every
        later read until `reset()`, which restarts it.

    Examples
    --------
    >>> r = rl.open_files("data/train-*.tfrecord", num_threads=2, shard="auto",
    ...                   equal_batches=True).shuffle(10_000, seed=0).batch(256)
    """
    paths = _expand(paths_or_glob)
    shard = _check_shard(shard)
    seed_drawn = bool(shuffle_files) and seed is None
    if seed_drawn:
        # drawn once here; it travels in get_state(), so a restore elsewhere draws the same order
        seed = int.from_bytes(os.urandom(8), "little")
    elif seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed is not None:
        seed = int(seed)
    if schema is not None:
        schema = Schema.coerce(schema)
    plan = FilePlan(paths, schema, shard, bool(shuffle_files), seed, by_chunks=shard is not None,
                    seed_drawn=seed_drawn)
    limit = -1
    if equal_batches:
        plan.equal_batches = True
        limit = min(plan.rank_counts())
    return MultiFileReader(plan, plan.schema, num_threads=num_threads, limit=limit, timeout=timeout)
