"""readerlib: Cython-accelerated reader chains, LoD batches and decode kernels.

Build a chain in Python, iterate batches::

    import readerlib as rl
    r = rl.RecordIOReader("train.rio").shuffle(10_000, seed=0).batch(256)
    for feats, label in r:
        ...
"""
from ._keyed import Batch, Instance
from ._parallel import get_num_threads, set_num_threads
from .errors import DataLossError, RecordIOError, RecordIOWarning, TFRecordError, TFRecordWarning
from .formats._recordio import RecordIOReader, RecordIOWriter
from .formats._tfrecord import TFRecordReader, TFRecordWriter, masked_crc32c
from .formats._tfrecord import build_index as build_tfrecord_index
from ._core import crc32c
from .readers._multifile import MultiFileReader
from .readers.files import (
    file_reader_for,
    open_file,
    open_files,
    register_file_reader,
    shard_from_env,
    unregister_file_reader,
)
from .readers._prefetch import PrefetchReader
from .readers._map import FilterReader, MapBatchesReader, MapReader
from .readers._slice import RepeatReader, SkipReader, TakeReader
from .readers._padded import BucketByLengthReader, PaddedBatchReader
from .readers._base import DecoratedReader, FileReader, ReaderBase, ReaderHolder
from .readers._shuffle import ShuffleReader
from .readers._batch import BatchReader
from .readers._passes import MultiPassReader, ShardReader
from .readers._sources import ArrayReader, PythonReader, RandomDataGenerator
from .kernels import (
    FailedPreconditionError,
    InvalidArgumentError,
    batch_reindex,
    batch_reindex_grad,
    ctc_greedy_decoder,
)
from .rnnt import Hypothesis, Joint, LSTMPredictor, RNNTModel, StatelessPredictor, rnnt_greedy_decode
from .tensor import Field, LoDTensor, Schema, SparseTensor

__version__ = "0.1.0"

__all__ = [
    "Field", "Schema", "LoDTensor", "SparseTensor", "Batch", "Instance",
    "ReaderBase", "FileReader", "DecoratedReader", "ReaderHolder",
    "ArrayReader", "RandomDataGenerator", "PythonReader",
    "ShuffleReader", "BatchReader", "MultiPassReader", "PrefetchReader", "ShardReader",
    "MapReader", "MapBatchesReader", "FilterReader", "TakeReader", "SkipReader", "RepeatReader",
    "PaddedBatchReader", "BucketByLengthReader",
    "RecordIOReader", "RecordIOWriter", "TFRecordReader", "TFRecordWriter", "masked_crc32c",
    "build_tfrecord_index", "MultiFileReader",
    "open_files", "open_file", "register_file_reader", "unregister_file_reader", "file_reader_for",
    "shard_from_env",
    "DataLossError", "RecordIOError", "RecordIOWarning", "TFRecordError", "TFRecordWarning",
    "crc32c", "set_num_threads", "get_num_threads",
    "batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder",
    "InvalidArgumentError", "FailedPreconditionError",
    "rnnt_greedy_decode", "Hypothesis", "RNNTModel", "LSTMPredictor", "StatelessPredictor", "Joint",
]
