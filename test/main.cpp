// test/main.cpp — Catch2 (2.13) under MPI. Every rank runs every test case;
// rank 0 reports. After each test case the ranks compare their verdicts: if
// they differ (an unagreed assertion or an exception on one rank), the job is
// aborted rather than left to hang in the next collective. Rank 0 ends with a
// line "gshard-test-summary: passed=N failed=M" that scripts/test adds up.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <gshard/runtime/environment.hpp>

#include <fstream>
#include <iostream>

namespace {
int cases_passed = 0, cases_failed = 0;

struct agreement_listener : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseEnded(const Catch::TestCaseStats& s) override {
    const int failed = (s.totals.assertions.failed > 0 || s.totals.testCases.failed > 0) ? 1 : 0;
    int lo = 0, hi = 0;
    MPI_Allreduce(&failed, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&failed, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (lo != hi)
      gshard::mpi::abort_job(("test case \"" + s.testInfo.name +
                              "\" failed on some ranks only (an unagreed assertion or exception); aborting")
                                 .c_str());
    (failed ? cases_failed : cases_passed) += 1;
  }
};
}  // namespace
CATCH_REGISTER_LISTENER(agreement_listener)

int main(int argc, char** argv) {
  gshard::mpi::environment env(argc, argv);
  const int rank = env.rank();
  std::ofstream devnull;
  std::streambuf* saved = nullptr;
  if (rank != 0) {  // rank 0 reports; the verdicts are the same everywhere
    devnull.open("/dev/null");
    saved = std::cout.rdbuf(devnull.rdbuf());
  }
  Catch::Session session;
  int rc = session.run(argc, argv);
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (saved) std::cout.rdbuf(saved);
  if (rank == 0)
    std::cout << "gshard-test-summary: passed=" << cases_passed << " failed=" << cases_failed << " ranks=" << env.size()
              << std::endl;
  return worst == 0 ? 0 : 1;
}
