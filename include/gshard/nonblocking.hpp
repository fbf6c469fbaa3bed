// gshard/nonblocking.hpp — collectives started now and finished later, so a
// rank computes while its data moves: start_all_reduce, start_all_gather,
// start_reduce_scatter return a `pending`; its test() moves the collective on
// without blocking, its wait() finishes it. The gradient buckets start their
// reductions this way the moment a bucket is full, and the backward tests them
// between its rules (gshard/buckets.hpp, gshard/ad/tape.hpp): PyTorch DDP's
// overlap, on MPI's non-blocking collectives.
//
// Progress: MPI moves a non-blocking collective on only inside MPI calls
// (OpenMPI's and MPICH's default; no progress thread here: MPI runs
// FUNNELED), so the caller tests between pieces of work — each test is a few
// microseconds when nothing has arrived.
//
// Each one is the blocking form's twin: counted when it starts (in the order
// every rank starts it, the order the checked mode compares), checked against
// the other ranks then in the checked mode, its MPI calls' wall time (start,
// tests, wait) added to its kind's total — so the counters keep measuring the
// time a rank is held by communication — watched by the watchdog while a rank
// waits for it, and traced twice: on the rank's track while it waits, and on
// the rank's "in flight" track from its start to the test that saw it end.
// The reduce-scatter is gshard's ring, as the blocking form's (the same sums
// in the same order), unless GSHARD_REDUCE_SCATTER=mpi.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gshard/collectives.hpp"

namespace gshard {

namespace detail {

// One collective in flight. Subclasses post its MPI calls and move it on.
// One collective in flight. Subclasses post its MPI calls (inside a
// counted_scope: test/pmpi.cpp checks that every MPI call gshard makes is a
// counted collective's) and move it on.
class in_flight {
 public:
  in_flight(collective kind, const axis_group& g, std::size_t bytes, int type, std::int64_t count)
      : kind_(kind), axes_(g.label), bytes_(bytes) {
    const counted_scope scope;
    seq_ = g.sequence ? (*g.sequence)++ : 0;
    if (options().watchdog_seconds > 0) debug::start_watchdog();  // once per process
    if (debug::checked() && g.mesh_comm != MPI_COMM_NULL) {
      std::optional<debug::watch> watch;  // the check itself may wait for a rank that never comes
      if (options().watchdog_seconds > 0) watch.emplace(kind, axes_, bytes, seq_);
      debug::check(g.mesh_comm, seq_, kind, axes_, type, count);
    }
    started_ = MPI_Wtime();
  }
  in_flight(const in_flight&) = delete;
  in_flight& operator=(const in_flight&) = delete;
  virtual ~in_flight() = default;

