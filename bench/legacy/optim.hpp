// bench/legacy/ (frozen copy of gshard/optim.hpp — Adam over sharded parameters: each rank updates its own
// shards, and the moments are sharded like their parameter. Gradient clipping
// by the global norm counts every element once: a shard held by several ranks
// (replicated over some axes) contributes 1/replication of its square sum on
// each, so one all_reduce gives the exact norm. Learning rate: linear warm-up,
// then cosine decay to a floor.
#pragma once

#include <cmath>
#include <numbers>
#include <vector>

#include "gshard/collectives.hpp"
#include "gshard/tensor.hpp"

namespace legacy {
using namespace gshard;

struct adam_config {
  double lr = 3e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.0;  // decoupled (AdamW)
  double clip_norm = 1.0;     // 0: no clipping
  int warmup_steps = 50;
  int total_steps = 1000;     // the cosine reaches min_lr_ratio · lr here
  double min_lr_ratio = 0.1;

  double lr_at(int step) const {  // step counts from 0
    if (step < warmup_steps) return lr * double(step + 1) / double(warmup_steps);
    const double t = std::min(1.0, double(step - warmup_steps) / double(std::max(1, total_steps - warmup_steps)));
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * t)));
  }
};

// How many ranks hold each element of a tensor with this layout: the product
// of the sizes of the axes that split none of its dims (and hold no pending sum).
template <sharded_tensor X>
index_t replication(const X& t) {
  index_t r = 1;
  for (int a = 0; a < t.mesh().naxes(); ++a)
    if (X::layout.is_free(a)) r *= t.mesh().size(a);
  return r;
}

// The global L2 norm of every tensor `for_each_param` visits in `grads`
// (one all_reduce over the whole mesh).
template <class P, class Mesh>
double global_norm(P& grads, const Mesh& m) {
  std::vector<double> sq{0.0};
  for_each_param(
      [&](const std::string&, auto& g) {
        double s = 0;
        for (index_t i = 0, n = g.local().size(); i < n; ++i) s += double(g.data()[i]) * double(g.data()[i]);
        sq[0] += s / double(replication(g));
      },
      grads);
  all_reduce<double>(m.group((1u << m.naxes()) - 1u), sq);
  return std::sqrt(sq[0]);
}

// Adam's state for parameters of type P (walked by for_each_param).
template <class P>
struct adam {
  adam_config cfg;
  P m, v;       // first and second moments, sharded like the parameters
  int step = 0;  // updates done

  adam(const adam_config& c, const P& zeros) : cfg(c), m(zeros), v(zeros) {}

  // One update; returns {the gradients' global norm before clipping, the learning rate used}.
  template <class Mesh>
  std::pair<double, double> update(P& params, P& grads, const Mesh& mesh) {
    const double norm = global_norm(grads, mesh);
    const double clip = cfg.clip_norm > 0 && norm > cfg.clip_norm ? cfg.clip_norm / (norm + 1e-12) : 1.0;
    const double lr = cfg.lr_at(step);
    ++step;
    const double c1 = 1.0 - std::pow(cfg.beta1, step), c2 = 1.0 - std::pow(cfg.beta2, step);
    for_each_param(
        [&](const std::string&, auto& w, auto& g, auto& m1, auto& m2) {
          using T = typename std::remove_cvref_t<decltype(w)>::value_type;
          T* pw = w.data();
          const T* pg = g.data();
          T* pm = m1.data();
          T* pv = m2.data();
          for (index_t i = 0, n = w.local().size(); i < n; ++i) {
            const double gi = double(pg[i]) * clip;
            pm[i] = T(cfg.beta1 * double(pm[i]) + (1.0 - cfg.beta1) * gi);
            pv[i] = T(cfg.beta2 * double(pv[i]) + (1.0 - cfg.beta2) * gi * gi);
            const double update = (double(pm[i]) / c1) / (std::sqrt(double(pv[i]) / c2) + cfg.eps);
            pw[i] = T(double(pw[i]) - lr * (update + cfg.weight_decay * double(pw[i])));
          }
        },
        params, grads, m, v);
    return {norm, lr};
  }
};

}  // namespace legacy
