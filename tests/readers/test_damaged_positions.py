"""A hand-edited shuffle state whose position counts are huge.

A saved buffer's positions are a short string; the number of positions it
holds comes from the state's counts (the tail: emitted - anchor).  A count
far past what get_state ever writes (at most the restore ring's steps) made
the restore allocate and write that many words (a 0-bit "p0:" string encodes
any number of them in no bytes), and the older deflated form inflated
whatever it held.  Both are refused with a ValueError before allocating;
the checks run in a child with a 1 GiB address-space limit and a timeout.
"""
import base64
import json
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import readerlib as rl

LIMIT = 1 << 30          # address space of the child beyond what it has at the start


def _state():
    c = rl.ArrayReader(np.arange(600, dtype=np.int64)).shuffle(50, seed=2)
    it = iter(c)
    for _ in range(100):
        next(it)
    return json.loads(json.dumps(c.get_state()))


CHILD = """
import json, resource, sys, time
import numpy as np, readerlib as rl
with open("/proc/self/statm") as f:
    have = int(f.read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (have + {limit}, have + {limit}))
state = json.loads(sys.stdin.read())
t = time.time()
try:
    rl.ArrayReader(np.arange(600, dtype=np.int64)).shuffle(50, seed=2).set_state(state)
except ValueError as e:
    print("VALUEERROR", time.time() - t, e)
except MemoryError as e:
    print("MEMORYERROR", e)
else:
    print("ACCEPTED")
"""


def _bomb(nbytes):
    """base64 of nbytes of zeros, deflated (streamed: never held whole)."""
    z = zlib.compressobj(9)
    chunk = bytes(1 << 24)
    parts = [z.compress(chunk) for _ in range(nbytes >> 24)]
    return base64.b64encode(b"".join(parts) + z.flush()).decode()


def _restore_in_child(state):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rl.__file__))))
    code = textwrap.dedent(CHILD.format(limit=LIMIT))
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(state), capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    return res.stdout


@pytest.mark.parametrize("steps", [1 << 28, 1 << 40, (1 << 62) - 200])
def test_a_tail_of_huge_length_is_refused_before_allocating(steps):
    state = _state()
    buf = state["buffer"]
    # emitted moved far past the anchor (source_position kept consistent), the
    # tail a 0-bit string: it "holds" any number of positions in no bytes
    buf["emitted"] = buf["anchor"] + steps
    buf["source_position"] = buf["emitted"] + buf["count"]
    buf["tail"] = "p0:"
    out = _restore_in_child(state)
    assert out.startswith("VALUEERROR"), out
    assert "saved buffer is inconsistent" in out and "more than the 65536 a state holds" in out, out
    assert float(out.split()[1]) < 5, out


def test_a_tail_just_inside_the_ring_is_not_refused_for_its_length():
    # the bound is what get_state can write, not less: a tail of the ring's
    # length gets past the length check (and fails a later consistency check)
    state = _state()
    buf = state["buffer"]
    buf["emitted"] = buf["anchor"] + 65536
    buf["source_position"] = buf["emitted"] + buf["count"]
    buf["tail"] = "p0:"
    out = _restore_in_child(state)
    assert "more than the 65536" not in out, out


def test_a_deflated_positions_string_inflating_to_gigabytes_is_refused():
    from readerlib.readers._shuffle import _unpack_positions
    bomb = _bomb(1 << 28)                        # 256 MiB of zeros
    assert len(bomb) < 1 << 20
    with pytest.raises(ValueError, match="more than the 3 positions expected"):
        _unpack_positions(bomb, 10, 3, "t")
    # in a state (the older form of the tail): refused, within the memory limit
    state = _state()
    state["buffer"]["tail"] = _bomb(3 << 29)              # 1.5 GiB
    out = _restore_in_child(state)
    assert out.startswith("VALUEERROR") and "positions expected" in out, out
    # an old-form string of the right length still decodes
    pos = np.array([9, 3, 7], np.int64)
    v1 = base64.b64encode(zlib.compress((10 - 1 - pos).astype("<u4").tobytes(), 1)).decode()
    assert np.array_equal(_unpack_positions(v1, 10, 3, "t"), pos)
    with pytest.raises(ValueError, match="more than the 2 positions expected"):
        _unpack_positions(v1, 10, 2, "t")
    with pytest.raises(ValueError, match="truncated deflate stream"):
        _unpack_positions(base64.b64encode(base64.b64decode(v1)[:-6]).decode(), 10, 3, "t")
