// gshard/moe/gating.hpp — top-k gating on one rank's groups, with GShard's
// top-2 (as Lingvo's Top2GatingOnLogits computes it) as the default: softmax, the k best experts, normalisation, the aux
// loss, random routing of the later choices keyed by the global group index
// (so any number of ranks reproduces the 1-rank routing), and capacity with
// exclusive-cumsum positions, every j-th choice placed after all (j-1)-th
// choices; padded tokens left out of every step, as Lingvo's paddings.
// Routing is two steps — choose, then place with a capacity — so that
// dropless routing can agree the capacity across ranks in between.
// Produces index routing (expert, slot, weight per token and choice). No MPI.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gshard/kernels/softmax_row.hpp"
#include "gshard/core/error.hpp"
#include "gshard/moe/stats.hpp"
#include "gshard/layout/random.hpp"
#include "gshard/layout/sharding.hpp"

namespace gshard::moe {

// What happens to the choices after the first.
enum class second_policy : std::uint8_t {
  all,     // always kept (capacity permitting)
  random,  // kept where uniform(0,1) < weight / threshold (GShard: 2·g2 > rnd)
};

// The order in which a group's choices take their experts' capacity slots.
// GShard's places every token's first choice, then every second choice, and
// so on: under a binding capacity a later token's first choice can take the
// slot an earlier token's second choice needed, so a token's output depends
// on later tokens of its group — a leak from the future in a decoder, and
// routing that training and incremental decoding do not share. by_token
// places each token's k choices, in order, before the next token places any:
// token t then depends only on tokens up to t.
enum class placement : std::uint8_t { by_choice, by_token };

// How the router is kept balanced: GShard's aux loss (a loss term), or
// DeepSeek-V3's aux-loss-free per-expert bias (added to the scores for the
// choice only, moved by the sign of each expert's load error every step).
enum class balance_mode : std::uint8_t { aux, bias };

struct gating_config {
  int top_k = 2;                  // k = 1 is Switch; k = 2 GShard
  double capacity_factor = 2.0;   // C ≈ capacity_factor · (k/2) · S/E: 2 gives each expert its average load
  double eval_capacity_factor = 0;  // at evaluation (a tape that does not record); 0: capacity_factor
  index_t min_capacity = 4;
  second_policy second = second_policy::random;
  double threshold = 0.5;         // of second_policy::random
  bool dropless = false;          // C = the largest load over the groups of the mesh: no token dropped
  double z_loss_coef = 0;         // router z-loss: coef · mean over tokens of logsumexp(logits)²
  balance_mode balance = balance_mode::aux;
  double bias_rate = 1e-3;        // γ of balance_mode::bias
  placement order = placement::by_choice;  // by_token for decoders (causal routing)
  std::uint64_t seed = 0;
};

// Throws gshard::error naming the setting and its value if `cfg` cannot
// route over E experts (the same on every rank: it depends on nothing else).
inline void validate(const gating_config& cfg, index_t E) {
  const auto bad = [](const std::string& what) { throw error("gshard::moe::gating_config: " + what); };
  if (cfg.top_k < 1 || cfg.top_k > E)
    bad("top_k = " + std::to_string(cfg.top_k) + " must be between 1 and the number of experts (" + std::to_string(E) + ")");
  for (const auto& [name, v] : {std::pair{"capacity_factor", cfg.capacity_factor}, std::pair{"eval_capacity_factor", cfg.eval_capacity_factor},
                                std::pair{"z_loss_coef", cfg.z_loss_coef}, std::pair{"bias_rate", cfg.bias_rate}})
    if (!std::isfinite(v) || v < 0) bad(std::string(name) + " = " + std::to_string(v) + " must be finite and >= 0");
  if (cfg.min_capacity < 0) bad("min_capacity = " + std::to_string(cfg.min_capacity) + " is negative");
  if (!(cfg.threshold > 0) || !std::isfinite(cfg.threshold))
    bad("threshold = " + std::to_string(cfg.threshold) + " must be finite and > 0");
}

// The capacity C of a group of S tokens over E experts with k choices, as
// Lingvo's Top2GatingOnLogits computes it for k = 2: the automatic value
// floor(k·S·factor / 2E), at most S (an expert receives each token once at
// most, so a larger C only adds empty slots); if it exceeds min_capacity,
// rounded up to a multiple of 4, else min_capacity as given. The same on
// every rank: it depends only on the configuration and the group size.
inline index_t capacity(index_t S, index_t E, const gating_config& cfg, double factor = -1) {
  if (E <= 0) throw shape_error("gshard::moe::capacity: the number of experts is " + std::to_string(E));
  if (factor < 0) factor = cfg.capacity_factor;
  const double wanted = std::floor(double(cfg.top_k) * double(S) * factor / (2.0 * double(E)));
  const index_t automatic = index_t(std::min(wanted, double(S)));
  if (automatic <= cfg.min_capacity) return cfg.min_capacity;
  return (automatic + 3) / 4 * 4;
}

// Where each token of this rank's groups goes. Token t = g·S + s; choice j
// (0: first) at index k·t + j. expert = -1: not routed (dropped, skipped by
// random routing, fewer than k unmasked experts, an invalid or a padded token). A
// choice placed with weight 0 (its gate underflowed to 0) holds its slot,
// as in Lingvo, but is not dispatched.
template <class T>
struct routing {
  index_t groups = 0, tokens = 0, experts = 0, capacity = 0;
  int k = 2;
  placement order = placement::by_choice;  // how place_choices fills the slots
  index_t group_offset = 0;          // global index of this rank's first group
  std::vector<std::int32_t> expert;
  std::vector<std::int32_t> slot;
  std::vector<T> weight;             // the combine weight (normalised gate for k ≥ 2, the gate for k = 1)
  std::vector<T> gates;              // softmax, [G·S·E] (zeros for invalid tokens)
  std::vector<std::int32_t> wanted;  // the k chosen experts before capacity and random routing (-1: none)
  std::vector<double> lse;           // logsumexp of each token's logits (for the z-loss)
  std::vector<index_t> real;         // per group: the tokens that are not padding (the aux loss's denominators)

