// gshard/mpi.hpp — the one place gshard touches MPI's runtime: start-up and
// shut-down, datatypes, error codes turned into exceptions, and the rule that
// a failure on any rank ends the whole job (MPI_Abort), never a hang.
#pragma once

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // the deprecated C++ bindings are not used
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <chrono>
#include <climits>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>

#include "gshard/detail/options.hpp"
#include "gshard/error.hpp"
#include "gshard/trace.hpp"

#if defined(GSHARD_USE_OPENBLAS)
extern "C" void openblas_set_num_threads(int);
#endif


namespace gshard::mpi {

template <class T>
MPI_Datatype datatype() {
  if constexpr (std::is_same_v<T, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>) return MPI_INT32_T;
  else if constexpr (std::is_same_v<T, std::int64_t>) return MPI_INT64_T;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return MPI_UINT8_T;
  else if constexpr (std::is_same_v<T, char>) return MPI_CHAR;
  else static_assert(sizeof(T) == 0, "gshard::mpi: no MPI datatype for this element type; use float, double, int32, int64 or uint8");
}

inline int world_rank() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return -1;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Throws gshard::mpi_error naming the call when an MPI function failed.
inline void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw mpi_error(std::string("gshard::mpi: ") + call + " failed: " + std::string(msg, std::size_t(len)));
}

// MPI counts are int: larger buffers are refused with a clear error instead of overflowing.
inline int count(std::size_t n, const char* call) {
  if (n > std::size_t(INT_MAX))
    throw error(std::string("gshard::mpi: ") + call + " of " + std::to_string(n) +
                " elements exceeds MPI's int count limit; split the tensor over more ranks");
  return int(n);
}

// Flushes stderr and gives the launcher time to forward it before this rank
// ends the job: MPICH's hydra kills the job on MPI_Abort (or a rank's exit)
// without draining the ranks' output pipes, and the message was lost in 2 of
// 60 runs on one core. Only failing jobs pay the pause.
inline void flush_stderr_before_exit() {
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
}

// Prints "gshard: rank R: <what>" to stderr and ends every rank of the job.
[[noreturn]] inline void abort_job(const char* what, int code = 1) {
  std::fprintf(stderr, "gshard: rank %d: %s\n", world_rank(), what);
  flush_stderr_before_exit();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

namespace detail {
[[noreturn]] inline void terminate_handler() {
  std::string what = "terminate called without an active exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = std::string("uncaught exception: ") + ex.what();
    } catch (...) {
      what = "uncaught exception of unknown type";
    }
  }
  abort_job(what.c_str());
}
}  // namespace detail

// RAII for MPI_Init_thread / MPI_Finalize. While it lives, an exception that
// escapes on any rank prints that rank and message and aborts the whole job,
// and MPI errors on MPI_COMM_WORLD are returned (and then thrown) instead of
// killing the job without a message.
class environment {
 public:
  environment(int& argc, char**& argv) {
    int provided = 0;
    check(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    previous_ = std::set_terminate(detail::terminate_handler);
#if defined(__GLIBC__)
    // Tensors are values: every reshard or einsum returns fresh storage. By
    // default glibc maps large blocks with mmap and unmaps them on free, so
    // each new tensor pays a page fault per 4 KiB (~10 us each here). Keep
    // freed memory in the heap instead, so repeated shapes reuse warm pages.
    // GSHARD_MALLOC_DEFAULTS=1 keeps glibc's defaults.
    if (!std::getenv("GSHARD_MALLOC_DEFAULTS")) {
      mallopt(M_MMAP_THRESHOLD, 1 << 30);
      mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
#endif
    // Every rank takes rank 0's run-time options (detail/options.hpp).
    gshard::detail::run_options& o = gshard::detail::options();
    double v[4] = {double(o.reduce_scatter_mpi), double(o.gemm), double(o.debug), o.watchdog_seconds};
    MPI_Bcast(v, 4, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    o.reduce_scatter_mpi = int(v[0]);
    o.gemm = int(v[1]);
    o.debug = int(v[2]);
    o.watchdog_seconds = v[3];
    // GSHARD_TRACE=<file>: a timeline of the whole run (rank 0's setting).
    const char* trace_env = std::getenv("GSHARD_TRACE");
    std::string trace_path = trace_env ? trace_env : "";
    int tlen = int(trace_path.size());
    MPI_Bcast(&tlen, 1, MPI_INT, 0, MPI_COMM_WORLD);
    trace_path.resize(std::size_t(tlen));
    MPI_Bcast(trace_path.data(), tlen, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (!trace_path.empty()) trace::start(trace_path);
#if defined(GSHARD_USE_OPENBLAS)
    // One BLAS thread per rank unless the user asked otherwise.
    if (!std::getenv("OPENBLAS_NUM_THREADS")) openblas_set_num_threads(1);
#endif
  }
  environment(const environment&) = delete;
  environment& operator=(const environment&) = delete;
  ~environment() {
    std::set_terminate(previous_);
    // Leaving by an exception on this rank alone would hang the others in
    // MPI_Finalize: end the job instead.
    if (std::uncaught_exceptions() > 0) abort_job("exception escaped while gshard::mpi::environment was live");
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (trace::enabled()) trace::stop();  // GSHARD_TRACE: written at the end of the run
    MPI_Finalize();
  }

  int rank() const { return world_rank(); }
  int size() const {
    int s = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &s);
    return s;
  }

 private:
  std::terminate_handler previous_ = nullptr;
};

}  // namespace gshard::mpi
