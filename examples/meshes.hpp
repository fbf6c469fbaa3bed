// examples/meshes.hpp — the compile-time meshes the examples can run on; the
// first whose size equals the world is used (with_mesh), so one binary
// serves mpirun -np 1, 2, 4 and 8. At 8 ranks the mesh is 3-D: the batch
// over data × expert, experts over expert, and attention heads and dense
// FFN hidden units over model.
#pragma once

#include <gshard/mesh.hpp>

namespace examples {
using m1 = gshard::mesh<gshard::axis<"data", 1>, gshard::axis<"expert", 1>>;
using m2 = gshard::mesh<gshard::axis<"data", 1>, gshard::axis<"expert", 2>>;
using m4 = gshard::mesh<gshard::axis<"data", 2>, gshard::axis<"expert", 2>>;
using m8 = gshard::mesh<gshard::axis<"data", 2>, gshard::axis<"expert", 2>, gshard::axis<"model", 2>>;

// f(mesh) on the mesh that fits MPI_COMM_WORLD.
template <class F>
decltype(auto) on_fitting_mesh(F&& f) {
  return gshard::with_mesh<m1, m2, m4, m8>(MPI_COMM_WORLD, std::forward<F>(f));
}
}  // namespace examples
