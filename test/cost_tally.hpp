// test/cost_tally.hpp — a step's collectives as the counters recorded them
// and as the cost model counts them, in one form to compare: calls and
// bytes per "kind(axes)", the axes named as the mesh names them.
#pragma once

#include <gshard/core/counters.hpp>
#include <gshard/model/cost.hpp>

#include <cstddef>
#include <map>
#include <string>
#include <utility>

namespace gshard::testing {

using collective_tally = std::map<std::string, std::pair<int, std::size_t>>;

inline collective_tally tally(const collective_recorder& rec) {
  collective_tally t;
  for (const auto& e : rec.events()) {
    auto& s = t[std::string(name_of(e.kind)) + "(" + e.axes + ")"];
    ++s.first;
    s.second += e.bytes;
  }
  return t;
}

template <class Mesh>
collective_tally tally(const model::cost::step_work& w, const Mesh& m, const model::cost::mesh_sizes& ms) {
  collective_tally t;
  for (const auto& x : w.collectives) {
    std::string axes;
    for (int a = 0; a < ms.naxes(); ++a)
      if ((x.axes >> a) & 1u) axes += (axes.empty() ? "" : ",") + std::string(m.names[std::size_t(a)].view());
    auto& to = t[std::string(name_of(x.kind)) + "(" + axes + ")"];
    to.first += x.calls, to.second += std::size_t(x.bytes);
  }
  return t;
}

inline std::string text(const collective_tally& s) {
  std::string t;
  for (const auto& [k, v] : s) t += k + " x" + std::to_string(v.first) + " " + std::to_string(v.second) + " B; ";
  return t;
}

// The cost model's mesh_sizes of a (data, expert[, model]) mesh, counting
// this rank.
template <class Mesh>
model::cost::mesh_sizes cost_mesh(const Mesh& m) {
  const bool three = m.naxes() == 3;
  return {m.size(0), m.size(1), three ? m.size(2) : 1, three, {m.coord(0), m.coord(1), three ? m.coord(2) : 0}};
}

// "" when the parameters declare the weights the cost model lists (names,
// extents, this rank's bytes), else the first difference.
template <class Params>
std::string weight_difference(Params& ps, const std::vector<model::cost::weight>& ws, const model::cost::mesh_sizes& ms,
                              std::size_t element_bytes) {
  if (ws.size() != ps.size()) return "counted " + std::to_string(ws.size()) + " weights, declared " + std::to_string(ps.size());
  for (std::size_t i = 0; i < ws.size(); ++i)
    if (ws[i].name != ps.name(i) || ws[i].extents != ps.values()[i].extents() ||
        double(ps.values()[i].local_bytes()) != double(model::cost::local_elements(ws[i].layout, ws[i].extents, ms)) * double(element_bytes))
      return "weight " + std::to_string(i) + ": declared " + ps.name(i) + " " + ps.values()[i].notation() + ", counted " + ws[i].name;
  return "";
}

}  // namespace gshard::testing
