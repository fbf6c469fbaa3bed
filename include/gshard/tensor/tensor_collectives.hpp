// gshard/tensor/tensor_collectives.hpp — collectives named on sharded tensors: the
// one-collective forms of reshard (all_reduce<"x">(t), all_gather<"x">(t),
// reduce_scatter<"x", Dim>(t), all_to_all<"x", Dim>(t)), each checked at
// compile time to be that one collective; broadcast along an axis; and the
// global tensor gathered to every rank, gathered to a root, or scattered
// from one.
#pragma once

#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/runtime/collectives.hpp"
#include "gshard/kernels/copy_box.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/runtime/mpi.hpp"
#include "gshard/tensor/reshard.hpp"

namespace gshard {

namespace detail {
template <class Mesh>
consteval sharding_spec spec_of(const rlayout& l) { return unresolve(l, Mesh::names); }

template <sharded_tensor X, step_kind K, class Target>
constexpr bool is_single_step() {
  constexpr auto p = reshard_plan<typename X::mesh_type, X::rank, typename X::sharding_type, Target>::steps;
  return p.n == 1 && p.step[0].kind == K;
}
}  // namespace detail

namespace detail {
// The target of each one-collective form for a tensor of type X, with the
// checks that it is that one collective; shared by the tensor and the var forms.
// Each ends in the same three lines (its layout as a type, the planner's
// check), written out: folding them takes a template over a layout value
// (a class-type template argument), which GCC 12 gets wrong (sharding.hpp).
template <class X, fixed_string Axis>
struct all_reduce_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::all_reduce: the axis is not in the tensor's mesh");
  static_assert(a < 0 || X::resolved.is_partial(a), "gshard::all_reduce: the tensor is not partial over this axis");
  static constexpr bool ok = a >= 0 && X::resolved.is_partial(a);
  static constexpr rlayout value = [] {
    rlayout l = X::resolved;
    if (ok) l.partial &= ~(1u << a);
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = GSHARD_SHARDING_OF(spec);
  static_assert(!ok || is_single_step<X, step_kind::all_reduce, type>());
};
template <class X, fixed_string Axis>
struct all_gather_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::all_gather: the axis is not in the tensor's mesh");
  static constexpr int d = a < 0 ? -1 : X::resolved.dim_of(a);
  static_assert(a < 0 || d >= 0, "gshard::all_gather: the axis splits no dim of the tensor");
  static_assert(d < 0 || minor_axis(X::resolved, d) == a,
                "gshard::all_gather: the axis is not the minor-most axis of its dim; gather the minor axes first");
  static constexpr bool ok = d >= 0 && minor_axis(X::resolved, d) == a;
  static constexpr rlayout value = [] {
    rlayout l = X::resolved;
    if (ok) l.pop(d);
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = GSHARD_SHARDING_OF(spec);
  static_assert(!ok || is_single_step<X, step_kind::all_gather, type>());
};
template <class X, fixed_string Axis, int Dim>
struct reduce_scatter_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::reduce_scatter: the axis is not in the tensor's mesh");
  static_assert(a < 0 || X::resolved.is_partial(a), "gshard::reduce_scatter: the tensor is not partial over this axis");
  static_assert(Dim >= 0 && Dim < X::rank, "gshard::reduce_scatter: the dim is out of range");
  static constexpr bool ok = a >= 0 && X::resolved.is_partial(a) && Dim >= 0 && Dim < X::rank;
  static constexpr rlayout value = [] {
    rlayout l = X::resolved;
    if (ok) {
      l.partial &= ~(1u << a);
      l.push(Dim, a);
    }
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = GSHARD_SHARDING_OF(spec);
  static_assert(!ok || is_single_step<X, step_kind::reduce_scatter, type>());
};
template <class X, fixed_string Axis, int Dim>
struct all_to_all_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::all_to_all: the axis is not in the tensor's mesh");
  static constexpr int d = a < 0 ? -1 : X::resolved.dim_of(a);
  static_assert(a < 0 || d >= 0, "gshard::all_to_all: the axis splits no dim of the tensor");
  static_assert(d < 0 || (Dim >= 0 && Dim < X::rank && Dim != d),
                "gshard::all_to_all: the target dim is out of range or already split by the axis");
  static_assert(d < 0 || minor_axis(X::resolved, d) == a, "gshard::all_to_all: the axis is not the minor-most axis of its dim");
  static constexpr bool ok = d >= 0 && Dim >= 0 && Dim < X::rank && Dim != d && minor_axis(X::resolved, d) == a;
  static constexpr rlayout value = [] {
    rlayout l = X::resolved;
    if (ok) {
      l.pop(d);
      l.push(Dim, a);
    }
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = GSHARD_SHARDING_OF(spec);
  static_assert(!ok || is_single_step<X, step_kind::all_to_all, type>());
};
}  // namespace detail

// The same four forms on a var are in ad/ops.hpp, on these targets: a
// deliberate parallel (this layer cannot see var).

// partial{Axis} |-> replicated on Axis: one all_reduce.
template <fixed_string Axis, class Xr>
  requires sharded_tensor<Xr>
auto all_reduce(Xr&& x) {
  return reshard<typename detail::all_reduce_target<std::remove_cvref_t<Xr>, Axis>::type>(std::forward<Xr>(x));
}

// (.., d{..,Axis}, ..) |-> (.., d{..}, ..): one all_gather. Axis must be the
// minor-most axis splitting its dim.
template <fixed_string Axis, class Xr>
  requires sharded_tensor<Xr>
auto all_gather(Xr&& x) {
  return reshard<typename detail::all_gather_target<std::remove_cvref_t<Xr>, Axis>::type>(std::forward<Xr>(x));
}

// partial{Axis} |-> (.., Dim{.., Axis}, ..): one reduce_scatter.
template <fixed_string Axis, int Dim, class Xr>
  requires sharded_tensor<Xr>
auto reduce_scatter(Xr&& x) {
  return reshard<typename detail::reduce_scatter_target<std::remove_cvref_t<Xr>, Axis, Dim>::type>(std::forward<Xr>(x));
}

// (.., a{..,Axis}, .., Dim{..}, ..) |-> (.., a{..}, .., Dim{..,Axis}, ..): one all_to_all.
template <fixed_string Axis, int Dim, class Xr>
  requires sharded_tensor<Xr>
auto all_to_all(Xr&& x) {
  return reshard<typename detail::all_to_all_target<std::remove_cvref_t<Xr>, Axis, Dim>::type>(std::forward<Xr>(x));
}

// Every rank along Axis takes the shard of coordinate `root`: one broadcast.
// Axis must hold neither a split nor a pending sum of the tensor (the ranks
// along it are meant to hold the same shard: this makes them agree).
template <fixed_string Axis, sharded_tensor X>
X broadcast(const X& x, int root = 0) {
  constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::broadcast: the axis is not in the tensor's mesh");
  static_assert(a < 0 || X::resolved.is_free(a),
                "gshard::broadcast: the axis splits the tensor or holds its pending sums; broadcasting would give every "
                "rank the root's block under a type that says otherwise");
  X out = x;
  broadcast<typename X::value_type>(x.mesh().group(1u << a), std::span(out.data(), std::size_t(out.local().size())), root);
  return out;
}

// The global tensor on every rank (all_gather and all_reduce as needed).
template <sharded_tensor X>
local_tensor<typename X::value_type, X::rank> gather(const X& x) {
  return reshard<replicate>(x).local();
}

namespace detail {

// Where every rank's shard of a layout-l tensor of extents g lies, and how
// many elements each rank sends (0 where `sends(q)` is false). A pure
// function of values every rank has, so a count MPI cannot hold is refused
// on every rank alike.
template <int R>
struct shard_table {
  std::vector<shape<R>> extent, offset;
  std::vector<int> counts, displs;
};
template <int R, class Sends>
shard_table<R> shard_table_of(const mesh_base& m, const rlayout& l, const shape<R>& g, Sends sends, const char* op) {
  shard_table<R> t;
  std::size_t total = 0;
  for (int q = 0; q < m.nranks(); ++q) {
    const std::vector<index_t> c = m.coords_of(q);
    shape<R> le{}, off{};
    std::size_t n = 1;
    for (int d = 0; d < R; ++d) {
      const block b = dim_block(l, d, g[std::size_t(d)], m.sizes(), c.data());
      le[std::size_t(d)] = b.extent;
      off[std::size_t(d)] = b.offset;
      n *= std::size_t(b.extent);
    }
    if (!sends(c)) n = 0;
    t.extent.push_back(le);
    t.offset.push_back(off);
    t.counts.push_back(mpi::count(n, op));
    t.displs.push_back(mpi::count(total, op));
    total += n;
  }
  mpi::count(total, op);
  return t;
}

}  // namespace detail

// The global tensor on rank `root` of the mesh; other ranks get an empty
// tensor. Pending sums are reduced first (all_reduce); then one MPI_Gatherv
// (counted as `gather`) from the ranks at coordinate 0 of every axis that
// splits nothing.
template <sharded_tensor X>
local_tensor<typename X::value_type, X::rank> gather_to_root(const X& x, int root = 0) {
  using T = typename X::value_type;
  constexpr int R = X::rank;
  constexpr detail::rlayout settled = [] {
    detail::rlayout l = X::resolved;
    l.partial = 0;
    return l;
  }();
  constexpr detail::sharding_spec settled_spec = detail::spec_of<typename X::mesh_type>(settled);
  const auto y = reshard<GSHARD_SHARDING_OF(settled_spec)>(x);
  const detail::mesh_base& m = x.mesh();
  const auto owner = [&](const std::vector<index_t>& c) {
    for (int a = 0; a < m.naxes(); ++a)
      if (!((settled.used_mask() >> a) & 1u) && c[std::size_t(a)] != 0) return false;
    return true;
  };
  const auto t = detail::shard_table_of<R>(m, settled, x.extents(), owner, "gather_to_root");
  const int n = t.counts[std::size_t(m.rank())];
  const std::size_t total = std::size_t(t.displs.back()) + std::size_t(t.counts.back());
  std::vector<T> recv(m.rank() == root ? total : 0);
  const detail::timed_collective timed(collective::gather, m.all_axes(), std::size_t(n) * sizeof(T),
                                       debug::type_code<T>(), -1);
  mpi::check(MPI_Gatherv(y.data(), n, mpi::datatype<T>(), recv.data(), t.counts.data(), t.displs.data(), mpi::datatype<T>(),
                         root, m.comm()),
             "MPI_Gatherv");
  if (m.rank() != root) return local_tensor<T, R>();
  local_tensor<T, R> out(x.extents());
  const shape<R> zero{};
  for (int q = 0; q < m.nranks(); ++q)
    if (t.counts[std::size_t(q)] > 0)
      detail::copy_box(recv.data() + t.displs[std::size_t(q)], t.extent[std::size_t(q)].data(), zero.data(), out.data(),
                       x.extents().data(), t.offset[std::size_t(q)].data(), t.extent[std::size_t(q)].data(), R);
  return out;
}

// Rank `root` holds `global`; every rank receives its shard. Other ranks'
// `global` is ignored: the extents travel from the root (MPI_Bcast), then one
// MPI_Scatterv; counted together as one `scatter`. For a partial sharding,
// coordinate 0 of each partial axis receives the value, the others zeros.
template <class Sharding, mesh_type Mesh, class T, int Rank>
tensor<T, Rank, Mesh, Sharding> scatter(const Mesh& m, const local_tensor<T, Rank>& global, int root = 0) {
  using out_t = tensor<T, Rank, Mesh, Sharding>;
  constexpr detail::rlayout L = out_t::resolved;
  shape<Rank> g = detail::dims_of<Rank>(global);
  const detail::timed_collective timed(collective::scatter, m.all_axes(),
                                       m.rank() == root ? std::size_t(global.size()) * sizeof(T) : 0,
                                       debug::type_code<T>(), -1);
  if constexpr (Rank > 0) mpi::check(MPI_Bcast(g.data(), Rank, mpi::datatype<index_t>(), root, m.comm()), "MPI_Bcast");
  out_t out(m, g);  // throws on every rank alike for a negative extent
  const auto receives = [&](const std::vector<index_t>& c) {
    for (int a = 0; a < m.naxes(); ++a)
      if (L.is_partial(a) && c[std::size_t(a)] != 0) return false;
    return true;
  };
  const auto t = detail::shard_table_of<Rank>(m, L, g, receives, "scatter");
  std::vector<T> send;
  if (m.rank() == root) {
    send.resize(std::size_t(t.displs.back()) + std::size_t(t.counts.back()));
    const shape<Rank> zero{};
    for (int q = 0; q < m.nranks(); ++q)
      if (t.counts[std::size_t(q)] > 0)
        detail::copy_box(global.data(), g.data(), t.offset[std::size_t(q)].data(), send.data() + t.displs[std::size_t(q)],
                         t.extent[std::size_t(q)].data(), zero.data(), t.extent[std::size_t(q)].data(), Rank);
  }
  mpi::check(MPI_Scatterv(send.data(), t.counts.data(), t.displs.data(), mpi::datatype<T>(), out.data(),
                          t.counts[std::size_t(m.rank())], mpi::datatype<T>(), root, m.comm()),
             "MPI_Scatterv");
  return out;
}

}  // namespace gshard
