// examples/translate.cpp — GShard's experiment in the small: one MoE
// encoder–decoder translating many languages into English (the paper's M4
// model: 100 languages; here FreeDict's 30, from Debian's
// dict-freedict-LLL-eng). Each pair is a dictionary headword or example
// sentence and its English; sources start with a token naming their
// language, and both sides are bytes. Languages are sampled at a
// temperature over their sizes, as M4 sampled them.
//   scripts/mpirun -np 2 build/examples/translate [options; --help lists them]
//
// Prints the languages and their pairs, a progress line every --log-every
// steps (loss, aux, tokens/s, drops, MFU against the peak measured at
// start — fp32 FMA's, or bf16's with --precision bf16 — the time left), and every --eval-every steps and at the end, per
// language on a fixed held-out sample: bits per reference byte, exact
// matches and chrF (model/chrf.hpp) of greedy and beam decoding; then a
// few held-out translations beside their references.
#include <gshard/gshard.hpp>
#include <gshard/model/chrf.hpp>
#include <gshard/model/cost.hpp>
#include <gshard/model/seq2seq.hpp>
#include <gshard/model/train.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "freedict.hpp"
#include "progress.hpp"

using namespace gshard;

namespace {

using grid = mesh<axis<"data">, axis<"expert">>;
using net_t = model::seq2seq<float, grid>;

struct options {
  std::vector<std::string> languages;  // empty: every installed one
  int steps = 6000, batch = 64, log_every = 100, eval_every = 1000, eval_sentences = 32, show = 6;
  int experts = 8, model = 128, hidden = 256, slot_hidden = 0, layers = 2, beam = 4, max_bytes = 32, save_every = 0;
  std::string optimizer = "adam";
  matmul_precision precision = matmul_precision::f32;  // --precision
  double temperature = 5, lr = 0, dropout = 0.1, label_smoothing = 0.1, capacity_factor = 2.0;
  std::uint64_t seed = 1;
  std::string metrics, save, resume;
  bool help = false;
};

const char* usage =
    "usage: mpirun -np P translate [options]   (any P)\n"
    "  trains one encoder-decoder to translate FreeDict's languages into English\n"
    "  --languages a,b,... FreeDict codes (deu,jpn,...; default: every dict-freedict-LLL-eng installed)\n"
    "  --steps N          training steps (6000: about 12 minutes at 2 ranks of a 2-core machine)\n"
    "  --batch N          pairs per step, over every rank (64)\n"
    "  --temperature T    languages sampled with p ∝ (pairs share)^(1/T) (5, as M4; 1: by size)\n"
    "  --max-bytes N      pairs with a side longer than N bytes are left out (32)\n"
    "  --experts E        experts of each MoE layer, in blocks 1, 3, ... of both stacks (8; 0: a dense model; else 2 or more)\n"
    "  --hidden H         FFN width of the dense blocks and of each expert (256)\n"
    "  --slot-hidden H    a dense model's FFN width in blocks 1, 3, ... (0: --hidden; 2H matches top-2's FLOPs)\n"
    "  --model M          model width, a multiple of 4: 4 heads of M/4 (128)\n"
    "  --layers L         blocks of the encoder and of the decoder (2)\n"
    "  --capacity-factor C  each expert's capacity, in tokens per expert of an even split (2)\n"
    "  --dropout R        dropout while training (0.1, as GShard's M4)\n"
    "  --label-smoothing E  the target (1 - E) onehot + E/V (0.1, the value of Lingvo's MT setups)\n"
    "  --optimizer adam|adafactor  Adam, or Adafactor as GShard trained M4: factored second moments, no first\n"
    "                     moment, decay min(0.99, 1 - t^-0.8), updates clipped at RMS 1 (adam)\n"
    "  --lr X             the peak learning rate (2e-3; adafactor 3e-3), warmed up over the first 5% of the steps\n"
    "  --precision f32|bf16  the GEMMs' operands in fp32, or rounded to bf16 and multiplied on the CPU's bf16\n"
    "                     units with fp32 sums, the MoE all_to_alls and the weights in bf16; master weights\n"
    "                     and optimizer state, the router, norms, softmax and the loss stay fp32: 1.3-1.4x the\n"
    "                     tokens/s on a core with AVX512_BF16 (docs/14_translation.md) (f32)\n"
    "  --seed N           weights, batches, routing and dropout (1)\n"
    "  --log-every N      steps between progress lines (100)\n"
    "  --eval-every N     steps between held-out evaluations (1000; 0: at the end only)\n"
    "  --eval-sentences N held-out pairs per language evaluated (32)\n"
    "  --beam W           beam width of the beam decoding evaluated (4)\n"
    "  --show N           held-out translations printed at the end, one per language, N in all (6)\n"
    "  --metrics FILE     one JSON line per step, with each evaluation's figures per language\n"
    "  --save FILE        checkpoint at the end, every --save-every N steps, and on SIGTERM/SIGINT\n"
    "  --resume FILE      continue from a checkpoint of the same languages and sizes, at any rank count\n";

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      o.help = true;
      return o;
    }
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw error("gshard translate: " + a + " needs a value");
      return argv[++i];
    };
    auto integer = [&](int lo, int hi = INT_MAX) { return int(examples::number<long long>("translate", a, next(), lo, hi)); };
    auto real = [&](double lo, double hi) { return examples::number<double>("translate", a, next(), lo, hi); };
    if (a == "--languages") {
      const std::string v = next();
      o.languages.clear();
      for (std::size_t at = 0; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        if (comma == at) throw error("gshard translate: --languages '" + v + "' has an empty code; give codes like deu,jpn");
        o.languages.push_back(v.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "--steps") o.steps = integer(1);
    else if (a == "--batch") o.batch = integer(1, 1 << 20);
    else if (a == "--temperature") o.temperature = real(1e-3, 1e6);
    else if (a == "--max-bytes") o.max_bytes = integer(1, 1000);
    else if (a == "--experts") o.experts = integer(0, 1 << 16);
    else if (a == "--hidden") o.hidden = integer(1, 1 << 20);
    else if (a == "--slot-hidden") o.slot_hidden = integer(0, 1 << 20);
    else if (a == "--model") o.model = integer(1, 1 << 16);
    else if (a == "--layers") o.layers = integer(1, 64);
    else if (a == "--capacity-factor") o.capacity_factor = real(1e-3, 1e6);
    else if (a == "--dropout") o.dropout = real(0, 0.99);
    else if (a == "--label-smoothing") o.label_smoothing = real(0, 0.99);
    else if (a == "--lr") o.lr = real(1e-9, 1);
    else if (a == "--optimizer") {
      o.optimizer = next();
      if (o.optimizer != "adam" && o.optimizer != "adafactor")
        throw error("gshard translate: --optimizer is adam or adafactor, not '" + o.optimizer + "'");
    } else if (a == "--precision") {
      const std::string v = next();
      if (v != "f32" && v != "bf16") throw error("gshard translate: --precision is f32 or bf16, not '" + v + "'");
      o.precision = v == "f32" ? matmul_precision::f32 : matmul_precision::bf16;
    }
    else if (a == "--seed") o.seed = std::uint64_t(examples::number<long long>("translate", a, next(), 0, LLONG_MAX));
    else if (a == "--log-every") o.log_every = integer(1);
    else if (a == "--eval-every") o.eval_every = integer(0);
    else if (a == "--eval-sentences") o.eval_sentences = integer(1, 1 << 16);
    else if (a == "--beam") o.beam = integer(1, 64);
    else if (a == "--show") o.show = integer(0, 1 << 16);
    else if (a == "--metrics") o.metrics = next();
    else if (a == "--save") o.save = next();
    else if (a == "--save-every") o.save_every = integer(0);
    else if (a == "--resume") o.resume = next();
    else if (a.rfind("--", 0) == 0) throw error("gshard translate: unknown option " + a + " (--help lists them)");
    else throw error("gshard translate: takes options only, not '" + a + "' (--help lists them)");
  }
  if (o.experts == 1)
    throw error("gshard translate: --experts 1: top-2 routing needs 2 experts or more; give --experts 0 for a dense model");
  if (o.model % 4 != 0)
    throw error("gshard translate: --model " + std::to_string(o.model) + " is not a multiple of 4: the model's 4 heads take a quarter of it each");
  if (o.slot_hidden > 0 && o.experts > 0)
    throw error("gshard translate: --slot-hidden " + std::to_string(o.slot_hidden) + " is for a dense model; give --experts 0");
  if (o.save.empty() && o.save_every > 0)
    throw error("gshard translate: --save-every needs --save FILE: without it the steps trained would be lost");
  return o;
}

