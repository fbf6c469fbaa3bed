// gshard/state/weight_update.hpp — where a replicated weight's update runs
// when it is sharded over the batch axes (shard_weight_update; ZeRO stage 2):
// the update layout each weight gets, the block of it a rank holds
// (update_shard: gradient, moments, the weight's block), and the one way
// updated blocks return to their weights (weight_gathers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "gshard/state/buckets.hpp"
#include "gshard/tensor/execute_reshard.hpp"
#include "gshard/layout/shard_geometry.hpp"
#include "gshard/state/tensor_set.hpp"
#include "gshard/layout/notation.hpp"
#include "gshard/tensor/reshard.hpp"
#include "gshard/runtime/roles.hpp"

namespace gshard {

namespace detail {

// The layout in which the optimizer updates a weight of layout `w` when the
// update is sharded over the mesh axes `axes` (bit a: axis a): the axes of
// `axes` that `w` replicates (of size > 1) are appended, in mesh order and
// minor-most, to the first dim whose blocks they divide equally on every
// rank (dim_even: each rank's block of the update is then the same size,
// as the gradient buckets' reduce_scatters need, whatever the weight's own
// blocks). So the
// weight's gradient, pending over those axes, arrives by reduce_scatter
// instead of all_reduce, and the updated block returns by all_gather. `w`
// itself when no such axis remains or no dim divides (`why` says which).
struct update_choice {
  rlayout layout{};
  index_t parts = 1;      // ranks sharing the update of each element: the appended axes' sizes
  const char* why = "";   // when parts == 1 though `axes` named axes the weight replicates
};
constexpr update_choice choose_update_layout(const rlayout& w, int rank, const index_t* extents, const index_t* sizes,
                                             int naxes, std::uint32_t axes) {
  update_choice c{w};
  std::uint32_t take = 0;
  index_t parts = 1;
  for (int a = 0; a < naxes; ++a)
    if (((axes >> a) & 1u) && w.is_free(a) && sizes[a] > 1) take |= 1u << a, parts *= sizes[a];
  if (take == 0) return c;
  for (int d = 0; d < rank; ++d) {
    rlayout l = w;
    for (int a = 0; a < naxes; ++a)
      if ((take >> a) & 1u) l.push(d, a);
    if (!dim_even(l, d, extents[d], sizes)) continue;
    c.layout = l;
    c.parts = parts;
    return c;
  }
  c.why = "no dim's blocks divide by the ranks of the update axes";
  return c;
}

// A set entry held in a weight's update layout: the block of a gradient,
// an optimizer moment or the weight itself that this rank updates. Its
// layout is chosen when the weight is declared (its extents and the mesh's
// sizes decide the dim), so it is a run-time value; the steps between it
// and the weight's layout are planned by the same planner as every reshard.
class sharded_entry : public set_entry {
 public:
  using set_entry::set_entry;
  sharded_entry* as_sharded() override { return this; }
  virtual const rlayout& layout() const = 0;
  // This rank's block of `weight` (the entry of the same name in the
  // parameters' values): a local copy.
  virtual void slice_from(set_entry& weight) = 0;
  // The block as the fp32 master of a bf16 weight: each element kept while
  // `weight` holds its rounding through bf16, else taken from `weight`
  // (set elsewhere: initialised, loaded, written).
  virtual void follow(set_entry& weight) = 0;
  // Every rank's block into `weight`: all_gathers over the update axes,
  // carrying `w` (wire::bf16: every block, this rank's too, rounded).
  virtual void gather_into(set_entry& weight, wire w) const = 0;
  // The steps gather_into runs, from this layout to the weight's.
  virtual const reshard_steps& gather_plan() const = 0;
};

template <class X>
class update_shard final : public sharded_entry {
  using T = typename X::value_type;
  using Mesh = typename X::mesh_type;
  static constexpr int R = X::rank;

 public:
  update_shard(std::string name, const Mesh& m, const typename X::extents_type& extents, const rlayout& l)
      : sharded_entry(std::move(name)),
        mesh_(&m),
        extents_(extents),
        layout_(l),
        local_(local_extents<R>(l, extents, m)),
        to_weight_(plan_reshard(l, X::resolved, m.naxes(), m.sizes())),
        from_weight_(plan_reshard(X::resolved, l, m.naxes(), m.sizes())) {
    local_.setZero();
  }

  const rlayout& layout() const override { return layout_; }
  local_tensor<T, R>& local() { return local_; }

