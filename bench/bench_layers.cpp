// bench/bench_layers.cpp — the MoE layer and attention alone: forward (layer,
// block, attention, dispatch), forward plus backward (moe_layer,
// moe_layer_uneven, moe_layer_bf16, attention_forms, moe_overlap) and decoding (decode), each against a
// baseline run in the same iterations; the comment above each says what it
// measures.
//   scripts/mpirun -np 2 build/bench/bench_layers --benchmark_filter=moe_layer
#include <gshard/gshard.hpp>
#include <gshard/model/seq2seq.hpp>
#include <gshard/model/transformer.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

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
  const index_t C = moe::capacity(S, E, gc), El = p.expert_ffn.w1.value().local_extents()[0];  // this rank's experts
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

// The MoE layer in its reference configuration (4096 tokens per rank,
// M=512, H=2048, E=8, capacity factor 2), forward plus backward on a tape.
struct moe_layer_run {
  const grid& m = gshard::bench::world_mesh<grid>();
  using L = moe::layer<float, grid>;
  static constexpr index_t S = 1024, M = 512, H = 2048;
  index_t E = 8, P = m.nranks(), G = 4 * P;
  moe::gating_config gc;
  parameters<grid> ps{m, 1};
  L layer{ps, "moe.", M, H, E};
  named<float, "GSM", grid, L::at_tokens> x{m, {G, S, M}};
  std::uint64_t s = 0;
  explicit moe_layer_run(index_t experts = 8, moe::layer_options o = {}) : E(experts), layer(ps, "moe.", M, H, experts, o) {
    fill_normal(x, 1.0, 2, 3);
  }
  void operator()() {
    tape t(ps);
    auto out = layer(t.constant(x), gc, s++);
    // <y, x>: the backward receives x as the output's gradient.
    auto l = reshard<replicate>(einsum<"GSM,GSM->">(relabel<"">(std::move(out.y)), t.constant(relabel<"">(x))));
    t.backward(l);
  }
  // This rank's experts: E / P, or where P does not divide E, 3, 3 or 2 of 8 on 3 ranks.
  index_t local_experts() const { return layer.expert_ffn.w1.value().local_extents()[0]; }
  index_t slot_rows() const { return G * moe::capacity(S, E, gc); }  // per expert on a rank
  // The experts' FFN FLOPs on a rank: forward 2 GEMMs, backward 4.
  double expert_flop() const { return 3.0 * 4.0 * double(local_experts() * slot_rows() * M * H); }
  // The same averaged over the ranks: the work the step needs, with no rank idle.
  double mean_expert_flop() const { return 3.0 * 4.0 * double(E * slot_rows() * M * H) / double(P); }
};

// moe_layer: the MoE layer alone, forward plus backward: expert-FFN
// GFLOP/s (6 GEMMs per expert), and the same GEMMs called directly in the
// same iterations: of_gemm_rate, the median ratio of the GEMMs' time to
// the layer's (1: the layer costs only its GEMMs).
void moe_layer(benchmark::State& state) {
  moe_layer_run fwd_bwd;
  constexpr index_t M = moe_layer_run::M, H = moe_layer_run::H;
  // The same expert GEMMs called directly on preallocated buffers: per
  // expert on this rank, x [GC,M]·wi [M,H], h·wo [H,M]; the backward's
  // dh = dy·woᵀ, dwo = hᵀ·dy, dx = dh·wiᵀ, dwi = xᵀ·dh.
  const index_t R = fwd_bwd.slot_rows(), El = fwd_bwd.local_experts();
  std::vector<float> bx(std::size_t(R * M), 0.5f), bh(std::size_t(R * H), 0.25f), by(std::size_t(R * M)), bdh(std::size_t(R * H)),
      bdx(std::size_t(R * M)), bwi(std::size_t(M * H), 0.01f), bwo(std::size_t(H * M), 0.01f), bdwi(std::size_t(M * H)),
      bdwo(std::size_t(H * M));
  auto gemms = [&] {
    using gshard::detail::gemm;
    for (index_t e = 0; e < El; ++e) {
      gemm<float>(false, false, R, H, M, 1.f, bx.data(), M, bwi.data(), H, 0.f, bh.data(), H);
      gemm<float>(false, false, R, M, H, 1.f, bh.data(), H, bwo.data(), M, 0.f, by.data(), M);
      gemm<float>(false, true, R, H, M, 1.f, by.data(), M, bwo.data(), M, 0.f, bdh.data(), H);
      gemm<float>(true, false, H, M, R, 1.f, bh.data(), H, by.data(), M, 0.f, bdwo.data(), M);
      gemm<float>(false, true, R, M, H, 1.f, bdh.data(), H, bwi.data(), H, 0.f, bdx.data(), M);
      gemm<float>(true, false, M, H, R, 1.f, bx.data(), M, bdh.data(), H, 0.f, bdwi.data(), H);
    }
  };
  fwd_bwd();
  fwd_bwd();  // steady state: the heap holds every buffer size once
  gemms();
  const long f0 = gshard::bench::minor_faults();
  const auto c = gshard::bench::compare(state, {std::ref(fwd_bwd), gemms}, 0);
  const double faults = gshard::bench::max_over_ranks(double(gshard::bench::minor_faults() - f0)) / double(state.iterations());
  const double expert_flop = fwd_bwd.expert_flop();
  state.counters["expert_gflops"] = expert_flop / c.median_time[0] * 1e-9;
  state.counters["gemm_gflops"] = expert_flop / c.median_time[1] * 1e-9;
  state.counters["of_gemm_rate"] = c.median_ratio[1];  // the layer's expert GFLOP/s over the direct GEMMs'
  state.counters["peak_share"] = expert_flop / c.median_time[0] * 1e-9 / gshard::bench::fma_peak_gflops();
  state.counters["page_faults/iter"] = faults;
}

