// gshard/gshard.hpp — the whole public library. Each header also compiles on
// its own; include the narrow ones to compile less:
//   the core        mesh, sharding, labels (rules), roles, tensor, collectives,
//                   reshard, einsum, counters, trace, error, types, random
//   the run         environment (MPI start-up), preemption (SIGTERM/SIGINT),
//                   peak (the measured FMA peak of a core),
//                   trace_file (writing a trace), io (files, with reasons)
//   training        ad/parameters, ad/tape, ad/ops, ad/nn (the tape and its
//                   operations), grad (the per-op gradient rules), ops, optim,
//                   checkpoint
//   the MoE layer   moe/gating, moe/dispatch, moe/layer
//   the model       model/transformer, model/train
#pragma once

#include "gshard/attention.hpp"
#include "gshard/buckets.hpp"
#include "gshard/collectives.hpp"
#include "gshard/counters.hpp"
#include "gshard/einsum.hpp"
#include "gshard/einsum_plan.hpp"
#include "gshard/environment.hpp"
#include "gshard/error.hpp"
#include "gshard/fixed_string.hpp"
#include "gshard/io.hpp"
#include "gshard/labels.hpp"
#include "gshard/mesh.hpp"
#include "gshard/mpi.hpp"
#include "gshard/nonblocking.hpp"
#include "gshard/notation.hpp"
#include "gshard/peak.hpp"
#include "gshard/preemption.hpp"
#include "gshard/random.hpp"
#include "gshard/reduce.hpp"
#include "gshard/reshard.hpp"
#include "gshard/reshard_plan.hpp"
#include "gshard/reshard_steps.hpp"
#include "gshard/roles.hpp"
#include "gshard/sharding.hpp"
#include "gshard/tensor.hpp"
#include "gshard/tensor_collectives.hpp"
#include "gshard/trace_file.hpp"
#include "gshard/types.hpp"

#include "gshard/ad/nn.hpp"
#include "gshard/ad/ops.hpp"
#include "gshard/ad/parameters.hpp"
#include "gshard/ad/remat.hpp"
#include "gshard/ad/tape.hpp"
#include "gshard/ad/var.hpp"
#include "gshard/checkpoint.hpp"
#include "gshard/grad.hpp"
#include "gshard/ops.hpp"
#include "gshard/optim.hpp"

#include "gshard/moe/dispatch.hpp"
#include "gshard/moe/gating.hpp"
#include "gshard/moe/layer.hpp"
#include "gshard/moe/metrics.hpp"

#include "gshard/model/cost.hpp"
#include "gshard/model/machine.hpp"
#include "gshard/model/train.hpp"
#include "gshard/model/transformer.hpp"
