// bench/bench_train.cpp — training.
//   scripts/mpirun -np 2 build/bench/bench_train
// step: one training step of the trainer's model (examples/train.cpp:
//   M=128, 4 heads of 32, H=256, E=8, 4 blocks, 16 sequences of 128 bytes),
//   forward-only model with the derived backward: tokens/s, the step split
//   into all_to_all, all_reduce and the rest (compute), from the
//   collectives' own timers (slowest rank), and page faults per step.
// step_vs_legacy: the same step and the hand-written backward it replaced
//   (bench/legacy/), on the same weights, alternating in one run:
//   legacy_over_autodiff = time(hand-written) / time(autodiff).
// step_memory/{autodiff,legacy}: peak resident memory of a process that ran
//   steps of one kind only (run each alone with --benchmark_filter).
// moe_layer: the MoE layer alone in its reference configuration (4096
//   tokens per rank, M=512, H=2048, E=8, capacity factor 2), forward plus
//   backward: expert-FFN GFLOP/s (6 GEMMs per expert), against the legacy
//   hand-written layer in the same run.
#include <gshard/gshard.hpp>
#include <gshard/model/train.hpp>

#include <sys/resource.h>

#include <cstring>

#include "legacy/legacy.hpp"
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
double max_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

model::config trainer_config() {
  model::config c;
  c.model = 128, c.heads = 4, c.head_dim = 32, c.hidden = 256, c.experts = 8, c.layers = 4;
  return c;
}
legacy::model::config legacy_config(const model::config& c) {
  legacy::model::config l;
  l.model = c.model, l.heads = c.heads, l.head_dim = c.head_dim, l.hidden = c.hidden, l.experts = c.experts, l.layers = c.layers;
  return l;
}

local_tensor<std::int32_t, 2> bench_tokens(index_t B, index_t L) {
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  return tok;
}

// Both models on the same weights, each with its own optimizer state.
struct both {
  const grid& m = gshard::bench::world_mesh<grid>();
  model::config c = trainer_config();
  legacy::model::config lc = legacy_config(c);
  parameters<grid> ps{m, 1};
  model::transformer<float, grid> tr{ps, c};
  adam opt{{}, ps};
  legacy::model::params<float, grid> lp = legacy::model::init<float>(m, lc, 1);
  legacy::adam<legacy::model::params<float, grid>> lopt{{}, legacy::model::zeros_like(lp)};
  model::transformer<float, grid>::tokens_type tokens =
      distribute<model::transformer<float, grid>::tokens_type>(m, bench_tokens(16, 128));
  tensor<std::int32_t, 2, grid, legacy::model::batch_split<grid>> ltokens =
      distribute<legacy::model::batch_split<grid>>(m, bench_tokens(16, 128));
  std::uint64_t s = 0, ls = 0;
  both() {
    legacy::model::for_each_param(
        [&](const std::string& name, auto& t) {
          std::memcpy(ps.values().find(name)->f32().data(), t.data(), sizeof(float) * std::size_t(t.local().size()));
        },
        lp);
  }
  void step() { model::train_step(tr, ps, opt, tokens, s++); }
  void legacy_step() { legacy::model::train_step(ltokens, lp, lopt, lc, ls++); }
};

void step(benchmark::State& state) {
  both b;
  b.step();  // warm up
  b.step();
  double a2a = 0, ar = 0, total = 0;
  const long f0 = minor_faults();
  for (auto _ : state) {
    const double a0 = collective_seconds(collective::all_to_all), r0 = collective_seconds(collective::all_reduce);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    b.step();
    const double t = gshard::bench::max_over_ranks(MPI_Wtime() - t0);
    a2a += gshard::bench::max_over_ranks(collective_seconds(collective::all_to_all) - a0);
    ar += gshard::bench::max_over_ranks(collective_seconds(collective::all_reduce) - r0);
    total += t;
    state.SetIterationTime(t);
  }
  const double n = double(state.iterations());
  state.counters["tokens/s"] = double(16 * 128) * n / total;
  state.counters["step_ms"] = 1e3 * total / n;
  state.counters["all_to_all_ms"] = 1e3 * a2a / n;
  state.counters["all_reduce_ms"] = 1e3 * ar / n;
  state.counters["compute_ms"] = 1e3 * (total - a2a - ar) / n;
  state.counters["page_faults/step"] = gshard::bench::max_over_ranks(double(minor_faults() - f0)) / n;
}

