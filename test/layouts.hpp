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
  if (P == 6) out.push_back({"(2,3)", two(2, 3)});
  if (P == 6 && both_orders) out.push_back({"(3,2)", two(3, 2)});
  if (P == 8) out.push_back({"(2,4)", two(2, 4)});
  if (P == 8 && both_orders) out.push_back({"(4,2)", two(4, 2)});
  return out;
}

// The collectives a plan runs on a tensor of extents `global`, as the
// recorder sees them: kind, axes, bytes. A permute whose blocks differ runs
// step by step. A step's bytes are this rank's block, or where a dim the
// step cuts has pieces of different lengths, each piece padded to the
// longest in its group.
inline std::vector<collective_event> planned_collectives(const detail::reshard_steps& plan, const detail::mesh_base& m,
                                                         const index_t* global, int rank, std::size_t elem) {
  const detail::reshard_steps ran = detail::plan_to_run(plan, global, rank, m.naxes(), m.sizes());
  std::vector<collective_event> out;
  for (int i = 0; i < ran.n; ++i) {
    const detail::reshard_step& s = ran.step[i];
    if (!is_collective(s.kind)) continue;
    index_t e[max_rank] = {};
    for (int d = 0; d < rank; ++d) e[d] = detail::dim_block(ran.state[i], d, global[d], m.sizes(), m.coords()).extent;
    const auto longest = [&](const rlayout& l, int d) {  // over the group along the step's axis
      index_t most = 0;
      std::vector<index_t> c(m.coords(), m.coords() + m.naxes());
      for (c[std::size_t(s.axis)] = 0; c[std::size_t(s.axis)] < m.size(s.axis); ++c[std::size_t(s.axis)])
        most = std::max(most, detail::dim_block(l, d, global[d], m.sizes(), c.data()).extent);
      return most;
    };
    if (s.kind == step_kind::all_gather || s.kind == step_kind::all_to_all) e[s.from_dim] = longest(ran.state[i], s.from_dim);
    if (s.kind == step_kind::all_to_all || s.kind == step_kind::reduce_scatter)
      e[s.to_dim] = m.size(s.axis) * longest(ran.state[i + 1], s.to_dim);
    index_t n = 1;
    for (int d = 0; d < rank; ++d) n *= e[d];
    out.push_back({collective_of(s.kind), m.label(s.mask), std::size_t(n) * elem});
  }
  return out;
}

}  // namespace gshard::testing
