// bench/bench_train.cpp — training: the trainer's step and its parts (GEMMs,
// memory, weight update, buckets, remat, cost model), the translation
// model's step and decoding; the MoE layer and attention alone are
// bench_layers.cpp's.
//   scripts/mpirun -np 2 build/bench/bench_train
// The comment above each benchmark says what it measures;
// docs/10_performance.md discusses the results.
#include <gshard/gshard.hpp>
#include <gshard/model/machine.hpp>
#include <gshard/model/seq2seq.hpp>
#include <gshard/model/train.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <malloc.h>
#include <map>
#include <stdexcept>

#include "mpi_bench.hpp"

using namespace gshard;
using grid = mesh<axis<"data", 1>, axis<"expert">>;

namespace {


model::config trainer_config() {
  model::config c;
  c.model = 128, c.heads = 4, c.head_dim = 32, c.hidden = 256, c.experts = 8, c.layers = 4;
  return c;
}
local_tensor<std::int32_t, 2> bench_tokens(index_t B, index_t L) {
  local_tensor<std::int32_t, 2> tok(B, L + 1);
  for (index_t i = 0; i < tok.size(); ++i) tok.data()[i] = std::int32_t((i * 37 + 11) % 256);
  return tok;
}

// The trainer's model, its parameters and Adam's state, and a batch; the
// weight update replicated or sharded over the batch axes.
struct trainer {
  explicit trainer(bool sharded_update = false) : trainer(trainer_config(), sharded_update) {}
  explicit trainer(const model::config& cfg, bool sharded_update = false)
      : c(cfg),
        ps(sharded_update ? parameters<grid>(m, 1, shard_weight_update<default_roles::batch>{}) : parameters<grid>(m, 1)) {}
  const grid& m = gshard::bench::world_mesh<grid>();
  model::config c;
  parameters<grid> ps;
  model::transformer<float, grid> tr{ps, c};
  adam opt{{}, ps};
  model::transformer<float, grid>::tokens_type tokens =
      distribute<model::transformer<float, grid>::tokens_type>(m, bench_tokens(16, 128));
  std::uint64_t s = 0;
  bool bf16 = false;
  // The trainer's --precision bf16 --gradient-wire bf16 (with a config whose
  // all_to_all_wire is bf16): bf16 GEMMs, gradients reduced in bf16, bf16
  // weights with fp32 masters (Adam built anew: the masters are its state).
  void use_bf16() {
    ps.set_gradient_wire(wire::bf16);
    ps.set_weight_wire(wire::bf16);
    opt = adam({}, ps);
    bf16 = true;
  }
  void step() {
    const matmul_precision_scope precision(bf16 ? matmul_precision::bf16 : matmul_precision::f32);
    model::train_step(tr, ps, opt, tokens, s++);
  }
  // A step that ends with its update's gathers: interleaved with another
  // model's steps, they would otherwise travel in that model's time.
  void step_alone() {
    step();
    ps.finish_gathers();
  }
};

// step/sharded_update:0|1: one training step of the trainer's model
// (examples/train.cpp: M=128, 4 heads of 32, H=256, E=8, 4 blocks, 16
// sequences of 128 bytes), the weight update replicated (0) or sharded (1),
// the backward derived by the tape: tokens/s, the step split into
// all_to_all, all_reduce and the rest (compute), from the collectives' own
// timers (slowest rank), page faults per step, and the step's model FLOPs
// and MFU against the FMA peak measured in the run.
void step(benchmark::State& state) {
  trainer b(state.range(0) == 1);
  b.step();  // warm up
  b.step();
  double a2a = 0, ar = 0, rs_ag = 0, total = 0;
  const long f0 = gshard::bench::minor_faults();
  const double flops0 = model_flops();
  for (auto _ : state) {
    const double a0 = collective_seconds(collective::all_to_all), r0 = collective_seconds(collective::all_reduce);
    const double s0 = collective_seconds(collective::reduce_scatter) + collective_seconds(collective::all_gather);
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    b.step();
    const double t = gshard::bench::max_over_ranks(MPI_Wtime() - t0);
    a2a += gshard::bench::max_over_ranks(collective_seconds(collective::all_to_all) - a0);
    ar += gshard::bench::max_over_ranks(collective_seconds(collective::all_reduce) - r0);
    rs_ag += gshard::bench::max_over_ranks(collective_seconds(collective::reduce_scatter) +
                                           collective_seconds(collective::all_gather) - s0);
    total += t;
    state.SetIterationTime(t);
  }
  const double n = double(state.iterations());
  state.counters["tokens/s"] = double(16 * 128) * n / total;
  state.counters["step_ms"] = 1e3 * total / n;
  state.counters["all_to_all_ms"] = 1e3 * a2a / n;
  state.counters["all_reduce_ms"] = 1e3 * ar / n;
  state.counters["reduce_scatter+all_gather_ms"] = 1e3 * rs_ag / n;
  state.counters["compute_ms"] = 1e3 * (total - a2a - ar - rs_ag) / n;
  state.counters["page_faults/step"] = gshard::bench::max_over_ranks(double(gshard::bench::minor_faults() - f0)) / n;
  // Model FLOPs utilisation: the step's einsum FLOPs (each rank counts 1/P of
  // every einsum, counters.hpp) over step time x ranks x the measured peak.
  const double P = double(b.m.nranks()), step_flops = (model_flops() - flops0) * P / n;
  state.counters["model_GFLOP/step"] = step_flops * 1e-9;
  state.counters["mfu"] = step_flops / (total / n) / (P * gshard::bench::fma_peak_gflops() * 1e9);
}

// step_bf16: the trainer's step (sharded update) three ways, interleaved
// in the same iterations: fp32; fp32 GEMMs with bf16 on the wire — the MoE
// all_to_alls (model::config::all_to_all_wire) and the gradients' reductions
// (parameters::set_gradient_wire); and those with matmul_precision::bf16
// and bf16 weights with fp32 masters (the trainer's --precision bf16
// --gradient-wire bf16: the router, norms, softmax, the loss, the masters
// and Adam stay fp32).
// wire_speedup and bf16_speedup: the fp32 step's time over each other's;
// tokens/s of each; MFU of the fp32 step against the FMA peak and of the
// bf16 step against the bf16 dot-product peak, both measured in the run
// (no bf16 MFU where this build does not target AVX512_BF16). Where the
// GEMM has no bf16 units, every step runs fp32 GEMMs. Fourth, the bf16
// step with only the filled capacity slots in its MoE all_to_alls
// (wire::bf16 | wire::trimmed, the trainer's with --precision bf16): trimmed_vs_bf16, the
// bf16 step's time over its own. At least 4 s. Over shared memory the
// halved bytes hardly show; at a slow link (scripts/multihost --link-rate
// 1gbit) they do.
void step_bf16(benchmark::State& state) {
  model::config wire_config = trainer_config(), trimmed_config = trainer_config();
  wire_config.all_to_all_wire = wire::bf16;
  trimmed_config.all_to_all_wire = wire::bf16 | wire::trimmed;
  trainer f32(true), on_wire(wire_config, true), bf16(wire_config, true), trimmed(trimmed_config, true);
  on_wire.ps.set_gradient_wire(wire::bf16);
  bf16.use_bf16();
  trimmed.use_bf16();
  const double flops0 = model_flops();
  f32.step();
  const double P = double(f32.m.nranks()), step_flops = (model_flops() - flops0) * P;
  const auto c = gshard::bench::compare(
      state, {[&] { f32.step_alone(); }, [&] { on_wire.step_alone(); }, [&] { bf16.step_alone(); }, [&] { trimmed.step_alone(); }},
      1);
  state.counters["wire_speedup"] = 1.0 / c.median_ratio[1];
  state.counters["bf16_speedup"] = 1.0 / c.median_ratio[2];
  state.counters["trimmed_vs_bf16"] = c.median_ratio[2] / c.median_ratio[3];
  state.counters["trimmed_tokens/s"] = 16 * 128 / c.median_time[3];
  state.counters["f32_tokens/s"] = 16 * 128 / c.median_time[0];
  state.counters["wire_tokens/s"] = 16 * 128 / c.median_time[1];
  state.counters["bf16_tokens/s"] = 16 * 128 / c.median_time[2];
  state.counters["f32_mfu"] = step_flops / c.median_time[0] / (P * gshard::bench::fma_peak_gflops() * 1e9);
  if (const double peak = gshard::bench::bf16_peak_gflops(); peak > 0)
    state.counters["bf16_mfu"] = step_flops / c.median_time[2] / (P * peak * 1e9);
  state.counters["bf16_units"] = gshard::detail::gemm_bf16_native() ? 1 : 0;
}

// gathers_in_flight: the bf16 step (step_bf16's trimmed one, one
// collective per weight as `train --bucket-kib 0`) with the updated blocks'
// all_gathers travelling into the next forward (the default) and finished
// in the update (parameters::set_gather_bytes_in_flight(0)), interleaved:
// each timed call runs three steps of one model and finishes its last
// gathers, so two of every three travel into a forward of the model's own.
// in_flight_speedup: the median ratio of the calls' times, finished over
// in flight. At least 4 s. Over shared memory the gathers are short; at a
// slow link (scripts/multihost --link-rate 1gbit) they are not.
void gathers_in_flight(benchmark::State& state) {
  model::config cfg = trainer_config();
  cfg.all_to_all_wire = wire::bf16 | wire::trimmed;
  trainer eager(cfg, true), late(cfg, true);
  for (trainer* t : {&eager, &late}) {
    t->ps.set_bucket_bytes(0);
    t->use_bf16();
  }
  eager.ps.set_gather_bytes_in_flight(0);
  const auto three = [](trainer& t) {
    return [&t] {
      for (int i = 0; i < 3; ++i) t.step();
      t.ps.finish_gathers();
    };
  };
  const auto c = gshard::bench::compare(state, {three(eager), three(late)}, 1);
  state.counters["in_flight_speedup"] = 1.0 / c.median_ratio[1];
  state.counters["finished_tokens/s"] = 3 * 16 * 128 / c.median_time[0];
  state.counters["in_flight_tokens/s"] = 3 * 16 * 128 / c.median_time[1];
}

// step_gemms: the step (sharded update) against its own GEMMs replayed
// alone, interleaved: every local GEMM one step ran (gemm_recorder,
// counters.hpp), called again in the same order with the same shapes,
// transposes and leading dimensions on one set of buffers (warm: the best
// rate those shapes get), each rank its own — attention's per-head
// products, one batched call each in the step (detail::gemm_batched), one
// by one here. gemms/step is the share of the step the BLAS itself needs; gemm_bound_mfu the MFU of a step that
// did nothing but its GEMMs — the ceiling this GEMM library sets on these
// shapes; the rest of the step (1 - gemms/step) is what fusing can win.
void step_gemms(benchmark::State& state) {
  trainer b(true);
  b.step();
  b.step();
  std::vector<gemm_call> calls;
  const double flops0 = model_flops();
  {
    gemm_recorder rec;
    b.step();
    calls = rec.calls();
  }
  const double P = double(b.m.nranks()), step_flops = (model_flops() - flops0) * P;
  std::size_t a_size = 0, b_size = 0, c_size = 0;
  double gemm_flops = 0;
  for (const auto& c : calls) {
    if (c.element_bytes != int(sizeof(float))) throw std::logic_error("step_gemms: the trainer runs float GEMMs only");
    a_size = std::max(a_size, std::size_t((c.trans_a ? c.k : c.m) * c.lda));
    b_size = std::max(b_size, std::size_t((c.trans_b ? c.n : c.k) * c.ldb));
    c_size = std::max(c_size, std::size_t(c.m * c.ldc));
    gemm_flops += c.flops();
  }
  std::vector<float> ab(a_size, 1e-3f), bb(b_size, 1e-3f), cb(c_size, 0.f);
  auto replay = [&] {
    for (const auto& c : calls)
      gshard::detail::gemm<float>(c.trans_a, c.trans_b, c.m, c.n, c.k, 1.f, ab.data(), c.lda, bb.data(), c.ldb,
                                  c.accumulate ? 1.f : 0.f, cb.data(), c.ldc);
  };
  const auto r = gshard::bench::compare(state, {[&] { b.step(); }, replay}, 0);
  const double peak = gshard::bench::fma_peak_gflops() * 1e9;
  state.counters["step_ms"] = 1e3 * r.median_time[0];
  state.counters["gemms_ms"] = 1e3 * r.median_time[1];
  state.counters["gemms/step"] = r.median_ratio[1];
  state.counters["gemm_calls"] = double(calls.size());
  state.counters["gemm_GFLOP/s"] = gshard::bench::max_over_ranks(gemm_flops) / r.median_time[1] * 1e-9;
  state.counters["gemm_peak_share"] = gshard::bench::max_over_ranks(gemm_flops) / r.median_time[1] / peak;
  state.counters["mfu"] = step_flops / r.median_time[0] / (P * peak);
  state.counters["gemm_bound_mfu"] = step_flops / r.median_time[1] / (P * peak);
}

// step_memory: peak resident memory per rank of a process that ran steps
// (run it alone with --benchmark_filter: the peak is the process's), and
// page faults per step after three warm-up steps.
void step_memory(benchmark::State& state) {
  trainer b;
  for (int i = 0; i < 3; ++i) b.step();  // steady state
  const long f0 = gshard::bench::minor_faults();
  for (auto _ : state) state.SetIterationTime(gshard::bench::slowest([&] { b.step(); }));
  state.counters["max_rss_MiB"] = gshard::bench::max_over_ranks(gshard::bench::max_rss_mib());
  state.counters["page_faults/step"] = gshard::bench::max_over_ranks(double(gshard::bench::minor_faults() - f0)) / double(state.iterations());
}

// sharded_vs_replicated_update: the same step with each weight update,
// interleaved step by step in one run (the machine's drift cancels): the
// median ratio of step times, sharded over replicated.
void sharded_vs_replicated_update(benchmark::State& state) {
  trainer rep(false), sh(true);
  const auto c = gshard::bench::compare(state, {[&] { rep.step(); }, [&] { sh.step_alone(); }}, 1);
  state.counters["replicated_ms"] = 1e3 * c.median_time[0];
  state.counters["sharded_ms"] = 1e3 * c.median_time[1];
  state.counters["sharded/replicated"] = c.median_ratio[1];
}

// bucket_sizes/bf16:0|1: the step (sharded update) with its gradient
// reductions and weight gathers one collective per weight, and in buckets of
// 128 KiB, 256 KiB, 1 MiB and 4 MiB (the default), interleaved step by step
// (median times, ratios to one per weight); and the collectives each issues
// per step. bf16:1 is step_bf16's bf16 step (bf16 GEMMs, weights, gradients
// and all_to_alls): half the bytes in each bucket. Buckets start as they
// fill and travel while the step computes: smaller ones start sooner,
// larger ones pay each collective's latency fewer times.
void bucket_sizes(benchmark::State& state) {
  const bool bf16 = state.range(0) == 1;
  const std::size_t kib[] = {0, 128, 256, 1024, default_bucket_bytes >> 10};
  std::vector<std::unique_ptr<trainer>> runs;
  std::vector<std::function<void()>> steps;
  model::config cfg = trainer_config();
  if (bf16) cfg.all_to_all_wire = wire::bf16;
  for (std::size_t k : kib) {
    runs.push_back(std::make_unique<trainer>(cfg, true));
    trainer& t = *runs.back();
    t.ps.set_bucket_bytes(k << 10);
    if (bf16) t.use_bf16();
    steps.push_back([&t] { t.step_alone(); });
  }
  auto name = [](std::size_t k) { return k == 0 ? std::string("per_weight") : std::to_string(k) + "KiB"; };
  for (std::size_t i = 0; i < runs.size(); ++i) {
    collective_recorder rec;
    steps[i]();
    state.counters["collectives_" + name(kib[i])] = double(rec.events().size());
  }
  const auto c = gshard::bench::compare(state, steps, runs.size() - 1);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    state.counters[name(kib[i]) + "_ms"] = 1e3 * c.median_time[i];
    if (i > 0) state.counters[name(kib[i]) + "/per_weight"] = c.median_ratio[i];
  }
}

