// Adafactor: every weight shape the models have (a vector, matrices split
// over "model" along either dim, an expert stack split over "expert" and
// "model", a replicated table) against a double reference of its formulas
// written here on the global tensors, at every mesh, with the replicated and
// the sharded weight update; the collectives of one update, exactly; its
// state through a checkpoint to another rank count; misuse. And the masters
// Adam and Adafactor keep for bf16 weights, on the same zoo.
#include <gshard/gshard.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "testing.hpp"

using namespace gshard;
using gshard::testing::data_expert_model_sizes;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using grid3 = mesh<axis<"data">, axis<"expert">, axis<"model">>;

constexpr index_t M = 6, H = 8, E = 6, V = 10;  // E divides by the expert axis at 1, 2, 3, 4 and 8 ranks

// The zoo's extents: the ones above, or (odd) extents that split into
// unequal shards: 5 experts over 2, 3 or 4 ranks, and H = 1 over "model" at
// 2, 4 and 8 (one rank's block empty: its factors' all_reduces still run).
// M = 4 still divides, so the sharded update cuts unequal weights.
struct zoo_sizes {
  index_t m = M, h = H, e = E, v = V;
};
constexpr zoo_sizes even_sizes{}, odd_sizes{4, 1, 5, 3};

// The shapes and shardings of the models' weights.
template <class Mesh, class T = double>
struct weight_zoo {
  parameters<Mesh> ps;
  param<tensor<T, 1, Mesh, replicate>> norm;                                       // [M]
  param<tensor<T, 2, Mesh, sharding<split<1, "model">>>> w_in;                     // [M, H{model}]
  param<tensor<T, 2, Mesh, sharding<split<0, "model">>>> w_out;                    // [H{model}, M]
  param<tensor<T, 3, Mesh, sharding<split<0, "expert">, split<2, "model">>>> experts;  // [E{expert}, M, H{model}]
  param<tensor<T, 2, Mesh, replicate>> table;                                      // [V, M]
  template <class... How>
  weight_zoo(const Mesh& m, const zoo_sizes& z, How... how)
      : ps(m, 11, how...),
        norm(ps, "norm", {z.m}, init::ones()),
        w_in(ps, "w_in", {z.m, z.h}, init::normal(0.5)),
        w_out(ps, "w_out", {z.h, z.m}, init::normal(0.5)),
        experts(ps, "experts", {z.e, z.m, z.h}, init::normal(0.5)),
        table(ps, "table", {z.v, z.m}, init::normal(1.0)) {}
  template <class... How>
  weight_zoo(const Mesh& m, How... how) : weight_zoo(m, even_sizes, how...) {}
};

// The gradient of weight i at `step`, element k of the global tensor: a
// different scale per row and column, so the factors differ from the mean.
double grad_at(std::size_t i, int step, std::size_t k, std::size_t cols) {
  const double row = double(k / cols), col = double(k % cols);
  return std::sin(0.7 * double(k) + 1.3 * double(i) + 0.9 * step) * (1 + 0.3 * row) * (1 + 0.2 * col) * (i == 4 ? 1e-3 : 1.0);
}
void set_grads(parameters_base& ps, int step) {
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto ext = ps.grads()[i].extents();
    std::size_t n = 1;
    for (index_t e : ext) n *= std::size_t(e);
    std::vector<double> g(n);
    std::vector<float> f(n);
    for (std::size_t k = 0; k < n; ++k) f[k] = float(g[k] = grad_at(i, step, k, std::size_t(ext.back())));
    ps.grads()[i].scatter_from_root(ps.grads()[i].element_bytes() == 8 ? reinterpret_cast<const char*>(g.data())
                                                                       : reinterpret_cast<const char*>(f.data()));
  }
}

// Adafactor's formulas on one global weight, in double.
struct reference {
  std::vector<index_t> ext;
  std::vector<double> w, r, c, v, m;

