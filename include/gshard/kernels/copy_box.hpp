// gshard/kernels/copy_box.hpp — copy an n-d box between row-major arrays: the
// one routine behind every slice, pack and unpack (trailing dims that the box
// covers whole in both arrays merge into one contiguous run, memcpy). And the
// bf16 wire's conversions: which tensors it narrows, the converting loop, and
// rounding through bf16 in place (what a weight kept as bf16 holds).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include <Eigen/Core>

#include "gshard/core/bf16.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/types.hpp"

namespace gshard::detail {

// dst[dst_off + i] = src[src_off + i] for every i in the box `ext` (rank `rank`).
template <class T>
void copy_box(const T* src, const index_t* src_ext, const index_t* src_off, T* dst, const index_t* dst_ext,
              const index_t* dst_off, const index_t* ext, int rank) {
  if (rank == 0) {
    *dst = *src;
    return;
  }
  for (int d = 0; d < rank; ++d)
    if (ext[d] == 0) return;
  index_t src_stride[max_rank], dst_stride[max_rank];
  src_stride[rank - 1] = dst_stride[rank - 1] = 1;
  for (int d = rank - 2; d >= 0; --d) {
    src_stride[d] = src_stride[d + 1] * src_ext[d + 1];
    dst_stride[d] = dst_stride[d + 1] * dst_ext[d + 1];
  }
  // Merge inner dims covered whole in both arrays into one run.
  int k = rank - 1;
  index_t run = ext[k];
  while (k > 0 && ext[k] == src_ext[k] && ext[k] == dst_ext[k]) {
    --k;
    run *= ext[k];
  }
  const T* s0 = src;
  T* d0 = dst;
  for (int d = 0; d < rank; ++d) {
    s0 += src_off[d] * src_stride[d];
    d0 += dst_off[d] * dst_stride[d];
  }
  // Odometer over dims 0..k-1.
  index_t pos[max_rank] = {};
  while (true) {
    index_t so = 0, dof = 0;
    for (int d = 0; d < k; ++d) {
      so += pos[d] * src_stride[d];
      dof += pos[d] * dst_stride[d];
    }
    std::memcpy(d0 + dof, s0 + so, std::size_t(run) * sizeof(T));
    int d = k - 1;
    while (d >= 0 && ++pos[d] == ext[d]) pos[d--] = 0;
    if (d < 0) break;
  }
}

// to[i] = from[i] converted, for n elements (bf16 <-> fp32 or f64 in vector
// loops, core/bf16.hpp; to bf16 rounded to nearest even; other pairs by Eigen).
template <class From, class To>
void convert_elements(const From* from, std::size_t n, To* to) {
  constexpr bool from_real = std::is_same_v<From, float> || std::is_same_v<From, double>;
  constexpr bool to_real = std::is_same_v<To, float> || std::is_same_v<To, double>;
  if constexpr (std::is_same_v<From, To>) std::copy_n(from, n, to);
  else if constexpr (std::is_same_v<To, bf16> && from_real) to_bf16(from, n, to);
  else if constexpr (std::is_same_v<From, bf16> && to_real) from_bf16(from, n, to);
  else
    Eigen::Map<Eigen::Array<To, Eigen::Dynamic, 1>>(to, Eigen::Index(n)) =
        Eigen::Map<const Eigen::Array<From, Eigen::Dynamic, 1>>(from, Eigen::Index(n)).template cast<To>();
}

// to[i] = from[i] rounded to bf16 and widened back (`to` may be `from`), in
// blocks through a buffer on the stack: the values a bf16 copy holds, in T.
template <class T>
void round_through_bf16(const T* from, std::size_t n, T* to) {
  constexpr std::size_t block = 1024;
  bf16 narrow[block];
  for (std::size_t at = 0; at < n; at += block) {
    const std::size_t k = std::min(block, n - at);
    convert_elements(from + at, k, narrow);
    convert_elements(narrow, k, to + at);
  }
}

// master[i] = weight[i] where weight[i] is not master[i] rounded through
// bf16, bit for bit (a NaN compares by its bits too): a master follows the
// elements of its bf16 weight that were set elsewhere, and keeps the rest.
// One pass per block of 32 (whose differences are OR-ed, a reduction GCC
// vectorizes) unless the block has such an element.
template <class T>
void follow_rounded(T* master, const T* weight, std::size_t n) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  const auto rounded = [](T m) { return std::bit_cast<U>(T(bf16_detail::widen(bf16_detail::narrow(float(m))))); };
  const auto follow = [&](std::size_t i) {
    if (rounded(master[i]) != std::bit_cast<U>(weight[i])) master[i] = weight[i];
  };
  constexpr std::size_t block = bf16_detail::block;
  std::size_t at = 0;
  for (; at + block <= n; at += block) {
    U differ = 0;
    for (std::size_t i = 0; i < block; ++i) differ |= rounded(master[at + i]) ^ std::bit_cast<U>(weight[at + i]);
    if (differ != 0)
      for (std::size_t i = at; i < at + block; ++i) follow(i);
  }
  for (; at < n; ++at) follow(at);
}

// Whether `w` sends a tensor of T as bf16: for float and double; bf16
// travels as itself; any other type (token ids: integers above 256 would
// round) is refused, the same on every rank.
template <class T>
bool narrows(wire w) {
  if (!sends_bf16(w) || std::is_same_v<T, bf16>) return false;
  if constexpr (!std::is_floating_point_v<T>)
    throw error(std::string("gshard::reshard: wire::bf16 carries float or double tensors; this one is ") +
                std::string(name_of(element_of<T>())));
  return true;
}

}  // namespace gshard::detail