// moe_layer_uneven/E: the cost of experts that do not divide over the
// ranks. The layer with E experts, and with P·ceil(E/P) (the same expert
// work in all, spread evenly: for E = 8, 9 at 3 ranks and 12 at 6; for
// E = 5, 6 at 2 ranks), interleaved in the same iterations. Where E does
// not divide, the busiest rank holds ceil(E/P) experts, more than the mean
// E/P, and the others wait for it: vs_even, the median ratio of the E
// experts' time to the even layer's, against busiest_over_mean, the ratio
// of the busiest rank's expert FLOPs to the mean's that the rule predicts
// (1 where P divides E). useful_gflops: the mean expert FLOPs a rank needs
// over the E-expert layer's time. Meaningful with a core per rank: ranks
// sharing cores hand a waiting rank's core to the busy ones.
void moe_layer_uneven(benchmark::State& state) {
  const index_t P = gshard::bench::world_mesh<grid>().nranks(), E = state.range(0);
  moe_layer_run uneven(E), even(P * ((E + P - 1) / P));
  const auto c = gshard::bench::compare(state, {std::ref(uneven), std::ref(even)}, 0);
  const double busiest = gshard::bench::max_over_ranks(uneven.expert_flop());
  state.counters["vs_even"] = 1.0 / c.median_ratio[1];
  state.counters["busiest_over_mean"] = busiest / uneven.mean_expert_flop();
  state.counters["even_experts"] = double(even.E);
  state.counters["useful_gflops"] = uneven.mean_expert_flop() / c.median_time[0] * 1e-9;
  state.counters["even_gflops"] = even.mean_expert_flop() / c.median_time[1] * 1e-9;
}

// moe_layer_bf16: moe_layer's forward plus backward with fp32 GEMMs, with
// matmul_precision::bf16 (the router still fp32), and with bf16 GEMMs and
// bf16 all_to_alls (layer_options::all_to_all_wire = wire::bf16), interleaved
// in the same iterations: bf16_speedup, the fp32 time over the bf16 GEMMs'
// one, and wire_speedup over the bf16 GEMMs and all_to_alls' one; each
// one's expert GFLOP/s, against the fp32 FMA peak and the bf16
// dot-product peak measured in the run (0 where this build does not
// target AVX512_BF16). Where the GEMM has no bf16 units, bf16 GEMMs run
// in fp32 and bf16_speedup is 1 but for noise (GSHARD_GEMM=openblas shows
// it); the all_to_alls still halve their bytes. Fourth, the same with only
// the filled capacity slots on the wire (wire::bf16 | wire::trimmed):
// trimmed_vs_wire, the bf16 all_to_alls' time over the trimmed ones' (above
// 1: trimming saves more than its scans and ragged messages cost), and
// trimmed_speedup against fp32. At least 4 s: the median needs several
// iterations.
void moe_layer_bf16(benchmark::State& state) {
  moe_layer_run f32, bf16, bf16_wire(8, moe::layer_options{.all_to_all_wire = wire::bf16}),
      trimmed(8, moe::layer_options{.all_to_all_wire = wire::bf16 | wire::trimmed});
  auto in_bf16 = [&](moe_layer_run& run) {
    return [&] {
      const matmul_precision_scope s(matmul_precision::bf16);
      run();
    };
  };
  const auto c = gshard::bench::compare(state, {std::ref(f32), in_bf16(bf16), in_bf16(bf16_wire), in_bf16(trimmed)}, 1);
  const double flop = f32.expert_flop();
  state.counters["bf16_speedup"] = 1.0 / c.median_ratio[1];
  state.counters["wire_speedup"] = 1.0 / c.median_ratio[2];
  state.counters["trimmed_speedup"] = 1.0 / c.median_ratio[3];
  state.counters["trimmed_vs_wire"] = c.median_ratio[2] / c.median_ratio[3];
  state.counters["f32_expert_gflops"] = flop / c.median_time[0] * 1e-9;
  state.counters["bf16_expert_gflops"] = flop / c.median_time[1] * 1e-9;
  state.counters["f32_fma_peak_share"] = flop / c.median_time[0] * 1e-9 / gshard::bench::fma_peak_gflops();
  if (const double peak = gshard::bench::bf16_peak_gflops(); peak > 0)
    state.counters["bf16_peak_share"] = flop / c.median_time[1] * 1e-9 / peak;
  state.counters["bf16_units"] = gshard::detail::gemm_bf16_native() ? 1 : 0;
}

