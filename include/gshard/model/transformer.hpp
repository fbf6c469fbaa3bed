// gshard/model/transformer.hpp — a byte-level language model of pre-norm
// Transformer blocks, x + attention(norm(x)) then x + ffn(norm(x)), the FFN
// an MoE layer in every other block (blocks 1, 3, ...). Written forward-only:
// its parameters are declared once (gshard::parameters) and its backward is
// derived on a tape. Every tensor's sharding comes from the mesh's axis roles
// (gshard/runtime/roles.hpp).
//   model::transformer<float, grid> tr(ps, c);  auto out = tr.forward(t, tokens, step);
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gshard/ad/communication.hpp"
#include "gshard/ad/nn.hpp"
#include "gshard/ad/ops.hpp"
#include "gshard/state/parameters.hpp"
#include "gshard/ad/remat.hpp"
#include "gshard/moe/layer.hpp"
#include "gshard/runtime/roles.hpp"

namespace gshard::model {

// Where a token's position enters: nowhere (causal attention alone tells
// positions apart), the sinusoids of "Attention Is All You Need", or a
// learned table of max_len rows; either is added to the token embedding.
enum class position_kind : std::uint8_t { none, sinusoidal, learned };

struct config {
  index_t vocab = 256;    // bytes
  index_t model = 64;     // M
  index_t heads = 4;      // N
  index_t head_dim = 16;  // K
  index_t hidden = 128;   // H, of the dense FFNs and of each expert
  index_t experts = 8;    // E; 0: a dense model (every block a dense FFN)
  position_kind positions = position_kind::none;
  index_t max_len = 1024;  // the longest sequence positions cover (sinusoidal, learned)
  int layers = 4;         // blocks; blocks 1, 3, ... have an MoE FFN
  // A dense model's (experts = 0) FFNs in blocks 1, 3, ...: their hidden
  // units (0: hidden). top_k · hidden matches the MoE model's FLOPs per
  // token, E · hidden its parameters: the two baselines of GShard's claim.
  index_t slot_hidden = 0;
  double aux_coef = 0.01;     // the loss adds aux_coef · Σ aux and gating.z_loss_coef · Σ z-loss over MoE layers
  moe::gating_config gating{};  // top-k, capacity, dropless, z-loss, balancing (moe/gating.hpp)
  ffn_kind ffn = ffn_kind::relu;  // the dense FFNs' and the experts' (relu or SwiGLU)
  int shared_experts = 0;       // per MoE layer, beside the routed ones
  int overlap_degree = 1;       // the MoE layers' all_to_alls pipelined with the experts in this many chunks (moe::layer_options)
  wire all_to_all_wire = wire::same;  // what the MoE layers' all_to_alls carry (moe::layer_options)
  // What causal attention keeps for the backward: the probabilities
  // [B, N, L, T], or two numbers per row from which the backward computes
  // them again (less memory at long L, one more QKᵀ GEMM per block).
  attention_memory attention = attention_memory::keep_probabilities;
  // Blocks that keep only their input and recompute their forward in the
  // backward (rematerialisation): less memory, one more forward of each.
  std::vector<int> remat;
  // 2: each rank's batch cut in two micro-batches that run through the
  // blocks interleaved, so one's MoE all_to_alls travel while the other
  // computes (and so in the backward): DeepSeek-V3's overlap of two
  // micro-batches, for links slow next to compute. Routed as the whole
  // batch (the rows keep their random-routing keys, the losses and counters
  // are the whole batch's): the same loss and gradients up to rounding. A
  // model without an MoE layer (nothing to overlap), or a batch no cut of
  // the ranks' rows splits in two (one row per rank; 17 rows over 2 x 4
  // batch ranks), runs whole. Not with remat in a model with MoE layers.
  int micro_batches = 1;
  bool is_moe(int layer) const { return experts > 0 && layer % 2 == 1; }
  bool any_moe() const { return layers > 1 && is_moe(1); }  // block 1 is the first that can hold one
  bool remats(int layer) const { return std::find(remat.begin(), remat.end(), layer) != remat.end(); }
  index_t ffn_hidden(int layer) const { return experts == 0 && layer % 2 == 1 && slot_hidden > 0 ? slot_hidden : hidden; }
};

// The shardings: the batch over the batch axes; experts over the expert
// axes; with model axes, attention heads and the hidden units of the dense
// FFNs and of each expert over them (Megatron-style: q, k, v and w1 split
// their output, wo and w2 their input), every other weight replicated. The
// communication follows: in the forward the MoE layers' all_to_alls and, with
// model axes, one all_reduce over them after each attention, dense FFN and
// expert FFN; in the backward their transposes and one reduction per weight
// over the batch axes (several weights' in one collective: gshard/state/buckets.hpp).
template <class T, mesh_type Mesh, class Roles = default_roles>
class transformer {
 public:
  using roles = roles_on<Mesh, Roles>;
  using at_tokens = typename roles::at_tokens;
  template <fixed_string Term>
  using weight = param<named<T, Term, Mesh, at_tokens>>;
  using tokens_type = named<std::int32_t, "BL", Mesh, at_tokens>;  // [B, L+1] bytes
  using activation = named<T, "BLM", Mesh, at_tokens>;             // [B{data,expert},L,M]

