"""The C core (readerlib/include/rl_core.h, state owned by readerlib/_core.pyx)
exists once per process: one block pool, one set of CRC-32C tables."""
import glob
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

import readerlib as rl
from readerlib import _core

PKG = os.path.dirname(os.path.abspath(rl.__file__))


def _extensions():
    return sorted(glob.glob(os.path.join(PKG, "**", "*.so"), recursive=True))


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_no_extension_has_its_own_pool_or_crc_tables():
    sos = _extensions()
    assert any(os.path.basename(p).startswith("_core.") for p in sos), sos
    # (the block pool's; `rl_pool` alone is also _parallel's thread pool, once per process by design)
    state_symbols = re.compile(r"\b(rl_pool_n|rl_pool_bytes|rl_pool_lock_word|rl_crc32c_table|rl_crc32c_long|"
                               r"rl_crc32c_short|rl_crc32c_pow2|rl_crc32c_hw|"
                               r"rl_cc_table|rl_cc_long|rl_cc_short|rl_cc_hw)\b")   # (the fused CRC + copy's, rl_crccopy.h)
    owners = []
    for so in sos:
        out = subprocess.run(["nm", so], capture_output=True, text=True, check=True).stdout
        assert not state_symbols.search(out), (so, state_symbols.findall(out))
        if "_5_core__state" in out:             # the one rl_core_state (Cython-mangled `_state`)
            owners.append(os.path.basename(so))
    assert len(owners) == 1 and owners[0].startswith("_core."), owners


def test_every_module_using_the_core_points_at_the_one_state():
    """A compiled module that includes rl_core.h (through readers/_base.pxd) and
    does not call rl_core_import() at init would dereference a NULL state."""
    missing = []
    for pyx in glob.glob(os.path.join(PKG, "**", "*.pyx"), recursive=True):
        text = open(pyx).read()
        uses_core = "readerlib.readers._base cimport" in text or 'extern from "rl_core.h"' in text
        if uses_core and not pyx.endswith(os.sep + "_core.pyx") \
                and not re.search(r"^rl_core_import\(\)$", text, re.M):
            missing.append(os.path.relpath(pyx, PKG))
    assert not missing, f"call rl_core_import() at module level in {missing}"


def test_blocks_freed_by_any_module_go_to_the_one_pool():
    # A 2 MiB batch block is allocated by readers/_batch.pyx and, once nothing
    # views it, returned to the pool -- the pool readerlib._core reports.
    x = np.zeros((8, 256 << 10), np.uint8)
    chain = rl.ArrayReader(x).batch(8)
    _core._pool_drain()
    assert _core._pool_stats() == (0, 0)
    batch = chain.read_next()
    nbytes = batch[0].data.nbytes
    assert nbytes >= 2 << 20
    del batch
    chain.close()
    n, size = _core._pool_stats()
    assert n >= 1 and size >= nbytes, (n, size)      # _core itself allocates no block


def test_crc_entry_points_agree():
    data = os.urandom(100_003)
    assert rl.crc32c(data) == _core.crc32c(data) == _core._crc32c_parallel_py(data)
    assert rl.crc32c(b"123456789") == 0xE3069283      # the CRC-32C check value
