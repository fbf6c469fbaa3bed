// test/gradcheck.hpp — central finite differences against analytic
// gradients of sharded tensors, for any world size. A probe moves one global
// element on every rank that holds a copy of it, one shard at a time; the
// verdicts are the same on every rank.
#pragma once

#include <gshard/gshard.hpp>

#include <algorithm>
#include <cmath>

namespace gshard::testing {

inline double sum_all(double local) {
  double s = 0;
  MPI_Allreduce(&local, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return s;
}

// Σ z·r over this rank's shard, summed over the ranks that hold distinct shards.
template <class X>
double dot(const X& z, const X& r) {
  index_t rep = 1;
  for (int a = 0; a < z.mesh().naxes(); ++a)
    if (X::resolved.is_free(a)) rep *= z.mesh().size(a);
  double s = 0;
  for (index_t i = 0; i < z.local().size(); ++i) s += double(z.data()[i]) * double(r.data()[i]);
  return sum_all(s / double(rep));
}

// Central differences of f() against the analytic gradient g of tensor t, at
// `probes` elements of each shard. Returns the worst error relative to
// max(|fd| + |analytic|, 1e-4) — below that scale central differences in
// double are round-off. The same on every rank.
template <class X, class G, class F>
double fd_check(X& t, const G& g, F&& f, int probes = 3, double eps = 1e-5) {
  const auto& m = t.mesh();
  auto holds_shard_of = [&](int q) {  // this rank's shard is rank q's
    const auto c = m.coords_of(q);
    for (int a = 0; a < m.naxes(); ++a)
      if (!X::resolved.is_free(a) && c[std::size_t(a)] != m.coord(a)) return false;
    return true;
  };
  auto representative = [&](int q) {  // rank q is the first holder of its shard
    const auto c = m.coords_of(q);
    for (int a = 0; a < m.naxes(); ++a)
      if (X::resolved.is_free(a) && c[std::size_t(a)] != 0) return false;
    return true;
  };
  double worst = 0;
  for (int probe = 0; probe < probes; ++probe)
    for (int owner = 0; owner < m.nranks(); ++owner) {
      if (!representative(owner)) continue;
      const index_t n = t.local().size();
      const bool mine = n > 0 && holds_shard_of(owner);
      const index_t i = n > 0 ? (probe * 7919 + 13) % n : 0;
      const double orig = mine ? double(t.data()[i]) : 0;
      if (mine) t.data()[i] = typename X::value_type(orig + eps);
      const double plus = f();
      if (mine) t.data()[i] = typename X::value_type(orig - eps);
      const double minus = f();
      if (mine) t.data()[i] = typename X::value_type(orig);
      const double fd = (plus - minus) / (2 * eps);
      const double an = sum_all(m.rank() == owner && n > 0 ? double(g.data()[i]) : 0.0);
      worst = std::max(worst, std::abs(fd - an) / std::max(std::abs(fd) + std::abs(an), 1e-4));
    }
  return worst;
}

// The worst finite-difference error over every parameter of `ps` (each one a
// param<> of the caller's), for the scalar loss(tape&) evaluated without recording.
template <class Mesh, class Loss, class... P>
double fd_check_params(parameters<Mesh>& ps, Loss&& loss, P... p) {  // handles: copies refer to the same parameters
  {
    tape t(ps);
    t.backward(loss(t));
  }
  auto f = [&] {
    tape t(ps, tape::no_grad);
    return double(loss(t).value().local()());
  };
  double worst = 0;
  ((worst = std::max(worst, fd_check(p.value(), p.grad(), f))), ...);
  return worst;
}

}  // namespace gshard::testing
