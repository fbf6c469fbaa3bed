// gshard/runtime/debug.hpp — the checked mode and the watchdog.
// GSHARD_DEBUG=1: before every collective, the ranks of the mesh compare a
// fingerprint of what they are about to run (kind, axes, element type,
// element count, the mesh's sequence number); a difference ends the job with
// a message naming the field and which ranks hold which value, instead of a
// hang or silently mixed data. GSHARD_WATCHDOG=<seconds> (default 300 in the
// checked mode, off otherwise): a collective (or its check) that has not
// finished in that time is reported with rank, sequence number and call, and
// the job ends — unless it waits for another rank's file I/O (an awaiting_io
// scope: a checkpoint's write or read, a trace's write), which is said once
// and not timed. Both settings are rank 0's (core/options.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gshard/core/counters.hpp"
#include "gshard/core/fnv1a.hpp"
#include "gshard/core/options.hpp"
#include "gshard/runtime/mpi.hpp"

namespace gshard::debug {

// The element type as the ranks compare it: types.hpp's table (other types
// by their size, so two different ones still differ).
template <class T>
constexpr int type_code() {
  constexpr element e = element_of<T>();
  return e == element::other ? 100 + int(sizeof(T)) : int(e);
}
inline std::string type_name(std::int64_t code) {
  if (code >= int(element::f32) && code < int(element::other)) return std::string(name_of(element(code)));
  return "another type (" + std::to_string(code - 100) + " bytes)";
}

namespace detail {

// What the watchdog watches: the collective in progress on this rank. The
// main thread publishes it under a generation counter (odd while it writes),
// so the watchdog reads a consistent snapshot and times one collective, not
// a start time left over from the previous one.
struct watch_state {
  std::atomic<std::uint64_t> generation{0};
  std::atomic<bool> busy{false};
  std::atomic<double> since{0};
  std::atomic<std::uint64_t> seq{0};
  std::atomic<int> kind{0};
  std::atomic<std::size_t> bytes{0};
  std::atomic<char> axes[64] = {};
  // What a peer's file I/O in progress makes this rank wait for (""
  // outside an awaiting_io scope): the watchdog does not time it.
  std::atomic<char> io[96] = {};
};
inline watch_state& watched() {
  static watch_state w;
  return w;
}
inline double wall() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

class watchdog {
 public:
  // Started on the main thread: it learns the rank there (MPI is FUNNELED).
  explicit watchdog(double seconds) : limit_(seconds), rank_(mpi::world_rank()), thread_([this] { run(); }) {}
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  ~watchdog() {
    stop_ = true;
    thread_.join();
  }

