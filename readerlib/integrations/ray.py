"""Ray Data source and sink for readerlib files, and LoD batches in Ray workers.

    import readerlib.integrations.ray as rlray
    ds = rlray.read_recordio("data/*.rio", override_num_blocks=8)   # a ray.data.Dataset
    ds = ds.map_batches(preprocess, batch_format="pyarrow")
    rlray.write_recordio(ds, "out/train", records_per_file=100_000)
    for feats, label in rlray.iter_lod_batches(ds, 256):           # LoDTensor per field
        ...

Design:
  * Reading (`RecordIODatasource`): the driver opens every file once (header
    and index footer only: `RecordIOReader.chunk_table()`), lists the chunks
    with their byte sizes and deals them, contiguous and in file order, into
    `parallelism` read tasks balanced by bytes (a big file is split between
    tasks, small files share one).  A task opens its files with readerlib,
    `select_chunks()` its chunks -- so each chunk's checksums are verified in
    the task that reads it, and a bad chunk raises `RecordIOError` naming the
    file and byte offset -- and batches them with readerlib's compiled
    `BatchReader` into Arrow tables of about `target_max_block_size` bytes.
    Every chunk belongs to exactly one task, so every record is read exactly
    once.
  * Arrow layout (one column per field; the same in both directions):
    fixed scalar -> a primitive column; fixed ``shape=(d0, ...)`` -> Ray's
    tensor extension column (NumPy ``[B, d0, ...]`` in ``iter_batches``);
    sequence (``lod_level=1``) -> ``large_list<item>`` whose int64 offsets are
    the LoD level and whose items are the rows (``fixed_size_list`` nested per
    inner dimension).  Arrays wrap the batch's NumPy buffers without a copy
    (bool, which Arrow packs into bits, is the exception).
  * Writing (`RecordIODatasink`): every write task writes its own files
    ``{prefix}-{write uuid}-{task:06d}-{k:04d}.rio`` of at most
    `records_per_file` records, each first under a temporary name
    (``... .rio.tmp-<pid>``) renamed when the file is closed and complete.  A
    task that fails or is killed never leaves a partial file under a final
    name; the driver removes a failed or killed attempt's temporary files when
    the write ends (`on_write_complete` / `on_write_failed`).
  * Training: `iter_lod_batches` turns a Dataset, or the `DataIterator` a
    Ray Train worker gets from ``ray.train.get_dataset_shard()`` (or
    ``Dataset.streaming_split``), into readerlib batches: one `LoDTensor`
    per field, zero copy from the Arrow block.  Workers that read files
    themselves use ``readerlib.open_files(paths, shard=(rank, world))``
    instead (see docs/scale_out.md).

Ray is imported only here; ``pip install "readerlib[ray]"`` installs it.
"""
import glob as _glob
import inspect
import os
import uuid

import numpy as np

from readerlib._keyed import as_keyed
from readerlib.formats._recordio import RecordIOReader, RecordIOWriter
from readerlib.readers.files import _expand, file_reader_for, open_file
from readerlib.readers.files import _recordio as _recordio_factory
from readerlib.tensor import Field, LoDTensor, Schema

try:
    import pyarrow as pa
    import ray
    from ray.data.block import BlockAccessor, BlockMetadata
    from ray.data.datasource import Datasink, Datasource, ReadTask
except ImportError as e:          # pragma: no cover - exercised only without ray
    raise ImportError("readerlib.integrations.ray needs Ray Data: pip install 'readerlib[ray]' "
                      "(or pip install 'ray[data]')") from e

__all__ = ["read_recordio", "read_tfrecord", "write_recordio", "iter_lod_batches",
           "RecordIODatasource", "RecordIODatasink", "arrow_schema", "schema_from_arrow",
           "batch_to_arrow", "arrow_to_columns"]