// kB of a "VmRSS:" / "VmHWM:" line of /proc/self/status, in MiB.
double status_mib(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  const std::size_t n = std::strlen(key);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, n) == 0) kb = std::atof(line + n);
  std::fclose(f);
  return kb / 1024.0;
}
// The heap's bytes in use (glibc's arenas and mmapped blocks), in MiB: what
// the program holds, without the heap's slack.
double heap_in_use_mib() {
  const struct mallinfo2 mi = mallinfo2();
  return double(mi.uordblks + mi.hblkhd) / (1024.0 * 1024.0);
}
double local_mib(tensor_set& s) { return double(s.local_bytes()) / (1024.0 * 1024.0); }

// memory_per_rank/sharded_update:0|1/adafactor:0|1/bf16:0/sequences:8 — GShard's weak scaling (paper §5.1):
// the work per rank fixed (8 sequences of 128 bytes), the experts growing
// with the ranks (E = 2P, two per rank), the trainer's model otherwise.
// With bf16:1 the steps run as the trainer's --precision bf16 (bf16 GEMMs,
// bf16 weights with fp32 masters, bf16 all_to_alls); sequences:64 makes the activations
// most of the peak (memory_per_rank/sharded_update:1/adafactor:0/bf16:0|1/sequences:64
// compares the two precisions' activation memory).
// Peak resident memory per rank after three steps, and its parts: the
// parameters, their gradients, the optimizer's state (Adam's, or
// Adafactor's with GShard's setting), and the rest (activations,
// communication buffers, the heap's slack) over what the process held
// before the model (MPI, the program). The peak is reset at its start, but
// the heap keeps what earlier benchmarks freed: run it alone per process
// (--benchmark_filter), as scripts/memory_per_rank does at 1, 2, 4 and 8 ranks.
// activations_MiB is what the tape holds for the backward when the forward
// ends: the heap's bytes in use then over those before it (one more step,
// untimed), without the backward's transient gradients or the heap's slack.
void memory_per_rank(benchmark::State& state) {
  // The peak from here on: "5" resets VmHWM to the current RSS (proc(5),
  // clear_refs), so earlier benchmarks of the process do not count.
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) std::fputs("5", f), std::fclose(f);
  const double before = gshard::bench::max_over_ranks(status_mib("VmRSS:"));
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t P = m.nranks();
  const bool bf16 = state.range(2) == 1;
  model::config c = trainer_config();
  c.experts = 2 * P;
  if (bf16) c.all_to_all_wire = wire::bf16;
  parameters<grid> ps = state.range(0) == 1 ? parameters<grid>(m, 1, shard_weight_update<default_roles::batch>{})
                                            : parameters<grid>(m, 1);
  model::transformer<float, grid> tr(ps, c);
  if (bf16) ps.set_weight_wire(wire::bf16);  // before the optimizer: the masters are its state
  std::unique_ptr<gshard::optimizer> opt;
  if (state.range(1) == 1) opt = std::make_unique<adafactor>(adafactor_config{}, ps);
  else opt = std::make_unique<adam>(adam_config{}, ps);
  using tokens_t = model::transformer<float, grid>::tokens_type;
  const auto tokens = distribute<tokens_t>(m, bench_tokens(state.range(3) * P, 128));
  const matmul_precision_scope precision(bf16 ? matmul_precision::bf16 : matmul_precision::f32);
  std::uint64_t s = 0;
  for (auto _ : state) state.SetIterationTime(gshard::bench::slowest([&] { model::train_step(tr, ps, *opt, tokens, s++); }));
  auto most = [](double v) { return gshard::bench::max_over_ranks(v); };
  double activations = 0;
  {
    const double heap = heap_in_use_mib();
    tape t(ps);
    auto out = tr.forward(t, tokens, s++);
    activations = heap_in_use_mib() - heap;
    t.backward(out.loss);
    opt->update(ps);
  }
  const double params = most(local_mib(ps.values())), grads = most(local_mib(ps.grads()));
  const double optimizer = most(double(opt->state_bytes()) / (1024.0 * 1024.0));
  const double peak = most(status_mib("VmHWM:"));
  state.counters["experts"] = double(c.experts);
  state.counters["peak_MiB"] = peak;
  state.counters["before_model_MiB"] = before;
  state.counters["params_MiB"] = params;
  state.counters["grads_MiB"] = grads;
  state.counters["optimizer_MiB"] = optimizer;
  state.counters["rest_MiB"] = peak - before - params - grads - optimizer;
  state.counters["activations_MiB"] = most(activations);
}

