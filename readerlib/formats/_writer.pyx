# cython: freethreading_compatible=False
"""The base of the file writers (RecordIOWriter, TFRecordWriter) and the file
they write through.

Design:
    _PieceFile writes whole pieces at known offsets: a piece is in the file or
    rolled back, so a failed write leaves the file as it was after the last
    complete piece.  FileWriter holds the open/closed state, the context
    manager, and close() = _finish() then close the file, once.
"""
import os
import warnings
from _thread import RLock as _RLock

from readerlib._signature import ClassSignature as _ClassSignature
from posix.unistd cimport getpid

__all__ = ["FileWriter"]

# Bumped in every forked child (os.register_at_fork): a writer whose _gen
# differs was opened by an ancestor process (FileWriter._check_process), found
# without a getpid() system call per write.
cdef long _fork_gen = 0


def _bump_fork_gen():
    global _fork_gen
    _fork_gen += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_bump_fork_gen)


class _PieceFile:
    """A file written in whole pieces at known offsets (pwritev): a piece is
    either all in the file or rolled back (the file truncated to where the
    piece began), so a failed write -- ENOSPC, EFBIG past RLIMIT_FSIZE, EIO --
    leaves the file exactly as it was after the last complete piece, and the
    same piece can be written again.  Writers keep what they had not yet
    written when a write fails, so a retry (the next write, flush or close)
    continues the file correctly.  SQLite's rule: a committed write survives,
    a torn one is detected (here: removed, or, after a kill, left for the
    reader's checks)."""

    def __init__(self, path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        self.pos = 0                 # bytes committed: the file's size after the last good piece

    def write(self, *pieces):
        """Append the pieces (bytes-like), all or nothing; returns the bytes written."""
        views = [memoryview(x).cast("B") for x in pieces if len(x)]
        total = sum(len(v) for v in views)
        done = 0
        try:
            while views:
                n = os.pwritev(self.fd, views, self.pos + done)
                done += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, self.pos)      # roll back the torn piece
            except OSError:
                pass
            raise type(e)(e.errno, f"{e.strerror}: writing {total} bytes at byte offset {self.pos} "
                          f"failed; the file keeps the {self.pos} bytes written before (the write "
                          f"can be retried)", self.path) from e
        self.pos += total
        return total

    def flush(self):
        pass                         # nothing is buffered here: every piece is with the OS

    def close(self):
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


cdef class FileWriter:
    """What every file writer shares: it is open from ``__init__`` (which sets
    ``self._f`` to a `_PieceFile` and ``self._closed = False``) until
    ``close()``, which runs the subclass's ``_finish()`` (last buffered data,
    footers) and then closes the file, once.  A context manager.

    Writes, flush() and close() may come from several threads: they are
    serialised (one lock per writer), each record whole and counted once.

    A failed write raises (OSError naming the file and offset) and leaves the
    file readable up to its last complete piece; what was not written stays
    buffered, so a later write, flush() or close() retries it.  close()
    raises when the file cannot be finished (and can be called again); it
    never reports success for a file that does not read back.  An unclosed
    writer still finishes its file when collected; if that fails, a warning
    (`_gc_warning`, a RecordIOWarning / TFRecordWarning) names the path.

    The file belongs to the process that opened it: in a child forked from
    it, writes and flush() raise RuntimeError, and close() (or collection)
    closes the child's descriptor without writing anything."""
    # inspect.signature(cls) of every subclass, from its own docstring (readerlib/_signature.py)
    __signature__ = _ClassSignature()

    def __cinit__(self, *args, **kwargs):
        self._closed = True
        self._lock = _RLock()        # (the C type: no Python frame in __cinit__)
        self._pid = getpid()
        self._gen = _fork_gen

    def __del__(self):
        if not self._closed and self._f is not None:
            try:
                self.close()
            except Exception as e:
                warnings.warn(f"{type(self).__name__}({getattr(self, 'path', '?')!r}) was "
                              f"garbage-collected unclosed and finishing the file failed ({e}); the "
                              f"file holds only what was written before (records still buffered are "
                              f"lost): close() writers explicitly", self._gc_warning(), stacklevel=1)
                self._closed = True
                try:
                    self._f.close()
                except Exception:
                    pass

    cdef int _check_process(self) except -1:
        if self._gen != _fork_gen:
            raise RuntimeError(
                f"{type(self).__name__}({getattr(self, 'path', '?')!r}) was opened by process "
                f"{self._pid}, and this is process {getpid()}, forked from it: the file is that "
                f"process's to write and finish (a write here would land where its next records "
                f"go); open a writer on another file in this process")
        return 0

    def _gc_warning(self):
        return ResourceWarning

    def _check_open(self):
        if self._closed:
            raise ValueError(f"I/O operation on closed {type(self).__name__}")

    def _finish(self):
        """Write what is still buffered and any footer (subclasses)."""

    def close(self):
        """Finish the file and close it.  Idempotent once it succeeded.

        Raises (OSError) when the file cannot be finished; the writer then
        stays open, so close() can be retried (e.g. after freeing space)."""
        if self._gen != _fork_gen:
            self._close_forked()
            return
        with self._lock:             # not while another thread writes
            if self._closed:
                return
            self._finish()           # raises: still open, the file ends at its last good piece
            self._closed = True
            self._f.close()

    def __reduce__(self):
        raise TypeError(
            f"cannot pickle {type(self).__name__}({getattr(self, 'path', '?')!r}): a writer belongs "
            f"to the process that opened its file; pass the path and open a writer (on another "
            f"file) in the other process")

    def _close_forked(self):
        """close() (or the collection of an unclosed writer) in a forked child:
        its descriptor is closed and nothing is written.  The process that
        opened the file finishes it; a child that wrote its buffered records
        and footer there (as close() would) overwrote the records the parent
        wrote after the fork, after the parent's close() had returned.  No
        lock: a thread of the parent may have held it at the fork."""
        if not self._closed:
            self._closed = True
            if self._f is not None:
                self._f.close()

    @property
    def closed(self):
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


