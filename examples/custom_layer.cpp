// examples/custom_layer.cpp — a layer of your own, written forward-only, and
// trained across ranks: a pre-norm SwiGLU block, x + (silu(h·wg) ⊙ (h·wu))·wd
// with h = rms_norm(x), whose hidden units are split over a "model" axis
// (Megatron-style) while the batch is split over "data". Two such blocks and
// a linear head learn a fixed random teacher, y = tanh(x·A), by mean squared
// error. Nothing here is a backward: the tape derives it, and the
// collectives it runs follow from the shardings (printed before training).
//   scripts/mpirun -np 3 build/examples/custom_layer [steps]   (any number of ranks)
#include <gshard/gshard.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "cli.hpp"

using namespace gshard;

namespace {

// The mesh's axes and what they are for: declared, not guessed from names.
using grid = mesh<axis<"data">, axis<"model">>;
using roles = axis_roles<batch_axes<"data">, expert_axes<>, model_axes<"model">>;
using at = roles_on<grid, roles>::at_tokens;  // B over data; H (and N) over model

template <class T>
struct swiglu_block {
  param<named<T, "M", grid, at>> scale;       // the RMS norm's gain, replicated
  param<named<T, "MH", grid, at>> wg, wu;     // [M, H{model}]
  param<named<T, "HM", grid, at>> wd;         // [H{model}, M]

  swiglu_block(parameters<grid>& ps, const std::string& name, index_t M, index_t H)
      : scale(ps, name + ".scale", {M}, init::ones()),
        wg(ps, name + ".wg", {M, H}, init::normal(1.0 / std::sqrt(double(M)))),
        wu(ps, name + ".wu", {M, H}, init::normal(1.0 / std::sqrt(double(M)))),
        wd(ps, name + ".wd", {H, M}, init::normal(0.5 / std::sqrt(double(H)))) {}

  // x: [B{data}, M]. The hidden units live on their "model" ranks; the down
  // projection sums over them, so the block ends in one all_reduce over "model".
  template <class X>
  auto operator()(const X& x) const {
    auto h = rms_norm(x, scale);
    auto a = silu(einsum<"BM,MH->BH">(h, wg)) * einsum<"BM,MH->BH">(h, wu);  // [B{data},H{model}]
    return x + einsum<"BH,HM->BM", at>(a, wd);
  }
};

template <class T>
struct regressor {
  swiglu_block<T> b1, b2;
  param<named<T, "MO", grid, at>> head;  // [M, O]

  regressor(parameters<grid>& ps, index_t M, index_t H, index_t O)
      : b1(ps, "block1", M, H), b2(ps, "block2", M, H), head(ps, "head", {M, O}, init::normal(1.0 / std::sqrt(double(M)))) {}

  // The mean squared error of the predictions for x against y: replicated.
  template <class X, class Y>
  auto loss(tape& t, const X& x, const Y& y) const {
    auto pred = einsum<"BM,MO->BO">(b2(b1(t.constant(x))), head);  // [B{data},O]
    auto err = pred - t.constant(y);
    const double n = double(y.extent(0) * y.extent(1));
    return all_reduce<"data">(einsum<"BO,BO->">(err, err)) / n;  // Σ over this rank's rows, then one all_reduce
  }
};

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const auto args = examples::positional(argc, argv, "custom_layer", {"steps"},
                                         "usage: mpirun -np P custom_layer [steps]   (any P; steps: 300)\n"
                                         "  trains two SwiGLU blocks written forward-only and prints their derived collectives\n");
  if (!args) return 0;
  const int steps = args->empty() ? 300 : examples::number<long long>("custom_layer", "steps", (*args)[0], 1);
  // data x model: 2 x P/2 for an even P above 2, else 1 x P. H = 128 over
  // "model" need not divide: at 3 ranks the blocks hold 43, 43 and 42 units.
  const int P = env.size();
  const int data = P % 2 == 0 && P > 2 ? 2 : 1;
  const grid m(MPI_COMM_WORLD, {data, P / data});
  const bool root = m.rank() == 0;
  const index_t B = 64, M = 32, H = 128, O = 8;

  parameters ps(m, 42);
  const regressor<float> model(ps, M, H, O);
  adam_config ac;
  ac.lr = 3e-3, ac.warmup_steps = 20, ac.total_steps = steps;
  adam opt(ac, ps);

  // The teacher: y = tanh(x·A) for a fixed A; every rank draws the same global batch.
  using rows = named<float, "BM", grid, at>;
  using targets = named<float, "BO", grid, at>;
  local_tensor<float, 2> A(M, O);
  for (index_t i = 0; i < A.size(); ++i) A.data()[i] = float(normal(7, 1, std::uint64_t(i)));
  auto batch = [&](int step) {
    local_tensor<float, 2> x(B, M), y(B, O);
    for (index_t i = 0; i < x.size(); ++i) x.data()[i] = float(normal(7, 2 + std::uint64_t(step), std::uint64_t(i)));
    for (index_t b = 0; b < B; ++b)
      for (index_t o = 0; o < O; ++o) {
        double s = 0;
        for (index_t k = 0; k < M; ++k) s += double(x(b, k)) * double(A(k, o)) / std::sqrt(double(M));
        y(b, o) = float(std::tanh(s));
      }
    return std::pair{distribute<rows>(m, x), distribute<targets>(m, y)};
  };

  if (root) {
    std::cout << "A SwiGLU block of your own on " << m.describe() << ", " << ps.size() << " parameters declared:\n";
    for (std::size_t i = 0; i < ps.size(); ++i) std::cout << "  " << ps.name(i) << "  " << ps.values()[i].notation() << "\n";
    const auto [x, y] = batch(0);
    using hidden = tensor<float, 2, grid, sharding_by<at, "BH">, "BH">;
    std::cout << "\nIts plan (each einsum, and the collectives its sharding implies):\n"
              << plan_of<"BM,MH->BH">(x, model.b1.wg.value())
              << plan_of<"BH,HM->BM", at>(hidden(m, {B, H}), model.b1.wd.value());
  }

  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(step);
    tape t(ps);
    collective_recorder rec;
    auto l = model.loss(t, x, y);
    const auto forward_ran = rec.tally();
    rec.reset();
    t.backward(l);
    const auto backward_ran = rec.tally();
    const auto [norm, lr] = opt.update(ps);
    if (root && step == 0) {
      auto show = [](const std::map<std::string, int>& ran) {
        std::string s;
        for (const auto& [k, n] : ran) s += (s.empty() ? "" : ", ") + std::to_string(n) + " " + k;
        return s;
      };
      std::cout << "\nOne step's collectives: forward " << show(forward_ran) << "; backward (derived) "
                << show(backward_ran) << "\n\n";
    }
    if (root && (step == 0 || (step + 1) % 50 == 0 || step + 1 == steps))
      std::printf("step %4d  mse %.5f  grad norm %.3f  lr %.2e\n", step + 1, double(l.value().local()()), norm, lr);
  }
  return 0;
}