 private:
  void run() {
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      auto& w = watched();
      const std::uint64_t g1 = w.generation.load();
      if (g1 % 2 == 1 || !w.busy.load()) continue;
      const double stuck = wall() - w.since.load();
      char axes[64], io[96];
      for (std::size_t i = 0; i < sizeof axes; ++i) axes[i] = w.axes[i].load(std::memory_order_relaxed);
      for (std::size_t i = 0; i < sizeof io; ++i) io[i] = w.io[i].load(std::memory_order_relaxed);
      axes[sizeof axes - 1] = io[sizeof io - 1] = '\0';
      const auto seq = w.seq.load();
      const int kind = w.kind.load();
      const std::size_t bytes = w.bytes.load();
      std::atomic_thread_fence(std::memory_order_acquire);  // the relaxed loads above before the check below
      if (w.generation.load() != g1 || stuck < limit_) continue;  // changed meanwhile, or not stuck yet
      if (io[0] != '\0') {  // waiting for a file to be read or written: slow disks are not stuck ranks
        if (seq != io_noted_)
          std::fprintf(stderr,
                       "gshard watchdog: rank %d: collective #%llu %s over {%s} has waited %.1f s for %s; file I/O is "
                       "not timed, the job goes on\n",
                       rank_, static_cast<unsigned long long>(seq), std::string(name_of(collective(kind))).c_str(), axes,
                       stuck, io);
        io_noted_ = seq;
        continue;
      }
      std::fprintf(stderr,
                   "gshard watchdog: rank %d: collective #%llu %s over {%s} (%zu B) has not finished after %.1f s: the "
                   "ranks disagree on what runs next, or a rank is gone; aborting the job\n",
                   rank_, static_cast<unsigned long long>(seq), std::string(name_of(collective(kind))).c_str(), axes, bytes,
                   stuck);
      mpi::flush_output_before_exit();
      std::_Exit(124);  // mpirun ends the other ranks; MPI itself is busy in the stuck call
    }
  }
  double limit_;
  int rank_;
  std::uint64_t io_noted_ = ~std::uint64_t(0);  // the collective whose wait for I/O was said
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

inline std::unique_ptr<watchdog>& the_watchdog() {
  static std::unique_ptr<watchdog> w;
  return w;
}

}  // namespace detail

inline bool checked() { return gshard::detail::options().debug != 0; }

// Starts the watchdog if the options ask for one (mpi::environment does).
inline void start_watchdog() {
  const double s = gshard::detail::options().watchdog_seconds;
  if (s > 0 && !detail::the_watchdog()) detail::the_watchdog() = std::make_unique<detail::watchdog>(s);
}
inline void stop_watchdog() { detail::the_watchdog().reset(); }

// Marks this rank as inside a collective until the object dies.
class watch {
 public:
  watch(collective kind, const std::string& axes, std::size_t bytes, std::uint64_t seq) {
    auto& w = detail::watched();
    w.generation.fetch_add(1);  // odd: writing
    w.kind = int(kind);
    w.bytes = bytes;
    w.seq = seq;
    for (std::size_t i = 0; i < std::size(w.axes); ++i)
      w.axes[i].store(i < axes.size() && i + 1 < std::size(w.axes) ? axes[i] : '\0', std::memory_order_relaxed);
    w.since = detail::wall();
    w.busy = true;
    w.generation.fetch_add(1);  // even: published
  }
  watch(const watch&) = delete;
  watch& operator=(const watch&) = delete;
  ~watch() {
    auto& w = detail::watched();
    w.generation.fetch_add(1);
    w.busy = false;
    w.generation.fetch_add(1);
  }
};

// Marks, on every rank, a stretch in which one rank reads or writes a file
// while the others wait for it in a collective (a checkpoint's save or load,
// a trace's write): the watchdog does not time those waits, however long the
// disk takes, and says once per collective that it is waiting. `what` names
// the I/O ("rank 0's write of x.ckpt"). Scopes do not nest.
class awaiting_io {
 public:
  explicit awaiting_io(const std::string& what) { set(what.empty() ? std::string_view("file I/O") : std::string_view(what)); }
  awaiting_io(const awaiting_io&) = delete;
  awaiting_io& operator=(const awaiting_io&) = delete;
  ~awaiting_io() { set({}); }

