// The tensor floor: sharding types, shards and their placement,
// distribute/gather/scatter, element-wise and last-dim ops, reductions, the
// typed collectives, reshard plans and labels. Every result is compared with
// the global tensor every rank builds from the same values.
#include <gshard/gshard.hpp>

#include <algorithm>

#include <array>
#include <cmath>
#include <numeric>
#include <sstream>

#include "testing.hpp"

using namespace gshard;
using gshard::testing::world_rank;
using gshard::testing::world_size;

// ---------------------------------------------------------------------------
// Sharding types are canonical (these run in the compiler).
static_assert(std::is_same_v<sharding<partial<"y", "x">>, sharding<partial<"x", "y">>>);
static_assert(std::is_same_v<sharding<split<1, "a">, split<0, "b">>, sharding<split<0, "b">, split<1, "a">>>);
static_assert(std::is_same_v<sharding<mesh_split<"data", "", "model,expert">>,
                             sharding<split<0, "data">, split<2, "model", "expert">>>);
static_assert(std::is_same_v<sharding<>, replicate>);
static_assert(!std::is_same_v<sharding<split<0, "x", "y">>, sharding<split<0, "y", "x">>>);
// Regression: GCC 12 once made these one type (see detail::canonical).
static_assert(!std::is_same_v<sharding<split<0, "x">>, sharding<split<1, "x">>>);
static_assert(!std::is_same_v<sharding<split<1, "x">, split<0, "y">>, sharding<split<0, "x">, split<1, "y">>>);

using dyn1 = mesh<axis<"x">>;
using dyn2 = mesh<axis<"x">, axis<"y">>;

namespace {
template <class T, int R>
local_tensor<T, R> arange(const shape<R>& e) {
  local_tensor<T, R> t(e);
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = T(i + 1);
  return t;
}
template <class T, int R>
bool equal(const local_tensor<T, R>& a, const local_tensor<T, R>& b) {
  if (a.dimensions() != b.dimensions()) return false;
  for (index_t i = 0; i < a.size(); ++i)
    if (a.data()[i] != b.data()[i]) return false;
  return true;
}
// The shard a rank must hold, cut from the global tensor by the library's one placement function.
template <class X>
local_tensor<typename X::value_type, X::rank> expected_shard(const X& x, const local_tensor<typename X::value_type, X::rank>& g) {
  local_tensor<typename X::value_type, X::rank> out(x.local_extents());
  const auto off = x.offsets();
  const auto le = x.local_extents();
  const shape<X::rank> zero{};
  detail::copy_box(g.data(), x.extents().data(), off.data(), out.data(), le.data(), zero.data(), le.data(), X::rank);
  return out;
}
// The extents of the P shards of n by the documented rule (ceil(n / P)
// each, the tail short or empty), as the notation lists them.
std::string shard_list(index_t n, index_t P) {
  const index_t c = (n + P - 1) / P;
  std::string s;
  for (index_t r = 0; r < P && r < 8; ++r) s += (r ? "," : "") + std::to_string(std::clamp<index_t>(n - r * c, 0, c));
  return P > 8 ? s + ",..." : s;
}
}  // namespace

