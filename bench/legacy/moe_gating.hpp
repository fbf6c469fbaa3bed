// bench/legacy/ (frozen copy of gshard/moe/gating.hpp — GShard's top-2 gating (the design's steps 1-9) on
// one rank's groups: softmax, top-1 and top-2, normalisation, the aux loss,
// capacity with exclusive cumsum positions (every first choice before any
// second choice), dropping, and random routing of the second expert keyed by
// the global group index, so any number of ranks reproduces the 1-rank
// routing. Produces index routing (expert, slot, weight per token and
// choice); the dense dispatch/combine tensors are built from it. No MPI.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gshard/error.hpp"
#include "gshard/sharding.hpp"

namespace legacy::moe {
using namespace gshard;

enum class second_policy : std::uint8_t {
  all,     // always keep the second expert (capacity permitting)
  random,  // keep it where uniform(0,1) < g2 / threshold (GShard: 2·g2 > rnd)
};

struct gating_config {
  double capacity_factor = 2.0;  // C ≈ S·factor/E; 2 reproduces the paper's 2S/E
  index_t min_capacity = 4;
  second_policy second = second_policy::random;
  double threshold = 0.5;
  std::uint64_t seed = 0;
};

// C = max(min_capacity, round_up_to_multiple_of_4(floor(S·capacity_factor/E))).
inline index_t capacity(index_t S, index_t E, const gating_config& cfg) {
  if (E <= 0) throw shape_error("gshard::moe::capacity: the number of experts is " + std::to_string(E));
  const index_t raw = index_t(std::floor(double(S) * cfg.capacity_factor / double(E)));
  const index_t up4 = (raw + 3) / 4 * 4;
  return std::max(cfg.min_capacity, up4);
}

// A uniform double in [0, 1), a pure function of its arguments (SplitMix64
// finaliser over the mixed key): the same on every rank and at every rank count.
inline double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t group, std::uint64_t token) {
  auto mix = [](std::uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  const std::uint64_t z = mix(mix(mix(mix(seed) ^ stream) ^ group) ^ token);
  return double(z >> 11) * 0x1.0p-53;
}

// Where each token of this rank's groups goes. Token t = g·S + s; choice k
// (0: first, 1: second) at index 2·t + k. expert = -1: not routed (dropped,
// skipped, or an invalid token).
template <class T>
struct routing {
  index_t groups = 0, tokens = 0, experts = 0, capacity = 0;
  index_t group_offset = 0;        // global index of this rank's first group
  std::vector<std::int32_t> expert;
  std::vector<std::int32_t> slot;
  std::vector<T> weight;           // normalised gate of the choice (combine weight)
  std::vector<T> gates;            // softmax, [G·S·E] (zeros for invalid tokens)
  std::vector<std::int32_t> wanted;  // the top-1 and top-2 experts before capacity
                                     // and random routing (-1: none); for backward

  std::size_t choice(index_t g, index_t s, int k) const { return std::size_t(2 * (g * tokens + s) + k); }
};

// What one call saw, on this rank. `reduce` (in moe/layer.hpp) sums it over ranks.
struct gating_stats {
  std::vector<std::int64_t> expert_load;  // choices placed in each expert (first + second)
  std::int64_t tokens = 0;
  std::int64_t dropped_first = 0;   // first choices over capacity
  std::int64_t dropped_second = 0;  // second choices over capacity
  std::int64_t skipped_second = 0;  // second choices not taken by random routing
  std::int64_t invalid = 0;         // tokens whose router logits had NaN or Inf: routed nowhere
  double aux_sum = 0;               // Σ over groups of mean_E(density·density_proxy)·E²

  // Largest expert load over the balanced load (1.0 = perfectly balanced).
  double overload() const {
    std::int64_t total = 0, mx = 0;
    for (auto v : expert_load) {
      total += v;
      mx = std::max(mx, v);
    }
    return total == 0 ? 0.0 : double(mx) * double(expert_load.size()) / double(total);
  }
  double dropped_share() const {
    const std::int64_t placed = [&] {
      std::int64_t t = 0;
      for (auto v : expert_load) t += v;
      return t;
    }();
    const std::int64_t wanted = placed + dropped_first + dropped_second;
    return wanted == 0 ? 0.0 : double(dropped_first + dropped_second) / double(wanted);
  }
};

// Top-2 gating of `G` groups of `S` tokens over `E` experts. `logits` is
// [G, S, E] row-major; `stream` separates the random numbers of different
// layers and steps. Gating runs in T when T is at least float.
template <class T>
gating_stats top2_gating(const T* logits, index_t G, index_t S, index_t E, index_t group_offset, std::uint64_t stream,
                         const gating_config& cfg, routing<T>& r) {
  static_assert(std::is_floating_point_v<T> && sizeof(T) >= 4, "gshard::moe::top2_gating: gating runs in float or double");
  const index_t C = capacity(S, E, cfg);
  r.groups = G, r.tokens = S, r.experts = E, r.capacity = C, r.group_offset = group_offset;
  r.expert.assign(std::size_t(2 * G * S), -1);
  r.slot.assign(std::size_t(2 * G * S), -1);
  r.weight.assign(std::size_t(2 * G * S), T(0));
  r.gates.assign(std::size_t(G * S * E), T(0));
  r.wanted.assign(std::size_t(2 * G * S), -1);
  gating_stats st;
  st.expert_load.assign(std::size_t(E), 0);
  st.tokens = G * S;

  std::vector<index_t> count(static_cast<std::size_t>(E));
  std::vector<double> density(static_cast<std::size_t>(E)), proxy(static_cast<std::size_t>(E));
  for (index_t g = 0; g < G; ++g) {
    std::fill(density.begin(), density.end(), 0.0);
    std::fill(proxy.begin(), proxy.end(), 0.0);
    // 1-4: softmax, top-1, top-2, normalisation.
    for (index_t s = 0; s < S; ++s) {
      const T* l = logits + (g * S + s) * E;
      T* gates = r.gates.data() + (g * S + s) * E;
      bool finite = true;
      for (index_t e = 0; e < E; ++e) finite = finite && std::isfinite(l[e]);
      if (!finite) {  // routed nowhere; passes through on the residual
        ++st.invalid;
        continue;
      }
      T mx = l[0];
      for (index_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
      T sum = 0;
      for (index_t e = 0; e < E; ++e) sum += (gates[e] = std::exp(l[e] - mx));
      for (index_t e = 0; e < E; ++e) gates[e] /= sum;
      index_t e1 = 0;
      for (index_t e = 1; e < E; ++e)
        if (gates[e] > gates[e1]) e1 = e;
      index_t e2 = -1;
      for (index_t e = 0; e < E; ++e)
        if (e != e1 && (e2 < 0 || gates[e] > gates[e2])) e2 = e;
      const T g1 = gates[e1], g2 = e2 >= 0 ? gates[e2] : T(0);
      const T denom = g1 + g2 + T(1e-9);
      const std::size_t c0 = r.choice(g, s, 0);
      r.expert[c0] = r.wanted[c0] = std::int32_t(e1);
      r.weight[c0] = g1 / denom;
      if (e2 >= 0) r.wanted[c0 + 1] = std::int32_t(e2);
      if (e2 >= 0 && g2 > T(0)) {
        r.expert[c0 + 1] = std::int32_t(e2);
        r.weight[c0 + 1] = g2 / denom;
      }
      // 5: the aux loss's ingredients, before capacity.
      density[std::size_t(e1)] += 1.0;
      for (index_t e = 0; e < E; ++e) proxy[std::size_t(e)] += double(gates[e]);
    }
    double aux = 0;
    for (index_t e = 0; e < E; ++e) aux += (density[std::size_t(e)] / double(S)) * (proxy[std::size_t(e)] / double(S));
    st.aux_sum += S > 0 ? aux * double(E * E) / double(E) : 0.0;

    // 6: first choices take slots in token order; over capacity they drop.
    std::fill(count.begin(), count.end(), 0);
    for (index_t s = 0; s < S; ++s) {
      const std::size_t c = r.choice(g, s, 0);
      const int e = r.expert[c];
      if (e < 0) continue;
      if (count[std::size_t(e)] < C) {
        r.slot[c] = std::int32_t(count[std::size_t(e)]++);
        ++st.expert_load[std::size_t(e)];
      } else {
        r.expert[c] = -1;
        r.weight[c] = T(0);
        ++st.dropped_first;
      }
    }
    // 7-8: second choices, randomly kept, then placed after every first choice.
    for (index_t s = 0; s < S; ++s) {
      const std::size_t c = r.choice(g, s, 1);
      const int e = r.expert[c];
      if (e < 0) continue;
      const bool keep = cfg.second == second_policy::all ||
                        uniform(cfg.seed, stream, std::uint64_t(group_offset + g), std::uint64_t(s)) <
                            double(r.weight[c]) / cfg.threshold;
      if (!keep) {
        r.expert[c] = -1;
        r.weight[c] = T(0);
        ++st.skipped_second;
      } else if (count[std::size_t(e)] < C) {
        r.slot[c] = std::int32_t(count[std::size_t(e)]++);
        ++st.expert_load[std::size_t(e)];
      } else {
        r.expert[c] = -1;
        r.weight[c] = T(0);
        ++st.dropped_second;
      }
    }
  }
  return st;
}

}  // namespace legacy::moe
