"""Exceptions and warnings that name the file and byte offset of a problem."""

__all__ = ["DataLossError", "RecordIOError", "RecordIOWarning", "TFRecordError", "TFRecordWarning"]


class DataLossError(OSError):
    """Stored data is corrupt or truncated (TensorFlow's DataLoss).

    Attributes
    ----------
    path : str
        The file.
    offset : int or None
        Byte offset where the problem was found.
    """

    def __init__(self, message, path=None, offset=None):
        super().__init__(message)
        self.path = path
        self.offset = offset


class RecordIOError(DataLossError):
    """A RecordIO file failed a check (magic, checksum, size, truncation)."""


class TFRecordError(DataLossError):
    """A TFRecord file failed a check (length or data CRC, truncation)."""


class RecordIOWarning(UserWarning):
    """A RecordIO file was readable, but not as written (no index footer, skipped chunks)."""


class TFRecordWarning(UserWarning):
    """A TFRecord file was readable, but not as its sidecar index said (index
    rejected and the file rescanned), or a writer was collected unfinished."""
