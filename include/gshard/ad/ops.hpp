// gshard/ad/ops.hpp — the local operations on the tape: element-wise + − ⊙,
// scalar × and ÷, relu, gelu, silu, sigmoid, exp, log, tanh, sqrt; the
// maximum and minimum over a dim; softmax, causal masking; chunk, concat and
// relabel. Each computes like its tensor form (gshard/tensor/ops.hpp, whose
// gradient rules it records) and keeps only what its rule reads — relu its
// output, + nothing; an rvalue var nothing else holds is updated in place.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/ad/operands.hpp"
#include "gshard/ad/tape.hpp"
#include "gshard/kernels/copy_box.hpp"
#include "gshard/kernels/gemm.hpp"
#include "gshard/tensor/ops.hpp"
#include "gshard/tensor/reduce.hpp"

namespace gshard {

namespace detail {

// Element-wise rules: y = f(x), dx = dy · f'(x, y), with f and f' from tensor/ops.hpp.
template <class Op, class V>
auto unary(V&& x) {
  using X = tensor_of<V>;
  tape& t = x.on_tape();
  const int xs = x.slot();
  if constexpr (std::is_same_v<Op, relu_op> && std::is_same_v<typename X::value_type, float>)
    if (x.held() && gemm_rounds_to_bf16()) {
      // x held in bf16 (einsum<.., bf16_activation>): the ReLU of the bf16
      // values — what rounding the ReLU of the fp32 ones gives — held so;
      // the rule passes dy where it is > 0.
      auto y16 = held_of(std::forward<V>(x));
      relu_in_place(y16.data(), y16.local().size());
      auto y = t.output_held(std::move(y16), xs >= 0);
      if (y.tracked())
        t.record([tp = &t, ys = y.slot(), xs, keep = y.held()] {
          auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
          if (!dy) return;
          zero_where_at_most(dy->data(), keep->data(), 0.0f, dy->local().size());
          tp->slot<X>(xs).add(std::move(*dy));
        });
      return y;
    }
  std::shared_ptr<const X> keep_x = Op::needs_x && xs >= 0 ? x.shared() : nullptr;  // before x may be moved from
  X v = value_of(std::forward<V>(x));
  elementwise<Op>(v.data(), v.local().size());
  auto y = t.output(std::move(v), xs >= 0);
  if constexpr (requires { requires Op::reads_sign_of_y; } && std::is_same_v<typename X::value_type, float>)
    if (y.tracked() && gemm_rounds_to_bf16()) {
      // With bf16 GEMMs the einsum that reads y (a ReLU's output: the FFN's
      // second GEMM) rounds it once (tape::derived); the rule keeps that
      // copy, half the bytes, and not y; the gradient passes where the copy
      // is > 0, which is where y is but for y at most 2⁻¹³⁴ (rounded to 0).
      auto y16 = t.derived<with_element<X, bf16>>(y.shared(), [](const X& u) { return convert<bf16>(u); });
      t.record([tp = &t, ys = y.slot(), xs, y16] {
        auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
        if (!dy) return;
        zero_where_at_most(dy->data(), y16->data(), 0.0f, dy->local().size());
        tp->slot<X>(xs).add(std::move(*dy));
      });
      return y;
    }
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

// y = x + s (s added to every element).
template <class V>
auto shift(V&& x, double s) {
  using X = tensor_of<V>;
  using T = typename X::value_type;
  static_assert(!has_pending_sums<X>(),
                "gshard::operator+: the tensor has pending sums; a scalar added to each summand is added once per rank: "
                "all_reduce it first");
  tape& t = x.on_tape();
  const int xs = x.slot();
  X v = value_of(std::forward<V>(x));
  v.local() = v.local() + T(s);
  auto y = t.output(std::move(v), xs >= 0);
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), xs] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (dy) tp->slot<X>(xs).add(std::move(*dy));
    });
  return y;
}