// remat/blocks:0|8 — the trainer's model at 8 blocks, no block or every
// block rematerialised (config::remat): step time, the peak resident memory
// per rank over what the process held before the model, and its part that
// is not parameters, gradients or Adam's state (VmHWM reset at the
// start, one invocation of 8 steps: run it alone per process, as
// scripts/remat does), and the FLOPs
// recomputed in the backward as a share of the model's.
void remat(benchmark::State& state) {
  if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) std::fputs("5", f), std::fclose(f);
  const double before = gshard::bench::max_over_ranks(status_mib("VmRSS:"));
  model::config c = trainer_config();
  c.layers = 8;
  for (int l = 0; l < int(state.range(0)); ++l) c.remat.push_back(l);
  trainer b(c);
  b.step();
  b.step();
  double total = 0;
  const double f0 = model_flops(), r0 = recomputed_flops();
  for (auto _ : state) {
    const double t = gshard::bench::slowest([&] { b.step(); });
    total += t;
    state.SetIterationTime(t);
  }
  const double n = double(state.iterations());
  auto most = [](double v) { return gshard::bench::max_over_ranks(v); };
  const double peak = most(status_mib("VmHWM:")) - before;
  const double state_mib = most(local_mib(b.ps.values()) + local_mib(b.ps.grads()) + double(b.opt.state_bytes()) / (1024.0 * 1024.0));
  state.counters["step_ms"] = 1e3 * total / n;
  state.counters["peak_MiB"] = peak;
  state.counters["params+grads+adam_MiB"] = state_mib;
  state.counters["rest_MiB"] = peak - state_mib;
  state.counters["recomputed/model_flops"] = (recomputed_flops() - r0) / (model_flops() - f0);
}

