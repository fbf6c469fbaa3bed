// The MoE layer and the Transformer: gating invariants, index form = einsum
// form, every world size and mesh reproducing the 1-rank result (computed on
// each rank over MPI_COMM_SELF), exactly two all_to_alls per MoE forward, and
// the bad inputs of the checklist.
#include <gshard/gshard.hpp>
#include <gshard/model/transformer.hpp>

#include <map>

#include <cmath>
#include <set>

#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using gshard::testing::random_tensor;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using grid2 = mesh<axis<"data">, axis<"expert">>;
using grid1 = mesh<axis<"expert">>;
using grid3 = mesh<axis<"data">, axis<"expert">, axis<"model">>;  // heads and dense FFNs split over "model"
using grid2r = mesh<axis<"expert">, axis<"data">>;  // axis order must not change the communication

// Checks the design's invariants on one routing; returns "" or what broke:
// each slot holds at most one token; a token reaches at most k distinct
// experts; its combine weights sum to at most 1; the slots used in each
// expert of a group are 0..count-1, the j-th choices after every (j-1)-th.
template <class T>
std::string check_invariants(const moe::routing<T>& r) {
  const index_t G = r.groups, S = r.tokens, E = r.experts, C = r.capacity;
  for (index_t g = 0; g < G; ++g) {
    std::vector<int> owner(std::size_t(E * C), -1), kind(std::size_t(E * C), -1);
    for (index_t s = 0; s < S; ++s) {
      T sum = 0;
      std::set<int> experts;
      int routed = 0;
      for (int k = 0; k < r.k; ++k) {
        const std::size_t c = r.choice(g, s, k);
        const int e = r.expert[c];
        if (e < 0) continue;
        ++routed;
        if (e >= E) return "expert id out of range";
        if (r.slot[c] < 0 || r.slot[c] >= C) return "slot out of range";
        const std::size_t at = std::size_t(e * C + r.slot[c]);
        if (owner[at] >= 0) return "a slot holds two tokens";
        owner[at] = int(s);
        kind[at] = k;
        experts.insert(e);
        sum += r.weight[c];
      }
      if (int(experts.size()) != routed) return "a token reaches one expert twice";
      if (sum > T(1) + T(1e-6)) return "combine sums to more than 1";
    }
    for (index_t e = 0; e < E; ++e) {  // slots 0..count-1 used, the j-th choices after the (j-1)-th
      bool hole = false;
      int last_kind = 0;
      for (index_t c = 0; c < C; ++c) {
        const std::size_t at = std::size_t(e * C + c);
        if (owner[at] < 0) hole = true;
        else if (hole) return "an unused slot before a used one";
        if (owner[at] >= 0) {
          if (kind[at] < last_kind) return "a choice placed before an earlier choice";
          last_kind = kind[at];
        }
      }
    }
  }
  return "";
}

}  // namespace

TEST_CASE("gating: capacity, invariants, balanced aux loss, determinism", "[moe][gating]") {
  moe::gating_config cfg;
  GSHARD_REQUIRE(moe::capacity(1024, 8, cfg) == 256);  // 2S/E
  GSHARD_REQUIRE(moe::capacity(6, 8, cfg) == 4);       // the minimum
  cfg.capacity_factor = 1.3;
  GSHARD_REQUIRE(moe::capacity(100, 8, cfg) == 16);    // floor(16.25) = 16
  cfg.capacity_factor = 1.25;
  GSHARD_REQUIRE(moe::capacity(100, 8, cfg) == 16);    // floor(15.6) = 15 -> 16

  for (auto policy : {moe::second_policy::all, moe::second_policy::random}) {
    moe::gating_config c;
    c.second = policy;
    c.capacity_factor = 1.0;  // tight: drops happen
    const index_t G = 3, S = 64, E = 8;
    const auto logits = random_tensor<3, float>({G, S, E}, 5);
    moe::routing<float> r;
    const auto st = moe::route_tokens<float>(logits.data(), G, S, E, 0, 7, c, r);
    const std::string broken = check_invariants(r);
    GSHARD_REQUIRE_MSG(broken.empty(), broken);
    std::int64_t placed = 0;
    for (auto v : st.expert_load) placed += v;
    const std::int64_t wanted = 2 * G * S - st.skipped_at(1);
    GSHARD_REQUIRE(placed + st.dropped_at(0) + st.dropped_at(1) == wanted);
    GSHARD_REQUIRE(st.dropped_at(0) + st.dropped_at(1) > 0);
    if (policy == moe::second_policy::all) GSHARD_REQUIRE(st.skipped_at(1) == 0);
    else GSHARD_REQUIRE(st.skipped_at(1) > 0);
    // The same call again: bit-identical routing.
    moe::routing<float> r2;
    moe::route_tokens<float>(logits.data(), G, S, E, 0, 7, c, r2);
    GSHARD_REQUIRE(r2.expert == r.expert && r2.slot == r.slot && r2.weight == r.weight);
  }

  // Perfectly balanced routing: each expert is the first choice of S/E tokens
  // and the second of S/E others, and by symmetry every expert's mean gate is
  // 1/E: aux = 1 and overload = 1.
  {
    const index_t S = 16, E = 4;
    local_tensor<double, 3> logits(1, S, E);
    logits.setConstant(0.0);
    for (index_t s = 0; s < S; ++s) {
      logits(0, s, s % E) = 2e-3;
      logits(0, s, (s + 1) % E) = 1e-3;
    }
    moe::gating_config all;
    all.second = moe::second_policy::all;
    moe::routing<double> r;
    const auto st = moe::route_tokens<double>(logits.data(), 1, S, E, 0, 0, all, r);
    GSHARD_REQUIRE(std::abs(st.aux_sum - 1.0) < 1e-12);
    GSHARD_REQUIRE(st.overload() == 1.0);
  }
}

