// examples/cost.cpp — sizes a training job before it runs: one step of
// gshard's MoE Transformer (or of examples/translate's encoder–decoder) on
// a mesh you describe, counted by the cost model
// (gshard/model/cost.hpp: every einsum, every collective as the planners
// choose it, the state's memory) and timed from a machine — this core,
// measured, unless given — and the network's α–β, which you give.
//   build/examples/cost --gshard --alpha 5e-6 --bandwidth 12.5
//   build/examples/cost --experts 64 --expert 64 --layers 12 --alpha 2e-6 --bandwidth 25
//   build/examples/cost --encoder-decoder --source 24 --seq 32 --expert 2 --alpha 5e-6 --bandwidth 12.5
// One process; no mpirun needed (the local measurements take a few seconds).
#include <gshard/gshard.hpp>
#include <gshard/model/machine.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
using namespace gshard;
namespace costs = gshard::model::cost;

namespace {

constexpr const char* usage =
    "usage: cost [options]   (one process)\n"
    "Counts one training step of gshard's MoE Transformer (or encoder-decoder) per rank — FLOPs,\n"
    "collectives, memory — and predicts its time from this core's measured rates and the network's\n"
    "alpha and bandwidth.\n"
    "  --gshard             GShard's configurations (M 1024, H 8192, 16 heads of 64, 36 blocks, E = D\n"
    "                       experts at D = 128, 512, 2048 ranks on one expert axis), as a table\n"
    "model (default: examples/train's): --model M --heads N --head-dim K --hidden H --experts E\n"
    "  --layers N --vocab V --top-k K --capacity-factor F --min-capacity C (4) --shared-experts N --swiglu\n"
    "  --overlap-degree K (the MoE all_to_alls in K chunks of the capacity: K calls each, the same bytes)\n"
    "  --encoder-decoder    examples/translate's model instead: --layers blocks (2) in each of its\n"
    "                       encoder and decoder, sources of --source S positions (default: --seq), the\n"
    "                       decoder's --seq (33), --vocab 286, --sequences-per-rank 32, --head-dim M/4\n"
    "batch: --seq L (128; 1024 with --gshard)  --sequences-per-rank B (8; 4 with --gshard)\n"
    "mesh: --data D --expert E --model-axis M (1, 2, none): the batch over data x expert, experts\n"
    "  over expert, heads and hidden units over model\n"
    "  --replicated-update  the update of replicated weights on every rank (default: sharded)\n"
    "  --optimizer adam|adafactor  the optimizer whose state is counted (adam; --gshard shows both)\n"
    "  --bucket-kib K       weights' reductions and gathers share collectives up to K KiB (4096;\n"
    "                       0: one collective per weight), as parameters::set_bucket_bytes\n"
    "network (needed for more than one rank): --alpha S (seconds per message round)\n"
    "  --bandwidth G (GB/s each rank sends and receives)\n"
    "machine, per rank (default: this core, measured): --gemm-gflops G --stream-gbps W\n"
    "  --exp-per-ns X (softmax elements per ns) --adam-per-ns Y (Adam elements per ns)\n";

struct options {
  model::config c;
  costs::mesh_sizes mesh{1, 2, 1, false};
  index_t seq = 128, per_rank = 8;
  bool seq_given = false, per_rank_given = false, layers_given = false, vocab_given = false, head_dim_given = false;
  bool sharded = true, gshard_table = false, help = false;
  bool encoder_decoder = false;
  index_t source = 0;  // 0: the targets' length
  std::vector<std::string> lm_only;  // options that apply to the Transformer alone, as given
  costs::optimizer_kind optimizer = costs::optimizer_kind::adam;
  std::size_t bucket_bytes = default_bucket_bytes;
  double alpha = -1, bandwidth = -1;
  double gemm = 0, stream = 0, exp = 0, adam = 0;
};

options parse(int argc, char** argv) {
  options o;
  o.c.model = 128, o.c.heads = 4, o.c.head_dim = 32, o.c.hidden = 256, o.c.experts = 8, o.c.layers = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw error("gshard cost: " + a + " needs a value");
      return argv[++i];
    };
    auto whole = [&](long long lo, long long hi = INT_MAX) { return index_t(examples::number<long long>("cost", a, next(), lo, hi)); };
    auto real = [&](double lo) { return examples::number<double>("cost", a, next(), lo); };
    if (a == "--help" || a == "-h") o.help = true;
    else if (a == "--gshard") o.gshard_table = true;
    else if (a == "--model") o.c.model = whole(1);
    else if (a == "--heads") o.c.heads = whole(1);
    else if (a == "--head-dim") o.c.head_dim = whole(1), o.head_dim_given = true;
    else if (a == "--hidden") o.c.hidden = whole(1);
    else if (a == "--experts") o.c.experts = whole(0);
    else if (a == "--layers") o.c.layers = int(whole(1, 10000)), o.layers_given = true;  // the count lists every block's weights
    else if (a == "--vocab") o.c.vocab = whole(1), o.vocab_given = true;
    else if (a == "--top-k") o.c.gating.top_k = int(whole(1));
    else if (a == "--capacity-factor") o.c.gating.capacity_factor = real(0);
    else if (a == "--min-capacity") o.c.gating.min_capacity = whole(1);
    else if (a == "--shared-experts") o.c.shared_experts = int(whole(0)), o.lm_only.push_back(a);
    else if (a == "--overlap-degree") o.c.overlap_degree = int(std::min<index_t>(whole(1), 1 << 16)), o.lm_only.push_back(a);
    else if (a == "--encoder-decoder") o.encoder_decoder = true;
    else if (a == "--source") o.source = whole(1);
    else if (a == "--swiglu") o.c.ffn = ffn_kind::swiglu;
    else if (a == "--seq") o.seq = whole(1), o.seq_given = true;
    else if (a == "--sequences-per-rank") o.per_rank = whole(1), o.per_rank_given = true;
    else if (a == "--data") o.mesh.data = whole(1);
    else if (a == "--expert") o.mesh.expert = whole(1);
    else if (a == "--model-axis") o.mesh.model = whole(1), o.mesh.has_model_axis = true;
    else if (a == "--replicated-update") o.sharded = false;
    else if (a == "--optimizer") {
      const std::string v = next();
      if (v != "adam" && v != "adafactor") throw error("gshard cost: --optimizer is adam or adafactor, not '" + v + "'");
      o.optimizer = v == "adam" ? costs::optimizer_kind::adam : costs::optimizer_kind::adafactor;
    }
    else if (a == "--bucket-kib") o.bucket_bytes = std::size_t(whole(0)) * 1024;
    else if (a == "--alpha") o.alpha = real(0);
    else if (a == "--bandwidth") o.bandwidth = real(1e-9);
    else if (a == "--gemm-gflops") o.gemm = real(1e-9);
    else if (a == "--stream-gbps") o.stream = real(1e-9);
    else if (a == "--exp-per-ns") o.exp = real(1e-9);
    else if (a == "--adam-per-ns") o.adam = real(1e-9);
    else throw error("gshard cost: unknown option " + a + " (--help lists them)");
  }
  if (o.gshard_table) o.lm_only.push_back("--gshard");
  if (o.c.experts > 0 && o.c.gating.top_k > o.c.experts)
    throw error("gshard cost: --top-k " + std::to_string(o.c.gating.top_k) + " is more than the " + std::to_string(o.c.experts) +
                " experts (--experts)");
  if (o.encoder_decoder && !o.lm_only.empty())
    throw error("gshard cost: " + o.lm_only.front() + " describes the Transformer; the encoder-decoder has no such option");
  if (o.source > 0 && !o.encoder_decoder) throw error("gshard cost: --source is the encoder-decoder's; give --encoder-decoder too");
  if (o.encoder_decoder) {  // examples/translate's defaults at 2 ranks: 64 pairs of up to 32 bytes a side
    if (!o.layers_given) o.c.layers = 2;
    if (!o.head_dim_given) o.c.head_dim = std::max<index_t>(1, o.c.model / 4);  // translate's 4 heads of M/4
    if (!o.vocab_given) o.c.vocab = 256 + 30;
    if (!o.seq_given) o.seq = 33;
    if (!o.per_rank_given) o.per_rank = 32;
  }
  return o;
}