// A var with a plain tensor in +, - or *: a compile error naming both.
template <class A, class B>
struct var_with_tensor {
  static_assert(sizeof(A) == 0,
                "gshard::elementwise: a var with a plain tensor in +, - or *; pass tape.constant(t) to use the tensor as a "
                "constant, or declare it as a gshard::param to train it");
  static constexpr bool ok = true;
};

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

// Micro-batches along a split dim, cut and joined rank by rank:
// cut_blocks<Dim>(x, first) cuts every rank's block of a tensor (the
// inputs: tokens, paddings) after the rows it would hold of a tensor of
// global extent `first`; join_blocks<Dim>(a, b) puts the block of var b
// after var a's on every rank (the activations, back into one batch).
// Nothing moves: the global order is the ranks' blocks interleaved, not a
// then b. Valid when the blocks add up (detail::blocks_add_up), as the cut
// halve_blocks<Dim>(x) chooses does; the check gives the same verdict on
// every rank.
//   auto [a, b] = cut_blocks<0>(tokens, halve_blocks<0>(tokens));  // 0: no cut splits it
namespace detail {
template <int Dim, class X>
void require_blocks_add_up(const char* who, const X& like, index_t first, index_t second) {
  if (first < 0 || second < 0 || !blocks_add_up(X::resolved, Dim, first, second, like.mesh().sizes()))
    throw shape_error(std::string("gshard::") + who + ": blocks of " + std::to_string(first) + " and " +
                      std::to_string(second) + " rows along dim " + std::to_string(Dim) + " of " + like.notation() +
                      " do not join rank by rank into the blocks of " + std::to_string(first + second) +
                      " (halve_blocks gives a cut that does)");
}
}  // namespace detail

// The cut of x's dim Dim into two micro-batches: the first's global extent,
// its blocks as near each rank's half as the rule for uneven dims allows, or
// 0 when no cut leaves both non-empty (one row per rank).
template <int Dim, class X>
  requires sharded_tensor<X>
index_t halve_blocks(const X& x) {
  static_assert(Dim >= 0 && Dim < X::rank, "gshard::halve_blocks: the dim is not one of the tensor's");
  return detail::halve_blocks(X::resolved, Dim, x.extent(Dim), x.mesh().sizes());
}

template <int Dim, class X>
  requires sharded_tensor<X>
std::pair<X, X> cut_blocks(const X& x, index_t first) {
  constexpr int R = X::rank;
  static_assert(Dim >= 0 && Dim < R, "gshard::cut_blocks: the dim is not one of the tensor's");
  detail::require_blocks_add_up<Dim>("cut_blocks", x, first, x.extent(Dim) - first);
  shape<R> ga = x.extents(), gb = x.extents();
  ga[Dim] = first, gb[Dim] = x.extent(Dim) - first;
  std::pair<X, X> out{X(x.mesh(), ga), X(x.mesh(), gb)};
  const shape<R> le = x.local_extents();
  const index_t la = out.first.local_extents()[Dim];
  using T = typename X::value_type;
  detail::copy_along<Dim, T, R>(x.data(), le, 0, out.first.data(), out.first.local_extents(), 0, la);
  detail::copy_along<Dim, T, R>(x.data(), le, la, out.second.data(), out.second.local_extents(), 0, le[Dim] - la);
  return out;
}

