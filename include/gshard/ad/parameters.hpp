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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/buckets.hpp"
#include "gshard/detail/execute_reshard.hpp"
#include "gshard/detail/fnv1a.hpp"
#include "gshard/detail/shard_geometry.hpp"
#include "gshard/error.hpp"
#include "gshard/notation.hpp"
#include "gshard/random.hpp"
#include "gshard/reshard.hpp"
#include "gshard/roles.hpp"
#include "gshard/tensor_collectives.hpp"

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

// The layout in which the optimizer updates a weight of layout `w` when the
// update is sharded over the mesh axes `axes` (bit a: axis a): the axes of
// `axes` that `w` replicates (of size > 1) are appended, in mesh order and
// minor-most, to the first dim whose local extent they divide. So the
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
    const index_t local = extents[d] / dim_parts(w, d, sizes);
    if (local % parts != 0) continue;
    for (int a = 0; a < naxes; ++a)
      if ((take >> a) & 1u) c.layout.push(d, a);
    c.parts = parts;
    return c;
  }
  c.why = "no dim's local extent divides by the ranks of the update axes";
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
  // Every rank's block into `weight`: all_gathers over the update axes.
  virtual void gather_into(set_entry& weight) const = 0;
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
    const auto block = execute_reshard<T, R>(*mesh_, from_weight_, weight_of(weight).local(), extents_);
    std::copy(block.data(), block.data() + block.size(), local_.data());  // into the buffer that lives from step to step
  }
  const reshard_steps& gather_plan() const override { return to_weight_; }
  void gather_into(set_entry& weight) const override {
    X& dst = weight_of(weight);
    const auto w = execute_reshard<T, R>(*mesh_, to_weight_, local_, extents_);
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
  X whole() const { return X(*mesh_, extents_, execute_reshard<T, R>(*mesh_, to_weight_, local_, extents_)); }

  const Mesh* mesh_;
  typename X::extents_type extents_;
  rlayout layout_;
  local_tensor<T, R> local_;
  reshard_steps to_weight_, from_weight_;
};

inline std::uint64_t name_hash(std::string_view s) { return fnv1a(s); }  // a parameter's stream of initial values

}  // namespace detail

// Named sharded tensors of any types, in the order they were added; the
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
    if (auto* sh = entries_[i]->as_sharded())
      throw error("gshard::tensor_set::at: '" + sh->name() + "' is held in its weight's update layout " + sh->notation() +
                  ", not as the weight's type; read it through the set_entry interface (f32(), f64(), gather_to_root())");
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

// The default size of a gradient bucket (parameters::bucket_bytes).
inline constexpr std::size_t default_bucket_bytes = std::size_t(4) << 20;

// A model's parameters on one mesh: their values and, after a tape's
// backward, their gradients (each in the parameter's own sharding, or in its
// update layout when the update is sharded).
template <mesh_type Mesh>
class parameters {
 public:
  parameters(const Mesh& m, std::uint64_t seed) : mesh_(&m), seed_(seed) {}
  template <class Axes>
  parameters(const Mesh& m, std::uint64_t seed, shard_weight_update<Axes> how)
      : mesh_(&m), seed_(seed), update_axes_(decltype(how)::template mask<Mesh>()) {
    static_assert(decltype(how)::template mask<Mesh>() != 0,
                  "gshard::shard_weight_update: none of its axes is an axis of the parameters' mesh");
  }
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
    static_assert(X::resolved.partial == 0, "gshard::param: a parameter cannot hold pending sums; use its reduced sharding");
    X value(*mesh_, extents);
    if (init.how == initializer::kind::normal) fill_normal(value, init.value, seed_, detail::name_hash(name));
    else value.local().setConstant(typename X::value_type(init.value));
    values_.add(name, std::move(value));
    const auto u = detail::choose_update_layout(X::resolved, X::rank, extents.data(), mesh_->sizes(), mesh_->naxes(),
                                                update_axes_);
    if (u.parts == 1) grads_.add(std::move(name), X(*mesh_, extents));
    else grads_.add_entry(std::make_unique<detail::update_shard<X>>(std::move(name), *mesh_, extents, u.layout));
    has_grad_.push_back(false);
    update_why_.push_back(u.why);
    return values_.size() - 1;
  }

  // The mesh axes (bit a: axis a) the update of a replicated weight is
  // sharded over; 0 for the replicated update.
  std::uint32_t update_axes() const { return update_axes_; }

  // Gradients reduced together (gshard/buckets.hpp): the weights whose
  // reductions take the same steps share one collective per step, a bucket
  // running once it holds this many bytes (a weight larger than that goes in
  // one bucket alone); so do the sharded update's gathers. 0: one
  // collective per weight.
  std::size_t bucket_bytes() const { return bucket_bytes_; }
  void set_bucket_bytes(std::size_t bytes) { bucket_bytes_ = bytes; }
  // The buckets' buffers, kept from step to step (the tape's gradient
  // buckets and Adam's gathers take theirs from here).
  template <class T>
  const std::shared_ptr<detail::bucket_memory<T>>& bucket_memory() {
    if constexpr (std::is_same_v<T, float>) return f32_bucket_memory_;
    else return f64_bucket_memory_;
  }

  // One line per parameter: its sharding, and where its update runs.
  std::string describe_update() {
    std::string out;
    for (std::size_t i = 0; i < size(); ++i) {
      out += values_[i].name() + "  " + values_[i].notation();
      if (auto* sh = grads_[i].as_sharded()) {
        out += "  update " + sh->notation() + ": gradient reduced onto it, weight all_gathered from it\n";
        continue;
      }
      const char* why = update_why_[i];
      out += why[0] ? std::string("  update replicated: ") + why + "\n" : "  update as the weight\n";
    }
    return out;
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
  std::uint32_t update_axes_ = 0;
  std::size_t bucket_bytes_ = default_bucket_bytes;
  std::shared_ptr<detail::bucket_memory<float>> f32_bucket_memory_ = std::make_shared<detail::bucket_memory<float>>();
  std::shared_ptr<detail::bucket_memory<double>> f64_bucket_memory_ = std::make_shared<detail::bucket_memory<double>>();
  tensor_set values_, grads_, buffers_;
  std::vector<bool> has_grad_;
  std::vector<const char*> update_why_;  // per parameter: why its update is not sharded ("" if it is, or nothing asked)
};

template <mesh_type Mesh>
parameters(const Mesh&, std::uint64_t) -> parameters<Mesh>;
template <mesh_type Mesh, class Axes>
parameters(const Mesh&, std::uint64_t, shard_weight_update<Axes>) -> parameters<Mesh>;

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
  // The gradient of the last backward, in the parameter's sharding (zeros if
  // it received none). Under shard_weight_update a replicated weight's
  // gradient exists only as blocks: grad() throws; gathered_grad() all_gathers
  // it — a collective: every rank calls it, or none.
  const X& grad() const {
    if (auto* sh = owner_->grads()[index_].as_sharded())
      throw error("gshard::param::grad: '" + name() + "' has its gradient only as this rank's block " + sh->notation() +
                  " (the parameters shard the weight update); use gathered_grad()");
    return owner_->grads().template at<X>(index_);
  }
  X gathered_grad() const {
    auto& g = owner_->grads()[index_];
    if (!g.as_sharded()) return owner_->grads().template at<X>(index_);
    X whole(value().mesh(), value().extents());
    detail::set_entry_of<X> w(name(), std::move(whole));
    g.as_sharded()->gather_into(w);
    return std::move(w.value());
  }
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
