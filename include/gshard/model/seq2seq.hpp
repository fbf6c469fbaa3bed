// gshard/model/seq2seq.hpp — GShard's own model in the small: a Transformer
// encoder–decoder with an MoE layer in place of every other FFN of both
// stacks (arXiv 2006.16668, the M4 model), sinusoidal positions, sources
// and targets of different lengths padded in one batch, and decoding with a
// cache — greedy and beam search, every rank in lockstep. Written
// forward-only: its backward is derived on a tape.
//   model::seq2seq<float, grid> m(ps, c);
//   auto out = m.forward(t, src, src_lengths, tgt, step);             // training
//   auto best = m.beam_search(src, src_lengths, {.width = 4}, step);  // decoding
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gshard/ad/communication.hpp"
#include "gshard/ad/nn.hpp"
#include "gshard/ad/ops.hpp"
#include "gshard/ad/remat.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/moe/layer.hpp"
#include "gshard/runtime/roles.hpp"
#include "gshard/state/parameters.hpp"

namespace gshard::model {

struct seq2seq_config {
  index_t vocab = 256;    // tokens of both sides, the begin and end tokens among them
  index_t model = 64;     // M
  index_t heads = 4;      // N
  index_t head_dim = 16;  // K
  index_t hidden = 128;   // H, of the dense FFNs and of each expert
  index_t experts = 8;    // E; 0: a dense model
  // A dense model's FFN width in blocks 1, 3, ... (where an MoE model has
  // its MoE layers); 0: `hidden`. 2·hidden matches top-2 routing's FLOPs.
  index_t slot_hidden = 0;
  int encoder_layers = 2;  // blocks of each stack; blocks 1, 3, ... have an MoE FFN
  int decoder_layers = 2;
  index_t max_len = 256;  // the longest source or target the sinusoids cover
  std::int32_t bos = 1;   // starts every target; decoding feeds it first
  std::int32_t eos = 2;   // ends a target; decoding stops a sequence there
  double aux_coef = 0.01;       // the loss adds aux_coef · Σ aux and gating.z_loss_coef · Σ z over MoE layers
  moe::gating_config gating{};  // the encoder's; the decoder's is the same placed by token
  // How the decoder's MoE layers place choices: by token (default) so no
  // output depends on a later target token and decoding with a cache routes
  // as training does; GShard's by_choice is the paper's.
  moe::placement decoder_order = moe::placement::by_token;
  ffn_kind ffn = ffn_kind::relu;
  wire all_to_all_wire = wire::same;  // what the MoE layers' all_to_alls carry (moe::layer_options)
  attention_memory attention = attention_memory::keep_probabilities;
  // Regularisation while training (on a tape that records; never when
  // evaluating or decoding). GShard's M4 setup: dropout 0.1 — here on the
  // sum of embeddings and positions and on each sublayer's output before it
  // joins the residual, as Vaswani et al. —; label smoothing 0.1, as
  // Lingvo's MT models use (here the target is (1 − ε)·onehot + ε/V, see
  // cross_entropy_options).
  double dropout = 0;
  double label_smoothing = 0;
  std::uint64_t dropout_seed = 0xD509;
  // Every block keeps only its input and runs again in the backward.
  bool remat = false;
  bool is_moe(int layer) const { return experts > 0 && layer % 2 == 1; }
  index_t ffn_hidden(int layer) const { return experts == 0 && layer % 2 == 1 && slot_hidden > 0 ? slot_hidden : hidden; }
  moe::gating_config decoder_gating() const {
    moe::gating_config g = gating;
    g.order = decoder_order;
    return g;
  }
};

// How beam_search decodes: `width` hypotheses per source, scored by their
// log-probability over GNMT's length penalty ((5 + len) / 6)^alpha; a
// hypothesis ends at eos (kept among the finished) or after max_steps tokens.
struct beam_options {
  int width = 4;
  double alpha = 0.6;
  index_t max_steps = 64;
};

// The shardings are those of model::transformer: the batch over the batch
// axes, experts over the expert axes, heads and hidden units over the model
// axes; sources, targets and lengths split like the batch.
template <class T, mesh_type Mesh, class Roles = default_roles>
class seq2seq {
 public:
  using roles = roles_on<Mesh, Roles>;
  using at_tokens = typename roles::at_tokens;
  template <fixed_string Term>
  using weight = param<named<T, Term, Mesh, at_tokens>>;
  using tokens_type = named<std::int32_t, "BL", Mesh, at_tokens>;  // sources [B, S], targets [B, L+1]
  using lengths_type = named<std::int32_t, "B", Mesh, at_tokens>;  // each source's real tokens
  using activation = named<T, "BLM", Mesh, at_tokens>;
  using keys_type = named<T, "BTNK", Mesh, at_tokens>;
  using logits_type = named<T, "BLV", Mesh, at_tokens>;
  using paddings_type = typename moe::layer<T, Mesh, Roles>::paddings_type;
  using scalar_var = var<tensor<double, 0, Mesh, replicate>>;

  struct attention_params {
    weight<"MNK"> wq, wk, wv;  // [M,N{model},K]
    weight<"NKM"> wo;          // [N{model},K,M]
  };
  using ffn_params = ffn_weights<named<T, "MH", Mesh, at_tokens>, named<T, "HM", Mesh, at_tokens>>;
  struct block_params {
    weight<"M"> norm1;
    attention_params self;
    std::optional<weight<"M">> norm_cross;        // decoder blocks
    std::optional<attention_params> cross;        // decoder blocks: queries over the encoder's output
    weight<"M"> norm2;
    std::optional<ffn_params> ffn;                  // dense blocks
    std::optional<moe::layer<T, Mesh, Roles>> moe;  // MoE blocks
  };

