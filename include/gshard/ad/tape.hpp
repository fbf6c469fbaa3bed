// gshard/ad/tape.hpp — reverse-mode differentiation over sharded tensors.
// A forward run on a tape records, per operation, a closure holding what its
// gradient rule reads; backward(loss) runs them in reverse and leaves every
// parameter's gradient in the parameter's own sharding (or its update
// layout, under shard_weight_update). The shardings are types, so each
// closure's gradient einsums are planned at compile time like the forward's;
// the tape only orders the closures: every collective it runs is a planner's.
//   tape t(ps);  auto l = model.loss(t, x, y);  t.backward(l);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <utility>
#include <vector>

#include "gshard/state/parameters.hpp"
#include "gshard/ad/var.hpp"
#include "gshard/state/buckets.hpp"
#include "gshard/tensor/einsum_backward.hpp"
#include "gshard/tensor/reshard.hpp"
#include "gshard/runtime/trace.hpp"

namespace gshard {

namespace detail {

struct grad_slot_base {
  virtual ~grad_slot_base() = default;
};

// The layout a contribution of sharding C is kept in while pending, for a
// value whose gradient sharding is G: G's dims, and C's pending sums on the
// axes G does not split (those on axes G splits are reduce_scattered now).
template <class Mesh, int R, class C, class G>
struct pending_layout {
  static constexpr rlayout value = [] {
    rlayout l = bind_layout<Mesh, R, G>::value;
    l.partial = bind_layout<Mesh, R, C>::value.partial & ~l.split_mask();
    return l;
  }();
  static constexpr sharding_spec spec = unresolve(value, Mesh::names);
  using type = GSHARD_SHARDING_OF(spec);
};

// The gradient of one value of type tensor<T, R, Mesh, S>, G = gradient_sharding<S>
// (S without pending sums). Contributions arrive as the rules produce them,
// often still pending (the gradient of a replicated weight used with
// batch-split activations is partial over the batch axes), and are added
// while pending; the slot is reduced once, by the planner's collective for
// its layout, when the gradient is taken: into the parameter's sharding (an
// all_reduce over the batch axes) or its update layout (reduce_scatters).
// So a weight used three times costs one reduction.
template <class T, int R, class Mesh, class G>
class grad_slot final : public grad_slot_base {
 public:
  static constexpr rlayout target = bind_layout<Mesh, R, G>::value;

  grad_slot(const Mesh& m, const shape<R>& extents) : mesh_(&m), extents_(extents) {}

  bool empty() const { return !acc_.has_value(); }
  const Mesh& mesh() const { return *mesh_; }
  std::uint32_t pending() const { return pending_; }

  // Adds a contribution of any sharding with the value's extents.
  template <class C, fixed_string L>
  void add(tensor<T, R, Mesh, C, L>&& c) {
    if (c.extents() != extents_)
      throw shape_error("gshard::tape: a gradient contribution " + c.notation() + " does not have the extents of its value " +
                        extents_string(extents_));
    using P = typename pending_layout<Mesh, R, C, G>::type;
    auto p = reshard<P>(std::move(c));  // local unless C splits dims G does not (their gradient gathers)
    const std::uint32_t mask = pending_layout<Mesh, R, C, G>::value.partial;
    if (!acc_) {
      acc_ = std::move(p.local());
      pending_ = mask;
      return;
    }
    // A value replicated over axis a is, as a sum over a, the value on
    // coordinate 0 and zeros elsewhere: that brings both to one set of axes.
    auto zero_unless_first = [&](local_tensor<T, R>& t, std::uint32_t axes) {
      for (int a = 0; a < mesh_->naxes(); ++a)
        if (((axes >> a) & 1u) && mesh_->coord(a) != 0) {
          t.setZero();
          return;
        }
    };
    zero_unless_first(*acc_, mask & ~pending_);
    zero_unless_first(p.local(), pending_ & ~mask);
    pending_ |= mask;
    *acc_ += p.local();
  }

