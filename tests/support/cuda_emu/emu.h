// tests/cuda_emu/emu.h -- run readerlib's CUDA kernels on the CPU, for tests.
//
// tests/support/cuda_emu.py compiles a .cu file (as readerlib/kernels/_cuda_loader.py gives it
// to NVRTC) with g++ and `-include emu.h`, so the kernel code itself -- index
// arithmetic, warp shuffles, block barriers, shared memory, atomics -- executes on
// this machine, on host memory, and its output can be compared with the NumPy
// references without a GPU.  What runs is the real source; only common.cuh's four
// inline-PTX helpers have plain C++ twins (under READERLIB_CUDA_EMULATION).
//
// Model:
//   * one block at a time; its threads are fibers on one OS thread (a 20-line stack
//     switch on x86-64, ucontext elsewhere: glibc's swapcontext makes a system
//     call per switch, 30x slower), so a
//     launch is deterministic and `__shared__` can simply be `static`;
//   * a fiber runs until it reaches __syncthreads() or a __shfl_*_sync(); the
//     scheduler releases a barrier when every live thread of the block waits at it,
//     and a shuffle when every lane named in its mask waits at it (values are
//     exchanged at release, as the hardware does);
//   * what real hardware leaves undefined is reported as a launch error instead of
//     being papered over: threads of one block waiting at different barriers, lanes
//     of one warp at different shuffles or with different masks, a shuffle naming a
//     lane that has exited or does not exist, launch shapes beyond CUDA's limits,
//     and deadlock.  (A barrier does release when some threads of the block have
//     exited, as the hardware does since Volta; CUDA calls that undefined.)
//   * shared memory starts each block poisoned (0xA5), static and dynamic.
//   * between two sync points the threads of a block run one after another, first
//     to last in even blocks and last to first in odd ones, so a missing barrier
//     (reading another thread's shared-memory write too early) shows as a wrong
//     result in one of the two orders.
// Not modelled: NaN payloads (x86 propagates an input NaN's payload; GPU arithmetic
// may return a canonical NaN instead -- the tests compare NaNs as equal),
// __launch_bounds__ (ignored), concurrency between blocks (blocks run in order, so a kernel that
// spins waiting for a later block would deadlock -- none of ours does), finer
// interleavings within a block, and out-of-bounds accesses (nothing checks
// addresses beyond what the host arrays give).
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define READERLIB_CUDA_EMULATION 1
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static __shared__ variables go to one ELF section, so each block can start with
// them poisoned (0xA5 bytes) like real shared memory starts undefined: a read
// before any write shows as a wrong value instead of the previous block's data.
#define __shared__ static __attribute__((section("rlemu_shared"), aligned(16)))
extern "C" char __start_rlemu_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_rlemu_shared[] __attribute__((weak, visibility("hidden")));

struct dim3 {
    unsigned x, y, z;
};
typedef dim3 uint3;
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

namespace rl_emu {

inline void entry();

#if defined(__x86_64__) && !defined(RLEMU_UCONTEXT)
// A fiber is its saved stack pointer; the callee-saved registers, MXCSR and the x87
// control word sit on its stack (System V x86-64 ABI).
struct Context {
    void* sp;
};
extern "C" void rlemu_switch(void** save_sp, void* load_sp);
__asm__(R"(
    .pushsection .text
    .p2align 4
    .hidden rlemu_switch
    .globl rlemu_switch
    .type rlemu_switch, @function
rlemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size rlemu_switch, .-rlemu_switch
    .popsection
)");

inline Context* sched_ptr();
[[noreturn]] inline void trampoline();

inline void switch_to(Context* save, Context* load) { rlemu_switch(&save->sp, load->sp); }

inline void make_context(Context* c, char* stack, size_t size) {
    // Top of stack, 16-byte aligned; `ret` into trampoline leaves rsp = 8 mod 16, as a
    // call would.  Below the return address: rbp, rbx, r12-r15 (zero) and the saved
    // MXCSR / x87 control word (the current ones).
    uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~static_cast<uintptr_t>(15);
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;  // padding: trampoline's frame starts 16-aligned minus 8
    *--sp = reinterpret_cast<uint64_t>(&trampoline);
    for (int r = 0; r < 6; ++r) *--sp = 0;
    uint32_t mxcsr;
    uint16_t fpcw;
    __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(fpcw));
    *--sp = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpcw) << 32);
    c->sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline Context* sched_ptr();
