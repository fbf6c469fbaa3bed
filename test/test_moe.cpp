// The MoE layer and the Transformer: gating invariants, index form = einsum
// form, every world size and mesh reproducing the 1-rank result (computed on
// each rank over MPI_COMM_SELF), exactly two all_to_alls per MoE forward, and
// the bad inputs of the checklist.
#include <gshard/gshard.hpp>
#include <gshard/model/seq2seq.hpp>
#include <gshard/model/transformer.hpp>

#include <filesystem>
#include <map>
#include <optional>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <tuple>

#include "cost_tally.hpp"
#include "gradcheck.hpp"
#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using gshard::testing::random_tensor;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {
template <class V>
double loss_value(const V& v) {
  return double(v.value().local()());
}
}  // namespace

namespace {

using grid2 = mesh<axis<"data">, axis<"expert">>;
using grid1 = mesh<axis<"expert">>;
using grid3 = mesh<axis<"data">, axis<"expert">, axis<"model">>;  // heads and dense FFNs split over "model"
using grid2r = mesh<axis<"expert">, axis<"data">>;  // axis order must not change the communication

// Checks GShard's invariants on one routing (docs/05_moe.md); returns "" or what broke:
// each slot holds at most one token; a token reaches at most k distinct
// experts; its combine weights sum to at most 1; the slots used in each
// expert of a group are 0..count-1, and in the routing's placement order:
// the j-th choices after every (j-1)-th (by choice), or by token.
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
          const bool by_choice = r.order == moe::placement::by_choice;
          if (by_choice && kind[at] < last_kind) return "a choice placed before an earlier choice";
          if (!by_choice && owner[at] < last_kind) return "a token's choice placed before an earlier token's";
          last_kind = by_choice ? kind[at] : owner[at];
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
  // At most S slots (rounded up to 4), however large the factor: never an
  // integer overflow that would drop tokens.
  for (double huge : {20.0, 1e6, 1e300}) {
    cfg.capacity_factor = huge;
    GSHARD_REQUIRE(moe::capacity(100, 8, cfg) == 100);
    GSHARD_REQUIRE(moe::capacity(102, 8, cfg) == 104);
  }
  cfg.capacity_factor = 1.25;

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
    GSHARD_REQUIRE(st.max_over_mean() == 1.0);
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
  GSHARD_REQUIRE(st.max_over_mean() > 1.0);
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

TEST_CASE("gating: top-k for k = 1, 2, 4 — slots, weights, later choices after earlier ones", "[moe][gating][topk]") {
  const index_t G = 3, S = 64, E = 8;
  const auto logits = random_tensor<3, double>({G, S, E}, 21);
  for (int k : {1, 2, 4}) {
    INFO("k = " << k);
    moe::gating_config c;
    c.top_k = k;
    c.second = moe::second_policy::all;
    c.capacity_factor = 1.0;  // binding: drops happen
    moe::routing<double> r;
    const auto st = moe::route_tokens<double>(logits.data(), G, S, E, 0, 7, c, r);
    GSHARD_REQUIRE(r.k == k && r.capacity == moe::capacity(S, E, c));
    GSHARD_REQUIRE(moe::capacity(1024, 8, c) == 1024 * k / 16);  // C = factor · (k/2) · S/E
    const std::string broken = check_invariants(r);
    GSHARD_REQUIRE_MSG(broken.empty(), broken);
    GSHARD_REQUIRE(st.placed() + st.total_dropped() == k * G * S);  // every choice placed or dropped
    GSHARD_REQUIRE(st.total_dropped() > 0);
    for (index_t g = 0; g < G; ++g)
      for (index_t s = 0; s < S; ++s) {
        const double* gate = r.gates.data() + (g * S + s) * E;
        double wanted_sum = 0;
        for (int j = 0; j < k; ++j) {
          const int e = r.wanted[r.choice(g, s, j)];
          GSHARD_REQUIRE(e >= 0);
          wanted_sum += gate[e];
          if (j > 0) GSHARD_REQUIRE(gate[e] <= gate[r.wanted[r.choice(g, s, j - 1)]]);  // best first
          for (index_t o = 0; o < E; ++o) {  // no unchosen expert beats a chosen one
            bool chosen = false;
            for (int i = 0; i < k; ++i) chosen = chosen || r.wanted[r.choice(g, s, i)] == o;
            if (!chosen) GSHARD_REQUIRE(gate[o] <= gate[e]);
          }
        }
        for (int j = 0; j < k; ++j) {
          const std::size_t ch = r.choice(g, s, j);
          if (r.expert[ch] < 0) continue;
          // k = 1: the gate itself (Switch); k >= 2: normalised over the k choices (GShard).
          const double want = k == 1 ? gate[r.expert[ch]] : gate[r.expert[ch]] / (wanted_sum + 1e-9);
          GSHARD_REQUIRE(std::abs(r.weight[ch] - want) < 1e-15);
        }
      }
  }
  // k out of range: named, with the number of experts.
  moe::gating_config bad;
  bad.top_k = 9;
  moe::routing<double> r;
  GSHARD_REQUIRE_THROWS_WITH(moe::route_tokens<double>(logits.data(), G, S, E, 0, 0, bad, r), error,
                             "gshard::moe::gating_config: top_k = 9 must be between 1 and the number of experts (8)");
  bad.top_k = 0;
  GSHARD_REQUIRE_THROWS_WITH(moe::route_tokens<double>(logits.data(), G, S, E, 0, 0, bad, r), error, "top_k = 0");
  bad = {};
  bad.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  GSHARD_REQUIRE_THROWS_WITH(moe::route_tokens<double>(logits.data(), G, S, E, 0, 0, bad, r), error,
                             "capacity_factor = nan must be finite and >= 0");
}

TEST_CASE("gating: Lingvo's edge cases — a zero second gate takes its slot, min_capacity, eval capacity", "[moe][gating][lingvo]") {
  // Lingvo's Top2GatingOnLogits: auto = floor(S · factor / E) for top-2; if
  // it exceeds min_capacity it is rounded up to a multiple of 4, else
  // min_capacity is used as given.
  moe::gating_config c;
  c.min_capacity = 6;
  c.capacity_factor = 1.0;
  GSHARD_REQUIRE(moe::capacity(40, 8, c) == 6);  // auto 5 <= 6: 6, not rounded
  GSHARD_REQUIRE(moe::capacity(48, 8, c) == 6);  // auto 6: 6
  GSHARD_REQUIRE(moe::capacity(56, 8, c) == 8);  // auto 7 > 6: rounded up to 8
  GSHARD_REQUIRE(moe::capacity(56, 8, c, 2.0) == 16);  // an explicit factor (evaluation): auto 14 -> 16

  // Tokens 0-1 prefer expert 0 so strongly that their second gate (expert
  // 1) is exactly 0 in float; tokens 2-7 prefer expert 2, then expert 1.
  // Lingvo places the zero-gate seconds (weight 0) and they take expert
  // 1's first two positions, so with C = 4 only tokens 2 and 3's seconds fit.
  const index_t S = 8, E = 4;
  local_tensor<float, 3> logits(1, S, E);
  for (index_t s = 0; s < S; ++s) {
    const float row[2][4] = {{0.0f, -200.0f, -300.0f, -300.0f}, {-300.0f, 0.0f, 1.0f, -300.0f}};
    for (index_t e = 0; e < E; ++e) logits(0, s, e) = row[s < 2 ? 0 : 1][e];
  }
  moe::gating_config all;
  all.second = moe::second_policy::all;
  all.min_capacity = 4, all.capacity_factor = 0;  // C = 4
  moe::routing<float> r;
  auto st = moe::route_tokens<float>(logits.data(), 1, S, E, 0, 0, all, r);
  GSHARD_REQUIRE(r.capacity == 4);
  GSHARD_REQUIRE(r.gates[1] == 0.0f && r.wanted[r.choice(0, 0, 1)] == 1);                // a zero gate is still a choice
  GSHARD_REQUIRE(r.expert[r.choice(0, 0, 1)] == 1 && r.slot[r.choice(0, 0, 1)] == 0);    // placed, with weight 0
  GSHARD_REQUIRE(r.weight[r.choice(0, 0, 1)] == 0.0f && !r.dispatched(r.choice(0, 0, 1)));  // but not dispatched
  GSHARD_REQUIRE(r.slot[r.choice(0, 2, 1)] == 2 && r.slot[r.choice(0, 3, 1)] == 3);
  GSHARD_REQUIRE(r.expert[r.choice(0, 4, 1)] == -1);  // over capacity because of the zero-gate seconds
  GSHARD_REQUIRE(st.dropped_at(0) == 2 && st.dropped_at(1) == 4);  // tokens 6, 7 first; 4-7 second
  GSHARD_REQUIRE(check_invariants(r).empty());
  // Random routing keeps a second choice where 2 · weight > draw: never a zero gate.
  moe::gating_config rnd = all;
  rnd.second = moe::second_policy::random;
  st = moe::route_tokens<float>(logits.data(), 1, S, E, 0, 0, rnd, r);
  GSHARD_REQUIRE(r.expert[r.choice(0, 0, 1)] == -1 && r.expert[r.choice(0, 1, 1)] == -1 && st.skipped_at(1) >= 2);
}

namespace {

// The layer on `m` with parameters and input from fixed seeds: the result
// gathered to every rank, the stats (summed over every group by the layer),
// what broke in this rank's routing ("" if nothing) and the capacity's
// smallest and largest value over the ranks. `collectives` receives
// all_to_all(expert) + 10 · all_reduce(model) + 100 · the rest (the
// all_reduce of the routing statistics over the groups' axes, and dropless
// routing's all_reduce of the largest load). With balance_mode::bias the
// router bias is set to a fixed pattern first.
template <class T>
struct layer_run {
  local_tensor<T, 3> y;
  moe::gating_stats stats;
  std::string broken;
  index_t capacity_min = 0, capacity_max = 0;
  std::size_t collectives = 0;
  std::size_t all_to_all_bytes = 0;  // over "expert", this rank's
};
template <class T, class Mesh>
layer_run<T> run_variant(const Mesh& m, shape<3> gsm, index_t H, index_t E, const moe::gating_config& cfg,
                         moe::dispatch_mode mode, const moe::layer_options& opt = {}) {
  parameters ps(m, 42);
  const moe::layer<T, Mesh> layer(ps, "moe.", gsm[2], H, E, opt);
  if (layer.bias)
    for (index_t e = 0; e < E; ++e) layer.bias->value().data()[e] = 0.2 * double(e % 3) - 0.2;
  named<T, "GSM", Mesh, typename moe::layer<T, Mesh>::at_tokens> x(m, gsm);
  fill_normal(x, 1.0, 7, 99);
  collective_recorder rec;
  tape t(ps, tape::no_grad);
  auto out = layer(t.constant(x), cfg, 3, mode);
  layer_run<T> r;
  const std::size_t a2a = rec.calls(collective::all_to_all, "expert"), ar = rec.calls(collective::all_reduce, "model");
  r.collectives = a2a + 10 * ar + 100 * (rec.events().size() - a2a - ar);
  r.all_to_all_bytes = rec.bytes(collective::all_to_all, "expert");
  r.y = gather(out.y.value());
  r.stats = out.stats;
  r.broken = check_invariants(*out.route);
  long long cap[2] = {-(long long)out.route->capacity, (long long)out.route->capacity};
  MPI_Allreduce(MPI_IN_PLACE, cap, 2, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
  r.capacity_min = index_t(-cap[0]), r.capacity_max = index_t(cap[1]);
  return r;
}
template <class T, class Mesh>
std::pair<local_tensor<T, 3>, moe::gating_stats> run_layer(const Mesh& m, shape<3> gsm, index_t H, index_t E,
                                                            const moe::gating_config& cfg, moe::dispatch_mode mode,
                                                            std::size_t* collectives = nullptr) {
  auto r = run_variant<T>(m, gsm, H, E, cfg, mode);
  if (collectives) *collectives = r.collectives;
  return {std::move(r.y), std::move(r.stats)};
}

// The layer on a recording tape, from fixed seeds: y, and the gradients of
// Σ y·c with respect to x, the router and the experts' first weights,
// gathered; the all_to_alls' calls and this rank's bytes over "expert".
struct layer_grads {
  local_tensor<float, 3> y, gx, gw1;
  local_tensor<float, 2> grouter;
  std::size_t calls = 0, bytes = 0;
};
template <class Mesh>
layer_grads run_with_grads(const Mesh& m, shape<3> gsm, index_t H, index_t E, const moe::gating_config& cfg,
                           const moe::layer_options& o, moe::dispatch_mode mode = moe::dispatch_mode::index) {
  parameters ps(m, 42);
  const moe::layer<float, Mesh> layer(ps, "moe.", gsm[2], H, E, o);
  using X = named<float, "GSM", Mesh, typename moe::layer<float, Mesh>::at_tokens>;
  param<X> x(ps, "x", gsm, init::normal(1.0));
  X c(m, gsm);
  fill_normal(c, 1.0, 8, 98);
  collective_recorder rec;
  tape t(ps);
  auto out = layer(t.use(x), cfg, 3, mode);
  t.backward(reshard<replicate>(einsum<"GSM,GSM->">(out.y, t.constant(c))));
  return layer_grads{gather(out.y.value()), gather(x.grad()), gather(layer.expert_ffn.w1.grad()), gather(layer.router.grad()),
                     rec.calls(collective::all_to_all, "expert"), rec.bytes(collective::all_to_all, "expert")};
}

template <class T>
double l2_rel_diff(const local_tensor<T, 3>& a, const local_tensor<T, 3>& b) {  // ‖a − b‖ / ‖b‖
  if (a.dimensions() != b.dimensions()) return 1e300;
  double d = 0, n = 0;
  for (index_t i = 0; i < a.size(); ++i) {
    d += std::pow(double(a.data()[i]) - double(b.data()[i]), 2);
    n += std::pow(double(b.data()[i]), 2);
  }
  return std::sqrt(d / n);
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
  const index_t E = 8;  // at 3 ranks on the expert axis, 3, 3 and 2 experts: padded all_to_alls
  moe::gating_config cfg;
  cfg.capacity_factor = 1.5;  // some drops, some random skips

  grid2 self(MPI_COMM_SELF, {1, 1});
  const auto [ref, ref_stats] = run_layer<double>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index);
  const auto [ref_f, ref_stats_f] = run_layer<float>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index);
  // Groups that do not divide over the batch axes: the last ranks hold fewer.
  const index_t G_odd = G + 1;
  const auto [ref_odd, ref_odd_stats] = run_layer<double>(self, {G_odd, S, M}, H, E, cfg, moe::dispatch_mode::index);

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
      const auto [yo, so] = run_layer<double>(m, {G_odd, S, M}, H, E, cfg, mode);
      INFO("G = " << G_odd);
      GSHARD_REQUIRE(max_rel_diff(yo, ref_odd) < 1e-12);
      GSHARD_REQUIRE(so.expert_load == ref_odd_stats.expert_load && so.dropped_at(1) == ref_odd_stats.dropped_at(1));
      GSHARD_REQUIRE(std::abs(so.aux_sum - ref_odd_stats.aux_sum) < 1e-9);
    }
    // The all_to_alls pipelined with the experts in 3 chunks of the capacity:
    // three each way (and with a model axis an all_reduce per chunk), the
    // same result to rounding (the chunks' GEMMs run on fewer rows).
    moe::layer_options o;
    o.overlap_degree = 3;
    const auto r = run_variant<double>(m, {G, S, M}, H, E, cfg, moe::dispatch_mode::index, o);
    INFO(name << " overlap_degree 3, collectives signature " << r.collectives << ", capacity " << r.capacity_min);
    GSHARD_REQUIRE(r.capacity_min >= 3);
    GSHARD_REQUIRE(r.collectives == (Mesh::index_of("model") >= 0 ? 36 : 6) + 100);
    GSHARD_REQUIRE(max_rel_diff(r.y, ref) < 1e-12);
    GSHARD_REQUIRE(r.broken.empty());
    // ... and its gradients (the backward's pipeline, with a model axis its
    // all_reduce before each chunk's all_to_all): those of one chunk.
    auto grads = [&](int k) {
      parameters ps(m, 42);
      moe::layer_options ok;
      ok.overlap_degree = k;
      const moe::layer<double, Mesh> layer(ps, "moe.", M, H, E, ok);
      using X = named<double, "GSM", Mesh, typename moe::layer<double, Mesh>::at_tokens>;
      param<X> x(ps, "x", {G, S, M}, init::normal(1.0));
      X c(m, {G, S, M});
      fill_normal(c, 1.0, 8, 98);
      tape t(ps);
      auto out = layer(t.use(x), cfg, 3);
      t.backward(reshard<replicate>(einsum<"GSM,GSM->">(out.y, t.constant(c))) + 0.5 * out.aux);
      std::vector<double> g;  // every parameter's gradient, gathered
      auto add = [&](const auto& p) {
        const auto whole = gather(p.grad());
        g.insert(g.end(), whole.data(), whole.data() + whole.size());
      };
      add(x), add(layer.router), add(layer.expert_ffn.w1), add(layer.expert_ffn.w2);
      return g;
    };
    const auto g1 = grads(1), g3 = grads(3);
    double gd = g1.size() == g3.size() ? 0.0 : 1e300;
    for (std::size_t i = 0; gd < 1e300 && i < g1.size(); ++i) gd = std::max(gd, std::abs(g1[i] - g3[i]) / (1 + std::abs(g1[i])));
    INFO("gradients, overlap_degree 3 against 1: " << gd);
    GSHARD_REQUIRE(gd < 1e-12);
  };
  check(grid1(MPI_COMM_WORLD), "mesh (P)");
  check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
  if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}), "mesh (2,P/2)");
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  if (P % 2 == 0) check(grid2r(MPI_COMM_WORLD, {P / 2, 2}), "mesh (expert, data)");
  GSHARD_REQUIRE(meshes == (P % 2 == 0 && P > 2 ? 5 : P == 2 ? 4 : 3));
}

