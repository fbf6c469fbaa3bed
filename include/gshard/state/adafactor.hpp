// gshard/state/adafactor.hpp — Adafactor (Shazeer & Stern 2018), GShard's
// optimizer, over a model's declared parameters. A gradient of rank ≥ 2
// keeps its second moment as two factors over its last two dims — a row
// factor (the mean of G² over the last dim) and a column factor (the mean
// over the second-to-last), one pair per index of the leading dims, so an
// expert stack [E, M, H] keeps one pair per expert — and a vector keeps a
// full second moment. The factors are blocks of the gradient's layout
// without the dim they average over: a factor whose mean runs along a split
// dim is one all_reduce over that dim's axes, and only then (the column
// factor of [M, H{model}] is local; its row factor sums over H: one
// all_reduce over "model"). Update clipping by the update's RMS and the
// parameter scale need each weight's global RMS: one all_reduce of two
// numbers per weight, for all weights at once.
//
//   β̂_t = min(β2, 1 − t^−decay_power)        (decay_power 0: β2 fixed)
//   R = β̂ R + (1−β̂)·rowmean(G² + ε1),  C = β̂ C + (1−β̂)·colmean(G² + ε1)
//   U = G / √(R Cᵀ / mean(R))               (a vector: U = G / √V)
//   U ← U / max(1, RMS(U) / clip_threshold);  with β1 > 0, U ← M = β1 M + (1−β1) U
//   W ← W − ρ (U + weight_decay · W),  ρ = lr_t · (scale_parameter ? max(ε2, RMS(W)) : 1)
//
// The sums that make the factors are taken in double, and the factors are
// kept in double; the update itself runs in the weight's type.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gshard/state/optim.hpp"

namespace gshard {

struct adafactor_config {
  double lr = 3e-3;            // the schedule's peak (warm-up, then cosine), unless relative_step
  double beta1 = 0.0;          // 0: no first moment (GShard's setting)
  double beta2 = 0.99;         // the second moments' decay, or its cap when decay_power > 0
  double decay_power = 0.8;    // β̂_t = min(beta2, 1 − t^−decay_power); 0: β̂ = beta2 at every step
  double eps1 = 1e-30;         // added to G² before it is averaged
  double eps2 = 1e-3;          // the smallest parameter scale
  double clip_threshold = 1.0; // update clipping: RMS(U) at most this; 0: no clipping
  bool relative_step = false;  // lr_t = min(1e-2, 1/√t) instead of the schedule
  bool scale_parameter = false;  // the step scaled by max(eps2, RMS(W)), each weight its own
  double weight_decay = 0.0;   // decoupled, scaled by the step size
  double clip_norm = 0.0;      // gradient clipping by the global norm first; 0: none (GShard clips the update)
  int warmup_steps = 50;
  int total_steps = 1000;
  double min_lr_ratio = 0.1;

  double lr_at(int step) const {  // step counts from 0
    if (relative_step) return std::min(1e-2, 1.0 / std::sqrt(double(step + 1)));
    return detail::warmup_cosine(lr, warmup_steps, total_steps, min_lr_ratio, step);
  }
  double beta2_at(int step) const {  // step counts from 0
    return decay_power > 0 ? std::min(beta2, 1.0 - std::pow(double(step + 1), -decay_power)) : beta2;
  }
};

class adafactor final : public optimizer {
 public:
  using config_type = adafactor_config;
  adafactor(const adafactor_config& c, parameters_base& ps) : cfg(checked(c)), owner_(&ps), targets_(ps) {
    const detail::mesh_base& m = ps.mesh();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto& g = ps.grads()[i];
      const int rank = int(g.extents().size());
      weights_.push_back({});
      auto& w = weights_.back();
      w.rank = rank;
      if (c.beta1 > 0) m_.add_entry(g.zeros(g.name()));
      if (rank < 2) {
        rows_.add_entry(g.zeros(g.name()));
        continue;
      }
      rows_.add_entry(ps.zero_factor(i, g.name(), rank - 1));
      cols_.add_entry(ps.zero_factor(i, g.name(), rank - 2));
      const auto& l = ps.grad_layout(i);
      const auto ext = g.extents();
      w.row_axes = live_axes(l.dims[rank - 1], m), w.col_axes = live_axes(l.dims[rank - 2], m);
      w.rows = ext[std::size_t(rank - 2)], w.cols = ext[std::size_t(rank - 1)];
      w.local_rows = detail::dim_block(l, rank - 2, w.rows, m.sizes(), m.coords()).extent;
      w.local_cols = detail::dim_block(l, rank - 1, w.cols, m.sizes(), m.coords()).extent;
      for (int d = 0; d < rank - 2; ++d) w.lead *= detail::dim_block(l, d, ext[std::size_t(d)], m.sizes(), m.coords()).extent;
    }
  }

