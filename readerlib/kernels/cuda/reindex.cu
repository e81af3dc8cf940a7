// readerlib/kernels/cuda/reindex.cu -- Caffe's BatchReindex on the GPU.
//
// Design:
//   Forward  y[n] = x[idx[n]] is a gather of whole rows, i.e. a byte copy: the
//   kernels are templated on the copy word (1, 2, 4, 8 or 16 bytes, the widest
//   that divides the row size and both base pointers, chosen in _gpu.py) instead of
//   on the element dtype, so every dtype gets 16-byte loads when its rows allow
//   and there is one kernel per (word, index type), named
//   batch_reindex_w<bytes>_<int32|int64>.  Threads of a block are laid out
//   [blockDim.y rows] x [blockDim.x words]; blockDim.x is a power of two sized to
//   the row, so a warp reads consecutive words of one row (or of a few short rows):
//   every load is coalesced.  gridDim.y splits long rows into tiles of
//   blockDim.x * kUnroll words; each thread issues its kUnroll loads before its
//   first store, so several 16-byte loads per thread are in flight.  Traffic: each
//   output row read once from x and written once to y, plus idx (8 B/row).
//
//   Index checks run in their own tiny kernel (reindex_check_*) that reads idx once
//   and records, for negative and for too-large indices, the FIRST offending
//   position (as n - pos, so 0 means "none" and a memset initialises it) with an
//   atomicMax -- issued only by a warp that saw a bad index.  The host copies those
//   few words back and raises Caffe's messages; the copy kernels skip rows with a bad
//   index, so they never read out of bounds even though they are queued before the
//   host has looked.
//
//   Backward dx[k] = sum over n with idx[n] == k of dy[n], in ascending n, with no
//   atomics (Caffe's idea, with a GPU sort in place of its host std::sort):
//     1. reindex_check_keys_* writes key[n] = (idx[n] << shift) | n, where
//        2^shift > n for every n: the keys are unique, so any sort orders them by
//        (idx, n) -- stable by construction; bad indices get idx := num_rows.
//     2. the keys are sorted (cupy.sort, CUB radix sort underneath); for
//        len(idx) <= 4096, steps 1 and 2 are one single-block launch instead
//        (reindex_sort_small_*: bitonic sort in shared memory).
//     3. reindex_segments writes, for each k present, seg_begin[k] / seg_end[k] (the
//        range of sorted keys with that idx); absent rows keep the memset 0..0.
//     4. batch_reindex_grad_<dtype>[_v16] gives each output row k one block-row:
//        every thread owns some columns and adds dy[key & mask][col] for the keys of
//        row k in ascending order, into an accumulator that starts at +0 (float16
//        in float32, rounded once at the end; float32 adds in PTX add.rn.f32, never
//        flushed), then writes dx[k] -- zeros for absent rows.  Each dx element is
//        produced by one thread, in the same order as the CPU kernel's loop, so the
//        result is bitwise the CPU's, for any launch shape.
//     Traffic: dy read once, dx written once, keys 8 B/row read per column tile.
//
//   LoD forward: reindex_lod_lengths_* checks idx and writes each picked sequence's
//   length (and max/total length for the host), cupy.cumsum makes the new offsets,
//   and batch_reindex_lod_w<bytes>_* copies whole sequences as single long "rows".
//
// Invariants: row_words, n_in, n_out >= 0; pointers aligned to the word size;
// 0 <= shift < 63 and (num_rows + 1) << shift fits in int64 (checked in _gpu.py).
#include "common.cuh"

namespace rl {

constexpr int kUnroll = 4;

// This thread's share of copying one span of `nwords` words (one row, or one
// whole sequence).  Column tiles of blockDim.x * kUnroll words are spread over
// gridDim.y; `full` tiles need no bounds test per word.
template <typename W>
__device__ __forceinline__ void copy_span(const W* __restrict__ src, W* __restrict__ dst,
                                          i64 nwords) {
    const i64 bx = blockDim.x;
    const i64 tile = bx * kUnroll;
    for (i64 c0 = static_cast<i64>(blockIdx.y) * tile; c0 < nwords;
         c0 += static_cast<i64>(gridDim.y) * tile) {
        const i64 c = c0 + threadIdx.x;
        W v[kUnroll];
        if (c0 + tile <= nwords) {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) v[u] = src[c + u * bx];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) dst[c + u * bx] = v[u];
        } else {
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * bx < nwords) v[u] = src[c + u * bx];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (c + u * bx < nwords) dst[c + u * bx] = v[u];
        }
    }
}

