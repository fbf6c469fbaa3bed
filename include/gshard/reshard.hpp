// gshard/reshard.hpp — moves a tensor between shardings: reshard<Target>(t),
// the one-collective forms (all_gather<"x">(t), all_to_all<"x", Dim>(t), ...),
// and gather/scatter to and from a global tensor. Plans come from
// reshard_plan.hpp at compile time; the executor here is instantiated per
// element type and rank only, and runs each step as Pack / Communicate / Unpack.
#pragma once

#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "gshard/collectives.hpp"
#include "gshard/detail/copy_box.hpp"
#include "gshard/reshard_plan.hpp"
#include "gshard/tensor.hpp"

namespace gshard {
namespace detail {

template <int Rank>
index_t product(const shape<Rank>& e, int from = 0, int to = Rank) {
  index_t p = 1;
  for (int d = from; d < to; ++d) p *= e[std::size_t(d)];
  return p;
}

// The rank whose `from` block is the `to` block of the rank at `coords`
// (a bijection when permute_suffices(from, to)).
inline int permute_source(const mesh_base& m, const rlayout& from, const rlayout& to, const index_t* coords) {
  const index_t* size = m.sizes();
  index_t src[max_mesh_axes] = {};
  for (int d = 0; d < max_rank; ++d) {
    index_t b = 0;
    for (int i = 0; i < to.dims[d].n; ++i) b = b * size[to.dims[d].ax[i]] + coords[to.dims[d].ax[i]];
    for (int i = from.dims[d].n - 1; i >= 0; --i) {
      const int a = from.dims[d].ax[i];
      src[a] = b % size[a];
      b /= size[a];
    }
  }
  for (int a = 0; a < m.naxes(); ++a)
    if (from.is_partial(a)) src[a] = coords[a];
  // Axes that split nothing: map the position on to's free axes onto from's.
  index_t u = 0;
  for (int a = 0; a < m.naxes(); ++a)
    if (!((to.used_mask() >> a) & 1u)) u = u * size[a] + coords[a];
  for (int a = m.naxes() - 1; a >= 0; --a)
    if (!((from.used_mask() >> a) & 1u)) {
      src[a] = u % size[a];
      u /= size[a];
    }
  return m.rank_of(src);
}

// Copies piece `j` of `in` along dim d (j-th of `parts` equal pieces) into `out`.
template <class T, int Rank>
void take_piece(const T* in, const shape<Rank>& e, int d, index_t parts, index_t j, T* out) {
  shape<Rank> piece = e, off{}, zero{};
  piece[std::size_t(d)] = e[std::size_t(d)] / parts;
  off[std::size_t(d)] = j * piece[std::size_t(d)];
  copy_box(in, e.data(), off.data(), out, piece.data(), zero.data(), piece.data(), Rank);
}
// Copies `piece` into `out` (extents e) at position j along dim d.
template <class T, int Rank>
void put_piece(const T* piece, const shape<Rank>& pe, int d, index_t j, T* out, const shape<Rank>& e) {
  shape<Rank> off{}, zero{};
  off[std::size_t(d)] = j * pe[std::size_t(d)];
  copy_box(piece, pe.data(), zero.data(), out, e.data(), off.data(), pe.data(), Rank);
}

// Runs one step; `before` is the layout of `in`, and the result has `after`.
// One piece: a switch over the step kinds, each case its Pack / Communicate /
// Unpack in a few lines; split per kind, the cases would repeat the shared
// geometry (e, the group, the block sizes) six times.
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> run_step(const mesh_base& m, const reshard_step& s, const rlayout& before, const rlayout& after,
                               const local_tensor<T, Rank>& in, const shape<Rank>& global) {
  const shape<Rank> e = local_extents<Rank>(before, global, m);
  const shape<Rank> eo = local_extents<Rank>(after, global, m);
  const std::size_t n = std::size_t(product<Rank>(e));
  switch (s.kind) {
    case step_kind::all_gather: {  // (.., d{..,x}, ..) |-> (.., d{..}, ..)
      const axis_group& g = m.group(1u << s.axis);
      local_tensor<T, Rank> out(eo);
      if (product<Rank>(e, 0, s.from_dim) == 1) {
        all_gather<T>(g, {in.data(), n}, {out.data(), std::size_t(out.size())});
        return out;
      }
      std::vector<T> recv(n * std::size_t(g.size));  // Communicate
      all_gather<T>(g, {in.data(), n}, recv);
      for (int p = 0; p < g.size; ++p) put_piece<T, Rank>(recv.data() + std::size_t(p) * n, e, s.from_dim, p, out.data(), eo);  // Unpack
      return out;
    }
    case step_kind::slice: {  // (.., d{..}, ..) |-> (.., d{..,x}, ..), local
      local_tensor<T, Rank> out(eo);
      take_piece<T, Rank>(in.data(), e, s.to_dim, m.size(s.axis), m.coord(s.axis), out.data());
      return out;
    }
    case step_kind::all_to_all: {  // (.., a{..,x}, .., b{..}, ..) |-> (.., a{..}, .., b{..,x}, ..)
      const axis_group& g = m.group(1u << s.axis);
      const index_t P = g.size;
      local_tensor<T, Rank> out(eo);
      std::vector<T> send_buf, recv_buf;
      const T* send = in.data();
      if (product<Rank>(e, 0, s.to_dim) != 1) {  // Pack: piece j of dim b goes to rank j
        send_buf.resize(n);
        for (index_t j = 0; j < P; ++j) take_piece<T, Rank>(in.data(), e, s.to_dim, P, j, send_buf.data() + std::size_t(j) * (n / std::size_t(P)));
        send = send_buf.data();
      }
      const bool direct = product<Rank>(eo, 0, s.from_dim) == 1;
      if (!direct) recv_buf.resize(n);
      T* recv = direct ? out.data() : recv_buf.data();
      all_to_all<T>(g, {send, n}, {recv, n});  // Communicate
      if (!direct) {                           // Unpack: the piece from rank i is block i of dim a
        shape<Rank> pe = e;
        pe[std::size_t(s.to_dim)] = eo[std::size_t(s.to_dim)];
        for (index_t i = 0; i < P; ++i) put_piece<T, Rank>(recv + std::size_t(i) * (n / std::size_t(P)), pe, s.from_dim, i, out.data(), eo);
      }
      return out;
    }
    case step_kind::all_reduce: {  // partial{x} |-> replicated on x
      local_tensor<T, Rank> out(eo);
      all_reduce<T>(m.group(s.mask), {in.data(), n}, {out.data(), n});
      return out;
    }
    case step_kind::reduce_scatter: {  // partial{x} |-> (.., d{..,x}, ..)
      const axis_group& g = m.group(1u << s.axis);
      const index_t P = g.size;
      local_tensor<T, Rank> out(eo);
      std::vector<T> send_buf;
      const T* send = in.data();
      if (product<Rank>(e, 0, s.to_dim) != 1) {  // Pack
        send_buf.resize(n);
        for (index_t j = 0; j < P; ++j) take_piece<T, Rank>(in.data(), e, s.to_dim, P, j, send_buf.data() + std::size_t(j) * (n / std::size_t(P)));
        send = send_buf.data();
      }
      reduce_scatter<T>(g, {send, n}, {out.data(), std::size_t(out.size())});  // Communicate
      return out;
    }
    case step_kind::zero_partial: {  // replicated on x |-> partial{x}: coordinate 0 keeps the value
      local_tensor<T, Rank> out(eo);
      if (m.coord(s.axis) != 0) out.setZero();
      else out = in;
      return out;
    }
    case step_kind::permute: {  // same blocks, other ranks
      const axis_group& g = m.all_axes();
      const int source = permute_source(m, before, after, m.coords());
      int dest = -1;
      for (int q = 0; q < m.nranks() && dest < 0; ++q)
        if (permute_source(m, before, after, m.coords_of(q).data()) == m.rank()) dest = q;
      local_tensor<T, Rank> out(eo);
      permute<T>(g, {in.data(), n}, dest, {out.data(), std::size_t(out.size())}, source);
      return out;
    }
  }
  return in;
}

// Runs steps [first, n) on a shard it owns: all_reduce and zero_partial
// work in place, the other steps write a fresh shard.
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> execute_reshard(const mesh_base& m, const reshard_steps& p, local_tensor<T, Rank>&& local,
                                      const shape<Rank>& global, int first = 0) {
  for (int i = first; i < p.n; ++i) {
    const reshard_step& s = p.step[i];
    if (s.kind == step_kind::all_reduce) {
      all_reduce<T>(m.group(s.mask), std::span<T>(local.data(), std::size_t(local.size())));
    } else if (s.kind == step_kind::zero_partial) {
      if (m.coord(s.axis) != 0) local.setZero();
    } else {
      local = run_step<T, Rank>(m, s, p.state[i], p.state[i + 1], local, global);
    }
  }
  return std::move(local);
}

// Runs a plan on a shard it only reads: the first step writes a fresh shard.
template <class T, int Rank>
GSHARD_NOINLINE local_tensor<T, Rank> execute_reshard(const mesh_base& m, const reshard_steps& p, const local_tensor<T, Rank>& local,
                                      const shape<Rank>& global) {
  if (p.n == 0) return local;
  return execute_reshard<T, Rank>(m, p, run_step<T, Rank>(m, p.step[0], p.state[0], p.state[1], local, global), global, 1);
}

// Plans at run time with the mesh's real sizes, then executes: for layouts
// that exist only at run time (the exhaustive tests).
template <class T, int Rank>
local_tensor<T, Rank> reshard_dynamic(const mesh_base& m, const rlayout& from, const rlayout& to,
                                      const local_tensor<T, Rank>& local, const shape<Rank>& global) {
  const reshard_steps p = plan_reshard(from, to, m.naxes(), m.sizes());
  return execute_reshard<T, Rank>(m, p, local, global);
}

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
    out += "   " + notation(unresolve(p.state[i + 1], names), rank, dtype, labels, global);
    if (m && global && is_collective(s.kind)) {
      index_t n = 1;
      for (int d = 0; d < rank; ++d) n *= dim_block(p.state[i], d, global[d], m->sizes(), m->coords()).extent;
      out += "   " + std::to_string(std::size_t(n) * elem_bytes) + " B/rank";
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

namespace detail {
// The sharding reshard<To> moves a tensor of type X to: To itself, or what
// the rules To give X's labels.
template <class To, class X>
struct reshard_target {
  using type = To;
};
template <fixed_string R, class X>
struct reshard_target<rules_text<R>, X> {
  static_assert(X::labels.size() == X::rank,
                "gshard::reshard: resharding by rules needs a labelled tensor; name its dims with relabel<\"...\">");
  using type = sharding_by<rules_text<R>, X::label_string>;
};
}  // namespace detail

// The same global tensor with sharding To — a sharding, or a rules table
// applied to the tensor's labels. Communication as the plan says. Given an
// rvalue, reuses its storage where a step allows (an all_reduce then runs in
// place).
template <class ToOrRules, class X>
  requires sharded_tensor<X>
auto reshard(X&& x) {
  using Y = std::remove_cvref_t<X>;
  using To = typename detail::reshard_target<ToOrRules, Y>::type;
  using out_t = with_sharding<Y, To>;
  using plan = reshard_plan<typename Y::mesh_type, Y::rank, typename Y::sharding_type, To>;
  using T = typename Y::value_type;
  const auto& mesh = x.mesh();
  const auto extents = x.extents();
  // Before any collective: a target that does not divide throws the same on every rank.
  detail::check_divisible<Y::rank>(out_t::layout, To::spec, extents, mesh, detail::dtype_name<T>(), Y::labels);
  if constexpr (std::is_rvalue_reference_v<X&&> && !std::is_const_v<std::remove_reference_t<X>>) {
    return out_t(mesh, extents, detail::execute_reshard<T, Y::rank>(mesh, plan::steps, std::move(x.local()), extents));
  } else {
    return out_t(mesh, extents, detail::execute_reshard<T, Y::rank>(mesh, plan::steps, x.local(), extents));
  }
}

namespace detail {
template <class S>
struct gradient_spec {  // S without its pending sums
  static constexpr layout_spec value = [] {
    layout_spec g = S::spec;
    g.npartial = 0;
    for (name_t& a : g.partial) a = name_t{};
    return g;
  }();
};
}  // namespace detail

// The sharding of the gradient of a tensor sharded S: S without its pending
// sums. A summand's gradient is the gradient of the sum, the same on every
// rank along those axes — so there it is replicated.
template <class S>
using gradient_sharding =
    layout<detail::text_of<detail::render(detail::gradient_spec<S>::value).n>(detail::gradient_spec<S>::value)>;

// The gradient of x for y = reshard<To>(x), given y's gradient dy — reduced
// (in To's gradient sharding) or still pending (partial over axes where y is
// replicated, e.g. straight from an einsum's backward). It comes back in
// gradient_sharding<From> with the forward's collectives transposed:
// all_to_all <-> the reverse all_to_all, all_reduce <-> nothing (or an
// all_reduce of a pending dy), a local slice <-> all_gather, and all_gather
// <-> a local slice when dy is reduced or one reduce_scatter when it is
// pending (the cheaper way: keep dy partial).
template <class From, class DY>
  requires sharded_tensor<DY>
auto reshard_backward(DY&& dy) {
  return reshard<gradient_sharding<From>>(std::forward<DY>(dy));
}

namespace detail {
template <class Mesh>
consteval layout_spec spec_of(const rlayout& l) { return unresolve(l, Mesh::names); }

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
  static_assert(a < 0 || X::layout.is_partial(a), "gshard::all_reduce: the tensor is not partial over this axis");
  static constexpr bool ok = a >= 0 && X::layout.is_partial(a);
  static constexpr rlayout value = [] {
    rlayout l = X::layout;
    if (ok) l.partial &= ~(1u << a);
    return l;
  }();
  static constexpr layout_spec spec = unresolve(value, X::mesh_type::names);
  using type = layout<text_of<render(spec).n>(spec)>;
  static_assert(!ok || is_single_step<X, step_kind::all_reduce, type>());
};
template <class X, fixed_string Axis>
struct all_gather_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::all_gather: the axis is not in the tensor's mesh");
  static constexpr int d = a < 0 ? -1 : X::layout.dim_of(a);
  static_assert(a < 0 || d >= 0, "gshard::all_gather: the axis splits no dim of the tensor");
  static_assert(d < 0 || minor_axis(X::layout, d) == a,
                "gshard::all_gather: the axis is not the minor-most axis of its dim; gather the minor axes first");
  static constexpr bool ok = d >= 0 && minor_axis(X::layout, d) == a;
  static constexpr rlayout value = [] {
    rlayout l = X::layout;
    if (ok) l.pop(d);
    return l;
  }();
  static constexpr layout_spec spec = unresolve(value, X::mesh_type::names);
  using type = layout<text_of<render(spec).n>(spec)>;
  static_assert(!ok || is_single_step<X, step_kind::all_gather, type>());
};
template <class X, fixed_string Axis, int Dim>
struct reduce_scatter_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::reduce_scatter: the axis is not in the tensor's mesh");
  static_assert(a < 0 || X::layout.is_partial(a), "gshard::reduce_scatter: the tensor is not partial over this axis");
  static_assert(Dim >= 0 && Dim < X::rank, "gshard::reduce_scatter: the dim is out of range");
  static constexpr bool ok = a >= 0 && X::layout.is_partial(a) && Dim >= 0 && Dim < X::rank;
  static constexpr rlayout value = [] {
    rlayout l = X::layout;
    if (ok) {
      l.partial &= ~(1u << a);
      l.push(Dim, a);
    }
    return l;
  }();
  static constexpr layout_spec spec = unresolve(value, X::mesh_type::names);
  using type = layout<text_of<render(spec).n>(spec)>;
  static_assert(!ok || is_single_step<X, step_kind::reduce_scatter, type>());
};
template <class X, fixed_string Axis, int Dim>
struct all_to_all_target {
  static constexpr int a = X::mesh_type::index_of(Axis.view());
  static_assert(a >= 0, "gshard::all_to_all: the axis is not in the tensor's mesh");
  static constexpr int d = a < 0 ? -1 : X::layout.dim_of(a);
  static_assert(a < 0 || d >= 0, "gshard::all_to_all: the axis splits no dim of the tensor");
  static_assert(d < 0 || (Dim >= 0 && Dim < X::rank && Dim != d),
                "gshard::all_to_all: the target dim is out of range or already split by the axis");
  static_assert(d < 0 || minor_axis(X::layout, d) == a, "gshard::all_to_all: the axis is not the minor-most axis of its dim");
  static constexpr bool ok = d >= 0 && Dim >= 0 && Dim < X::rank && Dim != d && minor_axis(X::layout, d) == a;
  static constexpr rlayout value = [] {
    rlayout l = X::layout;
    if (ok) {
      l.pop(d);
      l.push(Dim, a);
    }
    return l;
  }();
  static constexpr layout_spec spec = unresolve(value, X::mesh_type::names);
  using type = layout<text_of<render(spec).n>(spec)>;
  static_assert(!ok || is_single_step<X, step_kind::all_to_all, type>());
};
}  // namespace detail

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
  static_assert(a < 0 || X::layout.is_free(a),
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
    detail::rlayout l = X::layout;
    l.partial = 0;
    return l;
  }();
  constexpr detail::layout_spec settled_spec = detail::spec_of<typename X::mesh_type>(settled);
  const auto y = reshard<layout<detail::text_of<detail::render(settled_spec).n>(settled_spec)>>(x);
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
  constexpr detail::rlayout L = out_t::layout;
  shape<Rank> g = detail::dims_of<Rank>(global);
  const detail::timed_collective timed(collective::scatter, m.all_axes(),
                                       m.rank() == root ? std::size_t(global.size()) * sizeof(T) : 0,
                                       debug::type_code<T>(), -1);
  if constexpr (Rank > 0) mpi::check(MPI_Bcast(g.data(), Rank, mpi::datatype<index_t>(), root, m.comm()), "MPI_Bcast");
  out_t out(m, g);  // throws on every rank alike when g does not divide
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
