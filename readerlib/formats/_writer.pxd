# Base of the file writers (RecordIOWriter, TFRecordWriter): open/closed state,
# context manager, and close() = _finish() then close the file, once.
cdef class FileWriter:
    cdef object _f                  # the open file object
    cdef bint _closed
    cdef object _lock               # serialises writes, flush and close across threads
    cdef long _pid                  # the process that opened the file (getpid() in __cinit__)
    cdef long _gen                  # and its fork generation (_fork_gen in _writer.pyx)
    # Raises in a forked child (the file belongs to the process that opened
    # it): every write, write_batch and flush calls it before taking _lock.
    cdef int _check_process(self) except -1
