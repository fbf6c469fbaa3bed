// gshard/ad/ops.hpp — the operations a model is written in, on vars (values
// on a tape) and declared parameters: einsum, reshard and the one-collective
// forms, start_reshard (a reshard in flight while the model computes), chunk
// and concat, relabel, element-wise + − ⊙, scalar × and ÷, relu, gelu, silu,
// sigmoid, exp, log, tanh, sqrt, softmax, causal masking, causal attention and
// the RMS norm.
// Each computes like its tensor form and, while the tape records, notes its
// gradient rule (the ones with arithmetic of their own are in
// gshard/grad.hpp, each tested by finite differences). A rule keeps what it
// reads — an einsum its operands, relu its output, + nothing — and an rvalue
// var that nothing else holds is updated in place.
//
// What the rules run:
//   einsum      the transposed einsums ("O,B->A", "A,O->B"), planned at
//               compile time; each gradient comes out in its natural
//               sharding, so a replicated weight's is pending over the batch
//               axes until its slot is reduced (one all_reduce per weight,
//               in a bucket with others': gshard/buckets.hpp)
//   reshard     the transposed collectives, planned from the gradient's
//               pending layout: all_gather <-> reduce_scatter (or a local
//               slice), all_to_all <-> all_to_all, all_reduce <-> nothing
//   start_reshard  the same plan, started by wait()'s rule and finished by
//               start_reshard's: a final all_to_all in flight while the
//               rules between run
//   the rest    local
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/ad/tape.hpp"
#include "gshard/attention.hpp"
#include "gshard/detail/copy_box.hpp"
#include "gshard/einsum.hpp"
#include "gshard/grad.hpp"
#include "gshard/ops.hpp"
#include "gshard/reduce.hpp"
#include "gshard/tensor_collectives.hpp"

namespace gshard {

namespace detail {

template <class A>
concept ad_operand = is_var<std::remove_cvref_t<A>>::value || is_param<std::remove_cvref_t<A>>::value;

// The tape of the first var among the operands.
template <class A, class... Rest>
tape& tape_of(const A& a, const Rest&... rest) {
  if constexpr (is_var<A>::value) return a.on_tape();
  else if constexpr (sizeof...(Rest) > 0) return tape_of(rest...);
  else {
    static_assert(sizeof...(Rest) > 0,
                  "gshard::tape: an operation on parameters alone has no tape to record on; pass tape.use(p) for one of them");
    return *static_cast<tape*>(nullptr);
  }
}

template <class A>
auto as_var(tape& t, const A& a) {
  if constexpr (is_param<A>::value) return t.use(a);
  else return a;
}

// The tensor of a var to compute on: moved out of an rvalue var nothing else
// holds, copied otherwise.
template <class V>
tensor_of<V> value_of(V&& v) {
  if constexpr (std::is_rvalue_reference_v<V&&> && !std::is_const_v<std::remove_reference_t<V>>)
    return std::move(v).take_value();
  else return v.value();
}

// The layout with every axis that splits X pending instead: the sharding of
// a sum over X's shards (a norm scale's or an embedding table's gradient).
template <class X, int R, class T = typename X::value_type>
struct sum_over_shards {
  static constexpr rlayout value = [] {
    rlayout l{};
    l.partial = X::resolved.split_mask();
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = tensor<T, R, typename X::mesh_type, GSHARD_SHARDING_OF(spec)>;
};

template <fixed_string Spec, class Out, class ZA, class ZB>
using einsum_plan_of = einsum_plan<Spec, typename ZA::mesh_type, typename ZA::sharding_type,
                                   typename ZB::sharding_type, Out>;

// ---------------------------------------------------------------------------
// Element-wise rules: y = f(x), dx = dy · f'(x, y).

// The rules themselves (f and f') are ops.hpp's, shared with the plain tensors' forms.

template <class Op, class V>
auto unary(V&& x) {
  using X = tensor_of<V>;
  tape& t = x.on_tape();
  const int xs = x.slot();
  std::shared_ptr<const X> keep_x = Op::needs_x && xs >= 0 ? x.shared() : nullptr;  // before x may be moved from
  X v = value_of(std::forward<V>(x));
  elementwise<Op>(v.data(), v.local().size());
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked()) {
    std::shared_ptr<const X> keep_y = Op::needs_y ? y.shared() : nullptr;
    t.record([tp = &t, ys = y.slot(), xs, keep_x, keep_y] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      elementwise_backward<Op>(dy->data(), keep_x ? keep_x->data() : nullptr, keep_y ? keep_y->data() : nullptr,
                               dy->local().size());
      tp->slot<X>(xs).add(std::move(*dy));
    });
  }
  return y;
}

// y = s · x (linear: pending sums allowed).
template <class V>
auto scale(V&& x, double s) {
  using X = tensor_of<V>;
  using T = typename X::value_type;
  tape& t = x.on_tape();
  const int xs = x.slot();
  X v = value_of(std::forward<V>(x));
  v.local() = v.local() * T(s);
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, s] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      dy->local() = dy->local() * T(s);
      tp->slot<X>(xs).add(std::move(*dy));
    });
  return y;
}

