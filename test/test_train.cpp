// Training: analytic gradients against central finite differences in double
// (each operation, then the whole model), the exact collectives of one
// training step, determinism across rank counts and reruns, and checkpoints
// (resume, resume at another rank count, refusal of damaged files).
#include <gshard/gshard.hpp>
#include <gshard/model/train.hpp>

#include <filesystem>
#include <fstream>
#include <map>

#include "layouts.hpp"
#include "testing.hpp"

using namespace gshard;
using gshard::testing::random_tensor;
using gshard::testing::world_rank;
using gshard::testing::world_size;

namespace {

using grid1 = mesh<axis<"x">>;
using grid2 = mesh<axis<"data">, axis<"expert">>;
using grid3 = mesh<axis<"data">, axis<"expert">, axis<"model">>;  // heads and dense FFNs split over "model"
using gshard::testing::data_expert_model_sizes;

double sum_all(double local) {
  double s = 0;
  MPI_Allreduce(&local, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return s;
}
// Σ z·r over this rank's shard, summed over the ranks that hold distinct shards.
template <class X>
double dot(const X& z, const X& r) {
  double s = 0;
  for (index_t i = 0; i < z.local().size(); ++i) s += double(z.data()[i]) * double(r.data()[i]);
  return sum_all(s / double(replication(z)));
}

// Central differences of f() against the analytic gradient g of tensor t, at
// `probes` elements of each shard. A probe moves one global element: on every
// rank that holds a copy of it (a shard is replicated over the axes that
// split nothing), and one shard at a time. Returns the worst error relative
// to max(|fd| + |analytic|, 1e-4) — below that scale central differences in
// double are round-off. The same on every rank.
template <class X, class F>
double fd_check(X& t, const X& g, F&& f, int probes = 3, double eps = 1e-5) {
  const auto& m = t.mesh();
  auto holds_shard_of = [&](int q) {  // this rank's shard is rank q's
    const auto c = m.coords_of(q);
    for (int a = 0; a < m.naxes(); ++a)
      if (!X::layout.is_free(a) && c[std::size_t(a)] != m.coord(a)) return false;
    return true;
  };
  auto representative = [&](int q) {  // rank q is the first holder of its shard
    const auto c = m.coords_of(q);
    for (int a = 0; a < m.naxes(); ++a)
      if (X::layout.is_free(a) && c[std::size_t(a)] != 0) return false;
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
      if (mine) t.data()[i] = orig + eps;
      const double plus = f();
      if (mine) t.data()[i] = orig - eps;
      const double minus = f();
      if (mine) t.data()[i] = orig;
      const double fd = (plus - minus) / (2 * eps);
      const double an = sum_all(m.rank() == owner && n > 0 ? double(g.data()[i]) : 0.0);
      worst = std::max(worst, std::abs(fd - an) / std::max(std::abs(fd) + std::abs(an), 1e-4));
    }
  return worst;
}

template <class X>
X random_like(const X& t, std::uint64_t seed) {
  X r = t;
  moe::init_normal(r, 1.0, seed, 77);
  return r;
}

}  // namespace

TEST_CASE("gradients of einsum, relu, softmax and the RMS norm match finite differences", "[train][grad]") {
  grid1 m(MPI_COMM_WORLD);
  const index_t P = m.nranks();
  using rows = sharding<split<0, "x">>;
  double worst = 0;
  {  // einsum with a split operand and a replicated weight
    auto a = distribute<rows>(m, random_tensor<2, double>({2 * P, 5}, 1));
    auto b = distribute<replicate>(m, random_tensor<2, double>({5, 3}, 2));
    const auto r = random_like(einsum<"ij,jk->ik">(a, b), 3);
    auto f = [&] { return dot(einsum<"ij,jk->ik">(a, b), r); };
    auto [da, db] = einsum_backward<"ij,jk->ik">(r, a, b);
    worst = std::max({worst, fd_check(a, da, f), fd_check(b, db, f)});
  }
  {  // a batched contraction, batch split in both operands
    using bsplit = sharding<split<0, "x">>;
    auto q = distribute<bsplit>(m, random_tensor<4, double>({P, 4, 2, 3}, 4));
    auto k = distribute<bsplit>(m, random_tensor<4, double>({P, 4, 2, 3}, 5));
    const auto r = random_like(einsum<"BLNK,BTNK->BNLT">(q, k), 6);
    auto f = [&] { return dot(einsum<"BLNK,BTNK->BNLT">(q, k), r); };
    auto [dq, dk] = einsum_backward<"BLNK,BTNK->BNLT">(r, q, k);
    worst = std::max({worst, fd_check(q, dq, f), fd_check(k, dk, f)});
  }
  {  // relu, softmax, RMS norm (the scale's gradient reduced over the ranks)
    auto x = distribute<rows>(m, random_tensor<2, double>({2 * P, 6}, 7));
    const auto r = random_like(x, 8);
    auto frelu = [&] { return dot(relu(x), r); };
    worst = std::max(worst, fd_check(x, relu_backward(r, x), frelu));
    auto fsoft = [&] { return dot(softmax(x), r); };
    worst = std::max(worst, fd_check(x, softmax_backward(r, softmax(x)), fsoft));
    auto s = distribute<replicate>(m, random_tensor<1, double>({6}, 9));
    auto fnorm = [&] { return dot(rms_norm(x, s), r); };
    tensor<double, 1, grid1, sharding<partial<"x">>> ds(m, {6});
    const auto dx = rms_norm_backward(r, x, s, ds.data());
    const auto ds_full = reshard<replicate>(ds);
    worst = std::max({worst, fd_check(x, dx, fnorm), fd_check(s, ds_full, fnorm)});
  }
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

TEST_CASE("gradients of attention and of the MoE layer match finite differences", "[train][grad][moe]") {
  const int P = world_size();
  grid2 m(MPI_COMM_WORLD, {1, P});
  double worst = 0;
  {  // attention, batch split, weights replicated
    model::config c;
    c.model = 6, c.heads = 2, c.head_dim = 3, c.layers = 1;
    auto p = model::init<double>(m, c, 1);
    auto& b = p.blocks[0];
    model::activation<double, grid2> h(m, {P, 5, 6});
    moe::init_normal(h, 1.0, 2, 3);
    const auto r = random_like(h, 4);
    model::block_cache<double, grid2> keep;
    model::attention(h, b, &keep);
    auto g = model::zeros_like(p);
    const auto dh = model::attention_backward(r, h, b, keep, g.blocks[0]);
    auto f = [&] { return dot(model::attention(h, b), r); };
    worst = std::max({worst, fd_check(h, dh, f), fd_check(b.wq, g.blocks[0].wq, f), fd_check(b.wk, g.blocks[0].wk, f),
                      fd_check(b.wv, g.blocks[0].wv, f), fd_check(b.wo, g.blocks[0].wo, f)});
  }
  {  // the MoE layer: experts split, router through the combine weights and the aux loss
    const index_t E = P == 3 ? 6 : 8, G = 2 * P, S = 8, M = 5, H = 7;
    auto p = moe::init_params<double>(m, M, H, E, 11);
    auto g = moe::init_params<double>(m, M, H, E, 11);
    for (auto* t : {&g.wi, &g.wo}) t->local().setZero();
    g.gate.local().setZero();
    tensor<double, 3, grid2, moe::shardings<grid2>::by_group> x(m, {G, S, M});
    moe::init_normal(x, 1.0, 12, 13);
    moe::gating_config cfg;
    cfg.capacity_factor = 4.0;  // no drops: the choices stay put under the probes
    cfg.second = moe::second_policy::all;
    const double aux_coef = 0.5;
    moe::cache<double, grid2> keep;
    const auto out = moe::forward(x, p, cfg, 1, moe::dispatch_mode::index, &keep);
    const auto r = random_like(out.y, 14);
    const auto dx = moe::backward(r, x, p, out, keep, aux_coef, g);
    auto f = [&] {
      const auto o = moe::forward(x, p, cfg, 1);
      return dot(o.y, r) + aux_coef * sum_all(o.aux_partial);
    };
    worst = std::max({worst, fd_check(x, dx, f), fd_check(p.gate, g.gate, f), fd_check(p.wi, g.wi, f),
                      fd_check(p.wo, g.wo, f)});
  }
  INFO("worst relative error " << worst);
  GSHARD_REQUIRE(worst < 1e-6);
}

namespace {
model::config tiny(int P) {
  model::config c;
  c.model = 8, c.heads = 2, c.head_dim = 4, c.hidden = 12, c.experts = P == 3 ? 6 : 8, c.layers = 2;
  c.gating.capacity_factor = 4.0;
  c.gating.second = moe::second_policy::all;
  c.aux_coef = 0.1;
  return c;
}
local_tensor<std::int32_t, 2> some_tokens(index_t B, index_t L) {
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  return tok;
}
}  // namespace

TEST_CASE("the whole model's gradient matches finite differences", "[train][grad][model]") {
  const int P = world_size();
  auto check = [&](const auto& m) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    const auto c = tiny(P);
    auto p = model::init<double>(m, c, 3);
    const auto tokens = distribute<model::batch_split<Mesh>>(m, some_tokens(2 * P, 6));
    model::model_cache<double, Mesh> keep;
    model::forward(tokens, p, c, 0, moe::dispatch_mode::index, &keep);
    auto g = model::backward(tokens, p, c, keep);
    auto f = [&] { return model::reduce_loss(model::forward(tokens, p, c, 0).second, c, m).total; };
    double worst = 0;
    int tensors = 0;
    model::for_each_param(
        [&](const std::string&, auto& w, auto& gw) {
          worst = std::max(worst, fd_check(w, gw, f, 2));
          ++tensors;
        },
        p, g);
    INFO("worst relative error " << worst << " over " << tensors << " parameter tensors");
    GSHARD_REQUIRE(tensors == 20 && worst < 1e-6);
  };
  check(grid2(MPI_COMM_WORLD, {1, P}));
  if (P == 4) check(grid2(MPI_COMM_WORLD, {2, 2}));
  if (P % 2 == 0) check(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)));
}

