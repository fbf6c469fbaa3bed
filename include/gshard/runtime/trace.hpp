// gshard/runtime/trace.hpp — a timeline of what ran, in the Chrome trace-event JSON
// format (open it in https://ui.perfetto.dev or chrome://tracing): one track
// per rank, a span for each local einsum (spec, FLOPs) and each collective
// (kind, axes, bytes), and the user's own spans (a layer, a step). Off by
// default; when off, each hook is one test of a global flag.
//   GSHARD_TRACE=run.json mpirun ...     (written when mpi::environment ends)
//   trace::start("run.json"); ... trace::stop();   (both collective: trace_file.hpp)
//   { trace::span s("train step 3"); ... }
// This header records; trace_file.hpp starts a trace over the ranks (clock
// alignment) and writes it, through the counted collectives.
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
  int track = 0;                // trace::track
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

// A rank's tracks: what it runs (spans nest), and the non-blocking
// collectives in flight meanwhile (gshard/runtime/nonblocking.hpp; they overlap the
// first track's spans, so they get their own).
enum class track : int { rank = 0, in_flight = 1 };

inline bool enabled() { return detail::st().on; }
inline double now() { return MPI_Wtime() + detail::st().offset; }

// Records a finished span (seconds on the aligned clock).
inline void add(std::string_view name, std::string_view cat, double begin, double end, std::string args = {},
                track on = track::rank) {
  if (!enabled()) return;
  detail::st().records.push_back({std::string(name), std::string(cat), std::move(args), begin, end, 'X', int(on)});
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

}  // namespace gshard::trace
