// gshard/runtime/preemption.hpp — stopping a run cleanly when the job is told to,
// and output that a launcher which stops reading cannot block.
// While a gshard::preemption lives, the first SIGTERM or SIGINT a rank
// receives is only noted; requested(mesh), at a step boundary, tells every
// rank whether any rank received one, so all stop after the same step, save,
// and exit. A second signal ends the process at once.
//   gshard::preemption stop;
//   const gshard::stdout_relay relay(rank == 0);  // below: printing cannot block the save
//   for (int step = 0; step < n; ++step) {
//     if (int sig = stop.requested(mesh)) {
//       save(step);  // first: the launcher may have stopped reading the output
//       if (rank == 0) std::printf("stopped by %s after step %d\n", gshard::preemption::name(sig), step);
//       return 128 + sig;
//     }
//     train_step(...);
//   }
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include "gshard/runtime/collectives.hpp"
#include "gshard/core/error.hpp"
#include "gshard/runtime/mesh.hpp"

namespace gshard {

namespace detail {
struct stop_state {
  volatile std::sig_atomic_t signal = 0;  // the first one received; 0: none
  bool installed = false;
  struct sigaction previous[2] = {};
  // The handlers' signal stack, where gshard made one: a raw allocation, so
  // that no destructor at exit frees it while a handler may still run on it.
  char* stack = nullptr;
  pthread_t stack_thread{};  // the thread it is the signal stack of
  stack_t previous_stack{};  // that thread's before
};
// A signal stack this large is kept; a smaller one (none, a test framework's
// 32 KiB) is replaced while a preemption lives. An AVX-512 signal frame takes
// about 3.5 KiB.
inline std::size_t signal_stack_bytes() { return std::max<std::size_t>(std::size_t(1) << 16, std::size_t(SIGSTKSZ)); }
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
// a stop that never comes would bury the fault's message. The caller says
// what stopped once requested() has agreed on it, after its save. A second
// signal takes the signal's default action. OpenMPI's mpirun sends SIGKILL one second after SIGTERM unless told
// to wait longer: OMPI_MCA_odls_base_sigkill_timeout=<seconds> (which also
// delays the exit of every aborted job; docs/07). Slurm waits KillWait.
// Make it on the thread that trains: its handlers' signal stack is that
// thread's.
class preemption {
 public:
  preemption() {
    detail::stop_state& s = detail::stop_signals();
    if (s.installed) throw error("gshard::preemption: one is already live in this process");
    s.signal = 0;  // before the handlers: a signal from now on is this one's first
    // The handlers run on a signal stack (SA_ONSTACK), not on the stack of
    // the code they interrupt: oneDNN 2.x's JIT GEMM kernels ("gemm:jit",
    // every fp32 matmul where the CPU has AVX2 alone) point the stack
    // pointer into a heap buffer while they run, and a handler run there
    // would write its signal frame over the heap. The signal stack is this
    // thread's; other threads that run GEMMs (oneDNN's OpenMP workers above
    // one thread) are not covered.
    stack_t now{};
    if (sigaltstack(nullptr, &now) == 0 && ((now.ss_flags & SS_DISABLE) || now.ss_size < detail::signal_stack_bytes())) {
      stack_t own{};
      own.ss_size = detail::signal_stack_bytes();
      own.ss_sp = new char[own.ss_size];
      if (sigaltstack(&own, &s.previous_stack) != 0) {
        const int err = errno;
        delete[] static_cast<char*>(own.ss_sp);
        throw error(std::string("gshard::preemption: sigaltstack failed: ") + std::strerror(err));
      }
      s.stack = static_cast<char*>(own.ss_sp), s.stack_thread = pthread_self();
    }
    for (int i = 0; i < 2; ++i) {
      const int sig = detail::stop_signal_numbers[i];
      struct sigaction a{};
      a.sa_handler = detail::on_stop_signal;
      sigemptyset(&a.sa_mask);
      a.sa_flags = SA_RESTART | SA_ONSTACK;  // MPI's and the file reads' system calls go on
      if (sigaction(sig, &a, &s.previous[i]) != 0) {
        const int err = errno;
        for (int j = 0; j < i; ++j) sigaction(detail::stop_signal_numbers[j], &s.previous[j], nullptr);
        restore_stack(s);
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
    restore_stack(s);
    s.installed = false;
  }

  // This rank's own signal (no communication), or 0.
  static int received() { return int(detail::stop_signals().signal); }

  // The signal some rank of `g` received (the largest number when several),
  // or 0, the same on every rank of `g`: one all_reduce(max) of an int.
  int requested(const detail::axis_group& g) const { return all_reduce(g, received(), reduction::max); }
  int requested(const detail::mesh_base& m) const { return requested(m.all_axes()); }

  static const char* name(int sig) { return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal"; }

 private:
  // The thread's signal stack as it was before, once the handlers are the
  // previous ones again. Ended on another thread, or with the stack replaced
  // since, gshard's is left in place (a handler may yet run on it).
  static void restore_stack(detail::stop_state& s) {
    if (!s.stack) return;
    stack_t now{};
    if (pthread_equal(s.stack_thread, pthread_self()) && sigaltstack(nullptr, &now) == 0 && now.ss_sp == s.stack &&
        sigaltstack(&s.previous_stack, nullptr) == 0)
      delete[] s.stack;
    s.stack = nullptr;
  }
};

// A process's standard output through a relay: while it lives, what the
// program prints goes into a pipe of its own (1 MiB where Linux allows it)
// that a thread copies to the real output. A launcher that stops reading
// (mpirun, once signalled) then blocks that thread, not the training: the
// run still reaches the step boundary where it stops and saves.
class stdout_relay {
 public:
  explicit stdout_relay(bool active, double drain_seconds = 2.0) : drain_seconds_(drain_seconds) {
    int p[2];
    if (!active || ::fcntl(STDOUT_FILENO, F_GETFD) < 0 || ::pipe2(p, O_CLOEXEC) != 0) return;
    std::fflush(stdout);
    out_ = ::fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
    if (out_ < 0 || ::dup2(p[1], STDOUT_FILENO) < 0) {
      ::close(p[0]), ::close(p[1]);
      if (out_ >= 0) ::close(out_), out_ = -1;
      return;
    }
    ::close(p[1]);
    in_ = p[0];
#if defined(F_SETPIPE_SZ)
    ::fcntl(STDOUT_FILENO, F_SETPIPE_SZ, 1 << 20);
#endif
    copier_ = std::thread([in = in_, out = out_, done = done_] {
      char buf[1 << 16];
      for (ssize_t n; (n = ::read(in, buf, sizeof buf)) != 0;) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;
        for (ssize_t at = 0; at < n;) {
          const ssize_t w = ::write(out, buf + at, std::size_t(n - at));
          if (w < 0 && errno == EINTR) continue;
          if (w < 0) break;
          at += w;
        }
      }
      done->store(true);
    });
  }
  stdout_relay(const stdout_relay&) = delete;
  stdout_relay& operator=(const stdout_relay&) = delete;
  // Waits for the copy to finish, however slow the reader; after a stop
  // signal (the launcher may have stopped reading for good) at most
  // `drain_seconds`.
  ~stdout_relay() {
    if (out_ < 0) return;
    std::fflush(stdout);
    ::dup2(out_, STDOUT_FILENO);  // the program's own output again; the pipe's last writer closed: the copier reads to its end
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(drain_seconds_);
    while (!done_->load() && (preemption::received() == 0 || std::chrono::steady_clock::now() < until))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (done_->load()) {
      copier_.join();
      ::close(in_), ::close(out_);
    } else {
      copier_.detach();  // blocked on a reader that has gone; it ends with the process
    }
  }

 private:
  double drain_seconds_;
  int in_ = -1, out_ = -1;
  std::shared_ptr<std::atomic<bool>> done_ = std::make_shared<std::atomic<bool>>(false);
  std::thread copier_;
};

}  // namespace gshard