  // The sum of the contributions in layout `to` (reduced by the planner's
  // steps from the pending layout), or nothing if none arrived. The slot is
  // empty afterwards.
  // With wire::bf16 its messages carry bf16 (reshard's `wire`).
  std::optional<local_tensor<T, R>> take(const rlayout& to, wire w = wire::same) {
    auto p = take_pending();
    if (!p) return std::nullopt;
    const reshard_steps plan = plan_reshard(p->second, to, mesh_->naxes(), mesh_->sizes());
    return execute_reshard_on<T, R>(w, *mesh_, plan, std::move(p->first), extents_);
  }
  // The sum of the contributions as they are, still pending (its layout:
  // the value's gradient sharding with the pending axes), or nothing if
  // none arrived. The slot is empty afterwards.
  std::optional<std::pair<local_tensor<T, R>, rlayout>> take_pending() {
    if (!acc_) return std::nullopt;
    rlayout from = target;
    from.partial = pending_;
    std::pair<local_tensor<T, R>, rlayout> out{std::move(*acc_), from};
    acc_.reset();
    pending_ = 0;
    return out;
  }
  template <class S>
  std::optional<tensor<T, R, Mesh, S>> take(wire w = wire::same) {
    auto t = take(bind_layout<Mesh, R, S>::value, w);
    if (!t) return std::nullopt;
    return tensor<T, R, Mesh, S>(*mesh_, extents_, std::move(*t));
  }

 private:
  const Mesh* mesh_;
  shape<R> extents_;
  std::optional<local_tensor<T, R>> acc_;
  std::uint32_t pending_ = 0;
};

template <class X>
using slot_of = grad_slot<typename X::value_type, X::rank, typename X::mesh_type,
                          gradient_sharding<typename X::sharding_type>>;

}  // namespace detail

// The recording of one forward. tape(ps) records; tape(ps, tape::no_grad)
// runs the same model code without recording anything (evaluation,
// sampling). One backward per tape. Rematerialisation (gshard/ad/remat.hpp)
// runs a function's forward once with nothing recorded (suspended) and again
// in the backward (recomputing); state updates go through after_step().
class tape {
 public:
  struct no_grad_t {};
  static constexpr no_grad_t no_grad{};

  template <mesh_type Mesh>
  explicit tape(parameters<Mesh>& ps) : params_(&ps), recording_(true), reset_grads_(reset_grads(ps)) {
    reserve();
  }
  template <mesh_type Mesh>
  tape(parameters<Mesh>& ps, no_grad_t) : params_(&ps), recording_(false) {}
  tape(const tape&) = delete;
  tape& operator=(const tape&) = delete;
  ~tape() { run_after_step(); }

  // A training forward: its ops record their rules (also while a
  // rematerialised function runs unrecorded, and while it is recomputed).
  bool recording() const { return recording_; }
  // True while a rematerialised function's forward runs again in the
  // backward: code with side effects (trace counters, statistics) skips them.
  bool recomputing() const { return recomputing_ > 0; }

  // A state update of this training step (the router bias of bias
  // balancing): it runs when the step's tape ends — after its backward, or
  // when the tape is destroyed without one — so every forward of the step,
  // a recomputed one too, sees the state as the step began. Ignored while
  // recomputing (the first forward registered it). Runs nothing collective.
  void after_step(std::function<void()> update) {
    if (recomputing()) return;
    after_step_.push_back(std::move(update));
  }

  // A value that receives no gradient (inputs, masks).
  template <class X>
    requires sharded_tensor<X>
  var<std::remove_cvref_t<X>> constant(X&& x) {
    return {*this, std::make_shared<std::remove_cvref_t<X>>(std::forward<X>(x)), -1};
  }
  // The same without a copy, for a tensor that outlives the tape and does
  // not change while it lives (a model's table of positions, say).
  template <class X>
    requires sharded_tensor<X>
  var<X> constant_ref(const X& x) {
    return {*this, std::shared_ptr<const X>(std::shared_ptr<void>(), &x), -1};
  }

