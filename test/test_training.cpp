// Training the model: the whole model's derived gradient (ReLU and SwiGLU
// FFNs) against finite differences and the 1-rank result, rematerialisation,
// the exact collectives, FLOPs and state of one step against the cost model,
// determinism, mixed precision, axis roles, checkpoints, the sharded weight
// update, every MPI call counted, stop signals and trace errors.
#include <gshard/gshard.hpp>
#include <gshard/model/train.hpp>

#include <array>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include <pthread.h>
#include <sys/resource.h>

#include "gradcheck.hpp"
#include "layouts.hpp"
#include "cost_tally.hpp"
#include "pmpi.hpp"
#include "testing.hpp"

using namespace gshard;
using gshard::testing::dot;
using gshard::testing::fd_check;
using gshard::testing::fd_check_params;
using gshard::testing::random_tensor;
using gshard::testing::sum_all;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using grid1 = mesh<axis<"x">>;
using grid2 = mesh<axis<"data">, axis<"expert">>;
using grid3 = mesh<axis<"data">, axis<"expert">, axis<"model">>;  // heads and FFN hidden units split over "model"
using gshard::testing::data_expert_model_sizes;

template <class V>
double scalar(const V& v) {  // a replicated rank-0 var's value
  return double(v.value().local()());
}

}  // namespace

namespace {
model::config tiny(ffn_kind ffn = ffn_kind::relu) {
  model::config c;
  c.model = 8, c.heads = 2, c.head_dim = 4, c.hidden = 12, c.experts = 8, c.layers = 2;
  c.gating.capacity_factor = 4.0;
  c.gating.second = moe::second_policy::all;
  c.aux_coef = 0.1;
  c.ffn = ffn;
  return c;
}
local_tensor<std::int32_t, 2> some_tokens(index_t B, index_t L) {
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  return tok;
}

// A model, its parameters and Adam's state on one mesh.
// While it lives, rank's files may grow to `bytes` only (0: no limit
// change); SIGXFSZ is ignored so a write past it fails with EFBIG, as a full
// disk fails with ENOSPC.
struct file_size_limit {
  rlimit old{};
  bool set = false;
  void (*old_handler)(int) = nullptr;
  explicit file_size_limit(rlim_t bytes) {
    if (bytes == 0) return;
    getrlimit(RLIMIT_FSIZE, &old);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit now = old;
    now.rlim_cur = bytes;
    set = setrlimit(RLIMIT_FSIZE, &now) == 0;
  }
  ~file_size_limit() {
    if (!set) return;
    setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
  }
};

template <class T, class Mesh, class Roles = default_roles, class Opt = adam>
struct trainer {
  using model_t = model::transformer<T, Mesh, Roles>;
  parameters<Mesh> ps;
  model_t tr;
  Opt opt;
  trainer(const Mesh& m, const model::config& c, std::uint64_t seed, const typename Opt::config_type& ac = {})
      : ps(m, seed), tr(ps, c), opt(ac, ps) {}
  template <class Axes>
  trainer(const Mesh& m, const model::config& c, std::uint64_t seed, const typename Opt::config_type& ac,
          shard_weight_update<Axes> how)
      : ps(m, seed, how), tr(ps, c), opt(ac, ps) {}
  typename model_t::tokens_type tokens(const local_tensor<std::int32_t, 2>& tok) const {
    return distribute<typename model_t::tokens_type>(ps.mesh(), tok);
  }
  std::vector<double> steps(const local_tensor<std::int32_t, 2>& tok, int from, int to) {
    std::vector<double> losses;
    for (int step = from; step < to; ++step)
      losses.push_back(model::train_step(tr, ps, opt, tokens(tok), std::uint64_t(step)).loss);
    return losses;
  }
  std::vector<checkpoint_part> parts() { return model::checkpoint_parts(ps, opt); }
};
}  // namespace

TEST_CASE("the whole model's derived gradient matches finite differences and the 1-rank gradient", "[train][grad][model]") {
  const int P = world_size();
  for (auto ffn : {ffn_kind::relu, ffn_kind::swiglu}) {
    auto c = tiny(ffn);  // with sinusoidal positions (ReLU) and learned ones (SwiGLU)
    c.positions = ffn == ffn_kind::relu ? model::position_kind::sinusoidal : model::position_kind::learned, c.max_len = 7;
    const auto tok = some_tokens(2 * P, 6);
    // The 1-rank gradients, computed on each rank alone.
    std::map<std::string, local_tensor<double, 1>> ref;
    {
      grid2 self(MPI_COMM_SELF, {1, 1});
      trainer<double, grid2> one(self, c, 3);
      tape t(one.ps);
      t.backward(one.tr.forward(t, one.tokens(tok), 0).loss);
      for (std::size_t i = 0; i < one.ps.size(); ++i) {
        auto g = one.ps.grads()[i].f64();
        local_tensor<double, 1> flat(index_t(g.size()));
        std::copy(g.begin(), g.end(), flat.data());
        ref[one.ps.name(i)] = flat;
      }
    }
    auto check = [&](const auto& m) {
      using Mesh = std::remove_cvref_t<decltype(m)>;
      trainer<double, Mesh> run(m, c, 3);
      const auto tokens = run.tokens(tok);
      auto loss = [&](tape& t) { return run.tr.forward(t, tokens, 0).loss; };
      // Every parameter's gradient, gathered, equals the 1-rank one.
      std::size_t tensors = 0;
      auto vs_one_after_backward = [&](std::size_t bucket) {
        run.ps.set_bucket_bytes(bucket);
        {
          tape t(run.ps);
          t.backward(loss(t));
        }
        double vs_one = 0;
        tensors = 0;
        for (std::size_t i = 0; i < run.ps.size(); ++i) {
          const std::vector<char> bytes = run.ps.grads()[i].gather_to_root();
          if (run.ps.mesh().rank() != 0) continue;
          const double* g = reinterpret_cast<const double*>(bytes.data());
          const auto& r = ref.at(run.ps.name(i));
          for (index_t k = 0; k < r.size(); ++k) vs_one = std::max(vs_one, std::abs(g[k] - r.data()[k]) / (1e-6 + std::abs(r.data()[k])));
          ++tensors;
        }
        return sum_all(world_rank() == 0 ? vs_one : 0.0);
      };
      // Buckets of 1 KiB fill during the backward and travel while it
      // computes (plans of one step and of several); the default's one
      // bucket runs at its end. The same gradients either way.
      const double vs_one_small_buckets = vs_one_after_backward(1024);
      const double vs_one = std::max(vs_one_after_backward(default_bucket_bytes), vs_one_small_buckets);
      // Finite differences of every parameter (two probes per shard).
      double worst = 0;
      auto f = [&] {
        tape t(run.ps, tape::no_grad);
        return scalar(loss(t));
      };
      if (c.positions == model::position_kind::learned) {
        auto table = *run.tr.learned_positions();
        worst = std::max(worst, fd_check(table.value(), table.grad(), f, 2));
      }
      const auto& b0 = run.tr.blocks()[0];
      const auto& b1 = run.tr.blocks()[1];
      for (const auto* b : {&b0, &b1}) {
        for (const auto* w : {&b->norm1, &b->norm2}) worst = std::max(worst, fd_check(const_cast<std::remove_cvref_t<decltype(*w)>*>(w)->value(), w->grad(), f, 2));
        for (const auto* w : {&b->attn.wq, &b->attn.wk, &b->attn.wv})
          worst = std::max(worst, fd_check(const_cast<std::remove_cvref_t<decltype(*w)>*>(w)->value(), w->grad(), f, 2));
        auto wo = b->attn.wo;
        worst = std::max(worst, fd_check(wo.value(), wo.grad(), f, 2));
        if (b->ffn) {
          auto w1 = b->ffn->w1, w2 = b->ffn->w2;
          worst = std::max({worst, fd_check(w1.value(), w1.grad(), f, 2), fd_check(w2.value(), w2.grad(), f, 2)});
          if (b->ffn->w1_up) {
            auto w = *b->ffn->w1_up;
            worst = std::max(worst, fd_check(w.value(), w.grad(), f, 2));
          }
        }
        if (b->moe) {
          auto gate = b->moe->router, wi = b->moe->expert_ffn.w1, wo2 = b->moe->expert_ffn.w2;
          worst = std::max({worst, fd_check(gate.value(), gate.grad(), f, 2), fd_check(wi.value(), wi.grad(), f, 2),
                            fd_check(wo2.value(), wo2.grad(), f, 2)});
          if (b->moe->expert_ffn.w1_up) {
            auto w = *b->moe->expert_ffn.w1_up;
            worst = std::max(worst, fd_check(w.value(), w.grad(), f, 2));
          }
        }
      }
      INFO((ffn == ffn_kind::relu ? "ReLU" : "SwiGLU") << " on " << m.describe() << ": worst relative error " << worst
                                                              << ", worst difference from 1 rank " << vs_one << " over "
                                                              << tensors << " tensors");
      GSHARD_REQUIRE(worst < 1e-6 && vs_one < 1e-9);
      GSHARD_REQUIRE(run.ps.size() == (ffn == ffn_kind::relu ? 20u : 23u));  // SwiGLU: two w1_up and the positions
    };
    check(grid2(MPI_COMM_WORLD, {1, P}));
    if (P == 4) check(grid2(MPI_COMM_WORLD, {2, 2}));
    if (P % 2 == 0) check(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)));
  }
}

