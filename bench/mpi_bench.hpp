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

#include <sys/resource.h>

#include <gshard/kernels/gemm.hpp>
#include <gshard/runtime/environment.hpp>
#include <gshard/runtime/peak.hpp>


namespace gshard::bench {

// This process's minor page faults and peak resident memory so far.
inline long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}
inline double max_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

// The mesh a benchmark program runs on, bound to MPI_COMM_WORLD once.
template <class Mesh>
const Mesh& world_mesh() {
  static const Mesh m(MPI_COMM_WORLD);
  return m;
}

// The fp32 FMA peak of one core (gshard/runtime/peak.hpp), measured once in this run
// over the world: the benchmarks' peak_share is against this.
inline double fma_peak_gflops() {
  static const double peak = measure_fma_peak(world_group());
  return peak;
}

// The bf16 dot-product peak of one core (gshard/runtime/peak.hpp), measured
// once in this run; 0 where this build does not target AVX512_BF16.
inline double bf16_peak_gflops() {
  static const double peak = measure_bf16_peak(world_group());
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
  std::snprintf(peak, sizeof peak, "%.1f GFLOP/s per core (%s, measured in this run)", fma_peak_gflops(), fma_unit());
  benchmark::AddCustomContext("fp32 FMA peak", peak);
  if (bf16_peak_gflops() > 0) {
    std::snprintf(peak, sizeof peak, "%.1f GFLOP/s per core (AVX512_BF16, measured in this run)", bf16_peak_gflops());
    benchmark::AddCustomContext("bf16 dot-product peak", peak);
  }
  benchmark::AddCustomContext("bf16 GEMMs", gshard::detail::gemm_bf16_native() ? "on the CPU's bf16 units (oneDNN)"
                                                                                 : "none here: run in fp32");
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
