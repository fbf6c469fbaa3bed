// bench/mpi_bench.hpp — Google Benchmark under mpirun. Every rank runs every
// benchmark; an iteration starts after a barrier and its time is the maximum
// over ranks (manual time), so all ranks see the same times and choose the
// same iteration counts. Rank 0 reports.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <gshard/detail/gemm.hpp>
#include <gshard/environment.hpp>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace gshard::bench {

// The mesh a benchmark program runs on, bound to MPI_COMM_WORLD once.
template <class Mesh>
const Mesh& world_mesh() {
  static const Mesh m(MPI_COMM_WORLD);
  return m;
}

namespace detail {
// fp32 FMAs on registers only, for the widest vector unit this build targets:
// 16 independent accumulators (more than FMA latency x ports on current
// x86 cores), no memory traffic. Returns GFLOP/s (2 per lane per FMA).
inline double fma_loop_gflops(long iterations) {
#if defined(__AVX512F__)
  using vec = __m512;
  constexpr int lanes = 16;
  auto fma = [](vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); };
  auto set = [](float v) { return _mm512_set1_ps(v); };
  auto sum = [](vec v) { return _mm512_reduce_add_ps(v); };
#elif defined(__AVX2__) && defined(__FMA__)
  using vec = __m256;
  constexpr int lanes = 8;
  auto fma = [](vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); };
  auto set = [](float v) { return _mm256_set1_ps(v); };
  auto sum = [](vec v) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
  };
#else
  using vec = float;
  constexpr int lanes = 1;
  auto fma = [](vec a, vec b, vec c) { return a * b + c; };
  auto set = [](float v) { return v; };
  auto sum = [](vec v) { return v; };
#endif
  vec acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = set(1.0f + 1e-3f * float(i));
  const vec a = set(0.999999f), b = set(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iterations; ++it) {
    // Unrolled, or GCC keeps acc in memory: one FMA chain through a store
    // (measured: 56 instead of 167 GFLOP/s on an AVX-512 core).
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = fma(acc[i], a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float keep = 0;
  for (int i = 0; i < 16; ++i) keep += sum(acc[i]);
  if (keep == 12345.678f) std::puts("");  // the result is used: the loop is not removed
  return 2.0 * lanes * 16 * double(iterations) / seconds * 1e-9;
}

inline const char* fma_unit() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#else
  return "scalar";
#endif
}
}  // namespace detail

// The fp32 FMA peak of one core as this build can use it, measured in this
// run on every rank at once (each on its core, as the benchmarks run): the
// best of 5 rounds of ~50 ms, the smallest over the ranks. No machine's
// constant: the benchmarks' peak_share is against this.
inline double fma_peak_gflops() {
  static const double peak = [] {
    double best = 0;
    detail::fma_loop_gflops(1 << 20);  // wake the core up
    for (int round = 0; round < 5; ++round) best = std::max(best, detail::fma_loop_gflops(1 << 23));
    return all_reduce(world_group(), best, reduction::min);
  }();
  return peak;
}

// Names the GEMM backend that ran (and OpenBLAS's kernel) in the context
// lines; main() adds the FMA peak measured in the run (MPI must be up).
inline void add_gemm_context() {
  std::string backend = gshard::detail::gemm_backend();
#if defined(GSHARD_USE_OPENBLAS)
  backend += std::string(" (OpenBLAS kernel: ") + openblas_get_corename() + ")";
#endif
  benchmark::AddCustomContext("gemm", backend);
}

// Runs `forms` back to back in every iteration, in rotating order (the first
// after a barrier pays for what the previous one left in the caches), each
// timed as the slowest rank. The iteration time is that of forms[timed].
// Returns per form the median time (s) and the median of its per-iteration
// ratio to forms[0]: one slow iteration does not decide a ratio.
struct comparison {
  std::vector<double> median_time;
  std::vector<double> median_ratio;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

inline double max_over_ranks(double v, MPI_Comm comm = MPI_COMM_WORLD) {
  double m = 0;
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, comm);
  return m;
}

// The time of f() on the slowest rank, started together after a barrier.
inline double slowest(const std::function<void()>& f, MPI_Comm comm = MPI_COMM_WORLD) {
  MPI_Barrier(comm);
  const double t0 = MPI_Wtime();
  f();
  return max_over_ranks(MPI_Wtime() - t0, comm);
}

inline comparison compare(benchmark::State& state, const std::vector<std::function<void()>>& forms, std::size_t timed) {
  for (const auto& f : forms) f();  // warm up: first touch, MPI connections, BLAS buffers
  const std::size_t n = forms.size();
  std::vector<std::vector<double>> times(n), ratios(n);
  std::size_t turn = 0;
  for (auto _ : state) {
    std::vector<double> t(n);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t f = (turn + k) % n;
      t[f] = slowest(forms[f]);
    }
    ++turn;
    for (std::size_t f = 0; f < n; ++f) {
      times[f].push_back(t[f]);
      ratios[f].push_back(t[f] / t[0]);
    }
    state.SetIterationTime(t[timed]);
  }
  comparison c;
  for (std::size_t f = 0; f < n; ++f) {
    c.median_time.push_back(median(times[f]));
    c.median_ratio.push_back(median(ratios[f]));
  }
  return c;
}

class silent_reporter : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

// main() of an MPI benchmark program: registers nothing itself.
inline int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  // Only rank 0 writes --benchmark_out; the others drop those flags.
  std::vector<char*> args(argv, argv + argc);
  if (env.rank() != 0)
    std::erase_if(args, [](const char* a) { return std::string_view(a).starts_with("--benchmark_out"); });
  int n = int(args.size());
  benchmark::Initialize(&n, args.data());
  char peak[96];
  std::snprintf(peak, sizeof peak, "%.1f GFLOP/s per core (%s, measured in this run)", fma_peak_gflops(), detail::fma_unit());
  benchmark::AddCustomContext("fp32 FMA peak", peak);
  if (env.rank() == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    silent_reporter quiet;
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  return 0;
}

}  // namespace gshard::bench