// attention_forms: the trainer's causal self-attention alone (8 sequences of 128
// per rank, 4 heads of 32), forward plus backward on a tape, four forms
// interleaved iteration by iteration: causal_attention (blocks of rows),
// the einsums around causal_softmax it replaced, the dense GEMMs of the
// einsums called directly (per sequence and head, QKᵀ, PV and the four of
// the backward; no softmax), and causal_attention computing its
// probabilities again in the backward. Counters: each form's time, the
// ratios to causal_attention's (einsums_ratio > 1: the einsums are slower;
// of_gemm_rate > 1: causal_attention beats the dense GEMMs alone, by not
// computing the columns no row of a block sees; recompute_ratio: the cost of
// attention_memory::recompute_probabilities), and GFLOP/s of the dense
// einsums' FLOPs (model FLOPs) over causal_attention's time. Also
// interleaved: causal_attention in blocks of 32, 64 and 128 rows
// (rows32_ratio …: their time over that of the block this backend chooses,
// detail::attention_block_rows). bf16:1 runs all of it under
// matmul_precision::bf16 (the fp32 forms where the CPU has no bf16 units).
void attention_forms(benchmark::State& state) {
  const matmul_precision_scope precision(state.range(0) ? matmul_precision::bf16 : matmul_precision::f32);
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t P = m.nranks(), B = 8, L = 128, N = 4, K = 32;
  using bt = sharding<split<0, "expert">>;
  parameters ps(m, 1);
  param<tensor<float, 4, grid, bt, "BLNK">> q(ps, "q", {B * P, L, N, K}, init::normal(1.0));
  param<tensor<float, 4, grid, bt, "BTNK">> k(ps, "k", {B * P, L, N, K}, init::normal(1.0)), v(ps, "v", {B * P, L, N, K}, init::normal(1.0));
  tensor<float, 4, grid, bt, "BLNK"> dy(m, {B * P, L, N, K});
  fill_normal(dy, 1.0, 2, 3);
  const double scale = 1.0 / std::sqrt(double(K));
  enum form { fused, recomputing, composed };
  auto run = [&](form f, index_t rows = 0) {
    const gshard::detail::attention_block_scope blocks(rows);
    tape t(ps);
    auto o = f == fused         ? causal_attention(t.use(q), t.use(k), t.use(v), scale)
             : f == recomputing ? causal_attention(t.use(q), t.use(k), t.use(v), scale, attention_memory::recompute_probabilities)
                                : relabel<"BLNK">(einsum<"BNLT,BTNK->BLNK">(
                                      causal_softmax(einsum<"BLNK,BTNK->BNLT">(t.use(q), t.use(k)), scale), t.use(v)));
    t.backward(reshard<replicate>(einsum<"BLNK,BLNK->">(o, t.constant(dy))));  // dy is the output's gradient
  };
  const index_t ld = N * K;
  std::vector<float> bq(std::size_t(B * L * ld), 0.5f), bk(bq), bv(bq), bo(bq.size()), bdo(bq), bdq(bq.size()), bdk(bq.size()),
      bdv(bq.size()), bp(std::size_t(B * N * L * L), 0.01f), bg(bp);
  auto gemms = [&] {
    using gshard::detail::gemm;
    for (index_t b = 0; b < B; ++b)
      for (index_t n = 0; n < N; ++n) {
        const index_t a = b * L * ld + n * K;
        float *p = bp.data() + (b * N + n) * L * L, *g = bg.data() + (b * N + n) * L * L;
        gemm<float>(false, true, L, L, K, 1.f, bq.data() + a, ld, bk.data() + a, ld, 0.f, p, L);
        gemm<float>(false, false, L, K, L, 1.f, p, L, bv.data() + a, ld, 0.f, bo.data() + a, ld);
        gemm<float>(false, true, L, L, K, 1.f, bdo.data() + a, ld, bv.data() + a, ld, 0.f, g, L);
        gemm<float>(true, false, L, K, L, 1.f, p, L, bdo.data() + a, ld, 0.f, bdv.data() + a, ld);
        gemm<float>(false, false, L, K, L, 1.f, g, L, bk.data() + a, ld, 0.f, bdq.data() + a, ld);
        gemm<float>(true, false, L, K, L, 1.f, g, L, bq.data() + a, ld, 0.f, bdk.data() + a, ld);
      }
  };
  const auto c = gshard::bench::compare(state,
                                        {[&] { run(fused); }, [&] { run(composed); }, gemms, [&] { run(recomputing); },
                                         [&] { run(fused, 32); }, [&] { run(fused, 64); }, [&] { run(fused, 128); }},
                                        0);
  const double flop = 3.0 * 2.0 * 2.0 * double(B * N * L * L * K);  // the two einsums, forward and backward
  state.counters["fused_ms"] = c.median_time[0] * 1e3;
  state.counters["einsums_ms"] = c.median_time[1] * 1e3;
  state.counters["gemms_ms"] = c.median_time[2] * 1e3;
  state.counters["einsums_ratio"] = c.median_ratio[1];
  state.counters["of_gemm_rate"] = c.median_ratio[2];
  state.counters["recompute_ratio"] = c.median_ratio[3];
  state.counters["rows"] = double(gshard::detail::attention_block_rows<float>());
  state.counters["rows32_ratio"] = c.median_ratio[4];
  state.counters["rows64_ratio"] = c.median_ratio[5];
  state.counters["rows128_ratio"] = c.median_ratio[6];
  state.counters["gflops"] = flop / c.median_time[0] * 1e-9;
  state.counters["peak_share"] = flop / c.median_time[0] * 1e-9 / gshard::bench::fma_peak_gflops();
}

