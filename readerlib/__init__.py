"""readerlib: Cython-accelerated reader chains, LoD batches and decode kernels.

Build a chain in Python, iterate batches::

    import readerlib as rl
    r = rl.RecordIOReader("train.rio").shuffle(10_000, seed=0).batch(256)
    for feats, label in r:
        ...

The public API is ``__all__``: the data model, the sources and writers,
``open_files`` / ``register_file_reader``, the errors, the thread count and the
kernel functions.  Decorators (shuffle, batch, prefetch, map, ...) are reached
through a reader's fluent methods (``.shuffle()``, ``.batch()``, ...); their
classes live in ``readerlib.readers``' modules.  RNN-T models live in
``readerlib.rnnt``, the graph layer in ``readerlib.graph``, every exception and
warning in ``readerlib.errors``.
"""
from typing import TYPE_CHECKING

from ._build import get_include
from ._keyed import Batch, Instance
from ._parallel import get_num_threads, set_num_threads
from .errors import (DataLossError, FailedPreconditionError, InvalidArgumentError, RecordIOError,
                     RecordSchemaError, TFRecordError)
from .formats._recordio import RecordIOReader, RecordIOWriter
from .formats._tfrecord import TFRecordReader, TFRecordWriter
from .readers._base import ReaderBase
from .readers._sources import ArrayReader, PythonReader, RandomDataGenerator
from .readers.files import open_files, register_file_reader
from .kernels import batch_reindex, batch_reindex_grad, ctc_greedy_decoder
from .tensor import Field, LoDTensor, Schema, SparseTensor

if TYPE_CHECKING:
    from .rnnt import rnnt_greedy_decode

__version__ = "0.1.0"

__all__ = [
    # data model
    "Field", "Schema", "LoDTensor", "SparseTensor", "Batch", "Instance",
    # readers: the base (isinstance, fluent methods), sources, files
    "ReaderBase", "ArrayReader", "RandomDataGenerator", "PythonReader",
    "RecordIOReader", "RecordIOWriter", "TFRecordReader", "TFRecordWriter",
    "open_files", "register_file_reader",
    # errors (all of them, and the warnings: readerlib.errors)
    "DataLossError", "RecordSchemaError", "RecordIOError", "TFRecordError",
    "InvalidArgumentError", "FailedPreconditionError",
    # threads and kernels
    "set_num_threads", "get_num_threads",
    # building Cython against readerlib (the C headers; see docs/cext.md)
    "get_include",
    "batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder", "rnnt_greedy_decode",
]

# Names that were flat in this namespace before the public API was cut to the
# list above.  Still importable from here (lazily, from their homes) so that
# old code keeps working; not part of the API: new code uses the fluent methods
# or the module named here.
_COMPAT = {
    "FileReader": "readers._base", "DecoratedReader": "readers._base",
    "ReaderHolder": "readers._base",
    "ShuffleReader": "readers._shuffle", "BatchReader": "readers._batch",
    "MultiPassReader": "readers._passes", "ShardReader": "readers._passes",
    "PrefetchReader": "readers._prefetch",
    "MapReader": "readers._map", "MapBatchesReader": "readers._map", "FilterReader": "readers._map",
    "TakeReader": "readers._slice", "SkipReader": "readers._slice", "RepeatReader": "readers._slice",
    "PaddedBatchReader": "readers._padded", "BucketByLengthReader": "readers._padded",
    "MultiFileReader": "readers._multifile",
    "open_file": "readers.files", "unregister_file_reader": "readers.files",
    "file_reader_for": "readers.files", "shard_from_env": "readers.files",
    "masked_crc32c": "formats._tfrecord", "crc32c": "_core",
    "RecordIOWarning": "errors", "TFRecordWarning": "errors",
}


def __getattr__(name):
    if name == "rnnt_greedy_decode":
        # readerlib.rnnt is imported on first use: a third of readerlib's own
        # import time (~15 ms), which a chain that never decodes does not pay
        from .rnnt import rnnt_greedy_decode
        globals()[name] = rnnt_greedy_decode
        return rnnt_greedy_decode
    if name == "build_tfrecord_index":
        from .formats._tfrecord import build_index
        return build_index
    home = _COMPAT.get(name)
    if home is None:
        raise AttributeError(f"module 'readerlib' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
