// gshard/moe/stats.hpp — what an MoE layer's routing did (gating_stats), in
// every form it takes: the counters, one vector for the all_reduce that sums
// them over the groups, a JSON object (one per layer in a metrics log) and
// trace counters (gshard/runtime/trace.hpp). Summed over every group of the mesh,
// the numbers are the same on every rank.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "gshard/core/types.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard::moe {

// What one call saw: on this rank from route_tokens, summed over every group
// by moe::gate (gshard/moe/gate.hpp).
struct gating_stats {
  std::vector<std::int64_t> expert_load;    // choices placed in each expert (at most C per group)
  std::vector<std::int64_t> expert_demand;  // choices that chose each expert, before capacity (placed + dropped)
  std::int64_t tokens = 0;                  // the tokens routed: every position that is not padding
  std::int64_t padded = 0;                  // padded positions: routed nowhere, in no other counter
  std::vector<std::int64_t> dropped;      // per choice: over capacity
  std::vector<std::int64_t> skipped;      // per choice: not kept by random routing
  std::int64_t invalid = 0;               // tokens whose router logits had NaN or +Inf: routed nowhere
  double aux_sum = 0;                     // Σ over groups of mean_E(density·density_proxy)·E²
  double z_sum = 0;                       // Σ over tokens of logsumexp(logits)²
  index_t capacity = 0;                   // the C the groups were placed with

  // Adds another call's counters (e.g. of the next batch); the capacity kept is the larger.
  gating_stats& operator+=(const gating_stats& o) {
    const auto add = [](std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b) {
      if (a.size() < b.size()) a.resize(b.size(), 0);
      for (std::size_t i = 0; i < b.size(); ++i) a[i] += b[i];
    };
    add(expert_load, o.expert_load), add(expert_demand, o.expert_demand), add(dropped, o.dropped), add(skipped, o.skipped);
    tokens += o.tokens, padded += o.padded, invalid += o.invalid, aux_sum += o.aux_sum, z_sum += o.z_sum;
    capacity = std::max(capacity, o.capacity);
    return *this;
  }

  std::int64_t placed() const {
    std::int64_t t = 0;
    for (auto v : expert_load) t += v;
    return t;
  }
  std::int64_t total_dropped() const {
    std::int64_t t = 0;
    for (auto v : dropped) t += v;
    return t;
  }
  std::int64_t dropped_at(std::size_t j) const { return j < dropped.size() ? dropped[j] : 0; }
  std::int64_t skipped_at(std::size_t j) const { return j < skipped.size() ? skipped[j] : 0; }
  // The largest expert demand over the mean demand (1.0 = perfectly
  // balanced): before capacity, so a capacity that clips the busiest expert
  // does not hide the imbalance.
  double max_over_mean() const {
    std::int64_t total = 0, mx = 0;
    for (auto v : expert_demand) total += v, mx = std::max(mx, v);
    return total == 0 ? 0.0 : double(mx) * double(expert_demand.size()) / double(total);
  }
  double dropped_share() const {
    const std::int64_t wanted = placed() + total_dropped();
    return wanted == 0 ? 0.0 : double(total_dropped()) / double(wanted);
  }
  // Experts that received no token.
  int dead_experts() const {
    int n = 0;
    for (auto v : expert_load) n += v == 0 ? 1 : 0;
    return n;
  }
};

