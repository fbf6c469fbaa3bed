// gshard/trace_file.hpp — starting a trace on every rank (the clocks aligned
// to rank 0's) and writing it to one file. Both are collective over a group
// (every rank of a mesh, or the world), and run through the counted
// collectives like every other MPI communication gshard makes.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "gshard/collectives.hpp"
#include "gshard/error.hpp"
#include "gshard/io.hpp"
#include "gshard/mesh.hpp"
#include "gshard/trace.hpp"

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
  std::string mine;
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
  if (g.rank == 0) {
    std::string json = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    for (int r = 0; r < g.size; ++r) {
      char meta[320];
      std::snprintf(meta, sizeof meta,
                    "{\"ph\":\"M\",\"pid\":%d,\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}},\n"
                    "{\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"name\":\"thread_name\",\"args\":{\"name\":\"runs\"}},\n"
                    "{\"ph\":\"M\",\"pid\":%d,\"tid\":1,\"name\":\"thread_name\",\"args\":{\"name\":\"collectives in flight\"}},\n",
                    r, r, r, r);
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
