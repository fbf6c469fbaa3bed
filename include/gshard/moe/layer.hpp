// gshard/moe/layer.hpp — GShard's MoE layer, written forward-only (its
// backward is derived on the tape): route the tokens, move them to their
// experts (one all_to_all), run each expert's FFN where the expert lives,
// move the outputs back (one all_to_all), combine. Both all_to_alls are
// reshards between two rule tables of the mesh's axis roles (gshard/runtime/roles.hpp):
// at_tokens puts the groups G on every batch axis, at_experts the experts E on
// the expert axes. With model axes the experts' hidden units H are split over
// them too, and the second expert einsum ends in one all_reduce over them.
#pragma once

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gshard/ad/communication.hpp"
#include "gshard/ad/nn.hpp"
#include "gshard/ad/ops.hpp"
#include "gshard/state/parameters.hpp"
#include "gshard/moe/dispatch.hpp"
#include "gshard/moe/stats.hpp"
#include "gshard/runtime/roles.hpp"

namespace gshard::moe {

// What the layer declares beyond GShard's: shared experts (DeepSeek-MoE:
// experts every token passes through beside the routed ones, here one FFN
// of shared_experts · H hidden units, split like the dense FFNs), and the
// per-expert bias of aux-loss-free balancing.
struct layer_options {
  ffn_kind ffn = ffn_kind::relu;  // the experts' (and shared experts') FFN: relu or SwiGLU
  int shared_experts = 0;
  balance_mode balance = balance_mode::aux;
  // The all_to_alls pipelined with the experts in this many chunks of the
  // capacity dim C (Tutel's a2a_ffn_overlap_degree): chunk i+1 travels to
  // its experts and chunk i-1 back while chunk i's FFN computes, and so in
  // the backward (start_reshard, gshard/ad/communication.hpp). 1: one all_to_all each way. More chunks hide more of the
  // all_to_alls behind the experts' GEMMs, in smaller messages and GEMMs
  // (docs/10_performance.md measures it). Capped at C. dispatch_mode::einsum
  // (the reference form) runs unchunked.
  int overlap_degree = 1;
  // What the two all_to_alls carry, both ways: wire::bf16 halves their
  // bytes, rounding the tokens on their way to the experts, the experts'
  // outputs on their way back and the gradients of both once each (the
  // router's inputs and the combine weights stay as they are). Under
  // matmul_precision::bf16 the expert GEMMs round their inputs to bf16
  // anyway: the dispatch then costs no precision.
  wire all_to_all_wire = wire::same;
};

template <class T, mesh_type Mesh, class Roles = default_roles>
struct layer {
  using roles = roles_on<Mesh, Roles>;
  using at_tokens = typename roles::at_tokens;    // G over every batch axis
  using at_experts = typename roles::at_experts;  // E over the expert axes, G over the other batch axes
  template <fixed_string Term, class Rules>
  using weight = param<named<T, Term, Mesh, Rules>>;
  using bias_type = named<double, "E", Mesh, at_tokens>;  // replicated

  using expert_ffn_type = ffn_weights<named<T, "EMH", Mesh, at_experts>, named<T, "EHM", Mesh, at_experts>>;
  using shared_ffn_type = ffn_weights<named<T, "MH", Mesh, at_tokens>, named<T, "HM", Mesh, at_tokens>>;

  weight<"ME", at_tokens> router;  // [M,E], replicated; declared as prefix + "gate"
  expert_ffn_type expert_ffn;     // w1 [E{expert},M,H{model}], w2 [E{expert},H{model},M]
  std::optional<shared_ffn_type> shared;  // [M,H{model}], [H{model},M]
  std::optional<buffer<bias_type>> bias;  // balance_mode::bias
  layer_options options;
  std::string name;                       // the prefix, as in the trace's counters

