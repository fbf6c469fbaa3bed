// gshard/moe/gate.hpp — moe::gate on a tape: router logits [G,S,E] to the
// routing of this rank's groups, the combine weights (differentiable), the
// aux loss and the z-loss, and the counters of every group (one all_reduce).
// The router learns through the combine weights and the losses, never
// through the discrete choices.
//   auto r = moe::gate(einsum<"GSM,ME->GSE">(x, router), cfg, stream);
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "gshard/ad/communication.hpp"
#include "gshard/ad/operands.hpp"
#include "gshard/ad/tape.hpp"
#include "gshard/moe/gating.hpp"
#include "gshard/moe/stats.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard::moe {

namespace detail {
// This rank's groups routed: each token's experts chosen, the capacity
// agreed (dropless: the largest load of any group, one all_reduce of a
// maximum over `groups`, the ranks that hold different groups), the choices
// placed in slots. Returns this rank's counters.
template <class T>
gating_stats route_local_groups(const T* logits, index_t Gl, index_t S, index_t E, index_t group_offset,
                                std::uint64_t stream, const gating_config& cfg, const double* bias, bool training,
                                const gshard::detail::axis_group& groups, routing<T>& route, const T* paddings,
                                routing_state* state) {
  trace::span s("gating", "moe");
  if (state && cfg.order != placement::by_token)
    throw error("gshard::moe::gate: a routing_state carries on placement::by_token routing; this gating places by_choice");
  if (state && index_t(state->filled.size()) != Gl * E)
    throw error("gshard::moe::gate: the routing_state counts " + std::to_string(state->filled.size()) +
                " group-expert pairs; these logits hold " + std::to_string(Gl) + " groups of " + std::to_string(E) +
                " experts on this rank (moe::start_routing(cfg, E, length, groups))");
  gating_stats local =
      choose_experts<T>(logits, Gl, S, E, group_offset, stream, cfg, bias, route, paddings, state ? state->position : 0);
  index_t C = 0;
  if (state) {  // this call's slots: at most one choice per token and expert
    C = state->dropless ? S : std::min(S, state->capacity);
  } else if (cfg.dropless) {
    std::vector<double> most{double(largest_load(route))};
    all_reduce<double>(groups, most, reduction::max);  // the same capacity on every rank
    C = std::max<index_t>(index_t(most[0]), 1);
  } else {
    C = capacity(S, E, cfg, !training && cfg.eval_capacity_factor > 0 ? cfg.eval_capacity_factor : cfg.capacity_factor);
  }
  place_choices(route, C, local, state);
  return local;
}

}  // namespace detail

// What gate() decided, for dispatch and combine: the routing (constant), the
// combine weight of each (token, choice) [G,S,k] as a differentiable value,
// the aux loss and the router z-loss (replicated) and the counters of every
// group.
template <class Logits>
struct gate_output {
  using T = typename Logits::value_type;
  using Mesh = typename Logits::mesh_type;
  using weights_type = tensor<T, 3, Mesh, typename Logits::sharding_type>;
  using scalar = var<tensor<double, 0, Mesh, replicate>>;
  std::shared_ptr<const routing<T>> route;
  var<weights_type> weights;
  scalar aux;          // GShard's aux loss: 1 when balanced
  scalar z_loss;       // mean over the valid tokens of logsumexp(logits)²
  gating_stats stats;  // summed over every group of the mesh
  index_t groups = 0;  // global G
};

