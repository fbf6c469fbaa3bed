// gshard/model/machine.hpp — the machine a cost model predicts for
// (gshard/model/cost.hpp), measured in this run on the kernels a step runs:
// each einsum by gshard's local einsum kernel on a rank's extents, the
// element-wise work by its three classes (a stream triad, gshard's row
// softmax, gshard's Adam), and each collective's α–β by gshard's own
// collectives at two sizes. Every rank measures at once, as a job runs.
// Each measure is a template on the element type (float unless asked), so a
// translation unit that includes this header and measures nothing compiles
// none of the kernels.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "gshard/runtime/collectives.hpp"
#include "gshard/kernels/local_einsum.hpp"
#include "gshard/kernels/softmax_row.hpp"
#include "gshard/model/cost.hpp"
#include "gshard/state/optim.hpp"

namespace gshard::model::cost {

namespace detail_measure {
// The median time of `reps` runs of f, after one to warm up.
inline double median_seconds(int reps, const std::function<void()>& f) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}
// Keeps a result alive past the optimiser.
inline void keep(const void* p) { asm volatile("" : : "g"(p) : "memory"); }
}  // namespace detail_measure

// Seconds per step of one einsum of a step on this rank: its forward and
// both operand gradients by the local einsum kernel gshard's einsums run
// (the same strides, batch loops and copies) on this rank's extents, median
// of 5. Local: no communication.
template <class T = float>
double einsum_seconds(const einsum_work& e) {
  double total = 0;
  for (const std::string& spec : e.specs()) {
    const auto s = gshard::detail::parse_einsum(spec);
    std::array<index_t, max_rank> ea{}, eb{}, eo{};
    std::size_t na = 1, nb = 1, no = 1;
    for (int d = 0; d < s.in_rank[0]; ++d) na *= std::size_t(ea[std::size_t(d)] = e.local[std::size_t(s.in[0][d])]);
    for (int d = 0; d < s.in_rank[1]; ++d) nb *= std::size_t(eb[std::size_t(d)] = e.local[std::size_t(s.in[1][d])]);
    for (int d = 0; d < s.out_rank; ++d) no *= std::size_t(eo[std::size_t(d)] = e.local[std::size_t(s.out[d])]);
    std::vector<T> a(na, T(0.5)), b(nb, T(0.25)), o(no);
    total += detail_measure::median_seconds(
        5, [&] { gshard::detail::local_einsum<T>(s, a.data(), ea.data(), b.data(), eb.data(), o.data(), eo.data()); });
  }
  return double(e.calls) * total;
}

// FLOP/s of one GEMM of m×k by k×n (gshard's GEMM), median of 5.
template <class T = float>
double gemm_flops(index_t m, index_t n, index_t k) {
  std::vector<T> a(std::size_t(m * k), T(0.5)), b(std::size_t(k * n), T(0.25)), c(std::size_t(m * n));
  const double t = detail_measure::median_seconds(
      5, [&] { gshard::detail::gemm<T>(false, false, m, n, k, T(1), a.data(), k, b.data(), n, T(0), c.data(), n); });
  return 2.0 * double(m) * double(n) * double(k) / t;
}

// Bytes per second of a[i] = b[i] + s·c[i] over arrays of `n` elements (two
// reads, one write): the stream passes of element-wise work.
template <class T = float>
double triad_bytes_per_s(std::size_t n) {
  std::vector<T> a(n), b(n, T(1)), c(n, T(2));
  const double t = detail_measure::median_seconds(20, [&] {
    for (std::size_t i = 0; i < n; ++i) a[i] = b[i] + T(0.5) * c[i];
    detail_measure::keep(a.data());
  });
  return 3.0 * double(sizeof(T)) * double(n) / t;
}

// Elements per second of gshard's row softmax over rows of `row` entries.
template <class T = float>
double softmax_per_s(index_t row) {
  const index_t rows = std::max<index_t>(1, (index_t(1) << 19) / row);
  std::vector<T> x(std::size_t(rows * row)), y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(i % 97) * T(0.01);
  const double t = detail_measure::median_seconds(10, [&] {
    for (index_t r = 0; r < rows; ++r) gshard::detail::softmax_row(x.data() + r * row, row, y.data() + r * row);
    detail_measure::keep(y.data());
  });
  return double(x.size()) / t;
}

