// gshard/einsum.hpp — einsum<"GSEC,GSM->EGCM">(a, b) on sharded tensors: the
// spec is parsed and the partitioning planned at compile time; each rank
// slices what the rules allow, runs one local einsum (strided GEMMs), and the
// result comes back in its natural sharding — or in the one the caller names,
// by appending the reshard (a pending sum then becomes a reduce_scatter
// straight into the split output). einsum_plan<...> prints all of it.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include "gshard/detail/local_einsum.hpp"
#include "gshard/einsum_plan.hpp"
#include "gshard/einsum_spec.hpp"
#include "gshard/reshard.hpp"

namespace gshard {

// The default output sharding of einsum: whatever the rules produce.
struct natural_sharding {};

namespace detail {

// Names the axis and labels of a sharding combination the rules reject.
template <fixed_string Spec, fixed_string Axis, char LabelA, char LabelB, einsum_problem P>
struct check_einsum_sharding {
  // The spec, axis and labels are in the instantiation the compiler shows.
  static_assert(P != einsum_problem::axis_on_two_labels,
                "gshard::einsum: one mesh axis splits different labels of the two operands; reshard one operand so "
                "the axis splits the same label in both, or neither");
  static_assert(P != einsum_problem::lists_disagree,
                "gshard::einsum: a label of both operands is split over axis lists where neither extends the other; "
                "reshard one operand to match the other");
  static_assert(P != einsum_problem::partial_and_split,
                "gshard::einsum: one operand is partial over a mesh axis that splits the other; all_reduce the "
                "partial operand first");
  static_assert(P != einsum_problem::both_partial,
                "gshard::einsum: both operands are partial over the same mesh axis; the product of two sums is not a "
                "sum of products: all_reduce one of them first");
  static constexpr bool ok = P == einsum_problem::none;
};

template <class Mesh>
constexpr std::string_view axis_name_or_none(int a) {
  return a < 0 ? std::string_view{} : Mesh::names[std::size_t(a)].view();
}

// A labelled operand must carry exactly its term's labels; an unlabelled one
// is checked by rank only (the positional API).
template <fixed_string Term, fixed_string Labels>
struct check_operand_labels {
  static_assert(Labels.size() == 0 || Labels.view() == Term.view(),
                "gshard::einsum: a labelled operand's labels differ from its term in the spec (the term, then the "
                "tensor's labels: see the instantiation above); rename its dims with relabel<\"...\">");
  static constexpr bool ok = true;
};

// Term `Operand` of Spec (the output for -1) as an exact-length fixed_string.
template <fixed_string Spec, int Operand>
struct term_string {
  static constexpr einsum_spec spec = parse_einsum(Spec.view());
  static constexpr std::string_view view = Operand < 0 ? spec.out_term() : spec.term(Operand);
  static constexpr auto value = to_fixed<view.size()>(view);
};
template <fixed_string Spec, int Operand>
consteval auto term_of() {
  return term_string<Spec, Operand>::value;
}

// The output sharding einsum<Spec, Out> returns: the natural one, a given
// sharding, or the one a rules table gives the output term.
template <fixed_string Spec, class Natural, class Out>
struct resolve_out {
  using type = Out;
};
template <fixed_string Spec, class Natural>
struct resolve_out<Spec, Natural, natural_sharding> {
  using type = Natural;
};
template <fixed_string Spec, class Natural, fixed_string R>
struct resolve_out<Spec, Natural, rules_text<R>> {
  using type = sharding_by<rules_text<R>, term_of<Spec, -1>()>;
};

}  // namespace detail

// The plan of einsum<Spec, Out>(a[, b]) for operands sharded SA (and SB) on
// Mesh, as a type. SB is void for one operand.
template <fixed_string Spec, mesh_type Mesh, class SA, class SB = void, class Out = natural_sharding>
struct einsum_plan {
  using spec_check = detail::check_einsum_spec<Spec>;
  static constexpr detail::einsum_spec spec = spec_check::spec;
  static constexpr int nin = std::is_void_v<SB> ? 1 : 2;
  static_assert(!spec_check::ok || spec.nin == nin,
                "gshard::einsum: the number of operands differs from the number of input terms in the spec");
  static constexpr int rank_a = spec.in_rank[0], rank_b = spec.in_rank[1], rank_out = spec.out_rank;
  static constexpr std::string_view text = Spec.view();
  static constexpr auto spec_string = Spec;

