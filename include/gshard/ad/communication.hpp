// gshard/ad/communication.hpp — the operations on the tape that may
// communicate: einsum (its output's reshard), reshard and the one-collective
// forms, and start_reshard (a reshard in flight while the model computes).
// Their gradient rules run the transposed einsums and collectives, planned at
// compile time from the gradient's pending layout: all_gather <->
// reduce_scatter (or a local slice), all_to_all <-> all_to_all, all_reduce
// <-> nothing; a replicated weight's gradient stays pending over the batch
// axes until its slot is reduced (gshard/state/buckets.hpp).
#pragma once

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "gshard/ad/operands.hpp"
#include "gshard/ad/tape.hpp"
#include "gshard/tensor/einsum.hpp"
#include "gshard/tensor/einsum_backward.hpp"
#include "gshard/tensor/ops.hpp"
#include "gshard/tensor/tensor_collectives.hpp"

namespace gshard {

namespace detail {
template <fixed_string Spec, class Out, class ZA, class ZB>
using einsum_plan_of = einsum_plan<Spec, typename ZA::mesh_type, typename ZA::sharding_type,
                                   typename ZB::sharding_type, Out>;

}  // namespace detail

// ---------------------------------------------------------------------------
// einsum on vars and parameters: einsum<"BLM,MNK->BLNK">(h, w.wq).

namespace detail {

// The bf16 form of an fp32 var an einsum's GEMMs read: what a var held in
// bf16 holds, else its value rounded — once per tape for one var or weight
// (tape::derived: the q, k and v projections of one input share a copy).
template <class V>
std::shared_ptr<const with_element<tensor_of<V>, bf16>> rounded_operand(tape& t, const V& v) {
  if (auto h = v.held()) return h;
  return t.derived<with_element<tensor_of<V>, bf16>>(v.shared(), [](const auto& x) { return convert<bf16>(x); });
}

// Whether an einsum of fp32 operands on tape t takes einsum_rounded_once:
// the tape records, an operand is tracked (`tracked`), and the GEMMs round
// their operands to bf16.
inline bool rounds_operands_once(const tape& t, bool tracked) {
  return t.recording() && tracked && gemm_rounds_to_bf16();
}

// Whether einsum<Spec, Out> may write its output in bf16 as its GEMMs make
// it: no sum left pending and no collective after the GEMMs (a sum of
// partial products is taken in fp32 and rounded once; a product the GEMMs
// finish is rounded once where they store it).
template <fixed_string Spec, class Out, class XA, class XB>
inline constexpr bool output_from_gemms = [] {
  using plan = einsum_plan_of<Spec, Out, XA, XB>;
  return plan::sharding.out.partial == 0 && plan::finish::steps.n == 0;
}();

// An fp32 einsum on the tape whose GEMMs round their operands to bf16
// (matmul_precision::bf16 on bf16 units), its operands rounded once: the
// forward multiplies the rounded copies into fp32, the rule keeps them —
// for an activation, half the bytes of the fp32 tensor; for a weight, which
// the rule would have kept as a view, half its bytes more — and rounds dz
// once for both gradients. The GEMMs would have rounded each of these in
// the forward and again in each gradient's einsum, so the products are the
// same, except where no GEMM reads an operand as it is: a scalar output,
// or a label one operand holds alone (summed before the GEMM, now over the
// rounded values). Einsums of one var or weight share its copy
// (tape::derived); an operand held in bf16 is its own copy. With `release`
// (a, an rvalue var the caller gives up), a's fp32 value is let go once it
// is rounded, before the GEMMs: freed there if nothing else holds it. With
// Held, the GEMMs write the output in bf16 and the var holds it so (var's
// held form): oneDNN rounds its fp32 accumulators to nearest even as it
// stores them, the bits to_bf16 gives the fp32 output (test_autodiff
// checks it where the CPU has bf16 units).
template <fixed_string Spec, class Out, bool Held = false, class VA, class VB>
auto einsum_rounded_once(tape& t, const VA& a, const VB& b, VA* release = nullptr) {
  using XA = tensor_of<VA>;
  using XB = tensor_of<VB>;
  auto a16 = rounded_operand(t, a);
  auto b16 = rounded_operand(t, b);
  const int as = a.slot(), bs = b.slot();
  const auto ea = a.extents(), eb = b.extents();
  if (release) {
    const VA gone = std::move(*release);  // a refers to *release: not read from here on
  }
  auto out = [&] {
    if constexpr (Held) return t.output_held(einsum<Spec, Out>(*a16, *b16), true);
    else return t.output(einsum<Spec, Out, float>(*a16, *b16), true);
  }();
  using Z = tensor_of<decltype(out)>;
  using natural = typename einsum_plan_of<Spec, Out, XA, XB>::natural;
  std::shared_ptr<const with_element<XA, bf16>> keep_a = bs >= 0 ? std::move(a16) : nullptr;
  std::shared_ptr<const with_element<XB, bf16>> keep_b = as >= 0 ? std::move(b16) : nullptr;
  t.record([tp = &t, zs = out.slot(), as, bs, ea, eb, keep_a, keep_b] {
    auto dz = tp->slot<Z>(zs).template take<gradient_sharding<natural>>();
    if (!dz) return;
    const auto dz16 = convert<bf16>(*dz);
    dz.reset();  // both gradients read dz16: the fp32 dz is not held beside them
    if (as >= 0) tp->slot<XA>(as).add(einsum_operand_grad<Spec, 0, XA>(dz16, keep_b.get(), ea));
    if (bs >= 0) tp->slot<XB>(bs).add(einsum_operand_grad<Spec, 1, XB>(dz16, keep_a.get(), eb));
  });
  return out;
}

}  // namespace detail

template <fixed_string Spec, class Out = natural_sharding, class A, class B>
  requires(detail::ad_operand<A> && detail::ad_operand<B>)
auto einsum(const A& a_in, const B& b_in) {
  tape& t = detail::tape_of(a_in, b_in);
  const auto a = detail::as_var(t, a_in);
  const auto b = detail::as_var(t, b_in);
  using XA = detail::tensor_of<decltype(a)>;
  using XB = detail::tensor_of<decltype(b)>;
  if constexpr (std::is_same_v<typename XA::value_type, float> && std::is_same_v<typename XB::value_type, float>)
    if (detail::rounds_operands_once(t, a.tracked() || b.tracked()))
      return detail::einsum_rounded_once<Spec, Out>(t, a, b);
  auto z = einsum<Spec, Out>(a.value(), b.value());
  using Z = decltype(z);
  auto out = t.output(std::move(z), a.tracked() || b.tracked());
  if (out.tracked()) {
    using natural = typename detail::einsum_plan_of<Spec, Out, XA, XB>::natural;
    // dA needs b, dB needs a: keep only what a rule will read.
    std::shared_ptr<const XA> keep_a = b.tracked() ? a.shared() : nullptr;
    std::shared_ptr<const XB> keep_b = a.tracked() ? b.shared() : nullptr;
    t.record([tp = &t, zs = out.slot(), as = a.slot(), bs = b.slot(), ea = a.extents(), eb = b.extents(), keep_a, keep_b] {
      // One plan from the pending layout: the reduction, and Out's reshard transposed.
      auto dz = tp->slot<Z>(zs).template take<gradient_sharding<natural>>();
      if (!dz) return;
      if (as >= 0) tp->slot<XA>(as).add(detail::einsum_operand_grad<Spec, 0, XA>(*dz, keep_b.get(), ea));
      if (bs >= 0) tp->slot<XB>(bs).add(detail::einsum_operand_grad<Spec, 1, XB>(*dz, keep_a.get(), eb));
    });
  }
  return out;
}

// A tracked rvalue var as the first operand: under bf16 GEMMs its fp32
// value is let go once rounded, before the GEMMs (an FFN's hidden
// activations, [tokens, H], need not outlive their bf16 copy); otherwise
// as above. A is deduced (a non-const rvalue var only: an lvalue deduces a
// reference), so an explicit third template argument — the tensor
// einsum's element type — never names a var.
template <fixed_string Spec, class Out = natural_sharding, class A, class B>
  requires(detail::is_var<A>::value && detail::ad_operand<B>)
auto einsum(A&& a, const B& b_in) {
  if constexpr (std::is_same_v<typename detail::tensor_of<A>::value_type, float> &&
                std::is_same_v<typename detail::tensor_of<B>::value_type, float>) {
    tape& t = a.on_tape();
    if (detail::rounds_operands_once(t, a.tracked()))
      return detail::einsum_rounded_once<Spec, Out>(t, a, detail::as_var(t, b_in), &a);
  }
  return einsum<Spec, Out>(std::as_const(a), b_in);
}

// einsum<Spec, Out, bf16_activation>(h, w): an activation held in bf16.
// Where mixed precision rounds the GEMMs' operands to bf16 (fp32 operands
// under gemm_rounds_to_bf16(), the tape recording), the GEMMs write the
// product in bf16 and the var holds it so: for an activation whose readers
// round it anyway — attention's q, k and v, an FFN's hidden layer (its ReLU
// keeps the sign, the next einsum rounds) — the fp32 product is never
// written, read back or rounded, and those readers compute what they
// would have from it. The var's value() is the product rounded to bf16
// (widened once): a reader that does not round — code of one's own, or
// attention and relu run later under fp32 GEMMs — sees the rounding.
// Elsewhere — fp32 GEMMs, an untracked forward, or an einsum whose output
// is summed or resharded after its GEMMs — the same as einsum<Spec, Out>.
struct bf16_activation {};

template <fixed_string Spec, class Out, class Held, class A, class B>
  requires(std::is_same_v<Held, bf16_activation> && detail::ad_operand<A> && detail::ad_operand<B>)
auto einsum(A&& a_in, const B& b_in) {
  using XA = detail::tensor_of<A>;
  using XB = detail::tensor_of<B>;
  if constexpr (std::is_same_v<typename XA::value_type, float> && std::is_same_v<typename XB::value_type, float> &&
                detail::output_from_gemms<Spec, Out, XA, XB>) {
    tape& t = detail::tape_of(a_in, b_in);
    const auto b = detail::as_var(t, b_in);
    if constexpr (detail::is_var<A>::value) {  // an rvalue var, given up as einsum's own overload for one takes it
      if (detail::rounds_operands_once(t, a_in.tracked() || b.tracked()))
        return detail::einsum_rounded_once<Spec, Out, true>(t, a_in, b, &a_in);
      return einsum<Spec, Out>(std::move(a_in), b);
    } else {
      const auto a = detail::as_var(t, a_in);
      if (detail::rounds_operands_once(t, a.tracked() || b.tracked()))
        return detail::einsum_rounded_once<Spec, Out, true>(t, a, b);
      return einsum<Spec, Out>(a, b);
    }
  }
  return einsum<Spec, Out>(std::forward<A>(a_in), b_in);
}

template <fixed_string Spec, class Out = natural_sharding, class A>
  requires detail::ad_operand<A>
auto einsum(const A& a_in) {
  tape& t = detail::tape_of(a_in);
  const auto a = detail::as_var(t, a_in);
  using XA = detail::tensor_of<decltype(a)>;
  auto z = einsum<Spec, Out>(a.value());
  using Z = decltype(z);
  auto out = t.output(std::move(z), a.tracked());
  if (out.tracked()) {
    using natural = typename einsum_plan<Spec, typename XA::mesh_type, typename XA::sharding_type, void, Out>::natural;
    t.record([tp = &t, zs = out.slot(), as = a.slot(), ea = a.extents()] {
      auto dz = tp->slot<Z>(zs).template take<gradient_sharding<natural>>();
      if (!dz) return;
      tp->slot<XA>(as).add(detail::einsum_operand_grad<Spec, 0, XA>(*dz, static_cast<const XA*>(nullptr), ea));
    });
  }
  return out;
}

// A var or parameter with a plain tensor: a weight nobody declared would
// silently receive no gradient, so it does not compile.
template <fixed_string Spec, class Out = natural_sharding, class A, class B>
  requires((detail::ad_operand<A> && sharded_tensor<B>) || (sharded_tensor<A> && detail::ad_operand<B>))
auto einsum(const A&, const B&) {
  static_assert(sizeof(A) == 0,
                "gshard::einsum: one operand is a var or parameter, the other a plain tensor; declare the tensor as a "
                "gshard::param (to train it) or pass tape.constant(t) (to hold it fixed)");
}

// ---------------------------------------------------------------------------
// Resharding a var: reshard<To or rules>(v) and the one-collective forms.
// With wire::bf16 the forward's messages and the gradient's carry bf16: the
// value and its gradient are each rounded to bf16 once.

template <class ToOrRules, class V>
  requires var_type<V>
auto reshard(V&& v, wire w = wire::same) {
  using X = detail::tensor_of<V>;
  tape& t = v.on_tape();
  const int xs = v.slot();
  auto y = reshard<ToOrRules>(detail::value_of(std::forward<V>(v)), w);
  using Y = decltype(y);
  auto out = t.output(std::move(y), xs >= 0);
  if (out.tracked())
    t.record([tp = &t, ys = out.slot(), xs, w] {
      // The forward's collectives transposed, planned from dy's pending
      // layout: a pending dy of an all_gather becomes one reduce_scatter.
      auto dx = tp->slot<Y>(ys).template take<gradient_sharding<typename X::sharding_type>>(w);
      if (dx) tp->slot<X>(xs).add(std::move(*dx));
    });
  return out;
}

// A reshard of a var started now and finished later: start_reshard<To>(v)
// posts its collective (gshard/tensor/reshard.hpp's start_reshard), wait() gives
// the var in To. On a recording tape it is two operations, so the backward
// runs them transposed and reversed too: wait()'s rule starts the
// gradient's collective (the forward's, transposed) and start_reshard's
// rule finishes it — what the forward computes between the two, the
// backward computes (transposed) while the gradient travels. The MoE
// layer's all_to_alls pipelined with its experts are built of these.
template <class Y, class X>
class [[nodiscard]] var_in_flight {
 public:
  var_in_flight(tape& t, int xs, reshard_request<Y>&& r, wire w) : t_(&t), xs_(xs), w_(w), f_(std::make_shared<flight>()) {
    f_->forward.emplace(std::move(r));
    if (xs >= 0)
      t.record([tp = &t, xs, f = f_] {
        if (!f->backward) return;  // the result received no gradient
        auto dx = f->backward->wait();
        f->backward.reset();
        tp->slot<X>(xs).add(std::move(dx));
      });
  }

