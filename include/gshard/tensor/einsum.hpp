// gshard/tensor/einsum.hpp — einsum<"GSEC,GSM->EGCM">(a, b) on sharded tensors: the
// spec is parsed and the partitioning planned at compile time; each rank
// slices what the rules allow, runs one local einsum (strided GEMMs), and the
// result comes back in its natural sharding — or in the one the caller names,
// by appending the reshard (a pending sum then becomes a reduce_scatter
// straight into the split output). The plan is einsum_plan<...>
// (einsum_plan.hpp), which prints all of it.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include "gshard/kernels/local_einsum.hpp"
#include "gshard/tensor/einsum_plan.hpp"
#include "gshard/layout/einsum_spec.hpp"
#include "gshard/tensor/reshard.hpp"

namespace gshard {

namespace detail {

// A labelled operand must carry exactly its term's labels; an unlabelled one
// is checked by rank only (the positional API).
template <fixed_string Term, fixed_string Labels>
struct check_operand_labels {
  static_assert(Labels.size() == 0 || Labels.view() == Term.view(),
                "gshard::einsum: a labelled operand's labels differ from its term in the spec (the term, then the "
                "tensor's labels: see the instantiation above); rename its dims with relabel<\"...\">");
  static constexpr bool ok = true;
};

// Everything one einsum call does, as values: the typed API passes plans it
// computed at compile time, the tests pass plans computed at run time.
struct einsum_program {
  einsum_spec spec;
  einsum_sharding sharding;
  reshard_steps slice[max_operands];  // local slices only
  reshard_steps finish;               // natural output -> requested output
};

inline einsum_program plan_einsum_program(const einsum_spec& s, const rlayout* in, const rlayout* requested,
                                          const mesh_base& m) {
  einsum_program p{s, plan_einsum_sharding(s, in, m.naxes()), {}, {}};
  for (int op = 0; op < s.nin; ++op) p.slice[op] = plan_reshard(in[op], p.sharding.in[op], m.naxes(), m.sizes());
  p.finish = plan_reshard(p.sharding.out, requested ? *requested : p.sharding.out, m.naxes(), m.sizes());
  return p;
}

// Runs an einsum program on local shards; returns the output shard, of
// element type C (T, or float for bf16 operands), in the requested layout.
// `out_global` receives the output's global extents.
template <class T, int RA, int RB, int RO, class C = T>
GSHARD_NOINLINE local_tensor<C, RO> execute_einsum(const mesh_base& m, const einsum_program& p, const local_tensor<T, RA>& a,
                                   const shape<RA>& ga, const local_tensor<T, RB>* b, const shape<RB>& gb,
                                   shape<RO>& out_global) {
  const einsum_spec& s = p.spec;
  index_t global[128] = {};
  for (int d = 0; d < RA; ++d) global[int(s.in[0][d])] = ga[std::size_t(d)];
  for (int d = 0; d < (s.nin == 2 ? RB : 0); ++d) global[int(s.in[1][d])] = gb[std::size_t(d)];
  for (int d = 0; d < RO; ++d) out_global[std::size_t(d)] = global[int(s.out[d])];

  // Slices the rules allow (no communication); none usually.
  local_tensor<T, RA> a_sliced;
  const T* pa = a.data();
  if (p.slice[0].n > 0) {
    a_sliced = execute_reshard<T, RA>(m, p.slice[0], a, ga);
    pa = a_sliced.data();
  }
  const shape<RA> ea = local_extents<RA>(p.sharding.in[0], ga, m);
  local_tensor<T, RB> b_sliced;
  const T* pb = nullptr;
  shape<RB> eb{};
  if (s.nin == 2) {
    pb = b->data();
    if (p.slice[1].n > 0) {
      b_sliced = execute_reshard<T, RB>(m, p.slice[1], *b, gb);
      pb = b_sliced.data();
    }
    eb = local_extents<RB>(p.sharding.in[1], gb, m);
  }
  local_tensor<C, RO> out(local_extents<RO>(p.sharding.out, out_global, m));
  const double t0 = trace::enabled() ? trace::now() : 0.0;
  local_einsum<T, C>(s, pa, ea.data(), pb, eb.data(), out.data(), out.dimensions().data());
  add_model_flops(s.flops(global) / double(m.nranks()));  // this rank's share of the einsum's FLOPs
  if (trace::enabled()) {  // the span: spec and this rank's local FLOPs
    index_t local[128] = {};
    for (int d = 0; d < RA; ++d) local[int(s.in[0][d])] = ea[std::size_t(d)];
    for (int d = 0; d < (s.nin == 2 ? RB : 0); ++d) local[int(s.in[1][d])] = eb[std::size_t(d)];
    std::string spec(s.term(0));
    if (s.nin == 2) spec += "," + std::string(s.term(1));
    spec += "->" + std::string(s.out_term());
    trace::add(spec, "einsum", t0, trace::now(), "\"flops\":" + std::to_string(s.flops(local)));
  }
  if (p.finish.n == 0) return out;
  return execute_reshard<C, RO>(m, p.finish, std::move(out), out_global);
}

// The output's labels: the output term when an operand is labelled, else none.
template <class X>
constexpr bool is_labelled() {
  if constexpr (std::is_void_v<X>) return false;
  else return X::labels.size() > 0;
}
template <fixed_string Spec, class A, class B>
consteval auto out_labels() {
  if constexpr (is_labelled<A>() || is_labelled<B>()) return term_of<Spec, -1>();
  else return fixed_string<1>{};
}

template <class Plan, class T, class C, class A, class B>
auto run_einsum(const A& a, const B* b) {
  using Mesh = typename A::mesh_type;
  constexpr int RB = Plan::nin == 2 ? Plan::rank_b : 0;
  if constexpr (Plan::nin == 2)
    if (&a.mesh() != &b->mesh())
      throw shape_error("gshard::einsum " + std::string(Plan::text) + ": the operands are placed on two different meshes");
  index_t global[128] = {};
  Plan::label_extents(a.extents().data(), Plan::nin == 2 ? b->extents().data() : nullptr, global, dtype_name<T>());
  static constexpr einsum_program program{Plan::spec, Plan::sharding, {Plan::slice_a::steps, Plan::slice_b::steps},
                                          Plan::finish::steps};
  shape<Plan::rank_out> out_global{};
  local_tensor<C, Plan::rank_out> out;
  if constexpr (Plan::nin == 2)
    out = execute_einsum<T, Plan::rank_a, RB, Plan::rank_out, C>(a.mesh(), program, a.local(), a.extents(), &b->local(),
                                                               b->extents(), out_global);
  else
    out = execute_einsum<T, Plan::rank_a, 0, Plan::rank_out, C>(a.mesh(), program, a.local(), a.extents(), nullptr, {},
                                                              out_global);
  constexpr auto labels = out_labels<Plan::spec_string, A, std::conditional_t<Plan::nin == 2, B, void>>();
  return tensor<C, Plan::rank_out, Mesh, typename Plan::out, labels>(a.mesh(), out_global, std::move(out));
}

}  // namespace detail

// einsum<"GSM,ME->GSE">(x, w): the natural output sharding.
// einsum<"GSEC,GSM->EGCM", by_expert>(dispatch, x): resharded to by_expert,
// a sharding, or to what a rules table gives the output term (EGCM).
// Labelled operands must carry their terms' labels (checked at compile
// time); the output is then labelled with the output term.
// einsum<"ij,jk->ik", natural_sharding, float>(a, b) with bf16 a and b: the
// result in fp32, the GEMMs' fp32 accumulators unrounded (JAX's
// preferred_element_type=float32) — and its collectives move fp32.
template <fixed_string Spec, class Out = natural_sharding, class Element = void, sharded_tensor A, sharded_tensor B>
auto einsum(const A& a, const B& b) {
  static_assert(std::is_same_v<typename A::mesh_type, typename B::mesh_type>,
                "gshard::einsum: the operands live on different mesh types");
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "gshard::einsum: the operands have different element types; convert one first");
  using T = typename A::value_type;
  using C = std::conditional_t<std::is_void_v<Element>, T, Element>;
  static_assert(detail::einsum_result_type_ok<T, C>,
                "gshard::einsum: the result's element type is the operands' or, for bf16 operands, float");
  static_assert(detail::check_einsum_spec<Spec>::ok);
  static_assert(detail::check_operand_rank<Spec, 0, A::rank>::ok);
  static_assert(detail::check_operand_rank<Spec, 1, B::rank>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 0>(), A::label_string>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 1>(), B::label_string>::ok);
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, typename B::sharding_type, Out>;
  return detail::run_einsum<plan, T, C>(a, &b);
}