inline void switch_to(Context* save, Context* load) { swapcontext(&save->uc, &load->uc); }
inline void make_context(Context* c, char* stack, size_t size) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = &sched_ptr()->uc;
    makecontext(&c->uc, entry, 0);
}
#endif

enum State { RUNNABLE, AT_BARRIER, AT_SHUFFLE, DONE };
enum ShflKind { SHFL_XOR, SHFL_UP, SHFL_DOWN, SHFL_IDX };

struct Fiber {
    Context ctx;
    uint3 tid;
    State state;
    const char* file;  // source file and line of the barrier / shuffle it waits at
    int line;
    // shuffle request and result
    uint64_t value, result;
    int kind, arg, width;
    unsigned mask;
};

inline Fiber* cur = nullptr;
inline dim3 block_idx, block_dim, grid_dim;
inline Context sched;
inline std::vector<Fiber> fibers;
inline char* stacks = nullptr;
inline size_t stacks_count = 0;
constexpr size_t kStack = 128 * 1024;
inline std::vector<unsigned char> dyn_shared;
inline void (*thunk)(void**) = nullptr;
inline void** thunk_args = nullptr;
inline std::mutex launch_mutex;
inline unsigned launch_count = 0;

inline void yield() { switch_to(&cur->ctx, &sched); }

inline void syncthreads(const char* file, int line) {
    cur->state = AT_BARRIER;
    cur->file = file;
    cur->line = line;
    yield();
}

struct ShflAt {
    const char* file;
    int line, kind;
    template <typename T>
    T call(unsigned mask, T v, int arg, int width = 32) {
        static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle type");
        uint64_t bits = 0;
        std::memcpy(&bits, &v, sizeof(T));
        cur->value = bits;
        cur->kind = kind;
        cur->arg = arg;
        cur->width = width;
        cur->mask = mask;
        cur->file = file;
        cur->line = line;
        cur->state = AT_SHUFFLE;
        yield();
        T r;
        std::memcpy(&r, &cur->result, sizeof(T));
        return r;
    }
};

// "reindex.cu:123" for messages.
inline std::string site(const char* file, int line) {
    std::string f = file ? file : "?";
    const size_t slash = f.rfind('/');
    if (slash != std::string::npos) f = f.substr(slash + 1);
    return f + ":" + std::to_string(line);
}

inline std::string hex(unsigned v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%#x", v);
    return buf;
}

inline void* dynamic_shared() { return dyn_shared.data(); }

inline void entry() {
    thunk(thunk_args);
    cur->state = DONE;
}

inline Context* sched_ptr() { return &sched; }

#if defined(__x86_64__) && !defined(RLEMU_UCONTEXT)
[[noreturn]] inline void trampoline() {
    entry();
    switch_to(&cur->ctx, &sched);  // a finished fiber is never resumed
    __builtin_unreachable();
}
#endif

inline const char* state_name(State s) {
    switch (s) {
        case RUNNABLE: return "runnable";
        case AT_BARRIER: return "__syncthreads";
        case AT_SHUFFLE: return "shuffle";
        default: return "exited";
    }
}