  // Called once by the start_* function after the subclass posted its calls:
  // counted now, with the posting's wall time.
  void posted() {
    done_ = false;
    count_collective(kind_, axes_, bytes_, MPI_Wtime() - started_);
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

 protected:
  // block: wait for the MPI calls; otherwise test them. True once finished.
  virtual bool advance(bool block) = 0;
  // A tag for this collective's own point-to-point messages, the same on every
  // rank (from the mesh's sequence number) and different from any other
  // collective in flight (a few thousand apart), and from the blocking forms' tags.
  int tag() const { return 0x4000 + int(seq_ % 0x2000); }

 private:
  std::string args() const {
    return "\"axes\":\"" + trace::detail::escape(axes_) + "\",\"bytes\":" + std::to_string(bytes_);
  }
  void ended(double t) {
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

// Receive buffers for the rings in flight, kept from one to the next (fresh
// pages cost ~10 us per 4 KiB on these machines).
template <class T>
std::vector<std::vector<T>>& ring_buffers() {
  thread_local std::vector<std::vector<T>> free;
  return free;
}

// gshard's ring reduce-scatter (collectives.hpp's), one exchange at a time:
// P-1 exchanges with the neighbours, each posted when the one before has
// ended and its sum is added — so the sums are the blocking ring's, in its order.
template <class T>
class ring_in_flight final : public in_flight {
 public:
  ring_in_flight(const axis_group& g, std::span<const T> send, std::span<T> recv)
      : in_flight(collective::reduce_scatter, g, send.size_bytes(), debug::type_code<T>(), std::int64_t(send.size())),
        g_(g), send_(send.data()), recv_(recv.data()), chunk_(recv.size()) {
    if (g.size == 1) {
      std::copy(send.begin(), send.end(), recv.begin());
      return;
    }
    auto& free = ring_buffers<T>();
    if (!free.empty()) {
      incoming_ = std::move(free.back());
      free.pop_back();
    }
    incoming_.resize(chunk_);
    running_ = send_ + std::size_t((g.rank + g.size - 1) % g.size) * chunk_;
    post();
  }
  ~ring_in_flight() override {
    if (incoming_.capacity() > 0) ring_buffers<T>().push_back(std::move(incoming_));
  }

 private:
  void post() {
    const int P = g_.size, r = g_.rank, n = mpi::count(chunk_, "reduce_scatter");
    mpi::check(MPI_Irecv(incoming_.data(), n, mpi::datatype<T>(), (r + P - 1) % P, tag(), g_.comm, &req_[0]), "MPI_Irecv");
    mpi::check(MPI_Isend(running_, n, mpi::datatype<T>(), (r + 1) % P, tag(), g_.comm, &req_[1]), "MPI_Isend");
  }
  bool advance(bool block) override {
    const int P = g_.size, r = g_.rank;
    while (step_ < P - 1) {
      if (block) {
        mpi::check(MPI_Waitall(2, req_, MPI_STATUSES_IGNORE), "MPI_Waitall");
      } else {
        int flag = 0;
        mpi::check(MPI_Testall(2, req_, &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
        if (!flag) return false;
      }
      const T* own = send_ + std::size_t(((r - step_ - 2) % P + P) % P) * chunk_;
      for (std::size_t i = 0; i < chunk_; ++i) recv_[i] = own[i] + incoming_[i];
      running_ = recv_;
      if (++step_ < P - 1) post();
    }
    return true;
  }

  const axis_group& g_;
  const T* send_;
  T* recv_;
  std::size_t chunk_;
  const T* running_ = nullptr;
  std::vector<T> incoming_;
  MPI_Request req_[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  int step_ = 0;
};

}  // namespace detail

// A collective started by start_*: its buffers must stay where they are, and
// untouched, until it has finished. Destroying one that has not finished
// waits for it (an exception unwinding past it on every rank; on one rank
// alone the job ends through its terminate handler or the watchdog).
class pending {
 public:
  pending() = default;
  explicit pending(std::unique_ptr<detail::in_flight> op) : op_(std::move(op)) {}
  pending(pending&&) noexcept = default;
  pending& operator=(pending&& o) noexcept {
    if (this != &o) {
      finish_quietly();
      op_ = std::move(o.op_);
    }
    return *this;
  }
  ~pending() { finish_quietly(); }

  // Moves it on without blocking; true once finished.
  bool test() { return !op_ || op_->test(); }
  // Blocks until it has finished.
  void wait() {
    if (op_) op_->wait();
  }

 private:
  void finish_quietly() noexcept {
    if (!op_) return;
    try {
      op_->wait();
    } catch (const std::exception& e) {
      mpi::abort_job((std::string("a collective in flight failed while it was abandoned: ") + e.what()).c_str());
    }
    op_.reset();
  }
  std::unique_ptr<detail::in_flight> op_;
};

// x |-> the sum over the group of x, in place, started.
template <class T>
pending start_all_reduce(const detail::axis_group& g, std::span<T> data) {
  const detail::counted_scope scope;
  auto op = std::make_unique<detail::request_in_flight>(collective::all_reduce, g, data.size_bytes(), debug::type_code<T>(),
                                                        std::int64_t(data.size()));
  mpi::check(MPI_Iallreduce(MPI_IN_PLACE, data.data(), mpi::count(data.size(), "all_reduce"), mpi::datatype<T>(), MPI_SUM,
                            g.comm, &op->request),
             "MPI_Iallreduce");
  op->posted();
  return pending(std::move(op));
}

// recv = concat over group ranks r of send(r), started.
template <class T>
pending start_all_gather(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(recv.size() == send.size() * std::size_t(g.size), "all_gather", g, send.size(), recv.size());
  const detail::counted_scope scope;
  auto op = std::make_unique<detail::request_in_flight>(collective::all_gather, g, send.size_bytes(), debug::type_code<T>(),
                                                        std::int64_t(send.size()));
  const int n = mpi::count(send.size(), "all_gather");
  mpi::check(MPI_Iallgather(send.data(), n, mpi::datatype<T>(), recv.data(), n, mpi::datatype<T>(), g.comm, &op->request),
             "MPI_Iallgather");
  op->posted();
  return pending(std::move(op));
}

// recv = block `g.rank` of the sum over group ranks of send, started.
template <class T>
pending start_reduce_scatter(const detail::axis_group& g, std::span<const T> send, std::span<T> recv) {
  detail::require_size(send.size() == recv.size() * std::size_t(g.size), "reduce_scatter", g, send.size(), recv.size());
  const detail::counted_scope scope;
  if (!detail::reduce_scatter_uses_mpi()) {
    auto op = std::make_unique<detail::ring_in_flight<T>>(g, send, recv);
    op->posted();
    return pending(std::move(op));
  }
  auto op = std::make_unique<detail::request_in_flight>(collective::reduce_scatter, g, send.size_bytes(),
                                                        debug::type_code<T>(), std::int64_t(send.size()));
  mpi::check(MPI_Ireduce_scatter_block(send.data(), recv.data(), mpi::count(recv.size(), "reduce_scatter"),
                                       mpi::datatype<T>(), MPI_SUM, g.comm, &op->request),
             "MPI_Ireduce_scatter_block");
  op->posted();
  return pending(std::move(op));
}

}  // namespace gshard
