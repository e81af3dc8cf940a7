// Fused bookkeeping kernels for batched greedy RNN-T decoding (GPU).
//
// Design:
//   Mirrors readerlib/rnnt/_rnnt_cpu.pyx kernel for kernel (same arguments,
//   same semantics) so that decode.py drives both with one control flow.
//   The matrix products (predictor, joint) are cuBLAS calls made by CuPy;
//   everything between two products is one launch here:
//
//   * *_joint_step: one block (RNNT_THREADS threads) per utterance row; for
//     loop labels the row's `window` frames are scanned in order (stopping at
//     the first label or the row's end; frames after it are not reduced); the
//     block reduces argmax (ties -> lowest index, NaN -> the first NaN, as
//     numpy.argmax) and
//     sum(exp(x - max)) in double, then thread 0 does the row's bookkeeping
//     (labels, scores, time indices, active/advance masks, hypothesis and
//     alignment writes) and raises flag[0] when the row needs more work.
//     Reads the logits once (n x V), writes O(n) words.
//   * loop_labels_store: one thread per row, appends the found labels and
//     applies max_symbols; raises flag[0] for rows still active.
//   * masked_replace_rows: grid-stride copy dst[b, :] = src[b, :] where mask[b].
//
//   flag[0] (some row needs more work) and flag[1] (loop labels: some row
//   was processed, i.e. was active) are the only values the host reads per
//   loop iteration (8 bytes); the host zeroes them before the launches it
//   reads.  Rows are given as a list
//   (rows[r] = batch index of logits row r); the GPU decoder passes
//   arange(B) and masks do the selection, so no compaction (and no host
//   read of a row count) is needed.  Capacities (hyp_cap, al_cap) are
//   guaranteed by the host; the kernels still clamp as a last line of defence.
//
// Invariants (loop labels): active[b] == (time[b] < lengths[b]); advance[b]
// implies active[b] and labels[b] == blank; safe_time[b] ==
// min(time[b], lengths[b] - 1).

#define RNNT_THREADS 256

typedef long long i64;
typedef unsigned char u8;

template <typename T>
__device__ __forceinline__ void block_argmax_logsoftmax(const T* __restrict__ x, i64 V,
                                                        i64* k_out, double* lp_out) {
    __shared__ double s_val[RNNT_THREADS];
    __shared__ i64 s_idx[RNNT_THREADS];
    const int tid = threadIdx.x;
    double m = 0.0;
    i64 k = V;  // "none yet"; any real index wins
    for (i64 j = tid; j < V; j += RNNT_THREADS) {
        double v = (double)x[j];
        // numpy.argmax's rule: the first NaN wins, else the first maximum
        if (k == V || v > m || (v != v && m == m)) { m = v; k = j; }
    }
    s_val[tid] = m;
    s_idx[tid] = k;
    __syncthreads();
    for (int s = RNNT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            double vo = s_val[tid + s];
            i64 ko = s_idx[tid + s];
            const double sv = s_val[tid];
            const i64 sk = s_idx[tid];
            const bool on = vo != vo, sn = sv != sv;
            // a NaN beats a number; among NaNs, or equal numbers, the lower index
            const bool take = ko != V && (sk == V || (on != sn ? on :
                                                      on ? ko < sk : (vo > sv || (vo == sv && ko < sk))));
            if (take) {
                s_val[tid] = vo;
                s_idx[tid] = ko;
            }
        }
        __syncthreads();
    }
    const double mx = s_val[0];
    const i64 kx = s_idx[0];
    __syncthreads();
    double acc = 0.0;
    for (i64 j = tid; j < V; j += RNNT_THREADS) acc += exp((double)x[j] - mx);
    s_val[tid] = acc;
    __syncthreads();
    for (int s = RNNT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) s_val[tid] += s_val[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        *k_out = kx;
        *lp_out = -log(s_val[0]);
    }
    __syncthreads();
}

