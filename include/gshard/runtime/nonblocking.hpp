// gshard/runtime/nonblocking.hpp — collectives started now and finished later, so a
// rank computes while its data moves: start_all_reduce, start_all_gather,
// start_reduce_scatter, start_all_to_all return a `collective_request`; its
// test() moves the collective on without blocking, its wait() finishes it.
// MPI moves one on only inside MPI calls, so the caller tests between pieces
// of work (a few microseconds a test when nothing has arrived);
// detail::progress_in_flight() tests what this rank has in flight.
//   auto r = start_all_reduce(g, std::span(buf));  compute();  r.wait();
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gshard/runtime/collectives.hpp"
#include "gshard/core/progress.hpp"

namespace gshard {

namespace detail {

inline void progress_in_flight();

// One collective in flight. Subclasses post its MPI calls (inside a
// counted_scope: test/pmpi.cpp checks that every MPI call gshard makes is a
// counted collective's) and move it on. Each is its blocking form's twin:
// counted when it starts (in the order every rank starts it, the order the
// checked mode compares), checked against the other ranks then in the
// checked mode, its MPI calls' wall time (start, tests, wait) added to its
// kind's total — so the counters keep measuring the time a rank is held by
// communication — watched by the watchdog while a rank waits for it, and
// traced twice: on the rank's track while it waits, and on the "in flight"
// track from its start to the test or wait that saw it end
// (progress_in_flight tests the oldest request only: a later one's span may
// run on to its own test or wait).

class in_flight {
 public:
  in_flight(collective kind, const axis_group& g, std::size_t bytes, int type, std::int64_t count)
      : kind_(kind), axes_(g.label), bytes_(bytes) {
    const counted_scope scope;
    std::optional<debug::watch> watch;  // while the checked mode compares it: a rank may never come
    seq_ = open_collective(kind, g, bytes, type, count, watch);
    count_collective(kind, axes_, bytes_);  // before it is posted: nothing after the post throws
    started_ = MPI_Wtime();
  }
  in_flight(const in_flight&) = delete;
  in_flight& operator=(const in_flight&) = delete;

  virtual ~in_flight() { unlist(); }

  // Called by the start_* function once the subclass has posted its calls.
  void posted() noexcept {
    done_ = false;
    add_collective_seconds(kind_, axes_, MPI_Wtime() - started_);
    running().push_back(this);
    progress_hook() = &progress_in_flight;  // the kernels' calls between their pieces of work
    mpi::detail::finish_in_flight() = &finish_running;  // what an uncaught error ends with (mpi.hpp)
  }

  // The collectives this rank has in flight, oldest first (progress_in_flight).
  static std::vector<in_flight*>& running() {
    thread_local std::vector<in_flight*> list;
    return list;
  }
  // True for a collective that moves on only when it is itself tested (a
  // ring posts its next exchange then); false when any MPI call moves it.
  virtual bool needs_own_test() const { return false; }

  // Tests what this rank has in flight until none is left or the
  // watchdog's time (10 s without one) has passed; true when none is left.
  static bool finish_running() noexcept {
    const double until = MPI_Wtime() + (options().watchdog_seconds > 0 ? options().watchdog_seconds : 10.0);
    try {
      while (!running().empty()) {
        for (std::size_t i = 0; i < running().size();)  // a test that ends one unlists it
          if (!running()[i]->test()) ++i;
        if (MPI_Wtime() > until) return false;
      }
    } catch (...) {
      return false;
    }
    return true;
  }

  // Moves it on; true once it has finished (its result is in place).
  bool test() {
    if (done_) return true;
    const counted_scope scope;
    const double t0 = MPI_Wtime();
    done_ = advance(false);
    const double t1 = MPI_Wtime();
    add_collective_seconds(kind_, axes_, t1 - t0);
    if (done_) ended(t1);
    return done_;
  }