// Rank 0's check of the files, before anything is read or trained: no
// output names an input or the other output — the metrics never overwrite a
// checkpoint or a dictionary (--save naming the --resume checkpoint is how a
// run continues, and is allowed) —, each can be written, and the --resume
// checkpoint can be opened.
std::string check_files(const options& o) {
  std::vector<std::pair<std::string, std::string>> inputs{{"--resume", o.resume}};
  for (const auto& f : examples::input_files(examples::freedict_dir))
    if (std::filesystem::path(f).filename().string().rfind("freedict-", 0) == 0) inputs.emplace_back("a dictionary", f);
  const std::vector<std::pair<std::string, std::string>> outputs{{"--save", o.save}, {"--metrics", o.metrics}};
  if (const std::string p = examples::outputs_spare_inputs(outputs, inputs); !p.empty()) return p;
  for (const auto& [option, path] : outputs)
    if (!path.empty())
      if (const std::string p = io::check_writable(path); !p.empty()) return option + " " + path + ": " + p;
  if (!o.resume.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(o.resume, ec))
      return "--resume " + o.resume + ": " + (std::filesystem::exists(o.resume, ec) ? "not a file" : "no such file");
    std::FILE* f = std::fopen(o.resume.c_str(), "rb");
    if (!f) return "--resume " + o.resume + ": cannot open it: " + io::reason();
    std::fclose(f);
  }
  return "";
}