// remat_vs_kept: the step at 8 blocks with every block rematerialised over
// the one that keeps them, interleaved step by step (the median ratio).
void remat_vs_kept(benchmark::State& state) {
  model::config c = trainer_config();
  c.layers = 8;
  trainer kept(c);
  c.remat = {0, 1, 2, 3, 4, 5, 6, 7};
  trainer re(c);
  const auto r = gshard::bench::compare(state, {[&] { kept.step(); }, [&] { re.step(); }}, 1);
  state.counters["kept_ms"] = 1e3 * r.median_time[0];
  state.counters["remat_ms"] = 1e3 * r.median_time[1];
  state.counters["remat/kept"] = r.median_ratio[1];
}

// cost_model: the cost model's prediction of the trainer's step
// (gshard/model/cost.hpp), from this machine measured in the same run,
// against the step measured. Measured: each einsum of the step (forward and
// both gradients) by gshard's local einsum kernel on this rank's extents;
// element-wise work by its three classes — a triad on 2 MiB arrays (the
// attention's scores here), gshard's row softmax, gshard's Adam; each
// collective's α and β over the world (gshard's own collectives at 64 KiB
// and 4 MiB, median of 9). The slowest rank's figure each time.
// predicted/measured is the figure; the parts say where it differs.
namespace costs = gshard::model::cost;

