// gshard/types.hpp — the basic types and limits every header shares: the
// index type, how many dims a sharding can describe and how many axes a mesh
// can have, and GSHARD_NOINLINE for the shared run-time paths that would
// otherwise be inlined into every instantiation of a typed wrapper (one copy
// of an executor per element type and rank, not per sharding or plan).
#pragma once

#include <cstddef>

namespace gshard {

using index_t = std::ptrdiff_t;

inline constexpr int max_rank = 8;        // tensor dims a sharding can describe
inline constexpr int max_mesh_axes = 6;   // axes a mesh can have

}  // namespace gshard

#if defined(__GNUC__)
#define GSHARD_NOINLINE __attribute__((noinline))
#else
#define GSHARD_NOINLINE
#endif
