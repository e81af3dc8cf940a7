// readerlib/kernels/cuda/ctc.cu -- tf.nn.ctc_greedy_decoder on the GPU.
//
// Design:
//   TensorFlow registers this op for the CPU only.  Its semantics, per utterance b
//   and frame t < sequence_length[b]:
//     a[t] = argmax_c logits[t, b, c]   (RowMax: p = x[0]; p = x[c] when x[c] > p, so
//                                        the FIRST maximum wins, a NaN at c > 0 never
//                                        wins, a NaN at c == 0 wins the whole row)
//     emit a[t] iff a[t] != blank and not (merge_repeated and a[t] == a[t-1]),
//       with a[-1] = -1 (TF's prev_indices starts at -1 and is updated on every
//       frame, blank frames included -- so emission depends only on a[t], a[t-1]);
//     neg_sum_logits[b] = -sum_t max_c logits[t, b, c].
//   Because emission needs only neighbouring frames, the whole decode is data
//   parallel.  The chain is four launches and one host sync:
//     1. ctc_frame_argmax_*: one warp per frame row (t, b) in memory order; lanes read
//        the row with 16-byte loads (an unaligned head of < 16 bytes and a short tail
//        handled per element -- rows of odd num_classes are not 16-byte aligned),
//        four loads in flight per lane, keep the first maximum of their elements,
//        then a butterfly (max value, then smaller index) gives every lane the row's
//        (argmax, max).  Frames t >= sequence_length[b] are never read.  Output is
//        utterance-major: best_idx / best_val [b * max_time + t] (LoD: the frame).
//        Traffic: the logits within the lengths, read once; 8-12 B per frame written.
//     2. ctc_emit_scan_*: one block per utterance; emission flags, a block-wide
//        exclusive scan giving each emitted label its position, the label count, and
//        -sum of the maxima (a fixed-shape tree: deterministic, within rounding of
//        TF's sequential sum).  The block that finishes last (atomic ticket, fenced)
//        scans the per-utterance counts into row starts and writes the total and the
//        longest count -- the two numbers the host needs -- and dense_shape.
//     3. ctc_compact_*: one block per utterance scatters (b, position) and the label
//        of each emitted frame to row_start[b] + position.  Output buffers are sized
//        for the worst case (every frame emitted) so this runs before the host knows
//        the total; _gpu.py returns views of the first `total` rows.
//     4. the host copies {total, longest, bad length} (24 bytes) and waits: the only
//        sync.
//   16-bit logits (float16, bfloat16) are widened exactly to float32; maxima and the
//   sum run in float32 (float64 for float64).  All float32 compares and adds go
//   through common.cuh's PTX (no flush-to-zero), so the argmax is bitwise the CPU's.
//
// Invariants: 0 < num_classes < 2^31; 0 <= blank < num_classes; rows of the logits
// contiguous, base aligned to the element size; padded: sequence lengths are
// clamped into [0, max_time] for memory safety and a length > max_time is reported
// in status[3] (as batch - b, first offender) for the host to raise TF's error.
#include "common.cuh"