TEST_CASE("two interleaved micro-batches route, lose and learn as the whole batch, at every rank count",
          "[train][micro_batches]") {
  const int P = world_size();
  for (const auto balance : {moe::balance_mode::aux, moe::balance_mode::bias}) {
    auto c = tiny();
    c.gating.second = moe::second_policy::random;  // keyed by each row's index in the whole batch
    c.gating.capacity_factor = 1.0;                // binding: tokens drop
    c.gating.z_loss_coef = 0.01;
    c.gating.balance = balance;
    if (balance == moe::balance_mode::bias) c.aux_coef = 0, c.gating.bias_rate = 0.1;
    const auto tok = some_tokens(2 * P + 1, 6);  // uneven over the batch ranks
    // The whole batch on each rank alone: loss terms, counters, gradients, the bias after the step.
    struct result {
      double loss = 0, ce = 0, aux = 0, z = 0;
      std::vector<moe::gating_stats> moe;
      std::map<std::string, std::vector<double>> grads;  // on rank 0
      std::vector<double> bias;
      bool cut = false;             // the rows split in two on every rank (halve_blocks)
      std::size_t all_to_alls = 0;  // forward and backward
    };
    auto run = [&](const auto& m, int micro_batches) {
      using Mesh = std::remove_cvref_t<decltype(m)>;
      auto cm = c;
      cm.micro_batches = micro_batches;
      trainer<double, Mesh> r(m, cm, 5);
      result out;
      {
        const collective_recorder rec;
        tape t(r.ps);
        const auto tokens = r.tokens(tok);
        out.cut = halve_blocks<0>(tokens) > 0;
        auto o = r.tr.forward(t, tokens, 3);
        out.loss = scalar(o.loss), out.ce = o.ce, out.aux = o.aux, out.z = o.z, out.moe = o.moe;
        t.backward(o.loss);
        out.all_to_alls = rec.calls(collective::all_to_all);
      }
      for (std::size_t i = 0; i < r.ps.size(); ++i) {
        const std::vector<char> bytes = r.ps.grads()[i].gather_to_root();
        const double* g = reinterpret_cast<const double*>(bytes.data());
        out.grads[r.ps.name(i)].assign(g, g + bytes.size() / sizeof(double));
      }
      if (const auto& b = r.tr.blocks()[1].moe->bias) out.bias.assign(b->value().data(), b->value().data() + 8);
      return out;
    };
    const result whole = run(grid2(MPI_COMM_SELF, {1, 1}), 1);
    // `halves`: whether the batch's rows on this mesh split in two. 2P+1 rows
    // over the ranks of one axis always do; over a 2 x 4 grid no cut gives
    // every rank the canonical blocks of both parts, and the batch runs whole.
    auto check = [&](const auto& m, bool halves) {
      const result two = run(m, 2);
      GSHARD_REQUIRE(two.cut == halves);
      // Each half's MoE layers run their own all_to_alls: twice as many.
      GSHARD_REQUIRE(two.all_to_alls == (halves ? 2 : 1) * whole.all_to_alls);
      double worst = 0;
      const auto near = [&](double a, double b) { worst = std::max(worst, std::abs(a - b) / (1e-9 + std::abs(b))); };
      near(two.loss, whole.loss), near(two.ce, whole.ce), near(two.aux, whole.aux), near(two.z, whole.z);
      if (world_rank() == 0)
        for (const auto& [name, g] : whole.grads)
          for (std::size_t k = 0; k < g.size(); ++k) near(two.grads.at(name)[k], g[k]);
      worst = sum_all(worst);
      INFO("balance " << (balance == moe::balance_mode::aux ? "aux" : "bias") << " on " << m.describe()
                      << ": worst relative difference from the whole batch on 1 rank " << worst);
      GSHARD_REQUIRE(worst < 1e-9);
      GSHARD_REQUIRE(two.moe.size() == whole.moe.size());
      for (std::size_t l = 0; l < whole.moe.size(); ++l) {
        GSHARD_REQUIRE(two.moe[l].tokens == whole.moe[l].tokens);
        GSHARD_REQUIRE(two.moe[l].expert_load == whole.moe[l].expert_load);
        GSHARD_REQUIRE(two.moe[l].expert_demand == whole.moe[l].expert_demand);
        GSHARD_REQUIRE(two.moe[l].total_dropped() == whole.moe[l].total_dropped());
      }
      GSHARD_REQUIRE(whole.moe[0].total_dropped() > 0);
      GSHARD_REQUIRE(two.bias == whole.bias);  // moved once, by the whole batch's demand
      if (balance == moe::balance_mode::bias) GSHARD_REQUIRE(!whole.bias.empty());
    };
    check(grid2(MPI_COMM_WORLD, {1, P}), true);
    if (P % 2 == 0 && P > 2) check(grid2(MPI_COMM_WORLD, {2, P / 2}), P != 8);  // the batch over two axes
    if (P % 2 == 0) check(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), true);
  }
  SECTION("a model without an MoE layer runs its batch whole; bad options and blocks that do not join are refused") {
    grid2 m(MPI_COMM_WORLD, {1, P});
    for (const int experts : {0, 8}) {
      auto c = tiny();
      c.experts = experts, c.layers = experts > 0 ? 1 : c.layers;  // one block: no MoE layer
      std::size_t gemms[2] = {0, 0};
      double losses[2] = {0, 0};
      for (const int k : {1, 2}) {
        c.micro_batches = k;
        trainer<double, grid2> r(m, c, 5);
        const gemm_recorder rec;
        tape t(r.ps);
        auto o = r.tr.forward(t, r.tokens(some_tokens(2 * P + 1, 6)), 3);
        t.backward(o.loss);
        gemms[k - 1] = rec.calls().size(), losses[k - 1] = scalar(o.loss);
      }
      INFO("experts " << experts << ": " << gemms[0] << " and " << gemms[1] << " GEMMs");
      GSHARD_REQUIRE(gemms[1] == gemms[0] && (world_rank() != 0 || gemms[0] > 0));  // a rank may hold no rows
      GSHARD_REQUIRE(losses[1] == losses[0]);
    }
    parameters<grid2> ps(m, 1);
    auto c = tiny();
    c.micro_batches = 3;
    GSHARD_REQUIRE_THROWS_WITH((model::transformer<double, grid2>(ps, c)), error,
                               "gshard::model::transformer: config.micro_batches = 3; 1 (the batch whole) or 2 (two "
                               "interleaved halves)");
    c.micro_batches = 2, c.remat = {1};
    GSHARD_REQUIRE_THROWS_WITH((model::transformer<double, grid2>(ps, c)), error,
                               "gshard::model::transformer: config.micro_batches = 2 with blocks in config.remat");
    {  // a dense model runs whole: remat beside micro_batches = 2 is fine there
      parameters<grid2> dense_ps(m, 1);
      c.experts = 0;
      GSHARD_REQUIRE(model::transformer<double, grid2>(dense_ps, c).blocks().size() == std::size_t(c.layers));
    }
    {  // a call of the MoE layer in phases finishes once; a bias move needs a bias
      c = tiny();
      model::transformer<double, grid2> tr(ps, c);
      tape t(ps, tape::no_grad);
      named<double, "GSM", grid2, roles_on<grid2, default_roles>::at_tokens> x(m, {index_t(P), 4, 8});
      x.local().setConstant(0.5);
      const auto& layer = *tr.blocks()[1].moe;
      auto call = layer.start(t.constant(x), c.gating, 0);
      call.experts();
      (void)call.finish();
      GSHARD_REQUIRE_THROWS_WITH(call.finish(), error,
                                 "gshard::moe::layer: finish() was called before on this call of layer 'block1'");
      GSHARD_REQUIRE_THROWS_WITH(layer.update_bias(std::vector<std::int64_t>(8, 1), 0.1), error,
                                 "update_bias of layer 'block1' with the demand of 8 experts; the layer has 8 and no bias");
    }
    if (P >= 2) {  // 1 row and 1 row: rank 0 holds the first row of each, not the first two of the joined
      using X = named<double, "BM", grid2, roles_on<grid2, default_roles>::at_tokens>;
      tape t(ps, tape::no_grad);
      auto a = t.constant(X(m, {1, 3})), b = t.constant(X(m, {1, 3}));
      GSHARD_REQUIRE_THROWS_WITH(join_blocks<0>(a, b), shape_error,
                                 "gshard::join_blocks: blocks of 1 and 1 rows along dim 0 of ");
    }
  }
}

