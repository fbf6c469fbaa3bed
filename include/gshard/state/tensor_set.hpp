// gshard/state/tensor_set.hpp — named sharded tensors of float or double, in
// declaration order, walked without their types: a model's parameters,
// their gradients, optimizer moments and buffers. Each entry gives its
// shard's bytes, its replication and its global bytes (gathered to rank 0,
// scattered from it) — all a checkpoint, the optimizer or clipping needs.
#pragma once

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gshard/core/error.hpp"
#include "gshard/tensor/tensor.hpp"
#include "gshard/tensor/tensor_collectives.hpp"

namespace gshard {

namespace detail {

class sharded_entry;

// Ranks holding each element of a tensor of layout `l`: the product of the
// axes it neither splits nor sums over.
inline index_t replication_of(const rlayout& l, const mesh_base& m) {
  index_t r = 1;
  for (int a = 0; a < m.naxes(); ++a)
    if (l.is_free(a)) r *= m.size(a);
  return r;
}

// One named tensor of a tensor_set, seen without its type.
class set_entry {
 public:
  explicit set_entry(std::string name) : name_(std::move(name)) {}
  virtual ~set_entry() = default;
  const std::string& name() const { return name_; }

  virtual std::string notation() const = 0;
  virtual int element_bytes() const = 0;                 // 4 (float) or 8 (double)
  virtual std::vector<index_t> extents() const = 0;       // global
  virtual std::span<float> f32() = 0;                     // this rank's shard; empty unless float
  virtual std::span<double> f64() = 0;                    // this rank's shard; empty unless double
  virtual index_t replication() const = 0;                // ranks holding each element
  std::size_t local_bytes() { return f32().size_bytes() + f64().size_bytes(); }  // this rank's shard
  virtual std::string sharding_text() const = 0;
  virtual std::unique_ptr<set_entry> zeros(std::string name) const = 0;
  // The global tensor's bytes (row-major) on rank 0, nothing elsewhere: one gather.
  virtual std::vector<char> gather_to_root() const = 0;
  // Every rank takes its shard of the global bytes rank 0 holds: one scatter.
  virtual void scatter_from_root(const char* global_bytes_on_root) = 0;
  // Non-null for an entry held in a weight's update layout (see update_shard).
  virtual sharded_entry* as_sharded() { return nullptr; }

 private:
  std::string name_;
};

template <class X>
class set_entry_of final : public set_entry {
  using T = typename X::value_type;

 public:
  set_entry_of(std::string name, X value) : set_entry(std::move(name)), value_(std::move(value)) {}
  X& value() { return value_; }
  const X& value() const { return value_; }

  std::string notation() const override { return value_.notation(); }
  int element_bytes() const override { return int(sizeof(T)); }
  std::vector<index_t> extents() const override { return {value_.extents().begin(), value_.extents().end()}; }
  std::span<float> f32() override {
    if constexpr (std::is_same_v<T, float>) return {value_.data(), std::size_t(value_.local().size())};
    else return {};
  }
  std::span<double> f64() override {
    if constexpr (std::is_same_v<T, double>) return {value_.data(), std::size_t(value_.local().size())};
    else return {};
  }
  index_t replication() const override { return replication_of(X::resolved, value_.mesh()); }
  std::string sharding_text() const override { return std::string(X::sharding_type::text); }
  std::unique_ptr<set_entry> zeros(std::string name) const override {
    return std::make_unique<set_entry_of<X>>(std::move(name), X(value_.mesh(), value_.extents()));
  }
  std::vector<char> gather_to_root() const override {
    const auto g = gshard::gather_to_root(value_);
    const char* p = reinterpret_cast<const char*>(g.data());
    return {p, p + std::size_t(g.size()) * sizeof(T)};
  }
  void scatter_from_root(const char* bytes) override {
    local_tensor<T, X::rank> global;
    if (value_.mesh().rank() == 0) {
      global = local_tensor<T, X::rank>(value_.extents());
      std::memcpy(global.data(), bytes, std::size_t(global.size()) * sizeof(T));
    }
    auto t = scatter<typename X::sharding_type>(value_.mesh(), global);  // into this program's sharding
    value_.local() = std::move(t.local());
  }