  // Declares "embed" (both sides' tokens), "enc<l>.…", "enc_norm",
  // "dec<l>.…" (with "dec<l>.cross_…"), "dec_norm" and "unembed" in `ps`.
  seq2seq(parameters<Mesh>& ps, const seq2seq_config& c)
      : params_(&ps),
        c_(checked(c)),
        embed_(ps, "embed", {c.vocab, c.model}, init::normal(1.0)),
        sinusoids_(sinusoidal_positions<T>(ps.mesh(), c.max_len, c.model)),
        encoder_(declare_blocks(ps, c, "enc", c.encoder_layers, false)),
        enc_norm_(ps, "enc_norm", {c.model}, init::ones()),
        decoder_(declare_blocks(ps, c, "dec", c.decoder_layers, true)),
        dec_norm_(ps, "dec_norm", {c.model}, init::ones()),
        unembed_(ps, "unembed", {c.model, c.vocab}, init::normal(1.0 / std::sqrt(double(c.model)))) {}

  const seq2seq_config& cfg() const { return c_; }
  const std::vector<block_params>& encoder_blocks() const { return encoder_; }
  const std::vector<block_params>& decoder_blocks() const { return decoder_; }
  const weight<"VM">& embedding_table() const { return embed_; }  // both sides' tokens
  const weight<"M">& encoder_norm() const { return enc_norm_; }
  const weight<"M">& decoder_norm() const { return dec_norm_; }
  const weight<"MV">& unembedding() const { return unembed_; }

  struct output {
    scalar_var loss;                      // cross-entropy (label-smoothed while training) + aux_coef · Σ aux + z_loss_coef · Σ z
    double ce = 0, aux = 0, z = 0;        // mean cross-entropy (unsmoothed) over the real target tokens; Σ aux, Σ z-loss
    std::vector<moe::gating_stats> moe;   // per MoE layer, encoder first
    var<logits_type> logits;              // [B, L, V]
  };

  // src [B, S] (positions from src_lengths[b] on are padding, whatever they
  // hold), tgt [B, L+1]: bos, the target, eos, then -1 as padding; predicts
  // tgt[:, 1:] from tgt[:, :-1] and the source. `step` keys the random
  // routing. The padding reaches no real token: attention skips padded keys,
  // the MoE layers route padded positions nowhere, the loss ignores them.
  output forward(tape& t, const tokens_type& src, const lengths_type& src_lengths, const tokens_type& tgt,
                 std::uint64_t step) const {
    std::vector<scalar_var> aux, z;
    std::vector<moe::gating_stats> stats;
    const auto memory = encode(t, src, src_lengths, step, &aux, &z, &stats);
    auto [inputs, labels, pads] = split_target(tgt);
    auto x = drop(embed(t, inputs, 0), step, 1, 0, 0);
    for (int l = 0; l < c_.decoder_layers; ++l) {
      const auto run = [this, l, step, pads, src_lengths](const var<activation>& in, const var<activation>& mem) {
        return decoder_block(in, mem, src_lengths, pads, l, step);
      };
      auto [y, a, zl, st] = c_.remat ? remat(run, x, memory) : run(x, memory);
      x = std::move(y);
      collect(a, zl, st, &aux, &z, &stats);
    }
    auto logits = einsum<"BLM,MV->BLV">(rms_norm(x, dec_norm_), unembed_);
    double ce_value = 0;
    auto ce = cross_entropy(logits, labels, {.label_smoothing = t.recording() ? c_.label_smoothing : 0.0, .unsmoothed = &ce_value});
    output out{ce, ce_value, 0.0, 0.0, std::move(stats), std::move(logits)};
    for (auto& a : aux) {
      out.aux += a.value().local()();
      if (c_.aux_coef != 0) out.loss = out.loss + c_.aux_coef * a;
    }
    for (auto& zl : z) {
      out.z += zl.value().local()();
      if (c_.gating.z_loss_coef != 0) out.loss = out.loss + c_.gating.z_loss_coef * zl;
    }
    return out;
  }

  // The encoder's output [B, S, M] (its padded rows finite, attended by
  // nothing). With `aux`, `z` and `stats`, each MoE layer's losses and
  // counters are appended.
  var<activation> encode(tape& t, const tokens_type& src, const lengths_type& src_lengths, std::uint64_t step,
                         std::vector<scalar_var>* aux = nullptr, std::vector<scalar_var>* z = nullptr,
                         std::vector<moe::gating_stats>* stats = nullptr) const {
    auto [tokens, pads] = split_source(src, src_lengths);
    auto x = drop(embed(t, tokens, 0), step, 0, 0, 0);
    for (int l = 0; l < c_.encoder_layers; ++l) {
      const auto run = [this, l, step, pads, src_lengths](const var<activation>& in) {
        return encoder_block(in, src_lengths, pads, l, step);
      };
      auto [y, a, zl, st] = c_.remat ? remat(run, x) : run(x);
      x = std::move(y);
      collect(a, zl, st, aux, z, stats);
    }
    return rms_norm(x, enc_norm_);
  }