TEST_CASE("one training step runs exactly the collectives its types imply", "[train][collectives]") {
  const int P = world_size();
  const auto c = tiny(P);  // block 0 dense, block 1 MoE
  auto ran = [&](const auto& m) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    auto p = model::init<float>(m, c, 3);
    adam<model::params<float, Mesh>> opt({}, model::zeros_like(p));
    const auto tokens = distribute<model::batch_split<Mesh>>(m, some_tokens(2 * P, 6));
    collective_recorder rec;
    model::train_step(tokens, p, opt, c, 0);
    const auto seen = rec.tally();
    std::string got;
    for (const auto& [k, v] : seen) got += k + " x" + std::to_string(v) + " ";
    INFO("ran: " << got);
    return seen;
  };
  // all_to_all: the MoE layer's two in the forward and their transposes in the backward.
  // all_reduce over the batch axes: the gradient of every weight not split
  // over them (embed, unembed, final norm, per block norm1, norm2, wq, wk, wv,
  // wo, dense w1 and w2, MoE gate) — 18; the loss; the MoE statistics. Over
  // the whole mesh: the global norm. Over "data": the two expert weights
  // (replicated over data only).
  const auto seen2 = ran(grid2(MPI_COMM_WORLD, {P == 4 || P == 8 ? 2 : 1, P == 4 || P == 8 ? P / 2 : P}));
  GSHARD_REQUIRE(seen2 == std::map<std::string, int>{
                              {"all_to_all(expert)", 4}, {"all_reduce(data,expert)", 18 + 3}, {"all_reduce(data)", 2}});
  // With heads and the FFNs' hidden units split over "model": one all_reduce
  // over it after each attention (2), dense FFN (1) and expert FFN (1) in the
  // forward, and one for each of their input gradients in the backward (4);
  // the rest as above.
  const auto seen3 = ran(grid3(MPI_COMM_WORLD, data_expert_model_sizes(P)));
  GSHARD_REQUIRE(seen3 == std::map<std::string, int>{{"all_to_all(expert)", 4},
                                                     {"all_reduce(data,expert)", 18 + 2},
                                                     {"all_reduce(data,expert,model)", 1},
                                                     {"all_reduce(model)", 8},
                                                     {"all_reduce(data)", 2}});
}

