// gshard/state/optim.hpp — the optimizer interface (what a training step and
// a checkpoint see of any optimizer), and Adam over a model's declared
// parameters: each rank
// updates its own shards, and the moments are sharded like their parameter's
// gradient (tensor_sets with the parameters' names): in the parameter's
// sharding, or — when the parameters shard the weight update
// (shard_weight_update, ad/parameters.hpp) — in its update layout, a block
// of 1/(the update axes' ranks) of it. Gradient clipping by
// the global norm counts every element once: a shard held by several ranks
// (replicated over some axes) contributes 1/replication of its square sum on
// each, so one all_reduce gives the exact norm. Learning rate: linear
// warm-up, then cosine decay to a floor.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <numbers>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gshard/state/parameters.hpp"
#include "gshard/state/update_targets.hpp"
#include "gshard/state/weight_update.hpp"
#include "gshard/state/buckets.hpp"
#include "gshard/runtime/collectives.hpp"
#include "gshard/kernels/blockwise.hpp"

namespace gshard {

namespace detail {
// The learning rate at `step` (from 0): linear warm-up over `warmup` steps to
// `lr`, then a cosine to min_ratio · lr at step `total`, flat after it.
inline double warmup_cosine(double lr, int warmup, int total, double min_ratio, int step) {
  if (step < warmup) return lr * double(step + 1) / double(warmup);
  const double t = std::min(1.0, double(step - warmup) / double(std::max(1, total - warmup)));
  return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * t)));
}
}  // namespace detail

struct adam_config {
  double lr = 3e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.0;  // decoupled (AdamW)
  double clip_norm = 1.0;     // 0: no clipping
  int warmup_steps = 50;
  int total_steps = 1000;     // the cosine reaches min_lr_ratio · lr here
  double min_lr_ratio = 0.1;

  double lr_at(int step) const { return detail::warmup_cosine(lr, warmup_steps, total_steps, min_lr_ratio, step); }
};

namespace detail {
// Σ v², in double: blocks of 256 summed on Eigen's packets in T, the blocks'
// sums in double. A float's block sum is within ~1e-7 of its double sum;
// the loop in double does not vectorise at -O2 and waits on each add's
// latency (3.0 against 0.42 ms for 3M floats on an AVX-512 Xeon).
// A block whose sum overflows T (a float gradient above ~1.8e19) is summed
// again in double, so the norm stays finite and clipping still applies.
template <class T>
double sum_of_squares(std::span<const T> v) {
  constexpr std::size_t block = 256;
  const auto in_double = [&](std::size_t from, std::size_t to) {
    double s = 0;
    for (std::size_t i = from; i < to; ++i) s += double(v[i]) * double(v[i]);
    return s;
  };
  double sum = 0;
  std::size_t at = 0;
  for (; at + block <= v.size(); at += block) {
    const T s = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(v.data() + at, block).squaredNorm();
    sum += std::isfinite(s) ? double(s) : in_double(at, at + block);
  }
  return sum + in_double(at, v.size());
}
}  // namespace detail

// The global L2 norm of every tensor of `s` (one all_reduce over the whole mesh).
inline double global_norm(tensor_set& s, const detail::mesh_base& m) {
  std::vector<double> sq{0.0};
  for (auto& e : s) {
    const double sum = detail::sum_of_squares<float>(e->f32()) + detail::sum_of_squares<double>(e->f64());
    sq[0] += sum / double(e->replication());
  }
  all_reduce<double>(m.all_axes(), sq);
  return std::sqrt(sq[0]);
}

// What a training step and a checkpoint see of an optimizer: one update of
// every parameter from its gradient, the state it keeps (as checkpoint
// parts, resharded on load like the parameters), and the updates done.
class optimizer {
 public:
  virtual ~optimizer() = default;
  int step = 0;  // updates done

  virtual std::string_view name() const = 0;  // "adam", "adafactor"
  // One update of every parameter from its gradient; returns {the
  // gradients' global norm before clipping, the learning rate used}.
  virtual std::pair<double, double> update(parameters_base& ps) = 0;
  // This rank's bytes of the optimizer's state.
  virtual std::size_t state_bytes() = 0;
  // The state as checkpoint parts, each under the optimizer's own prefix.
  virtual std::vector<checkpoint_part> state_parts() = 0;

 protected:
  optimizer() = default;
  optimizer(const optimizer&) = default;
  optimizer& operator=(const optimizer&) = default;

  // The checks every optimizer makes before an update: these parameters are
  // the ones its state was built for, and none was declared after.
  void check_owner(const parameters_base& ps, const void* owner, std::size_t count) const {
    const std::string who = "gshard::" + std::string(name());
    if (static_cast<const void*>(&ps) != owner)
      throw error(who + ": these are not the parameters the optimizer was built for (its state has their layouts); "
                        "build one " + std::string(name()) + " per parameters");
    if (count != ps.size())
      throw error(who + ": built for " + std::to_string(count) + " parameters, but the parameters have " +
                  std::to_string(ps.size()) + "; build the optimizer after the model declares its parameters");
  }
};

