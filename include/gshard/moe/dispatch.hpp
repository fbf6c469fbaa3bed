// gshard/moe/dispatch.hpp — moving tokens by gate()'s routing, on a tape:
// dispatch (tokens -> expert slots, at the groups) and combine (expert
// outputs -> tokens, weighted by the differentiable combine weights). Both
// run by index; the one-hot tensors of the paper (dense_dispatch,
// dense_combine) give the executable specification the tests compare with.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "gshard/ad/operands.hpp"
#include "gshard/ad/tape.hpp"
#include "gshard/core/bf16.hpp"
#include "gshard/moe/gate.hpp"

namespace gshard::moe {

enum class dispatch_mode : std::uint8_t { index, einsum };

namespace detail {
using gshard::detail::rlayout;

// xe[e, g, c, :] = x[g, s, :] for every dispatched choice; other slots zero.
template <class T>
void dispatch_rows(const routing<T>& r, const T* x, index_t M, T* xe) {
  const index_t G = r.groups, S = r.tokens;
  std::memset(xe, 0, sizeof(T) * std::size_t(r.experts * G * r.capacity * M));
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (!r.dispatched(c)) continue;
        std::memcpy(xe + r.slot_row(c, g) * M, x + (g * S + s) * M, sizeof(T) * std::size_t(M));
      }
}

// The transpose of dispatch_rows: dx[g,s,:] = Σ_k dxe[e_k,g,c_k,:].
template <class T>
void dispatch_rows_backward(const routing<T>& r, const T* dxe, index_t M, T* dx) {
  const index_t G = r.groups, S = r.tokens;
  std::memset(dx, 0, sizeof(T) * std::size_t(G * S * M));
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (!r.dispatched(c)) continue;
        const T* row = dxe + r.slot_row(c, g) * M;
        T* out = dx + (g * S + s) * M;
        for (index_t i = 0; i < M; ++i) out[i] += row[i];
      }
}

// y[g, s, :] = Σ_k weight_k · ye[e_k, g, c_k, :]. With `kept` (fp32 only):
// each placed choice c's row of ye also copied to kept[c·M ..] as bf16 bit
// patterns while every row copied so far was bf16 values; returns whether
// all were (then `kept` holds every placed row exactly).
template <class T>
bool combine_rows(const routing<T>& r, const T* weight, const T* ye, index_t M, T* y, std::uint16_t* kept = nullptr) {
  const index_t G = r.groups, S = r.tokens;
  bool exact = std::is_same_v<T, float> && kept != nullptr;
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s) {
      T* out = y + (g * S + s) * M;
      std::fill(out, out + M, T(0));
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const T w = weight[c];
        const T* row = ye + r.slot_row(c, g) * M;
        for (index_t i = 0; i < M; ++i) out[i] += w * row[i];
        if constexpr (std::is_same_v<T, float>)
          if (exact) exact = gshard::detail::truncate_to_bf16(row, std::size_t(M), kept + c * std::size_t(M));
      }
    }
  return exact;
}

// Whether combine's rule may keep ye's placed rows as bf16: the first
// placed choice's row holds bf16 values, or no choice is placed (nothing
// of ye is read then).
inline bool placed_rows_may_be_bf16(const routing<float>& r, const float* ye, index_t M) {
  for (std::size_t c = 0; c < r.expert.size(); ++c)
    if (r.expert[c] >= 0) {
      const float* row = ye + r.slot_row(c, r.group_of(c)) * M;
      return std::all_of(row, row + M, gshard::detail::is_bf16_value);
    }
  return true;
}

// The transpose of combine_rows: dy[e,g,c,:] = w_k · dout[g,s,:] for placed
// choices, zero elsewhere; and, when `dweight` is given, each combine
// weight's gradient dw_k = <dout[g,s,:], y[e_k,g,c_k,:]>, reading y's row
// from ye or, when given, from combine_rows' bf16 copy `kept`: the same
// values, summed in the same order.
template <class T>
void combine_rows_backward(const routing<T>& r, const T* weight, const T* dout, const T* ye, const std::uint16_t* kept,
                           index_t M, T* dy, T* dweight) {
  const index_t G = r.groups, S = r.tokens;
  std::memset(dy, 0, sizeof(T) * std::size_t(r.experts * G * r.capacity * M));
  if (dweight) std::fill(dweight, dweight + r.k * G * S, T(0));
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s)
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (r.expert[c] < 0) continue;
        const index_t at = r.slot_row(c, g) * M;
        const T* go = dout + (g * S + s) * M;
        for (index_t i = 0; i < M; ++i) dy[at + i] = weight[c] * go[i];
        if (!dweight) continue;
        T dot = 0;
        if (kept) {
          const std::uint16_t* row = kept + c * std::size_t(M);
          for (index_t i = 0; i < M; ++i) dot += go[i] * T(gshard::detail::bf16_detail::widen(row[i]));
        } else {
          for (index_t i = 0; i < M; ++i) dot += go[i] * ye[at + i];
        }
        dweight[c] = dot;
      }
}

