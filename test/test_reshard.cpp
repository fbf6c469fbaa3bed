// Exhaustive resharding: every (source, target) pair of shardings of rank-1,
// 2 and 3 tensors over every mesh that fits the world — (P), (1,P), (P,1),
// (2,2) at 4 ranks, (2,4) and (4,2) at 8 — against the global tensor, with
// the exact collectives checked against the plan and against the
// transition table of docs/03_resharding.md wherever a single axis changes.
#include <gshard/gshard.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>

#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using detail::rlayout;
using gshard::testing::all_layouts;
using gshard::testing::global_tensor;
using gshard::testing::shard_of;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using dyn1 = mesh<axis<"x">>;
using dyn2 = mesh<axis<"x">, axis<"y">>;

// The state of one axis in a layout: (kind, dim, position).
struct axis_state {
  int kind;  // 0 unused, 1 partial, 2 split
  int dim, pos;
  bool operator==(const axis_state&) const = default;
};
axis_state state_of(const rlayout& l, int a) {
  if (l.is_partial(a)) return {1, -1, -1};
  for (int d = 0; d < max_rank; ++d)
    for (int i = 0; i < l.dims[d].n; ++i)
      if (l.dims[d].ax[i] == a) return {2, d, i};
  return {0, -1, -1};
}

// docs/03's table for a change of one axis; nullopt where it says nothing.
std::optional<std::vector<collective>> table(const axis_state& from, const axis_state& to) {
  using C = collective;
  if (from.kind == 2 && to.kind == 0) return std::vector{C::all_gather};
  if (from.kind == 0 && to.kind == 2) return std::vector<C>{};
  if (from.kind == 2 && to.kind == 2 && from.dim != to.dim) return std::vector{C::all_to_all};
  if (from.kind == 1 && to.kind == 0) return std::vector{C::all_reduce};
  if (from.kind == 1 && to.kind == 2) return std::vector{C::reduce_scatter};
  if (from.kind == 0 && to.kind == 1) return std::vector<C>{};
  return std::nullopt;
}

struct tally {
  int pairs = 0, table_checked = 0, permutes = 0, uneven_steps = 0;
  std::string first_failure;
  void fail(const std::string& s) {
    if (first_failure.empty()) first_failure = s;
  }
};

std::string show(const rlayout& l, const detail::mesh_base& m, int rank) {
  std::string s = "[";
  for (int d = 0; d < rank; ++d) {
    if (d) s += ',';
    s += 'd';
    s += std::to_string(d);
    if (l.dims[d].n) {
      s += "{";
      for (int i = 0; i < l.dims[d].n; ++i) {
        if (i) s += ',';
        s += m.axis_name(l.dims[d].ax[i]);
      }
      s += "}";
    }
  }
  s += "]";
  if (l.partial) s += " partial{" + m.label(l.partial) + "}";
  return s;
}

// x's elements as T (T = double: x itself).
template <class T, int R>
local_tensor<T, R> as(const local_tensor<double, R>& x) {
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    local_tensor<T, R> y(detail::dims_of<R>(x));
    for (index_t i = 0; i < x.size(); ++i) y.data()[i] = T(float(x.data()[i]));
    return y;
  }
}
// A global tensor of distinct values, each exact in bf16 (8 significant
// bits): (1 + (i mod 128)/128)·2^(i/128 - 12).
template <int R>
local_tensor<double, R> distinct_in_bf16(const shape<R>& e) {
  local_tensor<double, R> t(e);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = std::ldexp(1.0 + double(i % 128) / 128.0, int(i / 128) - 12);
  return t;
}
template <int R>
local_tensor<double, R> widened(const local_tensor<bf16, R>& x) {
  local_tensor<double, R> y(detail::dims_of<R>(x));
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = double(float(x.data()[i]));
  return y;
}

