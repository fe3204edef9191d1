/* Sends float32 products with one row or one column from cblas_sgemm to cblas_sgemv.
 *
 * MLX's CPU backend computes every float32 matmul with cblas_sgemm, decode steps
 * included, where the left operand is a single row. OpenBLAS before 0.3.27 runs
 * those through the general kernel, packing the whole weight matrix first: half the
 * bandwidth of its own sgemv (measured on a 1 GB matrix: 13.6 vs 26.4 GB/s).
 * Preloaded in front of the BLAS (LD_PRELOAD=this:libopenblas.so.0), this library
 * routes those calls to the BLAS's sgemv and everything else to its sgemm unchanged.
 * The BLAS must be preloaded too: a library that MLX loads privately is not visible.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111 };

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

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == ROW_MAJOR && k > 0) {
        if (m == 1) {
            /* C[1, n] = a . op(B): y = op(B)^T x, so B's transpose flag flips */
            int incx = trans_a == NO_TRANS ? 1 : lda;
            matvec(trans_b == NO_TRANS ? NO_TRANS + 1 : NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
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
