// gshard/core/progress.hpp — the hook local kernels call between pieces of work
// (a GEMM of a batched einsum, a block of rows of attention) so that
// collectives in flight move on while the rank computes. The kernels know
// nothing of MPI: runtime/nonblocking.hpp sets the hook when it starts a collective.
#pragma once

namespace gshard::detail {

using progress_fn = void (*)();

inline progress_fn& progress_hook() {
  thread_local progress_fn hook = nullptr;
  return hook;
}

// Lets this rank's collectives in flight move on; nothing if none was ever started.
inline void progress() {
  if (progress_fn hook = progress_hook()) hook();
}

}  // namespace gshard::detail
