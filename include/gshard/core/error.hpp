// gshard/core/error.hpp — the exceptions gshard throws for misuse found at run time.
// Every check that can throw runs on values all ranks agree on (global shapes,
// world size), so every rank throws the same error at the same point.
#pragma once

#include <stdexcept>
#include <string>

namespace gshard {

// Base of every gshard exception; what() starts with "gshard::<entity>:".
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Sizes that do not fit: a split dim not divisible by its axes, extents that
// differ from what an operation expects, a local shard of the wrong shape.
class shape_error : public error {
 public:
  using error::error;
};

// A mesh that does not fit its communicator, or no compile-time mesh that fits.
class mesh_error : public error {
 public:
  using error::error;
};

// A file that could not be read or written: names the path and the OS's reason.
class io_error : public error {
 public:
  using error::error;
};

// An MPI call that returned an error code.
class mpi_error : public error {
 public:
  using error::error;
};

}  // namespace gshard
