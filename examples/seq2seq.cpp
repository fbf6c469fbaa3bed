// examples/seq2seq.cpp — GShard's kind of model on a toy task: an
// encoder–decoder with an MoE layer in every other block of both stacks
// learns to reverse and uppercase a word ("gshard" -> "DRAHSG"). Words of
// 3 to 8 letters share a batch padded (the sources by their lengths, the
// targets with -1), the experts are spread over the ranks, and the model is
// evaluated by decoding held-out words with a cache, greedily and by beam
// search, every rank in lockstep.
//   scripts/mpirun -np 2 build/examples/seq2seq [steps]   (any number of ranks)
#include <gshard/gshard.hpp>
#include <gshard/model/seq2seq.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"

using namespace gshard;

namespace {

using grid = mesh<axis<"data">, axis<"expert">>;
using net_t = model::seq2seq<float, grid>;
constexpr index_t S = 8;  // the longest word

// Word i of a stream: 3 to 8 letters, the same on every rank.
std::string word(std::uint64_t stream, std::uint64_t i) {
  const auto n = 3 + std::size_t(uniform(11, stream, i, 0) * 6.0);
  std::string w;
  for (std::size_t k = 0; k < n; ++k) w += char('a' + int(uniform(11, stream, i, k + 1) * 26.0));
  return w;
}
std::string target_of(const std::string& w) {
  std::string t(w.rbegin(), w.rend());
  for (char& c : t) c = char(c - 'a' + 'A');
  return t;
}

// Sources [B, S] (0 after each word), their lengths, and targets [B, S + 2]:
// bos, the reversed word in capitals, eos, then -1.
struct batch {
  net_t::tokens_type src, tgt;
  net_t::lengths_type lengths;
};
batch make_batch(const grid& m, const std::vector<std::string>& words, const model::seq2seq_config& c) {
  const index_t B = index_t(words.size());
  local_tensor<std::int32_t, 2> src(B, S), tgt(B, S + 2);
  local_tensor<std::int32_t, 1> len(B);
  src.setZero();
  tgt.setConstant(-1);
  for (index_t b = 0; b < B; ++b) {
    const std::string& w = words[std::size_t(b)];
    const std::string t = target_of(w);
    len(b) = std::int32_t(w.size());
    tgt(b, 0) = c.bos;
    for (std::size_t k = 0; k < w.size(); ++k) src(b, index_t(k)) = w[k], tgt(b, index_t(k) + 1) = t[k];
    tgt(b, index_t(w.size()) + 1) = c.eos;
  }
  return {distribute<net_t::tokens_type>(m, src), distribute<net_t::tokens_type>(m, tgt),
          distribute<net_t::lengths_type>(m, len)};
}

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const auto args = examples::positional(argc, argv, "seq2seq", {"steps"},
                                         "usage: mpirun -np P seq2seq [steps]   (any P; steps: 600)\n"
                                         "  trains an MoE encoder-decoder to reverse and uppercase words, then decodes held-out ones\n");
  if (!args) return 0;
  const int steps = args->empty() ? 600 : examples::number<long long>("seq2seq", "steps", (*args)[0], 1);
  const grid m(MPI_COMM_WORLD, {1, env.size()});
  const bool root = m.rank() == 0;

  model::seq2seq_config c;
  c.vocab = 128, c.model = 64, c.heads = 4, c.head_dim = 16, c.hidden = 128, c.experts = 8;
  c.encoder_layers = 2, c.decoder_layers = 2, c.max_len = S + 2;
  c.gating.capacity_factor = 2.0;
  parameters ps(m, 42);
  const net_t net(ps, c);
  adam_config ac;
  ac.lr = 3e-3, ac.warmup_steps = 50, ac.total_steps = steps;
  adam opt(ac, ps);
  if (root)
    std::printf("An MoE encoder-decoder on %s: %d + %d blocks (an MoE layer in block 1 of each), M %lld, %lld experts, %zu weight tensors\n",
                m.describe().c_str(), c.encoder_layers, c.decoder_layers, (long long)c.model, (long long)c.experts, ps.size());

  const index_t B = 32;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::string> words;
    for (index_t b = 0; b < B; ++b) words.push_back(word(1, std::uint64_t(step) * std::uint64_t(B) + std::uint64_t(b)));
    const batch d = make_batch(m, words, c);
    tape t(ps);
    auto out = net.forward(t, d.src, d.lengths, d.tgt, std::uint64_t(step));
    t.backward(out.loss);
    opt.update(ps);
    if (root && (step == 0 || (step + 1) % 100 == 0 || step + 1 == steps)) {
      std::printf("step %4d  cross-entropy %.4f  aux %.3f  padded positions routed: none of %lld\n", step + 1, out.ce,
                  out.aux, (long long)(out.moe[0].padded + out.moe[1].padded));
    }
  }

  // Held-out words (another stream), decoded with the cache.
  std::vector<std::string> held;
  for (index_t b = 0; b < B; ++b) held.push_back(word(2, std::uint64_t(b)));
  const batch d = make_batch(m, held, c);
  const auto text = [](const std::vector<std::int32_t>& tokens) {
    std::string s;
    for (auto v : tokens)
      if (v >= 32 && v < 127) s += char(v);
    return s;
  };
  // Each rank decodes its sources; the counts of exact answers are summed.
  std::vector<double> exact(2, 0.0);
  const index_t first = d.lengths.offsets()[0];
  const auto greedy = net.greedy(d.src, d.lengths, S + 1, 7);
  const auto beam = net.beam_search(d.src, d.lengths, {4, 0.6, S + 1}, 7);
  for (std::size_t b = 0; b < greedy.size(); ++b) {
    const std::string want = target_of(held[std::size_t(first) + b]);
    exact[0] += text(greedy[b]) == want && !greedy[b].empty() && greedy[b].back() == c.eos;
    exact[1] += text(beam[b]) == want && !beam[b].empty() && beam[b].back() == c.eos;
    if (first == 0 && b < 4) std::printf("  %-8s -> greedy %-9s beam %s\n", held[b].c_str(), text(greedy[b]).c_str(), text(beam[b]).c_str());
  }
  all_reduce<double>(m.all_axes(), exact);
  if (root)
    std::printf("held-out words: greedy %d/%lld exact, beam 4 %d/%lld exact\n", int(exact[0]), (long long)B, int(exact[1]),
                (long long)B);
  return 0;
}