// The corpus as the model sees it: per language its pairs that fit
// max_bytes, its tag token (256 + its index) and its sampling probability.
struct language {
  std::string code;
  std::vector<examples::translation_pair> train, held;
  std::size_t left_out = 0;  // pairs longer than max_bytes
  double p = 0;
};

bool fits(const examples::translation_pair& pr, int max_bytes) {
  const auto printable = [](const std::string& s) {
    return std::all_of(s.begin(), s.end(), [](char ch) { return static_cast<unsigned char>(ch) >= 32; });
  };
  return pr.source.size() <= std::size_t(max_bytes) && pr.target.size() <= std::size_t(max_bytes) && printable(pr.source) &&
         printable(pr.target);
}

std::vector<language> prepare(std::vector<examples::language_corpus> read, const options& o) {
  std::vector<language> langs;
  std::vector<std::size_t> sizes;
  for (auto& c : read) {
    language l{c.code, {}, {}, 0, 0};
    for (auto* side : {&c.train, &c.held})
      for (auto& pr : *side) {
        if (!fits(pr, o.max_bytes)) {
          ++l.left_out;
          continue;
        }
        (side == &c.train ? l.train : l.held).push_back(std::move(pr));
      }
    if (l.train.empty() || l.held.empty())
      throw error("gshard translate: " + c.path + " has no " + (l.train.empty() ? "training" : "held-out") +
                  " pair of at most --max-bytes " + std::to_string(o.max_bytes) + " bytes a side; give a larger --max-bytes "
                  "or leave " + c.code + " out of --languages");
    sizes.push_back(l.train.size());
    langs.push_back(std::move(l));
  }
  const std::vector<double> p = examples::temperature_sampling(sizes, o.temperature);
  for (std::size_t i = 0; i < langs.size(); ++i) langs[i].p = p[i];
  return langs;
}

// Sources [B, S]: the language's tag, then the source's bytes (0 after);
// their lengths; targets [B, L+1]: bos, the English bytes, eos, then -1.
// A null pair is a row that counts for nothing (a source of the tag alone,
// a target of bos alone).
struct batch {
  net_t::tokens_type src, tgt;
  net_t::lengths_type lengths;
};
batch make_batch(const grid& m, const std::vector<std::pair<int, const examples::translation_pair*>>& rows,
                 const model::seq2seq_config& c) {
  const index_t B = index_t(rows.size());
  std::size_t S = 1, T = 0;
  for (const auto& [lang, pr] : rows)
    if (pr) S = std::max(S, pr->source.size() + 1), T = std::max(T, pr->target.size());
  local_tensor<std::int32_t, 2> src(B, index_t(S)), tgt(B, index_t(T) + 2);
  local_tensor<std::int32_t, 1> len(B);
  src.setZero();
  tgt.setConstant(-1);
  for (index_t b = 0; b < B; ++b) {
    const auto& [lang, pr] = rows[std::size_t(b)];
    src(b, 0) = std::int32_t(256 + lang);
    tgt(b, 0) = c.bos;
    len(b) = 1;
    if (!pr) continue;
    len(b) = std::int32_t(pr->source.size() + 1);
    for (std::size_t k = 0; k < pr->source.size(); ++k) src(b, index_t(k) + 1) = static_cast<unsigned char>(pr->source[k]);
    for (std::size_t k = 0; k < pr->target.size(); ++k) tgt(b, index_t(k) + 1) = static_cast<unsigned char>(pr->target[k]);
    tgt(b, index_t(pr->target.size()) + 1) = c.eos;
  }
  return {distribute<net_t::tokens_type>(m, src), distribute<net_t::tokens_type>(m, tgt),
          distribute<net_t::lengths_type>(m, len)};
}