TEST_CASE("rematerialised blocks give the kept blocks' gradients, route alike, move the router bias once", "[train][remat]") {
  const int P = world_size();
  // Every block rematerialised against none: the same gradients (double,
  // 1e-12 relative), losses, routing and router bias after two steps; the
  // recomputed forwards' FLOPs counted apart from the model's; the forward's
  // collectives again in the backward.
  auto check = [&](const auto& m, model::config c) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    const auto tok = some_tokens(2 * P, 6);
    trainer<double, Mesh> kept(m, c, 3);
    c.remat = {0, 1};
    trainer<double, Mesh> re(m, c, 3);
    struct run {
      double loss, flops, recomputed;
      std::size_t collectives;
      std::vector<std::int64_t> load;
    };
    auto step = [&](auto& tr, int s) {
      collective_recorder rec;
      const double f0 = model_flops(), r0 = recomputed_flops();
      const auto r = model::train_step(tr.tr, tr.ps, tr.opt, tr.tokens(tok), std::uint64_t(s));
      return run{r.loss, model_flops() - f0, recomputed_flops() - r0, rec.events().size(), r.moe.at(0).expert_load};
    };
    // The blocks' forward FLOPs (this rank's share): a forward's, less the unembedding's 2·B·L·M·V.
    const double blocks_forward = [&] {
      const double f0 = model_flops();
      tape t(kept.ps, tape::no_grad);
      (void)kept.tr.forward(t, kept.tokens(tok), 0);
      return model_flops() - f0 - 2.0 * double(2 * P * 6 * c.model * c.vocab) / double(P);
    }();
    double worst = 0;
    for (int s = 0; s < 2; ++s) {
      const run a = step(kept, s), b = step(re, s);
      GSHARD_REQUIRE(a.loss == b.loss);
      GSHARD_REQUIRE(a.load == b.load);
      GSHARD_REQUIRE(a.flops == b.flops);
      GSHARD_REQUIRE(a.recomputed == 0);
      GSHARD_REQUIRE(std::abs(b.recomputed - blocks_forward) <= 1e-12 * blocks_forward);
      GSHARD_REQUIRE(b.collectives > a.collectives);
      for (std::size_t i = 0; i < kept.ps.size(); ++i) {  // the gradients of this step, gathered
        const auto g1 = kept.ps.grads()[i].gather_to_root(), g2 = re.ps.grads()[i].gather_to_root();
        const auto* x = reinterpret_cast<const double*>(g1.data());
        const auto* y = reinterpret_cast<const double*>(g2.data());
        for (std::size_t j = 0; j < g1.size() / sizeof(double); ++j)
          worst = std::max(worst, std::abs(x[j] - y[j]) / std::max(1e-6, std::abs(x[j])));
      }
    }
    worst = sum_all(worst);
    INFO(m.describe() << ": worst relative gradient difference " << worst);
    GSHARD_REQUIRE(worst < 1e-12);
    const auto& b1 = kept.tr.blocks()[1].moe, &b2 = re.tr.blocks()[1].moe;
    if (b1->bias) {
      double moved = 0;
      for (index_t e = 0; e < c.experts; ++e) {
        GSHARD_REQUIRE(b1->bias->value().data()[e] == b2->bias->value().data()[e]);
        moved += std::abs(b1->bias->value().data()[e]);
      }
      GSHARD_REQUIRE(moved > 0);
    }
  };
  auto c = tiny();
  check(grid2(MPI_COMM_WORLD, {1, P}), c);
  c.gating.balance = moe::balance_mode::bias, c.gating.bias_rate = 0.01, c.gating.second = moe::second_policy::random;
  check(grid2(MPI_COMM_WORLD, {1, P}), c);
  if (P % 2 == 0) check(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), tiny(ffn_kind::swiglu));
  auto piped = tiny();  // the all_to_alls in flight, recomputed in the backward with their pipeline
  piped.overlap_degree = 2;
  check(grid2(MPI_COMM_WORLD, {1, P}), piped);

  // Misuse: a block that does not exist; a function reading a tracked value
  // it was not given.
  {
    auto bad = tiny();
    bad.remat = {2};
    grid2 m(MPI_COMM_WORLD, {1, P});
    parameters<grid2> ps(m, 1);
    GSHARD_REQUIRE_THROWS_WITH((model::transformer<double, grid2>(ps, bad)), error,
                               "gshard::model::transformer: config.remat names block 2 of a model with 2 blocks (0 to 1)");
  }
  {
    grid1 m(MPI_COMM_WORLD);
    parameters<grid1> ps(m, 1);
    param<tensor<double, 1, grid1, replicate>> w(ps, "w", {3}, init::ones());
    tape t(ps);
    auto x = t.constant(distribute<replicate>(m, random_tensor<1, double>({3}, 4)));
    auto wx = x * t.use(w);  // tracked
    GSHARD_REQUIRE_THROWS_WITH(remat([wx](const auto& in) { return in * wx; }, x), error,
                               "gshard::remat: the function uses a tracked value f64[3] that it was not given as an input");
    auto y = remat([&w, &t](const auto& in) { return in * t.use(w); }, x);  // a parameter: declared, so allowed
    const auto r = distribute<replicate>(m, random_tensor<1, double>({3}, 5));
    t.backward(einsum<"i,i->">(y, t.constant(r)));
    for (index_t i = 0; i < 3; ++i) GSHARD_REQUIRE(w.grad().local()(i) == x.value().local()(i) * r.local()(i));
  }
}

TEST_CASE("one training step runs exactly the collectives, FLOPs and state the cost model counts", "[train][collectives][cost]") {
  // gshard/model/cost.hpp counts a step from the config, the mesh's sizes
  // and the rank's coordinates alone; here each rank's counters of a real
  // step must equal its count: the calls and bytes of every collective per
  // kind and axes, the model FLOPs, the declared weights and the bytes of
  // parameters, gradients and Adam's state — for the replicated and the
  // sharded weight update, on (data, expert) and (data, expert, model)
  // meshes, with GShard's routing, with SwiGLU shared experts and top-1, and
  // for a dense model. The batch of 2P + 1 sequences and the 8 experts at 3
  // and 6 ranks do not divide, nor do 3 heads and 13 hidden units over a
  // "model" axis of P ranks: the padded collectives count their padding.
  const int P = world_size();
  const index_t B = 2 * P + 1, L = 6;
  auto ran_with = [&](const auto& m, const model::config& c, bool sharded, std::size_t bucket, auto optimizer_tag,
                      wire gradients = wire::same, wire weights = wire::same) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    constexpr bool factored = std::is_same_v<decltype(optimizer_tag), adafactor_config>;
    using run_t = trainer<float, Mesh, default_roles, std::conditional_t<factored, adafactor, adam>>;
    run_t run = sharded ? run_t(m, c, 3, optimizer_tag, shard_weight_update<default_roles::batch>{}) : run_t(m, c, 3, optimizer_tag);
    run.ps.set_bucket_bytes(bucket);
    run.ps.set_gradient_wire(gradients);
    run.ps.set_weight_wire(weights);
    if (weights == wire::bf16) run.opt = decltype(run.opt)(optimizer_tag, run.ps);  // built anew: with masters
    const auto tokens = run.tokens(some_tokens(B, L));
    collective_recorder rec;
    const double f0 = model_flops();
    model::train_step(run.tr, run.ps, run.opt, tokens, 0);
    const double flops = model_flops() - f0;
    const auto ms = gshard::testing::cost_mesh(m);
    const model::cost::step_options opts{B, L, sharded, int(sizeof(float)), bucket,
                                         factored ? model::cost::optimizer_kind::adafactor : model::cost::optimizer_kind::adam,
                                         factored && optimizer_tag.beta1 > 0, 0, gradients, weights};
    const auto w = model::cost::count_step(c, ms, opts);
    // The default count, at coordinate 0, is the busiest rank's: the most
    // collective bytes, state and local FLOPs of any rank.
    auto busiest = ms;
    busiest.at = {};
    const auto wb = model::cost::count_step(c, busiest, opts);
    auto sums = [](const model::cost::step_work& x) {
      std::array<double, 3> s{0, x.parameter_bytes + x.gradient_bytes + x.optimizer_bytes, 0};
      for (const auto& y : x.collectives) s[0] += y.bytes;
      for (const auto& y : x.einsums) s[2] += y.local_flops();
      return s;
    };
    std::array<double, 3> most{};
    MPI_Allreduce(sums(w).data(), most.data(), 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    GSHARD_REQUIRE(most == sums(wb));
    const auto seen = gshard::testing::tally(rec), want = gshard::testing::tally(w, m, ms);
    using gshard::testing::text;
    // The declared weights, and the state's bytes on this rank.
    const std::string weight_diff = gshard::testing::weight_difference(run.ps, model::cost::weights(c, ms.has_model_axis), ms, sizeof(float));
    INFO(m.describe() << (sharded ? ", sharded update" : ", replicated update") << (c.experts == 0 ? ", dense" : "")
                      << (factored ? ", Adafactor" : ", Adam") << (weights == wire::bf16 ? ", bf16 weights" : "")
                      << ", buckets of " << bucket << " B"
                      << "\nran: " << text(seen) << "\nwant: " << text(want) << "\nmodel FLOPs " << flops << " counted "
                      << w.model_flops << "\n" << weight_diff);
    GSHARD_REQUIRE(seen == want);
    GSHARD_REQUIRE(std::abs(flops - w.model_flops) <= 1e-12 * w.model_flops);
    GSHARD_REQUIRE(weight_diff.empty());
    GSHARD_REQUIRE(double(run.ps.values().local_bytes()) == w.parameter_bytes);
    GSHARD_REQUIRE(double(run.ps.grads().local_bytes()) == w.gradient_bytes);
    GSHARD_REQUIRE(double(run.opt.state_bytes()) == w.optimizer_bytes);
  };
  // A config whose all_to_alls carry bf16 runs with its gradients' reductions
  // and its weights in bf16 too (the updated weights gathered in bf16, fp32
  // masters in Adam's state).
  auto ran = [&](const auto& m, const model::config& c, bool sharded, std::size_t bucket = default_bucket_bytes) {
    ran_with(m, c, sharded, bucket, adam_config{}, c.all_to_all_wire, c.all_to_all_wire);
  };
  auto shared_top1 = tiny(ffn_kind::swiglu);
  shared_top1.shared_experts = 1, shared_top1.gating.top_k = 1;
  shared_top1.positions = model::position_kind::learned, shared_top1.max_len = 6;  // one more weight, reduced like embed
  auto dense = tiny();
  dense.experts = 0, dense.slot_hidden = 16;
  auto piped = tiny();
  piped.overlap_degree = 3;  // three all_to_alls (and all_reduces over "model") where one was, the same bytes
  piped.all_to_all_wire = wire::bf16;  // ... and those bytes halved, and the gradients' and weights': bf16 on the wire
  auto uneven_heads = tiny();
  uneven_heads.heads = 3, uneven_heads.hidden = 13;
  const index_t d = P % 2 == 0 && P > 2 ? 2 : 1, e = P / d;
  for (const auto& c : {tiny(), shared_top1, dense, piped})
    for (bool sharded : {false, true}) {
      ran(grid2(MPI_COMM_WORLD, {d, e}), c, sharded);
      ran(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), c, sharded);
    }
  for (bool sharded : {false, true}) ran(grid3(MPI_COMM_WORLD, {1, 1, P}), uneven_heads, sharded);
  // Adafactor: its factors reduced over "model" where their means run along
  // a model-split dim, its RMS sums over every axis, its state; without and
  // with a first moment.
  adafactor_config with_moment;
  with_moment.beta1 = 0.9;
  for (const auto& af : {adafactor_config{}, with_moment})
    for (bool sharded : {false, true}) {
      ran_with(grid2(MPI_COMM_WORLD, {d, e}), tiny(), sharded, default_bucket_bytes, af);
      ran_with(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), tiny(), sharded, default_bucket_bytes, af);
    }
  for (bool sharded : {false, true})  // bf16 weights: Adafactor's masters too
    ran_with(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), tiny(), sharded, default_bucket_bytes, with_moment,
             wire::same, wire::bf16);
  // Gradients and gathers one collective per weight (0), and in buckets cut
  // at 1 KiB (a few weights each: the tiny model's are 32 B to 8 KiB), where
  // the order the gradients complete in decides the cuts (SwiGLU's two input
  // projections, shared experts).
  for (std::size_t bucket : {std::size_t(0), std::size_t(1024)})
    for (bool sharded : {false, true})
      for (const auto& c : {tiny(), shared_top1, piped}) {
        ran(grid2(MPI_COMM_WORLD, {d, e}), c, sharded, bucket);
        ran(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), c, sharded, bucket);
      }
}

