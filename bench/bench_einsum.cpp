// bench/bench_einsum.cpp — the local einsum against a direct GEMM on the same
// shapes in the same run, and a distributed matmul whose contracting dim is
// split (all_reduce output versus reduce_scatter output).
//   scripts/mpirun -np 1 build/bench/bench_einsum --benchmark_filter=local
//   scripts/mpirun -np 2 build/bench/bench_einsum --benchmark_filter=matmul_split
// local/<spec>: counters gemm_gflops (the direct GEMM loop: one sgemm per batch
// on contiguous matrices) and speed = gemm time / einsum time (1.0 = as fast).
// gemm_backends/<m>x<n>x<k>: every fp32 GEMM backend of this build and the
// bf16 GEMM (bf16 × bf16 → fp32) on one shape in the same run, as GFLOP/s
// and as fractions of this core's fp32 FMA peak, measured in the run
// (gemm_bf16 through the backend the build chose: oneDNN's bf16 matmul on
// CPUs with bf16 units, else widened to fp32).
//   scripts/mpirun -np 1 build/bench/bench_einsum --benchmark_filter=gemm_backends
// bf16_convert/<KiB>: rounding KiB of fp32 to bf16 and widening it back
// (core/bf16.hpp: every rounded GEMM operand, bf16 message and kept copy
// goes through these), against memcpy of the fp32 bytes in the same
// iterations: GB/s of fp32 each, and memcpy's time over theirs.
//   scripts/mpirun -np 1 build/bench/bench_einsum --benchmark_filter=bf16_convert
#include <gshard/gshard.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mpi_bench.hpp"

using namespace gshard;
using flat = mesh<axis<"x">>;