// The one-hot tensors of the paper: combine[g,s,e,c] = weight, dispatch = (combine ≠ 0).
template <class T>
void dense_tensor(const routing<T>& r, const T* weight, T* out) {
  const index_t E = r.experts, C = r.capacity;
  std::memset(out, 0, sizeof(T) * std::size_t(r.groups * r.tokens * E * C));
  for (index_t g = 0; g < r.groups; ++g)
    for (index_t s = 0; s < r.tokens; ++s)
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        if (weight ? r.expert[c] < 0 : !r.dispatched(c)) continue;
        out[((g * r.tokens + s) * E + r.expert[c]) * C + r.slot[c]] = weight ? weight[c] : T(1);
      }
}

// Layouts: a [G,S,...] tensor's group split moved to dim `to` of a rank-R tensor.
template <class X, int From, int To, int R, fixed_string Labels>
struct moved_groups {
  static constexpr rlayout value = [] {
    rlayout l{};
    l.dims[To] = X::resolved.dims[From];
    return l;
  }();
  static constexpr gshard::detail::sharding_spec spec = gshard::detail::unresolve(value, X::mesh_type::names);
  using sharding = GSHARD_SHARDING_OF(spec);
  static constexpr auto labels = [] {
    if constexpr (X::labels.size() == 0) return fixed_string<1>{};
    else return Labels;
  }();
  using type = tensor<typename X::value_type, R, typename X::mesh_type, sharding, labels>;
};

}  // namespace detail

// The tokens x [G,S,M] (groups split) into expert slots at the groups:
// xe [E,G,C,M], G split as in x, unused slots zero. Local.
template <class L, class V>
  requires var_type<V>
auto dispatch(const gate_output<L>& g, V&& x_in) {
  using X = gshard::detail::tensor_of<V>;
  using XE = typename detail::moved_groups<X, 0, 1, 4, "EGCM">::type;
  static_assert(X::rank == 3 && X::resolved.dims[1].n == 0 && X::resolved.dims[2].n == 0 && X::resolved.partial == 0,
                "gshard::moe::dispatch: the tokens are [G,S,M] with only G split");
  const var<X> x = std::forward<V>(x_in);
  tape& t = x.on_tape();
  const routing<typename X::value_type>& r = *g.route;
  const index_t M = x.extent(2);
  XE xe(x.mesh(), {r.experts, x.extent(0), r.capacity, M});
  {
    trace::span s("dispatch", "moe");
    detail::dispatch_rows(r, x.value().data(), M, xe.data());
  }
  auto out = t.output(std::move(xe), x.tracked());
  if (out.tracked())
    t.record([tp = &t, xs = x.slot(), es = out.slot(), route = g.route, extents = x.extents(), M] {
      auto dxe = tp->slot<XE>(es).template take<typename XE::sharding_type>();
      if (!dxe) return;
      gshard::detail::gradient_of<X> dx(dxe->mesh(), extents);
      detail::dispatch_rows_backward(*route, dxe->data(), M, dx.data());
      tp->slot<X>(xs).add(std::move(dx));
    });
  return out;
}

// The expert outputs y [E,G,C,M] at the groups back into tokens [G,S,M],
// each the sum of its choices' outputs times their combine weights. Local.
// The transpose of dispatch, in its shape: the layout checked, the forward
// in a trace span, the gradient rule on the tape.
template <class L, class V>
  requires var_type<V>
