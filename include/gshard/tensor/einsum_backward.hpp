// gshard/tensor/einsum_backward.hpp — the gradient of an einsum, tested by finite
// differences; the tape (gshard/ad/) composes it. The gradient of an
// einsum is an einsum: for Z = einsum<"A,B->O">(a, b), dA = einsum<"O,B->A">(dz, b)
// and dB = einsum<"O,A->B">(dz, a), the specs derived at compile time (a
// label summed in one operand alone is broadcast back). Each comes out in its
// natural sharding — a weight replicated over the ranks that split the batch
// gets a pending sum, whose reduction is the data-parallel all_reduce — and
// einsum_backward reshards it to the operand's sharding unless asked
// otherwise.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

#include "gshard/tensor/einsum.hpp"
#include "gshard/tensor/reshard.hpp"

namespace gshard {

namespace detail {

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
// the other operand (nullptr for a one-operand einsum). dz and the other
// operand may be bf16 roundings of an fp32 einsum's (ad/communication.hpp):
// the contraction then multiplies them into fp32, XA's element type.
template <fixed_string Spec, int K, class XA, class DZ, class Other>
auto einsum_operand_grad(const DZ& dz, const Other* other, const typename XA::extents_type& ea) {
  using G = einsum_grad<Spec, K>;
  using T = typename XA::value_type;
  auto contract = [&] {
    if constexpr (G::dz_is_grad) return dz;
    else if constexpr (G::scalar_dz) {
      auto g = einsum<G::spec, natural_sharding, T>(*other);
      g.local() = g.local() * T(dz.local()());
      return g;
    } else if constexpr (G::two) return einsum<G::spec, natural_sharding, T>(dz, *other);
    else return einsum<G::spec, natural_sharding, T>(dz);
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

}  // namespace gshard
