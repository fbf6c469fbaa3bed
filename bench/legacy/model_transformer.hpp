// bench/legacy/ (frozen copy of gshard/model/transformer.hpp — a byte-level language model of pre-norm
// Transformer blocks: x + attention(norm(x)), then x + ffn(norm(x)), with the
// FFN an MoE layer in every other block (blocks 1, 3, ...). The batch is
// split over every mesh axis but "model" (the MoE layer's groups are its
// sequences); experts are split over "expert". If the mesh has a "model"
// axis, the attention heads and the hidden units of the dense FFNs and of
// each expert are split over it (Megatron-style: q, k, v and w1 split their
// output, wo and w2 their input); every other weight is replicated. Written
// as einsums on whole tensors: the shardings decide the communication — in
// the forward the MoE layers' all_to_alls, and with a "model" axis one
// all_reduce over it after each attention, dense FFN and expert FFN; in the
// backward their transposes and the all_reduces of the weights' gradients
// over the batch axes, which come from the types (a weight replicated over
// the ranks that split the batch).
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "gshard/einsum.hpp"
#include "gshard/grad.hpp"
#include "moe_backward.hpp"
#include "moe_layer.hpp"
#include "gshard/ops.hpp"

namespace legacy::model {
using namespace gshard;

struct config {
  index_t vocab = 256;    // bytes
  index_t model = 64;     // M
  index_t heads = 4;      // N
  index_t head_dim = 16;  // K
  index_t hidden = 128;   // H, of the dense FFNs and of each expert
  index_t experts = 8;    // E
  int layers = 4;         // blocks; blocks 1, 3, ... have an MoE FFN
  double aux_coef = 0.01;
  moe::gating_config gating{};
  bool is_moe(int layer) const { return layer % 2 == 1; }
};

template <mesh_type Mesh>
using batch_split = typename moe::shardings<Mesh>::by_group;  // [B{data,expert},...]

namespace detail {
// Dim BatchDim (if >= 0) split over the batch axes, and dim ModelDim over
// "model" if the mesh has that axis.
template <class Mesh, int BatchDim, int ModelDim>
struct model_spec {
  static constexpr gshard::detail::layout_spec value = moe::detail::over_model<Mesh>(
      BatchDim >= 0 ? moe::detail::split_groups<Mesh>(BatchDim, false) : gshard::detail::layout_spec{}, ModelDim);
};
template <class Mesh>
struct partial_spec {  // pending sums over every axis that splits the batch
  static constexpr gshard::detail::layout_spec value = [] {
    gshard::detail::spec_result r;
    for (const gshard::detail::name_t& a : Mesh::names)
      if (moe::detail::is_batch_axis(a.view())) gshard::detail::add_partial(r, &a, 1);
    return r.spec;
  }();
};
}  // namespace detail
// A weight's gradient before the data-parallel reduction: partial over the batch axes.
template <mesh_type Mesh>
using batch_partial = moe::detail::layout_of<detail::partial_spec<Mesh>::value>;

// A weight with dim Dim split over "model" (replicated if the mesh has no such axis).
template <mesh_type Mesh, int Dim>
using over_model = moe::detail::layout_of<detail::model_spec<Mesh, -1, Dim>::value>;
// An activation with the batch split over the batch axes and dim Dim over "model".
template <mesh_type Mesh, int Dim>
using batch_over_model = moe::detail::layout_of<detail::model_spec<Mesh, 0, Dim>::value>;

template <class T, mesh_type Mesh>
using rep1 = tensor<T, 1, Mesh, replicate>;
template <class T, mesh_type Mesh>
using rep2 = tensor<T, 2, Mesh, replicate>;

template <class T, mesh_type Mesh>
struct block_params {
  rep1<T, Mesh> norm1, norm2;                                        // [M]
  tensor<T, 3, Mesh, over_model<Mesh, 1>> wq, wk, wv;                // [M,N{model},K]
  tensor<T, 3, Mesh, over_model<Mesh, 0>> wo;                        // [N{model},K,M]
  std::optional<tensor<T, 2, Mesh, over_model<Mesh, 1>>> w1;         // dense blocks: [M,H{model}]
  std::optional<tensor<T, 2, Mesh, over_model<Mesh, 0>>> w2;         //               [H{model},M]
  std::optional<moe::params<T, Mesh>> moe;                           // MoE blocks
};

template <class T, mesh_type Mesh>
struct params {
  rep2<T, Mesh> embed;  // [V,M]
  std::vector<block_params<T, Mesh>> blocks;
  rep1<T, Mesh> final_norm;  // [M]
  rep2<T, Mesh> unembed;     // [M,V]
};

// f(name, tensor of ps[0], tensor of ps[1], ...) for every parameter, in a
// fixed order: gradients, optimizer state and checkpoints walk the same list.
template <class F, class P, class... Ps>
void for_each_param(F&& f, P& p, Ps&... ps) {
  f("embed", p.embed, ps.embed...);
  for (std::size_t l = 0; l < p.blocks.size(); ++l) {
    const std::string b = "block" + std::to_string(l) + ".";
    f(b + "norm1", p.blocks[l].norm1, ps.blocks[l].norm1...);
    f(b + "wq", p.blocks[l].wq, ps.blocks[l].wq...);
    f(b + "wk", p.blocks[l].wk, ps.blocks[l].wk...);
    f(b + "wv", p.blocks[l].wv, ps.blocks[l].wv...);
    f(b + "wo", p.blocks[l].wo, ps.blocks[l].wo...);
    f(b + "norm2", p.blocks[l].norm2, ps.blocks[l].norm2...);
    if (p.blocks[l].moe) {
      f(b + "gate", p.blocks[l].moe->gate, ps.blocks[l].moe->gate...);
      f(b + "wi", p.blocks[l].moe->wi, ps.blocks[l].moe->wi...);
      f(b + "wo_experts", p.blocks[l].moe->wo, ps.blocks[l].moe->wo...);
    } else {
      f(b + "w1", *p.blocks[l].w1, *ps.blocks[l].w1...);
      f(b + "w2", *p.blocks[l].w2, *ps.blocks[l].w2...);
    }
  }
  f("final_norm", p.final_norm, ps.final_norm...);
  f("unembed", p.unembed, ps.unembed...);
}

// Parameters that depend only on (config, seed): the same at every rank count.
template <class T, mesh_type Mesh>
params<T, Mesh> init(const Mesh& m, const config& c, std::uint64_t seed) {
  if constexpr (Mesh::index_of("model") >= 0) {  // name the setting, not just the tensor, that does not divide
    const index_t parts = m.size(Mesh::index_of("model"));
    for (const auto& [name, v] : {std::pair{"heads", c.heads}, std::pair{"hidden", c.hidden}})
      if (v % parts != 0)
        throw shape_error(std::string("gshard::model::init: config.") + name + " = " + std::to_string(v) +
                          " is not divisible by the \"model\" axis of " + m.describe() +
                          ": the heads and the FFNs' hidden units are split over it");
  }
  std::uint64_t id = 1000;
  // Each tensor draws from its own id, in this order, by global index.
  auto normal = [&]<class X>(X t, double sd) {
    moe::init_normal(t, sd, seed, id++);
    return t;
  };
  auto normal2 = [&](index_t a, index_t b, double sd) { return normal(rep2<T, Mesh>(m, {a, b}), sd); };
  using qkv_t = tensor<T, 3, Mesh, over_model<Mesh, 1>>;
  using wo_t = tensor<T, 3, Mesh, over_model<Mesh, 0>>;
  auto ones = [&](index_t n) {
    rep1<T, Mesh> t(m, {n});
    t.local().setConstant(T(1));
    return t;
  };
  const index_t M = c.model, N = c.heads, K = c.head_dim, H = c.hidden;
  params<T, Mesh> p{normal2(c.vocab, M, 1.0), {}, ones(M), normal2(M, c.vocab, 1.0 / std::sqrt(double(M)))};
  const double sd_in = 1.0 / std::sqrt(double(M));
  for (int l = 0; l < c.layers; ++l) {
    block_params<T, Mesh> b{ones(M), ones(M),
                            normal(qkv_t(m, {M, N, K}), sd_in), normal(qkv_t(m, {M, N, K}), sd_in),
                            normal(qkv_t(m, {M, N, K}), sd_in), normal(wo_t(m, {N, K, M}), 1.0 / std::sqrt(double(N * K))),
                            {}, {}, {}};
    if (c.is_moe(l)) b.moe = moe::init_params<T>(m, M, H, c.experts, seed, std::uint64_t(l + 1));
    else {
      b.w1 = normal(tensor<T, 2, Mesh, over_model<Mesh, 1>>(m, {M, H}), sd_in);
      b.w2 = normal(tensor<T, 2, Mesh, over_model<Mesh, 0>>(m, {H, M}), 1.0 / std::sqrt(double(H)));
    }
    p.blocks.push_back(std::move(b));
  }
  return p;
}

// Parameters of the same shapes, all zero: a gradient or an optimizer state.
template <class T, mesh_type Mesh>
params<T, Mesh> zeros_like(const params<T, Mesh>& p) {
  params<T, Mesh> z = p;
  for_each_param([](const std::string&, auto& t) { t.local().setZero(); }, z);
  return z;
}

template <class T, mesh_type Mesh>
using activation = tensor<T, 3, Mesh, batch_split<Mesh>>;  // [B{data,expert},L,M]
template <class T, mesh_type Mesh>
using heads_blnk = tensor<T, 4, Mesh, batch_over_model<Mesh, 2>>;  // [B{data,expert},L,N{model},K]
template <class T, mesh_type Mesh>
using heads_bnlt = tensor<T, 4, Mesh, batch_over_model<Mesh, 1>>;  // [B{data,expert},N{model},L,T]

// What the backward needs from one block's forward.
template <class T, mesh_type Mesh>
struct block_cache {
  std::optional<activation<T, Mesh>> x, h1, x_mid, h2;           // input, norm1(x), after attention, norm2
  std::optional<heads_blnk<T, Mesh>> q, k, v, o;                  // attention
  std::optional<heads_bnlt<T, Mesh>> probs;
  std::optional<tensor<T, 3, Mesh, batch_over_model<Mesh, 2>>> r;  // dense FFN: relu(BLM,MH->BLH) [B,L,H{model}]
  std::optional<moe::output<T, Mesh>> moe_out;                    // MoE: routing
  moe::cache<T, Mesh> moe;
};

// Causal self-attention: q, k, v = BLM,MNK->BLNK; logits BLNK,BTNK->BNLT
// scaled by 1/sqrt(K) and masked; softmax over T; BNLT,BTNK->BLNK; BLNK,NKM->BLM.
// Each rank computes its heads; the output projection sums over heads, so
// with a "model" axis it ends in one all_reduce over it.
template <class T, mesh_type Mesh>
activation<T, Mesh> attention(const activation<T, Mesh>& h, const block_params<T, Mesh>& b,
                              block_cache<T, Mesh>* keep = nullptr) {
  auto q = einsum<"BLM,MNK->BLNK">(h, b.wq);  // [B{data,expert},L,N{model},K]
  auto k = einsum<"BLM,MNK->BLNK">(h, b.wk);
  auto v = einsum<"BLM,MNK->BLNK">(h, b.wv);
  auto logits = einsum<"BLNK,BTNK->BNLT">(q, k);  // [B{data,expert},N{model},L,T]
  const auto le = logits.local_extents();
  const index_t L = le[2], Tn = le[3];
  const T scale = T(1) / std::sqrt(T(b.wq.extent(2)));
  T* p = logits.data();
  for (index_t bn = 0; bn < le[0] * le[1]; ++bn)
    for (index_t l = 0; l < L; ++l, p += Tn)
      for (index_t t = 0; t < Tn; ++t) p[t] = t <= l ? p[t] * scale : -std::numeric_limits<T>::infinity();
  auto probs = softmax(std::move(logits));
  auto o = einsum<"BNLT,BTNK->BLNK">(probs, v);  // [B{data,expert},L,N{model},K]
  auto out = einsum<"BLNK,NKM->BLM", batch_split<Mesh>>(o, b.wo);
  if (keep) {
    keep->q = std::move(q), keep->k = std::move(k), keep->v = std::move(v);
    keep->probs = std::move(probs), keep->o = std::move(o);
  }
  return out;
}

template <class T, mesh_type Mesh>
activation<T, Mesh> dense_ffn(const activation<T, Mesh>& h, const block_params<T, Mesh>& b,
                              block_cache<T, Mesh>* keep = nullptr) {
  auto r = relu(einsum<"BLM,MH->BLH">(h, *b.w1));  // [B{data,expert},L,H{model}]
  auto y = einsum<"BLH,HM->BLM", batch_split<Mesh>>(r, *b.w2);  // with "model": an all_reduce over it
  if (keep) keep->r = std::move(r);
  return y;
}

// What one forward saw: this rank's partial sums (the caller reduces them,
// with one all_reduce, when it wants the global values) and the MoE stats.
struct forward_stats {
  double ce_sum = 0;       // Σ over this rank's tokens of -log p(target)
  double tokens = 0;       // this rank's predicted tokens
  double aux_partial = 0;  // Σ over MoE layers of this rank's share of the aux loss
  std::vector<moe::gating_stats> moe;  // per MoE layer, this rank's groups
};

// Everything the backward needs from a forward.
template <class T, mesh_type Mesh>
struct model_cache {
  std::vector<block_cache<T, Mesh>> blocks;
  std::optional<activation<T, Mesh>> x_final, h_final;  // before and after the final norm
  std::optional<activation<T, Mesh>> logits;            // [B{..},L,V]
};

// tokens: [B{data,expert}, L+1] bytes; predicts tokens[:, 1:] from tokens[:, :-1].
// Returns the logits [B{data,expert},L,V] and this rank's partial statistics;
// with `keep`, also what the backward needs.
template <class T, mesh_type Mesh>
std::pair<tensor<T, 3, Mesh, batch_split<Mesh>>, forward_stats> forward(
    const tensor<std::int32_t, 2, Mesh, batch_split<Mesh>>& tokens, const params<T, Mesh>& p, const config& c,
    std::uint64_t step, moe::dispatch_mode mode = moe::dispatch_mode::index, model_cache<T, Mesh>* keep = nullptr) {
  const Mesh& m = tokens.mesh();
  const index_t B = tokens.extent(0), L = tokens.extent(1) - 1, M = c.model, V = c.vocab;
  if (L < 1) throw shape_error("gshard::model::forward: tokens " + tokens.notation("BL") + " need at least 2 per row");
  const index_t Bl = tokens.local_extents()[0];
  const std::int32_t* tok = tokens.data();
  // Every token, inputs and targets, indexes the vocabulary. A token out of
  // range is a fact of this rank's data alone: it ends the job with a message.
  for (index_t i = 0; i < Bl * (L + 1); ++i)
    if (tok[i] < 0 || tok[i] >= V)
      mpi::abort_job(("gshard::model::forward: token " + std::to_string(tok[i]) + " (row " + std::to_string(i / (L + 1)) +
                      " of this rank, position " + std::to_string(i % (L + 1)) + ") is outside the vocabulary of " +
                      std::to_string(V))
                         .c_str());
  // Embedding: rows of the replicated table, looked up locally.
  activation<T, Mesh> x(m, {B, L, M});
  for (index_t b = 0; b < Bl; ++b)
    for (index_t l = 0; l < L; ++l)
      std::memcpy(x.data() + (b * L + l) * M, p.embed.data() + index_t(tok[b * (L + 1) + l]) * M, sizeof(T) * std::size_t(M));
  forward_stats st;
  if (keep) keep->blocks.assign(std::size_t(c.layers), {});
  for (int layer = 0; layer < c.layers; ++layer) {
    const auto& b = p.blocks[std::size_t(layer)];
    block_cache<T, Mesh>* bc = keep ? &keep->blocks[std::size_t(layer)] : nullptr;
    const std::string tag = "block " + std::to_string(layer);
    trace::span block_span(tag, "model");
    auto h1 = rms_norm(x, b.norm1);
    auto x_mid = [&] {
      trace::span s(tag + " attention", "model");
      return x + attention(h1, b, bc);
    }();
    auto h2 = rms_norm(x_mid, b.norm2);
    activation<T, Mesh> ffn = [&] {
      trace::span s(tag + (c.is_moe(layer) ? " MoE" : " FFN"), "model");
      if (!c.is_moe(layer)) return dense_ffn(h2, b, bc);
      auto r = moe::forward(h2, *b.moe, c.gating, (step << 8) | std::uint64_t(layer), mode, bc ? &bc->moe : nullptr);
      st.aux_partial += r.aux_partial;
      st.moe.push_back(r.stats);
      auto y = std::move(r.y);
      if (bc) bc->moe_out = std::move(r);
      return y;
    }();
    auto x_next = x_mid + ffn;
    if (bc) {
      bc->x = std::move(x), bc->h1 = std::move(h1), bc->x_mid = std::move(x_mid), bc->h2 = std::move(h2);
    }
    x = std::move(x_next);
  }
  auto h_final = rms_norm(x, p.final_norm);
  auto logits = einsum<"BLM,MV->BLV">(h_final, p.unembed);  // [B{data,expert},L,V]
  // Cross-entropy of the next byte, summed over this rank's tokens.
  const T* lg = logits.data();
  for (index_t b = 0; b < Bl; ++b)
    for (index_t l = 0; l < L; ++l, lg += V) {
      T mx = lg[0];
      for (index_t v = 1; v < V; ++v) mx = std::max(mx, lg[v]);
      double sum = 0;
      for (index_t v = 0; v < V; ++v) sum += std::exp(double(lg[v] - mx));
      st.ce_sum += double(mx) + std::log(sum) - double(lg[tok[b * (L + 1) + l + 1]]);
      st.tokens += 1;
    }
  if (keep) {
    keep->x_final = std::move(x), keep->h_final = std::move(h_final), keep->logits = logits;
  }
  return {std::move(logits), std::move(st)};
}

// The global loss pieces from the ranks' partials (one all_reduce over the
// batch axes; ranks along "model" hold the same partials):
// {mean cross-entropy, aux loss, total = ce + aux_coef · aux}.
struct loss {
  double ce, aux, total;
};
template <mesh_type Mesh>
loss reduce_loss(const forward_stats& s, const config& c, const Mesh& m) {
  std::vector<double> v{s.ce_sum, s.tokens, s.aux_partial};
  all_reduce<double>(moe::group_axes(m), v);  // ranks along "model" hold the same partials
  const double ce = v[1] > 0 ? v[0] / v[1] : 0.0;
  return {ce, v[2], ce + c.aux_coef * v[2]};
}

// The attention's backward: dh for the forward attention(h, b, keep), adding
// the weights' gradients into `g`. Every einsum's gradient is the transposed
// einsum; the weights' come out in their shardings (an all_reduce over the
// batch axes each). dh sums q's, k's and v's contributions while they are
// still partial over "model", so that reduction is one all_reduce.
template <class T, mesh_type Mesh>
activation<T, Mesh> attention_backward(const activation<T, Mesh>& dout, const activation<T, Mesh>& h,
                                       const block_params<T, Mesh>& b, const block_cache<T, Mesh>& keep,
                                       block_params<T, Mesh>& g) {
  auto [do_, dwo] = einsum_backward<"BLNK,NKM->BLM">(dout, *keep.o, b.wo);
  g.wo.local() += dwo.local();
  auto [dprobs, dv] = einsum_backward<"BNLT,BTNK->BLNK">(do_, *keep.probs, *keep.v);
  auto dlog = softmax_backward(std::move(dprobs), *keep.probs);  // masked entries: probs = 0, so 0
  dlog.local() = dlog.local() * (T(1) / std::sqrt(T(b.wq.extent(2))));
  auto [dq, dk] = einsum_backward<"BLNK,BTNK->BNLT">(dlog, *keep.q, *keep.k);
  auto [dhq, dwq] = einsum_backward<"BLM,MNK->BLNK", natural_sharding>(dq, h, b.wq);
  auto [dhk, dwk] = einsum_backward<"BLM,MNK->BLNK", natural_sharding>(dk, h, b.wk);
  auto [dhv, dwv] = einsum_backward<"BLM,MNK->BLNK", natural_sharding>(dv, h, b.wv);
  g.wq.local() += dwq.local();
  g.wk.local() += dwk.local();
  g.wv.local() += dwv.local();
  return reshard<batch_split<Mesh>>(std::move(dhq) + dhk + dhv);
}

namespace detail {
// A norm scale's gradient: this rank's summand, reduced over the batch axes.
template <class T, mesh_type Mesh>
void add_scale_grad(rep1<T, Mesh>& grad, tensor<T, 1, Mesh, batch_partial<Mesh>>&& summand) {
  grad.local() += reshard<replicate>(std::move(summand)).local();  // all_reduce over the batch axes
}
}  // namespace detail

// Gradients of total = mean cross-entropy + aux_coef · Σ aux, for the forward
// that filled `keep` on `tokens`. Returns them in the parameters' shardings.
template <class T, mesh_type Mesh>
params<T, Mesh> backward(const tensor<std::int32_t, 2, Mesh, batch_split<Mesh>>& tokens, const params<T, Mesh>& p,
                         const config& c, const model_cache<T, Mesh>& keep) {
  const Mesh& m = tokens.mesh();
  const index_t B = tokens.extent(0), L = tokens.extent(1) - 1, M = c.model, V = c.vocab;
  const index_t Bl = tokens.local_extents()[0];
  const std::int32_t* tok = tokens.data();
  trace::span backward_span("backward", "model");
  params<T, Mesh> g = zeros_like(p);
  auto scale_summand = [&] { return tensor<T, 1, Mesh, batch_partial<Mesh>>(m, {M}); };

  // Cross-entropy: (softmax − onehot) / number of predicted tokens.
  activation<T, Mesh> dlogits(m, {B, L, V});
  {
    const T inv = T(1) / T(B * L);
    const T* lg = keep.logits->data();
    T* d = dlogits.data();
    for (index_t b = 0; b < Bl; ++b)
      for (index_t l = 0; l < L; ++l, lg += V, d += V) {
        T mx = lg[0];
        for (index_t v = 1; v < V; ++v) mx = std::max(mx, lg[v]);
        T sum = 0;
        for (index_t v = 0; v < V; ++v) sum += (d[v] = std::exp(lg[v] - mx));
        for (index_t v = 0; v < V; ++v) d[v] *= inv / sum;
        d[tok[b * (L + 1) + l + 1]] -= inv;
      }
  }
  auto [dh_final, dunembed] = einsum_backward<"BLM,MV->BLV">(dlogits, *keep.h_final, p.unembed);
  g.unembed.local() += dunembed.local();
  auto ds = scale_summand();
  auto dx = rms_norm_backward(std::move(dh_final), *keep.x_final, p.final_norm, ds.data());
  detail::add_scale_grad(g.final_norm, std::move(ds));

  for (int layer = c.layers - 1; layer >= 0; --layer) {
    const auto& b = p.blocks[std::size_t(layer)];
    auto& gb = g.blocks[std::size_t(layer)];
    const auto& bc = keep.blocks[std::size_t(layer)];
    // x_next = x_mid + ffn(norm2(x_mid)): dx flows to x_mid directly and through the FFN.
    activation<T, Mesh> dh2 = [&] {
      if (c.is_moe(layer)) return moe::backward(dx, *bc.h2, *b.moe, *bc.moe_out, bc.moe, c.aux_coef, *gb.moe);
      auto [dr, dw2] = einsum_backward<"BLH,HM->BLM">(dx, *bc.r, *b.w2);
      gb.w2->local() += dw2.local();
      auto [dh, dw1] = einsum_backward<"BLM,MH->BLH">(relu_backward(std::move(dr), *bc.r), *bc.h2, *b.w1);
      gb.w1->local() += dw1.local();
      return dh;
    }();
    auto ds2 = scale_summand();
    dx = dx + rms_norm_backward(std::move(dh2), *bc.x_mid, b.norm2, ds2.data());
    detail::add_scale_grad(gb.norm2, std::move(ds2));

    // x_mid = x + attention(norm1(x)).
    auto dh1 = attention_backward(dx, *bc.h1, b, bc, gb);
    auto ds1 = scale_summand();
    dx = dx + rms_norm_backward(std::move(dh1), *bc.x, b.norm1, ds1.data());
    detail::add_scale_grad(gb.norm1, std::move(ds1));
  }

  // The embedding: rows of dx added into the looked-up rows, reduced over the batch axes.
  tensor<T, 2, Mesh, batch_partial<Mesh>> dembed(m, {V, M});
  for (index_t b = 0; b < Bl; ++b)
    for (index_t l = 0; l < L; ++l) {
      T* row = dembed.data() + index_t(tok[b * (L + 1) + l]) * M;
      const T* d = dx.data() + (b * L + l) * M;
      for (index_t i = 0; i < M; ++i) row[i] += d[i];
    }
  g.embed.local() += reshard<replicate>(std::move(dembed)).local();  // all_reduce over the batch axes
  return g;
}

}  // namespace legacy::model