void cost_model(benchmark::State& state) {
  trainer b(true);  // the trainer's default: the sharded weight update
  const costs::mesh_sizes ms{b.m.size(0), b.m.size(1), 1, false};
  const auto work = costs::count_step(b.c, ms, {16, 128, true, int(sizeof(float))});
  const costs::machine mc = costs::measure_machine(world_group());
  std::vector<double> einsum_s;
  for (const auto& e : work.einsums) einsum_s.push_back(costs::einsum_seconds(e));
  const auto p = costs::predict(work, ms, mc, [&](const costs::einsum_work& e) {
    return gshard::bench::max_over_ranks(einsum_s[std::size_t(&e - work.einsums.data())]);
  });
  b.step();
  b.step();
  std::vector<double> times;
  for (auto _ : state) {
    const double t = gshard::bench::slowest([&] { b.step(); });
    times.push_back(t);
    state.SetIterationTime(t);
  }
  const double measured = gshard::bench::median(times);
  state.counters["measured_ms"] = 1e3 * measured;
  state.counters["predicted_ms"] = 1e3 * p.total_s();
  state.counters["predicted/measured"] = p.total_s() / measured;
  state.counters["gemm_ms"] = 1e3 * p.gemm_s;
  state.counters["elementwise_ms"] = 1e3 * p.elementwise_s;
  state.counters["communication_ms"] = 1e3 * p.communication_s;
  state.counters["elementwise_GB/s"] = mc.elementwise_bytes_per_s * 1e-9;
  state.counters["exp_G/s"] = mc.exp_per_s * 1e-9;
  state.counters["adam_G/s"] = mc.adam_elements_per_s * 1e-9;
  if (world_group().size > 1) {
    state.counters["a2a_alpha_us"] = mc.all_to_all.alpha * 1e6, state.counters["a2a_GB/s"] = mc.all_to_all.beta * 1e-9;
    state.counters["ar_alpha_us"] = mc.all_reduce.alpha * 1e6, state.counters["ar_GB/s"] = mc.all_reduce.beta * 1e-9;
  }
}