// T = bf16: the shards rounded to bf16 and resharded in bf16, against the
// same plan run in f64 on the rounded shards (exact). A plan with k summing
// steps (all_reduce, reduce_scatter) rounds each sum once to bf16 from fp32,
// so each element is within k·2^-8 + P·2^-23 of the sum of the magnitudes
// of its summands (that plan run on |shards|); with no summing step it is
// exact.
template <int R>
std::string bf16_error(const detail::mesh_base& m, const detail::reshard_steps& plan, const local_tensor<double, R>& src,
                       const shape<R>& ge, const local_tensor<bf16, R>& out) {
  const local_tensor<double, R> rounded = widened<R>(as<bf16, R>(src));
  local_tensor<double, R> mags = rounded;
  for (index_t i = 0; i < mags.size(); ++i) mags.data()[i] = std::abs(mags.data()[i]);
  auto want = detail::execute_reshard<double, R>(m, plan, rounded, ge);
  auto bound = detail::execute_reshard<double, R>(m, plan, mags, ge);
  auto got = widened<R>(out);
  if (got.size() != want.size()) return "wrong extents";
  int sums = 0;
  for (int i = 0; i < plan.n; ++i) sums += plan.step[i].kind == step_kind::all_reduce || plan.step[i].kind == step_kind::reduce_scatter;
  if (const auto p = plan.state[plan.n].partial; p)
    for (auto* x : {&want, &bound, &got})
      MPI_Allreduce(MPI_IN_PLACE, x->data(), int(x->size()), MPI_DOUBLE, MPI_SUM, m.group(p).comm);
  const double rel = sums * std::ldexp(1.0, -8) + m.nranks() * std::ldexp(1.0, -23);
  for (index_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got.data()[i] - want.data()[i]);
    if (sums == 0 ? err != 0 : err > rel * bound.data()[i])
      return "element " + std::to_string(i) + ": " + std::to_string(got.data()[i]) + " against " +
             std::to_string(want.data()[i]) + " after " + std::to_string(sums) + " summing steps";
  }
  return {};
}

template <int R, class T = double>
void check_all_pairs(const detail::mesh_base& m, const shape<R>& ge, tally& t) {
  const auto g = std::is_same_v<T, bf16> ? distinct_in_bf16<R>(ge) : global_tensor<R>(ge);
  const std::vector<rlayout> layouts = all_layouts(R, m.naxes());
  for (const rlayout& from : layouts) {
    const auto src64 = shard_of<R>(g, from, m);
    const auto src = as<T, R>(src64);
    for (const rlayout& to : layouts) {
      ++t.pairs;
      const std::string what = show(from, m, R) + " -> " + show(to, m, R) + " on " + m.describe();
      const detail::reshard_steps plan = detail::plan_reshard(from, to, m.naxes(), m.sizes());
      if (!(plan.state[plan.n] == to)) {
        t.fail(what + ": plan does not reach the target");
        continue;
      }
      collective_recorder rec;
      auto out = detail::execute_reshard<T, R>(m, plan, src, ge);
      const auto events = rec.events();

      // 1. Values: the target shard, after summing pending sums (raw MPI, not counted).
      const shape<R> le = detail::local_extents<R>(to, ge, m), off = detail::global_offsets<R>(to, ge, m), zero{};
      bool ok = detail::dims_of<R>(out) == le;
      if constexpr (std::is_same_v<T, bf16>) {
        if (const std::string e = ok ? bf16_error<R>(m, plan, src64, ge, out) : "wrong extents"; !e.empty())
          t.fail(what + ": bf16 " + e);
      } else {
        if (ok && to.partial)
          MPI_Allreduce(MPI_IN_PLACE, out.data(), int(out.size()), MPI_DOUBLE, MPI_SUM, m.group(to.partial).comm);
        if (ok) {
          local_tensor<double, R> want(le);
          if (want.size() > 0)
            detail::copy_box(g.data(), ge.data(), off.data(), want.data(), le.data(), zero.data(), le.data(), R);
          for (index_t i = 0; i < want.size() && ok; ++i) ok = out.data()[i] == want.data()[i];
        }
        if (!ok) t.fail(what + ": wrong values");
      }

      // 2. Collectives: exactly the plan's (step by step where a permute's
      // blocks differ), with its axes and bytes: a rank's block, or where a
      // cut dim's pieces differ, each piece padded to the group's longest.
      const bool even = detail::plan_even(plan, ge.data(), R, m.sizes());
      const std::vector<collective_event> planned = gshard::testing::planned_collectives(plan, m, ge.data(), R, sizeof(T));
      for (const auto& e : planned) {
        t.permutes += e.kind == collective::permute;
        t.uneven_steps += !even;
      }
      if (events != planned) t.fail(what + ": collectives differ from the plan");

      // 3. docs/03's table, where exactly one axis changes.
      int changed = -1, nchanged = 0;
      for (int a = 0; a < m.naxes(); ++a)
        if (!(state_of(from, a) == state_of(to, a))) {
          changed = a;
          ++nchanged;
        }
      if (nchanged == 1) {
        if (auto want = table(state_of(from, changed), state_of(to, changed))) {
          ++t.table_checked;
          std::vector<collective> got;
          for (const auto& e : events) got.push_back(e.kind);
          if (got != *want) t.fail(what + ": not the table's collective");
        }
      }
      // Equal per-dim axis sets in another order: one permute.
      bool same_sets = !(from == to) && from.partial == to.partial;
      for (int d = 0; d < R; ++d) same_sets = same_sets && detail::axis_set(from.dims[d]) == detail::axis_set(to.dims[d]);
      if (same_sets && even && !(events.size() == 1 && events[0].kind == collective::permute)) t.fail(what + ": reordering is not one permute");
    }
  }
}