TEST_CASE("the same seed gives the same losses at every rank count, and bit-identical reruns", "[train][determinism]") {
  const int P = world_size();
  const auto c = tiny();
  const auto tok = some_tokens(2 * P + 1, 6);  // a batch that does not divide, 8 experts at every P
  adam_config ac;
  ac.lr = 1e-2, ac.warmup_steps = 1;
  auto run = [&](const auto& m, auto zero) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    trainer<decltype(zero), Mesh> t(m, c, 5, ac);
    return t.steps(tok, 0, 4);
  };
  const auto one = run(grid2(MPI_COMM_SELF, {1, 1}), 0.0);
  const auto many = run(grid2(MPI_COMM_WORLD, {1, P}), 0.0);
  const auto split_heads = run(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), 0.0);
  double worst = 0;
  for (std::size_t i = 0; i < one.size(); ++i)
    worst = std::max({worst, std::abs(one[i] - many[i]) / std::abs(one[i]),
                      std::abs(one[i] - split_heads[i]) / std::abs(one[i])});
  INFO("1 rank vs " << P << " (also with heads split over \"model\"): worst relative difference " << worst);
  GSHARD_REQUIRE(worst < 1e-10);
  GSHARD_REQUIRE(many.back() < many.front());  // it learns
  const auto f1 = run(grid2(MPI_COMM_WORLD, {1, P}), 0.0f);
  const auto f2 = run(grid2(MPI_COMM_WORLD, {1, P}), 0.0f);
  GSHARD_REQUIRE(f1 == f2);  // bit-identical
}

TEST_CASE("mixed precision: bf16 GEMMs train as fp32 does, at every rank count; the router multiplies in fp32",
          "[train][bf16]") {
  const int P = world_size();
  auto c = tiny();
  const auto tok = some_tokens(2 * P, 6);
  adam_config ac;
  ac.lr = 1e-2, ac.warmup_steps = 1;
  const bool native = detail::gemm_bf16_native();
  auto run = [&](const auto& m, matmul_precision p, std::vector<gemm_call>* calls = nullptr) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    const matmul_precision_scope s(p);
    trainer<float, Mesh> t(m, c, 5, ac);
    std::optional<gemm_recorder> rec;
    if (calls) rec.emplace();
    auto losses = t.steps(tok, 0, 6);
    if (calls) *calls = rec->calls();
    return losses;
  };
  std::vector<gemm_call> calls;
  const auto f32 = run(grid2(MPI_COMM_SELF, {1, 1}), matmul_precision::f32);
  const auto one = run(grid2(MPI_COMM_SELF, {1, 1}), matmul_precision::bf16, &calls);
  const auto many = run(grid2(MPI_COMM_WORLD, {1, P}), matmul_precision::bf16);
  const auto split_heads = run(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), matmul_precision::bf16);
  double vs_ranks = 0, vs_f32 = 0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    vs_ranks = std::max({vs_ranks, std::abs(one[i] - many[i]) / one[i], std::abs(one[i] - split_heads[i]) / one[i]});
    vs_f32 = std::max(vs_f32, std::abs(one[i] - f32[i]) / f32[i]);
  }
  INFO("bf16 GEMMs: " << (native ? "on bf16 units" : "none here, fp32") << "; 1 rank vs " << P
                      << " ranks: worst relative loss difference " << vs_ranks << "; vs fp32: " << vs_f32);
  // Other rank counts sum in other orders, so an operand's rounding to bf16
  // may go the other way: that element moves by 2^-8 of itself, one among
  // thousands — far below 2^-12 of the loss (measured: below 1e-9).
  GSHARD_REQUIRE(vs_ranks < 0x1p-12);
  GSHARD_REQUIRE(vs_f32 < 0.02);
  if (!native) GSHARD_REQUIRE(one == f32);
  GSHARD_REQUIRE(many.back() < many.front());  // it learns
  // In bf16 every GEMM but the router's rounds its operands; the router's
  // three a step (the logits, their gradients by x and by the router; one
  // MoE layer) multiply in fp32. moe_tests checks the router's logits are
  // fp32's to the bit.
  int fp32 = 0, rounded = 0;
  for (const gemm_call& g : calls) ++(g.element_bytes == 2 ? rounded : fp32);
  INFO(fp32 << " fp32 GEMMs, " << rounded << " in bf16");
  GSHARD_REQUIRE(fp32 == (native ? 6 * 3 : int(calls.size())));
  GSHARD_REQUIRE(rounded > (native ? 6 * 10 : -1));
  // The trainers' --precision bf16: the weights bf16 copies of fp32 masters
  // too, a sharded update gathering them in bf16.
  auto with_masters = [&](const auto& m, bool sharded) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using run_t = trainer<float, Mesh>;
    const matmul_precision_scope s(matmul_precision::bf16);
    run_t t = sharded ? run_t(m, c, 5, ac, shard_weight_update<default_roles::batch>{}) : run_t(m, c, 5, ac);
    t.ps.set_weight_wire(wire::bf16);
    t.opt = adam(ac, t.ps);  // built anew for bf16 weights: with masters
    return t.steps(tok, 0, 6);
  };
  const auto masters_one = with_masters(grid2(MPI_COMM_SELF, {1, 1}), false);
  const auto masters_many = with_masters(grid2(MPI_COMM_WORLD, {P % 2 == 0 && P > 2 ? 2 : 1, P % 2 == 0 && P > 2 ? P / 2 : P}), true);
  double masters_vs_ranks = 0, masters_vs_f32 = 0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    masters_vs_ranks = std::max(masters_vs_ranks, std::abs(masters_one[i] - masters_many[i]) / masters_one[i]);
    masters_vs_f32 = std::max(masters_vs_f32, std::abs(masters_one[i] - f32[i]) / f32[i]);
  }
  INFO("bf16 weights with fp32 masters: 1 rank vs " << P << " ranks (sharded update) " << masters_vs_ranks << "; vs fp32 "
                                                    << masters_vs_f32);
  GSHARD_REQUIRE(masters_vs_ranks < 0x1p-12);
  GSHARD_REQUIRE(masters_vs_f32 < 0.02);
  GSHARD_REQUIRE(masters_many.back() < masters_many.front());
  // Rematerialised, the blocks recompute in bf16 with the router in fp32
  // (its forward once more a step), and train as the kept blocks do.
  c.remat = {0, 1};
  std::vector<gemm_call> remat_calls;
  const auto remat = run(grid2(MPI_COMM_SELF, {1, 1}), matmul_precision::bf16, &remat_calls);
  fp32 = 0;
  for (const gemm_call& g : remat_calls) fp32 += g.element_bytes == 4;
  INFO("rematerialised: " << fp32 << " fp32 GEMMs of " << remat_calls.size());
  GSHARD_REQUIRE(fp32 == (native ? 6 * 4 : int(remat_calls.size())));
  for (std::size_t i = 0; i < one.size(); ++i) GSHARD_REQUIRE(std::abs(remat[i] - one[i]) <= 1e-12 * one[i]);
}