TEST_CASE("gating: bad router logits — one expert, no tokens, NaN and Inf, tiny groups", "[moe][gating][errors]") {
  const index_t G = 2, S = 32, E = 4;
  moe::gating_config cfg;
  cfg.second = moe::second_policy::all;
  // All tokens prefer expert 2: capped at capacity, drops counted, experts 0 and 1 and 3 see only seconds.
  local_tensor<float, 3> logits(G, S, E);
  logits.setConstant(0.0f);
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s) {
      logits(g, s, 2) = 5.0f;
      logits(g, s, 1) = 1.0f;
    }
  moe::routing<float> r;
  auto st = moe::route_tokens<float>(logits.data(), G, S, E, 0, 0, cfg, r);
  const index_t C = moe::capacity(S, E, cfg);
  GSHARD_REQUIRE(st.expert_load[2] == 2 * C && st.dropped_at(0) == 2 * (S - C));
  GSHARD_REQUIRE(st.expert_load[0] == 0 && st.expert_load[3] == 0);  // experts with no tokens
  GSHARD_REQUIRE(st.overload() > 1.0);
  GSHARD_REQUIRE(check_invariants(r).empty());

  // NaN and +Inf: those tokens are routed nowhere and counted; ids stay in
  // range. -Inf masks one expert: the token goes to the best of the others.
  logits(0, 3, 1) = std::numeric_limits<float>::quiet_NaN();
  logits(1, 5, 0) = std::numeric_limits<float>::infinity();
  logits(1, 6, 2) = -std::numeric_limits<float>::infinity();  // its favourite
  st = moe::route_tokens<float>(logits.data(), G, S, E, 0, 0, cfg, r);
  GSHARD_REQUIRE(st.invalid == 2);
  GSHARD_REQUIRE(r.expert[r.choice(0, 3, 0)] == -1 && r.expert[r.choice(1, 5, 1)] == -1);
  GSHARD_REQUIRE(r.wanted[r.choice(1, 6, 0)] == 1 && r.wanted[r.choice(1, 6, 1)] != 2);
  GSHARD_REQUIRE(r.gates[std::size_t((1 * S + 6) * E + 2)] == 0.0f);
  GSHARD_REQUIRE(check_invariants(r).empty());

  // Groups smaller than the number of experts: C is the minimum, nothing breaks.
  const auto small = random_tensor<3, float>({5, 3, 8}, 9);
  st = moe::route_tokens<float>(small.data(), 5, 3, 8, 0, 0, {}, r);
  GSHARD_REQUIRE(r.capacity == 4 && st.dropped_at(0) == 0);
  GSHARD_REQUIRE(check_invariants(r).empty());
}

