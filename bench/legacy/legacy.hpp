// bench/legacy/legacy.hpp — the hand-written MoE Transformer backward as it
// stood before the autodiff rewrite (commit eaec8ac), frozen in namespace
// legacy so that bench_train can time it against the forward-only model in
// the same run. Not part of the library; deleted once the comparison is
// recorded in docs/10_performance.md.
#pragma once
#include "model_train.hpp"
