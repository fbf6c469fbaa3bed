// gshard/detail/options.hpp — the run-time choices gshard reads from the
// environment. Every rank must make the same choice (a ring reduce-scatter on
// one rank and MPI's on another would hang; two GEMM backends would let
// replicated tensors drift apart), so mpi::environment takes rank 0's values
// and broadcasts them. Without the environment each process reads its own.
//   GSHARD_REDUCE_SCATTER=mpi      MPI_Reduce_scatter_block instead of the ring
//   GSHARD_GEMM=eigen|openblas     the local GEMM backend (default: the faster, see gemm.hpp)
//   GSHARD_DEBUG=1                 compare a fingerprint across ranks before every collective (debug.hpp)
//   GSHARD_WATCHDOG=<seconds>      end the job when a collective is stuck that long (300 with GSHARD_DEBUG)
#pragma once

#include <cstdlib>
#include <string_view>

#if defined(GSHARD_USE_OPENBLAS)
extern "C" char* openblas_get_corename(void);
#endif

namespace gshard::detail {

enum class gemm_kind : int { eigen = 1, openblas = 2 };

struct run_options {
  int reduce_scatter_mpi = 0;  // 1: MPI_Reduce_scatter_block
  int gemm = 0;                // a gemm_kind
  int debug = 0;               // 1: the checked mode
  double watchdog_seconds = 0;  // 0: no watchdog
};

// OpenBLAS unless its active kernel lacks AVX-512 while this build has it
// (measured: OpenBLAS SkylakeX ~145 GFLOP/s, Haswell kernel ~100, Eigen with
// -march=native ~140). Without OpenBLAS: Eigen.
inline gemm_kind default_gemm() {
#if defined(GSHARD_USE_OPENBLAS)
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

inline run_options options_from_env() {
  run_options o;
  const char* rs = std::getenv("GSHARD_REDUCE_SCATTER");
  o.reduce_scatter_mpi = rs && std::string_view(rs) == "mpi";
  o.gemm = int(default_gemm());
  if (const char* d = std::getenv("GSHARD_DEBUG")) o.debug = std::string_view(d) != "0" && std::string_view(d) != "";
  if (o.debug) o.watchdog_seconds = 300;
  if (const char* w = std::getenv("GSHARD_WATCHDOG")) o.watchdog_seconds = std::atof(w);
  if (const char* g = std::getenv("GSHARD_GEMM")) {
    if (std::string_view(g) == "eigen") o.gemm = int(gemm_kind::eigen);
#if defined(GSHARD_USE_OPENBLAS)
    if (std::string_view(g) == "openblas") o.gemm = int(gemm_kind::openblas);
#endif
  }
  return o;
}

inline run_options& options() {
  static run_options o = options_from_env();
  return o;
}

}  // namespace gshard::detail