// a ± b (sign +1 or -1) for two vars of one type.
template <class X>
var<X> add(var<X> a, const var<X>& b, int sign) {
  if (a.extents() != b.extents())
    throw shape_error(std::string("gshard::operator") + (sign > 0 ? "+" : "-") + ": " + a.notation() + " and " + b.notation() +
                      " differ in extents");
  tape& t = a.on_tape();
  const int as = a.slot(), bs = b.slot();
  X v = value_of(std::move(a));
  if (sign > 0) v.local() += b.value().local();
  else v.local() -= b.value().local();
  auto y = t.output(std::move(v), as >= 0 || bs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), as, bs, sign] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      if (as >= 0 && bs >= 0) {
        auto db = *dy;
        if (sign < 0) db.local() = -db.local();
        tp->slot<X>(as).add(std::move(*dy));
        tp->slot<X>(bs).add(std::move(db));
      } else if (as >= 0) {
        tp->slot<X>(as).add(std::move(*dy));
      } else {
        if (sign < 0) dy->local() = -dy->local();
        tp->slot<X>(bs).add(std::move(*dy));
      }
    });
  return y;
}

}  // namespace detail

// ---------------------------------------------------------------------------
// einsum on vars and parameters: einsum<"BLM,MNK->BLNK">(h, w.wq).

template <fixed_string Spec, class Out = natural_sharding, class A, class B>
  requires(detail::ad_operand<A> && detail::ad_operand<B>)