// wire::bf16 on a float shard, blocking and started: to the bit, the plan
// run in bf16 on the rounded shard and widened back (rounded even where the
// plan sends nothing), with the plan's collectives carrying 2-byte elements.
template <int R>
void check_wire_pairs(const detail::mesh_base& m, const shape<R>& ge, tally& t) {
  const auto g = global_tensor<R>(ge);
  const std::vector<rlayout> layouts = all_layouts(R, m.naxes());
  for (const rlayout& from : layouts) {
    local_tensor<float, R> src = as<float, R>(shard_of<R>(g, from, m));
    for (index_t i = 0; i < src.size(); ++i) src.data()[i] *= 1.0f + 0x1p-12f;  // not exact in bf16
    const local_tensor<bf16, R> narrow = src.template cast<bf16>();
    for (const rlayout& to : layouts) {
      ++t.pairs;
      const std::string what = show(from, m, R) + " -> " + show(to, m, R) + " on " + m.describe() + " with bf16 on the wire";
      const detail::reshard_steps plan = detail::plan_reshard(from, to, m.naxes(), m.sizes());
      const local_tensor<float, R> want = detail::execute_reshard<bf16, R>(m, plan, narrow, ge).template cast<float>();
      collective_recorder rec;
      const auto got = detail::execute_reshard_on<float, R>(wire::bf16, m, plan, src, ge);
      const auto events = rec.events();
      // Started and finished later (start_reshard's work): a plan of no step, one whose last
      // step is an all_to_all with steps before it, any other.
      detail::started_reshard<float, R> going(m, ge, plan, src, wire::bf16);
      const auto arrived = going.wait();
      const auto events_started = rec.events();
      const auto f32 = detail::execute_reshard<float, R>(m, plan, src, ge);
      bool same = detail::dims_of<R>(got) == detail::dims_of<R>(want) && detail::dims_of<R>(arrived) == detail::dims_of<R>(want);
      for (index_t i = 0; same && i < got.size(); ++i) same = got.data()[i] == want.data()[i] && arrived.data()[i] == want.data()[i];
      // Every value a bf16 one: where fp32's plan gives a value bf16 cannot hold, a rounded one.
      bool rounded = f32.size() == got.size();
      for (index_t i = 0; rounded && i < got.size(); ++i)
        rounded = got.data()[i] == float(bf16(got.data()[i])) &&
                  (f32.data()[i] == float(bf16(f32.data()[i])) || got.data()[i] != f32.data()[i]);
      if (!same || !rounded) t.fail(what + ": not the bf16 plan's values");
      if (events != gshard::testing::planned_collectives(plan, m, ge.data(), R, sizeof(bf16)))
        t.fail(what + ": collectives differ from the plan in 2-byte elements");
      if (events_started.size() != 2 * events.size() ||
          !std::equal(events.begin(), events.end(), events_started.begin() + std::ptrdiff_t(events.size())))
        t.fail(what + ": started and finished later, other collectives than the blocking reshard's");
    }
  }
}

