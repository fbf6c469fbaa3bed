// bench/bench_moe.cpp — the MoE layer and a Transformer block, forward.
//   scripts/mpirun -np 2 build/bench/bench_moe --benchmark_filter=layer
// Benchmarks layer, block, attention and dispatch: the comment above each
// says what it measures.
#include <gshard/gshard.hpp>
#include <gshard/model/transformer.hpp>

#include "mpi_bench.hpp"

using namespace gshard;
using grid = mesh<axis<"data", 1>, axis<"expert">>;

namespace {


struct moe_setup {
  index_t tokens_per_rank = 4096, S = 1024, M = 512, H = 2048, E = 8;
};

// layer: the reference configuration, 4096 tokens per rank (groups of S=1024),
// M=512, H=2048, E=8, capacity factor 2. Counters: tokens/s per rank; the
// expert FFN's FLOPs per rank over the whole forward's time, in GFLOP/s and
// as a share of the fp32 FMA peak measured in the run (mpi_bench.hpp); and a
// direct GEMM loop over the same expert shapes (preallocated, contiguous)
// measured in the same iterations.
void layer(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  const moe_setup cfgs;
  const index_t P = m.nranks(), G = cfgs.tokens_per_rank / cfgs.S * P, S = cfgs.S, M = cfgs.M, H = cfgs.H, E = cfgs.E;
  moe::gating_config gc;  // capacity factor 2, random second expert
  parameters ps(m, 1);
  const moe::layer<float, grid> p(ps, "moe.", M, H, E);
  named<float, "GSM", grid, moe::layer<float, grid>::at_tokens> x(m, {G, S, M});
  fill_normal(x, 1.0, 2, 3);
  const index_t C = moe::capacity(S, E, gc), El = E / P;
  // The baseline: the expert FFN's two GEMMs per local expert on contiguous buffers.
  const index_t rows = G * C;  // slots per expert after the all_to_all
  std::vector<float> a(std::size_t(rows * M), 0.5f), wi(std::size_t(M * H), 0.01f), h(std::size_t(rows * H)),
      wo(std::size_t(H * M), 0.01f), y(std::size_t(rows * M));
  auto gemms = [&] {
    for (index_t e = 0; e < El; ++e) {
      detail::gemm<float>(false, false, rows, H, M, 1.0f, a.data(), M, wi.data(), H, 0.0f, h.data(), H);
      detail::gemm<float>(false, false, rows, M, H, 1.0f, h.data(), H, wo.data(), M, 0.0f, y.data(), M);
    }
  };
  std::uint64_t step = 0;
  auto fwd = [&] {
    tape t(ps, tape::no_grad);
    benchmark::DoNotOptimize(p(t.constant(x), gc, step++));
  };
  const auto c = gshard::bench::compare(state, {gemms, fwd}, 1);
  const double expert_flop = 4.0 * double(El * rows * M * H);
  state.counters["tokens/s/rank"] = double(cfgs.tokens_per_rank) / c.median_time[1];
  state.counters["expert_gflops"] = expert_flop / c.median_time[1] * 1e-9;
  state.counters["peak_share"] = expert_flop / c.median_time[1] * 1e-9 / gshard::bench::fma_peak_gflops();
  state.counters["gemm_gflops"] = expert_flop / c.median_time[0] * 1e-9;
  state.counters["vs_gemm"] = 1.0 / c.median_ratio[1];
}

// block: one pre-norm Transformer block with an MoE FFN (attention + MoE).
void block(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  model::config c;
  c.model = 512, c.heads = 8, c.head_dim = 64, c.hidden = 2048, c.experts = 8, c.layers = 2;
  const index_t P = m.nranks(), L = 512, B = 4 * P;  // 2048 tokens per rank
  parameters ps(m, 1);
  const model::transformer<float, grid> tr(ps, c);
  const auto& b = tr.blocks()[1];  // the MoE block
  model::transformer<float, grid>::activation x(m, {B, L, c.model});
  fill_normal(x, 1.0, 2, 3);
  std::uint64_t step = 0;
  auto fwd = [&] {
    tape t(ps, tape::no_grad);
    auto y = t.constant(x) + tr.attention(rms_norm(t.constant(x), b.norm1), b.attn);
    auto r = (*b.moe)(relabel<"GSM">(rms_norm(y, b.norm2)), c.gating, step++);
    benchmark::DoNotOptimize(y + relabel<"BLM">(std::move(r.y)));
  };
  const auto cmp = gshard::bench::compare(state, {fwd}, 0);
  state.counters["tokens/s/rank"] = double(B / P * L) / cmp.median_time[0];
}

// attention: the same causal self-attention (4 sequences of 512 per rank,
// M=512, 8 heads of 64) with the batch split over the ranks, and with the
// heads split over a "model" axis instead (every rank sees the whole batch,
// a 1/P share of the heads, and one all_reduce of [B,L,M] per forward).
using heads_grid = mesh<axis<"data", 1>, axis<"expert", 1>, axis<"model">>;

void attention(benchmark::State& state) {
  const grid& mb = gshard::bench::world_mesh<grid>();
  const heads_grid& mh = gshard::bench::world_mesh<heads_grid>();
  model::config c;
  c.model = 512, c.heads = 8, c.head_dim = 64, c.layers = 1;
  const index_t P = mb.nranks(), L = 512, B = 4 * P;
  parameters pb(mb, 1);
  parameters ph(mh, 1);
  const model::transformer<float, grid> tb(pb, c);
  const model::transformer<float, heads_grid> th(ph, c);
  model::transformer<float, grid>::activation xb(mb, {B, L, c.model});
  model::transformer<float, heads_grid>::activation xh(mh, {B, L, c.model});
  fill_normal(xb, 1.0, 2, 3);
  fill_normal(xh, 1.0, 2, 3);
  auto by_batch = [&] {
    tape t(pb, tape::no_grad);
    benchmark::DoNotOptimize(tb.attention(t.constant(xb), tb.blocks()[0].attn));
  };
  auto by_heads = [&] {
    tape t(ph, tape::no_grad);
    benchmark::DoNotOptimize(th.attention(t.constant(xh), th.blocks()[0].attn));
  };
  const auto cmp = gshard::bench::compare(state, {by_batch, by_heads}, 1);
  state.counters["batch_ms"] = 1e3 * cmp.median_time[0];
  state.counters["heads_ms"] = 1e3 * cmp.median_time[1];
  state.counters["heads_vs_batch"] = cmp.median_ratio[1];
}

// dispatch/<form>/<S>: dispatch + combine alone on one rank (E=8, M=512, one
// group): the one-hot einsums against the index form.
void dispatch(benchmark::State& state, bool einsum_form) {
  using one = mesh<axis<"data", 1>, axis<"expert", 1>>;
  static one m(MPI_COMM_SELF);
  const index_t Sg = state.range(0), M = 512, E = 8;
  moe::gating_config gc;
  const index_t C = moe::capacity(Sg, E, gc);
  tensor<float, 3, one, replicate> x(m, {1, Sg, M});
  fill_normal(x, 1.0, 2, 3);
  local_tensor<float, 3> logits(1, Sg, E);
  for (index_t i = 0; i < logits.size(); ++i) logits.data()[i] = float(normal(5, 6, std::uint64_t(i)));
  moe::routing<float> r;
  moe::route_tokens<float>(logits.data(), 1, Sg, E, 0, 0, gc, r);
  tensor<float, 4, one, replicate> combine(m, {1, Sg, E, C}), disp(m, {1, Sg, E, C});
  moe::detail::dense_tensor(r, r.weight.data(), combine.data());
  moe::detail::dense_tensor(r, static_cast<const float*>(nullptr), disp.data());
  tensor<float, 4, one, replicate> xe(m, {E, 1, C, M});
  tensor<float, 3, one, replicate> y(m, {1, Sg, M});
  auto run = [&] {
    if (einsum_form) {
      const auto d = einsum<"GSEC,GSM->EGCM">(disp, x);
      benchmark::DoNotOptimize(einsum<"GSEC,EGCM->GSM">(combine, d));
    } else {
      moe::detail::dispatch_rows(r, x.data(), M, xe.data());
      moe::detail::combine_rows(r, r.weight.data(), xe.data(), M, y.data());
    }
  };
  const auto cmp = gshard::bench::compare(state, {run}, 0);
  state.counters["ms"] = 1e3 * cmp.median_time[0];
}

const int registered = [] {
  benchmark::RegisterBenchmark("layer", layer)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("block", block)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attention", attention)->UseManualTime()->Unit(benchmark::kMillisecond);
  for (bool e : {true, false})
    benchmark::RegisterBenchmark(e ? "dispatch/einsum" : "dispatch/index", dispatch, e)
        ->Arg(256)->Arg(1024)->Arg(4096)->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
