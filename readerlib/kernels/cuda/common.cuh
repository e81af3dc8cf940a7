// readerlib/kernels/cuda/common.cuh -- helpers shared by the readerlib CUDA sources.
//
// These sources are compiled twice: by NVRTC at run time (CuPy's RawModule, through
// readerlib/kernels/_cuda_loader.py, which pastes this header in place of its
// #include with #line markers) and by nvcc in CI (tools/check_cuda.sh).  So:
//   * no #include of any CUDA or C++ header: NVRTC has none on its path, and the
//     builtins (uint4, __shfl_xor_sync, atomicMax, __uint_as_float ...) are enough;
//   * no float arithmetic or comparison that the compiler may flush to zero.  CuPy
//     compiles every RawModule with -ftz=true, appended after the caller's options
//     (so -ftz=false cannot override it), and a flushed subnormal would make the GPU
//     disagree bitwise with the CPU kernels.  Single-precision adds and comparisons go
//     through the inline PTX below, which names no .ftz; tests/gpu/test_cuda_sources.py
//     checks that the PTX of every kernel holds no .ftz instruction.
#ifndef READERLIB_CUDA_COMMON_CUH
#define READERLIB_CUDA_COMMON_CUH

typedef long long i64;
typedef unsigned long long u64;

namespace rl {

constexpr unsigned kFullMask = 0xffffffffu;

// 16-bit floats are carried as their bits: no cuda_fp16.h / cuda_bf16.h needed,
// and the conversions below are exact (widening) or round to nearest even.
struct half_t { unsigned short bits; };
struct bf16_t { unsigned short bits; };

// A word of `Bytes` bytes, the unit of a vectorised load or store.
template <int Bytes> struct Word;
template <> struct Word<1> { typedef unsigned char type; };
template <> struct Word<2> { typedef unsigned short type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<8> { typedef u64 type; };
template <> struct Word<16> { typedef uint4 type; };

// N elements of T loaded or stored as one word of sizeof(T) * N bytes
// (one LDG.128 for 16 bytes).  The pointer must be aligned to that size.
template <typename T, int N>
union Pack {
    typedef typename Word<sizeof(T) * N>::type word_type;
    T v[N];
    word_type word;
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const Pack<T, N>* __restrict__ p) {
    Pack<T, N> r;
    r.word = *reinterpret_cast<const typename Pack<T, N>::word_type*>(p);
    return r;
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(Pack<T, N>* __restrict__ p, const Pack<T, N>& v) {
    *reinterpret_cast<typename Pack<T, N>::word_type*>(p) = v.word;
}

// ---- exact float helpers (never flush subnormals, whatever -ftz says) ---------

#ifdef READERLIB_CUDA_EMULATION
// tests/support/cuda_emu runs these sources on the CPU (g++, x86-64 SSE: IEEE round to nearest,
// no flush-to-zero), where the plain operators are exactly what the PTX below does.
__device__ __forceinline__ float f32_add(float a, float b) { return a + b; }
__device__ __forceinline__ bool f32_gt(float a, float b) { return a > b; }
__device__ __forceinline__ bool f32_eq(float a, float b) { return a == b; }
#else
__device__ __forceinline__ float f32_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ bool f32_gt(float a, float b) {
    unsigned r;
    asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}

__device__ __forceinline__ bool f32_eq(float a, float b) {
    unsigned r;
    asm("{\n\t.reg .pred p;\n\tsetp.eq.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
#endif

// Bit tests, not compares: nothing here may carry .ftz.
__device__ __forceinline__ bool is_nan(float a) {
    return (__float_as_uint(a) & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ bool is_nan(double a) {
    return (static_cast<u64>(__double_as_longlong(a)) & 0x7fffffffffffffffULL) >
           0x7ff0000000000000ULL;
}
__device__ __forceinline__ float negate(float a) {
    return __uint_as_float(__float_as_uint(a) ^ 0x80000000u);
}
__device__ __forceinline__ double negate(double a) { return -a; }

// Overloads so templates can write acc_add / gt / eq for any accumulator type.
// (Double precision is never flushed, so plain operators are exact there.)
__device__ __forceinline__ float acc_add(float a, float b) { return f32_add(a, b); }
__device__ __forceinline__ double acc_add(double a, double b) { return a + b; }
__device__ __forceinline__ unsigned acc_add(unsigned a, unsigned b) { return a + b; }
__device__ __forceinline__ u64 acc_add(u64 a, u64 b) { return a + b; }

__device__ __forceinline__ bool gt(float a, float b) { return f32_gt(a, b); }
__device__ __forceinline__ bool gt(double a, double b) { return a > b; }
__device__ __forceinline__ bool eq(float a, float b) { return f32_eq(a, b); }
__device__ __forceinline__ bool eq(double a, double b) { return a == b; }

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

// ---- storage type <-> accumulator type -----------------------------------------
// Acc<T>::type is what sums and comparisons run in: float for 16-bit floats (the
// CPU kernels accumulate float16 in float32 and round once), wrap-around unsigned
// arithmetic for integers (no signed-overflow UB; the bits equal NumPy's wrapping).

template <typename T> struct Acc;
template <> struct Acc<float> { typedef float type; };
template <> struct Acc<double> { typedef double type; };
template <> struct Acc<half_t> { typedef float type; };
template <> struct Acc<bf16_t> { typedef float type; };
template <> struct Acc<int> { typedef unsigned type; };
template <> struct Acc<long long> { typedef u64 type; };
template <> struct Acc<unsigned char> { typedef unsigned type; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(half_t x) {
#ifdef READERLIB_CUDA_EMULATION
    _Float16 h;  // GCC's IEEE binary16: the conversions round as cvt does
    __builtin_memcpy(&h, &x.bits, 2);
    return static_cast<float>(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
#endif
}
__device__ __forceinline__ float to_acc(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}
__device__ __forceinline__ unsigned to_acc(int x) { return static_cast<unsigned>(x); }
__device__ __forceinline__ u64 to_acc(long long x) { return static_cast<u64>(x); }
__device__ __forceinline__ unsigned to_acc(unsigned char x) { return x; }

template <typename T> __device__ __forceinline__ T from_acc(typename Acc<T>::type a);
template <> __device__ __forceinline__ float from_acc<float>(float a) { return a; }
template <> __device__ __forceinline__ double from_acc<double>(double a) { return a; }
template <> __device__ __forceinline__ half_t from_acc<half_t>(float a) {
    half_t h;
#ifdef READERLIB_CUDA_EMULATION
    const _Float16 v = static_cast<_Float16>(a);
    __builtin_memcpy(&h.bits, &v, 2);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(a));
#endif
    return h;
}
template <> __device__ __forceinline__ int from_acc<int>(unsigned a) { return static_cast<int>(a); }
template <> __device__ __forceinline__ long long from_acc<long long>(u64 a) {
    return static_cast<long long>(a);
}
template <> __device__ __forceinline__ unsigned char from_acc<unsigned char>(unsigned a) {
    return static_cast<unsigned char>(a);
}

// ---- grid-stride helpers -----------------------------------------------------------

__device__ __forceinline__ i64 global_thread() {
    return static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ i64 grid_threads() {
    return static_cast<i64>(gridDim.x) * blockDim.x;
}

// Largest of a warp's values (all 32 lanes must call).
__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    for (int off = 16; off > 0; off >>= 1) {
        const u64 o = __shfl_xor_sync(kFullMask, v, off);
        v = o > v ? o : v;
    }
    return v;
}

__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
    return v;
}

}  // namespace rl

#endif  // READERLIB_CUDA_COMMON_CUH