auto einsum(const A& a_in, const B& b_in) {
  tape& t = detail::tape_of(a_in, b_in);
  const auto a = detail::as_var(t, a_in);
  const auto b = detail::as_var(t, b_in);
  using XA = detail::tensor_of<decltype(a)>;
  using XB = detail::tensor_of<decltype(b)>;
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

template <class ToOrRules, class V>
  requires var_type<V>
auto reshard(V&& v) {
  using X = detail::tensor_of<V>;
  tape& t = v.on_tape();
  const int xs = v.slot();
  auto y = reshard<ToOrRules>(detail::value_of(std::forward<V>(v)));
  using Y = decltype(y);
  auto out = t.output(std::move(y), xs >= 0);
  if (out.tracked())
    t.record([tp = &t, ys = out.slot(), xs] {
      // The forward's collectives transposed, planned from dy's pending
      // layout: a pending dy of an all_gather becomes one reduce_scatter.
      auto dx = tp->slot<Y>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (dx) tp->slot<X>(xs).add(std::move(*dx));
    });
  return out;
}

// A reshard of a var started now and finished later: start_reshard<To>(v)
// posts its collective (gshard/reshard.hpp's start_reshard), wait() gives
// the var in To. On a recording tape it is two operations, so the backward
// runs them transposed and reversed too: wait()'s rule starts the
// gradient's collective (the forward's, transposed) and start_reshard's
// rule finishes it — what the forward computes between the two, the
// backward computes (transposed) while the gradient travels. The MoE
// layer's all_to_alls pipelined with its experts are built of these.
template <class Y, class X>
class [[nodiscard]] var_in_flight {
 public:
  var_in_flight(tape& t, int xs, reshard_request<Y>&& r) : t_(&t), xs_(xs), f_(std::make_shared<flight>()) {
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
      t_->record([tp = t_, ys = out.slot(), f = f_, mesh = &out.mesh(), extents = out.extents()] {
        // Planned from dy's pending layout, as reshard's rule: a pending dy
        // of an all_gather becomes one reduce_scatter; a plan that ends in
        // an all_to_all leaves it in flight.
        auto dy = tp->slot<Y>(ys).take_pending();
        if (!dy) return;  // the result received no gradient (on every rank: the program is the same)
        using mesh_t = typename X::mesh_type;
        constexpr detail::rlayout to = detail::bind_layout<mesh_t, X::rank, gradient_sharding<typename X::sharding_type>>::value;
        const auto plan = detail::plan_reshard(dy->second, to, mesh->naxes(), mesh->sizes());
        f->backward.emplace(*mesh, extents, plan, std::move(dy->first));
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
  std::shared_ptr<flight> f_;  // shared with the two rules
};

template <class ToOrRules, class V>
  requires var_type<V>
[[nodiscard]] auto start_reshard(V&& v) {
  using X = detail::tensor_of<V>;
  tape& t = v.on_tape();
  const int xs = v.slot();
  auto r = start_reshard<ToOrRules>(detail::value_of(std::forward<V>(v)));
  using Y = decltype(r.wait());
  return var_in_flight<Y, X>(t, xs, std::move(r));
}

// Pieces along a dim and back: chunk<Dim>(v, k) cuts v into k pieces along
// Dim (in order; n/k each, the first n % k one longer), concat<Dim>(pieces)
// joins them. Dim is whole on each rank (split over no mesh axis), so each
// rank cuts and joins its own shard and nothing moves; each op's gradient
// is the other's.
namespace detail {
inline index_t piece_offset(index_t n, index_t k, index_t p) { return p * (n / k) + std::min(p, n % k); }
inline index_t piece_length(index_t n, index_t k, index_t p) { return n / k + (p < n % k ? 1 : 0); }
// Copies the box of `from` (local extents fe) at `off` along Dim into `to` (extents te) at `to_off` along Dim.
template <int Dim, class T, int R>
void copy_along(const T* from, const shape<R>& fe, index_t off, T* to, const shape<R>& te, index_t to_off, index_t len) {
  shape<R> a{}, b{}, box = fe;
  a[Dim] = off, b[Dim] = to_off, box[Dim] = len;
  copy_box(from, fe.data(), a.data(), to, te.data(), b.data(), box.data(), R);
}
template <int Dim, class X>
constexpr bool dim_whole() {
  if constexpr (Dim >= 0 && Dim < X::rank) return X::resolved.dims[Dim].n == 0;
  else return true;  // the other assertion names it
}
}  // namespace detail

template <int Dim, class V>
  requires var_type<V>
std::vector<var<detail::tensor_of<V>>> chunk(V v, index_t k) {  // by value: chunk(std::move(v), k) lets v's tensor go
  using X = detail::tensor_of<V>;
  using T = typename X::value_type;
  constexpr int R = X::rank;
  static_assert(Dim >= 0 && Dim < R, "gshard::chunk: the dim is not one of the tensor's");
  static_assert(detail::dim_whole<Dim, X>(), "gshard::chunk: the dim is split over mesh axes; chunk cuts a dim that is whole on each rank");
  const index_t n = v.extent(Dim);
  if (k < 1 || k > std::max<index_t>(n, 1))
    throw shape_error("gshard::chunk: " + std::to_string(k) + " pieces of dim " + std::to_string(Dim) + " of " + v.notation() +
                      ": between 1 and its extent");
  tape& t = v.on_tape();
  const shape<R> le = v.value().local_extents();
  std::vector<var<X>> pieces;
  std::vector<int> slots;
  for (index_t p = 0; p < k; ++p) {
    shape<R> g = v.extents(), pl = le;
    g[Dim] = pl[Dim] = detail::piece_length(n, k, p);
    X x(v.mesh(), g);
    detail::copy_along<Dim, T, R>(v.value().data(), le, detail::piece_offset(n, k, p), x.data(), pl, 0, pl[Dim]);
    pieces.push_back(t.output(std::move(x), v.tracked()));
    slots.push_back(pieces.back().slot());
  }
  if (v.tracked())
    t.record([tp = &t, xs = v.slot(), slots, mesh = &v.mesh(), extents = v.extents(), le, n, k] {
      using G = detail::gradient_of<X>;
      std::optional<G> dx;
      for (index_t p = 0; p < k; ++p) {
        auto dp = tp->slot<X>(slots[std::size_t(p)]).template take<gradient_sharding<typename X::sharding_type>>();
        if (!dp) continue;
        if (!dx) {
          dx.emplace(*mesh, extents);
          dx->local().setZero();
        }
        detail::copy_along<Dim, T, R>(dp->data(), dp->local_extents(), 0, dx->data(), le, detail::piece_offset(n, k, p),
                                      dp->local_extents()[Dim]);
      }
      if (dx) tp->slot<X>(xs).add(std::move(*dx));
    });
  return pieces;
}

template <int Dim, class X>
var<X> concat(const std::vector<var<X>>& pieces) {
  using T = typename X::value_type;
  constexpr int R = X::rank;
  static_assert(Dim >= 0 && Dim < R, "gshard::concat: the dim is not one of the tensor's");
  static_assert(detail::dim_whole<Dim, X>(), "gshard::concat: the dim is split over mesh axes; concat joins along a dim that is whole on each rank");
  if (pieces.empty()) throw shape_error("gshard::concat: no pieces to join");
  tape& t = pieces[0].on_tape();
  shape<R> g = pieces[0].extents();
  g[Dim] = 0;
  bool tracked = false;
  for (const auto& p : pieces) {
    for (int d = 0; d < R; ++d)
      if (d != Dim && p.extent(d) != pieces[0].extent(d))
        throw shape_error("gshard::concat: the pieces " + pieces[0].notation() + " and " + p.notation() +
                          " differ outside dim " + std::to_string(Dim));
    g[Dim] += p.extent(Dim);
    tracked = tracked || p.tracked();
  }
  X x(pieces[0].mesh(), g);
  const shape<R> le = x.local_extents();
  std::vector<std::pair<int, index_t>> slots;  // each piece's slot and offset
  index_t off = 0;
  for (const auto& p : pieces) {
    detail::copy_along<Dim, T, R>(p.value().data(), p.value().local_extents(), 0, x.data(), le, off, p.extent(Dim));
    slots.emplace_back(p.slot(), off);
    off += p.extent(Dim);
  }
  auto y = t.output(std::move(x), tracked);
  if (y.tracked()) {
    std::vector<shape<R>> extents;
    for (const auto& p : pieces) extents.push_back(p.extents());
    t.record([tp = &t, ys = y.slot(), slots, extents, le] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      for (std::size_t p = 0; p < slots.size(); ++p) {
        if (slots[p].first < 0) continue;
        detail::gradient_of<X> dp(dy->mesh(), extents[p]);
        detail::copy_along<Dim, T, R>(dy->data(), le, slots[p].second, dp.data(), dp.local_extents(), 0,
                                      dp.local_extents()[Dim]);
        tp->slot<X>(slots[p].first).add(std::move(dp));
      }
    });
  }
  return y;
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

// The same value with its dims renamed: free for an rvalue var nothing else
// holds (else one copy); the gradient flows to the same slot.
template <fixed_string Labels, class V>
  requires var_type<V>
auto relabel(V&& v) {
  using X = detail::tensor_of<V>;
  using Y = with_labels<X, Labels>;
  tape& t = v.on_tape();
  const int slot = v.slot();  // a relabelled value shares its gradient slot: the same types but for the labels
  return var<Y>(t, std::make_shared<Y>(relabel<Labels>(detail::value_of(std::forward<V>(v)))), slot);
}

// ---------------------------------------------------------------------------
// Element-wise algebra.

template <class X>
var<X> operator+(var<X> a, const var<X>& b) {
  return detail::add(std::move(a), b, +1);
}
template <class X>
var<X> operator-(var<X> a, const var<X>& b) {
  return detail::add(std::move(a), b, -1);
}
template <class V>
  requires var_type<V>
auto operator*(double s, V&& x) {
  return detail::scale(std::forward<V>(x), s);
}
template <class V>
  requires var_type<V>
auto operator*(V&& x, double s) {
  return detail::scale(std::forward<V>(x), s);
}
template <class V>
  requires var_type<V>
auto operator/(V&& x, double s) {
  return detail::scale(std::forward<V>(x), 1.0 / s);
}
template <class V>
  requires var_type<V>
auto operator-(V&& x) {
  return detail::scale(std::forward<V>(x), -1.0);
}

// a ⊙ b, element by element.
template <class X>
var<X> operator*(var<X> a, const var<X>& b) {
  static_assert(!detail::has_pending_sums<X>(),
                "gshard::operator*: the operands have pending sums; a product of sums is not a sum of products: "
                "all_reduce them first");
  if (a.extents() != b.extents())
    throw shape_error("gshard::operator*: " + a.notation() + " and " + b.notation() + " differ in extents");
  tape& t = a.on_tape();
  const int as = a.slot(), bs = b.slot();
  std::shared_ptr<const X> keep_a = bs >= 0 ? a.shared() : nullptr;
  std::shared_ptr<const X> keep_b = as >= 0 ? b.shared() : nullptr;
  X v = detail::value_of(std::move(a));
  v.local() *= b.value().local();
  auto y = t.output(std::move(v), as >= 0 || bs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), as, bs, keep_a, keep_b] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      if (bs >= 0) {
        typename X::local_type db = dy->local() * keep_a->local();
        tp->slot<X>(bs).add(detail::gradient_of<X>(dy->mesh(), dy->extents(), std::move(db)));
      }
      if (as >= 0) {
        dy->local() *= keep_b->local();
        tp->slot<X>(as).add(std::move(*dy));
      }
    });
  return y;
}

#define GSHARD_UNARY_(name, op)                                                                                    \
  template <class V>                                                                                               \
    requires var_type<V>                                                                                           \
  auto name(V&& x) {                                                                                               \
    static_assert(!detail::has_pending_sums<detail::tensor_of<V>>(),                                               \
                  "gshard::" #name ": the tensor has pending sums; all_reduce or reduce_scatter it first");        \
    return detail::unary<detail::op>(std::forward<V>(x));                                                          \
  }
GSHARD_ELEMENTWISE_FUNCTIONS(GSHARD_UNARY_)  // ops.hpp's list
#undef GSHARD_UNARY_

// ---------------------------------------------------------------------------
// The maximum or minimum over a dim (gshard/reduce.hpp). The gradient goes to
// the position holding the extreme; on ties to the lowest global index, which
// the ranks splitting the dim agree on with one all_reduce(min) of the
// indices in the backward (none when the dim is whole on each rank).

namespace detail {
template <int Dim, reduction R, class X>
auto reduce_extreme_var(const var<X>& x) {
  using T = typename X::value_type;
  using info = reduced<X, Dim, false>;
  using Y = typename info::type;
  tape& t = x.on_tape();
  const int xs = x.slot();
  auto y = t.output(reduce_extreme<Dim, R>(x.value()), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, keep_x = x.shared(), keep_y = y.shared()] {
      auto dy = tp->slot<Y>(ys).template take<gradient_sharding<typename Y::sharding_type>>();
      if (!dy) return;
      const X& xv = *keep_x;
      const auto [outer, n, inner] = shard_around<Dim>(xv);
      const index_t first = xv.offsets()[std::size_t(Dim)];
      const T* px = xv.data();
      const T* py = keep_y->data();
      std::vector<std::int64_t> winner(std::size_t(outer * inner), std::numeric_limits<std::int64_t>::max());
      for (index_t o = 0; o < outer; ++o)
        for (index_t i = 0; i < inner; ++i)
          for (index_t k = 0; k < n; ++k)
            if (px[(o * n + k) * inner + i] == py[o * inner + i]) {
              winner[std::size_t(o * inner + i)] = first + k;
              break;
            }
      if constexpr (info::axes != 0) all_reduce(xv.mesh().group(info::axes), std::span<std::int64_t>(winner), reduction::min);
      gradient_of<X> dx(xv.mesh(), xv.extents());
      T* g = dx.data();
      const T* pdy = dy->data();
      for (index_t o = 0; o < outer; ++o)
        for (index_t i = 0; i < inner; ++i) {
          const std::int64_t k = winner[std::size_t(o * inner + i)] - first;
          if (k >= 0 && k < n) g[(o * n + k) * inner + i] = pdy[o * inner + i];
        }
      tp->slot<X>(xs).add(std::move(dx));
    });
  return y;
}
}  // namespace detail

template <int Dim, class X>
auto reduce_max(const var<X>& x) {
  return detail::reduce_extreme_var<Dim, reduction::max>(x);
}
template <int Dim, class X>
auto reduce_min(const var<X>& x) {
  return detail::reduce_extreme_var<Dim, reduction::min>(x);
}

// ---------------------------------------------------------------------------
// Last-dim operations.

// Softmax over the last dim (whole on each rank).
template <class V>
  requires var_type<V>
auto softmax(V&& x) {
  using X = detail::tensor_of<V>;
  tape& t = x.on_tape();
  const int xs = x.slot();
  auto y = t.output(softmax(detail::value_of(std::forward<V>(x))), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, keep_y = y.shared()] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      tp->slot<X>(xs).add(softmax_backward(std::move(*dy), *keep_y));
    });
  return y;
}

