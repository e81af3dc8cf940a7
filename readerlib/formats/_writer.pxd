# Base of the file writers (RecordIOWriter, TFRecordWriter): open/closed state,
# context manager, and close() = _finish() then close the file, once.
cdef class FileWriter:
    cdef object _f                  # the open file object
    cdef bint _closed
    cdef object _lock               # serialises writes, flush and close across threads
