// gshard/core/types.hpp — the basic types and limits every header shares: the
// index type, how many dims a sharding can describe and how many axes a mesh
// can have, and GSHARD_NOINLINE for the shared run-time paths that would
// otherwise be inlined into every instantiation of a typed wrapper (one copy
// of an executor per element type and rank, not per sharding or plan).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

namespace Eigen {
struct bfloat16;  // <Eigen/Core>; here only its name
}

namespace gshard {

using index_t = std::ptrdiff_t;

inline constexpr int max_rank = 8;        // tensor dims a sharding can describe
inline constexpr int max_mesh_axes = 6;   // axes a mesh can have

// bfloat16: fp32's sign, exponent and top 7 mantissa bits. gshard stores
// and sends it; every sum of bf16 numbers is taken in fp32 and rounded once.
using bf16 = Eigen::bfloat16;

// The type sums of T are taken in: fp32 for bf16 (rounded once, at the
// end), T itself otherwise.
template <class T>
using sum_t = std::conditional_t<std::is_same_v<T, bf16>, float, T>;

// What a reshard's messages carry (reshard<To>(x, wire::bf16)): the
// tensor's own elements, or — for float and double tensors — bf16: half
// of fp32's bytes, a quarter of double's, each value rounded to nearest
// even (a double through fp32) to within 2⁻⁸ of itself, the parts of a
// sum added in fp32 and rounded once per summing step.
// wire::trimmed, alone or with bf16 (wire::bf16 | wire::trimmed): an
// all_to_all's pieces travel without their trailing rows of zeros — in
// each [rows, last dim] matrix of a piece, the rows after its last row
// with a nonzero bit — and the receiver writes those zeros back: the same
// tensor to the bit, in ragged messages (each led by its matrices' row
// counts, 4 bytes each). The MoE layer's capacity slots fill from the
// first, so its all_to_alls then carry the filled slots only. Other steps
// travel whole.
enum class wire : std::uint8_t { same = 0, bf16 = 1, trimmed = 2 };
constexpr wire operator|(wire a, wire b) { return wire(std::uint8_t(a) | std::uint8_t(b)); }
constexpr bool sends_bf16(wire w) { return (std::uint8_t(w) & std::uint8_t(wire::bf16)) != 0; }
constexpr bool trims_rows(wire w) { return (std::uint8_t(w) & std::uint8_t(wire::trimmed)) != 0; }

// The element types gshard moves and prints, in one table: a tensor's
// printed type (f32[...]), its MPI datatype (runtime/mpi.hpp) and the checked mode's
// comparison (runtime/debug.hpp) all read it.
enum class element : std::uint8_t { f32 = 1, f64, i32, i64, u8, character, bf16, other };

template <class T>
constexpr element element_of() {
  if constexpr (std::is_same_v<T, float>) return element::f32;
  else if constexpr (std::is_same_v<T, double>) return element::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return element::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return element::i64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return element::u8;
  else if constexpr (std::is_same_v<T, char>) return element::character;
  else if constexpr (std::is_same_v<T, bf16>) return element::bf16;
  else return element::other;
}

constexpr std::string_view name_of(element e) {
  switch (e) {
    case element::f32: return "f32";
    case element::f64: return "f64";
    case element::i32: return "i32";
    case element::i64: return "i64";
    case element::u8: return "u8";
    case element::character: return "char";
    case element::bf16: return "bf16";
    case element::other: break;
  }
  return "?";
}

}  // namespace gshard

#if defined(__GNUC__)
#define GSHARD_NOINLINE __attribute__((noinline))
#else
#define GSHARD_NOINLINE
#endif