  // A declared parameter as a value on this tape; its gradient is collected
  // over every use and reduced once, into the parameter's sharding (or its
  // update layout).
  template <class X>
  var<X> use(const param<X>& p) {
    if (static_cast<const void*>(p.owner()) != params_)
      throw error("gshard::tape: parameter '" + p.name() + "' " + p.value().notation() +
                  " is declared in another gshard::parameters than this tape's; declare it in the model's parameters");
    std::shared_ptr<const X> view(std::shared_ptr<void>(), &p.value());  // the parameters own it
    if (!recording_) return {*this, std::move(view), -1};
    // Rules recorded from here on may use it (a rematerialised function's
    // first, unrecorded, pass counts: its recomputation runs in the rule
    // recorded after it): once the backward has run them, its gradient is
    // complete.
    const std::size_t first = param_first_.try_emplace(p.index(), recomputing_ ? running_rule_ : rules_.size()).first->second;
    if (suspended_ > 0) return {*this, std::move(view), -1};
    const auto it = param_slots_.find(p.index());
    if (it != param_slots_.end()) return {*this, std::move(view), it->second};
    const int id = new_slot<X>(p.value().mesh(), p.value().extents());
    param_slots_[p.index()] = id;
    finish_.push_back({first, [this, id, p] {
      using T = typename X::value_type;
      auto& ps = *const_cast<parameters<typename X::mesh_type>*>(p.owner());
      std::optional<trace::span> span;
      if (trace::enabled()) span.emplace("gradient " + p.name(), "backward");
      // The one reduction of its contributions: into the parameter's
      // sharding, or (a sharded weight update) into its update layout; in a
      // bucket with other weights' when their steps are the same.
      auto* shard = ps.grads()[p.index()].as_sharded();
      auto pending = slot<X>(id).take_pending();
      if (!pending) return;
      const auto& m = p.value().mesh();
      const detail::reshard_steps plan = detail::plan_reshard(pending->second, shard ? shard->layout() : X::resolved, m.naxes(), m.sizes());
      // Copied into the gradient's own buffer, not moved: a buffer that lives
      // from step to step stays where it is, so the heap does not fragment
      // around it (moving it made the heap grow every few steps).
      auto& dst = shard ? static_cast<detail::update_shard<X>*>(shard)->local() : ps.grads().template at<X>(p.index()).local();
      auto done = [&ps, &dst, i = p.index()](std::span<const T> g) {
        if (std::size_t(dst.size()) != g.size())
          throw error("gshard::tape: the gradient of '" + ps.name(i) + "' has " + std::to_string(g.size()) +
                      " elements on this rank but its buffer " + std::to_string(dst.size()));
        std::copy(g.begin(), g.end(), dst.data());
        ps.set_has_grad(i, true);
      };
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        if (ps.bucket_bytes() > 0 && detail::bucketable(plan, p.value().extents().data(), X::rank, m.sizes())) {
          gradient_buckets<T>(m, ps.bucket_bytes(), ps.template bucket_memory<T>(), ps.gradient_wire()).add(
              plan, std::span<const T>(pending->first.data(), std::size_t(pending->first.size())), done);
          return;
        }
      }
      const auto g = detail::execute_reshard_on<T, X::rank>(ps.gradient_wire(), m, plan, std::move(pending->first), p.value().extents());
      done(std::span<const T>(g.data(), std::size_t(g.size())));
    }});
    return {*this, std::move(view), id};
  }

  // The output of an operation: tracked when the tape records and an input is.
  template <class X>
  var<X> output(X value, bool any_input_tracked) {
    const int id = output_slot<X>(value, any_input_tracked);
    return {*this, std::make_shared<X>(std::move(value)), id};  // not const: take_value may move it
  }
  // The same for an fp32 output held in bf16 (`value`): a var<X> for X the
  // fp32 tensor type, whose value() widens `value` if someone reads it.
  template <class X16>
    requires std::is_same_v<typename X16::value_type, bf16>
  var<with_element<X16, float>> output_held(X16 value, bool any_input_tracked) {
    using X = with_element<X16, float>;
    const int id = output_slot<X>(value, any_input_tracked);
    return {*this, std::shared_ptr<const X16>(std::make_shared<X16>(std::move(value))), id};  // not const: take_held may move it
  }

  // A gradient rule, run once during the backward (after every rule recorded
  // later), with the matmul_precision its forward ran with.
  void record(std::function<void()> rule) {
    recording_into_->push_back({std::move(rule), current_matmul_precision()});
  }

