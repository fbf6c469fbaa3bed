// gshard/state/buckets.hpp — one reshard plan run on many tensors at once: their
// blocks side by side in one buffer, one collective per step for all of
// them (PyTorch DDP's gradient buckets). The training step sends each
// weight's gradient reduction (all_reduces, reduce_scatters) and each
// sharded weight's gather (all_gathers) through buckets, so a step issues a
// few large collectives instead of one small one per weight: the α of every
// call saved, which the cost model shows is most of a step's communication
// at hundreds of ranks (docs/12_scale.md).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gshard/runtime/nonblocking.hpp"
#include "gshard/core/error.hpp"
#include "gshard/core/raw_storage.hpp"
#include "gshard/kernels/copy_box.hpp"
#include "gshard/runtime/mesh.hpp"
#include "gshard/layout/reshard_steps.hpp"

namespace gshard::detail {

// Steps every tensor can take side by side with others: an all_reduce (any
// layout), a reduce_scatter into dim 0 or an all_gather out of dim 0 (each
// rank's part of a tensor is one contiguous run of its block).
constexpr bool stackable(const reshard_steps& p) {
  for (int i = 0; i < p.n; ++i) {
    const reshard_step& s = p.step[i];
    const bool ok = s.kind == step_kind::all_reduce || (s.kind == step_kind::reduce_scatter && s.to_dim == 0) ||
                    (s.kind == step_kind::all_gather && s.from_dim == 0);
    if (!ok) return false;
  }
  return p.collectives() > 0;
}

// Whether a tensor of `global` extents takes plan `p` through a bucket: its
// steps stack, and its blocks are equal on every rank, so every rank cuts
// the bucket's collectives alike. The tape's gradients, the sharded
// update's gathers and the cost model ask this one rule.
constexpr bool bucketable(const reshard_steps& p, const index_t* global, int rank, const index_t* sizes) {
  return stackable(p) && plan_even(p, global, rank, sizes);
}

// The same steps (kind, axes, dims), whatever the layouts between them: a
// bucket's members may differ in rank and in their other dims.
constexpr bool same_steps(const reshard_steps& a, const reshard_steps& b) {
  if (a.n != b.n) return false;
  for (int i = 0; i < a.n; ++i)
    if (!(a.step[i] == b.step[i])) return false;
  return true;
}

// Buffers kept from step to step: each bucket takes its buffers (data and
// scratch; with wire::bf16, data and the two bf16 messages) from here and
// gives them back when it is destroyed, so a step's buckets reuse the last
// step's memory instead of the heap's (fresh pages cost ~10 us per 4 KiB on
// these machines, and the heap does not fragment around buffers that come
// and go). Raw storage: what a bucket's buffers grow by is written by the
// packing or the collective before it is read, never zeroed first. Owned by
// `parameters`, one per element type.
template <class T>
class bucket_memory {
 public:
  raw_vector<T> take() { return take_from(free_); }
  void give(raw_vector<T>&& v) { give_to(free_, std::move(v)); }
  // The buffers of a bucket whose messages carry bf16 (wire::bf16).
  raw_vector<bf16> take_wire() { return take_from(free_wire_); }
  void give_wire(raw_vector<bf16>&& v) { give_to(free_wire_, std::move(v)); }

 private:
  template <class U>
  static raw_vector<U> take_from(std::vector<raw_vector<U>>& free) {
    if (free.empty()) return {};
    raw_vector<U> v = std::move(free.back());
    free.pop_back();
    v.clear();
    return v;
  }
  template <class U>
  static void give_to(std::vector<raw_vector<U>>& free, raw_vector<U>&& v) {
    if (v.capacity() > 0) free.push_back(std::move(v));
  }
  std::vector<raw_vector<T>> free_;
  std::vector<raw_vector<bf16>> free_wire_;
};

// Tensors waiting to take one stackable plan together. Each member gives
// its block (copied in) and a function that receives its result. The plan's
// collectives run non-blocking, one step at a time: start() posts the first
// step (detail::progress_in_flight() moves it on), advance() finishes it and
// posts the next — or, after the last, hands each member its result — and
// finish() advances to the end. Where each step starts is the caller's
// program point (start, advance, finish), never a test's finding, so every
// rank issues the same collectives in the same order. With wire::bf16 each
// step's message is rounded to bf16 as it is packed (a sum's parts added in
// fp32, rounded once) and widened back as it is unpacked.
template <class T>
class bucket {
 public:
  using done_fn = std::function<void(std::span<const T>)>;