TEST_CASE("gradient reductions in bf16: bucketed or not, the same bits; 1 rank's are fp32's rounded; within bf16 of fp32's",
          "[train][bf16][buckets]") {
  // parameters::set_gradient_wire(wire::bf16): each rank's gradient rounded
  // to bf16, the parts added in fp32 and rounded once — by the buckets
  // (state/buckets.hpp) or, unbucketed, by the reshard's executor: two
  // implementations of one rule, so they must agree to the bit.
  const int P = world_size();
  const auto c = tiny();
  const auto tok = some_tokens(2 * P + 1, 6);
  auto grads = [&](const auto& m, bool sharded, wire w, std::size_t bucket) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using run_t = trainer<float, Mesh>;
    run_t run = sharded ? run_t(m, c, 3, adam_config{}, shard_weight_update<default_roles::batch>{}) : run_t(m, c, 3);
    run.ps.set_bucket_bytes(bucket);
    run.ps.set_gradient_wire(w);
    tape t(run.ps);
    auto loss = run.tr.forward(t, run.tokens(tok), 0).loss;
    collective_recorder rec;  // the backward's sums over the batch axes: the weights' gradients
    t.backward(loss);
    std::pair<std::vector<float>, std::size_t> out{{}, 0};
    for (const auto& e : rec.events())
      if ((e.kind == collective::reduce_scatter || e.kind == collective::all_reduce) && e.axes.find("model") == std::string::npos)
        out.second += e.bytes;
    for (std::size_t i = 0; i < run.ps.size(); ++i) {
      const auto g = run.ps.grads()[i].f32();
      out.first.insert(out.first.end(), g.begin(), g.end());
    }
    return out;
  };
  {  // 1 rank: nothing to add, every gradient rounded once
    grid2 self(MPI_COMM_SELF, {1, 1});
    const auto [g32, ignored] = grads(self, false, wire::same, default_bucket_bytes);
    const auto [g16, ignored16] = grads(self, false, wire::bf16, default_bucket_bytes);
    bool rounded = g32.size() == g16.size();
    for (std::size_t i = 0; rounded && i < g32.size(); ++i) rounded = g16[i] == float(bf16(g32[i]));
    GSHARD_REQUIRE(rounded);
  }
  auto check = [&](const auto& m) {
    for (bool sharded : {false, true}) {
      const auto [g32, bytes32] = grads(m, sharded, wire::same, default_bucket_bytes);
      const auto [alone, bytes_alone] = grads(m, sharded, wire::bf16, 0);
      const auto [bucketed, bytes] = grads(m, sharded, wire::bf16, default_bucket_bytes);
      const auto [small, bytes_small] = grads(m, sharded, wire::bf16, 1024);
      INFO(m.describe() << (sharded ? ", sharded update" : ", replicated update") << ": gradient bytes reduced " << bytes
                        << " against fp32's " << bytes32);
      GSHARD_REQUIRE((alone == bucketed && bucketed == small));
      GSHARD_REQUIRE(2 * bytes == bytes32);
      GSHARD_REQUIRE((bytes_alone == bytes && bytes_small == bytes));
      double worst = 0, scale = 0;
      for (std::size_t i = 0; i < g32.size(); ++i) {
        worst = std::max(worst, double(std::abs(bucketed[i] - g32[i])));
        scale = std::max(scale, double(std::abs(g32[i])));
      }
      INFO("worst difference from fp32's " << worst << " of " << scale);
      // Each of the P parts and their sum rounded once, within 2⁻⁸ of itself:
      // with parts no larger than the largest gradient, (P + 1)·2⁻⁸ of it.
      GSHARD_REQUIRE(worst <= (P + 1) * 0x1p-8 * scale);
    }
  };
  check(grid2(MPI_COMM_WORLD, {1, P}));
  check(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)));
}

TEST_CASE("axis roles are declared: a mesh named (dp, ep, tp) trains like (data, expert, model)", "[train][roles]") {
  const int P = world_size();
  using named_grid = mesh<axis<"dp">, axis<"ep">, axis<"tp">>;
  using roles = axis_roles<batch_axes<"dp", "ep">, expert_axes<"ep">, model_axes<"tp">>;
  const auto c = tiny();
  const auto tok = some_tokens(2 * P, 6);
  const auto s = data_expert_model_sizes(P);
  grid3 m3(MPI_COMM_WORLD, s);
  named_grid mn(MPI_COMM_WORLD, s);
  trainer<double, grid3> ref(m3, c, 9);
  trainer<double, named_grid, roles> other(mn, c, 9);
  static_assert(roles_on<named_grid, roles>::at_tokens::text == "B{dp,ep} G{dp,ep} H{tp} N{tp}");
  const auto l1 = ref.steps(tok, 0, 3), l2 = other.steps(tok, 0, 3);
  double worst = 0;
  for (std::size_t i = 0; i < l1.size(); ++i) worst = std::max(worst, std::abs(l1[i] - l2[i]));
  INFO("worst loss difference " << worst);
  GSHARD_REQUIRE(worst < 1e-12);
}