TEST_CASE("MoE layer under matmul_precision bf16: the router is fp32's to the bit; the experts' GEMMs round", "[moe][layer][bf16]") {
  const int P = world_size();
  const index_t G = 2 * P, S = 16, M = 16, H = 24, E = 8;
  const moe::gating_config cfg;
  grid3 m(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P));
  using at_tokens = moe::layer<float, grid3>::at_tokens;
  auto run = [&](matmul_precision p) {
    const matmul_precision_scope s(p);
    parameters ps(m, 42);
    const moe::layer<float, grid3> layer(ps, "moe.", M, H, E);
    named<float, "GSM", grid3, at_tokens> x(m, {G, S, M});
    fill_normal(x, 1.0, 7, 99);
    tape t(ps, tape::no_grad);
    auto out = layer(t.constant(x), cfg, 3);
    return std::pair{gather(out.y.value()), out.route};
  };
  const auto [y32, r32] = run(matmul_precision::f32);
  const auto [y16, r16] = run(matmul_precision::bf16);
  GSHARD_REQUIRE(r16->gates == r32->gates);  // the softmax of the same fp32 logits
  GSHARD_REQUIRE((r16->expert == r32->expert && r16->slot == r32->slot && r16->weight == r32->weight));
  double worst = 0, scale = 0;
  for (index_t i = 0; i < y32.size(); ++i) {
    worst = std::max(worst, double(std::abs(y32.data()[i] - y16.data()[i])));
    scale = std::max(scale, double(std::abs(y32.data()[i])));
  }
  INFO("bf16 GEMMs " << (detail::gemm_bf16_native() ? "on bf16 units" : "not here") << ": worst difference " << worst
                     << " of " << scale);
  if (detail::gemm_bf16_native()) GSHARD_REQUIRE((worst > 0 && worst < 0x1p-6 * scale));
  else GSHARD_REQUIRE(worst == 0);
}

