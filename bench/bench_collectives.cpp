// bench/bench_collectives.cpp — each gshard collective against the raw MPI
// call on the same buffers, 4 KiB to 64 MiB per rank. Each iteration runs the
// forms back to back (raw MPI, gshard buffer collective, gshard tensor
// collective, in rotating order), each after a barrier and timed as the
// slowest rank, so drift and noise hit all forms alike; the counters are
// medians of per-iteration ratios.
//   scripts/mpirun -np 2 build/bench/bench_collectives --benchmark_min_time=0.2
// Counters: mpi_us (raw call), gshard/mpi, tensor/mpi. The tensor form works
// on an lvalue and allocates its result; its all_reduce is therefore out of
// place and is compared with MPI_Allreduce into another buffer.
// bf16_all_reduce, bf16_reduce_scatter: the same element count in fp32 (raw
// MPI and gshard) and in bf16 (gshard's all_to_all and fp32 sum, half the
// bytes); counters f32/mpi and bf16/mpi.
#include <gshard/gshard.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mpi_bench.hpp"

using namespace gshard;
using flat = mesh<axis<"x">>;

namespace {

void bench(benchmark::State& state, collective kind) {
  const flat& m = gshard::bench::world_mesh<flat>();
  const auto& g = m.group<"x">();
  const int P = g.size;
  const std::size_t n = std::size_t(state.range(0)) / sizeof(float);  // elements per rank
  const std::size_t chunk = n / std::size_t(P);
  std::vector<float> send(n, 1.0f), recv(kind == collective::all_gather ? n * std::size_t(P) : n, 0.0f);
  const int right = (g.rank + 1) % P, left = (g.rank + P - 1) % P;
  const MPI_Datatype f32 = MPI_FLOAT;

  using split0 = sharding<split<0, "x">>;
  using part = sharding<partial<"x">>;
  local_tensor<float, 1> global(index_t(n) * (kind == collective::all_gather ? P : 1));
  global.setConstant(1.0f);
  local_tensor<float, 2> global2(P, index_t(n));
  global2.setConstant(1.0f);
  const auto t_part = distribute<part>(m, global);
  const auto t_split = distribute<split0>(m, global);
  const auto t_rows = distribute<split0>(m, global2);

  std::function<void()> raw, buf, ten;
  switch (kind) {
    case collective::all_reduce:
      raw = [&] { MPI_Allreduce(send.data(), recv.data(), int(n), f32, MPI_SUM, g.comm); };  // out of place, like the tensor form
      buf = [&] { all_reduce<float>(g, send, recv); };
      ten = [&] { benchmark::DoNotOptimize(all_reduce<"x">(t_part)); };
      break;
    case collective::all_gather:
      raw = [&] { MPI_Allgather(send.data(), int(n), f32, recv.data(), int(n), f32, g.comm); };
      buf = [&] { all_gather<float>(g, send, recv); };
      ten = [&] { benchmark::DoNotOptimize(all_gather<"x">(t_split)); };
      break;
    case collective::reduce_scatter:
      recv.resize(chunk);
      raw = [&] { MPI_Reduce_scatter_block(send.data(), recv.data(), int(chunk), f32, MPI_SUM, g.comm); };
      buf = [&] { reduce_scatter<float>(g, send, recv); };
      ten = [&] { benchmark::DoNotOptimize(reduce_scatter<"x", 0>(t_part)); };
      break;
    case collective::all_to_all:  // [P, n] split on dim 0 -> dim 1: the same bytes move
      raw = [&] { MPI_Alltoall(send.data(), int(chunk), f32, recv.data(), int(chunk), f32, g.comm); };
      buf = [&] { all_to_all<float>(g, send, recv); };
      ten = [&] { benchmark::DoNotOptimize(all_to_all<"x", 1>(t_rows)); };
      break;
    case collective::permute:
      raw = [&] { MPI_Sendrecv(send.data(), int(n), f32, right, 7, recv.data(), int(n), f32, left, 7, g.comm, MPI_STATUS_IGNORE); };
      buf = [&] { permute<float>(g, send, right, recv, left); };
      break;
    case collective::broadcast:
      raw = [&] { MPI_Bcast(send.data(), int(n), f32, 0, g.comm); };
      buf = [&] { broadcast<float>(g, send, 0); };
      break;
    default: break;
  }
  std::vector<std::function<void()>> forms{raw, buf};
  if (ten) forms.push_back(ten);
  const auto c = gshard::bench::compare(state, forms, 1);
  state.counters["mpi_us"] = 1e6 * c.median_time[0];
  state.counters["gshard/mpi"] = c.median_ratio[1];
  if (ten) state.counters["tensor/mpi"] = c.median_ratio[2];
  state.SetBytesProcessed(state.iterations() * std::int64_t(n * sizeof(float)));
}

// The sums of n elements per rank: MPI's fp32, gshard's fp32 and gshard's bf16.
void bench_bf16(benchmark::State& state, collective kind) {
  const flat& m = gshard::bench::world_mesh<flat>();
  const auto& g = m.group<"x">();
  const std::size_t n = std::size_t(state.range(0)) / sizeof(float), out = kind == collective::all_reduce ? n : n / std::size_t(g.size);
  std::vector<float> send(n, 1.0f), recv(out);
  std::vector<bf16> send16(n, bf16(1.0f)), recv16(out);
  std::function<void()> raw, f32, b16;
  if (kind == collective::all_reduce) {
    raw = [&] { MPI_Allreduce(send.data(), recv.data(), int(n), MPI_FLOAT, MPI_SUM, g.comm); };
    f32 = [&] { all_reduce<float>(g, send, recv); };
    b16 = [&] { all_reduce<bf16>(g, send16, recv16); };
  } else {
    raw = [&] { MPI_Reduce_scatter_block(send.data(), recv.data(), int(out), MPI_FLOAT, MPI_SUM, g.comm); };
    f32 = [&] { reduce_scatter<float>(g, send, recv); };
    b16 = [&] { reduce_scatter<bf16>(g, send16, recv16); };
  }
  const auto c = gshard::bench::compare(state, {raw, f32, b16}, 1);
  state.counters["mpi_us"] = 1e6 * c.median_time[0];
  state.counters["f32/mpi"] = c.median_ratio[1];
  state.counters["bf16/mpi"] = c.median_ratio[2];
  state.SetBytesProcessed(state.iterations() * std::int64_t(n * sizeof(float)));
}

const int registered = [] {
  for (collective kind : {collective::all_reduce, collective::all_gather, collective::reduce_scatter,
                          collective::all_to_all, collective::permute, collective::broadcast}) {
    auto* b = benchmark::RegisterBenchmark(std::string(name_of(kind)).c_str(), bench, kind);
    b->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (std::int64_t bytes = 4 << 10; bytes <= (64 << 20); bytes *= 4) b->Arg(bytes);
  }
  for (collective kind : {collective::all_reduce, collective::reduce_scatter}) {
    auto* b = benchmark::RegisterBenchmark(("bf16_" + std::string(name_of(kind))).c_str(), bench_bf16, kind);
    b->UseManualTime()->Unit(benchmark::kMicrosecond);
    for (std::int64_t bytes = 64 << 10; bytes <= (64 << 20); bytes *= 16) b->Arg(bytes);
  }
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