// moe_overlap: the MoE layer of moe_layer (4096 tokens per rank, M=512,
// H=2048, E=8), forward plus backward, with its all_to_alls pipelined with
// the experts in 1 (none), 2, 4 and 8 chunks of the capacity
// (layer_options::overlap_degree), interleaved iteration by iteration:
// each degree's time, its ratio to one chunk, and the time the slowest rank
// spent in the all_to_alls' MPI calls (posting, tests, waits: what the
// pipeline left exposed). Over shared memory the
// all_to_alls are short and chunks cost smaller GEMMs; over a slow link
// (scripts/multihost --link-rate 1gbit) chunks hide them behind the experts.
void moe_overlap(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t P = m.nranks(), S = 1024, G = 4 * P, M = 512, H = 2048, E = 8;
  const int degrees[] = {1, 2, 4, 8};
  moe::gating_config gc;
  using L = moe::layer<float, grid>;
  std::vector<std::unique_ptr<parameters<grid>>> pss;
  std::vector<std::unique_ptr<L>> layers;
  named<float, "GSM", grid, L::at_tokens> x(m, {G, S, M});
  fill_normal(x, 1.0, 2, 3);
  const auto dy = relabel<"">(named<float, "GSM", grid, L::at_tokens>(x));
  std::vector<std::function<void()>> runs;
  std::vector<double> a2a_s(std::size(degrees)), a2a_n(std::size(degrees));  // time in the all_to_alls' MPI calls
  for (int k : degrees) {
    pss.push_back(std::make_unique<parameters<grid>>(m, 1));
    moe::layer_options o;
    o.overlap_degree = k;
    layers.push_back(std::make_unique<L>(*pss.back(), "moe.", M, H, E, o));
    runs.push_back([&, i = runs.size(), ps = pss.back().get(), layer = layers.back().get(), s = std::uint64_t(0)]() mutable {
      const double a0 = collective_seconds(collective::all_to_all);
      tape t(*ps);
      auto out = (*layer)(t.constant(x), gc, s++);
      auto l = reshard<replicate>(einsum<"GSM,GSM->">(relabel<"">(std::move(out.y)), t.constant(dy)));
      t.backward(l);
      a2a_s[i] += collective_seconds(collective::all_to_all) - a0, a2a_n[i] += 1;
    });
  }
  const auto c = gshard::bench::compare(state, runs, 0);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const std::string k = std::to_string(degrees[i]);
    state.counters["chunks" + k + "_ms"] = 1e3 * c.median_time[i];
    state.counters["chunks" + k + "_a2a_ms"] = 1e3 * gshard::bench::max_over_ranks(a2a_s[i] / a2a_n[i]);
    if (i > 0) state.counters["chunks" + k + "/chunks1"] = c.median_ratio[i];
  }
}

