// examples/meshes.hpp — the meshes the examples run on, chosen by the world
// size, so one binary serves mpirun -np 1, 2, 4 and 8: (data, expert) of
// sizes (1,1), (1,2), (2,2), and at 8 ranks a 3-D mesh (2,2,2): the batch
// over data × expert, experts over expert, and attention heads and dense FFN
// hidden units over model. The axis sizes are bound at run time (one mesh
// type for 1, 2 and 4 ranks: the model is compiled twice, not four times).
#pragma once

#include <gshard/core/error.hpp>
#include <gshard/runtime/mesh.hpp>

#include <string>

namespace examples {
using mesh2 = gshard::mesh<gshard::axis<"data">, gshard::axis<"expert">>;
using mesh3 = gshard::mesh<gshard::axis<"data">, gshard::axis<"expert">, gshard::axis<"model">>;

// f(mesh) on the mesh that fits MPI_COMM_WORLD; gshard::mesh_error on every
// rank for another world size.
template <class F>
decltype(auto) on_fitting_mesh(F&& f) {
  int P = 0;
  gshard::mpi::check(MPI_Comm_size(MPI_COMM_WORLD, &P), "MPI_Comm_size");
  if (P == 8) {
    const mesh3 m(MPI_COMM_WORLD, {2, 2, 2});
    return f(m);
  }
  if (P != 1 && P != 2 && P != 4)
    throw gshard::mesh_error("gshard example: no mesh fits " + std::to_string(P) +
                             " ranks; this program supports 1, 2, 4 or 8");
  const mesh2 m(MPI_COMM_WORLD, {P == 4 ? 2 : 1, P == 4 ? 2 : P});
  return f(m);
}
}  // namespace examples
