# Threads' synchronisation, declared once for every compiled module: pthread
# mutexes and condition variables, GCC atomics, and the one clock deadlines
# use (CLOCK_MONOTONIC: a wall-clock jump neither ends a wait early nor makes
# it hang).  Declarations and inline functions only: nothing to import.
from posix.time cimport timespec, clock_gettime, CLOCK_MONOTONIC
from posix.types cimport clockid_t

from readerlib._typedefs cimport int64_t

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_condattr_init(pthread_condattr_t *a)
    int pthread_condattr_setclock(pthread_condattr_t *a, clockid_t clock)
    int pthread_condattr_destroy(pthread_condattr_t *a)
    int pthread_cond_init(pthread_cond_t *c, const pthread_condattr_t *a)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const timespec *t)
    int pthread_cond_signal(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)

cdef extern from *:
    int64_t __atomic_add_fetch(int64_t *p, int64_t v, int order) nogil
    int64_t __atomic_sub_fetch(int64_t *p, int64_t v, int order) nogil
    int __ATOMIC_RELAXED
    int __ATOMIC_ACQ_REL


# Nanoseconds on the monotonic clock.
cdef inline int64_t now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


# A condition variable whose timed waits (cond_wait_until) use the monotonic clock.
cdef inline int cond_init_monotonic(pthread_cond_t *c) noexcept nogil:
    cdef pthread_condattr_t attr
    cdef int r
    pthread_condattr_init(&attr)
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
    r = pthread_cond_init(c, &attr)
    pthread_condattr_destroy(&attr)
    return r


# Wait on `c` (made by cond_init_monotonic; `m` held) until signalled or until
# now_ns() reaches `until_ns`; pthread_cond_timedwait's result (ETIMEDOUT...).
cdef inline int cond_wait_until(pthread_cond_t *c, pthread_mutex_t *m, int64_t until_ns) noexcept nogil:
    cdef timespec ts
    ts.tv_sec = until_ns // 1000000000
    ts.tv_nsec = until_ns % 1000000000
    return pthread_cond_timedwait(c, m, &ts)
