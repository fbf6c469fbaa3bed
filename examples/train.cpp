// examples/train.cpp — trains a byte-level MoE Transformer language model
// across ranks. With no arguments: the GCIDE dictionary (40 MB of English,
// Debian's dict-gcide; examples/corpus.hpp), a small model, 1500 steps;
// a tenth of its headwords is held out for evaluation.
//   scripts/mpirun -np 2 build/examples/train [text file or directory] [options; --help lists them]
// SIGTERM or SIGINT (a time limit, preemption, Ctrl-C) stops every rank after
// the same step, saves when --save is given, and exits with 128 + the signal.
// Prints a progress line every --log-every steps (loss, tokens/s, MFU against
// the peak measured at start — fp32 FMA's, or bf16's with --precision bf16 —
// the time left), the held-out loss every --eval-every steps and at the end,
// and a sampled continuation of a held-out prompt.
#include <gshard/gshard.hpp>
#include <gshard/model/cost.hpp>
#include <gshard/model/train.hpp>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "cli.hpp"
#include "corpus.hpp"
#include "meshes.hpp"
#include "progress.hpp"
using namespace gshard;


namespace {

struct options {
  std::string text_path;  // empty: the dictionary, else /usr/share/common-licenses/* (corpus.hpp)
  int steps = 1500, log_every = 100, save_every = 0, eval_batches = 8, eval_every = 500;
  int sample_bytes = 160;
  double sample_temperature = 0.7;
  int stop_after = 0;  // stop (and save) after this many steps, on the schedule of `steps`
  std::string trace;   // write a timeline of step `trace_step` here
  int trace_step = 10;
  std::uint64_t seed = 1;
  std::string save, resume;
  index_t batch = 16, seq = 128;
  std::string metrics;  // JSON lines, one per step
  model::config model;  // the routing options land in model.gating
  index_t experts = 8, hidden = 256, slot_hidden = 0;  // the model's FFNs
  int layers = 4;
  std::string remat = "none";  // --remat: none, all, or a list of blocks
  bool aux_coef_given = false, second_given = false;
  bool sharded_update = true;  // --weight-update sharded (the default) or replicated
  std::string optimizer = "adam";
  matmul_precision precision = matmul_precision::f32;  // --precision
  double lr = 0;               // --lr; 0: the optimizer's default
  long long bucket_kib = -1;   // --bucket-kib; -1: the parameters' default
  wire gradient_wire = wire::same;  // --gradient-wire
  std::optional<wire> all_to_all_wire;  // --all-to-all-wire; unset: bf16 with --precision bf16
  bool filled_slots = true;             // --all-to-all-slots filled: the empty capacity slots stay home
  std::optional<wire> weight_wire;      // --weight-wire; unset: bf16 with --precision bf16
  std::vector<std::string> notes;  // options that have no effect, said once by rank 0
  bool help = false;
};

constexpr const char* usage =
    "usage: mpirun -np P train [text file] [options]   (any P)\n"
    "  text               a file (.gz, .dz: decompressed; .dict: a dictionary's entries) or a directory of\n"
    "                     files (default: /usr/share/dictd/gcide.dict.dz, else /usr/share/common-licenses);\n"
    "                     a tenth held out (a dictionary's headwords, else every 10th file; fewer than 10: the last 10%)\n"
    "  --steps N          optimizer steps (1500); the learning-rate schedule spans them\n"
    "  --batch B --seq L  B sequences of L bytes per step (16, 128), split over data x expert\n"
    "  --seed S           data order, routing noise and initial weights (1)\n"
    "  --log-every N      a progress line every N steps (100)\n"
    "  --eval-every N     the held-out loss every N steps (500; 0: at the end only)\n"
    "  --eval-batches N   batches of held-out text per evaluation (8; the same ones every time)\n"
    "  --sample-bytes N   bytes sampled after a held-out prompt at the end (160; 0: none)\n"
    "  --sample-temperature T  softmax temperature of the sampling (0.7; 0: the likeliest byte)\n"
    "  --save FILE        checkpoint at the end, every --save-every N steps, and on SIGTERM/SIGINT\n"
    "  --resume FILE      continue from a checkpoint, at any rank count\n"
    "  --stop-after N     stop (and save) after N steps, on the schedule of --steps\n"
    "  --trace FILE       a Chrome trace of step --trace-step N (10), with the routing as counters\n"
    "  --metrics FILE     one JSON line per step: losses, held-out loss when evaluated, tokens, tokens/s,\n"
    "                     MFU, lr, gradient norm, each MoE layer's loads and drops (scripts/plot_metrics.py)\n"
    "  --experts E        experts per MoE layer (8); 0: a dense model\n"
    "  --hidden H         hidden units of the dense FFNs and of each expert (256)\n"
    "  --slot-hidden H    with --experts 0: hidden units of the FFNs in the MoE layers' blocks (--hidden)\n"
    "  --layers N         Transformer blocks (4); blocks 1, 3, ... have the MoE layers\n"
    "  --positions none|sinusoidal|learned  positions added to the byte embeddings (none: causal attention\n"
    "                     alone tells them apart)\n"
    "  --remat none|all|LIST  blocks (LIST: 0,2,3) that keep only their input and recompute their forward in\n"
    "                     the backward: less memory for one more forward of each (none)\n"
    "  --attention keep|recompute  attention's probabilities [B,N,L,T] kept for the backward, or two numbers\n"
    "                     per row kept and the probabilities computed again: less memory at long --seq (keep)\n"
    "routing (docs/05_moe.md):\n"
    "  --top-k K          experts per token (2: GShard; 1: Switch)\n"
    "  --second all|random  later choices always kept, or GShard's random routing (random for K = 2, else all)\n"
    "  --placement by-choice|by-token  the order choices take capacity slots: GShard's (every first choice,\n"
    "                     then every second), or each token's choices before the next token's, so that no\n"
    "                     token's output depends on later tokens (by-choice)\n"
    "  --shared-experts N experts every token passes through, beside the routed ones (0)\n"
    "  --dropless         capacity = the largest load over the mesh: no token dropped\n"
    "  --capacity-factor F          C = F * (K/2) * S/E (2: each expert twice its mean load;\n"
    "                               Switch's factor f at K = 1 is F = 2f)\n"
    "  --eval-capacity-factor F     the same at evaluation (default: --capacity-factor)\n"
    "  --z-loss C         router z-loss coefficient (0; ST-MoE uses 1e-3)\n"
    "  --balance aux|bias GShard's aux loss, or DeepSeek-V3's per-expert bias (aux)\n"
    "  --bias-rate R      the bias step of --balance bias (1e-3)\n"
    "  --aux-coef C       weight of the aux loss (0.01; 0 with --balance bias)\n"
    "  --ffn relu|swiglu  the FFNs' and experts' activation (relu)\n"
    "optimizer:\n"
    "  --optimizer adam|adafactor  Adam (beta2 0.95), or GShard's Adafactor: factored second moments, no first\n"
    "                     moment, decay min(0.99, 1 - t^-0.8), updates clipped at RMS 1 (adam)\n"
    "  --lr X             the peak learning rate, warmed up over 50 steps, cosine to a tenth (2e-3; adafactor 3e-3)\n"
    "  --precision f32|bf16  the GEMMs' operands in fp32, or rounded to bf16 and multiplied on the CPU's bf16\n"
    "                     units with fp32 sums, the MoE all_to_alls and the weights in bf16; master weights,\n"
    "                     optimizer state, the router, norms, softmax and the loss stay fp32\n"
    "                     (docs/15_precision.md). Without bf16 units the GEMMs run in fp32 (the rest as said).\n"
    "                     Each einsum rounds its operands once: it pays most for large GEMMs (the MoE layer\n"
    "                     at M=512, H=2048: 1.7x), less at this trainer's sizes (1.4x) (docs/10_performance.md) (f32)\n"
    "  --weight-update sharded|replicated  the update of a weight replicated over batch axes on a block\n"
    "                     of it per rank (reduce_scatter, all_gather) or whole on every rank (all_reduce) (sharded)\n"
    "  --all-to-all-wire f32|bf16  what the MoE all_to_alls carry, forward and backward: bf16 halves their\n"
    "                     bytes; the router reads the input before it is rounded (bf16 with --precision bf16, else f32)\n"
    "  --all-to-all-slots filled|all  which capacity slots the MoE all_to_alls move: the filled ones (each\n"
    "                     expert's slots fill from the first; the receiver writes the empty ones as zeros: the same\n"
    "                     numbers, in ragged messages short by the slots left empty) or all of them (the paper's\n"
    "                     fixed-size all_to_all) (filled)\n"
    "  --gradient-wire f32|bf16  what the gradients' reductions carry: bf16 halves their bytes, each rank's\n"
    "                     gradient rounded once and the parts added in fp32 (docs/15_precision.md) (f32)\n"
    "  --weight-wire f32|bf16  what the weights hold: bf16 copies of fp32 masters the optimizer keeps and\n"
    "                     checkpoints, the sharded update's all_gathers in bf16 (bf16 with --precision bf16, else f32)\n"
    "  --bucket-kib N     gradients reduced (and updated weights gathered) together in buckets of N KiB, each\n"
    "                     started as it fills and travelling while the step computes (4096; 0: one per weight)\n"
    "  --overlap-degree K the MoE layers' all_to_alls pipelined with the experts in K chunks of the capacity:\n"
    "                     chunk i+1 travels while chunk i's experts compute, forward and backward (1: none)\n"
    "  --micro-batches 1|2  2: each rank's batch cut in two halves that run through the blocks interleaved,\n"
    "                     one's MoE all_to_alls travelling while the other computes: for slow links; the same\n"
    "                     losses up to rounding; not with --remat in a model with MoE blocks (1)\n";

// --remat's value: none, all, or blocks as a comma-separated list.
std::vector<int> remat_blocks(const std::string& v, int layers) {
  std::vector<int> blocks;
  if (v == "none") return blocks;
  if (v == "all") {
    for (int l = 0; l < layers; ++l) blocks.push_back(l);
    return blocks;
  }
  for (std::size_t at = 0; at <= v.size();) {
    const std::size_t comma = std::min(v.find(',', at), v.size());
    try {
      const int b = int(examples::number<long long>("train", "--remat", v.substr(at, comma - at), 0, layers - 1));
      if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) blocks.push_back(b);
    } catch (const error&) {
      throw error("gshard train: --remat is none, all, or blocks from 0 to " + std::to_string(layers - 1) +
                  " separated by commas (1,3); not '" + v + "'");
    }
    at = comma + 1;
  }
  return blocks;
}