  static constexpr detail::rlayout inputs[2] = {
      detail::bind_layout<Mesh, rank_a, SA>::value,
      detail::bind_layout<Mesh, (nin == 2 ? rank_b : 0), std::conditional_t<nin == 2, SB, replicate>>::value};
  static constexpr detail::einsum_sharding sharding = detail::plan_einsum_sharding(spec, inputs, Mesh::axis_count);
  static_assert(detail::check_einsum_sharding<
                Spec, detail::to_fixed<detail::axis_name_or_none<Mesh>(sharding.axis).size()>(
                          detail::axis_name_or_none<Mesh>(sharding.axis)),
                sharding.label_a, sharding.label_b, sharding.problem>::ok);

  static constexpr detail::layout_spec a_local_spec = detail::unresolve(sharding.in[0], Mesh::names);
  static constexpr detail::layout_spec b_local_spec = detail::unresolve(sharding.in[1], Mesh::names);
  static constexpr detail::layout_spec natural_spec = detail::unresolve(sharding.out, Mesh::names);
  using a_local = layout<detail::text_of<detail::render(a_local_spec).n>(a_local_spec)>;
  using b_local = layout<detail::text_of<detail::render(b_local_spec).n>(b_local_spec)>;
  using natural = layout<detail::text_of<detail::render(natural_spec).n>(natural_spec)>;
  using out = typename detail::resolve_out<Spec, natural, Out>::type;

  using slice_a = reshard_plan<Mesh, rank_a, SA, a_local>;
  using slice_b = reshard_plan<Mesh, (nin == 2 ? rank_b : 0), std::conditional_t<nin == 2, SB, replicate>,
                               std::conditional_t<nin == 2, b_local, replicate>>;
  static_assert(slice_a::steps.collectives() == 0 && slice_b::steps.collectives() == 0,
                "gshard::einsum: internal error: an operand slice needs communication");
  using finish = reshard_plan<Mesh, rank_out, natural, out>;

  // The steps without sizes.
  static std::string describe(std::string_view dtype = "") {
    return header(dtype, nullptr, nullptr) + body(dtype, nullptr, nullptr, nullptr, 0);
  }
  // With a bound mesh and the operands' global extents: bytes and FLOPs per rank.
  template <class T>
  static std::string describe(const Mesh& m, const shape<rank_a>& a, const shape<(nin == 2 ? rank_b : 0)>& b = {}) {
    const auto dt = detail::dtype_name<T>();
    return header(dt, a.data(), b.data()) + " on " + m.describe() + "\n" + body(dt, &m, a.data(), b.data(), sizeof(T));
  }
  friend std::ostream& operator<<(std::ostream& os, const einsum_plan&) { return os << describe(); }

  // Global extents by label letter; throws (the same on every rank) when
  // the operands disagree on a label.
  GSHARD_NOINLINE static void label_extents(const index_t* a, const index_t* b, index_t* by_label, std::string_view dtype) {
    for (int d = 0; d < rank_a; ++d) by_label[int(spec.in[0][d])] = a[d];
    if constexpr (nin == 2)
      for (int d = 0; d < rank_b; ++d) {
        const char l = spec.in[1][d];
        const int da = spec.find(0, l);
        if (da >= 0 && a[da] != b[d])
          throw shape_error("gshard::einsum " + std::string(Spec.view()) + ": label " + std::string(1, l) +
                            " has extent " + std::to_string(a[da]) + " in " +
                            detail::notation(SA::spec, rank_a, dtype, spec.term(0), a) + " but " + std::to_string(b[d]) +
                            " in " + detail::notation(SB::spec, rank_b, dtype, spec.term(1), b));
        by_label[int(l)] = b[d];
      }
  }