// wire::trimmed on a float tensor whose matrices (its last two dims) end
// in rows of zeros — and one row that is zero but for a -0.0 — blocking
// and started: to the bit the plain plan's shard, with its collectives in
// the same order and over the same axes; counts how many all_to_alls ran
// and how many moved fewer bytes than the plain ones.
template <int R>
void check_trimmed_pairs(const detail::mesh_base& m, const shape<R>& ge, tally& t, int& all_to_alls, int& fewer_bytes) {
  auto g = global_tensor<R>(ge);
  const index_t rows = ge[R - 2], row = ge[R - 1];
  for (index_t i = 0; i < g.size(); ++i) {
    const index_t r = (i / row) % rows, matrix = i / (row * rows);
    if (2 * r >= rows) g.data()[i] = 0.0;  // the lower half of every matrix
    if (r == rows - 1 && matrix % 2 == 0 && i % row == 0) g.data()[i] = -0.0;  // a row that must travel
  }
  const std::vector<rlayout> layouts = all_layouts(R, m.naxes());
  auto bits = [](const local_tensor<float, R>& a, const local_tensor<float, R>& b) {
    return detail::dims_of<R>(a) == detail::dims_of<R>(b) &&
           std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size())) == 0;
  };
  for (const rlayout& from : layouts) {
    const local_tensor<float, R> src = as<float, R>(shard_of<R>(g, from, m));
    for (const rlayout& to : layouts) {
      ++t.pairs;
      const std::string what = show(from, m, R) + " -> " + show(to, m, R) + " on " + m.describe() + ", trimmed";
      const detail::reshard_steps plan = detail::plan_reshard(from, to, m.naxes(), m.sizes());
      collective_recorder rec;
      const auto want = detail::execute_reshard<float, R>(m, plan, src, ge);
      const auto plain = rec.events();
      const auto got = detail::execute_reshard_on<float, R>(wire::trimmed, m, plan, src, ge);
      detail::started_reshard<float, R> going(m, ge, plan, src, wire::trimmed);
      const auto arrived = going.wait();
      const auto events = rec.events();
      if (!bits(got, want) || !bits(arrived, want)) t.fail(what + ": not the plain plan's shard to the bit");
      bool same = events.size() == 3 * plain.size();
      for (std::size_t k = 0; same && k < 2 * plain.size(); ++k) {
        const collective_event& e = events[plain.size() + k];
        const collective_event& p = plain[k % plain.size()];
        same = e.kind == p.kind && e.axes == p.axes && (e.kind == collective::all_to_all || e.bytes == p.bytes);
        if (same && e.kind == collective::all_to_all && k < plain.size()) {
          ++all_to_alls;
          fewer_bytes += e.bytes < p.bytes;
        }
      }
      if (!same) t.fail(what + ": other collectives than the plain plan's");
    }
  }
}

}  // namespace

TEST_CASE("every reshard pair of rank-1..3 tensors on every mesh matches the global tensor", "[reshard][exhaustive]") {
  const auto meshes = gshard::testing::meshes_for_world(true, true);
  const int P = world_size();
  const std::size_t expected_meshes = 3 + (P == 4 ? 1 : 0) + (P == 6 || P == 8 ? 2 : 0);
  int ran = 0;
  for (const auto& mc : meshes) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t;
    check_all_pairs<1>(m, {3 * W}, t);
    check_all_pairs<2>(m, {2 * W, W}, t);
    check_all_pairs<3>(m, {W, 2 * W, 3 * W}, t);
    const std::size_t nl1 = all_layouts(1, m.naxes()).size(), nl2 = all_layouts(2, m.naxes()).size(),
                      nl3 = all_layouts(3, m.naxes()).size();
    INFO("mesh " << mc.name << ": " << t.pairs << " pairs, " << t.table_checked << " checked against the table, "
                 << t.permutes << " permutes");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    GSHARD_REQUIRE(std::size_t(t.pairs) == nl1 * nl1 + nl2 * nl2 + nl3 * nl3);
    GSHARD_REQUIRE(t.table_checked > 0);
    ++ran;
  }
  // The loop over meshes did not silently collapse.
  GSHARD_REQUIRE(std::size_t(ran) == expected_meshes && meshes.size() == expected_meshes);
  // Layout counts: 1 axis: rank+2; 2 axes: (rank+2)^2 plus one more order per shared dim.
  GSHARD_REQUIRE(all_layouts(3, 1).size() == 5 && all_layouts(3, 2).size() == 28 && all_layouts(1, 2).size() == 10);
}

