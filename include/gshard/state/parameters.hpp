// gshard/state/parameters.hpp — a model's parameters, each declared once:
// name, global shape, sharding (its type) and initialiser. Everything that
// walks parameters — the tape's gradients, the optimizer, global-norm
// clipping, checkpoints, initialisation — walks this one declaration.
//   gshard::parameters ps(mesh, seed);
//   gshard::param<tensor<float, 3, Mesh, S, "MNK">> wq(ps, "block0.wq", {M, N, K}, init::normal(1 / sqrt(M)));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gshard/state/tensor_set.hpp"
#include "gshard/state/weight_update.hpp"
#include "gshard/state/buckets.hpp"
#include "gshard/core/fnv1a.hpp"
#include "gshard/layout/random.hpp"

namespace gshard {

namespace detail {
inline std::uint64_t name_hash(std::string_view s) { return fnv1a(s); }  // a parameter's stream of initial values
class update_targets;
}  // namespace detail

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

// What the optimizer, the tape's gradient reduction and checkpoints see of a
// model's parameters, without the mesh's type: the values, the gradients
// (each in the parameter's own sharding, or in its update layout when the
// update is sharded), the buffers, and how the gradients travel.
class parameters_base {
 public:
  parameters_base(const parameters_base&) = delete;
  parameters_base& operator=(const parameters_base&) = delete;

  const detail::mesh_base& mesh() const { return *mesh_; }
  std::uint64_t seed() const { return seed_; }
  std::size_t size() const { return values_.size(); }
  // The weights, each holding the last update: the sharded update's gathers
  // still in flight into them are finished first (a collective's wait: the
  // other ranks need not be here). A reference to a weight taken before an
  // update reads it as it is until its gather is finished: take it again
  // (param::value) after the update.
  tensor_set& values() {
    finish_gathers();
    return values_;
  }
  tensor_set& grads() { return grads_; }
  // State that is not trained but belongs to the model and is checkpointed
  // (e.g. the MoE router's balancing bias).
  tensor_set& buffers() { return buffers_; }
  const std::string& name(std::size_t i) const { return values_[i].name(); }
  // Whether parameter i received a gradient in the last backward.
  bool has_grad(std::size_t i) const { return has_grad_[i]; }
  void set_has_grad(std::size_t i, bool v) { has_grad_[i] = v; }

  // The mesh axes (bit a: axis a) the update of a replicated weight is
  // sharded over; 0 for the replicated update.
  std::uint32_t update_axes() const { return update_axes_; }

  // Gradients reduced together (gshard/state/buckets.hpp): the weights whose
  // reductions take the same steps share one collective per step, a bucket
  // running once it holds this many bytes (a weight larger than that goes in
  // one bucket alone); so do the sharded update's gathers. 0: one
  // collective per weight.
  std::size_t bucket_bytes() const { return bucket_bytes_; }
  void set_bucket_bytes(std::size_t bytes) { bucket_bytes_ = bytes; }
  // What the gradients' reductions carry: wire::bf16 rounds each rank's
  // gradient to bf16 once (at every rank count: 1 rank's too), adds the
  // parts in fp32 and rounds the sum once — half the bytes of fp32, each
  // gradient element within about 2⁻⁸ of the sum of its parts' magnitudes.
  // The optimizer stays in the weights' type; what the weights and their
  // gathers hold is weight_wire()'s.
  wire gradient_wire() const { return gradient_wire_; }
  void set_gradient_wire(wire w) { gradient_wire_ = w; }
  // What the weights the model computes with hold, and what the sharded
  // update's all_gathers carry (PyTorch FSDP's param_dtype): wire::bf16
  // makes each weight the bf16 rounding of an fp32 (f64 for a double
  // weight) master that the optimizer keeps, updates and checkpoints — at
  // every rank count, 1 rank's too, so 1 rank computes with the values P
  // ranks gather. The gathers carry half fp32's bytes, and updates smaller
  // than a bf16 unit add up in the master. Set it before the optimizer is
  // built: the masters are the optimizer's state.
  wire weight_wire() const { return weight_wire_; }
  void set_weight_wire(wire w) { weight_wire_ = w; }
  // The buckets' buffers, kept from step to step (the tape's gradient
  // buckets and the optimizer's gathers take theirs from here).
  template <class T>
  const std::shared_ptr<detail::bucket_memory<T>>& bucket_memory() {
    if constexpr (std::is_same_v<T, float>) return f32_bucket_memory_;
    else return f64_bucket_memory_;
  }

