// gshard/ad/parameters.hpp — a model's parameters, each declared once: name,
// global shape, sharding (its type) and initialiser. Everything that walks
// parameters — the tape's gradients, the optimizer, global-norm clipping,
// checkpoints, initialisation — walks this one declaration, so a weight can
// be neither forgotten by one of them nor trained without being declared.
//
//   gshard::parameters ps(mesh, seed);
//   gshard::param<tensor<float, 3, Mesh, S, "MNK">> wq(ps, "block0.wq", {M, N, K}, init::normal(1 / sqrt(M)));
//
// tensor_set is the walkable part: named sharded tensors of any types, in
// declaration order (parameters, their gradients, optimizer moments).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/detail/fnv1a.hpp"
#include "gshard/error.hpp"
#include "gshard/random.hpp"
#include "gshard/reshard.hpp"

namespace gshard {

namespace detail {

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
  virtual std::string sharding_text() const = 0;
  virtual std::unique_ptr<set_entry> zeros(std::string name) const = 0;
  // The global tensor's bytes (row-major) on rank 0, nothing elsewhere: one gather.
  virtual std::vector<char> gather_to_root() const = 0;
  // Every rank takes its shard of the global bytes rank 0 holds: one scatter.
  virtual void scatter_from_root(const char* global_bytes_on_root) = 0;

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
  index_t replication() const override {
    index_t r = 1;
    for (int a = 0; a < value_.mesh().naxes(); ++a)
      if (X::layout.is_free(a)) r *= value_.mesh().size(a);
    return r;
  }
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

inline std::uint64_t name_hash(std::string_view s) { return fnv1a(s); }  // a parameter's stream of initial values

}  // namespace detail

// Named sharded tensors of any types, in the order they were added; the
// names are unique. Parameters, gradients and optimizer moments are
// tensor_sets with the same names and types, walked in the same order.
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
    if (index_.count(name))
      throw error("gshard::tensor_set: the name '" + name + "' is declared twice (first as " +
                  entries_[index_.at(name)]->notation() + ", now as " + value.notation() + ")");
    index_[name] = entries_.size();
    auto e = std::make_unique<detail::set_entry_of<X>>(name, std::move(value));
    X& ref = e->value();
    entries_.push_back(std::move(e));
    return ref;
  }

  std::size_t size() const { return entries_.size(); }
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

  // Typed access by position (the caller knows the type it declared).
  template <class X>
  X& at(std::size_t i) {
    return static_cast<detail::set_entry_of<X>&>(*entries_[i]).value();
  }

 private:
  std::vector<std::unique_ptr<detail::set_entry>> entries_;
  std::map<std::string, std::size_t> index_;
};

// How a parameter starts: normal(stddev) draws from a stream keyed by the
// parameters' seed and the parameter's name, element by element of the
// global tensor, so every rank count starts from the same weights.
struct initializer {
  enum class kind : std::uint8_t { normal, constant } how = kind::normal;
  double value = 1.0;  // the standard deviation, or the constant

  static initializer normal(double stddev) { return {kind::normal, stddev}; }
  static initializer constant(double v) { return {kind::constant, v}; }
  static initializer zeros() { return {kind::constant, 0.0}; }
};
namespace init {
inline initializer normal(double stddev) { return initializer::normal(stddev); }
inline initializer constant(double v) { return initializer::constant(v); }
inline initializer zeros() { return initializer::zeros(); }
inline initializer ones() { return initializer::constant(1.0); }
}  // namespace init

template <class X>
class param;

// A model's parameters on one mesh: their values and, after a tape's
// backward, their gradients (each in the parameter's own sharding).
template <mesh_type Mesh>
class parameters {
 public:
  parameters(const Mesh& m, std::uint64_t seed) : mesh_(&m), seed_(seed) {}
  parameters(const parameters&) = delete;
  parameters& operator=(const parameters&) = delete;

  const Mesh& mesh() const { return *mesh_; }
  std::uint64_t seed() const { return seed_; }
  std::size_t size() const { return values_.size(); }
  tensor_set& values() { return values_; }
  tensor_set& grads() { return grads_; }
  // State that is not trained but belongs to the model and is checkpointed
  // (e.g. the MoE router's balancing bias).
  tensor_set& buffers() { return buffers_; }
  const std::string& name(std::size_t i) const { return values_[i].name(); }
  // Whether parameter i received a gradient in the last backward.
  bool has_grad(std::size_t i) const { return has_grad_[i]; }
  void set_has_grad(std::size_t i, bool v) { has_grad_[i] = v; }