  void step(const std::vector<double>& g0, const adafactor_config& cfg, int t, double clip) {
    const double beta = cfg.decay_power > 0 ? std::min(cfg.beta2, 1 - std::pow(t + 1.0, -cfg.decay_power)) : cfg.beta2;
    const double lr = cfg.relative_step ? std::min(1e-2, 1 / std::sqrt(t + 1.0))
                                        : detail::warmup_cosine(cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio, t);
    const std::size_t n = w.size();
    std::vector<double> g(n), u(n);
    for (std::size_t k = 0; k < n; ++k) g[k] = clip * g0[k];
    if (ext.size() == 1) {
      v.resize(n, 0.0);
      for (std::size_t k = 0; k < n; ++k) {
        v[k] = beta * v[k] + (1 - beta) * (g[k] * g[k] + cfg.eps1);
        u[k] = g[k] / std::sqrt(v[k]);
      }
    } else {
      const std::size_t C = std::size_t(ext.back()), R = std::size_t(ext[ext.size() - 2]), lead = n / (R * C);
      r.resize(lead * R, 0.0), c.resize(lead * C, 0.0);
      for (std::size_t l = 0; l < lead; ++l) {
        for (std::size_t i = 0; i < R; ++i) {
          double s = 0;
          for (std::size_t j = 0; j < C; ++j) s += g[(l * R + i) * C + j] * g[(l * R + i) * C + j] + cfg.eps1;
          r[l * R + i] = beta * r[l * R + i] + (1 - beta) * s / double(C);
        }
        for (std::size_t j = 0; j < C; ++j) {
          double s = 0;
          for (std::size_t i = 0; i < R; ++i) s += g[(l * R + i) * C + j] * g[(l * R + i) * C + j] + cfg.eps1;
          c[l * C + j] = beta * c[l * C + j] + (1 - beta) * s / double(R);
        }
        double mean_r = 0;
        for (std::size_t i = 0; i < R; ++i) mean_r += r[l * R + i] / double(R);
        for (std::size_t i = 0; i < R; ++i)
          for (std::size_t j = 0; j < C; ++j)
            u[(l * R + i) * C + j] = g[(l * R + i) * C + j] / std::sqrt(r[l * R + i] * c[l * C + j] / mean_r);
      }
    }
    double uu = 0, ww = 0;
    for (std::size_t k = 0; k < n; ++k) uu += u[k] * u[k], ww += w[k] * w[k];
    const double shrink = cfg.clip_threshold > 0 ? std::max(1.0, std::sqrt(uu / double(n)) / cfg.clip_threshold) : 1.0;
    const double rate = lr * (cfg.scale_parameter ? std::max(cfg.eps2, std::sqrt(ww / double(n))) : 1.0);
    if (cfg.beta1 > 0) m.resize(n, 0.0);
    for (std::size_t k = 0; k < n; ++k) {
      double up = u[k] / shrink;
      if (cfg.beta1 > 0) up = m[k] = cfg.beta1 * m[k] + (1 - cfg.beta1) * up;
      w[k] -= rate * (up + cfg.weight_decay * w[k]);
    }
  }
};

std::vector<double> global_values(detail::set_entry& e) {  // on rank 0; empty elsewhere
  const auto bytes = e.gather_to_root();
  std::vector<double> v(bytes.size() / std::size_t(e.element_bytes()));
  if (e.element_bytes() == 8) std::memcpy(v.data(), bytes.data(), bytes.size());
  else
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = double(reinterpret_cast<const float*>(bytes.data())[k]);
  return v;
}

// The worst relative difference between the weights of `a` and `b`, where
// `b` gathers them (its mesh's rank 0); 0 elsewhere.
double worst_difference(parameters_base& a, parameters_base& b) {
  double worst = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    const auto x = global_values(a.values()[i]), y = global_values(b.values()[i]);
    for (std::size_t k = 0; k < y.size(); ++k) worst = std::max(worst, std::abs(x[k] - y[k]) / std::max(1e-3, std::abs(x[k])));
  }
  return worst;
}

