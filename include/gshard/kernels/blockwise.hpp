// gshard/kernels/blockwise.hpp — element-wise loops on Eigen's packets that
// give every element the same instructions wherever it sits in memory.
//
// GCC at -O2 (its very-cheap cost model) leaves a plain element-wise loop of
// unknown length scalar, and Eigen on a dynamic map computes an unaligned
// head and tail one element at a time — with std::exp where its packets
// take their own exp, so the same value could round differently at two
// addresses (two ranks' replicas, a sharded block against the whole). Here
// the elements go through fixed-size maps of `block` elements (all packets,
// unaligned loads), the last partial block through zero-padded arrays.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "gshard/core/bf16.hpp"
#include "gshard/core/types.hpp"

namespace gshard::detail {

// f(maps...) on each block of the n elements at p...: one Eigen array map of
// `block` elements per pointer (a const map for a pointer to const), writes
// through the others.
template <class T, int block = 256, class F, class... P>
  requires(std::is_same_v<std::remove_const_t<P>, T> && ...)
void blockwise(index_t n, F&& f, P*... p) {
  using array = Eigen::Array<T, block, 1>;
  index_t at = 0;
  for (; at + block <= n; at += block)
    f(Eigen::Map<std::conditional_t<std::is_const_v<P>, const array, array>>(p + at)...);
  const index_t rest = n - at;
  if (rest == 0) return;
  std::tuple<std::pair<P*, array>...> tail{std::pair<P*, array>{p + at, array::Zero()}...};
  std::apply([&](auto&... t) { (std::copy_n(t.first, rest, t.second.data()), ...); }, tail);
  std::apply([&](auto&... t) { f(t.second...); }, tail);
  std::apply(
      [&](auto&... t) {
        const auto back = [&](auto& u) {
          if constexpr (!std::is_const_v<std::remove_pointer_t<decltype(u.first)>>) std::copy_n(u.second.data(), rest, u.first);
        };
        (back(t), ...);
      },
      tail);
}

// g[i] = 0 where y[i] <= threshold, else g[i] (a NaN y keeps g), over n
// values — relu's backward, the softmax row's clamp. A packet mask
// (Eigen 3.4's select() is scalar: in blocks relu's backward took 8.7% of
// a 2-rank trainer step, against 2.4% for a plain loop and 0.8% so); exact,
// so the scalar rest gives what packets would. g may be y.
template <class T>
void zero_where_at_most(T* g, const T* y, T threshold, index_t n) {
  index_t i = 0;
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    namespace ei = Eigen::internal;
    using P = typename ei::packet_traits<T>::type;
    constexpr index_t w = ei::packet_traits<T>::size;
    const P t = ei::pset1<P>(threshold);
    for (; i + w <= n; i += w) ei::pstoreu(g + i, ei::pandnot(ei::ploadu<P>(g + i), ei::pcmp_le(ei::ploadu<P>(y + i), t)));
  }
  for (; i < n; ++i) g[i] = y[i] <= threshold ? T(0) : g[i];
}

// The same against bf16 values (a bf16 copy of y), widened exactly.
inline void zero_where_at_most(float* g, const bf16* y, float threshold, index_t n) {
  constexpr index_t block = 32;  // a fixed trip count: vectorized at -O2 (core/bf16.hpp)
  const auto one = [&](index_t i) { g[i] = bf16_detail::widen(y[i]) <= threshold ? 0.0f : g[i]; };
  index_t i = 0;
  for (; i + block <= n; i += block)
    for (index_t k = 0; k < block; ++k) one(i + k);
  for (; i < n; ++i) one(i);
}

// ReLU in place on bf16 values, relu_op::f on each widened value: an
// entry <= 0 (its bits 0x8000 ... 0xFF80: the negative numbers, -inf and
// -0) becomes +0, the rest (NaN too) stays. Unsigned 16-bit lanes, in
// blocks of a fixed trip count: vectorized at -O2.
inline void relu_in_place(bf16* x, index_t n) {
  constexpr index_t block = 32;
  const auto one = [&](index_t i) {
    const std::uint16_t u = x[i].value;
    x[i].value = std::uint16_t(u - 0x8000u) <= 0x7F80u ? std::uint16_t(0) : u;
  };
  index_t i = 0;
  for (; i + block <= n; i += block)
    for (index_t k = 0; k < block; ++k) one(i + k);
  for (; i < n; ++i) one(i);
}

}  // namespace gshard::detail