namespace {

// The layer on `m` with parameters and input from fixed seeds; the result
// gathered to every rank, the stats (summed over every group by the layer).
// `collectives` receives all_to_all(expert) + 10 · all_reduce(model) + 100 ·
// the rest (the one all_reduce of the routing statistics over the groups' axes).
template <class T, class Mesh>
std::pair<local_tensor<T, 3>, moe::gating_stats> run_layer(const Mesh& m, shape<3> gsm, index_t H, index_t E,
                                                            const moe::gating_config& cfg, moe::dispatch_mode mode,
                                                            std::size_t* collectives = nullptr) {
  parameters ps(m, 42);
  const moe::layer<T, Mesh> layer(ps, "moe.", gsm[2], H, E);
  named<T, "GSM", Mesh, typename moe::layer<T, Mesh>::at_tokens> x(m, gsm);
  fill_normal(x, 1.0, 7, 99);
  collective_recorder rec;
  tape t(ps, tape::no_grad);
  auto out = layer(t.constant(x), cfg, 3, mode);
  if (collectives) {
    const std::size_t a2a = rec.calls(collective::all_to_all, "expert"), ar = rec.calls(collective::all_reduce, "model");
    *collectives = a2a + 10 * ar + 100 * (rec.events().size() - a2a - ar);
  }
  return {gather(out.y.value()), out.stats};
}

template <class T>
double max_rel_diff(const local_tensor<T, 3>& a, const local_tensor<T, 3>& b) {
  if (a.dimensions() != b.dimensions()) return 1e300;
  double d = 0;
  for (index_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::abs(double(a.data()[i]) - double(b.data()[i])) / (1.0 + std::abs(double(b.data()[i]))));
  return d;
}

}  // namespace

TEST_CASE("MoE layer: every mesh reproduces the 1-rank result with two all_to_alls", "[moe][layer]") {
  // (and one all_reduce of the routing statistics and aux loss over the groups' axes)
  // ... and, with the experts' H split over a "model" axis, one all_reduce over it.
  const int P = world_size();
  const index_t G = 4 * P, S = 24, M = 16, H = 24;
  const index_t E = P == 3 ? 6 : 8;  // divisible by the expert axis
  moe::gating_config cfg;
  cfg.capacity_factor = 1.5;  // some drops, some random skips

  grid2 self(MPI_COMM_SELF, {1, 1});
  const auto [ref, ref_stats] = run_layer<double>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index);
  const auto [ref_f, ref_stats_f] = run_layer<float>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index);

  int meshes = 0;
  auto check = [&](const auto& m, const char* name) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    constexpr std::size_t want = (Mesh::index_of("model") >= 0 ? 12 : 2) + 100;
    ++meshes;
    for (auto mode : {moe::dispatch_mode::index, moe::dispatch_mode::einsum}) {
      std::size_t n = 0;
      const auto [y, st] = run_layer<double>(m, {G, S, M}, H, E, cfg, mode, &n);
      INFO(name << (mode == moe::dispatch_mode::index ? " index" : " einsum"));
      INFO("collectives signature " << n);
      GSHARD_REQUIRE(n == want);  // exactly the two all_to_alls over 'expert' (+ the all_reduce over 'model'), and the statistics
      GSHARD_REQUIRE(max_rel_diff(y, ref) < 1e-12);
      GSHARD_REQUIRE(st.expert_load == ref_stats.expert_load && st.dropped_at(0) == ref_stats.dropped_at(0) &&
                     st.dropped_at(1) == ref_stats.dropped_at(1) && st.skipped_at(1) == ref_stats.skipped_at(1));
      GSHARD_REQUIRE(std::abs(st.aux_sum - ref_stats.aux_sum) < 1e-9);
      const auto [yf, stf] = run_layer<float>(m, {G, S, M}, H, E, cfg, mode);
      GSHARD_REQUIRE(max_rel_diff(yf, ref_f) < 1e-6);
    }
  };
  check(grid1(MPI_COMM_WORLD), "mesh (P)");
  check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
  if (P == 4 || P == 8) check(grid2(MPI_COMM_WORLD, {2, P / 2}), "mesh (2,P/2)");
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  if (P % 2 == 0) check(grid2r(MPI_COMM_WORLD, {P / 2, 2}), "mesh (expert, data)");
  GSHARD_REQUIRE(meshes == (P == 4 || P == 8 ? 5 : P == 2 ? 4 : 3));
}