void step_vs_legacy(benchmark::State& state) {
  both b;
  const auto c = gshard::bench::compare(state, {[&] { b.step(); }, [&] { b.legacy_step(); }}, 0);
  state.counters["autodiff_ms"] = 1e3 * c.median_time[0];
  state.counters["legacy_ms"] = 1e3 * c.median_time[1];
  state.counters["legacy_over_autodiff"] = c.median_ratio[1];
}

template <bool Legacy>
void step_memory(benchmark::State& state) {
  both b;
  for (int i = 0; i < 3; ++i) Legacy ? b.legacy_step() : b.step();  // steady state
  const long f0 = minor_faults();
  for (auto _ : state) {
    const double t = gshard::bench::slowest([&] {
      if constexpr (Legacy) b.legacy_step();
      else b.step();
    });
    state.SetIterationTime(t);
  }
  state.counters["max_rss_MiB"] = gshard::bench::max_over_ranks(max_rss_mib());
  state.counters["page_faults/step"] = gshard::bench::max_over_ranks(double(minor_faults() - f0)) / double(state.iterations());
}

void moe_layer(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t P = m.nranks(), S = 1024, G = 4 * P, M = 512, H = 2048, E = 8;
  moe::gating_config gc;
  parameters ps(m, 1);
  moe::layer<float, grid> layer(ps, "moe.", M, H, E);
  using L = moe::layer<float, grid>;
  named<float, "GSM", grid, L::at_tokens> x(m, {G, S, M});
  fill_normal(x, 1.0, 2, 3);
  const auto dy = relabel<"">(named<float, "GSM", grid, L::at_tokens>(x));
  std::uint64_t s = 0;
  auto fwd_bwd = [&] {
    tape t(ps);
    auto out = layer(t.constant(x), gc, s++);
    // <y, dy>: the backward receives dy as the output's gradient.
    auto l = reshard<replicate>(einsum<"GSM,GSM->">(relabel<"">(std::move(out.y)), t.constant(dy)));
    t.backward(l);
  };
  // The hand-written layer on the same weights.
  legacy::moe::gating_config lgc;
  auto lp = legacy::moe::init_params<float>(m, M, H, E, 1);
  auto lg = legacy::moe::init_params<float>(m, M, H, E, 1);
  std::memcpy(lp.gate.data(), layer.gate.value().data(), sizeof(float) * std::size_t(lp.gate.local().size()));
  std::memcpy(lp.wi.data(), layer.wi.value().data(), sizeof(float) * std::size_t(lp.wi.local().size()));
  std::memcpy(lp.wo.data(), layer.wo.value().data(), sizeof(float) * std::size_t(lp.wo.local().size()));
  tensor<float, 3, grid, legacy::moe::shardings<grid>::by_group> lx(m, {G, S, M});
  std::memcpy(lx.data(), x.data(), sizeof(float) * std::size_t(x.local().size()));
  std::uint64_t ls = 0;
  auto legacy_fwd_bwd = [&] {
    legacy::moe::cache<float, grid> keep;
    const auto out = legacy::moe::forward(lx, lp, lgc, ls++, legacy::moe::dispatch_mode::index, &keep);
    benchmark::DoNotOptimize(legacy::moe::backward(lx, lx, lp, out, keep, 0.01, lg));
  };
  fwd_bwd();
  fwd_bwd();  // steady state: the heap holds every buffer size once
  const long f0 = minor_faults();
  const auto c = gshard::bench::compare(state, {fwd_bwd, legacy_fwd_bwd}, 0);
  const double faults = gshard::bench::max_over_ranks(double(minor_faults() - f0)) / double(state.iterations());
  const index_t C = moe::capacity(S, E, gc);
  const double expert_flop = 3.0 * 4.0 * double(E / P * G * C * M * H);  // forward 2 GEMMs, backward 4
  state.counters["expert_gflops"] = expert_flop / c.median_time[0] * 1e-9;
  state.counters["peak_share"] = expert_flop / c.median_time[0] * 1e-9 / peak_gflops_per_core;
  state.counters["legacy_over_autodiff"] = c.median_ratio[1];
  state.counters["page_faults/iter"] = faults;
}

const int registered = [] {
  benchmark::RegisterBenchmark("step", step)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_vs_legacy", step_vs_legacy)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_memory/autodiff", step_memory<false>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_memory/legacy", step_memory<true>)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_layer", moe_layer)->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
