// gshard/runtime/preemption.hpp — stopping a run cleanly when the job is told to.
// While a gshard::preemption lives, the first SIGTERM or SIGINT a rank
// receives is only noted; requested(mesh), at a step boundary, tells every
// rank whether any rank received one, so all stop after the same step, save,
// and exit. A second signal ends the process at once.
//   gshard::preemption stop;
//   for (int step = 0; step < n; ++step) {
//     if (int sig = stop.requested(mesh)) {
//       save(step);  // first: the launcher may have stopped reading the output
//       if (rank == 0) std::printf("stopped by %s after step %d\n", gshard::preemption::name(sig), step);
//       return 128 + sig;
//     }
//     train_step(...);
//   }
#pragma once

#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>

#include "gshard/runtime/collectives.hpp"
#include "gshard/core/error.hpp"
#include "gshard/runtime/mesh.hpp"

namespace gshard {

namespace detail {
struct stop_state {
  volatile std::sig_atomic_t signal = 0;  // the first one received; 0: none
  bool installed = false;
  struct sigaction previous[2] = {};
};
inline stop_state& stop_signals() {
  static stop_state s;
  return s;
}
inline constexpr int stop_signal_numbers[2] = {SIGTERM, SIGINT};

inline void on_stop_signal(int sig) {
  stop_state& s = stop_signals();
  if (s.signal != 0) {  // the second: end now, as if never caught
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  s.signal = sig;
}
}  // namespace detail

// Slurm and mpirun send SIGTERM at a time limit or on preemption; a user at
// the terminal sends SIGINT (Ctrl-C; mpirun passes it on as SIGTERM). The
// first one is noted, silently: a launcher ending a job after one rank's
// fault sends the others SIGTERM too, and a line from each of them promising
// a stop that never comes would bury the fault's message. What stops is said
// once the ranks agree on it (requested()). A second signal takes the
// signal's default action. OpenMPI's mpirun sends SIGKILL one second after SIGTERM unless told
// to wait longer: OMPI_MCA_odls_base_sigkill_timeout=<seconds> (which also
// delays the exit of every aborted job; docs/07). Slurm waits KillWait.
class preemption {
 public:
  preemption() {
    detail::stop_state& s = detail::stop_signals();
    if (s.installed) throw error("gshard::preemption: one is already live in this process");
    s.signal = 0;  // before the handlers: a signal from now on is this one's first
    for (int i = 0; i < 2; ++i) {
      const int sig = detail::stop_signal_numbers[i];
      struct sigaction a{};
      a.sa_handler = detail::on_stop_signal;
      sigemptyset(&a.sa_mask);
      a.sa_flags = SA_RESTART;  // MPI's and the file reads' system calls go on
      if (sigaction(sig, &a, &s.previous[i]) != 0) {
        const int err = errno;
        for (int j = 0; j < i; ++j) sigaction(detail::stop_signal_numbers[j], &s.previous[j], nullptr);
        throw error(std::string("gshard::preemption: sigaction failed: ") + std::strerror(err));
      }
    }
    s.installed = true;
  }
  preemption(const preemption&) = delete;
  preemption& operator=(const preemption&) = delete;
  ~preemption() {
    detail::stop_state& s = detail::stop_signals();
    for (int i = 0; i < 2; ++i) sigaction(detail::stop_signal_numbers[i], &s.previous[i], nullptr);
    s.installed = false;
  }

  // This rank's own signal (no communication), or 0.
  static int received() { return int(detail::stop_signals().signal); }

  // The signal some rank of `g` received (the largest number when several),
  // or 0, the same on every rank of `g`: one all_reduce(max) of an int.
  int requested(const detail::axis_group& g) const { return all_reduce(g, received(), reduction::max); }
  int requested(const detail::mesh_base& m) const { return requested(m.all_axes()); }

  static const char* name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal"; }
};

}  // namespace gshard