 private:
  X value_;
};

}  // namespace detail

// Named sharded tensors of float or double, in the order they were added; the
// names are unique. Parameters, gradients and optimizer moments are
// tensor_sets with the same names, walked in the same order; a gradient or
// moment has its parameter's type, or is held in the parameter's update
// layout when the update is sharded (detail::update_shard).
class tensor_set {
 public:
  tensor_set() = default;
  tensor_set(tensor_set&&) = default;
  tensor_set& operator=(tensor_set&&) = default;

  // Adds `value` under `name`; throws gshard::error (on every rank: names
  // are program facts) if the name is taken.
  template <class X>
    requires sharded_tensor<X>
  X& add(std::string name, X value) {
    static_assert(std::is_same_v<typename X::value_type, float> || std::is_same_v<typename X::value_type, double>,
                  "gshard::tensor_set: the tensors are float or double (parameters, gradients, optimizer state and "
                  "checkpoints keep fp32 or f64; a bf16 tensor is a working copy of one)");
    if (index_.count(name))
      throw error("gshard::tensor_set: the name '" + name + "' is declared twice (first as " +
                  entries_[index_.at(name)]->notation() + ", now as " + value.notation() + ")");
    auto e = std::make_unique<detail::set_entry_of<X>>(name, std::move(value));
    X& ref = e->value();
    add_entry(std::move(e));
    return ref;
  }
  // Adds an entry of any kind (the name must be free).
  void add_entry(std::unique_ptr<detail::set_entry> e) {
    if (index_.count(e->name()))
      throw error("gshard::tensor_set: the name '" + e->name() + "' is declared twice (first as " +
                  entries_[index_.at(e->name())]->notation() + ", now as " + e->notation() + ")");
    index_[e->name()] = entries_.size();
    entries_.push_back(std::move(e));
  }

  std::size_t size() const { return entries_.size(); }
  // This rank's bytes of every tensor (its shards).
  std::size_t local_bytes() {
    std::size_t b = 0;
    for (auto& e : entries_) b += e->local_bytes();
    return b;
  }
  detail::set_entry& operator[](std::size_t i) { return *entries_[i]; }
  const detail::set_entry& operator[](std::size_t i) const { return *entries_[i]; }
  // The entry called `name`, or nullptr.
  detail::set_entry* find(const std::string& name) {
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : entries_[it->second].get();
  }
  auto begin() { return entries_.begin(); }
  auto end() { return entries_.end(); }

  // The same names, types and shapes, every element zero.
  tensor_set zeros_like() const {
    tensor_set z;
    for (const auto& e : entries_) {
      z.index_[e->name()] = z.entries_.size();
      z.entries_.push_back(e->zeros(e->name()));
    }
    return z;
  }

  // Typed access by position (the caller knows the type it declared). An
  // entry held in a weight's update layout (a sharded gradient or moment) is
  // not an X: refused.
  template <class X>
  X& at(std::size_t i) {
    if (entries_[i]->as_sharded())
      throw error("gshard::tensor_set::at: '" + entries_[i]->name() + "' is held in its weight's update layout " + entries_[i]->notation() +
                  ", not as the weight's type; read it through the set_entry interface (f32(), f64(), gather_to_root())");
    return static_cast<detail::set_entry_of<X>&>(*entries_[i]).value();
  }

  // Finishes whatever still writes into these tensors (a model's weights:
  // the sharded update's gathers in flight); checkpoints call it before
  // they read or write a set.
  void settle() {
    if (settle_) settle_();
  }
  void on_settle(std::function<void()> f) { settle_ = std::move(f); }

 private:
  std::vector<std::unique_ptr<detail::set_entry>> entries_;
  std::map<std::string, std::size_t> index_;
  std::function<void()> settle_;
};

// A named set of tensors to save or load: every tensor of *set, under the
// name "<prefix><its name>" (e.g. {"param.", &ps.values()}, {"adam.m.", &opt.moment1()}).
struct checkpoint_part {
  std::string prefix;
  tensor_set* set;
  // Records a file may lack: loading leaves those tensors as they are (an
  // optimizer's masters, which then follow the weights loaded).
  bool optional = false;
};

}  // namespace gshard