TEST_CASE("tensor shards: extents, offsets, notation, and extents that do not divide", "[tensor]") {
  const int P = world_size();
  dyn2 m(MPI_COMM_WORLD, {1, P});
  using S = sharding<split<1, "y">, partial<"x">>;
  tensor<float, 3, dyn2, S> t(m, {2, 3 * P, 5});
  GSHARD_REQUIRE(t.local_extents() == (shape<3>{2, 3, 5}));
  GSHARD_REQUIRE(t.offsets() == (shape<3>{0, 3 * index_t(world_rank()), 0}));
  GSHARD_REQUIRE(t.notation() == "f32[2," + std::to_string(3 * P) + "{y},5] partial{x}");
  GSHARD_REQUIRE(t.notation("GSM") == "f32[G,S{y},M] partial{x}");
  GSHARD_REQUIRE((to_string<sharding<split<0, "data", "expert">>>(3, "GSM") == "[G{data,expert},S,M]"));

  // 3P + 1 over P ranks: shards of 4, the last ones short (P = 3: 4,4,2) or
  // empty (P = 5: 4,4,4,4,0), named in the printed form.
  if (P > 1) {
    const index_t n = 3 * P + 1, r = world_rank();
    tensor<float, 3, dyn2, S> u(m, {2, n, 5});
    GSHARD_REQUIRE(u.local_extents() == (shape<3>{2, std::clamp<index_t>(n - 4 * r, 0, 4), 5}));
    GSHARD_REQUIRE(u.offsets() == (shape<3>{0, std::min<index_t>(4 * r, n), 0}));
    GSHARD_REQUIRE(u.notation() == "f32[2," + std::to_string(n) + "{y},5] partial{x} (uneven: " + std::to_string(n) +
                                       "{y} in shards " + shard_list(n, P) + ")");
    GSHARD_REQUIRE(u.notation("GSM") == "f32[G,S{y},M] partial{x} (uneven: S=" + std::to_string(n) + "{y} in shards " +
                                            shard_list(n, P) + ")");
  }
  GSHARD_REQUIRE_THROWS_WITH((tensor<float, 3, dyn2, S>(m, {2, -1, 5})), shape_error, "gshard::tensor: dim 1 of");
  // (A local shard of the wrong extents ends the job: test/abort_on_throw.cpp.)
  // Static extents are checked against the run-time ones.
  using M4 = tensor<float, 2, dyn1, sharding<split<0, "x">>, "", dynamic, 4>;
  GSHARD_REQUIRE_THROWS_WITH(M4(dyn1(MPI_COMM_WORLD), {index_t(P), 5}), shape_error, "dim 1 has static extent 4 but was given 5");
}

TEST_CASE("distribute, gather, gather_to_root and scatter round-trip the global tensor", "[tensor]") {
  const int P = world_size();
  dyn2 m(MPI_COMM_WORLD, {P, 1});
  const auto g = arange<double, 3>({2 * P, 3, 4});
  using S = sharding<split<0, "x">, split<2, "y">>;
  auto t = distribute<S>(m, g);
  GSHARD_REQUIRE(equal(t.local(), expected_shard(t, g)));
  GSHARD_REQUIRE(equal(gather(t), g));
  const auto r = gather_to_root(t);
  GSHARD_REQUIRE(world_rank() == 0 ? equal(r, g) : r.size() == 0);

  local_tensor<double, 3> only_root = world_rank() == 0 ? g : local_tensor<double, 3>();
  collective_recorder rec;
  auto s = scatter<S>(m, only_root);
  GSHARD_REQUIRE(rec.calls(collective::scatter) == 1);
  GSHARD_REQUIRE(equal(s.local(), t.local()));

  // Partial: distribute puts the value on coordinate 0; gather sums it back.
  using Q = sharding<partial<"x">>;
  auto q = distribute<Q>(m, g);
  GSHARD_REQUIRE(equal(gather(q), g));
  GSHARD_REQUIRE(equal(gather_to_root(q), world_rank() == 0 ? g : local_tensor<double, 3>()));
  auto qs = scatter<Q>(m, only_root);
  GSHARD_REQUIRE(equal(gather(qs), g));

  // Extents that do not divide: short and empty shards, the same round trip.
  for (const index_t n : {index_t(2 * P + 1), index_t(P > 1 ? P - 1 : 0)}) {
    const auto gu = arange<double, 3>({n, 3, 5});
    auto u = distribute<S>(m, gu);
    GSHARD_REQUIRE(equal(u.local(), expected_shard(u, gu)));
    GSHARD_REQUIRE(equal(gather(u), gu));
    GSHARD_REQUIRE(equal(gather_to_root(u), world_rank() == 0 ? gu : local_tensor<double, 3>()));
    auto su = scatter<S>(m, world_rank() == 0 ? gu : local_tensor<double, 3>());
    GSHARD_REQUIRE(equal(su.local(), u.local()));
  }
}

