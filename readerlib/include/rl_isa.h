/* rl_isa.h -- the instruction-set level of the kernels' run-time dispatch
 * (CTC's row argmax, rl_argmax.h; reindex's row loops, rl_gather.h), probed
 * in one place so that every kernel agrees on what the CPU has.
 *
 * Levels: 1 the baseline (SSE2, every x86-64 CPU), 2 AVX2, 3 AVX-512F.  A
 * level is reported only with the ones below it: the AVX-512 bodies are
 * compiled with target("avx512f"), which lets the compiler use AVX2
 * instructions in them too, so a CPU (or a VM whose CPUID masks AVX2) with
 * AVX-512F but not AVX2 is level 1.  __builtin_cpu_supports checks that the
 * OS saves the registers (XGETBV) as well as the CPUID bits. */
#ifndef READERLIB_RL_ISA_H
#define READERLIB_RL_ISA_H

#define RL_ISA_BASE 1
#define RL_ISA_AVX2 2
#define RL_ISA_AVX512 3

static inline int rl_isa_best(void) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return RL_ISA_BASE;
    return __builtin_cpu_supports("avx512f") ? RL_ISA_AVX512 : RL_ISA_AVX2;
#else
    return RL_ISA_BASE;
#endif
}

/* The level to use for a request: 0 the best the CPU has; a level above it
 * falls back to it.  Where rl_isa_best cannot probe (not GCC/Clang on x86)
 * it is the baseline: exactly where rl_argmax.h and rl_gather.h compile no
 * AVX2 / AVX-512 body (the same condition), so no caller checks again. */
static inline int rl_isa_choose(int want) {
    int best = rl_isa_best();
    return (want <= 0 || want > best) ? best : want;
}
#endif