TEST_CASE("combine keeps expert outputs of bf16 values as bf16 rows: the same gradients to the bit, y's fp32 freed",
          "[moe][combine][bf16]") {
  // The kernels: the bf16 rows give the fp32 rows' output and gradients to
  // the bit; one value that is not bf16 anywhere, and they are not kept.
  {
    moe::gating_config c;
    c.capacity_factor = 1.0;  // tight: some choices dropped
    const index_t G = 3, S = 64, E = 8, M = 24;
    const auto logits = random_tensor<3, float>({G, S, E}, 5);
    moe::routing<float> r;
    moe::route_tokens<float>(logits.data(), G, S, E, 0, 7, c, r);
    std::mt19937 gen(11);
    std::normal_distribution<float> normal;
    std::vector<float> ye(std::size_t(E * G * r.capacity * M)), dout(std::size_t(G * S * M));
    for (float& v : ye) v = float(bf16(normal(gen)));
    for (float& v : dout) v = normal(gen);
    std::vector<float> y(dout.size()), y_kept(dout.size()), dy(ye.size()), dy_kept(ye.size());
    std::vector<float> dw(r.expert.size()), dw_kept(r.expert.size());
    std::vector<std::uint16_t> rows(r.expert.size() * std::size_t(M));
    GSHARD_REQUIRE(moe::detail::placed_rows_may_be_bf16(r, ye.data(), M));
    GSHARD_REQUIRE(!moe::detail::combine_rows(r, r.weight.data(), ye.data(), M, y.data()));
    GSHARD_REQUIRE(moe::detail::combine_rows(r, r.weight.data(), ye.data(), M, y_kept.data(), rows.data()));
    GSHARD_REQUIRE(y_kept == y);
    moe::detail::combine_rows_backward(r, r.weight.data(), dout.data(), ye.data(), nullptr, M, dy.data(), dw.data());
    moe::detail::combine_rows_backward(r, r.weight.data(), dout.data(), static_cast<const float*>(nullptr), rows.data(), M,
                                       dy_kept.data(), dw_kept.data());
    GSHARD_REQUIRE((dw_kept == dw && dy_kept == dy));
    GSHARD_REQUIRE(std::any_of(dw.begin(), dw.end(), [](float v) { return v != 0; }));
    // The last placed row's last value made one fp32 unit off a bf16 value.
    std::size_t last = 0;
    for (std::size_t ch = 0; ch < r.expert.size(); ++ch)
      if (r.expert[ch] >= 0) last = ch;
    float& v = ye[std::size_t((r.slot_row(last, r.group_of(last)) + 1) * M - 1)];
    v = std::nextafter(v, 1e9f);
    GSHARD_REQUIRE(moe::detail::placed_rows_may_be_bf16(r, ye.data(), M));
    GSHARD_REQUIRE(!moe::detail::combine_rows(r, r.weight.data(), ye.data(), M, y_kept.data(), rows.data()));
    // Group 0's choices dropped: the first placed row is group 1's, which
    // the up-front check reads (and refuses once one value is not bf16).
    std::fill(r.expert.begin(), r.expert.begin() + r.k * S, -1);
    std::size_t first = 0;
    while (r.expert[first] < 0) ++first;
    GSHARD_REQUIRE(r.group_of(first) == 1);
    GSHARD_REQUIRE(moe::detail::placed_rows_may_be_bf16(r, ye.data(), M));
    ye[std::size_t(r.slot_row(first, 1) * M)] = std::nextafter(ye[std::size_t(r.slot_row(first, 1) * M)], 1e9f);
    GSHARD_REQUIRE(!moe::detail::placed_rows_may_be_bf16(r, ye.data(), M));
    // Nothing placed: nothing of ye is read, so the rows may be kept (none).
    std::fill(r.expert.begin(), r.expert.end(), -1);
    GSHARD_REQUIRE(moe::detail::placed_rows_may_be_bf16(r, ye.data(), M));
    GSHARD_REQUIRE(moe::detail::combine_rows(r, r.weight.data(), ye.data(), M, y_kept.data(), rows.data()));
  }
  // On the tape, at every mesh: the routed tokens' rows arrive as bf16
  // values (x rounded, as a bf16 all_to_all wire leaves them), and combine
  // keeps its bf16 rows — y's fp32 storage is freed after the forward —,
  // or, with x unrounded, y itself (a rank with no groups keeps nothing).
  // Either way the gradients are the einsum form's (dense_dispatch and
  // dense_combine) to fp32 rounding.
  const int P = world_size();
  const index_t G = 2 * P + 1, S = 16, M = 16, E = 8;  // groups that need not divide
  moe::gating_config cfg;
  cfg.capacity_factor = 1.5;
  grid2 m(MPI_COMM_WORLD, {1, P});
  using at_tokens = moe::layer<float, grid2>::at_tokens;
  const matmul_precision_scope fp32(matmul_precision::f32);  // the einsum form's GEMMs as exact as the rows
  const index_t G_local = named<float, "GSM", grid2, at_tokens>(m, {G, S, M}).local().dimension(0);  // 0 on the last ranks at P ≥ 4
  for (bool rounded : {true, false}) {
    // The gradients of x and the router; and whether y's storage was freed
    // by the end of the forward (index form).
    auto grads = [&](bool dense) {
      parameters ps(m, 42);
      param<named<float, "GSM", grid2, at_tokens>> x(ps, "x", {G, S, M}, init::normal(1.0));
      param<named<float, "ME", grid2, at_tokens>> router(ps, "router", {M, E}, init::normal(0.5));  // replicated
      if (rounded)
        for (index_t i = 0; i < x.value().local().size(); ++i) x.value().data()[i] = float(bf16(x.value().data()[i]));
      named<float, "GSM", grid2, at_tokens> c(m, {G, S, M});
      fill_normal(c, 1.0, 8, 98);
      tape t(ps);
      const auto xv = t.use(x);
      const auto route = moe::gate(einsum<"GSM,ME->GSE">(xv, t.use(router)), cfg, 3);
      std::weak_ptr<const void> y_alive;
      auto out = [&] {
        if (dense)
          return einsum<"GSEC,EGCM->GSM">(moe::dense_combine(route), einsum<"GSEC,GSM->EGCM">(moe::dense_dispatch(route), xv));
        auto ye = moe::dispatch(route, xv);
        y_alive = ye.shared();
        return moe::combine(route, std::move(ye));
      }();
      const bool y_freed = !dense && y_alive.expired();
      t.backward(reshard<replicate>(einsum<"GSM,GSM->">(out, t.constant(c))));
      return std::tuple{gather(x.grad()), gather(router.grad()), y_freed};
    };
    const auto [gx, gr, y_freed] = grads(false);
    const auto [gx_dense, gr_dense, unused] = grads(true);
    INFO((rounded ? "x rounded to bf16" : "x unrounded") << " at " << P << " ranks: x's gradient against the einsum form's "
                                                          << max_rel_diff(gx, gx_dense));
    GSHARD_REQUIRE(y_freed == (rounded || G_local == 0));
    GSHARD_REQUIRE(max_rel_diff(gx, gx_dense) < 1e-5);
    double router_diff = 0;
    for (index_t i = 0; i < gr.size(); ++i)
      router_diff = std::max(router_diff, std::abs(double(gr.data()[i]) - double(gr_dense.data()[i])) /
                                              (1.0 + std::abs(double(gr_dense.data()[i]))));
    INFO("the router's gradient against the einsum form's " << router_diff);
    GSHARD_REQUIRE(router_diff < 1e-5);
  }
}

TEST_CASE("MoE layer with bf16 all_to_alls: 1 rank's result at every mesh in half the bytes, within bf16 of fp32's",
          "[moe][layer][bf16]") {
  const int P = world_size();
  const index_t G = 2 * P + 1, S = 16, M = 16, H = 24, E = 8;  // groups and experts that need not divide
  moe::gating_config cfg;
  cfg.capacity_factor = 1.5;
  moe::layer_options o16;
  o16.all_to_all_wire = wire::bf16;
  grid2 self(MPI_COMM_SELF, {1, 1});
  const auto ref = run_variant<float>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index, o16);
  const auto ref32 = run_variant<float>(self, {G, S, M}, H, E, cfg, moe::dispatch_mode::index);
  // The tokens and the experts' outputs each rounded once: within 2⁻⁸ of
  // each, and not equal (the rounding is there at 1 rank too).
  const double rounding = max_rel_diff(ref.y, ref32.y);
  INFO("1 rank, bf16 all_to_alls against fp32's: " << rounding);
  GSHARD_REQUIRE((rounding > 0 && rounding < 0x1p-6));
  GSHARD_REQUIRE(ref.stats.expert_load == ref32.stats.expert_load);  // the router reads x unrounded

  // The gradient of Σ y·c with respect to x, gathered, and the all_to_alls' bytes.
  auto grad_x = [&](const auto& m, const moe::layer_options& o) {
    const layer_grads r = run_with_grads(m, {G, S, M}, H, E, cfg, o);
    return std::pair{r.gx, r.bytes};
  };
  const auto [gref, ignored] = grad_x(self, o16);
  const auto [gref32, ignored32] = grad_x(self, moe::layer_options{});

  auto check = [&](const auto& m, const char* name) {
    for (int overlap : {1, 3})
      for (auto mode : {moe::dispatch_mode::index, moe::dispatch_mode::einsum}) {
        if (overlap > 1 && mode == moe::dispatch_mode::einsum) continue;
        moe::layer_options o = o16, o32;
        o.overlap_degree = o32.overlap_degree = overlap;
        const auto got = run_variant<float>(m, {G, S, M}, H, E, cfg, mode, o);
        const auto f32 = run_variant<float>(m, {G, S, M}, H, E, cfg, mode, o32);
        INFO(name << (mode == moe::dispatch_mode::index ? " index" : " einsum") << ", overlap_degree " << overlap
                  << ": against 1 rank " << max_rel_diff(got.y, ref.y) << "; all_to_all bytes " << got.all_to_all_bytes
                  << " against fp32's " << f32.all_to_all_bytes);
        GSHARD_REQUIRE_MSG(got.broken.empty(), got.broken);
        // Other GEMM blockings may round an expert's output the other way: one bf16 unit at most.
        GSHARD_REQUIRE(max_rel_diff(got.y, ref.y) < 0x1p-7);
        GSHARD_REQUIRE(got.stats.expert_load == ref.stats.expert_load);
        GSHARD_REQUIRE(got.collectives == f32.collectives);  // the same collectives,
        GSHARD_REQUIRE(2 * got.all_to_all_bytes == f32.all_to_all_bytes);  // their elements 2 bytes, not 4
      }
    const auto [g, bytes] = grad_x(m, o16);
    const auto [g32, bytes32] = grad_x(m, moe::layer_options{});
    INFO(name << ": x's gradient against 1 rank's " << max_rel_diff(g, gref) << ", against fp32's " << l2_rel_diff(g, g32));
    GSHARD_REQUIRE(max_rel_diff(g, gref) < 0x1p-7);
    // Rounded on its two ways back too, and a ReLU whose input the rounding
    // moves across 0 passes or stops a whole hidden unit's gradient: a few
    // elements move by far more than 2⁻⁸, the whole by little.
    GSHARD_REQUIRE(l2_rel_diff(g, g32) < 0x1p-5);
    GSHARD_REQUIRE(2 * bytes == bytes32);
    GSHARD_REQUIRE((P == 1 || bytes > 0));
  };
  check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  GSHARD_REQUIRE(max_rel_diff(gref, gref32) > 0);
}

TEST_CASE("MoE layer with trimmed all_to_alls: the plain all_to_alls' output and gradients to the bit, in fewer bytes",
          "[moe][layer][trimmed]") {
  const int P = world_size();
  const index_t G = 2 * P + 1, S = 16, M = 16, H = 24, E = 8;  // groups and experts that need not divide
  moe::gating_config cfg;
  cfg.capacity_factor = 2;  // room for more than the choices routed: slots stay empty
  auto same_bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.size())) == 0;
  };
  auto check = [&](const auto& m, const char* name) {
    for (wire w : {wire::same, wire::bf16})
      for (int overlap : {1, 3})
        for (auto mode : {moe::dispatch_mode::index, moe::dispatch_mode::einsum}) {
          if (overlap > 1 && mode == moe::dispatch_mode::einsum) continue;
          moe::layer_options plain, trimmed;
          plain.overlap_degree = trimmed.overlap_degree = overlap;
          plain.all_to_all_wire = w;
          trimmed.all_to_all_wire = w | wire::trimmed;
          const layer_grads a = run_with_grads(m, {G, S, M}, H, E, cfg, plain, mode),
                            b = run_with_grads(m, {G, S, M}, H, E, cfg, trimmed, mode);
          INFO(name << (w == wire::bf16 ? ", bf16" : ", fp32") << (mode == moe::dispatch_mode::index ? " index" : " einsum")
                    << ", overlap_degree " << overlap << ": all_to_all bytes " << b.bytes << " trimmed, " << a.bytes
                    << " whole");
          GSHARD_REQUIRE(same_bits(a.y, b.y));
          GSHARD_REQUIRE(same_bits(a.gx, b.gx));
          GSHARD_REQUIRE(same_bits(a.gw1, b.gw1));
          GSHARD_REQUIRE(same_bits(a.grouter, b.grouter));
          GSHARD_REQUIRE(a.calls == b.calls);
          GSHARD_REQUIRE((a.calls == 0 || b.bytes < a.bytes));  // every piece ends in empty slots
        }
  };
  check(grid2(MPI_COMM_SELF, {1, 1}), "1 rank");
  check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
}

