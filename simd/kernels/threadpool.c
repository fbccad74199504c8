/* The one worker pool of simd (the kernels and the runtime helpers of simd/ops/): chunks of a range handed
 * out through one atomic counter, the calling thread working too, with no join barrier for threads that
 * never started.
 *
 * Why not an OpenMP parallel region: its end is a barrier every team thread must reach. When the machine
 * is busy (other processes, a browser), a worker that is not scheduled in time makes every kernel call
 * wait a whole scheduler slice: measured here, 2-thread GEMVs of 80 us took 12-20 ms under load. Here the
 * calling thread claims chunks too and only waits for chunks another thread has actually claimed; a late
 * worker finds the job finished and claims nothing.
 *
 * A chunk claimed by a worker that is then preempted cannot be taken back (the caller returns, and a late
 * write into an output buffer that Python already reuses would corrupt it), so the caller has to wait for
 * it. With one core busy (another process running flat out on it) that wait is the other process's time
 * slice, and spinning through it keeps the caller's core busy, so the scheduler has no idle core to move the
 * preempted worker to. The caller therefore spins only briefly (WAIT_SPIN_NS, yielding), then sleeps (a
 * futex on Linux, a condition variable elsewhere): its core goes idle and the kernel's idle balancing pulls
 * the runnable worker over, which finishes the chunk and wakes it.
 *
 * The claim word packs (generation, chunk count, next chunk) so a worker can never claim a chunk of a job
 * other than the one it read. Workers spin 5 ms after a job (kernel calls come in bursts during a
 * token), then sleep on a condition variable.
 */
#define _GNU_SOURCE /* syscall (futex) */
#include "kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ volatile("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_WORKERS 63
/* Spin 5 ms before sleeping, yielding the CPU every ~256 pauses: a worker that sleeps between the calls of
 * a token is woken onto the caller's CPU (wake-affine) and then shares it with the caller instead of
 * helping (measured: 200 us of spin left the worker asleep in ~1 of 4 calls, p90 285 us vs 75 us).
 * The yield matters with a busy core (a busy loop on one of the two cores): without it, 2-thread decode
 * fell to 0.79x of -t 1 (median of 3 paired runs; 1.10x with it). Variants that did not measurably help there (paired runs on
 * this shared 2-core machine, differences inside the run-to-run spread): a 50 us spin, and a spin that
 * drops to 50 us after the worker misses whole jobs. */
#ifndef SPIN_NS
#define SPIN_NS 5000000
#endif
/* chunks per thread: a preempted worker holds up the caller by at most one small chunk of work (plus the
 * time until it runs again: see WAIT_SPIN_NS) */
#define CHUNKS_PER_THREAD 16
/* The caller waiting for chunks held by workers: spin (yielding) this long, then sleep on the futex. A
 * decode GEMV chunk takes ~3 us, so on a quiet machine the wait ends well inside it; a longer wait means
 * the holder is not running. */
#ifndef WAIT_SPIN_NS
#define WAIT_SPIN_NS 30000
#endif

/* claim word: bits 40..63 generation, 20..39 chunk count, 0..19 next chunk */
#define CLAIM(gen, n, next) (((uint64_t)(gen) << 40) | ((uint64_t)(n) << 20) | (uint64_t)(next))
#define CLAIM_GEN(c) ((c) >> 40)
#define CLAIM_N(c) (((c) >> 20) & 0xfffff)
#define CLAIM_NEXT(c) ((c)&0xfffff)

