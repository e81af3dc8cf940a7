"""The CPU emulator of the CUDA kernels (tests/support/cuda_emu) catches what it claims to.

tests/conftest.py runs the GPU tests on it when there is no GPU, so its own semantics
must be right: shuffles exchange values as the hardware does, barriers hold, and what
CUDA leaves undefined -- divergent barriers, shuffles naming exited or missing lanes,
a missing __syncthreads -- fails loudly instead of passing by luck.
"""
import numpy as np
import pytest

import cuda_emu

pytestmark = pytest.mark.skipif(not cuda_emu.available(), reason="needs g++ and cpp")

SOURCE = r'''#line 1 "selftest.cu"
typedef long long i64;
constexpr unsigned kFull = 0xffffffffu;

extern "C" __global__ void warp_ops(const int* x, int* scan, int* down, int* xr, int* bcast) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    int v = x[i], inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(kFull, inc, off);
        if (lane >= off) inc += o;
    }
    scan[i] = inc;
    int s = v;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(kFull, s, off);
    down[i] = s;                                   // lane 0 holds the warp's sum
    xr[i] = __shfl_xor_sync(kFull, v, 5);
    bcast[i] = __shfl_sync(kFull, v, 3);
}

extern "C" __global__ void block_reverse(const double* x, double* y, int with_barrier) {
    __shared__ double s[128];
    const int t = threadIdx.x, n = blockDim.x;
    s[t] = x[blockIdx.x * n + t];
    if (with_barrier) __syncthreads();
    y[blockIdx.x * n + t] = s[n - 1 - t];
    __syncthreads();
}

extern "C" __global__ void dynamic_smem(const i64* x, i64* y) {
    extern __shared__ i64 buf[];
    buf[threadIdx.x] = x[threadIdx.x] * 2;
    __syncthreads();
    y[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

extern "C" __global__ void divergent_barrier(int* y) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    y[threadIdx.x] = 1;
}

extern "C" __global__ void shuffle_after_exit(int* y) {
    if (threadIdx.x == 5) return;
    y[threadIdx.x] = __shfl_xor_sync(kFull, (int)threadIdx.x, 1);
}

extern "C" __global__ void shuffle_all(int* y) {
    y[threadIdx.x] = __shfl_xor_sync(kFull, (int)threadIdx.x, 1);
}

extern "C" __global__ void barrier_vs_shuffle(int* y) {
    if (threadIdx.x == 0) __syncthreads();
    else y[threadIdx.x] = __shfl_xor_sync(kFull, 1, 1);
}

extern "C" __global__ void half_warps(const int* x, int* xr16, int* up40, int* idx) {
    // each half-warp shuffles with its own mask; width 16
    const int lane = threadIdx.x & 31, v = x[threadIdx.x];
    const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    // width 16: lanes 0-15 would read a later group (own value instead), lanes 16-31
    // may read the earlier one (CUDA Programming Guide, __shfl_xor_sync)
    xr16[threadIdx.x] = __shfl_xor_sync(kFull, v, 16, 16);
    up40[threadIdx.x] = __shfl_up_sync(kFull, v, 40);        // offset uses 5 bits: 8
    idx[threadIdx.x] = __shfl_sync(half, v, 21, 16);         // 21 mod 16 = 5 in each half
}

extern "C" __global__ void read_before_write(unsigned* y) {
    __shared__ unsigned s[64];
    y[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];   // never written: poison
    __syncthreads();
    s[threadIdx.x] = 7;
}

extern "C" __global__ void atomics(unsigned long long* c) {
    atomicAdd(&c[0], 1ULL);
    atomicMax(&c[1], (unsigned long long)(blockIdx.x * blockDim.x + threadIdx.x));
}
'''


@pytest.fixture(scope="module", params=["x86-64 switch", "ucontext"])
def lib(request):
    """Both fiber switches: the assembly one (used on x86-64) and the portable one."""
    return cuda_emu.build_text(SOURCE, "selftest",
                               defines=("RLEMU_UCONTEXT",) if request.param == "ucontext" else ())