auto combine(const gate_output<L>& g, V&& y_in) {
  using Y = gshard::detail::tensor_of<V>;
  using T = typename Y::value_type;
  using O = typename detail::moved_groups<Y, 1, 0, 3, "GSM">::type;
  using W = typename gate_output<L>::weights_type;
  static_assert(Y::rank == 4 && Y::resolved.dims[0].n == 0 && Y::resolved.dims[2].n == 0 && Y::resolved.dims[3].n == 0 &&
                    Y::resolved.partial == 0,
                "gshard::moe::combine: the expert outputs are [E,G,C,M] at the groups (only G split)");
  const var<Y> y = std::forward<V>(y_in);
  tape& t = y.on_tape();
  const routing<T>& r = *g.route;
  const index_t M = y.extent(3);
  O out_t(y.mesh(), {y.extent(1), r.tokens, M});
  // The weights' gradient reads each placed choice's row of y (nothing of y
  // when the weights are not tracked). When those rows are bf16 values — a
  // bf16 all_to_all wire delivers them so — the rule keeps them as bf16, one
  // row per choice: the same gradient to the bit, and the rule does not
  // hold y (the layer then frees it after the forward). Otherwise it keeps
  // y. The first placed row tells, before anything is allocated; with none
  // placed nothing of y is read.
  std::shared_ptr<std::uint16_t[]> rows;
  if constexpr (std::is_same_v<T, float>)
    if (g.weights.tracked() && detail::placed_rows_may_be_bf16(r, y.value().data(), M))
      rows = std::make_shared_for_overwrite<std::uint16_t[]>(std::max<std::size_t>(r.expert.size() * std::size_t(M), 1));
  bool kept_rows = false;
  {
    trace::span s("combine", "moe");
    kept_rows = detail::combine_rows(r, g.weights.value().data(), y.value().data(), M, out_t.data(), rows.get());
  }
  if (!kept_rows) rows.reset();
  auto out = t.output(std::move(out_t), y.tracked() || g.weights.tracked());
  if (out.tracked()) {
    std::shared_ptr<const Y> keep_y = g.weights.tracked() && !rows ? y.shared() : nullptr;
    t.record([tp = &t, os = out.slot(), ys = y.slot(), ws = g.weights.slot(), route = g.route, keep_y, rows,
              keep_w = g.weights.shared(), extents = y.extents(), M] {
      auto dout = tp->slot<O>(os).template take<typename O::sharding_type>();
      if (!dout) return;
      gshard::detail::gradient_of<Y> dy(dout->mesh(), extents);
      std::optional<gshard::detail::gradient_of<W>> dw;
      if (ws >= 0) dw.emplace(keep_w->mesh(), keep_w->extents());
      detail::combine_rows_backward(*route, keep_w->data(), dout->data(), keep_y ? keep_y->data() : nullptr, rows.get(), M,
                                    dy.data(), dw ? dw->data() : nullptr);
      if (ys >= 0) tp->slot<Y>(ys).add(std::move(dy));
      if (dw) tp->slot<W>(ws).add(std::move(*dw));
    });
  }
  return out;
}

// The paper's one-hot tensors [G,S,E,C]: dispatch (a constant) and combine
// (the combine weights at their slots, differentiable), for the einsum form
//   einsum<"GSEC,GSM->EGCM">(dispatch, x), einsum<"GSEC,EGCM->GSM">(combine, y).
template <class L>
auto dense_dispatch(const gate_output<L>& g) {
  using D = typename detail::moved_groups<L, 0, 0, 4, "GSEC">::type;
  const auto& w = g.weights;
  const routing<typename L::value_type>& r = *g.route;
  D d(w.mesh(), {w.extent(0), r.tokens, r.experts, r.capacity});
  detail::dense_tensor(r, static_cast<const typename L::value_type*>(nullptr), d.data());
  return w.on_tape().constant(std::move(d));
}
template <class L>
auto dense_combine(const gate_output<L>& g) {
  using T = typename L::value_type;
  using D = typename detail::moved_groups<L, 0, 0, 4, "GSEC">::type;
  using W = typename gate_output<L>::weights_type;
  const auto& w = g.weights;
  tape& t = w.on_tape();
  const routing<T>& r = *g.route;
  D d(w.mesh(), {w.extent(0), r.tokens, r.experts, r.capacity});
  detail::dense_tensor(r, w.value().data(), d.data());
  auto out = t.output(std::move(d), w.tracked());
  if (out.tracked())
    t.record([tp = &t, ds = out.slot(), ws = w.slot(), route = g.route, extents = w.extents()] {
      auto dd = tp->slot<D>(ds).template take<typename D::sharding_type>();
      if (!dd) return;
      const routing<T>& r = *route;
      gshard::detail::gradient_of<W> dw(dd->mesh(), extents);
      for (index_t gi = 0; gi < r.groups; ++gi)
        for (index_t s = 0; s < r.tokens; ++s)
          for (int k = 0; k < r.k; ++k) {
            const std::size_t c = r.choice(gi, s, k);
            if (r.expert[c] >= 0)
              dw.data()[c] = dd->data()[((gi * r.tokens + s) * r.experts + r.expert[c]) * r.capacity + r.slot[c]];
          }
      tp->slot<W>(ws).add(std::move(dw));
    });
  return out;
}

}  // namespace gshard::moe
