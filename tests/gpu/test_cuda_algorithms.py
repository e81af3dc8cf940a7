"""Python models of the CUDA kernels' index arithmetic, checked without a GPU.

The NumPy emulators in fake_cupy.py state what each kernel must compute; these
models follow what the CUDA code *does*, line by line -- which lane reads which
element, which thread copies which word, how the warp scans combine -- so a
mistake in that arithmetic (an off-by-one in the unaligned head, a word copied
twice, a wrong tie rule in the butterfly) fails here, on any machine.  Keep them
in step with reindex.cu and ctc.cu.
"""
import math

import numpy as np
import pytest

import kernel_reference as ref
from readerlib.kernels import _gpu

NO_INDEX = 0x7FFFFFFF


# ---- ctc_frame_argmax_impl ---------------------------------------------------------

def gt(a, b):
    return bool(a > b)          # IEEE: False when either is NaN


def eq(a, b):
    return bool(a == b)


def warp_argmax(row, addr, itemsize, loads_in_flight=4):
    """ctc.cu's warp argmax of one row, lane by lane; returns (value, index) of lane 0."""
    vec = 16 // itemsize
    n = len(row)
    first = row[0]
    if math.isnan(first):
        return first, 0
    mis = (addr & 15) // itemsize
    head = min(vec - mis if mis else 0, n)
    n_packs = (n - head) // vec
    best, arg = [-math.inf] * 32, [NO_INDEX] * 32
    for lane in range(32):
        order = []
        if lane < head:
            order.append(lane)
        for p in range(lane, n_packs, 32 * loads_in_flight):
            for u in range(loads_in_flight):
                q = p + 32 * u
                if q < n_packs:
                    order.extend(head + q * vec + e for e in range(vec))
        tail = head + n_packs * vec + lane
        if tail < n:
            order.append(tail)
        assert order == sorted(order)
        for i in order:
            if gt(row[i], best[lane]):
                best[lane], arg[lane] = row[i], i
    seen = sorted(i for lane in range(32) for i in _lane_elements(lane, head, n_packs, vec, n,
                                                                   loads_in_flight))
    assert seen == list(range(n)), "every element read exactly once"
    off = 16
    while off:
        nb, na = best[:], arg[:]
        for lane in range(32):
            ov, oi = best[lane ^ off], arg[lane ^ off]
            if gt(ov, best[lane]) or (eq(ov, best[lane]) and oi < arg[lane]):
                nb[lane], na[lane] = ov, oi
        best, arg = nb, na
        off //= 2
    assert len(set(arg)) == 1, "all lanes agree"
    if arg[0] == NO_INDEX:
        return first, 0
    return best[0], arg[0]