// `steps` updates of the zoo in T at `m` against the reference in double
// from the same initial weights and the gradients rounded to T; the worst
// relative difference (on rank 0).
template <class T = double, class... How>
double against_reference(const grid3& m, const zoo_sizes& sizes, const adafactor_config& cfg, int steps, How... how) {
  weight_zoo<grid3, T> z(m, sizes, how...);
  // Buckets of 64 B: cut after nearly every weight, so a rank that cut
  // elsewhere than its group would be seen (it would hang).
  if (sizes.e != E) z.ps.set_bucket_bytes(64);
  adafactor opt(cfg, z.ps);
  std::vector<reference> ref(z.ps.size());
  for (std::size_t i = 0; i < z.ps.size(); ++i) ref[i] = {z.ps.values()[i].extents(), global_values(z.ps.values()[i]), {}, {}, {}, {}};
  for (int t = 0; t < steps; ++t) {
    set_grads(z.ps, t);
    opt.update(z.ps);
    if (world_rank() != 0) continue;
    double sq = 0;
    std::vector<std::vector<double>> g(ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      g[i].resize(ref[i].w.size());
      for (std::size_t k = 0; k < g[i].size(); ++k)
        sq += std::pow(g[i][k] = double(T(grad_at(i, t, k, std::size_t(ref[i].ext.back())))), 2);
    }
    const double norm = std::sqrt(sq), clip = cfg.clip_norm > 0 && norm > cfg.clip_norm ? cfg.clip_norm / (norm + 1e-12) : 1.0;
    for (std::size_t i = 0; i < ref.size(); ++i) ref[i].step(g[i], cfg, t, clip);
  }
  double worst = 0;
  for (std::size_t i = 0; i < z.ps.size(); ++i) {
    const auto w = global_values(z.ps.values()[i]);
    for (std::size_t k = 0; k < w.size(); ++k)
      worst = std::max(worst, std::abs(w[k] - ref[i].w[k]) / std::max(1e-3, std::abs(ref[i].w[k])));
  }
  return worst;
}

// A zoo's checkpoint: the optimizer's state and the weights.
template <class Zoo>
std::vector<checkpoint_part> parts(Zoo& z, optimizer& o) {
  auto p = o.state_parts();
  p.push_back({"param.", &z.ps.values()});
  return p;
}

}  // namespace

TEST_CASE("Adafactor equals a double reference of its formulas on every weight shape, at every mesh and update sharding",
          "[train][adafactor]") {
  const int P = world_size();
  grid3 m(MPI_COMM_WORLD, data_expert_model_sizes(P));
  adafactor_config gshard_setting;  // β1 0, β̂ = min(0.99, 1 − t^−0.8), update clipping at 1
  gshard_setting.lr = 0.05, gshard_setting.warmup_steps = 2, gshard_setting.total_steps = 6;
  adafactor_config everything = gshard_setting;
  everything.beta1 = 0.9, everything.decay_power = 0, everything.beta2 = 0.95, everything.scale_parameter = true;
  everything.weight_decay = 0.1, everything.clip_norm = 2.0, everything.clip_threshold = 0.5;
  adafactor_config relative = gshard_setting;
  relative.relative_step = true;
  const shard_weight_update<default_roles::batch> sharded;
  for (const zoo_sizes& sizes : {even_sizes, odd_sizes})
  for (const auto& [what, cfg] : {std::pair{"GShard's setting", gshard_setting}, std::pair{"first moment, fixed decay, parameter "
                                  "scale, weight decay, both clippings", everything}, std::pair{"relative step", relative}}) {
    const double replicated = against_reference(m, sizes, cfg, 5), in_blocks = against_reference(m, sizes, cfg, 5, sharded);
    INFO((sizes.e == E ? "" : "extents that do not divide, ") << m.describe() << ", " << what
                                                              << ": worst relative difference, replicated update " << replicated
                      << ", sharded update " << in_blocks);
    GSHARD_REQUIRE(replicated < 1e-11);
    GSHARD_REQUIRE(in_blocks < 1e-11);
    // In float (the trainers'): the factors in double, the vectors' second
    // moment and the update in float.
    const double f32 = against_reference<float>(m, sizes, cfg, 5), f32_blocks = against_reference<float>(m, sizes, cfg, 5, sharded);
    INFO("in float: replicated update " << f32 << ", sharded update " << f32_blocks);
    GSHARD_REQUIRE(f32 < 2e-5);
    GSHARD_REQUIRE(f32_blocks < 2e-5);
  }
}