options parse(int argc, char** argv) {
  options o;
  bool bias_rate_given = false, capacity_given = false;
  std::string moe_option_given;  // the first MoE option given (no effect in a dense model)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    for (const char* r : {"--top-k", "--second", "--placement", "--shared-experts", "--dropless", "--capacity-factor", "--eval-capacity-factor",
                          "--z-loss", "--balance", "--bias-rate", "--aux-coef", "--overlap-degree",
                          "--all-to-all-wire", "--all-to-all-slots", "--micro-batches"})
      if (a == r && moe_option_given.empty()) moe_option_given = a;
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw error("gshard train: " + a + " needs a value");
      return argv[++i];
    };
    auto integer = [&](int lo) { return int(examples::number<long long>("train", a, next(), lo)); };
    auto real = [&] { return examples::number<double>("train", a, next(), 0.0); };
    moe::gating_config& g = o.model.gating;
    if (a == "--steps") o.steps = integer(1);
    else if (a == "--seed") o.seed = std::uint64_t(examples::number<long long>("train", a, next(), 0, LLONG_MAX));
    else if (a == "--save") o.save = next();
    else if (a == "--save-every") o.save_every = integer(0);
    else if (a == "--stop-after") o.stop_after = integer(0);
    else if (a == "--trace") o.trace = next();
    else if (a == "--trace-step") o.trace_step = integer(1);
    else if (a == "--resume") o.resume = next();
    else if (a == "--log-every") o.log_every = integer(1);
    else if (a == "--eval-every") o.eval_every = integer(0);
    else if (a == "--eval-batches") o.eval_batches = integer(1);
    else if (a == "--sample-bytes") o.sample_bytes = integer(0);
    else if (a == "--sample-temperature") o.sample_temperature = real();
    else if (a == "--batch") o.batch = integer(1);
    else if (a == "--seq") o.seq = integer(1);
    else if (a == "--metrics") o.metrics = next();
    else if (a == "--experts") o.experts = integer(0);
    else if (a == "--hidden") o.hidden = integer(1);
    else if (a == "--slot-hidden") o.slot_hidden = integer(1);
    else if (a == "--layers") o.layers = integer(1);
    else if (a == "--remat") o.remat = next();
    else if (a == "--bucket-kib") o.bucket_kib = examples::number<long long>("train", a, next(), 0, 1LL << 30);
    else if (a == "--micro-batches") o.model.micro_batches = int(examples::number<long long>("train", a, next(), 1, 2));
    else if (a == "--overlap-degree") o.model.overlap_degree = int(examples::number<long long>("train", a, next(), 1, 1 << 16));
    else if (a == "--top-k") g.top_k = integer(1);
    else if (a == "--shared-experts") o.model.shared_experts = integer(0);
    else if (a == "--dropless") g.dropless = true;
    else if (a == "--capacity-factor") g.capacity_factor = real(), capacity_given = true;
    else if (a == "--eval-capacity-factor") g.eval_capacity_factor = real(), capacity_given = true;
    else if (a == "--z-loss") g.z_loss_coef = real();
    else if (a == "--bias-rate") g.bias_rate = real(), bias_rate_given = true;
    else if (a == "--lr") o.lr = examples::number<double>("train", a, next(), 1e-9, 1.0);
    else if (a == "--aux-coef") o.model.aux_coef = real(), o.aux_coef_given = true;
    else if (a == "--balance" || a == "--ffn" || a == "--second" || a == "--weight-update" || a == "--attention" ||
             a == "--placement" || a == "--positions" || a == "--optimizer" || a == "--precision" ||
             a == "--gradient-wire" || a == "--all-to-all-wire" || a == "--weight-wire" || a == "--all-to-all-slots") {
      const std::string v = next();
      if (a == "--weight-update" && (v == "sharded" || v == "replicated")) o.sharded_update = v == "sharded";
      else if (a == "--optimizer" && (v == "adam" || v == "adafactor")) o.optimizer = v;
      else if (a == "--precision" && (v == "f32" || v == "bf16"))
        o.precision = v == "f32" ? matmul_precision::f32 : matmul_precision::bf16;
      else if (a == "--gradient-wire" && (v == "f32" || v == "bf16"))
        o.gradient_wire = v == "f32" ? wire::same : wire::bf16;
      else if (a == "--all-to-all-wire" && (v == "f32" || v == "bf16"))
        o.all_to_all_wire = v == "f32" ? wire::same : wire::bf16;
      else if (a == "--all-to-all-slots" && (v == "filled" || v == "all"))
        o.filled_slots = v == "filled";
      else if (a == "--weight-wire" && (v == "f32" || v == "bf16"))
        o.weight_wire = v == "f32" ? wire::same : wire::bf16;
      else if (a == "--balance" && (v == "aux" || v == "bias")) g.balance = v == "aux" ? moe::balance_mode::aux : moe::balance_mode::bias;
      else if (a == "--ffn" && (v == "relu" || v == "swiglu")) o.model.ffn = v == "relu" ? ffn_kind::relu : ffn_kind::swiglu;
      else if (a == "--attention" && (v == "keep" || v == "recompute"))
        o.model.attention = v == "keep" ? attention_memory::keep_probabilities : attention_memory::recompute_probabilities;
      else if (a == "--positions" && (v == "none" || v == "sinusoidal" || v == "learned"))
        o.model.positions = v == "none"         ? model::position_kind::none
                            : v == "sinusoidal" ? model::position_kind::sinusoidal
                                                : model::position_kind::learned;
      else if (a == "--placement" && (v == "by-choice" || v == "by-token"))
        g.order = v == "by-choice" ? moe::placement::by_choice : moe::placement::by_token;
      else if (a == "--second" && (v == "all" || v == "random"))
        g.second = v == "all" ? moe::second_policy::all : moe::second_policy::random, o.second_given = true;
      else
        throw error("gshard train: " + a + " is " +
                    (a == "--balance"     ? "aux or bias"
                     : a == "--ffn"       ? "relu or swiglu"
                     : a == "--second"    ? "all or random"
                     : a == "--attention" ? "keep or recompute"
                     : a == "--placement" ? "by-choice or by-token"
                     : a == "--positions" ? "none, sinusoidal or learned"
                     : a == "--optimizer" ? "adam or adafactor"
                     : a == "--all-to-all-slots" ? "filled or all"
                     : a == "--precision" || a == "--gradient-wire" || a == "--all-to-all-wire" || a == "--weight-wire"
                         ? "f32 or bf16"
                                          : "sharded or replicated") +
                    ", not '" + v + "'");
    } else if (a.size() > 1 && a[0] == '-') throw error("gshard train: unknown option " + a + " (--help lists them)");
    else if (!o.text_path.empty())
      throw error("gshard train: two texts given, '" + o.text_path + "' and '" + a + "'; give one file or directory");
    else o.text_path = a;
  }
  o.model.remat = remat_blocks(o.remat, o.layers);
  o.model.all_to_all_wire = o.all_to_all_wire.value_or(o.precision == matmul_precision::bf16 ? wire::bf16 : wire::same) |
                            (o.filled_slots ? wire::trimmed : wire::same);
  if (!o.weight_wire) o.weight_wire = o.precision == matmul_precision::bf16 ? wire::bf16 : wire::same;
  if (o.lr == 0) o.lr = o.optimizer == "adafactor" ? 3e-3 : 2e-3;
  if (o.slot_hidden > 0 && o.experts > 0)
    throw error("gshard train: --slot-hidden " + std::to_string(o.slot_hidden) + " is for a dense model; give --experts 0");
  if (o.save.empty() && (o.save_every > 0 || o.stop_after > 0))
    throw error(std::string("gshard train: ") + (o.save_every > 0 ? "--save-every" : "--stop-after") +
                " needs --save FILE: without it the steps trained would be lost");
  if (o.model.gating.balance == moe::balance_mode::bias && !o.aux_coef_given) o.model.aux_coef = 0;  // DeepSeek-V3
  for (const auto& [ignored, why] : {std::pair{bias_rate_given && o.model.gating.balance != moe::balance_mode::bias,
                                               "--bias-rate has no effect without --balance bias"},
                                     std::pair{capacity_given && o.model.gating.dropless,
                                               "--capacity-factor and --eval-capacity-factor have no effect with --dropless"},
                                     std::pair{o.second_given && o.model.gating.top_k == 1, "--second has no effect with --top-k 1"},
                                     std::pair{o.sample_bytes == 0 && o.sample_temperature != 0.7,
                                               "--sample-temperature has no effect with --sample-bytes 0"}})
    if (ignored) o.notes.push_back(why);
  if (o.experts > 0 && o.layers == 1)
    o.notes.push_back("--layers 1 has no MoE block (blocks 1, 3, ... hold the MoE layers): the model is dense" +
                      std::string(moe_option_given.empty() ? "" : ", and " + moe_option_given + " (every MoE option) has no effect"));
  if (o.experts == 0 && !moe_option_given.empty())
    o.notes.push_back(moe_option_given + " (and every MoE option) has no effect with --experts 0: a dense model has no MoE layer");
  // GShard's random routing is of the second choice of top-2; with other k every choice is kept (Switch, Mixtral).
  if (o.model.gating.top_k != 2 && !o.second_given) o.model.gating.second = moe::second_policy::all;
  return o;
}

