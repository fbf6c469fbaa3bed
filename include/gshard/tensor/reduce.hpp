// gshard/tensor/reduce.hpp — the maximum, minimum or sum of a sharded tensor over one
// dim. Each rank reduces its shard; where the dim is split over mesh axes,
// the maximum and minimum end in one all_reduce(max or min) over them (the
// result is then replicated there), while the sum stays pending over them —
// a partial sharding, settled by the caller's all_reduce or reduce_scatter,
// as an einsum's contraction does. The reduced dim leaves the type; the
// result is unlabelled.
//   auto m = reduce_max<1>(x);   // f32[B{data},E{expert}] -> f32[B{data}], one all_reduce(max) over expert
#pragma once

#include <limits>
#include <span>
#include <type_traits>

#include "gshard/runtime/collectives.hpp"
#include "gshard/tensor/ops.hpp"
#include "gshard/tensor/reshard.hpp"
#include "gshard/tensor/tensor.hpp"

namespace gshard {

namespace detail {

// The type of X reduced over Dim: the other dims keep their axes; the
// reduced dim's axes become pending sums (sum) or are dropped (max, min).
template <class X, int Dim, bool Sum>
struct reduced {
  static_assert(Dim >= 0 && Dim < X::rank, "gshard::reduce: the dim is out of range");
  static_assert(!has_pending_sums<X>(),
                "gshard::reduce: the tensor has pending sums; all_reduce or reduce_scatter it first");
  static constexpr bool ok = Dim >= 0 && Dim < X::rank;
  static constexpr std::uint32_t axes = ok ? axis_set(X::resolved.dims[Dim]) : 0;
  static constexpr rlayout value = [] {
    rlayout l{};
    for (int d = 0, o = 0; d < X::rank; ++d)
      if (d != Dim) l.dims[o++] = X::resolved.dims[d];
    l.partial = Sum ? axes : 0;
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, X::mesh_type::names);
  using type = tensor<typename X::value_type, ok ? X::rank - 1 : 0, typename X::mesh_type,
                      GSHARD_SHARDING_OF(spec)>;
};

// This rank's shard of x seen as [outer, n, inner] around dim Dim: element
// (o, k, i) is at (o * n + k) * inner + i.
struct around_dim {
  index_t outer = 1, n = 1, inner = 1;
};
template <int Dim, class X>
around_dim shard_around(const X& x) {
  const auto le = x.local_extents();
  around_dim g;
  for (int d = 0; d < Dim; ++d) g.outer *= le[std::size_t(d)];
  for (int d = Dim + 1; d < X::rank; ++d) g.inner *= le[std::size_t(d)];
  g.n = le[std::size_t(Dim)];
  return g;
}

// The local shard [outer, n, inner] reduced over n with op (first, then
// op(acc, v)), accumulated in A and rounded once to the element type;
// `init` for an empty n.
template <class X, int Dim, class Y, class A, class Op>
Y reduce_local(const X& x, A init, Op op) {
  using T = typename X::value_type;
  typename Y::extents_type out{};
  for (int d = 0, o = 0; d < X::rank; ++d)
    if (d != Dim) out[std::size_t(o++)] = x.extent(d);
  const auto [outer, n, inner] = shard_around<Dim>(x);
  Y y(x.mesh(), out);
  T* py = y.data();
  const T* px = x.data();
  for (index_t o = 0; o < outer; ++o)
    for (index_t i = 0; i < inner; ++i) {
      A acc = init;
      for (index_t k = 0; k < n; ++k) acc = op(acc, px[(o * n + k) * inner + i]);
      py[o * inner + i] = T(acc);
    }
  return y;
}

template <int Dim, reduction R, class X>
auto reduce_extreme(const X& x) {
  using T = typename X::value_type;
  using info = reduced<X, Dim, false>;
  using Y = typename info::type;
  constexpr bool is_max = R == reduction::max;
  const T init = std::numeric_limits<T>::has_infinity ? (is_max ? -std::numeric_limits<T>::infinity()
                                                                : std::numeric_limits<T>::infinity())
                                                      : (is_max ? std::numeric_limits<T>::lowest() : std::numeric_limits<T>::max());
  Y y = reduce_local<X, Dim, Y, T>(x, init, [](T a, T v) { return is_max ? (v > a ? v : a) : (v < a ? v : a); });
  if constexpr (info::axes != 0) all_reduce(x.mesh().group(info::axes), std::span<T>(y.data(), std::size_t(y.local().size())), R);
  return y;
}

}  // namespace detail

// max over dim Dim. A NaN never compares greater, so it is skipped; an
// empty or all-NaN dim gives -inf. A split dim: one all_reduce(max) over its
// axes. On a tape (ad/ops.hpp) with its gradient.
template <int Dim, sharded_tensor X>
auto reduce_max(const X& x) {
  return detail::reduce_extreme<Dim, reduction::max>(x);
}

// min over dim Dim, as reduce_max (an empty dim gives +inf).
template <int Dim, sharded_tensor X>
auto reduce_min(const X& x) {
  return detail::reduce_extreme<Dim, reduction::min>(x);
}

// sum over dim Dim (in sum_t: bf16's in fp32, rounded once): no
// communication; where Dim is split, the result holds pending sums over its
// axes (all_reduce<"axis">(s) settles them).
template <int Dim, sharded_tensor X>
auto reduce_sum(const X& x) {
  using T = typename X::value_type;
  using A = sum_t<T>;
  using Y = typename detail::reduced<X, Dim, true>::type;
  return detail::reduce_local<X, Dim, Y, A>(x, A(0), [](A a, T v) { return a + A(v); });
}

}  // namespace gshard
