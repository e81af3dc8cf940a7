"""PrefetchReader(device="cuda"): host batches staged to the GPU (CuPy)."""
from collections import deque

import numpy as np

from readerlib.tensor import LoDTensor

__all__ = ["CudaStager"]


def _align(n, a=256):
    return (n + a - 1) // a * a


class CudaStager:
    """Host batch -> device batch through reused pinned buffers on a side stream.

    UNTESTED on hardware (no GPU has been available); without one its tests (marked
    `gpu` and `cuda_emu`) run its logic on tests/support/fake_cupy.py, where streams and
    events are no-ops and copies are synchronous -- the packing, offsets and views
    are checked, the asynchronous ordering is not.

    Per batch: pack every array (data and offsets of every field) into one
    pinned buffer (a plain memcpy on the host), wait on the GPU for the work
    the consumer queued so far (the device memory may be a block it just
    freed), then one async H2D copy on the side stream and an event.  The
    consumer's current stream waits on that event when the batch is handed
    out, so kernels see finished data while the host never blocks.  A pinned
    buffer is reused only after its previous copy's event completed.
    """

    def __init__(self, device_id, depth):
        from readerlib.gpu import require_cupy
        cp = require_cupy()
        self.cp = cp
        self.device = cp.cuda.Device(device_id) if device_id >= 0 else cp.cuda.Device()
        with self.device:
            self.stream = cp.cuda.Stream(non_blocking=True)
        self.buffers = deque([[None, 0, None] for _ in range(depth + 1)])   # [mem, size, event]
        self.inflight = deque()
        self.host_end = False
        self.pending = None
        self.unstaged = None      # a host batch read but not staged yet (its stage() was interrupted)

    def clear(self):
        self.inflight.clear()
        self.host_end = False
        self.pending = None
        self.unstaged = None

    def stage(self, host_batch):
        """Start the batch's copy; returns the in-flight entry, which the caller
        (compiled code: no interrupt lands between) appends to `inflight`."""
        cp = self.cp
        arrays = []
        for t in host_batch:
            arrays.append(t.data)
            arrays.extend(t.lod)
        offsets = []
        total = 0
        for a in arrays:
            offsets.append(total)
            total += _align(a.nbytes)
        total = max(total, 256)
        buf = self.buffers.popleft()
        self.buffers.append(buf)
        if buf[2] is not None:
            buf[2].synchronize()              # its previous copy has left the buffer
        if buf[1] < total:
            buf[0] = cp.cuda.alloc_pinned_memory(total)
            buf[1] = total
        host = np.frombuffer(buf[0], dtype=np.uint8, count=total)
        for a, off in zip(arrays, offsets):
            if a.nbytes:
                host[off:off + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        with self.device:
            consumer_ready = cp.cuda.Event(disable_timing=True)
            consumer_ready.record(cp.cuda.get_current_stream())
            self.stream.wait_event(consumer_ready)
            with self.stream:
                dev = cp.empty(total, dtype=cp.uint8)
                dev.set(host[:total], stream=self.stream)
                done = cp.cuda.Event(disable_timing=True)
                done.record(self.stream)
        buf[2] = done
        out = []
        k = 0
        for t in host_batch:
            views = []
            for a in [t.data] + list(t.lod):
                off = offsets[k]
                k += 1
                views.append(dev[off:off + a.nbytes].view(a.dtype).reshape(a.shape))
            lt = LoDTensor.__new__(LoDTensor)
            lt.data = views[0]
            lt.lod = views[1:]
            out.append(lt)
        return (type(host_batch)._make(out) if hasattr(host_batch, "_make") else tuple(out), done)   # keeps a Batch's keys

    def hand_out(self):
        batch, done = self.inflight.popleft()
        with self.device:
            self.cp.cuda.get_current_stream().wait_event(done)
        return batch