// decode: an MoE encoder–decoder (model/seq2seq.hpp: 2 + 2 blocks, M=64,
// H=256, 8 experts, causal routing) decoding n positions for 4 sources of
// 32 tokens per rank, with the cache (start_decoding, then one decode_step
// per position: the encoder once, each position's keys appended) against
// recomputing the prefix (the whole forward over positions 0..t for each t,
// as decoding without a cache does), interleaved. Counters: the decoded
// tokens per second of each, and recompute/cache, the cache's speed-up.
void decode(benchmark::State& state) {
  const grid& m = gshard::bench::world_mesh<grid>();
  const index_t n = state.range(0), P = m.nranks(), B = 4 * P, S = 32;
  using net_t = model::seq2seq<float, grid>;
  model::seq2seq_config c;
  c.vocab = 256, c.model = 64, c.heads = 4, c.head_dim = 16, c.hidden = 256, c.experts = 8, c.max_len = n + 1;
  parameters ps(m, 1);
  const net_t net(ps, c);
  local_tensor<std::int32_t, 2> src(B, S), tgt(B, n + 1);
  local_tensor<std::int32_t, 1> len(B);
  for (index_t i = 0; i < src.size(); ++i) src.data()[i] = std::int32_t(3 + i * 7 % 250);
  for (index_t i = 0; i < tgt.size(); ++i) tgt.data()[i] = std::int32_t(3 + i * 11 % 250);
  len.setConstant(std::int32_t(S));
  const auto s = distribute<net_t::tokens_type>(m, src);
  const auto l = distribute<net_t::lengths_type>(m, len);
  std::vector<net_t::tokens_type> column, prefix;  // made before timing
  for (index_t t = 0; t < n; ++t) {
    local_tensor<std::int32_t, 2> col(B, 1), pre(B, t + 2);
    for (index_t b = 0; b < B; ++b) {
      col(b, 0) = tgt(b, t);
      for (index_t i = 0; i <= t + 1; ++i) pre(b, i) = tgt(b, i);
    }
    column.push_back(distribute<net_t::tokens_type>(m, col));
    prefix.push_back(distribute<net_t::tokens_type>(m, pre));
  }
  const auto cached = [&] {
    auto st = net.start_decoding(s, l, n, 0);
    for (index_t t = 0; t < n; ++t) benchmark::DoNotOptimize(net.decode_step(st, column[std::size_t(t)]));
  };
  const auto recompute = [&] {
    for (index_t t = 0; t < n; ++t) {
      tape tp(ps, tape::no_grad);
      benchmark::DoNotOptimize(net.forward(tp, s, l, prefix[std::size_t(t)], 0).logits);
    }
  };
  const auto c2 = gshard::bench::compare(state, {cached, recompute}, 0);
  state.counters["cache_tokens_per_s"] = double(B * n) / c2.median_time[0];
  state.counters["recompute_tokens_per_s"] = double(B * n) / c2.median_time[1];
  state.counters["recompute/cache"] = c2.median_ratio[1];
}

const int registered = [] {
  benchmark::RegisterBenchmark("layer", layer)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("block", block)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attention", attention)->UseManualTime()->Unit(benchmark::kMillisecond);
  for (bool e : {true, false})
    benchmark::RegisterBenchmark(e ? "dispatch/einsum" : "dispatch/index", dispatch, e)
        ->Arg(256)->Arg(1024)->Arg(4096)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_layer", moe_layer)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_layer_uneven", moe_layer_uneven)->Arg(8)->Arg(5)->MinTime(6)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_layer_bf16", moe_layer_bf16)->MinTime(4)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attention_forms", attention_forms)->ArgName("bf16")->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("moe_overlap", moe_overlap)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode", decode)->Arg(64)->Arg(256)->UseManualTime()->Unit(benchmark::kMillisecond);
  gshard::bench::add_gemm_context();
  return 0;
}();

}  // namespace

int main(int argc, char** argv) { return gshard::bench::main(argc, argv); }