  struct attention_params {
    weight<"MNK"> wq, wk, wv;  // [M,N{model},K]
    weight<"NKM"> wo;          // [N{model},K,M]
  };
  using ffn_params = ffn_weights<named<T, "MH", Mesh, at_tokens>, named<T, "HM", Mesh, at_tokens>>;  // [M,H{model}], [H{model},M]
  struct block_params {
    weight<"M"> norm1;
    attention_params attn;
    weight<"M"> norm2;
    std::optional<ffn_params> ffn;                // dense blocks
    std::optional<moe::layer<T, Mesh, Roles>> moe;  // MoE blocks
  };

  // Declares every parameter in `ps` (names "embed", "block0.wq", ...,
  // "final_norm", "unembed": those of gshard's checkpoints).
  transformer(parameters<Mesh>& ps, const config& c)
      : c_(checked(c)),
        embed_(ps, "embed", {c.vocab, c.model}, init::normal(1.0)),
        learned_positions_(c.positions == position_kind::learned
                               ? std::optional<weight<"PM">>(std::in_place, ps, "positions", shape<2>{c.max_len, c.model},
                                                             init::normal(1.0 / std::sqrt(double(c.model))))
                               : std::nullopt),
        sinusoids_(c.positions == position_kind::sinusoidal
                       ? std::optional<named<T, "PM", Mesh, at_tokens>>(sinusoidal_positions<T>(ps.mesh(), c.max_len, c.model))
                       : std::nullopt),
        blocks_(declare_blocks(ps, c)),
        final_norm_(ps, "final_norm", {c.model}, init::ones()),
        unembed_(ps, "unembed", {c.model, c.vocab}, init::normal(1.0 / std::sqrt(double(c.model)))) {}

  const config& cfg() const { return c_; }
  const std::vector<block_params>& blocks() const { return blocks_; }
  const std::optional<weight<"PM">>& learned_positions() const { return learned_positions_; }

  struct output {
    var<tensor<double, 0, Mesh, replicate>> loss;  // cross-entropy + aux_coef · Σ aux + z_loss_coef · Σ z
    double ce = 0, aux = 0, z = 0;                 // mean cross-entropy; Σ over MoE layers of the aux loss and the z-loss
    std::vector<moe::gating_stats> moe;            // per MoE layer, summed over every group
    var<named<T, "BLV", Mesh, at_tokens>> logits;  // [B,L,V]
  };

