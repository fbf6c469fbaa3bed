// gshard/grad.hpp — gradients. The gradient of an einsum is an einsum: for
// Z = einsum<"A,B->O">(a, b), dA = einsum<"O,B->A">(dZ, b) and
// dB = einsum<"A,O->B">(a, dZ), with the specs derived at compile time. By
// default each gradient comes back in its operand's sharding, so the
// communication is the transpose of the forward's, chosen by the types: a
// weight replicated over the ranks that split the batch gets a pending sum,
// and asking for it replicated is the data-parallel all_reduce (a caller may
// ask for another sharding, e.g. natural_sharding to sum several partial
// gradients before one reduction). Also: relu, softmax and the RMS norm
// backward, element-wise and local.
#pragma once

#include <cmath>

#include "gshard/einsum.hpp"
#include "gshard/ops.hpp"

namespace gshard {
namespace detail {

// The spec of an operand's gradient: "O,B->A" for operand 0, "A,O->B" for 1.
template <fixed_string Spec, int Operand>
consteval auto grad_spec() {
  constexpr einsum_spec s = parse_einsum(Spec.view());
  fixed_string<Spec.size() + 1> out;
  std::size_t n = 0;
  auto put = [&](std::string_view v) {
    for (char c : v) out.data[n++] = c;
  };
  if constexpr (Operand == 0) {
    put(s.out_term());
    if (s.nin == 2) {
      put(",");
      put(s.term(1));
    }
    put("->");
    put(s.term(0));
  } else {
    put(s.term(0));
    put(",");
    put(s.out_term());
    put("->");
    put(s.term(1));
  }
  while (n <= Spec.size()) out.data[n++] = '\0';
  return out;
}

template <fixed_string Spec, int Operand>
constexpr bool grad_is_einsum() {
  constexpr einsum_spec s = parse_einsum(Spec.view());
  for (int d = 0; d < s.in_rank[Operand]; ++d) {
    const char l = s.in[Operand][d];
    if (s.find_out(l) < 0 && (s.nin < 2 || s.find(1 - Operand, l) < 0)) return false;
  }
  return true;
}

}  // namespace detail

// The sharding of the operand a gradient belongs to (einsum_backward's default).
struct operand_sharding {};

// dA and dB of Z = einsum<Spec>(a, b), each in its operand's sharding unless
// DA / DB name another (natural_sharding: as computed, e.g. still partial,
// to sum several contributions before one reduction).
template <fixed_string Spec, class DA = operand_sharding, class DB = operand_sharding, sharded_tensor DZ,
          sharded_tensor A, sharded_tensor B>
auto einsum_backward(const DZ& dz, const A& a, const B& b) {
  static_assert(detail::grad_is_einsum<Spec, 0>() && detail::grad_is_einsum<Spec, 1>(),
                "gshard::einsum_backward: a label appears in one operand only; its gradient is a broadcast, not an einsum");
  constexpr auto spec_a = detail::grad_spec<Spec, 0>();
  constexpr auto spec_b = detail::grad_spec<Spec, 1>();
  using out_a = std::conditional_t<std::is_same_v<DA, operand_sharding>, typename A::sharding_type, DA>;
  using out_b = std::conditional_t<std::is_same_v<DB, operand_sharding>, typename B::sharding_type, DB>;
  auto da = einsum<spec_a, out_a>(dz, b);
  auto db = einsum<spec_b, out_b>(a, dz);
  return std::pair{std::move(da), std::move(db)};
}

namespace detail {
// A gradient and its primal: the same global shape and the same split dims
// (the gradient holds no pending sums; labels may differ).
template <class DY, class X>
constexpr bool same_shards() {
  rlayout a = DY::layout, b = X::layout;
  a.partial = b.partial = 0;
  return DY::rank == X::rank && a == b && std::is_same_v<typename DY::value_type, typename X::value_type>;
}
}  // namespace detail

// dy · [x > 0], where the forward was y = relu(x).
template <sharded_tensor DY, sharded_tensor X>
DY relu_backward(DY dy, const X& x) {
  static_assert(detail::same_shards<DY, X>(), "gshard::relu_backward: dy and x are sharded differently");
  auto* g = dy.data();
  const auto* v = x.data();
  for (index_t i = 0, n = dy.local().size(); i < n; ++i)
    if (!(v[i] > 0)) g[i] = 0;
  return dy;
}

// dx = y · (dy − Σ_last dy·y), where the forward was y = softmax(x) over the last dim.
template <sharded_tensor DY, sharded_tensor Y>
DY softmax_backward(DY dy, const Y& y) {
  static_assert(detail::same_shards<DY, Y>(), "gshard::softmax_backward: dy and y are sharded differently");
  using T = typename DY::value_type;
  const index_t n = DY::rank ? dy.local().dimension(DY::rank - 1) : 1;
  if (n == 0) return dy;
  T* g = dy.data();
  const T* p = y.data();
  for (index_t row = 0, rows = dy.local().size() / n; row < rows; ++row, g += n, p += n) {
    T dot = 0;
    for (index_t i = 0; i < n; ++i) dot += g[i] * p[i];
    for (index_t i = 0; i < n; ++i) g[i] = p[i] * (g[i] - dot);
  }
  return dy;
}

// The RMS norm y = x · r · s, r = (mean(x²) + eps)^-1/2, over the last dim:
// dx = s·r·dy − x·r³·mean(dy·s·x), and the scale's gradient Σ_rows dy·x·r,
// which is a pending sum over the ranks that split the rows; `ds` receives
// this rank's summand (the caller reduces it).
template <sharded_tensor DY, sharded_tensor X, class Scale>
DY rms_norm_backward(DY dy, const X& x, const Scale& scale, typename X::value_type* ds, double eps = 1e-6) {
  static_assert(detail::same_shards<DY, X>(), "gshard::rms_norm_backward: dy and x are sharded differently");
  using T = typename X::value_type;
  const index_t n = x.local().dimension(X::rank - 1);
  if (n == 0) return dy;
  T* g = dy.data();
  const T* v = x.data();
  const T* s = scale.data();
  for (index_t row = 0, rows = x.local().size() / n; row < rows; ++row, g += n, v += n) {
    double ss = 0, dot = 0;
    for (index_t i = 0; i < n; ++i) {
      ss += double(v[i]) * double(v[i]);
      dot += double(g[i]) * double(s[i]) * double(v[i]);
    }
    const double r = 1.0 / std::sqrt(ss / double(n) + eps);
    const double c = r * r * r * dot / double(n);
    for (index_t i = 0; i < n; ++i) {
      ds[i] += T(double(g[i]) * double(v[i]) * r);
      g[i] = T(double(s[i]) * r * double(g[i]) - double(v[i]) * c);
    }
  }
  return dy;
}

}  // namespace gshard
