// bench/bench_train.cpp — training.
//   env -u OPENBLAS_CORETYPE scripts/mpirun -np 2 build/bench/bench_train
// step: one training step of the trainer's model (examples/train.cpp:
//   M=128, 4 heads of 32, H=256, E=8, 4 blocks, 16 sequences of 128 bytes):
//   tokens/s, and the step split into all_to_all, all_reduce and the rest
//   (compute), from the collectives' own timers (slowest rank).
// moe_layer: the MoE layer alone in its reference configuration (4096
//   tokens per rank, M=512, H=2048, E=8, capacity factor 2), forward plus
//   backward: expert-FFN GFLOP/s (6 GEMMs per expert) and the share of the
//   fp32 FMA peak, and page faults per iteration in steady state (getrusage).
#include <gshard/gshard.hpp>
#include <gshard/model/train.hpp>

#include <sys/resource.h>

#include "mpi_bench.hpp"

using namespace gshard;
using grid = mesh<axis<"data", 1>, axis<"expert">>;

namespace {

constexpr double peak_gflops_per_core = 224.0;

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

void step(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  model::config c;
  c.model = 128, c.heads = 4, c.head_dim = 32, c.hidden = 256, c.experts = 8, c.layers = 4;
  const index_t B = 16, L = 128;
  auto p = model::init<float>(m, c, 1);
  adam<model::params<float, grid>> opt({}, model::zeros_like(p));
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  const auto tokens = distribute<model::batch_split<grid>>(m, tok);
  std::uint64_t s = 0;
  model::train_step(tokens, p, opt, c, s++);  // warm up
  double a2a = 0, ar = 0, total = 0;
  for (auto _ : state) {
    const double a0 = collective_seconds(collective::all_to_all), r0 = collective_seconds(collective::all_reduce);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    model::train_step(tokens, p, opt, c, s++);
    const double t = gshard::bench::max_over_ranks(MPI_Wtime() - t0);
    a2a += gshard::bench::max_over_ranks(collective_seconds(collective::all_to_all) - a0);
    ar += gshard::bench::max_over_ranks(collective_seconds(collective::all_reduce) - r0);
    total += t;
    state.SetIterationTime(t);
  }
  const double n = double(state.iterations());
  state.counters["tokens/s"] = double(B * L) * n / total;
  state.counters["step_ms"] = 1e3 * total / n;
  state.counters["all_to_all_ms"] = 1e3 * a2a / n;
  state.counters["all_reduce_ms"] = 1e3 * ar / n;
  state.counters["compute_ms"] = 1e3 * (total - a2a - ar) / n;
}

void moe_layer(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t P = m.nranks(), S = 1024, G = 4 * P, M = 512, H = 2048, E = 8;
  moe::gating_config gc;
  auto p = moe::init_params<float>(m, M, H, E, 1);
  auto g = moe::init_params<float>(m, M, H, E, 1);
  tensor<float, 3, grid, moe::shardings<grid>::by_group> x(m, {G, S, M});
  moe::init_normal(x, 1.0, 2, 3);
  auto dy = x;
  std::uint64_t s = 0;
  auto fwd_bwd = [&] {
    moe::cache<float, grid> keep;
    const auto out = moe::forward(x, p, gc, s++, moe::dispatch_mode::index, &keep);
    benchmark::DoNotOptimize(moe::backward(dy, x, p, out, keep, 0.01, g));
  };
  fwd_bwd();
  fwd_bwd();  // steady state: the heap holds every buffer size once
  const long f0 = minor_faults();
  const auto c = gshard::bench::compare(state, {fwd_bwd}, 0);
  const double faults = gshard::bench::max_over_ranks(double(minor_faults() - f0)) / double(state.iterations());
  const index_t C = moe::capacity(S, E, gc);
  const double expert_flop = 3.0 * 4.0 * double(E / P * G * C * M * H);  // forward 2 GEMMs, backward 4
  state.counters["expert_gflops"] = expert_flop / c.median_time[0] * 1e-9;
  state.counters["peak_share"] = expert_flop / c.median_time[0] * 1e-9 / peak_gflops_per_core;
  state.counters["page_faults/iter"] = faults;
}

const int registered = [] {
  benchmark::RegisterBenchmark("step", step)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_layer", moe_layer)->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
