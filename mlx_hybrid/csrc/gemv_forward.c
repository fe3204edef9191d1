/* Products with few rows, for MLX's CPU backend on Linux, in front of OpenBLAS.
 *
 * MLX computes every float32 matmul with cblas_sgemm, decode steps included, where the
 * left operand is a single row (a speculative verify pass: a few rows). OpenBLAS before
 * 0.3.27 runs those through its general kernel, packing the whole weight matrix first:
 * half the bandwidth of its own sgemv (1 GB matrix: 13.6 vs 26.4 GB/s). This library
 * takes them over:
 * - x @ W^T with up to 16 rows (every linear layer and the LM head): one pass over W,
 *   each row of W read once for all rows of x, with AVX2/FMA over a small thread pool.
 *   A verify pass of 1 + k tokens (k up to 15) then reads the weights once, as a decode
 *   step does.
 * - other products of up to 16 rows, or of one column: row by row through the BLAS's sgemv.
 * Each output row is computed by the same sequence of operations whatever rows come
 * with it, so a verify pass and single decode steps give the same bits.
 *
 * Loaded in front of the BLAS, either preloaded (LD_PRELOAD=this:libopenblas.so.0) or
 * opened into the global scope before MLX loads, then told where the BLAS is with
 * mlx_hybrid_gemv_bind(path): the system's OpenBLAS or the scipy-openblas32 wheel's.
 * Everything else goes to the BLAS's sgemm unchanged.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Products with up to this many rows (decode steps, speculative verify passes) are ours. */