// The translation model of examples/translate (model/seq2seq.hpp: 2 + 2
// blocks, M=128, 4 heads of 32, H=256, 8 experts in block 1 of each stack,
// dropout and label smoothing 0.1) and a batch of 64 pairs in all, at every rank count
// (sources of 4 to 24 bytes after their language tag, targets of 4 to 24
// bytes; padded as translate pads them).
struct translation {
  using net_t = model::seq2seq<float, grid>;
  static model::seq2seq_config config() {
    model::seq2seq_config c;
    c.vocab = 256 + 30, c.model = 128, c.heads = 4, c.head_dim = 32, c.hidden = 256, c.experts = 8;
    c.encoder_layers = c.decoder_layers = 2, c.max_len = 34, c.gating.capacity_factor = 2.0;
    c.dropout = 0.1, c.label_smoothing = 0.1;
    return c;
  }
  const grid& m = gshard::bench::world_mesh<grid>();
  model::seq2seq_config c = config();
  parameters<grid> ps{m, 1};
  net_t net{ps, c};
  adam opt{{}, ps};
  static constexpr index_t B = 64, S = 25, L = 24;
  // The batch on the host: sources [B, S] (a language tag, then bytes),
  // their lengths, targets [B, L + 2] (bos, bytes, eos, then -1).
  struct host_batch {
    local_tensor<std::int32_t, 2> src{B, S}, tgt{B, L + 2};
    local_tensor<std::int32_t, 1> lengths{B};
    double target_tokens = 0;  // real target tokens (eos included)
  };
  static host_batch make_batch(const model::seq2seq_config& c) {
    host_batch h;
    h.src.setZero(), h.tgt.setConstant(-1);
    for (index_t b = 0; b < B; ++b) {
      const index_t ns = 4 + (b * 7) % 21, nt = 4 + (b * 5) % 21;
      h.lengths(b) = std::int32_t(ns + 1), h.src(b, 0) = std::int32_t(256 + b % 30), h.tgt(b, 0) = c.bos;
      for (index_t i = 1; i <= ns; ++i) h.src(b, i) = std::int32_t(97 + (b + i * 3) % 26);
      for (index_t i = 1; i <= nt; ++i) h.tgt(b, i) = std::int32_t(97 + (b * 2 + i) % 26);
      h.tgt(b, nt + 1) = c.eos;
      h.target_tokens += double(nt + 1);
    }
    return h;
  }
  host_batch host = make_batch(c);
  net_t::tokens_type src = distribute<net_t::tokens_type>(m, host.src), tgt = distribute<net_t::tokens_type>(m, host.tgt);
  net_t::lengths_type lengths = distribute<net_t::lengths_type>(m, host.lengths);
  double target_tokens = host.target_tokens;
  void step(std::uint64_t k) {
    tape t(ps);
    auto out = net.forward(t, src, lengths, tgt, k);
    t.backward(out.loss);
    opt.update(ps);
  }
};