// The routing settings, saved in the checkpoint's metadata beside the step,
// so a resumed run can say when it trains another objective.
std::map<std::string, double> routing_meta(const model::config& c) {
  return {{"top_k", c.gating.top_k},
          {"second_random", c.gating.second == moe::second_policy::random},
          {"dropless", c.gating.dropless},
          {"capacity_factor", c.gating.capacity_factor},
          {"eval_capacity_factor", c.gating.eval_capacity_factor},
          {"z_loss_coef", c.gating.z_loss_coef},
          {"aux_coef", c.aux_coef},
          {"balance_bias", c.gating.balance == moe::balance_mode::bias},
          {"bias_rate", c.gating.bias_rate},
          {"shared_experts", c.shared_experts},
          {"swiglu", c.ffn == ffn_kind::swiglu},
          {"placement_by_token", c.gating.order == moe::placement::by_token}};
}

// A prompt from the held-out text: the start of the first paragraph that
// starts a line unindented (a dictionary's headword) after a seeded
// position, or the held-out text's start; up to 48 bytes, cut after a word.
std::string held_out_prompt(const std::string& text, std::size_t split, std::uint64_t seed) {
  std::size_t at = split + std::size_t(uniform(seed, 0x9A0B7, 0, 0) * double((text.size() - split) / 2));
  for (at = text.find("\n\n", at); at != std::string::npos && at + 2 < text.size() && std::isspace(static_cast<unsigned char>(text[at + 2]));)
    at = text.find("\n\n", at + 2);
  at = at != std::string::npos && at + 2 < text.size() ? at + 2 : split;
  std::string p = text.substr(at, std::min<std::size_t>(48, text.size() - at));
  if (const std::size_t space = p.find_last_of(" \n"); space != std::string::npos && space > 8) p.resize(space + 1);
  return p;
}