  // What incremental decoding keeps: per decoder block the keys and values
  // of the positions decoded so far (a cache of max_steps positions, split
  // like the keys) and the encoder's keys and values for cross-attention
  // (computed once), per MoE block the routing state, the sources' lengths
  // and the next position.
  struct decode_state {
    std::vector<keys_type> self_k, self_v, cross_k, cross_v;
    std::vector<moe::routing_state> routing;  // one per MoE block of the decoder
    lengths_type src_lengths;
    index_t position = 0;
    index_t max_steps = 0;
    std::uint64_t step = 0;
  };

  // Runs the encoder once on src and makes the caches for up to max_steps
  // target positions (bos included). With causal routing (decoder_order
  // by_token) each MoE block routes as the full forward over max_steps
  // target positions would at evaluation.
  decode_state start_decoding(const tokens_type& src, const lengths_type& src_lengths, index_t max_steps,
                              std::uint64_t step) const {
    if (max_steps < 1 || max_steps > c_.max_len)
      throw error("gshard::model::seq2seq: decoding " + std::to_string(max_steps) + " positions; between 1 and config.max_len = " +
                  std::to_string(c_.max_len));
    if (c_.experts > 0 && c_.decoder_layers > 1 && c_.decoder_order != moe::placement::by_token)
      throw error("gshard::model::seq2seq: decoding routes the decoder's MoE layers one position at a time, which needs "
                  "config.decoder_order = placement::by_token (by_choice places a later token's first choice before an "
                  "earlier token's second)");
    tape t(params_of(), tape::no_grad);
    const auto memory = encode(t, src, src_lengths, step);
    decode_state st{{}, {}, {}, {}, {}, src_lengths, 0, max_steps, step};
    const index_t B = src.extent(0);
    for (const block_params& b : decoder_) {
      st.self_k.emplace_back(src.mesh(), shape<4>{B, max_steps, c_.heads, c_.head_dim});
      st.self_v.emplace_back(src.mesh(), shape<4>{B, max_steps, c_.heads, c_.head_dim});
      st.cross_k.push_back(relabel<"BTNK">(einsum<"BLM,MNK->BLNK">(memory, b.cross->wk)).value());
      st.cross_v.push_back(relabel<"BTNK">(einsum<"BLM,MNK->BLNK">(memory, b.cross->wv)).value());
      if (b.moe)
        st.routing.push_back(moe::start_routing(c_.decoder_gating(), c_.experts, max_steps, src.local_extents()[0]));
    }
    return st;
  }

  // The logits [B, 1, V] of the next position from the tokens `next` [B, 1]
  // fed at st.position; appends their keys and values to the caches. Every
  // rank calls it with the same state: the MoE blocks run one all_to_all
  // pair each.
  logits_type decode_step(decode_state& st, const tokens_type& next) const {
    if (next.extent(0) != st.src_lengths.extent(0) || next.extent(1) != 1)
      throw shape_error("gshard::model::seq2seq: decode_step takes one token per sequence, [" +
                        std::to_string(st.src_lengths.extent(0)) + ", 1] for this state; it was given " + gshard::detail::shape_text(next));
    if (st.position >= st.max_steps)
      throw error("gshard::model::seq2seq: decode_step at position " + std::to_string(st.position) + " of a cache of " +
                  std::to_string(st.max_steps) + " positions (start_decoding's max_steps)");
    tape t(params_of(), tape::no_grad);
    check_tokens(next, nullptr, "decode_step");
    auto x = embed(t, next, st.position);
    lengths_type seen(next.mesh(), {next.extent(0)});
    std::fill_n(seen.data(), seen.local().size(), std::int32_t(st.position + 1));
    const double scale = 1.0 / std::sqrt(double(c_.head_dim));
    std::size_t moe_block = 0;
    for (std::size_t l = 0; l < decoder_.size(); ++l) {
      const block_params& b = decoder_[l];
      const auto h = rms_norm(x, b.norm1);
      auto q = einsum<"BLM,MNK->BLNK">(h, b.self.wq);
      append(st.self_k[l], einsum<"BLM,MNK->BLNK">(h, b.self.wk).value(), st.position);
      append(st.self_v[l], einsum<"BLM,MNK->BLNK">(h, b.self.wv).value(), st.position);
      // The caches are read in place (plain tensors: nothing to differentiate).
      auto o = t.constant(dot_product_attention(q.value(), st.self_k[l], st.self_v[l], seen, scale));
      x = x + einsum<"BLNK,NKM->BLM", at_tokens>(o, b.self.wo);
      auto qc = einsum<"BLM,MNK->BLNK">(rms_norm(x, *b.norm_cross), b.cross->wq);
      auto oc = t.constant(dot_product_attention(qc.value(), st.cross_k[l], st.cross_v[l], st.src_lengths, scale));
      x = x + einsum<"BLNK,NKM->BLM", at_tokens>(oc, b.cross->wo);
      const auto h2 = rms_norm(x, b.norm2);
      if (b.moe) {
        auto r = (*b.moe)(relabel<"GSM">(h2), st.routing[moe_block++], c_.decoder_gating(), stream(st.step, 1, int(l)));
        x = x + relabel<"BLM">(std::move(r.y));
      } else {
        x = x + ffn<at_tokens>(h2, *b.ffn);
      }
    }
    ++st.position;
    return einsum<"BLM,MV->BLV">(rms_norm(x, dec_norm_), unembed_).value();
  }

