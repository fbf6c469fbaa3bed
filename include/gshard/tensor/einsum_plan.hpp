// gshard/tensor/einsum_plan.hpp — einsum_plan<Spec, Mesh, SA, SB, Out>: the plan of
// one einsum call as a type, computed at compile time from the operands'
// shardings — the local slices, the local einsum and its natural output
// sharding (GShard's rules: einsum_sharding.hpp), the reshard to the output
// the caller asked for — with the compile errors for combinations the rules
// do not cover, and printable with and without sizes.
#pragma once

#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>

#include "gshard/layout/shard_geometry.hpp"
#include "gshard/layout/einsum_sharding.hpp"
#include "gshard/layout/einsum_spec.hpp"
#include "gshard/layout/labels.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/layout/notation.hpp"
#include "gshard/tensor/reshard_plan.hpp"
#include "gshard/tensor/tensor.hpp"

namespace gshard {

// The default output sharding of einsum: whatever the rules produce.
struct natural_sharding {};

namespace detail {

// Names the axis and labels of a sharding combination the rules reject.
// One static_assert per problem, as every diagnostic here is written
// (make_sharding, check_axis_role): the message is the diagnostic.
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

  static constexpr detail::sharding_spec a_local_spec = detail::unresolve(sharding.in[0], Mesh::names);
  static constexpr detail::sharding_spec b_local_spec = detail::unresolve(sharding.in[1], Mesh::names);
  static constexpr detail::sharding_spec natural_spec = detail::unresolve(sharding.out, Mesh::names);
  using a_local = GSHARD_SHARDING_OF(a_local_spec);
  using b_local = GSHARD_SHARDING_OF(b_local_spec);
  using natural = GSHARD_SHARDING_OF(natural_spec);
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
      // Local extents: each label's block in its (sliced) dim, the largest
      // where they differ (the FLOPs of the busiest rank).
      for (int op = 0; op < nin; ++op)
        for (int d = 0; d < spec.in_rank[op]; ++d) {
          const char l = spec.in[op][d];
          local[int(l)] = detail::max_block(sharding.in[op], d, global[int(l)], m->sizes());
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

}  // namespace gshard