// x with the entries above the diagonal of its last two dims [.., L, T]
// (t > l) set to -inf: causal attention logits.
template <class V>
  requires var_type<V>
auto causal_mask(V&& x) {
  using X = detail::tensor_of<V>;
  using T = typename X::value_type;
  static_assert(X::rank >= 2, "gshard::causal_mask: the tensor needs two dims [.., L, T] to mask");
  static_assert(X::resolved.dims[X::rank - 1].n == 0 && X::resolved.dims[X::rank - 2].n == 0,
                "gshard::causal_mask: the last two dims are split; the mask needs them whole on each rank");
  static_assert(!detail::has_pending_sums<X>(), "gshard::causal_mask: the tensor has pending sums; all_reduce it first");
  auto apply = [](T* p, const auto& le, T fill) {
    detail::causal_rows(le, [&](index_t at, index_t kept, index_t n) { std::fill(p + at + kept, p + at + n, fill); });
  };
  tape& t = x.on_tape();
  const int xs = x.slot();
  X v = detail::value_of(std::forward<V>(x));
  apply(v.data(), v.local_extents(), -std::numeric_limits<T>::infinity());
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, apply] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      apply(dy->data(), dy->local_extents(), T(0));
      tp->slot<X>(xs).add(std::move(*dy));
    });
  return y;
}

