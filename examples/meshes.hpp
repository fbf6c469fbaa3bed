// examples/meshes.hpp — the meshes the examples run on, chosen by the world
// size, so one binary serves any mpirun -np: (data, expert) of sizes (1,P)
// for P = 1, 2 and odd P, (2,P/2) for other even P, and at 8 ranks a 3-D
// mesh (2,2,2): the batch over data × expert, experts over expert, and
// attention heads and dense FFN hidden units over model. Extents that do not
// divide by their axes are sharded by gshard's rule (docs/02_sharding.md):
// 8 experts on 3 ranks hold 3, 3 and 2. The axis sizes are bound at run
// time (one mesh type for every P but 8: the model is compiled twice).
#pragma once

#include <gshard/core/error.hpp>
#include <gshard/runtime/mesh.hpp>

namespace examples {
using mesh2 = gshard::mesh<gshard::axis<"data">, gshard::axis<"expert">>;
using mesh3 = gshard::mesh<gshard::axis<"data">, gshard::axis<"expert">, gshard::axis<"model">>;

// f(mesh) on the mesh for MPI_COMM_WORLD's size.
template <class F>
decltype(auto) on_fitting_mesh(F&& f) {
  int P = 0;
  gshard::mpi::check(MPI_Comm_size(MPI_COMM_WORLD, &P), "MPI_Comm_size");
  if (P == 8) {
    const mesh3 m(MPI_COMM_WORLD, {2, 2, 2});
    return f(m);
  }
  const int data = P % 2 == 0 && P > 2 ? 2 : 1;
  const mesh2 m(MPI_COMM_WORLD, {data, P / data});
  return f(m);
}
}  // namespace examples
