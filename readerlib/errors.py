"""Every exception and warning readerlib raises (one module, one taxonomy:
TensorFlow's), naming the file, byte offset, index or field of a problem."""

__all__ = ["DataLossError", "RecordSchemaError", "RecordIOError", "RecordIOSchemaError", "RecordIOWarning",
           "TFRecordError", "TFRecordWarning"]


# TensorFlow's error taxonomy (tf.errors): OpError and its subclasses, raised by
# readerlib.graph at Session.run with .op set.  The eager exceptions are members and
# keep their Python bases (DataLossError is an OSError, InvalidArgumentError a ValueError).
class OpError(Exception):
    """A failed operation (TensorFlow's ``tf.errors.OpError``).

    Built as TensorFlow does, ``OpError(node_def, op, message)``, or, for the
    eager API, with just the message (``node_def`` and ``op`` are then None
    until ``Session.run`` attaches the failing op).

    Attributes
    ----------
    node_def : NodeDef or None
    op : readerlib.graph.Operation or None
    message : str
    error_code : int
        TensorFlow's ``error_codes_pb2`` value (0 on this base class).
    """

    error_code = 0

    def __init__(self, *args):
        if len(args) >= 3 and not isinstance(args[0], str):
            node_def, op, message = args[:3]
        else:
            node_def, op, message = None, None, args[0] if args else ""
        super().__init__(message)
        self.node_def, self.op, self.message = node_def, op, message

    def __str__(self):
        return str(self.message)


class DataLossError(OpError, OSError):
    """Stored data is corrupt or truncated (TensorFlow's DataLoss).

    Attributes
    ----------
    path : str
        The file.
    offset : int or None
        Byte offset where the problem was found.
    """

    error_code = 15

    def __init__(self, message, path=None, offset=None):
        if not isinstance(message, str) and isinstance(offset, str):   # (node_def, op, message)
            super().__init__(message, path, offset)
            self.path = self.offset = None
            return
        super().__init__(message)
        self.path = path
        self.offset = offset


def _op_error(name, code, bases=(), doc=""):
    return type(name, (OpError,) + bases, {"error_code": code, "__doc__": doc,
                                          "__module__": __name__})


# TensorFlow's subclasses with its error codes.  InvalidArgumentError and
# FailedPreconditionError are the kernels' argument errors too (hence ValueError).
CancelledError = _op_error("CancelledError", 1, doc="The operation was cancelled.")
UnknownError = _op_error("UnknownError", 2, doc="An error of no other kind.")
InvalidArgumentError = _op_error("InvalidArgumentError", 3, (ValueError,),
                                 "An argument TensorFlow would reject with InvalidArgument.")
DeadlineExceededError = _op_error("DeadlineExceededError", 4, doc="A deadline expired.")
NotFoundError = _op_error("NotFoundError", 5, doc="A file or op type was not found.")
AlreadyExistsError = _op_error("AlreadyExistsError", 6, doc="An entity already exists.")
PermissionDeniedError = _op_error("PermissionDeniedError", 7, doc="Not permitted.")
UnauthenticatedError = _op_error("UnauthenticatedError", 16, doc="Unauthenticated.")
ResourceExhaustedError = _op_error("ResourceExhaustedError", 8, doc="Out of a resource.")
FailedPreconditionError = _op_error("FailedPreconditionError", 9, (ValueError,),
                                    "A precondition TensorFlow checks with FailedPrecondition.")
AbortedError = _op_error("AbortedError", 10, doc="The operation was aborted.")
OutOfRangeError = _op_error("OutOfRangeError", 11, doc="End of input (a reader is exhausted).")
UnimplementedError = _op_error("UnimplementedError", 12, doc="Not implemented.")
InternalError = _op_error("InternalError", 13, doc="An internal invariant broke.")
UnavailableError = _op_error("UnavailableError", 14, doc="Temporarily unavailable.")

__all__ += ["OpError", "CancelledError", "UnknownError", "InvalidArgumentError",
            "DeadlineExceededError", "NotFoundError", "AlreadyExistsError",
            "PermissionDeniedError", "UnauthenticatedError", "ResourceExhaustedError",
            "FailedPreconditionError", "AbortedError", "OutOfRangeError", "UnimplementedError",
            "InternalError", "UnavailableError"]


class RecordSchemaError(DataLossError, ValueError):
    """A record does not fit the schema it is read with: its size, or a sequence
    field's row count, is not one the schema's fields allow.

    The one exception for this fault on every path: a RecordIO (there a
    RecordIOSchemaError, also a RecordIOError) or TFRecord file's record, an instance a BatchReader, PaddedBatchReader or
    BucketByLengthReader batches, an instance read_next() decodes.  A
    DataLossError (the data is not what it claims) and a ValueError (what
    TFRecord and the batches raised before).

    Attributes
    ----------
    path : str or None
        The file, when the record came straight from one.
    offset : int or None
        Byte offset of the record (or of its chunk, for RecordIO) in the file.
    index : int or None
        The record's index (in its chunk, or in the batch being built).
    field : str or None
        The field that does not fit, when one can be named.
    """

    def __init__(self, message, path=None, offset=None, index=None, field=None):
        super().__init__(message, path, offset)
        self.index = index
        self.field = field


class RecordIOError(DataLossError):
    """A RecordIO file failed a check (magic, checksum, size, truncation)."""


class RecordIOSchemaError(RecordIOError, RecordSchemaError):
    """A RecordIO record that does not fit the schema in its file's header: a
    RecordSchemaError (the one type for this fault) and, since the file
    contradicts itself (usually a corrupted byte found before the chunk's
    checksum is), a RecordIOError as every other RecordIO check raises."""


class TFRecordError(DataLossError):
    """A TFRecord file failed a check (length or data CRC, truncation)."""


class RecordIOWarning(UserWarning):
    """A RecordIO file was readable, but not as written (no index footer, skipped chunks)."""


class TFRecordWarning(UserWarning):
    """A TFRecord file was readable, but not as its sidecar index said (index
    rejected and the file rescanned), or a writer was collected unfinished."""