TEST_CASE("every reshard pair moves bf16 exactly, sums it in fp32 rounded once per summing step, and sends fp32 as bf16 on the wire",
          "[reshard][exhaustive][bf16]") {
  const auto meshes = gshard::testing::meshes_for_world(false, false);
  for (const auto& mc : meshes) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t;
    check_all_pairs<1, bf16>(m, {3 * W}, t);
    check_all_pairs<2, bf16>(m, {2 * W, W}, t);
    check_all_pairs<3, bf16>(m, {W, 2 * W, 3 * W}, t);
    INFO("mesh " << mc.name << ": " << t.pairs << " pairs");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    tally tw;  // fp32 tensors with bf16 on the wire, extents that divide and that do not
    check_wire_pairs<2>(m, {2 * W, W}, tw);
    check_wire_pairs<2>(m, {W + 1, 3}, tw);
    GSHARD_REQUIRE_MSG(tw.first_failure.empty(), tw.first_failure);
    GSHARD_REQUIRE(std::size_t(tw.pairs) == 2 * all_layouts(2, m.naxes()).size() * all_layouts(2, m.naxes()).size());
    // Token ids would round above 256: integer tensors are refused.
    const local_tensor<std::int32_t, 1> ids(W);
    rlayout rows;
    rows.push(0, 0);
    const detail::reshard_steps gather_ids = detail::plan_reshard(rows, rlayout{}, m.naxes(), m.sizes());
    const shape<1> id_extents{W * W};
    GSHARD_REQUIRE_THROWS_WITH((detail::execute_reshard_on<std::int32_t, 1>(wire::bf16, m, gather_ids, ids, id_extents)), error,
                               "gshard::reshard: wire::bf16 carries float or double tensors; this one is i32");
    GSHARD_REQUIRE(std::size_t(t.pairs) == all_layouts(1, m.naxes()).size() * all_layouts(1, m.naxes()).size() +
                                               all_layouts(2, m.naxes()).size() * all_layouts(2, m.naxes()).size() +
                                               all_layouts(3, m.naxes()).size() * all_layouts(3, m.naxes()).size());
  }
}

TEST_CASE("every reshard pair with wire::trimmed gives the plain plan's shard to the bit, its all_to_alls without the zero rows",
          "[reshard][exhaustive][trimmed]") {
  const auto meshes = gshard::testing::meshes_for_world(false, false);
  for (const auto& mc : meshes) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t;
    int all_to_alls = 0, fewer = 0;
    check_trimmed_pairs<2>(m, {4 * W, 3}, t, all_to_alls, fewer);
    check_trimmed_pairs<3>(m, {2 * W, 2 * W + 1, 3}, t, all_to_alls, fewer);  // pieces padded where they do not divide
    INFO("mesh " << mc.name << ": " << t.pairs << " pairs, " << all_to_alls << " all_to_alls, " << fewer
                 << " of them in fewer bytes");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    GSHARD_REQUIRE(std::size_t(t.pairs) == all_layouts(2, m.naxes()).size() * all_layouts(2, m.naxes()).size() +
                                               all_layouts(3, m.naxes()).size() * all_layouts(3, m.naxes()).size());
    GSHARD_REQUIRE((all_to_alls > 0 && fewer > 0));  // at 1 rank too: a rank's own piece counts as sent
    const std::vector<float> send(std::size_t(6 * W));
    std::vector<float> recv(send.size());
    GSHARD_REQUIRE_THROWS_WITH((all_to_all_trimmed<float>(m.all_axes(), send, recv, 4, 1)), error,
                               "gshard::all_to_all_trimmed: a piece of 6 elements is not matrices of 4 rows of 1 elements");
  }
}