  bucket(const mesh_base& m, const reshard_steps& plan, bucket_memory<T>& memory, wire w = wire::same)
      : mesh_(&m), plan_(plan), memory_(&memory), data_(memory.take()), narrow_(narrows<T>(w)) {
    if (narrow_) wire_in_ = memory.take_wire(), wire_out_ = memory.take_wire();
    else scratch_ = memory.take();  // bf16 messages are packed and unpacked straight from and into data_
  }
  bucket(const bucket&) = delete;  // lives in a std::list: never moved, so its buffers stay where MPI writes
  bucket& operator=(const bucket&) = delete;
  ~bucket() {
    flight_ = collective_request{};  // finished before its buffers go back
    memory_->give(std::move(data_));
    memory_->give(std::move(scratch_));
    memory_->give_wire(std::move(wire_in_));
    memory_->give_wire(std::move(wire_out_));
  }

  const reshard_steps& plan() const { return plan_; }
  std::size_t bytes() const { return data_.size() * sizeof(T); }
  bool empty() const { return members_.empty(); }

  // `id`: what holds() answers for it (the caller's number, e.g. a parameter's).
  void add(std::span<const T> block, done_fn done, std::size_t id = no_id) {
    if (step_ >= 0) throw error("gshard::detail::bucket: a tensor added to a bucket that has started");
    // Each rank's part of a member must be whole: a reduce_scatter's group
    // divides its block (only plans whose blocks are all equal are stacked:
    // plan_even, layout/reshard_steps.hpp).
    std::size_t parts = 1;
    for (int i = 0; i < plan_.n; ++i)
      if (plan_.step[i].kind == step_kind::reduce_scatter) parts *= std::size_t(mesh_->group(1u << plan_.step[i].axis).size);
    if (block.size() % parts != 0)
      throw error("gshard::detail::bucket: a block of " + std::to_string(block.size()) + " elements does not split into the " +
                  std::to_string(parts) + " parts its reduce_scatters make");
    members_.push_back({block.size(), std::move(done), id});
    data_.append(block);
  }
  static constexpr std::size_t no_id = std::size_t(-1);
  bool holds(std::size_t id) const {
    return std::any_of(members_.begin(), members_.end(), [id](const member& m) { return m.id == id; });
  }
  // The steps not yet finished (the one in flight among them).
  int steps_left() const { return members_.empty() ? 0 : step_ < 0 ? plan_.n : plan_.n - step_; }
  // The bytes its members hold once its all_gathers have run.
  std::size_t gathered_bytes() const {
    std::size_t n = data_.size();
    for (int i = std::max(step_, 0); i < plan_.n; ++i)
      if (plan_.step[i].kind == step_kind::all_gather) n *= std::size_t(mesh_->group(1u << plan_.step[i].axis).size);
    return n * sizeof(T);
  }

  // Posts the first step's collective.
  void start() {
    if (members_.empty() || step_ >= 0) return;
    flight_ = begin_step(plan_.step[0]);
    step_ = 0;
  }
  // Finishes the step in flight (waiting if it must) and posts the next;
  // after the last, hands each member its result and empties the bucket.
  void advance() {
    if (step_ < 0) return;
    flight_.wait();
    end_step(plan_.step[step_]);
    if (step_ + 1 < plan_.n) {
      flight_ = begin_step(plan_.step[step_ + 1]);
      ++step_;
      return;
    }
    flight_ = collective_request{};
    step_ = -1;
    const std::vector<member> done = std::move(members_);  // empty even if a member's function throws
    members_.clear();
    std::size_t at = 0;
    for (const auto& m : done) {
      m.done(std::span<const T>(data_.data() + at, m.size));
      at += m.size;
    }
    data_.clear();
  }
  // Runs what is left of the plan and hands out the results.
  void finish() {
    start();
    while (step_ >= 0) advance();
  }

 private:
  struct member {
    std::size_t size;  // its elements in data_, now
    done_fn done;
    std::size_t id;
  };

