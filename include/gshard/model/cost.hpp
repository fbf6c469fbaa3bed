// gshard/model/cost.hpp — a training step of the MoE Transformer or of the
// encoder–decoder counted from its config and its mesh's sizes, without
// running it: every einsum (FLOPs and local GEMM shape), every collective as
// the planners choose it (kind, axes, calls, bytes — what the counters
// would record), the element-wise traffic, the memory per rank; and, from a
// machine's GEMM rate, memory bandwidth and each collective's α–β, the
// step's predicted time. So a job can be sized before it runs
// (examples/cost.cpp), and the count is checked against the counters of
// real steps (test_training.cpp, test_moe.cpp).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gshard/state/weight_update.hpp"
#include "gshard/state/buckets.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/layout/einsum_spec.hpp"
#include "gshard/model/seq2seq.hpp"
#include "gshard/model/transformer.hpp"
#include "gshard/layout/reshard_steps.hpp"

namespace gshard::model::cost {

// Axis indices of the cost model's mesh, and their masks. The mesh is the
// roles' (data, expert[, model]): the batch over data × expert, the experts
// over expert, heads and hidden units over model — the trainer's meshes, and
// GShard's own (D ranks on one axis: data 1, expert D).
inline constexpr int data_axis = 0, expert_axis = 1, model_axis = 2;
inline constexpr std::uint32_t data_bit = 1u << data_axis, expert_bit = 1u << expert_axis, model_bit = 1u << model_axis;

// The mesh's sizes, and the rank whose step is counted, by its coordinates
// on (data, expert, model). Where an extent does not divide by its axes,
// blocks differ between ranks (gshard/layout/shard_geometry.hpp's rule), and
// so do a step's FLOPs, bytes and state; the rank at coordinate 0 of every
// axis holds the largest block of every dim, so the default counts the
// busiest rank, whose time is the step's.
struct mesh_sizes {
  index_t data = 1, expert = 1, model = 1;
  bool has_model_axis = false;  // a "model" axis (of any size, 1 too: its collectives still run)
  std::array<index_t, 3> at{};  // the counted rank's coordinates
  index_t ranks() const { return data * expert * model; }
  const index_t* sizes() const { return &data; }
  const index_t* coords() const { return at.data(); }
  int naxes() const { return has_model_axis ? 3 : 2; }
};

// One declared weight: its name (as the transformer declares it), global
// extents and layout over the cost model's axes.
struct weight {
  std::string name;
  std::vector<index_t> extents;
  detail::rlayout layout{};
  bool expert = false;  // split over the expert axis (the experts' FFNs)
  index_t elements() const {
    index_t n = 1;
    for (index_t e : extents) n *= e;
    return n;
  }
};

namespace detail_cost {
// The weights a model declares, listed in its order as it declares them,
// each split over the cost model's axes as the model's types split it.
struct weight_list {
  std::vector<weight> w;
  bool model_axis_in_mesh = true;

