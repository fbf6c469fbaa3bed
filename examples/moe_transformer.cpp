// examples/moe_transformer.cpp — a byte-level MoE Transformer language model
// partitioned over whatever mesh fits the world (1, 2, 4 or 8 ranks): prints
// the sharding plan of one MoE block, then runs forward passes over text and
// prints the loss, each MoE layer's expert load and dropped tokens, and the
// time per forward.
//   scripts/mpirun -np 2 build/examples/moe_transformer [text file] [forwards]
#include <gshard/gshard.hpp>
#include <gshard/model/transformer.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "meshes.hpp"
using namespace gshard;


namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw error("gshard example: cannot read " + path);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The plan of one MoE block, from the einsum and reshard plans, before anything runs.
template <class Mesh>
void print_block_plan(const Mesh& m, const model::config& c, index_t B, index_t L) {
  using S = moe::shardings<Mesh>;
  using act = model::batch_split<Mesh>;
  using blnk = model::batch_over_model<Mesh, 2>;  // q, k, v, o: heads over "model" if the mesh has it
  using bnlt = model::batch_over_model<Mesh, 1>;  // attention probabilities
  using w_in = model::over_model<Mesh, 1>;        // wq, wk, wv [M,N{model},K]
  using w_out = model::over_model<Mesh, 0>;       // wo [N{model},K,M]
  const index_t M = c.model, N = c.heads, K = c.head_dim, H = c.hidden, E = c.experts;
  const index_t C = moe::capacity(L, E, c.gating);
  std::cout << "Sharding plan of one MoE block on " << m.describe() << " (B=" << B << " L=" << L << " M=" << M
            << " heads=" << N << "x" << K << " E=" << E << " H=" << H << " C=" << C << "):\n"
            << einsum_plan<"BLM,MNK->BLNK", Mesh, act, w_in>::template describe<float>(m, {B, L, M}, {M, N, K})
            << einsum_plan<"BLNK,BTNK->BNLT", Mesh, blnk, blnk>::template describe<float>(m, {B, L, N, K}, {B, L, N, K})
            << einsum_plan<"BNLT,BTNK->BLNK", Mesh, bnlt, blnk>::template describe<float>(m, {B, N, L, L}, {B, L, N, K})
            << einsum_plan<"BLNK,NKM->BLM", Mesh, blnk, w_out, act>::template describe<float>(m, {B, L, N, K}, {N, K, M})
            << einsum_plan<"GSM,ME->GSE", Mesh, act, replicate>::template describe<float>(m, {B, L, M}, {M, E})
            << "dispatch by index (local): x[G,S,M] -> xe " << detail::notation(S::egcm_by_group::spec, 4, "f32", "EGCM")
            << "\n"
            << reshard_plan<Mesh, 4, typename S::egcm_by_group, typename S::by_expert>::template describe<float>(
                   m, {E, B, C, M}, "EGCM")
            << einsum_plan<"EGCM,EMH->EGCH", Mesh, typename S::by_expert, typename S::experts_in>::template describe<float>(
                   m, {E, B, C, M}, {E, M, H})
            << einsum_plan<"EGCH,EHM->EGCM", Mesh, typename S::hidden, typename S::experts_out,
                           typename S::by_expert>::template describe<float>(m, {E, B, C, H}, {E, H, M})
            << reshard_plan<Mesh, 4, typename S::by_expert, typename S::egcm_by_group>::template describe<float>(
                   m, {E, B, C, M}, "EGCM")
            << "combine by index (local): y " << detail::notation(S::egcm_by_group::spec, 4, "f32", "EGCM")
            << " -> [G,S,M]\n\n";
}

template <class Mesh>
int run(const Mesh& m, const std::string& text, int forwards) {
  const bool root = m.rank() == 0;
  model::config c;  // V=256, M=64, 4 heads of 16, H=128, E=8, 4 blocks (MoE in blocks 1 and 3)
  const index_t B = 16, L = 64;  // 16 sequences of 64 bytes per step, split over every axis but "model"
  if (root) print_block_plan(m, c, B, L);
  const auto p = model::init<float>(m, c, 2024);

  for (int step = 0; step < forwards; ++step) {
    // Every rank cuts the same B windows from the text (the root's copy decides).
    local_tensor<std::int32_t, 2> tok(B, L + 1);
    const std::size_t span = text.size() - std::size_t(L) - 1;
    for (index_t b = 0; b < B; ++b) {
      const std::size_t at = (std::size_t(step * B + b) * 7919u * std::size_t(L)) % span;
      for (index_t l = 0; l <= L; ++l) tok(b, l) = std::int32_t(static_cast<unsigned char>(text[at + std::size_t(l)]));
    }
    const auto tokens = distribute<model::batch_split<Mesh>>(m, tok);
    collective_recorder rec;
    MPI_Barrier(m.comm());
    const double t0 = MPI_Wtime();
    const auto [logits, st] = model::forward(tokens, p, c, std::uint64_t(step));
    double dt = MPI_Wtime() - t0, slowest = 0;
    MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, m.comm());
    std::string collectives;
    for (const auto& [k, n] : rec.tally()) collectives += (collectives.empty() ? "" : ", ") + std::to_string(n) + " " + k;
    const auto loss = model::reduce_loss(st, c, m);
    std::vector<moe::gating_stats> layers;
    for (const auto& s : st.moe) layers.push_back(moe::reduce(s, m));
    if (!root) continue;
    std::printf("forward %d: loss %.4f (cross-entropy %.4f, aux %.4f)  %.2f ms  collectives: %s\n", step, loss.total,
                loss.ce, loss.aux, 1e3 * slowest, collectives.c_str());
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const auto& s = layers[i];
      std::printf("  MoE layer %zu: expert load [", 2 * i + 1);
      for (std::size_t e = 0; e < s.expert_load.size(); ++e) std::printf("%s%lld", e ? " " : "", (long long)s.expert_load[e]);
      std::printf("]  overload %.2f  dropped %lld first + %lld second (%.1f%%)  skipped seconds %lld\n", s.overload(),
                  (long long)s.dropped_first, (long long)s.dropped_second, 100.0 * s.dropped_share(),
                  (long long)s.skipped_second);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const std::string path = argc > 1 ? argv[1] : "/usr/share/common-licenses/GPL-3";
  const int forwards = argc > 2 ? std::atoi(argv[2]) : 3;
  const std::string text = read_text(path);
  if (text.size() < 1024) throw error("gshard example: " + path + " holds fewer than 1024 bytes");
  return examples::on_fitting_mesh([&](const auto& m) { return run(m, text, forwards); });
}
