// gshard/detail/softmax_row.hpp — the softmax of one row, the one kernel
// behind softmax() (ops.hpp), the router's gates (moe/gating.hpp) and the
// cross-entropy's gradient (ad/nn.hpp).
#pragma once

#include <cmath>
#include <limits>

#include "gshard/types.hpp"

namespace gshard::detail {

// out = softmax(in) over n > 0 entries, shifted by the largest for
// stability (in may be out). Entries of -inf get 0. Returns the log of the
// partition function, log Σ exp(in), in double. The caller decides what NaN,
// +inf or a row of only -inf mean.
template <class T>
double softmax_row(const T* in, index_t n, T* out) {
  T mx = -std::numeric_limits<T>::infinity();
  for (index_t i = 0; i < n; ++i) mx = in[i] > mx ? in[i] : mx;
  T sum = 0;
  for (index_t i = 0; i < n; ++i) sum += (out[i] = std::exp(in[i] - mx));
  for (index_t i = 0; i < n; ++i) out[i] /= sum;
  return double(mx) + std::log(double(sum));
}

}  // namespace gshard::detail