// The counts are 64-bit integers: a configuration whose weights or whose
// largest per-rank tensor (attention's scores, the logits, the router's
// logits, the experts' dispatched tokens: E x tokens x M at most, as C <= S)
// would pass 2^53 elements is refused, naming its size, before anything is
// counted.
void check_size(const options& o) {
  const model::config& c = o.c;
  const double M = double(c.model), NK = double(c.heads) * double(c.head_dim), H = double(c.hidden), V = double(c.vocab);
  const double E = double(std::max<index_t>(c.experts, 1)) + double(c.shared_experts);
  const double stacks = o.encoder_decoder ? 2 : 1, L = double(std::max(o.seq, o.source));
  const double params = stacks * double(c.layers) * (4 * M * NK + E * 3 * M * H) + 2 * V * M;
  const double rows = double(o.per_rank) * L;  // tokens per rank
  const double widest =
      rows * std::max({M, NK, H * std::max(1.0, double(c.gating.top_k)), V, double(c.heads) * L, E, E * std::max(M, H)});
  const double ranks = double(o.mesh.data) * double(o.mesh.expert) * double(o.mesh.model);
  constexpr double most = 9007199254740992.0;  // 2^53
  char b[256];
  if (params > most || widest > most || ranks > most || rows * ranks > most) {
    std::snprintf(b, sizeof b, "gshard cost: %.3g parameters, %.3g elements in a rank's largest tensor and %.3g ranks: more than "
                  "the 2^53 the counts hold; give smaller sizes", params, widest, ranks);
    throw error(b);
  }
}