namespace {

// A GEMM-shaped einsum: labels and extents, and the GEMM it amounts to.
struct gemm_case {
  const char* name;
  index_t batch, m, n, k;  // the equivalent GEMMs: `batch` of (m×k)·(k×n)
};

template <fixed_string Spec, class T, int RA, int RB>
void local(benchmark::State& state, shape<RA> ea, shape<RB> eb, gemm_case g) {
  const flat& mesh = gshard::bench::world_mesh<flat>();
  local_tensor<T, RA> a(ea);
  local_tensor<T, RB> b(eb);
  a.setRandom();
  b.setRandom();
  const auto A = distribute<replicate>(mesh, a);
  const auto B = distribute<replicate>(mesh, b);
  // The baseline: the same GEMMs on contiguous matrices, output preallocated.
  std::vector<T> ga(std::size_t(g.batch * g.m * g.k), T(1)), gb(std::size_t(g.batch * g.k * g.n), T(1)),
      gc(std::size_t(g.batch * g.m * g.n));
  auto gemm = [&] {
    for (index_t i = 0; i < g.batch; ++i)
      detail::gemm<T>(false, false, g.m, g.n, g.k, T(1), ga.data() + i * g.m * g.k, g.k, gb.data() + i * g.k * g.n, g.n,
                      T(0), gc.data() + i * g.m * g.n, g.n);
  };
  auto ein = [&] { benchmark::DoNotOptimize(einsum<Spec>(A, B)); };
  const auto c = gshard::bench::compare(state, {gemm, ein}, 1);
  const double flop = 2.0 * double(g.batch * g.m * g.n * g.k);
  state.counters["gemm_gflops"] = flop / c.median_time[0] * 1e-9;
  state.counters["einsum_gflops"] = flop / c.median_time[1] * 1e-9;
  state.counters["speed"] = 1.0 / c.median_ratio[1];
}

// One shape, every backend: C[m,n] = A[m,k]·B[k,n] in fp32 by Eigen,
// OpenBLAS and oneDNN (those built in), and gemm_bf16 with fp32 output —
// on the bf16 units when oneDNN can, converted to fp32 otherwise.
void gemm_backends(benchmark::State& state, index_t m, index_t n, index_t k) {
  using detail::gemm_kind;
  std::vector<float> a(std::size_t(m * k)), b(std::size_t(k * n)), c(std::size_t(m * n));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = float(i % 7) * 0.25f - 0.5f;
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = float(i % 5) * 0.25f - 0.5f;
  std::vector<Eigen::bfloat16> a16(a.size()), b16(b.size());
  std::transform(a.begin(), a.end(), a16.begin(), [](float x) { return Eigen::bfloat16(x); });
  std::transform(b.begin(), b.end(), b16.begin(), [](float x) { return Eigen::bfloat16(x); });
  const std::vector<gemm_kind> fp32 = detail::gemm_kinds();
  const int chosen = detail::options().gemm;
  std::vector<std::function<void()>> forms;
  for (const gemm_kind kind : fp32)
    forms.push_back([&, kind] {
      detail::options().gemm = int(kind);
      detail::gemm<float>(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
    });
  forms.push_back([&] {
    detail::options().gemm = chosen;
    detail::gemm_bf16<float>(false, false, m, n, k, 1.0f, a16.data(), k, b16.data(), n, 0.0f, c.data(), n);
  });
  const auto cmp = gshard::bench::compare(state, forms, 0);
  detail::options().gemm = chosen;
  static const double peak = measure_fma_peak(world_group());
  const double flop = 2.0 * double(m * n * k);
  double best32 = 0;
  for (std::size_t i = 0; i < fp32.size(); ++i) {
    const double g = flop / cmp.median_time[i] * 1e-9;
    const std::string name = detail::gemm_name(fp32[i]);
    state.counters[name + "_gflops"] = g;
    state.counters[name + "/peak"] = g / peak;
    best32 = std::max(best32, g);
  }
  const double g16 = flop / cmp.median_time.back() * 1e-9;
  state.counters["bf16_gflops"] = g16;
  state.counters["bf16/peak"] = g16 / peak;
  state.counters["bf16/best_fp32"] = g16 / best32;
  state.SetLabel(detail::gemm_bf16_native() ? "bf16 on the bf16 units (oneDNN)" : "bf16 converted to fp32");
}

void bf16_convert(benchmark::State& state) {
  const std::size_t n = std::size_t(state.range(0)) * 1024 / sizeof(float);
  std::vector<float> f(n), back(n);
  std::vector<bf16> h(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = float(i % 1000) * 1.37e-3f - 0.6f;
  const auto c = gshard::bench::compare(
      state,
      {[&] { std::memcpy(back.data(), f.data(), n * sizeof(float)); }, [&] { detail::to_bf16(f.data(), n, h.data()); },
       [&] { detail::from_bf16(h.data(), n, back.data()); }},
      1);
  const double bytes = double(n * sizeof(float));
  state.counters["memcpy_GBps"] = bytes / c.median_time[0] * 1e-9;
  state.counters["to_bf16_GBps"] = bytes / c.median_time[1] * 1e-9;
  state.counters["from_bf16_GBps"] = bytes / c.median_time[2] * 1e-9;
  state.counters["to_bf16_vs_memcpy"] = 1.0 / c.median_ratio[1];
  state.counters["from_bf16_vs_memcpy"] = 1.0 / c.median_ratio[2];
#ifdef GSHARD_BF16_CONVERT_INSTRUCTION
  state.SetLabel("to_bf16 on VCVTNE2PS2BF16");
#else
  state.SetLabel("to_bf16 in a vector loop");
#endif
}

// ij,jk->ik with j split over every rank: the partial product is summed by an
// all_reduce into a replicated output, or by a reduce_scatter into rows.
void matmul_split(benchmark::State& state) {
  const flat& mesh = gshard::bench::world_mesh<flat>();
  const index_t n = state.range(0);
  using cols = sharding<split<1, "x">>;
  using rows = sharding<split<0, "x">>;
  local_tensor<float, 2> a(n, n), b(n, n);
  a.setRandom();
  b.setRandom();
  const auto A = distribute<cols>(mesh, a);
  const auto B = distribute<rows>(mesh, b);
  auto reduce = [&] { benchmark::DoNotOptimize(einsum<"ij,jk->ik", replicate>(A, B)); };
  auto scatter = [&] { benchmark::DoNotOptimize(einsum<"ij,jk->ik", rows>(A, B)); };
  auto natural = [&] { benchmark::DoNotOptimize(einsum<"ij,jk->ik">(A, B)); };
  const auto c = gshard::bench::compare(state, {reduce, scatter, natural}, 1);
  state.counters["all_reduce_ms"] = 1e3 * c.median_time[0];
  state.counters["reduce_scatter_ms"] = 1e3 * c.median_time[1];
  state.counters["local_only_ms"] = 1e3 * c.median_time[2];
  state.counters["rs/ar"] = c.median_ratio[1];
}

const int registered = [] {
  auto reg = [](const char* name, auto fn) {
    benchmark::RegisterBenchmark(name, fn)->UseManualTime()->Unit(benchmark::kMillisecond);
  };
  reg("local/ij,jk->ik/f32/512", [](benchmark::State& s) { local<"ij,jk->ik", float, 2, 2>(s, {512, 512}, {512, 512}, {"", 1, 512, 512, 512}); });
  reg("local/ij,jk->ik/f32/1024", [](benchmark::State& s) { local<"ij,jk->ik", float, 2, 2>(s, {1024, 1024}, {1024, 1024}, {"", 1, 1024, 1024, 1024}); });
  reg("local/ij,jk->ik/f64/512", [](benchmark::State& s) { local<"ij,jk->ik", double, 2, 2>(s, {512, 512}, {512, 512}, {"", 1, 512, 512, 512}); });
  reg("local/ji,jk->ik/f32/512", [](benchmark::State& s) { local<"ji,jk->ik", float, 2, 2>(s, {512, 512}, {512, 512}, {"", 1, 512, 512, 512}); });
  reg("local/ij,kj->ik/f32/512", [](benchmark::State& s) { local<"ij,kj->ik", float, 2, 2>(s, {512, 512}, {512, 512}, {"", 1, 512, 512, 512}); });
  reg("local/bij,bjk->bik/f32/8x256", [](benchmark::State& s) { local<"bij,bjk->bik", float, 3, 3>(s, {8, 256, 256}, {8, 256, 256}, {"", 8, 256, 256, 256}); });
  // MoE expert FFN: E=4 experts, G·C = 2·128 = 256 slots, M=512, H=1024.
  reg("local/EGCM,EMH->EGCH/f32", [](benchmark::State& s) { local<"EGCM,EMH->EGCH", float, 4, 3>(s, {4, 2, 128, 512}, {4, 512, 1024}, {"", 4, 256, 1024, 512}); });
  reg("local/EGCH,EHM->EGCM/f32", [](benchmark::State& s) { local<"EGCH,EHM->EGCM", float, 4, 3>(s, {4, 2, 128, 1024}, {4, 1024, 512}, {"", 4, 256, 512, 1024}); });
  // Attention: B=2, L=T=256, M=512, N=4 heads, K=64 (projections); B=1, N=2, L=T=512, K=256 (logits, mixing).
  reg("local/BLM,MNK->BLNK/f32", [](benchmark::State& s) { local<"BLM,MNK->BLNK", float, 3, 3>(s, {2, 256, 512}, {512, 4, 64}, {"", 1, 512, 256, 512}); });
  reg("local/BLNK,BTNK->BNLT/f32", [](benchmark::State& s) { local<"BLNK,BTNK->BNLT", float, 4, 4>(s, {1, 512, 2, 256}, {1, 512, 2, 256}, {"", 2, 512, 512, 256}); });
  reg("local/BNLT,BTNK->BLNK/f32", [](benchmark::State& s) { local<"BNLT,BTNK->BLNK", float, 4, 4>(s, {1, 2, 512, 512}, {1, 512, 2, 256}, {"", 2, 512, 256, 512}); });
  reg("local/BLNK,NKM->BLM/f32", [](benchmark::State& s) { local<"BLNK,NKM->BLM", float, 4, 3>(s, {2, 256, 4, 64}, {4, 64, 512}, {"", 1, 512, 512, 256}); });
  // The trainer's and the MoE benchmark's GEMMs (tokens × M × H, the
  // expert FFNs, the unembedding) and attention's K = 32 blocks.
  for (const auto& [m, n, k] : std::vector<std::array<index_t, 3>>{{1024, 128, 128}, {2048, 512, 128}, {2048, 128, 512},
                                                                    {2048, 256, 128}, {4096, 2048, 512}, {4096, 512, 2048},
                                                                    {512, 512, 32}, {512, 32, 512}})
    reg(("gemm_backends/" + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k)).c_str(),
        [m = m, n = n, k = k](benchmark::State& s) { gemm_backends(s, m, n, k); });
  benchmark::RegisterBenchmark("bf16_convert", bf16_convert)->ArgName("KiB")->Arg(256)->Arg(16384)->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("matmul_split", matmul_split)->Arg(1024)->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