TEST_CASE("element-wise algebra on sharded tensors: each rank's shard, no collective", "[tensor][ops]") {
  const int P = world_size();
  dyn2 m(MPI_COMM_WORLD, {P, 1});
  using S = sharding<split<0, "x">>;
  // 300 per rank: one whole block of the packet path and a padded rest (kernels/blockwise.hpp).
  local_tensor<double, 2> a(2 * P, 150), b(2 * P, 150);
  for (index_t i = 0; i < a.size(); ++i) a.data()[i] = 0.25 * double(i % 9) + 0.5, b.data()[i] = 1.5 - 0.125 * double(i % 7);
  const auto x = distribute<S>(m, a), y = distribute<S>(m, b);
  collective_recorder rec;
  const auto r = gather(exp(x - y) * tanh(y) + sqrt(x) / 4.0 - (-x) * 2.0 + log(x) * sigmoid(y) + silu(x) - gelu(-y));
  double worst = 0;
  for (index_t i = 0; i < a.size(); ++i) {
    const double p = a.data()[i], q = b.data()[i];
    const double want = std::exp(p - q) * std::tanh(q) + std::sqrt(p) / 4 + 2 * p + std::log(p) / (1 + std::exp(-q)) +
                        p / (1 + std::exp(-p)) - (q * 0.5 * (1 + std::erf(q / std::sqrt(2.0))) - q);  // gelu(-q) = qΦ(q) - q
    worst = std::max(worst, std::abs(r.data()[i] - want));
  }
  // The expression ran no collective; gather ran one.
  GSHARD_REQUIRE(worst < 1e-12 && rec.events().size() == 1);
  // Pending sums subtract and scale; a rank-0 result is read with scalar().
  using Q = sharding<partial<"x">>;
  const auto s = gather(distribute<Q>(m, a) - 0.5 * distribute<Q>(m, b));
  double worst_q = 0;
  for (index_t i = 0; i < a.size(); ++i) worst_q = std::max(worst_q, std::abs(s.data()[i] - (a.data()[i] - 0.5 * b.data()[i])));
  const auto total = all_reduce<"x">(einsum<"ij,ij->">(x, y));
  double dot = 0;
  for (index_t i = 0; i < a.size(); ++i) dot += a.data()[i] * b.data()[i];
  GSHARD_REQUIRE(worst_q < 1e-12 && std::abs(scalar(total) - dot) < 1e-12);
  // Extents that differ: named, on every rank.
  const auto z = distribute<S>(m, local_tensor<double, 2>(2 * P, 4).setZero());
  GSHARD_REQUIRE_THROWS_WITH(x - z, shape_error, "gshard::operator-: f64[");
  GSHARD_REQUIRE_THROWS_WITH(x * z, shape_error, "differ in extents");
}

