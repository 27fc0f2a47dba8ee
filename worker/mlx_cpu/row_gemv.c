/* MLX's CPU matmul calls cblas_sgemm for every float32 product, a decode step's one-row
 * products included. OpenBLAS before 0.3.27 packs the whole weight matrix on every such call
 * (it forwards one-row products to gemv only since then), so a decode step of a few rows reads
 * each weight about twice. This library is loaded ahead of OpenBLAS in the process's global
 * symbol scope: its cblas_sgemm sends a row-major product of at most `rows` rows to OpenBLAS's
 * cblas_sgemv, one row at a time, and everything else to OpenBLAS's cblas_sgemm unchanged.
 * Built and loaded by row_gemv.py; until mlxcel_gemv_bind succeeds nothing is forwarded
 * anywhere, so it must be bound before anything calls it. */
#include <dlfcn.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int max_rows;
static long gemv_products;

/* Bind to the OpenBLAS library `handle` (from dlopen) and send products of up to `rows` rows
 * to its gemv (0: none). Returns 1 when both functions were found, else 0 (nothing changes). */
int mlxcel_gemv_bind(void *handle, int rows) {
  sgemm_fn gemm = (sgemm_fn)dlsym(handle, "cblas_sgemm");
  sgemv_fn gemv = (sgemv_fn)dlsym(handle, "cblas_sgemv");
  if (gemm == NULL || gemv == NULL) return 0;
  real_sgemm = gemm;
  real_sgemv = gemv;
  max_rows = rows < 0 ? 0 : rows;
  return 1;
}

/* How many products went to gemv (tests and the worker's log read it). */
long mlxcel_gemv_products(void) { return __atomic_load_n(&gemv_products, __ATOMIC_RELAXED); }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (order == ROW_MAJOR && m >= 1 && m <= max_rows && n > 1 && k > 1) {
    __atomic_fetch_add(&gemv_products, 1, __ATOMIC_RELAXED);
    /* Row r of op(A) starts at a + r*lda (stride 1), or at a + r (stride lda) when A is
     * stored transposed; C's row r is alpha * row @ op(B) + beta * C[r]. */
    const int step_a = trans_a == NO_TRANS ? 1 : lda;
    for (int r = 0; r < m; r++) {
      const float *row = trans_a == NO_TRANS ? a + (long)r * lda : a + r;
      float *out = c + (long)r * ldc;
      /* beta 0 means C's old contents are ignored, NaNs included: clear the row ourselves
       * rather than rely on every OpenBLAS version's gemv to scale it by zero. */
      if (beta == 0.0f) memset(out, 0, sizeof(float) * (size_t)n);
      if (trans_b == TRANS) /* B holds op(B)'s transpose, n x k: out = B @ row */
        real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, row, step_a, beta, out, 1);
      else /* B is k x n: out = B^T @ row */
        real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, row, step_a, beta, out, 1);
    }
    return;
  }
  real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