// Release every group of warp `w`'s lanes waiting at a shuffle whose mask's lanes
// have all arrived (several groups may wait at once: half-warps with their own
// masks).  Returns 1 if one was released, 0 if none is ready, -1 on an error.
// Semantics of __shfl_*_sync (CUDA Programming Guide, PTX shfl.sync): the lane
// offset uses its low 5 bits; with width < 32 each group of `width` lanes reads
// within itself (xor may reach an earlier group), and an out-of-range source
// gives the lane its own value.
inline int try_release_warp(int w, int n, std::string& err) {
    const int lo = 32 * w, hi = lo + 32 < n ? lo + 32 : n;
    unsigned handled = 0;
    int released = 0;
    for (int i = lo; i < hi; ++i) {
        const Fiber& a = fibers[i];
        if (a.state != AT_SHUFFLE || (handled >> (i - lo) & 1u)) continue;
        const unsigned mask = a.mask;
        if (!(mask & (1u << (i - lo)))) {
            err = site(a.file, a.line) + ": lane " + std::to_string(i - lo) + " of warp " +
                  std::to_string(w) + " shuffles with mask " + hex(mask) + ", which omits itself";
            return -1;
        }
        bool ready = true;
        for (int j = lo; j < lo + 32; ++j) {
            if (!(mask & (1u << (j - lo)))) continue;
            if (j >= hi) {
                err = site(a.file, a.line) + ": shuffle mask " + hex(mask) + " names lane " +
                      std::to_string(j - lo) + ", which this block (" + std::to_string(n) +
                      " threads) does not have";
                return -1;
            }
            const Fiber& b = fibers[j];
            if (b.state == DONE) {
                err = site(a.file, a.line) + ": shuffle mask " + hex(mask) + " names lane " +
                      std::to_string(j - lo) + " of warp " + std::to_string(w) +
                      ", which has exited";
                return -1;
            }
            if (b.state != AT_SHUFFLE) {
                ready = false;  // still running, or stuck elsewhere (deadlock is found later)
                continue;
            }
            if (b.mask != mask || b.line != a.line || std::strcmp(b.file, a.file) ||
                b.kind != a.kind) {
                err = "warp " + std::to_string(w) + ": lanes at different shuffles (lane " +
                      std::to_string(i - lo) + " at " + site(a.file, a.line) + " mask " +
                      hex(mask) + ", lane " + std::to_string(j - lo) + " at " +
                      site(b.file, b.line) + " mask " + hex(b.mask) + ")";
                return -1;
            }
        }
        handled |= mask;
        if (!ready) continue;
        for (int j = lo; j < hi; ++j) {
            if (!(mask & (1u << (j - lo)))) continue;
            Fiber& f = fibers[j];
            const int lane = j - lo, width = f.width, off = f.arg & 31;
            if (width < 1 || width > 32 || (width & (width - 1))) {
                err = site(f.file, f.line) + ": shuffle width " + std::to_string(width) +
                      " is not a power of two <= 32";
                return -1;
            }
            const int seg = lane & ~(width - 1);
            int src = lane;
            switch (f.kind) {
                case SHFL_XOR: src = lane ^ off; if (src >= seg + width) src = lane; break;
                case SHFL_UP: src = lane - off; if (src < seg) src = lane; break;
                case SHFL_DOWN: src = lane + off; if (src >= seg + width) src = lane; break;
                default: src = seg + (f.arg & (width - 1)); break;
            }
            if (!(mask & (1u << src))) {
                err = site(f.file, f.line) + ": lane " + std::to_string(lane) + " of warp " +
                      std::to_string(w) + " reads lane " + std::to_string(src) +
                      ", which is not in the shuffle's mask " + hex(mask);
                return -1;
            }
            f.result = fibers[lo + src].value;
        }
        for (int j = lo; j < hi; ++j)
            if (mask & (1u << (j - lo))) fibers[j].state = RUNNABLE;
        released = 1;
    }
    return released;
}

inline std::string where(int n) {
    std::string s;
    for (int i = 0; i < n && s.size() < 400; ++i) {
        const Fiber& f = fibers[i];
        if (f.state == DONE) continue;
        s += " thread " + std::to_string(i) + ": " + state_name(f.state);
        if (f.state != RUNNABLE) s += " at " + site(f.file, f.line);
        s += ";";
    }
    return s;
}