// Elements per second of gshard's Adam on one weight of `n` elements (its
// global norm and update), each rank on its own (a mesh over MPI_COMM_SELF).
template <class T = float>
double adam_per_s(index_t n) {
  using self_mesh = mesh<axis<"x">>;
  const self_mesh m(MPI_COMM_SELF);
  parameters<self_mesh> ps(m, 1);
  param<tensor<T, 1, self_mesh, replicate>> w(ps, "w", {n}, init::normal(1.0));
  adam opt({}, ps);
  return double(n) / detail_measure::median_seconds(5, [&] { opt.update(ps); });
}

// α and β of one kind of collective over `g`: its median time (the slowest
// rank's, 9 runs after a barrier) at 64 KiB and 4 MiB per rank, fitted to
// seconds(). Collective over g.
template <class T = float>
alpha_beta fit_alpha_beta(collective kind, const gshard::detail::axis_group& g) {
  const index_t p = g.size;
  // Elements per rank, whole multiples of p (an all_to_all and a
  // reduce_scatter split them into p equal parts: 3 or 6 ranks too).
  const std::size_t whole = std::size_t(p);
  const std::size_t small = (64 << 10) / sizeof(T) / whole * whole, large = (4 << 20) / sizeof(T) / whole * whole;
  auto time = [&](std::size_t n) {
    std::vector<T> in(n, T(1)), out(kind == collective::all_gather ? n * std::size_t(p) : n);
    std::vector<double> t;
    for (int r = 0; r < 9; ++r) {
      barrier(g);
      const auto t0 = std::chrono::steady_clock::now();
      switch (kind) {
        case collective::all_to_all: all_to_all<T>(g, in, out); break;
        case collective::reduce_scatter: reduce_scatter<T>(g, in, std::span<T>(out.data(), n / std::size_t(p))); break;
        case collective::all_gather: all_gather<T>(g, in, out); break;
        default: all_reduce<T>(g, std::span<const T>(in), std::span<T>(out)); break;
      }
      t.push_back(all_reduce(g, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), reduction::max));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double t1 = time(small), t2 = time(large);
  // T(n) = rounds·α + unit·bytes/β: two sizes, two unknowns.
  const double unit = seconds(kind, p, 0, 1.0, {0, 1.0}), rounds = seconds(kind, p, 1, 0.0, {1.0, 1.0});
  alpha_beta ab;
  const double bytes = double(sizeof(T));
  ab.beta = unit * bytes * double(large - small) / std::max(t2 - t1, 1e-9);
  ab.alpha = std::max(0.0, (t1 - unit * bytes * double(small) / ab.beta) / rounds);
  return ab;
}

// This machine, measured: the GEMM rate of a 1024³ product (for einsums not
// timed on their own shapes), the element-wise rates (the slowest rank's),
// and, over `g` if it has more than one rank, each collective's α–β.
// Collective over g; a few seconds.
template <class T = float>
machine measure_machine(const gshard::detail::axis_group& g) {
  auto slowest = [&](double rate) { return -all_reduce(g, -rate, reduction::max); };
  machine mc;
  mc.gemm_flops = slowest(gemm_flops<T>(1024, 1024, 1024));
  mc.elementwise_bytes_per_s = slowest(triad_bytes_per_s<T>(std::size_t(1) << 19));
  mc.exp_per_s = slowest(softmax_per_s<T>(128));
  mc.adam_elements_per_s = slowest(adam_per_s<T>(index_t(1) << 20));
  if (g.size > 1)
    for (collective k : {collective::all_to_all, collective::all_reduce, collective::reduce_scatter, collective::all_gather}) {
      alpha_beta& ab = k == collective::all_to_all       ? mc.all_to_all
                       : k == collective::all_reduce     ? mc.all_reduce
                       : k == collective::reduce_scatter ? mc.reduce_scatter
                                                         : mc.all_gather;
      ab = fit_alpha_beta<T>(k, g);
    }
  return mc;
}

}  // namespace gshard::model::cost