  // A value made from a tensor of this tape, made once however many
  // operations ask for it (the bf16 copy that the q, k and v projections
  // of one input each multiply, or every use of a weight): make(x) the
  // first time, then the same value — while both x and that value live,
  // or, for a view that owns nothing (a parameter's, constant_ref's: a
  // tensor that outlives the tape unchanged), until the backward ends.
  // Keyed by x's address and Y.
  template <class Y, class X, class Make>
  std::shared_ptr<const Y> derived(const std::shared_ptr<const X>& x, Make&& make) {
    derived_entry& e = derived_[{static_cast<const void*>(x.get()), std::type_index(typeid(Y))}];
    const std::shared_ptr<const void> no_owner;
    const bool view = !x.owner_before(no_owner) && !no_owner.owner_before(x);
    if (view && e.held) return std::static_pointer_cast<const Y>(e.held);
    if (!view)
      if (const auto of = e.of.lock(); of && of.get() == x.get())
        if (auto y = e.value.lock()) return std::static_pointer_cast<const Y>(std::move(y));
    auto y = std::make_shared<const Y>(make(*x));
    e = {x, y, view ? y : nullptr};
    return y;
  }

  template <class X>
  detail::slot_of<X>& slot(int id) {
    return static_cast<detail::slot_of<X>&>(*slots_[std::size_t(id)]);
  }
  template <class X, class C, fixed_string L>
  void add(const var<X>& v, tensor<typename X::value_type, X::rank, typename X::mesh_type, C, L>&& g) {
    if (v.tracked()) slot<X>(v.slot()).add(std::move(g));
  }

  // Runs every rule in reverse from d(loss)/d(loss) = 1 and sets each
  // parameter's gradient (zeros, and has_grad false, for those the loss does
  // not depend on). `loss` is a scalar (rank 0), reduced or pending.
  template <class L>
  void backward(const var<L>& loss) {
    static_assert(L::rank == 0, "gshard::tape: backward starts from a scalar loss (a rank-0 tensor)");
    if (!recording_) throw error("gshard::tape::backward: this tape does not record (it was made with tape::no_grad)");
    if (done_) throw error("gshard::tape::backward: this tape's backward has run; record a new forward on a new tape");
    done_ = true;
    trace::span s("backward", "model");
    if (loss.tracked()) {
      using G = gradient_sharding<typename L::sharding_type>;
      tensor<typename L::value_type, 0, typename L::mesh_type, G> one(loss.mesh(), {});
      one.local()() = typename L::value_type(1);
      slot<L>(loss.slot()).add(std::move(one));
    }
    reset_grads_(false);
    // Each parameter's gradient is reduced as soon as it is complete — when
    // every rule recorded after its first use has run — not at the end: its
    // slot holds the whole contribution only from its last use in the forward
    // to its first, and its collective runs between the backward's others (in
    // the same order on every rank). Weights whose reductions take the same
    // steps share a bucket (gshard/state/buckets.hpp: one collective per step for
    // up to parameters::bucket_bytes() of them), started non-blocking when
    // full and moved on between rules, so it travels while the backward
    // computes; the last buckets start at the end, and all finish before
    // backward returns.
    for (std::size_t i = rules_.size(); i-- > 0;) {
      finish_complete(i + 1);
      running_rule_ = i;
      rules_[i].run();
      // Started collectives (the buckets', a reshard's in flight) move on
      // only inside MPI calls: a test between rules keeps them moving while
      // the next rule computes.
      detail::progress_in_flight();
    }
    rules_.clear();
    derived_.clear();
    finish_complete(0);
    if (float_buckets_) float_buckets_->flush();
    if (double_buckets_) double_buckets_->flush();
    finish_.clear();
    reset_grads_(true);
    run_after_step();
  }

 private:
  template <class F, class... X>
  friend auto remat(F f, const var<X>&... inputs);

  template <class T>
  detail::buckets<T>& gradient_buckets(const detail::mesh_base& m, std::size_t limit,
                                      const std::shared_ptr<detail::bucket_memory<T>>& memory, wire w) {
    auto& b = [&]() -> std::optional<detail::buckets<T>>& {
      if constexpr (std::is_same_v<T, float>) return float_buckets_;
      else return double_buckets_;
    }();
    if (!b) b.emplace(m, limit, memory, w);
    return *b;
  }

