/* MLX's CPU matmul calls cblas_sgemm for every float32 product. Two row counts are slow on
 * Debian 12's OpenBLAS (0.3.21):
 *  - a few rows (a decode step's, one a sequence): gemm packs the whole weight matrix on every
 *    call, so the weights are read about twice; gemv reads them once (later releases forward
 *    one-row products to gemv themselves: numpy's bundled 0.3.31 runs them as fast as gemv);
 *  - a row count just short of a multiple of 16: gemm's edge tiles make 12 rows slower than 16.
 * This library is loaded ahead of OpenBLAS in the process's global symbol scope. Its cblas_sgemm
 * sends a row-major product of at most `gemv_rows` rows to OpenBLAS's cblas_sgemv, a row at a
 * time; pads one of fewer than PAD_MAX_ROWS rows, A not transposed, whose row count is at least
 * five eighths of a tile past a multiple of `pad_to`, with zero rows to that multiple (copying A
 * in and C out); and sends everything else to OpenBLAS's cblas_sgemm unchanged. Built and loaded by
 * sgemm_rows.py, which binds it before it makes it global: unbound, it would call nothing. */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int gemv_rows;
static int pad_to;
static long gemv_products;
static long padded_products;

/* A padded product's copies of A and C live in these, per thread, grown as needed; a product
 * whose padded C would pass PAD_MAX_FLOATS is left unpadded (a large vocabulary's head). */
#define PAD_MAX_FLOATS (4L << 20)
/* Measured up to 64 rows (bench/README.md); a prefill's larger products go to gemm as they are. */
#define PAD_MAX_ROWS 64
static __thread float *pad_a, *pad_c;
static __thread long pad_a_cap, pad_c_cap;

/* Bind to the OpenBLAS library `handle` (from dlopen): products of up to `rows` rows go to its
 * gemv (0: none), awkward row counts are padded to a multiple of `pad` rows (0: none). Returns 1
 * when both functions were found, else 0 (nothing changes). */
int mlxcel_sgemm_bind(void *handle, int rows, int pad) {
  sgemm_fn gemm = (sgemm_fn)dlsym(handle, "cblas_sgemm");
  sgemv_fn gemv = (sgemv_fn)dlsym(handle, "cblas_sgemv");
  if (gemm == NULL || gemv == NULL) return 0;
  real_sgemm = gemm;
  real_sgemv = gemv;
  gemv_rows = rows < 0 ? 0 : rows;
  pad_to = pad < 2 ? 0 : pad;
  return 1;
}

/* Products of up to `rows` rows go to gemv from the next product on (0: none): the worker's
 * load-time probe tries row counts both ways in one process (gemv_turn.py). */
void mlxcel_sgemm_set_rows(int rows) {
  __atomic_store_n(&gemv_rows, rows < 0 ? 0 : rows, __ATOMIC_RELAXED);
}

/* Awkward row counts are padded to a multiple of `pad` from the next product on (under 2: none):
 * bench_sgemm_rows.py --paired compares settings step by step in one process. */
void mlxcel_sgemm_set_pad(int pad) {
  __atomic_store_n(&pad_to, pad < 2 ? 0 : pad, __ATOMIC_RELAXED);
}

/* How many products went each way (tests and the benchmark read them). */
long mlxcel_gemv_products(void) { return __atomic_load_n(&gemv_products, __ATOMIC_RELAXED); }
long mlxcel_padded_products(void) { return __atomic_load_n(&padded_products, __ATOMIC_RELAXED); }

static void by_rows(int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                    int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  /* Row r of op(A) starts at a + r*lda (stride 1), or at a + r (stride lda) when A is stored
   * transposed; C's row r is alpha * row @ op(B) + beta * C[r]. */
  const int step_a = trans_a == NO_TRANS ? 1 : lda;
  for (int r = 0; r < m; r++) {
    const float *row = trans_a == NO_TRANS ? a + (long)r * lda : a + r;
    float *out = c + (long)r * ldc;
    /* beta 0 means C's old contents are ignored, NaNs included: clear the row ourselves rather
     * than rely on every OpenBLAS version's gemv to scale it by zero. */
    if (beta == 0.0f) memset(out, 0, sizeof(float) * (size_t)n);
    if (trans_b == TRANS) /* B holds op(B)'s transpose, n x k: out = B @ row */
      real_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, row, step_a, beta, out, 1);
    else /* B is k x n: out = B^T @ row */
      real_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, row, step_a, beta, out, 1);
  }
}

static int grow(float **buf, long *cap, long floats) {
  if (*cap >= floats) return 1;
  float *bigger = realloc(*buf, sizeof(float) * (size_t)floats);
  if (bigger == NULL) return 0;
  *buf = bigger;
  *cap = floats;
  return 1;
}

/* The padded rows of A are zero, so C's first m rows are the product's; returns 0 (nothing
 * done) when the buffers cannot grow. With beta 0 the padded C is not cleared: gemm's beta-0
 * pass writes C before it adds (0.3.21 gives finite products over a C of NaNs). */
static int padded(int trans_b, int m, int mp, int n, int k, float alpha, const float *a, int lda,
                  const float *b, int ldb, float beta, float *c, int ldc) {
  if (!grow(&pad_a, &pad_a_cap, (long)mp * k) || !grow(&pad_c, &pad_c_cap, (long)mp * n))
    return 0;
  for (int r = 0; r < m; r++) memcpy(pad_a + (long)r * k, a + (long)r * lda, sizeof(float) * k);
  memset(pad_a + (long)m * k, 0, sizeof(float) * (size_t)(mp - m) * k);
  if (beta != 0.0f) { /* C's rows take part: bring them in, and keep the padding finite */
    for (int r = 0; r < m; r++) memcpy(pad_c + (long)r * n, c + (long)r * ldc, sizeof(float) * n);
    memset(pad_c + (long)m * n, 0, sizeof(float) * (size_t)(mp - m) * n);
  }
  real_sgemm(ROW_MAJOR, NO_TRANS, trans_b, mp, n, k, alpha, pad_a, k, b, ldb, beta, pad_c, n);
  for (int r = 0; r < m; r++) memcpy(c + (long)r * ldc, pad_c + (long)r * n, sizeof(float) * n);
  return 1;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (order == ROW_MAJOR && m >= 1 && n > 1 && k > 1) {
    if (m <= __atomic_load_n(&gemv_rows, __ATOMIC_RELAXED)) {
      __atomic_fetch_add(&gemv_products, 1, __ATOMIC_RELAXED);
      by_rows(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    const int pad = __atomic_load_n(&pad_to, __ATOMIC_RELAXED);
    /* At least five eighths of a tile past a multiple: 10-15 rows past one for 16. Fewer rows
     * past one read slower padded than not (bench/README.md, bench_sgemm_rows.py --paired). */
    if (pad && trans_a == NO_TRANS && m < PAD_MAX_ROWS && 8 * (m % pad) >= 5 * pad) {
      const int mp = (m / pad + 1) * pad;
      if ((long)mp * n <= PAD_MAX_FLOATS &&
          padded(trans_b, m, mp, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) {
        __atomic_fetch_add(&padded_products, 1, __ATOMIC_RELAXED);
        return;
      }
    }
  }
  real_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
