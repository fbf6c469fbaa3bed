// gshard/moe/layer.hpp — GShard's MoE layer, written forward-only: route the
// tokens, move them to their experts (one all_to_all), run each expert's FFN
// where the expert lives, move the outputs back (one all_to_all), combine.
// Both all_to_alls are reshards between two rule tables of the mesh's axis
// roles (gshard/roles.hpp): at_tokens puts the groups G on every batch axis,
// at_experts the experts E on the expert axes. With model axes the experts'
// hidden units H are split over them too, and the second expert einsum ends
// in one all_reduce over them. The backward is derived (gshard/ad/).
#pragma once

#include <cmath>
#include <optional>
#include <string>

#include "gshard/ad/ops.hpp"
#include "gshard/ad/parameters.hpp"
#include "gshard/moe/dispatch.hpp"
#include "gshard/roles.hpp"

namespace gshard::moe {

// The experts' feed-forward network: GShard's relu(x·wi)·wo, or the gated
// SwiGLU (silu(x·wi) ⊙ (x·wi_up))·wo of PaLM and Llama.
enum class ffn_kind : std::uint8_t { relu, swiglu };

template <class T, mesh_type Mesh, class Roles = default_roles>
struct layer {
  using roles = roles_on<Mesh, Roles>;
  using at_tokens = typename roles::at_tokens;    // G over every batch axis
  using at_experts = typename roles::at_experts;  // E over the expert axes, G over the other batch axes
  template <fixed_string Term, class Rules>
  using weight = param<named<T, Term, Mesh, Rules>>;

  weight<"ME", at_tokens> gate;       // the router, replicated
  weight<"EMH", at_experts> wi;       // [E{expert},M,H{model}]
  std::optional<weight<"EMH", at_experts>> wi_up;  // SwiGLU's second input projection
  weight<"EHM", at_experts> wo;       // [E{expert},H{model},M]
  ffn_kind ffn;

  // Declares prefix + "gate", "wi", ("wi_up",) "wo_experts" in `ps`.
  layer(parameters<Mesh>& ps, const std::string& prefix, index_t M, index_t H, index_t E, ffn_kind kind = ffn_kind::relu)
      : gate(ps, prefix + "gate", {M, E}, init::normal(1.0 / std::sqrt(double(M)))),
        wi(ps, prefix + "wi", {E, M, H}, init::normal(1.0 / std::sqrt(double(M)))),
        wi_up(kind == ffn_kind::swiglu ? std::optional<weight<"EMH", at_experts>>(std::in_place, ps, prefix + "wi_up",
                                                                                    shape<3>{E, M, H},
                                                                                    init::normal(1.0 / std::sqrt(double(M))))
                                       : std::nullopt),
        wo(ps, prefix + "wo_experts", {E, H, M}, init::normal(1.0 / std::sqrt(double(H)))),
        ffn(kind) {}

  index_t experts() const { return gate.value().extent(1); }

  template <class X>
  struct output {
    X y;                                       // [G,S,M], sharded like the input
    var<tensor<double, 0, Mesh, replicate>> aux;  // GShard's aux loss (1 when balanced)
    gating_stats stats;                        // summed over every group
    std::shared_ptr<const routing<T>> route;   // this rank's groups
  };

  // x: [G,S,M] at the groups (labelled "GSM", at_tokens). `stream` keys the
  // random routing (the layer and the step).
  template <class V>
    requires var_type<V>
  auto operator()(const V& x, const gating_config& cfg, std::uint64_t stream,
                  dispatch_mode mode = dispatch_mode::index) const {
    static_assert(std::is_same_v<typename V::tensor_type, named<T, "GSM", Mesh, at_tokens>>,
                  "gshard::moe::layer: the input is named<T, \"GSM\", Mesh, at_tokens> (groups over the batch axes)");
    if (x.extent(2) != gate.value().extent(0))
      throw shape_error("gshard::moe::layer: the input " + x.notation() + " does not fit the router " +
                        gate.value().notation());
    auto route = moe::gate(einsum<"GSM,ME->GSE">(x, gate), cfg, stream);  // router logits: local
    auto xe = [&] {  // [E{expert},G{data},C,M]: one all_to_all either way
      if (mode == dispatch_mode::index) return reshard<at_experts>(dispatch(route, x));
      return einsum<"GSEC,GSM->EGCM", at_experts>(dense_dispatch(route), x);
    }();
    auto h = [&] {  // [E{expert},G{data},C,H{model}]: the experts live here
      if (ffn == ffn_kind::relu) return relu(einsum<"EGCM,EMH->EGCH">(xe, wi));
      return silu(einsum<"EGCM,EMH->EGCH">(xe, wi)) * einsum<"EGCM,EMH->EGCH">(xe, *wi_up);
    }();
    auto ye = einsum<"EGCH,EHM->EGCM", at_experts>(h, wo);  // with model axes: one all_reduce over them
    auto y = reshard<at_tokens>(std::move(ye));               // all_to_all back: [E,G{data,expert},C,M]
    auto out = mode == dispatch_mode::index ? combine(route, std::move(y))
                                            : einsum<"GSEC,EGCM->GSM">(dense_combine(route), y);
    return output<decltype(out)>{std::move(out), route.aux, route.stats, route.route};
  }
};

}  // namespace gshard::moe