TEST_CASE("routing variants: top-k, dropless, shared experts and bias balancing reproduce the 1-rank result", "[moe][layer][variants]") {
  const int P = world_size();
  const index_t G = 4 * P, S = 24, M = 16, H = 24;
  const index_t E = 8;
  struct variant {
    std::string name;
    moe::gating_config cfg;
    moe::layer_options opt;
  };
  std::vector<variant> variants;
  auto cfg_k = [](int k, bool dropless) {
    moe::gating_config c;
    c.capacity_factor = 1.5;  // binding: drops without dropless
    c.top_k = k, c.dropless = dropless;
    c.second = k == 2 ? moe::second_policy::random : moe::second_policy::all;
    return c;
  };
  for (int k : {1, 2, 4}) variants.push_back({"top-" + std::to_string(k), cfg_k(k, false), {}});
  variants.push_back({"dropless top-2", cfg_k(2, true), {}});
  variants.push_back({"dropless top-4", cfg_k(4, true), {}});
  variants.push_back({"top-2 + 2 shared experts", cfg_k(2, false), {ffn_kind::relu, 2, moe::balance_mode::aux}});
  variants.push_back({"top-1 + 1 shared SwiGLU expert", cfg_k(1, false), {ffn_kind::swiglu, 1, moe::balance_mode::aux}});
  auto biased = cfg_k(2, false);
  biased.balance = moe::balance_mode::bias;
  variants.push_back({"top-2, bias balancing", biased, {ffn_kind::relu, 0, moe::balance_mode::bias}});

  grid2 self(MPI_COMM_SELF, {1, 1});
  {  // shared experts add relu(x·w1)·w2 to the routed output, computed here by hand
    parameters ps(self, 42);
    parameters ps_plain(self, 42);  // the same seed and names: the same routed weights
    const moe::layer<double, grid2> with(ps, "moe.", M, H, E, moe::layer_options{ffn_kind::relu, 2, moe::balance_mode::aux});
    const moe::layer<double, grid2> without(ps_plain, "moe.", M, H, E);
    named<double, "GSM", grid2, moe::layer<double, grid2>::at_tokens> x(self, {G, S, M});
    fill_normal(x, 1.0, 7, 99);
    tape t(ps, tape::no_grad), tp(ps_plain, tape::no_grad);
    const auto y = with(t.constant(x), moe::gating_config{}, 3).y.value().local();
    const auto y0 = without(tp.constant(x), moe::gating_config{}, 3).y.value().local();
    const auto& w1 = with.shared->w1.value().local();
    const auto& w2 = with.shared->w2.value().local();
    GSHARD_REQUIRE(w1.dimension(1) == 2 * H);
    double worst = 0;
    std::vector<double> a(std::size_t(2 * H));
    for (index_t g = 0; g < G; ++g)
      for (index_t s = 0; s < S; ++s) {
        for (index_t h = 0; h < 2 * H; ++h) {
          double v = 0;
          for (index_t i = 0; i < M; ++i) v += x.local()(g, s, i) * w1(i, h);
          a[std::size_t(h)] = std::max(v, 0.0);
        }
        for (index_t i = 0; i < M; ++i) {
          double v = 0;
          for (index_t h = 0; h < 2 * H; ++h) v += a[std::size_t(h)] * w2(h, i);
          worst = std::max(worst, std::abs(y(g, s, i) - y0(g, s, i) - v) / (1 + std::abs(v)));
        }
      }
    GSHARD_REQUIRE(worst < 1e-12);
  }
  for (const auto& v : variants) {
    INFO(v.name);
    const auto ref = run_variant<double>(self, {G, S, M}, H, E, v.cfg, moe::dispatch_mode::index, v.opt);
    GSHARD_REQUIRE_MSG(ref.broken.empty(), ref.broken);
    GSHARD_REQUIRE(ref.stats.placed() + ref.stats.total_dropped() + ref.stats.skipped_at(1) == v.cfg.top_k * G * S);
    if (v.cfg.dropless) {
      // Dropless = the reference with capacity S·k: nothing dropped, the same outputs.
      auto full = v.cfg;
      full.dropless = false, full.capacity_factor = 0, full.min_capacity = S * v.cfg.top_k;
      const auto wide = run_variant<double>(self, {G, S, M}, H, E, full, moe::dispatch_mode::index, v.opt);
      GSHARD_REQUIRE(wide.stats.total_dropped() == 0 && ref.stats.total_dropped() == 0);
      GSHARD_REQUIRE(ref.capacity_max < S * v.cfg.top_k);  // the agreed capacity is the largest load, not S·k
      GSHARD_REQUIRE(wide.stats.expert_load == ref.stats.expert_load);
      GSHARD_REQUIRE(max_rel_diff(wide.y, ref.y) < 1e-12);
    } else if (v.cfg.top_k < 4) {
      GSHARD_REQUIRE(ref.stats.total_dropped() > 0);  // the capacity binds: the variants are compared where it matters
    }
    if (v.cfg.balance == moe::balance_mode::bias) {  // the bias moves the choices
      auto plain = v.cfg;
      plain.balance = moe::balance_mode::aux;
      const auto unbiased = run_variant<double>(self, {G, S, M}, H, E, plain, moe::dispatch_mode::index, {});
      GSHARD_REQUIRE(unbiased.stats.expert_load != ref.stats.expert_load);
    }
    auto check = [&](const auto& m, const char* mesh_name) {
      using Mesh = std::remove_cvref_t<decltype(m)>;
      INFO(mesh_name);
      const std::size_t model_reductions = Mesh::index_of("model") >= 0 ? 1 + (v.opt.shared_experts > 0) : 0;
      const std::size_t want = 2 + 10 * model_reductions + 100 * (1 + v.cfg.dropless);
      const auto got = run_variant<double>(m, {G, S, M}, H, E, v.cfg, moe::dispatch_mode::index, v.opt);
      INFO("collectives signature " << got.collectives);
      GSHARD_REQUIRE(got.collectives == want);
      GSHARD_REQUIRE_MSG(got.broken.empty(), got.broken);
      GSHARD_REQUIRE(got.capacity_min == got.capacity_max);  // every rank moves tensors of one shape
      GSHARD_REQUIRE(got.capacity_max == ref.capacity_max);
      GSHARD_REQUIRE(max_rel_diff(got.y, ref.y) < 1e-12);
      GSHARD_REQUIRE(got.stats.expert_load == ref.stats.expert_load && got.stats.dropped == ref.stats.dropped &&
                     got.stats.skipped == ref.stats.skipped);
      GSHARD_REQUIRE(std::abs(got.stats.aux_sum - ref.stats.aux_sum) < 1e-9 &&
                     std::abs(got.stats.z_sum - ref.stats.z_sum) < 1e-9 * (1 + ref.stats.z_sum));
    };
    check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
    if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}), "mesh (2,P/2)");
    check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  }
}

TEST_CASE("balancing: the router bias follows the load's sign, is checkpointed; z-loss; evaluation capacity", "[moe][layer][balance]") {
  const int P = world_size();
  grid2 m(MPI_COMM_WORLD, {1, P});
  const index_t G = 2 * P, S = 16, M = 8, E = 2 * P;
  using layer_t = moe::layer<double, grid2>;
  named<double, "GSM", grid2, layer_t::at_tokens> x(m, {G, S, M});
  fill_normal(x, 1.0, 5, 6);
  moe::gating_config cfg;
  cfg.balance = moe::balance_mode::bias;
  cfg.bias_rate = 0.01;
  parameters ps(m, 3);
  const layer_t layer(ps, "moe.", M, 12, E, moe::layer_options{ffn_kind::relu, 0, moe::balance_mode::bias});
  std::vector<double> expect(std::size_t(E), 0.0);
  for (int step = 0; step < 3; ++step) {
    tape t(ps);  // recording: training
    const auto out = layer(t.constant(x), cfg, std::uint64_t(step));
    double mean = 0;
    for (auto v : out.stats.expert_demand) mean += double(v) / double(E);
    for (index_t e = 0; e < E; ++e) {
      const double err = mean - double(out.stats.expert_demand[std::size_t(e)]);
      expect[std::size_t(e)] += cfg.bias_rate * double((err > 0) - (err < 0));
    }
  }
  for (index_t e = 0; e < E; ++e) GSHARD_REQUIRE(layer.bias->value().data()[e] == expect[std::size_t(e)]);
  double moved = 0;
  for (auto v : expect) moved += std::abs(v);
  GSHARD_REQUIRE(moved > 0);
  {  // evaluation (a tape that does not record) leaves it alone
    tape t(ps, tape::no_grad);
    (void)layer(t.constant(x), cfg, 9);
    for (index_t e = 0; e < E; ++e) GSHARD_REQUIRE(layer.bias->value().data()[e] == expect[std::size_t(e)]);
  }
  // The bias is a buffer: saved and restored with the parameters, at another rank count too.
  const std::string path =
      (std::filesystem::temp_directory_path() / ("gshard_router_bias_np" + std::to_string(P) + ".ckpt")).string();
  save_checkpoint(path, m, {{"param.", &ps.values()}, {"buffer.", &ps.buffers()}}, {});
  {
    grid2 self(MPI_COMM_SELF, {1, 1});
    parameters fresh(self, 99);
    const moe::layer<double, grid2> again(fresh, "moe.", M, 12, E, moe::layer_options{ffn_kind::relu, 0, moe::balance_mode::bias});
    load_checkpoint(path, self, {{"param.", &fresh.values()}, {"buffer.", &fresh.buffers()}});
    for (index_t e = 0; e < E; ++e) GSHARD_REQUIRE(again.bias->value().data()[e] == expect[std::size_t(e)]);
  }
  // A skewed router (every token's logit for expert 0 raised by 1.5): the
  // bias pulls the demand toward balance within a few dozen steps (the mean
  // max/mean demand of the last 10 of 60 steps; with rate 0.01 a simulation
  // of this rule gives 3.4 -> 1.2 on such data).
  {
    parameters ps2(m, 8);
    const index_t Es = 8;  // more experts than choices: the skew shows in the demand
    layer_t skewed(ps2, "moe.", M, 12, Es, moe::layer_options{ffn_kind::relu, 0, moe::balance_mode::bias});
    skewed.router.value().data()[0] = 0.5;  // wg[0, expert 0]
    auto xs = x;
    for (index_t i = 0; i < xs.local().size(); i += M) xs.data()[i] = 3.0;  // feature 0 of every token
    moe::gating_config c = cfg;
    c.bias_rate = 0.01, c.second = moe::second_policy::all;
    double first = 0, last = 0;
    for (int step = 0; step < 60; ++step) {
      tape t(ps2);
      const double o = skewed(t.constant(xs), c, std::uint64_t(step)).stats.max_over_mean();
      if (step == 0) first = o;
      if (step >= 50) last += o / 10;
    }
    INFO("max/mean demand " << first << " -> " << last);
    GSHARD_REQUIRE(first > 2.0);
    GSHARD_REQUIRE(last < 0.6 * first);
  }
  // Asking the layer for another balance mode than it was declared with: named.
  {
    tape t(ps, tape::no_grad);
    GSHARD_REQUIRE_THROWS_WITH(layer(t.constant(x), moe::gating_config{}, 0), error,
                               "the gating asks for balance_mode::aux but the layer was declared with balance_mode::bias");
  }

  // The z-loss: the mean over tokens of logsumexp(router logits)², as computed here from the router's weights.
  {
    parameters ps2(m, 4);
    const layer_t plain(ps2, "moe.", M, 12, E);
    tape t(ps2, tape::no_grad);
    const auto out = plain(t.constant(x), moe::gating_config{}, 0);
    const auto xg = gather(x);
    const auto wg = gather(plain.router.value());
    double z = 0;
    for (index_t g = 0; g < G; ++g)
      for (index_t s = 0; s < S; ++s) {
        std::vector<double> l(std::size_t(E), 0.0);
        for (index_t e = 0; e < E; ++e)
          for (index_t i = 0; i < M; ++i) l[std::size_t(e)] += xg(g, s, i) * wg(i, e);
        const double mx = *std::max_element(l.begin(), l.end());
        double sum = 0;
        for (double v : l) sum += std::exp(v - mx);
        z += std::pow(mx + std::log(sum), 2) / double(G * S);
      }
    GSHARD_REQUIRE(std::abs(out.z_loss.value().local()() - z) < 1e-12 * (1 + z));
  }

  // A separate capacity factor at evaluation: a tape that does not record uses it.
  {
    parameters ps3(m, 5);
    const layer_t plain(ps3, "moe.", M, 12, E);
    moe::gating_config c;
    c.capacity_factor = 8.0, c.eval_capacity_factor = 1.0, c.min_capacity = 1;
    tape train(ps3), eval(ps3, tape::no_grad);
    GSHARD_REQUIRE(plain(train.constant(x), c, 0).stats.capacity == moe::capacity(S, E, c, 8.0));
    GSHARD_REQUIRE(plain(eval.constant(x), c, 0).stats.capacity == moe::capacity(S, E, c, 1.0));
    GSHARD_REQUIRE(moe::capacity(S, E, c, 8.0) != moe::capacity(S, E, c, 1.0));
  }
}