// Adam's state for the parameters of one model. The moments take the
// gradients' layouts: a weight's own, or the block of its update layout
// when the parameters shard the weight update (shard_weight_update).
class adam final : public optimizer {
 public:
  using config_type = adam_config;
  adam(const adam_config& c, parameters_base& ps)
      : cfg(c), owner_(&ps), m_(ps.grads().zeros_like()), v_(ps.grads().zeros_like()), targets_(ps) {}

  adam_config cfg;

  std::string_view name() const override { return "adam"; }
  tensor_set& moment1() { return m_; }
  tensor_set& moment2() { return v_; }
  // The masters of bf16 weights (parameters::weight_wire), when it keeps them.
  tensor_set& masters() { return targets_.masters(); }
  std::vector<checkpoint_part> state_parts() override {
    std::vector<checkpoint_part> p{{"adam.m.", &m_}, {"adam.v.", &v_}};
    if (masters().size() > 0) p.push_back({"adam.master.", &masters(), true});
    return p;
  }
  // This rank's bytes of Adam's state: both moments, and the weight blocks
  // a sharded update works on or the masters of bf16 weights.
  std::size_t state_bytes() override { return m_.local_bytes() + v_.local_bytes() + targets_.bytes(); }

  std::pair<double, double> update(parameters_base& ps) override {
    check_owner(ps, owner_, m_.size());
    targets_.check(ps, name());
    detail::weight_gathers& gathers = targets_.begin(ps);
    const double norm = global_norm(ps.grads(), ps.mesh());
    const double clip = cfg.clip_norm > 0 && norm > cfg.clip_norm ? cfg.clip_norm / (norm + 1e-12) : 1.0;
    const double lr = cfg.lr_at(step);
    ++step;
    const double c1 = 1.0 - std::pow(cfg.beta1, step), c2 = 1.0 - std::pow(cfg.beta2, step);
    // A sharded update runs on this rank's block of the weight and
    // all_gathers the updated blocks — in buckets of weights whose gathers
    // take the same steps (gshard/state/buckets.hpp), left in flight until
    // the model next reads each weight (detail::weight_gathers); otherwise
    // on the whole local shard, or on its master
    // (gshard/state/update_targets.hpp).
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto& g = ps.grads()[i];
      detail::set_entry& w = targets_.target(i, ps);
      update_one(w.f32(), g.f32(), m_[i].f32(), v_[i].f32(), clip, lr, c1, c2);
      update_one(w.f64(), g.f64(), m_[i].f64(), v_[i].f64(), clip, lr, c1, c2);
      targets_.publish(i, ps, gathers);
    }
    gathers.leave_in_flight();
    return {norm, lr};
  }

 private:
  // Adam on one tensor, in T (as PyTorch's for float weights), on Eigen's
  // packets in fixed blocks (kernels/blockwise.hpp): every element takes the
  // same instructions wherever it sits in memory and in the tensor, so
  // replicas on two ranks, and a sharded update's blocks against the
  // replicated update, stay bit-identical. (In double with scalar
  // conversions the update took 5.0 ms per 1.5M floats on an AVX-512 Xeon,
  // 6.7% of a 2-rank trainer step; in float on packets 1.5 ms, about the
  // memory traffic's time.)
  template <class T>
  void update_one(std::span<T> w, std::span<T> g, std::span<T> m1, std::span<T> m2, double clip, double lr, double c1,
                  double c2) const {
    // 1 - beta in double, as PyTorch's (in float, 1 - 0.999 is 1.3e-5 off).
    const T b1 = T(cfg.beta1), b2 = T(cfg.beta2), one_b1 = T(1.0 - cfg.beta1), one_b2 = T(1.0 - cfg.beta2);
    const T eps = T(cfg.eps), decay = T(cfg.weight_decay);
    const T cl = T(clip), rate = T(lr), inv_c1 = T(1.0 / c1), inv_c2 = T(1.0 / c2);
    constexpr T largest = std::numeric_limits<T>::max();
    detail::blockwise<T>(
        index_t(w.size()),
        [&](auto&& W, const auto& G, auto&& M, auto&& V) {
          M = b1 * M + one_b1 * (cl * G);
          V = b2 * V + one_b2 * (cl * G).square();
          // Eigen's packet sqrt (EIGEN_FAST_MATH) is NaN at +inf: a second
          // moment that overflowed (unclipped gradients above ~1.8e19)
          // divides by the largest root instead, as std::sqrt's inf would
          // (nearly) — the weight moves by ~0, not to NaN.
          W -= rate * ((M * inv_c1) / ((V * inv_c2).min(largest).sqrt() + eps) + decay * W);
        },
        w.data(), static_cast<const T*>(g.data()), m1.data(), m2.data());
  }

  const void* owner_;
  tensor_set m_, v_;
  detail::update_targets targets_;
};

}  // namespace gshard
