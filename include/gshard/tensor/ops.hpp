// gshard/tensor/ops.hpp — element-wise and last-dim operations on sharded tensors,
// each with its gradient rule (relu_backward, softmax_backward, ...). They
// act on each rank's shard and keep the sharding, so they never communicate; they refuse tensors with pending sums (relu of a summand is
// not a summand of the relu), and last-dim operations refuse a split last dim.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "gshard/core/bf16.hpp"
#include "gshard/kernels/blockwise.hpp"
#include "gshard/kernels/softmax_row.hpp"
#include "gshard/tensor/tensor.hpp"

namespace gshard {

namespace detail {
template <class X>
constexpr bool has_pending_sums() {
  return X::resolved.partial != 0;
}
template <class X>
constexpr bool last_dim_split() {
  return X::rank > 0 && X::resolved.dims[X::rank - 1].n > 0;
}
// A gradient and its primal: the same global shape and the same split dims
// (the gradient holds no pending sums; labels may differ).
template <class DY, class X>
constexpr bool same_shards() {
  rlayout a = DY::resolved, b = X::resolved;
  a.partial = b.partial = 0;
  return DY::rank == X::rank && a == b && std::is_same_v<typename DY::value_type, typename X::value_type>;
}

// Element-wise functions: y = f(x), and their derivatives f'(x, y) for
// the tape (ad/ops.hpp), each written once here: on one value (f, df) and,
// where Eigen's packets serve, on an array of them (fv, dfv; run in fixed
// blocks, kernels/blockwise.hpp). exp, log and sqrt keep std::'s forward:
// Eigen 3.4's packet exp never returns 0 (exp(-inf) is 2.9e-39 in float on
// AVX2, 0 on AVX-512; 5.6e-309 in double), its log clamps subnormals and,
// with its default EIGEN_FAST_MATH, its sqrt is an estimate refined (NaN at
// +inf). sigmoid and silu take its exp: for inputs below -88 (float) they
// give ~3e-39 where std::exp gives less, harmless for an activation; tanh
// agrees with std::tanh within a few ulp.
template <class A>
using scalar_of = typename std::remove_cvref_t<A>::Scalar;
template <class T>
T gelu_cdf(T x) {
  return T(0.5) * (T(1) + std::erf(x * T(0.70710678118654752440)));
}
struct relu_op {
  static constexpr bool needs_x = false, needs_y = true;
  static constexpr bool reads_sign_of_y = true;  // df passes dy where y > 0: a bf16 copy of y serves
  template <class T> static T f(T x) { return x <= T(0) ? T(0) : x; }  // NaN stays NaN, as fv's packets give it
  template <class T> static T df(T, T y, T dy) { return y <= T(0) ? T(0) : dy; }  // as df_n's mask
  template <class A> static auto fv(const A& x) { return x.max(scalar_of<A>(0)); }
  template <class T> static void df_n(T* g, const T*, const T* y, index_t n) { zero_where_at_most(g, y, T(0), n); }
};
struct gelu_op {  // x·Φ(x), the exact form
  static constexpr bool needs_x = true, needs_y = false;
  template <class T> static T f(T x) { return x * gelu_cdf(x); }
  template <class T> static T df(T x, T, T dy) {
    return dy * (gelu_cdf(x) + x * T(0.39894228040143267794) * std::exp(T(-0.5) * x * x));
  }
};
struct sigmoid_op {
  static constexpr bool needs_x = false, needs_y = true;
  template <class T> static T f(T x) { return T(1) / (T(1) + std::exp(-x)); }
  template <class T> static T df(T, T y, T dy) { return dy * y * (T(1) - y); }
  template <class A> static auto fv(const A& x) { return scalar_of<A>(1) / (scalar_of<A>(1) + (-x).exp()); }
  template <class A, class D> static auto dfv(const A&, const A& y, const D& dy) { return dy * y * (scalar_of<A>(1) - y); }
};
struct silu_op {  // x·σ(x)
  static constexpr bool needs_x = true, needs_y = false;
  template <class T> static T f(T x) { return x / (T(1) + std::exp(-x)); }
  template <class T> static T df(T x, T, T dy) {
    const T s = T(1) / (T(1) + std::exp(-x));
    return dy * s * (T(1) + x * (T(1) - s));
  }
  template <class A> static auto fv(const A& x) { return x / (scalar_of<A>(1) + (-x).exp()); }
  template <class A, class D> static auto dfv(const A& x, const A&, const D& dy) {
    using S = scalar_of<A>;
    const auto s = (S(1) / (S(1) + (-x).exp())).eval();
    return (dy * s * (S(1) + x * (S(1) - s))).eval();
  }
};
struct exp_op {
  static constexpr bool needs_x = false, needs_y = true;
  template <class T> static T f(T x) { return std::exp(x); }
  template <class T> static T df(T, T y, T dy) { return dy * y; }
  template <class A, class D> static auto dfv(const A&, const A& y, const D& dy) { return dy * y; }
};
struct log_op {
  static constexpr bool needs_x = true, needs_y = false;
  template <class T> static T f(T x) { return std::log(x); }
  template <class T> static T df(T x, T, T dy) { return dy / x; }
  template <class A, class D> static auto dfv(const A& x, const A&, const D& dy) { return dy / x; }
};
struct tanh_op {
  static constexpr bool needs_x = false, needs_y = true;
  template <class T> static T f(T x) { return std::tanh(x); }
  template <class T> static T df(T, T y, T dy) { return dy * (T(1) - y * y); }
  template <class A> static auto fv(const A& x) { return x.tanh(); }
  template <class A, class D> static auto dfv(const A&, const A& y, const D& dy) { return dy * (scalar_of<A>(1) - y * y); }
};
struct sqrt_op {
  static constexpr bool needs_x = false, needs_y = true;
  template <class T> static T f(T x) { return std::sqrt(x); }
  template <class T> static T df(T, T y, T dy) { return dy / (T(2) * y); }
  template <class A, class D> static auto dfv(const A&, const A& y, const D& dy) { return dy / (scalar_of<A>(2) * y); }
};

// Whether Op has an array form of f (fv) or of f' (dfv) for T: float and
// double, where Eigen has packets.
template <class Op, class T>
concept array_f = (std::is_same_v<T, float> || std::is_same_v<T, double>) &&
                  requires(const Eigen::Array<T, 4, 1>& a) { Op::fv(a); };
template <class Op, class T>
concept array_df = (std::is_same_v<T, float> || std::is_same_v<T, double>) &&
                   requires(const Eigen::Array<T, 4, 1>& a) { Op::dfv(a, a, a); };

// y = f(x) over n elements, in place (p holds x, then y).
template <class Op, class T>
void elementwise(T* p, index_t n) {
  if constexpr (array_f<Op, T>) blockwise<T>(n, [](auto&& v) { v = Op::fv(v); }, p);
  else
    for (index_t i = 0; i < n; ++i) p[i] = Op::f(p[i]);
}

// g = f'(x, y)·g over n elements, reading x or y (the one Op needs).
template <class Op, class T>
void elementwise_backward(T* g, const T* x, const T* y, index_t n) {
  if constexpr (requires { Op::df_n(g, x, y, n); }) {
    Op::df_n(g, x, y, n);
  } else if constexpr (array_df<Op, T>) {
    static_assert(Op::needs_x != Op::needs_y);
    blockwise<T>(n, [](auto&& d, const auto& v) { d = Op::dfv(v, v, d); }, g, Op::needs_x ? x : y);
  } else {
    for (index_t i = 0; i < n; ++i) g[i] = Op::df(x ? x[i] : T(0), y ? y[i] : T(0), g[i]);
  }
}

template <class Op, class X>
std::remove_cvref_t<X> apply_elementwise(X&& x) {
  using Y = std::remove_cvref_t<X>;
  Y out = std::forward<X>(x);
  elementwise<Op>(out.data(), out.local().size());
  return out;
}
}  // namespace detail

// relu, gelu, silu, sigmoid, exp, log, tanh, sqrt, element-wise; an rvalue
// is updated in place. Refused on pending sums at compile time (relu of a
// summand is not a summand of the relu).
#define GSHARD_UNARY_(name, op)                                                                                    \
  template <class X>                                                                                               \
    requires sharded_tensor<std::remove_cvref_t<X>>                                                                \
  std::remove_cvref_t<X> name(X&& x) {                                                                             \
    static_assert(!detail::has_pending_sums<std::remove_cvref_t<X>>(),                                             \
                  "gshard::" #name ": the tensor has pending sums; all_reduce or reduce_scatter it first");        \
    return detail::apply_elementwise<detail::op>(std::forward<X>(x));                                              \
  }
// The element-wise functions, listed once: these plain forms and the tape's
// (ad/ops.hpp) are both made from this list.
#define GSHARD_ELEMENTWISE_FUNCTIONS(F) \
  F(relu, relu_op)                      \
  F(gelu, gelu_op)                      \
  F(silu, silu_op)                      \
  F(sigmoid, sigmoid_op)                \
  F(exp, exp_op)                        \
  F(log, log_op)                        \
  F(tanh, tanh_op)                      \
  F(sqrt, sqrt_op)
GSHARD_ELEMENTWISE_FUNCTIONS(GSHARD_UNARY_)
#undef GSHARD_UNARY_

// dy where x > 0, else 0 (a NaN x passes dy, as relu keeps the NaN), where
// the forward was y = relu(x): the tape's relu mask (kernels/blockwise.hpp).
template <sharded_tensor DY, sharded_tensor X>
DY relu_backward(DY dy, const X& x) {
  static_assert(detail::same_shards<DY, X>(), "gshard::relu_backward: dy and x are sharded differently");
  detail::zero_where_at_most(dy.data(), x.data(), typename X::value_type(0), dy.local().size());
  return dy;
}

namespace detail {
// Two operands of an element-wise +, - or * that are not of one tensor type:
// instantiated with both, so the compiler's message names them.
template <class A, class B>
struct elementwise_operands {
  static constexpr bool same_kind = std::is_same_v<typename A::value_type, typename B::value_type> && A::rank == B::rank &&
                                    std::is_same_v<typename A::mesh_type, typename B::mesh_type>;
  static_assert(same_kind, "gshard::elementwise: the operands of +, - or * differ in element type, rank or mesh type");
  static_assert(!same_kind || A::labels == B::labels,
                "gshard::elementwise: the operands of +, - or * carry different labels; relabel<\"...\">(x) one to the other's");
  static_assert(!same_kind || A::labels != B::labels || std::is_same_v<typename A::sharding_type, typename B::sharding_type>,
                "gshard::elementwise: the operands of +, - or * are sharded differently; reshard one to the other's sharding");
  static constexpr bool ok = true;
};

template <class X>
void same_extents(const X& a, const X& b, const char* op) {
  if (a.extents() != b.extents())
    throw shape_error(std::string("gshard::operator") + op + ": " + a.notation() + " and " + b.notation() + " differ in extents");
}
}  // namespace detail

// a + b and a - b for two tensors of one type (pending sums add and
// subtract too: the sum of the differences is the difference of the sums).
template <sharded_tensor X>
X operator+(X a, const X& b) {
  detail::same_extents(a, b, "+");
  a.local() += b.local();
  return a;
}
template <sharded_tensor X>
X operator-(X a, const X& b) {
  detail::same_extents(a, b, "-");
  a.local() -= b.local();
  return a;
}
template <sharded_tensor X>
X operator-(X a) {
  a.local() = -a.local();
  return a;
}

// Two tensors of different types: the compile error names both and the fix.
template <sharded_tensor A, sharded_tensor B>
  requires(!std::is_same_v<A, B>)
A operator+(A a, const B&) {
  static_assert(detail::elementwise_operands<A, B>::ok);
  return a;
}
template <sharded_tensor A, sharded_tensor B>
  requires(!std::is_same_v<A, B>)
A operator-(A a, const B&) {
  static_assert(detail::elementwise_operands<A, B>::ok);
  return a;
}
template <sharded_tensor A, sharded_tensor B>
  requires(!std::is_same_v<A, B>)
A operator*(A a, const B&) {
  static_assert(detail::elementwise_operands<A, B>::ok);
  return a;
}

// a + s and a − s: s added to every element. Refused on pending sums (s
// added to each rank's summand would be added once per rank).
template <sharded_tensor X>
X operator+(X a, typename X::value_type s) {
  static_assert(!detail::has_pending_sums<X>(),
                "gshard::operator+: the tensor has pending sums; a scalar added to each summand is added once per rank: "
                "all_reduce it first");
  a.local() = a.local() + s;
  return a;
}
template <sharded_tensor X>
X operator+(typename X::value_type s, X a) {
  return std::move(a) + s;
}
template <sharded_tensor X>
X operator-(X a, typename X::value_type s) {
  return std::move(a) + (-s);
}
template <sharded_tensor X>
X operator-(typename X::value_type s, X a) {
  return -std::move(a) + s;
}

// a ⊙ b, element-wise, for two tensors of one type without pending sums.
template <sharded_tensor X>
X operator*(X a, const X& b) {
  static_assert(!detail::has_pending_sums<X>(),
                "gshard::operator*: the operands have pending sums; a product of sums is not a sum of products");
  detail::same_extents(a, b, "*");
  a.local() *= b.local();
  return a;
}

// s · a, a · s and a / s.
template <sharded_tensor X>
X operator*(typename X::value_type s, X a) {
  a.local() = a.local() * s;
  return a;
}
template <sharded_tensor X>
X operator*(X a, typename X::value_type s) {
  return s * std::move(a);
}
template <sharded_tensor X>
X operator/(X a, typename X::value_type s) {
  a.local() = a.local() / s;
  return a;
}

// The value of a rank-0 tensor without pending sums (a loss, a norm), on
// every rank.
template <sharded_tensor X>
typename X::value_type scalar(const X& x) {
  static_assert(X::rank == 0 && !detail::has_pending_sums<X>(),
                "gshard::scalar: the tensor is not a rank-0 tensor without pending sums; einsum to \"\" and all_reduce it first");
  return x.local()();
}

// Softmax over the last dim (which must not be split), computed in at least
// float precision with the maximum subtracted.
template <class X>
  requires sharded_tensor<X>
std::remove_cvref_t<X> softmax(X&& x) {
  using Y = std::remove_cvref_t<X>;
  using T = typename Y::value_type;
  static_assert(!detail::has_pending_sums<Y>(), "gshard::softmax: the tensor has pending sums; all_reduce it first");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<Y>::value_type>,
                "gshard::softmax: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  static_assert(!detail::last_dim_split<Y>(), "gshard::softmax: the last dim is split; softmax needs it whole on each rank");
  Y out = std::forward<X>(x);
  const index_t n = Y::rank ? out.local().dimension(Y::rank - 1) : 1;
  if (n == 0) return out;
  T* p = out.data();
  for (index_t row = 0, rows = out.local().size() / n; row < rows; ++row, p += n) detail::softmax_row(p, n, p);
  return out;
}

// dx = y · (dy − Σ_last dy·y), where the forward was y = softmax(x) over the last dim.
template <sharded_tensor DY, sharded_tensor Y>
DY softmax_backward(DY dy, const Y& y) {
  static_assert(detail::same_shards<DY, Y>(), "gshard::softmax_backward: dy and y are sharded differently");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<Y>::value_type>,
                "gshard::softmax: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  const index_t n = DY::rank ? dy.local().dimension(DY::rank - 1) : 1;
  if (n == 0) return dy;
  auto* g = dy.data();
  const auto* p = y.data();
  for (index_t row = 0, rows = dy.local().size() / n; row < rows; ++row, g += n, p += n) detail::softmax_row_backward(g, p, n);
  return dy;
}

namespace detail {
// f(at, kept, n) for each row [.., l, :] of a [.., L, T] shard (row-major):
// the row starts at element `at`, has n = T entries, of which the first
// kept = min(l + 1, T) are at or below the diagonal (t <= l).
template <std::size_t R, class F>
void causal_rows(const std::array<index_t, R>& le, F&& f) {
  static_assert(R >= 2);
  const index_t L = le[R - 2], n = le[R - 1];
  index_t rows = 1;
  for (std::size_t d = 0; d + 2 < R; ++d) rows *= le[d];
  for (index_t r = 0, at = 0; r < rows; ++r)
    for (index_t l = 0; l < L; ++l, at += n) f(at, std::min(l + 1, n), n);
}
}  // namespace detail

// Causal attention's softmax in one pass: softmax over the last dim T of
// scale · x with the entries above the diagonal of the last two dims
// [.., L, T] (t > l) masked out, which get 0 — softmax(causal_mask(scale · x))
// without its two extra passes over the logits or the exps of the masked
// half. Both last dims must be whole on each rank.
template <class X>
  requires sharded_tensor<X>
std::remove_cvref_t<X> causal_softmax(X&& x, double scale = 1.0) {
  using Y = std::remove_cvref_t<X>;
  using T = typename Y::value_type;
  static_assert(Y::rank >= 2, "gshard::causal_softmax: the tensor needs two dims [.., L, T] to mask");
  static_assert(Y::resolved.dims[Y::rank - 1].n == 0 && Y::resolved.dims[Y::rank - 2].n == 0,
                "gshard::causal_softmax: the last two dims are split; the mask needs them whole on each rank");
  static_assert(!detail::has_pending_sums<Y>(), "gshard::causal_softmax: the tensor has pending sums; all_reduce it first");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<Y>::value_type>,
                "gshard::softmax: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  Y out = std::forward<X>(x);
  T* p = out.data();
  detail::causal_rows(out.local_extents(), [&](index_t at, index_t kept, index_t n) {
    detail::softmax_row(p + at, kept, p + at, T(scale));
    std::fill(p + at + kept, p + at + n, T(0));
  });
  return out;
}

// dx = scale · y · (dy − Σ_t dy·y) over each row's unmasked entries (t <= l)
// and 0 above the diagonal, where the forward was y = causal_softmax(x, scale).
template <sharded_tensor DY, sharded_tensor Y>
DY causal_softmax_backward(DY dy, const Y& y, double scale) {
  static_assert(detail::same_shards<DY, Y>(), "gshard::causal_softmax_backward: dy and y are sharded differently");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<Y>::value_type>,
                "gshard::softmax: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  using T = typename DY::value_type;
  T* g = dy.data();
  const T* p = y.data();
  detail::causal_rows(dy.local_extents(), [&](index_t at, index_t kept, index_t n) {
    detail::softmax_row_backward(g + at, p + at, kept, T(scale));
    std::fill(g + at + kept, g + at + n, T(0));
  });
  return dy;
}

namespace detail {

// rms_norm over rows of n in place; each row's r = (mean(x²) + eps)^-1/2,
// in double, into `inverse` unless it is null.
template <class T>
void rms_norm_rows(T* p, index_t rows, index_t n, const T* scale, double eps, double* inverse) {
  using row = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const row> s(scale, n);
  for (index_t r = 0; r < rows; ++r, p += n) {
    Eigen::Map<row> v(p, n);
    const double inv = 1.0 / std::sqrt(double(v.matrix().squaredNorm()) / double(n) + eps);
    if (inverse) inverse[r] = inv;
    v = v * T(inv) * s;
  }
}

// One row of rms_norm's backward: g (dy in, dx out) from the row x and its r;
// the row's share of the scale's gradient added to ds.
template <class T>
void rms_norm_backward_row(T* g, const T* x, double inv, const T* scale, T* ds, index_t n) {
  using row = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const row> s(scale, n), xv(x, n);
  Eigen::Map<row> gv(g, n), dsum(ds, n);
  const double c = inv * inv * inv * double((gv * s * xv).sum()) / double(n);
  dsum += gv * xv * T(inv);
  gv = s * T(inv) * gv - xv * T(c);
}

// rms_norm(x, scale, eps), each row's r (double) into `inverse` unless null.
template <class X, class Scale>
  requires sharded_tensor<X>
std::remove_cvref_t<X> rms_norm_keeping(X&& x, const Scale& scale, double eps, double* inverse) {
  using Y = std::remove_cvref_t<X>;
  static_assert(!detail::has_pending_sums<Y>(), "gshard::rms_norm: the tensor has pending sums; all_reduce it first");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<Y>::value_type>,
                "gshard::rms_norm: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  static_assert(!detail::last_dim_split<Y>(), "gshard::rms_norm: the last dim is split; the norm needs it whole on each rank");
  Y out = std::forward<X>(x);
  const index_t n = out.local().dimension(Y::rank - 1);
  if (index_t(scale.size()) != n)
    throw shape_error("gshard::rms_norm: the scale has " + std::to_string(scale.size()) + " values for a last dim of " +
                      std::to_string(n));
  if (n > 0) rms_norm_rows(out.data(), index_t(out.local().size()) / n, n, scale.data(), eps, inverse);
  return out;
}

}  // namespace detail

// GShard's RMS-style norm over the last dim: x · rsqrt(mean(x²) + eps) · scale.
// `scale` holds the last dim's extent of values, on every rank. Float and
// double rows take Eigen's packets (the sum of squares in T, in several
// accumulators), which -O2 would not vectorise.
template <class X, class Scale>
  requires sharded_tensor<X>
std::remove_cvref_t<X> rms_norm(X&& x, const Scale& scale, double eps = 1e-6) {
  return detail::rms_norm_keeping(std::forward<X>(x), scale, eps, nullptr);
}

// The RMS norm y = x · r · s, r = (mean(x²) + eps)^-1/2, over the last dim:
// dx = s·r·dy − x·r³·mean(dy·s·x), and the scale's gradient Σ_rows dy·x·r,
// which is a pending sum over the ranks that split the rows; `ds` receives
// this rank's summand (the caller reduces it). Rows of float and double take
// Eigen's packets, as the forward's.
template <sharded_tensor DY, sharded_tensor X, class Scale>
DY rms_norm_backward(DY dy, const X& x, const Scale& scale, typename X::value_type* ds, double eps = 1e-6) {
  static_assert(detail::same_shards<DY, X>(), "gshard::rms_norm_backward: dy and x are sharded differently");
  static_assert(std::is_floating_point_v<typename std::remove_cvref_t<X>::value_type>,
                "gshard::rms_norm: the tensor is float or double (a row's sum of bf16 needs fp32: convert it first)");
  using T = typename X::value_type;
  const index_t n = x.local().dimension(X::rank - 1);
  if (n == 0) return dy;
  T* g = dy.data();
  const T* v = x.data();
  for (index_t r = 0, rows = x.local().size() / n; r < rows; ++r, g += n, v += n) {
    const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> xv(v, n);
    const double inv = 1.0 / std::sqrt(double(xv.matrix().squaredNorm()) / double(n) + eps);
    detail::rms_norm_backward_row(g, v, inv, scale.data(), ds, n);
  }
  return dy;
}

namespace detail {

// rms_norm_backward from x rounded to bf16 (x16: this rank's elements of x,
// dy's shape) and each row's r as the forward computed it from the fp32 x
// (rms_norm_keeping): only the x in the formulas is rounded.
template <sharded_tensor DY, class Scale>
DY rms_norm_backward_rounded(DY dy, const bf16* x16, const double* inverse, const Scale& scale,
                             typename DY::value_type* ds) {
  using T = typename DY::value_type;
  const index_t n = index_t(scale.size());
  if (n == 0) return dy;
  thread_local Eigen::Array<T, Eigen::Dynamic, 1> x;
  x.resize(n);
  T* g = dy.data();
  for (index_t r = 0, rows = index_t(dy.local().size()) / n; r < rows; ++r, g += n) {
    from_bf16(x16 + r * n, std::size_t(n), x.data());
    rms_norm_backward_row(g, x.data(), inverse[r], scale.data(), ds, n);
  }
  return dy;
}

}  // namespace detail

// The tensor with its elements converted to To, on every rank's shard, the
// sharding and labels kept (x.astype(To)): to bf16 rounded to nearest even
// (a double through fp32), from bf16 exactly, others as static_cast. A
// pending sum stays pending: each summand is converted, so for bf16 the
// sum is within 2⁻⁸ of each summand's magnitude of the unrounded one.
template <class To, sharded_tensor X>
auto convert(const X& x) {
  using From = typename X::value_type;
  constexpr auto is_number = []<class U>(std::type_identity<U>) { return std::is_arithmetic_v<U> || std::is_same_v<U, bf16>; };
  static_assert(is_number(std::type_identity<To>{}) && !std::is_same_v<To, bool>,
                "gshard::convert: the element type converted to is a number type (float, double, bf16, an integer)");
  using Y = with_element<X, To>;
  typename Y::local_type y(x.local().dimensions());  // every element written below
  const std::size_t n = std::size_t(x.local().size());
  if constexpr (std::is_same_v<To, bf16> && (std::is_same_v<From, float> || std::is_same_v<From, double>))
    detail::to_bf16(x.data(), n, y.data());
  else if constexpr (std::is_same_v<From, bf16> && (std::is_same_v<To, float> || std::is_same_v<To, double>))
    detail::from_bf16(x.data(), n, y.data());
  else if constexpr (std::is_same_v<From, bf16> || std::is_same_v<To, bf16>)  // integers through fp32
    std::transform(x.data(), x.data() + n, y.data(), [](From v) { return To(float(v)); });
  else
    std::transform(x.data(), x.data() + n, y.data(), [](From v) { return To(v); });
  return Y(x.mesh(), x.extents(), std::move(y));
}

}  // namespace gshard