TEST_CASE("gating: placement by token puts each token's choices before the next token's", "[moe][gating][causal]") {
  // One group of 4 tokens over 2 experts, capacity 2, top-2: every token
  // wants both experts, expert 0 first. By choice (GShard) tokens 0 and 1
  // take expert 0's slots with their first choices and token 0's second
  // choice gets expert 1's first slot; by token, token 0 places both its
  // choices, then token 1 — tokens 2 and 3 are dropped entirely.
  const index_t S = 4, E = 2;
  std::vector<float> logits;
  for (index_t s = 0; s < S; ++s) logits.insert(logits.end(), {1.0f, 0.0f});
  moe::gating_config cfg;
  cfg.second = moe::second_policy::all, cfg.min_capacity = 2, cfg.capacity_factor = 1.0;
  moe::routing<float> r;
  auto st = moe::route_tokens<float>(logits.data(), 1, S, E, 0, 0, cfg, r);
  GSHARD_REQUIRE(r.capacity == 2 && check_invariants(r).empty());
  GSHARD_REQUIRE(r.slot[r.choice(0, 0, 0)] == 0 && r.slot[r.choice(0, 1, 0)] == 1 && r.expert[r.choice(0, 2, 0)] == -1);
  GSHARD_REQUIRE(r.slot[r.choice(0, 0, 1)] == 0 && r.slot[r.choice(0, 1, 1)] == 1);  // seconds: expert 1, tokens 0, 1
  GSHARD_REQUIRE(st.dropped_at(0) == 2 && st.dropped_at(1) == 2);
  cfg.order = moe::placement::by_token;
  st = moe::route_tokens<float>(logits.data(), 1, S, E, 0, 0, cfg, r);
  GSHARD_REQUIRE(check_invariants(r).empty());
  for (index_t s = 0; s < 2; ++s)
    GSHARD_REQUIRE(r.expert[r.choice(0, s, 0)] == 0 && r.slot[r.choice(0, s, 0)] == s && r.expert[r.choice(0, s, 1)] == 1 &&
                   r.slot[r.choice(0, s, 1)] == s);
  GSHARD_REQUIRE(r.expert[r.choice(0, 2, 0)] == -1 && r.expert[r.choice(0, 3, 1)] == -1);
  GSHARD_REQUIRE(st.dropped_at(0) == 2 && st.dropped_at(1) == 2 && st.expert_load == std::vector<std::int64_t>{2, 2});
  // A token's second choice can take the slot a later token's first choice
  // wanted: token 0 wants (1, 0), tokens 1, 2 want (0, 1). Capacity 2.
  logits = {0.0f, 1.0f, 1.0f, 0.0f, 1.0f, 0.0f};
  st = moe::route_tokens<float>(logits.data(), 1, 3, E, 0, 0, cfg, r);
  GSHARD_REQUIRE(r.slot[r.choice(0, 0, 1)] == 0 && r.slot[r.choice(0, 1, 0)] == 1 && r.expert[r.choice(0, 2, 0)] == -1);
  GSHARD_REQUIRE(check_invariants(r).empty());
}

namespace {
// The MoE layer's output [G,S,M] gathered, for the input of seed 7 whose
// tokens after position `t` of every group are replaced by those of
// `other_seed` (none when t >= S).
template <class Mesh>
local_tensor<double, 3> layer_with_tail(const Mesh& m, shape<3> gsm, index_t H, index_t E, const moe::gating_config& cfg,
                                        index_t t, std::uint64_t other_seed) {
  parameters ps(m, 42);
  const moe::layer<double, Mesh> layer(ps, "moe.", gsm[2], H, E);
  using X = named<double, "GSM", Mesh, typename moe::layer<double, Mesh>::at_tokens>;
  X x(m, gsm), other(m, gsm);
  fill_normal(x, 1.0, 7, 99);
  fill_normal(other, 3.0, other_seed, 98);
  const auto le = x.local_extents();
  for (index_t g = 0; g < le[0]; ++g)
    for (index_t s = t + 1; s < le[1]; ++s)
      for (index_t k = 0; k < le[2]; ++k) x.local()(g, s, k) = other.local()(g, s, k);
  tape tp(ps, tape::no_grad);
  return gather(layer(tp.constant(x), cfg, 5).y.value());
}
}  // namespace

TEST_CASE("causal routing: with placement by token no output depends on a later token of its group", "[moe][layer][causal]") {
  // Binding capacity (factor 1), k = 1, 2 (GShard's random routing) and 4:
  // the tokens after t replaced by others leave every output at or before
  // t bit-identical. GShard's order (by choice) leaks: some earlier output
  // changes — the size is reported, and docs/05_moe.md quotes it.
  const int P = world_size();
  const index_t G = 2 * P, S = 16, M = 8, H = 12, E = 8;
  int meshes = 0;
  double leak = 0;
  auto check = [&](const auto& m, const char* name) {
    ++meshes;
    for (int k : {1, 2, 4}) {
      moe::gating_config cfg;
      cfg.top_k = k, cfg.capacity_factor = 1.0, cfg.min_capacity = 1;
      cfg.second = k == 2 ? moe::second_policy::random : moe::second_policy::all;
      for (auto order : {moe::placement::by_token, moe::placement::by_choice}) {
        cfg.order = order;
        const auto base = layer_with_tail(m, {G, S, M}, H, E, cfg, S, 0);
        for (index_t t : {index_t(0), index_t(5), S - 2}) {
          const auto y = layer_with_tail(m, {G, S, M}, H, E, cfg, t, 11 + std::uint64_t(t));
          double changed = 0;
          for (index_t g = 0; g < G; ++g)
            for (index_t s = 0; s <= t; ++s)
              for (index_t i = 0; i < M; ++i) changed = std::max(changed, std::abs(y(g, s, i) - base(g, s, i)));
          INFO(name << ", k = " << k << ", t = " << t << (order == moe::placement::by_token ? ", by token" : ", by choice")
                    << ": largest change at or before t " << changed);
          if (order == moe::placement::by_token) GSHARD_REQUIRE(changed == 0.0);
          else leak = std::max(leak, changed);
        }
      }
    }
  };
  check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
  if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}), "mesh (2,P/2)");
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  GSHARD_REQUIRE(meshes == (P % 2 == 0 && P > 2 ? 3 : 2));
  INFO("GShard's order: the largest change of an output at or before t " << leak);
  if (world_rank() == 0) std::printf("causal routing: GShard's placement changed an earlier output by up to %.3g\n", leak);
  GSHARD_REQUIRE(leak > 0.0);
}

TEST_CASE("gating: paddings leave a position out of the choices, the slots and the aux loss, as Lingvo's", "[moe][gating][paddings]") {
  // Lingvo's Top2GatingOnLogits with paddings, written out here on two
  // groups with padding at the end and inside: mask_1 and mask_2 zero on
  // padded positions, exclusive cumsums over them for the slots, the gates
  // normalised before capacity (legacy_mtf_behavior), and the densities
  // divided by the share of real positions (its density_denom, whose 1e-6
  // bounds the tolerance). The padded positions hold NaN logits: never read.
  const index_t G = 2, S = 8, E = 4, C = 2;
  std::vector<float> logits(std::size_t(G * S * E)), pads(std::size_t(G * S), 0.0f);
  for (std::size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(1.7 * double(i) + 0.3) * 2.0);
  for (index_t s : {5, 6, 7}) pads[std::size_t(s)] = 1.0f;  // group 0: 5 tokens, then padding
  for (index_t s : {0, 3}) pads[std::size_t(S + s)] = 1.0f;  // group 1: padding among the tokens
  for (std::size_t i = 0; i < pads.size(); ++i)
    if (pads[i] != 0.0f) std::fill_n(logits.begin() + std::ptrdiff_t(i) * E, E, std::numeric_limits<float>::quiet_NaN());
  moe::gating_config cfg;
  cfg.second = moe::second_policy::all, cfg.capacity_factor = 0, cfg.min_capacity = C;
  moe::routing<float> r;
  const auto st = moe::route_tokens<float>(logits.data(), G, S, E, 0, 0, cfg, r, -1, pads.data());
  GSHARD_REQUIRE(r.capacity == C && check_invariants(r).empty());
  GSHARD_REQUIRE(st.padded == 5 && st.tokens == 11 && st.invalid == 0 && r.real == std::vector<index_t>{5, 6});
  double aux = 0, z = 0;
  for (index_t g = 0; g < G; ++g) {
    std::vector<int> count1(std::size_t(E), 0), count2(std::size_t(E), 0);
    std::vector<double> density(std::size_t(E), 0.0), proxy(std::size_t(E), 0.0);
    std::vector<int> e1(std::size_t(S), -1), e2(std::size_t(S), -1);
    std::vector<double> w1(std::size_t(S), 0.0), w2(std::size_t(S), 0.0);
    double real = 0;
    for (index_t s = 0; s < S; ++s) {
      if (pads[std::size_t(g * S + s)] != 0.0f) continue;
      real += 1;
      const float* l = logits.data() + (g * S + s) * E;
      double mx = l[0], sum = 0, gates[4];
      for (index_t e = 1; e < E; ++e) mx = std::max(mx, double(l[e]));
      for (index_t e = 0; e < E; ++e) sum += gates[e] = std::exp(double(l[e]) - mx);
      for (index_t e = 0; e < E; ++e) gates[e] /= sum, proxy[std::size_t(e)] += gates[e];
      z += std::pow(mx + std::log(sum), 2);
      int a = 0, b = -1;
      for (int e = 1; e < E; ++e)
        if (gates[e] > gates[a]) a = e;
      for (int e = 0; e < E; ++e)
        if (e != a && (b < 0 || gates[e] > gates[b])) b = e;
      e1[std::size_t(s)] = a, e2[std::size_t(s)] = b, density[std::size_t(a)] += 1;
      w1[std::size_t(s)] = gates[a] / (gates[a] + gates[b] + 1e-9), w2[std::size_t(s)] = gates[b] / (gates[a] + gates[b] + 1e-9);
    }
    for (index_t s = 0; s < S; ++s) {  // first choices: position_in_expert_1 = exclusive cumsum of mask_1
      const std::size_t c = r.choice(g, s, 0);
      if (e1[std::size_t(s)] < 0) {
        GSHARD_REQUIRE(r.expert[c] == -1 && r.expert[c + 1] == -1 && r.weight[c] == 0.0f);
        continue;
      }
      const int pos = count1[std::size_t(e1[std::size_t(s)])]++;
      INFO("group " << g << " position " << s);
      GSHARD_REQUIRE(r.expert[c] == (pos < C ? e1[std::size_t(s)] : -1));
      if (pos < C) GSHARD_REQUIRE(r.slot[c] == pos && std::abs(r.weight[c] - w1[std::size_t(s)]) < 1e-6);
    }
    for (index_t s = 0; s < S; ++s) {  // seconds: after every kept first choice (mask_1_count)
      if (e2[std::size_t(s)] < 0) continue;
      const std::size_t c = r.choice(g, s, 1);
      const int e = e2[std::size_t(s)];
      const int pos = std::min(count1[std::size_t(e)], int(C)) + count2[std::size_t(e)]++;
      INFO("group " << g << " position " << s << ", second choice");
      GSHARD_REQUIRE(r.expert[c] == (pos < C ? e : -1));
      if (pos < C) GSHARD_REQUIRE(r.slot[c] == pos && std::abs(r.weight[c] - w2[std::size_t(s)]) < 1e-6);
    }
    const double denom = real / double(S) + 1e-6;  // Lingvo's density_denom
    for (index_t e = 0; e < E; ++e)
      aux += (density[std::size_t(e)] / double(S) / denom) * (proxy[std::size_t(e)] / double(S) / denom) * double(E * E);
  }
  aux /= double(G * E);  // reduce_mean over [G, E]
  INFO("aux " << st.aux_sum / double(G) << " against Lingvo's " << aux);
  GSHARD_REQUIRE(std::abs(st.aux_sum / double(G) - aux) < 1e-5 * aux);
  GSHARD_REQUIRE(std::abs(st.z_sum - z) < 1e-5 * z);
  GSHARD_REQUIRE(st.placed() + st.total_dropped() == 2 * st.tokens);
  // Paddings of zeros route as none, bit for bit.
  for (auto& l : logits)
    if (std::isnan(l)) l = 0.5f;
  moe::routing<float> a, b;
  const std::vector<float> zeros(std::size_t(G * S), 0.0f);
  const auto sa = moe::route_tokens<float>(logits.data(), G, S, E, 0, 0, cfg, a);
  const auto sb = moe::route_tokens<float>(logits.data(), G, S, E, 0, 0, cfg, b, -1, zeros.data());
  GSHARD_REQUIRE(a.expert == b.expert && a.slot == b.slot && a.weight == b.weight && sa.aux_sum == sb.aux_sum &&
                 sa.z_sum == sb.z_sum && sb.padded == 0);
}