  // Greedy decoding of each source: bos, then the most likely token (ties:
  // the lowest) until eos or max_steps tokens; every rank runs the same
  // steps, until no source anywhere is open. This rank's sequences, eos
  // included when reached.
  std::vector<std::vector<std::int32_t>> greedy(const tokens_type& src, const lengths_type& src_lengths, index_t max_steps,
                                                std::uint64_t step) const {
    const index_t Bl = src.local_extents()[0], V = c_.vocab, steps = std::min(max_steps, c_.max_len);
    decode_state st = start_decoding(src, src_lengths, steps, step);
    tokens_type next(src.mesh(), {src.extent(0), 1});
    std::fill_n(next.data(), next.local().size(), c_.bos);
    std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(Bl));
    std::vector<char> done(static_cast<std::size_t>(Bl), 0);
    for (index_t s = 0; s < steps; ++s) {
      const logits_type logits = decode_step(st, next);
      bool open = false;
      for (index_t b = 0; b < Bl; ++b) {
        if (done[std::size_t(b)]) continue;
        const T* row = logits.data() + b * V;
        const std::int32_t best = std::int32_t(std::max_element(row, row + V) - row);
        out[std::size_t(b)].push_back(best);
        next.data()[b] = best;
        done[std::size_t(b)] = best == c_.eos;
        open = open || !done[std::size_t(b)];
      }
      if (!any_rank(src, open)) break;
    }
    return out;
  }

  // Beam search: each source's `width` best hypotheses extended by every
  // token; of the 2·width best extensions, those ending at eos join the
  // finished and the first `width` others stay alive; scored by
  // log-probability / ((5 + len) / 6)^alpha (GNMT's length penalty, as
  // Lingvo decodes). Returns the best finished hypothesis of each of this
  // rank's sources (after max_steps tokens every live one finishes), eos
  // included when reached. Width 1 is greedy decoding. The rows of one source's beams stay on one rank
  // (the batch split by whole sources), so reordering them is local; every
  // rank runs the same steps, until no source anywhere has a live beam.
  std::vector<std::vector<std::int32_t>> beam_search(const tokens_type& src, const lengths_type& src_lengths,
                                                     const beam_options& o, std::uint64_t step) const {
    if (o.width < 1) throw error("gshard::model::seq2seq: beam width " + std::to_string(o.width) + "; at least 1");
    if (!(o.alpha >= 0) || !std::isfinite(o.alpha))
      throw error("gshard::model::seq2seq: beam alpha " + std::to_string(o.alpha) + "; a finite number >= 0");
    const index_t W = o.width, B = src.extent(0), Bl = src.local_extents()[0];
    const index_t steps = std::min(o.max_steps, c_.max_len);
    // The encoder runs once per source; the decoder, on each source's W
    // beams, rows b·W + w. So that a source's beams stay on its rank where
    // B does not divide, every rank's block holds `cap` sources, the
    // longest block of the sources' split: a shorter block's extra rows are
    // empty and never extended. Where B divides, cap = Bl.
    const index_t* sizes = src.mesh().sizes();
    const index_t cap = detail::max_block(tokens_type::resolved, 0, B, sizes);
    decode_state st = beams_of(start_decoding(src, src_lengths, steps, step), W, cap,
                               cap * detail::dim_parts(tokens_type::resolved, 0, sizes) * W, src.offsets()[0] * W);
    std::vector<beam_set> sources(static_cast<std::size_t>(Bl));
    for (beam_set& bs : sources) {
      bs.alive.resize(std::size_t(W));
      for (index_t w = 1; w < W; ++w) bs.alive[std::size_t(w)].logp = -std::numeric_limits<double>::infinity();  // one start
    }
    tokens_type next(src.mesh(), {st.src_lengths.extent(0), 1});
    std::fill_n(next.data(), next.local().size(), c_.bos);
    std::vector<index_t> parent(static_cast<std::size_t>(cap * W));
    for (index_t s = 0; s < steps; ++s) {
      const logits_type logits = decode_step(st, next);
      bool live = false;
      for (index_t b = 0; b < Bl; ++b) {
        beam_set& bs = sources[std::size_t(b)];
        live = extend(bs, logits.data() + b * W * c_.vocab, W, s + 1 == steps, o.alpha, steps, parent.data() + b * W) || live;
        for (index_t w = 0; w < W; ++w) {
          parent[std::size_t(b * W + w)] += b * W;
          const hypothesis& h = bs.alive[std::size_t(w)];
          next.data()[b * W + w] = h.tokens.empty() ? c_.eos : h.tokens.back();
        }
      }
      for (index_t r = Bl * W; r < cap * W; ++r) parent[std::size_t(r)] = r, next.data()[r] = c_.eos;  // the empty rows
      reorder(st, parent);
      if (!any_rank(src, live)) break;
    }
    std::vector<std::vector<std::int32_t>> best(static_cast<std::size_t>(Bl));
    for (index_t b = 0; b < Bl; ++b) {
      const beam_set& bs = sources[std::size_t(b)];
      double top = -std::numeric_limits<double>::infinity();
      for (const hypothesis& h : bs.finished.empty() ? bs.alive : bs.finished)
        if (const double sc = h.logp / length_penalty(h.tokens.size(), o.alpha); sc > top) top = sc, best[std::size_t(b)] = h.tokens;
    }
    return best;
  }