TEST_CASE("the same seed gives the same losses at every rank count, and bit-identical reruns", "[train][determinism]") {
  const int P = world_size();
  const auto c = tiny(P);
  auto run = [&](const auto& m, auto zero) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    using T = decltype(zero);
    auto p = model::init<T>(m, c, 5);
    adam_config ac;
    ac.lr = 1e-2, ac.warmup_steps = 1;
    adam<model::params<T, Mesh>> opt(ac, model::zeros_like(p));
    std::vector<double> losses;
    for (int step = 0; step < 4; ++step) {
      const auto tok = distribute<model::batch_split<Mesh>>(m, some_tokens(2 * P, 6));
      losses.push_back(model::train_step(tok, p, opt, c, std::uint64_t(step)).value.total);
    }
    return losses;
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

TEST_CASE("checkpoints resume the same curve, at any rank count, and refuse damaged files", "[train][checkpoint]") {
  const int P = world_size();
  const auto c = tiny(P);
  const std::string dir = (std::filesystem::temp_directory_path() / ("gshard_ckpt_test_" + std::to_string(P))).string();
  if (world_rank() == 0) std::filesystem::create_directories(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string path = dir + "/model.ckpt";

  auto steps = [&](const auto& m, auto& p, auto& opt, int from, int to) {
    using Mesh = std::remove_cvref_t<decltype(m)>;
    std::vector<double> losses;
    for (int step = from; step < to; ++step) {
      const auto tok = distribute<model::batch_split<Mesh>>(m, some_tokens(2 * P, 6));
      losses.push_back(model::train_step(tok, p, opt, c, std::uint64_t(step)).value.total);
    }
    return losses;
  };
  grid2 m(MPI_COMM_WORLD, {1, P});
  using params_t = model::params<float, grid2>;
  auto fresh = [&](const auto& mesh) {
    auto p = model::init<float>(mesh, c, 7);
    return std::pair{p, adam<std::remove_cvref_t<decltype(p)>>({}, model::zeros_like(p))};
  };
  auto [p0, o0] = fresh(m);
  const auto straight = steps(m, p0, o0, 0, 4);

  auto [p1, o1] = fresh(m);
  steps(m, p1, o1, 0, 2);
  save_checkpoint(path, m, model::checkpoint_parts(p1, o1), {{"step", 2.0}});
  {  // the same rank count: bit-identical continuation
    auto [p2, o2] = fresh(m);
    const auto meta = load_checkpoint(path, m, model::checkpoint_parts(p2, o2));
    o2.step = int(meta.at("step"));
    const auto resumed = steps(m, p2, o2, 2, 4);
    GSHARD_REQUIRE(meta.at("step") == 2.0 && resumed[0] == straight[2] && resumed[1] == straight[3]);
  }
  {  // one rank (each rank alone): resharded on load, the same curve within float rounding
    grid2 self(MPI_COMM_SELF, {1, 1});
    auto [p3, o3] = fresh(self);
    const auto meta = load_checkpoint(path, self, model::checkpoint_parts(p3, o3));
    o3.step = int(meta.at("step"));
    const auto resumed = steps(self, p3, o3, 2, 4);
    GSHARD_REQUIRE(std::abs(resumed[0] - straight[2]) < 1e-5 && std::abs(resumed[1] - straight[3]) < 1e-5);
  }
  {  // another mesh: heads, hidden units and their moments split over "model" on load
    grid3 m3(MPI_COMM_WORLD, data_expert_model_sizes(P));
    auto [p4, o4] = fresh(m3);
    const auto meta = load_checkpoint(path, m3, model::checkpoint_parts(p4, o4));
    o4.step = int(meta.at("step"));
    // ... and saved from there (shards split over "model"), back onto (data, expert).
    const std::string path3 = dir + "/model3.ckpt";
    save_checkpoint(path3, m3, model::checkpoint_parts(p4, o4), {{"step", 2.0}});
    const auto resumed = steps(m3, p4, o4, 2, 4);
    GSHARD_REQUIRE(std::abs(resumed[0] - straight[2]) < 1e-5 && std::abs(resumed[1] - straight[3]) < 1e-5);
    auto [p5, o5] = fresh(m);
    o5.step = int(load_checkpoint(path3, m, model::checkpoint_parts(p5, o5)).at("step"));
    const auto back = steps(m, p5, o5, 2, 4);
    GSHARD_REQUIRE(std::abs(back[0] - straight[2]) < 1e-5 && std::abs(back[1] - straight[3]) < 1e-5);
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
  auto [pq, oq] = fresh(m);
  const auto parts = model::checkpoint_parts(pq, oq);
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
  GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(dir + "/missing.ckpt", m, parts), checkpoint_error, "cannot open the file");
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
    auto po = model::init<float>(m, other, 7);
    adam<params_t> oo({}, model::zeros_like(po));
    GSHARD_REQUIRE_THROWS_WITH(load_checkpoint(path, m, model::checkpoint_parts(po, oo)), checkpoint_error,
                               "record 'param.embed' holds 32-bit [256,8] but the program has f32[256,16]");
  }
  {  // a save that fails leaves the previous checkpoint intact
    if (world_rank() == 0) std::filesystem::create_directories(path + ".tmp");  // the temporary file cannot be opened
    MPI_Barrier(MPI_COMM_WORLD);
    GSHARD_REQUIRE_THROWS_WITH(save_checkpoint(path, m, model::checkpoint_parts(p0, o0), {{"step", 4.0}}), checkpoint_error,
                               "for writing");
    auto [p4, o4] = fresh(m);
    GSHARD_REQUIRE(load_checkpoint(path, m, model::checkpoint_parts(p4, o4)).at("step") == 2.0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}
