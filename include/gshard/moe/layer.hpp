// gshard/moe/layer.hpp — GShard's MoE layer, written forward-only: route the
// tokens, move them to their experts (one all_to_all), run each expert's FFN
// where the expert lives, move the outputs back (one all_to_all), combine.
// Both all_to_alls are reshards between two rule tables of the mesh's axis
// roles (gshard/roles.hpp): at_tokens puts the groups G on every batch axis,
// at_experts the experts E on the expert axes. With model axes the experts'
// hidden units H are split over them too, and the second expert einsum ends
// in one all_reduce over them. With layer_options::overlap_degree = k each
// all_to_all is k, one per chunk of the capacity, pipelined with the
// experts (start_reshard, gshard/ad/ops.hpp). The backward is derived
// (gshard/ad/).
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gshard/ad/ops.hpp"
#include "gshard/ad/parameters.hpp"
#include "gshard/moe/dispatch.hpp"
#include "gshard/moe/metrics.hpp"
#include "gshard/roles.hpp"

namespace gshard::moe {

// The experts' feed-forward network: GShard's relu(x·wi)·wo, or the gated
// SwiGLU (silu(x·wi) ⊙ (x·wi_up))·wo of PaLM and Llama.
enum class ffn_kind : std::uint8_t { relu, swiglu };

// What the layer declares beyond GShard's: shared experts (DeepSeek-MoE:
// experts every token passes through beside the routed ones, here one FFN
// of shared_experts · H hidden units, split like the dense FFNs), and the
// per-expert bias of aux-loss-free balancing.
struct layer_options {
  ffn_kind ffn = ffn_kind::relu;
  int shared_experts = 0;
  balance_mode balance = balance_mode::aux;
  // The all_to_alls pipelined with the experts in this many chunks of the
  // capacity dim C (Tutel's a2a_ffn_overlap_degree): chunk i+1 travels to
  // its experts and chunk i-1 back while chunk i's FFN computes, and so in
  // the backward. 1: one all_to_all each way. More chunks hide more of the
  // all_to_alls behind the experts' GEMMs, in smaller messages and GEMMs
  // (docs/10_performance.md measures it). Capped at C. dispatch_mode::einsum
  // (the reference form) runs unchunked.
  int overlap_degree = 1;
};

template <class T, mesh_type Mesh, class Roles = default_roles>
struct layer {
  using roles = roles_on<Mesh, Roles>;
  using at_tokens = typename roles::at_tokens;    // G over every batch axis
  using at_experts = typename roles::at_experts;  // E over the expert axes, G over the other batch axes
  template <fixed_string Term, class Rules>
  using weight = param<named<T, Term, Mesh, Rules>>;
  using bias_type = named<double, "E", Mesh, at_tokens>;  // replicated

  struct shared_params {
    weight<"MH", at_tokens> w1;                    // [M, H{model}]
    std::optional<weight<"MH", at_tokens>> w1_up;  // SwiGLU
    weight<"HM", at_tokens> w2;                    // [H{model}, M]
  };

  weight<"ME", at_tokens> gate;       // the router, replicated
  weight<"EMH", at_experts> wi;       // [E{expert},M,H{model}]
  std::optional<weight<"EMH", at_experts>> wi_up;  // SwiGLU's second input projection
  weight<"EHM", at_experts> wo;       // [E{expert},H{model},M]
  std::optional<shared_params> shared;
  std::optional<buffer<bias_type>> bias;  // balance_mode::bias
  layer_options options;
  std::string name;                       // the prefix, as in the trace's counters