TEST_CASE("Adafactor's update reduces a factor over an axis only where its mean runs along a dim that axis splits",
          "[train][adafactor][collectives]") {
  const int P = world_size();
  const auto sizes = data_expert_model_sizes(P);
  grid3 m(MPI_COMM_WORLD, sizes);
  weight_zoo<grid3> z(m);
  adafactor opt({}, z.ps);
  set_grads(z.ps, 0);
  collective_recorder rec;
  opt.update(z.ps);
  std::map<std::string, std::pair<int, std::size_t>> seen, want;  // calls and bytes per kind(axes)
  for (const auto& e : rec.events()) {
    auto& s = seen[std::string(name_of(e.kind)) + "(" + e.axes + ")"];
    ++s.first, s.second += e.bytes;
  }
  // The global gradient norm, and two numbers per weight (Σ U², Σ W²), over every axis.
  want["all_reduce(data,expert,model)"] = {2, 8 + 2 * 8 * z.ps.size()};
  if (sizes[2] > 1) {
    // w_in [M, H{model}]: its row factor sums over H; w_out [H{model}, M]:
    // its column factor sums over H, with Σ R; the experts [E{expert}, M,
    // H{model}]: their row factors sum over H — one per local expert.
    const std::size_t e = std::size_t(E / sizes[1]);
    want["all_reduce(model)"] = {3, 8 * (M + (std::size_t(M) + 1) + e * M)};
  }
  const auto text = [](const auto& s) {
    std::string t;
    for (const auto& [k, v] : s) t += k + " x" + std::to_string(v.first) + " " + std::to_string(v.second) + " B; ";
    return t;
  };
  INFO(m.describe() << "\nran: " << text(seen) << "\nwant: " << text(want));
  GSHARD_REQUIRE(seen == want);
}