// Step `step`'s pairs: each row's language drawn by the sampling
// probabilities, then a pair of it uniformly — keyed by (seed, step, row),
// the same on every rank and at every rank count.
std::vector<std::pair<int, const examples::translation_pair*>> training_rows(const std::vector<language>& langs, int B,
                                                                             std::uint64_t seed, std::uint64_t step) {
  std::vector<std::pair<int, const examples::translation_pair*>> rows;
  for (int b = 0; b < B; ++b) {
    double u = uniform(seed, 0x7A11, step, std::uint64_t(b));
    std::size_t l = 0;
    while (l + 1 < langs.size() && (u -= langs[l].p) >= 0) ++l;
    const auto& pairs = langs[l].train;
    const auto i = std::min(pairs.size() - 1, std::size_t(uniform(seed, 0x7A12, step, std::uint64_t(b)) * double(pairs.size())));
    rows.emplace_back(int(l), &pairs[i]);
  }
  return rows;
}

// A language's held-out sample: up to n pairs spread evenly over its
// held-out pairs, padded to n rows with null ones.
std::vector<std::pair<int, const examples::translation_pair*>> held_rows(const std::vector<language>& langs, std::size_t l, int n) {
  const auto& held = langs[l].held;
  std::vector<std::pair<int, const examples::translation_pair*>> rows;
  const std::size_t k = std::min(held.size(), std::size_t(n));
  for (std::size_t i = 0; i < std::size_t(n); ++i) rows.emplace_back(int(l), i < k ? &held[i * held.size() / k] : nullptr);
  return rows;
}

std::string text_of(const std::vector<std::int32_t>& tokens, std::int32_t eos) {
  std::string s;
  for (auto v : tokens) {
    if (v == eos) break;
    if (v >= 32 && v < 256) s += char(v);
  }
  return s;
}

// One language's held-out figures.
struct language_eval {
  double bpb = 0, exact_greedy = 0, exact_beam = 0, chrf_greedy = 0, chrf_beam = 0;
  int pairs = 0;
  std::vector<std::string> shown;  // rank 0's first translations: "source -> greedy  (reference)"
};

language_eval evaluate(const net_t& net, parameters<grid>& ps, const std::vector<language>& langs, std::size_t l,
                       const options& o, int show) {
  const grid& m = ps.mesh();
  const auto rows = held_rows(langs, l, o.eval_sentences);
  const batch d = make_batch(m, rows, net.cfg());
  language_eval e;
  {
    tape t(ps, tape::no_grad);
    e.bpb = net.forward(t, d.src, d.lengths, d.tgt, 0).ce / std::log(2.0);  // nats per target byte (eos included) in bits
  }
  const index_t steps = o.max_bytes + 1;
  const auto greedy = net.greedy(d.src, d.lengths, steps, 0);
  const auto beam = net.beam_search(d.src, d.lengths, {o.beam, 0.6, steps}, 0);
  // This rank's rows: exact matches and chrF statistics, summed over the ranks.
  std::vector<double> sums(2 + 6 * model::chrf_order, 0.0);
  const index_t first = d.lengths.offsets()[0];
  for (std::size_t b = 0; b < greedy.size(); ++b) {
    const auto* pr = rows[std::size_t(first) + b].second;
    if (!pr) continue;
    const std::string g = text_of(greedy[b], net.cfg().eos), bm = text_of(beam[b], net.cfg().eos);
    sums[0] += g == pr->target;
    sums[1] += bm == pr->target;
    const model::chrf_stats sg = model::chrf_statistics(g, pr->target), sb = model::chrf_statistics(bm, pr->target);
    for (int n = 0; n < model::chrf_order; ++n) {
      double* at = sums.data() + 2 + 6 * n;
      at[0] += double(sg.hyp[n]), at[1] += double(sg.ref[n]), at[2] += double(sg.match[n]);
      at[3] += double(sb.hyp[n]), at[4] += double(sb.ref[n]), at[5] += double(sb.match[n]);
    }
    if (int(e.shown.size()) < show) e.shown.push_back(pr->source + " -> " + g + "  (" + pr->target + ")");
  }
  all_reduce<double>(m.all_axes(), sums);
  model::chrf_stats sg, sb;
  for (int n = 0; n < model::chrf_order; ++n) {
    const double* at = sums.data() + 2 + 6 * n;
    sg.hyp[n] = std::uint64_t(at[0]), sg.ref[n] = std::uint64_t(at[1]), sg.match[n] = std::uint64_t(at[2]);
    sb.hyp[n] = std::uint64_t(at[3]), sb.ref[n] = std::uint64_t(at[4]), sb.match[n] = std::uint64_t(at[5]);
  }
  e.pairs = int(std::min(langs[l].held.size(), std::size_t(o.eval_sentences)));
  e.exact_greedy = sums[0] / e.pairs, e.exact_beam = sums[1] / e.pairs;
  e.chrf_greedy = model::chrf_score(sg), e.chrf_beam = model::chrf_score(sb);
  return e;
}

