"""Fixtures shared by the format tests (pytest finds them here)."""
import pytest

import readerlib as rl
from readerlib import _parallel


@pytest.fixture(params=["serial", "parallel"])
def copy_path(request):
    """The batch's serial copy (one thread) or its parallel copy (records
    gathered, then copied on the pool's threads)."""
    old_n = rl.get_num_threads()
    old_min = None
    if request.param == "serial":
        rl.set_num_threads(1)
    else:
        rl.set_num_threads(2)
        old_min = _parallel._set_min_bytes_per_thread(1)
        _parallel._reset_backoff()
    yield request.param
    rl.set_num_threads(old_n)
    if old_min is not None:
        _parallel._set_min_bytes_per_thread(old_min)
