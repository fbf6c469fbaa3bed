// gshard/kernels/gemm.hpp — the one GEMM every local einsum calls:
// C = alpha·op(A)·op(B) + beta·C on row-major strided matrices, by OpenBLAS
// (when built with GSHARD_USE_OPENBLAS, Meson option blas=openblas) or by
// Eigen's own product; with both available the faster runs (default_gemm in
// core/options.hpp; GSHARD_GEMM overrides). Other element types (integers)
// take a plain loop: correct, not fast. A gemm_recorder (core/counters.hpp)
// lists the calls.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <climits>
#include <type_traits>

#include "gshard/core/options.hpp"

#include "gshard/core/counters.hpp"
#include "gshard/core/types.hpp"

#if defined(GSHARD_USE_OPENBLAS)
#include <cblas.h>
#endif

namespace gshard::detail {

// "openblas" or "eigen": the backend gemm() uses (agreed across ranks: core/options.hpp).
inline const char* gemm_backend() { return options().gemm == int(gemm_kind::openblas) ? "openblas" : "eigen"; }

template <class T>
void gemm_eigen(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
                const T* b, index_t ldb, T beta, T* c, index_t ldc) {
  using mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using cmap = Eigen::Map<const mat, 0, Eigen::OuterStride<>>;
  Eigen::Map<mat, 0, Eigen::OuterStride<>> C(c, m, n, Eigen::OuterStride<>(ldc));
  const cmap A(a, trans_a ? k : m, trans_a ? m : k, Eigen::OuterStride<>(lda));
  const cmap B(b, trans_b ? n : k, trans_b ? k : n, Eigen::OuterStride<>(ldb));
  if (beta == T(0)) C.setZero();
  else if (beta != T(1)) C *= beta;
  if (k == 0) return;
  if (trans_a && trans_b) C.noalias() += alpha * (A.transpose() * B.transpose());
  else if (trans_a) C.noalias() += alpha * (A.transpose() * B);
  else if (trans_b) C.noalias() += alpha * (A * B.transpose());
  else C.noalias() += alpha * (A * B);
}

// Element types BLAS and Eigen's GEMM kernels do not cover (integers).
template <class T>
void gemm_loop(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda,
               const T* b, index_t ldb, T beta, T* c, index_t ldc) {
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < n; ++j) {
      T acc = T(0);
      for (index_t p = 0; p < k; ++p)
        acc += (trans_a ? a[p * lda + i] : a[i * lda + p]) * (trans_b ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
}

// Row-major: op(A) is m×k (A stored k×m when trans_a), op(B) is k×n, C is m×n.
template <class T>
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
          index_t ldb, T beta, T* c, index_t ldc) {
  if (m == 0 || n == 0) return;
  if (auto& log = gemm_log(); log.recorders > 0)  // the check first: no gemm_call built when nobody records
    log.add({int(sizeof(T)), trans_a, trans_b, beta != T(0), m, n, k, lda, ldb, ldc});
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    gemm_loop(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
#if defined(GSHARD_USE_OPENBLAS)
    const bool fits_int = std::max({m, n, k, lda, ldb, ldc}) <= index_t(INT_MAX);  // BLAS takes int sizes
    if (options().gemm == int(gemm_kind::openblas) && fits_int) {
      const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
      if constexpr (std::is_same_v<T, float>)
        cblas_sgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
      else
        cblas_dgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
      return;
    }
#endif
    gemm_eigen(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // namespace gshard::detail
