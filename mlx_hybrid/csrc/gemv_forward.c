/* Sends float32 products with few rows, or one column, from cblas_sgemm to cblas_sgemv.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm, decode steps
 * included, where the left operand is a single row (a verify pass: a few rows).
 * OpenBLAS before 0.3.27 runs those through the general kernel, packing the whole
 * weight matrix first: half the bandwidth of its own sgemv (measured on a 1 GB
 * matrix: 13.6 vs 26.4 GB/s). Row by row through sgemv, each output row is also
 * computed exactly as it is when alone, so a verify pass and single decode steps
 * give the same bits.
 * Preloaded in front of the BLAS (LD_PRELOAD=this:libopenblas.so.0), this library
 * routes those calls to the BLAS's sgemv and everything else to its sgemm unchanged.
 * The BLAS must be preloaded too: a library that MLX loads privately is not visible.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* Products with up to this many rows (decode steps, speculative verify passes) go
   through sgemv. */
enum { SMALL_ROWS = 8 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

__attribute__((constructor)) static void find_blas(void) {
    blas_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    blas_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    if (blas_sgemm == 0 || blas_sgemv == 0) {
        fputs("gemv_forward: no BLAS preloaded after this library\n", stderr);
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

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == ROW_MAJOR && k > 0) {
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