// Run one block to completion.  Returns false with `err` set on an error.
// `reverse`: run the threads last to first between sync points, so that a read of
// another thread's write with no barrier between them sees the wrong value in one of
// the two orders (odd blocks use the reverse order).
inline bool run_block(int n, bool reverse, std::string& err) {
    for (;;) {
        bool ran = false;
        for (int j = 0; j < n; ++j) {
            const int i = reverse ? n - 1 - j : j;
            if (fibers[i].state != RUNNABLE) continue;
            cur = &fibers[i];
            switch_to(&sched, &fibers[i].ctx);
            ran = true;
        }
        if (ran) continue;
        bool released = false;
        for (int w = 0; w * 32 < n; ++w) {
            const int r = try_release_warp(w, n, err);
            if (r < 0) return false;
            released |= r > 0;
        }
        if (released) continue;
        int live = 0, at_bar = 0, line = -1;
        const char* file = nullptr;
        for (int i = 0; i < n; ++i) {
            if (fibers[i].state == DONE) continue;
            ++live;
            if (fibers[i].state == AT_BARRIER) {
                if (at_bar && (fibers[i].line != line || std::strcmp(fibers[i].file, file))) {
                    err = "threads of one block wait at different __syncthreads (" +
                          site(file, line) + " and " + site(fibers[i].file, fibers[i].line) + ")";
                    return false;
                }
                line = fibers[i].line;
                file = fibers[i].file;
                ++at_bar;
            }
        }
        if (live == 0) return true;
        if (at_bar == live) {
            for (int i = 0; i < n; ++i)
                if (fibers[i].state == AT_BARRIER) fibers[i].state = RUNNABLE;
            continue;
        }
        err = "deadlock:" + where(n);
        return false;
    }
}

inline int launch(const unsigned* grid, const unsigned* block, size_t shmem,
                  void (*kernel_thunk)(void**), void** args, char* errbuf, size_t errlen) {
    std::lock_guard<std::mutex> guard(launch_mutex);
    ++launch_count;  // alternates the thread order of single-block launches too
    const size_t n = static_cast<size_t>(block[0]) * block[1] * block[2];
    std::string err;
    // the limits of every CUDA device since compute capability 3.0 (48 KiB of dynamic
    // shared memory without cudaFuncSetAttribute, which the launchers do not use)
    if (n == 0 || n > 1024 || block[0] > 1024 || block[1] > 1024 || block[2] > 64 ||
        grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 2147483647u ||
        grid[1] > 65535 || grid[2] > 65535 || shmem > 48 * 1024) {
        std::snprintf(errbuf, errlen,
                      "bad launch shape grid (%u,%u,%u) block (%u,%u,%u) dynamic shared %zu B",
                      grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem);
        return 1;
    }
    if (stacks_count < n) {
        if (stacks) munmap(stacks, stacks_count * kStack);
        stacks = static_cast<char*>(mmap(nullptr, n * kStack, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
        if (stacks == MAP_FAILED) {
            stacks = nullptr;
            stacks_count = 0;
            std::snprintf(errbuf, errlen, "emulator: cannot map fiber stacks");
            return 1;
        }
        for (size_t i = 0; i < n; ++i)  // a guard page under each stack: overflow faults
            mprotect(stacks + i * kStack, 4096, PROT_NONE);
        stacks_count = n;
    }
    fibers.assign(n, Fiber());
    thunk = kernel_thunk;
    thunk_args = args;
    grid_dim = dim3{grid[0], grid[1], grid[2]};
    block_dim = dim3{block[0], block[1], block[2]};
    for (unsigned bz = 0; bz < grid[2]; ++bz)
        for (unsigned by = 0; by < grid[1]; ++by)
            for (unsigned bx = 0; bx < grid[0]; ++bx) {
                block_idx = dim3{bx, by, bz};
                dyn_shared.assign(shmem ? shmem : 1, 0xA5);  // poison: unwritten reads show
                {
                    // weak: null when the source declares no static __shared__ at all
                    const uintptr_t a = reinterpret_cast<uintptr_t>(&__start_rlemu_shared[0]);
                    const uintptr_t b = reinterpret_cast<uintptr_t>(&__stop_rlemu_shared[0]);
                    if (a != 0 && b > a) std::memset(reinterpret_cast<void*>(a), 0xA5, b - a);
                }
                for (size_t i = 0; i < n; ++i) {
                    Fiber& f = fibers[i];
                    make_context(&f.ctx, stacks + i * kStack, kStack);
                    f.tid = uint3{static_cast<unsigned>(i % block[0]),
                                  static_cast<unsigned>((i / block[0]) % block[1]),
                                  static_cast<unsigned>(i / (static_cast<size_t>(block[0]) * block[1]))};
                    f.state = RUNNABLE;
                }
                const bool reverse = (bx + by + bz + launch_count) & 1;
                if (!run_block(static_cast<int>(n), reverse, err)) {
                    std::snprintf(errbuf, errlen, "block (%u,%u,%u): %s", bx, by, bz, err.c_str());
                    return 1;
                }
            }
    return 0;
}

template <typename... P, size_t... I>
void call_impl(void (*f)(P...), void** a, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<P>*>(a[I])...);
}
template <typename... P>
void call_with(void (*f)(P...), void** a) {
    call_impl(f, a, std::index_sequence_for<P...>{});
}

template <typename T>
inline T bit_cast(const void* p) {
    T r;
    std::memcpy(&r, p, sizeof(T));
    return r;
}

}  // namespace rl_emu