// Append (label, frame, log-prob) to row b's alignment, if it has room.
__device__ __forceinline__ void record_alignment(i64 b, i64 k, i64 t, double lp, i64* al_labels,
                                                 i64* al_times, double* al_logp, i64* al_len, i64 al_cap) {
    const i64 pos = al_len[b];
    if (pos < al_cap) {
        al_labels[b * al_cap + pos] = k;
        al_times[b * al_cap + pos] = t;
        al_logp[b * al_cap + pos] = lp;
        al_len[b] = pos + 1;
    }
}

template <typename T>
__device__ void loop_labels_joint_step_impl(
        const T* __restrict__ logits, i64 V, const i64* __restrict__ rows, i64 n, i64 window,
        int first, i64 blank, i64* labels, double* scores, i64* time, i64* time_cur, i64* safe_time,
        const i64* __restrict__ lengths, u8* active, u8* advance,
        int record, i64* al_labels, i64* al_times, double* al_logp, i64* al_len, i64 al_cap,
        int* flag) {
    // logits[(r * window + w) * V ...] is row rows[r] at frame time[b] + w; the
    // window is scanned in order and the scan stops at the first label.
    __shared__ i64 s_k;
    __shared__ double s_lp;
    __shared__ int s_go;
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const i64 b = rows[r];
        // uniform across the block: every thread reads the same mask byte
        if (!(first ? active[b] : advance[b])) continue;
        if (threadIdx.x == 0) flag[1] = 1;  // some row was processed (host: "any active")
        i64 t = time[b];  // only thread 0's copy is authoritative
        bool act = true, is_blank = false;
        for (i64 w = 0; w < window; ++w) {
            block_argmax_logsoftmax<T>(logits + (r * window + w) * V, V, &s_k, &s_lp);
            if (threadIdx.x == 0) {
                const i64 k = s_k;
                labels[b] = k;
                scores[b] = s_lp;
                time_cur[b] = t;
                if (record) record_alignment(b, k, t, s_lp, al_labels, al_times, al_logp, al_len, al_cap);
                is_blank = k == blank;
                int go = 0;
                if (is_blank) {
                    t += 1;
                    if (t >= lengths[b]) act = false; else go = 1;
                }
                s_go = go;
            }
            __syncthreads();
            const int go = s_go;
            __syncthreads();  // s_go / s_k are rewritten by the next window element
            if (!go) break;
        }
        if (threadIdx.x == 0) {
            time[b] = t;
            const i64 last = lengths[b] - 1;
            safe_time[b] = t < last ? t : last;
            active[b] = act;
            advance[b] = act && is_blank;
            if (act && is_blank) flag[0] = 1;
        }
        __syncthreads();
    }
}

template <typename T>
__device__ void loop_frames_joint_step_impl(
        const T* __restrict__ logits, i64 V, i64 B, i64 t, i64 blank, u8* done, i64* last_label,
        u8* emitted, i64* hyp_labels, i64* hyp_times, i64* hyp_len, i64 hyp_cap, double* hyp_score,
        int record, i64* al_labels, i64* al_times, double* al_logp, i64* al_len, i64 al_cap,
        int* flag) {
    __shared__ i64 s_k;
    __shared__ double s_lp;
    for (i64 b = blockIdx.x; b < B; b += gridDim.x) {
        if (done[b]) {
            if (threadIdx.x == 0) emitted[b] = 0;
            continue;
        }
        block_argmax_logsoftmax<T>(logits + b * V, V, &s_k, &s_lp);
        if (threadIdx.x == 0) {
            const i64 k = s_k;
            emitted[b] = 0;
            if (record) record_alignment(b, k, t, s_lp, al_labels, al_times, al_logp, al_len, al_cap);
            if (k == blank) {
                done[b] = 1;
            } else {
                const i64 pos = hyp_len[b];
                if (pos < hyp_cap) {
                    hyp_labels[b * hyp_cap + pos] = k;
                    hyp_times[b * hyp_cap + pos] = t;
                    hyp_len[b] = pos + 1;
                }
                hyp_score[b] += s_lp;
                last_label[b] = k;
                emitted[b] = 1;
                flag[0] = 1;
            }
        }
        __syncthreads();
    }
}