// Samples `n` bytes after `prompt` at `temperature` (0: the likeliest byte).
// The batch holds one copy of the context per rank; rank 0's copy decides
// each byte, which every rank then adopts.
template <class Model>
std::string sample(const Model& model, parameters<typename Model::tokens_type::mesh_type>& ps, index_t L, std::string prompt,
                   int n, double temperature, std::uint64_t seed) {
  const auto& m = ps.mesh();
  const model::config& c = model.cfg();
  const index_t B = m.nranks();
  for (int i = 0; i < n; ++i) {
    const std::string ctx = prompt.size() > std::size_t(L) ? prompt.substr(prompt.size() - std::size_t(L)) : prompt;
    local_tensor<std::int32_t, 2> tok(B, L + 1);
    tok.setConstant(' ');
    for (index_t b = 0; b < B; ++b)
      for (std::size_t t = 0; t < ctx.size(); ++t) tok(b, index_t(t)) = static_cast<unsigned char>(ctx[t]);
    tape t(ps, tape::no_grad);
    const auto out = model.forward(t, distribute<typename Model::tokens_type>(m, tok), 0);
    const float* row = out.logits.value().data() + (index_t(ctx.size()) - 1) * c.vocab;  // this rank's copy
    // Softmax at the temperature, then the seeded uniform picks the byte.
    const float* top = std::max_element(row, row + c.vocab);
    int pick = int(top - row);
    if (temperature > 0) {
      std::vector<double> w(std::size_t(c.vocab));
      double sum = 0;
      for (index_t v = 0; v < c.vocab; ++v) sum += (w[std::size_t(v)] = std::exp((row[v] - *top) / temperature));
      double u = uniform(seed, 0x5A3B1E, std::uint64_t(i), 0) * sum;
      pick = 0;
      while (pick + 1 < c.vocab && (u -= w[std::size_t(pick)]) > 0) ++pick;
    }
    broadcast(m.all_axes(), std::span<int>(&pick, 1), 0);
    prompt += char(pick);
  }
  return prompt;
}