enum { SMALL_ROWS = 16 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

/* The BLAS's entry points are found under OpenBLAS's own names or under the `scipy_` prefix of the
   scipy-openblas32 wheel (OpenBLAS built for numpy and SciPy, which renames its symbols so that it
   never clashes with a system BLAS). */
static const char *const PREFIXES[] = {"scipy_", ""};

static int take_blas(void *handle) {
    char sgemm[64], sgemv[64];
    for (unsigned i = 0; i < sizeof PREFIXES / sizeof *PREFIXES; i++) {
        snprintf(sgemm, sizeof sgemm, "%scblas_sgemm", PREFIXES[i]);
        snprintf(sgemv, sizeof sgemv, "%scblas_sgemv", PREFIXES[i]);
        sgemm_fn found_sgemm = (sgemm_fn)dlsym(handle, sgemm);
        sgemv_fn found_sgemv = (sgemv_fn)dlsym(handle, sgemv);
        if (found_sgemm != 0 && found_sgemv != 0) {
            blas_sgemm = found_sgemm;
            blas_sgemv = found_sgemv;
            return 1;
        }
    }
    return 0;
}

/* Bind to the BLAS in `path`; 0 on success. */
int mlx_hybrid_gemv_bind(const char *path) {
    void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (handle == 0) return -1;
    return take_blas(handle) ? 0 : -2;
}

/* Preloaded: the BLAS is a library after this one in the search order (the wheel's prefixed names
   first: behind them, the search order also holds MLX's own reference BLAS). */
static void find_blas(void) {
    if (blas_sgemm != 0) return;
    if (!take_blas(RTLD_NEXT)) {
        fputs("gemv_forward: no BLAS bound or preloaded after this library\n", stderr);
        abort();
    }
}

/* y (n entries, stride incy) = 0: BLAS may leave y unread when beta is 0, and the
   buffer MLX hands over can hold anything, NaN included. */
static void clear(float *y, int n, int incy) {
    for (int i = 0; i < n; i++) y[(long)i * incy] = 0.0f;
}

/* Row-major y = alpha op(M) x + beta y, where op(M) has `rows` rows and M is stored
   untransposed as [rows, cols] when trans == NO_TRANS, else as [cols, rows]. */
static void matvec(int trans, int rows, int cols, float alpha, const float *m, int ldm, const float *x, int incx,
                   float beta, float *y, int incy) {
    if (beta == 0.0f) clear(y, rows, incy);
    if (trans == NO_TRANS)
        blas_sgemv(ROW_MAJOR, trans, rows, cols, alpha, m, ldm, x, incx, beta, y, incy);
    else
        blas_sgemv(ROW_MAJOR, trans, cols, rows, alpha, m, ldm, x, incx, beta, y, incy);
}

/* C[m, n] = op(A) op(B) a row at a time; with several rows, over blocks of about 1 MB
   of B, so that every row after the first reads the block from cache. */
static void rows_by_matvec(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                           const float *b, int ldb, float beta, float *c, int ldc) {
    int block = m == 1 ? n : (1 << 18) / k;
    if (block < 64) block = 64;
    for (int start = 0; start < n; start += block) {
        int count = n - start < block ? n - start : block;
        /* op(B)[:, start:start + count] */
        const float *b_block = b + (trans_b == NO_TRANS ? start : (long)start * ldb);
        for (int row = 0; row < m; row++) {
            const float *x = a + (trans_a == NO_TRANS ? (long)row * lda : row);
            int incx = trans_a == NO_TRANS ? 1 : lda;
            /* y = op(B)^T x, so B's transpose flag flips */
            matvec(trans_b == NO_TRANS ? TRANS : NO_TRANS, count, k, alpha, b_block, ldb, x, incx, beta,
                   c + (long)row * ldc + start, 1);
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* A product x @ W^T: x [m, k] (row stride lda), W [n, k] (row stride ldw), C [m, n]. */
struct rows_product {
    int m, n, k, lda, ldw, ldc;
    float alpha, beta;
    const float *x, *w;
    float *c;
};

/* out[r * 4 + c] = dot(x_r, w_c) for `rows` (1 or 2) rows of x and `cols` (1 or 4) rows
   of W. Every pair takes the same steps: one 8-lane accumulator over blocks of 8, reduced
   in a fixed order, then the scalar tail; so a row's bits depend neither on the other
   rows nor on how columns are grouped. Four rows of W at a time keep four streams open. */
__attribute__((target("avx2,fma"), always_inline)) static inline void dots(int rows, int cols, const float *const *x,
                                                                           const float *const *w, int k, float *out) {
    __m256 acc[2][4];
    _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {
        _Pragma("GCC unroll 4") for (int c = 0; c < cols; c++) acc[r][c] = _mm256_setzero_ps();
    }
    int p = 0;
    for (; p + 8 <= k; p += 8) {
        __m256 wv[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < cols; c++) wv[c] = _mm256_loadu_ps(w[c] + p);
        _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {
            __m256 xv = _mm256_loadu_ps(x[r] + p);
            _Pragma("GCC unroll 4") for (int c = 0; c < cols; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < rows; r++) {
        _Pragma("GCC unroll 4") for (int c = 0; c < cols; c++) {
            __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
            __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
            float total = _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
            for (int q = p; q < k; q++) total = __builtin_fmaf(x[r][q], w[c][q], total);
            out[r * 4 + c] = total;
        }
    }
}

static inline void store(const struct rows_product *job, int row, int col, float dot) {
    float *out = job->c + (long)row * job->ldc + col;
    *out = job->beta == 0.0f ? job->alpha * dot : job->alpha * dot + job->beta * *out;
}

/* Columns [j, j + cols) of the product (cols 4, or 1 for the remainder), for all its
   rows; rows in pairs, so that a pair after the first reads W's rows from L1. */
__attribute__((target("avx2,fma"), always_inline)) static inline void column_group(const struct rows_product *job,
                                                                                   const float *const *x, int j,
                                                                                   int cols) {
    const float *w[4];
    for (int c = 0; c < cols; c++) w[c] = job->w + (long)(j + c) * job->ldw;
    float d[8];
    for (int first = 0; first < job->m; first += 2) {
        int rows = job->m - first >= 2 ? 2 : 1;
        if (cols == 4) {
            if (rows == 2) dots(2, 4, x + first, w, job->k, d);
            else dots(1, 4, x + first, w, job->k, d);
        } else {
            if (rows == 2) dots(2, 1, x + first, w, job->k, d);
            else dots(1, 1, x + first, w, job->k, d);
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) store(job, first + r, j + c, d[r * 4 + c]);
    }
}

/* Columns [start, end) of the product, for all its rows. */
__attribute__((target("avx2,fma"))) static void rows_product_columns(const struct rows_product *job, int start,
                                                                     int end) {
    const float *x[SMALL_ROWS];
    for (int i = 0; i < job->m; i++) x[i] = job->x + (long)i * job->lda;
    int j = start;
    for (; j + 4 <= end; j += 4) column_group(job, x, j, 4);
    for (; j < end; j++) column_group(job, x, j, 1);
}

/* A small pool: the calling thread and `helpers` threads each take a share of the columns. */
enum { MAX_THREADS = 16 };
/* Products with fewer weights than this (4 MB in float32) run on the calling thread
   alone: waking a helper costs more than it saves (a 256-wide model decoded 8% slower). */
enum { PARALLEL_MIN_WEIGHTS = 1 << 20 };

static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER; /* one pooled product at a time */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_start = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int helpers = -1; /* -1: not started */
static unsigned long generation;
static int unfinished;
static const struct rows_product *pool_job;

static int pool_threads(void) {
    const char *names[] = {"MLX_HYBRID_GEMV_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"};
    for (int i = 0; i < 3; i++) {
        const char *value = getenv(names[i]);
        if (value != 0 && atoi(value) > 0) return atoi(value) < MAX_THREADS ? atoi(value) : MAX_THREADS;
    }
    cpu_set_t cpus;
    int count = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    return count < 1 ? 1 : (count < MAX_THREADS ? count : MAX_THREADS);
}

static void share(const struct rows_product *job, int part, int parts) {
    long n = job->n;
    rows_product_columns(job, (int)(n * part / parts), (int)(n * (part + 1) / parts));
}

/* A decode step's products come a hundred microseconds or so apart, and waking a sleeping
   thread takes tens: waiters spin this long (with pauses) before they sleep. */
static const double SPIN_SECONDS = 200e-6;

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

static int generation_is_not(unsigned long seen) { return __atomic_load_n(&generation, __ATOMIC_ACQUIRE) != seen; }
static int all_finished(unsigned long unused) {
    (void)unused;
    return __atomic_load_n(&unfinished, __ATOMIC_ACQUIRE) == 0;
}

/* 1 once done(arg) holds, 0 if it did not within SPIN_SECONDS */
static int spin_until(int (*done)(unsigned long), unsigned long arg) {
    double until = seconds_now() + SPIN_SECONDS;
    for (int i = 1;; i++) {
        if (done(arg)) return 1;
        __builtin_ia32_pause();
        if (i % 64 == 0 && seconds_now() > until) return 0;
    }
}

static void *helper_main(void *arg) {
    int part = (int)(intptr_t)arg;
    unsigned long seen = 0;
    for (;;) {
        if (!spin_until(generation_is_not, seen)) {
            pthread_mutex_lock(&pool_lock);
            while (!generation_is_not(seen)) pthread_cond_wait(&pool_start, &pool_lock);
            pthread_mutex_unlock(&pool_lock);
        }
        seen = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        share(pool_job, part, helpers + 1); /* the job stays until every helper has counted itself finished */
        if (__atomic_sub_fetch(&unfinished, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&pool_lock);
            pthread_cond_signal(&pool_done);
            pthread_mutex_unlock(&pool_lock);
        }
    }
    return 0;
}

static void start_pool(void) {
    int wanted = pool_threads() - 1, started = 0;
    for (; started < wanted; started++) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attr, helper_main, (void *)(intptr_t)(started + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
    }
    helpers = started;
}

/* A forked child has no helper threads. */
static void forget_pool(void) {
    helpers = -1;
    pthread_mutex_init(&pool_busy, 0);
    pthread_mutex_init(&pool_lock, 0);
}

static void rows_product(const struct rows_product *job) {
    if ((long)job->n * job->k < PARALLEL_MIN_WEIGHTS || pthread_mutex_trylock(&pool_busy) != 0) {
        rows_product_columns(job, 0, job->n); /* small, or another thread holds the pool */
        return;
    }
    if (helpers < 0) {
        pthread_atfork(0, 0, forget_pool);
        start_pool();
    }
    if (helpers == 0) {
        rows_product_columns(job, 0, job->n);
    } else {
        pthread_mutex_lock(&pool_lock);
        pool_job = job;
        __atomic_store_n(&unfinished, helpers, __ATOMIC_RELAXED);
        __atomic_add_fetch(&generation, 1, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&pool_start);
        pthread_mutex_unlock(&pool_lock);
        share(job, 0, helpers + 1);
        if (!spin_until(all_finished, 0)) {
            pthread_mutex_lock(&pool_lock);
            while (!all_finished(0)) pthread_cond_wait(&pool_done, &pool_lock);
            pthread_mutex_unlock(&pool_lock);
        }
    }
    pthread_mutex_unlock(&pool_busy);
}

static int have_avx2_fma(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return known;
}
#endif

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    find_blas();
    if (order == ROW_MAJOR && k > 0) {
#if defined(__x86_64__)
        if (m <= SMALL_ROWS && trans_a == NO_TRANS && trans_b == TRANS && have_avx2_fma()) {
            struct rows_product job = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c};
            rows_product(&job);
            return;
        }
#endif
        if (m <= SMALL_ROWS) {
            rows_by_matvec(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
            return;
        }
        if (n == 1) {
            /* C[m, 1] = op(A) . b */
            int incx = trans_b == NO_TRANS ? ldb : 1;
            matvec(trans_a, m, k, alpha, a, lda, b, incx, beta, c, ldc);
            return;
        }
    }
    blas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