namespace detail {
// gate() with this rank's paddings (G_local·S values, or null); random
// routing keys this rank's first group by `first_group_override` when it is
// >= 0 (a micro-batch's rows keep their index in the whole batch).
template <class V>
auto gate_impl(V&& logits_in, const typename gshard::detail::tensor_of<V>::value_type* paddings, const gating_config& cfg,
               std::uint64_t stream, const double* bias, bool training, routing_state* state = nullptr,
               index_t first_group_override = -1) {
  using X = gshard::detail::tensor_of<V>;
  using T = typename X::value_type;
  using Mesh = typename X::mesh_type;
  static_assert(X::rank == 3 && X::resolved.dims[1].n == 0 && X::resolved.dims[2].n == 0 && X::resolved.partial == 0,
                "gshard::moe::gate: the router logits are [G,S,E] with only G split and no pending sums");
  const var<X> logits = std::forward<V>(logits_in);
  tape& t = logits.on_tape();
  const X& lg = logits.value();
  const index_t G = lg.extent(0), S = lg.extent(1), E = lg.extent(2), Gl = lg.local_extents()[0];
  const auto& groups = lg.mesh().group(X::resolved.split_mask());  // the ranks that hold different groups
  // Paddings other than 0 and 1, counted here and refused on every rank
  // once the counters' all_reduce has summed them.
  double bad_paddings = 0;
  if (paddings)
    for (index_t i = 0; i < Gl * S; ++i) bad_paddings += paddings[i] != T(0) && paddings[i] != T(1) ? 1.0 : 0.0;
  auto route = std::make_shared<routing<T>>();
  const index_t first_group = first_group_override >= 0      ? first_group_override
                              : state && state->first_group >= 0 ? state->first_group
                                                                 : lg.offsets()[0];
  const gating_stats local = route_local_groups<T>(lg.data(), Gl, S, E, first_group, stream, cfg, bias, training,
                                                   groups, *route, paddings, state);
  using weights_t = typename gate_output<X>::weights_type;
  using scalar_t = tensor<double, 0, Mesh, replicate>;
  const int k = route->k;
  weights_t w(lg.mesh(), {G, S, k});
  std::copy(route->weight.begin(), route->weight.end(), w.data());
  // One all_reduce over the ranks that hold different groups.
  std::vector<double> sv = detail::stats_vector(local);
  sv.push_back(bad_paddings);
  typename gshard::detail::sum_over_shards<X, 1, double>::type partial(lg.mesh(), {index_t(sv.size())});
  std::copy(sv.begin(), sv.end(), partial.data());
  const auto total = reshard<replicate>(std::move(partial));
  if (const double bad = total.data()[sv.size() - 1]; bad > 0)
    throw error("gshard::moe::gate: " + std::to_string(std::int64_t(bad)) + " of the " + std::to_string(G * S) +
                " paddings are neither 0 (a token) nor 1 (padding)");
  gating_stats stats = detail::stats_from(total.data(), std::size_t(E), std::size_t(k), route->capacity);
  const double valid = double(stats.tokens - stats.invalid);
  scalar_t aux(lg.mesh(), {}), z(lg.mesh(), {});
  aux.local()() = G > 0 ? stats.aux_sum / double(G) : 0.0;
  z.local()() = valid > 0 ? stats.z_sum / valid : 0.0;
  gate_output<X> out{route, t.output(std::move(w), logits.tracked()), t.output(std::move(aux), logits.tracked()),
                     t.output(std::move(z), logits.tracked()), std::move(stats), G};
  if (logits.tracked())
    t.record([tp = &t, ls = logits.slot(), ws = out.weights.slot(), as = out.aux.slot(), zs = out.z_loss.slot(), route, G,
              valid, extents = lg.extents()] {
      auto dw = tp->slot<weights_t>(ws).template take<typename weights_t::sharding_type>();
      auto da = tp->slot<scalar_t>(as).template take<replicate>();
      auto dz = tp->slot<scalar_t>(zs).template take<replicate>();
      if (!dw && !da && !dz) return;
      std::vector<T> dweight(route->weight.size(), T(0));
      if (dw) std::copy(dw->data(), dw->data() + dweight.size(), dweight.begin());
      gshard::detail::gradient_of<X> dlogits(tp->slot<X>(ls).mesh(), extents);
      gating_backward(*route, dweight, da ? da->local()() : 0.0, G, dz ? dz->local()() : 0.0, valid, dlogits.data());
      tp->slot<X>(ls).add(std::move(dlogits));
    });
  return out;
}
}  // namespace detail

// Top-k gating of router logits [G,S,E] (groups split, S and E whole;
// computed in T, at least float). `bias` (E values, or null) shifts the
// scores for the choice only (balance_mode::bias); `training` false selects
// the evaluation capacity factor. One all_reduce over the axes that split
// the groups sums the counters, the aux loss and the z-loss; dropless
// routing first agrees the capacity — the largest load of any group —
// with one all_reduce of a maximum over the same axes, so every rank moves
// tensors of one shape.
template <class V>
  requires var_type<V>
auto gate(V&& logits, const gating_config& cfg, std::uint64_t stream, const double* bias = nullptr, bool training = true) {
  return detail::gate_impl(std::forward<V>(logits), nullptr, cfg, stream, bias, training);
}

// Routing the next positions of sequences routed before (incremental
// decoding): `state` (moe::start_routing) carries the capacity and each
// expert's count from the earlier calls, so the calls together route as one
// call over the whole sequences would with placement::by_token.
template <class V>
  requires var_type<V>
auto gate(V&& logits, routing_state& state, const gating_config& cfg, std::uint64_t stream, const double* bias = nullptr) {
  return detail::gate_impl(std::forward<V>(logits), nullptr, cfg, stream, bias, false, &state);
}

// The same with `paddings` [G,S], split like the logits' groups: 1 marks a
// padded position, 0 a token (Lingvo's paddings). A padded position chooses
// no expert, takes no slot, adds nothing to the losses or the counters
// (moe/gating.hpp); any other value is refused on every rank.
template <class V, class P>
  requires var_type<V> && sharded_tensor<P>
auto gate(V&& logits, const P& paddings, const gating_config& cfg, std::uint64_t stream, const double* bias = nullptr,
          bool training = true) {
  using X = gshard::detail::tensor_of<V>;
  static_assert(P::rank == 2 && std::is_same_v<typename P::value_type, typename X::value_type> &&
                    P::resolved.dims[0] == X::resolved.dims[0] && P::resolved.dims[1].n == 0 && P::resolved.partial == 0,
                "gshard::moe::gate: the paddings are [G,S] in the logits' element type, with G split as the logits' "
                "groups and nothing else split or pending");
  if (paddings.extent(0) != logits.extent(0) || paddings.extent(1) != logits.extent(1))
    throw shape_error("gshard::moe::gate: the paddings " + paddings.notation() + " do not fit the router logits " +
                      logits.notation() + " ([G,S] of [G,S,E])");
  return detail::gate_impl(std::forward<V>(logits), paddings.data(), cfg, stream, bias, training);
}

}  // namespace gshard::moe