// Every language's figures: printed as a table on rank 0, and as the
// metrics' JSON: {"deu":{...},...},"eval_mean":{...} (the means over the
// languages). Nothing when stop() (asked before each language, the same on
// every rank) says to stop: the run then saves within its launcher's grace.
std::optional<std::string> evaluate_all(const net_t& net, parameters<grid>& ps, const std::vector<language>& langs,
                                        const options& o, int step, bool last, const std::function<bool()>& stop) {
  const bool root = ps.mesh().rank() == 0;
  using moe::detail::json_number;
  std::string json = "{";
  double sums[5] = {0, 0, 0, 0, 0};
  std::vector<std::string> shown;
  for (std::size_t l = 0; l < langs.size(); ++l) {
    if (stop()) return std::nullopt;
    if (root && l == 0)
      std::printf("held-out at step %d, up to %d pairs per language:\n  lang   bits/byte  exact greedy  beam %d   chrF greedy  beam %d\n",
                  step, o.eval_sentences, o.beam, o.beam);
    const language_eval e = evaluate(net, ps, langs, l, o, last && shown.size() < std::size_t(o.show) ? 1 : 0);
    for (const auto& s : e.shown) shown.push_back("[" + langs[l].code + "] " + s);
    sums[0] += e.bpb, sums[1] += e.exact_greedy, sums[2] += e.exact_beam, sums[3] += e.chrf_greedy, sums[4] += e.chrf_beam;
    if (root)
      std::printf("  %-5s  %9.3f  %11.1f%%  %5.1f%%   %11.1f  %6.1f\n", langs[l].code.c_str(), e.bpb, 100 * e.exact_greedy,
                  100 * e.exact_beam, e.chrf_greedy, e.chrf_beam);
    json += (l ? ",\"" : "\"") + langs[l].code + "\":{\"pairs\":" + std::to_string(e.pairs) + ",\"bpb\":" + json_number(e.bpb) +
            ",\"exact_greedy\":" + json_number(e.exact_greedy) + ",\"exact_beam\":" + json_number(e.exact_beam) +
            ",\"chrf_greedy\":" + json_number(e.chrf_greedy) + ",\"chrf_beam\":" + json_number(e.chrf_beam) + "}";
  }
  const double n = double(langs.size());
  if (root) {
    std::printf("  mean   %9.3f  %11.1f%%  %5.1f%%   %11.1f  %6.1f\n", sums[0] / n, 100 * sums[1] / n, 100 * sums[2] / n,
                sums[3] / n, sums[4] / n);
    for (const auto& s : shown) std::printf("  %s\n", s.c_str());
    std::fflush(stdout);
  }
  return json + "},\"eval_mean\":{\"bpb\":" + json_number(sums[0] / n) + ",\"exact_greedy\":" + json_number(sums[1] / n) +
         ",\"exact_beam\":" + json_number(sums[2] / n) + ",\"chrf_greedy\":" + json_number(sums[3] / n) +
         ",\"chrf_beam\":" + json_number(sums[4] / n) + "}";
}

// What a checkpoint must agree on to be resumed: the languages, in the order
// of their tags ("language.deu" = its index), and every size; the shapes
// alone would let another set of as many languages through.
std::map<std::string, double> run_meta(const std::vector<language>& langs, const model::seq2seq_config& c) {
  std::map<std::string, double> meta{{"experts", double(c.experts)}, {"model", double(c.model)},
                                     {"hidden", double(c.hidden)},   {"slot_hidden", double(c.slot_hidden)},
                                     {"layers", double(c.encoder_layers)}};
  for (std::size_t i = 0; i < langs.size(); ++i) meta["language." + langs[i].code] = double(i);
  return meta;
}