  // Declares prefix + "gate", "wi", ("wi_up",) "wo_experts", (the shared
  // experts' "shared_w1", ("shared_w1_up",) "shared_w2") in `ps`, and the
  // buffer prefix + "router_bias" for balance_mode::bias.
  layer(parameters<Mesh>& ps, const std::string& prefix, index_t M, index_t H, index_t E, layer_options o = {})
      : gate(ps, prefix + "gate", {M, E}, init::normal(1.0 / std::sqrt(double(M)))),
        wi(ps, prefix + "wi", {E, M, H}, init::normal(1.0 / std::sqrt(double(M)))),
        wi_up(o.ffn == ffn_kind::swiglu
                  ? std::optional<weight<"EMH", at_experts>>(std::in_place, ps, prefix + "wi_up", shape<3>{E, M, H},
                                                             init::normal(1.0 / std::sqrt(double(M))))
                  : std::nullopt),
        wo(ps, prefix + "wo_experts", {E, H, M}, init::normal(1.0 / std::sqrt(double(H)))),
        options(o),
        name(prefix.empty() || prefix.back() != '.' ? prefix : prefix.substr(0, prefix.size() - 1)) {
    if (o.shared_experts < 0)
      throw error("gshard::moe::layer: shared_experts = " + std::to_string(o.shared_experts) + " is negative");
    if (o.overlap_degree < 1)
      throw error("gshard::moe::layer: overlap_degree = " + std::to_string(o.overlap_degree) +
                  " chunks; 1 (no pipelining) or more");
    if (o.shared_experts > 0) {
      const index_t Hs = H * o.shared_experts;
      std::optional<weight<"MH", at_tokens>> up;
      if (o.ffn == ffn_kind::swiglu) up.emplace(ps, prefix + "shared_w1_up", shape<2>{M, Hs}, init::normal(1.0 / std::sqrt(double(M))));
      shared = shared_params{weight<"MH", at_tokens>(ps, prefix + "shared_w1", {M, Hs}, init::normal(1.0 / std::sqrt(double(M)))), up,
                             weight<"HM", at_tokens>(ps, prefix + "shared_w2", {Hs, M}, init::normal(1.0 / std::sqrt(double(Hs))))};
    }
    if (o.balance == balance_mode::bias) bias.emplace(ps, prefix + "router_bias", shape<1>{E}, init::zeros());
  }
  layer(parameters<Mesh>& ps, const std::string& prefix, index_t M, index_t H, index_t E, ffn_kind kind)
      : layer(ps, prefix, M, H, E, layer_options{kind, 0, balance_mode::aux}) {}

  index_t experts() const { return gate.value().extent(1); }

  template <class X>
  struct output {
    X y;                                             // [G,S,M], sharded like the input
    var<tensor<double, 0, Mesh, replicate>> aux;     // GShard's aux loss (1 when balanced)
    var<tensor<double, 0, Mesh, replicate>> z_loss;  // the router z-loss (unscaled)
    gating_stats stats;                              // summed over every group
    std::shared_ptr<const routing<T>> route;         // this rank's groups
  };

