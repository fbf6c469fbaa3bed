// gshard/layout/rlayout.hpp — a sharding with its axis names resolved to a
// mesh's axis indices (rlayout, one rdim per tensor dim, the partial axes as
// a bit mask): the form the planners, the shard geometry and the executors
// compute on. resolve() and unresolve() go between it and the named
// sharding_spec of sharding.hpp. Knows nothing of MPI.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "gshard/core/fixed_string.hpp"
#include "gshard/layout/sharding.hpp"
#include "gshard/core/types.hpp"

namespace gshard::detail {

struct rdim {
  int n = 0;
  std::int8_t ax[max_mesh_axes]{};  // mesh axis indices, major to minor
  friend constexpr bool operator==(const rdim&, const rdim&) = default;
};

// a's axes are the first of b's (a dim split over a can be sliced on to b).
constexpr bool is_prefix(const rdim& a, const rdim& b) {
  if (a.n > b.n) return false;
  for (int i = 0; i < a.n; ++i)
    if (a.ax[i] != b.ax[i]) return false;
  return true;
}

struct rlayout {
  rdim dims[max_rank]{};
  std::uint32_t partial = 0;  // bit a set: axis a is partial

  friend constexpr bool operator==(const rlayout&, const rlayout&) = default;

  constexpr int dim_of(int axis) const {
    for (int d = 0; d < max_rank; ++d)
      for (int i = 0; i < dims[d].n; ++i)
        if (dims[d].ax[i] == axis) return d;
    return -1;
  }
  constexpr bool is_partial(int axis) const { return (partial >> axis) & 1u; }
  // Appends `axis` as the minor-most axis of dim d / removes d's minor-most axis.
  constexpr void push(int d, int axis) { dims[d].ax[dims[d].n++] = std::int8_t(axis); }
  constexpr void pop(int d) { dims[d].ax[--dims[d].n] = 0; }  // cleared, so layouts compare whole
  constexpr bool is_free(int axis) const { return dim_of(axis) < 0 && !is_partial(axis); }
  constexpr std::uint32_t used_mask() const {
    std::uint32_t m = partial;
    for (const rdim& d : dims)
      for (int i = 0; i < d.n; ++i) m |= 1u << d.ax[i];
    return m;
  }
  constexpr std::uint32_t split_mask() const { return used_mask() & ~partial; }
};

// The mesh axes splitting one dim, as a bit mask.
constexpr std::uint32_t axis_set(const rdim& d) {
  std::uint32_t m = 0;
  for (int i = 0; i < d.n; ++i) m |= 1u << d.ax[i];
  return m;
}

struct resolve_result {
  rlayout layout{};
  bool ok = true;
  name_t unknown{};  // the first axis name not in the mesh
};

// Maps the axis names of `s` onto the indices of `names` (a mesh's axes).
template <std::size_t NAxes>
constexpr resolve_result resolve(const sharding_spec& s, const std::array<name_t, NAxes>& names) {
  resolve_result r;
  auto index_of = [&](const name_t& n) -> int {
    for (std::size_t i = 0; i < NAxes; ++i)
      if (names[i] == n) return int(i);
    return -1;
  };
  for (int d = 0; d < max_rank; ++d) {
    for (int i = 0; i < s.dims[d].n; ++i) {
      const int a = index_of(s.dims[d].axes[i]);
      if (a < 0) { r.ok = false; r.unknown = s.dims[d].axes[i]; return r; }
      r.layout.dims[d].ax[i] = std::int8_t(a);
    }
    r.layout.dims[d].n = s.dims[d].n;
  }
  for (int i = 0; i < s.npartial; ++i) {
    const int a = index_of(s.partial[i]);
    if (a < 0) { r.ok = false; r.unknown = s.partial[i]; return r; }
    r.layout.partial |= 1u << a;
  }
  return r;
}

// The inverse of resolve: a name-based spec from a resolved layout.
template <std::size_t NAxes>
constexpr sharding_spec unresolve(const rlayout& l, const std::array<name_t, NAxes>& names) {
  spec_result r;
  for (int d = 0; d < max_rank; ++d) {
    name_t axes[max_mesh_axes]{};
    for (int i = 0; i < l.dims[d].n; ++i) axes[i] = names[std::size_t(l.dims[d].ax[i])];
    if (l.dims[d].n > 0) add_split(r, d, axes, l.dims[d].n);
  }
  for (std::size_t a = 0; a < NAxes; ++a)
    if (l.is_partial(int(a))) add_partial(r, &names[a], 1);
  return r.spec;
}

}  // namespace gshard::detail