namespace rl {

constexpr int kLoadsInFlight = 4;
constexpr int kNoIndex = 0x7fffffff;

template <bool LOD>
__device__ __forceinline__ void utterance_span(i64 b, const int* __restrict__ seq_len,
                                               const i64* __restrict__ offsets, i64 max_time,
                                               i64& start, i64& len) {
    if (LOD) {
        start = offsets[b];
        len = offsets[b + 1] - start;
    } else {
        start = b * max_time;
        len = seq_len[b];
        if (len > max_time) len = max_time;
    }
    if (len < 0) len = 0;
}

template <typename T, int VEC, bool LOD>
__device__ void ctc_frame_argmax_impl(const T* __restrict__ logits, const int* __restrict__ seq_len,
                                      i64 max_time, i64 batch, i64 n_rows, int num_classes,
                                      int* __restrict__ best_idx,
                                      typename Acc<T>::type* __restrict__ best_val) {
    typedef Pack<T, VEC> P;
    typedef typename Acc<T>::type A;
    const int lane = threadIdx.x & 31;
    const i64 n_warps = grid_threads() >> 5;
    for (i64 r = global_thread() >> 5; r < n_rows; r += n_warps) {  // warp-uniform loop
        i64 out = r;
        if (!LOD) {
            const i64 t = r / batch, b = r - t * batch;
            if (t >= static_cast<i64>(seq_len[b])) continue;
            out = b * max_time + t;
        }
        const T* __restrict__ row = logits + r * num_classes;
        const A first = to_acc(row[0]);
        A best = first;
        int arg = 0;
        if (!is_nan(first)) {
            // Each lane sees its elements in increasing index order, so a strict '>'
            // keeps the lane's first maximum.  (-inf, kNoIndex) means "nothing above
            // -inf seen yet".
            best = neg_inf<A>();
            arg = kNoIndex;
            const int mis = static_cast<int>((reinterpret_cast<u64>(row) & 15) / sizeof(T));
            int head = mis ? VEC - mis : 0;
            if (head > num_classes) head = num_classes;
            if (lane < head) {
                const A v = to_acc(row[lane]);
                if (gt(v, best)) { best = v; arg = lane; }
            }
            const int n_packs = (num_classes - head) / VEC;
            const P* __restrict__ body = reinterpret_cast<const P*>(row + head);
            for (int p = lane; p < n_packs; p += 32 * kLoadsInFlight) {
                P pk[kLoadsInFlight];
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u)
                    if (p + 32 * u < n_packs) pk[u] = load_pack(body + p + 32 * u);
#pragma unroll
                for (int u = 0; u < kLoadsInFlight; ++u) {
                    if (p + 32 * u < n_packs) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) {
                            const A v = to_acc(pk[u].v[e]);
                            if (gt(v, best)) { best = v; arg = head + (p + 32 * u) * VEC + e; }
                        }
                    }
                }
            }
            const int tail = head + n_packs * VEC + lane;
            if (tail < num_classes) {
                const A v = to_acc(row[tail]);
                if (gt(v, best)) { best = v; arg = tail; }
            }
            // Larger value wins; equal values: smaller index.  A strict total order on
            // the candidates, so every lane ends with the same answer.
            for (int off = 16; off > 0; off >>= 1) {
                const A ov = __shfl_xor_sync(kFullMask, best, off);
                const int oi = __shfl_xor_sync(kFullMask, arg, off);
                if (gt(ov, best) || (eq(ov, best) && oi < arg)) { best = ov; arg = oi; }
            }
            if (arg == kNoIndex) {  // every element -inf or NaN (and x[0] is not NaN)
                best = first;
                arg = 0;
            }
        }
        if (lane == 0) {
            best_idx[out] = arg;
            best_val[out] = best;
        }
    }
}

// ---- block-wide helpers (blockDim.x a multiple of 32, at most 1024) ----------------

template <typename V>
__device__ __forceinline__ V block_exclusive_sum(V v, V* s /* [33] */, V& total) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    V inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        const V o = __shfl_up_sync(kFullMask, inc, off);
        if (lane >= off) inc += o;
    }
    if (lane == 31) s[wid] = inc;
    __syncthreads();
    if (wid == 0) {
        const V w = lane < nw ? s[lane] : V(0);
        V winc = w;
        for (int off = 1; off < 32; off <<= 1) {
            const V o = __shfl_up_sync(kFullMask, winc, off);
            if (lane >= off) winc += o;
        }
        if (lane < nw) s[lane] = winc - w;
        if (lane == 31) s[32] = winc;
    }
    __syncthreads();
    const V excl = s[wid] + inc - v;
    total = s[32];
    __syncthreads();  // s is reused by the next call
    return excl;
}

// Sum in a fixed tree (deterministic for a given blockDim); result valid in thread 0.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* s /* [32] */) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) v = acc_add(v, __shfl_down_sync(kFullMask, v, off));
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? s[lane] : A(0);
        for (int off = 16; off > 0; off >>= 1) v = acc_add(v, __shfl_down_sync(kFullMask, v, off));
    }
    __syncthreads();
    return v;
}