// "" when the checkpoint's metadata fits this run, else what differs.
std::string resumable(const std::map<std::string, double>& saved, const std::map<std::string, double>& now,
                      const std::string& path) {
  std::vector<std::string> theirs(saved.size()), ours(now.size());
  for (const auto* m : {&saved, &now})
    for (const auto& [key, v] : *m)
      if (key.rfind("language.", 0) == 0 && v >= 0 && v < double(m->size()))
        (m == &saved ? theirs : ours)[std::size_t(v)] = key.substr(9);
  const auto listed = [](std::vector<std::string> v) {
    std::string s;
    for (const auto& c : v)
      if (!c.empty()) s += (s.empty() ? "" : ",") + c;
    return s;
  };
  if (listed(theirs) != listed(ours))
    return path + " was trained on " + std::to_string(std::count_if(theirs.begin(), theirs.end(), [](auto& c) { return !c.empty(); })) +
           " other languages; give the same --languages (it has " + listed(theirs) + ", this run " + listed(ours) + ")";
  for (const auto& [key, v] : now)
    if (const auto it = saved.find(key); key.rfind("language.", 0) != 0 && (it == saved.end() || it->second != v))
      return path + " was trained with " + key + " " + (it == saved.end() ? std::string("unknown") : std::to_string(long(it->second))) +
             "; this run has " + std::to_string(long(v)) + " (give the same sizes)";
  return "";
}

// The model of the options, for `languages` languages (each its tag token).
model::seq2seq_config config_of(const options& o, std::size_t languages) {
  model::seq2seq_config c;
  c.vocab = 256 + index_t(languages);
  c.model = o.model, c.heads = 4, c.head_dim = o.model / 4, c.hidden = o.hidden;
  c.experts = o.experts, c.slot_hidden = o.slot_hidden;
  c.all_to_all_wire = o.precision == matmul_precision::bf16 ? wire::bf16 : wire::same;
  c.encoder_layers = c.decoder_layers = o.layers;
  c.max_len = o.max_bytes + 2;
  c.gating.capacity_factor = o.capacity_factor;
  c.gating.seed = o.seed;  // the random second expert
  c.dropout = o.dropout, c.label_smoothing = o.label_smoothing, c.dropout_seed = o.seed ^ 0xD509;
  return c;
}

// "" when one rank's step at the longest batch (sources and targets of
// --max-bytes + 1 positions) fits the host's memory per rank, else what it
// needs. The cost model's count (model/cost.hpp, as `cost --encoder-decoder`
// prints it): the parameters, gradients and optimizer state exactly, 1.15×
// of them for the gradient buckets and the update's buffers (the language-model
// trainer's measured share), and the activations the backward keeps. The
// pairs every rank holds and the process itself come on top, so this refuses
// only what cannot fit. A model whose weights alone pass 2^50 elements is
// refused before counting.
std::string check_memory(const options& o, int P) {
  const auto [ranks_here, memory] = examples::memory_per_rank();
  const double gib = double(1 << 30);
  const std::size_t languages = o.languages.empty() ? examples::installed_freedict().size() : o.languages.size();
  const model::seq2seq_config c = config_of(o, languages);
  const double M = double(c.model), H = double(c.hidden), E = double(std::max<index_t>(c.experts, 1)), layers = double(o.layers);
  const double rough = 2 * layers * (E * 2 * M * H + 8 * M * M) + double(c.vocab) * M;  // the FFNs and attention's projections
  char b[400];
  const auto needs = [&](double bytes, const char* what) {
    std::snprintf(b, sizeof b, "--model %d --hidden %d --experts %d --layers %d --batch %d --max-bytes %d needs about %.1f GiB per rank (%s), "
                  "but this host has %.1f GiB for each of its %.0f ranks; give smaller sizes",
                  o.model, o.hidden, o.experts, o.layers, o.batch, o.max_bytes, bytes / gib, what, memory / gib, ranks_here);
    return std::string(b);
  };
  if (rough > 0x1p50) return needs(rough * 4 * 4 / double(P), "its weights, their gradients and the optimizer's state alone");
  model::cost::mesh_sizes ms{1, index_t(P), 1, false};
  model::cost::step_options so{index_t(o.batch), index_t(o.max_bytes + 1), false, int(sizeof(float))};
  so.source = o.max_bytes + 1;
  so.optimizer = o.optimizer == "adafactor" ? model::cost::optimizer_kind::adafactor : model::cost::optimizer_kind::adam;
  so.weight_wire = o.precision == matmul_precision::bf16 ? wire::bf16 : wire::same;
  const auto w = model::cost::count_step(c, ms, so);
  const double state = w.parameter_bytes + w.gradient_bytes + w.optimizer_bytes, need = 1.15 * state + w.activation_bytes;
  if (need <= memory) return "";
  char what[160];
  std::snprintf(what, sizeof what, "the cost model's count: weights, gradients and optimizer state %.1f GiB, activations %.1f GiB",
                state / gib, w.activation_bytes / gib);
  return needs(need, what);
}

