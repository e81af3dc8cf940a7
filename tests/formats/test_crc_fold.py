"""The AVX-512 VPCLMULQDQ folding CRC-32C (rl_core.h rl_crc32c_fold_raw): its
constants against their derivation, and its CRCs and copies against the crc32
streams and a bitwise reference, at every length and alignment around its
boundaries (256-byte steps, the 512-byte minimum, the 64-byte alignment of
streaming stores)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import readerlib as rl
from readerlib import _core
from readerlib.formats._recordio import _crc32c_copy, _gather_copy

HEADER = Path(rl.__file__).parent / "include" / "rl_core.h"
POLY_REFLECTED = 0x82F63B78

needs_fold = pytest.mark.skipif(not _core._cpu_can_fold() or not _core._crc32c_uses_hardware(),
                                reason="this CPU has no AVX-512 VPCLMULQDQ (the folding is never taken)")


def _bitwise_crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (POLY_REFLECTED if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _clmul(a, b):
    r = 0
    while b:
        if b & 1:
            r ^= a
        a <<= 1
        b >>= 1
    return r


def _xpow_mod(e):
    """x^e mod P, P the CRC-32C polynomial in normal bit order (bit j: x^j)."""
    p = int(f"{POLY_REFLECTED:032b}"[::-1], 2) | (1 << 32)

    def mod(a):
        while a.bit_length() > 32:
            a ^= p << (a.bit_length() - 33)
        return a
    r, b = 1, 2
    while e:
        if e & 1:
            r = mod(_clmul(r, b))
        b = mod(_clmul(b, b))
        e >>= 1
    return r


def _reflect32(v):
    return int(f"{v:032b}"[::-1], 2)


def test_fold_constants_match_their_derivation():
    text = HEADER.read_text()
    found = {int(d): (int(lo, 16), int(hi, 16))
             for d, lo, hi in re.findall(r"#define RL_FOLD_(\d+) (0x[0-9a-f]+)ull, (0x[0-9a-f]+)ull", text)}
    assert sorted(found) == [128, 256, 384, 512, 1024, 1536, 2048]
    for d, (lo, hi) in found.items():
        assert lo == _reflect32(_xpow_mod(d + 63)) << 32, d
        assert hi == _reflect32(_xpow_mod(d - 1)) << 32, d


def _with_fold(flag, fn, *a):
    old = _core._set_crc32c_folding(flag)
    try:
        return fn(*a)
    finally:
        _core._set_crc32c_folding(old)


@needs_fold
@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 6000), off=st.integers(0, 63), seed=st.integers(0, 2**32 - 1),
       crc=st.integers(0, 2**32 - 1))
def test_folded_crc_equals_the_crc32_streams(n, off, seed, crc):
    buf = np.random.default_rng(seed).integers(0, 256, n + off, dtype=np.uint8).tobytes()
    piece = memoryview(buf)[off:]
    folded = _with_fold(True, rl.crc32c, piece, crc)
    assert folded == _with_fold(False, rl.crc32c, piece, crc)
    if n <= 1100:
        assert folded == _bitwise_crc32c(piece.tobytes(), crc)


@needs_fold
def test_folded_crc_at_step_boundaries_against_bitwise():
    rng = np.random.default_rng(7)
    for n in [511, 512, 513, 575, 576, 577, 767, 768, 769, 1024 + 255, 1024 + 256, 2047, 2048]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _with_fold(True, rl.crc32c, data) == _bitwise_crc32c(data), n
        cut = n // 3
        assert _with_fold(True, rl.crc32c, data[cut:], _with_fold(True, rl.crc32c, data[:cut])) \
            == _bitwise_crc32c(data), n


@needs_fold
@settings(max_examples=80, deadline=None)
@given(n=st.integers(500, 5000), soff=st.integers(0, 63), doff=st.integers(0, 63),
       seed=st.integers(0, 2**32 - 1))
def test_folded_fused_copy_copies_exactly_and_checks_what_it_stored(n, soff, doff, seed):
    src = np.random.default_rng(seed).integers(0, 256, n + soff, dtype=np.uint8).tobytes()
    piece = memoryview(src)[soff:]
    want = _with_fold(False, rl.crc32c, piece)
    dst = bytearray(n + 64)
    d = memoryview(dst)[doff:doff + n]
    assert _with_fold(True, _crc32c_copy, d, piece) == want
    assert bytes(d) == bytes(piece) and not any(dst[:doff]) and not any(dst[doff + n:])
    # batch rows (plain and streaming stores), rows at every alignment of n
    rows = np.zeros((3, n), np.uint8)
    offs = [soff, 0, n // 2]
    flat = np.frombuffer(src + src, np.uint8)
    for nt in (False, True):
        rows[:] = 0
        got = _with_fold(True, _gather_copy, rows, flat, offs, True, nt)
        assert list(got) == [_with_fold(False, rl.crc32c, flat[o:o + n]) for o in offs]
        assert all(bytes(rows[i]) == flat[o:o + n].tobytes() for i, o in enumerate(offs))


def _child_fold_and_crc(fold_env):
    """(folding on in a fresh interpreter, its CRC of 80,000 bytes) with
    READERLIB_CRC_FOLD=fold_env (None: unset)."""
    env = dict(os.environ)
    env.pop("READERLIB_CRC_FOLD", None)
    if fold_env is not None:
        env["READERLIB_CRC_FOLD"] = fold_env
    code = ("from readerlib import _core, crc32c; import numpy as np; "
            "print(int(_core._crc32c_uses_folding()), crc32c(np.arange(20000, dtype=np.uint32).tobytes()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_fold_switch_and_environment():
    want = rl.crc32c(np.arange(20000, dtype=np.uint32).tobytes())
    for off in ("0", "false", "OFF", "no"):
        assert _child_fold_and_crc(off) == (0, want), off
    can = _core._cpu_can_fold() and _core._crc32c_uses_hardware()
    assert _child_fold_and_crc(None) == (int(can), want)
    if not can:
        with pytest.raises(ValueError):
            _core._set_crc32c_folding(True)


# The plain and fused CRC compiled into a standalone program under the
# sanitizers: AddressSanitizer sees every read and write of the 64-byte loads
# and stores against buffers allocated to the exact length (so a byte past the
# end is a report), UBSan the pointer arithmetic; every length to 3,000 bytes,
# source and destination offsets, a continuation crc, plain and streaming stores.
_HARNESS = r"""
#define RL_CORE_OWNER
#include "rl_core.h"
#include "rl_crccopy.h"
#include <stdio.h>
static rl_core_state st;
static uint32_t bitwise(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = crc & 1 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
}
int main(int argc, char **argv) {
    rl_core_state_init(&st);
    /* argv[1] "1": the parent (readerlib._core) saw the CPU fold; a compiler
     * runtime's __builtin_cpu_supports may not (zig's) */
    if (argc > 1 && argv[1][0] == '1') { st.crc_hw = 1; st.crc_fold = 1; }
    printf("fold=%d\n", st.crc_fold);
    unsigned seed = 1;
    long bad = 0;
    for (size_t n = 0; n < 3000; n += (n < 1100 ? 1 : 7)) {
        for (int off = 0; off < 64; off += (n > 700 ? 9 : 1)) {
            unsigned char *src = malloc(n + off + 1);
            for (size_t i = 0; i < n + off; i++) { seed = seed * 1103515245u + 12345u; src[i] = seed >> 16; }
            uint32_t c0 = seed, want = bitwise(c0, src + off, n);
            if (rl_crc32c(c0, src + off, n) != want && bad++ < 5) printf("crc n=%zu off=%d\n", n, off);
            for (int nt = 0; nt < 2; nt++)
                for (int doff = 0; doff < 64; doff += 13) {
                    char *dst = calloc(n + doff + 1, 1);
                    uint32_t got = nt ? rl_crc32c_copy_nt(c0, dst + doff, (const char *)src + off, n)
                                      : rl_crc32c_copy(c0, dst + doff, (const char *)src + off, n);
                    rl_cc_fence();
                    int before = 0;
                    for (int i = 0; i < doff; i++) before |= dst[i];
                    if ((got != want || memcmp(dst + doff, src + off, n) || before) && bad++ < 5)
                        printf("copy nt=%d n=%zu off=%d doff=%d\n", nt, n, off, doff);
                    free(dst);
                }
            free(src);
        }
    }
    printf("bad=%ld\n", bad);
    return bad != 0;
}
"""


def _compilers():
    """(name, command, flags): gcc with ASan + UBSan; a clang (`clang` on PATH,
    or READERLIB_TEST_CLANG, e.g. "python -m ziglang cc") with UBSan, which also
    flags arithmetic on a null pointer and builds without -mcrc32 only where the
    header's targets name crc32 (clang 14 and later)."""
    import shlex
    import shutil
    out = []
    if shutil.which("gcc"):
        out.append(("gcc", ["gcc"], ["-fsanitize=address,undefined"]))
    clang = os.environ.get("READERLIB_TEST_CLANG") or shutil.which("clang")
    if clang:
        out.append(("clang", shlex.split(clang), ["-fsanitize=undefined"]))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="the harness is built for Linux")
@pytest.mark.parametrize("name,cc,flags", _compilers(), ids=lambda v: v if isinstance(v, str) else "")
def test_fold_under_the_sanitizers(tmp_path, name, cc, flags):
    src = tmp_path / "fold_harness.c"
    src.write_text(_HARNESS)
    exe = tmp_path / "fold_harness"
    build = subprocess.run(cc + ["-O1", "-g", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", *flags,
                                 "-I", str(HEADER.parent), str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-4000:]
    can = _core._cpu_can_fold() and _core._crc32c_uses_hardware()
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    env.pop("LD_PRELOAD", None)
    run = subprocess.run([str(exe), "1" if can else "0"], capture_output=True, text=True, timeout=240, env=env)
    assert run.returncode == 0 and "bad=0" in run.stdout, (run.stdout[-2000:], run.stderr[-4000:])
    assert f"fold={int(can)}" in run.stdout, run.stdout[:200]