namespace detail {
// The gating counters, the aux loss and the z-loss as one vector (2E + 5 + 2k
// doubles), for one all_reduce.
inline std::vector<double> stats_vector(const gating_stats& s) {
  std::vector<double> v(s.expert_load.begin(), s.expert_load.end());
  v.insert(v.end(), s.expert_demand.begin(), s.expert_demand.end());
  v.push_back(double(s.tokens));
  v.insert(v.end(), s.dropped.begin(), s.dropped.end());
  v.insert(v.end(), s.skipped.begin(), s.skipped.end());
  v.insert(v.end(), {double(s.invalid), s.aux_sum, s.z_sum, double(s.padded)});
  return v;
}
inline gating_stats stats_from(const double* v, std::size_t E, std::size_t k, index_t capacity) {
  gating_stats r;
  for (std::size_t e = 0; e < E; ++e) r.expert_load.push_back(std::int64_t(v[e]));
  for (std::size_t e = 0; e < E; ++e) r.expert_demand.push_back(std::int64_t(v[E + e]));
  v += 2 * E;
  r.tokens = std::int64_t(v[0]);
  for (std::size_t j = 0; j < k; ++j) r.dropped.push_back(std::int64_t(v[1 + j]));
  for (std::size_t j = 0; j < k; ++j) r.skipped.push_back(std::int64_t(v[1 + k + j]));
  r.invalid = std::int64_t(v[1 + 2 * k]), r.aux_sum = v[2 + 2 * k], r.z_sum = v[3 + 2 * k];
  r.padded = std::int64_t(v[4 + 2 * k]);
  r.capacity = capacity;
  return r;
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";  // JSON has no NaN or Inf
  char b[40];
  std::snprintf(b, sizeof b, "%.10g", v);
  return b;
}
// Counts exactly, as integers.
inline std::string json_array(const std::vector<std::int64_t>& values) {
  std::string s = "[";
  for (std::size_t i = 0; i < values.size(); ++i) s += (i ? "," : "") + std::to_string(values[i]);
  return s + "]";
}
}  // namespace detail

// {"tokens":..,"padded":..,"capacity":..,"load":[per expert],"demand":[per expert],
//  "max_over_mean":..,"dead_experts":..,"dropped":[per choice],
//  "skipped":[per choice],"dropped_share":..,"invalid":..} — "load" counts
// the choices placed in each expert, "demand" those that chose it before
// capacity, "dropped" those over capacity, "skipped" the later choices
// random routing did not keep; "max_over_mean" is max_over_mean() (of the
// demand); "tokens" counts the routed positions, "padded" the others.
inline std::string to_json(const gating_stats& s) {
  using detail::json_array, detail::json_number;
  return "{\"tokens\":" + std::to_string(s.tokens) + ",\"padded\":" + std::to_string(s.padded) + ",\"capacity\":" + std::to_string(s.capacity) +
         ",\"load\":" + json_array(s.expert_load) + ",\"demand\":" + json_array(s.expert_demand) +
         ",\"max_over_mean\":" + json_number(s.max_over_mean()) + ",\"dead_experts\":" + std::to_string(s.dead_experts()) +
         ",\"dropped\":" + json_array(s.dropped) + ",\"skipped\":" + json_array(s.skipped) +
         ",\"dropped_share\":" + json_number(s.dropped_share()) + ",\"invalid\":" + std::to_string(s.invalid) + "}";
}

// Two counter tracks in the trace: `name` + " load" (choices per expert) and
// `name` + " routing" (drops per choice, skips, invalid tokens, dead
// experts, padded positions, max/mean demand). Nothing when tracing is off.
inline void trace_counters(const std::string& name, const gating_stats& s) {
  if (!trace::enabled()) return;
  std::vector<std::pair<std::string, double>> load, routing;
  for (std::size_t e = 0; e < s.expert_load.size(); ++e) load.emplace_back("expert " + std::to_string(e), double(s.expert_load[e]));
  for (std::size_t j = 0; j < s.dropped.size(); ++j) routing.emplace_back("dropped " + std::to_string(j + 1), double(s.dropped[j]));
  for (std::size_t j = 1; j < s.skipped.size(); ++j) routing.emplace_back("skipped " + std::to_string(j + 1), double(s.skipped[j]));
  routing.emplace_back("invalid", double(s.invalid));
  routing.emplace_back("padded", double(s.padded));
  routing.emplace_back("dead experts", double(s.dead_experts()));
  routing.emplace_back("max/mean demand", s.max_over_mean());
  trace::counter(name + " load", "moe", load);
  trace::counter(name + " routing", "moe", routing);
}

}  // namespace gshard::moe