TEST_CASE("Adafactor's state saved at P ranks resumes at 1 rank and back, on the same curve", "[train][adafactor][checkpoint]") {
  const int P = world_size();
  grid3 m(MPI_COMM_WORLD, data_expert_model_sizes(P)), self(MPI_COMM_SELF, {1, 1, 1});
  adafactor_config cfg;
  cfg.lr = 0.05, cfg.beta1 = 0.5, cfg.warmup_steps = 1;
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_adafactor_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  // With the zoo's extents, and with extents that split into unequal shards
  // (saved from unequal blocks, loaded into whole ones and back).
  for (const zoo_sizes& sizes : {odd_sizes, even_sizes}) {
    INFO((sizes.e == E ? "the zoo's extents" : "extents that do not divide"));
    weight_zoo<grid3> straight(self, sizes);
    adafactor so(cfg, straight.ps);
    // Steps [from, to) of the straight run and of `z`; then their worst difference.
    const auto go_on = [&](weight_zoo<grid3>& z, adafactor& o, int from, int to) {
      for (int t = from; t < to; ++t) {
        set_grads(straight.ps, t), so.update(straight.ps);
        set_grads(z.ps, t), o.update(z.ps);
      }
      return worst_difference(straight.ps, z.ps);
    };
    weight_zoo<grid3> a(m, sizes, shard_weight_update<default_roles::batch>{});
    adafactor ao(cfg, a.ps);
    go_on(a, ao, 0, 2);
    save_checkpoint(dir + "/a.ckpt", m, parts(a, ao), {{"step", 2.0}});
    weight_zoo<grid3> b(self, sizes);
    adafactor bo(cfg, b.ps);
    bo.step = int(load_checkpoint(dir + "/a.ckpt", self, parts(b, bo)).at("step"));
    const double worst = go_on(b, bo, 2, 4);
    INFO("worst relative weight difference after resuming at 1 rank: " << worst);
    GSHARD_REQUIRE(worst < 1e-11);
    // And back: saved by a 1-rank run (each rank its own file), loaded at P ranks.
    const std::string mine = dir + "/b" + std::to_string(world_rank()) + ".ckpt";
    save_checkpoint(mine, self, parts(b, bo), {{"step", 4.0}});
    weight_zoo<grid3> c(m, sizes, shard_weight_update<default_roles::batch>{});
    adafactor co(cfg, c.ps);
    co.step = int(load_checkpoint(dir + "/b0.ckpt", m, parts(c, co)).at("step"));
    const double back = go_on(c, co, 4, 6);
    INFO("worst relative weight difference after resuming at " << P << " ranks: " << back);
    GSHARD_REQUIRE(back < 1e-11);
  }
  // An Adam checkpoint has no Adafactor state: the record it lacks is named.
  weight_zoo<grid3> b(self);
  adafactor bo(cfg, b.ps);
  const std::string mine = dir + "/b" + std::to_string(world_rank()) + ".ckpt";
  adam other({}, b.ps);
  save_checkpoint(mine, self, {{"param.", &b.ps.values()}, {"adam.m.", &other.moment1()}});
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(mine, self, parts(b, bo)), checkpoint_error, "no record 'adafactor.v_row.norm'");
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("bf16 weights: the optimizers' masters are the fp32 weights of the same updates, at every rank count, update "
          "sharding and through checkpoints; the weights are their rounding, gathered in half the bytes",
          "[train][adafactor][bf16]") {
  // The gradients are set, not computed, so the fp32 weights of a run with
  // weight_wire same and the masters of one with weight_wire bf16 take the
  // same arithmetic: equal to the bit on one mesh. Adam's update is element
  // by element, so without clipping it is also bit-identical at 1 rank and
  // at P; Adafactor's factors and RMS are sums over ranks, in other orders.
  const int P = world_size();
  grid3 m(MPI_COMM_WORLD, data_expert_model_sizes(P)), self(MPI_COMM_SELF, {1, 1, 1});
  const shard_weight_update<default_roles::batch> sharded;
  adam_config ac;
  ac.lr = 0.05, ac.warmup_steps = 2, ac.total_steps = 6, ac.weight_decay = 0.1, ac.clip_norm = 0;
  adafactor_config fc;
  fc.lr = 0.05, fc.warmup_steps = 2, fc.total_steps = 6, fc.beta1 = 0.5, fc.scale_parameter = true;
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_masters_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  using zoo = weight_zoo<grid3, float>;
  const auto run = [&]<class Opt>(const typename Opt::config_type& cfg, const zoo_sizes& sizes, bool in_blocks) {
    constexpr bool elementwise = std::is_same_v<Opt, adam>;
    INFO((elementwise ? "adam" : "adafactor") << (sizes.e == E ? "" : ", extents that do not divide")
                                              << (in_blocks ? ", sharded update" : ", replicated update"));
    const auto make = [&](const grid3& g, wire w) {
      auto z = in_blocks ? std::make_unique<zoo>(g, sizes, sharded) : std::make_unique<zoo>(g, sizes);
      if (sizes.e != E) z->ps.set_bucket_bytes(64);
      z->ps.set_weight_wire(w);
      return z;
    };
    auto f32 = make(m, wire::same), b16 = make(m, wire::bf16), one = make(self, wire::bf16);
    Opt o32(cfg, f32->ps), o16(cfg, b16->ps), o1(cfg, one->ps);
    // The masters' bytes are the optimizer's: a whole shard for each weight
    // updated as itself (a sharded update's blocks were there already).
    std::size_t extra = 0;
    bool gathers = false;  // some weight is updated in blocks over more than one rank: its update is all_gathered
    for (std::size_t i = 0; i < b16->ps.size(); ++i) {
      if (!b16->ps.grads()[i].as_sharded()) extra += b16->ps.values()[i].local_bytes();
      else gathers = gathers || m.size(0) * m.size(1) > 1;
    }
    GSHARD_REQUIRE(o16.state_bytes() == o32.state_bytes() + extra);
    std::size_t gathered32 = 0, gathered16 = 0;
    const auto steps = [&](std::vector<std::pair<zoo*, Opt*>> runs, int from, int to) {
      for (int t = from; t < to; ++t) {
        if (t == 3)  // the program writes one element of a replicated vector, and of a table a sharded update holds in blocks
          for (auto [z, o] : runs)
            for (const char* name : {"norm", "table"}) z->ps.values().find(name)->f32()[0] = 0.75f + 0x1p-12f;
        for (auto [z, o] : runs) {
          set_grads(z->ps, t);
          collective_recorder rec;
          o->update(z->ps);
          for (const auto& e : rec.events())
            if (e.kind == collective::all_gather) (z == f32.get() ? gathered32 : gathered16) += e.bytes;
        }
      }
    };
    steps({{f32.get(), &o32}, {b16.get(), &o16}, {one.get(), &o1}}, 0, 6);
    INFO("bytes all_gathered: " << gathered32 << " in fp32, " << gathered16 << " in bf16");
    GSHARD_REQUIRE(2 * gathered16 == gathered32);
    GSHARD_REQUIRE(gathers == (gathered16 > 0));
    const index_t batch_ranks = m.size(0) * m.size(1);
    if (in_blocks && batch_ranks > 1 && sizes.m % batch_ranks == 0) GSHARD_REQUIRE(gathers);  // the norm [M] at least
    // Each run's weights are its masters rounded, and its masters the fp32
    // run's weights: to the bit where the arithmetic is the same.
    bool finer = false;  // some master holds what its bf16 weight cannot
    const auto check = [&](zoo& z, Opt& o, bool same_arithmetic, const char* what) {
      for (std::size_t i = 0; i < z.ps.size(); ++i) {
        const auto want = global_values(f32->ps.values()[i]), w = global_values(z.ps.values()[i]);
        const auto master = global_values(*o.masters().find(z.ps.name(i)));
        bool rounding = world_rank() != 0 || (w.size() == want.size() && master.size() == want.size());
        double worst = 0;
        for (std::size_t k = 0; rounding && k < want.size(); ++k) {  // rank 0 holds the global tensors
          rounding = w[k] == double(float(bf16(float(master[k]))));
          finer = finer || w[k] != master[k];
          worst = std::max(worst, std::abs(master[k] - want[k]) / std::max(1e-3, std::abs(want[k])));
        }
        INFO(what << ": " << z.ps.name(i) << ": worst relative difference from the fp32 run's weights " << worst);
        GSHARD_REQUIRE(rounding);
        GSHARD_REQUIRE(worst <= (same_arithmetic ? 0.0 : 1e-5));
      }
    };
    check(*b16, o16, true, "bf16 weights");
    check(*one, o1, elementwise, "bf16 weights at 1 rank");
    GSHARD_REQUIRE((finer || world_rank() != 0));
    // Through a checkpoint: saved at P ranks, resumed with the masters at 1
    // rank and at P (into blocks); an fp32 run's checkpoint (no masters)
    // resumed with bf16 weights, whose masters then take the weights loaded.
    save_checkpoint(dir + "/bf16.ckpt", m, parts(*b16, o16), {{"step", 6.0}});
    save_checkpoint(dir + "/f32.ckpt", m, parts(*f32, o32), {{"step", 6.0}});
    auto from16 = make(self, wire::bf16), from32 = make(self, wire::bf16), here = make(m, wire::bf16);
    Opt r16(cfg, from16->ps), r32(cfg, from32->ps), rm(cfg, here->ps);
    r16.step = int(load_checkpoint(dir + "/bf16.ckpt", self, parts(*from16, r16)).at("step"));
    r32.step = int(load_checkpoint(dir + "/f32.ckpt", self, parts(*from32, r32)).at("step"));
    rm.step = int(load_checkpoint(dir + "/bf16.ckpt", m, parts(*here, rm)).at("step"));
    MPI_Barrier(MPI_COMM_WORLD);  // every rank has read the files before the next run writes them
    steps({{f32.get(), &o32}, {from16.get(), &r16}, {from32.get(), &r32}, {here.get(), &rm}}, 6, 8);
    check(*from16, r16, elementwise, "resumed with masters at 1 rank");
    check(*from32, r32, elementwise, "an fp32 run resumed with bf16 weights at 1 rank");
    check(*here, rm, true, "resumed with masters at P ranks");
  };
  for (const zoo_sizes& sizes : {even_sizes, odd_sizes})
    for (bool in_blocks : {false, true}) {
      run.operator()<adam>(ac, sizes, in_blocks);
      run.operator()<adafactor>(fc, sizes, in_blocks);
    }
  // The weight wire is the optimizer's state: changing it after is refused.
  zoo z(self);
  adam o({}, z.ps);
  z.ps.set_weight_wire(wire::bf16);
  set_grads(z.ps, 0);
  GSHARD_REQUIRE_THROWS_WITH(o.update(z.ps), error,
                             "gshard::adam: the parameters' weight wire is wire::bf16 but the optimizer was built when it was "
                             "wire::same (the masters are its state); set it before building the optimizer");
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Adafactor refuses bad settings and parameters it was not built for, naming them", "[train][adafactor][errors]") {
  grid3 self(MPI_COMM_SELF, {1, 1, 1});
  weight_zoo<grid3> z(self), other(self);
  const auto refused = [&](auto set, const std::string& text) {
    adafactor_config c;
    set(c);
    GSHARD_REQUIRE_THROWS_WITH(adafactor(c, z.ps), error, text);
  };
  refused([](auto& c) { c.beta1 = 1; }, "gshard::adafactor: beta1 is 1; it must be in [0, 1)");
  refused([](auto& c) { c.beta2 = 0; }, "gshard::adafactor: beta2 is 0; it must be in (0, 1)");
  refused([](auto& c) { c.decay_power = -0.8; }, "gshard::adafactor: decay_power is -0.8; it must be in [0, 1]");
  refused([](auto& c) { c.eps1 = 0; }, "gshard::adafactor: eps1 is 0; it must be positive and finite");
  refused([](auto& c) { c.clip_threshold = std::nan(""); }, "gshard::adafactor: clip_threshold is nan");
  refused([](auto& c) { c.lr = -1e-9; }, "gshard::adafactor: lr is -1e-09; it must be positive and finite");
  adafactor opt({}, z.ps);
  GSHARD_REQUIRE_THROWS_WITH(opt.update(other.ps), error,
                             "gshard::adafactor: these are not the parameters the optimizer was built for");
  opt.cfg.beta1 = 0.9;  // no first moments were made
  GSHARD_REQUIRE_THROWS_WITH(opt.update(z.ps), error, "gshard::adafactor: beta1 is 0.9 but the optimizer was built with beta1 0");
  // Its state: two factors of a matrix, one per expert of a stack, a full moment of a vector.
  GSHARD_REQUIRE(opt.second_moment_rows().size() == 5);
  GSHARD_REQUIRE(opt.second_moment_cols().size() == 4);
  GSHARD_REQUIRE(opt.second_moment_rows().find("experts")->extents() == std::vector<index_t>{E, M});
  GSHARD_REQUIRE(opt.second_moment_cols().find("experts")->extents() == std::vector<index_t>{E, H});
  GSHARD_REQUIRE(opt.state_bytes() == 8 * std::size_t(M + (M + H) * 2 + E * (M + H) + V + M));
}
