// gshard/runtime/mpi.hpp — MPI's datatypes, error codes turned into exceptions, and
// the rule that a failure on any rank ends the whole job, never a hang: a
// usage error every rank sees is said once (exit status 2), anything else
// ends the job with MPI_Abort. Start-up and shut-down: gshard/runtime/environment.hpp.
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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <type_traits>

#include "gshard/core/error.hpp"
#include "gshard/core/types.hpp"



namespace gshard::mpi {

template <class T>
MPI_Datatype datatype() {
  constexpr element e = element_of<T>();
  static_assert(e != element::other, "gshard::mpi: no MPI datatype for this element type; use float, double, bf16, int32, int64 or uint8");
  switch (e) {
    case element::f32: return MPI_FLOAT;
    case element::f64: return MPI_DOUBLE;
    case element::i32: return MPI_INT32_T;
    case element::i64: return MPI_INT64_T;
    case element::u8: return MPI_UINT8_T;
    case element::character: return MPI_CHAR;
    case element::bf16: return MPI_UINT16_T;  // MPI has no bf16: 16-bit words, never summed by MPI
    case element::other: break;
  }
  return MPI_DATATYPE_NULL;
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

// Flushes stdout and stderr and gives the launcher time to forward them before this rank
// ends the job: MPICH's hydra kills the job on MPI_Abort (or a rank's exit)
// without draining the ranks' output pipes, and the message was lost in 2 of
// 60 runs on one core. Only failing jobs pay the pause.
inline void flush_output_before_exit() {
  std::fflush(stdout);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
}

// Prints "gshard: rank R: <what>" to stderr and ends every rank of the job.
[[noreturn]] inline void abort_job(const char* what, int code = 1) {
  std::fprintf(stderr, "gshard: rank %d: %s\n", world_rank(), what);
  flush_output_before_exit();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

namespace detail {
// A communicator of its own for agreeing on an error (environment.hpp makes
// it at start-up), so its barrier can never match a collective a rank is in.
inline MPI_Comm& error_comm() {
  static MPI_Comm c = MPI_COMM_NULL;
  return c;
}

// Finishes the non-blocking collectives this rank has in flight, for as
// long as the watchdog allows (10 s without one); true when none is left
// (set by runtime/nonblocking.hpp when it posts one). An error that leaves
// one pending cannot end in MPI_Finalize, which would wait on it; one
// every rank posted (the sharded update's gathers, travelling until the
// next forward reads the weights) finishes while every rank is here.
using finish_in_flight_fn = bool (*)();
inline finish_in_flight_fn& finish_in_flight() {
  static finish_in_flight_fn f = nullptr;
  return f;
}

// How long a rank with a gshard::error waits for the others to reach the same
// point: ranks that throw at one point of the program (an option, a file
// rank 0 read for all, a shape) arrive within milliseconds of each other.
inline constexpr double agreement_seconds = 3.0;

// True when every rank of the job reaches this call within `seconds`: a
// barrier on error_comm() that gives up instead of waiting for ever.
inline bool every_rank_here(double seconds) {
  MPI_Comm c = error_comm();
  if (c == MPI_COMM_NULL) return false;
  MPI_Request r = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(c, &r) != MPI_SUCCESS) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (int done = 0;;) {
    if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// An exception that escapes main. A gshard::error that every rank throws (a
// bad option, a missing file, shapes that do not fit: what the user asked
// for) is a usage error: rank 0 prints its message once and every rank ends
// normally with exit status 2. Anything else — an error one rank alone
// sees, an MPI failure, an error with a collective in flight that cannot
// be finished, or off MPI's main thread — prints that rank's message and
// ends the job (MPI_Abort).
[[noreturn]] inline void terminate_handler() {
  std::string what = "terminate called without an active exception";
  bool usage = false;
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const mpi_error& ex) {
      what = "uncaught exception: " + std::string(ex.what());
    } catch (const error& ex) {
      what = ex.what(), usage = true;
    } catch (const std::exception& ex) {
      what = "uncaught exception: " + std::string(ex.what());
    } catch (...) {
      what = "uncaught exception of unknown type";
    }
  }
  int initialized = 0, finalized = 0, main_thread = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Is_thread_main(&main_thread);
  // Every rank here, then none with a collective left in flight (a rank
  // that could not finish one does not come to the second agreement).
  if (usage && main_thread && !finalized && every_rank_here(agreement_seconds) &&
      (!finish_in_flight() || (finish_in_flight()() && every_rank_here(agreement_seconds)))) {
    std::fflush(stdout);  // what the program printed before comes first
    if (world_rank() == 0) std::fprintf(stderr, "%s\n", what.c_str());
    std::fflush(stderr);
    MPI_Finalize();
    flush_output_before_exit();
    std::_Exit(2);
  }
  abort_job((usage ? "uncaught exception: " + what : what).c_str());
}
}  // namespace detail

}  // namespace gshard::mpi
