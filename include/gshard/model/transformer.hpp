// gshard/model/transformer.hpp — a byte-level language model of pre-norm
// Transformer blocks: x + attention(norm(x)), then x + ffn(norm(x)), with the
// FFN an MoE layer in every other block (blocks 1, 3, ...). The batch is
// split over every mesh axis but "model" (the MoE layer's groups are its
// sequences); weights are replicated, experts split over "expert". Written as
// einsums on whole tensors: the shardings decide the communication, which is
// the MoE layers' all_to_alls and nothing else.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "gshard/einsum.hpp"
#include "gshard/moe/layer.hpp"
#include "gshard/ops.hpp"

namespace gshard::model {

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

template <class T, mesh_type Mesh>
struct block_params {
  std::vector<T> norm1, norm2;                       // [M] each, every rank
  tensor<T, 3, Mesh, replicate> wq, wk, wv;          // [M,N,K]
  tensor<T, 3, Mesh, replicate> wo;                  // [N,K,M]
  std::optional<tensor<T, 2, Mesh, replicate>> w1;  // dense: [M,H]
  std::optional<tensor<T, 2, Mesh, replicate>> w2;  // dense: [H,M]
  std::optional<moe::params<T, Mesh>> moe;           // MoE blocks
};

template <class T, mesh_type Mesh>
struct params {
  tensor<T, 2, Mesh, replicate> embed;  // [V,M]
  std::vector<block_params<T, Mesh>> blocks;
  std::vector<T> final_norm;            // [M]
  tensor<T, 2, Mesh, replicate> unembed;  // [M,V]
};

// Parameters that depend only on (config, seed): the same at every rank count.
template <class T, mesh_type Mesh>
params<T, Mesh> init(const Mesh& m, const config& c, std::uint64_t seed) {
  std::uint64_t id = 1000;
  auto rep2 = [&](index_t a, index_t b, double sd) {
    tensor<T, 2, Mesh, replicate> t(m, {a, b});
    moe::init_normal(t, sd, seed, id++);
    return t;
  };
  auto rep3 = [&](index_t a, index_t b, index_t d, double sd) {
    tensor<T, 3, Mesh, replicate> t(m, {a, b, d});
    moe::init_normal(t, sd, seed, id++);
    return t;
  };
  const index_t M = c.model, N = c.heads, K = c.head_dim, H = c.hidden;
  params<T, Mesh> p{rep2(c.vocab, M, 1.0), {}, std::vector<T>(std::size_t(M), T(1)), rep2(M, c.vocab, 1.0 / std::sqrt(double(M)))};
  for (int l = 0; l < c.layers; ++l) {
    block_params<T, Mesh> b{std::vector<T>(std::size_t(M), T(1)), std::vector<T>(std::size_t(M), T(1)),
                            rep3(M, N, K, 1.0 / std::sqrt(double(M))), rep3(M, N, K, 1.0 / std::sqrt(double(M))),
                            rep3(M, N, K, 1.0 / std::sqrt(double(M))), rep3(N, K, M, 1.0 / std::sqrt(double(N * K))),
                            {}, {}, {}};
    if (c.is_moe(l)) b.moe = moe::init_params<T>(m, M, H, c.experts, seed, std::uint64_t(l + 1));
    else {
      b.w1 = rep2(M, H, 1.0 / std::sqrt(double(M)));
      b.w2 = rep2(H, M, 1.0 / std::sqrt(double(H)));
    }
    p.blocks.push_back(std::move(b));
  }
  return p;
}

// What one forward saw: this rank's partial sums (the caller reduces them,
// with one all_reduce, when it wants the global values) and the MoE stats.
struct forward_stats {
  double ce_sum = 0;       // Σ over this rank's tokens of -log p(target)
  double tokens = 0;       // this rank's predicted tokens
  double aux_partial = 0;  // Σ over MoE layers of this rank's share of the aux loss
  std::vector<moe::gating_stats> moe;  // per MoE layer, this rank's groups
};

template <class T, mesh_type Mesh>
using activation = tensor<T, 3, Mesh, batch_split<Mesh>>;  // [B{data,expert},L,M]

// Causal self-attention: q, k, v = BLM,MNK->BLNK; logits BLNK,BTNK->BNLT
// scaled by 1/sqrt(K) and masked; softmax over T; BNLT,BTNK->BLNK; BLNK,NKM->BLM.
template <class T, mesh_type Mesh>
activation<T, Mesh> attention(const activation<T, Mesh>& h, const block_params<T, Mesh>& b) {
  const auto q = einsum<"BLM,MNK->BLNK">(h, b.wq);  // [B{data,expert},L,N,K]
  const auto k = einsum<"BLM,MNK->BLNK">(h, b.wk);
  const auto v = einsum<"BLM,MNK->BLNK">(h, b.wv);
  auto logits = einsum<"BLNK,BTNK->BNLT">(q, k);  // [B{data,expert},N,L,T]
  const auto le = logits.local_extents();
  const index_t L = le[2], Tn = le[3];
  const T scale = T(1) / std::sqrt(T(b.wq.extent(2)));
  T* p = logits.data();
  for (index_t bn = 0; bn < le[0] * le[1]; ++bn)
    for (index_t l = 0; l < L; ++l, p += Tn)
      for (index_t t = 0; t < Tn; ++t) p[t] = t <= l ? p[t] * scale : -std::numeric_limits<T>::infinity();
  const auto probs = softmax(std::move(logits));
  const auto o = einsum<"BNLT,BTNK->BLNK">(probs, v);  // [B{data,expert},L,N,K]
  return einsum<"BLNK,NKM->BLM">(o, b.wo);
}

template <class T, mesh_type Mesh>
activation<T, Mesh> dense_ffn(const activation<T, Mesh>& h, const block_params<T, Mesh>& b) {
  return einsum<"BLH,HM->BLM">(relu(einsum<"BLM,MH->BLH">(h, *b.w1)), *b.w2);
}

// tokens: [B{data,expert}, L+1] bytes; predicts tokens[:, 1:] from tokens[:, :-1].
// Returns the logits [B{data,expert},L,V] and this rank's partial statistics.
template <class T, mesh_type Mesh>
std::pair<tensor<T, 3, Mesh, batch_split<Mesh>>, forward_stats> forward(
    const tensor<std::int32_t, 2, Mesh, batch_split<Mesh>>& tokens, const params<T, Mesh>& p, const config& c,
    std::uint64_t step, moe::dispatch_mode mode = moe::dispatch_mode::index) {
  const Mesh& m = tokens.mesh();
  const index_t B = tokens.extent(0), L = tokens.extent(1) - 1, M = c.model, V = c.vocab;
  if (L < 1) throw shape_error("gshard::model::forward: tokens " + tokens.notation("BL") + " need at least 2 per row");
  const index_t Bl = tokens.local_extents()[0];
  const std::int32_t* tok = tokens.data();
  // Embedding: rows of the replicated table, looked up locally.
  activation<T, Mesh> x(m, {B, L, M});
  for (index_t b = 0; b < Bl; ++b)
    for (index_t l = 0; l < L; ++l) {
      const std::int32_t id = tok[b * (L + 1) + l];
      if (id < 0 || id >= V)
        throw shape_error("gshard::model::forward: token " + std::to_string(id) + " is outside the vocabulary of " +
                          std::to_string(V));
      std::memcpy(x.data() + (b * L + l) * M, p.embed.data() + index_t(id) * M, sizeof(T) * std::size_t(M));
    }
  forward_stats st;
  for (int layer = 0; layer < c.layers; ++layer) {
    const auto& b = p.blocks[std::size_t(layer)];
    x = x + attention(rms_norm(x, b.norm1), b);
    auto h = rms_norm(x, b.norm2);
    if (c.is_moe(layer)) {
      auto r = moe::forward(h, *b.moe, c.gating, (step << 8) | std::uint64_t(layer), mode);
      st.aux_partial += r.aux_partial;
      st.moe.push_back(std::move(r.stats));
      x = x + r.y;
    } else {
      x = x + dense_ffn(h, b);
    }
  }
  auto logits = einsum<"BLM,MV->BLV">(rms_norm(std::move(x), p.final_norm), p.unembed);  // [B{data,expert},L,V]
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
  return {std::move(logits), std::move(st)};
}

// The global loss pieces from every rank's partials (one all_reduce):
// {mean cross-entropy, aux loss, total = ce + aux_coef · aux}.
struct loss {
  double ce, aux, total;
};
template <mesh_type Mesh>
loss reduce_loss(const forward_stats& s, const config& c, const Mesh& m) {
  std::vector<double> v{s.ce_sum, s.tokens, s.aux_partial};
  all_reduce<double>(m.group((1u << m.naxes()) - 1u), v);
  const double ce = v[1] > 0 ? v[0] / v[1] : 0.0;
  return {ce, v[2], ce + c.aux_coef * v[2]};
}

}  // namespace gshard::model