_SCHEMA_KEY = b"readerlib.schema"
_READ_TASK_ARGS = set(inspect.signature(ReadTask.__init__).parameters)
# Blocks well under Ray's 128 MiB target_max_block_size: a fresh 128 MiB batch
# costs its page faults every time, an 8 MiB one stays in the allocator and
# cache (64 KiB records: ~2-3x faster here).  Ray glues a task's blocks into
# one chunked block, which costs it ~0.08 s CPU per 512 MiB pass over one chunk
# a task; one 64 MiB batch a task costs more (0.8 s against 0.55), 16 and 32 MiB
# no less (benchmarks/results/ray.md, "Where a 64 KiB pass goes").
_DEFAULT_BLOCK_BYTES = 8 << 20
# Ray's DataContext.target_max_block_size default: the most bytes a read task
# gets when Ray chooses the block count (RecordIODatasource._task_count)
_TASK_BYTES = 128 << 20


# --------------------------------------------------------------------- layout
def _field_type(field):
    """The Arrow type of one field's column."""
    item = pa.from_numpy_dtype(field.dtype)
    if field.lod_level == 0:
        if not field.shape:
            return item
        from ray.data.extensions import ArrowTensorTypeV2
        return ArrowTensorTypeV2(field.shape, item)
    for d in reversed(field.shape):
        item = pa.list_(item, d)
    return pa.large_list(item)


def arrow_schema(schema):
    """The Arrow schema of the blocks `read_recordio` makes for `schema`
    (the readerlib schema travels in its metadata)."""
    schema = Schema.coerce(schema)
    return pa.schema([pa.field(f.name, _field_type(f), nullable=False) for f in schema],
                     metadata={_SCHEMA_KEY: schema.to_json().encode()})


def schema_from_arrow(arrow):
    """A readerlib Schema for an Arrow schema: the one stored in its metadata
    when present, else inferred column by column (primitive -> scalar field,
    tensor extension -> fixed shape, list of (fixed-size lists of) primitives
    -> sequence field)."""
    meta = arrow.metadata or {}
    if _SCHEMA_KEY in meta:
        stored = Schema.from_json(meta[_SCHEMA_KEY].decode())
        if list(stored.names) == list(arrow.names):
            return stored
    fields = []
    for f in arrow:
        fields.append(_infer_field(f.name, f.type))
    return Schema(fields)


def _infer_field(name, t):
    from ray.data.extensions import ArrowTensorType, ArrowTensorTypeV2, ArrowVariableShapedTensorType
    if isinstance(t, (ArrowTensorType, ArrowTensorTypeV2)):
        return Field(name, _primitive_dtype(name, t.value_type), t.shape)
    if isinstance(t, ArrowVariableShapedTensorType):
        if t.ndim < 1:
            raise TypeError(f"column {name!r}: a variable-shaped tensor of {t.ndim} dims is no sequence")
        raise TypeError(f"column {name!r} holds variable-shaped tensors whose inner shape Arrow does "
                        f"not record; pass schema= to write_recordio")
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        shape = []
        item = t.value_type
        while pa.types.is_fixed_size_list(item):
            shape.append(item.list_size)
            item = item.value_type
        return Field(name, _primitive_dtype(name, item), tuple(shape), lod_level=1)
    return Field(name, _primitive_dtype(name, t))


def _primitive_dtype(name, t):
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise TypeError(f"column {name!r} has Arrow type {t}, which no readerlib field holds "
                        f"(numbers and bools, fixed-shape tensors, lists of them)")
    return np.dtype(t.to_pandas_dtype())


def batch_to_arrow(batch, schema, columns=None):
    """A readerlib batch (tuple of LoDTensor, schema order) as a pyarrow Table."""
    schema = Schema.coerce(schema)
    names = tuple(schema.names if columns is None else columns)
    out_schema, fields = _batch_layout(schema, names)
    arrays = []
    for (f, i), af in zip(fields, out_schema):
        t = batch[i]
        data = np.ascontiguousarray(t.data)
        if f.lod_level == 0:
            if f.shape:
                arrays.append(_tensor_column(data, af.type))
            else:
                arrays.append(pa.array(data))
        else:
            values = _flat_values(data)
            for d in reversed(f.shape):
                values = pa.FixedSizeListArray.from_arrays(values, d)
            arrays.append(pa.LargeListArray.from_arrays(pa.array(t.lod[0]), values))
    return pa.Table.from_arrays(arrays, schema=out_schema)


