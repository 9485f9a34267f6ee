/* One pool of worker threads for every native kernel: the caller plus (threads - 1) workers.
 *
 * Why our own and not OpenMP: torch ships its own OpenMP runtime, and a second one in this library would be a
 * second pool spinning on the same cores. The engine runs torch on one intra-op thread while this pool is on
 * (cpu_kernels.set_threads), so exactly one pool computes at a time.
 *
 * A job is n_items independent items handed out by an atomic counter (dynamic: a slow core takes fewer).
 * Workers spin a short while after a job (decode steps call us back within microseconds), then sleep on a
 * condition variable, so an idle engine burns no core. A second thread calling while a job runs (a host
 * executor thread beside the serving loop) runs its job alone on its own thread rather than wait. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 256
#define SPIN_ROUNDS 20000 /* ~0.1-0.5 ms of pause before a worker sleeps */

typedef void (*hs_task)(void *ctx, int64_t item);

static struct {
    int threads; /* including the caller */
    pthread_t tids[MAX_THREADS];
    _Atomic uint64_t generation;
    _Atomic int64_t next;
    _Atomic int pending; /* workers still in the current job */
    _Atomic int sleeping;
    _Atomic int stop;
    int64_t n_items;
    hs_task fn;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_mutex_t busy; /* held by the thread whose job the workers run */
} pool = {.threads = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
          .busy = PTHREAD_MUTEX_INITIALIZER};

/* Items are taken in runs of consecutive ones, a quarter of a thread's share at a time: taken one by one, two
 * threads alternated rows of the same matrices, so each core's prefetches fetched the other's next tile and
 * neither streamed (two threads decoded slower than one); runs still leave a slow core fewer items. */
static void run_items(hs_task fn, void *ctx, int64_t n_items) {
    int64_t run = n_items / (4 * pool.threads);
    run = run < 1 ? 1 : run;
    for (int64_t i; (i = atomic_fetch_add_explicit(&pool.next, run, memory_order_relaxed)) < n_items;)
        for (int64_t end = i + run < n_items ? i + run : n_items; i < end; i++)
            fn(ctx, i);
}

static void *worker(void *arg) {
    /* The generation in force when this worker was made (under `busy`, so no job was being posted): read
     * here instead, a job posted before the thread first ran would count as seen, and never be joined. */
    uint64_t seen = (uint64_t)(uintptr_t)arg;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen && !atomic_load(&pool.stop)) {
            if (++spins < SPIN_ROUNDS) {
                CPU_RELAX();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleeping, 1);
            while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.stop))
                pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        if (atomic_load(&pool.stop))
            return NULL;
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        run_items(pool.fn, pool.ctx, pool.n_items);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.mu);
    atomic_store(&pool.stop, 1);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    for (int t = 1; t < pool.threads; t++)
        pthread_join(pool.tids[t], NULL);
    atomic_store(&pool.stop, 0);
    pool.threads = 1;
}

/* Sets the pool's size (the caller counts as one); returns the size in force. */
int hs_set_threads(int threads) {
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    pthread_mutex_lock(&pool.busy);
    if (threads != pool.threads) {
        stop_workers();
        int started = 1;
        void *generation = (void *)(uintptr_t)atomic_load(&pool.generation);
        for (; started < threads; started++)
            if (pthread_create(&pool.tids[started], NULL, worker, generation) != 0)
                break;
        pool.threads = started;
    }
    int in_force = pool.threads;
    pthread_mutex_unlock(&pool.busy);
    return in_force;
}

int hs_threads(void) { return pool.threads; }

/* Runs fn(ctx, i) for i in [0, n_items) on the pool; returns when every item is done. */
void hs_parallel(hs_task fn, void *ctx, int64_t n_items) {
    if (n_items <= 0)
        return;
    if (pool.threads == 1 || n_items == 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t i = 0; i < n_items; i++)
            fn(ctx, i);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n_items = n_items;
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.pending, pool.threads - 1, memory_order_relaxed);
    atomic_fetch_add(&pool.generation, 1); /* seq_cst: pairs with a worker's sleeping++ then re-check */
    if (atomic_load(&pool.sleeping) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    run_items(fn, ctx, n_items);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0)
        CPU_RELAX();
    pthread_mutex_unlock(&pool.busy);
}

/* ---- the memory read probe (bench host-kernels): what the pool's threads can read, the kernels' yardstick ----
 * Each item is PROBE_ITEM bytes read as PROBE_STREAMS interleaved streams (a Zen 2 core drew 10.4 GB/s from
 * one stream and 18 from four), summed so the reads are not optimised away. */
#define PROBE_ITEM (4 << 20)
#define PROBE_STREAMS 4
typedef uint64_t probe_vec __attribute__((vector_size(32)));
typedef struct {
    const char *buf;
    int64_t bytes;
    _Atomic uint64_t sum;
} probe_job;

static void probe_item(void *ctx, int64_t item) {
    probe_job *j = ctx;
    int64_t start = item * PROBE_ITEM, end = start + PROBE_ITEM < j->bytes ? start + PROBE_ITEM : j->bytes;
    int64_t part = (end - start) / PROBE_STREAMS / 64 * 64;
    probe_vec acc[PROBE_STREAMS] = {{0}};
    for (int64_t i = 0; i < part; i += 64)
        for (int s = 0; s < PROBE_STREAMS; s++) {
            probe_vec a, b;
            __builtin_memcpy(&a, j->buf + start + s * part + i, sizeof a);
            __builtin_memcpy(&b, j->buf + start + s * part + i + 32, sizeof b);
            acc[s] += a ^ b;
        }
    uint64_t total = 0;
    for (int s = 0; s < PROBE_STREAMS; s++)
        for (int lane = 0; lane < 4; lane++)
            total += acc[s][lane];
    atomic_fetch_add(&j->sum, total);
}

/* Reads `bytes` of buf (a multiple of 64 per stream; the rest is skipped) on the pool; returns a checksum. */
uint64_t hs_read_probe(const void *buf, int64_t bytes) {
    probe_job job = {buf, bytes, 0};
    hs_parallel(probe_item, &job, (bytes + PROBE_ITEM - 1) / PROBE_ITEM);
    return atomic_load(&job.sum);
}