TEST_CASE("MoE layer: zero tokens, NaN inputs, and experts that do not divide", "[moe][layer][errors]") {
  const int P = world_size();
  grid2 m(MPI_COMM_WORLD, {1, P});
  moe::gating_config cfg;
  // No groups at all: every rank still joins both all_to_alls (and the statistics' all_reduce).
  {
    std::size_t n = 0;
    const auto [y, st] = run_layer<float>(m, {0, 8, 4}, 8, 2 * P, cfg, moe::dispatch_mode::index, &n);
    GSHARD_REQUIRE(n == 102 && y.size() == 0 && st.tokens == 0);
  }
  // NaN in some tokens' inputs: they are routed nowhere (zero output), counted; the rest is finite.
  {
    const index_t G = 2 * P, S = 8, M = 4, E = 2 * P;
    parameters ps(m, 1);
    const moe::layer<float, grid2> layer(ps, "moe.", M, 8, E);
    named<float, "GSM", grid2, moe::layer<float, grid2>::at_tokens> x(m, {G, S, M});
    fill_normal(x, 1.0, 2, 3);
    x.data()[0] = std::numeric_limits<float>::quiet_NaN();  // token 0 of this rank's first group
    tape t(ps, tape::no_grad);
    const auto out = layer(t.constant(x), cfg, 0);
    bool finite_elsewhere = true, zero_there = true;
    for (index_t i = 0; i < out.y.value().local().size(); ++i) {
      if (i < M) zero_there = zero_there && out.y.value().data()[i] == 0.0f;
      else finite_elsewhere = finite_elsewhere && std::isfinite(out.y.value().data()[i]);
    }
    GSHARD_REQUIRE(out.stats.invalid == P && zero_there && finite_elsewhere);  // one per rank's groups
    GSHARD_REQUIRE(check_invariants(*out.route).empty());
  }
  // Experts that do not divide over the expert axis: one clear error on every rank.
  if (P > 1) {
    parameters ps(m, 1);
    GSHARD_REQUIRE_THROWS_WITH((moe::layer<float, grid2>(ps, "moe.", 4, 8, 2 * P + 1)), shape_error,
                               "not divisible into " + std::to_string(P) + " shards over {expert}");
  }
}

TEST_CASE("Transformer: the loss at every world size equals the 1-rank loss", "[moe][model]") {
  const int P = world_size();
  model::config c;
  c.model = 32, c.heads = 2, c.head_dim = 8, c.hidden = 48, c.experts = P == 3 ? 6 : 8, c.layers = 4;
  const index_t B = 2 * P, L = 16;
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);

  auto run = [&](const auto& m, auto* logits_out) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using model_t = model::transformer<double, Mesh>;
    parameters ps(m, 5);
    const model_t tr(ps, c);
    tape t(ps, tape::no_grad);
    collective_recorder rec;
    const auto tokens = distribute<typename model_t::tokens_type>(m, tok);
    rec.reset();
    const auto out = tr.forward(t, tokens, 1);
    const auto ran = rec.tally();
    if (logits_out) *logits_out = gather(out.logits.value());
    return std::tuple{out.ce, out.aux, ran};
  };
  local_tensor<double, 3> ref_logits;
  grid2 self(MPI_COMM_SELF, {1, 1});
  const auto [ref_ce, ref_aux, ref_ran] = run(self, &ref_logits);
  GSHARD_REQUIRE(ref_ce > 4.0 && ref_ce < 8.0);  // about ln 256 before training

  auto check = [&](const auto& m) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    local_tensor<double, 3> logits;
    const auto [ce, aux, ran] = run(m, &logits);
    // Two all_to_alls per MoE layer; over the batch axes one all_reduce for
    // the cross-entropy and one per MoE layer for its statistics; with a
    // "model" axis also one all_reduce over it after each attention (4),
    // dense FFN (2) and expert FFN (2); nothing else.
    constexpr bool split_heads = Mesh::index_of("model") >= 0;
    const std::string batch = m.label(roles_on<Mesh>::batch_mask);
    std::map<std::string, int> want{{"all_to_all(expert)", 4}, {"all_reduce(" + batch + ")", 3}};
    if (split_heads) want["all_reduce(model)"] = 8;
    std::string got;
    for (const auto& [k, v] : ran) got += k + " x" + std::to_string(v) + " ";
    INFO("ran " << got);
    GSHARD_REQUIRE(ran == want);
    GSHARD_REQUIRE(std::abs(ce - ref_ce) < 1e-10 && std::abs(aux - ref_aux) < 1e-10);
    GSHARD_REQUIRE(max_rel_diff(logits, ref_logits) < 1e-10);
  };
  check(grid2(MPI_COMM_WORLD, {1, P}));
  if (P == 4 || P == 8) check(grid2(MPI_COMM_WORLD, {2, P / 2}));
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)));
  if (P % 2 == 0) {  // a setting the "model" axis cannot split: named, on every rank
    grid3 m3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P));
    auto bad = c;
    bad.heads = 3;
    parameters ps(m3, 5);
    GSHARD_REQUIRE_THROWS_WITH((model::transformer<double, grid3>(ps, bad)), shape_error,
                               "gshard::model::transformer: config.heads = 3 is not divisible by the model axes (2 ranks) of mesh(");
  }
}