  // The sharded update's all_gathers of the updated blocks travel into the
  // next forward, each weight's finished where the model first reads it
  // (param::value): at most this many bytes of gathered weights at once (in
  // the weights' type; the oldest gathers beyond it finish in the update).
  // 0: every gather finishes in the update.
  std::size_t gather_bytes_in_flight() const { return gather_bytes_in_flight_; }
  void set_gather_bytes_in_flight(std::size_t bytes) { gather_bytes_in_flight_ = bytes; }
  // The weights whose gathers are still in flight.
  std::size_t weights_in_flight() const { return gathers_ ? gathers_->in_flight() : 0; }
  // Every gather still in flight into a weight, finished (a wait on each:
  // the other ranks need not be here).
  void finish_gathers() {
    if (!gathers_) return;
    const auto g = std::move(gathers_);  // gone even if a wait throws
    g->finish_all();
  }

  // The layout of parameter i's gradient: the weight's, or its update layout.
  const detail::rlayout& grad_layout(std::size_t i) const { return grad_layouts_.at(i); }
  // A factor of parameter i's gradient for a factored optimizer (Adafactor):
  // zeros of the gradient's global shape without dim `drop`, in double,
  // split as the gradient's other dims are (replicated over the axes that
  // split `drop`). Null for a parameter of rank 1.
  std::unique_ptr<detail::set_entry> zero_factor(std::size_t i, std::string name, int drop) const {
    return factor_makers_.at(i)(std::move(name), *mesh_, values_[i].extents(), grad_layouts_[i], drop);
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

 protected:
  template <class X>
  friend class param;
  friend class detail::update_targets;
  // Parameter i's weight, holding its update (its gather finished, if one is
  // in flight; no other).
  template <class X>
  X& settled(std::size_t i) {
    if (gathers_) gathers_->finish(i);
    return values_.template at<X>(i);
  }
  // The weights as they are, gathers in flight or not: the optimizer's
  // view while it starts them.
  tensor_set& values_as_held() { return values_; }
  // The gathers of one update (state/weight_update.hpp), every earlier one
  // finished: the optimizer adds each updated block, then leaves them in
  // flight (leave_in_flight). `w`: what they carry.
  detail::weight_gathers& start_gathers(wire w) {
    finish_gathers();
    gathers_ = std::make_unique<detail::weight_gathers>(*mesh_, bucket_bytes_, gather_bytes_in_flight_, f32_bucket_memory_,
                                                        f64_bucket_memory_, w, values_.size());
    return *gathers_;
  }

  parameters_base(const detail::mesh_base& m, std::uint64_t seed, std::uint32_t update_axes)
      : mesh_(&m), seed_(seed), update_axes_(update_axes) {
    values_.on_settle([this] { finish_gathers(); });  // checkpoints read and write the weights whole
  }
  ~parameters_base() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) (void)gathers_.release();  // MPI is gone: nothing can be waited for, nor needs to be
  }

