// gshard/kernels/gemm.hpp — the one GEMM every local einsum calls:
// C = alpha·op(A)·op(B) + beta·C on row-major strided matrices, by OpenBLAS
// (when built with GSHARD_USE_OPENBLAS, Meson option blas=openblas), by
// oneDNN (GSHARD_USE_ONEDNN, Meson option onednn) or by Eigen's own
// product; the backend is chosen at start-up (default_gemm in
// core/options.hpp; GSHARD_GEMM overrides). Other element types (integers)
// take a plain loop: correct, not fast. gemm_bf16 multiplies bf16 operands
// with fp32 accumulation: on the CPU's bf16 units through oneDNN where it
// can, otherwise converted to fp32 in blocks. matmul_precision::bf16 makes
// fp32 GEMMs multiply their operands rounded to bf16 on those units. A
// gemm_recorder (core/counters.hpp) lists the calls.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <climits>
#include <type_traits>
#include <vector>

#include "gshard/core/options.hpp"

#include "gshard/core/counters.hpp"
#include "gshard/core/types.hpp"

#include "gshard/kernels/copy_box.hpp"
#include "gshard/kernels/onednn.hpp"

#if defined(GSHARD_USE_OPENBLAS)
#include <cblas.h>
#endif

namespace gshard {

// What fp32 GEMMs multiply (jax.default_matmul_precision;
// torch.autocast(dtype=torch.bfloat16) for matmuls):
//   f32   the fp32 operands as they are;
//   bf16  the operands rounded to bf16 (to nearest even), the products
//         accumulated in fp32 into the fp32 output — on the CPU's bf16 units
//         (oneDNN's bf16 matmul: AVX512_BF16, AMX). Where the CPU has none,
//         rounding would only add work, and the GEMM runs as f32.
// Set for a stretch of code by matmul_precision_scope; each thread has its
// own (f32 unless set). A tape's rules run with the precision their forward
// ran with (gshard/ad/tape.hpp), so a backward multiplies as its forward did.
enum class matmul_precision : std::uint8_t { f32, bf16 };

inline const char* to_string(matmul_precision p) { return p == matmul_precision::bf16 ? "bf16" : "f32"; }

namespace detail {
inline matmul_precision& matmul_precision_now() {
  thread_local matmul_precision p = matmul_precision::f32;
  return p;
}
}  // namespace detail

inline matmul_precision current_matmul_precision() { return detail::matmul_precision_now(); }

// matmul_precision_scope bf16(matmul_precision::bf16): fp32 GEMMs until the
// scope ends multiply in bf16; the precision before it comes back after.
class matmul_precision_scope {
 public:
  explicit matmul_precision_scope(matmul_precision p) : before_(detail::matmul_precision_now()) {
    detail::matmul_precision_now() = p;
  }
  ~matmul_precision_scope() { detail::matmul_precision_now() = before_; }
  matmul_precision_scope(const matmul_precision_scope&) = delete;
  matmul_precision_scope& operator=(const matmul_precision_scope&) = delete;

 private:
  matmul_precision before_;
};

}  // namespace gshard