// seq2seq_step: one training step of the translation model (above) at the
// rank count of the run: target tokens/s, and MFU against the FMA peak
// measured in the run, beside the language model's `step`.
void seq2seq_step(benchmark::State& state) {
  translation b;
  b.step(0);  // warm up
  b.step(1);
  std::uint64_t k = 2;
  double total = 0;
  const double flops0 = model_flops();
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    b.step(k++);
    const double t = gshard::bench::max_over_ranks(MPI_Wtime() - t0);
    total += t;
    state.SetIterationTime(t);
  }
  const double n = double(state.iterations()), P = double(b.m.nranks()), step_flops = (model_flops() - flops0) * P / n;
  state.counters["target_tokens/s"] = b.target_tokens * n / total;
  state.counters["step_ms"] = 1e3 * total / n;
  state.counters["model_GFLOP/step"] = step_flops * 1e-9;
  state.counters["mfu"] = step_flops / (total / n) / (P * gshard::bench::fma_peak_gflops() * 1e9);
}

// seq2seq_decode/width:1|4: the translation model decoding the batch's 64
// sources up to 32 bytes each, greedily (width 1) or by beam search of
// width 4, every rank in lockstep with the cache: decoded tokens per second
// (each source's tokens until its end token; beam: the best hypothesis's).
void seq2seq_decode(benchmark::State& state) {
  translation b;
  const int width = int(state.range(0));
  double total = 0, tokens = 0;
  for (auto _ : state) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    const auto out = width == 1 ? b.net.greedy(b.src, b.lengths, 33, 0) : b.net.beam_search(b.src, b.lengths, {width, 0.6, 33}, 0);
    const double t = gshard::bench::max_over_ranks(MPI_Wtime() - t0);
    double mine = 0;
    for (const auto& seq : out) mine += double(seq.size());
    MPI_Allreduce(MPI_IN_PLACE, &mine, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    tokens += mine, total += t;
    state.SetIterationTime(t);
  }
  state.counters["tokens/s"] = tokens / total;
  state.counters["sources/s"] = double(b.B) * double(state.iterations()) / total;
}

const int registered = [] {
  benchmark::RegisterBenchmark("step", step)->ArgName("sharded_update")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_bf16", step_bf16)->MinTime(4)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("gathers_in_flight", gathers_in_flight)->MinTime(4)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("sharded_vs_replicated_update", sharded_vs_replicated_update)
      ->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("bucket_sizes", bucket_sizes)->ArgName("bf16")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_gemms", step_gemms)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("step_memory", step_memory)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("memory_per_rank", memory_per_rank)
      ->ArgNames({"sharded_update", "adafactor", "bf16", "sequences"})
      ->ArgsProduct({{0, 1}, {0, 1}, {0}, {8}})->Args({1, 0, 0, 64})->Args({1, 0, 1, 64})->Iterations(3)
      ->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("remat", remat)->ArgName("blocks")->Arg(0)->Arg(8)->Iterations(8)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("remat_vs_kept", remat_vs_kept)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("cost_model", cost_model)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("seq2seq_step", seq2seq_step)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("seq2seq_decode", seq2seq_decode)->ArgName("width")->Arg(1)->Arg(4)->Iterations(3)
      ->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
