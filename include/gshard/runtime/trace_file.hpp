// gshard/runtime/trace_file.hpp — starting a trace on every rank (the clocks aligned
// to rank 0's) and writing it to one file. Both are collective over a group
// (every rank of a mesh, or the world), and run through the counted
// collectives like every other MPI communication gshard makes.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "gshard/runtime/collectives.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/io.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard::trace {

// Starts recording on every rank of `g` (collective). Each rank takes the
// offset to rank 0's clock from the round of five with the least delay.
inline void start(const std::string& path, const gshard::detail::axis_group& g) {
  auto& s = detail::st();
  double best = 1e300, offset = 0;
  for (int round = 0; round < 5; ++round) {
    barrier(g);
    const double mine = MPI_Wtime();
    double root = mine;
    broadcast(g, std::span<double>(&root, 1), 0);
    const double after = MPI_Wtime();
    if (after - mine < best) {  // the round with the least delay
      best = after - mine;
      offset = root - mine;
    }
  }
  s.offset = g.rank == 0 ? 0.0 : offset;
  s.path = path;
  s.records.clear();
  s.on = true;
}
inline void start(const std::string& path, const gshard::detail::mesh_base& m) { start(path, m.all_axes()); }
inline void start(const std::string& path) { start(path, world_group()); }

// Stops recording and writes the file on rank 0 (collective). Returns the
// number of events (spans and counters) written, on every rank. A file that
// cannot be written completely throws gshard::io_error on every rank, with
// the path and the reason; an existing file at the path is left as it was.
inline std::size_t stop(const gshard::detail::axis_group& g) {
  auto& s = detail::st();
  s.on = false;
  // Collectives in flight overlap each other: each goes on the first of
  // this rank's "in flight" tracks (tid 1, 2, ...) free at its start, so
  // the spans of one track never overlap (the viewers draw them nested).
  std::vector<std::size_t> flying;
  for (std::size_t i = 0; i < s.records.size(); ++i)
    if (s.records[i].track == int(track::in_flight)) flying.push_back(i);
  std::sort(flying.begin(), flying.end(), [&](std::size_t a, std::size_t b) { return s.records[a].begin < s.records[b].begin; });
  std::vector<double> lane_end;  // when each in-flight track is free again
  for (std::size_t i : flying) {
    auto& r = s.records[i];
    std::size_t lane = 0;
    while (lane < lane_end.size() && lane_end[lane] > r.begin) ++lane;
    if (lane == lane_end.size()) lane_end.push_back(0);
    lane_end[lane] = r.end;
    r.track = int(track::in_flight) + int(lane);
  }
  std::string mine;
  for (std::size_t t = 0; t <= lane_end.size(); ++t) {  // the tracks' names: what runs, then the collectives in flight
    char meta[160];
    std::snprintf(meta, sizeof meta, "{\"ph\":\"M\",\"pid\":%d,\"tid\":%zu,\"name\":\"thread_name\",\"args\":{\"name\":\"%s\"}},\n",
                  g.rank, t, t == 0 ? "runs" : "collectives in flight");
    mine += meta;
  }
  for (const auto& r : s.records) {
    char head[160];
    if (r.phase == 'C')
      std::snprintf(head, sizeof head, "{\"ph\":\"C\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,", g.rank, r.begin * 1e6);
    else
      std::snprintf(head, sizeof head, "{\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,", g.rank,
                    r.track, r.begin * 1e6, (r.end - r.begin) * 1e6);
    mine += head;
    mine += "\"name\":\"" + detail::escape(r.name) + "\",\"cat\":\"" + detail::escape(r.cat) + "\"";
    if (!r.args.empty()) mine += ",\"args\":{" + r.args + "}";
    mine += "},\n";
  }
  const std::size_t events = std::size_t(all_reduce(g, std::int64_t(s.records.size()), reduction::sum));
  s.records.clear();
  const std::string all = gather_text(g, mine, 0);
  std::string problem;
  const debug::awaiting_io io("rank 0's write of " + s.path);
  if (g.rank == 0) {
    std::string json = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    for (int r = 0; r < g.size; ++r) {
      char meta[120];
      std::snprintf(meta, sizeof meta, "{\"ph\":\"M\",\"pid\":%d,\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}},\n", r, r);
      json += meta;
    }
    json += all;
    if (json.size() >= 2 && json[json.size() - 2] == ',') json.erase(json.size() - 2, 1);
    json += "]}\n";
    problem = io::write_file(s.path, json);
  }
  if (const std::string p = broadcast_text(g, problem); !p.empty()) throw io_error("gshard::trace: " + p);
  return events;
}
inline std::size_t stop(const gshard::detail::mesh_base& m) { return stop(m.all_axes()); }
inline std::size_t stop() { return stop(world_group()); }

}  // namespace gshard::trace
