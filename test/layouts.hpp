// test/layouts.hpp — every layout of a tensor over a mesh, and this rank's
// shard of a global tensor under any of them: the raw material of the
// exhaustive reshard and einsum tests.
#pragma once

#include <gshard/gshard.hpp>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <random>
#include <vector>

namespace gshard::testing {

using detail::rlayout;

// Every layout of a rank-`rank` tensor over `naxes` axes: each axis splits
// one dim, is partial, or is unused; the axes of a dim in every order.
inline std::vector<rlayout> all_layouts(int rank, int naxes) {
  std::vector<rlayout> out;
  std::vector<int> state(std::size_t(naxes), -2);  // -2 unused, -1 partial, d split
  std::function<void(int)> assign = [&](int a) {
    if (a == naxes) {
      std::vector<std::vector<int>> per_dim(static_cast<std::size_t>(rank));
      rlayout base;
      for (int k = 0; k < naxes; ++k) {
        if (state[std::size_t(k)] == -1) base.partial |= 1u << k;
        if (state[std::size_t(k)] >= 0) per_dim[std::size_t(state[std::size_t(k)])].push_back(k);
      }
      std::function<void(int, rlayout)> order = [&](int d, rlayout l) {
        if (d == rank) {
          out.push_back(l);
          return;
        }
        auto axes = per_dim[std::size_t(d)];
        std::sort(axes.begin(), axes.end());
        do {
          rlayout l2 = l;
          for (int ax : axes) l2.push(d, ax);
          order(d + 1, l2);
        } while (std::next_permutation(axes.begin(), axes.end()));
      };
      order(0, base);
      return;
    }
    for (int s = -2; s < rank; ++s) {
      state[std::size_t(a)] = s;
      assign(a + 1);
    }
  };
  assign(0);
  return out;
}

// Global tensors every rank builds alike: arange (unique values, for layout
// tests) or seeded uniform [-1, 1) (for numerics).
template <int R, class T = double>
local_tensor<T, R> global_tensor(const shape<R>& e) {
  local_tensor<T, R> t(e);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = T(i + 1);
  return t;
}
template <int R, class T = double>
local_tensor<T, R> random_tensor(const shape<R>& e, unsigned seed) {
  local_tensor<T, R> t(e);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = T(u(gen));
  return t;
}

// This rank's shard of `g` under layout l; for partial layouts, distinct
// dyadic summands (exact in float) whose sum is the shard.
template <int R, class T = double>
local_tensor<T, R> shard_of(const local_tensor<T, R>& g, const rlayout& l, const detail::mesh_base& m) {
  const shape<R> ge = detail::dims_of<R>(g);
  const shape<R> le = detail::local_extents<R>(l, ge, m), off = detail::global_offsets<R>(l, ge, m), zero{};
  local_tensor<T, R> out(le);
  if (out.size() > 0) detail::copy_box(g.data(), ge.data(), off.data(), out.data(), le.data(), zero.data(), le.data(), R);
  index_t c = 0, parts = 1;
  for (int a = 0; a < m.naxes(); ++a)
    if (l.is_partial(a)) {
      c = c * m.size(a) + m.coord(a);
      parts *= m.size(a);
    }
  for (index_t i = 0; i < out.size(); ++i) {
    const T noise = T((i * 7 + 3) % 11) / T(16);
    out.data()[i] = c < parts - 1 ? T(c + 1) * noise : out.data()[i] - noise * T(parts * (parts - 1) / 2);
  }
  return out;
}

// The meshes a test runs on at this world size P, bound to MPI_COMM_WORLD:
// (P) always; (1,P) and (P,1) when `size_one_axes`; (2,2) at 4 ranks; (2,4)
// at 8, and (4,2) too when `both_orders`.
struct mesh_case {
  std::string name;
  std::unique_ptr<detail::mesh_base> mesh;
};
inline std::vector<mesh_case> meshes_for_world(bool size_one_axes, bool both_orders) {
  using dyn1 = mesh<axis<"x">>;
  using dyn2 = mesh<axis<"x">, axis<"y">>;
  int P = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  const std::string p = std::to_string(P);
  auto two = [](index_t a, index_t b) { return std::make_unique<dyn2>(MPI_COMM_WORLD, std::array<index_t, 2>{a, b}); };
  std::vector<mesh_case> out;
  out.push_back({"(" + p + ")", std::make_unique<dyn1>(MPI_COMM_WORLD)});
  if (size_one_axes) {
    out.push_back({"(1," + p + ")", two(1, P)});
    out.push_back({"(" + p + ",1)", two(P, 1)});
  }
  if (P == 4) out.push_back({"(2,2)", two(2, 2)});
  if (P == 8) out.push_back({"(2,4)", two(2, 4)});
  if (P == 8 && both_orders) out.push_back({"(4,2)", two(4, 2)});
  return out;
}

}  // namespace gshard::testing