 private:
  // The decoding state of st's sources widened to W beams each: every
  // cache's row b repeated at rows b·W + w of a block of cap·W rows (the
  // rows past Bl·W empty, of length 0), Bw rows in all; each MoE block's
  // routing for those rows, its random draws keyed by first_row + r (a
  // 1-rank run's rows of the same sources).
  decode_state beams_of(decode_state st, index_t W, index_t cap, index_t Bw, index_t first_row) const {
    const auto& m = st.src_lengths.mesh();
    const index_t Bl = st.src_lengths.local_extents()[0], rows = cap * W;
    auto widen = [&](const keys_type& k, bool copy) {
      const auto e = k.extents();
      keys_type out(m, shape<4>{Bw, e[1], e[2], e[3]});
      const index_t width = out.local().size() / rows;
      std::fill_n(out.data(), out.local().size(), T(0));
      if (copy)
        for (index_t b = 0; b < Bl; ++b)
          for (index_t w = 0; w < W; ++w) std::copy_n(k.data() + b * width, width, out.data() + (b * W + w) * width);
      return out;
    };
    decode_state wide{{}, {}, {}, {}, {}, lengths_type(m, {Bw}), st.position, st.max_steps, st.step};
    for (std::size_t i = 0; i < st.self_k.size(); ++i) {
      wide.self_k.push_back(widen(st.self_k[i], false)), wide.self_v.push_back(widen(st.self_v[i], false));
      wide.cross_k.push_back(widen(st.cross_k[i], true)), wide.cross_v.push_back(widen(st.cross_v[i], true));
    }
    for (std::size_t i = 0; i < st.routing.size(); ++i) {
      wide.routing.push_back(moe::start_routing(c_.decoder_gating(), c_.experts, st.max_steps, rows));
      wide.routing.back().first_group = first_row;
    }
    std::fill_n(wide.src_lengths.data(), rows, 0);
    for (index_t b = 0; b < Bl; ++b)
      for (index_t w = 0; w < W; ++w) wide.src_lengths.data()[b * W + w] = st.src_lengths.data()[b];
    return wide;
  }

  struct hypothesis {
    std::vector<std::int32_t> tokens;
    double logp = 0;
    bool alive = true;
  };
  // One source's beams: `width` alive (dead ones hold -inf), and the finished.
  struct beam_set {
    std::vector<hypothesis> alive, finished;
  };
  // GNMT's ((5 + len) / 6)^alpha.
  static double length_penalty(std::size_t len, double alpha) { return std::pow((5.0 + double(len)) / 6.0, alpha); }