template <typename T>
__device__ void masked_replace_rows_impl(T* dst, const T* __restrict__ src, const u8* __restrict__ mask,
                                         i64 B, i64 K) {
    const i64 total = B * K;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        if (mask[i / K]) dst[i] = src[i];
    }
}

extern "C" {

#define RNNT_JOINT_STEP(NAME, T)                                                                 \
__global__ void __launch_bounds__(RNNT_THREADS) loop_labels_joint_step_##NAME(                   \
        const T* logits, i64 V, const i64* rows, i64 n, i64 window, int first, i64 blank,        \
        i64* labels, double* scores, i64* time, i64* time_cur, i64* safe_time, const i64* lengths, \
        u8* active, u8* advance, int record, i64* al_labels, i64* al_times, double* al_logp,     \
        i64* al_len, i64 al_cap, int* flag) {                                                    \
    loop_labels_joint_step_impl<T>(logits, V, rows, n, window, first, blank, labels, scores, time, \
                                   time_cur, safe_time, lengths, active, advance, record,        \
                                   al_labels, al_times, al_logp, al_len, al_cap, flag);          \
}                                                                                                \
__global__ void __launch_bounds__(RNNT_THREADS) loop_frames_joint_step_##NAME(                   \
        const T* logits, i64 V, i64 B, i64 t, i64 blank, u8* done, i64* last_label, u8* emitted, \
        i64* hyp_labels, i64* hyp_times, i64* hyp_len, i64 hyp_cap, double* hyp_score,          \
        int record, i64* al_labels, i64* al_times, double* al_logp, i64* al_len, i64 al_cap,     \
        int* flag) {                                                                             \
    loop_frames_joint_step_impl<T>(logits, V, B, t, blank, done, last_label, emitted,            \
                                   hyp_labels, hyp_times, hyp_len, hyp_cap, hyp_score, record,   \
                                   al_labels, al_times, al_logp, al_len, al_cap, flag);          \
}

RNNT_JOINT_STEP(float32, float)
RNNT_JOINT_STEP(float64, double)

#define RNNT_REPLACE(NAME, T)                                                                    \
__global__ void masked_replace_rows_##NAME(T* dst, const T* src, const u8* mask, i64 B, i64 K) { \
    masked_replace_rows_impl<T>(dst, src, mask, B, K);                                           \
}

RNNT_REPLACE(float32, float)
RNNT_REPLACE(float64, double)
RNNT_REPLACE(int64, i64)

__global__ void loop_labels_store(
        const i64* rows, i64 n, i64 max_symbols, const i64* labels, const double* scores,
        i64* time, const i64* time_cur, i64* safe_time, const i64* lengths, u8* active,
        i64* hyp_labels, i64* hyp_times, i64* hyp_len, i64 hyp_cap, double* hyp_score,
        i64* last_ts, i64* ts_count, int* flag) {
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += (i64)gridDim.x * blockDim.x) {
        const i64 b = rows[r];
        if (!active[b]) continue;
        const i64 pos = hyp_len[b];
        const i64 tc = time_cur[b];
        if (pos < hyp_cap) {
            hyp_labels[b * hyp_cap + pos] = labels[b];
            hyp_times[b * hyp_cap + pos] = tc;
            hyp_len[b] = pos + 1;
        }
        hyp_score[b] += scores[b];
        if (last_ts[b] == tc) {
            ts_count[b] += 1;
        } else {
            last_ts[b] = tc;
            ts_count[b] = 1;
        }
        if (max_symbols > 0 && ts_count[b] >= max_symbols) {
            const i64 t = time[b] + 1;
            time[b] = t;
            const i64 last = lengths[b] - 1;
            safe_time[b] = t < last ? t : last;
            if (t >= lengths[b]) {
                active[b] = 0;
                continue;
            }
        }
        flag[0] = 1;
    }
}

}  // extern "C"