namespace gshard::detail {

// "openblas", "onednn" or "eigen": the backend gemm() uses (agreed across ranks: core/options.hpp).
inline const char* gemm_backend() { return gemm_name(gemm_kind(options().gemm)); }

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

// The product by the chosen backend, unrecorded.
template <class T>
void gemm_run(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
              index_t ldb, T beta, T* c, index_t ldc) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    gemm_loop(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
#if defined(GSHARD_USE_ONEDNN)
    if constexpr (std::is_same_v<T, float>)
      if (options().gemm == int(gemm_kind::onednn) && k > 0 &&
          onednn_gemm<float, float>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
        return;
#endif
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

template <class Out>  // below
void gemm_bf16(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const Eigen::bfloat16* a,
               index_t lda, const Eigen::bfloat16* b, index_t ldb, float beta, Out* c, index_t ldc);

// Whether gemm_bf16 runs on the CPU's bf16 units (oneDNN's bf16 matmul),
// rather than converting to fp32.
inline bool gemm_bf16_native() {
#if defined(GSHARD_USE_ONEDNN)
  return options().gemm == int(gemm_kind::onednn) && onednn_has_bf16();
#else
  return false;
#endif
}

// Whether gemm<float> rounds its operands to bf16 and multiplies them on the
// bf16 units: under matmul_precision::bf16 where gemm_bf16_native(). A
// kernel that multiplies one operand many times rounds it once, up front,
// and calls gemm_bf16 itself (local_einsum's loops, the attention blocks).
inline bool gemm_rounds_to_bf16() {
  return current_matmul_precision() == matmul_precision::bf16 && gemm_bf16_native();
}

// rows × cols of a matrix with leading dim ld_from, converted (bf16 <->
// fp32; to bf16 rounded to nearest even) into one with leading dim ld_to.
template <class From, class To>
void convert_rows(const From* from, index_t rows, index_t cols, index_t ld_from, To* to, index_t ld_to) {
  for (index_t r = 0; r < rows; ++r) convert_elements(from + r * ld_from, std::size_t(cols), to + r * ld_to);
}

// The same, packed (leading dim cols) into `to`, resized to fit.
template <class From, class To>
const To* packed(const From* from, index_t rows, index_t cols, index_t ld, std::vector<To>& to) {
  to.resize(std::size_t(rows * cols));
  convert_rows(from, rows, cols, ld, to.data(), cols);
  return to.data();
}

// Row-major: op(A) is m×k (A stored k×m when trans_a), op(B) is k×n, C is m×n.
// Called by one thread of a process at a time (the backends' state is the
// process's). fp32 under matmul_precision::bf16, on a CPU with bf16 units:
// A and B rounded to bf16 in buffers kept between calls, then gemm_bf16.
template <class T>
void gemm(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, T alpha, const T* a, index_t lda, const T* b,
          index_t ldb, T beta, T* c, index_t ldc) {
  if (m == 0 || n == 0) return;
  if constexpr (std::is_same_v<T, float>)
    if (k > 0 && gemm_rounds_to_bf16()) {
      thread_local std::vector<Eigen::bfloat16> a16, b16;
      const Eigen::bfloat16* ar = packed(a, trans_a ? k : m, trans_a ? m : k, lda, a16);
      const Eigen::bfloat16* br = packed(b, trans_b ? n : k, trans_b ? k : n, ldb, b16);
      gemm_bf16<float>(trans_a, trans_b, m, n, k, alpha, ar, trans_a ? m : k, br, trans_b ? k : n, beta, c, ldc);
      return;
    }
  if (auto& log = gemm_log(); log.recorders > 0)  // the check first: no gemm_call built when nobody records
    log.add({int(sizeof(T)), trans_a, trans_b, beta != T(0), m, n, k, lda, ldb, ldc});
  gemm_run(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C = alpha·op(A)·op(B) + beta·C with A and B in bf16, the products
// accumulated in fp32 and C in fp32 or bf16 (rounded once, to nearest
// even). oneDNN's bf16 matmul where it is the backend and the CPU has bf16
// units; otherwise A and B (and a bf16 C) widened to fp32 in buffers kept
// between calls and multiplied by gemm's fp32 backend — the same result to
// fp32 rounding.
template <class Out>
void gemm_bf16(bool trans_a, bool trans_b, index_t m, index_t n, index_t k, float alpha, const Eigen::bfloat16* a,
               index_t lda, const Eigen::bfloat16* b, index_t ldb, float beta, Out* c, index_t ldc) {
  static_assert(std::is_same_v<Out, float> || std::is_same_v<Out, Eigen::bfloat16>,
                "gshard::gemm_bf16: the output is float or bf16");
  if (m == 0 || n == 0) return;
  if (auto& log = gemm_log(); log.recorders > 0)
    log.add({2, trans_a, trans_b, beta != 0.0f, m, n, k, lda, ldb, ldc});
#if defined(GSHARD_USE_ONEDNN)
  if (options().gemm == int(gemm_kind::onednn) && k > 0 && onednn_has_bf16() &&
      onednn_gemm<Eigen::bfloat16, Out>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
    return;
#endif
  thread_local std::vector<float> a32, b32, c32;
  const float* aw = packed(a, trans_a ? k : m, trans_a ? m : k, lda, a32);
  const float* bw = packed(b, trans_b ? n : k, trans_b ? k : n, ldb, b32);
  const index_t lda32 = trans_a ? m : k, ldb32 = trans_b ? k : n;
  if constexpr (std::is_same_v<Out, float>) {
    gemm_run<float>(trans_a, trans_b, m, n, k, alpha, aw, lda32, bw, ldb32, beta, c, ldc);
  } else {
    if (beta != 0.0f) packed(c, m, n, ldc, c32);
    else c32.resize(std::size_t(m * n));
    gemm_run<float>(trans_a, trans_b, m, n, k, alpha, aw, lda32, bw, ldb32, beta, c32.data(), n);
    convert_rows(c32.data(), m, n, n, c, ldc);
  }
}

// For each product of the batch, C_i = alpha·op(A_i)·op(B_i) + beta·C_i: A
// and B float (multiplied as gemm<float>, rounded to bf16 where it rounds
// them), double or bf16 (as gemm_bf16, C float or bf16). One oneDNN call
// for the batch where oneDNN is the backend — the attention's per-head
// products (32 × 80 × 32) take about as long to dispatch one by one as to
// compute —, else one GEMM per product. Each product is recorded as a GEMM.
template <class In, class Out, class S>
void gemm_batched(const gemm_batch& batch, bool trans_a, bool trans_b, index_t m, index_t n, index_t k, S alpha,
                  const In* a, index_t lda, const In* b, index_t ldb, S beta, Out* c, index_t ldc) {
  if (batch.count == 0 || m == 0 || n == 0) return;
#if defined(GSHARD_USE_ONEDNN)
  constexpr bool bf16_in = std::is_same_v<In, Eigen::bfloat16>, f32 = std::is_same_v<In, float> && std::is_same_v<Out, float>;
  if constexpr (bf16_in || f32)
    if (batch.count > 1 && k > 0 && options().gemm == int(gemm_kind::onednn) &&
        (bf16_in ? onednn_has_bf16() : !gemm_rounds_to_bf16()) &&
        onednn_gemm<In, Out>(trans_a, trans_b, m, n, k, float(alpha), a, lda, b, ldb, float(beta), c, ldc, batch)) {
      if (auto& log = gemm_log(); log.recorders > 0)
        for (index_t i = 0; i < batch.count; ++i)
          log.add({int(sizeof(In)), trans_a, trans_b, beta != S(0), m, n, k, lda, ldb, ldc});
      return;
    }
#endif
  for (index_t i = 0; i < batch.count; ++i) {
    const In *ai = a + i * batch.a_stride, *bi = b + i * batch.b_stride;
    Out* ci = c + i * batch.c_stride;
    if constexpr (std::is_same_v<In, Eigen::bfloat16>)
      gemm_bf16<Out>(trans_a, trans_b, m, n, k, alpha, ai, lda, bi, ldb, beta, ci, ldc);
    else
      gemm<In>(trans_a, trans_b, m, n, k, alpha, ai, lda, bi, ldb, beta, ci, ldc);
  }
}

}  // namespace gshard::detail