  void add(std::string name, std::vector<index_t> extents, std::vector<std::vector<int>> split, bool expert = false) {
    weight x{std::move(name), std::move(extents), {}, expert};
    for (std::size_t d = 0; d < split.size(); ++d)
      for (int a : split[d])
        if (a != model_axis || model_axis_in_mesh) x.layout.push(int(d), a);
    w.push_back(std::move(x));
  }
  // An attention's projections [M,N{model},K] ×3 and [N{model},K,M].
  void attention(const std::string& p, index_t M, index_t N, index_t K) {
    for (const char* q : {"wq", "wk", "wv"}) add(p + q, {M, N, K}, {{}, {model_axis}});
    add(p + "wo", {N, K, M}, {{model_axis}});
  }
  // A dense FFN (ffn_weights): [M,H{model}] (twice for SwiGLU) and [H{model},M].
  void ffn(const std::string& w1, const std::string& w1_up, const std::string& w2, ffn_kind k, index_t M, index_t H) {
    add(w1, {M, H}, {{}, {model_axis}});
    if (k == ffn_kind::swiglu) add(w1_up, {M, H}, {{}, {model_axis}});
    add(w2, {H, M}, {{model_axis}});
  }
  // moe::layer's: the router, the experts' stacks over expert, the shared experts.
  void moe(const std::string& b, ffn_kind k, index_t M, index_t H, index_t E, index_t shared) {
    add(b + "gate", {M, E}, {});
    add(b + "wi", {E, M, H}, {{expert_axis}, {}, {model_axis}}, true);
    if (k == ffn_kind::swiglu) add(b + "wi_up", {E, M, H}, {{expert_axis}, {}, {model_axis}}, true);
    add(b + "wo_experts", {E, H, M}, {{expert_axis}, {model_axis}}, true);
    if (shared > 0) ffn(b + "shared_w1", b + "shared_w1_up", b + "shared_w2", k, M, H * shared);
  }
};
}  // namespace detail_cost

// Every weight the transformer declares for `c`, in its order, on a mesh
// with or without a model axis: transformer::declare_blocks, moe::layer's
// constructor and ffn_weights declare them; test_training's "[cost]" case
// compares this list with their declarations (names, extents, shards).
inline std::vector<weight> weights(const config& c, bool model_axis_in_mesh = true) {
  detail_cost::weight_list w{{}, model_axis_in_mesh};
  const index_t M = c.model;
  w.add("embed", {c.vocab, M}, {});
  if (c.positions == position_kind::learned) w.add("positions", {c.max_len, M}, {});
  for (int l = 0; l < c.layers; ++l) {
    const std::string b = "block" + std::to_string(l) + ".";
    w.add(b + "norm1", {M}, {});
    w.attention(b, M, c.heads, c.head_dim);
    w.add(b + "norm2", {M}, {});
    if (c.is_moe(l)) w.moe(b, c.ffn, M, c.ffn_hidden(l), c.experts, c.shared_experts);
    else w.ffn(b + "w1", b + "w1_up", b + "w2", c.ffn, M, c.ffn_hidden(l));
  }
  w.add("final_norm", {M}, {});
  w.add("unembed", {M, c.vocab}, {});
  return std::move(w.w);
}

// Every weight model::seq2seq declares for `c`, in its order: "embed", the
// encoder's blocks "enc<l>.", "enc_norm", the decoder's "dec<l>." (with
// cross-attention's "cross_" projections), "dec_norm", "unembed".
inline std::vector<weight> weights(const seq2seq_config& c, bool model_axis_in_mesh = true) {
  detail_cost::weight_list w{{}, model_axis_in_mesh};
  const index_t M = c.model;
  w.add("embed", {c.vocab, M}, {});
  auto stack = [&](const std::string& name, int layers, bool decoder) {
    for (int l = 0; l < layers; ++l) {
      const std::string b = name + std::to_string(l) + ".";
      w.add(b + "norm1", {M}, {});
      w.attention(b, M, c.heads, c.head_dim);
      if (decoder) w.add(b + "norm_cross", {M}, {}), w.attention(b + "cross_", M, c.heads, c.head_dim);
      w.add(b + "norm2", {M}, {});
      if (c.is_moe(l)) w.moe(b, c.ffn, M, c.hidden, c.experts, 0);
      else w.ffn(b + "w1", b + "w1_up", b + "w2", c.ffn, M, c.ffn_hidden(l));
    }
  };
  stack("enc", c.encoder_layers, false);
  w.add("enc_norm", {M}, {});
  stack("dec", c.decoder_layers, true);
  w.add("dec_norm", {M}, {});
  w.add("unembed", {M, c.vocab}, {});
  return std::move(w.w);
}

// Extent of dim d of a layout's shard on the counted rank.
inline index_t local_extent(const detail::rlayout& l, int d, index_t global, const mesh_sizes& m) {
  return detail::dim_block(l, d, global, m.sizes(), m.coords()).extent;
}

// Elements of a layout's shard on the counted rank.
inline index_t local_elements(const detail::rlayout& l, const std::vector<index_t>& extents, const mesh_sizes& m) {
  index_t n = 1;
  for (std::size_t d = 0; d < extents.size(); ++d) n *= local_extent(l, int(d), extents[d], m);
  return n;
}

// One einsum of the step: its spec, how often its forward runs, and each
// label's extent, global and on this rank. Its backward runs the two
// transposed einsums ("O,B->A" and "A,O->B"), each of the forward's FLOPs.
struct einsum_work {
  static constexpr double passes = 3.0;  // the forward and the backward's two transposed einsums, each as costly
  std::string spec;
  int calls = 0;
  std::array<index_t, 128> global{}, local{};  // by label letter
  // Model FLOPs per step on this rank (model_flops()'s count: the global
  // einsum's over the P ranks), forward and backward.
  double flops = 0;
  // FLOPs this rank's GEMMs run per step (more than `flops` where the einsum
  // is not split over every axis: each of those ranks runs all of it).
  double local_flops() const { return passes * double(calls) * gshard::detail::parse_einsum(spec).flops(local.data()); }
  // The einsums of a step: the forward, then the gradients of its operands.
  std::array<std::string, 3> specs() const {
    const gshard::detail::einsum_spec e = gshard::detail::parse_einsum(spec);
    const std::string a(e.term(0)), b(e.term(1)), o(e.out_term());
    return {spec, o + "," + b + "->" + a, a + "," + o + "->" + b};
  }
};

// One kind of collective over one set of axes, for one purpose: calls and
// bytes per step on a rank, as gshard's counters count them (a call's bytes
// are its input's).
struct collective_work {
  collective kind{};
  std::uint32_t axes = 0;  // data_bit | expert_bit | model_bit
  int calls = 0;
  double bytes = 0;
  std::string what;  // what it carries
};

struct step_work {
  std::vector<einsum_work> einsums;
  std::vector<collective_work> collectives;
  double model_flops = 0;        // per rank: Σ einsums
  // Element-wise work per rank, estimates: bytes of stream passes, exponentials, Adam's elements.
  double elementwise_bytes = 0, exp_elements = 0, adam_elements = 0;
  // Memory per rank (bytes): the state, exact; the activations a step keeps
  // for its backward, an estimate.
  double parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0, activation_bytes = 0;  // optimizer: its state
  // C of the MoE layers: an encoder–decoder's encoder's, and its decoder's
  // (of target groups) in decoder_capacity.
  index_t capacity = 0, decoder_capacity = 0;
};

// The optimizer a step updates with: Adam (two moments like each gradient),
// or Adafactor (factored second moments in double for every weight of rank
// ≥ 2, a full one for vectors; a first moment only when its beta1 > 0).
enum class optimizer_kind : std::uint8_t { adam, adafactor };

struct step_options {
  index_t batch = 16, seq = 128;  // the global batch: B sequences of L tokens
  bool sharded_update = true;     // the weight update sharded over the batch axes (shard_weight_update)
  int element_bytes = 4;          // float
  std::size_t bucket_bytes = default_bucket_bytes;  // parameters::bucket_bytes()
  optimizer_kind optimizer = optimizer_kind::adam;
  bool first_moment = false;      // Adafactor with beta1 > 0
  index_t source = 0;             // an encoder–decoder's source positions (its decoder runs `seq`)
  wire gradient_wire = wire::same;  // parameters::gradient_wire(): bf16, the gradients' reductions in 2-byte elements
  wire weight_wire = wire::same;    // parameters::weight_wire(): bf16, fp32 masters kept and the updated weights gathered in 2-byte elements
};

namespace detail_cost {
using gshard::detail::rlayout;

// The bytes of an element of `element_bytes` as `w` sends it.
inline int bytes_on(wire w, int element_bytes) { return sends_bf16(w) ? 2 : element_bytes; }

// Adds calls and bytes to the (kind, axes, what) entry, or a new one.
inline void add(std::vector<collective_work>& cs, collective kind, std::uint32_t axes, int calls, double bytes,
                const std::string& what) {
  for (auto& c : cs)
    if (c.kind == kind && c.axes == axes && c.what == what) {
      c.calls += calls, c.bytes += bytes;
      return;
    }
  cs.push_back({kind, axes, calls, bytes, what});
}

// The collectives of a reshard plan on a tensor of `extents`, its input in
// `from`, as the executor runs them: each call's bytes are the counted
// rank's elements, padded where a step cuts a dim whose pieces differ
// (step_elements).
inline void add_plan(std::vector<collective_work>& cs, const rlayout& from, const rlayout& to, const std::vector<index_t>& extents,
                     const mesh_sizes& m, int element_bytes, const std::string& what, int calls = 1) {
  const int r = int(extents.size());
  const auto plan = gshard::detail::plan_to_run(gshard::detail::plan_reshard(from, to, m.naxes(), m.sizes()), extents.data(), r,
                                                m.naxes(), m.sizes());
  for (int i = 0; i < plan.n; ++i) {
    const auto& s = plan.step[i];
    if (!is_collective(s.kind)) continue;
    const index_t n = gshard::detail::step_elements(s, plan.state[i], plan.state[i + 1], extents.data(), r, m.sizes(), m.coords());
    add(cs, collective_of(s.kind), s.mask, calls, double(n) * element_bytes, what);
  }
}

// One block of a network as the cost model counts it.
struct block_shape {
  index_t len = 0;       // positions of its sequence: its queries, and self-attention's keys
  index_t cross = 0;     // cross-attention's keys (the source's positions); 0: none
  bool causal = true;    // self-attention over earlier keys only (half the exponentials)
  bool moe = false;
  index_t hidden = 0;    // the dense FFN's width, or each expert's
  index_t capacity = 0;  // an MoE block's C
};

// What a step runs, model-independent: the extents, the blocks in the order
// the forward runs them, the positions embedded and unembedded per
// sequence, and the weights.
struct network_shape {
  index_t model = 0, heads = 0, head_dim = 0, vocab = 0, experts = 0, shared_experts = 0;
  ffn_kind ffn = ffn_kind::relu;
  int top_k = 2;
  index_t overlap_degree = 1;
  wire all_to_all_wire = wire::same;  // bf16: the MoE all_to_alls' elements are 2 bytes; trimmed: counted whole, a bound
  bool dropless = false;
  attention_memory attention = attention_memory::keep_probabilities;
  bool smoothed = false;  // label smoothing: the loss's all_reduce carries the unsmoothed sum too
  std::vector<block_shape> blocks;
  index_t embedded = 0;  // positions embedded per sequence (both sides')
  index_t out = 0;       // positions unembedded into the loss
  // The encoder's output positions, cross-attended by every decoder block:
  // its gradient, summed over them, is reduced once (0: no encoder).
  index_t memory = 0;
  std::vector<weight> weights;
};

// The state (parameters, gradients, the optimizer's) and the collectives of
// the weights' gradients and update: from the pending sum over the batch
// axes that do not split a weight, into the weight (replicated update) or
// its update layout; and, sharded, the updated blocks gathered back. Plans
// that can share a collective go through buckets (gshard/state/buckets.hpp)
// as the tape fills them — gradients in the order they complete, the
// reverse of the weights' first use (here: of their declaration) — and as
// the optimizer fills them, in declaration order.
inline void count_state(step_work& w, const std::vector<weight>& ws, const mesh_sizes& m, const step_options& o) {
  auto& cs = w.collectives;
  const int f = o.element_bytes;
  const std::uint32_t batch = data_bit | expert_bit, all = batch | (m.has_model_axis ? model_bit : 0u);
  add(cs, collective::all_reduce, all, 1, 8, "global gradient norm");
  struct bucket {
    gshard::detail::reshard_steps plan{};  // its steps (its first member's plan)
    std::string what;
    std::vector<std::pair<const weight*, gshard::detail::reshard_steps>> members;  // each with its own plan's layouts
    double bytes = 0;       // in the weights' type: where the bucket is cut
    int wire_bytes = 0;     // of an element on the wire
  };
  std::vector<bucket> open;
  auto run = [&](bucket& b) {
    for (int i = 0; i < b.plan.n; ++i) {
      if (!is_collective(b.plan.step[i].kind) || b.members.empty()) continue;
      double bytes = 0;
      for (const auto& [x, plan] : b.members) bytes += double(local_elements(plan.state[i], x->extents, m)) * b.wire_bytes;
      add(cs, collective_of(b.plan.step[i].kind), b.plan.step[i].mask, 1, bytes, b.what);
    }
    b.members.clear(), b.bytes = 0;
  };
  auto reduce = [&](const weight& x, const rlayout& from, const rlayout& to, const std::string& what, int wire_bytes) {
    const auto plan = gshard::detail::plan_reshard(from, to, m.naxes(), m.sizes());
    if (o.bucket_bytes == 0 || !gshard::detail::bucketable(plan, x.extents.data(), int(x.extents.size()), m.sizes()))
      return add_plan(cs, from, to, x.extents, m, wire_bytes, what);
    auto it = std::find_if(open.begin(), open.end(), [&](const bucket& b) { return gshard::detail::same_steps(b.plan, plan) && b.what == what; });
    if (it == open.end()) it = open.insert(open.end(), bucket{plan, what, {}, 0, wire_bytes});
    it->members.push_back({&x, plan});
    it->bytes += double(local_elements(from, x.extents, m)) * f;
    if (it->bytes >= double(o.bucket_bytes)) run(*it);
  };
  std::vector<rlayout> targets;
  for (const weight& x : ws) {
    rlayout target = x.layout;
    if (o.sharded_update) {
      const auto u = gshard::detail::choose_update_layout(x.layout, int(x.extents.size()), x.extents.data(), m.sizes(),
                                                          m.naxes(), batch);
      if (u.parts > 1) target = u.layout;
    }
    targets.push_back(target);
    const double g = double(local_elements(target, x.extents, m)) * f;
    w.parameter_bytes += double(local_elements(x.layout, x.extents, m)) * f;
    w.gradient_bytes += g;
    // The weight's block a sharded update works on, or the master of a bf16 weight.
    const double block = target == x.layout && !sends_bf16(o.weight_wire) ? 0 : g;
    if (o.optimizer == optimizer_kind::adam) {
      w.optimizer_bytes += 2 * g + block;  // the moments
      continue;
    }
    w.optimizer_bytes += block + (o.first_moment ? g : 0);
    const int r = int(x.extents.size());
    if (r < 2) {
      w.optimizer_bytes += g;  // a vector's full second moment
      continue;
    }
    // The factors: the gradient's local shape without its last dim, and
    // without its second-to-last, in double; each mean that runs along a
    // split dim is all_reduced over that dim's axes (with each stack's Σ R
    // beside the column sums).
    const double cols = double(local_extent(target, r - 1, x.extents[std::size_t(r - 1)], m));
    const double rows = double(local_extent(target, r - 2, x.extents[std::size_t(r - 2)], m));
    double lead = 1;
    for (int d = 0; d < r - 2; ++d) lead *= double(local_extent(target, d, x.extents[std::size_t(d)], m));
    w.optimizer_bytes += 8 * lead * (rows + cols);
    const auto live = [&](const gshard::detail::rdim& d) {
      std::uint32_t mask = 0;
      for (int k = 0; k < d.n; ++k)
        if (m.sizes()[d.ax[k]] > 1) mask |= 1u << d.ax[k];
      return mask;
    };
    if (const auto a = live(target.dims[r - 1])) add(cs, collective::all_reduce, a, 1, 8 * lead * rows, "Adafactor's row factors");
    if (const auto a = live(target.dims[r - 2]))
      add(cs, collective::all_reduce, a, 1, 8 * lead * (cols + 1), "Adafactor's column factors");
  }
  if (o.optimizer == optimizer_kind::adafactor)
    add(cs, collective::all_reduce, all, 1, 2.0 * 8 * double(ws.size()), "Adafactor's update and weight RMS");
  for (std::size_t i = ws.size(); i-- > 0;) {
    rlayout pending = ws[i].layout;
    pending.partial = batch & ~ws[i].layout.split_mask();
    reduce(ws[i], pending, targets[i], "weight gradients", bytes_on(o.gradient_wire, f));
  }
  for (auto& b : open) run(b);
  open.clear();
  for (std::size_t i = 0; i < ws.size(); ++i)
    if (!(targets[i] == ws[i].layout)) reduce(ws[i], targets[i], ws[i].layout, "updated weights", bytes_on(o.weight_wire, f));
  for (auto& b : open) run(b);
}

// What one training step (forward, backward, the optimizer) of `n` does on
// each rank: the einsums, the collectives, the state (count_state), the
// element-wise work and the activations kept. Not counted:
// rematerialisation's recomputed forward and attention's recomputed logits.
inline step_work count(const network_shape& n, const mesh_sizes& m, const step_options& o) {
  const index_t B = o.batch, M = n.model, N = n.heads, K = n.head_dim, V = n.vocab, E = n.experts;
  for (int a = 0; a < 3; ++a)
    if (m.at[std::size_t(a)] < 0 || m.at[std::size_t(a)] >= m.sizes()[a])
      throw shape_error("gshard::model::cost: mesh_sizes.at = (" + std::to_string(m.at[0]) + ", " + std::to_string(m.at[1]) +
                        ", " + std::to_string(m.at[2]) + ") is not a rank of data " + std::to_string(m.data) + " x expert " +
                        std::to_string(m.expert) + " x model " + std::to_string(m.model));
  const int f = o.element_bytes, k = n.top_k;
  // The counted rank's block of an extent split over `axes` (major first).
  auto local = [&](index_t global, std::initializer_list<int> axes) {
    rlayout l;
    for (int a : axes)
      if (a < m.naxes()) l.push(0, a);
    return local_extent(l, 0, global, m);
  };
  const index_t Bl = local(B, {data_axis, expert_axis}), Nl = local(N, {model_axis});
  const index_t Gd = local(B, {data_axis}), El = local(E, {expert_axis});  // at the experts: G over data only, E over expert
  const auto hidden = [&](index_t h) { return local(h, {model_axis}); };
  const double P = double(m.ranks());
  const int ffn_inputs = n.ffn == ffn_kind::swiglu ? 2 : 1;
  step_work w;

  // Einsums, with each label's global and local extent; the same einsum on
  // the same extents is one entry.
  using label = std::tuple<char, index_t, index_t>;
  auto einsum = [&](std::string spec, int calls, std::initializer_list<label> labels) {
    einsum_work x{std::move(spec), calls, {}, {}, 0};
    for (const auto& [l, g, loc] : labels) x.global[std::size_t(l)] = g, x.local[std::size_t(l)] = loc;
    x.flops = einsum_work::passes * double(calls) * gshard::detail::parse_einsum(x.spec).flops(x.global.data()) / P;
    w.model_flops += x.flops;
    for (einsum_work& y : w.einsums)
      if (y.spec == x.spec && y.global == x.global && y.local == x.local) {
        y.calls += x.calls, y.flops += x.flops;
        return;
      }
    w.einsums.push_back(std::move(x));
  };
  const label b_{'B', B, Bl}, m_{'M', M, M}, n_{'N', N, Nl}, k_{'K', K, K}, v_{'V', V, V};
  auto attention = [&](index_t queries, index_t keys, int projected) {  // projections of queries (and keys and values: 3)
    const label l_{'L', queries, queries}, t_{'T', keys, keys};
    einsum("BLM,MNK->BLNK", projected, {b_, l_, m_, n_, k_});
    if (projected == 1) einsum("BLM,MNK->BLNK", 2, {b_, {'L', keys, keys}, m_, n_, k_});
    einsum("BLNK,BTNK->BNLT", 1, {b_, l_, t_, n_, k_});
    einsum("BNLT,BTNK->BLNK", 1, {b_, l_, t_, n_, k_});
    einsum("BLNK,NKM->BLM", 1, {b_, l_, n_, k_, m_});
  };
  for (const block_shape& blk : n.blocks) {
    const label l_{'L', blk.len, blk.len};
    attention(blk.len, blk.len, 3);
    if (blk.cross > 0) attention(blk.len, blk.cross, 1);
    if (!blk.moe) {  // a dense FFN (a dense model's "slot" FFNs of their own width)
      const label h_{'H', blk.hidden, hidden(blk.hidden)};
      einsum("BLM,MH->BLH", ffn_inputs, {b_, l_, m_, h_});
      einsum("BLH,HM->BLM", 1, {b_, l_, m_, h_});
      continue;
    }
    const index_t C = blk.capacity;
    const label g_{'G', B, Bl}, s_{'S', blk.len, blk.len}, e_{'E', E, E}, ee_{'E', E, El}, gd_{'G', B, Gd}, c_{'C', C, C},
        h_{'H', blk.hidden, hidden(blk.hidden)};
    einsum("GSM,ME->GSE", 1, {g_, s_, m_, e_});
    einsum("EGCM,EMH->EGCH", ffn_inputs, {ee_, gd_, c_, m_, h_});
    einsum("EGCH,EHM->EGCM", 1, {ee_, gd_, c_, m_, h_});
    if (n.shared_experts > 0) {
      const index_t Hs = blk.hidden * n.shared_experts;
      const label hs_{'H', Hs, hidden(Hs)};
      einsum("GSM,MH->GSH", ffn_inputs, {g_, s_, m_, hs_});
      einsum("GSH,HM->GSM", 1, {g_, s_, m_, hs_});
    }
  }
  einsum("BLM,MV->BLV", 1, {b_, {'L', n.out, n.out}, m_, v_});

  // Collectives: the forward's and their transposes in the backward.
  auto& cs = w.collectives;
  const std::uint32_t batch = data_bit | expert_bit;
  for (const block_shape& blk : n.blocks) {
    if (!blk.moe) continue;
    // The all_to_alls pipelined in chunks of C (overlap_degree): as many
    // calls per all_to_all, the same bytes in all. (The expert einsums are
    // counted whole: their FLOPs are the chunks' sum.)
    const index_t C = blk.capacity;
    const int chunks = int(std::min<index_t>(std::max<index_t>(n.overlap_degree, 1), std::max<index_t>(C, 1)));
    const int wire_bytes = bytes_on(n.all_to_all_wire, f);
    // [E,G{data,expert},C,M] -> [E{expert},G{data},C,M] and back, each as
    // its transpose: the same bytes, padded where E or G does not divide.
    rlayout grouped, expert;
    grouped.push(1, data_axis), grouped.push(1, expert_axis);
    expert.push(0, expert_axis), expert.push(1, data_axis);
    for (int i = 0; i < 4; ++i)
      add_plan(cs, grouped, expert, {E, B, C, M}, m, wire_bytes, "MoE dispatch and combine, forward and backward", chunks);
    // The gating counters, aux loss and z-loss: 2E + 2k + 6 doubles (with the padded positions and a check of the paddings).
    add(cs, collective::all_reduce, batch, 1, double(2 * E + 2 * k + 6) * 8, "MoE statistics");
    if (n.dropless) add(cs, collective::all_reduce, batch, 1, 8, "dropless capacity");
    // The experts' outputs, summed over "model" at the experts
    // ([E{expert},G{data},C,M]); their inputs' gradients, after the
    // all_to_all back (at the tokens: [E,G{data,expert},C,M]), in the
    // all_to_all's element type. Equal unless E or G does not divide.
    if (m.has_model_axis) {
      add(cs, collective::all_reduce, model_bit, chunks, double(E * Bl * C * M) * wire_bytes,
          "expert FFN outputs and inputs' gradients");
      add(cs, collective::all_reduce, model_bit, chunks, double(El * Gd * C * M) * f, "expert FFN outputs and inputs' gradients");
    }
  }
  add(cs, collective::all_reduce, batch, 1, (n.smoothed ? 3 : 2) * 8, "cross-entropy's sum and count");
  if (m.has_model_axis) {  // after each model-split contraction, and its input's gradient
    for (const block_shape& blk : n.blocks) {
      const int calls = 2 + (blk.cross > 0 ? 2 : 0) + (!blk.moe || n.shared_experts > 0 ? 2 : 0);
      add(cs, collective::all_reduce, model_bit, calls, calls * double(Bl * blk.len * M) * f, "activations of model-split contractions");
    }
    if (n.memory > 0)
      add(cs, collective::all_reduce, model_bit, 1, double(Bl * n.memory * M) * f, "activations of model-split contractions");
  }
  count_state(w, n.weights, m, o);

  // Element-wise work, an estimate: the stream passes (elements read or
  // written by norms, residual adds, attention's probabilities, dispatch,
  // combine and the all_to_alls' packing, activations; the backward twice
  // the forward's), the exponentials (softmaxes, SwiGLU's sigmoid) and the
  // optimizer's elements; and the activations the backward keeps (the
  // einsums' inputs, attention's probabilities, the activations' outputs,
  // the norms' inputs).
  const bool kept = n.attention == attention_memory::keep_probabilities;
  const double out = double(Bl * n.out);
  double stream = 4 * double(Bl * n.embedded * M) + 2 * 3 * out * double(V);  // embedding; cross-entropy, forward and backward
  double exps = 2 * out * double(V), keep = 2 * out * double(V);
  for (const block_shape& blk : n.blocks) {
    const index_t Tl = Bl * blk.len;
    const double act = double(Tl * M), qkv = double(Tl * Nl * K);
    // Two norms and two residual adds; attention's probabilities, written
    // by the forward and read by the backward (its logits and their
    // gradients live in cache-sized blocks), and their exps (causal: the
    // half at or below the diagonal). With
    // attention_memory::recompute_probabilities it keeps two numbers per
    // row, and its backward computes the exps again (the extra QKᵀ GEMM, a
    // sixth of attention's, is not counted).
    const double scores = double(Bl * Nl * blk.len * blk.len);
    stream += 2 * (6 * act + 6 * act) + (kept ? 2 * scores : 0.0);
    exps += (kept ? 1.0 : 2.0) * scores * (blk.causal ? 0.5 : 1.0);
    keep += 4 * act + 4 * qkv + (kept ? scores : 2.0 * double(Bl * Nl * blk.len));  // norms' inputs and outputs, q k v o, the probabilities
    if (blk.cross > 0) {  // a third norm and residual add; the queries over the memory's keys and values
      const double cross = double(Bl * Nl * blk.len * blk.cross);
      stream += 2 * (3 * act + 3 * act) + (kept ? 2 * cross : 0.0);
      exps += (kept ? 1.0 : 2.0) * cross;
      keep += 2 * act + 2 * qkv + 2 * double(Bl * blk.cross * Nl * K) + (kept ? cross : 2.0 * double(Bl * Nl * blk.len));
    }
    const double gated = ffn_inputs == 2 ? 1.0 : 0.0;
    if (blk.moe) {
      const index_t C = blk.capacity;
      const double slots = double(El * Gd * C), Hl = double(hidden(blk.hidden)), xe = double(E * Bl * C * M);
      stream += 2 * (xe + 4 * double(k) * act + 4 * xe + (2 + 3 * gated) * slots * Hl);  // dispatch, combine, packing, activation
      exps += double(Tl * E) + 2 * gated * slots * Hl;
      keep += 2 * xe + ffn_inputs * slots * Hl + slots * double(M);
      if (n.shared_experts > 0) {  // the shared experts: a dense FFN of shared_experts · H hidden units over every token
        const double Hs = double(hidden(blk.hidden * n.shared_experts));
        stream += 2 * (2 + 3 * gated) * double(Tl) * Hs;
        exps += 2 * gated * double(Tl) * Hs;
        keep += ffn_inputs * double(Tl) * Hs + act;
      }
    } else {
      const double Hl = double(hidden(blk.hidden));
      stream += 2 * (2 + 3 * gated) * double(Tl) * Hl;
      exps += 2 * gated * double(Tl) * Hl;
      keep += ffn_inputs * double(Tl) * Hl + act;
    }
  }
  w.elementwise_bytes = stream * f;
  w.exp_elements = exps;
  w.adam_elements = w.gradient_bytes / f;
  w.activation_bytes = keep * f;
  return w;
}
}  // namespace detail_cost

// What one training step (forward, backward, the optimizer) of the MoE
// Transformer `c` does on each rank, for a global batch of o.batch
// sequences of o.seq tokens.
inline step_work count_step(const config& c, const mesh_sizes& m, const step_options& o) {
  detail_cost::network_shape n{.model = c.model, .heads = c.heads, .head_dim = c.head_dim, .vocab = c.vocab,
                               .experts = c.experts, .shared_experts = c.shared_experts, .ffn = c.ffn,
                               .top_k = c.gating.top_k, .overlap_degree = c.overlap_degree, .all_to_all_wire = c.all_to_all_wire,
                               .dropless = c.gating.dropless,
                               .attention = c.attention, .smoothed = false, .blocks = {}, .embedded = o.seq, .out = o.seq,
                               .memory = 0, .weights = weights(c, m.has_model_axis)};
  const index_t C = c.experts > 0 ? moe::capacity(o.seq, c.experts, c.gating) : 0;
  for (int l = 0; l < c.layers; ++l) n.blocks.push_back({o.seq, 0, true, c.is_moe(l), c.ffn_hidden(l), c.is_moe(l) ? C : 0});
  step_work w = detail_cost::count(n, m, o);
  w.capacity = C;
  return w;
}

// What one training step of the encoder–decoder `c` does on each rank, for
// a global batch of o.batch pairs: sources of o.source positions, targets
// of o.seq + 1 (the decoder runs o.seq positions, as model::seq2seq::forward).
// The capacities are the encoder's (capacity) and the decoder's (decoder_capacity).
inline step_work count_step(const seq2seq_config& c, const mesh_sizes& m, const step_options& o) {
  const index_t S = o.source, L = o.seq;
  if (S < 1 || L < 1)
    throw shape_error("gshard::model::cost: an encoder–decoder step needs sources and targets of 1 position or more; "
                      "step_options.source = " + std::to_string(S) + ", seq = " + std::to_string(L));
  detail_cost::network_shape n{.model = c.model, .heads = c.heads, .head_dim = c.head_dim, .vocab = c.vocab,
                               .experts = c.experts, .shared_experts = 0, .ffn = c.ffn, .top_k = c.gating.top_k,
                               .overlap_degree = 1, .all_to_all_wire = c.all_to_all_wire, .dropless = c.gating.dropless, .attention = c.attention,
                               .smoothed = c.label_smoothing > 0, .blocks = {}, .embedded = S + L, .out = L, .memory = S,
                               .weights = weights(c, m.has_model_axis)};
  const index_t Cs = c.experts > 0 ? moe::capacity(S, c.experts, c.gating) : 0;
  const index_t Cl = c.experts > 0 ? moe::capacity(L, c.experts, c.decoder_gating()) : 0;
  for (int l = 0; l < c.encoder_layers; ++l) n.blocks.push_back({S, 0, false, c.is_moe(l), c.ffn_hidden(l), c.is_moe(l) ? Cs : 0});
  for (int l = 0; l < c.decoder_layers; ++l) n.blocks.push_back({L, S, true, c.is_moe(l), c.ffn_hidden(l), c.is_moe(l) ? Cl : 0});
  step_work w = detail_cost::count(n, m, o);
  w.capacity = Cs, w.decoder_capacity = Cl;
  return w;
}

// A collective's cost: α seconds per message round, β bytes per second on a
// rank's link.
struct alpha_beta {
  double alpha = 0, beta = 0;
};

// What runs the step: the GEMM rate and element-wise bandwidth of one rank,
// and each collective's α–β.
struct machine {
  double gemm_flops = 0;  // FLOP/s per rank on the model's GEMMs
  double elementwise_bytes_per_s = 0, exp_per_s = 0, adam_elements_per_s = 0;
  alpha_beta all_to_all, all_reduce, reduce_scatter, all_gather;
  const alpha_beta& of(collective k) const {
    switch (k) {
      case collective::all_to_all: return all_to_all;
      case collective::reduce_scatter: return reduce_scatter;
      case collective::all_gather: return all_gather;
      default: return all_reduce;
    }
  }
};

// Seconds of `calls` calls of one collective moving `bytes` in all (their
// inputs' bytes, as counted) over groups of p ranks, by the bandwidth-optimal
// algorithms (ring all_reduce, reduce_scatter and all_gather, pairwise
// all_to_all): α per round, and the bytes a rank sends over β.
inline double seconds(collective kind, index_t p, int calls, double bytes, const alpha_beta& ab) {
  if (p <= 1 || ab.beta <= 0) return calls * (p <= 1 ? 0.0 : ab.alpha);
  const double q = double(p - 1), share = q / double(p);
  switch (kind) {
    case collective::all_reduce: return calls * 2 * q * ab.alpha + 2 * share * bytes / ab.beta;
    case collective::all_gather: return calls * q * ab.alpha + q * bytes / ab.beta;
    default: return calls * q * ab.alpha + share * bytes / ab.beta;  // reduce_scatter, all_to_all
  }
}

// The ranks of a set of the cost model's axes.
inline index_t group_size(std::uint32_t axes, const mesh_sizes& m) {
  index_t p = 1;
  for (int a = 0; a < m.naxes(); ++a)
    if ((axes >> a) & 1u) p *= m.sizes()[a];
  return p;
}

struct prediction {
  double gemm_s = 0, elementwise_s = 0, communication_s = 0;
  std::vector<double> collective_s;  // per entry of step_work::collectives
  double total_s() const { return gemm_s + elementwise_s + communication_s; }
  double communication_share() const { return total_s() > 0 ? communication_s / total_s() : 0.0; }
};

// The step's time on `mc` with nothing overlapped: an upper bound where the
// gradient buckets and pipelined all_to_alls hide communication.
// `einsum_seconds(e)`, when given, is one einsum's seconds per step
// (measured on its shapes); otherwise its local FLOPs at mc.gemm_flops.
template <class EinsumSeconds = std::nullptr_t>
prediction predict(const step_work& w, const mesh_sizes& m, const machine& mc, EinsumSeconds einsum_seconds = nullptr) {
  prediction p;
  for (const einsum_work& e : w.einsums) {
    if constexpr (std::is_same_v<EinsumSeconds, std::nullptr_t>) p.gemm_s += e.local_flops() / mc.gemm_flops;
    else p.gemm_s += einsum_seconds(e);
  }
  p.elementwise_s = w.elementwise_bytes / mc.elementwise_bytes_per_s + w.exp_elements / mc.exp_per_s +
                    w.adam_elements / mc.adam_elements_per_s;
  for (const collective_work& c : w.collectives) {
    const double s = seconds(c.kind, group_size(c.axes, m), c.calls, c.bytes, mc.of(c.kind));
    p.collective_s.push_back(s);
    p.communication_s += s;
  }
  return p;
}

}  // namespace gshard::model::cost