  // Declares prefix + "gate", the experts' "wi", ("wi_up",) "wo_experts",
  // the shared experts' "shared_w1", ("shared_w1_up",) "shared_w2" in `ps`,
  // and the buffer prefix + "router_bias" for balance_mode::bias.
  layer(parameters<Mesh>& ps, const std::string& prefix, index_t M, index_t H, index_t E, layer_options o = {})
      : router(ps, prefix + "gate", {M, E}, init::normal(1.0 / std::sqrt(double(M)))),
        expert_ffn(ps, o.ffn, {prefix + "wi", prefix + "wi_up", prefix + "wo_experts"}, {E, M, H}, {E, H, M}),
        options(o),
        name(prefix.empty() || prefix.back() != '.' ? prefix : prefix.substr(0, prefix.size() - 1)) {
    if (o.shared_experts < 0)
      throw error("gshard::moe::layer: shared_experts = " + std::to_string(o.shared_experts) + " is negative");
    if (o.overlap_degree < 1)
      throw error("gshard::moe::layer: overlap_degree = " + std::to_string(o.overlap_degree) +
                  " chunks; 1 (no pipelining) or more");
    if (o.shared_experts > 0) {
      const index_t Hs = H * o.shared_experts;
      shared.emplace(ps, o.ffn, std::array<std::string, 3>{prefix + "shared_w1", prefix + "shared_w1_up", prefix + "shared_w2"},
                     shape<2>{M, Hs}, shape<2>{Hs, M});
    }
    if (o.balance == balance_mode::bias) bias.emplace(ps, prefix + "router_bias", shape<1>{E}, init::zeros());
  }
  layer(parameters<Mesh>& ps, const std::string& prefix, index_t M, index_t H, index_t E, ffn_kind kind)
      : layer(ps, prefix, M, H, E, layer_options{kind, 0, balance_mode::aux}) {}

  index_t experts() const { return router.value().extent(1); }

  template <class X>
  struct output {
    X y;                                             // [G,S,M], sharded like the input
    var<tensor<double, 0, Mesh, replicate>> aux;     // GShard's aux loss (1 when balanced)
    var<tensor<double, 0, Mesh, replicate>> z_loss;  // the router z-loss (unscaled)
    gating_stats stats;                              // summed over every group
    std::shared_ptr<const routing<T>> route;         // this rank's groups
  };

  // 1 where a position of x is padding, 0 where it holds a token ([G,S],
  // split like x's groups).
  using paddings_type = named<T, "GS", Mesh, at_tokens>;