  // One step of one source's beams from their logits (rows [W, V]): every
  // live beam extended by every token; of the 2W best extensions (ties: the
  // lower beam, then the lower token) those ending at eos — or all, at the
  // last step — join the finished and the first W others stay alive.
  // parent[w] receives the beam new beam w continues. Returns whether the
  // source stays open: fewer than W finished (fairseq's stop: width 1 is
  // greedy) and a live beam that could still beat the best finished one
  // (GNMT's bound: log-probabilities only fall, the penalty grows at most
  // to that of max_steps tokens).
  bool extend(beam_set& bs, const T* rows, index_t W, bool last, double alpha, index_t steps, index_t* parent) const {
    const index_t V = c_.vocab;
    struct candidate {
      double logp;
      index_t from;
      std::int32_t token;
    };
    std::vector<candidate> cands;
    for (index_t w = 0; w < W; ++w) {
      const hypothesis& h = bs.alive[std::size_t(w)];
      if (!h.alive || !std::isfinite(h.logp)) continue;
      const T* row = rows + w * V;
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (index_t v = 0; v < V; ++v) mx = std::max(mx, double(row[v]));
      for (index_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
      const double lse = mx + std::log(sum);
      for (index_t v = 0; v < V; ++v) cands.push_back({h.logp + double(row[v]) - lse, w, std::int32_t(v)});
    }
    const std::size_t keep = std::min(cands.size(), std::size_t(2 * W));
    std::partial_sort(cands.begin(), cands.begin() + std::ptrdiff_t(keep), cands.end(), [](const candidate& a, const candidate& c) {
      return a.logp != c.logp ? a.logp > c.logp : a.from != c.from ? a.from < c.from : a.token < c.token;
    });
    std::vector<hypothesis> alive;
    for (std::size_t i = 0; i < keep && index_t(alive.size()) < W; ++i) {
      const candidate& c = cands[i];
      hypothesis h{bs.alive[std::size_t(c.from)].tokens, c.logp, true};
      h.tokens.push_back(c.token);
      if (c.token == c_.eos || last) {
        h.alive = false;
        bs.finished.push_back(std::move(h));
      } else {
        parent[alive.size()] = c.from;
        alive.push_back(std::move(h));
      }
    }
    double best_done = -std::numeric_limits<double>::infinity();
    for (const hypothesis& h : bs.finished) best_done = std::max(best_done, h.logp / length_penalty(h.tokens.size(), alpha));
    const bool open = index_t(bs.finished.size()) < W && !alive.empty() &&
                      alive.front().logp / length_penalty(std::size_t(steps), alpha) > best_done;
    while (index_t(alive.size()) < W) {
      parent[alive.size()] = 0;
      alive.push_back({{}, -std::numeric_limits<double>::infinity(), false});
    }
    if (!open)
      for (hypothesis& h : alive) h.alive = false;
    bs.alive = std::move(alive);
    return open;
  }

  // The random routing's key of a layer: the step, the stack (encoder 0,
  // decoder 1) and the block.
  static std::uint64_t stream(std::uint64_t step, int stack, int layer) {
    return (step << 17) | (std::uint64_t(stack) << 16) | std::uint64_t(layer);
  }

  parameters<Mesh>& params_of() const { return *params_; }

  // Whether `open` holds on any rank: one all_reduce of a maximum over the
  // whole mesh, so every rank runs the same decoding steps.
  static bool any_rank(const tokens_type& src, bool open) {
    std::vector<double> v{open ? 1.0 : 0.0};
    all_reduce<double>(src.mesh().all_axes(), v, reduction::max);
    return v[0] != 0;
  }

  static const seq2seq_config& checked(const seq2seq_config& c) {
    if (c.experts < 0 || c.slot_hidden < 0 || (c.slot_hidden > 0 && c.experts > 0))
      throw error("gshard::model::seq2seq: config.experts = " + std::to_string(c.experts) + " and config.slot_hidden = " +
                  std::to_string(c.slot_hidden) + ": experts is >= 0, and slot_hidden (>= 0) is for a dense model (experts = 0)");
    if (c.experts > 0) moe::validate(c.gating, c.experts);
    for (const auto& [name, v] : {std::pair{"dropout", c.dropout}, std::pair{"label_smoothing", c.label_smoothing}})
      if (!(v >= 0 && v < 1))
        throw error(std::string("gshard::model::seq2seq: config.") + name + " = " + std::to_string(v) + "; it must lie in [0, 1)");
    if (c.max_len < 2) throw error("gshard::model::seq2seq: config.max_len = " + std::to_string(c.max_len) + "; at least 2");
    if (c.encoder_layers < 0 || c.decoder_layers < 1 || c.encoder_layers > 1000 || c.decoder_layers > 1000)
      throw error("gshard::model::seq2seq: config.encoder_layers = " + std::to_string(c.encoder_layers) +
                  ", decoder_layers = " + std::to_string(c.decoder_layers) + ": 0 to 1000 and 1 to 1000");
    for (const auto& [name, v] : {std::pair{"bos", c.bos}, std::pair{"eos", c.eos}})
      if (v < 0 || v >= c.vocab)
        throw error(std::string("gshard::model::seq2seq: config.") + name + " = " + std::to_string(v) +
                    " is outside the vocabulary of " + std::to_string(c.vocab));
    return c;
  }

  std::vector<block_params> declare_blocks(parameters<Mesh>& ps, const seq2seq_config& c, const std::string& stack, int layers,
                                           bool decoder) {
    const index_t M = c.model, N = c.heads, K = c.head_dim;
    const double sd_in = 1.0 / std::sqrt(double(M)), sd_out = 1.0 / std::sqrt(double(N * K));
    const auto attn = [&](const std::string& p) {
      return attention_params{weight<"MNK">(ps, p + "wq", {M, N, K}, init::normal(sd_in)),
                              weight<"MNK">(ps, p + "wk", {M, N, K}, init::normal(sd_in)),
                              weight<"MNK">(ps, p + "wv", {M, N, K}, init::normal(sd_in)),
                              weight<"NKM">(ps, p + "wo", {N, K, M}, init::normal(sd_out))};
    };
    std::vector<block_params> blocks;
    for (int l = 0; l < layers; ++l) {
      const std::string b = stack + std::to_string(l) + ".";
      weight<"M"> norm1(ps, b + "norm1", {M}, init::ones());
      auto self = attn(b);
      std::optional<weight<"M">> norm_cross;
      std::optional<attention_params> cross;
      if (decoder) norm_cross.emplace(ps, b + "norm_cross", shape<1>{M}, init::ones()), cross.emplace(attn(b + "cross_"));
      weight<"M"> norm2(ps, b + "norm2", {M}, init::ones());
      block_params bp{norm1, self, norm_cross, cross, norm2, std::nullopt, std::nullopt};
      if (c.is_moe(l)) bp.moe.emplace(ps, b, M, c.hidden, c.experts, moe::layer_options{c.ffn, 0, c.gating.balance, 1, c.all_to_all_wire});
      else bp.ffn.emplace(ps, c.ffn, std::array<std::string, 3>{b + "w1", b + "w1_up", b + "w2"},
                          shape<2>{M, c.ffn_hidden(l)}, shape<2>{c.ffn_hidden(l), M});
      blocks.push_back(std::move(bp));
    }
    return blocks;
  }

  // Token embeddings plus the sinusoids of positions offset, offset + 1, ...
  var<activation> embed(tape& t, const named<std::int32_t, "BL", Mesh, at_tokens>& tokens, index_t offset) const {
    if (offset + tokens.extent(1) > c_.max_len)
      throw shape_error("gshard::model::seq2seq: " + std::to_string(offset + tokens.extent(1)) +
                        " positions; config.max_len = " + std::to_string(c_.max_len));
    return embedding(t, tokens, embed_) + embedding(t, positions_of(tokens, offset), t.constant_ref(sinusoids_));
  }

  // Self-attention of h: causal, or bidirectional over each sequence's
  // `lengths` keys. Under bf16 GEMMs q, k and v are written in bf16, the
  // only form the attention reads (bf16_activation); so in cross_attention.
  template <class H>
  auto self_attention(const H& h, const attention_params& a, const lengths_type* lengths, attention_options o) const {
    const double scale = 1.0 / std::sqrt(double(c_.head_dim));
    using qkv = bf16_activation;
    auto q = einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wq);
    auto k = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wk));
    auto v = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wv));
    auto out = lengths ? dot_product_attention(q, k, v, *lengths, scale, o) : dot_product_attention(q, k, v, scale, o);
    return einsum<"BLNK,NKM->BLM", at_tokens>(out, a.wo);
  }

  // The decoder's queries over the encoder's output, its padded keys skipped.
  template <class H, class Mem>
  auto cross_attention(const H& h, const Mem& memory, const attention_params& a, const lengths_type& src_lengths) const {
    const double scale = 1.0 / std::sqrt(double(c_.head_dim));
    using qkv = bf16_activation;
    auto q = einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(h, a.wq);
    auto k = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(memory, a.wk));
    auto v = relabel<"BTNK">(einsum<"BLM,MNK->BLNK", natural_sharding, qkv>(memory, a.wv));
    return einsum<"BLNK,NKM->BLM", at_tokens>(dot_product_attention(q, k, v, src_lengths, scale, {false, 0, c_.attention}),
                                               a.wo);
  }

  // A block's output, and an MoE block's aux loss, z-loss and counters.
  using block_out =
      std::tuple<var<activation>, std::optional<scalar_var>, std::optional<scalar_var>, std::optional<moe::gating_stats>>;

  // Encoder block l: x + self-attention(norm(x)) over the real keys, then
  // x + FFN(norm(x)); each sublayer's output dropped out while training.
  block_out encoder_block(const var<activation>& in, const lengths_type& src_lengths, const paddings_type& pads, int l,
                          std::uint64_t step) const {
    const block_params& b = encoder_[std::size_t(l)];
    auto x = in + drop(self_attention(rms_norm(in, b.norm1), b.self, &src_lengths, {false, 0, c_.attention}), step, 0, l, 1);
    return block_ffn(b, std::move(x), pads, c_.gating, step, 0, l);
  }

  // Decoder block l: causal self-attention, cross-attention over the
  // encoder's output `memory`, the FFN (routed by token).
  block_out decoder_block(const var<activation>& in, const var<activation>& memory, const lengths_type& src_lengths,
                          const paddings_type& pads, int l, std::uint64_t step) const {
    const block_params& b = decoder_[std::size_t(l)];
    auto x = in + drop(self_attention(rms_norm(in, b.norm1), b.self, nullptr, {true, 0, c_.attention}), step, 1, l, 1);
    x = x + drop(cross_attention(rms_norm(x, *b.norm_cross), memory, *b.cross, src_lengths), step, 1, l, 2);
    return block_ffn(b, std::move(x), pads, c_.decoder_gating(), step, 1, l);
  }

  // x + the block's FFN of norm(x): dense, or the MoE layer over the groups
  // G = B of S = L positions with the paddings.
  block_out block_ffn(const block_params& b, var<activation> x, const paddings_type& pads, const moe::gating_config& g,
                      std::uint64_t step, int stack, int l) const {
    const auto h = rms_norm(x, b.norm2);
    if (!b.moe) return {x + drop(ffn<at_tokens>(h, *b.ffn), step, stack, l, 3), std::nullopt, std::nullopt, std::nullopt};
    auto r = (*b.moe)(relabel<"GSM">(h), pads, g, stream(step, stack, l));
    return {x + drop(relabel<"BLM">(std::move(r.y)), step, stack, l, 3), std::move(r.aux), std::move(r.z_loss),
            std::move(r.stats)};
  }

  static void collect(std::optional<scalar_var>& a, std::optional<scalar_var>& zl, std::optional<moe::gating_stats>& st,
                      std::vector<scalar_var>* aux, std::vector<scalar_var>* z, std::vector<moe::gating_stats>* stats) {
    if (!a) return;
    if (aux) aux->push_back(std::move(*a));
    if (z) z->push_back(std::move(*zl));
    if (stats) stats->push_back(std::move(*st));
  }

  // Dropout of a sublayer's output (site 1: self-attention, 2:
  // cross-attention, 3: FFN) or of the embeddings (site 0) while training;
  // each (step, stack, block, site) draws its own mask.
  template <class V>
  auto drop(V&& x, std::uint64_t step, int stack, int l, int site) const {
    using X = gshard::detail::tensor_of<V>;
    if (c_.dropout == 0 || !x.on_tape().recording()) return var<X>(std::forward<V>(x));
    const std::uint64_t s = (step << 16) | (std::uint64_t(stack) << 15) | (std::uint64_t(l) << 4) | std::uint64_t(site);
    return dropout(std::forward<V>(x), c_.dropout, c_.dropout_seed, s);
  }

  // Ends the job naming a token outside the vocabulary at a real position
  // (`lengths`: a source's; null: every position) — this rank's data alone.
  void check_tokens(const tokens_type& tokens, const lengths_type* lengths, const char* what) const {
    const auto le = tokens.local_extents();
    for (index_t b = 0; b < le[0]; ++b) {
      const index_t n = lengths ? lengths->data()[b] : le[1];
      if (n < 0 || n > le[1])
        mpi::abort_job(("gshard::model::seq2seq::" + std::string(what) + ": source length " + std::to_string(n) + " (row " +
                        std::to_string(b) + " of this rank) is outside [0, " + std::to_string(le[1]) + "]")
                           .c_str());
      for (index_t l = 0; l < n; ++l)
        if (const std::int32_t v = tokens.data()[b * le[1] + l]; v < 0 || v >= c_.vocab)
          mpi::abort_job(("gshard::model::seq2seq::" + std::string(what) + ": token " + std::to_string(v) + " (row " +
                          std::to_string(b) + " of this rank, position " + std::to_string(l) +
                          ") is outside the vocabulary of " + std::to_string(c_.vocab))
                             .c_str());
    }
  }

  // The source's tokens with padded positions set to 0, and its paddings.
  std::pair<tokens_type, paddings_type> split_source(const tokens_type& src, const lengths_type& lengths) const {
    if (lengths.extent(0) != src.extent(0))
      throw shape_error("gshard::model::seq2seq: source lengths " + lengths.notation() + " for sources " + src.notation());
    check_tokens(src, &lengths, "forward");
    const auto le = src.local_extents();
    tokens_type tok(src.mesh(), src.extents());
    paddings_type pads(src.mesh(), src.extents());
    for (index_t b = 0; b < le[0]; ++b)
      for (index_t l = 0; l < le[1]; ++l) {
        const bool pad = l >= lengths.data()[b];
        tok.data()[b * le[1] + l] = pad ? 0 : src.data()[b * le[1] + l];
        pads.data()[b * le[1] + l] = pad ? T(1) : T(0);
      }
    return {std::move(tok), std::move(pads)};
  }

  // tgt [B, L+1] -> inputs [B, L] (padding -1 read as token 0), labels [B, L]
  // (tgt[:, 1:], -1 ignored by the loss) and the inputs' paddings.
  std::tuple<tokens_type, tensor<std::int32_t, 2, Mesh, sharding_by<at_tokens, "BL">>, paddings_type>
  split_target(const tokens_type& tgt) const {
    const index_t B = tgt.extent(0), L = tgt.extent(1) - 1;
    if (L < 1) throw shape_error("gshard::model::seq2seq: targets " + tgt.notation() + " need at least 2 per row");
    const index_t Bl = tgt.local_extents()[0];
    tokens_type in(tgt.mesh(), {B, L});
    tensor<std::int32_t, 2, Mesh, sharding_by<at_tokens, "BL">> out(tgt.mesh(), {B, L});
    paddings_type pads(tgt.mesh(), {B, L});
    for (index_t b = 0; b < Bl; ++b)
      for (index_t l = 0; l <= L; ++l) {
        const std::int32_t v = tgt.data()[b * (L + 1) + l];
        if (v < -1 || v >= c_.vocab)
          mpi::abort_job(("gshard::model::seq2seq::forward: target token " + std::to_string(v) + " (row " + std::to_string(b) +
                          " of this rank, position " + std::to_string(l) + ") is outside the vocabulary of " +
                          std::to_string(c_.vocab) + " (-1: padding)")
                             .c_str());
        if (l < L) in.data()[b * L + l] = std::max(v, 0), pads.data()[b * L + l] = v < 0 ? T(1) : T(0);
        if (l > 0) out.data()[b * L + l - 1] = v;
      }
    return {std::move(in), std::move(out), std::move(pads)};
  }

  // Writes the new position's keys [B, 1, N, K] into the cache [B, P, N, K].
  static void append(keys_type& cache, const named<T, "BLNK", Mesh, at_tokens>& kv, index_t position) {
    const auto ce = cache.local_extents(), ke = kv.local_extents();
    const index_t row = ce[2] * ce[3];
    for (index_t b = 0; b < ce[0]; ++b) std::copy_n(kv.data() + b * ke[1] * row, row, cache.data() + (b * ce[1] + position) * row);
  }

  // The caches' rows (and the MoE blocks' counts) taken from the parents of
  // this rank's beams: of each cache row only the positions decoded so far.
  static void reorder(decode_state& st, const std::vector<index_t>& parent) {
    const index_t rows = index_t(parent.size());
    const auto take = [&](auto* data, index_t width, index_t used) {
      std::vector<std::remove_cvref_t<decltype(*data)>> copy(std::size_t(rows * used));
      for (index_t r = 0; r < rows; ++r) std::copy_n(data + r * width, used, copy.data() + r * used);
      for (index_t r = 0; r < rows; ++r) std::copy_n(copy.data() + parent[std::size_t(r)] * used, used, data + r * width);
    };
    for (auto* caches : {&st.self_k, &st.self_v})
      for (auto& c : *caches) {
        const index_t width = c.local().size() / rows;
        take(c.data(), width, width / st.max_steps * st.position);
      }
    for (auto& r : st.routing) take(r.filled.data(), index_t(r.filled.size()) / rows, index_t(r.filled.size()) / rows);
  }

  parameters<Mesh>* params_ = nullptr;
  seq2seq_config c_;
  weight<"VM"> embed_;
  named<T, "PM", Mesh, at_tokens> sinusoids_;
  std::vector<block_params> encoder_;
  weight<"M"> enc_norm_;
  std::vector<block_params> decoder_;
  weight<"M"> dec_norm_;
  weight<"MV"> unembed_;
};

}  // namespace gshard::model