// The model the options describe.
model::config model_config(const options& o) {
  model::config c = o.model;
  c.model = 128, c.heads = 4, c.head_dim = 32, c.layers = o.layers, c.max_len = o.seq;
  c.hidden = o.hidden, c.experts = o.experts, c.slot_hidden = o.slot_hidden;
  return c;
}

// Peak memory of one rank's step, from the cost model's count for this
// configuration and mesh (model/cost.hpp): the parameters, gradients and
// Adam's state on this rank, exact, and the activations the backward keeps,
// over the process's base and the text every rank holds. Against the peak
// resident memory of 11 runs (1 and 2 ranks; batch, seq, experts, hidden,
// layers, shared experts, attention recompute) this is 0.99 to 1.06 times
// the peak (docs/12_scale.md); the state's extra share is the gradient
// buckets' and the update's buffers.
struct memory_estimate {
  double base = 0, state = 0, activations = 0;
  double total() const { return base + state_factor * state + activations; }
  static constexpr double process_bytes = 42e6, state_factor = 1.15;
};
memory_estimate step_memory(const model::config& c, const model::cost::mesh_sizes& ms, const options& o, std::size_t text_bytes) {
  const auto w = model::cost::count_step(c, ms, {o.batch, o.seq, o.sharded_update, int(sizeof(float)),
                                                 o.bucket_kib >= 0 ? std::size_t(o.bucket_kib) << 10 : default_bucket_bytes,
                                                 o.optimizer == "adafactor" ? model::cost::optimizer_kind::adafactor
                                                                            : model::cost::optimizer_kind::adam,
                                                 false, 0, o.gradient_wire, o.weight_wire.value_or(wire::same)});
  return {memory_estimate::process_bytes + double(text_bytes), w.parameter_bytes + w.gradient_bytes + w.optimizer_bytes,
          w.activation_bytes};
}

// The option whose value costs the most memory: each sizing option above its
// default is set back to it in turn, the others as given; named is the one
// that frees the most, with the bytes it frees (with `weights`, among the
// options that size the model, not the batch). {"", 0} when none above its
// default frees anything.
std::pair<std::string, double> costliest_option(const options& o, const model::cost::mesh_sizes& ms, std::size_t text_bytes,
                                                bool weights) {
  options d{};
  const auto bytes = [&](const options& x) { return step_memory(model_config(x), ms, x, text_bytes).total(); };
  const double now = bytes(o);
  std::pair<std::string, double> best{"", 0};
  // field(x): the option's value in x, to read and to set.
  const auto consider = [&](const char* option, auto field, bool sizes_weights) {
    options x = o;
    const auto given = field(x), fallback = field(d);
    if ((weights && !sizes_weights) || !(given > fallback)) return;
    field(x) = fallback;
    if (const double freed = now - bytes(x); freed > best.second) best = {std::string(option) + " " + std::to_string(given), freed};
  };
  consider("--experts", [](options& x) -> auto& { return x.experts; }, true);
  consider("--hidden", [](options& x) -> auto& { return x.hidden; }, true);
  consider("--slot-hidden", [](options& x) -> auto& { return x.slot_hidden; }, true);
  consider("--layers", [](options& x) -> auto& { return x.layers; }, true);
  consider("--shared-experts", [](options& x) -> auto& { return x.model.shared_experts; }, true);
  consider("--batch", [](options& x) -> auto& { return x.batch; }, false);
  consider("--seq", [](options& x) -> auto& { return x.seq; }, false);
  return best;
}

// Everything about the options that can be checked before step 1, on rank 0
// (where the files are written): "" or what is wrong.
// `ms`: the mesh's sizes, as the cost model takes them.
std::string preflight(const options& o, const model::config& c, const model::cost::mesh_sizes& ms, const std::string& text,
                      std::size_t split) {
  const double L = double(o.seq), held = double(text.size() - split), train = double(split);
  char b[640];
  if (held < 2 || train < 2) {
    std::snprintf(b, sizeof b, "the text's %s part has %.0f bytes: give a longer text (a tenth is held out: of a dictionary's "
                  "headwords, of a directory's files, or the last 10%% of a text's bytes)", held < 2 ? "held-out" : "training", std::min(held, train));
    return b;
  }
  if (held < L + 1 || train < L + 1) {
    std::snprintf(b, sizeof b, "--seq %ld needs windows of %ld bytes, but the text's %s part has %.0f bytes; "
                  "give a longer text or --seq %.0f at most", long(o.seq), long(o.seq + 1), held < L + 1 ? "held-out" : "training",
                  std::min(held, train), std::min(held, train) - 1);
    return b;
  }
  // Memory: the host's physical memory over the ranks it runs.
  const auto [ranks_here, memory] = examples::memory_per_rank();
  const memory_estimate need = step_memory(c, ms, o, text.size());
  if (need.total() > 0.8 * memory) {
    // What does not fit, and the option that moves it most: the weights and
    // their state alone (the model's size), or the activations, which grow
    // with the batch (then the largest batch that fits is named).
    const double state = memory_estimate::state_factor * need.state, per_sequence = need.activations / double(o.batch);
    const char* optimizer = o.optimizer == "adafactor" ? "Adafactor" : "Adam";
    const bool weights = need.base + state > 0.8 * memory;
    const auto [option, freed] = costliest_option(o, ms, text.size(), weights);
    const double gib = double(1 << 30);
    const std::string at_fault = option.substr(0, option.find(' '));  // the option's name
    char costliest[160] = "";
    if (!option.empty()) std::snprintf(costliest, sizeof costliest, "; %.1f GiB less at the default %s", freed / gib, at_fault.c_str());
    std::string advice;
    if (weights) {
      advice = at_fault.empty() ? "this model does not fit this host at any --batch" : "give a smaller " + at_fault;
      if (!at_fault.empty() && need.total() - freed > 0.8 * memory)
        advice += " (at its default the rest still needs about " + std::to_string(long(std::ceil((need.total() - freed) / gib))) +
                  " GiB: the other sizes are too large as well)";
    }
    else if (const double fits = std::floor((0.8 * memory - need.base - state) / per_sequence); fits >= 1)
      advice = "at this --seq, --batch " + std::to_string(long(fits)) + " at most";
    else
      advice = "one sequence's activations do not fit: give a smaller " + (at_fault.empty() || at_fault == "--batch" ? "--seq" : at_fault);
    const std::string what = weights ? (option.empty() ? "the model" : option)
                                     : "--batch " + std::to_string(o.batch) + " --seq " + std::to_string(o.seq);
    std::snprintf(b, sizeof b, "%s needs about %.1f GiB per rank (estimated: parameters, gradients and %s %.1f GiB, "
                  "activations %.1f GiB%s), but this host has %.1f GiB for each of its %.0f ranks; %s",
                  what.c_str(), need.total() / gib, optimizer, state / gib, need.activations / gib, costliest, memory / gib,
                  ranks_here, advice.c_str());
    return b;
  }
  // The files it will write: found out now, not after training; none may
  // be a file it reads.
  std::vector<std::pair<std::string, std::string>> inputs{{"--resume", o.resume}};
  const std::string text_path = !o.text_path.empty() ? o.text_path
                                : std::filesystem::exists(examples::default_dictionary) ? examples::default_dictionary
                                                                                : examples::fallback_texts;
  for (const auto& f : examples::input_files(text_path)) inputs.emplace_back("the training text", f);
  const std::vector<std::pair<std::string, std::string>> outputs{{"--save", o.save}, {"--metrics", o.metrics}, {"--trace", o.trace}};
  if (const std::string p = examples::outputs_spare_inputs(outputs, inputs); !p.empty()) return p;
  for (const auto& [option, path] : {std::pair{"--save", o.save}, std::pair{"--trace", o.trace}})
    if (!path.empty())
      if (std::string p = io::check_writable(path); !p.empty()) return std::string(option) + " " + path + ": " + p;
  if (!o.trace.empty() && o.trace_step > o.steps)
    return "--trace-step " + std::to_string(o.trace_step) + " is after the last step (--steps " + std::to_string(o.steps) + ")";
  return "";
}

