// Faults that must end the whole job with a message, never hang:
//   throw      one rank throws while the others already wait in a collective;
//   bad_shard  one rank builds a tensor from a local shard of the wrong extents.
#include <gshard/gshard.hpp>

#include <string_view>
#include <vector>

int main(int argc, char** argv) {
  gshard::mpi::environment env(argc, argv);
  const std::string_view mode = argc > 1 ? argv[1] : "throw";
  gshard::mesh<gshard::axis<"x">> m(MPI_COMM_WORLD);
  std::vector<double> v(4, 1.0);
  gshard::all_reduce<double>(m.group<"x">(), v);
  const int victim = m.nranks() - 1;
  if (mode == "throw" && m.rank() == victim) throw gshard::shape_error("gshard::test: deliberate failure on the last rank");
  if (mode == "bad_shard") {
    using rows = gshard::sharding<gshard::split<0, "x">>;
    const gshard::index_t rows_here = m.rank() == victim ? 3 : 2;
    gshard::tensor<double, 2, gshard::mesh<gshard::axis<"x">>, rows> t(m, {2 * m.nranks(), 4},
                                                                        gshard::local_tensor<double, 2>(rows_here, 4));
  }
  gshard::all_reduce<double>(m.group<"x">(), v);  // the others wait here for the victim
  gshard::all_reduce<double>(m.group<"x">(), v);
  return 0;
}
