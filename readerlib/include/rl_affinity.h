/* Moving one of readerlib's own threads off a CPU for a while: its affinity
 * narrowed to the other CPUs it may use (the kernel moves it at once), then
 * put back exactly as it was.  Used by the pool's placement of a late worker
 * (readerlib/_parallel.pyx, Design, "Placement") and by the shuffle's restore
 * fill, whose worker leaves its caller's CPU (readers/_shuffle.pyx).  Never
 * applied to a thread readerlib did not start.  Linux only; elsewhere nothing
 * moves and the current CPU is unknown (-1). */
#ifndef RL_AFFINITY_H
#define RL_AFFINITY_H

#if defined(__linux__)
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
typedef cpu_set_t rl_cpu_mask;

/* Thread `tid` (0: the calling one) leaves `cpu`: 1 when its affinity was
 * narrowed (its mask before in *saved, for rl_affinity_restore); 0 when it may
 * not run on `cpu` anyway, may run nowhere else, or a call failed. */
static inline int rl_affinity_leave(int tid, int cpu, rl_cpu_mask *saved) {
    cpu_set_t other;
    if (tid < 0 || cpu < 0 || cpu >= CPU_SETSIZE) return 0;
    if (sched_getaffinity(tid, sizeof *saved, saved) != 0 || !CPU_ISSET(cpu, saved)) return 0;
    other = *saved;
    CPU_CLR(cpu, &other);
    if (CPU_COUNT(&other) == 0) return 0;
    return sched_setaffinity(tid, sizeof other, &other) == 0;
}

static inline void rl_affinity_restore(int tid, const rl_cpu_mask *saved) {
    (void)sched_setaffinity(tid, sizeof *saved, saved);
}

static inline int rl_current_cpu(void) { return sched_getcpu(); }

#else
typedef struct { int unused; } rl_cpu_mask;
static inline int rl_affinity_leave(int tid, int cpu, rl_cpu_mask *saved) {
    (void)tid; (void)cpu; (void)saved;
    return 0;
}
static inline void rl_affinity_restore(int tid, const rl_cpu_mask *saved) { (void)tid; (void)saved; }
static inline int rl_current_cpu(void) { return -1; }
#endif

#endif