// Extents that do not divide: a prime, one below the ranks (empty shards),
// one short of a multiple; on every mesh, every pair, against the global
// tensor, with the padded bytes of every collective.
TEST_CASE("every reshard pair of extents that do not divide matches the global tensor", "[reshard][exhaustive][uneven]") {
  const auto meshes = gshard::testing::meshes_for_world(true, true);
  for (const auto& mc : meshes) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t, tb;
    check_all_pairs<1>(m, {2 * W + 1}, t);
    check_all_pairs<2>(m, {W + 1, W > 1 ? W - 1 : 1}, t);
    check_all_pairs<3>(m, {3, 2 * W - 1, 5}, t);
    check_all_pairs<2, bf16>(m, {W + 1, 7}, tb);
    INFO("mesh " << mc.name << ": " << t.pairs << " pairs, " << t.uneven_steps << " collectives on uneven shards");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    GSHARD_REQUIRE_MSG(tb.first_failure.empty(), tb.first_failure);
    const std::size_t nl1 = all_layouts(1, m.naxes()).size(), nl2 = all_layouts(2, m.naxes()).size(),
                      nl3 = all_layouts(3, m.naxes()).size();
    GSHARD_REQUIRE(std::size_t(t.pairs) == nl1 * nl1 + nl2 * nl2 + nl3 * nl3);
    GSHARD_REQUIRE((W == 1 ? t.uneven_steps == 0 : t.uneven_steps > 0));
  }
}

TEST_CASE("zero-size and size-1 dims reshard too", "[reshard][exhaustive]") {
  dyn2 m(MPI_COMM_WORLD, {1, world_size()});
  tally t;
  check_all_pairs<3>(m, {0, index_t(world_size()), 2 * index_t(world_size())}, t);
  check_all_pairs<2>(m, {index_t(world_size()), 0}, t);
  const int before = t.pairs;
  dyn1 m1(MPI_COMM_WORLD);
  check_all_pairs<2>(m1, {index_t(world_size()), 1}, t);  // dim 1's one element on the first rank, the others empty
  GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
  GSHARD_REQUIRE(t.pairs - before == 16);
}

TEST_CASE("typed reshard runs the compile-time plan, equal to the run-time planner", "[reshard]") {
  if (world_size() != 4) return;  // a static (2,2) mesh needs 4 ranks
  using grid = mesh<axis<"x", 2>, axis<"y", 2>>;
  grid m(MPI_COMM_WORLD);
  using A = sharding<split<0, "x", "y">>;
  using B = sharding<split<0, "y", "x">>;
  using C = sharding<split<1, "y">, partial<"x">>;
  using D = sharding<split<0, "x">, split<2, "y">>;
  using E = sharding<split<2, "y">>;  // x holds nothing: needs the x part gathered
  const auto g = global_tensor<3>({4, 8, 4});
  auto a = distribute<A>(m, g);

  auto check = [&]<class From, class To>(const auto& x) {
    using plan = reshard_plan<grid, 3, From, To>;
    const auto runtime = detail::plan_reshard(plan::from, plan::to, 2, m.sizes());
    collective_recorder rec;
    auto y = reshard<To>(x);
    bool ok = runtime == plan::steps && rec.events().size() == std::size_t(plan::steps.collectives());
    const auto full = gather(y);
    for (index_t i = 0; i < g.size() && ok; ++i) ok = full.data()[i] == g.data()[i];
    return std::pair{ok, y};
  };
  auto [ok1, b] = check.operator()<A, B>(a);
  GSHARD_REQUIRE(ok1);
  static_assert(reshard_plan<grid, 3, A, B>::steps.n == 1 &&
                reshard_plan<grid, 3, A, B>::steps.step[0].kind == step_kind::permute);
  auto [ok2, d] = check.operator()<B, D>(b);
  GSHARD_REQUIRE(ok2);
  auto c = distribute<C>(m, g);
  auto [ok3, e] = check.operator()<C, E>(c);
  GSHARD_REQUIRE(ok3);
  auto [ok4, a2] = check.operator()<D, A>(d);
  GSHARD_REQUIRE(ok4);
  (void)e;
  (void)a2;
}

