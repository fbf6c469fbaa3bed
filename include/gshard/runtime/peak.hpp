// gshard/runtime/peak.hpp — the fp32 FMA peak of one core, measured: a register-only
// loop for the widest vector unit the build targets. Benchmarks report shares
// of it and the trainer its model FLOPs utilisation, so no machine's constant
// lives in the code. The vector unit is the one the *including* program was
// compiled for (-march): a build without -mavx2/-mfma measures scalar FMAs.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "gshard/runtime/collectives.hpp"

namespace gshard {

// Everything here has internal linkage (an unnamed namespace): its body
// depends on the -march of the file that includes it, so two files built for
// different vector units must not share one definition (the one-definition
// rule, and a linker keeping the AVX-512 copy for an AVX2 caller).
namespace {

namespace peak_detail {  // not `detail`: a second one would make gshard's ambiguous
// fp32 FMAs on registers only, for the widest vector unit this build targets:
// independent accumulators, at least FMA latency x ports on current x86 cores
// (4 x 2 = 8 on Zen 3, Skylake), and fewer than the vector registers so none
// spills: AVX-512 has 32, so 16; AVX2 and SSE have 16 (two hold the
// multiplicands), so 12 — with 16 on AVX2, GCC spilled three accumulators to
// the stack and the loop measured 53.7 GFLOP/s instead of 93 on a Zen 3 core.
// No memory traffic. Returns GFLOP/s (2 per lane per FMA).
[[gnu::noinline]] inline double fma_loop_gflops(long iterations) {
#if defined(__AVX512F__)
  using vec = __m512;
  constexpr int lanes = 16, accumulators = 16;
  auto fma = [](vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); };
  auto set = [](float v) { return _mm512_set1_ps(v); };
  auto sum = [](vec v) { return _mm512_reduce_add_ps(v); };
#elif defined(__AVX2__) && defined(__FMA__)
  using vec = __m256;
  constexpr int lanes = 8, accumulators = 12;
  auto fma = [](vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); };
  auto set = [](float v) { return _mm256_set1_ps(v); };
  auto sum = [](vec v) {
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
  };
#else
  using vec = float;
  constexpr int lanes = 1, accumulators = 12;
  auto fma = [](vec a, vec b, vec c) { return a * b + c; };
  auto set = [](float v) { return v; };
  auto sum = [](vec v) { return v; };
#endif
  // Named locals, not an array: inlined into a large caller (the trainer's
  // main), GCC kept an array of accumulators in memory and stored all of
  // them every iteration (29 instead of 93 GFLOP/s on a Zen 3 core).
  vec c0 = set(1.000f), c1 = set(1.001f), c2 = set(1.002f), c3 = set(1.003f), c4 = set(1.004f), c5 = set(1.005f),
      c6 = set(1.006f), c7 = set(1.007f), c8 = set(1.008f), c9 = set(1.009f), c10 = set(1.010f), c11 = set(1.011f),
      c12 = set(1.012f), c13 = set(1.013f), c14 = set(1.014f), c15 = set(1.015f);
  const vec a = set(0.999999f), b = set(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iterations; ++it) {
    c0 = fma(c0, a, b), c1 = fma(c1, a, b), c2 = fma(c2, a, b), c3 = fma(c3, a, b), c4 = fma(c4, a, b);
    c5 = fma(c5, a, b), c6 = fma(c6, a, b), c7 = fma(c7, a, b), c8 = fma(c8, a, b), c9 = fma(c9, a, b);
    c10 = fma(c10, a, b), c11 = fma(c11, a, b);
    if constexpr (accumulators == 16) c12 = fma(c12, a, b), c13 = fma(c13, a, b), c14 = fma(c14, a, b), c15 = fma(c15, a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float keep = sum(c0) + sum(c1) + sum(c2) + sum(c3) + sum(c4) + sum(c5) + sum(c6) + sum(c7) + sum(c8) + sum(c9) +
               sum(c10) + sum(c11) + sum(c12) + sum(c13) + sum(c14) + sum(c15);
  if (keep == 12345.678f) std::puts("");  // the result is used: the loop is not removed
  return 2.0 * lanes * accumulators * double(iterations) / seconds * 1e-9;
}

// bf16 dot products on registers only (AVX512_BF16's vdpbf16ps: 32 bf16
// products summed into 16 fp32 lanes per instruction, 64 FLOPs), the
// fp32 loop's shape and accumulators. 0 where this build does not target
// AVX512_BF16 (AMX's tiles are not measured).
[[gnu::noinline]] inline double bf16_dot_loop_gflops(long iterations) {
#if defined(__AVX512BF16__)
  using vec = __m512;
  auto dot = [](vec c, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(c, a, b); };
  auto set = [](float v) { return _mm512_set1_ps(v); };
  auto sum = [](vec v) { return _mm512_reduce_add_ps(v); };
  vec c0 = set(1.000f), c1 = set(1.001f), c2 = set(1.002f), c3 = set(1.003f), c4 = set(1.004f), c5 = set(1.005f),
      c6 = set(1.006f), c7 = set(1.007f), c8 = set(1.008f), c9 = set(1.009f), c10 = set(1.010f), c11 = set(1.011f),
      c12 = set(1.012f), c13 = set(1.013f), c14 = set(1.014f), c15 = set(1.015f);
  const __m512bh a = _mm512_cvtne2ps_pbh(set(1e-7f), set(1e-7f)), b = _mm512_cvtne2ps_pbh(set(0.5f), set(0.5f));
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iterations; ++it) {
    c0 = dot(c0, a, b), c1 = dot(c1, a, b), c2 = dot(c2, a, b), c3 = dot(c3, a, b), c4 = dot(c4, a, b);
    c5 = dot(c5, a, b), c6 = dot(c6, a, b), c7 = dot(c7, a, b), c8 = dot(c8, a, b), c9 = dot(c9, a, b);
    c10 = dot(c10, a, b), c11 = dot(c11, a, b), c12 = dot(c12, a, b), c13 = dot(c13, a, b), c14 = dot(c14, a, b);
    c15 = dot(c15, a, b);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float keep = sum(c0) + sum(c1) + sum(c2) + sum(c3) + sum(c4) + sum(c5) + sum(c6) + sum(c7) + sum(c8) + sum(c9) +
               sum(c10) + sum(c11) + sum(c12) + sum(c13) + sum(c14) + sum(c15);
  if (keep == 12345.678f) std::puts("");
  return 64.0 * 16 * double(iterations) / seconds * 1e-9;
#else
  (void)iterations;
  return 0;
#endif
}

inline const char* fma_unit_name() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "AVX2+FMA";
#else
  return "scalar";
#endif
}
}  // namespace peak_detail

// The fp32 FMA peak of one core in GFLOP/s as this build can use it,
// measured on every rank of `g` at once (each on its core, as a job runs):
// the best of 5 rounds of 30-60 ms (2^24 iterations: 3.2 GFLOP on AVX2,
// 8.6 on AVX-512), the smallest over the ranks (one counted all_reduce).
// Collective over `g`; about 0.3 s.
inline double measure_fma_peak(const gshard::detail::axis_group& g) {
  double best = 0;
  peak_detail::fma_loop_gflops(1 << 20);  // wake the core up
  for (int round = 0; round < 5; ++round) best = std::max(best, peak_detail::fma_loop_gflops(1 << 24));
  return all_reduce(g, best, reduction::min);
}

// The vector unit measure_fma_peak uses: "AVX-512", "AVX2+FMA" or "scalar".
inline const char* fma_unit() { return peak_detail::fma_unit_name(); }

// The bf16 dot-product peak of one core in GFLOP/s (a bf16 product and its
// fp32 sum count 2), measured as measure_fma_peak is, on AVX512_BF16's
// vdpbf16ps; 0 where this build does not target AVX512_BF16 (then no
// bf16 peak is known, and bf16 GEMMs are measured against the fp32 one).
// Collective over `g`.
inline double measure_bf16_peak(const gshard::detail::axis_group& g) {
  double best = 0;
  peak_detail::bf16_dot_loop_gflops(1 << 20);
  for (int round = 0; round < 5; ++round) best = std::max(best, peak_detail::bf16_dot_loop_gflops(1 << 23));
  return all_reduce(g, best, reduction::min);
}

}  // namespace

}  // namespace gshard