 private:
  static std::string header(std::string_view dt, const index_t* a, const index_t* b) {
    std::string h = "einsum " + std::string(Spec.view()) + ": " + detail::notation(SA::spec, rank_a, dt, spec.term(0), a);
    if constexpr (nin == 2) h += ", " + detail::notation(SB::spec, rank_b, dt, spec.term(1), b);
    h += " -> " + detail::notation(out::spec, rank_out, dt, spec.out_term());
    return h;
  }
  static std::string body(std::string_view dt, const Mesh* m, const index_t* a, const index_t* b, std::size_t elem) {
    std::string out_text = m ? "" : "\n";
    int step = 0;
    auto slices = [&](const detail::reshard_steps& p, int op) {
      for (int i = 0; i < p.n; ++i)
        out_text += "  " + std::to_string(++step) + ". slice " + std::string(1, "AB"[op]) + " over " +
                    std::string(Mesh::names[std::size_t(p.step[i].axis)].view()) + ": " +
                    std::string(1, spec.in[op][p.step[i].to_dim]) + "   (local)\n";
    };
    slices(slice_a::steps, 0);
    if constexpr (nin == 2) slices(slice_b::steps, 1);
    out_text += "  " + std::to_string(++step) + ". local einsum " + std::string(Spec.view()) + " -> " +
                detail::notation(natural::spec, rank_out, dt, spec.out_term());
    shape<rank_out> out_global{};
    if (m) {
      index_t global[128] = {}, local[128] = {};
      label_extents(a, b, global, dt);
      for (int c = 0; c < 128; ++c) local[c] = global[c];
      // Local extents: each label divided by the shards of its (sliced) dim.
      for (int op = 0; op < nin; ++op)
        for (int d = 0; d < spec.in_rank[op]; ++d) {
          const char l = spec.in[op][d];
          local[int(l)] = global[int(l)] / detail::dim_parts(sharding.in[op], d, m->sizes());
        }
      for (int d = 0; d < rank_out; ++d) out_global[std::size_t(d)] = global[int(spec.out[d])];
      out_text += "   " + std::to_string(index_t(spec.flops(local))) + " FLOP/rank";
    }
    out_text += "\n";
    if (finish::steps.n > 0)  // the output's reshard, numbered on from the local einsum
      out_text += detail::describe_steps(finish::steps, Mesh::names, rank_out, dt, spec.out_term(), m ? out_global.data() : nullptr,
                                         m, elem, step + 1);
    return out_text;
  }
};

namespace detail {

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

// Runs an einsum program on local shards; returns the output shard in the
// requested layout. `out_global` receives the output's global extents.
template <class T, int RA, int RB, int RO>
GSHARD_NOINLINE local_tensor<T, RO> execute_einsum(const mesh_base& m, const einsum_program& p, const local_tensor<T, RA>& a,
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
  local_tensor<T, RO> out(local_extents<RO>(p.sharding.out, out_global, m));
  const double t0 = trace::enabled() ? trace::now() : 0.0;
  local_einsum<T>(s, pa, ea.data(), pb, eb.data(), out.data(), out.dimensions().data());
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
  return execute_reshard<T, RO>(m, p.finish, std::move(out), out_global);
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

template <class Plan, class T, class A, class B>
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
  local_tensor<T, Plan::rank_out> out;
  if constexpr (Plan::nin == 2)
    out = execute_einsum<T, Plan::rank_a, RB, Plan::rank_out>(a.mesh(), program, a.local(), a.extents(), &b->local(),
                                                               b->extents(), out_global);
  else
    out = execute_einsum<T, Plan::rank_a, 0, Plan::rank_out>(a.mesh(), program, a.local(), a.extents(), nullptr, {},
                                                              out_global);
  constexpr auto labels = out_labels<Plan::spec_string, A, std::conditional_t<Plan::nin == 2, B, void>>();
  return tensor<T, Plan::rank_out, Mesh, typename Plan::out, labels>(a.mesh(), out_global, std::move(out));
}

}  // namespace detail

// einsum<"GSM,ME->GSE">(x, w): the natural output sharding.
// einsum<"GSEC,GSM->EGCM", by_expert>(dispatch, x): resharded to by_expert,
// a sharding, or to what a rules table gives the output term (EGCM).
// Labelled operands must carry their terms' labels (checked at compile
// time); the output is then labelled with the output term.
template <fixed_string Spec, class Out = natural_sharding, sharded_tensor A, sharded_tensor B>
auto einsum(const A& a, const B& b) {
  static_assert(std::is_same_v<typename A::mesh_type, typename B::mesh_type>,
                "gshard::einsum: the operands live on different mesh types");
  static_assert(std::is_same_v<typename A::value_type, typename B::value_type>,
                "gshard::einsum: the operands have different element types; convert one first");
  static_assert(detail::check_einsum_spec<Spec>::ok);
  static_assert(detail::check_operand_rank<Spec, 0, A::rank>::ok);
  static_assert(detail::check_operand_rank<Spec, 1, B::rank>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 0>(), A::label_string>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 1>(), B::label_string>::ok);
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, typename B::sharding_type, Out>;
  return detail::run_einsum<plan, typename A::value_type>(a, &b);
}

// einsum<"GSE->GE">(a), einsum<"ab->ba">(a).
template <fixed_string Spec, class Out = natural_sharding, sharded_tensor A>
auto einsum(const A& a) {
  static_assert(detail::check_einsum_spec<Spec>::ok);
  static_assert(detail::check_operand_rank<Spec, 0, A::rank>::ok);
  static_assert(detail::check_operand_labels<detail::term_of<Spec, 0>(), A::label_string>::ok);
  using plan = einsum_plan<Spec, typename A::mesh_type, typename A::sharding_type, void, Out>;
  return detail::run_einsum<plan, typename A::value_type>(a, static_cast<const A*>(nullptr));
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