namespace {

// This rank's share of <a, b>: summed over the mesh, each pair of shards
// counts once — divided by the sizes of the axes along which both are
// replicated copies. (Along an axis where one of them holds pending summands,
// the sum over the ranks is the inner product with the sum.)
template <int R>
double inner_share(const local_tensor<double, R>& a, const rlayout& la, const local_tensor<double, R>& b,
                   const rlayout& lb, const detail::mesh_base& m) {
  double s = 0;
  for (index_t i = 0; i < a.size(); ++i) s += a.data()[i] * b.data()[i];
  for (int ax = 0; ax < m.naxes(); ++ax)
    if (la.is_free(ax) && lb.is_free(ax)) s /= double(m.size(ax));
  return s;
}

rlayout without_partial(rlayout l) {
  l.partial = 0;
  return l;
}

// The transposed collectives where one axis changes (design, "Backward"):
// all_gather <-> a local slice (dy reduced) or reduce_scatter (dy pending),
// all_to_all <-> all_to_all, all_reduce <-> nothing (dy reduced; a pending dy
// is reduced first: every summand's gradient is the whole dy), a slice <->
// all_gather.
std::optional<std::vector<collective>> transpose_table(const axis_state& from, const axis_state& to, bool pending) {
  using C = collective;
  if (from.kind == 2 && to.kind == 0) return pending ? std::vector{C::reduce_scatter} : std::vector<C>{};
  if (from.kind == 0 && to.kind == 2) return std::vector{C::all_gather};
  if (from.kind == 2 && to.kind == 2 && from.dim != to.dim) return std::vector{C::all_to_all};
  if (from.kind == 1 && to.kind == 0) return pending ? std::vector{C::all_reduce} : std::vector<C>{};
  return std::nullopt;
}

// For every (from, to): y = reshard(x), dx = reshard_backward(dy) with dy
// reduced and with dy pending over every axis y is replicated on. The
// adjoint identity <y, dy> = <x, dx> must hold, and single-axis changes must
// run the transposed collective.
template <int R>
void check_transposes(const detail::mesh_base& m, const shape<R>& ge, tally& t) {
  const std::vector<rlayout> layouts = gshard::testing::all_layouts(R, m.naxes());
  const auto gx = gshard::testing::random_tensor<R>(ge, 11), gdy = gshard::testing::random_tensor<R>(ge, 12);
  std::vector<double> sides;  // per case: this rank's shares of <y,dy> and <x,dx>, summed once at the end
  std::vector<std::string> cases;
  for (const rlayout& from : layouts) {
    const auto x = shard_of<R>(gx, from, m);
    for (const rlayout& to : layouts) {
      const auto y = detail::execute_reshard<double, R>(m, detail::plan_reshard(from, to, m.naxes(), m.sizes()), x, ge);
      for (bool pending : {false, true}) {
        ++t.pairs;
        rlayout dyl = without_partial(to);
        if (pending)
          for (int a = 0; a < m.naxes(); ++a)
            if (to.is_free(a)) dyl.partial |= 1u << a;
        const rlayout dxl = without_partial(from);
        const auto dy = shard_of<R>(gdy, dyl, m);
        collective_recorder rec;
        const auto dx = detail::execute_reshard<double, R>(m, detail::plan_reshard(dyl, dxl, m.naxes(), m.sizes()), dy, ge);
        const auto events = rec.events();
        const std::string what = show(from, m, R) + " -> " + show(to, m, R) + (pending ? ", dy pending" : ", dy reduced") +
                                 " on " + m.describe();
        sides.push_back(inner_share<R>(y, to, dy, dyl, m));
        sides.push_back(inner_share<R>(x, from, dx, dxl, m));
        cases.push_back(what);
        int changed = -1, nchanged = 0;
        for (int a = 0; a < m.naxes(); ++a)
          if (!(state_of(from, a) == state_of(to, a))) {
            changed = a;
            ++nchanged;
          }
        // The table speaks of the changed axis alone: a dy pending over an
        // unchanged axis also needs its own reduction.
        if (nchanged != 1 || (dyl.partial & ~(1u << changed)) != 0) continue;
        if (auto want = transpose_table(state_of(from, changed), state_of(to, changed), pending)) {
          ++t.table_checked;
          std::vector<collective> got;
          for (const auto& e : events) got.push_back(e.kind);
          if (got != *want) t.fail(what + ": not the transposed collective");
        }
      }
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, sides.data(), int(sides.size()), MPI_DOUBLE, MPI_SUM, m.comm());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const double lhs = sides[2 * i], rhs = sides[2 * i + 1];
    if (std::abs(lhs - rhs) > 1e-12 * std::max(1.0, std::abs(lhs))) t.fail(cases[i] + ": <y,dy> != <x,dx>");
  }
}

}  // namespace