  // tokens [B, L+1]: predicts tokens[:, 1:] from tokens[:, :-1]. `step` keys
  // the random routing. On a tape made with tape::no_grad nothing is kept;
  // a block in config::remat keeps only its input and runs again in the
  // backward (gshard/ad/remat.hpp).
  output forward(tape& t, const tokens_type& tokens, std::uint64_t step,
                 moe::dispatch_mode mode = moe::dispatch_mode::index) const {
    auto [inputs, targets] = split_tokens(tokens);
    const index_t first = c_.micro_batches == 2 && c_.any_moe() ? halve_blocks<0>(inputs) : 0;
    std::vector<moe_term> terms;
    auto x = first > 0 ? interleaved(t, inputs, first, step, mode, terms) : whole(t, inputs, step, mode, terms);
    auto logits = einsum<"BLM,MV->BLV">(rms_norm(x, final_norm_), unembed_);  // [B{data,expert},L,V]
    auto ce = cross_entropy(logits, targets);
    output out{ce, loss_value(ce), 0.0, 0.0, {}, std::move(logits)};
    for (auto& m : terms) {
      out.aux += loss_value(m.aux);
      if (c_.aux_coef != 0) out.loss = out.loss + c_.aux_coef * m.aux;
    }
    for (auto& m : terms) {
      out.z += loss_value(m.z);
      if (c_.gating.z_loss_coef != 0) out.loss = out.loss + c_.gating.z_loss_coef * m.z;
      out.moe.push_back(std::move(m.stats));
    }
    return out;
  }

  // Block `layer`: x + attention(norm(x)), then x + ffn(norm(x)) — an MoE
  // layer in blocks 1, 3, ..., which adds its aux loss, z-loss and routing
  // statistics to the output (the groups are the sequences: G = B, S = L).
  using scalar_var = var<tensor<double, 0, Mesh, replicate>>;
  std::tuple<var<activation>, std::optional<scalar_var>, std::optional<scalar_var>, std::optional<moe::gating_stats>>
  block(var<activation> x, int layer, std::uint64_t step, moe::dispatch_mode mode = moe::dispatch_mode::index) const {
    const block_params& b = blocks_[std::size_t(layer)];
    std::optional<trace::span> block_span, sub;  // named only when tracing
    const auto named_span = [&](std::optional<trace::span>& s, const char* what) {
      s.reset();
      if (trace::enabled()) s.emplace("block " + std::to_string(layer) + what, "model");
    };
    named_span(block_span, "");
    named_span(sub, " attention");
    x = x + attention(rms_norm(x, b.norm1), b.attn);
    named_span(sub, b.moe ? " MoE" : " FFN");
    auto h = rms_norm(x, b.norm2);
    if (!b.moe) return {x + ffn<at_tokens>(h, *b.ffn), std::nullopt, std::nullopt, std::nullopt};  // with model axes: an all_reduce over them
    auto r = (*b.moe)(relabel<"GSM">(std::move(h)), c_.gating, (step << 8) | std::uint64_t(layer), mode);
    return {x + relabel<"BLM">(std::move(r.y)), std::move(r.aux), std::move(r.z_loss), std::move(r.stats)};
  }