  // The resharded var; once.
  var<Y> wait() {
    if (!f_->forward)
      throw error("gshard::var_in_flight: wait() was called before on this reshard of " +
                  to_string<typename X::sharding_type>(X::rank, X::labels) + " to " +
                  to_string<typename Y::sharding_type>(Y::rank, Y::labels) + "; it hands the var out once");
    auto y = f_->forward->wait();
    f_->forward.reset();
    auto out = t_->output(std::move(y), xs_ >= 0);
    if (out.tracked())
      t_->record([tp = t_, ys = out.slot(), f = f_, mesh = &out.mesh(), extents = out.extents(), w = w_] {
        // Planned from dy's pending layout, as reshard's rule: a pending dy
        // of an all_gather becomes one reduce_scatter; a plan that ends in
        // an all_to_all leaves it in flight.
        auto dy = tp->slot<Y>(ys).take_pending();
        if (!dy) return;  // the result received no gradient (on every rank: the program is the same)
        using mesh_t = typename X::mesh_type;
        constexpr detail::rlayout to = detail::bind_layout<mesh_t, X::rank, gradient_sharding<typename X::sharding_type>>::value;
        const auto plan = detail::plan_reshard(dy->second, to, mesh->naxes(), mesh->sizes());
        f->backward.emplace(*mesh, extents, plan, std::move(dy->first), w);
      });
    return out;
  }

