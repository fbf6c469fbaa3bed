// gshard/grad.hpp — the gradient rules of the operations, each tested by
// finite differences; the tape (gshard/ad/) composes them. The gradient of an
// einsum is an einsum: for Z = einsum<"A,B->O">(a, b), dA = einsum<"O,B->A">(dz, b)
// and dB = einsum<"O,A->B">(dz, a), the specs derived at compile time (a
// label summed in one operand alone is broadcast back). Each comes out in its
// natural sharding — a weight replicated over the ranks that split the batch
// gets a pending sum, whose reduction is the data-parallel all_reduce — and
// einsum_backward reshards it to the operand's sharding unless asked
// otherwise. The gradient of a reshard is a reshard to gradient_sharding<From>
// (the sharding without its pending sums), the forward's collectives
// transposed. Also: relu, softmax and the RMS norm, element-wise and local.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "gshard/einsum.hpp"
#include "gshard/ops.hpp"
#include "gshard/reshard.hpp"

namespace gshard {

namespace detail {
template <class S>
struct gradient_spec {  // S without its pending sums
  static constexpr sharding_spec value = [] {
    sharding_spec g = S::spec;
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
    GSHARD_SHARDING_OF(detail::gradient_spec<S>::value);

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

template <class X>
using gradient_of = tensor<typename X::value_type, X::rank, typename X::mesh_type, gradient_sharding<typename X::sharding_type>>;

// A gradient and its primal: the same global shape and the same split dims
// (the gradient holds no pending sums; labels may differ).
template <class DY, class X>
constexpr bool same_shards() {
  rlayout a = DY::resolved, b = X::resolved;
  a.partial = b.partial = 0;
  return DY::rank == X::rank && a == b && std::is_same_v<typename DY::value_type, typename X::value_type>;
}

// Einsum gradients. For operand K with term A, the output term O and the
// other operand's term B: dA = einsum<"O,B->A">(dz, b) when every label of A
// is in O or B. Labels summed in A alone (in no other term) come back by a
// local broadcast of the gradient of A's other labels.

template <fixed_string Spec, int K>
struct einsum_grad {
  static constexpr einsum_spec s = parse_einsum(Spec.view());
  static constexpr bool two = s.nin == 2;
  static constexpr std::string_view A = s.term(K);
  static constexpr std::string_view O = s.out_term();
  static constexpr std::string_view B = two ? s.term(1 - K) : std::string_view{};
  static constexpr bool kept(char l) { return O.find(l) != std::string_view::npos || B.find(l) != std::string_view::npos; }
  struct text {
    char c[3 * max_rank + 4]{};
    std::size_t n = 0;
    constexpr void add(std::string_view v) {
      for (char ch : v) c[n++] = ch;
    }
    constexpr std::string_view view() const { return {c, n}; }
  };
  static constexpr text kept_term = [] {  // A': A's labels in O or B, in A's order
    text t;
    for (char l : A)
      if (kept(l)) t.c[t.n++] = l;
    return t;
  }();
  static constexpr std::string_view Akept = kept_term.view();
  static constexpr bool broadcast = Akept.size() != A.size();
  static constexpr bool scalar_dz = O.empty();
  static constexpr bool dz_is_grad = scalar_dz && !two;  // "->A'" with A' empty: dz itself
  // The contraction onto A': "O,B->A'" (dz first), "O->A'", or "B->A'" times a scalar dz.
  static constexpr text contraction = [] {
    text b;
    if (!scalar_dz) {
      b.add(O);
      if (two) {
        b.add(",");
        b.add(B);
      }
    } else if (two) {
      b.add(B);
    }
    b.add("->");
    b.add(Akept);
    return b;
  }();
  static constexpr auto spec = to_fixed<contraction.n>(contraction.view());
  static constexpr auto term = to_fixed<A.size()>(A);
  static constexpr auto kept_labels = to_fixed<Akept.size()>(Akept);
};

// x's local shard broadcast along the dims of `to_term` that `from_term`
// lacks; the shared dims keep their order and local extents.
template <class T>
void broadcast_dims(const T* x, std::string_view from_term, const index_t* from_ext, T* out, std::string_view to_term,
                    const index_t* to_ext) {
  const int R = int(to_term.size());
  index_t stride[max_rank] = {};  // stride in x of each dim of `to` (0 for a broadcast dim)
  index_t s = 1;
  for (int d = int(from_term.size()) - 1; d >= 0; --d) {
    stride[int(to_term.find(from_term[std::size_t(d)]))] = s;
    s *= from_ext[d];
  }
  index_t total = 1;
  for (int d = 0; d < R; ++d) total *= to_ext[d];
  index_t pos[max_rank] = {};
  for (index_t i = 0; i < total; ++i) {
    index_t at = 0;
    for (int d = 0; d < R; ++d) at += pos[d] * stride[d];
    out[i] = x[at];
    for (int d = R - 1; d >= 0 && ++pos[d] == to_ext[d]; --d) pos[d] = 0;
  }
}

// A's kept dims in A's gradient layout, with the pending sums of `from`
// (on axes that layout does not split): where the contraction onto A' goes.
template <class XA, class G, class From>
struct kept_layout {
  using Mesh = typename XA::mesh_type;
  static constexpr rlayout ga = bind_layout<Mesh, XA::rank, gradient_sharding<typename XA::sharding_type>>::value;
  static constexpr rlayout value = [] {
    rlayout l{};
    int k = 0;
    for (int d = 0; d < int(G::A.size()); ++d)
      if (G::kept(G::A[std::size_t(d)])) l.dims[k++] = ga.dims[d];
    l.partial = From::resolved.partial & ~l.split_mask();
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, Mesh::names);
  using type = GSHARD_SHARDING_OF(spec);
  static constexpr rlayout full = [] {  // A's gradient layout with the same pending sums
    rlayout l = ga;
    l.partial = value.partial;
    return l;
  }();
  static constexpr sharding_spec full_spec = unresolve(full, Mesh::names);
  using full_type = GSHARD_SHARDING_OF(full_spec);
};

// The gradient contribution to operand K (type XA, global extents `ea`) of
// einsum<Spec>: from dz, in the gradient sharding of the natural output, and
// the other operand (nullptr for a one-operand einsum).
template <fixed_string Spec, int K, class XA, class DZ, class Other>
auto einsum_operand_grad(const DZ& dz, const Other* other, const typename XA::extents_type& ea) {
  using G = einsum_grad<Spec, K>;
  auto contract = [&] {
    if constexpr (G::dz_is_grad) return dz;
    else if constexpr (G::scalar_dz) {
      auto g = einsum<G::spec>(*other);
      g.local() = g.local() * dz.local()();
      return g;
    } else if constexpr (G::two) return einsum<G::spec>(dz, *other);
    else return einsum<G::spec>(dz);
  };
  if constexpr (!G::broadcast) {
    return contract();
  } else {
    auto reduced = contract();
    using K_ = kept_layout<XA, G, decltype(reduced)>;
    const auto r = reshard<typename K_::type>(std::move(reduced));
    tensor<typename XA::value_type, XA::rank, typename XA::mesh_type, typename K_::full_type> out(r.mesh(), ea);
    const auto re = r.local_extents();
    const auto oe = out.local_extents();
    broadcast_dims(r.data(), G::Akept, re.data(), out.data(), G::A, oe.data());
    return out;
  }
}

}  // namespace detail

// The sharding of the operand a gradient belongs to (einsum_backward's default).
struct operand_sharding {};

// dA and dB of Z = einsum<Spec>(a, b) for the gradient dz of Z, each in its
// operand's sharding unless DA / DB name another (natural_sharding: as
// computed, e.g. still partial, to sum several contributions before one
// reduction). A label summed in one operand alone gets a broadcast gradient.
template <fixed_string Spec, class DA = operand_sharding, class DB = operand_sharding, sharded_tensor DZ,
          sharded_tensor A, sharded_tensor B>
auto einsum_backward(const DZ& dz, const A& a, const B& b) {
  auto finish = []<class Out, class X>(std::type_identity<Out>, std::type_identity<X>, auto&& g) {
    if constexpr (std::is_same_v<Out, natural_sharding>) return std::move(g);
    else return reshard<std::conditional_t<std::is_same_v<Out, operand_sharding>, typename X::sharding_type, Out>>(std::move(g));
  };
  return std::pair{finish(std::type_identity<DA>{}, std::type_identity<A>{}, detail::einsum_operand_grad<Spec, 0, A>(dz, &b, a.extents())),
                   finish(std::type_identity<DB>{}, std::type_identity<B>{}, detail::einsum_operand_grad<Spec, 1, B>(dz, &a, b.extents()))};
}

// dy where x > 0, else 0 (a NaN x passes dy, as relu keeps the NaN), where
// the forward was y = relu(x): the tape's relu mask (detail/blockwise.hpp).
template <sharded_tensor DY, sharded_tensor X>
DY relu_backward(DY dy, const X& x) {
  static_assert(detail::same_shards<DY, X>(), "gshard::relu_backward: dy and x are sharded differently");
  detail::zero_where_at_most(dy.data(), x.data(), typename X::value_type(0), dy.local().size());
  return dy;
}

// dx = y · (dy − Σ_last dy·y), where the forward was y = softmax(x) over the last dim.
template <sharded_tensor DY, sharded_tensor Y>
DY softmax_backward(DY dy, const Y& y) {
  static_assert(detail::same_shards<DY, Y>(), "gshard::softmax_backward: dy and y are sharded differently");
  const index_t n = DY::rank ? dy.local().dimension(DY::rank - 1) : 1;
  if (n == 0) return dy;
  auto* g = dy.data();
  const auto* p = y.data();
  for (index_t row = 0, rows = dy.local().size() / n; row < rows; ++row, g += n, p += n) detail::softmax_row_backward(g, p, n);
  return dy;
}

// dx = scale · y · (dy − Σ_t dy·y) over each row's unmasked entries (t <= l)
// and 0 above the diagonal, where the forward was y = causal_softmax(x, scale).
template <sharded_tensor DY, sharded_tensor Y>
DY causal_softmax_backward(DY dy, const Y& y, double scale) {
  static_assert(detail::same_shards<DY, Y>(), "gshard::causal_softmax_backward: dy and y are sharded differently");
  using T = typename DY::value_type;
  T* g = dy.data();
  const T* p = y.data();
  detail::causal_rows(dy.local_extents(), [&](index_t at, index_t kept, index_t n) {
    detail::softmax_row_backward(g + at, p + at, kept, T(scale));
    std::fill(g + at + kept, g + at + n, T(0));
  });
  return dy;
}

// The RMS norm y = x · r · s, r = (mean(x²) + eps)^-1/2, over the last dim:
// dx = s·r·dy − x·r³·mean(dy·s·x), and the scale's gradient Σ_rows dy·x·r,
// which is a pending sum over the ranks that split the rows; `ds` receives
// this rank's summand (the caller reduces it). Rows of float and double take
// Eigen's packets, as the forward's.
template <sharded_tensor DY, sharded_tensor X, class Scale>
DY rms_norm_backward(DY dy, const X& x, const Scale& scale, typename X::value_type* ds, double eps = 1e-6) {
  static_assert(detail::same_shards<DY, X>(), "gshard::rms_norm_backward: dy and x are sharded differently");
  using T = typename X::value_type;
  const index_t n = x.local().dimension(X::rank - 1);
  if (n == 0) return dy;
  using row = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const row> s(scale.data(), n);
  Eigen::Map<row> dsum(ds, n);
  T* g = dy.data();
  const T* v = x.data();
  for (index_t r = 0, rows = x.local().size() / n; r < rows; ++r, g += n, v += n) {
    Eigen::Map<row> gv(g, n);
    const Eigen::Map<const row> xv(v, n);
    const double inv = 1.0 / std::sqrt(double(xv.matrix().squaredNorm()) / double(n) + eps);
    const double c = inv * inv * inv * double((gv * s * xv).sum()) / double(n);
    dsum += gv * xv * T(inv);
    gv = s * T(inv) * gv - xv * T(c);
  }
  return dy;
}

}  // namespace gshard