  // x: [G,S,M] at the groups (labelled "GSM", at_tokens). `stream` keys the
  // random routing (the layer and the step). On a recording tape, with
  // balance_mode::bias, the router bias moves when the step's tape ends
  // (tape::after_step), so a recomputed forward routes as the first did.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, const gating_config& cfg, std::uint64_t stream,
                  dispatch_mode mode = dispatch_mode::index) const {
    return apply(x, nullptr, cfg, stream, mode);
  }
  // The same with paddings, as Lingvo's: a padded position is routed
  // nowhere, adds nothing to the losses and counters (moe::gate), and
  // leaves the layer as 0 (the shared experts see it as 0); what it held
  // reaches no other position's output or any gradient.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, const paddings_type& paddings, const gating_config& cfg, std::uint64_t stream,
                  dispatch_mode mode = dispatch_mode::index) const {
    return apply(x, &paddings, cfg, stream, mode);
  }
  // The next positions of sequences routed before (incremental decoding;
  // moe::start_routing makes `state`): routed as one call over the whole
  // sequences would route them with placement::by_token.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, routing_state& state, const gating_config& cfg, std::uint64_t stream) const {
    return apply(x, nullptr, cfg, stream, dispatch_mode::index, &state);
  }

 private:
  template <class V>
  auto apply(const V& x_in, const paddings_type* paddings, const gating_config& cfg, std::uint64_t stream,
             dispatch_mode mode, routing_state* state = nullptr) const {
    if (paddings && (paddings->extent(0) != x_in.extent(0) || paddings->extent(1) != x_in.extent(1)))
      throw shape_error("gshard::moe::layer: the paddings " + paddings->notation() + " do not fit the input " +
                        x_in.notation() + " ([G,S] of [G,S,M])");
    // With paddings the layer reads x with its padded rows cleared: no
    // padded value reaches the router's or any expert's GEMM, or a gradient.
    const V x = paddings ? V(mask_padding(x_in, *paddings)) : x_in;
    static_assert(std::is_same_v<typename V::tensor_type, named<T, "GSM", Mesh, at_tokens>>,
                  "gshard::moe::layer: the input is named<T, \"GSM\", Mesh, at_tokens> (groups over the batch axes)");
    if (x.extent(2) != router.value().extent(0))
      throw shape_error("gshard::moe::layer: the input " + x.notation() + " does not fit the router " +
                        router.value().notation());
    if ((cfg.balance == balance_mode::bias) != bias.has_value())
      throw error(std::string("gshard::moe::layer: the gating asks for balance_mode::") +
                  (cfg.balance == balance_mode::bias ? "bias" : "aux") + " but the layer was declared with " +
                  (bias ? "balance_mode::bias" : "balance_mode::aux") + " (layer_options::balance)");
    const bool training = x.on_tape().recording();
    const double* b = bias ? bias->value().data() : nullptr;
    auto logits = [&] {  // local; in fp32 under any matmul_precision, as Switch Transformer's router
      const matmul_precision_scope router_in(matmul_precision::f32);
      return einsum<"GSM,ME->GSE">(x, router);
    }();
    auto route = state      ? moe::gate(std::move(logits), *state, cfg, stream, b)
                 : paddings ? moe::gate(std::move(logits), *paddings, cfg, stream, b, training)
                            : moe::gate(std::move(logits), cfg, stream, b, training);
    if (bias && training)
      x.on_tape().after_step([this, demand = route.stats.expert_demand, rate = cfg.bias_rate] { update_bias(demand, rate); });
    if (!x.on_tape().recomputing()) trace_counters(name, route.stats);
    const wire w = options.all_to_all_wire;
    auto y = [&] {  // [E,G{data,expert},C,M]: the experts' outputs, back at the groups
      if (mode == dispatch_mode::einsum)  // the reference form: one all_to_all each way
        return reshard<at_tokens>(experts_ffn(reshard<at_experts>(einsum<"GSEC,GSM->EGCM">(dense_dispatch(route), x), w)), w);
      auto d = dispatch(route, x);  // [E,G{data,expert},C,M]
      const index_t k = std::min<index_t>(options.overlap_degree, d.extent(2));
      if (k <= 1) return reshard<at_tokens>(experts_ffn(reshard<at_experts>(std::move(d), w)), w);
      // Pipelined: chunk i+1 goes out and chunk i-1 comes back while chunk i's experts compute.
      auto pieces = chunk<2>(std::move(d), k);  // the whole goes: only the chunks stay
      using going_t = decltype(start_reshard<at_experts>(pieces[0], w));
      using coming_t = decltype(start_reshard<at_tokens>(experts_ffn(std::declval<going_t&>().wait()), w));
      std::vector<going_t> going;
      std::vector<coming_t> coming;
      going.push_back(start_reshard<at_experts>(std::move(pieces[0]), w));
      for (index_t i = 0; i < k; ++i) {
        if (i + 1 < k) going.push_back(start_reshard<at_experts>(std::move(pieces[std::size_t(i + 1)]), w));
        coming.push_back(start_reshard<at_tokens>(experts_ffn(going[std::size_t(i)].wait()), w));
      }
      std::vector<decltype(coming[0].wait())> back;
      for (auto& c : coming) back.push_back(c.wait());
      return concat<2>(back);
    }();
    auto out = [&] {  // the combine weights in fp32: with dispatch_mode::einsum a GEMM multiplies them
      const matmul_precision_scope gates_in(matmul_precision::f32);
      return mode == dispatch_mode::index ? combine(route, std::move(y))
                                          : einsum<"GSEC,EGCM->GSM">(dense_combine(route), y);
    }();
    if (shared) out = std::move(out) + ffn<at_tokens>(x, *shared);  // every token, one all_reduce over the model axes
    return output<decltype(out)>{std::move(out), route.aux, route.z_loss, route.stats, route.route};
  }

  // Each expert's FFN on its tokens: [E{expert},G{data},C,M] |->
  // [E{expert},G{data},C,M], with model axes one all_reduce over them at the end.
  template <class XE>
  auto experts_ffn(XE&& xe) const {
    return ffn<at_experts>(std::forward<XE>(xe), expert_ffn);
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
