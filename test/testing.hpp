// test/testing.hpp — assertions for SPMD tests. Every rank evaluates the
// condition; the verdicts are agreed over MPI_COMM_WORLD before Catch2 sees
// them, so all ranks pass or fail together and none is left waiting in a
// collective. Agreement uses raw MPI, which the collective counters ignore.
#pragma once

#include <catch2/catch.hpp>
#include <gshard/runtime/mpi.hpp>

#include <array>
#include <sstream>
#include <string>
#include <vector>

namespace gshard::testing {

struct verdict {
  bool all = true;
  std::string failing;  // "ranks 1,3 failed; rank 1: <detail>"
};

// Agrees a local result across the world; carries the first failing rank's detail.
inline verdict agree(bool ok, const std::string& detail = {}) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int mine = ok ? 1 : 0;
  std::vector<int> oks(static_cast<std::size_t>(n));
  MPI_Allgather(&mine, 1, MPI_INT, oks.data(), 1, MPI_INT, MPI_COMM_WORLD);
  verdict v;
  int first = -1;
  std::string ranks;
  for (int r = 0; r < n; ++r)
    if (!oks[std::size_t(r)]) {
      v.all = false;
      if (first < 0) first = r;
      if (!ranks.empty()) ranks += ',';
      ranks += std::to_string(r);
    }
  if (v.all) return v;
  // Share the first failing rank's detail with everyone.
  int len = int(detail.size());
  MPI_Bcast(&len, 1, MPI_INT, first, MPI_COMM_WORLD);
  std::string text(std::size_t(len), '\0');
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (me == first) text = detail;
  MPI_Bcast(text.data(), len, MPI_CHAR, first, MPI_COMM_WORLD);
  v.failing = "ranks " + ranks + " failed; rank " + std::to_string(first) + ": " + text;
  return v;
}

inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
inline int world_rank() { return mpi::world_rank(); }

// Sizes of a (data, expert, model) mesh over P ranks: "model" is 2 whenever
// P is even, and at 8 ranks every axis is 2.
inline std::array<std::ptrdiff_t, 3> data_expert_model_sizes(int P) {
  if (P == 8) return {2, 2, 2};
  if (P % 2 == 0) return {1, P / 2, 2};
  return {1, P, 1};
}

}  // namespace gshard::testing

// GSHARD_REQUIRE(cond) / GSHARD_CHECK(cond): agreed across ranks.
// GSHARD_REQUIRE_MSG(cond, detail): with a rank-local explanation.
#define GSHARD_AGREED_(macro, text, cond, detail)                               \
  do {                                                                          \
    const bool gshard_ok_ = static_cast<bool>(cond);                            \
    const auto gshard_v_ = ::gshard::testing::agree(gshard_ok_, (detail));      \
    INFO(text << "  " << gshard_v_.failing);                                    \
    macro(gshard_v_.all);                                                       \
  } while (0)
#define GSHARD_REQUIRE(...) GSHARD_AGREED_(REQUIRE, #__VA_ARGS__, (__VA_ARGS__), std::string())
#define GSHARD_CHECK(...) GSHARD_AGREED_(CHECK, #__VA_ARGS__, (__VA_ARGS__), std::string())
#define GSHARD_REQUIRE_MSG(cond, detail) GSHARD_AGREED_(REQUIRE, #cond, cond, detail)
#define GSHARD_CHECK_MSG(cond, detail) GSHARD_AGREED_(CHECK, #cond, cond, detail)

// The expression throws `Type` on every rank, with `text` in what().
#define GSHARD_REQUIRE_THROWS_WITH(expr, Type, text)                                        \
  do {                                                                                      \
    bool gshard_thrown_ = false;                                                            \
    std::string gshard_what_ = "no exception";                                              \
    try {                                                                                   \
      (void)(expr);                                                                         \
    } catch (const Type& e) {                                                               \
      gshard_what_ = e.what();                                                              \
      gshard_thrown_ = gshard_what_.find(text) != std::string::npos;                        \
    } catch (const std::exception& e) {                                                     \
      gshard_what_ = std::string("other exception: ") + e.what();                           \
    }                                                                                       \
    GSHARD_AGREED_(REQUIRE, #expr, gshard_thrown_, "expected " #Type " containing \"" + std::string(text) + "\", got: " + gshard_what_); \
  } while (0)