  // Pack and start one step's collective; end_step unpacks once it has finished.
  collective_request begin_step(const reshard_step& s) {
    if (s.kind == step_kind::all_reduce) {  // partial{x} |-> replicated on x, in place
      if (narrow_) return start_all_reduce<bf16>(mesh_->group(s.mask), narrowed());
      return start_all_reduce<T>(mesh_->group(s.mask), std::span<T>(data_));
    }
    const axis_group& g = mesh_->group(1u << s.axis);
    const std::size_t p = std::size_t(g.size);
    if (s.kind == step_kind::reduce_scatter) {  // partial{x} |-> dim 0 split by x
      // Pack: rank j's part of every member, member after member (rounded
      // to bf16 on the way, with wire::bf16).
      const std::size_t n = data_.size();
      if (narrow_) {
        wire_in_.resize(n);
        pack(data_.data(), wire_in_.data(), p);
      } else {
        scratch_.resize(n);
        pack(data_.data(), scratch_.data(), p);
      }
      data_.resize(n / p);
      // Communicate: this rank's parts, member after member
      if (narrow_) return start_reduce_scatter<bf16>(g, std::span<const bf16>(wire_in_), arriving(data_.size()));
      return start_reduce_scatter<T>(g, std::span<const T>(scratch_), std::span<T>(data_));
    }
    // all_gather: dim 0 split by x |-> replicated on x
    if (narrow_) return start_all_gather<bf16>(g, narrowed(), arriving(data_.size() * p));
    scratch_.resize(data_.size() * p);
    return start_all_gather<T>(g, std::span<const T>(data_), std::span<T>(scratch_));  // every rank's blocks, rank after rank
  }
  // to = rank 0's part of every member, then rank 1's, ... of `from` (the
  // members' blocks in order), converted to To.
  template <class To>
  void pack(const T* from, To* to, std::size_t p) const {
    std::size_t out = 0;
    for (std::size_t j = 0; j < p; ++j) {
      std::size_t at = 0;
      for (const member& m : members_) {
        const std::size_t part = m.size / p;
        convert_elements(from + at + j * part, part, to + out);
        out += part;
        at += m.size;
      }
    }
  }
  // to = each member's blocks from every rank, in rank order, out of `from`
  // (rank after rank, each holding its `total` elements member after
  // member), converted to T.
  template <class From>
  void unpack(const From* from, T* to, std::size_t p, std::size_t total) const {
    std::size_t out = 0, at = 0;
    for (const member& m : members_) {
      for (std::size_t j = 0; j < p; ++j) {
        convert_elements(from + j * total + at, m.size, to + out);
        out += m.size;
      }
      at += m.size;
    }
  }
  // wire::bf16: data_ rounded into wire_in_; what arrives lands in wire_out_.
  std::span<bf16> narrowed() {
    wire_in_.resize(data_.size());
    convert_elements(data_.data(), data_.size(), wire_in_.data());
    return wire_in_;
  }
  std::span<bf16> arriving(std::size_t n) {
    wire_out_.resize(n);
    return wire_out_;
  }
  void end_step(const reshard_step& s) {
    if (s.kind == step_kind::all_reduce || s.kind == step_kind::reduce_scatter) {
      // The result is data_ (reduce_scatter: this rank's parts of the members)
      if (narrow_) convert_elements((s.kind == step_kind::all_reduce ? wire_in_ : wire_out_).data(), data_.size(), data_.data());
      if (s.kind == step_kind::all_reduce) return;
      const std::size_t p = std::size_t(mesh_->group(1u << s.axis).size);
      for (member& m : members_) m.size /= p;
      return;
    }
    const std::size_t p = std::size_t(mesh_->group(1u << s.axis).size), total = data_.size();
    data_.resize(total * p);
    if (narrow_) unpack(wire_out_.data(), data_.data(), p, total);
    else unpack(scratch_.data(), data_.data(), p, total);
    for (member& m : members_) m.size *= p;
  }

