// gshard/core/options.hpp — the run-time choices gshard reads from the
// environment. Every rank must make the same choice (a ring reduce-scatter on
// one rank and MPI's on another would hang; two GEMM backends would let
// replicated tensors drift apart), so mpi::environment takes rank 0's values
// and broadcasts them. Without the environment each process reads its own.
//   GSHARD_REDUCE_SCATTER=ring|mpi gshard's ring (default) or MPI_Reduce_scatter_block
//   GSHARD_GEMM=eigen|openblas|onednn  the local GEMM backend (default: the faster, see default_gemm)
//   GSHARD_DEBUG=0|1               compare a fingerprint across ranks before every collective (runtime/debug.hpp)
//   GSHARD_WATCHDOG=<seconds>      end the job when a collective is stuck that long (>= 1; 300 with GSHARD_DEBUG; 0: off)
#pragma once

#include <cmath>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#if defined(GSHARD_USE_OPENBLAS)
extern "C" char* openblas_get_corename(void);
#endif

namespace gshard::detail {

// The GEMM backends this build has besides Eigen's.
#if defined(GSHARD_USE_OPENBLAS)
inline constexpr bool have_openblas = true;
#else
inline constexpr bool have_openblas = false;
#endif
#if defined(GSHARD_USE_ONEDNN)
inline constexpr bool have_onednn = true;
#else
inline constexpr bool have_onednn = false;
#endif

enum class gemm_kind : int { eigen = 1, openblas = 2, onednn = 3 };

inline const char* gemm_name(gemm_kind k) {
  return k == gemm_kind::openblas ? "openblas" : k == gemm_kind::onednn ? "onednn" : "eigen";
}

// The GEMM backends of this build, Eigen's first.
inline std::vector<gemm_kind> gemm_kinds() {
  std::vector<gemm_kind> k{gemm_kind::eigen};
  if (have_openblas) k.push_back(gemm_kind::openblas);
  if (have_onednn) k.push_back(gemm_kind::onednn);
  return k;
}

struct run_options {
  int reduce_scatter_mpi = 0;  // 1: MPI_Reduce_scatter_block
  int gemm = 0;                // a gemm_kind
  int debug = 0;               // 1: the checked mode
  double watchdog_seconds = 0;  // 0: no watchdog
  std::string problem;          // a variable's value that is not allowed, or ""
};

// oneDNN where this build has it: its fp32 matmul ran at 0.86–0.95 of a
// Zen 5 core's FMA peak on the trainer's GEMM shapes, against 0.52–0.64
// for Eigen and 0.41–0.47 for OpenBLAS's Haswell kernel there
// (bench_einsum's gemm_backends; not measured against OpenBLAS's AVX-512
// kernel on one host). Otherwise OpenBLAS unless its active kernel lacks
// AVX-512 while this build has it (OpenBLAS SkylakeX ~145 GFLOP/s, Haswell
// kernel ~100, Eigen with -march=native ~140). Without either: Eigen.
inline gemm_kind default_gemm() {
#if defined(GSHARD_USE_ONEDNN)
  return gemm_kind::onednn;
#elif defined(GSHARD_USE_OPENBLAS)
#if defined(__AVX512F__)
  const std::string_view core = openblas_get_corename();
  const bool avx512_kernel = core.find("kylakeX") != std::string_view::npos ||
                             core.find("ooperlake") != std::string_view::npos ||
                             core.find("apphire") != std::string_view::npos;
  return avx512_kernel ? gemm_kind::openblas : gemm_kind::eigen;
#else
  return gemm_kind::openblas;
#endif
#else
  return gemm_kind::eigen;
#endif
}

// The variables' values as this process sees them. A value outside those
// allowed goes to `problem`: mpi::environment then throws on every rank,
// naming the variable, the value and what is allowed.
inline run_options options_from_env() {
  run_options o;
  auto refuse = [&](const char* name, std::string_view value, const char* allowed) {
    if (o.problem.empty())
      o.problem = std::string("gshard: ") + name + "=" + std::string(value) + " is not allowed; use " + allowed;
  };
  if (const char* rs = std::getenv("GSHARD_REDUCE_SCATTER")) {
    const std::string_view v = rs;
    if (v == "mpi") o.reduce_scatter_mpi = 1;
    else if (v != "ring" && !v.empty()) refuse("GSHARD_REDUCE_SCATTER", v, "ring or mpi");
  }
  o.gemm = int(default_gemm());
  if (const char* d = std::getenv("GSHARD_DEBUG")) {
    const std::string_view v = d;
    if (v == "1") o.debug = 1;
    else if (v != "0" && !v.empty()) refuse("GSHARD_DEBUG", v, "1 (the checked mode) or 0");
  }
  if (o.debug) o.watchdog_seconds = 300;
  if (const char* w = std::getenv("GSHARD_WATCHDOG"); w && *w) {
    char* end = nullptr;
    const double s = std::strtod(w, &end);
    // Below a second a healthy collective (a large all_to_all on a slow
    // link, a rank's first touch of its buffers) could be taken for a stuck one.
    if (*end != '\0' || !std::isfinite(s) || s < 0 || (s > 0 && s < 1))
      refuse("GSHARD_WATCHDOG", w, "a number of seconds >= 1, or 0 (off)");
    else o.watchdog_seconds = s;
  }
  if (const char* g = std::getenv("GSHARD_GEMM"); g && *g) {
    const std::string_view v = g;
    constexpr bool openblas = have_openblas, onednn = have_onednn;
    if (v == "eigen") o.gemm = int(gemm_kind::eigen);
    else if (v == "openblas" && openblas) o.gemm = int(gemm_kind::openblas);
    else if (v == "onednn" && onednn) o.gemm = int(gemm_kind::onednn);
    else
      refuse("GSHARD_GEMM", v,
             openblas && onednn ? "eigen, openblas or onednn"
             : openblas         ? "eigen or openblas (this build has no oneDNN: install libdnnl-dev, meson setup -Donednn=enabled)"
             : onednn           ? "eigen or onednn (this build has no OpenBLAS: meson setup -Dblas=openblas)"
                                : "eigen (this build has neither OpenBLAS nor oneDNN: meson setup -Dblas=openblas -Donednn=enabled)");
  }
  return o;
}

inline run_options& options() {
  static run_options o = options_from_env();
  return o;
}

}  // namespace gshard::detail
