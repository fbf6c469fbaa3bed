// examples/meshes.hpp — the mesh the examples run on, chosen by the world
// size, so one binary serves any mpirun -np: (data, expert, model) of sizes
// (1,P,1) for P = 1, 2 and odd P, (2,P/2,1) for other even P, and (2,2,2)
// at 8 ranks: the batch over data × expert, experts over expert, and
// attention heads and dense FFN hidden units over model. Extents that do not
// divide by their axes are sharded by gshard's rule (docs/02_sharding.md):
// 8 experts on 3 ranks hold 3, 3 and 2. The axis sizes are bound at run
// time, so the model is compiled once, for one mesh type (a second type
// would compile it twice: docs/10_performance.md, "Compile time"); an axis
// of size 1 moves no data: its collectives are local copies at most.
#pragma once

#include <gshard/core/error.hpp>
#include <gshard/runtime/mesh.hpp>

namespace examples {
using mesh3 = gshard::mesh<gshard::axis<"data">, gshard::axis<"expert">, gshard::axis<"model">>;

// f(mesh) on the mesh for MPI_COMM_WORLD's size.
template <class F>
decltype(auto) on_fitting_mesh(F&& f) {
  int P = 0;
  gshard::mpi::check(MPI_Comm_size(MPI_COMM_WORLD, &P), "MPI_Comm_size");
  const int model = P == 8 ? 2 : 1;
  const int data = P == 8 || (P % 2 == 0 && P > 2) ? 2 : 1;
  const mesh3 m(MPI_COMM_WORLD, {data, P / (data * model), model});
  return f(m);
}
}  // namespace examples
