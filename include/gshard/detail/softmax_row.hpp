// gshard/detail/softmax_row.hpp — the softmax of one row and its gradient,
// the kernels behind softmax() and causal_softmax() (ops.hpp, grad.hpp), the
// router's gates (moe/gating.hpp) and the cross-entropy's loss and gradient
// (ad/nn.hpp).
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "gshard/detail/blockwise.hpp"
#include "gshard/types.hpp"

namespace gshard::detail {

namespace softmax_detail {
template <class T>
constexpr T lowest = std::is_same_v<T, float> ? T(-80) : T(-700);  // exp of it is still a normal number

// The row's n entries times scale in an aligned buffer padded with -inf to
// whole packets (every entry then takes the vectorised path, whatever the
// row's address).
template <class T>
auto scaled_row(const T* in, index_t n, T scale) {
  using row = Eigen::Array<T, Eigen::Dynamic, 1>;
  thread_local row buf;  // Eigen's heap arrays are aligned to its packets
  const index_t padded = (n + 15) / 16 * 16;
  if (buf.size() < padded) buf.resize(padded);
  auto b = buf.head(padded);
  if (scale == T(1)) std::copy(in, in + n, b.data());
  else b.head(n) = Eigen::Map<const row>(in, n) * scale;
  b.tail(padded - n).setConstant(-std::numeric_limits<T>::infinity());
  return b;
}

// b = exp(b − mx) clamped at `lowest`, the clamped entries 0 (NaN stays).
template <class B, class T>
void exp_shifted(B& b, T mx) {
  b = (b - mx).max(lowest<T>).exp();
  const T cut = std::exp(lowest<T> + 1);  // the clamped entries, with a margin for exp's last bits: 0
  zero_where_at_most(b.data(), b.data(), cut, b.size());
}
}  // namespace softmax_detail

// softmax_row's two numbers of a row, kept to compute it again
// (softmax_row_again): the largest scaled entry and the sum of the shifted exps.
template <class T>
struct softmax_row_stats {
  T max, sum;
};

// out = softmax(scale · in) over n entries (none: returns -inf), shifted by the
// largest for stability (in may be out). Entries of -inf get 0. Returns the log of the
// partition function, log Σ exp(in), in double. The caller decides what NaN,
// +inf or a row of only -inf mean.
//
// Float and double take Eigen's vectorised exp of the shifted entries
// clamped at -80 (float) or -700 (double): an entry 79 (699) or more below
// the row's largest gets 0 (its share is under 5e-35, or 3e-304; -inf
// entries exactly 0, as std::exp gives). The clamp keeps the exp away from subnormal
// results, which cost a microcode assist each: measured on a Zen 3 core over
// float rows of 128 with masked entries, 2.2 against 7.5 ns per element for
// std::exp (3.4x), within 5e-7 relative.
// The row is computed in an aligned buffer padded to whole packets, so
// every entry takes the vectorised path whatever the row's address: on a
// row at another address Eigen would compute some entries with std::exp
// (its unaligned head), and the same logits would route differently on two
// calls (test_moe caught it). The scale is applied (in T) as the row is
// copied in, so softmax_row(x, n, out, s) equals softmax_row of s·x. With
// `stats`, the row's largest scaled entry and sum of exps are kept.
template <class T>
double softmax_row(const T* in, index_t n, T* out, T scale = T(1), softmax_row_stats<T>* stats = nullptr) {
  if (n == 0) return -std::numeric_limits<double>::infinity();  // log Σ over nothing
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using row = Eigen::Array<T, Eigen::Dynamic, 1>;
    auto b = softmax_detail::scaled_row(in, n, scale);
    // On packets (Eigen's PropagateNaN reduction is scalar): a NaN entry
    // stays NaN through the max(lowest) and exp below, and so makes the sum
    // and the row NaN, as does +inf (inf - inf), as std::exp gives.
    const T mx = b.maxCoeff();
    softmax_detail::exp_shifted(b, mx);
    const T sum = b.sum();
    Eigen::Map<row>(out, n) = b.head(n) / sum;
    if (stats) *stats = {mx, sum};
    return double(mx) + std::log(double(sum));
  } else {
    T mx = -std::numeric_limits<T>::infinity();
    for (index_t i = 0; i < n; ++i) mx = scale * in[i] > mx ? scale * in[i] : mx;
    T sum = 0;
    for (index_t i = 0; i < n; ++i) sum += (out[i] = std::exp(scale * in[i] - mx));
    for (index_t i = 0; i < n; ++i) out[i] /= sum;
    if (stats) *stats = {mx, sum};
    return double(mx) + std::log(double(sum));
  }
}

// The row softmax_row(in, n, out, scale, &stats) gave, computed again from
// the same logits and its stats: bit for bit the same (the same operations
// in the same order).
template <class T>
void softmax_row_again(const T* in, index_t n, T* out, T scale, const softmax_row_stats<T>& stats) {
  if (n == 0) return;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using row = Eigen::Array<T, Eigen::Dynamic, 1>;
    auto b = softmax_detail::scaled_row(in, n, scale);
    softmax_detail::exp_shifted(b, stats.max);
    Eigen::Map<row>(out, n) = b.head(n) / stats.sum;
  } else {
    for (index_t i = 0; i < n; ++i) out[i] = std::exp(scale * in[i] - stats.max) / stats.sum;
  }
}

// The gradient through y = softmax(scale · x) of one row of n entries, in
// place: g = scale · p ⊙ (g − <g, p>). Float and double take Eigen's
// packets (the dot in several accumulators), which -O2 would not vectorise.
template <class T>
void softmax_row_backward(T* g, const T* p, index_t n, T scale = T(1)) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    using row = Eigen::Array<T, Eigen::Dynamic, 1>;
    Eigen::Map<row> gv(g, n);
    const Eigen::Map<const row> pv(p, n);
    const T dot = gv.matrix().dot(pv.matrix());
    gv = scale * pv * (gv - dot);
  } else {
    T dot = 0;
    for (index_t i = 0; i < n; ++i) dot += g[i] * p[i];
    for (index_t i = 0; i < n; ++i) g[i] = scale * p[i] * (g[i] - dot);
  }
}

}  // namespace gshard::detail
