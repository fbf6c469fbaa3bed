// gshard/tensor/reshard_plan.hpp — reshard_plan<Mesh, Rank, From, To>: the plan of
// reshard<To> as a type, its steps computed at compile time, printable with
// and without sizes (`std::cout << reshard_plan<grid, 3, by_group, by_expert>{}`).
// describe_steps() prints any plan's steps (an einsum's plan ends in one).
#pragma once

#include <array>
#include <cstddef>
#include <ostream>
#include <string>
#include <string_view>

#include "gshard/layout/shard_geometry.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/layout/notation.hpp"
#include "gshard/layout/reshard_steps.hpp"
#include "gshard/tensor/tensor.hpp"

namespace gshard {
namespace detail {

// The steps one per line, numbered from `first` (an einsum's plan continues
// its own numbering into its output's reshard).
template <std::size_t N>
std::string describe_steps(const reshard_steps& p, const std::array<name_t, N>& names, int rank, std::string_view dtype,
                           std::string_view labels, const index_t* global = nullptr, const mesh_base* m = nullptr,
                           std::size_t elem_bytes = 0, int first = 1) {
  std::string out;
  if (p.n == 0) return "  (no steps: the shardings are equal)\n";
  auto dim_name = [&](int d) {
    std::string n(1, d < int(labels.size()) ? labels[std::size_t(d)] : 'd');
    if (d >= int(labels.size())) n += std::to_string(d);
    return n;
  };
  if (m && global) {  // the steps that run (plan_to_run): a permute whose blocks differ, step by step
    const reshard_steps run = plan_to_run(p, global, rank, m->naxes(), m->sizes());
    if (!(run == p)) return describe_steps(run, names, rank, dtype, labels, global, m, elem_bytes, first);
  }
  for (int i = 0; i < p.n; ++i) {
    const reshard_step& s = p.step[i];
    out += "  " + std::to_string(first + i) + ". " + std::string(name_of(s.kind));
    if (s.kind == step_kind::permute) out += " over the whole mesh";
    else {
      out += " over ";
      bool lead = true;  // the first axis named
      for (std::size_t a = 0; a < N; ++a)
        if ((s.mask >> a) & 1u) {
          if (!lead) out += ',';
          out += names[a].view();
          lead = false;
        }
    }
    if (s.from_dim >= 0 && s.to_dim >= 0) out += ": " + dim_name(s.from_dim) + " -> " + dim_name(s.to_dim);
    else if (s.from_dim >= 0) out += ": " + dim_name(s.from_dim);
    else if (s.to_dim >= 0) out += ": " + dim_name(s.to_dim);
    const sharding_spec after = unresolve(p.state[i + 1], names);
    out += "   " + notation(after, rank, dtype, labels, global);
    if (m && global) out += uneven_note(p.state[i + 1], after, global, rank, *m, labels);
    if (m && global && is_collective(s.kind)) {
      index_t n = 1;
      for (int d = 0; d < rank; ++d) n *= dim_block(p.state[i], d, global[d], m->sizes(), m->coords()).extent;
      const index_t sent = step_elements(s, p.state[i], p.state[i + 1], global, rank, m->sizes(), m->coords());
      out += "   " + std::to_string(std::size_t(sent) * elem_bytes) + " B/rank";
      if (sent > n) {
        out += " (";
        out += std::to_string(std::size_t(sent - n) * elem_bytes);
        out += " B of it padding)";
      }
    }
    out += '\n';
  }
  return out;
}

}  // namespace detail

// The plan of reshard<To> for a Rank-dim tensor sharded From on Mesh, as a
// type: steps are computed at compile time and can be printed.
//   std::cout << reshard_plan<grid, 3, by_group, by_expert>{};
template <mesh_type Mesh, int Rank, class From, class To>
struct reshard_plan {
  static constexpr detail::rlayout from = detail::bind_layout<Mesh, Rank, From>::value;
  static constexpr detail::rlayout to = detail::bind_layout<Mesh, Rank, To>::value;
  static constexpr detail::reshard_steps steps =
      detail::plan_reshard(from, to, Mesh::axis_count, Mesh::static_sizes.data());
  static_assert(steps.state[steps.n] == to, "gshard::reshard: the planner did not reach the target (a gshard bug)");

  // Without sizes: the steps and the layout after each.
  static std::string describe(std::string_view labels = {}, std::string_view dtype = "") {
    return "reshard " + detail::notation(From::spec, Rank, dtype, labels) + " -> " +
           detail::notation(To::spec, Rank, dtype, labels) + "\n" +
           detail::describe_steps(steps, Mesh::names, Rank, dtype, labels);
  }
  // With a bound mesh and global extents: also the bytes each rank sends.
  template <class T>
  static std::string describe(const Mesh& m, const shape<Rank>& global, std::string_view labels = {}) {
    const auto dt = detail::dtype_name<T>();
    return "reshard " + detail::notation(From::spec, Rank, dt, labels, global.data()) + " -> " +
           detail::notation(To::spec, Rank, dt, labels, global.data()) + " on " + m.describe() + "\n" +
           detail::describe_steps(steps, Mesh::names, Rank, dt, labels, global.data(), &m, sizeof(T));
  }
  friend std::ostream& operator<<(std::ostream& os, const reshard_plan&) { return os << describe(); }
};

}  // namespace gshard