  std::size_t choice(index_t g, index_t s, int j) const { return std::size_t(k * (g * tokens + s) + j); }
  index_t group_of(std::size_t c) const { return index_t(c) / (index_t(k) * tokens); }  // choice()'s g
  bool dispatched(std::size_t c) const { return expert[c] >= 0 && weight[c] != T(0); }
  // The row of choice c (of group g) in the experts' [E, G, C] slots.
  index_t slot_row(std::size_t c, index_t g) const { return (index_t(expert[c]) * groups + g) * capacity + slot[c]; }
};

// What routing a sequence a few positions at a time carries from one call
// to the next (incremental decoding), so that the calls route each position
// as one call over the whole sequence would with placement::by_token: the
// whole sequence's capacity, the choices each expert of each group has
// taken so far, and the position the next call starts at (random routing's
// key). Each call's slots are its own (at most min(S, capacity) per
// expert); only the drops count the earlier calls' choices.
struct routing_state {
  index_t capacity = 0;          // the whole sequence's C
  bool dropless = false;         // no capacity: nothing drops
  index_t position = 0;          // the first position of the next call
  std::vector<index_t> filled;   // [local groups · E]: choices placed so far
  // The global index random routing keys this rank's first group by; -1:
  // its offset in the batch. (Beam search sets it to the rows a 1-rank run
  // of the same sources would route, whatever the ranks' blocks.)
  index_t first_group = -1;
};

// The state for `groups` local groups of sequences of `length` positions:
// the capacity one call over them would use at evaluation (eval capacity
// factor), none when dropless.
inline routing_state start_routing(const gating_config& cfg, index_t E, index_t length, index_t groups) {
  validate(cfg, E);
  if (cfg.order != placement::by_token)
    throw error("gshard::moe::start_routing: routing a sequence a few positions at a time needs gating_config::order = "
                "placement::by_token (GShard's by_choice places a later token's first choice before an earlier token's "
                "second, which a call cannot know)");
  routing_state st;
  st.dropless = cfg.dropless;
  st.capacity = capacity(length, E, cfg, cfg.eval_capacity_factor > 0 ? cfg.eval_capacity_factor : cfg.capacity_factor);
  st.filled.assign(std::size_t(groups * E), 0);
  return st;
}

namespace detail {
// The random number deciding whether choice j ≥ 1 of token s of global group
// g is kept: for j = 1 GShard's (seed, stream, group, token).
inline double keep_draw(std::uint64_t seed, std::uint64_t stream, std::uint64_t group, std::uint64_t s, int j) {
  return uniform(seed, stream + std::uint64_t(j - 1) * 0x9E3779B97F4A7C15ull, group, s);
}
// The softmax of one token's logits into `gates`, returning their
// logsumexp; NaN (gates untouched) if the token is invalid — a NaN or +Inf
// logit, or no finite one. -Inf masks that expert: its gate is 0.
template <class T>
double token_softmax(const T* l, index_t E, T* gates) {
  bool valid = true, any_finite = false;
  for (index_t e = 0; e < E; ++e) {
    if (std::isnan(l[e]) || l[e] == std::numeric_limits<T>::infinity()) valid = false;
    if (std::isfinite(l[e])) any_finite = true;
  }
  if (!valid || !any_finite) return std::numeric_limits<double>::quiet_NaN();
  return gshard::detail::softmax_row(l, E, gates);  // masked experts (-inf) get 0
}
// The k best unmasked experts of one token by score (gate + bias), ties to
// the lowest id, into `wanted`; returns how many (fewer than k if fewer are
// unmasked). The first is GShard's argmax(gates), the second the argmax with
// the first zeroed (a gate that underflowed to 0 is still a choice).
// `score` and `taken` are the caller's scratch of E entries.
template <class T>
int top_k(const T* l, const T* gates, const double* bias, index_t E, int k, std::vector<double>& score,
          std::vector<char>& taken, std::int32_t* wanted) {
  for (index_t e = 0; e < E; ++e) score[std::size_t(e)] = double(gates[e]) + (bias ? bias[e] : 0.0);
  std::fill(taken.begin(), taken.end(), 0);
  int chosen = 0;
  for (; chosen < k; ++chosen) {
    index_t best = -1;
    for (index_t e = 0; e < E; ++e)
      if (!taken[std::size_t(e)] && std::isfinite(l[e]) && (best < 0 || score[std::size_t(e)] > score[std::size_t(best)])) best = e;
    if (best < 0) break;
    taken[std::size_t(best)] = 1;
    wanted[chosen] = std::int32_t(best);
  }
  return chosen;
}
}  // namespace detail

// Step 1 of top-k gating of G groups of S tokens over E experts (`logits`
// [G,S,E] row-major, in T = float or double): softmax; the k best experts
// by gate (+ `bias`, for the choice only, if given: balance_mode::bias);
// normalisation (k ≥ 2); the aux loss and z-loss terms; random routing of
// the later choices (keyed by the group and the position: first_position +
// s). Fills r (without slots) and returns this rank's
// statistics (with the demand, without loads and drops). Weights, the aux
// sums, random routing and the demand accumulate per group in one pass over
// its tokens.
//
// `paddings` ([G,S], or null: none) marks padded tokens with a nonzero
// value, as Lingvo's: a padded token chooses no expert and adds nothing to
// the aux loss, the z-loss or the counters, whose means run over the real
// tokens of each group (Lingvo's density_denom without legacy_mtf_behavior:
// with no padding, GShard's means over S). Its logits are never read, so
// whatever a padded position holds changes no other token's routing.
template <class T>
gating_stats choose_experts(const T* logits, index_t G, index_t S, index_t E, index_t group_offset, std::uint64_t stream,
                            const gating_config& cfg, const double* bias, routing<T>& r, const T* paddings = nullptr,
                            index_t first_position = 0) {
  static_assert(std::is_floating_point_v<T> && sizeof(T) >= 4, "gshard::moe::choose_experts: gating runs in float or double");
  validate(cfg, E);
  const int k = cfg.top_k;
  r.groups = G, r.tokens = S, r.experts = E, r.k = k, r.group_offset = group_offset, r.capacity = 0, r.order = cfg.order;
  r.expert.assign(std::size_t(k * G * S), -1);
  r.slot.assign(std::size_t(k * G * S), -1);
  r.weight.assign(std::size_t(k * G * S), T(0));
  r.gates.assign(std::size_t(G * S * E), T(0));
  r.wanted.assign(std::size_t(k * G * S), -1);
  r.lse.assign(std::size_t(G * S), 0.0);
  r.real.assign(std::size_t(G), S);
  gating_stats st;
  st.expert_load.assign(std::size_t(E), 0);
  st.expert_demand.assign(std::size_t(E), 0);
  st.dropped.assign(std::size_t(k), 0);
  st.skipped.assign(std::size_t(k), 0);
  std::vector<double> density(static_cast<std::size_t>(E)), proxy(static_cast<std::size_t>(E)), score(static_cast<std::size_t>(E));
  std::vector<char> taken(static_cast<std::size_t>(E));
  for (index_t g = 0; g < G; ++g) {
    std::fill(density.begin(), density.end(), 0.0);
    std::fill(proxy.begin(), proxy.end(), 0.0);
    for (index_t s = 0; s < S; ++s) {
      if (paddings && paddings[g * S + s] != T(0)) {
        ++st.padded;
        --r.real[std::size_t(g)];
        continue;
      }
      const T* l = logits + (g * S + s) * E;
      T* gates = r.gates.data() + (g * S + s) * E;
      const double lse = detail::token_softmax(l, E, gates);
      if (std::isnan(lse)) {
        ++st.invalid;
        continue;
      }
      r.lse[std::size_t(g * S + s)] = lse;
      st.z_sum += lse * lse;
      const std::size_t c0 = r.choice(g, s, 0);
      const int chosen = detail::top_k(l, gates, bias, E, k, score, taken, r.wanted.data() + c0);
      T wsum = 0;
      for (int j = 0; j < chosen; ++j) wsum += gates[r.wanted[c0 + std::size_t(j)]];
      // Normalised over the k choices (GShard, before capacity and random
      // routing); with k = 1 the combine weight is the gate itself (Switch).
      const T denom = k >= 2 ? wsum + T(1e-9) : T(1);
      for (int j = 0; j < chosen; ++j) {
        r.expert[c0 + std::size_t(j)] = r.wanted[c0 + std::size_t(j)];
        r.weight[c0 + std::size_t(j)] = gates[r.wanted[c0 + std::size_t(j)]] / denom;
      }
      // The aux loss's ingredients, before capacity.
      density[std::size_t(r.wanted[c0])] += 1.0;
      for (index_t e = 0; e < E; ++e) proxy[std::size_t(e)] += double(gates[e]);
      // Random routing of the later choices.
      if (cfg.second == second_policy::random)
        for (int j = 1; j < chosen; ++j) {
          const std::size_t c = c0 + std::size_t(j);
          if (!(detail::keep_draw(cfg.seed, stream, std::uint64_t(group_offset + g), std::uint64_t(first_position + s), j) <
                double(r.weight[c]) / std::max(cfg.threshold, 1e-9))) {
            r.expert[c] = -1;
            r.weight[c] = T(0);
            ++st.skipped[std::size_t(j)];
          }
        }
      for (int j = 0; j < chosen; ++j)
        if (r.expert[c0 + std::size_t(j)] >= 0) ++st.expert_demand[std::size_t(r.expert[c0 + std::size_t(j)])];
    }
    const double n = double(r.real[std::size_t(g)]);
    double aux = 0;
    for (index_t e = 0; e < E; ++e) aux += (density[std::size_t(e)] / n) * (proxy[std::size_t(e)] / n);
    st.aux_sum += n > 0 ? aux * double(E * E) / double(E) : 0.0;
  }
  st.tokens = G * S - st.padded;
  return st;
}

// The largest number of choices any expert receives in one group: the
// capacity at which nothing is dropped.
template <class T>
index_t largest_load(const routing<T>& r) {
  index_t most = 0;
  std::vector<index_t> count(static_cast<std::size_t>(r.experts));
  for (index_t g = 0; g < r.groups; ++g) {
    std::fill(count.begin(), count.end(), 0);
    for (index_t s = 0; s < r.tokens; ++s)
      for (int j = 0; j < r.k; ++j) {
        const int e = r.expert[r.choice(g, s, j)];
        if (e >= 0) most = std::max(most, ++count[std::size_t(e)]);
      }
  }
  return most;
}

// Step 2: slots with capacity C, in r.order: by_choice (GShard's), the
// j-th choices of a group in token order after every (j-1)-th choice;
// by_token, each token's choices in order before the next token's. Over
// capacity a choice drops. With `state` (by_token), a choice drops when its
// expert has taken state->capacity choices of the group over this and the
// earlier calls, and takes the next of this call's C slots otherwise.
template <class T>
void place_choices(routing<T>& r, index_t C, gating_stats& st, routing_state* state = nullptr) {
  r.capacity = C;
  st.capacity = C;
  std::vector<index_t> count(static_cast<std::size_t>(r.experts));
  index_t* filled = nullptr;
  const auto place = [&](index_t g, index_t s, int j) {
    const std::size_t c = r.choice(g, s, j);
    const int e = r.expert[c];
    if (e < 0) return;
    const bool fits = filled ? state->dropless || filled[e] < state->capacity : count[std::size_t(e)] < C;
    if (fits) {
      r.slot[c] = std::int32_t(count[std::size_t(e)]++);
      if (filled) ++filled[e];
      ++st.expert_load[std::size_t(e)];
    } else {
      r.expert[c] = -1;
      r.weight[c] = T(0);
      ++st.dropped[std::size_t(j)];
    }
  };
  for (index_t g = 0; g < r.groups; ++g) {
    std::fill(count.begin(), count.end(), 0);
    if (state) filled = state->filled.data() + g * r.experts;
    if (r.order == placement::by_choice) {
      for (int j = 0; j < r.k; ++j)
        for (index_t s = 0; s < r.tokens; ++s) place(g, s, j);
    } else {
      for (index_t s = 0; s < r.tokens; ++s)
        for (int j = 0; j < r.k; ++j) place(g, s, j);
    }
  }
  if (state) state->position += r.tokens;
}

// Both steps with the configuration's capacity (`factor`: the capacity
// factor to use, e.g. at evaluation; the capacity counts every position of
// a group, padded or not, as Lingvo's); no bias.
template <class T>
gating_stats route_tokens(const T* logits, index_t G, index_t S, index_t E, index_t group_offset, std::uint64_t stream,
                          const gating_config& cfg, routing<T>& r, double factor = -1, const T* paddings = nullptr) {
  gating_stats st = choose_experts<T>(logits, G, S, E, group_offset, stream, cfg, nullptr, r, paddings);
  place_choices(r, capacity(S, E, cfg, factor), st);
  return st;
}

// The gradient rule of the gating: d(loss)/d(logits) from the gradients of
// the combine weights (`dweight`, one per choice), of the aux loss
// (`aux_grad`) and of the mean z-loss (`z_grad`, over `z_tokens` tokens);
// none flows through the discrete choices (top-k, capacity, random
// routing), as in GShard. For k ≥ 2, w_j = g_j / D with D = Σ_i g_i + 1e-9
// over the chosen (wanted) experts; for k = 1, w = g. aux = (E / G_total) ·
// Σ_g Σ_e (count1_e / n_g) · (Σ_s gates_e / n_g) over the n_g real tokens
// of group g, so ∂aux/∂gates[g,s,e] = E · count1_e[g] / (G_total · n_g²);
// ∂lse/∂logits = gates. Invalid and padded tokens get none.
template <class T>
void gating_backward(const routing<T>& r, const std::vector<T>& dweight, double aux_grad, index_t G_total, double z_grad,
                     double z_tokens, T* dlogits) {
  const index_t G = r.groups, S = r.tokens, E = r.experts;
  const int k = r.k;
  std::vector<double> count1(static_cast<std::size_t>(E));
  std::vector<T> dg(static_cast<std::size_t>(E));
  for (index_t g = 0; g < G; ++g) {
    std::fill(count1.begin(), count1.end(), 0.0);
    for (index_t s = 0; s < S; ++s) {
      const int e1 = r.wanted[r.choice(g, s, 0)];
      if (e1 >= 0) count1[std::size_t(e1)] += 1.0;
    }
    const double n = double(r.real[std::size_t(g)]);
    for (index_t s = 0; s < S; ++s) {
      T* dl = dlogits + (g * S + s) * E;
      const std::size_t c0 = r.choice(g, s, 0);
      if (r.wanted[c0] < 0) {  // an invalid or padded token: no gradient
        std::fill(dl, dl + E, T(0));
        continue;
      }
      const T* gates = r.gates.data() + (g * S + s) * E;
      for (index_t e = 0; e < E; ++e)
        dg[std::size_t(e)] = T(aux_grad * double(E) * count1[std::size_t(e)] / (double(G_total) * n * n));
      if (k == 1) {
        dg[std::size_t(r.wanted[c0])] += dweight[c0];
      } else {
        T D = T(1e-9), wdot = 0;
        for (int j = 0; j < k; ++j)
          if (r.wanted[c0 + std::size_t(j)] >= 0) D += gates[r.wanted[c0 + std::size_t(j)]];
        for (int j = 0; j < k; ++j)
          if (r.wanted[c0 + std::size_t(j)] >= 0) wdot += dweight[c0 + std::size_t(j)] * gates[r.wanted[c0 + std::size_t(j)]];
        for (int j = 0; j < k; ++j) {
          const int e = r.wanted[c0 + std::size_t(j)];
          if (e >= 0) dg[std::size_t(e)] += dweight[c0 + std::size_t(j)] / D - wdot / (D * D);
        }
      }
      T dot = 0;
      for (index_t e = 0; e < E; ++e) dot += dg[std::size_t(e)] * gates[e];
      const double dz = z_tokens > 0 ? z_grad * 2.0 * r.lse[std::size_t(g * S + s)] / z_tokens : 0.0;
      for (index_t e = 0; e < E; ++e) dl[e] = gates[e] * (dg[std::size_t(e)] - dot) + T(dz * double(gates[e]));
    }
  }
}

}  // namespace gshard::moe