namespace {
// Whether position s of global group g is padding in the paddings tests:
// every fourth group all padding, the others 0, 5 or 10 positions at the
// end, the odd ones also position 1.
bool padded_at(index_t g, index_t s, index_t S) {
  if (g % 4 == 3) return true;
  return s >= S - 5 * (g % 4) || (g % 2 == 1 && s == 1);
}

struct padded_run {
  local_tensor<double, 3> y;
  moe::gating_stats stats;
  std::vector<double> grads;  // of x, the router and the experts, gathered
  std::size_t collectives = 0;
  std::string broken;
};
// The layer of seed 42 on x of seed 7 with the padding of padded_at, the
// padded rows of x holding finite garbage (0), NaN, Inf and 1e300 (1), or
// no paddings given at all (-1). With `grads`, the gradients of
// Σ y·c + aux/2 + z/10 too. `collectives` counts the forward's as run_variant.
template <class Mesh>
padded_run run_padded(const Mesh& m, shape<3> gsm, index_t H, index_t E, const moe::gating_config& cfg,
                      const moe::layer_options& opt, int garbage, bool grads) {
  using L = moe::layer<double, Mesh>;
  using X = named<double, "GSM", Mesh, typename L::at_tokens>;
  parameters ps(m, 42);
  const L layer(ps, "moe.", gsm[2], H, E, opt);
  if (layer.bias)
    for (index_t e = 0; e < E; ++e) layer.bias->value().data()[e] = 0.2 * double(e % 3) - 0.2;
  param<X> x(ps, "x", gsm, init::normal(1.0));
  typename L::paddings_type pads(m, {gsm[0], gsm[1]});
  const auto le = x.value().local_extents();
  const index_t g0 = x.value().offsets()[0];
  for (index_t g = 0; g < le[0]; ++g)
    for (index_t s = 0; s < le[1]; ++s) {
      const bool pad = padded_at(g0 + g, s, gsm[1]);
      pads.local()(g, s) = pad ? 1.0 : 0.0;
      if (pad && garbage >= 0)
        for (index_t i = 0; i < le[2]; ++i)
          x.value().local()(g, s, i) = garbage == 0 ? 40.0 * std::sin(double(17 * g + 5 * s + i))
                                       : i % 3 == 0 ? std::numeric_limits<double>::quiet_NaN()
                                       : i % 3 == 1 ? std::numeric_limits<double>::infinity()
                                                    : 1e300;
    }
  X c(m, gsm);
  fill_normal(c, 1.0, 8, 98);
  collective_recorder rec;
  std::optional<tape> tp;
  if (grads) tp.emplace(ps);
  else tp.emplace(ps, tape::no_grad);
  tape& t = *tp;
  auto out = garbage >= 0 ? layer(t.use(x), pads, cfg, 3) : layer(t.use(x), cfg, 3);
  padded_run r;
  const std::size_t a2a = rec.calls(collective::all_to_all, "expert"), ar = rec.calls(collective::all_reduce, "model");
  r.collectives = a2a + 10 * ar + 100 * (rec.events().size() - a2a - ar);
  r.y = gather(out.y.value());
  r.stats = out.stats;
  r.broken = check_invariants(*out.route);
  if (grads) {
    t.backward(reshard<replicate>(einsum<"GSM,GSM->">(out.y, t.constant(c))) + 0.5 * out.aux + 0.1 * out.z_loss);
    auto add = [&](const auto& p) {
      const auto whole = gather(p.grad());
      r.grads.insert(r.grads.end(), whole.data(), whole.data() + whole.size());
    };
    add(x), add(layer.router), add(layer.expert_ffn.w1), add(layer.expert_ffn.w2);
    if (layer.shared) add(layer.shared->w1), add(layer.shared->w2);
  }
  return r;
}
}  // namespace

TEST_CASE("MoE layer: padded positions are routed nowhere, output 0, and change nothing else, at every mesh", "[moe][layer][paddings]") {
  // Every routing variant, at every mesh: what padded positions hold
  // (finite garbage, or NaN, Inf and 1e300) leaves every output, counter
  // and gradient bit-identical; padded outputs and their gradients are 0;
  // the counters and losses skip them; each mesh equals the 1-rank result;
  // the paddings cost no collective.
  const int P = world_size();
  const index_t G = 4 * P, S = 24, M = 16, H = 24, E = 8;
  struct variant {
    std::string name;
    moe::gating_config cfg;
    moe::layer_options opt;
  };
  auto cfg_k = [](int k, bool dropless) {
    moe::gating_config c;
    c.capacity_factor = 1.5, c.top_k = k, c.dropless = dropless;
    c.second = k == 2 ? moe::second_policy::random : moe::second_policy::all;
    return c;
  };
  std::vector<variant> variants;
  for (int k : {1, 2, 4}) variants.push_back({"top-" + std::to_string(k), cfg_k(k, false), {}});
  variants.push_back({"dropless top-2", cfg_k(2, true), {}});
  variants.push_back({"top-2 + 1 shared SwiGLU expert", cfg_k(2, false), {ffn_kind::swiglu, 1, moe::balance_mode::aux}});
  auto biased = cfg_k(2, false);
  biased.balance = moe::balance_mode::bias;
  variants.push_back({"top-2, bias balancing", biased, {ffn_kind::relu, 0, moe::balance_mode::bias}});
  auto causal = cfg_k(2, false);
  causal.order = moe::placement::by_token;
  variants.push_back({"top-2, placement by token", causal, {}});

  index_t padded = 0;
  for (index_t g = 0; g < G; ++g)
    for (index_t s = 0; s < S; ++s) padded += padded_at(g, s, S);
  grid2 self(MPI_COMM_SELF, {1, 1});
  for (const auto& v : variants) {
    INFO(v.name);
    const auto ref = run_padded(self, {G, S, M}, H, E, v.cfg, v.opt, 0, true);
    GSHARD_REQUIRE_MSG(ref.broken.empty(), ref.broken);
    GSHARD_REQUIRE(ref.stats.padded == padded && ref.stats.tokens == G * S - padded && ref.stats.invalid == 0);
    GSHARD_REQUIRE(ref.stats.placed() + ref.stats.total_dropped() + ref.stats.skipped_at(1) == v.cfg.top_k * ref.stats.tokens);
    std::int64_t demand = 0;
    for (auto d : ref.stats.expert_demand) demand += d;
    GSHARD_REQUIRE(demand == ref.stats.placed() + ref.stats.total_dropped());
    for (index_t g = 0; g < G; ++g)
      for (index_t s = 0; s < S; ++s)
        if (padded_at(g, s, S))
          for (index_t i = 0; i < M; ++i) {
            GSHARD_REQUIRE(ref.y(g, s, i) == 0.0);
            GSHARD_REQUIRE(ref.grads[std::size_t((g * S + s) * M + i)] == 0.0);  // x's gradient comes first
          }
    auto check = [&](const auto& m, const char* mesh_name) {
      using Mesh = std::remove_cvref_t<decltype(m)>;
      INFO(mesh_name);
      const auto a = run_padded(m, {G, S, M}, H, E, v.cfg, v.opt, 0, true);
      const auto b = run_padded(m, {G, S, M}, H, E, v.cfg, v.opt, 1, true);
      GSHARD_REQUIRE_MSG(a.broken.empty(), a.broken);
      GSHARD_REQUIRE(a.y.size() == b.y.size() && std::equal(a.y.data(), a.y.data() + a.y.size(), b.y.data()));
      GSHARD_REQUIRE(a.grads == b.grads);
      GSHARD_REQUIRE(a.stats.expert_load == b.stats.expert_load && a.stats.dropped == b.stats.dropped &&
                     a.stats.aux_sum == b.stats.aux_sum && a.stats.z_sum == b.stats.z_sum && b.stats.invalid == 0);
      const std::size_t model_reductions = Mesh::index_of("model") >= 0 ? 1 + (v.opt.shared_experts > 0) : 0;
      GSHARD_REQUIRE(a.collectives == 2 + 10 * model_reductions + 100 * (1 + v.cfg.dropless));
      GSHARD_REQUIRE(max_rel_diff(a.y, ref.y) < 1e-12);
      double gd = a.grads.size() == ref.grads.size() ? 0.0 : 1e300;
      for (std::size_t i = 0; gd < 1e300 && i < a.grads.size(); ++i)
        gd = std::max(gd, std::abs(a.grads[i] - ref.grads[i]) / (1 + std::abs(ref.grads[i])));
      INFO("gradients against 1 rank: " << gd);
      GSHARD_REQUIRE(gd < 1e-12);
      GSHARD_REQUIRE(a.stats.expert_load == ref.stats.expert_load && a.stats.padded == padded &&
                     std::abs(a.stats.aux_sum - ref.stats.aux_sum) < 1e-9);
    };
    check(grid2(MPI_COMM_WORLD, {1, P}), "mesh (1,P)");
    if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}), "mesh (2,P/2)");
    check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), "mesh (data, expert, model)");
  }
  // Without padding, the layer with paddings of zeros is the layer without paddings, bit for bit.
  {
    grid2 m(MPI_COMM_WORLD, {1, P});
    using L = moe::layer<double, grid2>;
    parameters ps(m, 42);
    const L layer(ps, "moe.", M, H, E);
    named<double, "GSM", grid2, L::at_tokens> x(m, {G, S, M});
    fill_normal(x, 1.0, 7, 99);
    L::paddings_type zeros(m, {G, S});
    tape t(ps, tape::no_grad);
    const auto y0 = gather(layer(t.constant(x), moe::gating_config{}, 3).y.value());
    const auto y1 = gather(layer(t.constant(x), zeros, moe::gating_config{}, 3).y.value());
    GSHARD_REQUIRE(std::equal(y0.data(), y0.data() + y0.size(), y1.data()));
    // Paddings other than 0 and 1, on one rank only: refused on every rank.
    L::paddings_type bad(m, {G, S});
    if (world_rank() == 0) bad.data()[1] = 0.5;
    GSHARD_REQUIRE_THROWS_WITH(layer(t.constant(x), bad, moe::gating_config{}, 3), error,
                               "gshard::moe::gate: 1 of the " + std::to_string(G * S) +
                                   " paddings are neither 0 (a token) nor 1 (padding)");
    L::paddings_type short_pads(m, {G, S - 1});
    GSHARD_REQUIRE_THROWS_WITH(layer(t.constant(x), short_pads, moe::gating_config{}, 3), shape_error,
                               "gshard::moe::layer: the paddings ");
  }
}

