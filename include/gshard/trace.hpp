// gshard/trace.hpp — a timeline of what ran, in the Chrome trace-event JSON
// format (open it in https://ui.perfetto.dev or chrome://tracing): one track
// per rank, a span for each local einsum (spec, FLOPs) and each collective
// (kind, axes, bytes), and the user's own spans (a layer, a step). Off by
// default; when off, each hook is one test of a global flag.
//   GSHARD_TRACE=run.json mpirun ...     (written when mpi::environment ends)
//   trace::start("run.json"); ... trace::stop();   (both collective)
//   { trace::span s("train step 3"); ... }
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gshard::trace {

namespace detail {
struct record {
  std::string name, cat, args;  // args: the inside of a JSON object, or ""
  double begin, end;            // seconds on rank 0's clock
  char phase = 'X';             // 'X': a span; 'C': counters (args: their values, at `begin`)
};
struct state {
  bool on = false;
  std::string path;
  double offset = 0;  // add to MPI_Wtime() to get rank 0's clock
  std::vector<record> records;
};
inline state& st() {
  static state s;
  return s;
}
// JSON string contents: quotes and backslashes escaped, control characters
// dropped, bytes outside ASCII replaced by '?' (names need not be UTF-8).
inline std::string escape(std::string_view v) {
  std::string out;
  for (char c : v) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20) continue;
    if (u >= 0x80) {
      out += '?';
      continue;
    }
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}
}  // namespace detail

inline bool enabled() { return detail::st().on; }
inline double now() { return MPI_Wtime() + detail::st().offset; }

// Records a finished span (seconds on the aligned clock).
inline void add(std::string_view name, std::string_view cat, double begin, double end, std::string args = {}) {
  if (!enabled()) return;
  detail::st().records.push_back({std::string(name), std::string(cat), std::move(args), begin, end});
}

// Records counters at this moment: values the trace viewer draws as a
// track of their own, e.g. counter("block1.moe load", {{"expert 0", 96}, ...}).
inline void counter(std::string_view name, std::string_view cat,
                    const std::vector<std::pair<std::string, double>>& values) {
  if (!enabled()) return;
  std::string args;
  for (const auto& [k, v] : values) {
    char num[40];
    std::snprintf(num, sizeof num, "%.17g", std::isfinite(v) ? v : 0.0);
    args += (args.empty() ? "\"" : ",\"") + detail::escape(k) + "\":" + num;
  }
  const double t = now();
  detail::st().records.push_back({std::string(name), std::string(cat), std::move(args), t, t, 'C'});
}

// A span for the lifetime of the object: trace::span s("MoE layer 1").
class span {
 public:
  explicit span(std::string_view name, std::string_view cat = "user") {
    if (!enabled()) return;
    name_ = name;
    cat_ = cat;
    begin_ = now();
  }
  span(const span&) = delete;
  span& operator=(const span&) = delete;
  ~span() {
    if (begin_ >= 0 && enabled()) add(name_, cat_, begin_, now());
  }

 private:
  std::string name_, cat_;
  double begin_ = -1;
};

// Starts recording on every rank of `comm` (collective). The clocks are
// aligned to rank 0's: each rank takes the smallest offset seen over a few
// barrier rounds.
inline void start(const std::string& path, MPI_Comm comm = MPI_COMM_WORLD) {
  auto& s = detail::st();
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  double best = 1e300, offset = 0;
  for (int round = 0; round < 5; ++round) {
    MPI_Barrier(comm);
    const double mine = MPI_Wtime();
    double root = mine;
    MPI_Bcast(&root, 1, MPI_DOUBLE, 0, comm);
    const double after = MPI_Wtime();
    if (after - mine < best) {  // the round with the least delay
      best = after - mine;
      offset = root - mine;
    }
  }
  s.offset = rank == 0 ? 0.0 : offset;
  s.path = path;
  s.records.clear();
  s.on = true;
}

// Stops recording and writes the file on rank 0 (collective). Returns the
// number of events (spans and counters) written (on rank 0; 0 elsewhere).
inline std::size_t stop(MPI_Comm comm = MPI_COMM_WORLD) {
  auto& s = detail::st();
  s.on = false;
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::string mine;
  for (const auto& r : s.records) {
    char head[160];
    if (r.phase == 'C')
      std::snprintf(head, sizeof head, "{\"ph\":\"C\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,", rank, r.begin * 1e6);
    else
      std::snprintf(head, sizeof head, "{\"ph\":\"X\",\"pid\":%d,\"tid\":0,\"ts\":%.3f,\"dur\":%.3f,", rank,
                    r.begin * 1e6, (r.end - r.begin) * 1e6);
    mine += head;
    mine += "\"name\":\"" + detail::escape(r.name) + "\",\"cat\":\"" + detail::escape(r.cat) + "\"";
    if (!r.args.empty()) mine += ",\"args\":{" + r.args + "}";
    mine += "},\n";
  }
  const std::size_t count = s.records.size();
  s.records.clear();
  int len = int(mine.size());
  std::vector<int> lens(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm);
  std::string all;
  if (rank == 0) {
    int total = 0;
    for (int r = 0; r < size; ++r) {
      displs[std::size_t(r)] = total;
      total += lens[std::size_t(r)];
    }
    all.resize(std::size_t(total));
  }
  MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, comm);
  std::size_t written = 0;
  unsigned long long counts[1] = {count};
  MPI_Reduce(rank == 0 ? MPI_IN_PLACE : counts, counts, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, 0, comm);
  if (rank == 0) {
    std::string json = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
    for (int r = 0; r < size; ++r) {
      char meta[120];
      std::snprintf(meta, sizeof meta, "{\"ph\":\"M\",\"pid\":%d,\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}},\n", r, r);
      json += meta;
    }
    json += all;
    if (json.size() >= 2 && json[json.size() - 2] == ',') json.erase(json.size() - 2, 1);
    json += "]}\n";
    if (std::FILE* f = std::fopen(s.path.c_str(), "wb")) {
      std::fwrite(json.data(), 1, json.size(), f);
      std::fclose(f);
      written = counts[0];
    } else {
      std::fprintf(stderr, "gshard::trace: cannot write %s\n", s.path.c_str());
    }
  }
  return written;
}

}  // namespace gshard::trace