  std::string notation() const override {
    return detail::notation(unresolve(layout_, Mesh::names), R, dtype_name<T>(), X::labels, extents_.data());
  }
  int element_bytes() const override { return int(sizeof(T)); }
  std::vector<index_t> extents() const override { return {extents_.begin(), extents_.end()}; }
  std::span<float> f32() override {
    if constexpr (std::is_same_v<T, float>) return {local_.data(), std::size_t(local_.size())};
    else return {};
  }
  std::span<double> f64() override {
    if constexpr (std::is_same_v<T, double>) return {local_.data(), std::size_t(local_.size())};
    else return {};
  }
  index_t replication() const override { return replication_of(layout_, *mesh_); }
  std::string sharding_text() const override { return std::string(render(unresolve(layout_, Mesh::names)).view()); }
  std::unique_ptr<set_entry> zeros(std::string name) const override {
    return std::make_unique<update_shard<X>>(std::move(name), *mesh_, extents_, layout_);
  }
  std::vector<char> gather_to_root() const override {
    return set_entry_of<X>(name(), whole()).gather_to_root();
  }
  void scatter_from_root(const char* bytes) override {
    set_entry_of<X> w(name(), X(*mesh_, extents_));
    w.scatter_from_root(bytes);
    slice_from(w);
  }
  void slice_from(set_entry& weight) override {
    const auto block = block_of(weight);
    std::copy(block.data(), block.data() + block.size(), local_.data());  // into the buffer that lives from step to step
  }
  void follow(set_entry& weight) override {
    const auto block = block_of(weight);
    follow_rounded(local_.data(), block.data(), std::size_t(block.size()));
  }
  const reshard_steps& gather_plan() const override { return to_weight_; }
  void gather_into(set_entry& weight, wire on) const override {
    X& dst = weight_of(weight);
    const auto w = execute_reshard_on<T, R>(on, *mesh_, to_weight_, local_, extents_);
    std::copy(w.data(), w.data() + w.size(), dst.local().data());
  }

 private:
  X& weight_of(set_entry& e) const {
    auto* w = dynamic_cast<set_entry_of<X>*>(&e);
    if (!w || w->value().extents() != extents_)
      throw error("gshard::update_shard: '" + name() + "' is given '" + e.name() + "' " + e.notation() +
                  " as its weight; it is the block of a " + X(*mesh_, extents_).notation());
    return w->value();
  }
  local_tensor<T, R> block_of(set_entry& weight) const {  // this rank's block of the weight: a local copy
    return execute_reshard<T, R>(*mesh_, from_weight_, weight_of(weight).local(), extents_);
  }
  X whole() const { return X(*mesh_, extents_, execute_reshard<T, R>(*mesh_, to_weight_, local_, extents_)); }

  const Mesh* mesh_;
  typename X::extents_type extents_;
  rlayout layout_;
  local_tensor<T, R> local_;
  reshard_steps to_weight_, from_weight_;
};

// Zeros of the global shape of a gradient of type X without dim `drop`, in
// double, held in the gradient's layout `l` without that dim (so replicated
// over the axes that split it): a second-moment factor of a factored
// optimizer. An update_shard of a replicated tensor type, so checkpoints
// gather and scatter it as any block. Null when X has rank 1.
using factor_maker = std::unique_ptr<set_entry> (*)(std::string, const mesh_base&, const std::vector<index_t>&,
                                                     const rlayout&, int);
template <class X>
std::unique_ptr<set_entry> zero_factor(std::string name, const mesh_base& m, const std::vector<index_t>& extents,
                                       const rlayout& l, int drop) {
  constexpr int R = X::rank;
  if constexpr (R < 2) {
    return nullptr;
  } else {
    using Mesh = typename X::mesh_type;
    using Y = tensor<double, R - 1, Mesh, replicate>;
    typename Y::extents_type e{};
    rlayout f{};
    for (int d = 0, k = 0; d < R; ++d)
      if (d != drop) e[std::size_t(k)] = extents[std::size_t(d)], f.dims[k++] = l.dims[d];
    return std::make_unique<update_shard<Y>>(std::move(name), static_cast<const Mesh&>(m), e, f);
  }
}

// The one way updated blocks return to their weights: the gathers of one
// update, in buckets by element type (one collective per step for many
// weights, gshard/state/buckets.hpp; `limit` 0: one per weight), carrying
// `w`. A block whose plan cannot share a bucket (its steps do not stack, or
// its blocks differ between ranks) is gathered at once. The optimizer calls
// gather() for each updated block, every rank for the same weights in the
// same order, then leave_in_flight(): the buckets' last all_gathers are
// still travelling when the update returns — as many as hold
// `in_flight_bytes` of gathered weights; the oldest beyond that finish
// first, 0: all, in the update — and finish(i) waits for weight i's where
// the model next reads it (param::value, the tape's use of it in the next
// forward), so they travel while the layers before it compute: the
// prefetch of PyTorch FSDP's forward. The parameters finish all of them
// before their values are read as a set, and before the next update.
class weight_gathers {
 public:
  weight_gathers(const mesh_base& m, std::size_t limit, std::size_t in_flight_bytes,
                 std::shared_ptr<bucket_memory<float>> f32, std::shared_ptr<bucket_memory<double>> f64, wire w,
                 std::size_t weights)
      : mesh_(&m), wire_(w), f32_(m, limit, std::move(f32), w), f64_(m, limit, std::move(f64), w), pending_(weights, 0) {
    f32_.hold(in_flight_bytes);
    f64_.hold(in_flight_bytes);
  }
  weight_gathers(const weight_gathers&) = delete;  // its buckets' functions point at pending_
  weight_gathers& operator=(const weight_gathers&) = delete;

