// examples/progress.hpp — what the trainers share: the peak MFU is taken
// against, the progress line's routing summary and time left, a
// checkpoint's step checked, the optimizer named by --optimizer (and
// checked against a checkpoint's), and the run's metrics file with its
// agreement on stopping.
#pragma once

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include <gshard/core/error.hpp>
#include <gshard/core/io.hpp>
#include <gshard/kernels/gemm.hpp>
#include <gshard/state/adafactor.hpp>
#include <gshard/moe/stats.hpp>
#include <gshard/runtime/collectives.hpp>
#include <gshard/runtime/peak.hpp>
#include <gshard/runtime/preemption.hpp>

namespace examples {

// The cores' peaks, measured at start on every rank: MFU is taken against
// the one the GEMMs run at — the bf16 dot-product peak when they run in
// bf16 on the CPU's bf16 units and this build measures it, else fp32's.
struct machine_peak {
  double fma = 0;   // fp32 FMA GFLOP/s per core
  double bf16 = 0;  // bf16 dot-product GFLOP/s per core; 0: not measured
  bool bf16_gemms = false;
  double gflops() const { return bf16_gemms && bf16 > 0 ? bf16 : fma; }
};

// Collective over the world.
inline machine_peak measure_peak(gshard::matmul_precision p) {
  machine_peak m;
  m.fma = gshard::measure_fma_peak(gshard::world_group());
  // Whether oneDNN has bf16 units is each process's finding: agreed, so every rank measures or none.
  const double native = gshard::detail::gemm_bf16_native() ? 1 : 0;
  m.bf16_gemms = p == gshard::matmul_precision::bf16 &&
                 gshard::all_reduce(gshard::world_group(), native, gshard::reduction::min) == 1;
  if (m.bf16_gemms) m.bf16 = gshard::measure_bf16_peak(gshard::world_group());
  return m;
}

// The progress output's machine line: the peaks, the GEMM backend, what
// precision its GEMMs multiply in, and (for an MoE model) what its
// all_to_alls carry.
inline std::string machine_line(const machine_peak& m, gshard::matmul_precision p, gshard::wire moe_all_to_alls) {
  char line[384];
  int n = std::snprintf(line, sizeof line, "machine: fp32 FMA peak %.1f GFLOP/s per core (%s, measured)", m.fma,
                        gshard::fma_unit());
  auto add = [&](auto... args) { n += std::snprintf(line + n, sizeof line - std::size_t(n), args...); };
  if (m.bf16_gemms && m.bf16 > 0) add(", bf16 dot-product peak %.1f GFLOP/s (AVX512_BF16, measured)", m.bf16);
  add(", gemm %s", gshard::detail::gemm_backend());
  if (m.bf16_gemms) add(m.bf16 > 0 ? " in bf16 (fp32 sums; MFU against the bf16 peak)"
                                   : " in bf16 (fp32 sums; a build without AVX512_BF16 measures no bf16 peak: MFU against fp32's)");
  else if (p == gshard::matmul_precision::bf16) add(" in fp32 (--precision bf16, but it has no bf16 units to run on here)");
  if (gshard::sends_bf16(moe_all_to_alls) || gshard::trims_rows(moe_all_to_alls))
    add(", MoE all_to_alls in %s%s", gshard::sends_bf16(moe_all_to_alls) ? "bf16" : "the tensors' type",
        gshard::trims_rows(moe_all_to_alls) ? ", filled slots only" : "");
  return line;
}

// The progress line's routing part, over the MoE layers: the share of all
// choices dropped and of first choices, the largest max/mean expert demand
// (before capacity), and the experts that received no token.
inline std::string routing_summary(const std::vector<gshard::moe::gating_stats>& layers) {
  if (layers.empty()) return "";  // a dense model
  double first = 0, all = 0, spread = 0;
  int dead = 0;
  for (const auto& s : layers) {
    const double routed = double(s.tokens - s.invalid);  // one first choice each
    first += routed > 0 ? double(s.dropped_at(0)) / routed : 0.0;
    all += s.dropped_share();
    spread = std::max(spread, s.max_over_mean());
    dead += s.dead_experts();
  }
  const double n = double(std::max<std::size_t>(layers.size(), 1));
  char b[160];
  std::snprintf(b, sizeof b, "dropped %.1f%% (1st %.1f%%)  max/mean demand %.2f  dead experts %d", 100.0 * all / n,
                100.0 * first / n, spread, dead);
  return b;
}

// "1h02m", "3m05s", "42s".
inline std::string duration(double s) {
  char b[32];
  const long t = long(std::max(0.0, s) + 0.5);
  if (t >= 3600) std::snprintf(b, sizeof b, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else if (t >= 60) std::snprintf(b, sizeof b, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(b, sizeof b, "%lds", t);
  return b;
}

// The checkpoint's step: a whole number in [0, 2^31), or the problem.
inline std::string valid_step(const std::map<std::string, double>& meta, const std::string& path) {
  const auto it = meta.find("step");
  if (it == meta.end()) return path + " has no step in its metadata (not written by this trainer)";
  const double v = it->second;
  if (!(v >= 0 && v <= double(INT_MAX) && v == std::floor(v)))
    return path + ": its step " + std::to_string(v) + " is not a whole number from 0 to " + std::to_string(INT_MAX) + " (damaged metadata)";
  return "";
}

// The optimizer --optimizer names ("adam" or "adafactor"), with the peak
// learning rate `lr` warmed up over `warmup` steps and decayed over `steps`.
// Adafactor takes GShard's setting: no first moment, β̂ = min(0.99, 1 − t^−0.8),
// updates clipped at RMS 1.
inline std::unique_ptr<gshard::optimizer> make_optimizer(const std::string& program, const std::string& name, double lr,
                                                         int warmup, int steps, gshard::parameters_base& ps) {
  if (name == "adam") {
    gshard::adam_config c;
    c.lr = lr, c.warmup_steps = warmup, c.total_steps = steps;
    return std::make_unique<gshard::adam>(c, ps);
  }
  if (name == "adafactor") {
    gshard::adafactor_config c;
    c.lr = lr, c.warmup_steps = warmup, c.total_steps = steps;
    return std::make_unique<gshard::adafactor>(c, ps);
  }
  throw gshard::error("gshard " + program + ": --optimizer is adam or adafactor, not '" + name + "'");
}

// The metadata key a checkpoint records its optimizer under: 1 for Adafactor;
// 0 or absent for Adam.
inline constexpr const char* optimizer_key = "optimizer_adafactor";
inline std::string optimizer_of(const std::map<std::string, double>& meta) {
  const auto it = meta.find(optimizer_key);
  return it != meta.end() && it->second != 0 ? "adafactor" : "adam";
}
// "" if a checkpoint with `meta` continues with optimizer `name`, else why not.
inline std::string resumes_with(const std::map<std::string, double>& meta, const std::string& path, std::string_view name) {
  const std::string saved = optimizer_of(meta);
  if (saved == name) return "";
  return path + " holds the state of --optimizer " + saved + ", but this run uses --optimizer " + std::string(name) +
         "; resume with --optimizer " + saved + " (one optimizer's state is not the other's)";
}

// The regular files `path` names: itself, or a directory's (not its
// subdirectories'); a dictionary's .index beside it. Nothing for "" or a
// path that does not exist.
inline std::vector<std::string> input_files(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  std::error_code ec;
  if (path.empty()) return files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (e.is_regular_file(ec)) files.push_back(e.path().string());
    return files;
  }
  files.push_back(path);
  for (const char* dict : {".dict.dz", ".dict"})
    if (path.size() > std::strlen(dict) && path.compare(path.size() - std::strlen(dict), std::strlen(dict), dict) == 0)
      files.push_back(path.substr(0, path.size() - std::strlen(dict)) + ".index");
  return files;
}

// Rank 0's check, before anything is written, that no output (option,
// path) names an input (what, path) or another output — "" or what is
// wrong. --save may name the --resume checkpoint: that is how a run
// continues.
inline std::string outputs_spare_inputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                        const std::vector<std::pair<std::string, std::string>>& inputs) {
  namespace fs = std::filesystem;
  const auto same = [](const std::string& a, const std::string& b) {
    std::error_code ec;
    return !a.empty() && !b.empty() && (a == b || fs::equivalent(a, b, ec));
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const auto& [option, path] = outputs[i];
    for (const auto& [what, input] : inputs)
      if (same(path, input) && !(option == "--save" && what == "--resume"))
        return option + " " + path + " is " + (what == "--resume" ? "the --resume checkpoint" : what) +
               "; writing it would destroy it";
    for (std::size_t j = 0; j < i; ++j)
      if (same(path, outputs[j].second))
        return option + " " + path + " is also " + outputs[j].first + "'s file; give each its own";
  }
  return "";
}

// What the launcher allows a run told to stop, said at start when it saves:
// OpenMPI's mpirun, given SIGTERM or Ctrl-C, passes SIGTERM on after
// odls_base_sigkill_timeout seconds (1 by default) and SIGKILLs the ranks as
// long again after that: too soon for a long step, evaluation or save. ""
// under other launchers, or with a timeout of 10 s and more.
inline std::string launcher_grace_note(const std::string& save_path) {
  if (save_path.empty() || !std::getenv("OMPI_COMM_WORLD_SIZE")) return "";
  const char* set = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  const double timeout = set ? std::atof(set) : 1.0;
  if (timeout >= 10) return "";
  char b[320];
  std::snprintf(b, sizeof b, "SIGTERM or Ctrl-C to mpirun leaves the ranks %g s to stop and save before SIGKILL (OpenMPI's "
                "odls_base_sigkill_timeout); a step, evaluation or save that takes longer is lost: export "
                "OMPI_MCA_odls_base_sigkill_timeout=30 to give them time", timeout);
  return b;
}

// A training run's --metrics file and its stop: rank 0 opens the file
// (appending when resuming; a path it cannot open stops every rank before
// training) and writes whole lines; from construction on, SIGTERM and SIGINT
// are caught (runtime/preemption.hpp). At each step boundary stop() agrees
// over `all` on a signal received by any rank and on a metrics line rank 0
// could not write (an io_error on every rank).
class run_log {
 public:
  run_log(const gshard::detail::axis_group& all, std::string program, std::string path, bool append)
      : all_(&all), program_(std::move(program)), path_(std::move(path)) {
    if (path_.empty()) return;
    std::string problem;
    if (all.rank == 0 && !(file_ = std::fopen(path_.c_str(), append ? "a" : "w"))) problem = gshard::io::reason();
    if (const std::string p = gshard::broadcast_text(all, problem); !p.empty())
      throw gshard::io_error("gshard " + program_ + ": --metrics " + path_ + ": cannot open it for writing: " + p);
  }
  run_log(const run_log&) = delete;
  run_log& operator=(const run_log&) = delete;
  ~run_log() {
    if (file_) std::fclose(file_);
  }

