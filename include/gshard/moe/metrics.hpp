// gshard/moe/metrics.hpp — what an MoE layer's routing did, in the forms a
// user watches: a JSON object (one per layer in a metrics log), trace
// counters (gshard/trace.hpp) and one short line. The numbers are those of
// gating_stats (gshard/moe/gating.hpp), summed over every group of the
// mesh, so they are the same on every rank. No MPI.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include "gshard/moe/gating.hpp"
#include "gshard/trace.hpp"

namespace gshard::moe {

namespace detail {
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

// {"tokens":..,"capacity":..,"load":[per expert],"demand":[per expert],
//  "max_over_mean":..,"dead_experts":..,"dropped":[per choice],
//  "skipped":[per choice],"dropped_share":..,"invalid":..} — "load" counts
// the choices placed in each expert, "demand" those that chose it before
// capacity, "dropped" those over capacity, "skipped" the later choices
// random routing did not keep; "max_over_mean" is overload() (of the demand).
inline std::string to_json(const gating_stats& s) {
  using detail::json_array, detail::json_number;
  return "{\"tokens\":" + std::to_string(s.tokens) + ",\"capacity\":" + std::to_string(s.capacity) +
         ",\"load\":" + json_array(s.expert_load) + ",\"demand\":" + json_array(s.expert_demand) +
         ",\"max_over_mean\":" + json_number(s.overload()) + ",\"dead_experts\":" + std::to_string(s.dead_experts()) +
         ",\"dropped\":" + json_array(s.dropped) + ",\"skipped\":" + json_array(s.skipped) +
         ",\"dropped_share\":" + json_number(s.dropped_share()) + ",\"invalid\":" + std::to_string(s.invalid) + "}";
}

// Two counter tracks in the trace: `name` + " load" (choices per expert) and
// `name` + " routing" (drops per choice, skips, invalid tokens, dead
// experts, max/mean demand). Nothing when tracing is off.
inline void trace_counters(const std::string& name, const gating_stats& s) {
  if (!trace::enabled()) return;
  std::vector<std::pair<std::string, double>> load, routing;
  for (std::size_t e = 0; e < s.expert_load.size(); ++e) load.emplace_back("expert " + std::to_string(e), double(s.expert_load[e]));
  for (std::size_t j = 0; j < s.dropped.size(); ++j) routing.emplace_back("dropped " + std::to_string(j + 1), double(s.dropped[j]));
  for (std::size_t j = 1; j < s.skipped.size(); ++j) routing.emplace_back("skipped " + std::to_string(j + 1), double(s.skipped[j]));
  routing.emplace_back("invalid", double(s.invalid));
  routing.emplace_back("dead experts", double(s.dead_experts()));
  routing.emplace_back("max/mean demand", s.overload());
  trace::counter(name + " load", "moe", load);
  trace::counter(name + " routing", "moe", routing);
}

}  // namespace gshard::moe