_LAYOUTS = {}


def _batch_layout(schema, names):
    """(Arrow schema, [(field, batch index)]) for `names` of `schema`, cached:
    `arrow_schema` serialises the readerlib schema into the metadata, which a
    read task would otherwise redo for every batch."""
    key = (schema, names)
    got = _LAYOUTS.get(key)
    if got is None:
        idx = [schema.index(n) for n in names]
        got = (arrow_schema(Schema([schema[i] for i in idx])), [(schema[i], i) for i in idx])
        if len(_LAYOUTS) > 64:
            _LAYOUTS.clear()
        _LAYOUTS[key] = got
    return got


def _flat_values(data):
    """`data`'s items as a flat Arrow array over its buffer (bool: packed, a copy)."""
    if data.dtype == np.bool_:
        return pa.array(data.reshape(-1))
    return pa.Array.from_buffers(pa.from_numpy_dtype(data.dtype), data.size, [None, pa.py_buffer(data)])


def _tensor_column(data, typ):
    """Ray's tensor column (`typ`, ArrowTensorTypeV2: a large_list of each row's
    flattened items) over `data` ``[B, *shape]`` without a copy -- what
    ``ArrowTensorArray.from_numpy`` builds, at a quarter of its cost per batch
    (it re-derives the type and checks the array every time)."""
    if data.dtype == np.bool_ or not isinstance(typ, pa.ExtensionType) or not pa.types.is_large_list(
            typ.storage_type):
        from ray.data.extensions import ArrowTensorArray
        return ArrowTensorArray.from_numpy(data)
    rows = data.shape[0]
    width = int(np.prod(data.shape[1:], dtype=np.int64))
    offsets = pa.py_buffer(np.arange(rows + 1, dtype=np.int64) * width)
    storage = pa.Array.from_buffers(typ.storage_type, rows, [None, offsets], children=[_flat_values(data)])
    return pa.ExtensionArray.from_storage(typ, storage)


def _column_numpy(col, name):
    """A contiguous Arrow array (no nulls) as NumPy, without a copy when Arrow allows."""
    if col.null_count:
        raise ValueError(f"column {name!r} holds {col.null_count} null value(s); readerlib fields have none")
    return col.to_numpy(zero_copy_only=False)


def _cast(arr, f):
    """`arr` as the field's dtype: safe casts freely, others only when every value
    survives (an int64 column of small ints into int16 is fine; 2.5 into int64 is not)."""
    if arr.dtype == f.dtype:
        return arr
    out = arr.astype(f.dtype)
    if not np.can_cast(arr.dtype, f.dtype, casting="safe"):
        with np.errstate(invalid="ignore"):
            back = out.astype(arr.dtype)
        if not np.array_equal(back, arr, equal_nan=arr.dtype.kind == "f"):
            bad = int(np.flatnonzero((back != arr).reshape(len(arr), -1).any(axis=1))[0]) if len(arr) else 0
            raise ValueError(f"column {f.name!r}: {arr.dtype} values do not fit field {f} "
                             f"(row {bad}: {arr[bad]!r})")
    return out


def arrow_to_columns(table, schema):
    """A pyarrow Table (or one Ray block) as readerlib columns, schema order:
    NumPy ``[B, *shape]`` for fixed fields, `LoDTensor` (rows + int64 offsets)
    for sequence fields.

    Raises
    ------
    KeyError
        A field of `schema` has no column.
    ValueError
        Nulls, or a column whose shape or dtype does not fit the field.
    """
    schema = Schema.coerce(schema)
    if not isinstance(table, pa.Table):
        table = BlockAccessor.for_block(table).to_arrow()
    out = []
    for f in schema:
        if f.name not in table.column_names:
            raise KeyError(f"the block has no column {f.name!r} (columns: {table.column_names})")
        col = table.column(f.name)
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        out.append(_to_field(col, f))
    return tuple(out)