TEST_CASE("checkpoints resume the same curve, at any rank count, and refuse damaged files", "[train][checkpoint]") {
  const int P = world_size();
  const auto c = tiny();
  const auto tok = some_tokens(2 * P, 6);
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_ckpt_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string path = dir + "/model.ckpt";

  grid2 m(MPI_COMM_WORLD, {1, P});
  auto fresh = [&](const auto& mesh) { return std::make_unique<trainer<float, std::remove_cvref_t<decltype(mesh)>>>(mesh, c, 7); };
  const auto straight = fresh(m)->steps(tok, 0, 4);

  auto t1 = fresh(m);
  t1->steps(tok, 0, 2);
  save_checkpoint(path, m, t1->parts(), {{"step", 2.0}});
  {  // the same rank count: bit-identical continuation
    auto t2 = fresh(m);
    const auto meta = load_checkpoint(path, m, t2->parts());
    t2->opt.step = int(meta.at("step"));
    const auto resumed = t2->steps(tok, 2, 4);
    GSHARD_REQUIRE(meta.at("step") == 2.0 && resumed[0] == straight[2] && resumed[1] == straight[3]);
  }
  {  // one rank (each rank alone): resharded on load, the same weights to the bit (8 experts in
     // 3, 3, 2 at 3 ranks: a file saved at any rank count loads at any other), the same curve
     // within float rounding
    grid2 self(MPI_COMM_SELF, {1, 1});
    auto t3 = fresh(self);
    t3->opt.step = int(load_checkpoint(path, self, t3->parts()).at("step"));
    bool same = t3->ps.size() == t1->ps.size();
    for (std::size_t i = 0; i < std::min(t1->ps.size(), t3->ps.size()); ++i) {  // every rank gathers every weight
      const auto saved = t1->ps.values()[i].gather_to_root(), loaded = t3->ps.values()[i].gather_to_root();
      same = same && (world_rank() != 0 || saved == loaded);  // the gathered global bytes live on rank 0
    }
    GSHARD_REQUIRE(same);
    const auto resumed = t3->steps(tok, 2, 4);
    GSHARD_REQUIRE(std::abs(resumed[0] - straight[2]) < 1e-5 && std::abs(resumed[1] - straight[3]) < 1e-5);
  }
  {  // another mesh: heads, hidden units and their moments split over "model" on load
    grid3 m3(MPI_COMM_WORLD, data_expert_model_sizes(P));
    auto t4 = fresh(m3);
    t4->opt.step = int(load_checkpoint(path, m3, t4->parts()).at("step"));
    // ... and saved from there (shards split over "model"), back onto (data, expert).
    const std::string path3 = dir + "/model3.ckpt";
    save_checkpoint(path3, m3, t4->parts(), {{"step", 2.0}});
    const auto resumed = t4->steps(tok, 2, 4);
    GSHARD_REQUIRE(std::abs(resumed[0] - straight[2]) < 1e-5 && std::abs(resumed[1] - straight[3]) < 1e-5);
    auto t5 = fresh(m);
    t5->opt.step = int(load_checkpoint(path3, m, t5->parts()).at("step"));
    const auto back = t5->steps(tok, 2, 4);
    GSHARD_REQUIRE(std::abs(back[0] - straight[2]) < 1e-5 && std::abs(back[1] - straight[3]) < 1e-5);
  }
  {  // a checkpoint of format version 1 (test/data/v1_tiny.ckpt, 2 steps of
     // a tiny model at 1 rank, written by an earlier trainer): the same names
     // and format; the loaded weights give the loss recorded in its metadata.
    model::config old = tiny();
    old.experts = 4;
    grid2 self(MPI_COMM_SELF, {1, 1});
    trainer<float, grid2> t6(self, old, 0);
    const auto meta = load_checkpoint(std::string(GSHARD_TEST_DATA) + "/v1_tiny.ckpt", self, t6.parts());
    tape t(t6.ps, tape::no_grad);
    const auto out = t6.tr.forward(t, t6.tokens(some_tokens(4, 6)), 2);
    INFO("loss " << scalar(out.loss) << " vs recorded " << meta.at("check_loss"));
    GSHARD_REQUIRE(meta.at("step") == 2.0 && std::abs(scalar(out.loss) - meta.at("check_loss")) < 1e-5 &&
                   std::abs(out.ce - meta.at("check_ce")) < 1e-5 && std::abs(out.aux - meta.at("check_aux")) < 1e-5);
  }

  // Damaged files: one clear error on every rank, naming the file and the problem.
  auto damaged = [&](const std::string& name, auto&& damage) {
    const std::string bad = dir + "/" + name;
    if (world_rank() == 0) {
      std::filesystem::copy_file(path, bad, std::filesystem::copy_options::overwrite_existing);
      damage(bad);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    return bad;
  };
  auto tq = fresh(m);
  const auto parts = tq->parts();
  const auto flipped = damaged("flipped.ckpt", [](const std::string& f) {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(std::streamoff(std::filesystem::file_size(f) / 2));
    io.put('\x5a');
  });
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(flipped, m, parts), checkpoint_error, "checksum mismatch (corrupted)");
  const auto cut = damaged("cut.ckpt", [](const std::string& f) {
    std::filesystem::resize_file(f, std::filesystem::file_size(f) * 2 / 3);
  });
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(cut, m, parts), checkpoint_error, "(truncated)");
  const auto alien = damaged("alien.ckpt", [](const std::string& f) { std::ofstream(f, std::ios::binary) << "hello world"; });
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(alien, m, parts), checkpoint_error,
                             "gshard::checkpoint: " + alien + ": not a gshard checkpoint");
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(dir + "/missing.ckpt", m, parts), checkpoint_error,
                             "cannot open " + dir + "/missing.ckpt: No such file or directory");
  // A directory: read(2) fails on rank 0 alone; every rank throws (a caught error must not leave the others waiting).
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(dir, m, parts), checkpoint_error, "cannot read " + dir + ": Is a directory");
  // A header whose shape overflows (extent 2^62 - 1, bytes 2^64 - 4): refused, not read past the end.
  const auto forged = damaged("forged.ckpt", [](const std::string& f) {
    std::ofstream out(f, std::ios::binary | std::ios::trunc);
    auto put = [&](const auto& v) { out.write(reinterpret_cast<const char*>(&v), sizeof v); };
    out << "GSHARDCK";
    put(std::uint32_t(1));
    put(std::uint64_t(0));  // no metadata
    put(std::uint64_t(1));  // one record
    put(std::uint32_t(1));
    out << 'x';
    put(std::uint8_t(4));
    put(std::uint32_t(1));
    put(std::uint64_t(0x3FFFFFFFFFFFFFFFull));
    put(std::uint32_t(0));
    put(std::uint64_t(0xFFFFFFFFFFFFFFFCull));
    out << std::string(16, '\0');
  });
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(forged, m, parts), checkpoint_error, "record 'x' has a corrupted shape");
  {  // a model of another shape
    auto other = c;
    other.model = 16;
    trainer<float, grid2> to(m, other, 7);
    GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(path, m, to.parts()), checkpoint_error,
                               "record 'param.embed' holds 32-bit [256,8] but the program has 32-bit [256,16] (f32[V,M])");
  }
  {  // a model with more weights (shared experts) or fewer (without the router bias) than the file: named
    auto more = c;
    more.shared_experts = 1;
    trainer<float, grid2> tm(m, more, 7);
    GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(path, m, tm.parts()), checkpoint_error, "no record 'param.block1.shared_w1'");
    auto biased = c;
    biased.gating.balance = moe::balance_mode::bias;
    trainer<float, grid2> tb(m, biased, 7);
    const std::string with_bias = dir + "/bias.ckpt";
    save_checkpoint(with_bias, m, tb.parts(), {{"step", 0.0}});
    trainer<float, grid2> plain(m, c, 7);
    GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(with_bias, m, plain.parts()), checkpoint_error,
                               "record 'buffer.block1.router_bias' is not in the program (saved by another model configuration?)");
    load_checkpoint(with_bias, m, {{"param.", &plain.ps.values()}});  // the parameters alone: fine
  }
  {  // a save that fails while writing (the file size limit: EFBIG, as a full disk gives ENOSPC) leaves the
     // previous checkpoint intact and no temporary file behind, and says why on every rank
    auto t0 = fresh(m);
    {
      const file_size_limit small(world_rank() == 0 ? 4096 : 0);
      GSHARD_REQUIRE_THROWS_WITH(save_checkpoint(path, m, t0->parts(), {{"step", 4.0}}), checkpoint_error,
                                 "failed: File too large");
    }
    GSHARD_REQUIRE_THROWS_WITH(save_checkpoint(dir, m, t0->parts(), {{"step", 4.0}}), checkpoint_error, dir + " is a directory");
    auto t4 = fresh(m);
    GSHARD_REQUIRE(load_checkpoint(path, m, t4->parts()).at("step") == 2.0);
    int leftovers = 0;
    if (world_rank() == 0)
      for (const auto& e : std::filesystem::directory_iterator(dir)) leftovers += e.path().string().find(".tmp.") != std::string::npos;
    GSHARD_REQUIRE(leftovers == 0);
  }
  {  // metadata travels in full precision, NaN and infinities included (the trainer refuses a NaN step)
    auto t0 = fresh(m);
    const std::map<std::string, double> meta{{"step", 3.0}, {"lr", 1.0 / 3.0}, {"bad", std::nan("")}, {"big", -1e300}};
    save_checkpoint(path, m, t0->parts(), meta);
    auto back = load_checkpoint(path, m, t0->parts());
    GSHARD_REQUIRE(back.size() == 4 && back.at("step") == 3.0 && back.at("lr") == 1.0 / 3.0 && std::isnan(back.at("bad")) &&
                   back.at("big") == -1e300);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

namespace {
// Bytes a rank sends and receives in a ring implementation of each counted
// collective (the counters hold this rank's send size): all_reduce 2(p-1)/p,
// reduce_scatter (p-1)/p of its input, all_gather (p-1) of its block.
double wire_bytes(const collective_event& e, const detail::mesh_base& m) {
  index_t p = 1;
  for (int a = 0; a < m.naxes(); ++a)
    if (("," + e.axes + ",").find("," + std::string(m.axis_name(a)) + ",") != std::string::npos) p *= m.size(a);
  const double n = double(e.bytes), f = double(p - 1) / double(p);
  switch (e.kind) {
    case collective::all_reduce: return 2 * f * n;
    case collective::reduce_scatter: return f * n;
    case collective::all_gather: return double(p - 1) * n;
    default: return n;
  }
}
}  // namespace

TEST_CASE("a sharded weight update trains like the replicated one, with its bytes, a fraction of its memory, and its checkpoints",
          "[train][zero]") {
  const int P = world_size();
  const auto c = tiny();
  const auto tok = some_tokens(2 * P, 6);
  adam_config ac;
  ac.lr = 1e-2, ac.warmup_steps = 2, ac.weight_decay = 0.01;
  const shard_weight_update<default_roles::batch> sharded;
  const index_t d = P % 2 == 0 && P > 2 ? 2 : 1, e = P / d;
  grid2 m(MPI_COMM_WORLD, {d, e});
  grid2 self(MPI_COMM_SELF, {1, 1});
  // Whether some dim of the tiny model (M = 8, H = 12, V = 256) divides into
  // `ranks` equal blocks: at 5 and 7 ranks none does, and every update
  // stays replicated.
  const auto shards = [](index_t ranks) { return ranks > 1 && (8 % ranks == 0 || 12 % ranks == 0 || 256 % ranks == 0); };

  SECTION("double: the parameters of the 1-rank run within 1e-9 after 20 steps, on (data, expert) and (data, expert, model)") {
    auto compare = [&](const auto& mesh, const auto& mesh1, std::size_t bucket) {
      using Mesh = std::remove_cvref_t<decltype(mesh)>;
      trainer<double, Mesh> ref(mesh1, c, 3, ac), sh(mesh, c, 3, ac, sharded);
      sh.ps.set_bucket_bytes(bucket);
      if (shards(mesh.size(0) * mesh.size(1))) {  // a weight replicated over the batch axes has a block of it per rank
        std::size_t blocks = 0;
        for (auto& g : sh.ps.grads()) blocks += g->as_sharded() != nullptr;
        INFO(sh.ps.describe_update());
        GSHARD_REQUIRE(blocks > 0);
      }
      const auto l1 = ref.steps(tok, 0, 20), l2 = sh.steps(tok, 0, 20);
      double worst = 0, worst_loss = 0;
      for (std::size_t i = 0; i < ref.ps.size(); ++i) {
        const auto g1 = ref.ps.values()[i].gather_to_root(), g2 = sh.ps.values()[i].gather_to_root();
        const auto* a = reinterpret_cast<const double*>(g1.data());
        const auto* b = reinterpret_cast<const double*>(g2.data());
        for (std::size_t j = 0; j < g2.size() / sizeof(double); ++j)  // (g2 is empty but on rank 0)
          worst = std::max(worst, std::abs(a[j] - b[j]) / std::max(1e-3, std::abs(a[j])));
      }
      for (std::size_t i = 0; i < l1.size(); ++i) worst_loss = std::max(worst_loss, std::abs(l1[i] - l2[i]));
      INFO("worst relative parameter difference " << worst << ", worst loss difference " << worst_loss);
      GSHARD_REQUIRE(worst < 1e-9 && worst_loss < 1e-10 && l2.back() < l2.front());
    };
    // In one bucket at the backward's end (the default, for this small
    // model), and in buckets of 1 KiB that travel while the backward and the
    // update compute (reduce_scatters and all_gathers in flight, plans of
    // several steps on three axes).
    compare(m, self, default_bucket_bytes);
    compare(m, self, 1024);
    compare(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)), grid3(MPI_COMM_SELF, {1, 1, 1}), 1024);
  }

  SECTION("float: the losses of the replicated update to 4 decimals; its bytes on the wire; the moments' memory") {
    trainer<float, grid2> rep(m, c, 3, ac), sh(m, c, 3, ac, sharded);
    std::vector<double> l1, l2;
    double bytes_rep = 0, bytes_sh = 0;
    for (int step = 0; step < 8; ++step) {
      {
        collective_recorder rec;
        l1.push_back(model::train_step(rep.tr, rep.ps, rep.opt, rep.tokens(tok), std::uint64_t(step)).loss);
        for (const auto& ev : rec.events()) bytes_rep += wire_bytes(ev, m);
      }
      collective_recorder rec;
      l2.push_back(model::train_step(sh.tr, sh.ps, sh.opt, sh.tokens(tok), std::uint64_t(step)).loss);
      for (const auto& ev : rec.events()) bytes_sh += wire_bytes(ev, m);
    }
    double worst = 0;
    for (std::size_t i = 0; i < l1.size(); ++i) worst = std::max(worst, std::abs(l1[i] - l2[i]));
    INFO("worst loss difference " << worst << "; bytes on the wire per rank: replicated " << bytes_rep << ", sharded "
                                  << bytes_sh);
    GSHARD_REQUIRE(worst < 5e-5);
    GSHARD_REQUIRE(std::abs(bytes_sh - bytes_rep) <= 0.05 * bytes_rep);
    // Each sharded moment is the replicated one's local size over its block count.
    for (std::size_t i = 0; i < sh.ps.size(); ++i) {
      const std::size_t a = rep.opt.moment1()[i].f32().size(), b = sh.opt.moment1()[i].f32().size();
      const index_t parts = sh.opt.moment1()[i].replication() == rep.opt.moment1()[i].replication()
                                ? 1
                                : rep.opt.moment1()[i].replication() / sh.opt.moment1()[i].replication();
      INFO(sh.ps.name(i) << ": " << a << " vs " << b << " elements in " << parts << " blocks");
      GSHARD_REQUIRE(std::size_t(parts) * b == a);
      GSHARD_REQUIRE((parts > 1) == (sh.ps.grads()[i].as_sharded() != nullptr));
    }
    INFO("moments per rank: replicated " << rep.opt.moment1().local_bytes() << " B, sharded " << sh.opt.moment1().local_bytes() << " B");
    if (shards(P)) GSHARD_REQUIRE(sh.opt.moment1().local_bytes() < rep.opt.moment1().local_bytes());
    // The gradient of a sharded weight is only blocks: grad() says so;
    // gathered, every gradient is the replicated update's.
    if (P > 1 && (8 % P == 0 || 12 % P == 0)) {
      const auto& w = sh.tr.blocks()[0].ffn->w1;  // [M,H]: one of M, H divides by the batch ranks at 2, 3, 4, 6 and 8
      GSHARD_REQUIRE_THROWS_WITH(w.grad(), error, "gshard::param::grad: 'block0.w1' has its gradient only as this rank's block");
      const auto a = gather(w.gathered_grad()), b = gather(rep.tr.blocks()[0].ffn->w1.grad());
      float diff = 0;
      for (index_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a.data()[i] - b.data()[i]));
      GSHARD_REQUIRE(diff < 1e-6f);
    }
    float worst_grad = 0;
    for (std::size_t i = 0; i < sh.ps.size(); ++i) {
      const auto a = sh.ps.grads()[i].gather_to_root(), b = rep.ps.grads()[i].gather_to_root();
      GSHARD_REQUIRE(a.size() == b.size());
      for (std::size_t j = 0; j < a.size() / sizeof(float); ++j)
        worst_grad = std::max(worst_grad, std::abs(reinterpret_cast<const float*>(a.data())[j] -
                                                   reinterpret_cast<const float*>(b.data())[j]));
    }
    INFO("worst gradient difference " << worst_grad);
    GSHARD_REQUIRE(worst_grad < 1e-4f);
    // Misuse: an optimizer built for other parameters (its moments have other layouts); typed access to a block.
    adam other({}, rep.ps);
    GSHARD_REQUIRE_THROWS_WITH(other.update(sh.ps), error, "gshard::adam: these are not the parameters the optimizer was built for");
    if (P > 1 && 8 % P == 0) {  // block0.norm1 [M=8] divides: held as a block
      using norm_t = std::remove_cvref_t<decltype(sh.tr.blocks()[0].norm1.value())>;
      GSHARD_REQUIRE_THROWS_WITH(sh.ps.grads().at<norm_t>(sh.tr.blocks()[0].norm1.index()), error,
                                 "gshard::tensor_set::at: 'block0.norm1' is held in its weight's update layout");
    }
  }

  SECTION("the updated blocks' all_gathers travel until the model reads each weight: the same bits as finished at once") {
    const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_gathers_test_" + std::to_string(P))).string();
    if (world_rank() == 0) std::filesystem::create_directories(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    // One gather per weight, in buckets of 1 KiB, and all in one bucket.
    for (const std::size_t bucket : {std::size_t(0), std::size_t(1024), default_bucket_bytes}) {
      INFO("bucket bytes " << bucket);
      trainer<float, grid2> eager(m, c, 3, ac, sharded), late(m, c, 3, ac, sharded);
      eager.ps.set_bucket_bytes(bucket);
      late.ps.set_bucket_bytes(bucket);
      eager.ps.set_gather_bytes_in_flight(0);  // every gather finished in the update
      const auto parts = late.parts();         // made before the updates, saved after them
      for (int step = 0; step < 4; ++step) {
        const double a = model::train_step(eager.tr, eager.ps, eager.opt, eager.tokens(tok), std::uint64_t(step)).loss;
        GSHARD_REQUIRE(eager.ps.weights_in_flight() == 0);
        const double b = model::train_step(late.tr, late.ps, late.opt, late.tokens(tok), std::uint64_t(step)).loss;
        GSHARD_REQUIRE(a == b);
        // Where M = 8 divides over the batch axes (one, or two: the
        // gathers' last steps travel), w1 [M,H] is gathered in its first
        // dim's blocks, which buckets stack: its gather is among those in
        // flight when the update returns.
        const bool stacks = P > 1 && 8 % P == 0;
        const std::size_t before = late.ps.weights_in_flight();
        if (stacks) GSHARD_REQUIRE(before > 0);
        // A weight read holds its update, to the bit.
        const auto& held = late.tr.blocks()[0].ffn->w1.value();
        if (stacks) GSHARD_REQUIRE(late.ps.weights_in_flight() < before);
        const auto& want = eager.tr.blocks()[0].ffn->w1.value();
        GSHARD_REQUIRE(std::equal(held.data(), held.data() + held.local().size(), want.data()));
      }
      // Saved through parts made before: the checkpoint finishes the gathers first.
      save_checkpoint(dir + "/late.ckpt", m, parts, {});
      GSHARD_REQUIRE(late.ps.weights_in_flight() == 0);
      trainer<float, grid2> loaded(m, c, 4, ac, sharded);
      load_checkpoint(dir + "/late.ckpt", m, loaded.parts());
      // The values as a set: every weight the eager run's, and the loaded ones too.
      tensor_set& values = late.ps.values();
      for (std::size_t i = 0; i < values.size(); ++i) {
        INFO(values[i].name());
        const auto same = [](detail::set_entry& x, detail::set_entry& y) {
          return std::equal(x.f32().begin(), x.f32().end(), y.f32().begin(), y.f32().end());
        };
        GSHARD_REQUIRE(same(values[i], eager.ps.values()[i]));
        GSHARD_REQUIRE(same(values[i], loaded.ps.values()[i]));
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(dir);
  }

  SECTION("checkpoints: sharded at P ranks to replicated at 1, replicated at P to sharded at P") {
    const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_zero_test_" + std::to_string(P))).string();
    if (world_rank() == 0) std::filesystem::create_directories(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    trainer<double, grid2> straight(m, c, 5, ac);
    const auto want = straight.steps(tok, 0, 4);
    trainer<double, grid2> a(m, c, 5, ac, sharded);
    a.steps(tok, 0, 2);
    save_checkpoint(dir + "/sharded.ckpt", m, a.parts(), {{"step", 2.0}});
    trainer<double, grid2> b(self, c, 5, ac);  // each rank alone, replicated
    b.opt.step = int(load_checkpoint(dir + "/sharded.ckpt", self, b.parts()).at("step"));
    const auto lb = b.steps(tok, 2, 4);
    trainer<double, grid2> r(m, c, 5, ac);
    r.steps(tok, 0, 2);
    save_checkpoint(dir + "/replicated.ckpt", m, r.parts(), {{"step", 2.0}});
    trainer<double, grid2> s2(m, c, 5, ac, sharded);
    s2.opt.step = int(load_checkpoint(dir + "/replicated.ckpt", m, s2.parts()).at("step"));
    const auto ls = s2.steps(tok, 2, 4);
    double worst = 0;
    for (int i = 0; i < 2; ++i)
      worst = std::max({worst, std::abs(lb[std::size_t(i)] - want[std::size_t(2 + i)]),
                        std::abs(ls[std::size_t(i)] - want[std::size_t(2 + i)])});
    INFO("worst resumed loss difference " << worst);
    GSHARD_REQUIRE(worst < 1e-10);
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove_all(dir);
  }
}

TEST_CASE("every MPI communication call of a step, a checkpoint, a trace and a stop check is a counted collective",
          "[train][pmpi]") {
  const int P = world_size();
  auto c = tiny();
  c.overlap_degree = 2;  // the MoE layers' all_to_alls started and finished later (MPI_Ialltoall)
  const auto tok = some_tokens(2 * P, 6);
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_pmpi_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  barrier(world_group());
  grid2 m(MPI_COMM_WORLD, {1, P});  // binding a mesh creates communicators: before the watch
  trainer<float, grid2> run(m, c, 5, {}, shard_weight_update<default_roles::batch>{});  // the trainer's default
  run.ps.set_bucket_bytes(1024);  // buckets fill during the backward: started there, tested between its rules
  const auto tokens = run.tokens(tok);
  const preemption stop;
  collective_recorder rec;
  gshard::testing::pmpi::watch w;
  trace::start(dir + "/trace.json", m);
  model::train_step(run.tr, run.ps, run.opt, tokens, 0);
  const std::size_t events = trace::stop(m);
  save_checkpoint(dir + "/m.ckpt", m, run.parts(), {{"step", 1.0}});
  load_checkpoint(dir + "/m.ckpt", m, run.parts());
  const int sig = stop.requested(m);
  const std::string text = broadcast_text(world_group(), world_rank() == 0 ? "from the root" : "");
  std::string uncounted;
  for (const auto& fn : w.uncounted()) uncounted += fn + " ";
  std::string calls;
  for (const auto& [fn, n] : w.calls()) calls += fn + " x" + std::to_string(n) + " ";
  INFO("intercepted: " << calls << "; outside a counted collective: " << uncounted);
  // Each kind's MPI function ran exactly as often as the counters say it ran.
  GSHARD_REQUIRE(w.uncounted().empty() && !w.calls().empty() && events > 0 && sig == 0 && text == "from the root" &&
                 w.calls("MPI_Alltoall") + w.calls("MPI_Ialltoall") == int(rec.calls(collective::all_to_all)) &&
                 w.calls("MPI_Ialltoall") > 0 &&
                 w.calls("MPI_Allreduce") + w.calls("MPI_Iallreduce") == int(rec.calls(collective::all_reduce)) &&
                 w.calls("MPI_Barrier") == int(rec.calls(collective::barrier)) &&
                 w.calls("MPI_Allgather") + w.calls("MPI_Iallgather") == int(rec.calls(collective::all_gather)) &&
                 // the sharded update's gradients: gshard's ring reduce_scatter over "expert", P-1 exchanges each,
                 // the buckets' started (non-blocking, moved on by tests between the backward's rules)
                 w.calls("MPI_Sendrecv") + w.calls("MPI_Isend") == int(rec.calls(collective::reduce_scatter)) * (P - 1) &&
                 w.calls("MPI_Isend") == w.calls("MPI_Irecv") &&
                 (P == 1 || (rec.calls(collective::reduce_scatter) > 0 && w.calls("MPI_Isend") > 0 &&
                             w.calls("MPI_Iallgather") > 0 && w.calls("MPI_Test") + w.calls("MPI_Testall") > 0)) &&
                 w.calls("MPI_Comm_split") + w.calls("MPI_Comm_dup") == 0);
  barrier(world_group());
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("a stop signal on one rank is every rank's at the next agreement; a second ends the process", "[train][signals]") {
  const int P = world_size();
  grid2 m(MPI_COMM_WORLD, {1, P});
  stack_t before{};
  GSHARD_REQUIRE(sigaltstack(nullptr, &before) == 0);
  {
    const preemption stop;
    GSHARD_REQUIRE(stop.requested(m) == 0);
    if (world_rank() == P - 1) std::raise(SIGTERM);  // only the last rank receives it
    GSHARD_REQUIRE(stop.requested(m) == SIGTERM && stop.requested(m) == SIGTERM);
    GSHARD_REQUIRE_THROWS_WITH(preemption(), error, "gshard::preemption: one is already live in this process");
  }
  {  // a new one starts clear; SIGINT as well
    const preemption stop;
    GSHARD_REQUIRE(stop.requested(m) == 0);
    if (world_rank() == 0) std::raise(SIGINT);
    GSHARD_REQUIRE(stop.requested(m) == SIGINT);
  }
  // Outside a preemption the handlers are the previous ones again, and the
  // thread's signal stack the one it had (here the test framework's).
  struct sigaction now{};
  sigaction(SIGTERM, nullptr, &now);
  stack_t stack{};
  GSHARD_REQUIRE(sigaltstack(nullptr, &stack) == 0);
  GSHARD_REQUIRE(now.sa_handler != detail::on_stop_signal && stack.ss_flags == before.ss_flags && stack.ss_sp == before.ss_sp);
  {  // inside one, the handlers run on a signal stack of 64 KiB or more: gshard's, where the thread's was smaller
    const preemption stop;
    sigaction(SIGTERM, nullptr, &now);
    GSHARD_REQUIRE(sigaltstack(nullptr, &stack) == 0);
    GSHARD_REQUIRE((now.sa_flags & SA_ONSTACK) && !(stack.ss_flags & SS_DISABLE) && stack.ss_size >= 65536 &&
                   (stack.ss_sp == before.ss_sp) == (!(before.ss_flags & SS_DISABLE) && before.ss_size >= 65536));
  }
  {  // a thread with no signal stack has gshard's while one lives, and none after
    stack_t off{}, framework{};
    off.ss_flags = SS_DISABLE;
    GSHARD_REQUIRE(sigaltstack(&off, &framework) == 0);
    bool inside = false;
    {
      const preemption stop;
      inside = sigaltstack(nullptr, &stack) == 0 && !(stack.ss_flags & SS_DISABLE) && stack.ss_size >= 65536;
    }
    const bool after = sigaltstack(nullptr, &stack) == 0 && (stack.ss_flags & SS_DISABLE);
    GSHARD_REQUIRE(sigaltstack(&framework, nullptr) == 0);
    GSHARD_REQUIRE(inside && after);
  }
}

// oneDNN 2.x's JIT GEMM kernels ("gemm:jit": every fp32 matmul on a CPU with
// AVX2 alone; this test runs with DNNL_MAX_CPU_ISA=AVX2) point the stack
// pointer into a heap buffer while they run. A signal handled then on the
// interrupted code's stack would write its frame over whatever the heap
// holds there. Stop signals arrive here at random moments of a stream of
// GEMMs, each one noted and the preemption made again (a second would end
// the process); the products stay right and the allocations around them
// whole. The thread starts with no signal stack, as a program's does.
// Hidden ([.]): DNNL_MAX_CPU_ISA must be set before oneDNN's first call, so
// its own meson test runs it alone ("stop signals during GEMMs np=1"), with
// DNNL_MAX_CPU_ISA=AVX2; the other train tests run at the CPU's own ISA.
TEST_CASE("stop signals during GEMMs leave the results and the heap whole", "[.][signals_in_gemm]") {
  const index_t m = 128, n = 128, k = 2048;  // a long sum: the kernel's stack pointer is off the stack most of the time
#if defined(GSHARD_USE_ONEDNN)
  if (const char* isa = std::getenv("DNNL_MAX_CPU_ISA"); isa && std::string(isa) == "AVX2") {
    using dims = dnnl::memory::dims;
    const auto f32 = dnnl::memory::data_type::f32;
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc({dims{m, k}, f32, dims{k, 1}}, {dims{k, n}, f32, dims{n, 1}},
                                                             {dims{m, n}, f32, dims{n, 1}}),
                                          engine);
    INFO("oneDNN's implementation: " << pd.impl_info_str());
    // the kernels in question, through gemm()
    GSHARD_REQUIRE(std::string(pd.impl_info_str()).rfind("gemm:jit", 0) == 0);
    GSHARD_REQUIRE(detail::options().gemm == int(detail::gemm_kind::onednn));
  }
#endif
  stack_t off{}, framework{};
  off.ss_flags = SS_DISABLE;
  GSHARD_REQUIRE(sigaltstack(&off, &framework) == 0);
  const std::vector<float> a(std::size_t(m * k), 1.0f), b(std::size_t(k * n), 0.5f);
  std::vector<float> c(std::size_t(m * n));
  std::optional<preemption> stop(std::in_place);
  const pthread_t worker = pthread_self();
  constexpr int signals = 300;
  std::atomic<int> seen{0};
  std::thread sender([&] {
    std::mt19937 rng(7);
    for (int i = 1; i <= signals; ++i) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
      pthread_kill(worker, SIGTERM);
      while (seen.load() < i) std::this_thread::yield();  // the next one once this one's preemption is made again
    }
  });
  std::vector<std::unique_ptr<std::string>> live;  // allocations made between the GEMMs, checked in batches
  int wrong = 0, damaged = 0, gemms = 0;
  while (seen.load() < signals) {
    detail::gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
    ++gemms;
    wrong += c.front() != 0.5f * float(k) || c.back() != 0.5f * float(k);
    live.push_back(std::make_unique<std::string>(std::size_t(32 + gemms % 480), 'x'));
    if (live.size() == 64) {
      for (const auto& s : live) damaged += s->find_first_not_of('x') != std::string::npos;
      live.clear();
    }
    if (preemption::received()) stop.reset(), stop.emplace(), seen.store(seen.load() + 1);
  }
  stop.reset();
  sender.join();
  GSHARD_REQUIRE(sigaltstack(&framework, nullptr) == 0);
  INFO(gemms << " GEMMs, " << signals << " signals");
  GSHARD_REQUIRE(wrong == 0);
  GSHARD_REQUIRE(damaged == 0);
}

TEST_CASE("a trace that cannot be written is an error on every rank, and leaves no file", "[train][trace]") {
  const int P = world_size();
  grid2 m(MPI_COMM_WORLD, {1, P});
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_trace_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  barrier(world_group());
  trace::start(dir, m);  // a directory
  GSHARD_REQUIRE_THROWS_WITH(trace::stop(m), io_error, "gshard::trace: " + dir + " is a directory");
  const std::string path = dir + "/cut.json";
  trace::start(path, m);
  for (int i = 0; i < 200; ++i) trace::add("a span with a long name " + std::to_string(i), "user", 0, 1);
  {
    const file_size_limit small(world_rank() == 0 ? 1024 : 0);
    GSHARD_REQUIRE_THROWS_WITH(trace::stop(m), io_error, "failed: File too large");
  }
  GSHARD_REQUIRE(world_rank() != 0 || std::filesystem::is_empty(dir));
  barrier(world_group());
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}