template <int Dim, class X>
var<X> join_blocks(const var<X>& a, const var<X>& b) {
  using T = typename X::value_type;
  constexpr int R = X::rank;
  static_assert(Dim >= 0 && Dim < R, "gshard::join_blocks: the dim is not one of the tensor's");
  for (int d = 0; d < R; ++d)
    if (d != Dim && a.extent(d) != b.extent(d))
      throw shape_error("gshard::join_blocks: " + a.notation() + " and " + b.notation() + " differ outside dim " +
                        std::to_string(Dim));
  detail::require_blocks_add_up<Dim>("join_blocks", a.value(), a.extent(Dim), b.extent(Dim));
  tape& t = a.on_tape();
  shape<R> g = a.extents();
  g[Dim] += b.extent(Dim);
  X x(a.mesh(), g);
  const shape<R> le = x.local_extents(), lea = a.value().local_extents(), leb = b.value().local_extents();
  detail::copy_along<Dim, T, R>(a.value().data(), lea, 0, x.data(), le, 0, lea[Dim]);
  detail::copy_along<Dim, T, R>(b.value().data(), leb, 0, x.data(), le, lea[Dim], leb[Dim]);
  auto y = t.output(std::move(x), a.tracked() || b.tracked());
  if (y.tracked())
    t.record([tp = &t, ys = y.slot(), as = a.slot(), bs = b.slot(), ea = a.extents(), eb = b.extents(), le, la = lea[Dim]] {
      auto dy = tp->slot<X>(ys).template take<gradient_sharding<typename X::sharding_type>>();
      if (!dy) return;
      for (const auto& [slot, extents, off] : {std::tuple{as, ea, index_t(0)}, std::tuple{bs, eb, la}}) {
        if (slot < 0) continue;
        detail::gradient_of<X> dp(dy->mesh(), extents);
        detail::copy_along<Dim, T, R>(dy->data(), le, off, dp.data(), dp.local_extents(), 0, dp.local_extents()[Dim]);
        tp->slot<X>(slot).add(std::move(dp));
      }
    });
  return y;
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
  if constexpr (std::is_same_v<typename X::value_type, float>)
    if (v.held())  // held in bf16: stays so
      return var<Y>(t, std::shared_ptr<const typename var<Y>::held_type>(std::make_shared<typename var<Y>::held_type>(
                           relabel<Labels>(detail::held_of(std::forward<V>(v))))),
                    slot);
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
// Vars of different types, or a var with a plain tensor: the compile error
// names both types and the fix (gshard/tensor/ops.hpp's elementwise_operands).
#define GSHARD_MISMATCHED_(op)                                                         \
  template <class X, class Y>                                                          \
    requires(!std::is_same_v<X, Y>)                                                    \
  var<X> operator op(var<X> a, const var<Y>&) {                                        \
    static_assert(detail::elementwise_operands<X, Y>::ok);                             \
    return a;                                                                          \
  }                                                                                    \
  template <class X, sharded_tensor Y>                                                 \
  var<X> operator op(var<X> a, const Y&) {                                             \
    static_assert(detail::var_with_tensor<X, Y>::ok);                                  \
    return a;                                                                          \
  }                                                                                    \
  template <sharded_tensor Y, class X>                                                 \
  var<X> operator op(const Y&, var<X> a) {                                             \
    static_assert(detail::var_with_tensor<X, Y>::ok);                                  \
    return a;                                                                          \
  }
GSHARD_MISMATCHED_(+)
GSHARD_MISMATCHED_(-)
GSHARD_MISMATCHED_(*)
#undef GSHARD_MISMATCHED_

// x + s, s + x, x − s and s − x: s added to every element.
template <class V>
  requires var_type<V>
auto operator+(V&& x, double s) {
  return detail::shift(std::forward<V>(x), s);
}
template <class V>
  requires var_type<V>
auto operator+(double s, V&& x) {
  return detail::shift(std::forward<V>(x), s);
}
template <class V>
  requires var_type<V>
auto operator-(V&& x, double s) {
  return detail::shift(std::forward<V>(x), -s);
}
template <class V>
  requires var_type<V>
auto operator-(double s, V&& x) {
  return detail::shift(detail::scale(std::forward<V>(x), -1.0), s);
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
GSHARD_ELEMENTWISE_FUNCTIONS(GSHARD_UNARY_)  // tensor/ops.hpp's list
#undef GSHARD_UNARY_

// ---------------------------------------------------------------------------
// The maximum or minimum over a dim (gshard/tensor/reduce.hpp). The gradient goes to
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

// softmax(causal_mask(scale · x)) in one pass (tensor/ops.hpp): causal attention's
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

}  // namespace gshard