  adafactor_config cfg;

  std::string_view name() const override { return "adafactor"; }
  // Per parameter: the row factor (rank ≥ 2) or the full second moment
  // (a vector); the column factors of the parameters of rank ≥ 2; the first
  // moments when beta1 > 0.
  tensor_set& second_moment_rows() { return rows_; }
  tensor_set& second_moment_cols() { return cols_; }
  tensor_set& moment1() { return m_; }
  std::vector<checkpoint_part> state_parts() override {
    std::vector<checkpoint_part> p{{"adafactor.v_row.", &rows_}, {"adafactor.v_col.", &cols_}};
    if (cfg.beta1 > 0) p.push_back({"adafactor.m.", &m_});
    if (masters().size() > 0) p.push_back({"adafactor.master.", &masters(), true});
    return p;
  }
  // The masters of bf16 weights (parameters::weight_wire), when it keeps them.
  tensor_set& masters() { return targets_.masters(); }
  std::size_t state_bytes() override {
    return rows_.local_bytes() + cols_.local_bytes() + m_.local_bytes() + targets_.bytes();
  }

  std::pair<double, double> update(parameters_base& ps) override {
    check_owner(ps, owner_, weights_.size());
    if (cfg.beta1 > 0 && m_.size() != weights_.size())
      throw error("gshard::adafactor: beta1 is " + text(cfg.beta1) +
                  " but the optimizer was built with beta1 0 (no first moments); set it before building the optimizer");
    check_config(cfg);
    targets_.check(ps, name());
    detail::weight_gathers& gathers = targets_.begin(ps);
    const detail::mesh_base& mesh = ps.mesh();
    const double norm = global_norm(ps.grads(), mesh);
    const double clip = cfg.clip_norm > 0 && norm > cfg.clip_norm ? cfg.clip_norm / (norm + 1e-12) : 1.0;
    const double lr = cfg.lr_at(step), beta = cfg.beta2_at(step);
    ++step;
    // The second moments, and each weight's Σ U² and Σ W² on this rank (over
    // its replicas, so one all_reduce over every axis sums each element once).
    std::vector<double> sums(2 * weights_.size(), 0.0);
    std::size_t col = 0;
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      auto& w = weights_[i];
      auto& g = ps.grads()[i];
      detail::set_entry& value = targets_.target(i, ps);
      const double rep = double(g.replication());
      // By the element type, not by which span holds elements: a block of a
      // split that does not divide may be empty on this rank, and its
      // factors' all_reduces still need it.
      const auto moments = [&](auto grad, auto weight) {
        sums[2 * i] = (w.rank < 2 ? update_full(grad, rows_[i], clip, beta)
                                  : update_factors(w, grad, rows_[i], cols_[col], mesh, clip, beta)) / rep;
        if (cfg.scale_parameter) sums[2 * i + 1] = detail::sum_of_squares<typename decltype(weight)::value_type>(weight) / rep;
      };
      if (g.element_bytes() == 4) moments(g.f32(), value.f32());
      else moments(g.f64(), value.f64());
      if (w.rank >= 2) ++col;
    }
    all_reduce<double>(mesh.all_axes(), sums);
    col = 0;
    for (std::size_t i = 0; i < weights_.size(); ++i) {
      auto& w = weights_[i];
      auto& g = ps.grads()[i];
      detail::set_entry& value = targets_.current(i, ps);
      double n = 1;
      for (index_t e : g.extents()) n *= double(e);
      const double rms_u = std::sqrt(sums[2 * i] / n), rms_w = std::sqrt(sums[2 * i + 1] / n);
      const double shrink = cfg.clip_threshold > 0 ? std::max(1.0, rms_u / cfg.clip_threshold) : 1.0;
      const double rate = lr * (cfg.scale_parameter ? std::max(cfg.eps2, rms_w) : 1.0);
      const auto apply = [&](auto weight, auto grad, auto first) {
        step_one(w, weight, grad, first, rows_[i], w.rank < 2 ? nullptr : &cols_[col], clip / shrink, rate);
      };
      if (g.element_bytes() == 4) apply(value.f32(), g.f32(), cfg.beta1 > 0 ? m_[i].f32() : std::span<float>{});
      else apply(value.f64(), g.f64(), cfg.beta1 > 0 ? m_[i].f64() : std::span<double>{});
      if (w.rank >= 2) ++col;
      targets_.publish(i, ps, gathers);
    }
    gathers.leave_in_flight();
    return {norm, lr};
  }

 private:
  struct weight_state {
    int rank = 1;
    index_t rows = 1, cols = 1, local_rows = 1, local_cols = 1;  // the last two dims, global and on this rank
    index_t lead = 1;  // the leading dims' elements on this rank (an expert stack's local experts)
    std::uint32_t row_axes = 0, col_axes = 0;  // the axes (of size > 1) splitting the last dim, and the second-to-last
    std::vector<double> mean_r;                // per leading index on this rank: mean(R), from the factors to the update
  };

  static const adafactor_config& checked(const adafactor_config& c) {  // before the targets round any weight
    check_config(c);
    return c;
  }
  static void check_config(const adafactor_config& c) {
    const auto bad = [](const char* what, double v, const char* want) {
      throw error(std::string("gshard::adafactor: ") + what + " is " + text(v) + "; it must be " + want);
    };
    if (!(c.beta1 >= 0 && c.beta1 < 1)) bad("beta1", c.beta1, "in [0, 1)");
    if (!(c.beta2 > 0 && c.beta2 < 1)) bad("beta2", c.beta2, "in (0, 1)");
    if (!(c.decay_power >= 0 && c.decay_power <= 1)) bad("decay_power", c.decay_power, "in [0, 1] (0: beta2 fixed)");
    if (!(c.eps1 > 0 && std::isfinite(c.eps1))) bad("eps1", c.eps1, "positive and finite");
    if (!(c.eps2 >= 0 && std::isfinite(c.eps2))) bad("eps2", c.eps2, "finite and not negative");
    if (!(c.clip_threshold >= 0 && std::isfinite(c.clip_threshold))) bad("clip_threshold", c.clip_threshold, "finite and not negative (0: none)");
    if (!(c.clip_norm >= 0 && std::isfinite(c.clip_norm))) bad("clip_norm", c.clip_norm, "finite and not negative (0: none)");
    if (!(c.weight_decay >= 0 && std::isfinite(c.weight_decay))) bad("weight_decay", c.weight_decay, "finite and not negative");
    if (!c.relative_step && !(c.lr > 0 && std::isfinite(c.lr))) bad("lr", c.lr, "positive and finite");
  }

  static std::string text(double v) {  // as a user would type it
    char t[32];
    std::snprintf(t, sizeof t, "%g", v);
    return t;
  }

  // The axes of `d` of more than one rank, as a mask.
  static std::uint32_t live_axes(const detail::rdim& d, const detail::mesh_base& m) {
    std::uint32_t mask = 0;
    for (int k = 0; k < d.n; ++k)
      if (m.size(d.ax[k]) > 1) mask |= 1u << d.ax[k];
    return mask;
  }

  // A vector's full second moment; returns this rank's Σ U².
  template <class T>
  double update_full(std::span<T> g, detail::set_entry& v_entry, double clip, double beta) const {
    const std::span<T> v = v_entry_span<T>(v_entry);
    double uu = 0;
    for (std::size_t k = 0; k < g.size(); ++k) {
      const double gk = clip * double(g[k]);
      const double vk = beta * double(v[k]) + (1 - beta) * (gk * gk + cfg.eps1);
      v[k] = T(vk);
      uu += gk * gk / double(v[k]);
    }
    return uu;
  }

  // A matrix's (or a stack's) factors: the row sums, all_reduced over the
  // last dim's axes; the column sums with each stack's Σ R, over the
  // second-to-last dim's. Returns this rank's Σ U².
  template <class T>
  double update_factors(weight_state& w, std::span<T> g, detail::set_entry& r_entry, detail::set_entry& c_entry,
                        const detail::mesh_base& mesh, double clip, double beta) {
    const std::span<double> r = r_entry.f64(), c = c_entry.f64();
    const std::size_t nr = std::size_t(w.local_rows), nc = std::size_t(w.local_cols), lead = std::size_t(w.lead);
    auto& s = sums_;
    s.assign(lead * nr, 0.0);
    for (std::size_t l = 0; l < lead; ++l)
      for (std::size_t i = 0; i < nr; ++i) {
        const T* row = g.data() + (l * nr + i) * nc;
        double sum = 0;
        for (std::size_t j = 0; j < nc; ++j) sum += double(row[j]) * double(row[j]);
        s[l * nr + i] = clip * clip * sum + double(nc) * cfg.eps1;
      }
    if (w.row_axes) all_reduce<double>(mesh.group(w.row_axes), s);
    for (std::size_t k = 0; k < lead * nr; ++k) r[k] = beta * r[k] + (1 - beta) * s[k] / double(w.cols);
    s.assign(lead * nc + lead, 0.0);
    for (std::size_t l = 0; l < lead; ++l) {
      for (std::size_t i = 0; i < nr; ++i) {
        const T* row = g.data() + (l * nr + i) * nc;
        double* cs = s.data() + l * nc;
        for (std::size_t j = 0; j < nc; ++j) cs[j] += double(row[j]) * double(row[j]);
        s[lead * nc + l] += r[l * nr + i];
      }
      for (std::size_t j = 0; j < nc; ++j) s[l * nc + j] = clip * clip * s[l * nc + j] + double(nr) * cfg.eps1;
    }
    if (w.col_axes) all_reduce<double>(mesh.group(w.col_axes), s);
    for (std::size_t k = 0; k < lead * nc; ++k) c[k] = beta * c[k] + (1 - beta) * s[k] / double(w.rows);
    // V̂_ij = R_i C_j / mean(R): U_ij = G_ij · √(mean(R) / R_i) / √C_j.
    w.mean_r.resize(lead);
    double uu = 0;
    for (std::size_t l = 0; l < lead; ++l) {
      const double mean_r = w.mean_r[l] = s[lead * nc + l] / double(w.rows);
      for (std::size_t i = 0; i < nr; ++i) {
        const double a = std::sqrt(mean_r / r[l * nr + i]);
        const T* row = g.data() + (l * nr + i) * nc;
        for (std::size_t j = 0; j < nc; ++j) {
          const double u = clip * double(row[j]) * a / std::sqrt(c[l * nc + j]);
          uu += u * u;
        }
      }
    }
    return uu;
  }

  // W ← W − rate (U·scale + weight_decay · W), or through the first moment;
  // `scale` folds the gradient clipping and the update clipping. On packets
  // in fixed blocks (kernels/blockwise.hpp), as Adam's: every element takes
  // the same instructions wherever it sits, so replicas stay bit-identical.
  template <class T>
  void step_one(const weight_state& w, std::span<T> W, std::span<T> g, std::span<T> m1, detail::set_entry& r_entry,
                detail::set_entry* c_entry, double scale, double rate) {
    const T b1 = T(cfg.beta1), one_b1 = T(1.0 - cfg.beta1), rt = T(rate), decay = T(cfg.weight_decay);
    constexpr T largest = std::numeric_limits<T>::max();
    // W and M from U, on `n` elements at `at`; `u(G, X)` gives U from the
    // gradient's block and the block of X (1/√V, or 1/√C times the row's scale).
    const auto apply = [&](std::size_t at, std::size_t n, const T* x, const auto& u) {
      if (m1.empty()) {
        detail::blockwise<T>(
            index_t(n), [&](auto&& Wb, const auto& G, const auto& X) { Wb -= rt * (u(G, X) + decay * Wb); }, W.data() + at,
            static_cast<const T*>(g.data() + at), x);
        return;
      }
      detail::blockwise<T>(
          index_t(n),
          [&](auto&& Wb, const auto& G, const auto& X, auto&& M) {
            M = b1 * M + one_b1 * u(G, X);
            Wb -= rt * (M + decay * Wb);
          },
          W.data() + at, static_cast<const T*>(g.data() + at), x, m1.data() + at);
    };
    if (!c_entry) {
      // Eigen's packet sqrt (EIGEN_FAST_MATH) is NaN at +inf: a second
      // moment that overflowed T divides by the largest root instead.
      const std::span<T> v = v_entry_span<T>(r_entry);
      const T s = T(scale);
      apply(0, W.size(), v.data(), [&](const auto& G, const auto& V) { return s * G / V.min(largest).sqrt(); });
      return;
    }
    const std::span<double> r = r_entry.f64(), c = c_entry->f64();
    const std::size_t nr = std::size_t(w.local_rows), nc = std::size_t(w.local_cols), lead = w.mean_r.size();
    scratch_t_<T>().resize(nc);
    T* inv_c = scratch_t_<T>().data();
    for (std::size_t l = 0; l < lead; ++l) {
      for (std::size_t j = 0; j < nc; ++j) inv_c[j] = T(1.0 / std::sqrt(c[l * nc + j]));
      for (std::size_t i = 0; i < nr; ++i) {
        const T a = T(scale * std::sqrt(w.mean_r[l] / r[l * nr + i]));
        apply((l * nr + i) * nc, nc, inv_c, [&](const auto& G, const auto& X) { return a * G * X; });
      }
    }
  }

  template <class T>
  static std::span<T> v_entry_span(detail::set_entry& e) {
    if constexpr (std::is_same_v<T, float>) return e.f32();
    else return e.f64();
  }

  // 1/√C of one stack's columns, in the weight's type.
  template <class T>
  std::vector<T>& scratch_t_() {
    if constexpr (std::is_same_v<T, float>) return inv_c_f32_;
    else return inv_c_f64_;
  }

  const void* owner_;
  std::vector<weight_state> weights_;
  tensor_set rows_, cols_, m_;
  detail::update_targets targets_;
  std::vector<double> sums_;  // one weight's row sums, then its column sums and Σ R, before their all_reduce
  std::vector<float> inv_c_f32_;
  std::vector<double> inv_c_f64_;
};

}  // namespace gshard