template <class Mesh>
int train(const Mesh& m, const options& o, const examples::corpus& corpus, const examples::machine_peak& peak) {
  const matmul_precision_scope precision(o.precision);  // every step and evaluation; the router in fp32 regardless
  const bool root = m.rank() == 0;
  const model::config c = model_config(o);
  const std::string& text = corpus.text;
  const std::size_t split = corpus.split;
  constexpr int model_axis = Mesh::index_of("model");
  const model::cost::mesh_sizes ms{m.size(0), m.size(1), model_axis >= 0 ? m.size(model_axis) : 1, model_axis >= 0};
  if (const std::string p = broadcast_text(m.all_axes(), root ? preflight(o, c, ms, text, split) : ""); !p.empty())
    throw error("gshard train: " + p);
  parameters<Mesh> ps = o.sharded_update ? parameters<Mesh>(m, o.seed, shard_weight_update<default_roles::batch>{})
                                          : parameters<Mesh>(m, o.seed);
  if (o.bucket_kib >= 0) ps.set_bucket_bytes(std::size_t(o.bucket_kib) << 10);
  ps.set_gradient_wire(o.gradient_wire);
  ps.set_weight_wire(*o.weight_wire);
  const model::transformer<float, Mesh> tr(ps, c);
  using tokens_t = typename model::transformer<float, Mesh>::tokens_type;
  const auto opt = examples::make_optimizer("train", o.optimizer, o.lr, 50, o.steps, ps);
  int start = 0;
  if (!o.resume.empty()) {
    // The optimizer first (its state's records differ), then everything.
    const std::string other = examples::resumes_with(load_checkpoint(o.resume, m, {}), o.resume, o.optimizer);
    if (!other.empty()) throw checkpoint_error("gshard train: " + other);
    const auto meta = load_checkpoint(o.resume, m, model::checkpoint_parts(ps, *opt));
    if (const std::string p = examples::valid_step(meta, o.resume); !p.empty()) throw checkpoint_error("gshard train: " + p);
    start = int(meta.at("step"));
    opt->step = start;
    if (root) std::printf("resumed %s at step %d on %s\n", o.resume.c_str(), start, m.describe().c_str());
    for (const auto& [key, now] : routing_meta(c))  // checkpoints of older trainers have none of these
      if (const auto it = meta.find(key); it != meta.end() && it->second != now && root)
        std::printf("note: the checkpoint was trained with %s = %g; this run uses %g\n", key.c_str(), it->second, now);
    for (const auto& [key, now, what] : {std::tuple{"seed", double(o.seed), "another data order and routing noise from here"},
                                         std::tuple{"steps", double(o.steps), "the learning-rate schedule spans this run's steps"}})
      if (const auto it = meta.find(key); it != meta.end() && it->second != now && root)
        std::printf("note: the checkpoint was trained with --%s %.0f; this run uses --%s %.0f (%s)\n", key, it->second, key, now,
                    what);
  }
  if (root) {
    std::printf("text: %s\n", corpus.source.c_str());
    double count = 0;  // the parameters, global
    for (std::size_t i = 0; i < ps.values().size(); ++i) {
      double n = 1;
      for (index_t e : ps.values()[i].extents()) n *= double(e);
      count += n;
    }
    char ffn[96];
    if (c.experts > 0) std::snprintf(ffn, sizeof ffn, "MoE in blocks 1, 3, ...: E=%ld, H=%ld", long(c.experts), long(c.hidden));
    else std::snprintf(ffn, sizeof ffn, "dense: H=%ld, blocks 1, 3, ...: H=%ld", long(c.hidden), long(c.ffn_hidden(1)));
    std::printf("training on %zu bytes (%zu held out), %s; M=%ld, %d blocks (%s), %.2fM parameters, batch %ld x %ld bytes\n",
                split, text.size() - split, m.describe().c_str(), long(c.model), c.layers, ffn, count * 1e-6, long(o.batch),
                long(o.seq));
    std::printf("%s\n", examples::machine_line(peak, o.precision, c.experts > 0 ? c.all_to_all_wire : wire::same).c_str());
    const memory_estimate mem = step_memory(c, ms, o, text.size());
    std::printf("memory per rank: about %.0f MB at its peak (parameters, gradients and %s %.0f MB, activations kept for "
                "the backward %.0f MB)\n", mem.total() * 1e-6, o.optimizer == "adam" ? "Adam" : "Adafactor", mem.state * 1e-6,
                mem.activations * 1e-6);
    if (!c.remat.empty()) {
      std::string list;
      for (int b : c.remat) list += (list.empty() ? "" : ", ") + std::to_string(b);
      std::printf("rematerialised blocks: %s (each keeps its input and runs its forward again in the backward)\n", list.c_str());
    }
    if (c.attention == attention_memory::recompute_probabilities)
      std::printf("attention: each block's probabilities computed again in the backward (two numbers per row kept)\n");
  }
  {  // The optimizer's state on this rank, and Adam's moments of a replicated update
    const double here = double(opt->state_bytes()), adam_whole = 2.0 * double(ps.values().local_bytes());
    bool sharded = false;
    for (auto& g : ps.grads()) sharded = sharded || g->as_sharded() != nullptr;
    if (root)
      std::printf("optimizer: %s, lr %g, weight update %s: state %.2f MB on rank 0 (Adam's moments, replicated: %.2f MB)%s%s\n",
                  o.optimizer == "adam" ? "Adam" : "Adafactor (factored second moments, no first moment)", o.lr,
                  sharded ? "sharded over the batch axes" : "replicated", here * 1e-6, adam_whole * 1e-6,
                  sends_bf16(ps.gradient_wire()) ? ", gradients reduced in bf16" : "",
                  sends_bf16(ps.weight_wire()) ? ", bf16 weights with fp32 masters" : "");
  }
  if (root)
    for (const auto& note : o.notes) std::printf("note: %s\n", note.c_str());
  if (const std::string grace = examples::launcher_grace_note(o.save); root && !grace.empty()) std::printf("note: %s\n", grace.c_str());
  if (root && c.experts > 0) {
    char cap[64], aux[64];
    std::snprintf(cap, sizeof cap, "capacity factor %g (eval %g)", c.gating.capacity_factor,
                  c.gating.eval_capacity_factor > 0 ? c.gating.eval_capacity_factor : c.gating.capacity_factor);
    std::snprintf(aux, sizeof aux, c.gating.balance == moe::balance_mode::aux ? "aux loss x %g" : "bias (rate %g)",
                  c.gating.balance == moe::balance_mode::aux ? c.aux_coef : c.gating.bias_rate);
    std::printf("routing: top-%d (%s later choices), %s, balance by %s, z-loss x %g, %d shared experts, %s FFNs%s%s%s\n",
                c.gating.top_k, c.gating.second == moe::second_policy::all ? "all" : "random", c.gating.dropless ? "dropless" : cap, aux,
                c.gating.z_loss_coef, c.shared_experts, c.ffn == ffn_kind::relu ? "relu" : "swiglu",
                c.overlap_degree > 1 ? (", all_to_alls in up to " + std::to_string(c.overlap_degree) + " chunks of the capacity").c_str() : "",
                c.gating.order == moe::placement::by_token ? ", each token's choices placed before the next token's" : "",
                c.micro_batches == 2 && c.any_moe() ? ", each rank's batch in two interleaved micro-batches" : "");
  }
  const int end = o.stop_after > 0 ? std::min(o.steps, o.stop_after) : o.steps;
  if (start >= end) {  // nothing left: do not relabel the checkpoint with another step
    if (root) std::printf("the checkpoint is at step %d; nothing to train up to step %d\n", start, end);
    return 0;
  }
  if (!o.trace.empty() && trace::enabled()) {
    if (root) std::printf("GSHARD_TRACE is tracing the whole run; --trace is ignored\n");
  }
  const bool trace_one_step = !o.trace.empty() && !trace::enabled();
  if (trace_one_step && (o.trace_step <= start || o.trace_step > end))
    throw error("gshard train: --trace-step " + std::to_string(o.trace_step) + " is not among the steps this run trains (" +
                std::to_string(start + 1) + " to " + std::to_string(end) + ")");
  auto save = [&](int step) {
    auto meta = routing_meta(c);
    meta["step"] = double(step);
    meta["seed"] = double(o.seed), meta["steps"] = double(o.steps);
    meta[examples::optimizer_key] = o.optimizer == "adafactor";
    save_checkpoint(o.save, m, model::checkpoint_parts(ps, *opt), meta);
    if (root) std::printf("saved %s at step %d\n", o.save.c_str(), step);
  };
  // The metrics log, opened by rank 0; SIGTERM and SIGINT stop at the next step boundary, saved.
  examples::run_log log(m.all_axes(), "train", o.metrics, start > 0);
  const gshard::stdout_relay relay(root);  // a launcher that stops reading cannot block the save
  // The progress line's window: step time, tokens and model FLOPs since the
  // last line, and the wall time (batches, evaluations and all) for the ETA.
  double t_window = 0, tokens_window = 0, flops_window = 0, wall_mark = MPI_Wtime();
  int steps_window = 0;
  auto stopping = [&](int step) { return log.stop(step, start, o.steps, o.save, save); };
  auto evaluate = [&] {  // cut short by a stop request, so the save comes within the launcher's grace
    return model::evaluate(tr, ps, text, split, text.size(), o.batch, o.seq, o.seed, o.eval_batches,
                           [&] { return log.stop_requested(); });
  };
  std::optional<model::eval_result> held_out;  // the last evaluation
  const double bits = 1.0 / std::log(2.0);
  for (int step = start; step < end; ++step) {
    if (const int code = stopping(step)) return code;
    const auto tok = distribute<tokens_t>(m, model::text_batch(text, 0, split, o.batch, o.seq, o.seed, std::uint64_t(step)));
    const bool tracing = trace_one_step && step + 1 == o.trace_step;  // the step printed as trace_step
    barrier(m.all_axes());
    if (tracing) trace::start(o.trace, m);  // after the barrier: the trace holds the step alone
    const double flops0 = model_flops(), t0 = MPI_Wtime();
    const auto r = model::train_step(tr, ps, *opt, tok, std::uint64_t(step));
    const double seconds = MPI_Wtime() - t0;
    // Every rank counts 1/P of each einsum's FLOPs (counters.hpp): x P is the step's.
    const double flops = (model_flops() - flops0) * double(m.nranks());
    const double mfu = flops / (seconds * double(m.nranks()) * peak.gflops() * 1e9);
    t_window += seconds, flops_window += flops, ++steps_window;
    if (tracing) {
      const std::size_t spans = trace::stop(m);
      if (root) std::printf("wrote %zu events of step %d to %s\n", spans, step + 1, o.trace.c_str());
    }
    tokens_window += double(o.batch * o.seq);
    bool evaluating = step + 1 == o.steps || (o.eval_every > 0 && (step + 1) % o.eval_every == 0);
    if (evaluating) {
      held_out = evaluate();
      if (held_out->stopped) held_out.reset(), evaluating = false;
      else if (root && step + 1 < o.steps)
        std::printf("held-out at step %d: %.4f nats/byte = %.3f bits per byte\n", step + 1, held_out->ce,
                    held_out->ce * bits);
    }
    if (log.writing()) {
      using moe::detail::json_number;
      std::string line = "{\"step\":" + std::to_string(step + 1) + ",\"tokens\":" +
                         json_number(double(step + 1) * double(o.batch * o.seq)) + ",\"loss\":" + json_number(r.loss) +
                         ",\"ce\":" + json_number(r.ce) + ",\"aux\":" + json_number(r.aux) + ",\"z\":" + json_number(r.z);
      if (evaluating) line += ",\"held_out_ce\":" + json_number(held_out->ce) + ",\"held_out_bpb\":" + json_number(held_out->ce * bits);
      line += ",\"lr\":" + json_number(r.lr) + ",\"grad_norm\":" + json_number(r.grad_norm) +
              ",\"seconds\":" + json_number(seconds) + ",\"tokens_per_s\":" + json_number(double(o.batch * o.seq) / seconds) +
              ",\"mfu\":" + json_number(mfu) + ",\"moe\":[";
      for (std::size_t l = 0; l < r.moe.size(); ++l) line += (l ? "," : "") + moe::to_json(r.moe[l]);
      log.write(line + "]}\n");
    }
    if (root && ((step + 1) % o.log_every == 0 || step == start) && !log.stop_received()) {
      const double now = MPI_Wtime(), per_step = (now - wall_mark) / steps_window;
      char aux[32] = "";
      if (!r.moe.empty()) std::snprintf(aux, sizeof aux, "  aux %.3f", r.aux);  // a dense model has no routing
      std::printf("step %5d  loss %.4f%s  %.0f tokens/s  %s%slr %.2e  MFU %.2f  ETA %s\n", step + 1, r.ce, aux,
                  tokens_window / t_window, examples::routing_summary(r.moe).c_str(), r.moe.empty() ? "" : "  ", r.lr,
                  flops_window / (t_window * double(m.nranks()) * peak.gflops() * 1e9), examples::duration(per_step * (end - step - 1)).c_str());
      std::fflush(stdout);
      t_window = tokens_window = flops_window = 0, steps_window = 0, wall_mark = now;
    }
    if (!o.save.empty() && o.save_every > 0 && (step + 1) % o.save_every == 0 && step + 1 < end) save(step + 1);
  }
  if (const int code = stopping(end)) return code;
  if (!o.save.empty()) save(end);
  if (end < o.steps) {
    if (root) std::printf("stopped after step %d of %d\n", end, o.steps);
    return 0;
  }
  if (!held_out) held_out = evaluate();  // the last step evaluates; kept for clarity, not reached
  if (root)
    std::printf("held-out loss %.4f nats/byte = %.3f bits per byte%s%s%s\n", held_out->ce, held_out->ce * bits,
                held_out->moe.empty() ? "" : "  (", examples::routing_summary(held_out->moe).c_str(), held_out->moe.empty() ? "" : ")");
  if (o.sample_bytes > 0) {
    const std::string prompt = held_out_prompt(text, split, o.seed);
    const std::string continuation = sample(tr, ps, o.seq, prompt, o.sample_bytes, o.sample_temperature, o.seed);
    if (root) {
      std::string shown;
      for (char ch : continuation) shown += (ch == '\n' || (ch >= 32 && ch < 127)) ? ch : '?';
      std::printf("sample (prompt: %zu held-out bytes, temperature %g):\n%s\n", prompt.size(), o.sample_temperature,
                  shown.c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const options o = parse(argc, argv);
  if (o.help) {
    if (env.rank() == 0) std::fputs(usage, stdout);
    return 0;
  }
  // The machine, measured before anything else runs: MFU is against the
  // peak of these cores for the precision the GEMMs run in.
  const examples::machine_peak peak = examples::measure_peak(o.precision);
  const examples::corpus corpus = examples::load_corpus("train", o.text_path);
  if (corpus.text.size() < 4096)
    throw error("gshard train: the text has " + std::to_string(corpus.text.size()) + " bytes; give at least 4096");
  try {
    return examples::on_fitting_mesh([&](const auto& m) { return train(m, o, corpus, peak); });
  } catch (const std::bad_alloc&) {  // perhaps on this rank alone: the terminate handler ends the job with it
    throw error("gshard train: out of memory with --batch " + std::to_string(o.batch) + " --seq " + std::to_string(o.seq) +
                "; give a smaller --batch or --seq");
  }
}