// softmax(causal_mask(scale · x)) in one pass (ops.hpp): causal attention's
// probabilities from its logits [.., L, T]. Keeps the output.
template <class V>
  requires var_type<V>
auto causal_softmax(V&& x, double scale = 1.0) {
  using X = detail::tensor_of<V>;
  tape& t = x.on_tape();
  const int xs = x.slot();
  auto y = t.output(causal_softmax(detail::value_of(std::forward<V>(x)), scale), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, keep_y = y.shared(), scale] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      tp->slot<X>(xs).add(causal_softmax_backward(std::move(*dy), *keep_y, scale));
    });
  return y;
}

// Causal self-attention (gshard/attention.hpp): q [B, L, N, K], k and v
// [B, T, N, K] to softmax(causal_mask(scale · q·kᵀ))·v, per sequence and head
// in blocks of rows. Keeps q, k, v and the probabilities [B, N, L, T] (as
// the einsums and softmax it stands for keep them; not the logits), or with
// attention_memory::recompute_probabilities two numbers per row instead.
template <class Q, class K, class V>
  requires(detail::ad_operand<Q> && detail::ad_operand<K> && detail::ad_operand<V>)
auto causal_attention(const Q& q_in, const K& k_in, const V& v_in, double scale,
                      attention_memory memory = attention_memory::keep_probabilities) {
  tape& t = detail::tape_of(q_in, k_in, v_in);
  const auto q = detail::as_var(t, q_in);
  const auto k = detail::as_var(t, k_in);
  const auto v = detail::as_var(t, v_in);
  using XQ = detail::tensor_of<decltype(q)>;
  using XK = detail::tensor_of<decltype(k)>;
  using XV = detail::tensor_of<decltype(v)>;
  static_assert(detail::check_attention<XQ, XK, XV>());
  using T = typename XQ::value_type;
  const bool track = q.tracked() || k.tracked() || v.tracked();
  auto kept = track && t.recording() ? std::make_shared<detail::attention_kept<T>>() : nullptr;
  auto y = t.output(detail::attention_forward<XQ>(q.value(), k.value(), v.value(), scale, kept.get(), memory), track);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), qs = q.slot(), ks = k.slot(), vs = v.slot(), kq = q.shared(), kk = k.shared(),
              kv = v.shared(), kept, scale] {
      auto dy = tp->slot<XQ>(ys).template take<gradient_sharding<typename XQ::sharding_type>>();
      if (!dy) return;
      auto [dq, dk, dv] = detail::attention_backward<detail::gradient_of<XQ>, detail::gradient_of<XK>, detail::gradient_of<XV>>(
          *dy, *kq, *kk, *kv, *kept, scale);
      if (qs >= 0) tp->slot<XQ>(qs).add(std::move(dq));
      if (ks >= 0) tp->slot<XK>(ks).add(std::move(dk));
      if (vs >= 0) tp->slot<XV>(vs).add(std::move(dv));
    });
  return y;
}