__device__ __forceinline__ i64 block_max(i64 v, i64* s /* [32] */) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        const i64 o = __shfl_down_sync(kFullMask, v, off);
        v = o > v ? o : v;
    }
    if (lane == 0) s[wid] = v;
    __syncthreads();
    if (wid == 0) {
        v = lane < nw ? s[lane] : 0;
        for (int off = 16; off > 0; off >>= 1) {
            const i64 o = __shfl_down_sync(kFullMask, v, off);
            v = o > v ? o : v;
        }
    }
    __syncthreads();
    return v;
}

// status: [0] ticket counter (zeroed by the host), [1] total labels, [2] longest,
// [3] padded only: batch - (first b with sequence_length[b] > max_time), 0 if none.
template <typename A, bool LOD>
__device__ void ctc_emit_scan_impl(const int* __restrict__ best_idx, const A* __restrict__ best_val,
                                   const int* __restrict__ seq_len, const i64* __restrict__ offsets,
                                   i64 max_time, i64 batch, int blank, int merge_repeated,
                                   int* __restrict__ pos, A* __restrict__ neg_sum,
                                   i64* counts, i64* __restrict__ row_start,
                                   u64* __restrict__ status, i64* __restrict__ dense_shape) {
    __shared__ int s_scan[33];
    __shared__ A s_sum[32];
    __shared__ i64 s_scan64[33];
    __shared__ i64 s_max[32];
    __shared__ int s_last;
    for (i64 b = blockIdx.x; b < batch; b += gridDim.x) {
        i64 start, len;
        utterance_span<LOD>(b, seq_len, offsets, max_time, start, len);
        if (!LOD && threadIdx.x == 0 && seq_len[b] > max_time)
            atomicMax(&status[3], static_cast<u64>(batch - b));
        int carry = 0;
        A part = A(0);
        for (i64 t0 = 0; t0 < len; t0 += blockDim.x) {
            const i64 t = t0 + threadIdx.x;
            int emit = 0;
            if (t < len) {
                const int a = best_idx[start + t];
                const int prev = t > 0 ? best_idx[start + t - 1] : -1;
                emit = (a != blank) && !(merge_repeated && a == prev);
                part = acc_add(part, negate(best_val[start + t]));
            }
            int chunk_total;
            const int excl = block_exclusive_sum(emit, s_scan, chunk_total);
            if (t < len) pos[start + t] = emit ? carry + excl : -1;
            carry += chunk_total;
        }
        const A sum = block_sum(part, s_sum);
        if (threadIdx.x == 0) {
            counts[b] = carry;
            neg_sum[b] = sum;
        }
    }
    // The last block to finish turns the counts into row starts.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&status[0], 1ULL) == static_cast<u64>(gridDim.x) - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const volatile i64* all_counts = counts;  // written by other blocks: bypass L1
    i64 carry = 0, longest = 0;
    for (i64 b0 = 0; b0 < batch; b0 += blockDim.x) {
        const i64 b = b0 + threadIdx.x;
        const i64 c = b < batch ? all_counts[b] : 0;
        i64 chunk_total;
        const i64 excl = block_exclusive_sum(c, s_scan64, chunk_total);
        if (b < batch) row_start[b] = carry + excl;
        carry += chunk_total;
        longest = c > longest ? c : longest;
    }
    longest = block_max(longest, s_max);
    if (threadIdx.x == 0) {
        status[1] = static_cast<u64>(carry);
        status[2] = static_cast<u64>(longest);
        dense_shape[0] = batch;
        dense_shape[1] = longest;
    }
}

template <bool LOD>
__device__ void ctc_compact_impl(const int* __restrict__ best_idx, const int* __restrict__ pos,
                                 const int* __restrict__ seq_len, const i64* __restrict__ offsets,
                                 const i64* __restrict__ row_start, i64 max_time, i64 batch,
                                 i64* __restrict__ indices, i64* __restrict__ values) {
    for (i64 b = blockIdx.x; b < batch; b += gridDim.x) {
        i64 start, len;
        utterance_span<LOD>(b, seq_len, offsets, max_time, start, len);
        const i64 base = row_start[b];
        for (i64 t = threadIdx.x; t < len; t += blockDim.x) {
            const int p = pos[start + t];
            if (p >= 0) {
                const i64 j = base + p;
                indices[2 * j] = b;
                indices[2 * j + 1] = p;
                values[j] = best_idx[start + t];
            }
        }
    }
}

}  // namespace rl

