// test/pmpi.cpp — MPI's communication calls intercepted through the
// profiling interface for train_tests (test/pmpi.hpp). Point-to-point,
// collective, one-sided-free: every call gshard might make to move data or
// synchronise. Communicator creation (MPI_Comm_split, _dup) is set-up, done
// when a mesh is bound, and is listed so a test can see none happens inside
// a step.
#include "pmpi.hpp"

#include <gshard/core/counters.hpp>
#include <gshard/runtime/mpi.hpp>

namespace gshard::testing::pmpi {
log& the_log() {
  static log l;
  return l;
}
}  // namespace gshard::testing::pmpi

namespace {
void seen(const char* fn) {
  auto& l = gshard::testing::pmpi::the_log();
  if (!l.on) return;
  ++l.calls[fn];
  if (!gshard::inside_counted_collective()) l.uncounted.push_back(fn);
}
}  // namespace

extern "C" {
int MPI_Barrier(MPI_Comm c) { return seen("MPI_Barrier"), PMPI_Barrier(c); }
int MPI_Bcast(void* b, int n, MPI_Datatype t, int root, MPI_Comm c) { return seen("MPI_Bcast"), PMPI_Bcast(b, n, t, root, c); }
int MPI_Allreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  return seen("MPI_Allreduce"), PMPI_Allreduce(s, r, n, t, op, c);
}
int MPI_Reduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, int root, MPI_Comm c) {
  return seen("MPI_Reduce"), PMPI_Reduce(s, r, n, t, op, root, c);
}
int MPI_Allgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, MPI_Comm c) {
  return seen("MPI_Allgather"), PMPI_Allgather(s, sn, st, r, rn, rt, c);
}
int MPI_Allgatherv(const void* s, int sn, MPI_Datatype st, void* r, const int* rn, const int* d, MPI_Datatype rt, MPI_Comm c) {
  return seen("MPI_Allgatherv"), PMPI_Allgatherv(s, sn, st, r, rn, d, rt, c);
}
int MPI_Gather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, int root, MPI_Comm c) {
  return seen("MPI_Gather"), PMPI_Gather(s, sn, st, r, rn, rt, root, c);
}
int MPI_Gatherv(const void* s, int sn, MPI_Datatype st, void* r, const int* rn, const int* d, MPI_Datatype rt, int root,
                MPI_Comm c) {
  return seen("MPI_Gatherv"), PMPI_Gatherv(s, sn, st, r, rn, d, rt, root, c);
}
int MPI_Scatter(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, int root, MPI_Comm c) {
  return seen("MPI_Scatter"), PMPI_Scatter(s, sn, st, r, rn, rt, root, c);
}
int MPI_Scatterv(const void* s, const int* sn, const int* d, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, int root,
                 MPI_Comm c) {
  return seen("MPI_Scatterv"), PMPI_Scatterv(s, sn, d, st, r, rn, rt, root, c);
}
int MPI_Alltoall(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, MPI_Comm c) {
  return seen("MPI_Alltoall"), PMPI_Alltoall(s, sn, st, r, rn, rt, c);
}
int MPI_Alltoallv(const void* s, const int* sn, const int* sd, MPI_Datatype st, void* r, const int* rn, const int* rd,
                  MPI_Datatype rt, MPI_Comm c) {
  return seen("MPI_Alltoallv"), PMPI_Alltoallv(s, sn, sd, st, r, rn, rd, rt, c);
}
int MPI_Reduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  return seen("MPI_Reduce_scatter_block"), PMPI_Reduce_scatter_block(s, r, n, t, op, c);
}
int MPI_Reduce_scatter(const void* s, void* r, const int* n, MPI_Datatype t, MPI_Op op, MPI_Comm c) {
  return seen("MPI_Reduce_scatter"), PMPI_Reduce_scatter(s, r, n, t, op, c);
}
int MPI_Sendrecv(const void* s, int sn, MPI_Datatype st, int dest, int stag, void* r, int rn, MPI_Datatype rt, int source,
                 int rtag, MPI_Comm c, MPI_Status* status) {
  return seen("MPI_Sendrecv"), PMPI_Sendrecv(s, sn, st, dest, stag, r, rn, rt, source, rtag, c, status);
}
int MPI_Send(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c) {
  return seen("MPI_Send"), PMPI_Send(b, n, t, dest, tag, c);
}
int MPI_Recv(void* b, int n, MPI_Datatype t, int source, int tag, MPI_Comm c, MPI_Status* s) {
  return seen("MPI_Recv"), PMPI_Recv(b, n, t, source, tag, c, s);
}
int MPI_Isend(const void* b, int n, MPI_Datatype t, int dest, int tag, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Isend"), PMPI_Isend(b, n, t, dest, tag, c, q);
}
int MPI_Irecv(void* b, int n, MPI_Datatype t, int source, int tag, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Irecv"), PMPI_Irecv(b, n, t, source, tag, c, q);
}
int MPI_Iallreduce(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Iallreduce"), PMPI_Iallreduce(s, r, n, t, op, c, q);
}
int MPI_Iallgather(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Iallgather"), PMPI_Iallgather(s, sn, st, r, rn, rt, c, q);
}
int MPI_Ialltoall(const void* s, int sn, MPI_Datatype st, void* r, int rn, MPI_Datatype rt, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Ialltoall"), PMPI_Ialltoall(s, sn, st, r, rn, rt, c, q);
}
int MPI_Ireduce_scatter_block(const void* s, void* r, int n, MPI_Datatype t, MPI_Op op, MPI_Comm c, MPI_Request* q) {
  return seen("MPI_Ireduce_scatter_block"), PMPI_Ireduce_scatter_block(s, r, n, t, op, c, q);
}
int MPI_Test(MPI_Request* q, int* flag, MPI_Status* st) { return seen("MPI_Test"), PMPI_Test(q, flag, st); }
int MPI_Testall(int n, MPI_Request* q, int* flag, MPI_Status* st) { return seen("MPI_Testall"), PMPI_Testall(n, q, flag, st); }
int MPI_Wait(MPI_Request* q, MPI_Status* st) { return seen("MPI_Wait"), PMPI_Wait(q, st); }
int MPI_Waitall(int n, MPI_Request* q, MPI_Status* st) { return seen("MPI_Waitall"), PMPI_Waitall(n, q, st); }
int MPI_Comm_split(MPI_Comm c, int color, int key, MPI_Comm* out) {
  return seen("MPI_Comm_split"), PMPI_Comm_split(c, color, key, out);
}
int MPI_Comm_dup(MPI_Comm c, MPI_Comm* out) { return seen("MPI_Comm_dup"), PMPI_Comm_dup(c, out); }
}
