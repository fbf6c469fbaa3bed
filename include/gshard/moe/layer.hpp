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
  // anyway: the dispatch then costs no precision. With wire::trimmed
  // (alone or wire::bf16 | wire::trimmed) they move the filled capacity
  // slots only — each expert's slots fill from the first — and the
  // receiver writes the empty ones back as zeros: the same numbers, in
  // fewer bytes.
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
    return begin(x, nullptr, cfg, stream, mode, {}, nullptr, false).finish();
  }
  // The same with paddings, as Lingvo's: a padded position is routed
  // nowhere, adds nothing to the losses and counters (moe::gate), and
  // leaves the layer as 0 (the shared experts see it as 0); what it held
  // reaches no other position's output or any gradient.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, const paddings_type& paddings, const gating_config& cfg, std::uint64_t stream,
                  dispatch_mode mode = dispatch_mode::index) const {
    return begin(x, &paddings, cfg, stream, mode, {}, nullptr, false).finish();
  }
  // The next positions of sequences routed before (incremental decoding;
  // moe::start_routing makes `state`): routed as one call over the whole
  // sequences would route them with placement::by_token.
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, routing_state& state, const gating_config& cfg, std::uint64_t stream) const {
    return begin(x, nullptr, cfg, stream, dispatch_mode::index, {}, &state, false).finish();
  }

  // What a call in phases is told beyond operator()'s arguments.
  struct call_options {
    // The global index random routing keys this rank's first group by; -1:
    // its offset in x. A micro-batch cut from the rows of a larger batch
    // passes the rows' first index there, and routes as the whole would.
    index_t first_group = -1;
    // balance_mode::bias: move the bias when the step's tape ends. false:
    // the caller does, with update_bias and the demand summed over the
    // micro-batches of the step (one move per step, as for the whole).
    bool update_bias = true;
  };

  // The layer in three phases, so that a model interleaving micro-batches
  // computes one while another's all_to_all travels:
  //   auto c = layer.start(x, cfg, stream);  // routed, dispatched; the tokens travel to the experts
  //   c.experts();                           // the experts' FFN; their outputs travel back
  //   auto out = c.finish();                 // combined: what operator() returns
  // The tape records each phase where it runs, so the backward interleaves
  // the same way, transposed (start_reshard). dispatch_mode::einsum, the
  // reference form, computes everything in start().
  template <class V>
  class call {
   public:
    // The experts' FFN on the tokens in flight; their outputs sent back.
    // With layer_options::overlap_degree chunks, chunk i+1 travels out and
    // chunk i-1 back while chunk i computes. Once; finish() calls it if
    // it was not.
    call& experts() {
      if (going_.empty()) return *this;
      for (std::size_t i = 0; i < pieces_.size(); ++i) {
        if (i + 1 < pieces_.size()) going_.push_back(start_reshard<at_experts>(std::move(pieces_[i + 1]), w_));
        coming_.push_back(start_reshard<at_tokens>(l_->experts_ffn(going_[i].wait()), w_));
      }
      going_.clear(), pieces_.clear();
      return *this;
    }

    // The experts' outputs combined with the gates (and the shared
    // experts' added): [G,S,M] like the input, the losses and counters.
    auto finish() {
      if (finished_)
        throw error("gshard::moe::layer: finish() was called before on this call of layer '" + l_->name +
                    "'; a call finishes once (start() begins another)");
      finished_ = true;
      experts();
      if (!y_) {
        std::vector<y_var> back;
        for (auto& c : coming_) back.push_back(c.wait());
        coming_.clear();
        y_.emplace(back.size() == 1 ? std::move(back[0]) : concat<2>(back));
      }
      auto out = [&] {  // the combine weights in fp32: with dispatch_mode::einsum a GEMM multiplies them
        const matmul_precision_scope gates_in(matmul_precision::f32);
        return mode_ == dispatch_mode::index ? combine(route_, std::move(*y_))
                                             : einsum<"GSEC,EGCM->GSM">(dense_combine(route_), *y_);
      }();
      y_.reset();
      if (l_->shared) out = std::move(out) + ffn<at_tokens>(x_, *l_->shared);  // every token, one all_reduce over the model axes
      return output<decltype(out)>{std::move(out), route_.aux, route_.z_loss, route_.stats, route_.route};
    }

   private:
    friend struct layer;
    using route_type = decltype(moe::gate(std::declval<var<named<T, "GSE", Mesh, at_tokens>>>(), gating_config{}, 0));
    using piece_var = decltype(dispatch(std::declval<const route_type&>(), std::declval<const V&>()));
    using going_type = decltype(start_reshard<at_experts>(std::declval<piece_var>(), wire::same));
    using coming_type =
        decltype(start_reshard<at_tokens>(std::declval<const layer&>().experts_ffn(std::declval<going_type&>().wait()), wire::same));
    using y_var = decltype(std::declval<coming_type&>().wait());

    call(const layer* l, V x, route_type route, dispatch_mode mode, wire w)
        : l_(l), x_(std::move(x)), route_(std::move(route)), mode_(mode), w_(w) {}

    const layer* l_;
    V x_;
    route_type route_;
    dispatch_mode mode_;
    wire w_;
    std::vector<piece_var> pieces_;  // the tokens not yet sent, in chunks of C
    std::vector<going_type> going_;  // in flight to the experts
    std::vector<coming_type> coming_;  // in flight back
    std::optional<y_var> y_;         // [E,G,C,M] at the groups, when computed whole
    bool finished_ = false;
  };

  template <class V>
    requires var_type<V>
  call<V> start(const V& x, const gating_config& cfg, std::uint64_t stream, dispatch_mode mode = dispatch_mode::index,
                call_options o = {}) const {
    return begin(x, nullptr, cfg, stream, mode, o, nullptr, true);
  }
  template <class V>
    requires var_type<V>
  call<V> start(const V& x, const paddings_type& paddings, const gating_config& cfg, std::uint64_t stream,
                dispatch_mode mode = dispatch_mode::index, call_options o = {}) const {
    return begin(x, &paddings, cfg, stream, mode, o, nullptr, true);
  }

  // DeepSeek-V3: b_e += γ · sign(mean demand - demand_e), from the choices
  // each expert got before capacity, summed over every group (the same on
  // every rank). The bias is the layer's state, not a parameter: it moves
  // once per recording forward (when its tape ends), even of a const layer.
  template <class Demand>
  void update_bias(const Demand& demand, double rate) const {
    if (!bias || demand.size() != std::size_t(experts()))
      throw error("gshard::moe::layer: update_bias of layer '" + name + "' with the demand of " +
                  std::to_string(demand.size()) + " experts; the layer has " + std::to_string(experts()) +
                  (bias ? "" : " and no bias (declare it with layer_options::balance = balance_mode::bias)"));
    double mean = 0;
    for (auto v : demand) mean += double(v);
    mean /= double(std::max<std::size_t>(demand.size(), 1));
    double* b = bias->value().data();
    for (std::size_t e = 0; e < demand.size(); ++e) {
      const double err = mean - double(demand[e]);
      b[e] += rate * double((err > 0) - (err < 0));
    }
  }

 private:
  // Routes x and sends its tokens on their way. `in_flight` (start()): the
  // all_to_all to the experts is started here and waited for in
  // call::experts(). Otherwise (operator()) with overlap_degree 1 the
  // experts run here, between two blocking all_to_alls.
  template <class V>
  call<V> begin(const V& x_in, const paddings_type* paddings, const gating_config& cfg, std::uint64_t stream,
                dispatch_mode mode, call_options o, routing_state* state, bool in_flight) const {
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
    auto route = detail::gate_impl(std::move(logits), paddings ? paddings->data() : nullptr, cfg, stream, b,
                                   training && !state, state, o.first_group);
    if (bias && training && o.update_bias)
      x.on_tape().after_step([this, demand = route.stats.expert_demand, rate = cfg.bias_rate] { update_bias(demand, rate); });
    if (!x.on_tape().recomputing()) trace_counters(name, route.stats);
    call<V> c(this, x, std::move(route), mode, options.all_to_all_wire);
    const wire w = options.all_to_all_wire;
    if (mode == dispatch_mode::einsum) {  // the reference form: one all_to_all each way
      c.y_.emplace(reshard<at_tokens>(
          experts_ffn(reshard<at_experts>(einsum<"GSEC,GSM->EGCM">(dense_dispatch(c.route_), x), w)), w));
      return c;
    }
    auto d = dispatch(c.route_, x);  // [E,G{data,expert},C,M]
    const index_t k = std::min<index_t>(options.overlap_degree, d.extent(2));
    if (k <= 1 && !in_flight) {
      c.y_.emplace(reshard<at_tokens>(experts_ffn(reshard<at_experts>(std::move(d), w)), w));
      return c;
    }
    if (k <= 1) c.pieces_.push_back(std::move(d));
    else c.pieces_ = chunk<2>(std::move(d), k);  // the whole goes: only the chunks stay
    c.going_.push_back(start_reshard<at_experts>(std::move(c.pieces_[0]), w));
    return c;
  }

  // Each expert's FFN on its tokens: [E{expert},G{data},C,M] |->
  // [E{expert},G{data},C,M], with model axes one all_reduce over them at the end.
  template <class XE>
  auto experts_ffn(XE&& xe) const {
    return ffn<at_experts>(std::forward<XE>(xe), expert_ffn);
  }
};

}  // namespace gshard::moe