std::string bytes_text(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char t[32];
  std::snprintf(t, sizeof t, "%.1f %s", b, unit[u]);
  return t;
}

std::string axes_text(std::uint32_t axes) {
  std::string t;
  for (const auto& [bit, name] : {std::pair{costs::data_bit, "data"}, {costs::expert_bit, "expert"}, {costs::model_bit, "model"}})
    if (axes & bit) t += (t.empty() ? "" : ",") + std::string(name);
  return t;
}

// The machine: what the options give, the rest measured on this core.
costs::machine machine_of(const options& o) {
  const bool given = o.gemm > 0 && o.stream > 0 && o.exp > 0 && o.adam > 0;
  costs::machine mc = given ? costs::machine{} : costs::measure_machine(world_group());
  if (o.gemm > 0) mc.gemm_flops = o.gemm * 1e9;
  if (o.stream > 0) mc.elementwise_bytes_per_s = o.stream * 1e9;
  if (o.exp > 0) mc.exp_per_s = o.exp * 1e9;
  if (o.adam > 0) mc.adam_elements_per_s = o.adam * 1e9;
  const costs::alpha_beta net{o.alpha, o.bandwidth * 1e9};
  mc.all_to_all = mc.all_reduce = mc.reduce_scatter = mc.all_gather = net;
  return mc;
}

// examples/translate's model of the options' sizes: --layers blocks in
// each stack, an MoE FFN in every other block of both, label smoothing 0.1
// (its default: the loss's all_reduce carries a third number).
model::seq2seq_config encoder_decoder_of(const options& o) {
  const model::config& c = o.c;
  model::seq2seq_config s;
  s.vocab = c.vocab, s.model = c.model, s.heads = c.heads, s.head_dim = c.head_dim, s.hidden = c.hidden, s.experts = c.experts;
  s.encoder_layers = s.decoder_layers = c.layers;
  s.gating = c.gating, s.ffn = c.ffn;
  s.label_smoothing = 0.1;
  return s;
}

