/* The kernels' worker threads: contiguous tile chunks handed out through one atomic counter, with no join
 * barrier for threads that never started.
 *
 * Why not an OpenMP parallel region: its end is a barrier every team thread must reach. When the machine
 * is busy (other processes, a browser), a worker that is not scheduled in time makes every kernel call
 * wait a whole scheduler slice: measured here, 2-thread GEMVs of 80 us took 12-20 ms under load. Here the
 * calling thread claims chunks too and only waits for chunks another thread has actually claimed; a late
 * worker finds the job finished and claims nothing.
 *
 * The claim word packs (generation, chunk count, next chunk) so a worker can never claim a chunk of a job
 * other than the one it read. Workers spin 5 ms after a job (kernel calls come in bursts during a
 * token), then sleep on a condition variable.
 */
#include "kernels.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
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
 * helping (measured: 200 us of spin left the worker asleep in ~1 of 4 calls, p90 285 us vs 75 us). */
#define SPIN_NS 5000000
/* chunks per thread: a preempted worker holds up the caller by at most one small chunk */
#define CHUNKS_PER_THREAD 16

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
    _Atomic int done;          /* chunks finished in the current job */
    _Atomic int sleepers;
    /* the current job: written before the claim word is published, stable until all its chunks are done */
    bk_range_fn fn;
    void *ctx;
    int n_tiles, n_chunks;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

int bk_use_pool = 1;
static _Atomic uint64_t stat_jobs, stat_worker_chunks;

void bk_pool_stats(uint64_t *jobs, uint64_t *worker_chunks) {
    *jobs = atomic_load(&stat_jobs);
    *worker_chunks = atomic_load(&stat_worker_chunks);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
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
        int chunk = (int)CLAIM_NEXT(c), b, e;
        bk_split_units(pool.n_tiles, pool.n_chunks, chunk, &b, &e);
        if (b < e) pool.fn(pool.ctx, b, e);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        ran++;
        c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
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
        atomic_fetch_add_explicit(&stat_worker_chunks, (uint64_t)run_chunks(gen), memory_order_relaxed);
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* the child has only the forking thread: no workers, fresh locks */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_mutex_init(&pool.busy, NULL);
    pool.n_workers = 0;
    atomic_store(&pool.sleepers, 0);
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
        int rc = pthread_create(&th, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer workers: the caller does more chunks itself */
        pool.n_workers++;
    }
}

void bk_parallel_tiles(int n_tiles, int nt, bk_range_fn fn, void *ctx) {
    int units = (n_tiles + 3) / 4;
    if (nt <= 1 || units <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, n_tiles);
        return;
    }
    ensure_workers(nt - 1);
    /* a few chunks per thread: a busy core costs at most a chunk's time */
    int n_chunks = nt * CHUNKS_PER_THREAD < units ? nt * CHUNKS_PER_THREAD : units;
    if (n_chunks > 0xfffff) n_chunks = 0xfffff;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_tiles = n_tiles;
    pool.n_chunks = n_chunks;
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
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < n_chunks) CPU_RELAX();
    pthread_mutex_unlock(&pool.busy);
}

void bk_run_tiles(int n_tiles, int nt, bk_range_fn fn, void *ctx) {
    if (nt <= 1 || n_tiles <= 4) {
        fn(ctx, 0, n_tiles);
    } else if (bk_use_pool) {
        bk_parallel_tiles(n_tiles, nt, fn, ctx);
    } else {
#pragma omp parallel num_threads(nt)
        {
            int b, e;
            bk_split_units(n_tiles, omp_get_num_threads(), omp_get_thread_num(), &b, &e);
            if (b < e) fn(ctx, b, e);
        }
    }
}
