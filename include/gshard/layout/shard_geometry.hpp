// gshard/layout/shard_geometry.hpp — where a shard lives: how many parts a
// dim is cut into and which block of it a rank holds. The one place that
// says it: everything that needs a local extent or a global offset
// (distribute, reshard, einsum, checkpoints, printing, the cost model) asks
// the functions here. Knows nothing of MPI.
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

// The rule for a dim that does not divide (GSPMD's): a block of `len` cut
// into `parts` pieces holds pieces of ceil(len / parts), the last ones short
// or empty. Piece j of them:
constexpr block piece_of(index_t len, index_t parts, index_t j) {
  const index_t c = (len + parts - 1) / parts;
  const index_t off = j * c < len ? j * c : len;
  return {off, len - off < c ? len - off : c};
}
// The longest piece: the size every piece travels at in a collective, the
// short ones padded with zeros.
constexpr index_t piece_capacity(index_t len, index_t parts) { return (len + parts - 1) / parts; }

// The slice of dim d (global extent `global`) held by the rank at `coords`.
// A dim split over axes (a, b) is cut over a by the rule above, then each
// block over b: so every reshard step, which moves one axis at a dim's
// minor end, stays within the blocks of the axes before it (a flat
// ceil(n / (|a| |b|)) would not: 10 over 2 x 3 would need element 5 of the
// second half on a rank of the first). Where every level divides, the block
// index is the row-major composite of the coordinates and every block equal.
constexpr block dim_block(const rlayout& l, int d, index_t global, const index_t* axis_sizes, const index_t* coords) {
  block b{0, global};
  for (int i = 0; i < l.dims[d].n; ++i) {
    const int a = l.dims[d].ax[i];
    const block p = piece_of(b.extent, axis_sizes[a], coords[a]);
    b = {b.offset + p.offset, p.extent};
  }
  return b;
}

// Whether dim d's blocks are all equal: every level of the rule divides.
constexpr bool dim_even(const rlayout& l, int d, index_t global, const index_t* axis_sizes) {
  for (int i = 0; i < l.dims[d].n; ++i) {
    const index_t p = axis_sizes[l.dims[d].ax[i]];
    if (global % p != 0) return false;
    global /= p;
  }
  return true;
}
// The largest block of dim d (the one at coordinate 0 of every axis).
constexpr index_t max_block(const rlayout& l, int d, index_t global, const index_t* axis_sizes) {
  for (int i = 0; i < l.dims[d].n; ++i) global = piece_capacity(global, axis_sizes[l.dims[d].ax[i]]);
  return global;
}

// Whether pred(coords) holds for the coordinates of every block of dim d:
// every combination of the axes splitting it (the other axes at 0).
template <class Pred>
constexpr bool every_block(const rlayout& l, int d, const index_t* axis_sizes, Pred pred) {
  index_t coords[max_mesh_axes]{};
  for (;;) {
    if (!pred(static_cast<const index_t*>(coords))) return false;
    int i = l.dims[d].n - 1;  // the next combination, the minor axis fastest
    for (; i >= 0; --i) {
      const int a = l.dims[d].ax[i];
      if (++coords[a] < axis_sizes[a]) break;
      coords[a] = 0;
    }
    if (i < 0) return true;
  }
}

// Two batches held block by block in one (micro-batches): whether every
// rank's block of dim d at global extent `first` + `second` is its block at
// `first` followed by its block at `second`, so that each rank cuts or
// joins its own rows and nothing moves. Not every pair does: over 2 ranks
// the blocks of 1 row are [1, 0] and of 2 rows [1, 1]. The halves of every
// block do for a dim split over one axis; over several, not always when it
// does not divide.
constexpr bool blocks_add_up(const rlayout& l, int d, index_t first, index_t second, const index_t* axis_sizes) {
  return every_block(l, d, axis_sizes, [&](const index_t* c) {
    return dim_block(l, d, first, axis_sizes, c).extent + dim_block(l, d, second, axis_sizes, c).extent ==
           dim_block(l, d, first + second, axis_sizes, c).extent;
  });
}

// Where to cut every rank's block of dim d (global extent n) in two for
// two micro-batches whose blocks_add_up: the first's global extent, the
// nearest to the sum of the blocks' halves (rounded up) that the rule
// allows, or 0 when no cut leaves both non-empty.
constexpr index_t halve_blocks(const rlayout& l, int d, index_t n, const index_t* axis_sizes) {
  index_t halves = 0;
  every_block(l, d, axis_sizes, [&](const index_t* c) {
    halves += (dim_block(l, d, n, axis_sizes, c).extent + 1) / 2;
    return true;
  });
  for (index_t step = 0; step < n; ++step)  // halves, then halves ∓ 1, halves ± 2, ...
    for (const index_t a : {halves - step, halves + step})
      if (a >= 1 && a <= n - 1 && blocks_add_up(l, d, a, n - a, axis_sizes)) return a;
  return 0;
}

}  // namespace gshard::detail
