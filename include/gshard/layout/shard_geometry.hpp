// gshard/layout/shard_geometry.hpp — where a shard lives: how many parts a
// dim is cut into and which block of it a rank holds. The one place that
// says it: everything that needs a local extent or a global offset
// (distribute, reshard, einsum, checkpoints, printing, the cost model) asks
// these two functions. Knows nothing of MPI.
#pragma once

#include "gshard/layout/rlayout.hpp"
#include "gshard/core/types.hpp"

namespace gshard::detail {

// Number of shards of dim d: the product of the sizes of the axes splitting it.
constexpr index_t dim_parts(const rlayout& l, int d, const index_t* axis_sizes) {
  index_t p = 1;
  for (int i = 0; i < l.dims[d].n; ++i) p *= axis_sizes[l.dims[d].ax[i]];
  return p;
}

struct block {
  index_t offset;
  index_t extent;
};

// The slice of dim d (global extent `global`) held by the rank at `coords`:
// block index = row-major composite of its coordinates on the splitting axes.
constexpr block dim_block(const rlayout& l, int d, index_t global, const index_t* axis_sizes, const index_t* coords) {
  index_t idx = 0, parts = 1;
  for (int i = 0; i < l.dims[d].n; ++i) {
    const int a = l.dims[d].ax[i];
    idx = idx * axis_sizes[a] + coords[a];
    parts *= axis_sizes[a];
  }
  const index_t extent = global / parts;
  return {idx * extent, extent};
}

}  // namespace gshard::detail
