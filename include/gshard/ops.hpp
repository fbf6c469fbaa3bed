// gshard/ops.hpp — element-wise and last-dim operations on sharded tensors.
// They act on each rank's shard and keep the sharding, so they never
// communicate; they refuse tensors with pending sums (relu of a summand is
// not a summand of the relu), and last-dim operations refuse a split last dim.
#pragma once

#include <cmath>
#include <utility>

#include "gshard/tensor.hpp"

namespace gshard {

namespace detail {
template <class X>
constexpr bool has_pending_sums() {
  return X::layout.partial != 0;
}
template <class X>
constexpr bool last_dim_split() {
  return X::rank > 0 && X::layout.dims[X::rank - 1].n > 0;
}
}  // namespace detail

// max(x, 0), element-wise; an rvalue is updated in place.
template <class X>
  requires sharded_tensor<X>
std::remove_cvref_t<X> relu(X&& x) {
  using Y = std::remove_cvref_t<X>;
  static_assert(!detail::has_pending_sums<Y>(), "gshard::relu: the tensor has pending sums; all_reduce or reduce_scatter it first");
  Y out = std::forward<X>(x);
  auto* p = out.data();
  for (index_t i = 0, n = out.local().size(); i < n; ++i) p[i] = p[i] > 0 ? p[i] : typename Y::value_type(0);
  return out;
}

// a + b for two tensors of one type (pending sums add too).
template <sharded_tensor X>
X operator+(X a, const X& b) {
  if (a.extents() != b.extents())
    throw shape_error("gshard::operator+: " + a.notation() + " and " + b.notation() + " differ in extents");
  a.local() += b.local();
  return a;
}

// s · a.
template <sharded_tensor X>
X operator*(typename X::value_type s, X a) {
  a.local() = a.local() * s;
  return a;
}

// Softmax over the last dim (which must not be split), computed in at least
// float precision with the maximum subtracted.
template <class X>
  requires sharded_tensor<X>
std::remove_cvref_t<X> softmax(X&& x) {
  using Y = std::remove_cvref_t<X>;
  using T = typename Y::value_type;
  static_assert(!detail::has_pending_sums<Y>(), "gshard::softmax: the tensor has pending sums; all_reduce it first");
  static_assert(!detail::last_dim_split<Y>(), "gshard::softmax: the last dim is split; softmax needs it whole on each rank");
  Y out = std::forward<X>(x);
  const index_t n = Y::rank ? out.local().dimension(Y::rank - 1) : 1;
  if (n == 0) return out;
  T* p = out.data();
  for (index_t row = 0, rows = out.local().size() / n; row < rows; ++row, p += n) {
    T mx = p[0];
    for (index_t i = 1; i < n; ++i) mx = p[i] > mx ? p[i] : mx;
    T sum = 0;
    for (index_t i = 0; i < n; ++i) sum += (p[i] = std::exp(p[i] - mx));
    const T inv = T(1) / sum;
    for (index_t i = 0; i < n; ++i) p[i] *= inv;
  }
  return out;
}

// GShard's RMS-style norm over the last dim: x · rsqrt(mean(x²) + eps) · scale.
// `scale` holds the last dim's extent of values, on every rank.
template <class X, class Scale>
  requires sharded_tensor<X>
std::remove_cvref_t<X> rms_norm(X&& x, const Scale& scale, double eps = 1e-6) {
  using Y = std::remove_cvref_t<X>;
  using T = typename Y::value_type;
  static_assert(!detail::has_pending_sums<Y>(), "gshard::rms_norm: the tensor has pending sums; all_reduce it first");
  static_assert(!detail::last_dim_split<Y>(), "gshard::rms_norm: the last dim is split; the norm needs it whole on each rank");
  Y out = std::forward<X>(x);
  const index_t n = out.local().dimension(Y::rank - 1);
  if (index_t(scale.size()) != n)
    throw shape_error("gshard::rms_norm: the scale has " + std::to_string(scale.size()) + " values for a last dim of " +
                      std::to_string(n));
  if (n == 0) return out;
  T* p = out.data();
  const T* s = scale.data();
  for (index_t row = 0, rows = out.local().size() / n; row < rows; ++row, p += n) {
    double ss = 0;
    for (index_t i = 0; i < n; ++i) ss += double(p[i]) * double(p[i]);
    const T r = T(1.0 / std::sqrt(ss / double(n) + eps));
    for (index_t i = 0; i < n; ++i) p[i] = p[i] * r * s[i];
  }
  return out;
}

}  // namespace gshard