// einsum<"GSE->GE">(a), einsum<"ab->ba">(a); einsum<"ij->j", natural_sharding,
// float>(a) sums bf16 a into fp32.
template <fixed_string Spec, class Out = natural_sharding, class Element = void, sharded_tensor A>
auto einsum(const A& a) {
  using T = typename A::value_type;
  using C = std::conditional_t<std::is_void_v<Element>, T, Element>;
  static_assert(detail::einsum_result_type_ok<T, C>,
                "gshard::einsum: the result's element type is the operands' or, for bf16 operands, float");
  static_assert(detail::check_einsum_spec<Spec>::ok);
  static_assert(detail::check_operand_rank<Spec, 0, A::rank>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 0>(), A::label_string>::ok);
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, void, Out>;
  return detail::run_einsum<plan, T, C>(a, static_cast<const A*>(nullptr));
}

// The plan of einsum<Spec, Out>(a, b) for these operands, with sizes.
template <fixed_string Spec, class Out = natural_sharding, sharded_tensor A, sharded_tensor B>
std::string plan_of(const A& a, const B& b) {
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, typename B::sharding_type, Out>;
  return plan::template describe<typename A::value_type>(a.mesh(), a.extents(), b.extents());
}
template <fixed_string Spec, class Out = natural_sharding, sharded_tensor A>
std::string plan_of(const A& a) {
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, void, Out>;
  return plan::template describe<typename A::value_type>(a.mesh(), a.extents());
}

}  // namespace gshard