TEST_CASE("the gradient of every reshard is its transpose: <y,dy> = <x,dx>", "[reshard][exhaustive][grad]") {
  for (const auto& mc : gshard::testing::meshes_for_world(true, false)) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t;
    check_transposes<1>(m, {2 * W}, t);
    check_transposes<2>(m, {2 * W, W}, t);
    INFO("mesh " << mc.name << ": " << t.pairs << " (pair, dy) cases, " << t.table_checked << " checked against the table");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    GSHARD_REQUIRE(t.table_checked > 0);
  }
}

TEST_CASE("the gradient of every reshard of extents that do not divide is its transpose", "[reshard][exhaustive][grad][uneven]") {
  for (const auto& mc : gshard::testing::meshes_for_world(true, false)) {
    const detail::mesh_base& m = *mc.mesh;
    const index_t W = m.nranks();
    tally t;
    check_transposes<1>(m, {2 * W + 1}, t);
    check_transposes<2>(m, {W + 1, 3}, t);
    INFO("mesh " << mc.name << ": " << t.pairs << " (pair, dy) cases");
    GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
    GSHARD_REQUIRE(t.table_checked > 0);
  }
}

TEST_CASE("reshard_backward: typed, with the transposed collectives", "[reshard][grad]") {
  using grid = mesh<axis<"data">, axis<"expert">>;
  const index_t P = world_size();
  grid m(MPI_COMM_WORLD, {1, P});
  using rows = sharding<split<0, "expert">>;
  using cols = sharding<split<1, "expert">>;
  using pending = sharding<partial<"expert">>;
  static_assert(std::is_same_v<gradient_sharding<sharding<split<0, "data">, partial<"expert">>>, sharding<split<0, "data">>>);
  static_assert(std::is_same_v<gradient_sharding<rows>, rows>);
  const auto g = gshard::testing::random_tensor<2>({2 * P, 2 * P}, 5);
  auto kinds = [](const collective_recorder& rec) {
    std::vector<collective> k;
    for (const auto& e : rec.events()) k.push_back(e.kind);
    return k;
  };
  {  // all_gather forward; a pending gradient comes back by one reduce_scatter
    auto dy = distribute<pending>(m, g);  // coordinate 0 holds the values, the rest zeros
    collective_recorder rec;
    const auto dx = reshard_backward<rows>(std::move(dy));
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(dx)>::sharding_type, rows>);
    GSHARD_REQUIRE(kinds(rec) == std::vector{collective::reduce_scatter});
    const auto full = gather(dx);
    double worst = 0;
    for (index_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(full.data()[i] - g.data()[i]));
    GSHARD_REQUIRE(worst < 1e-15);
  }
  {  // all_to_all forward (rows -> cols); all_to_all back
    auto dy = distribute<cols>(m, g);
    collective_recorder rec;
    const auto dx = reshard_backward<rows>(dy);
    GSHARD_REQUIRE(kinds(rec) == std::vector{collective::all_to_all});
    GSHARD_REQUIRE(gather(dx).data()[g.size() - 1] == g.data()[g.size() - 1]);
  }
  {  // all_reduce forward (pending -> replicate); nothing back: every summand's gradient is dy
    auto dy = distribute<replicate>(m, g);
    collective_recorder rec;
    const auto dx = reshard_backward<pending>(dy);
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(dx)>::sharding_type, replicate>);
    GSHARD_REQUIRE(rec.events().empty());
  }
}