  // Blocks until it has finished, watched by the watchdog.
  void wait() {
    if (done_) return;
    const counted_scope scope;
    std::optional<debug::watch> watch;
    if (options().watchdog_seconds > 0) watch.emplace(kind_, axes_, bytes_, seq_);
    const double t0 = MPI_Wtime();
    done_ = advance(true);
    const double t1 = MPI_Wtime();
    add_collective_seconds(kind_, axes_, t1 - t0);
    if (trace::enabled())  // the rank's own track: the time it waited
      trace::add(name_of(kind_), "collective", t0 + trace::detail::st().offset, t1 + trace::detail::st().offset, args());
    ended(t1);
  }

  // While an exception leaves the scope of a collective in flight: moves it
  // on for as long as the watchdog allows (10 s without one). When every
  // rank unwinds past it, they finish it together; when this rank alone
  // does, the others are blocked elsewhere and never will — then the job
  // ends with a message, instead of this rank waiting forever.
  void finish_while_unwinding() noexcept {
    const double limit = options().watchdog_seconds > 0 ? options().watchdog_seconds : 10.0;
    const double t0 = MPI_Wtime();
    try {
      while (!test())
        if (MPI_Wtime() - t0 > limit) break;
    } catch (...) {
    }
    if (done_) return;
    const std::string msg = "collective #" + std::to_string(seq_) + " " + std::string(name_of(kind_)) + " over {" + axes_ +
                            "} was in flight when an exception left its scope on this rank, and the other ranks did not "
                            "finish it within " + std::to_string(int(limit)) +
                            " s: the exception is this rank's alone; ending the job";
    mpi::abort_job(msg.c_str());
  }

  std::uint64_t sequence() const { return seq_; }

 protected:
  // block: wait for the MPI calls; otherwise test them. True once finished.
  virtual bool advance(bool block) = 0;

 private:
  std::string args() const {
    return "\"axes\":\"" + trace::detail::escape(axes_) + "\",\"bytes\":" + std::to_string(bytes_);
  }
  void unlist() noexcept {
    auto& r = running();
    if (auto it = std::find(r.begin(), r.end(), this); it != r.end()) r.erase(it);
  }
  void ended(double t) {
    unlist();
    if (trace::enabled())  // the "in flight" track: from its start to the call that saw it end
      trace::add(name_of(kind_), "in flight", started_ + trace::detail::st().offset, t + trace::detail::st().offset, args(),
                 trace::track::in_flight);
  }

  collective kind_;
  const std::string& axes_;  // the group's label: the mesh outlives every collective on it
  std::size_t bytes_;
  std::uint64_t seq_ = 0;
  double started_ = 0;
  bool done_ = true;
};

// One MPI request: MPI_Iallreduce, MPI_Iallgather, MPI_Ireduce_scatter_block.
class request_in_flight final : public in_flight {
 public:
  using in_flight::in_flight;
  MPI_Request request = MPI_REQUEST_NULL;

