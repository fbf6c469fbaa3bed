// test/pmpi.hpp — the MPI profiling interface (PMPI) used to see every MPI
// communication call train_tests makes: test/pmpi.cpp defines MPI_Bcast,
// MPI_Allreduce, ... (each calls its PMPI_ twin), so the linker takes them
// before the MPI library's. While a watch lives, every such call is counted,
// and one made outside a counted gshard collective is recorded by name.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace gshard::testing::pmpi {

struct log {
  bool on = false;
  std::map<std::string, int> calls;   // every intercepted call, by MPI function
  std::vector<std::string> uncounted;  // those outside gshard::inside_counted_collective()
};
log& the_log();

class watch {
 public:
  watch() { the_log() = log{true, {}, {}}; }
  ~watch() { the_log().on = false; }
  watch(const watch&) = delete;
  watch& operator=(const watch&) = delete;
  const std::map<std::string, int>& calls() const { return the_log().calls; }
  const std::vector<std::string>& uncounted() const { return the_log().uncounted; }
  int calls(const std::string& fn) const {
    const auto it = the_log().calls.find(fn);
    return it == the_log().calls.end() ? 0 : it->second;
  }
};

}  // namespace gshard::testing::pmpi