def _lane_elements(lane, head, n_packs, vec, n, k):
    out = [lane] if lane < head else []
    for p in range(lane, n_packs, 32 * k):
        for u in range(k):
            if p + 32 * u < n_packs:
                out.extend(head + (p + 32 * u) * vec + e for e in range(vec))
    if head + n_packs * vec + lane < n:
        out.append(head + n_packs * vec + lane)
    return out


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_warp_argmax_matches_tensorflow_rowmax(itemsize):
    rng = np.random.default_rng(itemsize)
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    sizes = list(range(1, 70)) + [127, 129, 255, 1025, 5001]
    for n in sizes:
        for addr in range(0, 16, itemsize):
            for trial in range(3):
                row = rng.integers(-3, 3, size=n).astype(np.float64)   # many ties
                if trial:
                    k = rng.integers(0, max(1, n // 3) + 1)
                    row[rng.integers(0, n, size=k)] = rng.choice(specials, size=k)
                if trial == 2:
                    row[:] = -np.inf
                    row[rng.integers(0, n, size=n // 2)] = np.nan
                want_v, want_i = ref.row_max(row)
                got_v, got_i = warp_argmax(list(row), addr, itemsize)
                assert got_i == want_i, (n, addr, trial, row)
                assert (got_v == want_v) or (math.isnan(got_v) and math.isnan(want_v))


# ---- copy_span / batch_reindex_impl / batch_reindex_grad_impl tiling ----------------

def copy_span_words(nwords, tx, gy, unroll=4):
    """(word -> how many threads copy it) for one span, over all blockIdx.y, threadIdx.x."""
    counts = np.zeros(nwords, dtype=np.int64)
    tile = tx * unroll
    for by in range(gy):
        c0 = by * tile
        while c0 < nwords:
            for t in range(tx):
                c = c0 + t
                for u in range(unroll):
                    if c + u * tx < nwords:
                        counts[c + u * tx] += 1
            c0 += gy * tile
    return counts


@pytest.mark.parametrize("words", [1, 2, 3, 4, 5, 15, 16, 17, 100, 512, 1023, 1024, 1025, 4097])
def test_copy_span_writes_every_word_once(words):
    tx, ty = _gpu._row_layout(words)
    assert tx * ty == _gpu._BLOCK and tx & (tx - 1) == 0
    for gy in {1, 2, 3, max(1, math.ceil(words / (tx * 4)))}:
        assert (copy_span_words(words, tx, gy) == 1).all(), (words, tx, gy)


def rows_visited(n_rows, gx, ty):
    counts = np.zeros(n_rows, dtype=np.int64)
    for bx in range(gx):
        for y in range(ty):
            n = bx * ty + y
            while n < n_rows:
                counts[n] += 1
                n += gx * ty
    return counts


class _FakeCupyForGrid:
    class cuda:
        class runtime:
            @staticmethod
            def getDevice():
                return 0

            @staticmethod
            def getDeviceProperties(dev):
                return {"multiProcessorCount": 3}


@pytest.mark.parametrize("n_rows,words", [(1, 1), (5, 16), (1000, 16), (7, 37632), (300, 2), (4096, 512)])
def test_row_loops_visit_every_row_once(monkeypatch, n_rows, words):
    monkeypatch.setattr(_gpu, "_sm_counts", {})
    tx, ty = _gpu._row_layout(words)
    gx, gy = _gpu._row_grid(_FakeCupyForGrid, n_rows, ty, words, tx)
    assert 1 <= gx <= 3 * 32 and 1 <= gy <= 65535
    assert (rows_visited(n_rows, gx, ty) == 1).all()


# ---- block_exclusive_sum (ctc.cu) ---------------------------------------------------

def shfl_up_scan(values):
    """Inclusive scan of 32 lanes as the __shfl_up_sync loop does it."""
    inc = list(values)
    off = 1
    while off < 32:
        prev = inc[:]
        for lane in range(32):
            if lane >= off:
                inc[lane] = prev[lane] + prev[lane - off]
        off *= 2
    return inc


def block_exclusive_sum(values, block):
    nw = block // 32
    inc = []
    for w in range(nw):
        inc += shfl_up_scan(values[32 * w:32 * w + 32])
    s = [0] * 33
    for w in range(nw):
        s[w] = inc[32 * w + 31]
    wl = [s[lane] if lane < nw else 0 for lane in range(32)]
    winc = shfl_up_scan(wl)
    for lane in range(nw):
        s[lane] = winc[lane] - wl[lane]
    s[32] = winc[31]
    excl = [s[t // 32] + inc[t] - values[t] for t in range(block)]
    return excl, s[32]


@pytest.mark.parametrize("block", [32, 64, 256, 1024])
def test_block_exclusive_sum(block):
    rng = np.random.default_rng(block)
    for _ in range(5):
        v = [int(x) for x in rng.integers(0, 2, size=block)]
        excl, total = block_exclusive_sum(v, block)
        assert excl == list(np.cumsum(v) - v) and total == sum(v)


# ---- the backward's keys ---------------------------------------------------------------

@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (5, 1), (1000, 7), (4096, 8192), (1 << 20, 1 << 20)])
def test_sort_keys_are_unique_and_decode(n, m):
    shift = (n - 1).bit_length()
    assert (m + 1).bit_length() + shift <= 63
    rng = np.random.default_rng(n)
    idx = rng.integers(0, m, size=min(n, 5000)).astype(np.int64)
    i = np.arange(idx.size, dtype=np.int64)
    keys = (idx << shift) | i
    assert np.unique(keys).size == keys.size
    order = np.sort(keys)
    np.testing.assert_array_equal(order >> shift, np.sort(idx, kind="stable"))
    np.testing.assert_array_equal(order & ((1 << shift) - 1), np.argsort(idx, kind="stable"))


# ---- reindex_sort_small_impl (bitonic sort in shared memory) -------------------------

def bitonic_sort(keys, threads=1024):
    """reindex.cu's network: for each (size, stride) stage, thread i of `threads` takes
    pairs i, i + threads, ... < p/2 -- modelled pair by pair, checking they are disjoint."""
    s = list(keys)
    p = len(s)
    size = 2
    while size <= p:
        stride = size >> 1
        while stride > 0:
            touched = set()
            for i in range(p >> 1):
                lo = 2 * stride * (i // stride) + (i & (stride - 1))
                hi = lo + stride
                assert lo not in touched and hi not in touched and hi < p
                touched.update((lo, hi))
                ascending = (lo & size) == 0
                a, b = s[lo], s[hi]
                if (a > b) == ascending:
                    s[lo], s[hi] = b, a
            stride >>= 1
        size <<= 1
    return s


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 100, 1000, 4095, 4096])
def test_small_sort_network(n):
    rng = np.random.default_rng(n)
    p = 1 << (n - 1).bit_length()
    assert p >= n and p * 8 <= 32 * 1024
    keys = [int(k) for k in rng.integers(0, 1 << 40, size=n)] + [2 ** 63 - 1] * (p - n)
    out = bitonic_sort(keys)
    assert out == sorted(keys) and out[:n] == sorted(keys[:n])