  const mesh_base* mesh_;
  reshard_steps plan_;
  bucket_memory<T>* memory_;
  raw_vector<T> data_, scratch_;
  bool narrow_;                          // wire::bf16 on a T that is not
  raw_vector<bf16> wire_in_, wire_out_;  // the rounded message and what arrives
  std::vector<member> members_;
  int step_ = -1;   // the step in flight; -1: none
  collective_request flight_;  // its collective (finished in ~bucket before the buffers go back)
};

// Buckets by steps: a tensor joins the bucket of its plan's steps; a bucket
// starts as soon as it holds `limit` bytes or more (so one collective may
// carry more than `limit`: a bucket holds at least one whole tensor), and a
// new one takes its place. Each time one starts, the buckets started before
// it move one step on — the next step posted, or the results handed out
// after the last — once the step in flight has finished: between two
// buckets' starts lies the compute that filled the second, so the wait is
// short when the network keeps up. detail::progress_in_flight() moves the
// steps in flight on (call it between pieces of work: it posts nothing);
// flush() starts the rest in the order their plans first came and finishes
// every bucket in the order they started. limit 0: every tensor on its own.
// The same sequence of adds and flushes on every rank gives the same
// collectives in the same order.
//
// Held (hold(bytes)): a bucket's last step is left in flight. Each time
// one starts, the buckets started before it post their next step, but not
// past their last; the oldest are finished while those in flight would
// hold more than `bytes` once gathered. start_rest() starts the rest, moves
// every bucket on to its last step and keeps the same bound. Then
// finish_holding(id) finishes the bucket holding a member `id` — a wait,
// which posts nothing, so a rank may call it where and when it needs that
// member. The sharded update's gathers travel this way while the next
// forward computes (state/weight_update.hpp). drop_open() forgets the
// buckets not started (an update that threw half-way).
template <class T>
class buckets {
 public:
  // `memory`: where the buckets' buffers come from and go back to (the
  // parameters' own, so they last from step to step); by default the
  // buckets' own. Shared: buckets left open by an exception give their
  // buffers back even when the parameters are gone.
  // `w`: what every bucket's messages carry.
  buckets(const mesh_base& m, std::size_t limit, std::shared_ptr<bucket_memory<T>> memory = nullptr, wire w = wire::same)
      : mesh_(&m), limit_(limit), wire_(w), memory_(memory ? std::move(memory) : std::make_shared<bucket_memory<T>>()) {}
  buckets(const buckets&) = delete;  // its buckets point at *memory_
  buckets& operator=(const buckets&) = delete;

  void add(const reshard_steps& plan, std::span<const T> block, typename bucket<T>::done_fn done,
           std::size_t id = bucket<T>::no_id) {
    if (!stackable(plan)) throw error("gshard::detail::buckets: a plan whose steps cannot share a bucket");
    auto it = std::find_if(open_.begin(), open_.end(), [&](const bucket<T>& b) { return same_steps(b.plan(), plan); });
    if (it == open_.end()) it = open_.emplace(open_.end(), *mesh_, plan, *memory_, wire_);
    it->add(block, std::move(done), id);
    if (it->bytes() < limit_) return;
    for (auto& b : running_)
      if (!hold_ || b.steps_left() > 1) b.advance();
    running_.remove_if([](const bucket<T>& b) { return b.empty(); });  // their buffers go back for the next ones
    it->start();
    open_.emplace(it, *mesh_, plan, *memory_, wire_);     // an empty one keeps the plan's place in flush()'s order
    running_.splice(running_.end(), open_, it);          // the list moves no bucket: its buffers stay put
    if (hold_) keep_within(1);
  }
  void flush() {
    for (auto& b : open_) b.start();
    running_.splice(running_.end(), open_);
    for (auto& b : running_) b.finish();
    running_.clear();
  }

  void hold(std::size_t bytes) {
    hold_ = true;
    hold_bytes_ = bytes;
  }
  void start_rest() {
    for (auto& b : open_) b.start();
    running_.splice(running_.end(), open_);
    for (auto& b : running_)
      while (b.steps_left() > 1) b.advance();
    keep_within(0);
  }
  // True if a bucket held a member `id` (now finished).
  bool finish_holding(std::size_t id) {
    auto it = std::find_if(running_.begin(), running_.end(), [id](const bucket<T>& b) { return b.holds(id); });
    if (it == running_.end()) return false;
    try {
      it->finish();
    } catch (...) {
      running_.erase(it);
      throw;
    }
    running_.erase(it);
    return true;
  }
  void drop_open() { open_.clear(); }

 private:
  // Finishes the oldest buckets while those in flight would hold more than
  // hold_bytes_ once gathered, leaving at least `keep`.
  void keep_within(std::size_t keep) {
    std::size_t held = 0;
    for (const auto& b : running_) held += b.gathered_bytes();
    while (held > hold_bytes_ && running_.size() > keep) {
      held -= running_.front().gathered_bytes();
      running_.front().finish();
      running_.pop_front();
    }
  }

  const mesh_base* mesh_;
  std::size_t limit_;
  wire wire_;
  bool hold_ = false;
  std::size_t hold_bytes_ = 0;
  std::shared_ptr<bucket_memory<T>> memory_;  // declared before the lists: outlives the buckets that give back to it
  std::list<bucket<T>> open_, running_;
};

}  // namespace gshard::detail

namespace gshard {

// The default size of a gradient bucket (parameters::bucket_bytes).
inline constexpr std::size_t default_bucket_bytes = std::size_t(4) << 20;
// The default bound on the gathered weights whose all_gathers travel into
// the next forward (parameters::gather_bytes_in_flight).
inline constexpr std::size_t default_gather_bytes_in_flight = std::size_t(64) << 20;

}  // namespace gshard
