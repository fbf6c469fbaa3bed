// Exhaustive resharding: every (source, target) pair of shardings of rank-1,
// 2 and 3 tensors over every mesh that fits the world — (P), (1,P), (P,1),
// (2,2) at 4 ranks, (2,4) and (4,2) at 8 — against the global tensor, with
// the exact collectives checked against the plan and against the design's
// transition table wherever a single axis changes.
#include <gshard/gshard.hpp>

#include <algorithm>
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

// The design's table for a change of one axis; nullopt where it says nothing.
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
  int pairs = 0, table_checked = 0, permutes = 0;
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

template <int R>
void check_all_pairs(const detail::mesh_base& m, const shape<R>& ge, tally& t) {
  const auto g = global_tensor<R>(ge);
  // Layouts whose split dims divide: the others are refused when a tensor is
  // built (tested in test_core.cpp), so no reshard can see them.
  std::vector<rlayout> layouts;
  for (const rlayout& l : all_layouts(R, m.naxes())) {
    bool divides = true;
    for (int d = 0; d < R; ++d) divides = divides && ge[std::size_t(d)] % detail::dim_parts(l, d, m.sizes()) == 0;
    if (divides) layouts.push_back(l);
  }
  for (const rlayout& from : layouts) {
    const auto src = shard_of<R>(g, from, m);
    for (const rlayout& to : layouts) {
      ++t.pairs;
      const std::string what = show(from, m, R) + " -> " + show(to, m, R) + " on " + m.describe();
      const detail::reshard_steps plan = detail::plan_reshard(from, to, m.naxes(), m.sizes());
      if (!(plan.state[plan.n] == to)) {
        t.fail(what + ": plan does not reach the target");
        continue;
      }
      collective_recorder rec;
      auto out = detail::execute_reshard<double, R>(m, plan, src, ge);
      const auto events = rec.events();

      // 1. Values: the target shard, after summing pending sums (raw MPI, not counted).
      const shape<R> le = detail::local_extents<R>(to, ge, m), off = detail::global_offsets<R>(to, ge, m), zero{};
      bool ok = detail::dims_of<R>(out) == le;
      if (ok && to.partial)
        MPI_Allreduce(MPI_IN_PLACE, out.data(), int(out.size()), MPI_DOUBLE, MPI_SUM, m.group(to.partial).comm);
      if (ok) {
        local_tensor<double, R> want(le);
        if (want.size() > 0) detail::copy_box(g.data(), ge.data(), off.data(), want.data(), le.data(), zero.data(), le.data(), R);
        for (index_t i = 0; i < want.size() && ok; ++i) ok = out.data()[i] == want.data()[i];
      }
      if (!ok) t.fail(what + ": wrong values");

      // 2. Collectives: exactly the plan's, with its axes and bytes.
      std::vector<collective_event> planned;
      for (int i = 0; i < plan.n; ++i) {
        const auto& s = plan.step[i];
        if (!is_collective(s.kind)) continue;
        const std::uint32_t mask = s.mask;
        const shape<R> e = detail::local_extents<R>(plan.state[i], ge, m);
        planned.push_back({collective_of(s.kind), m.label(mask), std::size_t(detail::product<R>(e)) * sizeof(double)});
        if (s.kind == step_kind::permute) ++t.permutes;
      }
      if (events != planned) t.fail(what + ": collectives differ from the plan");

      // 3. The design's table, where exactly one axis changes.
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
      if (same_sets && !(events.size() == 1 && events[0].kind == collective::permute)) t.fail(what + ": reordering is not one permute");
    }
  }
}

}  // namespace

TEST_CASE("every reshard pair of rank-1..3 tensors on every mesh matches the global tensor", "[reshard][exhaustive]") {
  const auto meshes = gshard::testing::meshes_for_world(true, true);
  const int P = world_size();
  const std::size_t expected_meshes = 3 + (P == 4 ? 1 : 0) + (P == 8 ? 2 : 0);
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

TEST_CASE("zero-size and size-1 dims reshard too", "[reshard][exhaustive]") {
  dyn2 m(MPI_COMM_WORLD, {1, world_size()});
  tally t;
  check_all_pairs<3>(m, {0, index_t(world_size()), 2 * index_t(world_size())}, t);
  check_all_pairs<2>(m, {index_t(world_size()), 0}, t);
  const int before = t.pairs;
  dyn1 m1(MPI_COMM_WORLD);
  check_all_pairs<2>(m1, {index_t(world_size()), 1}, t);  // dim 1 splits only on one rank
  GSHARD_REQUIRE_MSG(t.first_failure.empty(), t.first_failure);
  GSHARD_REQUIRE(t.pairs - before == (world_size() == 1 ? 16 : 9));
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
