// gshard/detail/gemm.hpp — the one GEMM every local einsum calls:
// C = alpha·op(A)·op(B) + beta·C on row-major strided matrices. OpenBLAS when
// GSHARD_USE_OPENBLAS is defined (Meson option blas=openblas, the default),
// Eigen's own product otherwise.
#pragma once

#include <Eigen/Core>
#include <type_traits>

#include "gshard/sharding.hpp"

#if defined(GSHARD_USE_OPENBLAS)
#include <cblas.h>
#endif

namespace gshard::detail {

inline constexpr const char* gemm_backend() {
#if defined(GSHARD_USE_OPENBLAS)
  return "openblas";
#else
  return "eigen";
#endif
}

// Row-major: op(A) is m×k (A stored k×m when trans_a), op(B) is k×n, C is m×n.
template <class T>
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
          index_t ldb, T beta, T* c, index_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "gshard::einsum: the local GEMM supports float and double");
  if (m == 0 || n == 0) return;
#if defined(GSHARD_USE_OPENBLAS)
  const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
#else
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
#endif
}

}  // namespace gshard::detail