TEST_CASE("the row softmax on packets: scaled, any length, and NaN, +inf or only -inf rows as std::exp gives", "[tensor][ops]") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  double worst = 0;
  for (index_t n = 1; n <= 40; ++n)
    for (const float scale : {1.0f, 0.37f}) {
      std::vector<float> in(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
      std::vector<long double> ref(static_cast<std::size_t>(n));
      for (index_t i = 0; i < n; ++i) in[std::size_t(i)] = i % 5 == 4 ? -inf : 3.0f * std::sin(float(i) * 1.7f);
      const double lse = detail::softmax_row(in.data(), n, out.data(), scale);
      long double mx = -INFINITY, sum = 0;
      for (index_t i = 0; i < n; ++i) mx = std::max(mx, (long double)scale * in[std::size_t(i)]);
      for (index_t i = 0; i < n; ++i) sum += (ref[std::size_t(i)] = std::exp((long double)scale * in[std::size_t(i)] - mx));
      for (index_t i = 0; i < n; ++i) worst = std::max(worst, double(std::abs(out[std::size_t(i)] - ref[std::size_t(i)] / sum)));
      worst = std::max(worst, std::abs(lse - double(mx + std::log(sum))) / (1 + std::abs(lse)));
    }
  INFO("worst difference from long double " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
  const auto row_of = [](std::vector<float> in) {
    std::vector<float> out(in.size());
    const double lse = detail::softmax_row(in.data(), index_t(in.size()), out.data());
    bool all_nan = std::isnan(lse);
    for (float v : out) all_nan = all_nan && std::isnan(v);
    return all_nan;
  };
  GSHARD_REQUIRE(row_of({1.0f, nan, 2.0f}));
  GSHARD_REQUIRE(row_of({nan}));
  GSHARD_REQUIRE(row_of({1.0f, inf, 2.0f, 0.5f, 0.25f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f}));
  GSHARD_REQUIRE(row_of({-inf, -inf, -inf}));
}

TEST_CASE("element-wise functions on Eigen's packets agree with their one-value forms, forward and backward, in any block",
          "[tensor][ops]") {
  // 1000 values: three whole blocks of 256 and a padded rest of 232; each
  // function and derivative against its scalar form (std:: functions).
  const auto check = [](auto op, auto zero) {
    using Op = decltype(op);
    using T = decltype(zero);
    std::vector<T> x(1000), y(1000), g(1000), want_y(1000), want_g(1000);
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = T(0.01) + T(0.0137) * T(i % 500) * (i % 3 == 0 ? T(-1) : T(1));  // negatives for relu, positives for log/sqrt
      if (std::is_same_v<Op, detail::log_op> || std::is_same_v<Op, detail::sqrt_op>) x[i] = std::abs(x[i]);
      g[i] = T(1) + T(0.001) * T(i);
      want_y[i] = Op::f(x[i]);
      want_g[i] = Op::df(x[i], want_y[i], g[i]);
    }
    y = x;
    detail::elementwise<Op>(y.data(), index_t(y.size()));
    detail::elementwise_backward<Op>(g.data(), x.data(), y.data(), index_t(g.size()));
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i)
      worst = std::max({worst, std::abs(double(y[i] - want_y[i])) / (1 + std::abs(double(want_y[i]))),
                        std::abs(double(g[i] - want_g[i])) / (1 + std::abs(double(want_g[i])))});
    return worst;
  };
  double f32 = 0, f64 = 0;
  const auto both = [&](auto op) {
    f32 = std::max(f32, check(op, 0.0f));
    f64 = std::max(f64, check(op, 0.0));
  };
  both(detail::relu_op{}), both(detail::gelu_op{}), both(detail::silu_op{}), both(detail::sigmoid_op{});
  both(detail::exp_op{}), both(detail::log_op{}), both(detail::tanh_op{}), both(detail::sqrt_op{});
  INFO("worst relative difference: float " << f32 << ", double " << f64);
  // relu keeps a NaN, in a whole block (packets) and in the rest (one value at a time) alike.
  std::vector<float> r(300, -1.0f);
  r[7] = r[290] = std::numeric_limits<float>::quiet_NaN();
  detail::elementwise<detail::relu_op>(r.data(), index_t(r.size()));
  GSHARD_REQUIRE((std::isnan(r[7]) && std::isnan(r[290]) && r[8] == 0.0f && r[289] == 0.0f));
  // The gradients' global norm: a block of float squares that overflows is summed in double.
  std::vector<float> big(300, 1e20f);
  const double sq = detail::sum_of_squares<float>(big);
  GSHARD_REQUIRE(std::abs(sq / (300 * 1e40) - 1) < 1e-6);
  GSHARD_REQUIRE(f32 < 4e-6);  // Eigen's float exp and tanh are within a few ulp of std::'s
  GSHARD_REQUIRE(f64 < 1e-13);
}