void describe(const options& o, const costs::machine& mc) {
  const model::config& c = o.c;
  const costs::mesh_sizes& m = o.mesh;
  const index_t B = o.per_rank * m.data * m.expert, S = o.source > 0 ? o.source : o.seq;
  costs::step_options so{B, o.seq, o.sharded, 4, o.bucket_bytes, o.optimizer};
  so.source = S;
  const model::seq2seq_config ed = encoder_decoder_of(o);
  const auto w = o.encoder_decoder ? costs::count_step(ed, m, so) : costs::count_step(c, m, so);
  const auto p = costs::predict(w, m, mc);
  if (!std::isfinite(p.total_s()))
    throw error("gshard cost: the predicted step time is not finite (GEMMs " + std::to_string(p.gemm_s) + " s, element-wise " +
                std::to_string(p.elementwise_s) + " s, communication " + std::to_string(p.communication_s) +
                " s): check the machine's and the network's rates");
  double params = 0;
  for (const auto& x : o.encoder_decoder ? costs::weights(ed) : costs::weights(c)) params += double(x.elements());
  if (o.encoder_decoder) {
    std::printf("model: encoder-decoder, M %ld, %ld heads of %ld, H %ld, %d + %d blocks, E %ld (top-%d, capacity factor %g: "
                "C %ld in the encoder, %ld in the decoder), V %ld; %.3gB parameters\n",
                long(c.model), long(c.heads), long(c.head_dim), long(c.hidden), ed.encoder_layers, ed.decoder_layers,
                long(c.experts), c.gating.top_k, c.gating.capacity_factor, long(w.capacity), long(w.decoder_capacity),
                long(c.vocab), params * 1e-9);
  } else {
    std::printf("model: M %ld, %ld heads of %ld, H %ld, %d blocks, E %ld (top-%d, capacity factor %g: C %ld), V %ld; %.3gB parameters\n",
                long(c.model), long(c.heads), long(c.head_dim), long(c.hidden), c.layers, long(c.experts), c.gating.top_k,
                c.gating.capacity_factor, long(w.capacity), long(c.vocab), params * 1e-9);
  }
  const std::string rows = o.encoder_decoder ? "pairs of " + std::to_string(S) + " -> " + std::to_string(o.seq)
                                             : "sequences of " + std::to_string(o.seq);
  std::printf("mesh: data %ld x expert %ld%s = %ld ranks; %ld %s per rank (batch %ld); weight update %s\n",
              long(m.data), long(m.expert), m.has_model_axis ? (" x model " + std::to_string(m.model)).c_str() : "",
              long(m.ranks()), long(o.per_rank), rows.c_str(), long(B), o.sharded ? "sharded" : "replicated");
  std::printf("machine per rank: GEMM %.1f GFLOP/s, stream %.1f GB/s, softmax %.2f/ns, Adam %.2f/ns; network alpha %.3g s, %.3g GB/s\n",
              mc.gemm_flops * 1e-9, mc.elementwise_bytes_per_s * 1e-9, mc.exp_per_s * 1e-9, mc.adam_elements_per_s * 1e-9,
              mc.all_to_all.alpha, mc.all_to_all.beta * 1e-9);
  std::printf("per rank and step (the busiest rank's, where an extent does not divide): %.3g TFLOP of model FLOPs; collectives:\n",
              w.model_flops * 1e-12);
  for (std::size_t i = 0; i < w.collectives.size(); ++i) {
    const auto& x = w.collectives[i];
    std::printf("  %-15s over %-18s %6d calls %12s %10.3f s  (%s)\n", std::string(name_of(x.kind)).c_str(),
                axes_text(x.axes).c_str(), x.calls, bytes_text(x.bytes).c_str(), p.collective_s[i], x.what.c_str());
  }
  std::printf("memory per rank: parameters %s, gradients %s, %s %s, activations about %s\n", bytes_text(w.parameter_bytes).c_str(),
              bytes_text(w.gradient_bytes).c_str(), o.optimizer == costs::optimizer_kind::adam ? "Adam" : "Adafactor",
              bytes_text(w.optimizer_bytes).c_str(), bytes_text(w.activation_bytes).c_str());
  std::printf("predicted step: %.3f s = GEMMs %.3f + element-wise %.3f + communication %.3f (%.0f%%), nothing overlapped\n",
              p.total_s(), p.gemm_s, p.elementwise_s, p.communication_s, 100 * p.communication_share());
}

