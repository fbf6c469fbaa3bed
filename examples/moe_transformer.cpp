// examples/moe_transformer.cpp — a byte-level MoE Transformer language model
// partitioned over the examples' mesh for the world's ranks (examples/meshes.hpp): prints
// the sharding plan of one MoE block, then runs forward passes over text and
// prints the loss, each MoE layer's expert load and dropped tokens, and the
// time per forward.
//   scripts/mpirun -np 2 build/examples/moe_transformer [text file] [forwards]
#include <gshard/gshard.hpp>
#include <gshard/model/transformer.hpp>

#include <cstdio>
#include <iostream>
#include <string>

#include "cli.hpp"
#include "meshes.hpp"
using namespace gshard;


namespace {

// The plan of one MoE block, from the einsum and reshard plans, before anything runs.
template <class Mesh>
void print_block_plan(const Mesh& m, const model::config& c, index_t B, index_t L) {
  using tr = model::transformer<float, Mesh>;
  using tok = typename tr::at_tokens;                          // B, G over data, expert; N, H over model
  using exp = typename tr::roles::at_experts;                  // E over expert, G over data; H over model
  const index_t M = c.model, N = c.heads, K = c.head_dim, H = c.hidden, E = c.experts;
  const index_t C = moe::capacity(L, E, c.gating);
  std::cout << "Sharding plan of one MoE block on " << m.describe() << " (B=" << B << " L=" << L << " M=" << M
            << " heads=" << N << "x" << K << " E=" << E << " H=" << H << " C=" << C << "):\n"
            << "  rules at the tokens:  " << tok::text << "\n  rules at the experts: " << exp::text << "\n"
            << einsum_plan<"BLM,MNK->BLNK", Mesh, sharding_by<tok, "BLM">, sharding_by<tok, "MNK">>::template describe<float>(
                   m, {B, L, M}, {M, N, K})
            << einsum_plan<"BLNK,BTNK->BNLT", Mesh, sharding_by<tok, "BLNK">, sharding_by<tok, "BTNK">>::template describe<
                   float>(m, {B, L, N, K}, {B, L, N, K})
            << einsum_plan<"BNLT,BTNK->BLNK", Mesh, sharding_by<tok, "BNLT">, sharding_by<tok, "BTNK">>::template describe<
                   float>(m, {B, N, L, L}, {B, L, N, K})
            << einsum_plan<"BLNK,NKM->BLM", Mesh, sharding_by<tok, "BLNK">, sharding_by<tok, "NKM">,
                           tok>::template describe<float>(m, {B, L, N, K}, {N, K, M})
            << einsum_plan<"GSM,ME->GSE", Mesh, sharding_by<tok, "GSM">, replicate>::template describe<float>(m, {B, L, M},
                                                                                                             {M, E})
            << "dispatch by index (local): x[G,S,M] -> xe " << detail::notation(sharding_by<tok, "EGCM">::spec, 4, "f32", "EGCM")
            << "\n"
            << reshard_plan<Mesh, 4, sharding_by<tok, "EGCM">, sharding_by<exp, "EGCM">>::template describe<float>(
                   m, {E, B, C, M}, "EGCM")
            << einsum_plan<"EGCM,EMH->EGCH", Mesh, sharding_by<exp, "EGCM">, sharding_by<exp, "EMH">>::template describe<
                   float>(m, {E, B, C, M}, {E, M, H})
            << einsum_plan<"EGCH,EHM->EGCM", Mesh, sharding_by<exp, "EGCH">, sharding_by<exp, "EHM">,
                           exp>::template describe<float>(m, {E, B, C, H}, {E, H, M})
            << reshard_plan<Mesh, 4, sharding_by<exp, "EGCM">, sharding_by<tok, "EGCM">>::template describe<float>(
                   m, {E, B, C, M}, "EGCM")
            << "combine by index (local): y " << detail::notation(sharding_by<tok, "EGCM">::spec, 4, "f32", "EGCM")
            << " -> [G,S,M]\n\n";
}

template <class Mesh>
int run(const Mesh& m, const std::string& text, int forwards) {
  const bool root = m.rank() == 0;
  model::config c;  // V=256, M=64, 4 heads of 16, H=128, E=8, 4 blocks (MoE in blocks 1 and 3)
  const index_t B = 16, L = 64;  // 16 sequences of 64 bytes per step, split over every axis but "model"
  if (root) print_block_plan(m, c, B, L);
  parameters ps(m, 2024);
  const model::transformer<float, Mesh> tr(ps, c);

  for (int step = 0; step < forwards; ++step) {
    // Every rank cuts the same B windows from the text (the root's copy decides).
    local_tensor<std::int32_t, 2> tok(B, L + 1);
    const std::size_t span = text.size() - std::size_t(L) - 1;
    for (index_t b = 0; b < B; ++b) {
      const std::size_t at = (std::size_t(step * B + b) * 7919u * std::size_t(L)) % span;
      for (index_t l = 0; l <= L; ++l) tok(b, l) = std::int32_t(static_cast<unsigned char>(text[at + std::size_t(l)]));
    }
    const auto tokens = distribute<typename model::transformer<float, Mesh>::tokens_type>(m, tok);
    barrier(m.all_axes());
    const double t0 = MPI_Wtime();
    std::string collectives;  // the forward's alone, not the timing's barrier and max
    tape t(ps, tape::no_grad);
    const auto out = [&] {
      collective_recorder rec;
      auto o = tr.forward(t, tokens, std::uint64_t(step));
      for (const auto& [k, n] : rec.tally()) collectives += (collectives.empty() ? "" : ", ") + std::to_string(n) + " " + k;
      return o;
    }();
    const double slowest = all_reduce(m.all_axes(), MPI_Wtime() - t0, reduction::max);
    if (!root) continue;
    std::printf("forward %d: loss %.4f (cross-entropy %.4f, aux %.4f)  %.2f ms  collectives: %s\n", step,
                out.loss.value().local()(), out.ce, out.aux, 1e3 * slowest, collectives.c_str());
    for (std::size_t i = 0; i < out.moe.size(); ++i) {
      const auto& s = out.moe[i];
      std::printf("  MoE layer %zu: expert load [", 2 * i + 1);
      for (std::size_t e = 0; e < s.expert_load.size(); ++e) std::printf("%s%lld", e ? " " : "", (long long)s.expert_load[e]);
      std::printf("]  overload %.2f  dropped %lld first + %lld second (%.1f%%)  skipped seconds %lld\n", s.max_over_mean(),
                  (long long)s.dropped_at(0), (long long)s.dropped_at(1), 100.0 * s.dropped_share(),
                  (long long)s.skipped_at(1));
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const auto args = examples::positional(argc, argv, "moe_transformer", {"text file or directory", "forwards"},
                                         "usage: mpirun -np P moe_transformer [text file or directory] [forwards]   (any P)\n"
                                         "  the sharding plan of one MoE block, then `forwards` (3) forward passes over the text\n"
                                         "  (default: /usr/share/common-licenses/GPL-3), with each MoE layer's expert loads\n");
  if (!args) return 0;
  const std::string path = args->size() > 0 ? (*args)[0] : "/usr/share/common-licenses/GPL-3";
  const int forwards = args->size() > 1 ? examples::number<long long>("moe_transformer", "forwards", (*args)[1], 1) : 3;
  const std::string text = examples::load_text("moe_transformer", path, "/usr/share/common-licenses");
  if (text.size() < 1024) throw error("gshard moe_transformer: " + path + " holds " + std::to_string(text.size()) + " bytes; give at least 1024");
  return examples::on_fitting_mesh([&](const auto& m) { return run(m, text, forwards); });
}