template <typename W, typename I>
__device__ void batch_reindex_impl(const W* __restrict__ x, const I* __restrict__ idx,
                                   W* __restrict__ y, i64 n_out, i64 n_in, i64 row_words) {
    for (i64 n = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y; n < n_out;
         n += static_cast<i64>(gridDim.x) * blockDim.y) {
        const i64 src = static_cast<i64>(idx[n]);
        if (src < 0 || src >= n_in) continue;  // reported by reindex_check_*
        copy_span(x + src * row_words, y + n * row_words, row_words);
    }
}

template <typename W, typename I>
__device__ void batch_reindex_lod_impl(const W* __restrict__ x, const i64* __restrict__ offsets,
                                       const I* __restrict__ idx,
                                       const i64* __restrict__ new_offsets, W* __restrict__ y,
                                       i64 n_out, i64 n_seq, i64 row_words) {
    for (i64 n = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y; n < n_out;
         n += static_cast<i64>(gridDim.x) * blockDim.y) {
        const i64 s = static_cast<i64>(idx[n]);
        if (s < 0 || s >= n_seq) continue;
        const i64 rows = new_offsets[n + 1] - new_offsets[n];
        copy_span(x + offsets[s] * row_words, y + new_offsets[n] * row_words, rows * row_words);
    }
}

// status[0] = max(n - first negative position), status[1] = same for idx >= limit
// (0 = none).  With KEYS, also writes the sort keys of the backward pass.
template <typename I, bool KEYS>
__device__ void reindex_check_impl(const I* __restrict__ idx, i64 n, i64 limit,
                                   u64* __restrict__ status, i64* __restrict__ keys, int shift) {
    u64 neg = 0, big = 0;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        const i64 k = static_cast<i64>(idx[i]);
        const bool is_neg = k < 0, is_big = k >= limit;
        if (is_neg && neg == 0) neg = static_cast<u64>(n - i);  // i only grows: first is largest
        if (is_big && big == 0) big = static_cast<u64>(n - i);
        if (KEYS) keys[i] = ((is_neg || is_big ? limit : k) << shift) | i;
    }
    neg = warp_max_u64(neg);
    big = warp_max_u64(big);
    if ((threadIdx.x & 31) == 0) {
        if (neg) atomicMax(&status[0], neg);
        if (big) atomicMax(&status[1], big);
    }
}

// For the LoD forward: checks idx against n_seq and writes the length of each
// picked sequence; status[2] = longest, status[3] = total rows.
template <typename I>
__device__ void reindex_lod_lengths_impl(const i64* __restrict__ offsets, i64 n_seq,
                                         const I* __restrict__ idx, i64 n,
                                         i64* __restrict__ lengths, u64* __restrict__ status) {
    u64 neg = 0, big = 0, longest = 0, total = 0;
    for (i64 i = global_thread(); i < n; i += grid_threads()) {
        const i64 s = static_cast<i64>(idx[i]);
        const bool is_neg = s < 0, is_big = s >= n_seq;
        if (is_neg && neg == 0) neg = static_cast<u64>(n - i);
        if (is_big && big == 0) big = static_cast<u64>(n - i);
        const i64 len = (is_neg || is_big) ? 0 : offsets[s + 1] - offsets[s];
        lengths[i] = len;
        longest = static_cast<u64>(len) > longest ? static_cast<u64>(len) : longest;
        total += static_cast<u64>(len);
    }
    neg = warp_max_u64(neg);
    big = warp_max_u64(big);
    longest = warp_max_u64(longest);
    total = warp_sum_u64(total);
    if ((threadIdx.x & 31) == 0) {
        if (neg) atomicMax(&status[0], neg);
        if (big) atomicMax(&status[1], big);
        if (longest) atomicMax(&status[2], longest);
        if (total) atomicAdd(&status[3], total);
    }
}

// For small len(idx) (<= 4096 in _gpu.py: 32 KiB of keys, within the default 48 KiB
// of dynamic shared memory): reindex_check_keys and the library sort in one launch of
// one block -- the keys are built, checked and bitonic-sorted in shared memory (p =
// next power of two >= n, padded with INT64_MAX, which sorts last).  A library radix
// sort is several launches of fixed cost; at a few thousand keys those launches, not
// the data, are the time.