// ---- extern "C" entry points (names used by readerlib/kernels/_gpu.py) -----------

#define RL_CTC_ARGMAX(NAME, T)                                                              \
    extern "C" __global__ void ctc_frame_argmax_padded_##NAME(                              \
        const T* __restrict__ logits, const int* __restrict__ seq_len, i64 max_time,        \
        i64 batch, int num_classes, int* __restrict__ best_idx,                             \
        rl::Acc<T>::type* __restrict__ best_val) {                                          \
        rl::ctc_frame_argmax_impl<T, 16 / sizeof(T), false>(                                \
            logits, seq_len, max_time, batch, max_time * batch, num_classes, best_idx,      \
            best_val);                                                                      \
    }                                                                                       \
    extern "C" __global__ void ctc_frame_argmax_lod_##NAME(                                 \
        const T* __restrict__ logits, i64 n_frames, int num_classes,                        \
        int* __restrict__ best_idx, rl::Acc<T>::type* __restrict__ best_val) {              \
        rl::ctc_frame_argmax_impl<T, 16 / sizeof(T), true>(                                 \
            logits, nullptr, 0, 1, n_frames, num_classes, best_idx, best_val);              \
    }

RL_CTC_ARGMAX(float16, rl::half_t)
RL_CTC_ARGMAX(bfloat16, rl::bf16_t)
RL_CTC_ARGMAX(float32, float)
RL_CTC_ARGMAX(float64, double)

// <acc> is the accumulator dtype: float32 for float16/bfloat16/float32 logits.
#define RL_CTC_SCAN(NAME, A)                                                                \
    extern "C" __global__ void ctc_emit_scan_padded_##NAME(                                 \
        const int* __restrict__ best_idx, const A* __restrict__ best_val,                   \
        const int* __restrict__ seq_len, i64 max_time, i64 batch, int blank,                \
        int merge_repeated, int* __restrict__ pos, A* __restrict__ neg_sum, i64* counts,    \
        i64* __restrict__ row_start, u64* __restrict__ status, i64* __restrict__ dense_shape) { \
        rl::ctc_emit_scan_impl<A, false>(best_idx, best_val, seq_len, nullptr, max_time,    \
                                         batch, blank, merge_repeated, pos, neg_sum, counts, \
                                         row_start, status, dense_shape);                   \
    }                                                                                       \
    extern "C" __global__ void ctc_emit_scan_lod_##NAME(                                    \
        const int* __restrict__ best_idx, const A* __restrict__ best_val,                   \
        const i64* __restrict__ offsets, i64 batch, int blank, int merge_repeated,          \
        int* __restrict__ pos, A* __restrict__ neg_sum, i64* counts,                        \
        i64* __restrict__ row_start, u64* __restrict__ status, i64* __restrict__ dense_shape) { \
        rl::ctc_emit_scan_impl<A, true>(best_idx, best_val, nullptr, offsets, 0, batch,     \
                                        blank, merge_repeated, pos, neg_sum, counts,        \
                                        row_start, status, dense_shape);                    \
    }

RL_CTC_SCAN(float32, float)
RL_CTC_SCAN(float64, double)

extern "C" __global__ void ctc_compact_padded(const int* __restrict__ best_idx,
                                              const int* __restrict__ pos,
                                              const int* __restrict__ seq_len, i64 max_time,
                                              const i64* __restrict__ row_start, i64 batch,
                                              i64* __restrict__ indices,
                                              i64* __restrict__ values) {
    rl::ctc_compact_impl<false>(best_idx, pos, seq_len, nullptr, row_start, max_time, batch,
                                indices, values);
}

extern "C" __global__ void ctc_compact_lod(const int* __restrict__ best_idx,
                                           const int* __restrict__ pos,
                                           const i64* __restrict__ offsets,
                                           const i64* __restrict__ row_start, i64 batch,
                                           i64* __restrict__ indices, i64* __restrict__ values) {
    rl::ctc_compact_impl<true>(best_idx, pos, nullptr, offsets, row_start, 0, batch, indices,
                               values);
}