 private:
  using dx_type = detail::gradient_of<X>;
  struct flight {
    std::optional<reshard_request<Y>> forward;
    std::optional<reshard_request<dx_type>> backward;
  };
  tape* t_;
  int xs_;
  wire w_;
  std::shared_ptr<flight> f_;  // shared with the two rules
};

template <class ToOrRules, class V>
  requires var_type<V>
[[nodiscard]] auto start_reshard(V&& v, wire w = wire::same) {
  using X = detail::tensor_of<V>;
  tape& t = v.on_tape();
  const int xs = v.slot();
  auto r = start_reshard<ToOrRules>(detail::value_of(std::forward<V>(v)), w);
  using Y = decltype(r.wait());
  return var_in_flight<Y, X>(t, xs, std::move(r), w);
}

// The one-collective forms on the tape: the same targets (and checks) as
// the tensor forms of tensor_collectives.hpp, which cannot see var (the tape is a
// layer above); reshard of a var records the transposed collective.
template <fixed_string Axis, class V>
  requires var_type<V>
auto all_reduce(V&& v) {
  return reshard<typename detail::all_reduce_target<detail::tensor_of<V>, Axis>::type>(std::forward<V>(v));
}
template <fixed_string Axis, class V>
  requires var_type<V>
auto all_gather(V&& v) {
  return reshard<typename detail::all_gather_target<detail::tensor_of<V>, Axis>::type>(std::forward<V>(v));
}
template <fixed_string Axis, int Dim, class V>
  requires var_type<V>
auto reduce_scatter(V&& v) {
  return reshard<typename detail::reduce_scatter_target<detail::tensor_of<V>, Axis, Dim>::type>(std::forward<V>(v));
}
template <fixed_string Axis, int Dim, class V>
  requires var_type<V>
auto all_to_all(V&& v) {
  return reshard<typename detail::all_to_all_target<detail::tensor_of<V>, Axis, Dim>::type>(std::forward<V>(v));
}

}  // namespace gshard