  // Declares a parameter and initialises it; returns its position.
  template <class X>
    requires sharded_tensor<X>
  std::size_t declare(std::string name, const typename X::extents_type& extents, initializer init) {
    static_assert(std::is_same_v<typename X::mesh_type, Mesh>,
                  "gshard::param: the parameter's tensor type lives on another mesh type than its parameters");
    static_assert(X::layout.partial == 0, "gshard::param: a parameter cannot hold pending sums; use its reduced sharding");
    X value(*mesh_, extents);
    if (init.how == initializer::kind::normal) fill_normal(value, init.value, seed_, detail::name_hash(name));
    else value.local().setConstant(typename X::value_type(init.value));
    X zero(*mesh_, extents);
    values_.add(name, std::move(value));
    grads_.add(std::move(name), std::move(zero));
    has_grad_.push_back(false);
    return values_.size() - 1;
  }

  // Declares a buffer (state the optimizer does not touch); returns its position.
  template <class X>
    requires sharded_tensor<X>
  std::size_t declare_buffer(std::string name, const typename X::extents_type& extents, initializer init) {
    static_assert(std::is_same_v<typename X::mesh_type, Mesh>,
                  "gshard::param: the parameter's tensor type lives on another mesh type than its parameters");
    X value(*mesh_, extents);
    if (init.how == initializer::kind::normal) fill_normal(value, init.value, seed_, detail::name_hash(name));
    else value.local().setConstant(typename X::value_type(init.value));
    buffers_.add(std::move(name), std::move(value));
    return buffers_.size() - 1;
  }

 private:
  const Mesh* mesh_;
  std::uint64_t seed_;
  tensor_set values_, grads_, buffers_;
  std::vector<bool> has_grad_;
};

template <mesh_type Mesh>
parameters(const Mesh&, std::uint64_t) -> parameters<Mesh>;

// A declared parameter of tensor type X: a handle into its parameters. A
// model holds these as members, each constructed (so declared) once:
//   param<tensor<float, 2, Mesh, replicate, "ME">> gate;
//   gate(ps, "block1.gate", {M, E}, init::normal(1 / std::sqrt(M)))
template <class X>
class param {
 public:
  using tensor_type = X;
  using value_type = typename X::value_type;
  using mesh_type = typename X::mesh_type;
  using sharding_type = typename X::sharding_type;
  static constexpr int rank = X::rank;
  static constexpr auto label_string = X::label_string;
  static constexpr std::string_view labels = X::labels;

  template <class M>
  param(parameters<M>& ps, std::string name, const typename X::extents_type& extents, initializer init)
      : owner_(&ps), index_(ps.template declare<X>(std::move(name), extents, init)) {}

  const X& value() const { return owner_->values().template at<X>(index_); }
  X& value() { return owner_->values().template at<X>(index_); }
  // The gradient of the last backward, in the parameter's sharding (zeros if it received none).
  const X& grad() const { return owner_->grads().template at<X>(index_); }
  const std::string& name() const { return owner_->name(index_); }
  std::size_t index() const { return index_; }
  const parameters<mesh_type>* owner() const { return owner_; }

 private:
  parameters<mesh_type>* owner_;
  std::size_t index_;
};

// A declared buffer of tensor type X: state of a model that checkpoints carry
// and the optimizer does not touch.
template <class X>
class buffer {
 public:
  using tensor_type = X;
  template <class M>
  buffer(parameters<M>& ps, std::string name, const typename X::extents_type& extents, initializer init)
      : set_(&ps.buffers()), index_(ps.template declare_buffer<X>(std::move(name), extents, init)) {}
  X& value() const { return set_->template at<X>(index_); }
  const std::string& name() const { return (*set_)[index_].name(); }

 private:
  tensor_set* set_;
  std::size_t index_;
};

namespace detail {
template <class P>
struct is_param : std::false_type {};
template <class X>
struct is_param<param<X>> : std::true_type {};
}  // namespace detail

}  // namespace gshard
