// gshard/core/counters.hpp — every collective gshard runs is counted here, by kind,
// by mesh axes and by bytes, so tests, benchmarks and traces can see exactly
// what ran; and the einsums' model FLOPs. Totals are always kept; an ordered
// log is kept while a collective_recorder is alive, and one of the local
// GEMMs while a gemm_recorder is. Knows nothing of MPI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gshard {

// scatter and gather move whole tensors to or from one root (distribution
// and collection, not part of any plan); barrier only synchronises (timing,
// the trace's clock alignment) and moves no data.
enum class collective : std::uint8_t { all_reduce, all_gather, reduce_scatter, all_to_all, permute, broadcast, scatter, gather, barrier };

inline constexpr std::string_view name_of(collective k) {
  switch (k) {
    case collective::all_reduce: return "all_reduce";
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_to_all: return "all_to_all";
    case collective::permute: return "permute";
    case collective::broadcast: return "broadcast";
    case collective::scatter: return "scatter";
    case collective::gather: return "gather";
    case collective::barrier: return "barrier";
  }
  return "?";
}

// One collective as this rank saw it. `axes` names the mesh axes it ran over
// ("data", or "data,expert" for several); `bytes` is the size of this rank's
// input buffer (what it contributes), the same measure the plans print.
struct collective_event {
  collective kind;
  std::string axes;
  std::size_t bytes;

  // What ran, not how long it took: events compare by kind, axes and bytes.
  friend bool operator==(const collective_event& a, const collective_event& b) {
    return a.kind == b.kind && a.axes == b.axes && a.bytes == b.bytes;
  }
  double seconds = 0;  // wall time of the MPI call(s) on this rank; a non-blocking one's posting only (its
                       // tests and wait are added to the totals: add_collective_seconds)
};

inline std::string to_string(const collective_event& e) {
  return std::string(name_of(e.kind)) + "(" + e.axes + ", " + std::to_string(e.bytes) + " B)";
}

struct collective_total {
  collective kind;
  std::string axes;
  std::size_t calls = 0;
  std::size_t bytes = 0;
  double seconds = 0;
};

namespace detail {
// An ordered log of events, kept while at least one recorder of it lives
// (collective_recorder, gemm_recorder).
template <class Event>
struct event_log {
  std::vector<Event> log;
  int recorders = 0;
  void add(Event e) {
    if (recorders > 0) log.push_back(std::move(e));
  }
};

// A recorder's window onto the log Log() returns: the events added from
// its construction (or reset()) on; the log is emptied when the last
// recorder of it ends.
template <class Event, event_log<Event>& (*Log)()>
class log_window {
 public:
  log_window() : start_(Log().log.size()) { ++Log().recorders; }
  log_window(const log_window&) = delete;
  log_window& operator=(const log_window&) = delete;
  ~log_window() {
    auto& l = Log();
    if (--l.recorders == 0) l.log.clear();
  }
  std::vector<Event> recorded() const {
    const auto& log = Log().log;
    return {log.begin() + std::ptrdiff_t(start_), log.end()};
  }
  void reset() { start_ = Log().log.size(); }

 private:
  std::size_t start_;
};

struct counter_state {
  std::vector<collective_total> totals;
  event_log<collective_event> events;
};
inline counter_state& counters() {
  static counter_state s;
  return s;
}
inline event_log<collective_event>& collective_log() { return counters().events; }
// How many counted collectives are running on this thread (0 or 1; more
// while the checked mode compares one). Every MPI communication call gshard
// makes is made while this is positive: test_training proves it by
// intercepting MPI through its profiling interface.
inline int& counted_depth() {
  thread_local int depth = 0;
  return depth;
}
// While one lives, this thread is inside a counted collective.
struct counted_scope {
  counted_scope() { ++counted_depth(); }
  ~counted_scope() { --counted_depth(); }
  counted_scope(const counted_scope&) = delete;
  counted_scope& operator=(const counted_scope&) = delete;
};
}  // namespace detail

// True while a counted collective runs on this thread.
inline bool inside_counted_collective() { return detail::counted_depth() > 0; }

// Called by the collectives layer once per collective it issues.
inline void count_collective(collective kind, std::string_view axes, std::size_t bytes, double seconds = 0) {
  auto& s = detail::counters();
  bool found = false;
  for (auto& t : s.totals)
    if (t.kind == kind && t.axes == axes) {
      ++t.calls;
      t.bytes += bytes;
      t.seconds += seconds;
      found = true;
      break;
    }
  if (!found) s.totals.push_back({kind, std::string(axes), 1, bytes, seconds});
  s.events.add({kind, std::string(axes), bytes, seconds});
}