def _to_field(col, f):
    from ray.data.extensions import ArrowVariableShapedTensorType
    t = col.type
    if f.lod_level == 0:
        if isinstance(t, pa.ExtensionType) and hasattr(col, "to_numpy"):
            arr = col.to_numpy()
            if isinstance(t, ArrowVariableShapedTensorType):
                arr = np.stack(list(arr)) if len(arr) else np.empty((0, *f.shape), f.dtype)
        else:
            arr = _column_numpy(col, f.name)
            if arr.dtype == object:                 # a list column of fixed-length rows
                arr = np.stack([np.asarray(v) for v in arr]) if len(arr) else np.empty((0, *f.shape))
        arr = np.asarray(arr)
        if arr.shape[1:] != f.shape:
            raise ValueError(f"column {f.name!r}: values of shape {arr.shape[1:]}, field {f} wants {f.shape}")
        return _cast(arr, f)
    if isinstance(t, ArrowVariableShapedTensorType):
        seqs = [_cast(np.asarray(s), f).reshape(-1, *f.shape) for s in col.to_numpy()]
        return LoDTensor.from_sequences(seqs) if seqs else LoDTensor(np.empty((0, *f.shape), f.dtype), [np.zeros(1, np.int64)])
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise ValueError(f"column {f.name!r} has Arrow type {t}; sequence field {f} needs a list column")
    if col.null_count:
        raise ValueError(f"column {f.name!r} holds {col.null_count} null value(s); readerlib fields have none")
    offsets = col.offsets.to_numpy().astype(np.int64, copy=False)
    values = col.values
    start, stop = int(offsets[0]), int(offsets[-1])
    if start:
        offsets = offsets - start
    values = values.slice(start, stop - start)
    inner = []
    while pa.types.is_fixed_size_list(values.type):
        inner.append(values.type.list_size)
        values = values.flatten()
    if tuple(inner) != f.shape:
        raise ValueError(f"column {f.name!r}: rows of shape {tuple(inner)}, field {f} wants {f.shape}")
    data = _cast(_column_numpy(values, f.name), f).reshape(-1, *f.shape)
    return LoDTensor(data, [offsets])


