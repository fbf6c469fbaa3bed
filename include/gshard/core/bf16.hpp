// gshard/core/bf16.hpp — arrays converted between bf16 and fp32 or f64, in
// loops the compiler vectorizes: to bf16 rounded to nearest even (a double
// through fp32), a NaN kept as the quiet NaN of its sign — bit for bit
// Eigen's bfloat16(x) —, and back exactly. Eigen's own array cast to bf16
// compiles to a loop of one element at a time. Every GEMM that rounds its
// operands, every bf16 message and every bf16 sum goes through these. Built
// for a CPU with AVX512_BF16 (-march=native there), to_bf16 rounds on the
// bf16 unit, to the same bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include <Eigen/Core>

#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define GSHARD_BF16_CONVERT_INSTRUCTION 1
#endif

#include "gshard/core/types.hpp"

namespace gshard::detail {

namespace bf16_detail {
// Elements per block: a fixed trip count, so GCC vectorizes the inner loops
// at -O2 (its cheap cost model takes no loop that needs a scalar epilogue).
inline constexpr std::size_t block = 32;

inline std::uint16_t narrow(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
  return std::uint16_t((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}
inline float widen(std::uint16_t bits) { return std::bit_cast<float>(std::uint32_t(bits) << 16); }
inline float widen(bf16 b) { return widen(b.value); }
inline void narrow_block(const float* from, bf16* to) {
  for (std::size_t k = 0; k < block; ++k) to[k].value = narrow(from[k]);
}
}  // namespace bf16_detail

// Whether f is a bf16 value: its lower half zero, so that its upper half,
// widened, gives f back to the bit (a NaN's payload too).
inline bool is_bf16_value(float f) { return (std::bit_cast<std::uint32_t>(f) & 0xFFFFu) == 0; }

inline void to_bf16(const float* from, std::size_t n, bf16* to) {
  using bf16_detail::block;
  std::size_t i = 0;
#ifdef GSHARD_BF16_CONVERT_INSTRUCTION
  // VCVTNE2PS2BF16 rounds to nearest even as narrow() does, at twice its
  // rate on arrays beyond the L2 cache; but it reads a subnormal as zero and
  // keeps a NaN's payload, so a block holding either (fpclass: QNaN 0x01,
  // subnormal 0x20, SNaN 0x80) goes through narrow().
  static_assert(block == 32, "a block is two vectors of 16 floats");
  for (; i + block <= n; i += block) {
    const __m512 lo = _mm512_loadu_ps(from + i), hi = _mm512_loadu_ps(from + i + 16);
    if ((_mm512_fpclass_ps_mask(lo, 0xA1) | _mm512_fpclass_ps_mask(hi, 0xA1)) == 0) {
      _mm512_storeu_si512(static_cast<void*>(to + i), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
      continue;
    }
    bf16_detail::narrow_block(from + i, to + i);
  }
#endif
  for (; i + block <= n; i += block) bf16_detail::narrow_block(from + i, to + i);
  for (; i < n; ++i) to[i].value = bf16_detail::narrow(from[i]);
}

inline void to_bf16(const double* from, std::size_t n, bf16* to) {
  float f[bf16_detail::block];
  for (std::size_t i = 0; i < n; i += bf16_detail::block) {
    const std::size_t k = std::min(bf16_detail::block, n - i);
    for (std::size_t j = 0; j < k; ++j) f[j] = float(from[i + j]);
    to_bf16(f, k, to + i);
  }
}

// The upper halves of n floats into `to` (bf16 bit patterns, truncated);
// returns whether every value was a bf16 value (is_bf16_value), so that
// widening `to` gives `from` back exactly. The lower halves are OR-ed, a
// reduction GCC vectorizes.
inline bool truncate_to_bf16(const float* from, std::size_t n, std::uint16_t* to) {
  using bf16_detail::block;
  std::uint32_t lower = 0;
  std::size_t i = 0;
  for (; i + block <= n; i += block)
    for (std::size_t k = 0; k < block; ++k) {
      const std::uint32_t u = std::bit_cast<std::uint32_t>(from[i + k]);
      to[i + k] = std::uint16_t(u >> 16);
      lower |= u & 0xFFFFu;
    }
  for (; i < n; ++i) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(from[i]);
    to[i] = std::uint16_t(u >> 16);
    lower |= u & 0xFFFFu;
  }
  return lower == 0;
}

template <class T>  // float or double
void from_bf16(const bf16* from, std::size_t n, T* to) {
  using bf16_detail::block;
  std::size_t i = 0;
  for (; i + block <= n; i += block)
    for (std::size_t k = 0; k < block; ++k) to[i + k] = T(bf16_detail::widen(from[i + k]));
  for (; i < n; ++i) to[i] = T(bf16_detail::widen(from[i]));
}

}  // namespace gshard::detail