// Wall time of a collective's later MPI calls — a non-blocking one's tests
// and wait (gshard/runtime/nonblocking.hpp) — added to its kind's total (counted
// when it started).
inline void add_collective_seconds(collective kind, std::string_view axes, double seconds) {
  for (auto& t : detail::counters().totals)
    if (t.kind == kind && t.axes == axes) {
      t.seconds += seconds;
      return;
    }
}

// Seconds spent in collectives of one kind since the start (every axis set).
inline double collective_seconds(collective kind) {
  double t = 0;
  for (const auto& c : detail::counters().totals)
    if (c.kind == kind) t += c.seconds;
  return t;
}

// Model FLOPs: every einsum adds, on each of its mesh's P ranks, its FLOPs
// over the global extents divided by P — so the sum over the ranks counts an
// einsum's work once however it is split or repeated (the convention of
// model FLOPs utilisation), and a rank's count times P is the whole job's.
// Since the start of the program; a step's is the difference around it.
// A forward recomputed in the backward (rematerialisation, ad/remat.hpp)
// is work the hardware does again, not the model's: its FLOPs go to
// recomputed_flops() instead.
namespace detail {
struct flop_totals {
  double model = 0, recomputed = 0;
  int recompute_depth = 0;
};
inline flop_totals& flops() {
  static flop_totals f;
  return f;
}
// While one lives, einsums' FLOPs count as recomputed.
struct recomputing_flops {
  recomputing_flops() { ++flops().recompute_depth; }
  ~recomputing_flops() { --flops().recompute_depth; }
  recomputing_flops(const recomputing_flops&) = delete;
  recomputing_flops& operator=(const recomputing_flops&) = delete;
};
}  // namespace detail
inline double model_flops() { return detail::flops().model; }
inline double recomputed_flops() { return detail::flops().recomputed; }
inline void add_model_flops(double f) {
  auto& t = detail::flops();
  (t.recompute_depth > 0 ? t.recomputed : t.model) += f;
}

// Totals since the start of the program, per (kind, axes).
inline const std::vector<collective_total>& collective_totals() { return detail::counters().totals; }

// Records the collectives issued during its lifetime, in order:
//   gshard::collective_recorder rec;
//   auto y = reshard<target>(x);
//   assert(rec.events().size() == 1 && rec.events()[0].kind == collective::all_gather);
class collective_recorder : public detail::log_window<collective_event, &detail::collective_log> {
 public:
  std::vector<collective_event> events() const { return recorded(); }
  std::size_t calls(collective kind, std::string_view axes = {}) const {
    std::size_t n = 0;
    for (const auto& e : events())
      if (e.kind == kind && (axes.empty() || e.axes == axes)) ++n;
    return n;
  }
  std::size_t bytes(collective kind, std::string_view axes = {}) const {
    std::size_t n = 0;
    for (const auto& e : events())
      if (e.kind == kind && (axes.empty() || e.axes == axes)) n += e.bytes;
    return n;
  }
  // How many of each ran: {"all_to_all(expert)": 4, "all_reduce(model)": 8, ...}.
  std::map<std::string, int> tally() const {
    std::map<std::string, int> t;
    for (const auto& e : events()) ++t[std::string(name_of(e.kind)) + "(" + e.axes + ")"];
    return t;
  }
};

// One local GEMM as gshard ran it (kernels/gemm.hpp): row-major
// C (m×n) = op(A) (m×k) · op(B) (k×n) + β·C with leading dimensions lda,
// ldb, ldc (for a GEMM rounded under matmul_precision::bf16, those of the
// packed bf16 copies); accumulate: β ≠ 0 (gshard's callers pass 1). Every
// einsum's GEMMs and causal_attention's blocks go through that one function.
struct gemm_call {
  int element_bytes;  // of the operands multiplied: 2 bf16 (matmul_precision::bf16 too), 4 float, 8 double
  bool trans_a, trans_b, accumulate;
  std::int64_t m, n, k, lda, ldb, ldc;
  double flops() const { return 2.0 * double(m) * double(n) * double(k); }
};

namespace detail {
inline event_log<gemm_call>& gemm_log() {
  static event_log<gemm_call> s;
  return s;
}
}  // namespace detail

// Records the local GEMMs run during its lifetime, in order: what a step
// asks of the BLAS, to replay them alone (bench_train step_gemms: the
// step's time against its GEMMs' own).
//   gshard::gemm_recorder rec;
//   auto y = einsum<"BLM,MH->BLH">(x, w);
//   assert(rec.calls().size() == 1 && rec.calls()[0].k == M);
class gemm_recorder : public detail::log_window<gemm_call, &detail::gemm_log> {
 public:
  std::vector<gemm_call> calls() const { return recorded(); }
  double flops() const {
    double f = 0;
    for (const auto& c : calls()) f += c.flops();
    return f;
  }
};

}  // namespace gshard