TEST_CASE("MoE layer: zero tokens and NaN inputs", "[moe][layer][errors]") {
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
  // Zero chunks: refused when the layer is declared.
  {
    parameters ps(m, 1);
    moe::layer_options o;
    o.overlap_degree = 0;
    GSHARD_REQUIRE_THROWS_WITH((moe::layer<float, grid2>(ps, "moe.", 4, 8, 2 * P, o)), error,
                               "gshard::moe::layer: overlap_degree = 0 chunks; 1 (no pipelining) or more");
  }
}

namespace {
// A small encoder–decoder over 16 tokens (bos 1, eos 2) with a binding
// capacity, and a batch of B sources of S tokens (lengths S, 0, 3, S - 1,
// ...; padded positions hold `pad`) and targets of L + 1 (bos, 12 tokens
// from 3 up, eos at L - 2 in every third row then -1 padding).
template <class T>
model::seq2seq_config small_seq2seq() {
  model::seq2seq_config c;
  c.vocab = 16, c.model = 16, c.heads = 2, c.head_dim = 8, c.hidden = 24, c.experts = 8;
  c.encoder_layers = 2, c.decoder_layers = 2, c.max_len = 32;
  c.gating.capacity_factor = 1.0, c.gating.min_capacity = 1;
  return c;
}
struct seq2seq_batch {
  local_tensor<std::int32_t, 2> src, tgt;
  local_tensor<std::int32_t, 1> lengths;
};
inline seq2seq_batch make_batch(index_t B, index_t S, index_t L, std::int32_t pad, bool padded_targets) {
  seq2seq_batch d{local_tensor<std::int32_t, 2>(B, S), local_tensor<std::int32_t, 2>(B, L + 1), local_tensor<std::int32_t, 1>(B)};
  for (index_t b = 0; b < B; ++b) {
    const index_t n = std::array<index_t, 4>{S, 0, 3, S - 1}[std::size_t(b % 4)];
    d.lengths(b) = std::int32_t(n);
    for (index_t i = 0; i < S; ++i) d.src(b, i) = i < n ? std::int32_t(3 + (b * 5 + i * 3) % 13) : pad;
    d.tgt(b, 0) = 1;
    for (index_t i = 1; i <= L; ++i) d.tgt(b, i) = std::int32_t(3 + (b * 7 + i * 2) % 13);
    if (padded_targets && b % 3 == 0) {
      d.tgt(b, L - 2) = 2;
      for (index_t i = L - 1; i <= L; ++i) d.tgt(b, i) = -1;
    }
  }
  return d;
}
}  // namespace

// Calls fn on every weight of an encoder–decoder.
template <class Net, class Fn>
void for_each_weight(const Net& net, Fn&& fn) {
  fn(net.embedding_table()), fn(net.encoder_norm()), fn(net.decoder_norm()), fn(net.unembedding());
  for (const auto* blocks : {&net.encoder_blocks(), &net.decoder_blocks()})
    for (const auto& b : *blocks) {
      fn(b.norm1), fn(b.self.wq), fn(b.self.wk), fn(b.self.wv), fn(b.self.wo), fn(b.norm2);
      if (b.cross) fn(*b.norm_cross), fn(b.cross->wq), fn(b.cross->wk), fn(b.cross->wv), fn(b.cross->wo);
      if (b.moe) fn(b.moe->router), fn(b.moe->expert_ffn.w1), fn(b.moe->expert_ffn.w2);
      else fn(b.ffn->w1), fn(b.ffn->w2);
    }
}

TEST_CASE("encoder–decoder: loss and gradients at every mesh equal 1 rank's, heads over \"model\" too; padding changes nothing; with dropout, "
          "label smoothing and remat too", "[moe][seq2seq]") {
  const int P = world_size();
  const index_t B = 4 * P, S = 7, L = 9;
  using model_t = model::seq2seq<double, grid2>;
  auto run = [&](const auto& m, std::int32_t pad, const model::seq2seq_config& c) {
    using net_t = model::seq2seq<double, std::remove_cvref_t<decltype(m)>>;
    parameters ps(m, 5);
    const net_t net(ps, c);
    const auto d = make_batch(B, S, L, pad, true);
    const auto src = distribute<typename net_t::tokens_type>(m, d.src);
    const auto tgt = distribute<typename net_t::tokens_type>(m, d.tgt);
    const auto len = distribute<typename net_t::lengths_type>(m, d.lengths);
    tape t(ps);
    auto out = net.forward(t, src, len, tgt, 3);
    t.backward(out.loss);
    std::vector<double> g{out.ce, out.aux, out.z, loss_value(out.loss)};
    for_each_weight(net, [&](const auto& w) {
      const auto whole = gather(w.grad());
      g.insert(g.end(), whole.data(), whole.data() + whole.size());
    });
    return std::pair{g, out.moe};
  };
  model::seq2seq_config regularised = small_seq2seq<double>();
  regularised.dropout = 0.1, regularised.label_smoothing = 0.1;
  double plain_ce = 0;
  for (const bool reg : {false, true}) {
    const model::seq2seq_config c = reg ? regularised : small_seq2seq<double>();
    const std::string kind = reg ? "dropout 0.1, label smoothing 0.1" : "plain";
    INFO(kind);
    grid2 self(MPI_COMM_SELF, {1, 1});
    const auto [ref, ref_stats] = run(self, 0, c);
    GSHARD_REQUIRE(ref_stats.size() == 2 && ref_stats[0].padded > 0 && ref_stats[1].padded > 0);
    if (!reg) plain_ce = ref[0];
    else GSHARD_REQUIRE(std::abs(ref[0] - plain_ce) > 1e-6);  // dropout changed the forward
    // Every mesh against 1 rank: the batch over data or expert, and heads
    // and dense FFNs over "model" besides.
    auto against_one = [&](const auto& m) {
      const auto [got, stats] = run(m, 0, c);
      const auto [other, other_stats] = run(m, 9, c);  // other tokens at the sources' padded positions
      INFO(m.describe());
      GSHARD_REQUIRE(got == other);
      double worst = got.size() == ref.size() ? 0.0 : 1e300;
      for (std::size_t i = 0; worst < 1e300 && i < got.size(); ++i)
        worst = std::max(worst, std::abs(got[i] - ref[i]) / (1 + std::abs(ref[i])));
      INFO("loss and gradients against 1 rank: " << worst);
      GSHARD_REQUIRE(worst < 1e-12);
      for (std::size_t l = 0; l < stats.size(); ++l) GSHARD_REQUIRE(stats[l].expert_load == ref_stats[l].expert_load);
      if (reg) {  // every block rematerialised: the same loss and gradients, bit for bit
        model::seq2seq_config with_remat = c;
        with_remat.remat = true;
        GSHARD_REQUIRE(run(m, 0, with_remat).first == got);
      }
    };
    against_one(grid2(MPI_COMM_WORLD, {1, P}));
    against_one(grid2(MPI_COMM_WORLD, {P, 1}));
    against_one(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)));
  }
  {  // The regularised loss against finite differences of every weight (a recording tape: dropout and smoothing on)
    grid2 m(MPI_COMM_WORLD, {1, P});
    parameters ps(m, 5);
    const model_t net(ps, regularised);
    const auto d = make_batch(B, S, L, 0, true);
    const auto src = distribute<model_t::tokens_type>(m, d.src);
    const auto tgt = distribute<model_t::tokens_type>(m, d.tgt);
    const auto len = distribute<model_t::lengths_type>(m, d.lengths);
    {
      tape t(ps);
      t.backward(net.forward(t, src, len, tgt, 3).loss);
    }
    const auto f = [&] {
      tape t(ps);
      return loss_value(net.forward(t, src, len, tgt, 3).loss);
    };
    double worst = 0;
    int weights = 0;
    for_each_weight(net, [&](const auto& w) {
      auto h = w;  // a handle to the same parameter
      worst = std::max(worst, gshard::testing::fd_check(h.value(), h.grad(), f, 2));
      ++weights;
    });
    INFO("finite differences over " << weights << " weights: worst relative error " << worst);
    GSHARD_REQUIRE(weights == 48);
    GSHARD_REQUIRE(worst < 1e-5);
  }
  // Rates outside [0, 1) are refused when the model is made.
  grid2 m(MPI_COMM_WORLD, {1, P});
  parameters ps(m, 5);
  model::seq2seq_config bad = small_seq2seq<double>();
  bad.dropout = 1.0;
  GSHARD_REQUIRE_THROWS_WITH((model_t(ps, bad)), error,
                             "gshard::model::seq2seq: config.dropout = 1.000000; it must lie in [0, 1)");
  bad.dropout = 0, bad.label_smoothing = -0.5;
  GSHARD_REQUIRE_THROWS_WITH((model_t(ps, bad)), error, "gshard::model::seq2seq: config.label_smoothing = -0.500000; it must lie in [0, 1)");
}