TEST_CASE("max, min and sum over a dim: each rank its shard, then the collective the split implies", "[tensor][ops]") {
  const int P = world_size();
  dyn2 m(MPI_COMM_WORLD, {P, 1});
  using S = sharding<split<0, "x">, split<2, "y">>;
  // Dim 0 even, short on the last rank, and empty on some (P - 1 over P):
  // max and min see their identities there, the sum adds nothing.
  for (const index_t n0 : {index_t(2 * P), index_t(2 * P + 1), index_t(std::max(P - 1, 1))}) {
    INFO("dim 0 of extent " << n0);
    local_tensor<double, 3> a(n0, 5, 3);
    for (index_t i = 0; i < a.size(); ++i) a.data()[i] = double((i * 7919) % 101) - 50;
    const auto x = distribute<S>(m, a);
    auto ref = [&](int dim, int op) {  // op 0: max, 1: min, 2: sum
      std::array<index_t, 3> e{a.dimension(0), a.dimension(1), a.dimension(2)};
      std::array<index_t, 2> o{};
      for (int d = 0, k = 0; d < 3; ++d)
        if (d != dim) o[std::size_t(k++)] = e[std::size_t(d)];
      local_tensor<double, 2> r(o[0], o[1]);
      for (index_t i = 0; i < o[0]; ++i)
        for (index_t j = 0; j < o[1]; ++j) {
          double acc = op == 0 ? -1e300 : op == 1 ? 1e300 : 0;
          for (index_t k = 0; k < e[std::size_t(dim)]; ++k) {
            std::array<index_t, 3> at{};
            for (int d = 0, q = 0; d < 3; ++d) at[std::size_t(d)] = d == dim ? k : (q++ == 0 ? i : j);
            const double v = a(at[0], at[1], at[2]);
            acc = op == 0 ? std::max(acc, v) : op == 1 ? std::min(acc, v) : acc + v;
          }
          r(i, j) = acc;
        }
      return r;
    };
    collective_recorder rec;
    const auto mx = reduce_max<0>(x);  // dim 0 split over x: one all_reduce(max) over x; [5,3{y}]
    GSHARD_REQUIRE(rec.calls(collective::all_reduce, "x") == 1);
    const auto mn = reduce_min<1>(x);  // dim 1 whole: no collective; [2P{x},3{y}]
    const auto sm = reduce_sum<0>(x);  // dim 0 split: pending sums over x, no collective
    GSHARD_REQUIRE(rec.events().size() == 1);
    static_assert(decltype(sm)::resolved.partial != 0 && decltype(mx)::resolved.partial == 0);
    GSHARD_REQUIRE(equal(gather(mx), ref(0, 0)) && equal(gather(mn), ref(1, 1)) && equal(gather(all_reduce<"x">(sm)), ref(0, 2)));
  }

  // bf16: each row 256 and 256P − 1 ones, split over x. The local sums and
  // the pending sum's all_reduce add in fp32 and round once each: 256P + 256,
  // bf16's rounding of the exact 256P + 255 at every P from 1 to 8. Added in
  // bf16, 256 + 1 would stay 256 at every step, and the sum be 256P.
  local_tensor<bf16, 2> h(3, 256 * P);
  h.setConstant(bf16(1.0f));
  for (index_t r = 0; r < 3; ++r) h(r, 0) = bf16(256.0f);
  const auto hs = all_reduce<"x">(reduce_sum<1>(distribute<sharding<split<1, "x">>>(m, h)));
  const auto hm = reduce_max<1>(distribute<sharding<split<1, "x">>>(m, h));
  GSHARD_REQUIRE(float(hs.local()(2)) == float(bf16(256.0f * float(P) + 255.0f)) && float(hm.local()(1)) == 256.0f);
}