int train(const grid& m, const options& o, const std::vector<language>& langs, const examples::machine_peak& peak) {
  const matmul_precision_scope precision(o.precision);  // every step, evaluation and decoding; the router in fp32 regardless
  const bool root = m.rank() == 0;
  const int P = m.nranks();
  const model::seq2seq_config c = config_of(o, langs.size());
  parameters<grid> ps(m, o.seed);
  ps.set_weight_wire(o.precision == matmul_precision::bf16 ? wire::bf16 : wire::same);  // with fp32 masters
  const net_t net(ps, c);
  const double lr = o.lr > 0 ? o.lr : o.optimizer == "adafactor" ? 3e-3 : 2e-3;
  const auto opt = examples::make_optimizer("translate", o.optimizer, lr, std::max(1, o.steps / 20), o.steps, ps);
  int start = 0;
  if (!o.resume.empty()) {
    // The metadata alone first (no part loaded): another run's languages or
    // sizes are named as such, before a tensor's shape would be.
    const auto saved = load_checkpoint(o.resume, m, {});
    if (const std::string p = resumable(saved, run_meta(langs, c), o.resume); !p.empty())
      throw checkpoint_error("gshard translate: " + p);
    if (const std::string p = examples::resumes_with(saved, o.resume, o.optimizer); !p.empty())
      throw checkpoint_error("gshard translate: " + p);
    const auto meta = load_checkpoint(o.resume, m, model::checkpoint_parts(ps, *opt));
    if (const std::string p = examples::valid_step(meta, o.resume); !p.empty()) throw checkpoint_error("gshard translate: " + p);
    start = int(meta.at("step"));
    opt->step = start;  // the schedule (and Adam's bias correction) continue where they stopped
    if (root) std::printf("resumed %s at step %d\n", o.resume.c_str(), start);
  }
  if (root) {
    double count = 0;
    for (std::size_t i = 0; i < ps.values().size(); ++i) {
      double n = 1;
      for (index_t e : ps.values()[i].extents()) n *= double(e);
      count += n;
    }
    std::printf("model: %d + %d blocks, M %ld, %s, %.2fM parameters, vocabulary %ld (bytes and %zu language tags); %s\n",
                o.layers, o.layers, long(c.model),
                c.experts > 0 ? ("MoE in blocks 1, 3, ...: E " + std::to_string(c.experts) + ", H " + std::to_string(c.hidden)).c_str()
                              : ("dense: H " + std::to_string(c.hidden) + ", blocks 1, 3, ...: H " + std::to_string(c.ffn_hidden(1))).c_str(),
                count * 1e-6, long(c.vocab), langs.size(), m.describe().c_str());
    std::printf("%s\n", examples::machine_line(peak, o.precision, c.experts > 0 ? c.all_to_all_wire : wire::same).c_str());
    if (const std::string grace = examples::launcher_grace_note(o.save); !grace.empty()) std::printf("note: %s\n", grace.c_str());
  }
  const int end = o.steps;
  if (start >= end) {
    if (root) std::printf("the checkpoint is at step %d; nothing to train up to step %d\n", start, end);
    return 0;
  }
  auto save = [&](int step) {
    auto meta = run_meta(langs, c);
    meta["step"] = double(step);
    meta[examples::optimizer_key] = o.optimizer == "adafactor";
    save_checkpoint(o.save, m, model::checkpoint_parts(ps, *opt), meta);
    if (root) std::printf("saved %s at step %d\n", o.save.c_str(), step);
  };
  examples::run_log log(m.all_axes(), "translate", o.metrics, start > 0);
  const gshard::stdout_relay relay(root);  // a launcher that stops reading cannot block the save
  auto stopping = [&](int step) { return log.stop(step, start, end, o.save, save); };
  double t_window = 0, tokens_window = 0, flops_window = 0, wall_mark = MPI_Wtime();
  int steps_window = 0;
  for (int step = start; step < end; ++step) {
    if (const int code = stopping(step)) return code;
    const auto rows = training_rows(langs, o.batch, o.seed, std::uint64_t(step));
    double tokens = 0;
    for (const auto& r : rows) tokens += double(r.second->target.size() + 1);
    const batch d = make_batch(m, rows, c);
    const double flops0 = model_flops(), t0 = MPI_Wtime();
    tape t(ps);
    const auto out = net.forward(t, d.src, d.lengths, d.tgt, std::uint64_t(step));
    t.backward(out.loss);
    opt->update(ps);
    const double seconds = MPI_Wtime() - t0, flops = (model_flops() - flops0) * double(P);
    t_window += seconds, flops_window += flops, tokens_window += tokens, ++steps_window;
    std::optional<std::string> eval_json;
    if (step + 1 == end || (o.eval_every > 0 && (step + 1) % o.eval_every == 0))
      eval_json = evaluate_all(net, ps, langs, o, step + 1, step + 1 == end, [&] { return log.stop_requested(); });
    if (log.writing()) {
      using moe::detail::json_number;
      std::string line = "{\"step\":" + std::to_string(step + 1) + ",\"loss\":" + json_number(out.loss.value().local()()) +
                         ",\"ce\":" + json_number(out.ce) + ",\"aux\":" + json_number(out.aux) +
                         ",\"seconds\":" + json_number(seconds) + ",\"tokens_per_s\":" + json_number(tokens / seconds) +
                         ",\"mfu\":" + json_number(flops / (seconds * double(P) * peak.gflops() * 1e9));
      if (eval_json) line += ",\"eval\":" + *eval_json;
      line += ",\"moe\":[";
      for (std::size_t l = 0; l < out.moe.size(); ++l) line += (l ? "," : "") + moe::to_json(out.moe[l]);
      log.write(line + "]}\n");
    }
    if (root && ((step + 1) % o.log_every == 0 || step == start) && !log.stop_received()) {
      const double now = MPI_Wtime(), per_step = (now - wall_mark) / steps_window;
      char aux[32] = "";
      if (!out.moe.empty()) std::snprintf(aux, sizeof aux, "  aux %.3f", out.aux);
      std::printf("step %5d  loss %.4f%s  %.0f tokens/s  %s%sMFU %.2f  ETA %s\n", step + 1, out.ce, aux,
                  tokens_window / t_window, examples::routing_summary(out.moe).c_str(), out.moe.empty() ? "" : "  ",
                  flops_window / (t_window * double(P) * peak.gflops() * 1e9), examples::duration(per_step * (end - step - 1)).c_str());
      std::fflush(stdout);
      t_window = tokens_window = flops_window = 0, steps_window = 0, wall_mark = now;
    }
    if (!o.save.empty() && o.save_every > 0 && (step + 1) % o.save_every == 0 && step + 1 < end) save(step + 1);
  }
  if (const int code = stopping(end)) return code;
  if (!o.save.empty()) save(end);
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
  if (const std::string p = broadcast_text(world_group(), env.rank() == 0 ? check_files(o) : ""); !p.empty())
    throw io_error("gshard translate: " + p);
  if (const std::string p = broadcast_text(world_group(), env.rank() == 0 ? check_memory(o, env.size()) : ""); !p.empty())
    throw error("gshard translate: " + p);
  const examples::machine_peak peak = examples::measure_peak(o.precision);
  const std::vector<language> langs = prepare(examples::load_freedict("translate", o.languages), o);
  if (env.rank() == 0) {
    std::size_t train = 0, held = 0;
    for (const auto& l : langs) train += l.train.size(), held += l.held.size();
    std::printf("%zu languages into English: %zu training pairs, %zu held out (pairs of at most %d bytes a side); sampled at "
                "T = %g\n  lang   train pairs  held out  left out  sampled\n",
                langs.size(), train, held, o.max_bytes, o.temperature);
    for (const auto& l : langs)
      std::printf("  %-5s  %11zu  %8zu  %8zu  %6.2f%%\n", l.code.c_str(), l.train.size(), l.held.size(), l.left_out, 100 * l.p);
    std::fflush(stdout);
  }
  const grid m(MPI_COMM_WORLD, {1, env.size()});
  return train(m, o, langs, peak);
}