TEST_CASE("encoder–decoder: decoding with a cache gives the full forward's logits; beam width 1 is greedy; the same "
          "tokens at every rank count", "[moe][seq2seq][decode]") {
  // 2P + 1 sources: a rank's block of the batch is one longer or shorter
  // than another's (beam search widens each source to its beams on its rank).
  const int P = world_size();
  const index_t B = 2 * P + 1, S = 7, L = 9;
  auto check = [&]<class T>(T tol) {
    using model_t = model::seq2seq<T, grid2>;
    const auto d = make_batch(B, S, L, 0, false);
    auto logits_both = [&](const grid2& m) {
      parameters ps(m, 6);
      const model_t net(ps, small_seq2seq<T>());
      const auto src = distribute<typename model_t::tokens_type>(m, d.src);
      const auto tgt = distribute<typename model_t::tokens_type>(m, d.tgt);
      const auto len = distribute<typename model_t::lengths_type>(m, d.lengths);
      tape t(ps, tape::no_grad);
      const auto full = gather(net.forward(t, src, len, tgt, 4).logits.value());  // [B, L, V]
      auto st = net.start_decoding(src, len, L, 4);
      double worst = 0;
      std::size_t a2a = 0;
      for (index_t s = 0; s < L; ++s) {
        local_tensor<std::int32_t, 2> col(B, 1);
        for (index_t b = 0; b < B; ++b) col(b, 0) = d.tgt(b, s);
        collective_recorder rec;
        const auto step = gather(net.decode_step(st, distribute<typename model_t::tokens_type>(m, col)));
        a2a = std::max(a2a, rec.calls(collective::all_to_all, "expert"));
        for (index_t b = 0; b < B; ++b)
          for (index_t v = 0; v < 16; ++v)
            worst = std::max(worst, std::abs(double(step(b, 0, v)) - double(full(b, s, v))) / (1 + std::abs(double(full(b, s, v)))));
      }
      // A step given other than one token per sequence: refused, naming the shapes.
      GSHARD_REQUIRE_THROWS_WITH(net.decode_step(st, src), shape_error,
                                 "gshard::model::seq2seq: decode_step takes one token per sequence, [" + std::to_string(B) +
                                     ", 1] for this state; it was given i32[B");
      local_tensor<std::int32_t, 2> one(B, 1);
      one.setConstant(3);
      GSHARD_REQUIRE_THROWS_WITH(net.decode_step(st, distribute<typename model_t::tokens_type>(m, one)), error,
                                 "gshard::model::seq2seq: decode_step at position 9 of a cache of 9 positions");
      GSHARD_REQUIRE_THROWS_WITH(net.beam_search(src, len, {2, -1.0, 5}, 4), error,
                                 "gshard::model::seq2seq: beam alpha -1.000000; a finite number >= 0");
      const auto greedy = net.greedy(src, len, 12, 4);
      const auto beam1 = net.beam_search(src, len, {1, 0.6, 12}, 4);
      const auto beam3 = net.beam_search(src, len, {3, 0.6, 12}, 4);
      return std::tuple{worst, a2a, greedy, beam1, beam3};
    };
    grid2 self(MPI_COMM_SELF, {1, 1});
    {  // GShard's placement in the decoder trains, but cannot be decoded a position at a time
      parameters ps(self, 6);
      auto c = small_seq2seq<T>();
      c.decoder_order = moe::placement::by_choice;
      const model_t net(ps, c);
      GSHARD_REQUIRE_THROWS_WITH(net.start_decoding(distribute<typename model_t::tokens_type>(self, d.src),
                                                    distribute<typename model_t::lengths_type>(self, d.lengths), 4, 0),
                                 error, "needs config.decoder_order = placement::by_token");
    }
    const auto [w1, a1, greedy1, beam1_1, beam3_1] = logits_both(self);
    // At 6 ranks (2,3) cuts 13 sources 7 | 6, then 3, 3, 1 | 2, 2, 2: the
    // beams' rows are not W times the sources' offsets, and random routing
    // must still draw by the 1-rank rows.
    std::vector<std::array<std::ptrdiff_t, 2>> meshes{{1, P}, {P, 1}};
    if (P % 2 == 0 && P > 2) meshes.push_back({2, P / 2});
    for (const auto& sizes : meshes) {
      grid2 m(MPI_COMM_WORLD, sizes);
      const auto [worst, a2a, greedy, beam1, beam3] = logits_both(m);
      INFO("mesh (" << sizes[0] << "," << sizes[1] << "), " << sizeof(T) * 8 << "-bit: incremental against full logits " << worst);
      GSHARD_REQUIRE(worst < tol);
      GSHARD_REQUIRE(a2a == 2);  // one MoE block in the decoder: one all_to_all pair per step
      GSHARD_REQUIRE(greedy == beam1);
      // The same tokens as the 1-rank run for this rank's sources.
      const auto len = distribute<typename model_t::lengths_type>(m, d.lengths);
      const index_t b0 = len.offsets()[0];
      GSHARD_REQUIRE((index_t(greedy.size()) == len.local_extents()[0] && beam3.size() == greedy.size()));
      bool same = true;  // one agreed check: ranks hold different numbers of sources
      for (std::size_t b = 0; b < greedy.size(); ++b)
        same = same && greedy[b] == greedy1[std::size_t(b0) + b] && beam3[b] == beam3_1[std::size_t(b0) + b];
      GSHARD_REQUIRE(same);
    }
    (void)w1, (void)a1, (void)beam1_1;
  };
  check(1e-12);
  check(1e-5f);
}

TEST_CASE("encoder–decoder: one training step runs exactly the collectives, FLOPs and state the cost model counts",
          "[moe][seq2seq][cost]") {
  // cost::count_step(seq2seq_config) counts a step of the encoder–decoder
  // from its config and the mesh's sizes; a real step's counters must equal
  // it: every collective's calls and bytes per kind and axes, the model
  // FLOPs, the declared weights, the bytes of parameters, gradients and
  // the optimizer's state — on (data, expert) meshes of every shape and on
  // (data, expert, model), with the replicated and the sharded update, Adam
  // and Adafactor, sources and targets of different lengths (the encoder's
  // and the decoder's capacities differ), padded, regularised, and dense.
  const int P = world_size();
  const index_t B = 4 * P, S = 7, L = 9;
  const auto d = make_batch(B, S, L, 0, true);
  auto ran = [&](const auto& m, const model::seq2seq_config& c, bool sharded, bool factored) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using model_t = model::seq2seq<double, Mesh>;
    parameters<Mesh> ps = sharded ? parameters<Mesh>(m, 5, shard_weight_update<default_roles::batch>{}) : parameters<Mesh>(m, 5);
    const model_t net(ps, c);
    std::unique_ptr<optimizer> opt;
    if (factored) opt = std::make_unique<adafactor>(adafactor_config{}, ps);
    else opt = std::make_unique<adam>(adam_config{}, ps);
    const auto src = distribute<typename model_t::tokens_type>(m, d.src);
    const auto tgt = distribute<typename model_t::tokens_type>(m, d.tgt);
    const auto len = distribute<typename model_t::lengths_type>(m, d.lengths);
    collective_recorder rec;
    const double f0 = model_flops();
    {
      tape t(ps);
      t.backward(net.forward(t, src, len, tgt, 3).loss);
    }
    opt->update(ps);
    const double flops = model_flops() - f0;
    const auto ms = gshard::testing::cost_mesh(m);
    model::cost::step_options o{B, L, sharded, int(sizeof(double))};
    o.source = S;
    o.optimizer = factored ? model::cost::optimizer_kind::adafactor : model::cost::optimizer_kind::adam;
    const auto w = model::cost::count_step(c, ms, o);
    const auto seen = gshard::testing::tally(rec), want = gshard::testing::tally(w, m, ms);
    const std::string weight_diff = gshard::testing::weight_difference(ps, model::cost::weights(c, ms.has_model_axis), ms, sizeof(double));
    INFO(m.describe() << (sharded ? ", sharded update" : ", replicated update") << (c.experts == 0 ? ", dense" : "")
                      << (c.dropout > 0 ? ", regularised" : "") << (factored ? ", Adafactor" : ", Adam")
                      << "\nran: " << gshard::testing::text(seen) << "\nwant: " << gshard::testing::text(want)
                      << "\nmodel FLOPs " << flops << " counted " << w.model_flops << "\n" << weight_diff);
    GSHARD_REQUIRE(seen == want);
    GSHARD_REQUIRE(std::abs(flops - w.model_flops) <= 1e-12 * w.model_flops);
    GSHARD_REQUIRE(weight_diff.empty());
    GSHARD_REQUIRE(double(ps.values().local_bytes()) == w.parameter_bytes);
    GSHARD_REQUIRE(double(ps.grads().local_bytes()) == w.gradient_bytes);
    GSHARD_REQUIRE(double(opt->state_bytes()) == w.optimizer_bytes);
    if (c.experts > 0) GSHARD_REQUIRE((w.capacity == moe::capacity(S, c.experts, c.gating) && w.decoder_capacity == moe::capacity(L, c.experts, c.gating)));
  };
  model::seq2seq_config regularised = small_seq2seq<double>();
  regularised.dropout = 0.1, regularised.label_smoothing = 0.1;
  model::seq2seq_config dense = small_seq2seq<double>();
  dense.experts = 0, dense.slot_hidden = 48;
  model::seq2seq_config swiglu = small_seq2seq<double>();
  swiglu.ffn = ffn_kind::swiglu, swiglu.gating.top_k = 1, swiglu.encoder_layers = 3, swiglu.decoder_layers = 4;
  const index_t dd = P % 2 == 0 && P > 2 ? 2 : 1;
  for (const auto& c : {small_seq2seq<double>(), regularised, dense, swiglu})
    for (const bool sharded : {false, true})
      for (const bool factored : {false, true}) {
        ran(grid2(MPI_COMM_WORLD, {1, P}), c, sharded, factored);
        ran(grid2(MPI_COMM_WORLD, {dd, P / dd}), c, sharded, factored);
        ran(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)), c, sharded, factored);
      }
  // The count refuses what it cannot count.
  model::cost::step_options none{B, L};
  GSHARD_REQUIRE_THROWS_WITH(model::cost::count_step(small_seq2seq<double>(), {1, P, 1, false}, none), shape_error,
                             "gshard::model::cost: an encoder–decoder step needs sources and targets of 1 position or more; "
                             "step_options.source = 0, seq = 9");
  model::cost::step_options some{B, L};
  some.source = S;
  GSHARD_REQUIRE_THROWS_WITH(model::cost::count_step(small_seq2seq<double>(), {1, P, 1, false, {0, P, 0}}, some), shape_error,
                             "gshard::model::cost: mesh_sizes.at = (0, " + std::to_string(P) + ", 0) is not a rank of data 1 x expert " +
                                 std::to_string(P) + " x model 1");
}

TEST_CASE("Transformer: the loss at every world size equals the 1-rank loss", "[moe][model]") {
  const int P = world_size();
  model::config c;
  c.model = 32, c.heads = 2, c.head_dim = 8, c.hidden = 48, c.experts = 8, c.layers = 4;
  const index_t B = 2 * P, L = 16;
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);

  auto run = [&](const auto& m, const model::config& cfg, auto* logits_out) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using model_t = model::transformer<double, Mesh>;
    parameters ps(m, 5);
    const model_t tr(ps, cfg);
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
  const auto [ref_ce, ref_aux, ref_ran] = run(self, c, &ref_logits);
  GSHARD_REQUIRE(ref_ce > 4.0 && ref_ce < 8.0);  // about ln 256 before training

  auto check = [&](const auto& m) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    local_tensor<double, 3> logits;
    const auto [ce, aux, ran] = run(m, c, &logits);
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
  if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}));
  check(grid3(MPI_COMM_WORLD, gshard::testing::data_expert_model_sizes(P)));
  // Heads and hidden units that do not divide over a "model" axis of P
  // ranks (3 heads and 47 units: at 2 ranks 2 and 1 heads, at 4 and 8 some
  // ranks hold none): the same loss and logits as 1 rank.
  auto uneven = c;
  uneven.heads = 3, uneven.hidden = 47;
  local_tensor<double, 3> uneven_ref, uneven_logits;
  const auto [uref_ce, uref_aux, uref_ran] = run(self, uneven, &uneven_ref);
  const auto [uce, uaux, uran] = run(grid3(MPI_COMM_WORLD, {1, 1, P}), uneven, &uneven_logits);
  GSHARD_REQUIRE(std::abs(uce - uref_ce) < 1e-10 && std::abs(uaux - uref_aux) < 1e-10);
  GSHARD_REQUIRE(max_rel_diff(uneven_logits, uneven_ref) < 1e-10);
}