TEST_CASE("typed collectives: one collective each, the sharding type follows", "[collectives][reshard]") {
  const int P = world_size();
  dyn2 m(MPI_COMM_WORLD, {P, 1});
  const auto g = arange<double, 2>({2 * P, 3 * P});
  using S0 = sharding<split<0, "x">>;
  auto t = distribute<S0>(m, g);

  collective_recorder rec;
  auto full = all_gather<"x">(t);
  static_assert(std::is_same_v<decltype(full)::sharding_type, replicate>);
  GSHARD_REQUIRE(equal(full.local(), g));

  auto moved = all_to_all<"x", 1>(t);
  static_assert(std::is_same_v<decltype(moved)::sharding_type, sharding<split<1, "x">>>);
  GSHARD_REQUIRE(equal(moved.local(), expected_shard(moved, g)));

  auto p = distribute<sharding<partial<"x">>>(m, g);
  auto summed = all_reduce<"x">(p);
  static_assert(std::is_same_v<decltype(summed)::sharding_type, replicate>);
  GSHARD_REQUIRE(equal(summed.local(), g));

  // An rvalue is reduced in place, with the same collective.
  auto p2 = distribute<sharding<partial<"x">>>(m, g);
  const double* before = p2.data();
  auto summed2 = all_reduce<"x">(std::move(p2));
  GSHARD_REQUIRE(equal(summed2.local(), g));
  GSHARD_REQUIRE(summed2.data() == before);

  auto scattered = reduce_scatter<"x", 1>(p);
  static_assert(std::is_same_v<decltype(scattered)::sharding_type, sharding<split<1, "x">>>);
  GSHARD_REQUIRE(equal(scattered.local(), expected_shard(scattered, g)));

  auto rep = distribute<replicate>(m, g);
  if (world_rank() != 0) rep.local().setZero();
  auto b = broadcast<"x">(rep, 0);
  GSHARD_REQUIRE(equal(b.local(), g));

  const auto ev = rec.events();
  GSHARD_REQUIRE(ev.size() == 6);
  GSHARD_REQUIRE(ev[0].kind == collective::all_gather && ev[1].kind == collective::all_to_all &&
                 ev[2].kind == collective::all_reduce && ev[3].kind == collective::all_reduce &&
                 ev[4].kind == collective::reduce_scatter && ev[5].kind == collective::broadcast);
}

TEST_CASE("reshard plans print their steps", "[reshard]") {
  using grid = mesh<axis<"data", 2>, axis<"expert", 4>>;
  using by_group = sharding<split<1, "data", "expert">>;   // EGCM split over G
  using by_expert = sharding<split<0, "expert">, split<1, "data">>;
  using plan = reshard_plan<grid, 4, by_group, by_expert>;
  static_assert(plan::steps.n == 1 && plan::steps.step[0].kind == step_kind::all_to_all);
  std::ostringstream os;
  os << plan{};
  GSHARD_REQUIRE(os.str() == "reshard [d0,d1{data,expert},d2,d3] -> [d0{expert},d1{data},d2,d3]\n"
                             "  1. all_to_all over expert: d1 -> d0   [d0{expert},d1{data},d2,d3]\n");
  GSHARD_REQUIRE(plan::describe("EGCM", "f32") ==
                 "reshard f32[E,G{data,expert},C,M] -> f32[E{expert},G{data},C,M]\n"
                 "  1. all_to_all over expert: G -> E   f32[E{expert},G{data},C,M]\n");
  using same = reshard_plan<grid, 2, by_group, by_group>;
  GSHARD_REQUIRE(same::describe() == "reshard [d0,d1{data,expert}] -> [d0,d1{data,expert}]\n  (no steps: the shardings are equal)\n");
  if (world_size() == 8) {
    grid g(MPI_COMM_WORLD);
    const std::string d = plan::describe<float>(g, {8, 8, 4, 16}, "EGCM");
    GSHARD_REQUIRE(d == "reshard f32[E,G{data,expert},C,M] -> f32[E{expert},G{data},C,M] on mesh(data=2, expert=4)\n"
                        "  1. all_to_all over expert: G -> E   f32[E{expert},G{data},C,M]   2048 B/rank\n");
    GSHARD_REQUIRE(d.find("2048 B/rank") != std::string::npos);  // 8*1*4*16 floats
  }
}