# ---------------------------------------------------------------------- source
class RecordIODatasource(Datasource):
    """Ray Data source of readerlib files (RecordIO, or TFRecord with a schema).

    Read tasks are groups of chunks, balanced by bytes (see the module's
    Design).  Use `read_recordio` / `read_tfrecord` rather than this class.
    """

    def __init__(self, paths, schema=None, columns=None, name="RecordIO", auto_tasks=False):
        super().__init__()
        self._name = name
        # True when the caller left the block count to Ray: tasks are then sized
        # as Ray's own file sources size them (see `_task_count`)
        self._auto_tasks = bool(auto_tasks)
        self._paths = _expand_paths(paths)
        self._user_schema = None if schema is None else Schema.coerce(schema)
        units = []                   # (file index, chunk or None, records, bytes)
        file_schema = None
        for i, p in enumerate(self._paths):
            r = open_file(p, self._user_schema)
            try:
                if file_schema is None:
                    file_schema = r.schema
                elif r.schema != file_schema:
                    raise ValueError(f"{p!r} has schema {r.schema}, but {self._paths[0]!r} has "
                                     f"{file_schema}; one dataset's files share a schema (pass schema=)")
                size = os.path.getsize(p)
                chunked = (hasattr(r, "chunk_table") and hasattr(r, "select_chunks")
                           and not getattr(r, "compression", None))
                if chunked:
                    offs, counts = r.chunk_table()
                    ends = np.append(offs[1:], size)
                    units.extend((i, c, int(n), int(e - o))
                                 for c, (o, e, n) in enumerate(zip(offs, ends, counts)))
                else:                # a compressed stream is read whole
                    units.append((i, None, int(len(r)), int(size)))
            finally:
                r.close()
        self._schema = file_schema
        self._units = units
        if columns is not None:
            columns = [columns] if isinstance(columns, str) else list(columns)
            for c in columns:
                if c not in file_schema.names:
                    raise ValueError(f"columns: no field {c!r} in the files' schema {file_schema}")
        self._columns = columns

    @property
    def schema(self):
        """The files' readerlib Schema."""
        return self._schema

    @property
    def num_records(self):
        return sum(u[2] for u in self._units)

    def get_name(self):
        return self._name

    def estimate_inmemory_data_size(self):
        lod = sum(1 for f in self._schema if f.lod_level)
        return int(sum(u[3] for u in self._units) + 8 * lod * self.num_records)

    def _groups(self, parallelism):
        """Contiguous groups of units, `parallelism` of them (fewer when there are
        fewer units), each ending where the running byte total first reaches its
        share."""
        units = self._units
        n = min(max(int(parallelism), 1), len(units))
        if n == 0:
            return []
        sizes = np.array([max(u[3], 1) for u in units], np.float64)
        cum = np.cumsum(sizes)
        total = cum[-1]
        groups, start = [], 0
        for k in range(1, n + 1):
            if k == n:
                stop = len(units)
            else:
                # first index whose cumulative bytes reach k/n of the total, leaving
                # at least one unit for every group still to come
                stop = int(np.searchsorted(cum, total * k / n, side="left")) + 1
                stop = min(max(stop, start + 1), len(units) - (n - k))
            groups.append(units[start:stop])
            start = stop
        return groups

    def _task_count(self, parallelism, data_context=None):
        """Read tasks for Ray's `parallelism`.  Asked for a count
        (``override_num_blocks=``): that many (at most one per chunk).  Left to
        Ray (`auto_tasks`): Ray's count is sized for its default 200 blocks
        (`read_op_min_num_blocks`), and Ray's own file sources cap it at one task
        per file; this source caps it at one task per file or per
        ``target_max_block_size`` bytes (128 MiB), whichever gives more tasks --
        so a few big files still spread over a cluster, and no task is so small
        that Ray's own cost per task (~25-45 ms here, benchmarks/results/ray.md)
        is the pass."""
        n = max(int(parallelism), 1)
        if self._auto_tasks:
            task_bytes = _TASK_BYTES
            if data_context is not None and getattr(data_context, "target_max_block_size", None):
                task_bytes = int(data_context.target_max_block_size)
            total = sum(u[3] for u in self._units)
            files = len({u[0] for u in self._units})
            n = min(n, max(files, -(-total // max(task_bytes, 1))))
        return n

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        block_bytes = _DEFAULT_BLOCK_BYTES
        if data_context is not None and getattr(data_context, "target_max_block_size", None):
            block_bytes = min(block_bytes, int(data_context.target_max_block_size))
        paths, user_schema, schema, columns = self._paths, self._user_schema, self._schema, self._columns
        out_schema = arrow_schema(schema if columns is None
                                  else Schema([schema[schema.index(c)] for c in columns]))
        tasks = []
        for group in self._groups(self._task_count(parallelism, data_context)):
            plan = []                              # [(path, [chunks] or None)], file order
            for i, c, _, _ in group:
                if plan and plan[-1][0] == paths[i] and c is not None and plan[-1][1] is not None:
                    plan[-1][1].append(c)
                else:
                    plan.append((paths[i], None if c is None else [c]))
            nrec = sum(u[2] for u in group)
            nbytes = sum(u[3] for u in group)
            rows = max(1, int(block_bytes // max(1, nbytes // max(nrec, 1))))
            meta = BlockMetadata(num_rows=nrec, size_bytes=int(nbytes),
                                 input_files=sorted({p for p, _ in plan}), exec_stats=None)

            def read_fn(plan=plan, rows=rows):
                return _read_units(plan, user_schema, schema, columns, rows)

            extra = {}
            if _READ_TASK_ARGS >= {"schema", "per_task_row_limit"}:     # Ray >= 2.48 or so
                extra = {"schema": out_schema, "per_task_row_limit": per_task_row_limit}
            tasks.append(ReadTask(read_fn, meta, **extra))
        return tasks


def _threads_for_this_task():
    """readerlib threads = the CPUs Ray gave this task (as Ray sets OMP_NUM_THREADS),
    unless READERLIB_NUM_THREADS says otherwise.  Several tasks share a node:
    each using every core oversubscribes it (10x slower on a busy machine)."""
    if os.environ.get("READERLIB_NUM_THREADS") or not ray.is_initialized():
        return                 # (not ray.get_runtime_context() first: it would start a cluster)
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE:
        return                 # the driver (a task's function called directly): leave it alone
    cpus = ctx.get_assigned_resources().get("CPU", 1)
    from readerlib._parallel import set_num_threads
    set_num_threads(max(1, int(cpus)))


def _read_units(plan, user_schema, schema, columns, rows):
    """A read task's body: its chunks, through readerlib's batcher, as Arrow tables."""
    _threads_for_this_task()
    for path, chunks in plan:
        if file_reader_for(path) is _recordio_factory:
            # a task batches its chunks in order, without a shuffle buffer: with
            # low_memory=False big records are copied once, from a mapping whose
            # pages stay until the reader closes at the end of this file's units
            # (at most the task's share of the file, ~128 MiB), and small records
            # hold one chunk at a time
            r = RecordIOReader(path, low_memory=False)
        else:
            r = open_file(path, user_schema)
        try:
            if chunks is not None:
                r.select_chunks(chunks)
            b = r.batch(rows, drop_last=False)
            for batch in b:
                yield batch_to_arrow(batch, schema, columns)
        finally:
            r.close()


def _expand_paths(paths):
    """Files, glob patterns, or directories (their RecordIO / TFRecord files, sorted)."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            found = sorted(f for f in _glob.glob(os.path.join(item, "*"))
                           if f.endswith((".rio", ".recordio", ".tfrecord", ".tfrecords", ".tfrec")))
            if not found:
                raise FileNotFoundError(f"no RecordIO or TFRecord file in directory {item!r}")
            out.extend(found)
        else:
            out.extend(_expand(item))
    if not out:
        raise ValueError("read_recordio needs at least one path")
    # absolute, as Ray's own file readers resolve them: tasks run in other directories
    return [os.path.abspath(p) for p in out]


def read_recordio(paths, *, schema=None, columns=None, override_num_blocks=None, parallelism=-1,
                  ray_remote_args=None, **read_args):
    """Read readerlib RecordIO files as a `ray.data.Dataset`.

    Parameters
    ----------
    paths : str, path, or list of them
        Files, glob patterns (sorted) or directories.
    schema : Schema, optional
        Checked against the files' own (RecordIO stores it).
    columns : list of str, optional
        Only these fields' columns.
    override_num_blocks : int, optional
        Read tasks to make (at most one per chunk).  Default: Ray's choice,
        capped as Ray's own file sources cap it -- one task per file, or per
        128 MiB (``DataContext.target_max_block_size``) when that gives more.
        ``parallelism=`` is Ray's older name for it.
    ray_remote_args, **read_args
        Passed to `ray.data.read_datasource` (``concurrency=``, ``num_cpus=``, ...).

    Returns
    -------
    ray.data.Dataset
        One column per field (see `arrow_schema`), records in file order
        within each read task.

    Raises
    ------
    RecordIOError
        In the read task (Ray re-raises it wrapped): a chunk failed its checks;
        the message names the file and byte offset.

    Examples
    --------
    >>> ds = read_recordio("data/*.rio", override_num_blocks=8)
    >>> ds.count()
    """
    ds = RecordIODatasource(paths, schema=schema, columns=columns,
                            auto_tasks=override_num_blocks is None and parallelism in (None, -1))
    return ray.data.read_datasource(ds, override_num_blocks=override_num_blocks, parallelism=parallelism,
                                    ray_remote_args=ray_remote_args, **read_args)


def read_tfrecord(paths, *, schema=None, columns=None, override_num_blocks=None, parallelism=-1,
                  ray_remote_args=None, **read_args):
    """Read TFRecord files with readerlib's reader and a one-field `schema`
    (see `TFRecordReader`; default: each record a uint8 sequence) as a
    `ray.data.Dataset`.  Uncompressed files are split by chunks of their
    index (``<file>.idx``, built by a scan in the driver when missing);
    compressed ones are read whole, one per task at most.  Records whose
    CRCs fail raise `TFRecordError` naming the file and offset."""
    ds = RecordIODatasource(paths, schema=schema, columns=columns, name="TFRecord",
                            auto_tasks=override_num_blocks is None and parallelism in (None, -1))
    return ray.data.read_datasource(ds, override_num_blocks=override_num_blocks, parallelism=parallelism,
                                    ray_remote_args=ray_remote_args, **read_args)


# ------------------------------------------------------------------------ sink
class RecordIODatasink(Datasink):
    """Ray Data sink writing readerlib RecordIO files (see `write_recordio`)."""

    def __init__(self, path_prefix, schema=None, records_per_file=None, chunk_size=1 << 20,
                 compressor="none"):
        self.path_prefix = os.path.abspath(os.fspath(path_prefix))   # tasks run elsewhere
        self.schema = None if schema is None else Schema.coerce(schema)
        if records_per_file is not None and (not isinstance(records_per_file, (int, np.integer))
                                             or isinstance(records_per_file, bool) or records_per_file < 1):
            raise ValueError(f"records_per_file must be a positive int or None, got {records_per_file!r}")
        self.records_per_file = None if records_per_file is None else int(records_per_file)
        self.chunk_size = chunk_size
        self.compressor = compressor
        self.write_uuid = uuid.uuid4().hex[:12]
        self.files = []                 # final paths, after the write completes

    def get_name(self):
        return "WriteRecordIO"

    @property
    def min_rows_per_write(self):
        return self.records_per_file

    def on_write_start(self, schema=None):
        d = os.path.dirname(self.path_prefix)
        if d:
            os.makedirs(d, exist_ok=True)
        if self.schema is None and schema is not None:
            self.schema = schema_from_arrow(schema)

    def _name(self, task, k):
        return f"{self.path_prefix}-{self.write_uuid}-{task:06d}-{k:04d}.rio"

    def write(self, blocks, ctx):
        """One write task: its blocks into files of at most `records_per_file`
        records, each renamed to its final name only once complete."""
        _threads_for_this_task()
        task = int(ctx.task_idx)
        done, tmp_paths = [], []
        writer, tmp, final, in_file = None, None, None, 0
        schema = self.schema
        try:
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if schema is None:
                    schema = schema_from_arrow(table.schema)
                pos, n = 0, table.num_rows
                while pos < n:
                    if writer is None:
                        final = self._name(task, len(done))
                        tmp = f"{final}.tmp-{os.getpid()}"
                        tmp_paths.append(tmp)
                        writer = RecordIOWriter(tmp, schema, chunk_size=self.chunk_size,
                                                compressor=self.compressor)
                        in_file = 0
                    take = n - pos if self.records_per_file is None else min(
                        n - pos, self.records_per_file - in_file)
                    writer.write_batch(dict(zip(schema.names, arrow_to_columns(table.slice(pos, take), schema))))
                    self._after_batch(tmp)
                    pos += take
                    in_file += take
                    if self.records_per_file is not None and in_file >= self.records_per_file:
                        writer.close()
                        writer = None
                        os.replace(tmp, final)
                        done.append(final)
            if writer is not None:
                writer.close()
                writer = None
                os.replace(tmp, final)
                done.append(final)
        except BaseException:
            if writer is not None:
                try:
                    writer.close()
                except Exception:
                    pass
            for p in tmp_paths:
                if os.path.exists(p):
                    os.unlink(p)
            for p in done:           # the task's files go with it: a retry rewrites them
                if os.path.exists(p):
                    os.unlink(p)
            raise
        return done

    def _after_batch(self, tmp_path):
        """Hook for tests (a task killed mid-file); nothing here."""

    def _remove_temporaries(self):
        for p in _glob.glob(_glob.escape(f"{self.path_prefix}-{self.write_uuid}-") + "*.rio.tmp-*"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def on_write_complete(self, write_result):
        # a killed attempt that Ray retried left its temporary file behind
        self._remove_temporaries()
        self.files = sorted(p for ret in write_result.write_returns for p in (ret or []))

    def on_write_failed(self, error):
        self._remove_temporaries()


def write_recordio(dataset, path_prefix, schema=None, records_per_file=None, *, chunk_size=1 << 20,
                   compressor="none", ray_remote_args=None, concurrency=None):
    """Write a `ray.data.Dataset` as readerlib RecordIO files.

    Parameters
    ----------
    dataset : ray.data.Dataset
        One column per field (the layout `read_recordio` produces; plain
        numeric, tensor and list columns are inferred when `schema` is None).
    path_prefix : str
        Files are ``{path_prefix}-{uuid}-{task}-{k}.rio`` (directories made).
    schema : Schema, optional
        Default: from the dataset's Arrow schema.
    records_per_file : int, optional
        At most this many records per file (and Ray bundles at least this
        many rows per write task); default: one file per write task.
    chunk_size, compressor
        As `RecordIOWriter`.

    Returns
    -------
    list of str
        The files written, sorted.

    Notes
    -----
    A file appears under its final name only once it is complete (written
    to ``<name>.tmp-<pid>`` and renamed); a task that fails removes its
    files, a killed one leaves only a temporary file, which the driver
    removes when the write ends.
    """
    sink = RecordIODatasink(path_prefix, schema=schema, records_per_file=records_per_file,
                            chunk_size=chunk_size, compressor=compressor)
    dataset.write_datasink(sink, ray_remote_args=ray_remote_args, concurrency=concurrency)
    return sink.files


# -------------------------------------------------------------------- training
def iter_lod_batches(source, batch_size, schema=None, drop_last=False, **iter_args):
    """readerlib batches (a `Batch`: a tuple of `LoDTensor` in schema order, keyed by name) from a Ray
    Dataset or `DataIterator` (what ``ray.train.get_dataset_shard(name)`` or
    ``Dataset.streaming_split(n)`` give each worker).

    Fixed fields come as ``LoDTensor(data [B, *shape])`` (empty lod), sequence
    fields as rows plus int64 offsets, both wrapping the Arrow buffers
    without a copy.  `schema` defaults to the one in the blocks' metadata
    (or inferred from their Arrow types).  Extra arguments go to
    ``iter_batches`` (``prefetch_batches=``, ``local_shuffle_buffer_size=``...).
    """
    if batch_size is None or int(batch_size) < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    sch = None if schema is None else Schema.coerce(schema)
    for table in source.iter_batches(batch_size=int(batch_size), batch_format="pyarrow",
                                     drop_last=drop_last, **iter_args):
        if sch is None:
            sch = schema_from_arrow(table.schema)
        yield as_keyed(sch, True, [t if isinstance(t, LoDTensor) else LoDTensor(t)
                                   for t in arrow_to_columns(table, sch)])      # a Batch, keyed by name