  // Reduces the gradients of the parameters first used at rule `from` or
  // later, latest first use first: those completing together (a
  // rematerialised block's) in the reverse of their use, as the rest
  // complete one by one.
  void finish_complete(std::size_t from) {
    for (auto it = finish_.rbegin(); it != finish_.rend(); ++it)
      if (auto& f = *it; f.reduce && f.first_rule >= from) {
        auto reduce = std::move(f.reduce);
        f.reduce = nullptr;
        reduce();
      }
  }

  void run_after_step() {
    auto updates = std::move(after_step_);
    after_step_.clear();
    for (auto& u : updates) u();
  }

  // A var that shares v's tensor and gets a slot of its own: a
  // rematerialised function's output, computed unrecorded.
  template <class X>
  var<X> track(const var<X>& v) {
    return {*this, v.shared(), new_slot<X>(v.mesh(), v.extents())};
  }

  // before == false: marks every parameter as without gradient; true: zeros
  // the gradients of those still without one.
  template <mesh_type Mesh>
  static std::function<void(bool)> reset_grads(parameters<Mesh>& ps) {
    return [&ps](bool zero_missing) {
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (!zero_missing) ps.set_has_grad(i, false);
        else if (!ps.has_grad(i)) {
          for (float& v : ps.grads()[i].f32()) v = 0;
          for (double& v : ps.grads()[i].f64()) v = 0;
        }
      }
    };
  }
  template <class X>
  int new_slot(const typename X::mesh_type& m, const typename X::extents_type& e) {
    slots_.push_back(std::make_unique<detail::slot_of<X>>(m, e));
    return int(slots_.size()) - 1;
  }

  // The tape's own lists keep one size from step to step (no reallocation
  // pattern for the heap to fragment around).
  void reserve() {
    slots_.reserve(1024);
    rules_.reserve(1024);
    finish_.reserve(256);
  }

  void* params_;
  bool recording_;
  bool done_ = false;
  int suspended_ = 0;    // > 0: a rematerialised function's first forward (no slots, no rules)
  int recomputing_ = 0;  // > 0: its forward again, in the backward
  std::vector<std::unique_ptr<detail::grad_slot_base>> slots_;
  // A gradient rule and the matmul_precision its forward ran with; run()
  // runs it in that precision (whatever the caller of backward set), once,
  // and frees what it kept.
  struct rule {
    std::function<void()> f;
    matmul_precision precision;
    void run() {
      {
        const matmul_precision_scope as_forward(precision);
        f();
      }
      f = nullptr;
    }
  };
  std::vector<rule> rules_;
  std::vector<rule>* recording_into_ = &rules_;  // a recomputed forward's own list
  std::vector<std::function<void()>> after_step_;
  // The gradient slot of an output of type X (-1: untracked).
  template <class X, class Value>
  int output_slot(const Value& value, bool any_input_tracked) {
    if (any_input_tracked && suspended_ > 0)
      throw error("gshard::remat: the function uses a tracked value " + value.notation() +
                  " that it was not given as an input; pass every value it reads as an argument of remat");
    const int id = recording_ && any_input_tracked ? new_slot<X>(value.mesh(), value.extents()) : -1;
    detail::progress_in_flight();  // as each operation ends: a reshard in flight moves while the forward computes
    return id;
  }
  struct derived_entry {
    std::weak_ptr<const void> of, value;
    std::shared_ptr<const void> held;  // a view's value
  };
  std::map<std::pair<const void*, std::type_index>, derived_entry> derived_;
  struct param_finish {
    std::size_t first_rule;          // the parameter's gradient is complete once the rules from here on have run
    std::function<void()> reduce;    // its one reduction, into its buffer; empty once run
  };
  std::vector<param_finish> finish_;
  std::map<std::size_t, int> param_slots_;
  std::map<std::size_t, std::size_t> param_first_;  // parameter index -> the first rule that may use it
  std::size_t running_rule_ = 0;                    // the rule the backward runs (a recomputation records new uses there)
  std::optional<detail::buckets<float>> float_buckets_;  // complete gradients waiting to be reduced together
  std::optional<detail::buckets<double>> double_buckets_;
  std::function<void(bool)> reset_grads_;
};

}  // namespace gshard