template <typename I>
__device__ void reindex_sort_small_impl(const I* __restrict__ idx, i64 n, i64 limit,
                                        u64* __restrict__ status, i64* __restrict__ keys,
                                        int shift, int p) {
    extern __shared__ i64 s_keys[];  // p entries
    u64 neg = 0, big = 0;
    for (int i = threadIdx.x; i < p; i += blockDim.x) {
        i64 key = 0x7fffffffffffffffLL;
        if (i < n) {
            const i64 k = static_cast<i64>(idx[i]);
            const bool is_neg = k < 0, is_big = k >= limit;
            if (is_neg && neg == 0) neg = static_cast<u64>(n - i);
            if (is_big && big == 0) big = static_cast<u64>(n - i);
            key = ((is_neg || is_big ? limit : k) << shift) | i;
        }
        s_keys[i] = key;
    }
    neg = warp_max_u64(neg);
    big = warp_max_u64(big);
    if ((threadIdx.x & 31) == 0) {
        if (neg) atomicMax(&status[0], neg);
        if (big) atomicMax(&status[1], big);
    }
    __syncthreads();
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < (p >> 1); i += blockDim.x) {
                const int lo = 2 * stride * (i / stride) + (i & (stride - 1));
                const int hi = lo + stride;
                const bool ascending = (lo & size) == 0;
                const i64 a = s_keys[lo], b = s_keys[hi];
                if ((a > b) == ascending) {
                    s_keys[lo] = b;
                    s_keys[hi] = a;
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) keys[i] = s_keys[i];
}

// seg[k] / seg[m + k] = first / one-past-last position of row k's keys.
__device__ void reindex_segments_impl(const i64* __restrict__ keys, i64 n, int shift, i64 m,
                                      i64* __restrict__ seg) {
    for (i64 j = global_thread(); j < n; j += grid_threads()) {
        const i64 k = keys[j] >> shift;
        if (k >= m) continue;  // bad index (reported by the check)
        if (j == 0 || (keys[j - 1] >> shift) != k) seg[k] = j;
        if (j == n - 1 || (keys[j + 1] >> shift) != k) seg[m + k] = j + 1;
    }
}

template <typename T, int VEC>
__device__ void batch_reindex_grad_impl(const T* __restrict__ dy, const i64* __restrict__ keys,
                                        const i64* __restrict__ seg, T* __restrict__ dx, i64 m,
                                        i64 row_packs, int shift) {
    typedef Pack<T, VEC> P;
    typedef typename Acc<T>::type A;
    const P* __restrict__ src = reinterpret_cast<const P*>(dy);
    P* __restrict__ dst = reinterpret_cast<P*>(dx);
    const i64 mask = (static_cast<i64>(1) << shift) - 1;
    const i64 bx = blockDim.x;
    const i64 tile = bx * kUnroll;
    for (i64 k = static_cast<i64>(blockIdx.x) * blockDim.y + threadIdx.y; k < m;
         k += static_cast<i64>(gridDim.x) * blockDim.y) {
        const i64 begin = seg[k], end = seg[m + k];
        for (i64 c0 = static_cast<i64>(blockIdx.y) * tile; c0 < row_packs;
             c0 += static_cast<i64>(gridDim.y) * tile) {
            const i64 c = c0 + threadIdx.x;
            A acc[kUnroll][VEC];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[u][e] = A(0);
            for (i64 j = begin; j < end; ++j) {
                const P* row = src + (keys[j] & mask) * row_packs;
                P p[kUnroll];
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * bx < row_packs) p[u] = load_pack(row + c + u * bx);
#pragma unroll
                for (int u = 0; u < kUnroll; ++u)
                    if (c + u * bx < row_packs)
#pragma unroll
                        for (int e = 0; e < VEC; ++e)
                            acc[u][e] = acc_add(acc[u][e], to_acc(p[u].v[e]));
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (c + u * bx < row_packs) {
                    P out;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) out.v[e] = from_acc<T>(acc[u][e]);
                    store_pack(dst + k * row_packs + c + u * bx, out);
                }
            }
        }
    }
}

}  // namespace rl

// ---- extern "C" entry points (names used by readerlib/kernels/_gpu.py) -----------

