// gshard/buckets.hpp — one reshard plan run on many tensors at once: their
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
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gshard/collectives.hpp"
#include "gshard/error.hpp"
#include "gshard/mesh.hpp"
#include "gshard/reshard_steps.hpp"

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

// The same steps (kind, axes, dims), whatever the layouts between them: a
// bucket's members may differ in rank and in their other dims.
constexpr bool same_steps(const reshard_steps& a, const reshard_steps& b) {
  if (a.n != b.n) return false;
  for (int i = 0; i < a.n; ++i)
    if (!(a.step[i] == b.step[i])) return false;
  return true;
}

// Buffers kept from step to step: each bucket takes its two from here and
// gives them back when it is destroyed, so a step's buckets reuse the last
// step's memory instead of the heap's (fresh pages cost ~10 us per 4 KiB on
// these machines, and the heap does not fragment around buffers that come
// and go). Owned by `parameters`, one per element type.
template <class T>
class bucket_memory {
 public:
  std::vector<T> take() {
    if (free_.empty()) return {};
    std::vector<T> v = std::move(free_.back());
    free_.pop_back();
    v.clear();
    return v;
  }
  void give(std::vector<T>&& v) {
    if (v.capacity() > 0) free_.push_back(std::move(v));
  }

 private:
  std::vector<std::vector<T>> free_;
};

// Tensors waiting to take one stackable plan together. Each member gives
// its block (moved in) and a function that receives its result.
template <class T>
class bucket {
 public:
  using done_fn = std::function<void(std::span<const T>)>;

  bucket(const mesh_base& m, const reshard_steps& plan, bucket_memory<T>& memory)
      : mesh_(&m), plan_(plan), memory_(&memory), data_(memory.take()), scratch_(memory.take()) {}
  bucket(bucket&&) noexcept = default;
  bucket& operator=(bucket&&) = delete;  // would drop its own buffers instead of giving them back
  ~bucket() {
    memory_->give(std::move(data_));
    memory_->give(std::move(scratch_));
  }

  const reshard_steps& plan() const { return plan_; }
  std::size_t bytes() const { return data_.size() * sizeof(T); }
  bool empty() const { return members_.empty(); }

  void add(std::span<const T> block, done_fn done) {
    // Each rank's part of a member must be whole: a reduce_scatter's group
    // divides its block (the layouts that plan it are divisible).
    std::size_t parts = 1;
    for (int i = 0; i < plan_.n; ++i)
      if (plan_.step[i].kind == step_kind::reduce_scatter) parts *= std::size_t(mesh_->group(1u << plan_.step[i].axis).size);
    if (block.size() % parts != 0)
      throw error("gshard::detail::bucket: a block of " + std::to_string(block.size()) + " elements does not split into the " +
                  std::to_string(parts) + " parts its reduce_scatters make");
    members_.push_back({block.size(), std::move(done)});
    data_.insert(data_.end(), block.begin(), block.end());
  }

  // Runs the plan's steps on every member, one collective per step, and
  // hands each member its result. The bucket is empty afterwards.
  void run() {
    if (members_.empty()) return;
    for (int i = 0; i < plan_.n; ++i) step(plan_.step[i]);
    std::size_t at = 0;
    for (auto& m : members_) {
      m.done(std::span<const T>(data_.data() + at, m.size));
      at += m.size;
    }
    members_.clear();
    data_.clear();
  }

 private:
  struct member {
    std::size_t size;  // its elements in data_, now
    done_fn done;
  };

  void step(const reshard_step& s) {
    if (s.kind == step_kind::all_reduce) {  // partial{x} |-> replicated on x, in place
      all_reduce<T>(mesh_->group(s.mask), std::span<T>(data_));
      return;
    }
    const axis_group& g = mesh_->group(1u << s.axis);
    const std::size_t p = std::size_t(g.size);
    if (s.kind == step_kind::reduce_scatter) {  // partial{x} |-> dim 0 split by x
      // Pack: rank j's part of every member, member after member.
      scratch_.resize(data_.size());
      std::size_t out = 0;
      for (std::size_t j = 0; j < p; ++j) {
        std::size_t at = 0;
        for (const member& m : members_) {
          const std::size_t part = m.size / p;
          std::copy_n(data_.data() + at + j * part, part, scratch_.data() + out);
          out += part;
          at += m.size;
        }
      }
      data_.resize(data_.size() / p);
      reduce_scatter<T>(g, scratch_, data_);  // Communicate: this rank's parts, member after member
      for (member& m : members_) m.size /= p;
      return;
    }
    // all_gather: dim 0 split by x |-> replicated on x
    scratch_.resize(data_.size() * p);
    all_gather<T>(g, data_, scratch_);  // Communicate: every rank's blocks, rank after rank
    const std::size_t total = data_.size();
    data_.resize(total * p);
    std::size_t out = 0, at = 0;  // Unpack: each member's blocks in rank order
    for (member& m : members_) {
      for (std::size_t j = 0; j < p; ++j) {
        std::copy_n(scratch_.data() + j * total + at, m.size, data_.data() + out);
        out += m.size;
      }
      at += m.size;
      m.size *= p;
    }
  }

  const mesh_base* mesh_;
  reshard_steps plan_;
  bucket_memory<T>* memory_;
  std::vector<T> data_, scratch_;
  std::vector<member> members_;
};

// Buckets by steps: a tensor joins the bucket of its plan's steps; a bucket runs
// as soon as it holds `limit` bytes or more (so one collective may carry
// more than `limit`: a bucket holds at least one whole tensor), and flush()
// runs the rest in the order their plans first came. limit 0: every tensor
// on its own. The same sequence of adds on every rank gives the same
// collectives.
template <class T>
class buckets {
 public:
  // `memory`: where the buckets' buffers come from and go back to (the
  // parameters' own, so they last from step to step); by default the
  // buckets' own. Shared: buckets left open by an exception give their
  // buffers back even when the parameters are gone.
  buckets(const mesh_base& m, std::size_t limit, std::shared_ptr<bucket_memory<T>> memory = nullptr)
      : mesh_(&m), limit_(limit), memory_(memory ? std::move(memory) : std::make_shared<bucket_memory<T>>()) {}
  buckets(const buckets&) = delete;  // its buckets point at *memory_
  buckets& operator=(const buckets&) = delete;

  void add(const reshard_steps& plan, std::span<const T> block, typename bucket<T>::done_fn done) {
    if (!stackable(plan)) throw error("gshard::detail::buckets: a plan whose steps cannot share a bucket");
    bucket<T>* b = nullptr;
    for (auto& x : open_)
      if (same_steps(x.plan(), plan)) b = &x;
    if (!b) b = &open_.emplace_back(*mesh_, plan, *memory_);
    b->add(block, std::move(done));
    if (b->bytes() >= limit_) b->run();
  }
  void flush() {
    for (auto& b : open_) b.run();
    open_.clear();
  }

 private:
  const mesh_base* mesh_;
  std::size_t limit_;
  std::shared_ptr<bucket_memory<T>> memory_;  // declared before open_: outlives the buckets that give back to it
  std::vector<bucket<T>> open_;
};

}  // namespace gshard::detail