  // Weight i (`weight`) takes every rank's `block`.
  void gather(std::size_t i, sharded_entry& block, set_entry& weight) {
    const std::vector<index_t> extents = block.extents();
    if (!bucketable(block.gather_plan(), extents.data(), int(extents.size()), mesh_->sizes())) {
      block.gather_into(weight, wire_);
      return;
    }
    auto add = [&](auto& into, auto from, auto to) {
      using T = typename std::remove_cvref_t<decltype(to)>::value_type;
      into.add(
          block.gather_plan(), std::span<const T>(from.data(), from.size()),
          [this, i, to, &weight](std::span<const T> whole) {
            pending_[i] = 0;
            if (whole.size() != to.size())
              throw error("gshard::weight_gathers: the gathered '" + weight.name() + "' has " + std::to_string(whole.size()) +
                          " elements on this rank but the weight " + std::to_string(to.size()));
            std::copy(whole.begin(), whole.end(), to.begin());
          },
          i);
    };
    pending_.at(i) = 1;
    // By the element type: an empty block (a split that does not divide) still
    // joins its group's all_gathers.
    if (block.element_bytes() == 4) add(f32_, block.f32(), weight.f32());
    else add(f64_, block.f64(), weight.f64());
  }
  void leave_in_flight() {
    f32_.start_rest();
    f64_.start_rest();
    left_ = true;
  }
  // Weight i holds its update.
  void finish(std::size_t i) {
    if (i >= pending_.size() || !pending_[i]) return;
    if (!f32_.finish_holding(i)) f64_.finish_holding(i);
  }
  // Every weight holds its update — or, after an update that threw before
  // leave_in_flight, the gathers it started have finished and the rest are
  // forgotten (starting them here would be this rank's alone).
  void finish_all() {
    if (!left_) {
      f32_.drop_open();
      f64_.drop_open();
    }
    f32_.flush();
    f64_.flush();
  }
  // The weights whose gathers have not finished.
  std::size_t in_flight() const { return std::size_t(std::count(pending_.begin(), pending_.end(), char(1))); }

 private:
  const mesh_base* mesh_;
  wire wire_;
  buckets<float> f32_;
  buckets<double> f64_;
  std::vector<char> pending_;  // per weight: its gather has not finished
  bool left_ = false;          // leave_in_flight() has run
};

}  // namespace detail

// How the optimizer updates a weight the mesh replicates. By default every
// rank holding a copy updates all of it: its gradient is all_reduced and
// Adam's moments are whole on each. shard_weight_update<batch_axes<...>>
// shards the update over those axes (the weight-update sharding of Xu et
// al. 2020; ZeRO stage 2): each rank's gradient block arrives by
// reduce_scatter, the moments and the update live on that block, and the
// updated block returns by all_gather — the bytes of the all_reduce, the
// optimizer's memory divided by the axes' ranks. The axes are normally the
// roles' batch axes: shard_weight_update<Roles::batch>. Axes the mesh lacks
// are ignored, as in axis_roles.
template <class Axes>
struct shard_weight_update {
  static_assert(sizeof(Axes) == 0,
                "gshard::shard_weight_update: name the axes as batch_axes<\"data\", ...> (usually Roles::batch)");
};
template <fixed_string... A>
struct shard_weight_update<batch_axes<A...>> {
  template <class Mesh>
  static constexpr std::uint32_t mask() {
    std::uint32_t m = 0;
    for (int a = 0; a < Mesh::axis_count; ++a)
      if (detail::names_contain(batch_axes<A...>::names, Mesh::names[std::size_t(a)])) m |= 1u << a;
    return m;
  }
};

}  // namespace gshard