  // Declares a parameter of type X and initialises it; returns its position.
  template <class X>
  std::size_t declare_value(std::string name, const typename X::extents_type& extents, initializer init) {
    static_assert(X::resolved.partial == 0, "gshard::param: a parameter cannot hold pending sums; use its reduced sharding");
    const auto& m = static_cast<const typename X::mesh_type&>(*mesh_);
    X value(m, extents);
    initialise(value, name, init);
    values_.add(name, std::move(value));
    const auto u = detail::choose_update_layout(X::resolved, X::rank, extents.data(), mesh_->sizes(), mesh_->naxes(),
                                                update_axes_);
    if (u.parts == 1) grads_.add(std::move(name), X(m, extents));
    else grads_.add_entry(std::make_unique<detail::update_shard<X>>(std::move(name), m, extents, u.layout));
    has_grad_.push_back(false);
    update_why_.push_back(u.why);
    grad_layouts_.push_back(u.layout);
    factor_makers_.push_back(&detail::zero_factor<X>);
    return values_.size() - 1;
  }
  template <class X>
  std::size_t declare_buffer_value(std::string name, const typename X::extents_type& extents, initializer init) {
    X value(static_cast<const typename X::mesh_type&>(*mesh_), extents);
    initialise(value, name, init);
    buffers_.add(std::move(name), std::move(value));
    return buffers_.size() - 1;
  }

 private:
  template <class X>
  void initialise(X& value, const std::string& name, initializer init) const {
    if (init.how == initializer::kind::normal) fill_normal(value, init.value, seed_, detail::name_hash(name));
    else value.local().setConstant(typename X::value_type(init.value));
  }

  const detail::mesh_base* mesh_;
  std::uint64_t seed_;
  std::uint32_t update_axes_ = 0;
  std::size_t bucket_bytes_ = default_bucket_bytes;
  std::size_t gather_bytes_in_flight_ = default_gather_bytes_in_flight;
  wire gradient_wire_ = wire::same;
  wire weight_wire_ = wire::same;
  std::shared_ptr<detail::bucket_memory<float>> f32_bucket_memory_ = std::make_shared<detail::bucket_memory<float>>();
  std::shared_ptr<detail::bucket_memory<double>> f64_bucket_memory_ = std::make_shared<detail::bucket_memory<double>>();
  tensor_set values_, grads_, buffers_;
  std::unique_ptr<detail::weight_gathers> gathers_;  // the last update's gathers, while any may be in flight
  std::vector<bool> has_grad_;
  std::vector<const char*> update_why_;  // per parameter: why its update is not sharded ("" if it is, or nothing asked)
  std::vector<detail::rlayout> grad_layouts_;
  std::vector<detail::factor_maker> factor_makers_;
};

// A model's parameters on one mesh of type Mesh: parameters_base with the
// declarations, which check each parameter's type against the mesh.
template <mesh_type Mesh>
class parameters : public parameters_base {
 public:
  parameters(const Mesh& m, std::uint64_t seed) : parameters_base(m, seed, 0) {}
  template <class Axes>
  parameters(const Mesh& m, std::uint64_t seed, shard_weight_update<Axes> how)
      : parameters_base(m, seed, decltype(how)::template mask<Mesh>()) {
    static_assert(decltype(how)::template mask<Mesh>() != 0,
                  "gshard::shard_weight_update: none of its axes is an axis of the parameters' mesh");
  }

  const Mesh& mesh() const { return static_cast<const Mesh&>(parameters_base::mesh()); }

  // Declares a parameter and initialises it; returns its position.
  template <class X>
    requires sharded_tensor<X>
  std::size_t declare(std::string name, const typename X::extents_type& extents, initializer init) {
    static_assert(std::is_same_v<typename X::mesh_type, Mesh>,
                  "gshard::param: the parameter's tensor type lives on another mesh type than its parameters");
    return declare_value<X>(std::move(name), extents, init);
  }

  // Declares a buffer (state the optimizer does not touch); returns its position.
  template <class X>
    requires sharded_tensor<X>
  std::size_t declare_buffer(std::string name, const typename X::extents_type& extents, initializer init) {
    static_assert(std::is_same_v<typename X::mesh_type, Mesh>,
                  "gshard::param: the parameter's tensor type lives on another mesh type than its parameters");
    return declare_buffer_value<X>(std::move(name), extents, init);
  }
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

  // The weight, holding the last update (its gather, if one is in flight,
  // finished here: the sharded update's all_gathers travel until the model
  // reads the weight).
  const X& value() const { return owner_->template settled<X>(index_); }
  X& value() { return owner_->template settled<X>(index_); }
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
    g.as_sharded()->gather_into(w, wire::same);
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
