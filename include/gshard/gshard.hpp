// gshard/gshard.hpp — the whole library: meshes, shardings, sharded tensors,
// collectives, resharding and einsum. Each piece also compiles on its own.
#pragma once

#include "gshard/collectives.hpp"
#include "gshard/counters.hpp"
#include "gshard/einsum.hpp"
#include "gshard/error.hpp"
#include "gshard/fixed_string.hpp"
#include "gshard/mesh.hpp"
#include "gshard/mpi.hpp"
#include "gshard/reshard.hpp"
#include "gshard/reshard_plan.hpp"
#include "gshard/sharding.hpp"
#include "gshard/tensor.hpp"
