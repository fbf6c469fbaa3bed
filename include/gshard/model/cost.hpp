// gshard/model/cost.hpp — a training step of the MoE Transformer counted
// from its config and its mesh's sizes, without running it: every einsum
// (FLOPs and local GEMM shape), every collective as the planners choose it
// (kind, axes, calls, bytes — what the counters would record), the
// element-wise traffic, the memory per rank; and, from a machine's GEMM rate,
// memory bandwidth and each collective's α–β, the step's predicted time.
// So a job can be sized before it runs (examples/cost.cpp), and the count is
// checked against the counters of real steps (test_training.cpp).
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
#include "gshard/model/transformer.hpp"
#include "gshard/layout/reshard_steps.hpp"

namespace gshard::model::cost {

// Axis indices of the cost model's mesh, and their masks. The mesh is the
// roles' (data, expert[, model]): the batch over data × expert, the experts
// over expert, heads and hidden units over model — the trainer's meshes, and
// GShard's own (D ranks on one axis: data 1, expert D).
inline constexpr int data_axis = 0, expert_axis = 1, model_axis = 2;
inline constexpr std::uint32_t data_bit = 1u << data_axis, expert_bit = 1u << expert_axis, model_bit = 1u << model_axis;

struct mesh_sizes {
  index_t data = 1, expert = 1, model = 1;
  bool has_model_axis = false;  // a "model" axis (of any size, 1 too: its collectives still run)
  index_t ranks() const { return data * expert * model; }
  const index_t* sizes() const { return &data; }
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

// Every weight the transformer declares for `c`, in its order, on a mesh
// with or without a model axis: transformer::declare_blocks, moe::layer's
// constructor and ffn_weights declare them; test_training's "[cost]" case
// compares this list with their declarations (names, extents, shards).
inline std::vector<weight> weights(const config& c, bool model_axis_in_mesh = true) {
  std::vector<weight> w;
  auto add = [&](std::string name, std::vector<index_t> extents, std::vector<std::vector<int>> split, bool expert = false) {
    weight x{std::move(name), std::move(extents), {}, expert};
    for (std::size_t d = 0; d < split.size(); ++d)
      for (int a : split[d])
        if (a != model_axis || model_axis_in_mesh) x.layout.push(int(d), a);
    w.push_back(std::move(x));
  };
  const index_t M = c.model, N = c.heads, K = c.head_dim, E = c.experts;
  add("embed", {c.vocab, M}, {});
  if (c.positions == position_kind::learned) add("positions", {c.max_len, M}, {});
  for (int l = 0; l < c.layers; ++l) {
    const std::string b = "block" + std::to_string(l) + ".";
    const index_t H = c.ffn_hidden(l);
    add(b + "norm1", {M}, {});
    for (const char* q : {"wq", "wk", "wv"}) add(b + q, {M, N, K}, {{}, {model_axis}});
    add(b + "wo", {N, K, M}, {{model_axis}});
    add(b + "norm2", {M}, {});
    if (c.is_moe(l)) {
      add(b + "gate", {M, E}, {});
      add(b + "wi", {E, M, H}, {{expert_axis}, {}, {model_axis}}, true);
      if (c.ffn == ffn_kind::swiglu) add(b + "wi_up", {E, M, H}, {{expert_axis}, {}, {model_axis}}, true);
      add(b + "wo_experts", {E, H, M}, {{expert_axis}, {model_axis}}, true);
      if (c.shared_experts > 0) {
        const index_t Hs = H * c.shared_experts;
        add(b + "shared_w1", {M, Hs}, {{}, {model_axis}});
        if (c.ffn == ffn_kind::swiglu) add(b + "shared_w1_up", {M, Hs}, {{}, {model_axis}});
        add(b + "shared_w2", {Hs, M}, {{model_axis}});
      }
    } else {
      add(b + "w1", {M, H}, {{}, {model_axis}});
      if (c.ffn == ffn_kind::swiglu) add(b + "w1_up", {M, H}, {{}, {model_axis}});
      add(b + "w2", {H, M}, {{model_axis}});
    }
  }
  add("final_norm", {M}, {});
  add("unembed", {M, c.vocab}, {});
  return w;
}

// Elements of a layout's shard.
inline index_t local_elements(const detail::rlayout& l, const std::vector<index_t>& extents, const mesh_sizes& m) {
  index_t n = 1;
  for (std::size_t d = 0; d < extents.size(); ++d) n *= extents[d] / detail::dim_parts(l, int(d), m.sizes());
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
  index_t capacity = 0;  // C of the MoE layers
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
};

namespace detail_cost {
using gshard::detail::rlayout;

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

// The collectives of a reshard plan on a tensor of `extents`, its input in `from`.
inline void add_plan(std::vector<collective_work>& cs, const rlayout& from, const rlayout& to, const std::vector<index_t>& extents,
                     const mesh_sizes& m, int element_bytes, const std::string& what) {
  const auto plan = gshard::detail::plan_reshard(from, to, m.naxes(), m.sizes());
  for (int i = 0; i < plan.n; ++i) {
    const auto& s = plan.step[i];
    if (!is_collective(s.kind)) continue;
    add(cs, collective_of(s.kind), s.mask, 1, double(local_elements(plan.state[i], extents, m)) * element_bytes, what);
  }
}
}  // namespace detail_cost

// What one training step (forward, backward, Adam) does on each rank, in
// the steps marked below: the einsums, the collectives, the weights'
// gradients and updates (through buckets), the element-wise work and the
// memory. Every step reads the same derived extents (B, L, the local
// batch, heads, experts, capacity) and adds to one step_work. Not counted:
// rematerialisation's recomputed forward and attention's recomputed logits.
inline step_work count_step(const config& c, const mesh_sizes& m, const step_options& o) {
  const index_t d = m.data, e = m.expert, mm = m.model;
  const index_t B = o.batch, L = o.seq, M = c.model, N = c.heads, K = c.head_dim, V = c.vocab, E = c.experts;
  if (B % (d * e) != 0 || N % mm != 0 || (E > 0 && E % e != 0))
    throw shape_error("gshard::model::cost: batch " + std::to_string(B) + ", heads " + std::to_string(N) + " and experts " +
                      std::to_string(E) + " do not divide over data " + std::to_string(d) + " x expert " + std::to_string(e) +
                      " x model " + std::to_string(mm));
  const int f = o.element_bytes, k = c.gating.top_k;
  const index_t Bl = B / (d * e), Tl = Bl * L, Nl = N / mm;
  step_work w;
  w.capacity = E > 0 ? moe::capacity(L, E, c.gating) : 0;
  const index_t C = w.capacity;

  // Einsums, with each label's global and local extent.
  const double P = double(m.ranks());
  const index_t Gd = B / d;  // groups at the experts: G over data only
  auto einsum = [&](std::string spec, int calls, std::initializer_list<std::tuple<char, index_t, index_t>> labels) {
    einsum_work x{std::move(spec), calls, {}, {}, 0};
    for (const auto& [l, g, loc] : labels) x.global[std::size_t(l)] = g, x.local[std::size_t(l)] = loc;
    x.flops = einsum_work::passes * double(calls) * gshard::detail::parse_einsum(x.spec).flops(x.global.data()) / P;
    w.model_flops += x.flops;
    w.einsums.push_back(std::move(x));
  };
  const int ffn_inputs = c.ffn == ffn_kind::swiglu ? 2 : 1;
  int moe_layers = 0, dense_layers = 0;
  for (int l = 0; l < c.layers; ++l) (c.is_moe(l) ? moe_layers : dense_layers)++;
  const int layers = c.layers;
  const std::tuple<char, index_t, index_t> b_{'B', B, Bl}, l_{'L', L, L}, t_{'T', L, L}, m_{'M', M, M}, n_{'N', N, Nl}, k_{'K', K, K},
      v_{'V', V, V};
  einsum("BLM,MNK->BLNK", 3 * layers, {b_, l_, m_, n_, k_});
  einsum("BLNK,BTNK->BNLT", layers, {b_, l_, t_, n_, k_});
  einsum("BNLT,BTNK->BLNK", layers, {b_, l_, t_, n_, k_});
  einsum("BLNK,NKM->BLM", layers, {b_, l_, n_, k_, m_});
  // Dense FFNs (and a dense model's "slot" FFNs, of their own width).
  for (int l = 0; l < layers; ++l) {
    if (c.is_moe(l)) continue;
    const std::tuple<char, index_t, index_t> h_{'H', c.ffn_hidden(l), c.ffn_hidden(l) / mm};
    einsum("BLM,MH->BLH", ffn_inputs, {b_, l_, m_, h_});
    einsum("BLH,HM->BLM", 1, {b_, l_, m_, h_});
  }
  if (moe_layers > 0) {
    const std::tuple<char, index_t, index_t> g_{'G', B, Bl}, s_{'S', L, L}, e_{'E', E, E}, ee_{'E', E, E / e},
        gd_{'G', B, Gd}, c_{'C', C, C}, h_{'H', c.hidden, c.hidden / mm};
    einsum("GSM,ME->GSE", moe_layers, {g_, s_, m_, e_});
    einsum("EGCM,EMH->EGCH", ffn_inputs * moe_layers, {ee_, gd_, c_, m_, h_});
    einsum("EGCH,EHM->EGCM", moe_layers, {ee_, gd_, c_, m_, h_});
    if (c.shared_experts > 0) {
      const index_t Hs = c.hidden * c.shared_experts;
      const std::tuple<char, index_t, index_t> hs_{'H', Hs, Hs / mm};
      einsum("GSM,MH->GSH", ffn_inputs * moe_layers, {g_, s_, m_, hs_});
      einsum("GSH,HM->GSM", moe_layers, {g_, s_, m_, hs_});
    }
  }
  einsum("BLM,MV->BLV", 1, {b_, l_, m_, v_});

  // Collectives. The forward's and their transposes in the backward.
  auto& cs = w.collectives;
  using detail_cost::add;
  const std::uint32_t batch = data_bit | expert_bit, all = batch | (m.has_model_axis ? model_bit : 0u);
  // The MoE layers' all_to_alls pipelined in chunks of C (overlap_degree):
  // as many calls per all_to_all, the same bytes in all. (The expert
  // einsums are counted whole: their FLOPs are the chunks' sum.)
  const int chunks = int(std::min<index_t>(std::max(c.overlap_degree, 1), std::max<index_t>(C, 1)));
  if (moe_layers > 0) {
    const double xe = double((E)*Bl * C * M) * f;  // [E,G{data,expert},C,M] = [E{expert},G{data},C,M] per rank
    add(cs, collective::all_to_all, expert_bit, 4 * moe_layers * chunks, 4.0 * moe_layers * xe,
        "MoE dispatch and combine, forward and backward");
    // The gating counters, aux loss and z-loss: 2E + 2k + 6 doubles per MoE layer (with the padded positions and a check of the paddings).
    add(cs, collective::all_reduce, batch, moe_layers, double(moe_layers) * double(2 * E + 2 * k + 6) * 8, "MoE statistics");
    if (c.gating.dropless) add(cs, collective::all_reduce, batch, moe_layers, double(moe_layers) * 8, "dropless capacity");
  }
  add(cs, collective::all_reduce, batch, 1, 2 * 8, "cross-entropy's sum and count");
  if (m.has_model_axis) {  // after each model-split contraction, and its input's gradient
    const double act = double(Tl * M) * f;
    int per_tokens = 2 * layers + 2 * dense_layers + (c.shared_experts > 0 ? 2 * moe_layers : 0);
    add(cs, collective::all_reduce, model_bit, per_tokens, per_tokens * act, "activations of model-split contractions");
    if (moe_layers > 0)
      add(cs, collective::all_reduce, model_bit, 2 * moe_layers * chunks,
          2.0 * moe_layers * double((E / e) * (B / d) * C * M) * f, "expert FFN outputs and inputs' gradients");
  }
  add(cs, collective::all_reduce, all, 1, 8, "global gradient norm");
  // The weights' gradients: from the pending sum over the batch axes that do
  // not split them, into the weight (replicated update) or its update
  // layout; and, sharded, the updated blocks gathered back. Plans that can
  // share a collective go through buckets (gshard/state/buckets.hpp) as the tape
  // fills them — gradients in the order they complete, the reverse of the
  // weights' first use (here: of their declaration) — and as Adam fills
  // them, in declaration order.
  struct bucket {
    gshard::detail::reshard_steps plan{};  // its steps (its first member's plan)
    std::string what;
    std::vector<std::pair<const weight*, gshard::detail::reshard_steps>> members;  // each with its own plan's layouts
    double bytes = 0;
  };
  std::vector<bucket> open;
  auto run = [&](bucket& b) {
    for (int i = 0; i < b.plan.n; ++i) {
      if (!is_collective(b.plan.step[i].kind) || b.members.empty()) continue;
      double bytes = 0;
      for (const auto& [x, plan] : b.members) bytes += double(local_elements(plan.state[i], x->extents, m)) * f;
      add(cs, collective_of(b.plan.step[i].kind), b.plan.step[i].mask, 1, bytes, b.what);
    }
    b.members.clear(), b.bytes = 0;
  };
  auto reduce = [&](const weight& x, const gshard::detail::rlayout& from, const gshard::detail::rlayout& to, const std::string& what) {
    const auto plan = gshard::detail::plan_reshard(from, to, m.naxes(), m.sizes());
    if (o.bucket_bytes == 0 || !gshard::detail::stackable(plan)) return detail_cost::add_plan(cs, from, to, x.extents, m, f, what);
    auto it = std::find_if(open.begin(), open.end(), [&](const bucket& b) { return gshard::detail::same_steps(b.plan, plan) && b.what == what; });
    if (it == open.end()) it = open.insert(open.end(), bucket{plan, what, {}, 0});
    it->members.push_back({&x, plan});
    it->bytes += double(local_elements(from, x.extents, m)) * f;
    if (it->bytes >= double(o.bucket_bytes)) run(*it);
  };
  const std::vector<weight> ws = weights(c, m.has_model_axis);
  std::vector<gshard::detail::rlayout> targets;
  for (const weight& x : ws) {
    gshard::detail::rlayout target = x.layout;
    if (o.sharded_update) {
      const auto u = gshard::detail::choose_update_layout(x.layout, int(x.extents.size()), x.extents.data(), m.sizes(),
                                                          m.naxes(), batch);
      if (u.parts > 1) target = u.layout;
    }
    targets.push_back(target);
    const double g = double(local_elements(target, x.extents, m)) * f;
    w.parameter_bytes += double(local_elements(x.layout, x.extents, m)) * f;
    w.gradient_bytes += g;
    const double block = target == x.layout ? 0 : g;  // the weight's block a sharded update works on
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
    const double local = double(local_elements(target, x.extents, m));
    const double cols = double(x.extents[std::size_t(r - 1)] / gshard::detail::dim_parts(target, r - 1, m.sizes()));
    const double rows = double(x.extents[std::size_t(r - 2)] / gshard::detail::dim_parts(target, r - 2, m.sizes()));
    const double lead = local / (rows * cols);
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
    gshard::detail::rlayout pending = ws[i].layout;
    pending.partial = batch & ~ws[i].layout.split_mask();
    reduce(ws[i], pending, targets[i], "weight gradients");
  }
  for (auto& b : open) run(b);
  open.clear();
  for (std::size_t i = 0; i < ws.size(); ++i)
    if (!(targets[i] == ws[i].layout)) reduce(ws[i], targets[i], ws[i].layout, "updated weights");
  for (auto& b : open) run(b);

  // Element-wise work, an estimate: the stream passes (elements read or
  // written by norms, residual adds, attention's probabilities, dispatch,
  // combine and the all_to_alls' packing, activations; the backward twice
  // the forward's), the exponentials (softmaxes, SwiGLU's sigmoid) and
  // Adam's elements; and the activations the backward keeps (the einsums'
  // inputs, attention's probabilities, the activations' outputs, the norms'
  // inputs).
  const double act = double(Tl * M), scores = double(Bl * Nl * L * L), qkv = double(Tl * Nl * K);
  double stream = 4 * act, exps = 2 * double(Tl * V), keep = 2 * double(Tl * V);  // embedding; cross-entropy, forward and backward
  stream += 2 * 3 * double(Tl * V);
  for (int l = 0; l < layers; ++l) {
    // Two norms and two residual adds; causal attention's probabilities,
    // written by the forward and read by the backward (its logits and their
    // gradients live in cache-sized blocks), and the exps of the half at
    // or below the diagonal.
    // With attention_memory::recompute_probabilities it keeps two numbers
    // per row, and its backward computes the exps again (the extra QKᵀ
    // GEMM, a sixth of attention's, is not counted).
    const bool kept = c.attention == attention_memory::keep_probabilities;
    stream += 2 * (6 * act + 6 * act) + (kept ? 2 * scores : 0.0);
    exps += (kept ? 1.0 : 2.0) * scores / 2;
    keep += 4 * act + 4 * qkv + (kept ? scores : 2.0 * double(Bl * Nl * L));  // norms' inputs and outputs, q k v o, the probabilities
    const double gated = ffn_inputs == 2 ? 1.0 : 0.0;
    if (c.is_moe(l)) {
      const double slots = double((E / e) * (B / d) * C), Hl = double(c.hidden / mm), xe = double(E * Bl * C * M);
      stream += 2 * (xe + 4 * double(k) * act + 4 * xe + (2 + 3 * gated) * slots * Hl);  // dispatch, combine, packing, activation
      exps += double(Tl * E) + 2 * gated * slots * Hl;
      keep += 2 * xe + ffn_inputs * slots * Hl + slots * double(M);
      if (c.shared_experts > 0) {  // the shared experts: a dense FFN of shared_experts · H hidden units over every token
        const double Hs = double(c.hidden * c.shared_experts / mm);
        stream += 2 * (2 + 3 * gated) * double(Tl) * Hs;
        exps += 2 * gated * double(Tl) * Hs;
        keep += ffn_inputs * double(Tl) * Hs + act;
      }
    } else {
      const double Hl = double(c.ffn_hidden(l) / mm);
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