  bool writing() const { return file_ != nullptr; }  // rank 0 with --metrics

  // One line (its newline included), flushed so a reader sees whole lines.
  // A line that cannot be written whole (a full disk) is cut off again, so
  // the file ends with its last whole line, and nothing more is written.
  void write(const std::string& line) {
    if (!file_ || failed_errno_) return;
    const long whole = std::ftell(file_);
    if (std::fputs(line.c_str(), file_) >= 0 && std::fflush(file_) == 0) return;
    failed_errno_ = errno ? errno : EIO;
    std::clearerr(file_);
    if (whole >= 0 && ::ftruncate(::fileno(file_), off_t(whole)) == 0) std::fseek(file_, whole, SEEK_SET);
  }

  // 0, or the signal that stops the run after `step` of `last`: then says so
  // and, when `save_path` is given and a step was trained since `first`,
  // calls save(step) and says how to resume. A metrics line that could not
  // be written ends the run too, saved the same way, as an io_error.
  int stop(int step, int first, int last, const std::string& save_path, const std::function<void(int)>& save) {
    std::int32_t why[2] = {gshard::preemption::received(), failed_errno_};
    gshard::all_reduce(*all_, std::span<std::int32_t>(why, 2), gshard::reduction::max);
    const bool root = all_->rank == 0;
    if (why[1]) {
      std::string saved = "; no --save FILE was given";
      if (!save_path.empty() && step > first) {
        save(step);
        saved = "; saved " + save_path + " at step " + std::to_string(step) + ": free space and resume with --resume " + save_path;
      }
      throw gshard::io_error("gshard " + program_ + ": --metrics " + path_ + ": writing failed: " + gshard::io::reason(why[1]) +
                             saved);
    }
    if (!why[0]) return 0;
    // Saved before anything is printed: the launcher may no longer read the
    // output it is about to stop, and a full pipe would block the save.
    const bool saving = !save_path.empty() && step > first;
    if (saving) save(step);
    if (root) {
      std::printf("stopped by %s after step %d of %d\n", gshard::preemption::name(why[0]), step, last);
      if (saving) std::printf("resume with the same options and --resume %s\n", save_path.c_str());
      else std::printf(save_path.empty() ? "nothing saved: no --save FILE was given\n" : "nothing new to save\n");
    }
    std::fflush(stdout);
    return 128 + why[0];
  }

  // Whether this rank has been told to stop: the step's output then waits
  // until the checkpoint is written (stop()).
  static bool stop_received() { return gshard::preemption::received() != 0; }
  // Whether any rank has (one all_reduce, the same answer on every rank): an
  // evaluation asks before each batch and is cut short by a yes, so the save
  // comes within the launcher's grace.
  bool stop_requested() const { return stop_signals_.requested(*all_) != 0; }

 private:
  const gshard::detail::axis_group* all_;
  std::string program_, path_;
  std::FILE* file_ = nullptr;
  int failed_errno_ = 0;  // rank 0's, when a line could not be written
  const gshard::preemption stop_signals_;
};

}  // namespace examples
