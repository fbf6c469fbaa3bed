// examples/reshard_tour.cpp — a tensor f32[G,S,M] moving through shardings on
// the examples' mesh for the world's ranks (examples/meshes.hpp; at 3, 5,
// 6 or 7 ranks G = 8 and M = 16 split into unequal shards), printing each
// step's plan and the collectives it ran. Every step is checked against the global tensor.
//   mpirun -np 4 build/examples/reshard_tour
#include <gshard/gshard.hpp>

#include <cstdio>
#include <iostream>


#include "cli.hpp"
#include "meshes.hpp"
using namespace gshard;

// One binary, four meshes: the first whose size equals the world runs.

using by_group = sharding<split<0, "data", "expert">>;           // [G{data,expert},S,M]
using m_over_expert = sharding<split<0, "data">, split<2, "expert">>;  // [G{data},S,M{expert}]
using pending = sharding<split<0, "data">, partial<"expert">>;   // [G{data},S,M] partial{expert}

template <class Mesh>
int tour(const Mesh& m) {
  const bool root = m.rank() == 0;
  const index_t G = 8, S = 4, M = 16;
  local_tensor<float, 3> global(G, S, M);
  for (index_t i = 0; i < global.size(); ++i) global.data()[i] = float(i % 97);

  if (root) std::cout << "gshard reshard tour on " << m.describe() << "\n\n";
  int bad = 0;
  auto step = [&]<class To>(const auto& x, const char* what) {
    using From = typename std::remove_cvref_t<decltype(x)>::sharding_type;
    if (root) std::cout << what << "\n" << reshard_plan<Mesh, 3, From, To>::template describe<float>(m, x.extents(), "GSM");
    collective_recorder rec;
    auto y = reshard<To>(x);
    const auto events = rec.events();
    // Compare with the global tensor (not counted above).
    const auto full = gather(y);
    for (index_t i = 0; i < full.size(); ++i) bad += full.data()[i] != global.data()[i];
    if (root) {
      std::cout << "  ran:";
      if (events.empty()) std::cout << " nothing (local)";
      for (const auto& e : events) std::cout << " " << to_string(e);
      std::cout << "\n\n";
    }
    return y;
  };

  auto x = distribute<replicate>(m, global);
  auto a = step.template operator()<by_group>(x, "1. replicate -> split G over data and expert: a local slice");
  auto b = step.template operator()<m_over_expert>(a, "2. move 'expert' from G to M: one all_to_all");
  auto c = step.template operator()<replicate>(b, "3. back to replicate: an all_gather per axis");
  auto p = distribute<pending>(m, global);  // summands: coordinate 0 holds the value
  auto d = step.template operator()<m_over_expert>(p, "4. partial{expert} -> split M over expert: one reduce_scatter");
  (void)c;
  (void)d;
  if (root) std::cout << (bad == 0 ? "every step matched the global tensor\n" : "MISMATCH\n");
  return bad == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  mpi::environment env(argc, argv);
  if (!examples::positional(argc, argv, "reshard_tour", {},
                            "usage: mpirun -np P reshard_tour   (any P)\n"
                            "  every kind of reshard on a small tensor, each checked against the global tensor\n"))
    return 0;
  return examples::on_fitting_mesh([](const auto& m) { return tour(m); });
}