 private:
  static void set(std::string_view what) {
    auto& w = detail::watched();
    w.generation.fetch_add(1);  // odd: writing
    for (std::size_t i = 0; i < std::size(w.io); ++i)
      w.io[i].store(i < what.size() && i + 1 < std::size(w.io) ? what[i] : '\0', std::memory_order_relaxed);
    w.generation.fetch_add(1);
  }
};

// The message for field f that differs across the n ranks' records `all`
// (5 per rank): each distinct value with the ranks that hold it. `show`
// prints one rank's value; `rank_of` maps a record to its mesh rank (none:
// record r is rank r).
template <class Show>
std::string difference_message(std::uint64_t seq, const char* field, const std::vector<std::int64_t>& all, int n, int f,
                               const Show& show, const std::vector<int>* rank_of = nullptr) {
  std::string msg = "gshard debug: collective #" + std::to_string(seq) + " differs across ranks in its " + field + ':';
  std::vector<bool> done(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (done[std::size_t(r)]) continue;
    std::string ranks;
    for (int q = r; q < n; ++q)
      if (!done[std::size_t(q)] && all[std::size_t(5 * q + f)] == all[std::size_t(5 * r + f)]) {
        done[std::size_t(q)] = true;
        if (!ranks.empty()) ranks += ',';
        ranks += std::to_string(rank_of ? (*rank_of)[std::size_t(q)] : q);
      }
    msg += ' ' + show(r) + (ranks.find(',') != std::string::npos ? " on ranks " : " on rank ") + ranks + ';';
  }
  msg.back() = '.';
  return msg;
}

// The checked mode's comparison, over every rank of the mesh (in SPMD they
// all reach the same collective). Fields: sequence number, kind, axes,
// element type, element count (-1: may differ, as for gather and scatter).
// The count is compared within the collective's group only (`group_comm`):
// groups of a split that does not divide legitimately move different counts.
inline void check(MPI_Comm mesh_comm, MPI_Comm group_comm, std::uint64_t seq, collective kind, const std::string& axes,
                  int type, std::int64_t count) {
  const std::uint64_t axes_hash = gshard::detail::fnv1a(axes);
  const std::int64_t mine[5] = {std::int64_t(seq), std::int64_t(kind), std::int64_t(axes_hash), type, count};
  int n = 0, me = 0;
  MPI_Comm_size(mesh_comm, &n);
  MPI_Comm_rank(mesh_comm, &me);
  std::vector<std::int64_t> all(std::size_t(5 * n));
  MPI_Allgather(mine, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, mesh_comm);
  static const char* field_names[5] = {"sequence number", "kind", "axes", "element type", "element count"};
  // The group's members, by mesh rank: the same collective on every rank
  // (the first four fields agree) before the group's own exchange.
  std::vector<int> members;
  const auto in_group = [&] {
    int g = 0;
    MPI_Comm_size(group_comm, &g);
    members.resize(std::size_t(g));
    MPI_Allgather(&me, 1, MPI_INT, members.data(), 1, MPI_INT, group_comm);
  };
  for (int f = 0; f < 5; ++f) {
    if (f == 4) in_group();
    const auto record = [&](int r) { return f == 4 ? members[std::size_t(r)] : r; };  // the r-th compared rank
    const int compared = f == 4 ? int(members.size()) : n;
    bool differ = false;
    for (int r = 1; r < compared; ++r) differ = differ || all[std::size_t(5 * record(r) + f)] != all[std::size_t(5 * record(0) + f)];
    if (!differ) continue;
    std::vector<char> names;  // the axes names travel too, for the message (only when they differ)
    if (f == 2) {
      char buf[64] = {};
      std::snprintf(buf, sizeof buf, "%s", axes.c_str());
      names.resize(std::size_t(64 * n));
      MPI_Allgather(buf, 64, MPI_CHAR, names.data(), 64, MPI_CHAR, mesh_comm);
    }
    auto show = [&](int r) -> std::string {
      const std::int64_t v = all[std::size_t(5 * r + f)];
      switch (f) {
        case 1: return std::string(name_of(collective(v)));
        case 2: return std::string("{").append(names.data() + 64 * r) + "}";  // not "{" + string: GCC 12's -Wrestrict at -O3
        case 3: return type_name(v);
        default: return std::to_string(v);
      }
    };
    if (f == 4) {  // within the group: its first member aborts the job
      std::vector<std::int64_t> sub;
      for (int q : members) sub.insert(sub.end(), all.begin() + 5 * q, all.begin() + 5 * q + 5);
      const auto show_sub = [&](int r) { return show(members[std::size_t(r)]); };
      const std::string msg = difference_message(seq, field_names[f], sub, compared, f, show_sub, &members);
      if (me == members[0]) mpi::abort_job(msg.c_str());
      MPI_Barrier(group_comm);
      std::_Exit(1);
    }
    const std::string msg = difference_message(seq, field_names[f], all, n, f, show);
    if (me == 0) mpi::abort_job(msg.c_str());
    MPI_Barrier(mesh_comm);  // rank 0 aborts the job; the others wait for it
    std::_Exit(1);
  }
}

}  // namespace gshard::debug