// Vars mixed with plain tensors: a tensor nobody declared would silently
// receive no gradient, so it does not compile (as einsum's).
template <class Q, class K, class V>
  requires((detail::ad_operand<Q> || detail::ad_operand<K> || detail::ad_operand<V>) &&
           (sharded_tensor<Q> || sharded_tensor<K> || sharded_tensor<V>))
auto causal_attention(const Q&, const K&, const V&, double, attention_memory = attention_memory::keep_probabilities) {
  static_assert(sizeof(Q) == 0,
                "gshard::causal_attention: some operands are vars or parameters, others plain tensors; declare the "
                "tensors as gshard::param (to train them) or pass tape.constant(t) (to hold them fixed)");
}

// GShard's RMS norm over the last dim: x · rsqrt(mean(x²) + eps) · scale.
// The scale's gradient is a sum over x's rows: pending over the axes that
// split them, reduced once with the scale's other contributions.
template <class V, class S>
  requires(var_type<V> && detail::ad_operand<S>)
auto rms_norm(V&& x, const S& scale_in, double eps = 1e-6) {
  using X = detail::tensor_of<V>;
  tape& t = x.on_tape();
  const auto sc = detail::as_var(t, scale_in);
  using XS = detail::tensor_of<decltype(sc)>;
  static_assert(XS::rank == 1 && XS::resolved == detail::rlayout{},
                "gshard::rms_norm: the scale is a replicated vector of the last dim's extent");
  const int xs = x.slot(), ss = sc.slot();
  std::shared_ptr<const X> keep_x = x.tracked() || sc.tracked() ? x.shared() : nullptr;
  auto y = t.output(rms_norm(detail::value_of(std::forward<V>(x)), sc.value().local(), eps), xs >= 0 || ss >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs, ss, keep_x, keep_s = sc.shared(), eps] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      using DS = typename detail::sum_over_shards<X, 1>::type;
      DS ds(keep_x->mesh(), {keep_x->extent(X::rank - 1)});
      auto dx = rms_norm_backward(std::move(*dy), *keep_x, keep_s->local(), ds.data(), eps);
      if (xs >= 0) tp->slot<X>(xs).add(std::move(dx));
      if (ss >= 0) tp->slot<XS>(ss).add(std::move(ds));
    });
  return y;
}

}  // namespace gshard