 private:
  bool advance(bool block) override {
    if (block) {
      mpi::check(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
      return true;
    }
    int flag = 0;
    mpi::check(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    return flag != 0;
  }
};

// The tags of the rings in flight. A ring's point-to-point messages carry
// tag ring_tag_base + its number in the mesh's sequence modulo
// ring_tag_slots (the same on every rank); a slot still held by an earlier
// ring that has not been let go — its collective_request destroyed or replaced, a
// program point, the same on every rank — is waited for first. So two rings
// in flight never share a tag, and neither shares one with the blocking
// ring (0x7273), permute (0x6773) or the blocking trimmed all_to_all (0x7461).
inline constexpr int ring_tag_base = 0x4000, ring_tag_slots = 0x2000;
inline std::vector<in_flight*>& ring_tag_owners() {
  thread_local std::vector<in_flight*> owners(ring_tag_slots, nullptr);
  return owners;
}

// Receive buffers for the rings in flight, kept from one to the next (fresh
// pages cost ~10 us per 4 KiB on these machines).
template <class T>
std::vector<std::vector<T>>& ring_buffers() {
  thread_local std::vector<std::vector<T>> free;
  return free;
}
// A kept buffer (empty when none is kept), and one given back.
template <class T>
std::vector<T> take_buffer() {
  auto& free = ring_buffers<T>();
  if (free.empty()) return {};
  std::vector<T> b = std::move(free.back());
  free.pop_back();
  return b;
}
template <class T>
void give_back(std::vector<T>& b) {
  if (b.capacity() > 0) ring_buffers<T>().push_back(std::move(b));
}

// The tags of a started collective's messages come from its group's sequence.
inline void require_sequence(const axis_group& g, const char* op) {
  if (!g.sequence)  // every mesh group and world_group() has one
    throw error(std::string("gshard::") + op + ": the group {" + g.label + "} keeps no sequence of its collectives, which "
                "its messages' tags come from");
}

// gshard's ring reduce-scatter (collectives.hpp's), one exchange at a time:
// P-1 exchanges with the neighbours, each posted when the one before has
// ended and its sum is added — so the sums are the blocking ring's, in its order.
template <class T>
class ring_in_flight final : public in_flight {
 public:
  ring_in_flight(const axis_group& g, std::span<const T> send, std::span<T> recv)
      : in_flight(collective::reduce_scatter, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size())),
        g_(g), send_(send.data()), recv_(recv.data()), chunk_(recv.size()), slot_(int(sequence() % ring_tag_slots)) {
    if (g.size == 1) {
      std::copy(send.begin(), send.end(), recv.begin());
      return;
    }
    incoming_ = take_buffer<T>();
    incoming_.resize(chunk_);
    in_flight*& owner = ring_tag_owners()[std::size_t(slot_)];
    if (owner) owner->wait();
    owner = this;
    running_ = send_ + std::size_t(ring_block(g.rank, -1, g.size)) * chunk_;
    post();
  }
  bool needs_own_test() const override { return true; }
  ~ring_in_flight() override {
    if (in_flight*& owner = ring_tag_owners()[std::size_t(slot_)]; owner == this) owner = nullptr;
    give_back(incoming_);
  }

 private:
  void post() {
    const int P = g_.size, r = g_.rank, n = mpi::count(chunk_, "reduce_scatter"), tag = ring_tag_base + slot_;
    mpi::check(MPI_Irecv(incoming_.data(), n, mpi::datatype<T>(), (r + P - 1) % P, tag, g_.comm, &req_[0]), "MPI_Irecv");
    mpi::check(MPI_Isend(running_, n, mpi::datatype<T>(), (r + 1) % P, tag, g_.comm, &req_[1]), "MPI_Isend");
  }
  bool advance(bool block) override {
    while (step_ < g_.size - 1) {
      if (block) {
        mpi::check(MPI_Waitall(2, req_, MPI_STATUSES_IGNORE), "MPI_Waitall");
      } else {
        int flag = 0;
        mpi::check(MPI_Testall(2, req_, &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
        if (!flag) return false;
      }
      ring_add(send_ + std::size_t(ring_block(g_.rank, step_, g_.size)) * chunk_, incoming_.data(), recv_, chunk_);
      running_ = recv_;
      if (++step_ < g_.size - 1) post();
    }
    return true;
  }

  const axis_group& g_;
  const T* send_;
  T* recv_;
  std::size_t chunk_;
  int slot_;
  const T* running_ = nullptr;
  std::vector<T> incoming_;
  MPI_Request req_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int step_ = 0;
};

// A bf16 sum in flight, by point-to-point messages under a ring tag slot
// (so it never depends on when another rank tests it, as a collective
// posted late would): block j of the (padded) send goes to rank j; once all
// P parts of this rank's block are in, they are added in fp32 in group-rank
// order and rounded once — the blocking form's sum, to the bit — and for an
// all_reduce this rank's block then goes to every rank. Every receive is
// posted at the start: two messages from one rank with one tag arrive in
// the order they were sent.
class fp32_sum_in_flight final : public in_flight {
 public:
  // reduce_scatter: send holds P blocks of `count`/P elements, out one
  // block; all_reduce: `count` elements from send (which may be out) into out.
  fp32_sum_in_flight(collective kind, const axis_group& g, const bf16* send, std::size_t count, bf16* out)
      : in_flight(kind, g, count * sizeof(bf16), debug::type_code<bf16>(), std::int64_t(count)),
        g_(g), out_(out), count_(count), gathers_(kind == collective::all_reduce),
        slot_(int(sequence() % ring_tag_slots)) {
    const std::size_t P = std::size_t(g.size), r = std::size_t(g.rank);
    chunk_ = gathers_ ? (count + P - 1) / P : count / P;
    parts_ = take_buffer<bf16>();
    const bf16* from = send;
    if (gathers_) {
      padded_ = take_buffer<bf16>();
      result_ = take_buffer<bf16>();
      padded_.assign(send, send + count);
      padded_.resize(chunk_ * P, bf16(0.0f));
      result_.resize(chunk_ * P);
      from = padded_.data();
    }
    parts_.resize(chunk_ * P);
    std::copy(from + r * chunk_, from + (r + 1) * chunk_, parts_.begin() + std::ptrdiff_t(r * chunk_));
    in_flight*& owner = ring_tag_owners()[std::size_t(slot_)];
    if (owner) owner->wait();
    owner = this;
    const int n = mpi::count(chunk_, gathers_ ? "all_reduce" : "reduce_scatter"), tag = ring_tag_base + slot_;
    req_.reserve(4 * (P - 1));
    const MPI_Datatype type = mpi::datatype<bf16>();
    for (std::size_t q = 0; q < P; ++q) {
      if (q == r) continue;
      mpi::check(MPI_Irecv(parts_.data() + q * chunk_, n, type, int(q), tag, g.comm, &req_.emplace_back()), "MPI_Irecv");
      mpi::check(MPI_Isend(from + q * chunk_, n, type, int(q), tag, g.comm, &req_.emplace_back()), "MPI_Isend");
    }
    if (gathers_)
      for (std::size_t q = 0; q < P; ++q)
        if (q != r)
          mpi::check(MPI_Irecv(result_.data() + q * chunk_, n, type, int(q), tag, g.comm, &req_.emplace_back()), "MPI_Irecv");
  }
  bool needs_own_test() const override { return true; }
  ~fp32_sum_in_flight() override {
    if (in_flight*& owner = ring_tag_owners()[std::size_t(slot_)]; owner == this) owner = nullptr;
    for (std::vector<bf16>* b : {&parts_, &padded_, &result_}) give_back(*b);
  }

 private:
  // Waits for (block) or tests requests [0, upto): true once they have ended.
  bool ended(std::size_t upto, bool block) {
    const int n = int(upto);
    if (block) {
      mpi::check(MPI_Waitall(n, req_.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
      return true;
    }
    int flag = 0;
    mpi::check(MPI_Testall(n, req_.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
    return flag != 0;
  }
  bool advance(bool block) override {
    const std::size_t P = std::size_t(g_.size), r = std::size_t(g_.rank);
    if (!summed_) {
      // The parts' receives and sends: the first 2(P-1) requests (the gather's receives follow).
      if (!ended(2 * (P - 1), block)) return false;
      combine_parts(parts_.data(), chunk_, g_.size, reduction::sum, gathers_ ? result_.data() + r * chunk_ : out_);
      if (gathers_) {
        const int n = int(chunk_), tag = ring_tag_base + slot_;
        for (std::size_t q = 0; q < P; ++q)
          if (q != r)
            mpi::check(MPI_Isend(result_.data() + r * chunk_, n, mpi::datatype<bf16>(), int(q), tag, g_.comm,
                                 &req_.emplace_back()),
                       "MPI_Isend");
      }
      summed_ = true;
    }
    if (!gathers_) return true;
    if (!ended(req_.size(), block)) return false;
    std::copy(result_.begin(), result_.begin() + std::ptrdiff_t(count_), out_);
    return true;
  }

  const axis_group& g_;
  bf16* out_;
  std::size_t count_, chunk_ = 0;
  bool gathers_;
  int slot_;
  std::vector<bf16> parts_, padded_, result_;
  std::vector<MPI_Request> req_;
  bool summed_ = false;  // this rank's block is summed (and, for an all_reduce, on its way to every rank)
};

// start_all_to_all_trimmed's collective (wire::trimmed): the messages of
// all_to_all_trimmed (collectives.hpp), posted now; each piece widened
// back as the test or wait that sees them all arrive. Tagged as the rings
// are (a slot of the group's sequence).
template <class T>
class trimmed_all_to_all_in_flight final : public in_flight {
 public:
  trimmed_all_to_all_in_flight(const axis_group& g, trimmed_messages&& m, const T* send, T* recv, std::size_t piece,
                               std::size_t rows, std::size_t row)
      : in_flight(collective::all_to_all, g, m.counted, debug::type_code<T>(), std::int64_t(piece) * g.size),
        g_(g), out_(std::move(m)), recv_(recv), piece_(piece), rows_(rows), row_(row),
        room_(trimmed_room<T>(piece, rows, row)), slot_(int(sequence() % ring_tag_slots)) {
    const int P = g.size, r = g.rank;
    std::copy(send + std::size_t(r) * piece, send + std::size_t(r + 1) * piece, recv + std::size_t(r) * piece);
    if (P == 1) return;
    inbox_ = take_buffer<unsigned char>();
    inbox_.resize(room_ * std::size_t(P));
    in_flight*& owner = ring_tag_owners()[std::size_t(slot_)];
    if (owner) owner->wait();
    post_trimmed(g, out_, inbox_.data(), room_, ring_tag_base + slot_, req_);
    owner = this;  // once posted: a posting that throws leaves the slot to its earlier owner
  }
  ~trimmed_all_to_all_in_flight() override {
    if (in_flight*& owner = ring_tag_owners()[std::size_t(slot_)]; owner == this) owner = nullptr;
    give_back(out_.bytes), give_back(inbox_);
  }

 private:
  bool advance(bool block) override {
    if (req_.empty()) return true;
    const int n = int(req_.size());
    if (block) {
      mpi::check(MPI_Waitall(n, req_.data(), MPI_STATUSES_IGNORE), "MPI_Waitall");
    } else {
      int flag = 0;
      mpi::check(MPI_Testall(n, req_.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (!flag) return false;
    }
    req_.clear();
    widen_trimmed(inbox_.data(), room_, g_.size, g_.rank, piece_, rows_, row_, recv_);
    return true;
  }

  const axis_group& g_;
  trimmed_messages out_;
  T* recv_;
  std::size_t piece_, rows_, row_, room_;  // room_: the largest message, in bytes
  int slot_;
  std::vector<unsigned char> inbox_;
  std::vector<MPI_Request> req_;
};

// Moves every collective this rank has in flight on, without blocking: one
// MPI_Test of the oldest request (any MPI call moves all of MPI's
// non-blocking operations on) and a test of each ring (which posts its next
// exchange only when tested). Nothing when none is in flight. MPI moves a
// non-blocking collective on only inside MPI calls (OpenMPI's and MPICH's
// default; there is no progress thread: MPI runs FUNNELED), so the tape calls
// it as each operation of the forward ends and between the backward's rules,
// the batched GEMMs between their GEMMs: the points where a rank that
// computes can let its data move.
inline void progress_in_flight() {
  auto& r = in_flight::running();
  if (r.empty()) return;
  // At most one round every 20 us: called between small GEMMs (attention's,
  // one per block of rows), the tests would cost more than they move.
  thread_local double last = 0;
  const double now = MPI_Wtime();
  if (now - last < 20e-6) return;
  last = now;
  bool tested_request = false;
  for (std::size_t i = 0; i < r.size();) {  // a test that ends one unlists it
    in_flight* op = r[i];
    const bool test = op->needs_own_test() || !tested_request;
    tested_request = tested_request || !op->needs_own_test();
    if (test && op->test()) continue;
    ++i;
  }
}

}  // namespace detail

// A collective started by start_*: its buffers must stay where they are, and
// untouched, until it has finished. Destroying one that has not finished
// waits for it; while an exception unwinds, only as long as the other ranks
// could take to unwind past it too (in_flight::finish_while_unwinding).
// The gradient buckets (gshard/state/buckets.hpp) start their reductions this way
// as soon as a bucket is full, and the backward tests them between its rules.
class collective_request {
 public:
  collective_request() = default;
  explicit collective_request(std::unique_ptr<detail::in_flight> op) noexcept : op_(std::move(op)) {}
  collective_request(collective_request&&) noexcept = default;
  collective_request& operator=(collective_request&& o) noexcept {
    if (this != &o) {
      let_go();
      op_ = std::move(o.op_);
    }
    return *this;
  }
  ~collective_request() { let_go(); }

  // Moves it on without blocking; true once finished.
  bool test() { return !op_ || op_->test(); }
  // Blocks until it has finished.
  void wait() {
    if (op_) op_->wait();
  }

 private:
  void let_go() noexcept {
    if (!op_) return;
    if (std::uncaught_exceptions() > 0) {
      op_->finish_while_unwinding();
    } else {
      try {
        op_->wait();
      } catch (const std::exception& e) {
        mpi::abort_job((std::string("a collective in flight failed as its request was let go: ") + e.what()).c_str());
      }
    }
    op_.reset();
  }
  std::unique_ptr<detail::in_flight> op_;
};

namespace detail {
// One MPI request's collective: counted and checked (in_flight), posted by
// `post` (which fills the request and returns MPI's code), then handed over.
template <class Post>
collective_request start_request(collective kind, const axis_group& g, std::size_t bytes, int type, std::int64_t count,
                                 const char* call, Post post) {
  const counted_scope scope;
  auto op = std::make_unique<request_in_flight>(kind, g, bytes, type, count);
  mpi::check(post(&op->request), call);
  op->posted();
  return collective_request(std::move(op));
}
}  // namespace detail

// x |-> the sum over the group of x, in place, started (bf16: summed in fp32, as the blocking form).
template <class T>
collective_request start_all_reduce(const detail::axis_group& g, std::span<T> data) {
  if constexpr (detail::sums_in_fp32<T>) {
    detail::require_sequence(g, "start_all_reduce");
    (void)mpi::count(data.size() / std::size_t(g.size) + 1, "all_reduce");  // before it is counted
    const detail::counted_scope scope;
    auto op = std::make_unique<detail::fp32_sum_in_flight>(collective::all_reduce, g, data.data(), data.size(), data.data());
    op->posted();
    return collective_request(std::move(op));
  } else {
    const int n = mpi::count(data.size(), "all_reduce");
    return detail::start_request(collective::all_reduce, g, data.size_bytes(), debug::type_code<T>(),
                                 std::int64_t(data.size()), "MPI_Iallreduce", [&](MPI_Request* q) {
                                   return MPI_Iallreduce(MPI_IN_PLACE, data.data(), n, mpi::datatype<T>(), MPI_SUM, g.comm, q);
                                 });
  }
}

// recv = concat over group ranks r of send(r), started.
template <class T>
collective_request start_all_gather(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(recv.size() == send.size() * std::size_t(g.size), "all_gather", g, send.size(), recv.size());
  const int n = mpi::count(send.size(), "all_gather");
  return detail::start_request(collective::all_gather, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()),
                               "MPI_Iallgather", [&](MPI_Request* q) {
                                 return MPI_Iallgather(send.data(), n, mpi::datatype<T>(), recv.data(), n, mpi::datatype<T>(),
                                                       g.comm, q);
                               });
}

// Block j of send goes to group rank j; block i of recv comes from group
// rank i, started.
template <class T>
collective_request start_all_to_all(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size() && send.size() % std::size_t(g.size) == 0, "all_to_all", g, send.size(),
                       recv.size());
  const int n = mpi::count(send.size() / std::size_t(g.size), "all_to_all");
  return detail::start_request(collective::all_to_all, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size()),
                               "MPI_Ialltoall", [&](MPI_Request* q) {
                                 return MPI_Ialltoall(send.data(), n, mpi::datatype<T>(), recv.data(), n, mpi::datatype<T>(),
                                                      g.comm, q);
                               });
}

// start_all_to_all with wire::trimmed: send and recv hold P pieces, each
// of matrices of `rows` rows of `row` elements; a piece travels without
// each matrix's trailing rows of zeros, which the receiver writes back —
// recv as start_all_to_all leaves it, to the bit, in fewer bytes where
// pieces end in zero rows (the MoE layer's empty capacity slots).
template <class T>
collective_request start_all_to_all_trimmed(const detail::axis_group& g, std::span<const T> send, std::span<T> recv,
                                            std::size_t rows, std::size_t row) {
  const std::size_t P = std::size_t(g.size);
  detail::require_size(send.size() == recv.size() && send.size() % P == 0, "all_to_all", g, send.size(), recv.size());
  detail::require_rows(send.size() / P, rows, row);
  detail::require_sequence(g, "start_all_to_all_trimmed");
  const std::size_t piece = send.size() / P;
  (void)mpi::count(detail::trimmed_room<T>(piece, rows, row), "all_to_all");  // before it is counted
  const detail::counted_scope scope;
  auto op = std::make_unique<detail::trimmed_all_to_all_in_flight<T>>(
      g, detail::trim_pieces(send.data(), g.size, g.rank, piece, rows, row, detail::take_buffer<unsigned char>()), send.data(),
      recv.data(), piece, rows, row);
  op->posted();
  return collective_request(std::move(op));
}

// recv = block `g.rank` of the sum over group ranks of send, started. It is
// gshard's ring, as the blocking form's (the same sums in the same order),
// unless GSHARD_REDUCE_SCATTER=mpi; bf16's is the blocking form's fp32 sum.
template <class T>
collective_request start_reduce_scatter(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size() * std::size_t(g.size), "reduce_scatter", g, send.size(), recv.size());
  if (!detail::sums_in_fp32<T> && detail::reduce_scatter_uses_mpi()) {
    const int n = mpi::count(recv.size(), "reduce_scatter");
    return detail::start_request(collective::reduce_scatter, g, send.size_bytes(), debug::type_code<T>(),
                                 std::int64_t(send.size()), "MPI_Ireduce_scatter_block", [&](MPI_Request* q) {
                                   return MPI_Ireduce_scatter_block(send.data(), recv.data(), n, mpi::datatype<T>(), MPI_SUM,
                                                                    g.comm, q);
                                 });
  }
  detail::require_sequence(g, "start_reduce_scatter");
  (void)mpi::count(recv.size(), "reduce_scatter");  // before it is counted
  const detail::counted_scope scope;
  std::unique_ptr<detail::in_flight> op;
  if constexpr (detail::sums_in_fp32<T>)
    op = std::make_unique<detail::fp32_sum_in_flight>(collective::reduce_scatter, g, send.data(), send.size(), recv.data());
  else
    op = std::make_unique<detail::ring_in_flight<T>>(g, send, recv);
  op->posted();
  return collective_request(std::move(op));
}

}  // namespace gshard