#define threadIdx (::rl_emu::cur->tid)
#define blockIdx (::rl_emu::block_idx)
#define blockDim (::rl_emu::block_dim)
#define gridDim (::rl_emu::grid_dim)
#define __syncthreads() ::rl_emu::syncthreads(__FILE__, __LINE__)
#define __shfl_xor_sync(...) (::rl_emu::ShflAt{__FILE__, __LINE__, ::rl_emu::SHFL_XOR}.call(__VA_ARGS__))
#define __shfl_up_sync(...) (::rl_emu::ShflAt{__FILE__, __LINE__, ::rl_emu::SHFL_UP}.call(__VA_ARGS__))
#define __shfl_down_sync(...) (::rl_emu::ShflAt{__FILE__, __LINE__, ::rl_emu::SHFL_DOWN}.call(__VA_ARGS__))
#define __shfl_sync(...) (::rl_emu::ShflAt{__FILE__, __LINE__, ::rl_emu::SHFL_IDX}.call(__VA_ARGS__))

inline void __threadfence() {}  // blocks run one after another
inline unsigned __float_as_uint(float x) { return rl_emu::bit_cast<unsigned>(&x); }
inline int __float_as_int(float x) { return rl_emu::bit_cast<int>(&x); }
inline float __uint_as_float(unsigned x) { return rl_emu::bit_cast<float>(&x); }
inline float __int_as_float(int x) { return rl_emu::bit_cast<float>(&x); }
inline long long __double_as_longlong(double x) { return rl_emu::bit_cast<long long>(&x); }
inline double __longlong_as_double(long long x) { return rl_emu::bit_cast<double>(&x); }

// One block runs at a time, so read-modify-write is atomic.
template <typename T>
inline T atomicAdd(T* p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    const T old = *p;
    if (v > old) *p = v;
    return old;
}
template <typename T>
inline T atomicMin(T* p, T v) {
    const T old = *p;
    if (v < old) *p = v;
    return old;
}

// One exported C entry point per kernel (the only symbols the library exports).
#define RLEMU_EXPORT(name)                                                                \
    extern "C" __attribute__((visibility("default"))) int rlemu_launch_##name(            \
        const unsigned* grid, const unsigned* block, size_t shmem, void** args, char* err, \
        size_t errlen) {                                                                   \
        return ::rl_emu::launch(                                                           \
            grid, block, shmem, [](void** a) { ::rl_emu::call_with(&name, a); }, args, err, \
            errlen);                                                                       \
    }