  // Causal self-attention: q, k, v = BLM,MNK->BLNK; then causal_attention
  // (gshard/tensor/attention.hpp): the logits BLNK,BTNK->BNLT scaled by 1/sqrt(K)
  // and masked, softmax over T, BNLT,BTNK->BLNK, per sequence in blocks of
  // rows; BLNK,NKM->BLM. Each rank computes its heads; the
  // output projection sums over them, so with model axes it ends in one
  // all_reduce over them.
  template <class V>
  auto attention(const V& h, const attention_params& a) const {
    const double scale = 1.0 / std::sqrt(double(c_.head_dim));
    // Only the attention reads q, k and v, and under bf16 GEMMs only their
    // bf16 copies: the projections write them so (bf16_activation).
    using qkv = bf16_activation;
    auto q = einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wq);                   // [B{data,expert},L,N{model},K]
    auto k = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wk));  // the keys' positions are T
    auto v = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wv));
    auto o = causal_attention(q, k, v, scale, c_.attention);  // [B{data,expert},L,N{model},K]
    return einsum<"BLNK,NKM->BLM", at_tokens>(o, a.wo);
  }

 private:
  using inputs_type = named<std::int32_t, "BL", Mesh, at_tokens>;
  using moe_input = decltype(relabel<"GSM">(std::declval<var<activation>>()));
  using moe_call = typename moe::layer<T, Mesh, Roles>::template call<moe_input>;

  // An MoE layer's terms of the loss and its counters.
  struct moe_term {
    scalar_var aux, z;
    moe::gating_stats stats;
  };

  // The byte embeddings of inputs [B, L], with their positions.
  var<activation> embed(tape& t, const inputs_type& inputs) const {
    auto x = embedding(t, inputs, embed_);  // [B{data,expert},L,M]
    if (c_.positions == position_kind::none) return x;
    if (inputs.extent(1) > c_.max_len)
      throw shape_error("gshard::model::forward: sequences of " + std::to_string(inputs.extent(1)) +
                        " tokens are longer than config.max_len = " + std::to_string(c_.max_len) + " positions");
    const auto pos = positions_of(inputs);
    return learned_positions_ ? x + embedding(t, pos, *learned_positions_) : x + embedding(t, pos, t.constant_ref(*sinusoids_));
  }

  // The blocks over the whole batch.
  var<activation> whole(tape& t, const inputs_type& inputs, std::uint64_t step, moe::dispatch_mode mode,
                        std::vector<moe_term>& terms) const {
    auto x = embed(t, inputs);
    for (int layer = 0; layer < c_.layers; ++layer) {
      const auto run = [this, layer, step, mode](const var<activation>& in) { return block(in, layer, step, mode); };
      auto [y, a, zl, st] = c_.remats(layer) ? remat(run, x) : run(x);
      x = std::move(y);
      if (a) terms.push_back({std::move(*a), std::move(*zl), std::move(*st)});
    }
    return x;
  }

  // One micro-batch of the interleaved forward: its activations, where it
  // is in the blocks, and the MoE call it has in flight.
  struct lane {
    const char* name;
    var<activation> x;
    index_t first_group;  // the global index of this rank's first row in the whole batch
    int layer = 0;
    std::optional<moe_call> moe{};   // started, its experts not yet run
    std::optional<moe_call> back{};  // the experts' outputs travelling back
    std::vector<moe_term> terms{};   // per MoE layer passed
  };

  // The blocks over two micro-batches — every rank's first `first`-block of
  // rows and the rest (cut_blocks) — interleaved at the MoE layers'
  // all_to_alls: each runs until it has started one (its attention and the
  // routing, or its experts), then the other runs. So A's tokens travel to
  // the experts while B's attention computes, B's while A's experts do, A's
  // outputs come back during B's experts and B's during A's next blocks.
  // Each MoE layer's losses and counters are then the whole batch's.
  var<activation> interleaved(tape& t, const inputs_type& inputs, index_t first, std::uint64_t step,
                              moe::dispatch_mode mode, std::vector<moe_term>& terms) const {
    auto [in_a, in_b] = cut_blocks<0>(inputs, first);
    const index_t offset = inputs.offsets()[0];
    lane lanes[2] = {{"A", embed(t, in_a), offset}, {"B", embed(t, in_b), offset + in_a.local_extents()[0]}};
    for (bool more = true; more;) {
      more = advance(lanes[0], step, mode);
      more = advance(lanes[1], step, mode) || more;
    }
    combine_terms(t, lanes[0].terms, lanes[1].terms, double(first) / double(inputs.extent(0)), terms);
    return join_blocks<0>(lanes[0].x, lanes[1].x);
  }

  // Runs lane l to its next all_to_all: its experts if it has tokens in
  // flight to them, else its combine (if outputs are on their way back) and
  // the blocks after it up to the next MoE layer's start. False once it is
  // through every block.
  bool advance(lane& l, std::uint64_t step, moe::dispatch_mode mode) const {
    std::optional<trace::span> s;
    const auto span = [&](const char* what) {
      s.reset();
      if (trace::enabled()) s.emplace("block " + std::to_string(l.layer) + what + " (micro-batch " + l.name + ")", "model");
    };
    if (l.moe) {
      span(" MoE experts");
      l.moe->experts();
      l.back = std::move(l.moe), l.moe.reset();
      return true;
    }
    if (l.back) {
      span(" MoE combine");
      auto r = l.back->finish();
      l.back.reset();
      l.x = l.x + relabel<"BLM">(std::move(r.y));
      l.terms.push_back({std::move(r.aux), std::move(r.z_loss), std::move(r.stats)});
      ++l.layer;
    }
    for (; l.layer < c_.layers; ++l.layer) {
      const block_params& b = blocks_[std::size_t(l.layer)];
      span(" attention");
      l.x = l.x + attention(rms_norm(l.x, b.norm1), b.attn);
      span(b.moe ? " MoE" : " FFN");
      auto h = rms_norm(l.x, b.norm2);
      if (!b.moe) {
        l.x = l.x + ffn<at_tokens>(h, *b.ffn);
        continue;
      }
      l.moe.emplace(b.moe->start(relabel<"GSM">(std::move(h)), c_.gating, (step << 8) | std::uint64_t(l.layer), mode,
                                 {l.first_group, false}));
      return true;
    }
    return false;
  }

  // Each MoE layer's terms of the two micro-batches as the whole batch's:
  // the aux loss is a mean over the groups and the z-loss over the valid
  // tokens, so each half's is weighted by its share (`share_a`: A's of the
  // groups); the counters add up. balance_mode::bias: the bias moves once
  // per layer and step, by the whole batch's demand.
  void combine_terms(tape& t, const std::vector<moe_term>& a, const std::vector<moe_term>& b, double share_a,
                     std::vector<moe_term>& terms) const {
    const std::size_t base = terms.size();
    for (std::size_t j = 0; j < a.size(); ++j) {
      const double va = double(a[j].stats.tokens - a[j].stats.invalid), vb = double(b[j].stats.tokens - b[j].stats.invalid);
      const double za = va + vb > 0 ? va / (va + vb) : 0.5;
      moe_term m{share_a * a[j].aux + (1.0 - share_a) * b[j].aux, za * a[j].z + (1.0 - za) * b[j].z, a[j].stats};
      m.stats += b[j].stats;
      terms.push_back(std::move(m));
    }
    if (c_.gating.balance == moe::balance_mode::bias && t.recording())
      for (std::size_t layer = 0, j = base; layer < blocks_.size(); ++layer)
        if (const auto& m = blocks_[layer].moe)
          t.after_step([m = &*m, demand = terms[j++].stats.expert_demand, rate = c_.gating.bias_rate] {
            m->update_bias(demand, rate);
          });
  }

  template <class L>
  static double loss_value(const var<L>& v) {
    return v.value().local()();
  }

  static const config& checked(const config& c) {
    if (c.experts < 0 || c.slot_hidden < 0 || (c.slot_hidden > 0 && c.experts > 0))
      throw error("gshard::model::transformer: config.experts = " + std::to_string(c.experts) + " and config.slot_hidden = " +
                  std::to_string(c.slot_hidden) + ": experts is >= 0, and slot_hidden (>= 0) is for a dense model (experts = 0)");
    if (c.experts > 0) moe::validate(c.gating, c.experts);
    if (c.shared_experts < 0)
      throw error("gshard::model::transformer: config.shared_experts = " + std::to_string(c.shared_experts) + " is negative");
    if (c.positions != position_kind::none && c.max_len < 1)
      throw error("gshard::model::transformer: config.max_len = " + std::to_string(c.max_len) + " positions; at least 1");
    if (c.micro_batches != 1 && c.micro_batches != 2)
      throw error("gshard::model::transformer: config.micro_batches = " + std::to_string(c.micro_batches) +
                  "; 1 (the batch whole) or 2 (two interleaved halves)");
    if (c.micro_batches == 2 && !c.remat.empty() && c.any_moe())
      throw error("gshard::model::transformer: config.micro_batches = 2 with blocks in config.remat: a recomputed "
                  "block would run the two micro-batches one after the other; use one of the two");
    for (int l : c.remat)
      if (l < 0 || l >= c.layers)
        throw error("gshard::model::transformer: config.remat names block " + std::to_string(l) + " of a model with " +
                    std::to_string(c.layers) + " blocks (0 to " + std::to_string(c.layers - 1) + ")");
    return c;
  }

  // The weights, in the order cost::weights() lists them (model/cost.hpp).
  static std::vector<block_params> declare_blocks(parameters<Mesh>& ps, const config& c) {
    const index_t M = c.model, N = c.heads, K = c.head_dim;
    const double sd_in = 1.0 / std::sqrt(double(M));
    std::vector<block_params> blocks;
    for (int l = 0; l < c.layers; ++l) {
      const std::string b = "block" + std::to_string(l) + ".";
      weight<"M"> norm1(ps, b + "norm1", {M}, init::ones());
      attention_params attn{weight<"MNK">(ps, b + "wq", {M, N, K}, init::normal(sd_in)),
                            weight<"MNK">(ps, b + "wk", {M, N, K}, init::normal(sd_in)),
                            weight<"MNK">(ps, b + "wv", {M, N, K}, init::normal(sd_in)),
                            weight<"NKM">(ps, b + "wo", {N, K, M}, init::normal(1.0 / std::sqrt(double(N * K))))};
      weight<"M"> norm2(ps, b + "norm2", {M}, init::ones());
      block_params bp{norm1, attn, norm2, std::nullopt, std::nullopt};
      const index_t H = c.ffn_hidden(l);
      if (c.is_moe(l)) {
        bp.moe.emplace(ps, b, M, H, c.experts, moe::layer_options{c.ffn, c.shared_experts, c.gating.balance, c.overlap_degree, c.all_to_all_wire});
      } else {
        bp.ffn.emplace(ps, c.ffn, std::array<std::string, 3>{b + "w1", b + "w1_up", b + "w2"}, shape<2>{M, H}, shape<2>{H, M});
      }
      blocks.push_back(std::move(bp));
    }
    return blocks;
  }

  // [B, L+1] -> inputs [B, L] and targets [B, L] (tokens[:, 1:]): local, L is
  // never split. A token outside the vocabulary is a fact of this rank's data
  // alone: it ends the job with its position.
  std::pair<named<std::int32_t, "BL", Mesh, at_tokens>, tensor<std::int32_t, 2, Mesh, sharding_by<at_tokens, "BL">>>
  split_tokens(const tokens_type& tokens) const {
    const index_t B = tokens.extent(0), L = tokens.extent(1) - 1;
    if (L < 1) throw shape_error("gshard::model::forward: tokens " + tokens.notation() + " need at least 2 per row");
    const index_t Bl = tokens.local_extents()[0];
    named<std::int32_t, "BL", Mesh, at_tokens> in(tokens.mesh(), {B, L});
    tensor<std::int32_t, 2, Mesh, sharding_by<at_tokens, "BL">> out(tokens.mesh(), {B, L});
    const std::int32_t* tok = tokens.data();
    for (index_t b = 0; b < Bl; ++b)
      for (index_t l = 0; l <= L; ++l) {
        const std::int32_t v = tok[b * (L + 1) + l];
        if (v < 0 || v >= c_.vocab)
          mpi::abort_job(("gshard::model::forward: token " + std::to_string(v) + " (row " + std::to_string(b) +
                          " of this rank, position " + std::to_string(l) + ") is outside the vocabulary of " +
                          std::to_string(c_.vocab))
                             .c_str());
        if (l < L) in.data()[b * L + l] = v;
        if (l > 0) out.data()[b * L + l - 1] = v;
      }
    return {std::move(in), std::move(out)};
  }

  config c_;
  weight<"VM"> embed_;
  std::optional<weight<"PM">> learned_positions_;             // [max_len, M]: position_kind::learned
  std::optional<named<T, "PM", Mesh, at_tokens>> sinusoids_;  // [max_len, M]: position_kind::sinusoidal
  std::vector<block_params> blocks_;
  weight<"M"> final_norm_;
  weight<"MV"> unembed_;
};

}  // namespace gshard::model
