// gshard/core/fnv1a.hpp — FNV-1a, 64 bits: the checkpoint's checksums, a
// parameter's stream of initial values (from its name) and the checked
// mode's hash of axis names. One definition: a checkpoint's checksum and a
// model's initial weights must not change with the code around them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace gshard::detail {

inline constexpr std::uint64_t fnv1a_basis = 0xcbf29ce484222325ull;

constexpr std::uint64_t fnv1a(const char* p, std::size_t n, std::uint64_t h = fnv1a_basis) {
  for (std::size_t i = 0; i < n; ++i) h = (h ^ std::uint8_t(p[i])) * 0x100000001b3ull;
  return h;
}
constexpr std::uint64_t fnv1a(std::string_view s, std::uint64_t h = fnv1a_basis) { return fnv1a(s.data(), s.size(), h); }

}  // namespace gshard::detail