def test_warp_shuffles_match_their_definitions(lib):
    rng = np.random.default_rng(0)
    x = rng.integers(-1000, 1000, size=96).astype(np.int32)
    out = [np.zeros(96, np.int32) for _ in range(4)]
    cuda_emu.launch(lib, "warp_ops", (1,), (96,), (x, *out))
    scan, down, xr, bcast = out
    w = x.reshape(3, 32)
    np.testing.assert_array_equal(scan, np.cumsum(w, axis=1).reshape(-1))
    np.testing.assert_array_equal(down.reshape(3, 32)[:, 0], w.sum(axis=1))
    np.testing.assert_array_equal(xr, w[:, np.arange(32) ^ 5].reshape(-1))
    np.testing.assert_array_equal(bcast, np.repeat(w[:, 3], 32))


def test_barrier_makes_shared_writes_visible(lib):
    x = np.arange(4 * 128, dtype=np.float64)
    y = np.zeros_like(x)
    cuda_emu.launch(lib, "block_reverse", (4,), (128,), (x, y, np.int32(1)))
    np.testing.assert_array_equal(y, x.reshape(4, 128)[:, ::-1].reshape(-1))


def test_missing_barrier_gives_wrong_results(lib):
    # Without the barrier a thread reads s[] before its owner wrote it -- in one of the
    # two thread orders the emulator alternates between blocks.
    x = np.arange(4 * 128, dtype=np.float64) + 1000
    y = np.zeros_like(x)
    cuda_emu.launch(lib, "block_reverse", (4,), (128,), (x, y, np.int32(0)))
    assert not np.array_equal(y, x.reshape(4, 128)[:, ::-1].reshape(-1))


def test_dynamic_shared_memory(lib):
    x = np.arange(64, dtype=np.int64)
    y = np.zeros_like(x)
    cuda_emu.launch(lib, "dynamic_smem", (1,), (64,), (x, y), shared_mem=64 * 8)
    np.testing.assert_array_equal(y, 2 * x[::-1])


@pytest.mark.parametrize("kernel, block, message", [
    ("divergent_barrier", 64, "different __syncthreads"),
    ("shuffle_after_exit", 32, "selftest.cu:[0-9]+: shuffle mask 0xffffffff names lane 5 of warp 0, "
                               "which has exited"),
    ("shuffle_all", 48, "lane 16, which this block [(]48 threads[)] does not have"),
    ("barrier_vs_shuffle", 32, "deadlock"),
])
def test_undefined_behaviour_is_an_error(lib, kernel, block, message):
    y = np.zeros(block, np.int32)
    with pytest.raises(AssertionError, match=message):
        cuda_emu.launch(lib, kernel, (2,), (block,), (y,))


def test_atomics_and_a_multi_dimensional_grid(lib):
    c = np.zeros(2, np.uint64)
    cuda_emu.launch(lib, "atomics", (3, 2), (40,), (c,))
    assert c.tolist() == [3 * 2 * 40, 2 * 40 + 39]   # blockIdx.x only goes to 2


def test_bad_launch_shape_is_an_error(lib):
    with pytest.raises(AssertionError, match="bad launch shape"):
        cuda_emu.launch(lib, "atomics", (1,), (2048,), (np.zeros(2, np.uint64),))


def test_half_warp_masks_widths_and_offsets(lib):
    x = (np.arange(64, dtype=np.int32) * 3 + 1)
    out = [np.zeros(64, np.int32) for _ in range(3)]
    cuda_emu.launch(lib, "half_warps", (1,), (64,), (x, *out))
    xr16, up40, idx = out
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(xr16, np.where(lane < 16, x, x[np.arange(64) - 16]))
    np.testing.assert_array_equal(up40, np.where(lane >= 8, x[np.arange(64) - 8], x))
    np.testing.assert_array_equal(idx, x[(np.arange(64) // 16) * 16 + 5])


def test_static_shared_memory_starts_poisoned_in_every_block(lib):
    y = np.zeros(3 * 64, np.uint32)
    cuda_emu.launch(lib, "read_before_write", (3,), (64,), (y,))
    assert (y == 0xA5A5A5A5).all()          # not 7, what the previous block left


@pytest.mark.parametrize("grid, block, shmem", [((1, 70000), (32,), 0), ((1,), (32, 1, 65), 0),
                                                ((1,), (32,), 64 * 1024)])
def test_launches_beyond_cuda_limits_are_errors(lib, grid, block, shmem):
    with pytest.raises(AssertionError, match="bad launch shape"):
        cuda_emu.launch(lib, "atomics", grid, block, (np.zeros(2, np.uint64),), shared_mem=shmem)
