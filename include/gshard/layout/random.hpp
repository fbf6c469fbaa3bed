// gshard/layout/random.hpp — counter-based random numbers: pure functions of their
// keys, so every rank computes the same value for the same (seed, stream,
// position) and every rank count draws the same global tensors, routing
// noise and batches. No state, no MPI.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "gshard/layout/sharding.hpp"

namespace gshard {

namespace detail {
inline constexpr std::uint64_t splitmix(std::uint64_t z) {  // SplitMix64's finaliser
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// The keys mixed in order: (seed, stream) once for a whole tensor, then each element's (a, b).
inline constexpr std::uint64_t random_key(std::uint64_t seed, std::uint64_t stream) { return splitmix(splitmix(seed) ^ stream); }
inline constexpr std::uint64_t random_bits(std::uint64_t key, std::uint64_t a, std::uint64_t b) {
  return splitmix(splitmix(key ^ a) ^ b) >> 11;  // 53 bits
}

// Chris Wellons' lowbias32: a bijection of 32-bit words with low avalanche bias. Two
// multiplies in 32-bit lanes: 16 draws to an AVX-512 register, 8 to an AVX2 one.
inline constexpr std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
// uniform32's draws in two steps: the 64-bit row key for the indices whose high 32 bits are
// hi (once per 2^32 indices), then a word per index from its low 32 bits (two rounds of
// mix32 with the row key's halves, vectorizable).
inline constexpr std::uint64_t random_key32(std::uint64_t key, std::uint64_t hi) { return splitmix(splitmix(key ^ hi) ^ 0x3232); }
inline constexpr std::uint32_t random_bits32(std::uint64_t row_key, std::uint32_t lo) {
  return mix32(mix32(lo ^ std::uint32_t(row_key)) ^ std::uint32_t(row_key >> 32));
}
// The least 32-bit draw that counts as ≥ p for p in [0, 1]: random_bits32(...) ≥ it exactly
// when uniform32(...) ≥ p (both sides exact in double). 2^32 (no draw) for p > 1 − 2^-32.
inline std::uint64_t random_threshold32(double p) { return std::uint64_t(std::ceil(std::ldexp(p, 32))); }
}  // namespace detail

// A uniform double in [0, 1) (the SplitMix64 finaliser over the mixed keys).
inline double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t a, std::uint64_t b) {
  return double(detail::random_bits(detail::random_key(seed, stream), a, b)) * 0x1.0p-53;
}

// A uniform double in [0, 1) with 32 random bits (a multiple of 2^-32), keyed by
// (seed, stream, index). One call costs what uniform's does; its point is the
// split form for a value per element on a hot path (dropout's mask):
// random_key32 once per 2^32 indices, then random_bits32 per index, 16 at a time
// in AVX-512's 32-bit lanes.
inline double uniform32(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t row_key = detail::random_key32(detail::random_key(seed, stream), index >> 32);
  return double(detail::random_bits32(row_key, std::uint32_t(index))) * 0x1.0p-32;
}

// A standard normal keyed by (seed, stream, index) (Box-Muller).
inline double normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const double u1 = uniform(seed, stream, index, 0x5EED), u2 = uniform(seed, stream, index, 0xF00D);
  return std::sqrt(-2.0 * std::log(u1 + 1e-300)) * std::cos(6.283185307179586 * u2);
}

// f(i, g, n) for each run of n elements of t's shard that are consecutive
// both in the local data (from i) and in the global tensor's row-major order
// (from g): the shard's rows along its last dim.
template <class X, class F>
void for_each_global_row(const X& t, F&& f) {
  const auto le = t.local_extents(), off = t.offsets(), ge = t.extents();
  constexpr int R = X::rank;
  if constexpr (R == 0) {
    f(index_t(0), std::uint64_t(0), t.local().size());
  } else {
    const index_t n = le[std::size_t(R - 1)], rows = n > 0 ? t.local().size() / n : 0;
    std::array<index_t, std::size_t(R)> pos{};
    for (index_t r = 0; r < rows; ++r) {
      index_t global = 0;
      for (int d = 0; d < R; ++d) global = global * ge[std::size_t(d)] + off[std::size_t(d)] + pos[std::size_t(d)];
      f(r * n, std::uint64_t(global), n);
      for (int d = R - 2; d >= 0 && ++pos[std::size_t(d)] == le[std::size_t(d)]; --d) pos[std::size_t(d)] = 0;
    }
  }
}

// f(i, g) for each element i of t's shard (its place in the local data)
// with g its row-major index in the global tensor: what keys a random draw
// so that every rank count draws the same global tensor.
template <class X, class F>
void for_each_global_index(const X& t, F&& f) {
  for_each_global_row(t, [&](index_t i, std::uint64_t g, index_t n) {
    for (index_t j = 0; j < n; ++j) f(i + j, g + std::uint64_t(j));
  });
}

// t[i] = stddev · normal(seed, stream, global index of i): each rank fills
// only its shard, and every rank count gives the same global tensor.
template <class X>
void fill_normal(X& t, double stddev, std::uint64_t seed, std::uint64_t stream) {
  for_each_global_index(t, [&](index_t i, std::uint64_t g) {
    t.data()[i] = typename X::value_type(stddev * normal(seed, stream, g));
  });
}

}  // namespace gshard
