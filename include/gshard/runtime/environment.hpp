// gshard/runtime/environment.hpp — mpi::environment: MPI's start-up and shut-down for
// a gshard program, in named steps. While it lives, a gshard::error that
// escapes on every rank alike is said once and the job exits with status 2;
// any other exception that escapes prints its rank and message and ends the
// whole job;
// every rank runs with rank 0's run-time options (core/options.hpp).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(GSHARD_USE_ONEDNN)
#include <dlfcn.h>
#endif

#include "gshard/runtime/collectives.hpp"
#include "gshard/core/options.hpp"
#include "gshard/core/error.hpp"
#include "gshard/runtime/mpi.hpp"
#include "gshard/runtime/trace_file.hpp"

#if defined(GSHARD_USE_OPENBLAS)
extern "C" void openblas_set_num_threads(int);
#endif

namespace gshard::mpi {

namespace detail {

// MPI errors on the world are returned (and then thrown by mpi::check)
// instead of killing the job without a message.
inline void start_mpi(int& argc, char**& argv) {
  int provided = 0;
  check(MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  check(MPI_Comm_dup(MPI_COMM_WORLD, &error_comm()), "MPI_Comm_dup");
}

// Tensors are values: every reshard or einsum returns fresh storage. By
// default glibc maps large blocks with mmap and unmaps them on free, so each
// new tensor pays a page fault per 4 KiB (~10 us each here). Keep freed
// memory in the heap instead, so repeated shapes reuse warm pages.
// GSHARD_MALLOC_DEFAULTS=1 keeps glibc's defaults.
inline void keep_freed_memory() {
#if defined(__GLIBC__)
  if (!std::getenv("GSHARD_MALLOC_DEFAULTS")) {
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
  }
#endif
}

// Every rank takes rank 0's options, and a value rank 0 refuses is an error
// on every rank. The broadcast is counted but not checked: the checked
// mode's own switch travels in it, so until it lands no rank compares.
inline void agree_on_options() {
  gshard::detail::run_options& o = gshard::detail::options();
  const gshard::detail::run_options mine = o;
  o.debug = 0, o.watchdog_seconds = 0;  // off while they travel
  gshard::detail::axis_group bootstrap = world_group();
  bootstrap.mesh_comm = MPI_COMM_NULL;
  double v[4] = {double(mine.reduce_scatter_mpi), double(mine.gemm), double(mine.debug), mine.watchdog_seconds};
  broadcast(bootstrap, std::span<double>(v, 4), 0);
  if (const std::string problem = broadcast_text(bootstrap, mine.problem); !problem.empty()) throw error(problem);
  o.reduce_scatter_mpi = int(v[0]);
  o.gemm = int(v[1]);
  o.debug = int(v[2]);
  o.watchdog_seconds = v[3];
  if (o.debug && bootstrap.rank == 0)
    std::fprintf(stderr, "gshard: the checked mode is on (GSHARD_DEBUG=1): every collective is compared across ranks first; "
                         "watchdog %g s\n", o.watchdog_seconds);
}

// GSHARD_TRACE=<file>: a timeline of the whole run (rank 0's setting),
// written when the environment ends.
inline void start_trace_from_env() {
  const char* env = std::getenv("GSHARD_TRACE");
  const std::string path = broadcast_text(world_group(), env ? env : "");
  if (path.empty()) return;
  if (const std::string p = broadcast_text(world_group(), world_group().rank == 0 ? io::check_writable(path) : "");
      !p.empty())
    throw io_error("gshard::trace: GSHARD_TRACE=" + path + ": " + p);
  trace::start(path);
}

// One BLAS thread per rank unless the user asked otherwise: OpenBLAS's,
// and oneDNN's OpenMP threads (libgomp, loaded with libdnnl, is asked
// through the symbol it exports; nothing links against it).
inline void one_blas_thread() {
#if defined(GSHARD_USE_OPENBLAS)
  if (!std::getenv("OPENBLAS_NUM_THREADS")) openblas_set_num_threads(1);
#endif
#if defined(GSHARD_USE_ONEDNN)
  if (!std::getenv("OMP_NUM_THREADS"))
    if (void* set = dlsym(RTLD_DEFAULT, "omp_set_num_threads")) reinterpret_cast<void (*)(int)>(set)(1);
#endif
}

}  // namespace detail

// RAII for MPI_Init_thread / MPI_Finalize, for the whole of main().
class environment {
 public:
  environment(int& argc, char**& argv) {
    detail::start_mpi(argc, argv);
    previous_ = std::set_terminate(detail::terminate_handler);
    detail::keep_freed_memory();
    detail::agree_on_options();
    detail::start_trace_from_env();
    detail::one_blas_thread();
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
    if (trace::enabled()) {  // GSHARD_TRACE: written at the end of the run
      try {
        trace::stop();
      } catch (const std::exception& e) {
        abort_job(e.what());  // every rank has it; the exit code says the run did not end well
      }
    }
    if (detail::error_comm() != MPI_COMM_NULL) MPI_Comm_free(&detail::error_comm());
    MPI_Finalize();
  }

  int rank() const { return world_rank(); }
  int size() const { return world_group().size; }

 private:
  std::terminate_handler previous_ = nullptr;
};

}  // namespace gshard::mpi
