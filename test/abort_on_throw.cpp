// One rank throws in the middle of a collective sequence; the others are
// already waiting in a collective. gshard::mpi::environment must end the
// whole job with the rank and message printed, never hang.
#include <gshard/gshard.hpp>

#include <vector>

int main(int argc, char** argv) {
  gshard::mpi::environment env(argc, argv);
  gshard::mesh<gshard::axis<"x">> m(MPI_COMM_WORLD);
  std::vector<double> v(4, 1.0);
  gshard::all_reduce<double>(m.group<"x">(), v);
  const int victim = m.nranks() - 1;
  if (m.rank() == victim) throw gshard::shape_error("gshard::test: deliberate failure on the last rank");
  gshard::all_reduce<double>(m.group<"x">(), v);  // the others wait here for the victim
  gshard::all_reduce<double>(m.group<"x">(), v);
  return 0;
}