namespace {
using grid_dem = mesh<axis<"data">, axis<"expert">, axis<"model">>;
using at_groups = rules<on<'G', "data", "expert">, on<'H', "model">>;
using at_experts = rules<on<'E', "expert">, on<'G', "data">, on<'H', "model">>;
// Rules resolve to the canonical positional types, whatever order they were written in.
static_assert(std::is_same_v<sharding_by<at_groups, "GSM">, sharding<split<0, "data", "expert">>>);
static_assert(std::is_same_v<sharding_by<at_groups, "EGCM">, sharding<split<1, "data", "expert">>>);
static_assert(std::is_same_v<sharding_by<at_experts, "EGCM">, sharding<split<0, "expert">, split<1, "data">>>);
static_assert(std::is_same_v<sharding_by<at_experts, "EGCH">, sharding<split<0, "expert">, split<1, "data">, split<3, "model">>>);
static_assert(std::is_same_v<sharding_by<at_experts, "EMH">, sharding<split<0, "expert">, split<2, "model">>>);
static_assert(std::is_same_v<sharding_by<at_groups, "ME">, replicate>);
static_assert(std::is_same_v<sharding_by<at_groups, "GECM">, sharding<split<0, "data", "expert">>>);  // GShard's GECM: no new alias
static_assert(std::is_same_v<at_experts, rules<on<'H', "model">, on<'G', "data">, on<'E', "expert">>>);
static_assert(at_experts::text == "E{expert} G{data} H{model}");
// The roles' tables: the expert axes minor-most in G whatever the mesh order.
static_assert(roles_on<grid_dem>::at_tokens::text == "B{data,expert} G{data,expert} H{model} N{model}");
static_assert(roles_on<mesh<axis<"expert">, axis<"data">>>::at_tokens::text == "B{data,expert} G{data,expert}");
static_assert(roles_on<grid_dem>::at_experts::text == "B{data} E{expert} G{data} H{model} N{model}");
static_assert(roles_on<mesh<axis<"data">, axis<"expert">>>::model_mask == 0);
}  // namespace

TEST_CASE("labels: rules give shardings by dim name, einsums label their outputs, relabel is free", "[labels]") {
  const int P = world_size();
  grid_dem m(MPI_COMM_WORLD, {1, P, 1});
  using gsm = named<float, "GSM", grid_dem, at_groups>;
  gsm x(m, {2 * index_t(P), 3, 4});
  GSHARD_REQUIRE(x.notation() == "f32[G{data,expert},S,M]");
  // An einsum of labelled operands is labelled with its output term, and a
  // rules table names its output sharding.
  named<float, "ME", grid_dem, at_groups> w(m, {4, 5});
  const auto logits = einsum<"GSM,ME->GSE">(x, w);
  static_assert(decltype(logits)::labels == "GSE");
  GSHARD_REQUIRE(logits.notation() == "f32[G{data,expert},S,E]");
  named<float, "EGCM", grid_dem, at_groups> xe(m, {2 * index_t(P), 2 * index_t(P), 3, 4});
  collective_recorder rec;
  const auto at_e = reshard<at_experts>(xe);  // one all_to_all over expert
  static_assert(std::is_same_v<decltype(at_e)::sharding_type, sharding_by<at_experts, "EGCM">>);
  GSHARD_REQUIRE(rec.calls(collective::all_to_all, "expert") == 1 && rec.events().size() == 1);
  GSHARD_REQUIRE(at_e.notation() == "f32[E{expert},G{data},C,M]");
  // relabel: an rvalue keeps its storage; an lvalue is copied.
  const float* before = x.data();
  auto y = relabel<"BLM">(std::move(x));
  GSHARD_REQUIRE(y.data() == before && y.notation() == "f32[B{data,expert},L,M]");
  const auto z = relabel<"">(y);
  GSHARD_REQUIRE(z.data() != y.data() && z.notation() == "f32[" + std::to_string(2 * P) + "{data,expert},3,4]");
  // The printed form names a dim whose shards differ by its label.
  if (P > 1)
    GSHARD_REQUIRE(gsm(m, {index_t(P) + 1, 3, 4}).notation() == "f32[G{data,expert},S,M] (uneven: G=" +
                                                                     std::to_string(P + 1) + "{data,expert} in shards " +
                                                                     shard_list(P + 1, P) + ")");
}

