// gshard/detail/gemm.hpp — the one GEMM every local einsum calls:
// C = alpha·op(A)·op(B) + beta·C on row-major strided matrices, by OpenBLAS
// (when built with GSHARD_USE_OPENBLAS, Meson option blas=openblas) or by
// Eigen's own product. With both available the faster runs: OpenBLAS, unless
// its active kernel lacks AVX-512 while this build has it (measured here:
// OpenBLAS SkylakeX kernel ~145 GFLOP/s, its Haswell kernel — which
// OPENBLAS_CORETYPE=Haswell forces — ~100, Eigen with -march=native ~140).
// GSHARD_GEMM=eigen or GSHARD_GEMM=openblas overrides the choice.
#pragma once

#include <Eigen/Core>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "gshard/sharding.hpp"

#if defined(GSHARD_USE_OPENBLAS)
#include <cblas.h>
#endif

namespace gshard::detail {

#if defined(GSHARD_USE_OPENBLAS)
extern "C" char* openblas_get_corename(void);
#endif

// "openblas" or "eigen": the backend gemm() uses in this process.
inline const char* gemm_backend() {
#if defined(GSHARD_USE_OPENBLAS)
  static const char* chosen = [] {
    if (const char* v = std::getenv("GSHARD_GEMM")) {
      if (std::string_view(v) == "eigen") return "eigen";
      if (std::string_view(v) == "openblas") return "openblas";
    }
#if defined(__AVX512F__)
    const std::string_view core = openblas_get_corename();
    const bool avx512_kernel = core.find("kylakeX") != std::string_view::npos ||
                               core.find("ooperlake") != std::string_view::npos ||
                               core.find("apphire") != std::string_view::npos;
    return avx512_kernel ? "openblas" : "eigen";
#else
    return "openblas";
#endif
  }();
  return chosen;
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
  static const bool blas = std::string_view(gemm_backend()) == "openblas";
  if (blas) {
    const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
    else
      cblas_dgemm(CblasRowMajor, ta, tb, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
    return;
  }
#endif
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

}  // namespace gshard::detail
