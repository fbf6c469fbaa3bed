// test/consumer/consumer.cpp — a user's program against the installed
// gshard, built three ways by test/check_consumers.py (pkg-config, CMake's
// find_package, a Meson subproject): a matrix product with the rows split
// over every rank, checked against the same product on one rank, and a
// vector split over the ranks gathered again.
#include <gshard/tensor/einsum.hpp>
#include <gshard/runtime/environment.hpp>
#include <gshard/tensor/reshard.hpp>
#include <gshard/tensor/tensor_collectives.hpp>

#include <cmath>
#include <iostream>

using namespace gshard;
using rows = mesh<axis<"rows">>;  // as many ranks as the world has

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  const rows m(MPI_COMM_WORLD);
  const index_t B = 4 * m.nranks(), K = 8, N = 3;
  local_tensor<double, 2> x(B, K), w(K, N);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = double(i % 7) - 3;
  for (index_t i = 0; i < w.size(); ++i) w.data()[i] = double(i % 5) * 0.5;
  const auto xs = distribute<sharding<split<0, "rows">>>(m, x);  // B over the ranks
  const auto ws = distribute<replicate>(m, w);
  const auto y = gather(einsum<"BK,KN->BN">(xs, ws));            // no collective until the gather
  double worst = 0;
  for (index_t b = 0; b < B; ++b)
    for (index_t n = 0; n < N; ++n) {
      double ref = 0;
      for (index_t k = 0; k < K; ++k) ref += x(b, k) * w(k, n);
      worst = std::max(worst, std::abs(y(b, n) - ref));
    }
  local_tensor<double, 1> v(B);
  for (index_t i = 0; i < B; ++i) v(i) = double(i);
  const auto vg = gather(reshard<replicate>(distribute<sharding<split<0, "rows">>>(m, v)));  // an all_gather
  for (index_t i = 0; i < B; ++i) worst = std::max(worst, std::abs(vg(i) - v(i)));
  if (m.rank() == 0) std::cout << (worst < 1e-12 ? "consumer ok" : "consumer WRONG") << " on " << m.describe() << "\n";
  return worst < 1e-12 ? 0 : 1;
}
