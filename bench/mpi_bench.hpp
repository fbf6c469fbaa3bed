// bench/mpi_bench.hpp — Google Benchmark under mpirun. Every rank runs every
// benchmark; an iteration starts after a barrier and its time is the maximum
// over ranks (manual time), so all ranks see the same times and choose the
// same iteration counts. Rank 0 reports.
#pragma once

#include <benchmark/benchmark.h>

#include <string_view>
#include <vector>

#include <gshard/mpi.hpp>

namespace gshard::bench {

// Times f() as the slowest rank saw it.
template <class F>
void run_timed(benchmark::State& state, F&& f, MPI_Comm comm = MPI_COMM_WORLD) {
  for (auto _ : state) {
    MPI_Barrier(comm);
    const double t0 = MPI_Wtime();
    f();
    const double local = MPI_Wtime() - t0;
    double slowest = 0;
    MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
    state.SetIterationTime(slowest);
  }
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