#define RL_REINDEX_COPY(WB, INAME, I)                                                       \
    extern "C" __global__ void batch_reindex_w##WB##_##INAME(                               \
        const rl::Word<WB>::type* __restrict__ x, const I* __restrict__ idx,                \
        rl::Word<WB>::type* __restrict__ y, i64 n_out, i64 n_in, i64 row_words) {           \
        rl::batch_reindex_impl(x, idx, y, n_out, n_in, row_words);                          \
    }                                                                                       \
    extern "C" __global__ void batch_reindex_lod_w##WB##_##INAME(                           \
        const rl::Word<WB>::type* __restrict__ x, const i64* __restrict__ offsets,          \
        const I* __restrict__ idx, const i64* __restrict__ new_offsets,                     \
        rl::Word<WB>::type* __restrict__ y, i64 n_out, i64 n_seq, i64 row_words) {          \
        rl::batch_reindex_lod_impl(x, offsets, idx, new_offsets, y, n_out, n_seq, row_words); \
    }

#define RL_REINDEX_INDEX(INAME, I)                                                          \
    RL_REINDEX_COPY(1, INAME, I)                                                            \
    RL_REINDEX_COPY(2, INAME, I)                                                            \
    RL_REINDEX_COPY(4, INAME, I)                                                            \
    RL_REINDEX_COPY(8, INAME, I)                                                            \
    RL_REINDEX_COPY(16, INAME, I)                                                           \
    extern "C" __global__ void reindex_check_##INAME(const I* __restrict__ idx, i64 n,      \
                                                     i64 limit, u64* __restrict__ status) { \
        rl::reindex_check_impl<I, false>(idx, n, limit, status, nullptr, 0);                \
    }                                                                                       \
    extern "C" __global__ void reindex_check_keys_##INAME(                                 \
        const I* __restrict__ idx, i64 n, i64 limit, u64* __restrict__ status,              \
        i64* __restrict__ keys, int shift) {                                                \
        rl::reindex_check_impl<I, true>(idx, n, limit, status, keys, shift);                \
    }                                                                                       \
    extern "C" __global__ void reindex_sort_small_##INAME(                                 \
        const I* __restrict__ idx, i64 n, i64 limit, u64* __restrict__ status,              \
        i64* __restrict__ keys, int shift, int p) {                                         \
        rl::reindex_sort_small_impl<I>(idx, n, limit, status, keys, shift, p);              \
    }                                                                                       \
    extern "C" __global__ void reindex_lod_lengths_##INAME(                                 \
        const i64* __restrict__ offsets, i64 n_seq, const I* __restrict__ idx, i64 n,       \
        i64* __restrict__ lengths, u64* __restrict__ status) {                              \
        rl::reindex_lod_lengths_impl(offsets, n_seq, idx, n, lengths, status);              \
    }

RL_REINDEX_INDEX(int32, int)
RL_REINDEX_INDEX(int64, long long)

extern "C" __global__ void reindex_segments(const i64* __restrict__ keys, i64 n, int shift, i64 m,
                                            i64* __restrict__ seg) {
    rl::reindex_segments_impl(keys, n, shift, m, seg);
}

// batch_reindex_grad_<dtype>: one element per load; _v16: 16-byte packs (the row
// length and both pointers must be multiples of 16 bytes).
#define RL_REINDEX_GRAD(NAME, T, VEC16)                                                     \
    extern "C" __global__ void batch_reindex_grad_##NAME(                                   \
        const T* __restrict__ dy, const i64* __restrict__ keys, const i64* __restrict__ seg, \
        T* __restrict__ dx, i64 m, i64 row_elems, int shift) {                              \
        rl::batch_reindex_grad_impl<T, 1>(dy, keys, seg, dx, m, row_elems, shift);          \
    }                                                                                       \
    extern "C" __global__ void batch_reindex_grad_##NAME##_v16(                             \
        const T* __restrict__ dy, const i64* __restrict__ keys, const i64* __restrict__ seg, \
        T* __restrict__ dx, i64 m, i64 row_packs, int shift) {                              \
        rl::batch_reindex_grad_impl<T, VEC16>(dy, keys, seg, dx, m, row_packs, shift);      \
    }

RL_REINDEX_GRAD(float16, rl::half_t, 8)
RL_REINDEX_GRAD(float32, float, 4)
RL_REINDEX_GRAD(float64, double, 2)
RL_REINDEX_GRAD(int32, int, 4)
RL_REINDEX_GRAD(int64, long long, 2)
RL_REINDEX_GRAD(uint8, unsigned char, 16)