  // x: [G,S,M] at the groups (labelled "GSM", at_tokens). `stream` keys the
  // random routing (the layer and the step). On a recording tape, with
  // balance_mode::bias, the router bias moves when the step's tape ends
  // (tape::after_step), so a recomputed forward routes as the first did.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, const gating_config& cfg, std::uint64_t stream,
                  dispatch_mode mode = dispatch_mode::index) const {
    static_assert(std::is_same_v<typename V::tensor_type, named<T, "GSM", Mesh, at_tokens>>,
                  "gshard::moe::layer: the input is named<T, \"GSM\", Mesh, at_tokens> (groups over the batch axes)");
    if (x.extent(2) != gate.value().extent(0))
      throw shape_error("gshard::moe::layer: the input " + x.notation() + " does not fit the router " +
                        gate.value().notation());
    if ((cfg.balance == balance_mode::bias) != bias.has_value())
      throw error(std::string("gshard::moe::layer: the gating asks for balance_mode::") +
                  (cfg.balance == balance_mode::bias ? "bias" : "aux") + " but the layer was declared with " +
                  (bias ? "balance_mode::bias" : "balance_mode::aux") + " (layer_options::balance)");
    const bool training = x.on_tape().recording();
    auto route = moe::gate(einsum<"GSM,ME->GSE">(x, gate), cfg, stream, bias ? bias->value().data() : nullptr,
                           training);  // router logits: local
    if (bias && training)
      x.on_tape().after_step([this, demand = route.stats.expert_demand, rate = cfg.bias_rate] { update_bias(demand, rate); });
    if (!x.on_tape().recomputing()) trace_counters(name, route.stats);
    auto y = [&] {  // [E,G{data,expert},C,M]: the experts' outputs, back at the groups
      if (mode == dispatch_mode::einsum)  // the reference form: one all_to_all each way
        return reshard<at_tokens>(experts_ffn(einsum<"GSEC,GSM->EGCM", at_experts>(dense_dispatch(route), x)));
      auto d = dispatch(route, x);  // [E,G{data,expert},C,M]
      const index_t k = std::min<index_t>(options.overlap_degree, d.extent(2));
      if (k <= 1) return reshard<at_tokens>(experts_ffn(reshard<at_experts>(std::move(d))));
      // Pipelined: chunk i+1 goes out and chunk i-1 comes back while chunk i's experts compute.
      auto pieces = chunk<2>(std::move(d), k);  // the whole goes: only the chunks stay
      using going_t = decltype(start_reshard<at_experts>(pieces[0]));
      using coming_t = decltype(start_reshard<at_tokens>(experts_ffn(std::declval<going_t&>().wait())));
      std::vector<going_t> going;
      std::vector<coming_t> coming;
      going.push_back(start_reshard<at_experts>(std::move(pieces[0])));
      for (index_t i = 0; i < k; ++i) {
        if (i + 1 < k) going.push_back(start_reshard<at_experts>(std::move(pieces[std::size_t(i + 1)])));
        coming.push_back(start_reshard<at_tokens>(experts_ffn(going[std::size_t(i)].wait())));
      }
      std::vector<decltype(coming[0].wait())> back;
      for (auto& c : coming) back.push_back(c.wait());
      return concat<2>(back);
    }();
    auto out = mode == dispatch_mode::index ? combine(route, std::move(y))
                                            : einsum<"GSEC,EGCM->GSM">(dense_combine(route), y);
    if (shared) out = std::move(out) + shared_ffn(x);
    return output<decltype(out)>{std::move(out), route.aux, route.z_loss, route.stats, route.route};
  }

 private:
  // Each expert's FFN on its tokens: [E{expert},G{data},C,M] |->
  // [E{expert},G{data},C,M], with model axes one all_reduce over them at the end.
  template <class XE>
  auto experts_ffn(const XE& xe) const {
    auto h = [&] {  // [E{expert},G{data},C,H{model}]: the experts live here
      if (options.ffn == ffn_kind::relu) return relu(einsum<"EGCM,EMH->EGCH">(xe, wi));
      // wi used before wi_up, in their declaration order (as every weight
      // is): gradients complete in reverse, the order buckets and the cost model take.
      auto gate = silu(einsum<"EGCM,EMH->EGCH">(xe, wi));
      return std::move(gate) * einsum<"EGCM,EMH->EGCH">(xe, *wi_up);
    }();
    return einsum<"EGCH,EHM->EGCM", at_experts>(h, wo);
  }

  // The shared experts: every token, [G,S,H{model}] hidden units, one all_reduce over the model axes.
  template <class V>
  auto shared_ffn(const V& x) const {
    auto a = [&] {
      if (!shared->w1_up) return relu(einsum<"GSM,MH->GSH">(x, shared->w1));
      auto up = einsum<"GSM,MH->GSH">(x, *shared->w1_up);  // first: declared before shared_w1 (the constructor)
      return silu(einsum<"GSM,MH->GSH">(x, shared->w1)) * std::move(up);
    }();
    return einsum<"GSH,HM->GSM", at_tokens>(a, shared->w2);
  }

  // DeepSeek-V3: b_e += γ · sign(mean demand - demand_e), from the choices
  // each expert got before capacity, summed over every group (the same on
  // every rank). The bias is the layer's state, not a parameter: it moves
  // once per recording forward (when its tape ends), even of a const layer.
  template <class Demand>
  void update_bias(const Demand& demand, double rate) const {
    double mean = 0;
    for (auto v : demand) mean += double(v);
    mean /= double(std::max<std::size_t>(demand.size(), 1));
    double* b = bias->value().data();
    for (std::size_t e = 0; e < demand.size(); ++e) {
      const double err = mean - double(demand[e]);
      b[e] += rate * double((err > 0) - (err < 0));
    }
  }
};

}  // namespace gshard::moe