// GShard's own: M 1024, H 8192, 16 heads (of 64), 36 blocks (18 MoE), top-2,
// capacity factor 2, E = D experts (one per rank), D ranks on one axis; the
// work per rank fixed (weak scaling, as GShard §5.1 grows E with D): by
// default 4 sequences of 1024 tokens per rank.
void gshard_table(options o, const costs::machine& mc) {
  o.c.model = 1024, o.c.hidden = 8192, o.c.heads = 16, o.c.head_dim = 64, o.c.layers = 36;
  if (!o.seq_given) o.seq = 1024;
  if (!o.per_rank_given) o.per_rank = 4;
  for (index_t D : {128, 512, 2048}) {  // every row countable before the first is printed
    options row = o;
    row.c.experts = D, row.mesh = {1, D, 1, false};
    check_size(row);
  }
  std::printf("GShard's configurations: M 1024, H 8192, 16 heads of 64, 36 blocks (18 MoE), top-2, capacity factor %g,\n"
              "V %ld, %ld sequences of %ld per rank, E = D (data 1 x expert D), weight update %s\n"
              "machine per rank: GEMM %.1f GFLOP/s, stream %.1f GB/s; network alpha %.3g s, %.3g GB/s per rank\n\n",
              o.c.gating.capacity_factor, long(o.c.vocab), long(o.per_rank), long(o.seq), o.sharded ? "sharded" : "replicated",
              mc.gemm_flops * 1e-9, mc.elementwise_bytes_per_s * 1e-9, mc.all_to_all.alpha, mc.all_to_all.beta * 1e-9);
  std::printf("| D | params | C | TFLOP/rank | step (s) | GEMMs | element-wise | all_to_all | gradients + update | other collectives | comm share | "
              "parameters + gradients/rank | Adam/rank | Adafactor/rank | activations/rank |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (index_t D : {128, 512, 2048}) {
    o.c.experts = D;
    o.mesh = {1, D, 1, false};
    const auto w = costs::count_step(o.c, o.mesh, {o.per_rank * D, o.seq, o.sharded, 4, o.bucket_bytes});
    const auto factored =
        costs::count_step(o.c, o.mesh, {o.per_rank * D, o.seq, o.sharded, 4, o.bucket_bytes, costs::optimizer_kind::adafactor});
    const auto p = costs::predict(w, o.mesh, mc);
    double params = 0, a2a = 0, grads = 0, other = 0;
    for (const auto& x : costs::weights(o.c)) params += double(x.elements());
    for (std::size_t i = 0; i < w.collectives.size(); ++i) {
      const auto& x = w.collectives[i];
      double& into = x.kind == collective::all_to_all ? a2a : x.what == "weight gradients" || x.what == "updated weights" ? grads : other;
      into += p.collective_s[i];
    }
    std::printf("| %ld | %.0fB | %ld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f%% | %s | %s | %s | %s |\n", long(D),
                params * 1e-9, long(w.capacity), w.model_flops * 1e-12, p.total_s(), p.gemm_s, p.elementwise_s, a2a, grads,
                other, 100 * p.communication_share(), bytes_text(w.parameter_bytes + w.gradient_bytes).c_str(),
                bytes_text(w.optimizer_bytes).c_str(), bytes_text(factored.optimizer_bytes).c_str(),
                bytes_text(w.activation_bytes).c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const options o = parse(argc, argv);
  if (o.help) {
    std::fputs(usage, stdout);
    return 0;
  }
  if (world_group().size != 1) throw error("gshard cost: run it as one process; it describes the ranks, it does not use them");
  check_size(o);
  const bool many = o.gshard_table || o.mesh.ranks() > 1;
  if (many && (o.alpha < 0 || o.bandwidth < 0))
    throw error("gshard cost: give the network's --alpha (seconds per message round) and --bandwidth (GB/s per rank) "
                "for a mesh of more than one rank; e.g. --alpha 5e-6 --bandwidth 12.5 for 100 Gbit/s links");
  const costs::machine mc = machine_of(o);
  if (o.gshard_table) gshard_table(o, mc);
  else describe(o, mc);
  return 0;
}