static struct {
    pthread_mutex_t lock;      /* sleeping workers + job publication wake-ups */
    pthread_cond_t wake;
    pthread_mutex_t busy;      /* one job at a time (callers from two Python threads) */
    int n_workers;
    _Atomic uint64_t claim;
    _Atomic uint32_t done;     /* chunks finished in the current job; the caller's futex word */
    _Atomic int caller_asleep; /* the caller sleeps on `done` until the last chunk is finished */
    _Atomic int sleepers;
    _Atomic int nt;            /* threads of the current job: workers with slot >= nt stay out */
    /* the current job: written before the claim word is published, stable until all its chunks are done */
    bk_range_fn fn;
    void *ctx;
    int n, grain, n_units;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int my_slot; /* 0 on every calling thread; the worker's number on a worker */
static _Atomic uint64_t stat_jobs, stat_worker_chunks, stat_caller_sleeps;

int bk_thread_slot(void) { return my_slot; }

void bk_pool_stats(uint64_t *jobs, uint64_t *worker_chunks, uint64_t *caller_sleeps) {
    *jobs = atomic_load(&stat_jobs);
    *worker_chunks = atomic_load(&stat_worker_chunks);
    *caller_sleeps = atomic_load(&stat_caller_sleeps);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The caller's sleep until `done` moves. Linux: a futex on the word itself. Elsewhere (macOS, the BSDs:
 * futex is Linux-only): a condition variable; the waker's increment happens before it takes the lock and
 * the sleeper checks the word under it, so no wake-up is lost. Built for non-Linux only by
 * tests/test_portable_pool.py on Linux with __linux__ undefined; no macOS machine was available to run it. */
#if defined(__linux__)
static void futex_wait(_Atomic uint32_t *addr, uint32_t seen) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void futex_reset_after_fork(void) {}
#else
static pthread_mutex_t done_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cond = PTHREAD_COND_INITIALIZER;

static void futex_wait(_Atomic uint32_t *addr, uint32_t seen) {
    pthread_mutex_lock(&done_lock);
    while (atomic_load(addr) == seen) pthread_cond_wait(&done_cond, &done_lock);
    pthread_mutex_unlock(&done_lock);
}

static void futex_wake(_Atomic uint32_t *addr) {
    (void)addr;
    pthread_mutex_lock(&done_lock);
    pthread_cond_broadcast(&done_cond);
    pthread_mutex_unlock(&done_lock);
}

static void futex_reset_after_fork(void) {
    pthread_mutex_init(&done_lock, NULL);
    pthread_cond_init(&done_cond, NULL);
}
#endif

/* Chunk c of n_chunks over [0, n): contiguous runs of whole grains (the last one may be short). */
static void chunk_range(int c, int n_chunks, int *b, int *e) {
    int base = pool.n_units / n_chunks, rem = pool.n_units % n_chunks;
    int u0 = c * base + (c < rem ? c : rem), u1 = u0 + base + (c < rem ? 1 : 0);
    *b = u0 * pool.grain;
    *e = u1 * pool.grain < pool.n ? u1 * pool.grain : pool.n;
}

/* Claim and run chunks of generation gen until none is left. */
static int run_chunks(uint64_t gen) {
    int ran = 0;
    uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        if (CLAIM_GEN(c) != gen || CLAIM_NEXT(c) >= CLAIM_N(c)) return ran;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        const int n_chunks = (int)CLAIM_N(c);
        int b, e;
        chunk_range((int)CLAIM_NEXT(c), n_chunks, &b, &e);
        if (b < e) pool.fn(pool.ctx, b, e);
        /* seq_cst, paired with the caller's store of caller_asleep and load of done (no lost wake-up) */
        if (atomic_fetch_add(&pool.done, 1) + 1 == (uint32_t)n_chunks && atomic_load(&pool.caller_asleep))
            futex_wake(&pool.done);
        ran++;
        c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    my_slot = (int)(intptr_t)arg;
    uint64_t seen = CLAIM_GEN(atomic_load(&pool.claim));
    for (;;) {
        /* spin a while for the next job, then sleep */
        uint64_t start = now_ns(), gen;
        int spins = 0;
        while ((gen = CLAIM_GEN(atomic_load_explicit(&pool.claim, memory_order_acquire))) == seen) {
            CPU_RELAX();
            if (++spins % 256 != 0) continue;
            sched_yield();
            if (now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&pool.lock);
                atomic_fetch_add(&pool.sleepers, 1); /* seq_cst: pairs with the publisher's store + load */
                while ((gen = CLAIM_GEN(atomic_load(&pool.claim))) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.lock);
                break;
            }
        }
        seen = gen;
        /* nt is read after the claim word (acquire): it is this job's, or the job is already over and
         * run_chunks finds nothing of generation gen to claim */
        if (my_slot < atomic_load_explicit(&pool.nt, memory_order_relaxed))
            atomic_fetch_add_explicit(&stat_worker_chunks, (uint64_t)run_chunks(gen), memory_order_relaxed);
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* the child has only the forking thread: no workers, fresh locks */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    futex_reset_after_fork();
    pool.n_workers = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.caller_asleep, 0);
}

static void ensure_workers(int want) {
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        atfork_done = 1;
    }
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (pool.n_workers < want) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(pool.n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer workers: the caller does more chunks itself */
        pool.n_workers++;
    }
}

/* The caller, its own claims done: wait for the chunks the workers hold. */
static void wait_for_workers(int n_chunks) {
    uint64_t start = 0;
    int spins = 0;
    uint32_t d;
    while ((d = atomic_load_explicit(&pool.done, memory_order_acquire)) < (uint32_t)n_chunks) {
        CPU_RELAX();
        if (++spins % 64 != 0) continue;
        if (!start) {
            start = now_ns();
            continue;
        }
        /* a worker preempted on this CPU's run queue gets it back at once */
        sched_yield();
        if (now_ns() - start < WAIT_SPIN_NS) continue;
        atomic_store(&pool.caller_asleep, 1);
        while ((d = atomic_load(&pool.done)) < (uint32_t)n_chunks) futex_wait(&pool.done, d);
        atomic_store(&pool.caller_asleep, 0);
        atomic_fetch_add_explicit(&stat_caller_sleeps, 1, memory_order_relaxed);
        return;
    }
}

void bk_parallel_for(int n, int grain, int nt, bk_range_fn fn, void *ctx) {
    if (grain < 1) grain = 1;
    const int units = (n + grain - 1) / grain;
    if (nt > units) nt = units;
    if (nt <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
    ensure_workers(nt - 1);
    int n_chunks = nt * CHUNKS_PER_THREAD < units ? nt * CHUNKS_PER_THREAD : units;
    if (n_chunks > 0xfffff) n_chunks = 0xfffff;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.grain = grain;
    pool.n_units = units;
    atomic_store_explicit(&pool.nt, nt, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (CLAIM_GEN(atomic_load(&pool.claim)) + 1) & 0xffffff;
    atomic_store(&pool.claim, CLAIM(gen, n_chunks, 0)); /* seq_cst publication */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    atomic_fetch_add_explicit(&stat_jobs, 1, memory_order_relaxed);
    run_chunks(gen);
    /* only chunks that some thread claimed are outstanding: wait for those */
    wait_for_workers(n_chunks);
    pthread_mutex_unlock(&pool.busy);
}

void bk_run_tiles(int n_tiles, size_t work, size_t min_work, bk_range_fn fn, void *ctx) {
    int nt = bk_get_num_threads();
    if (nt <= 1 || n_tiles <= 4 || work < min_work)
        fn(ctx, 0, n_tiles);
    else
        bk_parallel_for(n_tiles, 4, nt, fn, ctx);
}
